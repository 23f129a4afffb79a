"""Engine ``vectorized``: H-SGD with every client of an edge round as one batched computation.

The algorithm is :class:`fedhier.round.loop.HierarchicalSGD`, the one every engine runs (plan,
screen, aggregate, broadcast, cloud step, records, checkpoints); this engine only supplies
its executor, :class:`BatchedExecutor`, which trains all clients at once with the kernels of
:mod:`fedhier.engines.vectorized.kernels` (chunks of ``client_chunk`` clients change no bit;
convolutional models on the CPU instead loop over clients, :func:`client_loop_training`), decides
injected failures with the same :class:`fedhier.round.faults.FaultModel` the ClientApp consults,
keeps the clients' momentum buffers as ``[n, *shape]`` tensors, and evaluates the global model on
every client's rows directly. The host waits for the device once per edge round (the NaN
screen) and once per cloud round for the metrics.
"""


from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedhier.common.errors import ConfigError
from fedhier.data.federation import Federation
from fedhier.diagnostics.in_rounds import direct_client_gradients
from fedhier.engines.round_for import round_for
from fedhier.engines.vectorized.chunked_eval import client_metrics
from fedhier.engines.vectorized.conv_kernels import conv_chain_training, forward_for
from fedhier.engines.vectorized.kernels import (
    ClientRows,
    EdgeRoundBatches,
    LocalTraining,
    local_training_for,
)
from fedhier.local.models import conv_chain
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.quantization import quantize_updates
from fedhier.local.train import (
    Forward,
    evaluate,
    local_sgd,
    params_of,
    resolve_device,
)
from fedhier.round.faults import FaultModel
from fedhier.round.loop import ClientEvaluation, EdgeRoundWork, TrainResult
from fedhier.runs.checkpoint import Checkpoint
from fedhier.runs.driver import run_recorded
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import (
    central_evaluation,
    initial_model,
    prepare,
)
from fedhier.runs.recorder import RunRecorder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo

Params = dict[str, torch.Tensor]
#: (cfg, federation, model, device) -> the executor of a vectorized run.
ExecutorFactory = Callable[[RunConfig, Federation, nn.Module, torch.device], "BatchedExecutor"]

#: Largest minibatch-index block precomputed at once (entries, int32: 2**22 = 16 MiB); one
#: cloud round is always computed whole ([G, n, width]: 128 MiB for W1 at 100,000 clients).
INDEX_BLOCK_ENTRIES = 2**22
#: Parameters per chunk (bytes) with ``client_chunk`` 0 on a CPU: a chunk's models then stay in
#: the cache through its I local steps instead of streaming from memory at every step (W1,
#: 37.5 KiB models: chunks of 25-100 clients 1.2-1.4x faster than all 1,000 at once; see
#: docs/engines.md). Chunks of >= 2 clients give bit-for-bit the results of one chunk.
CHUNK_BYTES = 2 * 2**20


# ------------------------------------------------------------------------------ local steps
def has_convolutions(model: nn.Module) -> bool:
    """Whether ``model`` has a convolution layer (``cnn``)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def client_loop_training(model: nn.Module) -> LocalTraining:
    """Local training one client after another with :func:`fedhier.local.train.local_sgd` (the
    ClientApp's own local step: a private copy of the model, ``backward``, the optimizer rule),
    reading each client's mini-batches from the gathered batches and writing its result into
    the ``[c, *shape]`` tensors.

    Used for convolutional models on the CPU: there ``vmap`` turns the clients' convolutions
    into one grouped convolution, which runs about 3x slower per client than the ungrouped
    kernel this loop uses (docs/engines.md, W2); batching buys nothing for models whose every
    client step is already a few MFLOP of convolution.
    """

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        steps = len(lrs)
        total = torch.zeros(len(batches.batch), dtype=torch.float64, device=batches.x.device)
        new_buffers: Params | None = None
        rates = np.asarray(lrs, dtype=np.float64)
        for j, b in enumerate(int(b) for b in batches.batch):
            x = batches.x[:, j, :b].reshape(steps * b, *batches.x.shape[3:])
            y = batches.y[:, j, :b].reshape(steps * b)
            new, mean_loss, client_buffers = local_sgd(
                model, {k: v[j] for k, v in params.items()}, x, y, lr=rates,
                indices=np.arange(steps * b).reshape(steps, b), optimizer=optimizer,
                buffers=None if buffers is None else {k: v[j] for k, v in buffers.items()})
            with torch.no_grad():
                for key, value in new.items():
                    params[key][j].copy_(value)
                if client_buffers is not None:
                    if new_buffers is None:
                        new_buffers = {k: torch.empty_like(v) for k, v in params.items()}
                    for key, value in client_buffers.items():
                        new_buffers[key][j].copy_(value)
            total[j] = mean_loss * steps
        return total, new_buffers

    return train


def training_for(model: nn.Module, device: torch.device) -> LocalTraining:
    """The local training of ``model`` on ``device``. On the CPU: conv chains (``cnn``,
    ``lenet5``) batched as grouped convolutions
    (:func:`fedhier.engines.vectorized.conv_kernels.conv_chain_training`), other convolutional
    models a client loop (:func:`client_loop_training`); elsewhere, and for every other model,
    :func:`local_training_for` (hand-batched Linear/ReLU chains, ``vmap`` for the rest)."""
    if device.type == "cpu" and has_convolutions(model):
        chain = conv_chain(model)
        return client_loop_training(model) if chain is None else conv_chain_training(chain)
    return local_training_for(model)


# ------------------------------------------------------------------------------ the executor
@dataclass
class BatchedExecutor:
    """:class:`fedhier.round.loop.Executor` that trains every client of an edge round as one
    batched computation (chunks of ``client_chunk`` clients), on ``device``."""

    cfg: RunConfig
    model: nn.Module
    fed: Federation
    data: ClientRows
    train_fn: LocalTraining
    device: torch.device
    optimizer: LocalOptimizer = dataclasses.field(default_factory=LocalOptimizer)
    faults: FaultModel = dataclasses.field(default_factory=FaultModel)
    buffers: Params = dataclasses.field(default_factory=dict)  # clients' params [n, *shape]
    momentum: Params = dataclasses.field(default_factory=dict)  # kept buffers [n, *shape]
    next_momentum: Params = dataclasses.field(default_factory=dict)  # being filled
    _rows: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # by cloud round
    #: int64 [n]: the clients' ids in the whole federation when this executor runs a shard
    #: of it (fault draws are keyed by them); None = client j is client j.
    client_ids: np.ndarray | None = None
    #: (params, rows) -> logits for evaluating one model, None = the model's own forward
    #: (``fedhier.engines.vectorized.conv_kernels.forward_for``).
    forward: Forward | None = None

    @classmethod
    def build(cls, cfg: RunConfig, fed: Federation, model: nn.Module,
              device: torch.device) -> BatchedExecutor:
        return cls(cfg=cfg, model=model, fed=fed,
                   data=ClientRows.build(fed, cfg.batch_size, device),
                   train_fn=training_for(model, device), device=device,
                   optimizer=cfg.local_optimizer(), faults=cfg.faults(),
                   forward=forward_for(model, device))

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """[lo, hi) client ranges of :meth:`chunk_size` clients.

        A trailing chunk of a single client joins the previous one: torch runs a batch of one
        matrix product through a different CPU kernel (float32 rounding differs in the last
        bit), and chunking is meant to leave results bit-for-bit unchanged.
        """
        n = self.data.num_clients
        size = self.chunk_size()
        bounds = list(range(0, n, size)) + [n]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and size > 1:
            del bounds[-2]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def chunk_size(self) -> int:
        """``client_chunk``, or for 0 (auto): on the CPU as many clients as hold
        :data:`CHUNK_BYTES` of parameters (at least 2), elsewhere all of them."""
        if self.cfg.client_chunk > 0:
            return self.cfg.client_chunk
        n = self.data.num_clients
        if self.device.type != "cpu":
            return n
        model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return max(2, min(n, CHUNK_BYTES // max(model_bytes, 1)))

    def index_blocks(self) -> int:
        """Cloud rounds whose mini-batch indices are precomputed together (memory-bounded)."""
        per_round = self.cfg.global_period * self.data.num_clients * self.data.width
        return max(1, min(self.cfg.rounds, INDEX_BLOCK_ENTRIES // max(per_round, 1)))


    # ---------------------------------------------------------------- Executor
    def profiles(self) -> ClientInfo:
        """The clients' rows and label histograms (no SuperNodes, so no edge tags)."""
        fed = self.fed
        return ClientInfo(fed.label_histograms, fed.client_sizes(),
                          edge_tags=np.full(fed.num_clients, -1))

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        """Every client's I local steps from its edge's model, in one batched computation;
        the sent clients' rows are returned. A client the fault model fails is not ok."""
        cfg, n = self.cfg, self.data.num_clients
        period = cfg.local_period
        sent = np.zeros(n, dtype=bool)
        sent[work.clients] = True
        trains = sent.copy()
        if self.faults != FaultModel():
            ids = work.clients if self.client_ids is None else self.client_ids[work.clients]
            for client, client_id in zip(work.clients.tolist(), ids.tolist(), strict=True):
                trains[client] = not self.faults.fails(cfg.seed, client_id, work.edge_round,
                                                       work.cloud_round)
        steps = np.full(n, period, dtype=np.int64)  # unsent clients' work is discarded
        steps[work.clients] = work.steps
        edge_of = torch.as_tensor(work.start_edges, device=self.device)
        params = self.start_params(edge_models, edge_of)
        first = work.start_step - (work.cloud_round - 1) * cfg.global_period
        rows = self.minibatch_rows(work.cloud_round)[first:first + period]
        losses = self.local_training(params, rows, cfg.learning_rates(work.start_step, period),
                                     trains, steps, start_step=work.start_step)
        mean_loss = (losses / torch.as_tensor(steps, device=self.device)).cpu().numpy()
        models = params
        if len(work.clients) < n:
            index = torch.as_tensor(work.clients, device=self.device)
            models = {k: v.index_select(0, index) for k, v in params.items()}
        if cfg.quantize_bits:
            models = self.quantized(models, edge_models, edge_of, work)
        if len(work.clients) == n:
            return TrainResult(models=models, losses=mean_loss, ok=trains)
        return TrainResult(models=models, losses=mean_loss[work.clients],
                           ok=trains[work.clients])

    def client_ids_of(self, clients: np.ndarray) -> list[int]:
        """The ids that key the draws of ``clients`` (positions in this executor)."""
        return (clients if self.client_ids is None else self.client_ids[clients]).tolist()

    def quantized(self, models: Params, edge_models: Mapping[str, torch.Tensor],
                  edge_of: torch.Tensor, work: EdgeRoundWork) -> Params:
        """The sent clients' models as they go up: start + Q(end - start), each client's
        update quantised (:func:`fedhier.local.quantization.quantize_updates`, the ClientApp's)."""
        index = edge_of.index_select(0, torch.as_tensor(work.clients, device=self.device))
        starts = {k: v.index_select(0, index) for k, v in edge_models.items()}
        return quantize_updates(starts, models, bits=self.cfg.quantize_bits, seed=self.cfg.seed,
                                clients=self.client_ids_of(work.clients),
                                start_step=work.start_step)

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation:
        """The global model on every client's training rows (and held-out rows)."""
        loss, accuracy = self.client_metrics(params)
        return ClientEvaluation(loss=loss, accuracy=accuracy,
                                holdout_accuracy=self.holdout_accuracies(params))

    def client_gradients(self, params: Params) -> torch.Tensor:
        """Every client's full local gradient at ``params`` [n, P], on the rows the ClientApp's
        gradient query uses (``fedhier.diagnostics.in_rounds.direct_client_gradients``)."""
        return direct_client_gradients(self.model, dict(params), self.fed,
                                       self.cfg.diagnostics_max_samples, self.cfg.seed,
                                       self.device)

    def model_bytes(self, params: Params) -> int:
        """Bytes of one model as a Flower ArrayRecord (as the Flower engines count it)."""
        return int(ArrayRecord({k: v.detach().cpu() for k, v in params.items()}).count_bytes())

    def client_state(self) -> Params:
        """The kept momentum buffers [n, *shape] ({} without): a snapshot without copies,
        since training replaces ``self.momentum`` by new tensors every edge round and never
        writes into the ones returned here."""
        return dict(self.momentum)

    def restore_client_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.momentum = {k: v.to(self.device) for k, v in state.items()}

    # ---------------------------------------------------------------- the batched work

    def local_training(self, params: Params, rows: torch.Tensor, rates: Sequence[float],
                       trains: np.ndarray, steps: np.ndarray,
                       start_step: int | None = None) -> torch.Tensor:
        """One edge round of local steps for every client, in place on ``params``.

        Every client is computed (a batch is cheaper than a gather); only those in ``trains``
        are used, and only theirs update the kept momentum buffers. Client j stops after
        ``steps[j]`` <= I steps (stragglers): the I steps run in segments that end where some
        client stops, and a stopped client's model, buffers and loss are set aside until the
        round ends.

        Args:
            params: name -> [n, *shape], each client's start model; rows: int64 [I, n, width];
            rates: the I learning rates; trains: bool [n]; steps: int64 [n] in 1..I;
            start_step: the global index of the round's first step, which keys Langevin
            noise (with ``langevin_temperature`` the steps then run one at a time, each
            followed by :meth:`fedhier.local.langevin.Langevin.perturb_`).

        Returns:
            float64 [n], each client's summed mini-batch loss over its steps.
        """
        data = self.data
        losses = torch.zeros(data.num_clients, dtype=torch.float64, device=self.device)
        previous = self.momentum  # kept buffers of every client, or {} (fresh ones)
        rates = [float(r) for r in rates]
        bounds = [0, *np.unique(steps).tolist()]
        langevin = self.cfg.langevin()
        if langevin.active:
            if start_step is None:
                raise ValueError("Langevin noise needs the edge round's start step")
            bounds = list(range(int(steps.max()) + 1))  # one step per segment
        for lo, hi in self.chunks:
            chunk = {k: v[lo:hi] for k, v in params.items()}
            buffers = {k: v[lo:hi] for k, v in previous.items()} if previous else None
            stopped: dict[int, tuple[Params, Params | None]] = {}  # segment end -> saved
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                index = rows[start:end, lo:hi]  # [steps, c, width]
                batches = EdgeRoundBatches(x=data.x[index], y=data.y[index],
                                           weight=data.weight[lo:hi], batch=data.batch[lo:hi])
                running = torch.as_tensor(steps[lo:hi] >= end, device=self.device)
                segment_loss, buffers = self.train_fn(chunk, batches, rates[start:end],
                                                   self.optimizer, buffers)
                if langevin.active and start_step is not None:
                    langevin.perturb_(chunk, self.client_ids_of(np.arange(lo, hi)),
                                      start_step + start, rates[start])
                losses[lo:hi] += torch.where(running, segment_loss, 0.0)
                done = np.flatnonzero(steps[lo:hi] == end)
                if end < bounds[-1] and len(done):
                    rows_done = torch.as_tensor(done, device=self.device)
                    stopped[end] = (
                        {k: v.index_select(0, rows_done) for k, v in chunk.items()},
                        None if buffers is None else
                        {k: v.index_select(0, rows_done) for k, v in buffers.items()})
            for end, (saved, saved_buffers) in stopped.items():
                rows_done = torch.as_tensor(np.flatnonzero(steps[lo:hi] == end),
                                            device=self.device)
                for key, value in saved.items():
                    chunk[key].index_copy_(0, rows_done, value)
                if buffers is not None and saved_buffers is not None:
                    for key, value in saved_buffers.items():
                        buffers[key].index_copy_(0, rows_done, value)
            if self.keep_momentum and buffers is not None:
                self.store_momentum(buffers, lo, hi)
        if self.keep_momentum and self.momentum and not trains.all():
            idle = torch.as_tensor(np.flatnonzero(~trains), device=self.device)
            for key, value in self.momentum.items():  # idle clients keep what they had
                value.index_copy_(0, idle, previous[key].index_select(0, idle) if previous
                                  else torch.zeros_like(value.index_select(0, idle)))
        return losses

    def start_params(self, edge_models: Mapping[str, torch.Tensor],
                     edge_of: torch.Tensor) -> Params:
        """name -> [n, *shape]: each client's edge model, gathered into buffers reused from
        round to round (fresh multi-MB tensors cost page faults at 10,000 clients)."""
        n = self.data.num_clients
        for key, value in edge_models.items():
            buffer = self.buffers.get(key)
            if buffer is None:
                buffer = self.buffers[key] = torch.empty(n, *value.shape[1:], dtype=value.dtype,
                                                         device=self.device)
            torch.index_select(value, 0, edge_of, out=buffer)
        return dict(self.buffers)

    @property
    def keep_momentum(self) -> bool:
        """Momentum buffers persist per client across edge rounds (``optimizer_state=keep``)."""
        return self.optimizer.has_state and self.cfg.optimizer_state == "keep"


    def store_momentum(self, buffers: Params, lo: int, hi: int) -> None:
        """Keep clients lo..hi-1's momentum buffers for their next edge round."""
        if not self.next_momentum:
            n = self.data.num_clients
            self.next_momentum = {k: torch.empty(n, *v.shape[1:], dtype=v.dtype,
                                                 device=v.device) for k, v in buffers.items()}
        for key, value in buffers.items():
            self.next_momentum[key][lo:hi] = value
        if hi == self.data.num_clients:  # the edge round's last chunk: buffers complete
            self.momentum, self.next_momentum = self.next_momentum, {}

    def minibatch_rows(self, cloud_round: int) -> torch.Tensor:
        """int32 [G, n, width]: the pool rows of cloud round ``cloud_round``'s mini-batches.

        Computed with :meth:`ClientRows.minibatch_rows` for blocks of cloud rounds at once
        (:meth:`index_blocks`) and moved to the device once per block.
        """
        if cloud_round not in self._rows:
            self._rows = {}  # free the previous block before the next one is built
            cfg, g = self.cfg, self.cfg.global_period
            count = max(1, min(self.index_blocks(), cfg.rounds - cloud_round + 1))
            rows = torch.as_tensor(self.data.minibatch_rows(
                cfg.seed, cfg.batch_size, (cloud_round - 1) * g, count * g), device=self.device)
            self._rows = {cloud_round + k: rows[k * g:(k + 1) * g] for k in range(count)}
        return self._rows[cloud_round]

    def holdout_accuracies(self, params: Mapping[str, torch.Tensor]) -> np.ndarray | None:
        """Each client's accuracy on its held-out rows (``client_holdout``; NaN for a
        client without any), None when no client holds rows out."""
        fed = self.fed
        if not fed.holdouts:
            return None
        accuracies = np.full(fed.num_clients, np.nan)
        with torch.no_grad():
            for client in range(fed.num_clients):
                x, y = fed.holdout_tensors(client, self.device)
                if len(y):
                    accuracies[client] = evaluate(self.model, dict(params), x, y,
                                                  forward=self.forward)[1]
        return accuracies

    def client_metrics(self, params: Mapping[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """float64 [n] each: the model's mean loss and accuracy on each client's training
        rows (every distinct row is evaluated once; :func:`fedhier.engines.vectorized.chunked_eval.
        client_metrics`, a run of clients at a time)."""
        data = self.data
        return client_metrics(self.model, params, data.x, data.y, data.rows,
                              forward=self.forward)



@dataclass
class BatchedRun:
    """What a batched engine's run starts from (the data, the device, the initial model, the
    run folder's recorder) and how it ends (:meth:`finish`): shared by ``vectorized`` and
    ``vectorized-ray``."""

    fed: Federation
    device: torch.device
    model: nn.Module
    recorder: RunRecorder

    @classmethod
    def start(cls, cfg: RunConfig, folder: RunFolder, engine: str, progress: bool,
              federation: Federation | None, resume: Checkpoint | None) -> BatchedRun:
        """Prepare ``cfg``'s data (or take ``federation``: benchmarks build federations the
        partitioners cannot, e.g. replicated clients), its model and ``engine``'s recorder."""
        fed = federation if federation is not None else prepare(cfg)
        if fed.num_clients != cfg.clients:
            raise ConfigError(f"the federation has {fed.num_clients} clients but "
                              f"clients={cfg.clients}")
        device = resolve_device(cfg.device)
        model = initial_model(cfg, fed).to(device)
        recorder = RunRecorder.for_run(folder, cfg, fed, engine, progress, resume)
        return cls(fed, device, model, recorder)

    def finish(self, cfg: RunConfig, algorithm: Any, executor: Any,
               resume: Checkpoint | None) -> dict[str, Any]:
        """Run ``algorithm`` with ``executor`` from the initial model to the end, recorded;
        summary.json's dict."""
        return run_recorded(algorithm, executor, cfg, self.recorder, params_of(self.model),
                            central_evaluation(cfg, self.fed, self.model, self.device,
                                               forward_for(self.model, self.device)),
                            resume=resume)


def run_vectorized(cfg: RunConfig, folder: RunFolder, progress: bool = True, *,
                   federation: Federation | None = None,
                   resume: Checkpoint | None = None,
                   make_executor: ExecutorFactory | None = None) -> dict[str, Any]:
    """Run ``cfg`` with every client batched; writes the same run folder as ``inprocess``.

    Args:
        cfg: the run configuration (``client_chunk`` and ``device`` are honoured).
        folder: the run folder to write.
        progress: show a progress bar over cloud rounds.
        federation: the data to use instead of ``prepare(cfg)`` (benchmarks use it to build
            federations the partitioners cannot, e.g. replicated clients).
        resume: a checkpoint of this run to continue from.
        make_executor: builds the executor instead of ``BatchedExecutor.build`` (seeds
            batched together: :mod:`fedhier.engines.vectorized.seed_batch`).

    Returns:
        summary.json's dict.
    """
    run = BatchedRun.start(cfg, folder, "vectorized", progress, federation, resume)
    algorithm = round_for(cfg)
    executor = (make_executor or BatchedExecutor.build)(cfg, run.fed, run.model, run.device)
    return run.finish(cfg, algorithm, executor, resume)

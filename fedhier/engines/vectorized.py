"""Engine ``vectorized``: all clients of an edge round as one batched tensor computation.

It computes what the Flower path (``HierFedAvg`` + the ClientApp) computes, with the same
building blocks, and only executes it differently:

- the schedule: ``Hierarchy.level_after(step)`` from :func:`fedhier.topology.build_hierarchy`,
  with the groups HierFedAvg builds from the clients' profiles (and, for the ``gradient``
  grouping, their full gradients), regrouped as HierFedAvg does with ``regroup_every``;
- the mini-batches: :func:`fedhier.train.batch_indices`, a pure function of (seed, client,
  step), precomputed for whole cloud rounds and gathered once per edge round;
- the local step: the gradient of :func:`fedhier.train.loss_fn` (mean cross-entropy) followed
  by :class:`fedhier.optim.LocalOptimizer`'s rule over the client axis (plain SGD: the
  :func:`fedhier.train.sgd_update` rule ``params - lr * grads``), at the rates of
  ``cfg.learning_rates`` (the lr schedule);
- who trains: :func:`fedhier.plan.plan_edge_round` (participation, stragglers, FedNova
  scales) and :class:`fedhier.faults.FaultModel` (injected failures), decided per edge round
  exactly as HierFedAvg and the ClientApp decide them;
- the averaging: :func:`fedhier.aggregate.segment_weighted_mean` over the surviving clients
  with :func:`fedhier.aggregate.presence_weights`, at the level the schedule names; a node
  without survivors keeps its model (every edge's model is kept, ``[edges, *shape]``); the
  cloud step can be a Flower strategy (:func:`fedhier.cloud.cloud_update`);
- the records: :class:`fedhier.recorder.RunRecorder` and :class:`Communication`, with the
  records HierFedAvg's ``on_cloud_round`` produces, diagnostics included
  (:mod:`fedhier.round_diagnostics`).

Every client's parameters live in one tensor per parameter name with a leading client axis,
``[n, *shape]``. An edge round's local steps run for a chunk of clients at once
(``client_chunk``, 0 = all; chunks change no bit of the result):

- models that are chains of linear layers with ReLU between them (``logreg``, ``mlp``) use a
  hand-batched forward/backward with ``torch.bmm`` (:func:`linear_chain_pass`, checked against
  autograd of ``loss_fn`` in tests/test_vectorized.py): a few large kernels per step instead
  of autograd's many small ones;
- any other model (``cnn``, ``lstm``) uses ``vmap(grad(loss_fn))`` over clients
  (:func:`vmap_training`).

The host waits for the device once per edge round (the NaN check), and once per cloud round
for the metrics. Every RunConfig knob is implemented, tested against the Flower path.

Clients with fewer rows than ``batch_size`` use all their rows, so the per-step batch size b_j
differs between clients. Mini-batches are padded to the largest b_j of the run; padding rows
get weight 0 and real rows weight 1 / b_j, so each client's loss is exactly its mean
cross-entropy. The vmap path instead runs one vmap per distinct b_j (no padding at all).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import Strategy
from torch import nn
from torch.func import grad_and_value, vmap

from fedhier.aggregate import (
    client_weights,
    occupied_segments,
    presence_weights,
    segment_weighted_mean,
)
from fedhier.checkpoint import Checkpoint, save_checkpoint
from fedhier.cloud import ChildrenGrid, cloud_update, make_cloud_strategy
from fedhier.communication import Communication
from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.faults import FaultModel, RunFailureError, failed_edges, non_finite_message
from fedhier.federation import Federation
from fedhier.grouping import GRADIENT_GROUPING, ClientInfo
from fedhier.models import linear_chain
from fedhier.optim import LocalOptimizer
from fedhier.plan import EdgeRoundPlan, Workload, plan_edge_round
from fedhier.recorder import RunRecorder
from fedhier.results import RunFolder
from fedhier.round_diagnostics import (
    client_diagnostics,
    diagnostics_due,
    direct_client_gradients,
    sample_diagnostics,
)
from fedhier.server import initial_model, pooled_train_tensors, prepare, test_metrics
from fedhier.strategies.hierfedavg import client_accuracy_summary
from fedhier.topology import Hierarchy, build_hierarchy
from fedhier.train import (
    batch_indices,
    effective_batch_size,
    evaluate,
    loss_fn,
    params_of,
    resolve_device,
)

Params = dict[str, torch.Tensor]

#: Largest minibatch-index block precomputed at once (int64 entries; 2**22 = 32 MiB).
INDEX_BLOCK_ENTRIES = 2**22
#: Largest block (entries) one segment_weighted_mean call averages (float64 temporaries).
AGGREGATE_BLOCK = 2**18
#: Rows per forward pass when evaluating the global model on the clients' training rows.
EVAL_CHUNK = 4096


# ------------------------------------------------------------------------------ data
@dataclass
class ClientRows:
    """Every client's training rows as indices into one pool of rows on the device.

    Attributes:
        x: float32 [R, *input_shape], the dataset's training rows (the pool).
        y: int64 [R], their labels.
        rows: ``rows[j]`` int64 [m_j], client j's rows in the pool, in partition order (the
            order of ``Federation.client_tensors``, which ``batch_indices`` indexes).
        batch: int64 [n], b_j = ``effective_batch_size(batch_size, m_j)``.
        width: max_j b_j, the padded mini-batch width.
        weight: float32 [n, width] on the device: 1 / b_j for real rows, 0 for padding.
    """

    x: torch.Tensor
    y: torch.Tensor
    rows: list[np.ndarray]
    batch: np.ndarray
    width: int
    weight: torch.Tensor

    @classmethod
    def build(cls, fed: Federation, batch_size: int, device: torch.device) -> ClientRows:
        x, y = fed.bundle.train_arrays()
        rows = [np.asarray(p, dtype=np.int64) for p in fed.partitions]
        empty = [j for j, r in enumerate(rows) if len(r) == 0]
        if empty:
            raise ConfigError(f"clients {empty[:5]} have no training rows; the vectorized "
                              "engine needs at least one row per client")
        batch = np.array([effective_batch_size(batch_size, len(r)) for r in rows],
                         dtype=np.int64)
        width = int(batch.max())
        weight = np.zeros((len(rows), width), dtype=np.float32)
        for j, b in enumerate(batch):
            weight[j, :b] = np.float32(1.0) / np.float32(b)
        return cls(x=torch.as_tensor(x, device=device), y=torch.as_tensor(y, device=device),
                   rows=rows, batch=batch, width=width,
                   weight=torch.as_tensor(weight, device=device))

    @property
    def num_clients(self) -> int:
        return len(self.rows)

    def minibatch_rows(self, seed: int, batch_size: int, start: int, steps: int) -> np.ndarray:
        """Pool rows of every client's mini-batches for steps ``start .. start+steps-1``.

        Returns:
            int64 [steps, n, width]; client j's step-s batch is ``[s, j, :b_j]`` (from
            :func:`batch_indices`), padding repeats its first row (weight 0).
        """
        out = np.empty((steps, self.num_clients, self.width), dtype=np.int64)
        for j, rows in enumerate(self.rows):
            local = batch_indices(seed, j, len(rows), batch_size, start, steps)  # [steps, b_j]
            b = local.shape[1]
            out[:, j, :b] = rows[local]
            out[:, j, b:] = rows[local[:, :1]]
        return out


@dataclass
class EdgeRoundBatches:
    """The mini-batches of one edge round for a chunk of c clients.

    Attributes:
        x: float32 [steps, c, width, *input_shape]; y: int64 [steps, c, width].
        weight: float32 [c, width], 1 / b_j on client j's first b_j rows, 0 on padding.
        batch: int64 numpy [c], b_j per client.
    """

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    batch: np.ndarray


#: Local training of one edge round: (chunk params [c, ...], updated in place, the batches, one
#: learning rate per step, the optimizer, its momentum buffers or None) -> (float64 [c] each
#: client's summed mini-batch loss, the new buffers or None).
LocalTraining = Callable[[Params, EdgeRoundBatches, Sequence[float], LocalOptimizer,
                          Params | None], tuple[torch.Tensor, Params | None]]


# ------------------------------------------------------------------------------ local steps
def weighted_targets(y: torch.Tensor, weight: torch.Tensor, num_classes: int) -> torch.Tensor:
    """weight[j, r] * onehot(y[..., j, r]), class-major: y [..., c, b] -> [..., c, classes, b]."""
    onehot = nn.functional.one_hot(y, num_classes).to(weight.dtype)  # [..., c, b, classes]
    return (onehot * weight.unsqueeze(-1)).transpose(-1, -2).contiguous()


def linear_chain_pass(params: Params, layers: list[tuple[str, str]], x: torch.Tensor,
                      target: torch.Tensor, weight: torch.Tensor,
                      lr: float | None = None) -> tuple[Params, torch.Tensor]:
    """Hand-batched forward and backward of a Linear/ReLU chain for c clients at once.

    Client j's loss is sum_r weight[j, r] * CE(f(params_j, x[j, r]), y[j, r]): with weight
    1 / b_j on its b_j real rows (0 on padding) that is ``loss_fn``, its mean cross-entropy.
    Activations are feature-major ([c, features, b]): every product is one ``torch.bmm`` and
    the softmax runs over a non-innermost axis, several times faster than [c, b, features]
    on CPU for 10 classes.

    Args:
        params: weight [c, out, in] and bias [c, out] of every layer in ``layers``.
        x: [c, b, *input_shape]; target: [c, classes, b] from :func:`weighted_targets`;
        weight: [c, 1, b].
        lr: None: return the gradients and leave ``params`` alone. A float: apply the SGD
            rule params - lr * grads in place, fused into the gradient products
            (``baddbmm_``), and return no gradients.

    Returns:
        (gradients with the shapes of ``params`` or {} when ``lr`` is given, loss [c] at
        the parameters before the step).
    """
    c, b = x.shape[0], x.shape[1]
    acts = [x.reshape(c, b, -1).transpose(1, 2)]  # a_0 [c, in, b], then ReLU outputs
    for i, (w_key, b_key) in enumerate(layers):
        z = torch.baddbmm(params[b_key].unsqueeze(2), params[w_key], acts[-1])  # [c, out, b]
        acts.append(z.relu_() if i + 1 < len(layers) else z)
    log_probs = torch.log_softmax(acts.pop(), dim=1)  # [c, classes, b]
    loss = -(log_probs * target).sum(dim=(1, 2))
    delta = torch.exp(log_probs).mul_(weight).sub_(target)  # d loss / d logits
    grads: Params = {}
    for i in range(len(layers) - 1, -1, -1):
        w_key, b_key = layers[i]
        # d a_{i} (before this layer's update); ReLU passes it where a_i > 0
        below = (torch.ops.aten.threshold_backward(
            torch.bmm(params[w_key].transpose(1, 2), delta), acts[i], 0.0) if i > 0 else None)
        if lr is None:
            grads[w_key] = torch.bmm(delta, acts[i].transpose(1, 2))
            grads[b_key] = delta.sum(dim=2)
        else:
            params[w_key].baddbmm_(delta, acts[i].transpose(1, 2), alpha=-lr)
            params[b_key].sub_(delta.sum(dim=2), alpha=lr)
        if below is not None:
            delta = below
    return grads, loss


def linear_chain_training(layers: list[tuple[str, str]]) -> LocalTraining:
    """Local training of a Linear/ReLU chain with :func:`linear_chain_pass`, in place.

    Plain SGD (every optimizer knob 0) uses the fused in-place update; momentum, weight decay
    or clipping take the gradients and apply ``LocalOptimizer.step`` over the client axis.
    """

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        num_classes = params[layers[-1][0]].shape[1]
        targets = weighted_targets(batches.y, batches.weight, num_classes)  # [I, c, C, b]
        weight = batches.weight.unsqueeze(1)
        total = torch.zeros(len(batches.batch), dtype=torch.float64, device=targets.device)
        fused = optimizer == LocalOptimizer()
        with torch.no_grad():
            for s, lr in enumerate(lrs):
                grads, loss = linear_chain_pass(params, layers, batches.x[s], targets[s],
                                                weight, lr if fused else None)
                if not fused:
                    new, buffers = optimizer.step(params, grads, lr, buffers, client_axis=True)
                    for key, value in new.items():
                        params[key].copy_(value)
                total += loss
        return total, buffers

    return train


def vmap_training(model: nn.Module) -> LocalTraining:
    """Local training of any model: ``vmap(grad(loss_fn))`` over clients, then the optimizer
    rule (``sgd_update`` for plain SGD) over the client axis.

    Clients are grouped by their batch size b_j, so each group is one vmap over exactly the
    ``loss_fn`` the other engines differentiate (mean over b_j real rows, no padding).
    """
    grad_loss = vmap(grad_and_value(partial(loss_fn, model)))

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        device = batches.x.device
        total = torch.zeros(len(batches.batch), dtype=torch.float64, device=device)
        new_buffers: Params | None = None
        for b in np.unique(batches.batch):
            index = torch.as_tensor(np.flatnonzero(batches.batch == b), device=device)
            group = {k: v.index_select(0, index) for k, v in params.items()}
            group_buffers = (None if buffers is None else
                             {k: v.index_select(0, index) for k, v in buffers.items()})
            x, y = batches.x.index_select(1, index), batches.y.index_select(1, index)
            for s, lr in enumerate(lrs):
                grads, loss = grad_loss(group, x[s, :, :b], y[s, :, :b])
                group, group_buffers = optimizer.step(group, grads, lr, group_buffers,
                                                      client_axis=True)
                total.index_add_(0, index, loss.detach().to(torch.float64))
            for key, value in group.items():
                params[key].index_copy_(0, index, value.detach())
            if group_buffers is not None:
                if new_buffers is None:
                    new_buffers = {k: torch.empty_like(v) for k, v in params.items()}
                for key, value in group_buffers.items():
                    new_buffers[key].index_copy_(0, index, value.detach())
        return total, new_buffers

    return train


def local_training_for(model: nn.Module) -> LocalTraining:
    """The batched local training for ``model``: hand-batched when it is a Linear/ReLU chain."""
    layers = linear_chain(model)
    return linear_chain_training(layers) if layers is not None else vmap_training(model)


# ------------------------------------------------------------------------------ the run
def average(values: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor,
            num_nodes: int) -> torch.Tensor:
    """``segment_weighted_mean`` of values [n, *shape] per node -> [nodes, *shape].

    Called on blocks of columns of at most :data:`AGGREGATE_BLOCK` entries: each column's mean
    depends on that column only, so this is bit-for-bit one call, while its float64
    temporaries stay small instead of growing to n x P x 8 bytes (GBs at 10,000 clients).
    """
    flat = values.reshape(values.shape[0], -1)
    out = torch.empty(num_nodes, flat.shape[1], dtype=values.dtype, device=values.device)
    step = max(1, AGGREGATE_BLOCK // max(flat.shape[0], 1))
    for lo in range(0, flat.shape[1], step):
        out[:, lo:lo + step] = segment_weighted_mean(flat[:, lo:lo + step], weights, owner,
                                                     num_nodes)
    return out.reshape(num_nodes, *values.shape[1:])


@dataclass
class VectorizedRun:
    """State of one vectorized run: data, hierarchy, weights and counters."""

    cfg: RunConfig
    model: nn.Module
    fed: Federation
    info: ClientInfo  # the clients' profiles: label histograms and sizes
    data: ClientRows
    hierarchy: Hierarchy
    weights: np.ndarray  # float64 [n], client_weights(cfg.weighting, m)
    train: LocalTraining
    model_bytes: int
    device: torch.device
    communication: Communication
    optimizer: LocalOptimizer = dataclasses.field(default_factory=LocalOptimizer)
    cloud_strategy: Strategy | None = None  # "hierarchical X" (fedhier.cloud), None = average
    workload: Workload = dataclasses.field(default_factory=Workload)
    faults: FaultModel = dataclasses.field(default_factory=FaultModel)
    buffers: Params = dataclasses.field(default_factory=dict)  # clients' params [n, *shape]
    momentum: Params = dataclasses.field(default_factory=dict)  # kept buffers [n, *shape]
    next_momentum: Params = dataclasses.field(default_factory=dict)  # being filled

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """[lo, hi) client ranges of ``client_chunk`` clients (one range when it is 0).

        A trailing chunk of a single client joins the previous one: torch runs a batch of one
        matrix product through a different CPU kernel (float32 rounding differs in the last
        bit), and chunking is meant to leave results bit-for-bit unchanged.
        """
        n = self.data.num_clients
        size = self.cfg.client_chunk if self.cfg.client_chunk > 0 else n
        bounds = list(range(0, n, size)) + [n]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and size > 1:
            del bounds[-2]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def index_blocks(self) -> int:
        """Cloud rounds whose mini-batch indices are precomputed together (memory-bounded)."""
        per_round = self.cfg.global_period * self.data.num_clients * self.data.width
        return max(1, min(self.cfg.rounds, INDEX_BLOCK_ENTRIES // max(per_round, 1)))

    def train_cloud_round(self, cloud_round: int, global_params: Params,
                          rows: torch.Tensor) -> tuple[Params, dict[str, Any]]:
        """G / I edge rounds from ``global_params``; returns (new global model, its record).

        Args:
            cloud_round: 1-based index of this cloud round.
            global_params: the global model, name -> [*shape].
            rows: int64 [G, n, width] pool rows of this cloud round's mini-batches.

        Returns:
            The cloud average (the old global model when no client survived the cloud step)
            and HierFedAvg's training keys: ``local_train_loss`` (the mean over edge rounds
            of the client-weighted mean of each surviving client's mean mini-batch loss),
            ``failed_clients`` and ``failed_edges``.
        """
        cfg, hierarchy = self.cfg, self.hierarchy
        period = cfg.local_period
        edge_rounds = cfg.global_period // period
        num_edges = hierarchy.num_nodes(1)
        edge_of_client = hierarchy.edge_of_client()  # fixed for the cloud round
        edge_of = torch.as_tensor(edge_of_client, device=self.device)
        # every edge starts the cloud round from the global model
        edge_models = {k: v.unsqueeze(0).repeat(num_edges, *([1] * v.dim()))
                       for k, v in global_params.items()}
        new_global = dict(global_params)
        if self.cloud_strategy is not None:  # lets server optimisers see the current model
            self.cloud_strategy.configure_train(
                cloud_round, to_record(global_params), ConfigRecord(),
                ChildrenGrid(hierarchy.num_nodes(hierarchy.num_levels - 1)))
        edge_losses: list[torch.Tensor] = []
        failed = failed_edge_count = 0
        round_start = (cloud_round - 1) * cfg.global_period  # global index of its first step
        for k in range(edge_rounds):
            first_step = k * period  # steps counted within the cloud round
            edge_round = (cloud_round - 1) * edge_rounds + k + 1
            sent, trains, plan = self.who_trains(edge_round, cloud_round)
            steps = np.where(sent, plan.steps, period)  # unsent clients' work is discarded
            params = self.start_params(edge_models, edge_of)
            losses = self.local_training(params, rows[first_step:first_step + period],
                                         cfg.learning_rates(round_start + first_step, period),
                                         trains, steps)
            if (plan.scale != 1.0).any():  # FedNova: w_start + s (w_local - w_start)
                self.scale_updates(params, edge_models, plan.scale)
            # the periods divide G, so the level only depends on the step modulo G
            level = hierarchy.level_after(first_step + period - 1)
            alive, averaged, nodes = self.aggregate(params, losses, trains, level, edge_round)
            if level == hierarchy.num_levels and self.cloud_strategy is not None and alive.any():
                averaged, nodes = self.cloud_step(cloud_round, params, alive), np.zeros(1, int)
            failed += int(sent.sum() - alive.sum())
            failed_edge_count += failed_edges(
                edge_of_client, np.flatnonzero(sent), np.flatnonzero(alive),
                num_edges, cfg.min_clients_per_edge, edge_round)
            self.communication.add_edge_round(int(sent.sum()), int(alive.sum()),
                                              self.model_bytes)
            if not alive.any():
                continue  # nothing came back: every edge keeps its model
            weights = torch.as_tensor(self.weights[alive], device=self.device)
            mean_loss = losses / torch.as_tensor(steps, device=self.device)
            edge_losses.append((weights * mean_loss[torch.as_tensor(alive, device=self.device)]
                                ).sum() / weights.sum())
            self.communication.add_aggregation(hierarchy, level, self.model_bytes)
            # edges under a node with a survivor take its average; the others keep theirs
            position = np.full(hierarchy.num_nodes(level), -1, dtype=np.int64)
            position[nodes] = np.arange(len(nodes))
            source = position[hierarchy.edges_under(level)]
            updated = np.flatnonzero(source >= 0)
            src = torch.as_tensor(source[updated], device=self.device)
            dst = torch.as_tensor(updated, device=self.device)
            for key, value in averaged.items():
                edge_models[key].index_copy_(0, dst, value.index_select(0, src))
            if level == hierarchy.num_levels:
                new_global = {key: value[0] for key, value in averaged.items()}
        local_loss = float(torch.stack(edge_losses).mean()) if edge_losses else None
        return new_global, {"local_train_loss": local_loss, "failed_clients": failed,
                            "failed_edges": failed_edge_count}

    def who_trains(self, edge_round: int,
                   cloud_round: int) -> tuple[np.ndarray, np.ndarray, EdgeRoundPlan]:
        """bool [n] masks: the clients sent this edge round's work (participation), and those
        of them that run it (not failing by the fault model), as HierFedAvg and the
        ClientApp decide it; and the round's plan (steps and update scale per client)."""
        cfg = self.cfg
        plan = plan_edge_round(self.hierarchy, self.workload, self.weights, cfg.seed,
                               edge_round)
        sent = plan.steps > 0
        trains = sent.copy()
        if self.faults != FaultModel():
            for client in np.flatnonzero(sent):
                trains[client] = not self.faults.fails(cfg.seed, int(client), edge_round,
                                                       cloud_round)
        return sent, trains, plan

    def local_training(self, params: Params, rows: torch.Tensor, rates: Sequence[float],
                       trains: np.ndarray, steps: np.ndarray) -> torch.Tensor:
        """One edge round of local steps for every client, in place on ``params``.

        Every client is computed (a batch is cheaper than a gather); only those in ``trains``
        are used, and only theirs update the kept momentum buffers. Client j stops after
        ``steps[j]`` <= I steps (stragglers): the I steps run in segments that end where some
        client stops, and a stopped client's model, buffers and loss are set aside until the
        round ends.

        Args:
            params: name -> [n, *shape], each client's start model; rows: int64 [I, n, width];
            rates: the I learning rates; trains: bool [n]; steps: int64 [n] in 1..I.

        Returns:
            float64 [n], each client's summed mini-batch loss over its steps.
        """
        data = self.data
        losses = torch.zeros(data.num_clients, dtype=torch.float64, device=self.device)
        previous = self.momentum  # kept buffers of every client, or {} (fresh ones)
        rates = [float(r) for r in rates]
        bounds = [0, *np.unique(steps).tolist()]
        for lo, hi in self.chunks:
            chunk = {k: v[lo:hi] for k, v in params.items()}
            buffers = {k: v[lo:hi] for k, v in previous.items()} if previous else None
            stopped: dict[int, tuple[Params, Params | None]] = {}  # segment end -> saved
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                index = rows[start:end, lo:hi]  # [steps, c, width]
                batches = EdgeRoundBatches(x=data.x[index], y=data.y[index],
                                           weight=data.weight[lo:hi], batch=data.batch[lo:hi])
                running = torch.as_tensor(steps[lo:hi] >= end, device=self.device)
                segment_loss, buffers = self.train(chunk, batches, rates[start:end],
                                                   self.optimizer, buffers)
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

    def scale_updates(self, params: Params, edge_models: Mapping[str, torch.Tensor],
                      scale: np.ndarray) -> None:
        """FedNova-style: client j's model becomes w_start + scale[j] * (w_j - w_start), with
        w_start its edge's model (what the ClientApp does with ``update-scale``)."""
        clients = np.flatnonzero(scale != 1.0)
        index = torch.as_tensor(clients, device=self.device)
        edges = torch.as_tensor(self.hierarchy.edge_of_client()[clients], device=self.device)
        factor = torch.as_tensor(scale[clients], device=self.device)
        for key, value in params.items():
            start = edge_models[key].index_select(0, edges)
            local = value.index_select(0, index)
            f = factor.reshape(-1, *([1] * (local.dim() - 1))).to(local.dtype)
            value.index_copy_(0, index, start + f * (local - start))

    def aggregate(self, params: Params, losses: torch.Tensor, trains: np.ndarray, level: int,
                  edge_round: int) -> tuple[np.ndarray, Params, np.ndarray]:
        """Average the surviving clients' models per level-``level`` node.

        A client whose loss or model is NaN/inf stops the run (``on_nan="stop"``) or is
        dropped (``skip-client``). Weights renormalise over the survivors
        (:func:`presence_weights`), as in HierFedAvg.

        Returns:
            (alive bool [n]: the survivors, averages name -> [s, *shape] of the s nodes that
            have a survivor, those nodes' ids int64 [s]).
        """
        alive = trains.copy()
        averaged, nodes = self.node_means(params, alive, level)
        if all(bool(torch.isfinite(v).all()) for v in averaged.values()) and bool(
                torch.isfinite(losses[torch.as_tensor(alive, device=self.device)]).all()):
            return alive, averaged, nodes  # a non-finite survivor makes its node's mean so
        bad = torch.isfinite(losses)
        for value in params.values():
            bad &= torch.isfinite(value.reshape(len(bad), -1)).all(dim=1)
        bad_clients = np.flatnonzero(alive & ~bad.cpu().numpy())
        if self.cfg.on_nan == "stop":
            client = int(bad_clients[0])
            raise RunFailureError(non_finite_message(
                client, int(self.hierarchy.edge_of_client()[client]), edge_round,
                self.cfg.global_period // self.cfg.local_period))
        alive[bad_clients] = False
        averaged, nodes = self.node_means(params, alive, level)
        return alive, averaged, nodes

    def cloud_step(self, cloud_round: int, params: Params, alive: np.ndarray) -> Params:
        """The cloud's update with the wrapped Flower strategy (``cloud_update``) over the
        averages of the cloud's children; returns name -> [1, *shape]."""
        assert self.cloud_strategy is not None
        hierarchy = self.hierarchy
        child_level = hierarchy.num_levels - 1
        children, nodes = self.node_means(params, alive, child_level)
        weights = presence_weights(self.weights, alive, hierarchy.edge_of_client())
        child_weight = np.bincount(hierarchy.ancestors(child_level)[alive],
                                   weights=weights[alive],
                                   minlength=hierarchy.num_nodes(child_level))
        records = {int(node): to_record({k: v[i] for k, v in children.items()})
                   for i, node in enumerate(nodes)}
        arrays = cloud_update(self.cloud_strategy, cloud_round, records,
                              {int(node): float(child_weight[node]) for node in nodes})
        return {k: v.to(self.device).unsqueeze(0)
                for k, v in arrays.to_torch_state_dict().items()}

    def node_means(self, params: Params, alive: np.ndarray,
                   level: int) -> tuple[Params, np.ndarray]:
        """``segment_weighted_mean`` of the ``alive`` clients' models at ``level``, over the
        nodes that have one (:func:`occupied_segments`), with :func:`presence_weights`."""
        hierarchy = self.hierarchy
        members = np.flatnonzero(alive)
        if len(members) == 0:
            return {}, np.zeros(0, dtype=np.int64)
        everyone = len(members) == len(alive)
        weights = (self.weights if everyone else
                   presence_weights(self.weights, alive, hierarchy.edge_of_client()))[members]
        nodes, compact = occupied_segments(hierarchy.ancestors(level)[members],
                                           hierarchy.num_nodes(level))
        index = torch.as_tensor(members, device=self.device)
        w = torch.as_tensor(weights, device=self.device)
        owner = torch.as_tensor(compact, device=self.device)
        return {k: average(v if everyone else v.index_select(0, index), w, owner, len(nodes))
                for k, v in params.items()}, nodes

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

    def regroup(self, cloud_round: int, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Regroup before a cloud round when ``regroup_every`` says so (as HierFedAvg: seed
        + cloud_round - 1, at the global model); returns the keys it adds to the record."""
        cfg = self.cfg
        if not cfg.regroup_every or cloud_round <= 1 or (cloud_round - 1) % cfg.regroup_every:
            return {}
        grads = self.client_gradients(params) if cfg.grouping == GRADIENT_GROUPING else None
        self.hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping, self.info,
                                         cfg.seed + cloud_round - 1, client_grads=grads,
                                         weights=self.weights)
        return {"regrouped": True, "client_to_edge": self.hierarchy.edge_of_client().tolist()}

    def client_gradients(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Every client's full local gradient at ``params`` [n, P], on the rows the ClientApp's
        gradient query uses (``fedhier.round_diagnostics.direct_client_gradients``)."""
        return direct_client_gradients(self.model, dict(params), self.fed,
                                       self.cfg.diagnostics_max_samples, self.cfg.seed,
                                       self.device)

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

    def minibatch_schedule(self, first_round: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        """For each cloud round from ``first_round`` on: (round, int64 [G, n, width], the pool
        rows of its mini-batches).

        Computed with :meth:`ClientRows.minibatch_rows` for blocks of cloud rounds at once
        (:meth:`index_blocks`) and moved to the device once per block.
        """
        cfg, g = self.cfg, self.cfg.global_period
        block = self.index_blocks()
        for first in range(first_round - 1, cfg.rounds, block):
            count = min(block, cfg.rounds - first)
            rows = torch.as_tensor(self.data.minibatch_rows(cfg.seed, cfg.batch_size, first * g,
                                                            count * g), device=self.device)
            for k in range(count):
                yield first + k + 1, rows[k * g:(k + 1) * g]

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the global model: the communication counters,
        the grouping in force and the clients' kept momentum buffers [n, *shape].

        A snapshot without copies of the momentum: training replaces ``self.momentum`` by new
        tensors every edge round and never writes into the ones returned here. The cloud
        strategy (with its server optimiser state) is copied.
        """
        return {"communication": self.communication.as_dict(), "hierarchy": self.hierarchy,
                "momentum": dict(self.momentum),
                "cloud_strategy": copy.deepcopy(self.cloud_strategy)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.communication = Communication(**state["communication"])
        self.hierarchy = state["hierarchy"]
        self.momentum = {k: v.to(self.device) for k, v in state.get("momentum", {}).items()}
        if state.get("cloud_strategy") is not None:
            self.cloud_strategy = state["cloud_strategy"]

    def cloud_record(self, cloud_round: int, params: Mapping[str, torch.Tensor],
                     trained: Mapping[str, Any] | None = None,
                     regrouped: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The metrics record of a cloud round, keyed as HierFedAvg's ``on_cloud_round``."""
        cfg = self.cfg
        record: dict[str, Any] = {
            "round": cloud_round, "iteration": cloud_round * cfg.global_period,
            "edge_rounds": cloud_round * (cfg.global_period // cfg.local_period)}
        record.update(self.train_metrics(params))
        record.update(self.holdout_metrics(params))
        record.update(trained or {"local_train_loss": None, "failed_clients": 0,
                                  "failed_edges": 0})
        record.update(regrouped or {})
        record.update(test_metrics(self.model, dict(params), self.fed, self.device))
        record.update(round_diagnostics(self, cloud_round, params))
        record.update(self.communication.as_dict())
        return record

    def holdout_metrics(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Each client's accuracy on its held-out rows (``client_holdout``), summarised as
        HierFedAvg does (:func:`client_accuracy_summary`); {} without held-out rows."""
        fed = self.fed
        if not fed.holdouts:
            return {}
        accuracies = np.full(fed.num_clients, np.nan)
        with torch.no_grad():
            for client in range(fed.num_clients):
                x, y = fed.holdout_tensors(client, self.device)
                if len(y):
                    accuracies[client] = evaluate(self.model, dict(params), x, y)[1]
        return client_accuracy_summary(accuracies)

    def train_metrics(self, params: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """train_loss / train_accuracy: the global model on every client's training rows,
        client-weighted (what HierFedAvg's aggregate_evaluate reports)."""
        data = self.data
        used, member = np.unique(np.concatenate(data.rows), return_inverse=True)
        used_t = torch.as_tensor(used, device=self.device)
        row_loss, row_correct = [], []
        with torch.no_grad():
            for lo in range(0, len(used), EVAL_CHUNK):
                index = used_t[lo:lo + EVAL_CHUNK]
                logits = torch.func.functional_call(self.model, dict(params),
                                                    (data.x[index],))
                target = data.y[index]
                row_loss.append(nn.functional.cross_entropy(logits, target, reduction="none"))
                row_correct.append(logits.argmax(1) == target)
        loss = torch.cat(row_loss).to(torch.float64).cpu().numpy()[member]
        correct = torch.cat(row_correct).cpu().numpy()[member]
        client = np.repeat(np.arange(data.num_clients), [len(r) for r in data.rows])
        sizes = np.bincount(client, minlength=data.num_clients)
        client_loss = np.bincount(client, weights=loss, minlength=data.num_clients) / sizes
        client_acc = np.bincount(client, weights=correct, minlength=data.num_clients) / sizes
        w = self.weights
        return {"train_loss": float(np.dot(w, client_loss) / w.sum()),
                "train_accuracy": float(np.dot(w, client_acc) / w.sum())}


def to_record(params: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """A model as the ArrayRecord a Flower strategy expects (on the CPU)."""
    return ArrayRecord({k: v.detach().cpu() for k, v in params.items()})


def round_diagnostics(run: VectorizedRun, cloud_round: int,
                      params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Divergences and gradient diversity at the global model, every ``diagnostics_every``
    cloud rounds (and round 0): the keys and numbers the Flower engines record, from the same
    functions (``fedhier.round_diagnostics``): sample-level diversity on the pooled training
    rows (the server's part), then the divergences of the clients' full gradients."""
    cfg = run.cfg
    if not diagnostics_due(cloud_round, cfg.diagnostics_every):
        return {}
    x, y = pooled_train_tensors(run.fed, run.device)
    out = sample_diagnostics(run.model, dict(params), x, y, cfg.diagnostics_max_samples,
                             cfg.seed)
    out.update(client_diagnostics(run.client_gradients(params), run.weights, run.hierarchy))
    return out


def build_run(cfg: RunConfig, fed: Federation, model: nn.Module,
              device: torch.device) -> VectorizedRun:
    """Everything a vectorized run needs besides the recorder."""
    info = ClientInfo(fed.label_histograms, fed.client_sizes(),
                      edge_tags=np.full(fed.num_clients, -1))  # no SuperNodes, no tags
    weights = client_weights(cfg.weighting, info.num_examples)
    grads = (direct_client_gradients(model, params_of(model), fed, cfg.diagnostics_max_samples,
                                     cfg.seed, device)
             if cfg.grouping == GRADIENT_GROUPING else None)  # at the initial model
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return VectorizedRun(
        cfg=cfg, model=model, fed=fed, info=info,
        data=ClientRows.build(fed, cfg.batch_size, device),
        hierarchy=build_hierarchy(cfg.periods, cfg.groups, cfg.grouping, info, cfg.seed,
                                  client_grads=grads, weights=weights),
        weights=weights, train=local_training_for(model),
        model_bytes=ArrayRecord(state).count_bytes(), device=device,  # as Flower counts
        communication=Communication(), optimizer=cfg.local_optimizer(),
        workload=cfg.workload(), faults=cfg.faults(),
        cloud_strategy=make_cloud_strategy(cfg.cloud_strategy, cfg.server_lr,
                                           cfg.server_momentum))


def run_vectorized(cfg: RunConfig, folder: RunFolder, progress: bool = True, *,
                   federation: Federation | None = None,
                   resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` with every client batched; writes the same run folder as ``inprocess``.

    Writes ``checkpoint.pt`` every ``cfg.checkpoint_every`` cloud rounds and, on Ctrl-C, after
    the last completed round before re-raising; ``resume`` continues from one.

    Args:
        cfg: the run configuration (``client_chunk`` and ``device`` are honoured).
        folder: the run folder to write.
        progress: show a progress bar over cloud rounds.
        federation: the data to use instead of ``prepare(cfg)`` (benchmarks use it to build
            federations the partitioners cannot, e.g. replicated clients).
        resume: a checkpoint of this run to continue from.

    Returns:
        summary.json's dict.
    """
    fed = federation if federation is not None else prepare(cfg)
    if fed.num_clients != cfg.clients:
        raise ConfigError(f"the federation has {fed.num_clients} clients but "
                          f"clients={cfg.clients}")
    device = resolve_device(cfg.device)
    model = initial_model(cfg, fed).to(device)
    recorder = RunRecorder(folder, cfg, fed, "vectorized", progress,
                           resume_round=resume.round if resume else None,
                           elapsed=resume.wall_seconds if resume else 0.0)
    run = build_run(cfg, fed, model, device)
    params = params_of(model)
    done = 0  # the last recorded cloud round; params and state are the run after it
    if resume is None:
        recorder.save_initial(model.state_dict())
    else:
        done = resume.round
        params = {k: v.to(device) for k, v in resume.global_state.items()}
        run.load_state_dict(resume.strategy_state)
    state = run.state_dict()

    def checkpoint() -> None:
        saved = {**state, "momentum": {k: v.cpu() for k, v in state["momentum"].items()}}
        save_checkpoint(folder.path, Checkpoint(
            round=done, global_state={k: v.detach().cpu() for k, v in params.items()},
            strategy_state=saved, wall_seconds=recorder.elapsed))

    try:
        if resume is None:
            recorder.write_groups(run.hierarchy, run.info, cfg.grouping, cfg.seed)
            recorder.record_round(run.cloud_record(0, params))
        for cloud_round, rows in run.minibatch_schedule(done + 1):
            regrouped = run.regroup(cloud_round, params)
            new_params, trained = run.train_cloud_round(cloud_round, params, rows)
            record = run.cloud_record(cloud_round, new_params, trained, regrouped)
            recorder.record_round(record)
            # one tuple assignment: a Ctrl-C sees the round, its model and its state together
            params, done, state = new_params, cloud_round, run.state_dict()
            if cfg.checkpoint_every and cloud_round % cfg.checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        recorder.close()
        if done > 0:
            checkpoint()
        raise
    finally:
        recorder.close()
    final = {k: v.detach().cpu() for k, v in params.items()}
    return recorder.finish(final, run.communication.as_dict())

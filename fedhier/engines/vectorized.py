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
- the averaging: :func:`fedhier.aggregate.segment_weighted_mean` with
  :func:`fedhier.aggregate.client_weights`, at the level the schedule names;
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
for the metrics. Knobs this engine does not implement are refused (:data:`UNSUPPORTED`).

Clients with fewer rows than ``batch_size`` use all their rows, so the per-step batch size b_j
differs between clients. Mini-batches are padded to the largest b_j of the run; padding rows
get weight 0 and real rows weight 1 / b_j, so each client's loss is exactly its mean
cross-entropy. The vmap path instead runs one vmap per distinct b_j (no padding at all).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value, vmap

from fedhier.aggregate import client_weights, segment_weighted_mean
from fedhier.communication import Communication
from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.faults import RunFailureError
from fedhier.federation import Federation
from fedhier.grouping import GRADIENT_GROUPING, ClientInfo
from fedhier.models import MLP, LogReg
from fedhier.optim import LocalOptimizer
from fedhier.recorder import RunRecorder
from fedhier.results import RunFolder
from fedhier.round_diagnostics import (
    client_diagnostics,
    diagnostics_due,
    direct_client_gradients,
    sample_diagnostics,
)
from fedhier.server import initial_model, pooled_train_tensors, prepare, test_metrics
from fedhier.topology import Hierarchy, build_hierarchy
from fedhier.train import (
    batch_indices,
    effective_batch_size,
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
def linear_chain(model: nn.Module) -> list[tuple[str, str]] | None:
    """(weight, bias) names of a model that is Linear (-> ReLU -> Linear)*, else None."""
    if isinstance(model, LogReg):
        return [("linear.weight", "linear.bias")]
    if isinstance(model, MLP):
        return [("hidden.weight", "hidden.bias"), ("out.weight", "out.bias")]
    return None


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
                          rows: torch.Tensor) -> tuple[Params, float]:
        """G / I edge rounds from ``global_params``; returns (new global model, local loss).

        Args:
            cloud_round: 1-based index of this cloud round.
            global_params: the global model, name -> [*shape].
            rows: int64 [G, n, width] pool rows of this cloud round's mini-batches.

        Returns:
            The cloud average and HierFedAvg's ``local_train_loss``: the mean over edge rounds
            of the client-weighted mean of each client's mean mini-batch loss.
        """
        cfg, data, hierarchy = self.cfg, self.data, self.hierarchy
        n, period = data.num_clients, cfg.local_period
        weights = torch.as_tensor(self.weights, device=self.device)
        params = self.client_params(global_params)  # every client starts from the global model
        averaged: Params = {}
        edge_losses = []
        round_start = (cloud_round - 1) * cfg.global_period  # global index of its first step
        for first_step in range(0, cfg.global_period, period):  # steps counted within the round
            rates = [float(r) for r in cfg.learning_rates(round_start + first_step, period)]
            losses = torch.empty(n, dtype=torch.float64, device=self.device)
            momentum = self.momentum if self.momentum else None  # kept buffers, or fresh ones
            for lo, hi in self.chunks:
                index = rows[first_step:first_step + period, lo:hi]  # [I, c, width]
                batches = EdgeRoundBatches(x=data.x[index], y=data.y[index],
                                           weight=data.weight[lo:hi], batch=data.batch[lo:hi])
                losses[lo:hi], buffers = self.train(
                    {k: v[lo:hi] for k, v in params.items()}, batches, rates, self.optimizer,
                    None if momentum is None else {k: v[lo:hi] for k, v in momentum.items()})
                if self.keep_momentum and buffers is not None:
                    self.store_momentum(buffers, lo, hi)
            # the periods divide G, so the level only depends on the step modulo G
            level = hierarchy.level_after(first_step + period - 1)
            owner = torch.as_tensor(hierarchy.ancestors(level), device=self.device)
            averaged = {k: average(v, weights, owner, hierarchy.num_nodes(level))
                        for k, v in params.items()}  # name -> [nodes, *shape]
            self.check_finite(losses, params, averaged, (round_start + first_step) // period + 1)
            edge_losses.append((weights * losses / period).sum() / weights.sum())
            for key, value in averaged.items():  # each client continues from its node's model
                torch.index_select(value, 0, owner, out=params[key])
            self.communication.add_edge_round(n, n, self.model_bytes)
            self.communication.add_aggregation(hierarchy, level, self.model_bytes)
        assert level == hierarchy.num_levels, "a cloud round ends with a cloud aggregation"
        local_loss = float(torch.stack(edge_losses).mean())
        return {k: v[0] for k, v in averaged.items()}, local_loss

    def client_params(self, global_params: Mapping[str, torch.Tensor]) -> Params:
        """name -> [n, *shape]: the global model copied to every client, into buffers reused
        from round to round (fresh multi-MB tensors cost page faults at 10,000 clients)."""
        n = self.data.num_clients
        for key, value in global_params.items():
            buffer = self.buffers.get(key)
            if buffer is None:
                buffer = self.buffers[key] = torch.empty(n, *value.shape, dtype=value.dtype,
                                                         device=self.device)
            buffer.copy_(value.unsqueeze(0).expand_as(buffer))
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

    def check_finite(self, losses: torch.Tensor, params: Params, averaged: Params,
                     edge_round: int) -> None:
        """Stop like HierFedAvg (``on_nan="stop"``) when a client's loss or model is NaN/inf.

        A non-finite client model makes its node's average non-finite (weights are > 0), so
        only the losses [n] and the averages [nodes, ...] are scanned on the common path.
        """
        bad = ~torch.isfinite(losses)
        if all(bool(torch.isfinite(v).all()) for v in averaged.values()) and not bool(bad.any()):
            return
        for value in params.values():
            bad |= ~torch.isfinite(value.reshape(len(bad), -1)).all(dim=1)
        client = int(torch.nonzero(bad)[0])
        edge = int(self.hierarchy.edge_of_client()[client])
        cloud_round = (edge_round - 1) // (self.cfg.global_period // self.cfg.local_period) + 1
        raise RunFailureError(
            f"non-finite values in the update of client {client} (edge {edge}) in edge round "
            f"{edge_round} (cloud round {cloud_round}); lower --lr")

    def minibatch_schedule(self) -> Iterator[torch.Tensor]:
        """For each cloud round, int64 [G, n, width]: the pool rows of its mini-batches.

        Computed with :meth:`ClientRows.minibatch_rows` for blocks of cloud rounds at once
        (:meth:`index_blocks`) and moved to the device once per block.
        """
        cfg, g = self.cfg, self.cfg.global_period
        block = self.index_blocks()
        for first in range(0, cfg.rounds, block):
            count = min(block, cfg.rounds - first)
            rows = torch.as_tensor(self.data.minibatch_rows(cfg.seed, cfg.batch_size, first * g,
                                                            count * g), device=self.device)
            for k in range(count):
                yield rows[k * g:(k + 1) * g]

    def cloud_record(self, cloud_round: int, params: Mapping[str, torch.Tensor],
                     local_loss: float | None,
                     regrouped: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The metrics record of a cloud round, keyed as HierFedAvg's ``on_cloud_round``."""
        cfg = self.cfg
        record: dict[str, Any] = {
            "round": cloud_round, "iteration": cloud_round * cfg.global_period,
            "edge_rounds": cloud_round * (cfg.global_period // cfg.local_period)}
        record.update(self.train_metrics(params))
        record.update({"local_train_loss": local_loss, "failed_clients": 0, "failed_edges": 0})
        record.update(regrouped or {})
        record.update(test_metrics(self.model, dict(params), self.fed, self.device))
        record.update(round_diagnostics(self, cloud_round, params))
        record.update(self.communication.as_dict())
        return record

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


#: RunConfig knobs this engine does not implement yet. A non-default value is refused, so a
#: vectorized run never silently computes something other than the Flower path.
UNSUPPORTED = ("cloud_strategy", "participation", "straggler_fraction", "normalize_updates",
               "fail_rate", "dropout_fraction", "on_nan", "checkpoint_every",
               "client_holdout")


def check_supported(cfg: RunConfig) -> None:
    """Raise ConfigError if ``cfg`` asks for something this engine does not implement."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    changed = [f"{name}={getattr(cfg, name)!r}" for name in UNSUPPORTED
               if name in defaults and getattr(cfg, name) != defaults[name]]
    if changed:
        raise ConfigError(f"the vectorized engine does not support {', '.join(changed)} yet; "
                          "use --engine inprocess")


def build_run(cfg: RunConfig, fed: Federation, model: nn.Module,
              device: torch.device) -> VectorizedRun:
    """Everything a vectorized run needs besides the recorder."""
    from flwr.app import ArrayRecord  # only to count a model's bytes exactly as Flower does

    info = ClientInfo(label_histograms=fed.label_histograms, num_examples=fed.client_sizes())
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
        model_bytes=ArrayRecord(state).count_bytes(), device=device,
        communication=Communication(), optimizer=cfg.local_optimizer())


def run_vectorized(cfg: RunConfig, folder: RunFolder, progress: bool = True, *,
                   federation: Federation | None = None) -> dict[str, Any]:
    """Run ``cfg`` with every client batched; writes the same run folder as ``inprocess``.

    Args:
        cfg: the run configuration (``client_chunk`` and ``device`` are honoured).
        folder: the run folder to write.
        progress: show a progress bar over cloud rounds.
        federation: the data to use instead of ``prepare(cfg)`` (benchmarks use it to build
            federations the partitioners cannot, e.g. replicated clients).

    Returns:
        summary.json's dict.
    """
    fed = federation if federation is not None else prepare(cfg)
    if fed.num_clients != cfg.clients:
        raise ConfigError(f"the federation has {fed.num_clients} clients but "
                          f"clients={cfg.clients}")
    check_supported(cfg)
    device = resolve_device(cfg.device)
    model = initial_model(cfg, fed).to(device)
    recorder = RunRecorder(folder, cfg, fed, "vectorized", progress)
    recorder.save_initial(model.state_dict())
    run = build_run(cfg, fed, model, device)
    params = params_of(model)
    try:
        recorder.write_groups(run.hierarchy, run.info, cfg.grouping, cfg.seed)
        recorder.record_round(run.cloud_record(0, params, None))
        for cloud_round, rows in enumerate(run.minibatch_schedule(), start=1):
            regrouped = run.regroup(cloud_round, params)
            params, local_loss = run.train_cloud_round(cloud_round, params, rows)
            recorder.record_round(run.cloud_record(cloud_round, params, local_loss, regrouped))
    finally:
        recorder.close()
    final = {k: v.detach().cpu() for k, v in params.items()}
    return recorder.finish(final, run.communication.as_dict())

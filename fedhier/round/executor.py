"""The seam between the round and whatever runs the clients.

:class:`Executor` is everything the round (:class:`fedhier.round.loop.HierarchicalSGD`) needs from
clients, and nothing about the algorithm: Flower Grid messages in
``fedhier.strategies.grid_executor``, one batched computation in
``fedhier.engines.vectorized.engine``.
:class:`EdgeRoundWork` is what it is asked to run, :class:`TrainResult` what comes back,
:class:`ClientEvaluation` the global model on every client's rows. No Flower import here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.tree.grouping import ClientInfo

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class EdgeRoundWork:
    """What an executor runs in one edge round.

    Attributes:
        edge_round: 1-based index over the whole run.
        cloud_round: 1-based cloud round it belongs to.
        start_step: global 0-based index of its first local step, (edge_round - 1) * I.
        clients: int64 [k], sorted: the clients sent work.
        steps: int64 [k], local steps of each sent client (I, fewer for a straggler).
        edge_of_client: int64 [n], the client -> edge map in force (it aggregates there).
        start_edge_of_client: int64 [n], the edge whose model each client starts from, when
            it differs from ``edge_of_client`` (a client that just moved with ``carry``
            handoff starts from its old edge's model); None = its edge's. With per-edge
            periods a row >= the number of edges E names a carried client model (below).
        carried: int64 [c], the sent clients that continue from their own model (per-edge
            periods: their edge did not aggregate after their last edge round); client
            ``carried[r]`` starts from row E + r of the start models
            (:meth:`HierarchicalSGD.start_models`). None = every client starts from an edge.
        ids: int64 [n], each client's id in the whole federation when this work is in a
            numbering of its own (a chunk of engine ``vectorized-ray`` run as a federation
            of its own), for messages that name clients; None = the same numbering.
    """

    edge_round: int
    cloud_round: int
    start_step: int
    clients: np.ndarray
    steps: np.ndarray
    edge_of_client: np.ndarray
    start_edge_of_client: np.ndarray | None = None
    carried: np.ndarray | None = None
    ids: np.ndarray | None = None

    def named(self, clients: np.ndarray) -> list[int]:
        """The whole federation's ids of ``clients`` (ids in this work's numbering)."""
        return (clients if self.ids is None else self.ids[clients]).tolist()

    @property
    def start_edges(self) -> np.ndarray:
        """int64 [n]: the edge whose model each client starts this edge round from."""
        return (self.edge_of_client if self.start_edge_of_client is None
                else self.start_edge_of_client)


@dataclass
class TrainResult:
    """What came back from one edge round's clients, in ``work.clients`` order.

    Attributes:
        models: name -> [k, *shape], each client's model after its local steps (rows of
            clients that are not ``ok`` are ignored).
        losses: float64 [k], each client's mean mini-batch loss (NaN where not reported).
        ok: bool [k], the client returned a model.
        loss_reported: bool [k], the client reported a loss (None: every ok client did).
        num_examples: int64 [k], the rows each client reported (None: not reported; only
            needed for clients whose profile did not say).
    """

    models: Params
    losses: np.ndarray
    ok: np.ndarray
    loss_reported: np.ndarray | None = None
    num_examples: np.ndarray | None = None


@dataclass
class ClientEvaluation:
    """The global model on each client's own rows: float64 [n] each, NaN = no answer
    (``num_examples``: int64 [n] rows each client reported, 0 = no answer, or None)."""

    loss: np.ndarray
    accuracy: np.ndarray
    holdout_accuracy: np.ndarray | None = None
    num_examples: np.ndarray | None = None

    @classmethod
    def unanswered(cls, num_clients: int) -> ClientEvaluation:
        """No client has answered yet: NaN numbers, NaN held-out accuracies, 0 rows (fill
        them in place as replies come)."""
        return cls(loss=np.full(num_clients, np.nan), accuracy=np.full(num_clients, np.nan),
                   holdout_accuracy=np.full(num_clients, np.nan),
                   num_examples=np.zeros(num_clients, dtype=np.int64))

    def if_answered(self) -> ClientEvaluation | None:
        """None when no client answered; otherwise this, without held-out accuracies when
        no client holds rows out."""
        if np.isnan(self.loss).all():
            return None
        holdout = self.holdout_accuracy
        if holdout is not None and np.isnan(holdout).all():
            return dataclasses.replace(self, holdout_accuracy=None)
        return self


class Executor(Protocol):
    """How clients run: everything H-SGD needs from them, and nothing about the algorithm."""

    def profiles(self) -> ClientInfo:
        """The clients in client order: rows per client, label histograms, edge tags."""
        ...

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        """Run ``work``: each sent client trains from ``edge_models[name][its start
        edge]`` (``work.start_edges``). ``edge_models``: name -> [E (+ c), *shape], the
        start models (:meth:`HierarchicalSGD.start_models`: the edges' models, then any
        carried client models)."""
        ...

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        """The model on every client's training (and held-out) rows; None: no answers."""
        ...

    def client_gradients(self, params: Params) -> torch.Tensor | None:
        """Every client's full local gradient [n, P] at ``params``; None if some is missing."""
        ...

    def model_bytes(self, params: Params) -> int:
        """Bytes of one model on the wire (the traffic counters' unit)."""
        ...

    def client_state(self) -> Any:
        """The clients' kept state (momentum buffers) for a checkpoint."""
        ...

    def restore_client_state(self, state: Any) -> None:
        """Put back what :meth:`client_state` returned."""
        ...


def device_of(params: dict[str, torch.Tensor]) -> torch.device:
    """The device of a model's tensors (its first)."""
    return next(iter(params.values())).device

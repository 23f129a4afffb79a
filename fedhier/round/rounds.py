"""The cloud round's part: how a run's cloud rounds reach the clients.

The loop (:class:`fedhier.round.loop.HierarchicalSGD`) holds the run's state and the edge
round's steps (plan, train, settle, aggregate); a :class:`CloudRounds` part, chosen once per
run, strings them into cloud rounds. Each is one line of :data:`ROUNDS`, named by a
``"module:class"`` string so that the loop imports none of them:

* synchronous H-SGD (:class:`fedhier.round.synchronous.SynchronousRounds`): the G / I edge
  rounds one after another through :meth:`Executor.train`;
* asynchronous, buffered edges (:class:`fedhier.round.asynchrony.edges.BufferedRounds`): the
  cloud aggregates the first K edge reports.

Engines choose others for their executors: edge servers
(:class:`fedhier.round.tiers.servers.ServerRounds`, each child server runs a job per cloud
round), asynchronous edge servers (:class:`fedhier.round.tiers.asynchronous.BufferedServerRounds`)
and the sharded engine's (:mod:`fedhier.engines.vectorized_ray`). No class extends the loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedhier.round.executor import EdgeRoundWork, Executor, Params


@dataclass
class Settled:
    """One edge round's results after :meth:`HierarchicalSGD.settle`, before aggregation.

    Attributes:
        work: the edge round; models: name -> [s, *shape], the survivors' models, scaled and
        screened; survivors: int64 [s], their clients; level: where the round aggregates
        (the highest level an edge aggregates at after it); outcome: ``level``,
        ``failed_clients``, ``failed_edges``, ``train_loss`` (the client-weighted mean of the
        survivors' reported mean mini-batch losses, or None) and ``loss_weight`` (the sum of
        those clients' weights).
    """

    work: EdgeRoundWork
    models: Params
    survivors: np.ndarray
    level: int
    outcome: dict[str, Any]


class CloudRounds(Protocol):
    """How a run's cloud rounds reach the clients: one part of the loop, bound to it.

    :class:`fedhier.round.synchronous.SynchronousRounds` runs the G / I edge rounds one after
    another through :meth:`Executor.train`; asynchronous edges
    (:class:`fedhier.round.asynchrony.edges.BufferedRounds`) aggregate the first K edge
    reports; edge servers (:class:`fedhier.round.tiers.servers.ServerRounds`) send each child
    server a job. :func:`fedhier.round.rounds.rounds_for` picks one from the settings.
    """

    def setup(self, executor: Executor) -> None:
        """After the loop's set-up (the tree and weights known): the part's own."""
        ...

    def run(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Cloud round ``cloud_round`` (1-based); returns its training keys."""
        ...

    def elapsed_seconds(self) -> float:
        """The run's simulated time so far."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The part's state for a checkpoint (keys beside the loop's; {}: none)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`state_dict` wrote (``state``: the whole checkpoint's)."""
        ...


#: Builds a run's :class:`CloudRounds` part, bound to its loop.
RoundsFactory = Callable[[Any], CloudRounds]


#: (when the settings ask for it, "module:class" of its part): the first that applies wins.
ROUNDS: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda s: s.asynchronous.active, "fedhier.round.asynchrony.edges:BufferedRounds"),
    (lambda s: True, "fedhier.round.synchronous:SynchronousRounds"),
)


def rounds_for(settings: Any) -> RoundsFactory:
    """The :class:`CloudRounds` part ``settings`` (an ``HSGDSettings``) ask for."""
    target = next(name for wanted, name in ROUNDS if wanted(settings))
    module, _, name = target.partition(":")
    factory: RoundsFactory = getattr(importlib.import_module(module), name)
    return factory

"""Synchronous H-SGD's cloud round: G / I edge rounds, one after another.

The :class:`fedhier.round.rounds.CloudRounds` part of every run without asynchronous edges or
edge servers: each edge round is planned by the loop, trained by the executor
(:meth:`fedhier.round.executor.Executor.train`) and completed (settled, aggregated at its
level, broadcast) before the next one starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedhier.round.executor import Executor

if TYPE_CHECKING:
    from fedhier.round.loop import HierarchicalSGD


class SynchronousRounds:
    """Every edge round of a cloud round through ``executor.train``, in order."""

    def __init__(self, sgd: HierarchicalSGD) -> None:
        self.sgd = sgd

    def setup(self, executor: Executor) -> None:
        return None

    def run(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """G / I edge rounds from the global model; returns the round's training keys."""
        sgd = self.sgd
        changed = sgd.begin_cloud_round(executor, cloud_round)
        losses: list[float] = []
        failed = failed_edge_count = 0
        for edge_round in sgd.settings.edge_rounds_of(cloud_round):
            work, plan = sgd.plan(edge_round)
            outcome = sgd.complete(work, plan, executor.train(work, sgd.start_models(work)))
            failed += outcome["failed_clients"]
            failed_edge_count += outcome["failed_edges"]
            if outcome["train_loss"] is not None:
                losses.append(outcome["train_loss"])
        out: dict[str, Any] = {"local_train_loss": float(np.mean(losses)) if losses else None,
                               "failed_clients": failed, "failed_edges": failed_edge_count,
                               **changed}
        out.update(sgd.schedule.end_cloud_round())
        out.update(sgd.membership.end_cloud_round(sgd._hierarchy()))
        return out

    def elapsed_seconds(self) -> float:
        return self.sgd._clock().seconds

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None

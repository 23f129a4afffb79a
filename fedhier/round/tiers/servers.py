"""The cloud's half of a server tier: its cloud rounds as jobs for its child servers.

:class:`ServerRounds` is the loop's :class:`fedhier.round.rounds.CloudRounds` part when the
nodes between the clients and the cloud are servers of their own (``fedhier deploy local
--edges``, and engine ``vectorized-ray``'s shards): once per cloud round it sends every child
server its job and takes the cloud step over their aggregates
(:mod:`fedhier.round.tiers.jobs`, where each server's half is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.round.executor import Executor
from fedhier.round.synchronous import SynchronousRounds
from fedhier.round.tiers.jobs import run_children, schedule_keys, server_names
from fedhier.round.tiers.moves import run_segments

if TYPE_CHECKING:
    from fedhier.round.loop import HierarchicalSGD


def check_connected(sgd: HierarchicalSGD, executor: Executor) -> None:
    """The grouping must put every client under the servers it is connected to
    (``executor.ancestors``: per level 1 .. L-1 each client's server, when known)."""
    connected = getattr(executor, "ancestors", None) or ()
    tree = sgd._hierarchy()
    names = server_names(tree.num_levels)
    for level, where in enumerate(connected, start=1):
        grouped = tree.ancestors(level)
        if not np.array_equal(where, grouped):
            client = int(np.flatnonzero(np.asarray(where) != grouped)[0])
            raise ConfigError(
                f"client {client} is connected to {names[level]} {int(where[client])} but "
                f"the '{sgd.settings.grouping}' grouping puts it under {names[level]} "
                f"{int(grouped[client])}: start each client at its {names[level]} "
                "(fedhier deploy local --edges does)")


class ServerRounds(SynchronousRounds):
    """The cloud rounds of a run whose edges (and levels above) are servers of their own:
    synchronous H-SGD (its clock, no state of its own), run as one job per child server."""

    def setup(self, executor: Executor) -> None:
        if not self.sgd.membership.rules:  # clients that move are re-attached by the tree
            check_connected(self.sgd, executor)

    def run(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Send every child server its job, wait for the reports, aggregate them at the
        cloud; returns the round's training keys."""
        sgd = self.sgd
        changed = sgd.begin_cloud_round(executor, cloud_round)
        rounds = sgd.settings.edge_rounds_of(cloud_round)
        top = sgd._hierarchy().num_levels
        below, handoffs = run_segments(sgd, executor, run_children, top, cloud_round, rounds)
        if below.models is not None:
            sgd.aggregate_edges(cloud_round, below.models, below.children, below.weights)
        reported = below.losses[:, 1] > 0
        out: dict[str, Any] = {
            "local_train_loss": (float(np.mean(below.losses[reported, 0]))
                                 if reported.any() else None),
            "failed_clients": below.failed, "failed_edges": below.failed_edges, **changed}
        if sgd.membership.rules:
            out.update(sgd.membership.end_cloud_round(sgd._hierarchy()))
        if handoffs:
            out["handoffs"] = handoffs
        names = server_names(top)
        if below.unreached:
            out["unreached_" + names[top - 1] + "s"] = below.unreached
        for level, nodes in sorted(below.deeper.items()):  # e.g. an edge a region missed
            out["unreached_" + names[level] + "s"] = sorted(set(nodes))
        out.update(schedule_keys(sgd, rounds))
        return out

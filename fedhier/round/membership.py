"""Membership: which clients each edge has in each edge round.

One part of the round (docs/index.md, "The round as parts"). The loop asks a
:class:`Membership` three things and never which feature answers:

* :func:`draw_hierarchy`: the tree the run's grouping draws (the first, and each regrouping);
* :meth:`Membership.begin_cloud_round`: the tree a cloud round starts with (a regrouping
  draws a new one every K cloud rounds) and the record keys of that change;
* :meth:`Membership.enter`: the client -> edge map of an edge round (a mobility model moves
  clients at edge-round boundaries) and how moved clients hand off their model
  (:class:`Handoff`);
* :meth:`Membership.end_cloud_round`: the record keys of the moves of the cloud round.

A static tree is the empty composition. Each feature is one :class:`MembershipRule` and one
line of :data:`MEMBERSHIP_RULES`; :func:`membership_for` picks the rules a run's settings ask
for, once per run, in that order (a regrouping happens before the cloud round's moves are
drawn from the regrouped map). Reachability is a property of the mobility settings that both
rules respect. The rules keep no state across cloud rounds, so a checkpoint at a cloud-round
boundary holds none of theirs (the tree in force is the algorithm's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.faults import RunFailureError
from fedhier.tree.grouping import ClientInfo, grouping_needs
from fedhier.tree.hierarchy import Hierarchy, build_hierarchy
from fedhier.tree.mobility import Mobility

#: regroup(seed) -> a hierarchy drawn by the run's grouping (from the current model).
Regroup = Callable[[int], Hierarchy]


def draw_hierarchy(settings: Any, info: ClientInfo, weights: np.ndarray, seed: int,
                   gradients: Callable[[], torch.Tensor | None]) -> Hierarchy:
    """A hierarchy drawn by the grouping of ``settings`` (:class:`fedhier.round.loop.HSGDSettings`)
    with ``seed``: ``gradients()`` gives every client's gradient [n, P] (None: some
    missing), asked only by groupings that need them; ``weights``: float64 [n]."""
    needs = grouping_needs(settings.grouping)
    grads = None
    if "gradients" in needs:
        grads = gradients()
        if grads is None:
            raise RunFailureError(f"the '{settings.grouping}' grouping needs every client's "
                                  "gradient (query.gradient)")
    if "labels" in needs and not info.label_histograms.any():
        raise ConfigError(f"the '{settings.grouping}' grouping needs the clients' label "
                          "histograms, which they did not report (docs/contract.md: "
                          "the profile query); use grouping 'random' or 'contiguous'")
    return build_hierarchy(settings.periods, settings.groups, settings.grouping, info, seed,
                           client_grads=grads, weights=weights)


@dataclass(frozen=True)
class Handoff:
    """How an edge round's moved clients start.

    Attributes:
        start_edges: int64 [n], the edge whose model each client starts from when it differs
            from its edge (``carry``: a moved client brings its old edge's model); None = its
            own edge's, for every client.
        dropped: int64 [m], clients whose own unaggregated model (per-edge periods) is
            dropped (``fresh``: a moved client starts over at its new edge).
    """

    start_edges: np.ndarray | None = None
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class RoundPace:
    """What a membership rule needs to know of the run: its seed, the edge rounds of a cloud
    round (G / I) and the clients' label histograms (int64 [n, C], admission policies)."""

    seed: int
    edge_rounds: int
    histograms: np.ndarray


class MembershipRule(Protocol):
    """One way membership changes (a regrouping, a mobility model)."""

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Regroup,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        """The tree the cloud round starts with, and its record keys ({} if unchanged)."""
        ...

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        """The tree of edge round ``edge_round`` (1-based over the run) and its handoff
        (None: nobody moved)."""
        ...

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        """Record keys of the cloud round's changes ({} when it records none)."""
        ...


def regroup_due(every: int, cloud_round: int) -> bool:
    """Whether a run that regroups every ``every`` cloud rounds (0 = never) regroups at the
    start of ``cloud_round`` (1-based; never the first)."""
    return bool(every) and cloud_round > 1 and (cloud_round - 1) % every == 0


class Regrouping:
    """Regroup every ``every`` cloud rounds with the run's grouping (seed + cloud round - 1);
    under a reachability matrix a client whose new edge its edge does not reach stays."""

    def __init__(self, every: int, mobility: Mobility) -> None:
        self.every = every
        self.mobility = mobility

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Regroup,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        if not regroup_due(self.every, cloud_round):
            return hierarchy, {}
        new = regroup(pace.seed + cloud_round - 1)
        if self.mobility.active and self.mobility.reachability is not None:
            new = new.with_edge_map(self.mobility.respect(
                hierarchy.edge_of_client(), new.edge_of_client(), new.num_nodes(1)))
        return new, {"regrouped": True, "client_to_edge": new.edge_of_client().tolist()}

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        return hierarchy, None

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        return {}


class Moving:
    """Clients move between edges (:class:`fedhier.tree.mobility.Mobility`: by rate or trace):
    a cloud round's maps are drawn at its start, each takes effect at its edge round."""

    def __init__(self, mobility: Mobility) -> None:
        self.mobility = mobility
        self.maps: np.ndarray | None = None  # int64 [E, n]: this cloud round's edge maps
        self.moves: list[list[int]] = []  # [edge round, client, from, to] this cloud round

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Regroup,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        self.moves = []
        self.maps = self.mobility.maps(pace.seed, cloud_round, pace.edge_rounds,
                                       hierarchy.edge_of_client(), hierarchy.num_nodes(1),
                                       pace.histograms)
        return hierarchy, {}

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        """Put the map of ``edge_round`` in force; a ``carry`` handoff after the cloud
        round's first edge round starts moved clients from their old edge's model."""
        if self.maps is None:
            return hierarchy, None
        k = edge_round - ((edge_round - 1) // pace.edge_rounds) * pace.edge_rounds
        old = hierarchy.edge_of_client()
        new = self.maps[k - 1]
        moved = np.flatnonzero(new != old)
        if not len(moved):
            return hierarchy, None
        self.moves.extend([edge_round, int(c), int(old[c]), int(new[c])] for c in moved)
        carry = self.mobility.handoff == "carry"
        dropped = np.zeros(0, dtype=np.int64) if carry else moved
        if not carry or k == 1:  # k = 1: every edge holds the global model
            return hierarchy.with_edge_map(new), Handoff(None, dropped)
        start = new.copy()
        start[moved] = old[moved]
        return hierarchy.with_edge_map(new), Handoff(start, dropped)

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        out: dict[str, Any] = {"moved_clients": len(self.moves)}
        if self.moves:
            out["moves"] = list(self.moves)
            out["client_to_edge"] = hierarchy.edge_of_client().tolist()
        return out


class Membership:
    """The membership rules of a run, applied in order (none: a static tree)."""

    def __init__(self, rules: list[MembershipRule]) -> None:
        self.rules = rules

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Regroup,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        keys: dict[str, Any] = {}
        for rule in self.rules:
            hierarchy, changed = rule.begin_cloud_round(cloud_round, hierarchy, regroup, pace)
            keys.update(changed)
        return hierarchy, keys

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        handoff = None
        for rule in self.rules:
            hierarchy, moved = rule.enter(edge_round, hierarchy, pace)
            handoff = moved or handoff
        return hierarchy, handoff

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        keys: dict[str, Any] = {}
        for rule in self.rules:
            keys.update(rule.end_cloud_round(hierarchy))
        return keys


#: (when the settings ask for it, the rule): one line per membership feature, in the order
#: the rules apply. ``settings`` is an :class:`fedhier.round.loop.HSGDSettings`.
MEMBERSHIP_RULES: tuple[tuple[Callable[[Any], bool], Callable[[Any], MembershipRule]], ...] = (
    (lambda s: bool(s.regroup_every), lambda s: Regrouping(s.regroup_every, s.mobility)),
    (lambda s: s.mobility.active, lambda s: Moving(s.mobility)),
)


def membership_for(settings: Any) -> Membership:
    """The membership of a run: the rules of :data:`MEMBERSHIP_RULES` its settings ask for."""
    return Membership([make(settings) for wanted, make in MEMBERSHIP_RULES if wanted(settings)])

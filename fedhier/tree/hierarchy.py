"""The hierarchy: levels, periods, the client -> edge (-> region ...) tree, and the aggregation
schedule.

Level 0 holds the clients, level 1 the edge servers, level L the cloud (one node). Each level
l = 1..L has a period P_l in local SGD iterations, P_1 < P_2 < ... < P_L, each a multiple of
the one below. After local step t (0-based) the hierarchy aggregates at the highest level l
with (t + 1) % P_l == 0, over each level-l node's subtree (algorithms.md §1-§2).
Two-level H-SGD is periods (I, G).

Per-edge periods (docs/hsgd.md#per-edge-periods): edge i may aggregate every I_i steps
(each I_i dividing P_2); P_1 is then g = gcd(I_i), the length of one edge round, and
:func:`edge_levels_after` says which edges aggregate after a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from fedhier.common.errors import ConfigError, Refusal
from fedhier.tree.grouping import (
    ClientInfo,
    Grouping,
    assign_groups,
    grouping_needs,
    make_gradient_grouping,
)

if TYPE_CHECKING:
    import torch


def validate_periods(periods: tuple[int, ...]) -> None:
    """Raise ConfigError unless periods are positive and each divides the next."""
    if len(periods) < 1:
        raise ConfigError("at least one aggregation period is needed")
    for p in periods:
        if p < 1:
            raise ConfigError(f"aggregation periods must be positive integers, got {list(periods)}")
    for lower, upper in zip(periods, periods[1:], strict=False):
        if upper % lower != 0:
            raise ConfigError(
                f"each period must be a multiple of the one below: {upper} is not a multiple "
                f"of {lower} (periods {list(periods)})"
            )


def aggregation_level(step: int, periods: tuple[int, ...]) -> int:
    """Level aggregated after 0-based local step ``step``: 0 (none), 1 (edge) ... L (cloud)."""
    level = 0
    for index, period in enumerate(periods, start=1):
        if (step + 1) % period == 0:
            level = index
    return level


def parse_edge_periods(text: str) -> tuple[int, ...]:
    """``"2,4,4,8"`` -> (2, 4, 4, 8); ``""`` -> () (per-edge periods off). One-line errors."""
    if not text.strip():
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"edge_periods must be comma-separated integers, one per edge, got "
                          f"'{text}'") from None


def edge_round_period(edge_periods: tuple[int, ...]) -> int:
    """g = gcd of the per-edge periods: the length (local steps) of one edge round."""
    return math.gcd(*edge_periods)


#: What the schedule refuses (docs/hsgd.md's table, :mod:`fedhier.settings.refusals`).
REFUSALS = (
    Refusal("`--edge-periods` with a period that does not divide the next level's",
            "no meaning: an edge period must divide the period above the edges",
            ("--local-period", "2", "--global-period", "8", "--edge-periods", "2,4,2,6"),
            "does not divide the next level's period"),
)

def validate_edge_periods(edge_periods: tuple[int, ...], periods: tuple[int, ...],
                          num_edges: int) -> None:
    """Raise ConfigError unless there is one positive period I_i per edge, each dividing the
    next level's period P_2 (the cloud's G on two levels), and ``periods[0]`` is their gcd."""
    if not edge_periods:
        return
    if len(edge_periods) != num_edges:
        raise ConfigError(f"edge_periods gives {len(edge_periods)} period(s) for {num_edges} "
                          f"edge(s) {list(edge_periods)}: give one per edge")
    if min(edge_periods) < 1:
        raise ConfigError(f"edge_periods must be positive integers, got {list(edge_periods)}")
    if len(periods) < 2:
        raise ConfigError("per-edge periods need a level above the edges")
    above = periods[1]
    bad = [p for p in edge_periods if above % p]
    if bad:
        raise ConfigError(f"edge period {bad[0]} does not divide the next level's period "
                          f"{above} (edge_periods {list(edge_periods)})")
    if periods[0] != edge_round_period(edge_periods):
        raise ConfigError(f"the edge-level period {periods[0]} must be the gcd "
                          f"{edge_round_period(edge_periods)} of edge_periods "
                          f"{list(edge_periods)}")


def check_schedule(periods: tuple[int, ...], groups: tuple[int, ...],
                   edge_periods: tuple[int, ...] = ()) -> None:
    """Every rule on the aggregation periods, in one place (``RunConfig.validate`` and
    ``HSGDSettings`` call it): one period per group level plus the cloud's, per-edge periods
    (:func:`validate_edge_periods`), and each period a multiple of the one below
    (:func:`validate_periods`)."""
    if len(periods) != len(groups) + 1:
        raise ConfigError(
            f"{len(groups)} group level(s) {list(groups)} need {len(groups) + 1} periods "
            f"(edge ... cloud), got {list(periods)}; set --periods")
    validate_edge_periods(edge_periods, periods, groups[0] if groups else 0)
    if len(periods) == 2 and min(periods) >= 1 and periods[1] % periods[0] != 0:
        raise ConfigError(f"global_period G={periods[1]} must be a multiple of local_period "
                          f"I={periods[0]}")
    validate_periods(periods)


def edge_levels_after(step: int, periods: tuple[int, ...], edge_periods: tuple[int, ...],
                      num_edges: int) -> np.ndarray:
    """int64 [num_edges]: the level each edge aggregates at after 0-based local step ``step``.

    The one schedule of every engine. Without per-edge periods every edge shares
    :func:`aggregation_level`; with them edge i follows periods (I_i, P_2, ..., P_L): it
    aggregates (level 1) when ``step + 1`` is a multiple of I_i, and every edge takes part in
    the higher levels' aggregations (each I_i divides P_2).
    """
    if not edge_periods:
        return np.full(num_edges, aggregation_level(step, periods), dtype=np.int64)
    return np.array([aggregation_level(step, (p, *periods[1:])) for p in edge_periods],
                    dtype=np.int64)


@dataclass(frozen=True)
class Hierarchy:
    """A tree of clients under edges (under regions ...) under one cloud.

    Attributes:
        periods: (P_1, ..., P_L) in local SGD iterations; P_L is the cloud period.
        parents: ``parents[k]`` maps each level-k node to its level-(k+1) node, for
            k = 0 .. L-2 (``parents[0]`` is client -> edge). The cloud (level L) is implicit.
        num_edges: the number of edges when fixed apart from ``parents[0]`` (client
            mobility, :meth:`with_edge_map`): an edge may then have no client at all (it
            keeps its model). 0 = every edge has a client and ``parents[0]`` says how many.
    """

    periods: tuple[int, ...]
    parents: tuple[np.ndarray, ...]
    num_edges: int = 0

    def __post_init__(self) -> None:
        validate_periods(self.periods)
        if len(self.parents) != len(self.periods) - 1:
            raise ConfigError(
                f"{len(self.periods)} periods need {len(self.periods) - 1} grouping level(s), "
                f"got {len(self.parents)}"
            )
        for k, parent in enumerate(self.parents):
            size_above = int(parent.max()) + 1 if parent.size else 0
            if k == 0 and self.num_edges:  # moving clients may leave an edge empty
                if size_above > self.num_edges or (parent.size and parent.min() < 0):
                    raise ConfigError(f"a client is mapped to an edge outside "
                                      f"0..{self.num_edges - 1}")
                size_above = self.num_edges
            elif parent.size and set(np.unique(parent).tolist()) != set(range(size_above)):
                raise ConfigError(f"grouping level {k + 1} leaves a group without members")
            if k + 1 < len(self.parents) and len(self.parents[k + 1]) != size_above:
                raise ConfigError(f"grouping level {k + 2} does not match level {k + 1}")

    @property
    def num_levels(self) -> int:
        """L: the number of aggregation levels (2 for clients -> edges -> cloud)."""
        return len(self.periods)

    @property
    def num_clients(self) -> int:
        return len(self.parents[0]) if self.parents else 0

    def num_nodes(self, level: int) -> int:
        """Number of nodes at ``level`` (0 = clients, L = cloud)."""
        if level >= self.num_levels:
            return 1
        if level == 0:
            return self.num_clients
        if level == 1 and self.num_edges:
            return self.num_edges
        return int(self.parents[level - 1].max()) + 1

    def with_edge_map(self, edge_of_client: np.ndarray) -> Hierarchy:
        """The same tree above the edges with clients at ``edge_of_client`` [n] (edges may
        be left empty: client mobility)."""
        return replace(self, parents=(np.asarray(edge_of_client, dtype=np.int64),
                                      *self.parents[1:]), num_edges=self.num_nodes(1))

    def ancestors(self, level: int) -> np.ndarray:
        """For each client, the index of its level-``level`` ancestor (level 0 = itself)."""
        node = np.arange(self.num_clients)
        if level >= self.num_levels:
            return np.zeros(self.num_clients, dtype=np.int64)
        for k in range(level):
            node = self.parents[k][node]
        return node.astype(np.int64)

    def edge_of_client(self) -> np.ndarray:
        """Client -> edge (level-1 node) index, shape [num_clients]."""
        return self.ancestors(1)

    def edges_under(self, level: int) -> np.ndarray:
        """For each edge, the index of its level-``level`` ancestor."""
        node = np.arange(self.num_nodes(1))
        if level >= self.num_levels:
            return np.zeros(len(node), dtype=np.int64)
        for k in range(1, level):
            node = self.parents[k][node]
        return node.astype(np.int64)

    def level_after(self, step: int) -> int:
        return aggregation_level(step, self.periods)


def build_hierarchy(periods: tuple[int, ...], groups: tuple[int, ...], grouping: str,
                    info: ClientInfo, seed: int, client_grads: torch.Tensor | None = None,
                    weights: np.ndarray | None = None) -> Hierarchy:
    """Group clients into ``groups[0]`` edges, edges into ``groups[1]`` regions, and so on.

    Every level uses the same grouping, applied to the level below's nodes described by their
    summed label histograms and row counts; level k draws with seed ``seed + k - 1``. The
    ``gradient`` grouping needs ``client_grads`` [n, P] and ``weights`` [n]; a node above the
    clients is then described by the weighted mean gradient of its members.
    """
    import torch  # here, not at the top: checking a configuration needs no torch

    from fedhier.round.aggregators.averaging import segment_weighted_mean

    parents = []
    level_info = info
    level_grads, level_weights = client_grads, weights
    by_gradient = "gradients" in grouping_needs(grouping)
    for level, count in enumerate(groups, start=1):
        rule: str | Grouping = grouping
        if by_gradient:
            if level_grads is None or level_weights is None:
                raise ConfigError("the gradient grouping needs the clients' gradients")
            rule = make_gradient_grouping(level_grads, level_weights)
        parent = assign_groups(rule, level_info, count, seed + level - 1)
        parents.append(parent)
        if level_grads is not None and level_weights is not None:
            level_grads = segment_weighted_mean(level_grads, torch.as_tensor(level_weights),
                                                torch.as_tensor(parent), count)
            level_weights = np.bincount(parent, weights=level_weights, minlength=count)
        histograms = np.zeros((count, level_info.label_histograms.shape[1]), dtype=np.int64)
        np.add.at(histograms, parent, level_info.label_histograms)
        level_info = ClientInfo(label_histograms=histograms,
                                num_examples=np.bincount(parent, weights=level_info.num_examples,
                                                         minlength=count).astype(np.int64))
    return Hierarchy(tuple(periods), tuple(parents))

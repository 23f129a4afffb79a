"""The clients' own metrics, aggregated at every level of the tree as FedAvg aggregates them.

FedAvg hands each round's replies to ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``
(``(list[RecordDict], weighted_by_key) -> MetricRecord``; default: Flower's
``aggregate_metricrecords``, the ``weighted_by_key``-weighted mean of every key). HierFedAvg
does the same at each level: an edge's record is the function of its clients' replies; above
it, each node's record is the function of its children's records, each passed as
``RecordDict({"metrics": record + {weighted_by_key: the child's total weight}})``; the cloud's
record is the top one. With the default (a weighted mean) the cloud's record is the weighted
mean over all the clients' replies, as FedAvg's would be.

Which replies: a cloud round's train replies (every edge round of it, each (client, edge round)
one reply, the client under the edge it trained in), and the evaluate replies after it. By
default the keys HierFedAvg reads itself (:data:`OWN_KEYS`: sizes, losses, accuracies, the
held-out numbers) and those that name a client or a round are left out, so only a client's own
keys are aggregated (fedhier's own ClientApp has none); a given function gets the replies whole,
as FedAvg gives them. The record keys are ``train_metrics`` / ``evaluate_metrics`` (the cloud's,
names as the clients gave them) and ``edge_train_metrics`` / ``edge_evaluate_metrics`` (one dict
per edge, {} for an edge without replies), present only when not empty (docs/contract.md).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedhier.clients.wire.keys import ACCURACY_KEYS, LOSS_KEYS, NUM_EXAMPLES, TRAIN_LOSS_KEYS
from fedhier.tree.hierarchy import Hierarchy

log = logging.getLogger("fedhier")

#: FedAvg's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``.
MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]

#: Reply keys that are not a client's own metrics: what the contract reads, and what names a
#: client or a round (fedhier's own ClientApp sends ``partition-id`` and ``local-steps``).
OWN_KEYS = frozenset({NUM_EXAMPLES, *TRAIN_LOSS_KEYS, *LOSS_KEYS, *ACCURACY_KEYS,
                      "holdout-loss", "holdout-accuracy", "holdout-examples", "partition-id",
                      "local-steps", "edge-round", "server-round", "start-step"})


def own_metrics(contents: list[RecordDict], weighted_by_key: str,
                skip: frozenset[str] = OWN_KEYS) -> list[RecordDict]:
    """The replies' MetricRecords without the keys in ``skip`` (the weight kept); replies
    with nothing else left out."""
    out = []
    for content in contents:
        records: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {}
        for name, record in content.metric_records.items():
            kept = {k: v for k, v in record.items() if k not in skip or k == weighted_by_key}
            if kept.keys() - {weighted_by_key}:
                records[name] = MetricRecord(kept)
        if records:
            first = next(iter(content.metric_records.values()))
            weight = first.get(weighted_by_key)
            head = records[next(iter(records))]
            assert isinstance(head, MetricRecord)
            if weight is not None and weighted_by_key not in head:
                head[weighted_by_key] = weight
            out.append(RecordDict(records))
    return out


class LevelMetrics:
    """One kind of reply (train or evaluate) of one cloud round at a time, aggregated by
    ``fn`` at every level (None: :func:`own_metrics`, then Flower's weighted mean)."""

    def __init__(self, fn: MetricsAggregation | None, weighted_by_key: str,
                 skip: frozenset[str] = OWN_KEYS) -> None:
        self.fn = fn
        self.weighted_by_key = weighted_by_key
        self.skip = skip
        self.replies: dict[int, list[tuple[int, int | None, RecordDict]]] = defaultdict(list)
        self.warned = False

    def note(self, cloud_round: int, client: int, content: RecordDict,
             edge: int | None = None) -> None:
        """A usable reply of ``cloud_round`` from ``client``, under ``edge`` (None: the edge
        the tree puts it in when the round's records are made)."""
        self.replies[cloud_round].append((client, edge, content))

    def _apply(self, contents: list[RecordDict], first_level: bool) -> dict[str, Any] | None:
        if self.fn is None:
            if first_level:
                contents = own_metrics(contents, self.weighted_by_key, self.skip)
            if not contents:
                return None
            try:
                aggregated = aggregate_metricrecords(contents, self.weighted_by_key)
            except (ValueError, TypeError) as exc:  # e.g. lists of different lengths
                if not self.warned:
                    log.warning("the clients' own metrics cannot be averaged (%s): not "
                                "recorded; pass HierFedAvg(train_metrics_aggr_fn=..., "
                                "evaluate_metrics_aggr_fn=...) for them", exc)
                    self.warned = True
                return None
        else:
            aggregated = self.fn(contents, self.weighted_by_key)
        return dict(aggregated) if aggregated is not None else None

    def _weight(self, content: RecordDict) -> float:
        first = next(iter(content.metric_records.values()), None)
        value = first.get(self.weighted_by_key, 0) if first is not None else 0
        return float(value) if isinstance(value, int | float) else 0.0

    def records(self, cloud_round: int, hierarchy: Hierarchy) -> tuple[list[dict[str, Any]],
                                                                        dict[str, Any]]:
        """(each edge's record, the cloud's record) of ``cloud_round``'s replies, which are
        forgotten; ([], {}) when nothing was aggregated."""
        replies = self.replies.pop(cloud_round, [])
        if not replies:
            return [], {}
        edge_of = hierarchy.edge_of_client()
        by_node: dict[int, list[RecordDict]] = defaultdict(list)
        for client, edge, content in replies:
            by_node[int(edge_of[client]) if edge is None else edge].append(content)
        edges: list[dict[str, Any]] = [{} for _ in range(hierarchy.num_nodes(1))]
        level_records: dict[int, tuple[dict[str, Any], float]] = {}
        for node, contents in by_node.items():
            record = self._apply(contents, first_level=True)
            if record is not None:
                level_records[node] = (record, sum(self._weight(c) for c in contents))
                edges[node] = record
        if not level_records:
            return [], {}
        for level in range(1, hierarchy.num_levels):  # level -> level + 1, up to the cloud
            parent = (hierarchy.parents[level] if level < hierarchy.num_levels - 1 else None)
            grouped: dict[int, list[tuple[dict[str, Any], float]]] = defaultdict(list)
            for node, entry in level_records.items():
                grouped[0 if parent is None else int(parent[node])].append(entry)
            level_records = {}
            for node, entries in grouped.items():
                children = [RecordDict({"metrics": MetricRecord(
                    {**record, self.weighted_by_key: weight})}) for record, weight in entries]
                record = self._apply(children, first_level=False)
                if record is not None:
                    level_records[node] = (record, sum(weight for _, weight in entries))
        top = level_records.get(0)
        return edges, (top[0] if top is not None else {})


class ReplyMetrics:
    """The train and evaluate :class:`LevelMetrics` of a run (a GridExecutor's)."""

    def __init__(self, train_fn: MetricsAggregation | None = None,
                 evaluate_fn: MetricsAggregation | None = None,
                 weighted_by_key: str = NUM_EXAMPLES,
                 named: frozenset[str] = frozenset()) -> None:
        """``named``: reply keys HierFedAvg was told to read (``loss_key`` ...): not the
        clients' own metrics either."""
        self.train = LevelMetrics(train_fn, weighted_by_key, OWN_KEYS | named)
        self.evaluate = LevelMetrics(evaluate_fn, weighted_by_key, OWN_KEYS | named)

    def record(self, cloud_round: int, hierarchy: Hierarchy) -> dict[str, Any]:
        """The record keys of ``cloud_round`` (none when no reply had metrics of its own)."""
        out: dict[str, Any] = {}
        for kind, level in (("train", self.train), ("evaluate", self.evaluate)):
            edges, cloud = level.records(cloud_round, hierarchy)
            if cloud or any(edges):
                out[f"{kind}_metrics"] = cloud
                out[f"edge_{kind}_metrics"] = edges
        return out

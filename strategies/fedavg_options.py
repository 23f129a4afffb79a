"""What HierFedAvg takes of Flower's FedAvg: its constructor's arguments, with their meaning
under a hierarchy (docs/contract.md, "FedAvg's arguments").

``flwr.serverapp.strategy.FedAvg(fraction_train, fraction_evaluate, min_train_nodes,
min_evaluate_nodes, min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
train_metrics_aggr_fn, evaluate_metrics_aggr_fn)``: every one is a keyword of ``HierFedAvg``
too. Here they are checked (one line each) and turned into what the algorithm and the executor
take: the participation of :class:`fedhier.round.participants.Workload`, the nodes to wait for, the
reply keys and the metric aggregations (:mod:`fedhier.strategies.reply_metrics`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from logging import INFO

from flwr.supercore import log

from fedhier.clients.wire.keys import NUM_EXAMPLES
from fedhier.common.errors import ConfigError
from fedhier.round.participants import Workload
from fedhier.strategies.reply_metrics import MetricsAggregation, ReplyMetrics


@dataclass(frozen=True)
class FedAvgOptions:
    """FedAvg's constructor arguments as HierFedAvg takes them, and the reply keys it reads.

    Attributes:
        fraction_train: each edge trains this fraction of its clients per edge round (at
            least one; seeded by (seed, edge round, edge), the same on every engine). None:
            the ``workload``'s participation (default every client).
        fraction_evaluate: accepted; every client evaluates (named once in the log).
        min_train_nodes, min_evaluate_nodes, min_available_nodes: the run waits until this
            many nodes are connected (the largest of the three), as FedAvg's sampling does.
        weighted_by_key: the reply key of a client's size (train and evaluate replies).
        arrayrecord_key, configrecord_key: the record names in messages.
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: FedAvg's metric aggregations,
            applied at every level (None: the weighted mean of the clients' own keys).
        loss_key, accuracy_key, train_loss_key: a reply key read before the contract's names
            for the evaluate loss and accuracy and the mean train loss.
    """

    fraction_train: float | None = None
    fraction_evaluate: float = 1.0
    min_train_nodes: int | None = None
    min_evaluate_nodes: int | None = None
    min_available_nodes: int = 1
    weighted_by_key: str = NUM_EXAMPLES
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    train_metrics_aggr_fn: MetricsAggregation | None = None
    evaluate_metrics_aggr_fn: MetricsAggregation | None = None
    loss_key: str | None = None
    accuracy_key: str | None = None
    train_loss_key: str | None = None

    def __post_init__(self) -> None:
        f = self.fraction_train
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float)
                              or not 0 < f <= 1):
            why = (": a round in which no client trains has nothing to aggregate at any level "
                   "(evaluate a fixed model with evaluate_fn instead)" if f == 0 else "")
            raise ConfigError(f"fraction_train must be in (0, 1], got {f!r}{why}")
        if not 0 <= self.fraction_evaluate <= 1:
            raise ConfigError(f"fraction_evaluate must be in [0, 1], got "
                              f"{self.fraction_evaluate!r}")
        for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")
        for name in ("weighted_by_key", "arrayrecord_key", "configrecord_key", "loss_key",
                     "accuracy_key", "train_loss_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be a function (list[RecordDict], str) -> "
                                  "MetricRecord, as FedAvg's")

    def workload(self, given: Workload | None) -> Workload:
        """``given`` (default: every client) with ``fraction_train`` as its participation."""
        workload = given or Workload()
        if self.fraction_train is None:
            return workload
        if given is not None and given.participation not in (1.0, self.fraction_train):
            raise ConfigError(f"fraction_train={self.fraction_train} and workload's "
                              f"participation={given.participation} disagree; give one")
        return dataclasses.replace(workload, participation=float(self.fraction_train))

    @property
    def nodes_to_wait_for(self) -> int:
        """Nodes that must be connected before the run starts."""
        return max(self.min_available_nodes, self.min_train_nodes or 0,
                   self.min_evaluate_nodes or 0)

    def reply_metrics(self) -> ReplyMetrics:
        """A fresh collector of the clients' own metrics for a run's executor."""
        named = frozenset(k for k in (self.loss_key, self.accuracy_key, self.train_loss_key)
                          if k is not None)
        return ReplyMetrics(self.train_metrics_aggr_fn, self.evaluate_metrics_aggr_fn,
                            self.weighted_by_key, named)

    def log_summary(self, participation: float) -> None:
        """FedAvg's summary lines (sampling, keys in records), as HierFedAvg reads them."""
        log(INFO, "\t├──> Sampling:")
        log(INFO, "\t│\t├──Fraction: train (%.2f per edge and edge round) | evaluate "
            "(every client)", participation)
        log(INFO, "\t│\t└──Minimum available nodes: %d", self.nodes_to_wait_for)
        log(INFO, "\t├──> Keys in records:")
        log(INFO, "\t│\t├── Weighted by: '%s'", self.weighted_by_key)
        log(INFO, "\t│\t├── ArrayRecord key: '%s'", self.arrayrecord_key)
        log(INFO, "\t│\t└── ConfigRecord key: '%s'", self.configrecord_key)

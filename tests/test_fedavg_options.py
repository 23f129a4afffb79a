"""HierFedAvg takes what Flower's FedAvg takes (issue 42), checked against closed forms.

A ClientApp of constants: client j (partition id j) replies the model v_j = j + 1 with
n_j = 10 (j + 1) + edge round rows and its own metrics ``my-metric`` = j + edge round /
10 and ``sq`` = j^2; it evaluates with m_j = 1 + 3 j rows, ``accuracy`` j / 10, its loss
under ``test_logloss`` = 2 j and its own ``auc`` = 1 / (j + 1). Hence:

- ``fraction_train=0.5`` trains ceil(4 / 2) = 2 of each edge's 4 clients per edge round, the
  very clients ``workload=Workload(participation=0.5)`` trains;
- the clients' own train metrics of a cloud round are, per edge and at the cloud, the
  n-weighted means over that round's replies (every edge round), exactly; the contract's
  keys (num-examples, partition-id, ...) are not among them; ``Result`` holds the cloud's;
- a loss under another key is dropped with a warning naming the keys it looked for, and
  read when named (``loss_key``); the evaluate reply's own metrics are aggregated either way;
- a given ``train_metrics_aggr_fn`` is applied at every level of a three-level tree: edges,
  regions, cloud (a maximum and a count of replies, which no weighted mean gives);
- ``weighted_by_key`` names the size key (the model is then the mean weighted by it);
- FedAvg's log shape: "Starting HierFedAvg strategy:", its sampling and keys lines, one line
  per cloud round, "Strategy execution finished", "Final results:".
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.round.participants import Workload
from fedhier.strategies.hierfedavg import HierFedAvg

NUM, SEED = 8, 5


def constant_app(size_key: str = "num-examples", calls: list | None = None) -> ClientApp:
    app = ClientApp()

    @app.query()
    def profile(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord(
            # at least the rows any reply claims (claims past it are capped: docs/security.md)
            {"partition-id": pid, "num-examples": 10 * (pid + 1) + 10})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        edge_round = int(msg.content["config"]["edge-round"])
        if calls is not None:
            calls.append((edge_round, pid))
        arrays = {k: torch.full_like(v, pid + 1.0)
                  for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        metrics = {size_key: 10 * (pid + 1) + edge_round, "partition-id": pid,
                   "local-steps": int(msg.content["config"]["local-steps"]),
                   "train-loss": 0.5, "my-metric": pid + edge_round / 10, "sq": float(pid ** 2)}
        return Message(RecordDict({"arrays": ArrayRecord(arrays),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord(
            {"test_logloss": 2.0 * pid, "accuracy": pid / 10, size_key: 1 + 3 * pid,
             "auc": 1 / (pid + 1)})}), reply_to=msg)

    return app


def run(strategy: HierFedAvg, app: ClientApp, rounds: int = 2) -> tuple[Any, list[dict]]:
    records: list[dict[str, Any]] = []
    grid = InProcessGrid(app, NUM, seed=SEED)
    try:
        result = strategy.start(grid, ArrayRecord({"w": torch.zeros(3)}), num_rounds=rounds,
                                on_cloud_round=records.append)
    finally:
        grid.close()
    return result, records


def hier(**kwargs: Any) -> HierFedAvg:
    options: dict[str, Any] = dict(local_period=1, global_period=2, num_groups=2,
                                   grouping="contiguous", seed=SEED)
    return HierFedAvg(**{**options, **kwargs})


def weighted(pairs: list[tuple[float, float]]) -> float:
    return sum(w * v for w, v in pairs) / sum(w for w, _ in pairs)


def test_fraction_train_trains_that_fraction_of_each_edges_clients():
    calls: list[tuple[int, int]] = []
    run(hier(fraction_train=0.5), constant_app(calls=calls))
    by_round: dict[int, list[int]] = {}
    for edge_round, pid in calls:
        by_round.setdefault(edge_round, []).append(pid)
    assert sorted(by_round) == [1, 2, 3, 4]
    for pids in by_round.values():  # contiguous: edge 0 = clients 0-3, edge 1 = 4-7
        assert len(pids) == NUM // 2
        assert sum(p < 4 for p in pids) == 2 and sum(p >= 4 for p in pids) == 2
    assert len({tuple(sorted(p)) for p in by_round.values()}) > 1  # drawn anew each round
    same: list[tuple[int, int]] = []
    run(hier(workload=Workload(participation=0.5)), constant_app(calls=same))
    assert sorted(same) == sorted(calls)


def test_fraction_train_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"fraction_train must be in \(0, 1\], got 0: a round "
                                          r"in which no client trains"):
        hier(fraction_train=0)
    with pytest.raises(ConfigError, match="disagree"):
        hier(fraction_train=0.5, workload=Workload(participation=0.25))
    with pytest.raises(ConfigError, match="min_train_nodes must be a whole number"):
        hier(min_train_nodes=-1)
    assert hier(min_train_nodes=NUM, min_evaluate_nodes=3).min_available_nodes == NUM


def test_clients_own_metrics_are_weighted_means_per_edge_and_at_the_cloud(caplog):
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        result, records = run(hier(), constant_app())
    for record in records[1:]:
        edge_rounds = [2 * record["round"] - 1, 2 * record["round"]]
        replies = [(pid, e) for e in edge_rounds for pid in range(NUM)]

        def mean(key: str, members: range, rows: list[tuple[int, int]] = replies) -> float:
            values = {"my-metric": lambda p, e: p + e / 10, "sq": lambda p, e: float(p * p)}
            return weighted([(10 * (p + 1) + e, values[key](p, e))
                             for p, e in rows if p in members])

        assert set(record["train_metrics"]) == {"my-metric", "sq"}
        for key in ("my-metric", "sq"):
            assert math.isclose(record["train_metrics"][key], mean(key, range(NUM)),
                                rel_tol=1e-12)
            for edge, members in enumerate((range(4), range(4, 8))):
                assert math.isclose(record["edge_train_metrics"][edge][key],
                                    mean(key, members), rel_tol=1e-12)
        assert dict(result.train_metrics_clientapp[record["round"]])["my-metric"] == \
            record["train_metrics"]["my-metric"]
    # the loss under test_logloss: no train_loss, a warning naming what was looked for,
    # and the evaluate reply's own keys still aggregated (weighted by its rows)
    assert all("train_loss" not in r for r in records)
    assert "without a loss (loss/eval_loss)" in caplog.text and "loss_key" in caplog.text
    expected_auc = weighted([(1 + 3 * p, 1 / (p + 1)) for p in range(NUM)])
    for record in records:
        assert math.isclose(record["evaluate_metrics"]["auc"], expected_auc, rel_tol=1e-12)
        assert math.isclose(record["evaluate_metrics"]["test_logloss"],
                            weighted([(1 + 3 * p, 2.0 * p) for p in range(NUM)]),
                            rel_tol=1e-12)
    assert math.isclose(dict(result.evaluate_metrics_clientapp[2])["auc"], expected_auc,
                        rel_tol=1e-12)


def test_a_loss_under_another_key_is_read_when_named():
    _, records = run(hier(loss_key="test_logloss"), constant_app())
    rows = [1 + 3 * p for p in range(NUM)]
    for record in records:
        assert math.isclose(record["train_loss"],
                            weighted([(m, 2.0 * p) for p, m in enumerate(rows)]), rel_tol=1e-12)
        assert math.isclose(record["train_accuracy"],
                            weighted([(m, p / 10) for p, m in enumerate(rows)]), rel_tol=1e-12)


def test_a_given_aggregation_is_applied_at_every_level_of_the_tree():
    seen: list[int] = []

    def maximum(contents: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        metrics = [next(iter(c.metric_records.values())) for c in contents]
        seen.append(len(contents))
        return MetricRecord({"max": max(m.get("max", m.get("my-metric", -1.0)) for m in metrics),
                             "count": sum(m.get("count", 1) for m in metrics)})

    strategy = hier(num_groups=(4, 2), periods=(1, 2, 4), global_period=4,
                    train_metrics_aggr_fn=maximum)
    _, records = run(strategy, constant_app(), rounds=1)
    record = records[1]
    # 4 edge rounds x 8 clients; edges of 2 clients (contiguous), regions of 2 edges
    assert record["train_metrics"] == {"max": 7 + 4 / 10, "count": 32}
    assert [e["count"] for e in record["edge_train_metrics"]] == [8, 8, 8, 8]
    assert [e["max"] for e in record["edge_train_metrics"]] == [1.4, 3.4, 5.4, 7.4]
    assert sorted(seen) == [2, 2, 2, 8, 8, 8, 8]  # 4 edges, 2 regions, the cloud


def test_weighted_by_key_names_the_size_key():
    result, _ = run(hier(weighted_by_key="n", loss_key="test_logloss"), constant_app("n"))
    n = 10 * (np.arange(NUM) + 1) + 4  # the last edge round's rows
    expected = float(np.dot(n, np.arange(NUM) + 1) / n.sum())
    assert torch.allclose(result.arrays.to_torch_state_dict()["w"],
                          torch.full((3,), expected), atol=1e-6)


def test_flower_log_shape_header_rounds_and_final_summary(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        run(hier(fraction_train=0.5, loss_key="test_logloss"), constant_app())
    lines = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert lines[0] == "Starting HierFedAvg strategy:"
    assert "\t│\t├──Fraction: train (0.50 per edge and edge round) | evaluate (every client)" \
        in lines
    assert "\t│\t├── Weighted by: 'num-examples'" in lines
    rounds = [line for line in lines if line.startswith("[CLOUD ROUND")]
    assert [r.split("]")[0] for r in rounds] == ["[CLOUD ROUND 0/2", "[CLOUD ROUND 1/2",
                                                 "[CLOUD ROUND 2/2"]
    assert any(line.startswith("Strategy execution finished in") for line in lines)
    assert lines.index("Final results:") > lines.index(rounds[-1])
    assert "\tAggregated ClientApp-side Train Metrics:" in lines

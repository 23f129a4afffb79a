"""examples/sklearn-hier: a scikit-learn logistic regression under HierFedAvg (issue 42).

- its ``load_data`` returns ``(X_train, y_train, X_test, y_test)`` and ``register_profile``
  takes it as it is: the clients are weighted by their training rows, never the test rows;
- the run equals an independent hierarchical loop written here with scikit-learn alone
  (docs/contract.md, "Clients that do not train by mini-batch SGD"): each edge round every
  client runs ``local-steps`` = I lbfgs iterations from its edge's model, each edge averages
  its clients weighted by their training rows, and every G iterations the cloud averages
  all; to 1e-9;
- the evaluate replies' loss under ``test_logloss`` (named: ``loss_key``) is the record's
  train_loss, and their own ``f1`` is aggregated into ``evaluate_metrics``.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedhier.clients.profile import training_labels_of_split
from fedhier.engines.inprocess_grid import InProcessGrid

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sklearn-hier"
NUM = 6


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("sklearn")
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield {name: importlib.import_module(f"sklearnhier.{name}")
               for name in ("task", "client_app", "server_app")}
    finally:
        sys.path.remove(str(EXAMPLE))
        for name in [m for m in sys.modules if m.startswith("sklearnhier")]:
            del sys.modules[name]


def config(**changes: Any) -> dict[str, Any]:
    base = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    return {**base["config"], "num-server-rounds": 2, **changes}


def run(example: dict, cfg: dict) -> tuple[Any, list[dict], Any]:
    strategy = example["server_app"].strategy_for(cfg)
    records: list[dict[str, Any]] = []
    grid = InProcessGrid(example["client_app"].app, NUM, run_config=cfg)
    try:
        result = strategy.start(grid, ArrayRecord(example["task"].initial_params()),
                                num_rounds=cfg["num-server-rounds"],
                                train_config=ConfigRecord(
                                    {"regularization-c": cfg["regularization-c"]}),
                                on_cloud_round=records.append)
    finally:
        grid.close()
    return strategy, records, result


def test_the_four_tuple_shape_is_taken_as_training_rows():
    x_tr, y_tr, x_te, y_te = np.zeros((30, 2)), np.arange(30) % 3, np.zeros((8, 2)), np.ones(8)
    assert training_labels_of_split((x_tr, y_tr, x_te, y_te))[1] is y_tr
    assert training_labels_of_split(((x_tr, y_tr), (x_te, y_te)))[1] is y_tr
    plain = ([0, 1], [2, 3])  # lists are never taken for a split
    assert training_labels_of_split(plain) is plain


def test_weighted_by_training_rows_and_equal_to_an_independent_hierarchical_loop(example):
    cfg = config()
    strategy, records, result = run(example, cfg)
    task = example["task"]
    data = [task.load_data(j, NUM, cfg["seed"]) for j in range(NUM)]
    train_rows = np.array([len(d[1]) for d in data], dtype=float)
    test_rows = np.array([len(d[3]) for d in data], dtype=float)
    assert not np.array_equal(train_rows, test_rows)
    assert strategy.client_weights().tolist() == train_rows.tolist()

    # the oracle: scikit-learn and numpy only, the strategy's edges
    edge_of = strategy.hierarchy.edge_of_client()
    period, cloud_period = cfg["local-period"], cfg["global-period"]
    params = task.initial_params()
    for _ in range(cfg["num-server-rounds"]):
        edges = {e: [p.copy() for p in params] for e in set(edge_of.tolist())}
        for _ in range(cloud_period // period):
            trained = {}
            for j, (x, y, _, _) in enumerate(data):
                model = task.set_params(task.new_model(cfg["regularization-c"], period),
                                        edges[int(edge_of[j])])
                trained[j] = [p.copy() for p in task.get_params(task.fit(model, x, y))]
            for e in edges:
                members = [j for j in range(NUM) if edge_of[j] == e]
                w = train_rows[members] / train_rows[members].sum()
                edges[e] = [sum(w[i] * trained[j][k] for i, j in enumerate(members))
                            for k in range(2)]
        w = train_rows / train_rows.sum()
        params = [sum(w[j] * trained[j][k] for j in range(NUM)) for k in range(2)]
    got = result.arrays.to_numpy_ndarrays()
    assert max(float(np.abs(g - p).max()) for g, p in zip(got, params, strict=True)) < 1e-9

    # the named loss is train_loss (weighted by test rows), the replies' own f1 aggregated;
    # train replies hold nothing of their own (train_logloss is named: local_train_loss)
    from sklearn.metrics import f1_score, log_loss

    final, model = records[-1], task.set_params(task.new_model(), params)
    losses = [log_loss(y, model.predict_proba(x), labels=np.arange(10)) for _, _, x, y in data]
    f1s = [f1_score(y, model.predict(x), average="macro") for _, _, x, y in data]
    assert abs(final["train_loss"] - float(np.dot(test_rows, losses) / test_rows.sum())) < 1e-9
    assert set(final["evaluate_metrics"]) == {"f1"} and "train_metrics" not in final
    assert abs(final["evaluate_metrics"]["f1"] - float(np.dot(test_rows, f1s) / test_rows.sum())
               ) < 1e-12
    assert final["local_train_loss"] is not None
    assert final["train_accuracy"] > records[0]["train_accuracy"] + 0.3

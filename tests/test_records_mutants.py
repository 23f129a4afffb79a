"""Exact values of the round's records part (fedhier/round/record_fields.py), case by case: the
tests written against its mutation survivors (docs/testing.md, "Mutation testing")."""

import logging

import numpy as np
import pytest
import torch

import fedhier.round.record_fields as records
from fedhier.diagnostics.in_rounds import client_diagnostics
from fedhier.round.executor import ClientEvaluation
from fedhier.round.record_fields import (
    client_accuracy_summary,
    diagnostics_record,
    evaluation_metrics,
)
from fedhier.tree.hierarchy import Hierarchy

NAN = float("nan")
TREE = Hierarchy((1, 2), (np.array([0, 0, 1, 1], dtype=np.int64),))


def evaluation(holdout=None) -> ClientEvaluation:
    return ClientEvaluation(loss=np.array([0.5, NAN, 1.0, 2.0]),
                            accuracy=np.array([0.75, NAN, 0.5, 0.25]),
                            holdout_accuracy=None if holdout is None else np.array(holdout))


def test_train_metrics_are_weighted_over_the_clients_that_answered():
    out = evaluation_metrics(evaluation(), np.array([1.0, 9.0, 2.0, 1.0]))
    # weights 1, 2, 1 over clients 0, 2, 3: (0.5 + 2 + 2) / 4 and (0.75 + 1 + 0.25) / 4
    assert out == {"train_loss": 1.125, "train_accuracy": 0.5}
    assert all(type(v) is float for v in out.values())
    # held-out accuracies all missing: no summary
    assert evaluation_metrics(evaluation([NAN] * 4), np.array([1.0, 9.0, 2.0, 1.0])) == out


def test_nobody_answered_records_nothing():
    nobody = ClientEvaluation(loss=np.full(3, NAN), accuracy=np.full(3, NAN),
                              holdout_accuracy=np.array([0.5, 0.5, 0.5]))
    assert evaluation_metrics(nobody, np.ones(3)) == {}


def test_the_held_out_summary_skips_the_missing_clients():
    out = evaluation_metrics(evaluation([1.0, NAN, 0.0, 0.5]), np.ones(4))
    assert out["client_accuracy_mean"] == 0.5 and out["client_accuracy_worst"] == 0.0
    # the 10th percentile of 0, 0.5, 1 (linear): 0.2 of the way from 0 to 0.5
    assert out["client_accuracy_p10"] == pytest.approx(0.1, abs=1e-16)
    assert out["client_accuracies"] == [1.0, None, 0.0, 0.5]
    summary = client_accuracy_summary(np.array([0.9, 0.3, NAN]))
    assert summary["client_accuracy_worst"] == 0.3
    assert summary["client_accuracy_mean"] == pytest.approx(0.6, abs=1e-15)
    assert summary["client_accuracy_p10"] == pytest.approx(0.36, abs=1e-15)  # 0.3 + 0.1 * 0.6
    assert all(type(summary[k]) is float for k in ("client_accuracy_mean",
                                                    "client_accuracy_p10",
                                                    "client_accuracy_worst"))
    assert [type(a) for a in summary["client_accuracies"]] == [float, float, type(None)]


class Executor:
    def __init__(self, grads) -> None:
        self.grads = grads
        self.asked: list = []

    def client_gradients(self, params):
        self.asked.append(params)
        return self.grads


GRADS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5e3, 5e3], [1.0, 1.0]], dtype=torch.float64)


def test_without_gradients_diagnostics_warn_and_record_nothing(caplog):
    params = {"w": torch.zeros(2)}
    executor = Executor(None)
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        assert diagnostics_record(executor, params, np.ones(4), TREE, 3) == {}
    assert executor.asked == [params]
    assert [r.getMessage() for r in caplog.records] == [
        "divergences need every client's gradient (query.gradient, docs/contract.md): not "
        "recorded for round 3"]


def test_diagnostics_are_those_of_the_clients_gradients():
    grads = GRADS.clone()
    grads[2] = torch.tensor([3.0, -1.0], dtype=torch.float64)
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    got = diagnostics_record(Executor(grads), {}, weights, TREE, 1)
    assert got == client_diagnostics(grads, weights, TREE)
    assert "diagnostics_flagged_clients" not in got


def test_an_outlying_gradient_is_flagged_and_left_out():
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    got = diagnostics_record(Executor(GRADS.clone()), {}, weights, TREE, 1)
    kept = GRADS.clone()
    kept[2] = 0.0
    want = client_diagnostics(kept, np.array([1.0, 2.0, 0.0, 4.0]), TREE)
    assert got == {"diagnostics_flagged_clients": [2], **want}
    assert list(got)[0] == "diagnostics_flagged_clients"


def test_the_part_makes_its_tensors_on_the_gradients_device(monkeypatch):
    """Under another default device (meta) the flagged gradients are zeroed where they are
    (the diagnostics themselves are replaced by a recorder: their own tests cover them)."""
    seen = []
    monkeypatch.setattr(records, "client_diagnostics",
                        lambda g, w, h: seen.append((g.device.type, g.tolist(), w.tolist()))
                        or {"x": 1})
    grads = GRADS.clone()
    with torch.device("meta"):
        got = diagnostics_record(Executor(grads), {}, np.array([1.0, 2.0, 3.0, 4.0]), TREE, 1)
    assert got == {"diagnostics_flagged_clients": [2], "x": 1}
    assert seen == [("cpu", [[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 1.0]],
                     [1.0, 2.0, 0.0, 4.0])]

"""Exact values of the round's executor seam (fedhier/round/executor.py): the tests written
against its mutation survivors (docs/testing.md, "Mutation testing")."""

import numpy as np
import torch

from fedhier.round.executor import ClientEvaluation, EdgeRoundWork, device_of

NAN = float("nan")


def test_the_start_edges_are_the_edges_unless_a_handoff_says_otherwise():
    edge_of = np.array([0, 1, 1], dtype=np.int64)
    plain = EdgeRoundWork(1, 1, 0, np.arange(3), np.full(3, 2), edge_of)
    assert plain.start_edges is edge_of
    moved = np.array([1, 1, 0], dtype=np.int64)
    assert EdgeRoundWork(1, 1, 0, np.arange(3), np.full(3, 2), edge_of,
                         start_edge_of_client=moved).start_edges is moved


def test_unanswered_is_nan_numbers_and_zero_rows():
    e = ClientEvaluation.unanswered(3)
    assert np.isnan(e.loss).all() and np.isnan(e.accuracy).all() and len(e.loss) == 3
    assert e.holdout_accuracy is not None and np.isnan(e.holdout_accuracy).all()
    assert len(e.accuracy) == len(e.holdout_accuracy) == 3
    assert e.num_examples is not None and e.num_examples.dtype == np.int64
    assert e.num_examples.tolist() == [0, 0, 0]
    assert e.if_answered() is None


def test_if_answered_drops_held_out_accuracies_nobody_has():
    e = ClientEvaluation.unanswered(3)
    e.loss[1] = 0.5
    e.accuracy[1] = 1.0
    out = e.if_answered()
    assert out is not None and out is not e and out.holdout_accuracy is None
    assert out.loss is e.loss and out.num_examples is e.num_examples
    e.holdout_accuracy[2] = 0.25
    assert e.if_answered() is e
    no_holdout = ClientEvaluation(loss=np.array([1.0, NAN]), accuracy=np.array([0.5, NAN]))
    assert no_holdout.if_answered() is no_holdout


def test_device_of_is_the_first_tensor_s():
    params = {"a": torch.zeros(1, device="meta"), "b": torch.zeros(1)}
    assert device_of(params).type == "meta"

"""Exact values of the round's weights part (fedhier/round/weights.py), case by case: the
tests written against its mutation survivors (docs/testing.md, "Mutation")."""

import numpy as np
import pytest

from fedhier.round.weights import evaluation_weights, learned_sizes, weights_of

I64 = np.int64


def test_weights_of_uses_the_claims_capped_by_the_histograms_under_samples():
    claimed = np.array([10, 30, 20], dtype=I64)
    histograms = np.array([[4, 6], [10, 10], [5, 15]], dtype=I64)  # sums 10, 20, 20
    weights = weights_of(claimed, histograms, "samples", 0.0)
    assert weights.dtype == np.float64
    assert weights.tolist() == [10.0, 20.0, 20.0]  # client 1 claims 30, its histogram 20


def test_weights_of_ignores_histograms_of_another_length_and_caps_at_the_ratio():
    claimed = np.array([10, 10, 10, 1000], dtype=I64)
    histograms = np.zeros((2, 3), dtype=I64)  # not one row per client: not used
    assert weights_of(claimed, histograms, "samples", 0.0).tolist() == [10, 10, 10, 1000]
    # median 10, ratio 5: at most 50 rows
    assert weights_of(claimed, histograms, "samples", 5.0).tolist() == [10, 10, 10, 50]


def test_weights_of_uniform_is_one_each_whatever_the_claims():
    claimed = np.array([3, 0, 70], dtype=I64)
    assert weights_of(claimed, np.zeros((3, 2), dtype=I64), "uniform", 10.0).tolist() == \
        [1.0, 1.0, 1.0]


def test_learned_sizes_from_a_train_reply_replace_known_sizes():
    known = np.array([5, 0, 7, 9], dtype=I64)
    out = learned_sizes(known, np.array([0, 1, 3], dtype=I64), np.array([6, 4, 9], dtype=I64),
                        trained=True)
    assert out is not None and out.dtype == I64
    assert out.tolist() == [6, 4, 7, 9]
    assert known.tolist() == [5, 0, 7, 9]  # the input is not changed


def test_learned_sizes_from_an_evaluate_reply_only_fill_unknown_sizes():
    known = np.array([5, 0, -1, 9], dtype=I64)
    out = learned_sizes(known, np.array([0, 1, 2], dtype=I64), np.array([6, 4, 3], dtype=I64),
                        trained=False)
    assert out is not None and out.tolist() == [5, 4, 3, 9]


@pytest.mark.parametrize("trained", [True, False])
def test_learned_sizes_is_none_when_nothing_changes(trained):
    known = np.array([5, 0, 7], dtype=I64)
    clients = np.array([0, 1, 2], dtype=I64)
    assert learned_sizes(known, clients, None, trained=trained) is None
    # zero sizes teach nothing; an equal size is no change
    assert learned_sizes(known, clients, np.array([5, 0, 7], dtype=I64),
                         trained=trained) is None
    assert learned_sizes(known, clients, np.array([0, 0, 0], dtype=I64),
                         trained=trained) is None


def test_learned_sizes_takes_only_the_positive_sizes_of_a_reply():
    known = np.array([5, 6, 7], dtype=I64)
    out = learned_sizes(known, np.array([0, 1, 2], dtype=I64), np.array([0, 8, -2], dtype=I64),
                        trained=True)
    assert out is not None and out.tolist() == [5, 8, 7]


def test_evaluation_weights_are_the_rows_evaluated_under_samples():
    weights = np.array([1.0, 2.0, 3.0])
    rows = np.array([4, 0, 6], dtype=I64)
    out = evaluation_weights(rows, weights, "samples", 0.0)
    assert out.dtype == np.float64 and out.tolist() == [4.0, 0.0, 6.0]
    # capped like a training claim: median of the positive rows 5, ratio 1 -> at most 5
    assert evaluation_weights(rows, weights, "samples", 1.0).tolist() == [4.0, 0.0, 5.0]


def test_evaluation_weights_fall_back_to_the_averaging_weights():
    weights = np.array([1.0, 2.0, 3.0])
    assert evaluation_weights(None, weights, "samples", 10.0) is weights
    assert evaluation_weights(np.array([4, 5, 6], dtype=I64), weights, "uniform", 10.0) \
        is weights
    assert evaluation_weights(np.zeros(3, dtype=I64), weights, "samples", 10.0) is weights
    # one answer is enough to use the rows
    assert evaluation_weights(np.array([0, 0, 2], dtype=I64), weights, "samples",
                              0.0).tolist() == [0.0, 0.0, 2.0]


def test_a_client_of_one_row_counts():
    """Sizes of 1 are sizes: a one-row client is learned, kept, and weighs its one row."""
    known = np.array([0, 1, 5], dtype=I64)
    clients = np.array([0, 1, 2], dtype=I64)
    out = learned_sizes(known, clients, np.array([1, 3, 5], dtype=I64), trained=True)
    assert out is not None and out.tolist() == [1, 3, 5]
    # an evaluate reply does not replace a known size of 1
    out = learned_sizes(known, clients, np.array([2, 3, 5], dtype=I64), trained=False)
    assert out is not None and out.tolist() == [2, 1, 5]
    weights = np.array([7.0, 7.0, 7.0])
    assert evaluation_weights(np.array([1, 0, 0], dtype=I64), weights, "samples",
                              0.0).tolist() == [1.0, 0.0, 0.0]

"""Exact values of the round's updates part (fedhier/round/updates.py): FedNova's scaling,
the screening of failed and non-finite updates, and the survivors' loss. The tests written
against its mutation survivors (docs/testing.md, "Mutation")."""

import dataclasses
import logging

import numpy as np
import pytest
import torch

from fedhier.round.executor import EdgeRoundWork, TrainResult
from fedhier.round.faults import RunFailureError
from fedhier.round.updates import (
    all_finite,
    scale_rows,
    scale_updates,
    screen,
    survivors_loss,
)

I64 = np.int64


def work(clients=(0, 1, 2), edge_of=(0, 0, 1), start=None, edge_round=7) -> EdgeRoundWork:
    clients = np.asarray(clients, dtype=I64)
    return EdgeRoundWork(edge_round=edge_round, cloud_round=2, start_step=12, clients=clients,
                         steps=np.full(len(clients), 2, dtype=I64),
                         edge_of_client=np.asarray(edge_of, dtype=I64),
                         start_edge_of_client=None if start is None else
                         np.asarray(start, dtype=I64))


def test_scale_updates_moves_each_scaled_client_from_its_start_edge_model():
    models = {"w": torch.tensor([[3.0, 5.0], [1.0, 1.0], [10.0, 0.0]]),
              "b": torch.tensor([[2.0], [4.0], [6.0]])}
    edges = {"w": torch.tensor([[1.0, 1.0], [0.0, 2.0]]), "b": torch.tensor([[0.0], [1.0]])}
    # client 2 starts from edge 0's model (a carry handoff), not its own edge 1's
    scale_updates(models, work(start=(0, 0, 0)), np.array([0.5, 1.0, 2.0]), edges)
    assert models["w"].tolist() == [[2.0, 3.0], [1.0, 1.0], [19.0, -1.0]]
    assert models["b"].tolist() == [[1.0], [4.0], [12.0]]


def test_scale_updates_leaves_unscaled_rows_alone_bit_for_bit():
    models = {"w": torch.tensor([[0.1, 0.2], [0.3, 0.7]])}
    before = models["w"].clone()
    scale_updates(models, work(clients=(0, 1), edge_of=(0, 1)), np.array([1.0, 1.0]),
                  {"w": torch.zeros(2, 2)})
    assert torch.equal(models["w"], before)


def test_scale_rows_keeps_the_models_dtype_and_uses_the_given_start_models():
    models = {"w": torch.tensor([[4.0, 4.0], [8.0, 8.0]], dtype=torch.float64)}
    scale_rows(models, np.array([1]), np.array([0.25]), {"w": torch.tensor([[0.0, 4.0]])})
    assert models["w"].dtype == torch.float64
    assert models["w"].tolist() == [[4.0, 4.0], [2.0, 5.0]]


def result(models, losses, ok, reported=None) -> TrainResult:
    return TrainResult(models={"w": torch.tensor(models)}, losses=np.asarray(losses, float),
                       ok=np.asarray(ok, bool),
                       loss_reported=None if reported is None else np.asarray(reported, bool))


def test_screen_keeps_every_ok_finite_client():
    alive = screen(work(), result([[1.0], [2.0], [3.0]], [0.5, 0.4, 0.3], [True, False, True]),
                   "stop", 4)
    assert alive.tolist() == [True, False, True]
    none = screen(work(), result([[1.0], [2.0], [3.0]], [0.5, 0.4, 0.3], [False] * 3),
                  "stop", 4)
    assert none.tolist() == [False, False, False]


def test_screen_ignores_what_a_failed_client_returned():
    alive = screen(work(), result([[np.nan], [2.0], [np.inf]], [np.nan, 0.4, 0.3],
                                  [False, True, True]), "skip-client", 4)
    assert alive.tolist() == [False, True, False]  # client 2's inf model is dropped


def test_screen_stops_naming_the_first_bad_client_its_edge_and_rounds():
    bad = result([[1.0], [np.nan], [np.inf]], [0.5, 0.4, 0.3], [True, True, True])
    with pytest.raises(RunFailureError) as err:
        screen(work(clients=(3, 4, 5), edge_of=(0, 0, 0, 1, 2, 2), edge_round=7), bad,
               "stop", 4)
    assert str(err.value).startswith("non-finite values in the update of client 4 (edge 2) "
                                     "in edge round 7 (cloud round 2);")


def test_screen_drops_non_finite_models_and_losses_with_skip_client(caplog):
    bad = result([[1.0], [np.nan], [3.0], [4.0]], [0.5, 0.4, np.inf, 0.2], [True] * 4)
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        alive = screen(work(clients=(0, 1, 2, 3), edge_of=(0, 0, 1, 1), edge_round=3), bad,
                       "skip-client", 4)
    assert alive.tolist() == [True, False, False, True]
    assert "dropping the non-finite update of client(s) [1, 2] in edge round 3" in caplog.text


def test_an_unreported_loss_is_no_evidence_but_a_reported_nan_is():
    unreported = result([[1.0], [2.0]], [np.nan, 0.1], [True, True], reported=[False, True])
    assert screen(work(clients=(0, 1), edge_of=(0, 0)), unreported, "stop",
                  2).tolist() == [True, True]
    reported = result([[1.0], [2.0]], [np.nan, 0.1], [True, True], reported=[True, True])
    assert screen(work(clients=(0, 1), edge_of=(0, 0)), reported, "skip-client",
                  2).tolist() == [False, True]


def test_all_finite():
    assert all_finite(torch.tensor([1.0, 2.0]))
    assert not all_finite(torch.tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([float("inf"), 1.0]))
    big = torch.full((4,), 3e38)  # the sum overflows to inf; every entry is finite
    assert all_finite(big)
    assert all_finite(torch.tensor([1, 2], dtype=torch.int64))


def test_survivors_loss_is_the_weighted_mean_of_the_reported_losses():
    w = work(clients=(1, 2, 3), edge_of=(0, 0, 1, 1))
    weights = np.array([100.0, 1.0, 3.0, 4.0])
    res = result([[0.0]] * 3, [0.5, 0.1, 0.9], [True, True, True], reported=[True, True, False])
    loss, total = survivors_loss(w, res, np.array([True, True, True]), weights)
    assert total == 4.0 and loss == pytest.approx((1 * 0.5 + 3 * 0.1) / 4, abs=1e-15)
    # loss_reported None: every alive client reported
    res = result([[0.0]] * 3, [0.5, 0.1, 0.9], [True, True, True])
    loss, total = survivors_loss(w, res, np.array([True, False, True]), weights)
    assert total == 5.0 and loss == pytest.approx((1 * 0.5 + 4 * 0.9) / 5, abs=1e-15)
    assert survivors_loss(w, res, np.array([False, False, False]), weights) == (None, 0.0)


def test_screen_checks_every_array_and_every_entry_of_a_row(caplog):
    """A NaN in the first of two arrays (the second finite) drops the client; rows of two
    entries are checked whole; the warning is the documented line."""
    bad = TrainResult(models={"w": torch.tensor([[1.0, np.nan], [1.0, 2.0], [3.0, 4.0]]),
                              "b": torch.tensor([[1.0], [2.0], [3.0]])},
                      losses=np.array([0.1, 0.2, 0.3]), ok=np.array([True, True, True]))
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        alive = screen(work(), bad, "skip-client", 4)
    assert alive.tolist() == [False, True, True]
    assert [r.getMessage() for r in caplog.records] == [
        "dropping the non-finite update of client(s) [0] in edge round 7"]


def test_the_part_makes_its_tensors_on_the_models_device():
    """Under another default device (meta) the part still indexes the models where they are:
    every tensor it makes names the models' device (a GPU run's models stay on the GPU)."""
    models = {"w": torch.tensor([[3.0, 5.0], [1.0, 1.0], [10.0, 0.0]])}
    edges = {"w": torch.tensor([[1.0, 1.0], [0.0, 2.0]])}
    bad = result([[1.0], [np.nan], [3.0]], [0.5, 0.4, 0.3], [True, True, False])
    with torch.device("meta"):
        scale_updates(models, work(start=(0, 0, 0)), np.array([0.5, 1.0, 2.0]), edges)
        scale_rows(models, np.array([1]), np.array([2.0]), {"w": torch.zeros(1, 2,
                                                                              device="cpu")})
        alive = screen(work(), bad, "skip-client", 4)
    assert models["w"].device.type == "cpu"
    assert models["w"].tolist() == [[2.0, 3.0], [2.0, 2.0], [19.0, -1.0]]
    assert alive.tolist() == [True, False, False]


def test_screen_names_a_chunks_clients_by_their_ids_in_the_whole_federation(caplog):
    """Engine vectorized-ray runs a chunk of whole edges as a federation of its own
    (ChunkTree: clients 4, 5 of edge 2 become 0, 1): the dropped client is named 5, its id
    in the whole federation, as the one-process engine names it, not 1."""
    from fedhier.engines.vectorized.chunks import ChunkTree

    whole = work(clients=(0, 1, 4, 5), edge_of=(0, 0, 1, 1, 2, 2))
    chunk = ChunkTree.of(np.array([4, 5]), whole.edge_of_client, [whole])
    part = chunk.work(dataclasses.replace(whole, clients=np.array([4, 5], dtype=I64),
                                          steps=whole.steps[2:]))
    assert part.clients.tolist() == [0, 1] and part.edge_of_client.tolist() == [0, 0]
    bad = TrainResult(models={"w": torch.tensor([[1.0], [np.nan]])},
                      losses=np.array([0.1, 0.2]), ok=np.array([True, True]))
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        alive = screen(part, bad, "skip-client", 4)
    assert alive.tolist() == [True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "dropping the non-finite update of client(s) [5] in edge round 7"]

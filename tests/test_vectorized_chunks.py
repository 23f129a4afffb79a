"""A shard's cloud round in chunks of whole edges (fedhier/engines/vectorized/chunks.py)
equals the one-shot shard: every edge's aggregate bit for bit, the simulated clocks and the
counters exactly, the train losses to float64 rounding; with participation, faults and edges
of one client."""

import dataclasses

import numpy as np
import pytest
import torch

from fedhier.engines.vectorized.chunks import ChunkTree, edge_chunks, train_edge_chunks
from fedhier.engines.vectorized_ray.shard import ShardExecutor, edge_weights
from fedhier.local.train import params_of
from fedhier.round.faults import RunFailureError
from fedhier.round.tiers.jobs import ServerJob, edge_aggregates, job_rounds, start_job, train_edges
from fedhier.round.traffic import BatchCommunication
from fedhier.runs.prepare import initial_model, prepare, settings_for
from fedhier.settings.run_config import RunConfig

#: 12 clients on 6 edges of 3, 1, 2, 2, 1, 3 clients; the shard holds edges 0, 1, 2, 4, 5.
CFG = RunConfig(dataset="digits", clients=12, groups=(6,), local_period=2, global_period=6,
                rounds=2, batch_size=8, seed=5, participation=0.75, fail_rate=0.25,
                engine="vectorized-ray")
EDGE_OF = np.array([0, 2, 0, 1, 3, 5, 2, 0, 3, 4, 5, 5])
SHARD_EDGES = np.array([0, 1, 2, 4, 5])


def test_edge_chunks_are_runs_of_whole_edges_and_never_one_client():
    edge_of = np.array([2, 0, 0, 1, 2, 3, 4, 4, 4, 4])
    runs = edge_chunks(edge_of, 3)
    assert [r.tolist() for r in runs] == [[1, 2, 3], [0, 4, 5], [6, 7, 8, 9]]
    # edge 3's single client joins the run before it; a lone first client the next one
    assert [r.tolist() for r in edge_chunks(np.array([0, 1, 1, 2]), 2)] == [[0, 1, 2, 3]]
    assert [r.tolist() for r in edge_chunks(np.array([0, 1, 1]), 2)] == [[0, 1, 2]]
    assert edge_chunks(np.zeros(0, dtype=np.int64), 4) == []


def test_edge_weights_are_numpys_per_edge_sums_to_the_bit():
    weights = np.random.default_rng(0).random(500) * 1e3
    edge_of = np.random.default_rng(1).integers(0, 7, 500)
    edges = np.array([0, 3, 6])
    assert edge_weights(weights, edge_of, edges) == [float(weights[edge_of == e].sum())
                                                     for e in edges]


@pytest.fixture(scope="module")
def shard():
    fed = prepare(CFG)
    model = initial_model(CFG, fed)
    clients = np.flatnonzero(np.isin(EDGE_OF, SHARD_EDGES))
    return fed, model, clients


def _start(fed, model, clients, cloud_round):
    settings = settings_for(CFG)
    executor = ShardExecutor.build(CFG, fed, clients, model, torch.device("cpu"))
    job = ServerJob(0, cloud_round, params_of(model), EDGE_OF,
                  np.asarray(fed.client_sizes(), dtype=np.int64), np.linspace(0.0, 1.0, 6))
    algorithm = start_job(settings, executor, job)
    algorithm.communication = BatchCommunication(algorithm._hierarchy(), SHARD_EDGES)
    return settings, executor, job, algorithm


@pytest.mark.parametrize("size", [2, 4, 100])
def test_chunks_of_whole_edges_give_the_one_shot_shard(shard, size):
    fed, model, clients = shard
    settings, executor, job, one_shot = _start(fed, model, clients, cloud_round=2)
    rounds = job_rounds(settings, job)
    expected = train_edges(one_shot, executor, SHARD_EDGES, 2, rounds, held_from=2)
    models, edges = edge_aggregates(one_shot, expected.held)
    _, executor, _, chunked = _start(fed, model, clients, cloud_round=2)
    outcome, aggregates = train_edge_chunks(chunked, executor, rounds, size)

    assert expected.failed_clients > 0  # faults and participation are exercised
    assert sorted(aggregates) == edges.tolist()
    for i, edge in enumerate(edges.tolist()):
        for key, value in models.items():
            assert torch.equal(aggregates[edge][key], value[i]), (edge, key)
    assert (outcome.failed_clients, outcome.failed_edges) == (expected.failed_clients,
                                                              expected.failed_edges)
    np.testing.assert_array_equal(outcome.losses[:, 1], expected.losses[:, 1])
    np.testing.assert_allclose(outcome.losses[:, 0], expected.losses[:, 0], rtol=1e-12)
    np.testing.assert_array_equal(chunked._clock().edge_time, one_shot._clock().edge_time)
    assert vars(chunked.communication).keys() == vars(one_shot.communication).keys()
    for name in ("client_edge_messages", "client_edge_bytes", "edge_cloud_messages",
                 "edge_cloud_bytes"):
        assert getattr(chunked.communication, name) == getattr(one_shot.communication, name)


def test_a_chunk_runs_as_a_federation_of_its_own_in_whole_federation_ids(shard):
    """A chunk's algorithm holds its c clients and e edges only (every call O(chunk)); a
    carry handoff's start edges outside the chunk are extra start-model rows."""
    fed, model, clients = shard
    _, _, _, algorithm = _start(fed, model, clients, cloud_round=1)
    ids = np.flatnonzero(np.isin(EDGE_OF, [2, 4]))  # clients 1, 6, 9
    work, _ = algorithm.plan(1)
    start = EDGE_OF.copy()
    start[6] = 5  # client 6 starts from edge 5's model (it just moved to edge 2)
    work = dataclasses.replace(work, clients=ids, steps=np.full(3, 2),
                               start_edge_of_client=start)
    tree = ChunkTree.of(ids, EDGE_OF, [work])
    assert tree.edges.tolist() == [2, 4] and tree.edge_of.tolist() == [0, 0, 1]
    assert tree.sources.tolist() == [2, 4, 5]
    local = tree.work(work)
    assert local.clients.tolist() == [0, 1, 2]
    assert tree.sources[local.start_edges].tolist() == [2, 5, 4]
    part = tree.algorithm(algorithm)
    assert len(part.weights) == part._hierarchy().num_clients == 3
    assert len(part._clock().step_seconds) == 3 and len(part._clock().edge_time) == 2
    for key, value in part.edge_models.items():
        assert torch.equal(value, algorithm.edge_models[key][[2, 4, 5]])
    error = tree.in_whole_ids(RunFailureError(
        "edge 1 kept 0 of 1 clients in edge round 3; non-finite values in the update of "
        "client 1 (edge 0) in edge round 3"))
    assert str(error) == ("edge 4 kept 0 of 1 clients in edge round 3; non-finite values "
                          "in the update of client 6 (edge 2) in edge round 3")


def test_a_run_stopping_edge_is_named_by_its_id_in_the_whole_federation(shard):
    fed, model, _ = shard
    cfg = CFG.replace(min_clients_per_edge=1, fail_rate=0.5)
    edges = np.array([2, 4, 5])  # edge 4 is the chunk's edge 1
    clients = np.flatnonzero(np.isin(EDGE_OF, edges))
    messages = []
    for chunked in (False, True):
        settings = settings_for(cfg)
        executor = ShardExecutor.build(cfg, fed, clients, model, torch.device("cpu"))
        job = ServerJob(0, 1, params_of(model), EDGE_OF,
                      np.asarray(fed.client_sizes(), dtype=np.int64), np.zeros(6))
        algorithm = start_job(settings, executor, job)
        with pytest.raises(RunFailureError) as caught:
            if chunked:
                train_edge_chunks(algorithm, executor, job_rounds(settings, job), 100)
            else:
                train_edges(algorithm, executor, edges, 1, job_rounds(settings, job),
                            held_from=2)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("edge 4 kept 0 of 1 clients in edge round 2")

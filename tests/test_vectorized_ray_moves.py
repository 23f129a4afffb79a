"""Clients that move in engine ``vectorized-ray`` (mobility, regrouping): the cloud cuts a
cloud round at the moves (fedhier.round.tiers.moves) and a client whose new edge is on another
worker moves there, its row indices and not its rows (fedhier.engines.vectorized_ray.moves);
and per-edge periods, which the workers run as edge servers do.
The runs equal ``vectorized`` within the sharded engine's 1e-6 (counters exact) and
``inprocess`` within the engines' tolerance, on the two-node Ray cluster of
tests/test_vectorized_ray.py; a moved client trains bit for bit as on a shard built with it.
"""

import json

import numpy as np
import pytest
import torch

from fedhier.engines.vectorized_ray.moves import adopt, release
from fedhier.engines.vectorized_ray.shard import ShardExecutor
from fedhier.local.train import params_of
from fedhier.round.loop import EdgeRoundWork
from fedhier.runs.prepare import initial_model, prepare
from tests.helpers import metrics
from tests.test_deploy_mobility import without_handoffs
from tests.test_vectorized import assert_same_runs
from tests.test_vectorized_ray import (
    CFG,
    assert_equal_runs,
    resume_after_round_2,
    run_side_by_side,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 8 clients on 4 edges, edges 0-1 on worker 0 and 2-3 on worker 1; 3 edge rounds per cloud
#: round, so moves land inside cloud rounds. Seed 33 moves a ``carry`` client from edge 2 to
#: edge 3 (one worker) in edge round 2, a segment of 2 edge rounds: with runs of 2 clients
#: the shard must not train edge 2 before the moved client starts from its model.
MOBILE = CFG.replace(seed=33, global_period=6, rounds=2, mobility_rate=0.5, handoff="carry",
                     client_chunk=2)
#: Inprocess against vectorized: the engines' float32 tolerance (tests/test_vectorized.py).
INPROCESS_TOL = 1e-5


def moves_of(path) -> list[list[int]]:
    return [m for r in metrics(path) for m in r.get("moves", [])]


def test_a_moved_client_trains_bit_for_bit_as_on_a_shard_built_with_it():
    """Client 5 released by shard {1, 2, 5, 6} and adopted by shard {0}, full-batch (so the
    padded width shrinks from 192 to 170 rows on the first and grows from 125 to 192 on the
    second): both shards are the shards built with their new clients (rows, batch sizes and
    weights, ids) and train exactly as those do (mini-batch and fault draws included)."""
    cfg = CFG.replace(fail_rate=0.3, batch_size=0)
    fed = prepare(cfg)
    model = initial_model(cfg, fed)
    cpu = torch.device("cpu")
    edge_models = {k: torch.stack([v, v * 0.5, v * 2.0, -v]) for k, v in
                   params_of(model).items()}
    old = ShardExecutor.build(cfg, fed, np.array([1, 2, 5, 6]), model, cpu)
    new = ShardExecutor.build(cfg, fed, np.array([0]), model, cpu)
    old, moves = release(old, [5])
    new = adopt(new, moves)
    assert [m.client for m in moves] == [5] and moves[0].rows is fed.partitions[5]
    edge_of = np.array([0, 1, 1, 2, 3, 2, 3, 0])
    pool = torch.as_tensor(fed.bundle.train_arrays()[0])
    for shard, clients, width in ((old, [1, 2, 6], 170), (new, [0, 5], 192)):
        built = ShardExecutor.build(cfg, fed, np.array(clients), model, cpu)
        got, want = shard.inner.data, built.inner.data
        assert shard.clients.tolist() == clients and got.width == want.width == width
        assert got.client_ids.tolist() == shard.inner.client_ids.tolist() == clients
        np.testing.assert_array_equal(got.batch, want.batch)
        assert torch.equal(got.weight, want.weight)
        assert all(np.array_equal(a, b) for a, b in zip(got.rows, want.rows, strict=True))
        assert got.x.data_ptr() == pool.data_ptr()  # the pool, not a copy
        work = EdgeRoundWork(edge_round=4, cloud_round=2, start_step=6,
                             clients=np.array(clients), steps=np.full(len(clients), 2),
                             edge_of_client=edge_of)
        trained, reference = shard.train(work, edge_models), built.train(work, edge_models)
        np.testing.assert_array_equal(trained.ok, reference.ok)
        np.testing.assert_array_equal(trained.losses, reference.losses)
        for key, value in reference.models.items():
            assert torch.equal(value, trained.models[key])


def test_moving_clients_equal_the_one_process_and_inprocess_engines(ray_cluster, tmp_path):
    """``carry`` mobility with participation, faults and runs of 2 clients: every move of
    the one-process run is re-attached, some between workers inside a cloud round."""
    cfg = MOBILE.replace(ray_address=ray_cluster)
    sharding = run_side_by_side(cfg, tmp_path, inprocess=True)
    handoffs = [h for r in without_handoffs(tmp_path / "ray") for h in r]
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    assert_same_runs(tmp_path / "inprocess", tmp_path / "ray", INPROCESS_TOL)
    moves = moves_of(tmp_path / "one")
    assert moves_of(tmp_path / "ray") == moves
    assert [[h["edge_round"], h["client"], h["from"], h["to"]] for h in handoffs] == moves
    worker = {0: 0, 1: 0, 2: 1, 3: 1}  # place_edges of 4 edges of 2 clients on 2 workers
    across = [[c, worker[a], worker[b]] for _, c, a, b in moves if worker[a] != worker[b]]
    assert sharding["worker_moves"] == across
    assert any((m[0] - 1) % 3 and worker[m[2]] != worker[m[3]] for m in moves)  # mid-round
    assert [2, 1, 2, 3] in moves  # the carry move within worker 1 (MOBILE's comment)
    assert sorted(w["clients"] for w in sharding["workers"]) == sorted(
        np.bincount([worker[e] for e in metrics(tmp_path / "one")[-1]["client_to_edge"]],
                    minlength=2).tolist())


def test_regrouping_and_fresh_moves_equal_the_one_process_engine(ray_cluster, tmp_path):
    """A random regrouping every cloud round (clients re-attached at its start) and
    ``fresh`` moves inside the cloud rounds."""
    cfg = CFG.replace(ray_address=ray_cluster, grouping="random", regroup_every=1,
                      mobility_rate=0.5, handoff="fresh")
    sharding = run_side_by_side(cfg, tmp_path)
    handoffs = [h for r in without_handoffs(tmp_path / "ray") for h in r]
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    assert any(r.get("regrouped") for r in metrics(tmp_path / "one"))
    assert moves_of(tmp_path / "one") and sharding["worker_moves"]
    assert {h["bytes"] for h in handoffs} == {0}  # fresh: no model moves with a client


def test_per_edge_periods_equal_the_one_process_and_inprocess_engines(ray_cluster, tmp_path):
    """Edges aggregating every 1, 2, 4 and 2 steps (G = 4), with a regrouping every cloud
    round and runs of 2 clients: a worker runs its edges' rounds one after the other, as an
    edge server does (each round's plan depends on the clients' carried models)."""
    cfg = CFG.replace(ray_address=ray_cluster, local_period=1, edge_periods="1,2,4,2",
                      grouping="random", regroup_every=1, client_chunk=2)
    run_side_by_side(cfg, tmp_path, inprocess=True)
    without_handoffs(tmp_path / "ray")
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    assert_same_runs(tmp_path / "inprocess", tmp_path / "ray", INPROCESS_TOL)
    assert [r.get("edge_aggregations") for r in metrics(tmp_path / "ray")[1:]] == [
        [4, 2, 1, 2]] * 3


#: A trace that moves clients 2-7 to edge 0 in edge round 2, emptying worker 1 (edges 2-3),
#: then client 7 to edge 3 in edge round 5: a resumed run must keep each edge on its worker
#: (placing them again from the moved tree would sum in another order), start worker 1 without
#: clients and let it adopt client 7.
EMPTYING_TRACE = "edge_round,client,edge\n" + "".join(
    f"2,{c},0\n" for c in range(2, 8)) + "5,7,3\n"


@pytest.mark.parametrize("moves", ["random", "trace"])
def test_an_interrupted_mobile_run_resumes_bit_identically(ray_cluster, tmp_path,
                                                           monkeypatch, moves):
    trace = tmp_path / "trace.csv"
    trace.write_text(EMPTYING_TRACE)
    args = ["run", "--dataset", "digits", "--clients", "8", "--groups", "4",
            "--grouping", "contiguous", "--local-period", "2",
            "--global-period", "4" if moves == "random" else "6", "--rounds", "3",
            "--batch-size", "8", "--seed", "4", "--handoff", "carry",
            *(["--mobility-rate", "0.5"] if moves == "random"
              else ["--mobility-trace", str(trace)]),
            "--engine", "vectorized-ray", "--ray-address", ray_cluster, "--no-progress"]
    resumed = resume_after_round_2(args, tmp_path, monkeypatch,
                                   ("wall_seconds", "handoffs"))  # handoffs: measured seconds
    assert any(r.get("moves") for r in resumed[2:])
    stopped = tmp_path / "stopped"
    sharding = [json.loads((path / "sharding.json").read_text())
                for path in (tmp_path / "whole", stopped)]
    assert sharding[0]["worker_moves"] == sharding[1]["worker_moves"]
    assert sharding[0]["bytes_between_workers"] == sharding[1]["bytes_between_workers"]
    if moves == "trace":  # worker 1 emptied, then client 7 adopted there
        assert [7, 0, 1] in sharding[1]["worker_moves"]
        assert [c for c, _, to in sharding[1]["worker_moves"] if to == 0] == [4, 5, 6, 7]

"""Kept optimizer state (``--momentum > 0 --optimizer-state keep``) in engine ``vectorized-ray``:
each worker keeps its clients' momentum buffers as the one-process engine keeps them, chunk by
chunk of whole edges (fedhier.engines.vectorized_ray.shard.ShardExecutor.keep_chunk_state), a
client that moves to another worker takes its buffers along (fedhier.engines.
vectorized_ray_moves.ClientMove), and checkpoints gather them by client id. The runs equal
``vectorized`` within the sharded engine's 1e-6 (counters exact) and ``inprocess`` within
1e-5, on the two-node Ray cluster of tests/test_vectorized_ray.py, on two levels and on
three (whole regions per worker) and with per-edge periods; the state matters (the same run
with ``optimizer_state=reset`` differs by more than 1e-4).
"""

import json

import numpy as np
import pytest
import torch

from fedhier.engines.vectorized.chunks import train_edge_chunks
from fedhier.engines.vectorized.engine import BatchedExecutor
from fedhier.engines.vectorized_ray.moves import adopt, release
from fedhier.engines.vectorized_ray.shard import ShardExecutor
from fedhier.local.train import params_of
from fedhier.round.loop import EdgeRoundWork
from fedhier.runs.prepare import initial_model, prepare
from tests.helpers import metrics
from tests.test_deploy_mobility import without_handoffs
from tests.test_vectorized import assert_same_runs, final_state
from tests.test_vectorized_ray import (
    CFG,
    assert_equal_runs,
    resume_after_round_2,
    run_side_by_side,
)
from tests.test_vectorized_ray_moves import INPROCESS_TOL, MOBILE, moves_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEEP = {"momentum": 0.9, "optimizer_state": "keep"}
#: CFG (participation 0.75, faults) with kept momentum, in runs of 2 clients (two chunks per
#: worker: each reads and writes back its clients' buffers).
STATE = CFG.replace(client_chunk=2, **KEEP)


def largest_difference(a, b) -> float:
    """The largest absolute difference of the train losses and final models of two runs."""
    losses = max(abs(x["train_loss"] - y["train_loss"]) for x, y in
                 zip(metrics(a)[1:], metrics(b)[1:], strict=True))
    fa, fb = final_state(a), final_state(b)
    return max(losses, *(float((fa[k] - fb[k]).abs().max()) for k in fa))


def test_a_moved_client_takes_its_kept_state_to_the_other_shard():
    """Client 5's buffers leave shard {1, 2, 5, 6} with it and land in shard {0}'s in id
    order; the clients that stay keep theirs."""
    cfg = CFG.replace(**KEEP)
    fed = prepare(cfg)
    model = initial_model(cfg, fed)
    cpu = torch.device("cpu")
    old = ShardExecutor.build(cfg, fed, np.array([1, 2, 5, 6]), model, cpu)
    new = ShardExecutor.build(cfg, fed, np.array([0]), model, cpu)
    edge_models = {k: torch.stack([v, v * 0.5, v * 2.0, -v]) for k, v in
                   params_of(model).items()}
    edge_of = np.array([0, 1, 1, 2, 3, 2, 3, 0])
    for shard in (old, new):
        shard.train(EdgeRoundWork(edge_round=1, cloud_round=1, start_step=0,
                                  clients=shard.clients, steps=np.full(len(shard.clients), 2),
                                  edge_of_client=edge_of), edge_models)
    before = {int(c): {k: v[i].clone() for k, v in s.client_state().items()}
              for s in (old, new) for i, c in enumerate(s.clients)}
    old, moves = release(old, [5])
    new = adopt(new, moves)
    assert new.clients.tolist() == [0, 5] and old.clients.tolist() == [1, 2, 6]
    for shard in (old, new):
        state = shard.client_state()
        for i, client in enumerate(shard.clients.tolist()):
            for key, value in before[client].items():
                assert torch.equal(state[key][i], value), (client, key)


def test_chunks_keep_the_state_the_one_process_executor_keeps():
    """Two cloud rounds of a shard's jobs in runs of 2 clients: the shard's buffers after
    each equal, bit for bit, the one-process executor's rows of the shard's clients (the
    same edge rounds trained on all 8 clients at once)."""
    from fedhier.round.tiers.jobs import ServerJob, job_rounds, start_job, train_edges
    from fedhier.round.traffic import BatchCommunication
    from fedhier.runs.prepare import settings_for

    cfg = STATE.replace(participation=1.0)
    fed = prepare(cfg)
    model = initial_model(cfg, fed)
    cpu = torch.device("cpu")
    settings = settings_for(cfg)
    edge_of = np.array([0, 1, 1, 2, 3, 2, 3, 0])
    mine = np.array([1, 2, 3, 5])  # edges 1 and 2
    shard = ShardExecutor.build(cfg, fed, mine, model, cpu)
    whole = ShardExecutor.build(cfg, fed, np.arange(8), model, cpu)
    sizes = np.asarray(fed.client_sizes(), dtype=np.int64)
    for cloud_round in (1, 2):
        job = ServerJob(1, cloud_round, params_of(model), edge_of, sizes, np.zeros(4))
        chunked = start_job(settings, shard, job)
        chunked.communication = BatchCommunication(chunked._hierarchy(), np.array([1, 2]))
        train_edge_chunks(chunked, shard, job_rounds(settings, job), 2)
        one = start_job(settings, whole, job)
        one.communication = BatchCommunication(one._hierarchy(), np.arange(4))
        train_edges(one, whole, np.arange(4), cloud_round, job_rounds(settings, job),
                    held_from=2)
        kept, reference = shard.client_state(), whole.client_state()
        assert kept and kept.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(kept[key], value[mine]), (cloud_round, key)
    assert isinstance(whole.inner, BatchedExecutor)


def test_kept_momentum_equals_the_one_process_and_inprocess_engines(ray_cluster, tmp_path):
    """Momentum 0.9 kept, participation 0.75 and faults, two workers on two nodes: within
    1e-6 of ``vectorized`` and 1e-5 of ``inprocess``; the same run with reset buffers
    differs by more than 1e-4, so the kept state is what is compared."""
    from fedhier.engines.vectorized.engine import run_vectorized
    from fedhier.runs.folder import RunFolder

    cfg = STATE.replace(ray_address=ray_cluster)
    sharding = run_side_by_side(cfg, tmp_path, inprocess=True)
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    assert_same_runs(tmp_path / "inprocess", tmp_path / "ray", INPROCESS_TOL)
    assert largest_difference(tmp_path / "one", tmp_path / "ray") <= 1e-6
    run_vectorized(cfg.replace(engine="vectorized", optimizer_state="reset"),
                   RunFolder.create(tmp_path / "reset"), progress=False)
    assert largest_difference(tmp_path / "reset", tmp_path / "ray") > 1e-4
    assert sharding["client_state_bytes"] > 0  # gathered for the checkpoints' snapshots


def test_an_interrupted_run_with_kept_momentum_resumes_bit_identically(
        ray_cluster, tmp_path, monkeypatch):
    """The checkpoint of round 2 holds every client's buffers by id; the resumed run's
    workers take their clients' rows and finish as the uninterrupted run does."""
    args = ["run", "--dataset", "digits", "--clients", "8", "--groups", "4",
            "--local-period", "2", "--global-period", "4", "--rounds", "3",
            "--batch-size", "8", "--seed", "11", "--participation", "0.75",
            "--fail-rate", "0.2", "--momentum", "0.9", "--optimizer-state", "keep",
            "--client-chunk", "2", "--engine", "vectorized-ray", "--ray-address",
            ray_cluster, "--no-progress"]
    resume_after_round_2(args, tmp_path, monkeypatch)
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert all(torch.equal(a[k], b[k]) for k in a)
    counted = [json.loads((tmp_path / run / "sharding.json").read_text())["client_state_bytes"]
               for run in ("whole", "stopped")]
    # the counter goes into the checkpoint (before that round's snapshot is gathered) and
    # the resume sends the same bytes back down: 3 rounds x 8 clients x one float32 model
    assert counted == [3 * 8 * 4 * sum(v.numel() for v in a.values())] * 2, counted


def test_moving_clients_take_their_kept_momentum_across_workers(ray_cluster, tmp_path):
    """``carry`` mobility (tests/test_vectorized_ray_moves.py's MOBILE) with kept momentum:
    clients move between workers inside cloud rounds and the run equals ``vectorized``."""
    cfg = MOBILE.replace(ray_address=ray_cluster, **KEEP)
    sharding = run_side_by_side(cfg, tmp_path)
    without_handoffs(tmp_path / "ray")  # measured seconds; the simulation has none
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    assert largest_difference(tmp_path / "one", tmp_path / "ray") <= 1e-6
    assert moves_of(tmp_path / "ray") == moves_of(tmp_path / "one")
    assert sharding["worker_moves"]  # some clients changed workers


@pytest.mark.parametrize("case", ["regions-carry", "edge-periods"])
def test_kept_momentum_in_regions_and_with_per_edge_periods(ray_cluster, tmp_path, case):
    """Three levels (whole regions per worker) with ``carry`` moves between regions, so
    between workers; and per-edge periods with a regrouping every cloud round (a worker's
    one executor trains its clients round by round): both equal ``vectorized``."""
    from tests.test_vectorized_ray_levels import CFG as REGIONS

    cfg = (REGIONS.replace(mobility_rate=0.5, handoff="carry") if case == "regions-carry"
           else CFG.replace(local_period=1, edge_periods="1,2,4,2", grouping="random",
                            regroup_every=1, client_chunk=2))
    sharding = run_side_by_side(cfg.replace(ray_address=ray_cluster, **KEEP), tmp_path)
    without_handoffs(tmp_path / "ray")
    assert_same_runs(tmp_path / "one", tmp_path / "ray", 1e-6)
    assert sharding["worker_moves"] and sharding["client_state_bytes"] > 0

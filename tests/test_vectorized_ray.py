"""Engine ``vectorized-ray`` (the batched engine sharded by edge over Ray) equals engine
``vectorized``: a shard trains its clients bit for bit as the one-process executor does, and
whole runs on a local two-node Ray cluster (a head and one more node on 127.0.0.1, started
once per session with ``ray start``, shared with tests/test_vectorized_ray_moves.py) give the
one-process metrics to 1e-6, with participation and faults, and an interrupted run resumes
bit for bit.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from fedhier.cli.commands import main
from fedhier.engines.vectorized.engine import BatchedExecutor, run_vectorized
from fedhier.engines.vectorized_ray.engine import check_sharded, run_vectorized_ray
from fedhier.engines.vectorized_ray.executor import place_edges
from fedhier.engines.vectorized_ray.shard import ShardExecutor
from fedhier.local.train import params_of
from fedhier.round.loop import EdgeRoundWork
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import initial_model, prepare
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_refused, metrics
from tests.ray_cluster import free_port
from tests.test_faults import run_interrupted_at

#: 8 clients on 4 edges, two of them per worker; participation and faults make some edges
#: and clients drop out of some edge rounds.
CFG = RunConfig(dataset="digits", clients=8, groups=(4,), local_period=2, global_period=4,
                rounds=3, batch_size=8, seed=11, participation=0.75, fail_rate=0.2,
                engine="vectorized-ray", ray_workers=2)
TOL = 1e-6
#: Keys equal exactly: counters, simulated time, and what is read before any cloud step.
EXACT = ("round", "iteration", "edge_rounds", "failed_clients", "failed_edges",
         "client_edge_messages", "client_edge_bytes", "edge_cloud_messages",
         "edge_cloud_bytes", "sim_seconds")


def _close(a: float | None, b: float | None) -> bool:
    return a == b if a is None or b is None else abs(a - b) <= TOL * max(1.0, abs(a))


def assert_equal_runs(reference: Path, sharded: Path) -> None:
    """Same records: the EXACT keys equal, every other number within TOL."""
    ref, got = metrics(reference), metrics(sharded)
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key == "wall_seconds" or not isinstance(a[key], (int, float, type(None))):
                continue
            if key in EXACT:
                assert a[key] == b[key], (a["round"], key)
            else:
                assert _close(a[key], b[key]), (a["round"], key, a[key], b[key])


def run_side_by_side(cfg: RunConfig, tmp_path: Path, inprocess: bool = False) -> dict:
    """``cfg`` run by ``vectorized`` (``tmp_path / "one"``), ``inprocess`` when asked
    (``tmp_path / "inprocess"``) and ``vectorized-ray`` (``tmp_path / "ray"``); the sharded
    run's ``sharding``."""
    from fedhier.engines.inprocess import run_inprocess

    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "one"),
                   progress=False)
    if inprocess:
        run_inprocess(cfg.replace(engine="inprocess"),
                      RunFolder.create(tmp_path / "inprocess"), progress=False)
    return run_vectorized_ray(cfg, RunFolder.create(tmp_path / "ray"),
                              progress=False)["sharding"]


def test_a_shard_trains_its_clients_bit_for_bit_as_the_whole_federation():
    """Clients 1, 2, 5, 6 as a shard (their own mini-batch draws and fault draws, keyed by
    their ids) return exactly their rows of the one-process executor's result."""
    cfg = CFG.replace(fail_rate=0.3)
    fed = prepare(cfg)
    model = initial_model(cfg, fed)
    edge_models = {k: torch.stack([v, v * 0.5, v * 2.0, -v]) for k, v in
                   params_of(model).items()}
    edge_of = np.array([0, 1, 1, 2, 3, 2, 3, 0])
    work = EdgeRoundWork(edge_round=4, cloud_round=2, start_step=6,
                         clients=np.array([1, 2, 5, 6]), steps=np.array([2, 1, 2, 2]),
                         edge_of_client=edge_of)
    whole = BatchedExecutor.build(cfg, fed, model, torch.device("cpu")).train(
        work, edge_models)
    shard = ShardExecutor.build(cfg, fed, np.array([1, 2, 5, 6]), model,
                                torch.device("cpu")).train(work, edge_models)
    assert whole.ok.tolist() == [True, True, True, False]  # client 6 fails
    np.testing.assert_array_equal(whole.ok, shard.ok)
    np.testing.assert_array_equal(whole.losses, shard.losses)
    for key, value in whole.models.items():
        assert torch.equal(value[whole.ok], shard.models[key][shard.ok])


def test_edges_are_placed_whole_in_runs_of_about_equal_clients():
    edge_of = np.repeat(np.arange(5), [4, 1, 1, 1, 3])
    assert place_edges(edge_of, 5, 2).tolist() == [0, 0, 1, 1, 1]
    assert place_edges(edge_of, 5, 9).tolist() == [0, 1, 2, 3, 4]  # at most one per edge
    assert place_edges(np.zeros(3, dtype=np.int64), 1, 4).tolist() == [0]


@pytest.mark.parametrize("change, message", [
    ({"edge_periods": "1,2,1,2", "local_period": 1, "mobility_rate": 0.2},
     "engine vectorized-ray with per-edge periods needs static clients (no mobility): a job "
     "split at a move would restart an edge's period"),
])
def test_what_is_not_sharded_is_refused_in_one_line(change, message):
    assert_refused(lambda: check_sharded(CFG.replace(**change)), message)


def test_an_address_where_no_cluster_answers_is_refused_in_one_line(tmp_path, capsys):
    port = free_port()  # nothing listens there
    assert main(["run", "--engine", "vectorized-ray", "--ray-address", f"127.0.0.1:{port}",
                 "--dataset", "digits", "--clients", "4", "--groups", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedhier: error: no Ray cluster answers at 127.0.0.1:{port} (")
    assert len(err.splitlines()) == 1


def test_equals_the_one_process_engine_on_a_two_node_cluster(ray_cluster, tmp_path):
    cfg = CFG.replace(ray_address=ray_cluster)
    sharding = run_side_by_side(cfg, tmp_path)
    assert_equal_runs(tmp_path / "one", tmp_path / "ray")
    workers = sharding["workers"]
    assert sum(w["clients"] for w in workers) == 8
    assert len({w["node"] for w in workers}) == 2  # one worker on each node
    assert sharding["bytes_between_workers"] > 0


def test_an_interrupted_run_resumes_bit_identically(ray_cluster, tmp_path, monkeypatch):
    args = ["run", "--dataset", "digits", "--clients", "8", "--groups", "4",
            "--local-period", "2", "--global-period", "4", "--rounds", "3",
            "--batch-size", "8", "--seed", "11", "--participation", "0.75",
            "--fail-rate", "0.2", "--engine", "vectorized-ray", "--ray-address",
            ray_cluster, "--no-progress"]
    resume_after_round_2(args, tmp_path, monkeypatch)


def resume_after_round_2(args: list[str], tmp_path: Path, monkeypatch,
                         ignore: tuple[str, ...] = ("wall_seconds",)) -> list[dict]:
    """``fedhier`` ``args`` run whole (``tmp_path / "whole"``), and interrupted in round 2
    then resumed (``tmp_path / "stopped"``): every record equal but the keys ``ignore``;
    the resumed run's records."""
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(2, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    whole, resumed = metrics(tmp_path / "whole"), metrics(stopped)
    assert [r["round"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(whole, resumed, strict=True):
        assert {k: v for k, v in a.items() if k not in ignore} == {
            k: v for k, v in b.items() if k not in ignore}
    return resumed

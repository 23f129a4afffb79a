"""Drivers shared by the tests: run a strategy on the in-process grid without a run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import Strategy
from safetensors.torch import load_file

from fedhier.clients.app import app as client_app
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.prepare import initial_model, prepare
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.cloud_step import make_cloud_strategy
from fedhier.strategies.hierfedavg import HierFedAvg

State = dict[str, torch.Tensor]


def initial_state(cfg: RunConfig) -> State:
    return initial_model(cfg, prepare(cfg)).state_dict()


def run_hier(cfg: RunConfig, records: list | None = None) -> State:
    """Final global model of HierFedAvg for ``cfg`` on the in-process grid."""
    grid = InProcessGrid(client_app, cfg.clients, seed=cfg.seed)
    strategy = HierFedAvg(cfg.local_period, cfg.global_period, cfg.groups, periods=cfg.periods,
                          grouping=cfg.grouping,
                          weighting=cfg.weighting, seed=cfg.seed,
                          cloud_strategy=make_cloud_strategy(cfg.cloud_strategy, cfg.server_lr,
                                                             cfg.server_momentum),
                          workload=cfg.workload(), diagnostics_every=cfg.diagnostics_every,
                          regroup_every=cfg.regroup_every)
    result = strategy.start(grid, ArrayRecord(initial_state(cfg)), num_rounds=cfg.rounds,
                            train_config=ConfigRecord(cfg.to_run_config()),
                            on_cloud_round=records.append if records is not None else None)
    return result.arrays.to_torch_state_dict()


def run_flower_strategy(cfg: RunConfig, strategy: Strategy, local_steps: int,
                        rounds: int) -> State:
    """Final model of a plain Flower strategy driving the same ClientApp."""
    grid = InProcessGrid(client_app, cfg.clients, seed=cfg.seed)
    config = ConfigRecord({**cfg.to_run_config(), "local-steps": local_steps})
    result = strategy.start(grid, ArrayRecord(initial_state(cfg)), num_rounds=rounds,
                            train_config=config)
    return result.arrays.to_torch_state_dict()


def max_abs_diff(a: State, b: State) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


#: metrics.jsonl keys that differ between equal runs.
IGNORED_KEYS = {"wall_seconds"}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, rounds: int, tol: float = 1e-5,
                    ignore: frozenset[str] = frozenset()) -> None:
    """Two run folders hold the same metrics (floats to ``tol``; keys in ``ignore`` left
    out) and final model (tol 0: the same bits)."""
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb) == rounds + 1
    skip = IGNORED_KEYS | ignore
    for ra, rb in zip(ma, mb, strict=True):
        assert ra.keys() - ignore == rb.keys() - ignore
        for key in ra.keys() - skip:
            if isinstance(ra[key], float):
                assert math.isclose(ra[key], rb[key], rel_tol=tol, abs_tol=tol), key
            else:
                assert ra[key] == rb[key], key
    fa = load_file(str(a / "model_final.safetensors"))
    fb = load_file(str(b / "model_final.safetensors"))
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= tol


def interruptible() -> None:
    """``preexec_fn`` for a child the test will Ctrl-C (SIGINT): a shell that starts the test
    run in the background (no job control) makes its children ignore SIGINT, and a Python
    started with SIGINT ignored never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_refused(call, message: str, error: type[Exception] = ConfigError,
                   exact: bool = False) -> None:
    """``call()`` raises ``error`` (that very class with ``exact``) whose text is exactly
    ``message``."""
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value) == message
    if exact:
        assert type(caught.value) is error


def benchmark_engines():
    """benchmarks/engines.py as a module (it puts benchmarks/ on sys.path, so its
    engine_table package imports too)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "bench_engines", Path(__file__).resolve().parents[1] / "benchmarks" / "engines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engines"] = module
    spec.loader.exec_module(module)
    return module


def interrupt_at_crash_point(count: int):
    """A stand-in for ``fedhier.runs.driver.crash_point`` that raises KeyboardInterrupt at
    its ``count``-th call (2 calls for round 0's record, then 3 per round: 6 = round 2's)."""
    calls = {"n": 0}

    def interrupt() -> None:
        calls["n"] += 1
        if calls["n"] == count:
            raise KeyboardInterrupt

    return interrupt

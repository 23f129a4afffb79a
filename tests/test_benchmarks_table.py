"""The engine table's bookkeeping (benchmarks/engines.py, benchmarks/engine_table/): the
sharded engine's worker result becomes one row per worker count, each row's whole command is
the process less what is not its own, and the lines under the table (bytes between workers,
accuracy against vectorized) are computed from the runs' summaries. No engine runs here."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import benchmark_engines

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    return benchmark_engines()


BENCH = _bench()
processes = importlib.import_module("engine_table.processes")
w1_table = importlib.import_module("engine_table.w1_table")


def sharded_result() -> dict[str, Any]:
    """What ``--worker vectorized-ray --ray-workers 1,2`` prints (shape of a real one)."""
    def row(workers: int, run_seconds: float, accuracy: float, moved: int) -> dict[str, Any]:
        clients = [100] if workers == 1 else [50, 50]
        return {"ray_workers": workers, "windows": [{"wall": 1.0 + workers, "cpu": 0.1}],
                "run_seconds": run_seconds, "final_test_accuracy": accuracy,
                "final_test_loss": 0.5 + (workers - 1) * 2e-9,
                "sharding": {"workers": [{"clients": c, "peak_rss_bytes": 500 * 2**20}
                                         for c in clients],
                             "driver_peak_rss_bytes": 600 * 2**20,
                             "total_peak_rss_bytes": (600 + 500 * workers) * 2**20,
                             "bytes_between_workers": moved},
                "peak_rss_mb": 600.0 + 500 * workers, "rss_before_mb": 550.0,
                "untimed_seconds": 5.0 + (7.0 if workers == 1 else 6.0),
                "load_before": 1.0, "load_after": 1.5, "cpu_is_driver_only": True}
    return {"engine": "vectorized-ray", "threads": 1, "ray_start_seconds": 2.5,
            "warm_up_seconds": 5.0,
            "rows": {"1": row(1, 6.0, 0.8, 3 * 11 * 38_994),
                     "2": row(2, 7.0, 0.8 + 1e-9, 3 * 12 * 38_994)}}


def test_spawn_gives_each_sharded_row_its_own_command_seconds(monkeypatch):
    monkeypatch.setattr(processes, "run_worker", lambda cmd, name: (sharded_result(), 20.0))
    args = argparse.Namespace(rounds=3, repeats=1, threads=1, workload="w1", profile=False)
    result = processes.spawn("vectorized-ray", args, repeats=1, ray_workers="1,2")
    # 20 s of process less the warm-up (5 s) and the other row's run (7 s, resp. 6 s)
    assert result["rows"]["1"]["command_seconds"] == 20.0 - 12.0
    assert result["rows"]["2"]["command_seconds"] == 20.0 - 11.0
    rows = processes.rows_of("vectorized-ray", result)
    assert list(rows) == ["vectorized-ray, 1 worker", "vectorized-ray, 2 workers"]
    assert rows["vectorized-ray, 2 workers"]["ray_start_seconds"] == 2.5  # shared keys kept
    assert processes.rows_of("plain", {"windows": []}) == {"plain": {"windows": []}}


def test_sharded_rows_summary_and_lines(capsys):
    rows = processes.rows_of("vectorized-ray", sharded_result())
    results = {name: processes.summarise(processes.merge([res]), 6000)
               for name, res in rows.items()}
    results["vectorized"] = {"final_test_accuracy": 0.8, "final_test_loss": 0.5}
    one = results["vectorized-ray, 1 worker"]
    assert one["client_sgd_steps_per_s"] == 6000 / 2.0 and one["cpu_is_driver_only"]
    summary = w1_table.sharded_summary(results, rounds=3)
    assert list(summary) == ["vectorized-ray, 1 worker", "vectorized-ray, 2 workers"]
    two = summary["vectorized-ray, 2 workers"]
    assert two["bytes_between_workers_per_cloud_round"] == 12 * 38_994  # 2 down, 10 up
    assert two["worker_clients"] == [50, 50] and two["driver_peak_rss_mb"] == 600
    assert summary["vectorized-ray, 1 worker"]["accuracy_minus_vectorized"] == 0.0
    assert two["accuracy_minus_vectorized"] == pytest.approx(1e-9)
    assert two["loss_minus_vectorized"] == pytest.approx(2e-9)
    w1_table.print_sharded(summary)
    out = capsys.readouterr().out
    assert f"vectorized-ray, 2 workers: {3 * 12 * 38_994:,} bytes" in out
    assert "(+1.0e-09 vs vectorized; test loss +2.0e-09)" in out


@pytest.mark.parametrize("value", ["0", "1,x", ""])
def test_bad_ray_workers_is_a_one_line_error(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        BENCH.main(["--ray-workers", value])
    assert exit_.value.code == 2
    assert "--ray-workers" in capsys.readouterr().err.splitlines()[-1]

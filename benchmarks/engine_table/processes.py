"""The parent's side: a worker in a fresh interpreter, and one engine's results merged and
summarised over several workers."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .workload import PROFILED

ROOT = Path(__file__).resolve().parents[2]
#: the command line every worker runs (``--worker NAME``)
SCRIPT = ROOT / "benchmarks" / "engines.py"
#: keys a row's summary keeps as they are (the sharded rows' Ray start and traffic)
CARRIED = ("profile", "final_test_loss", "sharding", "ray_workers", "ray_start_seconds",
           "warm_up_seconds", "cpu_is_driver_only")


def run_worker(cmd: list[str], name: str) -> tuple[dict[str, Any], float]:
    """Run a worker command in a fresh interpreter: (its last ``RESULT {json}`` line, the
    whole command's wall seconds); a failed worker raises with its output's tail."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "FLWR_TELEMETRY_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {name} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):])), seconds


def spawn(name: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """Run one worker in a fresh interpreter and return its result."""
    cmd = [sys.executable, str(SCRIPT), "--worker", name,
           "--rounds", str(extra.pop("rounds", args.rounds)),
           "--repeats", str(extra.pop("repeats", args.repeats)),
           "--threads", str(extra.pop("threads", args.threads))]
    if args.workload != "w1":
        cmd += ["--workload", args.workload]
    if getattr(args, "device", "cpu") != "cpu" and "device" not in extra:  # fedhier's engines
        cmd += ["--device", args.device]  # (the plain loop stays on the cpu: worker.py)
    if getattr(args, "global_period", 0) and "global_period" not in extra:
        cmd += ["--global-period", str(args.global_period)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.profile and name in PROFILED:
        cmd.append("--profile")
    print(f"  running {name} {extra or ''} ...", flush=True)
    result, seconds = run_worker(cmd, name)
    for part in (result, *result.get("rows", {}).values()):
        if "untimed_seconds" in part:  # the whole command: the process less its warm-up
            part["command_seconds"] = seconds - part["untimed_seconds"]
    return dict(result)


def row_name(engine: str, workers: int) -> str:
    """The table's name of the sharded engine's row at ``workers`` workers."""
    return f"{engine}, {workers} worker{'s' if workers != 1 else ''}"


def rows_of(name: str, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A worker's result as the table's rows: one, or one per worker count for a worker that
    measured several (the sharded engine's ``rows``), with what they share."""
    if "rows" not in result:
        return {name: result}
    shared = {k: v for k, v in result.items() if k != "rows"}
    return {row_name(name, int(n)): {**shared, **row} for n, row in result["rows"].items()}


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's results from several worker processes, as if from one."""
    merged = dict(runs[0])
    merged["windows"] = [w for run in runs for w in run["windows"]]
    merged["command_seconds"] = [run["command_seconds"] for run in runs
                                 if "command_seconds" in run]
    merged["peak_rss_mb"] = max(run["peak_rss_mb"] for run in runs)
    merged["rss_before_mb"] = max(run["rss_before_mb"] for run in runs)
    merged["load_before"] = [run["load_before"] for run in runs]
    merged["load_after"] = [run["load_after"] for run in runs]
    return merged


def summarise(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """One engine's merged results as its table row: medians, steps/s, memory, accuracy."""
    walls = [w["wall"] for w in result["windows"]]
    cpus = [w["cpu"] for w in result["windows"]]
    wall = statistics.median(walls)
    commands = result.get("command_seconds", [])
    return {"window_seconds": walls, "median_seconds": wall,
            "command_seconds": commands,
            "command_seconds_median": statistics.median(commands) if commands else None,
            "cpu_seconds": cpus, "cpu_seconds_median": statistics.median(cpus),
            "client_sgd_steps_per_s": steps / wall, "peak_rss_mb": result["peak_rss_mb"],
            "rss_before_timing_mb": result["rss_before_mb"],
            "final_test_accuracy": result["final_test_accuracy"],
            "load_average_before_after": [result["load_before"], result["load_after"]],
            **{key: result[key] for key in CARRIED if key in result}}


def write_report(report: dict[str, Any], out: Path) -> None:
    """The report as JSON at ``out`` (folders made), and where it went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out}")

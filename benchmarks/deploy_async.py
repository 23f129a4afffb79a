"""Asynchronous against synchronous edge servers with one edge really slow, in wall seconds.

``fedhier deploy local --edges 2`` on loopback, 4 clients (2 per edge), digits, contiguous
grouping, ``--periods 2,8`` (4 edge rounds of 2 steps per cloud round), ``--rounds R``, with
``--real-step-seconds S`` and ``--edge-slowdown 1:F``: every client really sleeps S seconds
per local step, edge 1's clients F x S (fedhier.local.real_slowdown), so edge 1's job takes
about 8 F S seconds against 8 S for edge 0. Two arms, interleaved ``--repeats`` times:

- ``sync``: the cloud waits for both edges every cloud round;
- ``async``: ``--async-buffer 1``: it aggregates the first report it receives (combined by
  ``--async-rule``, FedBuff by default; dropped past ``--max-staleness``, the default 4).

Each arm's time is the wall time of the whole ``fedhier deploy local`` command (start-up,
R cloud rounds, shutdown), as a user waits for it; the table gives the median per arm and
each arm's final test accuracy (the async run trains on fewer reports from the slow edge).
The async arm also skips the clients' per-round evaluation (its edges are busy), so
``--control`` runs both arms again without any sleep (S = 0): the speed-up the slow edge
makes is the one with the sleep against the control's. Prints a Markdown table
(docs/deployment.md, "Asynchronous edges").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def deploy(arm: str, out: Path, args: argparse.Namespace, port: int,
           step_seconds: float) -> tuple[float, dict]:
    """One ``fedhier deploy local`` of ``arm``; (wall seconds, summary.json)."""
    cmd = [sys.executable, "-m", "fedhier.cli", "deploy", "local", "--dataset", "digits",
           "--nodes", "4", "--edges", "2", "--grouping", "contiguous", "--periods", "2,8",
           "--rounds", str(args.rounds), "--batch-size", "8", "--seed", "3",
           "--edge-slowdown", f"1:{args.factor:g}", "--insecure", "--base-port", str(port),
           "--out", str(out), "--timeout", "1200"]
    if arm == "async":
        cmd += ["--async-buffer", "1"]
    cmd += ["--real-step-seconds", str(step_seconds)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm} deployment failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return seconds, json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="S: real sleep per local step (default 1)")
    parser.add_argument("--factor", type=float, default=4.0,
                        help="F: edge 1's slowdown (default 4)")
    parser.add_argument("--base-port", type=int, default=47300)
    parser.add_argument("--control", action="store_true",
                        help="also run both arms with S = 0 (no sleep)")
    args = parser.parse_args()
    sleeps = [args.step_seconds, *([0.0] if args.control else [])]
    arms = [(arm, s) for s in sleeps for arm in ("sync", "async")]
    times: dict[tuple[str, float], list[float]] = {a: [] for a in arms}
    accuracy: dict[tuple[str, float], list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for arm, step in arms:
                seconds, summary = deploy(arm, Path(tmp) / f"{arm}-{step:g}-{repeat}", args,
                                          args.base_port, step)
                times[arm, step].append(seconds)
                accuracy[arm, step].append(float(summary["final_test_accuracy"]))
                print(f"{arm} S={step:g} repeat {repeat}: {seconds:.1f} s, final test "
                      f"accuracy {accuracy[arm, step][-1]:.4f}", flush=True)
    print(f"\n{args.rounds} cloud rounds, 4 clients, 2 edges, edge 1 {args.factor:g}x slower; "
          f"median of {args.repeats} run(s)\n")
    print("| edges | sleep S per step | wall seconds (median) | runs | final test accuracy |")
    print("|---|---:|---:|---:|---:|")
    for arm, step in arms:
        label = "synchronous" if arm == "sync" else "asynchronous, K = 1"
        print(f"| {label} | {step:g} s | {statistics.median(times[arm, step]):.1f} | "
              f"{len(times[arm, step])} | {statistics.median(accuracy[arm, step]):.4f} |")
    for step in sleeps:
        speedup = statistics.median(times["sync", step]) / statistics.median(times["async", step])
        print(f"\nspeed-up at S = {step:g} s: {speedup:.2f}x")


if __name__ == "__main__":
    main()

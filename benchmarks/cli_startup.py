"""How fast the command line answers, and what a short run spends outside training.

Each row is a fresh ``fedhier`` process (the installed console script's interpreter, this
checkout first on PYTHONPATH), the rows interleaved round by round so that the machine's
load falls on all of them alike; medians over ``--repeats``. Rows:

- ``fedhier --help``, ``fedhier run --alpha -1`` (a range error), ``fedhier run --dataset
  nope`` (an unknown dataset), ``fedhier run --local-period 3 --global-period 10`` (a
  relation): the whole command, which must stay under 0.5 s (issue 42);
- ``python -c "import torch"``: torch's own import, the floor of any command that trains;
- W1 on the vectorized engine (digits, 100 clients, 10 edges, I=5, G=20, 10 cloud rounds,
  ``--min-partition-size 3``): the whole command against its training window (the run's own
  ``wall_seconds`` in summary.json: from the recorder's start to the last round), and their
  ratio.

``python benchmarks/cli_startup.py [--repeats 5]`` prints the table and the 1-minute load
average before and after; docs/engines.md ("How fast the command line answers") has a run.
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
W1 = ["run", "--engine", "vectorized", "--clients", "100", "--groups", "10", "--rounds", "10",
      "--min-partition-size", "3", "--no-progress"]
ANSWERS = {"fedhier --help": ["--help"], "fedhier run --alpha -1": ["run", "--alpha", "-1"],
           "fedhier run --dataset nope": ["run", "--dataset", "nope"],
           "fedhier run --local-period 3 --global-period 10":
               ["run", "--local-period", "3", "--global-period", "10"]}


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    fedhier = [sys.executable, "-m", "fedhier.cli"]
    times: dict[str, list[float]] = {name: [] for name in [*ANSWERS, "import torch",
                                                           "W1 whole command",
                                                           "W1 training window"]}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, words in ANSWERS.items():
                times[name].append(timed([*fedhier, *words], env))
            times["import torch"].append(timed([sys.executable, "-c", "import torch"], env))
            out = Path(tmp) / f"w1-{repeat}"
            times["W1 whole command"].append(timed([*fedhier, *W1, "--out", str(out)], env))
            summary = json.loads((out / "summary.json").read_text())
            times["W1 training window"].append(float(summary["wall_seconds"]))
    load_after = os.getloadavg()[0]
    print(f"{args.repeats} repeats, interleaved; 1-minute load {load_before:.1f} -> "
          f"{load_after:.1f} on {os.cpu_count()} cores")
    print(f"{'command':<50} {'median s':>9} {'min s':>7}")
    for name, values in times.items():
        print(f"{name:<50} {statistics.median(values):>9.2f} {min(values):>7.2f}")
    whole, window = times["W1 whole command"], times["W1 training window"]
    ratios = [w / t for w, t in zip(whole, window, strict=True)]
    print(f"W1 whole command / training window: median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

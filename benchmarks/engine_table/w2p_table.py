"""``--workload w2p``: W2' (LeNet-5 on Fashion-MNIST, 50 clients), the batched engine's
window against the plain loop's and inprocess's, at one and at two torch threads."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .measure import machine
from .processes import merge, spawn, summarise
from .workload import W2P, WARMUPS, w1_config, w1_stats, workload_flops

ENGINES = ("plain", "inprocess", "vectorized")
THREADS = (1, 2)


def _listed(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def parent_w2p(args: argparse.Namespace) -> dict[str, Any]:
    """Each engine at each thread count in a fresh process, ``--repeats`` passes over all
    six, interleaved; medians, ratios to the plain loop and to inprocess at the same
    threads, the load average before and after every run."""
    cfg = w1_config(args.rounds, "w2p")
    steps = cfg.clients * args.rounds * cfg.global_period
    flops_per_example, formula = workload_flops(cfg)
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "repeats": args.repeats,
        "workload": {**_listed(W2P), "name": "W2'", "rounds": args.rounds,
                     "client_sgd_steps": steps, "warm_up": _listed(WARMUPS["w2p"]),
                     **w1_stats("w2p")},
        "timed_window": "cloud-round-0 record -> last cloud-round record, as W1 (local steps, "
                        "aggregations, evaluation on all clients' rows + test set); each run "
                        "a fresh process after an untimed 10-client warm-up run",
    }
    print(f"W2' on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"{args.rounds} cloud round(s) = {steps:,} client steps, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    raw: dict[str, list[dict[str, Any]]] = {f"{e}, {t} thread{'s' * (t > 1)}": []
                                            for t in THREADS for e in ENGINES}
    for _ in range(args.repeats):
        for t in THREADS:
            for engine in ENGINES:
                raw[f"{engine}, {t} thread{'s' * (t > 1)}"].append(
                    spawn(engine, args, repeats=1, threads=t))
    rows = {name: summarise(merge(r), steps) for name, r in raw.items()}
    flops = report["workload"]["rows_per_step_total"] * flops_per_example * (
        args.rounds * cfg.global_period)
    for t in THREADS:
        suffix = f", {t} thread{'s' * (t > 1)}"
        plain, inproc = rows["plain" + suffix], rows["inprocess" + suffix]
        for engine in ENGINES:
            row = rows[engine + suffix]
            row["threads"] = t
            for base, key in ((plain, "vs_plain"), (inproc, "vs_inprocess")):
                row[key] = base["median_seconds"] / row["median_seconds"]
                row[key + "_cpu"] = base["cpu_seconds_median"] / row["cpu_seconds_median"]
            row["useful_gflops"] = flops / row["median_seconds"] / 1e9
    report["engines"] = rows
    report["flops"] = {"formula": formula, "flops_per_example": flops_per_example,
                       "useful_gflop_per_run": flops / 1e9}
    report["load_average_at_end"] = os.getloadavg()
    return report


def print_w2p(report: dict[str, Any]) -> None:
    print(f"\n{'row':<24}{'window s':>9}{'CPU s':>8}{'steps/s':>9}{'vs plain':>9}"
          f"{'(CPU)':>7}{'vs inproc':>10}{'(CPU)':>7}{'GFLOP/s':>8}{'RSS MB':>8}"
          f"{'test acc':>9}  load before/after")
    for name, r in report["engines"].items():
        loads = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(*r["load_average_before_after"],
                                                           strict=True))
        print(f"{name:<24}{r['median_seconds']:>9.2f}{r['cpu_seconds_median']:>8.2f}"
              f"{r['client_sgd_steps_per_s']:>9,.0f}{r['vs_plain']:>8.2f}x"
              f"{r['vs_plain_cpu']:>6.2f}x{r['vs_inprocess']:>9.2f}x{r['vs_inprocess_cpu']:>6.2f}x"
              f"{r['useful_gflops']:>8.1f}{r['peak_rss_mb']:>8,.0f}"
              f"{r['final_test_accuracy']:>9.4f}  {loads}")
    f = report["flops"]
    print(f"\nuseful FLOPs: {f['useful_gflop_per_run']:.1f} GFLOP per run; {f['formula']}")

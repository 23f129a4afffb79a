"""``--workload w2``: the table on W2, where the model dominates."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .measure import device_name, machine
from .processes import merge, spawn, summarise
from .workload import W2, W2_CHUNK, W2_WARMUP, w1_config, w1_stats, workload_flops


def parent_w2(args: argparse.Namespace) -> dict[str, Any]:
    """``--workload w2``: plain, inprocess and vectorized (whole, and in chunks of
    ``--client-chunk`` clients, default 100) on W2, each in a fresh process, interleaved over
    ``--repeats`` passes; steps/s, ratio to the plain loop, fraction of the matmul peak."""
    cfg = w1_config(args.rounds, "w2")
    steps_per_run = cfg.clients * args.rounds * cfg.global_period
    flops_per_example, formula = workload_flops(cfg)
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "threads": args.threads, "repeats": args.repeats,
        "workload": {**{k: list(v) if isinstance(v, tuple) else v for k, v in W2.items()},
                     "name": "W2", "rounds": args.rounds, "client_sgd_steps": steps_per_run,
                     "warm_up": {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in W2_WARMUP.items()},
                     **w1_stats("w2")},
        "timed_window": "cloud-round-0 record -> last cloud-round record, as W1 (local steps, "
                        "aggregations, evaluation on all clients' rows + test set); each engine "
                        "a fresh process after an untimed 20-client warm-up run",
        "device": device_name(args.device),
    }
    print(f"W2 on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"{args.threads} torch thread(s), device {report['device']} (plain loop: cpu), "
          f"{args.rounds} cloud round(s) = {steps_per_run:,} client steps, load average "
          f"{os.getloadavg()[0]:.2f}")
    chunk = args.client_chunk or W2_CHUNK
    runs: dict[str, tuple[str, dict[str, Any]]] = {
        "plain": ("plain", {}), "inprocess": ("inprocess", {}),
        "vectorized": ("vectorized", {"client_chunk": 0}),
        f"vectorized, chunk {chunk}": ("vectorized", {"client_chunk": chunk})}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (engine, extra) in runs.items():
            raw[name].append(spawn(engine, args, repeats=1, **extra))
    results = {name: summarise(merge(r), steps_per_run) for name, r in raw.items()}
    peak = spawn("matmul", args)
    flops = report["workload"]["rows_per_step_total"] * flops_per_example * (
        args.rounds * cfg.global_period)
    plain = results["plain"]
    for res in results.values():
        res["speedup_vs_plain"] = plain["median_seconds"] / res["median_seconds"]
        res["cpu_speedup_vs_plain"] = plain["cpu_seconds_median"] / res["cpu_seconds_median"]
        res["fraction_of_peak"] = flops / res["median_seconds"] / 1e9 / peak["matmul_gflops"]
        res["achieved_gflops"] = flops / res["median_seconds"] / 1e9
    report["engines"] = results
    report["flops"] = {"formula": formula, "flops_per_example": flops_per_example,
                       "useful_gflop_per_run": flops / 1e9,
                       "matmul_peak_gflops": peak["matmul_gflops"]}
    report["load_average_at_end"] = os.getloadavg()
    return report


def print_w2(report: dict[str, Any]) -> None:
    print(f"\ndevice: {report['device']} (plain loop: cpu); fraction of peak = useful GFLOP/s "
          f"over the window / measured float32 matmul GFLOP/s at the same threads")
    print(f"{'engine':<24}{'seconds':>9}{'steps/s':>9}{'vs plain':>10}{'GFLOP/s':>9}"
          f"{'of peak':>9}{'CPU s':>8}{'CPU vs plain':>14}{'peak RSS MB':>13}{'test acc':>10}")
    for name, res in report["engines"].items():
        print(f"{name:<24}{res['median_seconds']:>9.2f}{res['client_sgd_steps_per_s']:>9,.1f}"
              f"{res['speedup_vs_plain']:>9.2f}x{res['achieved_gflops']:>9.1f}"
              f"{res['fraction_of_peak']:>9.1%}{res['cpu_seconds_median']:>8.2f}"
              f"{res['cpu_speedup_vs_plain']:>13.2f}x{res['peak_rss_mb']:>13,.0f}"
              f"{res['final_test_accuracy']:>10.4f}")
    f = report["flops"]
    print(f"\nuseful FLOPs: {f['useful_gflop_per_run']:.1f} GFLOP per run; {f['formula']}; "
          f"float32 matmul peak {f['matmul_peak_gflops']:.1f} GFLOP/s")


"""The engine table on W1 (the default run): every engine, the 2-thread runs, the scaling."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .measure import device_name, machine
from .processes import merge, rows_of, spawn, summarise
from .workload import FLOPS_FORMULA, FLOPS_PER_EXAMPLE, SHARDED, W1, w1_stats


def parent(args: argparse.Namespace) -> dict[str, Any]:
    """W1's engine table: every chosen engine in fresh worker processes, interleaved over
    ``--repeats`` passes (the sharded engine: a row per ``--ray-workers`` count), the matmul
    peak, the 2-thread runs, the scaling runs and the targets; the report as a dict."""
    steps_per_run = W1["clients"] * args.rounds * W1["global_period"]
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "threads": args.threads, "repeats": args.repeats,
        "workload": {**{k: list(v) if isinstance(v, tuple) else v for k, v in W1.items()},
                     "rounds": args.rounds, "client_sgd_steps": steps_per_run, **w1_stats()},
        "timed_window": "cloud-round-0 record -> last cloud-round record: local steps, "
                        "aggregations and per-round evaluation (train metrics over all clients "
                        "+ test set); excludes imports, data loading, set-up, Ray start-up, "
                        "final save/plot. flower: one run; others: median over interleaved passes, "
                        "each a fresh process with a one-round warm-up run; vectorized-ray: one "
                        "process per pass, one local Ray for its rows (one row per worker count).",
    }
    report["device"] = device_name(args.device)
    print(f"W1 on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"{args.threads} torch thread(s), device {report['device']} (plain loop: cpu), "
          f"load average {os.getloadavg()[0]:.2f}")
    engines = [e for e in args.engines if not (e == "flower" and (args.skip_flower or args.quick))]
    raw: dict[str, list[dict[str, Any]]] = {}  # row -> its workers' results
    for _ in range(args.repeats):  # interleaved, so a busy spell hits every engine alike
        for name in engines:
            if name == "flower" and name in raw:
                continue
            extra = ({"ray_workers": ",".join(map(str, args.ray_workers))} if name == SHARDED
                     else {})
            for row, result in rows_of(name, spawn(name, args, repeats=1, **extra)).items():
                raw.setdefault(row, []).append(result)
    results = {name: summarise(merge(runs), steps_per_run) for name, runs in raw.items()}
    plain = results["plain"]
    for res in results.values():
        res["speedup_vs_plain"] = plain["median_seconds"] / res["median_seconds"]
        res["cpu_speedup_vs_plain"] = plain["cpu_seconds_median"] / res["cpu_seconds_median"]
    report["engines"] = results
    peak = spawn("matmul", args)
    flops = report["workload"]["rows_per_step_total"] * FLOPS_PER_EXAMPLE * (
        args.rounds * W1["global_period"])
    for res in results.values():  # useful FLOPs / window, against the matmul peak
        res["fraction_of_peak"] = flops / res["median_seconds"] / 1e9 / peak["matmul_gflops"]
        res["fraction_of_peak_cpu"] = (flops / res["cpu_seconds_median"] / 1e9
                                       / peak["matmul_cpu_gflops"])
    report["matmul_peak_gflops"] = peak["matmul_gflops"]
    report["matmul_peak_cpu_gflops"] = peak["matmul_cpu_gflops"]
    report["sharded"] = sharded_summary(results, args.rounds)
    if "vectorized" not in results:  # a subset (--engines): the table and inprocess' target
        for key, speedup in (("targets", "speedup_vs_plain"),
                             ("targets_by_cpu_time", "cpu_speedup_vs_plain")):
            report[key] = ({"inprocess_no_slower_than_1.5x_plain":
                            results["inprocess"][speedup] >= 1 / 1.5}
                           if "inprocess" in results else {})
        return report
    peak2 = spawn("matmul", args, threads=2) if args.threads != 2 else peak
    if args.threads != 2 and not args.quick:  # plain and vectorized, side by side at 2 threads
        two: dict[str, list[dict[str, Any]]] = {"plain": [], "vectorized": []}
        for _ in range(args.repeats):
            for name in two:
                two[name].append(spawn(name, args, threads=2, repeats=1))
        plain2 = summarise(merge(two["plain"]), steps_per_run)
        for name, runs in two.items():
            extra = summarise(merge(runs), steps_per_run)
            extra["speedup_vs_plain"] = plain["median_seconds"] / extra["median_seconds"]
            extra["cpu_speedup_vs_plain"] = (plain["cpu_seconds_median"]
                                             / extra["cpu_seconds_median"])
            extra["speedup_vs_plain_2_threads"] = (plain2["median_seconds"]
                                                   / extra["median_seconds"])
            extra["fraction_of_peak"] = (flops / extra["median_seconds"] / 1e9
                                         / peak2["matmul_gflops"])
            report[f"{name}_2_threads"] = extra
    vec = results["vectorized"]
    report["vectorized_flops"] = {
        "formula": FLOPS_FORMULA, "flops_per_example": FLOPS_PER_EXAMPLE,
        "useful_gflop_per_run": flops / 1e9,
        "achieved_gflops": flops / vec["median_seconds"] / 1e9,
        "matmul_peak_gflops": peak["matmul_gflops"],
        "fraction_of_peak": flops / vec["median_seconds"] / 1e9 / peak["matmul_gflops"],
        "matmul_peak_gflops_2_threads": peak2["matmul_gflops"],
        "note": "achieved = useful FLOPs / timed window (the window also holds evaluation and "
                "aggregation); the engine pads every client to 16 rows and skips the input "
                "gradient of the first layer, so executed FLOPs differ from useful ones",
    }
    counts = [] if args.skip_scaling else [100, 1000] if args.quick else [100, 1000, 10000]
    rounds = {100: max(2, min(args.rounds, 5)), 1000: 2, 10000: 1}
    scaling = [spawn("scaling", args, clients=n, rounds=rounds[n], device=args.device)
               for n in counts]
    for n in () if args.skip_scaling else [1000] if args.quick else [1000, 10000]:
        # all clients in one chunk: what the automatic chunk saves
        scaling.append(spawn("scaling", args, clients=n, rounds=rounds[n], client_chunk=n,
                             device=args.device))
    report["scaling"] = {
        "workload": "W1 replicated: client j holds the rows of W1 client j mod 100 (its own "
                    "batch order), 10 clients per edge, random grouping; per-client work equals "
                    "W1's, so time per edge round should grow linearly with clients",
        "runs": scaling}
    inproc = results.get("inprocess")  # --engines may leave it out
    report["targets"] = {
        "vectorized_steps_per_s>=25000": vec["client_sgd_steps_per_s"] >= 25000,
        "vectorized>=30x_plain": vec["speedup_vs_plain"] >= 30,
        "10000_clients_ran": any(r["clients"] == 10000 for r in scaling),
    }
    report["targets_by_cpu_time"] = {
        "vectorized_steps_per_cpu_s>=25000": steps_per_run / vec["cpu_seconds_median"] >= 25000,
        "vectorized>=30x_plain": vec["cpu_speedup_vs_plain"] >= 30,
    }
    if inproc is not None:
        report["targets"]["inprocess_no_slower_than_1.5x_plain"] = (
            inproc["speedup_vs_plain"] >= 1 / 1.5)
        report["targets_by_cpu_time"]["inprocess_no_slower_than_1.5x_plain"] = (
            inproc["cpu_speedup_vs_plain"] >= 1 / 1.5)
    return report


def print_report(report: dict[str, Any]) -> None:
    """The table of :func:`parent`'s report, the lines under it, the scaling and targets."""
    print()
    print(f"device: {report.get('device', 'cpu')} (plain loop: cpu); fraction of peak = useful "
          f"GFLOP/s over the window / measured float32 matmul GFLOP/s at the same threads")
    print(f"{'engine':<26}{'window s':>9}{'command s':>10}{'steps/s':>10}{'vs plain':>10}"
          f"{'of peak':>9}{'CPU s':>8}{'CPU vs plain':>14}{'of peak (CPU)':>15}"
          f"{'peak RSS MB':>13}{'test acc':>10}")
    rows = list(report["engines"].items())
    for name in ("plain", "vectorized"):
        if f"{name}_2_threads" in report:
            rows.append((f"{name}, 2 threads", report[f"{name}_2_threads"]))
    for name, res in rows:
        of_peak = (f"{res['fraction_of_peak']:>8.1%}" if "fraction_of_peak" in res
                   else f"{'-':>8}")
        command = res.get("command_seconds_median")
        command_s = f"{command:>10.2f}" if command is not None else f"{'-':>10}"
        if res.get("cpu_is_driver_only"):  # the workers' CPU is not in the driver's clock
            cpu_ratios = f"{'-':>14}{'-':>15}"
        else:
            cpu_ratios = (f"{res['cpu_speedup_vs_plain']:>13.1f}x"
                          f"{res.get('fraction_of_peak_cpu', float('nan')):>15.1%}")
        print(f"{name:<26}{res['median_seconds']:>9.2f}{command_s}"
              f"{res['client_sgd_steps_per_s']:>10,.0f}"
              f"{res['speedup_vs_plain']:>9.1f}x{of_peak:>9}{res['cpu_seconds_median']:>8.2f}"
              f"{cpu_ratios}{res['peak_rss_mb']:>13,.0f}{res['final_test_accuracy']:>10.4f}")
    if "vectorized_2_threads" in report and "plain_2_threads" in report:
        print(f"at 2 threads, vectorized is "
              f"{report['vectorized_2_threads']['speedup_vs_plain_2_threads']:.1f}x the plain "
              f"loop at 2 threads")
    print("window s: cloud round 0 -> last round (median); command s: the whole worker process "
          "(interpreter start, imports, data, set-up, the run, final save) less its untimed "
          f"warm-up run; peak {report['matmul_peak_gflops']:.1f} GFLOP/s by wall time, "
          f"{report['matmul_peak_cpu_gflops']:.1f} by CPU time (of peak (CPU): useful GFLOP per "
          "CPU second of the window against it, less sensitive to other load)")
    print_sharded(report.get("sharded", {}))
    if "vectorized_flops" not in report:  # an --engines subset
        for key in ("targets", "targets_by_cpu_time"):
            print(f"\n{key}:", ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                         for k, v in report[key].items()))
        return
    f = report["vectorized_flops"]
    print(f"\nvectorized: {f['achieved_gflops']:.1f} GFLOP/s useful ({f['formula']}); float32 "
          f"matmul peak {f['matmul_peak_gflops']:.1f} GFLOP/s ({f['fraction_of_peak']:.0%})")
    if report["scaling"]["runs"]:
        print(f"\n{'clients':>8}{'chunk':>7}{'s/edge round':>14}{'CPU s/edge round':>18}"
              f"{'steps/s':>10}{'peak RSS MB':>13}")
    for run in report["scaling"]["runs"]:
        edge_rounds = run["window"]["wall"] / run["seconds_per_edge_round"]
        print(f"{run['clients']:>8,}{run['client_chunk'] or 'auto':>7}"
              f"{run['seconds_per_edge_round']:>14.3f}"
              f"{run['window']['cpu'] / edge_rounds:>18.3f}{run['client_steps_per_s']:>10,.0f}"
              f"{run['peak_rss_mb']:>13,.0f}")
    for key in ("targets", "targets_by_cpu_time"):
        print(f"\n{key}:", ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                     for k, v in report[key].items()))



def sharded_summary(results: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The sharded rows' traffic and their test accuracy against ``vectorized``'s (the same
    run up to float rounding: docs/engines.md, "vectorized-ray")."""
    reference = results.get("vectorized", {})
    rows = {}
    for name, res in results.items():
        if "sharding" not in res:
            continue
        sharding = res["sharding"]
        moved = sharding["bytes_between_workers"]
        rows[name] = {
            "ray_workers": res["ray_workers"], "bytes_between_workers": moved,
            "bytes_between_workers_per_cloud_round": moved / rounds,
            "worker_clients": [w["clients"] for w in sharding["workers"]],
            "worker_peak_rss_mb": [w["peak_rss_bytes"] / 2**20 for w in sharding["workers"]],
            "driver_peak_rss_mb": sharding["driver_peak_rss_bytes"] / 2**20,
            "ray_start_seconds": res["ray_start_seconds"],
            **{f"final_test_{key}": res[f"final_test_{key}"] for key in ("accuracy", "loss")},
            **{f"{key}_minus_vectorized": (res[f"final_test_{key}"]
                                           - reference[f"final_test_{key}"]
                                           if f"final_test_{key}" in reference else None)
               for key in ("accuracy", "loss")}}
    return rows


def print_sharded(sharded: dict[str, Any]) -> None:
    """Lines under the table: each sharded row's bytes between driver and workers, shards,
    memory, and its test accuracy against vectorized's."""
    if not sharded:
        return
    first = next(iter(sharded.values()))
    print(f"sharded rows (vectorized-ray): one local Ray started once per pass for all rows "
          f"({first['ray_start_seconds']:.1f} s, inside each row's command s) and an untimed "
          f"one-round warm-up run that boots the actors (outside); each worker one Ray actor "
          f"of one CPU; CPU s is the driver's only (evaluation, cloud step), so no CPU ratios")
    for name, row in sharded.items():
        diff, loss = row["accuracy_minus_vectorized"], row["loss_minus_vectorized"]
        vs = ("no vectorized row" if diff is None or loss is None
              else f"{diff:+.1e} vs vectorized; test loss {loss:+.1e}")
        workers = ", ".join(f"{c:,} clients {m:,.0f} MB" for c, m in
                            zip(row["worker_clients"], row["worker_peak_rss_mb"], strict=True))
        print(f"  {name}: {row['bytes_between_workers']:,} bytes of models between driver and "
              f"workers ({row['bytes_between_workers_per_cloud_round']:,.0f} per cloud round); "
              f"workers [{workers}], driver {row['driver_peak_rss_mb']:,.0f} MB; test accuracy "
              f"{row['final_test_accuracy']:.4f} ({vs})")

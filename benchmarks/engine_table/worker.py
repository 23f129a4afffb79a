"""The worker: one engine measured in a fresh process (``engines.py --worker NAME``)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .measure import (
    Marks,
    device_name,
    instrument_recorder,
    matmul_peak,
    peak_rss_mb,
    profiled,
    rss_mb,
)
from .runs import plain_loop, run_engine, run_summary
from .workload import PROFILED, SHARDED, WARMUPS, replicated_federation, w1_config


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns what the parent tabulates."""
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"engine": args.worker, "threads": args.threads}
    if args.worker == "matmul":
        return {**out, **matmul_peak(args.threads)}
    marks = Marks()
    if args.worker != "plain":
        instrument_recorder(marks)
    if args.worker == "scaling":
        return {**out, **scaling_run(args, marks, load_before)}
    if args.worker == SHARDED:
        return {**out, **sharded_runs(args, marks, load_before)}
    cfg = w1_config(args.rounds, args.workload,
                    **({} if args.worker == "plain" else {"device": args.device}))
    if args.worker == "vectorized" and args.workload == "w2":
        cfg = cfg.replace(client_chunk=args.client_chunk)
    repeats = 1 if args.worker == "flower" else args.repeats
    untimed_start = time.perf_counter()
    if args.worker != "flower":  # warm-up: lazy initialisation, caches, allocator
        warm = cfg.replace(**WARMUPS.get(args.workload, {"rounds": 1}))
        if args.worker == "plain":
            plain_loop(warm, marks)
        else:
            run_engine(args.worker, warm, marks)
    untimed = time.perf_counter() - untimed_start
    out["rss_before_mb"] = rss_mb()
    windows, accuracy = [], float("nan")
    for _ in range(repeats):
        marks.marks.clear()
        if args.worker == "plain":
            accuracy = plain_loop(cfg, marks)
        else:
            summary = run_summary(args.worker, cfg)
            accuracy = float(summary["final_test_accuracy"])
            out["final_test_loss"] = float(summary["final_test_loss"])
        windows.append(marks.window())
    if args.profile and args.worker in PROFILED:  # one more, untimed run under cProfile
        untimed_start = time.perf_counter()
        profiled(lambda: run_engine(args.worker, cfg, Marks()), out)
        untimed += time.perf_counter() - untimed_start
    out.update(windows=windows, untimed_seconds=untimed, final_test_accuracy=accuracy,
               peak_rss_mb=peak_rss_mb(),
               load_before=load_before, load_after=os.getloadavg()[0])
    return out


def scaling_run(args: argparse.Namespace, marks: Marks, load_before: float) -> dict[str, Any]:
    """One vectorized run of W1 replicated to ``args.clients`` clients, in this process.

    Peak RSS (``ru_maxrss``) is this process's: the imports, a one-round 100-client warm-up
    run, building the federation and the run itself. ``rss_before_mb`` is the resident memory
    just before the measured run starts (imports and warm-up, no federation yet).
    """
    small = w1_config(1, device=args.device)  # warm-up: lazy initialisation, at small size
    run_engine("vectorized", small, marks, replicated_federation(small, small.clients))
    marks.marks.clear()
    rss_before = rss_mb()
    start = time.perf_counter()
    cfg = w1_config(args.rounds, clients=args.clients, groups=(max(1, args.clients // 10),),
                    client_chunk=args.client_chunk, device=args.device,
                    **({"global_period": args.global_period} if args.global_period else {}))
    fed = replicated_federation(cfg, args.clients)
    federation_seconds = time.perf_counter() - start
    run_engine("vectorized", cfg, marks, fed)
    total = time.perf_counter() - start
    window = marks.window()
    edge_rounds = args.rounds * cfg.global_period // cfg.local_period
    return dict(clients=args.clients, edges=max(1, args.clients // 10), rounds=args.rounds,
                client_chunk=args.client_chunk, device=device_name(args.device),
                window=window, seconds_per_edge_round=window["wall"] / edge_rounds,
                client_steps_per_s=args.clients * args.rounds * cfg.global_period
                / window["wall"], federation_seconds=federation_seconds,
                setup_seconds=marks.marks[0][1] - start, total_seconds=total,
                rss_before_mb=rss_before, peak_rss_mb=peak_rss_mb(),
                load_before=load_before, load_after=os.getloadavg()[0])



def sharded_runs(args: argparse.Namespace, marks: Marks, load_before: float) -> dict[str, Any]:
    """Engine ``vectorized-ray`` on W1 at each of ``args.ray_workers`` shard workers (e.g.
    1 and 2), all on one local Ray session started here once (``ray_session``, as many CPUs
    as the most workers): an untimed one-round warm-up run at the most workers (it boots
    every actor; later runs reuse them), then per pass one timed run per worker count.

    Returns ``ray_start_seconds`` and ``rows``: worker count -> that row's windows, test
    accuracy, ``sharding`` (the run's ``summary["sharding"]``: each worker's clients and peak
    RSS, the driver's, the model bytes moved between driver and workers), ``peak_rss_mb`` (driver +
    workers, MB) and ``untimed_seconds``: the warm-up plus the other rows' runs, so that the
    process's wall time less it is this row's whole command (interpreter, imports, the Ray
    start shared by the rows, this row's runs)."""
    from fedhier.engines.vectorized_ray.worker import ray_session

    counts = list(args.ray_workers)
    cfg = w1_config(args.rounds, device=args.device, engine=SHARDED)
    start = time.perf_counter()
    with ray_session("", max(counts)):
        ray_start = time.perf_counter() - start
        warm_start = time.perf_counter()
        run_engine(SHARDED, cfg.replace(rounds=1, ray_workers=max(counts)), marks)
        warm = time.perf_counter() - warm_start
        rss_before = rss_mb()
        rows: dict[str, dict[str, Any]] = {
            str(n): {"ray_workers": n, "windows": [], "run_seconds": 0.0} for n in counts}
        for _ in range(args.repeats):
            for n in counts:
                row = rows[str(n)]
                marks.marks.clear()
                run_start = time.perf_counter()
                summary = run_summary(SHARDED, cfg.replace(ray_workers=n))
                row["run_seconds"] += time.perf_counter() - run_start
                row["windows"].append(marks.window())
                sharding = summary["sharding"]
                row.update(final_test_accuracy=float(summary["final_test_accuracy"]),
                           final_test_loss=float(summary["final_test_loss"]),
                           sharding=sharding,
                           peak_rss_mb=sharding["total_peak_rss_bytes"] / 2**20)
    every_run = sum(row["run_seconds"] for row in rows.values())
    for row in rows.values():
        row.update(untimed_seconds=warm + every_run - row["run_seconds"],
                   rss_before_mb=rss_before, load_before=load_before,
                   load_after=os.getloadavg()[0], cpu_is_driver_only=True)
    return {"ray_start_seconds": ray_start, "warm_up_seconds": warm, "rows": rows}

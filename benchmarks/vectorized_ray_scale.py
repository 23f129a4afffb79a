"""Engine ``vectorized-ray`` on W1 replicated to many clients: memory per worker, time.

``python benchmarks/vectorized_ray_scale.py --clients 10000,100000 --workers 2``: for each
client count, in a fresh driver process, one run of W1 replicated (client j holds the rows of
W1 client j mod 100, with its own batch order; ``--per-edge`` clients per edge, default 10;
``engines.py --scale``'s federation) on a local Ray cluster of ``--workers`` shard actors
that the run starts and stops. Printed per size: each worker's clients and peak resident
memory (``ru_maxrss`` of the actor process, after the run), the driver's, the sum of all, and
the time per client and edge round (the window from the record of cloud round 1 to the last
record, over clients x edge rounds: cloud round 1 also loads the shards; with ``--rounds 1``
from round 0), and the workers' CPU seconds in their runs of jobs (all cloud rounds, loading
excluded) per client and edge round: on a shared machine CPU time does not grow with other
processes' load, wall time does. The JSON report goes to ``--out`` (default
benchmarks/results/vectorized_ray_scale.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import engines as bench

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vectorized_ray_scale.json"


def one_run(clients: int, workers: int, rounds: int, per_edge: int = 10,
            global_period: int = 0) -> dict[str, Any]:
    """One run at ``clients`` clients in this process; what :func:`main` tabulates."""
    import torch

    from fedhier.engines.vectorized_ray.engine import run_vectorized_ray
    from fedhier.runs.folder import RunFolder

    torch.set_num_threads(1)
    cfg = bench.w1_config(rounds, clients=clients, groups=(max(1, clients // per_edge),),
                          engine="vectorized-ray", ray_workers=workers)
    if global_period:
        cfg = cfg.replace(global_period=global_period)
    start = time.perf_counter()
    fed = bench.replicated_federation(cfg, clients)
    setup = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        summary = run_vectorized_ray(cfg, RunFolder.create(Path(folder) / "run"),
                                     progress=False, federation=fed)
        records = [json.loads(line) for line in
                   (Path(folder) / "run" / "metrics.jsonl").read_text().splitlines()]
    total = time.perf_counter() - start
    first = 1 if rounds > 1 else 0  # cloud round 1 also loads the workers' shards
    window = records[-1]["wall_seconds"] - records[first]["wall_seconds"]
    edge_rounds = (rounds - first) * cfg.global_period // cfg.local_period
    sharding = summary["sharding"]
    all_edge_rounds = rounds * cfg.global_period // cfg.local_period
    train_cpu = sum(w["run_cpu_seconds"] for w in sharding["workers"])
    return {"clients": clients, "workers": workers, "rounds": rounds, "per_edge": per_edge,
            "global_period": cfg.global_period,
            "edge_rounds": edge_rounds, "federation_seconds": setup, "total_seconds": total,
            "window_seconds": window,
            "seconds_per_client_edge_round": window / (clients * edge_rounds),
            "worker_cpu_seconds_per_client_edge_round": train_cpu / (clients * all_edge_rounds),
            "load_average_after": os.getloadavg()[0],
            "final_test_accuracy": summary.get("final_test_accuracy"), **sharding}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10000,100000",
                        help="client counts, comma-separated (default 10000,100000)")
    parser.add_argument("--workers", type=int, default=2, help="shard actors (default 2)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="cloud rounds (default 2: the time is the rounds after the first)")
    parser.add_argument("--per-edge", type=int, default=10,
                        help="clients per edge (default 10)")
    parser.add_argument("--global-period", type=int, default=0,
                        help="G instead of W1's 20 (5: one edge round per cloud round)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:  # a child process: its result line for bench.run_worker
        print("RESULT " + json.dumps(one_run(args.one, args.workers, args.rounds,
                                             args.per_edge, args.global_period)))
        return 0
    sizes = [int(n.replace("_", "")) for n in args.clients.split(",") if n]
    print(f"vectorized-ray, W1 replicated, {args.per_edge} clients per edge, G "
          f"{args.global_period or 'of W1 (20)'}, "
          f"{args.workers} workers, {args.rounds} cloud "
          f"round(s), load average {os.getloadavg()[0]:.2f}")
    runs = []
    for n in sizes:
        try:  # a fresh driver process, so ru_maxrss is this size's
            run, _ = bench.run_worker(
                [sys.executable, str(Path(__file__).resolve()), "--one", str(n), "--workers",
                 str(args.workers), "--rounds", str(args.rounds), "--per-edge",
                 str(args.per_edge), "--global-period", str(args.global_period)],
                f"{n} clients")
        except RuntimeError as error:
            print(f"{n:>9,} clients: failed: {(str(error).strip().splitlines() or ['?'])[-1]}")
            runs.append({"clients": n, "failed": True})
            continue
        runs.append(run)
        per_worker = ", ".join(f"{w['clients']:,} clients {w['peak_rss_bytes'] / 2**20:,.0f} MB"
                               for w in run["workers"])
        print(f"{n:>9,} clients: workers [{per_worker}], driver "
              f"{run['driver_peak_rss_bytes'] / 2**20:,.0f} MB, total "
              f"{run['total_peak_rss_bytes'] / 2**20:,.0f} MB "
              f"({run['total_peak_rss_bytes'] / n:,.0f} B/client); "
              f"{run['seconds_per_client_edge_round'] * 1e6:.1f} us per client-edge round "
              f"(workers' training CPU "
              f"{run['worker_cpu_seconds_per_client_edge_round'] * 1e6:.1f} us; driver CPU "
              f"{run['driver_cpu_seconds']:.0f} s); "
              f"{run['bytes_between_workers'] / 2**20:.1f} MB between driver and workers")
    report = {"command": "python benchmarks/vectorized_ray_scale.py " + " ".join(sys.argv[1:]),
              "machine": bench.machine(), "runs": runs}
    bench.write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

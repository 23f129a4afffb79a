"""Engines side by side on W1 (or W2), and the vectorized engine's scaling (``make bench``).

W1: digits, 100 clients, Dirichlet(alpha=0.5) partition, 10 edges (random grouping), mlp
64-128-10, I=5, G=20, batch 16, lr 0.1, 10 cloud rounds = 100 x 200 = 20,000 client SGD steps.
(``min_partition_size`` is 3: digits' 1,437 training rows cannot give 100 Dirichlet clients the
default 10 rows each; 64 of the 100 clients hold fewer than 16 rows and use all of them.)

Measured, each in a fresh Python process (so peak memory is per engine):

(a) ``plain``: a hand-written PyTorch loop over clients, as a researcher writes it without a
    framework: deep-copy the edge model, ``torch.optim.SGD`` per client, the same edge/cloud
    schedule and grouping, averaging state dicts in Python. Mini-batches are indexed from
    in-memory tensors with fedhier's ``batch_indices`` (no DataLoader), so this loop is if
    anything optimistic.
(b) ``inprocess``: fedhier's Flower strategy + ClientApp on the in-process Grid.
(c) ``flower``: Flower's Simulation Engine on Ray.
(d) ``vectorized``: fedhier's batched engine.
(e) ``vectorized-ray``: the batched engine sharded by edge over Ray, one row per count of
    ``--ray-workers`` (default 1,2), all rows in one process on one local Ray started once
    (its start is in each row's whole command; the actors boot in the untimed warm-up run);
    under the table, each row's model bytes moved between the driver and the workers, its
    shards and its test accuracy against ``vectorized``'s.

Timed window, the same for all: from the record of cloud round 0 (initial model
evaluated) to the record of the last cloud round. It contains every local step, every edge and
cloud aggregation, and the per-round evaluation every engine does (the global model on all
clients' training rows and on the test set). It excludes imports, data loading, model set-up,
Ray's start-up, and the final save/plot. Each engine first does an untimed one-round warm-up run
(except flower), then one timed run; ``--repeats`` passes over the engines, interleaved so
that a busy spell on a shared machine hits every engine alike, and the table reports the
median. Wall time is the headline; CPU time of the process (``time.process_time``, one torch
thread) is reported too, as it is less sensitive to other load (flower, vectorized-ray: the
driver only).

Every engine's row shows its window and whole-command seconds (the worker process less its
untimed warm-up run; a vectorized-ray row: less the other rows' runs too), steps/s, its ratio
to the plain loop and its fraction of the float32 matmul peak measured in the same run (useful
FLOPs over the window / peak GFLOP/s; also by CPU time: the window's CPU seconds against the
matmul's CPU-time rate);
plain and vectorized are measured again side by side at 2 threads (against the 2-thread peak).

Run ``python benchmarks/engines.py`` (all), ``--quick`` (3 rounds, no flower, no 10,000
clients, no 2-thread runs), ``--skip-flower`` or ``--engines plain,inprocess`` (a subset: only
the table); results go to benchmarks/results/engines.json (``--out`` to change).
``--profile`` adds one untimed cProfile run of inprocess and vectorized. ``--device cuda``
runs the fedhier engines on that device (the plain loop stays on the cpu); the device used is
printed.

``--workload w2``: workload W2, where the model dominates (Fashion-MNIST from the Debian
package, 1,000 clients, Dirichlet(0.5), 100 edges, ``cnn``, I=5, G=10, batch 16, one cloud
round = 10,000 client SGD steps): plain, inprocess and vectorized (whole, and in chunks of
``--client-chunk`` clients, default 100), one pass each after a 20-client warm-up run, with
steps/s, the ratio to the plain loop and the fraction of the matmul peak; the useful FLOPs
per example are counted from the model's Conv2d and Linear layers (:func:`model_macs`). It
takes 10-20 minutes on 2 cores, so it is not part of the default run (results:
benchmarks/results/engines_w2.json). ``benchmarks/profile_cnn.py`` profiles one W2 step.

``--workload w2p``: workload W2' (HierFAVG's setting with LeNet-5: Fashion-MNIST, 50
one-class clients, 5 edges, ``lenet5``, batch 20, I=6, G=60, lr 0.05, 2 cloud rounds = 6,000
client SGD steps): plain, inprocess and vectorized at 1 and at 2 torch threads, each in a
fresh process after a 10-client warm-up run, ``--repeats`` interleaved passes (default 1);
the window's wall and CPU seconds and the ratios to the plain loop and to inprocess at the
same thread count, with the load average around every run (results:
benchmarks/results/engines_w2p.json). ``benchmarks/profile_lenet5.py`` profiles its step.
``--batched-seeds 5``: only K seeds of W1 batched into one computation against K separate
runs, interleaved pairs, each in a fresh process (benchmarks/batched_seeds.py; results:
benchmarks/results/engines_seeds.json).

``--scale 1000,10000,100000``: only the vectorized engine on W1 replicated to each client
count (``--client-chunk``, default 0 = the engine's automatic chunk), each in a fresh
process: steps/s, peak RSS (``ru_maxrss``) and bytes per client (results:
benchmarks/results/engines_scale.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
# The parts, one concept each (benchmarks/engine_table/); the names other benchmarks and the
# tests import from this script are re-exported here.
from engine_table.measure import Marks, instrument_recorder, machine, matmul_peak  # noqa: E402
from engine_table.processes import ROOT, run_worker, spawn, write_report  # noqa: E402
from engine_table.runs import plain_loop, run_engine  # noqa: E402
from engine_table.scale_table import parent_scale, print_scale  # noqa: E402
from engine_table.w1_table import parent, print_report  # noqa: E402
from engine_table.w2_table import parent_w2, print_w2  # noqa: E402
from engine_table.w2p_table import parent_w2p, print_w2p  # noqa: E402
from engine_table.worker import worker  # noqa: E402
from engine_table.workload import (  # noqa: E402
    ENGINES,
    FLOPS_PER_EXAMPLE,
    MLP_MACS,
    PROFILED,
    SEED_MODES,
    W1,
    WORKLOADS,
    model_macs,
    replicated_federation,
    w1_config,
)

#: what other benchmarks (flower_path, peak_profile, index_cost, vectorized_ray_scale,
#: profile_cnn) and tests/test_benchmarks_flops.py import from this script
__all__ = ["ENGINES", "FLOPS_PER_EXAMPLE", "MLP_MACS", "ROOT", "W1", "Marks",
           "instrument_recorder", "machine", "main", "matmul_peak", "model_macs", "plain_loop",
           "replicated_federation", "run_engine", "run_worker", "spawn", "w1_config",
           "write_report"]

RESULTS = ROOT / "benchmarks" / "results" / "engines.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 cloud rounds, one repeat, no flower, no 10,000 clients")
    parser.add_argument("--skip-flower", action="store_true", help="skip the Ray engine")
    parser.add_argument("--skip-scaling", action="store_true",
                        help="skip the 100 / 1,000 / 10,000-client scaling table")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated subset of the engines (plain is always run); "
                             "without vectorized: only the engine table and targets")
    parser.add_argument("--ray-workers", default="1,2",
                        help="worker counts of the vectorized-ray rows, comma-separated "
                             "(default 1,2), all on one local Ray per pass")
    parser.add_argument("--rounds", type=int, default=None, help="cloud rounds (default 10)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per engine")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in every worker (default 1)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the inprocess and vectorized runs (one more, untimed "
                             "run each) and print the top functions")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output file (default benchmarks/results/engines.json, "
                             "with --scale engines_scale.json)")
    parser.add_argument("--scale", default="",
                        help="comma-separated client counts (e.g. 1000,10000,100000): only "
                             "the vectorized engine's memory and speed at those sizes")
    parser.add_argument("--client-chunk", type=int, default=0,
                        help="--scale: clients per chunk (default 0: the engine's automatic "
                             "chunk); --workload w2: the chunked vectorized row (default 100)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="w1",
                        help="w1 (default): digits mlp, every engine; w2: the Fashion-MNIST "
                             "cnn at 1,000 clients, plain/inprocess/vectorized only, one cloud "
                             "round and one pass by default (~10 min on 2 cores; "
                             "benchmarks/results/engines_w2.json); w2p: W2', LeNet-5 on "
                             "Fashion-MNIST, 50 clients, plain/inprocess/vectorized at 1 and "
                             "2 threads, 2 cloud rounds (benchmarks/results/engines_w2p.json)")
    parser.add_argument("--global-period", type=int, default=0,
                        help="--scale: G of the replicated W1 (default W1's 20; 5 = one edge "
                             "round per cloud round, for the million-client case)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the fedhier engines (cpu, cuda, auto)")
    parser.add_argument("--batched-seeds", type=int, default=0, metavar="K",
                        help="only K seeds of W1 batched into one computation vs K separate "
                             "runs on the vectorized engine (benchmarks/batched_seeds.py)")
    parser.add_argument("--worker", choices=(*ENGINES, "matmul", "scaling", *SEED_MODES),
                        help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=100, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = set(args.engines.split(",")) | {"plain"}
    if not chosen <= set(ENGINES):
        parser.error(f"--engines: unknown {sorted(chosen - set(ENGINES))}; choose from {ENGINES}")
    args.engines = [e for e in ENGINES if e in chosen]
    rounds_given = args.rounds
    w2 = args.workload in ("w2", "w2p")
    args.rounds = args.rounds or (3 if args.quick and not w2 else WORKLOADS[args.workload][
        "rounds"])
    args.repeats = args.repeats or (1 if args.quick or w2 else 3)
    args.scale = [int(n.replace("_", "")) for n in args.scale.split(",") if n]
    try:
        args.ray_workers = sorted({int(n) for n in args.ray_workers.split(",") if n.strip()})
    except ValueError:
        parser.error(f"--ray-workers: expected counts like 1,2, got '{args.ray_workers}'")
    if not args.ray_workers or args.ray_workers[0] < 1:
        parser.error("--ray-workers: at least one count, each >= 1")
    if args.worker in SEED_MODES or args.batched_seeds:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from batched_seeds import parent_seeds, print_seeds, seeds_worker

        if args.worker:
            print("RESULT " + json.dumps(seeds_worker(args, w1_config)), flush=True)
            return 0
        report = {"machine": machine(), **parent_seeds(args, spawn)}
        print_seeds(report)
        write_report(report, args.out or RESULTS.with_name("engines_seeds.json"))
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.scale:
        args.rounds = rounds_given or 1
        report = parent_scale(args)
        print_scale(report)
        write_report(report, args.out or RESULTS.with_name("engines_scale.json"))
        return 0
    if args.workload == "w2p":
        report = parent_w2p(args)
        print_w2p(report)
        for name, row in report["engines"].items():  # --profile: the cProfile of each row
            if "profile" in row:
                print(f"\n{name}:\n{row['profile']}")
        write_report(report, args.out or RESULTS.with_name("engines_w2p.json"))
        return 0
    if w2:
        report = parent_w2(args)
        print_w2(report)
        write_report(report, args.out or RESULTS.with_name("engines_w2.json"))
        return 0
    args.out = args.out or RESULTS
    report = parent(args)
    print_report(report)
    for name in PROFILED if args.profile else ():
        if "profile" in report.get("engines", {}).get(name, {}):
            print(f"\n{name}:\n{report['engines'][name]['profile']}")
    write_report(report, args.out)
    return 0



if __name__ == "__main__":
    sys.exit(main())

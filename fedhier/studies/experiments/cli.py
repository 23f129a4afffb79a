"""``fedhier experiment NAME``: run a suite and write results.json, results.md and figures."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from fedhier.cli.flags import (
    add_config_flags,
    config_from_args,
    config_values,
    prepare_data,
)
from fedhier.common.errors import FedhierError
from fedhier.engines.registry import engine_names
from fedhier.runs.folder import read_json, write_json
from fedhier.settings.run_config import RunConfig

NAMES = ("sandwich", "grouping", "periods", "diversity", "levels", "time", "mobility",
         "mobility-noniid", "hierfavg")

#: Base settings per size; flags given on the command line override them.
QUICK = {"dataset": "digits", "clients": 20, "groups": 4, "alpha": 0.1,
         "min_partition_size": 2, "local_period": 2, "global_period": 16, "batch_size": 16,
         "lr": 0.05}
FULL = {"dataset": "digits", "clients": 50, "groups": 5, "alpha": 0.5,
        "min_partition_size": 5, "local_period": 5, "global_period": 20, "batch_size": 16,
        "lr": 0.05}
ITERATIONS = {"quick": 320, "full": 1200}
#: Suites with their own base settings (quick, full) and iterations (quick, full): the
#: hierfavg suite runs Liu et al.'s setting, one class per client (docs/baselines.md).
SUITE_BASES = {"hierfavg": (
    {"dataset": "digits", "clients": 20, "groups": 2, "partition": "shards",
     "classes_per_client": 1, "local_period": 1, "global_period": 4, "batch_size": 8,
     "lr": 0.05},
    {"dataset": "fashion-mnist", "clients": 50, "groups": 5, "partition": "shards",
     "classes_per_client": 1, "local_period": 6, "global_period": 60, "batch_size": 20,
     "lr": 0.05})}
SUITE_ITERATIONS = {"hierfavg": {"quick": 8, "full": 1200}}
#: ``--paper-scale``: each claim at its paper's published setting, as far as fedhier can
#: express it (docs/baselines.md, "Paper settings"); flags still override. Liu et al.
#: (HierFAVG, the HierFL README): MNIST -> Fashion-MNIST (offline; --dataset npz --data-path
#: mnist.npz for the real one), LeNet-5, 50 clients on 5 edges, one class per client,
#: κ1·κ2 = 60, batch 20, lr 0.01, 100 cloud rounds. Chen et al. (mobility): CIFAR-10 (--dataset
#: cifar10 with --data-path), a CNN, vehicles on a one-way ring road carrying their models.
#: Yin et al.: a CNN on MNIST (-> Fashion-MNIST) to 95% training accuracy.
PAPER: dict[str, dict[str, Any]] = {
    "hierfavg": {"dataset": "fashion-mnist", "model": "lenet5", "clients": 50, "groups": 5,
                 "partition": "shards", "classes_per_client": 1, "local_period": 6,
                 "global_period": 60, "batch_size": 20, "lr": 0.01},
    "mobility-noniid": {"dataset": "cifar10", "model": "cnn", "clients": 50, "groups": 5,
                        "partition": "shards", "classes_per_client": 1, "local_period": 5,
                        "global_period": 20, "batch_size": 16, "lr": 0.05,
                        "handoff": "carry", "reachability": "examples/mobility/ring5.csv"},
    "diversity": {"dataset": "fashion-mnist"},
}
PAPER_ITERATIONS = {"hierfavg": 6000, "mobility-noniid": 2000}
PAPER_SEEDS = 5

#: The diversity suite's time-to-accuracy claim (Yin et al.: a CNN on MNIST to 95% training
#: accuracy): model, batch sizes, rates, target, iteration cap, check interval.
DIVERSITY_ACCURACY = {
    "quick": {"model": "logreg", "batch_sizes": [64, 256], "lrs": (0.4, 1.6, 6.4),
              "target": 0.95, "max_iterations": 600, "check_every": 5},
    "full": {"model": "cnn", "batch_sizes": [32, 128, 512], "lrs": (0.2, 0.4, 0.8, 1.6, 3.2),
             "target": 0.95, "max_iterations": 1500, "check_every": 5}}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "experiment", help="reproduce a paper claim: " + ", ".join(NAMES),
        description="Run an experiment suite over seeds; writes DIR/results.json, "
        "DIR/results.md and PNG figures. Finished runs are not rerun.")
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--quick", action="store_true", help="reduced size (tests, CI)")
    parser.add_argument("--paper-scale", action="store_true",
                        help="the paper's published setting (model, data, clients, rounds, "
                        "batch, lr; 5 seeds): hierfavg, mobility-noniid, diversity")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds 0..K-1 (default 3; 5 with --paper-scale)")
    parser.add_argument("--iterations", type=int, default=0,
                        help="local SGD iterations T per arm (default 320 quick, 1200 full)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="runs in parallel (default: the number of CPU cores)")
    parser.add_argument("--experiment-engine", default="vectorized",
                        choices=engine_names(),
                        help="engine for the arms (default vectorized)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--config", type=Path, metavar="FILE.toml", help="base config keys")
    add_config_flags(parser)


def base_config(args: argparse.Namespace) -> RunConfig:
    config_from_args(args)  # validates the flags and the config file, one-line errors
    quick, full = SUITE_BASES.get(args.name, (QUICK, FULL))
    if args.paper_scale:
        if args.quick or args.name not in PAPER:
            raise FedhierError(f"--paper-scale is for {', '.join(PAPER)}, without --quick")
        full = {**full, **PAPER[args.name]}
    values = config_values(args, quick if args.quick else full)  # as fedhier run reads them
    values.pop("out", None)
    return RunConfig.from_mapping(values, where="experiment")


def cmd_experiment(args: argparse.Namespace) -> int:
    base = base_config(args)  # first: a bad flag is refused before any library loads
    from fedhier.studies.experiments import suites
    from fedhier.studies.experiments.hierfavg_suite import hierfavg
    from fedhier.studies.experiments.mobility_noniid import mobility_noniid
    from fedhier.studies.experiments.runner import default_jobs

    if args.seeds is None:
        args.seeds = PAPER_SEEDS if args.paper_scale else 3
    if args.seeds < 1:
        raise FedhierError("--seeds must be at least 1")
    if args.jobs < 0:
        raise FedhierError(f"--jobs must be >= 0 (0 = one per CPU core), got {args.jobs}")
    if args.iterations < 0:
        raise FedhierError(f"--iterations must be >= 0 (0 = the suite's default), got "
                           f"{args.iterations}")
    total = args.iterations or (PAPER_ITERATIONS.get(args.name, 0) if args.paper_scale
                                else 0) or SUITE_ITERATIONS.get(args.name, ITERATIONS)[
        "quick" if args.quick else "full"]
    if total % base.global_period:
        raise FedhierError(f"--iterations {total} must be a multiple of G={base.global_period}")
    out = Path(args.out or f"runs/experiments/{args.name}-{base.dataset}"
               f"{'-quick' if args.quick else ''}{'-paper' if args.paper_scale else ''}")
    if out.exists() and not out.is_dir():
        raise FedhierError(f"--out {out} is a file; an experiment writes a folder")
    from fedhier.local.train import resolve_device

    resolve_device(base.device)
    prepare_data(base)  # the data and partition of the base configuration are usable
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedhierError(f"--out {out}: cannot create the folder "
                           f"({exc.strerror or exc})") from None
    seeds = list(range(args.seeds))
    started = time.time()
    if args.name == "diversity":
        from fedhier.studies.experiments.diversity_suite import diversity

        quick = args.quick
        report = diversity(base, seeds, out,
                           batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
                           if not quick else [1, 4, 16, 64, 256],
                           lrs=(0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8) if not quick
                           else (0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8), target=0.3,
                           max_iterations=3000 if not quick else 1500,
                           duplicates=64, accuracy=DIVERSITY_ACCURACY[
                               "quick" if quick else "full"] if not args.paper_scale else
                           {**DIVERSITY_ACCURACY["full"], "batch_sizes": [128, 512, 2048]})
    else:
        # the suites in their own modules build on suites.py's helpers, so they are listed here
        every = {**suites.SUITES, "hierfavg": hierfavg, "mobility-noniid": mobility_noniid}
        report = every[args.name](base, seeds, out, args.experiment_engine,
                                  args.jobs or default_jobs(), total)
    seconds = time.time() - started
    run_seconds = [float(read_json(path.parent, "summary.json")["wall_seconds"])
                   for path in sorted((out / "runs").glob("*/seed*/summary.json"))]
    command = "fedhier " + " ".join(args.argv)
    meta = {"suite": args.name, "command": command, "seconds": seconds,
            "run_seconds_total": sum(run_seconds), "runs": len(run_seconds), "seeds": seeds,
            "iterations": total, "base_config": base.to_dict(),
            "machine": f"{platform.processor() or platform.machine()}, "
                       f"{__import__('os').cpu_count()} cores"}
    write_json(out / "results.json", {**meta, **report.results})
    claims = "\n".join(f"- {'holds' if ok else 'does NOT hold'}: {text}"
                       for text, ok in report.claims.items())
    # Finished runs are reused across invocations, so the runs' own times are the true cost.
    cost = (f"; its {len(run_seconds)} runs took {sum(run_seconds) / 60:.1f} min in all, "
            "including any reused from an earlier invocation" if run_seconds else "")
    (out / "results.md").write_text(
        f"## {args.name}\n\nCommand: `{command}` ({seconds / 60:.1f} min wall clock on "
        f"{meta['machine']}{cost}; seeds {seeds}, T = {total} iterations per arm)\n\n"
        f"{report.markdown}\n\n"
        + (f"Claims:\n{claims}\n" if claims else ""))
    print(json.dumps(report.claims, indent=1) if report.claims else "")
    print(f"wrote {out / 'results.md'} and {out / 'results.json'} in {seconds:.0f} s")
    return 0

"""``fedhier sweep [SPEC.toml] [--grid KEY=V1,V2 ...]``: run a sweep and report it."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from fedhier.cli.flags import (
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    add_config_flags,
    read_config_file,
)
from fedhier.common.errors import ConfigError, FedhierError
from fedhier.runs.trackers import TRACKERS
from fedhier.settings.run_config import RunConfig


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "sweep", help="compare configurations over seeds: intervals, paired differences",
        description="Run every arm of a sweep (a TOML spec, or --grid) over seeds as ordinary "
        "run folders on Ray Tune, then write DIR/results.md, DIR/results.json and figures. "
        "Running the same command again skips finished runs and restarts cut-off ones. "
        "Run-configuration flags set the base of every arm (docs/sweeps.md).")
    parser.add_argument("spec", nargs="?", type=Path, metavar="SPEC.toml",
                        help="sweep spec: [base], [grid], [zip], [random], [tune], seeds")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="an axis of the grid (repeatable); joins the spec's [grid]")
    parser.add_argument("--seeds", type=int, metavar="K", help="seeds 0..K-1 (spec: seeds)")
    parser.add_argument("--target-accuracy", type=float, metavar="ACC",
                        help="report iterations/rounds/bytes/simulated seconds to this test "
                        "accuracy")
    parser.add_argument("--jobs", type=int, default=0,
                        help="trials at once on the local Ray (default: CPU cores)")
    parser.add_argument("--tracker", choices=TRACKERS,
                        help="also log every run to this tracker (an optional extra)")
    parser.add_argument("--batch-seeds", action="store_true",
                        help="batch only the seeds of each vectorized arm (one unit per arm), "
                        "not whole groups of arms")
    parser.add_argument("--no-batch", action="store_true",
                        help="run every trial alone (by default the vectorized trials that "
                        "share a model and dataset run as batched computations; same run "
                        "folders, same numbers)")
    parser.add_argument("--runner", choices=("local", "tune"),
                        help="local: worker processes on this machine, each started once "
                        "(default); tune: Ray Tune (the default with --ray-address)")
    parser.add_argument("--config", type=Path, metavar="FILE.toml",
                        help="base configuration keys (under the spec's [base])")
    parser.add_argument("--no-progress", action="store_true",
                        help="no line per finished run (as fedhier run's progress bar)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_config_flags(parser)


def spec_table(args: argparse.Namespace) -> dict[str, Any]:
    """The spec as one table: the file's, with --grid, --seeds, --out and base flags added."""
    from fedhier.settings.run_config import read_toml
    from fedhier.studies.sweep.spec import parse_grid

    if args.spec is None and not args.grid:
        raise ConfigError("give a sweep spec (SPEC.toml) or at least one --grid KEY=V1,V2")
    table: dict[str, Any] = dict(read_toml(args.spec)) if args.spec else {}
    if args.grid:
        grid = dict(table.get("grid", {}))
        grid.update(parse_grid(args.grid))
        table["grid"] = grid
    base = dict(table.get("base", {}))
    if args.config:
        base = {**read_config_file(args.config), **base}
    if args.seed is not None:
        raise ConfigError("--seed: a sweep runs every seed of --seeds (or the spec's seeds)")
    base.update({f.name: getattr(args, f.name) for f in fields(RunConfig)
                 if f.name != "out" and getattr(args, f.name) is not None})
    table["base"] = base
    if args.seeds is not None:
        table["seeds"] = args.seeds
    if args.target_accuracy is not None:
        table["target_accuracy"] = args.target_accuracy
    if args.out:
        table["out"] = args.out
    return table


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedhier.runs.folder import write_json
    from fedhier.runs.trackers import check_tracker
    from fedhier.studies.sweep.report import write_report
    from fedhier.studies.sweep.spec import build
    from fedhier.studies.sweep.trials import (
        batch_units,
        load_records,
        trial_state,
        trial_units,
        trials_of,
    )

    if args.jobs < 0:
        raise FedhierError(f"--jobs must be >= 0 (0 = one per CPU core), got {args.jobs}")
    check_tracker(args.tracker)
    paths = [str(Path(args.spec).resolve().parent)] if args.spec else []
    paths.append(os.getcwd())
    for path in reversed(paths):  # a module:function plugin beside the spec (or here)
        if path not in sys.path:
            sys.path.insert(0, path)
    table = spec_table(args)
    spec = build(table, where=str(args.spec or "--grid"))
    folder = spec.out.resolve()  # Tune's workers run elsewhere: absolute paths
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"sweep folder {folder} is a file; choose another out")
    trials = trials_of(spec, folder)
    states = {t.name: trial_state(t) for t in trials}
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "spec.json", table)
    pending = [t for t in trials if states[t.name] != "done"]
    counts = {s: sum(v == s for v in states.values()) for s in ("done", "resume", "restart",
                                                                "new")}
    print(f"sweep {folder}: {len(spec.arms)} arms x {len(spec.seeds)} seeds"
          f"{' x tuned values' if spec.tuned else ''} = {len(trials)} runs; "
          f"{counts['done']} finished (skipped), {counts['resume']} to resume, "
          f"{counts['restart']} to restart, {counts['new']} new")
    if pending:
        runner = args.runner or ("tune" if args.ray_address else "local")
        if runner == "local" and args.ray_address:
            raise ConfigError("--runner local runs on this machine; drop --ray-address")
        jobs = args.jobs or os.cpu_count() or 1
        units = (trial_units(pending, states, args.batch_seeds)
                 if args.no_batch or args.batch_seeds else batch_units(pending, states, jobs))
        jobs = min(jobs, len(units))
        if runner == "local":
            from fedhier.studies.sweep.local_runner import run_locally

            errors = run_locally(units, jobs, args.tracker, paths,
                                 progress=not args.no_progress)
        else:
            from fedhier.studies.sweep.tune_runner import run_on_tune

            errors = run_on_tune(units, folder, jobs, args.ray_address, args.tracker, paths,
                                 progress=not args.no_progress)
        if errors:
            print(f"fedhier: run stopped: {len(errors)} of {len(pending)} runs failed; first: "
                  f"{errors[0]}; rerun the same command to retry them", file=sys.stderr)
            return EXIT_RUN_FAILED
        unfinished = [t.name for t in pending if trial_state(t) != "done"]
        if unfinished:  # Tune stopped early (Ctrl-C): no report from part of the runs
            print(f"fedhier: interrupted: {len(unfinished)} of {len(trials)} runs unfinished "
                  f"(first: {unfinished[0]}); rerun the same command to finish them",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
    write_report(spec, trials, load_records(trials), folder)
    print(f"wrote {folder / 'results.md'}, results.json, curves.png")
    return 0

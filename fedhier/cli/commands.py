"""The ``fedhier`` command line: ``fedhier run``, ``diversity``, ``experiment``, ``deploy``,
``plot``, ``sweep``.

Bad input ends with one line on stderr and exit code 2; ``--debug`` shows the traceback.
The flags and exit codes every subcommand shares are in :mod:`fedhier.cli.flags`, the engine
names and dispatch in :mod:`fedhier.engines.registry`; the ``experiment`` and ``deploy``
subcommands live in :mod:`fedhier.studies.experiments.cli` and
:mod:`fedhier.engines.deployment.cli`. Only the ``fedhier`` console script,
``fedhier.studies.experiments.publish`` and a sweep's trials (:mod:`fedhier.studies.sweep.trials`,
which run ``fedhier run`` itself) import this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhier.cli.flags import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    OneLineParser,
    add_config_flags,
    config_from_args,
    error_text,
    exit_code_for,
    prepare_data,
    resumed_config,
    run_command,
)
from fedhier.common.errors import FedhierError
from fedhier.runs.trackers import TRACKERS, attached, make_trackers


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedhier", description="Hierarchical federated learning on Flower.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one hierarchical federation (H-SGD)",
                         description="Run H-SGD: clients -> edges every I steps -> cloud every "
                         "G steps. Flags override keys of --config.")
    run.add_argument("--config", type=Path, metavar="FILE.toml",
                     help="TOML file with run configuration keys")
    run.add_argument("--overwrite", action="store_true",
                     help="reuse a non-empty --out folder")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="continue a run from its checkpoint.pt (same configuration)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--tracker", choices=TRACKERS,
                     help="also log to tensorboard, mlflow or wandb (optional extras)")
    run.add_argument("--seeds", metavar="S1,S2,...",
                     help="vectorized engine: these seeds as one batched computation, one run "
                     "folder each (OUT/seed<S>, each equal to its one-seed run)")
    run.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_config_flags(run)

    diversity = sub.add_parser(
        "diversity", help="gradient divergences, diversity and batch-size bound of a model",
        description="Measure, without training, the divergences and gradient diversity of a "
        "model (the seeded initial model, or --model-file) on the configured federation.")
    diversity.add_argument("--config", type=Path, metavar="FILE.toml",
                           help="TOML file with run configuration keys")
    diversity.add_argument("--model-file", type=Path, metavar="FILE.safetensors",
                           help="weights to measure, e.g. a run's model_final.safetensors")
    diversity.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers")
    diversity.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_config_flags(diversity)

    from fedhier.engines.deployment.cli import add_parser as add_deploy_parser
    from fedhier.studies.experiments.cli import add_parser as add_experiment_parser
    from fedhier.studies.sweep.cli import add_parser as add_sweep_parser

    add_experiment_parser(sub)
    add_sweep_parser(sub)
    add_deploy_parser(sub)

    plot = sub.add_parser("plot", help="overlay the curves of several run folders")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    plot.add_argument("--out", type=Path, default=Path("runs/compare.png"),
                      help="output PNG (default runs/compare.png)")
    plot.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    """``fedhier run``: validate everything (flags, config file, data, partition, device, the
    run folder's place) before the run folder is claimed; hold its lock for the run's life;
    on failure remove what a failed start wrote, or mark the folder failed (failed.json)."""
    from fedhier.runs.folder import RunFolder, default_run_dir

    if getattr(args, "seeds", None) is not None:
        return cmd_run_seeds(args)
    trackers = make_trackers(getattr(args, "tracker", None))  # a missing extra: nothing written
    resume = None
    if args.resume:
        if args.overwrite:
            raise FedhierError("--resume continues a run in its own folder; drop --overwrite")
        folder = RunFolder.claim_existing(args.resume)  # refused while another run writes it
        from fedhier.engines.resume import resumable_checkpoint

        try:
            cfg = resumed_config(args)
            resume = resumable_checkpoint(args.resume, cfg)
        except BaseException:
            folder.lock.release()
            raise
    else:
        cfg = config_from_args(args)
        name = f"{cfg.dataset.replace('/', '-')}-{cfg.engine}"
        out = cfg.out or default_run_dir(name)
        if cfg.out:  # a default name is made unique by claim()
            RunFolder.check_target(out, overwrite=args.overwrite)  # before loading the data
        from fedhier.local.train import resolve_device  # torch: only once the flags are valid

        resolve_device(cfg.device)  # a device this machine lacks: one line, nothing written
        prepare_data(cfg)  # validate data and partition before anything is written
        folder = RunFolder.claim(out, overwrite=args.overwrite, unique=not cfg.out)
    from fedhier.engines.registry import run_engine

    progress = not args.no_progress
    try:
        with attached(trackers):
            summary = run_engine(cfg, folder, progress, resume)
    except KeyboardInterrupt:
        note = folder.fail("interrupted (Ctrl-C)", EXIT_INTERRUPTED, interrupted=True)
        hint = (f"; resume with: fedhier run --resume {folder.path}"
                if (folder.path / "checkpoint.pt").exists() and folder.path.is_dir() else "")
        print(f"fedhier: interrupted{hint}{'; ' + note if note else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:
        exc.add_note(folder.fail(error_text(exc), exit_code_for(exc)))
        raise
    folder.succeed()
    print(f"final test accuracy {summary['final_test_accuracy']:.4f}, test loss "
          f"{summary['final_test_loss']:.4f} after {summary['iterations']} iterations "
          f"({summary['rounds']} cloud rounds) in {summary['wall_seconds']:.1f} s "
          f"[{summary['engine']}, {summary['weighting']} weighting]")
    print(f"run folder: {folder.path}")
    return 0


def cmd_run_seeds(args: argparse.Namespace) -> int:
    """``fedhier run --seeds``: every seed validated and its folder (OUT/seed<S>) claimed
    before any runs; then one batched computation (:mod:`fedhier.engines.vectorized.seed_batch`). A
    seed that fails is reported (and its folder marked) as a one-seed run's would be; the
    other seeds' folders are kept."""
    from fedhier.engines.vectorized.seed_batch import (
        check_seeds,
        parse_seeds,
        seed_folder,
    )
    from fedhier.runs.folder import default_run_dir

    if args.resume:
        raise FedhierError("--seeds starts new runs; resume a seed on its own: fedhier run "
                           "--resume OUT/seed<S>")
    if args.seed is not None:
        raise FedhierError("give --seed or --seeds, not both")
    seeds = parse_seeds(args.seeds)
    make_trackers(args.tracker)  # a missing extra: one line, nothing written
    base = config_from_args(args)
    check_seeds(base, seeds)
    out = Path(base.out) if base.out else default_run_dir(
        f"{base.dataset.replace('/', '-')}-{base.engine}-seeds")
    cfgs = [base.replace(seed=s, out=str(seed_folder(out, s))) for s in seeds]
    code = run_configs_batched(cfgs, [args.overwrite] * len(cfgs), args.tracker,
                               not args.no_progress, [f"seed {s}" for s in seeds],
                               f"{out}/seed<S>", same_but_seed=True)
    if code == 0:
        print(f"{len(seeds)} seeds batched [vectorized]: {out}")
    return code


def run_configs_batched(cfgs: Sequence[Any], overwrite: Sequence[bool], tracker: str | None,
                        progress: bool, names: Sequence[str], resume_hint: str,
                        same_but_seed: bool = False) -> int:
    """Runs of the vectorized engine as one batched computation, each into its own folder
    ``cfg.out`` (``fedhier run --seeds``; a sweep's trials, :mod:`fedhier.studies.sweep.trials`):
    every folder checked, every federation prepared and every folder claimed before any
    runs; a run that fails is reported (and its folder marked) as a lone run's would be, the
    others' folders are kept. ``same_but_seed``: the runs are seeds of one configuration
    (:func:`fedhier.engines.vectorized.seed_batch.run_seeds`), else they may differ in anything
    (:func:`~fedhier.engines.vectorized.seed_batch.run_batched`). Returns the exit code."""
    from fedhier.engines.vectorized.seed_batch import run_batched, run_seeds
    from fedhier.local.train import resolve_device
    from fedhier.runs.folder import RunFolder

    for cfg, again in zip(cfgs, overwrite, strict=True):
        resolve_device(cfg.device)
        RunFolder.check_target(cfg.out, overwrite=again)
    feds = [prepare_data(cfg) for cfg in cfgs]  # kept: S federations outgrow prepare's cache
    folders: list[RunFolder] = []
    try:
        for cfg, again in zip(cfgs, overwrite, strict=True):
            folders.append(RunFolder.claim(cfg.out, overwrite=again))
    except BaseException:
        for folder in folders:
            folder.fail("another run's folder could not be claimed", EXIT_BAD_INPUT)
        raise

    def tracked(_: int, run: Any) -> Any:
        with attached(make_trackers(tracker)):
            return run()

    try:
        results = (run_seeds if same_but_seed else run_batched)(
            cfgs, folders, progress, wrap=tracked, federations=feds)
    except KeyboardInterrupt:
        for folder in folders:
            folder.fail("interrupted (Ctrl-C)", EXIT_INTERRUPTED, interrupted=True)
        print(f"fedhier: interrupted; resume each run with: fedhier run --resume "
              f"{resume_hint}", file=sys.stderr)
        return EXIT_INTERRUPTED
    errors: list[BaseException] = []
    for name, folder, (summary, error) in zip(names, folders, results, strict=True):
        if error is None:
            folder.succeed()
            print(f"{name}: final test accuracy {summary['final_test_accuracy']:.4f}, "
                  f"test loss {summary['final_test_loss']:.4f} after {summary['iterations']} "
                  f"iterations in {summary['wall_seconds']:.1f} s: {folder.path}")
        else:
            error.add_note(name)
            error.add_note(folder.fail(error_text(error), exit_code_for(error)))
            errors.append(error)
    if errors:
        for error in errors[1:]:
            print(f"fedhier: {error_text(error)}", file=sys.stderr)
        raise errors[0]
    return 0


def cmd_diversity(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # first: a bad flag is refused before any library loads
    import numpy as np
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from fedhier.diagnostics.in_rounds import (
        client_diagnostics,
        direct_client_gradients,
        sample_diagnostics,
    )
    from fedhier.local.train import resolve_device
    from fedhier.round.aggregators.averaging import client_weights
    from fedhier.runs.folder import write_json
    from fedhier.runs.prepare import initial_model, pooled_train_tensors
    from fedhier.tree.grouping import ClientInfo
    from fedhier.tree.hierarchy import build_hierarchy

    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.model_file and not args.model_file.is_file():
        raise FedhierError(f"--model-file {args.model_file}: no such file")
    device = resolve_device(cfg.device)
    fed = prepare_data(cfg)
    model = initial_model(cfg, fed).to(device)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    if args.model_file:
        try:
            loaded = load_file(str(args.model_file))
        except (SafetensorError, OSError) as exc:
            raise FedhierError(f"--model-file {args.model_file}: not a readable .safetensors "
                               f"file ({' '.join(str(exc).split())})") from None
        if loaded.keys() != params.keys() or any(
                loaded[k].shape != params[k].shape for k in params):
            raise FedhierError(f"{args.model_file} does not hold a '{cfg.model}' model for "
                               f"{cfg.dataset}")
        params = {k: v.to(device) for k, v in loaded.items()}
    grads = direct_client_gradients(model, params, fed, cfg.diagnostics_max_samples, cfg.seed,
                                    device)
    weights = client_weights(cfg.weighting, fed.client_sizes())
    info = ClientInfo(fed.label_histograms, fed.client_sizes(),
                      edge_tags=np.full(fed.num_clients, -1))  # no SuperNodes, no tags
    hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping, info, cfg.seed,
                                client_grads=grads, weights=weights)
    x, y = pooled_train_tensors(fed, device)
    numbers = {**client_diagnostics(grads, weights, hierarchy),
               **sample_diagnostics(model, params, x, y, cfg.diagnostics_max_samples, cfg.seed)}
    model_name = str(args.model_file) if args.model_file else f"initial (seed {cfg.seed})"
    print(f"{cfg.model} on {cfg.dataset}: {cfg.clients} clients ({cfg.partition}), "
          f"{cfg.num_edges} edges ({cfg.grouping}), {cfg.weighting} weighting, model "
          f"{model_name}")
    rows = [("global divergence  ~eps^2 = sum_j p_j ||gF_j - gf||^2", "global_divergence"),
            ("upward divergence   eps^2 = sum_i P_i ||gf_i - gf||^2", "upward_divergence"),
            ("downward divergence sum_i P_i eps_i^2", "downward_divergence"),
            ("||grad f||", "grad_norm"),
            ("client gradient diversity  Delta = sum||g_j||^2 / ||sum g_j||^2",
             "client_gradient_diversity"),
            ("sample gradient diversity  Delta (per-example gradients)",
             "sample_gradient_diversity"),
            ("batch-size bound  B_S = m * Delta", "batch_size_bound")]
    for label, key in rows:
        print(f"  {label:<66} {numbers[key]:.6g}")
    print(f"  (sample diversity over m = {numbers['diversity_samples']} pooled training rows)")
    if args.json:
        write_json(args.json, {"config": cfg.to_dict(), "model": model_name, **numbers})
    return 0


def check_output_file(path: Path, flag: str) -> None:
    """Refuse, before any work, an output file path that names a folder or lies under a
    file; its parent folders are created here."""
    if path.is_dir():
        raise FedhierError(f"{flag} {path} is a folder; give a file name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FedhierError(f"{flag} {path}: {parent} is a file, not a folder")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedhierError(f"{flag} {path}: cannot create its folder "
                           f"({exc.strerror or exc})") from None


def cmd_plot(args: argparse.Namespace) -> int:
    for run_dir in args.runs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise FedhierError(f"{run_dir} is not a fedhier run folder (no metrics.jsonl)")
    from fedhier.runs.plots import check_image_path, plot_runs  # matplotlib: once the input is good

    check_image_path(args.out, "--out")
    check_output_file(args.out, "--out")
    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a flag argparse refuses (one line), or --help (exit 0)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    from fedhier.engines.deployment.cli import cmd_deploy
    from fedhier.studies.experiments.cli import cmd_experiment
    from fedhier.studies.sweep.cli import cmd_sweep

    handlers: dict[str, Any] = {"run": cmd_run, "plot": cmd_plot, "diversity": cmd_diversity,
                                "experiment": cmd_experiment, "deploy": cmd_deploy,
                                "sweep": cmd_sweep}
    args.argv = list(argv if argv is not None else sys.argv[1:])
    code = run_command(handlers[args.command], args)
    if argv is None:  # the process's entry point (fedhier, python -m fedhier.cli.commands)
        leave_if_threads_stuck(code)
    return code


def leave_if_threads_stuck(code: int) -> None:
    """End the process now with ``code`` when a late ClientApp call of the in-process grid
    still runs (its daemon thread inside torch would abort Python's shutdown: exit 134
    after a successful run): flush output and logs, then ``os._exit``. Nothing to do
    otherwise; library callers close their grid instead (InProcessGrid.close)."""
    if "fedhier.engines.inprocess_grid" not in sys.modules:  # no in-process grid ran
        return
    from fedhier.engines.inprocess_grid import stuck_client_threads

    if not stuck_client_threads():
        return
    import logging
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)

if __name__ == "__main__":
    sys.exit(main())

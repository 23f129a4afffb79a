"""Command-line pieces shared by every ``fedhier`` subcommand (run, diversity, experiment,
deploy): the exit codes, one flag per :class:`~fedhier.settings.run_config.RunConfig` field, and how
flags, a TOML file and a resumed run folder become one validated configuration.

This module imports no subcommand, so each subcommand's module can import it without an
import cycle through :mod:`fedhier.cli.commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import struct
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fedhier.common.errors import ConfigError, DamagedFileError, DataError, FedhierError
from fedhier.engines.registry import engine_help
from fedhier.round.faults import RunFailureError
from fedhier.settings.parse import run_config_value
from fedhier.settings.run_config import RunConfig, read_toml
from fedhier.settings.table import settings

if TYPE_CHECKING:
    pass

#: Exit codes of every fedhier command (docs/faults.md has the table).
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a flag, file or folder given is wrong; nothing was written
EXIT_RUN_FAILED = 3  # the run stopped on purpose (failed clients, non-finite numbers)
EXIT_INTERNAL = 4  # a bug in fedhier: one line asking for a report (--debug: the traceback)
EXIT_WRITE_FAILED = 5  # an output could not be written (disk full, read-only, folder gone)
EXIT_INTERRUPTED = 130  # Ctrl-C (or SIGTERM during fedhier deploy)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit code 2), not the usage of
    every flag followed by the error; an unknown flag gets the closest flags of the
    (sub)command it was given to ("did you mean --dataset?")."""

    #: the innermost parser of the command line being parsed (a subcommand's)
    active: OneLineParser | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        OneLineParser.active = self
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint = _close_flags(message, OneLineParser.active or self)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {_one_line(message)}{hint} (see "
                                  f"{(OneLineParser.active or self).prog} --help)\n")


def _close_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """'; did you mean --dataset?' for the unrecognized flags of ``message`` that are close to
    one of ``parser``'s ('' when none is)."""
    import difflib

    if not message.startswith("unrecognized arguments:"):
        return ""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for word in message.split(":", 1)[1].split():
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    return f"; {'; '.join(hints)}" if hints else ""


def _one_line(text: str) -> str:
    """A message on one line (an exception's text may hold newlines)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def exit_code_for(exc: BaseException) -> int:
    """The exit code a command ends with when ``exc`` escapes it."""
    from fedhier.runs.folder import WriteError

    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, RunFailureError):
        return EXIT_RUN_FAILED
    if isinstance(exc, WriteError):
        return EXIT_WRITE_FAILED
    if isinstance(exc, FedhierError):
        return EXIT_BAD_INPUT
    return EXIT_INTERNAL


def error_text(exc: BaseException) -> str:
    """The one line (without the ``fedhier: ...:`` prefix) that reports ``exc``, with the
    notes a command added (e.g. what became of the run folder)."""
    text = _one_line(str(exc)) if isinstance(exc, FedhierError) else \
        f"{type(exc).__name__}: {_one_line(str(exc))}".rstrip(": ")
    notes = [_one_line(n) for n in getattr(exc, "__notes__", ()) if str(n).strip()]
    return "; ".join([text, *notes])


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per declared setting (--local-period ...), default None = not given."""
    group = parser.add_argument_group("run configuration (also valid as TOML keys)")
    for setting in settings():
        kind = setting.type
        default = run_config_value(setting.default)
        shown = f" (default: {default})" if default != "" else ""
        description = engine_help() if setting.name == "engine" else setting.help
        help_text = f"{description}{shown}"
        if kind == "bool":
            group.add_argument(setting.flag, dest=setting.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            converter = {"int": int, "float": float}.get(kind, str)
            metavar = "N[,N...]" if kind.startswith("tuple") else kind.upper()
            group.add_argument(setting.flag, dest=setting.name, type=converter, default=None,
                               metavar=metavar, help=help_text)


def read_config_file(path: Path) -> dict[str, Any]:
    """The table of a ``--config`` TOML file; a one-line ConfigError naming the file if it
    cannot be read, is not UTF-8 text or is not TOML."""
    try:
        return read_toml(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {exc.start}); a config "
                          "file is a TOML text file") from None


@contextlib.contextmanager
def _library_logs_held(names: tuple[str, ...] = ("datasets",)) -> Iterator[list[Any]]:
    """Hold back what the data libraries log while the data loads: on success it is
    handed to their handlers as usual; on failure the last record joins the one-line error
    instead of printing a second line ("Failed to read file ..." from ``datasets``)."""
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    saved = []
    for name in names:
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers, log.propagate = [Hold()], False
    failed = False
    try:
        yield held
    except BaseException:
        failed = True
        raise
    finally:
        for log, handlers, propagate in saved:
            log.handlers, log.propagate = handlers, propagate
        if not failed:
            for record in held:
                logging.getLogger(record.name).handle(record)


def prepare_data(cfg: RunConfig) -> Any:
    """:func:`fedhier.runs.prepare.prepare` (load and partition the data), with every problem of the
    data reported as one line naming where it came from (``--dataset``/``--data-path``), and
    non-finite features refused before any training (they would stop the run later as
    "non-finite values in the update of client ...", blaming the learning rate)."""
    import numpy as np

    from fedhier.runs.prepare import prepare

    source = (f"--data-path {cfg.data_path}" if cfg.data_path else f"--dataset {cfg.dataset}")
    try:
        with _library_logs_held() as held:
            fed = prepare(cfg)
    except DataError as exc:
        text = str(exc)
        if held:  # what the library logged (e.g. pyarrow's reason) joins the one line
            text += f" [{_one_line(held[-1].getMessage())[:300]}]"
        if cfg.dataset in text or (cfg.data_path and cfg.data_path in text):
            raise DataError(text) from exc
        raise DataError(f"{source}: {text}") from exc
    except (ValueError, IndexError, EOFError, struct.error) as exc:
        # Data files the loaders do not check (yet) fail inside numpy or pyarrow; say which
        # data, and what failed, in one line (tests/test_fuzz_cli.py finds these).
        raise DataError(f"{source}: cannot use this data ({type(exc).__name__}: {exc}); "
                        "check the data files") from exc
    for split, (x, _) in (("training", fed.bundle.train_arrays()),
                          ("test", fed.bundle.test_arrays())):
        if len(x) == 0:
            raise DataError(f"{source}: the {split} split has no rows")
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            bad = int((~np.isfinite(x)).reshape(len(x), -1).any(1).sum())
            raise DataError(f"{source}: {bad} {split} row(s) hold NaN or infinite feature "
                            "values; clean the data first")
    return fed


def config_values(args: argparse.Namespace,
                  defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration keys a command sets: its own ``defaults`` (an experiment suite's
    sizes), overlaid with the ``--config`` TOML file, overlaid with the flags given. The one
    place every command (run, diversity, experiment, deploy) resolves its flags, so they all
    read the same flags the same way:

    - ``--periods`` replaces the two-level periods below it, ``--local-period`` /
      ``--global-period`` replace ``periods`` below them;
    - a ``--data-path`` (flag or file) without a ``dataset`` of the file or flags drops the
      command's default dataset, so that :meth:`RunConfig.from_mapping` picks the dataset
      from the path (a ``FILE.npz`` reads the npz source) as ``fedhier run`` does.
    """
    base: dict[str, Any] = {}
    if args.config:
        base = {str(k).replace("-", "_"): v for k, v in read_config_file(args.config).items()}
        RunConfig.from_mapping(base, where=str(args.config))  # report the file's own errors
    given = {f.name: getattr(args, f.name) for f in fields(RunConfig)
             if getattr(args, f.name) is not None}
    layers = [dict(defaults or {}), base, given]
    for upper in range(1, len(layers)):  # each layer's periods replace those beneath it
        keys = layers[upper].keys()
        for lower in layers[:upper]:
            if "periods" in keys:
                for key in ("local_period", "global_period"):
                    lower.pop(key, None)
            elif keys & {"local_period", "global_period"}:
                lower.pop("periods", None)
    explicit = {**base, **given}
    if "dataset" not in explicit and explicit.get("data_path"):
        layers[0].pop("dataset", None)
    return {**layers[0], **explicit}


def config_from_args(args: argparse.Namespace,
                     defaults: Mapping[str, Any] | None = None) -> RunConfig:
    """The validated configuration of :func:`config_values` (TOML file, then flags); an
    unknown dataset name is refused here too, before any data library is loaded."""
    from fedhier.data.specs import check_name

    for name, flag in FORMER_ENVIRONMENT.items():  # they would be ignored: say so
        if os.environ.get(name):
            raise ConfigError(f"{name} is the setting {flag} now (a flag or a config key); "
                              "unset it and give that instead")
    cfg = RunConfig.from_mapping(config_values(args, defaults), where="command line")
    check_name(cfg.dataset)
    if cfg.replay_arrivals:  # absolute: the ServerApp may run in another folder
        from fedhier.round.asynchrony.arrival_order import arrivals_path, read_arrivals

        if not read_arrivals(cfg.replay_arrivals):  # readable before anything starts
            raise ConfigError(f"replay_arrivals {cfg.replay_arrivals}: its arrivals file "
                              "holds no recorded cloud round")
        cfg = cfg.replace(replay_arrivals=str(arrivals_path(cfg.replay_arrivals).resolve()))
    return cfg


#: Environment variables that earlier releases read -> the setting that replaced each.
FORMER_ENVIRONMENT = {"FEDHIER_REPLAY_ARRIVALS": "--replay-arrivals",
                      "FEDHIER_STEP_SECONDS": "--real-step-seconds"}


def resumed_config(args: argparse.Namespace, engine: str | None = None) -> RunConfig:
    """The configuration of the run folder being resumed (no other config flags allowed);
    ``engine`` replaces the recorded one (a deployed run records Flower's runtime)."""
    given = [f.name for f in fields(RunConfig) if getattr(args, f.name) is not None]
    if given or args.config:
        raise FedhierError("--resume continues a run with its own configuration; drop "
                           f"{', '.join('--' + g.replace('_', '-') for g in given) or '--config'}")
    path = args.resume / "config.json"
    if not path.is_file():
        raise FedhierError(f"{args.resume} is not a fedhier run folder (no config.json)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        reason = exc.strerror if isinstance(exc, OSError) else "not valid JSON"
        raise DamagedFileError(path, f"--resume {args.resume}: cannot read it ({reason})",
                               "the run folder is damaged; it cannot be continued") from None
    if not isinstance(saved, dict):
        raise DamagedFileError(path, f"--resume {args.resume}: not a run configuration",
                               "the run folder is damaged; it cannot be continued")
    names = {f.name for f in fields(RunConfig)}
    missing = sorted(names - saved.keys())
    if missing:  # defaults would silently replace them: another federation than the checkpoint's
        raise ConfigError(f"--resume {args.resume}: {path} lacks {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''}; it is damaged or from another "
                          "fedhier version, so the run cannot be continued exactly")
    if engine is not None:
        saved["engine"] = engine
    elif "flwr run" in str(saved.get("engine")) or saved.get("edge_servers"):
        raise ConfigError(f"--resume {args.resume}: this run was made through flwr run "
                          f"(engine '{saved.get('engine')}'); a deployed run continues with: "
                          f"fedhier deploy local --resume {args.resume}")
    return RunConfig.from_mapping({k: v for k, v in saved.items() if k in names},
                                  where=str(path))


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's handler; a run failure, bad input, an unwritable output or Ctrl-C
    becomes one line on stderr and its exit code (the traceback only with ``--debug``).

    Anything else is a bug in fedhier: it too ends with one line (exit code 4) that says so,
    and the fuzz tests count every such line as a failure (tests/test_fuzz_cli.py).
    """
    debug = bool(getattr(args, "debug", False))
    try:
        return int(handler(args))
    except KeyboardInterrupt as exc:
        notes = "; ".join(getattr(exc, "__notes__", ()))
        print(f"fedhier: interrupted{'; ' + notes if notes else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every exception ends as one line + exit code
        if debug:
            traceback.print_exc()
        code = exit_code_for(exc)
        prefix = {EXIT_RUN_FAILED: "fedhier: run stopped: ",
                  EXIT_INTERNAL: "fedhier: internal error: "}.get(code, "fedhier: error: ")
        hint = ("; this is a bug in fedhier: please report it (rerun with --debug for the "
                "traceback)" if code == EXIT_INTERNAL else "")
        print(f"{prefix}{error_text(exc)}{hint}", file=sys.stderr)
        return code

"""Every command in README.md and docs/*.md runs as copied (issue 42).

The commands are the lines of the fenced shell blocks (```bash, ```sh, ``` ...) of README.md
and docs/*.md, backslash continuations joined, a trailing ``# comment`` dropped; a variable
set in the same block (``F="..."``) is put in, ``$seed`` reads 0, ``R`` (rounds) 1. What each
kind of command gets, by cost (CI runs all of it, ~1-2 minutes):

1. **every** ``fedhier`` command is parsed by fedhier's own parser (each flag exists, each
   value has its type) and its configuration is built and validated as the command would
   (``config_from_args`` for run and diversity, ``resolve_config`` for deploy, the suite's
   base for experiment, the sweep's whole spec for sweep): a renamed flag, a value out of
   range, an unknown name or an impossible combination fails here. A command whose comment
   says ``exit 2`` is a documented refusal: it must end with exit code 2 and one line.
   Synopses (``fedhier run [--config FILE.toml] [flags]``) are not commands and are skipped.
2. **cheap ones run fully**, in this process: ``fedhier run`` on the inprocess and vectorized
   engines with data that ships with fedhier (digits, synthetic), and ``fedhier diversity``,
   each as copied plus ``--rounds 1 --out TMP --no-progress`` (later flags win) so that a
   command of 100 cloud rounds costs one (a ``--mobility-trace`` run keeps its rounds: the
   trace names them); each must exit 0 and leave summary.json.
3. **the expensive ones stop after 1**: the Ray engines (``flower``, ``vectorized-ray``),
   ``deploy`` (real SuperLinks), ``sweep`` (Ray Tune) and ``experiment`` (many runs) are
   exercised by their own tests (tests/test_engines.py, test_deploy*.py, test_sweep_tune.py,
   test_experiments.py); data the machine may lack (cifar10, femnist, shakespeare,
   fashion-mnist) and placeholders (``runs/<run>``, ``FILE``) likewise.
4. other commands: ``make TARGET`` names a Makefile target; ``scripts/...`` and ``python
   benchmarks/X.py`` / ``scripts/X.py`` name a file of the repository, and each ``--flag``
   given to such a script is one its source declares. Flower's own ``flwr`` commands and
   plain shell (``python -m venv``, ``pip``) are not checked here.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from fedhier.cli.commands import build_parser, main
from fedhier.cli.flags import config_from_args

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: data that ships with fedhier (no download, no system package)
SHIPPED_DATA = ("digits", "synthetic", "synthetic-wide")
PLACEHOLDER = re.compile(r"<[^>]+>|\bFILE\b|\$\w+|(?<![\w/])spec\.toml")
#: in a command's comment: it reads a run folder an earlier command of its block writes
#: (``--replay-arrivals runs/x`` after ``... --out runs/x``): its flags are checked only
READS_EARLIER = "(reads an earlier command's run folder)"


def doc_commands() -> list[tuple[str, str, str]]:
    """(file name, command, its comment) of every shell line in the docs' code blocks."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"^```([a-z]*)\n(.*?)^```", text, re.S | re.M):
            if block.group(1) not in ("", "bash", "sh", "console", "shell"):
                continue
            body = re.sub(r"\\\n\s*", " ", block.group(2))
            variables = dict(re.findall(r'^(\w+)="([^"]*)"', body, re.M))
            written = re.findall(r"--out\s+(\S+)", body)  # run folders the block makes
            for line in body.splitlines():
                line = line.strip().removeprefix("$ ")
                command, _, comment = line.partition(" #")
                for name, value in variables.items():
                    command = command.replace(f"${name}", value)
                command = command.replace("$seed", "0").replace("--rounds R", "--rounds 1")
                if any(re.search(rf"(?<!--out )(?<![\w/-]){re.escape(folder)}(?![\w/-])",
                                 command) for folder in written):
                    comment += f" {READS_EARLIER}"  # reads a run folder made before it
                if command:
                    found.append((path.name, command.strip(), comment.strip()))
    return found


def fedhier_argv(command: str) -> list[str] | None:
    if not re.match(r"(\S*/)?fedhier\s", command):
        return None
    return shlex.split(command)[1:]


COMMANDS = doc_commands()
FEDHIER = [(name, fedhier_argv(c), c, comment) for name, c, comment in COMMANDS
           if fedhier_argv(c) is not None and "[" not in c]


def validate(argv: list[str]) -> None:
    """Parse ``argv`` and build its command's configuration, as the command does first."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.command == "run" and args.resume is None:
        config_from_args(args)
        if args.seeds is not None:
            from fedhier.engines.vectorized.seed_batch import parse_seeds

            parse_seeds(args.seeds)
    elif args.command == "diversity":
        config_from_args(args)
    elif args.command == "deploy" and args.resume is None:
        from fedhier.engines.deployment.cli import resolve_config

        resolve_config(args)
    elif args.command == "experiment":
        from fedhier.studies.experiments.cli import base_config

        base_config(args)
    elif args.command == "sweep":
        from fedhier.studies.sweep.cli import spec_table
        from fedhier.studies.sweep.spec import build

        if args.spec is not None:
            sys.path.insert(0, str((ROOT / args.spec).parent))
            args.spec = ROOT / args.spec
        build(spec_table(args), where=str(args.spec or "--grid"))


def test_the_docs_hold_the_commands_this_test_reads():
    assert len(FEDHIER) > 80
    assert any("fedhier run --engine vectorized --clients 1000" in c for _, _, c, _ in FEDHIER)


@pytest.mark.parametrize("name, argv, command, comment", FEDHIER,
                         ids=[f"{n}:{c[:60]}" for n, _, c, _ in FEDHIER])
def test_every_fedhier_command_parses_and_validates(name, argv, command, comment,
                                                     monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' relative paths (examples/...) are the repository's
    argv = [PLACEHOLDER.sub("x", word) for word in argv]
    if "exit 2" in comment:  # a documented refusal: one line, exit code 2
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 2, command
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
        return
    try:
        if PLACEHOLDER.search(command) or READS_EARLIER in comment:  # the flags only
            build_parser().parse_args(argv)
        else:
            validate(argv)
    except SystemExit as exc:  # argparse's refusal
        pytest.fail(f"{name}: {command}: argparse exit {exc.code}")


def runs_fully(argv: list[str], command: str) -> bool:
    """Cheap enough to run in full (class 2 of the module docstring)."""
    if PLACEHOLDER.search(command) or argv[0] not in ("run", "diversity"):
        return False
    args = build_parser().parse_args(argv)
    if getattr(args, "resume", None) is not None:
        return False
    cfg = config_from_args(args)
    return cfg.engine in ("inprocess", "vectorized") and cfg.dataset in SHIPPED_DATA


FULL = [(n, a, c) for n, a, c, comment in FEDHIER if "exit 2" not in comment
        and READS_EARLIER not in comment and runs_fully(a, c)]


@pytest.mark.parametrize("name, argv, command", FULL, ids=[f"{n}:{c[:60]}" for n, _, c in FULL])
def test_cheap_commands_run_as_copied(name, argv, command, tmp_path, monkeypatch,
                                      one_torch_thread):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    # one cloud round, unless a mobility trace names the rounds the run must have
    rounds = [] if "--mobility-trace" in argv else ["--rounds", "1"]
    extra = [*rounds, "--no-progress", "--out", str(out)] if argv[0] == "run" else \
        ["--json", str(tmp_path / "d.json")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, *extra]) == 0, command
    if argv[0] == "run":
        assert list(out.glob("**/summary.json")), command


def test_other_commands_name_what_exists():
    makefile = (ROOT / "Makefile").read_text()
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.choices and "run" in a.choices).choices
    fedhier_flags = {flag for sub in subcommands.values() for action in sub._actions
                     for flag in action.option_strings}
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    checked = 0
    for name, command, _ in COMMANDS:
        if not re.match(r"(make|scripts/|(\S*/)?python[\d.]* \S+\.py)", command):
            continue
        words = shlex.split(command.split("&&")[0])
        if words[0] == "make":
            assert words[1] in targets, (name, command)
        elif words[0].startswith("scripts/") or (
                re.fullmatch(r"(\S*/)?python[\d.]*", words[0]) and len(words) > 1
                and words[1].endswith(".py")):
            script = ROOT / (words[0] if words[0].startswith("scripts/") else words[1])
            assert script.is_file(), (name, command)
            source = script.read_text()
            passes_on = "parse_known_args" in source  # the rest goes to a fedhier command
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                assert f'"{flag}"' in source or f"'{flag}'" in source or (
                    passes_on and flag in fedhier_flags), (name, command, flag)
        else:
            continue
        checked += 1
    assert checked > 20

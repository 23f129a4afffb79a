"""Every run setting as one row, read from its one declaration.

A setting is declared once: its name, type, default and help as a field of
:class:`fedhier.settings.run_config.RunConfig`, its valid range or names in
:mod:`fedhier.settings.ranges`. The rest is derived here, never written again:

- the CLI flag (``--local-period``) and the Flower run-config key (``local-period``): the
  name in kebab-case (:func:`cli_flag`, :func:`app_key`);
- the Flower app's ``[tool.flwr.app.config]`` in pyproject.toml (:func:`flower_app_config`):
  every setting at its default, except a value the field declares for the app itself
  (``flower_app`` in its metadata, with ``flower_app_reason``). ``flwr run -c key=value``
  only overrides keys that table holds, so it holds every setting.
  tests/test_settings_declaration.py fails when pyproject.toml differs;
  ``python -m fedhier.settings.table --write pyproject.toml`` rewrites the table.
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedhier.settings.declaration import RANGES
from fedhier.settings.parse import app_key, run_config_value, type_name
from fedhier.settings.ranges import Range
from fedhier.settings.run_config import RunConfig


@dataclass(frozen=True)
class Setting:
    """One run setting, as declared (``RunConfig`` field +
    :data:`fedhier.settings.ranges.RANGES`)."""

    name: str  # snake_case, as in Python and TOML files
    type: str  # "int", "float", "bool", "str" or "tuple[int,...]"
    default: Any
    help: str
    valid: Range | None  # numeric settings; names sets: fedhier.settings.ranges.choices()
    flower_app: Any  # the value of [tool.flwr.app.config] (run-config form)
    flower_app_reason: str  # why it differs from the default ("" = it does not)

    @property
    def flag(self) -> str:
        return cli_flag(self.name)

    @property
    def app_key(self) -> str:
        return app_key(self.name)


def cli_flag(name: str) -> str:
    """The command-line flag of setting ``name``: ``local_period`` -> ``--local-period``."""
    return "--" + app_key(name)


def settings() -> tuple[Setting, ...]:
    """Every setting, in RunConfig's order."""
    rows = []
    for f in fields(RunConfig):
        default = run_config_value(f.default)
        reason = f.metadata.get("flower_app_reason", "")
        rows.append(Setting(f.name, type_name(f.type), f.default, f.metadata.get("help", ""),
                            RANGES.get(f.name), f.metadata.get("flower_app", default), reason))
    return tuple(rows)


def flower_app_config() -> dict[str, Any]:
    """What pyproject.toml's ``[tool.flwr.app.config]`` must hold: app key -> value."""
    return {s.app_key: s.flower_app for s in settings()}


def flower_app_differences() -> dict[str, tuple[Any, Any, str]]:
    """app key -> (RunConfig default, the app's value, why) where the two differ."""
    return {s.app_key: (run_config_value(s.default), s.flower_app, s.flower_app_reason)
            for s in settings() if s.flower_app != run_config_value(s.default)}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the names and paths used here
    return repr(value)


HEADER = ("# Generated from fedhier.settings.run_config.RunConfig by\n"
          "# `python -m fedhier.settings.table --write pyproject.toml`;\n"
          "# tests/test_settings_declaration.py checks it. Every setting, as\n"
          "# kebab-case keys (flwr run -c only overrides keys listed here), at RunConfig's\n"
          "# default unless the field declares another value for the Flower app.\n")


def flower_app_toml() -> str:
    """The ``[tool.flwr.app.config]`` table as pyproject.toml holds it."""
    lines = ["[tool.flwr.app.config]", HEADER.rstrip("\n")]
    for s in settings():
        if s.flower_app_reason:
            why = f"not {_toml_value(run_config_value(s.default))}: {s.flower_app_reason}"
            lines += textwrap.wrap(why, 96, initial_indent="# ", subsequent_indent="# ")
        lines.append(f"{s.app_key} = {_toml_value(s.flower_app)}")
    return "\n".join(lines) + "\n"


def write_pyproject(path: Path) -> bool:
    """Replace the ``[tool.flwr.app.config]`` table of ``path``; True if it changed."""
    text = path.read_text(encoding="utf-8")
    table = re.compile(r"^\[tool\.flwr\.app\.config\]\n.*?(?=^\[)", re.MULTILINE | re.DOTALL)
    if not table.search(text):
        raise SystemExit(f"{path}: no [tool.flwr.app.config] table followed by another table")
    new = table.sub(lambda _: flower_app_toml() + "\n", text, count=1)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


VALID_VALUES = "### Valid values"


def valid_values_md() -> str:
    """docs/cli.md's "Valid values" section, from the declarations."""
    from fedhier.settings.declaration import choices

    rows = "\n".join(f"| `{s.name}` | {s.valid.describe()} |" for s in settings()
                     if s.valid is not None)
    names = ", ".join(f"`{name}`" for name in choices())
    return f"""{VALID_VALUES}

Every numeric setting has one valid range, declared with the setting itself
(`valid=` in `fedhier/settings/declaration.py`) and checked by `RunConfig.validate`; a value
outside it stops with one line naming the setting and exit code 2 (`fedhier run
--straggler-fraction 1.5`: `straggler_fraction must be in [0, 1], got 1.5`). This section is
generated: `python -m fedhier.settings.table --write-docs docs/cli.md`;
`tests/test_ranges.py` checks it against the code, runs each end and refuses the nearest value
across it.

| setting | valid |
|---|---|
{rows}

Settings that take one of a fixed set of names (declared the same way; `choices()` lists
them): {names}; the grouping also accepts plugins ([grouping.md](grouping.md)). Checks that
relate settings (G a multiple of I, more groups than clients, per-edge periods dividing G,
...) are in `fedhier/settings/checks.py`.
"""


def write_docs(path: Path) -> bool:
    """Replace the "Valid values" section of ``path`` (up to the next heading); True if it
    changed."""
    text = path.read_text(encoding="utf-8")
    section = re.compile(rf"^{re.escape(VALID_VALUES)}\n.*?(?=^#|\Z)", re.MULTILINE | re.DOTALL)
    if not section.search(text):
        raise SystemExit(f"{path}: no '{VALID_VALUES}' section followed by a heading")
    new = section.sub(lambda _: valid_values_md() + "\n", text, count=1)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhier.settings.table",
                                     description="print (or write) pyproject.toml's "
                                                 "[tool.flwr.app.config] from RunConfig")
    parser.add_argument("--write", type=Path, metavar="PYPROJECT",
                        help="replace the table in this file instead of printing it")
    parser.add_argument("--write-docs", type=Path, metavar="CLI_MD",
                        help="replace the 'Valid values' section of this file (docs/cli.md)")
    args = parser.parse_args(argv)
    if args.write_docs:
        print(f"{args.write_docs}: "
              f"{'rewritten' if write_docs(args.write_docs) else 'unchanged'}")
        return 0
    if args.write:
        print(f"{args.write}: {'rewritten' if write_pyproject(args.write) else 'unchanged'}")
    else:
        print(flower_app_toml(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every numeric setting has one declared range (fedhier/settings/ranges.py), and both ways in
honour it: a value at each end runs, the nearest value across an end is refused with one
line naming the setting (RunConfig and `fedhier run`, exit code 2)."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import fields
from pathlib import Path

import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.settings.declaration import RANGES, choices
from fedhier.settings.run_config import RunConfig

NUMERIC = {f.name: f.type in (int, "int") for f in fields(RunConfig)
           if f.type in (int, float, "int", "float")}
#: settings a boundary value needs company for (relations checked elsewhere in validate)
COMPANY = {"clients": {"groups": 1}, "global_period": {"local_period": 1},
           "local_period": {"global_period": 20}, "async_buffer": {"groups": 4}}


def test_every_numeric_setting_has_a_range():
    assert set(NUMERIC) == set(RANGES)


def documented() -> tuple[dict[str, str], set[str]]:
    """The ranges and name-set settings docs/cli.md ("Valid values") publishes."""
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = text.split("### Valid values", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, flags=re.MULTILINE))
    names = section.split("fixed set of names", 1)[1].split("; the grouping", 1)[0]
    return rows, set(re.findall(r"`(\w+)`", names)) - {"choices"}


def test_the_documented_section_is_the_generated_one():
    """docs/cli.md's "Valid values" is generated from the declarations: on failure run
    `python -m fedhier.settings.table --write-docs docs/cli.md`."""
    from fedhier.settings.table import valid_values_md

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    assert valid_values_md() in text


def test_the_code_checks_the_documented_ranges():
    """The docs are the contract: a range changed in fedhier/settings/ranges.py alone (an upper
    bound dropped, a name set no longer checked) fails here, not only in the derived cases."""
    rows, names = documented()
    assert {name: valid.describe() for name, valid in RANGES.items()} == rows
    assert set(choices()) == names


@pytest.mark.parametrize("flag,value", [("--straggler-fraction", "1.5"),
                                        ("--optimizer-state", "global"),
                                        ("--participation", "0"), ("--fail-rate", "1"),
                                        ("--mobility-rate", "1.5"), ("--momentum", "1"),
                                        ("--client-holdout", "1"), ("--alpha", "0")])
def test_the_issue_cases_are_refused(tmp_path, flag, value):
    """Independent of the table: values the docs call invalid (issue #31 put two back)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", flag, value, "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 2 and flag[2:].replace("-", "_") in err.getvalue(), err.getvalue()
    assert not (tmp_path / "run").exists()


def cases(side: int) -> list[tuple[str, float]]:
    return [(name, value) for name, valid in RANGES.items()
            for value in valid.examples(NUMERIC[name])[side]]


def as_value(name: str, value: float) -> float | int:
    return int(value) if NUMERIC[name] and float(value).is_integer() else value


@pytest.mark.parametrize("name,value", cases(0))
def test_values_at_the_ends_are_accepted(name, value):
    cfg = RunConfig.from_mapping({**COMPANY.get(name, {}), name: as_value(name, value)})
    assert getattr(cfg, name) == value


@pytest.mark.parametrize("name,value", cases(1))
def test_values_across_an_end_are_refused_naming_the_setting(name, value):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({**COMPANY.get(name, {}), name: as_value(name, value)})
    message = str(info.value)
    assert name in message and "\n" not in message


@pytest.mark.parametrize("name,value", [*cases(1), *((name, "global") for name in choices())])
def test_cli_refuses_out_of_range_values_with_exit_2(tmp_path, name, value):
    """Numbers across an end, and a name outside each closed set (--optimizer-state global)."""
    value = as_value(name, value) if name in NUMERIC else value
    argv = ["run", "--out", str(tmp_path / "run"), "--no-progress"]
    for key, v in {**COMPANY.get(name, {}), name: value}.items():
        argv += ["--" + key.replace("_", "-"), str(v)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    lines = err.getvalue().splitlines()
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("fedhier")
    assert name in lines[0] or name.replace("_", "-") in lines[0]
    assert not (tmp_path / "run").exists()


# -- the control characters hypothesis found (issue #31): one line, escaped ----------------
@pytest.mark.parametrize("key", ["grouping", "weighting", "lr_schedule", "handoff", "engine"])
@pytest.mark.parametrize("text", ["\n", "a\nb", "\x1b[31m", "\r", "\u2028", "\t"])
def test_errors_do_not_echo_control_characters(key, text):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({key: text})
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.isprintable(), repr(message)
    assert key in message


def test_grouping_newline_example():  # the exact case the issue reports
    with pytest.raises(ConfigError, match=r"unknown grouping '\\n'"):
        RunConfig.from_mapping({"grouping": "\n"})


def test_range_examples_and_wording():
    """The derived cases themselves (computed at collection, where mutation testing cannot
    see them): each end and its neighbour across, in the words the docs use."""
    from fedhier.settings.ranges import AT_LEAST_1, POSITIVE, UNIT, UNIT_OPEN_TOP, Range

    assert UNIT.examples(False) == ([0, 1], [-0.5, 1.5])
    assert UNIT_OPEN_TOP.examples(False) == ([0, 0.75], [-0.5, 1])
    assert POSITIVE.examples(False) == ([0.25], [0])
    assert POSITIVE.examples(True) == ([1], [0])
    assert AT_LEAST_1.examples(True) == ([1], [0])
    assert RANGES["participation"].examples(False) == ([0.25, 3], [0, 1.5])
    assert Range(high=5, high_open=True).examples(True) == ([4], [5])
    assert Range().examples(False) == ([1], [])
    assert [r.describe() for r in (Range(high=2.0), Range(high=2.5, high_open=True), Range(),
                                   Range(0.5, 1.5, low_open=True))] == [
        "<= 2", "< 2.5", "any number", "in (0.5, 1.5]"]
    assert Range(0, 1, low_open=True, high_open=True).contains(0.5)
    assert not Range(0, 1, low_open=True, high_open=True).contains(1)
    assert not Range(0, whole_above_one=True).contains(float("nan"))

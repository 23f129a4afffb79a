"""Groupings from other installed packages (entry point group ``fedhier.groupings``).

A tiny package is built and installed with pip (real metadata: a .dist-info with
entry_points.txt) into a folder put on sys.path; `fedhier run --grouping NAME` then uses it,
and a plugin that fails to import stops the run with one line before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo, assign_groups, available_groupings

PLUGIN_MODULE = textwrap.dedent("""
    import numpy as np

    def reverse_blocks(info, num_groups, seed):
        \"\"\"Contiguous blocks, last group first.\"\"\"
        sizes = np.full(num_groups, info.num_clients // num_groups)
        sizes[: info.num_clients % num_groups] += 1
        return (num_groups - 1 - np.repeat(np.arange(num_groups), sizes)).astype(np.int64)

    def odd_even(info, num_groups, seed):
        return np.arange(info.num_clients) % num_groups

    NOT_A_FUNCTION = 3
""")
PYPROJECT = textwrap.dedent("""
    [build-system]
    requires = ["setuptools"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "fedhier-demo-plugin"
    version = "0.3"

    [project.entry-points."fedhier.groupings"]
    reverse-blocks = "fedhier_demo_plugin:reverse_blocks"
    broken = "fedhier_demo_plugin_missing.grouping:whatever"
    not-callable = "fedhier_demo_plugin:NOT_A_FUNCTION"
    random = "fedhier_demo_plugin:odd_even"

    [project.entry-points."fedhier.tree.grouping"]
    odd-even-legacy = "fedhier_demo_plugin:odd_even"
""")


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the installed demo plugin package (``pip install --target``)."""
    tmp = tmp_path_factory.mktemp("plugin")
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "fedhier_demo_plugin.py").write_text(PLUGIN_MODULE)
    (tmp / "pkg" / "pyproject.toml").write_text(PYPROJECT)
    site = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--target", str(site), str(tmp / "pkg")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (site / "fedhier_demo_plugin-0.3.dist-info" / "entry_points.txt").is_file()
    return site


@pytest.fixture
def with_plugin(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(plugin_site))
    return plugin_site


def test_plugins_are_listed_and_used(with_plugin):
    names = available_groupings()
    assert {"reverse-blocks", "broken", "not-callable", "odd-even-legacy"} <= set(names)
    assert names.count("random") == 1  # a plugin cannot replace a built-in
    info = ClientInfo(label_histograms=np.ones((5, 3), dtype=np.int64),
                      num_examples=np.ones(5, dtype=np.int64))
    assert assign_groups("reverse-blocks", info, 2, seed=0).tolist() == [1, 1, 1, 0, 0]
    assert assign_groups("odd-even-legacy", info, 2, seed=0).tolist() == [0, 1, 0, 1, 0]
    assert RunConfig(grouping="reverse-blocks").grouping == "reverse-blocks"


def test_broken_plugin_is_one_line_naming_it_and_its_package(with_plugin):
    with pytest.raises(ConfigError) as exc:
        RunConfig(grouping="broken")
    assert str(exc.value) == (
        "grouping plugin 'broken' from package fedhier-demo-plugin 0.3 "
        "(fedhier_demo_plugin_missing.grouping:whatever) failed to import: "
        "ModuleNotFoundError: No module named 'fedhier_demo_plugin_missing'; fix or uninstall "
        "that package")
    with pytest.raises(ConfigError, match="'not-callable' from package fedhier-demo-plugin 0.3 "
                                          r"\(fedhier_demo_plugin:NOT_A_FUNCTION\) is a int"):
        RunConfig(grouping="not-callable")


def test_cli_runs_with_a_plugin_grouping(with_plugin, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--clients", "6", "--groups", "2", "--rounds", "1", "--local-period",
                 "1", "--global-period", "1", "--grouping", "reverse-blocks", "--no-progress",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    groups = json.loads((out / "groups.json").read_text())
    assert groups["client_to_edge"] == [1, 1, 1, 0, 0, 0]
    assert json.loads((out / "config.json").read_text())["grouping"] == "reverse-blocks"


def test_cli_broken_plugin_exit_2_one_line_nothing_written(with_plugin, tmp_path):
    """A subprocess, as a user runs it: exit 2, one stderr line, an existing folder untouched."""
    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    env = {"PYTHONPATH": str(with_plugin), "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run([sys.executable, "-m", "fedhier.cli", "run", "--grouping", "broken",
                           "--no-progress", "--out", str(out), "--overwrite"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "grouping plugin 'broken' from package fedhier-demo-plugin 0.3" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"

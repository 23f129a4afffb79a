"""The repository's shape (issue 39, docs/index.md): the design card's root folders, a
subpackage per concept in fedhier/, short modules, one definition per class name, and the
last release's import names still working with a DeprecationWarning."""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import pytest

from fedhier.common.import_names import RENAMED, SOURCE_FOLDERS, renamed

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("fedhier", "strategies", "clients", "datasets_cfg")


def tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return sorted(set(listed))  # once each (a merge in progress lists a file per stage)


@pytest.fixture(scope="module")
def files() -> list[str]:
    return tracked()


def test_the_root_holds_the_design_cards_folders(files):
    folders = {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}
    assert folders == {"fedhier", "strategies", "clients", "datasets_cfg", "tests", "docs",
                       "benchmarks", "examples", "scripts"}


def test_the_core_has_at_most_twelve_entries(files):
    entries = {f.split("/")[1] for f in files if f.startswith("fedhier/")}
    assert len(entries) <= 12, sorted(entries)


def test_no_module_is_over_500_lines(files):
    long = {f: n for f in files if f.startswith(PRODUCT) and f.endswith(".py")
            and (n := len((ROOT / f).read_text().splitlines())) > 500}
    assert not long, long


def test_no_class_name_is_defined_twice(files):
    where = collections.defaultdict(list)
    for f in files:
        if f.startswith(PRODUCT) and f.endswith(".py"):
            for node in ast.walk(ast.parse((ROOT / f).read_text())):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f)
    twice = {name: found for name, found in where.items() if len(found) > 1}
    assert not twice, twice


def path_of(module: str) -> Path:
    """The file stem of ``module`` in the source tree (its root folders included)."""
    for package in sorted(SOURCE_FOLDERS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].strip(".")
            return ROOT / SOURCE_FOLDERS[package] / Path(*rest.split(".") if rest else ())
    return ROOT / Path(*module.split("."))


def test_every_renamed_module_has_a_module_of_todays_name():
    """Each old name of the table points at a module of the tree (nothing forwards to a name
    that a later move left behind)."""
    for old, new in RENAMED.items():
        base = path_of(new)
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), old
    assert renamed("fedhier_strategies.edge.server") == "fedhier.strategies.edge.server"
    assert renamed("fedhier.hsgd") == "fedhier.round.loop"
    assert renamed("fedhier.round.loop") is None


OLD_NAMES = """
import warnings
def expect(statement, new):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", DeprecationWarning)
        exec(statement, {})
    mine = [str(w.message) for w in seen if "fedhier" in str(w.message)]
    assert mine and all(new in m for m in mine), (statement, mine)
expect("import fedhier_strategies", "fedhier.strategies")
expect("import fedhier_clients.app", "fedhier.clients")
expect("import fedhier.hsgd", "fedhier.round.loop")
expect("from fedhier.config import RunConfig", "fedhier.settings.run_config")
import fedhier.strategies, fedhier.clients.app, fedhier.round.loop, fedhier_strategies
import fedhier_clients.app, fedhier.hsgd, fedhier_strategies.hierfedavg
assert fedhier_strategies.HierFedAvg is fedhier.strategies.HierFedAvg
assert fedhier_strategies.hierfedavg is sys.modules["fedhier.strategies.hierfedavg"]
assert fedhier_clients.app.app is fedhier.clients.app.app
assert fedhier.hsgd is fedhier.round.loop
from fedhier.clients.adapter import register_profile  # the earliest docs' name: today's
print("ok")
"""


def test_the_last_releases_names_import_todays_modules_with_a_warning():
    """fedhier_strategies, fedhier_clients and the core's old module names import the module
    of today's name (the same objects), each with a DeprecationWarning naming it."""
    done = subprocess.run([sys.executable, "-c", "import sys\n" + OLD_NAMES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_a_bare_source_tree_finds_the_root_folders(tmp_path):
    """Without any install (only the source tree on sys.path, site-packages off), importing
    fedhier finds fedhier.strategies, fedhier.clients and fedhier.datasets_cfg in the root
    folders beside it: the way an unpacked FAB runs."""
    import shutil

    for name in (*PRODUCT, "pyproject.toml"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / name)
    code = ("import importlib.util, fedhier\n"
            "for name in ('fedhier.strategies', 'fedhier.clients', 'fedhier.clients.wire',"
            " 'fedhier.datasets_cfg'):\n"
            "    print(importlib.util.find_spec(name).origin)\n")
    done = subprocess.run([sys.executable, "-S", "-I", "-c",
                           f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n{code}"],
                          capture_output=True, text=True, cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / f) for f in (
        "strategies/__init__.py", "clients/__init__.py", "clients/wire/__init__.py",
        "datasets_cfg/__init__.py")]

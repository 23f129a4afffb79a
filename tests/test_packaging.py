"""fedhier installed from its wheel (not editable) works, and `flwr run .` needs no install.

The slow tests build the wheel from a copy of the source, install it into a fresh venv, and run
from a folder outside the repository, so nothing resolves through the repo's files or the
editable install. The fresh venv reuses this venv's third-party packages (a .pth file) to stay
fast; fedhier itself comes only from the wheel (`pip install --no-index` also checks that the
wheel's requirements are met by the pinned packages).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

# flwr's FAB builder uses a pathspec pattern class that pathspec deprecates
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[1]
#: Import package -> its folder in the source tree (the FAB holds these folders as they are;
#: the wheel puts each at its import name's path: strategies/ at fedhier/strategies/, ...).
PACKAGE_FOLDERS = {"fedhier": "fedhier", "fedhier.strategies": "strategies",
                   "fedhier.clients": "clients", "fedhier.datasets_cfg": "datasets_cfg",
                   "fedhier_strategies": "strategies/deprecated_fedhier_strategies",
                   "fedhier_clients": "clients/deprecated_fedhier_clients"}
_SKIP_EVERYWHERE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                          "__pycache__", ".*_cache", "*.fab")


def _skip(folder: str, names: list[str]) -> set[str]:
    """What a copy of the source leaves out: caches and builds anywhere, and the root's
    runs/ (run folders; fedhier/runs/ is a package)."""
    skipped = set(_SKIP_EVERYWHERE(folder, names))
    return skipped | ({"runs"} & set(names) if Path(folder) == ROOT else set())


def _source_packages() -> set[str]:
    """Every package (a folder with __init__.py) of the source, by its import name."""
    found = set()
    roots = {ROOT / folder for folder in PACKAGE_FOLDERS.values()}
    for package, folder in PACKAGE_FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            inner = [r for r in roots if r != ROOT / folder and r in init.parents
                     and ROOT / folder in r.parents]
            if "__pycache__" in init.parts or inner:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    return found


def test_pyproject_lists_every_package():
    """pyproject.toml's explicit ``packages`` (needed beside ``package-dir``) is complete."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(listed["packages"]) == _source_packages()
    mapped = {k: v for k, v in listed["package-dir"].items() if k}
    assert mapped == {k: v for k, v in PACKAGE_FOLDERS.items() if k != "fedhier"}


def test_fab_carries_what_the_apps_import():
    """`flwr run .` packs the code of the components and the dataset cards, and nothing else."""
    from flwr.cli.build import build_fab_from_disk

    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist())
    for needed in ("pyproject.toml", "fedhier/__init__.py", "fedhier/runs/prepare.py",
                   "strategies/server_app.py", "clients/app.py",
                   "datasets_cfg/digits.toml", "datasets_cfg/shakespeare.toml"):
        assert needed in names
    for folder in PACKAGE_FOLDERS.values():
        for init in (ROOT / folder).rglob("__init__.py"):
            assert str(init.relative_to(ROOT)) in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "benchmarks/", "runs/"))]


def test_source_tree_imports_the_packages():
    """From a checkout (or an unpacked FAB) on sys.path, the three packages are its folders."""
    code = ("import fedhier.strategies, fedhier.clients.app, fedhier.datasets_cfg, sys; "
            "print(fedhier.strategies.__file__)")
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, "
                           f"{str(ROOT)!r}); {code}"], capture_output=True, text=True,
                          cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "strategies" / "__init__.py")


# --------------------------------------------------------------------------- the wheel


def _write_console_scripts(venv: Path, dist_name: str) -> None:
    """The console scripts of ``dist_name`` (installed in this venv) for ``venv``'s python."""
    for ep in distribution(dist_name).entry_points:
        if ep.group == "console_scripts":
            module, _, attr = ep.value.partition(":")
            script = venv / "bin" / ep.name
            script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import {attr}\n"
                              f"sys.exit({attr}())\n")
            script.chmod(0o755)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, a fresh venv with it installed)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_skip)
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                            "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp / "dist").glob("fedhier-*.whl"))
    venv = _bare_venv(tmp / "venv")  # so `fedhier` can only come from the wheel
    installed = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q",
                                "--no-index", str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    _write_console_scripts(venv, "flwr")  # flwr, flower-superlink, flwr-simulation ...
    return wheel, venv


def _bare_venv(folder: Path) -> Path:
    """A venv with this venv's third-party packages (a .pth line) and no fedhier at all."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True,
                   timeout=120)
    purelib = subprocess.run([str(folder / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # A .pth line adds the folder but does not run the editable install's finder hook.
    Path(purelib, "_fedhier_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return folder


@pytest.mark.slow
def test_components_load_from_the_fab_in_two_threads(tmp_path):
    """As in Flower's Simulation Engine: the ServerApp and the ClientApp are loaded from the
    unpacked FAB by two threads at once, with fedhier not installed."""
    from flwr.cli.build import build_fab_from_disk

    fab = tmp_path / "fab"
    zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).extractall(fab)
    venv = _bare_venv(tmp_path / "venv")
    probe = textwrap.dedent(f"""
        import threading
        from flwr.supercore.object_ref import load_app, validate
        fab = {str(fab)!r}
        out = {{}}
        def server():
            out["server"] = type(load_app("fedhier.engines.flower_app:serverapp",
                                          ValueError, fab)).__name__
        def client():
            assert validate("fedhier.engines.flower_app:clientapp",
                            project_dir=fab) == (True, None)
            out["client"] = type(load_app("fedhier.engines.flower_app:clientapp", ValueError,
                                          fab)).__name__
        threads = [threading.Thread(target=server), threading.Thread(target=client)]
        for t in threads: t.start()
        for t in threads: t.join()
        import fedhier, fedhier.clients
        print(out["server"], out["client"], fedhier.__file__, fedhier.clients.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for _ in range(3):
        done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        server, client, init, clients = done.stdout.split()
        assert (server, client) == ("ServerApp", "ClientApp")
        assert init == str(fab / "fedhier" / "__init__.py")
        assert clients == str(fab / "clients" / "__init__.py")


@pytest.mark.slow
def test_wheel_holds_every_package_and_the_cards(wheel_venv):
    wheel, _ = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(Path(n).parent).replace("/", ".") for n in names
                if n.endswith("/__init__.py")}
    assert packages == _source_packages()
    cards = {Path(n).name for n in names if n.startswith("fedhier/datasets_cfg/")
             and n.endswith(".toml")}
    assert cards == {p.name for p in (ROOT / "datasets_cfg").glob("*.toml")}
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # nothing else at the top of site-packages: no `strategies`, no `clients`
    assert top == {"fedhier", "fedhier_strategies", "fedhier_clients"}
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fedhier = fedhier.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_installed_wheel_runs_a_job_from_another_folder(wheel_venv, tmp_path):
    _, venv = wheel_venv
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = ("import json, fedhier, fedhier.strategies, fedhier.clients.app\n"
             "from fedhier.strategies import HierFedAvg\n"
             "from fedhier.data import available_datasets, load_data\n"
             "print(json.dumps({'fedhier': fedhier.__file__, 'hier': HierFedAvg.__module__,\n"
             "  'strategies': fedhier.strategies.__file__, 'cards': available_datasets(),\n"
             "  'digits_rows': len(load_data('digits', seed=0).train)}))\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert Path(seen["fedhier"]).is_relative_to(venv)
    assert Path(seen["strategies"]).is_relative_to(venv)
    assert seen["hier"] == "fedhier.strategies.hierfedavg"
    cards = ROOT / "datasets_cfg"
    assert seen["cards"] == sorted(p.stem for p in cards.glob("*.toml"))
    assert seen["digits_rows"] == 1437
    out = elsewhere / "run"
    run = subprocess.run([str(venv / "bin" / "fedhier"), "run", "--clients", "4", "--groups",
                          "2", "--local-period", "2", "--global-period", "4", "--rounds", "2",
                          "--no-progress", "--out", str(out)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["iterations"] == 8
    assert json.loads((out / "config.json").read_text())["versions"]["fedhier"] == "0.1.0"


@pytest.mark.slow
def test_flwr_run_dot_with_fedhier_from_the_wheel(wheel_venv, tmp_path):
    """`flwr run .` from the repo, in a venv where fedhier is not an editable install."""
    _, venv = wheel_venv
    out = tmp_path / "flwr"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(FEDHIER_VENV=str(venv), FLWR_HOME=str(tmp_path / "flwr-home"))
    proc = subprocess.run([str(ROOT / "scripts" / "flwr_run_local.sh"), "4",
                           f"groups=2 local-period=2 global-period=4 rounds=2 out='{out}'"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["engine"] == "flower (flwr run)"
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "flwr-home")], capture_output=True)
    assert leftover.returncode != 0, "flwr run left a SuperLink running"

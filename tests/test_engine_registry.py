"""The engine registry is the one list of engine names: config, CLI, experiments and the
benchmark read it, and importing it loads neither torch nor Flower."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fedhier.cli.commands import build_parser
from fedhier.common.errors import ConfigError
from fedhier.engines import registry
from fedhier.settings import run_config as config

ROOT = Path(__file__).resolve().parents[1]


def test_config_accepts_exactly_the_registered_engines():
    assert tuple(config.ENGINES) == registry.engine_names()
    assert config.RunConfig().engine == registry.engine_names()[0]  # the default comes first


@pytest.mark.parametrize("name", registry.engine_names())
def test_every_run_function_takes_cfg_folder_progress_resume(name):
    run = registry.get_engine(name).load()
    parameters = inspect.signature(run).parameters
    assert list(parameters)[:2] == ["cfg", "folder"]
    assert {"progress", "resume"} <= parameters.keys()


def test_importing_the_registry_loads_neither_torch_nor_flower():
    code = ("import sys, fedhier.engines.registry as r; r.engine_help(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'flwr', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_unknown_engine_is_a_config_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown engine 'vectorised' \(did you mean "
                                          r"'vectorized'\?\); choose one of inprocess"):
        registry.get_engine("vectorised")


def test_run_engine_dispatches_on_cfg_engine(monkeypatch):
    calls = []

    def run_fake(cfg, folder, progress=True, resume=None):
        calls.append((cfg.engine, folder, progress, resume))
        return {"engine": cfg.engine}

    module = types.ModuleType("fake_engine_module")
    module.run_fake = run_fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_engine_module", module)
    fake = registry.Engine("fake", "fake_engine_module:run_fake", "a test double")
    monkeypatch.setattr(registry, "ENGINES", {**registry.ENGINES, "fake": fake})
    cfg = types.SimpleNamespace(engine="fake")
    assert registry.run_engine(cfg, "FOLDER", progress=False, resume="R") == {"engine": "fake"}
    assert calls == [("fake", "FOLDER", False, "R")]
    assert "fake (a test double)" in registry.engine_help()


def test_cli_experiments_and_benchmark_read_the_registry():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    run, experiment = sub.choices["run"], sub.choices["experiment"]  # type: ignore[index]
    engine_flag = next(a for a in run._actions if a.dest == "engine")
    assert all(f"{e.name} ({e.description})" in (engine_flag.help or "")
               for e in registry.ENGINES.values())
    choice = next(a for a in experiment._actions if a.dest == "experiment_engine")
    assert tuple(choice.choices or ()) == registry.engine_names()
    spec = importlib.util.spec_from_file_location("bench_engines",
                                                  ROOT / "benchmarks" / "engines.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    benchmarked = bench.ENGINES
    assert benchmarked == ("plain", *registry.engine_names())

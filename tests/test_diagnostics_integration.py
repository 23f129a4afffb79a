"""Diagnostics and groupings wired into runs: Flower path equals a direct computation."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedhier.cli.commands import main
from fedhier.data.federation import federation_for
from fedhier.diagnostics.in_rounds import client_diagnostics, direct_client_gradients
from fedhier.round.aggregators.averaging import client_weights
from fedhier.runs.prepare import initial_model
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import build_hierarchy
from tests.helpers import run_hier

BASE = RunConfig(dataset="digits", clients=12, groups=3, batch_size=8, lr=0.1, seed=1,
                 local_period=2, global_period=4, rounds=1, diagnostics_every=1)
KEYS = ("global_divergence", "upward_divergence", "downward_divergence", "grad_norm",
        "client_gradient_diversity")


def direct(cfg: RunConfig) -> dict:
    fed = federation_for(cfg)
    model = initial_model(cfg, fed)
    grads = direct_client_gradients(model, model.state_dict(), fed,
                                    cfg.diagnostics_max_samples, cfg.seed, torch.device("cpu"))
    weights = client_weights(cfg.weighting, fed.client_sizes())
    hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping,
                                ClientInfo(fed.label_histograms, fed.client_sizes()), cfg.seed,
                                client_grads=grads, weights=weights)
    return client_diagnostics(grads, weights, hierarchy)


@pytest.mark.parametrize("changes", [{}, {"weighting": "uniform"}, {"diagnostics_max_samples": 5}])
def test_recorded_diagnostics_equal_direct_computation(changes):
    cfg = BASE.replace(**changes)
    records: list = []
    run_hier(cfg, records)
    expected = direct(cfg)
    for key in KEYS:
        assert records[0][key] == pytest.approx(expected[key], rel=1e-6), key
    assert records[0]["downward_divergence_by_edge"] == pytest.approx(
        expected["downward_divergence_by_edge"], rel=1e-6)
    identity = records[0]["upward_divergence"] + records[0]["downward_divergence"]
    assert identity == pytest.approx(records[0]["global_divergence"], rel=1e-9)
    assert "upward_divergence" in records[1]  # every K = 1 rounds


def test_capped_diagnostics_differ_from_full():
    assert direct(BASE.replace(diagnostics_max_samples=5))["global_divergence"] != (
        pytest.approx(direct(BASE)["global_divergence"], rel=1e-3))


def test_gradient_grouping_lowers_measured_upward_divergence():
    cfg = BASE.replace(clients=24, groups=4, alpha=0.1, min_partition_size=2)
    random_up = direct(cfg)["upward_divergence"]
    records: list = []
    run_hier(cfg.replace(grouping="gradient"), records)
    assert records[0]["upward_divergence"] < 0.5 * random_up


def test_regrouping_changes_the_assignment():
    records: list = []
    run_hier(BASE.replace(rounds=3, regroup_every=1, diagnostics_every=0), records)
    regrouped = [r for r in records if r.get("regrouped")]
    assert [r["round"] for r in regrouped] == [2, 3]
    assert regrouped[0]["client_to_edge"] != regrouped[1]["client_to_edge"]


def test_min_random_max_ordering_at_the_initial_model(tmp_path, capsys):
    ups = {}
    for grouping in ("min-divergence", "random", "max-divergence"):
        out = tmp_path / f"{grouping}.json"
        assert main(["diversity", "--clients", "40", "--groups", "4", "--alpha", "0.1",
                     "--min-partition-size", "2", "--grouping", grouping,
                     "--json", str(out)]) == 0
        ups[grouping] = json.loads(out.read_text())["upward_divergence"]
    assert ups["min-divergence"] < ups["random"] < ups["max-divergence"]
    assert "batch-size bound" in capsys.readouterr().out


def test_groups_report(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--clients", "8", "--groups", "2", "--rounds", "1", "--grouping",
                 "min-divergence", "--no-progress", "--out", str(out)]) == 0
    groups = json.loads((out / "groups.json").read_text())
    assert groups["label_upward_divergence"] >= 0
    assert sum(e["num_examples"] for e in groups["edges"]) == 1437
    assert (out / "groups.png").stat().st_size > 5000


@pytest.mark.slow
def test_plugin_grouping_from_a_separate_package(tmp_path):
    pkg = tmp_path / "tinyplug"
    (pkg / "tinyplug").mkdir(parents=True)
    (pkg / "tinyplug" / "__init__.py").write_text(textwrap.dedent("""
        import numpy as np

        def odd_even(info, num_groups, seed):
            return np.arange(info.num_clients) % num_groups
    """))
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tinyplug"
        version = "0.1"
        [project.entry-points."fedhier.tree.grouping"]
        odd-even = "tinyplug:odd_even"
    """))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(pkg)], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    env = {"PYTHONPATH": str(target), "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run([sys.executable, "-m", "fedhier.cli", "run", "--clients", "6",
                           "--groups", "2", "--rounds", "1", "--grouping", "odd-even",
                           "--no-progress", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "groups.json").read_text())["client_to_edge"] == [0, 1] * 3

"""The papers at their own scale: LeNet-5 with its layer sizes, and ``--paper-scale``, the
published settings of each suite (docs/baselines.md, "Paper settings")."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from fedhier.cli.commands import build_parser, main
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.local.models import build_model
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.studies.experiments.cli import base_config
from tests.test_vectorized import TOL, assert_same_runs

FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_lenet5_has_lenet5s_layers():
    net = build_model("lenet5", (1, 28, 28), 10, seed=0)
    shapes = {k: list(v.shape) for k, v in net.state_dict().items()}
    assert shapes == {"conv1.weight": [6, 1, 5, 5], "conv1.bias": [6],
                      "conv2.weight": [16, 6, 5, 5], "conv2.bias": [16],
                      "fc1.weight": [120, 400], "fc1.bias": [120],
                      "fc2.weight": [84, 120], "fc2.bias": [84],
                      "out.weight": [10, 84], "out.bias": [10]}
    assert sum(v.numel() for v in net.parameters()) == 61_706
    assert net(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    big = build_model("lenet5", (3, 32, 32), 10)  # LeCun's own input: no padding, 400 features
    assert big.conv1.padding == (0, 0) and big.fc1.in_features == 16 * 5 * 5
    assert big(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="model 'lenet5' needs image input"):
        build_model("lenet5", (64,), 10)


def _base(*argv: str) -> RunConfig:
    args = build_parser().parse_args(["experiment", *argv])
    args.argv = list(argv)
    return base_config(args)


def test_paper_scale_is_the_published_setting_and_flags_override():
    cfg = _base("hierfavg", "--paper-scale")
    assert (cfg.dataset, cfg.model, cfg.clients, cfg.num_edges, cfg.partition,
            cfg.classes_per_client, cfg.global_period, cfg.batch_size, cfg.lr) == (
        "fashion-mnist", "lenet5", 50, 5, "shards", 1, 60, 20, 0.01)
    assert _base("hierfavg", "--paper-scale", "--lr", "0.05").lr == 0.05
    chen = _base("mobility-noniid", "--paper-scale", "--dataset", "digits", "--model", "mlp")
    assert chen.handoff == "carry" and chen.mobility().reaches(5)[0].tolist() == [
        False, True, False, False, False]
    assert _base("hierfavg").model == "mlp"  # the CPU-budget suite is unchanged


@pytest.mark.parametrize("argv", [["sandwich", "--paper-scale"],
                                  ["hierfavg", "--paper-scale", "--quick"]])
def test_paper_scale_elsewhere_is_one_line(tmp_path, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["experiment", *argv, "--out", str(tmp_path / "x")])
    assert code == 2 and len(err.getvalue().splitlines()) == 1
    assert "--paper-scale is for hierfavg, mobility-noniid, diversity" in err.getvalue()


@pytest.mark.skipif(not FASHION.is_dir(), reason="apt-get install dataset-fashion-mnist")
@pytest.mark.usefixtures("one_torch_thread")
def test_lenet5_on_fashion_mnist_is_the_same_on_both_engines(tmp_path):
    cfg = RunConfig(dataset="fashion-mnist", model="lenet5", clients=4, groups=(2,),
                    partition="shards", classes_per_client=1, local_period=2,
                    global_period=4, rounds=1, batch_size=20, lr=0.01, seed=1,
                    quantize_bits=8)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", TOL)

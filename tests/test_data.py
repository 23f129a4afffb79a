"""Tests of the data layer: loaders, the synthetic generator and client partitions."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import datasets
import numpy as np
import pytest

from fedhier.common.errors import ConfigError, DataError
from fedhier.data import (
    PARTITION_SCHEMES,
    DataBundle,
    available_datasets,
    clear_cache,
    label_histogram,
    load_data,
    make_synthetic,
    partition_clients,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST absent: apt-get install dataset-fashion-mnist",
)


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Keep `datasets`' Arrow cache of parquet/CSV loads out of the user's home."""
    monkeypatch.setattr(
        datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"), raising=True
    )


@pytest.fixture(scope="module")
def digits() -> DataBundle:
    return load_data("digits", seed=0)


@pytest.fixture(scope="module")
def synthetic() -> DataBundle:
    return load_data("synthetic", seed=0)


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text.strip() == text and text
    return text


# --------------------------------------------------------------------------- loaders


def test_available_datasets() -> None:
    assert available_datasets() == ["cifar10", "digits", "fashion-mnist", "femnist", "npz",
                                    "shakespeare", "synthetic", "synthetic-wide"]


def test_digits_sizes_range_and_schema(digits: DataBundle) -> None:
    assert (len(digits.train), len(digits.test)) == (1437, 360)
    x, y = digits.train_arrays()
    xt, yt = digits.test_arrays()
    assert x.shape == (1437, 1, 8, 8) and xt.shape == (360, 1, 8, 8)
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0 and xt.min() >= 0.0 and xt.max() <= 1.0
    assert set(np.unique(y)) == set(range(10))
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert not digits.natural_ids and digits.train.column_names == ["x", "label"]
    assert "load_digits" in digits.source
    # the arrays are exactly the Dataset's rows
    row = digits.train[5]
    assert np.allclose(np.asarray(row["x"]).reshape(1, 8, 8), x[5]) and row["label"] == y[5]
    assert digits.train_arrays()[0] is x  # cached


def test_digits_split_is_stratified(digits: DataBundle) -> None:
    y_all = np.concatenate([digits.train_arrays()[1], digits.test_arrays()[1]])
    total = label_histogram(y_all, 10)
    train = label_histogram(digits.train_arrays()[1], 10)
    assert np.all(np.abs(train - 0.8 * total) <= 1)


def test_digits_seed_fixes_split() -> None:
    clear_cache()
    a = load_data("digits", seed=3).train_arrays()
    clear_cache()
    b = load_data("digits", seed=3).train_arrays()
    c = load_data("digits", seed=4).train_arrays()
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_cached_bundle_and_pickle(digits: DataBundle) -> None:
    assert load_data("digits", seed=11) is load_data("digits", seed=11)  # in-process cache
    digits.train_arrays()
    clone = pickle.loads(pickle.dumps(digits))
    assert clone._cache == {}  # array cache is not shipped
    assert np.array_equal(clone.train_arrays()[0], digits.train_arrays()[0])
    assert clone.name == "digits" and clone.input_shape == (1, 8, 8)


@needs_fashion
def test_fashion_mnist_full() -> None:
    clear_cache()
    start = time.perf_counter()
    bundle = load_data("fashion-mnist", seed=0)
    x, y = bundle.train_arrays()
    elapsed = time.perf_counter() - start
    xt, yt = bundle.test_arrays()
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert np.array_equal(label_histogram(y, 10), np.full(10, 6000))
    assert np.array_equal(label_histogram(yt, 10), np.full(10, 1000))
    assert x.dtype == np.float32 and x.min() >= 0.0 and x.max() == 1.0
    assert elapsed < 15, f"loading Fashion-MNIST took {elapsed:.1f}s"
    # the official split: another seed gives the same data, from the in-process cache
    other = load_data("fashion-mnist", seed=1)
    assert other is bundle


def test_fashion_mnist_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_data("fashion-mnist", seed=0, data_path=str(tmp_path))
    text = one_line(exc)
    assert "apt-get install dataset-fashion-mnist" in text and "--data-path" in text
    assert str(tmp_path) in text


def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def _idx_folder(folder: Path, n_train: int = 30, n_test: int = 10) -> np.ndarray:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n_train, 4, 4))
    _write_idx(folder / "train-images-idx3-ubyte.gz", images, 0x803)
    _write_idx(folder / "train-labels-idx1-ubyte.gz", np.arange(n_train) % 3, 0x801)
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n_test, 4, 4)), 0x803)
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.arange(n_test) % 3, 0x801)
    return images


IDX_TOML = """
name = "tiny-idx"
source = "idx"
num_classes = 3
input_shape = [1, 4, 4]
path = "idx"
"""


def test_user_idx_toml_round_trip_and_bad_magic(tmp_path: Path) -> None:
    (tmp_path / "idx").mkdir()
    images = _idx_folder(tmp_path / "idx")
    toml = tmp_path / "tiny.toml"
    toml.write_text(IDX_TOML)
    bundle = load_data(str(toml), seed=0)  # relative `path` is resolved next to the TOML
    x, y = bundle.train_arrays()
    assert x.shape == (30, 1, 4, 4) and np.allclose(x[:, 0] * 255, images)
    assert np.array_equal(y, np.arange(30) % 3) and len(bundle.test) == 10
    # labels file given where images are expected -> wrong dimensionality
    bad = tmp_path / "bad"
    bad.mkdir()
    _idx_folder(bad)
    _write_idx(bad / "t10k-images-idx3-ubyte.gz", np.arange(10), 0x801)
    with pytest.raises(DataError) as exc:
        load_data(str(toml), seed=1, data_path=str(bad))
    assert "t10k-images-idx3-ubyte.gz" in one_line(exc) and "1-D" in str(exc.value)


def test_make_synthetic_is_pure_and_heterogeneous() -> None:
    a = make_synthetic(1.0, 1.0, 30, 60, 10, np.random.default_rng(7))
    b = make_synthetic(1.0, 1.0, 30, 60, 10, np.random.default_rng(7))
    c = make_synthetic(1.0, 1.0, 30, 60, 10, np.random.default_rng(8))
    for u, v in zip(a, b, strict=True):
        assert np.array_equal(u, v)
    assert not np.array_equal(a[0][:50], c[0][:50])
    x, y, user = a
    assert x.shape == (len(y), 60) and x.dtype == np.float32 and y.dtype == np.int64
    assert y.min() >= 0 and y.max() < 10
    sizes = np.bincount(user, minlength=30)
    assert sizes.min() >= 50 and sizes.max() <= 1000 and np.all(np.diff(user) >= 0)
    # users have different models: their label distributions differ a lot
    hists = np.stack([label_histogram(y[user == k], 10) / sizes[k] for k in range(30)])
    assert np.abs(hists - hists.mean(0)).sum(1).mean() > 0.5
    # Synthetic(0, 0) makes users far more alike than Synthetic(1, 1)
    _, y0, u0 = make_synthetic(0.0, 0.0, 30, 60, 10, np.random.default_rng(7))
    s0 = np.bincount(u0, minlength=30)
    h0 = np.stack([label_histogram(y0[u0 == k], 10) / s0[k] for k in range(30)])
    assert np.abs(h0 - h0.mean(0)).sum(1).mean() < np.abs(hists - hists.mean(0)).sum(1).mean()


def test_synthetic_bundle(synthetic: DataBundle) -> None:
    x, y = synthetic.train_arrays()
    xt, yt = synthetic.test_arrays()
    assert synthetic.natural_ids and synthetic.input_shape == (60,)
    assert x.shape[1:] == (60,) and y.min() >= 0 and y.max() < 10 and yt.max() < 10
    ids = np.asarray(synthetic.train["client_id"])
    assert sorted(set(ids.tolist())) == list(range(30))
    # per-user 80/20 split: every user keeps about 80% of its rows for training
    _, _, user = make_synthetic(1.0, 1.0, 30, 60, 10, np.random.default_rng(0))
    total = len(y) + len(yt)
    assert total > 30 * 50 and abs(len(yt) / total - 0.2) < 0.01
    assert not synthetic.test.column_names.count("client_id")
    clear_cache()
    again = load_data("synthetic", seed=0)
    assert np.array_equal(again.train_arrays()[0], x) and np.array_equal(again.test_arrays()[1], yt)
    assert not np.array_equal(load_data("synthetic", seed=1).train_arrays()[1][:200], y[:200])


def test_synthetic_is_learnable(synthetic: DataBundle) -> None:
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    x, y = synthetic.train_arrays()
    xt, yt = synthetic.test_arrays()
    # one BLAS thread: spinning threads make this 100x slower on a busy 2-core machine
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning: 40 iterations are enough here
        model = LogisticRegression(max_iter=40).fit(x, y)
    majority = label_histogram(yt, 10).max() / len(yt)
    # pooled logistic regression; FedProx reports ~0.83-0.88, predicting the majority ~0.2
    assert model.score(xt, yt) > max(0.75, majority + 0.4)


def test_unknown_dataset_and_data_path_misuse() -> None:
    with pytest.raises(ConfigError) as exc:
        load_data("mnist", seed=0)
    assert one_line(exc) == (
        "unknown dataset 'mnist'; choose one of cifar10, digits, fashion-mnist, femnist, npz, "
        "shakespeare, synthetic, synthetic-wide, or give a path to a dataset TOML"
    )
    with pytest.raises(ConfigError) as exc:
        load_data("missing/file.toml", seed=0)
    assert "missing/file.toml" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        load_data("digits", seed=0, data_path="/somewhere")
    assert "--data-path" in one_line(exc)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('source = "local"\nnum_classes = 3\ninput_shape = [2]', "missing required key 'name'"),
        (
            'name = "a"\nsource = "local"\nnum_classes = 3\ninput_shape = [2]\npath = "p"\n'
            'feature_columns = ["f"]\nlabel_column = "y"\ncolour = 1',
            "unknown key 'colour'",
        ),
        (
            'name = "a"\nsource = "sklearn-digits"\nnum_classes = "ten"\ninput_shape = [1, 8, 8]',
            "key 'num_classes' must be an integer, got str 'ten'",
        ),
        (
            'name = "a"\nsource = "ftp"\nnum_classes = 3\ninput_shape = [2]',
            "source 'ftp' is not supported",
        ),
        (
            'name = "a"\nsource = "hub"\nnum_classes = 3\ninput_shape = [2]\nlabel_column = "y"\n'
            'feature_columns = "f"',
            "missing required key 'hub_name'",
        ),
        ('name = "a"\nsource = [', "invalid TOML"),
        (
            'name = "a"\nsource = "synthetic"\nnum_classes = 10\ninput_shape = [60]\n'
            "test_fraction = 1.5",
            "test_fraction must be in (0, 1)",
        ),
    ],
)
def test_toml_validation(tmp_path: Path, body: str, expected: str) -> None:
    toml = tmp_path / "user.toml"
    toml.write_text(body)
    with pytest.raises(ConfigError) as exc:
        load_data(str(toml), seed=0)
    assert expected in one_line(exc) and str(toml) in str(exc.value)


# --------------------------------------------------------------------------- hub / local

TABLE_TOML = """
name = "{name}"
source = "local"
path = "{path}"
num_classes = 3
input_shape = [6]
feature_columns = "feat"
label_column = "y"
client_id_column = "writer"
"""


def _table(n: int = 120) -> datasets.Dataset:
    rng = np.random.default_rng(1)
    return datasets.Dataset.from_dict(
        {
            "feat": rng.random((n, 6)).round(3).tolist(),
            "y": (np.arange(n) % 3).tolist(),
            "writer": [f"w{i % 8}" for i in range(n)],
            "extra": rng.random(n).tolist(),
        }
    )


def test_local_parquet_folder_round_trip(tmp_path: Path) -> None:
    table = _table()
    (tmp_path / "pq" / "data").mkdir(parents=True)
    table.select(range(90)).to_parquet(str(tmp_path / "pq" / "data" / "train-0000.parquet"))
    table.select(range(90, 120)).to_parquet(str(tmp_path / "pq" / "data" / "test-0000.parquet"))
    toml = tmp_path / "pq.toml"
    toml.write_text(TABLE_TOML.format(name="pq", path="pq"))
    bundle = load_data(str(toml), seed=0)
    x, y = bundle.train_arrays()
    assert x.shape == (90, 6) and len(bundle.test) == 30
    assert np.allclose(x, np.asarray(table["feat"][:90], dtype=np.float32))
    assert np.array_equal(y, np.arange(90) % 3)
    assert bundle.natural_ids and bundle.train["client_id"][:3] == ["w0", "w1", "w2"]
    parts = partition_clients(bundle, "natural", 0, seed=0)
    assert len(parts) == 8 and sum(len(p) for p in parts) == 90
    ids = np.asarray(bundle.train["client_id"])
    assert [ids[p[0]] for p in parts] == [f"w{i}" for i in range(8)]  # sorted natural ids


def test_local_save_to_disk_and_single_parquet(tmp_path: Path) -> None:
    table = _table()
    datasets.DatasetDict(
        {"train": table.select(range(100)), "test": table.select(range(100, 120))}
    ).save_to_disk(str(tmp_path / "disk"))
    toml = tmp_path / "disk.toml"
    toml.write_text(TABLE_TOML.format(name="disk", path=str(tmp_path / "disk")))
    bundle = load_data(str(toml), seed=0)
    assert (len(bundle.train), len(bundle.test)) == (100, 20)
    assert np.allclose(bundle.test_arrays()[0], np.asarray(table["feat"][100:], dtype=np.float32))
    # a single parquet file has no test split: test_fraction (default 0.2) of it, stratified
    table.to_parquet(str(tmp_path / "all.parquet"))
    toml.write_text(TABLE_TOML.format(name="one", path="unused"))
    single = load_data(str(toml), seed=0, data_path=str(tmp_path / "all.parquet"))
    assert (len(single.train), len(single.test)) == (96, 24)
    assert np.array_equal(label_histogram(single.test_arrays()[1], 3), [8, 8, 8])
    other = load_data(str(toml), seed=1, data_path=str(tmp_path / "all.parquet"))
    assert not np.array_equal(other.test_arrays()[0], single.test_arrays()[0])


def test_local_csv_with_scalar_feature_columns(tmp_path: Path) -> None:
    _table().to_csv(str(tmp_path / "t.csv"))
    toml = tmp_path / "csv.toml"
    toml.write_text(
        'name = "csv"\nsource = "local"\npath = "t.csv"\nnum_classes = 3\ninput_shape = [2]\n'
        'feature_columns = ["extra", "y"]\nlabel_column = "y"\nscale = 2\ntest_fraction = 0.25\n'
    )
    bundle = load_data(str(toml), seed=0)
    x, y = bundle.train_arrays()
    assert x.shape == (90, 2) and np.allclose(x[:, 1], y / 2) and not bundle.natural_ids


def test_local_image_column_channels_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (12, 4, 5, 3), dtype=np.uint8)  # H x W x C
    from PIL import Image

    ds = datasets.Dataset.from_dict(
        {"img": [Image.fromarray(p) for p in pixels], "label": ["cat", "dog", "emu"] * 4},
        features=datasets.Features({"img": datasets.Image(), "label": datasets.Value("string")}),
    )
    ds.save_to_disk(str(tmp_path / "imgs"))
    toml = tmp_path / "img.toml"
    toml.write_text(
        'name = "img"\nsource = "local"\npath = "imgs"\nnum_classes = 3\n'
        'input_shape = [3, 4, 5]\nfeature_columns = "img"\nlabel_column = "label"\n'
        "scale = 255.0\ntest_fraction = 0.25\n"
    )
    bundle = load_data(str(toml), seed=0)
    x, y = bundle.train_arrays()
    xt, yt = bundle.test_arrays()
    x_all = np.concatenate([x, xt])
    assert x.shape[1:] == (3, 4, 5) and len(x_all) == 12
    expected = pixels.transpose(0, 3, 1, 2) / 255.0
    for xi in x_all:  # every example is one of the images, channels first
        assert np.min(np.abs(expected - xi).reshape(12, -1).max(1)) < 1e-6
    assert set(np.concatenate([y, yt]).tolist()) == {0, 1, 2}  # strings -> sorted class ids
    assert bundle.label_names == ("cat", "dog", "emu")


def test_string_labels_run_and_the_run_folder_keeps_their_mapping(tmp_path: Path) -> None:
    """A CSV whose labels are strings trains, and labels.json says which class number each
    string became (sorted), matching the per-client label counts of partition.json."""
    import json

    from fedhier.cli.commands import main

    rng = np.random.default_rng(0)
    names = np.array(["virginica", "setosa", "versicolor"])
    which = rng.integers(0, 3, 120)
    table = datasets.Dataset.from_dict({"a": rng.normal(size=120) + which,
                                        "b": rng.normal(size=120), "species": names[which]})
    table.to_csv(str(tmp_path / "flowers.csv"))
    toml = tmp_path / "flowers.toml"
    toml.write_text('name = "flowers"\nsource = "local"\npath = "flowers.csv"\n'
                    'num_classes = 3\ninput_shape = [2]\nfeature_columns = ["a", "b"]\n'
                    'label_column = "species"\ntest_fraction = 0.25\n')
    out = tmp_path / "run"
    assert main(["run", "--dataset", str(toml), "--clients", "4", "--groups", "2",
                 "--local-period", "1", "--global-period", "2", "--rounds", "1",
                 "--engine", "vectorized", "--model", "logreg", "--out", str(out),
                 "--no-progress"]) == 0
    classes = json.loads((out / "labels.json").read_text())["classes"]
    assert classes == ["setosa", "versicolor", "virginica"]
    partition = json.loads((out / "partition.json").read_text())
    rows = [r for c in partition["clients"] for r in c["rows"]]
    bundle = load_data(str(toml), seed=0)
    _, y = bundle.train_arrays()
    counts = np.sum([c["label_counts"] for c in partition["clients"]], axis=0)
    assert counts.tolist() == np.bincount(y[rows], minlength=3).tolist()
    x, _ = bundle.train_arrays()  # feature b is unique: it finds each row's own string
    species = {np.float32(v): name for v, name in zip(table["b"], table["species"], strict=True)}
    assert [classes[label] for label in y] == [species[v] for v in x[:, 1]]
    integer = tmp_path / "int"
    assert main(["run", "--rounds", "1", "--local-period", "1", "--global-period", "2",
                 "--engine", "vectorized", "--out", str(integer), "--no-progress"]) == 0
    assert not (integer / "labels.json").exists()  # class numbers need no mapping


def test_missing_label_column_lists_columns(tmp_path: Path) -> None:
    _table().to_parquet(str(tmp_path / "t.parquet"))
    toml = tmp_path / "bad.toml"
    toml.write_text(TABLE_TOML.format(name="bad", path="t.parquet").replace('"y"', '"target"'))
    with pytest.raises(DataError) as exc:
        load_data(str(toml), seed=0)
    text = one_line(exc)
    assert "'target'" in text and "feat, y, writer, extra" in text and "label_column" in text


def test_wrong_input_shape_and_label_range(tmp_path: Path) -> None:
    _table().to_parquet(str(tmp_path / "t.parquet"))
    toml = tmp_path / "bad.toml"
    toml.write_text(TABLE_TOML.format(name="bad", path="t.parquet").replace("[6]", "[7]"))
    with pytest.raises(DataError) as exc:
        load_data(str(toml), seed=0)
    assert "input_shape" in one_line(exc)
    toml.write_text(TABLE_TOML.format(name="bad", path="t.parquet").replace("= 3", "= 2"))
    with pytest.raises(DataError) as exc:
        load_data(str(toml), seed=0)
    assert "num_classes" in one_line(exc)


def test_hub_name_offline_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    toml = tmp_path / "hub.toml"
    toml.write_text(
        'name = "fm"\nsource = "hub"\nhub_name = "zalando-datasets/fashion_mnist"\n'
        'num_classes = 10\ninput_shape = [1, 28, 28]\nfeature_columns = "image"\n'
        'label_column = "label"\nscale = 255\n'
    )
    with pytest.raises(DataError) as exc:
        load_data(str(toml), seed=0)
    text = one_line(exc)
    assert "zalando-datasets/fashion_mnist" in text and "save_to_disk" in text
    assert isinstance(exc.value.__cause__, Exception)  # original error kept as the cause


# --------------------------------------------------------------------------- partitions


def _check_disjoint(parts: list[np.ndarray], n_rows: int) -> np.ndarray:
    for p in parts:
        assert p.dtype == np.int64 and len(p) >= 1 and np.all(np.diff(p) > 0)
        assert p.min() >= 0 and p.max() < n_rows
    allrows = np.concatenate(parts)
    assert len(np.unique(allrows)) == len(allrows)
    return allrows


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "sorted", "shards"])
def test_partitions_disjoint_cover_deterministic(digits: DataBundle, scheme: str) -> None:
    parts = partition_clients(digits, scheme, 20, seed=1)
    assert len(parts) == 20
    allrows = _check_disjoint(parts, 1437)
    # with 20 clients >= 10 classes, shards ("first-deterministic") also uses every class
    assert len(allrows) == 1437
    again = partition_clients(digits, scheme, 20, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if scheme != "sorted":  # sorted is seed-free by design
        other = partition_clients(digits, scheme, 20, seed=2)
        assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_partition_result_is_not_shared(digits: DataBundle) -> None:
    parts = partition_clients(digits, "iid", 5, seed=0)
    parts[0][:] = 0
    assert partition_clients(digits, "iid", 5, seed=0)[0][1] != 0


def test_partition_same_in_a_fresh_process(digits: DataBundle) -> None:
    code = (
        "import hashlib, numpy as np\n"
        "from fedhier.data import load_data, partition_clients\n"
        "b = load_data('digits', seed=0)\n"
        "h = hashlib.sha256()\n"
        "for s in ('dirichlet', 'iid', 'shards'):\n"
        "    for p in partition_clients(b, s, 7, seed=5, alpha=0.3): h.update(p.tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    h = hashlib.sha256()
    for scheme in ("dirichlet", "iid", "shards"):
        for p in partition_clients(digits, scheme, 7, seed=5, alpha=0.3):
            h.update(p.tobytes())
    assert out.stdout.strip() == h.hexdigest()


def test_iid_sizes_balanced(digits: DataBundle) -> None:
    parts = partition_clients(digits, "iid", 10, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    y = digits.train_labels()
    assert not np.array_equal(parts[0], np.arange(len(parts[0])))  # shuffled, not contiguous
    for p in parts:
        assert len(np.unique(y[p])) >= 8


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_k_classes_per_client(digits: DataBundle, k: int) -> None:
    y = digits.train_labels()
    parts = partition_clients(digits, "shards", 10, seed=0, classes_per_client=k)
    for p in parts:
        assert len(np.unique(y[p])) == k
    if k == 1:  # "#C=1" with 10 clients: client i holds exactly class i
        assert [int(y[p][0]) for p in parts] == list(range(10))


def test_sorted_blocks(digits: DataBundle) -> None:
    y = digits.train_labels()
    parts = partition_clients(digits, "sorted", 7, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    # blocks of non-decreasing labels: client i's labels all <= client i+1's labels
    for a, b in zip(parts, parts[1:], strict=False):
        assert y[a].max() <= y[b].min()
    assert len(np.unique(y[parts[0]])) <= 2  # ~205 rows span at most 2 classes of ~144
    # ties keep the original order: the rows of a class shared by two blocks are split in order
    shared = int(y[parts[0]].max())
    assert parts[0][y[parts[0]] == shared].max() < parts[1][y[parts[1]] == shared].min()


def _mean_entropy(bundle: DataBundle, parts: list[np.ndarray]) -> float:
    y = bundle.train_labels()
    ent = []
    for p in parts:
        q = label_histogram(y[p], bundle.num_classes) / len(p)
        q = q[q > 0]
        ent.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(ent))


def test_dirichlet_alpha_controls_skew(digits: DataBundle) -> None:
    skewed = _mean_entropy(digits, partition_clients(digits, "dirichlet", 10, seed=0, alpha=0.1))
    flat = _mean_entropy(digits, partition_clients(digits, "dirichlet", 10, seed=0, alpha=100))
    assert skewed < 0.7 * flat and flat > 0.95 * np.log(10)


def test_dirichlet_min_size_and_impossible(digits: DataBundle) -> None:
    loose = partition_clients(digits, "dirichlet", 20, seed=0, alpha=0.5, min_partition_size=1)
    assert min(len(p) for p in loose) < 30  # the first draw has a client under 30 rows ...
    parts = partition_clients(digits, "dirichlet", 20, seed=0, alpha=0.5, min_partition_size=30)
    assert min(len(p) for p in parts) >= 30  # ... so the partitioner resampled
    balanced = partition_clients(digits, "dirichlet", 20, seed=0, alpha=0.3, self_balancing=True)
    _check_disjoint(balanced, 1437)
    with pytest.raises(DataError) as exc:
        partition_clients(digits, "dirichlet", 50, seed=0, alpha=0.01, min_partition_size=10)
    assert one_line(exc) == (
        "Dirichlet partition failed: could not give every one of 50 clients at least 10 rows "
        "with alpha=0.01 (1437 training rows); raise --alpha, lower --min-partition-size, use "
        "fewer clients or use --partition iid"
    )
    with pytest.raises(DataError):  # more rows asked for than exist: fails without sampling
        partition_clients(digits, "dirichlet", 100, seed=0, min_partition_size=15)


def test_natural_partition(synthetic: DataBundle, digits: DataBundle) -> None:
    parts = partition_clients(synthetic, "natural", 0, seed=0)
    assert len(parts) == 30
    allrows = _check_disjoint(parts, len(synthetic.train))
    assert len(allrows) == len(synthetic.train)
    ids = np.asarray(synthetic.train["client_id"])
    assert [set(ids[p].tolist()) for p in parts] == [{k} for k in range(30)]
    assert all(
        np.array_equal(a, b)
        for a, b in zip(parts, partition_clients(synthetic, "natural", 30, seed=9), strict=True)
    )
    with pytest.raises(ConfigError) as exc:
        partition_clients(synthetic, "natural", 10, seed=0)
    assert "30 natural client ids" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        partition_clients(digits, "natural", 10, seed=0)
    assert "natural client ids" in one_line(exc)
    # other schemes also work on a natural-id dataset
    _check_disjoint(partition_clients(synthetic, "dirichlet", 12, seed=0), len(synthetic.train))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"scheme": "zipf"}, "dirichlet, iid, shards, natural, sorted"),
        ({"num_clients": 0}, "between 1 and the 1437"),
        ({"num_clients": 5000}, "between 1 and the 1437"),
        ({"alpha": 0.0}, "alpha must be a number > 0"),
        ({"alpha": -1.0}, "alpha must be a number > 0"),
        ({"scheme": "shards", "classes_per_client": 0}, "between 1 and 10"),
        ({"scheme": "shards", "classes_per_client": 11}, "between 1 and 10"),
    ],
)
def test_partition_validation(digits: DataBundle, kwargs: dict, expected: str) -> None:
    args = {"scheme": "dirichlet", "num_clients": 10, **kwargs}
    with pytest.raises(ConfigError) as exc:
        partition_clients(digits, args.pop("scheme"), args.pop("num_clients"), seed=0, **args)
    assert expected in one_line(exc)


def test_partition_schemes_constant() -> None:
    assert PARTITION_SCHEMES == ("dirichlet", "iid", "shards", "natural", "sorted")


def test_label_histogram() -> None:
    hist = label_histogram(np.array([0, 2, 2, 1, 2]), 4)
    assert hist.dtype == np.int64 and hist.tolist() == [1, 1, 3, 0]
    with pytest.raises(DataError):
        label_histogram(np.array([0, 4]), 4)


@needs_fashion
def test_fashion_dirichlet_50_clients_fast() -> None:
    bundle = load_data("fashion-mnist", seed=0)
    start = time.perf_counter()
    parts = partition_clients(bundle, "dirichlet", 50, seed=0, alpha=0.5)
    elapsed = time.perf_counter() - start
    assert len(np.concatenate(parts)) == 60000 and min(len(p) for p in parts) >= 10
    assert elapsed < 10, f"partitioning took {elapsed:.1f}s"

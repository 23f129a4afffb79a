"""Tables read through Hugging Face ``datasets``: a hub dataset, or local files (a
``save_to_disk`` folder, parquet or CSV) with the same column keys. A local file that cannot be
read is a :class:`~fedhier.common.errors.DamagedFileError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import datasets
import numpy as np

from fedhier.common.errors import ConfigError, DamagedFileError, DataError, FedhierError
from fedhier.data.bundle import DataBundle
from fedhier.data.partition import quiet_progress
from fedhier.data.rows import _bundle, _check_labels, _check_width, _one_line, _split_indices
from fedhier.data.specs import DatasetSpec

# --------------------------------------------------------------------------- hub / local

T = TypeVar("T")


def _call_datasets(fn: Callable[[], T], what: str, fix: str, path: Path | None = None) -> T:
    """Run a `datasets` call; turn any failure into a one-line `DataError` (a
    `DamagedFileError` naming ``path`` when it reads local files)."""
    try:
        with quiet_progress():
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


def _encode_labels(spec: DatasetSpec, parts: list[np.ndarray], where: str,
                   ) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """Integer labels as int64; anything else (strings) mapped to 0..K-1 in sorted order.
    Also the mapping: class i's label (() for integer labels)."""
    col = spec.options["label_column"]
    numeric = all(p.dtype.kind in "iubf" for p in parts)
    classes: list[str] = []
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
    return out, tuple(classes)


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
    labels, label_names = _encode_labels(spec, raw, where)
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
    return _bundle(spec, seed, source, (x, y, cid), (x_test, y_test), label_names=label_names)


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

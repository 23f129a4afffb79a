"""A numpy ``.npz`` of your own: features (``x``/``image``/...), labels (``y``/``label``/...),
an optional ``client_id`` array and optional ``*_test`` arrays (docs/data.md). A damaged, empty
or 0-row file is a :class:`~fedhier.common.errors.DamagedFileError` naming the file and the array.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from fedhier.common.errors import ConfigError, DamagedFileError, DataError, os_reason
from fedhier.data.bundle import DataBundle
from fedhier.data.rows import _bundle, _check_labels, _split_indices
from fedhier.data.specs import NPZ_CLIENT_ID, NPZ_FEATURES, NPZ_LABELS, DatasetSpec

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

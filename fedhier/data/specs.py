"""Dataset cards: the TOML schema of a dataset (shipped ``datasets_cfg/<name>.toml`` or
a user's TOML), its validation (:func:`parse_spec`) and lookup (:func:`resolve_spec`). See
docs/data.md.
"""

from __future__ import annotations

import importlib.resources
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError, DamagedFileError, os_reason

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
        from fedhier.settings.run_config import check_card_defaults

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


def check_name(dataset: str | os.PathLike[str]) -> None:
    """Refuse an unknown dataset name (:func:`resolve_spec`'s one line) without reading any
    card: what the command line checks with the flags, before loading any library."""
    name = os.fspath(dataset)
    if name not in _shipped() and not name.endswith(".toml"):
        resolve_spec(name)


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

"""Arrays into a :class:`~fedhier.data.bundle.DataBundle`, for every loader: the width and
label checks (a bad label names the row and the rule), the seeded stratified train/test split,
and an exception's text on one line.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sklearn.model_selection import train_test_split

from fedhier.common.errors import DataError
from fedhier.data.bundle import DataBundle, bundle_from_arrays
from fedhier.data.specs import DatasetSpec


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
    label_names: tuple[str, ...] = (),
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
        label_names=label_names,
    )


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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

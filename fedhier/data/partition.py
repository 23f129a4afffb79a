"""Split a bundle's training rows among clients (non-IID schemes of the FL literature).

`partition_clients` returns, per client (client id = list position), a sorted int64
array of row indices into ``bundle.train``. Rows are disjoint, every client gets at
least one row, and the result is a pure function of the arguments. The schemes use
flwr-datasets partitioners on a light copy of the train split (label, row index,
natural id) and read the rows back through ``load_partition``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import numbers
import warnings
from collections.abc import Iterator

import datasets
import numpy as np
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    NaturalIdPartitioner,
    PathologicalPartitioner,
)
from flwr_datasets.partitioner.partitioner import Partitioner

from fedhier.common.errors import ConfigError, DataError
from fedhier.data.bundle import DataBundle
from fedhier.settings.declaration import names_of

#: the partition schemes, as the setting ``partition`` declares them
PARTITION_SCHEMES = names_of("partition")
_ROW = "__row__"


#: The auto minimum never exceeds this (the fixed default of earlier fedhier versions).
AUTO_MIN_PARTITION_CAP = 10


def auto_min_partition_size(train_rows: int, num_clients: int, alpha: float) -> int:
    """The Dirichlet minimum rows per client used when none is given (0 = auto).

    ``min(10, max(1, floor(alpha * train_rows / (2 * num_clients))))``: half the mean rows
    per client, scaled by alpha (a smaller alpha gives more clients a small share of every
    class), at most 10 and at least 1. Digits (1437 training rows): 100 clients at alpha 0.5
    -> 3, 40 clients at alpha 0.1 -> 1, 20 clients at alpha 0.5 -> 10.
    """
    if num_clients < 1:
        return 1
    share = math.floor(alpha * train_rows / (2 * num_clients))
    return min(AUTO_MIN_PARTITION_CAP, max(1, share))


def label_histogram(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Count of each class in ``labels``: int64 [num_classes]."""
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"labels range from {labels.min()} to {labels.max()}, outside 0..{num_classes - 1}"
        )
    return np.bincount(labels.astype(np.int64), minlength=num_classes).astype(np.int64)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """The datasets library's progress bars off inside the block (restored after)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _quiet(hide_stderr: bool = False) -> Iterator[None]:
    # flwr-datasets warns on every Dirichlet resample and shows a tqdm bar for natural ids
    # (hide_stderr); fedhier reports problems itself, as one line.
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        if hide_stderr:
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        warnings.simplefilter("ignore")
        stack.enter_context(quiet_progress())
        yield


def _light_train(bundle: DataBundle, order: np.ndarray | None = None) -> datasets.Dataset:
    """``label`` (+ ``client_id``) of the train split plus ``__row__``, optionally reordered."""
    cols = ["label", "client_id"] if bundle.natural_ids else ["label"]
    table = bundle.train.with_format("arrow", columns=cols)[:]
    rows = np.arange(table.num_rows, dtype=np.int64)
    if order is not None:
        table = table.take(order)
        rows = rows[order]
    mapping = {
        c: table.column(c).to_pylist() if c == "client_id" else table.column(c).to_numpy()
        for c in cols
    }
    mapping[_ROW] = rows
    return datasets.Dataset.from_dict(mapping)


def _read_rows(partitioner: Partitioner, num_partitions: int) -> list[np.ndarray]:
    parts = []
    for i in range(num_partitions):
        table = partitioner.load_partition(i).with_format("arrow", columns=[_ROW])[:]
        parts.append(np.sort(table.column(_ROW).to_numpy().astype(np.int64)))
    return parts


def partition_clients(
    bundle: DataBundle,
    scheme: str,
    num_clients: int,
    *,
    seed: int,
    alpha: float = 0.5,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    classes_per_client: int = 2,
) -> list[np.ndarray]:
    """Partition ``bundle.train`` rows among ``num_clients`` clients.

    Schemes:
      - ``dirichlet``: per class, client shares ~ Dir(alpha) (flwr-datasets
        DirichletPartitioner; resampled until every client has ``min_partition_size``
        rows; 0 = :func:`auto_min_partition_size`; ``self_balancing`` stops filling
        clients above the mean size).
      - ``iid``: seeded shuffle, then equal contiguous blocks (sizes differ by <= 1).
      - ``shards``: "#C=k", each client holds ``classes_per_client`` classes, the first
        one ``client % num_classes``, the rest random (PathologicalPartitioner,
        first-deterministic as in NIID-Bench); a class is split evenly among its clients.
        With fewer clients than classes some classes are left out.
      - ``natural``: one client per natural id (``client_id`` column), in sorted id
        order; ``num_clients`` must be 0 (all) or the number of ids.
      - ``sorted``: rows sorted by label (stable) cut into equal contiguous blocks.

    Returns one sorted int64 array of row indices per client (fresh copies of a result
    memoized on the bundle, so repeated calls are cheap).
    """
    run = functools.partial(
        _partition,
        bundle,
        scheme,
        num_clients,
        seed,
        alpha,
        min_partition_size,
        self_balancing,
        classes_per_client,
    )
    key = ("partition", *run.args[1:])
    try:
        hash(key)
    except TypeError:  # unhashable argument: let validation report it
        return run()
    return [p.copy() for p in bundle._memo(key, run)]


def _partition(
    bundle: DataBundle,
    scheme: str,
    num_clients: int,
    seed: int,
    alpha: float,
    min_partition_size: int,
    self_balancing: bool,
    classes_per_client: int,
) -> list[np.ndarray]:
    if scheme not in PARTITION_SCHEMES:
        raise ConfigError(
            f"unknown partition scheme '{scheme}'; choose one of {', '.join(PARTITION_SCHEMES)}"
        )
    n_rows = len(bundle.train)
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer):
        raise ConfigError(f"number of clients must be an integer, got {num_clients!r}")
    num_clients = int(num_clients)
    if scheme == "natural":
        parts = _natural(bundle, num_clients)
    else:
        if not 1 <= num_clients <= n_rows:
            raise ConfigError(
                f"number of clients must be between 1 and the {n_rows} training rows of "
                f"'{bundle.name}', got {num_clients}"
            )
        if scheme == "dirichlet":
            parts = _dirichlet(bundle, num_clients, seed, alpha, min_partition_size, self_balancing)
        elif scheme == "iid":
            order = np.random.default_rng(seed).permutation(n_rows)
            partitioner = IidPartitioner(num_partitions=num_clients)
            partitioner.dataset = _light_train(bundle, order)
            parts = _read_rows(partitioner, num_clients)
        elif scheme == "shards":
            parts = _shards(bundle, num_clients, seed, classes_per_client)
        else:  # sorted
            order = np.argsort(bundle.train_labels(), kind="stable")
            parts = [
                np.sort(block).astype(np.int64) for block in np.array_split(order, num_clients)
            ]

    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise DataError(
            f"{scheme} partition left {len(empty)} of {len(parts)} clients without rows "
            f"(first: client {empty[0]}); use fewer clients"
        )
    return parts


def _dirichlet(
    bundle: DataBundle,
    num_clients: int,
    seed: int,
    alpha: float,
    min_partition_size: int,
    self_balancing: bool,
) -> list[np.ndarray]:
    if isinstance(alpha, bool) or not (
        isinstance(alpha, numbers.Real) and alpha > 0 and np.isfinite(alpha)
    ):
        raise ConfigError(f"Dirichlet alpha must be a number > 0, got {alpha!r}")
    if isinstance(min_partition_size, bool) or not isinstance(min_partition_size, int):
        raise ConfigError(f"min partition size must be an integer, got {min_partition_size!r}")
    if min_partition_size < 0:
        raise ConfigError(f"min partition size must be >= 0, got {min_partition_size}")
    min_size = min_partition_size or auto_min_partition_size(len(bundle.train), num_clients, alpha)
    rows = len(bundle.train)
    if num_clients * min_size > rows:  # no alpha helps: say what can
        fewer = f"use at most {rows // min_size} clients"
        raise DataError(
            f"Dirichlet partition impossible: {num_clients} clients x at least {min_size} rows "
            f"each is more than the {rows} training rows; {fewer}"
            + (", or lower --min-partition-size" if min_size > 1 else ""))
    # what can help: a larger alpha (more even shares), a smaller minimum (only when it is
    # above one row), fewer clients, or a partition that does not draw by label
    hints = ["raise --alpha"] + (["lower --min-partition-size"] if min_size > 1 else []) + [
        "use fewer clients", "use --partition iid"]
    failure = DataError(
        f"Dirichlet partition failed: could not give every one of {num_clients} clients at "
        f"least {min_size} row{'s' if min_size > 1 else ''} with alpha={alpha:g} ({rows} "
        f"training rows); {', '.join(hints[:-1])} or {hints[-1]}"
    )
    partitioner = DirichletPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        alpha=float(alpha),
        min_partition_size=min_size,
        self_balancing=bool(self_balancing),
        shuffle=True,
        seed=seed,
    )
    partitioner.dataset = _light_train(bundle)
    try:
        with _quiet():
            return _read_rows(partitioner, num_clients)
    except (ValueError, ZeroDivisionError) as exc:
        raise failure from exc


def _shards(
    bundle: DataBundle, num_clients: int, seed: int, classes_per_client: int
) -> list[np.ndarray]:
    present = len(np.unique(bundle.train_labels()))
    if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, int):
        raise ConfigError(f"classes per client must be an integer, got {classes_per_client!r}")
    if not 1 <= classes_per_client <= bundle.num_classes:
        raise ConfigError(
            f"classes per client must be between 1 and {bundle.num_classes} (the classes of "
            f"'{bundle.name}'), got {classes_per_client}"
        )
    if classes_per_client > present:
        raise DataError(
            f"shards partition needs {classes_per_client} classes per client but the training "
            f"split of '{bundle.name}' holds only {present}; lower --classes-per-client"
        )
    partitioner = PathologicalPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        num_classes_per_partition=classes_per_client,
        class_assignment_mode="first-deterministic",
        shuffle=True,
        seed=seed,
    )
    partitioner.dataset = _light_train(bundle)
    try:
        with _quiet():
            return _read_rows(partitioner, num_clients)
    except ValueError as exc:
        raise DataError(
            f"shards partition failed: some class has fewer rows than the {num_clients} "
            f"clients x {classes_per_client} classes need ({exc}); use fewer clients or "
            "fewer classes per client"
        ) from exc


def _natural(bundle: DataBundle, num_clients: int) -> list[np.ndarray]:
    if not bundle.natural_ids:
        others = ", ".join(s for s in PARTITION_SCHEMES if s != "natural")
        raise ConfigError(
            f"partition 'natural' needs a dataset with natural client ids and '{bundle.name}' "
            f"has none; choose one of {others}"
        )
    partitioner = NaturalIdPartitioner(partition_by="client_id")
    partitioner.dataset = _light_train(bundle)
    with _quiet(hide_stderr=True):
        num_ids = partitioner.num_partitions
    if num_clients not in (0, num_ids):
        raise ConfigError(
            f"'{bundle.name}' has {num_ids} natural client ids, so the natural partition "
            f"needs {num_ids} clients (or 0 for all); got {num_clients}"
        )
    with _quiet(hide_stderr=True):
        return _read_rows(partitioner, num_ids)

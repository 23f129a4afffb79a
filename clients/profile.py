"""The profile query a user's ClientApp answers: partition id, rows, label histogram.

:func:`register_profile` adds the handler to a ClientApp from the user's own data loader;
the label-based groupings need it (docs/contract.md). Part of :mod:`fedhier.clients.adapter`,
which re-exports the public names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from fedhier.clients.batches import partition_id_of


def labels_of(data: Any, label_key: str = "label") -> np.ndarray:
    """The integer labels of a client's training data, int64 [m].

    Accepts a DataLoader (its dataset), a Hugging Face dataset (column ``label_key``), a
    ``TensorDataset`` (its last tensor), a tuple ``(x, y)`` of tensors/arrays (``y``), or
    the labels themselves.
    """
    if isinstance(data, DataLoader):
        data = data.dataset
    if hasattr(data, "column_names") and hasattr(data, "with_format"):  # datasets.Dataset
        table = data.with_format("numpy", columns=[label_key])[:]
        return np.asarray(table[label_key], dtype=np.int64).reshape(-1)
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple):  # TensorDataset
        data = tensors[-1]
    if isinstance(data, tuple | list) and len(data) >= 2 and not np.isscalar(data[0]):
        data = data[-1]
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    return np.asarray(data, dtype=np.int64).reshape(-1)


def _edge_tag(context: Context) -> int:
    try:
        return int(context.node_config.get("edge", -1))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"node config edge={context.node_config.get('edge')!r} is not an "
                         "integer") from None


def profile_metrics(context: Context, labels: np.ndarray, num_classes: int) -> MetricRecord:
    """The profile reply's metrics: partition-id, num-examples, label-histogram, edge-tag."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got "
                         f"{labels.min()}..{labels.max()}")
    histogram = np.bincount(labels, minlength=num_classes)
    return MetricRecord({"partition-id": partition_id_of(context),
                         "num-examples": len(labels),
                         "label-histogram": [int(c) for c in histogram],
                         "edge-tag": _edge_tag(context)})


_MISSING = object()


def _named_value(parameter: inspect.Parameter, context: Context) -> Any:
    """What a loader parameter's name asks for: the context (``context``, ``ctx`` or
    annotated ``Context``), else the run config's, then the node config's value of its name
    (``batch_size`` reads ``batch-size``)."""
    if parameter.name in ("context", "ctx") or parameter.annotation in (Context, "Context"):
        return context
    for config in (context.run_config, context.node_config):
        for key in (parameter.name.replace("_", "-"), parameter.name):
            if key in config:
                return config[key]
    return _MISSING


def call_loader(load: Callable[..., Any], context: Context) -> Any:
    """What ``load`` returns for this node, called with what its parameters ask for.

    The first two positional parameters get the partition id and the number of partitions
    (``load(partition_id, num_partitions)``); each further one its named value
    (:func:`_named_value`: ``batch_size`` <- run config ``batch-size``, ``context`` <- the
    context); one nothing names keeps its default, or, as the third positional parameter,
    gets the context.
    """
    pid = partition_id_of(context)
    num = int(context.node_config.get("num-partitions", 0))  # type: ignore[call-overload]
    try:
        parameters = list(inspect.signature(load).parameters.values())
    except (TypeError, ValueError):
        return load(pid, num)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for index, parameter in enumerate(parameters):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if index < 2 and parameter.kind is not parameter.KEYWORD_ONLY:
            args.append((pid, num)[index])
            continue
        value = _named_value(parameter, context)
        if value is _MISSING and parameter.default is not parameter.empty:
            continue
        if value is _MISSING and index == 2:
            value = context
        if value is _MISSING:
            raise ValueError(f"cannot tell what to pass for '{parameter.name}' of "
                             f"{getattr(load, '__name__', load)!r}: give it a default or name "
                             "it after a run-config key")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[parameter.name] = value
    return load(*args, **kwargs)


def _rows(item: Any) -> int | None:
    """The rows of an array, tensor or data frame (``.shape[0]``); None for anything else
    (a plain list is not taken for a split: a list of rows is not told from a list of
    parts)."""
    shape = getattr(item, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def training_labels_of_split(data: Any) -> Any:
    """The training part of a loader's result, as the sklearn / XGBoost examples return it:
    ``(X_train, y_train, X_test, y_test)`` gives ``(X_train, y_train)``, and
    ``((X_train, y_train), (X_test, y_test))`` its first pair; anything else as it is."""
    if isinstance(data, tuple | list) and len(data) == 4:
        rows = [_rows(item) for item in data]
        if None not in rows and rows[0] == rows[1] and rows[2] == rows[3]:
            return tuple(data[:2])
    if (isinstance(data, tuple | list) and len(data) == 2
            and all(isinstance(part, tuple | list) and len(part) == 2 for part in data)
            and all(None not in (_rows(a), _rows(b)) and _rows(a) == _rows(b)
                    for a, b in data)):
        return tuple(data[0])
    return data


def _training_part(data: Any) -> Any:
    """``data``, or its first item when it is a tuple of loaders or datasets (a quickstart's
    ``(trainloader, valloader)``), or its training arrays (:func:`training_labels_of_split`)."""
    if isinstance(data, tuple | list) and data and (
            isinstance(data[0], DataLoader | torch.utils.data.Dataset)
            or hasattr(data[0], "column_names")):
        return data[0]
    return training_labels_of_split(data)


def register_profile(app: ClientApp, load_data: Any, num_classes: int,
                     *, label_key: str = "label",
                     labels: Callable[[Any], Any] | None = None) -> None:
    """Answer HierFedAvg's profile query (``MessageType.QUERY``) on ``app``.

    ``load_data`` is this node's training data, or a function returning it: the
    quickstart's ``load_data(partition_id, num_partitions, batch_size)`` as it is (its
    parameters are filled as :func:`call_loader` says). The data may be a DataLoader, a
    (Hugging Face or torch) dataset, ``(x, y)``, the labels, a ``(train, validation)``
    pair of loaders or datasets (the first is used), or the sklearn / XGBoost examples'
    ``(X_train, y_train, X_test, y_test)`` or ``((X_train, y_train), (X_test, y_test))``
    (the training rows are used). ``labels``: a function from what ``load_data`` returns
    to the training labels, for any other shape (it decides alone). The reply carries
    ``partition-id`` (from the node config), ``num-examples`` (the training rows),
    ``label-histogram`` (``num_classes`` counts) and ``edge-tag`` (node config ``edge``,
    -1 when absent).
    """
    @app.query()
    def profile(msg: Message, context: Context) -> Message:
        data = call_loader(load_data, context) if callable(load_data) else load_data
        found = labels(data) if labels is not None else _training_part(data)
        labels_found = labels_of(found, label_key)
        metrics = profile_metrics(context, labels_found, num_classes)
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

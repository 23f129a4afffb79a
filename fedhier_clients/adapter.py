"""Make a user's own Flower ClientApp follow fedhier's message contract (docs/contract.md).

Two levels, use either:

* **A few lines in your own handlers** (what ``examples/quickstart-hier`` does): keep your
  ``@app.train()`` / ``@app.evaluate()`` code and

  - iterate over :func:`batch_stream` instead of your DataLoader: it yields exactly the
    ``local-steps`` mini-batches this client must train on in this edge round, drawn with
    fedhier's seeded order (:func:`fedhier.train.batch_indices`, a pure function of seed,
    partition id and global step), so a plain SGD loop over it gives fedhier's numbers;
  - optionally answer the profile query with :func:`register_profile` (partition id,
    sample count, label histogram: the label-based groupings need it);
  - optionally add the :func:`canonical_metrics` mod, which copies Flower-quickstart metric
    names (``train_loss``, ``eval_loss``, ``eval_acc``) to the contract's names
    (``train-loss``, ``loss``, ``accuracy``).

* **A whole contract-following client from four functions**: :class:`HierClient` registers
  train, evaluate, profile query and gradient query handlers on a ClientApp around your
  ``model_fn()``, ``load_data(partition_id, num_partitions)``,
  ``train_fn(model, batches, steps, lr)`` and ``test_fn(model, data)``.

Nothing here depends on fedhier's own ClientApp (``fedhier_clients.app``); it shares with it
only :func:`fedhier.train.batch_indices` (the mini-batch order) and the message keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedhier.train import batch_indices

__all__ = [
    "METRIC_ALIASES",
    "BatchStream",
    "HierClient",
    "RoundInfo",
    "batch_stream",
    "canonical_metrics",
    "labels_of",
    "register_profile",
    "round_info",
]

#: Flower-quickstart metric names -> the contract's names (train and evaluate replies).
METRIC_ALIASES: dict[str, str] = {"train_loss": "train-loss", "eval_loss": "loss",
                                  "eval_acc": "accuracy"}


# --------------------------------------------------------------------------- the round
@dataclass(frozen=True)
class RoundInfo:
    """The per-message keys of a train message (docs/contract.md, "Train message").

    ``local_steps``: SGD steps to run; ``start_step``: global index (0-based) of the first
    one; ``edge_round`` and ``server_round``: 1-based; ``config``: the whole ConfigRecord
    (your ``train_config`` plus these).
    """

    local_steps: int
    start_step: int
    edge_round: int
    server_round: int
    config: ConfigRecord

    def get(self, key: str, default: Any = None) -> Any:
        """A key of the ServerApp's ``train_config`` (e.g. ``"lr"``)."""
        return self.config.get(key, default)


def _config(msg: Message, config_key: str = "config") -> ConfigRecord:
    """The message's ConfigRecord (empty when it has none)."""
    return msg.content.config_records.get(config_key, ConfigRecord())


def _num(config: Mapping[str, Any], key: str, default: Any) -> Any:
    return config.get(key, default)


def round_info(msg: Message, config_key: str = "config") -> RoundInfo:
    """Read the contract's per-message keys from a train message.

    A message without ``local-steps`` (not from HierFedAvg) raises a ``KeyError`` naming it.
    """
    config = _config(msg, config_key)
    if "local-steps" not in config:
        raise KeyError("train message has no 'local-steps': it was not sent by HierFedAvg "
                       "(see docs/contract.md)")
    steps = int(config["local-steps"])  # type: ignore[arg-type]
    server_round = int(_num(config, "server-round", 1))
    return RoundInfo(
        local_steps=steps,
        start_step=int(_num(config, "start-step", (server_round - 1) * steps)),
        edge_round=int(_num(config, "edge-round", server_round)),
        server_round=server_round,
        config=config,
    )


def _seed_of(msg: Message, context: Context, seed: int | None, config_key: str) -> int:
    if seed is not None:
        return int(seed)
    config = _config(msg, config_key)
    if "seed" in config:
        return int(config["seed"])  # type: ignore[arg-type]
    return int(_num(context.run_config, "seed", 0))


def partition_id_of(context: Context) -> int:
    """This node's ``partition-id`` (its client index on every Flower engine)."""
    if "partition-id" not in context.node_config:
        raise KeyError("node config has no 'partition-id': start each SuperNode with "
                       "--node-config \"partition-id=i num-partitions=n\"")
    return int(context.node_config["partition-id"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- batches
class BatchStream:
    """The mini-batches of one edge round: ``len(self)`` == ``local-steps``.

    ``indices`` [steps, b] are rows of the client's data (fedhier's order); iterating yields
    ``fetch(rows)`` for each step: ``(x[rows], y[rows])`` for tensors, your DataLoader's
    collated batch for a dataset. Like a DataLoader it has ``dataset`` (all the client's
    rows, so ``len(stream.dataset)`` is its ``num-examples``) and ``batch_size``.

    It can be iterated **once**: the server asked for ``local-steps`` steps, so a second pass
    (e.g. a training loop with ``local-epochs`` > 1) raises instead of silently running more.
    """

    def __init__(self, indices: np.ndarray, fetch: Callable[[list[int]], Any],
                 num_rows: int, dataset: Any = None) -> None:
        self.indices = indices
        self._fetch = fetch
        self.num_rows = num_rows
        self.dataset = dataset
        self.batch_size = indices.shape[1] if indices.ndim == 2 else 0
        self._used = False

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Any]:
        if self._used:
            raise RuntimeError(
                "this edge round's mini-batches were already used: HierFedAvg asks for "
                f"local-steps = {len(self)} SGD steps, one pass over the stream (train for "
                "one epoch, e.g. local-epochs = 1)")
        self._used = True
        for rows in self.indices:
            yield self._fetch(rows.tolist())


def _tensor_fetch(tensors: Sequence[torch.Tensor]) -> Callable[[list[int]], Any]:
    def fetch(rows: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(rows, dtype=torch.long, device=tensors[0].device)
        return tuple(t[index] for t in tensors)
    return fetch


def _dataset_fetch(dataset: Any, collate: Callable[[Any], Any]) -> Callable[[list[int]], Any]:
    # What torch's DataLoader does for a map-style dataset (its _MapDatasetFetcher).
    getitems = getattr(dataset, "__getitems__", None)

    def fetch(rows: list[int]) -> Any:
        items = getitems(rows) if getitems is not None else [dataset[i] for i in rows]
        return collate(items)
    return fetch


def batch_stream(msg: Message, context: Context, data: Any, batch_size: int | None = None,
                 *, seed: int | None = None, config_key: str = "config") -> BatchStream:
    """The ``local-steps`` mini-batches this client trains on in this edge round.

    ``data`` is what your code trains on: a ``DataLoader`` (its dataset, ``batch_size`` and
    ``collate_fn`` are used; its sampler/shuffle is not), a map-style dataset (torch or
    Hugging Face, batches collated like a DataLoader's), or a tuple of tensors ``(x, y, ...)``
    with the rows in the first dimension (yields tuples of row-sliced tensors).

    Mini-batch rows are ``fedhier.train.batch_indices(seed, partition-id, num_rows,
    batch_size, start-step, local-steps)``: the same rows fedhier's own ClientApp uses, a
    function of (seed, client, global step) only. ``batch_size`` 0 (or >= rows) is the full
    batch. ``seed``: this argument, else ``seed`` in the message config, else in
    ``context.run_config``, else 0.
    """
    info = round_info(msg, config_key)
    client = partition_id_of(context)
    fetch: Callable[[list[int]], Any]
    if isinstance(data, DataLoader):
        if batch_size is None:
            batch_size = data.batch_size
        dataset = data.dataset
        fetch = _dataset_fetch(dataset, data.collate_fn)
        num_rows = len(dataset)  # type: ignore[arg-type]
    elif isinstance(data, tuple | list) and data and all(isinstance(t, torch.Tensor)
                                                         for t in data):
        num_rows = len(data[0])
        if any(len(t) != num_rows for t in data):
            raise ValueError("batch_stream: the tensors of data must have the same rows")
        fetch = _tensor_fetch(data)
        dataset = TensorDataset(*data)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        from torch.utils.data import default_collate

        num_rows = len(data)
        fetch = _dataset_fetch(data, default_collate)
        dataset = data
    else:
        raise TypeError(f"batch_stream: cannot read rows from {type(data).__name__}; pass a "
                        "DataLoader, a map-style dataset or a tuple of tensors")
    if batch_size is None:
        raise ValueError("batch_stream: pass batch_size (it cannot be read from the data)")
    if num_rows == 0:
        raise ValueError(f"batch_stream: client {client} has no rows to train on")
    indices = batch_indices(_seed_of(msg, context, seed, config_key), client, num_rows,
                            int(batch_size), info.start_step, info.local_steps)
    return BatchStream(indices, fetch, num_rows, dataset)


# --------------------------------------------------------------------------- profile
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


def _call_loader(load: Callable[..., Any], context: Context) -> Any:
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


def _training_part(data: Any) -> Any:
    """``data``, or its first item when it is a tuple of loaders or datasets (a quickstart's
    ``(trainloader, valloader)``)."""
    if isinstance(data, tuple | list) and data and (
            isinstance(data[0], DataLoader | torch.utils.data.Dataset)
            or hasattr(data[0], "column_names")):
        return data[0]
    return data


def register_profile(app: ClientApp, load_data: Any, num_classes: int,
                     *, label_key: str = "label") -> None:
    """Answer HierFedAvg's profile query (``MessageType.QUERY``) on ``app``.

    ``load_data`` is this node's training data, or a function returning it: the
    quickstart's ``load_data(partition_id, num_partitions, batch_size)`` as it is (its
    parameters are filled as :func:`_call_loader` says). The data may be a DataLoader, a
    (Hugging Face or torch) dataset, ``(x, y)``, the labels, or a ``(train, validation)``
    pair of loaders or datasets (the first is used). The reply carries ``partition-id``
    (from the node config), ``num-examples``, ``label-histogram`` (``num_classes`` counts)
    and ``edge-tag`` (node config ``edge``, -1 when absent).
    """
    @app.query()
    def profile(msg: Message, context: Context) -> Message:
        data = _call_loader(load_data, context) if callable(load_data) else load_data
        labels = labels_of(_training_part(data), label_key)
        metrics = profile_metrics(context, labels, num_classes)
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)


# --------------------------------------------------------------------------- the mod
def canonical_metrics(msg: Message, context: Context,
                      call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: give train/evaluate replies the contract's metric names too.

    ``ClientApp(mods=[canonical_metrics])``. For each name in :data:`METRIC_ALIASES` present
    in a reply's ``metrics`` and whose contract name is absent, the value is copied under
    the contract name (the original stays). Other messages pass through.
    """
    reply = call_next(msg, context)
    if reply.has_error() or msg.metadata.message_type not in (MessageType.TRAIN,
                                                                MessageType.EVALUATE):
        return reply
    metrics = reply.content.metric_records.get("metrics")
    if metrics is not None:
        for alias, name in METRIC_ALIASES.items():
            if alias in metrics and name not in metrics:
                metrics[name] = metrics[alias]
    return reply


# --------------------------------------------------------------------------- HierClient
def _cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch[0], batch[-1]
    return nn.functional.cross_entropy(model(x), y)


class HierClient:
    """A contract-following client made of the user's own functions.

    Parameters
    ----------
    model_fn : () -> torch.nn.Module
        Builds the model (its ``state_dict`` keys are the message's arrays).
    load_data : (partition_id, num_partitions[, context]) -> data
        The client's training data: a tuple of tensors ``(x, y)``, a map-style dataset or a
        DataLoader (see :func:`batch_stream`). Called once per node and cached.
    train_fn : (model, batches, steps, lr) -> float | None
        Runs ``steps`` SGD steps over ``batches`` (a :class:`BatchStream` of exactly
        ``steps`` mini-batches) and returns the mean training loss (or None).
    test_fn : (model, data) -> (loss, accuracy), optional
        Evaluates on a client's data; default: mean cross-entropy and accuracy of
        ``model(x)`` against ``y`` for ``(x, y)`` tensors.
    num_classes : int
        Length of the label histogram of the profile query.
    batch_size : int
        Rows per mini-batch (0 = full batch); a DataLoader's own batch size when None.
    load_eval_data : (partition_id, num_partitions[, context]) -> data, optional
        The client's held-out rows, evaluated too and reported as ``holdout-loss``,
        ``holdout-accuracy`` and ``holdout-examples``.
    loss_fn : (model, batch) -> scalar tensor, optional
        The training loss, for the ``query.gradient`` handler (diagnostics, ``gradient``
        grouping); default: cross-entropy of ``model(batch[0])`` against ``batch[-1]``.
    lr_key : str (default: "lr")
        The learning-rate key of the ServerApp's ``train_config``.
    seed : int, optional
        Seed of the mini-batch order; default: ``seed`` of the message config, else of the
        run config, else 0.
    label_key : str (default: "label")
        Label column of a Hugging Face dataset (profile query).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        load_data: Callable[..., Any],
        train_fn: Callable[[nn.Module, BatchStream, int, float], float | None],
        test_fn: Callable[[nn.Module, Any], tuple[float, float]] | None = None,
        *,
        num_classes: int,
        batch_size: int | None = None,
        load_eval_data: Callable[..., Any] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        lr_key: str = "lr",
        seed: int | None = None,
        label_key: str = "label",
    ) -> None:
        self.model_fn = model_fn
        self.load_data = load_data
        self.train_fn = train_fn
        self.test_fn = test_fn or _default_test
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.load_eval_data = load_eval_data
        self.loss_fn = loss_fn or _cross_entropy
        self.lr_key = lr_key
        self.seed = seed
        self.label_key = label_key
        self._data: dict[tuple[int, str], Any] = {}

    # -- data and model
    def data(self, context: Context, which: str = "train") -> Any:
        """This node's training (or ``"eval"``) data, loaded once per process."""
        key = (partition_id_of(context), which)
        if key not in self._data:
            load = self.load_data if which == "train" else self.load_eval_data
            self._data[key] = None if load is None else _call_loader(load, context)
        return self._data[key]

    def model(self, arrays: ArrayRecord) -> nn.Module:
        """A fresh model holding the received arrays."""
        model = self.model_fn()
        model.load_state_dict(arrays.to_torch_state_dict())
        return model

    # -- handlers
    def train(self, msg: Message, context: Context) -> Message:
        """``local-steps`` steps of the user's ``train_fn``; reply arrays, num-examples,
        train-loss (when ``train_fn`` returns one)."""
        info = round_info(msg)
        if self.lr_key not in info.config:
            raise KeyError(f"train config has no '{self.lr_key}': pass it in train_config "
                           "of HierFedAvg.start (or set lr_key)")
        lr = float(info.config[self.lr_key])  # type: ignore[arg-type]
        model = self.model(msg.content.array_records["arrays"])
        batches = batch_stream(msg, context, self.data(context), self.batch_size,
                               seed=self.seed)
        loss = self.train_fn(model, batches, info.local_steps, lr)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        metrics = MetricRecord({"num-examples": batches.num_rows,
                                "partition-id": partition_id_of(context)})
        if loss is not None:
            metrics["train-loss"] = float(loss)
        return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}),
                       reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """The received model on this client's training data (loss, accuracy) and, with
        ``load_eval_data``, on its held-out rows (holdout-*)."""
        model = self.model(msg.content.array_records["arrays"])
        model.eval()
        data = self.data(context)
        loss, accuracy = self.test_fn(model, data)
        metrics = MetricRecord({"num-examples": _num_rows(data), "loss": float(loss),
                                "accuracy": float(accuracy),
                                "partition-id": partition_id_of(context)})
        held = self.data(context, "eval")
        if held is not None and _num_rows(held):
            h_loss, h_accuracy = self.test_fn(model, held)
            metrics["holdout-loss"] = float(h_loss)
            metrics["holdout-accuracy"] = float(h_accuracy)
            metrics["holdout-examples"] = _num_rows(held)
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    def profile(self, msg: Message, context: Context) -> Message:
        """partition-id, num-examples, label-histogram, edge-tag."""
        labels = labels_of(self.data(context), self.label_key)
        return Message(RecordDict({"metrics": profile_metrics(context, labels,
                                                              self.num_classes)}),
                       reply_to=msg)

    def gradient(self, msg: Message, context: Context) -> Message:
        """The full local gradient of ``loss_fn`` on all training rows at the received
        model, flattened over the floating-point ``state_dict`` entries that are parameters
        (buffers count as zeros), in ``state_dict`` order: ArrayRecord ``gradient``,
        array ``g`` [P]."""
        model = self.model(msg.content.array_records["arrays"])
        data = self.data(context)
        num_rows = _num_rows(data)
        full = BatchStream(np.arange(num_rows, dtype=np.int64)[None, :],
                           _fetch_for(data), num_rows)
        model.zero_grad()
        loss = self.loss_fn(model, next(iter(full)))
        loss.backward()
        params = dict(model.named_parameters())
        parts = []
        for key, value in model.state_dict().items():
            if not value.is_floating_point():
                continue
            grad = params[key].grad if key in params else None
            parts.append((grad if grad is not None else torch.zeros_like(value)).reshape(-1))
        g = torch.cat(parts).detach().cpu()
        reply = RecordDict({"gradient": ArrayRecord({"g": g}),
                            "metrics": MetricRecord({"num-examples": num_rows,
                                                     "gradient-rows": num_rows,
                                                     "partition-id": partition_id_of(context)})})
        return Message(reply, reply_to=msg)

    def register(self, app: ClientApp | None = None) -> ClientApp:
        """Register the train, evaluate, profile query and ``query.gradient`` handlers on
        ``app`` (a new ClientApp when None) and return it."""
        app = ClientApp() if app is None else app
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        app.query()(self.profile)
        app.query("gradient")(self.gradient)
        return app


def _fetch_for(data: Any) -> Callable[[list[int]], Any]:
    if isinstance(data, DataLoader):
        return _dataset_fetch(data.dataset, data.collate_fn)
    if isinstance(data, tuple | list) and data and isinstance(data[0], torch.Tensor):
        return _tensor_fetch(data)
    from torch.utils.data import default_collate

    return _dataset_fetch(data, default_collate)


def _num_rows(data: Any) -> int:
    if isinstance(data, DataLoader):
        return len(data.dataset)  # type: ignore[arg-type]
    if isinstance(data, tuple | list) and data and isinstance(data[0], torch.Tensor):
        return len(data[0])
    return len(data)


@torch.no_grad()
def _default_test(model: nn.Module, data: Any) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over all rows (``(x, y)`` batches)."""
    num_rows = _num_rows(data)
    if num_rows == 0:
        return float("nan"), float("nan")
    loss_sum, correct = 0.0, 0
    for start in range(0, num_rows, 4096):
        rows = list(range(start, min(start + 4096, num_rows)))
        batch = _fetch_for(data)(rows)
        x, y = batch[0], batch[-1]
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return loss_sum / num_rows, correct / num_rows

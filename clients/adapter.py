"""Make a user's own Flower ClientApp follow fedhier's message contract (docs/contract.md).

Two levels, use either:

* **A few lines in your own handlers** (what ``examples/quickstart-hier`` does): keep your
  ``@app.train()`` / ``@app.evaluate()`` code and

  - iterate over :func:`batch_stream` instead of your DataLoader: it yields exactly the
    ``local-steps`` mini-batches this client must train on in this edge round, drawn with
    fedhier's seeded order (:func:`fedhier.local.train.batch_indices`, a pure function of seed,
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

The first level's pieces live in :mod:`fedhier.clients.batches` (the round and its batches)
and :mod:`fedhier.clients.profile` (the profile query), re-exported here; this module holds
the mod and :class:`HierClient`. Nothing here depends on fedhier's own ClientApp
(``fedhier.clients.app``); it shares with it only :func:`fedhier.local.train.batch_indices` (the
mini-batch order) and the message keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from torch import nn

from fedhier.clients.batches import (
    BatchStream,
    RoundInfo,
    batch_stream,
    count_rows,
    partition_id_of,
    round_info,
    rows_fetcher,
)
from fedhier.clients.profile import call_loader, labels_of, profile_metrics, register_profile

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
            self._data[key] = None if load is None else call_loader(load, context)
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
        metrics = MetricRecord({"num-examples": count_rows(data), "loss": float(loss),
                                "accuracy": float(accuracy),
                                "partition-id": partition_id_of(context)})
        held = self.data(context, "eval")
        if held is not None and count_rows(held):
            h_loss, h_accuracy = self.test_fn(model, held)
            metrics["holdout-loss"] = float(h_loss)
            metrics["holdout-accuracy"] = float(h_accuracy)
            metrics["holdout-examples"] = count_rows(held)
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
        num_rows = count_rows(data)
        full = BatchStream(np.arange(num_rows, dtype=np.int64)[None, :],
                           rows_fetcher(data), num_rows)
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


@torch.no_grad()
def _default_test(model: nn.Module, data: Any) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over all rows (``(x, y)`` batches)."""
    num_rows = count_rows(data)
    if num_rows == 0:
        return float("nan"), float("nan")
    loss_sum, correct = 0.0, 0
    for start in range(0, num_rows, 4096):
        rows = list(range(start, min(start + 4096, num_rows)))
        batch = rows_fetcher(data)(rows)
        x, y = batch[0], batch[-1]
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return loss_sum / num_rows, correct / num_rows

"""The fedhier ClientApp: local SGD, evaluation, and a query for the client's data profile.

Everything a client needs arrives in the message: the model in the ArrayRecord ``arrays`` and
the run configuration (kebab-case keys of :class:`fedhier.config.RunConfig`) plus
``local-steps`` and ``start-step`` in the ConfigRecord ``config``. The client's identity is
its ``partition-id`` from ``context.node_config``, on every Flower engine.

Replies carry ``num-examples`` (used for ``samples`` weighting) and ``partition-id``.
"""

from __future__ import annotations

import functools

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhier.config import RunConfig
from fedhier.federation import Federation, federation_for
from fedhier.models import build_model
from fedhier.train import batch_indices, evaluate, local_sgd, resolve_device

#: Keys of the ConfigRecord that are per-message, not part of the RunConfig.
ROUND_KEYS = ("local-steps", "start-step", "server-round", "edge-round")

app = ClientApp()


@functools.lru_cache(maxsize=8)
def _config(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return RunConfig.from_mapping(dict(items), where="message config")


def run_config_of(config: ConfigRecord) -> RunConfig:
    """The RunConfig carried by a message's ConfigRecord (per-round keys removed)."""
    items = tuple(sorted((k, v) for k, v in config.items() if k not in ROUND_KEYS))
    return _config(items)


@functools.lru_cache(maxsize=8)
def _skeleton(model: str, input_shape: tuple[int, ...], num_classes: int, device: str) -> nn.Module:
    return build_model(model, input_shape, num_classes).to(device)


def _setup(msg: Message, context: Context) -> tuple[RunConfig, Federation, int, torch.device]:
    cfg = run_config_of(msg.content["config"])
    fed = federation_for(cfg)
    partition_id = int(context.node_config["partition-id"])
    if not 0 <= partition_id < fed.num_clients:
        raise ValueError(f"partition-id {partition_id} outside 0..{fed.num_clients - 1}")
    return cfg, fed, partition_id, resolve_device(cfg.device)


def _params(arrays: ArrayRecord, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in arrays.to_torch_state_dict().items()}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run ``local-steps`` SGD steps from step ``start-step`` and return the local model."""
    cfg, fed, pid, device = _setup(msg, context)
    config = msg.content["config"]
    steps = int(config["local-steps"])
    start = int(config.get("start-step", (int(config.get("server-round", 1)) - 1) * steps))
    x, y = fed.client_tensors(pid, device)
    model = _skeleton(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes, str(device))
    indices = batch_indices(cfg.seed, pid, len(y), cfg.batch_size, start, steps)
    params, loss = local_sgd(model, _params(msg.content["arrays"], device), x, y, lr=cfg.lr,
                             indices=indices)
    reply = RecordDict({
        "arrays": ArrayRecord({k: v.detach().cpu() for k, v in params.items()}),
        "metrics": MetricRecord({"num-examples": len(y), "train-loss": loss,
                                 "partition-id": pid}),
    })
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this client's training rows."""
    cfg, fed, pid, device = _setup(msg, context)
    x, y = fed.client_tensors(pid, device)
    model = _skeleton(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes, str(device))
    loss, accuracy = evaluate(model, _params(msg.content["arrays"], device), x, y)
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": accuracy,
                            "partition-id": pid})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def profile(msg: Message, context: Context) -> Message:
    """The client's partition id, number of rows and label histogram (for grouping)."""
    _, fed, pid, _ = _setup(msg, context)
    histogram = fed.label_histograms[pid]
    metrics = MetricRecord({"partition-id": pid, "num-examples": int(histogram.sum()),
                            "label-histogram": [int(c) for c in histogram]})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)

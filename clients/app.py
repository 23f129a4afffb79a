"""The fedhier ClientApp: local SGD, evaluation, and a query for the client's data profile.

Everything a client needs arrives in the message: the model in the ArrayRecord ``arrays`` and
the run configuration (kebab-case keys of :class:`fedhier.settings.run_config.RunConfig`) plus
``local-steps`` and ``start-step`` in the ConfigRecord ``config``. The client's identity is
its ``partition-id`` from ``context.node_config``, on every Flower engine.

Replies carry ``num-examples`` (used for ``samples`` weighting) and ``partition-id``. The
profile reply also says the client reads packed models (:mod:`fedhier.clients.wire.packed_model`):
a server that sends one (an edge server of ``fedhier deploy``) gets the trained model back
packed; any other gets Flower's ArrayRecord.
"""

from __future__ import annotations

import functools

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhier.clients.wire.array_records import to_tensors
from fedhier.clients.wire.keys import EDGE_ROUND, LOCAL_STEPS, ROUND_KEYS, SERVER_ROUND, START_STEP
from fedhier.clients.wire.packed_model import (
    READS_PACKED,
    VERSION,
    get_model,
    is_packed,
    model_record,
)
from fedhier.common.errors import ConfigError
from fedhier.data.federation import Federation, federation_for
from fedhier.diagnostics.in_rounds import diagnostic_rows
from fedhier.diagnostics.measures import flat_gradient
from fedhier.local.models import build_model
from fedhier.local.quantization import quantize_update
from fedhier.local.real_slowdown import sleep_for_steps
from fedhier.local.train import batch_indices, evaluate, local_sgd, resolve_device
from fedhier.round.faults import InjectedFaultError
from fedhier.settings.run_config import RunConfig

#: Where a client keeps its momentum buffers between rounds (``optimizer-state = keep``).
OPTIMIZER_STATE_KEY = "fedhier-optimizer"

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
    cfg = run_config_of(msg.content.config_records["config"])
    fed = federation_for(cfg)
    partition_id = int(context.node_config["partition-id"])
    if not 0 <= partition_id < fed.num_clients:
        raise ValueError(f"partition-id {partition_id} outside 0..{fed.num_clients - 1}")
    return cfg, fed, partition_id, resolve_device(cfg.device)


def _int(value: object) -> int:
    """A ConfigRecord value that the contract says is an integer, as an int."""
    return int(value)  # type: ignore[call-overload]


def _params(content: RecordDict, device: torch.device) -> dict[str, torch.Tensor]:
    """The model ``arrays`` of a message (an ArrayRecord or a packed model) on ``device``."""
    return {k: v.to(device) for k, v in get_model(content, "arrays").items()}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run ``local-steps`` steps from global step ``start-step``; return the local model.

    The learning rate follows the run's schedule over global steps; momentum buffers are
    kept in ``context.state`` between rounds when ``optimizer-state`` is ``keep``.
    """
    cfg, fed, pid, device = _setup(msg, context)
    config = msg.content.config_records["config"]
    steps = _int(config[LOCAL_STEPS])
    start = _int(config.get(START_STEP, (_int(config.get(SERVER_ROUND, 1)) - 1) * steps))
    edge_round = _int(config.get(EDGE_ROUND, 0))
    if cfg.faults().fails(cfg.seed, pid, edge_round, _int(config.get(SERVER_ROUND, 0))):
        raise InjectedFaultError(f"injected fault: client {pid} fails edge round {edge_round}")
    x, y = fed.client_tensors(pid, device)
    model = _skeleton(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes, str(device))
    start_params = _params(msg.content, device)
    optimizer = cfg.local_optimizer()
    keep = optimizer.has_state and cfg.optimizer_state == "keep"
    buffers = None
    if keep and OPTIMIZER_STATE_KEY in context.state:
        buffers = {k: v.to(device) for k, v in to_tensors(
            context.state.array_records[OPTIMIZER_STATE_KEY], remember=False).items()}
    langevin = cfg.langevin()
    params, loss, buffers = local_sgd(
        model, start_params, x, y, lr=cfg.learning_rates(start, steps),
        indices=batch_indices(cfg.seed, pid, len(y), cfg.batch_size, start, steps),
        optimizer=optimizer, buffers=buffers,
        noise=(lambda p, k, rate: langevin.perturb_one_(p, pid, start + k, rate))
        if langevin.active else None)
    if cfg.quantize_bits:  # the update goes up quantised (fedhier.local.quantization)
        params = quantize_update(start_params, params, bits=cfg.quantize_bits, seed=cfg.seed,
                                 client=pid, start_step=start)
    # real_step_seconds: a real slow edge (deploy); the SuperNode's config names its edge
    sleep_for_steps(cfg, context.node_config.get("edge"), steps)
    if keep and buffers is not None:
        context.state[OPTIMIZER_STATE_KEY] = ArrayRecord(
            {k: v.detach().cpu() for k, v in buffers.items()})
    reply = RecordDict({
        "arrays": model_record(params, packed=is_packed(msg.content, "arrays")),
        "metrics": MetricRecord({"num-examples": len(y), "train-loss": loss,
                                 "partition-id": pid, "local-steps": steps}),
    })
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """The received model on this client's training rows (and its held-out rows, if any)."""
    cfg, fed, pid, device = _setup(msg, context)
    x, y = fed.client_tensors(pid, device)
    model = _skeleton(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes, str(device))
    params = _params(msg.content, device)
    loss, accuracy = evaluate(model, params, x, y)
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": accuracy,
                            "partition-id": pid})
    hx, hy = fed.holdout_tensors(pid, device)
    if len(hy):
        h_loss, h_accuracy = evaluate(model, params, hx, hy)
        metrics["holdout-loss"] = h_loss
        metrics["holdout-accuracy"] = h_accuracy
        metrics["holdout-examples"] = len(hy)
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def _edge_tag(context: Context) -> int:
    """The ``edge`` this node is tagged with in its node config, -1 when untagged."""
    value = context.node_config.get("edge", -1)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"node config edge={value!r} is not an integer") from None


@app.query()
def profile(msg: Message, context: Context) -> Message:
    """The client's partition id, number of rows and label histogram (for grouping)."""
    _, fed, pid, _ = _setup(msg, context)
    histogram = fed.label_histograms[pid]
    metrics = MetricRecord({"partition-id": pid, "num-examples": int(histogram.sum()),
                            "label-histogram": [int(c) for c in histogram],
                            "edge-tag": _edge_tag(context), READS_PACKED: VERSION})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.query("gradient")
def gradient(msg: Message, context: Context) -> Message:
    """The full local gradient of the received model on this client's training rows (a seeded
    subsample of ``diagnostics-max-samples`` rows when set), flattened: ArrayRecord
    ``gradient`` with one array ``g`` [P]."""
    cfg, fed, pid, device = _setup(msg, context)
    x, y = fed.client_tensors(pid, device)
    model = _skeleton(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes, str(device))
    rows = torch.as_tensor(diagnostic_rows(len(y), cfg.diagnostics_max_samples, cfg.seed, pid),
                           device=device)
    params = _params(msg.content, device)
    grad = flat_gradient(model, params, x[rows], y[rows])
    reply = RecordDict({
        "gradient": ArrayRecord({"g": grad.detach().cpu()}),
        "metrics": MetricRecord({"num-examples": len(y), "gradient-rows": len(rows),
                                 "partition-id": pid}),
    })
    return Message(reply, reply_to=msg)


@app.query("state")
def export_state(msg: Message, context: Context) -> Message:
    """This client's kept state (every ArrayRecord in ``context.state``, e.g. momentum
    buffers), for the server's checkpoints; a client that keeps nothing sends none."""
    _, _, pid, _ = _setup(msg, context)
    reply = RecordDict(dict(context.state.array_records))
    reply["metrics"] = MetricRecord({"partition-id": pid})
    return Message(reply, reply_to=msg)


@app.query("restore")
def restore_state(msg: Message, context: Context) -> Message:
    """Put back the kept state of a checkpoint: every ArrayRecord of the message but the
    configuration goes into ``context.state`` under its name."""
    _, _, pid, _ = _setup(msg, context)
    for key, record in msg.content.array_records.items():
        context.state[key] = record
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

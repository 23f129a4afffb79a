"""The message contract between HierFedAvg and any ClientApp, server side (docs/contract.md).

What HierFedAvg sends (the per-message keys it adds to the run's ConfigRecord) and how it
reads replies. fedhier's own ClientApp is one client that follows it; a Flower user's app
needs only the train reply (``arrays`` and ``num-examples``). A reply that breaks the
contract stops the run with one line naming the client and the key (:class:`ContractError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from flwr.app import Message

from fedhier.clients.wire.keys import (
    ACCURACY_KEYS,
    EDGE_ROUND,
    LOCAL_STEPS,
    LOSS_KEYS,
    NUM_EXAMPLES,
    ROUND_KEYS,
    SERVER_ROUND,
    START_STEP,
    TRAIN_LOSS_KEYS,
)
from fedhier.clients.wire.packed_model import (
    PackedModelError,
    declared_layout,
    get_model,
    has_model,
)
from fedhier.common.errors import FedhierError

__all__ = ["ACCURACY_KEYS", "EDGE_ROUND", "LOCAL_STEPS", "LOSS_KEYS", "NUM_EXAMPLES",
           "ROUND_KEYS", "SERVER_ROUND", "START_STEP", "TRAIN_LOSS_KEYS", "ContractError",
           "NonFiniteLossError", "TrainReply", "check_histogram", "evaluate_rows",
           "num_examples_of", "read_evaluate_reply", "read_gradient_reply", "read_train_reply",
           "train_rows", "who"]


class ContractError(FedhierError):
    """A client's reply breaks the message contract."""


class NonFiniteLossError(ContractError):
    """An evaluate reply's loss is NaN or inf: always left out (with a warning), never a
    stop, since an honest client reports it for a global model that diverged."""


@dataclass(frozen=True)
class TrainReply:
    """A usable train reply: the client's model (CPU tensors), rows and mean loss (or None)."""

    params: dict[str, torch.Tensor]
    num_examples: int
    train_loss: float | None


def who(reply: Message | None, client: int | None) -> str:
    """'client 3 (node 123...)': how errors name the sender (``None``: its node unknown)."""
    node = "?" if reply is None else reply.metadata.src_node_id
    return f"node {node}" if client is None else f"client {client} (node {node})"


def _metric(reply: Message, keys: tuple[str, ...], client: int | None,
            required: bool = False) -> float | None:
    """The first of ``keys`` in the reply's MetricRecord ``metrics``, as a float."""
    metrics = reply.content.metric_records.get("metrics")
    for key in keys:
        if metrics is not None and key in metrics:
            value = metrics[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ContractError(f"{who(reply, client)} replied '{key}' = {value!r}: "
                                    "it must be a number (docs/contract.md)")
            return float(value)
    if required:
        raise ContractError(f"{who(reply, client)} replied without MetricRecord 'metrics' "
                            f"holding '{keys[0]}' (docs/contract.md)")
    return None


def num_examples_of(reply: Message, client: int | None, key: str = NUM_EXAMPLES) -> int:
    """The reply's ``num-examples`` (or the size under ``key``, HierFedAvg's
    ``weighted_by_key``): a positive whole number."""
    value = _metric(reply, (key,), client, required=True)
    assert value is not None
    if not math.isfinite(value) or value != int(value) or value <= 0:
        raise ContractError(f"{who(reply, client)} replied '{key}' = {value}: it must "
                            "be a positive whole number")
    return int(value)


def train_rows(reply: Message, client: int, key: str = NUM_EXAMPLES) -> int:
    """Which number is a client's weight this round: the rows it trained on, as its train
    reply's ``num-examples`` says (docs/contract.md, "Which rows weigh"). Read from every
    train reply, so a client whose data change size is re-weighted; the one place that
    decides it (checks on claimed sizes wrap this function). ``key``: HierFedAvg's
    ``weighted_by_key``."""
    return num_examples_of(reply, client, key)


def evaluate_rows(reply: Message, client: int, key: str = NUM_EXAMPLES) -> int:
    """The weight of a client's evaluation in the round's means: the rows it evaluated, as
    its evaluate reply's ``num-examples`` (``key``) says (never its training weight)."""
    return num_examples_of(reply, client, key)


def read_train_reply(reply: Message, client: int, arrays_key: str,
                     expected: dict[str, torch.Tensor], *, size_key: str = NUM_EXAMPLES,
                     loss_keys: tuple[str, ...] = TRAIN_LOSS_KEYS) -> TrainReply:
    """Parse a (non-error) train reply; its arrays (an ArrayRecord, or a packed model when
    one was sent: :mod:`fedhier.clients.wire.packed_model`) must match ``expected`` in keys and
    shapes (the model that was sent). ``size_key``, ``loss_keys``: where its size and mean
    loss are (HierFedAvg's ``weighted_by_key``, ``train_loss_key``)."""
    if not has_model(reply.content, arrays_key):
        raise ContractError(f"{who(reply, client)} replied without ArrayRecord "
                            f"'{arrays_key}' (the trained model; docs/contract.md)")
    check_layout(reply, client, arrays_key, expected)  # before any array is converted
    try:
        params = get_model(reply.content, arrays_key, remember=False)
    except PackedModelError as exc:
        raise ContractError(f"{who(reply, client)} replied '{arrays_key}': {exc}") from None
    if params.keys() != expected.keys():
        raise ContractError(key_difference(who(reply, client), params, expected))
    for key, value in params.items():
        if value.shape != expected[key].shape or value.dtype != expected[key].dtype:
            raise ContractError(
                f"{who(reply, client)} replied '{key}' as {str(value.dtype)[6:]} "
                f"{tuple(value.shape)}, expected the model's {str(expected[key].dtype)[6:]} "
                f"{tuple(expected[key].shape)}")
    loss = _metric(reply, loss_keys, client)
    return TrainReply(params=params, num_examples=train_rows(reply, client, size_key),
                      train_loss=loss)


#: Bytes an array's record may carry beyond its data (the serialisation's own header).
ARRAY_HEADER_BYTES = 4096


def check_layout(reply: Message, client: int, arrays_key: str,
                 expected: dict[str, torch.Tensor]) -> None:
    """The reply's model as its record declares it (names, dtypes, shapes, bytes carried:
    :func:`fedhier.clients.wire.packed_model.declared_layout`) matches ``expected``, checked
    before any array is decoded, so that a reply holding a huge array costs no copy of it."""
    try:
        layout = declared_layout(reply.content, arrays_key)
    except PackedModelError as exc:
        raise ContractError(f"{who(reply, client)} replied '{arrays_key}': {exc}") from None
    if layout.keys() != expected.keys():
        raise ContractError(key_difference(who(reply, client), layout, expected))
    for key, (dtype, shape, size) in layout.items():
        want = expected[key]
        if shape != tuple(want.shape) or dtype != str(want.dtype)[6:]:
            raise ContractError(
                f"{who(reply, client)} replied '{key}' as {dtype} {shape}, expected the "
                f"model's {str(want.dtype)[6:]} {tuple(want.shape)}")
        if size > want.numel() * want.element_size() + ARRAY_HEADER_BYTES:
            raise ContractError(f"{who(reply, client)} replied '{key}' carrying {size} bytes "
                                f"for a {str(want.dtype)[6:]} {tuple(want.shape)} array")


def read_evaluate_reply(reply: Message, client: int, *,
                        loss_keys: tuple[str, ...] = LOSS_KEYS,
                        accuracy_keys: tuple[str, ...] = ACCURACY_KEYS,
                        ) -> tuple[float, float, float | None] | None:
    """(loss, accuracy, held-out accuracy or None) of an evaluate reply; None when the reply
    carries no loss or no accuracy (under ``loss_keys`` / ``accuracy_keys``: the contract's
    names, or those named by HierFedAvg's ``loss_key`` / ``accuracy_key`` first)."""
    loss = _metric(reply, loss_keys, client)
    accuracy = _metric(reply, accuracy_keys, client)
    if loss is None or accuracy is None:
        return None
    holdout = _metric(reply, ("holdout-accuracy",), client)
    if not math.isfinite(loss):  # honest on a diverged global model: not a contract break
        raise NonFiniteLossError(f"{who(reply, client)} replied loss = {loss}: left out of the "
                            "recorded metrics")
    if loss < 0:
        raise ContractError(f"{who(reply, client)} replied loss = {loss}: it must be >= 0")
    for name, value in (("accuracy", accuracy), ("holdout-accuracy", holdout)):
        if value is not None and not 0 <= value <= 1:
            raise ContractError(f"{who(reply, client)} replied {name} = {value}: it must "
                                "be in [0, 1]")
    return loss, accuracy, holdout


def key_difference(sender: str, got: dict, expected: dict) -> str:
    """'client 3 (node ...) replied arrays without [...] and with extra [...]': the keys
    that differ, not the first few of each side."""
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    parts = ([f"without the model's {missing}"] if missing else []) + (
        [f"with arrays the model lacks {extra}"] if extra else [])
    return f"{sender} replied arrays {' and '.join(parts)}"


def check_histogram(reply: Message, histogram: object, classes: int | None) -> list[int]:
    """A profile reply's ``label-histogram``: whole counts >= 0, ``classes`` long when
    given (the length most clients report)."""
    values = list(histogram) if isinstance(histogram, list | tuple) else None
    if values is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                             for v in values):
        raise ContractError(f"{who(reply, None)} replied 'label-histogram' = "
                            f"{str(histogram)[:60]}: it must be counts >= 0")
    if classes is not None and values and len(values) != classes:
        raise ContractError(f"{who(reply, None)} replied 'label-histogram' of {len(values)} "
                            f"classes, the others {classes}")
    return [int(v) for v in values]


def read_gradient_reply(reply: Message, client: int, size: int | None) -> torch.Tensor:
    """A ``query.gradient`` reply's ``g``: a finite-length float vector of ``size`` entries
    (the others' length) when given."""
    record = reply.content.array_records["gradient"]
    if "g" not in record:
        raise ContractError(f"{who(reply, client)} replied ArrayRecord 'gradient' without "
                            f"'g' (docs/contract.md)")
    array = record["g"]  # its declared shape first: a huge 'g' is never decoded
    shape, dtype = tuple(array.shape), str(array.dtype)
    if (len(shape) != 1 or dtype not in ("float16", "bfloat16", "float32", "float64")
            or (size is not None and shape[0] != size)
            or len(array.data) > shape[0] * 8 + ARRAY_HEADER_BYTES):
        raise ContractError(f"{who(reply, client)} replied gradient 'g' as {dtype} {shape}, "
                            f"expected float ({size if size is not None else 'P'},)")
    return torch.from_numpy(array.numpy().copy())

"""The message contract between HierFedAvg and any ClientApp, server side (docs/contract.md).

What HierFedAvg sends (the per-message keys it adds to the run's ConfigRecord) and how it
reads replies. fedhier's own ClientApp is one client that follows it; a Flower user's app
needs only the train reply (``arrays`` and ``num-examples``). A reply that breaks the
contract stops the run with one line naming the client and the key (:class:`ContractError`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Message

from fedhier.contract import (
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
from fedhier.engines.flower_records import to_tensors
from fedhier.errors import FedhierError

__all__ = ["ACCURACY_KEYS", "EDGE_ROUND", "LOCAL_STEPS", "LOSS_KEYS", "NUM_EXAMPLES",
           "ROUND_KEYS", "SERVER_ROUND", "START_STEP", "TRAIN_LOSS_KEYS", "ContractError",
           "TrainReply", "evaluate_rows", "num_examples_of", "read_evaluate_reply",
           "read_train_reply", "train_rows", "who"]


class ContractError(FedhierError):
    """A client's reply breaks the message contract."""


@dataclass(frozen=True)
class TrainReply:
    """A usable train reply: the client's model (CPU tensors), rows and mean loss (or None)."""

    params: dict[str, torch.Tensor]
    num_examples: int
    train_loss: float | None


def who(reply: Message, client: int | None) -> str:
    """'client 3 (node 123...)': how errors name the sender."""
    node = reply.metadata.src_node_id
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


def num_examples_of(reply: Message, client: int | None) -> int:
    """The reply's ``num-examples``: a positive whole number."""
    value = _metric(reply, (NUM_EXAMPLES,), client, required=True)
    assert value is not None
    if value != int(value) or value <= 0:
        raise ContractError(f"{who(reply, client)} replied '{NUM_EXAMPLES}' = {value}: it must "
                            "be a positive whole number")
    return int(value)


def train_rows(reply: Message, client: int) -> int:
    """Which number is a client's weight this round: the rows it trained on, as its train
    reply's ``num-examples`` says (docs/contract.md, "Which rows weigh"). Read from every
    train reply, so a client whose data change size is re-weighted; the one place that
    decides it (checks on claimed sizes wrap this function)."""
    return num_examples_of(reply, client)


def evaluate_rows(reply: Message, client: int) -> int:
    """The weight of a client's evaluation in the round's means: the rows it evaluated, as
    its evaluate reply's ``num-examples`` says (never its training weight)."""
    return num_examples_of(reply, client)


def read_train_reply(reply: Message, client: int, arrays_key: str,
                     expected: dict[str, torch.Tensor]) -> TrainReply:
    """Parse a (non-error) train reply; its arrays must match ``expected`` in keys and
    shapes (the model that was sent)."""
    records = reply.content.array_records
    if arrays_key not in records:
        raise ContractError(f"{who(reply, client)} replied without ArrayRecord "
                            f"'{arrays_key}' (the trained model; docs/contract.md)")
    record: ArrayRecord = records[arrays_key]
    params = to_tensors(record, remember=False)
    if params.keys() != expected.keys():
        raise ContractError(f"{who(reply, client)} replied arrays {sorted(params)[:4]}..., "
                            f"expected the model's {sorted(expected)[:4]}...")
    for key, value in params.items():
        if value.shape != expected[key].shape or value.dtype != expected[key].dtype:
            raise ContractError(
                f"{who(reply, client)} replied '{key}' as {str(value.dtype)[6:]} "
                f"{tuple(value.shape)}, expected the model's {str(expected[key].dtype)[6:]} "
                f"{tuple(expected[key].shape)}")
    loss = _metric(reply, TRAIN_LOSS_KEYS, client)
    return TrainReply(params=params, num_examples=train_rows(reply, client),
                      train_loss=loss)


def read_evaluate_reply(reply: Message,
                        client: int) -> tuple[float, float, float | None] | None:
    """(loss, accuracy, held-out accuracy or None) of an evaluate reply; None when the reply
    carries no loss/accuracy (a client that does not evaluate)."""
    loss = _metric(reply, LOSS_KEYS, client)
    accuracy = _metric(reply, ACCURACY_KEYS, client)
    if loss is None or accuracy is None:
        return None
    return loss, accuracy, _metric(reply, ("holdout-accuracy",), client)

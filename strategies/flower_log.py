"""What HierFedAvg says in Flower's log (the ``flwr`` logger, Flower's format).

- :func:`log_cloud_round`: one INFO line per cloud round, as Flower's FedAvg logs its rounds:
  the clients' loss and accuracy, the cloud's record of the clients' own train and evaluate
  metrics (:mod:`fedhier.strategies.reply_metrics`, the first six keys), the ``evaluate_fn``
  metrics as given, edge rounds and the bytes sent so far, and the failed client replies of
  the round when there were any.
- :class:`HeldFlowerLog`: holds back what Flower logs while one probe message is out, so
  that an expected error reply (a ClientApp without the optional profile handler) does not
  print Flower's traceback; anything else is let through afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from logging import INFO
from types import TracebackType
from typing import Any

#: Flower's logger (``flwr.supercore.logger.FLOWER_LOGGER``).
FLOWER_LOGGER = logging.getLogger("flwr")


def cloud_round_line(record: dict[str, Any], num_rounds: int,
                     central: Mapping[str, Any] | None = None) -> str:
    """The one line of a cloud round's record (``HierarchicalSGD.record``); ``central``:
    the ``evaluate_fn`` metrics of the round, named as given."""
    parts = [f"[CLOUD ROUND {record['round']}/{num_rounds}]"]
    if record.get("train_loss") is not None:
        parts.append(f"clients: loss {record['train_loss']:.4f}, accuracy "
                     f"{record['train_accuracy']:.4f}")
    for label, metrics in (("train metrics", record.get("train_metrics")),
                           ("evaluate metrics", record.get("evaluate_metrics")),
                           ("evaluate_fn", central)):
        numbers = {k: v for k, v in (metrics or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers:
            shown = list(numbers.items())[:None if label == "evaluate_fn" else 6]
            parts.append(f"{label}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown))
    sent = record.get("client_edge_bytes", 0) + record.get("edge_cloud_bytes", 0)
    tail = f"{record['edge_rounds']} edge rounds, {sent / 1e6:.3f} MB sent"
    if record.get("failed_clients"):
        tail += f", {record['failed_clients']} client replies failed"
    parts.append(tail)
    return " | ".join(parts)


def log_cloud_round(record: dict[str, Any], num_rounds: int,
                    central: Mapping[str, Any] | None = None) -> None:
    """Log :func:`cloud_round_line` at INFO on Flower's logger."""
    FLOWER_LOGGER.log(INFO, "%s", cloud_round_line(record, num_rounds, central))


class HeldFlowerLog(logging.Filter):
    """``with HeldFlowerLog() as held:`` keeps Flower's log records of the block (from any
    thread of this process: the Simulation Engine runs the ClientApps' message loop beside
    the ServerApp); afterwards :meth:`release` logs them, or :meth:`drop_errors` logs only
    those below ERROR. Records stay held until one of the two is called."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def __enter__(self) -> HeldFlowerLog:
        FLOWER_LOGGER.addFilter(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        FLOWER_LOGGER.removeFilter(self)
        if error is not None:
            self.release()

    def release(self) -> None:
        """Log every held record."""
        self._emit(logging.NOTSET)

    def drop_errors(self) -> None:
        """Log the held records below ERROR; drop the errors (an expected error reply)."""
        self._emit(logging.ERROR)

    def _emit(self, below: int) -> None:
        records, self.records = self.records, []
        for record in records:
            if below == logging.NOTSET or record.levelno < below:
                FLOWER_LOGGER.handle(record)

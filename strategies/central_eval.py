"""Evaluate a user's own model on the user's own central data, for ``HierFedAvg.start``.

``evaluate_fn=central_evaluate(Net, load_test_data, test)`` gives :meth:`HierFedAvg.start`
(or any Flower strategy's ``start``) a function ``(server_round, arrays) -> MetricRecord``
that loads the user's test data once (lazily, on the ServerApp side), puts the received
arrays into a fresh ``model_fn()`` and reports ``test-loss`` and ``test-accuracy`` (the keys
fedhier's own runs record, as ``test_loss`` / ``test_accuracy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn

from fedhier.local.train import evaluate as _evaluate

#: The metric names of :func:`central_evaluate`'s record (before ``prefix``).
METRIC_NAMES = ("loss", "accuracy")


class CentralEvaluate:
    """``(server_round, arrays) -> MetricRecord`` over the user's central data.

    Parameters
    ----------
    model_fn : () -> torch.nn.Module
        Builds the user's model; the global arrays are loaded with ``load_state_dict``.
    data : object or () -> object
        The central test data, or a zero-argument function returning it (called once, at
        the first evaluation). Any form ``test_fn`` accepts; for the default ``test_fn`` a
        tuple of tensors ``(x, y)``.
    test_fn : (model, data) -> (loss, accuracy), optional
        The user's own evaluation; default: mean cross-entropy and accuracy of ``model(x)``
        (``fedhier.local.train.evaluate``, the function fedhier's own runs use).
    prefix : str (default: "test-")
        Prepended to ``loss`` and ``accuracy`` in the returned record.
    device : str (default: "cpu")
        Where the model and (default ``test_fn``) the tensors are put.
    """

    def __init__(self, model_fn: Callable[[], nn.Module], data: Any,
                 test_fn: Callable[[nn.Module, Any], tuple[float, float]] | None = None,
                 *, prefix: str = "test-", device: str = "cpu") -> None:
        self.model_fn = model_fn
        self._data_source = data
        self._data: Any = None
        self._loaded = False
        self.test_fn = test_fn
        self.prefix = prefix
        self.device = torch.device(device)

    @property
    def data(self) -> Any:
        """The central data (loaded on first use)."""
        if not self._loaded:
            source = self._data_source
            self._data = source() if callable(source) else source
            self._loaded = True
        return self._data

    def model(self, arrays: ArrayRecord) -> nn.Module:
        """A fresh ``model_fn()`` holding ``arrays``, in eval mode, on ``device``."""
        model = self.model_fn()
        model.load_state_dict(arrays.to_torch_state_dict())
        return model.to(self.device).eval()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = self.model(arrays)
        if self.test_fn is not None:
            loss, accuracy = self.test_fn(model, self.data)
        else:
            x, y = self.data[0], self.data[-1]
            params = {k: v.detach() for k, v in model.state_dict().items()}
            loss, accuracy = _evaluate(model, params, torch.as_tensor(x, device=self.device),
                                       torch.as_tensor(y, device=self.device))
        return MetricRecord({f"{self.prefix}loss": float(loss),
                             f"{self.prefix}accuracy": float(accuracy)})


def central_evaluate(model_fn: Callable[[], nn.Module], data: Any,
                     test_fn: Callable[[nn.Module, Any], tuple[float, float]] | None = None,
                     *, prefix: str = "test-", device: str = "cpu") -> CentralEvaluate:
    """An ``evaluate_fn`` for ``strategy.start``: see :class:`CentralEvaluate`."""
    return CentralEvaluate(model_fn, data, test_fn, prefix=prefix, device=device)

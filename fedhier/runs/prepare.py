"""What every engine builds before a run: the data, the initial model, the algorithm's
settings and the central evaluation of the global model. The loop that records the run is
:func:`fedhier.runs.driver.run_recorded`. No Flower import here: each engine brings its
executor (``fedhier.engines``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fedhier.common.errors import ConfigError
from fedhier.common.rng import torch_seed
from fedhier.data.federation import Federation, federation_for
from fedhier.diagnostics.in_rounds import diagnostics_due, sample_diagnostics
from fedhier.local.models import build_model
from fedhier.local.train import Forward, evaluate
from fedhier.round.loop import HSGDSettings, Params
from fedhier.settings.run_config import RunConfig
from fedhier.settings.views import build_part


def quiet_flower() -> None:
    """Keep Flower's per-round INFO logs out of the progress bar."""
    logging.getLogger("flwr").setLevel(logging.WARNING)


def prepare(cfg: RunConfig) -> Federation:
    """Load and partition the data; raises a one-line FedhierError on bad input."""
    fed = federation_for(cfg)
    token_input = fed.bundle.x_dtype.startswith("int")
    if token_input != (cfg.model == "lstm"):
        kind = "token ids (text)" if token_input else "real-valued features"
        raise ConfigError(f"dataset {cfg.dataset} has {kind}; model '{cfg.model}' does not fit: "
                          f"use {'lstm' if token_input else 'logreg, mlp, cnn or lenet5'}")
    if fed.num_clients != cfg.clients:
        raise ConfigError(
            f"the partition has {fed.num_clients} clients but clients={cfg.clients}; set "
            f"--clients {fed.num_clients}")
    return fed


def initial_model(cfg: RunConfig, fed: Federation) -> torch.nn.Module:
    """The seeded initial global model."""
    return build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes,
                       seed=torch_seed(cfg.seed, "model-init"))


def test_metrics(model: torch.nn.Module, params: dict[str, torch.Tensor], fed: Federation,
                 device: torch.device, forward: Forward | None = None) -> dict[str, Any]:
    """``test_loss`` and ``test_accuracy`` of ``params`` on the held-out test set
    (``forward``: see :func:`fedhier.local.train.evaluate`)."""
    x_test, y_test = fed.test_tensors(device)
    loss, accuracy = evaluate(model, params, x_test, y_test, forward=forward)
    return {"test_loss": loss, "test_accuracy": accuracy}


def pooled_train_tensors(fed: Federation,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All clients' training rows together (the pooled data of sample-level diversity)."""
    parts = [fed.client_tensors(j, device) for j in range(fed.num_clients)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def settings_for(cfg: RunConfig) -> HSGDSettings:
    """The algorithm's settings of a run configuration: the part every setting declared with
    ``part="algorithm"`` feeds, with its parts (:func:`fedhier.settings.views.build_part`)."""
    settings: HSGDSettings = build_part(cfg, "algorithm")
    return settings


def central_evaluation(cfg: RunConfig, fed: Federation, model: torch.nn.Module,
                       device: torch.device, forward: Forward | None = None,
                       ) -> Callable[[int, Params], dict[str, Any]]:
    """The server's own evaluation of the global model after each cloud round: test loss
    and accuracy (with ``forward``'s logits when given), and (when diagnostics are due) the
    sample-level gradient diversity of the pooled training rows."""

    def evaluate_fn(cloud_round: int, params: Params) -> dict[str, Any]:
        on_device = {k: v.to(device) for k, v in params.items()}
        metrics = test_metrics(model, on_device, fed, device, forward)
        if diagnostics_due(cloud_round, cfg.diagnostics_every):
            x, y = pooled_train_tensors(fed, device)
            metrics.update(sample_diagnostics(model, on_device, x, y,
                                              cfg.diagnostics_max_samples, cfg.seed))
        return metrics

    return evaluate_fn

"""The round a run configuration asks for, built one way for every one-process engine.

:func:`round_for` is synchronous H-SGD or asynchronous edges (``async_buffer``:
:func:`fedhier.round.asynchrony.edges.algorithm_for`) with the cloud step of
``cloud_strategy`` (the plain mean, or a Flower strategy as the cloud's optimizer:
:mod:`fedhier.strategies.cloud_step`). An engine that builds its round here honours every
setting of the round (docs/engines.md, "Adding an engine").
"""

from __future__ import annotations

from fedhier.round.asynchrony.edges import algorithm_for
from fedhier.round.loop import HierarchicalSGD
from fedhier.runs.prepare import settings_for
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.cloud_step import as_cloud_step, make_cloud_strategy


def round_for(cfg: RunConfig) -> HierarchicalSGD:
    """``cfg``'s round (settings, asynchrony, cloud step), not yet run."""
    return algorithm_for(settings_for(cfg), as_cloud_step(make_cloud_strategy(
        cfg.cloud_strategy, cfg.server_lr, cfg.server_momentum)))

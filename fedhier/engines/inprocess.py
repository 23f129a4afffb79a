"""Engine ``inprocess``: the Flower strategy and ClientApp in this process (no Ray, no sockets)."""

from __future__ import annotations

from typing import Any

from fedhier.checkpoint import Checkpoint
from fedhier.clients.app import app as client_app
from fedhier.config import RunConfig
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.results import RunFolder
from fedhier.server import run_federation


def run_inprocess(cfg: RunConfig, folder: RunFolder, progress: bool = True,
                  resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` on an :class:`InProcessGrid` of ``cfg.clients`` nodes."""
    grid = InProcessGrid(client_app, cfg.clients, seed=cfg.seed)
    return run_federation(grid, cfg, folder, engine="inprocess", progress=progress,
                          resume=resume)

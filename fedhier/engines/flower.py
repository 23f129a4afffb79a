"""Engine ``flower``: Flower's Simulation Engine (Ray), one virtual SuperNode per client.

The ServerApp runs in this process (so it can write the run folder and show progress); the
ClientApp ``fedhier.clients.app:app`` runs in Ray actors. ``flwr run .`` from the repository
root runs the same ServerApp logic through ``fedhier.strategies.server_app:app``.
"""

from __future__ import annotations

import os
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedhier.checkpoint import Checkpoint
from fedhier.config import RunConfig
from fedhier.engines.grid_run import run_federation
from fedhier.run_folder import RunFolder
from fedhier.server import quiet_flower


def run_simulation_engine(cfg: RunConfig, folder: RunFolder, progress: bool = True,
                          num_cpus: int | None = None,
                          resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` on Flower's Simulation Engine; each client actor gets one CPU."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from fedhier.clients.app import app as client_app

    quiet_flower()
    summary: dict[str, Any] = {}
    errors: list[BaseException] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # The ServerApp runs in a Flower thread; its exception (a run failure, a stop
        # requested inside it) is handed to the caller's thread, as on the other engines.
        try:
            summary.update(run_federation(grid, cfg, folder, engine="flower",
                                          progress=progress, resume=resume))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    num_gpus = 1.0 if cfg.device in ("cuda", "auto") and _cuda() else 0.0
    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": "error"}
    if not os.environ.get("RAY_ADDRESS"):  # joining a cluster: Ray refuses num_cpus
        init_args["num_cpus"] = num_cpus or os.cpu_count() or 1
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": num_gpus / max(cfg.clients, 1)},
        "init_args": init_args,
    }
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.clients,
                   backend_config=backend_config)  # type: ignore[arg-type]
    quiet_flower()
    if errors:
        raise errors[0]
    if not summary:
        raise RuntimeError("the Simulation Engine finished without a result (see log above)")
    return summary


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

"""The fedhier ServerApp for ``flwr run .`` (Simulation or Deployment Engine).

It reads the run configuration from ``context.run_config`` (``[tool.flwr.app.config]`` in
pyproject.toml, overridden with ``flwr run . --run-config "key=value"``) and writes the
usual run folder (``out``, default runs/<timestamp>-flwr-run). ``fedhier deploy local
--resume`` sets ``FEDHIER_RESUME`` on the SuperLink: the ServerApp then continues that run
folder from its checkpoint.
"""

from __future__ import annotations

import os

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedhier.engines.grid_run import RESUME_ENV, run_federation
from fedhier.runs.checkpoint import resumed_checkpoint
from fedhier.runs.folder import RunFolder, default_run_dir
from fedhier.runs.prepare import quiet_flower
from fedhier.settings.run_config import RunConfig

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the hierarchical federation described by the run config."""
    quiet_flower()
    cfg = RunConfig.from_app_config(context.run_config).replace(engine="flower")
    resume_dir = os.environ.get(RESUME_ENV)
    if resume_dir:  # checked by fedhier deploy local --resume before anything started
        folder = RunFolder.claim_existing(resume_dir)
        checkpoint = resumed_checkpoint(resume_dir)
    else:
        folder = RunFolder.create(cfg.out or default_run_dir("flwr-run"))
        checkpoint = None
    summary = run_federation(grid, cfg, folder, engine="flower (flwr run)", progress=False,
                             resume=checkpoint)
    print(f"fedhier: run folder {folder.path}; final test accuracy "
          f"{summary['final_test_accuracy']:.4f}")

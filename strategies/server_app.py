"""The fedhier ServerApp for ``flwr run .`` (Simulation or Deployment Engine).

It reads the run configuration from ``context.run_config`` (``[tool.flwr.app.config]`` in
pyproject.toml, overridden with ``flwr run . --run-config "key=value"``) and writes the
usual run folder (``out``, default runs/<timestamp>-flwr-run).
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedhier.config import RunConfig
from fedhier.engines.grid_run import run_federation
from fedhier.run_folder import RunFolder, default_run_dir
from fedhier.server import quiet_flower

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the hierarchical federation described by the run config."""
    quiet_flower()
    cfg = RunConfig.from_app_config(context.run_config).replace(engine="flower")
    folder = RunFolder.create(cfg.out or default_run_dir("flwr-run"))
    summary = run_federation(grid, cfg, folder, engine="flower (flwr run)", progress=False)
    print(f"fedhier: run folder {folder.path}; final test accuracy "
          f"{summary['final_test_accuracy']:.4f}")

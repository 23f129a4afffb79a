"""The ClientApp component of ``flwr run .`` ([tool.flwr.app.components] in pyproject.toml).

See fedhier_serverapp.py: ``import fedhier`` first, whole, so the ClientApp's import waits
for a ServerApp thread that is running ``fedhier/__init__.py`` at the same moment.
"""

import fedhier  # noqa: F401  (first and whole: see fedhier_serverapp.py)
from fedhier.clients.app import app

__all__ = ["app"]

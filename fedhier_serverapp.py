"""The ServerApp component of ``flwr run .`` ([tool.flwr.app.components] in pyproject.toml).

``flwr run .`` packs this folder into a FAB and imports the components from it, fedhier
installed or not (docs/install.md). ``import fedhier`` comes first, as a whole statement: in
the Simulation Engine the ServerApp and the ClientApp are imported by two threads at once, and
a dotted import (``fedhier.strategies...``) would not wait for the other thread to finish
``fedhier/__init__.py``, which is what makes ``fedhier.strategies`` findable in a source tree.
"""

import fedhier  # noqa: F401  (first and whole: see above)
from fedhier.strategies.server_app import app

__all__ = ["app"]

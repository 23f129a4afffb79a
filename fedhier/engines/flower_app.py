"""The two components of ``flwr run .`` from this repository (pyproject.toml's
``[tool.flwr.app.components]``): ``serverapp`` is :data:`fedhier.strategies.server_app.app`,
``clientapp`` :data:`fedhier.clients.app.app`.

Why not name those two directly: in a source tree (this repository, or the FAB ``flwr run .``
unpacks) ``fedhier.strategies`` and ``fedhier.clients`` are the root folders ``strategies/``
and ``clients/``, found by the finder that ``import fedhier`` puts in place
(:mod:`fedhier.common.import_names`). Flower's Simulation Engine loads the ServerApp and the
ClientApp in two threads at once, and CPython's import system does not make a thread that
imports a *submodule* wait for another thread still executing the package itself: the second
thread could look for ``fedhier.clients`` before the finder is there (seen here: one start in
three). This module is a file of ``fedhier`` (found without the finder), and its first
statement is a plain ``import fedhier``, which does wait for that. Each component is imported
only when Flower asks for it (a SuperNode never imports the server side).
"""

from __future__ import annotations

import importlib
from typing import Any

import fedhier  # noqa: F401  (waits until another thread's import of fedhier has finished)

__all__ = ["clientapp", "serverapp"]  # noqa: F822  (module __getattr__)

#: component -> "module:attribute" it is
COMPONENTS = {"serverapp": "fedhier.strategies.server_app:app",
              "clientapp": "fedhier.clients.app:app"}


def __getattr__(name: str) -> Any:
    """``serverapp`` / ``clientapp``: the component, imported on first use."""
    if name not in COMPONENTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = COMPONENTS[name].split(":")
    return getattr(importlib.import_module(module), attribute)

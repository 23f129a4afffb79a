"""The engine registry: every engine name, in one place, with the function that runs it.

``fedhier run --engine NAME``, :class:`fedhier.settings.run_config.RunConfig` validation, the
experiment suites and ``benchmarks/engines.py`` all read the names from :data:`ENGINES`. Each entry
names its run function as an import string (``"package.module:function"``) that is imported only
when a run starts, so this module imports neither torch nor Flower, and any module (the
configuration included) can import it without an import cycle.

A run function has the signature::

    run(cfg: RunConfig, folder: RunFolder, progress: bool = True,
        resume: Checkpoint | None = None) -> dict[str, Any]   # the run's summary.json

Adding an engine is one module with such a function plus one :class:`Engine` line below
(docs/engines.md, "Adding an engine").
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fedhier.common.errors import ConfigError

#: ``(cfg, folder, progress=..., resume=...) -> summary``; typed loosely so that this module
#: needs no import of the configuration, run folder or checkpoint modules.
RunFunction = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Engine:
    """One engine: its ``--engine`` name, its run function, one line for ``--help``."""

    name: str
    target: str  # "package.module:function", imported by load()
    description: str

    def load(self) -> RunFunction:
        """Import and return the run function."""
        module_name, _, function = self.target.partition(":")
        run: RunFunction = getattr(importlib.import_module(module_name), function)
        return run


_ENGINES = (
    Engine("inprocess", "fedhier.engines.inprocess:run_inprocess",
           "Flower strategy + ClientApp in one process"),
    Engine("flower", "fedhier.engines.flower:run_simulation_engine",
           "Flower's Simulation Engine on Ray"),
    Engine("vectorized", "fedhier.engines.vectorized.engine:run_vectorized",
           "all clients as one batched computation"),
    Engine("vectorized-ray", "fedhier.engines.vectorized_ray.engine:run_vectorized_ray",
           "the batched engine sharded by edge over a Ray cluster"),
)

#: name -> Engine, in the order ``--help`` lists them; the first is the default.
ENGINES: Mapping[str, Engine] = MappingProxyType({e.name: e for e in _ENGINES})


def engine_names() -> tuple[str, ...]:
    """Every engine name, e.g. for ``argparse`` choices or RunConfig validation."""
    return tuple(ENGINES)


def get_engine(name: str) -> Engine:
    """The engine called ``name``; ConfigError (one line, with a suggestion) if none is."""
    try:
        return ENGINES[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(ENGINES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown engine '{name}'{hint}; choose one of "
                          f"{', '.join(ENGINES)}") from None


def engine_help() -> str:
    """One line for ``--engine``'s help: every name with its description."""
    parts = [f"{e.name} ({e.description})" for e in ENGINES.values()]
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def run_engine(cfg: Any, folder: Any, progress: bool = True,
               resume: Any = None) -> dict[str, Any]:
    """Run ``cfg`` on the engine ``cfg.engine`` names; returns the run's summary."""
    if getattr(cfg, "replay_arrivals", "") and cfg.engine not in ("inprocess", "flower"):
        raise ConfigError(f"replay_arrivals replays a recorded arrival order on engines "
                          f"inprocess and flower (grid_run.py); engine '{cfg.engine}' would "
                          "ignore it: drop it or choose one of those")
    if getattr(cfg, "edge_servers", False) and cfg.engine != "flower":  # flower_edges.py
        raise ConfigError(f"edge_servers is for fedhier deploy local --edges, which starts the "
                          f"edge server processes, or --engine flower; engine '{cfg.engine}' "
                          "keeps the edges inside the cloud (same numbers): leave "
                          "edge_servers off")
    return get_engine(cfg.engine).load()(cfg, folder, progress=progress, resume=resume)

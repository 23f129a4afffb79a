"""Where fedhier's import names find their files, and the names of the last release.

Both through importlib's finder API (no package's search path is edited):

1. **A source tree** (this repository, or the app folder ``flwr run .`` unpacks from its FAB)
   keeps the Flower layer and the dataset cards in folders of their own at its root:
   ``strategies/``, ``clients/``, ``datasets_cfg/`` (the design card's layout). Installed
   (``pip install .`` or the wheel), setuptools' ``package-dir`` puts them at
   ``fedhier/strategies`` ...; in a source tree :class:`SourceTreeFinder` finds
   ``fedhier.strategies`` in ``<root>/strategies``, as setuptools' own editable installs do
   for a ``package-dir`` mapping. It is installed only when ``fedhier`` sits in a source tree
   (a ``pyproject.toml`` beside it and the folders there, none inside ``fedhier/``).
2. **The last release's names** (:data:`RENAMED`: ``fedhier_strategies``, ``fedhier_clients``,
   ``fedhier.hsgd``, ``fedhier.config``, ...) import the module of today's name, with one
   DeprecationWarning naming it; kept for one release (docs/install.md#renamed-modules).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

#: The packages whose files are a folder at the source tree's root.
SOURCE_FOLDERS = {"fedhier.strategies": "strategies", "fedhier.clients": "clients",
                  "fedhier.datasets_cfg": "datasets_cfg"}

#: Last release's module name -> today's (a package's submodules follow their package).
RENAMED = {
    "fedhier.admission": "fedhier.tree.admission",
    "fedhier.aggregate": "fedhier.round.aggregators.averaging",
    "fedhier.arrival_order": "fedhier.round.asynchrony.arrival_order",
    "fedhier.async_edges": "fedhier.round.asynchrony.edges",
    "fedhier.async_regions": "fedhier.round.asynchrony.regions",
    "fedhier.checkpoint": "fedhier.runs.checkpoint",
    "fedhier.cli_flags": "fedhier.cli.flags",
    "fedhier.communication": "fedhier.round.traffic",
    "fedhier.config": "fedhier.settings.run_config",
    "fedhier.config_checks": "fedhier.settings.checks",
    "fedhier.config_parse": "fedhier.settings.parse",
    "fedhier.contract": "fedhier.clients.wire.keys",
    "fedhier.crash_points": "fedhier.runs.crash_points",
    "fedhier.devices": "fedhier.local.devices",
    "fedhier.edge_moves": "fedhier.round.tiers.moves",
    "fedhier.edge_tier": "fedhier.round.tiers.jobs",
    "fedhier.edge_tier_async": "fedhier.round.tiers.asynchronous",
    "fedhier.engines.batched_kernels": "fedhier.engines.vectorized.kernels",
    "fedhier.engines.chunked_eval": "fedhier.engines.vectorized.chunked_eval",
    "fedhier.engines.seed_batch": "fedhier.engines.vectorized.seed_batch",
    "fedhier.engines.vectorized_chunks": "fedhier.engines.vectorized.chunks",
    "fedhier.engines.vectorized_ray_async": "fedhier.engines.vectorized_ray.asynchrony",
    "fedhier.engines.vectorized_ray_executor": "fedhier.engines.vectorized_ray.executor",
    "fedhier.engines.vectorized_ray_moves": "fedhier.engines.vectorized_ray.moves",
    "fedhier.engines.vectorized_ray_segment": "fedhier.engines.vectorized_ray.segment",
    "fedhier.engines.vectorized_ray_shard": "fedhier.engines.vectorized_ray.shard",
    "fedhier.engines.vectorized_ray_subtree": "fedhier.engines.vectorized_ray.subtree",
    "fedhier.engines.vectorized_ray_worker": "fedhier.engines.vectorized_ray.worker",
    "fedhier.errors": "fedhier.common.errors",
    "fedhier.experiments": "fedhier.studies.experiments",
    "fedhier.experiments.stats": "fedhier.studies.experiments.seed_summary",
    "fedhier.faults": "fedhier.round.faults",
    "fedhier.federation": "fedhier.data.federation",
    "fedhier.grouping": "fedhier.tree.grouping",
    "fedhier.hsgd": "fedhier.round.loop",
    "fedhier.lr_schedules": "fedhier.local.lr_schedules",
    "fedhier.mobility": "fedhier.tree.mobility",
    "fedhier.models": "fedhier.local.models",
    "fedhier.optim": "fedhier.local.optimizer",
    "fedhier.permutations": "fedhier.common.permutations",
    "fedhier.plan": "fedhier.round.participants",
    "fedhier.plots": "fedhier.runs.plots",
    "fedhier.ranges": "fedhier.settings.ranges",
    "fedhier.real_slowdown": "fedhier.local.real_slowdown",
    "fedhier.recorded_run": "fedhier.runs.driver",
    "fedhier.reply_policy": "fedhier.round.reply_policy",
    "fedhier.rng": "fedhier.common.rng",
    "fedhier.robust": "fedhier.round.aggregators.robust",
    "fedhier.round.records": "fedhier.round.record_fields",
    "fedhier.round_diagnostics": "fedhier.diagnostics.in_rounds",
    "fedhier.run_folder": "fedhier.runs.folder",
    "fedhier.run_lock": "fedhier.runs.lock",
    "fedhier.run_recorder": "fedhier.runs.recorder",
    "fedhier.run_setup": "fedhier.runs.prepare",
    "fedhier.settings_table": "fedhier.settings.table",
    "fedhier.sim_clock": "fedhier.round.clock",
    "fedhier.stale_reports": "fedhier.round.asynchrony.reports",
    "fedhier.staleness": "fedhier.round.asynchrony.settings",
    "fedhier.state_codec": "fedhier.runs.state_codec",
    "fedhier.sweep": "fedhier.studies.sweep",
    "fedhier.topology": "fedhier.tree.hierarchy",
    "fedhier.trackers": "fedhier.runs.trackers",
    "fedhier.train": "fedhier.local.train",
    "fedhier_clients": "fedhier.clients",
    "fedhier_clients.packed_model": "fedhier.clients.wire.packed_model",
    "fedhier_clients.records": "fedhier.clients.wire.array_records",
    "fedhier_strategies": "fedhier.strategies",
    "fedhier_strategies.contract": "fedhier.strategies.replies",
}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``fedhier.strategies`` (...) in the source tree's root folders."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        folder = SOURCE_FOLDERS.get(fullname)
        if folder is None:
            return None  # submodules are found by the package's own search location
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


class _Forward(importlib.abc.Loader):
    """Loads an old name as the module of its new name (the same module object)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} is renamed {self.new}; the old name goes in the next "
                      "release", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module of the new name is already executed."""


class RenamedFinder(importlib.abc.MetaPathFinder):
    """Finds a module of the last release's name (:data:`RENAMED`) as today's module."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = renamed(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Forward(fullname, new))


def renamed(name: str) -> str | None:
    """Today's name of module ``name`` of the last release (None: not renamed)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        new = RENAMED.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return None


def source_root(package_folder: Path) -> Path | None:
    """The source tree ``fedhier`` (its folder: ``package_folder``) sits in, or None when it
    is installed (its folders inside it) or not in one."""
    root = package_folder.parent
    if (package_folder / "strategies").is_dir() or not (root / "pyproject.toml").is_file():
        return None
    if all((root / folder / "__init__.py").is_file() for folder in SOURCE_FOLDERS.values()):
        return root
    return None


def install(package_folder: Path) -> None:
    """Put the finders on ``sys.meta_path`` once: the source tree's right after the path
    finder (before an editable install's finder, so an unpacked FAB imports its own files),
    the renamed modules' last."""
    if any(isinstance(f, RenamedFinder) for f in sys.meta_path):
        return
    root = source_root(package_folder)
    if root is not None:
        after = next((i + 1 for i, f in enumerate(sys.meta_path)
                      if f is importlib.machinery.PathFinder), len(sys.meta_path))
        sys.meta_path.insert(after, SourceTreeFinder(root))
    sys.meta_path.append(RenamedFinder())

"""Client -> edge groupings: a registry of built-ins plus plugins.

Plugins are other installed packages that declare an entry point in the group
``fedhier.groupings`` (``fedhier.tree.grouping``, the group's earlier name, is read too): an entry
``name = "package.module:function"`` makes ``--grouping name`` call that function, which must
follow :class:`fedhier.tree.grouping.base.Grouping`. A built-in name cannot be replaced. A plugin
that fails to import is a one-line `ConfigError` naming the plugin and its package, raised when the
configuration is validated (before a run writes anything). A grouping name with a colon,
``module:function``, is such an entry point's value used directly: the function is imported
from an importable module without installing a package (a sweep's own plugin, docs/sweeps.md).
See docs/grouping.md.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.tree.grouping.base import ClientInfo, Grouping, balanced_sizes, declares, needs_of
from fedhier.tree.grouping.divergence import (
    make_gradient_grouping,
    max_divergence_grouping,
    min_divergence_grouping,
)
from fedhier.tree.grouping.simple import contiguous_grouping, edge_tag_grouping, random_grouping

ENTRY_POINT_GROUP = "fedhier.groupings"
#: Entry point groups also read, for plugins written against earlier fedhier versions.
LEGACY_ENTRY_POINT_GROUPS = ("fedhier.tree.grouping",)

BUILTIN_GROUPINGS: dict[str, Grouping] = {
    "random": random_grouping,
    "contiguous": contiguous_grouping,
    "min-divergence": min_divergence_grouping,
    "max-divergence": max_divergence_grouping,
    "edge-tag": edge_tag_grouping,
}
#: Needs the clients' gradients at the current model: built with make_gradient_grouping.
GRADIENT_GROUPING = "gradient"


def _plugins() -> dict[str, EntryPoint]:
    """Plugin name -> entry point; the first one found wins a name declared twice."""
    found: dict[str, EntryPoint] = {}
    for group in (ENTRY_POINT_GROUP, *LEGACY_ENTRY_POINT_GROUPS):
        for ep in entry_points(group=group):
            found.setdefault(ep.name, ep)
    return found


def plugin_origin(ep: EntryPoint) -> str:
    """How errors name a plugin's code: "package mypkg 0.1 (mypkg.grouping:func)"."""
    dist = getattr(ep, "dist", None)
    if dist is None and ep.name == ep.value:
        return f"module reference {ep.value}"
    package = f"package {dist.name} {dist.version}" if dist is not None else "unknown package"
    return f"{package} ({ep.value})"


def _entry(name: str) -> EntryPoint:
    """The entry point of plugin ``name``: an installed one, or ``module:function`` itself."""
    found = _plugins().get(name)
    return found if found is not None else EntryPoint(name, name, ENTRY_POINT_GROUP)


def load_plugin(name: str) -> Grouping:
    """Import the plugin grouping ``name``; any failure is a one-line ConfigError naming it."""
    ep = _entry(name)
    try:
        function = ep.load()
    except Exception as exc:  # a broken plugin is its author's to fix: say which one
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise ConfigError(f"grouping plugin '{name}' from {plugin_origin(ep)} failed to "
                          f"import: {why}; fix or uninstall that package") from exc
    if not callable(function):
        raise ConfigError(f"grouping plugin '{name}' from {plugin_origin(ep)} is a "
                          f"{type(function).__name__}, not a function (info, num_groups, seed)")
    return function  # type: ignore[no-any-return]


def available_groupings() -> list[str]:
    """Built-in grouping names followed by installed plugin names."""
    builtin = [*BUILTIN_GROUPINGS, GRADIENT_GROUPING]
    return builtin + sorted(set(_plugins()) - set(builtin))


def get_grouping(name: str) -> Grouping:
    """The grouping function registered under ``name``."""
    if name == GRADIENT_GROUPING:
        raise ConfigError("the 'gradient' grouping needs client gradients: build it with "
                          "fedhier.tree.grouping.make_gradient_grouping(grads)")
    if name in BUILTIN_GROUPINGS:
        return BUILTIN_GROUPINGS[name]
    if name in _plugins() or ":" in name:
        return load_plugin(name)
    raise ConfigError(
        f"unknown grouping '{name}'; choose one of {', '.join(available_groupings())}")


def grouping_needs(name: str) -> frozenset[str]:
    """What the grouping ``name`` needs from the clients: a subset of
    ``fedhier.tree.grouping.base.NEEDS`` ("labels", "gradients", "edge-tags")."""
    if name == GRADIENT_GROUPING:
        return frozenset({"gradients"})
    return needs_of(get_grouping(name))


def assign_groups(grouping: str | Grouping, info: ClientInfo, num_groups: int,
                  seed: int) -> np.ndarray:
    """Run a grouping (by name, or a function) and check its result: int64 [n] covering
    every group."""
    if num_groups > info.num_clients:
        raise ConfigError(
            f"more groups ({num_groups}) than clients ({info.num_clients})")
    function = get_grouping(grouping) if isinstance(grouping, str) else grouping
    name = grouping if isinstance(grouping, str) else getattr(grouping, "__name__", "custom")
    result = np.asarray(function(info, num_groups, seed))
    if result.shape != (info.num_clients,) or not np.issubdtype(result.dtype, np.integer):
        raise ConfigError(
            f"grouping '{name}' must return {info.num_clients} integer group ids, "
            f"got shape {result.shape} dtype {result.dtype}")
    if result.min(initial=0) < 0 or result.max(initial=0) >= num_groups or len(
            np.unique(result)) != num_groups:
        raise ConfigError(
            f"grouping '{name}' must use every group id 0..{num_groups - 1} at least once")
    return result.astype(np.int64)


__all__ = [
    "ClientInfo", "Grouping", "available_groupings", "assign_groups", "balanced_sizes",
    "get_grouping", "grouping_needs", "declares", "BUILTIN_GROUPINGS", "ENTRY_POINT_GROUP",
    "GRADIENT_GROUPING", "LEGACY_ENTRY_POINT_GROUPS", "load_plugin", "make_gradient_grouping",
    "plugin_origin",
]

"""Client -> edge groupings: a registry of built-ins plus plugins.

Plugins are found through the Python entry point group ``fedhier.grouping``: an entry
``name = "package.module:function"`` makes ``--grouping name`` call that function, which must
follow :class:`fedhier.grouping.base.Grouping`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import numpy as np

from fedhier.errors import ConfigError
from fedhier.grouping.base import ClientInfo, Grouping, balanced_sizes, declares, needs_of
from fedhier.grouping.divergence import (
    make_gradient_grouping,
    max_divergence_grouping,
    min_divergence_grouping,
)
from fedhier.grouping.simple import contiguous_grouping, edge_tag_grouping, random_grouping

ENTRY_POINT_GROUP = "fedhier.grouping"

BUILTIN_GROUPINGS: dict[str, Grouping] = {
    "random": random_grouping,
    "contiguous": contiguous_grouping,
    "min-divergence": min_divergence_grouping,
    "max-divergence": max_divergence_grouping,
    "edge-tag": edge_tag_grouping,
}
#: Needs the clients' gradients at the current model: built with make_gradient_grouping.
GRADIENT_GROUPING = "gradient"


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_groupings() -> list[str]:
    """Built-in grouping names followed by installed plugin names."""
    builtin = [*BUILTIN_GROUPINGS, GRADIENT_GROUPING]
    return builtin + sorted(set(_plugins()) - set(builtin))


def get_grouping(name: str) -> Grouping:
    """The grouping function registered under ``name``."""
    if name == GRADIENT_GROUPING:
        raise ConfigError("the 'gradient' grouping needs client gradients: build it with "
                          "fedhier.grouping.make_gradient_grouping(grads)")
    if name in BUILTIN_GROUPINGS:
        return BUILTIN_GROUPINGS[name]
    plugins = _plugins()
    if name in plugins:
        try:
            return plugins[name].load()  # type: ignore[attr-defined, no-any-return]
        except Exception as exc:  # a broken plugin is the user's problem to fix: say so
            raise ConfigError(f"grouping plugin '{name}' failed to load: {exc}") from exc
    raise ConfigError(
        f"unknown grouping '{name}'; choose one of {', '.join(available_groupings())}")


def grouping_needs(name: str) -> frozenset[str]:
    """What the grouping ``name`` needs from the clients: a subset of
    ``fedhier.grouping.base.NEEDS`` ("labels", "gradients", "edge-tags")."""
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
    "GRADIENT_GROUPING",
    "make_gradient_grouping",
]

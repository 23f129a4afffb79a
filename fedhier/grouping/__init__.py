"""Client -> edge groupings: a registry of built-ins plus plugins.

Plugins are found through the Python entry point group ``fedhier.grouping``: an entry
``name = "package.module:function"`` makes ``--grouping name`` call that function, which must
follow :class:`fedhier.grouping.base.Grouping`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import numpy as np

from fedhier.errors import ConfigError
from fedhier.grouping.base import ClientInfo, Grouping, balanced_sizes
from fedhier.grouping.simple import contiguous_grouping, random_grouping

ENTRY_POINT_GROUP = "fedhier.grouping"

BUILTIN_GROUPINGS: dict[str, Grouping] = {
    "random": random_grouping,
    "contiguous": contiguous_grouping,
}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_groupings() -> list[str]:
    """Built-in grouping names followed by installed plugin names."""
    return list(BUILTIN_GROUPINGS) + sorted(set(_plugins()) - set(BUILTIN_GROUPINGS))


def get_grouping(name: str) -> Grouping:
    """The grouping function registered under ``name``."""
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


def assign_groups(name: str, info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """Run a grouping and check its result: int64 [n] covering every group."""
    if num_groups > info.num_clients:
        raise ConfigError(
            f"more groups ({num_groups}) than clients ({info.num_clients})")
    result = np.asarray(get_grouping(name)(info, num_groups, seed))
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
    "get_grouping", "BUILTIN_GROUPINGS", "ENTRY_POINT_GROUP",
]

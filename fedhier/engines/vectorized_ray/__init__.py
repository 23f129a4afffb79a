"""Engine ``vectorized-ray``: the batched engine sharded by edge over a Ray cluster
(:mod:`fedhier.engines.vectorized_ray.engine`): the driver's executor, the workers and their
shards, clients moving between shards, and asynchronous edges."""

import importlib as _importlib
import warnings as _warnings
from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    """The last release's module ``fedhier.engines.vectorized_ray`` is this package's ``engine``:
    its names still resolve here, with a DeprecationWarning, for one release."""
    engine = _importlib.import_module(__name__ + ".engine")
    if name.startswith("__") or not hasattr(engine, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(f"{__name__}.{name} is {__name__}.engine.{name}; the old name goes in the "
                   "next release", DeprecationWarning, stacklevel=2)
    return getattr(engine, name)

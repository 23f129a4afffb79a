"""Engine ``vectorized`` (the batched engine): every client of an edge round as one batched
tensor computation (:mod:`fedhier.engines.vectorized.engine`), its kernels, chunks of whole
edges, and seeds batched into one computation."""

import importlib as _importlib
import warnings as _warnings
from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    """The last release's module ``fedhier.engines.vectorized`` is this package's ``engine``:
    its names still resolve here, with a DeprecationWarning, for one release."""
    engine = _importlib.import_module(__name__ + ".engine")
    if name.startswith("__") or not hasattr(engine, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(f"{__name__}.{name} is {__name__}.engine.{name}; the old name goes in the "
                   "next release", DeprecationWarning, stacklevel=2)
    return getattr(engine, name)

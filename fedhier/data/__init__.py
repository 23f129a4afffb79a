"""fedhier's data layer: load a dataset (`load_data`) and split it among clients.

`load_data` returns a `DataBundle` (train/test ``datasets.Dataset`` with columns ``x``,
``label`` and optionally ``client_id``); `partition_clients` returns per-client row
indices into ``bundle.train``. See docs/data.md.

The names below are imported on first use (PEP 562): importing a submodule such as
``fedhier.data.specs`` (the dataset cards, which the command line checks before any work)
does not load Hugging Face ``datasets``, scikit-learn or flwr-datasets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedhier.data.bundle import DataBundle, majority_baseline
    from fedhier.data.loaders import available_datasets, clear_cache, load_data
    from fedhier.data.partition import (
        PARTITION_SCHEMES,
        auto_min_partition_size,
        label_histogram,
        partition_clients,
    )
    from fedhier.data.synthetic import make_synthetic

#: name -> the module that defines it
_SOURCES = {
    "DataBundle": "bundle", "majority_baseline": "bundle",
    "available_datasets": "loaders", "clear_cache": "loaders", "load_data": "loaders",
    "PARTITION_SCHEMES": "partition", "auto_min_partition_size": "partition",
    "label_histogram": "partition", "partition_clients": "partition",
    "make_synthetic": "synthetic",
}

__all__ = [
    "PARTITION_SCHEMES",
    "DataBundle",
    "auto_min_partition_size",
    "available_datasets",
    "clear_cache",
    "label_histogram",
    "load_data",
    "majority_baseline",
    "make_synthetic",
    "partition_clients",
]


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'fedhier.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedhier.data.{_SOURCES[name]}"), name)
    globals()[name] = value
    return value

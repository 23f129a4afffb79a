"""fedhier's data layer: load a dataset (`load_data`) and split it among clients.

`load_data` returns a `DataBundle` (train/test ``datasets.Dataset`` with columns ``x``,
``label`` and optionally ``client_id``); `partition_clients` returns per-client row
indices into ``bundle.train``. See docs/data.md.
"""

from fedhier.data.bundle import DataBundle, majority_baseline
from fedhier.data.loaders import available_datasets, clear_cache, load_data
from fedhier.data.partition import (
    PARTITION_SCHEMES,
    auto_min_partition_size,
    label_histogram,
    partition_clients,
)
from fedhier.data.synthetic import make_synthetic

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

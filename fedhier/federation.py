"""A configured federation's data: the dataset, its client partition, and per-client tensors.

Server and clients build it from the same config, so both see the same partition. It is cached
per process (a Simulation Engine actor builds it once, not once per message).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from fedhier.config import RunConfig
from fedhier.data import DataBundle, label_histogram, load_data, partition_clients


@dataclass
class Federation:
    """The data of one federation: ``partitions[j]`` are client j's row indices in train."""

    bundle: DataBundle
    partitions: list[np.ndarray]
    _tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False)

    @property
    def num_clients(self) -> int:
        return len(self.partitions)

    def client_sizes(self) -> np.ndarray:
        """int64 [n]: rows per client."""
        return np.array([len(p) for p in self.partitions], dtype=np.int64)

    @functools.cached_property
    def label_histograms(self) -> np.ndarray:
        """int64 [n, num_classes]: rows per label on each client."""
        _, y = self.bundle.train_arrays()
        return np.stack([label_histogram(y[p], self.bundle.num_classes) for p in self.partitions])

    def client_tensors(self, client: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s training data: x float32 [m, *input_shape], y int64 [m]."""
        key = (client, str(device))
        if key not in self._tensors:
            x, y = self.bundle.train_arrays()
            rows = self.partitions[client]
            self._tensors[key] = (torch.as_tensor(x[rows], device=device),
                                  torch.as_tensor(y[rows], device=device))
        return self._tensors[key]

    def test_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out test set: x float32 [m, *input_shape], y int64 [m]."""
        key = (-1, str(device))
        if key not in self._tensors:
            x, y = self.bundle.test_arrays()
            self._tensors[key] = (torch.as_tensor(x, device=device),
                                  torch.as_tensor(y, device=device))
        return self._tensors[key]


@functools.lru_cache(maxsize=4)
def _build(dataset: str, data_path: str, seed: int, partition: str, clients: int, alpha: float,
           min_partition_size: int, self_balancing: bool, classes_per_client: int) -> Federation:
    bundle = load_data(dataset, seed=seed, data_path=data_path or None)
    partitions = partition_clients(
        bundle, partition, clients, seed=seed, alpha=alpha,
        min_partition_size=min_partition_size, self_balancing=self_balancing,
        classes_per_client=classes_per_client)
    return Federation(bundle=bundle, partitions=partitions)


def federation_for(cfg: RunConfig) -> Federation:
    """The (cached) federation that ``cfg`` describes."""
    return _build(cfg.dataset, cfg.data_path, cfg.seed, cfg.partition, cfg.clients, cfg.alpha,
                  cfg.min_partition_size, cfg.self_balancing, cfg.classes_per_client)

"""A configured federation's data: the dataset, its client partition, and per-client tensors.

Server and clients build it from the same config, so both see the same partition. It is cached
per process (a Simulation Engine actor builds it once, not once per message).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from fedhier.common.rng import generator
from fedhier.data import (
    DataBundle,
    auto_min_partition_size,
    label_histogram,
    load_data,
    partition_clients,
)
from fedhier.settings.run_config import RunConfig


@dataclass
class Federation:
    """The data of one federation.

    ``partitions[j]`` are client j's training row indices in ``bundle.train``; with a per-client
    holdout, ``holdouts[j]`` are the rows of its partition held out for per-client evaluation
    (disjoint from ``partitions[j]``), else empty.
    """

    bundle: DataBundle
    partitions: list[np.ndarray]
    holdouts: list[np.ndarray] = field(default_factory=list)
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
        """Client ``client``'s training data: x [m, *input_shape] (the bundle's ``x_dtype``),
        y int64 [m]."""
        key = (client, str(device))
        if key not in self._tensors:
            x, y = self.bundle.train_arrays()
            rows = self.partitions[client]
            self._tensors[key] = (torch.as_tensor(x[rows], device=device),
                                  torch.as_tensor(y[rows], device=device))
        return self._tensors[key]

    def holdout_tensors(self, client: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s held-out rows: x [h, *input_shape], y [h] (h may be 0)."""
        key = (-2 - client, str(device))
        if key not in self._tensors:
            x, y = self.bundle.train_arrays()
            rows = self.holdouts[client] if self.holdouts else np.zeros(0, dtype=np.int64)
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


def split_holdout(rows: np.ndarray, fraction: float, seed: int,
                  client: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a client's rows into (train, holdout) by a seeded draw; both sorted.

    The holdout gets round(fraction * m) rows, at least one when fraction > 0, and the
    client keeps at least one training row.
    """
    if fraction <= 0 or len(rows) < 2:
        return rows, np.zeros(0, dtype=np.int64)
    size = min(max(1, round(fraction * len(rows))), len(rows) - 1)
    perm = generator(seed, "holdout", client).permutation(len(rows))
    return np.sort(rows[perm[size:]]), np.sort(rows[perm[:size]])


@functools.lru_cache(maxsize=4)
def _build(dataset: str, data_path: str, seed: int, partition: str, clients: int, alpha: float,
           min_partition_size: int, self_balancing: bool, classes_per_client: int,
           client_holdout: float) -> Federation:
    bundle = load_data(dataset, seed=seed, data_path=data_path or None)
    partitions = partition_clients(
        bundle, partition, clients, seed=seed, alpha=alpha,
        min_partition_size=min_partition_size, self_balancing=self_balancing,
        classes_per_client=classes_per_client)
    if client_holdout > 0:
        splits = [split_holdout(rows, client_holdout, seed, j) for j, rows in enumerate(partitions)]
        return Federation(bundle=bundle, partitions=[s[0] for s in splits],
                          holdouts=[s[1] for s in splits])
    return Federation(bundle=bundle, partitions=partitions)


def federation_for(cfg: RunConfig) -> Federation:
    """The (cached) federation that ``cfg`` describes."""
    return _build(cfg.dataset, cfg.data_path, cfg.seed, cfg.partition, cfg.clients, cfg.alpha,
                  cfg.min_partition_size, cfg.self_balancing, cfg.classes_per_client,
                  cfg.client_holdout)


def resolved(cfg: RunConfig, train_rows: int | None = None) -> RunConfig:
    """``cfg`` with an auto ``min_partition_size`` (0) of a Dirichlet partition replaced by
    the value the partition uses (:func:`fedhier.data.auto_min_partition_size`, from the
    dataset's ``train_rows``; loaded, and cached in-process, when not given). Other configs
    as they are."""
    if cfg.min_partition_size or cfg.partition != "dirichlet":
        return cfg
    if train_rows is None:
        train_rows = len(load_data(cfg.dataset, seed=cfg.seed,
                                   data_path=cfg.data_path or None).train)
    return cfg.replace(
        min_partition_size=auto_min_partition_size(train_rows, cfg.clients, cfg.alpha))

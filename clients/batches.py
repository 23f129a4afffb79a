"""The round a ClientApp message asks for, and exactly its mini-batches.

:func:`round_info` reads the contract's per-message keys (docs/contract.md);
:func:`batch_stream` yields the ``local-steps`` mini-batches of this client's edge round in
fedhier's seeded order (:func:`fedhier.local.train.batch_indices`, a pure function of seed,
partition id and global step), from tensors, a dataset or a DataLoader's dataset. Part of
:mod:`fedhier.clients.adapter`, which re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message
from torch.utils.data import DataLoader, TensorDataset

from fedhier.local.train import batch_indices


@dataclass(frozen=True)
class RoundInfo:
    """The per-message keys of a train message (docs/contract.md, "Train message").

    ``local_steps``: SGD steps to run; ``start_step``: global index (0-based) of the first
    one; ``edge_round`` and ``server_round``: 1-based; ``config``: the whole ConfigRecord
    (your ``train_config`` plus these).
    """

    local_steps: int
    start_step: int
    edge_round: int
    server_round: int
    config: ConfigRecord

    def get(self, key: str, default: Any = None) -> Any:
        """A key of the ServerApp's ``train_config`` (e.g. ``"lr"``)."""
        return self.config.get(key, default)


def _config(msg: Message, config_key: str = "config") -> ConfigRecord:
    """The message's ConfigRecord (empty when it has none)."""
    return msg.content.config_records.get(config_key, ConfigRecord())


def _num(config: Mapping[str, Any], key: str, default: Any) -> Any:
    return config.get(key, default)


def round_info(msg: Message, config_key: str = "config") -> RoundInfo:
    """Read the contract's per-message keys from a train message.

    A message without ``local-steps`` (not from HierFedAvg) raises a ``KeyError`` naming it.
    """
    config = _config(msg, config_key)
    if "local-steps" not in config:
        raise KeyError("train message has no 'local-steps': it was not sent by HierFedAvg "
                       "(see docs/contract.md)")
    steps = int(config["local-steps"])  # type: ignore[arg-type]
    server_round = int(_num(config, "server-round", 1))
    return RoundInfo(
        local_steps=steps,
        start_step=int(_num(config, "start-step", (server_round - 1) * steps)),
        edge_round=int(_num(config, "edge-round", server_round)),
        server_round=server_round,
        config=config,
    )


def _seed_of(msg: Message, context: Context, seed: int | None, config_key: str) -> int:
    if seed is not None:
        return int(seed)
    config = _config(msg, config_key)
    if "seed" in config:
        return int(config["seed"])  # type: ignore[arg-type]
    return int(_num(context.run_config, "seed", 0))


def partition_id_of(context: Context) -> int:
    """This node's ``partition-id`` (its client index on every Flower engine)."""
    if "partition-id" not in context.node_config:
        raise KeyError("node config has no 'partition-id': start each SuperNode with "
                       "--node-config \"partition-id=i num-partitions=n\"")
    return int(context.node_config["partition-id"])  # type: ignore[arg-type]


class BatchStream:
    """The mini-batches of one edge round: ``len(self)`` == ``local-steps``.

    ``indices`` [steps, b] are rows of the client's data (fedhier's order); iterating yields
    ``fetch(rows)`` for each step: ``(x[rows], y[rows])`` for tensors, your DataLoader's
    collated batch for a dataset. Like a DataLoader it has ``dataset`` (all the client's
    rows, so ``len(stream.dataset)`` is its ``num-examples``) and ``batch_size``.

    It can be iterated **once**: the server asked for ``local-steps`` steps, so a second pass
    (e.g. a training loop with ``local-epochs`` > 1) raises instead of silently running more.
    """

    def __init__(self, indices: np.ndarray, fetch: Callable[[list[int]], Any],
                 num_rows: int, dataset: Any = None) -> None:
        self.indices = indices
        self._fetch = fetch
        self.num_rows = num_rows
        self.dataset = dataset
        self.batch_size = indices.shape[1] if indices.ndim == 2 else 0
        self._used = False

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Any]:
        if self._used:
            raise RuntimeError(
                "this edge round's mini-batches were already used: HierFedAvg asks for "
                f"local-steps = {len(self)} SGD steps, one pass over the stream (train for "
                "one epoch, e.g. local-epochs = 1)")
        self._used = True
        for rows in self.indices:
            yield self._fetch(rows.tolist())


def _tensor_fetch(tensors: Sequence[torch.Tensor]) -> Callable[[list[int]], Any]:
    def fetch(rows: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(rows, dtype=torch.long, device=tensors[0].device)
        return tuple(t[index] for t in tensors)
    return fetch


def _dataset_fetch(dataset: Any, collate: Callable[[Any], Any]) -> Callable[[list[int]], Any]:
    # What torch's DataLoader does for a map-style dataset (its _MapDatasetFetcher).
    getitems = getattr(dataset, "__getitems__", None)

    def fetch(rows: list[int]) -> Any:
        items = getitems(rows) if getitems is not None else [dataset[i] for i in rows]
        return collate(items)
    return fetch


def batch_stream(msg: Message, context: Context, data: Any, batch_size: int | None = None,
                 *, seed: int | None = None, config_key: str = "config") -> BatchStream:
    """The ``local-steps`` mini-batches this client trains on in this edge round.

    ``data`` is what your code trains on: a ``DataLoader`` (its dataset, ``batch_size`` and
    ``collate_fn`` are used; its sampler/shuffle is not), a map-style dataset (torch or
    Hugging Face, batches collated like a DataLoader's), or a tuple of tensors ``(x, y, ...)``
    with the rows in the first dimension (yields tuples of row-sliced tensors).

    Mini-batch rows are ``fedhier.local.train.batch_indices(seed, partition-id, num_rows,
    batch_size, start-step, local-steps)``: the same rows fedhier's own ClientApp uses, a
    function of (seed, client, global step) only. ``batch_size`` 0 (or >= rows) is the full
    batch. ``seed``: this argument, else ``seed`` in the message config, else in
    ``context.run_config``, else 0.
    """
    info = round_info(msg, config_key)
    client = partition_id_of(context)
    fetch: Callable[[list[int]], Any]
    if isinstance(data, DataLoader):
        if batch_size is None:
            batch_size = data.batch_size
        dataset = data.dataset
        fetch = _dataset_fetch(dataset, data.collate_fn)
        num_rows = len(dataset)  # type: ignore[arg-type]
    elif isinstance(data, tuple | list) and data and all(isinstance(t, torch.Tensor)
                                                         for t in data):
        num_rows = len(data[0])
        if any(len(t) != num_rows for t in data):
            raise ValueError("batch_stream: the tensors of data must have the same rows")
        fetch = _tensor_fetch(data)
        dataset = TensorDataset(*data)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        from torch.utils.data import default_collate

        num_rows = len(data)
        fetch = _dataset_fetch(data, default_collate)
        dataset = data
    else:
        raise TypeError(f"batch_stream: cannot read rows from {type(data).__name__}; pass a "
                        "DataLoader, a map-style dataset or a tuple of tensors")
    if batch_size is None:
        raise ValueError("batch_stream: pass batch_size (it cannot be read from the data)")
    if num_rows == 0:
        raise ValueError(f"batch_stream: client {client} has no rows to train on")
    indices = batch_indices(_seed_of(msg, context, seed, config_key), client, num_rows,
                            int(batch_size), info.start_step, info.local_steps)
    return BatchStream(indices, fetch, num_rows, dataset)


def rows_fetcher(data: Any) -> Callable[[list[int]], Any]:
    """``rows -> batch`` for a DataLoader's dataset, a tuple of tensors or a dataset."""
    if isinstance(data, DataLoader):
        return _dataset_fetch(data.dataset, data.collate_fn)
    if isinstance(data, tuple | list) and data and isinstance(data[0], torch.Tensor):
        return _tensor_fetch(data)
    from torch.utils.data import default_collate

    return _dataset_fetch(data, default_collate)


def count_rows(data: Any) -> int:
    """The number of rows of a DataLoader's dataset, a tuple of tensors or a dataset."""
    if isinstance(data, DataLoader):
        return len(data.dataset)  # type: ignore[arg-type]
    if isinstance(data, tuple | list) and data and isinstance(data[0], torch.Tensor):
        return len(data[0])
    return len(data)

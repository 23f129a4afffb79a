"""Tensors <-> Flower ArrayRecords, decoding each distinct record once per process.

An ArrayRecord holds .npy bytes: building one encodes, ``to_torch_state_dict`` decodes. In one
process (engine ``inprocess``) the strategy sends the same edge record object to every client
of the edge, and a client's reply record reaches the strategy as the very object the client
built, so each record needs decoding at most once, and one built by :func:`to_record` none.
Across processes (Ray, the Deployment Engine) records arrive as new objects and are decoded as
before.

The cache cannot change a number: an entry is found by the record's identity, is used only
while the record still holds the same keys and Array contents (``data`` bytes, dtype, shape,
stype) it was filled from, keeps private copies of the tensors and hands out fresh copies.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

#: What an entry was filled from: (key, data, dtype, shape, stype) per Array, in order.
Snapshot = tuple[tuple[str, bytes, str, tuple[int, ...], str], ...]


class _Entry:
    __slots__ = ("ref", "snapshot", "tensors")

    def __init__(self, ref: weakref.ref[ArrayRecord], snapshot: Snapshot,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.ref = ref
        self.snapshot = snapshot
        self.tensors = tensors


_CACHE: dict[int, _Entry] = {}


def _snapshot(record: ArrayRecord) -> Snapshot | None:
    """The record's contents by value (None if an Array's data is not immutable bytes)."""
    out = []
    for key, array in record.items():
        if type(array.data) is not bytes:  # a mutable buffer could change under the cache
            return None
        out.append((key, array.data, array.dtype, array.shape, array.stype))
    return tuple(out)


def _remember(record: ArrayRecord, tensors: dict[str, torch.Tensor]) -> None:
    snapshot = _snapshot(record)
    if snapshot is None:
        return
    key = id(record)

    def forget(ref: weakref.ref[ArrayRecord]) -> None:
        entry = _CACHE.get(key)
        if entry is not None and entry.ref is ref:
            _CACHE.pop(key, None)

    _CACHE[key] = _Entry(weakref.ref(record, forget), snapshot, tensors)


def _npy(array: np.ndarray) -> bytes:
    """``np.save(buffer, array, allow_pickle=False)``'s bytes for a C-contiguous array of a
    plain numeric dtype: its header (cached by dtype and shape) and the raw data."""
    key = (array.dtype.str, array.shape)
    header = _NPY_HEADERS.get(key)
    if header is None:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        data = buffer.getvalue()
        _NPY_HEADERS[key] = data[:len(data) - array.nbytes]
        return data
    return header + array.tobytes()


_NPY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord(tensors)`` (detached, on the CPU: the same bytes), remembered for
    :func:`to_tensors`."""
    cpu = {k: v.detach().cpu() for k, v in tensors.items()}
    # .npy keeps only C- or Fortran-ordered data; take the fast path (and cache) only for
    # C-ordered plain numbers, which decode to the same layout.
    if not all(v.is_contiguous() and v.dtype in _PLAIN_DTYPES for v in cpu.values()):
        return ArrayRecord(cpu)
    record = ArrayRecord()
    for key, tensor in cpu.items():
        array = tensor.numpy()
        record[key] = Array(dtype=str(array.dtype), shape=tuple(array.shape),
                            stype=SType.NUMPY, data=_npy(array))
    _remember(record, {k: v.clone(memory_format=torch.contiguous_format)
                       for k, v in cpu.items()})
    return record


#: torch dtypes whose .npy form is the raw bytes behind a one-string header.
_PLAIN_DTYPES = frozenset({
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})


def to_tensors(record: ArrayRecord, remember: bool = True) -> dict[str, torch.Tensor]:
    """The record's tensors on the CPU, equal to ``record.to_torch_state_dict()``'s, never
    shared with the cache or an earlier call.

    ``remember=False`` when the record will not be decoded again (it is still served from
    the cache when there): saves the cache's copy.
    """
    entry = _CACHE.get(id(record))
    if entry is not None and entry.ref() is record and entry.snapshot == _snapshot(record):
        return {k: v.clone() for k, v in entry.tensors.items()}
    tensors = dict(record.to_torch_state_dict())
    if not remember:
        return tensors
    _remember(record, tensors)
    return {k: v.clone() for k, v in tensors.items()}


def cache_size() -> int:
    """Number of records with cached tensors (for tests)."""
    return len(_CACHE)

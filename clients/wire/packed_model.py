"""A model as ONE object of a Flower message, on the hops between fedhier's own processes.

Flower 1.42 moves a message object by object, one request per object at each of a message's
six hops (docs/deployment.md#latency). A model of T tensors as Flower's ArrayRecord is 1 + 2T
objects (the record, and per tensor an Array and an ArrayChunk): 9 for the default MLP.
Packed, it is one ConfigRecord holding one ``bytes`` value, the "blob":

    MAGIC (8 bytes) | header length (uint32, little-endian) | header | data

``header``: UTF-8 JSON ``[[name, dtype, shape], ...]`` in the model's order (``dtype``: NumPy's
``dtype.str``, e.g. ``"<f4"``); ``data``: each tensor's bytes in C order, concatenated in the
header's order. Decoding is exact (the same bytes, dtypes, shapes and names).

Only fedhier's own ends read it: an edge server and fedhier's ClientApp (which says so in its
profile reply, :data:`READS_PACKED`), the cloud and its edge servers. Anything else (a user's
``--app``, Flower's strategies) gets Flower's per-tensor ArrayRecord, and every reader here
takes either form (:func:`get_model`). A model whose blob would exceed Flower's own chunk size
(``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``, 5 MiB: the most Flower sends in one request) or that
holds a dtype outside :data:`PACKABLE` is sent as an ArrayRecord too (:func:`model_record`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

from fedhier.clients.wire.array_records import to_record, to_tensors

#: The first bytes of a blob (format version 1).
MAGIC = b"FHPM\x00\x01\r\n"
#: The ConfigRecord key holding the blob.
BLOB_KEY = "fedhier-packed-model"
#: The profile reply's metric by which a client says it reads (and answers in) this format.
READS_PACKED = "packed-model"
#: The format version a reader of :data:`READS_PACKED` announces.
VERSION = 1
#: The largest blob sent packed (bytes): what Flower sends in one request (one ArrayChunk).
MAX_PACKED_BYTES = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

#: Tensor dtypes a blob holds: plain numbers, as NumPy's native ``dtype.str``.
PACKABLE: dict[torch.dtype, str] = {
    dtype: np.dtype(name).str for dtype, name in (
        (torch.float16, "float16"), (torch.float32, "float32"), (torch.float64, "float64"),
        (torch.complex64, "complex64"), (torch.complex128, "complex128"),
        (torch.int8, "int8"), (torch.int16, "int16"), (torch.int32, "int32"),
        (torch.int64, "int64"), (torch.uint8, "uint8"), (torch.bool, "bool"))}
_DTYPE_OF: dict[str, np.dtype] = {name: np.dtype(name) for name in PACKABLE.values()}
_LENGTH = struct.Struct("<I")
_HEADERS: dict[tuple[tuple[str, str, tuple[int, ...]], ...], bytes] = {}


class PackedModelError(ValueError):
    """A blob that is not a well-formed packed model."""


def pack(tensors: Mapping[str, torch.Tensor]) -> bytes | None:
    """The blob of ``tensors`` (detached, on the CPU); None when a dtype is not
    :data:`PACKABLE` or the blob would exceed :data:`MAX_PACKED_BYTES`."""
    arrays = []
    for name, tensor in tensors.items():
        if tensor.dtype not in PACKABLE:
            return None
        arrays.append((str(name), tensor.detach().cpu().numpy()))
    layout = tuple((name, a.dtype.str, tuple(int(d) for d in a.shape)) for name, a in arrays)
    header = _HEADERS.get(layout)
    if header is None:
        text = json.dumps([[n, d, list(s)] for n, d, s in layout]).encode("utf-8")
        header = MAGIC + _LENGTH.pack(len(text)) + text
        if len(_HEADERS) < 64:
            _HEADERS[layout] = header
    if len(header) + sum(a.nbytes for _, a in arrays) > MAX_PACKED_BYTES:
        return None
    return b"".join([header, *(a.tobytes(order="C") for _, a in arrays)])


def _layout(blob: bytes) -> tuple[list[tuple[str, np.dtype, tuple[int, ...]]], int]:
    """A blob's header: (name, dtype, shape) per tensor, and where its data starts."""
    if not isinstance(blob, bytes) or not blob.startswith(MAGIC):
        raise PackedModelError("not a packed model (bad magic bytes)")
    start = len(MAGIC) + _LENGTH.size
    if len(blob) < start:
        raise PackedModelError("packed model cut short in its header")
    (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    if start + length > len(blob):
        raise PackedModelError("packed model cut short in its header")
    try:
        layout = json.loads(blob[start:start + length].decode("utf-8"))
        entries = [(str(n), _DTYPE_OF[d], tuple(s)) for n, d, s in layout]
    except (ValueError, TypeError, KeyError) as exc:
        raise PackedModelError(f"packed model with a bad header: {exc}") from None
    return entries, start + length


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a blob (fresh CPU tensors, in the packed order); PackedModelError when
    ``blob`` is malformed (a bad header, a dtype outside :data:`PACKABLE`, data of the wrong
    length)."""
    entries, offset = _layout(blob)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in entries:
        if name in out or not all(type(d) is int and d >= 0 for d in shape):
            raise PackedModelError(f"packed model: repeated name or a shape that is not "
                                   f"whole numbers >= 0 at {name!r}")
        count = math.prod(shape)  # Python ints: no overflow
        end = offset + count * dtype.itemsize
        if end > len(blob):
            raise PackedModelError(f"packed model cut short in {name!r}")
        array = np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)
        out[name] = torch.from_numpy(array.copy())
        offset = end
    if offset != len(blob):
        raise PackedModelError(f"packed model with {len(blob) - offset} bytes after its data")
    return out


def model_record(tensors: Mapping[str, torch.Tensor], packed: bool) -> ConfigRecord | ArrayRecord:
    """The record of a model for a message: packed (a ConfigRecord holding the blob) when
    ``packed`` and :func:`pack` can, else Flower's ArrayRecord (:func:`to_record`). One
    record may go into many messages (Flower then stores it once)."""
    blob = pack(tensors) if packed else None
    return to_record(tensors) if blob is None else ConfigRecord({BLOB_KEY: blob})


def is_packed(content: RecordDict, key: str) -> bool:
    """Whether ``content[key]`` is a packed model."""
    record = content.config_records.get(key)
    return record is not None and BLOB_KEY in record


def has_model(content: RecordDict, key: str) -> bool:
    """Whether ``content`` holds a model at ``key``, in either form."""
    return key in content.array_records or is_packed(content, key)


def get_model(content: RecordDict, key: str, remember: bool = True) -> dict[str, torch.Tensor]:
    """The model at ``content[key]`` in either form (fresh CPU tensors). KeyError when there
    is none, PackedModelError when its blob is malformed. ``remember``: see
    :func:`fedhier.clients.wire.array_records.to_tensors` (ArrayRecords only)."""
    if is_packed(content, key):
        return unpack(content.config_records[key][BLOB_KEY])  # type: ignore[arg-type]
    return to_tensors(content.array_records[key], remember)


def declared_layout(content: RecordDict, key: str) -> dict[str, tuple[str, tuple, int]]:
    """name -> (dtype name, shape, bytes it carries) of the model at ``content[key]`` as its
    record declares them, read without decoding an array (a reply's shapes are checked
    before its arrays are converted: bounded memory). KeyError when there is none,
    PackedModelError when a blob's header is malformed."""
    if is_packed(content, key):
        blob = content.config_records[key][BLOB_KEY]
        entries, _ = _layout(blob)  # type: ignore[arg-type]
        return {name: (dtype.name, shape, math.prod(shape) * dtype.itemsize)
                for name, dtype, shape in entries}
    return {name: (str(array.dtype), tuple(array.shape), len(array.data))
            for name, array in content.array_records[key].items()}


def reads_packed(reply: Message) -> bool:
    """Whether a profile reply says its client reads packed models (:data:`READS_PACKED`)."""
    metrics = None if reply.has_error() else reply.content.metric_records.get("metrics")
    return metrics is not None and metrics.get(READS_PACKED) == VERSION

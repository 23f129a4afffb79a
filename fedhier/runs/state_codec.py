"""A run's state as tensors plus JSON: how checkpoints are stored without pickle.

:func:`encode` turns a state tree (dicts, lists, tuples, numbers, strings, tensors, NumPy
arrays and scalars, and objects of the *allowed* classes) into a JSON-able tree plus a flat
``name -> tensor`` dict (saved with safetensors); :func:`decode` reverses it exactly (floats
through ``repr``, arrays as their raw bytes). Reading never runs code from the file: an object
is rebuilt only for a class on the allow-list (fedhier's own state classes, and what the
strategy layer registers: the Flower cloud strategies fedhier builds), with ``cls.__new__`` and
its saved attributes, and a function only by name from the same list; a registered
:func:`adapter` type (Flower's ``ArrayRecord``) is stored as plain values and rebuilt by its
adapter. Anything else in a file is refused as damaged; anything else in a state being saved
is a :class:`TypeError` (a programming error: register the type first with :func:`allow`).

This module imports no Flower and nothing of the strategy layer: the layers that create
Flower objects register them when imported (``fedhier.strategies.cloud_step`` calls
:func:`allow` and :func:`adapter`), and whoever reads a checkpoint that may hold them imports
that layer first (:func:`fedhier.engines.resume.resumable_checkpoint`, the engines). A file naming
a class nobody registered is refused as damaged.
"""

from __future__ import annotations

import base64
import importlib
import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: The allowed classes and functions, by "module:qualname" (see :func:`_allowed`).
_EXTRA: dict[str, Any] = {}
_ALLOWED: dict[str, Any] | None = None
#: Adapters by name: (type, to plain values, from plain values).
_ADAPTERS: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}

#: fedhier's own allow-list: (module, names) imported on first use.
_BUILTIN = (
    ("fedhier.tree.hierarchy", ("Hierarchy",)),
    ("fedhier.round.asynchrony.edges", ("EdgeTraining",)),
)
#: Names checkpoints written by earlier releases hold -> today's (the modules moved and a
#: class was renamed: those checkpoints still resume).
_FORMER_NAMES = {
    "fedhier.topology:Hierarchy": "fedhier.tree.hierarchy:Hierarchy",
    "fedhier.async_edges:EdgeJob": "fedhier.round.asynchrony.edges:EdgeTraining",
    "fedhier.round.asynchrony.edges:EdgeJob": "fedhier.round.asynchrony.edges:EdgeTraining",
}


class StateFormatError(ValueError):
    """A stored state that is not one :func:`encode` writes (a damaged or foreign file)."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def allow(obj: type | Callable[..., Any]) -> None:
    """Allow a class (its instances are stored as their attributes) or a function (stored by
    name) in checkpoints, e.g. a custom Flower cloud strategy passed in code."""
    _EXTRA[_name(obj)] = obj


def former_name(old: str, new: str) -> None:
    """Read ``old`` ("module:qualname" an earlier release wrote) as ``new`` (an allowed name):
    the strategy layer renames its own classes this way."""
    _FORMER_NAMES[old] = new


def adapter(name: str, cls: type, to_plain: Callable[[Any], Any],
            from_plain: Callable[[Any], Any]) -> None:
    """Store instances of ``cls`` as ``to_plain(obj)`` (values this module stores) and rebuild
    them with ``from_plain`` (e.g. Flower's ArrayRecord as name -> NumPy array)."""
    _ADAPTERS[name] = (cls, to_plain, from_plain)


def _allowed() -> dict[str, Any]:
    global _ALLOWED
    if _ALLOWED is None:
        table = {}
        for module, names in _BUILTIN:
            loaded = importlib.import_module(module)
            for name in names:
                obj = getattr(loaded, name)
                table[_name(obj)] = obj
        _ALLOWED = table
    return {**_ALLOWED, **_EXTRA}


def encode(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able tree, tensors by name) of a state tree."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storages already stored: a shared one is copied (safetensors)

    def store(tensor: torch.Tensor, path: str) -> str:
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        key = f"{len(tensors)}:{path}"
        tensors[key] = tensor
        return key

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, torch.Tensor):
            return {"$tensor": store(v, path)}
        if isinstance(v, np.ndarray):
            if v.dtype.hasobject:
                raise TypeError(f"{path}: an object array cannot be checkpointed")
            raw = torch.frombuffer(bytearray(np.ascontiguousarray(v).tobytes()) or
                                   bytearray(1), dtype=torch.uint8)[:v.nbytes]
            return {"$ndarray": store(raw, path), "dtype": v.dtype.str, "shape": list(v.shape)}
        if isinstance(v, np.generic):
            return {"$npscalar": v.dtype.str, "value": enc(v.item(), path)}
        if isinstance(v, bytes):
            return {"$bytes": base64.b64encode(v).decode()}
        if isinstance(v, list):
            return [enc(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {"$tuple": [enc(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, f"{path}/{k}") for k, x in v.items()}
            return {"$dict": [[enc(k, path), enc(x, f"{path}/{k}")] for k, x in v.items()]}
        allowed = _allowed()
        for name, (cls, to_plain, _) in _ADAPTERS.items():
            if type(v) is cls:
                return {"$adapter": name, "value": enc(to_plain(v), path)}
        if isinstance(v, types.FunctionType | types.BuiltinFunctionType):
            if _name(v) not in allowed:
                raise TypeError(f"{path}: function {_name(v)} is not allowed in checkpoints "
                                "(fedhier.runs.state_codec.allow registers one)")
            return {"$function": _name(v)}
        cls_name = _name(type(v))
        if cls_name not in allowed or not hasattr(v, "__dict__"):
            raise TypeError(f"{path}: a {cls_name} cannot be checkpointed "
                            "(fedhier.runs.state_codec.allow registers a class)")
        return {"$object": cls_name, "state": enc(vars(v), path)}

    return enc(value, ""), tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state tree :func:`encode` was given; :class:`StateFormatError` on anything else."""
    allowed: dict[str, Any] | None = None

    def lookup(name: Any) -> Any:
        nonlocal allowed
        allowed = allowed if allowed is not None else _allowed()
        name = _FORMER_NAMES.get(name, name) if isinstance(name, str) else name
        if not isinstance(name, str) or name not in allowed:
            raise StateFormatError(f"names {str(name)[:80]!r}, not on the allow-list of "
                                   "classes checkpoints may hold (fedhier.runs.state_codec.allow)")
        return allowed[name]

    def tensor(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise StateFormatError(f"refers to a tensor {str(key)[:80]!r} it does not hold")
        return tensors[key]

    def dec(v: Any) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            raise StateFormatError(f"holds a {type(v).__name__}")
        markers = [k for k in v if k.startswith("$")]
        if not markers:
            return {k: dec(x) for k, x in v.items()}
        marker = markers[0]
        try:
            if marker == "$float":
                return float(v["$float"]) if v["$float"] in ("nan", "inf", "-inf") else \
                    _bad(v["$float"])
            if marker == "$tensor":
                return tensor(v["$tensor"])
            if marker == "$ndarray":
                dtype = np.dtype(v["dtype"])
                if dtype.hasobject:
                    raise StateFormatError("holds an object array")
                raw = tensor(v["$ndarray"]).numpy().tobytes()
                return np.frombuffer(raw, dtype=dtype).reshape(v["shape"]).copy()
            if marker == "$npscalar":
                return np.dtype(v["$npscalar"]).type(dec(v["value"]))
            if marker == "$bytes":
                return base64.b64decode(v["$bytes"], validate=True)
            if marker == "$tuple":
                return tuple(dec(x) for x in v["$tuple"])
            if marker == "$dict":
                return {_key(dec(k)): dec(x) for k, x in v["$dict"]}
            if marker == "$adapter":
                if v["$adapter"] not in _ADAPTERS:
                    raise StateFormatError(f"names an adapter {str(v['$adapter'])[:40]!r} "
                                           "fedhier does not have")
                return _ADAPTERS[v["$adapter"]][2](dec(v["value"]))
            if marker == "$function":
                function = lookup(v["$function"])
                if isinstance(function, type):
                    raise StateFormatError("names a class where a function belongs")
                return function
            if marker == "$object":
                cls = lookup(v["$object"])
                if not isinstance(cls, type):
                    raise StateFormatError("names a function where a class belongs")
                state = dec(v["state"])
                if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                    raise StateFormatError(f"holds a {cls.__name__} without attributes")
                obj: Any = object.__new__(cls)  # no __init__, no __setstate__: nothing runs
                obj.__dict__.update(state)
                return obj
        except StateFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFormatError(f"has a malformed {marker} entry ({type(exc).__name__})") \
                from None
        raise StateFormatError(f"has an unknown entry {marker[:40]!r}")

    return dec(tree)


def _bad(value: Any) -> float:
    raise StateFormatError(f"has a malformed number {str(value)[:40]!r}")


def _key(key: Any) -> Any:
    """A dict key must be hashable (a list is not: the file is damaged)."""
    try:
        hash(key)
    except TypeError:
        raise StateFormatError("has an unhashable dictionary key") from None
    return key

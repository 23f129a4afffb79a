"""Checkpoints: everything needed to continue a run exactly where it stopped.

``checkpoint.pt`` in the run folder (written atomically) holds the cloud round it was taken
after, the global model, the strategy's state (communication counters, the cloud strategy
object with its optimiser state), the clients' kept state (collected with ``query.state``
messages, so on every Flower engine; the vectorized engine keeps it in ``strategy_state``),
and the run's elapsed seconds. Randomness needs no saving: every draw is a
pure function of (seed, ids), so a resumed run draws exactly what the uninterrupted run would.

The file is a safetensors file, never a pickle: the tensors (and NumPy arrays, as raw bytes)
are its tensors, everything else is JSON in its header (:mod:`fedhier.runs.state_codec`), so
reading a checkpoint someone hands you runs no code from it. A checkpoint written by fedhier
before this format (a torch pickle) is refused in one line, never unpickled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from fedhier.common.errors import ConfigError, DamagedFileError, FedhierError, os_reason
from fedhier.runs.crash_points import crash_point
from fedhier.runs.folder import writing

CHECKPOINT = "checkpoint.pt"
#: The header key (safetensors metadata) holding the JSON part, and its format version.
FORMAT_KEY = "fedhier_checkpoint"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    round: int
    global_state: dict[str, torch.Tensor]
    strategy_state: dict[str, Any]
    wall_seconds: float
    client_states: dict[int, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)


def checkpoint_bytes(checkpoint: Checkpoint) -> bytes:
    """The file contents of a checkpoint: safetensors with the JSON state in its header."""
    from safetensors.torch import save

    from fedhier.runs.state_codec import encode

    tree, tensors = encode(checkpoint.__dict__)
    header = json.dumps({"version": FORMAT_VERSION, "state": tree}, allow_nan=False)
    return save(tensors, metadata={FORMAT_KEY: header})


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint.pt`` atomically (a reader never sees a half-written file)."""
    data = checkpoint_bytes(checkpoint)
    tmp = run_dir / f".{CHECKPOINT}.tmp"
    with writing(run_dir / CHECKPOINT):
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            crash_point()
            os.replace(tmp, run_dir / CHECKPOINT)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def read_checkpoint_file(path: Path) -> Checkpoint:
    """The checkpoint in file ``path``; a one-line :class:`DamagedFileError` if it is not a
    readable fedhier checkpoint. Never unpickles anything."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from fedhier.runs.state_codec import StateFormatError, decode

    remedy = "it cannot be resumed; rerun the run from the start"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DamagedFileError(path, f"cannot read the checkpoint ({os_reason(exc)})",
                               "check the file's permissions") from None
    # A safetensors file opens with its header's length (8 bytes, little-endian) and then
    # "{"; a length such as 0x580 also starts with 0x80, so the JSON brace decides.
    if data[8:9] != b"{" and (data[:2] == b"PK" or data[:1] == b"\x80"):
        raise DamagedFileError(path, "a pickled checkpoint (an older fedhier's format, or "
                               "something else's); fedhier never unpickles files",
                               "rerun the run from the start to get a safe checkpoint")
    try:
        tensors = load(data)
        metadata = _metadata(data)
    except (SafetensorError, ValueError, OverflowError, RuntimeError) as exc:
        raise DamagedFileError(path, f"damaged, not a fedhier checkpoint ({os_reason(exc)[:120]})",
                               remedy) from None
    if FORMAT_KEY not in metadata:
        raise DamagedFileError(path, "not a fedhier checkpoint (a safetensors file without "
                               "fedhier's state)", remedy)
    try:
        header = json.loads(metadata[FORMAT_KEY])
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            raise StateFormatError(f"has format version {str(header.get('version'))[:20]} "
                                   f"where fedhier reads {FORMAT_VERSION}"
                                   if isinstance(header, dict) else "has no header")
        state = decode(header.get("state"), tensors)
    except (ValueError, RecursionError) as exc:  # StateFormatError, JSON errors
        raise DamagedFileError(path, f"damaged: the checkpoint {exc}"
                               if isinstance(exc, StateFormatError) else
                               "damaged: its header is not JSON", remedy) from None
    names = {f.name for f in fields(Checkpoint)}
    required = {f.name for f in fields(Checkpoint) if f.default is MISSING
                and f.default_factory is MISSING}
    if not isinstance(state, dict) or not required <= state.keys() or \
            not state.keys() <= names:
        raise DamagedFileError(path, "not a fedhier checkpoint (damaged, or written by "
                               "something else)", remedy)
    if not isinstance(state["round"], int) or isinstance(state["round"], bool) or \
            not isinstance(state["global_state"], dict) or \
            not all(isinstance(v, torch.Tensor) for v in state["global_state"].values()) or \
            not isinstance(state["strategy_state"], dict) or \
            not isinstance(state["wall_seconds"], int | float) or \
            not isinstance(state.get("client_states", {}), dict):
        raise DamagedFileError(path, "damaged: no cloud round or global model in it", remedy)
    if not math.isfinite(state["wall_seconds"]) or state["wall_seconds"] < 0:
        raise DamagedFileError(path, "damaged: its elapsed seconds are not a duration", remedy)
    if any(v.is_floating_point() and not bool(torch.isfinite(v).all())
           for v in state["global_state"].values()):
        # a run never records such a model (non-finite updates stop it or are skipped)
        raise DamagedFileError(path, "damaged: its global model holds non-finite values",
                               remedy)
    if not _client_states_form(state.get("client_states", {})):
        raise DamagedFileError(path, "damaged: its clients' kept state is not tensors by "
                               "client and name", remedy)
    return Checkpoint(**state)


def _client_states_form(states: dict[Any, Any]) -> bool:
    """Whether ``states`` has one of the two forms engines write: name -> tensor [n, *shape]
    (the vectorized engine) or client id -> state name -> tensor name -> tensor (Flower)."""
    def tensors(value: Any) -> bool:
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())

    return tensors(states) or all(
        isinstance(client, int) and not isinstance(client, bool) and isinstance(kept, dict)
        and all(isinstance(name, str) and tensors(value) for name, value in kept.items())
        for client, kept in states.items())


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's JSON header (already validated by
    safetensors' own parser when the tensors were loaded)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("header metadata is not a table")
    return metadata


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """The checkpoint of a run folder; a one-line error if it is missing or damaged."""
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise ConfigError(f"{run_dir} has no {CHECKPOINT} to resume from (checkpoints are "
                          "written with --checkpoint-every K and on Ctrl-C)")
    if not path.is_file():
        raise DamagedFileError(path, "is not a file", "a checkpoint is a file; remove it")
    return read_checkpoint_file(path)


def resumed_checkpoint(run_dir: Path | str) -> Checkpoint | None:
    """What ``--resume`` continues from: the folder's checkpoint, or None (start again at
    round 0 in the same folder) when the run stopped before its first checkpoint or holds a
    round-0 one (checked by :func:`fedhier.engines.resume.resumable_checkpoint` beforehand)."""
    if not (Path(run_dir) / CHECKPOINT).exists():
        return None
    checkpoint = load_checkpoint(Path(run_dir))
    return checkpoint if checkpoint.round > 0 else None


def check_model(checkpoint: Checkpoint, state: dict[str, torch.Tensor], path: Path) -> None:
    """A one-line ConfigError unless the checkpoint's global model has the names and shapes
    of ``state`` (the run's model): a checkpoint of another run must not be resumed here."""
    saved = checkpoint.global_state
    if saved.keys() != state.keys() or any(saved[k].shape != state[k].shape or
                                           saved[k].dtype != state[k].dtype for k in state):
        raise ConfigError(f"{path / CHECKPOINT} holds another model than this run folder's "
                          "config.json describes; it does not belong to this run")


#: What restoring a state that does not fit the algorithm raises (a damaged or crafted file).
RESTORE_ERRORS = (TypeError, KeyError, AttributeError, ValueError, IndexError)


def restore_state(algorithm: Any, checkpoint: Checkpoint, run_dir: Path,
                  num_clients: int) -> None:
    """``algorithm.load_state_dict(checkpoint.strategy_state)``, after checking the parts the
    algorithm uses only later (the grouping, the simulated clock, the cloud step) fit a run of
    ``num_clients`` clients with ``algorithm``'s settings and cloud step. A damaged or crafted
    state is one :class:`DamagedFileError` naming checkpoint.pt, never a traceback.

    The one place a checkpoint's strategy state enters an algorithm: the CLI rehearses it on
    a fresh algorithm before the run starts (:func:`fedhier.engines.resume.resumable_checkpoint`),
    the engine does it for real (:func:`fedhier.runs.driver.run_recorded`)."""
    state = checkpoint.strategy_state
    try:
        _check_hierarchy_and_clock(state, algorithm.settings.groups,
                                   len(algorithm.settings.periods), num_clients)
        _check_same_kind(state.get("cloud_step"), algorithm.cloud_step)
        algorithm.load_state_dict(state)
    except FedhierError:
        raise
    except RESTORE_ERRORS as exc:
        raise DamagedFileError(Path(run_dir) / CHECKPOINT,
                               f"damaged: its strategy state does not fit this run "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())[:100]})",
                               "it cannot be resumed; rerun the run from the start") from None


def _check_hierarchy_and_clock(state: dict[str, Any], groups: tuple[int, ...], levels: int,
                               num_clients: int) -> None:
    """ValueError/TypeError unless the saved grouping is a valid tree of ``num_clients``
    clients in ``groups`` nodes per level over ``levels`` levels, and the saved clock holds
    one finite time per edge."""
    import numpy as np

    from fedhier.tree.hierarchy import Hierarchy

    hierarchy = state.get("hierarchy")
    edges = groups[0] if groups else 1
    if hierarchy is not None:
        if type(hierarchy) is not Hierarchy:
            raise TypeError(f"the grouping is a {type(hierarchy).__name__}")
        parents = tuple(hierarchy.parents)
        if not all(isinstance(p, np.ndarray) and p.dtype == np.int64 and p.ndim == 1
                   for p in parents):
            raise TypeError("the grouping's parents are not int64 vectors")
        tree = Hierarchy(tuple(int(p) for p in hierarchy.periods), parents,
                         int(hierarchy.num_edges))  # its own consistency checks
        sizes = [tree.num_nodes(level) for level in range(levels)]
        if sizes != [num_clients, *groups][:levels]:
            raise ValueError(f"a grouping of {sizes} nodes per level where this run has "
                             f"{[num_clients, *groups][:levels]}")
        edges = tree.num_nodes(1)
    clock = state.get("clock")
    if clock is not None:
        times = np.asarray(clock["edge_time"], dtype=np.float64)
        if times.shape != (edges,) or not np.isfinite(times).all():
            raise ValueError(f"a clock of shape {times.shape} for {edges} edge(s)")


def _check_same_kind(saved: Any, fresh: Any) -> None:
    """TypeError unless the saved cloud step is of the run's kind (None, or the same class
    holding the same class of Flower strategy, with at least a fresh one's attributes)."""
    if fresh is None or saved is None:
        if saved is not fresh:
            raise TypeError("the cloud step does not match the run's cloud strategy")
        return
    for a, b in ((saved, fresh), (getattr(saved, "strategy", None),
                                  getattr(fresh, "strategy", None))):
        if a is None and b is None:  # a cloud step without a Flower strategy inside
            continue
        if type(a) is not type(b) or not vars(b).keys() <= vars(a).keys():
            raise TypeError(f"the cloud step holds a {type(a).__name__} where this run has "
                            f"a {type(b).__name__}")

"""Checkpoints: everything needed to continue a run exactly where it stopped.

``checkpoint.pt`` in the run folder (written atomically) holds the cloud round it was taken
after, the global model, the strategy's state (communication counters, the cloud strategy
object with its optimiser state), the clients' kept state (collected with ``query.state``
messages, so on every Flower engine; the vectorized engine keeps it in ``strategy_state``),
and the run's elapsed seconds. Randomness needs no saving: every draw is a
pure function of (seed, ids), so a resumed run draws exactly what the uninterrupted run would.
"""

from __future__ import annotations

import io
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from fedhier.errors import ConfigError
from fedhier.run_folder import writing

CHECKPOINT = "checkpoint.pt"


@dataclass
class Checkpoint:
    round: int
    global_state: dict[str, torch.Tensor]
    strategy_state: dict[str, Any]
    wall_seconds: float
    client_states: dict[int, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint.pt`` atomically (a reader never sees a half-written file)."""
    buffer = io.BytesIO()
    torch.save(checkpoint.__dict__, buffer)
    tmp = run_dir / f".{CHECKPOINT}.tmp"
    with writing(run_dir / CHECKPOINT):
        try:
            with open(tmp, "wb") as handle:
                handle.write(buffer.getvalue())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, run_dir / CHECKPOINT)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """The checkpoint of a run folder; a one-line ConfigError if it is missing or damaged."""
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise ConfigError(f"{run_dir} has no {CHECKPOINT} to resume from (checkpoints are "
                          "written with --checkpoint-every K and on Ctrl-C)")
    try:
        data = torch.load(path, weights_only=False)
    except Exception as exc:  # a damaged file is the user's to know about, in one line
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"cannot read {path}: {reason}") from exc
    names = {f.name for f in fields(Checkpoint)}
    required = {f.name for f in fields(Checkpoint) if f.default is MISSING
                and f.default_factory is MISSING}
    if not isinstance(data, dict) or not required <= data.keys() or not data.keys() <= names:
        raise ConfigError(f"{path} is not a fedhier checkpoint (damaged, or written by "
                          "something else)")
    if not isinstance(data["round"], int) or not isinstance(data["global_state"], dict) or \
            not all(isinstance(v, torch.Tensor) for v in data["global_state"].values()):
        raise ConfigError(f"{path} is damaged: no cloud round or global model in it")
    return Checkpoint(**data)


def check_model(checkpoint: Checkpoint, state: dict[str, torch.Tensor], path: Path) -> None:
    """A one-line ConfigError unless the checkpoint's global model has the names and shapes
    of ``state`` (the run's model): a checkpoint of another run must not be resumed here."""
    saved = checkpoint.global_state
    if saved.keys() != state.keys() or any(saved[k].shape != state[k].shape for k in state):
        raise ConfigError(f"{path / CHECKPOINT} holds another model than this run folder's "
                          "config.json describes; it does not belong to this run")

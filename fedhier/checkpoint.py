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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedhier.errors import ConfigError

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
    with open(tmp, "wb") as handle:
        handle.write(buffer.getvalue())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, run_dir / CHECKPOINT)


def load_checkpoint(run_dir: Path) -> Checkpoint:
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise ConfigError(f"{run_dir} has no {CHECKPOINT} to resume from (checkpoints are "
                          "written with --checkpoint-every K and on Ctrl-C)")
    try:
        data = torch.load(path, weights_only=False)
    except Exception as exc:  # a damaged file is the user's to know about, in one line
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return Checkpoint(**data)

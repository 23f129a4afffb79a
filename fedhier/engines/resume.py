"""Resuming a run folder: its checkpoint, checked before the run folder is touched.

In the engine layer because rehearsing a restore builds the run's cloud step, which may be a
Flower strategy (:mod:`fedhier.strategies.cloud_step`); importing that module also registers
the Flower strategies' classes with the checkpoint reader (:func:`fedhier.runs.state_codec.allow`)
before the file is read. fedhier's core imports nothing of the Flower layer.
"""

from __future__ import annotations

from pathlib import Path

from fedhier.cli.flags import prepare_data
from fedhier.common.errors import FedhierError
from fedhier.engines.round_for import round_for
from fedhier.local.train import resolve_device
from fedhier.runs.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    check_model,
    load_checkpoint,
    restore_state,
)
from fedhier.runs.folder import read_metrics
from fedhier.runs.prepare import initial_model
from fedhier.settings.run_config import RunConfig


def resumable_checkpoint(path: Path, cfg: RunConfig) -> Checkpoint | None:
    """The checkpoint of run folder ``path`` (configuration ``cfg``), checked against the
    folder's metrics and the model ``cfg`` builds; a one-line FedhierError if it does not fit.

    None when the run stopped before its first checkpoint (no checkpoint.pt, no summary.json):
    the resumed run starts again at round 0 in the same folder. A round-0 checkpoint is the
    same as none (it holds nothing a fresh start lacks)."""

    resume: Checkpoint | None = None
    if (path / CHECKPOINT).exists() or (path / "summary.json").exists():
        resume = load_checkpoint(path)
        if not 0 <= resume.round <= cfg.rounds:
            raise FedhierError(f"{path}/{CHECKPOINT} is after cloud round {resume.round} of "
                               f"a {cfg.rounds}-round run; it does not belong to this run "
                               "folder")
        recorded = {r["round"] for r in read_metrics(path)}
        if not set(range(resume.round + 1)) <= recorded:
            raise FedhierError(f"{path}/metrics.jsonl lacks rounds of the checkpoint's "
                               f"0..{resume.round}; the folder is damaged")
    resolve_device(cfg.device)
    fed = prepare_data(cfg)
    if resume is not None:
        check_model(resume, initial_model(cfg, fed).state_dict(), path)
        # rehearse the restore on a fresh algorithm: a state that does not fit is one line
        # now, before the run folder is touched, not an error in the middle of the run
        restore_state(round_for(cfg), resume, path, cfg.clients)
    return resume if resume is not None and resume.round > 0 else None

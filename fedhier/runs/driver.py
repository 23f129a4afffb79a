"""The loop every engine runs: :func:`run_recorded` records the run folder, checkpoints and
resumes around :meth:`fedhier.round.loop.HierarchicalSGD.run`. No Flower import here: each engine
brings its executor (``fedhier.engines``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedhier.round.loop import Executor, HierarchicalSGD, Params
from fedhier.runs.checkpoint import Checkpoint, restore_state, save_checkpoint
from fedhier.runs.crash_points import crash_point
from fedhier.runs.recorder import RunRecorder
from fedhier.settings.run_config import RunConfig


def run_recorded(algorithm: HierarchicalSGD, executor: Executor, cfg: RunConfig,
                 recorder: RunRecorder, initial: Params,
                 evaluate_fn: Callable[[int, Params], dict[str, Any]],
                 resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``algorithm`` with ``executor`` for ``cfg.rounds`` cloud rounds, recording every
    round in the run folder; returns summary.json's dict.

    Writes ``checkpoint.pt`` every ``cfg.checkpoint_every`` cloud rounds and, on Ctrl-C,
    after the last completed round before re-raising; ``resume`` continues from one.
    metrics.jsonl and the checkpoint agree by construction: a record is appended before its
    round's checkpoint is written, and a resume first cuts metrics.jsonl back to the
    checkpoint's round (:class:`~fedhier.runs.recorder.RunRecorder`), so a run killed at any
    moment and resumed holds each round's record exactly once.
    """
    folder = recorder.folder
    if resume is None:
        recorder.save_initial(initial)
    else:  # on the device the executor works on
        device = next(iter(initial.values())).device
        initial = {k: v.to(device) for k, v in resume.global_state.items()}
        restore_state(algorithm, resume, folder.path, cfg.clients)
    # The last fully recorded cloud round, its model and states, replaced in one update so
    # that a Ctrl-C at any moment checkpoints a consistent set.
    done: dict[str, Any] = {"round": resume.round if resume else 0, "params": None,
                            "state": None, "clients": {}}

    def checkpoint() -> None:
        save_checkpoint(folder.path, Checkpoint(
            round=done["round"],
            global_state={k: v.detach().cpu() for k, v in done["params"].items()},
            strategy_state=done["state"], wall_seconds=recorder.elapsed,
            client_states=_to_cpu(done["clients"])))

    def on_record(record: dict[str, Any]) -> None:
        if record["round"] == 0:
            assert algorithm.hierarchy is not None and algorithm.info is not None
            recorder.write_groups(algorithm.hierarchy, algorithm.info, cfg.grouping, cfg.seed)
        crash_point()
        recorder.record_round(record)
        crash_point()
        done.update({"round": record["round"], "params": algorithm.global_params,
                     "state": algorithm.state_dict(), "clients": executor.client_state()})
        # No round-0 checkpoint: it would hold nothing a fresh start lacks (a folder without
        # a checkpoint restarts from round 0 on --resume).
        if cfg.checkpoint_every and record["round"] > 0 and \
                record["round"] % cfg.checkpoint_every == 0:
            checkpoint()
            crash_point()

    try:
        final = algorithm.run(executor, initial, cfg.rounds, first_round=done["round"] + 1,
                              evaluate_fn=evaluate_fn, on_record=on_record,
                              client_state=resume.client_states if resume else None)
    except KeyboardInterrupt:
        recorder.close()
        if done["params"] is not None and done["round"] > 0:
            checkpoint()
        raise
    finally:
        recorder.close()
    return recorder.finish({k: v.detach().cpu() for k, v in final.items()},
                           algorithm.communication.as_dict())


def _to_cpu(value: Any) -> Any:
    """Tensors anywhere inside dicts, moved to the CPU (checkpoints load on any machine)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value

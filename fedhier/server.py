"""The cloud side of a fedhier run, whatever the engine: data, initial model, central
evaluation, and :func:`run_recorded`, the loop that records the run folder, checkpoints and
resumes around :meth:`fedhier.hsgd.HierarchicalSGD.run`. No Flower import here: each engine
brings its executor (``fedhier.engines``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fedhier.checkpoint import Checkpoint, restore_state, save_checkpoint
from fedhier.config import RunConfig
from fedhier.crash_points import crash_point
from fedhier.errors import ConfigError
from fedhier.federation import Federation, federation_for
from fedhier.hsgd import Executor, HierarchicalSGD, HSGDSettings, Params
from fedhier.models import build_model
from fedhier.rng import torch_seed
from fedhier.round_diagnostics import diagnostics_due, sample_diagnostics
from fedhier.run_recorder import RunRecorder
from fedhier.train import evaluate


def quiet_flower() -> None:
    """Keep Flower's per-round INFO logs out of the progress bar."""
    logging.getLogger("flwr").setLevel(logging.WARNING)


def prepare(cfg: RunConfig) -> Federation:
    """Load and partition the data; raises a one-line FedhierError on bad input."""
    fed = federation_for(cfg)
    token_input = fed.bundle.x_dtype.startswith("int")
    if token_input != (cfg.model == "lstm"):
        kind = "token ids (text)" if token_input else "real-valued features"
        raise ConfigError(f"dataset {cfg.dataset} has {kind}; model '{cfg.model}' does not fit: "
                          f"use {'lstm' if token_input else 'logreg, mlp or cnn'}")
    if fed.num_clients != cfg.clients:
        raise ConfigError(
            f"the partition has {fed.num_clients} clients but clients={cfg.clients}; set "
            f"--clients {fed.num_clients}")
    return fed


def initial_model(cfg: RunConfig, fed: Federation) -> torch.nn.Module:
    """The seeded initial global model."""
    return build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes,
                       seed=torch_seed(cfg.seed, "model-init"))


def test_metrics(model: torch.nn.Module, params: dict[str, torch.Tensor], fed: Federation,
                 device: torch.device) -> dict[str, Any]:
    """``test_loss`` and ``test_accuracy`` of ``params`` on the held-out test set."""
    x_test, y_test = fed.test_tensors(device)
    loss, accuracy = evaluate(model, params, x_test, y_test)
    return {"test_loss": loss, "test_accuracy": accuracy}


def pooled_train_tensors(fed: Federation,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All clients' training rows together (the pooled data of sample-level diversity)."""
    parts = [fed.client_tensors(j, device) for j in range(fed.num_clients)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def settings_for(cfg: RunConfig) -> HSGDSettings:
    """The algorithm's settings of a run configuration."""
    return HSGDSettings(periods=cfg.periods, groups=cfg.groups, grouping=cfg.grouping,
                        weighting=cfg.weighting, seed=cfg.seed, workload=cfg.workload(),
                        min_clients_per_edge=cfg.min_clients_per_edge, on_nan=cfg.on_nan,
                        diagnostics_every=cfg.diagnostics_every,
                        regroup_every=cfg.regroup_every, aggregators=cfg.aggregator_names,
                        mobility=cfg.mobility(), time_model=cfg.time_model(),
                        asynchronous=cfg.asynchronous(), edge_periods=cfg.edge_period_list,
                        policy=cfg.reply_policy())


def central_evaluation(cfg: RunConfig, fed: Federation, model: torch.nn.Module,
                       device: torch.device) -> Callable[[int, Params], dict[str, Any]]:
    """The server's own evaluation of the global model after each cloud round: test loss
    and accuracy, and (when diagnostics are due) the sample-level gradient diversity of the
    pooled training rows."""

    def evaluate_fn(cloud_round: int, params: Params) -> dict[str, Any]:
        on_device = {k: v.to(device) for k, v in params.items()}
        metrics = test_metrics(model, on_device, fed, device)
        if diagnostics_due(cloud_round, cfg.diagnostics_every):
            x, y = pooled_train_tensors(fed, device)
            metrics.update(sample_diagnostics(model, on_device, x, y,
                                              cfg.diagnostics_max_samples, cfg.seed))
        return metrics

    return evaluate_fn


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
    checkpoint's round (:class:`~fedhier.run_recorder.RunRecorder`), so a run killed at any
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

"""Run an experiment's arms (configurations x seeds) as ordinary run folders.

Each (arm, seed) is a normal fedhier run in ``OUT/runs/<arm>/seed<k>/``; one that already has
its summary.json is not run again (so an interrupted experiment resumes), and one that was
cut off is started over. Runs go to a process pool when ``jobs`` > 1.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhier.engines.registry import run_engine
from fedhier.runs.folder import RunFolder, read_json, read_metrics
from fedhier.settings.run_config import FIELD_DEFAULTS, RunConfig


@dataclass(frozen=True)
class SuiteArm:
    """One configuration of an experiment; ``label`` is what tables and legends show."""

    name: str
    label: str
    config: RunConfig


#: settings whose default is not what a run made before the setting existed did
BEFORE_THE_SETTING = {"async_rule": "shifted-mean"}


def _same_config(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether a finished run folder ran ``cfg`` (the engine may differ: same numbers). A
    setting missing from an older config.json is taken at what that run did before the
    setting existed: its default, or :data:`BEFORE_THE_SETTING`'s value."""
    saved = read_json(run_dir, "config.json")
    return all(saved.get(k, _listed(BEFORE_THE_SETTING.get(k, FIELD_DEFAULTS[k])))
               == _listed(v) for k, v in cfg.to_dict().items() if k not in ("out", "engine"))


def _listed(value: Any) -> Any:
    """A tuple as config.json stores it (a list)."""
    return list(value) if isinstance(value, tuple) else value


def _run_one(cfg: RunConfig, run_dir: str) -> str:
    import torch

    torch.set_num_threads(1)
    folder = RunFolder.create(run_dir, overwrite=True)
    run_engine(cfg, folder, progress=False, resume=None)
    return run_dir


def run_arms(arms: Sequence[SuiteArm], seeds: Sequence[int], out: Path, engine: str = "vectorized",
             jobs: int = 1) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Run every arm for every seed (skipping finished runs); returns metrics by arm, seed."""
    todo: list[tuple[RunConfig, str]] = []
    for arm in arms:
        for seed in seeds:
            run_dir = out / "runs" / arm.name / f"seed{seed}"
            cfg = arm.config.replace(seed=seed, out=str(run_dir), engine=engine)
            if (run_dir / "summary.json").exists() and _same_config(run_dir, cfg):
                continue
            if run_dir.exists():
                shutil.rmtree(run_dir)  # cut off mid-run, or another configuration: redo
            todo.append((cfg, str(run_dir)))
    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(_run_one, *zip(*todo, strict=True)))
    else:
        for cfg, path in todo:
            _run_one(cfg, path)
    return {arm.name: {seed: read_metrics(out / "runs" / arm.name / f"seed{seed}")
                       for seed in seeds} for arm in arms}


def default_jobs() -> int:
    return max(1, (os.cpu_count() or 1))

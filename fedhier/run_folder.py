"""The run folder: everything needed to audit and repeat a run, written atomically.

Layout: config.json, partition.json, groups.json, metrics.jsonl, summary.json,
model_initial.safetensors, model_final.safetensors, curves.png.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from fedhier.errors import ConfigError


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path`` and rename it: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, (json.dumps(_jsonable(value), indent=1) + "\n").encode())


def default_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}"


class RunFolder:
    """A run folder. ``create`` refuses to reuse a non-empty folder unless ``overwrite``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | Path, overwrite: bool = False) -> RunFolder:
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run folder {path} exists and is not a folder")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise ConfigError(
                f"run folder {path} already exists and is not empty; choose another --out "
                "or pass --overwrite")
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path)
        if overwrite:
            (path / "metrics.jsonl").unlink(missing_ok=True)
        return folder

    def write_json(self, name: str, value: Any) -> None:
        write_json(self.path / name, value)

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl and flush it to disk."""
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(_jsonable(record)) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def rewrite_metrics(self, records: list[dict[str, Any]]) -> None:
        """Replace metrics.jsonl atomically with ``records`` (used when resuming)."""
        text = "".join(json.dumps(_jsonable(r)) + "\n" for r in records)
        atomic_write_bytes(self.path / "metrics.jsonl", text.encode())

    def save_model(self, name: str, state: Mapping[str, torch.Tensor]) -> None:
        tmp = self.path / f".{name}.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, self.path / name)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-cloud-round records of a run folder's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"{run_dir} is not a fedhier run folder (no metrics.jsonl)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_json(run_dir: str | Path, name: str) -> Any:
    return json.loads((Path(run_dir) / name).read_text())

"""docs/engines.md, "Adding an engine", followed literally: its code block, run as written
with the batched engine's executor as ``MyExecutor``, gives ``vectorized``'s numbers bit for
bit under asynchronous edges and a Flower cloud strategy (an engine that built
``HierarchicalSGD(settings_for(cfg))`` would silently run neither)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedhier.engines.vectorized.engine import BatchedExecutor, run_vectorized
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CFG = RunConfig(dataset="digits", clients=8, groups=(4,), local_period=2, global_period=4,
                rounds=3, batch_size=16, async_buffer=2, cloud_strategy="fedadam",
                edge_slowdown="0:4", seed=5)


def doc_block() -> str:
    text = (ROOT / "docs" / "engines.md").read_text()
    section = text[text.index("## Adding an engine"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    return "\n".join(line[3:] if line.startswith("   ") else line
                     for line in block.group(1).splitlines())


def records(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


def test_the_documented_engine_runs_async_edges_and_the_cloud_strategy(tmp_path):
    space: dict = {"MyExecutor": BatchedExecutor.build}
    exec(compile(doc_block(), "docs/engines.md", "exec"), space)  # noqa: S102
    space["run_myengine"](CFG, RunFolder.create(tmp_path / "doc", CFG), progress=False)
    run_vectorized(CFG, RunFolder.create(tmp_path / "vec", CFG), progress=False)
    ours, theirs = records(tmp_path / "doc"), records(tmp_path / "vec")
    assert ours == theirs and len(ours) == CFG.rounds + 1
    assert any(r.get("async_reports") for r in ours)  # asynchrony ran
    a = load_file(tmp_path / "doc" / "model_final.safetensors")
    b = load_file(tmp_path / "vec" / "model_final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and it is not what the synchronous plain-mean round gives
    sync = CFG.replace(async_buffer=0, cloud_strategy="average")
    run_vectorized(sync, RunFolder.create(tmp_path / "sync", sync), progress=False)
    c = load_file(tmp_path / "sync" / "model_final.safetensors")
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-4

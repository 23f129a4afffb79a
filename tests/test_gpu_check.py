"""benchmarks/gpu_check.sh stops cleanly without a GPU; benchmarks/gpu_table.py puts the
check's table into its section of a page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_fails_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                               "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "no CUDA device" in proc.stderr and not (tmp_path / "out").exists()


def test_gpu_table_fills_the_section(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_table import END, START, main  # noqa: PLC0415 - benchmarks/ is not a package

    w1 = {"device": "cuda (a test)", "engines": {"vectorized": {"client_sgd_steps_per_s": 40.0}}}
    (tmp_path / "w1_cuda.json").write_text(json.dumps(w1))
    w1["engines"]["vectorized"]["client_sgd_steps_per_s"] = 10.0
    (tmp_path / "w1_cpu.json").write_text(json.dumps(w1))
    page = tmp_path / "page.md"
    page.write_text(f"before\n{START}\nold\n{END}\nafter\n")
    sys.argv = ["gpu_table.py", str(tmp_path), "--docs", str(page)]
    main()
    text = page.read_text()
    assert text.startswith(f"before\n{START}\n") and text.endswith(f"{END}\nafter\n")
    assert "old" not in text and "| 10 | 40 | 4.00x |" in text and "cuda (a test)" in text
    assert "not run / did not finish" in text  # W2' and the million clients: no reports

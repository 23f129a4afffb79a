"""Every benchmark script imports (its names exist after a move or a rename): a stale
import in a script no test runs otherwise shows up here, not when a user reproduces a table.
One subprocess imports them all as modules (no script's main runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ALL = """
import importlib, sys
sys.path.insert(0, {root!r})
failed = []
for name in {names!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_imports():
    names = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                   for p in (ROOT / "benchmarks").rglob("*.py") if "__pycache__" not in p.parts)
    assert len(names) >= 20 and "benchmarks.async_rules_table" in names
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL.format(root=str(ROOT), names=names)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

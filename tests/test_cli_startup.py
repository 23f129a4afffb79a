"""The command line answers at once (issue 42): ``--help`` and every argument error load none
of the heavy libraries (torch, Flower, Hugging Face datasets, Ray, matplotlib, scipy,
scikit-learn), so they take the interpreter's start and fedhier's own modules (~0.3 s here)
instead of 4-20 s. Checked by the modules a fresh interpreter has loaded after each command,
not by a clock (benchmarks/cli_startup.py measures the times). Each case also still ends
with its one-line error and exit code 2 (0 for help)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "flwr", "datasets", "ray", "matplotlib", "scipy", "sklearn", "pandas",
         "flwr_datasets", "mlflow", "wandb", "tensorboardX")

CASES = {  # argv -> (exit code, what its one line says)
    ("--help",): (0, None),
    ("run", "--help"): (0, None),
    ("sweep", "--help"): (0, None),
    ("deploy", "local", "--help"): (0, None),
    ("experiment", "--help"): (0, None),
    ("run", "--datset", "x"): (2, "did you mean --dataset?"),
    ("run", "--rounds", "x"): (2, "invalid int value: 'x'"),
    ("run", "--alpha", "-1"): (2, "alpha must be > 0"),
    ("run", "--grouping", "nope"): (2, "unknown grouping 'nope'"),
    ("run", "--model", "nope"): (2, "unknown model 'nope'"),
    ("run", "--engine", "nope"): (2, "unknown engine 'nope'"),
    ("run", "--aggregators", "nope"): (2, "unknown aggregator 'nope'"),
    ("run", "--dataset", "nope"): (2, "unknown dataset 'nope'"),
    ("run", "--local-period", "3", "--global-period", "10"): (2, "must be a multiple of"),
    ("run", "--groups", "30"): (2, "more groups (30) than clients (20)"),
    ("run", "--tracker", "mlflow", "--alpha", "-1"): (2, "alpha must be > 0"),
    ("sweep", "--grid", "lrr=1"): (2, "did you mean 'lr'?"),
    ("diversity", "--alpha", "-1"): (2, "alpha must be > 0"),
    ("deploy", "local", "--alpha", "-1"): (2, "alpha must be > 0"),
    ("experiment", "sandwich", "--quick", "--alpha", "-1"): (2, "alpha must be > 0"),
    ("plot", "/nonexistent/run"): (2, "is not a fedhier run folder"),
}

PROBE = """
import contextlib, io, json, sys
from fedhier.cli.commands import main
argv = json.loads(sys.argv[1])
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    code = main(argv)
heavy = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
print(json.dumps({"code": code, "err": err.getvalue(), "heavy": heavy}))
"""


def test_help_and_argument_errors_load_no_heavy_library():
    for argv, (code, says) in CASES.items():
        done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(argv)),
                               json.dumps(HEAVY)], capture_output=True, text=True, check=True)
        got = json.loads(done.stdout)
        assert got["heavy"] == [], (argv, got["heavy"])
        assert got["code"] == code, (argv, got)
        if says is not None:
            lines = got["err"].strip().splitlines()
            assert len(lines) == 1 and says in lines[0], (argv, got["err"])

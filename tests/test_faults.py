"""Client faults, checkpoints and resume, numerical faults, and validation of any input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.round.faults import FaultModel
from fedhier.runs.checkpoint import load_checkpoint
from fedhier.settings.run_config import RunConfig, read_toml
from tests.conftest import examples
from tests.helpers import interruptible, max_abs_diff, run_hier

BASE = RunConfig(dataset="digits", clients=8, groups=2, batch_size=8, lr=0.1, seed=3,
                 local_period=2, global_period=4, rounds=2)
TINY = ["--clients", "6", "--groups", "2", "--local-period", "2", "--global-period", "4",
        "--no-progress"]


def expected_failures(cfg: RunConfig) -> list[int]:
    """Failed clients per cloud round predicted by the fault model."""
    model: FaultModel = cfg.faults()
    edge_rounds = cfg.global_period // cfg.local_period
    out = []
    for cloud_round in range(1, cfg.rounds + 1):
        rounds = range((cloud_round - 1) * edge_rounds + 1, cloud_round * edge_rounds + 1)
        out.append(sum(model.fails(cfg.seed, c, r, cloud_round)
                       for r in rounds for c in range(cfg.clients)))
    return out


def test_fail_rate_drops_exactly_the_failing_clients():
    cfg = BASE.replace(fail_rate=0.3, rounds=3)
    records: list = []
    faulty = run_hier(cfg, records)
    counts = [r["failed_clients"] for r in records[1:]]
    assert counts == expected_failures(cfg) and sum(counts) > 0
    again: list = []
    assert max_abs_diff(faulty, run_hier(cfg, again)) == 0.0  # seeded: same faults
    assert max_abs_diff(faulty, run_hier(BASE.replace(rounds=3))) > 1e-4


def test_dropout_span_only_hits_those_rounds():
    cfg = BASE.replace(dropout_fraction=0.5, dropout_rounds="2-2", rounds=3)
    records: list = []
    run_hier(cfg, records)
    counts = [r["failed_clients"] for r in records[1:]]
    assert counts[0] == 0 and counts[2] == 0 and counts[1] > 0
    assert counts == expected_failures(cfg)


ENGINES = pytest.mark.parametrize("engine", ["inprocess", "vectorized"])


@ENGINES
def test_min_clients_per_edge_stops_with_one_line(engine, tmp_path, capsys):
    code = main(["run", *TINY, "--engine", engine, "--rounds", "2", "--fail-rate", "0.9",
                 "--min-clients-per-edge", "2", "--out", str(tmp_path / "r")])
    assert code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "min-clients-per-edge" in err[0]


@ENGINES
def test_nan_stops_naming_round_edge_and_client(engine, tmp_path, capsys):
    code = main(["run", *TINY, "--engine", engine, "--rounds", "1", "--lr", "1e30",
                 "--out", str(tmp_path / "r")])
    assert code == 3
    err = capsys.readouterr().err.strip()
    assert "non-finite" in err and "client" in err and "edge" in err and "round" in err
    assert "\n" not in err


@ENGINES
def test_nan_skip_client_keeps_the_global_model(engine, tmp_path):
    out = tmp_path / "r"
    assert main(["run", *TINY, "--engine", engine, "--rounds", "1", "--lr", "1e30",
                 "--on-nan", "skip-client", "--out", str(out)]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["failed_clients"] == 6 * 2  # everyone, both edge rounds
    first = load_file(str(out / "model_initial.safetensors"))
    last = load_file(str(out / "model_final.safetensors"))
    assert all(np.array_equal(first[k].numpy(), last[k].numpy()) for k in first)


def _run_cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedhier.cli", "run", *args],
                            preexec_fn=interruptible,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_cli_to_end(args: list[str]) -> None:
    """A whole run in a fresh process: bit-identity needs the same thread settings, which
    tests in this process may have changed."""
    proc = _run_cli(args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def _wait_for_rounds(run_dir: Path, rounds: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= rounds + 1:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("run did not reach the round in time")


def _same_final(a: Path, b: Path) -> bool:
    fa = load_file(str(a / "model_final.safetensors"))
    fb = load_file(str(b / "model_final.safetensors"))
    return all(np.array_equal(fa[k].numpy(), fb[k].numpy()) for k in fa)


SLOW_RUN = [*TINY, "--rounds", "8", "--momentum", "0.9", "--optimizer-state", "keep",
            "--regroup-every", "2",
            "--checkpoint-every", "1"]


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    _run_cli_to_end([*SLOW_RUN, "--out", str(reference)])
    killed = tmp_path / "killed"
    proc = _run_cli([*SLOW_RUN, "--out", str(killed)])
    _wait_for_rounds(killed, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoint.pt").exists() and not (killed / "summary.json").exists()
    _run_cli_to_end(["--resume", str(killed), "--no-progress"])
    assert _same_final(reference, killed)
    rounds = [json.loads(x)["round"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(9))  # no duplicated rounds after the resume
    ref = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    res = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_loss"] for r in ref] == [r["test_loss"] for r in res]


@pytest.mark.slow
def test_ctrl_c_writes_a_checkpoint_and_resume_finishes(tmp_path):
    reference = tmp_path / "reference"
    # A tiny round takes ~40 ms: with few rounds the run could end before the signal lands.
    # 60 rounds leave seconds of work after round 2.
    args = [*TINY, "--rounds", "60"]
    _run_cli_to_end([*args, "--out", str(reference)])
    stopped = tmp_path / "stopped"
    proc = _run_cli([*args, "--out", str(stopped)])  # no --checkpoint-every: only on Ctrl-C
    _wait_for_rounds(stopped, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "--resume" in err
    assert (stopped / "checkpoint.pt").exists()
    _run_cli_to_end(["--resume", str(stopped), "--no-progress"])
    assert _same_final(reference, stopped)


def run_interrupted_at(round_: int, args: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``main(args)`` with a KeyboardInterrupt (as Ctrl-C) raised when cloud round ``round_``
    is about to be recorded; returns its exit code."""
    from fedhier.runs.recorder import RunRecorder

    record_round = RunRecorder.record_round

    def interrupting(self, record):
        if record["round"] == round_:
            raise KeyboardInterrupt
        record_round(self, record)

    with monkeypatch.context() as patch:
        patch.setattr(RunRecorder, "record_round", interrupting)
        return main(args)


@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
def test_interrupted_run_resumes_bit_identically(engine, tmp_path, monkeypatch):
    """Ctrl-C during cloud round 4 checkpoints round 3; --resume then ends where an
    uninterrupted run ends, with kept momentum, participation, faults and regrouping."""
    args = ["run", *TINY, "--engine", engine, "--rounds", "6", "--momentum", "0.9",
            "--optimizer-state", "keep", "--participation", "0.7", "--fail-rate", "0.2",
            "--regroup-every", "2"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(4, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert not (stopped / "summary.json").exists()
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    assert _same_final(tmp_path / "reference", stopped)
    ref, res = (read_lines(tmp_path / "reference"), read_lines(stopped))
    assert [r["round"] for r in res] == list(range(7))
    assert [r["test_loss"] for r in ref] == [r["test_loss"] for r in res]
    assert [r["failed_clients"] for r in ref] == [r["failed_clients"] for r in res]
    assert [r["sim_seconds"] for r in ref] == [r["sim_seconds"] for r in res]


@pytest.mark.slow
def test_simulation_engine_resume_restores_the_clients_momentum(tmp_path, monkeypatch):
    """On Ray the clients' kept momentum lives in the actors; checkpoints collect it with
    query.state and --resume sends it back with query.restore."""
    args = ["run", *TINY, "--engine", "flower", "--rounds", "4", "--momentum", "0.9",
            "--optimizer-state", "keep", "--checkpoint-every", "1"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(3, [*args, "--out", str(stopped)], monkeypatch) != 0
    checkpoint = load_checkpoint(stopped)
    assert checkpoint.round == 2 and len(checkpoint.client_states) == 6
    assert all("fedhier-optimizer" in state for state in checkpoint.client_states.values())
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    assert _same_final(tmp_path / "reference", stopped)


def read_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_refuses_config_flags_and_missing_checkpoint(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *TINY, "--rounds", "1", "--out", str(out)]) == 0
    assert main(["run", "--resume", str(out)]) == 2  # finished without checkpoints
    assert "checkpoint" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--lr", "0.5"]) == 2
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())  # as a deployed run records it
    (out / "config.json").write_text(json.dumps({**config, "engine": "flower (flwr run)"}))
    assert main(["run", "--resume", str(out)]) == 2
    assert f"fedhier deploy local --resume {out}" in capsys.readouterr().err


# --- validation never gives a traceback ----------------------------------------------------
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True),
                   st.text(max_size=8), st.lists(st.integers(-2, 9), max_size=3))
KEYS = st.sampled_from([f.replace("_", "-") for f in RunConfig.__dataclass_fields__]
                       + ["bogus", "local_period", "groups", "periods"])


def assert_one_line(exc: ConfigError) -> str:
    message = str(exc)
    assert message and len(message.splitlines()) == 1 and message.isprintable(), repr(message)
    return message


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, VALUES, max_size=6))
# found by hypothesis (issue #31): a control character echoed into a two-line error
@example({"grouping": "\n"})
@example({"weighting": "\n"})
@example({"lr-schedule": "\r\x1b"})
def test_random_configs_give_a_config_or_a_config_error(values):
    try:
        cfg = RunConfig.from_mapping(values)
    except ConfigError as exc:
        assert_one_line(exc)
    else:
        assert isinstance(cfg, RunConfig)
        assert RunConfig.from_mapping(cfg.to_dict()) == cfg  # config.json reads back as is


#: fields whose given value may be replaced: by periods, edge_periods or their defaults
DERIVED = {"local_period", "global_period", "periods", "groups"}


@settings(max_examples=examples(200))
@given(st.text(alphabet=st.sampled_from(list('abcdefgklmnoprst_-=.,[]"\n 0123456789')),
               max_size=60))
@example("lr = 0.5\nrounds = 3\n")
@example("alpha = 0")
def test_random_toml_gives_its_values_or_one_line_naming_the_problem(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_text(text)
    table: dict = {}
    try:
        table = read_toml(path)
        cfg = RunConfig.from_mapping(table, where=str(path))
    except ConfigError as exc:
        message = assert_one_line(exc)
        keys = {str(k).replace("-", "_") for k in table}
        named = {str(path)} | keys | {k.replace("_", " ") for k in keys}
        assert any(name in message for name in named if name), (message, text)
        return
    for key, value in table.items():  # every value the file gives is the value that runs
        key = key.replace("-", "_")
        if key not in DERIVED:
            assert getattr(cfg, key) == value, (key, value, text)
    assert RunConfig.from_mapping(cfg.to_dict()) == cfg

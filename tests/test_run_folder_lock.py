"""Run folders under contention and on bad disks, devices, and what a failed run leaves.

Named cases of the issue "bad input anywhere gets a clear error" that need a real second
process, a real file system or a simulated machine (the random cases are in
tests/test_fuzz_cli.py):

- two runs given the same ``--out`` at once: one wins, the other gets one line (a lock);
- a ``--resume`` of a folder that another live process is writing is refused;
- a read-only or full output location fails cleanly (a real read-only / full tmpfs when this
  machine lets the tests mount one, else skipped; always: a path under /sys, and ENOSPC
  injected into the run folder's own writes);
- ``--device``: checked before any work, one line naming what is available; ``auto``;
- a failed start leaves no folder; a failure after work leaves failed.json with the reason;
  an unexpected exception is one line, exit 4.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.local import devices
from fedhier.round.faults import RunFailureError
from fedhier.runs.lock import RunFolderBusyError, RunLock
from fedhier.runs.recorder import RunRecorder

TINY = ["--rounds", "1", "--clients", "4", "--groups", "2", "--local-period", "1",
        "--global-period", "2", "--no-progress"]
REPO = Path(__file__).resolve().parents[1]

#: A fedhier run that, after recording cloud round 1, touches DIR/at-round-1 and waits for
#: DIR/release: a live process holding its run folder at a known moment.
HOLDER = textwrap.dedent("""
    import pathlib, sys, time
    from fedhier.cli.commands import main
    from fedhier.runs.recorder import RunRecorder
    signals = pathlib.Path(sys.argv[1])
    original = RunRecorder.record_round
    def record(self, r):
        original(self, r)
        if r["round"] == 1:
            (signals / "at-round-1").touch()
            deadline = time.time() + 300
            while not (signals / "release").exists() and time.time() < deadline:
                time.sleep(0.05)
    RunRecorder.record_round = record
    sys.exit(main(sys.argv[2:]))
""")


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def valid_run_folder(path: Path, rounds: int) -> None:
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "metrics.jsonl", "summary.json", "model_final.safetensors"} <= names
    assert "failed.json" not in names and ".lock" not in names
    records = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(rounds + 1))


def start_holder(tmp_path: Path, out: Path, *flags: str) -> tuple[subprocess.Popen[str], Path]:
    signals = tmp_path / "signals"
    signals.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(signals), "run", *TINY,
                             "--rounds", "2", "--out", str(out), *flags],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 180
    while not (signals / "at-round-1").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the holder never reached round 1"
        time.sleep(0.05)
    return proc, signals


# -- concurrency: a lock, not a race ----------------------------------------------------------

def test_second_run_on_a_folder_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    holder, signals = start_holder(tmp_path, out, "--checkpoint-every", "1")
    try:
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        for extra in ([], ["--overwrite"]):  # --overwrite does not get past a live run either
            assert main(["run", *TINY, "--out", str(out), *extra]) == 2
            line = one_line(capsys.readouterr().err)
            assert str(out) in line and f"pid {holder.pid}" in line, line
        # a resume of the folder the holder is still writing is refused too
        assert main(["run", "--resume", str(out), "--no-progress"]) == 2
        line = one_line(capsys.readouterr().err)
        assert str(out) in line and f"pid {holder.pid}" in line and "resume" in line, line
        after = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        assert after == before  # the refused runs wrote nothing into the holder's folder
    finally:
        (signals / "release").touch()
        stdout, stderr = holder.communicate(timeout=300)
    assert holder.returncode == 0, stderr
    valid_run_folder(out, rounds=2)


def test_two_runs_started_together_on_one_folder_one_wins(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedhier.cli", "run", *TINY, "--out", str(out)]
    procs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, _, err in results if code == 2)
    line = one_line(loser)
    assert str(out) in line and ("in use" in line or "not empty" in line), line
    valid_run_folder(out, rounds=1)


def test_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    with RunLock(folder), pytest.raises(RunFolderBusyError, match=f"pid {os.getpid()}"):
        RunLock(folder).acquire()
    assert not (folder / ".lock").exists()  # removed on release
    # a holder killed with SIGKILL leaves the file but not the lock
    script = (f"import time; from fedhier.runs.lock import RunLock; "
              f"RunLock({str(folder)!r}).acquire(); print('locked', flush=True); "
              "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderBusyError, match=f"pid {proc.pid}"):
            RunLock(folder).acquire()
    finally:
        proc.kill()
        proc.wait()
    assert (folder / ".lock").exists()
    RunLock(folder).acquire().release()  # the kernel dropped the dead holder's lock


def test_default_run_folders_started_in_the_same_second_do_not_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")
    assert main(["run", *TINY]) == 0
    assert main(["run", *TINY]) == 0
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert folders == ["20260101-000000-digits-inprocess", "20260101-000000-digits-inprocess-2"]


# -- what a failed run leaves ---------------------------------------------------------------

def test_failed_start_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """Failures after the folder is claimed but before a cloud round completes: an
    unexpected exception (exit 4), Ctrl-C (130), a deliberate stop (3)."""
    out = tmp_path / "a" / "b" / "run"
    original = RunRecorder.record_round
    for exc, code in ((ValueError("boom"), 4), (KeyboardInterrupt(), 130),
                      (RunFailureError("stopped"), 3)):
        def record(self, r, exc=exc):
            if r["round"] == 1:
                raise exc
            original(self, r)

        monkeypatch.setattr(RunRecorder, "record_round", record)
        assert main(["run", *TINY, "--out", str(out)]) == code
        line = one_line(capsys.readouterr().err)
        assert "removed" in line, line
        assert not (tmp_path / "a").exists()  # the parents it created are gone too
    # a folder that existed (empty) before stays, empty
    out.mkdir(parents=True)
    assert main(["run", *TINY, "--out", str(out)]) == 3
    assert out.is_dir() and not list(out.iterdir())


def test_internal_error_is_one_line_with_exit_4(tmp_path, capsys, monkeypatch):
    import fedhier.engines.registry

    def broken(*args, **kwargs):
        raise AssertionError("Torch not compiled with CUDA enabled")

    # fedhier.cli.commands imports run_engine when a run starts (not at import: a fast CLI)
    monkeypatch.setattr(fedhier.engines.registry, "run_engine", broken)
    out = tmp_path / "run"
    assert main(["run", *TINY, "--out", str(out)]) == 4
    line = one_line(capsys.readouterr().err)
    assert line.startswith("fedhier: internal error: AssertionError") and "report" in line
    assert "--debug" in line and not out.exists()


def test_failure_after_work_keeps_the_folder_marked_failed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    original = RunRecorder.record_round

    def record(self, r):
        if r["round"] == 2:
            raise RunFailureError("edge 0 kept 0 of 2 clients in edge round 3")
        original(self, r)

    monkeypatch.setattr(RunRecorder, "record_round", record)
    assert main(["run", *TINY, "--rounds", "3", "--out", str(out)]) == 3
    line = one_line(capsys.readouterr().err)
    assert "edge 0 kept 0" in line and "failed.json" in line, line
    failed = json.loads((out / "failed.json").read_text())
    assert failed["exit_code"] == 3 and "edge 0 kept 0" in failed["reason"]
    assert failed["last_completed_round"] == 1 and not (out / ".lock").exists()


# -- read-only and full disks ---------------------------------------------------------------

def _mount_tmpfs(target: Path, options: str) -> bool:
    """Mount a tmpfs on ``target`` (root with mount rights only); False when not allowed."""
    if os.geteuid() != 0:
        return False
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                          capture_output=True)
    return proc.returncode == 0


def _umount(target: Path) -> None:
    subprocess.run(["umount", str(target)], capture_output=True)


def test_read_only_output_location_fails_cleanly(tmp_path, capsys):
    # always: a place nobody may create folders in (/sys refuses even root: EPERM/EROFS)
    assert main(["run", *TINY, "--out", "/sys/fedhier-run"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--out /sys/fedhier-run" in line and "cannot create the run folder" in line
    # a real read-only file system, when this machine lets the test mount one
    ro = tmp_path / "ro"
    if not _mount_tmpfs(ro, "size=1m,ro"):
        pytest.skip("cannot mount a read-only tmpfs here (needs root with mount rights)")
    try:
        assert main(["run", *TINY, "--out", str(ro / "run")]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"--out {ro / 'run'}" in line and "Read-only file system" in line, line
        assert main(["run", "--resume", str(ro), "--no-progress"]) == 2
        assert "Read-only file system" in one_line(capsys.readouterr().err)
    finally:
        _umount(ro)


def test_disk_full_during_the_run_fails_cleanly(tmp_path, capsys, monkeypatch):
    """ENOSPC from the run folder's own fsync in cloud round 2 (no mount needed)."""
    import fedhier.runs.folder

    out = tmp_path / "run"
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == 3:  # metrics of rounds 0 and 1 are on disk; round 2's is not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(fedhier.runs.folder.os, "fsync", fsync)
    assert main(["run", *TINY, "--rounds", "3", "--out", str(out)]) == 5
    line = one_line(capsys.readouterr().err)
    assert "metrics.jsonl" in line and "No space left on device" in line, line
    assert json.loads((out / "failed.json").read_text())["exit_code"] == 5


def test_full_file_system_fails_cleanly(tmp_path, capsys):
    """A real full tmpfs: the run fails with one line naming the file it could not write,
    exit 5 (or 2 if not even the lock file fits), and leaves no half folder."""
    full = tmp_path / "full"
    if not _mount_tmpfs(full, "size=64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root with mount rights)")
    try:
        code = main(["run", *TINY, "--out", str(full / "run")])
        line = one_line(capsys.readouterr().err)
        assert code in (2, 5), line
        assert "No space left on device" in line and str(full / "run") in line, line
        assert not (full / "run").exists() or (full / "run" / "failed.json").exists()
    finally:
        _umount(full)


# -- devices --------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    for name in ("cuda", "cuda:3", "mps"):
        assert main(["run", *TINY, "--device", name, "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"fedhier: error: --device {name}: this machine has no ")
        assert f"torch {torch.__version__}" in line and line.endswith("available: cpu")
        assert not out.exists()
    assert main(["run", *TINY, "--device", "gpu", "--out", str(out)]) == 2
    assert "unknown device 'gpu'" in one_line(capsys.readouterr().err)


def test_device_auto_runs_and_records_the_device_used(tmp_path):
    out = tmp_path / "run"
    assert main(["run", *TINY, "--device", "auto", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "auto"
    assert config["device_used"] == str(devices.resolve_device("auto"))


def test_device_names_are_one_list():
    from fedhier.settings.run_config import DEVICES

    assert DEVICES == devices.DEVICE_KINDS


def test_device_names_on_a_simulated_two_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.available_devices()[:2] == ["cuda:0", "cuda:1"]
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert devices.resolve_device("auto") == torch.device("cuda", 0)
    assert devices.resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"--device cuda:2: this machine has 2 CUDA devices "
                                          r"\(cuda:0..cuda:1\).*available: cuda:0, cuda:1"):
        devices.resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert devices.resolve_device("auto") == torch.device("mps")
    assert devices.available_devices() == ["mps", "cpu"]

"""The Flower path on W1: the plain loop against the Simulation Engine, before and after
(issue 26, item 4).

Rows, each a fresh process, alternated over ``--repeats`` passes (medians):

* ``plain``: the hand-written PyTorch loop (``benchmarks/engines.py``'s worker, its whole
  command less its untimed warm-up run, as there);
* ``flower, a node per client``: ``--engine flower``, one virtual SuperNode per client (one
  message per client and edge round): the Flower path before;
* ``flower --edge-servers``: the Simulation Engine's nodes are the 10 edge servers, each running
  its clients' edge rounds in its Ray actor (one message per edge and cloud round): after;
* ``... --ray-address``: the same joining a Ray cluster started once by this script (``ray
  start --head``, 2 CPUs, stopped at the end), as a sweep reuses one (not counted in the
  command: a sweep starts it once).

Timed window and whole command as in ``benchmarks/engines.py`` (imported from there): the
window runs from the record of cloud round 0 to the last record; the whole command is the
worker process from its start to its exit (the Flower rows have no warm-up run). For the
Flower rows the worker also times its phases: interpreter start and imports before the run,
the run's own imports and set-up up to ``ray.init``, ``ray.init``, Ray's first
actor call through to the round-0 record (the actors' cold start, their clients' profiles,
the round-0 evaluation), the window, and what follows it (final save, Ray's shutdown).

Run ``python benchmarks/flower_path.py`` (``--rounds``, ``--repeats``, ``--no-cluster``);
results go to benchmarks/results/flower_path.json (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import (  # noqa: E402 - benchmarks/ is not a package
    ROOT,
    W1,
    Marks,
    instrument_recorder,
    machine,
    run_engine,
    run_worker,
    spawn,
    w1_config,
    write_report,
)

RESULTS = ROOT / "benchmarks" / "results" / "flower_path.json"
#: row name -> the worker's mode (None: engines.py's plain worker)
ROWS = {"plain": None, "flower --edge-servers": "edges",
        "flower --edge-servers --ray-address": "edges-cluster",
        "flower, a node per client": "clients"}


# ------------------------------------------------------------------------------ worker
def flower_worker(mode: str, rounds: int, ray_address: str) -> dict[str, Any]:
    """One Flower run of W1 in this (fresh) process, with its phases' clock readings."""
    import torch
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    torch.set_num_threads(1)
    entered = time.perf_counter()
    stamps: dict[str, float] = {}
    original = RayBackend.init_ray

    def init_ray(self: Any, backend_config: Any) -> None:
        stamps["ray_init_start"] = time.perf_counter()
        original(self, backend_config)
        stamps["ray_init_end"] = time.perf_counter()

    RayBackend.init_ray = init_ray  # type: ignore[method-assign]
    marks = Marks()
    instrument_recorder(marks)
    cfg = w1_config(rounds)
    if mode != "clients":
        cfg = cfg.replace(edge_servers=True, ray_address=ray_address)
    accuracy = run_engine("flower", cfg, marks)
    ended = time.perf_counter()
    first, last = marks.marks[0][1], marks.marks[-1][1]
    return {"mode": mode, "windows": [marks.window()], "final_test_accuracy": accuracy,
            "untimed_seconds": 0.0,
            "phases": {"run_imports_and_setup": stamps["ray_init_start"] - entered,
                       "ray_init": stamps["ray_init_end"] - stamps["ray_init_start"],
                       "actors_to_round_0": first - stamps["ray_init_end"],
                       "window": last - first, "after_window": ended - last},
            "worker_seconds": ended - entered}


def spawn_flower(mode: str, args: argparse.Namespace, ray_address: str) -> dict[str, Any]:
    """:func:`flower_worker` in a fresh interpreter; its whole command in seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
           "--rounds", str(args.rounds), "--ray-address", ray_address]
    print(f"  running flower ({mode}) ...", flush=True)
    result, seconds = run_worker(cmd, f"flower ({mode})")
    result["command_seconds"] = seconds
    result["phases"]["interpreter_and_imports"] = seconds - result["worker_seconds"]
    return result


# ------------------------------------------------------------------------------ cluster
def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def ray_head(cpus: int = 2) -> Any:
    """``ray start --head --block`` on 127.0.0.1 (a free port, a private temp dir), stopped
    at the end (its process group, then anything still running from its temp dir)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    temp_dir = tempfile.mkdtemp(prefix="fhfp-", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    ray = Path(sys.executable).parent / "ray"
    head = subprocess.Popen([str(ray), "start", "--head", "--block", f"--port={port}",
                             "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                             "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp_dir}"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not _listening(port):
            if time.time() > deadline or head.poll() is not None:
                raise RuntimeError("the Ray head did not start")
            time.sleep(0.2)
        time.sleep(2.0)  # the raylet registers after the GCS listens
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=20)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if temp_dir.encode() in (entry / "cmdline").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)


# ------------------------------------------------------------------------------ parent
def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every row's runs, alternated over the passes; each run is also appended to
    ``args.out`` with ``.runs.jsonl`` as it ends (a partial measurement can be tabulated:
    ``--from-runs``)."""
    rows = {k: v for k, v in ROWS.items() if args.cluster or v != "edges-cluster"}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    engines_args = argparse.Namespace(rounds=args.rounds, repeats=1, threads=1,
                                      workload="w1", profile=False)
    log = args.out.with_suffix(".runs.jsonl")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    with ray_head() if args.cluster else contextlib.nullcontext("") as address:
        for _ in range(args.repeats):  # alternated: a busy spell hits every row alike
            for name, mode in rows.items():
                if mode is None:
                    run = spawn("plain", engines_args, repeats=1)
                else:
                    run = spawn_flower(mode, args, address if mode == "edges-cluster" else "")
                raw[name].append(run)
                with log.open("a") as handle:
                    handle.write(json.dumps({"row": name, **run,
                                             "load_average": os.getloadavg()}) + "\n")
    return raw


def tabulate(args: argparse.Namespace, raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per row, ratios to the plain loop, the Flower rows' phases."""
    table: dict[str, Any] = {}
    for name, runs in raw.items():
        if not runs:
            continue
        windows = [r["windows"][0]["wall"] for r in runs]
        commands = [r["command_seconds"] for r in runs]
        row: dict[str, Any] = {
            "window_seconds": windows, "command_seconds": commands,
            "window_median": statistics.median(windows),
            "command_median": statistics.median(commands),
            "cpu_window_median": statistics.median(r["windows"][0]["cpu"] for r in runs),
            "final_test_accuracy": runs[-1]["final_test_accuracy"]}
        if "phases" in runs[0]:
            row["phases_median"] = {k: statistics.median(r["phases"][k] for r in runs)
                                    for k in runs[0]["phases"]}
        table[name] = row
    plain = table["plain"]
    for row in table.values():
        row["window_vs_plain"] = row["window_median"] / plain["window_median"]
        row["command_vs_plain"] = row["command_median"] / plain["command_median"]
    return {"command": "python benchmarks/flower_path.py " + " ".join(sys.argv[1:]),
            "machine": machine(), "repeats": min(len(r) for r in raw.values() if r),
            "workload": {**{k: list(v) if isinstance(v, tuple) else v for k, v in W1.items()},
                         "rounds": args.rounds},
            "messages_per_run": messages(args.rounds),
            "targets": {"command_within_2x_plain": "flower --edge-servers",
                        "window_within_1.5x_plain": "flower --edge-servers"},
            "rows": table,
            "load_average_at_end": os.getloadavg()}


def messages(rounds: int) -> dict[str, int]:
    """Messages the cloud sends per W1 run: profiles, train, evaluation (round 0 too)."""
    clients, edges = W1["clients"], W1["groups"][0]
    per_round = W1["global_period"] // W1["local_period"]
    return {"flower, a node per client": clients * (1 + rounds * per_round + rounds + 1),
            "flower --edge-servers": edges * (1 + rounds + rounds + 1)}


def print_table(report: dict[str, Any]) -> None:
    print(f"\nW1, {report['workload']['rounds']} cloud rounds, medians of {report['repeats']} "
          "alternated runs, each a fresh process")
    print(f"{'row':<38}{'window s':>9}{'x plain':>9}{'command s':>11}{'x plain':>9}"
          f"{'test acc':>10}")
    for name, row in report["rows"].items():
        print(f"{name:<38}{row['window_median']:>9.2f}{row['window_vs_plain']:>8.2f}x"
              f"{row['command_median']:>11.2f}{row['command_vs_plain']:>8.2f}x"
              f"{row['final_test_accuracy']:>10.4f}")
    print("\nphases of the Flower rows (medians, seconds): interpreter+imports | run imports "
          "and set-up | ray.init | actors to round 0 | window | after")
    for name, row in report["rows"].items():
        if "phases_median" in row:
            p = row["phases_median"]
            print(f"{name:<38}" + " | ".join(f"{p[k]:6.2f}" for k in (
                "interpreter_and_imports", "run_imports_and_setup", "ray_init",
                "actors_to_round_0", "window", "after_window")))
    print("messages per run:", report["messages_per_run"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=W1["rounds"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cluster", dest="cluster", action="store_false",
                        help="leave out the row that joins a running Ray cluster")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-runs", type=Path, default=None,
                        help="only tabulate the runs logged in this .runs.jsonl")
    parser.add_argument("--worker", choices=("clients", "edges", "edges-cluster"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(flower_worker(args.worker, args.rounds,
                                                   args.ray_address)), flush=True)
        return 0
    if args.from_runs:  # tabulate the runs a (partial) measurement logged
        raw: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
        for line in args.from_runs.read_text().splitlines():
            run = json.loads(line)
            raw[run.pop("row")].append(run)
    else:
        raw = measure(args)
    report = tabulate(args, raw)
    print_table(report)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

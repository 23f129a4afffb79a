"""Engines side by side on W1 (or W2), and the vectorized engine's scaling (``make bench``).

W1: digits, 100 clients, Dirichlet(alpha=0.5) partition, 10 edges (random grouping), mlp
64-128-10, I=5, G=20, batch 16, lr 0.1, 10 cloud rounds = 100 x 200 = 20,000 client SGD steps.
(``min_partition_size`` is 3: digits' 1,437 training rows cannot give 100 Dirichlet clients the
default 10 rows each; 64 of the 100 clients hold fewer than 16 rows and use all of them.)

Measured, each in a fresh Python process (so peak memory is per engine):

(a) ``plain``: a hand-written PyTorch loop over clients, as a researcher writes it without a
    framework: deep-copy the edge model, ``torch.optim.SGD`` per client, the same edge/cloud
    schedule and grouping, averaging state dicts in Python. Mini-batches are indexed from
    in-memory tensors with fedhier's ``batch_indices`` (no DataLoader), so this loop is if
    anything optimistic.
(b) ``inprocess``: fedhier's Flower strategy + ClientApp on the in-process Grid.
(c) ``flower``: Flower's Simulation Engine on Ray.
(d) ``vectorized``: fedhier's batched engine.

Timed window, the same for all four: from the record of cloud round 0 (initial model
evaluated) to the record of the last cloud round. It contains every local step, every edge and
cloud aggregation, and the per-round evaluation every engine does (the global model on all
clients' training rows and on the test set). It excludes imports, data loading, model set-up,
Ray's start-up, and the final save/plot. Each engine first does an untimed one-round warm-up run
(except flower), then one timed run; ``--repeats`` passes over the engines, interleaved so
that a busy spell on a shared machine hits every engine alike, and the table reports the
median. Wall time is the headline; CPU time of the process (``time.process_time``, one torch
thread) is reported too, as it is less sensitive to other load (flower: the driver only).

Every engine's row shows its window and whole-command seconds (the worker process less its
untimed warm-up run), steps/s, its ratio to the plain loop and its fraction of the float32
matmul peak measured in the same run (useful FLOPs over the window / peak GFLOP/s; also by
CPU time: the window's CPU seconds against the matmul's CPU-time rate);
plain and vectorized are measured again side by side at 2 threads (against the 2-thread peak).

Run ``python benchmarks/engines.py`` (all), ``--quick`` (3 rounds, no flower, no 10,000
clients, no 2-thread runs), ``--skip-flower`` or ``--engines plain,inprocess`` (a subset: only
the table); results go to benchmarks/results/engines.json (``--out`` to change).
``--profile`` adds one untimed cProfile run of inprocess and vectorized. ``--device cuda``
runs the fedhier engines on that device (the plain loop stays on the cpu); the device used is
printed.

``--workload w2``: workload W2, where the model dominates (Fashion-MNIST from the Debian
package, 1,000 clients, Dirichlet(0.5), 100 edges, ``cnn``, I=5, G=10, batch 16, one cloud
round = 10,000 client SGD steps): plain, inprocess and vectorized (whole, and in chunks of
``--client-chunk`` clients, default 100), one pass each after a 20-client warm-up run, with
steps/s, the ratio to the plain loop and the fraction of the matmul peak; the useful FLOPs
per example are counted from the model's Conv2d and Linear layers (:func:`model_macs`). It
takes 10-20 minutes on 2 cores, so it is not part of the default run (results:
benchmarks/results/engines_w2.json). ``benchmarks/profile_cnn.py`` profiles one W2 step.

``--batched-seeds 5``: only K seeds of W1 batched into one computation against K separate
runs, interleaved pairs, each in a fresh process (benchmarks/batched_seeds.py; results:
benchmarks/results/engines_seeds.json).

``--scale 1000,10000,100000``: only the vectorized engine on W1 replicated to each client
count (``--client-chunk``, default 0 = the engine's automatic chunk), each in a fresh
process: steps/s, peak RSS (``ru_maxrss``) and bytes per client (results:
benchmarks/results/engines_scale.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedhier.engines.registry import engine_names

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engines.json"
ENGINES = ("plain", *engine_names())  # plain: the baseline loop below, not a fedhier engine
PROFILED = ("inprocess", "vectorized")
SEED_MODES = ("seeds-batched", "seeds-separate")  # workers of --batched-seeds
W1: dict[str, Any] = dict(
    dataset="digits", clients=100, groups=(10,), partition="dirichlet", alpha=0.5,
    min_partition_size=3, model="mlp", local_period=5, global_period=20, batch_size=16, lr=0.1,
    rounds=10, seed=0)
#: MACs per example of mlp 64-128-10 (weights; biases and ReLU not counted); equal to
#: ``model_macs`` of W1's model (tests/test_benchmarks_flops.py).
MLP_MACS = 64 * 128 + 128 * 10
FLOPS_PER_EXAMPLE = 3 * 2 * MLP_MACS  # forward 2*MACs + backward 4*MACs
FLOPS_FORMULA = ("3 x 2 x MACs per example per step, MACs = 64*128 + 128*10 = 9,472 "
                 "(forward 2*MACs, backward 4*MACs), summed over each client's real rows b_j")
#: Workload W2 (``--workload w2``), where the model dominates: Fashion-MNIST (the Debian
#: package's 60,000 real 28x28 training images), 1,000 clients, Dirichlet(0.5), 100 edges,
#: ``cnn`` (conv 16, pool, conv 32, pool, linear: 1.03 M MACs per example), I=5, G=10,
#: batch 16, one cloud round = 10,000 client SGD steps.
W2: dict[str, Any] = dict(
    dataset="fashion-mnist", clients=1000, groups=(100,), partition="dirichlet", alpha=0.5,
    model="cnn", local_period=5, global_period=10, batch_size=16, lr=0.05, rounds=1, seed=0)
#: W2's untimed warm-up run (the same model and data at 20 clients: a full-size warm-up
#: would double every engine's time).
W2_WARMUP: dict[str, Any] = dict(clients=20, groups=(2,), rounds=1)
#: W2's vectorized engine is measured whole and with this ``--client-chunk`` too.
W2_CHUNK = 100
WORKLOADS = {"w1": W1, "w2": W2}


def model_macs(model: Any, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Multiply-accumulates per example of every Conv2d and Linear layer of ``model``
    (layer name -> MACs), counted from the layers' shapes in one forward pass of one example:
    a convolution costs (output elements) x (in_channels / groups) x kernel area, a linear
    layer in x out. Biases, activations and pooling are not counted."""
    import torch
    from torch import nn

    macs: dict[str, int] = {}
    hooks = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Conv2d):
            def conv_hook(mod: Any, _inp: Any, out: Any, name: str = name) -> None:
                kh, kw = mod.kernel_size
                macs[name] = int(out[0].numel()) * mod.in_channels // mod.groups * kh * kw
            hooks.append(layer.register_forward_hook(conv_hook))
        elif isinstance(layer, nn.Linear):
            def linear_hook(mod: Any, _inp: Any, out: Any, name: str = name) -> None:
                macs[name] = mod.in_features * mod.out_features
            hooks.append(layer.register_forward_hook(linear_hook))
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    return macs


def workload_flops(cfg: Any) -> tuple[int, str]:
    """(useful FLOPs per example and step, the formula) of ``cfg``'s model: 3 x 2 x MACs
    (forward 2 x MACs, backward 4 x MACs: input and weight gradients), MACs from
    :func:`model_macs`."""
    from fedhier.data import load_data
    from fedhier.models import build_model

    bundle = load_data(cfg.dataset, seed=cfg.seed)
    shape = tuple(bundle.input_shape)
    macs = model_macs(build_model(cfg.model, shape, bundle.num_classes), shape)
    total = sum(macs.values())
    terms = " + ".join(f"{name} {m:,}" for name, m in macs.items())
    return 3 * 2 * total, (f"3 x 2 x MACs per example per step, MACs of {cfg.model} on "
                           f"{list(shape)} = {terms} = {total:,} (counted from the layers; "
                           f"forward 2*MACs, backward 4*MACs), summed over each client's "
                           f"real rows b_j")


# ------------------------------------------------------------------------------ workers
def w1_config(rounds: int, workload: str = "w1", **changes: Any) -> Any:
    from fedhier.config import RunConfig

    return RunConfig(**{**WORKLOADS[workload], "rounds": rounds, **changes})


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """Current resident memory of this process."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Marks:
    """(round, wall, cpu) at every cloud-round record; the timed window is first -> last."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, float, float]] = []

    def mark(self, cloud_round: int) -> None:
        self.marks.append((cloud_round, time.perf_counter(), time.process_time()))

    def window(self) -> dict[str, float]:
        (_, w0, c0), (_, w1, c1) = self.marks[0], self.marks[-1]
        return {"wall": w1 - w0, "cpu": c1 - c0}


def instrument_recorder(marks: Marks) -> None:
    """Mark every record the engines write through RunRecorder (benchmark-only patch)."""
    from fedhier.run_recorder import RunRecorder

    original = RunRecorder.record_round

    def record_round(self: Any, record: dict[str, Any]) -> None:
        original(self, record)
        marks.mark(int(record["round"]))

    RunRecorder.record_round = record_round  # type: ignore[method-assign]


def plain_loop(cfg: Any, marks: Marks) -> float:
    """(a) A hand-written PyTorch H-SGD loop over clients; returns the final test accuracy."""
    import numpy as np
    import torch
    import torch.nn.functional as F  # noqa: N812 - the usual alias

    from fedhier.aggregate import client_weights
    from fedhier.grouping import ClientInfo
    from fedhier.run_setup import initial_model, prepare
    from fedhier.topology import build_hierarchy
    from fedhier.train import batch_indices

    fed = prepare(cfg)
    cpu = torch.device("cpu")
    data = [fed.client_tensors(j, cpu) for j in range(cfg.clients)]
    x_test, y_test = fed.test_tensors(cpu)
    hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping,
                                ClientInfo(fed.label_histograms, fed.client_sizes()), cfg.seed)
    edge_of = hierarchy.edge_of_client()
    weights = client_weights(cfg.weighting, fed.client_sizes())
    model = initial_model(cfg, fed)

    def evaluate(cloud_round: int) -> float:
        with torch.no_grad():
            losses, accs = [], []
            for x, y in data:
                logits = model(x)
                losses.append(float(F.cross_entropy(logits, y)))
                accs.append(float((logits.argmax(1) == y).float().mean()))
            _ = float(np.dot(weights, losses) / weights.sum())  # train loss, as the engines do
            logits = model(x_test)
            _ = float(F.cross_entropy(logits, y_test))
            accuracy = float((logits.argmax(1) == y_test).float().mean())
        marks.mark(cloud_round)
        return accuracy

    accuracy = evaluate(0)
    edge_rounds = cfg.global_period // cfg.local_period
    for cloud_round in range(1, cfg.rounds + 1):
        edge_models = [copy.deepcopy(model) for _ in range(hierarchy.num_nodes(1))]
        for k in range(edge_rounds):
            start = ((cloud_round - 1) * edge_rounds + k) * cfg.local_period
            states = []
            for j, (x, y) in enumerate(data):
                local = copy.deepcopy(edge_models[edge_of[j]])
                opt = torch.optim.SGD(local.parameters(), lr=cfg.lr)
                for rows in batch_indices(cfg.seed, j, len(y), cfg.batch_size, start,
                                          cfg.local_period):
                    opt.zero_grad()
                    loss = F.cross_entropy(local(x[rows]), y[rows])
                    loss.backward()
                    opt.step()
                states.append(local.state_dict())
            level = hierarchy.level_after(start + cfg.local_period - 1)
            owner = hierarchy.ancestors(level)
            edge_owner = hierarchy.edges_under(level)
            for node in range(hierarchy.num_nodes(level)):
                members = np.flatnonzero(owner == node)
                total = weights[members].sum()
                average = {key: sum(weights[j] * states[j][key] for j in members) / total
                           for key in states[0]}
                for edge in np.flatnonzero(edge_owner == node):
                    edge_models[edge].load_state_dict(average)
        model.load_state_dict(edge_models[0].state_dict())  # the cloud average
        accuracy = evaluate(cloud_round)
    return accuracy


def run_engine(name: str, cfg: Any, marks: Marks, federation: Any = None) -> float:
    """Run fedhier engine ``name`` in a temporary run folder; returns the final test accuracy."""
    from fedhier.run_folder import RunFolder

    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        folder = RunFolder.create(Path(tmp) / "run")
        if name == "vectorized":
            from fedhier.engines.vectorized import run_vectorized

            summary = run_vectorized(cfg.replace(engine="vectorized"), folder, progress=False,
                                     federation=federation)
        else:  # inprocess, flower, or any engine registered later: its registered runner
            from fedhier.engines.registry import get_engine

            summary = get_engine(name).load()(cfg.replace(engine=name), folder, progress=False)
    return float(summary["final_test_accuracy"])


def replicated_federation(cfg: Any, clients: int) -> Any:
    """W1's 100-client partition tiled to ``clients`` clients: client j holds the rows of W1
    client j mod 100 (with its own batch order, drawn from its own id)."""
    from fedhier.federation import Federation
    from fedhier.run_setup import prepare

    base = prepare(w1_config(1))
    parts = [base.partitions[j % len(base.partitions)] for j in range(clients)]
    return Federation(bundle=base.bundle, partitions=parts)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns what the parent tabulates."""
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"engine": args.worker, "threads": args.threads}
    if args.worker == "matmul":
        return {**out, **matmul_peak(args.threads)}
    marks = Marks()
    if args.worker != "plain":
        instrument_recorder(marks)
    if args.worker == "scaling":
        return {**out, **scaling_run(args, marks, load_before)}
    cfg = w1_config(args.rounds, args.workload,
                    **({} if args.worker == "plain" else {"device": args.device}))
    if args.worker == "vectorized" and args.workload == "w2":
        cfg = cfg.replace(client_chunk=args.client_chunk)
    repeats = 1 if args.worker == "flower" else args.repeats
    untimed_start = time.perf_counter()
    if args.worker != "flower":  # warm-up: lazy initialisation, caches, allocator
        warm = cfg.replace(**(W2_WARMUP if args.workload == "w2" else {"rounds": 1}))
        if args.worker == "plain":
            plain_loop(warm, marks)
        else:
            run_engine(args.worker, warm, marks)
    untimed = time.perf_counter() - untimed_start
    out["rss_before_mb"] = rss_mb()
    windows, accuracy = [], float("nan")
    for _ in range(repeats):
        marks.marks.clear()
        if args.worker == "plain":
            accuracy = plain_loop(cfg, marks)
        else:
            accuracy = run_engine(args.worker, cfg, marks)
        windows.append(marks.window())
    if args.profile and args.worker in PROFILED:  # one more, untimed run under cProfile
        untimed_start = time.perf_counter()
        profiled(lambda: run_engine(args.worker, cfg, Marks()), out)
        untimed += time.perf_counter() - untimed_start
    out.update(windows=windows, untimed_seconds=untimed, final_test_accuracy=accuracy,
               peak_rss_mb=peak_rss_mb(),
               load_before=load_before, load_after=os.getloadavg()[0])
    return out


def scaling_run(args: argparse.Namespace, marks: Marks, load_before: float) -> dict[str, Any]:
    """One vectorized run of W1 replicated to ``args.clients`` clients, in this process.

    Peak RSS (``ru_maxrss``) is this process's: the imports, a one-round 100-client warm-up
    run, building the federation and the run itself. ``rss_before_mb`` is the resident memory
    just before the measured run starts (imports and warm-up, no federation yet).
    """
    small = w1_config(1, device=args.device)  # warm-up: lazy initialisation, at small size
    run_engine("vectorized", small, marks, replicated_federation(small, small.clients))
    marks.marks.clear()
    rss_before = rss_mb()
    start = time.perf_counter()
    cfg = w1_config(args.rounds, clients=args.clients, groups=(max(1, args.clients // 10),),
                    client_chunk=args.client_chunk, device=args.device)
    fed = replicated_federation(cfg, args.clients)
    federation_seconds = time.perf_counter() - start
    run_engine("vectorized", cfg, marks, fed)
    total = time.perf_counter() - start
    window = marks.window()
    edge_rounds = args.rounds * cfg.global_period // cfg.local_period
    return dict(clients=args.clients, edges=max(1, args.clients // 10), rounds=args.rounds,
                client_chunk=args.client_chunk, device=device_name(args.device),
                window=window, seconds_per_edge_round=window["wall"] / edge_rounds,
                client_steps_per_s=args.clients * args.rounds * cfg.global_period
                / window["wall"], federation_seconds=federation_seconds,
                setup_seconds=marks.marks[0][1] - start, total_seconds=total,
                rss_before_mb=rss_before, peak_rss_mb=peak_rss_mb(),
                load_before=load_before, load_after=os.getloadavg()[0])


def device_name(device: str) -> str:
    """The device ``--device`` resolves to here, with the GPU's name for CUDA."""
    import torch

    from fedhier.train import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return f"{resolved} ({torch.cuda.get_device_name(resolved)})"
    return str(resolved)


def profiled(run: Any, out: dict[str, Any]) -> float:
    """Run under cProfile; keep the top functions by own time in ``out['profile']``."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    accuracy = profile.runcall(run)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    out["profile"] = text.getvalue()
    return float(accuracy)


def matmul_peak(threads: int, size: int = 2048, repeats: int = 7) -> dict[str, Any]:
    """float32 matmul throughput of square size x size matrices (median of ``repeats``)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"matmul_size": size, "matmul_gflops": 2 * size**3 / statistics.median(times) / 1e9,
            "matmul_best_gflops": 2 * size**3 / min(times) / 1e9,
            "matmul_cpu_gflops": 2 * size**3 / statistics.median(cpu_times) / 1e9}


# ------------------------------------------------------------------------------ parent
def run_worker(cmd: list[str], name: str) -> tuple[dict[str, Any], float]:
    """Run a worker command in a fresh interpreter: (its last ``RESULT {json}`` line, the
    whole command's wall seconds); a failed worker raises with its output's tail."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "FLWR_TELEMETRY_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {name} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):])), seconds


def spawn(name: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """Run one worker in a fresh interpreter and return its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
           "--rounds", str(extra.pop("rounds", args.rounds)),
           "--repeats", str(extra.pop("repeats", args.repeats)),
           "--threads", str(extra.pop("threads", args.threads))]
    if args.workload != "w1":
        cmd += ["--workload", args.workload]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.profile and name in PROFILED:
        cmd.append("--profile")
    print(f"  running {name} {extra or ''} ...", flush=True)
    result, seconds = run_worker(cmd, name)
    if "untimed_seconds" in result:  # the whole command: the process less its warm-up
        result["command_seconds"] = seconds - result["untimed_seconds"]
    return dict(result)


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's results from several worker processes, as if from one."""
    merged = dict(runs[0])
    merged["windows"] = [w for run in runs for w in run["windows"]]
    merged["command_seconds"] = [run["command_seconds"] for run in runs
                                 if "command_seconds" in run]
    merged["peak_rss_mb"] = max(run["peak_rss_mb"] for run in runs)
    merged["rss_before_mb"] = max(run["rss_before_mb"] for run in runs)
    merged["load_before"] = [run["load_before"] for run in runs]
    merged["load_after"] = [run["load_after"] for run in runs]
    return merged


def summarise(result: dict[str, Any], steps: int) -> dict[str, Any]:
    walls = [w["wall"] for w in result["windows"]]
    cpus = [w["cpu"] for w in result["windows"]]
    wall = statistics.median(walls)
    commands = result.get("command_seconds", [])
    return {"window_seconds": walls, "median_seconds": wall,
            "command_seconds": commands,
            "command_seconds_median": statistics.median(commands) if commands else None,
            "cpu_seconds_median": statistics.median(cpus),
            "client_sgd_steps_per_s": steps / wall, "peak_rss_mb": result["peak_rss_mb"],
            "rss_before_timing_mb": result["rss_before_mb"],
            "final_test_accuracy": result["final_test_accuracy"],
            "load_average_before_after": [result["load_before"], result["load_after"]],
            **({"profile": result["profile"]} if "profile" in result else {})}


def machine() -> dict[str, Any]:
    import torch

    model = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "gpu": torch.cuda.is_available(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_start": os.getloadavg()}


def w1_stats(workload: str = "w1") -> dict[str, Any]:
    """Rows per client, and the rows of one step of every client (summed b_j)."""
    import numpy as np

    from fedhier.run_setup import prepare
    from fedhier.train import effective_batch_size

    cfg = w1_config(WORKLOADS[workload]["rounds"], workload)
    sizes = prepare(cfg).client_sizes()
    batch = np.array([effective_batch_size(cfg.batch_size, int(m)) for m in sizes])
    return {"client_rows_min_median_max": [int(sizes.min()), int(np.median(sizes)),
                                           int(sizes.max())],
            "clients_with_fewer_rows_than_batch": int((sizes < cfg.batch_size).sum()),
            "mean_rows_per_step": float(batch.mean()), "rows_per_step_total": int(batch.sum())}


def parent(args: argparse.Namespace) -> dict[str, Any]:
    steps_per_run = W1["clients"] * args.rounds * W1["global_period"]
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "threads": args.threads, "repeats": args.repeats,
        "workload": {**{k: list(v) if isinstance(v, tuple) else v for k, v in W1.items()},
                     "rounds": args.rounds, "client_sgd_steps": steps_per_run, **w1_stats()},
        "timed_window": "cloud-round-0 record -> last cloud-round record: local steps, "
                        "aggregations and per-round evaluation (train metrics over all clients "
                        "+ test set); excludes imports, data loading, set-up, Ray start-up, "
                        "final save/plot. flower: one run; others: median over interleaved passes, "
                        "each a fresh process with a one-round warm-up run.",
    }
    report["device"] = device_name(args.device)
    print(f"W1 on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"{args.threads} torch thread(s), device {report['device']} (plain loop: cpu), "
          f"load average {os.getloadavg()[0]:.2f}")
    engines = [e for e in args.engines if not (e == "flower" and (args.skip_flower or args.quick))]
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # interleaved, so a busy spell hits every engine alike
        for name in engines:
            if name != "flower" or not raw[name]:
                raw[name].append(spawn(name, args, repeats=1))
    results = {name: summarise(merge(runs), steps_per_run) for name, runs in raw.items()}
    plain = results["plain"]
    for res in results.values():
        res["speedup_vs_plain"] = plain["median_seconds"] / res["median_seconds"]
        res["cpu_speedup_vs_plain"] = plain["cpu_seconds_median"] / res["cpu_seconds_median"]
    report["engines"] = results
    peak = spawn("matmul", args)
    flops = report["workload"]["rows_per_step_total"] * FLOPS_PER_EXAMPLE * (
        args.rounds * W1["global_period"])
    for res in results.values():  # useful FLOPs / window, against the matmul peak
        res["fraction_of_peak"] = flops / res["median_seconds"] / 1e9 / peak["matmul_gflops"]
        res["fraction_of_peak_cpu"] = (flops / res["cpu_seconds_median"] / 1e9
                                       / peak["matmul_cpu_gflops"])
    report["matmul_peak_gflops"] = peak["matmul_gflops"]
    report["matmul_peak_cpu_gflops"] = peak["matmul_cpu_gflops"]
    if "vectorized" not in results:  # a subset (--engines): the table and inprocess' target
        for key, speedup in (("targets", "speedup_vs_plain"),
                             ("targets_by_cpu_time", "cpu_speedup_vs_plain")):
            report[key] = ({"inprocess_no_slower_than_1.5x_plain":
                            results["inprocess"][speedup] >= 1 / 1.5}
                           if "inprocess" in results else {})
        return report
    peak2 = spawn("matmul", args, threads=2) if args.threads != 2 else peak
    if args.threads != 2 and not args.quick:  # plain and vectorized, side by side at 2 threads
        two: dict[str, list[dict[str, Any]]] = {"plain": [], "vectorized": []}
        for _ in range(args.repeats):
            for name in two:
                two[name].append(spawn(name, args, threads=2, repeats=1))
        plain2 = summarise(merge(two["plain"]), steps_per_run)
        for name, runs in two.items():
            extra = summarise(merge(runs), steps_per_run)
            extra["speedup_vs_plain"] = plain["median_seconds"] / extra["median_seconds"]
            extra["cpu_speedup_vs_plain"] = (plain["cpu_seconds_median"]
                                             / extra["cpu_seconds_median"])
            extra["speedup_vs_plain_2_threads"] = (plain2["median_seconds"]
                                                   / extra["median_seconds"])
            extra["fraction_of_peak"] = (flops / extra["median_seconds"] / 1e9
                                         / peak2["matmul_gflops"])
            report[f"{name}_2_threads"] = extra
    vec = results["vectorized"]
    report["vectorized_flops"] = {
        "formula": FLOPS_FORMULA, "flops_per_example": FLOPS_PER_EXAMPLE,
        "useful_gflop_per_run": flops / 1e9,
        "achieved_gflops": flops / vec["median_seconds"] / 1e9,
        "matmul_peak_gflops": peak["matmul_gflops"],
        "fraction_of_peak": flops / vec["median_seconds"] / 1e9 / peak["matmul_gflops"],
        "matmul_peak_gflops_2_threads": peak2["matmul_gflops"],
        "note": "achieved = useful FLOPs / timed window (the window also holds evaluation and "
                "aggregation); the engine pads every client to 16 rows and skips the input "
                "gradient of the first layer, so executed FLOPs differ from useful ones",
    }
    counts = [] if args.skip_scaling else [100, 1000] if args.quick else [100, 1000, 10000]
    rounds = {100: max(2, min(args.rounds, 5)), 1000: 2, 10000: 1}
    scaling = [spawn("scaling", args, clients=n, rounds=rounds[n], device=args.device)
               for n in counts]
    for n in () if args.skip_scaling else [1000] if args.quick else [1000, 10000]:
        # all clients in one chunk: what the automatic chunk saves
        scaling.append(spawn("scaling", args, clients=n, rounds=rounds[n], client_chunk=n,
                             device=args.device))
    report["scaling"] = {
        "workload": "W1 replicated: client j holds the rows of W1 client j mod 100 (its own "
                    "batch order), 10 clients per edge, random grouping; per-client work equals "
                    "W1's, so time per edge round should grow linearly with clients",
        "runs": scaling}
    inproc = results.get("inprocess")  # --engines may leave it out
    report["targets"] = {
        "vectorized_steps_per_s>=25000": vec["client_sgd_steps_per_s"] >= 25000,
        "vectorized>=30x_plain": vec["speedup_vs_plain"] >= 30,
        "10000_clients_ran": any(r["clients"] == 10000 for r in scaling),
    }
    report["targets_by_cpu_time"] = {
        "vectorized_steps_per_cpu_s>=25000": steps_per_run / vec["cpu_seconds_median"] >= 25000,
        "vectorized>=30x_plain": vec["cpu_speedup_vs_plain"] >= 30,
    }
    if inproc is not None:
        report["targets"]["inprocess_no_slower_than_1.5x_plain"] = (
            inproc["speedup_vs_plain"] >= 1 / 1.5)
        report["targets_by_cpu_time"]["inprocess_no_slower_than_1.5x_plain"] = (
            inproc["cpu_speedup_vs_plain"] >= 1 / 1.5)
    return report


def parent_w2(args: argparse.Namespace) -> dict[str, Any]:
    """``--workload w2``: plain, inprocess and vectorized (whole, and in chunks of
    ``--client-chunk`` clients, default 100) on W2, each in a fresh process, interleaved over
    ``--repeats`` passes; steps/s, ratio to the plain loop, fraction of the matmul peak."""
    cfg = w1_config(args.rounds, "w2")
    steps_per_run = cfg.clients * args.rounds * cfg.global_period
    flops_per_example, formula = workload_flops(cfg)
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "threads": args.threads, "repeats": args.repeats,
        "workload": {**{k: list(v) if isinstance(v, tuple) else v for k, v in W2.items()},
                     "name": "W2", "rounds": args.rounds, "client_sgd_steps": steps_per_run,
                     "warm_up": {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in W2_WARMUP.items()},
                     **w1_stats("w2")},
        "timed_window": "cloud-round-0 record -> last cloud-round record, as W1 (local steps, "
                        "aggregations, evaluation on all clients' rows + test set); each engine "
                        "a fresh process after an untimed 20-client warm-up run",
        "device": device_name(args.device),
    }
    print(f"W2 on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"{args.threads} torch thread(s), device {report['device']} (plain loop: cpu), "
          f"{args.rounds} cloud round(s) = {steps_per_run:,} client steps, load average "
          f"{os.getloadavg()[0]:.2f}")
    chunk = args.client_chunk or W2_CHUNK
    runs: dict[str, tuple[str, dict[str, Any]]] = {
        "plain": ("plain", {}), "inprocess": ("inprocess", {}),
        "vectorized": ("vectorized", {"client_chunk": 0}),
        f"vectorized, chunk {chunk}": ("vectorized", {"client_chunk": chunk})}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (engine, extra) in runs.items():
            raw[name].append(spawn(engine, args, repeats=1, **extra))
    results = {name: summarise(merge(r), steps_per_run) for name, r in raw.items()}
    peak = spawn("matmul", args)
    flops = report["workload"]["rows_per_step_total"] * flops_per_example * (
        args.rounds * cfg.global_period)
    plain = results["plain"]
    for res in results.values():
        res["speedup_vs_plain"] = plain["median_seconds"] / res["median_seconds"]
        res["cpu_speedup_vs_plain"] = plain["cpu_seconds_median"] / res["cpu_seconds_median"]
        res["fraction_of_peak"] = flops / res["median_seconds"] / 1e9 / peak["matmul_gflops"]
        res["achieved_gflops"] = flops / res["median_seconds"] / 1e9
    report["engines"] = results
    report["flops"] = {"formula": formula, "flops_per_example": flops_per_example,
                       "useful_gflop_per_run": flops / 1e9,
                       "matmul_peak_gflops": peak["matmul_gflops"]}
    report["load_average_at_end"] = os.getloadavg()
    return report


def print_w2(report: dict[str, Any]) -> None:
    print(f"\ndevice: {report['device']} (plain loop: cpu); fraction of peak = useful GFLOP/s "
          f"over the window / measured float32 matmul GFLOP/s at the same threads")
    print(f"{'engine':<24}{'seconds':>9}{'steps/s':>9}{'vs plain':>10}{'GFLOP/s':>9}"
          f"{'of peak':>9}{'CPU s':>8}{'CPU vs plain':>14}{'peak RSS MB':>13}{'test acc':>10}")
    for name, res in report["engines"].items():
        print(f"{name:<24}{res['median_seconds']:>9.2f}{res['client_sgd_steps_per_s']:>9,.1f}"
              f"{res['speedup_vs_plain']:>9.2f}x{res['achieved_gflops']:>9.1f}"
              f"{res['fraction_of_peak']:>9.1%}{res['cpu_seconds_median']:>8.2f}"
              f"{res['cpu_speedup_vs_plain']:>13.2f}x{res['peak_rss_mb']:>13,.0f}"
              f"{res['final_test_accuracy']:>10.4f}")
    f = report["flops"]
    print(f"\nuseful FLOPs: {f['useful_gflop_per_run']:.1f} GFLOP per run; {f['formula']}; "
          f"float32 matmul peak {f['matmul_peak_gflops']:.1f} GFLOP/s")


def parent_scale(args: argparse.Namespace) -> dict[str, Any]:
    """``--scale N1,N2,...``: the vectorized engine on W1 replicated to each client count,
    each in a fresh process (so ``ru_maxrss`` is that size's peak), chunked by
    ``--client-chunk`` (default 0: the engine's automatic chunk)."""
    chunk = args.client_chunk
    print(f"scale: W1 replicated, vectorized, {args.threads} torch thread(s), device "
          f"{device_name(args.device)}, client_chunk {chunk or 'auto'}, {args.rounds} cloud "
          f"round(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    runs = [spawn("scaling", args, clients=n, repeats=1, client_chunk=min(chunk, n),
                  device=args.device) for n in args.scale]
    for previous, run in zip([None, *runs[:-1]], runs, strict=True):
        run["bytes_per_client"] = (run["peak_rss_mb"] - run["rss_before_mb"]) * 2**20 / run[
            "clients"]
        run["marginal_bytes_per_client"] = (
            None if previous is None else (run["peak_rss_mb"] - previous["peak_rss_mb"])
            * 2**20 / (run["clients"] - previous["clients"]))
    return {"command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
            "machine": machine(), "threads": args.threads, "device": device_name(args.device),
            "scale": {
                "workload": "W1 replicated: client j holds the rows of W1 client j mod 100 "
                            "(its own batch order), 10 clients per edge, random grouping, "
                            "mlp 64-128-10 (9,610 parameters = 37.5 KiB per client model)",
                "memory": "peak_rss_mb: ru_maxrss of the fresh worker process; "
                          "bytes_per_client = (peak - RSS before the measured run) / clients; "
                          "marginal = peak difference / client difference to the previous size",
                "runs": runs}}


def print_scale(report: dict[str, Any]) -> None:
    print(f"\ndevice: {report['device']}")
    print(f"{'clients':>9}{'chunk':>7}{'steps/s':>10}{'s/edge round':>14}{'set-up s':>10}"
          f"{'RSS before MB':>15}{'peak RSS MB':>13}{'bytes/client':>14}{'marginal B/client':>19}")
    for run in report["scale"]["runs"]:
        marginal = run["marginal_bytes_per_client"]
        print(f"{run['clients']:>9,}{run['client_chunk'] or 'auto':>7}"
              f"{run['client_steps_per_s']:>10,.0f}"
              f"{run['seconds_per_edge_round']:>14.3f}{run['setup_seconds']:>10.1f}"
              f"{run['rss_before_mb']:>15,.0f}{run['peak_rss_mb']:>13,.0f}"
              f"{run['bytes_per_client']:>14,.0f}"
              f"{'-' if marginal is None else f'{marginal:,.0f}':>19}")


def print_report(report: dict[str, Any]) -> None:
    print()
    print(f"device: {report.get('device', 'cpu')} (plain loop: cpu); fraction of peak = useful "
          f"GFLOP/s over the window / measured float32 matmul GFLOP/s at the same threads")
    print(f"{'engine':<22}{'window s':>9}{'command s':>10}{'steps/s':>10}{'vs plain':>10}"
          f"{'of peak':>9}{'CPU s':>8}{'CPU vs plain':>14}{'of peak (CPU)':>15}"
          f"{'peak RSS MB':>13}{'test acc':>10}")
    rows = list(report["engines"].items())
    for name in ("plain", "vectorized"):
        if f"{name}_2_threads" in report:
            rows.append((f"{name}, 2 threads", report[f"{name}_2_threads"]))
    for name, res in rows:
        of_peak = (f"{res['fraction_of_peak']:>8.1%}" if "fraction_of_peak" in res
                   else f"{'-':>8}")
        command = res.get("command_seconds_median")
        command_s = f"{command:>10.2f}" if command is not None else f"{'-':>10}"
        print(f"{name:<22}{res['median_seconds']:>9.2f}{command_s}"
              f"{res['client_sgd_steps_per_s']:>10,.0f}"
              f"{res['speedup_vs_plain']:>9.1f}x{of_peak:>9}{res['cpu_seconds_median']:>8.2f}"
              f"{res['cpu_speedup_vs_plain']:>13.1f}x"
              f"{res.get('fraction_of_peak_cpu', float('nan')):>15.1%}"
              f"{res['peak_rss_mb']:>13,.0f}{res['final_test_accuracy']:>10.4f}")
    if "vectorized_2_threads" in report and "plain_2_threads" in report:
        print(f"at 2 threads, vectorized is "
              f"{report['vectorized_2_threads']['speedup_vs_plain_2_threads']:.1f}x the plain "
              f"loop at 2 threads")
    print("window s: cloud round 0 -> last round (median); command s: the whole worker process "
          "(interpreter start, imports, data, set-up, the run, final save) less its untimed "
          f"warm-up run; peak {report['matmul_peak_gflops']:.1f} GFLOP/s by wall time, "
          f"{report['matmul_peak_cpu_gflops']:.1f} by CPU time (of peak (CPU): useful GFLOP per "
          "CPU second of the window against it, less sensitive to other load)")
    if "vectorized_flops" not in report:  # an --engines subset
        for key in ("targets", "targets_by_cpu_time"):
            print(f"\n{key}:", ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                         for k, v in report[key].items()))
        return
    f = report["vectorized_flops"]
    print(f"\nvectorized: {f['achieved_gflops']:.1f} GFLOP/s useful ({f['formula']}); float32 "
          f"matmul peak {f['matmul_peak_gflops']:.1f} GFLOP/s ({f['fraction_of_peak']:.0%})")
    if report["scaling"]["runs"]:
        print(f"\n{'clients':>8}{'chunk':>7}{'s/edge round':>14}{'CPU s/edge round':>18}"
              f"{'steps/s':>10}{'peak RSS MB':>13}")
    for run in report["scaling"]["runs"]:
        edge_rounds = run["window"]["wall"] / run["seconds_per_edge_round"]
        print(f"{run['clients']:>8,}{run['client_chunk'] or 'auto':>7}"
              f"{run['seconds_per_edge_round']:>14.3f}"
              f"{run['window']['cpu'] / edge_rounds:>18.3f}{run['client_steps_per_s']:>10,.0f}"
              f"{run['peak_rss_mb']:>13,.0f}")
    for key in ("targets", "targets_by_cpu_time"):
        print(f"\n{key}:", ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                     for k, v in report[key].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 cloud rounds, one repeat, no flower, no 10,000 clients")
    parser.add_argument("--skip-flower", action="store_true", help="skip the Ray engine")
    parser.add_argument("--skip-scaling", action="store_true",
                        help="skip the 100 / 1,000 / 10,000-client scaling table")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated subset of the engines (plain is always run); "
                             "without vectorized: only the engine table and targets")
    parser.add_argument("--rounds", type=int, default=None, help="cloud rounds (default 10)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per engine")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in every worker (default 1)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the inprocess and vectorized runs (one more, untimed "
                             "run each) and print the top functions")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output file (default benchmarks/results/engines.json, "
                             "with --scale engines_scale.json)")
    parser.add_argument("--scale", default="",
                        help="comma-separated client counts (e.g. 1000,10000,100000): only "
                             "the vectorized engine's memory and speed at those sizes")
    parser.add_argument("--client-chunk", type=int, default=0,
                        help="--scale: clients per chunk (default 0: the engine's automatic "
                             "chunk); --workload w2: the chunked vectorized row (default 100)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="w1",
                        help="w1 (default): digits mlp, every engine; w2: the Fashion-MNIST "
                             "cnn at 1,000 clients, plain/inprocess/vectorized only, one cloud "
                             "round and one pass by default (~10 min on 2 cores; "
                             "benchmarks/results/engines_w2.json)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the fedhier engines (cpu, cuda, auto)")
    parser.add_argument("--batched-seeds", type=int, default=0, metavar="K",
                        help="only K seeds of W1 batched into one computation vs K separate "
                             "runs on the vectorized engine (benchmarks/batched_seeds.py)")
    parser.add_argument("--worker", choices=(*ENGINES, "matmul", "scaling", *SEED_MODES),
                        help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=100, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = set(args.engines.split(",")) | {"plain"}
    if not chosen <= set(ENGINES):
        parser.error(f"--engines: unknown {sorted(chosen - set(ENGINES))}; choose from {ENGINES}")
    args.engines = [e for e in ENGINES if e in chosen]
    rounds_given = args.rounds
    w2 = args.workload == "w2"
    args.rounds = args.rounds or (3 if args.quick and not w2 else WORKLOADS[args.workload][
        "rounds"])
    args.repeats = args.repeats or (1 if args.quick or w2 else 3)
    args.scale = [int(n.replace("_", "")) for n in args.scale.split(",") if n]
    if args.worker in SEED_MODES or args.batched_seeds:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from batched_seeds import parent_seeds, print_seeds, seeds_worker

        if args.worker:
            print("RESULT " + json.dumps(seeds_worker(args, w1_config)), flush=True)
            return 0
        report = {"machine": machine(), **parent_seeds(args, spawn)}
        print_seeds(report)
        write_report(report, args.out or RESULTS.with_name("engines_seeds.json"))
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.scale:
        args.rounds = rounds_given or 1
        report = parent_scale(args)
        print_scale(report)
        write_report(report, args.out or RESULTS.with_name("engines_scale.json"))
        return 0
    if w2:
        report = parent_w2(args)
        print_w2(report)
        write_report(report, args.out or RESULTS.with_name("engines_w2.json"))
        return 0
    args.out = args.out or RESULTS
    report = parent(args)
    print_report(report)
    for name in PROFILED if args.profile else ():
        if "profile" in report.get("engines", {}).get(name, {}):
            print(f"\n{name}:\n{report['engines'][name]['profile']}")
    write_report(report, args.out)
    return 0


def write_report(report: dict[str, Any], out: Path) -> None:
    """The report as JSON at ``out`` (folders made), and where it went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())

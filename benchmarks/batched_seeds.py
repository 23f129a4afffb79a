"""Seeds batched into one computation against separate runs (``engines.py --batched-seeds K``).

K seeds of W1 (seeds 0..K-1, ``--rounds`` cloud rounds, ``--threads`` torch threads, default
one) on the vectorized engine, two ways, each in a fresh process after an untimed one-round
warm-up of the same kind:

- ``separate``: K one-seed runs one after another (``run_vectorized``, as K ``fedhier run
  --engine vectorized --seed s`` would, without the K interpreter start-ups);
- ``batched``: the K seeds as one batched computation (``run_seeds``, as ``fedhier run
  --engine vectorized --seeds 0,...,K-1``).

Timed window, the same for both: the wall (and CPU) time of the K runs minus each seed's
set-up (its start to its round-0 record: model, rows, grouping) and finish (its last record
to its end: final model, summary, plots), so that, as in the engine table, the window holds
every local step, aggregation and per-round evaluation of the K seeds. Each seed's data are
loaded before (``prepare``). The seeds run one at a time in the batched mode too (threads that
take turns), so both modes use one core at ``--threads 1``. Pairs (batched, separate) are
interleaved ``--repeats`` times; the speed-up is the median of the pairs' ratios. Each seed's
final test accuracy must agree between the modes (bit-identical runs), else the benchmark
fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

MODES = ("seeds-batched", "seeds-separate")


def timed_runs(cfgs: list[Any], feds: list[Any], batched: bool) -> dict[str, Any]:
    """Run ``cfgs`` both ways' one way in temporary folders; the window and accuracies."""
    from fedhier.engines.vectorized.engine import run_vectorized
    from fedhier.engines.vectorized.seed_batch import run_seeds
    from fedhier.runs.folder import RunFolder
    from fedhier.runs.recorder import RunRecorder

    marks: dict[str, list[tuple[float, float]]] = {}  # run folder -> records' (wall, cpu)
    original = RunRecorder.record_round

    def record_round(self: Any, record: dict[str, Any]) -> None:
        original(self, record)
        marks.setdefault(str(self.folder.path), []).append((time.perf_counter(),
                                                            time.process_time()))

    spans: dict[str, tuple[float, float, float, float]] = {}

    def timed(i: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        start = (time.perf_counter(), time.process_time())
        summary = run()
        spans[str(folders[i].path)] = (*start, time.perf_counter(), time.process_time())
        return summary

    RunRecorder.record_round = record_round  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-seeds-") as tmp:
            folders = [RunFolder.create(Path(tmp) / f"seed{c.seed}") for c in cfgs]
            t0 = (time.perf_counter(), time.process_time())
            if batched:
                results = run_seeds(cfgs, folders, progress=False, wrap=timed, federations=feds)
                errors = [e for _, e in results if e is not None]
                if errors:
                    raise errors[0]
                summaries = [s for s, _ in results]
            else:
                summaries = [timed(i, partial(run_vectorized, cfgs[i], folders[i], False,
                                              federation=feds[i])) for i in range(len(cfgs))]
            t1 = (time.perf_counter(), time.process_time())
    finally:
        RunRecorder.record_round = original  # type: ignore[method-assign]
    window = {}
    for k, name in enumerate(("wall", "cpu")):
        outside = sum((marks[p][0][k] - spans[p][k]) + (spans[p][2 + k] - marks[p][-1][k])
                      for p in spans)
        window[name] = t1[k] - t0[k] - outside
    return {"window": window,
            "final_test_accuracy": [float(s["final_test_accuracy"]) for s in summaries]}


def seeds_worker(args: argparse.Namespace, w1_config: Callable[..., Any]) -> dict[str, Any]:
    """One timed measurement of ``args.worker`` (a mode) in this fresh process."""
    import torch

    from fedhier.runs.prepare import prepare

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    batched = args.worker == "seeds-batched"
    seeds = range(args.batched_seeds)
    warm = [w1_config(1, engine="vectorized", seed=s, device=args.device) for s in seeds]
    cfgs = [c.replace(rounds=args.rounds) for c in warm]
    feds = [prepare(c) for c in cfgs]
    timed_runs(warm if batched else warm[:1], feds if batched else feds[:1], batched)
    result = timed_runs(cfgs, feds, batched)
    return {"engine": args.worker, "threads": args.threads, "seeds": args.batched_seeds,
            "rounds": args.rounds, **result, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def parent_seeds(args: argparse.Namespace, spawn: Callable[..., dict[str, Any]],
                 ) -> dict[str, Any]:
    """Interleaved pairs of (batched, separate) workers; the speed-up of the median pair."""
    pairs = []
    for _ in range(args.repeats):
        pair = {mode: spawn(mode, args, repeats=1, batched_seeds=args.batched_seeds,
                            device=args.device)
                for mode in MODES}
        accuracies = {m: r["final_test_accuracy"] for m, r in pair.items()}
        if accuracies["seeds-batched"] != accuracies["seeds-separate"]:
            raise RuntimeError(f"batched and separate seeds differ: {accuracies}")
        pairs.append(pair)
    ratios = [p["seeds-separate"]["window"]["wall"] / p["seeds-batched"]["window"]["wall"]
              for p in pairs]
    cpu_ratios = [p["seeds-separate"]["window"]["cpu"] / p["seeds-batched"]["window"]["cpu"]
                  for p in pairs]
    return {"batched_seeds": {
        "seeds": args.batched_seeds, "rounds": args.rounds, "threads": args.threads,
        "pairs": pairs, "speedup_wall": ratios, "speedup_cpu": cpu_ratios,
        "median_speedup_wall": statistics.median(ratios),
        "median_speedup_cpu": statistics.median(cpu_ratios),
        "load_average": [p[m]["load_before"] for p in pairs for m in MODES],
        "final_test_accuracy": pairs[0]["seeds-batched"]["final_test_accuracy"]}}


def print_seeds(report: dict[str, Any]) -> None:
    r = report["batched_seeds"]
    print(f"\n{r['seeds']} seeds of W1, {r['rounds']} cloud rounds, {r['threads']} thread(s): "
          "batched vs separate runs (timed window: every seed's rounds)")
    print(f"{'pair':>5}{'separate s':>12}{'batched s':>11}{'speed-up':>10}{'CPU speed-up':>14}"
          f"{'load':>12}")
    for i, pair in enumerate(r["pairs"]):
        sep, bat = pair["seeds-separate"], pair["seeds-batched"]
        print(f"{i + 1:>5}{sep['window']['wall']:>12.2f}{bat['window']['wall']:>11.2f}"
              f"{r['speedup_wall'][i]:>9.2f}x{r['speedup_cpu'][i]:>13.2f}x"
              f"{bat['load_before']:>6.1f}/{sep['load_before']:<5.1f}")
    print(f"median speed-up {r['median_speedup_wall']:.2f}x wall, "
          f"{r['median_speedup_cpu']:.2f}x CPU; final test accuracies (equal both ways): "
          + ", ".join(f"{a:.4f}" for a in r["final_test_accuracy"]))

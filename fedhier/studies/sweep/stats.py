"""Statistics of a sweep: per-run numbers, t-intervals over seeds, paired differences.

An interval is the two-sided Student-t interval mean ± t_{1-a/2, n-1} s / sqrt(n) with s the
sample standard deviation (ddof = 1). A paired difference is taken seed by seed between two
arms run on the same seeds (the same partition, initial model and draws), so the interval is
that of the differences, usually much narrower than the two arms' own intervals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LEVEL = 0.95


def t_interval(values: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """{n, mean, std, low, high} of ``values`` (low/high None when n < 2)."""
    from scipy.stats import t

    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "low": None, "high": None}
    mean = float(x.mean())
    if n < 2:
        return {"n": 1, "mean": mean, "std": None, "low": None, "high": None}
    std = float(x.std(ddof=1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "low": mean - half, "high": mean + half}


def paired(a: Mapping[int, float | None], b: Mapping[int, float | None],
           level: float = LEVEL) -> dict[str, Any]:
    """Interval of a[s] - b[s] over the seeds s both have a value for; ``seeds`` says which."""
    seeds = sorted(s for s in a.keys() & b.keys() if a[s] is not None and b[s] is not None)
    diffs = [float(a[s]) - float(b[s]) for s in seeds]  # type: ignore[arg-type]
    return {**t_interval(diffs, level), "seeds": seeds}


def _bytes(record: Mapping[str, Any]) -> int:
    return int(record.get("client_edge_bytes", 0)) + int(record.get("edge_cloud_bytes", 0))


def run_numbers(records: Sequence[Mapping[str, Any]], target: float | None,
                at_iterations: Sequence[int]) -> dict[str, Any]:
    """One run's numbers from its metrics.jsonl records (cumulative counters).

    ``final_test_accuracy``; ``validation_accuracy`` (mean held-out client accuracy at the
    last round, None without a holdout); ``accuracy_at_<T>`` (the last evaluation at or before
    iteration T, None if the run is shorter); and with a target, the first evaluation reaching
    it: ``to_target_iterations``, ``_rounds``, ``_bytes``, ``_sim_seconds`` (None = never).
    """
    last = records[-1]
    out: dict[str, Any] = {"final_test_accuracy": last["test_accuracy"],
                           "validation_accuracy": last.get("client_accuracy_mean"),
                           "iterations": last["iteration"]}
    for it in at_iterations:
        before = [r for r in records if r["iteration"] <= it]
        out[f"accuracy_at_{it}"] = (before[-1]["test_accuracy"]
                                    if before and last["iteration"] >= it else None)
    if target is not None:
        hit = next((r for r in records if r["test_accuracy"] >= target), None)
        out["reached_target"] = hit is not None
        out["to_target_iterations"] = None if hit is None else hit["iteration"]
        out["to_target_rounds"] = None if hit is None else hit["round"]
        out["to_target_bytes"] = None if hit is None else _bytes(hit)
        out["to_target_sim_seconds"] = None if hit is None else hit.get("sim_seconds")
    return out


def metric_names(target: float | None, at_iterations: Sequence[int]) -> list[str]:
    """The numbers :func:`run_numbers` reports, in table order."""
    names = ["final_test_accuracy", *(f"accuracy_at_{it}" for it in at_iterations)]
    if target is not None:
        names += ["to_target_iterations", "to_target_rounds", "to_target_bytes",
                  "to_target_sim_seconds"]
    return names


def choose(validation: Mapping[str, Sequence[float | None]]) -> str:
    """The tuned value (its name) with the best mean validation accuracy over seeds; ties go
    to the first listed. Only validation numbers reach this function: never test ones."""
    best, best_mean = None, -math.inf
    for name, values in validation.items():
        known = [v for v in values if v is not None]
        if not known:
            continue
        mean = float(np.mean(known))
        if mean > best_mean:
            best, best_mean = name, mean
    if best is None:
        raise ValueError("no tuned value has a validation accuracy (client_holdout = 0?)")
    return best


def band(curves: Sequence[Sequence[Mapping[str, Any]]], key: str = "test_accuracy",
         level: float = LEVEL) -> dict[str, list[float]]:
    """Mean and t-interval per iteration of ``key`` over runs (iterations all runs share)."""
    common = set.intersection(*({r["iteration"] for r in run if r.get(key) is not None}
                                for run in curves))
    its = sorted(common)
    mean, low, high = [], [], []
    for it in its:
        ci = t_interval([next(r[key] for r in run if r["iteration"] == it) for run in curves],
                        level)
        mean.append(ci["mean"])
        low.append(ci["low"] if ci["low"] is not None else ci["mean"])
        high.append(ci["high"] if ci["high"] is not None else ci["mean"])
    return {"iteration": its, "mean": mean, "low": low, "high": high}

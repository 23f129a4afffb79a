"""Mean and standard deviation over seeds of per-round curves and final numbers."""

from __future__ import annotations

from typing import Any

import numpy as np


def curve(records_by_seed: dict[int, list[dict[str, Any]]], key: str) -> dict[str, list]:
    """{iteration, mean, std} of ``key`` over seeds, rounds where every seed has it."""
    runs = list(records_by_seed.values())
    its = [r["iteration"] for r in runs[0] if r.get(key) is not None]
    values = np.array([[next(r[key] for r in run if r["iteration"] == it) for it in its]
                       for run in runs], dtype=np.float64)
    return {"iteration": its, "mean": values.mean(0).tolist(), "std": values.std(0).tolist()}


def final(records_by_seed: dict[int, list[dict[str, Any]]], key: str) -> dict[str, float]:
    """Mean and standard deviation over seeds of ``key`` at the last round."""
    values = np.array([run[-1][key] for run in records_by_seed.values()], dtype=np.float64)
    return {"mean": float(values.mean()), "std": float(values.std()), "n": len(values)}


def first_reaching(curve_: dict[str, list], target: float) -> int | None:
    """First iteration whose mean reaches ``target`` (None if never)."""
    for it, value in zip(curve_["iteration"], curve_["mean"], strict=True):
        if value >= target:
            return int(it)
    return None


def mean_std(value: dict[str, float], digits: int = 4, scale: float = 1.0) -> str:
    """'0.9123 ± 0.0040': a summary's mean and std over seeds (divided by ``scale``), as the
    results tables print them."""
    return f"{value['mean'] / scale:.{digits}f} ± {value['std'] / scale:.{digits}f}"

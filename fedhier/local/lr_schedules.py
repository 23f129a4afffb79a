"""Learning-rate schedules over global local-SGD iterations t = 0 .. T-1.

- ``constant``: lr
- ``step``: lr * decay ** floor(t / step_every)
- ``cosine``: lr * (1 + cos(pi * t / T)) / 2
- ``exponential``: lr * decay ** floor(t / G), a decay per cloud round (as in HierFL)
"""

from __future__ import annotations

import math

import numpy as np

LR_SCHEDULES = ("constant", "step", "cosine", "exponential")


def learning_rate(step: int, *, lr: float, schedule: str = "constant", decay: float = 1.0,
                  step_every: int = 1, total_steps: int = 1, global_period: int = 1) -> float:
    """The learning rate of global iteration ``step``."""
    if schedule == "constant":
        return lr
    if schedule == "step":
        return lr * decay ** (step // max(step_every, 1))
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * step / max(total_steps, 1)))
    if schedule == "exponential":
        return lr * decay ** (step // max(global_period, 1))
    raise ValueError(f"unknown lr schedule '{schedule}'")


def learning_rates(start_step: int, num_steps: int, **kwargs: float | int | str) -> np.ndarray:
    """float64 [num_steps]: the rates of steps start_step .. start_step + num_steps - 1."""
    return np.array([learning_rate(start_step + k, **kwargs)  # type: ignore[arg-type]
                     for k in range(num_steps)], dtype=np.float64)

"""The valid range of every numeric run setting, declared once.

:meth:`fedhier.config.RunConfig.validate` checks every setting against :data:`RANGES`
(one line naming the setting, exit code 2), and the fuzz harness (tests/test_fuzz_cli.py)
derives from the same table which values must be refused and which must run. Checks that
relate two settings (G a multiple of I, more groups than clients, ...) stay in ``validate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedhier.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """low .. high (None = unbounded), each end open or closed.

    ``whole_above_one``: above 1 only whole numbers are valid (participation: a fraction of
    the clients, or a number of clients).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    whole_above_one: bool = False

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open
                                      else value > self.high):
            return False
        return not (self.whole_above_one and value > 1 and not float(value).is_integer())

    def examples(self, integer: bool) -> tuple[list[float], list[float]]:
        """(values inside, values outside): each end and its nearest neighbour across it
        (for tests and the fuzz harness)."""
        step = 1 if integer else 0.5
        inside: list[float] = []
        outside: list[float] = []
        for end, is_open, sign in ((self.low, self.low_open, -1), (self.high, self.high_open, 1)):
            if end is None:
                continue
            if is_open:
                outside.append(end)
                inside.append(end - sign * (1 if integer else 0.25))
            else:
                inside.append(end)
                outside.append(end + sign * step)
        if self.whole_above_one:
            inside.append(3)
            outside.append(1.5)
        if not inside:
            inside.append(1)
        return inside, outside

    def describe(self) -> str:
        """The range as users read it: '>= 0', '> 0', 'in [0, 1)', ..."""
        if self.whole_above_one:
            return "a fraction in (0, 1] or a whole number of clients"
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "any number"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)
UNIT = Range(0, 1)  # [0, 1]
UNIT_OPEN_TOP = Range(0, 1, high_open=True)  # [0, 1)

#: setting -> its valid range. Every numeric RunConfig field is listed (a test checks it).
RANGES: dict[str, Range] = {
    # data
    "alpha": POSITIVE,
    "min_partition_size": AT_LEAST_0,  # 0 = auto
    "classes_per_client": AT_LEAST_1,
    "clients": AT_LEAST_1,
    "client_holdout": UNIT_OPEN_TOP,
    "seed": Range(0, 2**32 - 1),  # the seeds scikit-learn's random_state accepts
    # hierarchy and schedule
    "local_period": AT_LEAST_1,
    "global_period": AT_LEAST_1,
    "regroup_every": AT_LEAST_0,
    "rounds": AT_LEAST_1,
    "mobility_rate": UNIT,
    "diagnostics_every": AT_LEAST_0,
    "diagnostics_max_samples": AT_LEAST_0,
    "server_lr": AT_LEAST_0,
    "server_momentum": UNIT_OPEN_TOP,
    # participation and local work
    "participation": Range(0, low_open=True, whole_above_one=True),
    "straggler_fraction": UNIT,
    "straggler_min_steps": AT_LEAST_1,
    # faults and robustness
    "fail_rate": UNIT_OPEN_TOP,
    "dropout_fraction": UNIT,
    "round_timeout": POSITIVE,
    "min_clients_per_edge": AT_LEAST_0,
    "checkpoint_every": AT_LEAST_0,
    "exclude_after": AT_LEAST_0,  # 0 = never exclude
    "max_weight_ratio": AT_LEAST_0,  # 0 = no cap
    "max_update_ratio": AT_LEAST_0,  # 0 = no check
    "async_buffer": AT_LEAST_0,
    "max_staleness": AT_LEAST_0,
    "async_server_lr": POSITIVE,
    "async_mixing": Range(0, 1, low_open=True),  # (0, 1]
    # simulated time
    "step_seconds": AT_LEAST_0,
    "compute_spread": AT_LEAST_0,
    "client_edge_mbps": POSITIVE,
    "client_edge_latency_ms": AT_LEAST_0,
    "edge_cloud_mbps": POSITIVE,
    "edge_cloud_latency_ms": AT_LEAST_0,
    # local training
    "batch_size": AT_LEAST_0,  # 0 = full batch
    "lr": POSITIVE,
    "lr_decay": Range(0, 1, low_open=True),
    "lr_step_every": AT_LEAST_1,
    "momentum": UNIT_OPEN_TOP,
    "weight_decay": AT_LEAST_0,
    "clip_norm": AT_LEAST_0,  # 0 = off
    # execution
    "client_chunk": AT_LEAST_0,  # 0 = auto
    "ray_workers": AT_LEAST_1,
}


def choices() -> dict[str, tuple[str, ...]]:
    """setting -> its valid names, for every setting that takes one of a fixed set (the
    grouping, open to plugins, is checked on its own)."""
    from fedhier.async_rules import ASYNC_RULES
    from fedhier.engines.registry import engine_names
    from fedhier.lr_schedules import LR_SCHEDULES
    from fedhier.mobility import HANDOFFS
    from fedhier.models import MODELS
    from fedhier.optim import OPTIMIZER_STATES
    from fedhier.reply_policy import ON_BAD_REPLY

    return {"weighting": WEIGHTINGS, "engine": tuple(engine_names()), "model": MODELS,
            "cloud_strategy": CLOUD_STRATEGIES, "partition": PARTITIONS,
            "lr_schedule": LR_SCHEDULES, "handoff": HANDOFFS,
            "optimizer_state": OPTIMIZER_STATES, "on_nan": ON_NAN,
            "on_bad_reply": ON_BAD_REPLY, "async_rule": ASYNC_RULES}


#: the cloud's step: the plain average or a Flower strategy (fedhier_strategies.cloud_step)
CLOUD_STRATEGIES = ("average", "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")

#: averaging weights (docs/hsgd.md#weighting) and what a non-finite client update does
WEIGHTINGS = ("samples", "uniform")
ON_NAN = ("stop", "skip-client")
#: fedhier.data.partition.PARTITION_SCHEMES (not imported: it loads the datasets library)
PARTITIONS = ("dirichlet", "iid", "shards", "natural", "sorted")


def check_ranges(values: Any) -> None:
    """A one-line ConfigError naming the first setting of ``values`` (a RunConfig or any
    object with these attributes) outside its range."""
    for name, valid in RANGES.items():
        value = getattr(values, name)
        if not valid.contains(value):
            raise ConfigError(f"{name} must be {valid.describe()}, got {value}")

"""Numeric ranges: what a setting's ``valid=`` declares (:mod:`fedhier.settings.declaration`).

:meth:`fedhier.settings.run_config.RunConfig.validate` checks every setting against its
declared range (one line naming the setting, exit code 2), and the fuzz harness
(tests/test_fuzz_cli.py) derives from the same declarations which values must be refused and
which must run. Checks that relate two settings (G a multiple of I, more groups than clients,
...) stay in :mod:`fedhier.settings.checks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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

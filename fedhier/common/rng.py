"""Seeded randomness as a pure function of (seed, purpose, ids).

Every random draw in fedhier (mini-batch order, grouping, model init, fault injection) comes
from ``generator(seed, purpose, *ids)``. Draws therefore never depend on execution order, so
engines are interchangeable and runs are reproducible.
"""

from __future__ import annotations

import zlib

import numpy as np


def purpose_tag(purpose: str) -> int:
    """A stable 32-bit integer for a purpose name (CRC32, identical on every platform)."""
    return zlib.crc32(purpose.encode("utf-8"))


def generator(seed: int, purpose: str, *ids: int) -> np.random.Generator:
    """A NumPy generator determined only by ``seed``, ``purpose`` and ``ids``."""
    return np.random.default_rng([int(seed), purpose_tag(purpose), *(int(i) for i in ids)])


def torch_seed(seed: int, purpose: str, *ids: int) -> int:
    """A 63-bit seed for ``torch.Generator`` derived like :func:`generator`."""
    return int(generator(seed, purpose, *ids).integers(0, 2**63 - 1))

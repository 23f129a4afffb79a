"""The benchmark's FLOP count comes from the model's layers (benchmarks/engines.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedhier.local.models import build_model
from tests.helpers import benchmark_engines

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    return benchmark_engines()


def test_mlp_macs_match_w1_constant() -> None:
    bench = _bench()
    macs = bench.model_macs(build_model("mlp", (64,), 10), (64,))
    assert macs == {"hidden": 64 * 128, "out": 128 * 10}
    assert sum(macs.values()) == bench.MLP_MACS


def test_cnn_macs_fashion_mnist_shapes() -> None:
    bench = _bench()
    macs = bench.model_macs(build_model("cnn", (1, 28, 28), 10), (1, 28, 28))
    # conv1: 16x28x28 outputs x 1x3x3; conv2 on the pooled 14x14 map: 32x14x14 x 16x3x3;
    # out: 32*7*7 -> 10
    assert macs == {"conv1": 16 * 28 * 28 * 9, "conv2": 32 * 14 * 14 * 16 * 9,
                    "out": 32 * 7 * 7 * 10}


def test_cnn_macs_digits_shapes() -> None:
    bench = _bench()
    macs = bench.model_macs(build_model("cnn", (1, 8, 8), 10), (1, 8, 8))
    assert macs == {"conv1": 16 * 8 * 8 * 9, "conv2": 32 * 4 * 4 * 16 * 9, "out": 32 * 2 * 2 * 10}

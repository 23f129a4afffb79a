"""Label groupings against their known optimum, through `fedhier run`.

12 natural clients, each holding 5 rows of one class (4 clients per class, 3 classes), in 4
edges of 3: the min-divergence optimum puts one client of every class in each edge (label
upward divergence exactly 0; a random balanced grouping does so with probability
4!^3 / (12! / 3!^4) = 3.7%), and the max-divergence optimum makes three edges label-pure
(the fourth then holds one client of each class).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedhier.cli.commands import main

CLASSES, PER_CLASS, ROWS, EDGES = 3, 4, 5, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.tile(np.arange(CLASSES), PER_CLASS), ROWS)  # client j: class j % 3
    x = rng.normal(size=(len(labels), 4)).astype(np.float32)
    folder = tmp_path_factory.mktemp("grouping")
    np.savez(folder / "pure.npz", x=x, y=labels,
             client_id=np.repeat(np.arange(CLASSES * PER_CLASS), ROWS),
             x_test=x[:6], y_test=labels[:6])
    return folder


def groups_of(data, grouping: str, seed: int) -> dict:
    out = data / f"{grouping}-{seed}"
    assert main(["run", "--data-path", str(data / "pure.npz"), "--partition", "natural",
                 "--clients", "12", "--groups", str(EDGES), "--grouping", grouping,
                 "--model", "logreg", "--local-period", "1", "--global-period", "1",
                 "--rounds", "1", "--engine", "vectorized", "--seed", str(seed),
                 "--no-progress", "--out", str(out)]) == 0
    return json.loads((out / "groups.json").read_text())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_divergence_finds_the_perfect_mix(data, seed):
    groups = groups_of(data, "min-divergence", seed)
    assert [e["label_histogram"] for e in groups["edges"]] == [[ROWS] * CLASSES] * EDGES
    assert groups["label_upward_divergence"] == pytest.approx(0.0, abs=1e-12)


def test_max_divergence_makes_pure_edges(data):
    groups = groups_of(data, "max-divergence", 0)
    classes = sorted(sum(1 for c in e["label_histogram"] if c) for e in groups["edges"])
    assert classes == [1, 1, 1, 3]  # three pure edges; the fourth takes one of each class

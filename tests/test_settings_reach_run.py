"""Every setting that shapes the federation reaches the run: each test goes through
`fedhier run` and asserts a property of what ran (partition.json, config.json, the models),
not of the function underneath (issue #31: a dropped ``alpha=`` keyword passed every test).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedhier.cli.commands import main

BASE = ["--clients", "8", "--groups", "2", "--local-period", "1", "--global-period", "1",
        "--rounds", "1", "--engine", "vectorized", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """flags -> run folder; each distinct run once per module (plots skipped)."""
    import fedhier.runs.plots as plots

    done: dict[tuple[str, ...], Path] = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("plot_runs", "plot_groups", "plot_groups_history"):
            patch.setattr(plots, name, lambda *a, **k: None)

        def run(*flags: str) -> Path:
            if flags not in done:
                out = tmp_path_factory.mktemp("reach") / "run"
                assert main(["run", *BASE, *flags, "--out", str(out)]) == 0
                done[flags] = out
            return done[flags]
        yield run


def partition(run: Path) -> dict:
    return json.loads((run / "partition.json").read_text())


def config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def label_counts(run: Path) -> np.ndarray:
    return np.array([c["label_counts"] for c in partition(run)["clients"]], dtype=np.float64)


def mean_entropy(run: Path) -> float:
    """Mean over clients of the entropy (nats) of the client's label distribution."""
    counts = label_counts(run)
    p = counts / counts.sum(axis=1, keepdims=True)
    return float(np.mean([-(q[q > 0] * np.log(q[q > 0])).sum() for q in p]))


def test_alpha_reaches_the_partition(runs):
    entropy = {a: mean_entropy(runs("--alpha", a)) for a in ("0.1", "0.5", "100")}
    assert entropy["0.1"] < entropy["0.5"] - 0.2 < entropy["100"] - 0.4, entropy
    assert entropy["100"] > 0.9 * math.log(10)  # near IID
    assert config(runs("--alpha", "0.1"))["alpha"] == 0.1


def test_partition_scheme_reaches_the_run(runs):
    iid, dirichlet = runs("--partition", "iid"), runs("--alpha", "0.1")
    assert partition(iid)["scheme"] == "iid" and config(iid)["partition"] == "iid"
    assert mean_entropy(iid) > 0.95 * math.log(10) > mean_entropy(dirichlet)
    sizes = [c["num_examples"] for c in partition(iid)["clients"]]
    assert max(sizes) - min(sizes) <= 1  # equal shares
    ordered = label_counts(runs("--partition", "sorted"))
    held = [np.flatnonzero(c) for c in ordered]  # rows sorted by label, cut into blocks
    assert all(len(h) <= 3 for h in held)
    assert all(a.max() <= b.min() for a, b in zip(held, held[1:], strict=False))


@pytest.mark.parametrize("k", ["1", "3"])
def test_classes_per_client_as_asked(runs, k):
    counts = label_counts(runs("--partition", "shards", "--classes-per-client", k))
    assert [int((c > 0).sum()) for c in counts] == [int(k)] * 8


def test_min_partition_size_reaches_the_partition(runs):
    auto = runs("--alpha", "0.1")
    asked = runs("--alpha", "0.1", "--min-partition-size", "60")
    assert min(c["num_examples"] for c in partition(auto)["clients"]) < 60  # it matters
    assert min(c["num_examples"] for c in partition(asked)["clients"]) >= 60
    assert config(asked)["min_partition_size"] == 60


def test_seed_reaches_partition_grouping_and_model(runs):
    a, b = runs("--alpha", "0.5"), runs("--alpha", "0.5", "--seed", "1")
    rows = [c["rows"] for c in partition(a)["clients"]]
    assert rows != [c["rows"] for c in partition(b)["clients"]]
    ia, ib = load_file(a / "model_initial.safetensors"), load_file(b / "model_initial.safetensors")
    assert any(not np.array_equal(ia[k], ib[k]) for k in ia)
    assert config(b)["seed"] == 1


def test_dataset_reaches_the_model_and_the_data(runs):
    digits, synthetic = runs("--partition", "iid"), runs("--partition", "iid", "--dataset",
                                                         "synthetic")
    assert config(synthetic)["dataset"] == "synthetic"
    first_layer = {run: min(load_file(run / "model_initial.safetensors").values(),
                            key=lambda v: -v.size).shape for run in (digits, synthetic)}
    assert first_layer[digits][-1] == 64 and first_layer[synthetic][-1] == 60  # input width
    assert partition(digits)["clients"][0]["rows"] != partition(synthetic)["clients"][0]["rows"]


def test_holdout_reaches_the_clients(runs):
    whole, split = runs("--alpha", "0.5"), runs("--alpha", "0.5", "--client-holdout", "0.25")
    p = partition(split)
    assert len(p["holdout"]) == 8
    for kept, held, all_rows in zip(p["clients"], p["holdout"], partition(whole)["clients"],
                                    strict=True):
        assert not set(kept["rows"]) & set(held)
        assert sorted(kept["rows"] + held) == sorted(all_rows["rows"])  # a split of the same
        assert len(held) == max(1, round(0.25 * all_rows["num_examples"]))
    last = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()][-1]
    assert len(last["client_accuracies"]) == 8

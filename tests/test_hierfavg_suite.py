"""``fedhier experiment hierfavg --quick`` (docs/baselines.md): the arms, the placements and
the κ1 = G reduction, on digits in a few seconds."""

import json

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.runs.folder import read_metrics
from fedhier.studies.experiments.hierfavg_suite import _to_target
from fedhier.studies.experiments.mobility_noniid import label_divergences

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_hierfavg_quick_suite(tmp_path):
    out = tmp_path / "hierfavg"
    assert main(["experiment", "hierfavg", "--quick", "--seeds", "1", "--jobs", "1",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    # quick: G = 4, so κ2 in 1, 2, 4 -> κ1 = 4, 2, 1, each under both placements
    assert results["kappa1"] == [4, 2, 1]
    assert set(results["arms"]) == {f"{p}-k{k}" for p in ("edge-iid", "edge-noniid")
                                    for k in (4, 2, 1)}
    for name, arm in results["arms"].items():
        cfg = arm["config"]
        assert cfg["global_period"] == 4 and cfg["local_period"] == int(name.split("-k")[1])
        assert cfg["partition"] == "shards" and cfg["classes_per_client"] == 1
    # 20 one-class clients on 2 edges: edge-IID puts all 10 classes on each edge,
    # edge-non-IID 5 per edge
    for place, classes in (("edge-iid", 10), ("edge-noniid", 5)):
        groups = json.loads((out / "runs" / f"{place}-k2" / "seed0" / "groups.json").read_text())
        assert [int(np.count_nonzero(e["label_histogram"])) for e in groups["edges"]] == \
            [classes, classes]
    # κ1 = G: one edge aggregation right before the cloud's, whatever the placement
    iid = read_metrics(out / "runs" / "edge-iid-k4" / "seed0")
    noniid = read_metrics(out / "runs" / "edge-noniid-k4" / "seed0")
    assert [r["test_loss"] for r in iid] == pytest.approx([r["test_loss"] for r in noniid],
                                                          abs=1e-6)
    # the table's numbers are the first record at or above the target
    target = results["target_accuracy"]
    reach = results["to_target"]["edge-iid-k1"]
    records = read_metrics(out / "runs" / "edge-iid-k1" / "seed0")
    hit = next(r for r in records if r["round"] > 0 and r["test_accuracy"] >= target)
    assert reach["rounds"]["per_seed"] == [hit["round"]]
    assert reach["bytes"]["per_seed"] == [hit["client_edge_bytes"] + hit["edge_cloud_bytes"]]
    assert _to_target(records, 2.0)["rounds"] == float("inf")
    # the mobility-noniid suite's divergence: none moves here, so every round keeps round 0's
    divs = label_divergences(out / "runs" / "edge-noniid-k2" / "seed0", records)
    assert divs == [pytest.approx(divs[0])] * len(records) and divs[0] > 0
    assert "Claims" in (out / "results.md").read_text()
    assert (out / "hierfavg_curves.png").exists() and (out / "hierfavg_rounds.png").exists()

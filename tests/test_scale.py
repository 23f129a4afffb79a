"""Many clients on the vectorized engine: what grew faster than the clients, kept linear.

- the NaN screen checks [n, *shape] models without a bool copy of them (``_all_finite``);
- the mini-batch index blocks are int32 (half of int64) and still ``batch_indices``' rows;
- groups.json's members come from one sort (it was a scan of all clients per edge: O(n x
  edges), minutes at 100,000 clients) and the groups figure keeps a bounded size (one inch-row
  per edge was gigabytes of pixels);
- a federation the partitioners cannot build (replicated clients, as benchmarks/engines.py
  --scale builds them) runs end to end, chunked, with the groups it was given.
"""

import json

import numpy as np
import pytest
import torch

from fedhier.data.federation import Federation
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.engines.vectorized.kernels import ClientRows
from fedhier.local.train import batch_indices
from fedhier.round.loop import _all_finite
from fedhier.runs.folder import RunFolder
from fedhier.runs.plots import MAX_LABELLED_ROWS, plot_groups
from fedhier.runs.prepare import prepare
from fedhier.settings.run_config import RunConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = RunConfig(dataset="digits", clients=10, groups=(2,), local_period=1, global_period=2,
                 rounds=1, batch_size=16, seed=5, engine="vectorized")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_any_non_finite_entry(bad):
    value = torch.randn(50, 7, 3)
    assert _all_finite(value)
    value[31, 2, 1] = bad
    assert not _all_finite(value)


def test_all_finite_opposite_infinities_and_overflow():
    value = torch.zeros(10, 4)
    value[1, 0], value[7, 3] = float("inf"), -float("inf")  # sum NaN: still caught
    assert not _all_finite(value)
    huge = torch.full((10, 4), 3e38)  # finite entries whose float32 sum overflows
    assert _all_finite(huge)
    assert _all_finite(torch.arange(12).reshape(3, 4))  # integer buffers are finite


def test_minibatch_rows_are_int32_and_batch_indices_rows():
    cfg = BASE.replace(clients=12, alpha=0.3, batch_size=40)
    fed = prepare(cfg)
    rows = ClientRows.build(fed, cfg.batch_size, torch.device("cpu"))
    block = rows.minibatch_rows(cfg.seed, cfg.batch_size, start=3, steps=5)
    assert block.dtype == np.int32 and block.shape == (5, 12, rows.width)
    for j, part in enumerate(fed.partitions):
        local = batch_indices(cfg.seed, j, len(part), cfg.batch_size, 3, 5)
        np.testing.assert_array_equal(block[:, j, :local.shape[1]], np.asarray(part)[local])
    x = rows.x[torch.as_tensor(block)]  # torch gathers with int32 indices as with int64
    assert torch.equal(x, rows.x[torch.as_tensor(block.astype(np.int64))])


def replicated(clients: int) -> Federation:
    """``clients`` clients, client j holding the rows of BASE's client j mod 10."""
    base = prepare(BASE)
    return Federation(bundle=base.bundle,
                      partitions=[base.partitions[j % 10] for j in range(clients)])


def test_many_replicated_clients_run_chunked(tmp_path):
    clients, edges = 3000, 300
    cfg = BASE.replace(clients=clients, groups=(edges,), client_chunk=1000)
    summary = run_vectorized(cfg, RunFolder.create(tmp_path / "run"), progress=False,
                             federation=replicated(clients))
    assert summary["engine"] == "vectorized"
    groups = json.loads((tmp_path / "run" / "groups.json").read_text())
    edge_of = np.array(groups["client_to_edge"])
    assert len(groups["edges"]) == edges
    for edge in groups["edges"]:  # members: ascending, exactly the clients mapped there
        assert edge["clients"] == np.flatnonzero(edge_of == edge["edge"]).tolist()
    assert (tmp_path / "run" / "groups.png").stat().st_size < 2_000_000


def test_groups_figure_size_is_bounded(tmp_path):
    edges = 20 * MAX_LABELLED_ROWS
    histograms = np.random.default_rng(0).integers(0, 9, size=(edges, 10))
    (tmp_path / "groups.json").write_text(json.dumps({
        "grouping": "random", "label_upward_divergence": 0.1,
        "edges": [{"edge": e, "label_histogram": h.tolist()}
                  for e, h in enumerate(histograms)]}))
    out = plot_groups(tmp_path / "groups.json", tmp_path / "groups.png")
    from PIL import Image

    with Image.open(out) as image:
        assert image.size[1] <= 110 * (1.2 + 0.35 * MAX_LABELLED_ROWS) + 1

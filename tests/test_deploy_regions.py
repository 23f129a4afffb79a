"""Servers at every level (`fedhier deploy local --edges E --regions R`): clients under edge
servers under region servers under the cloud. The split round equals the one-process run
through Flower messages on nested in-process grids (no sockets), and on real processes on
127.0.0.1 with TLS and SuperNode authentication on every tier, with the bytes measured on
each link in the ratio the algorithm counts.

Two levels (edges under the cloud) are tested in tests/test_edge_tier.py and
tests/test_deploy_edges.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message

from fedhier.clients.app import app as client_app
from fedhier.engines.deployment.placement import tree_placement
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.server import EdgeServer
from tests.helpers import metrics
from tests.test_vectorized import assert_same_runs

#: 8 clients, 4 edges, 2 regions: edges aggregate every 2 steps, regions every 4, the cloud
#: every 8 (2 region rounds of 2 edge rounds per cloud round).
BASE = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8),
                 grouping="contiguous", rounds=2, batch_size=8, seed=5)
TOL = 1e-5


class ServersApp:
    """A grid's "ClientApp" whose node k is server ``servers[k]`` (as a server process is)."""

    def __init__(self, servers: list[EdgeServer]) -> None:
        self.servers = servers

    def __call__(self, msg: Message, context) -> Message:
        return Message(self.servers[int(context.node_config["partition-id"])].handle(msg),
                       reply_to=msg)


def servers_grid(cfg: RunConfig) -> InProcessGrid:
    """The cloud's grid: its child servers, each with its own grid of children, down to the
    clients' grids at the edges."""
    parents = tree_placement(cfg)  # client -> edge, edge -> region, ...
    below: list[EdgeServer] = []
    ancestors = np.arange(cfg.clients)
    for level, parent in enumerate(parents, start=1):
        ancestors = parent[ancestors]
        servers = []
        for node in range(int(parent.max()) + 1):
            children = np.flatnonzero(parent == node).tolist()
            clients = np.flatnonzero(ancestors == node).tolist()
            if level == 1:
                grid = InProcessGrid(client_app, len(children), seed=cfg.seed + 1 + node,
                                     partition_ids=children, num_partitions=cfg.clients)
            else:
                grid = InProcessGrid(ServersApp([below[c] for c in children]),  # type: ignore[arg-type]
                                     len(children), seed=cfg.seed + 100 * level + node)
            servers.append(EdgeServer(node, grid, clients, level=level, children=children))
        below = servers
    return InProcessGrid(ServersApp(below), len(below), seed=cfg.seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {},
    dict(participation=0.7, fail_rate=0.15, compute_spread=0.5, edge_slowdown="1:3"),
    dict(aggregators="mean,median,mean"),
    dict(groups=(4, 2, 1), periods=(2, 4, 8, 16), rounds=1),
], ids=["plain", "faults-sim-time", "median-regions", "four-levels"])
def test_servers_at_every_level_equal_the_one_process_run(change, tmp_path):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    split = cfg.replace(edge_servers=True)
    run_federation(servers_grid(split), split, RunFolder.create(tmp_path / "split", split),
                   engine="servers (in-process)", progress=False)
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    assert metrics(tmp_path / "split")[-1]["round"] == cfg.rounds


def test_a_malformed_report_is_counted_as_a_lost_job_and_named(tmp_path, monkeypatch, caplog):
    """A server whose reply to its job is not a report (region 1 in cloud round 1: its model
    one column short; edge 1 under region 0 in its first job of round 2: a count missing)
    is counted as a server that missed that job, by the same exact counts as a lost job
    (tests/test_deploy_faults.py), with one warning naming it and what is wrong; the run
    completes instead of ending in a KeyError or a shape error in the average."""
    import logging

    from fedhier.clients.wire.packed_model import get_model, model_record
    from fedhier.strategies.edge.messages import FIRST_ROUND

    handle = EdgeServer.handle

    def hostile(self: EdgeServer, msg):
        content = handle(self, msg)
        config = msg.content["config"]
        key = (self.level, self.edge, int(config.get("server-round", 0)),
               int(config.get(FIRST_ROUND, 0)))
        if msg.metadata.message_type == "train" and key == (2, 1, 1, 1):
            model = get_model(content, "arrays")
            content["arrays"] = model_record({k: v[..., :-1] for k, v in model.items()},
                                             packed=True)
        if msg.metadata.message_type == "train" and key == (1, 1, 2, 5):
            del content["metrics"]["failed-clients"]
        return content

    monkeypatch.setattr(EdgeServer, "handle", hostile)
    cfg = BASE.replace(edge_servers=True)
    with caplog.at_level(logging.WARNING, logger="fedhier"):
        run_federation(servers_grid(cfg), cfg, RunFolder.create(tmp_path / "r", cfg),
                       engine="servers (in-process)", progress=False)
    rows = metrics(tmp_path / "r")
    assert rows[1]["unreached_regions"] == [1] and "unreached_edges" not in rows[1]
    assert (rows[1]["failed_clients"], rows[1]["failed_edges"]) == (4 * 4, 2 * 4)
    assert rows[2]["unreached_edges"] == [1] and "unreached_regions" not in rows[2]
    assert (rows[2]["failed_clients"], rows[2]["failed_edges"]) == (2 * 2, 1 * 2)
    said = [r.getMessage() for r in caplog.records if "region 1" in r.getMessage()
            or "edge 1 " in r.getMessage()]
    assert len(said) == 2, said  # one line each (not also "did not answer")
    assert said[0].startswith("region 1 sent a malformed reply to its job (arrays[")
    assert said[0].endswith("): its clients miss the round")
    assert "not a float tensor of shape" in said[0]
    assert said[1] == ("edge 1 sent a malformed reply to its job "
                       "(KeyError: 'failed-clients'): its clients miss the round")


def test_report_from_reply_checks_a_report_against_its_job():
    """A region's segment report (its edges' own models) read back as sent; then each way a
    reply can fail to fit its job is one line: edge models without their edges, rows that
    are not one per edge, an edge outside the region, losses not one row per edge round,
    clocks not one per edge."""
    import torch

    from fedhier.clients.wire.packed_model import model_record
    from fedhier.round.tiers.jobs import EdgeReport, ServerJob
    from fedhier.strategies.edge.messages import (
        EDGE_MODELS,
        MalformedReplyError,
        report_content,
        report_from_reply,
    )

    like = {"w": torch.zeros(3, 2), "b": torch.zeros(3)}
    # region 0 of edges 0, 1 (edges 2, 3 under region 1); a job of 2 edge rounds
    job = ServerJob(0, 1, like, np.array([0, 1, 2, 3]), np.ones(4, dtype=np.int64), np.zeros(4),
                  level=2, parents=(np.array([0, 0, 1, 1]),), first_round=1, num_rounds=2)
    models = {"w": torch.ones(2, 3, 2), "b": torch.ones(2, 3)}
    report = EdgeReport(0, None, np.zeros((2, 2)), seconds=np.zeros(4),
                        edges=np.array([0, 1]), edge_models=models)

    def read(content):
        return report_from_reply(Message(content, dst_node_id=1, message_type="train"), job)

    ok = read(report_content(report))
    assert ok.edges.tolist() == [0, 1] and torch.equal(ok.edge_models["w"], models["w"])
    content = report_content(report)
    del content["metrics"]["edges"]
    with pytest.raises(MalformedReplyError, match=r"^KeyError: 'edge-models without edges'$"):
        read(content)
    content = report_content(report)
    content[EDGE_MODELS] = model_record({k: v[:1] for k, v in models.items()}, packed=True)
    with pytest.raises(MalformedReplyError, match=r"edge-models\['.'\] is torch.float32 "
                       r"\(1, 3(, 2)?\), not a float tensor of shape \(2, 3(, 2)?\)$"):
        read(content)
    content = report_content(report)
    content["metrics"]["edges"] = [0, 2]
    with pytest.raises(MalformedReplyError, match=r"^edges \[0, 2\] are not all under 0$"):
        read(content)
    content = report_content(report)
    content["metrics"]["edges"] = [0, 7]
    with pytest.raises(MalformedReplyError, match=r"lie outside 0\.\.3$"):
        read(content)
    for key, value, said in (("loss-means", [0.0], "1 rows of losses for a job of 2 edge "
                                                   "rounds"),
                             ("edge-seconds", [0.0, 0.0], "2 edge clocks for 4 edges")):
        content = report_content(report)
        content["metrics"][key] = value
        if key == "loss-means":
            content["metrics"]["loss-weights"] = value
        with pytest.raises(MalformedReplyError, match=f"^{said}$"):
            read(content)

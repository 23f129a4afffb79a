"""Servers as processes (`fedhier deploy local --edges [--regions]`): clients, edge servers,
region servers and the cloud on 127.0.0.1 with TLS and SuperNode authentication equal the
in-process run, each link carries the models the algorithm counts (the saving H-SGD exists
for, measured on the wire against the flat deployment), and Ctrl-C stops every process. A
killed server (a region, an edge under it) and a killed cloud with `--resume` are in
tests/test_deploy_faults.py (three tiers: it took over the two-tier kill and resume tests).

The same split round without processes is tested in tests/test_edge_tier.py and
tests/test_deploy_regions.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhier.engines import deployment as deploy
from fedhier.engines.deployment.ports import ports_needed
from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_same_run, interruptible, metrics
from tests.test_deploy import ROOT, leftovers

pytestmark = pytest.mark.slow

#: The synthetic-wide card: 8,000 features, a 4.1 MB MLP, so that models, not Flower's polling
#: and heartbeats (a few KB/s per node), dominate the bytes on the wire.
NODES, EDGES, ROUNDS = 4, 2, 1


def deploy_on_free_ports(args: list[str], ports: int, out: Path, capsys) -> tuple[str, int]:
    """``fedhier deploy local ARGS`` on a free block of ``ports`` ports; once more on another
    block if a port was taken meanwhile (another deployment on this machine). Returns (its
    output, the base port)."""
    port = deploy.free_port_block(ports)
    code = deploy.main(["local", *args, "--base-port", str(port), "--out", str(out),
                        "--timeout", "900"])
    printed = capsys.readouterr()
    if code != 0 and "in use" in printed.out + printed.err:
        shutil.rmtree(out, ignore_errors=True)
        port = deploy.free_port_block(ports, start=port + ports + 100)
        code = deploy.main(["local", *args, "--base-port", str(port), "--out", str(out),
                            "--timeout", "900"])
        printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    return printed.out, port


def test_servers_at_every_tier_equal_inprocess_and_each_link_carries_the_counted_models(
        tmp_path, capsys):
    """Clients, 2 edge servers, 1 region server and the cloud, each a process of its own with
    TLS and SuperNode authentication (edges aggregate every step, I = 1; the region every 2
    steps, its 2 edges' models; the cloud every 4): equal to the one-process run, and the
    bytes measured on each link are in the ratio of the models the algorithm sends over it
    (the saving H-SGD exists for, realised on the wire)."""
    card, periods, regions = "synthetic-wide", (1, 2, 4), 1
    flags = ["--dataset", card, "--nodes", str(NODES), "--partition", "natural", "--grouping",
             "contiguous", "--periods", ",".join(map(str, periods)), "--rounds", str(ROUNDS),
             "--batch-size", "8", "--lr", "0.001", "--seed", "3"]
    ports = ports_needed(NODES, EDGES + regions)
    t0 = time.time()
    out, port = deploy_on_free_ports([*flags, "--edges", str(EDGES), "--regions", str(regions)],
                                     ports, tmp_path / "tiers", capsys)
    elapsed = time.time() - t0
    assert "superlink-region-0 on" in out and "TLS + SuperNode authentication" in out
    assert "region server 0" in out and "edge server 1" in out
    assert leftovers(range(port, port + ports)) == ""
    cfg = RunConfig(dataset=card, clients=NODES, groups=(EDGES, regions), periods=periods,
                    partition="natural", grouping="contiguous", rounds=ROUNDS, batch_size=8,
                    lr=0.001, seed=3)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    links = ("client-edge", "edge-region", "region-cloud")
    wire_keys = frozenset(f"wire_{link.replace('-', '_')}_bytes" for link in links)
    assert_same_run(tmp_path / "inprocess", tmp_path / "tiers", ROUNDS, ignore=wire_keys)
    logs = tmp_path / "tiers" / "deploy" / "logs"  # every tier authenticated the one below
    for name, activated in (("superlink-edge-0", 2), ("superlink-edge-1", 2),
                            ("superlink-region-0", EDGES), ("superlink", regions)):
        assert (logs / f"{name}.log").read_text().count("[Fleet.ActivateNode] Activated") \
            == activated, name
    wire = json.loads((tmp_path / "tiers" / "wire.json").read_text())
    measured = {link: wire[link]["sent"] + wire[link]["received"] for link in links}
    # Models on each link over the run (each way counts): a node exchanges two with its
    # parent per period of the parent's level (down and up), and one per evaluation (round 0
    # and after each round), forwarded down to every client. The client-edge link carries
    # what the cloud's link would carry flat (--groups 2,1: 170.1 MB against 170.4 MB here,
    # docs/deployment.md), so region-cloud / client-edge is the cloud's saving.
    evaluations = ROUNDS + 1
    models = {"client-edge": NODES * (2 * ROUNDS * periods[2] // periods[0] + evaluations),
              "edge-region": EDGES * (2 * ROUNDS * periods[2] // periods[1] + evaluations),
              "region-cloud": regions * (2 * ROUNDS + evaluations)}
    ratios = {}
    for upper, lower in (("edge-region", "client-edge"), ("region-cloud", "edge-region"),
                         ("region-cloud", "client-edge")):
        ratio, expected = measured[upper] / measured[lower], models[upper] / models[lower]
        ratios[f"{upper}/{lower}"] = (round(ratio, 4), round(expected, 4))
        assert abs(ratio / expected - 1) < 0.10, (upper, lower, ratio, expected, measured)
    rows = metrics(tmp_path / "tiers")
    assert rows[-1]["wire_region_cloud_bytes"] > rows[0]["wire_region_cloud_bytes"] > 0
    # the counted traffic: training models only (edge-cloud = every link above the edges)
    model_bytes = rows[-1]["client_edge_bytes"] // rows[-1]["client_edge_messages"]
    assert rows[-1]["client_edge_messages"] == NODES * 2 * ROUNDS * periods[2] // periods[0]
    assert rows[-1]["edge_cloud_bytes"] == model_bytes * ROUNDS * (
        2 * EDGES * periods[2] // periods[1] + 2 * regions)
    print(f"servers at every tier: {elapsed:.0f} s; bytes per link {measured}; measured and "
          f"expected ratios {ratios}")


def _edge_cmd(port: int, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fedhier.engines.deployment", "local", "--nodes", "4",
            "--edges", "2", "--grouping", "contiguous", "--local-period", "2",
            "--global-period", "2", "--batch-size", "8", "--seed", "11", "--base-port",
            str(port), "--out", str(out), *extra]


def _start_until(cmd: list[str], prefix: str) -> tuple[subprocess.Popen, list[str]]:
    """Start ``cmd`` (Ctrl-C-able) and read its output up to the first line starting with
    ``prefix``; returns the process and the lines read."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, preexec_fn=interruptible)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            break
    return proc, lines


def test_ctrl_c_stops_every_process_of_the_three_tiers(tmp_path):
    port = deploy.free_port_block(ports_needed(4, 2))
    out = tmp_path / "run"
    # every tier is up once the cloud's app is submitted
    proc, lines = _start_until(_edge_cmd(port, out, "--rounds", "2", "--insecure"), "flwr run")
    assert "edge server 1" in "".join(lines)
    assert leftovers(range(port, port + ports_needed(4, 2))) != ""
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest + err
    assert "stopped all" in rest
    assert leftovers(range(port, port + ports_needed(4, 2))) == ""

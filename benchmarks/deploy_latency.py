"""Where a deployed round's seconds go: per-leg medians of `fedhier deploy local` on loopback.

    python benchmarks/deploy_latency.py                       # 4 clients, 2 edge servers
    python benchmarks/deploy_latency.py --poll-interval 0     # Flower's own 3 s pace
    python benchmarks/deploy_latency.py --edges 0 --groups 2  # flat: edges inside the cloud

Runs the deployment with ``FEDHIER_TRACE_DIR`` (fedhier/engines/deployment/trace.py), then
prints, per tier (cloud -> edge, edge -> client, or cloud -> client when flat) and per message
type, the median seconds of each leg of a message (docs/deployment.md#latency), the median
edge round (one ``send_and_receive`` of train messages to an edge's clients) and the cloud
rounds' seconds (from metrics.jsonl). Extra arguments go to ``fedhier deploy local``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedhier.engines.deployment.trace import TRACE_ENV, read_trace  # noqa: E402

#: The legs of one message, between two traced events.
LEGS = [("push", "received", "SuperLink -> SuperNode (pull)"),
        ("received", "pulled", "SuperNode pulls the content"),
        ("pulled", "acquired", "SuperNode -> task runtime"),
        ("acquired", "answered", "handling (ClientApp or edge job)"),
        ("answered", "sent", "reply -> SuperLink (SuperNode push)"),
        ("sent", "reply", "SuperLink -> Grid (reply pull)"),
        ("push", "reply", "whole message, push to reply")]


def tier(events: dict[str, dict[str, Any]]) -> str:
    sender = events["push"]["proc"]
    node = events.get("pulled", {}).get("proc", "")
    if node.startswith("supernode-edge"):
        return "cloud -> edge"
    return "edge -> client" if sender.startswith("edge-") else "cloud -> client"


def legs(trace: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(tier, message type) -> leg name -> seconds of each message."""
    by_id: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for event in trace:
        for msg_id in event["ids"]:
            by_id[msg_id].setdefault(event["ev"], event)
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for events in by_id.values():
        if "push" not in events or "reply" not in events:
            continue
        key = (tier(events), events["push"].get("kind", "?"))
        for start, end, name in LEGS:
            if start in events and end in events:
                out[key][name].append(events[end]["t"] - events[start]["t"])
    return out


def report(run: Path, trace: list[dict[str, Any]]) -> str:
    lines = [f"{'tier':<16}{'message':<16}{'leg':<40}{'median s':>9}{'n':>5}"]
    for (where, kind), table in sorted(legs(trace).items()):
        for _, _, name in LEGS:
            if table.get(name):
                lines.append(f"{where:<16}{kind:<16}{name:<40}"
                             f"{statistics.median(table[name]):>9.3f}{len(table[name]):>5}")
    trains = [e for e in trace if e["ev"] == "exchange" and e.get("kind") == "train"]
    at_edges = [e["s"] for e in trains if e["proc"].startswith("edge-")]
    rounds = at_edges or [e["s"] for e in trains]  # flat: the cloud runs the edge rounds
    if rounds:
        lines.append(f"edge round (send_and_receive of train messages): median "
                     f"{statistics.median(rounds):.3f} s over {len(rounds)}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall_seconds"] for r in records if "wall_seconds" in r]
    steps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    if steps:
        lines.append("cloud rounds: " + ", ".join(f"{s:.1f}" for s in steps) + " s")
    empty: dict[str, int] = defaultdict(int)
    span: dict[str, list[float]] = defaultdict(list)
    for e in trace:
        if e["ev"] == "pulled":
            empty[e["proc"]] += e.get("empty", 0)
            span[e["proc"]].append(e["t"])
    rates = [empty[p] / (max(t) - min(t)) for p, t in span.items() if len(t) > 1]
    if rates:
        lines.append(f"empty pulls per SuperNode between its first and last message: "
                     f"median {statistics.median(rates):.1f} per second")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--edges", type=int, default=2, help="0: no edge servers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="run folder (default: a temporary one)")
    args, extra = parser.parse_known_args(argv)
    from fedhier.engines.deployment import free_port_block
    from fedhier.engines.deployment import main as deploy
    from fedhier.engines.deployment.ports import ports_needed

    out = args.out or Path(tempfile.mkdtemp(prefix="deploy-latency-")) / "run"
    trace_dir = out.parent / f"{out.name}-trace"
    os.environ[TRACE_ENV] = str(trace_dir)
    port = free_port_block(ports_needed(args.nodes, args.edges))
    flags = ["local", "--nodes", str(args.nodes), "--rounds", str(args.rounds),
             "--base-port", str(port), "--out", str(out)]
    if args.edges:
        flags += ["--edges", str(args.edges), "--grouping", "contiguous"]
    defaults = ["--local-period", "2", "--global-period", "8", "--batch-size", "8",
                "--seed", "11"]  # 4 edge rounds per cloud round, a tiny MLP
    code = deploy([*flags, *defaults, *extra])
    if code != 0:
        return code
    print(f"\n{' '.join(['fedhier deploy', *flags[:-4], *defaults, *extra])}")
    print(report(out, read_trace(trace_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

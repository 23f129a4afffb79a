"""Where a deployed round's seconds go: per-leg medians of `fedhier deploy local` on loopback.

    python benchmarks/deploy_latency.py                       # 4 clients, 2 edge servers
    python benchmarks/deploy_latency.py --poll-interval 0     # Flower's own 3 s pace
    python benchmarks/deploy_latency.py --edges 0 --groups 2  # flat: edges inside the cloud
    python benchmarks/deploy_latency.py --report RUN          # the tables of an earlier run

Runs the deployment with ``FEDHIER_TRACE_DIR`` (fedhier/engines/deployment/trace.py) while
sampling every process's CPU seconds from /proc, then prints the per-leg table of
docs/deployment.md#latency: per tier (cloud -> edge, edge -> client, or cloud -> client when
flat) the median seconds of each leg of a train message, and the CPU seconds the process doing
a one-process leg spent in it (the rest is waiting: for a core, or asleep); then the median
edge round (one ``send_and_receive`` of train messages to an edge's clients), the cloud
rounds' seconds (metrics.jsonl), and the cores each kind of process kept busy during edge
rounds. Extra arguments go to ``fedhier deploy local``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedhier.engines.deployment.trace import NAME_ENV, TRACE_ENV, read_trace  # noqa: E402

#: The legs of one message, between two traced events.
LEGS = [("push", "pushed", "(the Grid pushes message and content)"),
        ("push", "received", "SuperLink -> SuperNode (pull)"),
        ("received", "pulled", "SuperNode pulls the content"),
        ("pulled", "acquired", "SuperNode -> task runtime"),
        ("acquired", "answered", "handling (ClientApp or edge job)"),
        ("answered", "sent", "reply -> SuperLink (SuperNode push)"),
        ("sent", "reply", "SuperLink -> Grid (reply pull)"),
        ("push", "reply", "whole message, push to reply")]


class CpuSampler(threading.Thread):
    """Samples every ``period`` seconds the CPU seconds (user + system) of each process
    below this one, from ``/proc`` (Linux): ``samples`` holds (time, {process: seconds}).
    A process is named by its ``FEDHIER_TRACE_NAME`` and its program
    (``supernode-0/python -m fedhier.engines.deployment.supernode``)."""

    def __init__(self, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.names: dict[int, str] = {}
        self.halt = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def _tree(self) -> dict[int, float]:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(entry.name)
            parents[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
        mine = {os.getpid()}
        grew = True
        while grew:
            new = {p for p, parent in parents.items() if parent in mine} - mine
            grew = bool(new)
            mine |= new
        return {p: cpu[p] for p in mine - {os.getpid()}}

    def label(self, pid: int) -> str:
        if pid not in self.names:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                return f"pid-{pid}"
            env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if e)
            words = [Path(a.decode(errors="replace")).name for a in argv if a][:3]
            program = " ".join(w for w in words if not w.startswith("python")) or "python"
            self.names[pid] = f"{env.get(NAME_ENV, 'deploy')}/{program}"
        return self.names[pid]

    def run(self) -> None:
        while not self.halt.wait(self.period):
            tree = self._tree()
            self.samples.append((time.time(), {f"{self.label(p)}#{p}": s
                                               for p, s in tree.items()}))


def tier(events: dict[str, dict[str, Any]]) -> str:
    sender = events["push"]["proc"]
    node = events.get("pulled", {}).get("proc", "")
    if node.startswith("supernode-edge"):
        return "cloud -> edge"
    return "edge -> client" if sender.startswith("edge-") else "cloud -> client"


def legs(trace: list[dict[str, Any]]
         ) -> dict[tuple[str, str], dict[str, list[tuple[float, float | None]]]]:
    """(tier, message type) -> leg name -> (seconds, CPU seconds of the process or None) of
    each message; CPU only for a leg whose two events are in one process."""
    by_id: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for event in trace:
        for msg_id in event["ids"]:
            by_id[msg_id].setdefault(event["ev"], event)
    out: dict[tuple[str, str], dict[str, list[tuple[float, float | None]]]] = defaultdict(
        lambda: defaultdict(list))
    for events in by_id.values():
        if "push" not in events or "reply" not in events:
            continue
        key = (tier(events), events["push"].get("kind", "?"))
        for start, end, name in LEGS:
            if start in events and end in events:
                a, b = events[start], events[end]
                cpu = (b["cpu"] - a["cpu"] if a["proc"] == b["proc"] and "cpu" in a
                       and "cpu" in b and start != "push" else None)  # push: t is before the push
                out[key][name].append((b["t"] - a["t"], cpu))
    return out


def leg_table(trace: list[dict[str, Any]], kind: str = "train") -> str:
    """The markdown table of docs/deployment.md#latency: per tier, the median seconds of
    each leg of ``kind`` messages, and the median CPU seconds of the process doing a leg
    that one process does (the rest of that leg is waiting for a core or a sleep)."""
    table = {where: t for (where, k), t in sorted(legs(trace).items()) if k == kind}
    head = "| leg | " + " | ".join(f"{w}: s | CPU s" for w in table) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(table)]
    for _, _, name in LEGS:
        cells = []
        for rows in table.values():
            if not rows.get(name):
                cells += ["", ""]
                continue
            cpus = [c for _, c in rows[name] if c is not None]
            cells += [f"{statistics.median(s for s, _ in rows[name]):.3f}",
                      f"{statistics.median(cpus):.3f}" if cpus else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    counts = ", ".join(f"{w}: {len(next(iter(t.values())))}" for w, t in table.items() if t)
    return "\n".join([*lines, f"({kind} messages: {counts})"])


def report(run: Path, trace: list[dict[str, Any]]) -> str:
    lines = [leg_table(trace)]
    trains = [e for e in trace if e["ev"] == "exchange" and e.get("kind") == "train"]
    at_edges = [e["s"] for e in trains if e["proc"].startswith("edge-")]
    rounds = at_edges or [e["s"] for e in trains]  # flat: the cloud runs the edge rounds
    if rounds:
        lines.append(f"edge round (send_and_receive of train messages): median "
                     f"{statistics.median(rounds):.3f} s over {len(rounds)} "
                     f"(min {min(rounds):.3f}, max {max(rounds):.3f})")
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


def kind_of(process: str) -> str:
    """``supernode-3/fedhier.engines.deployment.supernode#812`` -> ``supernode-N/...``."""
    return re.sub(r"-\d+/", "-N/", process.split("#")[0], count=1)


def cpu_report(samples: list[tuple[float, dict[str, float]]],
               windows: list[tuple[float, float]]) -> str:
    """The cores each kind of process kept busy during edge rounds (``windows``: start,
    end), over the sample intervals whose middle falls in one."""
    used: dict[str, float] = defaultdict(float)
    wall = 0.0
    for (t0, before), (t1, after) in zip(samples, samples[1:], strict=False):
        middle = (t0 + t1) / 2
        if not any(a <= middle <= b for a, b in windows):
            continue
        wall += t1 - t0
        for process, seconds in after.items():
            used[kind_of(process)] += seconds - before.get(process, seconds)
    if wall == 0:
        return ""
    lines = [f"CPU during edge rounds ({wall:.1f} s sampled): "
             f"{sum(used.values()) / wall:.2f} of {os.cpu_count()} cores busy, "
             f"{sum(used.values()) / len(windows):.2f} CPU s per edge round (all processes)",
             f"  {'process (all of the kind)':<60}{'cores':>7}"]
    for kind, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            lines.append(f"  {kind:<60}{seconds / wall:>7.2f}")
    return "\n".join(lines)


def print_report(out: Path) -> None:
    """Print the tables of run folder ``out`` (its trace and CPU samples lie beside it)."""
    trace = read_trace(out.parent / f"{out.name}-trace")
    print(report(out, trace))
    samples_file = out.parent / f"{out.name}-cpu.json"
    if samples_file.exists():
        samples = [(t, cpu) for t, cpu in json.loads(samples_file.read_text())]
        windows = [(e["t"] - e["s"], e["t"]) for e in trace if e["ev"] == "exchange"
                   and e.get("kind") == "train"]
        print(cpu_report(samples, windows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--edges", type=int, default=2, help="0: no edge servers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="run folder (default: a temporary one)")
    parser.add_argument("--report", type=Path, metavar="RUN",
                        help="print the tables of an earlier run folder, run nothing")
    args, extra = parser.parse_known_args(argv)
    if args.report:
        print_report(args.report)
        return 0
    from fedhier.engines.deployment import free_port_block
    from fedhier.engines.deployment import main as deploy
    from fedhier.engines.deployment.ports import ports_needed

    out = args.out or Path(tempfile.mkdtemp(prefix="deploy-latency-")) / "run"
    os.environ[TRACE_ENV] = str(out.parent / f"{out.name}-trace")
    port = free_port_block(ports_needed(args.nodes, args.edges))
    flags = ["local", "--nodes", str(args.nodes), "--rounds", str(args.rounds),
             "--base-port", str(port), "--out", str(out)]
    if args.edges:
        flags += ["--edges", str(args.edges), "--grouping", "contiguous"]
    defaults = ["--local-period", "2", "--global-period", "8", "--batch-size", "8",
                "--seed", "11"]  # 4 edge rounds per cloud round, a tiny MLP
    sampler = CpuSampler()
    sampler.start()
    try:
        code = deploy([*flags, *defaults, *extra])
    finally:
        sampler.halt.set()
    if code != 0:
        return code
    (out.parent / f"{out.name}-cpu.json").write_text(json.dumps(sampler.samples))
    print(f"\n{' '.join(['fedhier deploy', *flags[:-4], *defaults, *extra])}")
    print_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

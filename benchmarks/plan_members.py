"""An edge round's plan at scale: every edge's clients from one sort against a scan per edge.

    python benchmarks/plan_members.py                         # 1,000,000 clients, 10,000 edges
    python benchmarks/plan_members.py --clients 100000 --edges 1000

``fedhier.round.participants.plan_edge_round`` needs each edge's clients (increasing ids) once per
edge round. It used to take them with ``np.flatnonzero(edge_of == e)`` for every edge e (O(n) per
edge); ``fedhier.round.participants.members_by_edge`` takes them all from one stable sort. Prints
the median seconds of each (``--repeats`` side by side; the scan is timed on ``--sample`` edges and
scaled to all of them), their ratio, and checks the two give the same arrays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fedhier.round.participants import members_by_edge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1_000_000)
    parser.add_argument("--edges", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", type=int, default=100, help="edges the scan is timed on")
    args = parser.parse_args()
    edge_of = np.random.default_rng(0).integers(0, args.edges, size=args.clients)
    sampled = np.linspace(0, args.edges - 1, min(args.sample, args.edges)).astype(np.int64)
    sort_s, scan_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        members = members_by_edge(edge_of, args.edges)
        sort_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        scanned = [np.flatnonzero(edge_of == e) for e in sampled.tolist()]
        scan_s.append((time.perf_counter() - t0) * args.edges / len(sampled))
    assert all(np.array_equal(members[e], s) for e, s in zip(sampled.tolist(), scanned,
                                                              strict=True))
    sort, scan = statistics.median(sort_s), statistics.median(scan_s)
    print(f"{args.clients:,} clients, {args.edges:,} edges; median of {args.repeats}")
    print(f"  one stable sort (members_by_edge): {sort:.3f} s")
    print(f"  a scan per edge (flatnonzero):     {scan:.3f} s")
    print(f"  ratio: {scan / sort:.1f}x")


if __name__ == "__main__":
    main()

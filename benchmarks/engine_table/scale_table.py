"""``--scale N1,N2,...``: the vectorized engine's speed and memory at many clients."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .measure import device_name, machine
from .processes import spawn


def parent_scale(args: argparse.Namespace) -> dict[str, Any]:
    """``--scale N1,N2,...``: the vectorized engine on W1 replicated to each client count,
    each in a fresh process (so ``ru_maxrss`` is that size's peak), chunked by
    ``--client-chunk`` (default 0: the engine's automatic chunk)."""
    chunk = args.client_chunk
    print(f"scale: W1 replicated, vectorized, {args.threads} torch thread(s), device "
          f"{device_name(args.device)}, client_chunk {chunk or 'auto'}, {args.rounds} cloud "
          f"round(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    runs = [spawn("scaling", args, clients=n, repeats=1, client_chunk=min(chunk, n),
                  device=args.device) for n in args.scale]
    for previous, run in zip([None, *runs[:-1]], runs, strict=True):
        run["bytes_per_client"] = (run["peak_rss_mb"] - run["rss_before_mb"]) * 2**20 / run[
            "clients"]
        run["marginal_bytes_per_client"] = (
            None if previous is None else (run["peak_rss_mb"] - previous["peak_rss_mb"])
            * 2**20 / (run["clients"] - previous["clients"]))
    return {"command": "python benchmarks/engines.py " + " ".join(sys.argv[1:]),
            "machine": machine(), "threads": args.threads, "device": device_name(args.device),
            "scale": {
                "workload": "W1 replicated: client j holds the rows of W1 client j mod 100 "
                            "(its own batch order), 10 clients per edge, random grouping, "
                            "mlp 64-128-10 (9,610 parameters = 37.5 KiB per client model)",
                "memory": "peak_rss_mb: ru_maxrss of the fresh worker process; "
                          "bytes_per_client = (peak - RSS before the measured run) / clients; "
                          "marginal = peak difference / client difference to the previous size",
                "runs": runs}}


def print_scale(report: dict[str, Any]) -> None:
    print(f"\ndevice: {report['device']}")
    print(f"{'clients':>9}{'chunk':>7}{'steps/s':>10}{'s/edge round':>14}{'set-up s':>10}"
          f"{'RSS before MB':>15}{'peak RSS MB':>13}{'bytes/client':>14}{'marginal B/client':>19}")
    for run in report["scale"]["runs"]:
        marginal = run["marginal_bytes_per_client"]
        print(f"{run['clients']:>9,}{run['client_chunk'] or 'auto':>7}"
              f"{run['client_steps_per_s']:>10,.0f}"
              f"{run['seconds_per_edge_round']:>14.3f}{run['setup_seconds']:>10.1f}"
              f"{run['rss_before_mb']:>15,.0f}{run['peak_rss_mb']:>13,.0f}"
              f"{run['bytes_per_client']:>14,.0f}"
              f"{'-' if marginal is None else f'{marginal:,.0f}':>19}")


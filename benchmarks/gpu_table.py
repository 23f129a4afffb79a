"""The GPU check's table (``benchmarks/gpu_check.sh``): W1, W2' and the million-client case,
cuda against cpu, from the JSON reports the check wrote into ``DIR``; printed, written to
``DIR/gpu_table.md`` and, with ``--docs docs/engines.md``, put in place of that page's
section between ``<!-- gpu-check:start -->`` and ``<!-- gpu-check:end -->``.

    python benchmarks/gpu_table.py DIR [--docs docs/engines.md]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

START, END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _steps(report: dict[str, Any] | None, row: str) -> float | None:
    if report is None:
        return None
    if "scale" in report:
        return float(report["scale"]["runs"][0]["client_steps_per_s"])
    engines = report.get("engines", {})
    return float(engines[row]["client_sgd_steps_per_s"]) if row in engines else None


def table(folder: Path) -> str:
    """The markdown table of the reports in ``folder`` (a missing one: "not run")."""
    rows = [("W1, 100 clients (`--quick`, 3 cloud rounds), `vectorized`", "w1_cpu.json",
             "w1_cuda.json", "vectorized"),
            ("W2' (LeNet-5, Fashion-MNIST, 50 clients, 1 cloud round), `vectorized`",
             "w2p_cpu.json", "w2p_cuda.json", "vectorized, 1 thread"),
            ("W2', `inprocess`", "w2p_cpu.json", "w2p_cuda.json", "inprocess, 1 thread"),
            ("W1 replicated, 1,000,000 clients, G = 5 (one edge round), `vectorized`",
             "scale_1m_cpu.json", "scale_1m_cuda.json", "")]
    device = next((r.get("device") for name in ("w1_cuda.json", "w2p_cuda.json",
                                                "scale_1m_cuda.json")
                   if (r := _load(folder / name)) is not None and r.get("device")), "?")
    lines = [f"Measured by `bash benchmarks/gpu_check.sh` on {device} (load average "
             f"{os.getloadavg()[0]:.1f} at the end; one torch thread on the cpu rows):", "",
             "| workload | cpu steps/s | cuda steps/s | cuda / cpu |", "|---|---:|---:|---:|"]
    for label, cpu_file, cuda_file, row in rows:
        cpu, cuda = (_steps(_load(folder / f), row) for f in (cpu_file, cuda_file))
        ratio = f"{cuda / cpu:.2f}x" if cpu and cuda else ""
        lines.append(f"| {label} | {f'{cpu:,.0f}' if cpu else 'not run / did not finish'} | "
                     f"{f'{cuda:,.0f}' if cuda else 'not run / did not finish'} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--docs", type=Path, default=None)
    args = parser.parse_args()
    text = table(args.folder)
    print(text)
    (args.folder / "gpu_table.md").write_text(text)
    if args.docs is not None:
        page = args.docs.read_text()
        if START in page and END in page:
            head, rest = page.split(START, 1)
            page = head + START + "\n" + text + END + rest.split(END, 1)[1]
            args.docs.write_text(page)
            print(f"wrote the table into {args.docs}")


if __name__ == "__main__":
    main()

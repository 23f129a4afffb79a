"""``make experiments``: run every suite at full size and write docs/results.md.

Each suite's results.md (table, claim checks, the exact command and the machine time) is
copied into docs/results.md, and its figures into docs/figures/<run>/.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from fedhier.cli.commands import main as fedhier_main

RUNS: list[tuple[str, list[str]]] = [
    ("sandwich-fmnist-a0.1", ["experiment", "sandwich", "--dataset", "fashion-mnist",
                              "--alpha", "0.1", "--iterations", "400"]),
    ("sandwich-fmnist-a0.5", ["experiment", "sandwich", "--dataset", "fashion-mnist",
                              "--alpha", "0.5", "--iterations", "400"]),
    ("sandwich-fmnist-a0.1-T1200", ["experiment", "sandwich", "--dataset", "fashion-mnist",
                                    "--alpha", "0.1"]),
    ("sandwich-fmnist-a0.5-T1200", ["experiment", "sandwich", "--dataset", "fashion-mnist",
                                    "--alpha", "0.5"]),
    ("sandwich-digits", ["experiment", "sandwich", "--dataset", "digits", "--clients", "20",
                         "--groups", "4", "--alpha", "0.1", "--min-partition-size", "2"]),
    ("grouping-fmnist-a0.1", ["experiment", "grouping", "--dataset", "fashion-mnist",
                              "--alpha", "0.1"]),
    ("grouping-digits", ["experiment", "grouping", "--dataset", "digits", "--clients", "40",
                         "--groups", "4", "--alpha", "0.1", "--min-partition-size", "2"]),
    ("grouping-fmnist-a0.5", ["experiment", "grouping", "--dataset", "fashion-mnist",
                              "--alpha", "0.5"]),
    ("periods-fmnist-a0.5", ["experiment", "periods", "--dataset", "fashion-mnist",
                             "--alpha", "0.5"]),
    ("periods-fmnist-a0.1", ["experiment", "periods", "--dataset", "fashion-mnist",
                             "--alpha", "0.1"]),
    ("periods-digits", ["experiment", "periods", "--dataset", "digits"]),
    ("levels-fmnist-a0.1", ["experiment", "levels", "--dataset", "fashion-mnist",
                            "--alpha", "0.1", "--groups", "10"]),
    ("levels-fmnist-a0.5", ["experiment", "levels", "--dataset", "fashion-mnist",
                            "--alpha", "0.5", "--groups", "10"]),
    ("levels-digits", ["experiment", "levels", "--dataset", "digits", "--groups", "10"]),
    ("diversity-digits", ["experiment", "diversity", "--dataset", "digits", "--seeds", "5"]),
    ("time-fmnist-a0.5", ["experiment", "time", "--dataset", "fashion-mnist",
                          "--alpha", "0.5", "--iterations", "400"]),
    ("mobility-fmnist-a0.5", ["experiment", "mobility", "--dataset", "fashion-mnist",
                              "--alpha", "0.5", "--iterations", "400"]),
    ("hierfavg-fmnist", ["experiment", "hierfavg", "--dataset", "fashion-mnist"]),
    ("mobility-noniid-fmnist-c1", ["experiment", "mobility-noniid", "--dataset",
                                   "fashion-mnist", "--partition", "shards",
                                   "--classes-per-client", "1", "--iterations", "400",
                                   "--seeds", "2"]),
]


def published_sections(results_md: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The sections (run name -> text) and claim rows (run name -> rows) already published
    in ``results_md``, so that publishing some runs keeps the others' evidence."""
    if not results_md.exists():
        return {}, {}
    sections: dict[str, str] = {}
    claims: dict[str, list[str]] = {}
    name = ""
    for line in results_md.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].split(":", 1)[0] if ":" in line else ""
            if name:
                sections[name] = line
            continue
        if name:
            sections[name] += "\n" + line
        elif line.startswith("| ") and not line.startswith("| run |"):
            claims.setdefault(line[2:].split(" |", 1)[0], []).append(line)
    return {k: v.rstrip() for k, v in sections.items()}, claims


def publish(root: Path, only: list[str] | None = None) -> None:
    docs = root / "docs"
    parts = ["# Results", "",
             "Every table and figure below was produced by `make experiments` "
             "(`python -m fedhier.studies.experiments.publish`); each section names its exact "
             "command and the machine time it took. Claims that do not hold are reported as "
             "measured.",
             "", "Sections appear for the runs that have been made; `make experiments` runs all "
             "of them (`python -m fedhier.studies.experiments.publish NAME ...` runs some). The "
             "sensitivity of each \"does not hold\" verdict (5 seeds, 95% intervals of paired "
             "differences; `python -m fedhier.studies.experiments.sensitivity`) and the paper "
             "settings are in [baselines.md](baselines.md#paper-settings-and-sensitivity).",
             ""]
    claims: list[str] = []
    old_sections, old_claims = published_sections(docs / "results.md")
    for name, args in RUNS:
        out = root / "runs" / "experiments" / name  # run from the repository root
        if only and name not in only:
            if not (out / "results.md").exists():
                if name in old_sections:  # published before, its run folder is gone: keep
                    parts += [old_sections[name], ""]
                    claims += old_claims.get(name, [])
                continue
        else:
            started = time.time()
            code = fedhier_main([*args, "--out", str(out.relative_to(root))])
            if code != 0:
                parts += [f"## {name}", "", f"failed with exit code {code}", ""]
                continue
            print(f"{name}: {time.time() - started:.0f} s", flush=True)
        figures = docs / "figures" / name
        figures.mkdir(parents=True, exist_ok=True)
        text = (out / "results.md").read_text()
        for png in out.glob("*.png"):
            shutil.copy(png, figures / png.name)
            text = text.replace(f"]({png.name})", f"](figures/{name}/{png.name})")
        parts += [text.replace("## ", f"## {name}: ", 1), ""]
        results = json.loads((out / "results.json").read_text())
        claims += [f"| {name} | {claim} | {'holds' if ok else '**does not hold**'} |"
                   for claim, ok in results.get("claims", {}).items()]
    if claims:  # the verdicts first, the evidence below
        at = next(i for i, part in enumerate(parts) if part.startswith("## "))
        parts[at:at] = ["## Claims at a glance", "", "| run | claim | verdict |",
                        "|---|---|---|", *claims, ""]
    text = "\n".join(parts).replace(f"--out {root}/", "--out ")  # commands as run from root
    (docs / "results.md").write_text(text)
    print(f"wrote {docs / 'results.md'}")


if __name__ == "__main__":
    publish(Path.cwd(), only=sys.argv[1:] or None)

"""Yin et al.'s time-to-95%-training-accuracy claim at the size this shared machine affords
(the ``diversity`` suite's full run did not finish here): Δ and m·Δ of every mechanism
(logreg, pooled digits, initial model) and the iterations of distributed mini-batch SGD of
the ``cnn`` to 95% training accuracy at B = 512, rates 0.4, 0.8, 1.6, 5 seeds::

    python -m fedhier.studies.experiments.diversity_accuracy

writes ``runs/experiments/diversity-accuracy/results.md`` and ``results.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fedhier.common.rng import torch_seed
from fedhier.local.models import build_model
from fedhier.runs.prepare import pooled_train_tensors, prepare
from fedhier.settings.run_config import RunConfig
from fedhier.studies.experiments.diversity_suite import (
    measured_bound,
    mechanisms_for,
    time_to_accuracy,
)

OUT = Path("runs/experiments/diversity-accuracy")
SEEDS = list(range(5))


def bounds(base: RunConfig) -> dict[str, list[tuple[float, float]]]:
    """variant -> per seed (Δ, m·Δ) of logreg at its initial model, per mechanism."""
    fed = prepare(base.replace(model="logreg", partition="iid", clients=1, groups=(1,)))
    x, y = pooled_train_tensors(fed, torch.device("cpu"))
    out: dict[str, list[tuple[float, float]]] = {}
    for seed in SEEDS:
        model = build_model("logreg", fed.bundle.input_shape, fed.bundle.num_classes,
                            seed=torch_seed(seed, "model-init"))
        start = {k: v.detach() for k, v in model.state_dict().items()}
        for mechanism in [None, *mechanisms_for(model, start, x, y)]:
            name = "original" if mechanism is None else mechanism.name.split(" (")[0]
            out.setdefault(name, []).append(measured_bound(model, start, x, y, mechanism,
                                                           seed))
    return out


def main() -> None:
    torch.set_num_threads(1)
    started = time.time()
    base = RunConfig(dataset="digits")
    measured = bounds(base)
    extra, md, claims = time_to_accuracy(base, SEEDS, model="cnn", batch_sizes=[512],
                                         lrs=(0.4, 0.8, 1.6), target=0.95, max_iterations=600,
                                         check_every=5)
    seconds = time.time() - started
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(
        {"bounds": measured, **extra, "claims": claims, "seconds": seconds}, indent=1,
        default=str))
    lines = ["| variant | Δ at start (mean over 5 seeds) | bound m·Δ |", "|---|---|---|"]
    for name, values in measured.items():
        lines.append(f"| {name} | {sum(d for d, _ in values) / len(values):.4g} | "
                     f"{sum(b for _, b in values) / len(values):.1f} |")
    text = "\n".join([*lines, "", *md, "", f"Claims: {claims}", "",
                      f"({seconds / 60:.1f} min wall clock)", ""])
    (OUT / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

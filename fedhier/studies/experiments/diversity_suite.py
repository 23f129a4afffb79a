"""Gradient diversity and the batch-size bound (Yin et al. 2018; algorithms.md §4).

Mini-batch SGD with batch size B = 1, 2, 4, ... on a convex model (logreg) over the pooled
training data, from the same seeded start and with the same learning rate: the iterations to
reach a target training loss, and B x iterations. Below the bound B_S = m·Δ (Δ measured at the
initial model) B x iterations should stay roughly flat (linear speed-up); beyond it, it grows.
Two variants move the bound: ``duplicates`` (the data replaced by copies of a small subset:
lower diversity) and ``dropout`` (DropConnect-like masking of each per-example gradient with
keep probability p, rescaled by 1/p: higher diversity).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.func import grad, vmap  # noqa: E402

from fedhier.common.rng import generator, torch_seed  # noqa: E402
from fedhier.diagnostics.measures import gradient_diversity  # noqa: E402
from fedhier.local.models import build_model  # noqa: E402
from fedhier.local.train import batch_indices, loss_fn  # noqa: E402
from fedhier.runs.prepare import pooled_train_tensors, prepare  # noqa: E402
from fedhier.settings.run_config import RunConfig  # noqa: E402
from fedhier.studies.experiments.suites import Report  # noqa: E402

KEEP = 0.5  # dropout variant: keep probability of each gradient coordinate


def _per_example_grads(model: torch.nn.Module, params: dict[str, torch.Tensor],
                       x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(model, p, xi[None], yi[None])

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _masked(grads: dict[str, torch.Tensor], seed: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(torch_seed(seed, "dropout-mask", step))
    return {k: g * (torch.rand(g.shape, generator=gen) < KEEP) / KEEP for k, g in grads.items()}


def measured_bound(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, dropout: bool, seed: int) -> tuple[float, float]:
    """(Δ, m·Δ) over all m per-example gradients (masked ones for the dropout variant)."""
    grads = _per_example_grads(model, params, x, y)
    if dropout:
        grads = _masked(grads, seed, 2**31)  # a mask stream apart from the training steps
    flat = torch.cat([g.reshape(len(y), -1) for g in grads.values()], dim=1)
    delta = gradient_diversity(flat)
    return delta, len(y) * delta


def iterations_to_target(model: torch.nn.Module, start: dict[str, torch.Tensor],
                         x: torch.Tensor, y: torch.Tensor, batch: int, lr: float, target: float,
                         max_iterations: int, dropout: bool, seed: int) -> int | None:
    """Mini-batch SGD steps until the full training loss is <= target (None: not within the
    cap). Batches follow :func:`fedhier.local.train.batch_indices` (epochs of permutations)."""
    params = {k: v.clone() for k, v in start.items()}
    chunk = 256
    for offset in range(0, max_iterations, chunk):
        steps = min(chunk, max_iterations - offset)
        rows = torch.as_tensor(batch_indices(seed, 0, len(y), batch, offset, steps))
        for k, r in enumerate(rows):
            if dropout:
                grads = _masked(_per_example_grads(model, params, x[r], y[r]), seed, offset + k)
                g = {name: v.mean(0) for name, v in grads.items()}
            else:
                leaves = {n: v.requires_grad_(True) for n, v in params.items()}
                values = torch.autograd.grad(loss_fn(model, leaves, x[r], y[r]),
                                             tuple(leaves.values()))
                g = dict(zip(leaves, values, strict=True))
            with torch.no_grad():
                params = {n: params[n].detach() - lr * g[n] for n in params}
                loss = float(loss_fn(model, params, x, y))
                if loss <= target:
                    return offset + k + 1
                if not np.isfinite(loss) or loss > 1e3:
                    return None  # diverged at this rate
    return None


def diversity(base: RunConfig, seeds: Sequence[int], out: Path, batch_sizes: Sequence[int],
              lrs: Sequence[float], target: float, max_iterations: int,
              duplicates: int) -> Report:
    """Run the three variants (original, duplicates, dropout) for every batch size, each with
    the best learning rate of ``lrs`` (fewest iterations to the target), as in empirical
    batch-size studies: a fixed rate would measure the rate, not the batch size."""
    torch.set_num_threads(1)  # tiny steps: threads only add overhead
    cfg = base.replace(model="logreg", partition="iid", clients=1, groups=(1,))
    fed = prepare(cfg)
    x_all, y_all = pooled_train_tensors(fed, torch.device("cpu"))
    rows = generator(cfg.seed, "duplicates").choice(len(y_all), duplicates, replace=False)
    copies = np.resize(rows, len(y_all))
    variants = {"original": (x_all, y_all, False),
                f"duplicates ({duplicates} distinct rows)": (x_all[copies], y_all[copies],
                                                              False),
                f"dropout (keep {KEEP})": (x_all, y_all, True)}
    results: dict[str, Any] = {}
    for name, (x, y, dropout) in variants.items():
        per_seed: list[dict[str, Any]] = []
        for seed in seeds:
            model = build_model("logreg", fed.bundle.input_shape, fed.bundle.num_classes,
                                seed=torch_seed(seed, "model-init"))
            start = {k: v.detach() for k, v in model.state_dict().items()}
            delta, bound = measured_bound(model, start, x, y, dropout, seed)
            its, best_lr = [], []
            for b in batch_sizes:
                best, best_its = None, max_iterations
                for rate in lrs:  # a rate only has to beat the best so far: cap it there
                    found = iterations_to_target(model, start, x, y, b, rate, target, best_its,
                                                 dropout, seed)
                    if found is not None and (best is None or found < best_its):
                        best, best_its = rate, found
                its.append(best_its if best is not None else None)
                best_lr.append(best)
            per_seed.append({"delta": delta, "bound": bound, "iterations": its,
                             "best_lr": best_lr})
        its_arr = np.array([[np.nan if i is None else i for i in s["iterations"]]
                            for s in per_seed], dtype=np.float64)
        mean_its = its_arr.mean(0)
        results[name] = {
            "delta": float(np.mean([s["delta"] for s in per_seed])),
            "bound": float(np.mean([s["bound"] for s in per_seed])),
            "batch_sizes": list(batch_sizes),
            "iterations_mean": [None if np.isnan(v) else float(v) for v in mean_its],
            "iterations_std": [None if np.isnan(v) else float(v) for v in its_arr.std(0)],
            "b_times_iterations": [None if np.isnan(v) else float(v * b)
                                   for v, b in zip(mean_its, batch_sizes, strict=True)],
            "per_seed": per_seed,
        }
    claims = {}
    original = results["original"]
    work = np.array([np.nan if v is None else v for v in original["b_times_iterations"]])
    below = np.array(batch_sizes) <= original["bound"]
    if below.sum() >= 2 and not np.isnan(work[below]).any():
        claims["B x iterations flat (within 2x) up to the measured bound"] = bool(
            work[below].max() <= 2 * work[below].min())
    beyond = ~below & ~np.isnan(work)
    if beyond.any() and not np.isnan(work[0]):
        claims["B x iterations grows beyond the bound (largest B > 2x B=1)"] = bool(
            work[beyond][-1] > 2 * work[0])
    _plot(results, out / "diversity.png", target)
    md = ["| variant | Δ at start | bound m·Δ | " + " | ".join(f"B={b}" for b in batch_sizes)
          + " |", "|---|---|---|" + "---|" * len(batch_sizes)]
    for name, r in results.items():
        cells = ["–" if v is None else f"{v:.0f}" for v in r["b_times_iterations"]]
        md.append(f"| {name} | {r['delta']:.4g} | {r['bound']:.1f} | " + " | ".join(cells)
                  + " |")
    md += ["", f"Cells: B × (iterations to reach training loss {target}), mean over seeds; "
           f"best lr of {list(lrs)} per cell, logreg on pooled {cfg.dataset}; '–' = not "
           f"reached in {max_iterations} "
           "iterations. Δ = Σ_k ||g_k||² / ||Σ_k g_k||² over the m per-example gradients at "
           "the initial model (not 1/Δ, not a square root).", "", "![diversity](diversity.png)"]
    return Report({"variants": results, "target_loss": target, "lrs": list(lrs),
                   "claims": claims},
                  "\n".join(md), claims)


def _plot(results: dict[str, Any], path: Path, target: float) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (name, r), color in zip(results.items(), ("C0", "C1", "C2"), strict=False):
        b = np.array(r["batch_sizes"], dtype=float)
        work = np.array([np.nan if v is None else v for v in r["b_times_iterations"]])
        ax.plot(b, work, marker="o", color=color, label=name)
        ax.axvline(r["bound"], color=color, ls="--", lw=1,
                   label=f"bound m·Δ = {r['bound']:.0f}")
    ax.set(xscale="log", yscale="log", xlabel="batch size B",
           ylabel=f"B × iterations to loss {target}",
           title="Speed-up saturates beyond the diversity bound")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

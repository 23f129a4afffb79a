"""Gradient diversity and the batch-size bound (Yin et al. 2018; algorithms.md §4).

Mini-batch SGD with batch size B = 1, 2, 4, ... on a convex model (logreg) over the pooled
training data, from the same seeded start and with the same learning rate: the iterations to
reach a target training loss, and B x iterations. Below the bound B_S = m·Δ (Δ measured at the
initial model) B x iterations should stay roughly flat (linear speed-up); beyond it, it grows.
Variants move the bound: ``duplicates`` (the data replaced by copies of a small subset:
lower diversity) and Yin et al.'s three diversity-inducing mechanisms on every per-example
gradient (:mod:`fedhier.studies.experiments.per_example`): DropConnect-like masking, QSGD
quantisation and Gaussian (Langevin) noise: higher diversity.

Then the paper's "a diversity-inducing mechanism cuts distributed training time to 95%
training accuracy by 30%": distributed mini-batch SGD whose B examples are spread over
workers takes one round per iteration, so its time is its iterations; for each mechanism
and batch size, the iterations to 95% training accuracy (best learning rate of the grid per
cell, as for the loss target) against the same without a mechanism.
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
from fedhier.studies.experiments.per_example import (  # noqa: E402
    MEASURE_STEP,
    Mechanism,
    dropout,
    langevin,
    matched_sigma,
    mean_gradient,
    quantized,
)
from fedhier.studies.experiments.suites import Report  # noqa: E402

KEEP = 0.5  # dropout variant: keep probability of each gradient coordinate
BITS = 4  # quantised variant: bits per value (s = 7 levels)
NOISE_RATIO = 1.0  # Langevin variant: d sigma^2 = this x the mean ||g_k||^2 at the start


def _per_example_grads(model: torch.nn.Module, params: dict[str, torch.Tensor],
                       x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(model, p, xi[None], yi[None])

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _step_gradient(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, mechanism: Mechanism | None, seed: int,
                   step: int) -> dict[str, torch.Tensor]:
    """The mini-batch gradient of one step: the mean gradient, or the mean of the
    mechanism's per-example gradients."""
    if mechanism is not None:
        return mean_gradient(mechanism(_per_example_grads(model, params, x, y), seed, step))
    leaves = {n: v.detach().requires_grad_(True) for n, v in params.items()}
    values = torch.autograd.grad(loss_fn(model, leaves, x, y), tuple(leaves.values()))
    return dict(zip(leaves, values, strict=True))


def measured_bound(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, mechanism: Mechanism | None,
                   seed: int) -> tuple[float, float]:
    """(Δ, m·Δ) over all m per-example gradients (after the mechanism, drawn with a stream
    apart from the training steps')."""
    grads = _per_example_grads(model, params, x, y)
    if mechanism is not None:
        grads = mechanism(grads, seed, MEASURE_STEP)
    flat = torch.cat([g.reshape(len(y), -1) for g in grads.values()], dim=1)
    delta = gradient_diversity(flat)
    return delta, len(y) * delta


def _loss_at_most(target: float) -> Any:
    def reached(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor) -> tuple[bool, float]:
        loss = float(loss_fn(model, params, x, y))
        return loss <= target, loss
    return reached


def _accuracy_at_least(target: float) -> Any:
    def reached(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor) -> tuple[bool, float]:
        logits = torch.func.functional_call(model, params, (x,))
        accuracy = float((logits.argmax(1) == y).double().mean())
        return accuracy >= target, float(torch.nn.functional.cross_entropy(logits, y))
    return reached


def iterations_to_target(model: torch.nn.Module, start: dict[str, torch.Tensor],
                         x: torch.Tensor, y: torch.Tensor, batch: int, lr: float, target: float,
                         max_iterations: int, mechanism: Mechanism | None, seed: int,
                         criterion: Any = None, check_every: int = 1) -> int | None:
    """Mini-batch SGD steps until the full training loss is <= target (or ``criterion``
    holds, checked every ``check_every`` steps; None: not within the cap). Batches follow
    :func:`fedhier.local.train.batch_indices` (epochs of permutations)."""
    reached = criterion or _loss_at_most(target)
    params = {k: v.clone() for k, v in start.items()}
    chunk = 256
    for offset in range(0, max_iterations, chunk):
        steps = min(chunk, max_iterations - offset)
        rows = torch.as_tensor(batch_indices(seed, 0, len(y), batch, offset, steps))
        for k, r in enumerate(rows):
            g = _step_gradient(model, params, x[r], y[r], mechanism, seed, offset + k)
            with torch.no_grad():
                params = {n: params[n].detach() - lr * g[n] for n in params}
                if (offset + k + 1) % check_every and offset + k + 1 < max_iterations:
                    continue
                done, loss = reached(model, params, x, y)
                if done:
                    return offset + k + 1
                if not np.isfinite(loss) or loss > 1e3:
                    return None  # diverged at this rate
    return None


def _best(model: torch.nn.Module, start: dict[str, torch.Tensor], x: torch.Tensor,
          y: torch.Tensor, batch: int, lrs: Sequence[float], target: float,
          max_iterations: int, mechanism: Mechanism | None, seed: int, criterion: Any = None,
          check_every: int = 1) -> tuple[int | None, float | None]:
    """(fewest iterations to the target over the rates ``lrs``, that rate); a rate only has
    to beat the best so far, so it is capped there."""
    best, best_its = None, max_iterations
    for rate in lrs:
        found = iterations_to_target(model, start, x, y, batch, rate, target, best_its,
                                     mechanism, seed, criterion, check_every)
        if found is not None and (best is None or found < best_its):
            best, best_its = rate, found
    return (best_its if best is not None else None), best


def mechanisms_for(model: torch.nn.Module, start: dict[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor) -> list[Mechanism]:
    """Dropout, quantisation and Langevin noise (sigma matched to the gradients at
    ``start``)."""
    sigma = matched_sigma(_per_example_grads(model, start, x, y), NOISE_RATIO)
    # sigma depends on the seed's start: the label must not, so seeds pool into one variant
    return [dropout(KEEP), quantized(BITS),
            langevin(sigma, f"Langevin (d·σ² = {NOISE_RATIO:g} × mean squared norm)")]


def diversity(base: RunConfig, seeds: Sequence[int], out: Path, batch_sizes: Sequence[int],
              lrs: Sequence[float], target: float, max_iterations: int,
              duplicates: int, accuracy: dict[str, Any] | None = None) -> Report:
    """Run the variants (original, duplicates, each mechanism) for every batch size, each
    with the best learning rate of ``lrs`` (fewest iterations to the target), as in
    empirical batch-size studies: a fixed rate would measure the rate, not the batch size.
    ``accuracy`` (model, batch_sizes, lrs, target, max_iterations, check_every): the
    time-to-accuracy claim (None: skipped)."""
    torch.set_num_threads(1)  # tiny steps: threads only add overhead
    cfg = base.replace(model="logreg", partition="iid", clients=1, groups=(1,))
    fed = prepare(cfg)
    x_all, y_all = pooled_train_tensors(fed, torch.device("cpu"))
    rows = generator(cfg.seed, "duplicates").choice(len(y_all), duplicates, replace=False)
    copies = np.resize(rows, len(y_all))
    results: dict[str, Any] = {}
    for seed in seeds:
        model = build_model("logreg", fed.bundle.input_shape, fed.bundle.num_classes,
                            seed=torch_seed(seed, "model-init"))
        start = {k: v.detach() for k, v in model.state_dict().items()}
        variants: list[tuple[str, torch.Tensor, torch.Tensor, Mechanism | None]] = [
            ("original", x_all, y_all, None),
            (f"duplicates ({duplicates} distinct rows)", x_all[copies], y_all[copies], None),
            *((m.name, x_all, y_all, m) for m in mechanisms_for(model, start, x_all, y_all))]
        for name, x, y, mechanism in variants:
            delta, bound = measured_bound(model, start, x, y, mechanism, seed)
            found = [_best(model, start, x, y, b, lrs, target, max_iterations, mechanism,
                           seed) for b in batch_sizes]
            results.setdefault(name, {"per_seed": []})["per_seed"].append(
                {"delta": delta, "bound": bound, "iterations": [f[0] for f in found],
                 "best_lr": [f[1] for f in found]})
    for r in results.values():
        r.update(_summary(r["per_seed"], batch_sizes))
    claims = _bound_claims(results["original"], batch_sizes)
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
           "the initial model (not 1/Δ, not a square root), after the mechanism. Mechanisms "
           f"on every per-example gradient: DropConnect-like masks (keep {KEEP}, rescaled), "
           f"QSGD to {BITS} bits per value (s = {2 ** (BITS - 1) - 1}), Gaussian noise with "
           f"d·σ² = {NOISE_RATIO} × the mean ||g_k||² at the start (Langevin: at batch B and "
           "rate η the temperature T = η σ² / (2B)).", "", "![diversity](diversity.png)"]
    extra: dict[str, Any] = {}
    if accuracy is not None:
        extra, acc_md, acc_claims = time_to_accuracy(base, seeds, **accuracy)
        claims.update(acc_claims)
        md += ["", *acc_md]
    return Report({"variants": results, "target_loss": target, "lrs": list(lrs),
                   "claims": claims, **extra},
                  "\n".join(md), claims)


def _summary(per_seed: list[dict[str, Any]], batch_sizes: Sequence[int]) -> dict[str, Any]:
    its_arr = np.array([[np.nan if i is None else i for i in s["iterations"]]
                        for s in per_seed], dtype=np.float64)
    mean_its = its_arr.mean(0)
    return {
        "delta": float(np.mean([s["delta"] for s in per_seed])),
        "bound": float(np.mean([s["bound"] for s in per_seed])),
        "batch_sizes": list(batch_sizes),
        "iterations_mean": [None if np.isnan(v) else float(v) for v in mean_its],
        "iterations_std": [None if np.isnan(v) else float(v) for v in its_arr.std(0)],
        "b_times_iterations": [None if np.isnan(v) else float(v * b)
                               for v, b in zip(mean_its, batch_sizes, strict=True)],
    }


def _bound_claims(original: dict[str, Any], batch_sizes: Sequence[int]) -> dict[str, bool]:
    claims = {}
    work = np.array([np.nan if v is None else v for v in original["b_times_iterations"]])
    below = np.array(batch_sizes) <= original["bound"]
    if below.sum() >= 2 and not np.isnan(work[below]).any():
        claims["B x iterations flat (within 2x) up to the measured bound"] = bool(
            work[below].max() <= 2 * work[below].min())
    beyond = ~below & ~np.isnan(work)
    if beyond.any() and not np.isnan(work[0]):
        claims["B x iterations grows beyond the bound (largest B > 2x B=1)"] = bool(
            work[beyond][-1] > 2 * work[0])
    return claims


def time_to_accuracy(base: RunConfig, seeds: Sequence[int], model: str,
                     batch_sizes: Sequence[int], lrs: Sequence[float], target: float,
                     max_iterations: int, check_every: int,
                     ) -> tuple[dict[str, Any], list[str], dict[str, bool]]:
    """Iterations of distributed mini-batch SGD (``model`` on the pooled training rows) to
    training accuracy ``target`` per mechanism and batch size, and the paired reduction
    against no mechanism (per seed, then mean and 95% interval over seeds)."""
    from fedhier.studies.sweep.stats import t_interval

    cfg = base.replace(model=model, partition="iid", clients=1, groups=(1,))
    fed = prepare(cfg)
    x, y = pooled_train_tensors(fed, torch.device("cpu"))
    criterion = _accuracy_at_least(target)
    table: dict[str, dict[int, list[float]]] = {}
    for seed in seeds:
        net = build_model(model, fed.bundle.input_shape, fed.bundle.num_classes,
                          seed=torch_seed(seed, "model-init"))
        start = {k: v.detach() for k, v in net.state_dict().items()}
        arms: list[tuple[str, Mechanism | None]] = [
            ("none", None), *((m.name, m) for m in mechanisms_for(net, start, x, y))]
        for name, mechanism in arms:
            for b in batch_sizes:
                its, _ = _best(net, start, x, y, b, lrs, 0.0, max_iterations, mechanism, seed,
                               criterion, check_every)
                table.setdefault(name, {}).setdefault(b, []).append(
                    float("nan") if its is None else float(its))
    claim = (f"a diversity-inducing mechanism cuts the iterations (distributed time) to "
             f"{target:.0%} training accuracy by >= 30% at some batch size ({model}, "
             f"{cfg.dataset})")
    md = [f"Iterations to {target:.0%} training accuracy ({model} on pooled {cfg.dataset}, "
          f"checked every {check_every}; best lr of {list(lrs)} per cell; mean over seeds "
          f"{list(seeds)}), and each mechanism's paired reduction against none, mean "
          "[95% interval] over seeds:", "",
          "| mechanism | " + " | ".join(f"B={b}" for b in batch_sizes) + " |",
          "|---|" + "---|" * len(batch_sizes)]
    reductions: dict[str, dict[int, Any]] = {}
    best_cut = -np.inf
    for name, by_batch in table.items():
        cells = []
        for b in batch_sizes:
            runs = np.array(by_batch[b])
            if len(runs) != len(seeds):
                raise ValueError(f"{name}, B={b}: {len(runs)} runs for {len(seeds)} seeds")
            cell = "–" if np.isnan(runs).any() else f"{runs.mean():.0f}"
            if name != "none" and not np.isnan(runs).any() and not np.isnan(
                    table["none"][b]).any():
                cut = 1 - runs / np.array(table["none"][b])
                diff = t_interval(list(cut))
                reductions.setdefault(name, {})[b] = diff
                span = ("" if diff["low"] is None else
                        f" [{diff['low']:+.0%}, {diff['high']:+.0%}]")
                cell += f" ({diff['mean']:+.0%}{span})"
                best_cut = max(best_cut, diff["mean"])
            cells.append(cell)
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    md += ["", "A reduction is 1 − (iterations with the mechanism) / (iterations without), "
           "per seed; '–': not reached within "
           f"{max_iterations} iterations at any rate."]
    claims = {claim: bool(best_cut >= 0.3)} if np.isfinite(best_cut) else {}
    return ({"accuracy": {"model": model, "target": target, "iterations": {
        k: {str(b): v for b, v in d.items()} for k, d in table.items()},
        "reductions": {k: {str(b): v for b, v in d.items()} for k, d in reductions.items()}}},
        md, claims)


def _plot(results: dict[str, Any], path: Path, target: float) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (name, r), color in zip(results.items(), ("C0", "C1", "C2", "C3", "C4"),
                                strict=False):
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

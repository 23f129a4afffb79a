"""Where a W2' local step goes, and the convolution kernels' own rate: LeNet-5 on 28x28
inputs, batch 20, one torch thread, CPU time.

(a) the plain loop's step (one client: ``nn.Module`` + autograd + ``torch.optim.SGD``) and
(b) the vectorized engine's step for a chunk of c clients (``conv_chain_grads`` and the SGD
rule over the client axis, as ``conv_chain_training`` runs it), each timed and profiled op by
op; then (c) every convolution kernel alone, forward and backward, as the plain loop calls it
(one client, batch 20) and as the engine calls it (grouped, c clients): ms per client step
and GFLOP/s. The last lines say how far the engine's step is from the time of its own
convolution kernels alone (the ceiling if every other op vanished).

    python benchmarks/profile_lenet5.py [--clients 8] [--repeats 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import model_macs  # noqa: E402

from fedhier.engines.vectorized.conv_kernels import (  # noqa: E402
    conv_chain_grads,
    grouped,
    keep_freed_memory,
)
from fedhier.engines.vectorized.kernels import weighted_targets  # noqa: E402
from fedhier.local.models import build_model, conv_chain  # noqa: E402
from fedhier.local.optimizer import LocalOptimizer  # noqa: E402

SHAPE, BATCH, LR = (1, 28, 28), 20, 0.05
aten = torch.ops.aten


def cpu_ms(fn: Any, repeats: int) -> float:
    """Median-free mean CPU milliseconds of ``fn`` over ``repeats`` calls after one warm-up."""
    fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def top_ops(fn: Any, repeats: int, step_ms: float) -> list[tuple[str, float]]:
    """(op, ms per client step) of the 8 largest ops by self time: each op's share of the
    profile's total self time (the profiler's clock is the wall, which other load on the
    machine stretches) applied to the step's CPU milliseconds ``step_ms``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return [(e.key, e.self_cpu_time_total / total * step_ms) for e in top]


def kernel_row(one: torch.Tensor, w1: torch.Tensor, many: torch.Tensor, weight: torch.Tensor,
               pad: int, c: int, mask: list[bool], fwd_flops: int,
               reps: int) -> dict[str, float]:
    """One convolution's forward and backward (``mask``: input, weight, bias gradients) as
    the plain loop calls it (``one`` [b, C, H, W], weights ``w1``) and grouped over c
    clients (``many`` [b, c*C, H, W] channels-last, ``weight`` [c*out, C, kh, kw]): CPU ms
    per client step and GFLOP/s."""
    g_one = torch.randn_like(F.conv2d(one, w1, padding=pad))
    g_many = torch.randn_like(F.conv2d(many, weight, padding=pad, groups=c))
    bwd_flops = fwd_flops * (2 if mask[0] else 1)
    row: dict[str, float] = {}
    for label, fn, flops, per in (
            ("plain forward", lambda: F.conv2d(one, w1, padding=pad), fwd_flops, 1),
            ("plain backward", lambda: aten.convolution_backward(
                g_one, one, w1, [w1.shape[0]], [1, 1], [pad, pad], [1, 1], False, [0, 0], 1,
                mask), bwd_flops, 1),
            ("grouped forward", lambda: F.conv2d(many, weight, padding=pad, groups=c),
             fwd_flops, c),
            ("grouped backward", lambda: aten.convolution_backward(
                g_many, many, weight, [weight.shape[0]], [1, 1], [pad, pad], [1, 1], False,
                [0, 0], c, mask), bwd_flops, c)):
        ms = cpu_ms(fn, reps) / per
        row[f"{label} ms"] = ms
        row[f"{label} GFLOP/s"] = flops / ms / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="clients per chunk (W2': 8)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does (the plain loop is timed in the same process)
    torch.manual_seed(0)
    c, reps = args.clients, args.repeats
    model = build_model("lenet5", SHAPE, 10, seed=0)
    chain = conv_chain(model)
    assert chain is not None
    macs = model_macs(model, SHAPE)
    step_flops = 3 * 2 * sum(macs.values()) * BATCH  # useful FLOPs of one client step
    x1, y1 = torch.rand(BATCH, *SHAPE), torch.randint(0, 10, (BATCH,))
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def plain_step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x1), y1).backward()
        opt.step()

    params = {k: v.detach().unsqueeze(0).repeat(c, *[1] * v.dim()).contiguous()
              for k, v in model.named_parameters()}
    xs, ys = torch.rand(c, BATCH, *SHAPE), torch.randint(0, 10, (c, BATCH))
    targets = weighted_targets(ys, torch.full((c, BATCH), 1.0 / BATCH), 10)
    rule = LocalOptimizer()

    def engine_step() -> None:
        with torch.no_grad():
            grads, _ = conv_chain_grads(chain, params, xs, targets)
            new, _ = rule.step(params, grads, LR, None, client_axis=True)
            for key, value in new.items():
                params[key].copy_(value)

    report: dict[str, Any] = {"command": "python benchmarks/profile_lenet5.py " +
                              " ".join(sys.argv[1:]), "clients_per_chunk": c, "batch": BATCH,
                              "load_average_before": os.getloadavg()[0],
                              "useful_mflop_per_client_step": step_flops / 1e6}
    plain = cpu_ms(plain_step, 5 * reps)
    engine = cpu_ms(engine_step, reps) / c
    report["plain_ms_per_client_step"], report["engine_ms_per_client_step"] = plain, engine
    report["plain_top_ops"] = top_ops(plain_step, 5 * reps, plain)
    report["engine_top_ops"] = top_ops(engine_step, reps, engine)

    # (c) the convolutions alone: inputs of the shapes each call sees in a step
    cl = torch.channels_last
    kernels: dict[str, dict[str, float]] = {}
    grouped_in = grouped(xs).contiguous(memory_format=cl)
    for name, stage, shape_in in (("conv1", chain.stages[0], (1, 28, 28)),
                                  ("conv2", chain.stages[1], (6, 14, 14))):
        w1 = params[stage.weight][0]
        weight = params[stage.weight].reshape(-1, *w1.shape[1:])
        pad = stage.padding
        one = torch.rand(BATCH, *shape_in)
        many = (grouped_in if name == "conv1" else
                torch.rand(BATCH, c * shape_in[0], *shape_in[1:]).contiguous(memory_format=cl))
        mask = [name != "conv1", True, True]  # the input of conv1 needs no gradient
        kernels[name] = kernel_row(one, w1, many, weight, pad, c, mask,
                                   2 * macs[name] * BATCH, reps)
    report["conv_kernels"] = kernels
    conv_engine = sum(r["grouped forward ms"] + r["grouped backward ms"] for r in kernels.values())
    conv_plain = sum(r["plain forward ms"] + r["plain backward ms"] for r in kernels.values())
    report["engine_conv_kernels_ms_per_client_step"] = conv_engine
    report["plain_conv_kernels_ms_per_client_step"] = conv_plain
    report["load_average_after"] = os.getloadavg()[0]

    print(f"LeNet-5, 28x28, batch {BATCH}, one thread, CPU time; chunk of {c} clients; "
          f"{step_flops / 1e6:.1f} useful MFLOP per client step; load average "
          f"{report['load_average_before']:.2f} -> {report['load_average_after']:.2f}")
    for label, ms, ops in (("plain loop", plain, report["plain_top_ops"]),
                           (f"engine, {c} clients", engine, report["engine_top_ops"])):
        print(f"\n== {label}: {ms:.3f} ms per client step ({1e3 / ms:,.0f} client steps/s, "
              f"{step_flops / ms / 1e6:.1f} GFLOP/s)")
        for op, op_ms in ops:
            print(f"   {op[:44]:<44} {op_ms:7.3f} ms  {op_ms / ms:6.1%}")
    print("\nconvolution kernels alone, ms per client step (GFLOP/s):")
    for name, row in kernels.items():
        print("   " + name + ": " + ", ".join(
            f"{k} {row[k + ' ms']:.3f} ({row[k + ' GFLOP/s']:.1f})"
            for k in ("plain forward", "plain backward", "grouped forward", "grouped backward")))
    print(f"\nconvolutions alone: {conv_plain:.3f} ms per client step as the plain loop calls "
          f"them, {conv_engine:.3f} ms grouped; the engine's whole step {engine:.3f} ms is "
          f"{engine / conv_engine:.2f}x its convolutions alone; the plain step {plain:.3f} ms "
          f"is {plain / conv_plain:.2f}x its own. Ceiling of the step against the plain loop "
          f"if all but the grouped convolutions vanished: {plain / conv_engine:.2f}x (now "
          f"{plain / engine:.2f}x).")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Where a W2 local step goes: torch.profiler of one SGD step of the ``cnn`` on
Fashion-MNIST shapes (batch 16), (a) as the plain loop runs it (one client, ``nn.Module`` +
autograd) and (b) as the vectorized engine runs it (``vmap(grad(loss_fn))`` over c clients),
one torch thread. Prints the top operators by self CPU time and the step's GFLOP/s.

    python benchmarks/profile_cnn.py [--clients 100] [--steps 3]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from engines import model_macs
from torch.func import grad_and_value, vmap
from torch.profiler import ProfilerActivity, profile

from fedhier.local.models import build_model
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import loss_fn

SHAPE = (1, 28, 28)
BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn", SHAPE, 10, seed=0)
    macs = sum(model_macs(model, SHAPE).values())
    flops_per_step = 3 * 2 * macs * BATCH

    x = torch.randn(BATCH, *SHAPE)
    y = torch.randint(0, 10, (BATCH,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def plain_step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    c = args.clients
    params = {k: v.detach().unsqueeze(0).repeat(c, *[1] * v.dim()).contiguous()
              for k, v in model.named_parameters()}
    xs = torch.randn(c, BATCH, *SHAPE)
    ys = torch.randint(0, 10, (c, BATCH))
    grad_loss = vmap(grad_and_value(partial(loss_fn, model)))
    optimizer = LocalOptimizer()

    def vmap_step() -> None:
        nonlocal params
        grads, _ = grad_loss(params, xs, ys)
        params, _ = optimizer.step(params, grads, 0.05, None, client_axis=True)

    for name, step, clients, repeats in (("plain loop, one client", plain_step, 1, 20 * args.steps),
                                         (f"vmap over {c} clients", vmap_step, c, args.steps)):
        step()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        seconds = (time.perf_counter() - start) / repeats
        print(f"\n== {name}: {seconds * 1e3:.1f} ms per step, {clients / seconds:,.1f} client "
              f"steps/s, {clients * flops_per_step / seconds / 1e9:.1f} GFLOP/s useful")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=45))


if __name__ == "__main__":
    main()

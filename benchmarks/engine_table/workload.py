"""The benchmark's workloads (W1, W2), their run configurations and useful FLOPs per example."""

from __future__ import annotations

from typing import Any

from fedhier.engines.registry import engine_names

ENGINES = ("plain", *engine_names())  # plain: the baseline loop (runs.py), not a fedhier engine
PROFILED = ("inprocess", "vectorized")
SEED_MODES = ("seeds-batched", "seeds-separate")  # workers of --batched-seeds
SHARDED = "vectorized-ray"  # measured at each of --ray-workers (worker.sharded_runs)
W1: dict[str, Any] = dict(
    dataset="digits", clients=100, groups=(10,), partition="dirichlet", alpha=0.5,
    min_partition_size=3, model="mlp", local_period=5, global_period=20, batch_size=16, lr=0.1,
    rounds=10, seed=0)
#: MACs per example of mlp 64-128-10 (weights; biases and ReLU not counted); equal to
#: ``model_macs`` of W1's model (tests/test_benchmarks_flops.py).
MLP_MACS = 64 * 128 + 128 * 10
FLOPS_PER_EXAMPLE = 3 * 2 * MLP_MACS  # forward 2*MACs + backward 4*MACs
FLOPS_FORMULA = ("3 x 2 x MACs per example per step, MACs = 64*128 + 128*10 = 9,472 "
                 "(forward 2*MACs, backward 4*MACs), summed over each client's real rows b_j")
#: Workload W2 (``--workload w2``), where the model dominates: Fashion-MNIST (the Debian
#: package's 60,000 real 28x28 training images), 1,000 clients, Dirichlet(0.5), 100 edges,
#: ``cnn`` (conv 16, pool, conv 32, pool, linear: 1.03 M MACs per example), I=5, G=10,
#: batch 16, one cloud round = 10,000 client SGD steps.
W2: dict[str, Any] = dict(
    dataset="fashion-mnist", clients=1000, groups=(100,), partition="dirichlet", alpha=0.5,
    model="cnn", local_period=5, global_period=10, batch_size=16, lr=0.05, rounds=1, seed=0)
#: W2's untimed warm-up run (the same model and data at 20 clients: a full-size warm-up
#: would double every engine's time).
W2_WARMUP: dict[str, Any] = dict(clients=20, groups=(2,), rounds=1)
#: W2's vectorized engine is measured whole and with this ``--client-chunk`` too.
W2_CHUNK = 100
#: Workload W2' (``--workload w2p``): HierFAVG's setting with LeNet-5, the ``hierfavg``
#: suite's full base (fedhier/studies/experiments/cli.py): Fashion-MNIST (60,000 training images),
#: 50 clients of one class each (shards), 5 edges, ``lenet5``, batch 20, I=6, G=60, lr 0.05;
#: one cloud round = 50 x 60 = 3,000 client SGD steps (one epoch of the training set).
W2P: dict[str, Any] = dict(
    dataset="fashion-mnist", clients=50, groups=(5,), partition="shards", classes_per_client=1,
    model="lenet5", local_period=6, global_period=60, batch_size=20, lr=0.05, rounds=2, seed=0)
#: Untimed warm-up runs (W2: the same model and data at 20 clients, a full-size warm-up would
#: double every engine's time; W2': 10 clients, one edge round).
WARMUPS: dict[str, dict[str, Any]] = {"w2": W2_WARMUP,
                                      "w2p": dict(clients=10, groups=(2,), rounds=1,
                                                  global_period=6)}
WORKLOADS = {"w1": W1, "w2": W2, "w2p": W2P}


def model_macs(model: Any, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Multiply-accumulates per example of every Conv2d and Linear layer of ``model``
    (layer name -> MACs), counted from the layers' shapes in one forward pass of one example:
    a convolution costs (output elements) x (in_channels / groups) x kernel area, a linear
    layer in x out. Biases, activations and pooling are not counted."""
    import torch
    from torch import nn

    macs: dict[str, int] = {}
    hooks = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Conv2d):
            def conv_hook(mod: Any, _inp: Any, out: Any, name: str = name) -> None:
                kh, kw = mod.kernel_size
                macs[name] = int(out[0].numel()) * mod.in_channels // mod.groups * kh * kw
            hooks.append(layer.register_forward_hook(conv_hook))
        elif isinstance(layer, nn.Linear):
            def linear_hook(mod: Any, _inp: Any, out: Any, name: str = name) -> None:
                macs[name] = mod.in_features * mod.out_features
            hooks.append(layer.register_forward_hook(linear_hook))
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    return macs


def workload_flops(cfg: Any) -> tuple[int, str]:
    """(useful FLOPs per example and step, the formula) of ``cfg``'s model: 3 x 2 x MACs
    (forward 2 x MACs, backward 4 x MACs: input and weight gradients), MACs from
    :func:`model_macs`."""
    from fedhier.data import load_data
    from fedhier.local.models import build_model

    bundle = load_data(cfg.dataset, seed=cfg.seed)
    shape = tuple(bundle.input_shape)
    macs = model_macs(build_model(cfg.model, shape, bundle.num_classes), shape)
    total = sum(macs.values())
    terms = " + ".join(f"{name} {m:,}" for name, m in macs.items())
    return 3 * 2 * total, (f"3 x 2 x MACs per example per step, MACs of {cfg.model} on "
                           f"{list(shape)} = {terms} = {total:,} (counted from the layers; "
                           f"forward 2*MACs, backward 4*MACs), summed over each client's "
                           f"real rows b_j")


def w1_config(rounds: int, workload: str = "w1", **changes: Any) -> Any:
    from fedhier.settings.run_config import RunConfig

    return RunConfig(**{**WORKLOADS[workload], "rounds": rounds, **changes})

def replicated_federation(cfg: Any, clients: int) -> Any:
    """W1's 100-client partition tiled to ``clients`` clients: client j holds the rows of W1
    client j mod 100 (with its own batch order, drawn from its own id)."""
    from fedhier.data.federation import Federation
    from fedhier.runs.prepare import prepare

    base = prepare(w1_config(1))
    parts = [base.partitions[j % len(base.partitions)] for j in range(clients)]
    return Federation(bundle=base.bundle, partitions=parts)


def w1_stats(workload: str = "w1") -> dict[str, Any]:
    """Rows per client, and the rows of one step of every client (summed b_j)."""
    import numpy as np

    from fedhier.local.train import effective_batch_size
    from fedhier.runs.prepare import prepare

    cfg = w1_config(WORKLOADS[workload]["rounds"], workload)
    sizes = prepare(cfg).client_sizes()
    batch = np.array([effective_batch_size(cfg.batch_size, int(m)) for m in sizes])
    return {"client_rows_min_median_max": [int(sizes.min()), int(np.median(sizes)),
                                           int(sizes.max())],
            "clients_with_fewer_rows_than_batch": int((sizes < cfg.batch_size).sum()),
            "mean_rows_per_step": float(batch.mean()), "rows_per_step_total": int(batch.sum())}


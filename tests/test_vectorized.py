"""The vectorized engine computes what the in-process (Flower strategy) engine computes.

Same config and seed => the same metrics.jsonl values (every key but wall_seconds, 1e-4
relative) and the same final parameters (1e-4), across hierarchy depths, unequal client sizes,
weightings, batch sizes and models; chunking clients changes nothing at all.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.func import grad, vmap

from fedhier.cli.commands import main
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.engines.vectorized.kernels import linear_chain_pass, weighted_targets
from fedhier.local.models import build_model, linear_chain
from fedhier.local.train import loss_fn
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics

TOL = 1e-4
IGNORED = {"wall_seconds"}
BASE = RunConfig(dataset="digits", clients=8, groups=(2,), local_period=2, global_period=4,
                 rounds=2, batch_size=8, seed=11)
# client sizes 48 .. 221 rows: with batch_size 100 the two smallest clients use all their
# rows (b = 48, 79) while the others use 100, so three batch sizes run side by side.
UNEQUAL = BASE.replace(clients=10, alpha=0.3, seed=3, batch_size=100)

CASES = {
    "two-level": BASE,
    "three-level": BASE.replace(groups=(4, 2), periods=(2, 4, 8), rounds=2),
    "unequal-sizes": UNEQUAL,
    "uniform-weighting": UNEQUAL.replace(weighting="uniform"),
    "full-batch": BASE.replace(batch_size=0, lr=0.5, weighting="uniform"),
    "logreg": UNEQUAL.replace(model="logreg"),
    "cnn": UNEQUAL.replace(model="cnn", rounds=1),
    "lr-schedule": BASE.replace(lr_schedule="step", lr_step_every=3, lr_decay=0.5),
    "momentum-weight-decay": BASE.replace(momentum=0.9, weight_decay=1e-3),
    "momentum-kept-clipped": UNEQUAL.replace(momentum=0.5, optimizer_state="keep",
                                             clip_norm=0.5),
    "cnn-momentum-kept": BASE.replace(model="cnn", momentum=0.5, optimizer_state="keep",
                                      batch_size=16, rounds=1),
    "lenet5": UNEQUAL.replace(model="lenet5", rounds=1),
    "lenet5-momentum-kept-clipped-participation": BASE.replace(
        model="lenet5", momentum=0.5, optimizer_state="keep", clip_norm=0.5,
        participation=0.5, batch_size=16, rounds=2),
    "diagnostics": UNEQUAL.replace(diagnostics_every=1),
    "regroup": BASE.replace(regroup_every=1, rounds=3),
    "gradient-grouping": BASE.replace(groups=(4, 2), periods=(2, 4, 8), grouping="gradient",
                                      regroup_every=2, diagnostics_every=2,
                                      diagnostics_max_samples=20, rounds=3),
    "participation": BASE.replace(participation=0.5, rounds=3),
    "participation-momentum-kept": UNEQUAL.replace(participation=0.5, momentum=0.5,
                                                   optimizer_state="keep", rounds=3),
    "fail-rate": UNEQUAL.replace(fail_rate=0.3, rounds=3),
    # edges and regions left without survivors; with seed 32 the cloud step of cloud round 3
    # has none (the global model is kept)
    "failed-edges-three-level": BASE.replace(groups=(4, 2), periods=(2, 4, 8), fail_rate=0.7,
                                             rounds=4, seed=32),
    "dropout-span": BASE.replace(dropout_fraction=0.5, dropout_rounds="2-2", rounds=3),
    "client-holdout": UNEQUAL.replace(client_holdout=0.2),
    "stragglers": BASE.replace(local_period=4, global_period=8, straggler_fraction=0.5,
                               rounds=2),
    "stragglers-fednova-momentum-kept": UNEQUAL.replace(
        local_period=4, global_period=8, straggler_fraction=0.6, normalize_updates=True,
        momentum=0.5, optimizer_state="keep", participation=0.7, rounds=2),
    "cloud-fedavgm": BASE.replace(cloud_strategy="fedavgm", server_lr=1.0, server_momentum=0.9,
                                  rounds=3),
    "cloud-fedadam-three-level-faults": BASE.replace(
        groups=(4, 2), periods=(2, 4, 8), cloud_strategy="fedadam", server_lr=0.01,
        fail_rate=0.3, rounds=3),
    "median": BASE.replace(aggregators="median", rounds=3),
    "median-mean-median-three-level-faults": BASE.replace(
        groups=(4, 2), periods=(2, 4, 8), aggregators="median,mean,median", fail_rate=0.3,
        rounds=3),
    "trimmed-krum": BASE.replace(aggregators="trimmed-mean,krum", rounds=2),
    "clip-clip-multikrum-three-level-faults": BASE.replace(
        groups=(4, 2), periods=(2, 4, 8), aggregators="clip:1.5x,clip,multi-krum",
        fail_rate=0.3, rounds=2),
    "median-clip-cloud": BASE.replace(aggregators="median,clip:0.5", rounds=2),
    "stragglers-cnn": BASE.replace(model="cnn", local_period=3, global_period=6,
                                   straggler_fraction=0.5, normalize_updates=True, rounds=1),
}


# Tiny models: one intra-op thread is fastest, and robust on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model_final.safetensors"))


def assert_same_runs(a: Path, b: Path, tol: float) -> None:
    """Every metrics key but wall_seconds within ``tol`` (relative), final params within tol."""
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra.keys() - IGNORED:
            va, vb = ra[key], rb[key]
            if isinstance(va, list) and va and isinstance(va[0], float):  # e.g. one per edge
                assert len(va) == len(vb), key
                assert all(math.isclose(u, v, rel_tol=tol, abs_tol=tol * 1e-3)
                           for u, v in zip(va, vb, strict=True)), (key, ra["round"], va, vb)
            elif isinstance(va, float):
                assert math.isclose(va, vb, rel_tol=tol, abs_tol=tol * 1e-3), (
                    key, ra["round"], va, vb)
            else:
                assert va == vb, (key, ra["round"], va, vb)
    fa, fb = final_state(a), final_state(b)
    assert fa.keys() == fb.keys()
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= tol


@pytest.mark.parametrize("case", list(CASES))
def test_vectorized_equals_inprocess(case, tmp_path):
    cfg = CASES[case]
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    summary = run_vectorized(cfg.replace(engine="vectorized"),
                             RunFolder.create(tmp_path / "vectorized"), progress=False)
    assert summary["engine"] == "vectorized"
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", TOL)
    for name in ("groups.json", "partition.json"):
        assert (json.loads((tmp_path / "inprocess" / name).read_text())
                == json.loads((tmp_path / "vectorized" / name).read_text()))
    initial = load_file(str(tmp_path / "vectorized" / "model_initial.safetensors"))
    final = final_state(tmp_path / "vectorized")
    assert max(float((initial[k] - final[k]).abs().max()) for k in final) > 1e-3  # it trained


@pytest.mark.parametrize("model", ["mlp", "cnn", "lenet5"])
def test_client_chunks_change_nothing(model, tmp_path, monkeypatch):
    """All clients at once, chunks of 3, and the automatic size (made 2 clients here): the
    same bits."""
    import fedhier.engines.vectorized.engine as vectorized

    cfg = UNEQUAL.replace(model=model, rounds=1)
    monkeypatch.setattr(vectorized, "CHUNK_BYTES", 1)  # auto: the minimum, 2 clients
    runs = {"all": cfg.clients, "chunks": 3, "auto": 0}
    for name, chunk in runs.items():
        run_vectorized(cfg.replace(client_chunk=chunk), RunFolder.create(tmp_path / name),
                       progress=False)
    for name in ("chunks", "auto"):
        assert_same_runs(tmp_path / "all", tmp_path / name, tol=0.0)
        fa, fb = final_state(tmp_path / "all"), final_state(tmp_path / name)
        assert all(torch.equal(fa[k], fb[k]) for k in fa)


def test_automatic_chunk_holds_about_two_mib_of_models():
    from types import SimpleNamespace

    from fedhier.engines.vectorized.engine import CHUNK_BYTES, BatchedExecutor

    net = build_model("mlp", (1, 8, 8), 10, seed=1)  # 64-128-10: 9,610 float32 = 38,440 B
    assert CHUNK_BYTES // 38_440 == 54

    def size(clients, chunk=0, device="cpu", model=net):
        executor = SimpleNamespace(cfg=SimpleNamespace(client_chunk=chunk), model=model,
                                   data=SimpleNamespace(num_clients=clients),
                                   device=torch.device(device))
        return BatchedExecutor.chunk_size(executor)  # type: ignore[arg-type]

    assert size(1000) == 54 and size(30) == 30 and size(1000, chunk=7) == 7
    assert size(1000, device="meta") == 1000  # an accelerator takes every client at once
    big = torch.nn.Linear(1024, 1024)  # 4 MiB: never fewer than 2 clients per chunk
    assert size(1000, model=big) == 2


@pytest.mark.parametrize("model", ["mlp", "logreg"])
def test_hand_batched_gradient_is_autograd_of_loss_fn(model):
    """linear_chain_pass == vmap(grad(loss_fn)) per client, padded batches included."""
    torch.manual_seed(0)
    net = build_model(model, (1, 8, 8), 10, seed=1)
    layers = linear_chain(net)
    assert layers is not None
    sizes = [5, 3, 5, 1]  # b_j per client; width 5, padding rows hold garbage
    c, width = len(sizes), max(sizes)
    params = {k: v.detach() + 0.1 * torch.randn(c, *v.shape)  # c different clients
              for k, v in net.state_dict().items()}
    x = torch.randn(c, width, 1, 8, 8)
    y = torch.randint(0, 10, (c, width))
    weight = torch.zeros(c, width)
    for j, b in enumerate(sizes):
        weight[j, :b] = 1.0 / b
    target = weighted_targets(y, weight, 10)
    grads, loss = linear_chain_pass(params, layers, x, target, weight.unsqueeze(1))
    for j, b in enumerate(sizes):
        one = {k: v[j] for k, v in params.items()}
        expected = grad(lambda p, j=j, b=b: loss_fn(net, p, x[j, :b], y[j, :b]))(one)
        for k in params:
            torch.testing.assert_close(grads[k][j], expected[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss[j], loss_fn(net, one, x[j, :b], y[j, :b]),
                                   rtol=1e-5, atol=1e-6)
    # The fused in-place step is the plain SGD rule, params - lr * grads, on those gradients.
    stepped = {k: v.clone() for k, v in params.items()}
    linear_chain_pass(stepped, layers, x, target, weight.unsqueeze(1), lr=0.3)
    expected_step = {k: params[k] - 0.3 * grads[k] for k in params}
    for k in params:
        torch.testing.assert_close(stepped[k], expected_step[k], rtol=1e-5, atol=1e-6)


def test_vmap_gradient_on_equal_batches_matches_per_client_loop():
    net = build_model("cnn", (1, 8, 8), 10, seed=2)
    params = {k: v.detach().unsqueeze(0).repeat(3, *([1] * v.dim()))
              for k, v in net.state_dict().items()}
    x, y = torch.randn(3, 4, 1, 8, 8), torch.randint(0, 10, (3, 4))
    batched = vmap(grad(lambda p, a, b: loss_fn(net, p, a, b)))(params, x, y)
    for j in range(3):
        single = grad(lambda p, j=j: loss_fn(net, p, x[j], y[j]))({k: v[j] for k, v in
                                                                   params.items()})
        for k in params:
            torch.testing.assert_close(batched[k][j], single[k], rtol=1e-5, atol=1e-6)


def test_cli_runs_the_vectorized_engine(tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--engine", "vectorized", "--clients", "6", "--groups", "2",
                 "--local-period", "2", "--global-period", "4", "--rounds", "1",
                 "--client-chunk", "4", "--no-progress", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "vectorized"
    assert json.loads((out / "config.json").read_text())["engine"] == "vectorized"
    assert len(metrics(out)) == 2


def test_minibatch_rows_come_from_batch_indices():
    from fedhier.engines.vectorized.kernels import ClientRows
    from fedhier.local.train import batch_indices
    from fedhier.runs.prepare import prepare

    fed = prepare(UNEQUAL)
    rows = ClientRows.build(fed, UNEQUAL.batch_size, torch.device("cpu"))
    block = rows.minibatch_rows(UNEQUAL.seed, UNEQUAL.batch_size, start=6, steps=4)
    for j, part in enumerate(fed.partitions):
        local = batch_indices(UNEQUAL.seed, j, len(part), UNEQUAL.batch_size, 6, 4)
        b = local.shape[1]
        np.testing.assert_array_equal(block[:, j, :b], np.asarray(part)[local])
        assert float(rows.weight[j, :b].sum()) == pytest.approx(1.0)
        assert float(rows.weight[j, b:].sum()) == 0.0


@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_conv_models_on_cpu_grouped_loop_and_vmap_agree(name):
    """Conv chains (cnn, lenet5) train batched as grouped convolutions on the CPU; the client
    loop (local_sgd, for other conv models on the CPU) and the vmap path (other devices) give
    the same models, losses and momentum."""
    from fedhier.engines.vectorized.engine import client_loop_training, training_for
    from fedhier.engines.vectorized.kernels import EdgeRoundBatches, local_training_for
    from fedhier.local.models import CNN
    from fedhier.local.optimizer import LocalOptimizer

    net = build_model(name, (1, 8, 8), 10, seed=2)
    assert training_for(net, torch.device("cpu")).__qualname__.startswith("conv_chain")
    assert training_for(build_model("mlp", (1, 8, 8), 10), torch.device("cpu")).__qualname__ \
        .startswith("linear_chain")

    class OwnCNN(CNN):  # a subclass may compute something else: not a known conv chain
        pass

    assert training_for(OwnCNN((1, 8, 8), 10), torch.device("cpu")).__qualname__.startswith(
        "client_loop")
    torch.manual_seed(0)
    sizes = np.array([4, 2, 4])  # b_j; width 4, padding rows hold garbage
    c, steps = len(sizes), 3
    params = {k: v.detach() + 0.1 * torch.randn(c, *v.shape) for k, v in net.state_dict().items()}
    weight = torch.zeros(c, 4)
    for j, b in enumerate(sizes):
        weight[j, :b] = 1.0 / b
    batches = EdgeRoundBatches(x=torch.randn(steps, c, 4, 1, 8, 8),
                               y=torch.randint(0, 10, (steps, c, 4)), weight=weight, batch=sizes)
    optimizer = LocalOptimizer(momentum=0.5, clip_norm=1.0)
    lrs = [0.1, 0.05, 0.1]
    start = {k: 0.01 * torch.randn_like(v) for k, v in params.items()}  # kept momentum
    results = {}
    for path, train in (("loop", client_loop_training(net)), ("vmap", local_training_for(net)),
                        ("grouped", training_for(net, torch.device("cpu")))):
        trained = {k: v.clone() for k, v in params.items()}
        loss, buffers = train(trained, batches, lrs, optimizer,
                              {k: v.clone() for k, v in start.items()})
        assert buffers is not None
        results[path] = (trained, loss, buffers)
    loop_params, loop_loss, loop_buf = results["loop"]
    for path in ("vmap", "grouped"):
        other_params, other_loss, other_buf = results[path]
        torch.testing.assert_close(loop_loss, other_loss, rtol=1e-5, atol=1e-6)
        for k in params:
            torch.testing.assert_close(loop_params[k], other_params[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loop_buf[k], other_buf[k], rtol=1e-5, atol=1e-6)
    assert max(float((loop_params[k] - params[k]).abs().max()) for k in params) > 1e-3

"""The grouped-convolution kernels of the vectorized engine
(fedhier/engines/vectorized/conv_kernels.py) and the ``lenet5`` model: gradients equal autograd of
``loss_fn`` client by client, the evaluation forward equals the model's, results do not depend on
how clients are chunked or on the thread count, and a whole run equals ``inprocess`` within 1e-5 and
repeats bit for bit."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.conv_kernels import (
    conv_chain_grads,
    conv_chain_logits,
    conv_chain_training,
    keep_freed_memory,
)
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.engines.vectorized.kernels import EdgeRoundBatches, weighted_targets
from fedhier.local.models import build_model, conv_chain
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import loss_fn
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_vectorized import assert_same_runs, final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SHAPES = [(1, 28, 28), (1, 8, 8)]


def test_lenet5_has_lecuns_layer_sizes():
    net = build_model("lenet5", (1, 28, 28), 10)
    maps = []
    hooks = [getattr(net, name).register_forward_hook(lambda m, i, o: maps.append(o.shape[1:]))
             for name in ("conv1", "conv2", "fc1", "fc2", "out")]
    net(torch.zeros(1, 1, 28, 28))
    for hook in hooks:
        hook.remove()
    assert maps == [(6, 28, 28), (16, 10, 10), (120,), (84,), (10,)]
    assert net.fc1.in_features == 16 * 5 * 5
    assert sum(p.numel() for p in net.parameters()) == 61_706  # LeNet-5's count
    small = build_model("lenet5", (1, 8, 8), 10)  # digits: conv2 pads, 16 x 2 x 2 features
    assert small.conv2.padding == (2, 2) and small.fc1.in_features == 64
    assert conv_chain(net) is not None and conv_chain(build_model("mlp", (64,), 10)) is None


def _clients(name, shape, sizes, seed=0):
    net = build_model(name, shape, 10, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    c, width = len(sizes), int(max(sizes))
    params = {k: (v.detach() + 0.05 * torch.randn(c, *v.shape, generator=gen)).contiguous()
              for k, v in net.named_parameters()}
    weight = torch.zeros(c, width)
    for j, b in enumerate(sizes):
        weight[j, :b] = 1.0 / b
    return net, params, weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_grads_are_autograd_of_loss_fn_per_client(name, shape):
    sizes = [5, 3, 5, 1]  # padded to 5: padding rows hold garbage and must not count
    net, params, weight = _clients(name, shape, sizes)
    x = torch.randn(len(sizes), 5, *shape)
    y = torch.randint(0, 10, (len(sizes), 5))
    grads, losses = conv_chain_grads(conv_chain(net), params, x, weighted_targets(y, weight, 10))
    for j, b in enumerate(sizes):
        own = {k: v[j].detach().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(net, own, x[j, :b], y[j, :b])
        expected = torch.autograd.grad(loss, list(own.values()))
        for key, value in zip(own, expected, strict=True):
            torch.testing.assert_close(grads[key][j], value, rtol=1e-5, atol=1e-6)
        assert float(losses[j]) == pytest.approx(float(loss.detach()), rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_evaluation_forward_is_the_models(name, shape):
    net = build_model(name, shape, 10, seed=1)
    params = {k: v.detach() for k, v in net.state_dict().items()}
    for rows in (1, 19, 20, 657):  # partial groups and several forward batches
        x = torch.randn(rows, *shape)
        torch.testing.assert_close(conv_chain_logits(conv_chain(net), params, x), net(x),
                                   rtol=1e-5, atol=1e-6)


def _train(name, sizes, lo, hi, threads=1):
    net, params, weight = _clients(name, (1, 28, 28), sizes, seed=3)
    gen = torch.Generator().manual_seed(4)
    steps, width = 3, int(max(sizes))
    x = torch.randn(steps, len(sizes), width, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (steps, len(sizes), width), generator=gen)
    chunk = {k: v[lo:hi].clone() for k, v in params.items()}
    batches = EdgeRoundBatches(x=x[:, lo:hi], y=y[:, lo:hi], weight=weight[lo:hi],
                               batch=np.asarray(sizes[lo:hi]))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loss, _ = conv_chain_training(conv_chain(net))(chunk, batches, [0.1, 0.05, 0.1],
                                                        LocalOptimizer(), None)
    finally:
        torch.set_num_threads(before)
    return chunk, loss


@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_chunks_and_threads_change_no_bit(name):
    """A client's result does not depend on which clients share its chunk (chunks of >= 2,
    as the engine makes them), on the thread count, or on the call: bit for bit."""
    sizes = [6, 4, 6, 6, 2]
    whole, whole_loss = _train(name, sizes, 0, 5)
    again, again_loss = _train(name, sizes, 0, 5)
    two_threads, two_loss = _train(name, sizes, 0, 5, threads=2)
    for other, other_loss in ((again, again_loss), (two_threads, two_loss)):
        assert torch.equal(whole_loss, other_loss)
        assert all(torch.equal(whole[k], other[k]) for k in whole)
    for lo, hi in ((0, 2), (2, 5)):
        part, part_loss = _train(name, sizes, lo, hi)
        assert torch.equal(part_loss, whole_loss[lo:hi])
        assert all(torch.equal(part[k], whole[k][lo:hi]) for k in whole)


W2_TINY = RunConfig(dataset="digits", model="lenet5", clients=6, groups=(2,), partition="shards",
                    classes_per_client=2, local_period=3, global_period=6, batch_size=20,
                    lr=0.05, rounds=2, seed=5)


def test_lenet5_run_equals_inprocess_and_repeats(tmp_path):
    """W2' in miniature (lenet5, shards, batch 20): vectorized = inprocess within 1e-5 on
    every metric and the final model, and a second vectorized run repeats it bit for bit."""
    run_inprocess(W2_TINY, RunFolder.create(tmp_path / "inprocess"), progress=False)
    for name in ("vectorized", "again"):
        run_vectorized(W2_TINY.replace(engine="vectorized"), RunFolder.create(tmp_path / name),
                       progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", 1e-5)
    first, second = metrics(tmp_path / "vectorized"), metrics(tmp_path / "again")
    for a, b in zip(first, second, strict=True):
        assert {k: v for k, v in a.items() if k != "wall_seconds"} == \
            {k: v for k, v in b.items() if k != "wall_seconds"}
    fa, fb = final_state(tmp_path / "vectorized"), final_state(tmp_path / "again")
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    initial = load_file(str(tmp_path / "vectorized" / "model_initial.safetensors"))
    assert max(float((initial[k] - fa[k]).abs().max()) for k in fa) > 1e-3  # it trained


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
def test_freed_memory_is_kept():
    assert keep_freed_memory()


def test_lenet5_seeds_batched_equal_one_seed_runs(tmp_path):
    """Two seeds of lenet5 batched (one grouped computation per edge round, evaluation with
    the grouped forward too) = each seed's own run, bit for bit."""
    from fedhier.engines.vectorized.seed_batch import SeedLockstep, run_seeds
    from tests.test_batched_seeds import same_run

    cfgs = [W2_TINY.replace(engine="vectorized", rounds=1, seed=s) for s in (1, 2)]
    lockstep = SeedLockstep()
    results = run_seeds(cfgs, [RunFolder.create(tmp_path / f"b{c.seed}") for c in cfgs],
                        progress=False, lockstep=lockstep)
    assert [e for _, e in results] == [None, None] and max(lockstep.batch_sizes) == 2
    for cfg in cfgs:
        run_vectorized(cfg, RunFolder.create(tmp_path / f"s{cfg.seed}"), progress=False)
        same_run(tmp_path / f"b{cfg.seed}", tmp_path / f"s{cfg.seed}")

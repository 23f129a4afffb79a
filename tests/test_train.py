import numpy as np
import pytest
import torch

from fedhier.local.models import build_model
from fedhier.local.train import batch_indices, evaluate, local_sgd, params_of


def test_batch_indices_are_epochs_of_permutations():
    idx = batch_indices(seed=3, client=5, num_rows=10, batch_size=4, start_step=0, num_steps=5)
    stream = idx.reshape(-1)
    assert idx.shape == (5, 4)
    assert sorted(stream[:10].tolist()) == list(range(10))  # epoch 0: every row once
    assert sorted(stream[10:20].tolist()) == list(range(10))  # epoch 1 too


def test_batch_indices_are_a_function_of_seed_client_step_only():
    whole = batch_indices(1, 2, 37, 8, start_step=0, num_steps=12)
    pieces = np.concatenate([batch_indices(1, 2, 37, 8, start_step=s, num_steps=3)
                             for s in range(0, 12, 3)])
    np.testing.assert_array_equal(whole, pieces)
    assert not np.array_equal(whole, batch_indices(1, 3, 37, 8, 0, 12))
    assert not np.array_equal(whole, batch_indices(2, 2, 37, 8, 0, 12))


def test_full_batch_when_zero_or_too_large():
    for b in (0, 50):
        idx = batch_indices(0, 0, 7, b, start_step=4, num_steps=2)
        np.testing.assert_array_equal(idx, np.tile(np.arange(7), (2, 1)))


def test_local_sgd_equals_torch_optim_sgd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (30,), generator=gen)
    model = build_model("cnn", (1, 8, 8), 10, seed=1)
    indices = batch_indices(0, 0, 30, 7, 0, 9)
    params, mean_loss, _ = local_sgd(model, params_of(model), x, y, lr=0.1, indices=indices)

    reference = build_model("cnn", (1, 8, 8), 10, seed=1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for rows in indices:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(x[rows]), y[rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
    assert abs(mean_loss - float(np.mean(losses))) < 1e-5


def test_evaluate_counts_correct_predictions():
    model = build_model("logreg", (2,), 2, seed=0)
    params = {"linear.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
              "linear.bias": torch.zeros(2)}
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])
    loss, acc = evaluate(model, params, x, y)
    assert acc == 0.75
    expected = torch.nn.functional.cross_entropy(x, y).item()
    assert abs(loss - expected) < 1e-6


def test_model_init_is_seeded_and_side_effect_free():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("mlp", (64,), 10, seed=7)
    after = torch.rand(1)
    b = build_model("mlp", (64,), 10, seed=7)
    assert torch.equal(before, after)  # global RNG untouched
    for k in a.state_dict():
        assert torch.equal(a.state_dict()[k], b.state_dict()[k])


@pytest.mark.parametrize("num_rows,batch_size,start,steps", [
    (10, 4, 0, 5), (18, 16, 100, 5), (37, 8, 3, 12), (5, 3, 7, 1), (200, 33, 11, 9)])
def test_batch_indices_read_the_stream_of_seeded_epoch_permutations(num_rows, batch_size,
                                                                    start, steps):
    """Step t takes stream positions t*b .. t*b+b-1 of the concatenated permutations drawn
    from generator(seed, "batches", client, epoch)."""
    from fedhier.common.rng import generator

    epochs = (start + steps) * batch_size // num_rows + 1
    stream = np.concatenate([generator(4, "batches", 9, e).permutation(num_rows)
                             for e in range(epochs)])
    expected = stream[start * batch_size:(start + steps) * batch_size].reshape(steps, -1)
    np.testing.assert_array_equal(
        batch_indices(4, 9, num_rows, batch_size, start, steps), expected)

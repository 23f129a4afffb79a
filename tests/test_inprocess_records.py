"""The in-process shortcuts change no number: the decoded-record cache
(fedhier.clients.wire.array_records) and local_sgd's resident model copy (fedhier.local.train)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedhier.clients.wire import array_records as records
from fedhier.clients.wire.array_records import to_record, to_tensors
from fedhier.local.models import build_model
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import local_sgd, loss_fn, params_of

TENSORS = {
    "w": torch.randn(4, 3), "b": torch.randn(4), "scalar": torch.tensor(2.5),
    "d": torch.randn(2, 2, dtype=torch.float64), "h": torch.randn(3).half(),
    "i": torch.arange(6).reshape(2, 3), "flag": torch.tensor([True, False]),
    "u8": torch.arange(5, dtype=torch.uint8), "empty": torch.zeros(0, 3),
}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].stride() == b[key].stride(), key
        assert torch.equal(a[key], b[key]), key


def test_to_record_is_byte_identical_to_flower() -> None:
    for _ in range(2):  # the second pass uses the cached .npy headers
        ours, flowers = to_record(TENSORS), ArrayRecord(TENSORS)
        assert list(ours) == list(flowers)
        for key in TENSORS:
            a, b = ours[key], flowers[key]
            assert (a.data, a.dtype, a.shape, a.stype) == (b.data, b.dtype, b.shape, b.stype)


def test_to_tensors_equals_flower_decoding_hit_or_miss() -> None:
    built = to_record(TENSORS)  # remembered when built
    assert_same_tensors(to_tensors(built), dict(built.to_torch_state_dict()))
    foreign = ArrayRecord(TENSORS)  # decoded on the first call, remembered after
    assert_same_tensors(to_tensors(foreign), dict(foreign.to_torch_state_dict()))
    assert_same_tensors(to_tensors(foreign), dict(foreign.to_torch_state_dict()))


def test_cached_tensors_are_never_shared() -> None:
    source = {"w": torch.ones(3)}
    record = to_record(source)
    source["w"].add_(5)  # the caller changes its tensor after building the record
    first = to_tensors(record)
    assert torch.equal(first["w"], torch.ones(3))
    first["w"].mul_(0)  # a consumer changes what it got
    assert torch.equal(to_tensors(record)["w"], torch.ones(3))
    foreign = ArrayRecord({"w": torch.ones(3)})
    to_tensors(foreign)["w"].mul_(0)
    assert torch.equal(to_tensors(foreign)["w"], torch.ones(3))


@pytest.mark.parametrize("change", ["replace", "data", "add", "delete"])
def test_a_changed_record_is_decoded_again(change: str) -> None:
    record = to_record({"w": torch.ones(2, 2), "b": torch.zeros(2)})
    to_tensors(record)
    if change == "replace":
        record["w"] = Array(torch.full((2, 2), 7.0))
    elif change == "data":
        record["w"].data = Array(torch.full((2, 2), 7.0)).data
    elif change == "add":
        record["extra"] = Array(torch.arange(3.0))
    else:
        del record["b"]
    assert_same_tensors(to_tensors(record), dict(record.to_torch_state_dict()))


def test_a_new_record_at_a_dead_records_address_is_not_confused() -> None:
    for value in range(20):  # ids of freed records are reused
        record = to_record({"w": torch.full((3,), float(value))})
        assert torch.equal(to_tensors(record)["w"], torch.full((3,), float(value)))
        foreign = ArrayRecord({"w": torch.full((3,), -float(value))})
        assert torch.equal(to_tensors(foreign)["w"], torch.full((3,), -float(value)))
        del record, foreign


def test_entries_go_with_their_records() -> None:
    gc.collect()
    before = records.cache_size()
    kept = [to_record({"w": torch.randn(3)}) for _ in range(5)]
    assert records.cache_size() == before + 5
    del kept
    gc.collect()
    assert records.cache_size() == before
    to_tensors(ArrayRecord({"w": torch.randn(3)}), remember=False)
    assert records.cache_size() == before


def test_non_contiguous_tensors_are_encoded_by_flower() -> None:
    t = torch.randn(3, 4).t()  # Fortran-ordered: .npy keeps that layout
    record = to_record({"t": t})
    flowers = ArrayRecord({"t": t})
    assert record["t"].data == flowers["t"].data
    assert_same_tensors(to_tensors(record), dict(flowers.to_torch_state_dict()))


# ------------------------------------------------------------------ local_sgd's resident copy
def reference_local_sgd(model, params, x, y, lr, indices, optimizer):
    """local_sgd as written with ``loss_fn`` (functional_call) at every step."""
    rates = np.broadcast_to(np.asarray(lr, dtype=np.float64), (len(indices),))
    buffers = None
    total = torch.zeros((), dtype=torch.float64)
    for step_rows, rate in zip(torch.as_tensor(indices), rates, strict=True):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(model, leaves, x[step_rows], y[step_rows])
        grads = torch.autograd.grad(loss, tuple(leaves.values()))
        with torch.no_grad():
            params, buffers = optimizer.step({k: v.detach() for k, v in leaves.items()},
                                             dict(zip(leaves, grads, strict=True)),
                                             float(rate), buffers)
        total += loss.detach().to(torch.float64)
    return params, float(total) / max(len(indices), 1), buffers


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn", "lenet5", "lstm"])
@pytest.mark.parametrize("optimizer", [LocalOptimizer(),
                                       LocalOptimizer(momentum=0.9, weight_decay=1e-2,
                                                      clip_norm=0.5)])
def test_local_sgd_is_bit_identical_to_the_functional_loop(name, optimizer) -> None:
    torch.manual_seed(0)
    if name == "lstm":
        model = build_model(name, (6,), 11, seed=1)
        x, y = torch.randint(0, 11, (20, 6)), torch.randint(0, 11, (20,))
    else:
        shape = (1, 8, 8) if name in ("cnn", "lenet5") else (64,)
        model = build_model(name, shape, 10, seed=1)
        x, y = torch.randn(20, *shape), torch.randint(0, 10, (20,))
    rng = np.random.default_rng(0)
    indices = np.stack([rng.permutation(20)[:8] for _ in range(4)])
    lr = np.array([0.3, 0.2, 0.1, 0.05])
    start = params_of(model)
    for _ in range(2):  # the second call reuses the resident copy
        got = local_sgd(model, start, x, y, lr=lr, indices=indices, optimizer=optimizer)
        want = reference_local_sgd(model, start, x, y, lr, indices, optimizer)
        assert_same_tensors(got[0], want[0])
        assert got[1] == want[1]
        if want[2] is not None:
            assert_same_tensors(got[2], want[2])
    # The caller's model and start parameters are untouched.
    assert_same_tensors(params_of(model), start)


def test_local_sgd_with_other_layouts_takes_the_functional_path() -> None:
    model = build_model("mlp", (5,), 3, seed=0)
    params = params_of(model)
    params["hidden.weight"] = params["hidden.weight"].t().contiguous().t()  # other strides
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    indices = np.tile(np.arange(6), (3, 1))
    got = local_sgd(model, params, x, y, lr=0.1, indices=indices)
    want = reference_local_sgd(model, params, x, y, 0.1, indices, LocalOptimizer())
    assert_same_tensors(got[0], want[0])
    assert got[1] == want[1]

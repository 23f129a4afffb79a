"""fedhier.common.permutations reproduces NumPy's seeded permutations exactly, and
clients_batch_indices reproduces batch_indices client by client."""

import numpy as np
import pytest
import torch

from fedhier.common.permutations import MIN_BATCH, permutations
from fedhier.common.rng import generator
from fedhier.local.train import batch_indices, clients_batch_indices


def _numpy(seed, purpose, ids, lengths):
    return [generator(seed, purpose, *row.tolist()).permutation(int(n))
            for row, n in zip(ids, lengths, strict=True)]


def _assert_rows_equal(got, expected, lengths):
    assert got.dtype == np.int64 and got.shape == (len(lengths), max(lengths, default=0))
    for row, want, n in zip(got, expected, lengths, strict=True):
        assert np.array_equal(row[:n], want)
        assert (row[n:] == -1).all()


@pytest.mark.parametrize(("seed", "purpose", "id_high", "width", "max_length"), [
    (0, "batches", 1000, 2, 40),          # the mini-batch case
    (2**32 - 1, "x", 2**32, 2, 513),      # largest one-word ids; lengths past the fast limit
    (12345, "batches", 2**32, 3, 300),    # more ids: SeedSequence's extra-entropy loop
    (7, "faults", 10, 1, 3),              # permutations of 0, 1 and 2 elements
])
def test_equal_to_numpy(seed, purpose, id_high, width, max_length):
    rng = np.random.default_rng(seed % 1000)
    ids = rng.integers(0, id_high, size=(400, width))
    lengths = rng.integers(0, max_length, size=400)
    _assert_rows_equal(permutations(seed, purpose, ids, lengths),
                       _numpy(seed, purpose, ids, lengths), lengths)


def test_fallbacks_equal_numpy_too():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 100, size=(MIN_BATCH - 1, 2))  # too few for the array path
    lengths = rng.integers(0, 30, size=len(ids))
    _assert_rows_equal(permutations(3, "batches", ids, lengths),
                       _numpy(3, "batches", ids, lengths), lengths)
    ids = rng.integers(0, 100, size=(200, 2))  # a seed of two uint32 words
    lengths = rng.integers(0, 30, size=len(ids))
    _assert_rows_equal(permutations(2**40 + 9, "batches", ids, lengths),
                       _numpy(2**40 + 9, "batches", ids, lengths), lengths)


@pytest.mark.parametrize("first_client", [0, 1000])
def test_clients_batch_indices_equal_batch_indices(first_client):
    rng = np.random.default_rng(11)
    for _ in range(25):
        rows = rng.integers(1, 60, size=int(rng.integers(1, 150))).tolist()
        batch_size = int(rng.choice([0, 1, 5, 16, 100]))
        start, steps = int(rng.integers(0, 300)), int(rng.integers(0, 25))
        seed = int(rng.integers(0, 2**32))
        got = clients_batch_indices(seed, rows, batch_size, start, steps, first_client)
        for k, n in enumerate(rows):
            want = batch_indices(seed, first_client + k, n, batch_size, start, steps)
            assert got[k].dtype == want.dtype and np.array_equal(got[k], want)
            assert got[k].shape == want.shape


def test_minibatch_rows_in_blocks_equal_one_block(monkeypatch):
    """The vectorized engine draws the indices of blocks of clients: the same rows whatever
    the block."""
    import fedhier.engines.vectorized.kernels as batched
    from fedhier.runs.prepare import prepare
    from fedhier.settings.run_config import RunConfig

    fed = prepare(RunConfig(clients=30, groups=(3,), alpha=0.5, batch_size=4))
    data = batched.ClientRows.build(fed, 4, torch.device("cpu"))
    whole = data.minibatch_rows(3, 4, 7, 10)
    monkeypatch.setattr(batched, "INDEX_CLIENT_BLOCK", 4)
    assert np.array_equal(data.minibatch_rows(3, 4, 7, 10), whole)
    for j, rows in enumerate(data.rows):  # and they are batch_indices'
        local = batch_indices(3, j, len(rows), 4, 7, 10)
        assert np.array_equal(whole[:, j, :local.shape[1]], rows[local])

"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules running many tiny torch ops: on a busy 2-core machine torch's thread pool
    makes each one wait for a second core (index_add_ took 4 ms instead of 20 us). Restored
    after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

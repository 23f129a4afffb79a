"""Shared pytest fixtures, and hypothesis profiles.

Hypothesis runs the ``ci`` profile unless ``HYPOTHESIS_PROFILE`` names another: derandomized
(the same cases on every run of the same code, so CI never fails at random) and without an
example database. ``explore`` (``make fuzz-long``) draws fresh cases, 20 times as many; a
failure it finds becomes an explicit ``@example`` in the test.
"""

import os

import pytest
import torch
from hypothesis import settings

from tests.ray_cluster import (  # noqa: F401  (one Ray cluster per session)
    ray_cluster,
    ray_cluster_nodes,
)

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True,
                          max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(count: int) -> int:
    """A test's example count: ``count`` in CI, 20x while exploring."""
    return count * 20 if settings.default.derandomize is False else count


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules running many tiny torch ops: on a busy 2-core machine torch's thread pool
    makes each one wait for a second core (index_add_ took 4 ms instead of 20 us). Restored
    after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Test files whose tests start real SuperLinks and SuperNodes (``fedhier deploy``): they
#: mostly wait on Flower's polling, so ``make test`` runs them beside the rest (marker
#: ``deployment``). They start no Ray; the one test that starts a Ray cluster (``ray start``)
#: stays with the rest, since ``ray.init()`` joins a local cluster that ``ray start`` made.
DEPLOYMENT_FILES = ("test_deploy.py", "test_deploy_edges.py", "test_deploy_faults.py")
STARTS_RAY = ("test_simulation_engine_joins_an_existing_ray_cluster",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in DEPLOYMENT_FILES and item.originalname not in STARTS_RAY:
            item.add_marker(pytest.mark.deployment)
    # Files that use the session's shared Ray cluster run last, whole: each connects to it for
    # its own tests only (tests/ray_cluster.py), so that Flower's Simulation Engine (ray.init)
    # never runs its actors there, where they would wait for ever for the CPUs the cluster's
    # shard workers hold; sorted last, the cluster starts once the other files are done.
    on_cluster = {item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in on_cluster)

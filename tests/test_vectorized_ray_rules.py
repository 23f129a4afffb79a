"""The asynchronous rules (tests/test_async_rules.py) on engine vectorized-ray.

Apart from test_async_rules.py because it uses the session's shared Ray cluster
(tests/ray_cluster.py): test files that use it sort after every file that starts Flower's
Simulation Engine, whose actors would otherwise wait for the CPUs the cluster's shard workers
hold (a test of test_bound_replies.py waited there for good)."""

from __future__ import annotations

import pytest

from tests import oracle_hsgd as oracle
from tests.test_async_rules import CASE, RULES
from tests.test_oracle import (  # noqa: F401 - `data`: a fixture
    data,
    gap,
    initial,
    problem,
    run,
)


@pytest.mark.slow
def test_the_sharded_engine_runs_every_rule_as_the_oracle(data, ray_cluster):  # noqa: F811
    """Engine vectorized-ray (asynchronous edge servers over two shard actors): each rule
    equals the oracle's equation to 1e-5 (averaging the edges' averages: float rounding)."""
    for name, (flags, rule) in RULES.items():
        r = run(data, "vectorized-ray", *CASE, "--ray-address", ray_cluster, "--ray-workers",
                "2", *flags, rounds=6)
        reports = [[edge for edge, _ in rec["async_reports"]] for rec in r["records"][1:]]
        want, _ = oracle.async_hsgd(problem(data, r, (2, 4)), initial(r), reports, rule=rule)
        assert gap(r, want) <= 1e-5, name

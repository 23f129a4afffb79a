"""H-SGD's special cases (algorithms.md §1) as exact equalities with other algorithms."""

import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from fedhier.data.federation import federation_for
from fedhier.local.models import build_model
from fedhier.settings.run_config import RunConfig
from tests.helpers import initial_state, max_abs_diff, run_flower_strategy, run_hier

BASE = RunConfig(dataset="digits", clients=8, groups=2, batch_size=8, lr=0.1, seed=4,
                 local_period=2, global_period=6, rounds=2)


def fedavg(cfg: RunConfig) -> FedAvg:
    return FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=cfg.clients,
                  min_available_nodes=cfg.clients)


def test_i_equals_g_is_flower_fedavg():
    cfg = BASE.replace(local_period=6, global_period=6)
    hier = run_hier(cfg)
    flat = run_flower_strategy(cfg, fedavg(cfg), local_steps=6, rounds=cfg.rounds)
    assert max_abs_diff(hier, flat) <= 1e-5
    assert max_abs_diff(hier, initial_state(cfg)) > 1e-2  # it trained


def test_one_group_is_local_sgd_with_period_i():
    cfg = BASE.replace(groups=(1,))
    hier = run_hier(cfg)
    edge_rounds = cfg.rounds * cfg.global_period // cfg.local_period
    flat = run_flower_strategy(cfg, fedavg(cfg), local_steps=cfg.local_period, rounds=edge_rounds)
    assert max_abs_diff(hier, flat) <= 1e-5


def test_one_client_per_edge_is_local_sgd_with_period_g():
    cfg = BASE.replace(groups=(BASE.clients,))
    hier = run_hier(cfg)
    flat = run_flower_strategy(cfg, fedavg(cfg), local_steps=cfg.global_period,
                               rounds=cfg.rounds)
    assert max_abs_diff(hier, flat) <= 1e-5


def test_edges_matter_otherwise():
    # Not a special case: H-SGD(2, 6) with 2 groups differs from both local SGD periods.
    hier = run_hier(BASE)
    period_g = run_flower_strategy(BASE, fedavg(BASE), local_steps=6, rounds=BASE.rounds)
    assert max_abs_diff(hier, period_g) > 1e-4


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_i_g_1_full_batch_is_centralised_gradient_descent(weighting):
    cfg = BASE.replace(local_period=1, global_period=1, batch_size=0, rounds=12,
                       weighting=weighting, lr=0.5)
    hier = run_hier(cfg)

    fed = federation_for(cfg)
    x, y = fed.bundle.train_arrays()
    model = build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes)
    model.load_state_dict(initial_state(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    parts = [(torch.as_tensor(x[p]), torch.as_tensor(y[p])) for p in fed.partitions]
    for _ in range(cfg.iterations):
        opt.zero_grad()
        if weighting == "samples":  # pooled mean loss over all rows
            xs = torch.cat([p[0] for p in parts])
            ys = torch.cat([p[1] for p in parts])
            loss = torch.nn.functional.cross_entropy(model(xs), ys)
        else:  # f = (1/n) sum_j F_j
            loss = sum(torch.nn.functional.cross_entropy(model(a), b) for a, b in parts)
            loss = loss / len(parts)
        loss.backward()
        opt.step()
    assert max_abs_diff(hier, model.state_dict()) <= 1e-5
    assert max_abs_diff(hier, initial_state(cfg)) > 1e-2


def test_same_seed_same_numbers_different_seed_different():
    records_a: list = []
    records_b: list = []
    a = run_hier(BASE, records_a)
    b = run_hier(BASE, records_b)
    assert max_abs_diff(a, b) == 0.0
    assert [r["train_loss"] for r in records_a] == [r["train_loss"] for r in records_b]
    c = run_hier(BASE.replace(seed=5))
    assert max_abs_diff(a, c) > 1e-3


def test_communication_counters():
    records: list = []
    run_hier(BASE, records)
    last = records[-1]
    n, edges, rounds = BASE.clients, BASE.num_edges, BASE.rounds
    edge_rounds = rounds * BASE.global_period // BASE.local_period
    assert last["client_edge_messages"] == 2 * n * edge_rounds  # one model down, one up
    assert last["edge_cloud_messages"] == 2 * edges * rounds
    assert last["client_edge_bytes"] > 0 and last["edge_cloud_bytes"] > 0
    assert [r["iteration"] for r in records] == [0, 6, 12]


def test_three_levels_with_equal_top_periods_reduce_to_two_levels():
    two = BASE.replace(groups=(4,), periods=(2, 6))
    three = BASE.replace(groups=(4, 2), periods=(2, 6, 6))
    assert max_abs_diff(run_hier(two), run_hier(three)) == 0.0


def test_three_levels_differ_from_two_when_regions_aggregate():
    two = BASE.replace(groups=(4,), periods=(2, 12), rounds=1)
    three = BASE.replace(groups=(4, 2), periods=(2, 6, 12), rounds=1)
    records: list = []
    diff = max_abs_diff(run_hier(two), run_hier(three, records))
    assert diff > 1e-4
    # per cloud round: 6 edge rounds; regions aggregate at step 6 (edges 4 -> 2 messages up/down)
    assert records[-1]["edge_cloud_messages"] == 2 * 4 + (2 * 4 + 2 * 2)

"""Participation, local optimiser, schedules, stragglers and per-client evaluation."""

import numpy as np
import pytest
import torch

from fedhier.data.federation import federation_for
from fedhier.local.models import build_model
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import batch_indices, evaluate, local_sgd, params_of
from fedhier.round.aggregators.averaging import presence_weights
from fedhier.round.participants import Workload, plan_edge_round, sample_clients
from fedhier.runs.prepare import initial_model
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import initial_state, max_abs_diff, run_hier

BASE = RunConfig(dataset="digits", clients=8, groups=2, batch_size=8, lr=0.1, seed=3,
                 local_period=2, global_period=4, rounds=2)


# --- participation -----------------------------------------------------------------------
def test_sample_clients_fraction_count_and_determinism():
    members = np.arange(10, 20)
    a = sample_clients(members, 0.2, seed=1, edge_round=3, edge=0)
    assert len(a) == 2 and set(a) <= set(members)
    np.testing.assert_array_equal(a, sample_clients(members, 0.2, 1, 3, 0))
    assert len(sample_clients(members, 0.01, 1, 3, 0)) == 1  # at least one client
    assert len(sample_clients(members, 4, 1, 3, 0)) == 4  # a count
    assert len(sample_clients(members, 1.0, 1, 3, 0)) == 10
    draws = {tuple(sample_clients(members, 0.3, 1, r, 0)) for r in range(20)}
    assert len(draws) > 5  # changes with the round


def test_presence_weights_renormalise_within_edge_and_keep_edge_weight():
    w = np.array([1.0, 3.0, 2.0, 2.0])
    edge = np.array([0, 0, 1, 1])
    full = presence_weights(w, np.ones(4, dtype=bool), edge)
    assert np.array_equal(full, w)
    part = presence_weights(w, np.array([True, False, True, True]), edge)
    np.testing.assert_allclose(part, [4.0, 0.0, 2.0, 2.0])  # edge 0 keeps its weight 4


def test_partial_participation_is_reproducible_and_counted():
    cfg = BASE.replace(participation=0.5)
    records_a: list = []
    records_b: list = []
    a = run_hier(cfg, records_a)
    b = run_hier(cfg, records_b)
    assert max_abs_diff(a, b) == 0.0
    assert max_abs_diff(a, run_hier(BASE)) > 1e-4
    edge_rounds = cfg.rounds * cfg.global_period // cfg.local_period
    # 2 of 4 clients per edge, 2 edges: 4 clients per edge round, one model down and one up
    assert records_a[-1]["client_edge_messages"] == 2 * 4 * edge_rounds


# --- local optimiser ---------------------------------------------------------------------
def _one_client_reference(cfg: RunConfig, clip: float = 0.0) -> dict:
    fed = federation_for(cfg)
    x, y = fed.client_tensors(0, torch.device("cpu"))
    model = build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes)
    model.load_state_dict(initial_model(cfg, fed).state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    for rows in batch_indices(cfg.seed, 0, len(y), cfg.batch_size, 0, cfg.iterations):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def test_momentum_kept_across_rounds_equals_torch_sgd_on_one_client():
    cfg = RunConfig(dataset="digits", clients=1, groups=1, local_period=3, global_period=3,
                    rounds=4, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3,
                    optimizer_state="keep", seed=5)
    assert max_abs_diff(run_hier(cfg), _one_client_reference(cfg)) <= 1e-5
    reset = run_hier(cfg.replace(optimizer_state="reset"))
    assert max_abs_diff(reset, _one_client_reference(cfg)) > 1e-4  # reset is different


def test_clipping_equals_torch_clip_grad_norm():
    cfg = RunConfig(dataset="digits", clients=1, groups=1, local_period=4, global_period=4,
                    rounds=2, batch_size=8, lr=0.2, clip_norm=0.05, seed=6)
    assert max_abs_diff(run_hier(cfg), _one_client_reference(cfg, clip=0.05)) <= 1e-5


def test_optimizer_batched_update_equals_per_client_update():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, 2, generator=gen), "b": torch.randn(3, 2, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    opt = LocalOptimizer(momentum=0.5, weight_decay=0.1, clip_norm=0.7)
    lrs = torch.tensor([0.1, 0.2, 0.3])
    batched, buf = opt.step(params, grads, lrs, None, client_axis=True)
    batched, _ = opt.step(batched, grads, lrs, buf, client_axis=True)
    for c in range(3):
        one = {k: v[c] for k, v in params.items()}
        g = {k: v[c] for k, v in grads.items()}
        one, b1 = opt.step(one, g, float(lrs[c]), None)
        one, _ = opt.step(one, g, float(lrs[c]), b1)
        for k in one:
            torch.testing.assert_close(batched[k][c], one[k], rtol=1e-6, atol=1e-6)


# --- schedules ---------------------------------------------------------------------------
def test_step_schedule_changes_at_exactly_the_configured_iteration():
    cfg = BASE.replace(lr=0.4, lr_schedule="step", lr_step_every=6, lr_decay=0.5)
    rates = cfg.learning_rates(0, 14)
    assert rates.tolist() == [0.4] * 6 + [0.2] * 6 + [0.1] * 2
    np.testing.assert_allclose(cfg.learning_rates(5, 3), [0.4, 0.2, 0.2])


def test_cosine_and_exponential_schedules():
    cos = BASE.replace(lr=1.0, lr_schedule="cosine")  # T = 8
    np.testing.assert_allclose(cos.learning_rates(0, 9)[[0, 4, 8]], [1.0, 0.5, 0.0], atol=1e-12)
    exp = BASE.replace(lr=1.0, lr_schedule="exponential", lr_decay=0.9)  # per cloud round (G=4)
    np.testing.assert_allclose(exp.learning_rates(0, 9), [1] * 4 + [0.9] * 4 + [0.81])


def test_schedule_reaches_the_clients():
    # A step decay to ~0 after the first cloud round freezes the model: round 2 changes nothing.
    frozen = BASE.replace(lr_schedule="step", lr_step_every=4, lr_decay=1e-12)
    one_round = run_hier(BASE.replace(rounds=1))
    assert max_abs_diff(run_hier(frozen), one_round) <= 1e-6


# --- heterogeneous local work ------------------------------------------------------------
def test_straggler_plan_and_fednova_scale():
    hierarchy = Hierarchy((5, 10), (np.array([0, 0, 0, 1, 1, 1]),))
    weights = np.array([1.0, 2.0, 3.0, 1.0, 1.0, 2.0])
    workload = Workload(straggler_fraction=0.5, straggler_min_steps=2, normalize_updates=True)
    plan = plan_edge_round(hierarchy, workload, weights, seed=0, edge_round=1)
    assert ((plan.steps >= 2) & (plan.steps <= 5)).all() and (plan.steps < 5).any()
    for edge in (0, 1):
        members = np.arange(3) + 3 * edge
        p = weights[members] / weights[members].sum()
        tau_eff = (p * plan.steps[members]).sum()
        np.testing.assert_allclose(plan.scale[members], tau_eff / plan.steps[members])
    same = plan_edge_round(hierarchy, workload, weights, seed=0, edge_round=1)
    assert np.array_equal(plan.steps, same.steps)


def test_stragglers_run_and_differ():
    slow = run_hier(BASE.replace(straggler_fraction=0.5))
    assert max_abs_diff(slow, run_hier(BASE)) > 1e-5
    nova = run_hier(BASE.replace(straggler_fraction=0.5, normalize_updates=True))
    assert max_abs_diff(nova, slow) > 1e-6


# --- per-client evaluation ----------------------------------------------------------------
def test_per_client_holdout_metrics_equal_direct_computation():
    cfg = BASE.replace(client_holdout=0.25, rounds=1)
    records: list = []
    final = run_hier(cfg, records)
    fed = federation_for(cfg)
    for train_rows, held in zip(fed.partitions, fed.holdouts, strict=True):
        assert len(held) >= 1 and not set(train_rows) & set(held)
    model = initial_model(cfg, fed)
    direct = []
    for j in range(cfg.clients):
        x, y = fed.holdout_tensors(j, torch.device("cpu"))
        direct.append(evaluate(model, final, x, y)[1])
    last = records[-1]
    np.testing.assert_allclose(last["client_accuracies"], direct, rtol=1e-12)
    assert last["client_accuracy_mean"] == pytest.approx(np.mean(direct))
    assert last["client_accuracy_worst"] == pytest.approx(min(direct))
    assert last["client_accuracy_p10"] == pytest.approx(np.percentile(direct, 10))


def test_local_sgd_plain_path_unchanged_by_default_optimizer():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 64, generator=gen)
    y = torch.randint(0, 10, (20,), generator=gen)
    model = build_model("mlp", (64,), 10, seed=0)
    idx = batch_indices(0, 0, 20, 5, 0, 4)
    a, _, _ = local_sgd(model, params_of(model), x, y, lr=0.1, indices=idx)
    b, _, _ = local_sgd(model, params_of(model), x, y, lr=np.full(4, 0.1), indices=idx,
                        optimizer=LocalOptimizer())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert initial_state  # helpers import used

"""Yin et al.'s diversity mechanisms as local-step options: QSGD quantisation of the
uploaded update (``quantize_bits``) and Langevin noise (``langevin_temperature``).

Closed forms: the quantiser is unbiased (a Hoeffding bound at failure probability 1e-12, that
deterministic rounding breaks), its variance is (||v||/s)^2 sum p_i (1 - p_i) <= min(n/s^2,
sqrt(n)/s) ||v||^2, its values lie on the grid ||v|| k / s; the noise a local step adds has
mean 0 and variance 2 eta T (a chi-square bound at 1e-12, that sqrt(eta T) breaks). Runs: the
in-process (Flower ClientApp) engine and the vectorized engine give the same numbers with
either mechanism, on the fused, optimiser, vmap and client-loop kernels; the uploads are
counted at b bits per value.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.local.langevin import Langevin
from fedhier.local.models import build_model
from fedhier.local.quantization import levels, quantize, quantize_update, upload_bytes
from fedhier.local.train import local_sgd
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_vectorized import BASE, TOL, UNEQUAL, assert_same_runs, final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Failure probability of every statistical bound below (union-bounded over coordinates).
DELTA = 1e-12


def test_levels_of_b_bits():
    assert [levels(b) for b in (2, 3, 4, 8, 16)] == [1, 3, 7, 127, 32767]
    for bad in (1, 17, -1):
        with pytest.raises(ConfigError, match="quantize_bits must be 0 .off. or 2..16"):
            levels(bad)


def _vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.rand(
        n, generator=g, dtype=torch.float64)


def _draws(v: torch.Tensor, s: int, k: int, seed: int) -> torch.Tensor:
    u = torch.rand(k, len(v), generator=torch.Generator().manual_seed(seed),
                   dtype=torch.float64)
    return quantize(v.expand(k, -1).contiguous(), s, u)


def _hoeffding(width: float, k: int, n: int) -> float:
    """t with P(|mean of k draws in an interval of ``width`` - its mean| >= t) <= DELTA / n."""
    return width * math.sqrt(math.log(2 * n / DELTA) / (2 * k))


@pytest.mark.parametrize("s", [1, 3, 127])
def test_quantiser_is_unbiased(s):
    """Each coordinate's mean over K draws is within Hoeffding's bound of v_i (each draw lies
    in an interval of width ||v|| / s); nearest and floor rounding are biased past it."""
    n, k = 64, 20_000
    v = _vector(n, 1)
    q = _draws(v, s, k, 2)
    t = _hoeffding(float(v.norm()) / s, k, n)
    assert float((q.mean(0) - v).abs().max()) <= t
    ratio = v.abs() / v.norm() * s
    for rounded in (ratio.round(), ratio.floor()):  # the deterministic mutants
        biased = v.sign() * rounded * v.norm() / s
        assert float((biased - v).abs().max()) > 3 * t


@pytest.mark.parametrize("s", [1, 3, 127])
def test_quantiser_variance_closed_form_and_bound(s):
    """E||Q(v) - v||^2 = (||v||/s)^2 sum_i p_i (1 - p_i) <= min(n/s^2, sqrt(n)/s) ||v||^2,
    and the draws' mean squared error matches it coordinate by coordinate (Hoeffding, each
    squared error in [0, (||v||/s)^2])."""
    n, k = 64, 20_000
    cases = ((1, _vector(n, 1)), (3, torch.full((n,), 0.5, dtype=torch.float64)),
             (5, torch.ones(n, dtype=torch.float64)))
    for seed, v in cases:
        norm = float(v.norm())
        ratio = v.abs() / norm * s
        p = ratio - ratio.floor()
        exact = (norm / s) ** 2 * p * (1 - p)  # per coordinate
        bound = min(n / s**2, math.sqrt(n) / s) * norm**2
        assert float(exact.sum()) <= bound
        q = _draws(v, s, k, seed + 10)
        measured = ((q - v) ** 2).mean(0)
        assert float((measured - exact).abs().max()) <= _hoeffding((norm / s) ** 2, k, n)
    # equal coordinates with s = 1 (p = 1/sqrt(n) = 1/8): the bound is nearly attained
    if s == 1:
        assert float(measured.sum()) >= 0.8 * bound


def test_quantised_update_lies_on_the_grid_and_keeps_its_start():
    """What goes up is start + Q(end - start), per tensor: (sent - start) s / ||update||
    is an integer in -s..s for every coordinate; a zero update stays exactly zero; the draws
    are a function of (seed, client, start step)."""
    g = torch.Generator().manual_seed(0)
    start = {"a.weight": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g)}
    end = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    end["b"] = start["b"].clone()
    sent = quantize_update(start, end, bits=3, seed=4, client=2, start_step=10)
    s = levels(3)
    for name in start:
        update = (end[name] - start[name]).double()
        steps = (sent[name] - start[name]).double()
        if float(update.norm()) == 0:
            assert torch.equal(sent[name], start[name])
            continue
        grid = steps * s / update.norm()
        assert float((grid - grid.round()).abs().max()) < 1e-4
        assert float(grid.abs().max()) <= s + 1e-4
    again = quantize_update(start, end, bits=3, seed=4, client=2, start_step=10)
    other = quantize_update(start, end, bits=3, seed=4, client=3, start_step=10)
    assert all(torch.equal(again[k], sent[k]) for k in sent)
    assert not torch.equal(other["a.weight"], sent["a.weight"])


def test_langevin_noise_has_variance_two_eta_t():
    """The step's noise over P parameters and 40 steps: mean 0 (Gaussian tail) and variance
    2 eta T (chi-square, Laurent-Massart) at failure probability 1e-12; sqrt(eta T), the
    factor 2 dropped, is outside the bound."""
    eta, temperature = 0.05, 0.3
    noise = Langevin(temperature, seed=5)
    like = {"w": torch.zeros(1, 64, 40), "b": torch.zeros(1, 10)}
    values = torch.cat([torch.cat([v.reshape(-1) for v in noise.noise(like, [3], t, eta)
                                   .values()]) for t in range(40)]).double()
    n, x = len(values), math.log(2 / DELTA)
    sigma2 = 2 * eta * temperature
    assert abs(float(values.mean())) <= math.sqrt(sigma2 * 2 * x / n)
    chi = float((values ** 2).sum()) / sigma2  # chi-square with n degrees of freedom
    assert abs(chi - n) <= 2 * math.sqrt(n * x) + 2 * x
    wrong = float((values ** 2).sum()) / (eta * temperature)
    assert abs(wrong - n) > 2 * math.sqrt(n * x) + 2 * x


def test_local_step_adds_exactly_the_keyed_noise():
    """local_sgd with Langevin minus local_sgd without, after one step from the same start,
    is the noise of (seed, client, step) to float32 rounding; two steps differ from it."""
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g)
    noise = Langevin(0.01, seed=7)
    rows = np.arange(8)[None]
    plain, _, _ = local_sgd(model, params, x, y, lr=0.1, indices=rows)
    noisy, _, _ = local_sgd(model, params, x, y, lr=0.1, indices=rows,
                            noise=lambda p, k, rate: noise.perturb_one_(p, 4, 12 + k, rate))
    expected = noise.noise({k: v[None] for k, v in params.items()}, [4], 12, 0.1)
    for key in params:
        assert torch.allclose(noisy[key] - plain[key], expected[key][0], atol=1e-6)
    assert float(expected["hidden.weight"].abs().max()) > 1e-2  # not a zero noise


#: Small runs, each mechanism on each batched kernel: the fused Linear/ReLU chain (plain
#: SGD), the optimiser path (momentum, clipping), the client loop (cnn), stragglers, mobility
#: with a carried model, partial participation, a three-level tree.
CASES = {
    "quantize": BASE.replace(quantize_bits=4),
    "langevin": BASE.replace(langevin_temperature=1e-4),
    "both-momentum-clip-kept": UNEQUAL.replace(quantize_bits=2, langevin_temperature=1e-5,
                                               momentum=0.5, clip_norm=1.0,
                                               optimizer_state="keep"),
    "both-cnn": BASE.replace(model="cnn", quantize_bits=8, langevin_temperature=1e-5,
                             rounds=1),
    "langevin-stragglers-schedule": BASE.replace(local_period=4, global_period=8,
                                                 straggler_fraction=0.5,
                                                 langevin_temperature=1e-4,
                                                 lr_schedule="cosine", rounds=2),
    "quantize-carry-participation-three-level": BASE.replace(
        groups=(4, 2), periods=(2, 4, 8), quantize_bits=3, mobility_rate=0.5,
        handoff="carry", participation=0.5, rounds=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engines_agree_with_each_mechanism(case, tmp_path):
    cfg = CASES[case]
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", TOL)


@pytest.fixture(scope="module")
def plain_and_quantised(tmp_path_factory):
    out = tmp_path_factory.mktemp("bits")
    for name, cfg in (("plain", BASE), ("q4", BASE.replace(quantize_bits=4)),
                      ("t", BASE.replace(langevin_temperature=1e-3))):
        run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(out / name),
                       progress=False)
    return out


def test_mechanisms_change_the_run(plain_and_quantised):
    """Off is not the same as on (the options reach the local step)."""
    plain = final_state(plain_and_quantised / "plain")
    for name in ("q4", "t"):
        other = final_state(plain_and_quantised / name)
        assert max(float((plain[k] - other[k]).abs().max()) for k in plain) > 1e-4, name


def test_uploads_are_counted_at_b_bits_per_value(plain_and_quantised):
    """client_edge_bytes = sum over edge rounds of (downloads x model bytes + uploads x the
    quantised upload's bytes); edge-cloud traffic is unchanged."""
    plain = metrics(plain_and_quantised / "plain")[-1]
    quantised = metrics(plain_and_quantised / "q4")[-1]
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    params = dict(model.state_dict())
    edge_rounds = BASE.rounds * BASE.global_period // BASE.local_period
    messages = edge_rounds * BASE.clients  # full participation: one each way per client
    model_bytes = plain["client_edge_bytes"] // (2 * messages)
    assert plain["client_edge_bytes"] == 2 * messages * model_bytes
    packed = sum(math.ceil(v.numel() * 4 / 8) + 4 for v in params.values())
    assert upload_bytes(params, model_bytes, 4) == model_bytes - 4 * 9610 + packed
    assert quantised["client_edge_bytes"] == messages * (
        model_bytes + upload_bytes(params, model_bytes, 4))
    assert quantised["edge_cloud_bytes"] == plain["edge_cloud_bytes"]
    assert quantised["client_edge_messages"] == plain["client_edge_messages"]
    assert quantised["sim_seconds"] < plain["sim_seconds"]  # smaller uploads, shorter rounds


@pytest.mark.parametrize("values,message", [
    ({"quantize_bits": 1}, "quantize_bits must be 0 (off) or 2..16"),
    ({"quantize_bits": 17}, "quantize_bits must be in [0, 16]"),
    ({"langevin_temperature": -1.0}, "langevin_temperature must be >= 0"),
    ({"quantize_bits": 4, "edge_periods": "5,10,10,10"}, "quantize_bits quantises each"),
])
def test_bad_values_are_one_line_errors(values, message):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(values)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_batched_seeds_refuse_langevin():
    from fedhier.engines.vectorized.seed_batch import check_seeds

    with pytest.raises(ConfigError, match="--seeds does not batch --langevin-temperature"):
        check_seeds(RunConfig(engine="vectorized", langevin_temperature=0.1), [0, 1])
    check_seeds(RunConfig(engine="vectorized", quantize_bits=4), [0, 1])  # per seed: fine


def test_config_json_records_the_mechanisms(plain_and_quantised):
    saved = json.loads((plain_and_quantised / "q4" / "config.json").read_text())
    assert saved["quantize_bits"] == 4 and saved["langevin_temperature"] == 0.0


def test_the_suites_per_example_mechanisms():
    """The diversity suite's mechanisms on per-example gradients: QSGD rows on their own
    norm's grid (the option's quantiser), Gaussian noise of variance sigma^2 (chi-square at
    1e-12), and d sigma^2 = the mean squared gradient norm for the matched sigma."""
    from fedhier.studies.experiments.per_example import langevin, matched_sigma, quantized

    g = torch.Generator().manual_seed(3)
    grads = {"w": torch.randn(50, 10, 8, generator=g), "b": torch.randn(50, 10, generator=g)}
    flat = torch.cat([grads["b"], grads["w"].reshape(50, -1)], dim=1).double()  # sorted names
    q = quantized(3)(grads, seed=1, step=7)
    steps = torch.cat([q["b"], q["w"].reshape(50, -1)], dim=1).double()
    grid = steps * levels(3) / flat.norm(dim=1, keepdim=True)
    assert float((grid - grid.round()).abs().max()) < 1e-4
    sigma = matched_sigma(grads)
    assert 90 * sigma**2 == pytest.approx(float(flat.pow(2).sum(1).mean()), rel=1e-9)
    noisy = langevin(sigma)(grads, seed=1, step=7)
    noise = torch.cat([noisy["b"] - grads["b"], (noisy["w"] - grads["w"]).reshape(50, -1)],
                      dim=1).double()
    n, x = noise.numel(), math.log(2 / DELTA)
    chi = float(noise.pow(2).sum()) / sigma**2
    assert abs(chi - n) <= 2 * math.sqrt(n * x) + 2 * x + n * 1e-5  # float32 rounding


def test_the_suites_mechanisms_pool_seeds_under_one_name():
    """Each seed matches its own sigma, but the variants' names (which pool the seeds in the
    suite's tables) do not depend on the seed."""
    from fedhier.studies.experiments.diversity_suite import mechanisms_for

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 1, 8, 8, generator=g), torch.randint(0, 10, (30,), generator=g)
    names = []
    for seed in (1, 2):
        model = build_model("logreg", (1, 8, 8), 10, seed=seed)
        start = {k: v.detach() for k, v in model.state_dict().items()}
        names.append([m.name for m in mechanisms_for(model, start, x, y)])
    assert names[0] == names[1] and len(set(names[0])) == 3

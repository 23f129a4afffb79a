"""fedhier/tree/grouping/*, value by value: the mutants `make mutation` left alive.

The registry and plugin loading (exact messages, which entry point wins), the interface
helpers, the simple groupings by hand, and the divergence search against a second
implementation of its greedy pass (written from the module docstring) and against brute
force on tiny instances.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedhier.tree.grouping as registry
from fedhier.common.rng import generator
from fedhier.tree.grouping import (
    ClientInfo,
    assign_groups,
    available_groupings,
    divergence,
    get_grouping,
    grouping_needs,
    load_plugin,
    plugin_origin,
)
from fedhier.tree.grouping.base import NEEDS, balanced_sizes, declares, needs_of
from fedhier.tree.grouping.divergence import (
    _positive_weights,
    _seeded_order,
    gradient_grouping,
    make_gradient_grouping,
    max_divergence_grouping,
    min_divergence_grouping,
    search_grouping,
    weighted_gram,
)
from fedhier.tree.grouping.simple import contiguous_grouping, edge_tag_grouping, random_grouping
from tests.helpers import assert_refused as refused


def _info(n: int, tags=None) -> ClientInfo:
    hist = np.ones((n, 2), dtype=np.int64)
    return ClientInfo(label_histograms=hist, num_examples=hist.sum(1), edge_tags=tags)


# ------------------------------------------------------------------------------ base
def test_balanced_sizes_and_needs():
    assert balanced_sizes(10, 4).tolist() == [3, 3, 2, 2]
    assert balanced_sizes(8, 4).tolist() == [2, 2, 2, 2]
    assert balanced_sizes(3, 5).tolist() == [1, 1, 1, 0, 0]
    assert balanced_sizes(10, 4).dtype == np.int64
    assert NEEDS == ("labels", "gradients", "edge-tags")
    assert needs_of(lambda info, n, seed: None) == frozenset({"labels"})

    @declares("gradients", "edge-tags")
    def marked(info, n, seed):
        return np.zeros(info.num_clients, np.int64)

    assert needs_of(marked) == frozenset({"gradients", "edge-tags"})
    assert needs_of(declares()(lambda i, n, s: None)) == frozenset()
    refused(lambda: declares("labels", "votes", "age"),
             "unknown grouping needs ['age', 'votes']; choose from ('labels', 'gradients', "
             "'edge-tags')", ValueError)
    assert _info(5).num_clients == 5 and isinstance(_info(5).num_clients, int)


# ------------------------------------------------------------------------------ simple
def test_simple_groupings_by_hand():
    assert contiguous_grouping(_info(7), 3, 0).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert contiguous_grouping(_info(7), 3, 0).dtype == np.int64
    # random: the documented permutation of the contiguous labels
    expected = generator(4, "grouping-random").permutation([0, 0, 0, 1, 1, 2, 2])
    drawn = random_grouping(_info(7), 3, 4)
    assert drawn.tolist() == expected.tolist() and drawn.dtype == np.int64
    assert random_grouping(_info(7), 3, 5).tolist() != drawn.tolist()
    assert needs_of(random_grouping) == frozenset() == needs_of(contiguous_grouping)
    assert needs_of(edge_tag_grouping) == frozenset({"edge-tags"})


def test_edge_tag_grouping():
    assert edge_tag_grouping(_info(4), 2, 0).tolist() == [0, 0, 1, 1]  # untagged level: blocks
    tagged = edge_tag_grouping(_info(4, np.array([1, 0, 0, 1], dtype=np.int32)), 2, 0)
    assert tagged.tolist() == [1, 0, 0, 1] and tagged.dtype == np.int64
    refused(lambda: edge_tag_grouping(_info(4, np.array([1, -1, 0, -1])), 2, 0),
             "grouping 'edge-tag' needs every SuperNode tagged with --node-config 'edge=k'; "
             "2 client(s) are not (e.g. partition 1)")
    refused(lambda: edge_tag_grouping(_info(3, np.array([0, 2, 2])), 3, 0),
             "grouping 'edge-tag': the SuperNodes' edge tags [0, 2] must be exactly 0..2 for 3 "
             "edges (--groups)")


# ------------------------------------------------------------------------------ registry
def test_names_and_needs():
    assert available_groupings()[:6] == ["random", "contiguous", "min-divergence",
                                         "max-divergence", "edge-tag", "gradient"]
    assert grouping_needs("gradient") == frozenset({"gradients"})
    assert grouping_needs("min-divergence") == frozenset({"labels"})
    assert grouping_needs("edge-tag") == frozenset({"edge-tags"})
    assert get_grouping("contiguous") is contiguous_grouping
    refused(lambda: get_grouping("gradient"),
             "the 'gradient' grouping needs client gradients: build it with "
             "fedhier.tree.grouping.make_gradient_grouping(grads)")
    names = ", ".join(available_groupings())
    refused(lambda: get_grouping("nope"), f"unknown grouping 'nope'; choose one of {names}")


def test_assign_groups_checks_the_result():
    info = _info(4)
    assert assign_groups(lambda i, n, s: np.array([1, 0, 1, 0], np.int32), info, 2, 0).dtype \
        == np.int64
    assert assign_groups("contiguous", info, 4, 0).tolist() == [0, 1, 2, 3]  # n groups is fine
    refused(lambda: assign_groups("random", info, 5, 0), "more groups (5) than clients (4)")

    def short(i, n, s):
        return np.zeros(3, np.int64)

    refused(lambda: assign_groups(short, info, 2, 0),
             "grouping 'short' must return 4 integer group ids, got shape (3,) dtype int64")
    refused(lambda: assign_groups(lambda i, n, s: np.zeros(4), info, 2, 0),
             "grouping '<lambda>' must return 4 integer group ids, got shape (4,) dtype "
             "float64")
    for bad in ([0, 1, 2, 0], [0, -1, 1, 0], [0, 0, 0, 0]):
        refused(lambda bad=bad: assign_groups(lambda i, n, s: np.array(bad), info, 2, 0),
                 "grouping '<lambda>' must use every group id 0..1 at least once")
    refused(lambda: assign_groups(lambda i, n, s: np.array([0, 1, 1, 1]), info, 3, 0),
             "grouping '<lambda>' must use every group id 0..2 at least once")
    refused(lambda: assign_groups(lambda i, n, s: np.array([-1, 0, 0, 0]), info, 2, 0),
             "grouping '<lambda>' must use every group id 0..1 at least once")
    refused(lambda: assign_groups(lambda i, n, s: np.array([0, 2, 2, 2]), info, 2, 0),
             "grouping '<lambda>' must use every group id 0..1 at least once")

    class Unnamed:
        def __call__(self, info, num_groups, seed):
            return np.zeros(3, np.int64)

    refused(lambda: assign_groups(Unnamed(), info, 2, 0),
             "grouping 'custom' must return 4 integer group ids, got shape (3,) dtype int64")
    callable_object = SimpleNamespace()
    refused(lambda: assign_groups(lambda i, n, s: callable_object, info, 2, 0),
             "grouping '<lambda>' must return 4 integer group ids, got shape () dtype object")


class _Fake:
    """A stand-in for importlib.metadata.entry_points(group=...)."""

    def __init__(self, groups: dict[str, list[EntryPoint]]):
        self.groups, self.asked = groups, []

    def __call__(self, group: str):
        self.asked.append(group)
        return self.groups.get(group, [])


def _ep(name: str, value: str, group: str, dist=None) -> EntryPoint:
    ep = EntryPoint(name, value, group)
    if dist is not None:
        ep = ep._for(dist)  # how importlib.metadata attaches an installed distribution
    return ep


def test_plugins_from_entry_points(monkeypatch):
    pkg = SimpleNamespace(name="demo", version="0.3")
    fake = _Fake({
        "fedhier.groupings": [_ep("blocks", "fedhier.tree.grouping.simple:contiguous_grouping",
                                  "fedhier.groupings", pkg),
                              _ep("blocks", "fedhier.tree.grouping.simple:random_grouping",
                                  "fedhier.groupings", pkg),
                              _ep("random", "fedhier.tree.grouping.simple:contiguous_grouping",
                                  "fedhier.groupings", pkg),
                              _ep("broken", "fedhier_no_such_module:f", "fedhier.groupings",
                                  pkg)],
        "fedhier.tree.grouping": [_ep("old", "fedhier.tree.grouping.simple:contiguous_grouping",
                                 "fedhier.tree.grouping"),
                             _ep("blocks", "fedhier.tree.grouping.simple:edge_tag_grouping",
                                 "fedhier.tree.grouping")],
    })
    monkeypatch.setattr(registry, "entry_points", fake)
    assert available_groupings() == ["random", "contiguous", "min-divergence",
                                     "max-divergence", "edge-tag", "gradient", "blocks",
                                     "broken", "old"]
    assert fake.asked[:2] == ["fedhier.groupings", "fedhier.tree.grouping"]
    assert get_grouping("blocks") is contiguous_grouping  # the first one declared wins
    assert get_grouping("old") is contiguous_grouping  # the legacy group is read too
    assert get_grouping("random") is random_grouping  # a plugin cannot replace a built-in
    refused(lambda: get_grouping("broken"),
             "grouping plugin 'broken' from package demo 0.3 (fedhier_no_such_module:f) failed "
             "to import: ModuleNotFoundError: No module named 'fedhier_no_such_module'; fix or "
             "uninstall that package")


def test_plugin_origin():
    assert plugin_origin(EntryPoint("a.b:f", "a.b:f", "g")) == "module reference a.b:f"
    assert plugin_origin(EntryPoint("x", "a.b:f", "g")) == "unknown package (a.b:f)"
    pkg = SimpleNamespace(name="demo", version="1.2")
    assert plugin_origin(_ep("a.b:f", "a.b:f", "g", pkg)) == "package demo 1.2 (a.b:f)"


def test_module_reference_plugins(tmp_path, monkeypatch):
    (tmp_path / "fedhier_t31_plugins.py").write_text(textwrap.dedent("""
        import numpy as np
        LIMIT = 3
        def short(info, num_groups, seed):
            return np.zeros(2, np.int64)
        def halves(info, num_groups, seed):
            return (np.arange(info.num_clients) * num_groups // info.num_clients)
    """))
    (tmp_path / "fedhier_t31_noisy.py").write_text(
        "raise ValueError('\\n  \\n  first line  \\nsecond line')\n")
    (tmp_path / "fedhier_t31_silent.py").write_text("raise KeyboardInterrupt if 0 else "
                                                     "RuntimeError()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fedhier_t31_plugins", "fedhier_t31_noisy", "fedhier_t31_silent"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    halves = get_grouping("fedhier_t31_plugins:halves")
    assert assign_groups("fedhier_t31_plugins:halves", _info(6), 3, 0).tolist() == \
        [0, 0, 1, 1, 2, 2]
    assert load_plugin("fedhier_t31_plugins:halves") is halves
    refused(lambda: assign_groups("fedhier_t31_plugins:short", _info(6), 3, 0),
             "grouping 'fedhier_t31_plugins:short' must return 6 integer group ids, got shape "
             "(2,) dtype int64")
    refused(lambda: get_grouping("fedhier_t31_plugins:LIMIT"),
             "grouping plugin 'fedhier_t31_plugins:LIMIT' from module reference "
             "fedhier_t31_plugins:LIMIT is a int, not a function (info, num_groups, seed)")
    refused(lambda: get_grouping("fedhier_t31_noisy:f"),
             "grouping plugin 'fedhier_t31_noisy:f' from module reference fedhier_t31_noisy:f "
             "failed to import: ValueError: first line; fix or uninstall that package")
    refused(lambda: get_grouping("fedhier_t31_silent:f"),
             "grouping plugin 'fedhier_t31_silent:f' from module reference fedhier_t31_silent:f "
             "failed to import: RuntimeError; fix or uninstall that package")


# ------------------------------------------------------------------------------ divergence
def _greedy(z: np.ndarray, w: np.ndarray, groups: int, order, maximise: bool) -> list[int]:
    """The docstring's greedy pass: each client, in order, to the open group whose mean
    (with it) is closest to (farthest from) the global mean; ties to the lowest group."""
    mu = w @ z / w.sum()
    sizes = balanced_sizes(len(w), groups)
    members: list[list[int]] = [[] for _ in range(groups)]
    assign = [-1] * len(w)
    for j in order:
        best, best_d = -1, 0.0
        for g in range(groups):
            if len(members[g]) >= sizes[g]:
                continue
            m = members[g] + [j]
            d = float(np.sum((w[m] @ z[m] / w[m].sum() - mu) ** 2))
            if best < 0 or (d > best_d if maximise else d < best_d):
                best, best_d = g, d
        members[best].append(j)
        assign[j] = best
    return assign


def _u(z: np.ndarray, w: np.ndarray, assign) -> float:
    """U = Σ_i P_i ||μ_i − μ||² (the module docstring)."""
    assign = np.asarray(assign)
    mu = w @ z / w.sum()
    total = 0.0
    for g in np.unique(assign):
        m = assign == g
        total += w[m].sum() / w.sum() * float(np.sum((w[m] @ z[m] / w[m].sum() - mu) ** 2))
    return total


def _sweeps(z, w, assign, order, maximise: bool, max_sweeps: int = 100) -> list[int]:
    """The docstring's local search: sweeps over the clients in order; for each client the
    best swap partner in another group (ties: the lowest index) is taken if it improves U."""
    assign = list(assign)
    sign = -1.0 if maximise else 1.0
    scale = 1e-12 * float(np.sum(w * np.sum((z - w @ z / w.sum()) ** 2, 1)))
    for _ in range(max_sweeps):
        improved = False
        for j in order:
            here = sign * _u(z, w, assign)
            best, best_k = np.inf, -1
            for k in range(len(w)):
                if assign[k] == assign[j]:
                    continue
                swapped = list(assign)
                swapped[j], swapped[k] = assign[k], assign[j]
                delta = sign * _u(z, w, swapped) - here
                if delta < best:
                    best, best_k = delta, k
            if best_k >= 0 and best < -scale:
                assign[j], assign[best_k] = assign[best_k], assign[j]
                improved = True
        if not improved:
            break
    return assign


@pytest.mark.parametrize("maximise", [False, True])
@pytest.mark.parametrize("n, groups", [(7, 3), (8, 2), (9, 4), (16, 3)])
def test_the_search_is_the_documented_one(n, groups, maximise):
    """Greedy pass and swap sweeps, each against a plain re-implementation (U by brute
    force): the same grouping, client for client."""
    rng = np.random.default_rng(n * 10 + groups)
    z, w = rng.normal(size=(n, 3)), rng.uniform(0.5, 3.0, size=n)
    order = rng.permutation(n)
    gram = weighted_gram(z, w, seed=0)
    greedy = _greedy(z, w, groups, order, maximise)
    got = search_grouping(gram, w, groups, order, maximise=maximise, max_sweeps=0)
    assert got.tolist() == greedy and got.dtype == np.int64
    full = search_grouping(gram, w, groups, order, maximise=maximise)
    assert full.tolist() == _sweeps(z, w, greedy, order, maximise)
    one = search_grouping(gram, w, groups, order, maximise=maximise, max_sweeps=1)
    assert one.tolist() == _sweeps(z, w, greedy, order, maximise, max_sweeps=1)


def test_the_swap_search_ends_at_a_swap_optimum():
    """No swap of two clients in different groups improves U (checked by brute force over
    every pair), and the sweeps do change the greedy result on some of these cases."""
    changed = 0
    for seed, maximise in itertools.product(range(6), (False, True)):
        rng = np.random.default_rng(100 + seed)
        n, groups = 8, 3
        z, w = rng.normal(size=(n, 2)), rng.uniform(0.5, 3.0, size=n)
        gram, order = weighted_gram(z, w, seed=0), rng.permutation(n)
        got = search_grouping(gram, w, groups, order, maximise=maximise)
        greedy = search_grouping(gram, w, groups, order, maximise=maximise, max_sweeps=0)
        changed += got.tolist() != greedy.tolist()
        sign = -1 if maximise else 1
        value = sign * _u(z, w, got)
        assert value <= sign * _u(z, w, greedy) + 1e-12
        assert np.bincount(got, minlength=groups).tolist() == balanced_sizes(n, groups).tolist()
        for a, b in itertools.combinations(range(n), 2):
            if got[a] != got[b]:
                swapped = got.copy()
                swapped[a], swapped[b] = got[b], got[a]
                assert sign * _u(z, w, swapped) >= value - 1e-12, (seed, maximise, a, b)
    assert changed >= 3


def test_search_edge_cases():
    rng = np.random.default_rng(0)
    z, w = rng.normal(size=(5, 2)), np.ones(5)
    gram = weighted_gram(z, w, seed=0)
    assert search_grouping(gram, w, 1, np.arange(5)).tolist() == [0] * 5
    assert search_grouping(gram, w, 5, np.array([4, 3, 2, 1, 0])).tolist() == [4, 3, 2, 1, 0]
    refused(lambda: search_grouping(gram, w, 6, np.arange(5)),
             "need 1 <= num_groups <= 5 clients, got 6", ValueError)
    refused(lambda: search_grouping(gram, w, 0, np.arange(5)),
             "need 1 <= num_groups <= 5 clients, got 0", ValueError)


def test_positive_weights():
    assert _positive_weights(np.array([[2.0, 0.0, 4.0]])).tolist() == [2.0, 4e-9, 4.0]
    assert _positive_weights(np.zeros(3)).tolist() == [1.0, 1.0, 1.0]
    assert _positive_weights(np.array([1, 2])).dtype == np.float64
    assert _positive_weights(np.array([0, 0])).dtype == np.float64
    for bad in ([1.0, -1.0], [1.0, np.nan], [np.inf, 1.0]):
        refused(lambda bad=bad: _positive_weights(np.array(bad)),
                 "client weights must be finite and non-negative", ValueError)


def test_seeded_order():
    # keys ascending, first key primary; ties in the order of generator(seed, purpose)
    primary = np.array([2, 1, 2, 1, 0])
    secondary = np.array([5.0, 3.0, 4.0, 3.0, 9.0])
    got = _seeded_order(3, "p", primary, secondary)
    shuffle = generator(3, "p").permutation(5)
    tie = [j for j in shuffle if j in (1, 3)]  # clients 1 and 3 tie on both keys
    assert got.tolist() == [4, *tie, 2, 0] and got.dtype == np.int64


def test_weighted_gram_by_hand():
    z = np.array([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    w = np.array([1.0, 1.0, 2.0])
    # μ = (1*[1,0] + [3,2] + 2*[0,4]) / 4 = [1, 2.5]; u = w (z − μ)
    u = np.array([[0.0, -2.5], [2.0, -0.5], [-2.0, 3.0]])
    np.testing.assert_allclose(weighted_gram(z, w, seed=0), u @ u.T, rtol=0, atol=1e-12)
    # D = 2 <= max_dim = 2 (or n = 3 <= max_dim = 3): exact, float32 input accumulated in float64
    for max_dim in (2, 3):
        np.testing.assert_allclose(weighted_gram(torch.from_numpy(z).float(), w, seed=0,
                                                 max_dim=max_dim), u @ u.T, rtol=0, atol=1e-12)
    np.testing.assert_allclose(weighted_gram(z, np.array([1, 1, 2]), seed=0), u @ u.T, rtol=0,
                               atol=1e-12)  # integer weights
    wide = np.random.default_rng(2).normal(size=(3, 5))
    uw = wide - wide.mean(0)
    np.testing.assert_allclose(weighted_gram(wide, np.ones(3), seed=0, max_dim=3), uw @ uw.T,
                               rtol=0, atol=1e-12)  # n = max_dim < D: still exact
    # both n and D above max_dim: the seeded projection R / sqrt(max_dim), blocks of columns
    big = np.random.default_rng(1).normal(size=(4, 6))
    wb = np.array([1.0, 2.0, 1.0, 3.0])
    ub = wb[:, None] * (big - wb @ big / wb.sum())
    r = generator(9, "gradient-grouping-projection").standard_normal((6, 2), dtype=np.float32)
    v = (ub.astype(np.float32) @ r).astype(np.float64) / np.sqrt(2)
    np.testing.assert_allclose(weighted_gram(big, wb, seed=9, max_dim=2), v @ v.T, rtol=1e-5,
                               atol=1e-5)
    assert not np.allclose(weighted_gram(big, wb, seed=10, max_dim=2), v @ v.T, atol=1e-3)


def test_weighted_gram_in_column_blocks(monkeypatch):
    """Blocks of 2 columns (6 columns: 3 blocks) give the one-block numbers."""
    big = np.random.default_rng(1).normal(size=(4, 6))
    wb = np.array([1.0, 2.0, 1.0, 3.0])
    exact, projected = weighted_gram(big, wb, 0), weighted_gram(big, wb, 9, max_dim=2)
    monkeypatch.setattr(divergence, "_COLUMN_BLOCK", 2)
    np.testing.assert_allclose(weighted_gram(big, wb, 0), exact, rtol=0, atol=1e-12)
    np.testing.assert_allclose(weighted_gram(big, wb, 9, max_dim=2), projected, rtol=1e-5,
                               atol=1e-5)


def test_label_groupings_by_hand():
    # 6 clients, one class each: 0, 0, 1, 1, 2, 2 (rows 4, 2, 4, 2, 4, 2). The min-divergence
    # optimum into 2 groups of 3 holds one client of every class in each group (the mixes
    # 4:4:4 / 2:2:2 give U = 0 exactly).
    hist = np.array([[4, 0, 0], [2, 0, 0], [0, 4, 0], [0, 2, 0], [0, 0, 4], [0, 0, 2]])
    info = ClientInfo(label_histograms=hist, num_examples=hist.sum(1))
    mixed = min_divergence_grouping(info, 2, 0)
    for g in (0, 1):
        assert sorted(hist[mixed == g].argmax(1).tolist()) == [0, 1, 2]
    # max-divergence into 3 groups of 2: each group one class (label-pure)
    pure = max_divergence_grouping(info, 3, 0)
    assert len({(pure[0], pure[1]), (pure[2], pure[3]), (pure[4], pure[5])}) == 3
    assert pure[0] == pure[1] and pure[2] == pure[3] and pure[4] == pure[5]
    refused(lambda: min_divergence_grouping(info, 7, 0),
             "need 1 <= num_groups <= 6 clients, got 7", ValueError)


def test_gradient_grouping_weights_and_errors():
    # gradients ±e1 (weights 1), ±2 e2 (weights 3): min-divergence pairs the opposites
    grads = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0], [0.0, -2.0]])
    info = ClientInfo(label_histograms=np.ones((4, 1), np.int64),
                      num_examples=np.array([1, 3, 1, 3]))
    for weights in ("samples", np.array([1.0, 3.0, 1.0, 3.0]), torch.tensor([1.0, 3.0, 1.0, 3.0])):
        got = gradient_grouping(info, 2, 0, grads, weights)
        assert got[0] == got[2] and got[1] == got[3] and got[0] != got[1]
        assert make_gradient_grouping(grads, weights)(info, 2, 0).tolist() == got.tolist()
    # maximising: a larger U than the pairing of opposites (whose U is 0)
    far = gradient_grouping(info, 2, 0, grads, "uniform", maximise=True)
    assert _u(grads.numpy().astype(np.float64), np.ones(4), far) > \
        _u(grads.numpy().astype(np.float64), np.ones(4), [0, 1, 0, 1])
    refused(lambda: gradient_grouping(info, 2, 0, grads[:3]),
             "3 client gradients for 4 clients", ValueError)
    refused(lambda: gradient_grouping(info, 2, 0, grads, np.ones(3)),
             "need 4 client weights, got shape (3,)", ValueError)
    refused(lambda: gradient_grouping(info, 5, 0, grads),
             "need 1 <= num_groups <= 4 clients, got 5", ValueError)


def _documented_order(seed: int, purpose: str, *keys: np.ndarray) -> list[int]:
    """Clients by keys ascending (first key primary), ties in generator(seed, purpose)'s
    permutation order."""
    rank = {int(c): i for i, c in enumerate(generator(seed, purpose).permutation(len(keys[0])))}
    return sorted(range(len(keys[0])), key=lambda j: (*(float(k[j]) for k in keys), rank[j]))


@pytest.fixture
def recorded(monkeypatch):
    """What the groupings hand to weighted_gram and search_grouping."""
    calls: dict[str, list] = {"gram": [], "search": []}
    real_gram, real_search = divergence.weighted_gram, divergence.search_grouping

    def gram(features, weights, seed, max_dim=divergence.PROJECTION_DIM):
        calls["gram"].append((np.asarray(weights, dtype=np.float64).copy(), seed, max_dim))
        return real_gram(features, weights, seed, max_dim)

    def search(g, weights, num_groups, order, *, maximise=False, max_sweeps=100):
        calls["search"].append((np.asarray(order).tolist(), maximise))
        return real_search(g, weights, num_groups, order, maximise=maximise,
                           max_sweeps=max_sweeps)

    monkeypatch.setattr(divergence, "weighted_gram", gram)
    monkeypatch.setattr(divergence, "search_grouping", search)
    return calls


def test_label_search_orders(recorded):
    # rows 5, 3, 5, 2, 3, 5; dominant labels 1, 0, 0, 2, 1, 1
    hist = np.array([[1, 4, 0], [3, 0, 0], [4, 1, 0], [0, 0, 2], [1, 2, 0], [0, 5, 0]])
    info = ClientInfo(label_histograms=hist, num_examples=hist.sum(1))
    rows = hist.sum(1).astype(np.float64)
    for seed in range(3, 9):  # ties (equal rows, equal labels) in each seed's own order
        min_divergence_grouping(info, 2, seed)
        max_divergence_grouping(info, 2, seed)
    assert recorded["search"] == [
        order for seed in range(3, 9) for order in (
            (_documented_order(seed, "grouping-min-divergence", -rows), False),
            (_documented_order(seed, "grouping-max-divergence", hist.argmax(1), -rows), True))]
    assert [(g[1], g[2]) for g in recorded["gram"]] == \
        [(seed, 256) for seed in range(3, 9) for _ in range(2)]
    np.testing.assert_array_equal(recorded["gram"][0][0], rows)


def test_gradient_search_orders(recorded):
    grads = torch.from_numpy(np.random.default_rng(6).normal(size=(6, 4)))
    info = ClientInfo(label_histograms=np.ones((6, 1), np.int64),
                      num_examples=np.array([2, 5, 5, 1, 2, 5]))
    w = np.array([2.0, 5.0, 5.0, 1.0, 2.0, 5.0])
    default = gradient_grouping(info, 2, 4, grads)  # weights default to uniform
    assert default.tolist() == gradient_grouping(info, 2, 4, grads, "uniform").tolist()
    gradient_grouping(info, 2, 4, grads, "samples", max_dim=3)
    gradient_grouping(info, 2, 4, grads, torch.tensor(w, requires_grad=True), maximise=True)
    vectors = np.linalg.eigh(weighted_gram(grads, w, 4))[1]
    assert recorded["search"][1:] == [
        (_documented_order(4, "grouping-gradient", -np.ones(6)), False),
        (_documented_order(4, "grouping-gradient", -w), False),
        (_documented_order(4, "grouping-gradient", vectors[:, -1]), True)]
    assert [(g[1], g[2]) for g in recorded["gram"][:4]] == [(4, 256), (4, 256), (4, 3), (4, 256)]
    np.testing.assert_array_equal(recorded["gram"][2][0], w)


def test_make_gradient_grouping_passes_everything_on():
    grads = torch.from_numpy(np.random.default_rng(8).normal(size=(12, 10)))
    info = ClientInfo(label_histograms=np.ones((12, 1), np.int64),
                      num_examples=np.arange(1, 13) ** 2)
    for kwargs in ({}, {"weights": "samples"}, {"maximise": True}, {"max_dim": 4},
                   {"weights": np.arange(1.0, 13.0), "maximise": True, "max_dim": 3}):
        made = make_gradient_grouping(grads, **kwargs)(info, 3, 1)
        assert made.tolist() == gradient_grouping(info, 3, 1, grads, **kwargs).tolist(), kwargs
    # and the arguments matter here: each differs from the default
    plain = gradient_grouping(info, 3, 1, grads)
    for kwargs in ({"weights": "samples"}, {"maximise": True}, {"max_dim": 4}):
        assert gradient_grouping(info, 3, 1, grads, **kwargs).tolist() != plain.tolist(), kwargs

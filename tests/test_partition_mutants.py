"""fedhier/data/partition.py, value by value: the mutants `make mutation` left alive.

Fresh tiny bundles (never the process-wide ``load_data`` cache, whose memoized partitions
would hide a changed partitioner), partitions worked out from the docstring's definitions
or from flwr-datasets' partitioners called directly with the documented arguments, and the
exact message of every refused argument.
"""

from __future__ import annotations

import functools

import datasets
import numpy as np
import pytest
from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

from fedhier.common.errors import DataError
from fedhier.data.bundle import DataBundle, bundle_from_arrays
from fedhier.data.partition import (
    AUTO_MIN_PARTITION_CAP,
    auto_min_partition_size,
    label_histogram,
    partition_clients,
    quiet_progress,
)
from tests.helpers import assert_refused

# 40 rows, 4 classes: labels 0..3 in a scrambled but fixed order, 10 rows each
LABELS = np.array([3, 0, 2, 1, 1, 3, 0, 2, 0, 0, 3, 1, 2, 2, 1, 3, 0, 1, 2, 3,
                   2, 0, 1, 3, 3, 2, 0, 1, 0, 2, 1, 3, 2, 1, 0, 3, 1, 2, 3, 0])


def _bundle(labels: np.ndarray = LABELS, ids=None, name: str = "tiny") -> DataBundle:
    x = np.arange(len(labels) * 2, dtype=np.float32).reshape(len(labels), 2)
    return bundle_from_arrays(name=name, train=(x, labels, ids), test=(x[:4], labels[:4]),
                              input_shape=(2,), num_classes=4, source="test",
                              fingerprint_key=f"t31-{name}-{len(labels)}")


_refused = functools.partial(assert_refused, exact=True)


def _light(labels: np.ndarray) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"label": labels, "__row__": np.arange(len(labels))})


def _read(partitioner, k: int) -> list[list[int]]:
    return [sorted(partitioner.load_partition(i)["__row__"]) for i in range(k)]


def test_auto_min_partition_size():
    assert AUTO_MIN_PARTITION_CAP == 10
    # the docstring's digits examples: floor(alpha * rows / (2 n)), capped to [1, 10]
    assert auto_min_partition_size(1437, 100, 0.5) == 3
    assert auto_min_partition_size(1437, 40, 0.1) == 1
    assert auto_min_partition_size(1437, 20, 0.5) == 10
    assert auto_min_partition_size(40, 2, 1.0) == 10   # floor(10.0) = 10: at the cap
    assert auto_min_partition_size(36, 2, 1.0) == 9    # floor(9.0)
    assert auto_min_partition_size(100, 1, 0.001) == 1  # floor(0.05) = 0 -> at least 1
    assert auto_min_partition_size(40, 1, 1.0) == 10    # one client: floor(20) -> 10
    assert auto_min_partition_size(6, 1, 1.0) == 3      # floor(3.0)
    assert auto_min_partition_size(100, 0, 0.5) == 1
    assert auto_min_partition_size(100, -3, 0.5) == 1


def test_label_histogram():
    hist = label_histogram(np.array([3, 0, 3]), 5)
    assert hist.tolist() == [1, 0, 0, 2, 0] and hist.dtype == np.int64
    assert label_histogram(np.array([], dtype=np.int64), 3).tolist() == [0, 0, 0]
    assert label_histogram(np.array([2, 0]), 3).tolist() == [1, 0, 1]  # max = C - 1 is fine
    _refused(lambda: label_histogram(np.array([1, -1, 2]), 4),
             "labels range from -1 to 2, outside 0..3", DataError)
    _refused(lambda: label_histogram(np.array([0, 4]), 4),
             "labels range from 0 to 4, outside 0..3", DataError)


@pytest.mark.parametrize("enabled", [True, False])
def test_quiet_progress_restores_the_setting(enabled):
    was = datasets.is_progress_bar_enabled()
    try:
        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
        with quiet_progress():
            assert not datasets.is_progress_bar_enabled()
        assert datasets.is_progress_bar_enabled() == enabled
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def test_iid_is_a_seeded_shuffle_cut_in_blocks():
    parts = partition_clients(_bundle(), "iid", 3, seed=7)
    order = np.random.default_rng(7).permutation(40)
    assert [p.tolist() for p in parts] == [sorted(b.tolist())
                                          for b in np.array_split(order, 3)]
    assert all(p.dtype == np.int64 for p in parts)


def test_sorted_is_stable_label_order_cut_in_blocks():
    parts = partition_clients(_bundle(), "sorted", 3, seed=0)
    order = np.argsort(LABELS, kind="stable")
    assert [p.tolist() for p in parts] == [sorted(b.tolist())
                                          for b in np.array_split(order, 3)]
    assert [len(p) for p in parts] == [14, 13, 13] and parts[0].dtype == np.int64


def test_dirichlet_is_flwr_datasets_with_the_documented_arguments():
    for kwargs in ({"alpha": 0.3, "min_partition_size": 4, "self_balancing": False},
                   {"alpha": 0.5, "min_partition_size": 3, "self_balancing": True}):
        parts = partition_clients(_bundle(), "dirichlet", 4, seed=3, **kwargs)
        direct = DirichletPartitioner(num_partitions=4, partition_by="label",
                                      alpha=kwargs["alpha"],
                                      min_partition_size=kwargs["min_partition_size"],
                                      self_balancing=kwargs["self_balancing"], shuffle=True,
                                      seed=3)
        direct.dataset = _light(LABELS)
        assert [p.tolist() for p in parts] == _read(direct, 4)
        assert min(len(p) for p in parts) >= kwargs["min_partition_size"]
    # 0 = the auto minimum: floor(100 * 40 / (2 * 3)) -> 10 (the cap) -> 3 x 10 rows <= 40
    auto = partition_clients(_bundle(), "dirichlet", 3, seed=1, alpha=100.0,
                             min_partition_size=0)
    assert min(len(p) for p in auto) >= 10


def test_dirichlet_failures():
    # 5 x 10 > 40 rows: impossible at any alpha, so only fewer clients or a smaller minimum
    _refused(lambda: partition_clients(_bundle(), "dirichlet", 5, seed=0, alpha=100.0,
                                       min_partition_size=0),
             "Dirichlet partition impossible: 5 clients x at least 10 rows each is more than "
             "the 40 training rows; use at most 4 clients, or lower --min-partition-size",
             DataError)
    _refused(lambda: partition_clients(_bundle(), "dirichlet", 4, seed=0, alpha=0.5,
                                       min_partition_size=11),
             "Dirichlet partition impossible: 4 clients x at least 11 rows each is more than "
             "the 40 training rows; use at most 3 clients, or lower --min-partition-size",
             DataError)
    # 4 x 9 = 36 <= 40 rows, but alpha 0.01 never gives every client 9: the sampler fails
    _refused(lambda: partition_clients(_bundle(), "dirichlet", 4, seed=0, alpha=0.01,
                                       min_partition_size=9),
             "Dirichlet partition failed: could not give every one of 4 clients at least 9 "
             "rows with alpha=0.01 (40 training rows); raise --alpha, lower "
             "--min-partition-size, use fewer clients or use --partition iid", DataError)
    # exactly 4 x 10 = 40 rows: not refused up front (no cause), the sampler tries and fails
    with pytest.raises(DataError) as tried:
        partition_clients(_bundle(), "dirichlet", 4, seed=0, alpha=100.0, min_partition_size=10)
    assert isinstance(tried.value.__cause__, ValueError)
    with pytest.raises(DataError) as upfront:
        partition_clients(_bundle(), "dirichlet", 5, seed=0, alpha=100.0, min_partition_size=9)
    assert upfront.value.__cause__ is None  # 5 x 9 > 40: refused without sampling


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": True}, "Dirichlet alpha must be a number > 0, got True"),
    ({"alpha": "0.5"}, "Dirichlet alpha must be a number > 0, got '0.5'"),
    ({"alpha": 0.0}, "Dirichlet alpha must be a number > 0, got 0.0"),
    ({"alpha": float("inf")}, "Dirichlet alpha must be a number > 0, got inf"),
    ({"alpha": float("nan")}, "Dirichlet alpha must be a number > 0, got nan"),
    ({"alpha": [0.5]}, "Dirichlet alpha must be a number > 0, got [0.5]"),  # unhashable
    ({"min_partition_size": True}, "min partition size must be an integer, got True"),
    ({"min_partition_size": 2.0}, "min partition size must be an integer, got 2.0"),
    ({"min_partition_size": -1}, "min partition size must be >= 0, got -1"),
])
def test_dirichlet_arguments_refused(kwargs, message):
    _refused(lambda: partition_clients(_bundle(), "dirichlet", 2, seed=0, **kwargs), message)


def test_shards_are_flwr_datasets_with_the_documented_arguments():
    for k in (1, 2, 4):
        parts = partition_clients(_bundle(), "shards", 4, seed=5, classes_per_client=k)
        direct = PathologicalPartitioner(num_partitions=4, partition_by="label",
                                         num_classes_per_partition=k,
                                         class_assignment_mode="first-deterministic",
                                         shuffle=True, seed=5)
        direct.dataset = _light(LABELS)
        assert [p.tolist() for p in parts] == _read(direct, 4)
        assert [len(set(LABELS[p].tolist())) for p in parts] == [k] * 4
        if k == 1:  # the first class of client i is i % 4
            assert [int(LABELS[p][0]) for p in parts] == [0, 1, 2, 3]


def test_shards_arguments_refused():
    tiny = _bundle()
    for bad, message in [
        (True, "classes per client must be an integer, got True"),
        (2.0, "classes per client must be an integer, got 2.0"),
        (0, "classes per client must be between 1 and 4 (the classes of 'tiny'), got 0"),
        (5, "classes per client must be between 1 and 4 (the classes of 'tiny'), got 5"),
    ]:
        _refused(lambda bad=bad: partition_clients(tiny, "shards", 2, seed=0,
                                                   classes_per_client=bad), message)
    three = _bundle(LABELS % 3, name="three")  # classes 0..2 present of 4
    _refused(lambda: partition_clients(three, "shards", 2, seed=0, classes_per_client=4),
             "shards partition needs 4 classes per client but the training split of 'three' "
             "holds only 3; lower --classes-per-client", DataError)
    assert len(partition_clients(three, "shards", 3, seed=0, classes_per_client=3)) == 3


def test_shards_with_too_few_rows_per_class():
    few = _bundle(np.array([0, 1, 2, 3, 0, 1, 2, 3]), name="few")  # 2 rows per class
    with pytest.raises(DataError) as caught:
        partition_clients(few, "shards", 8, seed=0, classes_per_client=2)
    text = str(caught.value)
    assert text.startswith("shards partition failed: some class has fewer rows than the 8 "
                           "clients x 2 classes need (")
    assert text.endswith("); use fewer clients or fewer classes per client")


def test_defaults():
    # alpha 0.5 and at least 10 rows per client by default (5 x 10 > 40 rows)
    _refused(lambda: partition_clients(_bundle(), "dirichlet", 5, seed=0),
             "Dirichlet partition impossible: 5 clients x at least 10 rows each is more than "
             "the 40 training rows; use at most 4 clients, or lower --min-partition-size",
             DataError)
    big = _bundle(np.tile(LABELS, 5), name="big")  # 200 rows
    assert [p.tolist() for p in partition_clients(big, "dirichlet", 4, seed=2)] == \
        [p.tolist() for p in partition_clients(_bundle(np.tile(LABELS, 5), name="big"),
                                               "dirichlet", 4, seed=2, alpha=0.5,
                                               min_partition_size=10, self_balancing=False)]
    # two classes per client by default
    assert [len(set(LABELS[p].tolist())) for p in partition_clients(_bundle(), "shards", 4,
                                                                     seed=0)] == [2] * 4


def test_one_bundle_many_schemes():
    """Results memoized on the bundle are told apart by every argument."""
    bundle = _bundle()
    iid = partition_clients(bundle, "iid", 3, seed=0)
    ordered = partition_clients(bundle, "sorted", 3, seed=0)
    order = np.argsort(LABELS, kind="stable")
    assert [p.tolist() for p in ordered] == [sorted(b.tolist())
                                            for b in np.array_split(order, 3)]
    assert [p.tolist() for p in iid] != [p.tolist() for p in ordered]
    assert [p.tolist() for p in partition_clients(bundle, "iid", 3, seed=1)] != \
        [p.tolist() for p in iid]


def test_natural_partition_prints_nothing(capfd):
    ids = ["b", "a", "c", "a", "b", "b", "c", "a"] * 5
    partition_clients(_bundle(ids=ids, name="quiet"), "natural", 0, seed=0)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_natural_is_one_client_per_id_in_sorted_order():
    ids = ["b", "a", "c", "a", "b", "b", "c", "a"] * 5
    bundle = _bundle(ids=ids, name="natural")
    expected = [[i for i, v in enumerate(ids) if v == name] for name in ("a", "b", "c")]
    assert [p.tolist() for p in partition_clients(bundle, "natural", 0, seed=0)] == expected
    assert [p.tolist() for p in partition_clients(bundle, "natural", 3, seed=9)] == expected
    _refused(lambda: partition_clients(bundle, "natural", 2, seed=0),
             "'natural' has 3 natural client ids, so the natural partition needs 3 clients (or "
             "0 for all); got 2")
    _refused(lambda: partition_clients(_bundle(), "natural", 0, seed=0),
             "partition 'natural' needs a dataset with natural client ids and 'tiny' has none; "
             "choose one of dirichlet, iid, shards, sorted")
    # a natural-id dataset partitioned by another scheme
    assert sum(len(p) for p in partition_clients(bundle, "iid", 4, seed=0)) == 40


@pytest.mark.parametrize("scheme, clients, message", [
    ("zipf", 2, "unknown partition scheme 'zipf'; choose one of dirichlet, iid, shards, "
                "natural, sorted"),
    ("iid", True, "number of clients must be an integer, got True"),
    ("iid", 2.0, "number of clients must be an integer, got 2.0"),
    ("iid", 0, "number of clients must be between 1 and the 40 training rows of 'tiny', got 0"),
    ("sorted", 41, "number of clients must be between 1 and the 40 training rows of 'tiny', "
                   "got 41"),
])
def test_partition_arguments_refused(scheme, clients, message):
    _refused(lambda: partition_clients(_bundle(), scheme, clients, seed=0), message)


def test_client_counts_at_the_ends_and_fresh_copies():
    bundle = _bundle()
    assert [len(p) for p in partition_clients(bundle, "sorted", 40, seed=0)] == [1] * 40
    one = partition_clients(bundle, "iid", np.int64(1), seed=0)
    assert len(one) == 1 and one[0].tolist() == list(range(40))
    first = partition_clients(bundle, "iid", 2, seed=0)
    first[0][:] = -1
    assert partition_clients(bundle, "iid", 2, seed=0)[0].min() >= 0

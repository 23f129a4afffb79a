"""Exact values of the round's restore part (fedhier/round/restore.py), case by case: the
tests written against its mutation survivors (docs/testing.md, "Mutation testing")."""

import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.round.restore import Restored
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import assert_refused

TREE = Hierarchy((1, 2), (np.array([0, 1, 1], dtype=np.int64),))


def test_an_old_checkpoint_restores_nothing():
    r = Restored.from_state({})
    assert (r.hierarchy, r.clock, r.sizes, r.executor) == (None, None, None, None)
    assert Restored() == r


def test_every_part_is_read_from_its_key():
    clock = {"now": 2.5}
    r = Restored.from_state({"hierarchy": TREE, "clock": clock, "num_examples": [3, 0, 5],
                             "executor": {"momentum": 1}, "other": 7})
    assert r.hierarchy is TREE and r.clock is clock and r.sizes == [3, 0, 5]
    assert r.executor == {"momentum": 1}


@pytest.mark.parametrize("sizes", [(3, 0, 5), [3, -1, 5], [3, True, 5], [3, 2.0, 5], "35",
                                   {"a": 1}])
def test_sizes_that_are_not_a_list_of_row_counts_are_refused(sizes):
    assert_refused(lambda: Restored.from_state({"num_examples": sizes}),
                   "num_examples is not a list of row counts >= 0", TypeError, exact=True)


@pytest.mark.parametrize("state", [[("momentum", 1)], "x", 3])
def test_an_executor_state_that_is_not_a_table_is_refused(state):
    assert_refused(lambda: Restored.from_state({"executor": state}),
                   "the executor state is not a table", TypeError, exact=True)


def profiles() -> ClientInfo:
    return ClientInfo(label_histograms=np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64),
                      num_examples=np.array([3, 7, 11], dtype=np.int64))


def test_the_checkpoint_s_rows_replace_the_profiles_rows():
    info = profiles()
    assert Restored().info(info) is info
    out = Restored(sizes=[4, 0, 9]).info(info)
    assert out.num_examples.dtype == np.int64 and out.num_examples.tolist() == [4, 0, 9]
    assert out.label_histograms is info.label_histograms
    assert info.num_examples.tolist() == [3, 7, 11]
    assert_refused(lambda: Restored(sizes=[4, 0]).info(profiles()),
                   "the checkpoint holds the rows of 2 clients, this run has 3",
                   ConfigError, exact=True)


class Executor:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.loaded: list = []

    def load_state_dict(self, state) -> None:
        self.loaded.append(state)
        if self.error is not None:
            raise self.error


def test_the_executor_gets_its_state_back():
    executor = Executor()
    Restored().restore_executor(executor)
    assert executor.loaded == []
    state = {"momentum": 1}
    Restored(executor=state).restore_executor(executor)
    assert executor.loaded == [state] and executor.loaded[0] is state


@pytest.mark.parametrize("error,shown", [(TypeError("bad type"), "bad type"),
                                         (ValueError("bad value"), "bad value"),
                                         (KeyError("momentum"), "'momentum'"),
                                         (AttributeError("no attr"), "no attr")])
def test_a_state_that_does_not_fit_is_one_line(error, shown):
    with pytest.raises(ConfigError) as caught:
        Restored(executor={"x": 1}).restore_executor(Executor(error))
    assert type(caught.value) is ConfigError
    assert str(caught.value) == (f"the checkpoint's executor state does not fit this run "
                                 f"({shown}); rerun the run from the start")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_another_error_of_the_executor_is_not_hidden():
    with pytest.raises(RuntimeError, match="disk"):
        Restored(executor={"x": 1}).restore_executor(Executor(RuntimeError("disk")))

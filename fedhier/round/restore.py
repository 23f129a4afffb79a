"""What a resumed run takes back from its checkpoint, checked before it is used.

:meth:`fedhier.round.loop.HierarchicalSGD.load_state_dict` reads a checkpoint's state into a
:class:`Restored`; :meth:`~fedhier.round.loop.HierarchicalSGD.setup` then puts it back once the
clients are known. Keys absent from older checkpoints restore nothing (None). No Flower
import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy


@dataclass(frozen=True)
class Restored:
    """A checkpoint's round state.

    Attributes:
        hierarchy: the grouping in force at the checkpoint (a regrouped or gradient-based
            one): setup must not draw a new one.
        clock: the simulated clock's state (None in checkpoints before sim_seconds).
        sizes: the rows learned from replies, by client (None: the profiles' sizes).
        executor: the executor's own ``state_dict()`` (None: a fresh one).
    """

    hierarchy: Hierarchy | None = None
    clock: dict[str, Any] | None = None
    sizes: list[int] | None = None
    executor: dict[str, Any] | None = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Restored:
        """Read a :meth:`~fedhier.round.loop.HierarchicalSGD.state_dict`; TypeError when a part
        has the wrong shape."""
        sizes, executor_state = state.get("num_examples"), state.get("executor")
        if sizes is not None and (not isinstance(sizes, list) or not all(
                type(n) is int and n >= 0 for n in sizes)):
            raise TypeError("num_examples is not a list of row counts >= 0")
        if executor_state is not None and not isinstance(executor_state, dict):
            raise TypeError("the executor state is not a table")
        return cls(state.get("hierarchy"), state.get("clock"), sizes, executor_state)

    def info(self, info: ClientInfo) -> ClientInfo:
        """The clients' profiles with the checkpoint's rows (one-line error on a mismatch)."""
        if self.sizes is None:
            return info
        if len(self.sizes) != len(info.num_examples):
            raise ConfigError(f"the checkpoint holds the rows of {len(self.sizes)} clients, "
                              f"this run has {len(info.num_examples)}")
        return dataclasses.replace(info, num_examples=np.array(self.sizes, dtype=np.int64))

    def restore_executor(self, executor: Any) -> None:
        """Give the executor its checkpointed state (one-line error when it does not fit)."""
        if self.executor is None:
            return
        try:
            executor.load_state_dict(self.executor)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"the checkpoint's executor state does not fit this run "
                              f"({exc}); rerun the run from the start") from None

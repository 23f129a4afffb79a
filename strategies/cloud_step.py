"""The cloud step as a Flower strategy: "hierarchical X" for Flower's strategy X.

``--cloud-strategy average`` (default) is exact H-SGD: the cloud takes the weighted average of
all clients. Any other name, or any ``flwr.serverapp.strategy.Strategy`` instance passed in
code (``HierFedAvg(cloud_strategy=...)``), becomes a :class:`FlowerCloudStep`: at each cloud
step the strategy's ``aggregate_train`` is applied to the cloud's children (the edges'
aggregates), on every engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Strategy,
)
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedhier.clients.wire.array_records import to_record
from fedhier.common.errors import ConfigError
from fedhier.settings.declaration import names_of

#: the cloud steps, as the setting ``cloud_strategy`` declares them
CLOUD_STRATEGIES = names_of("cloud_strategy")


def make_cloud_strategy(name: str, server_lr: float = 0.0,
                        server_momentum: float = 0.0) -> Strategy | None:
    """The Flower strategy applied at the cloud, or None for the plain average.

    ``server_lr`` 0 keeps each strategy's own default (FedAvgM 1.0, FedAdam/FedYogi/FedAdagrad
    eta 0.1); ``server_momentum`` is FedAvgM's momentum.
    """
    common = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 0,
              "fraction_evaluate": 0.0}
    lr = {"eta": server_lr} if server_lr > 0 else {}
    if name == "average":
        return None
    if name == "fedavg":
        return FedAvg(**common)  # type: ignore[arg-type]
    if name == "fedavgm":
        return FedAvgM(**common, server_learning_rate=server_lr or 1.0,  # type: ignore[arg-type]
                       server_momentum=server_momentum)
    optimisers = {"fedadam": FedAdam, "fedyogi": FedYogi, "fedadagrad": FedAdagrad}
    if name in optimisers:
        return optimisers[name](**common, **lr)  # type: ignore[arg-type]
    raise ConfigError(f"unknown cloud strategy '{name}'; choose one of "
                      f"{', '.join(CLOUD_STRATEGIES)}")


def cloud_update(strategy: Strategy, cloud_round: int, children: Mapping[int, ArrayRecord],
                 child_weights: Mapping[int, float]) -> ArrayRecord:
    """The cloud's new model from the wrapped Flower strategy, over the cloud's children.

    Each child of the cloud (an edge, or a top region of a deeper tree) is one reply to
    ``strategy.aggregate_train`` carrying its average model and, as ``num-examples``, the sum
    of its clients' weights.

    Args:
        children: child index -> its average model (children without survivors left out).
        child_weights: child index -> the sum of its surviving clients' weights.
    """
    _ensure_task_identity()
    replies = [
        Message(RecordDict({
            "arrays": children[child],
            "metrics": MetricRecord({"num-examples": float(child_weights[child])})}),
            message_type=MessageType.TRAIN, dst_node_id=child + 1)
        for child in sorted(children)
    ]
    arrays, _ = strategy.aggregate_train(cloud_round, replies)
    if arrays is None:
        raise RuntimeError(f"cloud strategy {type(strategy).__name__} returned no model")
    # Flower's server optimisers (FedAdam, FedYogi, FedAdagrad) compute in float64 numpy;
    # the model keeps its own dtypes (clients cannot train a float32 model on float64 weights).
    dtypes = {k: v.dtype for k, v in children[min(children)].items()}
    if any(v.dtype != dtypes[k] for k, v in arrays.items()):
        state = arrays.to_torch_state_dict()
        arrays = ArrayRecord({k: v.to(_torch_dtype(dtypes[k])) for k, v in state.items()})
    return arrays


class FlowerCloudStep:
    """A Flower strategy as :class:`fedhier.round.loop.CloudStep`: ``configure_train`` at the start
    of each cloud round (server optimisers record the current model), ``aggregate_train``
    over the cloud's children at the cloud step (:func:`cloud_update`)."""

    def __init__(self, strategy: Strategy) -> None:
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"cloud_strategy must be a flwr.serverapp.strategy.Strategy, "
                              f"got {type(strategy).__name__}")
        self.strategy = strategy

    def begin(self, cloud_round: int, global_params: Mapping[str, torch.Tensor],
              num_children: int) -> None:
        _ensure_task_identity()
        self.strategy.configure_train(cloud_round, to_record(global_params), ConfigRecord(),
                                      ChildrenGrid(num_children))

    def step(self, cloud_round: int, children: Mapping[int, Mapping[str, torch.Tensor]],
             child_weights: Mapping[int, float]) -> dict[str, torch.Tensor]:
        records = {child: to_record(params) for child, params in children.items()}
        arrays = cloud_update(self.strategy, cloud_round, records, child_weights)
        return dict(arrays.to_torch_state_dict())


def as_cloud_step(strategy: Any) -> FlowerCloudStep | None:
    """None (the plain average) stays None; a Flower Strategy becomes a FlowerCloudStep."""
    return None if strategy is None else FlowerCloudStep(strategy)


def _ensure_task_identity() -> None:
    """Outside a Flower run (the vectorized engine) a Message cannot be built until a run
    identity is set: give it the SuperLink's, as the in-process grid does."""
    try:
        TaskIdentity.run_id  # noqa: B018 - raises when unset
    except RuntimeError:
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = 1
        TaskIdentity.task_id = 1


def _torch_dtype(numpy_dtype: str) -> torch.dtype:
    """The torch dtype of a Flower Array's numpy dtype string (e.g. '<f4')."""
    return torch.from_numpy(np.zeros(0, dtype=np.dtype(numpy_dtype))).dtype


class ChildrenGrid(Grid):
    """The cloud's children as the nodes of a Grid that sends nothing.

    A cloud strategy's ``configure_train`` records the current model (FedAvgM, FedAdam, ...)
    and samples node ids; engines without messages (``vectorized``) hand it this Grid.
    """

    def __init__(self, num_children: int) -> None:
        self.num_children = num_children

    def get_node_ids(self) -> Iterable[int]:
        return range(1, self.num_children + 1)

    @property
    def run(self) -> Run:
        raise NotImplementedError(NO_MESSAGES)

    def set_run(self, run: Run) -> None:
        raise NotImplementedError(NO_MESSAGES)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        raise NotImplementedError(NO_MESSAGES)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError(NO_MESSAGES)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError(NO_MESSAGES)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        raise NotImplementedError(NO_MESSAGES)


NO_MESSAGES = "ChildrenGrid only lists node ids; it sends no messages"


def _register_checkpoint_types() -> None:
    """Checkpoints (:mod:`fedhier.runs.state_codec`, never pickle) store a cloud step by its
    attributes: allow the classes and the function a FlowerCloudStep holds, and store an
    ArrayRecord (FedAvgM's current arrays) as name -> NumPy array."""
    from flwr.app import Array
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedhier.runs import state_codec

    for obj in (FlowerCloudStep, FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad,
                aggregate_metricrecords):
        state_codec.allow(obj)
    state_codec.former_name("fedhier_strategies.cloud_step:FlowerCloudStep",
                            state_codec._name(FlowerCloudStep))
    state_codec.adapter("flwr.ArrayRecord", ArrayRecord,
                        lambda record: {k: a.numpy() for k, a in record.items()},
                        lambda arrays: ArrayRecord({str(k): Array(v) for k, v in arrays.items()}))


_register_checkpoint_types()

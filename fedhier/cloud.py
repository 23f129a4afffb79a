"""Cloud-side strategies: "hierarchical X" for Flower's strategy X.

``--cloud-strategy average`` (default) is exact H-SGD: the cloud takes the weighted average of
all clients. Any other name wraps the Flower strategy of that name; HierFedAvg then applies
its ``aggregate_train`` to the edges' models at each cloud step (see
:class:`fedhier.strategies.HierFedAvg`, parameter ``cloud_strategy``).
"""

from __future__ import annotations

from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Strategy,
)

from fedhier.errors import ConfigError

CLOUD_STRATEGIES = ("average", "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")


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

"""sklearnhier: the ServerApp, HierFedAvg over the logistic regression's arrays."""

from __future__ import annotations

from fedhier.strategies import HierFedAvg
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from sklearnhier.task import initial_params

app = ServerApp()


def strategy_for(config: dict) -> HierFedAvg:
    """HierFedAvg as the run config says: lbfgs iterations between edge averages
    (local-period) and cloud averages (global-period), edges, the fraction of each edge's
    clients that trains per edge round; the replies' loss keys named."""
    return HierFedAvg(
        local_period=int(config["local-period"]), global_period=int(config["global-period"]),
        num_groups=int(config["num-edges"]), seed=int(config["seed"]),
        fraction_train=float(config["fraction-train"]),
        loss_key="test_logloss",  # the evaluate replies' loss (train_loss in the records)
        train_loss_key="train_logloss")


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = dict(context.run_config)
    strategy_for(config).start(grid, ArrayRecord(initial_params()),
                               num_rounds=int(config["num-server-rounds"]),
                               train_config=ConfigRecord(
                                   {"regularization-c": float(config["regularization-c"])}))

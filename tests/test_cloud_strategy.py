"""Hierarchical X: Flower strategies applied at the cloud step."""

from fedhier.settings.run_config import RunConfig
from tests.helpers import initial_state, max_abs_diff, run_hier

BASE = RunConfig(dataset="digits", clients=8, groups=2, batch_size=8, lr=0.1, seed=2,
                 local_period=2, global_period=4, rounds=1)


def test_flower_fedavg_at_the_cloud_equals_plain_h_sgd():
    plain = run_hier(BASE)
    assert max_abs_diff(plain, run_hier(BASE.replace(cloud_strategy="fedavg"))) <= 1e-6
    neutral = BASE.replace(cloud_strategy="fedavgm", server_lr=1.0, server_momentum=0.0)
    assert max_abs_diff(plain, run_hier(neutral)) <= 1e-6


def test_fedavgm_server_learning_rate_scales_the_cloud_update():
    # One cloud round: FedAvgM(lr=2, momentum 0) gives w0 + 2 * (average - w0).
    w0 = initial_state(BASE)
    average = run_hier(BASE)
    boosted = run_hier(BASE.replace(cloud_strategy="fedavgm", server_lr=2.0))
    expected = {k: w0[k] + 2.0 * (average[k] - w0[k]) for k in w0}
    assert max_abs_diff(boosted, expected) <= 1e-5


def test_fedadam_runs_and_changes_the_model():
    adam = run_hier(BASE.replace(cloud_strategy="fedadam", server_lr=0.01, rounds=2))
    plain = run_hier(BASE.replace(rounds=2))
    assert max_abs_diff(adam, plain) > 1e-4
    assert max_abs_diff(adam, initial_state(BASE)) > 1e-3


def test_a_cloud_step_that_makes_the_model_non_finite_stops_the_run_naming_it():
    import pytest
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from fedhier.clients.app import app as client_app
    from fedhier.engines.inprocess_grid import InProcessGrid
    from fedhier.round.faults import RunFailureError
    from fedhier.strategies.hierfedavg import HierFedAvg

    class Exploding(FedAvg):
        def aggregate_train(self, server_round, replies):
            arrays, metrics = super().aggregate_train(server_round, replies)
            state = arrays.to_torch_state_dict()
            return ArrayRecord({k: v * float("inf") for k, v in state.items()}), metrics

    grid = InProcessGrid(client_app, BASE.clients, seed=BASE.seed)
    strategy = HierFedAvg(BASE.local_period, BASE.global_period, BASE.groups,
                          cloud_strategy=Exploding(min_available_nodes=1, min_train_nodes=1,
                                                   fraction_evaluate=0.0))
    with pytest.raises(RunFailureError, match="cloud step \\(Exploding\\).*cloud round 1"):
        strategy.start(grid, ArrayRecord(initial_state(BASE)), num_rounds=1,
                       train_config=ConfigRecord(BASE.to_run_config()))

"""The round written once (fedhier.round.loop): aggregators, grouping needs, and the message
contract with clients that are not fedhier's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhier.clients import app as fedhier_client
from fedhier.common.errors import ConfigError
from fedhier.data.federation import federation_for
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.local.train import batch_indices, local_sgd
from fedhier.round.aggregators.averaging import (
    AGGREGATORS,
    Aggregator,
    mean_aggregate,
    median_aggregate,
)
from fedhier.round.loop import aggregate_levels
from fedhier.round.reply_policy import ReplyPolicy
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.hierfedavg import HierFedAvg
from fedhier.strategies.replies import ContractError
from fedhier.tree.grouping import grouping_needs
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import initial_state, max_abs_diff, run_hier

CFG = RunConfig(dataset="digits", clients=6, groups=(1,), local_period=2, global_period=4,
                rounds=2, batch_size=8, seed=5)


# ------------------------------------------------------------------------------ aggregators
def test_median_aggregator_closed_form():
    values = torch.tensor([[1.0, -4.0], [5.0, 0.0], [2.0, 8.0], [100.0, 1.0],
                           [3.0, 3.0], [10.0, 2.0]])
    segments = torch.tensor([0, 0, 0, 1, 1, 1])
    out = median_aggregate(values, torch.ones(6, dtype=torch.float64), segments, 2)
    assert out.tolist() == [[2.0, 0.0], [10.0, 2.0]]
    even = median_aggregate(values[:4], torch.ones(4, dtype=torch.float64),
                            torch.zeros(4, dtype=torch.int64), 1)
    assert even.tolist() == [[3.5, 0.5]]  # numpy.median's convention


def test_level_by_level_mean_equals_the_direct_mean(monkeypatch):
    """A non-linear rule runs level by level, each node weighted by its survivors' total
    weight; for the mean that is the direct weighted mean over the subtree's clients."""
    monkeypatch.setitem(AGGREGATORS, "mean-by-level", Aggregator(mean_aggregate, linear=False))
    hierarchy = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 1, 2, 3, 3, 2]), np.array([0, 1, 1, 0])))
    rng = np.random.default_rng(0)
    models = {"w": torch.tensor(rng.normal(size=(6, 3, 2)), dtype=torch.float64)}
    survivors = np.array([0, 2, 3, 4, 6, 7])
    weights = rng.uniform(1, 5, size=8)
    for level in (1, 2, 3):
        direct, nodes = aggregate_levels(models, survivors, weights, hierarchy, level, ("mean",))
        stepped, nodes2 = aggregate_levels(models, survivors, weights, hierarchy, level,
                                           ("mean-by-level",))
        assert nodes.tolist() == nodes2.tolist()
        assert torch.allclose(direct["w"], stepped["w"], rtol=0, atol=1e-12)


def test_unknown_aggregator_is_a_one_line_error():
    with pytest.raises(ConfigError, match="unknown aggregator 'mode'; choose one of mean"):
        RunConfig(aggregators="mode")
    with pytest.raises(ConfigError, match="one name for every level or 2"):
        RunConfig(aggregators="mean,median,mean")


def poisoning_app(partition: int, factor: float) -> ClientApp:
    """fedhier's ClientApp, except that one client multiplies its model by ``factor``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = fedhier_client.train(msg, context)
        if int(context.node_config["partition-id"]) == partition:
            state = reply.content["arrays"].to_torch_state_dict()
            reply.content["arrays"] = ArrayRecord({k: v * factor for k, v in state.items()})
        return reply

    app.evaluate()(fedhier_client.evaluate_local)
    app.query()(fedhier_client.profile)
    return app


def test_median_resists_a_poisoned_client_the_mean_does_not():
    cfg = RunConfig(dataset="digits", clients=9, groups=(3,), local_period=2, global_period=4,
                    rounds=1, batch_size=8, seed=2, grouping="contiguous")
    finals = {}
    for rule in ("mean", "median"):
        grid = InProcessGrid(poisoning_app(partition=0, factor=1e6), cfg.clients, seed=cfg.seed)
        strategy = HierFedAvg(2, 4, 3, grouping="contiguous", seed=cfg.seed,
                              aggregators=(rule,),  # the rules alone: no update check
                              reply_policy=ReplyPolicy(max_update_ratio=0))
        result = strategy.start(grid, ArrayRecord(initial_state(cfg)), num_rounds=1,
                                train_config=ConfigRecord(cfg.to_run_config()))
        finals[rule] = result.arrays.to_torch_state_dict()
    honest = run_hier(cfg.replace(aggregators="median"))
    assert max(float(v.abs().max()) for v in finals["mean"].values()) > 1e3
    assert max_abs_diff(finals["median"], honest) < 0.5  # the poisoned client is outvoted


# ------------------------------------------------------------------------------ groupings
def test_groupings_declare_what_they_need():
    assert grouping_needs("random") == frozenset()
    assert grouping_needs("contiguous") == frozenset()
    assert grouping_needs("min-divergence") == {"labels"}
    assert grouping_needs("max-divergence") == {"labels"}
    assert grouping_needs("edge-tag") == {"edge-tags"}
    assert grouping_needs("gradient") == {"gradients"}


# ------------------------------------------------------------------------------ the contract
def bare_app(reply_fn=None) -> ClientApp:
    """A foreign ClientApp: a train handler only (no query, no evaluate), which runs the same
    local SGD as fedhier's ClientApp and replies with only the model and num-examples."""
    app = ClientApp()
    fed = federation_for(CFG)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        config = msg.content["config"]
        steps, start = int(config["local-steps"]), int(config["start-step"])
        x, y = fed.client_tensors(pid, torch.device("cpu"))
        from fedhier.local.models import build_model

        model = build_model(CFG.model, fed.bundle.input_shape, fed.bundle.num_classes)
        params, _, _ = local_sgd(model, dict(msg.content["arrays"].to_torch_state_dict()), x, y,
                                 lr=CFG.lr, indices=batch_indices(CFG.seed, pid, len(y),
                                                                  CFG.batch_size, start, steps))
        content = RecordDict({"arrays": ArrayRecord({k: v.detach() for k, v in params.items()}),
                              "metrics": MetricRecord({"num-examples": len(y)})})
        if reply_fn is not None:
            content = reply_fn(content, pid)
        return Message(content, reply_to=msg)

    return app


def run_bare(app: ClientApp, grouping: str = "random", records: list | None = None):
    grid = InProcessGrid(app, CFG.clients, seed=CFG.seed)
    strategy = HierFedAvg(CFG.local_period, CFG.global_period, 1, grouping=grouping,
                          seed=CFG.seed)
    result = strategy.start(grid, ArrayRecord(initial_state(CFG)), num_rounds=CFG.rounds,
                            train_config=ConfigRecord({"lr": CFG.lr}),
                            on_cloud_round=records.append if records is not None else None)
    return result.arrays.to_torch_state_dict()


def test_a_client_replying_only_arrays_and_num_examples_runs_exactly():
    """No query, no evaluate, no loss: clients are numbered by node id and weighted by the
    num-examples of their train replies. With one edge the numbering does not matter, so the
    result is fedhier's own ClientApp's (up to the order of float64 summation)."""
    records: list = []
    final = run_bare(bare_app(), records=records)
    assert max_abs_diff(final, run_hier(CFG)) < 1e-6
    assert [r["round"] for r in records] == [0, 1, 2]
    assert "train_loss" not in records[1] and records[1]["local_train_loss"] is None
    assert records[2]["failed_clients"] == 0


def test_label_grouping_without_profiles_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs the clients' label histograms"):
        run_bare(bare_app(), grouping="min-divergence")


def test_a_reply_without_arrays_names_the_client():
    def drop_arrays(content: RecordDict, pid: int) -> RecordDict:
        return RecordDict({"metrics": content["metrics"]}) if pid == 3 else content

    with pytest.raises(ContractError, match=r"client \d \(node \d+\) replied without "
                                            r"ArrayRecord 'arrays'"):
        run_bare(bare_app(drop_arrays))


def test_arrays_of_another_dtype_or_shape_name_the_client_and_the_key():
    def as_float64(content: RecordDict, pid: int) -> RecordDict:
        state = content["arrays"].to_torch_state_dict()
        content["arrays"] = ArrayRecord({k: v.double() for k, v in state.items()})
        return content

    with pytest.raises(ContractError, match=r"client \d \(node \d+\) replied '.*' as "
                                            r"float64 .*, expected the model's float32"):
        run_bare(bare_app(as_float64))

    def transposed(content: RecordDict, pid: int) -> RecordDict:
        state = content["arrays"].to_torch_state_dict()
        content["arrays"] = ArrayRecord({k: v.T.contiguous() if v.dim() == 2 else v
                                         for k, v in state.items()})
        return content

    with pytest.raises(ContractError, match=r"expected the model's float32 \(\d+, \d+\)"):
        run_bare(bare_app(transposed))


def test_a_wrong_key_type_names_the_client_and_the_key():
    def text_count(content: RecordDict, pid: int) -> RecordDict:
        content["metrics"] = MetricRecord({"num-examples": 0.5})
        return content

    with pytest.raises(ContractError, match="'num-examples' = 0.5: it must be a positive"):
        run_bare(bare_app(text_count))


def test_any_flower_strategy_instance_from_another_package_is_the_cloud_step(tmp_path,
                                                                             monkeypatch):
    """A Strategy class from a package that is not fedhier's, passed in code: HierFedAvg
    calls its aggregate_train once per cloud round over the edges' aggregates. FedAvg over
    the edges weighted by their clients' total weight is the plain H-SGD average."""
    package = tmp_path / "mycloud"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from flwr.serverapp.strategy import FedAvg\n\n\n"
        "class CountingFedAvg(FedAvg):\n"
        "    calls = 0\n\n"
        "    def aggregate_train(self, server_round, replies):\n"
        "        replies = list(replies)\n"
        "        CountingFedAvg.calls += 1\n"
        "        CountingFedAvg.children = len(replies)\n"
        "        return super().aggregate_train(server_round, replies)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from mycloud import CountingFedAvg  # type: ignore[import-not-found]

    cfg = RunConfig(dataset="digits", clients=8, groups=(4,), local_period=2, global_period=4,
                    rounds=3, batch_size=8, seed=4)
    grid = InProcessGrid(fedhier_client.app, cfg.clients, seed=cfg.seed)
    cloud = CountingFedAvg(min_available_nodes=1, min_train_nodes=1, min_evaluate_nodes=0,
                           fraction_evaluate=0.0)
    strategy = HierFedAvg(2, 4, 4, seed=cfg.seed, cloud_strategy=cloud)
    result = strategy.start(grid, ArrayRecord(initial_state(cfg)), num_rounds=cfg.rounds,
                            train_config=ConfigRecord(cfg.to_run_config()))
    assert CountingFedAvg.calls == cfg.rounds and CountingFedAvg.children == 4
    assert max_abs_diff(result.arrays.to_torch_state_dict(), run_hier(cfg)) < 1e-6


def test_a_cloud_strategy_that_is_not_a_strategy_is_a_clear_error():
    with pytest.raises(ConfigError, match="cloud_strategy must be a flwr.serverapp.strategy"):
        HierFedAvg(2, 4, 2, cloud_strategy="fedadam")  # type: ignore[arg-type]

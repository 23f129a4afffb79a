"""Foreign ClientApps under HierFedAvg, written from docs/contract.md and the adapter only.

- a second toy app (an MLP on synthetic, non-IID data) built with ``HierClient`` runs
  hierarchically, answers the gradient query (diagnostics) and gives fedhier's own
  ClientApp's numbers on the same data;
- a bare client that replies with only arrays and ``num-examples`` (no train loss, no
  evaluate or query handler) runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhier.clients.adapter import HierClient, batch_stream, round_info
from fedhier.clients.app import app as fedhier_client_app
from fedhier.data.bundle import bundle_from_arrays
from fedhier.data.federation import Federation
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.local.models import build_model
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.central_eval import central_evaluate
from fedhier.strategies.hierfedavg import HierFedAvg

NUM_CLIENTS, FEATURES, CLASSES = 6, 12, 3
LR, BATCH, SEED = 0.2, 8, 3


# ---------------------------------------------------------------- the toy app (user code)
class TinyMLP(nn.Module):
    """The user's model: Linear -> ReLU -> Linear (named like fedhier's `mlp`)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 128)
        self.out = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


_TRUE = torch.Generator().manual_seed(0)
TRUE_W = torch.randn(FEATURES, CLASSES, generator=_TRUE)


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's data: client j's features are shifted by j (non-IID), labels from a
    shared linear rule."""
    g = torch.Generator().manual_seed(100 + partition_id)
    x = torch.randn(40 + 5 * partition_id, FEATURES, generator=g) + 0.3 * partition_id
    return x, (x @ TRUE_W).argmax(1)


def load_test_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(300, FEATURES, generator=torch.Generator().manual_seed(7)) + 0.75
    return x, (x @ TRUE_W).argmax(1)


def train_fn(model: nn.Module, batches, steps: int, lr: float) -> float:
    """The user's own plain SGD loop over the batches the adapter hands it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    total = 0.0
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / steps


toy_app = HierClient(TinyMLP, load_data, train_fn, num_classes=CLASSES, batch_size=BATCH,
                     seed=SEED).register(ClientApp())


# ---------------------------------------------------------------- the runs
def run(client_app: ClientApp, train_config: dict[str, Any], initial: ArrayRecord,
        rounds: int = 3, diagnostics_every: int = 1,
        grouping: str = "random") -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    records: list[dict[str, Any]] = []
    grid = InProcessGrid(client_app, NUM_CLIENTS, seed=SEED)
    strategy = HierFedAvg(local_period=2, global_period=6, num_groups=2, grouping=grouping,
                          seed=SEED, diagnostics_every=diagnostics_every)
    result = strategy.start(grid, initial, num_rounds=rounds,
                            train_config=ConfigRecord(train_config),
                            evaluate_fn=central_evaluate(TinyMLP, load_test_data),
                            on_cloud_round=records.append)
    return result.arrays.to_torch_state_dict(), records


def initial_arrays() -> ArrayRecord:
    torch.manual_seed(SEED)
    return ArrayRecord(TinyMLP().state_dict())


@pytest.fixture(scope="module")
def toy_run(one_torch_thread):
    return run(toy_app, {"lr": LR}, initial_arrays())


def test_toy_app_runs_hierarchically_with_diagnostics(toy_run):
    _, records = toy_run
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(r["failed_clients"] == 0 for r in records)
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[-1]["local_train_loss"] is not None
    for record in records:  # the gradient query answered: divergences and diversity
        assert math.isclose(record["global_divergence"], record["upward_divergence"]
                            + record["downward_divergence"], rel_tol=1e-4)
        assert record["client_gradient_diversity"] > 0


def test_toy_app_label_grouping_uses_its_profile(one_torch_thread):
    """The profile query (label histograms) feeds a label-based grouping."""
    _, records = run(toy_app, {"lr": LR}, initial_arrays(), rounds=1, diagnostics_every=0,
                     grouping="min-divergence")
    assert records[-1]["failed_clients"] == 0


def test_toy_app_equals_fedhier_client_app(toy_run, monkeypatch, one_torch_thread):
    """The HierClient-converted app and fedhier's own ClientApp (model `mlp`, the same data,
    seed and batch size): same models, losses and diagnostics."""
    xs, ys = zip(*(load_data(j, NUM_CLIENTS) for j in range(NUM_CLIENTS)), strict=True)
    x_test, y_test = load_test_data()
    bundle = bundle_from_arrays(
        name="toy", train=(torch.cat(xs).numpy(), torch.cat(ys).numpy(), None),
        test=(x_test.numpy(), y_test.numpy()), input_shape=(FEATURES,), num_classes=CLASSES,
        source="tests/test_foreign_app.py", fingerprint_key="toy-foreign-app")
    bounds = np.cumsum([0] + [len(y) for y in ys])
    fed = Federation(bundle=bundle, partitions=[np.arange(bounds[j], bounds[j + 1])
                                                for j in range(NUM_CLIENTS)])
    monkeypatch.setattr("fedhier.clients.app.federation_for", lambda cfg: fed)
    assert build_model("mlp", (FEATURES,), CLASSES).state_dict().keys() == \
        TinyMLP().state_dict().keys()
    cfg = RunConfig(dataset="synthetic", model="mlp", clients=NUM_CLIENTS, groups=2,
                    local_period=2, global_period=6, rounds=3, batch_size=BATCH, lr=LR,
                    seed=SEED, diagnostics_every=1)
    ours, ours_records = run(fedhier_client_app, cfg.to_run_config(), initial_arrays())
    theirs, their_records = toy_run
    diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    print(f"max |w_fedhier - w_toy| = {diff:.3g}")
    assert diff < 1e-5
    for mine, other in zip(ours_records, their_records, strict=True):
        for key in ("test_loss", "test_accuracy", "train_loss", "train_accuracy",
                    "global_divergence", "upward_divergence", "downward_divergence",
                    "client_gradient_diversity"):
            assert math.isclose(mine[key], other[key], rel_tol=1e-4, abs_tol=1e-6), key
        if mine["round"] > 0:
            assert abs(mine["local_train_loss"] - other["local_train_loss"]) < 1e-5


# ---------------------------------------------------------------- the bare client
bare_app = ClientApp()


@bare_app.train()
def bare_train(msg: Message, context: Context) -> Message:
    """Only what the contract requires: the trained arrays and num-examples."""
    model = TinyMLP()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_data(int(context.node_config["partition-id"]), NUM_CLIENTS)
    train_fn(model, batch_stream(msg, context, data, BATCH, seed=SEED),
             round_info(msg).local_steps, float(msg.content["config"]["lr"]))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(data[1])})}),
                   reply_to=msg)


def test_bare_client_runs(one_torch_thread, caplog):
    final, records = run(bare_app, {"lr": LR}, initial_arrays(), rounds=2, diagnostics_every=1)
    assert all(r["failed_clients"] == 0 for r in records)
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert "train_loss" not in records[-1]  # no evaluate handler
    assert "global_divergence" not in records[-1]
    assert "gradient" in caplog.text  # the diagnostics say they need gradients


def test_from_settings_keeps_every_setting():
    """HierFedAvg's constructor lists each setting again: a setting added to HSGDSettings but
    not passed through from_settings would silently take its default."""
    import dataclasses

    from fedhier.round.asynchrony.settings import AsyncEdges
    from fedhier.round.clock import TimeModel
    from fedhier.round.loop import HSGDSettings
    from fedhier.round.participants import Workload
    from fedhier.round.reply_policy import ReplyPolicy
    from fedhier.strategies import HierFedAvg
    from fedhier.tree.mobility import Mobility

    changed = HSGDSettings(
        periods=(2, 8), groups=(2,), grouping="contiguous", weighting="uniform", seed=5,
        workload=Workload(participation=0.5), min_clients_per_edge=1, on_nan="skip-client",
        diagnostics_every=2, regroup_every=3, aggregators=("median",),
        mobility=Mobility(rate=0.1), time_model=TimeModel(step_seconds=0.5),
        asynchronous=AsyncEdges(0, 2), edge_periods=(2, 8),
        policy=ReplyPolicy("drop", exclude_after=2, max_weight_ratio=5.0), quantize_bits=4,
        metrics_aggregator="median")
    default = HSGDSettings(periods=(2, 8), groups=(2,))
    assert all(getattr(changed, f.name) != getattr(default, f.name)
               for f in dataclasses.fields(HSGDSettings) if f.name not in ("periods", "groups"))
    assert HierFedAvg.from_settings(changed).settings == changed

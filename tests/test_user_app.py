"""A Flower user's own app under HierFedAvg (issue 28): the right weights, a quiet log, a
failed run called failed.

- weights: a client's weight is the rows its train reply reports, every round (exact
  weighted means with counts that change per edge round); evaluation means are weighted by
  the evaluate reply's rows;
- a quickstart-shaped app (its own train/evaluate, a validation split, no profile handler)
  gives fedhier's own ClientApp's models on the same training rows (1e-6), logs one line per
  cloud round, and no traceback of Flower's for the missing profile handler;
- an app whose every client fails stops the run with one line (exit code 3).
"""

from __future__ import annotations

import logging
import re
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedhier.cli.commands import main as cli_main
from fedhier.cli.flags import exit_code_for
from fedhier.clients.adapter import batch_stream, register_profile
from fedhier.clients.app import app as fedhier_client_app
from fedhier.data.bundle import bundle_from_arrays
from fedhier.data.federation import Federation
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.local.models import build_model
from fedhier.round.faults import RunFailureError
from fedhier.runs.prepare import prepare
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.central_eval import central_evaluate
from fedhier.strategies.flower_log import HeldFlowerLog
from fedhier.strategies.hierfedavg import HierFedAvg

NUM_CLIENTS, FEATURES, CLASSES = 6, 12, 3
LR, BATCH, SEED, ROUNDS = 0.2, 8, 3, 2
_TRUE_W = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))


class TinyMLP(nn.Module):
    """The user's model, named like fedhier's `mlp`."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 128)
        self.out = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def client_rows(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client j's rows: 40 + 5j, non-IID (shifted by j)."""
    g = torch.Generator().manual_seed(100 + partition_id)
    x = torch.randn(40 + 5 * partition_id, FEATURES, generator=g) + 0.3 * partition_id
    return x, (x @ _TRUE_W).argmax(1)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Quickstart-shaped: (trainloader, valloader), the last quarter of the rows held out."""
    x, y = client_rows(partition_id)
    cut = len(y) * 3 // 4
    return (DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=batch_size))


def central_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(200, FEATURES, generator=torch.Generator().manual_seed(7)) + 0.75
    return x, (x @ _TRUE_W).argmax(1)


# ---------------------------------------------------------------- the user's app
user_app = ClientApp()  # no profile query handler


@user_app.train()
def user_train(msg: Message, context: Context) -> Message:
    model = TinyMLP()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(context.node_config["partition-id"],
                               context.node_config["num-partitions"],
                               context.run_config["batch-size"])
    trainloader = batch_stream(msg, context, trainloader)
    optimizer = torch.optim.SGD(model.parameters(), lr=msg.content["config"]["lr"])
    total = 0.0
    for x, y in trainloader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    metrics = {"train_loss": total / len(trainloader), "num-examples": len(trainloader.dataset)}
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord(metrics)}), reply_to=msg)


@user_app.evaluate()
def user_evaluate(msg: Message, context: Context) -> Message:
    model = TinyMLP()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valloader = load_data(context.node_config["partition-id"],
                             context.node_config["num-partitions"],
                             context.run_config["batch-size"])
    x, y = valloader.dataset.tensors
    with torch.no_grad():
        out = model(x)
    metrics = {"eval_loss": float(nn.functional.cross_entropy(out, y)),
               "eval_acc": float((out.argmax(1) == y).float().mean()),
               "num-examples": len(y)}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


class LoggingGrid(InProcessGrid):
    """The in-process grid, logging a ClientApp's exception as Flower's Simulation Engine
    does (``flwr.server.superlink.fleet.vce.vce_api.worker``: the error and its traceback on
    the ``flwr`` logger, in the process that runs the ServerApp)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        client_app = self.client_app

        def logged(msg: Message, context: Context) -> Message:
            try:
                return client_app(msg, context)
            except Exception as exc:
                logging.getLogger("flwr").error(exc)
                logging.getLogger("flwr").error(traceback.format_exc())
                raise

        self.client_app = logged  # type: ignore[assignment]


def in_partition_order(grid: InProcessGrid) -> InProcessGrid:
    """Give the nodes partition ids in node-id order: clients without a profile handler are
    numbered by node id, so they then get the numbers fedhier's own clients have."""
    for pid, node in enumerate(sorted(grid.contexts)):
        grid.contexts[node].node_config["partition-id"] = pid
    return grid


def run(grid: InProcessGrid, train_config: dict[str, Any], **strategy: Any,
        ) -> tuple[HierFedAvg, dict[str, torch.Tensor], list[dict[str, Any]]]:
    torch.manual_seed(SEED)
    initial = ArrayRecord(TinyMLP().state_dict())
    records: list[dict[str, Any]] = []
    hier = HierFedAvg(local_period=2, global_period=4, num_groups=2, seed=SEED, **strategy)
    result = hier.start(grid, initial, num_rounds=ROUNDS, train_config=ConfigRecord(train_config),
                        evaluate_fn=central_evaluate(TinyMLP, central_data()),
                        on_cloud_round=records.append)
    return hier, result.arrays.to_torch_state_dict(), records


@pytest.fixture(scope="module")
def user_run(one_torch_thread):
    """The user's app on 6 nodes (in node-id order), with Flower's and fedhier's log."""
    flower, fedhier = logging.getLogger("flwr"), logging.getLogger("fedhier")
    flower_log, fedhier_log, level = _Capture(), _Capture(), flower.level
    flower.addHandler(flower_log)
    fedhier.addHandler(fedhier_log)
    flower.setLevel(logging.INFO)  # fedhier's own runs set WARNING (quiet_flower)
    try:
        grid = in_partition_order(LoggingGrid(user_app, NUM_CLIENTS, seed=SEED,
                                              run_config={"batch-size": BATCH, "seed": SEED}))
        out = run(grid, {"lr": LR}, fraction_evaluate=0.5)
    finally:
        flower.removeHandler(flower_log)
        fedhier.removeHandler(fedhier_log)
        flower.setLevel(level)
    return (*out, flower_log.lines, fedhier_log.lines)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def training_rows() -> list[int]:
    return [len(load_data(j, NUM_CLIENTS, BATCH)[0].dataset) for j in range(NUM_CLIENTS)]


def test_user_app_is_weighted_by_its_training_rows(user_run):
    hier, _, records, _, _ = user_run
    assert hier.client_weights().tolist() == training_rows()  # not the validation rows
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    assert all(r["failed_clients"] == 0 for r in records)


def test_user_app_log_is_quiet_and_one_line_per_cloud_round(user_run):
    _, _, _, flower_lines, fedhier_lines = user_run
    text = "\n".join(flower_lines)
    assert "Traceback" not in text and "No query function" not in text, text
    rounds = [line for line in flower_lines if line.startswith("[CLOUD ROUND")]
    assert [re.match(r"\[CLOUD ROUND (\d+)/2\]", line).group(1) for line in rounds] == \
        ["0", "1", "2"]
    assert all("edge rounds" in line and "MB sent" in line and "clients: loss" in line
               and "evaluate_fn: test-loss" in line for line in rounds), rounds
    assert sum("fraction_evaluate=0.5 is not used" in line for line in flower_lines) == 1
    assert sum("no profile query handler" in line for line in fedhier_lines) == 1


def test_user_app_equals_fedhier_client_app(user_run, monkeypatch):
    """fedhier's own ClientApp on the user's training rows (its profile weights them by
    those rows): the same models and central metrics."""
    _, theirs, their_records, _, _ = user_run
    parts = [load_data(j, NUM_CLIENTS, BATCH)[0].dataset.tensors for j in range(NUM_CLIENTS)]
    x_test, y_test = central_data()
    bundle = bundle_from_arrays(
        name="user-app", train=(torch.cat([p[0] for p in parts]).numpy(),
                                torch.cat([p[1] for p in parts]).numpy(), None),
        test=(x_test.numpy(), y_test.numpy()), input_shape=(FEATURES,), num_classes=CLASSES,
        source="tests/test_user_app.py", fingerprint_key="user-app-weights")
    bounds = np.cumsum([0] + training_rows())
    fed = Federation(bundle=bundle, partitions=[np.arange(bounds[j], bounds[j + 1])
                                                for j in range(NUM_CLIENTS)])
    monkeypatch.setattr("fedhier.clients.app.federation_for", lambda cfg: fed)
    cfg = RunConfig(dataset="synthetic", model="mlp", clients=NUM_CLIENTS, groups=2,
                    local_period=2, global_period=4, rounds=ROUNDS, batch_size=BATCH, lr=LR,
                    seed=SEED)
    _, ours, our_records = run(InProcessGrid(fedhier_client_app, NUM_CLIENTS, seed=SEED),
                               cfg.to_run_config())
    diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    print(f"max |w_fedhier - w_user| = {diff:.3g}")
    assert diff < 1e-6
    for mine, other in zip(our_records, their_records, strict=True):
        assert abs(mine["test_loss"] - other["test_loss"]) < 1e-6


def test_held_flower_log_lets_through_all_but_an_expected_error():
    flower, capture = logging.getLogger("flwr"), _Capture()
    flower.addHandler(capture)
    try:
        with HeldFlowerLog() as dropped:
            flower.error("ValueError: No query function registered with name 'default'")
            flower.warning("kept")
        with HeldFlowerLog() as released:
            flower.error("an error of another kind")
        assert capture.lines == []  # held until told
        dropped.drop_errors()
        released.release()
    finally:
        flower.removeHandler(capture)
    assert capture.lines == ["kept", "an error of another kind"]


# ---------------------------------------------------------------- exact weights
def counting_app() -> ClientApp:
    """A ClientApp whose client j replies the constant model v_j = j + 1 with
    n_j = 10 (j + 1) + edge round training rows (its data change size every edge round),
    and evaluates on 1 + 3 j rows of its own."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        arrays = {k: torch.full_like(v, pid + 1.0)
                  for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        rows = 10 * (pid + 1) + int(msg.content["config"]["edge-round"])
        return Message(RecordDict({"arrays": ArrayRecord(arrays),
                                   "metrics": MetricRecord({"num-examples": rows})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord(
            {"loss": float(pid), "accuracy": pid / 10, "num-examples": 1 + 3 * pid})}),
            reply_to=msg)

    return app


@pytest.mark.parametrize("profile", [False, True])
def test_weights_are_each_rounds_train_rows_and_evaluation_the_evaluate_rows(profile):
    """The global model after cloud round r is sum n_j v_j / sum n_j with the rows of the
    round's last edge round (exact); train_loss is weighted by the evaluate rows."""
    app = counting_app()
    if profile:  # a profile that claims other rows: the train replies still decide
        register_profile(app, lambda pid, n: torch.zeros(500, dtype=torch.long), 1)
    records: list[dict[str, Any]] = []
    hier = HierFedAvg(local_period=1, global_period=2, num_groups=2, seed=SEED)
    initial = ArrayRecord({"w": torch.zeros(3)})
    result = hier.start(InProcessGrid(app, 4, seed=SEED), initial, num_rounds=2,
                        on_cloud_round=records.append)
    pids = np.arange(4)
    last_edge_round = 4  # cloud round 2 = edge rounds 3, 4
    n = 10 * (pids + 1) + last_edge_round
    expected = float(np.dot(n, pids + 1) / n.sum())
    assert torch.allclose(result.arrays.to_torch_state_dict()["w"],
                          torch.full((3,), expected, dtype=torch.float32), atol=1e-6)
    assert sorted(hier.client_weights().tolist()) == sorted(n.astype(float).tolist())
    e = 1 + 3 * pids
    assert records[-1]["train_loss"] == pytest.approx(float(np.dot(e, pids) / e.sum()),
                                                      rel=1e-12)


# ---------------------------------------------------------------- every client fails
failing_app = ClientApp()


@failing_app.train()
def failing_train(msg: Message, context: Context) -> Message:
    return msg.content["config"]["learning_rate"]  # KeyError: the config says "lr"


def test_every_client_failing_stops_the_run_with_one_line(one_torch_thread, caplog):
    grid = InProcessGrid(failing_app, 4, seed=SEED)
    hier = HierFedAvg(local_period=1, global_period=2, num_groups=2, seed=SEED)
    with caplog.at_level(logging.WARNING, logger="fedhier"), \
            pytest.raises(RunFailureError) as caught:
        hier.start(grid, ArrayRecord({"w": torch.zeros(3)}), num_rounds=2,
                   train_config=ConfigRecord({"lr": 0.1}))
    # No per-client failure lines: the one line says it.
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(r"no client trained in cloud round 1 \(8 error replies\); the first: "
                        r"client \d \(node \d+\): KeyError: 'learning_rate'", message), message
    assert exit_code_for(caught.value) == 3


def test_injected_faults_keep_running(one_torch_thread):
    """fedhier's fault model (every client away in round 1) is no run failure."""
    cfg = RunConfig(dataset="synthetic", model="logreg", clients=4, groups=2, local_period=1,
                    global_period=2, rounds=1, dropout_fraction=1.0, dropout_rounds="1",
                    seed=SEED)
    grid = InProcessGrid(fedhier_client_app, 4, seed=SEED)
    hier = HierFedAvg(local_period=1, global_period=2, num_groups=2, seed=SEED)
    fed = prepare(cfg)
    model = build_model("logreg", fed.bundle.input_shape, fed.bundle.num_classes)
    records: list[dict[str, Any]] = []
    hier.start(grid, ArrayRecord(model.state_dict()), num_rounds=1,
               train_config=ConfigRecord(cfg.to_run_config()), on_cloud_round=records.append)
    assert records[-1]["failed_clients"] == 8


def test_cli_run_where_every_client_fails_exits_3(one_torch_thread, monkeypatch, tmp_path,
                                                  capsys):
    """fedhier's own ClientApp failing in every client (a bug): exit 3, one line on stderr."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("learning_rate")

    monkeypatch.setattr("fedhier.clients.app.local_sgd", broken)
    code = cli_main(["run", "--dataset", "synthetic", "--model", "logreg", "--clients", "4",
                     "--groups", "2", "--local-period", "1", "--global-period", "2",
                     "--rounds", "1", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 3
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fedhier: run stopped: no client trained in cloud round 1 (8 error "
                          "replies); the first: client "), err
    assert "KeyError: 'learning_rate'" in err and "removed" in err


# ---------------------------------------------------------------- register_profile
def test_register_profile_takes_the_quickstart_loader_as_it_is():
    """``load_data(partition_id, num_partitions, batch_size)`` returning (train, val)
    loaders, and a DataLoader itself: the profile counts the training rows."""
    for data in (load_data, load_data(2, NUM_CLIENTS, 4)[0]):
        app = ClientApp()
        register_profile(app, data, num_classes=CLASSES)
        grid = InProcessGrid(app, NUM_CLIENTS, run_config={"batch-size": 4})
        node = next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 2)
        [reply] = grid.send_and_receive([Message(RecordDict({"config": ConfigRecord()}),
                                                 message_type="query", dst_node_id=node)])
        assert not reply.has_error(), reply.error.reason
        metrics = reply.content["metrics"]
        y = client_rows(2)[1][: len(client_rows(2)[1]) * 3 // 4]
        assert metrics["num-examples"] == len(y) == training_rows()[2]
        assert metrics["label-histogram"] == np.bincount(y.numpy(), minlength=CLASSES).tolist()


# ---------------------------------------------------------------- the documented conversion
def test_contract_shows_the_whole_conversion_in_at_most_10_lines():
    """docs/contract.md's diff: the example's conversion.diff (ClientApp, ServerApp) and the
    pyproject.toml dependency, at most 10 changed lines in all."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "contract.md").read_text()
    section = doc.split("## Converting Flower's quickstart", 1)[1]
    block = section.split("```diff\n", 1)[1].split("```", 1)[0]
    conversion = (root / "examples" / "quickstart-hier" / "conversion.diff").read_text()
    assert block.startswith(conversion)
    changed = [line for line in block.splitlines()
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len(changed) <= 10, changed
    assert f"**{len(changed)} changed\nlines**" in section
    assert any('"fedhier"' in line for line in changed)

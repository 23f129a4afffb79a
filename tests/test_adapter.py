"""fedhier.clients.adapter and fedhier.strategies.central_eval, piece by piece."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from fedhier.clients.adapter import (
    batch_stream,
    canonical_metrics,
    labels_of,
    register_profile,
    round_info,
)
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.local.train import batch_indices
from fedhier.strategies.central_eval import central_evaluate


def _identity() -> None:
    """Messages can only be built with a run identity: the in-process grid sets one."""
    InProcessGrid(ClientApp(), 1)


def train_message(steps: int = 3, start: int = 6, **extra) -> Message:
    _identity()
    config = ConfigRecord({"local-steps": steps, "start-step": start, "edge-round": 3,
                           "server-round": 2, "lr": 0.1, **extra})
    return Message(RecordDict({"config": config}), message_type=MessageType.TRAIN,
                   dst_node_id=5)


def context(pid: int = 2, **run_config) -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": pid, "num-partitions": 4},
                   state=RecordDict(), run_config=run_config)


def test_round_info_reads_the_contract_keys():
    info = round_info(train_message())
    assert (info.local_steps, info.start_step, info.edge_round, info.server_round) == (3, 6, 3, 2)
    assert info.get("lr") == 0.1
    _identity()
    with pytest.raises(KeyError, match="local-steps"):
        round_info(Message(RecordDict({"config": ConfigRecord({"lr": 0.1})}),
                           message_type=MessageType.TRAIN, dst_node_id=5))


def test_batch_stream_over_tensors_is_fedhiers_order():
    x, y = torch.arange(50.0).reshape(25, 2), torch.arange(25)
    stream = batch_stream(train_message(), context(seed=4), (x, y), 4)
    expected = batch_indices(4, 2, 25, 4, 6, 3)
    assert len(stream) == 3 and len(stream.dataset) == 25 and stream.batch_size == 4
    for (bx, by), rows in zip(stream, expected, strict=True):
        assert torch.equal(by, torch.as_tensor(rows)) and torch.equal(bx, x[rows])
    with pytest.raises(RuntimeError, match="one pass"):
        next(iter(stream))  # local-steps steps, not more
    # the message's seed wins over the run config's; an explicit seed over both
    assert np.array_equal(batch_stream(train_message(seed=9), context(seed=4), (x, y),
                                       4).indices, batch_indices(9, 2, 25, 4, 6, 3))
    assert np.array_equal(batch_stream(train_message(seed=9), context(), (x, y), 4,
                                       seed=1).indices, batch_indices(1, 2, 25, 4, 6, 3))


def test_batch_stream_over_a_dataloader_collates_like_it():
    ds = datasets.Dataset.from_dict({"image": np.arange(40, dtype=np.float32).reshape(20, 2),
                                     "label": np.arange(20)}).with_format("torch")
    loader = DataLoader(ds, batch_size=5, shuffle=True)
    stream = batch_stream(train_message(steps=2, start=0), context(), loader)
    expected = batch_indices(0, 2, 20, 5, 0, 2)
    batches = list(stream)
    assert len(batches) == 2 and len(stream.dataset) == 20
    for batch, rows in zip(batches, expected, strict=True):
        assert torch.equal(batch["label"], torch.as_tensor(rows))
        assert batch["image"].shape == (5, 2)


def test_labels_of_reads_common_containers():
    y = np.array([0, 2, 2, 1])
    ds = datasets.Dataset.from_dict({"x": [[0.0]] * 4, "label": y})
    for data in (y, torch.as_tensor(y), (torch.zeros(4, 1), torch.as_tensor(y)), ds,
                 DataLoader(ds, batch_size=2),
                 torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.as_tensor(y))):
        assert labels_of(data).tolist() == y.tolist()


def test_profile_and_canonical_metrics_through_a_client_app():
    app = ClientApp(mods=[canonical_metrics])
    register_profile(app, lambda pid, n: np.array([pid, 1, 1]), num_classes=4)

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord(
            {"num-examples": 3, "train_loss": 0.5})}), reply_to=msg)

    grid = InProcessGrid(app, 3)
    node = list(grid.get_node_ids())[2]
    query = Message(RecordDict({"config": ConfigRecord()}), message_type=MessageType.QUERY,
                    dst_node_id=node)
    (reply,) = grid.send_and_receive([query])
    metrics = reply.content["metrics"]
    assert metrics["partition-id"] == 2 and metrics["num-examples"] == 3
    assert list(metrics["label-histogram"]) == [0, 2, 1, 0] and metrics["edge-tag"] == -1
    content = RecordDict({"arrays": ArrayRecord({"w": torch.zeros(1)}),
                          "config": ConfigRecord({"local-steps": 1})})
    (reply,) = grid.send_and_receive([Message(content, message_type=MessageType.TRAIN,
                                              dst_node_id=node)])
    assert reply.content["metrics"]["train-loss"] == 0.5
    assert reply.content["metrics"]["train_loss"] == 0.5


def test_central_evaluate_loads_once_and_reports_test_keys():
    calls = []
    x, y = torch.randn(30, 3), torch.randint(0, 2, (30,))

    def load():
        calls.append(1)
        return x, y

    model = torch.nn.Linear(3, 2)
    arrays = ArrayRecord(model.state_dict())
    evaluate = central_evaluate(lambda: torch.nn.Linear(3, 2), load)
    first, second = evaluate(0, arrays), evaluate(1, arrays)
    assert len(calls) == 1 and dict(first) == dict(second)
    with torch.no_grad():
        logits = model(x)
    assert abs(first["test-loss"] - float(torch.nn.functional.cross_entropy(logits, y))) < 1e-6
    assert first["test-accuracy"] == int((logits.argmax(1) == y).sum()) / 30
    own = central_evaluate(lambda: torch.nn.Linear(3, 2), (x, y), lambda m, d: (1.0, 0.5),
                           prefix="central-")
    assert dict(own(0, arrays)) == {"central-loss": 1.0, "central-accuracy": 0.5}

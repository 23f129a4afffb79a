"""A model as one object of a Flower message (clients/wire/packed_model.py): the blob's round
trip is bit-exact in dtypes, shapes, names and order; malformed blobs are refused; only
fedhier's own ends send it (an edge server to fedhier's ClientApp, cloud <-> edge), while a
client that does not announce it gets Flower's ArrayRecord; and either way the edge tier's
run is the same run."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedhier.clients.app import app as client_app
from fedhier.clients.wire import packed_model as pm
from fedhier.engines.deployment.placement import client_placement
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.local.models import build_model
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.server import EdgeServer
from fedhier.strategies.replies import ContractError, read_train_reply
from tests.helpers import assert_same_run
from tests.test_edge_tier import EdgeServersApp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def test_round_trip_is_bit_exact_in_dtypes_shapes_names_and_order():
    g = torch.Generator().manual_seed(0)
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    tensors = {
        "z.weight": torch.randn(3, 5, generator=g),
        "a/bias": torch.randn(7, generator=g, dtype=torch.float64),
        "half": torch.randn(2, 2, generator=g).half(),
        "transposed": torch.randn(4, 3, generator=g).T,  # not contiguous
        "steps": torch.tensor(123456789012, dtype=torch.int64),  # 0-d
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(250, 256, dtype=torch.uint8),
        "small": torch.tensor([-3, 4], dtype=torch.int8),
        "c": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64),
        "empty": torch.zeros(0, 4),
        "nan-payloads": nan,
        "ünïcode name": torch.ones(1, 1, 1, dtype=torch.int32),
    }
    blob = pm.pack(tensors)
    assert blob is not None and blob.startswith(pm.MAGIC)
    back = pm.unpack(blob)
    assert list(back) == list(tensors)  # the names, in order
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        assert _bits(back[name]) == _bits(value), name
    # the data are the tensors' bytes, C order, after the header: nothing else
    header = len(pm.MAGIC) + 4 + struct.unpack_from("<I", blob, len(pm.MAGIC))[0]
    assert len(blob) - header == sum(v.numel() * v.element_size() for v in tensors.values())
    # fresh tensors: writing one changes neither the blob nor a second decode
    back["z.weight"].add_(1)
    assert torch.equal(pm.unpack(blob)["z.weight"], tensors["z.weight"])


def test_records_fall_back_to_flowers_arrayrecord():
    model = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert isinstance(pm.model_record(model, packed=False), ArrayRecord)
    assert isinstance(pm.model_record(model, packed=True), ConfigRecord)
    # a dtype outside PACKABLE, or a blob over Flower's one-request chunk size
    assert isinstance(pm.model_record({"w": torch.ones(3, dtype=torch.uint16)}, True),
                      ArrayRecord)
    big = {"w": torch.zeros(pm.MAX_PACKED_BYTES // 4)}
    assert pm.pack(big) is None and isinstance(pm.model_record(big, True), ArrayRecord)
    # either form reads back the same tensors
    for packed in (False, True):
        content = RecordDict({"arrays": pm.model_record(model, packed)})
        assert pm.has_model(content, "arrays") and pm.is_packed(content, "arrays") == packed
        got = pm.get_model(content, "arrays")
        assert all(torch.equal(got[k], model[k]) for k in model)
    assert not pm.has_model(RecordDict({"config": ConfigRecord({"lr": 0.1})}), "config")


def test_the_default_mlp_message_has_4_objects_instead_of_12():
    """Flower moves one request per object per hop: a train message of the default MLP (4
    tensors) is Message + RecordDict + ConfigRecord + model record (+ 4 Arrays and 4
    ArrayChunks when not packed)."""
    model = build_model("mlp", (1, 8, 8), 10).state_dict()
    counts = {}
    for packed in (False, True):
        content = RecordDict({"arrays": pm.model_record(model, packed),
                              "config": ConfigRecord({"lr": 0.1})})
        counts[packed] = 1 + len(get_all_nested_objects(content))  # + the Message
    assert counts == {False: 12, True: 4}


def _blob(layout, data: bytes) -> bytes:
    text = json.dumps(layout).encode()
    return pm.MAGIC + struct.pack("<I", len(text)) + text + data


@pytest.mark.parametrize("blob, says", [
    (b"\x93NUMPY", "magic"),
    (pm.MAGIC + b"\x01", "cut short in its header"),
    (_blob([["w", "<f4", [2]]], b"\0" * 4), "cut short in 'w'"),
    (_blob([["w", "<f4", [1]]], b"\0" * 5), "1 bytes after"),
    (_blob([["w", "|O", [1]]], b"\0" * 8), "bad header"),
    (_blob([["w", "<f4", [-1]]], b""), "shape that is not whole numbers"),
    (_blob([["w", "<f4", [1.5]]], b"\0" * 4), "shape that is not whole numbers"),
    # 2**62 x 4 elements: their count overflows an int64 product to 0
    (_blob([["w", "<f4", [4611686018427387904, 4]]], b""), "cut short in 'w'"),
    (pm.MAGIC + struct.pack("<I", 2**31) + b"[]", "cut short in its header"),
    (_blob([["w", "<f4", [1]], ["w", "<f4", [1]]], b"\0" * 8), "repeated name"),
    (_blob({"w": 1}, b""), "bad header"),
    (pm.MAGIC + struct.pack("<I", 2) + b"\xff\xfe", "bad header"),
])
def test_malformed_blobs_are_refused(blob, says):
    with pytest.raises(pm.PackedModelError, match=says):
        pm.unpack(blob)


class Spy(InProcessGrid):
    """An edge's grid that keeps the messages it sends and the replies it gets."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += messages
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.replies += replies
        return replies


def foreign(msg: Message, context) -> Message:
    """fedhier's ClientApp whose profile reply does not say it reads packed models."""
    reply = client_app(msg, context)
    if msg.metadata.message_type == MessageType.QUERY:
        del reply.content["metrics"][pm.READS_PACKED]
    return reply


CFG = RunConfig(dataset="digits", clients=4, groups=(2,), grouping="contiguous",
                local_period=2, global_period=4, rounds=1, batch_size=8, seed=5,
                edge_servers=True)


def _edge_tier_run(app, path) -> tuple[list[Spy], Spy]:
    """CFG's run on in-process edge servers whose clients run ``app``: (the edges' grids,
    the cloud's grid)."""
    placement = client_placement(CFG)
    grids, servers = [], []
    for edge in range(CFG.num_edges):
        clients = np.flatnonzero(placement == edge).tolist()
        grids.append(Spy(app, len(clients), seed=CFG.seed + 1 + edge, partition_ids=clients,
                         num_partitions=CFG.clients))
        servers.append(EdgeServer(edge, grids[-1], clients))
    cloud = Spy(EdgeServersApp(servers), CFG.num_edges, seed=CFG.seed)  # type: ignore[arg-type]
    run_federation(cloud, CFG, RunFolder.create(path, CFG), engine="edge servers (in-process)",
                   progress=False)
    return grids, cloud


def _kinds(messages: list[Message], kind: str) -> list[Message]:
    return [m for m in messages if m.metadata.message_type == kind]


def test_edge_servers_pack_for_fedhiers_client_app_only_and_run_the_same(tmp_path):
    grids, cloud = _edge_tier_run(client_app, tmp_path / "packed")
    sent = [m for g in grids for m in g.sent]
    replies = [m for g in grids for m in g.replies]
    for kind in (MessageType.TRAIN, MessageType.EVALUATE):
        assert _kinds(sent, kind) and all(pm.is_packed(m.content, "arrays")
                                          for m in _kinds(sent, kind)), kind
    train_replies = [r for r in replies if "train-loss" in r.content["metrics"]]
    assert len(train_replies) == 4 * 2 and all(pm.is_packed(r.content, "arrays")
                                               for r in train_replies)
    # cloud <-> edge: the job's model and record, the edges' models
    jobs, reports = _kinds(cloud.sent, MessageType.TRAIN), _kinds(cloud.replies, MessageType.TRAIN)
    assert len(jobs) == len(reports) == 2 * CFG.rounds
    assert all(pm.is_packed(m.content, "arrays") and pm.is_packed(m.content, "edge-job")
               for m in jobs) and all(pm.is_packed(r.content, "arrays") for r in reports)
    evaluations = _kinds(cloud.sent, MessageType.EVALUATE)
    assert len(evaluations) == 2 * (CFG.rounds + 1) and all(
        pm.is_packed(m.content, "arrays") for m in evaluations)

    grids, _ = _edge_tier_run(foreign, tmp_path / "plain")
    sent = [m for g in grids for m in g.sent]
    assert _kinds(sent, MessageType.TRAIN) and not any(pm.is_packed(m.content, "arrays")
                                                       for m in sent)
    assert all(isinstance(r.content["arrays"], ArrayRecord)
               for g in grids for r in g.replies if "arrays" in r.content)
    # every number of metrics.jsonl (counted bytes included) and the final model's bits
    assert_same_run(tmp_path / "packed", tmp_path / "plain", CFG.rounds, tol=0)


def test_a_malformed_packed_reply_names_the_client():
    bad = ClientApp()

    @bad.train()
    def train(msg: Message, context) -> Message:
        return Message(RecordDict({"arrays": ConfigRecord({pm.BLOB_KEY: pm.MAGIC + b"\0"}),
                                   "metrics": MetricRecord({"num-examples": 3})}), reply_to=msg)

    grid = InProcessGrid(bad, 1)
    node = list(grid.get_node_ids())[0]
    sent = grid.create_message(RecordDict({"arrays": pm.model_record({"w": torch.ones(2)}, True)}),
                               MessageType.TRAIN, node, "")
    (reply,) = grid.send_and_receive([sent])
    with pytest.raises(ContractError, match=r"client 3 \(node \d+\) replied 'arrays': packed "
                                            "model cut short in its header"):
        read_train_reply(reply, 3, "arrays", {"w": torch.ones(2)})

"""Every reply bound to the request it answers (docs/security.md, issue 41).

A hostile client of six replays an earlier reply, forges its sender, answers from a node the
run does not know or with another message type. Through ``fedhier run``'s path on the
in-process grid (:func:`tests.test_hostile_clients.run`): under ``stop`` one line naming the
client and what did not match (exit 2, never 4); under ``drop`` the reply is dropped and
counted (``dropped_replies``) and the final model is exactly that of a client that failed
those rounds. Then the executor's own check on a grid that hands replies on unchecked, the
profile query failing under ``drop``, claims bounded by the profile, the metrics a client
cannot take over, and the realistic bugs (exclusion at the K-th round, +inf to on_nan).
"""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhier.clients import app as fedhier_client
from fedhier.engines.inprocess_grid import InProcessGrid
from tests.test_hostile_clients import CFG, HOSTILE, _raise, arrays, hostile_app, metric, run

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_plots")


@pytest.fixture(scope="module")
def no_plots():
    import fedhier.runs.plots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fedhier.runs.plots, "plot_runs", lambda *a, **k: None)
        yield


def node_of(client: int, cfg=CFG) -> int:
    """The node id of ``client`` on the grid :func:`run` makes (seeded)."""
    grid = InProcessGrid(ClientApp(), cfg.clients, seed=cfg.seed)
    return next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == client)


def set_meta(reply: Message, **values) -> Message:
    for key, value in values.items():
        reply.metadata.__dict__[f"_{key}"] = value
    return reply


def replayer():
    """A train reply: the first one, returned again in every later edge round."""
    first: list[Message] = []

    def corrupt(reply: Message) -> Message:
        if not first:
            first.append(reply)
        return first[0]
    return corrupt


def raises_from(edge_round: int):
    """fedhier's ClientApp whose client 2 raises in train from ``edge_round`` on."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if (int(context.node_config["partition-id"]) == HOSTILE
                and int(msg.content["config"]["edge-round"]) >= edge_round):
            raise RuntimeError("failed")
        return fedhier_client.train(msg, context)

    app.evaluate()(fedhier_client.evaluate_local)
    app.query()(fedhier_client.profile)
    app.query("gradient")(fedhier_client.gradient)
    return app


CASES = {  # case -> (kind, corruption, the line, reference under drop)
    "replayed-train": ("train", replayer, r"in edge round 2: its reply does not answer the "
                       r"message it was sent: reply_to_message_id '\d+' is not its message's",
                       "from-2"),
    "forged-source-train": ("train", lambda: lambda r: set_meta(r, src_node_id=node_of(5)),
                            rf"src_node_id {node_of(5)} is not node {node_of(HOSTILE)}",
                            "crashed"),
    "unknown-node-gradient": ("gradient", lambda: lambda r: set_meta(r, src_node_id=999),
                              "src_node_id 999 is not node", "honest"),
    "evaluate-as-train": ("evaluate", lambda: lambda r: set_meta(r, message_type="train"),
                          "message_type 'train' answers a 'evaluate' message", "honest"),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    base = tmp_path_factory.mktemp("bound")
    cfg = CFG.replace(diagnostics_every=1)
    out = {"honest": run(hostile_app("none", lambda r: r), base / "honest", cfg),
           "crashed": run(hostile_app("train", _raise), base / "crashed", cfg),
           "from-2": run(raises_from(2), base / "from2", cfg)}
    assert all(r[0] == 0 for r in out.values())
    return {k: v[3] for k, v in out.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unbound_reply_stops_with_one_line_naming_the_client(case, tmp_path):
    kind, corrupt, line, _ = CASES[case]
    code, text, _, _ = run(hostile_app(kind, corrupt()), tmp_path / "run",
                           CFG.replace(diagnostics_every=int(kind == "gradient")))
    assert code == 2, text  # never 4 (the KeyError of an unknown node)
    assert "\n" not in text and text.startswith(f"client {HOSTILE} (node "), text
    assert re.search(line, text), text


@pytest.mark.parametrize("case", list(CASES))
def test_an_unbound_reply_is_dropped_counted_and_never_used(case, tmp_path, references):
    kind, corrupt, _, reference = CASES[case]
    cfg = CFG.replace(diagnostics_every=1, on_bad_reply="drop")
    code, text, records, final = run(hostile_app(kind, corrupt()), tmp_path / "run", cfg)
    assert code == 0, text
    expected = references[reference]
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    dropped = {"train": [0, 2 if reference == "crashed" else 1], "gradient": [1, 1],
               "evaluate": [1, 1]}[kind]
    assert [r.get("dropped_replies", 0) for r in records] == dropped
    assert all("excluded_clients" not in r for r in records)  # client 5 is not blamed
    if kind == "gradient":
        assert all("global_divergence" not in r for r in records)


class UncheckedGrid(InProcessGrid):
    """An in-process grid that hands on whatever the ClientApp returns (as a grid whose
    SuperLink checked nothing would): the executor's own check is all there is."""

    def _call(self, msg: Message) -> Message:
        return self.client_app(msg, self.contexts[msg.metadata.dst_node_id])


def test_the_executor_binds_replies_a_grid_did_not_check(tmp_path):
    from fedhier.cli.flags import error_text
    from fedhier.engines.grid_run import run_federation
    from fedhier.runs.folder import RunFolder

    def on(app, name, cfg=CFG):
        try:
            run_federation(UncheckedGrid(app, cfg.clients, seed=cfg.seed), cfg,
                           RunFolder.create(tmp_path / name), engine="inprocess",
                           progress=False)
        except Exception as exc:  # noqa: BLE001 - the line is the assertion
            return error_text(exc)
        return None

    replay = on(hostile_app("train", replayer()), "replay")
    assert replay.startswith(f"client {HOSTILE} (node {node_of(HOSTILE)}) replied in edge "
                             "round 2 to its message of edge round 1: a replayed reply"), replay
    forged = on(hostile_app("train", lambda r: set_meta(r, src_node_id=node_of(5))), "forged")
    assert forged.startswith(f"client {HOSTILE} (node {node_of(HOSTILE)}) in edge round 1: "
                             "its reply does not answer its message: src_node_id"), forged
    stray = on(hostile_app("train", lambda r: set_meta(r, reply_to_message_id="x" * 40)), "x")
    assert stray.startswith(f"a reply from client {HOSTILE} (node {node_of(HOSTILE)}) in edge "
                            "round 1 answers no message this run sent"), stray


# ---------------------------------------------------------------- the profile query
def crashing(clients) -> ClientApp:
    """fedhier's ClientApp whose ``clients`` raise in every train call."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) in clients:
            raise RuntimeError("failed")
        return fedhier_client.train(msg, context)

    app.evaluate()(fedhier_client.evaluate_local)
    app.query()(fedhier_client.profile)
    return app


@pytest.mark.parametrize("case", ["raises", "late", "another-partition-id"])
def test_a_profile_failure_under_drop_leaves_its_client_out(case, tmp_path):
    """Under ``drop`` the run trains without the client (both claimants of a partition id
    reported twice); under uniform weighting the final model is exactly that of the same
    clients failing every train call (an absent client keeps its edge's weight either way).
    Under ``stop``: one line, exit 3 (2 for the partition id)."""
    def late(reply):
        time.sleep(3)
        return reply

    corrupt, left_out = {
        "raises": (_raise, [HOSTILE]),
        "late": (late, [HOSTILE]),
        "another-partition-id": (metric("partition-id", 5), [HOSTILE, 5]),
    }[case]
    cfg = CFG.replace(weighting="uniform", round_timeout=1.0 if case == "late" else 3600)
    code, text, _, _ = run(hostile_app("profile", corrupt), tmp_path / "stop", cfg)
    assert code == 3 and "\n" not in text, text
    cfg = cfg.replace(on_bad_reply="drop")
    code, text, records, final = run(hostile_app("profile", corrupt), tmp_path / "drop", cfg)
    assert code == 0, text
    assert all(r["excluded_clients"] == left_out for r in records)
    assert records[-1]["failed_clients"] == 2 * len(left_out)  # its two edge rounds each
    expected = run(crashing(left_out), tmp_path / "crashed", cfg)[3]
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_claims_are_bounded_by_the_profile_and_metrics_cannot_be_taken_over(tmp_path):
    """A client whose histogram was dropped (negative count) claiming 10**12 train rows is
    weighted by its profile's num-examples: the final model equals the honest run's. An
    evaluate reply claiming 10**12 rows with loss 50, accuracy 0 weighs as its declared
    rows: the record equals, bit for bit, the same lie made with its honest rows; with
    ``--metrics-aggregator median`` the recorded accuracy is that of an honest client."""
    cfg = CFG.replace(on_bad_reply="drop")
    honest = run(hostile_app("none", lambda r: r), tmp_path / "honest", cfg)
    inflated = run(hostile_app("train", metric("num-examples", 10**12),
                               profile=metric("label-histogram", [-5] + [40] * 9)),
                   tmp_path / "inflated", cfg)
    assert all(torch.equal(inflated[3][k], honest[3][k]) for k in honest[3])

    def liar(rows):
        def corrupt(reply):
            reply.content["metrics"].update({"num-examples": rows, "loss": 50.0,
                                             "accuracy": 0.0})
            return reply
        return corrupt

    rows = profile_of(HOSTILE)["num-examples"]
    big = run(hostile_app("evaluate", liar(10**12)), tmp_path / "big", cfg)[2]
    fair = run(hostile_app("evaluate", liar(rows)), tmp_path / "fair", cfg)[2]
    assert [r["train_accuracy"] for r in big] == [r["train_accuracy"] for r in fair]
    assert [r["train_loss"] for r in big] == [r["train_loss"] for r in fair]
    assert honest[2][-1]["train_loss"] < big[-1]["train_loss"] < 50 / 3  # one share of six
    median = run(hostile_app("evaluate", liar(10**12)), tmp_path / "median",
                 cfg.replace(metrics_aggregator="median"))[2]
    assert all(r["train_accuracy"] > 0.05 and r["train_loss"] < 5 for r in median)


def profile_of(client: int) -> dict:
    grid = InProcessGrid(ClientApp(), CFG.clients, seed=CFG.seed)
    context = next(c for c in grid.contexts.values()
                   if c.node_config["partition-id"] == client)
    msg = Message(RecordDict({"config": ConfigRecord(CFG.to_run_config())}),
                  message_type="query", dst_node_id=context.node_id)
    return dict(fedhier_client.profile(msg, context).content["metrics"])


def test_the_metrics_aggregator_median_over_constant_clients():
    """Four clients replying loss j, accuracy j / 10 and a fifth lying (loss 50, accuracy 0,
    10**12 rows): the median rule records the median of the five exactly."""
    from fedhier.strategies import HierFedAvg

    app = ClientApp()

    @app.train()
    def train(msg, context):
        return Message(RecordDict({"arrays": msg.content["arrays"],
                                   "metrics": MetricRecord({"num-examples": 10})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg, context):
        pid = int(context.node_config["partition-id"])
        values = ({"loss": 50.0, "accuracy": 0.0, "num-examples": 10**12} if pid == 4 else
                  {"loss": float(pid), "accuracy": pid / 10, "num-examples": 10})
        return Message(RecordDict({"metrics": MetricRecord(values)}), reply_to=msg)

    for rule, loss, accuracy in [("median", 2.0, 0.1), ("mean", None, None)]:
        records: list = []
        HierFedAvg(1, 2, 2, metrics_aggregator=rule).start(
            InProcessGrid(app, 5, seed=1), ArrayRecord({"w": torch.zeros(2)}),
            num_rounds=1, on_cloud_round=records.append)
        if loss is None:  # the mean: the liar capped at 10 x the median claim (no profile)
            w = np.array([10, 10, 10, 10, 100.0])
            loss = float(np.dot(w, [0, 1, 2, 3, 50]) / w.sum())
            accuracy = float(np.dot(w, [0, .1, .2, .3, 0]) / w.sum())
        assert records[-1]["train_loss"] == loss and records[-1]["train_accuracy"] == accuracy


# ---------------------------------------------------------------- realistic bugs
def test_exclude_after_2_excludes_at_exactly_the_second_bad_round(tmp_path):
    """Client 2 replies a bad size every edge round, K = 2: it is sent train messages in
    edge rounds 1 and 2 only, and the record of cloud round 1 (edge rounds 1-2) already
    names it excluded."""
    sent: list[int] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = fedhier_client.train(msg, context)
        if int(context.node_config["partition-id"]) == HOSTILE:
            sent.append(int(msg.content["config"]["edge-round"]))
            return metric("num-examples", 0)(reply)
        return reply

    app.evaluate()(fedhier_client.evaluate_local)
    app.query()(fedhier_client.profile)
    cfg = CFG.replace(on_bad_reply="drop", exclude_after=2, rounds=3)
    code, text, records, _ = run(app, tmp_path / "run", cfg)
    assert code == 0, text
    assert sent == [1, 2]
    assert [r.get("excluded_clients") for r in records] == [None, [HOSTILE], [HOSTILE],
                                                             [HOSTILE]]


def test_an_inf_update_goes_to_on_nan_not_to_the_outlier_check(tmp_path):
    """+inf in one entry: under on_nan stop the run stops with on_nan's line (exit 3), not as
    an outlying update; with skip-client it is dropped as non-finite, not as a bad reply."""
    inf = arrays(lambda s: {k: v.flatten().index_fill(0, torch.tensor([0]), math.inf)
                            .reshape(v.shape) for k, v in s.items()})
    cfg = CFG.replace(on_bad_reply="drop")
    code, text, _, _ = run(hostile_app("train", inf), tmp_path / "stop", cfg)
    assert code == 3 and text.startswith(f"non-finite values in the update of client "
                                         f"{HOSTILE}"), text
    code, _, records, _ = run(hostile_app("train", inf), tmp_path / "skip",
                              cfg.replace(on_nan="skip-client"))
    assert code == 0 and records[-1]["failed_clients"] == 2
    assert all("dropped_replies" not in r for r in records)


def test_a_nan_train_loss_with_a_finite_model_has_its_own_line(tmp_path):
    code, text, _, _ = run(hostile_app("train", metric("train-loss", math.nan)),
                           tmp_path / "run")
    assert code == 3 and text.startswith(f"client {HOSTILE} (edge "), text
    assert "reported a train loss of nan" in text and "with a finite model" in text
    assert "non-finite values in the update" not in text


def test_a_huge_array_is_refused_by_its_declared_shape_before_conversion(monkeypatch):
    """The shape a record declares is checked before any array is decoded: a reply
    declaring 2**28 entries is refused with no call to Array.numpy."""
    from flwr.app import Array
    from flwr.supercore.task_identity import TaskIdentity

    from fedhier.strategies.replies import ContractError, read_train_reply

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    expected = {"w": torch.zeros(3)}
    huge = ArrayRecord({"w": torch.zeros(3)})
    array = huge["w"]
    huge["w"] = Array(dtype=array.dtype, shape=(2**28,), stype=array.stype, data=array.data)
    sent = Message(RecordDict(), dst_node_id=7, message_type="train")
    reply = Message(RecordDict({"arrays": huge,
                                "metrics": MetricRecord({"num-examples": 3})}), reply_to=sent)
    monkeypatch.setattr(Array, "numpy", lambda self: pytest.fail("decoded before the check"))
    with pytest.raises(ContractError, match=r"replied 'w' as float32 \(268435456,\), "
                                            r"expected the model's float32 \(3,\)"):
        read_train_reply(reply, 2, "arrays", expected)
    padded = ArrayRecord({"w": torch.zeros(3)})
    padded["w"] = Array(dtype=array.dtype, shape=(3,), stype=array.stype,
                        data=array.data + bytes(1 << 20))
    reply = Message(RecordDict({"arrays": padded,
                                "metrics": MetricRecord({"num-examples": 3})}), reply_to=sent)
    with pytest.raises(ContractError, match="carrying 1048"):
        read_train_reply(reply, 2, "arrays", expected)


def forge_999(reply: Message) -> Message:
    """A train reply claiming to come from node 999 (a node no run has)."""
    reply.metadata.__dict__["_src_node_id"] = 999
    return reply


@pytest.mark.slow
def test_the_simulation_engine_binds_replies_and_waits_for_its_nodes(tmp_path, monkeypatch):
    """On Flower's Simulation Engine (its LinkState would drop the forged reply unseen: a
    silent client), ``--round-timeout 20`` on 2 CPUs (the actors take ~30 s to start: the
    first deadline starts at the first reply): under ``stop`` one line naming client 2;
    under ``drop`` the run equals the in-process run of the same clients (1e-5), the reply
    dropped and counted in each edge round."""
    import fedhier.engines.flower_edges as flower_edges
    from fedhier.cli.flags import error_text, exit_code_for
    from fedhier.engines.flower import run_simulation_engine
    from fedhier.engines.inprocess import run_inprocess
    from fedhier.runs.folder import RunFolder
    from tests.helpers import assert_same_run, metrics

    monkeypatch.setattr(flower_edges, "simulation_nodes",
                        lambda cfg: (hostile_app("train", forge_999), cfg.clients))
    cfg = CFG.replace(engine="flower", round_timeout=20.0)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the line is the assertion
        run_simulation_engine(cfg, RunFolder.create(tmp_path / "stop"), progress=False,
                              num_cpus=2)
    text = error_text(caught.value)
    assert exit_code_for(caught.value) == 2 and text.startswith(f"client {HOSTILE} (node "), text
    assert "src_node_id 999 is not node" in text, text
    drop = cfg.replace(on_bad_reply="drop")
    run_simulation_engine(drop, RunFolder.create(tmp_path / "flower"), progress=False,
                          num_cpus=2)
    import fedhier.engines.inprocess as inprocess

    monkeypatch.setattr(inprocess, "client_app", hostile_app("train", forge_999))
    run_inprocess(drop.replace(engine="inprocess"), RunFolder.create(tmp_path / "inprocess"),
                  progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "flower", drop.rounds)
    records = metrics(tmp_path / "flower")
    assert records[-1]["dropped_replies"] == 2 and records[-1]["failed_clients"] == 2


def test_a_rule_too_small_for_its_node_warns_once_per_run_naming_node_and_size(tmp_path,
                                                                               caplog):
    """trimmed-mean (b = 0.2) at edges of 3 clients trims floor(0.6) = 0: one warning per
    edge and run (2 edge rounds aggregate each edge twice), again in the next run; the exact
    minimum sizes of docs/security.md."""
    from fedhier.round.aggregators.averaging import aggregator

    assert {name: aggregator(name).min_members for name in (
        "mean", "median", "trimmed-mean", "trimmed-mean:0.1", "trimmed-mean:0.25",
        "trimmed-mean:0", "clip", "clip:5", "krum", "krum:2", "multi-krum",
        "multi-krum:0")} == {
        "mean": None, "median": 3, "trimmed-mean": 5, "trimmed-mean:0.1": 10,
        "trimmed-mean:0.25": 4, "trimmed-mean:0": None, "clip": 3, "clip:5": 1, "krum": 5,
        "krum:2": 7, "multi-krum": 5, "multi-krum:0": None}
    cfg = CFG.replace(aggregators="trimmed-mean,mean")
    for attempt in range(2):
        caplog.clear()
        assert run(hostile_app("none", lambda r: r), tmp_path / f"run{attempt}", cfg)[0] == 0
        lines = sorted(r.getMessage() for r in caplog.records
                       if r.getMessage().startswith("aggregator "))
        assert lines == [f"aggregator trimmed-mean at the edges: node {e} aggregates 3 "
                         "member(s), the rule needs >= 5 to resist one hostile member: not "
                         "robust there (docs/security.md)" for e in (0, 1)]

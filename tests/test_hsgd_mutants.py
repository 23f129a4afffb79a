"""The round's loop (fedhier/round/loop.py) driven by a fake executor whose "training" is a closed
form, so every model, loss and counter of a run is worked out by hand (docs/hsgd.md), written
against mutmut's survivors (docs/testing.md, "Mutation testing").

The fake: client j trained for s steps from model w returns w + s * c_j (c = 1, 2, 3, 4) and
reports loss j + 1. Four clients, contiguous grouping: edge 0 = {0, 1}, edge 1 = {2, 3};
rows 1, 1, 2, 4 (``samples`` weights 1, 1, 2, 4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.executor import ClientEvaluation, EdgeRoundWork, TrainResult
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import NO_TRAINING, HierarchicalSGD, HSGDSettings
from fedhier.round.participants import Workload
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import assert_refused

DRIFT = torch.tensor([1.0, 2.0, 3.0, 4.0])
ROWS = np.array([1, 1, 2, 4], dtype=np.int64)


class Fake:
    """A closed-form executor (see the module docstring); records what it was asked."""

    def __init__(self, ok=None, losses=None, evaluation=None, sizes=None) -> None:
        self.calls: list[tuple[EdgeRoundWork, dict[str, torch.Tensor]]] = []
        self.ok, self.losses, self.evaluation, self.sizes = ok, losses, evaluation, sizes
        self.restored = None

    def profiles(self) -> ClientInfo:
        return ClientInfo(label_histograms=np.stack([ROWS, np.zeros(4, dtype=np.int64)], 1),
                          num_examples=ROWS.copy())

    def train(self, work: EdgeRoundWork, edge_models):
        self.calls.append((work, {k: v.clone() for k, v in edge_models.items()}))
        start = edge_models["w"][work.start_edges[work.clients]]
        steps = torch.as_tensor(work.steps, dtype=torch.float32)[:, None]
        models = {"w": start + steps * DRIFT[work.clients][:, None]}
        k = len(work.clients)
        ok = np.ones(k, dtype=bool) if self.ok is None else self.ok(work)
        losses = work.clients + 1.0 if self.losses is None else self.losses(work)
        sizes = None if self.sizes is None else self.sizes(work)
        return TrainResult(models=models, losses=np.asarray(losses, dtype=np.float64), ok=ok,
                           num_examples=sizes)

    def evaluate(self, params, cloud_round):
        return None if self.evaluation is None else self.evaluation(params, cloud_round)

    def client_gradients(self, params):
        return None

    def model_bytes(self, params):
        return 10

    def client_state(self):
        return None

    def restore_client_state(self, state):
        self.restored = state


def settings(**kw) -> HSGDSettings:
    kw.setdefault("periods", (1, 2))
    kw.setdefault("groups", (2,))
    return HSGDSettings(grouping="contiguous", **kw)


def run(s: HSGDSettings, rounds: int = 1, fake: Fake | None = None, **kw):
    fake = fake or Fake()
    records: list[dict] = []
    algo = HierarchicalSGD(s)
    final = algo.run(fake, {"w": torch.zeros(1)}, rounds, on_record=records.append, **kw)
    return algo, fake, records, float(final["w"][0])


# -- one cloud round, worked out ------------------------------------------------------------
def test_one_cloud_round_of_two_edge_rounds_by_hand():
    """I = 1, G = 2. Edge round 1 from 0: clients 1, 2, 3, 4; edge 0 = (1 + 2) / 2 = 1.5,
    edge 1 = (2*3 + 4*4) / 6 = 11/3. Edge round 2: 2.5, 3.5, 20/3, 23/3; the cloud's
    client-weighted mean (2.5 + 3.5 + 2*20/3 + 4*23/3) / 8 = 50/8 = 6.25."""
    algo, fake, records, final = run(settings())
    assert final == pytest.approx(6.25, abs=1e-6)
    (w1, m1), (w2, m2) = fake.calls
    assert m1["w"].flatten().tolist() == [0.0, 0.0]
    assert m2["w"].flatten().tolist() == pytest.approx([1.5, 11 / 3], abs=1e-6)
    assert (w1.edge_round, w1.cloud_round, w1.start_step) == (1, 1, 0)
    assert (w2.edge_round, w2.cloud_round, w2.start_step) == (2, 1, 1)
    assert w1.clients.tolist() == [0, 1, 2, 3] and w1.steps.tolist() == [1, 1, 1, 1]
    assert w1.edge_of_client.tolist() == [0, 0, 1, 1]
    assert algo.edge_models["w"].flatten().tolist() == pytest.approx([6.25, 6.25], abs=1e-6)
    # round 0 then round 1; the loss each edge round: (1*1 + 1*2 + 2*3 + 4*4) / 8 = 3.125
    assert [r["round"] for r in records] == [0, 1]
    assert records[0] == {"round": 0, "iteration": 0, "edge_rounds": 0, **NO_TRAINING,
                          "client_edge_messages": 0, "edge_cloud_messages": 0,
                          "client_edge_bytes": 0, "edge_cloud_bytes": 0,
                          "sim_seconds": 0.0}
    r = records[1]
    assert (r["iteration"], r["edge_rounds"]) == (2, 2)
    assert r["local_train_loss"] == pytest.approx(3.125, abs=1e-12)
    assert (r["failed_clients"], r["failed_edges"]) == (0, 0)
    # 2 edge rounds x (4 down + 4 up); one cloud aggregation: 2 edges up and down
    assert (r["client_edge_messages"], r["client_edge_bytes"]) == (16, 160)
    assert (r["edge_cloud_messages"], r["edge_cloud_bytes"]) == (4, 40)
    assert r["sim_seconds"] > 0


def test_the_second_cloud_round_starts_every_edge_from_the_global_model():
    """Round 2 repeats round 1 from 6.25: + 6.25 again (the drift is linear) = 12.5."""
    algo, fake, records, final = run(settings(), rounds=2)
    assert final == pytest.approx(12.5, abs=1e-5)
    work3, start3 = fake.calls[2]
    assert (work3.edge_round, work3.cloud_round, work3.start_step) == (3, 2, 2)
    assert start3["w"].flatten().tolist() == pytest.approx([6.25, 6.25], abs=1e-6)
    assert [(r["round"], r["iteration"], r["edge_rounds"]) for r in records] == \
        [(0, 0, 0), (1, 2, 2), (2, 4, 4)]
    assert records[2]["client_edge_messages"] == 32 and records[2]["edge_cloud_messages"] == 8


def test_a_longer_edge_round_multiplies_the_drift():
    """I = 2, G = 4: each edge round adds 2 c_j: edge 0 = 3, edge 1 = 22/3; then the cloud:
    (5 + 7 + 2*(22/3 + 6) + 4*(22/3 + 8)) / 8 = 12.5."""
    algo, fake, records, final = run(settings(periods=(2, 4)))
    assert final == pytest.approx(12.5, abs=1e-5)
    work2, start2 = fake.calls[1]
    assert work2.start_step == 2 and work2.steps.tolist() == [2, 2, 2, 2]
    assert start2["w"].flatten().tolist() == pytest.approx([3.0, 22 / 3], abs=1e-6)
    assert (records[1]["iteration"], records[1]["edge_rounds"]) == (4, 2)


def test_three_levels_aggregate_at_each_level_when_due():
    """Periods 1, 2, 4 over groups (2, 1): with one region the region's mean at step 2 is
    already the global mean (6.25), and steps 3-4 add 6.25 again."""
    algo, fake, records, final = run(settings(periods=(1, 2, 4), groups=(2, 1)))
    assert final == pytest.approx(12.5, abs=1e-5)
    assert fake.calls[2][1]["w"].flatten().tolist() == pytest.approx([6.25, 6.25], abs=1e-5)
    # edge rounds 2 and 4 aggregate above the edges: 2 edges up and down each time, and at
    # the cloud (round 4) the region too
    assert records[1]["edge_cloud_messages"] == 4 + 4 + 2


def test_resuming_starts_at_the_given_round_without_round_zero():
    algo, fake, records, final = run(settings(), rounds=3, first_round=3, client_state={"k": 1})
    assert [r["round"] for r in records] == [3]
    assert fake.calls[0][0].edge_round == 5 and fake.restored == {"k": 1}
    assert final == pytest.approx(6.25, abs=1e-6)


def test_a_run_with_no_rounds_records_round_zero_only():
    algo, fake, records, final = run(settings(), rounds=0)
    assert [r["round"] for r in records] == [0] and fake.calls == [] and final == 0.0


# -- failures, losses and sizes ---------------------------------------------------------------
def test_a_failed_client_is_left_out_and_counted():
    """Client 1 fails every edge round: edge 0 = client 0 alone: 1, then 2; edge 1 = 11/3,
    then 20/3 and 23/3. Presence weights: edge 0 keeps its full weight 2 (docs/hsgd.md), so
    the cloud = (2*2 + 2*20/3 + 4*23/3) / 8 = 48/8 = 6."""
    fake = Fake(ok=lambda work: work.clients != 1)
    algo, fake, records, final = run(settings(), fake=fake)
    assert final == pytest.approx(6.0, abs=1e-5)
    r = records[1]
    assert (r["failed_clients"], r["failed_edges"]) == (2, 0)
    # losses: survivors 0, 2, 3 with weights 1, 2, 4: (1 + 6 + 16) / 7 = 23/7
    assert r["local_train_loss"] == pytest.approx(23 / 7, abs=1e-12)
    # 4 sent and 3 received per edge round
    assert r["client_edge_messages"] == 14


def test_an_edge_without_survivors_is_counted_and_drops_out_of_the_cloud():
    """Clients 0 and 1 (edge 0) fail: edge 0 keeps 0; edge 1 = 11/3, then 20/3 and 23/3;
    the cloud over edge 1 alone: (2*20/3 + 4*23/3) / 6 = 22/3."""
    fake = Fake(ok=lambda work: work.clients >= 2)
    _, _, records, final = run(settings(), fake=fake)
    assert final == pytest.approx(22 / 3, abs=1e-5)
    assert (records[1]["failed_edges"], records[1]["failed_clients"]) == (2, 4)


def test_an_edge_below_the_minimum_stops_the_run():
    fake = Fake(ok=lambda work: work.clients != 1)
    with pytest.raises(RunFailureError, match="edge 0 kept 1 of 2 clients in edge round 1"):
        run(settings(min_clients_per_edge=2), fake=fake)


def test_no_survivor_keeps_every_model_and_reports_no_loss():
    fake = Fake(ok=lambda work: np.zeros(len(work.clients), dtype=bool))
    algo, fake, records, final = run(settings(), fake=fake)
    assert final == 0.0
    r = records[1]
    assert r["local_train_loss"] is None and r["failed_clients"] == 8
    assert r["client_edge_messages"] == 8 and r["edge_cloud_messages"] == 0


def test_a_non_finite_update_stops_the_run_or_is_skipped():
    def nan_losses(work):
        return work.clients + 1.0

    class NaNFake(Fake):
        def train(self, work, edge_models):
            result = super().train(work, edge_models)
            result.models["w"][1] = float("nan")
            return result

    with pytest.raises(Exception, match="client 1"):
        run(settings(), fake=NaNFake(losses=nan_losses))
    algo, fake, records, final = run(settings(on_nan="skip-client"), fake=NaNFake())
    assert final == pytest.approx(6.0, abs=1e-5)
    assert records[1]["failed_clients"] == 2


def test_rows_reported_by_train_replies_become_the_weights():
    """Every client reports 1 row: uniform weights from then on; edge round 1 edge 1 =
    (3 + 4) / 2 = 3.5; edge round 2: 2.5, 3.5, 6.5, 7.5: the cloud's mean 5.0."""
    fake = Fake(sizes=lambda work: np.ones(len(work.clients), dtype=np.int64))
    algo, fake, records, final = run(settings(), fake=fake)
    assert final == pytest.approx(5.0, abs=1e-6)
    assert algo.info.num_examples.tolist() == [1, 1, 1, 1]
    assert algo.weights.tolist() == [1.0] * 4
    assert records[1]["local_train_loss"] == pytest.approx(2.5, abs=1e-12)


def test_the_evaluation_is_weighted_and_recorded():
    evaluation = ClientEvaluation(loss=np.array([1.0, 2.0, 3.0, 4.0]),
                                  accuracy=np.array([0.0, 1.0, 0.5, 0.25]))
    fake = Fake(evaluation=lambda params, cloud_round: evaluation)
    _, _, records, _ = run(settings(), fake=fake)
    # weights 1, 1, 2, 4 (/8): loss 25/8, accuracy (0 + 1 + 1 + 1) / 8
    for r in records:
        assert r["train_loss"] == pytest.approx(3.125) and r["train_accuracy"] == 0.375


def test_evaluate_fn_and_excluded_clients_join_the_record():
    class Excluding(Fake):
        excluded_clients = {3, 1}

    seen = []

    def evaluate_fn(cloud_round, params):
        seen.append((cloud_round, float(params["w"][0])))
        return {"test_accuracy": cloud_round / 10}

    _, _, records, _ = run(settings(), fake=Excluding(), evaluate_fn=evaluate_fn)
    assert seen == [(0, 0.0), (1, pytest.approx(6.25, abs=1e-6))]
    assert [r["test_accuracy"] for r in records] == [0.0, 0.1]
    assert records[1]["excluded_clients"] == [1, 3]


# -- participation, stragglers, FedNova -------------------------------------------------------
def test_stragglers_with_fednova_move_like_a_full_step():
    """I = 2, every client a straggler with 1 step (k = 1, I - 1 = 1). FedNova within an edge:
    tau_eff = 1, scale 1: one step of drift per edge round; 2 edge rounds of G = 4: edge 0
    1.5 then 3.0, edge 1 11/3 then 22/3; cloud (2*3 + 6*22/3) / 8 = 6.25."""
    s = settings(periods=(2, 4), workload=Workload(straggler_fraction=1.0,
                                                    normalize_updates=True))
    algo, fake, records, final = run(s)
    assert fake.calls[0][0].steps.tolist() == [1, 1, 1, 1]
    assert final == pytest.approx(6.25, abs=1e-5)


# -- settings, state and guards -------------------------------------------------------------
def test_settings_refuse_unknown_names_in_one_line():
    assert_refused(lambda: settings(weighting="equal"),
                   "unknown weighting 'equal'; choose samples or uniform")
    assert_refused(lambda: settings(on_nan="ignore"),
                   "unknown on_nan 'ignore'; choose stop or skip-client")
    assert settings(weighting="uniform").weighting == "uniform"
    assert settings(on_nan="skip-client").on_nan == "skip-client"


def test_state_dict_round_trips_the_counters_and_the_tree():
    algo, fake, _, _ = run(settings())
    state = algo.state_dict()
    assert state["communication"] == {"client_edge_messages": 16, "edge_cloud_messages": 4,
                                      "client_edge_bytes": 160, "edge_cloud_bytes": 40}
    assert state["num_examples"] == [1, 1, 2, 4]
    assert state["hierarchy"].edge_of_client().tolist() == [0, 0, 1, 1]
    assert "executor" not in state and state["cloud_step"] is None
    again = HierarchicalSGD(settings())
    again.load_state_dict(state)
    assert again.communication.as_dict() == state["communication"]


def test_a_round_before_setup_is_a_clear_error():
    algo = HierarchicalSGD(settings())
    with pytest.raises(RuntimeError, match="setup"):
        algo.plan(1)
    with pytest.raises(RuntimeError, match="must run first"):
        algo.elapsed_seconds()


def test_a_given_hierarchy_is_used_as_is():
    algo = HierarchicalSGD(settings())
    tree = Hierarchy((1, 2), (np.array([1, 0, 0, 1], dtype=np.int64),))
    algo.setup(Fake(), {"w": torch.zeros(1)}, hierarchy=tree)
    assert algo.hierarchy is tree and algo.model_bytes == 10
    assert algo.weights.tolist() == [1.0, 1.0, 2.0, 4.0]


def test_regroup_due_counts_from_the_second_round():
    algo = HierarchicalSGD(settings(regroup_every=2))
    assert [algo.regroup_due(r) for r in range(1, 6)] == [False, False, True, False, True]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        settings(periods=(2, 3))


class Recorder:
    """A cloud step that records what it is told and takes the first child's model + 100."""

    def __init__(self) -> None:
        self.begun: list[tuple[int, float, int]] = []
        self.steps: list[tuple[int, list[int], list[float]]] = []

    def begin(self, cloud_round, global_params, num_children):
        self.begun.append((cloud_round, float(global_params["w"][0]), num_children))

    def step(self, cloud_round, children, child_weights):
        self.steps.append((cloud_round, sorted(children), [child_weights[c] for c in
                                                           sorted(children)]))
        return {"w": children[0]["w"] + 100}


def test_a_cloud_step_is_told_each_round_and_gives_the_global_model():
    """Round 1's edges after 2 edge rounds: edge 0 = 3.0, edge 1 = 22/3 (weights 2 and 6);
    the step returns edge 0's + 100 = 103; round 2 starts there: edge 0 = 106, + 100."""
    step = Recorder()
    algo = HierarchicalSGD(settings(), cloud_step=step)
    final = algo.run(Fake(), {"w": torch.zeros(1)}, 2)
    assert step.begun == [(1, 0.0, 2), (2, pytest.approx(103.0), 2)]
    assert step.steps == [(1, [0, 1], [2.0, 6.0]), (2, [0, 1], [2.0, 6.0])]
    assert float(final["w"][0]) == pytest.approx(206.0)
    assert algo.state_dict()["cloud_step"].steps == step.steps


def test_an_executors_own_state_joins_the_checkpoint():
    class Stateful(Fake):
        def state_dict(self):
            return {"strikes": [1, 2]}

    algo, _, _, _ = run(settings(), fake=Stateful())
    assert algo.state_dict()["executor"] == {"strikes": [1, 2]}


def test_regrouping_asks_the_clients_gradients_at_the_current_global_model():
    """Gradient grouping regroups at the start of cloud round 2 (regroup_every 1) from the
    gradients at the global model then, 6.25 (round 1 above); at set-up, at 0."""
    class Gradients(Fake):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[float] = []

        def client_gradients(self, params):
            self.asked.append(float(params["w"][0]))
            return torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0]])

    fake = Gradients()
    algo = HierarchicalSGD(HSGDSettings(periods=(1, 2), groups=(2,), grouping="gradient",
                                        regroup_every=1))
    algo.run(fake, {"w": torch.zeros(1)}, 2)
    assert fake.asked == [0.0, pytest.approx(6.25, abs=1e-6)]


def test_the_cloud_aggregates_edge_servers_aggregates_by_their_weights():
    """Edges 0 and 1 report 3 and 22/3 with weights 2 and 6: (6 + 44) / 8 = 6.25; one
    cloud aggregation of 2 edges: 4 messages of 10 bytes."""
    algo = HierarchicalSGD(settings())
    algo.setup(Fake(), {"w": torch.zeros(1)})
    algo.begin_cloud_round(Fake(), 1)
    algo.aggregate_edges(1, {"w": torch.tensor([[3.0], [22 / 3]])}, np.array([0, 1]),
                         np.array([2.0, 6.0]))
    assert float(algo.global_params["w"][0]) == pytest.approx(6.25, abs=1e-6)
    assert algo.edge_models["w"].flatten().tolist() == pytest.approx([6.25, 6.25], abs=1e-6)
    assert algo.communication.as_dict() == {"client_edge_messages": 0, "edge_cloud_messages": 4,
                                            "client_edge_bytes": 0, "edge_cloud_bytes": 40}
    assert algo.node_models(2, np.zeros(1, dtype=np.int64))["w"].flatten().tolist() == \
        pytest.approx([6.25], abs=1e-6)
    assert algo.node_models(1, np.array([1]))["w"].flatten().tolist() == \
        pytest.approx([6.25], abs=1e-6)


@pytest.mark.parametrize("weighting,ratio,expected", [
    ("samples", 10.0, 13 / 7),  # evaluated rows 4, 1, 1, 1: (4*1 + 2 + 3 + 4) / 7
    ("uniform", 10.0, 2.5),     # every client 1: (1 + 2 + 3 + 4) / 4
    ("samples", 2.0, 11 / 5),   # rows capped at 2 x median 1: 2, 1, 1, 1
])
def test_the_evaluation_weighs_by_the_rows_each_client_evaluated(weighting, ratio, expected):
    from fedhier.round.reply_policy import ReplyPolicy

    evaluation = ClientEvaluation(loss=np.array([1.0, 2.0, 3.0, 4.0]),
                                  accuracy=np.zeros(4),
                                  num_examples=np.array([4, 1, 1, 1], dtype=np.int64))
    fake = Fake(evaluation=lambda params, cloud_round: evaluation)
    s = settings(weighting=weighting, policy=ReplyPolicy(max_weight_ratio=ratio))
    _, _, records, _ = run(s, fake=fake)
    assert records[0]["train_loss"] == pytest.approx(expected, abs=1e-12)


def test_a_checkpoint_holds_its_own_copy_and_a_resumed_run_takes_it_back():
    step = Recorder()
    algo = HierarchicalSGD(settings(), cloud_step=step)
    tree = Hierarchy((1, 2), (np.array([1, 0, 0, 1], dtype=np.int64),))
    algo.setup(Fake(), {"w": torch.zeros(1)}, hierarchy=tree)
    algo.cloud_round(Fake(), 1)
    state = algo.state_dict()
    assert set(state) == {"communication", "cloud_step", "hierarchy", "clock", "num_examples"}
    assert max(state["clock"]["edge_time"]) == algo.elapsed_seconds() > 0
    algo.cloud_round(Fake(), 2)  # the live step records round 2; the checkpoint does not
    assert len(step.steps) == 2 and len(state["cloud_step"].steps) == 1
    resumed = HierarchicalSGD(settings())
    resumed.load_state_dict(state)
    assert resumed.cloud_step is state["cloud_step"]
    resumed.setup(Fake(), {"w": torch.zeros(1)})
    assert resumed.hierarchy.edge_of_client().tolist() == [1, 0, 0, 1]  # not contiguous
    assert resumed.elapsed_seconds() == max(state["clock"]["edge_time"])
    kept = HierarchicalSGD(settings(), cloud_step=step)
    kept.load_state_dict({**state, "cloud_step": None})
    assert kept.cloud_step is step


@pytest.mark.parametrize("fednova,expected", [(True, 247 / 24), (False, 10.75)])
def test_fednova_rescales_stragglers_updates_by_hand(fednova, expected):
    """Seed 0, fraction 0.5: clients 0 and 2 are stragglers (draws 0.498, 0.927, 0.440,
    0.903), I = 2: they do 1 step, the others 2. FedNova: edge 0 (p = 1/2, 1/2; tau 1, 2)
    tau_eff = 1.5 and moves 1.5 * (1 + 2) / 2 = 2.25 per edge round; edge 1 (p = 1/3, 2/3;
    tau 1, 2) tau_eff = 5/3, moves 5/3 * 11/3 = 55/9. After G = 4: edges 4.5 and 110/9, the
    cloud (2 * 4.5 + 6 * 110/9) / 8 = 247/24. Without it: edges move 2.5 and 19/3 per edge
    round: (2 * 5 + 6 * 38/3) / 8 = 10.75."""
    s = settings(periods=(2, 4), workload=Workload(straggler_fraction=0.5,
                                                    normalize_updates=fednova))
    _, fake, _, final = run(s)
    assert fake.calls[0][0].steps.tolist() == [1, 2, 1, 2]
    assert final == pytest.approx(expected, abs=1e-5)


def test_an_edge_rounds_outcome_by_hand():
    """Edge round 1 of the run above (I = 1): level 1, no failure, loss 25/8 over weight 8."""
    algo = HierarchicalSGD(settings())
    fake = Fake()
    algo.setup(fake, {"w": torch.zeros(1)})
    algo.begin_cloud_round(fake, 1)
    work, plan = algo.plan(1)
    out = algo.complete(work, plan, fake.train(work, algo.start_models(work)))
    assert out == {"level": 1, "failed_clients": 0, "failed_edges": 0,
                   "train_loss": pytest.approx(3.125), "loss_weight": 8.0}
    work, plan = algo.plan(2)
    settled = algo.settle(work, plan, fake.train(work, algo.start_models(work)))
    assert settled.level == 2 and settled.survivors.tolist() == [0, 1, 2, 3]
    assert settled.models["w"].flatten().tolist() == pytest.approx([2.5, 3.5, 20 / 3, 23 / 3])
    assert float(algo.global_params["w"][0]) == 0.0  # settled: not aggregated yet
    algo.aggregate(settled)
    assert float(algo.global_params["w"][0]) != 0.0  # aggregated at the cloud


def test_diagnostics_and_the_evaluation_are_asked_at_the_rounds_global_model():
    class Asked(Fake):
        def __init__(self) -> None:
            super().__init__()
            self.gradients_at: list[float] = []
            self.evaluated: list[tuple[float, int]] = []

        def client_gradients(self, params):
            self.gradients_at.append(float(params["w"][0]))
            return torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0]])

        def evaluate(self, params, cloud_round):
            self.evaluated.append((float(params["w"][0]), cloud_round))
            return None

    fake = Asked()
    _, _, records, _ = run(settings(diagnostics_every=2), rounds=2, fake=fake)
    # round 0 and round 2 (every 2), each at the global model of that round
    assert fake.gradients_at == [0.0, pytest.approx(12.5, abs=1e-5)]
    assert fake.evaluated == [(0.0, 0), (pytest.approx(6.25, abs=1e-6), 1),
                              (pytest.approx(12.5, abs=1e-5), 2)]
    diagnostic = set(records[0]) - set(records[1])
    assert diagnostic and diagnostic <= set(records[2])


def test_a_clipped_middle_level_measures_from_its_last_aggregate():
    """Periods 1, 2, 4 over one region; aggregators mean, clip:1, mean. Step 2: edges 3 and
    22/3, the region clips both updates from 0 to norm 1: 1. Steps 3-4 from 1: edges 4 and
    25/3; the region measures from its last aggregate, 1 (not the global 0): updates 3 and
    22/3 clipped to 1: 2, the cloud's mean of one region: 2."""
    s = settings(periods=(1, 2, 4), groups=(2, 1), aggregators=("mean", "clip:1", "mean"))
    _, fake, _, final = run(s)
    assert fake.calls[2][1]["w"].flatten().tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert final == pytest.approx(2.0, abs=1e-6)

"""One hostile client of six, case by case, through ``fedhier run``'s own path
(:func:`fedhier.engines.grid_run.run_federation` on the in-process grid): every bad reply
either stops with one line naming the client (``--on-bad-reply stop``, exit 2) or is dropped
and the run finishes (``drop``), never exit 4 and never a hang (docs/security.md).

Identities checked: a dropped train reply leaves the final model exactly that of a client
whose ClientApp raised in those rounds; a dropped evaluate, profile or gradient reply leaves
it exactly the honest run's; a 10**12 size claim moves the model exactly as far as the
honest claim of the same poisoned model.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from safetensors.torch import load_file

from fedhier.cli.flags import error_text, exit_code_for
from fedhier.clients import app as fedhier_client
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig

HOSTILE = 2
CFG = RunConfig(dataset="digits", clients=6, groups=(2,), local_period=2, global_period=4,
                rounds=1, batch_size=8, seed=5, model="logreg", on_bad_reply="stop")

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_plots")


@pytest.fixture(scope="module")
def no_plots():
    """The curves are not under test here (two thirds of a run's time)."""
    import fedhier.runs.plots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fedhier.runs.plots, "plot_runs", lambda *a, **k: None)
        yield


def hostile_app(kind: str, corrupt, *, hostile: int = HOSTILE, **more) -> ClientApp:
    """fedhier's ClientApp, except that partition ``hostile`` passes its ``kind`` replies
    (train, evaluate, profile, gradient; more as ``kind=corrupt``) through ``corrupt``
    (reply -> reply)."""
    app = ClientApp()
    corruptions = {kind: corrupt, **more}

    def wrap(honest, handler_kind):
        def handler(msg: Message, context: Context) -> Message:
            reply = honest(msg, context)
            if (handler_kind in corruptions
                    and int(context.node_config["partition-id"]) == hostile):
                return corruptions[handler_kind](reply)
            return reply
        return handler

    app.train()(wrap(fedhier_client.train, "train"))
    app.evaluate()(wrap(fedhier_client.evaluate_local, "evaluate"))
    app.query()(wrap(fedhier_client.profile, "profile"))
    app.query("gradient")(wrap(fedhier_client.gradient, "gradient"))
    return app


def arrays(fn):
    def corrupt(reply):
        state = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = ArrayRecord(fn(dict(state)))
        return reply
    return corrupt


def metric(key, value):
    def corrupt(reply):
        reply.content["metrics"][key] = value
        return reply
    return corrupt


def gradient(fn):
    def corrupt(reply):
        g = reply.content["gradient"].to_torch_state_dict()["g"]
        reply.content["gradient"] = ArrayRecord(fn(g))
        return reply
    return corrupt


def _drop_first(state):
    del state[sorted(state)[0]]
    return state


def _raise(reply):
    raise RuntimeError("hostile client crashed")


#: case -> (reply kind, corruption, what the one line must say). The line names the client
#: as 'client 2' (train, evaluate, gradient replies) or by its node (profile replies).
CASES = {
    "float64": ("train", arrays(lambda s: {k: v.double() for k, v in s.items()}),
                r"client 2 \(node \d+\) replied '.*' as float64"),
    "missing-array": ("train", arrays(_drop_first), r"replied arrays without the model's \['"),
    "extra-array": ("train", arrays(lambda s: {**s, "extra": torch.zeros(2)}),
                    r"with arrays the model lacks \['extra'\]"),
    "no-arrays": ("train", lambda r: (r.content.array_records.pop("arrays"), r)[1],
                  "without ArrayRecord 'arrays'"),
    "entry-1e38": ("train", arrays(lambda s: {k: v.flatten().index_fill(0, torch.tensor([0]),
                                                                    1e38).reshape(v.shape)
                                             for k, v in s.items()}),
                   r"client 2 \(node \d+\) replied an update .* x the round's median length"),
    "num-examples-0": ("train", metric("num-examples", 0), "'num-examples' = 0"),
    "num-examples-nan": ("train", metric("num-examples", math.nan), "'num-examples' = nan"),
    "num-examples-inf": ("train", metric("num-examples", math.inf), "'num-examples' = inf"),
    "num-examples-negative": ("train", metric("num-examples", -5), "'num-examples' = -5"),
    "num-examples-fraction": ("train", metric("num-examples", 3.5), "'num-examples' = 3.5"),
    "accuracy-2": ("evaluate", metric("accuracy", 2.0), r"accuracy = 2.0: it must be in"),
    "accuracy-nan": ("evaluate", metric("accuracy", math.nan), r"accuracy = nan"),
    "loss-negative": ("evaluate", metric("loss", -100.0), r"loss = -100.0: it must be"),
    "profile-num-examples-nan": ("profile", metric("num-examples", math.nan),
                                 r"node \d+ replied 'num-examples' = nan"),
    "histogram-negative": ("profile", metric("label-histogram", [-5] + [40] * 9),
                           r"'label-histogram' = \[-5, .*counts >= 0"),
    "histogram-short": ("profile", metric("label-histogram", [40] * 9),
                        "of 9 classes, the others 10"),
    "gradient-short": ("gradient", gradient(lambda g: {"g": g[:-1]}),
                       r"client 2 \(node \d+\) replied gradient 'g' as float32"),
    "gradient-without-g": ("gradient", gradient(lambda g: {"h": g}), "without 'g'"),
}


def run(app: ClientApp, folder, cfg: RunConfig = CFG, timeout: float | None = None):
    """``fedhier run``'s path on an in-process grid of ``app``: (exit code, the one line or
    None, the records, the final model)."""
    if timeout is not None:
        cfg = cfg.replace(round_timeout=timeout)
    try:
        run_federation(InProcessGrid(app, cfg.clients, seed=cfg.seed), cfg,
                       RunFolder.create(folder), engine="inprocess", progress=False)
    except Exception as exc:  # noqa: BLE001 - the exit status is the assertion
        return exit_code_for(exc), error_text(exc), None, None
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return 0, None, records, load_file(str(folder / "model_final.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final models of the honest run and of the run whose hostile client raises in every
    train call (its edge rounds failed), with diagnostics on (gradient queries)."""
    base = tmp_path_factory.mktemp("reference")
    honest = run(hostile_app("none", lambda r: r), base / "honest",
                 CFG.replace(diagnostics_every=1))
    crashed = run(hostile_app("train", _raise), base / "crashed",
                  CFG.replace(diagnostics_every=1))
    assert honest[0] == 0 and crashed[0] == 0
    return {"honest": honest, "crashed": crashed}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_reply_stops_with_one_line_naming_the_client(case, tmp_path):
    kind, corrupt, line = CASES[case]
    code, text, _, _ = run(hostile_app(kind, corrupt), tmp_path / "run",
                           CFG.replace(diagnostics_every=int(kind == "gradient")))
    assert code == 2, text
    assert "\n" not in text and len(text) < 400
    assert re.search(line, text), text
    if kind != "profile":
        assert f"client {HOSTILE} (node " in text


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_reply_is_dropped_and_the_run_finishes(case, tmp_path, reference, caplog):
    kind, corrupt, _ = CASES[case]
    cfg = CFG.replace(diagnostics_every=1, on_bad_reply="drop")
    code, text, records, final = run(hostile_app(kind, corrupt), tmp_path / "run", cfg)
    assert code == 0, text
    assert any("dropped a bad reply" in r.getMessage() for r in caplog.records)
    expected = reference["crashed" if kind == "train" else "honest"][3]
    assert all(torch.equal(final[k], expected[k]) for k in expected), "dropped, not used"
    for record in records:
        assert 0 <= record.get("train_accuracy", 0) <= 1
        assert math.isfinite(record.get("train_loss", 0))
    if kind == "train":
        assert records[-1]["failed_clients"] == 2  # its two edge rounds
    if kind == "gradient":
        assert all("global_divergence" not in r for r in records)


def test_a_hostile_first_gradient_reply_blames_only_its_client(tmp_path, reference):
    """The expected gradient length is the model's, not the first reply's: a short gradient
    from client 0 (the first to answer) stops naming client 0, or under ``drop`` (K = 1)
    is dropped alone; a bad query reply is no bad training round, so nobody is excluded
    and the model is exactly the honest run's."""
    short = gradient(lambda g: {"g": g[:-1]})
    code, text, _, _ = run(hostile_app("gradient", short, hostile=0), tmp_path / "stop",
                           CFG.replace(diagnostics_every=1))
    assert code == 2 and "client 0 (node " in text, text
    cfg = CFG.replace(diagnostics_every=1, on_bad_reply="drop", exclude_after=1)
    code, text, records, final = run(hostile_app("gradient", short, hostile=0),
                                     tmp_path / "drop", cfg)
    assert code == 0, text
    assert all("excluded_clients" not in r for r in records)
    honest = reference["honest"][3]
    assert all(torch.equal(final[k], honest[k]) for k in honest)


def test_a_size_claim_gains_nothing(tmp_path):
    """The poisoned model (100 x the initial one) with a claim of 10**12 rows moves the
    global model exactly as far as with its honest size: its histogram sums to its rows."""
    poison = arrays(lambda s: {k: 100 * v for k, v in s.items()})
    cfg = CFG.replace(max_update_ratio=0)  # the poison is an outlying update otherwise
    honest = run(hostile_app("train", poison), tmp_path / "honest", cfg)[3]
    inflated = run(hostile_app("train", poison, profile=metric("num-examples", 10**12)),
                   tmp_path / "inflated", cfg)[3]
    initial = load_file(str(tmp_path / "honest" / "model_initial.safetensors"))
    assert max(float((honest[k] - initial[k]).abs().max()) for k in honest) > 1  # it moved
    finals = {"honest": honest, "inflated": inflated}
    assert all(torch.equal(finals["honest"][k], finals["inflated"][k]) for k in finals["honest"])


def test_an_outlying_gradient_is_flagged_not_averaged(tmp_path, reference):
    code, _, records, _ = run(hostile_app("gradient", gradient(lambda g: {"g": g * 1e6})),
                              tmp_path / "run", CFG.replace(diagnostics_every=1))
    assert code == 0
    assert all(r["diagnostics_flagged_clients"] == [HOSTILE] for r in records)
    assert all(math.isfinite(r["global_divergence"]) and r["global_divergence"] < 1e3
               for r in records)


def test_a_late_reply_is_dropped_and_a_silent_client_does_not_hang(tmp_path, reference,
                                                                  caplog):
    """round_timeout 1 s: a train reply 3 s late is dropped (as a crash would be); a client
    that never answers costs one timeout per message and the run finishes."""
    def slow(reply):
        time.sleep(3)
        return reply

    start = time.perf_counter()
    code, _, records, final = run(hostile_app("train", slow), tmp_path / "slow", timeout=1.0)
    assert code == 0 and records[-1]["failed_clients"] == 2
    lines = [r.getMessage() for r in caplog.records if "did not reply" in r.getMessage()
             and r.getMessage().startswith("edge round")]
    assert lines == [f"edge round {e}: 1 of 6 clients did not reply within 1 s: [{HOSTILE}]"
                     for e in (1, 2)]
    crashed = reference["crashed"][3]
    assert all(torch.equal(final[k], crashed[k]) for k in crashed)
    never = threading.Event()
    code, _, records, _ = run(hostile_app("evaluate", lambda r: never.wait(600) and r),
                              tmp_path / "never", timeout=1.0)
    never.set()
    assert code == 0 and len(records) == 2
    assert time.perf_counter() - start < 30


LATE_CLIENT_RUN = """
import sys, time, torch
import fedhier.engines.inprocess as engine
import fedhier.runs.plots
fedhier.runs.plots.plot_runs = fedhier.runs.plots.plot_groups = lambda *args, **kwargs: None
from tests.test_hostile_clients import hostile_app

def busy(reply):  # computes in torch far past the round timeout
    a, start = torch.randn(200, 200), time.time()
    while time.time() - start < 120:
        a = torch.tanh(a @ a)
    return reply

engine.client_app = hostile_app("train", busy)
from fedhier.cli.commands import main
sys.argv = ["fedhier", "run", "--dataset", "digits", "--clients", "4", "--groups", "2",
            "--rounds", "1", "--local-period", "1", "--global-period", "1",
            "--round-timeout", "1", "--on-bad-reply", "drop",
            "--out", sys.argv[1], "--no-progress"]
sys.exit(main())
"""


def test_a_client_still_computing_after_the_run_does_not_abort_fedhier_run(tmp_path):
    """``fedhier run`` whose client 2 computes in torch for 120 s (round timeout 1 s): the
    run finishes with exit 0 and its summary, in seconds (a daemon thread inside torch at
    interpreter shutdown aborted Python: exit 134)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LATE_CLIENT_RUN, str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()
    assert f"client(s) [{HOSTILE}] still computing a late reply" in done.stderr  # not its node
    assert time.perf_counter() - start < 60


def test_in_process_grid_close_waits_for_late_calls():
    """InProcessGrid.close(wait): a late call that ends within the wait leaves no thread; one
    that does not is named (its node)."""
    from flwr.app import MessageType, RecordDict

    release = threading.Event()
    app = ClientApp()

    @app.query()
    def held(msg, context):
        release.wait(30)
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, 1)
    node = next(iter(grid.get_node_ids()))
    message = Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=node)
    assert list(grid.send_and_receive([message], timeout=0.1)) == []  # late
    assert grid.close(wait=0.1) == [node]
    release.set()
    assert grid.close(wait=10) == []


def test_a_client_dropped_k_rounds_in_a_row_is_excluded(tmp_path):
    cfg = CFG.replace(on_bad_reply="drop", exclude_after=1, rounds=2)
    code, _, records, _ = run(hostile_app("train", metric("num-examples", 0)),
                              tmp_path / "run", cfg)
    assert code == 0
    assert records[-1]["excluded_clients"] == [HOSTILE]
    assert records[-1]["failed_clients"] == 2  # not sent, counted failed


def test_a_run_whose_every_client_is_excluded_stops(tmp_path):
    """Every train reply bad, K = 1: all six clients are excluded in round 1; the run stops
    (exit 3) with one line saying why instead of finishing having trained nothing."""
    bad = metric("num-examples", 0)
    every = ClientApp()
    every.train()(lambda msg, context: bad(fedhier_client.train(msg, context)))
    every.evaluate()(fedhier_client.evaluate_local)
    every.query()(fedhier_client.profile)
    cfg = CFG.replace(on_bad_reply="drop", exclude_after=1, rounds=2)
    code, text, _, _ = run(every, tmp_path / "run", cfg)
    assert code == 3, text
    assert text.startswith("every client is excluded after cloud round 1 (1 bad replies in "
                           "a row each)"), text
    assert "\n" not in text


def test_a_client_with_only_the_train_handler_runs_through_fedhier_run(tmp_path):
    """No profile, evaluate or query handlers: groups.json records no label proxy (None)
    instead of ending in exit 4."""
    from tests.test_hsgd import CFG as BARE_CFG
    from tests.test_hsgd import bare_app

    code, text, records, _ = run(bare_app(), tmp_path / "run", BARE_CFG.replace(rounds=1))
    assert code == 0, text
    groups = json.loads((tmp_path / "run" / "groups.json").read_text())
    assert groups["label_upward_divergence"] is None and len(records) == 2


def test_allowed_sizes_closed_form():
    import numpy as np

    from fedhier.round.reply_policy import allowed_sizes

    claimed = np.array([100, 10**12, 80, 0, 120, 5000])
    sums = np.array([100, 344, 80, 50, 0, 5000])  # client 1 lies in its claim only
    # min(claim, sum) where both: [100, 344, 80, 0, 120, 5000]; median of the positive
    # ones (80, 100, 120, 344, 5000) = 120, cap 10 x 120 = 1200 -> client 5 capped
    assert allowed_sizes(claimed, sums, 10.0).tolist() == [100, 344, 80, 0, 120, 1200]
    assert allowed_sizes(claimed, sums, 0.0).tolist() == [100, 344, 80, 0, 120, 5000]
    honest = np.array([149, 231, 232, 300, 180, 220])
    assert allowed_sizes(honest, honest, 10.0).tolist() == honest.tolist()


def test_on_bad_reply_auto_is_drop_on_real_processes_and_stop_in_simulations():
    from fedhier.cli.flags import OneLineParser
    from fedhier.engines.deployment.cli import add_parser, resolve_config

    def parse(*argv):
        parser = OneLineParser(prog="fedhier")
        add_parser(parser.add_subparsers(dest="command", required=True))
        return parser.parse_args(["deploy", "local", *argv])

    assert CFG.replace(on_bad_reply="auto").reply_policy().on_bad_reply == "stop"
    edge_tier = CFG.replace(on_bad_reply="auto", edge_servers=True)
    assert edge_tier.reply_policy().on_bad_reply == "drop"
    assert resolve_config(parse("--nodes", "4")).on_bad_reply == "drop"
    assert resolve_config(parse("--nodes", "4", "--on-bad-reply", "stop")).on_bad_reply == "stop"


def test_an_evaluate_reply_without_metrics_is_named(tmp_path, caplog):
    def bare(reply):
        reply.content.metric_records.pop("metrics")
        return reply

    code, _, records, _ = run(hostile_app("evaluate", bare), tmp_path / "run")
    assert code == 0 and len(records) == 2
    said = f"client(s) [{HOSTILE}] replied without a loss (loss/eval_loss) or an accuracy"
    assert any(said in r.getMessage() for r in caplog.records)


def test_the_reply_guard_state_round_trips_and_refuses_a_damaged_one():
    from fedhier.round.reply_policy import ReplyGuard

    guard = ReplyGuard(streak={4: 2, 1: 1}, excluded={3: "3 bad replies in a row"})
    state = guard.state_dict()
    assert state == {"streak": [[1, 1], [4, 2]], "excluded": [[3, "3 bad replies in a row"]]}
    fresh = ReplyGuard()
    fresh.load_state_dict(state)
    assert (fresh.streak, fresh.excluded) == (guard.streak, guard.excluded)
    for damaged in ({"streak": "x", "excluded": []}, {"streak": [[1, "2"]], "excluded": []},
                    {"streak": [], "excluded": [[True, "x"]]}):
        with pytest.raises(TypeError):
            ReplyGuard().load_state_dict(damaged)
    with pytest.raises(KeyError):
        ReplyGuard().load_state_dict({"streak": []})

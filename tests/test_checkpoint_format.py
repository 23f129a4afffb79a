"""checkpoint.pt is safetensors + JSON: reading one runs no code from it.

A pickled checkpoint whose unpickling would create a file is refused in one line (exit 2)
and the file is not created; a JSON header naming a function or class outside the allow-list
(``os:system``) is refused as damaged; every kind of value a run's state holds comes back
exactly (the resume-equality tests in test_faults.py, test_async_edges.py, test_mobility.py
check whole runs).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from fedhier.cli.commands import main
from fedhier.common.errors import DamagedFileError
from fedhier.runs.checkpoint import FORMAT_KEY, FORMAT_VERSION, read_checkpoint_file
from fedhier.runs.state_codec import decode, encode
from fedhier.strategies.cloud_step import FlowerCloudStep, make_cloud_strategy
from fedhier.tree.hierarchy import Hierarchy

ROOT = Path(__file__).resolve().parents[1]


class CreatesAFile:
    """Unpickling this creates ``target`` (what a hostile checkpoint's author could do)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.target}",))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["run", "--dataset", "digits", "--clients", "4", "--groups", "2",
                 "--rounds", "2", "--local-period", "2", "--global-period", "4",
                 "--checkpoint-every", "1", "--cloud-strategy", "fedadam", "--out", str(out),
                 "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_resume_refuses_a_pickled_checkpoint_and_runs_none_of_it(run_folder, tmp_path, capsys,
                                                                 how):
    folder = tmp_path / "run"
    shutil.copytree(run_folder, folder)
    target = tmp_path / "created-by-the-checkpoint"
    payload = {"round": 1, "global_state": CreatesAFile(target)}
    with open(folder / "checkpoint.pt", "wb") as handle:
        if how == "torch.save":
            torch.save(payload, handle)
        else:
            pickle.dump(payload, handle)
    metrics_before = (folder / "metrics.jsonl").read_bytes()
    assert main(["run", "--resume", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder / "checkpoint.pt") in err[0], err
    assert "never unpickles" in err[0]
    assert not target.exists()
    assert (folder / "metrics.jsonl").read_bytes() == metrics_before


def header_with(tree: object) -> bytes:
    return save({}, metadata={FORMAT_KEY: json.dumps({"version": FORMAT_VERSION,
                                                      "state": tree})})


@pytest.mark.parametrize("tree", [
    {"$function": "os:system"},
    {"round": 1, "global_state": {}, "strategy_state": {"x": {"$object": "os:system",
                                                              "state": {}}},
     "wall_seconds": 0.0},
    {"round": 1, "global_state": {"w": {"$tensor": "missing"}}, "strategy_state": {},
     "wall_seconds": 0.0},
    {"$ndarray": "0:x", "dtype": "|O", "shape": [1]},
    {"$unknown": 1},
])
def test_a_header_outside_the_format_is_damaged(tmp_path, tree):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(header_with(tree))
    with pytest.raises(DamagedFileError, match=str(path)):
        read_checkpoint_file(path)


def test_every_kind_of_state_value_comes_back_exactly():
    step = FlowerCloudStep(make_cloud_strategy("fedadam"))
    step.strategy.m_t = {"w": np.array([1e-300, np.nan, -0.0], dtype=np.float64)}
    state = {"round": 3, "w": torch.tensor([0.1, float("inf")], dtype=torch.float64),
             "half": torch.ones(2, 3, dtype=torch.bfloat16), "ints": {0: {"m": torch.arange(3)}},
             "tuple": (1, 2.5, "x", None, True), "nan": float("nan"), "big": 2 ** 70,
             "scalar": np.float32(0.1), "step": step,
             "hierarchy": Hierarchy((2, 4), (np.array([0, 0, 1, 1]),), 2), "$key": b"\x00"}
    tree, tensors = encode(state)
    json.dumps(tree, allow_nan=False)  # strict JSON
    back = decode(json.loads(json.dumps(tree)), tensors)
    assert back["round"] == 3 and back["big"] == 2 ** 70 and back["$key"] == b"\x00"
    assert torch.equal(back["w"], state["w"]) and back["w"].dtype == torch.float64
    assert torch.equal(back["half"], state["half"]) and back["half"].dtype == torch.bfloat16
    assert torch.equal(back["ints"][0]["m"], torch.arange(3))
    assert back["tuple"] == (1, 2.5, "x", None, True) and np.isnan(back["nan"])
    assert back["scalar"] == np.float32(0.1) and type(back["scalar"]) is np.float32
    m_t = back["step"].strategy.m_t["w"]
    assert m_t.tobytes() == state["step"].strategy.m_t["w"].tobytes()
    assert type(back["step"].strategy) is type(step.strategy)
    assert back["step"].strategy.train_metrics_aggr_fn is step.strategy.train_metrics_aggr_fn
    assert back["hierarchy"].periods == (2, 4)
    assert back["hierarchy"].parents[0].tolist() == [0, 0, 1, 1]


def test_a_checkpoint_holds_no_pickle(run_folder):
    blob = (run_folder / "checkpoint.pt").read_bytes()
    assert blob[:1] != b"\x80" and blob[:2] != b"PK"
    checkpoint = read_checkpoint_file(run_folder / "checkpoint.pt")
    assert checkpoint.round == 2
    assert type(checkpoint.strategy_state["cloud_step"]) is FlowerCloudStep


def _set(path: str, value: object):
    """A mutation of the checkpoint's state tree: the entry at ``a/b/c`` set to ``value``."""
    def mutate(state: dict, tensors: dict) -> None:
        *parents, last = path.split("/")
        for key in parents:
            state = state[key]
        state[last] = value(state, tensors) if callable(value) else value
    return mutate


def _global_to_int8(state: dict, tensors: dict) -> None:
    for entry in state["global_state"].values():
        tensors[entry["$tensor"]] = tensors[entry["$tensor"]].to(torch.int8)


def _global_to_nan(state: dict, tensors: dict) -> None:
    for entry in state["global_state"].values():
        tensors[entry["$tensor"]] = torch.full_like(tensors[entry["$tensor"]], float("nan"))


#: Crafted checkpoints (the review's repros): each must be refused in one line naming the
#: file, exit 2, before anything of the run folder changes (not exit 4, nor exit 3 blaming
#: the clients for a model of the wrong dtype or a non-finite one, nor a run that finishes
#: with a NaN duration).
CRAFTED = {
    "communication not a table": _set("strategy_state/communication", "x"),
    "communication extra key": _set("strategy_state/communication/bogus", 1),
    "strategy state empty": _set("strategy_state", {}),
    "grouping parents a string": _set("strategy_state/hierarchy/state/parents", "abc"),
    "grouping without attributes": _set("strategy_state/hierarchy/state", {}),
    "grouping of other edges": _set("strategy_state/hierarchy/state/num_edges", 5),
    "clock of strings": _set("strategy_state/clock", {"edge_time": "zz"}),
    "clock too short": _set("strategy_state/clock", {"edge_time": [1.0]}),
    "cloud step a grouping": _set("strategy_state/cloud_step",
                                  lambda st, t: copy.deepcopy(st["hierarchy"])),
    "cloud step missing": _set("strategy_state/cloud_step", None),
    "clients' state malformed": _set("client_states", {"$dict": [[0, "x"]]}),
    "global model int8": lambda st, t: _global_to_int8(st, t),
    "global model nan": lambda st, t: _global_to_nan(st, t),
    "elapsed seconds nan": _set("wall_seconds", {"$float": "nan"}),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_checkpoint_is_one_line_exit_2(run_folder, tmp_path, capsys, case):
    folder = tmp_path / "run"
    shutil.copytree(run_folder, folder)
    data = (folder / "checkpoint.pt").read_bytes()
    tensors = load(data)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(json.loads(data[8:8 + size])["__metadata__"][FORMAT_KEY])
    header["state"]["round"] = 1  # a round still to run: every restored part would be used
    CRAFTED[case](header["state"], tensors)
    (folder / "checkpoint.pt").write_bytes(save(tensors, metadata={FORMAT_KEY:
                                                                    json.dumps(header)}))
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert main(["run", "--resume", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder / "checkpoint.pt") in err[0], err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def test_the_reader_imports_no_strategy_layer_and_refuses_unregistered_classes(run_folder):
    """fedhier.runs.state_codec imports nothing of the strategy layer: in a process that has not
    imported it, a checkpoint holding a Flower cloud strategy names an unregistered class and
    is refused in one line (the CLI imports the layer first: the resume tests above)."""
    code = ("import sys\nfrom fedhier.runs.checkpoint import read_checkpoint_file\n"
            "from fedhier.common.errors import DamagedFileError\n"
            f"try:\n    read_checkpoint_file({str(run_folder / 'checkpoint.pt')!r})\n"
            "except DamagedFileError as exc:\n    print(exc)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('flwr', 'fedhier.strat'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert "FlowerCloudStep', not on the allow-list" in out and out.endswith("[]\n"), out


@pytest.mark.parametrize("first_byte", [0x80, ord("P")])
def test_a_header_length_that_looks_like_a_pickle_is_still_read(tmp_path, first_byte):
    """A safetensors file opens with its header's length: 0x580 starts with 0x80 like a
    pickle, 0x4B50 with "PK" like a zip; the JSON brace after it says safetensors."""
    from fedhier.runs.checkpoint import Checkpoint, checkpoint_bytes

    base = Checkpoint(round=3, global_state={"w": torch.arange(6.0).reshape(2, 3)},
                      strategy_state={"note": ""}, wall_seconds=1.5)
    wanted = first_byte if first_byte == 0x80 else 0x4B50
    for pad in range(0, 0x5000):
        base.strategy_state["note"] = "x" * pad
        data = checkpoint_bytes(base)
        length = int.from_bytes(data[:8], "little")
        if length % 256 == first_byte and (first_byte == 0x80 or length == wanted):
            break
    else:
        pytest.fail("no padding gives the header length wanted")
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    back = read_checkpoint_file(path)
    assert back.round == 3 and back.strategy_state == base.strategy_state
    assert torch.equal(back.global_state["w"], base.global_state["w"])


def test_a_checkpoint_written_before_the_layout_move_still_decodes():
    """Headers name classes by module:qualname; those of the release before the layout
    (fedhier.topology, fedhier.async_edges:EdgeJob, fedhier_strategies.cloud_step) come
    back as today's classes with their attributes."""
    from fedhier.round.asynchrony.edges import EdgeTraining

    job = EdgeTraining(1, 2, {"p": torch.ones(2)}, 3.5, None, np.array([0, 1]))
    state = {"hierarchy": Hierarchy((2, 4), (np.array([0, 0, 1, 1]),), 2), "job": job,
             "step": FlowerCloudStep(make_cloud_strategy("fedavgm"))}
    tree, tensors = encode(state)
    old = json.loads(json.dumps(tree).replace(
        "fedhier.tree.hierarchy:Hierarchy", "fedhier.topology:Hierarchy").replace(
        "fedhier.round.asynchrony.edges:EdgeTraining", "fedhier.async_edges:EdgeJob").replace(
        "fedhier.strategies.cloud_step:", "fedhier_strategies.cloud_step:"))
    assert "fedhier.topology:Hierarchy" in json.dumps(old)
    back = decode(old, tensors)
    assert type(back["job"]) is EdgeTraining and back["job"].finish == 3.5
    assert back["job"].survivors.tolist() == [0, 1] and back["hierarchy"].periods == (2, 4)
    assert type(back["step"]) is FlowerCloudStep

"""The command line: a default-shaped run writes a complete run folder; bad input exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhier.cli.commands import main

TINY = ["--clients", "6", "--groups", "2", "--local-period", "2", "--global-period", "4",
        "--rounds", "2", "--no-progress"]


def test_run_writes_complete_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *TINY, "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "partition.json", "groups.json", "metrics.jsonl", "summary.json",
            "model_initial.safetensors", "model_final.safetensors", "curves.png"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["clients"] == 6 and config["engine"] == "inprocess"
    assert config["periods"] == [2, 4] and config["iterations"] == 8
    partition = json.loads((out / "partition.json").read_text())
    rows = [r for c in partition["clients"] for r in c["rows"]]
    assert len(rows) == len(set(rows)) == 1437  # digits train split, disjoint, covered
    groups = json.loads((out / "groups.json").read_text())
    assert sorted(groups["client_to_edge"]) == [0, 0, 0, 1, 1, 1]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for key in ("iteration", "test_accuracy", "test_loss", "train_loss", "wall_seconds",
                "client_edge_messages", "edge_cloud_messages", "client_edge_bytes",
                "edge_cloud_bytes"):
        assert key in records[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_accuracy"] == records[-1]["test_accuracy"]
    assert summary["weighting"] == "samples" and summary["iterations"] == 8
    assert "final test accuracy" in capsys.readouterr().out


def test_config_file_and_flag_override(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('clients = 6\ngroups = 3\nlocal-period = 2\nglobal_period = 4\nrounds = 1\n'
                   'grouping = "contiguous"\n')
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--groups", "2", "--no-progress",
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["groups"] == [2] and config["grouping"] == "contiguous"
    assert json.loads((out / "groups.json").read_text())["client_to_edge"] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("args,message", [
    (["--local-period", "5", "--global-period", "12"], "multiple of local_period"),
    (["--alpha", "0"], "alpha must be > 0"),
    (["--alpha", "-1"], "alpha must be > 0"),
    (["--groups", "30"], "more groups"),
    (["--dataset", "imagenet"], "unknown dataset"),
    (["--model", "resnet"], "unknown model"),
    (["--dataset", "fashion-mnist", "--data-path", "/nonexistent"], "apt-get install"),
    (["--clients", "200", "--alpha", "0.01", "--min-partition-size", "10"], "Dirichlet"),
    (["--engine", "spark"], "unknown engine"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, message):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fedhier.cli", "run", *args, "--no-progress",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_existing_run_folder_is_not_clobbered(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["run", *TINY, "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "precious"
    assert not (out / "metrics.jsonl").exists()


def test_missing_config_file_and_argparse_errors(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "none.toml")]) == 2
    capsys.readouterr()
    assert main(["run", "--rounds", "many"]) == 2  # main returns argparse's code too
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rounds" in err[0] and "invalid int value" in err[0], err


def test_plot_overlays_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", *TINY, "--out", str(a)]) == 0
    assert main(["run", *TINY, "--local-period", "4", "--out", str(b)]) == 0
    png = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "nothing"), "--out", str(png)]) == 2


def test_readme_example_runs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["result"].evaluate_metrics_clientapp) == 6  # rounds 0..5
    final_loss = namespace["result"].evaluate_metrics_clientapp[5]["loss"]
    assert final_loss < namespace["result"].evaluate_metrics_clientapp[0]["loss"] - 0.5


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
                    .exists(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_short_run(tmp_path):
    out = tmp_path / "fm"
    assert main(["run", "--dataset", "fashion-mnist", "--clients", "10", "--groups", "2",
                 "--local-period", "5", "--global-period", "10", "--rounds", "2",
                 "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.5  # 20 steps of 10 clients: well above 0.1
    config = json.loads((out / "config.json").read_text())
    assert config["train_rows"] == 60000 and config["test_rows"] == 10000

"""Fuzz family: damaged data files. Every format the local loader reads (npz, csv, parquet,
and a save_to_disk folder: its .arrow data and its JSON state files) is cut short at several
offsets, has bytes flipped, is emptied, carries the wrong extension, is a folder in place of
a file, or cannot be read (no read permission: skipped when the tests run as root, since root
reads every file). The rule: a readable file loads (exit 0); a damaged one ends in exactly one
line naming the file (exit 2): never a traceback, never exit 4's "this is a bug" line.

The cases call the loader in-process through the CLI's own error mapping
(:func:`fedhier.cli.flags.run_command`), so each costs a load, not an interpreter start; two
subprocess runs of ``fedhier run`` prove the exit code and that an existing run folder given
to ``--out --overwrite`` is left untouched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import build_parser
from fedhier.cli.flags import EXIT_BAD_INPUT, config_from_args, prepare_data, run_command
from fedhier.data.loaders import clear_cache

ROWS, WIDTH, CLASSES = 48, 6, 3
#: Fractions of the file kept when it is cut short, and seeds of the byte flips.
CUTS = (0.05, 0.3, 0.6, 0.97)
FLIPS = (0, 1, 2)
COUNTS: Counter[str] = Counter()


def arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((ROWS, WIDTH)).astype(np.float32), np.arange(ROWS) % CLASSES


def write_format(fmt: str, folder: Path) -> tuple[Path, list[str]]:
    """The data file (or folder) of one format and the flags that read it."""
    import datasets
    import pandas as pd

    x, y = arrays()
    folder.mkdir(parents=True)
    if fmt == "npz":
        path = folder / "data.npz"
        np.savez(path, x=x, y=y)
        return path, ["--data-path", str(path)]
    columns = [f"f{i}" for i in range(WIDTH)]
    if fmt == "csv":
        path = folder / "data.csv"
        frame = pd.DataFrame(x, columns=columns)
        frame["label"] = y
        frame.to_csv(path, index=False)
        features = "[" + ", ".join(f'"{c}"' for c in columns) + "]"
    elif fmt == "parquet":
        path = folder / "data.parquet"
        pd.DataFrame({"x": list(x), "label": y}).to_parquet(path)
        features = '"x"'
    else:  # a save_to_disk folder
        path = folder / "disk"
        datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).save_to_disk(
            str(path))
        features = '"x"'
    toml = folder / "data.toml"
    toml.write_text(f'name = "mine"\nsource = "local"\npath = "{path.name}"\n'
                    f"num_classes = {CLASSES}\ninput_shape = [{WIDTH}]\n"
                    f'feature_columns = {features}\nlabel_column = "label"\nscale = 1.0\n')
    return path, ["--dataset", str(toml)]


def target_files(fmt: str, path: Path) -> list[Path]:
    """The files of a format's data that a case damages."""
    if fmt != "disk":
        return [path]
    return sorted(path.glob("*.arrow")) + [path / "state.json", path / "dataset_info.json"]


def cut(at: float) -> Callable[[Path], None]:
    def damage(file: Path) -> None:
        blob = file.read_bytes()
        file.write_bytes(blob[:max(1, int(len(blob) * at))])
    return damage


def flip(seed: int) -> Callable[[Path], None]:
    def damage(file: Path) -> None:
        blob = bytearray(file.read_bytes())
        rng = np.random.default_rng(seed)
        for at in rng.integers(0, len(blob), 4):
            blob[at] ^= 0xFF
        file.write_bytes(bytes(blob))
    return damage


def empty(file: Path) -> None:
    file.write_bytes(b"")


def folder_instead(file: Path) -> None:
    file.unlink()
    file.mkdir()
    (file / "inside.txt").write_text("a folder where the file was\n")


def unreadable(file: Path) -> None:
    file.chmod(0)


DAMAGES: dict[str, Callable[[Path], None]] = {
    **{f"cut-{at}": cut(at) for at in CUTS}, **{f"flip-{s}": flip(s) for s in FLIPS},
    "empty": empty, "folder-instead": folder_instead}


def load_outcome(flags: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of loading the data of ``fedhier run FLAGS``, in-process, through
    the CLI's mapping of exceptions to lines and exit codes."""
    clear_cache()
    args = build_parser().parse_args(["run", "--clients", "2", "--groups", "1",
                                      "--partition", "iid", "--min-partition-size", "1",
                                      *flags])

    def load(args: object) -> int:
        prepare_data(config_from_args(args))  # type: ignore[arg-type]
        return 0

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_command(load, args)
    return code, err.getvalue()


def check(code: int, err: str, names: list[str], what: str) -> None:
    COUNTS[f"exit {code}"] += 1
    assert "Traceback" not in err, f"{what}: traceback\n{err}"
    assert "this is a bug" not in err and code != 4, f"{what}: exit 4\n{err}"
    assert code in (0, EXIT_BAD_INPUT), f"{what}: exit {code}\n{err}"
    if code:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("fedhier: error: "), f"{what}: {lines}"
        assert any(name in lines[0] for name in names), f"{what}: names no file: {lines[0]}"


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    base = tmp_path_factory.mktemp("formats")
    return {fmt: write_format(fmt, base / fmt) for fmt in ("npz", "csv", "parquet", "disk")}


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The csv/parquet loads' arrow caches go to a temporary folder, not the user's."""
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf-cache")
    yield
    datasets.config.HF_DATASETS_CACHE = saved


@pytest.mark.parametrize("fmt", ["npz", "csv", "parquet", "disk"])
def test_damaged_files_of_every_format_end_in_one_line(fmt, originals, tmp_path,
                                                       one_torch_thread):
    source, _ = originals[fmt]
    code, err = load_outcome(write_format(fmt, tmp_path / "intact")[1])
    assert code == 0, f"the intact {fmt} data must load: {err}"
    cases = 0
    for file_index, name in enumerate(p.name for p in target_files(fmt, source)):
        for damage, apply in DAMAGES.items():
            case = tmp_path / f"{file_index}-{damage}"
            path, flags = write_format(fmt, case)
            file = path / name if fmt == "disk" else path
            apply(file)
            code, err = load_outcome(flags)
            # a csv cut short can be a valid shorter table: then the error is about its rows
            # and names the dataset ('mine', its TOML)
            check(code, err, [str(path), str(file), "'mine'", str(case / "data.toml")],
                  f"{fmt} {name} {damage}")
            if damage in ("empty", "folder-instead", "cut-0.05") \
                    and file.suffix in (".npz", ".csv", ".parquet", ".arrow"):
                assert code == EXIT_BAD_INPUT, f"{fmt} {damage} loaded: {err}"
            cases += 1
            shutil.rmtree(case)
    assert cases >= 8


@pytest.mark.skipif(os.geteuid() == 0, reason="the tests run as root, who reads any file: "
                    "a file without read permission cannot be made here")
@pytest.mark.parametrize("fmt", ["npz", "csv", "parquet", "disk"])
def test_a_file_without_read_permission_is_named(fmt, tmp_path):
    path, flags = write_format(fmt, tmp_path / "case")
    file = target_files(fmt, path)[0]
    unreadable(file)
    try:
        code, err = load_outcome(flags)
    finally:
        file.chmod(0o600)
    check(code, err, [str(path), str(file)], f"{fmt} unreadable")
    assert code == EXIT_BAD_INPUT


@pytest.mark.parametrize("wrong", [("npz", ".csv"), ("csv", ".npz"), ("parquet", ".csv"),
                                   ("csv", ".parquet")])
def test_a_file_with_the_wrong_extension_is_named(wrong, originals, tmp_path):
    fmt, suffix = wrong
    source, _ = originals[fmt]
    renamed = tmp_path / f"data{suffix}"
    shutil.copy(source, renamed)
    if suffix == ".npz":
        flags = ["--data-path", str(renamed)]
    else:
        _, flags = write_format("csv" if suffix == ".csv" else "parquet", tmp_path / "toml")
        flags = [*flags, "--data-path", str(renamed)]
    code, err = load_outcome(flags)
    check(code, err, [str(renamed)], f"{fmt} named {suffix}")
    assert code == EXIT_BAD_INPUT


def test_empty_npz_and_negative_labels_name_the_array_row_and_rule(tmp_path):
    x, y = arrays()
    np.savez(tmp_path / "none.npz")
    code, err = load_outcome(["--data-path", str(tmp_path / "none.npz")])
    assert code == 2 and "holds no arrays" in err and "none.npz" in err
    np.savez(tmp_path / "rows.npz", x=x[:0], y=y[:0])
    code, err = load_outcome(["--data-path", str(tmp_path / "rows.npz")])
    assert code == 2 and "array 'x' has no rows" in err
    y = y.copy()
    y[17] = -2
    np.savez(tmp_path / "neg.npz", x=x, y=y)
    code, err = load_outcome(["--data-path", str(tmp_path / "neg.npz")])
    assert code == 2 and "array 'y': row 17 holds label -2" in err, err
    assert "labels are class indices >= 0" in err


def test_the_command_exits_2_and_leaves_an_existing_run_folder_alone(originals, tmp_path):
    """A real ``fedhier run`` process given a truncated .npz and ``--overwrite`` of an
    existing folder exits 2 with one line naming the file and leaves the folder as it was;
    a damaged csv (in-process, through ``main``) creates no run folder."""
    from fedhier.cli.commands import main

    folder = tmp_path / "earlier-run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"round": 0}\n')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    npz = tmp_path / "cut.npz"
    npz.write_bytes(originals["npz"][0].read_bytes()[:300])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "fedhier.cli", "run", "--clients", "2",
                           "--groups", "1", "--no-progress", "--data-path", str(npz), "--out",
                           str(folder), "--overwrite"], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and str(npz) in lines[0], proc.stderr
    assert "this is a bug" not in proc.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    csv_path, csv_flags = write_format("csv", tmp_path / "csv")
    csv_path.write_bytes(b"f0,f1\n\x00\xff\x00garbage\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--clients", "2", "--groups", "1", "--no-progress", *csv_flags,
                     "--out", str(tmp_path / "new")])
    assert code == 2 and str(csv_path) in err.getvalue(), err.getvalue()
    assert not (tmp_path / "new").exists()


def test_zz_counts(tmp_path_factory):
    """The counts of this module's cases, for the record (docs/faults.md)."""
    target = tmp_path_factory.getbasetemp() / "fuzz-files-counts.json"
    target.write_text(json.dumps(dict(COUNTS), indent=1) + "\n")
    assert COUNTS.get("exit 4", 0) == 0

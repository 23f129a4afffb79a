"""A sweep spec: base configuration, axes, seeds; expanded into arms and trials.

TOML layout (every key optional except at least one of grid/zip/random/tune)::

    out = "runs/my-sweep"           # the sweep folder
    seeds = [0, 1, 2]               # or an int K = seeds 0..K-1
    target_accuracy = 0.8           # for the "to target" statistics
    at_iterations = [100, 200]      # accuracy at these iterations
    compare = "grouping"            # paired differences along this axis (default: first)
    baseline = "random"             # the value the others are compared to (default: first)
    [base]   ...RunConfig keys...
    [grid]   key = [v1, v2]         # cartesian product
    [zip]    a = [1, 2]; b = [3, 4] # varied together (equal lengths); an optional
             name = ["x", "y"]      # names the zipped rows (folders, tables) instead
    [random] samples = 4; sample_seed = 0
             lr = {low = 0.01, high = 0.5, log = true}   # or a list to choose from
    [tune]   lr = [0.03, 0.1]       # chosen per arm by validation accuracy

Every arm's configuration is validated here, before anything runs: a bad key or value is a
one-line :class:`~fedhier.common.errors.ConfigError` naming it (exit code 2).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.settings.run_config import RunConfig, read_toml

TOP_KEYS = {"out", "seeds", "target_accuracy", "at_iterations", "compare", "baseline",
            "base", "grid", "zip", "random", "tune"}
RUN_KEYS = {f.name for f in fields(RunConfig)}
#: settings a sweep owns: the seed comes from ``seeds``, the folder from the sweep
OWNED = {"seed", "out"}


@dataclass(frozen=True)
class Arm:
    """One configuration compared in the sweep: ``values`` are its axis settings (tuned
    axes excluded), ``candidates`` its configurations, one per tuned value (one if none)."""

    name: str
    values: dict[str, Any]
    candidates: tuple[tuple[dict[str, Any], RunConfig], ...]


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep: arms x seeds."""

    out: Path
    seeds: tuple[int, ...]
    axes: tuple[str, ...]
    tuned: tuple[str, ...]
    arms: tuple[Arm, ...]
    zipped: tuple[str, ...] = ()
    target_accuracy: float | None = None
    at_iterations: tuple[int, ...] = ()
    compare: str | None = None
    baseline: Any = None
    base: dict[str, Any] = field(default_factory=dict)


def _key(name: Any, where: str) -> str:
    key = str(name).replace("-", "_")
    if key == "name" and where == "zip":
        return key
    if key in OWNED:
        raise ConfigError(f"{where}: '{name}' is set by the sweep (use seeds = [...] and out)")
    if key not in RUN_KEYS:
        import difflib

        close = difflib.get_close_matches(key, sorted(RUN_KEYS), n=1)
        raise ConfigError(f"{where}: unknown setting '{name}'"
                          + (f"; did you mean '{close[0]}'?" if close else ""))
    return key


def _values(table: Any, where: str) -> dict[str, list[Any]]:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table of setting = [values]")
    out = {}
    for name, values in table.items():
        key = _key(name, where)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}.{name} must be a non-empty list of values")
        out[key] = values
    return out


def _random_draws(table: Any, where: str = "random") -> list[dict[str, Any]]:
    """``samples`` seeded draws: a {low, high, log?, integer?} range or a list to choose from."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table")
    table = dict(table)
    samples = table.pop("samples", None)
    seed = table.pop("sample_seed", 0)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ConfigError(f"{where}.samples must be a positive integer, got {samples!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{where}.sample_seed must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(seed)
    ranges: dict[str, Any] = {}
    for name, value in table.items():
        key = _key(name, where)
        if isinstance(value, list) and value:
            ranges[key] = value
            continue
        if not isinstance(value, Mapping) or set(value) - {"low", "high", "log", "integer"} \
                or not {"low", "high"} <= set(value):
            raise ConfigError(f"{where}.{name} must be a list or {{low, high, log, integer}}")
        low, high = value["low"], value["high"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) \
                or not low < high or (value.get("log") and low <= 0):
            raise ConfigError(f"{where}.{name}: need numbers low < high (> 0 with log), got "
                              f"{low!r}, {high!r}")
        ranges[key] = dict(value)
    draws = []
    for _ in range(samples):
        draw = {}
        for key, spec in ranges.items():  # one fixed order: the same draws every time
            if isinstance(spec, list):
                draw[key] = spec[int(rng.integers(len(spec)))]
            elif spec.get("log"):
                draw[key] = float(math.exp(rng.uniform(math.log(spec["low"]),
                                                       math.log(spec["high"]))))
            else:
                draw[key] = float(rng.uniform(spec["low"], spec["high"]))
            if not isinstance(spec, list) and spec.get("integer"):
                draw[key] = int(round(draw[key]))
        draws.append(draw)
    return draws


def _seeds(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"seeds must be >= 1 or a list of seeds, got {value}")
        return tuple(range(value))
    if isinstance(value, list) and value and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"seeds repeat a seed: {value}")
        return tuple(value)
    raise ConfigError(f"seeds must be a count or a list of integers >= 0, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "x".join(map(str, value))
    return str(value)


def arm_name(values: Mapping[str, Any], hide: Sequence[str] = ()) -> str:
    """A folder-safe name such as ``alpha=0.1,grouping=random`` (``base`` with no axis); a
    zipped ``name`` stands for its row (``alpha=0.1,hsgd``, the row's keys in ``hide``)."""
    text = ",".join(str(v) if k == "name" else f"{k}={_text(v)}" for k, v in values.items()
                    if k not in hide) or "base"
    return re.sub(r"[^A-Za-z0-9_.,=+-]+", "-", text)


def build(table: Mapping[str, Any], where: str, out: Path | None = None) -> SweepSpec:
    """Validate a spec table and expand it into arms; every arm config is checked."""
    unknown = set(table) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key '{sorted(unknown)[0]}'; a spec has "
                          f"{', '.join(sorted(TOP_KEYS))}")
    base_table = table.get("base", {})
    if not isinstance(base_table, Mapping):
        raise ConfigError(f"{where}: [base] must be a table of run settings")
    base = {_key(k, "base"): v for k, v in base_table.items()}
    grid = _values(table.get("grid", {}), "grid")
    zip_table = dict(table.get("zip", {})) if isinstance(table.get("zip", {}), Mapping) else None
    names_row = zip_table.pop("name", None) if zip_table is not None else None
    zipped = _values(zip_table, "zip")
    if names_row is not None:
        if not isinstance(names_row, list) or not all(isinstance(n, str) and n
                                                      for n in names_row):
            raise ConfigError("zip.name must be a list of non-empty strings")
        if len(set(names_row)) != len(names_row):
            raise ConfigError(f"zip.name repeats a name: {names_row}")
        zipped = {"name": names_row, **zipped}
    tune = _values(table.get("tune", {}), "tune")
    draws = _random_draws(table["random"]) if "random" in table else [{}]
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        raise ConfigError(f"zip: the lists must have one length, got "
                          f"{', '.join(f'{k}: {len(v)}' for k, v in zipped.items())}")
    seen: dict[str, str] = {}
    for part, keys in (("grid", grid), ("zip", zipped), ("tune", tune),
                       ("random", draws[0])):
        for key in keys:
            if key in seen:
                raise ConfigError(f"'{key}' is an axis of both [{seen[key]}] and [{part}]")
            seen[key] = part
    if not seen:
        raise ConfigError(f"{where}: no axis; give [grid], [zip], [random] or [tune]")
    axes = tuple(k for k in seen if seen[k] != "tune")
    if tune:
        holdout = base.get("client_holdout", 0)
        if "client_holdout" in seen or not isinstance(holdout, int | float) or holdout <= 0:
            raise ConfigError(
                "[tune] picks values by validation accuracy, the clients' held-out rows: set "
                "base.client_holdout > 0 (e.g. 0.2), the same for every arm; the test set is "
                "never used to choose")
    zip_rows = [dict(zip(zipped, row, strict=True)) for row in zip(*zipped.values(),
                                                                   strict=True)] or [{}]
    arms = []
    names: set[str] = set()
    for combo in itertools.product(*grid.values()):
        for zrow in zip_rows:
            for draw in draws:
                values = {**dict(zip(grid, combo, strict=True)), **zrow, **draw}
                settings_of_arm = {k: v for k, v in values.items() if k != "name"}
                candidates = []
                for tcombo in itertools.product(*tune.values()):
                    tuned = dict(zip(tune, tcombo, strict=True))
                    settings = {**base, **settings_of_arm, **tuned}
                    where_arm = f"arm {arm_name({**values, **tuned})}"
                    try:
                        cfg = RunConfig.from_mapping(settings, where=where_arm)
                    except ConfigError as exc:
                        text = str(exc)
                        raise ConfigError(text if where_arm in text
                                          else f"{where_arm}: {text}") from exc
                    if cfg.engine == "flower":
                        raise ConfigError(
                            f"{where_arm}: engine 'flower' starts its own Ray, which a sweep's "
                            "Ray Tune trial cannot host; use inprocess or vectorized (the same "
                            "numbers, docs/engines.md)")
                    candidates.append((tuned, cfg))
                name = arm_name(values, hide=[k for k in zipped if k != "name"]
                                if "name" in zipped else ())
                if name in names:
                    raise ConfigError(f"two arms are both {name}; make the axis values differ")
                names.add(name)
                arms.append(Arm(name, values, tuple(candidates)))
    compare = table.get("compare", axes[0] if axes else None)
    if compare is not None and compare not in axes:
        raise ConfigError(f"compare = {compare!r} is not an axis ({', '.join(axes)})")
    baseline = table.get("baseline")
    if compare is not None:
        options = [a.values[compare] for a in arms]
        if baseline is None:
            baseline = options[0]
        elif baseline not in options:
            raise ConfigError(f"baseline = {baseline!r} is not a value of {compare}")
    target = table.get("target_accuracy")
    if target is not None and (not isinstance(target, int | float) or isinstance(target, bool)
                               or not 0 < target <= 1):
        raise ConfigError(f"target_accuracy must be in (0, 1], got {target!r}")
    at = table.get("at_iterations", [])
    if not isinstance(at, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                           and i > 0 for i in at):
        raise ConfigError(f"at_iterations must be a list of positive integers, got {at!r}")
    folder = out or Path(str(table.get("out", "runs/sweep")))
    return SweepSpec(out=folder, seeds=_seeds(table.get("seeds", 3)), axes=axes,
                     tuned=tuple(tune), arms=tuple(arms), zipped=tuple(zipped),
                     target_accuracy=None if target is None else float(target),
                     at_iterations=tuple(at), compare=compare, baseline=baseline, base=base)


def read_spec(path: Path, out: Path | None = None) -> SweepSpec:
    """The spec of a TOML file (one-line errors name the file)."""
    return build(read_toml(path), where=str(path), out=out)


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``--grid key=v1,v2`` items as a [grid] table. Values are read as TOML scalars
    (numbers, true/false), else strings; a tuple setting joins its numbers with ``+``
    (``groups=4,8+2``: 4 edges, or 8 edges under 2 regions)."""
    import tomllib

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,...")
        values: list[Any] = []
        for raw in text.split(","):
            if "+" in raw:
                values.append(raw.replace("+", ","))  # a tuple setting, e.g. groups=8+2
                continue
            try:
                values.append(tomllib.loads(f"v = {raw}")["v"])
            except tomllib.TOMLDecodeError:
                values.append(raw)
        grid[key.strip()] = values
    return grid

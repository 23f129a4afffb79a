"""Reading run settings from mappings (a TOML file, a Flower run_config, CLI values, a dataset
card's ``[defaults]``): each value's type checked against its declared field
(:class:`fedhier.settings.run_config.RunConfig`); every error is one ConfigError line naming the key
and where it came from.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import Field
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError, DamagedFileError


def checked(values: Mapping[str, Any], where: str,
            known: Mapping[str, Field[Any]]) -> dict[str, Any]:
    """snake_case key -> checked value of a mapping of setting keys (kebab-case accepted);
    ``known``: the declared fields by name (``RunConfig``'s)."""
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{raw_key}' in {where}{hint}")
        kwargs[key] = coerce(key, value, known[key].type, where)
    return kwargs


def int_tuple(key: str, value: Any, where: str) -> tuple[int, ...]:
    """An int, a list of ints, or a comma-separated string such as "8,2"."""
    items: list[Any]
    if isinstance(value, int):  # bools too: rejected below
        items = [value]
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",")] if value.strip() else []
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        items = [value]
    out = []
    for item in items:
        if isinstance(item, bool) or (isinstance(item, float) and not item.is_integer()):
            raise ConfigError(f"{key} in {where} must be integers, got {value!r}")
        try:
            out.append(int(item))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(
                f"{key} in {where} must be an integer or a comma-separated list of integers, "
                f"got {value!r}") from None
    return tuple(out)


def type_name(kind: Any) -> str:
    """A field's type as its annotation reads: 'int', 'float', 'bool', 'str', 'tuple[int,...]'."""
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return str(name).replace(" ", "")


def coerce(key: str, value: Any, kind: Any, where: str) -> Any:
    """Check a value's type; ints are accepted for floats, and bools only for bools."""
    name = type_name(kind)
    if name == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif name == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif name == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif name == "str" and isinstance(value, str):
        return value
    elif name.startswith("tuple"):
        return int_tuple(key, value, where)
    wanted = {"bool": "true or false", "int": "an integer", "float": "a number",
              "str": "a string"}.get(name, name)
    raise ConfigError(f"{key} in {where} must be {wanted}, got {value!r}")


def app_key(name: str) -> str:
    """The Flower run-config key (and TOML kebab-case key) of setting ``name``."""
    return name.replace("_", "-")


def run_config_value(value: Any) -> Any:
    """A value in run-config form: tuples as comma-separated strings ("8,2"), others as
    they are (Flower's run_config and ConfigRecord hold scalars only)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def read_toml(path: str | Path) -> dict[str, Any]:
    """The raw table of a config TOML file, or a one-line ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DamagedFileError(path, f"cannot read config file: {exc.strerror or exc}",
                               "check the path and its permissions") from exc
    except UnicodeDecodeError as exc:
        raise DamagedFileError(path, f"not UTF-8 text (byte {exc.start}); a config file is a "
                               "TOML text file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DamagedFileError(path, f"malformed TOML in the file: {exc}") from exc

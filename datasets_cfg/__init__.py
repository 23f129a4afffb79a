"""Dataset descriptions shipped with fedhier (one TOML per dataset: a "dataset card").

A card says where the data comes from and how to read it (see docs/data.md), and may hold a
``[defaults]`` table of run settings that fit the data (e.g. ``model = "lstm"`` for text):
they apply to a run on that dataset unless the user sets the key (flag, config file or
``-c`` of ``flwr run``). This module stays light (no data libraries): `fedhier.settings.run_config`
reads the defaults through it.
"""

from __future__ import annotations

import importlib.resources
import os
import tomllib
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

#: Run settings a card may not set: they say which data, where and how to run, not what fits it.
NOT_CARD_DEFAULTS = ("dataset", "data_path", "out", "seed", "engine", "device")


def shipped_cards() -> dict[str, Traversable]:
    """Shipped card name -> its TOML file."""
    root = importlib.resources.files(__name__)
    return {entry.name[: -len(".toml")]: entry for entry in root.iterdir()
            if entry.name.endswith(".toml")}


def card_text(dataset: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(TOML text, label for errors) of a shipped name or a path to a ``.toml``; None when
    there is no such card (the data loader reports that)."""
    name = os.fspath(dataset)
    shipped = shipped_cards()
    if name in shipped:
        return shipped[name].read_text(encoding="utf-8"), f"dataset '{name}'"
    path = Path(name).expanduser()
    if name.endswith(".toml") and path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    return None


def card_defaults(dataset: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The raw ``[defaults]`` table of a card and the card's label; ({}, "") when the card
    does not exist, cannot be parsed (the data loader reports that) or has no defaults."""
    found = card_text(dataset)
    if found is None:
        return {}, ""
    text, label = found
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {}, label
    defaults = raw.get("defaults", {})
    return (defaults if isinstance(defaults, dict) else {}), label

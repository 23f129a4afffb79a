"""How the declared settings become the parts' settings objects (one function for all).

A setting's declaration (:mod:`fedhier.settings.declaration`) names the part that reads it:
``part="workload"`` (the part's attribute of the same name), ``part=("asynchronous",
"buffer")`` (another attribute name) or ``part=("faults", "dropout_span",
"fedhier.settings.views:parse_span")`` (with the conversion from the setting's value, here ``"A-B"``
to a pair; named, not imported, so that the declarations import nothing). :func:`build_part` makes a
part's settings object from exactly the settings that name it, so no list of settings is written
twice: a new setting that one part reads is its declaration, the part's attribute and the code that
uses it. Each part's class is named here as ``"module:Class"`` and imported when first built, so
reading settings imports no engine.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any

#: part -> (its settings class, {attribute: the part whose object fills it})
PARTS: dict[str, tuple[str, dict[str, str]]] = {
    "algorithm": ("fedhier.round.loop:HSGDSettings",
                  {"workload": "workload", "mobility": "mobility", "time_model": "time_model",
                   "asynchronous": "asynchronous", "policy": "reply_policy"}),
    "workload": ("fedhier.round.participants:Workload", {}),
    "faults": ("fedhier.round.faults:FaultModel", {}),
    "mobility": ("fedhier.tree.mobility:Mobility", {}),
    "time_model": ("fedhier.round.clock:TimeModel", {}),
    "reply_policy": ("fedhier.round.reply_policy:ReplyPolicy", {}),
    "asynchronous": ("fedhier.round.asynchrony.settings:AsyncEdges", {"rule": "async_rule"}),
    "async_rule": ("fedhier.round.asynchrony.rules:AsyncRule", {}),
    "local_optimizer": ("fedhier.local.optimizer:LocalOptimizer", {}),
    "langevin": ("fedhier.local.langevin:Langevin", {}),
}


def resolve(reference: str) -> Any:
    """The object ``"module:attribute"`` names."""
    module, attribute = reference.split(":")
    return getattr(importlib.import_module(module), attribute)


def readers(declaration: Any) -> tuple[tuple[str, str, Any], ...]:
    """(part, attribute, conversion or None) of each part that reads a declared setting."""
    return tuple(declaration.metadata.get("readers", ()))


def build_part(cfg: Any, part: str) -> Any:
    """The settings object of ``part`` (:data:`PARTS`) for the run configuration ``cfg``."""
    reference, nested = PARTS[part]
    values: dict[str, Any] = {name: build_part(cfg, inner) for name, inner in nested.items()}
    for declaration in fields(cfg):
        for reader, attribute, convert in readers(declaration):
            if reader != part:
                continue
            value = getattr(cfg, declaration.name)
            value = resolve(convert)(value, cfg) if convert is not None else value
            if attribute == "*":  # one setting, several attributes (the handoff's two halves)
                values.update(value)
            else:
                values[attribute or declaration.name] = value
    return resolve(reference)(**values)


# ------------------------------------------------------------------ conversions (value, cfg)
def parse_span(value: str, cfg: Any) -> tuple[int, int] | None:
    """``dropout_rounds`` ``"A-B"`` -> (A, B) (None: no span)."""
    from fedhier.round.faults import parse_span as parse

    return parse(value)


def staleness_function(value: str, cfg: Any) -> Any:
    """``staleness_fn`` ``"polynomial:0.5"`` -> its :class:`StalenessFunction`."""
    from fedhier.round.asynchrony.rules import staleness_function as parse

    return parse(value)


def edge_slowdown(value: str, cfg: Any) -> tuple[tuple[int, float], ...]:
    """``edge_slowdown`` ``"0:4,2:1.5"`` -> ((edge, factor), ...)."""
    from fedhier.round.clock import parse_edge_slowdown

    return parse_edge_slowdown(value)


def on_bad_reply(value: str, cfg: Any) -> str:
    """``auto`` -> drop with edge servers, stop otherwise."""
    from fedhier.round.reply_policy import resolve_on_bad_reply

    return resolve_on_bad_reply(value, cfg.edge_servers)


def reachability(value: str, cfg: Any) -> Any:
    """The reachability matrix read from its file (None: every edge reaches every edge)."""
    from fedhier.tree.mobility import read_reachability

    return read_reachability(value, cfg.num_edges) if value else None


def mobility_trace(value: str, cfg: Any) -> Any:
    """The mobility trace read from its file (() : none)."""
    from fedhier.tree.mobility import read_trace

    return read_trace(value, cfg.clients, cfg.num_edges, cfg.rounds,
                      cfg.global_period // cfg.local_period) if value else ()


def handoff(value: str, cfg: Any) -> dict[str, str]:
    """``MODEL[:ADMISSION]`` -> the handoff model and the admission rule."""
    from fedhier.tree.mobility import parse_handoff

    return dict(zip(("handoff", "admission"), parse_handoff(value), strict=True))


def aggregator_names(value: str, cfg: Any) -> tuple[str, ...]:
    """``"mean,clip,median"`` -> one rule name per entry."""
    return tuple(name.strip() for name in value.split(","))


def edge_periods(value: str, cfg: Any) -> tuple[int, ...]:
    """``"2,4,4"`` -> the per-edge periods (() : off)."""
    from fedhier.tree.hierarchy import parse_edge_periods

    return parse_edge_periods(value)

"""Validation of a :class:`fedhier.settings.run_config.RunConfig`: the libraries' numeric limits,
each setting's declared range and names (:mod:`fedhier.settings.declaration`), and the checks that
relate settings (groups and clients, the periods' schedule, mobility, async edges, edge servers).
Every failure is one ConfigError line naming the setting.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import fields
from typing import Any

from fedhier.common.errors import ConfigError, Refusal
from fedhier.settings.declaration import RANGES, choices

#: a :class:`fedhier.settings.run_config.RunConfig` (not imported: that module imports this one)
RunConfig = Any

#: What these checks refuse (docs/hsgd.md's table is generated from every owner's list).
REFUSALS = (
    Refusal("`--mobility-rate` with `--mobility-trace`",
            "no meaning: clients move by a rate or by a trace, not both",
            ("--mobility-rate", "0.5", "--mobility-trace", "trace.csv"),
            "give mobility_rate or mobility_trace, not both"),
    Refusal("`--mobility-every edge-round` with `--mobility-trace`",
            "no meaning: a trace gives its own moves",
            ("--mobility-every", "edge-round", "--mobility-trace", "trace.csv"),
            "a mobility_trace gives its own moves"),
    Refusal("`--quantize-bits 1`",
            "no meaning: one bit is a sign with no level (QSGD's s = 2**(b-1) - 1 levels)",
            ("--quantize-bits", "1"), "quantize_bits must be 0 (off) or 2..16"),
    Refusal("`--quantize-bits` with `--edge-periods`",
            "not yet: with per-edge periods a client's update spans several edge rounds and "
            "goes up only when its edge aggregates; quantisation is applied per edge round",
            ("--quantize-bits", "8", "--local-period", "2", "--global-period", "8",
             "--edge-periods", "2,4,2,4"), "quantize_bits quantises each edge round's update"),
    Refusal("`--replay-arrivals` without `--async-buffer`",
            "no meaning: it replays the arrival order of asynchronous edges",
            ("--replay-arrivals", "arrivals.jsonl"), "it needs --async-buffer"),
    Refusal("edge servers as processes with `--regroup-every` under `--regions`",
            "not yet on real processes: a regrouping re-draws the edges' regions, and an "
            "edge server stays under the region server it started under (mobility under "
            "regions runs: docs/deployment.md, \"Moving clients\")",
            ("--edge-servers", "--groups", "4,2", "--periods", "5,10,20",
             "--regroup-every", "1"), "edge servers under region servers need a fixed grouping"),
    Refusal("edge servers as processes with a `clip` region rule and moving clients under "
            "`--regions`",
            "not yet on real processes: a region's job that starts inside its period does "
            "not carry its last aggregate, which clip measures from",
            ("--edge-servers", "--groups", "4,2", "--periods", "5,10,20",
             "--mobility-rate", "0.5", "--aggregators", "mean,clip,mean"),
            "need a region rule that does not measure from the region's own model"),
    Refusal("edge servers as processes with mobility and `--edge-periods`",
            "not yet on real processes: a job split at a move would restart an edge's period",
            ("--edge-servers", "--local-period", "2", "--global-period", "8",
             "--edge-periods", "2,4,2,4", "--mobility-rate", "0.5"),
            "edge servers with per-edge periods need static clients"),
    Refusal("asynchronous edge servers (`--edge-servers --async-buffer`) with moving clients",
            "not yet on real processes: clients re-attach between synchronous jobs",
            ("--edge-servers", "--async-buffer", "2", "--mobility-rate", "0.5"),
            "asynchronous edge servers need static clients"),
    Refusal("asynchronous edge servers with kept optimizer state",
            "not yet on real processes: the clients' kept state is gathered between "
            "synchronous jobs",
            ("--edge-servers", "--async-buffer", "2", "--momentum", "0.5",
             "--optimizer-state", "keep"), "asynchronous edge servers need --optimizer-state"),
)

#: Largest finite float32: models, learning rates and optimiser state are float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38


def validate(cfg: RunConfig) -> None:
    """Raise a one-line ConfigError at the first thing wrong with ``cfg`` (the order is part
    of the messages users see: limits, ranges, names, then relations)."""
    check_limits(cfg)  # first: huge or non-finite numbers reach no other check
    check_ranges(cfg)  # every numeric setting against its one declared range
    from fedhier.tree.mobility import parse_handoff

    parse_handoff(cfg.handoff)  # names the bad half of MODEL:ADMISSION
    for key, allowed in choices().items():  # every closed set of names
        one_of(key, getattr(cfg, key), allowed)
    from fedhier.local.devices import check_device_name

    check_device_name(cfg.device)
    from fedhier.round.aggregators.averaging import check_aggregators, check_metrics_aggregator

    check_aggregators(cfg.aggregator_names, len(cfg.periods) or 2)
    check_metrics_aggregator(cfg.metrics_aggregator, cfg.aggregator_names)
    below, below_name = cfg.clients, "clients"
    for level, count in enumerate(cfg.groups, start=1):
        if count < 1:
            raise ConfigError(f"groups must be at least 1, got {list(cfg.groups)}")
        if count > below:
            raise ConfigError(
                f"more groups ({count}) than {below_name} ({below}) at level {level}: every "
                "group needs at least one member")
        below, below_name = count, f"level-{level} groups"
    from fedhier.tree.hierarchy import check_schedule

    check_schedule(cfg.periods, cfg.groups, cfg.edge_period_list)
    if cfg.mobility_rate > 0 and cfg.mobility_trace:
        raise ConfigError("give mobility_rate or mobility_trace, not both")
    if cfg.mobility_every == "edge-round" and cfg.mobility_trace:
        raise ConfigError("mobility_every edge-round sets how often mobility_rate moves "
                          "clients; a mobility_trace gives its own moves")
    if cfg.reachability and cfg.num_edges < 2:
        raise ConfigError("a reachability matrix needs at least 2 edges")
    from fedhier.round.faults import parse_span

    parse_span(cfg.dropout_rounds)
    check_mechanisms(cfg)
    if not cfg.dataset:
        raise ConfigError("dataset must not be empty")
    check_grouping(cfg.grouping)
    cfg.mobility()  # unreadable or inconsistent mobility files: stop before any output
    cfg.time_model().check_edges(cfg.num_edges)
    cfg.asynchronous().check(cfg.num_edges)
    from fedhier.round.asynchrony.settings import check_region_buffers

    check_region_buffers(cfg.asynchronous(), cfg.groups)
    if cfg.replay_arrivals and not cfg.asynchronous().active:
        raise ConfigError("replay_arrivals replays the arrival order of asynchronous edges: "
                          "it needs --async-buffer")
    if cfg.replay_arrivals and cfg.region_buffer:
        raise ConfigError("replayed arrivals are of two-level runs (no region_buffer)")
    if cfg.edge_servers:
        check_edge_servers(cfg)


def check_mechanisms(cfg: RunConfig) -> None:
    """Stochastic quantisation of the updates: 0 or 2..16 bits, and an update per edge
    round (per-edge periods carry unaggregated models across edge rounds)."""
    if cfg.quantize_bits == 1:  # the declared range [0, 16] holds it: 1 bit has no level
        raise ConfigError("quantize_bits must be 0 (off) or 2..16 bits per value (a sign and "
                          "s = 2**(b-1) - 1 levels), got 1")
    if cfg.quantize_bits and cfg.edge_periods:
        raise ConfigError("quantize_bits quantises each edge round's update; with "
                          "edge_periods a client sends one only when its edge aggregates: "
                          "give one or the other")


def check_grouping(grouping: str) -> None:
    """A built-in grouping, or a plugin that imports (stop before any output if not)."""
    from fedhier.tree.grouping import BUILTIN_GROUPINGS, GRADIENT_GROUPING, available_groupings

    if ":" not in grouping:  # module:function is imported below
        one_of("grouping", grouping, tuple(available_groupings()))
    if grouping not in BUILTIN_GROUPINGS and grouping != GRADIENT_GROUPING:
        from fedhier.tree.grouping import load_plugin

        load_plugin(grouping)


def check_edge_servers(cfg: RunConfig) -> None:
    """What edge servers as processes do not run (yet), in one line."""
    if len(cfg.periods) > 2 and cfg.clients_move():
        check_moves_under_regions(cfg)
    if cfg.edge_periods and (cfg.mobility_rate > 0 or cfg.mobility_trace):
        raise ConfigError("edge servers with per-edge periods need static clients (no "
                          "mobility): a job split at a move would restart an edge's period")
    if cfg.asynchronous().active:
        from fedhier.round.tiers.asynchronous import check_async_edge_tier

        if cfg.clients_move():
            raise ConfigError("asynchronous edge servers need static clients (no mobility, "
                              "no regroup_every): clients re-attach between synchronous jobs")
        if cfg.keeps_client_state():
            raise ConfigError("asynchronous edge servers need --optimizer-state reset: the "
                              "clients' kept state is gathered between synchronous jobs")
        check_async_edge_tier(cfg)


def check_moves_under_regions(cfg: RunConfig) -> None:
    """Moving clients under region servers (fedhier.round.tiers.moves): only clients move."""
    from fedhier.round.aggregators.averaging import aggregator

    if cfg.regroup_every:
        raise ConfigError("edge servers under region servers need a fixed grouping (no "
                          "regroup_every): a regrouping re-draws the edges' regions too, and "
                          "an edge server stays under the region server it started under")
    names = cfg.aggregator_names
    regional = names if len(names) == 1 else names[1:-1]  # the levels between edge and cloud
    if any(aggregator(name).needs_reference for name in regional):
        raise ConfigError("moving clients under region servers need a region rule that does "
                          "not measure from the region's own model (not clip): a region's "
                          "job that starts inside its period does not carry its last aggregate")


def check_limits(cfg: RunConfig) -> None:
    """Limits of the libraries below: step counters and row indices are int64, and numbers
    become float32 tensors (each setting's own range: :mod:`fedhier.settings.ranges`)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**62:
                raise ConfigError(f"{f.name} {item} is too large (limit 2**62)")
        if isinstance(value, float) and f.name != "round_timeout" and not (
                math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise ConfigError(f"{f.name} {value} is not a finite float32 number "
                              f"(|x| <= {FLOAT32_MAX:.3g})")
    if cfg.rounds * cfg.global_period >= 2**62:
        raise ConfigError(f"rounds x global_period = {cfg.rounds * cfg.global_period} local "
                          "steps is too many (limit 2**62)")


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """A one-line ConfigError (with a "did you mean") unless ``value`` is in ``allowed``."""
    if value not in allowed:
        close = difflib.get_close_matches(str(value), list(allowed), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown {key} '{value}'{hint}; choose one of {', '.join(allowed)}")


def check_ranges(values: Any) -> None:
    """A one-line ConfigError naming the first setting of ``values`` (a RunConfig or any
    object with these attributes) outside its declared range."""
    for name, valid in RANGES.items():
        value = getattr(values, name)
        if not valid.contains(value):
            raise ConfigError(f"{name} must be {valid.describe()}, got {value}")

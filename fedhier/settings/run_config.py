"""One validated run configuration, from CLI flags, a TOML file or a Flower run_config.

Keys are snake_case in Python and TOML (kebab-case is accepted too, as Flower's run_config
uses it). Every way in goes through :meth:`RunConfig.from_mapping`, so all three are
validated the same way and errors read the same.

`from_mapping` receives the keys a user set. Keys the user did not set take the dataset
card's ``[defaults]`` (datasets_cfg/<name>.toml, e.g. ``model = "lstm"`` for Shakespeare),
then the field defaults below. ``min_partition_size = 0`` (auto) is resolved against the data
(:func:`fedhier.data.federation.resolved`), so config.json records the value the Dirichlet
partition uses; this module never loads data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError, Refusal
from fedhier.engines.registry import engine_names
from fedhier.settings.checks import FLOAT32_MAX
from fedhier.settings.checks import validate as validate_config
from fedhier.settings.declaration import DeclaredSettings
from fedhier.settings.parse import app_key, checked, int_tuple, read_toml, run_config_value
from fedhier.settings.views import build_part

__all__ = ["DEVICES", "ENGINES", "FIELD_DEFAULTS", "FLOAT32_MAX", "RunConfig",
           "check_card_defaults", "dataset_defaults", "read_toml"]

ENGINES = engine_names()
DEVICES = ("cpu", "cuda", "mps", "auto")  # and cuda:N (fedhier.local.devices)


@dataclass(frozen=True)
class RunConfig(DeclaredSettings):
    """Everything that determines a run (each setting declared once in
    :class:`fedhier.settings.declaration.DeclaredSettings`). Same config and seed => same
    numbers."""

    def __post_init__(self) -> None:
        for key in ("groups", "periods"):  # RunConfig(groups=4) is accepted too
            if not isinstance(getattr(self, key), tuple):
                object.__setattr__(self, key, int_tuple(key, getattr(self, key), "config"))
        if self.periods:  # the level periods define I (edge) and G (cloud)
            object.__setattr__(self, "local_period", self.periods[0])
            object.__setattr__(self, "global_period", self.periods[-1])
        else:
            object.__setattr__(self, "periods", (self.local_period, self.global_period))
        self._edge_round_from_edge_periods()

    def _edge_round_from_edge_periods(self) -> None:
        """With per-edge periods, I (and P_1) is g = gcd(I_i), the length of an edge round
        (unparsable or non-positive periods are left to :meth:`validate`)."""
        try:
            edge_periods = self.edge_period_list
        except ConfigError:  # validate() reports it, after the checks that come first
            edge_periods = ()
        if edge_periods and min(edge_periods) > 0:
            from fedhier.tree.hierarchy import edge_round_period

            g = edge_round_period(edge_periods)
            object.__setattr__(self, "local_period", g)
            object.__setattr__(self, "periods", (g, *self.periods[1:]))
        self.validate()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "config") -> RunConfig:
        """Build from a mapping (TOML table, Flower run_config, CLI dict), checking types.

        ``values`` are the keys the user set; the others take the dataset card's
        ``[defaults]``, then the field defaults. An auto ``min_partition_size`` (0) is
        resolved to the value used (see :meth:`resolved`).
        """
        kwargs = checked(values, where, _FIELDS)
        given = set(kwargs)  # the keys the user set, before the card's defaults join them
        if "dataset" not in kwargs and str(kwargs.get("data_path", "")).lower().endswith(".npz"):
            kwargs["dataset"] = "npz"  # a local .npz describes itself (datasets_cfg/npz.toml)
        dataset = kwargs.get("dataset", FIELD_DEFAULTS["dataset"])
        defaults = dataset_defaults(dataset)
        if "periods" in kwargs:  # the user's periods replace all of the card's
            defaults = {k: v for k, v in defaults.items() if k not in _PERIOD_KEYS}
        elif kwargs.keys() & _PERIOD_KEYS:  # a given I or G keeps the card's other one
            defaults.pop("periods", None)
        kwargs = {**defaults, **kwargs}
        periods = kwargs.get("periods")
        if periods:
            for key, index in (("local_period", 0), ("global_period", -1)):
                if key in kwargs and kwargs[key] != periods[index]:
                    raise ConfigError(
                        f"{key}={kwargs[key]} contradicts periods={list(periods)} in {where}; "
                        "give one or the other")
        asked = (("local_period", kwargs["local_period"]) if "local_period" in given else
                 ("periods", kwargs["periods"][0]) if "periods" in given and kwargs["periods"]
                 else None)
        cfg = cls(**kwargs)
        if "edge_periods" in given:
            _check_given_edge_round(cfg, asked, where)
        return cfg

    @classmethod
    def from_app_config(cls, values: Mapping[str, Any], where: str = "run_config") -> RunConfig:
        """Build from a Flower app's run_config (``flwr run``): pyproject.toml's
        ``[tool.flwr.app.config]`` lists every key, so a value equal to the field's default
        counts as not set and the dataset card's ``[defaults]`` apply to it, as on the
        command line (``--dataset shakespeare`` picks the LSTM)."""
        kwargs = checked(values, where, _FIELDS)  # tuples as tuples, like the defaults
        return cls.from_mapping({k: v for k, v in kwargs.items() if v != FIELD_DEFAULTS[k]},
                                where)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """Read a TOML file whose top-level keys are RunConfig fields."""
        return cls.from_mapping(read_toml(path), where=str(path))

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes``; new local/global periods replace a two-level ``periods``."""
        if changes.keys() & {"local_period", "global_period"} and "periods" not in changes:
            if len(self.periods) > 2:
                raise ConfigError("replace periods, not local/global_period, on a deeper tree")
            changes["periods"] = ()
        return dataclasses.replace(self, **changes)

    # -- views ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_run_config(self) -> dict[str, Any]:
        """Flat kebab-case dict of scalars, the form of Flower's run_config and ConfigRecord."""
        return {app_key(k): run_config_value(v) for k, v in self.to_dict().items()}

    def learning_rates(self, start_step: int, num_steps: int) -> Any:
        """float64 [num_steps]: the scheduled rates of the given global steps."""
        from fedhier.local.lr_schedules import learning_rates

        return learning_rates(start_step, num_steps, lr=self.lr, schedule=self.lr_schedule,
                              decay=self.lr_decay, step_every=self.lr_step_every,
                              total_steps=self.iterations, global_period=self.global_period)

    def local_optimizer(self) -> Any:
        """The :class:`fedhier.local.optimizer.LocalOptimizer` of this run."""
        return build_part(self, "local_optimizer")

    def langevin(self) -> Any:
        """The :class:`fedhier.local.langevin.Langevin` noise of this run's local steps."""
        return build_part(self, "langevin")

    def keeps_client_state(self) -> bool:
        """Clients keep optimizer state (momentum buffers) from one edge round to the next."""
        return bool(self.local_optimizer().has_state and self.optimizer_state == "keep")

    def clients_move(self) -> bool:
        """Clients change edges during the run (mobility, or a regrouping)."""
        return bool(self.mobility_rate > 0 or self.mobility_trace or self.regroup_every)

    def workload(self) -> Any:
        """The :class:`fedhier.round.participants.Workload` of this run."""
        return build_part(self, "workload")

    def faults(self) -> Any:
        """The :class:`fedhier.round.faults.FaultModel` of this run."""
        return build_part(self, "faults")

    def mobility(self) -> Any:
        """The :class:`fedhier.tree.mobility.Mobility` model of this run (reads its files)."""
        return build_part(self, "mobility")

    def time_model(self) -> Any:
        """The :class:`fedhier.round.clock.TimeModel` of this run's simulated clock."""
        return build_part(self, "time_model")

    def reply_policy(self) -> Any:
        """The :class:`fedhier.round.reply_policy.ReplyPolicy` of this run (``auto``: drop with
        edge servers, stop otherwise; ``fedhier deploy`` sets drop itself)."""
        return build_part(self, "reply_policy")

    def asynchronous(self) -> Any:
        """The :class:`fedhier.round.asynchrony.settings.AsyncEdges` settings of this run."""
        return build_part(self, "asynchronous")

    @property
    def aggregator_names(self) -> tuple[str, ...]:
        """``aggregators`` as names: one for every level, or one per level."""
        from fedhier.settings.views import aggregator_names

        return aggregator_names(self.aggregators, self)

    @property
    def edge_period_list(self) -> tuple[int, ...]:
        """``edge_periods`` as integers, one per edge; () = off."""
        from fedhier.tree.hierarchy import parse_edge_periods

        return parse_edge_periods(self.edge_periods)

    @property
    def num_edges(self) -> int:
        """N: the number of edge servers (level-1 groups)."""
        return self.groups[0]

    @property
    def iterations(self) -> int:
        """T = rounds * G local SGD steps."""
        return self.rounds * self.global_period

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """A one-line ConfigError at the first thing wrong (:mod:`fedhier.settings.checks`)."""
        validate_config(self)


#: The declared settings by name, and each one's default (what a setting missing from a
#: mapping takes).
_FIELDS = {f.name: f for f in fields(RunConfig)}

#: What the settings refuse as they are read (docs/hsgd.md's table,
#: :mod:`fedhier.settings.refusals`).
REFUSALS = (
    Refusal("`--local-period` or `--periods` giving another I than gcd(`--edge-periods`)",
            "no meaning: with per-edge periods an edge round is gcd(I_i) steps (it used to "
            "be replaced silently)",
            ("--local-period", "4", "--global-period", "8", "--edge-periods", "2,4,2,4"),
            "an edge round is their gcd"),
)


def _check_given_edge_round(cfg: RunConfig, asked: tuple[str, int] | None,
                            where: str) -> None:
    """With per-edge periods the edge round is g = gcd(I_i) steps: an I the user gave
    (``asked``: ``local_period`` or ``periods``' first entry, and its value) must be g, not
    be replaced by it without a word."""
    if asked is None or not cfg.edge_periods or asked[1] == cfg.local_period:
        return
    key, value = asked
    raise ConfigError(
        f"{key} gives I={value}, but with edge_periods={cfg.edge_periods} an edge round is "
        f"their gcd, {cfg.local_period} steps, in {where}; leave {key} unset or give "
        f"{cfg.local_period}")


FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RunConfig)}


def check_card_defaults(raw: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The checked ``[defaults]`` table of a dataset card (``label`` names it in errors)."""
    from fedhier.datasets_cfg import NOT_CARD_DEFAULTS

    where = f"[defaults] of {label}"
    kwargs = checked(raw, where, _FIELDS)
    for key in kwargs:
        if key in NOT_CARD_DEFAULTS:
            raise ConfigError(f"{where} cannot set '{key}'; a card sets only what fits its "
                              f"data, not {', '.join(NOT_CARD_DEFAULTS)}")
    return kwargs


def dataset_defaults(dataset: str) -> dict[str, Any]:
    """The run settings a dataset's card gives by default (snake_case keys), or {}."""
    from fedhier.datasets_cfg import card_defaults

    raw, label = card_defaults(dataset)
    return check_card_defaults(raw, label) if raw else {}
_PERIOD_KEYS = frozenset({"periods", "local_period", "global_period"})

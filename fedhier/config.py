"""One validated run configuration, from CLI flags, a TOML file or a Flower run_config.

Keys are snake_case in Python and TOML (kebab-case is accepted too, as Flower's run_config
uses it). Every way in goes through :meth:`RunConfig.from_mapping`, so all three are
validated the same way and errors read the same.

`from_mapping` receives the keys a user set. Keys the user did not set take the dataset
card's ``[defaults]`` (datasets_cfg/<name>.toml, e.g. ``model = "lstm"`` for Shakespeare),
then the field defaults below. ``min_partition_size = 0`` (auto) is resolved against the data
(:func:`fedhier.federation.resolved`), so config.json records the value the Dirichlet
partition uses; this module never loads data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedhier.config_checks import FLOAT32_MAX
from fedhier.config_checks import validate as validate_config
from fedhier.config_parse import app_key, checked, int_tuple, read_toml, run_config_value
from fedhier.engines.registry import engine_names
from fedhier.errors import ConfigError

__all__ = ["DEVICES", "ENGINES", "FIELD_DEFAULTS", "FLOAT32_MAX", "RunConfig",
           "check_card_defaults", "dataset_defaults", "read_toml"]

ENGINES = engine_names()
DEVICES = ("cpu", "cuda", "mps", "auto")  # and cuda:N (fedhier.devices)


def _help(text: str, **flower_app: Any) -> dict[str, Any]:
    """A field's metadata: its ``help`` (flag help, docs), and optionally ``flower_app`` +
    ``flower_app_reason``: another value for the Flower app's [tool.flwr.app.config], and why
    (:mod:`fedhier.settings_table`)."""
    if flower_app.keys() not in (set(), {"flower_app", "flower_app_reason"}):
        raise TypeError("give flower_app and flower_app_reason together")
    return {"help": text, **flower_app}


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run. Same config and seed => same numbers."""

    # data
    dataset: str = field(default="digits", metadata=_help(
        "dataset name (digits, fashion-mnist, synthetic, shakespeare, cifar10, femnist, npz) "
        "or a path to a dataset TOML; its card's [defaults] apply to settings not given"))
    data_path: str = field(default="", metadata=_help(
        "folder/file/hub name overriding the dataset's default location; a FILE.npz alone "
        "picks the npz dataset"))
    partition: str = field(default="dirichlet", metadata=_help(
        "client partition: dirichlet, iid, shards, natural, sorted"))
    alpha: float = field(default=0.5, metadata=_help("Dirichlet concentration (> 0)"))
    min_partition_size: int = field(default=0, metadata=_help(
        "Dirichlet: minimum rows per client (resampled until met); 0 = auto: "
        "min(10, max(1, floor(alpha * train rows / (2 * clients))))"))
    self_balancing: bool = field(default=False, metadata=_help(
        "Dirichlet: stop giving a class to clients already above the average size"))
    classes_per_client: int = field(default=2, metadata=_help("shards: classes per client"))
    clients: int = field(default=20, metadata=_help("number of clients n"))
    # hierarchy
    groups: tuple[int, ...] = field(default=(4,), metadata=_help(
        "number of edge servers N; for deeper trees one count per level, e.g. 8,2 = 8 edges "
        "under 2 regions"))
    grouping: str = field(default="random", metadata=_help(
        "client -> edge assignment: random, contiguous, or a plugin name"))
    local_period: int = field(default=5, metadata=_help(
        "I: edge aggregation period, in local SGD steps"))
    global_period: int = field(default=20, metadata=_help(
        "G: cloud aggregation period, in local SGD steps (a multiple of I)"))
    edge_periods: str = field(default="", metadata=_help(
        "per-edge periods I_i, comma-separated, one per edge, each dividing the next level's "
        "period (e.g. 2,4,4,8); the edge period I becomes their gcd ('' = off)"))
    regroup_every: int = field(default=0, metadata=_help(
        "regroup clients every K cloud rounds (0 = never); gradient grouping uses the current "
        "model's gradients"))
    mobility_rate: float = field(default=0.0, metadata=_help(
        "client mobility: per cloud round each client moves to another (reachable) edge with "
        "this probability, at a seeded edge round (0 = static)"))
    mobility_trace: str = field(default="", metadata=_help(
        "client mobility from a CSV trace of rows round,client,edge (cloud rounds) or "
        "edge_round,client,edge (with that header)"))
    reachability: str = field(default="", metadata=_help(
        "CSV or .npy edge x edge 0/1 matrix: edge i may send a client to edge j (mobility "
        "and regrouping respect it)"))
    handoff: str = field(default="fresh", metadata=_help(
        "a moved client starts from its new edge's model (fresh) or brings its own (carry); "
        "MODEL:ADMISSION also says which reachable edge it joins: random (default) or "
        "min-divergence, e.g. fresh:min-divergence"))
    diagnostics_every: int = field(default=0, metadata=_help(
        "record divergences and gradient diversity at the initial model and every K cloud "
        "rounds (0 = off)"))
    diagnostics_max_samples: int = field(default=0, metadata=_help(
        "cap on the rows per client (and pooled, for sample diversity) the diagnostics' "
        "gradients use (0 = all)"))
    periods: tuple[int, ...] = field(default=(), metadata=_help(
        "all aggregation periods P1,...,PL (one more than group levels); default I,G"))
    cloud_strategy: str = field(default="average", metadata=_help(
        "cloud update: average (exact H-SGD) or a Flower strategy applied to the edge models: "
        "fedavg, fedavgm, fedadam, fedyogi, fedadagrad"))
    aggregators: str = field(default="mean", metadata=_help(
        "aggregation rule at every level, or one per level edge,...,cloud: mean (exact "
        "H-SGD), median, trimmed-mean[:b], clip[:C x|:tau] (norm-bounded mean), krum[:f], "
        "multi-krum[:f] (docs/security.md)"))
    server_lr: float = field(default=0.0, metadata=_help(
        "cloud strategy's server learning rate (0 = the strategy's default)"))
    server_momentum: float = field(default=0.0, metadata=_help("fedavgm server momentum"))
    rounds: int = field(default=30, metadata=_help(
        "cloud rounds R; total local steps T = R * G", flower_app=5, flower_app_reason=(
            "a bare `flwr run .` is a first look at the Flower app on the Simulation Engine, "
            "where every edge round is a message round through the SuperLink; "
            "-c rounds=30 gives the default run")))
    # participation and local work
    participation: float = field(default=1.0, metadata=_help(
        "per edge round each edge trains this fraction of its clients (0 < f <= 1), or this "
        "many clients when > 1"))
    straggler_fraction: float = field(default=0.0, metadata=_help(
        "share of clients (seeded) doing fewer than I local steps per edge round"))
    straggler_min_steps: int = field(default=1, metadata=_help(
        "fewest local steps a straggler does"))
    normalize_updates: bool = field(default=False, metadata=_help(
        "FedNova-style: scale each client's update by tau_eff / tau_j within its edge"))
    # faults and robustness
    fail_rate: float = field(default=0.0, metadata=_help(
        "simulation: a client fails an edge round with this probability (seeded)"))
    dropout_fraction: float = field(default=0.0, metadata=_help(
        "simulation: share of clients (seeded) away during --dropout-rounds"))
    dropout_rounds: str = field(default="", metadata=_help(
        "simulation: cloud rounds 'A-B' during which the dropout clients are away"))
    round_timeout: float = field(default=3600.0, metadata=_help(
        "seconds to wait for client replies in each round"))
    min_clients_per_edge: int = field(default=0, metadata=_help(
        "stop the run when an edge round leaves an edge with fewer surviving clients"))
    on_nan: str = field(default="stop", metadata=_help(
        "a non-finite client update: stop the run, or skip-client (drop it from the average)"))
    on_bad_reply: str = field(default="auto", metadata=_help(
        "a reply that breaks the contract: stop the run, or drop it (the client fails that "
        "round); auto = drop under fedhier deploy and edge servers, stop in simulations"))
    exclude_after: int = field(default=3, metadata=_help(
        "a client whose replies were dropped K rounds in a row is excluded for the rest of "
        "the run (0 = never)"))
    max_weight_ratio: float = field(default=10.0, metadata=_help(
        "a client's size (its weight) is capped at this multiple of the median claimed "
        "size (0 = no cap; docs/security.md)"))
    max_update_ratio: float = field(default=1000.0, metadata=_help(
        "a train reply whose update is longer than this multiple of the round's median "
        "update is a bad reply (0 = no check; docs/security.md)"))
    checkpoint_every: int = field(default=0, metadata=_help(
        "write a checkpoint every K cloud rounds (0 = only on Ctrl-C)"))
    async_buffer: int = field(default=0, metadata=_help(
        "asynchronous edges: the cloud aggregates as soon as K edges reported their G steps "
        "(0 = synchronous; K = number of edges is synchronous H-SGD)"))
    region_buffer: tuple[int, ...] = field(default=(), metadata=_help(
        "asynchronous regions (3+ levels): one K per level between the edges and the cloud; "
        "each node there aggregates its first K children's reports (0 = all of them) and "
        "async_buffer then counts the cloud's children's reports (0 = all)"))
    max_staleness: int = field(default=4, metadata=_help(
        "asynchronous edges: drop a report more than S cloud aggregations old; fresher ones "
        "weigh 1/sqrt(1+s)"))
    # simulated time (fedhier.sim_clock): metrics.jsonl's sim_seconds
    step_seconds: float = field(default=0.01, metadata=_help(
        "simulated time: seconds of compute per local step of a typical client"))
    compute_spread: float = field(default=0.0, metadata=_help(
        "simulated time: each client's speed factor is exp(N(0, spread)), drawn with the "
        "seed (0 = all equal)"))
    edge_slowdown: str = field(default="", metadata=_help(
        "simulated time: compute slowdown of some edges' clients, edge:factor pairs such "
        "as 0:4"))
    client_edge_mbps: float = field(default=100.0, metadata=_help(
        "simulated time: bandwidth of each edge's link to its clients, Mbit/s (shared)"))
    client_edge_latency_ms: float = field(default=5.0, metadata=_help(
        "simulated time: one-way latency of a client-edge link, ms"))
    edge_cloud_mbps: float = field(default=10.0, metadata=_help(
        "simulated time: bandwidth of the cloud's (and each region's) link to its children, "
        "Mbit/s (shared)"))
    edge_cloud_latency_ms: float = field(default=50.0, metadata=_help(
        "simulated time: one-way latency of a link above the edges, ms"))
    # local training
    batch_size: int = field(default=16, metadata=_help(
        "mini-batch size b; 0 = all of a client's rows (gradient descent)"))
    lr: float = field(default=0.1, metadata=_help("SGD learning rate"))
    lr_schedule: str = field(default="constant", metadata=_help(
        "constant, step (x lr_decay every lr_step_every steps), cosine (over T), exponential "
        "(x lr_decay per cloud round)"))
    lr_decay: float = field(default=0.1, metadata=_help("decay factor of step/exponential"))
    lr_step_every: int = field(default=1000, metadata=_help(
        "step schedule: decay every this many global iterations"))
    momentum: float = field(default=0.0, metadata=_help("local SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=_help("local SGD weight decay (L2)"))
    clip_norm: float = field(default=0.0, metadata=_help(
        "clip each local gradient to this L2 norm (0 = off)"))
    optimizer_state: str = field(default="reset", metadata=_help(
        "momentum buffers: reset at each edge round, or keep per client across rounds"))
    client_holdout: float = field(default=0.0, metadata=_help(
        "fraction of each client's rows held out (seeded) for per-client evaluation"))
    model: str = field(default="mlp", metadata=_help(
        "model: logreg, mlp, cnn, lenet5, lstm (text)"))
    weighting: str = field(default="samples", metadata=_help(
        "averaging weights: samples (by client data size) or uniform (each client equal)"))
    # execution
    engine: str = field(default="inprocess", metadata=_help(
        "inprocess (Flower strategy + ClientApp in one process), flower (Simulation Engine on "
        "Ray), vectorized (all clients as one batched computation) or vectorized-ray (the "
        "batched engine sharded by edge over a Ray cluster)"))
    edge_servers: bool = field(default=False, metadata=_help(
        "the cloud's nodes are edge servers that run their own clients' edge rounds (set by "
        "fedhier deploy local --edges; with --engine flower the Simulation Engine's nodes; "
        "every other engine keeps the edges inside the cloud)"))
    client_chunk: int = field(default=0, metadata=_help(
        "vectorized engine: clients per batched chunk (0 = auto: about 2 MiB of models per "
        "chunk on a CPU, all clients on other devices; K >= clients = all at once)"))
    ray_address: str = field(default="", metadata=_help(
        "an existing Ray cluster (host:port of its head, or auto) for the vectorized-ray "
        "engine's workers, the flower engine's actors and fedhier sweep's trials; empty = a "
        "local Ray started and "
        "stopped by the command"))
    ray_workers: int = field(default=2, metadata=_help(
        "vectorized-ray engine: workers (Ray actors, one CPU each), each a shard of whole "
        "edges"))
    device: str = field(default="cpu", metadata=_help(
        "cpu, cuda, cuda:N, mps or auto (best available)"))
    seed: int = field(default=0, metadata=_help("seed for every random draw"))
    out: str = field(default="", metadata=_help(
        "run folder (default runs/<timestamp>-<name>)"))

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
            from fedhier.topology import edge_round_period

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
        from fedhier.lr_schedules import learning_rates

        return learning_rates(start_step, num_steps, lr=self.lr, schedule=self.lr_schedule,
                              decay=self.lr_decay, step_every=self.lr_step_every,
                              total_steps=self.iterations, global_period=self.global_period)

    def local_optimizer(self) -> Any:
        from fedhier.optim import LocalOptimizer

        return LocalOptimizer(self.momentum, self.weight_decay, self.clip_norm)

    def keeps_client_state(self) -> bool:
        """Clients keep optimizer state (momentum buffers) from one edge round to the next."""
        return bool(self.local_optimizer().has_state and self.optimizer_state == "keep")

    def clients_move(self) -> bool:
        """Clients change edges during the run (mobility, or a regrouping)."""
        return bool(self.mobility_rate > 0 or self.mobility_trace or self.regroup_every)

    def workload(self) -> Any:
        from fedhier.plan import Workload

        return Workload(self.participation, self.straggler_fraction, self.straggler_min_steps,
                        self.normalize_updates)

    def faults(self) -> Any:
        from fedhier.faults import FaultModel, parse_span

        return FaultModel(self.fail_rate, self.dropout_fraction, parse_span(self.dropout_rounds))

    def mobility(self) -> Any:
        """The :class:`fedhier.mobility.Mobility` model of this run (reads its files)."""
        from fedhier.mobility import Mobility, parse_handoff, read_reachability, read_trace

        reach = read_reachability(self.reachability, self.num_edges) if self.reachability \
            else None
        trace = read_trace(self.mobility_trace, self.clients, self.num_edges, self.rounds,
                           self.global_period // self.local_period) \
            if self.mobility_trace else ()
        return Mobility(self.mobility_rate, reach, trace, *parse_handoff(self.handoff))

    def time_model(self) -> Any:
        """The :class:`fedhier.sim_clock.TimeModel` of this run's simulated clock."""
        from fedhier.sim_clock import TimeModel, parse_edge_slowdown

        return TimeModel(self.step_seconds, self.compute_spread, self.client_edge_mbps,
                         self.client_edge_latency_ms, self.edge_cloud_mbps,
                         self.edge_cloud_latency_ms, parse_edge_slowdown(self.edge_slowdown))

    def reply_policy(self) -> Any:
        """The :class:`fedhier.reply_policy.ReplyPolicy` of this run (``auto``: drop with
        edge servers, stop otherwise; ``fedhier deploy`` sets drop itself)."""
        from fedhier.reply_policy import ReplyPolicy, resolve_on_bad_reply

        return ReplyPolicy(resolve_on_bad_reply(self.on_bad_reply, self.edge_servers),
                           self.exclude_after, self.max_weight_ratio, self.max_update_ratio)

    def asynchronous(self) -> Any:
        """The :class:`fedhier.staleness.AsyncEdges` settings of this run."""
        from fedhier.staleness import AsyncEdges

        return AsyncEdges(self.async_buffer, self.max_staleness, self.region_buffer)

    @property
    def aggregator_names(self) -> tuple[str, ...]:
        """``aggregators`` as names: one for every level, or one per level."""
        return tuple(name.strip() for name in self.aggregators.split(","))

    @property
    def edge_period_list(self) -> tuple[int, ...]:
        """``edge_periods`` as integers, one per edge; () = off."""
        from fedhier.topology import parse_edge_periods

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
        """A one-line ConfigError at the first thing wrong (:mod:`fedhier.config_checks`)."""
        validate_config(self)


#: The declared settings by name, and each one's default (what a setting missing from a
#: mapping takes).
_FIELDS = {f.name: f for f in fields(RunConfig)}
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

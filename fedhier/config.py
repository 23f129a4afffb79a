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
import difflib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedhier.engines.registry import engine_names
from fedhier.errors import ConfigError, DamagedFileError

WEIGHTINGS = ("samples", "uniform")
ENGINES = engine_names()
DEVICES = ("cpu", "cuda", "mps", "auto")  # and cuda:N (fedhier.devices)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


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
        "a moved client starts from its new edge's model (fresh) or brings its own (carry)"))
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
        "cloud rounds R; total local steps T = R * G"))
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
    model: str = field(default="mlp", metadata=_help("model: logreg, mlp, cnn, lstm (text)"))
    weighting: str = field(default="samples", metadata=_help(
        "averaging weights: samples (by client data size) or uniform (each client equal)"))
    # execution
    engine: str = field(default="inprocess", metadata=_help(
        "inprocess (Flower strategy + ClientApp in one process), flower (Simulation Engine on "
        "Ray) or vectorized (all clients as one batched computation)"))
    edge_servers: bool = field(default=False, metadata=_help(
        "the cloud's nodes are edge servers that run their own clients' edge rounds (set by "
        "fedhier deploy local --edges; every other engine keeps the edges inside the cloud)"))
    client_chunk: int = field(default=0, metadata=_help(
        "vectorized engine: clients per batched chunk (0 = auto: about 2 MiB of models per "
        "chunk on a CPU, all clients on other devices; K >= clients = all at once)"))
    device: str = field(default="cpu", metadata=_help(
        "cpu, cuda, cuda:N, mps or auto (best available)"))
    seed: int = field(default=0, metadata=_help("seed for every random draw"))
    out: str = field(default="", metadata=_help(
        "run folder (default runs/<timestamp>-<name>)"))

    def __post_init__(self) -> None:
        for key in ("groups", "periods"):  # RunConfig(groups=4) is accepted too
            if not isinstance(getattr(self, key), tuple):
                object.__setattr__(self, key, _int_tuple(key, getattr(self, key), "config"))
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
        kwargs = _checked(values, where)
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
        return cls(**kwargs)

    @classmethod
    def from_app_config(cls, values: Mapping[str, Any], where: str = "run_config") -> RunConfig:
        """Build from a Flower app's run_config (``flwr run``): pyproject.toml's
        ``[tool.flwr.app.config]`` lists every key, so a value equal to the field's default
        counts as not set and the dataset card's ``[defaults]`` apply to it, as on the
        command line (``--dataset shakespeare`` picks the LSTM)."""
        kwargs = _checked(values, where)  # tuples as tuples, like the defaults
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
        return {k.replace("_", "-"): ",".join(map(str, v)) if isinstance(v, tuple) else v
                for k, v in self.to_dict().items()}

    def learning_rates(self, start_step: int, num_steps: int) -> Any:
        """float64 [num_steps]: the scheduled rates of the given global steps."""
        from fedhier.lr_schedules import learning_rates

        return learning_rates(start_step, num_steps, lr=self.lr, schedule=self.lr_schedule,
                              decay=self.lr_decay, step_every=self.lr_step_every,
                              total_steps=self.iterations, global_period=self.global_period)

    def local_optimizer(self) -> Any:
        from fedhier.optim import LocalOptimizer

        return LocalOptimizer(self.momentum, self.weight_decay, self.clip_norm)

    def workload(self) -> Any:
        from fedhier.plan import Workload

        return Workload(self.participation, self.straggler_fraction, self.straggler_min_steps,
                        self.normalize_updates)

    def faults(self) -> Any:
        from fedhier.faults import FaultModel, parse_span

        return FaultModel(self.fail_rate, self.dropout_fraction, parse_span(self.dropout_rounds))

    def mobility(self) -> Any:
        """The :class:`fedhier.mobility.Mobility` model of this run (reads its files)."""
        from fedhier.mobility import Mobility, read_reachability, read_trace

        reach = read_reachability(self.reachability, self.num_edges) if self.reachability \
            else None
        trace = read_trace(self.mobility_trace, self.clients, self.num_edges, self.rounds,
                           self.global_period // self.local_period) \
            if self.mobility_trace else ()
        return Mobility(self.mobility_rate, reach, trace, self.handoff)

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

        return AsyncEdges(self.async_buffer, self.max_staleness)

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
        from fedhier.models import MODELS  # local: keep config import-light

        _check_ranges(self)  # first: huge or non-finite numbers reach no other check

        _one_of("weighting", self.weighting, WEIGHTINGS)
        _one_of("engine", self.engine, ENGINES)
        _one_of("model", self.model, MODELS)
        from fedhier.devices import check_device_name

        check_device_name(self.device)
        from fedhier.strategies.cloud_step import CLOUD_STRATEGIES

        _one_of("cloud_strategy", self.cloud_strategy, CLOUD_STRATEGIES)
        from fedhier.aggregate import check_aggregators

        check_aggregators(self.aggregator_names, len(self.periods) or 2)
        if self.server_lr < 0 or not 0 <= self.server_momentum < 1:
            raise ConfigError("server_lr must be >= 0 and server_momentum in [0, 1)")
        _one_of("partition", self.partition,
                ("dirichlet", "iid", "shards", "natural", "sorted"))
        if self.clients < 1:
            raise ConfigError(f"clients must be at least 1, got {self.clients}")
        below, below_name = self.clients, "clients"
        for level, count in enumerate(self.groups, start=1):
            if count < 1:
                raise ConfigError(f"groups must be at least 1, got {list(self.groups)}")
            if count > below:
                raise ConfigError(
                    f"more groups ({count}) than {below_name} ({below}) at level {level}: every "
                    "group needs at least one member")
            below, below_name = count, f"level-{level} groups"
        if len(self.periods) != len(self.groups) + 1:
            raise ConfigError(
                f"{len(self.groups)} group level(s) {list(self.groups)} need "
                f"{len(self.groups) + 1} periods (edge ... cloud), got {list(self.periods)}; "
                "set --periods")
        if self.alpha <= 0:
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")
        if self.min_partition_size < 0:
            raise ConfigError(
                f"min_partition_size must be >= 0 (0 = auto), got {self.min_partition_size}")
        if self.classes_per_client < 1:
            raise ConfigError(f"classes_per_client must be >= 1, got {self.classes_per_client}")
        from fedhier.topology import validate_edge_periods

        validate_edge_periods(self.edge_period_list, self.periods, self.num_edges)
        if self.normalize_updates and len(set(self.edge_period_list)) > 1:
            raise ConfigError("normalize_updates (FedNova) is not supported with unequal "
                              "edge_periods")
        if self.local_period < 1 or self.global_period < 1:
            raise ConfigError("local_period and global_period must be positive integers")
        if len(self.periods) == 2 and self.global_period % self.local_period != 0:
            raise ConfigError(
                f"global_period G={self.global_period} must be a multiple of local_period "
                f"I={self.local_period}")
        from fedhier.topology import validate_periods

        validate_periods(self.periods)
        from fedhier.lr_schedules import LR_SCHEDULES
        from fedhier.optim import OPTIMIZER_STATES

        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        from fedhier.mobility import HANDOFFS

        _one_of("handoff", self.handoff, HANDOFFS)
        if not 0 <= self.mobility_rate <= 1:
            raise ConfigError(f"mobility_rate must be in [0, 1], got {self.mobility_rate}")
        if self.mobility_rate > 0 and self.mobility_trace:
            raise ConfigError("give mobility_rate or mobility_trace, not both")
        if self.reachability and self.num_edges < 2:
            raise ConfigError("a reachability matrix needs at least 2 edges")
        _one_of("optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        fraction_ok = 0 < self.participation <= 1
        count_ok = self.participation > 1 and float(self.participation).is_integer()
        if not (fraction_ok or count_ok):
            raise ConfigError(f"participation must be a fraction in (0, 1] or a whole number of "
                              f"clients, got {self.participation}")
        if not 0 <= self.straggler_fraction <= 1:
            raise ConfigError(f"straggler_fraction must be in [0, 1], got "
                              f"{self.straggler_fraction}")
        if self.straggler_min_steps < 1:
            raise ConfigError("straggler_min_steps must be at least 1")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0 or self.clip_norm < 0:
            raise ConfigError("need 0 <= momentum < 1, weight_decay >= 0 and clip_norm >= 0")
        if not 0 < self.lr_decay <= 1 or self.lr_step_every < 1:
            raise ConfigError("need 0 < lr_decay <= 1 and lr_step_every >= 1")
        if not 0 <= self.client_holdout < 1:
            raise ConfigError(f"client_holdout must be in [0, 1), got {self.client_holdout}")
        _one_of("on_nan", self.on_nan, ("stop", "skip-client"))
        from fedhier.reply_policy import ON_BAD_REPLY

        _one_of("on_bad_reply", self.on_bad_reply, ON_BAD_REPLY)
        self.reply_policy()  # its numbers are checked in one place: ReplyPolicy
        if not 0 <= self.fail_rate < 1 or not 0 <= self.dropout_fraction <= 1:
            raise ConfigError("need 0 <= fail_rate < 1 and 0 <= dropout_fraction <= 1")
        from fedhier.faults import parse_span

        parse_span(self.dropout_rounds)
        if self.round_timeout <= 0 or self.min_clients_per_edge < 0 or self.checkpoint_every < 0:
            raise ConfigError(
                "need round_timeout > 0, min_clients_per_edge >= 0 and checkpoint_every >= 0")
        if min(self.regroup_every, self.diagnostics_every, self.diagnostics_max_samples) < 0:
            raise ConfigError("regroup_every, diagnostics_every and diagnostics_max_samples "
                              "must be >= 0")
        if self.client_chunk < 0:
            raise ConfigError(f"client_chunk must be >= 0 (0 = auto), got {self.client_chunk}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be at least 1, got {self.rounds}")
        if self.batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0 (0 = full batch), got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not self.dataset:
            raise ConfigError("dataset must not be empty")
        from fedhier.grouping import BUILTIN_GROUPINGS, GRADIENT_GROUPING, available_groupings

        if ":" not in self.grouping:  # module:function is imported below
            _one_of("grouping", self.grouping, tuple(available_groupings()))
        if self.grouping not in BUILTIN_GROUPINGS and self.grouping != GRADIENT_GROUPING:
            from fedhier.grouping import load_plugin

            load_plugin(self.grouping)  # a plugin that fails to import: stop before any output
        self.mobility()  # unreadable or inconsistent mobility files: stop before any output
        self.time_model().check_edges(self.num_edges)
        self.asynchronous().check(self.num_edges, len(self.periods), self.aggregator_names,
                                  self.mobility_rate > 0 or bool(self.mobility_trace),
                                  self.regroup_every > 0, bool(self.edge_periods))
        if self.edge_servers:
            self._check_edge_servers()
        if self.async_buffer and self.cloud_strategy != "average":
            raise ConfigError("asynchronous edges (async_buffer) use the staleness-weighted "
                              "average at the cloud; choose cloud_strategy average")


    def _check_edge_servers(self) -> None:
        """What edge servers as processes do not run (yet), in one line."""
        from fedhier.grouping import grouping_needs

        if "gradients" in grouping_needs(self.grouping):
            raise ConfigError(f"edge servers as processes place clients before the run; the "
                              f"'{self.grouping}' grouping needs their gradients: choose "
                              "contiguous, random or a label-based grouping")
        if self.local_optimizer().has_state and self.optimizer_state == "keep":
            raise ConfigError("edge servers do not forward clients' kept optimizer state "
                              "(checkpoints): use optimizer_state reset")
        from fedhier.edge_tier import check_edge_tier

        check_edge_tier(len(self.periods), self.mobility_rate > 0 or bool(self.mobility_trace),
                        self.regroup_every > 0, self.async_buffer > 0, bool(self.edge_periods))


#: Largest finite float32: models, learning rates and optimiser state are float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38
#: The seeds every library the data layer calls accepts (scikit-learn's random_state).
SEED_RANGE = (0, 2**32 - 1)


def _check_ranges(cfg: RunConfig) -> None:
    """Limits of the libraries below: a seed outside 0..2**32-1 reaches scikit-learn, step
    counters and row indices are int64, and numbers become float32 tensors."""
    low, high = SEED_RANGE
    if not low <= cfg.seed <= high:
        raise ConfigError(f"seed must be in {low}..{high}, got {cfg.seed}")
    for f in fields(RunConfig):
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


#: Every setting's default (what a setting missing from a mapping takes).
FIELD_DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
_PERIOD_KEYS = frozenset({"periods", "local_period", "global_period"})


def _checked(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """snake_case key -> checked value of a mapping of RunConfig keys."""
    known = {f.name: f for f in fields(RunConfig)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{raw_key}' in {where}{hint}")
        kwargs[key] = _coerce(key, value, known[key].type, where)
    return kwargs


def check_card_defaults(raw: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The checked ``[defaults]`` table of a dataset card (``label`` names it in errors)."""
    from fedhier.datasets_cfg import NOT_CARD_DEFAULTS

    where = f"[defaults] of {label}"
    kwargs = _checked(raw, where)
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


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown {key} '{value}'{hint}; choose one of {', '.join(choices)}")


def _int_tuple(key: str, value: Any, where: str) -> tuple[int, ...]:
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


def _coerce(key: str, value: Any, kind: Any, where: str) -> Any:
    """Check a value's type; ints are accepted for floats, and bools only for bools."""
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    name = name.replace(" ", "")
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
        return _int_tuple(key, value, where)
    wanted = {"bool": "true or false", "int": "an integer", "float": "a number",
              "str": "a string"}.get(name, name)
    raise ConfigError(f"{key} in {where} must be {wanted}, got {value!r}")


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

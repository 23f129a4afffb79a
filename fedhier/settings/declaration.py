"""Every run setting, declared once: its name, type, default, help, valid values and the part
that reads it (:func:`setting`).

Everything else that lists settings is derived from these declarations
(:mod:`fedhier.settings.table`): the CLI flags (``--local-period``), the TOML and Flower
run-config keys, pyproject.toml's ``[tool.flwr.app.config]``, the ranges the configuration is
checked against and the table of docs/cli.md ("Valid values"), the fuzz harness's values, and
the parts' settings objects (:mod:`fedhier.settings.views`). Adding a setting that one part
reads is one :func:`setting` line here, the part's attribute and the code that uses it
(docs/index.md, "Adding a setting").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from fedhier.settings.ranges import AT_LEAST_0, AT_LEAST_1, POSITIVE, UNIT, UNIT_OPEN_TOP, Range

#: Valid values: a numeric range, a closed set of names, or "module:NAMES" (a set defined by
#: the module that implements them, imported when checked).
Valid = Range | tuple[str, ...] | str | None
#: The part that reads a setting: its name (:data:`fedhier.settings.views.PARTS`), or
#: (part, attribute[, "module:function" converting the setting's value: function(value, cfg)]);
#: a list for several parts.
Reader = str | tuple[Any, ...]


def setting(default: Any, help: str, *, valid: Valid = None,  # noqa: A002
            part: Reader | list[Reader] | None = None, **flower_app: Any) -> Any:
    """A setting's declaration (a dataclass field): its default and help (the flag's help and
    the docs), its valid values, the part that reads it, and optionally ``flower_app`` with
    ``flower_app_reason``: another value for the Flower app's [tool.flwr.app.config], and
    why (:mod:`fedhier.settings.table`)."""
    if flower_app.keys() not in (set(), {"flower_app", "flower_app_reason"}):
        raise TypeError("give flower_app and flower_app_reason together")
    entries = [] if part is None else part if isinstance(part, list) else [part]
    readers = tuple((entry, "", None) if isinstance(entry, str) else
                    (entry[0], entry[1], entry[2] if len(entry) > 2 else None)
                    for entry in entries)
    return field(default=default, metadata={"help": help, "valid": valid, "readers": readers,
                                            **flower_app})


@dataclass(frozen=True)
class DeclaredSettings:
    """Every setting of a run (:class:`fedhier.settings.run_config.RunConfig` adds how it is
    read, checked and viewed). Same settings and seed => same numbers."""

    # data
    dataset: str = setting(
        "digits",
        "dataset name (digits, fashion-mnist, synthetic, shakespeare, cifar10, femnist, npz) "
        "or a path to a dataset TOML; its card's [defaults] apply to settings not given")
    data_path: str = setting(
        "", "folder/file/hub name overriding the dataset's default location; a FILE.npz alone "
        "picks the npz dataset")
    partition: str = setting(
        "dirichlet", "client partition: dirichlet, iid, shards, natural, sorted",
        valid=("dirichlet", "iid", "shards", "natural", "sorted"))
    alpha: float = setting(
        0.5, "Dirichlet concentration (> 0)",
        valid=POSITIVE)
    min_partition_size: int = setting(
        0, "Dirichlet: minimum rows per client (resampled until met); 0 = auto: "
        "min(10, max(1, floor(alpha * train rows / (2 * clients))))",
        valid=AT_LEAST_0)
    self_balancing: bool = setting(
        False, "Dirichlet: stop giving a class to clients already above the average size")
    classes_per_client: int = setting(
        2, "shards: classes per client",
        valid=AT_LEAST_1)
    clients: int = setting(
        20, "number of clients n",
        valid=AT_LEAST_1)
    # hierarchy
    groups: tuple[int, ...] = setting(
        (4,), "number of edge servers N; for deeper trees one count per level, e.g. 8,2 = 8 edges "
        "under 2 regions",
        part="algorithm")
    grouping: str = setting(
        "random", "client -> edge assignment: random, contiguous, or a plugin name",
        part="algorithm")
    local_period: int = setting(
        5, "I: edge aggregation period, in local SGD steps",
        valid=AT_LEAST_1)
    global_period: int = setting(
        20, "G: cloud aggregation period, in local SGD steps (a multiple of I)",
        valid=AT_LEAST_1)
    edge_periods: str = setting(
        "", "per-edge periods I_i, comma-separated, one per edge, each dividing the next level's "
        "period (e.g. 2,4,4,8); the edge period I becomes their gcd ('' = off)",
        part=("algorithm", "edge_periods", "fedhier.settings.views:edge_periods"))
    regroup_every: int = setting(
        0, "regroup clients every K cloud rounds (0 = never); gradient grouping uses the current "
        "model's gradients",
        valid=AT_LEAST_0, part="algorithm")
    mobility_rate: float = setting(
        0.0, "client mobility: per cloud round each client moves to another (reachable) edge with "
        "this probability, at a seeded edge round (0 = static)",
        valid=UNIT, part=("mobility", "rate"))
    mobility_every: str = setting(
        "cloud-round",
        "mobility_rate per cloud-round (at most one move per cloud round) or per edge-round "
        "(a chance to move before every edge round: Chen et al.'s moving vehicles)",
        valid="fedhier.tree.mobility:MOBILITY_EVERY", part=("mobility", "every"))
    mobility_trace: str = setting(
        "", "client mobility from a CSV trace of rows round,client,edge (cloud rounds) or "
        "edge_round,client,edge (with that header)",
        part=("mobility", "trace", "fedhier.settings.views:mobility_trace"))
    reachability: str = setting(
        "", "CSV or .npy edge x edge 0/1 matrix: edge i may send a client to edge j (mobility "
        "and regrouping respect it)",
        part=("mobility", "reachability", "fedhier.settings.views:reachability"))
    handoff: str = setting(
        "fresh",
        "a moved client starts from its new edge's model (fresh) or brings its own (carry); "
        "MODEL:ADMISSION also says which reachable edge it joins: random (default) or "
        "min-divergence, e.g. fresh:min-divergence",
        valid="fedhier.tree.mobility:HANDOFFS",
        part=("mobility", "*", "fedhier.settings.views:handoff"))
    diagnostics_every: int = setting(
        0, "record divergences and gradient diversity at the initial model and every K cloud "
        "rounds (0 = off)",
        valid=AT_LEAST_0, part="algorithm")
    diagnostics_max_samples: int = setting(
        0, "cap on the rows per client (and pooled, for sample diversity) the diagnostics' "
        "gradients use (0 = all)",
        valid=AT_LEAST_0)
    periods: tuple[int, ...] = setting(
        (), "all aggregation periods P1,...,PL (one more than group levels); default I,G",
        part="algorithm")
    cloud_strategy: str = setting(
        "average",
        "cloud update: average (exact H-SGD) or a Flower strategy applied to the edge models: "
        "fedavg, fedavgm, fedadam, fedyogi, fedadagrad",
        valid=("average", "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"))
    aggregators: str = setting(
        "mean", "aggregation rule at every level, or one per level edge,...,cloud: mean (exact "
        "H-SGD), median, trimmed-mean[:b], clip[:C x|:tau] (norm-bounded mean), krum[:f], "
        "multi-krum[:f] (docs/security.md)",
        part=("algorithm", "aggregators", "fedhier.settings.views:aggregator_names"))
    server_lr: float = setting(
        0.0, "cloud strategy's server learning rate (0 = the strategy's default)",
        valid=AT_LEAST_0)
    server_momentum: float = setting(
        0.0, "fedavgm server momentum",
        valid=UNIT_OPEN_TOP)
    rounds: int = setting(
        30, "cloud rounds R; total local steps T = R * G",
        valid=AT_LEAST_1,
        flower_app=5,
        flower_app_reason=("a bare `flwr run .` is a first look at the Flower app on the "
                           "Simulation Engine, where every edge round is a message round "
                           "through the SuperLink; -c rounds=30 gives the default run"))
    # participation and local work
    participation: float = setting(
        1.0, "per edge round each edge trains this fraction of its clients (0 < f <= 1), or this "
        "many clients when > 1",
        valid=Range(0, low_open=True, whole_above_one=True), part="workload")
    straggler_fraction: float = setting(
        0.0, "share of clients (seeded) doing fewer than I local steps per edge round",
        valid=UNIT, part="workload")
    straggler_min_steps: int = setting(
        1, "fewest local steps a straggler does",
        valid=AT_LEAST_1, part="workload")
    normalize_updates: bool = setting(
        False, "FedNova-style: scale each client's update by tau_eff / tau_j within its edge",
        part="workload")
    # faults and robustness
    fail_rate: float = setting(
        0.0, "simulation: a client fails an edge round with this probability (seeded)",
        valid=UNIT_OPEN_TOP, part="faults")
    dropout_fraction: float = setting(
        0.0, "simulation: share of clients (seeded) away during --dropout-rounds",
        valid=UNIT, part="faults")
    dropout_rounds: str = setting(
        "", "simulation: cloud rounds 'A-B' during which the dropout clients are away",
        part=("faults", "dropout_span", "fedhier.settings.views:parse_span"))
    round_timeout: float = setting(
        3600.0, "seconds to wait for client replies in each round",
        valid=POSITIVE)
    min_clients_per_edge: int = setting(
        0, "stop the run when an edge round leaves an edge with fewer surviving clients",
        valid=AT_LEAST_0, part="algorithm")
    on_nan: str = setting(
        "stop",
        "a non-finite client update: stop the run, or skip-client (drop it from the average)",
        valid=("stop", "skip-client"), part="algorithm")
    on_bad_reply: str = setting(
        "auto", "a reply that breaks the contract: stop the run, or drop it (the client fails that "
        "round); auto = drop under fedhier deploy and edge servers, stop in simulations",
        valid="fedhier.round.reply_policy:ON_BAD_REPLY",
        part=("reply_policy", "on_bad_reply", "fedhier.settings.views:on_bad_reply"))
    exclude_after: int = setting(
        3, "a client whose replies were dropped K rounds in a row is excluded for the rest of "
        "the run (0 = never)",
        valid=AT_LEAST_0, part="reply_policy")
    max_weight_ratio: float = setting(
        10.0, "a client's size (its weight) is capped at this multiple of the median claimed "
        "size (0 = no cap; docs/security.md)",
        valid=AT_LEAST_0, part="reply_policy")
    max_update_ratio: float = setting(
        1000.0, "a train reply whose update is longer than this multiple of the round's median "
        "update is a bad reply (0 = no check; docs/security.md)",
        valid=AT_LEAST_0, part="reply_policy")
    metrics_aggregator: str = setting(
        "mean", "how the clients' evaluations become the recorded train_loss / train_accuracy: "
        "mean (weighted by the rows each evaluated), a robust rule (median, "
        "trimmed-mean[:b], krum[:f], multi-krum[:f]; per metric, unweighted) or model (the "
        "cloud level's rule of --aggregators; docs/security.md)",
        part="algorithm")
    checkpoint_every: int = setting(
        0, "write a checkpoint every K cloud rounds (0 = only on Ctrl-C)",
        valid=AT_LEAST_0)
    async_buffer: int = setting(
        0, "asynchronous edges: the cloud aggregates as soon as K edges reported their G steps "
        "(0 = synchronous; K = number of edges is synchronous H-SGD)",
        valid=AT_LEAST_0, part=("asynchronous", "buffer"))
    region_buffer: tuple[int, ...] = setting(
        (), "asynchronous regions (3+ levels): one K per level between the edges and the cloud; "
        "each node there aggregates its first K children's reports (0 = all of them) and "
        "async_buffer then counts the cloud's children's reports (0 = all)",
        part=("asynchronous", "regions"))
    max_staleness: int = setting(
        4, "asynchronous edges: drop a report more than S cloud aggregations old; fresher ones "
        "are discounted by staleness_fn",
        valid=AT_LEAST_0, part="asynchronous")
    async_rule: str = setting(
        "fedbuff", "asynchronous edges and regions: how the accepted reports make the new model: "
        "fedbuff (Nguyen et al. 2022: w + async_server_lr x the data-weighted mean of the "
        "discounted updates), fedasync (Xie et al. 2019: each report's model mixed into w "
        "with weight async_mixing x s), shifted-mean (the rule before these existed: the "
        "updates moved to w, their discounts renormalised)",
        valid=("fedbuff", "fedasync", "shifted-mean"), part=("async_rule", "name"))
    async_server_lr: float = setting(
        1.0, "async_rule fedbuff: the server learning rate eta_g applied to the buffer's update",
        valid=POSITIVE, part=("async_rule", "server_lr"))
    async_mixing: float = setting(
        0.5, "async_rule fedasync: the mixing weight alpha of a fresh report, in (0, 1]",
        valid=Range(0, 1, low_open=True), part=("async_rule", "mixing"))
    staleness_fn: str = setting(
        "polynomial:0.5", "asynchronous edges: the staleness discount s(t) of every async_rule, "
        "t in cloud aggregations: polynomial:A ((1+t)^-A; polynomial:0.5 is FedBuff's "
        "1/sqrt(1+t)), hinge:A:B (1 up to t = B, then 1/(A(t-B)+1)) or constant",
        part=("async_rule", "staleness", "fedhier.settings.views:staleness_function"))
    replay_arrivals: str = setting(
        "", "asynchronous two-level runs (inprocess, flower, deploy local --edges): take the "
        "edges' reports in the order recorded in this arrivals.jsonl or run folder, then by "
        "the simulated clock (docs/deployment.md#asynchronous-edges); '' = the run's own order",
        part=("asynchronous", "replay"))
    # simulated time (fedhier.round.clock): metrics.jsonl's sim_seconds
    step_seconds: float = setting(
        0.01, "simulated time: seconds of compute per local step of a typical client",
        valid=AT_LEAST_0, part="time_model")
    real_step_seconds: float = setting(
        0.0, "deploy local --edges: every client also really sleeps this many seconds per "
        "local step x its edge's edge_slowdown factor (wall-clock time only, no number "
        "changes; 0 = no sleep)",
        valid=Range(0, 3600, high_open=True))
    compute_spread: float = setting(
        0.0, "simulated time: each client's speed factor is exp(N(0, spread)), drawn with the "
        "seed (0 = all equal)",
        valid=AT_LEAST_0, part="time_model")
    edge_slowdown: str = setting(
        "", "simulated time: compute slowdown of some edges' clients, edge:factor pairs such "
        "as 0:4",
        part=("time_model", "edge_slowdown", "fedhier.settings.views:edge_slowdown"))
    client_edge_mbps: float = setting(
        100.0, "simulated time: bandwidth of each edge's link to its clients, Mbit/s (shared)",
        valid=POSITIVE, part="time_model")
    client_edge_latency_ms: float = setting(
        5.0, "simulated time: one-way latency of a client-edge link, ms",
        valid=AT_LEAST_0, part="time_model")
    edge_cloud_mbps: float = setting(
        10.0, "simulated time: bandwidth of the cloud's (and each region's) link to its children, "
        "Mbit/s (shared)",
        valid=POSITIVE, part="time_model")
    edge_cloud_latency_ms: float = setting(
        50.0, "simulated time: one-way latency of a link above the edges, ms",
        valid=AT_LEAST_0, part="time_model")
    # local training
    batch_size: int = setting(
        16, "mini-batch size b; 0 = all of a client's rows (gradient descent)",
        valid=AT_LEAST_0)
    lr: float = setting(
        0.1, "SGD learning rate",
        valid=POSITIVE)
    lr_schedule: str = setting(
        "constant",
        "constant, step (x lr_decay every lr_step_every steps), cosine (over T), exponential "
        "(x lr_decay per cloud round)",
        valid="fedhier.local.lr_schedules:LR_SCHEDULES")
    lr_decay: float = setting(
        0.1, "decay factor of step/exponential",
        valid=Range(0, 1, low_open=True))
    lr_step_every: int = setting(
        1000, "step schedule: decay every this many global iterations",
        valid=AT_LEAST_1)
    momentum: float = setting(
        0.0, "local SGD momentum",
        valid=UNIT_OPEN_TOP, part="local_optimizer")
    weight_decay: float = setting(
        0.0, "local SGD weight decay (L2)",
        valid=AT_LEAST_0, part="local_optimizer")
    clip_norm: float = setting(
        0.0, "clip each local gradient to this L2 norm (0 = off)",
        valid=AT_LEAST_0, part="local_optimizer")
    langevin_temperature: float = setting(
        0.0, "Langevin dynamics (SGLD): every local step adds sqrt(2 lr T) N(0, I) to the "
        "parameters at this temperature T (0 = off)",
        valid=AT_LEAST_0, part=("langevin", "temperature"))
    quantize_bits: int = setting(
        0, "clients send their update (model minus start model) QSGD-quantised to this many "
        "bits per value, 2..16: a sign and 2**(b-1) - 1 levels, unbiased stochastic "
        "rounding; counted so on the client-edge link (0 = off: float32)",
        valid=Range(0, 16), part="algorithm")
    optimizer_state: str = setting(
        "reset", "momentum buffers: reset at each edge round, or keep per client across rounds",
        valid=("reset", "keep"))
    client_holdout: float = setting(
        0.0, "fraction of each client's rows held out (seeded) for per-client evaluation",
        valid=UNIT_OPEN_TOP)
    model: str = setting(
        "mlp", "model: logreg, mlp, cnn, lenet5 (LeNet-5, image datasets), lstm (text)",
        valid=("logreg", "mlp", "cnn", "lstm", "lenet5"))
    weighting: str = setting(
        "samples",
        "averaging weights: samples (by client data size) or uniform (each client equal)",
        valid=("samples", "uniform"), part="algorithm")
    # execution
    engine: str = setting(
        "inprocess",
        "inprocess (Flower strategy + ClientApp in one process), flower (Simulation Engine on "
        "Ray), vectorized (all clients as one batched computation) or vectorized-ray (the "
        "batched engine sharded by edge over a Ray cluster)",
        valid="fedhier.engines.registry:engine_names")
    edge_servers: bool = setting(
        False, "the cloud's nodes are edge servers that run their own clients' edge rounds (set by "
        "fedhier deploy local --edges; with --engine flower the Simulation Engine's nodes; "
        "every other engine keeps the edges inside the cloud)")
    client_chunk: int = setting(
        0, "vectorized engine: clients per batched chunk (0 = auto: about 2 MiB of models per "
        "chunk on a CPU, all clients on other devices; K >= clients = all at once)",
        valid=AT_LEAST_0)
    ray_address: str = setting(
        "", "an existing Ray cluster (host:port of its head, or auto) for the vectorized-ray "
        "engine's workers, the flower engine's actors and fedhier sweep's trials; empty = a "
        "local Ray started and "
        "stopped by the command")
    ray_workers: int = setting(
        2, "vectorized-ray engine: workers (Ray actors, one CPU each), each a shard of whole "
        "edges",
        valid=AT_LEAST_1)
    device: str = setting(
        "cpu", "cpu, cuda, cuda:N, mps or auto (best available)")
    seed: int = setting(
        0, "seed for every random draw",
        valid=Range(0, 2**32 - 1), part=["algorithm", "langevin"])
    out: str = setting(
        "", "run folder (default runs/<timestamp>-<name>)")


#: setting -> its valid range (every numeric setting has one: tests/test_ranges.py)
RANGES: dict[str, Range] = {f.name: f.metadata["valid"] for f in fields(DeclaredSettings)
                            if isinstance(f.metadata["valid"], Range)}


def choices() -> dict[str, tuple[str, ...]]:
    """setting -> its valid names, for every setting that takes one of a fixed set (the
    grouping, open to plugins, is checked on its own)."""
    out = {}
    for f in fields(DeclaredSettings):
        valid = f.metadata["valid"]
        if isinstance(valid, str):  # "module:NAMES" (or a function returning them)
            module, attribute = valid.split(":")
            found = getattr(importlib.import_module(module), attribute)
            valid = tuple(found() if callable(found) else found)
        if isinstance(valid, tuple):
            out[f.name] = valid
    return out


def names_of(name: str) -> tuple[str, ...]:
    """The closed set of names setting ``name`` declares (its one list: the code that
    implements them reads it from here)."""
    valid = next(f.metadata["valid"] for f in fields(DeclaredSettings) if f.name == name)
    if not isinstance(valid, tuple):
        raise TypeError(f"setting {name} declares no tuple of names")
    return valid

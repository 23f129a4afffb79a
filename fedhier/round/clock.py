"""Simulated wall-clock time: a network and compute model that turns a run's schedule into
seconds, the same way for every engine.

The model (docs/hsgd.md, "Simulated time"):

* **compute**: client j needs ``step_seconds * speed_j * slowdown_e`` seconds per local step,
  ``speed_j = exp(N(0, compute_spread))`` drawn once per client with the seed (1 for all when
  the spread is 0) and ``slowdown_e`` the factor of its edge e (``edge_slowdown``, default 1);
* **links**: a server's link to its children is one shared channel of ``mbps`` Mbit/s with
  ``latency_ms`` one-way latency; sending ``m`` models of ``B`` bytes over it, one way, takes
  ``latency + m * 8B / (mbps * 1e6)`` seconds. The client-edge tier uses the ``client_edge_*``
  pair, every tier above the edges the ``edge_cloud_*`` pair;
* **an edge round** at edge e with sent clients S: the edge's model goes down to S, the slowest
  of them computes its steps, the models come up: ``2 transfer(|S|) + max_{j in S} steps_j *
  seconds_j``. A failed client is waited for like the others (the edge cannot know);
* **uploads share a link one after another**: children's models go up a shared link in the
  order they are ready (ties: lower index first); each occupies it ``8B / (mbps * 1e6)``
  seconds and arrives ``latency`` later (:meth:`SimClock.upload_queue`). Children ready at
  the same instant thus take ``transfer(m)``, as above;
* **an aggregation at level L >= 2**: each level-l node (l = 2..L) waits for the last of its
  children's models to arrive; the level-L aggregate then goes back down the same links to
  every edge under it (``transfer(children)`` per tier).

Edges keep their own clocks between aggregations (an edge with quick clients waits only at the
next aggregation above it); ``seconds`` is the latest edge clock, the run's elapsed time. No
Flower import; the algorithm (:mod:`fedhier.round.loop`) drives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.common.rng import generator
from fedhier.tree.hierarchy import Hierarchy


@dataclass(frozen=True)
class TimeModel:
    """Compute and link speeds (units in the names); see the module docstring."""

    step_seconds: float = 0.01
    compute_spread: float = 0.0
    client_edge_mbps: float = 100.0
    client_edge_latency_ms: float = 5.0
    edge_cloud_mbps: float = 10.0
    edge_cloud_latency_ms: float = 50.0
    edge_slowdown: tuple[tuple[int, float], ...] = ()  # (edge, factor >= 1e-9)

    def __post_init__(self) -> None:
        for name in ("step_seconds", "compute_spread", "client_edge_latency_ms",
                     "edge_cloud_latency_ms"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("client_edge_mbps", "edge_cloud_mbps"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0 (Mbit/s), got {value}")

    def check_edges(self, num_edges: int) -> None:
        """A one-line ConfigError when ``edge_slowdown`` names an edge that does not exist."""
        for edge, _ in self.edge_slowdown:
            if not 0 <= edge < num_edges:
                raise ConfigError(f"edge_slowdown names edge {edge}, but the edges are "
                                  f"0..{num_edges - 1}")

    def transfer_seconds(self, tier: str, messages: np.ndarray | int,
                         model_bytes: int) -> np.ndarray:
        """float64: seconds to send ``messages`` models one way over a ``tier`` link
        ("client-edge" or "edge-cloud"); 0 messages take no time."""
        latency, per_model = self.link(tier, model_bytes)
        m = np.asarray(messages, dtype=np.float64)
        return np.where(m > 0, latency + m * per_model, 0.0)

    def link(self, tier: str, model_bytes: int) -> tuple[float, float]:
        """(one-way latency, seconds one model occupies the link) of a ``tier`` link
        ("client-edge" or "edge-cloud")."""
        mbps, latency_ms = ((self.client_edge_mbps, self.client_edge_latency_ms)
                            if tier == "client-edge"
                            else (self.edge_cloud_mbps, self.edge_cloud_latency_ms))
        return latency_ms / 1e3, 8.0 * model_bytes / (mbps * 1e6)

    def client_step_seconds(self, seed: int, num_clients: int) -> np.ndarray:
        """float64 [n]: each client's seconds per local step (before its edge's slowdown)."""
        if self.compute_spread == 0:
            return np.full(num_clients, self.step_seconds)
        speed = generator(seed, "compute-speed").lognormal(0.0, self.compute_spread,
                                                             num_clients)
        return self.step_seconds * speed

    def edge_factors(self, num_edges: int) -> np.ndarray:
        """float64 [E]: each edge's compute slowdown."""
        factors = np.ones(num_edges)
        for edge, factor in self.edge_slowdown:
            factors[edge] = factor
        return factors


def parse_edge_slowdown(text: str) -> tuple[tuple[int, float], ...]:
    """``"0:4,3:2.5"`` -> ((0, 4.0), (3, 2.5)); "" -> (); a one-line ConfigError otherwise."""
    out: list[tuple[int, float]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        edge, sep, factor = item.partition(":")
        try:
            pair = (int(edge), float(factor))
        except ValueError:
            pair = None
        if not sep or pair is None or not np.isfinite(pair[1]) or pair[1] <= 0 or pair[0] < 0:
            raise ConfigError(f"edge_slowdown '{text}': give edge:factor pairs such as "
                              "'0:4,3:2' (edge >= 0, factor > 0)")
        if any(pair[0] == seen for seen, _ in out):
            raise ConfigError(f"edge_slowdown '{text}' names edge {pair[0]} twice")
        out.append(pair)
    return tuple(out)


class SimClock:
    """Per-edge simulated clocks of one run (seconds since the start)."""

    def __init__(self, model: TimeModel, seed: int, num_clients: int, num_edges: int,
                 upload_bytes: int | None = None) -> None:
        model.check_edges(num_edges)
        self.model = model
        #: bytes of one client's upload when they differ from a model's (quantised
        #: updates, fedhier.local.quantization); None = a model's
        self.upload_bytes = upload_bytes
        self.step_seconds = model.client_step_seconds(seed, num_clients)  # float64 [n]
        self.edge_factor = model.edge_factors(num_edges)  # float64 [E]
        self.edge_time = np.zeros(num_edges)  # float64 [E], seconds

    @property
    def seconds(self) -> float:
        """The run's simulated elapsed time: the latest edge clock."""
        return float(self.edge_time.max()) if len(self.edge_time) else 0.0

    def edge_round_seconds(self, clients: np.ndarray, steps: np.ndarray,
                           edge_of_client: np.ndarray, model_bytes: int,
                           downloads: np.ndarray | None = None,
                           uploads: np.ndarray | None = None) -> np.ndarray:
        """float64 [E]: each edge's time for an edge round in which ``clients`` (int64 [k])
        do ``steps`` (int64 [k]) local steps at the edges ``edge_of_client`` [n] names
        (0 for an edge without a sent client).

        By default every sent client receives its edge's model and sends one back; per-edge
        periods say which sent clients receive one (``downloads``, bool [k]) and how many
        models each edge receives at the end (``uploads``, int64 [E]).
        """
        num_edges = len(self.edge_time)
        edges = edge_of_client[clients]
        compute = steps * self.step_seconds[clients] * self.edge_factor[edges]
        slowest = np.zeros(num_edges)
        np.maximum.at(slowest, edges, compute)
        sent = np.bincount(edges, minlength=num_edges)
        up_bytes = model_bytes if self.upload_bytes is None else self.upload_bytes
        if downloads is None and uploads is None and up_bytes == model_bytes:
            return 2 * self.model.transfer_seconds("client-edge", sent, model_bytes) + slowest
        down = sent if downloads is None else np.bincount(edges[downloads],
                                                          minlength=num_edges)
        up = sent if uploads is None else uploads
        # (down + up) + slowest: with down == up this is 2 * t + slowest to the last bit, so
        # equal per-edge periods give the clock of no per-edge periods exactly
        return (self.model.transfer_seconds("client-edge", down, model_bytes)
                + self.model.transfer_seconds("client-edge", up, up_bytes) + slowest)

    def edge_round(self, clients: np.ndarray, steps: np.ndarray,
                   edge_of_client: np.ndarray, model_bytes: int,
                   downloads: np.ndarray | None = None,
                   uploads: np.ndarray | None = None) -> None:
        """Advance each edge's clock by its edge round (see :meth:`edge_round_seconds`)."""
        self.edge_time += self.edge_round_seconds(clients, steps, edge_of_client, model_bytes,
                                                  downloads, uploads)

    def aggregate(self, hierarchy: Hierarchy, level: int, model_bytes: int) -> None:
        """An aggregation at ``level``: the edges under each level-``level`` node wait for
        the last of them, their models go up the tiers and the aggregate comes back down."""
        if level < 2:
            return
        ready = self.edge_time.copy()  # float64 [nodes of the current level]
        above = np.arange(len(ready))  # each edge's ancestor at the current level
        down = np.zeros(len(ready))  # float64 [E]: each edge's way back down so far
        for upper in range(2, level + 1):
            parent = (hierarchy.parents[upper - 1] if upper < hierarchy.num_levels
                      else np.zeros(hierarchy.num_nodes(upper - 1), dtype=np.int64))
            nodes = hierarchy.num_nodes(upper)
            link = self.model.transfer_seconds(
                "edge-cloud", np.bincount(parent, minlength=nodes), model_bytes)
            ready = self._last_arrivals(ready, parent, nodes, model_bytes)
            above = parent[above]
            down += link[above]
        self.edge_time = ready[above] + down

    def _last_arrivals(self, ready: np.ndarray, parent: np.ndarray, nodes: int,
                       model_bytes: int) -> np.ndarray:
        """float64 [nodes]: when each node has the last of its children's models, the
        children (ready at ``ready`` [m], under ``parent`` [m]) queuing on its link."""
        arrivals, _ = self._queue(ready, parent, np.full(nodes, -np.inf), model_bytes)
        last = np.full(nodes, -np.inf)
        np.maximum.at(last, parent, arrivals)
        return last

    def upload_queue(self, ready: np.ndarray, link_free: float,
                     model_bytes: int) -> tuple[np.ndarray, float]:
        """Arrival times (float64 [m]) of one model from each of m children ready at
        ``ready`` over one shared link above the edges that is free from ``link_free``,
        served in order of readiness (ties: lower index first); and when the link is free
        again."""
        arrivals, free = self._queue(ready, np.zeros(len(ready), dtype=np.int64),
                                     np.array([link_free]), model_bytes)
        return arrivals, float(free[0])

    def _queue(self, ready: np.ndarray, parent: np.ndarray, free: np.ndarray,
               model_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The shared links above the edges, one per node: children's models (ready at
        ``ready`` [m], sent to ``parent`` [m]) go one after another in order of readiness
        (ties: lower index first) over a link free from ``free`` [nodes]. Returns each
        model's arrival time [m] and when each link is free again [nodes]."""
        latency, per_model = self.model.link("edge-cloud", model_bytes)
        free = free.copy()
        arrivals = np.empty(len(ready))
        for child in np.lexsort((np.arange(len(ready)), ready, parent)).tolist():
            node = parent[child]
            free[node] = max(free[node], float(ready[child])) + per_model
            arrivals[child] = free[node] + latency
        return arrivals, free

    def state_dict(self) -> dict[str, Any]:
        return {"edge_time": self.edge_time.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.edge_time = np.asarray(state["edge_time"], dtype=np.float64)

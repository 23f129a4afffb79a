"""Client mobility: the client -> edge map as a function of the edge round.

Only level 0 -> 1 moves (a client changes edge); the edges' places in the tree above (edge ->
region -> cloud) stay fixed. Two models:

- **Markov** (``rate`` > 0): in every cloud round each client moves with probability
  ``rate`` to an edge drawn uniformly among those its current edge reaches (every other edge
  without a reachability matrix). A client that moves in cloud round r moves before a seeded
  edge round k in 1..E of that round (E = G / I), uniform; it belongs to its new edge from
  edge round k on (k = 1: at the cloud round's start). Every draw comes from
  ``generator(seed, "mobility", cloud round, client)``, so the map is a pure function of the
  seed, the ids and the map the cloud round starts from, never of execution order.
- **Markov per edge round** (``rate`` > 0, ``every = "edge-round"``; Chen et al.'s vehicles,
  whose speed sets how often they change cells): before each edge round k of a cloud round
  every client moves with probability ``rate`` to an edge drawn uniformly among those its
  edge at that moment reaches (a one-way ring road: ``reachability`` of i -> i+1), so a
  client can move several times per cloud round. Client c's draws of cloud round r are
  ``generator(seed, "mobility-edge-round", r, c).random(2 E)`` (move, then which edge, per
  edge round); moves are admitted in (edge round, client) order.
- **Trace** (a CSV file): rows ``round,client,edge`` (cloud rounds: from that round's first
  edge round) or, with an ``edge_round`` header, ``edge_round,client,edge`` (from that edge
  round): the client is at that edge from then on.

``handoff`` says which model a moved client starts its first edge round at the new edge from:
``fresh`` = the new edge's model, ``carry`` = the model it ended its last edge round with (its
old edge's model, which every member of that edge was given at the last edge aggregation).
``admission`` says which edge a moving client joins (:mod:`fedhier.tree.admission`): ``random``
(the draw above; a traced move: the trace's edge) or ``min-divergence`` (among the same
candidates, the edge that leaves the label upward divergence lowest; a traced move's
candidates are the trace's edge and the edges it reaches). Where a client goes and which model
it brings are independent settings.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.common.rng import generator
from fedhier.tree.admission import ADMISSIONS, Move, get_admission

#: How the model travels with a moved client.
HANDOFF_MODELS = ("fresh", "carry")
#: How often the Markov model may move a client (``mobility_every``).
MOBILITY_EVERY = ("cloud-round", "edge-round")
#: Every accepted ``handoff`` value: MODEL or MODEL:ADMISSION.
HANDOFFS = (*HANDOFF_MODELS, *(f"{m}:{a}" for m in HANDOFF_MODELS for a in ADMISSIONS))


def parse_handoff(text: str) -> tuple[str, str]:
    """``MODEL[:ADMISSION]`` (e.g. ``fresh``, ``carry:min-divergence``) -> (handoff,
    admission); one-line errors. The admission defaults to ``random``."""
    model, _, admission = str(text).partition(":")
    if model not in HANDOFF_MODELS:
        raise ConfigError(f"unknown handoff '{model}' in '{text}'; choose one of "
                          f"{', '.join(HANDOFF_MODELS)}, optionally followed by :ADMISSION "
                          f"({', '.join(ADMISSIONS)})")
    if admission and admission not in ADMISSIONS:
        raise ConfigError(f"unknown admission '{admission}' in handoff '{text}'; choose one "
                          f"of {', '.join(ADMISSIONS)}")
    return model, admission or "random"


@dataclass(frozen=True)
class Mobility:
    """A mobility model (see the module docstring).

    Attributes:
        rate: per cloud round, the probability that a client moves (0 = static).
        reachability: bool rows ``[edge][edge]``: a client at edge i may move to edge j
            (the diagonal is ignored); None = every edge reaches every other.
        trace: ``(edge_round, client, edge)`` moves, sorted (edge rounds are 1-based over
            the run).
        handoff: ``fresh`` or ``carry`` (which model a moved client brings).
        admission: which edge a moving client joins (:data:`fedhier.tree.admission.ADMISSIONS`).
        every: ``cloud-round`` (at most one move per cloud round) or ``edge-round`` (a
            chance to move before every edge round).
    """

    rate: float = 0.0
    reachability: tuple[tuple[bool, ...], ...] | None = None
    trace: tuple[tuple[int, int, int], ...] = ()
    handoff: str = "fresh"
    admission: str = "random"
    every: str = "cloud-round"

    @property
    def active(self) -> bool:
        """Whether clients can move at all (rate 0 without a trace is today's static run)."""
        return self.rate > 0 or bool(self.trace)

    def reaches(self, num_edges: int) -> np.ndarray:
        """bool [N, N]: edge i may send a client to edge j (never to itself)."""
        if self.reachability is None:
            matrix = np.ones((num_edges, num_edges), dtype=bool)
        else:
            matrix = np.array(self.reachability, dtype=bool)
        matrix = matrix.copy()
        np.fill_diagonal(matrix, False)
        return matrix

    def maps(self, seed: int, cloud_round: int, edge_rounds: int,
             start: np.ndarray, num_edges: int,
             histograms: np.ndarray | None = None) -> np.ndarray:
        """int64 [E, n]: the client -> edge map of each of cloud round ``cloud_round``'s
        E = ``edge_rounds`` edge rounds, starting from the map ``start`` [n].

        Each move's edge is its admission policy's choice (:mod:`fedhier.tree.admission`) given
        the map in force when it takes effect; moves are admitted in (edge round, client)
        order. ``histograms`` [n, C]: the clients' label histograms (``min-divergence``)."""
        maps = np.repeat(np.asarray(start, dtype=np.int64)[None], edge_rounds, axis=0)
        reach = self.reaches(num_edges)
        if self.rate > 0 and self.every == "edge-round":
            return self._edge_round_moves(maps, seed, cloud_round, reach, histograms)
        moves: list[tuple[int, int, Move]] = []  # (edge round k, client, move)
        if self.rate > 0:
            for client in range(len(start)):
                draw = generator(seed, "mobility", cloud_round, client)
                moved, when, which = draw.random(), int(draw.integers(1, edge_rounds + 1)), \
                    draw.random()
                options = np.flatnonzero(reach[start[client]])
                if moved < self.rate and len(options):
                    moves.append((when, client, Move(client, options, draw=which)))
        first = (cloud_round - 1) * edge_rounds + 1
        for edge_round, client, edge in self.trace:
            if first <= edge_round < first + edge_rounds:
                options = np.flatnonzero(reach[edge] | (np.arange(num_edges) == edge))
                moves.append((edge_round - first + 1, client,
                              Move(client, options, preferred=edge)))
        admit = get_admission(self.admission)
        for when, client, move in sorted(moves, key=lambda m: (m[0], m[1])):
            maps[when - 1:, client] = admit(move, maps[when - 1], histograms, num_edges)
        return maps

    def _edge_round_moves(self, maps: np.ndarray, seed: int, cloud_round: int,
                          reach: np.ndarray, histograms: np.ndarray | None) -> np.ndarray:
        """:meth:`maps` of the per-edge-round Markov model (module docstring), in place on
        ``maps`` [E, n] (every row the start map)."""
        edge_rounds, num_clients = maps.shape
        draws = np.stack([generator(seed, "mobility-edge-round", cloud_round, c).random(
            2 * edge_rounds) for c in range(num_clients)]) if num_clients else np.zeros((0, 0))
        admit = get_admission(self.admission)
        for k in range(edge_rounds):
            for client in np.flatnonzero(draws[:, 2 * k] < self.rate).tolist():
                options = np.flatnonzero(reach[maps[k, client]])
                if len(options):
                    maps[k:, client] = admit(Move(client, options, draw=draws[client, 2 * k + 1]),
                                             maps[k], histograms, len(reach))
        return maps

    def edge_of_client(self, edge_round: int, initial: np.ndarray, seed: int,
                       edge_rounds: int, num_edges: int,
                       histograms: np.ndarray | None = None) -> np.ndarray:
        """int64 [n]: the map in force in ``edge_round`` (1-based) of a run that starts from
        ``initial`` and never regroups."""
        cloud_round = (edge_round - 1) // edge_rounds + 1
        current = np.asarray(initial, dtype=np.int64)
        for r in range(1, cloud_round + 1):
            maps = self.maps(seed, r, edge_rounds, current, num_edges, histograms)
            if r == cloud_round:
                return maps[edge_round - (r - 1) * edge_rounds - 1].copy()
            current = maps[-1]
        return current.copy()

    def respect(self, old: np.ndarray, new: np.ndarray, num_edges: int) -> np.ndarray:
        """A regrouping ``new`` of clients at ``old`` under the reachability matrix: a client
        whose new edge its current edge does not reach stays where it is."""
        if self.reachability is None:
            return new
        ok = (old == new) | self.reaches(num_edges)[old, new]
        return np.where(ok, new, old).astype(np.int64)


# ------------------------------------------------------------------------------ files
def read_reachability(path: str, num_edges: int) -> tuple[tuple[bool, ...], ...]:
    """An edge x edge 0/1 matrix from a .npy or CSV file, checked; one-line errors."""
    try:
        if path.endswith(".npy"):
            matrix = np.load(path, allow_pickle=False)
        else:
            matrix = np.loadtxt(path, delimiter=",", ndmin=2)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read reachability matrix {path}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                          ) from None
    if matrix.shape != (num_edges, num_edges):
        raise ConfigError(f"reachability matrix {path} has shape {list(matrix.shape)}; "
                          f"the run has {num_edges} edges, so it must be "
                          f"{num_edges} x {num_edges}")
    if not np.isin(matrix, (0, 1)).all():
        raise ConfigError(f"reachability matrix {path} must hold only 0 and 1")
    reach = matrix.astype(bool)
    np.fill_diagonal(reach, False)
    stuck = np.flatnonzero(~reach.any(axis=1))
    if len(stuck):
        raise ConfigError(f"reachability matrix {path}: edge {int(stuck[0])} reaches no other "
                          "edge")
    return tuple(tuple(bool(v) for v in row) for row in matrix.astype(bool))


def read_trace(path: str, clients: int, num_edges: int, rounds: int,
               edge_rounds: int) -> tuple[tuple[int, int, int], ...]:
    """Moves ``(edge_round, client, edge)`` from a CSV trace (see the module docstring),
    checked against the run's clients, edges and rounds; one-line errors."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = [r for r in csv.reader(handle) if r and any(c.strip() for c in r)]
    except OSError as exc:
        raise ConfigError(f"cannot read mobility trace {path}: {exc.strerror}") from None
    in_edge_rounds = has_header = False
    if rows and not rows[0][0].strip().lstrip("-").isdigit():
        header = [c.strip().lower() for c in rows[0]]
        if header not in (["round", "client", "edge"], ["edge_round", "client", "edge"]):
            raise ConfigError(f"mobility trace {path}: the header must be 'round,client,edge' "
                              f"or 'edge_round,client,edge', got '{','.join(rows[0])}'")
        in_edge_rounds, has_header = header[0] == "edge_round", True
        rows = rows[1:]
    last = rounds * edge_rounds if in_edge_rounds else rounds
    unit = "edge round" if in_edge_rounds else "round"
    moves: dict[tuple[int, int], int] = {}
    name = Path(path).name
    for line, row in enumerate(rows, start=2 if has_header else 1):
        try:
            when, client, edge = (int(c) for c in row)
        except ValueError:
            raise ConfigError(f"mobility trace {name} row {line}: need three integers "
                              f"round,client,edge, got '{','.join(row)}'") from None
        if not 1 <= when <= last:
            raise ConfigError(f"mobility trace {name} row {line}: {unit} {when} is not in "
                              f"1..{last}")
        if not 0 <= client < clients:
            raise ConfigError(f"mobility trace {name} row {line}: client {client} does not "
                              f"exist (clients 0..{clients - 1})")
        if not 0 <= edge < num_edges:
            raise ConfigError(f"mobility trace {name} row {line}: edge {edge} does not exist "
                              f"(edges 0..{num_edges - 1})")
        at = when if in_edge_rounds else (when - 1) * edge_rounds + 1
        if moves.get((at, client), edge) != edge:
            raise ConfigError(f"mobility trace {name} row {line}: client {client} is sent to "
                              f"two edges in {unit} {when}")
        moves[(at, client)] = edge
    return tuple(sorted((at, client, edge) for (at, client), edge in moves.items()))

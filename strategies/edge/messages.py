"""The messages between fedhier's cloud and its edge servers (docs/deployment.md#edge-servers).

The cloud ServerApp reaches each of its child servers (edges; regions in a deeper tree) as one
node of the cloud SuperLink, a region its edges as nodes of its own SuperLink, and an edge
server its clients through its own SuperLink under the client message contract
(docs/contract.md). Between two tiers of servers, one message per server and task:

=====================  ==========================================================================
``query`` (profile)    reply ``metrics``: ``edge-id`` and, per client under the server (lists
                       in the order of ``partition-ids``), ``num-examples``, ``label-histogram``
                       (flattened, ``num-classes`` per client) and, above the edges,
                       ``server-path`` (its servers at levels 1 .. l-1, flattened)
``train``              a job: ``arrays`` (the parent's model), ArrayRecord ``edge-job``
                       (``edge-of-client``, ``num-examples`` int64 [n], ``edge-seconds``
                       float64 [E], ``parents-k`` the tree above the edges), ``config``: the
                       run configuration plus ``server-round``, ``edge-id``, ``node-level``,
                       ``first-edge-round``, ``num-edge-rounds`` and, when a client could not
                       be re-attached, ``absent-clients`` (its partition ids); with a ``carry``
                       handoff also ``start-edge-of-client``, and with it or a region's job
                       that starts inside its period ``carried-edges`` in the job record and
                       ArrayRecord ``carried`` (those edges' models); clients that moved
                       into the server's subtree with kept state: their state, one
                       ArrayRecord ``state/<client>/<name>`` each (as ``query.state``).
                       Reply: ``arrays`` (the edge's aggregate; absent when no client survived)
                       and ``metrics`` (see :func:`report_from_reply`); a region's job that
                       ends inside its parent's period: ArrayRecord ``edge-models`` (its
                       edges' models, ``edges`` in the metrics) instead of ``arrays``
                       The report's ``dropped-replies``: the clients' replies the server
                       dropped as bad during the job.
``evaluate``           ``arrays`` (the global model); reply ``metrics``: per client ``loss``,
                       ``accuracy``, ``holdout-accuracy`` (NaN: none), ``num-examples``
``query.gradient``     ``arrays``; reply ArrayRecord ``gradient`` (``g``: [k, P] in
                       ``partition-ids`` order)
``query.state``        for a checkpoint (or moving clients: ConfigRecord ``state-clients``,
                       ``clients``, names the ones to ask), the kept state of the clients under
                       the server (their ``context.state``: momentum with
                       ``optimizer-state = keep``); reply one ArrayRecord
                       ``state/<client>/<name>`` per client and record (none when the clients
                       keep nothing)
``query.restore``      a resumed run's kept state back to the clients, in the same records
                       (the server's clients only); reply ``metrics``: ``edge-id``
=====================  ==========================================================================

Both ends are fedhier's, so the models (``arrays``, ``carried``, ``edge-models``) and the job
record travel packed, one object each instead of 1 + 2 per tensor
(:mod:`fedhier.clients.wire.packed_model`; read in either form).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedhier.clients.wire.packed_model import get_model, has_model, model_record
from fedhier.local.optimizer import Params
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.round.tiers.moves import ClientStates

EDGE_ID = "edge-id"
PARTITION_IDS = "partition-ids"
#: Per client of a server above the edges, its servers at levels 1 .. l-1 (flattened).
PATH = "server-path"
JOB_RECORD = "edge-job"
#: A carry handoff's models of the moved clients' old edges (name -> [m, *shape]).
CARRIED = "carried"
#: A report's models of the server's edges (name -> [m, *shape]; a segment's end).
EDGE_MODELS = "edge-models"
#: ``unreached-<level>``: the servers of that level under a server that missed a job.
UNREACHED = "unreached"
LEVEL = "node-level"
FIRST_ROUND = "first-edge-round"
NUM_ROUNDS = "num-edge-rounds"
#: A job's clients that could not be re-attached to their new edge (the edge does not wait
#: for them: they fail its edge rounds until they come online there).
ABSENT = "absent-clients"
#: A report's count of the clients' replies the server dropped as bad during the job.
DROPPED = "dropped-replies"
#: The config keys a parent adds for a server (not the run configuration's).
EDGE_KEYS = (EDGE_ID, LEVEL, FIRST_ROUND, NUM_ROUNDS, ABSENT)
#: The prefix of a client's kept-state record: ``state/<client>/<name>``.
STATE_PREFIX = "state/"

#: A ``query.state`` message's ConfigRecord naming the clients to ask (``clients``).
STATE_CLIENTS = "state-clients"


def state_query(clients: list[int] | None) -> RecordDict:
    """The records of a ``query.state`` message besides its config: the clients to ask
    (None: all the server's)."""
    if clients is None:
        return RecordDict()
    return RecordDict({STATE_CLIENTS: ConfigRecord({"clients": [int(c) for c in clients]})})


def state_clients(content: RecordDict) -> list[int] | None:
    """The clients a ``query.state`` message asks for (None: all)."""
    if STATE_CLIENTS not in content.config_records:
        return None
    return [int(c) for c in content.config_records[STATE_CLIENTS]["clients"]]  # type: ignore[union-attr]


def state_content(states: ClientStates) -> RecordDict:
    """Clients' kept state as records (``query.state``'s reply, ``query.restore``'s
    message)."""
    return RecordDict({f"{STATE_PREFIX}{client}/{name}": ArrayRecord(dict(tensors))
                       for client, records in states.items()
                       for name, tensors in records.items()})


def states_of(content: RecordDict) -> ClientStates:
    """The clients' kept state in ``content`` (the records of :func:`state_content`)."""
    states: ClientStates = {}
    for key, record in content.array_records.items():
        if key.startswith(STATE_PREFIX):
            client, name = key[len(STATE_PREFIX):].split("/", 1)
            states.setdefault(int(client), {})[name] = dict(record.to_torch_state_dict())
    return states


def job_content(job: ServerJob, run_config: ConfigRecord) -> RecordDict:
    """The train message of ``job``."""
    config = run_config.copy()
    config["server-round"] = job.cloud_round
    config[EDGE_ID] = job.edge
    config[LEVEL] = job.level
    config[FIRST_ROUND] = job.first_round
    config[NUM_ROUNDS] = job.num_rounds
    arrays = {"edge-of-client": np.asarray(job.edge_of_client, dtype=np.int64),
              "num-examples": np.asarray(job.num_examples, dtype=np.int64),
              "edge-seconds": np.asarray(job.seconds, dtype=np.float64)}
    arrays.update({f"parents-{k}": np.asarray(p, dtype=np.int64)
                   for k, p in enumerate(job.parents, start=1)})
    if job.start_edge_of_client is not None:  # a carry handoff (fedhier.round.tiers.moves)
        arrays["start-edge-of-client"] = np.asarray(job.start_edge_of_client, dtype=np.int64)
    if len(job.carried_edges):
        arrays["carried-edges"] = np.asarray(job.carried_edges, dtype=np.int64)
    tree = model_record({k: torch.as_tensor(v) for k, v in arrays.items()}, packed=True)
    content = RecordDict({"arrays": model_record(job.params, packed=True), JOB_RECORD: tree,
                          "config": config})
    if len(job.carried_edges):
        content[CARRIED] = model_record(job.carried, packed=True)
    for key, record in state_content(job.states).items():  # moved clients' kept state
        content[key] = record
    return content


def job_from_message(msg: Message) -> ServerJob:
    config = msg.content["config"]
    tree = get_model(msg.content, JOB_RECORD, remember=False)
    parents = tuple(tree[f"parents-{k}"].numpy() for k in range(1, len(tree))
                    if f"parents-{k}" in tree)
    handoff: dict = {}
    if "start-edge-of-client" in tree:
        handoff["start_edge_of_client"] = tree["start-edge-of-client"].numpy()
    if "carried-edges" in tree:
        handoff.update(carried_edges=tree["carried-edges"].numpy(),
                       carried=get_model(msg.content, CARRIED))
    return ServerJob(edge=int(config[EDGE_ID]),  # type: ignore[arg-type]
                   cloud_round=int(config["server-round"]),  # type: ignore[arg-type]
                   params=get_model(msg.content, "arrays"),
                   edge_of_client=tree["edge-of-client"].numpy(),
                   num_examples=tree["num-examples"].numpy(),
                   seconds=tree["edge-seconds"].numpy(),
                   level=int(config.get(LEVEL, 1)),  # type: ignore[arg-type]
                   parents=parents,
                   first_round=int(config.get(FIRST_ROUND, 0)),  # type: ignore[arg-type]
                   num_rounds=int(config.get(NUM_ROUNDS, 0)),  # type: ignore[arg-type]
                   states=states_of(msg.content), **handoff)


def report_content(report: EdgeReport) -> RecordDict:
    """The reply to a job."""
    metrics = MetricRecord({
        EDGE_ID: report.edge, "loss-means": report.losses[:, 0].tolist(),
        "loss-weights": report.losses[:, 1].tolist(), "failed-clients": report.failed_clients,
        "failed-edges": report.failed_edges,
        "client-edge-messages": report.client_edge_messages,
        "client-edge-bytes": report.client_edge_bytes,
        "edge-cloud-messages": report.edge_cloud_messages,
        "edge-cloud-bytes": report.edge_cloud_bytes,
        "edge-seconds": np.asarray(report.seconds, dtype=np.float64).tolist(),
        "weight": float(report.weight)})
    for level, nodes in report.unreached.items():
        metrics[f"{UNREACHED}-{level}"] = [int(n) for n in nodes]
    content = RecordDict({"metrics": metrics})
    if report.model is not None:
        content["arrays"] = model_record(report.model, packed=True)
    if len(report.edges):
        metrics["edges"] = [int(e) for e in report.edges]
        content[EDGE_MODELS] = model_record(report.edge_models, packed=True)
    return content


class MalformedReplyError(ValueError):
    """A server's reply to its job that is not a report (a key missing, a value of the wrong
    type, models of another shape): its parent counts the job as lost."""


def report_from_reply(reply: Message, job: ServerJob) -> EdgeReport:
    """The :class:`EdgeReport` in a server's reply to ``job``, checked against the job: its
    models have the job model's names and shapes, a row of losses per edge round of the
    job, a clock per edge, and a segment's edges lie under the job's server.

    Raises:
        MalformedReplyError: the reply is not a well-formed report (one line: what is wrong).
    """
    try:
        report = _report(reply, job.edge)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise MalformedReplyError(f"{type(exc).__name__}: {exc}") from None
    num_edges = len(job.seconds)
    if job.num_rounds and len(report.losses) != job.num_rounds:
        raise MalformedReplyError(f"{len(report.losses)} rows of losses for a job of "
                                  f"{job.num_rounds} edge rounds")
    if num_edges and len(report.seconds) != num_edges:
        raise MalformedReplyError(f"{len(report.seconds)} edge clocks for {num_edges} edges")
    if len(report.edges):
        edges = report.edges
        if len(set(edges.tolist())) != len(edges) or edges.min() < 0 or (
                num_edges and edges.max() >= num_edges):
            raise MalformedReplyError(f"edges {edges.tolist()[:10]} repeat an edge or lie "
                                      f"outside 0..{num_edges - 1}")
        node = edges
        for parent in job.parents[:job.level - 1]:  # each edge's server at the job's level
            node = np.asarray(parent)[node]
        if (node != job.edge).any():
            raise MalformedReplyError(f"edges {edges.tolist()[:10]} are not all under "
                                      f"{job.edge}")
    if report.model is not None:
        _check_shapes("arrays", report.model, job.params, ())
    if report.edge_models:
        _check_shapes(EDGE_MODELS, report.edge_models, job.params, (len(report.edges),))
    return report


def _check_shapes(name: str, got: Params, like: Params, rows: tuple[int, ...]) -> None:
    if set(got) != set(like):
        raise MalformedReplyError(f"{name} has tensors {sorted(got)}, the model "
                                  f"{sorted(like)}")
    for key, value in got.items():
        want = (*rows, *like[key].shape)
        if tuple(value.shape) != want or not value.is_floating_point():
            raise MalformedReplyError(f"{name}[{key!r}] is {value.dtype} {tuple(value.shape)}, "
                                      f"not a float tensor of shape {want}")


def _report(reply: Message, edge: int) -> EdgeReport:
    m = reply.content["metrics"]
    losses = np.stack([np.asarray(m["loss-means"], dtype=np.float64),
                       np.asarray(m["loss-weights"], dtype=np.float64)], axis=1)
    model = get_model(reply.content, "arrays") if has_model(reply.content, "arrays") else None
    own: dict = {}
    if has_model(reply.content, EDGE_MODELS):
        if "edges" not in m:
            raise KeyError("edge-models without edges")
        own = dict(edges=np.asarray(m["edges"], dtype=np.int64),
                   edge_models=get_model(reply.content, EDGE_MODELS))
    return EdgeReport(edge=edge, model=model, losses=losses,
                      failed_clients=int(m["failed-clients"]),  # type: ignore[arg-type]
                      failed_edges=int(m["failed-edges"]),  # type: ignore[arg-type]
                      client_edge_messages=int(m["client-edge-messages"]),  # type: ignore[arg-type]
                      client_edge_bytes=int(m["client-edge-bytes"]),  # type: ignore[arg-type]
                      seconds=np.asarray(m["edge-seconds"], dtype=np.float64),
                      weight=float(m["weight"]),  # type: ignore[arg-type]
                      edge_cloud_messages=int(m["edge-cloud-messages"]),  # type: ignore[arg-type]
                      edge_cloud_bytes=int(m["edge-cloud-bytes"]),  # type: ignore[arg-type]
                      unreached={int(k[len(UNREACHED) + 1:]): [int(n) for n in v]  # type: ignore[union-attr]
                                 for k, v in m.items() if k.startswith(f"{UNREACHED}-")},
                      **own)

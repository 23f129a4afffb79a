"""The messages between fedhier's cloud and its edge servers (docs/deployment.md#edge-servers).

The cloud ServerApp reaches each edge server as one node of the cloud SuperLink; the edge
server reaches its clients through its own SuperLink under the client message contract
(docs/contract.md). Between the two tiers, one message per edge and task:

=====================  ==========================================================================
``query`` (profile)    reply ``metrics``: ``edge-id`` and, per client of the edge (lists in
                       the order of ``partition-ids``), ``num-examples``, ``label-histogram``
                       (flattened, ``num-classes`` per client)
``train``              an edge job: ``arrays`` (the global model), ArrayRecord ``edge-job``
                       (``edge-of-client`` and ``num-examples``, int64 [n]), ``config``: the run
                       configuration plus ``server-round``, ``edge-id``, ``edge-start-seconds``.
                       Reply: ``arrays`` (the edge's aggregate; absent when no client survived)
                       and ``metrics`` (see :func:`report_from_reply`)
``evaluate``           ``arrays`` (the global model); reply ``metrics``: per client ``loss``,
                       ``accuracy``, ``holdout-accuracy`` (NaN: none), ``num-examples``
``query.gradient``     ``arrays``; reply ArrayRecord ``gradient`` (``g``: [k, P] in
                       ``partition-ids`` order)
=====================  ==========================================================================
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedhier.edge_tier import EdgeJob, EdgeReport
from fedhier_clients.records import to_record, to_tensors

EDGE_ID = "edge-id"
PARTITION_IDS = "partition-ids"
JOB_RECORD = "edge-job"
START_SECONDS = "edge-start-seconds"
#: The config keys the cloud adds for an edge server (not the run configuration's).
EDGE_KEYS = (EDGE_ID, START_SECONDS)


def job_content(job: EdgeJob, run_config: ConfigRecord) -> RecordDict:
    """The train message of ``job``."""
    config = run_config.copy()
    config["server-round"] = job.cloud_round
    config[EDGE_ID] = job.edge
    config[START_SECONDS] = float(job.start_seconds)
    tree = ArrayRecord({"edge-of-client": torch.as_tensor(np.asarray(job.edge_of_client,
                                                                     dtype=np.int64)),
                        "num-examples": torch.as_tensor(np.asarray(job.num_examples,
                                                                   dtype=np.int64))})
    return RecordDict({"arrays": to_record(job.params), JOB_RECORD: tree, "config": config})


def job_from_message(msg: Message) -> EdgeJob:
    config = msg.content["config"]
    tree = cast(ArrayRecord, msg.content[JOB_RECORD]).to_torch_state_dict()
    return EdgeJob(edge=int(config[EDGE_ID]),  # type: ignore[arg-type]
                   cloud_round=int(config["server-round"]),  # type: ignore[arg-type]
                   params=to_tensors(cast(ArrayRecord, msg.content["arrays"])),
                   edge_of_client=tree["edge-of-client"].numpy(),
                   num_examples=tree["num-examples"].numpy(),
                   start_seconds=float(config[START_SECONDS]))  # type: ignore[arg-type]


def report_content(report: EdgeReport) -> RecordDict:
    """The reply to an edge job."""
    metrics = MetricRecord({
        EDGE_ID: report.edge, "loss-means": report.losses[:, 0].tolist(),
        "loss-weights": report.losses[:, 1].tolist(), "failed-clients": report.failed_clients,
        "failed-edges": report.failed_edges,
        "client-edge-messages": report.client_edge_messages,
        "client-edge-bytes": report.client_edge_bytes, "edge-seconds": report.seconds})
    content = RecordDict({"metrics": metrics})
    if report.model is not None:
        content["arrays"] = to_record(report.model)
    return content


def report_from_reply(reply: Message, edge: int) -> EdgeReport:
    """The :class:`EdgeReport` in an edge server's reply to its job."""
    m = reply.content["metrics"]
    losses = np.stack([np.asarray(m["loss-means"], dtype=np.float64),
                       np.asarray(m["loss-weights"], dtype=np.float64)], axis=1)
    model = (to_tensors(cast(ArrayRecord, reply.content["arrays"]))
             if "arrays" in reply.content.array_records else None)
    return EdgeReport(edge=edge, model=model, losses=losses,
                      failed_clients=int(m["failed-clients"]),  # type: ignore[arg-type]
                      failed_edges=int(m["failed-edges"]),  # type: ignore[arg-type]
                      client_edge_messages=int(m["client-edge-messages"]),  # type: ignore[arg-type]
                      client_edge_bytes=int(m["client-edge-bytes"]),  # type: ignore[arg-type]
                      seconds=float(m["edge-seconds"]))  # type: ignore[arg-type]

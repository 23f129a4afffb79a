"""One server (an edge, a region, ...) as one long-lived process, built from Flower's own
runtime clients.

``python -m fedhier.engines.deployment.edge_process --edge E --clients 0,1,2 ...`` (started by
``fedhier deploy local --edges``; ``--level 2 --children 0,1`` for a region over edges 0 and 1;
docs/deployment.md#edge-servers has the diagram). The server has two faces, both Flower's:

* **toward its children** (an edge's clients, a region's edges) it is the ServerApp of its
  own SuperLink. That SuperLink runs with ``--isolation process``: this process submits one
  run to it (``flwr run``, so that the children's SuperNodes get the app), claims that run's
  ServerApp task itself (``AcquireTask``, authenticated with the SuperExec secret) and keeps
  one :class:`flwr.superlink.grid.HttpGrid` with heartbeats for the whole federation;
* **toward its parent** (the cloud, or a region) it is the ClientApp runtime of a SuperNode
  attached to the parent's SuperLink (also ``--isolation process``): it claims each task the
  parent sends that SuperNode, answers it with
  :class:`~fedhier.strategies.edge.server.EdgeServer` over the grid, and pushes the reply, as
  Flower's ``flwr-clientapp`` does for one message.

Flower's ``Message()`` reads the run, node and task ids from the process-global
``TaskIdentity``, so the process switches identity between the two faces and handles one
message at a time. It runs until stopped (SIGTERM/SIGINT: exit 0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.common.serde import run_from_proto
from flwr.proto.runtime_pb2 import PullTaskInputRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.grid import HttpGrid

from fedhier.engines.deployment.task_runtime import (
    acquire,
    exit_on_sigterm,
    runtime_client,
    serve_tasks,
)
from fedhier.engines.prompt_grid import PromptGrid
from fedhier.round.tiers.jobs import server_name
from fedhier.strategies.edge.cloud_executor import STARTUP_SECONDS
from fedhier.strategies.edge.server import EdgeServer


class Identity:
    """A snapshot of Flower's process-global task identity, to switch back to."""

    def __init__(self) -> None:
        self.task_id = TaskIdentity.task_id
        self.run_id = TaskIdentity.run_id
        self.node_id = TaskIdentity.node_id

    def activate(self) -> None:
        TaskIdentity.task_id = self.task_id
        TaskIdentity.run_id = self.run_id
        TaskIdentity.node_id = self.node_id


def connect_to_clients(args: argparse.Namespace, ca: bytes | None,
                       secret: bytes | None) -> tuple[HttpGrid, HeartbeatSender]:
    """Submit this edge's run to its SuperLink and claim the run's ServerApp task."""
    extra = ["--run-config", str(args.run_config)] if args.run_config else []
    # a start, not a job: as long as the parent lets its servers start (a short
    # --round-timeout must not fail a start on a busy machine and use up a restart)
    run = subprocess.run(["flwr", "run", str(args.app), args.connection, *extra],
                         capture_output=True, text=True,
                         timeout=max(args.timeout, STARTUP_SECONDS), stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        raise RuntimeError(f"flwr run on the edge SuperLink failed: "
                           f"{(run.stdout + run.stderr).strip()[-500:]}")
    link = runtime_client(args.edge_superlink, ca, "SuperExec", secret)
    _, token = acquire(link, TaskType.SERVER_APP)
    grid = HttpGrid(runtime_api_address=args.edge_superlink, insecure=ca is None,
                    root_certificates=ca, token=token)
    res = grid._runtime_client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    grid.set_run(run_from_proto(res.run))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(grid._runtime_client))
    heartbeat.start()
    return grid, heartbeat


def edge_answer(server: EdgeServer, edge_identity: Identity,
                ) -> Callable[[Message, Context], Message]:
    """The parent's message answered with the server's children (under the identity of the
    server's own run)."""

    def answer(msg: Message, context: Context) -> Message:
        cloud_identity = Identity()
        edge_identity.activate()  # Message() reads TaskIdentity: the edge's run
        try:
            content = server.handle(msg)
        finally:
            cloud_identity.activate()
        return Message(content, reply_to=msg)

    return answer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhier.engines.deployment.edge_process",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--edge", type=int, required=True,
                        help="this server's index among its level's nodes")
    parser.add_argument("--level", type=int, default=1,
                        help="its level: 1 an edge (default), 2 a region, ...")
    parser.add_argument("--clients", required=True,
                        help="the partition ids of the clients under it, comma-separated")
    parser.add_argument("--children", default="",
                        help="above the edges: its child servers' indices, comma-separated")
    parser.add_argument("--edge-superlink", required=True, metavar="HOST:PORT",
                        help="this server's SuperLink (its children connect to it)")
    parser.add_argument("--cloud-node", required=True, metavar="HOST:PORT",
                        help="runtime API of this server's SuperNode on its parent's "
                        "SuperLink (the cloud's, or a region's)")
    parser.add_argument("--app", type=Path, required=True, help="the Flower app (FAB source)")
    parser.add_argument("--run-config", type=Path, metavar="FILE.toml",
                        help="--run-config of the edge's flwr run (the clients read the run's "
                        "configuration from each message; default: the app's)")
    parser.add_argument("--connection", required=True,
                        help="the edge SuperLink's connection name in $FLWR_HOME/config.toml")
    parser.add_argument("--root-certificates", type=Path, help="CA of the edge SuperLink "
                        "(TLS); without it the connection is insecure")
    parser.add_argument("--superexec-secret", type=Path,
                        help="the SuperExec authentication secret of the edge SuperLink and "
                        "SuperNode")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds to wait for the clients' replies")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads for aggregating (default 1: the "
                        "models are small next to a thread's start; docs/deployment.md#latency)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, args.torch_threads))
    exit_on_sigterm()
    ca = args.root_certificates.read_bytes() if args.root_certificates else None
    secret = args.superexec_secret.read_bytes() if args.superexec_secret else None
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    children = [int(c) for c in args.children.split(",") if c.strip()]
    name = f"{server_name(args.level)} {args.edge}"
    try:
        grid, heartbeat = connect_to_clients(args, ca, secret)
        print(f"{name}: ServerApp task of its SuperLink claimed (pid {os.getpid()}); waiting "
              f"for {f'children {children} serving ' if children else ''}clients {clients}",
              flush=True)
        server = EdgeServer(args.edge, PromptGrid(grid), clients, timeout=args.timeout,
                            level=args.level, children=children)
        serve_tasks(args.cloud_node, secret, edge_answer(server, Identity()), name)
    except (KeyboardInterrupt, SystemExit):
        return 0
    except Exception as exc:  # noqa: BLE001 - one line for the deploy log
        print(f"{name}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if "heartbeat" in locals():
            heartbeat.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

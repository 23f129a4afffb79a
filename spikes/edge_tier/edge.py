"""Edge aggregator process built only from Flower 1.42 Runtime-API clients.

Role A (edge tier, "ServerApp process"): the edge SuperLink runs with --isolation process, so
no SuperExec claims its ServerApp task. This process submits ONE run there (flwr run, once),
claims the task itself (AcquireTask -> token), and keeps a long-lived HttpGrid with that token.

Role B (cloud tier, "ClientApp process"): the edge's SuperNode of the cloud SuperLink runs with
--isolation process; this process claims each flwr-clientapp task on that SuperNode's Runtime
API, pulls the cloud's train message, runs edge-rounds rounds over the HttpGrid, and pushes the
reply -- exactly the calls flwr-clientapp makes, but from one long-lived process.
"""
import argparse, os, subprocess, sys, time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullTaskInputRequest
from flwr.common.serde import run_from_proto
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.grid import HttpGrid
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output


def log(*a):
    print(f"[edge {time.strftime('%H:%M:%S')}]", *a, flush=True)


SECRET = None


def client(addr, insecure, ca, component, token=None, secret=True):
    ics = [RuntimeVersionHttpInterceptor(component_name=component)]
    if SECRET and secret and not token:  # HMAC on AcquireTask, as flower-superexec does
        from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor
        ics.append(SuperExecAuthHttpInterceptor(master_secret=SECRET,
                   protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    if token:
        ics.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=addr, insecure=insecure, root_certificates=ca, interceptors=ics,
        retry_invoker=make_simple_http_retry_invoker())


def acquire(c, ttype, poll=0.2):
    while True:
        res = c.AcquireTask(AcquireTaskRequest(supported_task_types=[ttype]))
        if res.HasField("task") and res.token:
            return res.task, res.token
        time.sleep(poll)


class Identity:
    def __init__(self):
        self.t, self.r, self.n = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id

    def activate(self):
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = self.t, self.r, self.n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--edge-link", required=True)        # edge SuperLink host:port (Runtime API)
    p.add_argument("--cloud-node", required=True)       # edge's cloud-side SuperNode Runtime API
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--app", required=True)
    p.add_argument("--connection", default="edge")      # name in $FLWR_HOME/config.toml
    p.add_argument("--ca", default=None)                # CA file for the edge SuperLink (TLS)
    p.add_argument("--max-cloud-rounds", type=int, default=10**9)
    p.add_argument("--superexec-secret", default=None)  # same file as the SuperLink/SuperNode
    a = p.parse_args()
    global SECRET
    SECRET = Path(a.superexec_secret).read_bytes() if a.superexec_secret else None
    insecure = a.ca is None
    ca = Path(a.ca).read_bytes() if a.ca else None

    # --- Role A: one run on the edge SuperLink, claimed by us -------------------------------
    t0 = time.time()
    out = subprocess.run(["flwr", "run", a.app, a.connection], capture_output=True, text=True)
    log("flwr run (once) rc", out.returncode, out.stdout.strip().splitlines()[-1:] , out.stderr[-300:])
    if SECRET:  # negative check: AcquireTask without the secret must be refused
        try:
            r = client(a.edge_link, insecure, ca, "SuperExec", secret=False).AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.SERVER_APP]))
            log("AcquireTask WITHOUT secret answered:", r.HasField("task"))
        except BaseException as e:  # Flower's HTTP retry gives up by SIGINT-ing its own process
            log("AcquireTask WITHOUT secret refused:", type(e).__name__, str(e)[:160])
    link = client(a.edge_link, insecure, ca, "SuperExec")
    task, token = acquire(link, TaskType.SERVER_APP)
    log(f"claimed edge ServerApp task {task.task_id} run {task.run_id} after {time.time()-t0:.1f}s")
    grid = HttpGrid(runtime_api_address=a.edge_link, insecure=insecure, root_certificates=ca,
                    token=token)
    res = grid._runtime_client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    grid.set_run(run_from_proto(res.run))
    edge_id = Identity()
    hb = HeartbeatSender(make_task_heartbeat_fn_http(grid._runtime_client)); hb.start()
    while len(nodes := sorted(grid.get_node_ids())) < a.clients:
        time.sleep(0.5)
    log("edge clients", nodes)

    # --- Role B: serve cloud train messages arriving at our cloud-side SuperNode --------------
    node = client(a.cloud_node, True, None, "SuperExec")
    for k in range(a.max_cloud_rounds):
        task, tok = acquire(node, TaskType.CLIENT_APP)
        c = client(a.cloud_node, True, None, "flwr-clientapp", tok)
        chb = HeartbeatSender(make_task_heartbeat_fn_http(c)); chb.start()
        msg, ctx, run, fab = pull_task_input(c)          # sets TaskIdentity to the cloud task
        cloud_id = Identity()
        t1 = time.time()
        cfg = msg.content["config"]
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        edge_id.activate()                                # Message() reads TaskIdentity
        for r in range(int(cfg["edge-rounds"])):
            msgs = [Message(RecordDict({"arrays": ArrayRecord([w]),
                                        "config": ConfigRecord({"lr": cfg["lr"]})}),
                            dst_node_id=n, message_type="train") for n in nodes]
            replies = list(grid.send_and_receive(msgs, timeout=300))
            ok = [m for m in replies if not m.has_error()]
            assert len(ok) == len(nodes), [m.error for m in replies if m.has_error()]
            ns = [m.content["metrics"]["num-examples"] for m in ok]
            w = sum(n * m.content["arrays"].to_numpy_ndarrays()[0] for n, m in zip(ns, ok)) / sum(ns)
            log(f"cloud round {k+1} edge round {r+1}: w0={w[0]:.6f}")
        cloud_id.activate()
        reply = Message(RecordDict({"arrays": ArrayRecord([w]),
                                    "metrics": MetricRecord({"num-examples": int(sum(ns))})}),
                        reply_to=msg)
        push_message(c, reply, ctx)
        push_task_output(c, ctx, SubStatus.COMPLETED, "")
        chb.stop(); c.close()
        log(f"replied to cloud round {k+1} in {time.time()-t1:.1f}s")


if __name__ == "__main__":
    main()

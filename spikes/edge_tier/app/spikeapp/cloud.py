"""Cloud ServerApp: every cloud round, send w to each edge SuperNode, weighted average."""
import json, time
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    E = int(cfg["num-edges"])
    while len(nodes := list(grid.get_node_ids())) < E:
        time.sleep(1)
    w = np.zeros(int(cfg["dim"]), dtype=np.float64)
    log = []
    for r in range(int(cfg["cloud-rounds"])):
        t0 = time.time()
        msgs = [Message(RecordDict({"arrays": ArrayRecord([w]),
                                    "config": ConfigRecord({"lr": float(cfg["lr"]),
                                                            "edge-rounds": int(cfg["edge-rounds"])})}),
                        dst_node_id=n, message_type="train") for n in nodes]
        replies = list(grid.send_and_receive(msgs, timeout=600))
        ok = [m for m in replies if not m.has_error()]
        assert len(ok) == E, [m.error for m in replies if m.has_error()]
        ns = [m.content["metrics"]["num-examples"] for m in ok]
        ws = [m.content["arrays"].to_numpy_ndarrays()[0] for m in ok]
        w = sum(n * x for n, x in zip(ns, ws)) / sum(ns)
        log.append({"round": r + 1, "w0": float(w[0]), "secs": time.time() - t0})
        print("CLOUD ROUND", log[-1], flush=True)
    if cfg["out"]:
        with open(str(cfg["out"]), "w") as f:
            json.dump({"w0": float(w[0]), "rounds": log}, f)

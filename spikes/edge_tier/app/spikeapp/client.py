"""Client tier: one local step of w <- w - lr*(w - target), target = partition-id + 1."""
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    lr = float(msg.content["config"]["lr"])
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    w = w - lr * (w - (pid + 1.0))
    return Message(RecordDict({"arrays": ArrayRecord([w]),
                               "metrics": MetricRecord({"num-examples": 10 * (pid + 1)})}),
                   reply_to=msg)

"""sklearnhier: a scikit-learn ClientApp under HierFedAvg.

``local-steps`` (the server's, per train message) is the number of lbfgs iterations this
client runs from the model it is sent: ``max_iter`` of a warm-started ``LogisticRegression``
(docs/contract.md, "Clients that do not train by mini-batch SGD").
"""

from __future__ import annotations

import numpy as np
from fedhier.clients.adapter import register_profile
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.metrics import accuracy_score, f1_score, log_loss

from sklearnhier.task import NUM_CLASSES, fit, get_params, load_data, new_model, set_params

app = ClientApp()
# (X_train, y_train, X_test, y_test) as it is: the profile counts the training rows
register_profile(app, load_data, num_classes=NUM_CLASSES)


def _data(context: Context):
    return load_data(int(context.node_config["partition-id"]),
                     int(context.node_config["num-partitions"]),
                     int(context.run_config.get("seed", 0)))


@app.train()
def train(msg: Message, context: Context) -> Message:
    x_train, y_train, _, _ = _data(context)
    config = msg.content["config"]
    model = new_model(float(config.get("regularization-c", 1.0)), int(config["local-steps"]))
    set_params(model, msg.content["arrays"].to_numpy_ndarrays())
    fit(model, x_train, y_train)
    metrics = {"num-examples": len(y_train),
               "train_logloss": float(log_loss(y_train, model.predict_proba(x_train),
                                               labels=np.arange(NUM_CLASSES)))}
    return Message(RecordDict({"arrays": ArrayRecord(get_params(model)),
                               "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, x_test, y_test = _data(context)
    model = set_params(new_model(), msg.content["arrays"].to_numpy_ndarrays())
    predicted = model.predict(x_test)
    metrics = {"num-examples": len(y_test),
               "test_logloss": float(log_loss(y_test, model.predict_proba(x_test),
                                              labels=np.arange(NUM_CLASSES))),
               "accuracy": float(accuracy_score(y_test, predicted)),
               "f1": float(f1_score(y_test, predicted, average="macro"))}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

"""The message contract's keys, shared by the server side (HierFedAvg) and the client side
(fedhier's ClientApp, and the adapter for a Flower user's own app). docs/contract.md
describes each; :mod:`fedhier.strategies.replies` reads replies by it.
"""

#: Keys HierFedAvg adds to the run's ConfigRecord in each train message (all int).
LOCAL_STEPS = "local-steps"  # SGD steps to run from the received model (I, fewer: straggler)
START_STEP = "start-step"  # global 0-based index of the first of them, (edge-round - 1) * I
EDGE_ROUND = "edge-round"  # 1-based index of the edge round over the whole run
SERVER_ROUND = "server-round"  # 1-based cloud round (also in evaluate messages; 0 = initial)
#: Every key the server adds per message (a client's run configuration is the rest).
ROUND_KEYS = (LOCAL_STEPS, START_STEP, EDGE_ROUND, SERVER_ROUND)

#: Reply keys (MetricRecord "metrics").
NUM_EXAMPLES = "num-examples"  # int > 0, required in train replies
TRAIN_LOSS_KEYS = ("train-loss", "train_loss")  # float, optional; either spelling
LOSS_KEYS = ("loss", "eval_loss")  # evaluate replies (Flower's quickstart: eval_*)
ACCURACY_KEYS = ("accuracy", "eval_acc")

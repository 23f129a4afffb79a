"""One run of a workload in this process: the hand-written plain loop, or a fedhier engine."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

from .measure import Marks


def plain_loop(cfg: Any, marks: Marks) -> float:
    """(a) A hand-written PyTorch H-SGD loop over clients; returns the final test accuracy."""
    import numpy as np
    import torch
    import torch.nn.functional as F  # noqa: N812 - the usual alias

    from fedhier.local.train import batch_indices
    from fedhier.round.aggregators.averaging import client_weights
    from fedhier.runs.prepare import initial_model, prepare
    from fedhier.tree.grouping import ClientInfo
    from fedhier.tree.hierarchy import build_hierarchy

    fed = prepare(cfg)
    cpu = torch.device("cpu")
    data = [fed.client_tensors(j, cpu) for j in range(cfg.clients)]
    x_test, y_test = fed.test_tensors(cpu)
    hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping,
                                ClientInfo(fed.label_histograms, fed.client_sizes()), cfg.seed)
    edge_of = hierarchy.edge_of_client()
    weights = client_weights(cfg.weighting, fed.client_sizes())
    model = initial_model(cfg, fed)

    def evaluate(cloud_round: int) -> float:
        with torch.no_grad():
            losses, accs = [], []
            for x, y in data:
                logits = model(x)
                losses.append(float(F.cross_entropy(logits, y)))
                accs.append(float((logits.argmax(1) == y).float().mean()))
            _ = float(np.dot(weights, losses) / weights.sum())  # train loss, as the engines do
            logits = model(x_test)
            _ = float(F.cross_entropy(logits, y_test))
            accuracy = float((logits.argmax(1) == y_test).float().mean())
        marks.mark(cloud_round)
        return accuracy

    accuracy = evaluate(0)
    edge_rounds = cfg.global_period // cfg.local_period
    for cloud_round in range(1, cfg.rounds + 1):
        edge_models = [copy.deepcopy(model) for _ in range(hierarchy.num_nodes(1))]
        for k in range(edge_rounds):
            start = ((cloud_round - 1) * edge_rounds + k) * cfg.local_period
            states = []
            for j, (x, y) in enumerate(data):
                local = copy.deepcopy(edge_models[edge_of[j]])
                opt = torch.optim.SGD(local.parameters(), lr=cfg.lr)
                for rows in batch_indices(cfg.seed, j, len(y), cfg.batch_size, start,
                                          cfg.local_period):
                    opt.zero_grad()
                    loss = F.cross_entropy(local(x[rows]), y[rows])
                    loss.backward()
                    opt.step()
                states.append(local.state_dict())
            level = hierarchy.level_after(start + cfg.local_period - 1)
            owner = hierarchy.ancestors(level)
            edge_owner = hierarchy.edges_under(level)
            for node in range(hierarchy.num_nodes(level)):
                members = np.flatnonzero(owner == node)
                total = weights[members].sum()
                average = {key: sum(weights[j] * states[j][key] for j in members) / total
                           for key in states[0]}
                for edge in np.flatnonzero(edge_owner == node):
                    edge_models[edge].load_state_dict(average)
        model.load_state_dict(edge_models[0].state_dict())  # the cloud average
        accuracy = evaluate(cloud_round)
    return accuracy


def run_summary(name: str, cfg: Any, federation: Any = None) -> dict[str, Any]:
    """Run fedhier engine ``name`` (its registered runner) on ``cfg`` in a temporary run
    folder; returns the run's summary (``federation``: the data instead of ``prepare(cfg)``,
    for the engines that take one: vectorized, vectorized-ray)."""
    from fedhier.engines.registry import get_engine
    from fedhier.runs.folder import RunFolder

    data = {} if federation is None else {"federation": federation}
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        folder = RunFolder.create(Path(tmp) / "run")
        return dict(get_engine(name).load()(cfg.replace(engine=name), folder, progress=False,
                                            **data))


def run_engine(name: str, cfg: Any, marks: Marks, federation: Any = None) -> float:
    """Run fedhier engine ``name`` (:func:`run_summary`); returns the final test accuracy.
    ``marks`` receives the cloud-round records once :func:`instrument_recorder` is in place."""
    return float(run_summary(name, cfg, federation)["final_test_accuracy"])

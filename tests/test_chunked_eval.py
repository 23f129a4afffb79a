"""The global model's per-client metrics formed a run of clients at a time
(fedhier/engines/vectorized/chunked_eval.py) equal, bit for bit, the all-at-once computation the
batched engines used before (every client's rows concatenated, one np.unique, one np.bincount)."""

import numpy as np
import torch
from torch import nn

from fedhier.engines.vectorized.chunked_eval import EVAL_CHUNK, client_metrics, distinct_rows
from fedhier.engines.vectorized.kernels import ClientRows
from fedhier.local.train import params_of
from fedhier.runs.prepare import initial_model, prepare
from fedhier.settings.run_config import RunConfig


def all_at_once(model, params, data):
    """The former ``BatchedExecutor.client_metrics``, verbatim in substance."""
    used, member = np.unique(np.concatenate(data.rows), return_inverse=True)
    used_t = torch.as_tensor(used)
    row_loss, row_correct = [], []
    with torch.no_grad():
        for lo in range(0, len(used), EVAL_CHUNK):
            index = used_t[lo:lo + EVAL_CHUNK]
            logits = torch.func.functional_call(model, dict(params), (data.x[index],))
            target = data.y[index]
            row_loss.append(nn.functional.cross_entropy(logits, target, reduction="none"))
            row_correct.append(logits.argmax(1) == target)
    loss = torch.cat(row_loss).to(torch.float64).numpy()[member]
    correct = torch.cat(row_correct).numpy()[member]
    client = np.repeat(np.arange(len(data.rows)), [len(r) for r in data.rows])
    sizes = np.bincount(client, minlength=len(data.rows))
    return (np.bincount(client, weights=loss, minlength=len(data.rows)) / sizes,
            np.bincount(client, weights=correct, minlength=len(data.rows)) / sizes)


def test_runs_of_clients_give_the_all_at_once_metrics_bit_for_bit():
    cfg = RunConfig(dataset="digits", clients=40, groups=(4,), seed=3)
    fed = prepare(cfg)
    torch.manual_seed(0)
    model = initial_model(cfg, fed)
    params = {k: v + 0.05 * torch.randn_like(v) for k, v in params_of(model).items()}
    data = ClientRows.build(fed, 16, torch.device("cpu"))
    # clients sharing rows (replicated, reversed), so distinct rows span several runs
    rows = data.rows + [r[::-1].copy() for r in data.rows[:7]]
    data.rows = rows
    expected = all_at_once(model, params, data)
    assert len(distinct_rows(rows, 3)) == len(np.unique(np.concatenate(rows)))
    for per_run in (1, 3, 16, 10**6):
        loss, accuracy = client_metrics(model, params, data.x, data.y, rows, per_run)
        np.testing.assert_array_equal(loss, expected[0])
        np.testing.assert_array_equal(accuracy, expected[1])
    assert 0 < expected[1].mean() < 1

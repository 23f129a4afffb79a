"""``--device cuda`` on the vectorized and inprocess engines: the same run as on the CPU.

Skipped without a CUDA device. A cuda run differs from the cpu run only by float32 rounding
(different kernels), so metrics and the final model are compared within 1e-4 (relative for
metrics), as the engines are compared with each other in tests/test_vectorized.py.
"""

import pytest
import torch

from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.test_vectorized import TOL, assert_same_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BASE = RunConfig(dataset="digits", clients=8, groups=(2,), local_period=2, global_period=4,
                 rounds=2, batch_size=8, seed=11)
CASES = {
    "mlp": BASE,
    # unequal client sizes (padded batches) and per-client momentum kept on the device
    "mlp-unequal-momentum-kept": BASE.replace(clients=10, alpha=0.3, seed=3, batch_size=100,
                                              momentum=0.5, optimizer_state="keep"),
    "cnn-chunked": BASE.replace(model="cnn", rounds=1, client_chunk=3),
    "stragglers-faults": BASE.replace(local_period=4, global_period=8, straggler_fraction=0.5,
                                      fail_rate=0.3, rounds=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vectorized_cuda_equals_cpu(case, tmp_path):
    cfg = CASES[case].replace(engine="vectorized")
    run_vectorized(cfg, RunFolder.create(tmp_path / "cpu"), progress=False)
    run_vectorized(cfg.replace(device="cuda"), RunFolder.create(tmp_path / "cuda"),
                   progress=False)
    assert_same_runs(tmp_path / "cpu", tmp_path / "cuda", TOL)


@pytest.mark.parametrize("case", ["mlp", "cnn-chunked"])
def test_inprocess_cuda_equals_cpu(case, tmp_path):
    cfg = CASES[case]
    run_inprocess(cfg, RunFolder.create(tmp_path / "cpu"), progress=False)
    run_inprocess(cfg.replace(device="cuda"), RunFolder.create(tmp_path / "cuda"),
                  progress=False)
    assert_same_runs(tmp_path / "cpu", tmp_path / "cuda", TOL)


def test_vectorized_cuda_keeps_its_tensors_on_the_device():
    """Every [n, ...] tensor of the executor lives on the GPU (a stray CPU tensor would make
    the run fail or copy on every step)."""
    from fedhier.engines.vectorized.engine import BatchedExecutor
    from fedhier.runs.prepare import initial_model, prepare

    cfg = BASE.replace(engine="vectorized", device="cuda", momentum=0.5,
                       optimizer_state="keep")
    fed = prepare(cfg)
    device = torch.device("cuda", torch.cuda.current_device())
    executor = BatchedExecutor.build(cfg, fed, initial_model(cfg, fed).to(device), device)
    data = executor.data
    for tensor in (data.x, data.y, data.weight, executor.minibatch_rows(1)):
        assert tensor.device.type == "cuda"

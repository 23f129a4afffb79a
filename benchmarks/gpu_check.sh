#!/usr/bin/env bash
# The GPU check of the batched engine (docs/engines.md, "Accelerators"): W1, W2' and the
# million-client case with --device cuda against the cpu, then their table into
# docs/engines.md (benchmarks/gpu_table.py). Without a CUDA device it stops at once with one
# line and exit code 2. Runs from the repository root with the Python that holds a CUDA
# torch; flwr, flwr-datasets and the packages they import that the machine lacks may come as
# wheels in .whl/ (`pip download --no-deps --only-binary=:all: ...` of the versions in
# .venv). Writes logs and JSON results under ${OUT:-benchmarks/results/gpu}.
set -u
OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here ($PY: torch.cuda.is_available() is not true); nothing measured" >&2
  exit 2
fi
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L; nproc
"$PY" -c "import torch, flwr, flwr_datasets; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
# 1. equality: cuda against cpu on both engines
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
# 2. W1 (100 clients, --quick: 3 cloud rounds, one thread): plain loop and vectorized
for device in cpu cuda; do
  timeout 120 "$PY" benchmarks/engines.py --quick --engines plain,vectorized --skip-scaling \
    --device $device --out "$OUT/w1_$device.json" 2>&1 | tail -6
done
# 3. W2' (LeNet-5 on Fashion-MNIST, 50 clients), one cloud round, one pass
for device in cpu cuda; do
  timeout 240 "$PY" benchmarks/engines.py --workload w2p --rounds 1 --repeats 1 \
    --device $device --out "$OUT/w2p_$device.json" 2>&1 | tail -9
done
# 4. the million-client case: W1 replicated to 1,000,000 clients, G = 5 (one edge round)
for device in cuda cpu; do
  timeout 240 "$PY" benchmarks/engines.py --scale 1000000 --rounds 1 --global-period 5 \
    --device $device --out "$OUT/scale_1m_$device.json" 2>&1 | tail -3
done
"$PY" benchmarks/gpu_table.py "$OUT" --docs docs/engines.md

#!/usr/bin/env bash
# The GPU check of the vectorized engine, as run on a lent NVIDIA H200 (docs/engines.md,
# "Accelerators"). Runs from the repository root with the Python that holds a CUDA torch;
# flwr, flwr-datasets and the packages they import that the machine lacks come as wheels in
# .whl/ (`pip download --no-deps --only-binary=:all: --python-version 3.12 ...` of the
# versions in .venv: flwr, flwr-datasets, datasets, dill, multiprocess, pycryptodome,
# iterators, grpcio(-health-checking), protobuf, cryptography, cffi, fastapi, starlette,
# pydantic(-core), sqlalchemy, alembic, mako, ...).
# Writes logs and JSON results under ${OUT:-benchmarks/results/gpu}.
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L; nproc
python3 -c "import torch, flwr, flwr_datasets; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
# 1. equality: cuda against cpu on both engines
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
# 2. W1 (100 clients, --quick: 3 cloud rounds, one thread): plain loop and vectorized on the cpu,
#    then vectorized on cuda
for device in cpu cuda; do
  timeout 90 python3 benchmarks/engines.py --quick --engines plain,vectorized --skip-scaling \
    --device $device --out "$OUT/w1_$device.json" 2>&1 | tail -12
done
# 3. at scale: W1 replicated, vectorized (run separately: --scale 1000,10000,100000, with and
#    without --device cuda; 100,000 clients take ~2.5 minutes on one cpu thread)

#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) with a Python whose torch sees the GPU: the checkout's .venv when
# it has a CUDA build (TORCH_SPEC=<a CUDA build> scripts/setup), else the machine's python3 (a lent GPU
# machine's holds one), else the .venv anyway, which then reports that there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda() { "$1" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
if [ -x .venv/bin/python ] && cuda .venv/bin/python; then PYTHON=.venv/bin/python
elif cuda python3; then PYTHON=python3
else PYTHON=.venv/bin/python
fi
exec "$PYTHON" -m benchmarks.gpu_check "$@"

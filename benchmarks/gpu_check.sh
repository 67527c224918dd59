#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) with the machine's own python3, which holds the CUDA build of
# torch on a lent GPU machine (elsewhere: TORCH_SPEC=<a CUDA build> scripts/setup, then .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && "$(dirname "$0")/../.venv/bin/python" -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null && PYTHON=.venv/bin/python
exec "$PYTHON" -m benchmarks.gpu_check "$@"

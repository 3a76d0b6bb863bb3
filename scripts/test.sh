#!/usr/bin/env bash
# Set up (if needed) and run the test suite (CPU; CUDA kernels run under the Numba simulator).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NUMBA_ENABLE_CUDASIM=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/python -m pytest -q "$@"

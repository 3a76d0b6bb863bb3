#!/usr/bin/env bash
# One H200 call (session 15): the training step's kernels (bench/gpu_train_kernels.py) and then the
# steps of bench/gpu_session11.sh (STEPS, default "flow"). Outputs under $OUT.
#   LIMIT=560 STEPS="flow" RUNS=4 bash bench/gpu_session15.sh
set -u
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${TRAIN:-1}" = 1 ]; then
  echo "== training step, kernel by kernel: bench/gpu_train_kernels.py ($(el))"
  VARIANTS="${TRAIN_VARIANTS:-default}" timeout ${TRAIN_LIMIT:-200} python3 bench/gpu_train_kernels.py 2>&1 | grep -v -i warn | tail -${TRAIN_LINES:-75}
fi
echo "== gpu_session11.sh ($(el))"
BUDGET=$(( ${LIMIT:-560} - ($(date +%s) - t0) )) STEPS="${STEPS:-flow}" bash bench/gpu_session11.sh
echo "== done ($(el))"

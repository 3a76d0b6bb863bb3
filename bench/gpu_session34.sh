#!/usr/bin/env bash
# One GPU call: why session 34's first call saw the transposed sums' run 1 train to other losses than the
# butterflies' (from epoch 2; its kept runs 2-3 were the butterflies' to the bit), and the flow with them.
#   1. "tests": tests/test_train_kernel.py on the GPU (output kept in $OUT/tests.txt): the transposed sums'
#      gradients bit for bit the butterflies' on the flow's shapes (test_flow_shapes_on_the_gpu);
#   2. "kbench": bench/gpu_train_step_kernel.py, VARIANTS "kernel-transposed kernel" (the order of the first call
#      swapped: a fresh capture that is not the process's first), RUNS 3, losses compared run by run;
#   3. "flow": the flow on a standing cluster with BEATFLOW_STEP_SUMS=transposed, RUNS runs (default 5).
#   LIMIT=420 bash bench/gpu_session34.sh   (carry .whl)
DEFAULT_STEPS="tests kbench flow"
source "$(dirname "$0")/gpu_common.sh"
if want tests && [ "$(left)" -gt 200 ]; then
  echo "== GPU tests: tests/test_train_kernel.py ($(el))"
  timeout $(( $(left) - 170 )) python3 -m pytest -q -rs --tb=short -p no:cacheprovider -p no:warnings \
    tests/test_train_kernel.py > "$OUT/tests.txt" 2>&1
  tail -12 "$OUT/tests.txt"
fi
if want kbench && [ "$(left)" -gt 150 ]; then
  echo "== the epoch graph: transposed sums first, then a butterfly each ($(el))"
  VARIANTS="kernel-transposed kernel" RUNS=3 PROFILE=0 timeout $(( $(left) - 100 )) \
    python3 bench/gpu_train_step_kernel.py 2>&1 | grep "^| \|^rows\|agree\|DIFFER\|identical"
fi
if want flow && [ "$(left)" -gt 90 ]; then
  echo "== the flow with the transposed sums, RUNS=${RUNS:-5} ($(el))"
  rm -rf /tmp/bf-persistent-gpu-*
  BEATFLOW_STEP_SUMS=transposed TAG=-transposed PYSPY="" RUNS=${RUNS:-5} RUN_LIMIT=${RUN_LIMIT:-240} \
    timeout $(( $(left) - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 | grep "^| \|^run [0-9]" | cut -c1-260
fi
echo "== done ($(el))"

#!/usr/bin/env bash
# One GPU call: the step kernel's weight-gradient sums 32 at a time (a transposed butterfly, warp_sums' tsum;
# BEATFLOW_STEP_SUMS=transposed, an option until it has run on a GPU) against a butterfly each (the default).
#   1. "tests": tests/test_train_kernel.py on the GPU (the transposed sums bit for bit the butterflies', the flow's
#      shapes with both, the rest as before);
#   2. "kbench": bench/gpu_train_step_kernel.py, VARIANTS "kernel kernel-transposed", RUNS 3 (the epoch graph's GPU
#      time and the losses of each: they must agree to the bit);
#   3. "figs": bench/figure_times.py on the host's CPU (session 33's figure changes; the slowest late figure).
# The call planned (bench/RESULTS.md, session 33; carry .whl), then the pair with this tree's figures:
#   LIMIT=250 bash bench/gpu_session33.sh; \
#   LIMIT=340 STEPS="flow cpuwarm" RUNS=6 CPU_RUNS=3 PYSPY=0 CPU_MIN=100 bash bench/gpu_session29.sh
DEFAULT_STEPS="tests kbench figs"
source "$(dirname "$0")/gpu_common.sh"
if want tests && [ "$(left)" -gt 120 ]; then
  echo "== GPU tests: tests/test_train_kernel.py ($(el))"
  timeout $(( $(left) - 100 )) python3 -m pytest -q -rs --tb=short -p no:cacheprovider -p no:warnings \
    tests/test_train_kernel.py 2>&1 | tail -12
fi
if want kbench && [ "$(left)" -gt 60 ]; then
  echo "== the epoch graph, transposed sums against a butterfly each ($(el))"
  VARIANTS="kernel kernel-transposed" RUNS=3 PROFILE=0 timeout $(( $(left) - 30 )) \
    python3 bench/gpu_train_step_kernel.py 2>&1 | grep "^| \|^rows\|agree\|DIFFER\|identical"
fi
if want figs && [ "$(left)" -gt 30 ]; then
  echo "== the report's figures on this host's CPU ($(el))"
  timeout $(( $(left) - 5 )) python3 bench/figure_times.py 7 2>&1 | tail -12
fi
echo "== done ($(el))"

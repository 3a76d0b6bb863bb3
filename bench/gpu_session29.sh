#!/usr/bin/env bash
# One GPU call (session 29): the GPU tests (TESTS), the training step kernel against the compiled bf16
# steps (STEPS "kbench": bench/gpu_train_step_kernel.py), the warm flow on a standing cluster with the flow's
# process sampled by py-spy (where the flow's thread waits: bench/stack_summary.py, in the log), then
# (STEPS "cpuwarm") the CPU path on the host's cores for the ratio.
#   LIMIT=570 STEPS="tests kbench idle flow cpuwarm" RUNS=4 bash bench/gpu_session29.sh
#   next (session 31): both paths on one machine, GPU runs either side of the CPU runs
#     LIMIT=420 STEPS="flow cpuwarm" RUNS=7 CPU_RUNS=4 PYSPY=0 CPU_MIN=100 bash bench/gpu_session29.sh; \
#     TAG=-after LIMIT=110 STEPS="flow" RUNS=5 PYSPY=0 FLOW_MIN=60 bash bench/gpu_session29.sh
# "busy": the epoch graph beside a thread busy in Python (bench/gpu_train_step_kernel.py kernel-busy*).
# "diag": the flow with the queued epochs' switch interval left at 5 ms, Dask's worker profiler on, then off.
# "idle": the epoch graph after the GPU idled (IDLE_S 0, 3); the flow step samples nvidia-smi (clocks) every 20 ms.
# py-spy travels as a wheel in .whl/core (pip download py-spy); without it the runs are not sampled.
DEFAULT_STEPS="tests kbench flow cpuwarm"
source "$(dirname "$0")/gpu_common.sh"
spy=""
if [ -x /tmp/site/bin/py-spy ] && [ "${PYSPY:-1}" = 1 ]; then
  if /tmp/site/bin/py-spy record -o /tmp/spy-check.txt -f raw -r 100 --nonblocking -- python3 -c "sum(range(10**7))" \
      >/dev/null 2>&1 && [ -s /tmp/spy-check.txt ]; then spy=/tmp/site/bin/py-spy; echo "py-spy: works"
  else echo "py-spy: cannot sample here"; fi
fi
if want tests && [ "$(left)" -gt 60 ]; then
  echo "== GPU tests: ${TESTS:-tests/test_train_kernel.py tests/test_model.py} ($(el))"
  timeout $(( $(left) - 5 )) python3 -m pytest -x -q -rs --tb=short -p no:cacheprovider -p no:warnings \
    ${TESTS:-tests/test_train_kernel.py tests/test_model.py} 2>&1 | tail -12
fi
if want kbench && [ "$(left)" -gt 120 ]; then
  echo "== the training step kernel against the compiled bf16 steps ($(el))"
  timeout $(( $(left) - 10 )) python3 bench/gpu_train_step_kernel.py 2>&1 | grep -v -i "warn" | tail -30
fi
if want busy && [ "$(left)" -gt 100 ]; then  # the epoch graph beside a thread busy in Python, switch interval 0.1 / 5 ms
  echo "== the step kernel's epoch graph beside a busy thread ($(el))"
  VARIANTS="kernel kernel-busy kernel-busy-5ms" RUNS=${BUSY_RUNS:-3} PROFILE=0 timeout $(( $(left) - 10 )) \
    python3 bench/gpu_train_step_kernel.py 2>&1 | grep "^| kernel\|agree\|DIFFER"
fi
if want idle && [ "$(left)" -gt 100 ]; then  # the epoch graph's runs with the GPU idle 0 and 3 s before each
  for idle in 0 3; do
    echo "== the step kernel's epoch graph, IDLE_S=$idle ($(el))"
    IDLE_S=$idle VARIANTS=kernel RUNS=4 PROFILE=0 timeout $(( $(left) - 10 )) python3 bench/gpu_train_step_kernel.py 2>&1 \
      | grep "^| kernel"
  done
fi
if want flow && [ "$(left)" -gt ${FLOW_MIN:-200} ]; then
  echo "== flow on a standing cluster, RUNS=${RUNS:-5} ($(el))"
  rm -rf /tmp/bf-persistent-gpu-*
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader -lms 20 \
    > "$OUT/smi-flow.csv" 2>/dev/null & smi=$!
  rm -rf /tmp/spy; PYSPY=$spy PYSPY_DIR=/tmp/spy RUNS=${RUNS:-5} RUN_LIMIT=${RUN_LIMIT:-240} timeout $(( $(left) - 10 )) \
    python3 bench/gpu_flow_persistent.py 2>&1 | grep -v -i "warn\|^\s*$" | tail -40
  kill $smi 2>/dev/null
  [ -d /tmp/spy ] && tar czf "$OUT/stacks-gpu.tar.gz" -C /tmp spy  # (one file: a call brings back only a few)
fi
if want cpuwarm && [ "$(left)" -gt ${CPU_MIN:-200} ]; then
  echo "== the flow on the CPU, a standing cluster of ${WORKERS:-16} workers ($(el))"
  rm -rf /tmp/bf-persistent-cpu-*
  PYSPY="" DEVICE=cpu WORKERS=${WORKERS:-16} RUNS=${CPU_RUNS:-3} RUN_LIMIT=${RUN_LIMIT:-240} timeout $(( $(left) - 10 )) \
    python3 bench/gpu_flow_persistent.py 2>&1 | grep -v -i "warn\|^\s*$" | tail -30
fi
if want diag && [ "$(left)" -gt 150 ]; then  # which worker thread held the interpreter: the fix off, Dask's profiler on / off
  for prof in True False; do
    echo "== flow, the queued epochs' switch interval the interpreter's, the workers' profiler $prof ($(el))"
    rm -rf /tmp/bf-persistent-gpu-*
    TAG=-diag-profile-$prof DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=$prof SWITCH=none \
      RUNS=${DIAG_RUNS:-3} RUN_LIMIT=${RUN_LIMIT:-240} \
      timeout $(( $(left) - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 | grep "profiler\|switch\|^  train\|^| [0-9]"
  done
fi
echo "== done ($(el))"

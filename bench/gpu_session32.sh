#!/usr/bin/env bash
# One GPU call (session 32): the training step kernel with a row shared by several warps, then the flow pair.
#   1. "tests": the step kernel's GPU tests at every thread count (TESTS_K);
#   2. "kbench": the epoch graph's GPU time per thread count (bench/gpu_train_step_kernel.py, VARIANTS "kernel
#      kernel-t64 kernel-t128 kernel-t256", RUNS 3), the fastest (median of runs 2-3) whose tests passed chosen;
#   3. "pair": with BEATFLOW_STEP_THREADS set to that count (32 where the tests failed or the kernels did not run),
#      the flow on a standing GPU cluster, the CPU path on the host's cores, the GPU again (bench/gpu_session29.sh).
#   LIMIT=585 bash bench/gpu_session32.sh      (carry .whl; about 480 s on an H100 host)
DEFAULT_STEPS="tests kbench pair"
source "$(dirname "$0")/gpu_common.sh"
threads=32
passed=0
if want tests && [ "$(left)" -gt 400 ]; then
  echo "== GPU tests of the step kernel ($(el))"
  timeout 120 python3 -m pytest -q -rs --tb=short -p no:cacheprovider -p no:warnings tests/test_train_kernel.py \
    -k "${TESTS_K:-flow_shapes or several or queued or fills}" 2>&1 | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] && passed=1
fi
if want kbench && [ "$(left)" -gt 330 ]; then
  echo "== the epoch graph per thread count ($(el))"
  VARIANTS="kernel kernel-t64 kernel-t128 kernel-t256" RUNS=3 PROFILE=0 timeout 150 \
    python3 bench/gpu_train_step_kernel.py 2>&1 | grep -v -i "warn" | tail -16
  best=$(python3 - "$OUT/train_step_kernel.json" <<'EOF'
import json, statistics, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except Exception:
    print(32); sys.exit()
ms = {}
for r in runs:
    if r.get("run", 1) > 1 and r.get("epoch_gpu_ms"):
        ms.setdefault(r["variant"], []).append(sum(r["epoch_gpu_ms"]))
med = {v: statistics.median(x) for v, x in ms.items()}
for v, m in sorted(med.items(), key=lambda kv: kv[1]):
    print(f"{v}: {m:.1f} ms for 10 epochs", file=sys.stderr)
best = min(med, key=med.get) if med else "kernel"
print(32 if best == "kernel" else int(best.split("-t")[1]))
EOF
)
  [ "$passed" = 1 ] && threads=$best
  echo "fastest: $best threads a row; tests passed: $passed; the pair runs with $threads"
fi
if want pair; then
  export BEATFLOW_STEP_THREADS=$threads
  echo "== the pair, BEATFLOW_STEP_THREADS=$threads ($(el))"
  rest=$(( $(left) - 75 ))
  LIMIT=$rest STEPS="flow cpuwarm" RUNS=${RUNS:-6} CPU_RUNS=${CPU_RUNS:-4} PYSPY=0 CPU_MIN=100 \
    bash bench/gpu_session29.sh
  TAG=-after LIMIT=$(( $(left) - 3 )) STEPS="flow" RUNS=${AFTER_RUNS:-4} PYSPY=0 FLOW_MIN=55 bash bench/gpu_session29.sh
fi
echo "== done ($(el))"

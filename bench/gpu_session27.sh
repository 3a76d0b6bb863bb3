#!/usr/bin/env bash
# One GPU call (session 27): what sessions 25-27 changed, on the GPU: the CuPy import's cost in a fresh
# process, the warm flow on a standing cluster (the load's `return` after the background CuPy import,
# the figures' queue with 6 figure processes), segmentation + embedding variants (SegmentGraph), the GPU
# tests of the kernels, then (STEPS "cpuwarm") the CPU path on the host's cores for the ratio.
#   LIMIT=570 STEPS="import flow timeline tests" RUNS=5 bash bench/gpu_session27.sh
DEFAULT_STEPS="import flow timeline tests"
source "$(dirname "$0")/gpu_common.sh"
if want import; then
  echo "== import cupy in a fresh process ($(el))"
  for i in 1 2; do python3 -c "import time; t = time.perf_counter(); import cupy; print(f'import cupy: {time.perf_counter() - t:.3f} s')"; done
fi
if want flow && [ "$(left)" -gt 200 ]; then
  echo "== flow on a standing cluster, RUNS=${RUNS:-5} ($(el))"
  rm -rf /tmp/bf-persistent-gpu-*
  RUNS=${RUNS:-5} RUN_LIMIT=${RUN_LIMIT:-240} timeout $(( $(left) - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 \
    | grep -v -i "warn\|^\s*$" | tail -40
fi
if want timeline && [ "$(left)" -gt 90 ]; then
  echo "== segmentation + embedding variants ($(el))"
  VARIANTS="${VARIANTS:-streams;streams,graph;streams,ws}" RUNS=${TL_RUNS:-300} CHECKS=3 PROFILE=0 \
    timeout $(( $(left) - 10 )) python3 bench/gpu_seg_timeline.py 2>&1 | grep -v -i warn | tail -24
fi
if want tests && [ "$(left)" -gt 60 ]; then
  echo "== GPU tests: ${TESTS:-tests/test_kernels.py tests/test_capture_arena.py} ($(el))"
  timeout $(( $(left) - 5 )) python3 -m pytest -x -q --tb=short -p no:cacheprovider -p no:warnings \
    ${TESTS:-tests/test_kernels.py tests/test_capture_arena.py} 2>&1 | tail -8
fi
if want cpuwarm && [ "$(left)" -gt 200 ]; then
  echo "== the flow on the CPU, a standing cluster of ${WORKERS:-16} workers ($(el))"
  rm -rf /tmp/bf-persistent-cpu-*
  DEVICE=cpu WORKERS=${WORKERS:-16} RUNS=${CPU_RUNS:-3} RUN_LIMIT=${RUN_LIMIT:-240} timeout $(( $(left) - 10 )) \
    python3 bench/gpu_flow_persistent.py 2>&1 | grep -v -i "warn\|^\s*$" | tail -30
fi
echo "== done ($(el))"

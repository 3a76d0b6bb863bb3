#!/usr/bin/env bash
# One H200 call (session 8): the GPU tests (kernels, with the flutter rule's kernels; the rhythm
# tests on CuPy), segmentation + embedding of the 20 h stream with the rule as kernels, the
# detection and episodes against the CPU on MIT-BIH records, Nsight Compute durations, and the flow
# on a standing cluster. Outputs under $OUT.
#   BUDGET=540 [SKIP="ncu flow"] bash bench/gpu_session8.sh      (from the repository root; .whl and .devdata carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== GPU tests ($(el))"
timeout 200 python3 -m pytest -x -q --tb=short -p no:cacheprovider -p no:warnings tests/test_kernels.py \
  tests/test_rhythm.py 2>&1 | tail -15
echo "== segmentation + embedding: bench/gpu_segment.py ($(el))"
SHAPES=${SHAPES:-1} timeout 150 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -24
cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
echo "== MIT-BIH, detection and episodes on CuPy against NumPy ($(el))"
timeout 120 python3 bench/gpu_mitdb_check.py 2>&1 | grep -v -i warn | tail -7
echo "== Nsight Compute durations ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if ! skip ncu && [ "$left" -gt 260 ]; then
  timeout 110 ncu --clock-control none -c 40 --section SpeedOfLight python3 bench/gpu_seg_embed.py > "$OUT/ncu.txt" 2>&1
fi
[ -f "$OUT/ncu.txt" ] && python3 bench/ncu_durations.py "$OUT/ncu.txt"
echo "== flow on a standing cluster ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if ! skip flow && [ "$left" -gt 140 ]; then
  rm -rf /tmp/bf-persistent-* /tmp/flowout; mkdir -p /tmp/flowout
  OUT=/tmp/flowout RUNS=${RUNS:-2} RUN_LIMIT=150 timeout $(( left - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 \
    | grep -v -i warn | tail -5
  tar czf "$OUT/flow.tgz" -C /tmp flowout 2>/dev/null
fi
echo "done ($(el))"

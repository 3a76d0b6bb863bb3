#!/usr/bin/env bash
# One H200 call (session 7): the GPU tests (kernels, the rhythm rule on CuPy), segmentation +
# embedding of the 20 h stream (the noise rule's window minimum by a warp per candidate, rows
# claimed in order), the embedding probe (rows per claim), the detection against the CPU on MIT-BIH
# records, the training's time in an RMM-async process, Nsight Compute durations, and the flow on a standing cluster. Outputs under $OUT.
#   BUDGET=540 [SKIP="embed ncu"] bash bench/gpu_session7.sh      (from the repository root; .whl and .devdata carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== GPU tests ($(el))"
tests="tests/test_kernels.py"
[ -f tests/test_rhythm.py ] && tests="$tests tests/test_rhythm.py"
timeout 200 python3 -m pytest -x -q --tb=short -p no:cacheprovider -p no:warnings $tests 2>&1 | tail -15
echo "== segmentation + embedding: bench/gpu_segment.py ($(el))"
SHAPES=${SHAPES:-1} timeout 150 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -22
cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
echo "== embedding probe ($(el))"
skip embed || timeout 90 python3 bench/gpu_embed_probe.py 2>&1 | grep -v -i warn | tail -8
echo "== MIT-BIH, detection on CuPy against NumPy ($(el))"
timeout 120 python3 bench/gpu_mitdb_check.py 2>&1 | grep -v -i warn | tail -7
echo "== training in a worker-like process ($(el))"
timeout 150 python3 bench/gpu_train_probe.py 2>&1 | grep -v -i warn | tail -22
echo "-- the same with PyTorch's own allocator ($(el))"
ALLOC=native timeout 100 python3 bench/gpu_train_probe.py 2>&1 | grep -v -i warn | tail -18
echo "== Nsight Compute durations ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if ! skip ncu && [ "$left" -gt 260 ]; then
  timeout 110 ncu --clock-control none -c 40 --section SpeedOfLight python3 bench/gpu_seg_embed.py > "$OUT/ncu.txt" 2>&1
fi
[ -f "$OUT/ncu.txt" ] && python3 bench/ncu_durations.py "$OUT/ncu.txt"
echo "== flow on a standing cluster ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if [ "$left" -gt 140 ]; then
  rm -rf /tmp/bf-persistent-* /tmp/flowout; mkdir -p /tmp/flowout
  OUT=/tmp/flowout RUNS=${RUNS:-2} RUN_LIMIT=150 timeout $(( left - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 \
    | grep -v -i warn | tail -5
  tar czf "$OUT/flow.tgz" -C /tmp flowout 2>/dev/null
fi
echo "done ($(el))"

#!/usr/bin/env bash
# One H200 call (session 5): the detection kernels (timings and checks, the GPU tests),
# the flow on a standing cluster (3 runs), then, as time allows, Nsight Compute on the detection kernels.
# (The call of 2026-12-03 05:10 also tried two GPU workers on the one GPU: dask-cuda refuses --gpus 0,0.)
#   bash bench/gpu_session5.sh      (from the repository root, .whl carried; outputs under $OUT)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== detection kernels: bench/gpu_segment.py"
timeout 200 python3 bench/gpu_segment.py 2>&1 | grep -v Warn | tail -44
echo "== GPU tests: tests/test_kernels.py"
timeout 150 python3 -m pytest -x -q tests/test_kernels.py 2>&1 | tail -4
echo "== flow on a standing cluster: bench/gpu_flow_persistent.py ($(( $(date +%s) - t0 )) s so far)"
rm -rf /tmp/bf-persistent-* /tmp/flowout
mkdir -p /tmp/flowout
OUT=/tmp/flowout RUNS=${RUNS:-3} RUN_LIMIT=150 timeout 330 python3 bench/gpu_flow_persistent.py 2>&1 | grep -v Warn | tail -14
tar czf "$OUT/flow.tgz" -C /tmp flowout
left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
echo "== Nsight Compute ($left s left)"
if [ "$left" -gt 60 ]; then
  cat > /tmp/one.py <<'PY'
import cupy
from beatflow.gpu import kernels as K
from beatflow.params import SegmentParams
from beatflow.io.synth import synthesize_ecg
s = SegmentParams().samples(250.0)
xg = cupy.asarray(synthesize_ecg(hours=20, fs=250.0, seed=0).signal)
for _ in range(2): K.detect_peaks_gpu(xg, s)
cupy.cuda.Device().synchronize()
PY
  timeout $(( left - 15 )) ncu --clock-control none -k regex:"dense|cand_|emit|scan" -c 10 --section SpeedOfLight \
    --section LaunchStats --section Occupancy python3 /tmp/one.py > "$OUT/ncu_dense.txt" 2>&1
  grep -E "^  [a-z_]+::|Duration|Registers Per|Achieved Occ|Executed Ipc Active|Compute \(SM\)" "$OUT/ncu_dense.txt" \
    | sed 's/\[abi[^(]*//' | cut -c1-100 | head -60
fi

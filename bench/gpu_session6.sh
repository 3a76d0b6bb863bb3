#!/usr/bin/env bash
# One H200 call (session 6, first): segmentation + embedding times after the shared-memory views,
# the host cost of each launch, Nsight Compute (full set, SASS source counters) on the dense kernel
# and cand_eval, the GPU tests. Outputs under $OUT.
#   bash bench/gpu_session6.sh      (from the repository root, .whl carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== segmentation + embedding: bench/gpu_segment.py"
SHAPES=${SHAPES:-2} timeout 200 python3 bench/gpu_segment.py 2>&1 | grep -v Warn | tail -30
cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
echo "== host cost per launch: bench/gpu_launch_probe.py ($(( $(date +%s) - t0 )) s)"
timeout 90 python3 bench/gpu_launch_probe.py 2>&1 | grep -v Warn | tail -20
echo "== GPU tests ($(( $(date +%s) - t0 )) s)"
timeout 120 python3 -m pytest -x -q tests/test_kernels.py 2>&1 | tail -3
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
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
echo "== Nsight Compute ($left s left)"
if [ "$left" -gt 60 ]; then
  timeout $(( left - 20 )) ncu --clock-control none -k regex:"dense|cand_eval" -c 2 --set full --import-source no \
    -o /tmp/det python3 /tmp/one.py > /tmp/ncu.log 2>&1; tail -3 /tmp/ncu.log
  ncu -i /tmp/det.ncu-rep --print-details all > "$OUT/ncu_full.txt" 2>&1
  ncu -i /tmp/det.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
  gzip -f "$OUT/ncu_sass.csv"
  grep -E "^  [a-z_]+::|Duration|Executed Instructions |Registers Per|Achieved Occ|Issue Slots Busy|Warp Cycles Per Issued" \
    "$OUT/ncu_full.txt" | sed 's/\[abi[^(]*//' | cut -c1-110 | head -30
fi

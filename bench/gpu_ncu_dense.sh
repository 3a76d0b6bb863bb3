#!/usr/bin/env bash
# Nsight Compute on the fused detection kernel and the embedding kernel (20 h stream): pipes,
# instruction mix, warp stalls. Output: $OUT/ncu_detail.txt
set -u
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cat > /tmp/two.py <<'PY'
import cupy
from beatflow import beats as B, kernels as K
from beatflow.params import SegmentParams
from beatflow.synth import synthesize_ecg
s = SegmentParams().samples(250.0)
xg = cupy.asarray(synthesize_ecg(hours=20, fs=250.0, seed=0).signal)
for _ in range(2):
    peaks = K.detect_peaks_gpu(xg, s)
    _, start, length = B.beats_from_peaks(peaks, s, xg.shape[0])
    kept = B.kept_mask(length, s)
    K.embed_gpu(xg, start[kept], B.row_lengths(length[kept], s), s.width, baseline_samples=12)
cupy.cuda.Device().synchronize()
PY
timeout 200 ncu --clock-control none -k regex:"dense|embed_warp" -c 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --print-details all python3 /tmp/two.py > "$OUT/ncu_detail.txt" 2>&1
grep -E "^  [a-z_]+::|Duration|Executed Instructions |Issue Slots Busy|Pipe|Stall|Warp Cycles Per Issued|FP64|fp64|Executed Ipc|Bank" "$OUT/ncu_detail.txt" | sed 's/\[abi[^(]*//' | cut -c1-120 | head -80

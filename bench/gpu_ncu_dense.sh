#!/usr/bin/env bash
# Nsight Compute on the fused detection kernel and the embedding kernel (20 h stream; KERNELS: another
# regex of kernel names, COUNT: launches profiled): pipes, instruction mix, warp stalls. Output: $OUT/ncu_detail.txt
set -u
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 ncu --clock-control none -k regex:"${KERNELS:-dense|embed_warp}" -c ${COUNT:-2} --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --print-details all python3 bench/gpu_seg_embed.py > "$OUT/ncu_detail.txt" 2>&1
grep -E "^  [a-z_]+::|Duration|Executed Instructions |Issue Slots Busy|Pipe|Stall|Warp Cycles Per Issued|FP64|fp64|Executed Ipc|Bank" "$OUT/ncu_detail.txt" | sed 's/\[abi[^(]*//' | cut -c1-120 | head -80

#!/usr/bin/env bash
# One H200 call (session 6, third): the fast-launch test first, then checks and times of
# segmentation + embedding (with the noise rule and the bounded search-back), the detection against
# the CPU on MIT-BIH 108/203/116, host cost per launch, the GPU tests, Nsight Compute durations and
# SASS counters of cand_eval/embed_warp, and the flow on a standing cluster. Outputs under $OUT.
#   bash bench/gpu_session6c.sh      (from the repository root; .whl and .devdata carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
echo "== fast launch test"
timeout 120 python3 -m pytest -x -q --tb=short tests/test_kernels.py -k fast_launch > /tmp/fast.log 2>&1
rc=$?; grep -v -i warn /tmp/fast.log | tail -25
if [ $rc -ne 0 ]; then export BEATFLOW_FAST_LAUNCH=0; echo "fast launches OFF for the rest of this run"; fi
echo "== segmentation + embedding: bench/gpu_segment.py ($(el))"
SHAPES=${SHAPES:-2} timeout 200 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -22
cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
echo "== MIT-BIH, kernels against the CPU ($(el))"
timeout 120 python3 bench/gpu_mitdb_check.py 2>&1 | grep -v -i warn | tail -5
echo "== GPU tests ($(el))"
timeout 150 python3 -m pytest -x -q --tb=short tests/test_kernels.py 2>&1 | tail -15
echo "== embedding kernel probe ($(el))"
timeout 90 python3 bench/gpu_embed_probe.py 2>&1 | grep -v -i warn | tail -6
echo "== host cost per launch ($(el))"
timeout 90 python3 bench/gpu_launch_probe.py 2>&1 | grep -v -i warn | tail -17
echo "== Nsight Compute ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
[ "$left" -gt 80 ] && timeout $(( left - 15 < 150 ? left - 15 : 150 )) ncu --clock-control none -c 40 --section SpeedOfLight \
  --section LaunchStats --section Occupancy python3 bench/gpu_seg_embed.py > "$OUT/ncu_c.txt" 2>&1
python3 bench/ncu_durations.py "$OUT/ncu_c.txt"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if [ "$left" -gt 200 ]; then
  timeout 100 ncu --clock-control none -k regex:"dense|cand_eval|embed_warp" -c 6 --set full --import-source no -o /tmp/ce \
    python3 bench/gpu_seg_embed.py > /tmp/ncu2.log 2>&1
  ncu -i /tmp/ce.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu_ce_sass.csv.gz"
  ncu -i /tmp/ce.ncu-rep --print-details all > "$OUT/ncu_ce.txt" 2>&1
fi
echo "== flow on a standing cluster ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if [ "$left" -gt 150 ]; then
  rm -rf /tmp/bf-persistent-* /tmp/flowout; mkdir -p /tmp/flowout
  OUT=/tmp/flowout RUNS=${RUNS:-2} RUN_LIMIT=150 timeout $(( left - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 \
    | grep -v -i warn | tail -5
  tar czf "$OUT/flow.tgz" -C /tmp flowout 2>/dev/null
fi
echo "done ($(el))"

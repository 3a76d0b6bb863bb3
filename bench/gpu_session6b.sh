#!/usr/bin/env bash
# One H200 call (session 6, second): after the fast launches (CuPy driver call), the doubling NMS in
# the dense kernel and the warp-per-candidate cand_eval: checks and times of segmentation + embedding,
# host cost per launch, the GPU tests, Nsight Compute durations, the flow on a standing cluster, and
# one flow on its own LocalCUDACluster (the workers' pre-spawn environment). Outputs under $OUT.
#   bash bench/gpu_session6b.sh      (from the repository root, .whl carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
echo "== segmentation + embedding: bench/gpu_segment.py"
SHAPES=${SHAPES:-3} timeout 200 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -24
cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
echo "== host cost per launch ($(el))"
timeout 90 python3 bench/gpu_launch_probe.py 2>&1 | grep -v -i warn | tail -16
echo "== GPU tests ($(el))"
timeout 150 python3 -m pytest -x -q tests/test_kernels.py 2>&1 | tail -3
echo "== Nsight Compute durations ($(el))"
timeout 120 nsys --version >/dev/null 2>&1 && echo "(nsys present)"
timeout 150 ncu --clock-control none -c 40 --section SpeedOfLight --section LaunchStats --section Occupancy \
  python3 bench/gpu_seg_embed.py > "$OUT/ncu_b.txt" 2>&1
python3 bench/ncu_durations.py "$OUT/ncu_b.txt"
echo "== flow on a standing cluster ($(el))"
rm -rf /tmp/bf-persistent-* /tmp/flowout; mkdir -p /tmp/flowout
OUT=/tmp/flowout RUNS=${RUNS:-2} RUN_LIMIT=150 timeout 300 python3 bench/gpu_flow_persistent.py 2>&1 | grep -v -i warn | tail -8
echo "== one flow on its own LocalCUDACluster, 2 h ($(el))"
left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
if [ "$left" -gt 100 ]; then
  python3 -m prefect server start --host 127.0.0.1 --port 4299 > /tmp/server.log 2>&1 &
  for i in $(seq 60); do curl -s http://127.0.0.1:4299/api/health >/dev/null 2>&1 && break; sleep 1; done
  PREFECT_API_URL=http://127.0.0.1:4299/api timeout $(( left - 15 )) python3 -m beatflow.cli run --hours 2 --device gpu \
    --out /tmp/flowout/own > /tmp/flowout/own.log 2>&1; echo "rc=$?"
  python3 -c "import json; s=json.load(open('/tmp/flowout/own/summary.json')); print('transfers', s.get('transfers')); print('timings', s.get('timings_s'))" 2>&1 | tail -3
fi
tar czf "$OUT/flow.tgz" -C /tmp flowout 2>/dev/null
echo "done ($(el))"

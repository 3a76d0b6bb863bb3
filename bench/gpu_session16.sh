#!/usr/bin/env bash
# One H200 call (session 16): segmentation + embedding launch by launch and its stream variants
# (bench/gpu_seg_timeline.py, step "timeline"), then the steps of bench/gpu_session11.sh (STEPS).
#   LIMIT=570 STEPS="timeline tests flow cpuwarm" RUNS=4 CPU_RUNS=3 bash bench/gpu_session16.sh
# Before the call, compile every kernel for sm_90 on the machine without a GPU (the CUDA simulator runs
# kernels as Python and does not type them as Numba's CUDA target does; session 17's call B failed there):
#   /tmp/nv/bin/python bench/ptx_check.py      (the environment: see that script's docstring)
set -u
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
case " ${STEPS:-timeline} " in *" timeline "*)
  echo "== segmentation + embedding, launch by launch: bench/gpu_seg_timeline.py ($(el))"
  RUNS=${TL_RUNS:-${RUNS:-40}} timeout ${TIMELINE_LIMIT:-150} python3 bench/gpu_seg_timeline.py 2>&1 | grep -v -i warn | tail -${TIMELINE_LINES:-120}
esac
echo "== gpu_session11.sh ($(el))"
BUDGET=$(( ${LIMIT:-560} - ($(date +%s) - t0) )) STEPS="${STEPS:-timeline}" bash bench/gpu_session11.sh
echo "== done ($(el))"

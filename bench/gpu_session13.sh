#!/usr/bin/env bash
# One H200 call (session 13): the detection kernels before and after their block-stride loops became
# constant-round loops (constant taps, a thread per candidate's valley, the tile rank by the warp's lanes),
# in the same call. The code before is a copy of beatflow/ at the session's start commit under .base/
# (made here: rm -rf .base && mkdir .base && git archive <commit> beatflow bench/gpu_segment.py
# bench/gpu_seg_embed.py | tar -x -C .base; cp bench/ncu_durations.py .base/bench/), carried with .whl and
# .devdata. Nsight Compute kernel durations of both, bench/gpu_segment.py of both, then the GPU tests of the
# kernels and the MIT-BIH check of the new code (bench/gpu_session11.sh). Outputs under $OUT.
# BASE=0 leaves out the code before (then .base need not be carried); STEPS and TESTS go to gpu_session11.sh
# (e.g. STEPS="maxreg tests segment mitdb" VARIANTS="default;dense=48" SHAPES=6).
#   bash bench/gpu_session13.sh
set -u
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bash .whl/install.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
versions="new"; [ "${BASE:-1}" = 1 ] && versions="new base"
for v in $versions; do
  root=$PWD; [ $v = base ] && root=$PWD/.base
  echo "== Nsight Compute durations, $v ($(el))"
  (cd "$root" && PYTHONPATH=/tmp/site:$root timeout 120 ncu --clock-control none -c 40 --section SpeedOfLight \
    python3 bench/gpu_seg_embed.py > "$OUT/ncu_$v.txt" 2>&1; python3 bench/ncu_durations.py "$OUT/ncu_$v.txt")
done
[ "${BASE:-1}" = 1 ] && echo "== segmentation + embedding, base ($(el))" &&
(cd .base && PYTHONPATH=/tmp/site:$PWD OUT=$OUT/base timeout 150 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -24)
echo "== new ($(el))"
BUDGET=$(( ${LIMIT:-585} - ($(date +%s) - t0) )) STEPS="${STEPS:-segment tests mitdb}" \
  TESTS="${TESTS:-tests/test_kernels.py tests/test_rhythm.py}" bash bench/gpu_session11.sh
echo "== done ($(el))"

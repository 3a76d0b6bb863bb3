#!/usr/bin/env bash
# A plain `beatflow run` (its defaults: 20 h synthetic ECG, its own Prefect server and cluster, the run cache's
# default folder) as a user runs it twice, for each tree of TREES interleaved: one warm-up run each (its first:
# it fills the run cache, the synthetic cache, compiled kernels), then RUNS more, each timed from command to
# prompt; the flow's total and its training from summary.json. From the repository root:
#
#   TREES="/tmp/base $PWD" RUNS=2 bash bench/second_run.sh        (results: bench/results/cli.md)
#
# Each tree's own code is imported (PYTHONPATH) by the command and its workers; the venv is this one's.
set -u
PY=${PY:-$PWD/.venv/bin/python}
OUTS=${OUTS:-/tmp/bf-second-run}
rm -rf "$OUTS"; mkdir -p "$OUTS"
one() {  # one TREE TAG
  local t0 t1; t0=$(date +%s.%N)
  (cd /tmp && PYTHONPATH=$1 "$PY" -m beatflow.cli run --out "$OUTS/$2" > "$OUTS/$2.log" 2>&1) || echo "$2: rc $?"
  t1=$(date +%s.%N)
  "$PY" -c "
import json, sys
s = json.load(open('$OUTS/$2/summary.json')); t = s['timings_s']
print('| $1 | $2 | %.1f | %.2f | %.2f |' % ($t1 - $t0, t['total'], t['train']))"
}
"$PY" bench/common.py "bench/second_run.sh TREES=${TREES:-$PWD}"
echo "| tree | run | command to prompt, s | flow, s | train, s |"
echo "|---|---|---:|---:|---:|"
for tree in ${TREES:-$PWD}; do one "$tree" "warm-$(basename "$tree")"; done
for i in $(seq "${RUNS:-2}"); do
  for tree in ${TREES:-$PWD}; do one "$tree" "$(basename "$tree")-$i"; done
done

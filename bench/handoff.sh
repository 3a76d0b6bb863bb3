#!/usr/bin/env bash
# `beatflow run` on its defaults (20 h synthetic ECG, the run cache on) with `beatflow serve --detach --device cpu
# --workers 2` up: handed to the service's ready runner (beatflow.pipeline.handoff), and run by the command itself
# on the service's cluster (BEATFLOW_NO_HANDOFF=1), interleaved. One warm-up run first (it fills the run cache and
# warms the workers); before each timed run the script waits until a runner is ready (`serve --status`), so each
# command starts on a machine where no runner is importing. Each run timed from command to prompt; the flow's
# total from summary.json. From the repository root:
#
#   RUNS=3 bash bench/handoff.sh        (results: bench/results/cli.md)
#
# This tree's code is imported (PYTHONPATH) by the command, the service and its runners; the data folder and the
# run cache are throw-away folders of the script's own (no service or cache of the user's is used).
set -u
BF=${BF:-$PWD/.venv/bin/beatflow}
PY=${PY:-$PWD/.venv/bin/python}
OUTS=${OUTS:-/tmp/bf-handoff}
rm -rf "$OUTS"; mkdir -p "$OUTS/data" "$OUTS/cache"
export PYTHONPATH=$PWD BEATFLOW_DATA_DIR=$OUTS/data BEATFLOW_CACHE=$OUTS/cache
unset BEATFLOW_NO_SERVICE BEATFLOW_NO_HANDOFF PREFECT_API_URL
"$PY" bench/common.py "bench/handoff.sh RUNS=${RUNS:-3}"
"$BF" serve --detach --device cpu --workers 2 || exit 1
trap '"$BF" serve --stop > /dev/null' EXIT
ready() { until "$BF" serve --status | grep -q ": ready for"; do sleep 0.5; done; }
one() {  # one TAG [VAR=VALUE]: one timed run
  local t0 t1; ready; t0=$(date +%s.%N)
  (cd /tmp && env $2 "$BF" run --out "$OUTS/$1" > "$OUTS/$1.log" 2>&1) || echo "$1: rc $?"
  t1=$(date +%s.%N)
  "$PY" -c "
import json
s = json.load(open('$OUTS/$1/summary.json')); t = s['timings_s']
print('| $1 | %.2f | %.2f |' % ($t1 - $t0, t['total']))"
}
one warm-up "BEATFLOW_NO_HANDOFF="
echo "| run | command to prompt, s | flow (timings_s.total), s |"
echo "|---|---:|---:|"
for i in $(seq "${RUNS:-3}"); do
  one "handoff-$i" "BEATFLOW_NO_HANDOFF="
  one "itself-$i" "BEATFLOW_NO_HANDOFF=1"
done
uptime

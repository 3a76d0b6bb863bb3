#!/usr/bin/env bash
# The GPU benchmarks as named steps, run in the order given; each writes its output under $OUT.
# From the repository root of the GPU machine, with the wheels of ../shared/device/wheels.sh carried as .whl and
# those of bench/gpu_extra_wheels.sh as .whl-extra:
#
#   bash bench/gpu.sh setup tests detect train flow engine
#   LIMIT=560 RUNS=6 CPU_RUNS=3 bash bench/gpu.sh pair      # the GPU flow, the CPU path, the GPU flow again, the ratio
#   BENCH_COMMIT=<sha> ...                                   # the tree's commit in the headers (the copy may lack .git)
#
# Steps (their knobs, with defaults, in brackets):
#   setup    the carried wheels installed into /tmp/site once a machine (bash .whl/install.sh; implied before the
#            first step when they are not installed yet); the machine header, kept in $OUT/machine.md
#   tests    the GPU tests under real CUDA [TESTS: tests/test_train_kernel.py tests/test_kernels.py
#            tests/test_rhythm.py tests/test_leads.py tests/test_capture_arena.py tests/test_model.py] -> $OUT/tests.txt
#   check    bench/gpu_check.py: CuPy = NumPy on the 20 h stream, zero copy, one RMM pool -> $OUT/gpu_check.{json,md}
#   enginestart  bench/gpu_engine_start.py: a fresh process's engine-cache hit, cold and after warm_gpu_engine
#            [ENGINE_START_RUNS 2] -> $OUT/engine_start.{txt,json}
#   mitdb    bench/gpu_mitdb_check.py: MIT-BIH peaks, episodes, the second lead's rules on CuPy = NumPy
#            (needs .devdata carried: bench/gpu_mitdb_check.py --prepare 108 203 207 here first)
#   detect   bench/gpu_seg_timeline.py: segmentation + embedding of the 20 h stream
#            [DETECT_VARIANTS "streams;streams,graph;streams,ws", DETECT_RUNS 300, CHECKS 3] -> $OUT/detect.txt,
#            $OUT/seg_timeline.json
#   train    bench/gpu_train_step_kernel.py: the training step kernel's epoch graph
#            [TRAIN_VARIANTS "kernel kernel-transposed", TRAIN_RUNS 3, TRAIN_PROFILE 0, IDLE_S 0] -> $OUT/train.txt,
#            $OUT/train_step_kernel.json
#   flow     the GPU flow on a standing cluster [RUNS 6; run 1 is cold, the rest warm; RUN_LIMIT 240 s a run]
#            -> $OUT/log-persistent-gpu*.txt, summaries-persistent-gpu*.json, smi-flow*.csv (nvidia-smi every 20 ms).
#            A second flow step in one call gets the tag -2, a third -3 (on top of TAG).
#   cpuflow  the CPU path on this host's cores: a standing cluster of WORKERS [16] single-threaded workers,
#            CPU_RUNS [3] (its cold run takes about 100 s on a 16-core host) -> $OUT/*-persistent-cpu*
#   ratio    the ratio of the medians of the flow's and the CPU path's warm runs found under $OUT
#   pair     flow cpuflow flow ratio
#   ownflow  `beatflow run` on its own cluster, cold, as a user runs it [OWN "gpu"; "gpu cpu" adds a fresh
#            WORKERS-worker CPU cluster] -> $OUT/own-*/
#   serve    `beatflow serve --device gpu --detach`, then SERVE_RUNS [3] `beatflow run --device gpu` on it, each timed
#            from command to prompt, then `beatflow serve --stop` -> $OUT/serve/ (summaries, the service's lines)
#   oom      a pool too small for a partition: the run must stop with one line naming the sizes, no output folder
#   multi    bench/gpu_multi.py: the flow on 1, 2 and all GPUs (a several-GPU kind) -> $OUT/multi/
#   engine   bench/engine_bench.py --device cuda [ENGINE_ARGS "--hours 2 --epochs 10 --latency-calls 3000"]
#            -> $OUT/engine/engine_bench.{json,md}
# LIMIT [570]: seconds for the whole call. Each step gets what is left (less a margin) as its timeout and is
# skipped when too little is left. Which results file each step feeds: bench/README.md.
set -u
t0=$(date +%s)
OUT=${OUT:-bench/out}
PY=${PY:-python3}
export OUT PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
STEPS="setup tests check enginestart mitdb detect train flow cpuflow ratio pair ownflow serve oom multi engine"

el() { echo "$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - t0) )); }
budget() { local b=$(( $(left) - ${1:-10} )); [ "$b" -lt 1 ] && b=1; echo "$b"; }  # a timeout (never 0: no limit)
enough() {  # enough NAME SECONDS: whether SECONDS are left for step NAME (else it says so)
  [ "$(left)" -gt "$2" ] && return 0
  echo "== $1: skipped, $(left) s left of LIMIT=${LIMIT:-570}, it needs $2 ($(el))"
  return 1
}

step_setup() {
  if [ ! -f /tmp/site/.beatflow-wheels ]; then
    echo "== setup: bash .whl/install.sh ($(el))"
    if ! bash .whl/install.sh > "$OUT/setup.txt" 2>&1; then
      echo "!! setup failed:"; tail -5 "$OUT/setup.txt"; return 1
    fi
    # wheels the device recipe leaves out (platformdirs; EDF input is not benched there): bench/gpu_extra_wheels.sh fills .whl-extra here
    if ls .whl-extra/*.whl > /dev/null 2>&1 && ! python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl-extra/*.whl >> "$OUT/setup.txt" 2>&1; then
      echo "!! setup of .whl-extra failed:"; tail -5 "$OUT/setup.txt"; return 1
    fi
    touch /tmp/site/.beatflow-wheels
  fi
  $PY bench/common.py "bench/gpu.sh $*" | tee "$OUT/machine.md"
}

step_tests() {
  enough tests 60 || return 0
  local have=""
  for f in ${TESTS:-tests/test_train_kernel.py tests/test_kernels.py tests/test_rhythm.py tests/test_leads.py \
                     tests/test_capture_arena.py tests/test_model.py}; do
    if [ -e "${f%%::*}" ]; then have="$have $f"; else echo "(no ${f%%::*} in this tree: left out)"; fi
  done
  echo "== GPU tests:$have ($(el))"
  timeout "$(budget 10)" $PY -m pytest -q -rs --tb=short -p no:cacheprovider -p no:warnings $have \
    > "$OUT/tests.txt" 2>&1
  echo "pytest rc $?"
  tail -15 "$OUT/tests.txt"
}

step_check() {
  enough check 120 || return 0
  echo "== bench/gpu_check.py ($(el))"
  timeout "$(budget 10)" $PY bench/gpu_check.py > "$OUT/check.txt" 2>&1
  echo "rc $?"
  grep -v -i warn "$OUT/check.txt" | tail -40
}

step_enginestart() {
  enough enginestart 90 || return 0
  echo "== bench/gpu_engine_start.py ($(el))"
  timeout "$(budget 10)" $PY bench/gpu_engine_start.py --runs "${ENGINE_START_RUNS:-2}" > "$OUT/engine_start.txt" 2>&1
  echo "rc $?"
  grep -v -i warn "$OUT/engine_start.txt" | tail -20
}

step_mitdb() {
  if [ ! -f .devdata/mitdb_ch0.npz ]; then
    echo "== mitdb: skipped, no .devdata/mitdb_ch0.npz (bench/gpu_mitdb_check.py --prepare, then carry .devdata)"
    return 0
  fi
  enough mitdb 80 || return 0
  echo "== MIT-BIH on CuPy against NumPy: bench/gpu_mitdb_check.py ($(el))"
  timeout "$(budget 10)" $PY bench/gpu_mitdb_check.py 2>&1 | grep -v -i warn | tail -16
}

step_detect() {
  enough detect 90 || return 0
  echo "== segmentation + embedding: bench/gpu_seg_timeline.py ($(el))"
  VARIANTS="${DETECT_VARIANTS:-streams;streams,graph;streams,ws}" RUNS=${DETECT_RUNS:-300} CHECKS=${CHECKS:-3} \
    PROFILE=${PROFILE:-0} timeout "$(budget 10)" $PY bench/gpu_seg_timeline.py > "$OUT/detect.txt" 2>&1
  echo "rc $?"
  grep "^- \|^stream:\|^variant\|^interleaved\|^| \|^host time" "$OUT/detect.txt" | cut -c1-260
}

step_train() {
  enough train 150 || return 0
  echo "== the training step kernel: bench/gpu_train_step_kernel.py ($(el))"
  VARIANTS="${TRAIN_VARIANTS:-kernel kernel-transposed}" RUNS=${TRAIN_RUNS:-3} PROFILE=${TRAIN_PROFILE:-0} \
    IDLE_S=${IDLE_S:-0} timeout "$(budget 10)" $PY bench/gpu_train_step_kernel.py > "$OUT/train.txt" 2>&1
  echo "rc $?"
  grep "^- \|^rows\|^| \|agree\|DIFFER\|identical\|^kernel step\|^  " "$OUT/train.txt" | cut -c1-260
}

flow_n=0
step_flow() {
  enough flow "${FLOW_MIN:-90}" || return 0
  flow_n=$((flow_n + 1))
  local tag=${TAG:-}
  [ "$flow_n" -gt 1 ] && tag="${TAG:-}-$flow_n"
  echo "== the GPU flow on a standing cluster, RUNS=${RUNS:-6}, tag '$tag' ($(el))"
  rm -rf /tmp/bf-persistent-gpu-*
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader -lms 20 \
    > "$OUT/smi-flow$tag.csv" 2>/dev/null &
  local smi=$!
  TAG=$tag RUNS=${RUNS:-6} RUN_LIMIT=${RUN_LIMIT:-240} timeout "$(budget 10)" $PY bench/gpu_flow_persistent.py 2>&1 \
    | grep "^- \|^threads\|^cluster\|^run [0-9]\|^| " | cut -c1-260
  kill "$smi" 2>/dev/null
}

step_cpuflow() {
  enough cpuflow "${CPU_MIN:-150}" || return 0
  echo "== the CPU path on this host: a standing cluster of ${WORKERS:-16} workers, CPU_RUNS=${CPU_RUNS:-3} ($(el))"
  rm -rf /tmp/bf-persistent-cpu-*
  DEVICE=cpu WORKERS=${WORKERS:-16} TAG=${TAG:-} RUNS=${CPU_RUNS:-3} RUN_LIMIT=${RUN_LIMIT:-240} \
    timeout "$(budget 10)" $PY bench/gpu_flow_persistent.py 2>&1 \
    | grep "^- \|^CPU\|^cluster\|^run [0-9]\|^| " | cut -c1-260
}

step_ratio() {
  echo "== the warm runs' ratio, GPU flow against the CPU path on this host ($(el))"
  $PY - "$OUT" <<'PY'
import glob, json, os, statistics, sys
sys.path.insert(0, "bench")
from common import print_table

def warm(device):
    """Totals of the warm runs (run 2 on of each standing cluster) that completed."""
    runs = []
    for f in sorted(glob.glob(os.path.join(sys.argv[1], f"summaries-persistent-{device}*.json"))):
        for run, v in json.load(open(f)).items():
            total = ((v.get("summary") or {}).get("timings_s") or {}).get("total")
            if int(run) >= 2 and v.get("rc") == 0 and total:
                runs.append(total)
    return runs

gpu, cpu = warm("gpu"), warm("cpu")
print_table(["path", "warm runs", "totals, s", "median, s"],
            [(name, len(r), ", ".join(f"{t:.3f}" for t in r), f"{statistics.median(r):.3f}" if r else "-")
             for name, r in (("GPU", gpu), ("CPU", cpu))], "lrll")
if gpu and cpu:
    g = statistics.median(gpu)
    print(f"ratio of the medians: {statistics.median(cpu) / g:.1f}x (each CPU run against the GPU median: "
          + ", ".join(f"{c / g:.1f}x" for c in cpu) + ")")
PY
}

step_pair() { step_flow; step_cpuflow; step_flow; step_ratio; }

step_ownflow() {
  for dev in ${OWN:-gpu}; do
    enough "ownflow $dev" 150 || return 0
    local out=/tmp/bf-own-$dev extra=""
    [ "$dev" = cpu ] && extra="--workers ${WORKERS:-16}"
    echo "== beatflow run --device $dev $extra on its own cluster, cold ($(el))"
    mkdir -p "$OUT/own-$dev"
    rm -rf "$out"
    local t1=$(date +%s)
    PREFECT_HOME=/tmp/prefect-home timeout "$(budget 20)" $PY -m beatflow.cli run --hours "${HOURS:-20}" \
      --device "$dev" $extra --out "$out" -v > "$OUT/own-$dev/log.txt" 2>&1  # (-v: the flow's log, grepped below)
    echo "rc $? in $(( $(date +%s) - t1 )) s"
    grep -E "epoch|segmentation:|training:|scoring:|truth:|engine|error" "$OUT/own-$dev/log.txt" | cut -c1-220 | tail -12
    for f in summary.json report.html; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/own-$dev/"; done
  done
  $PY - "$OUT" <<'PY'
import glob, json, os, sys
sys.path.insert(0, "bench")
from common import print_table

stages = ["synthesize", "load", "segment", "embed", "train", "engine", "score", "report", "total"]
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "own-*", "summary.json"))):
    s = json.load(open(f))
    t, tr, tru = s["timings_s"], s.get("transfers", {}), s.get("truth", {})
    peak = max(tr.get("rmm_peak_bytes_per_worker") or [0]) / 2**30
    rows.append([os.path.basename(os.path.dirname(f)), s["device"], s["workers"]]
                + [f"{t.get(k, float('nan')):.2f}" for k in stages]
                + [f"{tr.get('d2h_bytes', 0) / 2**20:.1f}", f"{peak:.2f}"]
                + [f"{tru.get(k, 0):.4f}" for k in ("se", "ppv", "auc")])
if rows:
    print_table(["run", "device", "workers"] + stages + ["d2h MB", "pool peak GB", "Se", "PPV", "AUC"], rows)
PY
}

step_serve() {
  enough serve 120 || return 0
  mkdir -p "$OUT/serve"
  export BEATFLOW_DATA_DIR=/tmp/bf-serve-data
  echo "== beatflow serve --device gpu --detach ($(el))"
  local t1=$(date +%s.%N)
  timeout "$(budget 30)" $PY -m beatflow.cli serve --device gpu --detach > "$OUT/serve/serve.txt" 2>&1
  echo "rc $? in $(python3 -c "import time; print(round(time.time() - $t1, 1))") s"; tail -3 "$OUT/serve/serve.txt"
  for k in $(seq 1 "${SERVE_RUNS:-3}"); do
    enough "serve run $k" 60 || break
    rm -rf "/tmp/bf-serve-$k"
    t1=$(date +%s.%N)
    timeout "$(budget 20)" $PY -m beatflow.cli run --hours "${HOURS:-20}" --device gpu --out "/tmp/bf-serve-$k" \
      > "$OUT/serve/run-$k.txt" 2>&1
    echo "run $k: rc $? in $(python3 -c "import time; print(round(time.time() - $t1, 1))") s (command to prompt)"
    [ -f "/tmp/bf-serve-$k/summary.json" ] && cp "/tmp/bf-serve-$k/summary.json" "$OUT/serve/summary-$k.json"
  done
  grep -h -E "total time|service|classes|engine" "$OUT"/serve/run-*.txt | cut -c1-160 | tail -8
  timeout 60 $PY -m beatflow.cli serve --stop >> "$OUT/serve/serve.txt" 2>&1; echo "stop rc $?"
  unset BEATFLOW_DATA_DIR
}

step_oom() {
  enough oom 120 || return 0
  echo "== a pool too small for a partition: beatflow run --device gpu --partitions 1 --rmm-pool-size 40MB ($(el))"
  rm -rf /tmp/bf-oom
  local t1=$(date +%s)
  timeout "$(budget 10)" $PY -m beatflow.cli run --device gpu --hours "${OOM_HOURS:-20}" --partitions 1 \
    --rmm-pool-size 40MB --out /tmp/bf-oom > "$OUT/log-oom.txt" 2>&1
  echo "rc $? in $(( $(date +%s) - t1 )) s; last line: $(tail -1 "$OUT/log-oom.txt" | cut -c1-400)"
  echo "output folder: $(ls -d /tmp/bf-oom /tmp/.bf-oom.* 2>/dev/null || echo none)"
}

step_multi() {
  enough multi 200 || return 0
  echo "== several GPUs: bench/gpu_multi.py (GPU sets ${GPU_SETS:-from nvidia-smi}, inputs ${INPUTS:-20 200:10}) ($(el))"
  mkdir -p "$OUT/multi"
  OUT=$OUT/multi timeout "$(budget 10)" $PY bench/gpu_multi.py 2>&1 | grep -v -i "warn\|sqlalche\|database" | tail -30
}

step_engine() {
  enough engine 200 || return 0
  echo "== the engines on the GPU: bench/engine_bench.py --device cuda ($(el))"
  mkdir -p "$OUT/engine"
  timeout "$(budget 10)" $PY bench/engine_bench.py --device cuda --out "$OUT/engine" --cache-dir /tmp/bf-engine-cache \
    ${ENGINE_ARGS:---hours 2 --epochs 10 --latency-calls 3000} 2>&1 | grep -v -i warn | tail -60
}

if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ] || [ "$1" = help ]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d' | cut -c3-
  exit 0
fi
for s in "$@"; do
  case " $STEPS " in *" $s "*) ;; *) echo "bench/gpu.sh: unknown step '$s' (steps: $STEPS)"; exit 2 ;; esac
done
mkdir -p "$OUT"
[ "$1" = setup ] || step_setup "$@" || exit 1  # (the wheels and the header before anything else)
for s in "$@"; do
  "step_$s" "$@"
done
echo "== done ($(el))"

#!/usr/bin/env bash
# On the H200: the whole flow on the GPU (LocalCUDACluster + RMM pool) and on the CPU (16 workers),
# same 20-hour synthetic ECG; summaries and the GPU report go to $OUT. Run from the repo root with
# the wheels of ../shared/device/wheels.sh carried (.whl):
#   bash .whl/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash bench/gpu_flow.sh
set -uo pipefail
export PREFECT_SERVER_ANALYTICS_ENABLED=false PYTHONUNBUFFERED=1 PREFECT_HOME=/tmp/prefect-home
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
HOURS=${HOURS:-20}
run() {  # name, args...
  local name=$1; shift
  local t0=$(date +%s.%N)
  # the log goes under $OUT as it is written, so a run stopped at its limit still tells where it was
  timeout "${RUN_LIMIT:-240}" python3 -m beatflow.cli run --hours "$HOURS" --out "/tmp/bf-$name" "$@" \
    > "$OUT/log-$name.txt" 2>&1
  local rc=$?
  cp "$OUT/log-$name.txt" "/tmp/bf-$name.log"
  local t1=$(date +%s.%N)
  echo "== $name rc=$rc wall=$(python3 -c "print(round($t1-$t0,1))") s"
  grep -E "epoch|segmentation:|training:|scoring:|truth:|engine|error" "/tmp/bf-$name.log" | cut -c1-220 | tail -20
  [ -f "/tmp/bf-$name/summary.json" ] && cp "/tmp/bf-$name/summary.json" "$OUT/summary-$name.json"
  return 0
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for r in ${RUNS:-gpu-cold gpu-warm cpu16}; do
  case $r in
    gpu-*) run "$r" --device gpu ;;
    cpu16) run cpu16 --device cpu --workers 16 ;;
  esac
done
for r in gpu-warm gpu-cold; do
  [ -f "/tmp/bf-$r/report.html" ] && { cp "/tmp/bf-$r/report.html" "$OUT/report-gpu.html"; break; }
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
for f in sorted(out.glob("summary-*.json")):
    s = json.loads(f.read_text())
    t = s["timings_s"]
    rows.append((f.stem[8:], s["device"], s["workers"], t, s.get("transfers", {}), s.get("truth", {})))
stages = ["synthesize", "load", "segment", "embed", "train", "engine", "score", "report", "total"]
print("| run | device | workers | " + " | ".join(stages) + " | d2h MB | pool peak GB | Se | PPV | AUC |")
print("|---" * (len(stages) + 8) + "|")
for name, dev, w, t, tr, tru in rows:
    peak = max(tr.get("rmm_peak_bytes_per_worker") or [0]) / 2**30
    print(f"| {name} | {dev} | {w} | " + " | ".join(f"{t.get(k, float('nan')):.2f}" for k in stages)
          + f" | {tr.get('d2h_bytes', 0) / 2**20:.1f} | {peak:.2f} | {tru.get('se', 0):.4f} | {tru.get('ppv', 0):.4f} | {tru.get('auc', 0):.4f} |")
PY

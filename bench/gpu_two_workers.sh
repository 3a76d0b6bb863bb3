#!/usr/bin/env bash
# Two dask-cuda workers on the one H200 (`--gpus 0,0`: both workers see GPU 0, each with its own RMM
# pool): the partitions are spread over two GPU workers, and the result must be that of one worker.
# The several-GPU machines are not lent; this runs the multi-worker GPU code path on one device.
#   bash bench/gpu_two_workers.sh     (repository root, .whl carried; logs and a comparison under $OUT)
set -u
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
for g in 0 0,0; do
  out=/tmp/bf-gpus-${g/,/_}
  rm -rf "$out"
  t=$(date +%s)
  timeout ${RUN_LIMIT:-200} python3 -m beatflow.cli run --device gpu --hours ${HOURS:-4} --gpus $g \
      --rmm-pool-size 0.3 --out "$out" > "$OUT/log-gpus-${g/,/_}.txt" 2>&1
  echo "--gpus $g: rc=$? in $(( $(date +%s) - t )) s"
done
python3 - <<'PY'
import json, os
import numpy as np
import pandas as pd
a, b = "/tmp/bf-gpus-0", "/tmp/bf-gpus-0_0"
out = {}
sa, sb = (json.load(open(os.path.join(p, "summary.json"))) for p in (a, b))
ta, tb = (pd.read_parquet(os.path.join(p, "anomalies.parquet")) for p in (a, b))
out["workers"] = [sa["workers"], sb["workers"]]
out["partitions"] = [sa["partitions"], sb["partitions"]]
out["beats_detected"] = [sa["beats_detected"], sb["beats_detected"]]
out["same_beats"] = bool(ta[["beat", "start", "length"]].equals(tb[["beat", "start", "length"]]))
out["max_score_diff"] = float(np.abs(ta["score"].to_numpy() - tb["score"].to_numpy()).max())
out["same_flagged"] = bool((ta["flagged"] == tb["flagged"]).all())
out["timings_s"] = [sa["timings_s"], sb["timings_s"]]
out["transfers"] = [sa.get("transfers"), sb.get("transfers")]
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ["OUT"], "two_workers.json"), "w"), indent=1)
PY

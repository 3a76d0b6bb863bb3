#!/usr/bin/env bash
# One H200 call (sessions 9-11): register caps, capture probe, GPU tests, segmentation + embedding,
# MIT-BIH check, Nsight Compute, the flow on a standing cluster, the CPU flow on 16 workers, "gpuflow":
# `beatflow run --device gpu` on its own LocalCUDACluster (a cold run), and (session 11) "workers":
# bench/gpu_workers.py, the flow on WORKERS plain `dask worker` processes sharing the GPU, set up by the
# flow's GPU memory plugin, against the one-worker run. Outputs under $OUT.
# "multi": bench/gpu_multi.py, the flow on 1, 2 and all GPUs (the several-GPU issue); "oom": a pool too small
# for a partition must stop the run with one line naming the sizes. "ncudense" (session 12): Nsight Compute's
# pipes, stalls and instruction counts of the dense and embedding kernels (bench/gpu_ncu_dense.sh).
#   BUDGET=540 [STEPS="tests workers multi flow cpuwarm cpu16 gpuflow"] bash bench/gpu_session11.sh
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - t0) )); }
want() { case " ${STEPS:-maxreg capture} " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if want maxreg; then
  echo "== register caps: bench/gpu_maxreg.py ($(el))"
  timeout $(( $(left) - 20 )) python3 bench/gpu_maxreg.py 2>&1 | grep -v -i warn | tail -30
  cp bench/out/gpu_maxreg.json "$OUT/" 2>/dev/null
fi
if want capture; then
  echo "== compiled training step captured under RMM: bench/gpu_capture_probe.py ($(el))"
  VARIANTS=${CAPTURE:-"uncompiled async arena"} LIMIT=${CAPTURE_LIMIT:-110} timeout $(( $(left) - 10 )) python3 bench/gpu_capture_probe.py 2>&1 | tail -60
fi
if want tests && [ "$(left)" -gt 120 ]; then
  echo "== GPU tests ($(el))"
  timeout 260 python3 -m pytest -x -q --tb=short -p no:cacheprovider -p no:warnings ${TESTS:-tests/test_kernels.py \
    tests/test_rhythm.py tests/test_capture_arena.py tests/test_model.py} 2>&1 | tail -15
fi
if want segment && [ "$(left)" -gt 100 ]; then
  echo "== segmentation + embedding: bench/gpu_segment.py ($(el))"
  SHAPES=${SHAPES:-1} timeout 150 python3 bench/gpu_segment.py 2>&1 | grep -v -i warn | tail -24
  cp bench/out/gpu_segment.json "$OUT/" 2>/dev/null
fi
if want mitdb && [ "$(left)" -gt 80 ]; then
  echo "== MIT-BIH, detection and episodes on CuPy against NumPy ($(el))"
  timeout 120 python3 bench/gpu_mitdb_check.py 2>&1 | grep -v -i warn | tail -7
fi
if want ncu && [ "$(left)" -gt 200 ]; then
  echo "== Nsight Compute durations ($(el))"
  timeout 110 ncu --clock-control none -c 40 --section SpeedOfLight python3 bench/gpu_seg_embed.py > "$OUT/ncu.txt" 2>&1
  python3 bench/ncu_durations.py "$OUT/ncu.txt"
fi
if want ncudense && [ "$(left)" -gt 90 ]; then
  echo "== Nsight Compute, the dense and embedding kernels in detail: bench/gpu_ncu_dense.sh ($(el))"
  bash bench/gpu_ncu_dense.sh 2>&1 | tail -60
fi
if want flow && [ "$(left)" -gt 140 ]; then
  echo "== flow on a standing cluster ($(el))"
  rm -rf /tmp/bf-persistent-gpu-* /tmp/flowout; mkdir -p /tmp/flowout
  OUT=/tmp/flowout RUNS=${RUNS:-2} RUN_LIMIT=${RUN_LIMIT:-150} timeout $(( $(left) - 10 )) python3 bench/gpu_flow_persistent.py 2>&1 \
    | grep -v -i warn | tail -5
  tar czf "$OUT/flow.tgz" -C /tmp flowout 2>/dev/null
fi
if want cpuwarm && [ "$(left)" -gt 200 ]; then
  echo "== the flow on the CPU, a standing cluster of 16 workers ($(el))"
  rm -rf /tmp/bf-persistent-cpu-* /tmp/flowcpu; mkdir -p /tmp/flowcpu
  DEVICE=cpu WORKERS=16 OUT=/tmp/flowcpu RUNS=${CPU_RUNS:-3} RUN_LIMIT=${RUN_LIMIT:-150} timeout $(( $(left) - 10 )) \
    python3 bench/gpu_flow_persistent.py 2>&1 | grep -v -i warn | tail -5
  tar czf "$OUT/flow-cpu.tgz" -C /tmp flowcpu 2>/dev/null
fi
if want cpu16 && [ "$(left)" -gt 150 ]; then
  echo "== the flow on the CPU, 16 workers (bench/gpu_flow.sh) ($(el))"
  OUT=$OUT/cpu RUNS=cpu16 RUN_LIMIT=$(( $(left) - 20 )) bash bench/gpu_flow.sh 2>&1 | grep -v -i warn | tail -8
fi
if want gpuflow && [ "$(left)" -gt 150 ]; then
  echo "== the flow on its own LocalCUDACluster, cold (bench/gpu_flow.sh) ($(el))"
  OUT=$OUT/gpu RUNS=gpu-cold RUN_LIMIT=$(( $(left) - 20 )) bash bench/gpu_flow.sh 2>&1 | grep -v -i warn | tail -8
fi
if want workers && [ "$(left)" -gt 200 ]; then
  echo "== the flow on ${WORKERS:-2} plain dask workers sharing the GPU, against one worker ($(el))"
  mkdir -p "$OUT/workers"
  OUT=$OUT/workers RUN_LIMIT=${RUN_LIMIT:-200} timeout $(( $(left) - 10 )) python3 bench/gpu_workers.py 2>&1 \
    | grep -v -i "warn\|sqlalche\|database" | tail -40
fi
if want oom && [ "$(left)" -gt 120 ]; then
  echo "== a pool too small for a partition: beatflow run --device gpu --partitions 1 --rmm-pool-size 40MB ($(el))"
  rm -rf /tmp/bf-oom
  t1=$(date +%s)
  PREFECT_SERVER_ANALYTICS_ENABLED=false timeout 200 python3 -m beatflow.cli run --device gpu --hours ${OOM_HOURS:-20} \
    --partitions 1 --rmm-pool-size 40MB --out /tmp/bf-oom > "$OUT/log-oom.txt" 2>&1
  echo "rc=$? in $(( $(date +%s) - t1 )) s; last line: $(tail -1 "$OUT/log-oom.txt" | cut -c1-400)"
  echo "output folder: $(ls -d /tmp/bf-oom /tmp/.bf-oom.* 2>/dev/null || echo none)"
fi
if want multi && [ "$(left)" -gt 200 ]; then
  echo "== several GPUs: bench/gpu_multi.py (GPU sets ${GPU_SETS:-from nvidia-smi}, inputs ${INPUTS:-20 200:10}) ($(el))"
  mkdir -p "$OUT/multi"
  OUT=$OUT/multi timeout $(( $(left) - 10 )) python3 bench/gpu_multi.py 2>&1 | grep -v -i "warn\|sqlalche\|database" | tail -30
fi
echo "done ($(el))"

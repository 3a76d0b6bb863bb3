"""GPU: the flow run several times on one long-lived dask-cuda cluster (``beatflow run --scheduler``).

A fresh ``LocalCUDACluster`` per run pays worker start, imports, CUDA/cuDNN start-up, Numba kernel
compilation and the compiled training step's per-process start on every run (``bash bench/gpu.sh
ownflow``). Here one Prefect server and one cluster (one worker per GPU, RMM pool 80 %
for CuPy, Numba and PyTorch, as the flow's own cluster) stay up, and the same 20 h flow runs
``RUNS`` times against it (``--scheduler``), as on a deployment whose workers live on.

Run on the GPU machine from the repository root (``PYTHONPATH=/tmp/site:$PWD``)::

    RUNS=3 python3 bench/gpu_flow_persistent.py     # a table; all runs' summaries and logs in two files under $OUT

(``bash bench/gpu.sh flow cpuflow``; results: ``bench/results/flow.md``.) ``SWITCH=none`` (or
seconds) sets the workers' ``beatflow.model.graphs.QUEUE_SWITCH_INTERVAL`` for the runs (``none``: the
interpreter's own); ``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False`` in the environment turns the
workers' Dask profiler off (which one is on is printed): what held a worker's interpreter. ``TAG``: a suffix for
the log's and the summaries' file names. ``DEVICE=cpu WORKERS=16`` does the same for the CPU path: a standing ``LocalCluster`` of 16
single-threaded workers set up as the flow's own (``beatflow.pipeline.cluster``), and ``beatflow run --device
cpu`` against it, so that warm runs of both paths can be compared.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench", "out"))

from common import print_header, print_table  # noqa: E402


def _set_queue_switch(value):
    """On a worker: ``beatflow.model.graphs.QUEUE_SWITCH_INTERVAL`` set to ``value``; returns it."""
    from beatflow.model import graphs as model
    model.QUEUE_SWITCH_INTERVAL = value
    return value


def _profiler_on(dask_worker=None):
    """On a worker: whether Dask's statistical profiler samples its task threads."""
    return "profile" in getattr(dask_worker, "periodic_callbacks", {})


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    print_header()
    from distributed import Client
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=120)
    env = {"PREFECT_API_URL": server.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1",
           "NUMBA_CUDA_MEMORY_MANAGER": "rmm.allocators.numba", "BEATFLOW_RMM_POOL_SIZE": "0.8", "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}
    t = time.perf_counter()
    device = os.environ.get("DEVICE", "gpu")
    extra = []
    if device == "cpu":
        from distributed import LocalCluster

        from beatflow.pipeline.cluster import _configure_worker_spawn

        _configure_worker_spawn()  # as the flow's own CPU cluster
        n = int(os.environ.get("WORKERS", "16"))
        env = {k: v for k, v in env.items() if not k.startswith(("NUMBA_CUDA", "BEATFLOW_RMM"))}
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0", env=env)
        extra = ["--workers", str(n)]
        print(f"CPU workers: {n}", flush=True)
    else:
        from dask_cuda import LocalCUDACluster

        rmm_async = os.environ.get("RMM_ALLOCATOR", "async") == "async"  # as `beatflow run --rmm-allocator`
        from beatflow.pipeline.cluster import GPU_WORKER_THREADS, gpu_worker_env

        gpu_worker_env(env, 0.8)  # what the flow's own cluster gives its workers (dask-cuda drops `env`)
        threads = int(os.environ.get("THREADS", GPU_WORKER_THREADS))  # as the flow's own cluster
        cluster = LocalCUDACluster(rmm_pool_size=0.8, rmm_maximum_pool_size=0.8, rmm_async=rmm_async,
                                   rmm_allocator_external_lib_list=["cupy", "torch"], host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0", env=env, threads_per_worker=threads)
        print(f"threads per worker: {threads}", flush=True)
    client = Client(cluster)
    print(f"cluster up in {time.perf_counter() - t:.1f} s: {cluster.scheduler_address}", flush=True)
    if os.environ.get("SWITCH"):  # the queued epochs' switch interval on the workers ("none": the interpreter's)
        value = None if os.environ["SWITCH"] == "none" else float(os.environ["SWITCH"])
        print(f"queued epochs' switch interval: {client.run(_set_queue_switch, value)}", flush=True)
    print(f"workers' profiler: {client.run(_profiler_on)}", flush=True)
    rows = []
    log_path = os.path.join(OUT, f"log-persistent-{device}{os.environ.get('TAG', '')}.txt")
    if os.path.exists(log_path):
        os.remove(log_path)  # (an earlier call's)
    try:
        for r in range(1, int(os.environ.get("RUNS", "3")) + 1):
            out = f"/tmp/bf-persistent-{device}-{r}"
            shutil.rmtree(out, ignore_errors=True)  # (left by an earlier call on this machine)
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "beatflow.cli", "run", "--hours", os.environ.get("HOURS", "20"),
                   "--device", device, "--scheduler", cluster.scheduler_address, "--out", out] + extra
            if os.environ.get("EPOCHS"):  # (a shorter training, to look at the other stages on a small machine)
                cmd += ["--epochs", os.environ["EPOCHS"]]
            # one log and one file of summaries for all runs (a device call brings back only a few files)
            with open(log_path, "a") as log:
                log.write(f"\n===== run {r} =====\n")
                log.flush()
                rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=int(os.environ.get("RUN_LIMIT", "150"))).returncode
            wall = time.perf_counter() - t
            s = json.load(open(os.path.join(out, "summary.json"))) if os.path.exists(os.path.join(out, "summary.json")) else {}
            rows.append((r, rc, wall, s))
            with open(os.path.join(OUT, f"summaries-persistent-{device}{os.environ.get('TAG', '')}.json"), "w") as f:
                json.dump({str(k): {"rc": c, "wall_s": round(w, 2), "summary": v} for k, c, w, v in rows}, f, indent=1)
            t_ = s.get("timings_s", {})
            print(f"run {r}: rc={rc} wall {wall:.1f} s  " + "  ".join(f"{k} {v:.2f}" for k, v in t_.items())
                  + f"  training {s.get('training')}  engine {(s.get('engine') or {}).get('cache')}"
                  + f"  transfers {s.get('transfers')}", flush=True)
            detail = s.get("timings_detail_s", {})
            if detail:  # where the load's, training's, scoring's and the report's time went
                print(f"  load {detail.get('load')}\n  figures {detail.get('figures')}\n  report {detail.get('report')}"
                      f"\n  train {detail.get('train')}\n  score {detail.get('score')}", flush=True)
    finally:
        client.close()
        cluster.close()
        server.stop()
    stages = ["synthesize", "load", "segment", "embed", "train", "engine", "score", "report", "total"]
    table = []
    for r, rc, wall, s in rows:
        t_, tru = s.get("timings_s", {}), s.get("truth", {})
        table.append([r] + [f"{t_.get(k, float('nan')):.2f}" for k in stages]
                     + [f"{tru.get(k, 0):.4f}" for k in ("se", "ppv", "auc")])
    print_table(["run"] + stages + ["Se", "PPV", "AUC"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

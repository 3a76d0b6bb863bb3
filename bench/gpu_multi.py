"""Several GPUs of one host: the flow on 1, 2 and all GPUs, scaling efficiency and identical results.

For each GPU set (``GPU_SETS``, default ``0``, ``0,1`` and all GPUs that ``nvidia-smi -L`` lists) a
``LocalCUDACluster`` set up as the flow's own (one worker per GPU, one thread, RMM async pool 80 %
for CuPy, Numba and PyTorch) stays up, and ``beatflow run --device gpu --scheduler ...`` runs each
input ``RUNS`` times (default 2: the first compiles, the last is measured, "excluding one-time
compilation"). Per run: the stage times, bytes moved between workers (the totals of the workers'
``transfer_incoming_log``), the RMM pool peak per GPU. Per input: scaling efficiency
``T(1 GPU) / (N × T(N GPUs))`` of the measured runs, and beats, scores and flags against the one-GPU
run. ``PROTOCOL=ucx`` tries UCX (needs ``ucxx``/``distributed-ucxx``).

``INPUTS`` (default ``20 200:10``): ``H`` is the synthetic ECG of ``H`` hours (the flow's default
input, with its truth); ``H:R`` is ``R`` synthetic recordings of ``H/R`` hours each (seeds 1..R,
one PVC rate and noise level per recording) written once as a folder of WFDB records (format 16) under
``$DATA`` (default /tmp/bfm-data) and passed as ``--input``: several recordings, as a long study has.

``DEVICE=cpu`` runs the same on CPU clusters (``WORKER_SETS``, default ``1 2``: a ``LocalCluster`` of
that many single-threaded workers set up as the flow's own, ``beatflow run --device cpu``): the script
checked end to end where no several-GPU machine is lent, and the CPU cluster's own scaling.

    INPUTS="20 200:10" python3 bench/gpu_multi.py      # on the GPU machine, PYTHONPATH=/tmp/site:$PWD
    DEVICE=cpu INPUTS="2 4:2" .venv/bin/python bench/gpu_multi.py     # here

Table and ``gpu_multi.json`` under ``$OUT`` (``bash bench/gpu.sh multi``; results: ``bench/results/gpu.md``).
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
STAGES = ["synthesize", "load", "segment", "embed", "train", "engine", "score", "report", "total"]


def gpu_sets() -> list[str]:
    if os.environ.get("GPU_SETS"):
        return os.environ["GPU_SETS"].split()
    n = len([l for l in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
             if l.startswith("GPU ")])
    sets = ["0"] + (["0,1"] if n >= 2 else []) + ([",".join(map(str, range(n)))] if n > 2 else [])
    return sets


def write_records(hours: float, count: int, folder: str) -> str:
    """``count`` synthetic recordings of ``hours / count`` hours as WFDB records in ``folder`` (kept:
    written once per machine), in parallel processes."""
    from concurrent.futures import ProcessPoolExecutor

    done = os.path.join(folder, "DONE")
    if os.path.exists(done):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with ProcessPoolExecutor(max(1, min(count, (os.cpu_count() or 1) - 1))) as pool:
        list(pool.map(_write_record, [(folder, hours / count, seed) for seed in range(1, count + 1)]))
    open(done, "w").close()
    return folder


def _write_record(args) -> None:
    import numpy as np
    import wfdb

    from beatflow.io.synth import synthesize_ecg

    folder, hours, seed = args
    rng = np.random.default_rng(seed)  # recordings differ in their PVC rate and noise, as patients do
    e = synthesize_ecg(hours=hours, fs=250.0, seed=seed, pvc_rate=float(rng.uniform(0.005, 0.04)),
                       noise_mv=float(rng.uniform(0.01, 0.08)))
    wfdb.wrsamp(f"rec{seed:03d}", fs=250, units=["mV"], sig_name=["ECG"], p_signal=e.signal[:, None].astype(np.float64),
                fmt=["16"], write_dir=folder)


def input_args(spec: str) -> list[str]:
    """``beatflow run`` arguments of one ``INPUTS`` entry (``H`` or ``H:R``)."""
    if ":" not in spec:
        return ["--hours", spec]
    hours, count = spec.split(":")
    data = os.environ.get("DATA", "/tmp/bfm-data")
    t = time.perf_counter()
    folder = write_records(float(hours), int(count), os.path.join(data, f"h{hours}-r{count}"))
    print(f"input {spec}: {count} WFDB records of {float(hours) / int(count):g} h in {folder} "
          f"({time.perf_counter() - t:.1f} s)", flush=True)
    return ["--input", folder]


def cpu_cluster(n: int, env: dict):
    """A ``LocalCluster`` of ``n`` single-threaded workers, set up as the flow's own CPU cluster."""
    from distributed import LocalCluster

    from beatflow.pipeline.cluster import _configure_worker_spawn

    _configure_worker_spawn()
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                        dashboard_address="127.0.0.1:0", env=env)


def between_workers(client) -> int:
    """Bytes the workers fetched from each other so far (not what the flow's client gathered)."""
    return int(sum(client.run(lambda dask_worker: sum(e["total"] for e in dask_worker.transfer_incoming_log)).values()))


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    print_header()
    from distributed import Client
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=120)
    env = {**os.environ, "PREFECT_API_URL": server.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}
    device = os.environ.get("DEVICE", "gpu")
    inputs = os.environ.get("INPUTS", "20 200:10").split()
    runs = int(os.environ.get("RUNS", "2"))
    protocol = os.environ.get("PROTOCOL", "tcp")
    results = []
    try:
        args = {spec: input_args(spec) for spec in inputs}  # (records written before any cluster starts)
        # a set: GPUs as CUDA_VISIBLE_DEVICES lists them, or (CPU) a number of workers
        sets = gpu_sets() if device == "gpu" else os.environ.get("WORKER_SETS", "1 2").split()
        size = (lambda g: len(g.split(","))) if device == "gpu" else int
        # the same partitions on every set (results must not depend on how many workers share them)
        parts = os.environ.get("PARTITIONS") or str(2 * max(size(g) for g in sets))
        worker_env = {k: env[k] for k in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "OMP_NUM_THREADS",
                                          "PYTHONPATH")}  # what every worker gets from here
        for gpus in sets:
            t = time.perf_counter()
            n = size(gpus)
            try:
                if device == "gpu":
                    from dask_cuda import LocalCUDACluster

                    from beatflow.pipeline.cluster import GPU_WORKER_THREADS, gpu_worker_env

                    gpu_worker_env(worker_env, 0.8)
                    kw = {"protocol": protocol} if protocol != "tcp" else {"host": "127.0.0.1"}
                    cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=gpus, rmm_pool_size=0.8, rmm_maximum_pool_size=0.8,
                                               rmm_async=True, rmm_allocator_external_lib_list=["cupy", "torch"],
                                               dashboard_address="127.0.0.1:0", threads_per_worker=GPU_WORKER_THREADS,
                                               **kw)
                else:
                    cluster = cpu_cluster(n, worker_env)
            except Exception as e:
                print(f"{device} set {gpus}: cluster ({protocol}) did not start: {type(e).__name__}: {e}", flush=True)
                continue
            client = Client(cluster)
            client.wait_for_workers(n, timeout=180)
            print(f"{device} set {gpus}: {n} worker(s) up in {time.perf_counter() - t:.1f} s ({protocol})", flush=True)
            try:
                for hours in inputs:
                    for r in range(1, runs + 1):
                        name = f"{device[0]}{gpus.replace(',', '')}-h{hours.replace(':', 'r')}-r{r}"
                        out = f"/tmp/bfm-{name}"
                        shutil.rmtree(out, ignore_errors=True)
                        before = between_workers(client)
                        t = time.perf_counter()
                        cmd = [sys.executable, "-m", "beatflow.cli", "run", *args[hours], "--device", device,
                               "--scheduler", cluster.scheduler_address, "--partitions", parts, "--out", out]
                        with open(os.path.join(OUT, f"log-{name}.txt"), "w") as log:
                            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                timeout=float(os.environ.get("RUN_LIMIT", "400"))).returncode
                        wall = time.perf_counter() - t
                        moved = between_workers(client) - before
                        s = json.load(open(os.path.join(out, "summary.json"))) if rc == 0 else {}
                        if s:
                            shutil.copy(os.path.join(out, "summary.json"), os.path.join(OUT, f"summary-{name}.json"))
                        results.append({"gpus": gpus, "n": n, "hours": hours, "run": r, "rc": rc, "wall": wall,
                                        "moved_bytes": moved, "summary": s, "out": out})
                        tt = s.get("timings_s", {})
                        print(f"{name}: rc {rc}, wall {wall:.1f} s, flow {tt.get('total', float('nan')):.2f} s, "
                              f"between workers {moved / 2**20:.1f} MiB", flush=True)
            finally:
                client.close()
                cluster.close()
    finally:
        server.stop()

    measured = {(x["gpus"], x["hours"]): x for x in results if x["run"] == runs and x["summary"]}
    table = []
    import numpy as np
    import pandas as pd

    for (gpus, hours), x in measured.items():
        s, tt = x["summary"], x["summary"]["timings_s"]
        one = (measured.get(("0", hours)) or measured.get((gpus.split(",")[0], hours)) if device == "gpu"
               else measured.get(("1", hours)))
        eff = one["summary"]["timings_s"]["total"] / (x["n"] * tt["total"]) if one else float("nan")
        same, diff, flags = "-", "-", "-"
        if one and one is not x:
            a = pd.read_parquet(os.path.join(one["out"], "anomalies.parquet"))
            b = pd.read_parquet(os.path.join(x["out"], "anomalies.parquet"))
            same = len(a) == len(b) and bool((a["peak"].to_numpy() == b["peak"].to_numpy()).all())
            if same:
                diff = f"{float(np.abs(a['score'].to_numpy() - b['score'].to_numpy()).max()):.2e}"
                flags = bool((a["flagged"].to_numpy() == b["flagged"].to_numpy()).all())
        x["check"] = {"efficiency": eff, "same_beats": same, "max_score_diff": diff, "same_flags": flags}
        peaks = ", ".join(f"{v / 2**30:.2f}" for v in s.get("transfers", {}).get("rmm_peak_bytes_per_worker") or [])
        table.append([gpus, hours] + [f"{tt.get(k, float('nan')):.2f}" for k in STAGES]
                     + [f"{eff:.2f}", f"{x['moved_bytes'] / 2**20:.1f}", peaks, same, diff, flags])
    print_table(["GPUs" if device == "gpu" else "CPU workers", "input"] + STAGES
                + ["efficiency", "between workers MiB", "pool peak GB per GPU", "same beats", "max score diff",
                   "same flags"], table)
    json.dump([{k: v for k, v in x.items() if k != "summary"} | {"timings_s": x["summary"].get("timings_s")}
               for x in results], open(os.path.join(OUT, "gpu_multi.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

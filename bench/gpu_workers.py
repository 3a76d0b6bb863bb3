"""GPU: the flow on several GPU workers of an existing cluster, against the one-worker run.

One Prefect server stays up. Run ``one``: ``beatflow run --device gpu`` on its own
``LocalCUDACluster`` (one worker, dask-cuda's RMM set-up). Then a ``dask scheduler`` and ``WORKERS``
plain ``dask worker`` processes (``CUDA_VISIBLE_DEVICES=0`` each: on a one-GPU machine they share
it; no RMM and no Numba memory manager in their environment: the flow's GPU memory plugin,
``beatflow.pipeline.cluster.GPUMemorySetup``, must set them up), and ``RUNS`` runs with ``--scheduler`` on them
(``workers2-1`` first, then warm). Same input and ``--partitions`` everywhere: the beats must be
identical and the scores equal (up to training's nondeterminism on the GPU), and each worker's
summary must show CuPy, PyTorch and Numba on RMM. Prints a table; summaries and a JSON under ``$OUT``.

    HOURS=20 WORKERS=2 python3 bench/gpu_workers.py      # on the GPU machine, PYTHONPATH=/tmp/site:$PWD
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench", "out"))
HOURS = os.environ.get("HOURS", "20")
PARTS = os.environ.get("PARTITIONS", "4")
DEVICE = os.environ.get("DEVICE", "gpu")  # cpu: a dry run of this script on a machine without a GPU
STAGES = ["synthesize", "load", "segment", "embed", "train", "engine", "score", "report", "total"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, env: dict, *args) -> dict | None:
    out = f"/tmp/bfw-{name}"
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "beatflow.cli", "run", "--hours", HOURS, "--partitions", PARTS, "--device", DEVICE,
           "--out", out, *args]
    with open(os.path.join(OUT, f"log-{name}.txt"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=float(os.environ.get("RUN_LIMIT", "240"))).returncode
    wall = time.perf_counter() - t
    print(f"== {name}: rc {rc}, {wall:.1f} s", flush=True)
    if rc != 0:
        print(open(os.path.join(OUT, f"log-{name}.txt")).read()[-3000:], flush=True)
        return None
    shutil.copy(os.path.join(out, "summary.json"), os.path.join(OUT, f"summary-{name}.json"))
    return json.loads(open(os.path.join(out, "summary.json")).read())


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=120)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CUDA_MEMORY", "BEATFLOW_RMM"))}
    env = {**base, "PREFECT_API_URL": server.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}
    summaries = {}
    procs = []
    try:
        if os.environ.get("ONE", "1") == "1":
            summaries["one"] = run("one", env)
        port = free_port()
        dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        procs.append(subprocess.Popen([*dask, "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(3)
        n = int(os.environ.get("WORKERS", "2"))
        wenv = {**env, "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1"}
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                                           f"tcp://127.0.0.1:{port}", "--nthreads", "1", "--no-dashboard",
                                           "--host", "127.0.0.1"], env=wenv, cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as c:
            c.wait_for_workers(n, timeout=120)
            print("workers' environment before the run:", c.run(lambda: (os.environ.get("NUMBA_CUDA_MEMORY_MANAGER"),
                                                                       os.environ.get("CUDA_VISIBLE_DEVICES"))))
        pool = os.environ.get("POOL", f"{0.6 / n:.2f}")
        for k in range(1, int(os.environ.get("RUNS", "2")) + 1):
            summaries[f"workers{n}-{k}"] = run(f"workers{n}-{k}", env, "--scheduler", f"tcp://127.0.0.1:{port}",
                                               *(["--rmm-pool-size", pool] if DEVICE == "gpu" else []))
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()

    print("| run | workers | " + " | ".join(STAGES) + " | Se | PPV | AUC | d2h MB | pool peak GB per worker |")
    print("|---" * (len(STAGES) + 7) + "|")
    for name, s in summaries.items():
        if not s:
            continue
        t, tr, tru = s["timings_s"], s.get("transfers", {}), s.get("truth", {})
        peaks = ", ".join(f"{b / 2**30:.2f}" for b in tr.get("rmm_peak_bytes_per_worker") or [])
        print(f"| {name} | {s['workers']} | " + " | ".join(f"{t.get(k, float('nan')):.2f}" for k in STAGES)
              + f" | {tru.get('se', 0):.4f} | {tru.get('ppv', 0):.4f} | {tru.get('auc', 0):.4f}"
              + f" | {tr.get('d2h_bytes', 0) / 2**20:.1f} | {peaks} |")
    for name, s in summaries.items():
        if s:
            print(f"{name}: GPU workers' memory:", json.dumps(s.get("gpu_workers", {})))
    import numpy as np
    import pandas as pd

    check = {}
    ref = "one" if summaries.get("one") else None
    frames = {name: pd.read_parquet(f"/tmp/bfw-{name}/anomalies.parquet") for name, s in summaries.items() if s}
    if ref:
        a = frames[ref]
        for name, b in frames.items():
            if name == ref:
                continue
            same_beats = len(a) == len(b) and bool((a["peak"].to_numpy() == b["peak"].to_numpy()).all())
            row = {"beats": [len(a), len(b)], "same_beats": same_beats}
            if same_beats:
                d = np.abs(a["score"].to_numpy() - b["score"].to_numpy())
                row.update(max_abs_score_diff=float(d.max()),
                           max_rel_score_diff=float((d / np.maximum(np.abs(a["score"].to_numpy()), 1e-12)).max()),
                           same_flagged=bool((a["flagged"].to_numpy() == b["flagged"].to_numpy()).all()),
                           flagged=[int(a["flagged"].sum()), int(b["flagged"].sum())],
                           flagged_differ=int((a["flagged"].to_numpy() != b["flagged"].to_numpy()).sum()))
            check[f"{ref} vs {name}"] = row
            print(f"{ref} vs {name}:", json.dumps(row))
    json.dump({"summaries": summaries, "check": check}, open(os.path.join(OUT, "gpu_workers.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

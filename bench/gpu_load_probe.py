"""Where the load stage's time goes between the flow and its workers (session 26).

On the GPU hosts ``timings_detail_s.load.partitions`` (dispatch of the reads until every partition is
on its worker) took 0.21-0.35 s for the 20 h stream while, measured on the worker, the reads took
10-12 ms and the copies to the GPU 6.5-8 ms (session 25, H100): most of it was not the work. This
probe runs the load's own calls (``beatflow.pipeline.stages.load_stashed`` then ``partition_edges``, through
``beatflow.pipeline.stages.map_partitions`` and ``wait_partitions``, as the ``load`` task does) ``RUNS`` times
against a standing cluster set up as the flow's own, with Dask's task stream on, and splits each
load into:

* ``to_start``: from the call to ``map_partitions`` until the first read starts on a worker
  (submission, the scheduler, the worker's receipt and its thread);
* ``compute``: from the first read's start to the last read's end (the worker's own time);
* ``to_flow``: from the last read's end until ``wait_partitions`` returns in the flow's process;
* ``edges``: the edges' round trip, as in the flow.

The first load of the probe's process is shown apart (``first``): its Dask client unpickles the
type of each result a worker holds, and the partitions' type (a CuPy array on the GPU path) imports
CuPy here unless it was imported before (``PRELOAD=1``: in the background from the start, as
``beatflow run --device gpu`` does). Beside it, an empty call's round trip (``noop``) on the same cluster, one that makes a 4 MB array on
the worker's device (``zeros``), and the same load with the
previous load's partitions still held (``held``: as in a flow, where nothing is released mid-run).

    DEVICE=gpu RUNS=10 [PRELOAD=1] python3 bench/gpu_load_probe.py        # on the GPU machine
    DEVICE=cpu WORKERS=2 RUNS=5 HOURS=2 python3 bench/gpu_load_probe.py   # this machine
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _noop(x):
    return x


def _zeros(i, device):
    """A 4 MB array on the partition's device (what an empty read would hand back)."""
    from beatflow.device import namespace

    return namespace(device).zeros(1 << 20, dtype="float32")


def _store(dask_worker):
    return type(dask_worker.data).__name__


def main() -> int:
    from distributed import Client, get_task_stream, wait

    from beatflow.io.sources import NpySource, Recording
    from beatflow.io.synth import synthesize_cached
    import beatflow.pipeline.stages as S

    device = os.environ.get("DEVICE", "gpu")
    if os.environ.get("PRELOAD") == "1":  # as `beatflow run --device gpu` does (beatflow.device)
        from beatflow.device import import_in_background

        import_in_background("cupy")
    hours = float(os.environ.get("HOURS", "20"))
    runs = int(os.environ.get("RUNS", "10"))
    tmp = tempfile.mkdtemp(prefix="bf-probe-")
    t = time.perf_counter()
    path = os.path.join(tmp, "ecg.npy")
    synthesize_cached(path, os.path.join(tmp, "truth.npz"), hours=hours)
    import numpy as np

    n = np.load(path, mmap_mode="r").shape[0]
    source = NpySource(path, (Recording("synthetic", 250.0, n),))
    print(f"stream: {n:,} samples ({time.perf_counter() - t:.1f} s to make)", flush=True)

    t = time.perf_counter()
    if device == "cpu":
        from distributed import LocalCluster

        from beatflow.pipeline.cluster import _configure_worker_spawn

        _configure_worker_spawn()
        workers = int(os.environ.get("WORKERS", "2"))
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0")
    else:
        from dask_cuda import LocalCUDACluster

        from beatflow.pipeline.cluster import GPU_WORKER_THREADS, gpu_worker_env

        env = gpu_worker_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}, 0.8)
        cluster = LocalCUDACluster(rmm_pool_size=0.8, rmm_maximum_pool_size=0.8, rmm_async=True,
                                   rmm_allocator_external_lib_list=["cupy", "torch"], host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0", env=env, threads_per_worker=GPU_WORKER_THREADS)
        workers = len(cluster.workers)
    client = Client(cluster)
    S._client = lambda: client  # the probe is its own flow: the stages' calls go to this client
    print(f"cluster: {workers} worker(s), up in {time.perf_counter() - t:.1f} s", flush=True)
    specs = source.plan(2 * max(1, workers))
    print(f"workers' data stores: {sorted(set(client.run(_store).values()))}", flush=True)

    def load_once():
        stash = [f"probe-{time.perf_counter_ns()}-{k}" for k in range(len(specs))]
        with get_task_stream(client) as ts:
            t0 = time.time()
            parts = S.map_partitions(S.load_stashed, list(specs), stash, name="load-partition", source=source,
                                     device=device, run_id=None)
            S.wait_partitions(parts)
            t1 = time.time()
            edges = S.gather(S.map_partitions(S.partition_edges, parts, stash, name="partition-edges", halo=250))
            t2 = time.time()
        reads = [s for d in ts.data if d["key"].startswith("load-partition")
                 for s in d["startstops"] if s["action"] == "compute"]
        first, last = min(s["start"] for s in reads), max(s["stop"] for s in reads)
        phases = [e[3] for e in edges]
        return parts, {"total": t1 - t0, "to_start": first - t0, "compute": last - first, "to_flow": t1 - last,
                       "edges": t2 - t1, "read_max": max(p["read"] for p in phases),
                       "to_device_max": max(p["to_device"] for p in phases)}

    rows = {"first": [], "fresh": [], "held": []}
    noop, zeros = [], []
    for r in range(runs + 1):
        if not r:
            had = "cupy" in sys.modules
            parts, row = load_once()  # this process's first: its client meets the partitions' type now
            rows["first"].append(row)
            print(f"first load: CuPy imported in this process before it: {had}, after it: {'cupy' in sys.modules}",
                  flush=True)
        else:
            parts, row = load_once()  # the earlier load's partitions released before this one
            rows["fresh"].append(row)
        t0 = time.perf_counter()
        wait(client.map(_noop, range(len(specs)), pure=False))
        noop.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        z = client.map(_zeros, range(len(specs)), device=device, pure=False)
        wait(z)
        zeros.append(time.perf_counter() - t0)
        del z
        held, row = load_once()  # this one with `parts` still held
        if r:
            rows["held"].append(row)
        del parts, held
    cols = ["total", "to_start", "compute", "to_flow", "edges", "read_max", "to_device_max"]
    print(f"\nload of {len(specs)} partitions, {runs} runs after a first one, medians (min-max) in ms; "
          f"an empty map of {len(specs)}: {1e3 * statistics.median(noop[1:]):.1f} ms, "
          f"one of 4 MB device arrays: {1e3 * statistics.median(zeros[1:]):.1f} ms")
    print("| case | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for case, rs in rows.items():
        print(f"| {case} | " + " | ".join(
            f"{1e3 * statistics.median(x[c] for x in rs):.1f} ({1e3 * min(x[c] for x in rs):.1f}-"
            f"{1e3 * max(x[c] for x in rs):.1f})" for c in cols) + " |")  # (one row for "first")
    client.close()
    cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two GPU questions the flow's timings raised, answered on the H200 in one short call.

1. Where do the 40 s of an AOTInductor engine-cache *hit* go in a fresh worker process?
   (build once here; then, in a fresh subprocess, time the imports, CUDA start and the hit itself,
   and a second hit in the same process)
2. Does the RMM statistics adaptor see a Dask-CUDA worker's allocations (peak pool use)?

    bash .whl/install.sh && export PYTHONPATH=/tmp/site:$PWD && python bench/gpu_probe.py

Prints JSON lines; writes them to $OUT/gpu_probe.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT", "bench/out")


def hit_in_fresh_process(model_path: str, val_path: str, cache: str) -> dict:
    code = f"""
import json, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import torch._inductor; t2 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
import numpy as np
from beatflow.engine.cache import build_or_load_engine
val = np.load({val_path!r})
t4 = time.perf_counter()
eng, info = build_or_load_engine({model_path!r}, val, backend="aoti", device="cuda", cache_dir={cache!r})
t5 = time.perf_counter()
eng2, info2 = build_or_load_engine({model_path!r}, val, backend="aoti", device="cuda", cache_dir={cache!r})
t6 = time.perf_counter()
print(json.dumps({{"import_torch_s": t1 - t0, "import_inductor_s": t2 - t1, "cuda_start_s": t3 - t2,
                   "first_hit_s": t5 - t4, "first_hit_status": info["cache"], "second_hit_s": t6 - t5,
                   "throughput": info["throughput_beats_per_s"]}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def rmm_peak_on_worker() -> dict:
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from beatflow.device import track_rmm_statistics, transfer_stats

    def allocate():
        import cupy
        import torch

        a = cupy.ones(64 * 2**20 // 4, dtype=cupy.float32)  # 64 MiB through CuPy
        b = torch.ones(32 * 2**20 // 4, device="cuda")  # 32 MiB through PyTorch
        return float(a.sum()) + float(b.sum())

    with LocalCUDACluster(rmm_pool_size=0.05, rmm_allocator_external_lib_list=["cupy", "torch"],
                          dashboard_address=None) as cluster, Client(cluster) as client:
        tracked = client.run(track_rmm_statistics)
        client.submit(allocate, pure=False).result()
        in_task = client.submit(lambda: (track_rmm_statistics(), transfer_stats()), pure=False).result()
        return {"tracked": list(tracked.values()), "stats_via_run": list(client.run(transfer_stats).values()),
                "stats_in_task": in_task[1]}


def main() -> int:
    import numpy as np

    from beatflow.engine.cache import build_or_load_engine
    from beatflow.model.vae import LightVAE, save_model

    res = {}
    work = tempfile.mkdtemp()
    model = LightVAE(256)
    model_path = os.path.join(work, "model.pt")
    save_model(model, model_path)
    val = (np.random.default_rng(0).normal(size=(4096, 256)) * 0.3).astype(np.float32)
    val_path = os.path.join(work, "val.npy")
    np.save(val_path, val)
    cache = os.path.join(work, "cache")
    t = time.perf_counter()
    _, info = build_or_load_engine(model_path, val, backend="aoti", device="cuda", cache_dir=cache)
    res["build"] = {"seconds": time.perf_counter() - t, "status": info["cache"]}
    print(json.dumps(res["build"]), flush=True)
    res["hit_fresh_process"] = hit_in_fresh_process(model_path, val_path, cache)
    print(json.dumps(res["hit_fresh_process"]), flush=True)
    try:
        res["rmm"] = rmm_peak_on_worker()
    except Exception as e:  # report, do not hide
        res["rmm"] = {"error": f"{e.__class__.__name__}: {e}"}
    print(json.dumps(res["rmm"], default=str), flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_probe.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a fresh GPU worker pays for the engine stage on an engine-cache hit, and what a warm-up at the
worker's start takes off it.

Each variant runs in a fresh process, as a new ``LocalCUDACluster`` worker does: RMM set up first
(:func:`beatflow.device.setup_gpu_memory`), then ``build_or_load_engine`` of one model on 4096 validation
rows (the flow's ``validation_beats.npy`` size). The first process builds the entry (and fills Inductor's
disk caches); the others hit it.

- ``hit``: the engine call alone, cold process (what the flow's second run pays);
- ``warmed``: :func:`beatflow.engine.cache.warm_gpu_engine` first (a worker's start does it in a thread, beside
  the first stages), then the engine call.

    python bench/gpu_engine_start.py [--runs 2]      # -> a table; $OUT/engine_start.json

(``bash bench/gpu.sh enginestart``; results: ``bench/results/gpu.md``.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


def child(variant: str, folder: str) -> dict:
    t0 = time.perf_counter()
    from beatflow.device import setup_gpu_memory

    setup_gpu_memory(0.5)
    out = {"variant": variant, "rmm_s": time.perf_counter() - t0}
    if variant == "probes":
        from beatflow.engine import options

        for name in ("tensorrt_available", "compiled_available", "aoti_available", "_ort_has_cuda"):
            t = time.perf_counter()
            fn = getattr(options, name)
            out[name] = [fn() if name in ("tensorrt_available", "_ort_has_cuda") else fn("cuda"),
                         time.perf_counter() - t]
        return {**out, "import_s": 0.0, "engine_s": 0.0, "cache": "-", "backend": "-", "phases": {}}
    if variant == "imports":
        t = time.perf_counter()
        from beatflow.engine.cache import warm_gpu_engine

        out["warm_phases"] = warm_gpu_engine(compile=False)
        out["warm_s"] = time.perf_counter() - t
    if variant == "warmed":
        t = time.perf_counter()
        from beatflow.engine.cache import warm_gpu_engine

        out["warm_phases"] = warm_gpu_engine()
        out["warm_s"] = time.perf_counter() - t
    import numpy as np

    t = time.perf_counter()
    from beatflow.engine.cache import build_or_load_engine

    out["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _, info = build_or_load_engine(os.path.join(folder, "model.pt"), np.load(os.path.join(folder, "val.npy")),
                                   device="gpu", cache_dir=os.path.join(folder, "engines"))
    out["engine_s"] = time.perf_counter() - t
    out.update(cache=info["cache"], backend=info["backend"], phases=info["phases_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(*a.child)), flush=True)
        return
    print("| variant | cache | backend | warm s | import s | engine call s | validate s | process s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    import numpy as np
    import torch

    from beatflow.model.vae import LightVAE, save_model

    folder = tempfile.mkdtemp(prefix="bf-engine-start-")
    torch.manual_seed(0)
    save_model(LightVAE(256), os.path.join(folder, "model.pt"))
    np.save(os.path.join(folder, "val.npy"), np.random.default_rng(0).normal(0, 0.2, (4096, 256)).astype(np.float32))
    rows = []
    for variant in ["build", "probes"] + ["hit", "imports", "warmed"] * a.runs:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", "hit" if variant == "build" else variant, folder],
                           capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t
        res = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
        if res is None:
            print(p.stdout[-2000:], p.stderr[-3000:])
            continue
        res.update(variant=variant, process_s=wall)
        rows.append(res)
        if variant == "probes":
            print("probes:", {k: v for k, v in res.items() if isinstance(v, list)}, flush=True)
            continue
        ph = res["phases"]
        print(f"| {variant} | {res['cache']} | {res['backend']} | {res.get('warm_s', 0):.2f} | {res['import_s']:.2f} | "
              f"{res['engine_s']:.2f} | {ph.get('validate', 0):.2f} | {wall:.1f} |", flush=True)
    out = os.environ.get("OUT", os.path.join(ROOT, "bench", "out"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "engine_start.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""GPU: the product's CUDA-graph paths, timed through their public entry points.

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``; a plain process, so PyTorch
keeps its own allocator and graphs are on by default)::

    python bench/gpu_graphs.py        # gpu_graphs.json under $OUT (or bench/out), a table on stdout

(a) the ``compiled`` engine (:class:`beatflow.engine.compiled.CompiledEngine`) in fp32 and fp16,
    with CUDA graphs (the default here) and without: :func:`beatflow.engine.base.profile_engine`
    (batch-1 latency p50/p99 with CUDA events, throughput by batch), and the largest score
    difference between the two;
(b) ``train_vae`` on the pipeline's ~97 k residual rows (10 epochs, batch 1024): launched steps
    (compiled, as the flow's RMM workers run them) against CUDA graphs of eager and of compiled
    steps, each run twice (the second with warm caches); seconds and final test loss.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.environ.get("OUT", "bench/out")
RES: dict = {"errors": {}}


def save():
    with open(os.path.join(OUT, "gpu_graphs.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def section(name, fn):
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        RES[name] = fn()
    except Exception:
        RES["errors"][name] = traceback.format_exc()[-2500:]
        print(RES["errors"][name], flush=True)
    print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
    save()


def rows():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_fused import beats_matrix

    return beats_matrix()


def engines(x):
    import torch

    from beatflow.engine.base import profile_engine
    from beatflow.engine.compiled import CompiledEngine
    from beatflow.model.vae import Scorer, train_vae

    vae = train_vae(x[:20000], epochs=2, device="cuda").model
    out = {}
    for prec in ("fp32", "fp16"):
        ref = None
        for graphs in (True, False):
            name = f"compiled {prec} {'graphs' if graphs else 'no graphs'}"
            t = time.perf_counter()
            eng = CompiledEngine.build(Scorer(vae), os.path.join(tempfile.mkdtemp(), "e.pt"), precision=prec,
                                       cudagraphs=None if graphs else False)
            assert eng.cudagraphs == graphs
            build = time.perf_counter() - t
            s, _ = eng.infer(torch.from_numpy(x[:5000]).cuda())
            ref = s if ref is None else ref
            prof = profile_engine(eng, x[:8192], latency_calls=2000)
            out[name] = {"build_s": round(build, 1), "max_abs_diff_vs_graphs": float((s - ref).abs().max()), **prof}
            lat = prof["latency_batch1_us"]
            print(f"   {name:28s} p50 {lat['p50']:6.1f} us  p99 {lat['p99']:6.1f} us  "
                  + "  ".join(f"b{b}: {v / 1e6:.2f} M/s" for b, v in prof["throughput_beats_per_s"].items()),
                  flush=True)
    return out


def training(x):
    import torch

    from beatflow.model.vae import train_vae

    data = torch.from_numpy(x).cuda()
    out = {}
    for name, compile, graphs in (("eager + CUDA graphs", False, True), ("eager + CUDA graphs (again)", False, True),
                                  ("compiled, launched (flow workers)", True, False),
                                  ("compiled + CUDA graphs", True, True), ("compiled + CUDA graphs (again)", True, True)):
        torch.cuda.synchronize()
        r = train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", compile=compile, cudagraphs=graphs)
        out[name] = {"seconds": round(r.seconds, 3), "test_loss": r.test_loss, "cudagraphs": r.cudagraphs,
                     "train_loss_last": r.train_loss[-1]}
        print(f"   {name:34s} {r.seconds:7.2f} s  test loss {r.test_loss:.5f}  graphs {r.cudagraphs}", flush=True)
    ref = out["compiled, launched (flow workers)"]["test_loss"]
    for v in out.values():
        v["test_loss_vs_launched"] = v["test_loss"] / ref - 1
    out["rows"] = int(x.shape[0])
    return out


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    x = rows()
    RES["rows"] = int(x.shape[0])
    section("engines", lambda: engines(x))
    section("training", lambda: training(x))

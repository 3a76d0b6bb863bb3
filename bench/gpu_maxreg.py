"""GPU: register caps of the heavy kernels (``kernels._maxreg``), each variant in a fresh process.

The dense detection kernel uses 72 registers at 256 threads a block (3 blocks, 37 % occupancy on an
H100/H200 SM), ``vf_energy`` 117 at 128 threads; a cap lets more blocks run per SM at the price of
spills. Each variant checks that the peaks and the rows equal the first variant's (exactly), then
times (CUDA events, ``cupyx.profiler.benchmark``, median of 30): the dense kernel with the envelope
written (``qrs_envelope_gpu``), the detection with the flutter rule, ``embed_gpu`` and segmentation +
embedding. Run on the GPU machine from the repository root::

    python3 bench/gpu_maxreg.py                       # the default list of variants
    VARIANTS="none;default;dense=48" python3 bench/gpu_maxreg.py
    VARIANTS="default;tpb=256,dense=40" python3 bench/gpu_maxreg.py   # with another launch shape
    VARIANTS="default;ch=7/11/11/9,dense=64;rl=2" python3 bench/gpu_maxreg.py   # the dense kernel's chunks
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.environ.get("OUT", "bench/out")
CACHE = "/tmp/beatflow_maxreg"
DEFAULT = ("none;dense=64,embed_warp=56;dense=56,embed_warp=48;dense=48,vf_energy=96;dense=40,vf_energy=64;"
           "cand_eval=48,vf_energy=80")


def child(spec: str):
    import cupy
    import numpy as np
    from cupyx.profiler import benchmark

    from beatflow.gpu import kernels as K
    from gpu_seg_embed import kept_bounds, setup

    for item in spec.split(","):  # "tpb=128" / "tile=2048": the detection's launch shape; "ch=11/11/11/9":
        # the dense kernel's chunk lengths (kernels._DENSE_CHUNKS); "rl=3": its register levels (_REG_LEVELS)
        if item.startswith(("tpb=", "tile=")):
            name, value = item.split("=")
            setattr(K, "_DET_TPB" if name == "tpb" else "_DET_TILE", int(value))
        elif item.startswith("ch="):
            K._DENSE_CHUNKS = tuple(int(v) for v in item[3:].split("/"))
        elif item.startswith("rl="):
            K._REG_LEVELS = int(item[3:])
        elif item.startswith("vs="):  # vf_energy's slopes per register window (kernels._VF_SUB)
            K._VF_SUB = int(item[3:])
    s, x, xg, seg_embed = setup(cache=os.path.join(CACHE, "x.npy"))
    t = time.perf_counter()
    peaks = K.detect_beats_gpu(xg, s)[0]
    rows, _ = seg_embed()
    cupy.cuda.Device().synchronize()
    first = time.perf_counter() - t
    peaks_h, rows_h = cupy.asnumpy(peaks), cupy.asnumpy(rows)
    ref = os.path.join(CACHE, "ref.npz")
    if not os.path.exists(ref):
        np.savez(ref, peaks=peaks_h, rows=rows_h)
        same = True
    else:
        r = np.load(ref)
        same = bool(np.array_equal(r["peaks"], peaks_h) and np.array_equal(r["rows"], rows_h))
    start, length = kept_bounds(peaks, s, xg.shape[0])
    base = max(1, s.pre // 2)
    out = {"variant": spec, "same_as_first": same, "first_call_s": round(first, 2), "peaks": int(peaks.shape[0])}
    for name, fn in (("dense_env", lambda: K.qrs_envelope_gpu(xg, s)),
                     ("detect_rule", lambda: K.detect_beats_gpu(xg, s)),
                     ("embed", lambda: K.embed_gpu(xg, start, length, s.width, baseline_samples=base)),
                     ("seg_embed", seg_embed)):
        r = benchmark(fn, (), n_repeat=30, n_warmup=3)
        out[name] = round(float(np.median(r.gpu_times[0])) * 1e3, 3)
    print("RESULT " + json.dumps(out), flush=True)


def main():
    os.makedirs(CACHE, exist_ok=True)
    os.makedirs(OUT, exist_ok=True)
    for f in ("ref.npz",):
        if os.path.exists(os.path.join(CACHE, f)):
            os.remove(os.path.join(CACHE, f))
    rows = []
    for spec in os.environ.get("VARIANTS", DEFAULT).split(";"):
        # "none": no cap at all; "default": kernels._MAXREG_DEFAULT; else those caps over the defaults
        none = "dense=0,embed_warp=0,vf_energy=0,cand_eval=0,vf_near=0"
        caps = ",".join(i for i in spec.split(",") if not i.startswith(("tpb=", "tile=", "ch=", "rl=", "vs=")))
        env = {**os.environ, "BEATFLOW_MAXREG": none if spec == "none" else "" if spec == "default" else caps}
        try:
            p = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True,
                               timeout=float(os.environ.get("LIMIT", "90")))
            got = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not got:
                print(f"{spec}: failed\n{(p.stdout + p.stderr)[-1500:]}", flush=True)
                continue
            rows.append(json.loads(got[0]))
        except subprocess.TimeoutExpired:
            print(f"{spec}: timed out", flush=True)
            continue
        r = rows[-1]
        print(f"{r['variant']:18s} same {str(r['same_as_first']):5s} dense+env {r['dense_env']:7.3f}  detect+rule "
              f"{r['detect_rule']:7.3f}  embed {r['embed']:7.3f}  seg+embed {r['seg_embed']:7.3f} ms", flush=True)
        with open(os.path.join(OUT, "gpu_maxreg.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child(sys.argv[2]) if "--child" in sys.argv else main()

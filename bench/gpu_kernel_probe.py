"""GPU: why the detection kernels take milliseconds — per-kernel times, resources, Nsight Compute.

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python bench/gpu_kernel_probe.py            # times and kernel resources, probe.json under $OUT
    python bench/gpu_kernel_probe.py --ncu      # one launch of each kernel (for ncu -k regex:...)

Data: the 20 h synthetic ECG (250 Hz, 18 M samples, float32) on the device. Each kernel is timed
alone with CUDA events around 20 launches (median), next to a plain copy kernel that shows what the
memory system allows, so that the difference is the kernel's own.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

OUT = os.environ.get("OUT", "bench/out")


def main():
    import cupy
    from numba import cuda

    from beatflow.gpu import kernels as K
    from beatflow.detect import peaks as S
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    ncu = "--ncu" in sys.argv
    os.makedirs(OUT, exist_ok=True)
    s = SegmentParams().samples(250.0)
    x = synthesize_ecg(hours=20, fs=250.0, seed=0).signal
    xg = cupy.asarray(x)
    n = int(xg.shape[0])
    kernels, _ = K._build()

    @cuda.jit
    def copy(a, b):
        for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
            b[i] = a[i]

    y = cupy.empty_like(xg)
    stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    args = {}

    def run_copy():
        copy[-(-n // 256), 256, stream](cuda.as_cuda_array(xg), cuda.as_cuda_array(y))

    env = K.qrs_envelope_gpu(xg, s)
    x64 = xg.astype(cupy.float64)
    kr = cupy.asarray(S.gaussian_derivative(s.kernel, s.a)[::-1].copy())
    box = int(s.box)
    g = max(1, int(np.sqrt(box)))
    gate = cupy.empty(n, dtype=cupy.uint8)

    def env_launch(xx, tpb=256):
        out = cupy.empty(n, dtype=cupy.float64)
        shared = (2 * tpb + 4 * (box // 2) + 2 * (int(s.kernel) // 2)) * 8
        kernels["envelope_tiled"][-(-n // tpb), tpb, stream, shared](
            cuda.as_cuda_array(xx), cuda.as_cuda_array(kr), box, g, box // g, cuda.as_cuda_array(out))
        return out

    def nms_launch():
        tpb = 256
        kernels["nms_tiled"][-(-n // tpb), tpb, stream, (tpb + 2 * s.nms) * 8](
            cuda.as_cuda_array(env), s.nms, cuda.as_cuda_array(gate))

    cases = {
        "copy f32 (memory baseline)": run_copy,
        "envelope_tiled f32 in, tpb 256": lambda: env_launch(xg),
        "envelope_tiled f64 in, tpb 256": lambda: env_launch(x64),
        "envelope_tiled f32 in, tpb 128": lambda: env_launch(xg, 128),
        "envelope_tiled f32 in, tpb 1024": lambda: env_launch(xg, 1024),
        "nms_tiled": nms_launch,
        "cupy.flatnonzero(gate)": lambda: cupy.flatnonzero(gate),
        "qrs_envelope_gpu (wrapper)": lambda: K.qrs_envelope_gpu(xg, s),
        "local_maxima_gpu (wrapper)": lambda: K.local_maxima_gpu(env, s.nms),
        "detect_peaks_gpu": lambda: K.detect_peaks_gpu(xg, s),
    }
    for f in cases.values():  # compile
        f()
    cupy.cuda.Device().synchronize()
    if ncu:
        for f in cases.values():
            f()
        cupy.cuda.Device().synchronize()
        return
    res = {"n": n, "ms": {}, "resources": {}}
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
    for name, f in cases.items():
        ts = []
        for _ in range(20):
            ev0.record()
            f()
            ev1.record()
            ev1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(ev0, ev1))
        res["ms"][name] = round(float(np.median(ts)), 4)
        print(f"{name:45s} {res['ms'][name]:9.4f} ms", flush=True)
    for name, k in list(kernels.items()) + [("copy", copy)]:
        try:
            for sig, ov in k.overloads.items():
                res["resources"][f"{name}{sig}"] = {"regs": ov.get_regs_per_thread(),
                                                    "local_bytes": ov.get_local_mem_per_thread(),
                                                    "shared_static": ov.get_shared_mem_per_block(),
                                                    "max_threads": ov.get_max_threads_per_block()}
        except Exception as e:
            res["resources"][name] = repr(e)
    print(json.dumps(res["resources"], indent=1), flush=True)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

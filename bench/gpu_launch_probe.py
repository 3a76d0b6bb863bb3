"""GPU: where the time of segmentation + embedding goes between the kernels (host side).

Times every ``kernels._Ctx.launch`` on the host (argument conversion + Numba dispatch + enqueue)
and every CuPy step of the beat bounds, for one warm ``detect_peaks_gpu`` + bounds + ``embed_gpu``
on the 20 h stream; prints a table (host µs per launch) and the GPU time of the whole step.
Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``).
"""
from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import cupy

    from gpu_seg_embed import setup

    from beatflow.gpu import kernels as K
    _, _, _, seg_embed = setup()

    for _ in range(3):
        seg_embed()
    cupy.cuda.Device().synchronize()
    rec = collections.defaultdict(list)
    orig = K._Ctx.launch

    def timed(self, kernel, *a):
        t = time.perf_counter()
        orig(self, kernel, *a)
        rec[getattr(kernel, "__name__", str(kernel))].append(time.perf_counter() - t)

    K._Ctx.launch = timed
    walls = []
    for _ in range(10):
        t = time.perf_counter()
        seg_embed()
        cupy.cuda.Device().synchronize()
        walls.append(time.perf_counter() - t)
    K._Ctx.launch = orig
    tot = 0.0
    print(f"{'kernel':24s} {'launches/call':>13s} {'host µs each (median)':>22s}")
    for k, v in rec.items():
        v = sorted(v)
        med = v[len(v) // 2]
        per_call = len(v) / 10
        tot += med * per_call
        print(f"{k:24s} {per_call:13.1f} {med * 1e6:22.1f}")
    walls.sort()
    print(f"host time in launches per call: {tot * 1e3:.3f} ms; wall per seg+embed (synchronised): "
          f"{walls[5] * 1e3:.3f} ms")
    print(f"fast launches registered: {sum(v is not None for v in K._FastLaunch._cache.values())} of "
          f"{len(K._FastLaunch._cache)}; errors: {K._FastLaunch.errors}")
    # the same with a Numba device-array cache: how much is argument conversion
    from numba import cuda
    a = cupy.zeros(10, dtype=cupy.float64)
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        cuda.as_cuda_array(a, sync=False)
    print(f"cuda.as_cuda_array: {(time.perf_counter() - t) / n * 1e6:.1f} µs per array")


if __name__ == "__main__":
    main()

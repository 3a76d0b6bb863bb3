"""GPU: what bounds the warp-per-beat embedding kernel (20 h stream, ~97 k beats of 256 samples)?

Times, with CUDA events (median of 20 launches): ``embed_gpu`` with 1, 2, 4 and 8 rows per claim
(the warp's first lane claims rows in order with an atomic add on one counter; 1 is the seed's one
claim per beat), the same body with the row taken as the beat's index (one warp per beat, no
atomic: what the counter costs), and a plain copy of the same bytes (the memory-bandwidth floor). Run on the GPU machine (``PYTHONPATH=$PWD``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402


def main():
    import cupy
    from numba import cuda

    from gpu_seg_embed import setup

    from beatflow.embed import beats as B
    from beatflow.gpu import kernels as K
    s, _, xg, _ = setup()
    peaks = K.detect_peaks_gpu(xg, s)
    _, start, length = B.beats_from_peaks(peaks, s, xg.shape[0])
    k = cupy.flatnonzero(B.kept_mask(length, s))
    st, ln = start[k], B.row_lengths(length[k], s)
    n, width = int(st.shape[0]), s.width
    rows = cupy.empty((n, width), cupy.float32)
    p2p = cupy.empty(n, cupy.float32)

    @cuda.jit
    def embed_rows_by_index(x, start, length, width, baseline, rows, p2p):
        lane = cuda.threadIdx.x % 32
        warp = cuda.grid(1) // 32
        if warp >= start.shape[0]:
            return
        ln = length[warp]
        s0 = start[warp]
        nx = x.shape[0]
        acc = np.float32(0.0)
        for j in range(lane, baseline, 32):
            acc += x[min(max(s0 + j, 0), nx - 1)]
        off = 16
        while off > 0:
            acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)
            off //= 2
        base = acc / baseline
        lo, hi = np.float32(np.inf), np.float32(-np.inf)
        for j in range(lane, width, 32):
            v = np.float32(0.0)
            if j < ln:
                v = x[min(max(s0 + j, 0), nx - 1)] - base
                lo, hi = min(lo, v), max(hi, v)
            rows[warp, j] = v
        off = 16
        while off > 0:
            lo = min(lo, cuda.shfl_down_sync(0xFFFFFFFF, lo, off))
            hi = max(hi, cuda.shfl_down_sync(0xFFFFFFFF, hi, off))
            off //= 2
        if lane == 0:
            p2p[warp] = hi - lo

    def timed(fn, reps=20):
        fn()
        cupy.cuda.Device().synchronize()
        ts = []
        for _ in range(reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
        return float(np.median(ts))

    blocks = -(-n // K._EMBED_WARPS)

    stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    nx, nst, nln, nrows, np2p = (cuda.as_cuda_array(a) for a in (xg, st, ln, rows, p2p))

    def by_index():
        embed_rows_by_index[blocks, K._EMBED_WARPS * 32, stream](nx, nst, nln, width, 12, nrows, np2p)

    dst = cupy.empty_like(rows)
    print(f"beats {n}, row bytes {rows.nbytes / 1e6:.1f} MB")
    want = K.embed_gpu(xg, st, ln, width, baseline_samples=12, claim=1)[0]
    for k in (1, 2, 4, 8):
        same = bool(cupy.array_equal(K.embed_gpu(xg, st, ln, width, baseline_samples=12, claim=k)[0], want))
        t = timed(lambda k=k: K.embed_gpu(xg, st, ln, width, baseline_samples=12, claim=k))
        print(f"embed_gpu, {k} row(s) per claim            {t:8.1f} µs  same rows as claim=1: {same}")
    print(f"same body, row = beat index (no atomic)  {timed(by_index):8.1f} µs")
    print(f"copy of the rows' bytes (bandwidth)      {timed(lambda: cupy.copyto(dst, rows)):8.1f} µs")


if __name__ == "__main__":
    main()

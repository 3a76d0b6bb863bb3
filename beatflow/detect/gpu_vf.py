"""The flutter rule on the GPU (Numba CUDA): :mod:`beatflow.detect.rhythm`'s window quantities, its
flutter-like windows and episodes as four kernels (:func:`flutter_pass`).

:func:`beatflow.detect.gpu.detect_beats_gpu` launches them beside the detection's kernels, before
the peaks are emitted; they are tested against the array code of :mod:`beatflow.detect.rhythm` and
the fused CPU loops of :mod:`beatflow.detect.cpu`. Built per window length and filter sizes, on
first use; launches, streams and the simulator: :mod:`beatflow.gpu.runtime`.
"""
from __future__ import annotations

import functools

import numpy as np

from beatflow.detect.gpu_kernels import CAND_TPB, build, kernel_taps
from beatflow.detect.rhythm import quantile_sorted
from beatflow.gpu.runtime import FULL_MASK, WARP, bind, jit_kernel

__all__ = ["flutter_pass", "build_vf"]

#: the flutter rule's energy kernel: chunks per window (a window's lanes, a power of two that divides
#: a warp) and the windows of a block (GPU; the simulator runs one warp per block). Each chunk sums
#: its first moving-mean window afresh (150 samples at 250 Hz): 16 chunks of 17 samples spent half
#: of vf_energy's instructions on that (H200, ``bench/results/detection.md``, flutter kernels: 166 M
#: warp instructions, issue slots 82 % busy), 8 chunks of 33 half as many.
_VF_CHUNKS = 8
_VF_TILE = 16


# set by _bound() (module globals, so that the simulator can swap ``cuda`` inside the kernels)
cuda = None
_shfl_idx = _shfl_down = _shfl_xor = _syncthreads = _syncwarp = None
_F64 = np.float64


@functools.lru_cache(maxsize=None)
def _bound() -> bool:
    """This module's kernel names set (once, :func:`beatflow.gpu.runtime.bind`): whether it is the simulator."""
    return bind(globals())


@functools.lru_cache(maxsize=None)
def build_vf(W: int, HP: int, K: int, tpb: int, taps: tuple):
    """The flutter rule's kernels (:mod:`beatflow.detect.rhythm` on the GPU) for one window length ``W``,
    high-pass length ``HP`` and slope kernel ``K`` (constant loop bounds, as in
    :func:`beatflow.detect.gpu_kernels.build_detect`).

    ``vf_energy`` takes a tile of ``tpb // _VF_CHUNKS`` windows per block, a chunk of consecutive
    samples per thread; ``vf_need`` and ``vf_episodes`` one thread per window; ``vf_near`` one block
    per listed window. A window's samples beyond the array take the values at its ends (``rhythm``'s
    edge padding), its neighbourhoods the despiked samples at clipped positions (``mode="nearest"``).
    """
    kernels, _ = build()  # the device functions shared with the detection's kernels
    sim = _bound()
    _clip, _despiked = kernels["_clip"], kernels["_despiked"]
    hh, kh = HP // 2, K // 2
    R = max(hh, kh)
    XS = W + 2 * R  # the despiked samples a window reads
    NW = tpb // WARP
    G = _VF_CHUNKS
    TW = tpb // G  # windows per block of vf_energy
    C = -(-W // G) | 1  # samples per chunk, odd: the lanes of a window read 8-byte words in distinct banks
    # (an even stride of 16 doubles put all of them in one bank: 16-way conflicts, 2.1 ms on the H200)
    XT = TW * W + 2 * R  # the despiked samples a tile of windows reads
    f64 = _F64
    u64 = np.uint64
    half = (W - 1) // 2
    TAPS = np.array(taps, dtype=np.float64)  # the slope taps reversed: constants of the kernel

    @cuda.jit(device=True)
    def _load(x, P0, xs, m):
        """``xs[u]`` = the despiked sample at ``clip(P0 - R + u)`` for ``u < m`` (``P0``: the first
        sample of the window or tile, local; may lie outside the array). Away from the ends a
        constant number of rounds (``build_detect``'s block-stride loops) with the three samples
        read directly."""
        n = x.shape[0]
        tid = cuda.threadIdx.x
        if P0 - R >= 1 and P0 - R + m + 1 <= n:  # (uniform over the block)
            for k in range((m + tpb - 1) // tpb):
                u = tid + k * tpb
                if k < m // tpb or u < m:
                    j = u64(P0 - R - 1 + u)
                    a = np.float64(x[j])
                    b = np.float64(x[j + u64(1)])
                    c = np.float64(x[j + u64(2)])
                    xs[u64(u)] = max(min(a, b), min(max(a, b), c))
        else:
            for u in range(tid, m, tpb):
                xs[u] = _despiked(x, _clip(P0 - R + u, n), n)

    @cuda.jit(device=True)
    def _high(xs, c):
        """The high-passed sample at ``xs[c]``: minus its moving mean over ``HP`` samples."""
        acc = 0.0
        for i in range(HP):
            acc += xs[c - hh + i]
        return xs[c] - acc / HP

    @cuda.jit(device=True)
    def _slope_at(xs, c, kr):
        j = u64(c) - u64(kh)  # (c >= kh)
        d = 0.0
        for i in range(K):
            d += xs[j + u64(i)] * kr[i]
        return d

    @cuda.jit(device=True)
    def _slopes2(xs, c, kr):
        """:func:`_slope_at` at ``c`` and ``c + 1`` (each summed in its order), each of the ``K + 1``
        samples loaded once (constant bounds, no branches: NVVM unrolls the loop; K >= 9, see
        ``SegmentParams.samples``)."""
        j = u64(c) - u64(kh)
        v = xs[j]
        d0 = v * kr[0]
        v = xs[j + u64(1)]
        d1 = v * kr[0]
        d0 += v * kr[1]
        for i in range(2, K):
            v = xs[j + u64(i)]
            d0 += v * kr[i]
            d1 += v * kr[i - 1]
        d1 += xs[j + u64(K)] * kr[K - 1]
        return d0, d1

    @cuda.jit(device=True)
    def _step(xs, c, acc, ss, sd, d, slide):
        """One sample of a chunk: the moving sum slid to ``c`` (when ``slide``), the energies with
        the high-passed sample at ``c`` and the slope ``d`` added."""
        if slide:
            acc += xs[c + u64(hh)] - xs[c - u64(hh + 1)]
        h = xs[c] - acc / HP
        return acc, ss + h * h, sd + d * d

    @cuda.jit(device=True)
    def _block_sum(v, red):
        """The sum of ``v`` over the block (a butterfly per warp, then the warps' sums in order), in
        every thread; ``red`` holds ``NW`` values."""
        off = WARP // 2
        while off > 0:
            v += _shfl_xor(FULL_MASK, v, off)
            off //= 2
        if cuda.threadIdx.x % WARP == 0:
            red[cuda.threadIdx.x // WARP] = v
        _syncthreads()
        t = red[0]
        for i in range(1, NW):
            t += red[i]
        _syncthreads()
        return t

    @cuda.jit(device=True)
    def _group_sum(v):
        """The sum of ``v`` over the ``G`` lanes of a window (aligned lane groups), in each of them."""
        off = G // 2
        while off > 0:
            v += _shfl_xor(FULL_MASK, v, off)
            off //= 2
        return v

    @jit_kernel("vf_energy", sim)
    def vf_energy(x, first, w0, e_sig, e_slope):
        """Per window: the energies of the high-passed signal and of its slope (the reversed slope
        taps ``TAPS``, summed as the dense kernel sums them). A tile of ``TW`` windows per block
        in shared memory; each thread a chunk of ``C`` consecutive samples of one window, its moving
        mean carried along the chunk (one sample in, one out) where the chunk lies inside the array,
        summed afresh per sample at its ends (whose values repeat the end samples')."""
        xs = cuda.shared.array(XT, f64)
        kr = cuda.const.array_like(TAPS)
        n = x.shape[0]
        nw = e_sig.shape[0]
        tid = cuda.threadIdx.x
        wi = tid // G
        t0 = (tid % G) * C
        t1 = min(t0 + C, W)
        for k0 in range(cuda.blockIdx.x * TW, nw, cuda.gridDim.x * TW):  # uniform over the block
            P0 = (w0 + k0) * W - first
            _load(x, P0, xs, XT)
            _syncthreads()
            ss = 0.0
            sd = 0.0
            Pk = P0 + wi * W  # this thread's window
            if k0 + wi < nw and t0 < t1:
                if Pk + t0 >= 0 and Pk + t1 <= n:  # inside the array: slide the moving sum
                    c = u64(wi * W + t0 + R)  # (>= R: the indices below are never negative)
                    acc = 0.0
                    for i in range(HP):
                        acc += xs[c - u64(hh) + u64(i)]
                    m = t1 - t0  # two samples at a time: their slopes load each sample once
                    for qd in range(m // 2):  # (K + 1 loads, not 2 K)
                        d0, d1 = _slopes2(xs, c, kr)
                        acc, ss, sd = _step(xs, c, acc, ss, sd, d0, qd > 0)
                        acc, ss, sd = _step(xs, c + u64(1), acc, ss, sd, d1, True)
                        c += u64(2)
                    if m % 2:
                        acc, ss, sd = _step(xs, c, acc, ss, sd, _slope_at(xs, c, kr), m > 1)
                else:
                    for t in range(t0, t1):
                        c = _clip(Pk + t, n) - P0 + R
                        h = _high(xs, c)
                        d = _slope_at(xs, c, kr)
                        ss += h * h
                        sd += d * d
            ss = _group_sum(ss)
            sd = _group_sum(sd)
            if tid % G == 0 and k0 + wi < nw:
                e_sig[k0 + wi] = ss
                e_slope[k0 + wi] = sd
            _syncthreads()  # the tile is read before the next one is loaded

    @cuda.jit(device=True)
    def _smooth(e_sig, e_slope, j, c, omega2):
        """Window ``j`` (in range) is smooth: over ``j ± c`` (added in order, as ``rhythm.context_sum``)
        the slope's energy below ``omega2`` × the signal's."""
        nw = e_sig.shape[0]
        ss = 0.0
        sd = 0.0
        for i in range(max(j - c, 0), min(j + c + 1, nw)):
            ss += e_sig[i]
            sd += e_slope[i]
        return sd < omega2 * ss

    _pct = cuda.jit(device=True)(quantile_sorted)  # NumPy's linear quantile, as the CPU loops take it

    @cuda.jit
    def vf_need(e_sig, e_slope, c, omega2, todo, info):
        """Lists (in any order) the windows whose near-median fraction a smooth window's mean reads:
        those within ``±c`` of a smooth one (their number in ``info[3]``)."""
        nw = e_sig.shape[0]
        for k in range(cuda.grid(1), nw, cuda.gridsize(1)):
            for j in range(max(k - c, 0), min(k + c + 1, nw)):
                if _smooth(e_sig, e_slope, j, c, omega2):
                    todo[cuda.atomic.add(info, 3, 1)] = k
                    break

    @jit_kernel("vf_near", sim)
    def vf_near(x, first, w0, todo, info, tol, near):
        """Per listed window (one block each, grid-stride over the list): the fraction of its
        high-passed samples within ``tol`` × their 3–97 % range of their median. The ``W`` values
        are sorted by rank in shared memory (their number of smaller values, ties by position)."""
        xs = cuda.shared.array(XS, f64)
        hv = cuda.shared.array(W, f64)
        srt = cuda.shared.array(W, f64)
        red = cuda.shared.array(NW, f64)
        n = x.shape[0]
        tid = cuda.threadIdx.x
        for q in range(cuda.blockIdx.x, info[3], cuda.gridDim.x):  # uniform over the block
            k = todo[q]
            P0 = (w0 + k) * W - first
            _load(x, P0, xs, XS)
            _syncthreads()
            for t in range(tid, W, tpb):
                hv[t] = _high(xs, _clip(P0 + t, n) - P0 + R)
            _syncthreads()
            for t in range(tid, W, tpb):
                v = hv[t]
                r = 0
                for u in range(W):
                    o = hv[u]
                    if o < v or (o == v and u < t):
                        r += 1
                srt[r] = v
            _syncthreads()
            if W % 2 == 1:
                med = srt[half]
            else:
                med = (srt[half] + srt[half + 1]) / 2.0
            lo = _pct(srt, 0.03)
            thr = tol * (_pct(srt, 0.97) - lo)
            cnt = 0.0
            for t in range(tid, W, tpb):
                if abs(hv[t] - med) < thr:
                    cnt += 1.0
            cnt = _block_sum(cnt, red)
            if tid == 0:
                near[k] = cnt / W

    @cuda.jit(device=True)
    def _like(e_sig, e_slope, near, j, c, omega2, baseline):
        """Window ``j`` is flutter-like: smooth, and the mean near-median fraction over ``j ± c``
        below ``baseline`` (False outside the windows)."""
        nw = e_sig.shape[0]
        if j < 0 or j >= nw or not _smooth(e_sig, e_slope, j, c, omega2):
            return False
        sn = 0.0
        m = 0
        for i in range(max(j - c, 0), min(j + c + 1, nw)):
            sn += near[i]
            m += 1
        return sn / m < baseline

    @jit_kernel("vf_episodes", sim)
    def vf_episodes(e_sig, e_slope, near, c, omega2, baseline, runs, w0, lo, hi, episode, spans, info):
        """Per window: ``episode[k]``, it lies in a run of at least ``runs`` flutter-like windows;
        the thread of a run's first window also writes the run as a ``[start, end)`` sample range
        clipped to ``[lo, hi)`` into the next slot of ``spans`` (counted in ``info[2]``; runs that
        miss the range are left out)."""
        nw = e_sig.shape[0]
        for k in range(cuda.grid(1), nw, cuda.gridsize(1)):
            ep = 0
            if _like(e_sig, e_slope, near, k, c, omega2, baseline):
                left = 0
                while left < runs - 1 and _like(e_sig, e_slope, near, k - left - 1, c, omega2, baseline):
                    left += 1
                right = 0
                while left + right < runs - 1 and _like(e_sig, e_slope, near, k + right + 1, c, omega2, baseline):
                    right += 1
                if left + right + 1 >= runs:
                    ep = 1
                if not _like(e_sig, e_slope, near, k - 1, c, omega2, baseline):  # a run starts here
                    r = 1
                    while _like(e_sig, e_slope, near, k + r, c, omega2, baseline):
                        r += 1
                    if r >= runs:
                        st = max((w0 + k) * W, lo)
                        en = min((w0 + k + r) * W, hi)
                        if en > st:
                            slot = cuda.atomic.add(info, 2, 1)
                            spans[slot, 0] = st
                            spans[slot, 1] = en
            episode[k] = ep

    return {"vf_energy": vf_energy, "vf_need": vf_need, "vf_near": vf_near, "vf_episodes": vf_episodes}


def flutter_pass(ctx, x, s, first: int, lo: int, hi: int, info, keep: list | None = None):
    """Launch the flutter rule's kernels over ``x``: ``(episode, w0, spans)`` (device arrays; the
    number of spans goes to ``info[2]``, that of the windows whose near-median fraction was computed
    to ``info[3]``)."""
    xp = ctx.xp
    W, n = int(s.vf_window), int(x.shape[0])
    w0 = first // W
    nw = -(-(first - w0 * W + n) // W)
    L = max(1, int(s.vf_runs))
    tpb = WARP if ctx.sim else _VF_CHUNKS * _VF_TILE
    kern = build_vf(W, int(s.vf_highpass), int(s.kernel), tpb, kernel_taps(int(s.kernel), float(s.a), True))
    e_sig = ctx.empty(nw, xp.float64)
    e_slope = ctx.empty(nw, xp.float64)
    near = ctx.empty(nw, xp.float64)  # read only where computed (vf_need's list)
    todo = ctx.empty(nw, xp.int64)
    episode = ctx.empty(nw, xp.int8)
    spans = ctx.empty((nw // (L + 1) + 1, 2), xp.int64)
    a = ctx.arg
    c, omega2 = int(s.vf_context), float(s.vf_omega) ** 2
    tw = tpb // _VF_CHUNKS
    per_window = WARP if ctx.sim else CAND_TPB
    wblocks = ctx.blocks(-(-nw // per_window))
    eblocks = ctx.blocks(-(-nw // tw))
    if _VF_ENERGY_PER_SM and not ctx.sim:  # (a grid-stride loop: fewer blocks take more tiles each)
        eblocks = min(eblocks, int(_VF_ENERGY_PER_SM) * _sm_count(ctx.dev))
    ctx.launch(kern["vf_energy"], eblocks, tpb, 0, a(x), first, w0, a(e_sig), a(e_slope), sig=x.dtype.char)
    ctx.launch(kern["vf_need"], wblocks, per_window, 0, a(e_sig), a(e_slope), c, omega2, a(todo), a(info), sig="")
    ctx.launch(kern["vf_near"], ctx.blocks(min(nw, _VF_NEAR_BLOCKS)), tpb, 0, a(x), first, w0, a(todo), a(info),
               float(s.vf_tol), a(near), sig=x.dtype.char)
    ctx.launch(kern["vf_episodes"], wblocks, per_window, 0, a(e_sig), a(e_slope), a(near), c, omega2,
               float(s.vf_baseline), L, w0, int(lo), int(hi), a(episode), a(spans), a(info), sig="")
    if keep is not None:  # (on a side stream: alive until the caller's synchronisation)
        keep += (e_sig, e_slope, near, todo)
    return episode, w0, spans


#: blocks of vf_energy per SM (None: one block per tile of windows). 5 of its blocks (128 threads x
#: 95 registers) fill an SM's registers, so uncapped it kept the candidates' kernels, on their
#: high-priority stream, from starting until it drained; with 4 per SM they run beside it. H200
#: (``bench/results/detection.md``, streams; 120 calls each): segmentation + embedding 0.969 -> 0.955 ms
#: median (interleaved 0.984 -> 0.979), the same peaks, episodes and rows
_VF_ENERGY_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    """The number of streaming multiprocessors of CUDA device ``dev`` (asked once per device)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, dev))


#: blocks of vf_near (launched before the number of listed windows is known; grid-stride over them)
_VF_NEAR_BLOCKS = 2048

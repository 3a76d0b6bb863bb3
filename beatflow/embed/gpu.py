"""The beat rows on the GPU (Numba CUDA): the warp-per-beat embedding and the kept beats' bounds.

:func:`embed_gpu` and :func:`beat_rows_gpu` have exactly the contracts of
:func:`beatflow.embed.beats.embed_xp` and :func:`beatflow.embed.beats.beat_rows_xp` (the array code,
which :mod:`beatflow.embed` runs on host arrays) and are tested against them and against the loop
references of ``tests/naive.py``. :func:`rows_launch` queues the rows' kernels behind the detection's
(:func:`beatflow.detect.gpu.segment_rows_gpu`: one synchronisation for both). Launches, streams and
the simulator: :mod:`beatflow.gpu.runtime`; the kernels are defined on first use.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from beatflow.gpu.runtime import FULL_MASK, WARP, bind, ctx_for, jit_kernel

__all__ = ["embed_gpu", "beat_rows_gpu", "rows_launch"]

_INF = math.inf
# embed: warps per block (one warp per beat)
_EMBED_WARPS = 8
_EMBED_CLAIM = 4  # rows a warp claims at once (embed_warp)
#: blocks of embed_warp when the number of rows is known on the device only (the warps claim rows
#: until they pass it; a grid for the capacity would spend an atomic claim per idle warp)
_EMBED_COUNT_BLOCKS = 1024
#: threads per block of beats_count and beats_write (a chunk of as many consecutive beats)
_ROWS_TPB = 128

# set by _build() (module globals, so that the simulator can swap ``cuda`` inside the kernels)
cuda = None
_shfl_idx = _shfl_down = _shfl_xor = _syncthreads = _syncwarp = None
_F64 = np.float64


@functools.lru_cache(maxsize=None)
def _build():
    """Define the kernels of the kept beats' bounds (once): ``(kernels dict, simulator?)``."""
    sim = bind(globals())

    @cuda.jit(device=True)
    def _beat_kept(peaks, i, pre, lower, upper, cut_long, n_samples):
        """Whether beat ``i`` (peak ``i`` to peak ``i + 1``) gets a row: ``beats.beats_from_peaks``
        keeps it (it starts at or after sample 0 and ends within the recording) and ``beats.kept_mask``
        (long enough; not too long unless ``cut_long``)."""
        p = peaks[i]
        ln = peaks[i + 1] - p
        st = p - pre
        return st >= 0 and st + ln <= n_samples and ln >= lower and (cut_long or ln <= upper)

    @cuda.jit(device=True)
    def _block_exclusive(sh, v):
        """Exclusive prefix sum of ``v`` over the block's threads (``sh``: tpb int64 of shared
        memory; Hillis-Steele), and the block's total."""
        tid = cuda.threadIdx.x
        tpb = cuda.blockDim.x
        sh[tid] = v
        _syncthreads()
        off = 1
        while off < tpb:
            u = sh[tid - off] if tid >= off else 0
            _syncthreads()
            sh[tid] += u
            _syncthreads()
            off *= 2
        incl = sh[tid]
        total = sh[tpb - 1]
        _syncthreads()
        return incl - v, total

    @cuda.jit
    def beats_count(peaks, npeaks, pre, lower, upper, cut_long, n_samples, counts):
        """Kept beats of each chunk of ``blockDim`` consecutive beats (a block per chunk, grid-stride);
        the peaks are ``peaks[:npeaks[0]]`` (a count on the device)."""
        sh = cuda.shared.array(_ROWS_TPB, np.int64)
        tid = cuda.threadIdx.x
        tpb = cuda.blockDim.x
        nb = max(npeaks[0] - 1, 0)
        for c in range(cuda.blockIdx.x, (nb + tpb - 1) // tpb, cuda.gridDim.x):
            i = c * tpb + tid
            k = 1 if i < nb and _beat_kept(peaks, i, pre, lower, upper, cut_long, n_samples) else 0
            _, total = _block_exclusive(sh, k)
            if tid == 0:
                counts[c] = total

    @cuda.jit
    def beats_write(peaks, npeaks, pre, lower, upper, cut_long, n_samples, counts, index, peak, start, length,
                    rowlen, total):
        """The kept beats in order: each chunk's place is the sum of the chunks' counts before it
        (a block reduction), each beat's within it the block's exclusive scan of the kept flags;
        the last chunk writes the number of kept beats into ``total[0]``."""
        sh = cuda.shared.array(_ROWS_TPB, np.int64)
        tid = cuda.threadIdx.x
        tpb = cuda.blockDim.x
        nb = max(npeaks[0] - 1, 0)
        nch = (nb + tpb - 1) // tpb
        d = 0  # beats that start before sample 0 (the first few of sorted peaks): not counted in `index`
        while d < nb and peaks[d] < pre:
            d += 1
        for c in range(cuda.blockIdx.x, nch, cuda.gridDim.x):
            b = 0
            for j in range(tid, c, tpb):
                b += counts[j]
            _, base = _block_exclusive(sh, b)
            i = c * tpb + tid
            k = 1 if i < nb and _beat_kept(peaks, i, pre, lower, upper, cut_long, n_samples) else 0
            before, n_c = _block_exclusive(sh, k)
            if k:
                q = base + before
                p = peaks[i]
                index[q] = i - d  # among the beats of beats_from_peaks
                peak[q] = p
                start[q] = p - pre
                ln = peaks[i + 1] - p
                length[q] = ln
                rowlen[q] = min(ln, upper)  # beats.row_lengths
            if c == nch - 1 and tid == 0:
                total[0] = base + n_c

    return {"beats_count": beats_count, "beats_write": beats_write}, sim


@functools.lru_cache(maxsize=None)
def _embed_build(width: int):
    """The embedding kernel for rows of ``width`` samples (its loops over a row have constant bounds)."""
    _, sim = _build()
    NJ = -(-width // WARP)  # a lane's samples of a row
    f32 = np.float32

    @jit_kernel("embed_warp", sim)
    def embed_warp(x, start, length, first, baseline, rows, p2p, counter, claim, count):
        """Warps claim beats and write each beat's row in beat order (row = beat index).

        The warp's first lane claims the next ``claim`` output rows with one atomic add on
        ``counter`` and broadcasts the first with shfl_sync; the warp then embeds those beats one
        after the other, until the claims pass the last beat. (The seed's kernel claimed one row
        per beat and wrote rows in claim order, which then needed a scatter of every row back to
        beat order: one atomic per beat on one address cost about half the kernel's time on the
        H200, and the scatter as much again. Claiming rows in order keeps the claim and makes the
        scatter unnecessary; ``claim`` > 1 divides the atomics.) A beat with a bad length (not
        ``0 < length <= width``) gets a zero row and p2p 0. The baseline (mean of the first
        ``baseline`` samples of the beat's window) is a shfl_xor_sync butterfly sum, the row is
        written (samples minus baseline, then zeros) in a warp-stride loop that also tracks the
        lane's min/max of the valid samples, reduced with shfl_down_sync. Built per row width: the
        row's ``ceil(width / 32)`` loads per lane are one unrolled loop, all in flight at once (with
        the baseline's samples among them), before anything is written.
        """
        n_beats = start.shape[0]
        if count.shape[0] > 0:  # the number of beats on the device (beat_rows_gpu: no synchronisation)
            n_beats = min(n_beats, count[0])
        nx = x.shape[0]
        lane = cuda.threadIdx.x % WARP
        raw = cuda.local.array(NJ, f32)  # registers: constant indices once the loops are unrolled
        while True:  # uniform over the warp: the claim is broadcast
            first_row = np.int32(0)
            if lane == 0:
                first_row = cuda.atomic.add(counter, 0, claim)
            first_row = _shfl_idx(FULL_MASK, first_row, 0)
            if first_row >= n_beats:
                break
            for row in range(first_row, min(first_row + claim, n_beats)):
                ln = length[row]
                if ln <= 0 or ln > width:
                    ln = 0  # skipped: a zero row
                s = start[row] - first
                nb = min(baseline, width) if baseline > 0 and ln > 0 else 0
                reach = max(ln, nb) if nb <= WARP else ln  # the samples read now
                for k in range(NJ):
                    j = lane + k * WARP
                    v = f32(0.0)
                    if j < reach:
                        v = f32(x[min(max(s + j, 0), nx - 1)])
                    raw[k] = v
                base = f32(0.0)
                if nb > 0:
                    acc = 0.0
                    if nb <= WARP:  # the baseline's samples are the lanes' first ones
                        if lane < nb:
                            acc += raw[0]
                    else:
                        for j in range(lane, nb, WARP):
                            acc += f32(x[min(max(s + j, 0), nx - 1)])
                    off = WARP // 2
                    while off > 0:
                        acc += _shfl_xor(FULL_MASK, acc, off)
                        off //= 2
                    base = f32(acc / nb)
                lo = f32(_INF)  # float32 keeps each shuffle one 32-bit shfl
                hi = f32(-_INF)
                for k in range(NJ):
                    j = lane + k * WARP
                    if j < width:
                        v = f32(0.0)
                        if j < ln:
                            v = raw[k] - base
                            lo = min(lo, v)
                            hi = max(hi, v)
                        rows[row, j] = v
                off = WARP // 2
                while off > 0:
                    lo = min(lo, _shfl_down(FULL_MASK, lo, off))
                    hi = max(hi, _shfl_down(FULL_MASK, hi, off))
                    off //= 2
                if lane == 0:
                    p2p[row] = hi - lo if ln > 0 else f32(0.0)

    return embed_warp


def embed_gpu(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0,
              claim: int = _EMBED_CLAIM, _count=None):
    """Each beat in a row of a zero-padded ``(n, width)`` float32 matrix, and its peak-to-peak.

    Exactly :func:`beatflow.embed.beats.embed_xp` for beats with ``0 < length <= width`` lying in ``x``: row
    ``i`` is ``x[start[i]-first : start[i]-first+length[i]]`` (as float32) minus, when
    ``baseline_samples > 0``, the mean of the first ``min(baseline_samples, width)`` samples of the
    beat's window, then zeros; ``p2p[i]`` is the range of the row's valid samples.

    A beat with ``length <= 0`` or ``length > width`` is skipped: its row is all zeros and its p2p 0
    (``beats.embed_xp`` leaves those undefined). Reads are clipped to ``x``, writes to the output, so a
    bad ``start`` cannot touch memory outside the arrays.

    Row order: the kernel's warps claim rows with an atomic counter (``claim`` rows at a time) and
    embed the beats of the rows they claimed, so rows come out in beat order, the same as
    ``beats.embed_xp`` (and deterministic), with no scatter and no device-to-host synchronisation.
    Every beat has a row (a skipped one writes zeros), so nothing is zero-filled first.

    Parameters
    ----------
    x : CuPy array (or NumPy under the simulator), 1-D
        Samples ``[first, first + len(x))`` of the recording.
    start, length : int arrays (any namespace)
        Global start and length of each beat.
    width : int
        Row width D.
    first : int
        Global index of ``x[0]``.
    baseline_samples : int
        If > 0, subtract each beat's mean over its first ``baseline_samples`` samples.
    claim : int
        Rows a warp claims with one atomic add (1 is the seed's one claim per beat).
    _count : device int64 array of one element, optional
        The number of beats, read by the kernel (:func:`beat_rows_gpu`: known on the device only);
        rows past it are left unwritten.

    Returns
    -------
    rows : float32 (n, width), p2p : float32 (n,), in the namespace of ``x``.
    """
    width, claim = int(width), int(claim)
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    if claim <= 0:
        raise ValueError(f"claim must be positive, got {claim}")
    ctx, host_in = ctx_for(x, start, length)
    xp = ctx.xp
    x = ctx.array(x)
    start = ctx.array(start, dtype=np.int64).reshape(-1)
    length = ctx.array(length, dtype=np.int64).reshape(-1)
    n = int(start.shape[0])
    if length.shape[0] != n:
        raise ValueError(f"start and length differ in size: {n} != {length.shape[0]}")
    rows, p2p = _embed_launch(ctx, x, start, length, width, first, baseline_samples, claim, _count)
    if host_in:
        return xp.asnumpy(rows), xp.asnumpy(p2p)
    return rows, p2p


def _embed_launch(ctx, x, start, length, width: int, first: int, baseline_samples: int, claim: int, count=None):
    """:func:`embed_gpu`'s launch, its arguments already checked and in ``ctx``'s namespace (int64
    ``start`` and ``length``): ``(rows, p2p)``."""
    xp = ctx.xp
    n = int(start.shape[0])
    if n == 0:
        return xp.zeros((0, width), dtype=xp.float32), xp.zeros(0, dtype=xp.float32)
    rows = ctx.empty((n, width), xp.float32)
    p2p = ctx.empty(n, xp.float32)
    counter = ctx.zeros(1, xp.int32)
    warps = 1 if ctx.sim else _EMBED_WARPS  # simulator: a block is one warp (shuffle emulation)
    blocks = ctx.blocks(-(-n // (warps * claim)))
    if count is not None:
        blocks = min(blocks, _EMBED_COUNT_BLOCKS)
    else:
        count = ctx.empty(0, xp.int64)  # (empty: all n beats)
    ctx.launch(_embed_build(width), blocks, warps * WARP, 0, x, start, length, int(first),
               max(0, int(baseline_samples)), rows, p2p, counter, int(claim), count, sig=(x.dtype.char, x.ndim))
    return rows, p2p


def beat_rows_gpu(x, peaks, s, n_samples: int, *, first: int = 0, baseline_samples: int = 0):
    """:func:`beatflow.embed.beats.beat_rows_xp` on the GPU: the kept beats of ``peaks`` and their rows in
    three kernel launches and one synchronisation (the number of kept beats).

    ``beats_count`` counts the kept beats (``beats.beats_from_peaks`` then ``beats.kept_mask``) of
    each chunk of 128 consecutive beats, ``beats_write`` writes them in order (each chunk's place
    from the counts before it, each beat's from a block scan of the flags) with their row lengths
    (``beats.row_lengths``), and ``embed_warp`` writes their rows (:func:`embed_gpu`, the number of
    beats read on the device). The arrays are sized for every beat of ``peaks`` and cut to the kept
    ones after the one synchronisation.

    Parameters and result as :func:`beatflow.embed.beats.beat_rows_xp` (``x``, ``peaks`` CuPy arrays, or
    NumPy under the simulator).
    """
    ctx, host_in = ctx_for(x, peaks)
    xp = ctx.xp
    x = ctx.array(x)
    peaks = ctx.array(peaks, dtype=np.int64).reshape(-1)
    npk = int(peaks.shape[0])
    total = xp.zeros(1, dtype=xp.int64)
    out = rows_launch(ctx, x, peaks, xp.full(1, npk, dtype=xp.int64), total, s, first, n_samples,
                      baseline_samples, npk)
    m = int(total[0]) if ctx.sim else int(total.get()[0])  # the one synchronisation
    out = tuple(v[:m] for v in out)
    return tuple(xp.asnumpy(v) for v in out) if host_in else out


def rows_launch(ctx, x, peaks, npeaks, total, s, first: int, n_samples: int, baseline_samples: int, cap: int):
    """Launch ``beats_count``, ``beats_write`` and ``embed_warp`` for the peaks ``peaks[:npeaks[0]]``
    (``npeaks``: a device array; ``cap`` >= that count sizes the outputs); the number of kept beats
    goes to ``total[0]`` (zero before). Returns ``(index, peak, start, length, rows, p2p)`` of ``cap - 1``
    entries, the first ``total[0]`` of them written."""
    xp = ctx.xp
    kernels, _ = _build()
    nb = max(int(cap) - 1, 0)
    tpb = WARP if ctx.sim else _ROWS_TPB
    nch = -(-nb // tpb)
    index, peak, start, length, rowlen = (ctx.empty(nb, xp.int64) for _ in range(5))
    if nb > 0:
        counts = ctx.empty(nch, xp.int64)
        a = ctx.arg
        args = (a(peaks), a(npeaks), int(s.pre), int(s.lower), int(s.upper), bool(s.cut_long), int(n_samples))
        ctx.launch(kernels["beats_count"], ctx.blocks(nch), tpb, 0, *args, a(counts), sig="")
        ctx.launch(kernels["beats_write"], ctx.blocks(nch), tpb, 0, *args, a(counts), a(index), a(peak), a(start),
                   a(length), a(rowlen), a(total), sig="")
    rows, p2p = _embed_launch(ctx, x, start, rowlen, int(s.width), int(first), int(baseline_samples), _EMBED_CLAIM,
                              total)
    return index, peak, start, length, rows, p2p

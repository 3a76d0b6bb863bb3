"""The detection's CUDA kernels (Numba CUDA): 1-D non-maximum suppression, the fused dense pass, the
per-candidate decisions and the one-block scan.

:mod:`beatflow.detect.gpu` launches them (:func:`beatflow.detect.gpu.detect_peaks_gpu`); the flutter
rule's kernels are in :mod:`beatflow.detect.gpu_vf`. The kernels that take no window sizes are
defined once (:func:`build`); the dense pass, the candidates' evaluation and the emission are built
per parameter set (:func:`build_detect`: their loop bounds are compile-time constants). Each is
compiled by Numba on its first launch. Launches, streams and the simulator:
:mod:`beatflow.gpu.runtime`.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from beatflow.detect.peaks import gaussian_derivative
from beatflow.gpu.runtime import FULL_MASK, WARP, bind, jit_kernel

__all__ = ["build", "build_detect", "dense_alloc", "kernel_taps", "CAND_TPB", "SCAN_TPB", "MAX_WINDOW",
           "DENSE_CHUNKS", "REG_LEVELS"]

_INF = math.inf
#: threads per block of the per-candidate kernels
CAND_TPB = 128
# the one-block exclusive scan: threads (GPU; the simulator runs one warp), counts per thread and piece
SCAN_TPB = 1024
_SCAN_PER = 4
_SCAN_PIECE = _SCAN_PER * SCAN_TPB  # (a constant for the shared array's size)
#: the widest window of blocks the level's median takes (2 * threshold_blocks + 1)
MAX_WINDOW = 63

# set by build() (module globals, so that the simulator can swap ``cuda`` inside the kernels)
cuda = None
_shfl_idx = _shfl_down = _shfl_xor = _syncthreads = _syncwarp = None
_F64 = np.float64  # dtype of the shared tile (the simulator wants a dtype instance, see runtime.bind)


@functools.lru_cache(maxsize=None)
def build():
    """Define the kernels that take no window sizes (once): ``(kernels dict, simulator?)``; the dict
    also holds the device functions that the per-parameter kernels share (``_clip``, ``_despiked``)."""
    sim = bind(globals())

    @cuda.jit(device=True)
    def _nms_keep(win, half):
        """Whether the centre of ``win`` (2*half + 1 values, a view of a tile) is > 0 and no other
        value is larger. Outwards from the centre: a sample on a slope stops at d = 1, only
        (near-)maxima scan the whole window. (A view: with a constant ``half`` the offsets are
        constants in the addresses.)"""
        v = win[half]
        if not v > 0:
            return False
        for d in range(1, half + 1):
            if win[half - d] > v or win[half + d] > v:
                return False
        return True

    @cuda.jit
    def nms_tiled(env, half, gate):
        """gate[i] = env[i] > 0 and env[i] >= every env[j], |i - j| <= half (window clipped at the ends).

        One thread per position; each block stages its tile plus a ``half`` halo on each side in
        shared memory (dynamic, ``blockDim + 2*half`` float64). Out-of-range halo positions take the
        edge value (mode="nearest"), which leaves the clipped window's maximum unchanged. Each thread
        compares outwards from its sample and stops at the first larger one, so only (near-)maxima
        scan the whole window.
        """
        tile = cuda.shared.array(0, _F64)
        tpb = cuda.blockDim.x
        tid = cuda.threadIdx.x
        n = env.shape[0]
        span = tpb + 2 * half
        for base in range(cuda.blockIdx.x * tpb, n, cuda.gridDim.x * tpb):  # uniform over the block
            _syncthreads()  # the previous tile is no longer read
            for k in range(tid, span, tpb):
                g = min(max(base - half + k, 0), n - 1)
                tile[k] = env[g]
            _syncthreads()
            i = base + tid
            if i < n:
                gate[i] = 1 if _nms_keep(tile[tid:tid + 2 * half + 1], half) else 0

    @cuda.jit
    def nms_global(env, half, gate):
        """Same as nms_tiled, reading global memory (for windows too wide for a shared tile)."""
        n = env.shape[0]
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            v = env[i]
            keep = v > 0
            if keep:
                for d in range(1, half + 1):
                    if env[max(i - d, 0)] > v or env[min(i + d, n - 1)] > v:
                        keep = False
                        break
            gate[i] = 1 if keep else 0

    # --- detection (beatflow.detect.detect_peaks on the GPU): the dense stages are built per parameter
    # set by build_detect (their loop bounds are compile-time constants); the decisions over the sparse
    # candidates are one thread per candidate walking to its neighbours ---
    @cuda.jit(device=True)
    def _clip(i, n):
        return 0 if i < 0 else (n - 1 if i >= n else i)

    @cuda.jit(device=True)
    def _despiked(x, j, n):
        a = np.float64(x[j - 1] if j > 0 else x[1])
        b = np.float64(x[j])
        c = np.float64(x[j + 1] if j < n - 1 else x[n - 2])
        return max(min(a, b), min(max(a, b), c))

    @cuda.jit(device=True)
    def _window_median(bmax, b, k):
        """Median of bmax over blocks b-k .. b+k that exist and are not NaN (nanmedian of the
        NaN-padded window); NaN when there are none. By ranks (a value's rank: the values below
        it, and the equal ones before it), so no sorted copy in local memory: the values at the
        middle ranks are those a sort puts there."""
        nb = bmax.shape[0]
        lo = max(b - k, 0)
        hi = min(b + k + 1, nb)
        m = 0
        for j in range(lo, hi):
            if not math.isnan(bmax[j]):
                m += 1
        if m == 0:
            return math.nan
        half = m // 2
        below = math.nan  # the value at rank half - 1 (even m)
        mid = math.nan  # at rank half
        for j in range(lo, hi):
            v = bmax[j]
            if math.isnan(v):
                continue
            r = 0
            for i in range(lo, hi):
                u = bmax[i]  # (NaN compares false: not counted)
                if u < v or (u == v and i < j):
                    r += 1
            if r == half:
                mid = v
            elif r == half - 1:
                below = v
        if m % 2 == 1:
            return mid
        return (below + mid) / 2.0

    @cuda.jit
    def block_median(bmax, k, amp):
        """amp[b] = _window_median(bmax, b, k): the local level of every block."""
        for b in range(cuda.grid(1), bmax.shape[0], cuda.gridsize(1)):
            amp[b] = _window_median(bmax, b, k)

    @cuda.jit
    def cand_twave(cand, mcount, state, slope, window, ratio, out):
        """Strong candidates that are the T wave of the previous strong one (peaks.t_wave_mask)
        become 0; others keep their state. The candidates are ``cand[:mcount[0]]`` (a count on the
        device: the launch is sized for the capacity, so no host synchronisation is needed)."""
        for j in range(cuda.grid(1), mcount[0], cuda.gridsize(1)):
            st = state[j]
            if st == 2:
                c = cand[j]
                i = j - 1
                while i >= 0 and c - cand[i] < window:
                    if state[i] == 2:
                        if slope[j] < ratio * slope[i]:
                            st = 0
                        break
                    i -= 1
            out[j] = st

    @cuda.jit
    def cand_refractory(cand, mcount, state, member, height, window, out, mark):
        """peaks.refractory_mask over the candidates whose state is ``member``: a member closer
        than ``window`` to the next member and smaller than it, or to the previous one and not larger
        than it, is dropped (0); a kept member becomes ``mark``; others keep their state."""
        m = mcount[0]
        for j in range(cuda.grid(1), m, cuda.gridsize(1)):
            st = state[j]
            if st == member:
                c = cand[j]
                h = height[j]
                keep = True
                i = j - 1
                while i >= 0 and c - cand[i] < window:
                    if state[i] == member:
                        if not height[i] < h:
                            keep = False
                        break
                    i -= 1
                i = j + 1
                while keep and i < m and cand[i] - c < window:
                    if state[i] == member:
                        if h < height[i]:
                            keep = False
                        break
                    i += 1
                st = mark if keep else 0
            out[j] = st

    @cuda.jit
    def cand_search_back(cand, mcount, state, slope, n, max_gap, rr_window, searchback, margin, tw_ratio, out):
        """peaks.search_back: weak candidates (state 1) that fill a gap among the beats (state 3)
        become 4; beats stay 3; the rest 0. (The array code's "fewer than 2 beats: none" is implied
        by the test below, which needs 3 beats around the candidate.)"""
        m = mcount[0]
        for j in range(cuda.grid(1), m, cuda.gridsize(1)):
            st = state[j]
            if st == 3:
                out[j] = 3
                continue
            out[j] = 0
            if st != 1:
                continue
            c = cand[j]
            # the stream's ends bound a gap as a beat does: with no beat before c (within max_gap),
            # peaks.search_back's min(c - 0, max_gap); likewise min(n - 1 - c, max_gap) after it
            dp = min(c, max_gap)
            prev_slope = 0.0
            i = j - 1
            while i >= 0 and c - cand[i] <= max_gap:
                if state[i] == 3:
                    dp = c - cand[i]
                    prev_slope = slope[i]
                    break
                i -= 1
            dn = min(n - 1 - c, max_gap)
            i = j + 1
            while i < m and cand[i] - c <= max_gap:
                if state[i] == 3:
                    dn = cand[i] - c
                    break
                i += 1
            cnt = 0  # beats within [c - rr_window, c + rr_window]: count, first, last
            lo = c
            hi = c
            i = j - 1
            while i >= 0 and c - cand[i] <= rr_window:
                if state[i] == 3:
                    cnt += 1
                    lo = cand[i]
                    if cnt == 1:
                        hi = cand[i]
                i -= 1
            i = j + 1
            while i < m and cand[i] - c <= rr_window:
                if state[i] == 3:
                    if cnt == 0:
                        lo = cand[i]
                    cnt += 1
                    hi = cand[i]
                i += 1
            if cnt < 3:
                continue
            rr = (hi - lo) / (cnt - 1)
            if (dp + dn > searchback * rr and dp > margin * rr and dn > margin * rr
                    and slope[j] >= tw_ratio * prev_slope):
                out[j] = 4

    @cuda.jit(device=True)
    def _warp_inclusive(v, lane):
        """Inclusive prefix sum of ``v`` over the warp's lanes (shuffles from ``lane - off``)."""
        off = 1
        while off < WARP:
            u = _shfl_idx(FULL_MASK, v, lane - off if lane >= off else lane)
            if lane >= off:
                v += u
            off *= 2
        return v

    @cuda.jit
    def exclusive_scan(counts, offsets, total):
        """One block: ``offsets[i] = sum(counts[:i])`` for ``i <= len(counts)``, and the sum into
        ``total[0]`` when ``total`` is not empty. Pieces of ``_SCAN_PER`` counts per thread pass
        through shared memory (coalesced loads and stores); each thread sums its consecutive ones,
        the warps scan those sums with shuffles, warp 0 the warps' totals."""
        sh = cuda.shared.array(_SCAN_PIECE, np.int64)
        wsum = cuda.shared.array(WARP, np.int64)
        n = counts.shape[0]
        tid = cuda.threadIdx.x
        tpb = cuda.blockDim.x
        lane = tid % WARP
        w = tid // WARP
        nwarps = tpb // WARP
        piece = _SCAN_PER * tpb
        carry = 0
        for p0 in range(0, n, piece):  # uniform over the block
            for k in range(_SCAN_PER):
                i = p0 + k * tpb + tid
                sh[k * tpb + tid] = counts[i] if i < n else 0
            _syncthreads()
            b = tid * _SCAN_PER
            v = 0
            for j in range(_SCAN_PER):
                v += sh[b + j]
            incl = _warp_inclusive(v, lane)
            if lane == WARP - 1:
                wsum[w] = incl
            _syncthreads()
            if w == 0:
                t = wsum[lane] if lane < nwarps else 0
                wsum[lane] = _warp_inclusive(t, lane)
            _syncthreads()
            run = carry + incl - v + (wsum[w - 1] if w > 0 else 0)
            for j in range(_SCAN_PER):
                c = sh[b + j]
                sh[b + j] = run
                run += c
            carry += wsum[nwarps - 1]
            _syncthreads()
            for k in range(_SCAN_PER):
                i = p0 + k * tpb + tid
                if i < n:
                    offsets[i] = sh[k * tpb + tid]
            _syncthreads()
        if tid == 0:
            offsets[n] = carry
            if total.shape[0] > 0:
                total[0] = carry
    return {"nms_tiled": nms_tiled, "nms_global": nms_global, "exclusive_scan": exclusive_scan,
            "block_median": block_median, "cand_twave": cand_twave, "cand_refractory": cand_refractory,
            "cand_search_back": cand_search_back, "_clip": _clip, "_despiked": _despiked,
            "_window_median": _window_median, "_nms_keep": _nms_keep}, sim


def _dense_tile(K: int, box: int, nms: int, tile: int):
    """Sizes of the dense kernel's shared-memory stages for a tile of ``tile`` samples:
    ``(g, groups, E, YL, XL, PL)``, the RMS window's partial sums (``groups`` sums of ``g``), then the
    lengths of the envelope (the tile and the NMS window's reach on both sides), of the squared
    slopes (that and the RMS window's reach), of the despiked samples (that and the slope kernel's
    reach) and of the partial sums."""
    g = max(1, int(np.sqrt(box)))
    E = tile + 2 * nms
    YL = E + 2 * (box // 2)
    return g, box // g, E, YL, YL + 2 * (K // 2), YL - g + 1


#: the dense kernel's chunk lengths (odd): consecutive slopes, partial sums, envelope values and
#: window maxima a thread computes from registers (each input loaded once per chunk, not once per
#: output: the slope's 17 shared loads per sample become (CS + 16) / CS)
DENSE_CHUNKS = (11, 11, 11, 9)
#: levels of the NMS window maxima the dense kernel takes in registers (the rest by doubling; at least 1)
REG_LEVELS = 3


def dense_alloc(K: int, box: int, nms: int, tile: int, chunks: tuple):
    """Lengths of the dense kernel's three shared buffers ``(a, y2, part)``: the stages' lengths
    (:func:`_dense_tile`) rounded up to what the last chunk of each stage reads or writes (values
    past a stage's length are never read into one within it)."""
    g, groups, E, YL, XL, PL = _dense_tile(K, box, nms, tile)
    CS, CP, CR, CN = chunks
    RL = min((2 * nms + 1).bit_length() - 1, max(1, REG_LEVELS))
    ns, np_ = -(-YL // CS) * CS, -(-PL // CP) * CP
    nr = g - 1 + g * (-(-(-(-E // g)) // CR) * CR + groups - 2) + 1  # the envelope's last chunk reads part[:nr]
    nn = -(-(E - (1 << RL) + 1) // CN) * CN
    xa = max(XL, ns + K - 1, nn + (1 << RL) - 1)
    ya = max(YL, ns, np_ + g - 1, nn)
    pa = max(PL, np_, nr)
    return xa, ya, pa


@functools.lru_cache(maxsize=None)
def build_detect(K: int, box: int, nms: int, block: int, KF: int, shalf: int, tile: int, tpb: int,
                 taps: tuple, ftaps: tuple, chunks: tuple = DENSE_CHUNKS):
    """The detection kernels for one set of window sizes (their loops then have constant bounds,
    which NVVM unrolls: a fused stage whose every bound was a runtime value issued ~4x the
    instructions). Cached per parameter set; compiled by Numba on first launch."""
    kernels, sim = build()
    _clip, _despiked = kernels["_clip"], kernels["_despiked"]
    kh, bh = K // 2, box // 2
    g, groups, E, YL, XL, PL = _dense_tile(K, box, nms, tile)
    W = 2 * nms + 1  # the NMS window, and the largest power of two in it (2**LEVELS)
    LEVELS = W.bit_length() - 1
    L = 1 << LEVELS
    RL = min(LEVELS, max(1, REG_LEVELS))  # levels of the window maxima taken in registers
    CS, CP, CR, CN = chunks
    XA, YA, PA = dense_alloc(K, box, nms, tile, chunks)
    # a thread's chunks of consecutive outputs (odd lengths: 8-byte shared accesses at an odd
    # stride hit distinct banks): how many, and the rounds of tpb threads that take them
    NBR = -(-(-(-E // g)) // CR)  # the envelope's chunks per residue mod g
    NCS, NCP, NCR, NCN = -(-YL // CS), -(-PL // CP), g * NBR, -(-(E - (1 << RL) + 1) // CN)
    NRS, NRP, NRR, NRN = (-(-m // tpb) for m in (NCS, NCP, NCR, NCN))
    WS, WP, WR, WN = CS + K - 1, CP + g - 1, CR + groups - 1, CN + (1 << RL) - 1  # a chunk's inputs
    R = tile // tpb
    NW = tpb // WARP
    NXL = -(-XL // tpb)  # rounds of the block-stride loops
    TAPS = np.array(taps, dtype=np.float64)
    FTAPS = np.array(ftaps, dtype=np.float64)
    fkh = KF // 2
    SP = 2 * shalf + 1  # positions of a candidate's steepest-slope window
    SW = SP + 2 * fkh  # the despiked samples they read
    CWB = CAND_TPB // WARP  # cand_eval's warps per block
    f64, i32, i64 = _F64, np.int32, np.int64
    u64 = np.uint64  # unsigned indices: no negative-index wraparound code, no truncation
    # The block-stride loops over a stage's m items run a constant number of rounds (m // tpb full
    # ones and a last partial one), which NVVM unrolls: the items' addresses become one base plus
    # constant offsets, and only the last round tests its bound. (``for t in range(tid, m, tpb)``
    # has a trip count that depends on the thread: a rolled loop with ~20 integer instructions per
    # item around two loads and a store, most of the dense kernel's time on the H200.)
    # The slope taps are constants of the kernel (immediate operands, no loads).

    @cuda.jit(device=True)
    def _double(src, dst, sh, m):
        """One level of the window maxima by doubling: ``dst[t] = max(src[t], src[t + sh])``, t < m."""
        tid = cuda.threadIdx.x
        for k in range((m + tpb - 1) // tpb):
            t = tid + k * tpb
            if k < m // tpb or t < m:
                p0 = src[u64(t)]
                p1 = src[u64(t + sh)]
                dst[u64(t)] = p1 if p1 > p0 else p0

    @jit_kernel("dense", sim)
    def dense(x, first, b0, write_env, env_out, bmax, xmax, cap, tcount, tpos, theight, tvalley, info):
        """One tile of ``tile`` samples per block, everything in shared memory: 3-point median,
        derivative-of-Gaussian slope, RMS over ``box`` (the sums of ``cpu.envelope_cpu``
        in its order), then for the tile's own samples the NMS over ±nms (the candidates, in
        arrival order, into this tile's ``cap`` slots of tpos/theight, with the lowest envelope of
        their window in tvalley; ``info[1] = 1`` if they overflow), the maximum of the envelope
        per stream-aligned block (one atomic max per block and tile into ``bmax``) and of |x| (into
        ``xmax[0]``); the envelope itself into ``env_out`` when ``write_env``."""
        a = cuda.shared.array(XA, f64)  # despiked samples, then the envelope
        y2 = cuda.shared.array(YA, f64)
        part = cuda.shared.array(PA, f64)
        ws = cuda.local.array(WS, f64)  # a chunk's inputs (registers once the loops unroll)
        wp = cuda.local.array(WP, f64)
        wr = cuda.local.array(WR, f64)
        wn = cuda.local.array(WN, f64)
        red = cuda.shared.array(tpb, f64)
        redx = cuda.shared.array(NW, f64)
        cnt = cuda.shared.array(1, i32)
        kr = cuda.const.array_like(TAPS)
        n = x.shape[0]
        tid = cuda.threadIdx.x
        lane = tid % WARP
        w = tid // WARP
        ti = cuda.blockIdx.x
        base = ti * tile
        xlo = base - nms - bh - kh
        if tid == 0:
            cnt[0] = 0
        for t in range(XL + tid, XA, tpb):  # the buffers' padding (read only into values past a stage's
            a[t] = 0.0  # length): finite
        for t in range(YL + tid, YA, tpb):
            y2[t] = 0.0
        for t in range(PL + tid, PA, tpb):
            part[t] = 0.0
        inner = xlo >= 1 and xlo + XL + 1 <= n  # (uniform over the block) no end of the stream in reach
        xm = 0.0  # the largest |x|
        if inner:
            for k in range(NXL):
                t = tid + k * tpb
                if k < XL // tpb or t < XL:
                    j = u64(xlo - 1 + t)
                    p0 = np.float64(x[j])
                    p1 = np.float64(x[j + u64(1)])
                    p2 = np.float64(x[j + u64(2)])
                    a[u64(t)] = max(min(p0, p1), min(max(p0, p1), p2))
                    xm = max(xm, abs(p1))  # (samples of the stream: the halo's count as well)
        else:
            for t in range(tid, XL, tpb):
                a[t] = _despiked(x, _clip(xlo + t, n), n)
        _syncthreads()
        ylo = base - nms - bh
        if inner:  # the slope at ylo + t reads the despiked a[t .. t + K - 1]
            for k in range(NRS):  # a thread's CS consecutive slopes from CS + K - 1 loads (registers)
                ch = tid + k * tpb
                if k < NCS // tpb or ch < NCS:
                    t0 = u64(ch * CS)
                    for i in range(WS):
                        ws[i] = a[t0 + u64(i)]
                    for j in range(CS):
                        acc = 0.0
                        for i in range(K):
                            acc += ws[j + i] * kr[i]
                        y2[t0 + u64(j)] = acc * acc
        else:
            for t in range(tid, YL, tpb):  # slope at clip(ylo + t): the envelope repeats the edge values
                off = _clip(ylo + t, n) - kh - xlo
                acc = 0.0
                for i in range(K):
                    acc += a[u64(off) + u64(i)] * kr[i]
                y2[t] = acc * acc
        _syncthreads()
        for k in range(NRP):  # the RMS window's partial sums: CP consecutive ones from CP + g - 1 loads
            ch = tid + k * tpb
            if k < NCP // tpb or ch < NCP:
                t0 = u64(ch * CP)
                for i in range(WP):
                    wp[i] = y2[t0 + u64(i)]
                for j in range(CP):
                    p = wp[j]
                    for i in range(1, g):
                        p += wp[j + i]
                    part[t0 + u64(j)] = p
        _syncthreads()
        elo = base - nms
        for k in range(NRR):  # the envelope: a thread's CR values g apart, t0 + c * g, from CR + groups - 1
            ch = tid + k * tpb  # partial sums g apart (outside the stream: -inf, never larger; the NMS
            if k < NCR // tpb or ch < NCR:  # window is clipped)
                r = ch // NBR  # the residue mod g; the lanes of a warp mostly share it and take
                t0 = u64(r + g * CR * (ch - r * NBR))  # consecutive runs of CR * g values
                for i in range(WR):
                    wr[i] = part[t0 + u64(i * g)]
                for c in range(CR):
                    t = t0 + u64(c * g)
                    if t < E:
                        acc = wr[c]
                        for q in range(1, groups):
                            acc += wr[c + q]
                        for i in range(groups * g, box):
                            acc += y2[t + u64(i)]
                        v = math.sqrt(max(acc / box, 0.0))
                        if not inner:
                            pos = elo + i64(t)
                            if pos < 0 or pos >= n:
                                v = -_INF
                        a[t] = v
        _syncthreads()
        if RL > 0:  # the first RL levels in registers: CN consecutive maxima of 2**RL from CN + 2**RL - 1 loads
            for k in range(NRN):
                ch = tid + k * tpb
                if k < NCN // tpb or ch < NCN:
                    t0 = u64(ch * CN)
                    for i in range(WN):
                        wn[i] = a[t0 + u64(i)]
                    for lev in range(RL):
                        for i in range(CN + (1 << RL) - (2 << lev)):  # upwards: wn[i + sh] is of the level below
                            p0 = wn[i]
                            p1 = wn[i + (1 << lev)]
                            wn[i] = p1 if p1 > p0 else p0
                    for j in range(CN):
                        y2[t0 + u64(j)] = wn[j]
            _syncthreads()
        if LEVELS > RL:  # the other levels by doubling in shared memory
            _double(y2, part, 1 << RL, E - (2 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 1:
            _double(part, y2, 2 << RL, E - (4 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 2:
            _double(y2, part, 4 << RL, E - (8 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 3:
            _double(part, y2, 8 << RL, E - (16 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 4:
            _double(y2, part, 16 << RL, E - (32 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 5:
            _double(part, y2, 32 << RL, E - (64 << RL) + 1)
            _syncthreads()
        if LEVELS > RL + 6:
            _double(y2, part, 64 << RL, E - (128 << RL) + 1)
            _syncthreads()
        mL = a if LEVELS == 0 else (y2 if (LEVELS - RL) % 2 == 0 else part)
        for r in range(R):
            c = r * tpb + tid
            pos = base + c
            if pos < n:
                v = a[u64(c + nms)]
                w0 = mL[u64(c)]
                w1 = mL[u64(c + W - L)]
                if v > 0 and not (w0 > v or w1 > v):  # _nms_keep(a[c:c + W], nms)
                    k = cuda.atomic.add(cnt, 0, 1)
                    if k < cap:
                        tpos[ti * cap + k] = pos
                        theight[ti * cap + k] = v
                if write_env:
                    env_out[pos] = v
                if not inner:
                    xm = max(xm, abs(np.float64(x[pos])))
        _syncthreads()  # the tile's candidates are in (global writes are visible to the block now)
        # the lowest envelope of each candidate's window in the stream (peaks.valley_at): a thread
        # per candidate (about one per 60 samples: mostly one warp per tile) walks the window, a
        # loop of constant length (the -inf outside the stream only in the edge tiles)
        nc = min(cnt[0], cap)
        for k in range(tid, nc, tpb):
            c = u64(tpos[ti * cap + k] - base)
            m = theight[ti * cap + k]
            if inner:
                for q in range(W):
                    m = min(m, a[c + u64(q)])
            else:
                for q in range(W):
                    u = a[c + u64(q)]
                    if u > -_INF and u < m:
                        m = u
            tvalley[ti * cap + k] = m
        # block maxima: warp w takes the stream blocks jb = w, w + NW, ... that meet this tile
        end = min(base + tile, n)
        gb0 = (base + first) // block
        nj = (end - 1 + first) // block - gb0 + 1
        for j0 in range(0, nj, NW):  # uniform over the block
            jb = j0 + w
            m = -_INF
            if jb < nj:
                lo = max((gb0 + jb) * block - first, base)
                hi = min((gb0 + jb + 1) * block - first, end)
                for p in range(lo + lane, hi, WARP):
                    m = max(m, a[u64(p - elo)])
            red[tid] = m
            _syncthreads()
            if lane == 0 and jb < nj:
                for l in range(1, WARP):
                    m = max(m, red[tid + l])
                cuda.atomic.max(bmax, gb0 + jb - b0, m)
            _syncthreads()
        red[tid] = xm
        _syncthreads()
        if lane == 0:
            for l in range(1, WARP):
                xm = max(xm, red[tid + l])
            redx[w] = xm
        _syncthreads()
        if tid == 0:
            for l in range(1, NW):
                xm = max(xm, redx[l])
            cuda.atomic.max(xmax, 0, xm)
            c = cnt[0]
            if c > cap:
                info[1] = 1
                c = cap
            tcount[ti] = c

    @jit_kernel("cand_eval", sim)
    def cand_eval(x, tcount, offsets, cap, tpos, theight, tvalley, amp, b0, first, edge, weak_ratio, ratio, xmax,
                  noise_valley, noise_slope, noise_level, cand, height, slope, state):
        """One warp per tile (grid-stride), its candidates one after the other (a warp per slot, most
        of them empty, took 181 us on the H200, this 83): each candidate goes to
        ``offsets[tile] + rank`` (rank by position within the tile, so the list
        is sorted), with its height, class (0 dropped:
        edge, below the weak threshold or the flat-line floor, or a peak of a noise burst
        (peaks.noise_mask); 1 weak; 2 strong, against ``amp``, the
        median of the block maxima around its block) and steepest fine slope (peaks.steepest_at_xp:
        the warp despikes the samples around the candidate once into shared memory, each lane takes
        positions of the ``±slope_half`` window, a butterfly max joins them)."""
        dls = cuda.shared.array((CWB, SW), f64)
        kfc = cuda.const.array_like(FTAPS)
        n = x.shape[0]
        lane = cuda.threadIdx.x % WARP
        warp = cuda.grid(1) // WARP
        n_warps = cuda.gridsize(1) // WARP
        floor = 1e-7 * np.float64(xmax[0])
        for ti in range(warp, tcount.shape[0], n_warps):  # uniform over the warp
            num = tcount[ti]
            s0 = ti * cap
            for t in range(num):
                c = tpos[s0 + t]
                h = theight[s0 + t]
                best = 0.0
                st = 0
                if c >= edge and c < n - edge:
                    level = amp[(c + first) // block - b0]
                    if h > weak_ratio * level and h > floor:
                        st = 2 if h > ratio * level else 1
                        dl = dls[cuda.threadIdx.x // WARP]  # this warp's despiked samples around c, once
                        for v0 in range(0, SW, WARP):
                            v = v0 + lane
                            if v < SW:
                                dl[v] = _despiked(x, _clip(c - shalf - fkh + v, n), n)
                        _syncwarp()
                        for u0 in range(0, SP, WARP):
                            u = u0 + lane
                            q = c - shalf + u
                            if u < SP and q >= 0 and q < n:
                                d = 0.0
                                for jj in range(KF):  # the order of peaks.steepest_at_xp's sums
                                    d += dl[u + 2 * fkh - jj] * kfc[jj]
                                d = abs(d)
                                if d > best:
                                    best = d
                        _syncwarp()  # read before the warp's next candidate writes
                        off = WARP // 2
                        while off > 0:
                            o = _shfl_xor(FULL_MASK, best, off)
                            if o > best:
                                best = o
                            off //= 2
                        # peaks.noise_mask: a peak of a noise burst is no candidate
                        if (tvalley[s0 + t] > noise_valley * h and best > noise_slope * h
                                and h < noise_level * level):
                            st = 0
                # rank within the tile (the slots hold arrival order): each lane compares one slot's
                # position (the lanes take strides when a tile has more than 32 slots), a butterfly sum
                r = 0
                for u in range(lane, num, WARP):
                    if tpos[s0 + u] < c:
                        r += 1
                off = WARP // 2
                while off > 0:
                    r += _shfl_xor(FULL_MASK, r, off)
                    off //= 2
                if lane == 0:
                    j = offsets[ti] + r
                    cand[j] = c
                    height[j] = h
                    slope[j] = best
                    state[j] = st

    @cuda.jit(device=True)
    def _beat(p, st, lo, hi, episode, w0, vw):
        """A candidate at global index ``p`` with state ``st`` is emitted: a beat (state >= 3) in
        ``[lo, hi)`` outside the flutter episodes (``episode[k]`` for window ``w0 + k`` of ``vw``
        samples, ``vw = 0``: no episodes; the window clipped to the array, as ``rhythm.flutter_rule``)."""
        if st < 3 or p < lo or p >= hi:
            return False
        if vw > 0:
            return not episode[_clip(p // vw - w0, episode.shape[0])]
        return True

    @jit_kernel("emit_count", sim)
    def emit_count(offsets, cand, state, first, lo, hi, episode, w0, vw, counts):
        """Per tile: how many of its candidates are emitted (:func:`_beat`)."""
        nt = counts.shape[0]
        for ti in range(cuda.grid(1), nt, cuda.gridsize(1)):
            c = 0
            for j in range(offsets[ti], offsets[ti + 1]):
                if _beat(cand[j] + first, state[j], lo, hi, episode, w0, vw):
                    c += 1
            counts[ti] = c

    @jit_kernel("emit", sim)
    def emit(offsets, cand, state, first, lo, hi, episode, w0, vw, out_offsets, peaks):
        """The emitted beats of each tile, in order, at ``out_offsets[tile]`` of ``peaks`` (global indices)."""
        nt = out_offsets.shape[0] - 1
        for ti in range(cuda.grid(1), nt, cuda.gridsize(1)):
            o = out_offsets[ti]
            for j in range(offsets[ti], offsets[ti + 1]):
                p = cand[j] + first
                if _beat(p, state[j], lo, hi, episode, w0, vw):
                    peaks[o] = p
                    o += 1

    return {"dense": dense, "cand_eval": cand_eval, "emit_count": emit_count, "emit": emit}


@functools.lru_cache(maxsize=None)
def kernel_taps(size: int, a: float, reverse: bool = False) -> tuple:
    """Derivative-of-Gaussian taps (:func:`beatflow.detect.peaks.gaussian_derivative`) as constants of the
    kernels, which are compiled per parameter set (immediate operands, no loads): reversed for the
    detection's slope (a correlation: the dense and flutter kernels), as they are for ``cand_eval``'s
    fine slope. Cached: every detection call asks for them."""
    taps = gaussian_derivative(size, a)
    return tuple(float(v) for v in (taps[::-1] if reverse else taps))

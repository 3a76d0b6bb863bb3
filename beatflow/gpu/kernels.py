"""The CUDA kernels of the GPU path (Numba CUDA): beat detection, 1-D non-maximum suppression and
beat embedding.

``segment.detect_peaks``, ``segment.local_maxima`` and ``beats.embed`` dispatch here when their input
is a CuPy array; each wrapper has exactly the contract of the NumPy function it replaces and is tested
against it and against the same loop references (``tests/naive.py``). The seed's two kernels are the
NMS (``nms_tiled``) and the warp-per-beat embedding (``embed_warp``); detection adds a fused envelope,
the block levels and the per-candidate decisions (:func:`detect_peaks_gpu`).

Zero copy
    CuPy arrays go to the kernels as views (``cuda.as_cuda_array`` over their
    ``__cuda_array_interface__``, no host round trip, no device copy), outputs are allocated with
    CuPy, and the kernels are launched on CuPy's current stream so that they are ordered with the
    CuPy work around them (no extra synchronisation). The detection with the flutter rule forks two
    side streams of the calling thread and joins them back with events before it emits the peaks
    (:func:`detect_beats_gpu`); every array they use stays referenced until its synchronisation.

Simulator
    With ``NUMBA_ENABLE_CUDASIM=1`` (set before Numba is imported) the same kernels run on the CPU
    on NumPy arrays, so CI (no GPU, no CuPy) tests them. The simulator has no warp shuffles, so
    there ``shfl_sync``/``shfl_down_sync``/``shfl_xor_sync`` are emulated by an exchange buffer
    between two per-block barriers (exact because the embedding kernel then runs one-warp blocks),
    and ``syncthreads`` by a ``threading.Barrier`` (much faster than the simulator's own).

Numba is imported lazily, on the first call (as STUMPY's gpu modules do): importing this module
costs nothing, and without a CUDA GPU and without the simulator the wrappers raise
:class:`~beatflow.errors.DeviceError`.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import struct as _struct
import sys
import threading
import weakref

import numpy as np

from beatflow.errors import DeviceError

__all__ = ["local_maxima_gpu", "embed_gpu", "detect_peaks_gpu", "detect_beats_gpu", "beat_rows_gpu",
           "segment_rows_gpu", "SegmentGraph", "simulator_active"]

WARP = 32
_FULL_MASK = 0xFFFFFFFF
_INF = math.inf
# NMS: threads per block; a tile of ``_NMS_TPB + 2*half`` float64 must fit in shared memory
_NMS_TPB = 256
_SHARED_BYTES = 48 * 1024
# embed: warps per block (one warp per beat)
_EMBED_WARPS = 8
_EMBED_CLAIM = 4  # rows a warp claims at once (embed_warp)
# the simulator runs one Python thread per CUDA thread: few blocks, grid-stride loops do the rest
_SIM_NMS_TPB = 32
_SIM_MAX_BLOCKS = 4
# detection: threads per block of the envelope tiles and of the per-candidate kernels; the widest
# window of blocks the level's median takes (2 * threshold_blocks + 1)
_CAND_TPB = 128
# the one-block exclusive scan: threads (GPU; the simulator runs one warp), counts per thread and piece
_SCAN_TPB = 1024
_SCAN_PER = 4
_SCAN_PIECE = _SCAN_PER * _SCAN_TPB  # (a constant for the shared array's size)
_MAX_WINDOW = 63

# set by _build() (module globals, so that the simulator can swap ``cuda`` inside the kernels)
cuda = None
_shfl_idx = _shfl_down = _shfl_xor = _syncthreads = _syncwarp = None
_F64 = np.float64  # dtype of the shared tile (the simulator wants a dtype instance, see _build)


def simulator_active() -> bool:
    """Whether ``numba.cuda`` is the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before Numba's import)."""
    try:
        from numba import cuda as c
    except Exception:
        return False
    return c.is_available.__module__.endswith("simulator_init")


# --- the simulator's stand-ins for barriers and warp shuffles -------------------------------------
# The simulator runs each CUDA thread as a Python thread and has no warp shuffles. Here a barrier is
# a threading.Barrier per block (the simulator's own syncthreads polls, ~20 ms a call on a busy
# machine; this is ~1 ms), and a shuffle is an exchange through a per-block buffer between two
# barriers. A shuffle is a warp operation, so kernels that shuffle run one-warp blocks there.
_sim_lock = threading.Lock()
_sim_blocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # launch -> {block: state}


def _sim_block_state():
    launch = cuda  # the simulator's per-launch module object, swapped in while a kernel runs
    block = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z)
    with _sim_lock:
        per_launch = _sim_blocks.setdefault(launch, {})
        state = per_launch.get(block)
        if state is None:
            d = cuda.blockDim
            state = per_launch[block] = (threading.Barrier(d.x * d.y * d.z), [None] * WARP)
    return state


def _sim_syncthreads():
    _sim_block_state()[0].wait(timeout=120)  # a thread that failed breaks it instead of hanging the rest


def _sim_exchange(value, src_lane):
    barrier, buf = _sim_block_state()
    lane = cuda.threadIdx.x % WARP
    buf[lane] = value
    barrier.wait(timeout=120)
    out = buf[src_lane]
    barrier.wait(timeout=120)
    return out


def _sim_shfl_idx(mask, value, src_lane):
    return _sim_exchange(value, src_lane)


def _sim_shfl_down(mask, value, delta):
    lane = cuda.threadIdx.x % WARP
    return _sim_exchange(value, lane + delta if lane + delta < WARP else lane)


def _sim_shfl_xor(mask, value, lane_mask):
    return _sim_exchange(value, (cuda.threadIdx.x % WARP) ^ lane_mask)


def _sim_lock_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` thread-safe.

    It finds a block's array by the calling line in a dict, and creates it on the first call
    without a lock: threads of a launch's first block that call it at the same time can each get an
    array of their own, so "shared" writes are lost (seen as a tile whose candidate count stayed 0,
    a rare failure of the kernel tests under the simulator). Same lookup, under a lock."""
    import traceback

    try:
        from numba.core import types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support

        shared = kernelapi.FakeCUDAShared
        if not hasattr(shared(0), "_allocations"):
            return
    except Exception:  # another simulator layout: leave it as it is
        return
    if getattr(shared.array, "_beatflow_locked", False):
        return
    orig = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one preallocated buffer, no race
            return orig(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2]  # (file, line) as the original
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array._beatflow_locked = True
    shared.array = array


#: per-kernel register caps (``max_registers``; ptxas then spills what does not fit), a kernel
#: absent from it gets what ptxas chooses; ``BEATFLOW_MAXREG="dense=64,vf_energy=96"`` overrides
#: them (read once, when the kernels are first built: for benchmarks, each variant a process). On
#: the H200 (``bench/gpu_maxreg.py``, session 9): dense 72 -> 64 registers, 4 blocks of 256 threads per
#: SM instead of 3, 1.01 -> 0.93 ms; embed_warp 72 -> 48, 0.244 -> 0.195 ms; vf_energy 117 -> 96, 5
#: blocks of 128 instead of 4 (the detection with the rule 1.69 -> 1.66 ms); the same peaks and rows.
#: Session 13: embed_warp built per row width needs 56 (48 spilled 44 bytes): 0.136 ms against 0.143.
#: Session 14: the dense kernel's register windows (``_DENSE_CHUNKS``) need 72 without spills (64 spills
#: 4 bytes); 7 blocks of 128 threads per SM either way (shared memory allows 7).
_MAXREG_DEFAULT: dict = {"dense": 72, "embed_warp": 56, "vf_energy": 96}


def _maxreg() -> dict:
    out = dict(_MAXREG_DEFAULT)
    for item in os.environ.get("BEATFLOW_MAXREG", "").split(","):
        if "=" in item:
            name, value = item.split("=", 1)
            out[name.strip()] = int(value)
    return {k: v for k, v in out.items() if v > 0}


def _kernel(name: str, sim: bool):
    """``cuda.jit`` for the kernel ``name``, with its register cap (none under the simulator)."""
    cap = None if sim else _maxreg().get(name)
    return cuda.jit(max_registers=cap) if cap else cuda.jit


@functools.lru_cache(maxsize=None)
def _build():
    """Import Numba CUDA and compile-define the kernels (once). Returns ``(kernels dict, simulator?)``."""
    global cuda, _shfl_idx, _shfl_down, _shfl_xor, _syncthreads, _syncwarp, _F64
    try:
        from numba import cuda as numba_cuda
    except Exception as e:  # numba absent or broken (numba-cuda on numpy 2.5: "no attribute 'row_stack'")
        raise DeviceError(f"the GPU kernels need Numba CUDA (pip install numba-cuda): {e}") from e
    sim = numba_cuda.is_available.__module__.endswith("simulator_init")
    if not sim and not numba_cuda.is_available():
        raise DeviceError("no CUDA GPU for the Numba kernels (beatflow.gpu.kernels); set NUMBA_ENABLE_CUDASIM=1 "
                          "before Numba is imported to run them on the CPU simulator")
    cuda = numba_cuda
    if sim:
        _sim_lock_shared_arrays()
        _shfl_idx, _shfl_down, _shfl_xor = _sim_shfl_idx, _sim_shfl_down, _sim_shfl_xor
        _syncthreads = _sim_syncthreads
        _syncwarp = _sim_syncthreads  # kernels that shuffle run one-warp blocks there
        _F64 = np.dtype(np.float64)  # its dynamic shared array reads dtype.itemsize
    else:
        # thin device functions (inlined by LLVM) so that the kernels name one function either way
        @cuda.jit(device=True)
        def _shfl_idx(mask, value, src_lane):
            return cuda.shfl_sync(mask, value, src_lane)

        @cuda.jit(device=True)
        def _shfl_down(mask, value, delta):
            return cuda.shfl_down_sync(mask, value, delta)

        @cuda.jit(device=True)
        def _shfl_xor(mask, value, lane_mask):
            return cuda.shfl_xor_sync(mask, value, lane_mask)

        @cuda.jit(device=True)
        def _syncthreads():
            cuda.syncthreads()

        @cuda.jit(device=True)
        def _syncwarp():
            cuda.syncwarp(_FULL_MASK)

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

    # --- detection (segment.detect_peaks on the GPU): the dense stages are built per parameter set
    # by _detect_build (their loop bounds are compile-time constants); the decisions over the sparse
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
        """Strong candidates that are the T wave of the previous strong one (segment.t_wave_mask)
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
        """segment.refractory_mask over the candidates whose state is ``member``: a member closer
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
        """segment.search_back: weak candidates (state 1) that fill a gap among the beats (state 3)
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
            # segment.search_back's min(c - 0, max_gap); likewise min(n - 1 - c, max_gap) after it
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
        sh = cuda.shared.array(_CAND_TPB, np.int64)
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
        sh = cuda.shared.array(_CAND_TPB, np.int64)
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

    @cuda.jit(device=True)
    def _warp_inclusive(v, lane):
        """Inclusive prefix sum of ``v`` over the warp's lanes (shuffles from ``lane - off``)."""
        off = 1
        while off < WARP:
            u = _shfl_idx(_FULL_MASK, v, lane - off if lane >= off else lane)
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

    return {"nms_tiled": nms_tiled, "nms_global": nms_global, "beats_count": beats_count, "beats_write": beats_write,
            "exclusive_scan": exclusive_scan,
            "block_median": block_median, "cand_twave": cand_twave, "cand_refractory": cand_refractory,
            "cand_search_back": cand_search_back, "_clip": _clip, "_despiked": _despiked,
            "_window_median": _window_median, "_nms_keep": _nms_keep}, sim


# --- host side -----------------------------------------------------------------------------------
def _is_device(a) -> bool:
    # the class first: CuPy builds the interface's dict on every access of the instance attribute
    return hasattr(type(a), "__cuda_array_interface__") or hasattr(a, "__cuda_array_interface__")


class _Ctx:
    """Where one call's arrays live: ``xp`` (cupy on the GPU, numpy in the simulator), how kernel
    arguments are passed, and the stream to launch on."""

    #: where the call's arrays come from: None, fresh ones from the pool; a :class:`_Workspace`, the
    #: same arrays on every pass (:class:`SegmentGraph`)
    ws = None

    def __init__(self, sim: bool):
        self.sim = sim
        if sim:
            self.xp = np
            self.stream_ptr = 0
        else:
            try:
                import cupy
            except ImportError as e:
                raise DeviceError("the GPU kernels return CuPy arrays: install cupy") from e
            self.xp = cupy
            self.cstream = cur = cupy.cuda.get_current_stream()
            self.stream_ptr = cur.ptr
            self.dev = cupy.cuda.runtime.getDevice()
            self._stream = None  # Numba's view of it: made for a launch through Numba only

    @property
    def stream(self):
        """The stream as Numba takes it (a kernel's first launch goes through Numba)."""
        if self.sim:
            return 0
        if self._stream is None:
            ptr = self.stream_ptr
            self._stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        return self._stream

    def arg(self, a):
        """A kernel argument as it is: NumPy in the simulator, the CuPy array itself on the GPU (the
        launch passes its device pointer, no copy and no synchronisation: the kernel runs on CuPy's
        stream, after the work that produced ``a``)."""
        return a

    def array(self, a, dtype=None):
        """``a`` in this call's namespace (no copy when it already is, with that dtype)."""
        if self.sim:
            if _is_device(a):
                raise DeviceError("the CUDA simulator takes NumPy arrays, not device arrays")
            return np.ascontiguousarray(a, dtype=dtype)
        return self.xp.ascontiguousarray(self.xp.asarray(a), dtype=dtype)

    def empty(self, shape, dtype):
        """An array for this call's launches: from the pool, or the workspace's next one."""
        if self.ws is None:
            return self.xp.empty(shape, dtype=dtype)
        return self.ws.take(self.xp, shape, dtype)

    def zeros(self, shape, dtype):
        """:meth:`empty` set to zero (a memset on this call's stream)."""
        if self.ws is None:
            return self.xp.zeros(shape, dtype=dtype)
        a = self.ws.take(self.xp, shape, dtype)
        a.fill(0)
        return a

    def blocks(self, needed: int) -> int:
        return max(1, min(needed, _SIM_MAX_BLOCKS)) if self.sim else max(1, needed)

    def fork(self, high: bool = False):
        """A context on one of this thread's two side streams (:func:`_side_streams`; ``high``: the
        one of the device's highest priority), which starts behind the work queued on this one so
        far: ``(side, join)``, where ``join()`` makes this stream wait for what was by then
        launched on the side. In the simulator (one stream): ``(self, no-op)``.

        The caller keeps every array that a side launch uses referenced until after ``join`` and
        the synchronisation behind it: the memory pools are ordered by the allocating stream, so an
        array freed while the side stream still reads it could be handed to the next allocation
        on this one (session 16's first two-stream try lost peaks that way)."""
        if self.sim:
            return self, _no_join
        stream = _side_streams()[1 if high else 0]
        side = object.__new__(_Ctx)
        side.sim, side.xp, side.cstream, side.stream_ptr, side._stream = False, self.xp, stream, stream.ptr, None
        side.dev, side.ws = self.dev, self.ws
        stream.wait_event(self.cstream.record())

        def join():
            self.cstream.wait_event(stream.record())

        return side, join

    def launch(self, kernel, blocks: int, threads: int, shared: int, *args, sig=None):
        """``kernel[blocks, threads, stream, shared](*args)``.

        ``sig``: where the call site's argument kinds (dtype, dimensions, contiguity; scalar types)
        follow from a few of them, a key made of those (the dtype of its input, or ``""`` when all
        its arrays are made with fixed dtypes by the caller). It selects the compiled kernel without
        reading every argument's kind on each launch (~0.5 µs an argument, 16 for ``dense``).

        On the GPU a kernel's first launch with a given signature goes through Numba (which compiles
        it), the next ones through :class:`_FastLaunch` (CuPy's driver call with the arguments packed
        as Numba lays them out): Numba's own launch converts and types every argument on each call,
        about 14 µs per CuPy array, 100-270 µs per detection kernel on the H200 (session 6), which
        the GPU spends waiting. In the simulator the interpreter's thread switch interval is cut while
        a kernel runs: its block manager busy-polls, and with the default 5 ms every barrier of its
        Python threads waits for the GIL."""
        if not self.sim:
            fast = _FastLaunch.get(kernel, args, self.dev, sig) if _FAST_LAUNCH else None
            if fast is not None:
                fast(blocks, threads, shared, self.stream_ptr, args)
                return
            nargs = [cuda.as_cuda_array(a, sync=False) if _is_device(a) else a for a in args]
            kernel[blocks, threads, self.stream, shared](*nargs)
            if _FAST_LAUNCH:
                _FastLaunch.register(kernel, args, nargs, self.dev, sig)
            return
        from beatflow.device import switch_interval

        with switch_interval(2e-4):
            kernel[blocks, threads, 0, shared](*args)


def _no_join():
    pass


class _Workspace:
    """The arrays of one sequence of launches, kept for the next passes over it: the first pass
    (``recording``) allocates them and keeps them in the order it asked for them; every later pass
    asks in the same order and gets the same arrays back, with no allocation (what capturing the
    launches in a CUDA graph needs: the pool's allocations are not stream-capture safe, and the
    graph's kernels keep the addresses they were captured with)."""

    def __init__(self):
        self.arrays: list = []
        self.recording = True
        self.i = 0

    def rewind(self):
        """Start a pass that hands out the kept arrays again."""
        self.recording, self.i = False, 0

    def take(self, xp, shape, dtype):
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(v) for v in shape)
        if self.recording:
            a = xp.empty(shape, dtype=dtype)
            self.arrays.append(a)
            return a
        if self.i >= len(self.arrays):
            raise RuntimeError(f"a replayed pass asked for array {self.i + 1}; the recorded pass made "
                               f"{len(self.arrays)}")
        a = self.arrays[self.i]
        if a.shape != shape or a.dtype != np.dtype(dtype):
            raise RuntimeError(f"a replayed pass asked for array {self.i + 1} as {shape} {np.dtype(dtype)}; "
                               f"the recorded pass made it {a.shape} {a.dtype}")
        self.i += 1
        return a


_side = threading.local()


def _side_streams():
    """This thread's two side streams on the current device, made once: ``(low, high)``, both
    non-blocking, ``high`` at the device's highest priority (where the runtime offers none, a second
    stream of the default priority)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    streams = getattr(_side, "streams", None)
    if streams is None:
        streams = _side.streams = {}
    pair = streams.get(dev)
    if pair is None:
        rt = cupy.cuda.runtime
        try:
            _, greatest = rt.deviceGetStreamPriorityRange()
            high = cupy.cuda.ExternalStream(rt.streamCreateWithPriority(rt.streamNonBlocking, greatest))
        except Exception:  # (the stream lives as long as the thread's entry: for the process)
            high = cupy.cuda.Stream(non_blocking=True)
        pair = streams[dev] = (cupy.cuda.Stream(non_blocking=True), high)
    return pair


#: the detection's kernels on three streams (BEATFLOW_DETECT_STREAMS=0: one): the flutter rule's
#: beside the dense kernel's last blocks and the candidates', the candidates' at high priority
_STREAMS = os.environ.get("BEATFLOW_DETECT_STREAMS", "1") not in ("0", "false", "no")

#: launch compiled kernels through CuPy's driver call (False, or BEATFLOW_FAST_LAUNCH=0: always through Numba)
_FAST_LAUNCH = os.environ.get("BEATFLOW_FAST_LAUNCH", "1") not in ("0", "false", "no")


def _arg_key(a):
    """What selects a kernel's compiled signature: (dtype, ndim, C-contiguous) of an array, the
    Python type of a scalar. (Read per argument on every launch: CuPy's ``_c_contiguous`` attribute,
    not its ``flags`` object, which is built anew on each access.)"""
    c = getattr(a, "_c_contiguous", None)
    if c is not None:  # a CuPy array
        return (a.dtype, a.ndim, c)
    if _is_device(a):
        return (a.dtype, a.ndim, bool(a.flags.c_contiguous))
    return type(a)


class _FastLaunch:
    """A compiled Numba kernel launched with ``cupy.cuda.driver.launchKernel``.

    The kernel's cubin (Numba's, for this device) is loaded as a CuPy module once; each launch
    packs the arguments into one buffer of 8-byte slots in Numba's kernel ABI (per array: meminfo,
    parent, size, itemsize, data pointer, shape, strides in bytes; per scalar: its value; the driver
    reads as many bytes of a slot as the parameter has) with one ``struct.pack_into`` and launches.
    The slot pointers are fixed, so packing and launching hold a lock (Dask workers launch from
    several threads). Kernels with module set-up code, debug or cooperative kernels stay with Numba.
    """

    _cache: dict = {}
    _lock = threading.Lock()
    errors: dict = {}  #: kernel name -> why it stays with Numba's launch

    def __init__(self, fn, module, fmt: str, kinds: tuple, nslots: int):
        import ctypes

        self.fn, self.module, self.fmt, self.kinds = fn, module, fmt, kinds
        self.buf = (ctypes.c_int64 * max(1, nslots))()
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(1, nslots))(*[base + 8 * i for i in range(nslots)])
        self.params = ctypes.addressof(self.ptrs)
        self.lock = threading.Lock()

    @staticmethod
    def _key(kernel, args, dev, sig):
        """The launcher's key: the kernel, the device, and the arguments' kinds (or the call
        site's ``sig`` for them, see :meth:`_Ctx.launch`)."""
        if sig is not None:
            return (id(kernel), dev, len(args), sig)
        return (id(kernel), dev, tuple(_arg_key(a) for a in args))

    @classmethod
    def get(cls, kernel, args, dev, sig=None):
        return cls._cache.get(cls._key(kernel, args, dev, sig))

    @classmethod
    def register(cls, kernel, args, nargs, dev, sig=None):
        """After Numba's launch of ``kernel`` with ``nargs`` (``args`` as Numba sees them): its
        compiled overload, as a fast launcher for calls with the same argument kinds."""
        import cupy

        key = cls._key(kernel, args, dev, sig)
        if key in cls._cache:
            return
        try:
            sig = tuple(kernel.typeof_pyval(a) for a in nargs)
            ov = kernel.overloads[sig]
            lib = ov._codelibrary
            if (getattr(ov, "debug", False) or getattr(ov, "cooperative", False)
                    or getattr(ov, "launch_config_sensitive", False) or getattr(lib, "_setup_functions", None)):
                cls._cache[key] = None
                return
            try:
                cubin = lib.get_cubin()  # bytes, or (recent numba-cuda) a cuda.core ObjectCode
                cubin = cubin if isinstance(cubin, (bytes, bytearray)) else getattr(cubin, "code", cubin)
                module = cupy.cuda.function.Module()
                module.load(bytes(cubin))
                fn = module.get_function(lib._entry_name).ptr
            except Exception:  # the function Numba loaded (a CUkernel, which cuLaunchKernel takes too)
                module, fn = None, int(lib.get_cufunc().handle)
        except Exception as e:  # an unexpected Numba layout: keep launching through Numba
            cls.errors[getattr(kernel, "__name__", str(kernel))] = f"{type(e).__name__}: {e}"
            cls._cache[key] = None
            return
        fmt, kinds, nslots = "<", [], 0
        for a in args:
            if _is_device(a):
                fmt += "q" * (5 + 2 * a.ndim)
                kinds.append(a.ndim)
                nslots += 5 + 2 * a.ndim
            else:
                fmt += "d" if isinstance(a, (float, np.floating)) else "q"
                kinds.append(-1)
                nslots += 1
        with cls._lock:
            cls._cache[key] = cls(fn, module, fmt, tuple(kinds), nslots)

    def __call__(self, blocks: int, threads: int, shared: int, stream_ptr: int, args):
        import cupy

        vals = []
        for a, k in zip(args, self.kinds):
            if k >= 0:
                vals += (0, 0, a.size, a.itemsize, a.data.ptr)
                vals += a.shape
                vals += a.strides
            else:
                vals.append(a)
        with self.lock:
            _struct.pack_into(self.fmt, self.buf, 0, *vals)
            cupy.cuda.driver.launchKernel(self.fn, int(blocks), 1, 1, int(threads), 1, 1, int(shared),
                                          stream_ptr, self.params, 0)


def _ctx_for(*arrays) -> tuple[_Ctx, bool]:
    """The call's context, and whether results go back to the host (NumPy input on a real GPU)."""
    kernels, sim = _build()
    ctx = _Ctx(sim)
    host_in = not sim and not any(_is_device(a) for a in arrays)
    return ctx, host_in


def _vector_call(a, name: str):
    """``(ctx, host_in, kernels, xp, a)`` for a kernel wrapper whose input ``a`` is a 1-D array."""
    ctx, host_in = _ctx_for(a)
    kernels, _ = _build()
    a = ctx.array(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return ctx, host_in, kernels, ctx.xp, a


def local_maxima_gpu(env, half_window: int, *, tiled: bool | None = None):
    """Indices where ``env`` is the maximum of its ``±half_window`` neighbourhood and positive.

    Exactly :func:`beatflow.detect.peaks.local_maxima` (``maximum_filter1d(env, 2*half+1,
    mode="nearest")``, gate ``env == max & env > 0``, flatnonzero): a 1-D non-maximum suppression
    kernel, one thread per sample, writes a uint8 gate; the indices are ``flatnonzero(gate)``.

    Parameters
    ----------
    env : CuPy array (or NumPy under the simulator), 1-D
    half_window : int
        Half width of the window (>= 0); the window is clipped at the ends.
    tiled : bool, optional
        Stage tiles with their halo in shared memory (default: when the tile fits in 48 KiB).

    Returns
    -------
    int64 array of indices, in the namespace of ``env``.
    """
    half = int(half_window)
    if half < 0:
        raise ValueError(f"half_window must be >= 0, got {half}")
    ctx, host_in, kernels, xp, env = _vector_call(env, "env")
    n = int(env.shape[0])
    if n == 0:
        out = xp.zeros(0, dtype=xp.int64)
        return xp.asnumpy(out) if host_in else out
    gate = xp.empty(n, dtype=xp.uint8)
    tpb = _SIM_NMS_TPB if ctx.sim else _NMS_TPB
    shared = (tpb + 2 * half) * 8
    if tiled is None:
        tiled = shared <= _SHARED_BYTES
    if tiled:
        ctx.launch(kernels["nms_tiled"], ctx.blocks(-(-n // tpb)), tpb, shared, ctx.arg(env), half, ctx.arg(gate))
    else:
        ctx.launch(kernels["nms_global"], ctx.blocks(-(-n // tpb)), tpb, 0, ctx.arg(env), half, ctx.arg(gate))
    out = xp.flatnonzero(gate).astype(xp.int64, copy=False)
    return xp.asnumpy(out) if host_in else out


@functools.lru_cache(maxsize=None)
def _embed_build(width: int):
    """The embedding kernel for rows of ``width`` samples (its loops over a row have constant bounds)."""
    kernels, sim = _build()
    NJ = -(-width // WARP)  # a lane's samples of a row
    f32 = np.float32

    @_kernel("embed_warp", sim)
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
            first_row = _shfl_idx(_FULL_MASK, first_row, 0)
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
                        acc += _shfl_xor(_FULL_MASK, acc, off)
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
                    lo = min(lo, _shfl_down(_FULL_MASK, lo, off))
                    hi = max(hi, _shfl_down(_FULL_MASK, hi, off))
                    off //= 2
                if lane == 0:
                    p2p[row] = hi - lo if ln > 0 else f32(0.0)

    return embed_warp


def embed_gpu(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0,
              claim: int = _EMBED_CLAIM, _count=None):
    """Each beat in a row of a zero-padded ``(n, width)`` float32 matrix, and its peak-to-peak.

    Exactly :func:`beatflow.embed.beats.embed` for beats with ``0 < length <= width`` lying in ``x``: row
    ``i`` is ``x[start[i]-first : start[i]-first+length[i]]`` (as float32) minus, when
    ``baseline_samples > 0``, the mean of the first ``min(baseline_samples, width)`` samples of the
    beat's window, then zeros; ``p2p[i]`` is the range of the row's valid samples.

    A beat with ``length <= 0`` or ``length > width`` is skipped: its row is all zeros and its p2p 0
    (``beats.embed`` leaves those undefined). Reads are clipped to ``x``, writes to the output, so a
    bad ``start`` cannot touch memory outside the arrays.

    Row order: the kernel's warps claim rows with an atomic counter (``claim`` rows at a time) and
    embed the beats of the rows they claimed, so rows come out in beat order, the same as
    ``beats.embed`` (and deterministic), with no scatter and no device-to-host synchronisation.
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
    ctx, host_in = _ctx_for(x, start, length)
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
    """:func:`beatflow.embed.beats.beat_rows` on the GPU: the kept beats of ``peaks`` and their rows in
    three kernel launches and one synchronisation (the number of kept beats).

    ``beats_count`` counts the kept beats (``beats.beats_from_peaks`` then ``beats.kept_mask``) of
    each chunk of 128 consecutive beats, ``beats_write`` writes them in order (each chunk's place
    from the counts before it, each beat's from a block scan of the flags) with their row lengths
    (``beats.row_lengths``), and ``embed_warp`` writes their rows (:func:`embed_gpu`, the number of
    beats read on the device). The arrays are sized for every beat of ``peaks`` and cut to the kept
    ones after the one synchronisation.

    Parameters and result as :func:`beatflow.embed.beats.beat_rows` (``x``, ``peaks`` CuPy arrays, or
    NumPy under the simulator).
    """
    ctx, host_in = _ctx_for(x, peaks)
    xp = ctx.xp
    x = ctx.array(x)
    peaks = ctx.array(peaks, dtype=np.int64).reshape(-1)
    npk = int(peaks.shape[0])
    total = xp.zeros(1, dtype=xp.int64)
    out = _rows_launch(ctx, x, peaks, xp.full(1, npk, dtype=xp.int64), total, s, first, n_samples,
                       baseline_samples, npk)
    m = int(total[0]) if ctx.sim else int(total.get()[0])  # the one synchronisation
    out = tuple(v[:m] for v in out)
    return tuple(xp.asnumpy(v) for v in out) if host_in else out


def _rows_launch(ctx, x, peaks, npeaks, total, s, first: int, n_samples: int, baseline_samples: int, cap: int):
    """Launch ``beats_count``, ``beats_write`` and ``embed_warp`` for the peaks ``peaks[:npeaks[0]]``
    (``npeaks``: a device array; ``cap`` >= that count sizes the outputs); the number of kept beats
    goes to ``total[0]`` (zero before). Returns ``(index, peak, start, length, rows, p2p)`` of ``cap - 1``
    entries, the first ``total[0]`` of them written."""
    xp = ctx.xp
    kernels, _ = _build()
    nb = max(int(cap) - 1, 0)
    tpb = WARP if ctx.sim else _CAND_TPB
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


def segment_rows_gpu(x, s, *, baseline_samples: int = 0):
    """A whole recording's beats and their rows on the GPU with one synchronisation:
    :func:`detect_beats_gpu` then :func:`beat_rows_gpu`, the second launched behind the first before
    anything comes back to the host (the peaks and their number stay on the device; the rows'
    kernels are launched for the detection's candidate capacity, so their outputs are sized for it:
    about 19 rows of ``s.width`` float32 per 1024 samples, 0.35 GB for 20 h at 250 Hz).

    Returns ``(peaks, episodes, index, peak, start, length, rows, p2p)``: those of
    :func:`beatflow.detect.peaks.detect_beats` and of :func:`beatflow.embed.beats.beat_rows` (``x`` the whole
    recording: ``first = 0``, ``n_samples = len(x)``), in the namespace of ``x``.
    """
    peaks, ep, rows = _detect_gpu(x, s, 0, None, None, rule=s.vf_baseline > 0,
                                  rows=max(0, int(baseline_samples)))
    return (peaks, ep) + tuple(rows)


class SegmentGraph:
    """:func:`segment_rows_gpu` over one device buffer, again and again: for a caller that writes
    each new stretch of signal into the same array (a monitor's window, fixed-size partitions) and
    segments it. The launches of a call are captured once in a CUDA graph, over arrays kept for it
    (a :class:`_Workspace`); each call replays the graph (one launch for all the kernels, no host
    work between them, no allocation) and waits once, as :func:`segment_rows_gpu` does.

    ``x``: the buffer (1-D, contiguous; a CuPy array, or NumPy under the simulator), read again by
    every call: the graph's kernels keep its address. ``graph=False``: the same kept arrays, the
    kernels launched one by one (what runs under the simulator, which has no graphs).

    Calling it returns :func:`segment_rows_gpu`'s tuple for the buffer's present contents. Those
    arrays are views of the kept ones: valid until the next call (copy what must outlive it). When
    a tile's candidate slots overflow, that call runs :func:`segment_rows_gpu`'s retry and returns
    fresh arrays.
    """

    def __init__(self, x, s, *, baseline_samples: int = 0, graph: bool = True):
        ctx, host_in = _ctx_for(x)
        if host_in:
            raise ValueError("SegmentGraph reads a device buffer: pass a CuPy array (NumPy only under the "
                             "CUDA simulator)")
        if getattr(x, "ndim", None) != 1 or not x.flags.c_contiguous:
            raise ValueError(f"SegmentGraph's buffer must be a contiguous 1-D array, got shape "
                             f"{getattr(x, 'shape', None)}")
        n = int(x.shape[0])
        self.plan = None if n < 3 else _detect_plan(s, ctx.sim)
        if self.plan is None:
            raise ValueError(f"SegmentGraph takes what the detection kernels take: a stream of at least 3 "
                             f"samples ({n} given) and windows that fit their tiles")
        self.x, self.s, self.sim = x, s, ctx.sim
        self.rule, self.rows = s.vf_baseline > 0, max(0, int(baseline_samples))
        self.ws = _Workspace()
        self.graph = None
        self.stream = None
        if not ctx.sim:  # (a graph is captured on a stream of its own, never the legacy default one)
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
        # the first pass: the arrays made and kept, every kernel compiled and launched once
        ctx, st = self._pass()
        with self._on_stream():
            _detect_sync(ctx, st)
        self.ws.rewind()
        if graph and not ctx.sim:
            with self.stream:
                self.stream.begin_capture()
                try:
                    self._st = self._launch()
                finally:
                    g = self.stream.end_capture()  # (ends the capture on an error too)
            self.graph = g
            self.graph.upload(self.stream)

    def _launch(self):
        ctx = _Ctx(self.sim)
        ctx.ws = self.ws
        self.ws.i = 0
        st = _detect_launch(ctx, self.plan, self.x, self.s, 0, None, None, self.rule, self.rows)
        if not self.ws.recording and self.ws.i != len(self.ws.arrays):
            raise RuntimeError(f"a replayed pass took {self.ws.i} of the {len(self.ws.arrays)} kept arrays")
        return ctx, st

    def _on_stream(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def _pass(self):
        with self._on_stream():
            return self._launch()

    def __call__(self):
        if self.graph is None:
            ctx, st = self._pass()
        else:
            ctx, st = self._st
            self.graph.launch(self.stream)
        with self._on_stream():
            peaks, ep, rows = _detect_finish(ctx, st, _detect_sync(ctx, st), False)
        return (peaks, ep) + tuple(rows)


#: blocks of embed_warp when the number of rows is known on the device only (the warps claim rows
#: until they pass it; a grid for the capacity would spend an atomic claim per idle warp)
_EMBED_COUNT_BLOCKS = 1024


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
_DENSE_CHUNKS = (11, 11, 11, 9)
#: levels of the NMS window maxima the dense kernel takes in registers (the rest by doubling; at least 1)
_REG_LEVELS = 3


def _dense_alloc(K: int, box: int, nms: int, tile: int, chunks: tuple):
    """Lengths of the dense kernel's three shared buffers ``(a, y2, part)``: the stages' lengths
    (:func:`_dense_tile`) rounded up to what the last chunk of each stage reads or writes (values
    past a stage's length are never read into one within it)."""
    g, groups, E, YL, XL, PL = _dense_tile(K, box, nms, tile)
    CS, CP, CR, CN = chunks
    RL = min((2 * nms + 1).bit_length() - 1, max(1, _REG_LEVELS))
    ns, np_ = -(-YL // CS) * CS, -(-PL // CP) * CP
    nr = g - 1 + g * (-(-(-(-E // g)) // CR) * CR + groups - 2) + 1  # the envelope's last chunk reads part[:nr]
    nn = -(-(E - (1 << RL) + 1) // CN) * CN
    xa = max(XL, ns + K - 1, nn + (1 << RL) - 1)
    ya = max(YL, ns, np_ + g - 1, nn)
    pa = max(PL, np_, nr)
    return xa, ya, pa


@functools.lru_cache(maxsize=None)
def _detect_build(K: int, box: int, nms: int, block: int, KF: int, shalf: int, tile: int, tpb: int,
                  taps: tuple, ftaps: tuple, chunks: tuple = _DENSE_CHUNKS):
    """The detection kernels for one set of window sizes (their loops then have constant bounds,
    which NVVM unrolls: a fused stage whose every bound was a runtime value issued ~4x the
    instructions). Cached per parameter set; compiled by Numba on first launch."""
    kernels, sim = _build()
    _clip, _despiked = kernels["_clip"], kernels["_despiked"]
    kh, bh = K // 2, box // 2
    g, groups, E, YL, XL, PL = _dense_tile(K, box, nms, tile)
    W = 2 * nms + 1  # the NMS window, and the largest power of two in it (2**LEVELS)
    LEVELS = W.bit_length() - 1
    L = 1 << LEVELS
    RL = min(LEVELS, max(1, _REG_LEVELS))  # levels of the window maxima taken in registers
    CS, CP, CR, CN = chunks
    XA, YA, PA = _dense_alloc(K, box, nms, tile, chunks)
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
    CWB = _CAND_TPB // WARP  # cand_eval's warps per block
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

    @_kernel("dense", sim)
    def dense(x, first, b0, write_env, env_out, bmax, xmax, cap, tcount, tpos, theight, tvalley, info):
        """One tile of ``tile`` samples per block, everything in shared memory: 3-point median,
        derivative-of-Gaussian slope, RMS over ``box`` (the sums of ``cpu_kernels.envelope_cpu``
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
        # the lowest envelope of each candidate's window in the stream (segment.valley_at): a thread
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

    @_kernel("cand_eval", sim)
    def cand_eval(x, tcount, offsets, cap, tpos, theight, tvalley, amp, b0, first, edge, weak_ratio, ratio, xmax,
                  noise_valley, noise_slope, noise_level, cand, height, slope, state):
        """One warp per tile (grid-stride), its candidates one after the other (a warp per slot, most
        of them empty, took 181 us on the H200, this 83): each candidate goes to
        ``offsets[tile] + rank`` (rank by position within the tile, so the list
        is sorted), with its height, class (0 dropped:
        edge, below the weak threshold or the flat-line floor, or a peak of a noise burst
        (segment.noise_mask); 1 weak; 2 strong, against ``amp``, the
        median of the block maxima around its block) and steepest fine slope (segment.steepest_at:
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
                                for jj in range(KF):  # the order of segment.steepest_at's sums
                                    d += dl[u + 2 * fkh - jj] * kfc[jj]
                                d = abs(d)
                                if d > best:
                                    best = d
                        _syncwarp()  # read before the warp's next candidate writes
                        off = WARP // 2
                        while off > 0:
                            o = _shfl_xor(_FULL_MASK, best, off)
                            if o > best:
                                best = o
                            off //= 2
                        # segment.noise_mask: a peak of a noise burst is no candidate
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
                    r += _shfl_xor(_FULL_MASK, r, off)
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

    @_kernel("emit_count", sim)
    def emit_count(offsets, cand, state, first, lo, hi, episode, w0, vw, counts):
        """Per tile: how many of its candidates are emitted (:func:`_beat`)."""
        nt = counts.shape[0]
        for ti in range(cuda.grid(1), nt, cuda.gridsize(1)):
            c = 0
            for j in range(offsets[ti], offsets[ti + 1]):
                if _beat(cand[j] + first, state[j], lo, hi, episode, w0, vw):
                    c += 1
            counts[ti] = c

    @_kernel("emit", sim)
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


#: the flutter rule's energy kernel: chunks per window (a window's lanes, a power of two that divides
#: a warp) and the windows of a block (GPU; the simulator runs one warp per block). Each chunk sums
#: its first moving-mean window afresh (150 samples at 250 Hz): 16 chunks of 17 samples spent half
#: of vf_energy's instructions on that (H200, session 13: 166 M warp instructions, issue slots 82 %
#: busy), 8 chunks of 33 half as many.
_VF_CHUNKS = 8
_VF_TILE = 16


@functools.lru_cache(maxsize=None)
def _vf_build(W: int, HP: int, K: int, tpb: int, taps: tuple):
    """The flutter rule's kernels (:mod:`beatflow.detect.rhythm` on the GPU) for one window length ``W``,
    high-pass length ``HP`` and slope kernel ``K`` (constant loop bounds, as in :func:`_detect_build`).

    ``vf_energy`` takes a tile of ``tpb // _VF_CHUNKS`` windows per block, a chunk of consecutive
    samples per thread; ``vf_need`` and ``vf_episodes`` one thread per window; ``vf_near`` one block
    per listed window. A window's samples beyond the array take the values at its ends (``rhythm``'s
    edge padding), its neighbourhoods the despiked samples at clipped positions (``mode="nearest"``).
    """
    kernels, sim = _build()
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
        constant number of rounds (``_detect_build``'s block-stride loops) with the three samples
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
            v += _shfl_xor(_FULL_MASK, v, off)
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
            v += _shfl_xor(_FULL_MASK, v, off)
            off //= 2
        return v

    @_kernel("vf_energy", sim)
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
        """Window ``j`` (in range) is smooth: over ``j ± c`` (added in order, as ``rhythm._context_sum``)
        the slope's energy below ``omega2`` × the signal's."""
        nw = e_sig.shape[0]
        ss = 0.0
        sd = 0.0
        for i in range(max(j - c, 0), min(j + c + 1, nw)):
            ss += e_sig[i]
            sd += e_slope[i]
        return sd < omega2 * ss

    from beatflow.detect.cpu import quantile_sorted

    _pct = cuda.jit(device=True)(quantile_sorted)  # NumPy's linear quantile, the CPU loops' function

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

    @_kernel("vf_near", sim)
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

    @_kernel("vf_episodes", sim)
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


# the detection's launch shape: threads per tile and samples per tile (GPU; the simulator runs one
# warp per tile). H200, session 13 (bench/gpu_segment.py): the detection 0.84 ms with 128 threads, 0.91
# with 256, 0.93 with 256 on 2048 samples, 0.99 with 128 on 512, 1.25 with 512 on 2048 or 4096.
_DET_TPB, _DET_TILE = 128, 1024
#: doubling levels of the NMS window maxima written out in the dense kernel (windows up to 2047
#: samples; wider ones go to the array code, see _detect_plan)
_MAX_LEVELS = 10
_SIM_DET_TPB, _SIM_DET_TILE = WARP, 4 * WARP


_plans: dict = {}
_plan_last: list = [None]  # (s, flags, plan) of the last call


def _detect_plan(s, sim: bool):
    """``(kernels, tile, tpb)`` for these parameters, or None where the fused kernels cannot take
    them (a level window wider than ``_MAX_WINDOW`` blocks, an NMS window of more than
    ``2**(_MAX_LEVELS + 1) - 1`` samples, or windows so wide that even a tile of one sample per thread
    would not fit in 48 KiB of shared memory): then the array code runs. Kept per parameter set and
    launch shape (every detection asks for it, and the host's time before the first kernel is the
    GPU's idle time; the last one also by the identity of ``s``, a frozen dataclass, which skips
    building the key)."""
    flags = (bool(sim), _DET_TPB, _DET_TILE, _SIM_DET_TPB, _SIM_DET_TILE, tuple(_DENSE_CHUNKS), _REG_LEVELS)
    last = _plan_last[0]
    if last is not None and last[0] is s and last[1] == flags:
        return last[2]
    key = (int(s.blocks), int(s.kernel), int(s.box), int(s.nms), int(s.block), int(s.fine_kernel),
           int(s.slope_half), float(s.a), float(s.fine_a)) + flags
    plan = _plans.get(key, _plans)
    if plan is _plans:
        plan = _plans[key] = _make_plan(s, sim)
    _plan_last[0] = (s, flags, plan)
    return plan


def _make_plan(s, sim: bool):
    tpb, tile = (_SIM_DET_TPB, _SIM_DET_TILE) if sim else (_DET_TPB, _DET_TILE)
    if 2 * s.blocks + 1 > _MAX_WINDOW:
        return None
    K, box, nms = int(s.kernel), int(s.box), int(s.nms)
    if (2 * nms + 1).bit_length() - 1 > _MAX_LEVELS:  # more doubling levels than `dense` writes out
        return None  # (a window that wide does not fit in shared memory either)
    chunks = tuple(int(c) for c in _DENSE_CHUNKS)
    while True:
        XA, YA, PA = _dense_alloc(K, box, nms, tile, chunks)
        shared = 8 * (XA + YA + PA + tpb + tpb // WARP) + 4
        if shared <= _SHARED_BYTES:
            break
        if tile == tpb:
            return None
        tile //= 2
    return _detect_build(K, box, nms, int(s.block), int(s.fine_kernel), int(s.slope_half), tile, tpb,
                         _taps(K, float(s.a), True), _taps(int(s.fine_kernel), float(s.fine_a)), chunks), tile, tpb


@functools.lru_cache(maxsize=None)
def _taps(size: int, a: float, reverse: bool = False) -> tuple:
    """Derivative-of-Gaussian taps (:func:`beatflow.detect.peaks.gaussian_derivative`) as constants of the
    kernels, which are compiled per parameter set (immediate operands, no loads): reversed for the
    detection's slope (a correlation: the dense and flutter kernels), as they are for ``cand_eval``'s
    fine slope. Cached: every detection call asks for them."""
    from beatflow.detect.peaks import gaussian_derivative

    taps = gaussian_derivative(size, a)
    return tuple(float(v) for v in (taps[::-1] if reverse else taps))


def _dense_pass(ctx, plan, x, s, first: int, cap: int, write_env: bool, fork: bool = False):
    """Launch the fused dense kernel over ``x``; returns its outputs (device arrays). With ``fork``
    also ``out["side"] = ctx.fork()``: a side stream that starts behind the outputs' set-up, not
    behind the kernel."""
    kern, tile, tpb = plan
    xp = ctx.xp
    n = int(x.shape[0])
    nt = -(-n // tile)
    b0 = first // s.block
    nb = -(-(first - b0 * s.block + n) // s.block)
    out = {
        # (zeros, not -inf: every block holds samples of x, whose envelope values are >= 0; a memset,
        # not a fill kernel's launch before the dense kernel's)
        "bmax": ctx.zeros(nb, xp.float64),
        "xmax": ctx.zeros(1, xp.float64),
        "tcount": ctx.empty(nt, xp.int64),
        "tpos": ctx.empty(nt * cap, xp.int64),
        "theight": ctx.empty(nt * cap, xp.float64),
        "tvalley": ctx.empty(nt * cap, xp.float64),
        "info": ctx.zeros(5, xp.int64),  # [peaks, candidate slots overflowed, flutter episodes, windows
        # whose near-median fraction the flutter rule computed, kept beats (segment_rows_gpu)]
        "env": ctx.empty(n if write_env else 1, xp.float64),
    }
    if fork:
        out["side"] = ctx.fork()
    a = ctx.arg
    ctx.launch(kern["dense"], nt, tpb, 0, a(x), first, b0, bool(write_env), a(out["env"]), a(out["bmax"]),
               a(out["xmax"]), cap, a(out["tcount"]), a(out["tpos"]), a(out["theight"]), a(out["tvalley"]),
               a(out["info"]), sig=x.dtype.char)
    out.update(nt=nt, b0=b0, tile=tile, tpb=tpb)
    return out


def detect_peaks_gpu(x, s, *, first: int = 0, core: tuple[int, int] | None = None, _cap: int | None = None):
    """The beat detection of :func:`beatflow.detect.peaks.detect_peaks` on the GPU, without the flutter
    rule: the same peaks as ``segment._detect_peaks_xp`` (:func:`detect_beats_gpu` adds the rule).

    The whole detection is eleven kernel launches (two of them one-block scans) and one
    synchronisation (the number of peaks), with nothing of the size of the stream written to memory
    but the stream itself read once:

    1. ``dense`` (one tile of 1024 samples per block, everything in shared memory): despike,
       derivative-of-Gaussian slope and moving RMS (the envelope), the NMS over it (window maxima,
       the first levels in registers, then by doubling), the tile's candidates into a fixed number of
       slots per tile with the lowest envelope of their window, the maxima per 1 s block and of |x|;
       each thread takes runs of consecutive outputs whose inputs it loads once into registers;
    2. ``exclusive_scan`` of the slot counts: where each tile's candidates go in the sorted candidate
       list;
    3. ``block_median``: the local level of every block (the median of the block maxima around it);
       ``cand_eval`` (one warp per tile, its candidates in turn): each candidate at its sorted
       place, with its height, weak/strong class, steepest slope, and the noise-burst test;
    4. ``cand_twave``, ``cand_refractory``: the strong candidates' T-wave test and refractory period;
    5. ``cand_search_back``, ``cand_refractory``: the weak candidates that fill a gap (the stream's
       ends bound one), and their refractory period;
    6. ``emit_count``, a scan, ``emit``: the accepted peaks in the core, in order.

    Launches after a kernel's first go through CuPy's driver call (:class:`_FastLaunch`).
    Sizes that depend on the data stay on the device (the candidate count is read by the kernels,
    which are launched for the capacity), so the host waits once, for the number of peaks. The
    decisions of 4-5 compare a candidate with its neighbours in a set (the previous strong one, the
    beats around it): each thread walks along the sorted candidates from its own until it finds
    them or passes the distance that matters (``twave``, ``refractory``, ``max_gap``, ``rr_window``).
    The slots per tile hold every candidate the NMS can produce unless a plateau of equal maxima
    fills them; then the detection runs again with a slot for every sample.

    Parameters and result as :func:`beatflow.detect.peaks.detect_peaks` (``x`` a CuPy array, or NumPy
    under the simulator; the peaks in the same namespace).
    """
    return _detect_gpu(x, s, first, core, _cap, rule=False)[0]


def detect_beats_gpu(x, s, *, first: int = 0, core: tuple[int, int] | None = None, _cap: int | None = None):
    """:func:`beatflow.detect.peaks.detect_beats` on the GPU: :func:`detect_peaks_gpu` with the flutter
    rule of :mod:`beatflow.detect.rhythm` in four more kernels, before the peaks are emitted (still one
    synchronisation):

    - ``vf_energy`` (a tile of 1 s windows per block): the energies of the high-passed signal and
      of its slope;
    - ``vf_need`` (one thread per window): the list of windows within reach of a smooth one;
    - ``vf_near`` (one block per listed window): the fraction of near-median samples (a rank sort
      of the window in shared memory, NumPy's median and linear percentiles);
    - ``vf_episodes`` (one thread per window): the runs of flutter-like windows, and the episodes'
      sample ranges; ``emit`` then leaves out the peaks in them.

    These four need only ``x``: they go on a side stream that starts behind the set-up of the dense
    kernel's outputs, so their blocks fill the dense kernel's last wave, while the candidates' kernels
    go on a second side stream of the device's highest priority behind the dense kernel (a
    ``BEATFLOW_DETECT_STREAMS=0`` environment, or ``kernels._STREAMS = False``: all on one stream). The
    emission waits for both. H200, session 16 (``bench/gpu_seg_timeline.py``): the kernels of
    segmentation + embedding end 60-80 µs earlier than on one stream; same peaks, episodes and rows.

    Returns ``(peaks, episodes)`` as :func:`beatflow.detect.peaks.detect_beats`.
    """
    return _detect_gpu(x, s, first, core, _cap, rule=s.vf_baseline > 0)


def _flutter_pass(ctx, x, s, first: int, lo: int, hi: int, info, keep: list | None = None):
    """Launch the flutter rule's kernels over ``x``: ``(episode, w0, spans)`` (device arrays; the
    number of spans goes to ``info[2]``, that of the windows whose near-median fraction was computed
    to ``info[3]``)."""
    xp = ctx.xp
    W, n = int(s.vf_window), int(x.shape[0])
    w0 = first // W
    nw = -(-(first - w0 * W + n) // W)
    L = max(1, int(s.vf_runs))
    tpb = WARP if ctx.sim else _VF_CHUNKS * _VF_TILE
    kern = _vf_build(W, int(s.vf_highpass), int(s.kernel), tpb, _taps(int(s.kernel), float(s.a), True))
    e_sig = ctx.empty(nw, xp.float64)
    e_slope = ctx.empty(nw, xp.float64)
    near = ctx.empty(nw, xp.float64)  # read only where computed (vf_need's list)
    todo = ctx.empty(nw, xp.int64)
    episode = ctx.empty(nw, xp.int8)
    spans = ctx.empty((nw // (L + 1) + 1, 2), xp.int64)
    a = ctx.arg
    c, omega2 = int(s.vf_context), float(s.vf_omega) ** 2
    tw = tpb // _VF_CHUNKS
    per_window = WARP if ctx.sim else _CAND_TPB
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
#: high-priority stream, from starting until it drained; with 4 per SM they run beside it. H200,
#: session 18 (bench/gpu_seg_timeline.py, 120 calls each): segmentation + embedding 0.969 -> 0.955 ms
#: median (interleaved 0.984 -> 0.979), the same peaks, episodes and rows
_VF_ENERGY_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    """The number of streaming multiprocessors of CUDA device ``dev`` (asked once per device)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, dev))


#: blocks of vf_near (launched before the number of listed windows is known; grid-stride over them)
_VF_NEAR_BLOCKS = 2048


def _detect_gpu(x, s, first, core, _cap, rule: bool, rows: int | None = None):
    """The detection kernels, with the flutter rule when ``rule``: ``(peaks, episodes)``
    (``episodes`` empty without the rule). With ``rows`` (the baseline samples; ``x`` a whole
    recording: ``first == 0``, no core) also the kept beats and their rows, launched before the one
    synchronisation: ``(peaks, episodes, (index, peak, start, length, rows, p2p))``."""
    from beatflow.detect.peaks import _detect_beats_xp, _detect_peaks_xp

    ctx, host_in, kernels, xp, x = _vector_call(x, "x")
    n = int(x.shape[0])
    plan = None if n < 3 else _detect_plan(s, ctx.sim)
    if plan is None:  # too short for the 3-point median, or windows the kernels do not take
        if rule:
            out, ep = _detect_beats_xp(x, s, first=first, core=core)
        else:
            out, ep = _detect_peaks_xp(x, s, first=first, core=core), xp.zeros((0, 2), dtype=xp.int64)
        if rows is not None:
            beat_out = beat_rows_gpu(x, out, s, n, baseline_samples=rows)
            if host_in:
                return xp.asnumpy(out), xp.asnumpy(ep), tuple(xp.asnumpy(v) for v in beat_out)
            return out, ep, beat_out
        return (xp.asnumpy(out), xp.asnumpy(ep)) if host_in else (out, ep)
    st = _detect_launch(ctx, plan, x, s, first, core, _cap, rule, rows)
    return _detect_finish(ctx, st, _detect_sync(ctx, st), host_in)


def _detect_launch(ctx, plan, x, s, first, core, _cap, rule: bool, rows: int | None):
    """:func:`_detect_gpu`'s launches, all queued on ``ctx``'s stream (and its side streams, joined
    back to it) with nothing read back: the state that :func:`_detect_sync` and
    :func:`_detect_finish` take."""
    xp, kernels = ctx.xp, _build()[0]
    n = int(x.shape[0])
    first = int(first)
    kern, tile, tpb = plan
    cap = int(_cap) if _cap is not None else tile // (int(s.nms) + 1) + 2
    lo, hi = (-_FAR, _FAR) if core is None else (int(core[0]), int(core[1]))
    streams = rule and _STREAMS and not ctx.sim
    d = _dense_pass(ctx, plan, x, s, first, cap, write_env=False, fork=streams)  # 1.
    try:  # (on an error, nothing a side stream still runs may see its arrays freed and reused)
        info = d["info"]
        keep = []  # arrays the side streams use: referenced until the synchronisation
        vf_range = (first if core is None else lo, first + n if core is None else hi)
        if streams:  # the flutter rule's kernels, queued behind the dense kernel's blocks on a side stream;
            # the candidates' kernels behind the dense kernel on a high-priority one
            low, join_low = d["side"]
            episode, w0, spans = _flutter_pass(low, x, s, first, *vf_range, info, keep)
            cctx, join_cand = ctx.fork(high=True)
        else:
            cctx = ctx
        nt = d["nt"]
        a = ctx.arg
        offsets = ctx.empty(nt + 1, xp.int64)
        _exclusive_scan(cctx, d["tcount"], offsets)  # 2.
        mcap = nt * cap
        mcount = a(offsets[nt:])
        cand = ctx.empty(mcap, xp.int64)
        height = ctx.empty(mcap, xp.float64)
        slope = ctx.empty(mcap, xp.float64)
        st_a = ctx.empty(mcap, xp.int8)
        st_b = ctx.empty(mcap, xp.int8)
        ac, ah, asl, sa, sb = a(cand), a(height), a(slope), a(st_a), a(st_b)
        blocks, threads = ctx.blocks(-(-mcap // _CAND_TPB)), WARP if ctx.sim else _CAND_TPB
        amp = _block_levels(cctx, d["bmax"], s)  # 3. the level of every block, then the candidates
        warps = 1 if ctx.sim else _CAND_TPB // WARP  # simulator: one-warp blocks (shuffle emulation)
        cctx.launch(kern["cand_eval"], ctx.blocks(-(-nt // warps)), warps * WARP, 0, a(x), a(d["tcount"]), a(offsets),
                    cap, a(d["tpos"]), a(d["theight"]), a(d["tvalley"]), a(amp), d["b0"], first, int(s.edge),
                    float(s.weak_ratio), float(s.ratio), a(d["xmax"]), float(s.noise_valley),
                    float(s.noise_slope), float(s.noise_level), ac, ah, asl, sa, sig=x.dtype.char)
        cctx.launch(kernels["cand_twave"], blocks, threads, 0, ac, mcount, sa, asl, int(s.twave),
                    float(s.twave_slope), sb, sig="")  # 4.
        cctx.launch(kernels["cand_refractory"], blocks, threads, 0, ac, mcount, sb, 2, ah, int(s.refractory),
                    sa, 3, sig="")
        cctx.launch(kernels["cand_search_back"], blocks, threads, 0, ac, mcount, sa, asl, n, int(s.max_gap),
                    int(s.rr_window), float(s.searchback), float(s.margin), float(s.twave_slope), sb, sig="")  # 5.
        cctx.launch(kernels["cand_refractory"], blocks, threads, 0, ac, mcount, sb, 4, ah, int(s.twave), sa, 4,
                    sig="")
        if streams:  # 6. the emission waits for both side streams
            join_low()
            join_cand()
        elif rule:  # the flutter episodes; the peaks in them are not emitted
            episode, w0, spans = _flutter_pass(ctx, x, s, first, *vf_range, info)
        if rule:
            vw = int(s.vf_window)
        else:
            episode, w0, vw, spans = ctx.zeros(1, xp.int8), 0, 0, None
        counts = ctx.empty(nt, xp.int64)
        out_offsets = ctx.empty(nt + 1, xp.int64)
        peaks = ctx.empty(mcap, xp.int64)
        tblocks = ctx.blocks(-(-nt // _CAND_TPB))
        ae = a(episode)
        ctx.launch(kern["emit_count"], tblocks, threads, 0, a(offsets), ac, sa, first, lo, hi, ae, w0, vw, a(counts),
                   sig="")
        _exclusive_scan(ctx, counts, out_offsets, info)  # (the number of peaks into info[0])
        ctx.launch(kern["emit"], tblocks, threads, 0, a(offsets), ac, sa, first, lo, hi, ae, w0, vw, a(out_offsets),
                   a(peaks), sig="")
        beat_out = None
        if rows is not None:  # the kept beats' bounds and rows, behind the detection on the stream
            beat_out = _rows_launch(ctx, x, peaks, info[0:1], info[4:5], s, first, n, rows, mcap)
    except BaseException:
        if streams:
            xp.cuda.Device().synchronize()
        raise
    return {"x": x, "s": s, "first": first, "core": core, "tile": tile, "rule": rule, "rows": rows, "info": info,
            "peaks": peaks, "spans": spans, "beat_out": beat_out, "streams": streams, "keep": keep}


def _detect_sync(ctx, st):
    """The one synchronisation: ``(total, overflow, nsp, kept)`` from the launches' ``info``."""
    try:
        info = st["info"]
        total, overflow, nsp, _, kept = (int(v) for v in (info if ctx.sim else info.get()))
    except BaseException:
        if st["streams"]:
            ctx.xp.cuda.Device().synchronize()
        raise
    return total, overflow, nsp, kept


def _detect_finish(ctx, st, counts, host_in: bool):
    """:func:`_detect_gpu`'s result from the launches' state and their counts (the outputs cut to
    them; on an overflow of a tile's candidate slots, the detection again with a slot per sample)."""
    xp = ctx.xp
    total, overflow, nsp, kept = counts
    rows = st["rows"]
    if overflow:  # a plateau of equal maxima filled a tile's slots: a slot for every sample (x is on the
        # device now)
        res = _detect_gpu(st["x"], st["s"], st["first"], st["core"], st["tile"], st["rule"], rows)
        if not host_in:
            return res
        return tuple(tuple(xp.asnumpy(u) for u in v) if isinstance(v, tuple) else xp.asnumpy(v) for v in res)
    out = st["peaks"][:total]
    if st["rule"]:
        ep = st["spans"][:nsp]
        if nsp > 1:  # the runs' threads claimed their slots in any order
            ep = ep[xp.argsort(ep[:, 0])]
    else:
        ep = xp.zeros((0, 2), dtype=xp.int64)
    if rows is not None:
        beat_out = tuple(v[:kept] for v in st["beat_out"])
        if host_in:
            return xp.asnumpy(out), xp.asnumpy(ep), tuple(xp.asnumpy(v) for v in beat_out)
        return out, ep, beat_out
    return (xp.asnumpy(out), xp.asnumpy(ep)) if host_in else (out, ep)


_FAR = 1 << 40  # "no limit" for the core filter


def _block_levels(ctx, bmax, s):
    """The local level of every block: the median of the block maxima ``bmax`` over ``±s.blocks``
    blocks (the ``block_median`` kernel, one thread per block)."""
    amp = ctx.empty(bmax.shape, bmax.dtype)
    ctx.launch(_build()[0]["block_median"], ctx.blocks(-(-int(bmax.shape[0]) // _CAND_TPB)),
               WARP if ctx.sim else _CAND_TPB, 0, ctx.arg(bmax), int(s.blocks), ctx.arg(amp), sig="")
    return amp


def _exclusive_scan(ctx, counts, offsets, total=None):
    """``offsets[i] = sum(counts[:i])`` for ``i <= len(counts)``, and the sum into ``total[0]``
    (a device array) when given: one launch of the one-block ``exclusive_scan`` kernel, no sync
    (CuPy's cumsum and the zero before it were three launches)."""
    tot = ctx.empty(0, ctx.xp.int64) if total is None else total
    ctx.launch(_build()[0]["exclusive_scan"], 1, WARP if ctx.sim else _SCAN_TPB, 0, ctx.arg(counts),
               ctx.arg(offsets), ctx.arg(tot), sig="")




def qrs_envelope_gpu(x, s, *, first: int = 0, levels: bool = False):
    """:func:`beatflow.detect.peaks.qrs_envelope` with the detection's dense kernel (the sums of
    :func:`beatflow.detect.cpu.envelope_cpu` in its order), float64, same length as ``x`` (n >= 3).

    With ``levels=True`` also the local amplitude of :func:`beatflow.detect.peaks.block_amplitude`
    (``x`` starting at global sample ``first``): returns ``(env, amp, b0)``, the block maxima from
    the same kernel and their medians from the per-block kernel that the detection's ``cand_eval``
    shares (``_window_median``).
    """
    ctx, host_in, kernels, xp, x = _vector_call(x, "x")
    n = int(x.shape[0])
    if n < 3:
        raise ValueError(f"the envelope kernel takes a stream of at least 3 samples, got {n}")
    plan = _detect_plan(s, ctx.sim)
    if plan is None:
        raise ValueError("these segmentation parameters exceed what the detection kernels take "
                         f"(threshold_blocks <= {(_MAX_WINDOW - 1) // 2}, windows that fit a shared-memory tile)")
    d = _dense_pass(ctx, plan, x, s, int(first), plan[1] // (int(s.nms) + 1) + 2, write_env=True)
    env = d["env"]
    if not levels:
        return xp.asnumpy(env) if host_in else env
    amp = _block_levels(ctx, d["bmax"], s)
    if host_in:
        return xp.asnumpy(env), xp.asnumpy(amp), d["b0"]
    return env, amp, d["b0"]

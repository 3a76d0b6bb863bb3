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
    CuPy work around them (no extra synchronisation).

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

import functools
import math
import sys
import threading
import weakref

import numpy as np

from .errors import DeviceError

__all__ = ["local_maxima_gpu", "embed_gpu", "detect_peaks_gpu", "simulator_active"]

WARP = 32
_FULL_MASK = 0xFFFFFFFF
_INF = math.inf
# NMS: threads per block; a tile of ``_NMS_TPB + 2*half`` float64 must fit in shared memory
_NMS_TPB = 256
_SHARED_BYTES = 48 * 1024
# embed: warps per block (one warp per beat)
_EMBED_WARPS = 8
# the simulator runs one Python thread per CUDA thread: few blocks, grid-stride loops do the rest
_SIM_NMS_TPB = 32
_SIM_MAX_BLOCKS = 4
# detection: threads per block of the envelope tiles and of the per-candidate kernels; the widest
# window of blocks the level's median takes (2 * threshold_blocks + 1)
_ENV_TPB = 256
_CAND_TPB = 128
_MAX_WINDOW = 63

# set by _build() (module globals, so that the simulator can swap ``cuda`` inside the kernels)
cuda = None
_shfl_idx = _shfl_down = _shfl_xor = _syncthreads = None
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


@functools.lru_cache(maxsize=None)
def _build():
    """Import Numba CUDA and compile-define the kernels (once). Returns ``(kernels dict, simulator?)``."""
    global cuda, _shfl_idx, _shfl_down, _shfl_xor, _syncthreads, _F64
    try:
        from numba import cuda as numba_cuda
    except Exception as e:  # numba absent or broken (numba-cuda on numpy 2.5: "no attribute 'row_stack'")
        raise DeviceError(f"the GPU kernels need Numba CUDA (pip install numba-cuda): {e}") from e
    sim = numba_cuda.is_available.__module__.endswith("simulator_init")
    if not sim and not numba_cuda.is_available():
        raise DeviceError("no CUDA GPU for the Numba kernels (beatflow.kernels); set NUMBA_ENABLE_CUDASIM=1 "
                          "before Numba is imported to run them on the CPU simulator")
    cuda = numba_cuda
    if sim:
        _shfl_idx, _shfl_down, _shfl_xor = _sim_shfl_idx, _sim_shfl_down, _sim_shfl_xor
        _syncthreads = _sim_syncthreads
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
                c = tid + half
                v = tile[c]
                keep = v > 0
                if keep:  # outwards from the centre: a sample on a slope stops at d = 1
                    for d in range(1, half + 1):
                        if tile[c - d] > v or tile[c + d] > v:
                            keep = False
                            break
                gate[i] = 1 if keep else 0

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

    @cuda.jit
    def embed_warp(x, start, length, first, width, baseline, rows, p2p, counter, beat_of_row):
        """One warp per beat (grid-stride over beats). Writes compact rows in claim order.

        Lane 0 checks ``0 < length <= width`` and claims the next output row with an atomic add on
        ``counter``; the row is broadcast with shfl_sync. The baseline (mean of the first
        ``baseline`` samples of the beat's window) is a shfl_xor_sync butterfly sum, the row is
        written (samples minus baseline, then zeros) in a warp-stride loop that also tracks the
        lane's min/max of the valid samples, reduced with shfl_down_sync. ``beat_of_row[row]`` is
        the beat that claimed ``row`` (the order is nondeterministic).
        """
        n_beats = start.shape[0]
        nx = x.shape[0]
        lane = cuda.threadIdx.x % WARP
        warp = cuda.grid(1) // WARP
        n_warps = cuda.gridsize(1) // WARP
        for beat in range(warp, n_beats, n_warps):  # uniform over the warp
            ln = length[beat]
            row = np.int32(-1)
            if lane == 0:
                if ln > 0 and ln <= width:
                    row = cuda.atomic.add(counter, 0, 1)
            row = _shfl_idx(_FULL_MASK, row, 0)
            if row < 0:
                continue  # skipped beat: whole warp
            s = start[beat] - first
            base = np.float32(0.0)
            if baseline > 0:
                nb = min(baseline, width)
                acc = 0.0
                for j in range(lane, nb, WARP):
                    acc += np.float32(x[min(max(s + j, 0), nx - 1)])
                off = WARP // 2
                while off > 0:
                    acc += _shfl_xor(_FULL_MASK, acc, off)
                    off //= 2
                base = np.float32(acc / nb)
            lo = np.float32(_INF)  # float32 keeps each shuffle one 32-bit shfl
            hi = np.float32(-_INF)
            for j in range(lane, width, WARP):
                v = np.float32(0.0)
                if j < ln:
                    v = np.float32(x[min(max(s + j, 0), nx - 1)]) - base
                    lo = min(lo, v)
                    hi = max(hi, v)
                rows[row, j] = v
            off = WARP // 2
            while off > 0:
                lo = min(lo, _shfl_down(_FULL_MASK, lo, off))
                hi = max(hi, _shfl_down(_FULL_MASK, hi, off))
                off //= 2
            if lane == 0:
                p2p[row] = hi - lo
                beat_of_row[row] = beat

    # --- detection (segment.detect_peaks on the GPU): the dense envelope, block levels, and the
    # decisions over the sparse candidates as one thread per candidate walking to its neighbours ---
    @cuda.jit(device=True)
    def _clip(i, n):
        return 0 if i < 0 else (n - 1 if i >= n else i)

    @cuda.jit(device=True)
    def _despiked(x, j, n):
        a = np.float64(x[j - 1] if j > 0 else x[1])
        b = np.float64(x[j])
        c = np.float64(x[j + 1] if j < n - 1 else x[n - 2])
        return max(min(a, b), min(max(a, b), c))

    @cuda.jit
    def envelope_tiled(x, kr, box, g, groups, env):
        """env[i] = sqrt(mean over ±box//2 of slope²), the slope the derivative-of-Gaussian response
        of the despiked signal: ``cpu_kernels.envelope_cpu`` one tile per block, with its sums in the
        same order (slope: taps in order; box: ``groups`` sums of ``g`` consecutive squares, then
        the rest). Shared memory: the tile's despiked samples, then its squared slopes."""
        sh = cuda.shared.array(0, _F64)
        n = x.shape[0]
        K = kr.shape[0]
        kh = K // 2
        bh = box // 2
        tpb = cuda.blockDim.x
        tid = cuda.threadIdx.x
        yl = tpb + 2 * bh
        xl = yl + 2 * kh
        for base in range(cuda.blockIdx.x * tpb, n, cuda.gridDim.x * tpb):
            _syncthreads()
            xlo = base - bh - kh
            for t in range(tid, xl, tpb):
                sh[t] = _despiked(x, _clip(xlo + t, n), n)
            _syncthreads()
            ylo = base - bh
            for t in range(tid, yl, tpb):  # slope at clip(ylo + t): the envelope repeats the edge values
                off = _clip(ylo + t, n) - kh - xlo
                acc = 0.0
                for i in range(K):
                    acc += sh[off + i] * kr[i]
                sh[xl + t] = acc * acc
            _syncthreads()
            i = base + tid
            if i < n:
                y0 = xl + tid
                acc = 0.0
                for q in range(groups):
                    part = sh[y0 + q * g]
                    for ii in range(1, g):
                        part += sh[y0 + q * g + ii]
                    acc = part if q == 0 else acc + part
                for ii in range(groups * g, box):
                    acc += sh[y0 + ii]
                env[i] = math.sqrt(max(acc / box, 0.0))

    @cuda.jit
    def block_max_warp(env, lead, block, bmax):
        """bmax[b] = max of env over stream-aligned block b (global samples [b*block - lead, +block)
        of env): one warp per block, a shfl_xor_sync butterfly."""
        n = env.shape[0]
        nb = bmax.shape[0]
        lane = cuda.threadIdx.x % WARP
        warp = cuda.grid(1) // WARP
        for b in range(warp, nb, cuda.gridsize(1) // WARP):
            lo = b * block - lead
            m = -_INF
            for j in range(max(lo, 0) + lane, min(lo + block, n), WARP):
                m = max(m, env[j])
            off = WARP // 2
            while off > 0:
                m = max(m, _shfl_xor(_FULL_MASK, m, off))
                off //= 2
            if lane == 0:
                bmax[b] = m

    @cuda.jit
    def block_median(bmax, k, amp):
        """amp[b] = median of bmax over blocks b-k .. b+k that exist (nanmedian of the NaN-padded window)."""
        nb = bmax.shape[0]
        w = cuda.local.array(_MAX_WINDOW, _F64)
        for b in range(cuda.grid(1), nb, cuda.gridsize(1)):
            m = 0
            for j in range(max(b - k, 0), min(b + k + 1, nb)):
                v = bmax[j]
                if math.isnan(v):
                    continue
                p = m  # insertion sort
                while p > 0 and w[p - 1] > v:
                    w[p] = w[p - 1]
                    p -= 1
                w[p] = v
                m += 1
            if m == 0:
                amp[b] = math.nan
            elif m % 2 == 1:
                amp[b] = w[m // 2]
            else:
                amp[b] = (w[m // 2 - 1] + w[m // 2]) / 2.0

    @cuda.jit
    def cand_eval(x, env, cand, amp, b0, first, block, edge, weak_ratio, ratio, xmax, kf, shalf,
                  state, height, slope):
        """Per candidate: 0 dropped (edge, below the weak threshold or the flat-line floor), 1 weak,
        2 strong; its envelope height and (when kept) its steepest fine slope (segment.steepest_at)."""
        n = x.shape[0]
        K = kf.shape[0]
        kh = K // 2
        floor = 1e-7 * np.float64(xmax[0])
        for j in range(cuda.grid(1), cand.shape[0], cuda.gridsize(1)):
            c = cand[j]
            h = env[c]
            height[j] = h
            slope[j] = 0.0
            st = 0
            if c >= edge and c < n - edge:
                level = amp[(c + first) // block - b0]
                if h > weak_ratio * level and h > floor:
                    st = 2 if h > ratio * level else 1
                    best = 0.0
                    for u in range(2 * shalf + 1):
                        q = c - shalf + u
                        if q < 0 or q >= n:
                            continue
                        d = 0.0
                        for jj in range(K):
                            d += _despiked(x, _clip(q + kh - jj, n), n) * kf[jj]
                        d = abs(d)
                        if d > best:
                            best = d
                    slope[j] = best
            state[j] = st

    @cuda.jit
    def cand_twave(cand, state, slope, window, ratio, out):
        """Strong candidates that are the T wave of the previous strong one (segment.t_wave_mask)
        become 0; others keep their state."""
        for j in range(cuda.grid(1), cand.shape[0], cuda.gridsize(1)):
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
    def cand_refractory(cand, state, member, height, window, out, mark):
        """segment.refractory_mask over the candidates whose state is ``member``: a member closer
        than ``window`` to the next member and smaller than it, or to the previous one and not larger
        than it, is dropped (0); a kept member becomes ``mark``; others keep their state."""
        m = cand.shape[0]
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
    def cand_search_back(cand, state, slope, nbeats, max_gap, rr_window, searchback, margin, tw_ratio, out):
        """segment.search_back: weak candidates (state 1) that fill a gap among the beats (state 3)
        become 4; beats stay 3; the rest 0."""
        m = cand.shape[0]
        for j in range(cuda.grid(1), m, cuda.gridsize(1)):
            st = state[j]
            if st == 3:
                out[j] = 3
                continue
            out[j] = 0
            if st != 1 or nbeats[0] < 2:
                continue
            c = cand[j]
            dp = max_gap
            prev_slope = 0.0
            i = j - 1
            while i >= 0 and c - cand[i] <= max_gap:
                if state[i] == 3:
                    dp = c - cand[i]
                    prev_slope = slope[i]
                    break
                i -= 1
            dn = max_gap
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

    return {"nms_tiled": nms_tiled, "nms_global": nms_global, "embed_warp": embed_warp,
            "envelope_tiled": envelope_tiled, "block_max_warp": block_max_warp, "block_median": block_median,
            "cand_eval": cand_eval, "cand_twave": cand_twave, "cand_refractory": cand_refractory,
            "cand_search_back": cand_search_back}, sim


# --- host side -----------------------------------------------------------------------------------
def _is_device(a) -> bool:
    return hasattr(a, "__cuda_array_interface__")


class _Ctx:
    """Where one call's arrays live: ``xp`` (cupy on the GPU, numpy in the simulator), how kernel
    arguments are passed, and the stream to launch on."""

    def __init__(self, sim: bool):
        self.sim = sim
        if sim:
            self.xp = np
            self.stream = 0
        else:
            try:
                import cupy
            except ImportError as e:
                raise DeviceError("the GPU kernels return CuPy arrays: install cupy") from e
            self.xp = cupy
            ptr = cupy.cuda.get_current_stream().ptr
            self.stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()

    def arg(self, a):
        """A kernel argument: NumPy itself in the simulator; a zero-copy Numba view of a CuPy array
        (no synchronisation: the kernel runs on CuPy's stream, after the work that produced ``a``)."""
        return a if self.sim else cuda.as_cuda_array(a, sync=False)

    def array(self, a, dtype=None):
        """``a`` in this call's namespace (no copy when it already is, with that dtype)."""
        if self.sim:
            if _is_device(a):
                raise DeviceError("the CUDA simulator takes NumPy arrays, not device arrays")
            return np.ascontiguousarray(a, dtype=dtype)
        return self.xp.ascontiguousarray(self.xp.asarray(a), dtype=dtype)

    def blocks(self, needed: int) -> int:
        return max(1, min(needed, _SIM_MAX_BLOCKS)) if self.sim else max(1, needed)

    def launch(self, kernel, blocks: int, threads: int, shared: int, *args):
        """``kernel[blocks, threads, stream, shared](*args)``. In the simulator the interpreter's
        thread switch interval is cut while it runs: its block manager busy-polls, and with the
        default 5 ms every barrier of its Python threads waits for the GIL."""
        if not self.sim:
            kernel[blocks, threads, self.stream, shared](*args)
            return
        old = sys.getswitchinterval()
        sys.setswitchinterval(min(old, 2e-4))
        try:
            kernel[blocks, threads, 0, shared](*args)
        finally:
            sys.setswitchinterval(old)


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

    Exactly :func:`beatflow.segment.local_maxima` (``maximum_filter1d(env, 2*half+1,
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


def embed_gpu(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0):
    """Each beat in a row of a zero-padded ``(n, width)`` float32 matrix, and its peak-to-peak.

    Exactly :func:`beatflow.beats.embed` for beats with ``0 < length <= width`` lying in ``x``: row
    ``i`` is ``x[start[i]-first : start[i]-first+length[i]]`` (as float32) minus, when
    ``baseline_samples > 0``, the mean of the first ``min(baseline_samples, width)`` samples of the
    beat's window, then zeros; ``p2p[i]`` is the range of the row's valid samples.

    A beat with ``length <= 0`` or ``length > width`` is skipped: its row is all zeros and its p2p 0
    (``beats.embed`` leaves those undefined). Reads are clipped to ``x``, writes to the output, so a
    bad ``start`` cannot touch memory outside the arrays.

    Row order: the kernel runs one warp per beat and each warp claims its output row with an atomic
    counter, so rows come out of the kernel in a nondeterministic order; it records
    ``beat_of_row[row] = beat`` and the wrapper scatters ``out[beat_of_row] = rows``, so the result
    is in beat order, the same as ``beats.embed`` (and deterministic). Unclaimed rows (skipped beats)
    are sent to a spare last row that is dropped, so no device-to-host synchronisation is needed.

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

    Returns
    -------
    rows : float32 (n, width), p2p : float32 (n,), in the namespace of ``x``.
    """
    width = int(width)
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    ctx, host_in = _ctx_for(x, start, length)
    kernels, _ = _build()
    xp = ctx.xp
    x = ctx.array(x)
    start = ctx.array(start, dtype=np.int64).reshape(-1)
    length = ctx.array(length, dtype=np.int64).reshape(-1)
    n = int(start.shape[0])
    if length.shape[0] != n:
        raise ValueError(f"start and length differ in size: {n} != {length.shape[0]}")
    if n == 0:
        rows, p2p = xp.zeros((0, width), dtype=xp.float32), xp.zeros(0, dtype=xp.float32)
    else:
        rows_c = xp.empty((n, width), dtype=xp.float32)  # rows in claim order
        p2p_c = xp.empty(n, dtype=xp.float32)
        beat_of_row = xp.full(n, n, dtype=xp.int64)  # unclaimed rows -> the spare row n
        counter = xp.zeros(1, dtype=xp.int32)
        warps = 1 if ctx.sim else _EMBED_WARPS  # simulator: a block is one warp (shuffle emulation)
        ctx.launch(kernels["embed_warp"], ctx.blocks(-(-n // warps)), warps * WARP, 0,
                   ctx.arg(x), ctx.arg(start), ctx.arg(length), int(first), width, max(0, int(baseline_samples)),
                   ctx.arg(rows_c), ctx.arg(p2p_c), ctx.arg(counter), ctx.arg(beat_of_row))
        rows = xp.zeros((n + 1, width), dtype=xp.float32)
        p2p = xp.zeros(n + 1, dtype=xp.float32)
        rows[beat_of_row] = rows_c  # back to beat order
        p2p[beat_of_row] = p2p_c
        rows, p2p = rows[:n], p2p[:n]
    if host_in:
        return xp.asnumpy(rows), xp.asnumpy(p2p)
    return rows, p2p


def detect_peaks_gpu(x, s, *, first: int = 0, core: tuple[int, int] | None = None):
    """:func:`beatflow.segment.detect_peaks` on the GPU: same contract, same peaks.

    The array code of :mod:`beatflow.segment` makes some forty small passes and host
    synchronisations over the ~1 candidate per beat; here the whole detection is nine kernel
    launches and two synchronisations (the sizes of the candidate list and of the result):

    1. ``envelope_tiled``: despike, derivative-of-Gaussian slope and moving RMS in one pass, one
       shared-memory tile per block (the sums in the order of the CPU kernel);
    2. ``nms_tiled`` + ``flatnonzero``: the candidates (:func:`local_maxima_gpu`);
    3. ``block_max_warp`` and ``block_median``: the local level of every 1 s block;
    4. ``cand_eval``: per candidate its height, weak/strong class and steepest slope;
    5. ``cand_twave``, ``cand_refractory``: the strong candidates' T-wave test and refractory period;
    6. ``cand_search_back``, ``cand_refractory``: the weak candidates that fill a gap, and their
       refractory period.

    The decisions of 5-6 compare a candidate with its neighbours in a set (the previous strong
    one, the beats around it): each thread walks along the sorted candidates from its own until
    it finds them or passes the distance that matters (``twave``, ``refractory``, ``max_gap``,
    ``rr_window``), so no compaction is needed between the steps.

    Parameters and result as :func:`beatflow.segment.detect_peaks` (``x`` a CuPy array, or NumPy
    under the simulator; the peaks in the same namespace).
    """
    from .segment import _detect_peaks_xp, gaussian_derivative

    ctx, host_in, kernels, xp, x = _vector_call(x, "x")
    n = int(x.shape[0])
    if n < 3 or 2 * s.blocks + 1 > _MAX_WINDOW:  # too short for the 3-point median, or a window too wide
        out = _detect_peaks_xp(x, s, first=first, core=core)
        return xp.asnumpy(out) if host_in else out
    first = int(first)
    sim = ctx.sim
    a = ctx.arg
    env = qrs_envelope_gpu(x, s)  # 1.
    cand = local_maxima_gpu(env, s.nms)  # 2.
    m = int(cand.shape[0])
    if m == 0:
        out = xp.zeros(0, dtype=xp.int64)
        return xp.asnumpy(out) if host_in else out
    amp, b0 = block_amplitude_gpu(env, first, s)  # 3.
    # 4.-6.
    xmax = xp.abs(x).max().reshape(1)
    kf = xp.asarray(gaussian_derivative(s.fine_kernel, s.fine_a))
    st_a = xp.empty(m, dtype=xp.int8)
    st_b = xp.empty(m, dtype=xp.int8)
    height = xp.empty(m, dtype=xp.float64)
    slope = xp.empty(m, dtype=xp.float64)
    blocks, threads = ctx.blocks(-(-m // _CAND_TPB)), WARP if sim else _CAND_TPB
    ctx.launch(kernels["cand_eval"], blocks, threads, 0, a(x), a(env), a(cand), a(amp), b0, first, int(s.block),
               int(s.edge), float(s.weak_ratio), float(s.ratio), a(xmax), a(kf), int(s.slope_half),
               a(st_a), a(height), a(slope))
    ctx.launch(kernels["cand_twave"], blocks, threads, 0, a(cand), a(st_a), a(slope), int(s.twave),
               float(s.twave_slope), a(st_b))
    ctx.launch(kernels["cand_refractory"], blocks, threads, 0, a(cand), a(st_b), 2, a(height), int(s.refractory),
               a(st_a), 3)
    nbeats = (st_a == 3).sum(dtype=xp.int64).reshape(1)
    ctx.launch(kernels["cand_search_back"], blocks, threads, 0, a(cand), a(st_a), a(slope), a(nbeats),
               int(s.max_gap), int(s.rr_window), float(s.searchback), float(s.margin), float(s.twave_slope),
               a(st_b))
    ctx.launch(kernels["cand_refractory"], blocks, threads, 0, a(cand), a(st_b), 4, a(height), int(s.twave),
               a(st_a), 4)
    peaks = cand[xp.flatnonzero(st_a >= 3)] + first
    if core is not None:
        peaks = peaks[(peaks >= core[0]) & (peaks < core[1])]
    return xp.asnumpy(peaks) if host_in else peaks


def qrs_envelope_gpu(x, s):
    """:func:`beatflow.segment.qrs_envelope` as one kernel (``envelope_tiled``): the sums of
    :func:`beatflow.cpu_kernels.envelope_cpu` in its order, float64, same length as ``x`` (n >= 3)."""
    from .segment import gaussian_derivative

    ctx, host_in, kernels, xp, x = _vector_call(x, "x")
    n = int(x.shape[0])
    if n < 3:
        raise ValueError(f"the envelope kernel takes a stream of at least 3 samples, got {n}")
    kr = xp.asarray(gaussian_derivative(s.kernel, s.a)[::-1].copy())
    env = xp.empty(n, dtype=xp.float64)
    box = int(s.box)
    g = max(1, int(np.sqrt(box)))
    tpb = WARP if ctx.sim else _ENV_TPB
    shared = (2 * tpb + 4 * (box // 2) + 2 * (int(s.kernel) // 2)) * 8
    ctx.launch(kernels["envelope_tiled"], ctx.blocks(-(-n // tpb)), tpb, shared, ctx.arg(x), ctx.arg(kr), box, g,
               box // g, ctx.arg(env))
    return xp.asnumpy(env) if host_in else env


def block_amplitude_gpu(env, first: int, s):
    """:func:`beatflow.segment.block_amplitude` as two kernels (block maxima, one warp per block;
    the median over ``±s.blocks`` blocks, one thread per block). Returns ``(amp, b0)``."""
    ctx, host_in, kernels, xp, env = _vector_call(env, "env")
    n = int(env.shape[0])
    if 2 * s.blocks + 1 > _MAX_WINDOW:
        raise ValueError(f"threshold_blocks={s.blocks}: the level's window is at most {_MAX_WINDOW} blocks")
    b0 = int(first) // s.block
    lead = int(first) - b0 * s.block
    nb = -(-(lead + n) // s.block)
    bmax = xp.empty(nb, dtype=xp.float64)
    amp = xp.empty(nb, dtype=xp.float64)
    warps = 1 if ctx.sim else 8  # simulator: one-warp blocks (shuffle emulation)
    ctx.launch(kernels["block_max_warp"], ctx.blocks(-(-nb // warps)), warps * WARP, 0, ctx.arg(env), lead,
               int(s.block), ctx.arg(bmax))
    ctx.launch(kernels["block_median"], ctx.blocks(-(-nb // _CAND_TPB)), WARP if ctx.sim else _CAND_TPB, 0,
               ctx.arg(bmax), int(s.blocks), ctx.arg(amp))
    return (xp.asnumpy(amp) if host_in else amp), b0

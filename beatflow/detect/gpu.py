"""The beat detection on the GPU (Numba CUDA kernels): :func:`detect_peaks_gpu`, :func:`detect_beats_gpu`
(with the flutter rule), :func:`segment_rows_gpu` (and the beats' rows, one synchronisation),
:class:`SegmentGraph` (the same launches replayed over one buffer), :func:`local_maxima_gpu` (the
non-maximum suppression) and :func:`qrs_envelope_gpu`.

:mod:`beatflow.detect` dispatches here for device arrays. Each wrapper has exactly the contract of
the array code it stands in for (:mod:`beatflow.detect.peaks`, :mod:`beatflow.detect.rhythm`) and is
tested against it and against the same loop references (``tests/naive.py``). The seed's NMS kernel
is ``nms_tiled``; detection adds a fused envelope, the block levels and the per-candidate decisions
(:mod:`beatflow.detect.gpu_kernels`) and the flutter rule's kernels (:mod:`beatflow.detect.gpu_vf`).
Where the kernels cannot take the input (fewer than 3 samples, windows wider than their tiles) the
array code runs, on the device, with the NMS kernel. Launches, streams and the simulator:
:mod:`beatflow.gpu.runtime`.
"""
from __future__ import annotations

import contextlib
import os

from beatflow.detect import gpu_kernels as GK
from beatflow.detect.gpu_vf import flutter_pass
from beatflow.detect.peaks import detect_peaks_xp
from beatflow.detect.rhythm import detect_beats_xp
from beatflow.embed.gpu import beat_rows_gpu, rows_launch
from beatflow.gpu.runtime import SHARED_BYTES, WARP, Ctx, Workspace, ctx_for, vector_call

__all__ = ["local_maxima_gpu", "detect_peaks_gpu", "detect_beats_gpu", "segment_rows_gpu", "SegmentGraph",
           "qrs_envelope_gpu"]

# NMS: threads per block; a tile of ``_NMS_TPB + 2*half`` float64 must fit in shared memory
_NMS_TPB = 256
_SIM_NMS_TPB = 32
_CAND_TPB = GK.CAND_TPB

#: the detection's kernels on three streams (BEATFLOW_DETECT_STREAMS=0: one): the flutter rule's
#: beside the dense kernel's last blocks and the candidates', the candidates' at high priority
_STREAMS = os.environ.get("BEATFLOW_DETECT_STREAMS", "1") not in ("0", "false", "no")

#: the detection's launch shape: threads per tile and samples per tile (GPU; the simulator runs one
#: warp per tile). H200 (``bench/results/detection.md``, launch shape): the detection 0.84 ms with 128
#: threads, 0.91 with 256, 0.93 with 256 on 2048 samples, 0.99 with 128 on 512, 1.25 with 512 on 2048
#: or 4096.
_DET_TPB, _DET_TILE = 128, 1024
#: doubling levels of the NMS window maxima written out in the dense kernel (windows up to 2047
#: samples; wider ones go to the array code, see _detect_plan)
_MAX_LEVELS = 10
_SIM_DET_TPB, _SIM_DET_TILE = WARP, 4 * WARP


_plans: dict = {}
_plan_last: list = [None]  # (s, flags, plan) of the last call


def _detect_plan(s, sim: bool):
    """``(kernels, tile, tpb)`` for these parameters, or None where the fused kernels cannot take
    them (a level window wider than ``MAX_WINDOW`` blocks, an NMS window of more than
    ``2**(_MAX_LEVELS + 1) - 1`` samples, or windows so wide that even a tile of one sample per thread
    would not fit in 48 KiB of shared memory): then the array code runs. Kept per parameter set and
    launch shape (every detection asks for it, and the host's time before the first kernel is the
    GPU's idle time; the last one also by the identity of ``s``, a frozen dataclass, which skips
    building the key)."""
    flags = (bool(sim), _DET_TPB, _DET_TILE, _SIM_DET_TPB, _SIM_DET_TILE, tuple(GK.DENSE_CHUNKS), GK.REG_LEVELS)
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
    if 2 * s.blocks + 1 > GK.MAX_WINDOW:
        return None
    K, box, nms = int(s.kernel), int(s.box), int(s.nms)
    if (2 * nms + 1).bit_length() - 1 > _MAX_LEVELS:  # more doubling levels than `dense` writes out
        return None  # (a window that wide does not fit in shared memory either)
    chunks = tuple(int(c) for c in GK.DENSE_CHUNKS)
    while True:
        XA, YA, PA = GK.dense_alloc(K, box, nms, tile, chunks)
        shared = 8 * (XA + YA + PA + tpb + tpb // WARP) + 4
        if shared <= SHARED_BYTES:
            break
        if tile == tpb:
            return None
        tile //= 2
    return GK.build_detect(K, box, nms, int(s.block), int(s.fine_kernel), int(s.slope_half), tile, tpb,
                           GK.kernel_taps(K, float(s.a), True), GK.kernel_taps(int(s.fine_kernel), float(s.fine_a)),
                           chunks), tile, tpb


def local_maxima_gpu(env, half_window: int, *, tiled: bool | None = None):
    """Indices where ``env`` is the maximum of its ``±half_window`` neighbourhood and positive.

    Exactly :func:`beatflow.detect.peaks.local_maxima_xp` (``maximum_filter1d(env, 2*half+1,
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
    ctx, host_in, xp, env = vector_call(env, "env")
    kernels, _ = GK.build()
    n = int(env.shape[0])
    if n == 0:
        out = xp.zeros(0, dtype=xp.int64)
        return xp.asnumpy(out) if host_in else out
    gate = xp.empty(n, dtype=xp.uint8)
    tpb = _SIM_NMS_TPB if ctx.sim else _NMS_TPB
    shared = (tpb + 2 * half) * 8
    if tiled is None:
        tiled = shared <= SHARED_BYTES
    if tiled:
        ctx.launch(kernels["nms_tiled"], ctx.blocks(-(-n // tpb)), tpb, shared, ctx.arg(env), half, ctx.arg(gate))
    else:
        ctx.launch(kernels["nms_global"], ctx.blocks(-(-n // tpb)), tpb, 0, ctx.arg(env), half, ctx.arg(gate))
    out = xp.flatnonzero(gate).astype(xp.int64, copy=False)
    return xp.asnumpy(out) if host_in else out


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
    """The beat detection of :func:`beatflow.detect.detect_peaks` on the GPU, without the flutter
    rule: the same peaks as :func:`beatflow.detect.peaks.detect_peaks_xp` (:func:`detect_beats_gpu` adds
    the rule).

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

    Launches after a kernel's first go through CuPy's driver call
    (:class:`~beatflow.gpu.runtime.FastLaunch`).
    Sizes that depend on the data stay on the device (the candidate count is read by the kernels,
    which are launched for the capacity), so the host waits once, for the number of peaks. The
    decisions of 4-5 compare a candidate with its neighbours in a set (the previous strong one, the
    beats around it): each thread walks along the sorted candidates from its own until it finds
    them or passes the distance that matters (``twave``, ``refractory``, ``max_gap``, ``rr_window``).
    The slots per tile hold every candidate the NMS can produce unless a plateau of equal maxima
    fills them; then the detection runs again with a slot for every sample.

    Parameters and result as :func:`beatflow.detect.detect_peaks` (``x`` a CuPy array, or NumPy
    under the simulator; the peaks in the same namespace).
    """
    return _detect_gpu(x, s, first, core, _cap, rule=False)[0]


def detect_beats_gpu(x, s, *, first: int = 0, core: tuple[int, int] | None = None, _cap: int | None = None):
    """:func:`beatflow.detect.detect_beats` on the GPU: :func:`detect_peaks_gpu` with the flutter
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
    ``BEATFLOW_DETECT_STREAMS=0`` environment, or ``beatflow.detect.gpu._STREAMS = False``: all on one
    stream). The emission waits for both. H200 (``bench/results/detection.md``, streams): the kernels
    of segmentation + embedding end 60-80 µs earlier than on one stream; same peaks, episodes and rows.

    Returns ``(peaks, episodes)`` as :func:`beatflow.detect.detect_beats`.
    """
    return _detect_gpu(x, s, first, core, _cap, rule=s.vf_baseline > 0)


def _detect_gpu(x, s, first, core, _cap, rule: bool, rows: int | None = None):
    """The detection kernels, with the flutter rule when ``rule``: ``(peaks, episodes)``
    (``episodes`` empty without the rule). With ``rows`` (the baseline samples; ``x`` a whole
    recording: ``first == 0``, no core) also the kept beats and their rows, launched before the one
    synchronisation: ``(peaks, episodes, (index, peak, start, length, rows, p2p))``."""
    ctx, host_in, xp, x = vector_call(x, "x")
    n = int(x.shape[0])
    plan = None if n < 3 or s.fast_nms > 0 else _detect_plan(s, ctx.sim)
    if plan is None:  # too short for the 3-point median, or windows the kernels do not take: the array
        # code on the device, with the NMS kernel
        if rule:
            out, ep = detect_beats_xp(x, s, first=first, core=core, local_maxima=local_maxima_gpu)
        else:
            out = detect_peaks_xp(x, s, first=first, core=core, local_maxima=local_maxima_gpu)
            ep = xp.zeros((0, 2), dtype=xp.int64)
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
    xp, kernels = ctx.xp, GK.build()[0]
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
            episode, w0, spans = flutter_pass(low, x, s, first, *vf_range, info, keep)
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
            episode, w0, spans = flutter_pass(ctx, x, s, first, *vf_range, info)
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
            beat_out = rows_launch(ctx, x, peaks, info[0:1], info[4:5], s, first, n, rows, mcap)
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
    ctx.launch(GK.build()[0]["block_median"], ctx.blocks(-(-int(bmax.shape[0]) // _CAND_TPB)),
               WARP if ctx.sim else _CAND_TPB, 0, ctx.arg(bmax), int(s.blocks), ctx.arg(amp), sig="")
    return amp


def _exclusive_scan(ctx, counts, offsets, total=None):
    """``offsets[i] = sum(counts[:i])`` for ``i <= len(counts)``, and the sum into ``total[0]``
    (a device array) when given: one launch of the one-block ``exclusive_scan`` kernel, no sync
    (CuPy's cumsum and the zero before it were three launches)."""
    tot = ctx.empty(0, ctx.xp.int64) if total is None else total
    ctx.launch(GK.build()[0]["exclusive_scan"], 1, WARP if ctx.sim else GK.SCAN_TPB, 0, ctx.arg(counts),
               ctx.arg(offsets), ctx.arg(tot), sig="")


def qrs_envelope_gpu(x, s, *, first: int = 0, levels: bool = False):
    """:func:`beatflow.detect.qrs_envelope` with the detection's dense kernel (the sums of
    :func:`beatflow.detect.cpu.envelope_cpu` in its order), float64, same length as ``x`` (n >= 3).

    With ``levels=True`` also the local amplitude of :func:`beatflow.detect.peaks.block_amplitude`
    (``x`` starting at global sample ``first``): returns ``(env, amp, b0)``, the block maxima from
    the same kernel and their medians from the per-block kernel that the detection's ``cand_eval``
    shares (``_window_median``).
    """
    ctx, host_in, xp, x = vector_call(x, "x")
    n = int(x.shape[0])
    if n < 3:
        raise ValueError(f"the envelope kernel takes a stream of at least 3 samples, got {n}")
    plan = _detect_plan(s, ctx.sim)
    if plan is None:
        raise ValueError("these segmentation parameters exceed what the detection kernels take "
                         f"(threshold_blocks <= {(GK.MAX_WINDOW - 1) // 2}, windows that fit a shared-memory tile)")
    d = _dense_pass(ctx, plan, x, s, int(first), plan[1] // (int(s.nms) + 1) + 2, write_env=True)
    env = d["env"]
    if not levels:
        return xp.asnumpy(env) if host_in else env
    amp = _block_levels(ctx, d["bmax"], s)
    if host_in:
        return xp.asnumpy(env), xp.asnumpy(amp), d["b0"]
    return env, amp, d["b0"]


def segment_rows_gpu(x, s, *, baseline_samples: int = 0):
    """A whole recording's beats and their rows on the GPU with one synchronisation:
    :func:`detect_beats_gpu` then :func:`beat_rows_gpu`, the second launched behind the first before
    anything comes back to the host (the peaks and their number stay on the device; the rows'
    kernels are launched for the detection's candidate capacity, so their outputs are sized for it:
    about 19 rows of ``s.width`` float32 per 1024 samples, 0.35 GB for 20 h at 250 Hz).

    Returns ``(peaks, episodes, index, peak, start, length, rows, p2p)``: those of
    :func:`beatflow.detect.detect_beats` and of :func:`beatflow.embed.beat_rows` (``x`` the whole
    recording: ``first = 0``, ``n_samples = len(x)``), in the namespace of ``x``.
    """
    peaks, ep, rows = _detect_gpu(x, s, 0, None, None, rule=s.vf_baseline > 0,
                                  rows=max(0, int(baseline_samples)))
    return (peaks, ep) + tuple(rows)


class SegmentGraph:
    """:func:`segment_rows_gpu` over one device buffer, again and again: for a caller that writes
    each new stretch of signal into the same array (a monitor's window, fixed-size partitions) and
    segments it. The launches of a call are captured once in a CUDA graph, over arrays kept for it
    (a :class:`~beatflow.gpu.runtime.Workspace`); each call replays the graph (one launch for all the kernels, no host
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
        ctx, host_in = ctx_for(x)
        if host_in:
            raise ValueError("SegmentGraph reads a device buffer: pass a CuPy array (NumPy only under the "
                             "CUDA simulator)")
        if getattr(x, "ndim", None) != 1 or not x.flags.c_contiguous:
            raise ValueError(f"SegmentGraph's buffer must be a contiguous 1-D array, got shape "
                             f"{getattr(x, 'shape', None)}")
        n = int(x.shape[0])
        self.plan = None if n < 3 or s.fast_nms > 0 else _detect_plan(s, ctx.sim)
        if self.plan is None:
            raise ValueError(f"SegmentGraph takes what the detection kernels take: a stream of at least 3 "
                             f"samples ({n} given), windows that fit their tiles and no fast-rhythm "
                             f"candidates (fast_nms {s.fast_nms})")
        self.x, self.s, self.sim = x, s, ctx.sim
        self.rule, self.rows = s.vf_baseline > 0, max(0, int(baseline_samples))
        self.ws = Workspace()
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
        ctx = Ctx(self.sim)
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

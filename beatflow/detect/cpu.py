"""Fused CPU kernels (Numba) for the dense steps of segmentation on NumPy arrays.

Why they exist: the array-namespace version of the QRS energy envelope
(:func:`beatflow.detect.peaks.qrs_envelope_xp`) makes a dozen full passes over the stream (median, convolution, square,
moving sum, square root, each with its temporaries), and SciPy's moving maximum for the
non-maximum suppression is slower than all of them. On a 2-core machine that made segmentation
slower than NeuroKit2. Here each is one pass:

* :func:`envelope_cpu`: 3-point median → derivative-of-Gaussian convolution → RMS over a centred
  box, computed chunk by chunk so that every intermediate stays in the L1/L2 cache; the inner
  loops run over samples (not taps), so LLVM vectorises them without reassociating any sum
  (each output is summed in the same tap order as a plain loop);
* :func:`local_maxima_cpu`: the non-maximum suppression as a scan that only looks at the window of
  a sample that is a 3-point maximum, and stops at the first larger neighbour;
* :func:`flutter_features_cpu`: the flutter rule's per-window energies in one pass (the array code
  of :func:`beatflow.detect.rhythm.window_features_xp` made five full passes and four stream-sized
  temporaries, 2 s per 20 h on one core), and the near-median fractions of the windows that need one.
* :func:`quality_features_cpu`: the signal quality's window measures (:mod:`beatflow.detect.quality`)
  in one loop per window.

Each has exactly the contract of its array-namespace function in :mod:`beatflow.detect.peaks`,
:mod:`beatflow.detect.rhythm` or :mod:`beatflow.detect.leads` and is tested against it (and against
the loop references of ``tests/naive.py``); the steps at the end (:func:`qrs_envelope_cpu`,
:func:`steepest_at_cpu`, :func:`window_features_cpu`, :func:`lead_windows_cpu`) take the reference's
arguments, for streams of at least 3 samples (:mod:`beatflow.detect` chooses them). Compiled on first
use and cached on disk (``cache=True``; this module is imported only when the CPU path runs).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from beatflow.detect.peaks import gaussian_derivative
from beatflow.detect.rhythm import context_sum, quantile_sorted
from beatflow.params import SegmentSamples

__all__ = ["envelope_cpu", "local_maxima_cpu", "steepest_cpu", "flutter_features_cpu", "qrs_envelope_cpu",
           "steepest_at_cpu", "window_features_cpu", "lead_windows_cpu", "quality_features_cpu"]

_CHUNK = 4096


# module-level functions: Numba caches them on disk (closures would be recompiled in every process)
@njit(cache=True, nogil=True)
def _clip(i, n):
    return 0 if i < 0 else (n - 1 if i >= n else i)

@njit(cache=True, nogil=True)
def _despiked(x, j, n):
    # 3-point median at j (0 <= j < n, n >= 3); beyond the ends the neighbour is mirrored
    a = np.float64(x[j - 1] if j > 0 else x[1])
    b = np.float64(x[j])
    c = np.float64(x[j + 1] if j < n - 1 else x[n - 2])
    return max(min(a, b), min(max(a, b), c))

@njit(cache=True, nogil=True)
def _window_buffer(x, P0, R, xd):
    # xd[u] = despiked sample at clip(P0 - R + u); without clipping (the interior) a vectorised loop
    n = x.shape[0]
    lo = P0 - R
    L = xd.shape[0]
    if lo >= 1 and lo + L + 1 <= n:
        for u in range(L):
            a = np.float64(x[lo + u - 1])
            b = np.float64(x[lo + u])
            c = np.float64(x[lo + u + 1])
            xd[u] = max(min(a, b), min(max(a, b), c))
    else:
        for u in range(L):
            xd[u] = _despiked(x, _clip(lo + u, n), n)

@njit(cache=True, nogil=True)
def _envelope(x, kr, box, out):
    n = x.shape[0]
    K = kr.shape[0]
    kh = K // 2
    bh = box // 2
    # per chunk [c0, c1): slope y over [c0 - bh, c1 + bh), despiked xd over that ± kh
    ylen = _CHUNK + 2 * bh
    xd = np.empty(ylen + 2 * kh, np.float64)
    y = np.empty(ylen, np.float64)
    acc = np.empty(_CHUNK, np.float64)
    part = np.empty(ylen, np.float64)
    g = max(1, int(np.sqrt(box)))
    groups = box // g
    for c0 in range(0, n, _CHUNK):
        c1 = min(n, c0 + _CHUNK)
        m = c1 - c0
        ylo = c0 - bh
        yl = m + 2 * bh
        xlo = ylo - kh
        xl = yl + 2 * kh
        _window_buffer(x, xlo, 0, xd[:xl])
        # y[t] = sum_j xd[_clip(ylo + t + kh - j)] * k[j] = sum_i xd[t + i] * kr[i] with kr the
        # reversed kernel; the loop over t is the inner one, and its index must run forward
        # for LLVM to vectorise it (2.3x)
        for t in range(yl):
            y[t] = 0.0
        for i in range(K):
            ki = kr[i]
            for t in range(yl):
                y[t] += xd[t + i] * ki
        # the envelope repeats the edge values of y beyond the stream's ends (mode "nearest")
        if ylo < 0:
            e = y[-ylo]
            for t in range(-ylo):
                y[t] = e
        if ylo + yl > n:
            e = y[n - 1 - ylo]
            for t in range(n - ylo, yl):
                y[t] = e
        for t in range(yl):
            y[t] = y[t] * y[t]
        # moving sum of `box` squares as sums of `g` consecutive ones (g ≈ √box: ~2√box adds
        # per sample instead of box); each output is summed in the same order wherever the
        # stream was cut, so partitions agree bit for bit
        for t in range(yl - g + 1):
            part[t] = y[t]
        for i in range(1, g):
            for t in range(yl - g + 1):
                part[t] += y[t + i]
        for t in range(m):
            acc[t] = part[t]
        for q in range(1, groups):
            for t in range(m):
                acc[t] += part[t + q * g]
        for i in range(groups * g, box):
            for t in range(m):
                acc[t] += y[t + i]
        for t in range(m):
            out[c0 + t] = np.sqrt(max(acc[t] / box, 0.0))
    return out

@njit(cache=True, nogil=True)
def _nms(env, half, out):
    n = env.shape[0]
    cnt = 0
    for i in range(n):
        v = env[i]
        if not v > 0.0:
            continue
        ok = True
        for d in range(1, half + 1):  # nearest first: most samples fail at d = 1
            if (i - d >= 0 and env[i - d] > v) or (i + d < n and env[i + d] > v):
                ok = False
                break
        if ok:
            out[cnt] = i
            cnt += 1
    return cnt

@njit(cache=True, nogil=True)
def _steepest(x, at, k, sh, out):
    n = x.shape[0]
    K = k.shape[0]
    kh = K // 2
    w = np.empty(2 * (sh + kh) + 1, np.float64)
    for r in range(at.shape[0]):
        lo = at[r] - sh - kh
        for t in range(w.shape[0]):
            w[t] = _despiked(x, _clip(lo + t, n), n)
        best = 0.0
        for u in range(2 * sh + 1):
            q = at[r] - sh + u
            if q < 0 or q >= n:
                continue
            d = 0.0
            for j in range(K):
                d += w[u + 2 * kh - j] * k[j]
            d = abs(d)
            if d > best:
                best = d
        out[r] = best
    return out



@njit(cache=True, nogil=True)
def _high_window(xd, ta, tb, R, hp, h):
    # h[t] for t in [ta, tb): xd[t + R] minus the mean of its hp neighbours, the sum carried along
    hh = hp // 2
    acc = 0.0
    for i in range(hp):
        acc += xd[ta + R - hh + i]
    for t in range(ta, tb):
        if t > ta:
            acc += xd[t + R + hh] - xd[t + R - hh - 1]
        h[t] = xd[t + R] - acc / hp

@njit(cache=True, nogil=True)
def _window_energies(x, kr, first, w0, W, hp, e_sig, e_slope):
    n = x.shape[0]
    K = kr.shape[0]
    kh = K // 2
    R = max(hp // 2, kh)
    xd = np.empty(W + 2 * R, np.float64)
    h = np.empty(W, np.float64)
    d = np.empty(W, np.float64)
    for k in range(e_sig.shape[0]):
        P0 = (w0 + k) * W - first
        _window_buffer(x, P0, R, xd)
        ta = max(0, -P0)  # the window's samples inside x; the others repeat those at its ends
        tb = min(W, n - P0)
        _high_window(xd, ta, tb, R, hp, h)
        for t in range(ta, tb):
            d[t] = 0.0
        for i in range(K):  # taps outer, samples inner (vectorised, as _envelope)
            ki = kr[i]
            off = R - kh + i
            for t in range(ta, tb):
                d[t] += xd[t + off] * ki
        ss = 0.0
        sd = 0.0
        for t in range(ta, tb):
            ss += h[t] * h[t]
            sd += d[t] * d[t]
        if ta > 0:
            ss += ta * h[ta] * h[ta]
            sd += ta * d[ta] * d[ta]
        if tb < W:
            ss += (W - tb) * h[tb - 1] * h[tb - 1]
            sd += (W - tb) * d[tb - 1] * d[tb - 1]
        e_sig[k] = ss
        e_slope[k] = sd

_quantile = njit(cache=True, nogil=True)(quantile_sorted)

@njit(cache=True, nogil=True)
def _window_near(x, first, w0, W, hp, R, rows, tol, near):
    n = x.shape[0]
    xd = np.empty(W + 2 * R, np.float64)
    h = np.empty(W, np.float64)
    v = np.empty(W, np.float64)
    for r in range(rows.shape[0]):
        k = rows[r]
        P0 = (w0 + k) * W - first
        _window_buffer(x, P0, R, xd)
        ta = max(0, -P0)
        tb = min(W, n - P0)
        _high_window(xd, ta, tb, R, hp, h)
        for t in range(W):
            v[t] = h[min(max(t, ta), tb - 1)]
        srt = np.sort(v)
        if W % 2 == 1:
            med = srt[W // 2]
        else:
            med = (srt[W // 2 - 1] + srt[W // 2]) / 2.0
        lo = _quantile(srt, 0.03)
        thr = tol * (_quantile(srt, 0.97) - lo)
        c = 0
        for t in range(W):
            if abs(v[t] - med) < thr:
                c += 1
        near[k] = c / W



@njit(cache=True, nogil=True)
def _quality_windows(x, g, first, w0, W, hp, levels, pinned, kurt, hf):
    # per window: the raw samples around it (ends clipped to x), the high-pass (_high_window) and the
    # residue of the Gaussian low-pass g over the window's samples inside x, then the four measures
    n = x.shape[0]
    G = g.shape[0]
    gh = G // 2
    R = max(hp // 2, gh)
    xb = np.empty(W + 2 * R, np.float64)
    h = np.empty(W, np.float64)
    low = np.empty(W, np.float64)
    for k in range(levels.shape[0]):
        P0 = (w0 + k) * W - first
        for u in range(W + 2 * R):
            xb[u] = x[_clip(P0 - R + u, n)]
        ta = max(0, -P0)
        tb = min(W, n - P0)
        m = tb - ta
        _high_window(xb, ta, tb, R, hp, h)
        for t in range(ta, tb):
            low[t] = 0.0
        for i in range(G):  # taps outer, samples inner (vectorised, as _envelope)
            gi = g[i]
            off = R - gh + i
            for t in range(ta, tb):
                low[t] += gi * xb[t + off]
        hi = xb[ta + R]
        lo = hi
        for t in range(ta, tb):
            v = xb[t + R]
            hi = max(hi, v)
            lo = min(lo, v)
        step = np.inf
        c_hi = 0
        c_lo = 0
        s1 = 0.0
        e_above = 0.0
        for t in range(ta, tb):
            v = xb[t + R]
            if t > ta:
                d = abs(v - xb[t + R - 1])
                if d > 0 and d < step:
                    step = d
            c_hi += v == hi
            c_lo += v == lo
            s1 += h[t]
            f = v - low[t]
            e_above += f * f
        levels[k] = (hi - lo) / step if step < np.inf else 0.0
        pinned[k] = (c_hi + c_lo) / m
        mean = s1 / m
        m2 = 0.0
        m4 = 0.0
        for t in range(ta, tb):
            c = h[t] - mean
            c2 = c * c
            m2 += c2
            m4 += c2 * c2
        kurt[k] = m * m4 / (m2 * m2) if m2 > 0 else 0.0
        e_high = m2 + m * mean * mean
        hf[k] = e_above / e_high if e_high > 0 else 0.0


def envelope_cpu(x: np.ndarray, kernel: np.ndarray, box: int) -> np.ndarray:
    """QRS energy envelope of a NumPy stream in one fused pass.

    Parameters
    ----------
    x : ndarray, 1-D, float32 or float64
        The stream (at least 3 samples).
    kernel : ndarray, float64, odd length
        Convolution taps (the derivative of a Gaussian).
    box : int
        Odd RMS window in samples.

    Returns
    -------
    ndarray, float64
        ``sqrt(mean over ±box//2 of (despike(x) * kernel)²)``, every convolution and window
        padded with the edge values: equal (to float round-off) to
        :func:`beatflow.detect.peaks.qrs_envelope_xp`.
    """
    x = np.ascontiguousarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    out = np.empty(x.shape[0], np.float64)
    if x.shape[0] == 0:
        return out
    kr = np.ascontiguousarray(np.asarray(kernel, dtype=np.float64)[::-1])
    return _envelope(x, kr, int(box), out)


def local_maxima_cpu(env: np.ndarray, half_window: int) -> np.ndarray:
    """Indices where ``env`` is positive and the maximum of its ``±half_window`` neighbourhood.

    Exactly ``flatnonzero((env == maximum_filter1d(env, 2*half+1, mode="nearest")) & (env > 0))``.
    """
    env = np.ascontiguousarray(env)
    out = np.empty(env.shape[0], np.int64)
    return out[: _nms(env, int(half_window), out)].copy()


def steepest_cpu(x: np.ndarray, at: np.ndarray, kernel: np.ndarray, slope_half: int) -> np.ndarray:
    """Max of |despiked ``x`` convolved with ``kernel``| over ``±slope_half`` around each of ``at``.

    Exactly :func:`beatflow.detect.peaks.steepest_at_xp` (the array-namespace version) for a NumPy
    stream of at least 3 samples, a loop per position instead of a gathered matrix.
    """
    x = np.ascontiguousarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    at = np.ascontiguousarray(at, dtype=np.int64)
    out = np.empty(at.shape[0], np.float64)
    return _steepest(x, at, np.ascontiguousarray(kernel, dtype=np.float64), int(slope_half), out)


def flutter_features_cpu(x: np.ndarray, first: int, window: int, highpass: int, kernel: np.ndarray,
                         rows: np.ndarray | None = None, tol: float = 0.1):
    """The flutter rule's window quantities of :func:`beatflow.detect.rhythm.window_features_xp` for a NumPy
    stream of at least 3 samples: windows of ``window`` samples aligned to the stream (``x[0]`` is
    global sample ``first``), the ones at the ends of ``x`` completed with its end samples.

    With ``rows=None``: ``(e_sig, e_slope)``, per window the energies of the high-passed signal
    (despiked minus its moving mean over ``highpass`` samples) and of its slope (``kernel``). With
    ``rows``: the near-median fractions of those windows (0 elsewhere): the share of high-passed
    samples within ``tol`` × their 3–97 % range of their median (NumPy's median and linear
    percentiles).
    """
    x = np.ascontiguousarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    W, hp, first = int(window), int(highpass), int(first)
    w0 = first // W
    nw = -(-(first - w0 * W + x.shape[0]) // W)
    kr = np.ascontiguousarray(np.asarray(kernel, dtype=np.float64)[::-1])
    if rows is None:
        e_sig = np.empty(nw, np.float64)
        e_slope = np.empty(nw, np.float64)
        _window_energies(x, kr, first, w0, W, hp, e_sig, e_slope)
        return e_sig, e_slope
    near = np.zeros(nw, np.float64)
    R = max(hp // 2, kr.shape[0] // 2)
    _window_near(x, first, w0, W, hp, R, np.ascontiguousarray(rows, dtype=np.int64), float(tol), near)
    return near


# --- the steps, with the references' arguments (NumPy streams of at least 3 samples) --------------
def qrs_envelope_cpu(x: np.ndarray, s: SegmentSamples) -> np.ndarray:
    """:func:`beatflow.detect.peaks.qrs_envelope_xp` in one fused pass (:func:`envelope_cpu`)."""
    return envelope_cpu(x, gaussian_derivative(s.kernel, s.a), s.box)


def steepest_at_cpu(x: np.ndarray, at: np.ndarray, s: SegmentSamples) -> np.ndarray:
    """:func:`beatflow.detect.peaks.steepest_at_xp` as a loop per position (:func:`steepest_cpu`)."""
    if at.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    return steepest_cpu(x, at, gaussian_derivative(s.fine_kernel, s.fine_a), s.slope_half)


def window_features_cpu(x: np.ndarray, first: int, s: SegmentSamples):
    """:func:`beatflow.detect.rhythm.window_features_xp` with the fused loops of
    :func:`flutter_features_cpu` (one pass for the energies, the near-median fractions only for the
    windows that need them); the array code is their reference."""
    taps = gaussian_derivative(s.kernel, s.a)
    e_sig, e_slope = flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps)
    c = s.vf_context
    smooth = context_sum(e_slope, c) < s.vf_omega**2 * context_sum(e_sig, c)
    rows = np.flatnonzero(context_sum(smooth.astype(np.float64), c) > 0)
    near = flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps, rows=rows, tol=s.vf_tol)
    base = context_sum(near, c) / context_sum(np.ones(near.shape[0], dtype=np.float64), c)
    return smooth, base, first // s.vf_window


def lead_windows_cpu(x: np.ndarray, first: int, s: SegmentSamples):
    """:func:`beatflow.detect.leads.lead_windows_xp` with the fused loops of
    :func:`flutter_features_cpu`: ``(e_signal, e_slope, near, w0)``, ``near(rows)`` computing the
    near-median fractions of the windows ``rows`` when asked."""
    taps = gaussian_derivative(s.kernel, s.a)
    e_sig, e_slope = flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps)

    def near(rows):
        return flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps, rows=rows, tol=s.vf_tol)

    return e_sig, e_slope, near, first // s.vf_window


def quality_features_cpu(x: np.ndarray, first: int, q):
    """:func:`beatflow.detect.quality.window_features` in one pass per window (the array code makes a
    dozen passes and five stream-sized temporaries: 26.5 ms against 9.5 ms here, and 29 ms for the
    detection of the same 30-minute MIT-BIH record, ``bench/results/quality.md``):
    ``(levels, pinned, kurtosis, hf_share, w0)``.
    The moving mean of the high-pass is carried along each window from its own start (the array
    code's from the start of ``x``), so the measures agree to rounding."""
    from beatflow.detect.quality import lowpass_taps

    x = np.ascontiguousarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    W, first = int(q.window), int(first)
    w0 = first // W
    nw = -(-(first - w0 * W + x.shape[0]) // W)
    out = [np.empty(nw, np.float64) for _ in range(4)]
    _quality_windows(x, lowpass_taps(q.hf_sigma, np), first, w0, W, int(q.highpass), *out)
    return (*out, w0)

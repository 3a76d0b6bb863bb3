"""Ventricular flutter/fibrillation episodes: detected peaks inside them are waves, not beats.

In ventricular flutter the ECG is a smooth, almost sinusoidal wave at 3–5 Hz with no isoelectric
baseline; the QRS detector takes its crests for beats (MIT-BIH 207: ~300 false positives inside the
annotated episodes, which carry no beat annotations). Fast ventricular tachycardia has beats of
similar rate, so the rule looks at the wave's shape rather than at the rate.

Array code for NumPy and CuPy (the namespace comes from the input) over fixed windows of
``s.vf_window`` samples aligned to the stream (window ``k`` covers global samples ``[k·W, (k+1)·W)``,
as the blocks of :func:`beatflow.detect.peaks.block_amplitude`): the reference. On the CPU the
window quantities come from the fused loops of :func:`beatflow.detect.cpu.window_features_cpu`
(the ``window_features`` step, which :mod:`beatflow.detect` passes for NumPy input); on the GPU the
detection runs the same steps as kernels (:mod:`beatflow.detect.gpu_vf`: about sixty CuPy launches
took 4.5–5.8 ms over 20 h on an H200, the kernels 0.38 ms) and this array code is their reference and
fallback:

1. the despiked signal is high-passed (minus its moving mean over ``s.vf_highpass`` samples) and
   its QRS-band slope taken (:func:`beatflow.detect.peaks.wavelet_response`);
2. per window: the fraction of samples within ``s.vf_tol`` × (97th − 3rd percentile) of the
   window's median (the isoelectric baseline of a normal ECG holds most samples; flutter crosses
   it), and the energies of the high-passed signal and of its slope;
3. over each window and its ``±s.vf_context`` neighbours: the window is *flutter-like* when the
   mean baseline fraction is below ``s.vf_baseline`` and the mean frequency (Hjorth mobility,
   ``sqrt(E_slope / E_signal)`` in radians per sample) is below ``s.vf_omega`` (smooth waves:
   QRS complexes, noise and spikes raise it);
4. an episode is a run of at least ``s.vf_runs`` consecutive flutter-like windows; the peaks in
   its windows are dropped.

A partition's decision for a window looks at most ``(s.vf_runs + s.vf_context)`` windows away plus
the filters' radius; :meth:`beatflow.params.SegmentParams.samples` makes the halo cover that, so the
result does not depend on the partitioning. ``s.vf_baseline = 0`` switches the rule off.
"""
from __future__ import annotations

import math

import numpy as np

from beatflow.detect.peaks import (despike, despiked_slope, detect_peaks_xp, local_maxima_xp, qrs_envelope_xp,
                                   steepest_at_xp)
from beatflow.device import namespace_of, scipy_for
from beatflow.params import SegmentSamples


def context_sum(v, radius: int):
    """``v[k - radius] + … + v[k + radius]`` for every ``k`` (positions outside ``v`` add 0), added
    in that order (as the loop reference adds them): one padded copy and ``2·radius`` additions of
    its shifted views (few launches on a GPU)."""
    xp = namespace_of(v)
    n = v.shape[0]
    padded = xp.pad(v, radius, constant_values=0)
    total = padded[0:n]
    for i in range(1, 2 * radius + 1):
        total = total + padded[i : i + n]
    return total


def window_features_xp(x, first: int, s: SegmentSamples):
    """Per stream-aligned window, over it and its ``±s.vf_context`` neighbours: whether its waves
    are smooth, and the mean fraction of near-median samples (the reference of the CPU's fused loops,
    :func:`beatflow.detect.cpu.window_features_cpu`, and of the GPU kernels).

    Parameters
    ----------
    x : array, 1-D
        Samples ``[first, first + len(x))`` of a recording.
    first : int
        Global index of ``x[0]``.

    Returns
    -------
    (smooth, base, w0) : bool array, float64 array, int
        For global window ``w0 + k``: ``smooth[k]``, the mean frequency over the windows
        ``k ± vf_context`` (those that overlap ``x``: summed squared slope below ``vf_omega²`` ×
        summed squared high-passed signal) is below ``vf_omega``; ``base[k]``, the mean over the
        same windows of the fraction of near-median samples, computed only where it decides
        (``smooth[k]``; elsewhere it is not meaningful). The windows at the ends of ``x`` are
        completed with its first and last sample.
    """
    xp = namespace_of(x)
    h, e_sig, e_slope, w0 = window_energies_xp(x, first, s)
    nw = h.shape[0]
    c = s.vf_context
    smooth = context_sum(e_slope, c) < s.vf_omega**2 * context_sum(e_sig, c)
    # the baseline fraction (a median and two percentiles per window: most of the rule's cost) only
    # for the windows within ±c of a smooth one, the ones a smooth window's mean reads
    need = context_sum(smooth.astype(xp.float64), c) > 0
    near = near_fractions_xp(h, xp.flatnonzero(need), s)
    base = context_sum(near, c) / context_sum(xp.ones(nw, dtype=xp.float64), c)
    return smooth, base, w0


def window_energies_xp(x, first: int, s: SegmentSamples):
    """Per stream-aligned window (not summed with its neighbours): ``(h, e_signal, e_slope, w0)``,
    the high-passed despiked samples as an ``(nw, W)`` matrix (the windows at the ends completed with
    the end samples), the energies of those samples and of their QRS-band slope, and the global
    number of the first window."""
    xp = namespace_of(x)
    _, ndimage = scipy_for(xp)
    W, n = s.vf_window, x.shape[0]
    w0 = first // W
    lead = first - w0 * W
    nw = -(-(lead + n) // W)
    xd = despike(x)
    high = xd - ndimage.uniform_filter1d(xd, size=s.vf_highpass, mode="nearest")
    slope = despiked_slope(xd, s.kernel, s.a)  # peaks.wavelet_response, despiked once
    tail = nw * W - lead - n
    h = xp.pad(high, (lead, tail), mode="edge").reshape(nw, W)
    d = xp.pad(slope, (lead, tail), mode="edge").reshape(nw, W)
    return h, (h * h).sum(axis=1), (d * d).sum(axis=1), w0


def near_fractions_xp(h, rows, s: SegmentSamples):
    """The fraction of near-median samples of the windows ``rows`` of ``h`` (0 for the others):
    the share of samples within ``s.vf_tol`` × their 3–97 % range of their median."""
    xp = namespace_of(h)
    near = xp.zeros(h.shape[0], dtype=xp.float64)
    if rows.shape[0]:
        hr = h[rows]
        med = xp.median(hr, axis=1)
        lo, hi = xp.percentile(hr, [3.0, 97.0], axis=1)
        near[rows] = (xp.abs(hr - med[:, None]) < s.vf_tol * (hi - lo)[:, None]).sum(axis=1) / float(h.shape[1])
    return near


def flutter_windows(x, first: int, s: SegmentSamples, *, window_features=window_features_xp):
    """Which stream-aligned windows lie in a ventricular flutter/fibrillation episode.

    Returns
    -------
    (episode, w0) : bool array, int
        ``episode[k]`` for global window ``w0 + k``: the window is in a run of at least
        ``s.vf_runs`` consecutive flutter-like windows (low mean frequency and low baseline
        fraction: ``window_features``, of :func:`window_features_xp`'s contract).
    """
    smooth, base, w0 = window_features(x, first, s)
    return runs_of(smooth & (base < s.vf_baseline), s.vf_runs), w0


def runs_of(like, length: int):
    """Which windows lie in a run of at least ``length`` consecutive True of ``like`` (bool array)."""
    xp = namespace_of(like)
    L, nw = max(1, int(length)), like.shape[0]
    # full[j]: windows j .. j + L - 1 are all flutter-like; episode[k]: some full[j] with k - L < j <= k
    padded = xp.pad(like, (0, L - 1), constant_values=False)
    full = xp.ones(nw, dtype=bool)
    for i in range(L):
        full &= padded[i : i + nw]
    padded = xp.pad(full, (L - 1, 0), constant_values=False)
    episode = xp.zeros(nw, dtype=bool)
    for i in range(L):
        episode |= padded[i : i + nw]
    return episode


def episode_spans(episode, w0: int, window: int, lo: int, hi: int):
    """The runs of episode windows as ``[start, end)`` global sample ranges, clipped to ``[lo, hi)``.

    Parameters
    ----------
    episode : bool array
        ``episode[k]`` for global window ``w0 + k`` (:func:`flutter_windows`).
    window : int
        Window length in samples.

    Returns
    -------
    int64 array (m, 2), in the namespace of ``episode``; runs that miss ``[lo, hi)`` are left out.
    """
    xp = namespace_of(episode)
    d = xp.diff(xp.pad(episode.astype(xp.int8), 1))  # +1 at a run's first window, -1 after its last
    starts = xp.maximum((xp.flatnonzero(d == 1) + w0) * window, lo)
    ends = xp.minimum((xp.flatnonzero(d == -1) + w0) * window, hi)
    keep = ends > starts
    return xp.stack([starts[keep], ends[keep]], axis=1).astype(xp.int64)


def merge_spans(spans) -> np.ndarray:
    """Sample ranges of one recording gathered from its partitions (host arrays ``(m, 2)``), sorted,
    with ranges that touch or overlap joined (an episode across a partition boundary is one)."""
    rows = sorted(tuple(int(v) for v in r) for a in spans for r in np.asarray(a).reshape(-1, 2))
    out: list[list[int]] = []
    for a, b in rows:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def flutter_rule(x, peaks, first: int, s: SegmentSamples, span: tuple[int, int] | None = None, *,
                 window_features=window_features_xp):
    """The peaks to keep and the episodes: ``(keep, episodes)``.

    ``keep`` as :func:`flutter_keep_mask`; ``episodes`` the flutter/fibrillation episodes as
    ``[start, end)`` global sample ranges (whole windows) clipped to ``span`` (default: ``x``), an
    int64 ``(m, 2)`` array in the namespace of ``x`` (empty when the rule is off). ``window_features``:
    the step of :func:`window_features_xp`'s contract (:mod:`beatflow.detect` passes the CPU's loops).
    """
    xp = namespace_of(x)
    lo, hi = (first, first + x.shape[0]) if span is None else (int(span[0]), int(span[1]))
    if x.shape[0] == 0 or not s.vf_baseline > 0:
        return xp.ones(peaks.shape[0], dtype=bool), xp.zeros((0, 2), dtype=xp.int64)
    episode, w0 = flutter_windows(x, first, s, window_features=window_features)
    k = xp.clip(peaks // s.vf_window - w0, 0, episode.shape[0] - 1)
    return ~episode[k], episode_spans(episode, w0, s.vf_window, lo, hi)


def flutter_keep_mask(x, peaks, first: int, s: SegmentSamples, *, window_features=window_features_xp):
    """True for the peaks outside ventricular flutter/fibrillation episodes.

    Parameters
    ----------
    x : array, 1-D
        Samples ``[first, first + len(x))`` of a recording (a partition with its halos).
    peaks : int array
        Global sample indices of detected peaks, inside ``x``.
    first : int
        Global index of ``x[0]``.

    Returns
    -------
    bool array over ``peaks`` (all True when ``s.vf_baseline <= 0``, the rule switched off).
    """
    if peaks.shape[0] == 0:  # nothing to drop: the windows are not needed
        return namespace_of(x).ones(0, dtype=bool)
    return flutter_rule(x, peaks, first, s, window_features=window_features)[0]


def detect_beats_xp(x, s: SegmentSamples, *, first: int = 0, core: tuple[int, int] | None = None,
                    envelope=qrs_envelope_xp, local_maxima=local_maxima_xp, steepest=steepest_at_xp,
                    window_features=window_features_xp):
    """The peaks of :func:`beatflow.detect.peaks.detect_peaks_xp` outside the ventricular
    flutter/fibrillation episodes, and the episodes: the reference of
    :func:`beatflow.detect.detect_beats` (and the GPU kernels' fallback).

    Returns
    -------
    (peaks, episodes) : int64 arrays in the namespace of ``x``
        The sorted global peaks within ``core`` (default: ``x``); the episodes as ``[start, end)``
        global sample ranges within ``core``, shape ``(m, 2)`` (:func:`flutter_rule`; none when
        ``s.vf_baseline <= 0``, the rule switched off). The steps ``envelope``, ``local_maxima``,
        ``steepest`` and ``window_features`` as :func:`beatflow.detect.peaks.detect_peaks_xp` and
        :func:`flutter_rule` take them.
    """
    xp = namespace_of(x)
    vf = s.vf_baseline > 0
    peaks = detect_peaks_xp(x, s, first=first, core=None if vf else core, envelope=envelope,
                            local_maxima=local_maxima, steepest=steepest)
    if not vf:
        return peaks, xp.zeros((0, 2), dtype=xp.int64)
    keep, episodes = flutter_rule(x, peaks, first, s, span=core, window_features=window_features)
    peaks = peaks[keep]
    if core is not None:
        peaks = peaks[(peaks >= core[0]) & (peaks < core[1])]
    return peaks, episodes


def quantile_sorted(srt, q):
    """NumPy's default (linear) ``quantile(q)`` of the sorted values ``srt``, with its interpolation
    formula (as :func:`near_fractions_xp`'s percentiles take it). Plain Python: compiled by
    :mod:`beatflow.detect.cpu` for the CPU loops and by :mod:`beatflow.detect.gpu_vf` as a CUDA
    device function. (Numba's disk cache of the CPU loops is checked against ``cpu.py`` only: after a
    change here, delete ``beatflow/detect/__pycache__/cpu.*.nbi``.)"""
    m = srt.shape[0]
    vi = (m - 1) * q
    i0 = int(math.floor(vi))
    g = vi - i0
    a = srt[i0]
    b = srt[min(i0 + 1, m - 1)]
    diff = b - a
    if g >= 0.5:
        return b - diff * (1.0 - g)
    return a + diff * g

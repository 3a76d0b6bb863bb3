"""Signal quality: the stretches of a recording where no beat can be trusted, and why.

A QRS detector finds "beats" in anything: an hour of white noise gave 4,292 of them at 94 bpm. This
module judges the signal in windows of ``q.window`` samples (4 s by default) aligned to the recording
(window ``k`` covers its samples ``[k·W, (k+1)·W)``, as the flutter rule's windows of
:mod:`beatflow.detect.rhythm`) and gives each window a reason code (:data:`REASONS`):

* **flat** (lead-off, a flat line): the window's range is at most ``q.flat_levels`` of its
  quantisation steps (its smallest nonzero change from one sample to the next), or zero;
* **saturated** (clipping at the converter's rails): at least ``q.saturated`` of its samples sit
  exactly at its largest or at its smallest value;
* **noise** (no ECG structure): the kurtosis of the high-passed samples (the signal minus its moving
  mean over ``q.highpass`` samples) is below ``q.kurtosis`` and at least ``q.hf_share`` of their
  energy lies above the cutoff of a Gaussian low-pass (40 Hz, at most ``fs / 6``).

The noise test pairs two of the signal-quality indices that NeuroKit2's ``ecg_quality``
(``method="zhao2018"``) and Li, Mark & Clifford (2008) combine: the kurtosis (kSQI: QRS complexes
make an ECG's distribution peaked, while white noise has 3 and uniform noise 1.8) and the spectral
share of the QRS band (pSQI), here taken from the other side, as the share above the band: an ECG
(and a smooth wave such as ventricular flutter, which :mod:`beatflow.detect.rhythm` handles) has
little energy there, broadband noise much. Either alone would fail on real records: the paced and
wide complexes of MIT-BIH 107 and 217 have a kurtosis below 5 in most windows, and muscle noise
raises the high band of windows whose QRS complexes stand out clearly. The agreement of two
detectors (bSQI) is not used: it needs a second detection of the whole recording.

Unreadable windows (in runs of at least ``q.runs``) make episodes, ``[start, end)`` sample ranges
with their reason; the detection leaves out the peaks inside them (:func:`quality_rule`, called by
:func:`beatflow.embed.partitions.segment_partition` and :func:`beatflow.score.evaluate.record_beats`).

Measured (``.venv/bin/python bench/quality_mitdb.py``, ``bench/results/quality.md``: the 26 MIT-BIH
records of ``../shared/data/mitdb``, lead 0, at the defaults): no window holding an annotated beat is
called unreadable, so none of the 59,782 annotated beats is lost and the detection is unchanged (Se
99.834 %, PPV 99.821 %); 0 s of the 13.04 h are unreadable. The thresholds come from the noise's side,
not from the records: white and uniform noise at 250 and 360 Hz (1 h each) reach a kurtosis of at most
3.67 and a high-band share of at least 0.34 (0.52 at 360 Hz), against the limits 5 and 0.2, and are
unreadable over their whole length. Among the records' windows with beats and a kurtosis below 5 the
largest high-band share is 0.099 (116), half the limit, and every record's own largest is below it (so
leaving any one record out would not move a limit that fits the others). The largest share of samples
at one rail in a window with beats is 0.28 (116, whose R waves and baseline wander reach the converter's
limits), against 0.5; the smallest range of such a window is 139 quantisation steps (114), against 8.

Array code for NumPy and CuPy (the namespace comes from the input): a high-pass, a Gaussian low-pass
and a few reductions over the ``(windows, W)`` matrix: the reference, and the GPU's path. On the CPU
:mod:`beatflow.detect` passes the measures of one loop per window
(:func:`beatflow.detect.cpu.quality_features_cpu`: 9.5 ms for a 30-minute record, against 26.5 ms for the
array code and 29 ms for the detection; loop references in ``tests/naive.py``). A partition with halos of at least
``q.halo`` samples (:meth:`beatflow.params.QualityParams.samples`; within the detection's halo) decides
its windows as the whole recording does.
"""
from __future__ import annotations

import math

import numpy as np

from beatflow.detect.rhythm import episode_spans, merge_spans, runs_of
from beatflow.device import namespace_of, scipy_for
from beatflow.params import QualitySamples

#: the reason codes of :func:`quality_windows`, by their number
REASONS = ("ok", "flat", "saturated", "noise")
OK, FLAT, SATURATED, NOISE = range(4)


def window_matrix(x, first: int, window: int):
    """``x`` (samples ``[first, first + len(x))``) as an ``(nw, window)`` matrix of the stream-aligned
    windows it touches, completed with its end samples, the global number of the first window, and the
    numbers of completed samples before ``x[0]`` and after its last sample: ``(X, w0, lead, pad)``."""
    xp = namespace_of(x)
    n = x.shape[0]
    w0 = first // window
    lead = first - w0 * window
    nw = -(-(lead + n) // window)
    pad = nw * window - lead - n
    X = xp.pad(x, (lead, pad), mode="edge").reshape(nw, window)
    return X, w0, lead, pad


def _row_features(X, H, F):
    """:func:`window_features`'s four measures of every row of the windows ``X``, the high-passed
    ``H`` and the high band ``F`` (equal shapes; float64)."""
    xp = namespace_of(X)
    n = float(X.shape[1])
    hi, lo = X.max(axis=1), X.min(axis=1)
    d = xp.abs(X[:, 1:] - X[:, :-1])
    d[d == 0] = xp.inf
    step = d.min(axis=1) if X.shape[1] > 1 else xp.full(X.shape[0], xp.inf)
    finite = xp.isfinite(step)
    levels = xp.where(finite, (hi - lo) / xp.where(finite, step, 1.0), 0.0)
    pinned = ((X == hi[:, None]).sum(axis=1) + (X == lo[:, None]).sum(axis=1)) / n
    mean = H.sum(axis=1) / n
    c = H - mean[:, None]
    m2 = xp.einsum("ij,ij->i", c, c)
    c *= c
    m4 = xp.einsum("ij,ij->i", c, c)
    kurtosis = xp.where(m2 > 0, n * m4 / xp.where(m2 > 0, m2 * m2, 1.0), 0.0)
    e_high = m2 + n * mean * mean
    e_above = xp.einsum("ij,ij->i", F, F)
    hf_share = xp.where(e_high > 0, e_above / xp.where(e_high > 0, e_high, 1.0), 0.0)
    return levels, pinned, kurtosis, hf_share


def lowpass_taps(sigma: float, xp=np):
    """The Gaussian low-pass's taps (σ = ``sigma`` samples, to ±4σ, summing to 1), symmetric."""
    r = max(1, int(math.ceil(4.0 * sigma)))
    t = xp.arange(-r, r + 1, dtype=xp.float64)
    k = xp.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def lowpass_residue(x, sigma: float):
    """``x`` minus its Gaussian low-pass (:func:`lowpass_taps`; ends: the edge values): the part above
    the cutoff. A direct convolution (``xp.convolve``: each output depends on its own neighbourhood
    only, as :func:`beatflow.detect.peaks._convolve_edge`'s), 3-4 times faster than
    ``ndimage.gaussian_filter1d`` for these 9-15 taps."""
    xp = namespace_of(x)
    k = lowpass_taps(sigma, xp)
    r = k.shape[0] // 2
    return x - xp.convolve(xp.pad(x, r, mode="edge"), k, mode="valid")


def window_features(x, first: int, q: QualitySamples):
    """Per stream-aligned window, over its samples inside ``x``: ``(levels, pinned, kurtosis,
    hf_share, w0)``: its range in quantisation steps (0 for a constant window), the share of its samples
    at its largest or smallest value, the kurtosis of its high-passed samples, the share of their
    energy above the low-pass's cutoff, and the global number of the first window (float64 arrays)."""
    xp = namespace_of(x)
    _, ndimage = scipy_for(xp)
    x = x.astype(xp.float64, copy=False)
    high = x - ndimage.uniform_filter1d(x, size=q.highpass, mode="nearest")
    above = lowpass_residue(x, q.hf_sigma)
    X, w0, lead, pad = window_matrix(x, first, q.window)
    H = window_matrix(high, first, q.window)[0]
    F = window_matrix(above, first, q.window)[0]
    out = _row_features(X, H, F)
    # the rows that x covers in part (at most its first and its last): measured on their own samples
    nw, W = X.shape
    for row in sorted({0, nw - 1}):
        a, b = (lead if row == 0 else 0), (W - pad if row == nw - 1 else W)
        if b - a < W:
            part = _row_features(X[row : row + 1, a:b], H[row : row + 1, a:b], F[row : row + 1, a:b])
            for v, p in zip(out, part):
                v[row] = p[0]
    return (*out, w0)


def quality_windows(x, first: int, q: QualitySamples, *, features=window_features):
    """The reason code of every stream-aligned window that ``x`` touches (:data:`REASONS`; the first
    that applies of flat, saturated, noise): ``(codes, w0)``, an int8 array in the namespace of ``x``
    and the global number of its first window. ``features``: the step of :func:`window_features`'s
    contract (:mod:`beatflow.detect` passes the CPU's loop for NumPy input)."""
    xp = namespace_of(x)
    levels, pinned, kurtosis, hf_share, w0 = features(x, first, q)
    codes = xp.zeros(levels.shape[0], dtype=xp.int8)
    codes = xp.where((kurtosis < q.kurtosis) & (hf_share >= q.hf_share), xp.int8(NOISE), codes)
    codes = xp.where(pinned >= q.saturated, xp.int8(SATURATED), codes)
    codes = xp.where(levels <= q.flat_levels, xp.int8(FLAT), codes)
    return codes.astype(xp.int8), w0


def unreadable_windows(codes, q: QualitySamples):
    """Which windows lie in an unreadable episode: a run of at least ``q.runs`` consecutive windows
    whose code is not ok (bool array over ``codes``)."""
    return runs_of(codes != OK, q.runs)


def unreadable_spans(codes, w0: int, q: QualitySamples, lo: int, hi: int):
    """The unreadable episodes as ``[start, end)`` global sample ranges clipped to ``[lo, hi)`` with
    their reason codes, sorted: ``(spans, reasons)``, an int64 ``(m, 2)`` and an int8 ``(m,)`` array in
    the namespace of ``codes`` (consecutive windows of one reason make one range)."""
    xp = namespace_of(codes)
    bad = unreadable_windows(codes, q)
    spans, reasons = [], []
    for r in (FLAT, SATURATED, NOISE):
        sp = episode_spans(bad & (codes == r), w0, q.window, lo, hi)
        spans.append(sp)
        reasons.append(xp.full(sp.shape[0], r, dtype=xp.int8))
    spans, reasons = xp.concatenate(spans), xp.concatenate(reasons)
    order = xp.argsort(spans[:, 0])
    return spans[order].reshape(-1, 2), reasons[order]


def quality_rule(x, peaks, first: int, q: QualitySamples, span: tuple[int, int] | None = None, *,
                 features=window_features):
    """The peaks outside the unreadable episodes, and the episodes: ``(keep, spans, reasons)``.

    Parameters
    ----------
    x : array, 1-D
        Samples ``[first, first + len(x))`` of a recording (a partition with its halos).
    peaks : int array
        Global sample indices of detected peaks, inside ``x``.
    first : int
        Global index of ``x[0]``.
    span : (int, int), optional
        The episodes are clipped to it (a partition's core; default: ``x``).

    Returns
    -------
    ``keep``: bool array over ``peaks``; ``spans``, ``reasons``: :func:`unreadable_spans` within
    ``span``. All in the namespace of ``x``. ``features``: as :func:`quality_windows` takes it.
    """
    xp = namespace_of(x)
    lo, hi = (first, first + x.shape[0]) if span is None else (int(span[0]), int(span[1]))
    if x.shape[0] == 0:
        return xp.ones(peaks.shape[0], dtype=bool), xp.zeros((0, 2), dtype=xp.int64), xp.zeros(0, dtype=xp.int8)
    codes, w0 = quality_windows(x, first, q, features=features)
    bad = unreadable_windows(codes, q)
    k = xp.clip(xp.asarray(peaks, dtype=xp.int64) // q.window - w0, 0, codes.shape[0] - 1)
    spans, reasons = unreadable_spans(codes, w0, q, lo, hi)
    return ~bad[k], spans, reasons


def merge_episodes(spans, reasons) -> tuple[np.ndarray, np.ndarray]:
    """One recording's episodes gathered from its partitions (host arrays: ``spans[k]`` ``(m, 2)``
    with ``reasons[k]``), ranges of one reason that touch joined (an episode across a partition
    boundary is one): ``(spans, reasons)`` sorted by start."""
    out_s, out_r = [], []
    for r in (FLAT, SATURATED, NOISE):
        m = merge_spans([np.asarray(s).reshape(-1, 2)[np.asarray(c) == r] for s, c in zip(spans, reasons)])
        out_s.append(m)
        out_r.append(np.full(m.shape[0], r, dtype=np.int8))
    s, c = np.concatenate(out_s), np.concatenate(out_r)
    order = np.argsort(s[:, 0], kind="stable")
    return s[order].reshape(-1, 2), c[order]

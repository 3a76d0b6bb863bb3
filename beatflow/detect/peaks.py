"""Beat segmentation, the reference: a QRS energy envelope, non-maximum suppression, adaptive
thresholds, T-wave rejection and search-back.

Array code for NumPy and CuPy (the array namespace comes from the input): the dense steps are array
code on the whole signal (a 3-point median, a direct convolution, a moving average, the non-maximum
suppression), the decisions are vectorised over the sparse candidate peaks. Where the array code is
too slow for its device, a kernel with exactly its contract takes over and is tested against it and
against the loop references in ``tests/naive.py``; :mod:`beatflow.detect` chooses, by the input's
device: on the GPU the whole detection runs as the kernels of
:func:`beatflow.detect.gpu.detect_beats_gpu` (Numba CUDA: one fused pass over the stream in shared
memory and small kernels over the candidates, with one host synchronisation instead of some forty
array operations and their synchronisations); on the CPU :func:`detect_peaks_xp` runs with the fused
envelope, the NMS scan and the sparse slope of :mod:`beatflow.detect.cpu` (Numba) as its
``envelope``, ``local_maxima`` and ``steepest`` steps, which make the CPU path ~15x faster.

The steps of :func:`detect_peaks_xp`:

1. ``despike``: 3-point median (removes one-sample glitches and most pacemaker spikes);
2. ``wavelet_response``: derivative of a Gaussian (σ ≈ 8 ms), a band-pass slope estimate with no
   response to a constant or to slow baseline wander;
3. ``energy_envelope``: root mean square of the slope over ~100 ms; QRS complexes are its
   highest, narrowest peaks, T waves (slow) and baseline wander (slower) are much lower
   (1-3: :func:`qrs_envelope_xp`);
4. ``local_maxima_xp``: candidates are maxima of the envelope over ``±nms``;
5. ``block_amplitude``: the local level, a median of 1 s block maxima over ``±blocks`` blocks;
   a candidate above ``ratio`` × level is *strong*, one above ``weak_ratio`` × level is *weak*;
   ``noise_mask``: a candidate in a burst of noise (the envelope stays above ``noise_valley`` × its
   height over ``±nms``, its steepest slope is above ``noise_slope`` × its height, and it is below
   ``noise_level`` × level) is no candidate at all;
6. ``t_wave_mask``: a strong candidate closer than ``twave`` to the previous strong one whose
   steepest slope (:func:`steepest_at_xp`: fine derivative, σ ≈ 4 ms) is below ``twave_slope`` ×
   that one's is a T wave;
7. ``drop_refractory``: of two accepted peaks closer than ``refractory``, the smaller goes;
8. ``search_back``: a weak candidate is accepted where the accepted beats around it leave a gap
   longer than ``searchback`` × the local mean RR (beats within ``±rr_window``), if it is at least
   ``margin`` × RR from both and not T-wave-like; the ends of the stream bound a gap as a beat does;
   (with ``fast_nms > 0``, :func:`fast_candidates`: where those beats are close together, the maxima of a
   narrower window (with ``fast_dip < 1``: those that are peaks of their own) join the candidates, and 5-8 run again);
9. :func:`beatflow.detect.rhythm.detect_beats_xp`: peaks inside ventricular flutter/fibrillation
   episodes (runs of windows with no isoelectric baseline and a low mean frequency) are dropped
   (after the CPU's detection, fused loops of :func:`beatflow.detect.cpu.flutter_features_cpu`;
   on the GPU four kernels before the peaks are emitted, :mod:`beatflow.detect.gpu_vf`).

Why not the seed's Ricker wavelet by FFT: on real ECG (MIT-BIH) a Ricker response of fixed width
peaks on tall T waves and on the wrong lobe of wide beats; the slope envelope with a T-wave test
and search-back is what brought sensitivity from 99.60 to 99.84 % (``bench/results/accuracy.md``).
The kernels are 9–37 taps, for which direct convolution is several times faster than an FFT and
gives every sample the same round-off wherever the stream was cut.

A stream may be cut into partitions: each is processed with a halo of its neighbours
(``SegmentSamples.halo``) and keeps only the peaks in its own core. Every decision above looks at
a bounded neighbourhood (gaps are capped at ``max_gap``; blocks are aligned to the stream), and the
halo covers the sum of those radii, so the result does not depend on the partitioning.
"""
from __future__ import annotations

import numpy as np

from beatflow.device import namespace_of, scipy_for
from beatflow.params import SegmentSamples

_FAR = 1 << 40  # "no neighbour": farther than any gap that matters


def gaussian_derivative(points: int, sigma: float, xp=np):
    """Derivative-of-Gaussian taps that estimate the slope (signal units per sample).

    Parameters
    ----------
    points : int
        Number of taps (odd, centred).
    sigma : float
        Gaussian width in samples.
    xp : module
        Array namespace of the result.

    Returns
    -------
    array, shape (points,), float64
        ``k(t) = -t g(t) / Σ t² g(t)`` with ``g`` the Gaussian: antisymmetric (no response to a
        constant), and convolving a unit ramp with it gives exactly 1.
    """
    t = xp.arange(points, dtype=xp.float64) - (points - 1) / 2.0
    g = xp.exp(-(t**2) / (2.0 * sigma**2))
    return -t * g / (t * t * g).sum()


def despike(x):
    """3-point running median, float64, same length; the ends are mirrored (``x[1]`` beyond ``x[0]``).

    A one-sample glitch (a truncated last sample, a pacemaker spike) disappears, a QRS of several
    samples does not.
    """
    xp = namespace_of(x)
    x = x.astype(xp.float64, copy=False)
    if x.shape[0] < 3:
        return x.copy()
    p = xp.pad(x, 1, mode="reflect")
    a, b, c = p[:-2], p[1:-1], p[2:]
    lo = xp.minimum(a, b)  # max(min(a, b), min(max(a, b), c)), with two temporaries
    hi = xp.maximum(a, b)
    xp.minimum(hi, c, out=hi)
    return xp.maximum(lo, hi, out=lo)


def _convolve_edge(x, kernel):
    """``x`` (float64) convolved with an odd ``kernel``, same length, ends padded with the edge values.

    Direct convolution (``ndimage.convolve1d``): the kernels here have 9–33 taps, for which it is
    several times faster than an FFT on the CPU and on the GPU, and each output depends only on its
    own neighbourhood (an FFT's round-off depends on the whole array, so on where a partition starts).
    """
    xp = namespace_of(x)
    _, ndimage = scipy_for(xp)
    if x.shape[0] == 0:
        return x.astype(xp.float64)
    return ndimage.convolve1d(x.astype(xp.float64, copy=False), kernel, mode="nearest")


def wavelet_response(x, s: SegmentSamples):
    """Slope of the despiked signal: convolution with the derivative of a Gaussian (σ = ``s.a``).

    Same length as ``x``, float64, signed. The ends are padded with the edge values, so a baseline
    offset at the stream's ends does not look like a beat.
    """
    return despiked_slope(despike(x), s.kernel, s.a)


def despiked_slope(xd, points: int, sigma: float):
    """Derivative-of-Gaussian response of an already despiked signal."""
    return _convolve_edge(xd, gaussian_derivative(points, sigma, namespace_of(xd)))


def energy_envelope(y, s: SegmentSamples):
    """Root mean square of ``y`` over a centred window of ``s.box`` samples (ends: nearest)."""
    xp = namespace_of(y)
    _, ndimage = scipy_for(xp)
    if y.shape[0] == 0:
        return y
    e = ndimage.uniform_filter1d(y * y, size=s.box, mode="nearest")
    return xp.sqrt(xp.maximum(e, 0.0))


def qrs_envelope_xp(x, s: SegmentSamples):
    """The QRS energy envelope of a stream: ``energy_envelope(wavelet_response(x, s), s)``.

    (The one fused pass of :func:`beatflow.detect.cpu.envelope_cpu` gives the same, about 15× faster
    on the CPU: :func:`beatflow.detect.qrs_envelope` takes it for NumPy input.)
    """
    return energy_envelope(wavelet_response(x, s), s)


def steepest_at_xp(x, at, s: SegmentSamples):
    """Steepest slope near each of the positions ``at``: max of |fine slope| over ``±s.slope_half``.

    The fine slope is the derivative-of-Gaussian response (σ = ``s.fine_a``) of the despiked signal;
    QRS complexes are much steeper than T waves, which is what :func:`t_wave_mask` compares. Only
    the windows around ``at`` are computed (gathered as one ``(len(at), window)`` matrix), not the
    whole stream; the ends of the stream are padded with edge values, as by the dense filters.
    (:func:`beatflow.detect.cpu.steepest_cpu` makes the same sums as a loop per position, no
    ``(m, window)`` temporaries.)

    Returns
    -------
    array, float64, shape ``at.shape``
    """
    xp = namespace_of(x)
    n, m = x.shape[0], at.shape[0]
    if m == 0:
        return xp.zeros(0, dtype=xp.float64)
    k = gaussian_derivative(s.fine_kernel, s.fine_a, xp)
    K, kh, sh = s.fine_kernel, s.fine_kernel // 2, s.slope_half
    # despiked samples at clip(at - sh - kh + t), t = 0 .. 2(sh + kh)
    pos = xp.clip(at[:, None] + xp.arange(-(sh + kh), sh + kh + 1), 0, n - 1)
    xf = x.astype(xp.float64, copy=False)
    if n >= 3:
        a = xf[xp.where(pos > 0, pos - 1, 1)]
        b = xf[pos]
        c = xf[xp.where(pos < n - 1, pos + 1, n - 2)]
        w = xp.maximum(xp.minimum(a, b), xp.minimum(xp.maximum(a, b), c))
    else:
        w = xf[pos]
    # slope at q = at - sh + u: sum_j w[u + 2kh - j] * k[j]
    d = xp.zeros((m, 2 * sh + 1), dtype=xp.float64)
    for j in range(K):
        d += w[:, 2 * kh - j : 2 * kh - j + 2 * sh + 1] * k[j]
    d = xp.abs(d)
    # positions beyond the ends are not samples (the dense maximum filter repeats the end value)
    q = at[:, None] + xp.arange(-sh, sh + 1)
    d = xp.where((q >= 0) & (q < n), d, 0.0)
    return d.max(axis=1)


def local_maxima_xp(env, half_window: int):
    """Indices where ``env`` is the maximum of its ``±half_window`` neighbourhood and positive.

    The 1-D non-maximum suppression of the seed (a dense gate becomes a sparse index list): the
    moving maximum over the clipped window (``mode="nearest"`` repeats the end values, which lie in
    it). (The scan with early exit of :func:`beatflow.detect.cpu.local_maxima_cpu`, ~30× SciPy's
    moving maximum, and the NMS kernel of :func:`beatflow.detect.gpu.local_maxima_gpu` give the same.)
    """
    xp = namespace_of(env)
    _, ndimage = scipy_for(xp)
    half = int(half_window)
    if env.shape[0] == 0:
        return xp.zeros(0, dtype=xp.int64)
    m = ndimage.maximum_filter1d(env, 2 * half + 1, mode="nearest")
    return xp.flatnonzero((env == m) & (env > 0)).astype(xp.int64, copy=False)


def block_amplitude(env, first: int, s: SegmentSamples):
    """Local amplitude per stream-aligned block: median over ``±blocks`` of block maxima of ``env``.

    Parameters
    ----------
    env : array
        Non-negative response over global samples ``[first, first + len(env))``.
    first : int
        Global index of ``env[0]``.

    Returns
    -------
    (amp, b0) : array, int
        ``amp[k]`` is the local amplitude of global block ``b0 + k``.
    """
    xp = namespace_of(env)
    n = env.shape[0]
    b0 = first // s.block
    lead = first - b0 * s.block  # samples of block b0 before env[0]
    nb = -(-(lead + n) // s.block)
    # blocks are aligned to the stream: pad to whole blocks (with -inf, never a maximum), reshape
    padded = xp.pad(env, (lead, nb * s.block - lead - n), constant_values=-np.inf)
    bmax = padded.reshape(nb, s.block).max(axis=1)
    k = s.blocks
    padded = xp.pad(bmax, k, constant_values=np.nan)
    win = xp.stack([padded[i : i + nb] for i in range(2 * k + 1)], axis=1)
    return xp.nanmedian(win, axis=1), b0


def valley_at(env, at, half: int):
    """Lowest envelope on each side of the positions ``at``: ``min(env[a - half .. a])`` and
    ``min(env[a .. a + half])`` (both inclusive, clipped to the stream).

    Returns
    -------
    (left, right) : arrays, float64, shape ``at.shape``
    """
    xp = namespace_of(env)
    n = env.shape[0]
    if at.shape[0] == 0 or n == 0:
        z = xp.zeros(at.shape[0], dtype=xp.float64)
        return z, z.copy()
    left = env[at].astype(xp.float64)
    right = left.copy()
    for d in range(1, half + 1):  # half + 1 gathers of len(at) (no (len(at), half) temporaries)
        left = xp.minimum(left, env[xp.maximum(at - d, 0)])
        right = xp.minimum(right, env[xp.minimum(at + d, n - 1)])
    return left, right


def noise_mask(env, cand, heights, level, slopes, s: SegmentSamples):
    """True for candidates that are peaks of a noise burst rather than QRS complexes.

    A QRS is an isolated, compact peak of the energy envelope: within ``±s.nms`` of it the envelope
    falls far below its height on both sides. In muscle noise or a saturated, dropping-out lead
    (MIT-BIH 108, 203, 116, 114) the envelope stays high between its peaks, and their high-frequency
    content makes the steepest fine slope large against the envelope's RMS. Candidate ``i`` is noise when

    * ``min(valley_at(env, cand, s.nms)) > s.noise_valley × heights[i]`` (no quiet on either side),
    * ``slopes[i] > s.noise_slope × heights[i]`` (spiky: a wide ectopic beat, also in a busy
      stretch, has a low ratio), and
    * ``heights[i] < s.noise_level × level[i]`` (a peak as tall as the local beats is kept).

    ``noise_slope = inf`` switches the test off. The window is that of the non-maximum suppression,
    so a partition's halo covers it.
    """
    xp = namespace_of(cand)
    if cand.shape[0] == 0:
        return xp.zeros(0, dtype=bool)
    out = (slopes > s.noise_slope * heights) & (heights < s.noise_level * level)
    idx = xp.flatnonzero(out)  # the window minimum only where the cheap tests pass (few candidates)
    left, right = valley_at(env, cand[idx], s.nms)
    out[idx] = xp.minimum(left, right) > s.noise_valley * heights[idx]
    return out


def refractory_mask(peaks, heights, refractory: int):
    """Which peaks survive: of two consecutive peaks closer than ``refractory``, the smaller is dropped."""
    xp = namespace_of(peaks)
    keep = xp.ones(peaks.shape[0], dtype=bool)
    if peaks.shape[0] < 2:
        return keep
    close = xp.diff(peaks) < refractory
    left_smaller = heights[:-1] < heights[1:]
    keep[:-1] &= ~(close & left_smaller)
    keep[1:] &= ~(close & ~left_smaller)
    return keep


def drop_refractory(peaks, heights, refractory: int):
    """Of two consecutive peaks closer than ``refractory`` samples, drop the smaller one."""
    return peaks[refractory_mask(peaks, heights, refractory)]


def t_wave_mask(peaks, slopes, window: int, ratio: float):
    """True for peaks that look like the T wave of the peak before them.

    Peak ``i`` is T-wave-like when it lies less than ``window`` samples after peak ``i-1`` and its
    steepest slope is below ``ratio`` times that of peak ``i-1`` (a QRS is steep, a T wave is not).
    """
    xp = namespace_of(peaks)
    out = xp.zeros(peaks.shape[0], dtype=bool)
    if peaks.shape[0] < 2:
        return out
    out[1:] = (xp.diff(peaks) < window) & (slopes[1:] < ratio * slopes[:-1])
    return out


def mean_rr(beats, at, window: int):
    """Mean RR interval (samples) of the sorted ``beats`` within ``[at - window, at + window]``.

    ``(last - first) / (count - 1)`` of the beats in the window; NaN where fewer than 3 beats lie in it.
    """
    xp = namespace_of(beats)
    if beats.shape[0] == 0:
        return xp.full(at.shape[0], np.nan)
    lo = xp.searchsorted(beats, at - window, side="left")
    hi = xp.searchsorted(beats, at + window, side="right") - 1
    n = hi - lo
    span = beats[xp.clip(hi, 0, beats.shape[0] - 1)] - beats[xp.clip(lo, 0, beats.shape[0] - 1)]
    return xp.where(n >= 2, span / xp.maximum(n, 1), np.nan)


def search_back(beats, beat_slopes, cand, cand_slopes, cand_heights, s: SegmentSamples, length: int | None = None):
    """Which weak candidates fill a gap in the accepted beats (search-back for missed beats).

    Parameters
    ----------
    beats, beat_slopes : arrays
        Accepted beats (sorted sample indices) and their steepest slopes.
    cand, cand_slopes, cand_heights : arrays
        Weak candidates (sorted, none of them in ``beats``), their slopes and envelope heights.
    length : int, optional
        Number of samples of the stream (indices ``0 .. length - 1``). When given, the ends of the
        stream bound a gap as a beat does: a candidate with no beat before it measures its distance
        to the previous beat from sample 0, one with no beat after it to sample ``length - 1``
        (before the cap at ``max_gap``). Without it, a stream's end is an unbounded gap, and a T wave
        or a partial beat just after the start of a record fills it. For a partition the ends of its
        extended array are more than ``max_gap`` from its core, so the result does not change there.

    Returns
    -------
    bool array over ``cand``
        A candidate is accepted when, with ``rr`` the mean RR around it (:func:`mean_rr`) and the
        distances to the previous and next accepted beats capped at ``s.max_gap``, the gap between
        them exceeds ``s.searchback × rr``, both distances exceed ``s.margin × rr``, and it is not
        T-wave-like against the previous beat (slope below ``s.twave_slope`` times its slope, when
        that beat is within ``max_gap``). Of two accepted candidates closer than ``s.twave``, the
        smaller goes.
    """
    xp = namespace_of(cand)
    n = beats.shape[0]
    if n < 2 or cand.shape[0] == 0:
        return xp.zeros(cand.shape[0], dtype=bool)
    i = xp.searchsorted(beats, cand)
    start, end = (-_FAR, _FAR) if length is None else (0, length - 1)
    prev = xp.where(i > 0, beats[xp.maximum(i - 1, 0)], start)
    nxt = xp.where(i < n, beats[xp.minimum(i, n - 1)], end)
    dp = xp.minimum(cand - prev, s.max_gap)
    dn = xp.minimum(nxt - cand, s.max_gap)
    prev_slope = xp.where((i > 0) & (cand - prev <= s.max_gap), beat_slopes[xp.maximum(i - 1, 0)], 0.0)
    rr = mean_rr(beats, cand, s.rr_window)
    ok = ((dp + dn > s.searchback * rr) & (dp > s.margin * rr) & (dn > s.margin * rr)
          & (cand_slopes >= s.twave_slope * prev_slope))
    idx = xp.flatnonzero(ok)
    keep = refractory_mask(cand[idx], cand_heights[idx], s.twave)
    ok[idx[~keep]] = False
    return ok


def decide(x, env, cand, first: int, s: SegmentSamples, steepest=steepest_at_xp):
    """The decisions of :func:`detect_peaks_xp` on the envelope's candidate maxima ``cand`` (sorted
    indices into ``x``): the edge, the thresholds, the noise rule, the T-wave test, the refractory
    period and search-back.

    Returns
    -------
    (beats, peaks) : int64 arrays, indices into ``x``
        The strong candidates accepted before search-back, and every accepted peak (sorted).
    """
    xp = namespace_of(x)
    n = x.shape[0]
    # a peak within `edge` of the ends of x sees only padding on one side (a QRS cut by the end of
    # the record); for a partition these are halo samples, never in its core
    cand = cand[(cand >= s.edge) & (cand < n - s.edge)]
    amp, b0 = block_amplitude(env, first, s)
    level = amp[(cand + first) // s.block - b0]
    heights = env[cand]
    # above float round-off of the signal's level (flat lines), and above the weak threshold
    floor = 1e-7 * float(xp.abs(x).max())
    keep = (heights > s.weak_ratio * level) & (heights > floor)
    cand, heights, level = cand[keep], heights[keep], level[keep]
    slopes = steepest(x, cand, s)
    quiet = ~noise_mask(env, cand, heights, level, slopes, s)  # peaks of noise bursts are no candidates
    cand, heights, level, slopes = cand[quiet], heights[quiet], level[quiet], slopes[quiet]
    strong = xp.flatnonzero(heights > s.ratio * level)
    strong = strong[~t_wave_mask(cand[strong], slopes[strong], s.twave, s.twave_slope)]
    strong = strong[refractory_mask(cand[strong], heights[strong], s.refractory)]
    weak = xp.flatnonzero(heights <= s.ratio * level)
    added = weak[search_back(cand[strong], slopes[strong], cand[weak], slopes[weak], heights[weak], s, length=n)]
    beats = cand[strong].astype(xp.int64)
    return beats, xp.sort(cand[xp.concatenate([strong, added])]).astype(xp.int64)


def fast_candidates(env, wide, beats, s: SegmentSamples, local_maxima=local_maxima_xp):
    """The extra candidates of a fast rhythm (``s.fast_nms > 0``): maxima of the envelope over
    ``±s.fast_nms`` that are not maxima over ``±s.nms`` (``wide``: a larger envelope within
    ``s.nms`` hid them, often the flank of a wide neighbour in ventricular tachycardia), where the
    mean RR of ``beats`` (the strong beats found among ``wide``) within ``±s.fast_window`` is below
    ``s.fast_rr`` (NaN, fewer than 3 beats around: not fast), and that are peaks of their own: the
    envelope falls to at most ``s.fast_dip`` × their height within ``±s.fast_nms`` on both sides
    (:func:`valley_at`; ``fast_dip = 1``: no such test). Sorted indices into ``env``."""
    xp = namespace_of(env)
    narrow = local_maxima(env, s.fast_nms)
    narrow = narrow[~xp.isin(narrow, wide)]
    if narrow.shape[0] == 0:
        return narrow
    narrow = narrow[mean_rr(beats, narrow, s.fast_window) < s.fast_rr]
    if s.fast_dip < 1.0 and narrow.shape[0] > 0:
        left, right = valley_at(env, narrow, s.fast_nms)
        narrow = narrow[xp.maximum(left, right) <= s.fast_dip * env[narrow]]
    return narrow


def detect_peaks_xp(x, s: SegmentSamples, *, first: int = 0, core: tuple[int, int] | None = None,
                    envelope=qrs_envelope_xp, local_maxima=local_maxima_xp, steepest=steepest_at_xp):
    """Beat fiducial points (QRS peaks) of a stream or of one extended partition, without the flutter
    rule (:func:`beatflow.detect.rhythm.detect_beats_xp` adds it): the reference of
    :func:`beatflow.detect.detect_peaks`.

    Parameters
    ----------
    x : array (NumPy or CuPy), 1-D
        Samples ``[first, first + len(x))`` of a recording: a partition's core with its halos.
    s : SegmentSamples
        Parameters in samples (``SegmentParams().samples(fs)``).
    first : int
        Global sample index of ``x[0]``.
    core : (int, int), optional
        Keep only peaks with ``core[0] <= peak < core[1]`` (global). Default: all of ``x``.
    envelope, local_maxima, steepest : callables
        The steps of the same contracts as :func:`qrs_envelope_xp`, :func:`local_maxima_xp` and
        :func:`steepest_at_xp` (the defaults): :mod:`beatflow.detect` passes the fast ones of the
        input's device.

    Returns
    -------
    array of int64
        Sorted global sample indices of the detected peaks (maxima of the QRS energy envelope),
        in the namespace of ``x``.
    """
    xp = namespace_of(x)
    n = x.shape[0]
    if n == 0:
        return xp.zeros(0, dtype=xp.int64)
    env = envelope(x, s)
    wide = local_maxima(env, s.nms)
    beats, peaks = decide(x, env, wide, first, s, steepest)
    if s.fast_nms > 0:  # fast rhythm: the narrow window's maxima where the beats found are close together
        extra = fast_candidates(env, wide, beats, s, local_maxima)
        if extra.shape[0] > 0:
            _, peaks = decide(x, env, xp.sort(xp.concatenate([wide, extra])), first, s, steepest)
    peaks = peaks + first
    if core is not None:
        peaks = peaks[(peaks >= core[0]) & (peaks < core[1])]
    return peaks

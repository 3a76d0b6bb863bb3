"""A second lead as a check on the first: fewer false beats where the recording has two leads.

Beats are detected on one lead (:func:`beatflow.segment.detect_peaks`, with its flutter-episode rule).
Holter and MIT-BIH recordings have a second lead, which sees the same heart from another angle: a QRS
complex shows on both, while a noise burst or an electrode artefact on one lead is often quiet on the
other, and ventricular flutter may lose its last bits of baseline on one lead only. Two rules use it
(:func:`second_lead_keep`), both on quantities the detection already computes, per lead:

1. **flutter on either lead.** A 1 s window (aligned to the stream, as in :mod:`beatflow.rhythm`) is
   flutter-like when it is so on the first lead (the detection's rule), or when it is so on the second
   lead with that lead's own limits (mean frequency below ``flutter_max_freq_hz``, baseline fraction
   below ``flutter_baseline_ratio``) while the first lead's baseline fraction is below
   ``flutter_gate_ratio`` (the first lead has lost most of its baseline too). Runs of at least
   ``vf_min_windows`` such windows are episodes and their peaks are dropped (a superset of the first
   lead's episodes, whose peaks the detection dropped already).
2. **doubtful peaks.** A peak is dropped when it is weak against its ``±neighbours`` neighbouring
   peaks on the first lead (QRS envelope below ``weak_ratio`` × their median), shows no QRS energy on
   the second lead (the envelope's maximum within ``±reach_s`` below ``quiet_ratio`` × the lower
   quartile of the same at the neighbouring peaks), and the second lead is usable there (its
   neighbouring beats stand ``quality_ratio`` times above the median of its envelope over the peak's
   window; a flat or noisy second lead says nothing, and the peak is kept).

MIT-BIH, 22 non-paced records, lead 0 checked by lead 1 (``bench/RESULTS_mitdb.md``, session 18): the
false positives 90 -> 55 (19 of them inside the annotated flutter of 207, 42 before), one true beat
lost; the 4 paced records 17 -> 10 false positives, none lost. The defaults were chosen on those
records (``bench/two_lead_study.py``: the grid, and the cross-validation by record).

Array code for NumPy and CuPy (the namespace comes from the input); the loop references are in
``tests/naive.py``. On a whole recording: :func:`second_lead_keep` (``beatflow evaluate
--confirm-lead``). In the flow (``beatflow run --confirm-lead`` / ``--confirm-column``) each partition,
with the halos of both leads, runs rule 1 and measures its peaks (:func:`flutter_keep`,
:func:`peak_measures`: both look no further than the first lead's flutter rule), and rule 2, which
compares a peak with its neighbouring peaks, runs on the gathered measures (:func:`doubtful`): any
partitioning gives the whole recording's beats.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .backend import namespace_of, scipy_for
from .params import SegmentSamples
from .rhythm import _context_sum, episode_spans, near_fractions_xp, runs_of, window_energies_xp


@dataclass(frozen=True)
class SecondLeadParams:
    """The second lead's rules (:mod:`beatflow.leads`).

    Attributes
    ----------
    flutter_max_freq_hz, flutter_baseline_ratio : float
        A window is flutter-like on the second lead below this mean frequency and this baseline
        fraction (the first lead's limits are ``SegmentParams.vf_max_freq_hz`` and
        ``vf_baseline_ratio``); ``flutter_baseline_ratio=0`` switches rule 1 off.
    flutter_gate_ratio : float
        ... while the first lead's baseline fraction is below this.
    weak_ratio, quiet_ratio, quality_ratio : float
        Rule 2's limits (the module's docstring); ``weak_ratio=0`` switches it off.
    neighbours : int
        The peaks on either side a peak is compared with.
    reach_s : float
        The second lead's QRS energy is its envelope's maximum within ``±`` this of the peak.
    """

    flutter_max_freq_hz: float = 4.5
    flutter_baseline_ratio: float = 0.38
    flutter_gate_ratio: float = 0.42
    weak_ratio: float = 0.8
    quiet_ratio: float = 0.35
    quality_ratio: float = 3.0
    neighbours: int = 4
    reach_s: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)

    def samples(self, fs: float) -> "SecondLeadSamples":
        """These parameters at sampling rate ``fs``."""
        if not fs > 0:
            raise ValueError(f"sampling rate must be positive, got {fs}")
        return SecondLeadSamples(omega=2.0 * math.pi * float(self.flutter_max_freq_hz) / fs,
                                 baseline=float(self.flutter_baseline_ratio), gate=float(self.flutter_gate_ratio),
                                 weak=float(self.weak_ratio), quiet=float(self.quiet_ratio),
                                 quality=float(self.quality_ratio), neighbours=max(1, int(self.neighbours)),
                                 reach=max(0, int(round(self.reach_s * fs))))


@dataclass(frozen=True)
class SecondLeadSamples:
    """:class:`SecondLeadParams` at one sampling rate (``omega``: radians per sample; ``reach``: samples)."""

    omega: float
    baseline: float
    gate: float
    weak: float
    quiet: float
    quality: float
    neighbours: int
    reach: int


def lead_windows(x, first: int, s: SegmentSamples):
    """Per window of ``s.vf_window`` samples aligned to the recording (``x[0]`` is its sample
    ``first``; the windows at the ends of ``x`` completed with its end samples), not summed with its
    neighbours: ``(e_signal, e_slope, near, w0)``, the energies of the high-passed signal and of its
    slope and the fraction of near-median samples of every window, and the number of the first window
    (:mod:`beatflow.rhythm`'s quantities; on NumPy by the fused loops of
    :func:`beatflow.cpu_kernels.flutter_features_cpu`)."""
    xp = namespace_of(x)
    if xp is np and x.shape[0] >= 3:
        from .cpu_kernels import flutter_features_cpu
        from .segment import gaussian_derivative

        taps = gaussian_derivative(s.kernel, s.a)
        e_sig, e_slope = flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps)
        rows = np.arange(e_sig.shape[0], dtype=np.int64)
        near = flutter_features_cpu(x, first, s.vf_window, s.vf_highpass, taps, rows=rows, tol=s.vf_tol)
        return e_sig, e_slope, near, first // s.vf_window
    h, e_sig, e_slope, w0 = window_energies_xp(x, first, s)
    return e_sig, e_slope, near_fractions_xp(h, xp.arange(h.shape[0]), s), w0


def flutter_either_lead(first_lead: tuple, second_lead: tuple, s: SegmentSamples, q: SecondLeadSamples):
    """Rule 1: which windows lie in an episode, from the two leads' ``(e_signal, e_slope, near)`` of
    :func:`lead_windows` (the same windows). With ``q.baseline = 0``, exactly the first lead's episodes."""
    (es0, ed0, nr0), (es1, ed1, nr1) = first_lead, second_lead
    xp = namespace_of(es0)
    c = s.vf_context
    count = _context_sum(xp.ones(es0.shape[0], dtype=xp.float64), c)
    b0, b1 = _context_sum(nr0, c) / count, _context_sum(nr1, c) / count
    smooth0 = _context_sum(ed0, c) < s.vf_omega**2 * _context_sum(es0, c)
    smooth1 = _context_sum(ed1, c) < q.omega**2 * _context_sum(es1, c)
    like = (smooth0 & (b0 < s.vf_baseline)) | (smooth1 & (b1 < q.baseline) & (b0 < q.gate))
    return runs_of(like, s.vf_runs)


def _neighbour_quantiles(v, k: int, qs: tuple):
    """For every position ``i``: the quantiles ``qs`` (linear, as ``numpy.quantile``) of
    ``v[i-k..i-1, i+1..i+k]``, the positions that exist (NaN where none do): one sort of an
    ``(n, 2k)`` matrix whose missing entries are +inf, then a linear interpolation per row."""
    xp = namespace_of(v)
    n = v.shape[0]
    padded = xp.pad(v.astype(xp.float64), k, constant_values=xp.inf)
    nb = xp.stack([padded[k + j : k + j + n] for j in range(-k, k + 1) if j != 0], axis=1)
    nb = xp.sort(nb, axis=1)
    idx = xp.arange(n)
    have = xp.minimum(idx, k) + xp.minimum(n - 1 - idx, k)  # neighbours that exist
    out = []
    for q in qs:
        pos = q * xp.maximum(have - 1, 0).astype(xp.float64)
        lo = xp.floor(pos).astype(xp.int64)
        hi = xp.minimum(lo + 1, xp.maximum(have - 1, 0))
        a = xp.take_along_axis(nb, lo[:, None], axis=1)[:, 0]
        b = xp.take_along_axis(nb, hi[:, None], axis=1)[:, 0]
        val = a + (b - a) * (pos - lo)
        out.append(xp.where(have > 0, val, xp.nan))
    return out


def _ratio(num, den):
    """``num / den``, +inf where ``den`` is not positive (no division warnings), NaN stays NaN."""
    xp = namespace_of(num)
    ok = den > 0
    return xp.where(ok, num / xp.where(ok, den, 1.0), xp.where(xp.isnan(den), xp.nan, xp.inf))


def peak_measures(x0, x1, peaks, first: int, n_total: int, s: SegmentSamples, q: SecondLeadSamples):
    """Rule 2's measures of each peak that need the signal, all within ``s.vf_window`` of the peak
    (a partition's halo covers them): ``(h0, h1, background)``, the first lead's QRS envelope at the
    peak, the second lead's envelope maximum within ``±q.reach``, and the median of the second lead's
    envelope over the peak's window (windows of ``s.vf_window`` samples aligned to the recording, the
    last one completed with the recording's last value). ``x0``, ``x1``: samples ``[first, first +
    len)`` of a recording of ``n_total`` samples; ``peaks``: global indices inside them."""
    from .segment import qrs_envelope

    xp = namespace_of(x0)
    _, ndimage = scipy_for(xp)
    peaks = xp.asarray(peaks, dtype=xp.int64)
    if peaks.shape[0] == 0:
        z = xp.zeros(0, dtype=xp.float64)
        return z, z, z
    env0, env1 = qrs_envelope(x0, s), qrs_envelope(x1, s)
    m1 = ndimage.maximum_filter1d(env1, 2 * q.reach + 1, mode="nearest")
    local = peaks - first
    W, n = s.vf_window, x0.shape[0]
    w = peaks // W
    # each peak's window, as positions in x (clipped to the recording's end: its last value repeats)
    cols = xp.minimum(w[:, None] * W + xp.arange(W)[None, :], n_total - 1) - first
    background = xp.median(env1[xp.clip(cols, 0, n - 1)], axis=1)
    return env0[local].astype(xp.float64), m1[local].astype(xp.float64), background.astype(xp.float64)


def doubtful(h0, h1, background, q: SecondLeadSamples):
    """Rule 2 over the measures of consecutive peaks of one recording (:func:`peak_measures`, in
    order): True for the peaks to drop (weak on the first lead, quiet on a usable second lead)."""
    xp = namespace_of(h0)
    if h0.shape[0] == 0 or not q.weak > 0:
        return xp.zeros(h0.shape[0], dtype=bool)
    (med0,) = _neighbour_quantiles(h0, q.neighbours, (0.5,))
    q25, med1 = _neighbour_quantiles(h1, q.neighbours, (0.25, 0.5))
    weak, quiet = _ratio(h0, med0), _ratio(h1, q25)
    quality = _ratio(med1, xp.maximum(background, 1e-12))
    return (weak < q.weak) & (quiet < q.quiet) & (quality > q.quality)


def flutter_keep(x0, x1, peaks, first: int, s: SegmentSamples, q: SecondLeadSamples, span: tuple[int, int]):
    """Rule 1 on ``x0``, ``x1`` (samples ``[first, first + len)`` of a recording): ``(keep, episodes)``,
    which ``peaks`` (global, inside ``x0``) lie outside the episodes, and the episodes as ``[start,
    end)`` ranges clipped to ``span``. Decisions within ``span`` are those of the whole recording
    where ``x0`` reaches ``s.halo`` beyond it (the first lead's rule reaches as far)."""
    xp = namespace_of(x0)
    peaks = xp.asarray(peaks, dtype=xp.int64)
    keep = xp.ones(peaks.shape[0], dtype=bool)
    if x0.shape[0] < 3 or not (q.baseline > 0 and s.vf_baseline > 0):
        return keep, xp.zeros((0, 2), dtype=xp.int64)
    es0, ed0, nr0, w0 = lead_windows(x0, first, s)
    es1, ed1, nr1, _ = lead_windows(x1, first, s)
    episode = flutter_either_lead((es0, ed0, nr0), (es1, ed1, nr1), s, q)
    keep &= ~episode[xp.clip(peaks // s.vf_window - w0, 0, episode.shape[0] - 1)]
    return keep, episode_spans(episode, w0, s.vf_window, int(span[0]), int(span[1]))


def second_lead_keep(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams = SecondLeadParams()):
    """The two rules on a whole recording: ``(keep, episodes)``, which of the first lead's detected
    ``peaks`` (:func:`beatflow.segment.detect_peaks` of ``x0``) to keep, and the flutter episodes of
    rule 1 as ``[start, end)`` sample ranges (``(m, 2)`` int64). ``x1``: the second lead, as long as
    ``x0``. (The flow runs the same steps per partition: :func:`beatflow.partitions.segment_partition`
    with a second lead, then :func:`doubtful` on the gathered measures.)

    Raises
    ------
    ValueError
        The leads differ in length.
    """
    xp = namespace_of(x0)
    if x1.shape != x0.shape:
        raise ValueError(f"the two leads differ in length ({x0.shape[0]} and {x1.shape[0]} samples)")
    q = p.samples(fs)
    n = int(x0.shape[0])
    keep, episodes = flutter_keep(x0, x1, peaks, 0, s, q, (0, n))
    if q.weak > 0 and n >= 3:
        rest = xp.flatnonzero(keep)
        if rest.shape[0]:
            h0, h1, background = peak_measures(x0, x1, xp.asarray(peaks, dtype=xp.int64)[rest], 0, n, s, q)
            keep[rest[doubtful(h0, h1, background, q)]] = False
    return keep, episodes

"""A second lead as a check on the first: fewer false beats where the recording has two leads.

Beats are detected on one lead (:func:`beatflow.detect.detect_peaks`, with its flutter-episode rule).
Holter and MIT-BIH recordings have a second lead, which sees the same heart from another angle: a QRS
complex shows on both, while a noise burst or an electrode artefact on one lead is often quiet on the
other, and ventricular flutter may lose its last bits of baseline on one lead only. Three rules use it
(:func:`second_lead_peaks_xp`), all on quantities the detection already computes, per lead:

1. **flutter on either lead.** A 1 s window (aligned to the stream, as in :mod:`beatflow.detect.rhythm`) is
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
3. **misplaced peaks.** A noise peak of the first lead 0.15-0.35 s beside a QRS can win the
   detection's suppression window: one false beat and one missed. A peak is moved to the second
   lead's QRS when that lead is usable and quiet at the peak (below ``move_quiet_ratio`` × the lower
   quartile of its neighbours') but has a QRS ``move_min_s`` to ``move_max_s`` away (an envelope
   maximum of at least ``move_found_ratio`` × the neighbours' median), where the first lead has some
   QRS energy too (``move_first_ratio`` × the peak's), more than the detection's T-wave window after
   the previous peak and more than its refractory period before the next (:func:`misplaced`).

MIT-BIH, 22 non-paced records, lead 0 checked by lead 1 (``bench/results/accuracy.md``, second
lead): false positives 90 -> 55 (rules 1 and 2; 19 of them inside the annotated flutter of 207) -> 44
(rule 3: 11 peaks moved, each from a false beat onto a missed one, so the missed beats 90 -> 79);
the 4 paced records 17 -> 10 -> 9 false positives, none lost. The defaults were chosen on those
records and checked by cross-validation over records (same file).

Array code for NumPy and CuPy (the namespace comes from the input): the reference; the loop
references are in ``tests/naive.py``, and :mod:`beatflow.detect` has the public functions (the same,
with the CPU's fused loops for the steps ``envelope`` and ``lead_windows`` on NumPy input). On a
whole recording: :func:`second_lead_peaks_xp` (``beatflow evaluate --confirm-lead``). In the flow
(``beatflow run --confirm-lead`` / ``--confirm-column``) each partition, with the halos of both
leads, runs rule 1 and measures its peaks (:func:`flutter_keep_xp`, :func:`peak_measures_xp`: both
look no further than the first lead's flutter rule), and rules 2 and 3,
which compare a peak with its neighbouring peaks, run on the gathered measures (:func:`doubtful`,
:func:`misplaced`): any partitioning gives the whole recording's beats.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from beatflow.detect.peaks import qrs_envelope_xp
from beatflow.detect.rhythm import context_sum, episode_spans, near_fractions_xp, runs_of, window_energies_xp
from beatflow.device import namespace_of, scipy_for
from beatflow.params import SegmentSamples


@dataclass(frozen=True)
class SecondLeadParams:
    """The second lead's rules (:mod:`beatflow.detect.leads`).

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
    move_quiet_ratio, move_found_ratio, move_first_ratio : float
        Rule 3's limits (the module's docstring); ``move_quiet_ratio=0`` switches it off.
    move_min_s, move_max_s : float
        Rule 3 looks for the second lead's QRS this far from the peak, on either side.
    """

    flutter_max_freq_hz: float = 4.5
    flutter_baseline_ratio: float = 0.38
    flutter_gate_ratio: float = 0.42
    weak_ratio: float = 0.8
    quiet_ratio: float = 0.35
    quality_ratio: float = 3.0
    neighbours: int = 4
    reach_s: float = 0.1
    move_quiet_ratio: float = 0.7
    move_found_ratio: float = 0.6
    move_first_ratio: float = 0.2
    move_min_s: float = 0.15
    move_max_s: float = 0.4

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
                                 reach=max(0, int(round(self.reach_s * fs))),
                                 move_quiet=float(self.move_quiet_ratio), move_found=float(self.move_found_ratio),
                                 move_first=float(self.move_first_ratio),
                                 move_min=max(1, int(round(self.move_min_s * fs))),
                                 move_max=max(1, int(round(self.move_max_s * fs))))


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
    move_quiet: float = 0.0
    move_found: float = 0.0
    move_first: float = 0.0
    move_min: int = 1
    move_max: int = 1


def lead_windows_xp(x, first: int, s: SegmentSamples):
    """Per window of ``s.vf_window`` samples aligned to the recording (``x[0]`` is its sample
    ``first``; the windows at the ends of ``x`` completed with its end samples), not summed with its
    neighbours: ``(e_signal, e_slope, near, w0)``, the energies of the high-passed signal and of its
    slope, ``near(rows)``: the fractions of near-median samples of the windows ``rows`` (0 for the
    others), and the number of the first window (:mod:`beatflow.detect.rhythm`'s quantities; the
    fused loops of :func:`beatflow.detect.cpu.lead_windows_cpu` give the same)."""
    h, e_sig, e_slope, w0 = window_energies_xp(x, first, s)
    return e_sig, e_slope, lambda rows: near_fractions_xp(h, rows, s), w0


def flutter_either_lead(first_lead: tuple, second_lead: tuple, s: SegmentSamples, q: SecondLeadSamples):
    """Rule 1: which windows lie in an episode, from the two leads' ``(e_signal, e_slope, near)`` of
    :func:`lead_windows_xp` (the same windows). With ``q.baseline = 0``, exactly the first lead's episodes.

    The near-median fractions (a median and two percentiles per window: most of the rule's cost)
    are asked only for the windows within ``±s.vf_context`` of a window whose baseline fraction the
    rule reads (as :func:`beatflow.detect.rhythm.window_features_xp` does): the second lead's around
    its smooth windows, the first lead's around its own smooth ones and the second lead's candidates."""
    (es0, ed0, near0), (es1, ed1, near1) = first_lead, second_lead
    xp = namespace_of(es0)
    c = s.vf_context
    count = context_sum(xp.ones(es0.shape[0], dtype=xp.float64), c)

    def around(mask):
        return xp.flatnonzero(context_sum(mask.astype(xp.float64), c) > 0)

    smooth0 = context_sum(ed0, c) < s.vf_omega**2 * context_sum(es0, c)
    smooth1 = context_sum(ed1, c) < q.omega**2 * context_sum(es1, c)
    b1 = context_sum(near1(around(smooth1)), c) / count
    candidate1 = smooth1 & (b1 < q.baseline)
    b0 = context_sum(near0(around(smooth0 | candidate1)), c) / count
    like = (smooth0 & (b0 < s.vf_baseline)) | (candidate1 & (b0 < q.gate))
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


def _ring_maxima(env1, m1, local, q: SecondLeadSamples):
    """For every peak (``local``: positions in ``env1``): the largest maximum of ``env1`` (a position
    where it equals its sliding maximum ``m1`` over ``±q.reach`` and rises into it: a plateau counts
    once, at its first sample) that lies ``q.move_min`` to ``q.move_max`` samples away on either side,
    and its position: ``(value, position)``, ``(-inf, -1)`` where there is none; of equal values the
    earliest. The maxima are sparse (at most one per ``q.reach`` samples of a peaked envelope), so
    each peak's ring holds a few: one pass per ring slot, vectorised over the peaks."""
    xp = namespace_of(env1)
    n = local.shape[0]
    rise = xp.concatenate([xp.ones(1, dtype=bool), env1[1:] > env1[:-1]])
    at = xp.flatnonzero((env1 >= m1) & rise)
    val = env1[at].astype(xp.float64)
    best = xp.full(n, -xp.inf, dtype=xp.float64)
    where = xp.full(n, -1, dtype=xp.int64)
    if at.shape[0] == 0 or n == 0:
        return best, where
    for lo_off, hi_off in ((-q.move_max, -q.move_min), (q.move_min, q.move_max)):  # in position order
        lo = xp.searchsorted(at, local + lo_off, side="left")
        hi = xp.searchsorted(at, local + hi_off, side="right")
        for j in range(int((hi - lo).max())):
            idx = lo + j
            ok = idx < hi
            safe = xp.minimum(idx, at.shape[0] - 1)
            v = xp.where(ok, val[safe], -xp.inf)
            better = v > best
            best = xp.where(better, v, best)
            where = xp.where(better, at[safe], where)
    return best, where


def peak_measures_xp(x0, x1, peaks, first: int, n_total: int, s: SegmentSamples, q: SecondLeadSamples, *,
                     envelope=qrs_envelope_xp):
    """The measures of each peak that rules 2 and 3 need from the signal, all within ``s.vf_window``
    of the peak (a partition's halo covers them): ``(h0, h1, background, far1, far_at, far0)``, the
    first lead's QRS envelope at the peak, the second lead's envelope maximum within ``±q.reach``,
    the median of the second lead's envelope over the peak's window (windows of ``s.vf_window``
    samples aligned to the recording, the last one completed with the recording's last value), and
    for rule 3 the second lead's largest QRS maximum ``q.move_min`` to ``q.move_max`` samples away
    (:func:`_ring_maxima`), its position (global; -1 if none) and the first lead's envelope there.
    ``x0``, ``x1``: samples ``[first, first + len)`` of a recording of ``n_total`` samples;
    ``peaks``: global indices inside them; ``envelope``: the QRS envelope, of
    :func:`beatflow.detect.peaks.qrs_envelope_xp`'s contract."""
    xp = namespace_of(x0)
    _, ndimage = scipy_for(xp)
    peaks = xp.asarray(peaks, dtype=xp.int64)
    if peaks.shape[0] == 0:
        z = xp.zeros(0, dtype=xp.float64)
        return z, z, z, z, xp.zeros(0, dtype=xp.int64), z
    env0, env1 = envelope(x0, s), envelope(x1, s)
    m1 = ndimage.maximum_filter1d(env1, 2 * q.reach + 1, mode="nearest")
    local = peaks - first
    W, n = s.vf_window, x0.shape[0]
    w = peaks // W
    # each peak's window, as positions in x (clipped to the recording's end: its last value repeats)
    cols = xp.minimum(w[:, None] * W + xp.arange(W)[None, :], n_total - 1) - first
    background = xp.median(env1[xp.clip(cols, 0, n - 1)], axis=1)
    if q.move_quiet > 0:
        far1, far_local = _ring_maxima(env1, m1, local, q)
        found = far_local >= 0
        far0 = xp.where(found, env0[xp.maximum(far_local, 0)].astype(xp.float64), 0.0)
        far_at = xp.where(found, far_local + first, -1)
    else:
        far1 = xp.full(peaks.shape[0], -xp.inf, dtype=xp.float64)
        far_at, far0 = xp.full(peaks.shape[0], -1, dtype=xp.int64), xp.zeros(peaks.shape[0], dtype=xp.float64)
    return (env0[local].astype(xp.float64), m1[local].astype(xp.float64), background.astype(xp.float64),
            far1, far_at, far0)


def doubtful(h0, h1, background, q: SecondLeadSamples):
    """Rule 2 over the measures of consecutive peaks of one recording (:func:`peak_measures_xp`, in
    order): True for the peaks to drop (weak on the first lead, quiet on a usable second lead)."""
    xp = namespace_of(h0)
    if h0.shape[0] == 0 or not q.weak > 0:
        return xp.zeros(h0.shape[0], dtype=bool)
    (med0,) = _neighbour_quantiles(h0, q.neighbours, (0.5,))
    q25, med1 = _neighbour_quantiles(h1, q.neighbours, (0.25, 0.5))
    weak, quiet = _ratio(h0, med0), _ratio(h1, q25)
    quality = _ratio(med1, xp.maximum(background, 1e-12))
    return (weak < q.weak) & (quiet < q.quiet) & (quality > q.quality)


def misplaced(peaks, h0, h1, background, far1, far_at, far0, q: SecondLeadSamples, refractory: int, twave: int):
    """Rule 3 over the measures of consecutive peaks of one recording (:func:`peak_measures_xp`, in
    order, after rule 2): ``(move, peaks)``, which peaks to move and the peaks with those moved to
    the second lead's QRS. A peak moves when the second lead is usable there (rule 2's quality) and
    quiet at the peak (its QRS energy below ``q.move_quiet`` × the lower quartile of the same at the
    neighbouring peaks) but shows a QRS ``q.move_min`` to ``q.move_max`` samples away (at least
    ``q.move_found`` × the median of the neighbours'), where the first lead has some QRS energy too
    (``q.move_first`` × the peak's) and which lies more than ``twave`` samples after the previous
    peak (a bump closer behind a beat may be its T wave: the detection's T-wave window) and more
    than ``refractory`` samples before the next, where they are and where they would move. The
    order of the peaks stays, and so does their number."""
    xp = namespace_of(h0)
    peaks = xp.asarray(peaks, dtype=xp.int64)
    n = peaks.shape[0]
    if n == 0 or not q.move_quiet > 0:
        return xp.zeros(n, dtype=bool), peaks
    q25, med1 = _neighbour_quantiles(h1, q.neighbours, (0.25, 0.5))
    usable = _ratio(med1, xp.maximum(background, 1e-12)) > q.quality
    quiet = _ratio(h1, q25) < q.move_quiet
    found = (far_at >= 0) & (_ratio(far1, med1) > q.move_found) & (_ratio(far0, h0) > q.move_first)
    pos = peaks.astype(xp.float64)
    inf = xp.full(1, xp.inf, dtype=xp.float64)
    prev, nxt = xp.concatenate([-inf, pos[:-1]]), xp.concatenate([pos[1:], inf])
    at = far_at.astype(xp.float64)
    move = usable & quiet & found & (at - prev > twave) & (nxt - at > refractory)
    # where a neighbour moves too, its new place must be as far away (then either place is)
    no = xp.zeros(1, dtype=bool)
    prev_moves, next_moves = xp.concatenate([no, move[:-1]]), xp.concatenate([move[1:], no])
    prev = xp.where(prev_moves, xp.concatenate([-inf, at[:-1]]), prev)
    nxt = xp.where(next_moves, xp.concatenate([at[1:], inf]), nxt)
    move &= (at - prev > twave) & (nxt - at > refractory)
    return move, xp.where(move, far_at, peaks)


def flutter_keep_xp(x0, x1, peaks, first: int, s: SegmentSamples, q: SecondLeadSamples, span: tuple[int, int], *,
                    lead_windows=lead_windows_xp):
    """Rule 1 on ``x0``, ``x1`` (samples ``[first, first + len)`` of a recording): ``(keep, episodes)``,
    which ``peaks`` (global, inside ``x0``) lie outside the episodes, and the episodes as ``[start,
    end)`` ranges clipped to ``span``. Decisions within ``span`` are those of the whole recording
    where ``x0`` reaches ``s.halo`` beyond it (the first lead's rule reaches as far). ``lead_windows``:
    the windows' quantities, of :func:`lead_windows_xp`'s contract."""
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


def _rules_1_and_2(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams, rule3: bool, envelope,
                   lead_windows):
    """Rules 1 and 2 on a whole recording: ``(keep, episodes, dropped, measures)``, which ``peaks``
    to keep, rule 1's episodes, how many peaks rule 2 dropped, and the kept peaks' measures
    (:func:`peak_measures_xp`, rule 3's too when ``rule3``; None when rule 2 and, with ``rule3``, rule 3
    are off or no peak is left); the steps ``envelope`` and ``lead_windows`` as those take them."""
    xp = namespace_of(x0)
    if x1.shape != x0.shape:
        raise ValueError(f"the two leads differ in length ({x0.shape[0]} and {x1.shape[0]} samples)")
    q = p.samples(fs) if rule3 else replace(p.samples(fs), move_quiet=0.0)
    n = int(x0.shape[0])
    peaks = xp.asarray(peaks, dtype=xp.int64)
    keep, episodes = flutter_keep_xp(x0, x1, peaks, 0, s, q, (0, n), lead_windows=lead_windows)
    rest = xp.flatnonzero(keep)
    if not (q.weak > 0 or q.move_quiet > 0) or n < 3 or rest.shape[0] == 0:
        return keep, episodes, 0, None
    measures = peak_measures_xp(x0, x1, peaks[rest], 0, n, s, q, envelope=envelope)
    drop = doubtful(*measures[:3], q)
    keep[rest[drop]] = False
    return keep, episodes, int(drop.sum()), tuple(m[~drop] for m in measures)


def second_lead_keep_xp(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams = SecondLeadParams(), *,
                        envelope=qrs_envelope_xp, lead_windows=lead_windows_xp):
    """Rules 1 and 2 on a whole recording: ``(keep, episodes)``, which of the first lead's detected
    ``peaks`` (:func:`beatflow.detect.detect_peaks` of ``x0``) to keep, and the flutter episodes of
    rule 1 as ``[start, end)`` sample ranges (``(m, 2)`` int64). ``x1``: the second lead, as long as
    ``x0``. (The flow runs the same steps per partition: :func:`beatflow.embed.partitions.segment_partition`
    with a second lead, then :func:`doubtful` on the gathered measures.) The steps ``envelope`` and
    ``lead_windows`` as :func:`peak_measures_xp` and :func:`flutter_keep_xp` take them.

    Raises
    ------
    ValueError
        The leads differ in length.
    """
    keep, episodes, _, _ = _rules_1_and_2(x0, x1, peaks, fs, s, p, False, envelope, lead_windows)
    return keep, episodes


def second_lead_peaks_xp(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams = SecondLeadParams(), *,
                         envelope=qrs_envelope_xp, lead_windows=lead_windows_xp):
    """The three rules on a whole recording: ``(peaks, episodes, dropped, moved)``, the first lead's
    detected ``peaks`` (:func:`beatflow.detect.detect_peaks` of ``x0``) that rules 1 and 2 keep,
    with those of rule 3 moved to the second lead's QRS (sorted, as many as kept), rule 1's flutter
    episodes (as :func:`second_lead_keep_xp`), and how many peaks rule 2 dropped and rule 3 moved.
    (The flow runs the same steps per partition and on the gathered measures:
    :func:`beatflow.embed.partitions.second_lead_gathered`.) The steps as :func:`second_lead_keep_xp`."""
    xp = namespace_of(x0)
    keep, episodes, dropped, measures = _rules_1_and_2(x0, x1, peaks, fs, s, p, True, envelope, lead_windows)
    rest = xp.asarray(peaks, dtype=xp.int64)[keep]
    moved = 0
    if measures is not None:
        move, rest = misplaced(rest, *measures, p.samples(fs), s.refractory, s.twave)
        moved = int(move.sum())
    return rest, episodes, dropped, moved

"""Beat classes found without labels, as a Holter reader finds them: the AAMI EC57 classes N, S, V (F and Q
are never assigned: see below), from each beat's shape against its recording's template and its timing
against the local rhythm.

**Morphology** (array code: NumPy or CuPy, on the partition's worker). A recording's *template*
(:func:`template`) is the elementwise median of its beat rows after each row is aligned to the plain median
(:func:`beatflow.score.rule.dominant_beat`) by the lag, within ``±max_lag_s``, that correlates its QRS window
best: the detector's fiducial point moves by up to ±20 ms from beat to beat on MIT-BIH, which blurs an
unaligned median and lowers every beat's correlation with it. A beat's *deviation*
(:func:`morphology`) is one minus the best correlation of its QRS window (``-qrs_before_s`` to
``+qrs_after_s`` around its peak) with the template's over those lags: 0 for the patient's usual QRS,
about 0.3 to 1 for a ventricular beat. Correlation ignores amplitude, so the deviation needs no scale.

**Rhythm** (:func:`rhythm`, on the host, from all detected peaks of a recording): the RR intervals before and
after each beat, the *local RR* (the median of the ``local_beats`` intervals on either side, the beat's own
two left out), *prematurity* ``1 - rr_prev / local RR``, the *pause* ``rr_next / local RR`` and the local
*irregularity* (the median absolute difference of successive intervals over ``irregular_beats`` either side,
over the local RR; atrial fibrillation is irregular throughout, and its beats are N for AAMI) and the *long
prematurity* ``1 - rr_prev / long RR``, the long RR the larger of the medians of the ``long_beats`` intervals
before the beat's own two and of those after them (a run of atrial or junctional beats sets the local RR
itself, not the rhythm on both sides of it).

**The P wave** (:func:`pre_qrs`, array code where the stream is: a beat row starts only 100 ms before the
peak; :func:`p_wave` on the host): the raw signal from ``p_before_s`` to ``p_after_s`` before each peak, and
the beat's *P deviation*, one minus its correlation with the median window of its recording's sinus beats of
the usual shape, on time (:func:`on_time`): about 0 where the sinus P wave is, towards 1 and beyond where the
P wave is of another shape, inverted, hidden in the T wave or absent. A graded *S score* (:func:`s_score`, for a
ranking): the prematurity plus ``s_score_p`` times the P deviation.

**The episode** (:func:`episode`, on the host, a recording's beats in peak order): the medians over the
``episode_beats`` (31) beats centred on each beat of their P deviation and of their irregularity. Atrial
fibrillation or flutter has no sinus P wave anywhere in the stretch and is irregular throughout (on MIT-BIH,
10-90 % of the beats: an episode P deviation of 0.65-1.23 in 201's and 203's fibrillation and flutter, of
0.02-0.65 in the sinus stretches but 208's, whose ventricular beats, 45 % of them, raise it to 0.76: the
median is over all beats, V ones too); an ectopic beat of a sinus stretch, its P wave changed, moves the
median little.

**Shape features** (:func:`features`, array code beside the deviation): the QRS window's *amplitude* (log of
its standard deviation over the template's), signed *area* (in template units; negative for a beat of the
other polarity) and *width* (:func:`qrs_width`: the span of the central 80 % of the window's absolute slope,
taken over ``width_slope_s``, minus the template's; a ventricular QRS is wide), all at the beat's best lag.

**Within the recording** (:func:`shape_z`, on the host): every feature is judged against the recording's
*dominant* beats, the half of its beats least unlike the template (all normal wherever half of the beats are):
the log deviation's robust z above its ``z_low`` quantile (the spread from the 5 % quantile to that one: a
recording whose normal beats deviate a lot, a noisy lead, judges by its own spread; a recording of 45 %
ventricular and fusion beats, 208, keeps its normal beats' spread), the amplitude's and area's absolute robust z
(median, median absolute deviation of the dominant beats), and the width's one-sided robust z (0 for a QRS
narrower than the dominant beats' median).

**The rule** (:func:`assign`, :func:`judge`), per recording:

* **V**: a deviation above ``v_dev`` whose z exceeds ``v_dev_z`` (off by default: no fold chose it), or a
  deviation above ``v_min_dev`` whose *shape z* (the largest of the deviation's z and ``v_width``, ``v_amp``,
  ``v_area`` times the width's, amplitude's and area's) exceeds ``v_z_alone``, or exceeds ``v_z`` for a *wide*
  beat (width z above ``v_wide``; off by default: one fold chose it) or an *early* one (premature
  by ``v_premature`` or before a pause ``v_pause``; with, where set, a regular local rhythm, irregularity below
  ``v_irregular``, and a compensatory pause, ``(rr_prev + rr_next) / local RR`` above ``v_compensation``: an
  atrial beat resets the sinus node, a ventricular one does not); or, *early in a regular rhythm*, exceeds the
  lower ``v_z_early`` where the beat is premature by more than ``v_early_premature`` in a local rhythm of
  irregularity below ``v_early_irregular``, before a compensatory pause above ``v_early_compensation`` and,
  where set, with a P deviation above ``v_early_p_dev`` (no sinus P wave before it; off by default: no fold
  chose it): a narrow ventricular beat deviates less than a wide one, and in atrial
  fibrillation, irregular, an aberrant N beat is as early and as unlike the template; but not V, whatever its
  width, where its deviation's z is below ``v_ontime_z``, it is premature by less than ``v_ontime_premature``
  and its P deviation is below ``v_ontime_p_dev`` (on time after a P wave, its correlation with the template
  barely lower than the usual beats': a fusion beat or a normal one of changed conduction, 208's and 209's
  wide N and F beats), nor, off by default (no majority of folds chose them), where its deviation's and
  area's z are both below ``v_aberrant_z`` and it is premature by more than ``v_aberrant_premature`` in a
  local rhythm of irregularity below ``v_aberrant_irregular`` before no compensatory pause (below
  ``v_aberrant_compensation``, its next interval above ``v_aberrant_pause`` of the local RR: an aberrated
  atrial beat resets the sinus node), or where both are below ``v_sinus_z`` after a sinus P wave (a P
  deviation below ``v_sinus_p_dev``);
* **S**: not V, its QRS correlating above ``s_corr`` with the template, in a regular local rhythm
  (irregularity below ``s_irregular``), and (a) premature by more than ``s_premature`` and by more than
  ``s_spread`` times the local irregularity (earlier than the beat-to-beat variation around it explains),
  with a P deviation above ``s_p_dev``; or (b) premature by more than ``s_premature_p`` and ``s_spread`` times
  the irregularity with an S score above ``s_score_min`` (less early, but its P wave changed); or (c) long
  premature by more than ``s_long`` with a P deviation above ``s_p_long`` (within a run of ectopic atrial or
  junctional beats: faster than the rhythm around the run, without the sinus P wave), or (d) long premature
  by more than ``s_long_alone`` whatever its P wave (an atrial run or beat much faster than the rhythm around
  it; a sustained step of the rate, a 2:1 block ending, calls the first beats after it S too, until the long
  RR has followed it); but never within atrial fibrillation or flutter (AAMI: N), where the episode's P
  deviation exceeds ``s_af_p`` and its irregularity ``s_af_irregular`` (:func:`episode`); off by default (it
  lowered the folds' held-out S), a run carried on from an S beat (:func:`_carry_runs`, ``s_run_rr``). Where
  the P windows are not given (:func:`classify` of the shape alone) only (a), without its P-wave condition
  (and no episode gate);
* **N**: the rest. F (fusion) and Q (paced, unclassifiable) are never assigned: a fusion beat lies between
  the patient's N and V shapes, and no rule here separates it from either (their beats are counted in the
  evaluation under the class they are assigned).

The thresholds (the P window's start, ``p_before_s``, among them) were chosen by 5-fold cross-validation
across the 22 non-paced MIT-BIH records of the shared set (patients, never beats, split), the rule chosen on
each fold's training records (the V thresholds for the best min(Se, +P) of V, then the S ones for that of S)
being judged on its held-out records:
``bench/classes_study.py`` (the table, its command and the figures: ``bench/results/accuracy.md``). Each
default is the value most folds chose for it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from beatflow.device import namespace_of, to_host

#: the classes, in the order of the report's tables
CLASSES = ("N", "S", "V", "F", "Q")
#: at most this many rows (evenly spaced) enter a template
TEMPLATE_SAMPLE = 4096


@dataclass(frozen=True)
class ClassParams:
    """The class rule's parameters (seconds unless noted); see the module's docstring."""

    qrs_before_s: float = 0.05
    qrs_after_s: float = 0.10
    max_lag_s: float = 0.04
    width_slope_s: float = 0.008
    local_beats: int = 20
    irregular_beats: int = 16
    z_low: float = 0.25
    v_dev: float = np.inf
    v_dev_z: float = 1.0
    v_amp: float = 0.0
    v_area: float = 1.0
    v_width: float = 1.0
    v_wide: float = np.inf
    v_min_dev: float = 0.05
    v_z: float = 6.0
    v_z_alone: float = 12.0
    v_premature: float = 0.05
    v_pause: float = 1.1
    v_irregular: float = np.inf
    v_compensation: float = 0.0
    v_z_early: float = 3.0
    v_early_premature: float = 0.1
    v_early_irregular: float = 0.2
    v_early_p_dev: float = -np.inf
    v_early_compensation: float = 0.0
    v_aberrant_premature: float = np.inf
    v_aberrant_compensation: float = 1.6
    v_aberrant_irregular: float = 0.3
    v_aberrant_z: float = 6.0
    v_aberrant_pause: float = 0.0
    v_sinus_p_dev: float = -np.inf
    v_sinus_z: float = 4.0
    v_ontime_z: float = 3.0
    v_ontime_premature: float = 0.1
    v_ontime_p_dev: float = 0.9
    s_premature: float = 0.15
    s_irregular: float = 0.15
    s_spread: float = 1.0
    s_corr: float = 0.7
    p_before_s: float = 0.25
    p_after_s: float = 0.07
    s_p_dev: float = 0.1
    s_score_p: float = 0.5
    s_score_min: float = 0.6
    s_premature_p: float = 0.0
    long_beats: int = 150
    s_long: float = 0.15
    s_p_long: float = 0.6
    s_run_rr: float = 0.0
    s_run_p_dev: float = 0.2
    s_run_p: float = 0.6
    episode_beats: int = 31
    s_af_p: float = 0.5
    s_af_irregular: float = 0.1
    s_long_alone: float = 0.3

    def to_dict(self) -> dict:
        return asdict(self)

    def window(self, fs: float, pre: int) -> tuple[int, int, int]:
        """The QRS window ``[a, b)`` in a row whose peak is at ``pre``, and the largest lag, in samples (the
        window moved by any lag stays inside the row's first ``pre + qrs_after + lag`` samples)."""
        lag = int(round(self.max_lag_s * fs))
        a = max(lag, pre - int(round(self.qrs_before_s * fs)))
        return a, pre + int(round(self.qrs_after_s * fs)), lag


# --- morphology (array code) -------------------------------------------------------------------------

def _best_lag(rows, ref, a: int, b: int, lag: int):
    """For each row, the best correlation of ``rows[:, a+l:b+l]`` with ``ref[a:b]`` over ``|l| <= lag`` (the
    first such ``l`` on ties), and that ``l``.

    The template's window has zero mean, so a lag's covariance is one matrix-vector product of the rows'
    window with it; the windows' variances for every lag come from two running sums of the rows (float64),
    so each lag costs one pass over the window instead of five (centring, squaring, summing)."""
    xp = namespace_of(rows)
    width = b - a
    d = ref[a:b].astype(xp.float32)
    d = d - d.mean()
    dn = float(xp.sqrt((d * d).sum())) + 1e-12
    seg = rows[:, a - lag : b + lag].astype(xp.float32)
    n = int(seg.shape[0])
    zero = xp.zeros((n, 1), dtype=xp.float64)
    c1 = xp.concatenate([zero, xp.cumsum(seg, axis=1, dtype=xp.float64)], axis=1)
    c2 = xp.concatenate([zero, xp.cumsum(seg.astype(xp.float64) ** 2, axis=1)], axis=1)
    s1 = c1[:, width:] - c1[:, :-width]  # (n, 2 lag + 1): each lag's window sum
    var = xp.maximum(c2[:, width:] - c2[:, :-width] - s1 * s1 / width, 0.0)
    norm = (xp.sqrt(var) * dn + 1e-12).astype(xp.float32)
    best = xp.full(n, -2.0, dtype=xp.float32)
    at = xp.zeros(n, dtype=xp.int32)
    for j in range(2 * lag + 1):
        c = (seg[:, j : j + width] @ d) / norm[:, j]
        up = c > best
        best = xp.where(up, c, best)
        at = xp.where(up, xp.int32(j - lag), at)
    return best, at


def template(rows, fs: float, pre: int, p: ClassParams = ClassParams()):
    """A recording's template: the elementwise median of its rows (at most :data:`TEMPLATE_SAMPLE`, evenly
    spaced), each shifted by its best lag against the plain median (see the module's docstring).

    ``rows``: ``(n, width)``, NumPy or CuPy, any scale (the template has the rows' scale). Returns ``(width,)``
    float32 in the rows' namespace (zeros for no rows)."""
    xp = namespace_of(rows)
    n, width = int(rows.shape[0]), int(rows.shape[1])
    if n == 0:
        return xp.zeros(width, dtype=xp.float32)
    sample = rows[:: -(-n // TEMPLATE_SAMPLE)].astype(xp.float32)
    plain = xp.median(sample, axis=0)
    a, b, lag = p.window(fs, pre)
    _, at = _best_lag(sample, plain, a, b, lag)
    cols = xp.clip(xp.arange(width)[None, :] + at[:, None], 0, width - 1)
    return xp.median(xp.take_along_axis(sample, cols, axis=1), axis=0).astype(xp.float32)


def morphology(rows, tmpl, fs: float, pre: int, p: ClassParams = ClassParams()):
    """Each row's deviation from the template (one minus its best aligned QRS correlation), float32 in the
    rows' namespace."""
    a, b, lag = p.window(fs, pre)
    xp = namespace_of(rows)
    best, _ = _best_lag(rows, xp.asarray(tmpl), a, b, lag)
    return (1.0 - best).astype(xp.float32)


#: the columns of :func:`features`
FEATURES = ("deviation", "amplitude", "area", "width")
#: the QRS width's ends: where the window's cumulative absolute slope crosses these fractions of its total
WIDTH_QUANTILES = (0.1, 0.9)


def qrs_width(win, fs: float, p: ClassParams = ClassParams()):
    """The QRS width of each row of ``win`` (``(n, m)`` windows around the QRS, NumPy or CuPy), in seconds: the
    time between the points where the row's cumulative absolute slope crosses :data:`WIDTH_QUANTILES` of its
    total (linearly interpolated between samples), the slope the difference over ``width_slope_s`` (8 ms: 3
    samples at 360 Hz, 2 at 250 Hz). The slope's mass is the QRS's (the P and T waves and the baseline are
    slow), so a wide QRS spreads it over a longer stretch; the central 80 % of the mass leaves out the tails,
    and the difference over a few samples keeps white noise from spreading the mass over the whole window (a
    first difference's noise mass grows as its span shrinks). ``(n,)`` float32 in ``win``'s namespace (0 for
    a flat row).

    By hand: no library has a row-wise quantile of a weight profile (``quantile`` is of values, not weights)."""
    xp = namespace_of(win)
    w = xp.asarray(win).astype(xp.float32)
    k = max(1, int(round(p.width_slope_s * fs)))
    n, m = int(w.shape[0]), int(w.shape[1]) - k + 1
    if m < 2:
        raise ValueError(f"a QRS window of {int(w.shape[1])} samples is too short for a slope over {k}")
    c = xp.concatenate([xp.zeros((n, 1), dtype=xp.float32),
                        xp.cumsum(xp.abs(w[:, k:] - w[:, :-k]), axis=1, dtype=xp.float32)], axis=1)
    total = c[:, -1:]
    c = c / xp.maximum(total, xp.float32(1e-30))
    ends = []
    for q in WIDTH_QUANTILES:
        at = xp.clip(xp.argmax(c >= q, axis=1), 1, m - 1)[:, None]  # the first point at or past q (c[:, 0] = 0)
        lo, hi = xp.take_along_axis(c, at - 1, axis=1)[:, 0], xp.take_along_axis(c, at, axis=1)[:, 0]
        ends.append((at[:, 0] - 1).astype(xp.float32) + (q - lo) / xp.maximum(hi - lo, xp.float32(1e-12)))
    return xp.where(total[:, 0] > 0, (ends[1] - ends[0]) / xp.float32(fs), xp.float32(0.0)).astype(xp.float32)


def features(rows, tmpl, fs: float, pre: int, p: ClassParams = ClassParams()):
    """Each row's shape against the template, ``(n, 4)`` float32 in the rows' namespace, the columns
    :data:`FEATURES`: the *deviation* (:func:`morphology`), the *amplitude* (the log of the standard deviation of
    the row's QRS window, at its best lag, over the template's), the *area* (the sum of that window over the
    template window's absolute sum: the signed QRS area in template units; a beat of the other polarity is
    negative) and the *width* (:func:`qrs_width` of that window minus the template window's, in seconds). The
    rows' scale must be the template's (the rows the template was made of)."""
    a, b, lag = p.window(fs, pre)
    xp = namespace_of(rows)
    t = xp.asarray(tmpl).astype(xp.float32)
    best, at = _best_lag(rows, t, a, b, lag)
    cols = (a + at.astype(xp.int64))[:, None] + xp.arange(b - a)[None, :]
    win = xp.take_along_axis(rows, cols, axis=1).astype(xp.float32)
    tw = t[a:b]
    ts = float(tw.std()) + 1e-12
    amp = xp.log(xp.maximum(win.std(axis=1), 1e-3 * ts) / ts)
    area = win.sum(axis=1) / (float(xp.abs(tw).sum()) + 1e-12)
    width = qrs_width(win, fs, p) - qrs_width(tw[None, :], fs, p)[0]
    return xp.stack([1.0 - best, amp, area, width], axis=1).astype(xp.float32)


# --- the P wave (array code, and host) -----------------------------------------------------------------

def pre_qrs(x, x0: int, peaks, fs: float, p: ClassParams = ClassParams()):
    """The raw signal before each beat, where its P wave is: ``x[peak - p_before_s : peak - p_after_s]``
    (``(n, width)`` float32 in ``x``'s namespace, NumPy or CuPy), ``x`` a stretch of the stream whose first
    sample is sample ``x0`` of ``peaks``' (a window reaching past either end repeats the end sample: a
    partition's halos hold every window of its own beats). A beat row begins ``pre`` (100 ms) before the
    peak, too late for the P wave, so the window comes from the stream itself."""
    xp = namespace_of(x)
    a, b = int(round(p.p_before_s * fs)), int(round(p.p_after_s * fs))
    at = xp.asarray(peaks).astype(xp.int64) - int(x0)
    idx = xp.clip(at[:, None] - a + xp.arange(a - b, dtype=xp.int64)[None, :], 0, int(x.shape[0]) - 1)
    return x[idx].astype(xp.float32)


def on_time(dev, timing: dict) -> np.ndarray:
    """The beats whose pre-QRS window makes a recording's P reference (:func:`p_wave`): of the usual shape
    (deviation at most the median's) and on time (prematurity within ±0.1)."""
    d = np.asarray(to_host(dev), np.float64)
    prem = np.nan_to_num(np.asarray(timing["prematurity"], np.float64), nan=1.0)
    return (d <= np.median(d)) & (np.abs(prem) < 0.1) if len(d) else np.zeros(0, bool)


def p_wave(windows, dominant, chunk: int = 65536) -> np.ndarray:
    """Each beat's *P deviation*: one minus the correlation of its :func:`pre_qrs` window (mean removed) with
    the median window of the recording's ``dominant`` beats (a mask: sinus beats of the usual shape, on
    time). A sinus beat's P wave is the dominant's (0); an atrial beat's is of another shape or hidden in
    the T wave before it, a junctional beat's absent or inverted (towards 1 and beyond). Host float64,
    ``chunk`` windows at a time: a 200 h recording's float64 copies of all its windows took 1.4 GB of the
    flow's process at once."""
    w = to_host(windows)
    n = len(w)
    if not n:
        return np.zeros(0)
    dom = np.asarray(dominant, bool)
    ref_rows = np.asarray(w[dom] if dom.any() else w, np.float64)
    ref_rows -= ref_rows.mean(axis=1, keepdims=True)
    ref = np.median(ref_rows, axis=0)
    del ref_rows
    ref = ref - ref.mean()
    ref_norm = np.sqrt(ref @ ref)
    out = np.empty(n)
    for i in range(0, n, chunk):
        c = np.asarray(w[i:i + chunk], np.float64)
        c -= c.mean(axis=1, keepdims=True)
        with np.errstate(all="ignore"):
            out[i:i + chunk] = 1.0 - (c @ ref) / (np.sqrt(np.einsum("ij,ij->i", c, c)) * ref_norm + 1e-12)
    return out


def episode(timing: dict, p: ClassParams = ClassParams()) -> dict:
    """The rhythm of the stretch around each beat of one recording (beats in peak order): the medians over the
    ``episode_beats`` beats centred on it of the beats' P deviation (``episode_p``) and of their irregularity
    (``episode_irregularity``), NaN counted as 1 (no P wave, no rhythm). In atrial fibrillation or flutter
    the stretch has no sinus P wave (about 1 against 0.02-0.65 in sinus rhythm) and is irregular throughout;
    the median leaves out the few ectopic beats of a sinus stretch (their changed P wave, the irregularity
    they cause). ``scipy.ndimage.median_filter``, its ends repeated."""
    from scipy.ndimage import median_filter

    out = {}
    for key, name in (("p_deviation", "episode_p"), ("irregularity", "episode_irregularity")):
        v = np.nan_to_num(np.asarray(timing[key], np.float64), nan=1.0, posinf=1.0)
        out[name] = median_filter(v, size=max(1, p.episode_beats), mode="nearest") if len(v) else v
    return out


# --- rhythm (host) -----------------------------------------------------------------------------------

def _around(rr: np.ndarray, idx: np.ndarray, k: int) -> np.ndarray:
    """For beat ``i`` (its peak at position ``idx[i]`` of the peaks), the intervals ``rr[idx-1-k .. idx+k]``
    without ``rr[idx-1]`` and ``rr[idx]`` (its own two), NaN beyond the ends: ``(n, 2k)``."""
    pad = np.concatenate([np.full(k + 1, np.nan), rr, np.full(k + 1, np.nan)])
    offs = np.concatenate([np.arange(-k - 1, -1), np.arange(1, k + 1)])  # (rr[idx-1] is at offset -1)
    return pad[(idx + k + 1)[:, None] + offs[None, :]]


def _row_median(v: np.ndarray) -> np.ndarray:
    """The median of each row, NaNs left out (NaN for a row of NaNs): ``np.median`` for the rows without a NaN
    (all but a recording's first and last few beats; ``np.nanmedian`` of every row took 5x longer)."""
    out = np.full(v.shape[0], np.nan)
    gap = np.isnan(v).any(axis=1)
    if (~gap).any():
        out[~gap] = np.median(v[~gap], axis=1)
    if gap.any():
        import warnings

        with warnings.catch_warnings():  # (all-NaN neighbourhoods of a recording of a few beats)
            warnings.simplefilter("ignore", RuntimeWarning)
            out[gap] = np.nanmedian(v[gap], axis=1)
    return out


def rhythm(peaks, beat_peaks, fs: float, p: ClassParams = ClassParams(), chunk: int = 65536) -> dict:
    """Timing of the beats at ``beat_peaks`` among a recording's sorted detected ``peaks`` (samples).

    Returns float64 arrays (NaN where a neighbour is missing): ``rr_prev_s``, ``rr_next_s``, ``local_rr_s``,
    ``prematurity``, ``pause``, ``irregularity``, ``long_prematurity`` (see the module's docstring; the long
    RR's medians are over ``long_beats`` made odd, 151, intervals, each window clipped to the recording's
    intervals, their ends repeated where a window still runs past them: ``scipy.ndimage.median_filter``).
    The local RR and the irregularity are taken ``chunk`` beats at a time."""
    pk = np.asarray(to_host(peaks), np.int64)
    at = np.asarray(to_host(beat_peaks), np.int64)
    rr = np.diff(pk) / float(fs)
    idx = np.searchsorted(pk, at)
    n = len(at)
    prev = np.full(n, np.nan)
    nxt = np.full(n, np.nan)
    if len(rr):
        has_prev, has_next = idx > 0, idx < len(pk) - 1
        prev[has_prev] = rr[idx[has_prev] - 1]
        nxt[has_next] = rr[idx[has_next]]
    with np.errstate(all="ignore"):
        local, irr = np.empty(n), np.empty(n)
        for i in range(0, n, chunk):  # (the neighbourhoods of all of a 200 h recording's beats at once: 0.9 GB)
            j = idx[i:i + chunk]
            local[i:i + chunk] = _row_median(_around(rr, j, p.local_beats))
            near = _around(rr, j, p.irregular_beats)
            irr[i:i + chunk] = _row_median(np.abs(np.diff(near, axis=1))) / _row_median(near)
        prem = 1.0 - prev / local
        pause = nxt / local
        long_rr = np.full(n, np.nan)
        if len(rr):
            from scipy.ndimage import median_filter

            k, h, top = 2 * (p.long_beats // 2) + 1, p.long_beats // 2, len(rr) - 1
            med = median_filter(rr, size=k, mode="nearest")  # (centred: med[j] over rr[j-h .. j+h])
            before = med[np.clip(idx - 2 - h, 0, top)]  # the k intervals before rr_prev
            after = med[np.clip(idx + 1 + h, 0, top)]  # the k intervals after rr_next
            long_rr = np.maximum(before, after)
        long_prem = 1.0 - prev / long_rr
    return {"rr_prev_s": prev, "rr_next_s": nxt, "local_rr_s": local, "prematurity": prem, "pause": pause,
            "irregularity": irr, "long_prematurity": long_prem}


# --- the rule (host) ---------------------------------------------------------------------------------

def _robust_z(v: np.ndarray, ref: np.ndarray, floor: float) -> np.ndarray:
    """``|v - median(ref)| / max(σ, floor)``, σ the median absolute deviation of ``ref`` scaled to a normal's
    standard deviation (``scipy.stats.median_abs_deviation(ref, scale="normal")``, written out: importing
    ``scipy.stats`` took 0.7 s of every run's flow process)."""
    if not len(ref):
        return np.zeros(len(v))
    med = float(np.median(ref))
    return np.abs(v - med) / max(float(np.median(np.abs(ref - med))) / _NORMAL_Q3, floor)


#: the standard normal's 0.75 quantile (the median absolute deviation of a normal over its σ)
_NORMAL_Q3 = NormalDist().inv_cdf(0.75)


#: the least spread (seconds) of the dominant beats' QRS width in :func:`shape_z` (a sample is 2.8 ms at 360 Hz)
WIDTH_FLOOR_S = 0.002


def shape_z(feats, recording=None, p: ClassParams = ClassParams()) -> np.ndarray:
    """Each beat's shape judged within its recording, ``(n, 4)``, against the recording's *dominant* beats
    (the half of its beats least unlike the template: all normal where half of them are; a recording of
    45 % ventricular and fusion beats, 208, keeps its normal beats' spread):

    * column 0, the log deviation above the recording's ``z_low`` quantile of it (the dominant beats' middle)
      in units of its spread from the 5 % quantile to that one (one-sided: for normal values, a standard
      deviation), so a recording whose normal beats deviate a lot (a noisy lead) judges by its own spread;
    * columns 1 and 2, the absolute robust z (median, median absolute deviation) of the amplitude and the
      area (:func:`features`) against the dominant beats' (a beat unlike the usual either way);
    * column 3, the width's one-sided robust z (0 for a beat narrower than the dominant beats' median: only a
      wide QRS is ventricular), its spread at least :data:`WIDTH_FLOOR_S`.

    ``feats``: :func:`features` (or the deviation alone, ``(n,)``: the other three are 0; or its first three
    columns: the width's z is 0)."""
    f = np.asarray(to_host(feats), np.float64)
    if f.ndim == 1:
        f = np.stack([f, np.zeros_like(f), np.ones_like(f)], axis=1)
    n = f.shape[0]
    if f.shape[1] < len(FEATURES):  # (no width: that of every beat the same)
        f = np.concatenate([f, np.zeros((n, len(FEATURES) - f.shape[1]))], axis=1)
    rec = np.zeros(n, np.int64) if recording is None else np.asarray(to_host(recording))
    if rec.shape != (n,):
        raise ValueError(f"{rec.size} recording labels for {n} beats")
    z = np.zeros((n, len(FEATURES)))
    logd = np.log(np.clip(f[:, 0], 1e-4, 2.0))
    span = NormalDist().inv_cdf(p.z_low) - NormalDist().inv_cdf(0.05)
    for r in np.unique(rec):
        m = np.flatnonzero(rec == r)
        d = logd[m]
        lo, mid, half = np.quantile(d, [0.05, p.z_low, 0.5])
        z[m, 0] = (d - mid) / max((mid - lo) / span, 0.05)
        dom = m[d <= half]
        z[m, 1] = _robust_z(f[m, 1], f[dom, 1], 0.01)
        z[m, 2] = _robust_z(f[m, 2], f[dom, 2], 0.01)
        if len(dom):
            z[m, 3] = _robust_z(f[m, 3], f[dom, 3], WIDTH_FLOOR_S) * (f[m, 3] > float(np.median(f[dom, 3])))
    return z


def assign(deviation, timing: dict, recording=None, p: ClassParams = ClassParams()) -> np.ndarray:
    """The class (``"N"``, ``"S"`` or ``"V"``) of each beat, from its shape (:func:`features`, or the deviation
    alone: :func:`morphology`) and timing (:func:`rhythm`), the shape judged within each recording
    (``recording``: each beat's; None: one; :func:`shape_z`)."""
    f = np.asarray(to_host(deviation), np.float64)
    return judge(f[:, 0] if f.ndim == 2 else f, shape_z(f, recording, p), timing, p)


def judge(dev: np.ndarray, z: np.ndarray, timing: dict, p: ClassParams = ClassParams()) -> np.ndarray:
    """:func:`assign`'s classes from each beat's deviation, its :func:`shape_z` and its timing."""
    wide = z[:, 3] if z.shape[1] > 3 else np.zeros(len(dev))
    shape = np.maximum(np.maximum(z[:, 0], p.v_width * wide), np.maximum(p.v_amp * z[:, 1], p.v_area * z[:, 2]))
    prem = np.nan_to_num(timing["prematurity"], nan=0.0)
    pause = np.nan_to_num(timing["pause"], nan=1.0)
    irr = np.nan_to_num(timing["irregularity"], nan=np.inf)
    with np.errstate(all="ignore"):
        comp = np.nan_to_num((timing["rr_prev_s"] + timing["rr_next_s"]) / timing["local_rr_s"], nan=2.0)
    early = ((prem > p.v_premature) | (pause > p.v_pause)) & (irr < p.v_irregular) & (comp > p.v_compensation)
    # (a missing P deviation, the shape alone or a flat window, counts as the sinus P wave's 0)
    pdev = np.nan_to_num(np.asarray(timing.get("p_deviation", np.zeros(len(dev))), np.float64), nan=0.0)
    early_regular = ((prem > p.v_early_premature) & (irr < p.v_early_irregular) & (pdev > p.v_early_p_dev)
                     & (comp > p.v_early_compensation) & (shape > p.v_z_early))
    v = (((dev > p.v_dev) & (z[:, 0] > p.v_dev_z))
         | ((dev > p.v_min_dev) & (((shape > p.v_z) & (early | (shape > p.v_z_alone) | (wide > p.v_wide)))
                                   | early_regular)))
    # not V where only the width makes the QRS unlike the template (the deviation's and the area's z low) and
    # the timing or the P wave says atrial: very early, in a rhythm regular enough to tell, before no
    # compensatory pause (an aberrated atrial beat resets the sinus node); or after a sinus P wave
    narrow = np.maximum(z[:, 0], z[:, 2])
    v &= ~((prem > p.v_aberrant_premature) & (comp < p.v_aberrant_compensation) & (pause > p.v_aberrant_pause)
           & (irr < p.v_aberrant_irregular) & (narrow < p.v_aberrant_z))
    if "p_deviation" in timing:  # (a missing P deviation is no sinus P wave)
        p_seen = np.nan_to_num(np.asarray(timing["p_deviation"], np.float64), nan=np.inf)
        v &= ~((p_seen < p.v_sinus_p_dev) & (narrow < p.v_sinus_z))
        # on time, its correlation with the template barely lower than the usual beats', a P wave before it: a
        # fusion or a normal beat of changed conduction, not V, however wide
        v &= ~((z[:, 0] < p.v_ontime_z) & (prem < p.v_ontime_premature) & (p_seen < p.v_ontime_p_dev))
    normal = ~v & (1.0 - dev > p.s_corr) & (irr < p.s_irregular)
    if "episode_p" in timing:  # not S within atrial fibrillation or flutter (AAMI: N): no P wave, irregular
        normal &= ~((np.asarray(timing["episode_p"]) > p.s_af_p)
                    & (np.asarray(timing["episode_irregularity"]) > p.s_af_irregular))
    early_s = prem > np.maximum(p.s_premature, p.s_spread * irr)
    if "p_deviation" in timing:  # (without the P wave: the timing alone)
        early_s &= pdev > p.s_p_dev
        early_s |= (prem > np.maximum(p.s_premature_p, p.s_spread * irr)) & (s_score(timing, p) > p.s_score_min)
        if "long_prematurity" in timing:
            long_prem = np.nan_to_num(timing["long_prematurity"], nan=0.0)
            early_s |= ((long_prem > p.s_long) & (pdev > p.s_p_long)) | (long_prem > p.s_long_alone)
    s = normal & early_s
    if p.s_run_rr > 0 and "p_deviation" in timing:
        s = _carry_runs(s, normal, timing, p)
    out = np.full(len(dev), "N", dtype="<U1")
    out[v] = "V"
    out[s] = "S"
    return out


def _carry_runs(s: np.ndarray, normal: np.ndarray, timing: dict, p: ClassParams) -> np.ndarray:
    """``s`` with the runs carried on: a beat of the usual QRS in a regular rhythm (``normal``) right after an S
    beat (the beats in peak order) is S where its RR interval is within ``s_run_rr`` (a fraction) of the S beat's,
    its P deviation within ``s_run_p_dev`` of the S beat's and above ``s_run_p`` (the same ectopic P wave or none)
    and it is faster than the longer rhythm (long prematurity above 0): an atrial or junctional run goes on at
    its own rate, after its first beats the local RR is the run's own, and only the P wave and the rate tell."""
    rr = np.asarray(timing["rr_prev_s"], np.float64)
    pd = np.asarray(timing["p_deviation"], np.float64)
    n = len(s)
    cand = np.zeros(n, bool)
    if n > 1:
        with np.errstate(all="ignore"):
            cand[1:] = (np.abs(rr[1:] / rr[:-1] - 1.0) < p.s_run_rr) & (np.abs(pd[1:] - pd[:-1]) < p.s_run_p_dev)
    cand &= normal & (np.nan_to_num(pd, nan=-np.inf) > p.s_run_p)
    if "long_prematurity" in timing:
        cand &= np.nan_to_num(np.asarray(timing["long_prematurity"], np.float64), nan=0.0) > 0.0
    # S where S or a candidate whose block of consecutive candidates begins at (or holds, before it) an S beat
    idx = np.arange(n)
    start = np.maximum.accumulate(np.where(~cand, idx, 0)) if n else idx
    cs = np.concatenate([[0], np.cumsum(s)])
    return s | (cand & (cs[idx + 1] - cs[start] > 0))


def s_score(timing: dict, p: ClassParams = ClassParams()) -> np.ndarray:
    """A graded supraventricular score (for a ranking, its ROC-AUC against N): the prematurity plus
    ``s_score_p`` times the P deviation (a missing one counts as 0)."""
    prem = np.nan_to_num(np.asarray(timing["prematurity"], np.float64), nan=0.0)
    pdev = np.nan_to_num(np.asarray(timing.get("p_deviation", np.zeros(len(prem))), np.float64), nan=0.0)
    return prem + p.s_score_p * pdev


# --- what a Holter report counts ---------------------------------------------------------------------

def runs(classes, cls: str, recording=None) -> dict:
    """Runs of consecutive beats of class ``cls`` within each recording: ``isolated`` (1 beat), ``couplets``
    (2), ``runs`` (3 or more: ventricular or supraventricular tachycardia), ``longest``."""
    c = np.asarray(classes)
    rec = np.zeros(len(c), np.int64) if recording is None else np.asarray(recording)
    hit = c == cls
    # a run ends where the class changes or the recording does
    brk = np.ones(len(c) + 1, bool)
    if len(c) > 1:
        brk[1:-1] = (hit[1:] != hit[:-1]) | (rec[1:] != rec[:-1])
    edges = np.flatnonzero(brk)
    lengths = np.diff(edges)
    starts = edges[:-1]
    lengths = lengths[hit[starts]] if len(starts) else lengths[:0]
    return {"isolated": int((lengths == 1).sum()), "couplets": int((lengths == 2).sum()),
            "runs": int((lengths >= 3).sum()), "longest": int(lengths.max()) if len(lengths) else 0}


def class_summary(classes, recording=None) -> dict:
    """Counts per class, the V and S burden (% of the classed beats), and the V and S runs."""
    c = np.asarray(classes)
    n = len(c)
    counts = {k: int((c == k).sum()) for k in CLASSES}
    return {"counts": counts, "beats": n,
            "v_burden_pct": 100.0 * counts["V"] / n if n else 0.0,
            "s_burden_pct": 100.0 * counts["S"] / n if n else 0.0,
            "v_runs": runs(c, "V", recording), "s_runs": runs(c, "S", recording)}


def classify(peaks_of: dict, beat_peak, recording, deviation, fs: float, p: ClassParams = ClassParams()):
    """The class and timing of each beat of a stream of recordings.

    ``peaks_of``: each recording's sorted detected peaks (samples); ``beat_peak``, ``recording``,
    ``deviation``: each classed beat's peak, recording and :func:`features` (or :func:`morphology`), optionally
    followed by the columns of its :func:`pre_qrs` window (its recording's beats in peak order); or a list of
    such arrays, pieces of the beats in order (the partitions' results, never joined: at 1000 h their P
    windows are 0.9 GB). Returns ``(classes, timing)``: :func:`assign`'s classes and :func:`rhythm`'s arrays
    (with a ``p_deviation``, :func:`p_wave` against the recording's :func:`on_time` beats, where the windows
    came), in the beats' order."""
    beat_peak = np.asarray(to_host(beat_peak), np.int64)
    rec = np.asarray(to_host(recording), np.int64)
    pieces = [np.asarray(to_host(d), np.float32) for d in (deviation if isinstance(deviation, (list, tuple))
                                                           else [deviation])]
    has_windows = pieces[0].ndim == 2 and pieces[0].shape[1] > len(FEATURES)
    if has_windows:
        f = np.concatenate([d[:, : len(FEATURES)] for d in pieces])
    else:
        f = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    keys = ("rr_prev_s", "rr_next_s", "local_rr_s", "prematurity", "pause", "irregularity", "long_prematurity")
    timing = {k: np.full(len(beat_peak), np.nan) for k in keys + (("p_deviation",) if has_windows else ())}
    dev = f[:, 0] if f.ndim == 2 else f
    for r in np.unique(rec):
        m = rec == r
        t = rhythm(peaks_of[int(r)], beat_peak[m], fs, p)
        for k in keys:
            timing[k][m] = t[k]
        if has_windows:
            timing["p_deviation"][m] = p_wave(_rows_of(pieces, np.flatnonzero(m), len(FEATURES)), on_time(dev[m], t))
            for k, v in episode({"p_deviation": timing["p_deviation"][m], "irregularity": t["irregularity"]}, p).items():
                timing.setdefault(k, np.full(len(beat_peak), np.nan))[m] = v
    return assign(f, timing, rec, p), timing


def _rows_of(pieces: list, idx: np.ndarray, col: int) -> np.ndarray:
    """Rows ``idx`` (sorted) of the pieces stacked, from column ``col`` on."""
    off = np.cumsum([0] + [len(d) for d in pieces])
    k = np.searchsorted(off, idx, side="right") - 1
    out = np.empty((len(idx), pieces[0].shape[1] - col), np.float32)
    for j in np.unique(k):
        sel = k == j
        out[sel] = pieces[j][idx[sel] - off[j], col:]
    return out

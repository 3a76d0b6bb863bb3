"""The model's input and its scores' decision: the model-input rule, a robust threshold and the anomaly table.

**The model-input rule** (one for training, the flow's scoring, ``beatflow score`` and ``beatflow evaluate``):
the VAE sees each beat row divided by the model's *scale*, minus the *dominant beat* of the row's recording.
The scale is one number per model, :func:`input_scale` of its training rows (the median peak-to-peak of
every training row, pooled over the recordings it trained on); rows scored later are divided by that same
scale. The dominant beat is per recording: the elementwise median of that recording's scaled rows
(:func:`dominant_beat`), the training's for the recordings it trained on, a new recording's own otherwise.
:func:`model_input` applies the rule; :data:`MODEL_INPUT` names it in ``model.json``.
"""
from __future__ import annotations

import numpy as np

from beatflow.device import namespace_of, to_host
from beatflow.score.classes import CLASSES

#: what the VAE is trained on and scores (recorded in model.json)
MODEL_INPUT = "beat rows / scale - dominant beat of their recording (elementwise median of its rows)"
#: at most this many rows (evenly spaced) enter a stream's dominant beat
DOMINANT_SAMPLE = 16384


def input_scale(p2p) -> float:
    """The model's scale: the median peak-to-peak amplitude of its training rows, pooled over their
    recordings (1 where that is 0, or where there are no rows). ``p2p``: NumPy or CuPy."""
    if not p2p.shape[0]:
        return 1.0
    s = float(to_host(namespace_of(p2p).median(p2p)))
    return s if s > 0 else 1.0


def scale_rows(rows, scale: float, out=None):
    """``rows / scale`` in the rows' float type (NumPy or CuPy); into ``out`` when given (it may be ``rows``)."""
    return namespace_of(rows).divide(rows, rows.dtype.type(scale), out=out)


def dominant_beat(rows, scale: float | None = None):
    """A stream's dominant beat: the elementwise median of its beat rows, scaled by ``scale`` when given
    (the rows as they are otherwise: already scaled).

    Most beats of a recording are that patient's normal beats, so the median row is their shape,
    and a beat's difference from it (:func:`residual_rows`) is what makes it unusual *for this
    patient*; the VAE is trained on and scores those differences, which makes its score comparable
    across patients whose normal beats differ (bundle branch blocks, lead placement). Long streams
    use at most :data:`DOMINANT_SAMPLE` evenly spaced rows (deterministic).

    Parameters
    ----------
    rows : array (n, width), NumPy or CuPy
    scale : float, optional

    Returns
    -------
    array (width,) of ``rows.dtype`` (zeros when there are no rows)
    """
    xp = namespace_of(rows)
    n = int(rows.shape[0])
    if n == 0:
        return xp.zeros(rows.shape[1], dtype=rows.dtype)
    step = -(-n // DOMINANT_SAMPLE)
    sample = rows[::step] if scale is None else scale_rows(rows[::step], scale)
    return xp.median(sample, axis=0).astype(rows.dtype)


def residual_rows(rows, dominant):
    """The rows minus their stream's dominant beat (the VAE's input); a new array."""
    xp = namespace_of(rows)
    return rows - xp.asarray(dominant, dtype=rows.dtype)[None, :]


def model_input(rows, scale: float, dominant=None, out=None):
    """The VAE's input (the rule above): ``rows / scale - dominant``, NumPy or CuPy as ``rows``.

    ``dominant``: the dominant beat of the rows' recording, already scaled (the training's); None: these
    rows' own (:func:`dominant_beat` of the scaled rows: a whole recording's rows). ``out``: where to write
    (it may be ``rows``: the rows replaced by their input), else a new array."""
    x = scale_rows(rows, scale, out=out)
    if dominant is None:
        dominant = dominant_beat(x)
    x -= namespace_of(x).asarray(dominant, dtype=x.dtype)[None, :]
    return x

#: a beat is flagged when log(score) exceeds median + K · 1.4826 · MAD of log(score)
DEFAULT_MAD_K = 4.0


def robust_threshold(scores, k: float = DEFAULT_MAD_K, recording=None) -> float:
    """Score threshold from the median and MAD of the log scores.

    Reconstruction errors are positive and heavy-tailed; on the log scale the bulk of normal beats
    is close to symmetric, so ``median + k·σ̂`` (σ̂ = 1.4826·MAD) flags what lies far in the tail
    without assuming any anomaly rate.

    With ``recording`` (each score's recording), σ̂ is the spread *within* recordings: the MAD of
    the log scores around their own recording's median. Recordings differ in noise, and so in the
    level of their normal beats' scores (MIT-BIH: medians e^-7.4 to e^-4.0); around one overall
    median those differences widened σ̂ until the threshold lay above the abnormal beats themselves
    (the 22 non-paced MIT-BIH records as one stream: 30 beats flagged, 0.1 % of the V beats; with
    the spread within recordings 1 718 flagged, 42 % of the V beats, 87 % of them V:
    ``bench/threshold_study.py``). One recording: the same threshold either way.

    Parameters
    ----------
    scores : array of positive floats
    k : float
        Number of robust standard deviations.
    recording : array of ints or names, optional
        The recording of each score.

    Returns
    -------
    float
    """
    s = np.log(np.maximum(np.asarray(scores, dtype=np.float64), 1e-12))
    med = np.median(s)
    if recording is None:
        dev = s - med
    else:
        if np.shape(recording) != s.shape:
            raise ValueError(f"{np.size(recording)} recording labels for {s.shape[0]} scores")
        _, which = np.unique(np.asarray(recording), return_inverse=True)
        which = which.reshape(-1)
        dev = np.empty_like(s)
        for r in range(int(which.max()) + 1 if which.size else 0):
            m = which == r
            dev[m] = s[m] - np.median(s[m])
    mad = 1.4826 * np.median(np.abs(dev))
    return float(np.exp(med + k * max(mad, 1e-6)))


def rank_order(score) -> np.ndarray:
    """Row numbers from the highest score down, ties in row order: the anomaly table's ranks 1, 2, ...
    (float32 scores, as the table keeps them)."""
    return np.argsort(-np.asarray(score, dtype=np.float32), kind="stable")


def top_order(score, n: int) -> np.ndarray:
    """``rank_order(score)[:n]`` without ranking every row: the ``n`` highest scores' rows, highest first, ties
    in row order. A partition finds the ``n``-th score; only the rows above it and its ties are sorted (97 k
    scores: about 1 ms where the whole ranking took 5-8)."""
    s = np.asarray(score, dtype=np.float32).reshape(-1)
    n = max(0, min(int(n), s.shape[0]))
    if n == 0:
        return np.zeros(0, np.int64)
    if 4 * n >= s.shape[0]:
        return rank_order(s)[:n]
    neg = -s
    cut = np.partition(neg, n - 1)[n - 1]  # (the n-th highest score, negated)
    if np.isnan(cut):  # (fewer than n numbers: NaNs come last, as in the whole ranking)
        return rank_order(s)[:n]
    rows = np.flatnonzero(neg <= cut)  # (every row above it and all its ties, in row order)
    return rows[np.argsort(neg[rows], kind="stable")][:n]


def anomaly_table(beat, recording, peak, start, length, score, fs: float, threshold: float, recording_names,
                  classes=None, timing: dict | None = None):
    """The per-beat table written to ``anomalies.parquet`` (one row per kept beat).

    Columns: ``beat`` (index among detected beats), ``recording``, ``start`` (sample in the
    recording), ``peak``, ``time_s``, ``length``, ``score``, ``flagged``, ``rank`` (1 = most
    anomalous); with ``classes`` and ``timing`` (:func:`beatflow.score.classes.classify`) also ``class``
    (N, S or V), ``rr_prev_s``, ``rr_next_s`` and ``prematurity``.
    """
    import pandas as pd

    score = np.asarray(score, dtype=np.float32)
    order = rank_order(score)
    rank = np.empty_like(order)
    rank[order] = np.arange(1, order.shape[0] + 1)
    # the recordings' names as codes into their sorted distinct names (what pd.Categorical of the names
    # per beat gives, without making and factorizing one string per beat: 7 of 18 ms for 97 k beats)
    names, code = np.unique(np.asarray(recording_names, dtype=str), return_inverse=True)
    return pd.DataFrame(
        {
            "beat": np.asarray(beat, dtype=np.int64),
            "recording": (pd.Categorical.from_codes(code.reshape(-1)[np.asarray(recording, dtype=np.int64)],
                                                    categories=names.astype(object))
                          if len(names) else []),
            "start": np.asarray(start, dtype=np.int64),
            "peak": np.asarray(peak, dtype=np.int64),
            "time_s": np.asarray(start, dtype=np.float64) / fs,
            "length": np.asarray(length, dtype=np.int32),
            "score": score,
            "flagged": score > threshold,
            "rank": rank.astype(np.int64),
            **({} if classes is None else {
                "class": pd.Categorical(np.asarray(classes, dtype=str), categories=list(CLASSES)),
                "rr_prev_s": np.asarray(timing["rr_prev_s"], dtype=np.float32),
                "rr_next_s": np.asarray(timing["rr_next_s"], dtype=np.float32),
                "prematurity": np.asarray(timing["prematurity"], dtype=np.float32)}),
        }
    )


def write_anomaly_table(table, path) -> None:
    """``table`` (:func:`anomaly_table`) as a Parquet file; dictionary encoding only for the recording names.

    Parquet's default dictionary-encodes every column, and for the table's columns of distinct numbers
    (beat, start, peak, time, rank) that was most of the writing: 35 ms of 97 k rows against 15 ms
    (pyarrow, 2 cores); the file reads back the same, the names still categorical.
    """
    table.to_parquet(path, index=False, use_dictionary=[c for c in ("recording", "class") if c in table])


def score_recording(x, fs: float, infer, scale: float, threshold: float, width: int, name: str = "recording",
                    params=None, second=None):
    """Segment, embed, score and class one whole recording with an already trained model.

    The model sees each row as :func:`model_input` makes it: divided by the model's scale, minus this
    recording's own dominant beat; the classes (:mod:`beatflow.score.classes`) judge each beat against this
    recording's own template and rhythm.

    Parameters
    ----------
    x : array, 1-D
        The recording.
    infer : callable
        ``infer(rows) -> (score, mu)``: an engine's ``infer``.
    scale, threshold, width : float, float, int
        From the trained model's metadata (``model.json``).
    second : array, 1-D, optional
        A second lead of the recording, as long as ``x``, that checks the beats
        (:func:`beatflow.detect.leads.second_lead_peaks`).

    Returns
    -------
    pandas.DataFrame
        The anomaly table of :func:`anomaly_table`.

    Raises
    ------
    InputError
        No beats, or a sampling rate that gives another row width than the model's.
    """
    from beatflow.embed import beat_rows
    from beatflow.errors import InputError
    from beatflow.params import SegmentParams
    from beatflow.detect import detect_peaks

    s = (params or SegmentParams()).samples(fs)
    if s.width != width:
        raise InputError(f"{name}: sampling rate {fs:g} Hz gives beat rows of {s.width} samples, "
                         f"the model was trained on {width}")
    peaks = detect_peaks(x, s)
    if second is not None:  # the second lead checks the beats (beatflow.detect.leads), as `beatflow run --confirm-lead`
        from beatflow.detect import second_lead_peaks

        if second.shape != x.shape:
            raise InputError(f"{name}: the second lead has {second.shape[0]} samples, the first {x.shape[0]}")
        peaks = second_lead_peaks(x, second, peaks, fs, s)[0]
    kb, peak, start, length, rows, _ = beat_rows(x, peaks, s, x.shape[0], baseline_samples=max(1, s.pre // 2))
    if kb.shape[0] == 0:
        raise InputError(f"{name}: no heartbeats found (flat line or no QRS-like peaks)")
    from beatflow.score.classes import classify, features, template

    rows = np.asarray(rows)
    dev = features(rows, template(rows, fs, s.pre), fs, s.pre)
    classes, timing = classify({0: np.asarray(peaks)}, peak, np.zeros(len(peak), np.int64), dev, fs)
    score, _ = infer(model_input(rows, scale))  # (the recording's own dominant beat)
    return anomaly_table(kb, np.zeros(kb.shape[0], np.int64), peak, start, length, score, fs, threshold, [name],
                         classes, timing)

"""Evaluation on annotated WFDB records (MIT-BIH): beat detection and inter-patient anomaly ranking.

``beatflow evaluate --train DIR --test DIR`` runs in-process (no Prefect, no Dask):

* every record is segmented with :func:`beatflow.detect.peaks.detect_peaks` (with ``--confirm-lead``, its
  peaks then checked on a second lead: :mod:`beatflow.detect.leads`); detection is scored against
  all reference beat annotations with a 150 ms tolerance (sensitivity, positive predictivity, F1,
  per record and gross), and so are three peers on the same signals, timed per record: NeuroKit2
  ``ecg_peaks`` (default method; after ``ecg_clean``, its documented use, and on the raw signal),
  WFDB ``processing.xqrs_detect`` and sleepecg ``detect_heartbeats``;
* the LightVAE is trained without labels on the beats of the ``--train`` records only (10 epochs,
  batch 1024), then the beats of the ``--test`` records are scored (reconstruction error; the model
  sees each beat as the pipeline makes it, :func:`beatflow.score.rule.model_input`: divided by the
  median peak-to-peak of the training beats, minus its record's dominant beat); detected
  beats matched to annotated ones carry the AAMI class of their annotation, and the score is ranked
  for V against N, S against N and F against N (ROC-AUC, PR-AUC), with PyOD IsolationForest and
  ECOD as baselines on the same beat matrices.

Training and test records must be disjoint (inter-patient evaluation).
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from beatflow.embed import embed
from beatflow.embed.beats import beats_from_peaks, kept_mask, row_lengths
from beatflow.errors import InputError
from beatflow.io.channels import parse_lead, pick_channel
from beatflow.score.metrics import TOLERANCE_S, Detection, match_beats, pr_auc, roc_auc
from beatflow.params import QualityParams, SegmentParams
from beatflow.score.rule import dominant_beat, input_scale, model_input, robust_threshold
from beatflow.detect import detect_peaks, quality_rule

#: annotation symbols of beats (all of them are reference beats for detection)
BEAT_SYMBOLS = "NLRBAaJSVrFejnE/fQ?"
#: AAMI EC57 classes of the beat symbols
AAMI_CLASSES = {"N": "NLRej", "S": "AaJS", "V": "VE", "F": "F", "Q": "/fQ"}
_SYMBOL_CLASS = {sym: cls for cls, syms in AAMI_CLASSES.items() for sym in syms}
#: the records of the MIT-BIH Arrhythmia Database with a pacemaker (AAMI: evaluated apart)
PACED_RECORDS = ("102", "104", "107", "217")


def aami_class(symbol: str) -> str | None:
    """AAMI class (``N``, ``S``, ``V``, ``F``, ``Q``) of a beat annotation symbol; None for non-beats.

    N: N L R e j (``B``, ``n`` and ``r`` are not in the AAMI table either and give None); S: A a J S;
    V: V E; F: F; Q: / f Q.
    """
    return _SYMBOL_CLASS.get(symbol)


@dataclass
class Record:
    """One annotated recording, one lead (and optionally a second lead that checks the first's beats)."""

    name: str
    fs: float
    signal: np.ndarray  # float32, physical units
    ann_sample: np.ndarray  # int64
    ann_symbol: np.ndarray  # str
    second: np.ndarray | None = None  # float32, the second lead (beatflow.detect.leads), as long as signal

    @property
    def beats(self) -> tuple[np.ndarray, np.ndarray]:
        """Reference beats: (sample, symbol) of the beat annotations."""
        m = np.isin(self.ann_symbol, list(BEAT_SYMBOLS))
        return self.ann_sample[m], self.ann_symbol[m]

    def vf_episodes(self) -> list[tuple[int, int]]:
        """``[start, end]`` samples of the ventricular flutter/fibrillation episodes (``[`` … ``]``)."""
        out, start = [], None
        for q, sym in zip(self.ann_sample, self.ann_symbol):
            if sym == "[":
                start = int(q)
            elif sym == "]" and start is not None:
                out.append((start, int(q)))
                start = None
        if start is not None:
            out.append((start, int(self.signal.shape[0])))
        return out


def list_records(folder, names: list[str] | None = None) -> list[str]:
    """Record paths (stems) in ``folder`` that have a header and ``.atr`` annotations.

    Raises
    ------
    InputError
        Missing folder, no annotated record, or a requested name that is not there.
    """
    p = Path(folder)
    if not p.is_dir():
        raise InputError(f"{p}: no such folder")
    have = {h.stem: str(h.with_suffix("")) for h in sorted(p.glob("*.hea")) if h.with_suffix(".atr").exists()}
    if not have:
        raise InputError(f"{p}: no WFDB records with .atr annotations in this folder")
    if names is None:
        return list(have.values())
    missing = [n for n in names if n not in have]
    if missing:
        raise InputError(f"{p}: no annotated record named {', '.join(missing)}")
    return [have[n] for n in names]


def load_record(stem: str, lead: int | str = 0, max_seconds: float | None = None,
                second: int | str | None = None) -> Record:
    """Read one lead (an index, or a signal name of the header) and the ``atr`` annotations of a WFDB
    record (optionally only its start), and the lead ``second`` as :attr:`Record.second` when given."""
    import wfdb

    try:
        hdr = wfdb.rdheader(stem)
        names = [str(n) for n in (hdr.sig_name or [])]
        leads = [pick_channel(f"{stem}.hea", names, c, option) if isinstance(c, str) else c
                 for c, option in ((lead, "--lead"), (second, "--confirm-lead")) if c is not None]
        for c in leads:
            if c < 0 or c >= (hdr.n_sig or 0):
                raise InputError(f"{stem}.hea: lead {c} does not exist (record has {hdr.n_sig} signals)")
        if second is not None and leads[1] == leads[0]:
            raise InputError(f"{stem}: the confirming lead must differ from lead {lead}")
        n = int(hdr.sig_len)
        if max_seconds is not None:
            n = min(n, int(round(max_seconds * hdr.fs)))
        rec = wfdb.rdrecord(stem, channels=leads, sampto=n)
        ann = wfdb.rdann(stem, "atr", sampto=n)
    except InputError:
        raise
    except Exception as e:  # wfdb raises many kinds
        raise InputError(f"{stem}: cannot read WFDB record ({type(e).__name__}: {e})".splitlines()[0]) from None
    sig = [np.asarray(rec.p_signal[:, k], dtype=np.float32) for k in range(len(leads))]
    for c, x in zip(leads, sig):
        if x.size == 0 or not np.isfinite(x).all():
            raise InputError(f"{stem}: lead {c} is empty or has non-finite samples")
    keep = np.asarray(ann.sample) < sig[0].shape[0]
    return Record(Path(stem).name, float(rec.fs), sig[0], np.asarray(ann.sample, np.int64)[keep],
                  np.asarray(ann.symbol, dtype=object)[keep].astype(str), sig[1] if second is not None else None)


# ---------------------------------------------------------------------------------------------
# detection

def detection_of(peaks, rec: Record, *, exclude_vf: bool = False) -> Detection:
    """Detection counts of ``peaks`` against the reference beats of ``rec`` (150 ms tolerance).

    ``exclude_vf`` drops detections inside ventricular flutter/fibrillation episodes, which carry
    no beat annotations (the convention of the AAMI beat-by-beat comparison).
    """
    peaks = np.asarray(peaks, dtype=np.int64)
    ref, _ = rec.beats
    if exclude_vf:
        for a, b in rec.vf_episodes():
            peaks = peaks[(peaks < a) | (peaks > b)]
            ref = ref[(ref < a) | (ref > b)]
    det, _ = match_beats(np.sort(peaks), ref, int(round(TOLERANCE_S * rec.fs)))
    return det


def _neurokit2(x, fs):
    import neurokit2 as nk

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = nk.ecg_peaks(nk.ecg_clean(x, sampling_rate=fs), sampling_rate=fs)
    return np.asarray(info["ECG_R_Peaks"], dtype=np.int64)


def _neurokit2_raw(x, fs):
    import neurokit2 as nk

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = nk.ecg_peaks(x, sampling_rate=fs)
    return np.asarray(info["ECG_R_Peaks"], dtype=np.int64)


def _xqrs(x, fs):
    from wfdb import processing

    return np.asarray(processing.xqrs_detect(np.asarray(x, np.float64), fs=fs, verbose=False), dtype=np.int64)


def _sleepecg(x, fs):
    import sleepecg

    return np.asarray(sleepecg.detect_heartbeats(np.asarray(x, np.float64), fs), dtype=np.int64)


#: peer detectors: name -> (description, function(signal, fs) -> peaks)
PEERS = {
    "neurokit2": ("NeuroKit2 ecg_peaks (default method) on ecg_clean output (its documented use)", _neurokit2),
    "neurokit2_raw": ("NeuroKit2 ecg_peaks (default method) on the raw signal", _neurokit2_raw),
    "xqrs": ("wfdb.processing.xqrs_detect (defaults)", _xqrs),
    "sleepecg": ("sleepecg.detect_heartbeats (its C backend, defaults)", _sleepecg),
}


#: the jitter that halves the JF-style score (Porr & Macfarlane, PLOS ONE 2024, take 10 ms)
JF_HALF_JITTER_MS = 10.0


def offsets_ms(peaks, rec: Record) -> np.ndarray:
    """Detected minus reference time (ms) of each beat matched within 150 ms."""
    ref, _ = rec.beats
    _, m = match_beats(np.sort(np.asarray(peaks, np.int64)), ref, int(round(TOLERANCE_S * rec.fs)))
    ok = m >= 0
    return (np.sort(np.asarray(peaks, np.int64))[m[ok]] - ref[ok]) * 1000.0 / rec.fs


def jf_score(f1: float, jitter_ms: float) -> float:
    """A JF-style score in the manner of Porr & Macfarlane (PLOS ONE 2024): the F1 score times a jitter term
    ``1 / (1 + jitter / 10 ms)`` (1 for no jitter, 1/2 at 10 ms). Their jitter comes from interval
    differences on their own database; here ``jitter`` is :func:`offsets_ms`' median absolute value."""
    return float(f1) / (1.0 + float(jitter_ms) / JF_HALF_JITTER_MS)


def _det_dict(det: Detection) -> dict:
    return {"tp": det.tp, "fp": det.fp, "fn": det.fn, "se": det.se, "ppv": det.ppv, "f1": det.f1}


def detection_summary(peaks_of: dict, seconds_of: dict, records: list[Record],
                      unreadable_of: dict | None = None) -> dict:
    """Gross and per-record detection (plus gross with VF episodes excluded) of one detector; with
    ``unreadable_of`` (record name -> seconds its detection left out as unreadable), those seconds too."""
    per, gross, gross_vf = {}, Detection(0, 0, 0), Detection(0, 0, 0)
    for rec in records:
        d = detection_of(peaks_of[rec.name], rec)
        gross = gross + d
        gross_vf = gross_vf + detection_of(peaks_of[rec.name], rec, exclude_vf=True)
        per[rec.name] = {**_det_dict(d), "s": seconds_of[rec.name]}
        if unreadable_of is not None:
            per[rec.name]["unreadable_s"] = float(unreadable_of[rec.name])
    total_s = float(sum(seconds_of[r.name] for r in records))
    off = np.concatenate([offsets_ms(peaks_of[r.name], r) for r in records]) if records else np.zeros(0)
    jitter = float(np.median(np.abs(off))) if len(off) else float("nan")
    out = {**_det_dict(gross), "jitter_ms": jitter, "offset_ms": float(np.median(off)) if len(off) else None,
           "jf": jf_score(gross.f1, jitter), "s_per_record": total_s / max(1, len(records)), "s_total": total_s,
           "excluding_vf": _det_dict(gross_vf), "per_record": per}
    if unreadable_of is not None:
        out["unreadable_s"] = float(sum(unreadable_of[r.name] for r in records))
    return out


# ---------------------------------------------------------------------------------------------
# beats and anomaly ranking

@dataclass
class RecordBeats:
    """Detection and beat rows of one record: the kept beats (as the pipeline scores them), and all
    detected beats (longer ones cut to the row)."""

    peaks: np.ndarray  # all detected peaks (outside the unreadable stretches)
    seconds: float  # time of detect_peaks (and of the second lead's check, and of the quality rule)
    kept_peak: np.ndarray  # peaks of the kept beats (one per row)
    rows: np.ndarray  # (n, width) float32, not scaled
    p2p: np.ndarray  # (n,) peak-to-peak of each row
    label: np.ndarray  # AAMI class of each kept beat, "" if unmatched
    all_rows: np.ndarray  # (m, width): every beat of beats_from_peaks, cut to `upper` samples
    all_label: np.ndarray
    unreadable: np.ndarray | None = None  # (k, 2) [start, end) samples left out as unreadable
    unreadable_s: float = 0.0  # their seconds


def record_beats(rec: Record, params: SegmentParams | None = None, second_params=None,
                 quality: QualityParams | None = QualityParams()) -> RecordBeats:
    """Segment a record and embed its beats exactly as the pipeline does (no scaling yet); with a
    second lead (:attr:`Record.second`) the peaks are checked on it (:func:`beatflow.detect.leads.second_lead_peaks`,
    ``second_params`` or the defaults); the peaks in unreadable stretches are dropped
    (:func:`beatflow.detect.quality_rule` with ``quality``; None: not).

    The pipeline keeps beats of at least ``min_length_s``, a beat longer than ``max_length_s`` (a
    premature beat followed by a long compensatory pause) with its row cut to that length; with
    ``cut_long=False`` it prunes them as the seed does. ``all_rows`` holds every beat, cut the same
    way, for the evaluation of all detected beats.
    """
    s = (params or SegmentParams()).samples(rec.fs)
    t = time.perf_counter()
    peaks = np.asarray(detect_peaks(rec.signal, s))
    if rec.second is not None:
        from beatflow.detect import SecondLeadParams, second_lead_peaks

        peaks = second_lead_peaks(rec.signal, rec.second, peaks, rec.fs, s, second_params or SecondLeadParams())[0]
    spans = np.zeros((0, 2), np.int64)
    if quality is not None:
        keep, spans, _ = quality_rule(rec.signal, peaks, 0, quality.samples(rec.fs))
        peaks = peaks[keep]
    seconds = time.perf_counter() - t
    peak, start, length = beats_from_peaks(peaks, s, rec.signal.shape[0])
    kept = kept_mask(length, s)
    base = max(1, s.pre // 2)
    rows, p2p = embed(rec.signal, start[kept], row_lengths(length[kept], s), s.width, baseline_samples=base)
    all_rows, _ = embed(rec.signal, start, row_lengths(length, s), s.width, baseline_samples=base)
    return RecordBeats(peaks, seconds, peak[kept], np.asarray(rows), np.asarray(p2p), beat_labels(peak[kept], rec),
                       np.asarray(all_rows), beat_labels(peak, rec), np.asarray(spans),
                       float((spans[:, 1] - spans[:, 0]).sum()) / rec.fs)


def beat_labels(peaks, rec: Record) -> np.ndarray:
    """AAMI class of each beat matched (150 ms) to a reference beat; ``""`` if unmatched or unclassed."""
    ref, sym = rec.beats
    _, match = match_beats(np.asarray(peaks), ref, int(round(TOLERANCE_S * rec.fs)))
    out = np.full(len(peaks), "", dtype="<U1")
    ok = match >= 0
    out[match[ok]] = [aami_class(y) or "" for y in sym[ok]]
    return out


def model_inputs(beats: list[RecordBeats], scale: float | None = None, which: str = "rows") -> np.ndarray:
    """The VAE's input for each record, concatenated (:func:`beatflow.score.rule.model_input`): rows
    (``rows`` or ``all_rows``) divided by ``scale`` (None: the median peak-to-peak of the record's own
    kept beats), minus the record's dominant beat (of its scaled kept rows)."""
    if not beats:
        raise InputError("no beats to evaluate")
    out = []
    for b in beats:
        k = input_scale(b.p2p) if scale is None else scale
        out.append(model_input(getattr(b, which), k, dominant_beat(b.rows, k)))
    return np.concatenate(out)


def scaled_rows(beats: list[RecordBeats], how: str, which: str = "rows") -> tuple[np.ndarray, float]:
    """:func:`model_inputs` with the scale of all of ``beats`` (``pooled``, the flow's rule: returned), or of
    each record (``record``; NaN returned)."""
    if not beats:
        raise InputError("no beats to evaluate")
    if how == "record":
        return model_inputs(beats, None, which), float("nan")
    scale = input_scale(np.concatenate([b.p2p for b in beats]))
    return model_inputs(beats, scale, which), scale


def class_metrics(assigned, labels) -> dict:
    """The gross AAMI per-class sensitivity and positive predictivity of the assigned classes (the de Chazal
    protocol's): over the kept beats matched to a reference beat of an AAMI class, ``se`` = right / reference
    beats of the class, ``ppv`` = right / beats assigned it, ``n`` = reference beats of the class, ``assigned``."""
    assigned, labels = np.asarray(assigned), np.asarray(labels)
    lab = np.isin(labels, list(AAMI_CLASSES))
    out = {}
    for c in ("N", "S", "V", "F", "Q"):
        ref, got = (labels == c), (assigned == c) & lab
        tp = int((ref & got).sum())
        out[c] = {"se": tp / int(ref.sum()) if ref.any() else None, "ppv": tp / int(got.sum()) if got.any() else None,
                  "n": int(ref.sum()), "assigned": int(got.sum())}
    return out


def record_classes(rec: Record, b: RecordBeats, params: SegmentParams | None = None) -> np.ndarray:
    """The class of each kept beat of a record (:mod:`beatflow.score.classes`, against the record's own
    template, rhythm and P wave, as the flow classes a recording)."""
    from beatflow.score.classes import classify, features, pre_qrs, template

    pre = (params or SegmentParams()).samples(rec.fs).pre
    dev = features(b.rows, template(b.rows, rec.fs, pre), rec.fs, pre)
    shape = np.concatenate([np.asarray(dev), pre_qrs(rec.signal, 0, b.kept_peak, rec.fs)], axis=1)
    return classify({0: b.peaks}, b.kept_peak, np.zeros(len(b.kept_peak), np.int64), shape, rec.fs)[0]


def anomaly_metrics(scores, labels) -> dict:
    """ROC-AUC and PR-AUC of ``scores`` for V, S and F against N (AAMI classes in ``labels``)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    out = {}
    for cls in ("V", "S", "F"):
        m = (labels == cls) | (labels == "N")
        out[f"auc_{cls.lower()}"] = roc_auc(scores[m], labels[m] == cls)
        out[f"prauc_{cls.lower()}"] = pr_auc(scores[m], labels[m] == cls)
    out["counts"] = {c: int((labels == c).sum()) for c in AAMI_CLASSES}
    return out


def flag_metrics(scores, labels, threshold: float) -> dict:
    """The beats above ``threshold`` against the AAMI classes: how many, the share of the V beats
    flagged (``v_recall``), the share of flagged beats that are V (``v_precision``) or of any
    labelled class but N (``not_n_precision``, over the flagged beats matched to a reference beat),
    and the share of N beats flagged."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    flag = scores > threshold
    labelled = flag & np.isin(labels, list(AAMI_CLASSES))
    v, n = labels == "V", labels == "N"
    return {"threshold": float(threshold), "flagged": int(flag.sum()),
            "v_recall": float((flag & v).sum() / v.sum()) if v.any() else None,
            "v_precision": float((flag & v).sum() / flag.sum()) if flag.any() else None,
            "not_n_precision": float((labelled & ~n).sum() / labelled.sum()) if labelled.any() else None,
            "n_flagged": float((flag & n).sum() / n.sum()) if n.any() else None}


def baseline_scores(train_rows, test_sets: list, seed: int = 0) -> dict:
    """PyOD detectors fitted on the training rows; ``name -> ([scores of each test set], seconds)``
    (higher = more anomalous)."""
    from pyod.models.ecod import ECOD
    from pyod.models.iforest import IForest

    models = {"isolation_forest": IForest(random_state=seed, n_jobs=1), "ecod": ECOD()}
    out = {}
    for name, m in models.items():
        t = time.perf_counter()
        m.fit(train_rows)
        out[name] = ([np.asarray(m.decision_function(x), np.float64) for x in test_sets], time.perf_counter() - t)
    return out


# ---------------------------------------------------------------------------------------------
# the whole evaluation

_WARM: set = set()


def _warm_up(records: list[Record], params, peers: bool) -> None:
    """Run each detector once on a few seconds, so that per-record times exclude imports and JIT."""
    rec = records[0]
    x = rec.signal[: int(10 * rec.fs)]
    todo = [("beatflow", lambda: detect_peaks(x, (params or SegmentParams()).samples(rec.fs)))]
    if peers:
        todo += [(name, lambda fn=fn: fn(x, rec.fs)) for name, (_, fn) in PEERS.items()]
    for name, run in todo:
        if name not in _WARM:
            try:
                run()
            except Exception:  # a few seconds may be too short for a peer; the real run will tell
                pass
            _WARM.add(name)

def _clean(v):
    """JSON-safe: NaN/inf -> None, NumPy scalars -> Python."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return v if math.isfinite(v) else None
    return v


def check_disjoint(train: list[str], test: list[str]) -> None:
    """Refuse overlapping record names (the evaluation is inter-patient)."""
    both = sorted(set(train) & set(test))
    if both:
        raise InputError(f"training and test records overlap ({', '.join(both)}): "
                         "the evaluation is inter-patient, give disjoint records")


def evaluate(train: list[Record], test: list[Record], *, epochs: int = 10, batch_size: int = 1024, seed: int = 0,
             peers: bool = True, baselines: bool = True, scale: str = "pooled", params: SegmentParams | None = None,
             cache: dict | None = None, log=None, second_params=None) -> dict:
    """Detection on the test records, and anomaly ranking by a LightVAE trained on the training records.

    Parameters
    ----------
    train, test : lists of Record
        Disjoint by name.
    epochs, batch_size, seed
        LightVAE training (:func:`beatflow.model.train.train_vae`).
    peers, baselines : bool
        Also run the peer detectors (NeuroKit2, XQRS) and the PyOD baselines (on the first lead).
    scale : ``"pooled"`` or ``"record"``
        Rows are divided by the median peak-to-peak of all training rows, test rows too (default: the
        flow's rule, where a model has one scale, that of its training rows: :mod:`beatflow.score.rule`),
        or by that of their own record (``record``: a study of the scale, not what the flow does).
    cache : dict, optional
        ``name -> RecordBeats`` reused across calls (cross-validation segments each record once).
    log : callable, optional
        Progress lines.
    second_params : beatflow.detect.leads.SecondLeadParams, optional
        The second lead's rules, for records that carry one (default parameters).

    Returns
    -------
    dict (JSON-ready)
    """
    import torch

    from beatflow.model.train import train_vae
    from beatflow.model.vae import score_beats

    log = log or (lambda *_: None)
    check_disjoint([r.name for r in train], [r.name for r in test])
    if not train or not test:
        raise InputError("need at least one training and one test record")
    cache = {} if cache is None else cache
    timings = {}

    t0 = time.perf_counter()
    _warm_up(train + test, params, peers)
    for rec in train + test:
        if rec.name not in cache:
            cache[rec.name] = record_beats(rec, params, second_params)
            log(f"segmented {rec.name}: {len(cache[rec.name].peaks)} peaks in {cache[rec.name].seconds:.2f} s")
    timings["segment_and_embed"] = time.perf_counter() - t0
    tr = [cache[r.name] for r in train]
    te = [cache[r.name] for r in test]

    result = {
        "records": {"train": [r.name for r in train], "test": [r.name for r in test]},
        "fs": sorted({r.fs for r in train + test}),
        "tolerance_s": TOLERANCE_S,
        "params": (params or SegmentParams()).to_dict(),
        "detection": detection_summary({r.name: cache[r.name].peaks for r in test},
                                       {r.name: cache[r.name].seconds for r in test}, test,
                                       {r.name: cache[r.name].unreadable_s for r in test}),
        "quality": QualityParams().to_dict(),
    }

    # anomaly ranking: the VAE is trained on the kept beats of the training records
    x_train, train_scale = scaled_rows(tr, scale)
    if scale == "pooled":
        x_test, x_all = (model_inputs(te, train_scale, w) for w in ("rows", "all_rows"))
    else:
        x_test, _ = scaled_rows(te, scale)
        x_all, _ = scaled_rows(te, scale, "all_rows")
    labels = np.concatenate([b.label for b in te])
    labels_all = np.concatenate([b.all_label for b in te])
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t = time.perf_counter()
    res = train_vae(x_train, epochs=epochs, batch_size=batch_size, seed=seed)
    timings["train_vae"] = time.perf_counter() - t
    log(f"trained LightVAE on {len(x_train)} beats in {timings['train_vae']:.1f} s")
    t = time.perf_counter()
    scores, _ = score_beats(res.model, x_test)
    scores_all, _ = score_beats(res.model, x_all)
    timings["score"] = time.perf_counter() - t
    ref_counts = {c: 0 for c in AAMI_CLASSES}
    for rec in test:
        for y in rec.beats[1]:
            c = aami_class(y)
            if c:
                ref_counts[c] += 1
    # the threshold the trained model carries (the flow's model.json: robust_threshold of its training
    # records' scores), as `beatflow score` applies it to new recordings
    train_records = np.concatenate([[r.name] * len(b.label) for r, b in zip(train, tr)])
    threshold = robust_threshold(score_beats(res.model, x_train)[0], recording=train_records)
    result["anomaly"] = {**anomaly_metrics(scores, labels), "reference_counts": ref_counts,
                         "flagged": flag_metrics(scores, labels, threshold),
                         "score": "LightVAE reconstruction MSE of the beat minus its record's dominant beat",
                         "scale": scale, "beats_scored": int(len(x_test)),
                         "beats": "kept beats (as the pipeline scores them)"}
    assigned = np.concatenate([record_classes(r, b, params) for r, b in zip(test, te)])
    result["classes"] = class_metrics(assigned, labels)
    result["anomaly_all_beats"] = {**anomaly_metrics(scores_all, labels_all), "beats_scored": int(len(x_all)),
                                   "beats": "all detected beats, longer ones cut to the row"}
    result["training"] = {"beats": int(len(x_train)), "epochs": epochs, "batch_size": batch_size, "seed": seed,
                          "scale": scale, "pooled_scale": train_scale, "train_loss": res.train_loss,
                          "held_out_loss": res.test_loss, "seconds": res.seconds}

    if baselines:
        t = time.perf_counter()
        bl = baseline_scores(x_train, [x_test, x_all], seed)
        result["baselines"] = {name: {**anomaly_metrics(sc[0], labels), "seconds": sec}
                               for name, (sc, sec) in bl.items()}
        result["baselines_all_beats"] = {name: anomaly_metrics(sc[1], labels_all) for name, (sc, _) in bl.items()}
        timings["baselines"] = time.perf_counter() - t
        log(f"baselines in {timings['baselines']:.1f} s")

    if peers:
        result["peers"] = {}
        for name, (desc, fn) in PEERS.items():
            pk, sec = {}, {}
            for rec in test:
                t = time.perf_counter()
                pk[rec.name] = fn(rec.signal, rec.fs)
                sec[rec.name] = time.perf_counter() - t
            result["peers"][name] = {"method": desc, **detection_summary(pk, sec, test)}
            log(f"peer {name}: {result['peers'][name]['s_total']:.1f} s")
    result["timings_s"] = timings
    return _clean(result)


# ---------------------------------------------------------------------------------------------
# command line

def _names(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [n.strip() for n in arg.split(",") if n.strip()]
    if not names:
        raise InputError(f"empty record list {arg!r}")
    return names


def register(sub) -> dict:
    """Add the ``evaluate`` subcommand to the CLI's subparsers; returns ``{"evaluate": handler}``."""
    p = sub.add_parser("evaluate", help="beat detection and inter-patient anomaly metrics on annotated WFDB records")
    p.add_argument("--train", required=True, help="folder of WFDB records (.hea/.dat/.atr) to train the VAE on")
    p.add_argument("--test", required=True, help="folder of WFDB records to segment and score (disjoint from --train)")
    p.add_argument("--train-records", help="comma-separated record names within --train (default: all)")
    p.add_argument("--test-records", help="comma-separated record names within --test (default: all)")
    p.add_argument("--lead", type=parse_lead, default=0, metavar="N|LABEL",
                   help="WFDB channel: its index or its signal name, e.g. MLII (default 0)")
    p.add_argument("--confirm-lead", type=parse_lead, metavar="N|LABEL",
                   help="a second WFDB channel (index or signal name) that checks the first one's beats "
                        "(beatflow.detect.leads: flutter on either lead, peaks with no QRS on the second lead dropped, "
                        "misplaced ones moved)")
    p.add_argument("--out", help="write the metrics to this JSON file")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="seed of the VAE training and of the baselines")
    p.add_argument("--scale", choices=("pooled", "record"), default="pooled",
                   help="divide beats by the training beats' median peak-to-peak (default, as the flow does) or by "
                        "their own record's")
    p.add_argument("--max-seconds", type=float, help="use only the first seconds of each record (quick checks)")
    p.add_argument("--no-peers", action="store_true", help="skip NeuroKit2 and XQRS")
    p.add_argument("--no-baselines", action="store_true", help="skip the PyOD baselines")
    p.add_argument("--quiet", action="store_true")
    return {"evaluate": cmd_evaluate}


def cmd_evaluate(args) -> int:
    """Handler of ``beatflow evaluate``."""
    for name in ("epochs", "batch_size", "max_seconds"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if isinstance(args.lead, int) and args.lead < 0:
        raise InputError(f"--lead must be >= 0, got {args.lead}")
    if args.confirm_lead is not None and ((isinstance(args.confirm_lead, int) and args.confirm_lead < 0)
                                          or args.confirm_lead == args.lead):
        raise InputError(f"--confirm-lead must be >= 0 and differ from --lead, got {args.confirm_lead}")
    train_paths = list_records(args.train, _names(args.train_records))
    test_paths = list_records(args.test, _names(args.test_records))
    check_disjoint([Path(p).name for p in train_paths], [Path(p).name for p in test_paths])
    if args.out:
        out_dir = Path(args.out).resolve().parent
        if not out_dir.is_dir():
            raise InputError(f"--out {args.out}: folder {out_dir} does not exist")
    say = (lambda *_: None) if args.quiet else (lambda m: print(m, flush=True))
    train = [load_record(p, args.lead, args.max_seconds, args.confirm_lead) for p in train_paths]
    test = [load_record(p, args.lead, args.max_seconds, args.confirm_lead) for p in test_paths]
    res = evaluate(train, test, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                   peers=not args.no_peers, baselines=not args.no_baselines, scale=args.scale, log=say)
    res["lead"] = args.lead
    if args.confirm_lead is not None:
        from beatflow.detect.leads import SecondLeadParams

        res["confirm_lead"] = {"lead": args.confirm_lead, "params": SecondLeadParams().to_dict()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(summary_text(res))
    return 0


def _pct(v) -> str:
    return "  -   " if v is None else f"{100 * v:6.2f}"


def _auc(v) -> str:
    return "  -  " if v is None else f"{v:.3f}"


def summary_text(res: dict) -> str:
    """A short plain-text table of a result of :func:`evaluate`."""
    lines = [f"test records: {' '.join(res['records']['test'])}",
             f"train records: {' '.join(res['records']['train'])}",
             "detection (gross, 150 ms)       Se %    PPV %   F1 %   s/record   (VF excluded: Se %  PPV %)"]
    rows = [("beatflow", res["detection"])] + list((res.get("peers") or {}).items())
    for name, d in rows:
        v = d["excluding_vf"]
        lines.append(f"  {name:<28} {_pct(d['se'])}  {_pct(d['ppv'])}  {_pct(d['f1'])}  {d['s_per_record']:8.3f}"
                     f"       {_pct(v['se'])} {_pct(v['ppv'])}   jitter {d['jitter_ms']:.1f} ms, JF {_pct(d['jf'])}")
    if "classes" in res:
        lines.append("classes (gross, kept beats matched to an AAMI beat)   Se %    +P %   reference  assigned")
        for c, m in res["classes"].items():
            lines.append(f"  {c:<52} {_pct(m['se'])}  {_pct(m['ppv'])}   {m['n']:9d}  {m['assigned']:8d}")
    if res["detection"].get("unreadable_s") is not None:
        lines.append(f"  beatflow left out {res['detection']['unreadable_s']:.0f} s as unreadable "
                     "(beatflow.detect.quality)")
    for title, key, bkey in (("kept beats", "anomaly", "baselines"),
                             ("all detected beats", "anomaly_all_beats", "baselines_all_beats")):
        if key not in res:
            continue
        lines.append(f"anomaly, {title:<20}   V-vs-N ROC/PR    S-vs-N ROC/PR    F-vs-N ROC/PR")
        arows = [("beatflow LightVAE", res[key])] + list((res.get(bkey) or {}).items())
        for name, a in arows:
            lines.append(f"  {name:<28} {_auc(a['auc_v'])} / {_auc(a['prauc_v'])}   {_auc(a['auc_s'])} / "
                         f"{_auc(a['prauc_s'])}   {_auc(a['auc_f'])} / {_auc(a['prauc_f'])}")
        c = res[key]["counts"]
        lines.append(f"  scored beats by class: N {c['N']}  S {c['S']}  V {c['V']}  F {c['F']}  Q {c['Q']}")
    f = res["anomaly"].get("flagged")
    if f:
        lines.append(f"  flagged (score > {f['threshold']:.4g}): {f['flagged']} beats, {_pct(f['v_recall'])} % of the V "
                     f"beats; {_pct(f['v_precision'])} % of them V, {_pct(f['not_n_precision'])} % not N")
    r = res["anomaly"].get("reference_counts")
    if r:
        lines.append(f"  reference beats by class: N {r['N']}  S {r['S']}  V {r['V']}  F {r['F']}  Q {r['Q']}")
    return "\n".join(lines)

"""Evaluation against reference beats: detection (Se, PPV, F1), anomaly ranking (ROC/PR-AUC), and the
checks against a synthetic truth (:mod:`beatflow.io.synth`'s ``truth.npz``).

The synthetic truth's checks: :func:`match_truth` (detection, and the truth beat matched to each kept
beat), :func:`truth_check` (the anomaly scores' ROC-AUCs), :func:`truth_classes` (assigned beat classes
against the truth's) and :func:`truth_quality` (found unreadable spans against the truth's episodes).
The truth's labels are beat classes: 0 normal (N), 1 PVC (V), 3 APC (S); 2 is an artifact over a normal
beat, no class. Truth beats inside the truth's unreadable episodes (noise, lead-off, clipping) are kept
apart: they count in no detection figure, no AUC and no class figure.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from beatflow.io.synth import AAMI_CLASS

#: matching tolerance between detected and reference beats (150 ms, the AAMI convention)
TOLERANCE_S = 0.15
#: the beat classes that :func:`truth_classes` scores (AAMI N, S, V) and those it accepts
SCORED_CLASSES = ("N", "S", "V")
BEAT_CLASSES = ("N", "S", "V", "F", "Q")


@dataclass
class Detection:
    """Counts and rates of a beat detection against reference beats."""

    tp: int
    fp: int
    fn: int

    @property
    def se(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else float("nan")

    @property
    def ppv(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else float("nan")

    @property
    def f1(self) -> float:
        d = 2 * self.tp + self.fp + self.fn
        return 2 * self.tp / d if d else float("nan")

    def __add__(self, other: "Detection") -> "Detection":
        return Detection(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn)

    def to_dict(self) -> dict:
        return {**asdict(self), "se": self.se, "ppv": self.ppv, "f1": self.f1}


def match_beats(detected, reference, tolerance: int):
    """One-to-one matching of detected to reference beat positions within ``tolerance`` samples.

    Reference beats are taken in order, each matched to the earliest detection not yet taken that
    lies within its ``±tolerance`` window. All windows have the same width, so sorting by position
    sorts them by their right end, and this greedy choice gives a maximum matching.

    Parameters
    ----------
    detected, reference : 1-D int arrays (sorted)
    tolerance : int
        Largest |detected − reference| for a match (e.g. 150 ms in samples).

    Returns
    -------
    (Detection, match) : match[i] is the index in ``detected`` matched to ``reference[i]``, or -1.
    """
    d = np.asarray(detected, dtype=np.int64).tolist()  # Python ints: the walk is 10x faster than on
    r = np.asarray(reference, dtype=np.int64).tolist()  # NumPy scalars (0.1 s per 100 000 beats)
    out = [-1] * len(r)
    j, nd = 0, len(d)
    for i, ri in enumerate(r):
        lo = ri - tolerance
        while j < nd and d[j] < lo:
            j += 1
        if j < nd and d[j] <= ri + tolerance:
            out[i] = j
            j += 1
    match = np.asarray(out, dtype=np.int64)
    tp = int((match >= 0).sum())
    return Detection(tp=tp, fp=int(nd - tp), fn=int(len(r) - tp)), match


def roc_auc(scores, positive) -> float:
    """ROC-AUC of ``scores`` for the boolean ``positive`` labels (NaN if one class is missing).

    The Mann-Whitney statistic: the mean rank of the positives, ties sharing their average rank
    (a tie between a positive and a negative counts one half), as ``sklearn.metrics.roc_auc_score``;
    NumPy only, so that the flow's process need not import scikit-learn (a second of a warm run)."""
    positive = np.asarray(positive, dtype=bool).reshape(-1)
    if positive.all() or not positive.any():
        return float("nan")
    x = np.asarray(scores, dtype=np.float64).reshape(-1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # average 1-based rank of each value's ties
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def pr_auc(scores, positive) -> float:
    """Average precision (PR-AUC) of ``scores`` for ``positive`` (NaN if one class is missing)."""
    from sklearn.metrics import average_precision_score

    positive = np.asarray(positive, dtype=bool)
    if positive.all() or not positive.any():
        return float("nan")
    return float(average_precision_score(positive, np.asarray(scores)))


def merge_spans(spans) -> np.ndarray:
    """``[start, end)`` spans (any order, overlapping or touching) as their union: sorted, apart,
    non-empty, int64 ``(k, 2)``."""
    x = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    x = x[x[:, 1] > x[:, 0]]
    if x.shape[0] == 0:
        return x
    x = x[np.argsort(x[:, 0], kind="stable")]
    end = np.maximum.accumulate(x[:, 1])
    new = np.r_[True, x[1:, 0] > end[:-1]]  # a span that starts past every earlier end opens a group
    first = np.flatnonzero(new)
    last = np.r_[first[1:], x.shape[0]] - 1
    return np.stack([x[first, 0], end[last]], axis=1)


def in_spans(x, spans) -> np.ndarray:
    """Whether each sample index of ``x`` lies in one of ``spans`` (``[start, end)``, any order)."""
    u = merge_spans(spans)
    x = np.asarray(x, dtype=np.int64)
    if u.shape[0] == 0:
        return np.zeros(x.shape, bool)
    k = np.searchsorted(u[:, 0], x, side="right") - 1
    return (k >= 0) & (x < u[np.maximum(k, 0), 1])


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Samples each span of ``a`` shares with the union ``b`` (both ``(k, 2)``; ``b`` merged)."""
    if a.shape[0] == 0 or b.shape[0] == 0:
        return np.zeros(a.shape[0], np.int64)
    lo = np.maximum(a[:, None, 0], b[None, :, 0])
    hi = np.minimum(a[:, None, 1], b[None, :, 1])
    return np.clip(hi - lo, 0, None).sum(axis=1)


def match_truth(truth_path: str, peaks, kept_peaks, fs: float) -> dict:
    """Detection against a synthetic truth file (``.npz`` with ``r_peaks`` and ``labels``, and, where
    the truth has them, the unreadable episodes ``unreadable``, ``unreadable_reason`` and
    ``beat_unreadable``): the part of the flow's truth check that needs no scores.

    Se, PPV and F1 of ``peaks`` at 150 ms count only the truth beats and the peaks outside the truth's
    unreadable spans widened by the tolerance on each side (``detection_scope`` says so;
    ``excluded_beats`` and ``excluded_peaks`` count those left out): a beat under noise or a lead-off
    is no test of the detector, nor is a peak found there. Every truth beat, those under the spans
    included, is matched to ``kept_peaks`` for the class and score checks.
    (A light module: the flow runs this in its figure processes while the cluster trains.)

    Returns
    -------
    dict
        ``se``, ``ppv``, ``f1``, ``detection_scope``, ``excluded_beats``, ``excluded_peaks``;
        ``matched`` (int64 per truth beat: the index of the kept beat matched to it, -1 for none),
        ``labels`` (the truth's labels per truth beat), ``beat_unreadable`` (bool per truth beat),
        ``kept_labels`` (int8 per kept beat: the label of the truth beat matched to it, -1 for none),
        ``kept_unreadable`` (bool per kept beat: matched to a truth beat under an unreadable span),
        ``unreadable`` (int64 ``(m, 2)``: the truth's ``[start, end)`` episodes), ``unreadable_reason``
        (a string per episode) and ``fs``."""
    with np.load(truth_path) as t:
        r_peaks, labels = t["r_peaks"], t["labels"]
        spans = t["unreadable"].astype(np.int64).reshape(-1, 2) if "unreadable" in t.files else np.zeros((0, 2), np.int64)
        reasons = t["unreadable_reason"].astype(str) if "unreadable_reason" in t.files else np.zeros(0, "<U8")
        unread = t["beat_unreadable"].astype(bool) if "beat_unreadable" in t.files else in_spans(r_peaks, spans)
    tol = int(round(TOLERANCE_S * fs))
    peaks = np.asarray(peaks, dtype=np.int64)
    kept_peaks = np.asarray(kept_peaks, dtype=np.int64)
    guard = spans + np.array([-tol, tol])
    ref_out, det_out = in_spans(r_peaks, guard), in_spans(peaks, guard)
    det, _ = match_beats(peaks[~det_out], r_peaks[~ref_out], tol)
    _, m = match_beats(kept_peaks, r_peaks, tol)
    kept_labels = np.full(kept_peaks.shape[0], -1, np.int8)
    kept_labels[m[m >= 0]] = labels[m >= 0]
    kept_unreadable = np.zeros(kept_peaks.shape[0], bool)
    kept_unreadable[m[m >= 0]] = unread[m >= 0]
    return {"se": det.se, "ppv": det.ppv, "f1": det.f1,
            "detection_scope": f"truth beats and peaks outside the truth's unreadable spans widened by "
                               f"{TOLERANCE_S * 1000:g} ms",
            "excluded_beats": int(ref_out.sum()), "excluded_peaks": int(det_out.sum()),
            "matched": m, "labels": labels, "beat_unreadable": unread, "kept_labels": kept_labels,
            "kept_unreadable": kept_unreadable, "unreadable": spans, "unreadable_reason": reasons, "fs": float(fs)}


def _readable_matched(matched: dict):
    """The truth beats matched to a kept beat outside the unreadable episodes: (their kept indices,
    their labels), and the mask over the truth beats."""
    m, labels = np.asarray(matched["matched"]), np.asarray(matched["labels"])
    unread = np.asarray(matched.get("beat_unreadable", np.zeros(m.shape[0], bool)), bool)
    ok = (m >= 0) & ~unread
    return m[ok], labels[ok], ok


def truth_check(matched: dict, kept_scores) -> dict:
    """The flow's check against a synthetic truth, once the beats are scored: detection (Se, PPV and F1
    from :func:`match_truth`'s ``matched``, with its ``detection_scope``, ``excluded_beats`` and
    ``excluded_peaks`` where it has them) and the ROC-AUCs of the kept beats' scores over the truth
    beats matched to a kept beat outside the unreadable episodes.

    ``auc``: beats of an abnormal shape (PVCs, artifacts) against normal beats; ``auc_pvc``: PVCs
    against normal beats; ``auc_apc``: APCs against normal beats (an APC has the patient's usual QRS,
    so a shape score is not expected to rank it high); ``auc_any``: every label > 0 against normal
    beats. Counts: ``true_beats``, ``abnormal`` (truth beats of a label > 0), ``abnormal_scored``
    (those matched and readable), ``classes`` (truth beats per class and artifacts),
    ``unreadable_beats``, ``unreadable_episodes`` and ``unreadable_s`` (the truth's).
    (A light module: the flow runs this in a figure process while it goes on.)"""
    all_labels = np.asarray(matched["labels"])
    kept, labels, _ = _readable_matched(matched)
    s = np.asarray(kept_scores)[kept]
    auc = lambda pos, neg: roc_auc(s[pos | neg], pos[pos | neg])  # noqa: E731
    normal = labels == 0
    spans = np.asarray(matched.get("unreadable", np.zeros((0, 2), np.int64))).reshape(-1, 2)
    fs = matched.get("fs")
    scope = {k: matched[k] for k in ("detection_scope", "excluded_beats", "excluded_peaks") if k in matched}
    return {"se": matched["se"], "ppv": matched["ppv"], "f1": matched["f1"], **scope,
            "auc": auc((labels == 1) | (labels == 2), normal), "auc_pvc": auc(labels == 1, normal),
            "auc_apc": auc(labels == 3, normal), "auc_any": auc(labels > 0, normal),
            "true_beats": int(len(all_labels)), "abnormal": int((all_labels > 0).sum()),
            "abnormal_scored": int((labels > 0).sum()),
            "classes": {**{c: int((all_labels == k).sum()) for k, c in sorted(AAMI_CLASS.items())},
                        "artifact": int((all_labels == 2).sum())},
            "unreadable_beats": int(np.asarray(matched.get("beat_unreadable", np.zeros(0, bool))).sum()),
            "unreadable_episodes": int(spans.shape[0]),
            "unreadable_s": float((spans[:, 1] - spans[:, 0]).sum() / fs) if fs else 0.0}


def _counts(letters: np.ndarray) -> dict:
    values, n = np.unique(np.asarray(letters, dtype=str), return_counts=True)
    return {str(v): int(c) for v, c in zip(values, n)}


def truth_classes(matched: dict, kept_classes) -> dict:
    """Assigned beat classes against a synthetic truth's.

    Parameters
    ----------
    matched : dict
        :func:`match_truth`'s result.
    kept_classes : array of str
        One letter per kept beat (the ``kept_peaks`` given to :func:`match_truth`): ``'N'``, ``'S'``,
        ``'V'``, ``'F'`` or ``'Q'``.

    Returns
    -------
    dict
        For each truth class ``'N'`` (label 0), ``'S'`` (3) and ``'V'`` (1): ``{"se", "ppv", "n"}``
        over the truth beats of a class matched to a kept beat outside the unreadable episodes
        (``n``: those of the class; ``se``: the share of them assigned the class; ``ppv``: of the
        beats assigned the class, the share of the class; NaN where nothing counts). ``confusion``:
        ``{truth class: {assigned class: count}}`` over the same beats. Kept apart, as counts of the
        assigned classes: ``artifacts`` (kept beats matched to a truth artifact, label 2, which is no
        class), ``unreadable`` (matched to a truth beat under an unreadable episode) and ``unmatched``
        (kept beats matched to no truth beat). ``scope`` says what counted.

    Raises
    ------
    ValueError
        If ``kept_classes`` holds a letter not in :data:`BEAT_CLASSES`, or is shorter than the kept
        beats (or, where ``matched`` has ``kept_labels``, of another length).
    """
    a = np.asarray(kept_classes).astype(str).reshape(-1)
    bad = sorted(set(np.unique(a).tolist()) - set(BEAT_CLASSES))
    if bad:
        raise ValueError(f"kept_classes holds {bad}; the classes are {list(BEAT_CLASSES)}")
    m = np.asarray(matched["matched"])
    n_kept = len(matched["kept_labels"]) if "kept_labels" in matched else None
    if (n_kept is not None and a.size != n_kept) or (m.size and a.size <= m.max()):
        want = f"{n_kept} kept beats" if n_kept is not None else f"kept beat {int(m.max())} matched"
        raise ValueError(f"{a.size} kept_classes, but {want}")
    kept, labels, _ = _readable_matched(matched)
    cls = a[kept]
    beat = labels != 2
    truth = np.asarray([AAMI_CLASS.get(int(v), "") for v in range(4)], dtype="<U1")[np.clip(labels[beat], 0, 3)]
    got = cls[beat]
    out = {}
    for c in SCORED_CLASSES:
        tp = int(((truth == c) & (got == c)).sum())
        n, p = int((truth == c).sum()), int((got == c).sum())
        out[c] = {"se": tp / n if n else float("nan"), "ppv": tp / p if p else float("nan"), "n": n}
    out["confusion"] = {c: _counts(got[truth == c]) for c in SCORED_CLASSES}
    out["artifacts"] = _counts(cls[~beat])
    unread = np.asarray(matched.get("beat_unreadable", np.zeros(m.size, bool)), bool)
    out["unreadable"] = _counts(a[m[(m >= 0) & unread]])
    taken = np.zeros(a.size, bool)
    taken[m[m >= 0]] = True
    out["unmatched"] = _counts(a[~taken])
    out["scope"] = ("truth beats matched to a kept beat outside the truth's unreadable episodes; "
                    "truth labels 0 N, 1 V, 3 S; artifacts (2) counted apart")
    return out


def truth_quality(matched: dict, unreadable_found) -> dict:
    """Found unreadable spans against a synthetic truth's unreadable episodes.

    Parameters
    ----------
    matched : dict
        :func:`match_truth`'s result (its ``unreadable``, ``unreadable_reason`` and ``fs``).
    unreadable_found : array-like of int, ``(k, 2)``
        Found ``[start, end)`` spans in samples, in any order, overlapping or not.

    Returns
    -------
    dict
        ``episodes`` (the truth's), ``episodes_found`` (those overlapping a found span by at least a
        sample), ``by_reason`` (``{reason: {"episodes", "found"}}``), ``seconds_true``,
        ``seconds_found`` (of the found spans' union), ``seconds_overlap`` (of both),
        ``seconds_false`` (found outside the truth's episodes), ``spans_found`` (the union's spans) and
        ``spans_false`` (of those, the ones overlapping no episode).
    """
    fs = float(matched["fs"])
    true = np.asarray(matched.get("unreadable", np.zeros((0, 2), np.int64)), np.int64).reshape(-1, 2)
    reasons = np.asarray(matched.get("unreadable_reason", np.full(true.shape[0], "")), dtype=str)
    found = merge_spans(unreadable_found)
    hit = _overlap(true, found)
    back = _overlap(found, merge_spans(true))
    by_reason = {str(r): {"episodes": int((reasons == r).sum()), "found": int(((reasons == r) & (hit > 0)).sum())}
                 for r in dict.fromkeys(reasons.tolist())}
    overlap = int(hit.sum())
    return {"episodes": int(true.shape[0]), "episodes_found": int((hit > 0).sum()), "by_reason": by_reason,
            "seconds_true": float((true[:, 1] - true[:, 0]).sum() / fs),
            "seconds_found": float((found[:, 1] - found[:, 0]).sum() / fs),
            "seconds_overlap": overlap / fs,
            "seconds_false": float((found[:, 1] - found[:, 0]).sum() - overlap) / fs,
            "spans_found": int(found.shape[0]), "spans_false": int((back == 0).sum())}

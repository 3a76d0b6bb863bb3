"""Evaluation against reference beats: detection (Se, PPV, F1) and anomaly ranking (ROC/PR-AUC)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

#: matching tolerance between detected and reference beats (150 ms, the AAMI convention)
TOLERANCE_S = 0.15


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


def match_truth(truth_path: str, peaks, kept_peaks, fs: float) -> dict:
    """Detection against a synthetic truth file (``.npz`` with ``r_peaks`` and ``labels``): Se, PPV
    and F1 of ``peaks`` at 150 ms, and for each truth beat the index of the one of ``kept_peaks``
    matched to it (``matched``, -1 for none), with the truth ``labels``: the part of the flow's truth
    check that needs no scores.
    (A light module: the flow runs this in its figure processes while the cluster trains.)"""
    with np.load(truth_path) as t:
        r_peaks, labels = t["r_peaks"], t["labels"]
    tol = int(round(TOLERANCE_S * fs))
    det, _ = match_beats(peaks, r_peaks, tol)
    _, m = match_beats(kept_peaks, r_peaks, tol)
    return {"se": det.se, "ppv": det.ppv, "f1": det.f1, "matched": m, "labels": labels}


def truth_check(matched: dict, kept_scores) -> dict:
    """The flow's check against a synthetic truth, once the beats are scored: detection (Se, PPV and F1
    from :func:`match_truth`'s ``matched``) and the anomaly ROC-AUC of the kept beats' scores, over the
    truth beats matched to a kept beat (abnormal: any label > 0; ``auc_pvc``: PVCs against normal
    beats only). (A light module: the flow runs this in a figure process while it goes on.)"""
    m, all_labels = np.asarray(matched["matched"]), np.asarray(matched["labels"])
    ok = m >= 0
    labels = all_labels[ok]
    s = np.asarray(kept_scores)[m[ok]]
    return {"se": matched["se"], "ppv": matched["ppv"], "f1": matched["f1"], "auc": roc_auc(s, labels > 0),
            "auc_pvc": roc_auc(s[labels != 2], labels[labels != 2] == 1),
            "true_beats": int(len(all_labels)), "abnormal": int((all_labels > 0).sum()),
            "abnormal_scored": int((labels > 0).sum())}

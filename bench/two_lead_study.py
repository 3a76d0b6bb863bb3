"""MIT-BIH (26 records): can the second lead (channel 1) remove false positives of the lead-0
detection? A study for the accuracy issue (session 18), not product code: nothing here runs in the
pipeline, which reads one lead.

Two rules, as array code over features the product already computes per lead
(``cpu_kernels.flutter_features_cpu``'s per-window energies and near-median fractions,
``segment.qrs_envelope``):

* the **flutter rule on both leads**: a 1 s window is flutter-like on lead 0 (the product's rule) or
  on lead 1 with its own caps (mean frequency < ``fmax1``, baseline fraction < ``base1``) while lead
  0's baseline fraction is below ``gate0``; runs of >= 5 such windows are episodes whose lead-0 peaks
  are dropped (``base1=0``: exactly the product's rule, checked on every record);
* the **doubtful-peak rule**: a lead-0 peak is dropped when it is weak against its +-4 neighbouring
  peaks on lead 0 (``r0 < a``), has no QRS-like energy on lead 1 within +-100 ms against its
  neighbours' (``r1q < t1``), and lead 1 is usable there (its beats stand ``q1 > c`` times above its
  background; otherwise lead 1 says nothing and the peak is kept).

Prints the exact Se/PPV/TP/FP/FN over the 22 non-paced records (false positives inside and outside
207's VF episodes) and the 4 paced ones for the recommended settings, then a grid (49 flutter
settings and off, 196 doubtful-peak settings and off) chosen by leave-one-unit-out (21 records and
207 cut into 6 pieces, one VF episode each) and 5-fold-by-record cross-validation::

    .venv/bin/python bench/two_lead_study.py [--data ../shared/data/mitdb]   (~3 min on 2 cores the first
    time; the records' features are kept in bench/out/two_lead_cache)
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beatflow.detect.cpu import flutter_features_cpu  # noqa: E402
from beatflow.score.evaluate import BEAT_SYMBOLS, PACED_RECORDS, list_records, load_record  # noqa: E402
from beatflow.score.metrics import TOLERANCE_S, match_beats  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402
from beatflow.detect.peaks import detect_peaks, gaussian_derivative, qrs_envelope  # noqa: E402

CACHE = ROOT / "bench" / "out" / "two_lead_cache"
NON_PACED = "101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230".split()
PACED = sorted(PACED_RECORDS)
S = SegmentParams().samples(360.0)
S_OFF = SegmentParams(vf_baseline_ratio=0.0).samples(360.0)
FS, W = 360.0, S.vf_window
MERGED = dict(base1=0.0)  # the product's lead-0 rule
ROBUST = dict(fmax1=4.5, base1=0.38, gate0=0.42)
AGGRESSIVE = dict(fmax1=4.5, base1=0.40, gate0=0.45)
PEAK = dict(a=0.8, t1=0.35, c=3.0)


# ---- the rules (array code: elementwise operations, shifted views, per-row quantiles)

def context_sum(v, r):
    n = v.shape[0]
    p = np.pad(v.astype(np.float64), r)
    out = p[0:n].copy()
    for i in range(1, 2 * r + 1):
        out += p[i:i + n]
    return out


def runs_of(like, L):
    """Windows lying in a run of >= L consecutive True (the merged rule's episode definition)."""
    nw = like.shape[0]
    pad = np.pad(like, (0, L - 1))
    full = np.ones(nw, bool)
    for i in range(L):
        full &= pad[i:i + nw]
    pad = np.pad(full, (L - 1, 0))
    ep = np.zeros(nw, bool)
    for i in range(L):
        ep |= pad[i:i + nw]
    return ep


def two_lead_flutter_windows(es0, ed0, nr0, es1, ed1, nr1, fs, *, context=2, runs=5,
                             base0=0.35, fmax0=5.5, base1=0.40, fmax1=4.5, gate0=0.45):
    """Episode windows: runs of >= `runs` windows that are flutter-like on lead 0 (the merged rule:
    mean frequency < fmax0 and mean baseline fraction < base0 over +-context windows), OR flutter-like
    on lead 1 with its own caps (fmax1, base1) while lead 0's baseline fraction is below gate0.
    base1=0 reproduces the merged lead-0 rule exactly."""
    c = context
    ones = np.ones(es0.shape[0])
    nb = context_sum(ones, c)
    b0 = context_sum(nr0, c) / nb
    b1 = context_sum(nr1, c) / nb
    s0 = context_sum(ed0, c) < (2 * np.pi * fmax0 / fs) ** 2 * context_sum(es0, c)
    s1 = context_sum(ed1, c) < (2 * np.pi * fmax1 / fs) ** 2 * context_sum(es1, c)
    like = (s0 & (b0 < base0)) | (s1 & (b1 < base1) & (b0 < gate0))
    return runs_of(like, runs)


def _neighbours(v, k):
    """(n, 2k) matrix of v[i-k..i-1, i+1..i+k] (NaN beyond the ends)."""
    n = v.shape[0]
    p = np.pad(v.astype(np.float64), k, constant_values=np.nan)
    return np.stack([p[k + j:k + j + n] for j in range(-k, k + 1) if j != 0], axis=1)


def peak_two_lead_features(env0, env1, peaks, fs, window, *, half_s=0.10, k=4):
    """Per channel-0 peak:
    r0  = env0[p] / median of env0 at the +-k neighbouring peaks (weak relative to its neighbours),
    r1q = max(env1[p-h .. p+h]) / 25th percentile of that quantity at the +-k neighbouring peaks
          (QRS energy on lead 1 relative to the smaller of the neighbouring beats' on lead 1),
    q1  = median over the neighbours of that lead-1 quantity / median of env1 over the peak's
          stream-aligned window (lead 1 quality: do its beats stand out of its background?)."""
    from scipy import ndimage

    h = int(round(half_s * fs))
    m1 = ndimage.maximum_filter1d(env1, 2 * h + 1, mode="nearest")  # sliding max (GPU: a windowed max)
    h0 = env0[peaks].astype(np.float64)
    h1 = m1[peaks].astype(np.float64)
    N0, N1 = _neighbours(h0, k), _neighbours(h1, k)
    r0 = h0 / np.nanmedian(N0, axis=1)
    r1q = h1 / np.nanquantile(N1, 0.25, axis=1)
    nw = -(-env1.shape[0] // window)
    e = np.pad(env1, (0, nw * window - env1.shape[0]), mode="edge").reshape(nw, window)
    bg1 = np.median(e, axis=1)[peaks // window]
    q1 = np.nanmedian(N1, axis=1) / np.maximum(bg1, 1e-12)
    return r0, r1q, q1


def doubtful_peaks(r0, r1q, q1, *, a=0.8, t1=0.35, c=3.0):
    """True for peaks to drop: weak on lead 0 (r0 < a), no QRS-like energy on lead 1 (r1q < t1),
    and lead 1 usable around it (q1 > c: otherwise lead 1 says nothing and the peak is kept)."""
    return (r0 < a) & (r1q < t1) & (q1 > c)


# ---- the records' features (cached)

def lead_window_features(x, s=S):
    """Per 1-s window (unsmoothed): e_sig, e_slope, near (all windows)."""
    taps = gaussian_derivative(s.kernel, s.a)
    e_sig, e_slope = flutter_features_cpu(x, 0, s.vf_window, s.vf_highpass, taps)
    rows = np.arange(e_sig.shape[0], dtype=np.int64)
    near = flutter_features_cpu(x, 0, s.vf_window, s.vf_highpass, taps, rows=rows, tol=s.vf_tol)
    return e_sig, e_slope, near


def build_cache(stem):
    name = Path(stem).name
    f = CACHE / f"{name}.npz"
    if f.exists():
        return dict(np.load(f, allow_pickle=True))
    r0 = load_record(stem, lead=0)
    r1 = load_record(stem, lead=1)
    assert r0.signal.shape == r1.signal.shape
    x0, x1 = r0.signal, r1.signal
    on = detect_peaks(x0, S)
    off = detect_peaks(x0, S_OFF)
    f0 = lead_window_features(x0)
    f1 = lead_window_features(x1)
    vf = np.asarray(r0.vf_episodes(), dtype=np.int64).reshape(-1, 2)
    d = dict(name=name, fs=r0.fs, x0=x0, x1=x1, ann_sample=r0.ann_sample, ann_symbol=r0.ann_symbol,
             on=on, off=off, es0=f0[0], ed0=f0[1], nr0=f0[2], es1=f1[0], ed1=f1[1], nr1=f1[2], vf=vf)
    np.savez(f, **d)
    return d


def load_all(data, names=None):
    CACHE.mkdir(parents=True, exist_ok=True)
    stems = list_records(data)
    out = {}
    for st in stems:
        n = Path(st).name
        if names is None or n in names:
            out[n] = build_cache(st)
    return out


def ref_beats(d):
    m = np.isin(d["ann_symbol"], list(BEAT_SYMBOLS))
    return d["ann_sample"][m]


def in_vf(d, p):
    p = np.asarray(p)
    m = np.zeros(p.shape[0], bool)
    for a, b in d["vf"]:
        m |= (p >= a) & (p <= b)
    return m


def evaluate(d, peaks):
    """Detection, plus matched mask over peaks and reference."""
    peaks = np.sort(np.asarray(peaks, np.int64))
    ref = ref_beats(d)
    det, match = match_beats(peaks, ref, int(round(TOLERANCE_S * float(d["fs"]))))
    matched = np.zeros(peaks.shape[0], bool)
    matched[match[match >= 0]] = True
    return det, matched, ref[match < 0], peaks


# ---- the peaks of a setting, and the exact rows

D: dict = {}    # record name -> its cached features
ENV: dict = {}  # record name -> (lead-0 envelope, lead-1 envelope)


def flutter_peaks(d, vfp):
    """The lead-0 peaks (rule off) outside the episodes of the two-lead flutter rule ``vfp``."""
    ep = two_lead_flutter_windows(d["es0"], d["ed0"], d["nr0"], d["es1"], d["ed1"], d["nr1"], FS, **vfp)
    p = d["off"]
    return p[~ep[np.clip(p // W, 0, ep.shape[0] - 1)]]


def final_peaks(n, vfp, pkp):
    p = flutter_peaks(D[n], vfp)
    if pkp is None:
        return p
    r0, r1q, q1 = peak_two_lead_features(*ENV[n], p, FS, W)
    return p[~doubtful_peaks(r0, r1q, q1, **pkp)]


def fmt(tp, fp, fn):
    return f"{100 * tp / (tp + fn):.3f} | {100 * tp / (tp + fp):.3f} | {tp} | {fp} | {fn}"


def exact_row(label, vfp, pkp):
    """One row: gross counts over the non-paced and the paced records, the non-paced false positives
    inside and outside 207's VF episodes, and the true beats lost against the product's rule."""
    a, b = np.zeros(3, int), np.zeros(3, int)
    fp_vf = fp_out = 0
    lost = []
    for n, d in D.items():
        det, matched, missed, pk = evaluate(d, final_peaks(n, vfp, pkp))
        if n in NON_PACED:
            a += [det.tp, det.fp, det.fn]
            v = in_vf(d, pk[~matched])
            fp_vf, fp_out = fp_vf + int(v.sum()), fp_out + int((~v).sum())
        else:
            b += [det.tp, det.fp, det.fn]
        lost += [(n, int(q)) for q in np.setdiff1d(missed, evaluate(d, d["on"])[2])]
    print(f"| {label} | {fmt(*a)} | {fp_vf} | {fp_out} | {fmt(*b)} | {lost or 'none'} |")


# ---- the grid and the cross-validation

VF_GRID = [MERGED] + [dict(fmax1=f, base1=b, gate0=g) for f, b, g in
                      itertools.product([4.0, 4.5, 5.0, 5.5], [0.30, 0.35, 0.40, 0.45], [0.40, 0.45, 0.50, 1.0])]
PK_GRID = [None] + [dict(a=a, t1=t, c=c) for a, t, c in
                    itertools.product([0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 99.0], [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4],
                                      [0.0, 2.0, 3.0, 4.0])]


def grid_counts(units, unit_of):
    """``C[v, k, unit] = (TP, FP, FN)`` of every flutter setting ``v`` and doubtful-peak setting ``k``."""
    uidx = {u: i for i, u in enumerate(units)}
    nu = len(units)
    C = np.zeros((len(VF_GRID), len(PK_GRID), nu, 3), np.int64)
    for vi, vfp in enumerate(VF_GRID):
        for n, d in D.items():
            det, matched, missed, pk = evaluate(d, flutter_peaks(d, vfp))
            up, um = unit_of(n, pk, uidx), unit_of(n, missed, uidx)
            fn_base = np.bincount(um, minlength=nu)
            r0, r1q, q1 = peak_two_lead_features(*ENV[n], pk, FS, W)
            for ki, pkp in enumerate(PK_GRID):
                drop = np.zeros(pk.shape[0], bool) if pkp is None else doubtful_peaks(r0, r1q, q1, **pkp)
                C[vi, ki, :, 0] += np.bincount(up[matched & ~drop], minlength=nu)
                C[vi, ki, :, 1] += np.bincount(up[~matched & ~drop], minlength=nu)
                C[vi, ki, :, 2] += fn_base + np.bincount(up[matched & drop], minlength=nu)
    return C, uidx


def select(C, uidx, train_units, allowed_vf=None, allowed_pk=None):
    """The setting with the fewest FP + FN over ``train_units``; ties: fewest FN, then the most peaks
    kept, then grid order (the product's rule and no peak rule first)."""
    tot = C[:, :, [uidx[u] for u in train_units], :].sum(axis=2)
    err, kept = tot[..., 1] + tot[..., 2], tot[..., 0] + tot[..., 1]
    mask = np.ones(err.shape, bool)
    if allowed_vf is not None:
        mask[[i for i in range(len(VF_GRID)) if i not in allowed_vf], :] = False
    if allowed_pk is not None:
        mask[:, [i for i in range(len(PK_GRID)) if i not in allowed_pk]] = False
    key = np.where(mask, err, 10 ** 9).astype(np.int64) * 10 ** 8 + tot[..., 2] * 10 ** 6 - kept
    v, k = np.unravel_index(np.argmin(key), key.shape)
    return int(v), int(k)


def cross_validate(C, uidx, units, folds, label, **kw):
    tot, chosen = np.zeros(3, int), []
    for held in folds:
        v, k = select(C, uidx, [u for u in units if u not in held], **kw)
        chosen.append((held, VF_GRID[v], PK_GRID[k]))
        tot += C[v, k, [uidx[u] for u in held], :].sum(axis=0)
    print(f"| {label} | {fmt(*tot)} |")
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    args = ap.parse_args()
    t0 = time.time()
    D.update(load_all(args.data))
    ENV.update({n: (qrs_envelope(d["x0"], S), qrs_envelope(d["x1"], S)) for n, d in D.items()})
    for n, d in D.items():  # the study's form of the rule is the product's
        assert np.array_equal(flutter_peaks(d, MERGED), d["on"]), n
    print(f"two_lead_flutter_windows(base1=0) gives detect_peaks' peaks on all {len(D)} records ({time.time() - t0:.0f} s)")
    from beatflow.detect.leads import SecondLeadParams, second_lead_keep

    product = SecondLeadParams()  # the product's defaults are the study's robust setting and peak rule
    assert (product.flutter_max_freq_hz, product.flutter_baseline_ratio, product.flutter_gate_ratio) == \
        (ROBUST["fmax1"], ROBUST["base1"], ROBUST["gate0"])
    assert (product.weak_ratio, product.quiet_ratio, product.quality_ratio) == (PEAK["a"], PEAK["t1"], PEAK["c"])
    for n, d in D.items():  # and beatflow.detect.leads gives the study's peaks
        keep, _ = second_lead_keep(d["x0"], d["x1"], d["on"], FS, S, product)
        assert np.array_equal(d["on"][keep], final_peaks(n, ROBUST, PEAK)), n
    print("beatflow.detect.leads.second_lead_keep (defaults) gives the study's 'robust + doubtful peaks' on every record")

    print("\n## The settings, exact (22 non-paced records; the 4 paced apart)\n")
    print("| variant | Se % | PPV % | TP | FP | FN | FP in VF | FP outside VF | paced Se % | paced PPV % | paced TP "
          "| paced FP | paced FN | true beats lost against the product's rule |\n|" + "---|" * 14)
    exact_row("product's rule (lead 0)", MERGED, None)
    exact_row(f"flutter on both leads, robust {ROBUST}", ROBUST, None)
    exact_row(f"flutter on both leads, aggressive {AGGRESSIVE}", AGGRESSIVE, None)
    exact_row(f"doubtful peaks {PEAK}", MERGED, PEAK)
    exact_row("robust + doubtful peaks", ROBUST, PEAK)
    exact_row("aggressive + doubtful peaks", AGGRESSIVE, PEAK)

    # units: the records, and 207 cut into pieces with one VF episode each (cut midway between episodes)
    vf207 = D["207"]["vf"]
    cuts = [0] + [int((vf207[i][1] + vf207[i + 1][0]) // 2) for i in range(len(vf207) - 1)] + [10 ** 12]
    units = [n for n in NON_PACED if n != "207"] + [f"207.{i}" for i in range(len(vf207))] + PACED

    def unit_of(name, pos, uidx):
        if name != "207":
            return np.full(np.shape(pos), uidx[name])
        piece = np.searchsorted(cuts, pos, side="right") - 1
        return np.array([uidx[f"207.{i}"] for i in piece], dtype=int).reshape(np.shape(pos))

    C, uidx = grid_counts(units, unit_of)
    np_units = [u for u in units if u.split(".")[0] in NON_PACED]
    print(f"\n## Cross-validation: settings chosen on the other units by the fewest FP + FN "
          f"(22 non-paced records pooled; {time.time() - t0:.0f} s)\n")
    print("| protocol | Se % | PPV % | TP | FP | FN |\n|---|---|---|---|---|---|")
    recs = sorted(NON_PACED)
    protocols = [("leave one unit out (21 records, 207 in 6 pieces)", [[u] for u in np_units]),
                 ("5 folds by record (207 whole)", [[u for u in np_units if u.split(".")[0] in recs[k::5]]
                                                    for k in range(5)])]
    chosen = {}
    for proto, folds in protocols:
        chosen[proto, "both"] = cross_validate(C, uidx, np_units, folds, f"{proto}: both rules")
        chosen[proto, "flutter"] = cross_validate(C, uidx, np_units, folds, f"{proto}: flutter rule only",
                                                  allowed_pk=[0])
        chosen[proto, "peaks"] = cross_validate(C, uidx, np_units, folds, f"{proto}: doubtful peaks only",
                                                allowed_vf=[0])
    print("\nsettings chosen per fold:")
    for (proto, what), lst in chosen.items():
        print(f"-- {proto} / {what}")
        for held, vfp, pkp in lst:
            print(f"   held out {held}: flutter {vfp}, doubtful peaks {pkp}")
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

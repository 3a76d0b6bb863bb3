"""Beat detection on the 22 non-paced MIT-BIH records, fast, and why each missed beat was missed.

Runs the detection core directly (no Prefect, no Dask): :func:`beatflow.detect.detect_peaks` on lead 0,
then with ``--confirm-lead`` the second lead's rules (:func:`beatflow.detect.second_lead_peaks`), then the
signal-quality rule, exactly as ``beatflow evaluate`` does (:func:`beatflow.score.evaluate.record_beats`),
scored against every reference beat with the 150 ms tolerance. Beside it the stages of
:func:`beatflow.detect.peaks.detect_peaks_xp` are re-run step by step (the same functions, the CPU's steps),
checked to give the same peaks, and each missed beat gets the first stage that lost it:

* ``no candidate``: no maximum of the envelope within 150 ms (the non-maximum suppression over
  ``±nms_half_window_s`` left none: a larger peak is that close);
* ``below weak``: candidates, all below the weak threshold (or float round-off);
* ``noise``: dropped by the noise-burst rule;
* ``T-wave``: strong, dropped by the T-wave test; ``refractory``: strong, dropped by the refractory period;
* ``search-back``: weak, not taken by search-back;
* ``flutter``: accepted, dropped by the flutter-episode rule; ``second lead``: dropped or moved by the
  second lead's rules; ``quality``: dropped as unreadable; ``matching``: a detection was near but taken by
  a neighbouring reference beat.

    .venv/bin/python bench/detection_study.py [--data ../shared/data/mitdb] [--confirm-lead 1]
                                              [--set refractory_s=0.2 ...] [--records 203,205]

``--set NAME=VALUE`` changes a :class:`beatflow.params.SegmentParams` field. Each record's signals are
cached in ``bench/out/detect_cache`` (ignored). Prints per-record and pooled Se/PPV/FP/FN, the causes,
and the detection's CPU seconds per record (median of the records' ``detect_peaks`` calls).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import print_header, print_table  # noqa: E402
from beatflow.detect import SecondLeadParams, detect_peaks, local_maxima, qrs_envelope, quality_rule  # noqa: E402
from beatflow.detect import second_lead_peaks, steepest_at, window_features  # noqa: E402
from beatflow.detect import peaks as P  # noqa: E402
from beatflow.detect.rhythm import flutter_rule  # noqa: E402
from beatflow.params import QualityParams, SegmentParams  # noqa: E402
from beatflow.score.evaluate import BEAT_SYMBOLS, PACED_RECORDS, list_records, load_record  # noqa: E402
from beatflow.score.metrics import TOLERANCE_S, match_beats  # noqa: E402

CAUSES = ("no candidate", "below weak", "noise", "T-wave", "refractory", "search-back", "flutter",
          "second lead", "quality", "matching")


def cached(stem: str, lead2: int | None, cache: Path):
    f = cache / f"{Path(stem).name}_{lead2}.npz"
    if f.exists():
        z = np.load(f)
        return z["x0"], (z["x1"] if "x1" in z else None), float(z["fs"]), z["ref"]
    rec = load_record(stem, 0, second=lead2)
    ref = rec.beats[0]
    cache.mkdir(parents=True, exist_ok=True)
    extra = {} if rec.second is None else {"x1": rec.second}
    np.savez(f, x0=rec.signal, fs=rec.fs, ref=ref, **extra)
    return rec.signal, rec.second, rec.fs, ref


def stages(x, s):
    """The stages of detect_peaks_xp (first=0, no core) with the CPU's steps: a dict of global index arrays."""
    n = x.shape[0]
    env = qrs_envelope(x, s)
    cand = local_maxima(env, s.nms)
    if s.fast_nms > 0:  # the candidates of the second decision (peaks.detect_peaks_xp)
        extra = P.fast_candidates(env, cand, P.decide(x, env, cand, 0, s, steepest_at)[0], s, local_maxima)
        cand = np.sort(np.concatenate([cand, extra]))
    cand = cand[(cand >= s.edge) & (cand < n - s.edge)]
    out = {"cand": cand}
    amp, b0 = P.block_amplitude(env, 0, s)
    level = amp[cand // s.block - b0]
    heights = env[cand]
    floor = 1e-7 * float(np.abs(x).max())
    keep = (heights > s.weak_ratio * level) & (heights > floor)
    cand, heights, level = cand[keep], heights[keep], level[keep]
    out["weak_ok"] = cand
    slopes = steepest_at(x, cand, s)
    quiet = ~P.noise_mask(env, cand, heights, level, slopes, s)
    cand, heights, level, slopes = cand[quiet], heights[quiet], level[quiet], slopes[quiet]
    out["quiet"] = cand
    strong = np.flatnonzero(heights > s.ratio * level)
    out["strong"] = cand[strong]
    strong = strong[~P.t_wave_mask(cand[strong], slopes[strong], s.twave, s.twave_slope)]
    out["not_t"] = cand[strong]
    strong = strong[P.refractory_mask(cand[strong], heights[strong], s.refractory)]
    out["not_refr"] = cand[strong]
    weak = np.flatnonzero(heights <= s.ratio * level)
    added = weak[P.search_back(cand[strong], slopes[strong], cand[weak], slopes[weak], heights[weak], s, length=n)]
    out["accepted"] = np.sort(cand[np.concatenate([strong, added])]).astype(np.int64)
    return out


def near(ref, pts, tol):
    """For each reference beat, whether some of ``pts`` (sorted) is within ``tol``."""
    if pts.shape[0] == 0:
        return np.zeros(ref.shape[0], bool)
    i = np.searchsorted(pts, ref - tol)
    return (i < pts.shape[0]) & (pts[np.minimum(i, pts.shape[0] - 1)] <= ref + tol)


def causes_of(missed, st, vf_kept, lead2_kept, final, tol):
    """The first stage that lost each missed beat (``CAUSES``)."""
    out = np.full(missed.shape[0], "", dtype=object)

    def mark(name, lost):
        out[(out == "") & lost] = name

    mark("no candidate", ~near(missed, st["cand"], tol))
    mark("below weak", ~near(missed, st["weak_ok"], tol))
    mark("noise", ~near(missed, st["quiet"], tol))
    accepted = near(missed, st["accepted"], tol)
    mark("search-back", ~near(missed, st["strong"], tol) & ~accepted)  # weak only, not taken
    mark("T-wave", ~near(missed, st["not_t"], tol) & ~accepted)
    mark("refractory", ~near(missed, st["not_refr"], tol) & ~accepted)
    mark("search-back", ~accepted)
    mark("flutter", ~near(missed, vf_kept, tol))
    mark("second lead", ~near(missed, lead2_kept, tol))
    mark("quality", ~near(missed, final, tol))
    mark("matching", np.ones(missed.shape[0], bool))
    return out


def run(stems, params, lead2, cache, quality=QualityParams(), verbose=True):
    """Per record: (name, beats, tp, fp, fn, causes Counter, seconds of detect_peaks)."""
    rows = []
    for stem in stems:
        x0, x1, fs, ref = cached(stem, lead2, cache)
        s = params.samples(fs)
        tol = int(round(TOLERANCE_S * fs))
        t = time.process_time()
        pk = np.asarray(detect_peaks(x0, s))
        sec = time.process_time() - t
        vf_kept = pk
        if x1 is not None:
            pk = np.asarray(second_lead_peaks(x0, x1, pk, fs, s, SecondLeadParams())[0])
        lead2_kept = pk
        if quality is not None:
            keep, _, _ = quality_rule(x0, pk, 0, quality.samples(fs))
            pk = pk[keep]
        det, match = match_beats(np.sort(pk), ref, tol)
        st = stages(x0, s)
        if s.vf_baseline > 0:
            keep, _ = flutter_rule(x0, st["accepted"], 0, s, window_features=window_features)
            mine = st["accepted"][keep]
        else:
            mine = st["accepted"]
        assert np.array_equal(mine, vf_kept), f"{stem}: the stages differ from detect_peaks"
        c = Counter(causes_of(ref[match < 0], st, vf_kept, lead2_kept, np.sort(pk), tol))
        rows.append((Path(stem).name, int(ref.shape[0]), det.tp, det.fp, det.fn, c, sec))
    return rows


def pooled(rows):
    tp, fp, fn = (sum(r[k] for r in rows) for k in (2, 3, 4))
    return tp, fp, fn, 100 * tp / max(1, tp + fn), 100 * tp / max(1, tp + fp)


def report(rows, title):
    tp, fp, fn, se, ppv = pooled(rows)
    table = [(r[0], r[1], r[3], r[4], ", ".join(f"{k} {v}" for k, v in sorted(r[5].items())))
             for r in rows if r[3] or r[4]]
    print(f"\n**{title}**: Se {se:.3f} %, PPV {ppv:.3f} % (TP {tp}, FP {fp}, FN {fn}); detect_peaks CPU "
          f"{np.median([r[6] for r in rows]):.4f} s / record (median), {sum(r[6] for r in rows):.2f} s in all\n")
    print_table(["record", "beats", "FP", "FN", "FN causes"], table)
    tot = Counter()
    for r in rows:
        tot.update(r[5])
    print("\nFN causes, pooled: " + ", ".join(f"{k} {tot[k]}" for k in CAUSES if tot[k]))


#: the fast-rhythm candidates' settings the cross-validation chooses among (``None``: off, the default)
CV_GRID = [None] + [dict(fast_nms_s=0.12, fast_rr_s=b, fast_rr_window_s=5.0, fast_dip=d)
                    for b in (0.5, 0.6, 0.7, 0.8, float("inf")) for d in (1.0, 0.3, 0.4, 0.5)]


def cross_validate(stems, base, cache, folds=5):
    """Leave-records-out choice of the fast-rhythm setting: per fold, the setting of ``CV_GRID`` with the
    fewest FP + FN pooled over the other folds' records (ties: the earlier, ``None`` first), counted on the
    fold's records; for lead 0 alone and with the second lead."""
    names = sorted(Path(st).name for st in stems)
    fold_of = {nm: k % folds for k, nm in enumerate(names)}
    for lead2 in (None, 1):
        per = []  # per setting: {record: (tp, fp, fn)}
        for g in CV_GRID:
            rows = run(stems, replace(base, **(g or {})), lead2, cache)
            per.append({r[0]: r[2:5] for r in rows})
            tp, fp, fn = (sum(v[k] for v in per[-1].values()) for k in range(3))
            print(f"{'lead 0' if lead2 is None else '--confirm-lead 1'} {g or 'off'}: all 22: Se "
                  f"{100 * tp / (tp + fn):.3f} PPV {100 * tp / (tp + fp):.3f} (FP {fp}, FN {fn})", flush=True)
        held = {}
        chosen = []
        for k in range(folds):
            train = [nm for nm in names if fold_of[nm] != k]
            cost = [sum(p[nm][1] + p[nm][2] for nm in train) for p in per]
            best = min(range(len(CV_GRID)), key=lambda i: (cost[i], i))
            chosen.append(CV_GRID[best] or "off")
            held.update({nm: per[best][nm] for nm in names if fold_of[nm] == k})
        tp, fp, fn = (sum(v[k] for v in held.values()) for k in range(3))
        off = per[0]
        print(f"\n**cross-validated ({folds} folds by record), "
              f"{'lead 0 alone' if lead2 is None else '--confirm-lead 1'}**: pooled held-out Se {100 * tp / (tp + fn):.3f} %, "
              f"PPV {100 * tp / (tp + fp):.3f} % (FP {fp}, FN {fn}); chosen per fold: {chosen}")
        changed = [f"{nm} {off[nm][1]}/{off[nm][2]} -> {held[nm][1]}/{held[nm][2]}" for nm in names if held[nm] != off[nm]]
        print("held-out FP/FN where they changed from off: " + (", ".join(changed) or "none") + "\n", flush=True)


def parse_set(items):
    names = {f.name: f.type for f in fields(SegmentParams)}
    out = {}
    for it in items or []:
        k, v = it.split("=", 1)
        if k not in names:
            raise SystemExit(f"no SegmentParams field {k}")
        out[k] = (v.lower() in ("1", "true", "yes")) if names[k] in (bool, "bool") else float(v)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    ap.add_argument("--confirm-lead", type=int, default=None)
    ap.add_argument("--both", action="store_true", help="lead 0 alone and with --confirm-lead 1")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--records", default=None)
    ap.add_argument("--cv", action="store_true", help="cross-validate the fast-rhythm candidates (CV_GRID)")
    a = ap.parse_args(argv)
    names = a.records.split(",") if a.records else None
    stems = [st for st in list_records(a.data, names) if Path(st).name not in PACED_RECORDS]
    params = replace(SegmentParams(), **parse_set(a.set))
    cache = ROOT / "bench" / "out" / "detect_cache"
    print_header("detection study")
    print(f"SegmentParams changed: {parse_set(a.set) or 'none'}")
    if a.cv:
        cross_validate(stems, params, cache)
        return
    for lead2 in ((None, 1) if a.both else (a.confirm_lead,)):
        rows = run(stems, params, lead2, cache)
        report(rows, "lead 0 alone" if lead2 is None else f"--confirm-lead {lead2}")


if __name__ == "__main__":
    main()

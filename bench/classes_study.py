"""The beat-class rule (:mod:`beatflow.score.classes`) chosen by cross-validation across patients.

Every record is segmented and embedded as ``beatflow evaluate`` does it (:func:`beatflow.score.evaluate.record_beats`);
each kept beat gets its shape features against its record's template (:func:`~beatflow.score.classes.features`:
deviation, amplitude, area; ``--shape deviation``: the deviation alone), its timing
(:func:`~beatflow.score.classes.rhythm`) and its P deviation (:func:`~beatflow.score.classes.p_wave` of the
record's signal before the peak, :func:`~beatflow.score.classes.pre_qrs`, for each P window searched); the AAMI
label of the annotation matched to it is used only to judge. Each record's labels, shape features, peaks and
signal are cached in ``bench/out/classes_cache`` (ignored; delete it after a change to the segmentation or to
:func:`~beatflow.score.classes.features`). On the training records of each of 5 folds (records, never
beats, split) a grid of the V thresholds is searched for the best pooled ``min(Se, +P)`` of V, then, given
that V, a grid of the S thresholds for the best of S; the choice is judged on the fold's held-out records.
The table: the folds' choices, each fold's held-out figures, the pooled held-out figures (every record judged
by a rule chosen without it) with the ROC-AUC of S against N of :func:`~beatflow.score.classes.s_score`, each
record's held-out counts and those of the defaults.

    python bench/classes_study.py [--data ../shared/data/mitdb] [--folds 5] [--seed 0] [--shape deviation]
                                  [--set NAME=V1,V2 ...]

``--set s_af_p=inf`` searches ``s_af_p`` off alone, ``--set long_beats=150,300`` two long windows (each
value's timing is computed): a row of the "what was tried" table of ``bench/results/accuracy.md``.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_header, print_table  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402
from beatflow.score.classes import (FEATURES, ClassParams, episode, judge, morphology, on_time, p_wave,  # noqa: E402
                                    pre_qrs, rhythm, s_score, shape_z, template)
from beatflow.score.classes import features as shape_features  # noqa: E402
from beatflow.score.evaluate import PACED_RECORDS, list_records, load_record, record_beats  # noqa: E402

#: the V thresholds searched, with the values tried (searched first, for the best min(Se, +P) of V)
V_GRID = {"z_low": (0.25,), "v_dev": (np.inf,), "v_dev_z": (1.0,), "v_min_dev": (0.05,),
          "v_z": (6.0,), "v_z_alone": (12.0,), "v_amp": (0.0,),
          "v_area": (1.0,), "v_width": (1.0,), "v_wide": (np.inf,),
          "v_irregular": (np.inf,), "v_compensation": (0.0,),
          "v_z_early": (np.inf, 3.0, 4.0), "v_early_premature": (0.15, 0.1), "v_early_irregular": (0.1, 0.2),
          "v_early_p_dev": (-np.inf, 0.3), "v_early_compensation": (0.0, 1.8),
          "v_aberrant_premature": (np.inf, 0.4, 0.45), "v_aberrant_compensation": (1.6, 1.7),
          "v_aberrant_pause": (0.0, 0.8), "v_aberrant_irregular": (0.3,), "v_aberrant_z": (6.0,),
          "v_sinus_p_dev": (-np.inf, 0.3, 0.5), "v_sinus_z": (4.0,),
          "v_ontime_z": (-np.inf, 2.5, 3.0), "v_ontime_premature": (0.1,), "v_ontime_p_dev": (0.7, 0.9)}
# (also searched, no fold choosing them: v_dev 0.3, 0.4 and 0.6, v_dev_z 2 and 3, v_z 3, 4 and 5, v_z_alone 6 and
# 8, v_area 0 and 0.5, v_width 0 and 0.5, v_wide 4 and 8, v_irregular 0.2 and 0.3, v_amp 0.5 and 1,
# v_compensation 1.5, 1.7 and 1.8)
#: the S thresholds searched, given the chosen V (for the best min(Se, +P) of S)
S_GRID = {"s_premature": (0.15,), "s_irregular": (0.15,), "s_corr": (0.7, 0.8), "s_spread": (1.0, 2.0),
          "irregular_beats": (16,), "p_before_s": (0.25,), "s_p_dev": (0.1,),
          "s_score_min": (0.6, 0.7), "s_score_p": (0.5,),
          "s_premature_p": (0.0,), "s_long": (0.15, 0.2), "long_beats": (150,),
          "s_p_long": (0.4, 0.6), "s_run_rr": (0.0,), "s_run_p_dev": (0.2,), "s_run_p": (0.6,),
          "episode_beats": (31,), "s_af_p": (np.inf, 0.5, 0.6), "s_af_irregular": (0.1, 0.12),
          "s_long_alone": (np.inf, 0.3, 0.35)}
# (also searched, no fold choosing them: s_irregular 0.2 and 0.3, p_before_s 0.2, s_p_dev off, s_score_min off
# and 0.5, s_long off and 0.1, s_p_long 0.9; and S runs carried on, s_run_rr 0.1 and 0.15 with s_run_p_dev 0.2
# and 0.3 and s_run_p 0.5 and 0.6, chosen by 4 folds of 5 but lowering the pooled held-out S; with the AF gate,
# long_beats 300 (chosen by 4 folds of 5, lowering the pooled held-out S), s_p_dev 0.2 and 0.3, s_premature 0.2,
# s_score_min 0.8 (the pooled held-out S no higher),
# episode_beats 61, s_af_p 0.4, s_af_irregular 0.08, s_long_alone 0.25 and 0.4, s_irregular 0.2 and 0.3 (chosen by
# some folds, lowering the pooled held-out S) and a QRS-width gate on S (width z above 3 or 5, no fold chose it):
# see bench/results/accuracy.md)
GRID = {**V_GRID, **S_GRID}
#: the parameters of the timing itself (:func:`features` computes it for each combination of their values)
TIMING = ("irregular_beats", "p_before_s", "episode_beats", "long_beats")
#: the gates of the early-in-a-regular-rhythm V path (inert while ``v_z_early`` is off)
EARLY_GATES = ("v_early_premature", "v_early_irregular", "v_early_p_dev", "v_early_compensation")
#: each switch (off at ``off``) and the gates that are inert while it is off
SWITCHES = {"v_z_early": (np.inf, EARLY_GATES),
            "v_aberrant_premature": (np.inf, ("v_aberrant_compensation", "v_aberrant_pause", "v_aberrant_irregular",
                                              "v_aberrant_z")),
            "v_sinus_p_dev": (-np.inf, ("v_sinus_z",)),
            "v_ontime_z": (-np.inf, ("v_ontime_premature", "v_ontime_p_dev")),
            "s_run_rr": (0.0, ("s_run_p_dev", "s_run_p")),
            "s_af_p": (np.inf, ("s_af_irregular",))}
#: ``--shape deviation``: the deviation alone (no amplitude or area), the V grid without their weights
DEVIATION_ONLY = {"v_amp": (0.0,), "v_area": (0.0,), "v_width": (0.0,), "v_wide": (np.inf,)}


#: the cached per-record arrays (``bench/out`` is ignored): segmentation and shape features take most of a run
CACHE = Path(__file__).resolve().parent / "out" / "classes_cache"


def cache_record(stem: str, shape: str = "features") -> dict:
    """The record's beats' labels and shape features, its peaks and signal (cached by name)."""
    path = CACHE / f"{Path(stem).name}-{shape}.npz"
    if path.exists():
        with np.load(path) as z:
            if shape != "features" or (z["f"].ndim == 2 and z["f"].shape[1] == len(FEATURES)):
                return {k: z[k] for k in z.files}
        # (a cache of fewer features than `features` gives now: filled again)
    rec = load_record(stem)
    b = record_beats(rec)
    pre = SegmentParams().samples(rec.fs).pre
    tmpl = template(b.rows, rec.fs, pre)
    f = np.asarray(shape_features(b.rows, tmpl, rec.fs, pre) if shape == "features" else morphology(b.rows, tmpl, rec.fs, pre))
    out = {"name": np.asarray(rec.name), "fs": np.asarray(rec.fs), "label": b.label, "f": f, "peaks": b.peaks,
           "kept_peak": b.kept_peak, "signal": rec.signal}
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(path, **out)
    return out


def features(stem: str, shape: str = "features") -> dict:
    c = cache_record(stem, shape)
    fs, f = float(c["fs"]), c["f"]
    dev = f[:, 0] if f.ndim == 2 else f
    timing = {}
    for k, lb in itertools.product(GRID["irregular_beats"], GRID["long_beats"]):
        t = rhythm(c["peaks"], c["kept_peak"], fs, ClassParams(irregular_beats=k, long_beats=lb))
        dom = on_time(dev, t)
        for pb in GRID["p_before_s"]:
            win = pre_qrs(c["signal"], 0, c["kept_peak"], fs, ClassParams(p_before_s=pb))
            tp = {**t, "p_deviation": p_wave(win, dom)}
            for e in GRID["episode_beats"]:
                timing[k, pb, e, lb] = {**tp, **episode(tp, ClassParams(episode_beats=e))}
    z = {q: shape_z(f, None, ClassParams(z_low=q)) for q in GRID["z_low"]}
    return {"name": str(c["name"]), "label": c["label"], "dev": dev, "z": z, "timing": timing}


def timing_of(r: dict, p: ClassParams) -> dict:
    """The record's timing (:func:`features`) for the rule's :data:`TIMING` parameters."""
    return r["timing"][tuple(getattr(p, k) for k in TIMING)]


def counts(recs: list[dict], p: ClassParams, only: str = "NSV") -> dict:
    out = {c: [0, 0, 0] for c in only}  # tp, reference, assigned (among labelled beats)
    for r in recs:
        got = judge(r["dev"], r["z"][p.z_low], timing_of(r, p), p)
        lab = r["label"] != ""
        for c in out:
            out[c][0] += int(((got == c) & (r["label"] == c)).sum())
            out[c][1] += int((r["label"] == c).sum())
            out[c][2] += int(((got == c) & lab).sum())
    return out


def se_ppv(c: list) -> tuple[float, float]:
    return c[0] / max(1, c[1]), c[0] / max(1, c[2])


def grid_of(base: ClassParams, grid: dict) -> list[ClassParams]:
    """The grid's rules, in order, each once: with ``v_dev`` off its ``v_dev_z`` is that of the first, with a
    switch of :data:`SWITCHES` off (``v_z_early``, ``v_aberrant_premature``, ``v_sinus_p_dev``) its gates are
    those of the first (the same rule; the first of equal rules is the one chosen)."""
    out = [replace(base, **dict(zip(grid, v))) for v in itertools.product(*grid.values())]
    if "v_dev_z" in grid:
        out = [q for q in out if q.v_dev < np.inf or q.v_dev_z == grid["v_dev_z"][0]]
    for switch, (off, gates) in SWITCHES.items():  # (with a switch off its gates are those of the first)
        if switch in grid:
            first = {g: grid[g][0] for g in gates if g in grid}
            out = [q for q in out if getattr(q, switch) != off or all(getattr(q, g) == v for g, v in first.items())]
    return out


def choose(recs: list[dict], v_grid: dict, base: ClassParams) -> ClassParams:
    """The V thresholds with the best min(Se, +P) of V on ``recs``, then the S ones with the best of S."""
    pv = max(grid_of(base, v_grid), key=lambda p: min(se_ppv(counts(recs, p, "V")["V"])))
    return max(grid_of(pv, S_GRID), key=lambda p: min(se_ppv(counts(recs, p, "S")["S"])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mitdb"))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=("features", "deviation"), default="features",
                    help="the beats' shape: deviation, amplitude and area (the flow's), or the deviation alone")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                    help="search these values of a threshold of the grids instead (repeatable; inf, -inf: off)")
    a = ap.parse_args(argv)
    for item in a.set:
        name, _, values = item.partition("=")
        grid = V_GRID if name in V_GRID else S_GRID if name in S_GRID else None
        if grid is None or not values:
            ap.error(f"--set {item}: not NAME=V1,V2 of a threshold of the grids")
        kind = type(getattr(ClassParams(), name))
        grid[name] = GRID[name] = tuple(kind(float(v)) if kind is int else kind(v) for v in values.split(","))
    print_header("bench/classes_study.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    stems = [s for s in list_records(a.data) if Path(s).name not in PACED_RECORDS]
    recs = [features(s, a.shape) for s in stems]
    base = ClassParams()
    v_grid = {**V_GRID, **(DEVIATION_ONLY if a.shape == "deviation" else {})}
    order = np.random.default_rng(a.seed).permutation(len(recs))
    folds = [sorted(order[k :: a.folds]) for k in range(a.folds)]
    rows, held, chosen, rule_of = [], {c: [0, 0, 0] for c in "NSV"}, [], {}
    for k, test in enumerate(folds):
        train = [recs[i] for i in range(len(recs)) if i not in test]
        p = choose(train, v_grid, base)
        chosen.append(tuple(getattr(p, g) for g in GRID))
        rule_of.update({i: p for i in test})
        cnt = counts([recs[i] for i in test], p)
        for c in held:
            held[c] = [x + y for x, y in zip(held[c], cnt[c])]
        rows.append([k, " ".join(recs[i]["name"] for i in test), " ".join(f"{g}={getattr(p, g)}" for g in GRID),
                     *(f"{100 * v:.1f}" for c in "VS" for v in se_ppv(cnt[c]))])
    print_table(["fold", "held-out records", "chosen on the other folds", "V Se", "V +P", "S Se", "S +P"], rows)
    print()
    y, sc = [], []
    for i, r in enumerate(recs):  # the S score of each record's N and S beats, its weight chosen without it
        m = np.isin(r["label"], ["N", "S"])
        y.append(r["label"][m] == "S")
        sc.append(s_score(timing_of(r, rule_of[i]), rule_of[i])[m])
    auc = roc_auc_score(np.concatenate(y), np.concatenate(sc))
    print_table(["pooled held-out", "V Se", "V +P", "S Se", "S +P", "N Se", "N +P", "S ROC-AUC (s_score)"],
                [["every record judged by a rule chosen without it",
                  *(f"{100 * v:.1f}" for c in "VSN" for v in se_ppv(held[c])), f"{auc:.3f}"]])
    modes = [Counter(c[i] for c in chosen).most_common(1)[0] for i in range(len(GRID))]
    print("\neach threshold's value most folds chose: "
          + ", ".join(f"{g}={v} ({n} of {len(folds)})" for g, (v, n) in zip(GRID, modes)))
    print(f"the defaults (beatflow.score.classes.ClassParams): "
          + ", ".join(f"{g}={getattr(base, g)}" for g in GRID))
    per = []
    for i, r in enumerate(recs):
        cnt, dflt = counts([r], rule_of[i]), counts([r], base)
        per.append([r["name"], *(f"{x[c][0]}/{x[c][1]}/{x[c][2]}" for x in (cnt, dflt) for c in "VS")])
    print()
    print_table(["record", "V held out: right / reference / assigned", "S held out", "V (defaults)", "S (defaults)"],
                per)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

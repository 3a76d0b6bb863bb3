"""Which beats to flag: the score threshold on MIT-BIH (inter-patient folds) and on the synthetic ECG.

The flow ranks beats by the LightVAE's reconstruction error and flags those above
``beatflow.score.rule.robust_threshold`` of the scored stream's scores (median + k robust standard
deviations of the log scores). This study scores the MIT-BIH records as ``bench/evaluate_mitdb.py``
does (22 non-paced records in 5 folds by record, the VAE trained on the other folds; the 4 paced
records scored by a VAE trained on the 22), saves every fold's scores, and counts, for threshold
rules that see only the scores of the records being scored (or, as ``beatflow score`` does, the
threshold the trained model carries from its training records), how many beats each flags and how
they match the reference classes (AAMI V, and any class but N). The synthetic ECG's truth comes
from a finished run (``--synthetic runs/<stamp>``: its ``anomalies.parquet`` and ``truth.npz``)::

    .venv/bin/python bench/threshold_study.py [--data ../shared/data/mitdb] [--synthetic runs/<stamp>]
                                              [--scores bench/out/threshold_scores.npz]   (~3 min on 2 cores)

With ``--scores`` pointing at an existing file the folds are not scored again.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beatflow.score.evaluate import PACED_RECORDS, list_records, load_record, record_beats, scaled_rows  # noqa: E402
from beatflow.model.vae import score_beats, train_vae  # noqa: E402
from beatflow.score.rule import robust_threshold  # noqa: E402

NON_PACED = "101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230".split()
#: the rules compared: name -> per-beat thresholds from the scored set's scores and recordings
RULES = {
    "**the training records' threshold (model.json; what `beatflow score` applies to new recordings)**":
        lambda s, r, tr: robust_threshold(tr[0], 4.0, recording=tr[1]) if tr is not None else float("nan"),
    "median ± spread around it (before), k=4": lambda s, r, tr: robust_threshold(s, 4.0),
    "median ± spread around it (before), k=3": lambda s, r, tr: robust_threshold(s, 3.0),
    "**median ± spread within recordings, k=4** (the flow's rule, on the scored records' own scores)":
        lambda s, r, tr: robust_threshold(s, 4.0, recording=r),
    "median ± spread within recordings, k=3": lambda s, r, tr: robust_threshold(s, 3.0, recording=r),
    "each recording's median ± spread within recordings, k=4": lambda s, r, tr: _per_recording(s, r, 4.0),
    **{f"within recordings, k=4, spread capped at {c}": (lambda c: lambda s, r, tr: _capped(s, r, c))(c)
       for c in (0.6, 0.7, 0.8)},
}


def _capped(scores, records, cap: float) -> float:
    """Not taken: the product's threshold, at most median × e^(4·cap) (σ̂ capped)."""
    med = float(np.median(np.log(np.maximum(scores, 1e-12))))
    return min(robust_threshold(scores, 4.0, recording=records), float(np.exp(med + 4.0 * cap)))


def _per_recording(scores, records, k: float) -> np.ndarray:
    """The alternative: each beat against its own recording's median (the same pooled spread)."""
    ls = np.log(np.maximum(scores, 1e-12))
    sigma = np.log(robust_threshold(scores, 1.0, recording=records)) - np.median(ls)
    out = np.empty_like(ls)
    for r in np.unique(records):
        m = records == r
        out[m] = np.exp(np.median(ls[m]) + k * sigma)
    return out


def score_folds(data: Path, epochs: int, seed: int) -> dict:
    """Every fold's test scores, AAMI labels and record names (non-paced folds, then the paced set)."""
    names = NON_PACED + sorted(PACED_RECORDS)
    beats = {}
    for name, path in zip(names, list_records(data, names)):
        beats[name] = record_beats(load_record(path, 0))
    folds = [NON_PACED[k::5] for k in range(5)] + [sorted(PACED_RECORDS)]
    out = {}
    for k, test in enumerate(folds):
        train = [n for n in NON_PACED if n not in test]
        x_train, _ = scaled_rows([beats[n] for n in train], "record")
        x_test, _ = scaled_rows([beats[n] for n in test], "record")
        t = time.perf_counter()
        res = train_vae(x_train, epochs=epochs, batch_size=1024, seed=seed)
        scores, _ = score_beats(res.model, x_test)
        out[f"scores_{k}"] = np.asarray(scores, np.float64)
        # the training records' own scores: the flow's threshold (model.json) comes from these
        out[f"train_scores_{k}"] = np.asarray(score_beats(res.model, x_train)[0], np.float64)
        out[f"train_records_{k}"] = np.concatenate([[n] * len(beats[n].label) for n in train]).astype(str)
        out[f"labels_{k}"] = np.concatenate([beats[n].label for n in test]).astype(str)
        out[f"records_{k}"] = np.concatenate([[n] * len(beats[n].label) for n in test]).astype(str)
        print(f"fold {k + 1} ({' '.join(test)}): {len(scores)} beats scored, trained in {time.perf_counter() - t:.1f} s",
              flush=True)
    return out


def counts(flag, labels) -> tuple[int, int, int, int, int]:
    """(flagged, flagged V, reference V, flagged of a labelled class other than N, flagged N)."""
    labelled = labels != "None"
    return (int(flag.sum()), int((flag & (labels == "V")).sum()), int((labels == "V").sum()),
            int((flag & labelled & (labels != "N")).sum()), int((flag & (labels == "N")).sum()))


def table(title: str, sets: list[tuple]) -> str:
    """Counts of every rule over ``sets`` of ``(scores, labels, records, (training scores, their records) or None)``."""
    out = [f"**{title}**", "", "| rule | flagged | V recall % | V precision % | not-N precision % | N flagged % |",
           "|---|---|---|---|---|---|"]
    n_total = sum(int((lab == "N").sum()) for _, lab, _, _ in sets)
    for name, rule in RULES.items():
        c = np.zeros(5, np.int64)
        thresholds = [rule(scores, records, train) for scores, _, records, train in sets]
        if any(np.isnan(np.asarray(th, dtype=np.float64)).any() for th in thresholds):
            out.append(f"| {name} | – | – | – | – | – |")  # (no training records: the synthetic run)
            continue
        for (scores, labels, _, _), th in zip(sets, thresholds):
            c += counts(scores > th, labels)
        f, fv, v, fa, fn = (int(x) for x in c)
        out.append(f"| {name} | {f} | {100 * fv / max(v, 1):.1f} | {100 * fv / max(f, 1):.1f} | "
                   f"{100 * fa / max(f, 1):.1f} | {100 * fn / max(n_total, 1):.2f} |")
    return "\n".join(out)


def synthetic_sets(run: Path) -> list[tuple]:
    """The scores of a finished synthetic run and its truth labels ('V' for the injected
    abnormal beats, 'N' for normal ones, 'None' where a kept beat matches no truth beat)."""
    import pandas as pd

    from beatflow.score.metrics import TOLERANCE_S, match_beats

    table_ = pd.read_parquet(run / "anomalies.parquet")
    with np.load(run / "truth.npz") as t:
        r_peaks, labels, fs = t["r_peaks"], t["labels"], float(t["fs"])
    _, matched = match_beats(table_["peak"].to_numpy(), r_peaks, int(round(TOLERANCE_S * fs)))
    lab = np.full(len(table_), "None", dtype=object)
    ok = matched >= 0
    lab[matched[ok]] = np.where(labels[ok] != 0, "V", "N")
    return [(table_["score"].to_numpy().astype(np.float64), lab.astype(str), np.zeros(len(table_), np.int64), None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    ap.add_argument("--scores", default=str(ROOT / "bench" / "out" / "threshold_scores.npz"))
    ap.add_argument("--synthetic", help="a finished synthetic run's folder (anomalies.parquet, truth.npz)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = Path(args.scores)
    if path.exists():
        saved = dict(np.load(path))
    else:
        saved = score_folds(Path(args.data), args.epochs, args.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **saved)
    folds = [(saved[f"scores_{k}"], saved[f"labels_{k}"], saved[f"records_{k}"],
              (saved[f"train_scores_{k}"], saved[f"train_records_{k}"])) for k in range(6)]
    print(table("MIT-BIH, 22 non-paced records, 5 folds (each fold's threshold from its own scores; counts summed)",
                folds[:5]))
    print()
    for k in range(5):
        print(table(f"fold {k + 1} ({' '.join(sorted(set(folds[k][2].tolist())))})", folds[k:k + 1]))
        print()
    print()
    print(table("MIT-BIH, the 22 non-paced records' fold scores as one stream (one threshold)",
                [tuple(np.concatenate(v) for v in zip(*(f[:3] for f in folds[:5]))) + (None,)]))
    print()
    print(table("MIT-BIH, 4 paced records (trained on the 22)", folds[5:]))
    if args.synthetic:
        print()
        print(table(f"Synthetic ECG ({args.synthetic}; V = the injected abnormal beats)",
                    synthetic_sets(Path(args.synthetic))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

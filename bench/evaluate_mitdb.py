"""Leave-records-out cross-validation of ``beatflow evaluate`` on the local MIT-BIH records.

The 22 non-paced records are split by record into ``--folds`` folds (sorted names, fold k holds
every k-th record); for each fold the LightVAE is trained on the other folds' records and the fold's
records are segmented and scored (inter-patient). The 4 paced records (102, 104, 107, 217) are
reported apart: trained on all 22 non-paced records, tested on the paced ones. Detection does not
depend on the training, so its gross figures over the folds are those of the 22 records.

Prints the machine header and Markdown tables; ``--json`` writes every fold's full result.

    .venv/bin/python bench/evaluate_mitdb.py [--data ../shared/data/mitdb] [--json bench/mitdb_cv.json]

Results: ``bench/results/accuracy.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import markdown_table, print_header  # noqa: E402

from beatflow.score.evaluate import PACED_RECORDS, evaluate, list_records, load_record  # noqa: E402
from beatflow.score.metrics import Detection  # noqa: E402

DETECTORS = ("beatflow", "neurokit2", "neurokit2_raw", "xqrs", "sleepecg")
SCORERS = ("beatflow", "isolation_forest", "ecod")


def _gross(results: list[dict], name: str, vf: bool = False) -> Detection:
    tot = Detection(0, 0, 0)
    for r in results:
        d = r["detection"] if name == "beatflow" else r["peers"][name]
        if vf:
            e = d["excluding_vf"]
            tot = tot + Detection(e["tp"], e["fp"], e["fn"])
        else:
            for v in d["per_record"].values():
                tot = tot + Detection(v["tp"], v["fp"], v["fn"])
    return tot


def _seconds(results: list[dict], name: str) -> float:
    per = [v["s"] for r in results for v in (r["detection"] if name == "beatflow" else r["peers"][name])
           ["per_record"].values()]
    return sum(per) / max(1, len(per))


def _anom(r: dict, name: str, all_beats: bool = False) -> dict:
    if all_beats:
        return r["anomaly_all_beats"] if name == "beatflow" else r["baselines_all_beats"][name]
    return r["anomaly"] if name == "beatflow" else r["baselines"][name]


def _f(v, pct=False) -> str:
    if v is None or v != v:
        return "–"
    return f"{100 * v:.2f}" if pct else f"{v:.3f}"


def detection_table(results: list[dict], title: str) -> str:
    rows = []
    for name in DETECTORS:
        d, v = _gross(results, name), _gross(results, name, vf=True)
        rows.append((name, _f(d.se, 1), _f(d.ppv, 1), _f(d.f1, 1), d.tp, d.fp, d.fn, _f(v.se, 1), _f(v.ppv, 1),
                     f"{_seconds(results, name):.3f}"))
    return "\n".join([f"**{title}** (gross over the test records, 150 ms tolerance)", "", markdown_table(
        ["detector", "Se %", "PPV %", "F1 %", "TP", "FP", "FN", "Se % (VF excl.)", "PPV % (VF excl.)", "s / record"],
        rows)])


def per_record_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for rec, d in r["detection"]["per_record"].items():
            peers = [r["peers"][p]["per_record"][rec] for p in DETECTORS[1:]]
            rows.append([rec, d["tp"] + d["fn"], d["fp"], d["fn"]] + [f"{p['fp']}/{p['fn']}" for p in peers])
    return markdown_table(["record", "beats", "beatflow FP", "beatflow FN", "neurokit2 FP/FN", "neurokit2_raw FP/FN",
                           "xqrs FP/FN", "sleepecg FP/FN"], rows)


def anomaly_table(results: list[dict], labels: list[str], all_beats: bool = False) -> str:
    rows = []
    for lab, r in zip(labels, results):
        c = r["anomaly_all_beats" if all_beats else "anomaly"]["counts"]
        for name in SCORERS:
            a = _anom(r, name, all_beats)
            rows.append((lab, name, _f(a["auc_v"]), _f(a["prauc_v"]), _f(a["auc_s"]), _f(a["auc_f"]),
                         f"{c['N']} / {c['S']} / {c['V']} / {c['F']}"))
    return markdown_table(["fold (test records)", "scorer", "V-vs-N ROC-AUC", "V-vs-N PR-AUC", "S-vs-N ROC-AUC",
                           "F-vs-N ROC-AUC", "N / S / V / F beats"], rows)


def classes_table(results: list[dict]) -> str:
    """The assigned classes' gross Se and +P over the folds' test records (the class rule has no training:
    these are the defaults of ``beatflow.score.classes`` on every record; ``bench/classes_study.py`` judges
    the rule's choice on records it was not chosen on)."""
    rows = []
    for c in ("N", "S", "V", "F"):
        tp = sum(round((r["classes"][c]["se"] or 0) * r["classes"][c]["n"]) for r in results)
        n = sum(r["classes"][c]["n"] for r in results)
        got = sum(r["classes"][c]["assigned"] for r in results)
        rows.append((c, n, got, tp, _f(tp / n if n else None, 1), _f(tp / got if got else None, 1)))
    return markdown_table(["AAMI class", "reference beats", "assigned", "right", "Se %", "+P %"], rows)


def coverage_table(results: list[dict]) -> str:
    ref = {c: sum(r["anomaly"]["reference_counts"][c] for r in results) for c in "NSVF"}
    kept = {c: sum(r["anomaly"]["counts"][c] for r in results) for c in "NSVF"}
    every = {c: sum(r["anomaly_all_beats"]["counts"][c] for r in results) for c in "NSVF"}
    return markdown_table(["AAMI class", "reference beats", "scored, kept beats", "scored, all detected beats"],
                          [(c, ref[c], f"{kept[c]} ({100 * kept[c] / max(1, ref[c]):.0f} %)",
                            f"{every[c]} ({100 * every[c] / max(1, ref[c]):.0f} %)") for c in "NSVF"])


def mean_table(results: list[dict]) -> str:
    rows = []
    for all_beats in (False, True):
        for name in SCORERS:
            cells = []
            for key in ("auc_v", "prauc_v", "auc_s", "auc_f"):
                vals = [_anom(r, name, all_beats)[key] for r in results if _anom(r, name, all_beats)[key] is not None]
                cells.append(f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else
                             (_f(vals[0]) if vals else "–"))
            rows.append(["all detected" if all_beats else "kept", name] + cells)
    return markdown_table(["beats", "scorer", "V-vs-N ROC-AUC", "V-vs-N PR-AUC", "S-vs-N ROC-AUC", "F-vs-N ROC-AUC"],
                          rows)


def flagged_table(results: list[dict], labels: list[str]) -> str:
    """The beats the pipeline's threshold flags per fold (``anomaly.flagged``; older JSON files lack it)."""
    rows = [(lab, r["anomaly"]["flagged"]) for lab, r in zip(labels, results) if "flagged" in r["anomaly"]]
    if not rows:
        return ""
    return markdown_table(["fold (test records)", "threshold", "flagged", "V recall %", "V precision %",
                           "not-N precision %", "N flagged %"],
                          [(lab, f"{f['threshold']:.4g}", f["flagged"], _f(f["v_recall"], 1), _f(f["v_precision"], 1),
                            _f(f["not_n_precision"], 1), _f(f["n_flagged"], 1)) for lab, f in rows])


def report(results: list[dict], folds: list[list[str]], paced_res: dict | None, args: dict, total: float) -> str:
    """The Markdown report of a cross-validation run."""
    n = sum(len(f) for f in folds)
    labels = [f"{k + 1} ({' '.join(f)})" for k, f in enumerate(folds)]
    lead = f"lead {args['lead']}" + (f", checked on lead {args['confirm_lead']}" if args.get("confirm_lead") is not None else "")
    jit = [r["detection"]["jitter_ms"] for r in results if r["detection"].get("jitter_ms") is not None]
    out = [f"## MIT-BIH, {lead}: {len(folds)}-fold leave-records-out cross-validation "
           f"({n} non-paced records)",
           "", detection_table(results, f"Detection, {n} non-paced records"), "",
           f"Beat timing: median |detected - reference| per fold {', '.join(f'{j:.1f}' for j in jit)} ms; JF-style "
           f"score (F1 / (1 + jitter / 10 ms)) per fold {', '.join(_f(r['detection']['jf'], 1) for r in results)} %.",
           "", per_record_table(results), "",
           f"**Anomaly ranking per fold** (LightVAE {args['epochs']} epochs, batch {args['batch_size']}, seed "
           f"{args['seed']}, beats scaled per {args['scale']}; baselines: PyOD on the same rows). Kept beats, as the "
           "pipeline scores them:", "", anomaly_table(results, labels), "",
           "All detected beats (longer ones cut to the row):", "", anomaly_table(results, labels, True), "",
           "**Mean ± sd over the folds**", "", mean_table(results), "",
           "**Flagged beats per fold** (the trained model's threshold, from its training records' scores as in "
           "`model.json`, which `beatflow score` applies to new recordings; V recall: share of the V beats flagged; "
           "precision: share of the flagged beats that are V, or not N):", "", flagged_table(results, labels), "",
           "**Beat classes** (`beatflow.score.classes`, gross over the test records, kept beats matched to an AAMI "
           "beat):", "", classes_table(results), "",
           "**Beats scored** (matched to a reference beat; the pipeline keeps beats of at least 0.4 s, cutting rows at 1.024 s):", "",
           coverage_table(results), ""]
    if paced_res is not None:
        paced = paced_res["records"]["test"]
        out += ["## Paced records (trained on the 22 non-paced records)", "",
                detection_table([paced_res], "Detection, paced records " + " ".join(paced)), "",
                per_record_table([paced_res]), "",
                anomaly_table([paced_res], ["paced, kept beats"]), "",
                anomaly_table([paced_res], ["paced, all detected beats"], True), ""]
    out.append(f"total time {total:.0f} s")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    ap.add_argument("--lead", type=int, default=0)
    ap.add_argument("--confirm-lead", type=int, default=None,
                    help="a second channel that checks the beats (beatflow.detect.leads, as beatflow evaluate --confirm-lead)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", choices=("record", "pooled"), default="pooled",
                    help="pooled: one scale for the model, as the flow has (default); record: each record its own")
    ap.add_argument("--no-paced", action="store_true", help="skip the paced-records run")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--from-json", help="only print the report of a previous run's --json")
    args = ap.parse_args(argv)

    if args.from_json:
        with open(args.from_json) as f:
            d = json.load(f)
        print(report(d["folds"], d["fold_records"], d["paced"], d["args"], d["seconds"]))
        return 0
    print_header()
    t0 = time.perf_counter()
    names = sorted(Path(p).name for p in list_records(args.data))
    non_paced = [n for n in names if n not in PACED_RECORDS]
    paced = [n for n in names if n in PACED_RECORDS]
    recs = {n: load_record(str(Path(args.data) / n), args.lead, second=args.confirm_lead) for n in names}
    folds = [non_paced[k:: args.folds] for k in range(args.folds)]
    cache: dict = {}
    kw = dict(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, scale=args.scale, cache=cache,
              log=lambda m: print("  " + m, file=sys.stderr, flush=True))
    results = []
    for k, fold in enumerate(folds):
        train = [recs[n] for n in non_paced if n not in fold]
        print(f"fold {k + 1}/{len(folds)}: test {' '.join(fold)}", file=sys.stderr, flush=True)
        results.append(evaluate(train, [recs[n] for n in fold], **kw))
    paced_res = None
    if paced and not args.no_paced:
        print(f"paced: test {' '.join(paced)}", file=sys.stderr, flush=True)
        paced_res = evaluate([recs[n] for n in non_paced], [recs[n] for n in paced], **kw)
    total = time.perf_counter() - t0
    print(report(results, folds, paced_res, vars(args), total))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"folds": results, "fold_records": folds, "paced": paced_res, "args": vars(args),
                       "seconds": total}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

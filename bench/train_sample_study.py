"""How many beats the LightVAE needs: the training sample's size against what the model gives on unseen patients.

The 22 non-paced MIT-BIH records in the 5 folds of ``bench/evaluate_mitdb.py`` (sorted names, fold k = every
5th from k). For each fold and each sample size, the model is trained (10 epochs, batch 1024, seed 0) on
:func:`beatflow.model.sample.training_sample` of the other folds' kept beats (at most that many, stratified by
record and over time), as the flow's model input (:mod:`beatflow.score.rule`, the pooled scale), and judged on
the fold's records: the mean score of their beats (the reconstruction error: the test loss on unseen patients),
the V-vs-N and S-vs-N ROC-AUC, and the training's seconds. The table: mean ± sd over the folds.

    python bench/train_sample_study.py [--data ../shared/data/mitdb] [--sizes 5000 10000 20000 50000 0]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_header, print_table  # noqa: E402
from beatflow.model.sample import training_sample  # noqa: E402
from beatflow.model.train import train_vae  # noqa: E402
from beatflow.model.vae import score_beats  # noqa: E402
from beatflow.score.evaluate import (PACED_RECORDS, anomaly_metrics, list_records, load_record,  # noqa: E402
                                     model_inputs, record_beats, scaled_rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mitdb"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 10000, 20000, 50000, 0],
                    help="sample sizes (0: all the training beats)")
    ap.add_argument("--epochs", type=int, default=10)
    a = ap.parse_args(argv)
    print_header("bench/train_sample_study.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    import torch

    torch.set_num_threads(1)
    names = sorted(Path(s).name for s in list_records(a.data) if Path(s).name not in PACED_RECORDS)
    beats = {n: record_beats(load_record(str(Path(a.data) / n))) for n in names}
    folds = [names[k::5] for k in range(5)]
    out = {size: {"loss": [], "auc_v": [], "auc_s": [], "s": [], "rows": []} for size in a.sizes}
    for k, test in enumerate(folds):
        train = [beats[n] for n in names if n not in test]
        x, scale = scaled_rows(train, "pooled")
        xt = model_inputs([beats[n] for n in test], scale)
        labels = np.concatenate([beats[n].label for n in test])
        for size in a.sizes:
            pick = training_sample([len(b.rows) for b in train], size or None)
            t = time.perf_counter()
            res = train_vae(np.ascontiguousarray(x[pick]), epochs=a.epochs, batch_size=1024, seed=0)
            sec = time.perf_counter() - t
            sc, _ = score_beats(res.model, xt)
            m = anomaly_metrics(sc, labels)
            for key, v in (("loss", float(np.mean(sc))), ("auc_v", m["auc_v"]), ("auc_s", m["auc_s"]), ("s", sec),
                           ("rows", len(pick))):
                out[size][key].append(v)
            print(f"fold {k + 1}, {len(pick)} beats: held-out loss {np.mean(sc):.5f}, V AUC {m['auc_v']:.3f}, "
                  f"S AUC {m['auc_s']:.3f}, {sec:.1f} s", flush=True)

    def ms(v, f="{:.3f}"):
        v = [u for u in v if u == u]
        return (f.format(statistics.mean(v)) + " ± " + f.format(statistics.stdev(v))) if len(v) > 1 else "–"

    print()
    print_table(["sample (beats)", "beats trained on (mean)", "held-out loss", "V-vs-N ROC-AUC", "S-vs-N ROC-AUC",
                 "training s (1 thread)"],
                [[str(size or "all"), f"{statistics.mean(r['rows']):,.0f}", ms(r["loss"], "{:.5f}"), ms(r["auc_v"]),
                  ms(r["auc_s"]), ms(r["s"], "{:.1f}")] for size, r in out.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

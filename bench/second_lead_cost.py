"""What a second lead costs on the CPU: per MIT-BIH record, the first lead's detection
(``detect_peaks``) beside the second lead's steps (``beatflow.detect.leads``): rule 1 (``flutter_keep``: the
window energies of both leads and the near-median fractions where the rule reads them), the peaks'
measures (``peak_measures``), rules 2 and 3 (``doubtful``, ``misplaced``). Best of ``--repeat`` calls
each (one thread, after a warm-up call that compiles the Numba loops), and the peaks, to check that
variants give the same result::

    .venv/bin/python bench/second_lead_cost.py [--data ../shared/data/mitdb] [--records 207,203,101,118]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beatflow.detect import leads as LD
from beatflow.score.evaluate import load_record  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402
from beatflow.detect.peaks import detect_peaks  # noqa: E402


def best(fn, repeat: int):
    out, t = None, float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return out, t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    ap.add_argument("--records", default="207,203,101,118")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print("| record | detect_peaks s | rule 1 (flutter_keep) s | measures s | rules 2+3 s | second lead / detection | peaks kept | moved |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.records.split(","):
        r = load_record(str(Path(args.data) / name), 0, second=1)
        s, q = SegmentParams().samples(r.fs), LD.SecondLeadParams().samples(r.fs)
        n = r.signal.shape[0]
        detect_peaks(r.signal, s)  # (warm-up: the Numba loops compile)
        peaks, t_det = best(lambda: detect_peaks(r.signal, s), args.repeat)
        (keep, _), t_r1 = best(lambda: LD.flutter_keep(r.signal, r.second, peaks, 0, s, q, (0, n)), args.repeat)
        rest = peaks[keep]
        m, t_m = best(lambda: LD.peak_measures(r.signal, r.second, rest, 0, n, s, q), args.repeat)

        def rules_2_3():
            drop = LD.doubtful(*m[:3], q)
            return LD.misplaced(rest[~drop], *(v[~drop] for v in m), q, s.refractory, s.twave)

        (move, final), t_23 = best(rules_2_3, args.repeat)
        extra = t_r1 + t_m + t_23
        print(f"| {name} | {t_det:.4f} | {t_r1:.4f} | {t_m:.4f} | {t_23:.4f} | {extra / t_det:.2f} | "
              f"{final.shape[0]} | {int(move.sum())} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

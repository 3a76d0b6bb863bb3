"""MIT-BIH (22 non-paced records, lead 0): the "misplaced" false positives outside VF episodes, i.e.
those with a missed reference beat within 0.45 s (session 16).

For each: record, time, offset of the missed beat, the QRS envelope at the detection and its maximum
within 150 ms of the missed beat, the steepest slopes there, the intervals to the neighbouring
detections; and how many of the missed beats have no envelope maximum of their own (the window's
maximum lies at its edge: the envelope merges the beat with the detected peak)::

    .venv/bin/python bench/misplaced_study.py [--data ../shared/data/mitdb]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beatflow.detect import peaks as S
from beatflow.score.evaluate import list_records, load_record  # noqa: E402
from beatflow.score.metrics import TOLERANCE_S, match_beats  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402

NON_PACED = "101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230".split()
NEAR_S = 0.45


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    args = ap.parse_args()
    print(f"{'rec':>4} {'t s':>8} {'dt s':>6} {'envF':>7} {'envG':>7} {'slF':>7} {'slG':>7} "
          f"{'rrF-':>5} {'rrF+':>5} {'own max':>7}")
    n = own = 0
    for stem in list_records(args.data, NON_PACED):
        rec = load_record(stem)
        s = SegmentParams().samples(rec.fs)
        pk, _ = S.detect_beats(rec.signal, s)
        ref, _ = rec.beats
        for a, b in rec.vf_episodes():
            pk = pk[(pk < a) | (pk > b)]
            ref = ref[(ref < a) | (ref > b)]
        tol = int(round(TOLERANCE_S * rec.fs))
        _, m = match_beats(np.sort(pk), ref, tol)
        matched = np.zeros(len(pk), bool)
        matched[m[m >= 0]] = True
        fns = ref[m < 0]
        env = S.qrs_envelope(rec.signal, s)
        for f in pk[~matched]:
            near = fns[np.abs(fns - f) < NEAR_S * rec.fs]
            if len(near) == 0:
                continue
            g = near[np.argmin(np.abs(near - f))]
            lo, hi = max(g - tol, 0), min(g + tol + 1, len(env))
            gi = lo + int(np.argmax(env[lo:hi]))
            has_own = gi not in (lo, hi - 1)
            sl = S.steepest_at(rec.signal, np.array([f, gi]), s)
            i = int(np.searchsorted(pk, f))
            prev = (f - pk[i - 1]) / rec.fs if i > 0 else np.nan
            nxt = (pk[i + 1] - f) / rec.fs if i + 1 < len(pk) else np.nan
            print(f"{rec.name:>4} {f / rec.fs:8.2f} {(g - f) / rec.fs:6.2f} {env[f]:7.3f} {env[gi]:7.3f} "
                  f"{sl[0]:7.3f} {sl[1]:7.3f} {prev:5.2f} {nxt:5.2f} {str(has_own):>7}")
            n += 1
            own += has_own
    print(f"{n} misplaced false positives; {n - own} of their missed beats have no envelope maximum of their own")
    return 0


if __name__ == "__main__":
    sys.exit(main())

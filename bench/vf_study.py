"""Beat detection on the local MIT-BIH records with and without the VF/flutter episode rule.

Runs :func:`beatflow.detect.peaks.detect_peaks` on channel 0 of every record (no VAE), matches against
all beat annotations (150 ms), and prints gross Se/PPV over the 22 non-paced records (all beats and
VF episodes excluded), the 4 paced records apart, the per-record FP/FN changes against the rule
switched off (``vf_baseline_ratio=0``), and, with ``--grid``, a small sensitivity grid.

    .venv/bin/python bench/vf_study.py [--data ../shared/data/mitdb] [--grid]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from beatflow.score.evaluate import PACED_RECORDS, detection_of, list_records, load_record  # noqa: E402
from beatflow.score.metrics import Detection  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402
from beatflow.detect.peaks import detect_peaks  # noqa: E402

NON_PACED = ("101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230").split()


def run(records, params: SegmentParams) -> dict:
    """Per record: (all beats, VF excluded) detections, and the number of detected peaks."""
    out = {}
    for rec in records:
        peaks = detect_peaks(rec.signal, params.samples(rec.fs))
        out[rec.name] = (detection_of(peaks, rec), detection_of(peaks, rec, exclude_vf=True))
    return out


def gross(res: dict, names, vf: bool = False) -> Detection:
    tot = Detection(0, 0, 0)
    for n in names:
        if n in res:
            tot = tot + res[n][1 if vf else 0]
    return tot


def line(label: str, d: Detection) -> str:
    return f"| {label} | {100 * d.se:.3f} | {100 * d.ppv:.3f} | {d.tp} | {d.fp} | {d.fn} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    ap.add_argument("--grid", action="store_true", help="also a sensitivity grid of the rule's parameters")
    args = ap.parse_args()
    records = [load_record(p) for p in list_records(args.data)]
    paced = [r.name for r in records if r.name in PACED_RECORDS]
    on_p, off_p = SegmentParams(), SegmentParams(vf_baseline_ratio=0.0)
    on, off = run(records, on_p), run(records, off_p)
    print("| detection | Se % | PPV % | TP | FP | FN |\n|---|---|---|---|---|---|")
    for label, res in (("rule off", off), ("rule on", on)):
        print(line(f"{label}, 22 non-paced, all beats", gross(res, NON_PACED)))
        print(line(f"{label}, 22 non-paced, VF excluded", gross(res, NON_PACED, vf=True)))
        print(line(f"{label}, 4 paced", gross(res, paced)))
    print("\nper-record changes (rule on − rule off), all beats:\n\n| record | ΔFP | ΔFN (true beats removed) |\n|---|---|---|")
    for name in sorted(on):
        dfp = on[name][0].fp - off[name][0].fp
        dfn = on[name][0].fn - off[name][0].fn
        if dfp or dfn:
            print(f"| {name} | {dfp:+d} | {dfn:+d} |")
    if args.grid:
        print("\nsensitivity (22 non-paced, all beats): baseline ratio × max frequency × min windows\n")
        print("| baseline | f max Hz | min windows | context | Se % | PPV % | FP | FN | records losing beats |")
        print("|---|---|---|---|---|---|---|---|---|")
        for b, f, L, c in itertools.product((0.3, 0.35, 0.4), (4.5, 5.5, 6.5), (3, 5, 7), (1, 2)):
            p = replace(on_p, vf_baseline_ratio=b, vf_max_freq_hz=f, vf_min_windows=L, vf_context=c)
            res = run([r for r in records if r.name in NON_PACED], p)
            d = gross(res, NON_PACED)
            lost = {n: res[n][0].fn - off[n][0].fn for n in res if res[n][0].fn != off[n][0].fn}
            print(f"| {b} | {f} | {L} | {c} | {100 * d.se:.3f} | {100 * d.ppv:.3f} | {d.fp} | {d.fn} | {lost} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

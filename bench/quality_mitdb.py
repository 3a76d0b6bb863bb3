"""Signal quality (:mod:`beatflow.detect.quality`) on the local MIT-BIH records and on pure noise.

Per record (lead 0): the seconds called unreadable, the annotated beats inside unreadable windows, and
the detection (150 ms) without and with the quality rule; the gross figures; the features' extremes
that the thresholds are checked against (beat windows of the records; white and uniform noise at 250
and 360 Hz, 1 h each); whether the synthetic ECG (0.5 h) is readable; and the quality rule's time beside
the detection's on the longest record.

    .venv/bin/python bench/quality_mitdb.py [--data ../shared/data/mitdb]

Results: ``bench/results/quality.md``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import print_header  # noqa: E402

from beatflow.detect import detect_peaks, quality_rule  # noqa: E402
from beatflow.detect import quality as Q  # noqa: E402
from beatflow.detect.quality import REASONS, window_features  # noqa: E402
from beatflow.params import QualityParams, SegmentParams  # noqa: E402
from beatflow.score.evaluate import detection_of, list_records, load_record  # noqa: E402
from beatflow.score.metrics import Detection  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mitdb"))
    args = ap.parse_args()
    print_header()
    qp = QualityParams()
    print(f"quality parameters: {qp.to_dict()}\n")
    before, after = Detection(0, 0, 0), Detection(0, 0, 0)
    total_s = bad_s = 0.0
    beats = lost = 0
    worst = {"hf_share_lowkurt": (0.0, ""), "pinned": (0.0, ""), "levels": (np.inf, "")}
    print("| record | hours | unreadable s | reasons | beats | beats in unreadable windows | Se/PPV before % | Se/PPV after % |")
    print("|---|---|---|---|---|---|---|---|")
    for stem in list_records(args.data):
        rec = load_record(stem)
        s, q = SegmentParams().samples(rec.fs), qp.samples(rec.fs)
        peaks = np.asarray(detect_peaks(rec.signal, s))
        keep, spans, reasons = quality_rule(rec.signal, peaks, 0, q)
        ref, _ = rec.beats
        inside = np.zeros(ref.shape[0], bool)
        for a, b in spans:
            inside |= (ref >= a) & (ref < b)
        d0, d1 = detection_of(peaks, rec), detection_of(peaks[keep], rec)
        before, after = before + d0, after + d1
        sec = float((spans[:, 1] - spans[:, 0]).sum()) / rec.fs
        total_s += rec.signal.shape[0] / rec.fs
        bad_s += sec
        beats += ref.shape[0]
        lost += int(inside.sum())
        why = ", ".join(sorted({REASONS[int(r)] for r in reasons})) or "-"
        print(f"| {rec.name} | {rec.signal.shape[0] / rec.fs / 3600:.2f} | {sec:.0f} | {why} | {ref.shape[0]} | "
              f"{int(inside.sum())} | {100 * d0.se:.2f} / {100 * d0.ppv:.2f} | {100 * d1.se:.2f} / {100 * d1.ppv:.2f} |")
        levels, pinned, kurt, hf, w0 = window_features(rec.signal, 0, q)
        with_beats = np.bincount(ref // q.window - w0, minlength=levels.shape[0])[: levels.shape[0]] > 0
        low = with_beats & (kurt < q.kurtosis)
        if low.any() and hf[low].max() > worst["hf_share_lowkurt"][0]:
            worst["hf_share_lowkurt"] = (float(hf[low].max()), rec.name)
        if pinned[with_beats].max() > worst["pinned"][0]:
            worst["pinned"] = (float(pinned[with_beats].max()), rec.name)
        if levels[with_beats].min() < worst["levels"][0]:
            worst["levels"] = (float(levels[with_beats].min()), rec.name)
    print(f"\ngross: {total_s / 3600:.2f} h, {bad_s:.0f} s unreadable ({100 * bad_s / total_s:.3f} %); "
          f"{lost} of {beats} annotated beats in unreadable windows")
    print(f"detection before: Se {100 * before.se:.3f} % PPV {100 * before.ppv:.3f} % (tp {before.tp} fp {before.fp} "
          f"fn {before.fn}); after: Se {100 * after.se:.3f} % PPV {100 * after.ppv:.3f} % (tp {after.tp} fp {after.fp} "
          f"fn {after.fn})")
    print("windows with annotated beats: largest high-band share among those with kurtosis < limit "
          f"{worst['hf_share_lowkurt'][0]:.3f} ({worst['hf_share_lowkurt'][1]}); largest share at a rail "
          f"{worst['pinned'][0]:.3f} ({worst['pinned'][1]}); smallest range {worst['levels'][0]:.0f} steps "
          f"({worst['levels'][1]})")
    rng = np.random.default_rng(0)
    for fs in (250.0, 360.0):
        q = qp.samples(fs)
        for name, x in (("white", rng.normal(size=int(3600 * fs))), ("uniform", rng.uniform(-1, 1, int(3600 * fs)))):
            x = x.astype(np.float32)
            _, _, kurt, hf, _ = window_features(x, 0, q)
            _, spans, _ = quality_rule(x, np.zeros(0, np.int64), 0, q)
            sec = float((spans[:, 1] - spans[:, 0]).sum()) / fs
            print(f"{name} noise, 1 h at {fs:g} Hz: kurtosis max {kurt.max():.2f}, high-band share min {hf.min():.3f}; "
                  f"unreadable {sec:.0f} of 3600 s")
    from beatflow.io.synth import synthesize_ecg

    syn = synthesize_ecg(hours=0.5)
    _, spans, _ = quality_rule(syn.signal, np.zeros(0, np.int64), 0, qp.samples(syn.fs))
    print(f"synthetic ECG 0.5 h: {float((spans[:, 1] - spans[:, 0]).sum()) / syn.fs:.0f} s unreadable")
    rec = load_record(list_records(args.data)[0])
    s, q = SegmentParams().samples(rec.fs), qp.samples(rec.fs)
    detect_peaks(rec.signal[:10000], s)
    quality_rule(rec.signal[:10000], np.zeros(0, np.int64), 0, q)
    t_det, t_q, t_xp = [], [], []
    for _ in range(5):
        t = time.perf_counter()
        peaks = detect_peaks(rec.signal, s)
        t_det.append(time.perf_counter() - t)
        t = time.perf_counter()
        quality_rule(rec.signal, peaks, 0, q)
        t_q.append(time.perf_counter() - t)
        t = time.perf_counter()
        Q.quality_rule(rec.signal, peaks, 0, q)
        t_xp.append(time.perf_counter() - t)
    print(f"record {rec.name} ({rec.signal.shape[0]:,} samples): detect_peaks {1e3 * min(t_det):.1f} ms, "
          f"quality_rule {1e3 * min(t_q):.1f} ms (the CPU's loop), {1e3 * min(t_xp):.1f} ms (the array code); "
          "best of 5")


if __name__ == "__main__":
    main()

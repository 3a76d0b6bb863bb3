"""GPU: the detection kernels against the CPU path on real MIT-BIH records (peaks identical?).

The shared records are not sent to the GPU machine; ``--prepare`` (here) writes channel 0 of a few
records as float32 in one compressed file under the ignored ``.devdata/`` (carried with the run),
and the plain run (there) detects with ``segment.detect_peaks`` on NumPy and on CuPy and compares
the peaks, with the detection counts against the reference beats.

    .venv/bin/python bench/gpu_mitdb_check.py --prepare 108 203 116      # here
    python3 bench/gpu_mitdb_check.py                                     # on the GPU machine
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = os.path.join(ROOT, ".devdata", "mitdb_ch0.npz")


def prepare(names):
    from beatflow.evaluate import load_record

    data = {}
    for name in names:
        rec = load_record(os.path.join(ROOT, "..", "shared", "data", "mitdb", name))
        data[f"x{name}"] = rec.signal.astype(np.float32)
        data[f"ann{name}"] = rec.ann_sample.astype(np.int64)
        data[f"sym{name}"] = np.asarray(rec.ann_symbol).astype("U2")
    os.makedirs(os.path.dirname(FILE), exist_ok=True)
    np.savez_compressed(FILE, names=np.asarray(names), fs=np.float64(360.0), **data)
    print(FILE, os.path.getsize(FILE))


def check():
    import cupy

    from beatflow import segment as S
    from beatflow.evaluate import Record, detection_of
    from beatflow.params import SegmentParams

    d = np.load(FILE)
    s = SegmentParams().samples(float(d["fs"]))
    print(f"{'record':8s} {'CPU peaks':>9s} {'GPU peaks':>9s} {'sym. diff':>9s} {'Se %':>7s} {'PPV %':>7s} "
          f"{'CPU ms':>7s} {'GPU ms':>7s} {'episodes CPU/GPU, equal':>24s}")
    for name in d["names"]:
        x = d[f"x{name}"]
        t = time.perf_counter()
        pc, ec = S.detect_beats(x, s)
        tc = time.perf_counter() - t
        xg = cupy.asarray(x)
        S.detect_peaks(xg, s)
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        pg, eg = (cupy.asnumpy(a) for a in S.detect_beats(xg, s))
        tg = time.perf_counter() - t
        rec = Record(str(name), float(d["fs"]), x, d[f"ann{name}"], d[f"sym{name}"].astype(object).astype(str))
        det = detection_of(pg, rec, exclude_vf=True)
        print(f"{name:8s} {len(pc):9d} {len(pg):9d} {np.setxor1d(pc, pg).size:9d} {100 * det.se:7.2f} "
              f"{100 * det.ppv:7.2f} {tc * 1e3:7.1f} {tg * 1e3:7.2f} {len(ec):10d}/{len(eg)} {np.array_equal(ec, eg)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--prepare":
        prepare(sys.argv[2:])
    else:
        check()

"""GPU: the detection kernels against the CPU path on real MIT-BIH records (peaks identical?).

The shared records are not sent to the GPU machine; ``--prepare`` (here) writes channels 0 and 1 of
a few records as float32 in one compressed file under the ignored ``.devdata/`` (carried with the
run), and the plain run (there) detects with ``beatflow.detect.detect_peaks`` on NumPy and on CuPy and
compares the peaks, with the detection counts against the reference beats; then the second lead's
three rules (``beatflow.detect.second_lead_peaks``, lead 1 checking lead 0) on both, with the peaks they drop
and move. ``--numpy`` runs the same comparison with NumPy on both sides (a check of the script).

    .venv/bin/python bench/gpu_mitdb_check.py --prepare 108 203 207      # here
    python3 bench/gpu_mitdb_check.py                                     # on the GPU machine (bash bench/gpu.sh mitdb)

Results: ``bench/results/gpu.md``.
"""
from __future__ import annotations

import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import numpy as np  # noqa: E402

from common import Table, print_header  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = os.path.join(ROOT, ".devdata", "mitdb_ch0.npz")


def prepare(names):
    from beatflow.score.evaluate import load_record

    data = {}
    for name in names:
        rec = load_record(os.path.join(ROOT, "..", "shared", "data", "mitdb", name), second=1)
        data[f"x{name}"] = rec.signal.astype(np.float32)
        data[f"y{name}"] = rec.second.astype(np.float32)
        data[f"ann{name}"] = rec.ann_sample.astype(np.int64)
        data[f"sym{name}"] = np.asarray(rec.ann_symbol).astype("U2")
    os.makedirs(os.path.dirname(FILE), exist_ok=True)
    np.savez_compressed(FILE, names=np.asarray(names), fs=np.float64(360.0), **data)
    print(FILE, os.path.getsize(FILE))


def check(numpy_only: bool = False):
    if numpy_only:
        import types

        cupy = types.SimpleNamespace(asarray=np.asarray, asnumpy=np.asarray, cuda=types.SimpleNamespace(
            Device=lambda: types.SimpleNamespace(synchronize=lambda: None)))
    else:
        import cupy

    import beatflow.detect as S
    import beatflow.detect as LD
    from beatflow.score.evaluate import Record, detection_of
    from beatflow.params import SegmentParams

    d = np.load(FILE)
    s = SegmentParams().samples(float(d["fs"]))
    print_header()
    table = Table(["record", "CPU peaks", "GPU peaks", "sym. diff", "Se %", "PPV %", "CPU ms", "GPU ms",
                   "episodes CPU/GPU, equal", "dropped, moved CPU/GPU"], "lrrrrrrrll")
    table.header()
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
        table.row(name, len(pc), len(pg), np.setxor1d(pc, pg).size, f"{100 * det.se:.2f}", f"{100 * det.ppv:.2f}",
                  f"{tc * 1e3:.1f}", f"{tg * 1e3:.2f}", f"{len(ec)}/{len(eg)} {np.array_equal(ec, eg)}", "")
        if f"y{name}" not in d:
            continue
        y = d[f"y{name}"]
        t = time.perf_counter()
        qc, epc, dc, mc = LD.second_lead_peaks(x, y, pc, float(d["fs"]), s)
        tc = time.perf_counter() - t
        yg = cupy.asarray(y)
        t = time.perf_counter()
        qg, epg, dg, mg = LD.second_lead_peaks(xg, yg, cupy.asarray(pc), float(d["fs"]), s)
        qg, epg = cupy.asnumpy(qg), cupy.asnumpy(epg)
        tg = time.perf_counter() - t
        det = detection_of(qg, rec)
        table.row(f"{name} + lead 1", len(qc), len(qg), np.setxor1d(qc, qg).size, f"{100 * det.se:.2f}",
                  f"{100 * det.ppv:.2f}", f"{tc * 1e3:.1f}", f"{tg * 1e3:.2f}",
                  f"{len(epc)}/{len(epg)} {np.array_equal(epc, epg)}", f"dropped {dc}/{dg}, moved {mc}/{mg}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--prepare":
        prepare(sys.argv[2:])
    else:
        check(numpy_only="--numpy" in sys.argv[1:])

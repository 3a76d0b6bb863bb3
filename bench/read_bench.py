"""Reading one long two-lead recording as beatflow's sources do: the same record in EDF (pyedflib), in BDF and
in WFDB (format 16, the same 2 bytes a sample as EDF, and format 212, MIT-BIH's 12-bit packing). Results:
bench/results/inputs.md.

The record: ``HOURS`` (default 24) hours at 360 Hz, two channels, from the synthetic ECG
(``beatflow.io.synth.synthesize_ecg``, seed 1: lead ``MLII``; lead ``V5`` is the generator's seed 2), written
once into ``bench/out/read_bench/`` (ignored by git; kept between runs, rewritten when ``--rewrite`` is given).

For each format, timed in turn (formats interleaved, so that a busy moment of the shared machine hits all
alike), the median and the spread of ``REPEATS``:

* ``open``: ``beatflow.io.sources.open_source(path, lead="MLII")``: the header read and checked, what
  ``beatflow run`` does before anything starts;
* ``read, N partitions``: every partition of the first lead read by ``Source.read`` in one process, one after
  the other, and concatenated (the sum of what the workers read), for N = 1 and 16.

The files are read from the page cache (they were just written or read): what is measured is the readers'
own cost (parsing, conversion to float32 millivolts), not the disk. Every read is checked against the
first format's samples (within the formats' quantisation).

    .venv/bin/python bench/read_bench.py [--hours 24] [--repeats 5] [--rewrite]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from common import Table, print_header, timed  # noqa: E402

FS = 360
LABELS = ("MLII", "V5")
OUT = Path(ROOT) / "bench" / "out" / "read_bench"
PHYS_MV = (-10.0, 10.0)  # the EDF channels' physical range


def _signals(hours: float) -> np.ndarray:
    from beatflow.io.synth import synthesize_ecg

    a = synthesize_ecg(hours=hours, fs=float(FS), seed=1).signal
    b = synthesize_ecg(hours=hours, fs=float(FS), seed=2).signal
    return np.clip(np.stack([a, b], axis=1).astype(np.float64), *PHYS_MV)


def _write_edf(path: Path, sig: np.ndarray, bdf: bool) -> None:
    import pyedflib

    digital = (-(1 << 23), (1 << 23) - 1) if bdf else (-32768, 32767)
    kind = pyedflib.FILETYPE_BDFPLUS if bdf else pyedflib.FILETYPE_EDFPLUS
    with pyedflib.EdfWriter(str(path), sig.shape[1], file_type=kind) as w:
        w.setSignalHeaders([dict(label=lb, dimension="mV", sample_frequency=FS, physical_min=PHYS_MV[0],
                                 physical_max=PHYS_MV[1], digital_min=digital[0], digital_max=digital[1],
                                 transducer="", prefilter="") for lb in LABELS])
        step = FS * 3600  # an hour at a time (whole data records of 1 s)
        for a in range(0, sig.shape[0], step):
            w.writeSamples([np.ascontiguousarray(sig[a : a + step, k]) for k in range(sig.shape[1])])


def _write_wfdb(folder: Path, sig: np.ndarray, fmt: str) -> None:
    import wfdb

    folder.mkdir(parents=True, exist_ok=True)
    wfdb.wrsamp("rec", fs=FS, units=["mV", "mV"], sig_name=list(LABELS), p_signal=sig, fmt=[fmt, fmt],
                adc_gain=[200.0, 200.0], baseline=[0, 0], write_dir=str(folder))


def prepare(hours: float, rewrite: bool) -> dict[str, Path]:
    """``{format: input path}``, written when missing (or when ``rewrite``)."""
    paths = {"EDF+ (16 bit)": OUT / "rec.edf", "BDF+ (24 bit)": OUT / "rec.bdf",
             "WFDB format 16": OUT / "wfdb16", "WFDB format 212": OUT / "wfdb212"}
    stamp = OUT / f"hours-{hours:g}"
    if not rewrite and stamp.exists() and all(p.exists() for p in paths.values()):
        return paths
    import shutil

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    sig, s = timed(_signals, hours)
    print(f"synthetic ECG, {hours:g} h x 2 leads at {FS} Hz: {s:.1f} s", flush=True)
    for name, p in paths.items():
        t = time.perf_counter()
        if name.startswith("EDF"):
            _write_edf(p, sig, bdf=False)
        elif name.startswith("BDF"):
            _write_edf(p, sig, bdf=True)
        else:
            _write_wfdb(p, sig, name.split()[-1])
        print(f"wrote {name}: {time.perf_counter() - t:.1f} s", flush=True)
    stamp.touch()
    return paths


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


def _read_all(path: Path, parts: int) -> np.ndarray:
    from beatflow.io.sources import open_source

    src = open_source(path, lead="MLII")
    return np.concatenate([src.read(sp) for sp in src.plan(parts)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rewrite", action="store_true", help="write the files again")
    args = ap.parse_args()
    print_header("Reading a two-lead recording: EDF, BDF and WFDB")
    print(f"    .venv/bin/python bench/read_bench.py --hours {args.hours:g} --repeats {args.repeats}\n")
    from beatflow.io.sources import open_source

    paths = prepare(args.hours, args.rewrite)
    n = int(round(args.hours * 3600 * FS))
    ref = None
    for name, p in paths.items():  # (every reader once: warms the page cache and imports; checks the values)
        x = _read_all(p, 1)
        assert x.shape == (n,), (name, x.shape)
        if ref is None:
            ref = x
        else:  # format 212 holds 12 bits at 200 adu/mV (5 µV); EDF's 16 bits span 20 mV (0.3 µV)
            err = float(np.abs(x - ref).max())
            assert err <= 0.006, (name, err)
    cases = [("open", lambda p: open_source(p, lead="MLII"))]
    cases += [(f"read, {k} partition{'s' * (k > 1)}", lambda p, k=k: _read_all(p, k)) for k in (1, 16)]
    times = {(c, f): [] for c, _ in cases for f in paths}
    for _ in range(args.repeats):
        for c, fn in cases:
            for f, p in paths.items():
                times[c, f].append(timed(fn, p)[1])
    t = Table(["format", "file (MB)", *[f"{c} ({'ms' if c == 'open' else 's'})" for c, _ in cases],
               "read, 1 partition (M samples/s)"],
              "lrrrrr")
    t.header()
    for f, p in paths.items():
        cells = []
        for c, _ in cases:
            v = times[c, f]
            med = statistics.median(v)
            cells.append(f"{1e3 * med:.2f} ({1e3 * min(v):.2f}-{1e3 * max(v):.2f})" if c == "open"
                         else f"{med:.2f} ({min(v):.2f}-{max(v):.2f})")
        rate = n / statistics.median(times["read, 1 partition", f]) / 1e6
        t.row(f, f"{_size(p) / 1e6:.1f}", *cells, f"{rate:.1f}")
    print(f"\n{n} samples a lead ({args.hours:g} h at {FS} Hz), 2 leads a file; the median of {args.repeats} "
          f"(min-max); the first lead read as float32 mV")


if __name__ == "__main__":
    main()

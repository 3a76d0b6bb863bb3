"""Stage times of the pipeline on the 20-hour synthetic ECG, and segmentation beside NeuroKit2.

    .venv/bin/python bench/pipeline_bench.py [--hours 20] [--end-to-end]

Prints the machine header and a markdown table (``bench/results/detection.md``; the ``--end-to-end`` rows:
``bench/results/flow.md``). With ``--end-to-end`` it also runs ``beatflow run`` (the default job) and reports
its per-stage times.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import print_header, print_table, timed  # noqa: E402


def segment_on_cluster(x, s, workers: int, whole):
    """Best-of-3 time of segmenting ``x`` as ``workers`` partitions (with halos) on a Dask LocalCluster.

    This is what the flow's segmentation task does: the partitions already live on the workers
    (scattered before the clock starts), each worker runs ``partitions.segment_partition`` on its
    own, only the peak indices come back.
    """
    from distributed import Client, LocalCluster

    from beatflow.embed.partitions import assemble_halos, edges, segment_partition
    from beatflow.pipeline.cluster import _configure_worker_spawn

    _configure_worker_spawn()  # as the flow does (and keeps this process's environment clean for the run below)
    from beatflow.io.sources import PartitionSpec, _split_even

    spans = _split_even(x.shape[0], workers)
    specs = [PartitionSpec(0, k, a, b) for k, (a, b) in enumerate(spans)]
    parts = [x[a:b] for a, b in spans]
    e = [edges(p, s.halo) for p in parts]
    lefts, rights, firsts = assemble_halos(specs, [len(p) for p in parts], [h for h, _ in e], [t for _, t in e],
                                           s.halo)
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        futs = [client.scatter(a, workers=[w]) for a, w in zip(parts, list(client.scheduler_info()["workers"]))]
        client.gather([client.submit(segment_partition, f, l, r, fi, s, pure=False)
                       for f, l, r, fi in zip(futs, lefts, rights, firsts)])  # compile / load the kernels
        best, out = float("inf"), None
        for _ in range(3):
            t = time.perf_counter()
            out = client.gather([client.submit(segment_partition, f, l, r, fi, s, pure=False)
                                 for f, l, r, fi in zip(futs, lefts, rights, firsts)])
            best = min(best, time.perf_counter() - t)
    return best, bool(np.array_equal(np.concatenate(out), whole))


def segment_and_class(x, fs: float, s) -> dict:
    """The peaks, the unreadable stretches' drop, the kept beats' rows and their classes of one stream, as
    the flow makes them (one process): the counts and the seconds of the steps after the peaks."""
    from beatflow.detect import detect_peaks, quality_rule
    from beatflow.embed import beat_rows
    from beatflow.params import QualityParams
    from beatflow.score.classes import classify, morphology, template

    peaks = detect_peaks(x, s)
    t0 = time.perf_counter()
    keep, _, _ = quality_rule(x, peaks, 0, QualityParams().samples(fs))
    peaks = peaks[keep]
    t1 = time.perf_counter()
    kb, peak, start, length, rows, _ = beat_rows(x, peaks, s, x.shape[0], baseline_samples=max(1, s.pre // 2))
    t2 = time.perf_counter()
    dev = morphology(rows, template(rows, fs, s.pre), fs, s.pre)
    cls, _ = classify({0: peaks}, peak, np.zeros(len(peak), np.int64), dev, fs)
    t3 = time.perf_counter()
    return {"beats": int(len(cls)), "V": int((cls == "V").sum()), "S": int((cls == "S").sum()),
            "quality_s": t1 - t0, "rows_s": t2 - t1, "classes_s": t3 - t2}


def mitdb_rows(folder, skip_neurokit: bool) -> list:
    """Segmentation of the concatenated MIT-BIH records (channel 0), beatflow beside NeuroKit2.

    Detection quality is scored per record (the concatenation joins unrelated patients), against
    all beat annotations, 150 ms tolerance.
    """
    from beatflow.score.evaluate import detection_of, list_records, load_record
    from beatflow.params import SegmentParams
    from beatflow.detect import detect_peaks

    recs = [load_record(stem) for stem in list_records(folder)]
    x = np.concatenate([r.signal for r in recs]).astype(np.float32)
    fs = recs[0].fs
    n = x.shape[0]
    s = SegmentParams().samples(fs)
    detect_peaks(x[: int(60 * fs)], s)  # kernels compiled / loaded
    _, t = min((timed(detect_peaks, x, s) for _ in range(3)), key=lambda r: r[1])
    tp = fp = fn = 0
    for r in recs:
        d = detection_of(np.asarray(detect_peaks(r.signal, s)), r)
        tp, fp, fn = tp + d.tp, fp + d.fp, fn + d.fn
    name = f"MIT-BIH {len(recs)} records concatenated ({n / fs / 3600:.1f} h at {fs:g} Hz)"
    out = [(f"{name}: beatflow, one process, best of 3", t, n / t,
            f"per record: Se {tp / (tp + fn):.4f} PPV {tp / (tp + fp):.4f}")]
    if not skip_neurokit:
        import neurokit2 as nk

        _, t1 = timed(nk.ecg_peaks, x, sampling_rate=int(fs))
        cleaned, t2 = timed(nk.ecg_clean, x, sampling_rate=int(fs))
        _, t3 = timed(nk.ecg_peaks, cleaned, sampling_rate=int(fs))
        out.append((f"{name}: NeuroKit2 ecg_peaks", t1, n / t1, f"beatflow {t1 / t:.1f}x"))
        out.append((f"{name}: NeuroKit2 ecg_clean + ecg_peaks", t2 + t3, n / (t2 + t3),
                    f"beatflow {(t2 + t3) / t:.1f}x"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=20.0)
    ap.add_argument("--end-to-end", action="store_true")
    ap.add_argument("--skip-neurokit", action="store_true")
    ap.add_argument("--mitdb", help="also compare the segmentation on these WFDB records, concatenated "
                                     "(e.g. ../shared/data/mitdb: 26 records, 13 h at 360 Hz)")
    args = ap.parse_args()

    import torch

    from beatflow.embed import embed
    from beatflow.embed.beats import beats_from_peaks, prune_mask
    from beatflow.score.metrics import match_beats
    from beatflow.params import SegmentParams
    from beatflow.detect import detect_peaks
    from beatflow.io.synth import synthesize_ecg

    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    ecg, t = timed(synthesize_ecg, args.hours, 250.0, 0)
    x, fs, n = ecg.signal, ecg.fs, ecg.signal.shape[0]
    rows.append(("synthesize", t, n / t, ""))
    s = SegmentParams().samples(fs)
    tol = int(0.15 * fs)
    _, t_first = timed(detect_peaks, x, s)  # the first call compiles the CPU kernels (or loads them from cache)
    peaks, t = min((timed(detect_peaks, x, s) for _ in range(3)), key=lambda r: r[1])
    d, _ = match_beats(peaks, ecg.r_peaks, tol)
    seg_rate = n / t
    rows.append(("segment (beatflow, whole stream, one process, best of 3)", t, seg_rate,
                 f"Se {d.se:.4f} PPV {d.ppv:.4f}; first call {t_first:.2f} s"))
    # what the flow does per beat beyond the peaks: the unreadable stretches, the rows, the classes
    full, t_full = min((timed(segment_and_class, x, fs, s) for _ in range(3)), key=lambda r: r[1])
    full_rate = n / t_full
    rows.append(("segment + quality + rows + classes (beatflow, one process, best of 3)", t_full, full_rate,
                 f"{full['V']} V, {full['S']} S of {full['beats']} beats; quality {full['quality_s']:.2f} s, "
                 f"rows {full['rows_s']:.2f} s, classes {full['classes_s']:.2f} s"))
    workers = os.cpu_count() or 1
    t_par, same = segment_on_cluster(x, s, workers, peaks)
    par_rate = n / t_par
    rows.append((f"segment (beatflow, {workers} partitions on a {workers}-worker Dask LocalCluster, best of 3)",
                 t_par, par_rate, f"peaks identical to the whole-stream run: {same}"))
    if not args.skip_neurokit:
        import neurokit2 as nk

        (_, info), t = timed(nk.ecg_peaks, x, sampling_rate=int(fs))
        d2, _ = match_beats(np.asarray(info["ECG_R_Peaks"]), ecg.r_peaks, tol)
        rows.append(("segment (NeuroKit2 ecg_peaks)", t, n / t, f"Se {d2.se:.4f} PPV {d2.ppv:.4f}; "
                     f"beatflow {seg_rate / (n / t):.1f}x (one process), {par_rate / (n / t):.1f}x (cluster), "
                     f"{full_rate / (n / t):.1f}x with quality, rows and classes"))
        cleaned, t1 = timed(nk.ecg_clean, x, sampling_rate=int(fs))
        (_, info), t2 = timed(nk.ecg_peaks, cleaned, sampling_rate=int(fs))
        d3, _ = match_beats(np.asarray(info["ECG_R_Peaks"]), ecg.r_peaks, tol)
        rows.append(("segment (NeuroKit2 ecg_clean + ecg_peaks)", t1 + t2, n / (t1 + t2),
                     f"Se {d3.se:.4f} PPV {d3.ppv:.4f}; beatflow {seg_rate / (n / (t1 + t2)):.1f}x (one process), "
                     f"{par_rate / (n / (t1 + t2)):.1f}x (cluster)"))
    if args.mitdb:
        rows += mitdb_rows(args.mitdb, args.skip_neurokit)
    peak, start, length = beats_from_peaks(peaks, s, n)
    kept = prune_mask(length, s.lower, s.upper)
    (rows_, p2p), t = timed(embed, x, start[kept], length[kept], s.width, baseline_samples=s.pre // 2)
    rows.append(("prune + embed", t, n / t, f"{kept.sum()} rows x {s.width}"))
    if args.end_to_end:
        out = Path(tempfile.mkdtemp()) / "run"
        t = time.perf_counter()
        r = subprocess.run([str(ROOT / ".venv/bin/beatflow"), "run", "--hours", str(args.hours), "--out", str(out)],
                           capture_output=True, text=True, cwd=ROOT)
        (ROOT / "bench" / "out").mkdir(exist_ok=True)
        (ROOT / "bench" / "out" / "pipeline_bench_run.log").write_text(r.stdout + r.stderr)
        wall = time.perf_counter() - t
        if r.returncode:
            print(r.stderr[-3000:])
            sys.exit(1)
        summ = json.loads((out / "summary.json").read_text())
        for k, v in summ["timings_s"].items():
            rows.append((f"beatflow run: {k}", v, n / v if k == "total" else float("nan"), ""))
        rows.append(("beatflow run: command wall time (server + cluster start included)", wall, n / wall,
                     f"Se {summ['truth']['se']:.4f} PPV {summ['truth']['ppv']:.4f} AUC {summ['truth']['auc']:.4f}"))
    print()
    print_header()
    print(f"{args.hours:g} h synthetic ECG at {fs:g} Hz = {n} samples\n")
    print_table(["stage", "seconds", "samples/s", "notes"],
                [(name, f"{sec:.2f}", f"{rate / 1e6:.1f} M" if rate == rate else "", note) for name, sec, rate, note in rows],
                "lrrl")


if __name__ == "__main__":
    main()

"""The cost of ``beatflow run`` as the hours grow: a cohort of synthetic recordings, each ``--record-hours`` long.

For each size (hours in all) the cohort's first ``size / record-hours`` recordings (synthetic, seeds 0, 1, ...;
written once as WFDB records in ``bench/out/scale/records``, ignored) are linked into a folder, and
``beatflow run --input <folder> --no-service --cache off`` runs on it in a fresh process, as a user's
first run on a new cohort. The table: the command's wall time and its seconds per hour, the flow's stages
(``summary.json`` ``timings_s``), the flow process's and the largest worker's peak RSS (``peak_rss_bytes``)
and the peak of the sum of the RSS of the command's whole process tree (sampled every 0.5 s with psutil).

    python bench/scale.py [--sizes 20,200,1000] [--record-hours 20] [--workers N] [-- extra run arguments]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, print_header, print_table  # noqa: E402

OUT = ROOT / "bench" / "out" / "scale"


def write_records(n: int, hours: float, folder: Path) -> list[Path]:
    """The first ``n`` synthetic recordings (seed = index) as WFDB records in ``folder`` (made once)."""
    import numpy as np
    import wfdb

    from beatflow.io.synth import synthesize_ecg

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        name = f"s{i:03d}"
        if not (folder / f"{name}.hea").exists():
            t = time.perf_counter()
            ecg = synthesize_ecg(hours=hours, fs=250.0, seed=i)
            sig = np.asarray(ecg.signal, np.float64)[:, None]
            # (wfdb's writer: 16-bit samples; 1 µV steps hold the synthetic millivolts to 32 mV)
            wfdb.wrsamp(name, fs=250, units=["mV"], sig_name=["MLII"], p_signal=sig, fmt=["16"],
                        adc_gain=[1000.0], baseline=[0], write_dir=str(folder))
            print(f"  wrote {name} ({hours:g} h) in {time.perf_counter() - t:.1f} s", flush=True)
        paths.append(folder / name)
    return paths


def tree_rss(pid: int, stop: threading.Event, out: dict) -> None:
    """The largest sum of RSS over ``pid`` and its descendants, sampled every 0.5 s, into ``out['peak']``."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            break
        out["peak"] = max(out.get("peak", 0), total)
        stop.wait(0.5)


def run_size(hours: float, records: list[Path], workers: int | None, extra: list[str]) -> dict:
    """One ``beatflow run`` over the linked cohort; its figures."""
    cohort = OUT / f"cohort-{len(records)}"
    shutil.rmtree(cohort, ignore_errors=True)
    cohort.mkdir(parents=True)
    for r in records:
        for ext in (".hea", ".dat"):
            os.symlink(r.with_suffix(ext), cohort / (r.name + ext))
    out = OUT / f"run-{len(records)}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "beatflow.cli", "run", "--input", str(cohort), "--no-service", "--cache", "off",
           "--out", str(out), *(["--workers", str(workers)] if workers else []), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop, peak = threading.Event(), {}
    th = threading.Thread(target=tree_rss, args=(proc.pid, stop, peak), daemon=True)
    th.start()
    log = proc.communicate()[0]
    wall = time.perf_counter() - t
    stop.set()
    th.join()
    if proc.returncode:
        print(log[-3000:])
        raise SystemExit(f"beatflow run on {len(records)} recordings failed (exit {proc.returncode})")
    s = json.loads((out / "summary.json").read_text())
    return {"hours": hours, "recordings": len(records), "beats": s["beats_kept"], "wall": wall,
            "timings": s["timings_s"], "rss": s.get("peak_rss_bytes") or {}, "tree": peak.get("peak", 0),
            "partitions": s.get("partitions")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20,200,1000", help="hours in all, comma-separated")
    ap.add_argument("--record-hours", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("extra", nargs="*", help="more `beatflow run` arguments (after --)")
    a = ap.parse_args(argv)
    sizes = [float(x) for x in a.sizes.split(",")]
    n_max = max(max(1, round(h / a.record_hours)) for h in sizes)
    print_header("beatflow run over a synthetic cohort")
    records = write_records(n_max, a.record_hours, OUT / "records")
    rows = []
    for h in sizes:
        n = max(1, round(h / a.record_hours))
        r = run_size(n * a.record_hours, records[:n], a.workers, a.extra)
        t = r["timings"]
        gb = 1e9
        rows.append([f"{r['hours']:g}", r["recordings"], r["partitions"], f"{r['beats']:,}", f"{r['wall']:.1f}",
                     f"{r['wall'] / r['hours']:.3f}", f"{t.get('total', 0):.1f}",
                     *(f"{t.get(k, 0):.1f}" for k in ("load", "segment", "embed", "train", "engine", "score", "report")),
                     f"{(r['rss'].get('flow') or 0) / gb:.2f}", f"{(r['rss'].get('largest_worker') or 0) / gb:.2f}",
                     f"{r['tree'] / gb:.2f}"])
        print(f"  {r['hours']:g} h: {r['wall']:.1f} s", flush=True)
    print_table(["hours", "recordings", "partitions", "beats", "wall s", "s per hour", "flow s", "load", "segment",
                 "embed", "train", "engine", "score", "report", "peak RSS flow GB", "largest worker GB",
                 "process tree GB"], rows)


if __name__ == "__main__":
    main()

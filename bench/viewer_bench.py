"""The report's stream viewer on a finished run's ``report.html``: the page's bytes and the viewer's share
(its levels, raw windows and beats), then the page in headless Chromium, loaded ``REPEATS`` times from disk
(a fresh tab each): the load event, first contentful paint (Performance API), the viewer's first draw (the
script's start to the first picture: base64 decoding included) and the time of one redraw at several zooms.

    beatflow run --out /tmp/viewer_run20                 (the 20 h default)
    python bench/viewer_bench.py /tmp/viewer_run20 [REPEATS]   (default 5; results: bench/results/report.md)

Needs Debian's chromium and chromium-driver (``apt-get install -y chromium chromium-driver``).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from common import print_header  # noqa: E402

#: the redraw's zooms: the view's span in seconds (None: the whole stream)
SPANS = (None, 3600.0, 600.0, 60.0, 10.0, 2.0)


def _payload(doc: str) -> dict:
    m = re.search(r'<script type="application/json" id="bf-viewer-data">(.*?)</script>', doc, re.S)
    if m is None:
        raise SystemExit("no stream viewer in this report")
    return json.loads(m.group(1))


def _b64_bytes(s: str) -> int:
    return len(base64.b64decode(s))


def _build_times(stream: Path, p: dict, repeats: int) -> None:
    """The viewer's data made in this process from the stream (8 partitions, their finest level as the
    workers make it, then the report task's part: the pyramid, the quantisation and the base64 of
    :func:`beatflow.report.viewer.viewer_payload`), beats and raw windows as the page holds them."""
    import time

    import numpy as np

    from beatflow.report import viewer as V
    from beatflow.report.envelope import column_minmax

    x = np.load(stream, mmap_mode="r")
    x = np.asarray(x if x.ndim == 1 else x[:, 0], np.float32)
    total, n0 = x.size, V.finest_columns(x.size)
    bounds = np.linspace(0, total, 9).astype(np.int64)
    starts = np.frombuffer(base64.b64decode(p["beats"]["start"]), "<u4")
    codes = np.frombuffer(base64.b64decode(p["beats"]["code"]), "u1")
    ra = np.frombuffer(base64.b64decode(p["raw"]["start"]), "<u4").astype(np.int64)
    rn = np.frombuffer(base64.b64decode(p["raw"]["len"]), "<u4").astype(np.int64)
    pieces = [(a, x[a:a + n]) for a, n in zip(ra, rn)]
    workers, task = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parts = [column_minmax(x[a:b], a, total, n0) for a, b in zip(bounds[:-1], bounds[1:])]
        t1 = time.perf_counter()
        V.viewer_payload(total, p["fs"], parts, pieces, (starts, codes), [], ["r"], [0], p["top"])
        t2 = time.perf_counter()
        workers.append(1e3 * (t1 - t0))
        task.append(1e3 * (t2 - t1))
    print(f"making the viewer's data, {repeats} repeats (median, min-max), ms: the finest level over 8 partitions "
          f"{statistics.median(workers):.0f} ({min(workers):.0f}-{max(workers):.0f}), the pyramid, quantisation "
          f"and base64 {statistics.median(task):.0f} ({min(task):.0f}-{max(task):.0f})")


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    page = Path(sys.argv[1])
    page = page / "report.html" if page.is_dir() else page
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    print_header()
    doc = page.read_text(encoding="utf-8")
    p = _payload(doc)
    json_bytes = len(json.dumps(p))
    levels = sum(len(L["lo"]) + len(L["hi"]) for L in p["levels"])
    raw = sum(len(v) for v in p["raw"].values())
    beats = sum(len(v) for v in p["beats"].values())
    pngs = sum(len(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", doc))
    print(f"page {page}: {page.stat().st_size:,} bytes; stream {p['total']:,} samples at {p['fs']:g} Hz")
    bins = ", ".join(f"{L['n']:,}" for L in p["levels"])
    print(f"  viewer data {json_bytes:,} bytes: levels {levels:,} ({len(p['levels'])}: {bins} bins), raw {raw:,} "
          f"({_b64_bytes(p['raw']['data']) // 2:,} samples in {_b64_bytes(p['raw']['len']) // 4:,} windows), "
          f"beats {beats:,} ({_b64_bytes(p['beats']['code']):,}); the figures' PNGs {pngs:,} (base64)")

    stream = page.parent / "input.npy"
    if stream.exists():  # the page's data made again from the run's input (synthetic runs keep it)
        _build_times(stream, p, repeats)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        raise SystemExit("needs chromium and chromedriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    tmp = tempfile.mkdtemp(prefix="viewer-bench-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver_path), options=opts)
    rows = []
    try:
        for _ in range(repeats):
            d.get("about:blank")
            d.get(page.resolve().as_uri())
            r = d.execute_script("""
                const nav = performance.getEntriesByType('navigation')[0];
                const paint = Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]));
                const s = window.bfViewer.state;
                return {load: nav.loadEventEnd, fcp: paint['first-contentful-paint'], first_draw: s.first_draw_ms,
                        setup: s.setup_ms};""")
            draws = {}
            for span in SPANS:
                ms = d.execute_script("""
                    const v = window.bfViewer, fs = arguments[1];
                    if (arguments[0] === null) v.reset(); else {
                      const c = v.state.t1 / 2; v.goTo(c - arguments[0] * fs / 2, c + arguments[0] * fs / 2); }
                    v.draw(); const t = performance.now();
                    for (let i = 0; i < 10; i++) v.draw();
                    return (performance.now() - t) / 10;""", span, p["fs"])
                draws[span] = ms
            r["draws"] = draws
            rows.append(r)
        errors = [e for e in d.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    finally:
        d.quit()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key):
        return statistics.median(r[key] for r in rows)

    print(f"chromium, {repeats} loads (median, min-max), ms:")
    for key, name in (("load", "load event"), ("fcp", "first contentful paint"),
                      ("first_draw", "viewer's first picture"), ("setup", "viewer's script to its first picture")):
        vals = [r[key] for r in rows]
        print(f"  {name}: {med(key):.0f} ({min(vals):.0f}-{max(vals):.0f})")
    print("  one redraw, by the view's span: " + ", ".join(
        f"{'whole' if s is None else f'{s:g} s'} {statistics.median(r['draws'][s] for r in rows):.1f}"
        for s in SPANS))
    print(f"  script errors: {len(errors)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

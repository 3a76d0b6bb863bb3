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

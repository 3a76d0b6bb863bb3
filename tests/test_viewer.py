"""The report's stream viewer (beatflow.report.viewer, templates/viewer.js): its min/max pyramid against a
plain loop, the quantisation, the raw windows, the page's size for a 20 h stream, and the page in headless
Chromium (no script errors, zoom, a click on a top anomaly, a picture that is drawn)."""

from __future__ import annotations

import base64
import io
import math
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest

from beatflow.report import viewer as V
from beatflow.report.envelope import column_minmax
from beatflow.report.html import render_report_html, write_report
from test_report import _fake_data

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
browser = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver")


def _naive_level(x, n):
    """min/max of every bin [floor(j * total / n), floor((j + 1) * total / n)) by a plain loop (NaN ignored,
    NaN where a bin has no number)."""
    total = x.size
    mins, maxs = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    for j in range(n):
        lo, hi = (j * total) // n, ((j + 1) * total) // n
        vals = [float(v) for v in x[lo:hi] if not math.isnan(v)]
        if vals:
            mins[j], maxs[j] = min(vals), max(vals)
    return mins, maxs


def _parts(x, n0, rng, nparts):
    cuts = np.sort(rng.choice(np.arange(1, x.size), size=nparts - 1, replace=False)) if nparts > 1 else []
    bounds = [0, *map(int, cuts), x.size]
    return [column_minmax(x[a:b], a, x.size, n0) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("total,top_bins,nparts,seed", [(5_003, 4, 1, 0), (20_011, 8, 3, 1), (65_536, 16, 7, 2),
                                                        (140_001, 2048, 2, 3)])
def test_pyramid_matches_a_naive_loop_on_random_input(monkeypatch, total, top_bins, nparts, seed):
    monkeypatch.setattr(V, "TOP_BINS", top_bins)  # (more levels on a short stream)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(total).astype(np.float32)
    x[rng.choice(total, total // 50, replace=False)] = np.nan
    n0 = V.finest_columns(total)
    counts = V.level_columns(n0)
    assert len(counts) >= 2
    assert all(a == V.FACTOR * b for a, b in zip(counts, counts[1:]))  # whole groups of FACTOR bins
    assert counts[-1] >= top_bins and counts[-1] // V.FACTOR < top_bins
    assert total / n0 <= V.FINEST_BIN
    levels = V.pyramid(_parts(x, n0, rng, nparts), total)
    assert [m.size for m, _ in levels] == counts
    for (mins, maxs), n in zip(levels, counts):
        rmin, rmax = _naive_level(x.astype(np.float64), n)
        np.testing.assert_array_equal(mins, rmin)
        np.testing.assert_array_equal(maxs, rmax)


def test_finest_level_widens_bins_on_a_long_stream_to_stay_in_its_budget():
    for total in (18_000_000, 31_104_000, 200_000_000):
        n0 = V.finest_columns(total)
        assert 2 * n0 <= V.LEVEL_BYTES * 1.01
        counts = V.level_columns(n0)
        assert counts[-1] >= V.TOP_BINS and all(a == V.FACTOR * b for a, b in zip(counts, counts[1:]))
    assert V.finest_columns(18_000_000) >= 18_000_000 // V.FINEST_BIN  # 20 h at 250 Hz: 16 samples a bin


def test_quantised_levels_decode_to_half_a_step():
    rng = np.random.default_rng(4)
    mins = rng.normal(0, 1, 10_000).astype(np.float32)
    maxs = mins + rng.uniform(0, 1, mins.size).astype(np.float32)
    mins[5], maxs[5] = np.nan, np.nan
    maxs[7] = 1e6  # one far outlier: at the rail, the rest keeps its resolution
    (qmin, qmax), off, scale = V.quantise([(mins, maxs)])[0][0], *V.quantise([(mins, maxs)])[1:]
    assert qmin.dtype == np.int8 and qmin[5] == -128 and qmax[5] == -128
    assert qmax[7] == 127
    assert scale < 10 / 254  # (the range is the quantiles', not the outlier's)
    ok = (qmin > -127) & (qmin < 127)
    assert ok.sum() > 9_900
    np.testing.assert_allclose(off + qmin[ok] * scale, mins[ok], atol=scale / 2 + 1e-6)


def test_merge_pieces_joins_overlapping_windows_of_one_stream():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(10_000).astype(np.float32)
    spans = [(a, a + int(rng.integers(1, 400))) for a in rng.integers(0, 9_500, 60)]
    merged = V.merge_pieces([(a, x[a:b]) for a, b in spans])
    covered = np.zeros(x.size, bool)
    for a, b in spans:
        covered[a:b] = True
    ends = [a + p.size for a, p in merged]
    assert all(e < a for e, (a, _) in zip(ends, merged[1:]))  # sorted, apart
    got = np.zeros(x.size, bool)
    for a, p in merged:
        np.testing.assert_array_equal(p, x[a:a + p.size])
        got[a:a + p.size] = True
    np.testing.assert_array_equal(got, covered)


def _plan(n, rng, fs=250.0):
    start = np.cumsum(rng.integers(180, 260, n)).astype(np.int64)
    return SimpleNamespace(start=start, length=np.full(n, 200, np.int64), owner=start // 100_000,
                           recording=np.zeros(n, np.int64), kept=np.ones(n, bool))


def test_raw_windows_take_the_table_then_flagged_then_ectopic_beats_within_the_budget():
    rng = np.random.default_rng(6)
    n, fs = 3_000, 250.0
    plan = _plan(n, rng)
    kb = np.arange(n)
    scores = rng.random(n)
    flagged = scores > 0.99  # (about 30: 50 windows hold them and some V and S beats)
    classes = rng.choice(np.array(["N", "S", "V"]), n, p=[0.9, 0.05, 0.05])
    first = np.array([17, 2_500, 40])
    per = 200 + 2 * int(fs)
    for budget in (3 * per, 50 * per, 10**9):
        w = V.raw_windows(plan, kb, scores, flagged, classes, first, fs, budget=budget)
        got = [(a, b) for k in w for a, b in w[k]]
        assert sum(b - a for a, b in got) <= budget
        chosen = {int(np.searchsorted(plan.start, a + int(fs))) for a, _ in got}
        assert set(first.tolist()) <= chosen
        for k, ws in w.items():  # each window with the partition that owns its beat
            assert all(plan.owner[np.searchsorted(plan.start, a + int(fs))] == k for a, _ in ws)
        if budget == 50 * per:  # the flagged beats come before the unflagged V and S ones
            assert set(np.flatnonzero(flagged).tolist()) <= chosen
            assert len(chosen) == 50
            rest = sorted(chosen - set(first.tolist()) - set(np.flatnonzero(flagged).tolist()))
            ectopic = np.flatnonzero(~flagged & (classes != "N"))
            best = ectopic[np.argsort(-scores[ectopic], kind="stable")][: len(rest)]
            assert rest and set(rest) <= set(best.tolist()) | set(first.tolist())
        if budget == 10**9:
            assert chosen == set(np.flatnonzero(flagged | (classes != "N")).tolist()) | set(first.tolist())


def _ecg(total, fs, rng):
    """A cheap ECG-like stream: a QRS bump every ~0.8 s on noise; the beats' starts (100 ms before)."""
    peaks = np.cumsum(rng.integers(int(0.7 * fs), int(0.95 * fs), int(total / (0.7 * fs))))
    peaks = peaks[peaks < total - fs]
    x = 0.03 * rng.standard_normal(total).astype(np.float32)
    k = np.arange(-12, 13)
    qrs = np.exp(-0.5 * (k / 3.0) ** 2).astype(np.float32)
    for p in peaks:
        x[p - 12:p + 13] += qrs
    return x, peaks - int(0.1 * fs)


def _payload(d, x, starts, rng, nparts=4):
    """The viewer's data for the fake report ``d`` over the stream ``x`` (beats at ``starts``): its top rows
    flagged V beats with their raw windows, some more flagged and classed beats."""
    total, fs = x.size, float(d.fs)
    n0 = V.finest_columns(total)
    parts = _parts(x, n0, rng, nparts)
    codes = rng.choice(np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 2], np.uint8), starts.size)
    codes[rng.random(starts.size) < 0.02] += 4
    top = [(int(t["start"]), int(t["length"])) for t in d.top]
    bs = np.concatenate([starts, [a for a, _ in top]]).astype(np.uint32)
    bc = np.concatenate([codes, np.full(len(top), 6, np.uint8)])
    order = np.argsort(bs, kind="stable")
    pieces = [(a - int(fs), x[a - int(fs):a + n + int(fs)]) for a, n in top]
    return V.viewer_payload(total, fs, parts, pieces, (bs[order], bc[order]), [(600.0, 660.0)], ["rec"], [0], top)


def test_page_of_a_20_hour_stream_stays_under_10_mb(tmp_path):
    rng = np.random.default_rng(7)
    fs, total = 250.0, 18_000_000
    x = rng.standard_normal(total).astype(np.float32)  # (noise: the levels' bytes do not depend on the signal)
    starts = np.cumsum(rng.integers(150, 220, 100_000)).astype(np.int64)
    starts = starts[starts < total]
    n0 = V.finest_columns(total)
    parts = _parts(x, n0, rng, 8)
    codes = rng.choice(np.array([0, 1, 2, 4, 6], np.uint8), starts.size)
    win = 2 * int(fs) + 200  # the raw budget filled with windows of one beat and a second either side
    pieces = [(int(a), x[a:a + win]) for a in starts[:: max(1, starts.size // (V.RAW_SAMPLES // win))][: V.RAW_SAMPLES // win]]
    d = _fake_data()
    d.fs, d.total_samples = fs, total
    payload = V.viewer_payload(total, fs, parts, pieces, (starts.astype(np.uint32), codes), [(10.0, 40.0)], ["r"],
                               [0], [(int(starts[5]), 200)])
    out = tmp_path / "report.html"
    write_report(out, d, None, payload)
    size = out.stat().st_size
    assert size <= 10_000_000, size
    assert V.payload_bytes(payload) > 4_000_000  # (the levels are all there: 2 bytes a bin, 4/3 in base64)


def test_page_without_a_viewer_has_no_script_and_with_one_the_data_is_escaped():
    d = _fake_data()
    assert "<script" not in render_report_html(d).lower()
    rng = np.random.default_rng(8)
    x, starts = _ecg(200_000, d.fs, rng)
    d.total_samples = x.size
    for t in d.top:
        t["start"] = int(rng.integers(1000, x.size - 2000))
    p = _payload(d, x, starts, rng)
    p["recordings"] = [["</script><b>", 0]]
    doc = render_report_html(d, viewer=p)
    assert doc.lower().count("<script") == 2 and "</script><b>" not in doc
    assert doc.count('data-top="') == len(d.top)


# ---------------------------------------------------------------------------
# the page in headless Chromium
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A report with the viewer over a 1.5 h ECG-like stream at 360 Hz (the fake report's), and the browser."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("viewer")
    rng = np.random.default_rng(9)
    d = _fake_data()
    x, starts = _ecg(int(d.total_samples), d.fs, rng)
    payload = _payload(d, x, starts, rng)
    path = tmp / "report.html"
    write_report(path, d, None, payload)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp / 'chrome'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        driver.get(path.as_uri())
        for _ in range(100):
            if driver.execute_script("return !!(window.bfViewer && window.bfViewer.state.first_draw_ms)"):
                break
            time.sleep(0.1)
        yield SimpleNamespace(driver=driver, data=d, payload=payload, x=x, tmp=tmp)
    finally:
        driver.quit()


def _state(driver):
    return driver.execute_script("return Object.assign({}, window.bfViewer.state)")


def _canvas_pixels(driver):
    from PIL import Image

    from selenium.webdriver.common.by import By

    png = driver.find_element(By.CSS_SELECTOR, "#bf-viewer canvas.bf-main").screenshot_as_png
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


@browser
def test_page_loads_without_script_errors_and_shows_the_whole_stream(page):
    logs = page.driver.get_log("browser")
    assert not [e for e in logs if e["level"] in ("SEVERE", "ERROR")], logs
    s = _state(page.driver)
    assert s["t0"] == 0 and s["t1"] == page.payload["total"] and s["draws"] >= 1
    assert s["beats_in_view"] > 1000
    assert page.driver.execute_script("return window.bfViewer.levels") == [L["n"] for L in page.payload["levels"]]


@browser
def test_zoom_by_buttons_and_wheel_narrows_the_visible_range(page):
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    d = page.driver
    d.execute_script("window.bfViewer.reset()")
    time.sleep(0.2)
    span0 = _state(d)["span_s"]
    d.find_element(By.CSS_SELECTOR, '#bf-viewer button[data-act="in"]').click()
    time.sleep(0.3)
    s1 = _state(d)
    assert s1["span_s"] == pytest.approx(span0 / 2, rel=1e-6)
    canvas = d.find_element(By.CSS_SELECTOR, "#bf-viewer canvas.bf-main")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    for _ in range(3):  # (each: the span times 1.0015 ** -600, about 0.41)
        ActionChains(d).scroll_from_origin(ScrollOrigin.from_element(canvas), 0, -600).perform()
        time.sleep(0.3)
    s2 = _state(d)
    assert s2["span_s"] < 0.25 * s1["span_s"]
    assert s1["t0_s"] <= s2["t0_s"] and s2["t1_s"] <= s1["t1_s"]  # (zoomed at the pointer, inside the view)
    assert s2["level"] < s1["level"]  # a level FACTOR times finer once the span is FACTOR times narrower
    d.find_element(By.CSS_SELECTOR, '#bf-viewer button[data-act="all"]').click()
    time.sleep(0.3)
    assert _state(d)["span_s"] == pytest.approx(span0)


@browser
def test_a_click_on_a_top_anomaly_shows_that_beat(page):
    from selenium.webdriver.common.by import By

    d, fs = page.driver, page.data.fs
    rows = d.find_elements(By.CSS_SELECTOR, "tr[data-top]")
    assert len(rows) == len(page.data.top)
    for i in (3, 0):
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", rows[i])
        rows[i].click()
        time.sleep(0.4)
        s = _state(d)
        a, n = page.payload["top"][i]
        assert a == page.data.top[i]["start"]
        assert s["t0"] <= a and a + n <= s["t1"] and s["span_s"] <= (n + 2 * fs + 1) / fs
        assert s["selected"] == [a, a + n]
        assert s["raw"] is True  # the beat's own samples are in the page
        pix = _canvas_pixels(d)
        dark = (pix.sum(axis=2) < 200).sum()  # the raw trace
        yellow = ((pix[..., 0] > 200) & (pix[..., 1] > 170) & (pix[..., 2] < 190)).sum()  # the selected beat
        assert dark > 200 and yellow > 1000


@browser
def test_screenshot_shows_a_trace_and_red_marks(page):
    d = page.driver
    d.execute_script("window.bfViewer.reset()")
    time.sleep(0.3)
    d.save_screenshot(str(page.tmp / "viewer.png"))
    pix = _canvas_pixels(d)
    assert pix.std() > 20  # not blank
    red = ((pix[..., 0] > 150) & (pix[..., 1] < 90) & (pix[..., 2] < 90)).sum()
    trace = ((abs(pix[..., 0] - 0x1f) < 30) & (abs(pix[..., 1] - 0x3a) < 30) & (abs(pix[..., 2] - 0x5f) < 30)).sum()
    assert red > 50 and trace > 5_000, (red, trace)
    paint = d.execute_script("return performance.getEntriesByType('paint').map(e => [e.name, e.startTime])")
    assert dict(paint).get("first-contentful-paint", 0) > 0


# ---------------------------------------------------------------------------
# the viewer of a real run
# ---------------------------------------------------------------------------


def test_flow_report_holds_the_viewer_of_its_own_stream(tmp_path):
    """A flow run's page: its viewer's levels are the input's min/max by a plain loop, its beats and flagged
    beats the anomaly table's, its raw windows the input's samples, its top rows the table's top ranks."""
    import json
    import re

    import pandas as pd
    from prefect.testing.utilities import prefect_test_harness

    from beatflow.pipeline.cluster import make_task_runner
    from beatflow.pipeline.flow import ecg_anomaly_flow

    out = tmp_path / "run"
    with prefect_test_harness(server_startup_timeout=120):
        ecg_anomaly_flow.with_options(task_runner=make_task_runner("cpu", 2))(
            out=str(out), device="cpu", workers=2, hours=0.25, seed=3, epochs=2, partitions=3)
    doc = (out / "report.html").read_text(encoding="utf-8")
    p = json.loads(re.search(r'<script type="application/json" id="bf-viewer-data">(.*?)</script>', doc, re.S)[1])
    x = np.load(out / "input.npy").astype(np.float32).reshape(-1)
    assert p["total"] == x.size and p["fs"] == 250.0
    n = p["levels"][1]["n"]
    lo = np.frombuffer(base64.b64decode(p["levels"][1]["lo"]), np.int8)
    hi = np.frombuffer(base64.b64decode(p["levels"][1]["hi"]), np.int8)
    rmin, rmax = _naive_level(x.astype(np.float64), n)
    inside = (lo > -127) & (hi < 127)
    assert inside.mean() > 0.99
    tol = p["scale"] / 2 + 1e-5
    np.testing.assert_allclose(p["off"] + lo[inside] * p["scale"], rmin[inside], atol=tol)
    np.testing.assert_allclose(p["off"] + hi[inside] * p["scale"], rmax[inside], atol=tol)
    table = pd.read_parquet(out / "anomalies.parquet")
    starts = np.frombuffer(base64.b64decode(p["beats"]["start"]), "<u4")
    codes = np.frombuffer(base64.b64decode(p["beats"]["code"]), np.uint8)
    t = table.sort_values("start", kind="stable")
    np.testing.assert_array_equal(starts, t["start"].to_numpy())
    np.testing.assert_array_equal(codes >= 4, t["flagged"].to_numpy())
    np.testing.assert_array_equal(np.array(["N", "S", "V"])[codes & 3], t["class"].astype(str).to_numpy())
    ra = np.frombuffer(base64.b64decode(p["raw"]["start"]), "<u4")
    rn = np.frombuffer(base64.b64decode(p["raw"]["len"]), "<u4")
    raw = np.frombuffer(base64.b64decode(p["raw"]["data"]), "<i2")
    assert len(ra) > 0 and rn.sum() == raw.size <= V.RAW_SAMPLES
    at = np.concatenate([[0], np.cumsum(rn)]).astype(np.int64)
    for a, k, b in zip(ra.tolist(), at[:-1].tolist(), at[1:].tolist()):
        np.testing.assert_allclose(p["off"] + raw[k:b] * p["raw_scale"], x[a:a + (b - k)], atol=p["raw_scale"])
    covered = np.zeros(x.size, bool)
    for a, k in zip(ra, rn):
        covered[a:a + k] = True
    flagged = t[t["flagged"]]
    assert covered[flagged["start"].to_numpy()].all()  # (a short run: the budget holds every flagged beat)
    ranked = table.sort_values("rank")
    top = [tuple(r) for r in p["top"]]
    rows = ranked[ranked["class"].astype(str).isin(["V", "S"])].head(len(top))
    assert top == list(zip(rows["start"].tolist(), rows["length"].tolist()))
    assert doc.count('data-top="') == len(top) > 0

"""Tests for beatflow.report: the stream's per-pixel min/max envelope (envelope), the figures (figures, png),
their processes (pool) and the HTML page (html)."""

from __future__ import annotations

import base64
import re
import time

import numpy as np
import pytest

from beatflow.report.envelope import column_bounds, column_minmax, combine_minmax
from beatflow.report.figures import ReportData
from beatflow.report.html import write_report


# ---------------------------------------------------------------------------
# column_minmax / combine_minmax
# ---------------------------------------------------------------------------


def _naive(x: np.ndarray, ncols: int):
    total = x.size
    mins = np.full(ncols, np.nan, dtype=np.float32)
    maxs = np.full(ncols, np.nan, dtype=np.float32)
    for c in range(ncols):
        a = (c * total) // ncols
        b = ((c + 1) * total) // ncols
        if b > a:
            seg = x[a:b]
            seg = seg[~np.isnan(seg)] if np.issubdtype(seg.dtype, np.floating) else seg
            if seg.size:
                mins[c] = np.float32(seg.min())
                maxs[c] = np.float32(seg.max())
    return mins, maxs


def _split(total: int, nparts: int, rng) -> list[int]:
    """Uneven cut points (including empty and 1-sample partitions sometimes)."""
    if nparts == 1:
        return [0, total]
    cuts = np.sort(rng.integers(0, total + 1, size=nparts - 1))
    return [0, *cuts.tolist(), total]


def _run(x, ncols, bounds, method="reduceat"):
    total = x.size
    parts = [column_minmax(x[a:b], a, total, ncols, _method=method) for a, b in zip(bounds[:-1], bounds[1:])]
    return combine_minmax(parts, ncols)


def _same(a, b):
    np.testing.assert_array_equal(a, b)  # NaN == NaN positionally for assert_array_equal


CASES = [
    (1000, 100),
    (1003, 97),
    (10_007, 4000),
    (12_345, 1),
    (5, 5),
    (37, 100),  # ncols > total: empty columns must be NaN
    (1, 7),
    (2, 3),
]


@pytest.mark.parametrize("total,ncols", CASES)
@pytest.mark.parametrize("nparts", [1, 2, 7])
@pytest.mark.parametrize("method", ["reduceat", "pad"])
def test_minmax_matches_naive_any_partitioning(total, ncols, nparts, method):
    rng = np.random.default_rng(total * 31 + ncols * 7 + nparts)
    x = rng.standard_normal(total).astype(np.float32)
    ref_min, ref_max = _naive(x, ncols)
    one_min, one_max = _run(x, ncols, [0, total], method)
    _same(one_min, ref_min)
    _same(one_max, ref_max)
    for trial in range(3):
        bounds = _split(total, nparts, rng)
        mins, maxs = _run(x, ncols, bounds, method)
        _same(mins, one_min)
        _same(maxs, one_max)
        assert mins.dtype == np.float32 and maxs.dtype == np.float32
        assert mins.shape == (ncols,)


def test_minmax_more_columns_than_samples_nan():
    total, ncols = 10, 25
    x = np.arange(total, dtype=np.float64)
    mins, maxs = _run(x, ncols, [0, 3, 4, 10])
    b = column_bounds(total, ncols)
    empty = b[1:] == b[:-1]
    assert empty.sum() == ncols - total
    assert np.isnan(mins[empty]).all() and np.isnan(maxs[empty]).all()
    assert np.array_equal(np.sort(mins[~empty]), x)
    assert np.array_equal(mins[~empty], maxs[~empty])


def test_minmax_partial_columns_and_first_col():
    # 100 samples, 10 columns of 10 samples: partition [15, 35) touches columns 1..3
    x = np.arange(100, dtype=np.float64)
    first, mins, maxs = column_minmax(x[15:35], 15, 100, 10)
    assert first == 1
    assert mins.tolist() == [15, 20, 30]
    assert maxs.tolist() == [19, 29, 34]
    assert isinstance(mins, np.ndarray) and mins.dtype == np.float32


def test_minmax_int_dtype_and_nan_samples():
    rng = np.random.default_rng(0)
    xi = rng.integers(-2000, 2000, size=5000).astype(np.int16)
    for method in ("reduceat", "pad"):
        m, M = _run(xi, 333, _split(5000, 7, rng), method)
        rm, rM = _naive(xi, 333)
        _same(m, rm)
        _same(M, rM)
    xf = rng.standard_normal(3000)
    xf[rng.integers(0, 3000, 200)] = np.nan
    xf[100:140] = np.nan  # whole columns of NaN
    for method in ("reduceat", "pad"):
        one = _run(xf, 300, [0, 3000], method)
        many = _run(xf, 300, _split(3000, 7, rng), method)
        ref = _naive(xf, 300)
        _same(one[0], ref[0])
        _same(one[1], ref[1])
        _same(many[0], one[0])
        _same(many[1], one[1])


def test_minmax_empty_partition_and_errors():
    first, m, M = column_minmax(np.empty(0), 0, 10, 5)
    assert m.size == 0 and M.size == 0
    mins, maxs = combine_minmax([(first, m, M)], 5)
    assert np.isnan(mins).all()
    with pytest.raises(ValueError):
        column_minmax(np.zeros(5), 8, 10, 5)


def test_minmax_numpy_path_does_not_import_cupy(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def guarded(name, *a, **k):
        if name == "cupy" or name.startswith("cupy."):
            raise AssertionError("cupy imported for a NumPy array")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guarded)
    x = np.random.default_rng(1).standard_normal(1000)
    mins, maxs = _run(x, 64, [0, 300, 1000])
    ref = _naive(x, 64)
    _same(mins, ref[0])
    _same(maxs, ref[1])


def test_minmax_cupy_if_available():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:  # pragma: no cover - no device
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(2)
    x = rng.standard_normal(20011).astype(np.float32)
    xd = cp.asarray(x)
    bounds = _split(x.size, 7, rng)
    parts = [column_minmax(xd[a:b], a, x.size, 1500) for a, b in zip(bounds[:-1], bounds[1:])]
    mins, maxs = combine_minmax(parts, 1500)
    ref = _naive(x, 1500)
    _same(mins, ref[0])
    _same(maxs, ref[1])


# ---------------------------------------------------------------------------
# write_report
# ---------------------------------------------------------------------------


def _fake_data(title="beatflow <script>alert(1)</script> & co", m=600, ncols=400, truth=True, seed=0):
    rng = np.random.default_rng(seed)
    fs = 360.0
    total = int(fs * 3600 * 1.5)
    t = np.arange(200_000) / fs
    sig = np.sin(2 * np.pi * 1.2 * t) ** 63 + 0.05 * rng.standard_normal(t.size)
    x = np.interp(np.linspace(0, t.size - 1, total // 100), np.arange(t.size), sig)  # cheap stand-in
    parts = [column_minmax(x[a:b], a, x.size, ncols) for a, b in ((0, 1000), (1000, x.size))]
    smin, smax = combine_minmax(parts, ncols)
    lengths = rng.normal(300, 25, 5000).astype(int)
    counts, edges = np.histogram(lengths, bins=60)
    D = 360
    beats = np.zeros((20, D))
    for i in range(20):
        L = int(rng.integers(250, 340))
        beats[i, :L] = np.exp(-0.5 * ((np.arange(L) - 60) / 6.0) ** 2) + 0.02 * rng.standard_normal(L)
    mu = rng.standard_normal((m, 2))
    score = np.abs(rng.standard_normal(m)) + np.hypot(*mu.T)
    thr = float(np.quantile(score, 0.98))
    score_all = np.abs(rng.standard_normal(4000)) * 2
    top = []
    for r in range(14):
        start = int(rng.integers(1000, total - 2000))
        c0 = start - int(fs)
        top.append(
            {
                "beat": int(rng.integers(0, 9999)),
                "start": start,
                "time_s": start / fs,
                "length": 290,
                "score": float(10 - r * 0.3),
                "context": np.sin(np.arange(int(3 * fs)) / 20.0),
                "context_start": c0,
                "label": ["pvc", "artifact", None, "<b>x</b>"][r % 4],
            }
        )
    summary = {
        "samples": total,
        "fs": fs,
        "beats_detected": 6400,
        "beats_kept": 6200,
        "pruned_fraction": 0.03125,
        "test_loss": 0.0123,
        "anomalies_flagged": 120,
        "device": "cpu",
        "workers": 2,
        "engine": {"backend": "onnxruntime", "max_abs_err": 3.2e-6, "precision": "fp32", "cache": "hit",
                   "latency_batch1_us": {"p50": 41.5, "p99": 97.0, "calls": 200}, "clock": "monotonic",
                   "throughput_by_batch": {"1": 21000.0, "1024": 412345.0}},
        "timings_s": {"load": 1.2, "detect": 3.4, "train": 20.0, "score": 2.0, "report": 0.8},
        "truth": {"se": 0.91, "ppv": 0.87, "auc": 0.975},
        "seed": 0,
    }
    return ReportData(
        title=title,
        summary=summary,
        fs=fs,
        total_samples=total,
        stream_min=smin,
        stream_max=smax,
        length_hist_counts=counts,
        length_hist_edges=edges,
        length_bounds=(240, 380),
        aligned_beats=beats,
        train_loss=[0.5 / (e + 1) for e in range(12)],
        test_loss=0.045,
        latent_mu=mu,
        latent_score=score,
        threshold=thr,
        score_all=score_all,
        top=top,
        anomaly_times_s=np.sort(rng.uniform(0, total / fs, 120)),
        truth_labels=rng.choice([0, 0, 0, 0, 1, 2], size=m) if truth else None,
    )


def test_write_report_self_contained(tmp_path):
    out = tmp_path / "sub" / "report.html"
    write_report(out, _fake_data())
    files = list(out.parent.iterdir())
    assert files == [out], files  # one file, no leftover .tmp
    doc = out.read_text(encoding="utf-8")
    assert doc.startswith("<!DOCTYPE html>")
    assert doc.count("data:image/png;base64,") >= 6
    for heading in ("Summary", "Per-stage timings", "Whole stream", "Beat-length histogram", "Aligned beats",
                    "Training curve", "Latent space", "Latent space by truth label", "Anomaly score distribution",
                    "Top anomalies"):
        assert heading in doc, heading
    # no external resources of any kind
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", doc, re.I)
    assert "http://" not in doc and "https://" not in doc
    assert "<link" not in doc.lower() and "<script" not in doc.lower() and "@import" not in doc
    # escaping: title and labels
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in doc
    assert "&lt;b&gt;x&lt;/b&gt;" in doc
    # key figures present
    for s in ("onnxruntime", "1:30", "0.975", "3.12 %", "detect", "Inference engine", "p50 42 µs, p99 97 µs",
              "throughput, batch 1024", "412,345 beats/s"):
        assert s in doc, s
    assert out.stat().st_size < 3_000_000


def test_write_report_degenerate_inputs(tmp_path):
    d = _fake_data(title="empty run", truth=False)
    d.top = []
    d.train_loss = []
    d.latent_mu = np.zeros((0, 2))
    d.latent_score = np.zeros(0)
    d.score_all = np.zeros(0)
    d.anomaly_times_s = np.zeros(0)
    d.aligned_beats = np.zeros((0, 10))
    d.summary = {"timings_s": {}}
    out = tmp_path / "r.html"
    write_report(str(out), d)
    doc = out.read_text(encoding="utf-8")
    assert "No anomalies flagged" in doc
    assert doc.count("data:image/png;base64,") >= 6
    assert "by truth label" not in doc  # no truth: no such figure


def test_latent_figures_by_score_and_by_label():
    """The latent space by score always; by truth label only with a label per point."""
    from beatflow.report.figures import FIGURES

    d = _fake_data(m=3000)
    by_score, by_label = FIGURES["latent"](d), FIGURES["latent_truth"](d)
    assert base64.b64decode(by_score)[:8] == base64.b64decode(by_label)[:8] == b"\x89PNG\r\n\x1a\n"
    assert by_score != by_label
    d.truth_labels = None
    assert FIGURES["latent_truth"](d) is None and FIGURES["latent"](d) == by_score
    d.truth_labels = np.zeros(5, np.int64)  # not one per point: left out, not drawn wrong
    assert FIGURES["latent_truth"](d) is None


def test_figures_are_drawn_under_their_settings_and_leave_the_processs_alone():
    """Each figure is drawn with the report's Matplotlib settings (unhinted glyphs: the same picture but for
    the text's pixels), and the process's own settings are as they were after it, also when it fails."""
    import matplotlib

    from beatflow.report.figures import _RC, FIGURES, _fig_scores

    d = _fake_data(m=3000)
    assert _RC["text.hinting"] != matplotlib.rcParams["text.hinting"]  # (else this test shows nothing)
    before = dict(matplotlib.rcParams)
    got = FIGURES["scores"](d)
    assert dict(matplotlib.rcParams) == before
    assert got != _fig_scores(d)  # (drawn with the process's hinting)
    with matplotlib.rc_context(_RC):
        assert _fig_scores(d) == got
    d.score_all = "not scores"
    with pytest.raises(ValueError):
        FIGURES["scores"](d)
    assert dict(matplotlib.rcParams) == before


@pytest.mark.parametrize("n", [12, 7, 3, 2, 1])
def test_top_figures_parts_are_the_whole_figures_sides(n):
    """The top anomalies' figure drawn as two parts (two processes): side by side they are the whole figure,
    pixel for pixel, split in a gap between columns; one column: all of it the left part. The page shows both
    at their shares of the width."""
    import io

    from PIL import Image

    import matplotlib

    from beatflow.report.figures import _RC, FIGURES, _fig_top
    from beatflow.report.html import render_report_html

    def pixels(png):
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))

    d = _fake_data(m=500)
    d.top = d.top[:n]
    assert len(d.top) == n
    with matplotlib.rc_context(_RC):  # (the whole figure, under the figures' settings)
        whole = pixels(_fig_top(d))
    left, right = FIGURES["top"](d), FIGURES["top_right"](d)
    with pytest.raises(ValueError, match="'left' or 'right', got 'middle'"):
        _fig_top(d, part="middle")
    if n == 1:
        assert right is None
        np.testing.assert_array_equal(pixels(left), whole)
        return
    lp, rp = pixels(left), pixels(right)
    assert lp.shape[0] == rp.shape[0] == whole.shape[0] and lp.shape[1] + rp.shape[1] == whole.shape[1]
    assert 0.3 < lp.shape[1] / whole.shape[1] < 0.7
    np.testing.assert_array_equal(np.concatenate([lp, rp], axis=1), whole)
    gap = whole[:, lp.shape[1] - 3:lp.shape[1] + 3]  # (the split: a blank column, no panel cut)
    assert (gap[: whole.shape[0] // 2] == 255).all()
    doc = render_report_html(d, {"top": left, "top_right": right})
    share = 100 * lp.shape[1] / whole.shape[1]
    assert (f'<div class="split"><img alt="top anomalies" style="width:{share:.4f}%" '
            f'src="data:image/png;base64,{left}">') in doc
    assert f'style="width:{100 - share:.4f}%" src="data:image/png;base64,{right}"></div>' in doc


def test_write_report_fast_realistic(tmp_path):
    d = _fake_data(m=20_000, ncols=4000)
    t0 = time.perf_counter()
    write_report(tmp_path / "r.html", d)
    dt = time.perf_counter() - t0
    assert dt < 20.0, dt  # target is < ~8 s; generous bound for slow CI machines
    assert (tmp_path / "r.html").stat().st_size < 3_000_000


def test_figures_drawn_ahead_are_used_and_match():
    from types import SimpleNamespace

    from beatflow.report.figures import EARLY_FIGURES, render_figures
    from beatflow.report.html import render_report_html

    d = _fake_data()
    # the early figures read only what the flow has once the model is trained
    part = SimpleNamespace(fs=d.fs, length_hist_counts=d.length_hist_counts, length_hist_edges=d.length_hist_edges,
                           length_bounds=d.length_bounds, aligned_beats=d.aligned_beats, train_loss=d.train_loss,
                           test_loss=d.test_loss)
    early = render_figures(part, EARLY_FIGURES)
    assert early == render_figures(d, EARLY_FIGURES)  # same pictures as from the whole ReportData
    doc = render_report_html(d, {**early, "lengths": "QUFBQQ=="})
    assert "data:image/png;base64,QUFBQQ==" in doc  # a figure given is not drawn again
    assert doc.count("data:image/png;base64,") == render_report_html(d).count("data:image/png;base64,")


def test_figure_processes_cover_the_figures_drawn_at_once():
    """A host with cores to spare gets one figure process per figure that can be drawing at once (the
    early ones but the beat lengths', the late ones, the top anomalies'); a small one at most 4 and
    never more than its cores."""
    from beatflow.report.pool import CONCURRENT_FIGURES, figure_processes
    from beatflow.pipeline.flow import LATE_FIGURES

    from beatflow.report.figures import EARLY_FIGURES, FIGURES

    at_once = [n for n in EARLY_FIGURES if n != "lengths"] + list(LATE_FIGURES) + ["top", "top_right"]
    assert set(at_once) <= set(FIGURES) and CONCURRENT_FIGURES == len(at_once)
    assert [figure_processes(c) for c in (0, 1, 2, 3, 4, 8, 15, 16, 128)] == [1, 1, 2, 3, 4, 4, 4, 8, 8]


def test_figure_pool_draws_in_processes_the_same_pictures():
    """The flow's FigurePool: each figure drawn in a spawned process equals the one drawn here; a
    figure whose job fails is left out (the report task draws it), and a closed pool draws nothing."""
    from beatflow.pipeline.flow import FigurePool

    from beatflow.report.figures import FIGURES, render_figures

    d = _fake_data()
    pool = FigurePool(2)
    try:
        futures = pool.draw(d, list(FIGURES))
        assert set(futures) == set(FIGURES)
        got = FigurePool.collect(futures)
        assert got == render_figures(d, list(FIGURES))
        assert len(pool.pool._processes) == 2  # drawn by the pool's two processes
        took = FigurePool.timings(futures)  # how long each waited for a process, and drew there
        assert set(took) == set(FIGURES) and all(t["draw"] > 0 and t["queued"] >= 0 for t in took.values())
        # eight jobs, two processes: the last ones waited at least for a figure drawn before them
        assert max(t["queued"] for t in took.values()) >= min(t["draw"] for t in took.values()) * 0.9, took
        broken = pool.draw(object(), ["lengths"])  # no fields: the job raises
        assert FigurePool.collect(broken) == {} and FigurePool.timings(broken) == {}
    finally:
        pool.close()


def test_pixel_max_matches_a_naive_loop_over_points():
    """The latent figure's aggregation: each pixel the largest value of the points in it, widened by
    one pixel (down/left neighbours' maxima), NaN where empty; points outside the limits dropped."""
    from beatflow.report.figures import _pixel_max

    rng = np.random.default_rng(3)
    n, rows, cols = 500, 17, 23
    x, y = rng.uniform(-0.2, 1.2, n), rng.uniform(-0.1, 1.1, n)
    v = rng.normal(size=n)
    v[::50] = np.nan
    got = _pixel_max(x, y, v, (0.0, 1.0), (0.0, 1.0), (rows, cols))
    raw = np.full((rows, cols), -np.inf)
    for xi, yi, vi in zip(x, y, v):
        c, r = int(np.floor(xi * cols)), int(np.floor(yi * rows))
        if 0 <= c < cols and 0 <= r < rows and np.isfinite(vi):
            raw[r, c] = max(raw[r, c], vi)
    want = np.full((rows, cols), -np.inf)
    for r in range(rows):
        for c in range(cols):
            for dr in (-1, 0):
                for dc in (-1, 0):
                    if 0 <= r + dr and 0 <= c + dc:
                        want[r, c] = max(want[r, c], raw[r + dr, c + dc])
    want[np.isneginf(want)] = np.nan
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got).any() and np.isfinite(got).any()


@pytest.mark.parametrize("n,cols,seed", [(4000, 117, 0), (50, 117, 1), (117, 117, 2), (1, 9, 3), (300, 40, 4)])
def test_envelope_cover_matches_a_naive_loop_over_pixels_and_columns(n, cols, seed):
    """The stream figure's envelope on pixels: each data column covers, in each pixel column it overlaps, the
    rows from its minimum's to its maximum's (at least one), by the share of the pixel column's width it
    overlaps; NaN columns nothing; nothing outside the data's span; a pixel column wholly inside it and reached
    by every one of its data columns is covered wholly."""
    from beatflow.report.figures import _envelope_cover

    rng = np.random.default_rng(seed)
    rows, xmax = 31, 7.0
    mn = rng.normal(size=n)
    mx = mn + rng.exponential(size=n)
    mx[::7] = mn[::7]  # (flat columns: a row still)
    mn[rng.random(n) < 0.1] = np.nan
    xlim, ylim = (-0.4, 7.9), (-2.0, 3.0)
    got = _envelope_cover(mn, mx, xmax, xlim, ylim, (rows, cols))
    want = np.zeros((rows, cols))
    width, dx = (xlim[1] - xlim[0]) / cols, xmax / n
    for c in range(cols):
        left, right = xlim[0] + c * width, xlim[0] + (c + 1) * width
        for j in range(n):
            share = (min(right, (j + 1) * dx) - max(left, j * dx)) / width
            if share <= 0 or not (np.isfinite(mn[j]) and np.isfinite(mx[j])):
                continue
            r0 = int(np.floor((mn[j] - ylim[0]) / (ylim[1] - ylim[0]) * rows))
            r1 = max(int(np.ceil((mx[j] - ylim[0]) / (ylim[1] - ylim[0]) * rows)) - 1, r0)
            want[max(r0, 0):max(r1 + 1, 0), c] += share
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    outside = int((0.0 - xlim[0]) // width)  # (pixel columns wholly left of the data; the last ones: right of it)
    assert got.any() and not got[:, :outside].any() and not got[:, cols - int((xlim[1] - xmax) // width):].any()
    assert got.max() <= 1 + 1e-9
    band = _envelope_cover(np.zeros(n), np.ones(n), xmax, (0.0, xmax), (-1.0, 2.0), (30, cols))  # (all alike)
    np.testing.assert_allclose(band[10:20], 1.0, rtol=0, atol=1e-9)
    assert not band[:10].any() and not band[20:].any()


@pytest.mark.parametrize("seed", [0, 1])
def test_latent_image_puts_each_pixels_maximum_on_that_pixel(seed):
    """The latent figures' image (``_latent_image``): at drawing, the points aggregated onto the axes'
    own pixels (``_pixel_max``, at the axes' final limits) and coloured by the scale it returns, each value
    on its pixel of the canvas (not flipped, not shifted), the axes' face where no point falls."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from types import SimpleNamespace

    from beatflow.report.figures import _latent_image, _new_fig, _pixel_max

    rng = np.random.default_rng(seed)
    fig = _new_fig(4.0, 3.0, margins=(1.0, 1.0, 0.6, 0.6))  # (the axes: pixels 100-300 by 60-240)
    ax = fig.add_subplot()
    ax.set_axis_off()
    n = 400
    f = SimpleNamespace(x=rng.uniform(-1.0, 3.0, n) ** 2, y=rng.normal(size=n) * 2.0)
    value = rng.uniform(0.0, 10.0, n)
    scale = _latent_image(ax, f, value, "viridis", 2.0, 8.0)
    ax.set_xlim(0.0, 5.0)  # (set after: the image follows the final limits)
    ax.set_ylim(-3.0, 4.0)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    px = np.asarray(canvas.buffer_rgba())[::-1]  # (row 0 at the bottom)
    want = _pixel_max(f.x, f.y, value, (0.0, 5.0), (-3.0, 4.0), (180, 200))
    got = px[60:240, 100:300]
    have = np.isfinite(want)
    assert 50 < have.sum() < have.size // 2
    np.testing.assert_array_equal(got[have], scale.to_rgba(want[have], bytes=True))
    assert (got[~have] == 255).all()  # (white: the axes' face)
    assert (px[:60] == 255).all() and (px[240:] == 255).all()  # (nothing outside the axes)
    assert (px[:, :100] == 255).all() and (px[:, 300:] == 255).all()


def test_figure_pool_side_work_stays_light(tmp_path):
    """Jobs the flow submits to its figure processes (the truth matching; a plain file copy) give what
    they give here and does not make the processes import Prefect or PyTorch (on the H200 a job that
    imported Prefect there cost 2-3 s of the scoring stage); without processes it runs in place."""
    import shutil

    from beatflow.pipeline.flow import FigurePool
    from naive import imported

    from beatflow.score.metrics import match_truth

    rng = np.random.default_rng(0)
    r_peaks = np.sort(rng.choice(100_000, 300, replace=False))
    labels = rng.integers(0, 3, 300).astype(np.int8)
    np.savez(tmp_path / "truth.npz", r_peaks=r_peaks, labels=labels, fs=250.0)
    peaks = np.sort(np.concatenate([r_peaks[5:] + 3, [7, 99_990]]))
    kept = peaks[::2]
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    here = match_truth(str(tmp_path / "truth.npz"), peaks, kept, 250.0)
    assert 0.9 < here["se"] < 1 and here["ppv"] < 1 and here["matched"].shape == r_peaks.shape  # per truth beat
    pool = FigurePool(1)
    try:
        there = pool.submit(match_truth, str(tmp_path / "truth.npz"), peaks, kept, 250.0).result(timeout=60)
        assert pool.submit(shutil.copyfile, str(tmp_path / "a.bin"), str(tmp_path / "b.bin")).result(timeout=60)
        assert (tmp_path / "b.bin").read_bytes() == b"x" * 1000
        assert pool.submit(imported, ["prefect", "torch", "distributed"]).result(timeout=60) == {
            "prefect": False, "torch": False, "distributed": False}
    finally:
        pool.close()
    assert {k: there[k] for k in ("se", "ppv", "f1")} == {k: here[k] for k in ("se", "ppv", "f1")}
    np.testing.assert_array_equal(there["matched"], here["matched"])
    pool.pool = None  # no processes: the job runs in this thread, its exception kept in the future
    assert pool.submit(match_truth, str(tmp_path / "truth.npz"), peaks, kept, 250.0).result()["se"] == here["se"]
    with pytest.raises(FileNotFoundError):
        pool.submit(match_truth, str(tmp_path / "missing.npz"), peaks, kept, 250.0).result()


def test_figure_pool_result_runs_a_job_again_here_when_its_process_died():
    """The truth check's jobs survive a figure process that dies: ``FigurePool.result`` runs the job
    again in this thread; an error of the job's own is raised as it is, not run twice."""
    import os
    import signal

    from beatflow.pipeline.flow import FigurePool
    from naive import slow_in_child

    pool = FigurePool(1)
    try:
        assert FigurePool.result(pool.submit(slow_in_child, 3, 0)) == 3  # (the process is up)
        job = pool.submit(slow_in_child, 7, 120)
        os.kill(next(iter(pool.pool._processes)), signal.SIGKILL)
        assert FigurePool.result(job) == 7  # not 120 s: run again here
        with pytest.raises(ValueError):
            FigurePool.result(pool.submit(int, "x"))  # (the broken pool: run here at once, its error kept)
    finally:
        pool.close()


def test_figure_pool_is_kept_from_run_to_run_and_replaced_when_broken():
    """``figure_pool()``: one pool per process, the same object on the next call (its processes stay
    warm for the next flow run); when one of its processes dies it is broken and the next call gives a
    new pool that draws."""
    import os
    import signal
    import time

    import beatflow.pipeline.flow as P
    from beatflow.report.figures import render_figures

    first = P.figure_pool()
    assert P.figure_pool() is first and not first.broken()
    first.submit(int).result(timeout=120)  # its processes are up
    victim = next(iter(first.pool._processes))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not first.broken() and time.monotonic() < deadline:  # the pool notices (its manager thread)
        time.sleep(0.05)
    assert first.broken()
    second = P.figure_pool()
    assert second is not first and not second.broken()
    d = _fake_data()
    assert P.FigurePool.collect(second.draw(d, ["lengths"])) == render_figures(d, ["lengths"])


def test_png_is_the_figure_savefig_draws_without_its_alpha():
    """A figure's PNG (``figure_png``: RGB, zlib level 1) has the pixels of Matplotlib's own ``savefig`` of it
    (RGBA; the figures are opaque), at the figure's size; ``png_width`` reads its width."""
    import io

    from PIL import Image

    from beatflow.report.figures import _DPI, _new_fig
    from beatflow.report.png import figure_png, png_width

    fig = _new_fig(4.0, 2.5)
    ax = fig.add_subplot(1, 1, 1)
    rng = np.random.default_rng(3)
    ax.plot(rng.normal(size=300), lw=0.8)
    ax.scatter(rng.normal(size=50), rng.normal(size=50), c=rng.random(50), alpha=0.5)
    ax.set_title("a title")
    png = figure_png(fig)
    mine = Image.open(io.BytesIO(base64.b64decode(png)))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    ref = np.asarray(Image.open(io.BytesIO(buf.getvalue())))
    assert mine.mode == "RGB" and mine.size == (int(4.0 * _DPI), int(2.5 * _DPI)) and png_width(png) == 400
    assert (ref[..., 3] == 255).all()  # (opaque: the alpha channel carries nothing)
    np.testing.assert_array_equal(np.asarray(mine), ref[..., :3])


@pytest.mark.parametrize("h,w,seed", [(1, 1, 0), (2, 3, 1), (37, 53, 2), (300, 17, 3)])
def test_png_bytes_decode_to_the_images_rgb(h, w, seed):
    """``png_bytes`` of random RGBA pixels (every byte value) decodes to their RGB at their size."""
    import io

    from PIL import Image

    from beatflow.report.png import png_bytes

    rgba = np.random.default_rng(seed).integers(0, 256, size=(h, w, 4), dtype=np.uint8)
    img = Image.open(io.BytesIO(png_bytes(rgba)))
    img.load()
    assert img.format == "PNG" and img.mode == "RGB" and img.size == (w, h)
    np.testing.assert_array_equal(np.asarray(img), rgba[..., :3])


def _tick_figure(xlim, ylim, right=False, log=False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from beatflow.report.figures import _new_fig

    fig = _new_fig(6.0, 3.5, margins=(1.2, 1.2, 0.4, 0.7))
    ax = fig.add_subplot()
    ax.plot(xlim, ylim, lw=0.5)
    if log:
        ax.set_yscale("log")
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_xlabel("x label", fontsize=9)
    ax.set_ylabel("y label", fontsize=9)
    if right:
        ax.yaxis.set_label_position("right")
        ax.yaxis.tick_right()
    ax.tick_params(which="both", labelsize=8)
    return fig, ax, FigureCanvasAgg(fig)


def _tick_limits(seed):
    if seed == "tiny":  # (a scientific offset text: 1e-7)
        return (0.0, 3e-7), (1e9, 1e9 + 5.0), False, False
    if seed == "log-decades":  # (a histogram's counts: major labels only)
        return (-0.3, 7.9), (0.5, 3e3), False, True
    if seed == "log-narrow":  # (less than a decade: minor ticks labelled too)
        return (0.0, 1.0), (2.0, 15.0), True, True
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-7, 7)
    centre = rng.choice([0.0, 1.0, 1e4]) * scale * rng.uniform(-3, 3)
    xlim = tuple(np.sort(centre + scale * rng.uniform(-5, 5, 2)))
    ylim = tuple(np.sort(rng.uniform(-50, 50, 2) * 10.0 ** rng.integers(-3, 4)))
    if seed >= 6:  # (log y axes over random spans)
        ylim = tuple(np.sort(10.0 ** rng.uniform(-3, 5, 2)))
    return xlim, ylim, bool(seed % 2), seed >= 6


@pytest.mark.parametrize("seed", [*range(9), "tiny", "log-decades", "log-narrow"])
def test_drawn_ticks_are_the_ticks_matplotlib_draws(seed):
    """``_drawn_ticks`` (marks, labels and grid as a few artists, no Tick objects) against Matplotlib's
    own ticks on the same axes (the ticks its draw made: ``Axis._update_ticks``), on random limits
    (offsets, tiny or huge ranges and log axes among them): the same ticks, major and minor, their labels'
    texts at the same places, the offset text alike, and the axes' labels where Matplotlib puts them
    (within two pixels)."""
    from beatflow.report.figures import _drawn_ticks

    xlim, ylim, right, log = _tick_limits(seed)
    ref, rax, rcanvas = _tick_figure(xlim, ylim, right, log)
    rcanvas.draw()
    fig, ax, canvas = _tick_figure(xlim, ylim, right, log)
    _drawn_ticks(ax, "x")
    _drawn_ticks(ax, "y", right=right)
    canvas.draw()
    assert ax.xaxis._update_ticks() == ax.yaxis._update_ticks() == []  # (no Tick objects drawn)
    r1, r2 = rcanvas.get_renderer(), canvas.get_renderer()
    for which, axis in (("x", rax.xaxis), ("y", rax.yaxis)):
        drawn_ticks = axis._update_ticks()  # (what Matplotlib's draw drew)
        for kind, theirs_ticks in (("major", axis.majorTicks), ("minor", axis.minorTicks)):
            ticks = [t for t in drawn_ticks if any(t is u for u in theirs_ticks)]
            marks = [c for c in ax.collections if c.get_gid() == f"{which}marks-{kind}"]
            got_locs = sorted(seg[0][0 if which == "x" else 1] for c in marks for seg in c.get_segments())
            np.testing.assert_allclose(got_locs, sorted(t.get_loc() for t in ticks), rtol=1e-12, err_msg=which + kind)
            label = (lambda t: t.label2) if which == "y" and right else (lambda t: t.label1)
            want = [label(t) for t in ticks if label(t).get_text()]
            got = [t for t in ax.texts if t.get_gid() == (f"{which}tick" if kind == "major" else f"{which}minor")]
            assert [t.get_text() for t in want] == [t.get_text() for t in got], (which, kind)
            if got:  # each label at its tick's place on the screen, as Matplotlib put its own
                np.testing.assert_allclose([t.get_window_extent(r2).get_points().mean(0) for t in got],
                                           [t.get_window_extent(r1).get_points().mean(0) for t in want], atol=1.5)
        offset = axis.get_offset_text().get_text()
        drawn = [t for t in ax.texts if t.get_gid() == f"{which}offset"]
        assert ([offset] if offset else []) == [t.get_text() for t in drawn], which
        if offset and which == "x":  # its top right corner where Matplotlib puts its own (in a 10-point font)
            np.testing.assert_allclose(drawn[0].get_window_extent(r2).get_points()[1],
                                       axis.get_offset_text().get_window_extent(r1).get_points()[1], atol=3)
        elif offset:  # above the axes, beside them (Matplotlib's own is over the axes, where the titles are)
            (x0, y0), (x1, _) = drawn[0].get_window_extent(r2).get_points()
            box = ax.get_window_extent(r2)
            assert y0 >= box.y1 and (x0 >= box.x1 if right else x1 <= box.x0)
    for a, b in ((rax.xaxis.label, ax.xaxis.label), (rax.yaxis.label, ax.yaxis.label)):
        np.testing.assert_allclose(b.get_window_extent(r2).get_points(), a.get_window_extent(r1).get_points(), atol=2)


def test_report_lists_and_shades_the_unreadable_stretches(tmp_path):
    """The unreadable stretches (quality.csv's first rows, the summary's totals): a card, a table, and
    bands on the stream figure; none: neither the table nor the bands."""
    import dataclasses

    import pandas as pd

    from beatflow.report.data import N_UNREADABLE, quality_summary, unreadable_view
    from beatflow.report.figures import FIGURES

    d = _fake_data()
    table = pd.DataFrame([("rec", 40.0 + 8 * k, 44.0 + 8 * k, 4.0, "noise" if k % 2 else "flat") for k in range(30)],
                         columns=["recording", "start_s", "end_s", "duration_s", "reason"])
    view = unreadable_view(table, ["rec"], [0.0])
    assert len(view["unreadable_spans_s"]) == 30 and len(view["unreadable_rows"]) == N_UNREADABLE
    shaded = dataclasses.replace(d, summary={**d.summary, "quality": quality_summary(table)}, **view)
    assert shaded.summary["quality"] == {"unreadable_s": 120.0, "episodes": 30, "by_reason_s": {"flat": 60.0,
                                                                                               "noise": 60.0}}
    write_report(tmp_path / "a.html", shaded)
    doc = (tmp_path / "a.html").read_text()
    assert "Unreadable stretches" in doc and "30 stretch(es), 120.0 s" in doc and "quality.csv has them all" in doc
    assert FIGURES["stream"](shaded) != FIGURES["stream"](d)  # the bands are drawn
    write_report(tmp_path / "b.html", d)
    assert "Unreadable stretches" not in (tmp_path / "b.html").read_text()

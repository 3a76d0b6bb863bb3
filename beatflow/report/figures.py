"""The report's figures: Matplotlib (Agg, no pyplot global state), each a function of the parts of
:class:`ReportData` it reads that gives a base64 PNG (:mod:`beatflow.report.png`).

:data:`FIGURES` names them; :func:`render_figures` draws some (the figure processes of
:mod:`beatflow.report.pool` do, while the flow goes on); the page is :mod:`beatflow.report.html`'s.

This module imports neither prefect nor dask, and no Matplotlib until a figure is drawn.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from beatflow.report.png import figure_png

__all__ = [
    "ReportData",
    "FIGURES",
    "EARLY_FIGURES",
    "fmt_hms",
    "fmt_num",
    "render_figures",
    "render_figures_timed",
    "warm_up",
]


@dataclass
class ReportData:
    """What the report shows: the run's summary and the small arrays its figures are drawn from."""

    title: str
    summary: dict
    fs: float
    total_samples: int
    stream_min: np.ndarray
    stream_max: np.ndarray
    length_hist_counts: np.ndarray
    length_hist_edges: np.ndarray
    length_bounds: tuple[int, int]
    aligned_beats: np.ndarray
    train_loss: list[float]
    test_loss: float
    latent_mu: np.ndarray
    latent_score: np.ndarray
    threshold: float
    score_all: np.ndarray
    top: list[dict]
    anomaly_times_s: np.ndarray
    truth_labels: np.ndarray | None = None
    #: the input's recordings on the stream's time axis (several: the stream figure marks where each starts)
    recording_names: list = field(default_factory=list)
    recording_starts_s: list = field(default_factory=list)


_DPI = 100
#: Matplotlib settings the figures are drawn with (:func:`_with_rc`): glyphs drawn as their outlines,
#: not fitted to the pixel grid first. FreeType's hinting of each glyph was a fifth of the top anomalies'
#: figure (52 texts) and a tenth of the stream's; at 100 dpi the text looks the same to the eye
#: (``bench/results/report.md``).
_RC = {"text.hinting": "no_hinting"}
_LABEL_NAMES = {0: "normal", 1: "PVC", 2: "artifact", 3: "APC"}
_LABEL_COLOURS = {0: "#9e9e9e", 1: "#e6550d", 2: "#6a51a3", 3: "#2ca02c"}
_ENVELOPE = "#1f5fa6"
_FLAG = "#d62728"


def fmt_hms(seconds: float, with_seconds: bool = True) -> str:
    """``seconds`` as h:mm:ss (rounded), or h:mm (cut) without ``with_seconds``; "–" for None or NaN."""
    if seconds is None or not np.isfinite(seconds):
        return "–"
    s = int(round(float(seconds))) if with_seconds else int(float(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if with_seconds else f"{h}:{m:02d}"


def fmt_num(v: Any, digits: int = 4) -> str:
    """``v`` for the report's text: integers with thousands separators, floats to ``digits`` significant
    digits (very large or small ones in e-notation), "–" for None, anything else as ``str``."""
    if v is None:
        return "–"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not np.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}g}"
    return str(v)


def _new_fig(w: float, h: float, margins: tuple = (0.75, 0.2, 0.35, 0.55), **space):
    """A figure of ``w`` × ``h`` inches with fixed ``margins`` (left, right, top, bottom, in inches)
    around its subplots (``space``: ``wspace``/``hspace`` between them). Fixed margins, not
    Matplotlib's constrained layout: that measures every text of a figure in an extra draw, a third
    to a half of what a figure cost."""
    from matplotlib.figure import Figure  # noqa: PLC0415  (no pyplot, Agg canvas on save)

    fig = Figure(figsize=(w, h), dpi=_DPI)
    left, right, top, bottom = margins
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h, **space)
    return fig


def _title(ax, text: str, fontsize: float = 10) -> None:
    """A left-aligned title just above ``ax``, at a fixed place (``Axes.set_title`` moves its title
    clear of the ticks by measuring them at every draw)."""
    ax.text(0.0, 1.0, text, transform=ax.transAxes, ha="left", va="bottom", fontsize=fontsize)


def _hours_formatter():
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    return FuncFormatter(lambda v, _pos: fmt_hms(v * 3600.0, with_seconds=v * 3600 < 600) if v >= 0 else "")


def _no_data(ax, msg: str = "no data") -> None:
    ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, color="#888")
    ax.set_xticks([])
    ax.set_yticks([])


def _drawn_ticks(ax, which: str, *, labels: bool = True, grid: bool = False, fontsize: float = 8,
                 right: bool = False) -> None:
    """The ticks of one axis of ``ax`` (``which`` "x": at the bottom, "y": at the left, or at the right
    with ``right``, as a vertical colorbar's) drawn as LineCollections (marks, grid) and a Text per label,
    in place of Matplotlib's Tick objects: five artists a tick (a log axis has dozens of minor ones),
    built at every draw, were a third of what the report's figures cost to draw (28-43 ms of 75-120 ms a
    figure, 2 cores; ``bench/figure_times.py``), and the late figures are on the flow's critical path.
    The axis's own locators and formatters pick and write the ticks, major and minor, linear or log, so
    the marks, labels and grid (the major ticks') are those Matplotlib would draw, at its default sizes
    and with its labels at ``fontsize`` (``tests/test_report.py`` compares them). Call it once the
    limits are final."""
    from matplotlib import rcParams  # noqa: PLC0415
    from matplotlib.collections import LineCollection  # noqa: PLC0415
    from matplotlib.ticker import NullLocator  # noqa: PLC0415
    from matplotlib.transforms import offset_copy  # noqa: PLC0415

    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = axis.get_view_interval()
    a, b = sorted(axis.get_transform().transform([lo, hi]))  # (the view in scaled units: a log axis's logs)
    tol = 1e-10 * (b - a)
    kinds = []
    for kind in ("major", "minor"):
        locs = np.asarray(axis.get_majorticklocs() if kind == "major" else axis.get_minorticklocs(), np.float64)
        if locs.size:  # those in view, as Matplotlib keeps them
            t = axis.get_transform().transform(locs)
            locs = locs[np.isfinite(t) & (t >= a - tol) & (t <= b + tol)]
        fmt = axis.get_major_formatter() if kind == "major" else axis.get_minor_formatter()
        texts = fmt.format_ticks(list(locs)) if labels and locs.size else [""] * locs.size
        offset = fmt.get_offset() if kind == "major" and labels and locs.size else ""
        kinds.append((kind, [float(v) for v in locs], texts, offset))
    axis.set_major_locator(NullLocator())  # (no Tick objects at the draw)
    axis.set_minor_locator(NullLocator())
    if not any(k[1] for k in kinds):
        return
    fig = ax.figure
    pos = ax.get_position()  # (a fixed layout: its size in inches is known now)
    size_in = pos.height * fig.get_figheight() if which == "x" else pos.width * fig.get_figwidth()
    colour = rcParams[f"{which}tick.color"]
    trans = ax.get_xaxis_transform() if which == "x" else ax.get_yaxis_transform()
    room = 0.0
    for kind, locs, texts, offset in kinds:
        size = rcParams[f"{which}tick.{kind}.size"]
        tick = size / 72.0 / size_in  # (points, as a fraction of the axes)
        pad = size + rcParams[f"{which}tick.{kind}.pad"]
        gid = f"{which}tick" if kind == "major" else f"{which}minor"
        shown = [(v, t) for v, t in zip(locs, texts) if t]
        if which == "x":
            marks = [[(v, 0.0), (v, -tick)] for v in locs]
            at = offset_copy(trans, fig=fig, y=-pad, units="points")
            for v, t in shown:
                ax.text(v, 0.0, t, transform=at, ha="center", va="top", fontsize=fontsize, color=colour,
                        clip_on=False, gid=gid)
            if offset:
                ax.text(1.0, 0.0, offset, transform=offset_copy(ax.transAxes, fig=fig, y=-pad - 1.6 * fontsize,
                                                                 units="points"),
                        ha="right", va="top", fontsize=fontsize, color=colour, gid="xoffset")
        else:
            edge, out, sign = (1.0, 1.0 + tick, 1) if right else (0.0, -tick, -1)
            marks = [[(edge, v), (out, v)] for v in locs]
            at = offset_copy(trans, fig=fig, x=sign * pad, units="points")
            side = "left" if right else "right"
            for v, t in shown:
                ax.text(edge, v, t, transform=at, ha=side, va="center_baseline", fontsize=fontsize, color=colour,
                        clip_on=False, gid=gid)
            if offset:
                ax.text(edge, 1.0, offset, transform=offset_copy(ax.transAxes, fig=fig, x=sign * pad, y=2,
                                                                 units="points"),
                        ha=side, va="bottom", fontsize=fontsize, color=colour, gid="yoffset")
        wide, tall = _text_extent_pts([t for _, t in shown], fontsize)
        room = max(room, pad + (tall if which == "x" else wide))
        ax.add_collection(LineCollection(marks, colors=colour, linewidths=rcParams[f"{which}tick.{kind}.width"],
                                         transform=trans, clip_on=False, gid=f"{which}marks-{kind}"), autolim=False)
        if grid and kind == "major":
            lines = [[(v, 0.0), (v, 1.0)] if which == "x" else [(0.0, v), (1.0, v)] for v in locs]
            ax.add_collection(LineCollection(lines, colors=rcParams["grid.color"], linewidths=0.4, alpha=0.5,
                                             transform=trans, zorder=1.5), autolim=False)  # (as axisbelow "line")
    # the axis's label clear of the tick labels, where Matplotlib would put it (it measures its Tick
    # objects' labels at each draw: here they are measured once, by the same renderer's font metrics)
    room += rcParams["axes.labelpad"]
    if which == "x":
        axis.set_label_coords(0.5, 0.0, offset_copy(ax.transAxes, fig=fig, y=-room, units="points"))
    else:
        axis.set_label_coords(1.0 if right else 0.0, 0.5,
                              offset_copy(ax.transAxes, fig=fig, x=room if right else -room, units="points"))


_MEASURE: list = []  # (an Agg renderer, made once a process, that measures texts)


def _text_extent_pts(texts, fontsize: float) -> tuple[float, float]:
    """The widest and the tallest of ``texts`` at ``fontsize`` in Matplotlib's default font, in points
    (0, 0 for none), as the Agg renderer lays them out."""
    if not texts:
        return 0.0, 0.0
    from matplotlib import cbook  # noqa: PLC0415
    from matplotlib.backends.backend_agg import RendererAgg  # noqa: PLC0415
    from matplotlib.font_manager import FontProperties  # noqa: PLC0415

    if not _MEASURE:
        _MEASURE.append(RendererAgg(8, 8, 72))  # (72 dpi: a pixel is a point)
    prop = FontProperties(size=fontsize)
    sizes = [_MEASURE[0].get_text_width_height_descent(t, prop, ismath=cbook.is_math_text(t)) for t in texts]
    # (a line is at least as tall as "lp", as Matplotlib lays a text out)
    low = _MEASURE[0].get_text_width_height_descent("lp", prop, ismath=False)[1]
    return max(w for w, _, _ in sizes), max(low, *(h for _, h, _ in sizes))


def _style(ax, *, xlabels: bool = True) -> None:
    """Two spines and the ticks (:func:`_drawn_ticks`) with a grid; call it once the limits are final."""
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)
    _drawn_ticks(ax, "x", labels=xlabels, grid=True)
    _drawn_ticks(ax, "y", grid=True)


# ---- individual figures ----------------------------------------------------


def _fig_stream(d: ReportData) -> str:
    from matplotlib.colors import to_rgba  # noqa: PLC0415

    fig = _new_fig(13.0, 3.4, margins=(0.95, 0.3, 0.32, 0.5))
    gs = fig.add_gridspec(2, 1, height_ratios=[1.0, 0.13], hspace=0.08)
    ax = fig.add_subplot(gs[0])
    rug = fig.add_subplot(gs[1])  # (the same time axis: its limits set alike, below)
    mn = np.asarray(d.stream_min, dtype=np.float64).reshape(-1)
    mx = np.asarray(d.stream_max, dtype=np.float64).reshape(-1)
    fs = float(d.fs) if d.fs else 1.0
    dur_h = float(d.total_samples) / fs / 3600.0
    ncols = mn.size
    if ncols and np.isfinite(mn).any():
        # the envelope onto the axes' pixel columns when drawn (4 000 columns as a polygon: 25 ms to fill)
        colour = np.round(np.array(to_rgba(_ENVELOPE, 0.85)) * 255)

        def paint(shape, xlim, ylim):
            rgba = np.empty((*shape, 4), np.uint8)
            rgba[..., :3] = colour[:3]
            rgba[..., 3] = np.round(colour[3] * np.minimum(_envelope_cover(mn, mx, dur_h, xlim, ylim, shape), 1.0))
            return rgba

        ax.add_artist(_raster()(ax, paint, zorder=1))  # (a filled area's zorder: below the grid)
        lo, hi = np.nanpercentile(mn, 0.2), np.nanpercentile(mx, 99.8)
        pad = 0.08 * (hi - lo if hi > lo else 1.0)
        ax.set_ylim(min(lo, np.nanmedian(mn)) - pad, max(hi, np.nanmedian(mx)) + pad)
    else:
        _no_data(ax)
    ax.set_xlim(0, dur_h if dur_h > 0 else 1)
    rug.set_xlim(ax.get_xlim())
    ax.set_ylabel("amplitude", fontsize=9)
    names = list(getattr(d, "recording_names", None) or [])
    what = "Whole recording" if len(names) < 2 else f"{len(names)} recordings, one after the other"
    _title(ax, f"{what}, min/max envelope of {ncols:,} columns (y clipped to 0.2–99.8 percentile)")
    if len(names) > 1:  # where each recording starts, and (while they fit) its name
        starts = np.asarray(getattr(d, "recording_starts_s", None) or [], dtype=np.float64) / 3600.0
        for h in starts[1:]:
            for a in (ax, rug):
                a.axvline(h, color="#555555", lw=0.6, alpha=0.8)
        if len(names) <= 40:
            ends = np.append(starts[1:], dur_h)
            for name, a, b in zip(names, starts, ends):
                ax.text((a + b) / 2, 0.985, str(name)[:12], transform=ax.get_xaxis_transform(), ha="center",
                        va="top", fontsize=7 if len(names) <= 16 else 5.5, color="#222222",
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.8})
    _style(ax, xlabels=False)
    t = np.asarray(d.anomaly_times_s, dtype=np.float64).reshape(-1) / 3600.0
    if t.size:
        rug.vlines(t, 0, 1, color=_FLAG, lw=0.6, alpha=0.7)
    rug.set_ylim(0, 1)
    rug.set_yticks([])
    rug.set_ylabel(f"flagged\n({t.size:,})", fontsize=8, rotation=0, ha="right", va="center")
    rug.xaxis.set_major_formatter(_hours_formatter())
    rug.set_xlabel("time (h:mm)", fontsize=9)
    _drawn_ticks(rug, "x")
    for s in ("top", "right", "left"):
        rug.spines[s].set_visible(False)
    return figure_png(fig)


def _fig_lengths(d: ReportData) -> str:
    fig = _new_fig(6.4, 3.4, margins=(0.75, 0.2, 0.55, 0.55))
    ax = fig.add_subplot()
    counts = np.asarray(d.length_hist_counts, dtype=np.float64).reshape(-1)
    edges = np.asarray(d.length_hist_edges, dtype=np.float64).reshape(-1)
    if counts.size and edges.size == counts.size + 1:
        ax.stairs(counts, edges, fill=True, color="#4c72b0", alpha=0.9)
        if counts.max() > 0 and counts.max() / max(counts[counts > 0].min(), 1) > 200:
            ax.set_yscale("log")
        lo, hi = d.length_bounds
        ax.axvspan(lo, hi, color="#2ca02c", alpha=0.15, label=f"kept {int(lo)}–{int(hi)}")
        ax.axvline(lo, color="#2ca02c", lw=1.2)
        ax.axvline(hi, color="#2ca02c", lw=1.2)
        ax.legend(fontsize=8, loc="upper right", frameon=False)
        if d.fs:
            sec = ax.secondary_xaxis("top", functions=(lambda v: v / d.fs * 1e3, lambda v: v * d.fs / 1e3))
            sec.set_xlabel("ms", fontsize=8)
            sec.tick_params(labelsize=7)
    else:
        _no_data(ax)
    ax.set_xlabel("beat length (samples)", fontsize=9)
    ax.set_ylabel("beats", fontsize=9)
    _style(ax)
    return figure_png(fig)


def _fig_aligned(d: ReportData) -> str:
    fig = _new_fig(6.4, 3.4, margins=(0.75, 0.2, 0.3, 0.55))
    ax = fig.add_subplot()
    a = np.asarray(d.aligned_beats, dtype=np.float64)
    if a.ndim == 2 and a.size:
        fs = float(d.fs) if d.fs else 1.0
        t = np.arange(a.shape[1]) / fs * 1e3
        ax.plot(t, a.T, lw=0.6, alpha=0.55, color="#4c72b0")
        ax.plot(t, np.median(a, axis=0), lw=1.6, color="#111", label="median")
        ax.legend(fontsize=8, frameon=False)
        _title(ax, f"{a.shape[0]} typical kept beats, zero padded to {a.shape[1]} samples", fontsize=9)
        ax.set_xlabel("time from beat start (ms)" if d.fs else "sample", fontsize=9)
    else:
        _no_data(ax)
    ax.set_ylabel("amplitude", fontsize=9)
    _style(ax)
    return figure_png(fig)


def _fig_training(d: ReportData) -> str:
    fig = _new_fig(6.4, 3.4)
    ax = fig.add_subplot()
    tl = np.asarray(list(d.train_loss) if d.train_loss is not None else [], dtype=np.float64)
    has = False
    if tl.size:
        ep = np.arange(1, tl.size + 1)
        ax.plot(ep, tl, marker="o", ms=3, lw=1.4, color="#4c72b0", label="train loss")
        has = True
    if d.test_loss is not None and np.isfinite(d.test_loss):
        ax.axhline(float(d.test_loss), color="#dd8452", lw=1.4, ls="--", label=f"test loss {float(d.test_loss):.4g}")
        has = True
    if has:
        ax.legend(fontsize=8, frameon=False)
        allv = np.concatenate([tl[np.isfinite(tl)], [float(d.test_loss)] if d.test_loss is not None else []])
        allv = allv[np.isfinite(allv)]
        if allv.size and allv.min() > 0 and allv.max() / allv.min() > 30:
            ax.set_yscale("log")
        if tl.size:
            from matplotlib.ticker import MultipleLocator  # noqa: PLC0415

            ax.xaxis.set_major_locator(MultipleLocator(max(1, math.ceil(tl.size / 10))))  # whole epochs
            ax.set_xlim(0.5, tl.size + 0.5)
    else:
        _no_data(ax)
    ax.set_xlabel("epoch", fontsize=9)
    ax.set_ylabel("loss", fontsize=9)
    _style(ax)
    return figure_png(fig)


def _fig_scores(d: ReportData) -> str:
    fig = _new_fig(6.4, 3.4)
    ax = fig.add_subplot()
    s = np.asarray(d.score_all, dtype=np.float64).reshape(-1)
    s = s[np.isfinite(s)]
    if s.size:
        counts, edges = np.histogram(s, bins=120)  # one step patch, not 120 bars
        ax.stairs(counts, edges, fill=True, color="#4c72b0", baseline=0.5)
        ax.set_yscale("log")
        ax.set_ylim(0.5, None)
        thr = float(d.threshold)
        n_above = int((s >= thr).sum())
        ax.axvline(thr, color=_FLAG, lw=1.4, label=f"threshold {thr:.4g}  ({n_above:,} ≥)")
        ax.legend(fontsize=8, frameon=False)
    else:
        _no_data(ax)
    ax.set_xlabel("anomaly score", fontsize=9)
    ax.set_ylabel("beats (log)", fontsize=9)
    _style(ax)
    return figure_png(fig)


def _pixel_max(x, y, value, xlim, ylim, shape) -> np.ndarray:
    """Datashader-style aggregation of points onto pixels: the largest ``value`` of the points in
    each pixel of a ``shape`` (rows, columns) grid over ``xlim`` × ``ylim`` (row 0 at the bottom),
    widened by one pixel so that single points stay visible; NaN where no point falls."""
    rows, cols = shape
    c = np.floor((x - xlim[0]) / (xlim[1] - xlim[0]) * cols).astype(np.int64)
    r = np.floor((y - ylim[0]) / (ylim[1] - ylim[0]) * rows).astype(np.int64)
    ok = (c >= 0) & (c < cols) & (r >= 0) & (r < rows) & np.isfinite(value)
    img = np.full(rows * cols, -np.inf)
    np.maximum.at(img, r[ok] * cols + c[ok], value[ok])
    img = img.reshape(rows, cols)
    np.maximum(img[1:], img[:-1], out=img[1:])  # each pixel also takes the one below it,
    np.maximum(img[:, 1:], img[:, :-1], out=img[:, 1:])  # then the one to its left (ufuncs buffer overlaps)
    img[np.isneginf(img)] = np.nan
    return img


def _latent_frame(d: ReportData):
    """What the two latent-space figures share (so that their panels match point for point): the
    test beats' latent means ``x``, ``y``, their scores, their truth labels (None without a truth), the
    axes' limits (the bulk of the points) and the colour scale's range; None when there is nothing to
    draw."""
    mu = np.asarray(d.latent_mu, dtype=np.float64)
    sc = np.asarray(d.latent_score, dtype=np.float64).reshape(-1)
    labels = None if d.truth_labels is None else np.asarray(d.truth_labels).reshape(-1)
    if labels is not None and labels.size != sc.size:
        labels = None
    if mu.ndim != 2 or mu.shape[0] == 0 or mu.shape[1] < 2 or sc.size != mu.shape[0]:
        return None
    x, y = mu[:, 0], mu[:, 1]
    fin = sc[np.isfinite(sc)]
    vmin, vmax = (np.percentile(fin, 1), np.percentile(fin, 99.5)) if fin.size else (0, 1)
    if vmax <= vmin:
        vmax = vmin + 1e-9
    # Zoom on the bulk: outliers can stretch the axes a lot.
    lims = []
    for arr in (x, y):
        f = arr[np.isfinite(arr)]
        lo, hi = np.percentile(f, [0.05, 99.95]) if f.size else (0.0, 1.0)
        pad = 0.08 * (hi - lo if hi > lo else 1.0)
        lims.append((lo - pad, hi + pad))
    return SimpleNamespace(x=x, y=y, sc=sc, labels=labels, lims=lims, vrange=(vmin, vmax))


def _latent_image(ax, f, value, cmap, vmin: float, vmax: float):
    """``value`` of the points aggregated onto the pixels of ``ax`` (:func:`_pixel_max`) and put on the
    canvas as they are; returns their colour scale (a ``ScalarMappable``, for a colorbar).

    The aggregation is made when the figure is drawn (:func:`_raster`), at the axes' final place and
    limits (a colorbar added later narrows them), one aggregated value a pixel: no resampling of an image
    made beforehand at an estimated size, which (``imshow``) cost 20 ms a figure (2 cores)."""
    from matplotlib.cm import ScalarMappable  # noqa: PLC0415
    from matplotlib.colors import Normalize  # noqa: PLC0415

    scale = ScalarMappable(Normalize(vmin, vmax), cmap)

    def paint(shape, xlim, ylim):  # (NaN, where no point falls: the colormap's "bad" colour, transparent)
        return scale.to_rgba(_pixel_max(f.x, f.y, value, xlim, ylim, shape), bytes=True)

    ax.add_artist(_raster()(ax, paint, zorder=0))  # (an image's zorder: below the lines, markers and texts)
    return scale


@functools.lru_cache(maxsize=None)
def _raster():
    """A Matplotlib artist class (made on first use: this module imports no Matplotlib until a figure is
    drawn): ``Raster(ax, paint, zorder)`` asks ``paint((rows, cols), xlim, ylim)`` at drawing for an RGBA
    image (uint8, row 0 at the bottom) of the axes' pixels at their final place and limits, and gives it to
    the renderer as it is (the datashader way: aggregated onto the pixels, not drawn as shapes)."""
    from matplotlib.artist import Artist  # noqa: PLC0415

    class Raster(Artist):
        def __init__(self, ax, paint, zorder: float):
            super().__init__()
            self._ax, self._paint = ax, paint
            self.set_zorder(zorder)

        def draw(self, renderer):
            if not self.get_visible():
                return
            box = self._ax.bbox  # (display coordinates: pixels from the canvas's bottom left)
            x0, y0 = int(round(box.x0)), int(round(box.y0))
            cols, rows = int(round(box.x1)) - x0, int(round(box.y1)) - y0
            if cols > 0 and rows > 0:
                rgba = self._paint((rows, cols), self._ax.get_xlim(), self._ax.get_ylim())
                gc = renderer.new_gc()
                gc.set_clip_rectangle(box)
                renderer.draw_image(gc, x0, y0, rgba)  # (its first row at the bottom, as NonUniformImage's)
                gc.restore()
            self.stale = False

    return Raster


def _envelope_cover(mn, mx, xmax: float, xlim, ylim, shape) -> np.ndarray:
    """How much of each pixel of a (rows, columns) grid over ``xlim`` x ``ylim`` (row 0 at the bottom) a
    min/max envelope covers, from 0 to 1: column ``j`` of ``mn``/``mx`` spans x from ``j`` to ``j + 1`` times
    ``xmax / n`` and, in each pixel column it overlaps, the rows from its minimum's to its maximum's (at least
    one), weighted by the share of the pixel column's width it overlaps (NaN columns cover nothing). As a
    polygon's antialiasing shades it: where data columns are narrower than pixels, a row that only a few of
    them reach is pale. (rows, columns), float."""
    rows, cols = shape
    mn, mx = np.asarray(mn, np.float64).reshape(-1), np.asarray(mx, np.float64).reshape(-1)
    n = mn.size
    if n == 0 or xmax <= 0:
        return np.zeros(shape)
    edges = (xlim[0] + (xlim[1] - xlim[0]) * np.arange(cols + 1) / cols) / (xmax / n)  # (in data columns)
    first = np.maximum(np.floor(edges[:-1]), 0).astype(np.int64)
    last = np.minimum(np.ceil(edges[1:]) - 1, n - 1).astype(np.int64)
    k = max(1, int((last - first).max(initial=0)) + 1)  # (the most data columns a pixel column overlaps)
    j = first[:, None] + np.arange(k)  # (cols, k): the data columns of each pixel column
    share = (np.minimum(edges[1:, None], j + 1) - np.maximum(edges[:-1, None], j)) / (edges[1:] - edges[:-1])[:, None]
    jj = np.minimum(j, n - 1)
    lo, hi = mn[jj], mx[jj]
    share = np.where((j <= last[:, None]) & (share > 0) & np.isfinite(lo) & np.isfinite(hi), share, 0.0)
    scale = rows / (ylim[1] - ylim[0])
    with np.errstate(invalid="ignore"):
        r0 = np.floor((lo - ylim[0]) * scale)
        r1 = np.maximum(np.ceil((hi - ylim[0]) * scale) - 1, r0)
    r = np.arange(rows)[:, None, None]
    return (((r >= r0) & (r <= r1)) * share).sum(axis=2)


def _latent_axes_done(ax, f, title: str) -> None:
    _title(ax, title)
    ax.set_xlabel("z₁", fontsize=9)
    ax.set_ylabel("z₂", fontsize=9)
    ax.set_xlim(*f.lims[0])
    ax.set_ylim(*f.lims[1])
    _style(ax)


def _fig_latent(d: ReportData) -> str:
    """The test beats' latent means, coloured by score, drawn as an image of per-pixel maxima
    (:func:`_pixel_max`): the cost does not grow with the beats. The same points by truth label are
    a figure of their own (:func:`_fig_latent_truth`), drawn beside this one in another process."""
    f = _latent_frame(d)
    fig = _new_fig(7.6, 5.0, margins=(0.85, 0.2, 0.35, 0.55))
    ax = fig.add_subplot()
    if f is None:
        _no_data(ax)
        return figure_png(fig)
    sca = _latent_image(ax, f, f.sc, "viridis", *f.vrange)
    flagged = f.sc >= float(d.threshold)
    if flagged.any():
        ax.scatter(
            f.x[flagged], f.y[flagged], s=20, facecolors="none", edgecolors=_FLAG, lw=0.7,
            label=f"flagged ({int(flagged.sum()):,})",
        )
        ax.legend(fontsize=8, loc="upper right", frameon=True, framealpha=0.8)
    cb = fig.colorbar(sca, ax=ax, extend="both", shrink=0.9)
    cb.set_label("anomaly score", fontsize=9)
    _drawn_ticks(cb.ax, "y", right=True)
    _latent_axes_done(ax, f, f"latent means of {f.sc.size:,} test beats, coloured by score (largest per pixel)")
    return figure_png(fig)


def _fig_latent_truth(d: ReportData) -> str | None:
    """The points of :func:`_fig_latent` on the same axes, coloured by ground-truth label (the rarest
    per pixel); None without a truth."""
    from matplotlib.colors import ListedColormap  # noqa: PLC0415

    f = _latent_frame(d)
    if f is None or f.labels is None:
        return None
    labels = f.labels
    fig = _new_fig(6.6, 5.0, margins=(0.85, 0.2, 0.35, 0.55))
    ax = fig.add_subplot()
    uniq = [int(u) for u in np.unique(labels)]
    # the common class lowest, so that rare classes stay visible where they share a pixel
    uniq.sort(key=lambda u: -(labels == u).sum())
    rank = np.zeros(labels.size)
    for k, u in enumerate(uniq):
        rank[labels == u] = k
    colours = [_LABEL_COLOURS.get(u, "#17becf") for u in uniq]
    _latent_image(ax, f, rank, ListedColormap(colours), -0.5, len(uniq) - 0.5)
    for u, colour in zip(uniq, colours):
        ax.scatter([], [], s=16, lw=0, color=colour, label=f"{_LABEL_NAMES.get(u, str(u))} ({int((labels == u).sum()):,})")
    ax.legend(fontsize=8, frameon=True, framealpha=0.8, loc="upper right")
    _latent_axes_done(ax, f, "same points, coloured by ground-truth label (rarest per pixel)")
    return figure_png(fig)


def _fig_top(d: ReportData, limit: int = 12, part: str | None = None) -> str | None:
    """The signal around each of the ``limit`` highest-scoring beats, a panel each (beat shaded).

    The panels share one time axis (seconds from the beat's start) and are drawn in a single
    Matplotlib Axes, each trace scaled into its cell, its amplitude range written in the corner: a
    dozen Axes spent most of a second on their tick objects, and this figure is on the flow's
    critical path.

    ``part`` ``"left"`` or ``"right"``: the columns of panels left or right of the middle (a figure each,
    drawn at once in two processes and shown side by side by the page, :mod:`beatflow.report.html`), each
    the same pixels as that side of the whole figure, split in the gap between two columns; ``"right"`` is
    None where there is one column. With its four dozen texts, the whole figure was the longest of the
    report's to draw (Matplotlib 3.11 lays out and renders each glyph of a text on its own)."""
    from matplotlib.collections import LineCollection, PolyCollection  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    if part not in (None, "left", "right"):
        raise ValueError(f"the top anomalies' figure's part is 'left' or 'right', got {part!r}")
    top = list(d.top or [])[:limit]
    if not top:
        return None
    ncol = 4 if len(top) > 4 else len(top)
    nrow = math.ceil(len(top) / ncol)
    height = 2.05 * nrow + 0.35
    gx, gy, title_h = 0.07, 0.42, 0.16  # gaps between cells and the title band, in cell units
    xlim = (-0.005, ncol * (1 + gx) - gx + 0.005)
    whole, side = 13.0, 0.12  # (inches: the whole figure's width and its margins left and right)
    width = whole
    columns, shift, k = range(ncol), 0.0, math.ceil(ncol / 2)  # (k: the left part's columns)
    if part == "right" and k == ncol:  # (one column: all of it is the left part)
        return None
    if part is not None and k < ncol:
        unit = (whole - 2 * side) / (xlim[1] - xlim[0])  # (inches a cell unit)
        split = round((side + (k * (1 + gx) - gx / 2 - xlim[0]) * unit) * _DPI) / _DPI  # (in the gap; whole pixels)
        columns, shift, width = ((range(k), 0.0, split) if part == "left"
                                 else (range(k, ncol), split, whole - split))
    # (a part's axes are the whole figure's, shifted left by where the part starts: the same pixels)
    fig = _new_fig(width, height, margins=(side - shift, shift + width - (whole - side), 0.05, 0.5))
    ax = fig.add_subplot()
    ax.set_axis_off()
    fs = float(d.fs) if d.fs else 1.0
    panels = []
    for a in top:
        ctx = np.asarray(a.get("context", []), dtype=np.float64).reshape(-1)
        c0 = int(a.get("context_start", a.get("start", 0)))
        start = int(a.get("start", c0))
        t = (c0 + np.arange(ctx.size)) / fs - start / fs  # seconds relative to the beat start
        panels.append((a, t, ctx, start))
    spans = [(float(t[0]), float(t[-1])) for _, t, c, _ in panels if c.size]
    t0, t1 = (min(p[0] for p in spans), max(p[1] for p in spans)) if spans else (0.0, 1.0)
    t1 = t1 if t1 > t0 else t0 + 1.0
    ticks = [v for v in MaxNLocator(nbins=6).tick_values(t0, t1) if t0 <= v <= t1]
    frames, traces, shaded, grid = [], [], [], []
    for i, (a, t, ctx, start) in enumerate(panels):
        row, col = divmod(i, ncol)
        if col not in columns:
            continue
        x0, y0 = col * (1 + gx), -row * (1 + gy)

        def px(v, x0=x0):
            return x0 + (np.asarray(v, dtype=np.float64) - t0) / (t1 - t0)

        frames.append([(x0, y0), (x0 + 1, y0), (x0 + 1, y0 + 1), (x0, y0 + 1)])
        grid.extend([[(float(px(v)), y0), (float(px(v)), y0 + 1)] for v in ticks])
        if ctx.size and np.isfinite(ctx).any():
            lo, hi = float(np.nanmin(ctx)), float(np.nanmax(ctx))
            pad = 0.08 * (hi - lo if hi > lo else 1.0)
            lo, hi = lo - pad, hi + pad
            traces.append(np.column_stack([px(t), y0 + (ctx - lo) / (hi - lo)]))
            length = int(a.get("length", 0))
            b0, b1 = float(px(0.0)), float(px(length / fs))
            shaded.append([(b0, y0), (b1, y0), (b1, y0 + 1), (b0, y0 + 1)])
            ax.text(x0 + 0.99, y0 + 0.97, f"{fmt_num(lo + pad, 3)} … {fmt_num(hi - pad, 3)}", ha="right", va="top",
                    fontsize=7, color="#5a6470")
        else:
            ax.text(x0 + 0.5, y0 + 0.5, "no data", ha="center", va="center", fontsize=8, color="#888")
        time_s = a.get("time_s", start / fs)
        title = f"#{i + 1}  {fmt_hms(time_s)}  score {fmt_num(a.get('score'), 3)}"
        if a.get("label"):
            title += f"  [{a['label']}]"
        ax.text(x0, y0 + 1 + 0.03, title, ha="left", va="bottom", fontsize=8.5)
        if row == nrow - 1 or i + ncol >= len(top):  # the lowest panel of its column: the time axis
            for v in ticks:
                ax.text(float(px(v)), y0 - 0.03, f"{v:g}", ha="center", va="top", fontsize=7)
            ax.text(x0 + 0.5, y0 - 0.16, "s from beat start", ha="center", va="top", fontsize=8)
    ax.add_collection(LineCollection(grid, colors="#b0b0b0", linewidths=0.4, alpha=0.5))
    ax.add_collection(PolyCollection(shaded, facecolors=_FLAG, alpha=0.2, linewidths=0))
    ax.add_collection(PolyCollection(frames, facecolors="none", edgecolors="#888", linewidths=0.6))
    ax.add_collection(LineCollection(traces, colors="#222", linewidths=0.7))
    ax.set_xlim(*xlim)
    ax.set_ylim(-(nrow - 1) * (1 + gy) - 0.005, 1 + title_h)
    return figure_png(fig)

def _with_rc(draw):
    """``draw`` under the figures' Matplotlib settings (:data:`_RC`; the process's own are left as they were)."""
    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        import matplotlib  # noqa: PLC0415

        with matplotlib.rc_context(_RC):
            return draw(*args, **kwargs)

    return drawn


#: the report's figures: name -> function of the (parts of the) ReportData it reads ("top" and "top_right":
#: the top anomalies' figure's two parts, drawn at once)
FIGURES = {name: _with_rc(draw) for name, draw in (
    ("stream", _fig_stream), ("lengths", _fig_lengths), ("aligned", _fig_aligned), ("training", _fig_training),
    ("scores", _fig_scores), ("latent", _fig_latent), ("latent_truth", _fig_latent_truth),
    ("top", functools.partial(_fig_top, part="left")), ("top_right", functools.partial(_fig_top, part="right")))}
#: which figures need only what is known once the model is trained (the flow renders them while the
#: engine is built and the beats are scored)
EARLY_FIGURES = ("lengths", "aligned", "training")


@_with_rc
def warm_up() -> None:
    """Start of a figure-drawing process (``beatflow.report.pool.FigurePool``): Matplotlib (Agg) imported
    and its fonts loaded, so that the first figure it draws pays none of that."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    # mathtext (the log axes' labels) looks for fallback fonts that a minimal install lacks and warns
    # about each on the console; DejaVu Sans, which it falls back to, has every glyph the figures use
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    # what the figures use, once each (the first use of an image, a colorbar, a log axis or a
    # legend in a process costs up to 0.4 s more than the next)
    fig = _new_fig(3.0, 2.0, margins=(0.3, 0.3, 0.2, 0.3))
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    fig.colorbar(ax.imshow(np.eye(4), origin="lower", aspect="auto", interpolation="nearest"), ax=ax)
    ax.scatter([0.0, 1.0], [1.0, 0.0], s=4, label="x")
    ax.legend(fontsize=8)
    ax2.stairs([1.0, 10.0], [0.0, 1.0, 2.0], fill=True)
    ax2.set_yscale("log")
    ax2.plot([0.0, 1.0], [1.0, 2.0])
    _title(ax2, "x")
    figure_png(fig)


def render_figures(data, names=EARLY_FIGURES) -> dict:
    """The PNGs (base64) of the named figures. ``data`` may be a :class:`ReportData` or any object
    with the fields those figures read (``fs``, ``length_hist_counts``, ``length_hist_edges``,
    ``length_bounds``, ``aligned_beats``, ``train_loss``, ``test_loss`` for the early ones)."""
    return {name: FIGURES[name](data) for name in names}


def render_figures_timed(data, names) -> tuple[dict, tuple[float, float]]:
    """:func:`render_figures` and the wall-clock times of its start and end (a figure process's job:
    ``beatflow.report.pool.FigurePool`` tells from them how long a figure waited for a process)."""
    import time  # noqa: PLC0415

    start = time.time()
    return render_figures(data, names), (start, time.time())

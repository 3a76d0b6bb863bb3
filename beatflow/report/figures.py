"""Self-contained HTML report for a beatflow run.

Two parts:

* :func:`column_minmax` / :func:`combine_minmax` -- datashader-style per-pixel
  min/max aggregation of a long 1-D stream that is split into partitions
  (NumPy or CuPy arrays).  Each partition reduces to a tiny per-column result;
  combining the partial results of *any* partitioning gives exactly the
  one-partition result.
* :class:`ReportData` / :func:`write_report` -- one HTML file with inline
  base64 PNG figures (matplotlib, Agg, no pyplot global state), inline CSS,
  no external resources.

This module deliberately imports neither prefect nor dask.
"""

from __future__ import annotations

import base64
import functools
import html
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable

import numpy as np

from beatflow.device import namespace_of, to_host

__all__ = [
    "column_minmax",
    "combine_minmax",
    "column_bounds",
    "ReportData",
    "write_report",
    "render_report_html",
]


# --------------------------------------------------------------------------
# Part 1: per-pixel min/max aggregation
# --------------------------------------------------------------------------


def _xp(x):
    """Array namespace of ``x`` (the one decision lives in :mod:`beatflow.device`)."""
    return namespace_of(x)


def _to_numpy(a) -> np.ndarray:
    return to_host(a)


def _col_of(g: int, total: int, ncols: int) -> int:
    """Column containing global sample ``g`` (0 <= g < total).

    Column c covers [floor(c*total/ncols), floor((c+1)*total/ncols)); the
    containing column is the largest c with floor(c*total/ncols) <= g, i.e.
    c = floor(((g+1)*ncols - 1) / total).  Exact integer arithmetic.
    """
    return ((g + 1) * ncols - 1) // total


def column_bounds(total: int, ncols: int) -> np.ndarray:
    """Global sample boundaries (ncols+1,) of the pixel columns (int64)."""
    c = np.arange(ncols + 1, dtype=np.int64)
    return (c * np.int64(total)) // np.int64(ncols)


def _segment_minmax(xp, x, starts, ends, method: str):
    """min/max of x[starts[i]:ends[i]] for contiguous, non-empty, sorted segments
    that tile x[starts[0]:ends[-1]].  Returns device arrays."""
    if method == "reduceat":
        try:
            if np.issubdtype(x.dtype, np.floating):
                mins = xp.fmin.reduceat(x, starts)
                maxs = xp.fmax.reduceat(x, starts)
            else:
                mins = xp.minimum.reduceat(x, starts)
                maxs = xp.maximum.reduceat(x, starts)
            return mins, maxs
        except Exception:  # noqa: BLE001 - e.g. a CuPy without (f)min.reduceat: use the padded gather
            pass
    # Padded gather: every segment is read as a row of length Lmax; indices past
    # the segment end are clamped to its last element (repeats do not change
    # min/max), so no fill value / dtype juggling is needed.
    lengths = ends - starts
    lmax = int(lengths.max())
    idx = starts[:, None] + xp.arange(lmax, dtype=starts.dtype)[None, :]
    idx = xp.minimum(idx, (ends - 1)[:, None])
    g = x[idx]
    if np.issubdtype(g.dtype, np.floating):
        nan = xp.isnan(g)
        allnan = nan.all(axis=1)
        mins = xp.where(nan, xp.inf, g).min(axis=1)
        maxs = xp.where(nan, -xp.inf, g).max(axis=1)
        mins = xp.where(allnan, xp.nan, mins)
        maxs = xp.where(allnan, xp.nan, maxs)
    else:
        mins = g.min(axis=1)
        maxs = g.max(axis=1)
    return mins, maxs


def column_minmax(x, start: int, total: int, ncols: int, *, _method: str = "reduceat"):
    """Per-pixel-column min/max of one partition of a long stream.

    ``x`` is one partition (NumPy or CuPy 1-D array) covering global samples
    ``[start, start+len(x))`` of a stream of ``total`` samples; the stream maps
    onto ``ncols`` pixel columns, column ``c`` covering global samples
    ``[floor(c*total/ncols), floor((c+1)*total/ncols))``.

    Returns ``(first_col, mins, maxs)``: ``mins``/``maxs`` are NumPy float32
    arrays for columns ``first_col .. first_col+len(mins)-1`` touched by this
    partition (partial columns included).  Columns that contain no samples at
    all (possible when ``ncols > total``) are NaN.  NaN samples are ignored.
    All per-sample work happens in the array namespace of ``x``; only the small
    per-column result is transferred to the host.
    """
    start = int(start)
    total = int(total)
    ncols = int(ncols)
    if total <= 0 or ncols <= 0:
        raise ValueError("total and ncols must be positive")
    xp = _xp(x)
    x = xp.asarray(x).reshape(-1)
    n = int(x.shape[0])
    if n == 0:
        empty = np.empty(0, dtype=np.float32)
        return 0, empty, empty.copy()
    if start < 0 or start + n > total:
        raise ValueError(f"partition [{start}, {start + n}) outside stream [0, {total})")
    first = _col_of(start, total, ncols)
    last = _col_of(start + n - 1, total, ncols)
    # Boundaries of columns first..last (host side, tiny), in local coordinates.
    c = np.arange(first, last + 2, dtype=np.int64)
    b = (c * np.int64(total)) // np.int64(ncols) - start
    lo = np.clip(b[:-1], 0, n)
    hi = np.clip(b[1:], 0, n)
    nonempty = hi > lo
    mins = np.full(last - first + 1, np.nan, dtype=np.float32)
    maxs = mins.copy()
    starts_h = lo[nonempty]
    ends_h = hi[nonempty]
    starts = xp.asarray(starts_h)
    ends = xp.asarray(ends_h)
    dmin, dmax = _segment_minmax(xp, x, starts, ends, _method)
    mins[nonempty] = _to_numpy(dmin).astype(np.float32)
    maxs[nonempty] = _to_numpy(dmax).astype(np.float32)
    return first, mins, maxs


def combine_minmax(parts: Iterable[tuple[int, Any, Any]], ncols: int) -> tuple[np.ndarray, np.ndarray]:
    """Combine per-partition ``(first_col, mins, maxs)`` into full-length
    ``(mins, maxs)`` of ``ncols`` float32 values (NaN where no data); partial
    columns shared by neighbouring partitions are merged with min/max."""
    ncols = int(ncols)
    mins = np.full(ncols, np.nan, dtype=np.float32)
    maxs = np.full(ncols, np.nan, dtype=np.float32)
    for first, pmin, pmax in parts:
        pmin = np.asarray(_to_numpy(pmin), dtype=np.float32).reshape(-1)
        pmax = np.asarray(_to_numpy(pmax), dtype=np.float32).reshape(-1)
        if pmin.size == 0:
            continue
        first = int(first)
        sl = slice(first, first + pmin.size)
        if first < 0 or first + pmin.size > ncols:
            raise ValueError(f"part columns [{first}, {first + pmin.size}) outside [0, {ncols})")
        np.fmin(mins[sl], pmin, out=mins[sl])
        np.fmax(maxs[sl], pmax, out=maxs[sl])
    return mins, maxs


# --------------------------------------------------------------------------
# Part 2: the report
# --------------------------------------------------------------------------


@dataclass
class ReportData:
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
#: (``bench/RESULTS.md``, session 33).
_RC = {"text.hinting": "no_hinting"}
_LABEL_NAMES = {0: "normal", 1: "PVC", 2: "artifact"}
_LABEL_COLOURS = {0: "#9e9e9e", 1: "#e6550d", 2: "#6a51a3"}
_ENVELOPE = "#1f5fa6"
_FLAG = "#d62728"


def _fmt_hms(seconds: float, with_seconds: bool = True) -> str:
    if seconds is None or not np.isfinite(seconds):
        return "–"
    s = int(round(float(seconds))) if with_seconds else int(float(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if with_seconds else f"{h}:{m:02d}"


def _fmt_num(v: Any, digits: int = 4) -> str:
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


def _png(fig, up: bool = True) -> str:
    """``fig`` drawn by Agg and written as an RGB PNG (:func:`_png_bytes`, ``up``), base64."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return base64.b64encode(_png_bytes(np.asarray(canvas.buffer_rgba()), up)).decode("ascii")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_bytes(rgba: np.ndarray, up: bool = True) -> bytes:
    """An opaque RGBA image (``(h, w, 4)`` uint8) as an RGB PNG: every row by PNG's "Up" filter (its
    difference from the row above, in NumPy; ``up``, else unfiltered), zlib at level 1.

    The figures are opaque (a white face), so the alpha Matplotlib's ``savefig`` writes carries nothing.
    Pillow (level 1, RGB) chose a filter for each row by trying all five: its encoding took 18, 12 and 10 ms
    (the top anomalies', the latent space's and the stream's figures) where this takes 8, 6 and 4, for
    files of about the same size (2 cores; ``bench/RESULTS.md``, session 33). Lines and fills compress better
    by "Up"; the latent figures' scattered pixels do not: unfiltered, they are smaller and 3-4 ms faster."""
    h, w = rgba.shape[:2]
    rows = np.empty((h, 1 + 3 * w), np.uint8)
    rows[:, 0] = 2 if up else 0  # ("Up": above the first row PNG takes zeros)
    out = rows[:, 1:].reshape(h, w, 3)
    if up:
        out[0] = rgba[0, :, :3]
        np.subtract(rgba[1:, :, :3], rgba[:-1, :, :3], out=out[1:])  # (uint8: modulo 256, as PNG's filter)
    else:
        out[:] = rgba[:, :, :3]
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits a sample, RGB, deflate, filtered, not interlaced
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(rows.data, 1)) + _png_chunk(b"IEND", b""))


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

    return FuncFormatter(lambda v, _pos: _fmt_hms(v * 3600.0, with_seconds=v * 3600 < 600) if v >= 0 else "")


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
    return _png(fig)


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
    return _png(fig)


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
    return _png(fig)


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
    return _png(fig)


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
    return _png(fig)


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
        return _png(fig)
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
    return _png(fig, up=False)  # (scattered pixels: smaller and faster unfiltered)


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
    return _png(fig, up=False)


def _fig_top(d: ReportData, limit: int = 12, part: str | None = None) -> str | None:
    """The signal around each of the ``limit`` highest-scoring beats, a panel each (beat shaded).

    The panels share one time axis (seconds from the beat's start) and are drawn in a single
    Matplotlib Axes, each trace scaled into its cell, its amplitude range written in the corner: a
    dozen Axes spent most of a second on their tick objects, and this figure is on the flow's
    critical path.

    ``part`` ``"left"`` or ``"right"``: the columns of panels left or right of the middle (a figure each,
    drawn at once in two processes and shown side by side: :func:`_top_pictures`), each the same pixels as
    that side of the whole figure, split in the gap between two columns; ``"right"`` is None where there is
    one column. With its four dozen texts, the whole figure was the longest of the report's to draw (Matplotlib
    3.11 lays out and renders each glyph of a text on its own)."""
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
            ax.text(x0 + 0.99, y0 + 0.97, f"{_fmt_num(lo + pad, 3)} … {_fmt_num(hi - pad, 3)}", ha="right", va="top",
                    fontsize=7, color="#5a6470")
        else:
            ax.text(x0 + 0.5, y0 + 0.5, "no data", ha="center", va="center", fontsize=8, color="#888")
        time_s = a.get("time_s", start / fs)
        title = f"#{i + 1}  {_fmt_hms(time_s)}  score {_fmt_num(a.get('score'), 3)}"
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
    return _png(fig)


# ---- HTML ------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;background:#f4f5f7;color:#1d232b}
main{max-width:1340px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:1.6em;margin:.2em 0 .1em}
h2{font-size:1.15em;margin:1.6em 0 .5em;border-bottom:2px solid #d7dbe0;padding-bottom:.2em}
h3{font-size:1em;margin:.2em 0 .4em}
.sub{color:#5a6470;margin:0 0 1em;font-size:.9em}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px}
.card{background:#fff;border-radius:8px;padding:9px 12px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card .k{font-size:.75em;color:#5a6470;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:1.25em;font-weight:600;margin-top:2px;overflow-wrap:anywhere}
.card.alert .v{color:#b3261e}
.card.long .v{font-size:.95em;padding-top:.2em}
.row{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.panel{background:#fff;border-radius:8px;padding:10px 12px;box-shadow:0 1px 2px rgba(0,0,0,.08);overflow-x:auto}
.panel img{max-width:100%;height:auto;display:block;margin:0 auto}
.split{display:flex;max-width:1300px;margin:0 auto}
.split img{min-width:0;margin:0}
.note{color:#5a6470;font-size:.85em;margin:.3em 0 0}
table{border-collapse:collapse;font-size:.88em;background:#fff}
th,td{padding:4px 10px;border-bottom:1px solid #e3e6ea;text-align:right;white-space:nowrap}
th{background:#eef0f3;font-weight:600}
td.l,th.l{text-align:left}
.tables{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start;margin-top:12px}
@media (max-width:900px){.row{grid-template-columns:1fr}}
"""


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _png_width(b64: str) -> int:
    """The width in pixels of a base64 PNG (its header's)."""
    return struct.unpack(">I", base64.b64decode(b64[:32])[16:20])[0]


def _top_pictures(left: str, right: str | None, alt: str) -> str:
    """The top anomalies' figure from its two parts (:func:`_fig_top`), side by side at their shares of
    its width: one picture, at any page width."""
    if right is None:
        return _img(left, alt)
    wl, wr = _png_width(left), _png_width(right)
    return (f'<div class="split"><img alt="{html.escape(alt)}" style="width:{100 * wl / (wl + wr):.4f}%" '
            f'src="data:image/png;base64,{left}"><img alt="" style="width:{100 * wr / (wl + wr):.4f}%" '
            f'src="data:image/png;base64,{right}"></div>')


def _card(key: str, value: str, alert: bool = False) -> str:
    cls = "card alert" if alert else "card"
    if len(value) > 10:
        cls += " long"
    return f'<div class="{cls}"><div class="k">{html.escape(key)}</div><div class="v">{html.escape(value)}</div></div>'


def _summary_cards(d: ReportData) -> str:
    s = d.summary or {}
    fs = float(d.fs) if d.fs else float(s.get("fs") or 0)
    samples = s.get("samples", d.total_samples)
    dur = (float(samples) / fs) if fs else float("nan")
    cards = [
        _card("samples", _fmt_num(int(samples)) if samples is not None else "–"),
        _card("duration (h:mm)", _fmt_hms(dur, with_seconds=False)),
        _card("sampling rate", f"{_fmt_num(fs)} Hz" if fs else "–"),
        _card("beats detected", _fmt_num(s.get("beats_detected"))),
        _card("beats kept", _fmt_num(s.get("beats_kept"))),
    ]
    pf = s.get("pruned_fraction")
    cards.append(_card("pruned", f"{100.0 * float(pf):.2f} %" if pf is not None else "–"))
    cards.append(_card("anomalies flagged", _fmt_num(s.get("anomalies_flagged")), alert=True))
    vf = s.get("flutter_episodes")
    if isinstance(vf, dict):  # ventricular flutter/fibrillation: the waves are no beats (rhythm_episodes.csv)
        n = int(vf.get("count") or 0)
        cards.append(_card("VF / flutter episodes", f"{n} ({_fmt_hms(float(vf.get('seconds') or 0))})" if n else "none",
                           alert=n > 0))
    sl = s.get("second_lead")
    if isinstance(sl, dict):  # a second lead checked the beats (beatflow.detect.leads)
        which = f"lead {sl.get('lead')}" if sl.get("lead") is not None else f"column {sl.get('column')}"
        cards.append(_card(f"second lead ({which})", f"{_fmt_num(sl.get('doubtful_peaks_dropped', 0))} dropped, "
                           f"{_fmt_num(sl.get('peaks_moved', 0))} moved"))
    cards.append(_card("test loss", _fmt_num(s.get("test_loss", d.test_loss))))
    cards.append(_card("device", _fmt_num(s.get("device"))))
    cards.append(_card("workers", _fmt_num(s.get("workers"))))
    eng = s.get("engine") or {}
    if isinstance(eng, dict):
        cards.append(_card("engine backend", _fmt_num(eng.get("backend"))))
        cards.append(_card("engine max |err|", _fmt_num(eng.get("max_abs_err"), 3)))
    else:
        cards.append(_card("engine", _fmt_num(eng)))
    truth = s.get("truth")
    if isinstance(truth, dict) and truth:
        for k, name in (("se", "truth Se"), ("ppv", "truth PPV"), ("auc", "truth AUC")):
            if truth.get(k) is not None:
                cards.append(_card(name, f"{float(truth[k]):.3f}"))
    return '<div class="cards">' + "".join(cards) + "</div>"


_CONSUMED = {
    "samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "test_loss", "anomalies_flagged",
    "device", "workers", "engine", "timings_s", "truth", "flutter_episodes", "per_recording",
}


def _recordings_table(d: ReportData) -> str:
    """Per recording (when there are several): hours, kept beats, flagged beats and their share."""
    rows = (d.summary or {}).get("per_recording") or []
    if len(rows) < 2:
        return ""
    body = []
    for r in rows:
        beats, flagged = int(r.get("beats") or 0), int(r.get("flagged") or 0)
        cells = [str(r.get("recording")), _fmt_hms(3600.0 * float(r.get("hours") or 0.0)), f"{beats:,}",
                 f"{flagged:,}", f"{100.0 * flagged / beats:.1f} %" if beats else "–"]
        body.append("<tr>" + "".join(f'<td{" class=l" if j == 0 else ""}>{html.escape(c)}</td>'
                                     for j, c in enumerate(cells)) + "</tr>")
    head = ["recording", "duration", "beats", "flagged", "flagged share"]
    return ("<table><thead><tr>" + "".join(f'<th{" class=l" if j == 0 else ""}>{h}</th>' for j, h in enumerate(head))
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def _timings_table(d: ReportData) -> str:
    t = (d.summary or {}).get("timings_s") or {}
    if not isinstance(t, dict) or not t:
        return ""
    rows = []
    tot = 0.0
    for k, v in t.items():
        if k == "total":  # (the sum of the stages, shown as such)
            continue
        try:
            fv = float(v)
        except (TypeError, ValueError):
            rows.append(f'<tr><td class="l">{html.escape(str(k))}</td><td>{html.escape(str(v))}</td><td></td></tr>')
            continue
        tot += fv
        rows.append((k, fv))
    out = []
    for r in rows:
        if isinstance(r, str):
            out.append(r)
        else:
            k, fv = r
            pct = f"{100.0 * fv / tot:.1f} %" if tot > 0 else ""
            out.append(f'<tr><td class="l">{html.escape(str(k))}</td><td>{fv:.2f}</td><td>{pct}</td></tr>')
    out.append(f'<tr><th class="l">sum</th><th>{tot:.2f}</th><th></th></tr>')
    return (
        '<table><thead><tr><th class="l">stage</th><th>seconds</th><th>share</th></tr></thead><tbody>'
        + "".join(out) + "</tbody></table>"
    )


def _engine_table(d: ReportData) -> str:
    """The inference engine: what it is, its error against PyTorch, batch-1 latency, throughput by batch."""
    e = (d.summary or {}).get("engine")
    if not isinstance(e, dict) or not e:
        return ""
    rows = [("backend", f"{e.get('backend', '–')} ({e.get('precision', '–')}), {e.get('cache', '–')}"),
            ("max abs error vs PyTorch", _fmt_num(e.get("max_abs_err"), 3))]
    lat = e.get("latency_batch1_us")
    if isinstance(lat, dict):
        rows.append(("latency, batch 1", f"p50 {float(lat['p50']):.0f} µs, p99 {float(lat['p99']):.0f} µs "
                                          f"({e.get('clock') or 'timed'})"))
    for b, v in (e.get("throughput_by_batch") or {}).items():
        rows.append((f"throughput, batch {b}", f"{float(v):,.0f} beats/s"))
    return ('<table><thead><tr><th class="l">engine</th><th class="l">value</th></tr></thead><tbody>'
            + "".join(f'<tr><td class="l">{html.escape(k)}</td><td class="l">{html.escape(v)}</td></tr>' for k, v in rows)
            + "</tbody></table>")


def _other_table(d: ReportData) -> str:
    s = d.summary or {}
    rows = []
    for k, v in s.items():
        if k in _CONSUMED:
            continue
        if isinstance(v, dict):
            v = ", ".join(f"{kk}={_fmt_num(vv)}" for kk, vv in v.items())
        elif isinstance(v, (list, tuple)) and len(v) > 8:
            v = f"[{len(v)} items]"
        rows.append(f'<tr><td class="l">{html.escape(str(k))}</td><td class="l">{html.escape(_fmt_num(v))}</td></tr>')
    if not rows:
        return ""
    return '<table><thead><tr><th class="l">setting</th><th class="l">value</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>"


def _top_table(d: ReportData, limit: int = 50) -> str:
    top = list(d.top or [])[:limit]
    if not top:
        return '<p class="note">No anomalies flagged.</p>'
    has_label = any(a.get("label") for a in top)
    head = ["rank", "beat", "start (sample)", "time", "length", "length (ms)", "score"] + (["label"] if has_label else [])
    fs = float(d.fs) if d.fs else 0.0
    rows = []
    for i, a in enumerate(top):
        length = a.get("length")
        start = a.get("start")
        time_s = a.get("time_s", (float(start) / fs) if (start is not None and fs) else None)
        cells = [
            str(i + 1),
            _fmt_num(a.get("beat")),
            _fmt_num(start),
            _fmt_hms(time_s) if time_s is not None else "–",
            _fmt_num(length),
            f"{1e3 * float(length) / fs:.0f}" if (length is not None and fs) else "–",
            _fmt_num(a.get("score"), 4),
        ]
        if has_label:
            cells.append(str(a.get("label") or ""))
        rows.append(
            "<tr>" + "".join(f'<td{" class=l" if j == 7 else ""}>{html.escape(c)}</td>' for j, c in enumerate(cells))
            + "</tr>"
        )
    return (
        "<table><thead><tr>"
        + "".join(f'<th{" class=l" if j == 7 else ""}>{html.escape(h)}</th>' for j, h in enumerate(head))
        + "</tr></thead><tbody>"
        + "".join(rows) + "</tbody></table>"
    )


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
    _png(fig)


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


def render_report_html(data: ReportData, figures: dict | None = None) -> str:
    """Build the complete, self-contained HTML document as a string.

    ``figures``: PNGs already rendered (:func:`render_figures`); the others are rendered here.
    """
    d = data
    done = dict(figures or {})

    def fig(name):
        return done[name] if name in done else FIGURES[name](d)

    title = html.escape(str(d.title))
    fs = float(d.fs) if d.fs else 0.0
    dur_s = float(d.total_samples) / fs if fs else float("nan")
    n_flag = int(np.asarray(d.anomaly_times_s).size)
    n_top = min(len(d.top or []), 12)
    parts: list[str] = []
    parts.append(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>{title}</title>"
        f"<style>{_CSS}</style></head><body><main>"
    )
    parts.append(f"<h1>{title}</h1>")
    parts.append(
        f'<p class="sub">{_fmt_num(int(d.total_samples))} samples at {_fmt_num(fs)} Hz '
        f"({html.escape(_fmt_hms(dur_s))}), {n_flag:,} beats flagged above score threshold "
        f"{html.escape(_fmt_num(float(d.threshold)))}.</p>"
    )
    parts.append('<section id="summary"><h2>Summary</h2>')
    parts.append(_summary_cards(d))
    tt, ot, et = _timings_table(d), _other_table(d), _engine_table(d)
    if tt or ot or et:
        parts.append('<div class="tables">')
        if tt:
            parts.append(f'<div><h3>Per-stage timings</h3>{tt}</div>')
        if et:
            parts.append(f'<div><h3>Inference engine</h3>{et}</div>')
        if ot:
            parts.append(f"<div><h3>Other details</h3>{ot}</div>")
        parts.append("</div>")
    parts.append("</section>")

    parts.append('<section id="stream"><h2>Whole stream</h2><div class="panel">')
    parts.append(_img(fig("stream"), "min/max envelope of the whole recording with flagged beats"))
    parts.append('<p class="note">The stream is cut into columns, each drawn from the minimum to the maximum of '
                 "its samples; where columns are narrower than a pixel, values that few of them reach are pale. "
                 "Red ticks below mark the start of every flagged beat.</p></div>")
    rt = _recordings_table(d)
    if rt:
        parts.append(f'<div class="panel" style="margin-top:14px"><h3>Recordings</h3>{rt}</div>')
    parts.append("</section>")

    parts.append('<section id="beats"><h2>Beats</h2><div class="row">')
    parts.append('<div class="panel"><h3>Beat-length histogram</h3>' + _img(fig("lengths"), "beat length histogram")
                 + '<p class="note">Shaded band: the row length range; shorter beats are pruned, longer ones are cut to the row.</p></div>')
    parts.append('<div class="panel"><h3>Aligned beats</h3>' + _img(fig("aligned"), "aligned beats overlay")
                 + '<p class="note">Overlay of typical kept beats; a sharp common QRS means good alignment.</p></div>')
    parts.append("</div></section>")

    parts.append('<section id="model"><h2>Model</h2><div class="row">')
    parts.append('<div class="panel"><h3>Training curve</h3>' + _img(fig("training"), "training curve") + "</div>")
    parts.append('<div class="panel"><h3>Anomaly score distribution</h3>' + _img(fig("scores"), "score histogram")
                 + '<p class="note">All kept beats; the red line is the flagging threshold.</p></div>')
    parts.append("</div>")
    by_label = fig("latent_truth")
    parts.append('<div class="row" style="margin-top:14px">' if by_label is not None else '<div style="margin-top:14px">')
    parts.append('<div class="panel"><h3>Latent space</h3>' + _img(fig("latent"), "latent space")
                 + '<p class="note">Flagged beats (score ≥ threshold) are circled in red.</p></div>')
    if by_label is not None:
        parts.append('<div class="panel"><h3>Latent space by truth label</h3>'
                     + _img(by_label, "latent space by truth label") + "</div>")
    parts.append("</div>")
    parts.append("</section>")

    parts.append('<section id="anomalies"><h2>Top anomalies</h2>')
    top_png = fig("top")
    if top_png is not None:
        parts.append(f'<div class="panel"><h3>Top {n_top} in context</h3>'
                     + _top_pictures(top_png, fig("top_right"), "top anomalies")
                     + '<p class="note">Shaded: the flagged beat. Titles: rank, time (h:mm:ss), score.</p></div>')
    parts.append('<div class="panel" style="margin-top:14px"><h3>Table</h3>' + _top_table(d) + "</div>")
    parts.append("</section>")
    parts.append('<p class="note" style="margin-top:2em">Generated by beatflow. Self-contained file: no external resources.</p>')
    parts.append("</main></body></html>\n")
    return "".join(parts)


def write_report(path, data: ReportData, figures: dict | None = None) -> None:
    """Render ``data`` (with the ``figures`` already rendered) and write one self-contained HTML file
    atomically."""
    path = os.fspath(path)
    doc = render_report_html(data, figures)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(doc)
    os.replace(tmp, path)

"""The whole stream's min/max envelope for the report: datashader-style per-pixel-column min/max
aggregation of a long 1-D stream split into partitions (NumPy or CuPy arrays).

Each partition reduces to a tiny per-column result (:func:`column_minmax`, on the worker that holds it);
combining the partial results of *any* partitioning (:func:`combine_minmax`) gives exactly the
one-partition result.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from beatflow.device import namespace_of, to_host

__all__ = ["column_bounds", "column_minmax", "combine_minmax"]


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
    xp = namespace_of(x)
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
    mins[nonempty] = to_host(dmin).astype(np.float32)
    maxs[nonempty] = to_host(dmax).astype(np.float32)
    return first, mins, maxs


def combine_minmax(parts: Iterable[tuple[int, Any, Any]], ncols: int) -> tuple[np.ndarray, np.ndarray]:
    """Combine per-partition ``(first_col, mins, maxs)`` into full-length
    ``(mins, maxs)`` of ``ncols`` float32 values (NaN where no data); partial
    columns shared by neighbouring partitions are merged with min/max."""
    ncols = int(ncols)
    mins = np.full(ncols, np.nan, dtype=np.float32)
    maxs = np.full(ncols, np.nan, dtype=np.float32)
    for first, pmin, pmax in parts:
        pmin = np.asarray(to_host(pmin), dtype=np.float32).reshape(-1)
        pmax = np.asarray(to_host(pmax), dtype=np.float32).reshape(-1)
        if pmin.size == 0:
            continue
        first = int(first)
        sl = slice(first, first + pmin.size)
        if first < 0 or first + pmin.size > ncols:
            raise ValueError(f"part columns [{first}, {first + pmin.size}) outside [0, {ncols})")
        np.fmin(mins[sl], pmin, out=mins[sl])
        np.fmax(maxs[sl], pmax, out=maxs[sl])
    return mins, maxs

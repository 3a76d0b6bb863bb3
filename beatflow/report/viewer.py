"""The report's interactive stream viewer: the whole ECG stream, zoomable from the whole recording down to one
beat, inside the self-contained ``report.html`` (no network, no server).

Why a small hand-written canvas viewer (``templates/viewer.js``, vanilla JavaScript, ~15 kB) and not a library:

* plotly-resampler re-aggregates on zoom in a live Python (Dash) server: the report is one file opened from
  disk, with no server behind it;
* Bokeh (or Plotly) could draw a pyramid precomputed here, but its JavaScript bundle (about 1 MB for BokehJS,
  3-4 MB for plotly.js) would have to be inlined in every report for what is one line plot with markers;
* what the page needs is small: pick the pyramid level that gives about one bin per pixel, fold its bins into
  pixel columns, draw each column from its minimum to its maximum on a ``<canvas>``; that is what the viewer
  does, and nothing else is loaded.

The data, built here with NumPy and embedded in the page as base64 typed arrays (little-endian):

* a min/max **pyramid**: the finest level has one bin per about :data:`FINEST_BIN` samples (wider on a stream
  long enough that its two bytes a bin would pass :data:`LEVEL_BYTES`), each coarser level :data:`FACTOR` times
  fewer bins, down to the first level of fewer than :data:`FACTOR` x :data:`TOP_BINS` bins (about a pixel a bin
  for the whole stream on a wide screen). The finest level is the whole-stream picture's own reduction
  (:func:`beatflow.report.envelope.column_minmax` on the workers that hold the partitions, combined by
  :func:`~beatflow.report.envelope.combine_minmax`, ``n_0`` columns), and each coarser level is the same
  function over the level below it: ``n_0`` is a multiple of ``FACTOR ** levels``, so a bin of level ``k``
  is exactly ``FACTOR`` bins of level ``k - 1`` and covers the stream's samples
  ``[floor(j * total / n_k), floor((j + 1) * total / n_k))``, the bounds the page computes;
* the levels quantised to **int8** on one scale (``value = off + q * scale``, ``q = -128``: a bin with no
  sample): 254 steps over the stream's range are about a pixel of the viewer's height, and int8 halves the
  page against int16 for the same time resolution (at the finest level a bin is 64 ms at 250 Hz, which shows
  a beat's QRS and T wave but not its shape). The range leaves out the finest level's most extreme 0.01 % of
  bins either side (at least one) and is widened by 5 %: one far outlier (a lead-off spike) does not flatten
  the rest; values past it sit at the rail;
* the **raw samples** (int16 on the same offset, 128 times finer steps) only in windows around the beats a
  reader zooms onto: the top anomalies' table first, then the flagged beats by rank, then the V and S beats
  by rank, each from one second before the beat to one second after it, up to :data:`RAW_SAMPLES` samples
  in all; these windows are cut on the partitions' workers (:func:`beatflow.embed.partitions.snippets`);
* every kept beat's start on the stream's time axis (uint32) with its class and whether it is flagged
  (uint8: 0 N, 1 S, 2 V, +4 flagged), the unreadable stretches and where each recording starts.

For the 20 h synthetic default (18 M samples, 97 k beats) that is 6.2 MB of a 7.1 MB page: levels 4.0 MB,
raw 1.5 MB, beats 0.65 MB in base64 (``bench/viewer_bench.py``, ``bench/results/report.md``).

NumPy only: this module imports neither prefect nor dask.
"""

from __future__ import annotations

import base64
import math

import numpy as np

from beatflow.report.envelope import column_minmax, combine_minmax

__all__ = ["finest_columns", "level_columns", "pyramid", "quantise", "raw_windows", "beat_marks", "merge_pieces",
           "viewer_payload", "CLASS_CODES"]

#: samples a bin of the finest level holds, at least
FINEST_BIN = 16
#: the finest level's bytes (int8 minimum and maximum per bin), at most: a longer stream gets wider bins
LEVEL_BYTES = 2_400_000
#: bins of a level to the next coarser one
FACTOR = 4
#: the coarsest level has fewer than FACTOR * TOP_BINS bins (at least TOP_BINS where the stream allows)
TOP_BINS = 2048
#: raw samples (int16) the page holds, at most
RAW_SAMPLES = 600_000
#: a beat's class as the page codes it (+4: flagged)
CLASS_CODES = {"N": 0, "S": 1, "V": 2}


def _levels_above(n: int) -> int:
    """Coarser levels above a finest level of ``n`` bins: while the next one keeps ``TOP_BINS`` bins."""
    k = 0
    while n // FACTOR ** (k + 1) >= TOP_BINS:
        k += 1
    return k


def finest_columns(total: int) -> int:
    """The finest level's bins for a stream of ``total`` samples: about one per :data:`FINEST_BIN` samples (a
    power of two times more samples where :data:`LEVEL_BYTES` would be passed), rounded up to a multiple of
    ``FACTOR ** levels`` so that every coarser level's bins are whole groups of ``FACTOR`` (never more bins
    than samples)."""
    total = int(total)
    if total <= 0:
        raise ValueError("the stream has no samples")
    width = FINEST_BIN
    while 2 * math.ceil(total / width) > LEVEL_BYTES:
        width *= 2
    n = max(1, math.ceil(total / width))
    step = FACTOR ** _levels_above(n)
    return math.ceil(n / step) * step  # (step > 1 only where n is thousands of times below total)


def level_columns(n0: int) -> list[int]:
    """Bins of every level, finest first."""
    n0 = int(n0)
    out = [n0]
    for _ in range(_levels_above(n0)):
        if out[-1] % FACTOR:
            break
        out.append(out[-1] // FACTOR)
    return out


def pyramid(parts, total: int, n0: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The min/max pyramid, finest level first, as float32 ``(mins, maxs)`` (NaN: a bin with no sample).

    ``parts``: the partitions' ``column_minmax(core, offset, total, n0)`` results (any partitioning); level
    ``k + 1`` is :func:`column_minmax` over level ``k``'s minima and maxima."""
    n0 = finest_columns(total) if n0 is None else int(n0)
    mins, maxs = combine_minmax(parts, n0)
    out = [(mins, maxs)]
    for n in level_columns(n0)[1:]:
        m, x = out[-1]
        out.append((column_minmax(m, 0, m.size, n)[1], column_minmax(x, 0, x.size, n)[2]))
    return out


def quantise(levels) -> tuple[list[tuple[np.ndarray, np.ndarray]], float, float]:
    """The levels as int8 on one scale: ``(levels, off, scale)``, ``value ~ off + q * scale`` to half a step
    inside the range (the finest level's bins but the most extreme 0.01 % either side, at least one, widened
    by 5 %; values past it at -127 or 127), -128 where a bin has no sample."""
    mins, maxs = levels[0]
    ok = np.isfinite(mins) & np.isfinite(maxs)
    if ok.any():  # all but the k most extreme bins either side (k: one in 10 000, at least one where 2 or more)
        lo_v, hi_v = mins[ok], maxs[ok]
        k = min(max(1, lo_v.size // 10_000), lo_v.size - 1)
        lo = float(np.partition(lo_v, k)[k])
        hi = float(np.partition(hi_v, hi_v.size - 1 - k)[hi_v.size - 1 - k])
    else:
        lo = hi = 0.0
    pad = 0.05 * (hi - lo) if hi > lo else max(1.0, abs(lo))
    lo, hi = lo - pad, hi + pad
    off, scale = (lo + hi) / 2.0, (hi - lo) / 254.0

    def q(v):
        out = np.full(v.shape, -128, np.int8)
        f = np.isfinite(v)
        out[f] = np.clip(np.rint((v[f] - off) / scale), -127, 127).astype(np.int8)
        return out

    return [(q(m), q(x)) for m, x in levels], off, scale


def beat_marks(plan, kb, offsets, classes, flagged) -> tuple[np.ndarray, np.ndarray]:
    """Every kept beat on the stream's time axis, in time order: ``(start, code)`` (uint32 samples; uint8
    :data:`CLASS_CODES` + 4 where flagged). ``offsets``: each recording's first sample on that axis."""
    kb = np.asarray(kb, np.int64)
    off = np.asarray([offsets[r] for r in range(len(offsets))], np.int64)
    start = plan.start[kb].astype(np.int64) + off[plan.recording[kb]]
    code = np.zeros(kb.size, np.uint8)
    if classes is not None:
        c = np.asarray(classes)
        for name, v in CLASS_CODES.items():
            code[c == name] = v
    code[np.asarray(flagged, bool)] += 4
    order = np.argsort(start, kind="stable")
    return start[order].astype(np.uint32), code[order]


def raw_windows(plan, kb, scores, flagged, classes, first_rows, fs: float,
                budget: int = RAW_SAMPLES) -> dict[int, list[tuple[int, int]]]:
    """The windows of raw signal the page holds, by owning partition: ``{partition: [(a, b), ...]}`` (samples of
    the beat's recording, from ``fs`` before the beat's start to ``fs`` after its end), for the kept rows
    ``first_rows`` (the top anomalies' table), then the flagged rows by rank, then the V and S rows by rank,
    until ``budget`` samples."""
    from beatflow.score.rule import rank_order

    pad = int(round(fs))
    order = rank_order(np.asarray(scores))
    f = np.asarray(flagged, bool)[order]
    rows = [np.asarray(first_rows, np.int64), order[f]]
    if classes is not None:
        c = np.asarray(classes)[order]
        rows.append(order[(~f) & ((c == "V") | (c == "S"))])
    seen: set[int] = set()
    used = 0
    out: dict[int, list[tuple[int, int]]] = {}
    for i in np.concatenate(rows).tolist():
        if i in seen:
            continue
        seen.add(i)
        b = int(kb[i])
        a, e = int(plan.start[b]) - pad, int(plan.start[b]) + int(plan.length[b]) + pad
        if used + (e - a) > budget:
            break
        used += e - a
        out.setdefault(int(plan.owner[b]), []).append((max(0, a), e))
    return out


def merge_pieces(pieces) -> list[tuple[int, np.ndarray]]:
    """Raw pieces ``(first sample on the stream's axis, samples)`` sorted and joined where they overlap or
    touch (the same stream's samples: the later piece adds only what lies past the earlier one's end)."""
    out: list[tuple[int, np.ndarray]] = []
    for a, x in sorted(((int(a), np.asarray(x, np.float32)) for a, x in pieces if len(x)), key=lambda p: p[0]):
        if out and a <= out[-1][0] + out[-1][1].size:
            a0, x0 = out[-1]
            past = a + x.size - (a0 + x0.size)
            if past > 0:
                out[-1] = (a0, np.concatenate([x0, x[x.size - past:]]))
            continue
        out.append((a, x))
    return out


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def viewer_payload(total: int, fs: float, parts, pieces=(), beats=None, unreadable_s=(), recording_names=(),
                   recording_starts=(), top_starts=()) -> dict:
    """What the page's viewer reads (JSON with base64 arrays; ``templates/viewer.js``).

    ``parts``: the partitions' finest-level columns (:func:`finest_columns` of ``total``); ``pieces``: the raw
    windows ``(first sample on the stream's axis, samples)``; ``beats``: :func:`beat_marks`;
    ``unreadable_s``: the unreadable stretches ``(start_s, end_s)``; ``recording_starts``: each recording's
    first sample; ``top_starts``: the top anomalies' table rows ``(stream start, length)``, in order."""
    total, fs = int(total), float(fs)
    levels, off, scale = quantise(pyramid(parts, total))
    merged = merge_pieces(pieces)
    rs = scale / 128.0
    raw = (np.concatenate([np.clip(np.rint((x - off) / rs), -32767, 32767) for _, x in merged]) if merged
           else np.zeros(0))
    bs, bc = beats if beats is not None else (np.zeros(0, np.uint32), np.zeros(0, np.uint8))
    return {
        "total": total, "fs": fs, "off": off, "scale": scale, "raw_scale": rs,
        "levels": [{"n": int(m.size), "lo": _b64(m, "i1"), "hi": _b64(x, "i1")} for m, x in levels],
        "raw": {"start": _b64([a for a, _ in merged], "<u4"), "len": _b64([x.size for _, x in merged], "<u4"),
                "data": _b64(raw, "<i2")},
        "beats": {"start": _b64(bs, "<u4"), "code": _b64(bc, "u1")},
        "unreadable": [[round(float(a) * fs), round(float(b) * fs)] for a, b in unreadable_s],
        "recordings": [[str(n), int(s)] for n, s in zip(recording_names, recording_starts)],
        "top": [[int(a), int(n)] for a, n in top_starts],
    }


def payload_bytes(payload: dict) -> int:
    """The payload's bytes as the page holds it (its base64 strings and the rest)."""
    import json

    return len(json.dumps(payload))

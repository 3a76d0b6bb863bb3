"""The report's page: one self-contained HTML file (inline CSS, the figures as inline base64 PNGs, the
stream viewer's script and data inline, no external resources), rendered by Jinja2 from
``templates/report.html.j2`` with autoescaping on.

The functions here turn a :class:`~beatflow.report.figures.ReportData` into what the template shows (texts,
already formatted, and the figures); the template holds all of the markup and escapes every text.

This module imports neither prefect nor dask.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from beatflow.report.figures import FIGURES, ReportData, fmt_hms, fmt_num
from beatflow.report.png import png_width

__all__ = ["render_report_html", "write_report"]

#: the summary's keys that the cards and tables above the settings table show
_CONSUMED = {
    "samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "test_loss", "anomalies_flagged",
    "device", "workers", "engine", "timings_s", "truth", "flutter_episodes", "per_recording", "classes",
    "quality",
}


@functools.lru_cache(maxsize=None)
def _template():
    """The page's template, loaded and compiled once a process: the first page a process renders takes
    12-19 ms, the next 1.3 ms, most of it escaping the figures' base64 (the full fake report of
    ``tests/test_report.py`` with its figures given, 2 cores)."""
    from jinja2 import Environment, PackageLoader, StrictUndefined  # noqa: PLC0415

    env = Environment(loader=PackageLoader("beatflow.report", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                      keep_trailing_newline=True)
    return env.get_template("report.html.j2")


def _card(key: str, value: str, alert: bool = False) -> dict:
    return {"key": key, "value": value, "alert": alert}


def _summary_cards(d: ReportData) -> list[dict]:
    s = d.summary or {}
    fs = float(d.fs) if d.fs else float(s.get("fs") or 0)
    samples = s.get("samples", d.total_samples)
    dur = (float(samples) / fs) if fs else float("nan")
    cards = [
        _card("samples", fmt_num(int(samples)) if samples is not None else "–"),
        _card("duration (h:mm)", fmt_hms(dur, with_seconds=False)),
        _card("sampling rate", f"{fmt_num(fs)} Hz" if fs else "–"),
        _card("beats detected", fmt_num(s.get("beats_detected"))),
        _card("beats kept", fmt_num(s.get("beats_kept"))),
    ]
    pf = s.get("pruned_fraction")
    cards.append(_card("pruned", f"{100.0 * float(pf):.2f} %" if pf is not None else "–"))
    cards.append(_card("anomalies flagged", fmt_num(s.get("anomalies_flagged")), alert=True))
    cl = s.get("classes")
    if isinstance(cl, dict) and cl.get("counts"):  # the beat classes (beatflow.score.classes)
        n = cl["counts"]
        cards.append(_card("V beats", f"{fmt_num(n.get('V', 0))} ({float(cl.get('v_burden_pct', 0)):.2f} %)",
                           alert=bool(n.get("V"))))
        cards.append(_card("S beats", f"{fmt_num(n.get('S', 0))} ({float(cl.get('s_burden_pct', 0)):.2f} %)",
                           alert=bool(n.get("S"))))
        vr = cl.get("v_runs") or {}
        cards.append(_card("V couplets / runs", f"{fmt_num(vr.get('couplets', 0))} / {fmt_num(vr.get('runs', 0))}",
                           alert=bool(vr.get("runs"))))
    vf = s.get("flutter_episodes")
    if isinstance(vf, dict):  # ventricular flutter/fibrillation: the waves are no beats (rhythm_episodes.csv)
        n = int(vf.get("count") or 0)
        cards.append(_card("VF / flutter episodes", f"{n} ({fmt_hms(float(vf.get('seconds') or 0))})" if n else "none",
                           alert=n > 0))
    qu = s.get("quality")
    if isinstance(qu, dict):  # unreadable stretches: no beats are detected there (quality.csv)
        n = int(qu.get("episodes") or 0)
        cards.append(_card("unreadable", f"{n} ({fmt_hms(float(qu.get('unreadable_s') or 0))})" if n else "none",
                           alert=n > 0))
    sl = s.get("second_lead")
    if isinstance(sl, dict):  # a second lead checked the beats (beatflow.detect.leads)
        which = f"lead {sl.get('lead')}" if sl.get("lead") is not None else f"column {sl.get('column')}"
        cards.append(_card(f"second lead ({which})", f"{fmt_num(sl.get('doubtful_peaks_dropped', 0))} dropped, "
                           f"{fmt_num(sl.get('peaks_moved', 0))} moved"))
    cards.append(_card("test loss", fmt_num(s.get("test_loss", d.test_loss))))
    cards.append(_card("device", fmt_num(s.get("device"))))
    cards.append(_card("workers", fmt_num(s.get("workers"))))
    eng = s.get("engine") or {}
    if isinstance(eng, dict):
        cards.append(_card("engine backend", fmt_num(eng.get("backend"))))
        cards.append(_card("engine max |err|", fmt_num(eng.get("max_abs_err"), 3)))
    else:
        cards.append(_card("engine", fmt_num(eng)))
    truth = s.get("truth")
    if isinstance(truth, dict) and truth:
        for k, name in (("se", "truth Se"), ("ppv", "truth PPV"), ("auc", "truth AUC")):
            if truth.get(k) is not None:
                cards.append(_card(name, f"{float(truth[k]):.3f}"))
    return cards


def _recordings(d: ReportData) -> list[list[str]]:
    """Per recording (when there are several): name, duration, kept beats, flagged beats and their share."""
    rows = (d.summary or {}).get("per_recording") or []
    if len(rows) < 2:
        return []
    out = []
    for r in rows:
        beats, flagged = int(r.get("beats") or 0), int(r.get("flagged") or 0)
        out.append([str(r.get("recording")), fmt_hms(3600.0 * float(r.get("hours") or 0.0)), f"{beats:,}",
                    f"{flagged:,}", f"{100.0 * flagged / beats:.1f} %" if beats else "–"])
    return out


def _classes(d: ReportData) -> dict | None:
    """The classes' table: per recording (and in all, with several) the beats of each class, the V and S
    burden, V couplets and runs (3 or more), S couplets and runs, the longest V run."""
    s = d.summary or {}
    rows = [r for r in (s.get("per_recording") or []) if r.get("classes")]
    if not rows:
        return None
    total = s.get("classes") or {}

    def cells(name, c, vb, sb, vr, sr):
        return [name, *(fmt_num(int(c.get(k, 0))) for k in ("N", "S", "V")), f"{float(vb):.2f} %",
                f"{float(sb):.2f} %", f"{vr.get('couplets', 0)} / {vr.get('runs', 0)}",
                f"{sr.get('couplets', 0)} / {sr.get('runs', 0)}", str(vr.get("longest", 0))]

    out = [cells(str(r["recording"]), r["classes"], r.get("v_burden_pct", 0), r.get("s_burden_pct", 0),
                 r.get("v_runs") or {}, r.get("s_runs") or {}) for r in rows]
    if len(rows) > 1 and total.get("counts"):
        out.append(cells("all", total["counts"], total.get("v_burden_pct", 0), total.get("s_burden_pct", 0),
                         total.get("v_runs") or {}, total.get("s_runs") or {}))
    return {"head": ["recording", "N", "S", "V", "V burden", "S burden", "V couplets / runs",
                     "S couplets / runs", "longest V run"], "rows": out}


def _unreadable(d: ReportData) -> dict | None:
    """The unreadable stretches' table (its first rows: ``d.unreadable_rows``) and the summary's totals,
    or None where there are none."""
    qu = (d.summary or {}).get("quality") or {}
    rows = list(getattr(d, "unreadable_rows", None) or [])
    n = int(qu.get("episodes") or len(rows))
    if not n:
        return None
    several = len({str(r.get("recording")) for r in rows}) > 1 or len((d.summary or {}).get("recordings") or []) > 1
    head = (["recording"] if several else []) + ["start", "end", "duration (s)", "reason"]
    body = [([str(r.get("recording"))] if several else [])
            + [fmt_hms(float(r["start_s"])), fmt_hms(float(r["end_s"])), f"{float(r['duration_s']):.1f}",
               str(r.get("reason"))] for r in rows]
    total = float(qu.get("unreadable_s") or sum(float(r["duration_s"]) for r in rows))
    note = f"{n:,} stretch(es), {total:,.1f} s ({fmt_hms(total)}) in all"
    if n > len(rows):
        note += f"; the first {len(rows)} shown, quality.csv has them all"
    return {"head": head, "rows": body, "note": note}


def _timings(d: ReportData) -> dict | None:
    """The stages' times: rows of (stage, seconds, share of their sum) and the sum (the summary's own
    ``total`` left out); a value that is no number is shown as it is, without a share."""
    t = (d.summary or {}).get("timings_s") or {}
    if not isinstance(t, dict) or not t:
        return None
    rows, tot = [], 0.0
    for k, v in t.items():
        if k == "total":
            continue
        try:
            fv = float(v)
        except (TypeError, ValueError):
            rows.append((str(k), str(v), None))
            continue
        tot += fv
        rows.append((str(k), None, fv))
    shown = [(k, text, "") if fv is None else (k, f"{fv:.2f}", f"{100.0 * fv / tot:.1f} %" if tot > 0 else "")
             for k, text, fv in rows]
    return {"rows": shown, "sum": f"{tot:.2f}"}


def _engine(d: ReportData) -> list[tuple[str, str]]:
    """The inference engine: what it is, its error against PyTorch, batch-1 latency, throughput by batch."""
    e = (d.summary or {}).get("engine")
    if not isinstance(e, dict) or not e:
        return []
    rows = [("backend", f"{e.get('backend', '–')} ({e.get('precision', '–')}), {e.get('cache', '–')}"),
            ("max abs error vs PyTorch", fmt_num(e.get("max_abs_err"), 3))]
    lat = e.get("latency_batch1_us")
    if isinstance(lat, dict):
        rows.append(("latency, batch 1", f"p50 {float(lat['p50']):.0f} µs, p99 {float(lat['p99']):.0f} µs "
                                          f"({e.get('clock') or 'timed'})"))
    for b, v in (e.get("throughput_by_batch") or {}).items():
        rows.append((f"throughput, batch {b}", f"{float(v):,.0f} beats/s"))
    return rows


def _other(d: ReportData) -> list[tuple[str, str]]:
    """The summary's other settings and values (dicts as k=v lists, long lists as their length)."""
    rows = []
    for k, v in (d.summary or {}).items():
        if k in _CONSUMED:
            continue
        if isinstance(v, dict):
            v = ", ".join(f"{kk}={fmt_num(vv)}" for kk, vv in v.items())
        elif isinstance(v, (list, tuple)) and len(v) > 8:
            v = f"[{len(v)} items]"
        rows.append((str(k), fmt_num(v)))
    return rows


def _top(d: ReportData, limit: int = 50) -> dict:
    """The table of the top anomalies: its header and rows (the label column where any has a label)."""
    top = list(d.top or [])[:limit]
    has_label = any(a.get("label") for a in top)
    has_class = any(a.get("class") for a in top)
    head = (["rank", "beat", "start (sample)", "time", "length", "length (ms)", "score"] + (["class"] if has_class else [])
            + (["label"] if has_label else []))
    fs = float(d.fs) if d.fs else 0.0
    rows = []
    for i, a in enumerate(top):
        length = a.get("length")
        start = a.get("start")
        time_s = a.get("time_s", (float(start) / fs) if (start is not None and fs) else None)
        cells = [
            str(i + 1),
            fmt_num(a.get("beat")),
            fmt_num(start),
            fmt_hms(time_s) if time_s is not None else "–",
            fmt_num(length),
            f"{1e3 * float(length) / fs:.0f}" if (length is not None and fs) else "–",
            fmt_num(a.get("score"), 4),
        ]
        if has_class:
            cells.append(str(a.get("class") or ""))
        if has_label:
            cells.append(str(a.get("label") or ""))
        rows.append(cells)
    return {"head": head, "rows": rows}


def _top_pictures(left: str, right: str | None) -> dict:
    """The top anomalies' figure from its two parts (``beatflow.report.figures._fig_top``), side by side at
    their shares of its width (percent, written to 4 decimals): one picture, at any page width."""
    if right is None:
        return {"left": left, "right": None}
    wl, wr = png_width(left), png_width(right)
    return {"left": left, "right": right, "left_share": f"{100 * wl / (wl + wr):.4f}",
            "right_share": f"{100 * wr / (wl + wr):.4f}"}


def _viewer_note(viewer: dict) -> str:
    """The viewer's raw windows in words: how many and how long in all."""
    import base64  # noqa: PLC0415

    n = len(base64.b64decode(viewer["raw"]["len"])) // 4
    seconds = len(base64.b64decode(viewer["raw"]["data"])) // 2 / float(viewer["fs"])
    return f"{n:,} window(s), {fmt_hms(seconds)} in all" if n else "none in this report"


def render_report_html(data: ReportData, figures: dict | None = None, viewer: dict | None = None) -> str:
    """Build the complete, self-contained HTML document as a string.

    ``figures``: PNGs already rendered (``beatflow.report.figures.render_figures``); the others are
    rendered here. ``viewer``: the stream viewer's data (:func:`beatflow.report.viewer.viewer_payload`), a
    section at the top of the page; none without it.
    """
    d = data
    done = dict(figures or {})

    def fig(name):
        return done[name] if name in done else FIGURES[name](d)

    fs = float(d.fs) if d.fs else 0.0
    dur_s = float(d.total_samples) / fs if fs else float("nan")
    top_left = fig("top")
    return _template().render(
        title=str(d.title),
        samples=fmt_num(int(d.total_samples)),
        fs=fmt_num(fs),
        duration=fmt_hms(dur_s),
        flagged=f"{int(np.asarray(d.anomaly_times_s).size):,}",
        threshold=fmt_num(float(d.threshold)),
        cards=_summary_cards(d),
        timings=_timings(d),
        engine=_engine(d),
        other=_other(d),
        recordings=_recordings(d),
        unreadable=_unreadable(d),
        figures={name: fig(name) for name in ("stream", "lengths", "aligned", "training", "scores", "latent",
                                              "latent_truth", "latent_class", "class_V", "class_S", "artifacts")},
        classes=_classes(d),
        top_pictures=None if top_left is None else _top_pictures(top_left, fig("top_right")),
        n_top=min(len(d.top or []), 12),
        top=_top(d),
        viewer=viewer,
        viewer_note=_viewer_note(viewer) if viewer else "",
    )


def write_report(path, data: ReportData, figures: dict | None = None, viewer: dict | None = None) -> None:
    """Render ``data`` (with the ``figures`` already rendered and the stream ``viewer``'s data, if any) and
    write one self-contained HTML file atomically."""
    path = os.fspath(path)
    doc = render_report_html(data, figures, viewer)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(doc)
    os.replace(tmp, path)

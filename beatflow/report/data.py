"""The run's reported data: ``summary.json``, the rhythm episodes' table and the report's fields
(:class:`beatflow.report.figures.ReportData`), built from the stages' small results.

Plain NumPy and pandas: the flow (:mod:`beatflow.pipeline.flow`) gathers the stages' results and
calls these; nothing here knows Prefect or Dask.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from beatflow.score.classes import class_summary

#: pixel columns of the whole-stream picture
N_COLUMNS = 4000
#: the report's top anomalies
N_TOP = 12
#: the unreadable stretches listed in the report (quality.csv has them all)
N_UNREADABLE = 20


def flutter_episodes(specs, per_partition, source, fs: float) -> pd.DataFrame:
    """The ventricular flutter/fibrillation episodes of every recording (partitions' ranges joined),
    as a table: recording, start_s, end_s, duration_s (rhythm_episodes.csv)."""
    from beatflow.detect.rhythm import merge_spans

    rows = []
    for rec in sorted({sp.recording for sp in specs}):
        spans = merge_spans([per_partition[k] for k, sp in enumerate(specs) if sp.recording == rec])
        for a, b in spans:
            rows.append((source.recordings[rec].name, a / fs, b / fs, (b - a) / fs))
    return pd.DataFrame(rows, columns=["recording", "start_s", "end_s", "duration_s"])


def unreadable_episodes(specs, per_partition, source, fs: float) -> pd.DataFrame:
    """The unreadable stretches of every recording (:mod:`beatflow.detect.quality`; ``per_partition``:
    each partition's ``(spans, reasons)``, ranges of one reason across partitions joined), as a table:
    recording, start_s, end_s, duration_s, reason (quality.csv)."""
    from beatflow.detect.quality import REASONS, merge_episodes

    rows = []
    for rec in sorted({sp.recording for sp in specs}):
        idx = [k for k, sp in enumerate(specs) if sp.recording == rec]
        spans, reasons = merge_episodes([per_partition[k][0] for k in idx], [per_partition[k][1] for k in idx])
        for (a, b), r in zip(spans, reasons):
            rows.append((source.recordings[rec].name, a / fs, b / fs, (b - a) / fs, REASONS[int(r)]))
    return pd.DataFrame(rows, columns=["recording", "start_s", "end_s", "duration_s", "reason"])


def quality_summary(unreadable: pd.DataFrame) -> dict:
    """``summary.json["quality"]``: the unreadable seconds and stretches in all, and the seconds by reason."""
    return {"unreadable_s": float(unreadable["duration_s"].sum()), "episodes": int(len(unreadable)),
            "by_reason_s": {str(r): float(v) for r, v in unreadable.groupby("reason")["duration_s"].sum().items()}}


def run_summary(source, fs, total, plan, pruned, trained, engine, flagged, threshold, device, workers, specs,
                truth, episodes, unreadable=None) -> dict:
    """``summary.json``'s fields that the stages' results decide (the flow adds the rest: per recording,
    second lead, workers, timings, transfers)."""
    prof = engine.get("profile") or {}
    out = {
        "input": source.path, "recordings": [r.name for r in source.recordings], "samples": int(total),
        "fs": fs, "hours": total / fs / 3600, "partitions": len(specs), "beats_detected": plan.n_detected,
        "beats_kept": plan.n_kept, "pruned_fraction": pruned, "train_loss": trained["train_loss"],
        "test_loss": trained["test_loss"], "train_seconds": trained["seconds"], "anomalies_flagged": flagged,
        "flutter_episodes": {"count": int(len(episodes)), "seconds": float(episodes["duration_s"].sum())},
        "quality": quality_summary(unreadable if unreadable is not None else unreadable_episodes([], [], source, fs)),
        "training": {"beats": int(trained.get("rows", 0)), "precision": trained.get("precision", "fp32"),
                     "compiled": trained.get("compiled", False),
                     "cuda_graphs": trained.get("cuda_graphs", False),
                     "graphs_kept": trained.get("graphs_kept", False), "kernel": trained.get("kernel", False),
                     "epoch_graph": trained.get("epoch_graph", False)},
        "threshold": threshold, "device": device, "workers": workers,
        "engine": {**{k: engine[k] for k in ("backend", "precision", "cache", "max_abs_err", "throughput_beats_per_s")},
                   "latency_batch1_us": prof.get("latency_batch1_us"),
                   "throughput_by_batch": {str(b): v for b, v in (prof.get("throughput_beats_per_s") or {}).items()},
                   "clock": prof.get("clock"), "profile_measured": prof.get("measured")},
    }
    if truth is not None:
        out["truth"] = dict(truth)
    return out


def per_recording(source, fs, n_samples: dict, recording, flagged, classes=None) -> list[dict]:
    """Per recording of the input: its name, hours (``n_samples``: its length as read), kept beats and
    flagged beats (``recording``: each kept beat's recording number; ``flagged``: whether it is flagged),
    and with ``classes`` (each kept beat's) the class counts, V and S burden and runs
    (:func:`beatflow.score.classes.class_summary`). (Counted on the numbers: the table's names as strings
    took 18 ms for 97 k beats.)"""
    n = len(source.recordings)
    recording = np.asarray(recording, np.int64)
    beats = np.bincount(recording, minlength=n)
    hits = np.bincount(recording[np.asarray(flagged, bool)], minlength=n)
    out = [{"recording": r.name, "hours": n_samples.get(k, 0) / fs / 3600.0, "beats": int(beats[k]),
            "flagged": int(hits[k])} for k, r in enumerate(source.recordings)]
    if classes is not None:
        classes = np.asarray(classes)
        for k, row in enumerate(out):
            c = class_summary(classes[recording == k])
            row.update(classes=c["counts"], v_burden_pct=c["v_burden_pct"], s_burden_pct=c["s_burden_pct"],
                       v_runs=c["v_runs"], s_runs=c["s_runs"])
    return out


def transfer_summary(stats: dict, total: int) -> dict:
    """``summary.json["transfers"]``: the workers' transfer counts and RMM pools (``stats``: per worker,
    :func:`beatflow.device.transfer_stats`) beside the stream's bytes (``total`` float32 samples)."""
    return {
        "d2h_bytes": int(sum(v.get("d2h_bytes", 0) for v in stats.values())),
        "stream_bytes": int(total * 4),
        "rmm_pool_bytes_per_worker": [v["rmm_pool_bytes"] for v in stats.values() if "rmm_pool_bytes" in v],
        "rmm_peak_bytes_per_worker": [v["rmm_peak_bytes"] for v in stats.values() if "rmm_peak_bytes" in v],
        "numba_memory_manager_per_worker": [v["numba_memory_manager"] for v in stats.values()
                                            if "numba_memory_manager" in v],
    }


def length_histogram(plan, s):
    """The report's histogram of beat lengths: (counts, edges), bins of 4 samples."""
    return np.histogram(plan.length, bins=np.arange(0, 3 * s.upper + 8, 4))


def truth_per_kept(matched, n_kept: int):
    """The truth label of every kept beat (:data:`TRUTH_NAMES`; an unmatched beat 0), or None
    without a truth (``matched``: :func:`beatflow.score.metrics.match_truth`'s result)."""
    if matched is None:
        return None
    m, labels = matched["matched"], matched["labels"]
    per_kept = np.zeros(n_kept, np.int64)
    per_kept[m[m >= 0]] = labels[m >= 0]
    return per_kept


def scored_view(fs, total, plan, trained, scores, mu, threshold, flagged, overview, per_kept, kb, rec_offset,
                names=(), classes=None) -> dict:
    """The report's fields that the scores decide (what the flow's ``LATE_FIGURES`` draw: the stream's
    picture with the flagged beats' times, every score, and a sample of at most 20 000 test beats' latent
    means with their scores and truth labels; ``overview``: the partitions' column minima and maxima,
    ``per_kept``: :func:`truth_per_kept`)."""
    from beatflow.report.envelope import combine_minmax

    smin, smax = combine_minmax(overview, N_COLUMNS)
    test_idx = np.asarray(trained["test_index"])
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(test_idx, size=min(20000, len(test_idx)), replace=False))
    truth_labels = per_kept[sub] if per_kept is not None else None
    fb = kb[np.asarray(flagged, bool)]  # the flagged beats, on the time axis of all recordings
    offsets = np.asarray([rec_offset[r] for r in range(len(rec_offset))], dtype=np.int64)
    times = (plan.start[fb].astype(np.int64) + offsets[plan.recording[fb]]) / fs
    return dict(fs=fs, total_samples=int(total), stream_min=smin, stream_max=smax, latent_mu=mu[sub],
                latent_score=scores[sub], threshold=threshold, score_all=scores, anomaly_times_s=times,
                truth_labels=truth_labels, recording_names=list(names),
                class_labels=None if classes is None else np.asarray(classes)[sub],
                recording_starts_s=(offsets / fs).tolist())


def top_list(names, fs, plan, rows, scores, ctx, kb, per_kept, classes=None) -> list[dict]:
    """The report's list of beats ``rows`` (kept rows, in order), each with the signal around it from its
    partition's snippets ``ctx`` (the one that starts ``fs`` samples before the beat, see
    :func:`missing_context`), its class (with ``classes``, each kept beat's) and, with a truth, its label."""
    out = []
    for i in np.asarray(rows, np.int64):
        b = int(kb[i])
        start = int(plan.start[b])
        length = int(plan.length[b])
        pieces = ctx[int(plan.owner[b])]
        pieces = [p for p in pieces if _covers(p, start, length)] or pieces
        piece = min(pieces, key=lambda p: abs(p[0] - (start - int(fs))))
        label = None
        if per_kept is not None:
            label = TRUTH_NAMES.get(int(per_kept[i]), str(int(per_kept[i])))
        out.append({"beat": b, "start": start, "time_s": start / fs, "length": int(plan.length[b]),
                    "score": float(np.float32(scores[i])), "context": piece[1], "context_start": int(piece[0]),
                    "class": str(classes[i]) if classes is not None else None,
                    "label": (f"{names[int(plan.recording[b])]} " if len(names) > 1 else "") + (label or "")})
    return out


#: the synthetic truth's labels (:data:`beatflow.io.synth.LABEL_NAMES`, as the report writes them)
TRUTH_NAMES = {0: "normal", 1: "pvc", 2: "artifact", 3: "apc"}
#: beats a class's panel shows
N_PER_CLASS = 8


def class_lists(scores, classes, flagged, n_top: int = N_TOP, n_class: int = N_PER_CLASS) -> dict:
    """The kept rows each of the report's beat lists shows, highest score first (ties in row order):

    * ``top``: the anomaly list, the ``n_top`` highest-scoring beats classed V or S (arrhythmia leads it;
      the highest-scoring beats of any class where no beat is V or S);
    * ``V``, ``S``: the ``n_class`` highest-scoring beats of each class;
    * ``artifacts``: the ``n_class`` highest-scoring flagged beats classed N: beats unlike the patient's
      that neither their shape nor their timing makes ectopic (noise, artifacts, aberrant beats), in a
      section of their own."""
    from beatflow.score.rule import rank_order

    order = rank_order(scores)
    c = np.asarray(classes)[order]
    f = np.asarray(flagged, bool)[order]
    ectopic = order[(c == "V") | (c == "S")]
    return {"top": ectopic[:n_top] if len(ectopic) else order[:n_top],
            "V": order[c == "V"][:n_class], "S": order[c == "S"][:n_class],
            "artifacts": order[(c == "N") & f][:n_class]}


def _covers(piece, start: int, length: int) -> bool:
    """Whether a snippet ``(first sample, samples)`` holds the beat ``[start, start + length)``."""
    return piece[0] <= start and piece[0] + len(piece[1]) >= start + length


def missing_context(plan, kb, rows, ctx, fs: float) -> dict:
    """For the kept ``rows`` whose signal the partitions' snippets ``ctx`` do not hold (a partition cuts its
    own top beats' by score, before the classes are known), the windows to cut, by owning partition:
    ``{partition: [(start - fs, start + length + fs), ...]}``."""
    pad = int(fs)
    need: dict = {}
    for i in np.unique(np.asarray(rows, np.int64)):
        b = int(kb[i])
        start, length, k = int(plan.start[b]), int(plan.length[b]), int(plan.owner[b])
        if not any(_covers(p, start, length) for p in ctx.get(k, ())):
            need.setdefault(k, []).append((start - pad, start + length + pad))
    return need

def unreadable_view(unreadable: pd.DataFrame | None, names, starts_s) -> dict:
    """The report's fields of the unreadable stretches: every stretch as ``(start_s, end_s)`` on the
    stream's time axis (``names``, ``starts_s``: the recordings and where each starts on it), the first
    :data:`N_UNREADABLE` rows of the table as dicts."""
    if unreadable is None or not len(unreadable):
        return {"unreadable_spans_s": [], "unreadable_rows": []}
    at = {str(n): float(a) for n, a in zip(names, starts_s)}
    off = unreadable["recording"].astype(str).map(lambda n: at.get(n, 0.0)).to_numpy(np.float64)
    spans = np.stack([unreadable["start_s"].to_numpy(np.float64) + off,
                      unreadable["end_s"].to_numpy(np.float64) + off], axis=1)
    return {"unreadable_spans_s": spans.tolist(),
            "unreadable_rows": unreadable.head(N_UNREADABLE).to_dict("records")}


def report_data(source, s, plan, trained, top, summary, truth, view: dict):
    """The report's :class:`~beatflow.report.figures.ReportData`: ``view`` (:func:`scored_view`, with
    :func:`unreadable_view`), the beat lengths' histogram (``s``: the segmentation's samples), the
    training's rows and losses, the ``top`` anomalies (:func:`top_list`) and the ``summary``."""
    from beatflow.report.figures import ReportData

    counts, edges = length_histogram(plan, s)
    return ReportData(
        title=f"beatflow: {Path(source.path).name if truth is None else 'synthetic ECG'}", summary=summary,
        length_hist_counts=counts, length_hist_edges=edges, length_bounds=(s.lower, s.upper),
        aligned_beats=trained["sample_rows"], train_loss=trained["train_loss"], test_loss=trained["test_loss"],
        top=top, **view)


def top_table_rows(top: pd.DataFrame) -> list[dict]:
    """The top anomalies (rows of the anomaly table) as the rows of a UI table: plain values, floats rounded."""
    return [{k: (round(float(v), 4) if isinstance(v, float) else (v if isinstance(v, (int, str, bool)) else str(v)))
             for k, v in r.items()} for r in top[[c for c in ("rank", "beat", "recording", "start", "time_s", "length",
                                                             "score", "class") if c in top]]
            .astype({c: str for c in ("recording", "class") if c in top}).to_dict("records")]


def summary_markdown(summary: dict) -> str:
    """The run's summary as a markdown table (the Prefect UI's summary artifact)."""
    lines = ["# beatflow run", "", "| | |", "|---|---|"]
    for k in ("samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "test_loss",
              "anomalies_flagged", "device", "workers"):
        v = summary[k]
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    cl = summary.get("classes")
    if cl:  # the beat classes (beatflow.score.classes)
        lines.append("| classes | " + ", ".join(f"{k} {v:,}" for k, v in cl["counts"].items() if v or k in "NSV") + " |")
        lines.append(f"| V burden | {cl['v_burden_pct']:.2f} % ({cl['v_runs']['couplets']} couplets, "
                     f"{cl['v_runs']['runs']} runs) |")
        lines.append(f"| S burden | {cl['s_burden_pct']:.2f} % ({cl['s_runs']['couplets']} couplets, "
                     f"{cl['s_runs']['runs']} runs) |")
    e = summary["engine"]
    lines.append(f"| engine | {e['backend']} ({e['precision']}), max abs err {e['max_abs_err']:.2e} |")
    vf = summary.get("flutter_episodes") or {}
    if vf.get("count"):
        lines.append(f"| ventricular flutter/fibrillation | {vf['count']} episode(s), {vf['seconds']:.1f} s "
                     "(rhythm_episodes.csv) |")
    qu = summary.get("quality") or {}
    if qu.get("episodes"):
        lines.append(f"| unreadable | {qu['episodes']} stretch(es), {qu['unreadable_s']:.1f} s (quality.csv) |")
    if "truth" in summary:
        t = summary["truth"]
        lines.append(f"| truth | Se {t['se']:.4f}, PPV {t['ppv']:.4f}, ROC-AUC {t['auc']:.4f} |")
    lines.append(f"| total time | {summary['timings_s']['total']:.1f} s |")
    return "\n".join(lines)

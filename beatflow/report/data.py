"""The run's reported data: ``summary.json``, the rhythm episodes' table and the report's fields
(:class:`beatflow.report.figures.ReportData`), built from the stages' small results.

Plain NumPy and pandas: the flow (:mod:`beatflow.pipeline.flow`) gathers the stages' results and
calls these; nothing here knows Prefect or Dask.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

#: pixel columns of the whole-stream picture
N_COLUMNS = 4000
#: the report's top anomalies
N_TOP = 12


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


def run_summary(source, fs, total, plan, pruned, trained, engine, flagged, threshold, device, workers, specs,
                truth, episodes) -> dict:
    """``summary.json``'s fields that the stages' results decide (the flow adds the rest: per recording,
    second lead, workers, timings, transfers)."""
    prof = engine.get("profile") or {}
    out = {
        "input": source.path, "recordings": [r.name for r in source.recordings], "samples": int(total),
        "fs": fs, "hours": total / fs / 3600, "partitions": len(specs), "beats_detected": plan.n_detected,
        "beats_kept": plan.n_kept, "pruned_fraction": pruned, "train_loss": trained["train_loss"],
        "test_loss": trained["test_loss"], "train_seconds": trained["seconds"], "anomalies_flagged": flagged,
        "flutter_episodes": {"count": int(len(episodes)), "seconds": float(episodes["duration_s"].sum())},
        "training": {"precision": trained.get("precision", "fp32"), "compiled": trained.get("compiled", False),
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


def per_recording(source, fs, n_samples: dict, recording, flagged) -> list[dict]:
    """Per recording of the input: its name, hours (``n_samples``: its length as read), kept beats and
    flagged beats (``recording``: each kept beat's recording number; ``flagged``: whether it is flagged).
    (Counted on the numbers: the table's names as strings took 18 ms for 97 k beats.)"""
    n = len(source.recordings)
    recording = np.asarray(recording, np.int64)
    beats = np.bincount(recording, minlength=n)
    hits = np.bincount(recording[np.asarray(flagged, bool)], minlength=n)
    return [{"recording": r.name, "hours": n_samples.get(k, 0) / fs / 3600.0, "beats": int(beats[k]),
             "flagged": int(hits[k])} for k, r in enumerate(source.recordings)]


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
    """The truth label of every kept beat (0 normal, 1 PVC, 2 artifact, 3 APC; an unmatched beat 0), or None
    without a truth (``matched``: :func:`beatflow.score.metrics.match_truth`'s result)."""
    if matched is None:
        return None
    m, labels = matched["matched"], matched["labels"]
    per_kept = np.zeros(n_kept, np.int64)
    per_kept[m[m >= 0]] = labels[m >= 0]
    return per_kept


def scored_view(fs, total, plan, trained, scores, mu, threshold, flagged, overview, per_kept, kb, rec_offset,
                names=()) -> dict:
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
                recording_starts_s=(offsets / fs).tolist())


def top_list(names, fs, plan, rows, scores, ctx, kb, per_kept) -> list[dict]:
    """The report's top anomalies: kept rows ``rows`` (the highest ``scores`` first), each with the signal
    around it from its partition's snippets ``ctx`` (the partition's own top beats': the one that starts
    ``fs`` samples before the beat) and, with a truth, its label."""
    out = []
    for i in np.asarray(rows, np.int64):
        b = int(kb[i])
        start = int(plan.start[b])
        pieces = ctx[int(plan.owner[b])]
        piece = min(pieces, key=lambda p: abs(p[0] - (start - int(fs))))
        label = None
        if per_kept is not None:
            label = {0: "normal", 1: "pvc", 2: "artifact"}[int(per_kept[i])]
        out.append({"beat": b, "start": start, "time_s": start / fs, "length": int(plan.length[b]),
                    "score": float(np.float32(scores[i])), "context": piece[1], "context_start": int(piece[0]),
                    "label": (f"{names[int(plan.recording[b])]} " if len(names) > 1 else "") + (label or "")})
    return out


def report_data(source, s, plan, trained, top, summary, truth, view: dict):
    """The report's :class:`~beatflow.report.figures.ReportData`: ``view`` (:func:`scored_view`), the beat
    lengths' histogram (``s``: the segmentation's samples), the training's rows and losses, the ``top``
    anomalies (:func:`top_list`) and the ``summary``."""
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
             for k, v in r.items()} for r in top[["rank", "beat", "recording", "start", "time_s", "length", "score"]]
            .astype({"recording": str}).to_dict("records")]


def summary_markdown(summary: dict) -> str:
    """The run's summary as a markdown table (the Prefect UI's summary artifact)."""
    lines = ["# beatflow run", "", "| | |", "|---|---|"]
    for k in ("samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "test_loss",
              "anomalies_flagged", "device", "workers"):
        v = summary[k]
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    e = summary["engine"]
    lines.append(f"| engine | {e['backend']} ({e['precision']}), max abs err {e['max_abs_err']:.2e} |")
    vf = summary.get("flutter_episodes") or {}
    if vf.get("count"):
        lines.append(f"| ventricular flutter/fibrillation | {vf['count']} episode(s), {vf['seconds']:.1f} s "
                     "(rhythm_episodes.csv) |")
    if "truth" in summary:
        t = summary["truth"]
        lines.append(f"| truth | Se {t['se']:.4f}, PPV {t['ppv']:.4f}, ROC-AUC {t['auc']:.4f} |")
    lines.append(f"| total time | {summary['timings_s']['total']:.1f} s |")
    return "\n".join(lines)

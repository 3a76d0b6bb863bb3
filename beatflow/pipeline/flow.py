"""The end-to-end flow: load → segment → embed → train → engine → score → report.

Each stage is a Prefect task; the partitions' work of a stage is mapped over the Dask workers
(``beatflow.pipeline.stages``) and each partition's arrays stay in its worker (futures). The flow itself only
sees small results and writes the outputs, into a temporary folder renamed at the end, so a failed
run leaves no partial output (:mod:`beatflow.pipeline.outputs`).

The flow builds its options once (:class:`~beatflow.pipeline.options.RunOptions`); each stage is a function
here (:func:`_load`, :func:`_segment`, :func:`_embed`, :func:`_train`, :func:`_build_engine`, :func:`_score`,
:func:`_report`) that hands its small results to the next; what the outputs say (``summary.json``, the
report's data) is built by :mod:`beatflow.report.data`.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from prefect import flow, get_run_logger

from beatflow.detect.leads import SecondLeadParams
from beatflow.device import transfer_stats
from beatflow.embed.partitions import (BeatPlan, assemble_halos, peaks_by_recording, plan_beats,
                                       second_lead_gathered)
from beatflow.errors import InputError
from beatflow.io.sources import Source, open_second_lead, open_source
from beatflow.model.sample import training_sample
from beatflow.params import (DEFAULT_FS, TRAIN_BEATS, TRAIN_FRACTION, QualityParams, QualitySamples, SegmentParams,
                             SegmentSamples, compile_pays)
from beatflow.pipeline import stages as T
from beatflow.pipeline.caching import cached, code_version, input_digest, token
from beatflow.pipeline.cluster import peak_rss_bytes, prepare_cluster, run_on_workers
from beatflow.pipeline.options import RunOptions
from beatflow.pipeline.outputs import default_out_dir, run_folder, write_in_background
from beatflow.report import data as R
from beatflow.report.data import N_COLUMNS, N_TOP
from beatflow.report.viewer import beat_marks, finest_columns, raw_windows
from beatflow.report.figures import EARLY_FIGURES, FIGURES
from beatflow.report.pool import FigurePool, figure_pool
from beatflow.score.classes import class_summary, classify
from beatflow.score.metrics import match_truth, truth_check, truth_classes, truth_quality
from beatflow.score.rule import MODEL_INPUT, anomaly_table, robust_threshold, write_anomaly_table
from beatflow.terminal import front_sigterm

#: the report's figures drawn as soon as the scores are known (``beatflow.report.figures.FIGURES``)
LATE_FIGURES = ("stream", "scores", "latent", "latent_truth")


class _Stopwatch:
    """Seconds between named laps (``timings_s`` over the stages, rounded to ``digits``; inside one
    stage, ``timings_detail_s``: where its time goes)."""

    def __init__(self, digits: int = 3):
        self.t0 = self.last = time.perf_counter()
        self.digits = digits
        self.times: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self.last, self.digits)
        self.last = now

    def total(self) -> dict:
        return {**self.times, "total": round(time.perf_counter() - self.t0, self.digits)}


@flow(name="beatflow", log_prints=True)
def ecg_anomaly_flow(input: str | None = None, column: str | None = None, fs: float | None = None,
                     lead: int | str = 0, confirm_lead: int | str | None = None, confirm_column: str | None = None,
                     hours: float = 20.0, seed: int = 0, out: str | None = None,
                     device: str = "cpu", workers: int | None = 2, partitions: int | None = None,
                     epochs: int = 10, batch_size: int = 1024, train_beats: int | None = TRAIN_BEATS,
                     store: str | None = None,
                     cache: str | None = None, engine_backend: str = "auto", precision: str = "fp32",
                     train_precision: str = "auto", train_compile: bool | None = None,
                     rmm_pool_size: str | float | None = None, rmm_allocator: str = "async",
                     service: bool = False) -> dict:
    """Find abnormal heartbeats in a long ECG and write ``summary.json``, ``anomalies.parquet``,
    ``report.html``, the model and the engine to ``out``.

    Parameters
    ----------
    input : str, optional
        CSV / Parquet / ``.npy`` / EDF / BDF file or a WFDB or EDF folder; synthetic ECG (``hours`` long)
        when omitted.
    column, fs, lead : optional
        Column of a CSV/Parquet file, its sampling rate (default 250 Hz), WFDB or EDF channel (an index
        or a label).
    confirm_lead, confirm_column : optional
        A second lead of the input (WFDB or EDF channel, or CSV/Parquet column) that checks the first one's
        beats (:mod:`beatflow.detect.leads`: flutter seen on either lead, weak peaks with no QRS on the second
        lead are dropped, a noise peak beside a QRS seen on the second lead is moved to it); default:
        one lead.
    hours, seed : float, int
        Length and seed of the synthetic ECG (the seed also fixes the train/test split).
    out : str, optional
        Output folder (default ``runs/<timestamp>``); must not exist yet.
    device : {"cpu", "gpu"}
        Resolved device the task runner was built for.
    workers, partitions : int
        Dask workers (``None``: as many as the cluster has) and partitions of the stream (default 2
        per worker).
    epochs, batch_size : int
        VAE training.
    train_beats : int, optional
        Train on at most this many beats, stratified by recording and over time
        (:func:`beatflow.model.sample.training_sample`); every beat is scored. None or 0: all.
    store : str, optional
        A results store (``beatflow.io.store``): the trained model is registered there as the latest,
        for the scheduled ``score-new-recordings`` flow.
    cache : str, optional
        A cache folder: segmentation and training results are keyed by the input's content hash,
        the parameters and the code version, persisted there and reused by later runs (a run
        killed during training resumes after its last finished task).
    engine_backend, precision : str
        Inference engine (``auto|onnxruntime|compiled|aoti|tensorrt``) and its precision (``fp32``, ``fp16``,
        ``bf16`` on GPU, ``int8`` on CPU); engines are cached by model hash and configuration.
    train_precision, train_compile : str, bool
        VAE training on a GPU (``auto`` and ``fp32``: the step kernel of :mod:`beatflow.model.step_kernel` in
        fp32 where Numba's CUDA target runs, else bf16 where supported and fp16 with a gradient scaler
        otherwise; ``bf16``/``fp16``: compiled steps in mixed precision), and compiled training steps
        (default: on a GPU, and on the CPU for trainings large enough to pay for the compilation:
        :func:`beatflow.params.compile_pays`).
    rmm_pool_size, rmm_allocator : optional
        On the GPU, the RMM pool that a worker without one gets (default 80 % of its GPU) and its
        kind (``async`` or ``pool``): every GPU worker, on the flow's own cluster or on one given by
        ``--scheduler``, is set up by :class:`beatflow.pipeline.cluster.GPUMemorySetup`.
    service : bool
        The task runner is the cluster of ``beatflow serve`` (:mod:`beatflow.pipeline.service`):
        ``summary.json: service``.
    """
    front_sigterm()  # (a command's SIGTERM before Prefect's handler: beatflow.terminal)
    opts = RunOptions(input=input, column=column, fs=fs, lead=lead, confirm_lead=confirm_lead,
                      confirm_column=confirm_column, hours=hours, seed=seed, out=out, device=device, workers=workers,
                      partitions=partitions, epochs=epochs, batch_size=batch_size, train_beats=train_beats,
                      store=store, cache=cache,
                      engine_backend=engine_backend, precision=precision, train_precision=train_precision,
                      train_compile=train_compile, rmm_pool_size=rmm_pool_size, rmm_allocator=rmm_allocator,
                      service=service)
    log = get_run_logger()
    sw = _Stopwatch()
    final = Path(opts.out) if opts.out else default_out_dir()
    with run_folder(final, log) as work:  # (renamed to `final` at the end; removed if the run fails)
        summary = _run_stages(_Run(opts, log, sw, work, figure_pool()))
        if opts.store:
            from beatflow.io.store import Store

            meta = json.loads((work / "model.json").read_text())
            summary["model_id"] = Store(opts.store).register_model(work / "model.pt", meta)
            log.info("model registered in %s as %s", opts.store, summary["model_id"])
    log.info("outputs in %s", final)
    summary["out"] = str(final)
    _publish_report_link(final / "report.html")
    return summary


# --- the stages of one run, each handing its small results to the next ---

@dataclass
class _Run:
    """What the stages of one run share: its options, log, clocks, work folder and figure processes."""

    opts: RunOptions
    log: Any
    sw: _Stopwatch
    work: Path
    figures: FigurePool
    threads: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    workers: int = 1  # the cluster's workers (:func:`beatflow.pipeline.cluster.prepare_cluster`)
    gpu_workers: dict = field(default_factory=dict)  # each GPU worker's memory state
    run_id: Any = None  # the Prefect flow run's id (the workers count their transfers per run)
    detail: dict = field(default_factory=dict)  # summary.json's timings_detail_s
    drawn: dict = field(default_factory=dict)  # the report's figures started (futures), in order


@dataclass
class _Loaded:
    """The load stage's result: the input and its partitions (futures, on the workers) with their halos."""

    source: Source
    second: Source | None  # the second lead's source (``confirm_lead``/``confirm_column``)
    fs: float
    s: SegmentSamples
    q: Any  # the second lead's rules in samples (None with one lead)
    quality: QualitySamples  # the signal quality's rule (beatflow.detect.quality)
    specs: list
    parts: list
    lengths: list
    lefts: list
    rights: list
    firsts: list
    second_parts: tuple | None  # the second lead's (parts, lefts, rights)
    n_samples: dict  # samples per recording
    total: int
    rec_offset: dict  # each recording's first sample on the stream's time axis
    overview: list  # futures of the partitions' columns of the whole-stream picture
    truth_path: str | None  # the synthetic ECG's truth
    base_token: str | None  # the cache key of the input and its reading
    levels: list | None = None  # futures of the partitions' columns of the stream viewer's finest level


@dataclass
class _Segmented:
    """The segmentation stage's result: the beats of every recording."""

    peaks: list
    plan: BeatPlan
    kb: np.ndarray  # beat numbers of the kept beats, in the order of the rows
    pruned: float
    episodes: Any  # the flutter episodes' table (rhythm_episodes.csv)
    second_lead: dict | None  # what the second lead changed (summary.json)
    unreadable: Any  # the unreadable stretches' table (quality.csv)


@dataclass
class _Scored:
    """The scoring stage's result: the scores, the table and the report's fields that they decide."""

    threshold: float
    flagged_mask: np.ndarray
    flagged: int
    top_list: list
    view: dict
    top: Any  # the anomaly table's top rows (the UI's artifact)
    truth: dict | None
    score_workers: int
    written: Any  # the anomaly table's background write (a future)
    classes: np.ndarray  # each kept beat's class (beatflow.score.classes)
    beat_lists: dict  # the report's classes' panels (class_V, class_S, artifacts)


def _run_stages(run: _Run) -> dict:
    """The stages, one after the other: ``summary.json``'s content (the outputs are in ``run.work``)."""
    run.workers, run.gpu_workers = prepare_cluster(run.opts.device, run.opts.workers, run.opts.rmm_pool_size,
                                                   run.opts.rmm_allocator)
    loaded = _load(run)
    seg = _segment(run, loaded)
    embedded = _embed(run, loaded, seg)
    trained, matching = _train(run, loaded, seg, embedded)
    engine = _build_engine(run, trained)
    scored = _score(run, loaded, seg, embedded, trained, engine, matching)
    return _report(run, loaded, seg, trained, engine, scored)


def _load(run: _Run) -> _Loaded:
    """The input (the synthetic ECG made first where none is given) read onto the workers, each
    partition on one, where it stays; the small halos exchanged; the whole-stream picture started."""
    o, log = run.opts, run.log
    input, truth_path = o.input, None
    if input is None:
        # in the flow's process (a copy from the cache of generated recordings on a warm run): as a
        # task on a worker it cost the round trips of a remote Prefect task run too
        input, truth_path = T.synthesize(o.hours, o.fs or DEFAULT_FS, o.seed, str(run.work))
        run.sw.lap("synthesize")
    source = open_source(input, column=o.column, fs=o.fs, lead=o.lead)
    second = open_second_lead(source, input, o.fs, lead=o.lead, column=o.column, confirm_lead=o.confirm_lead,
                              confirm_column=o.confirm_column)
    fs = source.fs
    s = SegmentParams().samples(fs)
    if o.device == "gpu":  # the engine's imports and first compile, beside the stages before it
        T.start_engine_warmup(s.width)
    q = SecondLeadParams().samples(fs) if second is not None else None
    quality = QualityParams().samples(fs)
    if quality.halo > s.halo:  # (the quality windows' decisions must fit in the detection's halo)
        raise ValueError(f"the quality rule needs a halo of {quality.halo} samples, the detection's is {s.halo}")
    base_token = None
    if o.cache:
        digest = (token("synthetic", o.hours, fs, o.seed, code_version()) if truth_path
                  else input_digest(input))
        base_token = token(digest, o.column, fs, o.lead, s, quality, code_version(),
                           *((o.confirm, q) if second is not None else ()))
        log.info("cache: %s (input %s)", o.cache, digest[:12])
    specs = source.plan(o.partitions or 2 * max(1, run.workers))
    log.info("%s: %d recording(s), %d partitions, fs %g Hz", source.path, len(source.recordings), len(specs), fs)

    from prefect.runtime import flow_run

    run.run_id = flow_run.id
    parts, edges, load_detail = T.load(source, specs, o.device, s.halo, run.run_id)
    lengths = [e[0] for e in edges]
    n_samples = {}
    for sp, n in zip(specs, lengths):
        n_samples[sp.recording] = n_samples.get(sp.recording, 0) + n
    total = sum(lengths)
    if total < 2 * s.upper + s.kernel:
        raise InputError(f"{source.path}: {total} samples is too short for a beat "
                         f"(need at least {2 * s.upper + s.kernel} at {fs:g} Hz)")
    lefts, rights, firsts = assemble_halos(specs, lengths, [e[1] for e in edges], [e[2] for e in edges], s.halo)
    second_parts = None
    if second is not None:  # the second lead's partitions, on the first's workers, with the same halos
        parts2, edges2, load_detail2 = T.load(second, specs, o.device, s.halo, run.run_id, beside=parts)
        load_detail = {"first_lead": load_detail, "second_lead": load_detail2}
        if [e[0] for e in edges2] != lengths:
            raise InputError(f"{source.path}: the second lead's partitions differ in length from the first's")
        second_parts = (parts2, *assemble_halos(specs, lengths, [e[1] for e in edges2], [e[2] for e in edges2],
                                                s.halo)[:2])
    run.detail["load"] = load_detail
    rec_offset, acc = {}, 0
    for r in range(len(source.recordings)):
        rec_offset[r] = acc
        acc += n_samples.get(r, 0)
    # the whole-stream picture (per pixel column) is computed while the rest goes on
    at = [rec_offset[sp.recording] + firsts[k] for k, sp in enumerate(specs)]
    overview = T.map_partitions(T.stream_overview, parts, at, name="stream-overview", total=total, ncols=N_COLUMNS)
    # and the finest level of the report's stream viewer (beatflow.report.viewer), by the same reduction
    levels = T.map_partitions(T.stream_overview, parts, at, name="viewer-levels", total=total,
                              ncols=finest_columns(total))
    run.sw.lap("load")
    return _Loaded(source, second, fs, s, q, quality, specs, parts, lengths, lefts, rights, firsts, second_parts,
                   n_samples, total, rec_offset, overview, truth_path, base_token, levels)


def _segment(run: _Run, ld: _Loaded) -> _Segmented:
    """The peaks of every partition (checked by the second lead where there is one), the beats they make
    and the flutter episodes (``rhythm_episodes.csv``); the beat lengths' figure started."""
    o, log, s, specs = run.opts, run.log, ld.s, ld.specs
    seg_token = (token(ld.base_token, "segment", [(sp.recording, ld.firsts[k], ld.lengths[k])
                                                  for k, sp in enumerate(specs)]) if o.cache else None)
    n_totals = [ld.n_samples[sp.recording] for sp in specs]
    segmented = cached(T.segment, o.cache)(ld.parts, ld.lefts, ld.rights, ld.firsts, s, cache_token=seg_token,
                                           second=ld.second_parts, n_totals=n_totals, q=ld.q, quality=ld.quality)
    peaks = [r[0] for r in segmented]
    second_lead = None
    if ld.second is not None:  # rules 2 and 3 compare each peak with its neighbours: over the gathered peaks
        peaks, dropped, moved = second_lead_gathered(specs, peaks, [r[2] for r in segmented], ld.q, s)
        second_lead = {"lead": o.confirm_lead, "column": o.confirm_column, "params": SecondLeadParams().to_dict(),
                       "doubtful_peaks_dropped": dropped, "peaks_moved": moved}
        log.info("second lead %s: %d doubtful peak(s) dropped (no QRS on the second lead), %d moved to the "
                 "second lead's QRS", o.confirm_lead if o.confirm_lead is not None else o.confirm_column, dropped,
                 moved)
    plan = plan_beats(specs, ld.firsts, ld.n_samples, peaks, s)
    episodes = R.flutter_episodes(specs, [r[1] for r in segmented], ld.source, ld.fs)
    episodes.to_csv(run.work / "rhythm_episodes.csv", index=False)
    if len(episodes):
        log.warning("ventricular flutter/fibrillation: %d episode(s), %.1f s in all (rhythm_episodes.csv); "
                    "their waves are not counted as beats", len(episodes), float(episodes["duration_s"].sum()))
    unreadable = R.unreadable_episodes(specs, [r[-1] for r in segmented], ld.source, ld.fs)
    unreadable.to_csv(run.work / "quality.csv", index=False)
    if len(unreadable):
        log.warning("signal quality: %d unreadable stretch(es), %.1f s in all (%s; quality.csv); no beats are "
                    "detected there", len(unreadable), float(unreadable["duration_s"].sum()),
                    ", ".join(f"{r} {v:.1f} s" for r, v in R.quality_summary(unreadable)["by_reason_s"].items()))
    if plan.n_detected == 0:
        total_s = ld.total / ld.fs
        bad_s = float(unreadable["duration_s"].sum())
        if bad_s >= total_s - 1e-9:
            why = ", ".join(sorted(set(unreadable["reason"])))
            raise InputError(f"{ld.source.path}: no ECG found: the whole recording is unreadable ({why})")
        raise InputError(f"{ld.source.path}: no heartbeats found (flat line or no QRS-like peaks"
                         + (f"; {bad_s:.0f} of {total_s:.0f} s unreadable" if bad_s > 0 else "") + ")")
    if plan.n_kept < 64:
        raise InputError(f"{ld.source.path}: only {plan.n_kept} beats of plausible length "
                         f"(at least {s.lower} samples): too few to learn from")
    pruned = 1.0 - plan.n_kept / plan.n_detected
    kb = np.flatnonzero(plan.kept)  # beat numbers of kept beats, in the same order as the rows
    log.info("segmentation: %d beats detected, %d kept, removed %.2f percent of the candidates",
             plan.n_detected, plan.n_kept, 100 * pruned)
    # the beat lengths' figure needs nothing more: drawn now, so that its process is free by the time
    # the figures of the trained model and of the scores come (nine figures, up to eight processes)
    counts, edges = R.length_histogram(plan, s)
    run.drawn.update(run.figures.draw(SimpleNamespace(fs=ld.fs, length_hist_counts=counts, length_hist_edges=edges,
                                                      length_bounds=(s.lower, s.upper)), ("lengths",)))
    run.sw.lap("segment")
    return _Segmented(peaks, plan, kb, pruned, episodes, second_lead, unreadable)


def _embed(run: _Run, ld: _Loaded, seg: _Segmented) -> list:
    """Pruning / embedding: each partition's kept beats become rows, on the partition's worker (futures)."""
    kept = [seg.plan.kept_of(k) for k in range(len(ld.specs))]
    embedded = T.embed(ld.parts, ld.lefts, ld.rights, ld.firsts, [k[0] for k in kept], [k[1] for k in kept], ld.s)
    run.sw.lap("embed")
    return embedded


def _train(run: _Run, ld: _Loaded, seg: _Segmented, embedded: list) -> tuple[dict, Any]:
    """Training, once, on the home worker, on the gathered rows (from the cache where it ran before); the
    report's early figures started. Returns the training's result and, for the synthetic ECG, the job
    matching its truth to the beats (a future of the figure processes)."""
    o, plan = run.opts, seg.plan
    train_token = (token(ld.base_token, "train", plan.start[plan.kept].tobytes(), plan.length[plan.kept].tobytes(),
                         o.epochs, o.batch_size, o.seed, MODEL_INPUT, o.train_precision, o.train_beats)
                   if o.cache else None)
    model_folder = str(Path(o.cache).resolve() / "models" / train_token) if o.cache else str(run.work)
    # the training sample: at most train_beats rows, stratified by recording and over time, each partition's
    # share cut on its worker (only the sample travels to the home worker); every beat is scored
    counts = [int((plan.kept & (plan.owner == k)).sum()) for k in range(len(ld.specs))]
    pick = training_sample([sum(c for c, sp in zip(counts, ld.specs) if sp.recording == r)
                            for r in sorted({sp.recording for sp in ld.specs})], o.train_beats or None)
    sampled = len(pick) < plan.n_kept
    if sampled:
        bounds = np.cumsum([0] + counts)
        picks = [pick[(pick >= a) & (pick < b)] - a for a, b in zip(bounds[:-1], bounds[1:])]
        embedded = T.sample_rows(embedded, picks)
        run.log.info("training on %d of %d beats (stratified by recording and over time; --train-beats)",
                     len(pick), plan.n_kept)
    compile_steps = (compile_pays(o.device, int(len(pick) * TRAIN_FRACTION), o.epochs) if o.train_compile is None
                     else bool(o.train_compile))
    # while the cluster trains, the matching of the beats to the synthetic truth (the part of its
    # check that needs no scores) runs in an idle figure process, not in a thread of this one, whose
    # GIL the stages need (on the H200 a thread here made the embedding stage 4x slower); only light
    # modules there: a job that made a process import Prefect cost seconds
    matching = None
    if ld.truth_path:
        matching = run.figures.submit(match_truth, ld.truth_path, np.concatenate(seg.peaks), plan.peak[seg.kb], ld.fs)
    t_submit = time.time()
    # on the home worker, the same every run: its compiled steps and graphs stay warm
    trained = cached(T.train_model, o.cache)(embedded, model_folder, o.epochs, o.batch_size, o.seed, run.threads,
                                             [sp.recording for sp in ld.specs], train_precision=o.train_precision,
                                             compile=compile_steps, cache_token=train_token,
                                             beat_window=(ld.fs, ld.s.pre))
    over = _task_overhead(t_submit, trained)  # (empty for a result from the cache: its phases are an earlier run's)
    queued = ({"epoch_gpu_ms": trained["epoch_gpu_ms"], "queue_s": trained.get("queue_s")}
              if trained.get("epoch_gpu_ms") else {})  # (the GPU's queued epochs: where their time went)
    run.detail["train"] = {**over, **(trained.get("phases_s") or {}), **queued} if over else {}
    if o.cache:  # the cached model lives in the cache; the run's outputs get a copy
        for name in ("model.pt", "model.json", "validation_beats.npy"):
            shutil.copy(Path(model_folder) / name, run.work / name)
        trained = {**trained, "model": str(run.work / "model.pt"), "validation": str(run.work / "validation_beats.npy")}
    if sampled:  # (the held-out rows as kept beats' numbers: the report's latent figure draws them)
        trained = {**trained, "test_index": pick[np.asarray(trained["test_index"], np.int64)],
                   "beats_sampled": int(len(pick))}
    run.log.info("training: train loss %s, test loss %.5f", ", ".join(f"{v:.4f}" for v in trained["train_loss"]),
                 trained["test_loss"])
    run.sw.lap("train")
    # the report's early figures but the beat lengths' (drawn after segmentation) need nothing more: drawn
    # now, in the figure processes, while the workers build the engine and score
    early = SimpleNamespace(fs=ld.fs, aligned_beats=np.asarray(trained["sample_rows"]),
                            train_loss=trained["train_loss"], test_loss=trained["test_loss"])
    run.drawn.update(run.figures.draw(early, [name for name in EARLY_FIGURES if name != "lengths"]))
    return trained, matching


def _build_engine(run: _Run, trained: dict) -> dict:
    """The validated inference engine (on the home worker); the run keeps a copy."""
    o = run.opts
    t_submit = time.time()
    engine = T.build_engine(trained["model"], trained["validation"], run.threads, o.device, o.engine_backend,
                            o.precision)
    run.detail["engine"] = {**_task_overhead(t_submit, engine), **(engine.get("phases_s") or {})}
    shutil.copy(engine["path"], run.work / ("engine" + Path(engine["path"]).suffix))  # the run keeps its engine
    run.sw.lap("engine")
    return engine


def _score(run: _Run, ld: _Loaded, seg: _Segmented, embedded: list, trained: dict, engine: dict,
           matching) -> _Scored:
    """Scoring, back out on the partitions' workers; the threshold, the anomaly table (written in the
    background), the truth's check, and the report's figures that the scores decide started."""
    log, figures, plan, kb, fs = run.log, run.figures, seg.plan, seg.kb, ld.fs
    ph = _Stopwatch(4)
    dominant = np.asarray(trained["dominant"], np.float32)
    # (each partition also cuts the signal around its own top beats: those of the report's top anomalies are among them)
    bounds = [plan.kept & (plan.owner == k) for k in range(len(ld.specs))]
    context = (ld.parts, ld.lefts, ld.rights, ld.firsts, [plan.start[m] for m in bounds],
               [plan.length[m] for m in bounds])
    templates = np.asarray(trained["templates"], np.float32)
    scored, score_workers = T.score(embedded, engine["path"], trained["scale"],
                                    [dominant[sp.recording] for sp in ld.specs], at=ld.parts, context=context,
                                    top=N_TOP, pad=int(fs), templates=[templates[sp.recording] for sp in ld.specs],
                                    beat_window=(fs, ld.s.pre))
    scores = np.concatenate([sc[0] for sc in scored]) if scored else np.zeros(0, np.float32)
    mu = np.concatenate([sc[1] for sc in scored]) if scored else np.zeros((0, 2), np.float32)
    deviation = [sc[2] for sc in scored] if scored else np.zeros(0, np.float32)  # (classify takes the pieces)
    ctx = {k: sc[3] for k, sc in enumerate(scored)}
    ph.lap("engine")  # the partitions' rows through the engine, on their workers
    classes, timing = classify(peaks_by_recording(ld.specs, seg.peaks), plan.peak[kb], plan.recording[kb],
                               deviation, fs)
    ph.lap("classes")
    threshold = robust_threshold(scores, recording=plan.recording[kb])  # (the spread within recordings)
    flagged_mask = scores > threshold
    names = [r.name for r in ld.source.recordings]
    matched = FigurePool.result(matching) if matching is not None else None  # (the truth's beats matched to ours)
    # the check against the synthetic truth (its ROC-AUCs), in a figure process while this one goes on
    checking = figures.submit(truth_check, matched, scores) if matched is not None else None
    # the report's figures that need the scores start first, in the figure processes: the top anomalies
    # (their context came with the scores; on the H100 host theirs was the longest drawing, 0.12-0.21 s),
    # then the stream, the scores and the latent space's two; the table, the truth's scores and the
    # summary are made while they are drawn
    per_kept = R.truth_per_kept(matched, len(kb))
    # the report's beat lists: the anomaly list led by the V and S beats, the classes' panels and the
    # artifacts'; the signal around the beats that the partitions' own top beats by score did not hold is
    # cut in one more round over the partitions that own them
    lists = R.class_lists(scores, classes, flagged_mask)
    need = R.missing_context(plan, kb, np.concatenate(list(lists.values())), ctx, fs)
    if need:
        owners = sorted(need)
        more = T.gather(T.map_partitions(T.partition_snippets, [ld.parts[k] for k in owners],
                                         [ld.lefts[k] for k in owners], [ld.rights[k] for k in owners],
                                         [ld.firsts[k] for k in owners], [need[k] for k in owners],
                                         name="class-snippets", at=[ld.parts[k] for k in owners]))
        for k, pieces in zip(owners, more):
            ctx[k] = list(ctx[k]) + list(pieces)
    top_rows = lists["top"]
    beat_lists = {name: R.top_list(names, fs, plan, lists[key], scores, ctx, kb, per_kept, classes)
                  for name, key in (("top", "top"), ("class_V", "V"), ("class_S", "S"), ("artifacts", "artifacts"))}
    top_list = beat_lists["top"]
    # (the classes' panels and the latent space by class are drawn with the report's other figures)
    run.drawn.update(figures.draw(SimpleNamespace(fs=fs, top=top_list), ("top", "top_right")))
    ph.lap("context")
    view = R.scored_view(fs, ld.total, plan, trained, scores, mu, threshold, flagged_mask, T.gather(ld.overview),
                         per_kept, kb, ld.rec_offset, names, classes)
    view.update(R.unreadable_view(seg.unreadable, [r.name for r in ld.source.recordings],
                                  [ld.rec_offset[r] / fs for r in range(len(ld.source.recordings))]))
    run.drawn.update(figures.draw(SimpleNamespace(**view), LATE_FIGURES))
    ph.lap("figures_started")
    table = anomaly_table(kb, plan.recording[kb], plan.peak[kb], plan.start[kb], plan.length[kb], scores, fs,
                          threshold, names, classes, timing)
    top = table.iloc[top_rows]  # (the rows the report's top anomalies are)
    truth = None
    if checking is not None:
        truth = FigurePool.result(checking)
        # the classes and the unreadable stretches against the truth's (the synthetic input is one recording)
        found = (np.round(seg.unreadable[["start_s", "end_s"]].to_numpy(np.float64) * fs).astype(np.int64)
                 if len(seg.unreadable) else np.zeros((0, 2), np.int64))
        truth = {**truth, "classes": truth_classes(matched, classes), "quality": truth_quality(matched, found)}
        log.info("truth: Se %.4f PPV %.4f, anomaly ROC-AUC %.4f; classes V Se %.4f +P %.4f, S Se %.4f +P %.4f; "
                 "unreadable episodes found %d of %d", truth["se"], truth["ppv"], truth["auc"],
                 *(truth["classes"][c][k] for c in "VS" for k in ("se", "ppv")),
                 truth["quality"]["episodes_found"], truth["quality"]["episodes"])
        ph.lap("truth")
    # the table's file written in a thread (pyarrow lets go of the interpreter) while the report is made
    written = write_in_background(run.work, write_anomaly_table, table, run.work / "anomalies.parquet")
    meta = json.loads((run.work / "model.json").read_text())
    meta.update(threshold=threshold, fs=fs)
    (run.work / "model.json").write_text(json.dumps(meta, indent=1))
    flagged = int(flagged_mask.sum())
    log.info("scoring: %d of %d beats flagged (threshold %.4g)", flagged, len(table), threshold)
    cls = class_summary(classes, plan.recording[kb])
    log.info("classes: %s; V burden %.2f %%, S burden %.2f %%", ", ".join(f"{k} {v}" for k, v in cls["counts"].items()),
             cls["v_burden_pct"], cls["s_burden_pct"])
    ph.lap("table")
    run.detail["score"] = ph.times
    run.sw.lap("score")
    return _Scored(threshold, flagged_mask, flagged, top_list, view, top, truth, score_workers, written, classes,
                   {k: v for k, v in beat_lists.items() if k != "top"})


def _viewer_request(ld: _Loaded, seg: _Segmented, sc: _Scored) -> dict:
    """What the report's task builds the stream viewer from (``beatflow.report.viewer``): the futures of the
    finest level's columns and of the raw windows around the top, flagged and V/S beats (cut now on the
    partitions' workers, gathered in the task), the beats' marks, the top anomalies' starts on the stream."""
    plan, kb, fs = seg.plan, seg.kb, ld.fs
    scores = sc.view["score_all"]
    windows = raw_windows(plan, kb, scores, sc.flagged_mask, sc.classes,
                          np.searchsorted(kb, [t["beat"] for t in sc.top_list]), fs)
    owners = sorted(windows)
    raw = T.map_partitions(T.partition_snippets, [ld.parts[k] for k in owners], [ld.lefts[k] for k in owners],
                           [ld.rights[k] for k in owners], [ld.firsts[k] for k in owners],
                           [windows[k] for k in owners], name="viewer-snippets",
                           at=[ld.parts[k] for k in owners]) if owners else []
    names = [r.name for r in ld.source.recordings]
    starts = [ld.rec_offset[r] for r in range(len(names))]
    return {"total": ld.total, "fs": fs, "levels": ld.levels, "raw": raw,
            "raw_offsets": [ld.rec_offset[ld.specs[k].recording] for k in owners],
            "beats": beat_marks(plan, kb, ld.rec_offset, sc.classes, sc.flagged_mask),
            "unreadable_s": sc.view.get("unreadable_spans_s") or [], "recording_names": names,
            "recording_starts": starts,
            "top_starts": [(int(plan.start[t["beat"]]) + ld.rec_offset[int(plan.recording[t["beat"]])],
                            int(plan.length[t["beat"]])) for t in sc.top_list]}


def _report(run: _Run, ld: _Loaded, seg: _Segmented, trained: dict, engine: dict, sc: _Scored) -> dict:
    """The report: the summary, the figures that are left, the page; then ``summary.json`` and the UI's
    artifacts. Returns the summary."""
    o, ph = run.opts, _Stopwatch(4)
    summary = R.run_summary(ld.source, ld.fs, ld.total, seg.plan, seg.pruned, trained, engine, sc.flagged,
                            sc.threshold, o.device, run.workers, ld.specs, sc.truth, seg.episodes, seg.unreadable)
    summary["per_recording"] = R.per_recording(ld.source, ld.fs, ld.n_samples, seg.plan.recording[seg.kb],
                                               sc.flagged_mask, sc.classes)
    summary["classes"] = class_summary(sc.classes, seg.plan.recording[seg.kb])
    if seg.second_lead is not None:
        summary["second_lead"] = seg.second_lead
    summary["workers_scoring"] = sc.score_workers
    summary["service"] = o.service  # (on the cluster of `beatflow serve`)
    if run.gpu_workers:
        summary["gpu_workers"] = run.gpu_workers
    if ld.truth_path:  # the synthetic stream lives in the output folder, which is renamed at the end
        summary["input"] = f"synthetic ECG ({o.hours:g} h, seed {o.seed}): input.npy, truth.npz"
    summary["timings_s"] = dict(run.sw.times)  # the report's table: the stages up to this one (summary.json: all)
    data = R.report_data(ld.source, ld.s, seg.plan, trained, sc.top_list, summary, sc.truth,
                         {**sc.view, **sc.beat_lists})
    run.drawn.update(run.figures.draw(data, [name for name in FIGURES if name not in run.drawn]))  # the rest
    ph.lap("data")
    # while the figures are drawn: this run's transfer counts from the workers (their device work is done);
    # the top anomalies' artifact, an API call for the UI only, in the background (settled at the flow's end:
    # once the figures drew in 70 ms or less, its 10-50 ms here would have been the report's wait)
    stats = run_on_workers(transfer_stats, run.run_id)  # (workers may serve many runs)
    rss = run_on_workers(peak_rss_bytes)  # (a standing worker's: its peak since it started)
    summary["peak_rss_bytes"] = {"flow": peak_rss_bytes(), "largest_worker": max(rss.values(), default=None),
                                 "workers": len(rss)}
    viewer = _viewer_request(ld, seg, sc)  # (its windows cut while the figures are awaited; after the counts)
    T.api_call_later(_publish_top, sc.top)
    ph.lap("stats_artifact")
    drawn = run.figures.collect(run.drawn)
    ph.lap("figures_wait")
    sc.written.result()  # (its error, if it failed)
    run.detail["figures"] = FigurePool.timings(run.drawn)
    T.write_report(str(run.work / "report.html"), data, drawn, viewer)
    ph.lap("write")
    run.detail["report"] = ph.times
    run.sw.lap("report")

    summary["workers_reporting"] = len(stats)
    summary["transfers"] = R.transfer_summary(stats, ld.total)
    summary["timings_s"] = run.sw.total()
    summary["timings_detail_s"] = run.detail
    (run.work / "summary.json").write_text(json.dumps(summary, indent=2))
    for name in ("validation_beats.npy",):
        (run.work / name).unlink(missing_ok=True)
    _publish_summary(summary)
    # the training's progress artifact is updated in the background by the process that trained: a worker
    # (or this process, under another task runner)
    unsettled = [T.settle_api_calls(), *run_on_workers(T.settle_api_calls).values()]
    for line in (line for lines in unsettled for line in lines):
        run.log.warning("a Prefect UI update failed: %s", line)
    return summary


def _task_overhead(t_submit: float, result: dict) -> dict:
    """Seconds of a task on a worker outside its own work: from submitting it to its start there
    (``dispatch``) and from its end to its result here (``return``), from the ``task_span`` the task
    put in its result (wall clocks: exact on one host, approximate across hosts)."""
    span = result.get("task_span") if isinstance(result, dict) else None
    if not span or span[0] < t_submit - 1.0:  # none, or a result from the cache of an earlier run
        return {}
    now = time.time()
    return {"dispatch": round(span[0] - t_submit, 4), "work": round(span[1] - span[0], 4),
            "return": round(now - span[1], 4)}


def _publish_top(top) -> None:
    """The Prefect UI's table of the top anomalies (an artifact)."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(R.top_table_rows(top), key="beatflow-top-anomalies", description="most anomalous beats")


def _publish_report_link(report: Path) -> None:
    """The Prefect UI's link to the run's report (a link artifact: the page is on this machine's disk)."""
    from prefect.artifacts import create_link_artifact

    try:
        create_link_artifact(report.resolve().as_uri(), link_text=f"report.html ({report.parent.name})",
                             key="beatflow-report", description="the run's report page, on the machine that ran it")
    except Exception as e:  # the UI's link must not fail a run whose outputs are written
        get_run_logger().warning("the report's link artifact failed: %s", e)


def _publish_summary(summary: dict) -> None:
    """The Prefect UI's summary of the run (a markdown artifact)."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(R.summary_markdown(summary), key="beatflow-summary", description="beatflow run summary")

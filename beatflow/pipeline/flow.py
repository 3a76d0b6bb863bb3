"""The end-to-end flow: load → segment → embed → train → engine → score → report.

Each stage is a Prefect task; the partitions' work of a stage is mapped over the Dask workers
(``beatflow.pipeline.stages``) and each partition's arrays stay in its worker (futures). The flow itself only
sees small results and writes the outputs, into a temporary folder renamed at the end, so a failed
run leaves no partial output.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
from prefect import flow, get_run_logger

from beatflow.device import import_in_background, transfer_stats
from beatflow.embed.beats import MODEL_INPUT
from beatflow.errors import InputError
from beatflow.terminal import done_interrupt, front_sigterm, on_interrupt
from beatflow.report.pool import FigurePool, figure_pool
from beatflow.score.metrics import match_truth, truth_check
from beatflow.params import DEFAULT_FS, TRAIN_FRACTION, SegmentParams, compile_pays
from beatflow.detect.leads import SecondLeadParams
from beatflow.embed.partitions import assemble_halos, plan_beats, second_lead_gathered
from beatflow.io.sources import open_second_lead, open_source
from beatflow.score.rule import anomaly_table, robust_threshold, top_order, write_anomaly_table
from beatflow.pipeline import stages as T
from beatflow.pipeline.caching import cached, code_version, input_digest, token
from beatflow.pipeline.cluster import flow_client, prepare_gpu_workers, run_on_workers, wait_for_workers

N_COLUMNS = 4000  # pixel columns of the whole-stream picture
N_TOP = 12


def default_out_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


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


_OWNER = ".owner"  # "<host> <pid>" of the run writing a .partial folder


def remove_stale_partials(final: Path) -> list[Path]:
    """Remove the ``.partial`` folders that killed runs left next to ``final``.

    A run writes into ``.<name>.<random>.partial`` and renames it at the end; a run killed with
    SIGKILL cannot clean up. A folder is stale when its owner file names this host and a process
    that no longer exists (folders of other hosts, or without an owner file, are left alone).
    """
    host, out = socket.gethostname(), []
    for d in final.parent.glob(f".{final.name}.*.partial"):
        try:
            owner_host, pid = (d / _OWNER).read_text().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if owner_host != host or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(d, ignore_errors=True)
        out.append(d)
    return out


@flow(name="beatflow", log_prints=True)
def ecg_anomaly_flow(input: str | None = None, column: str | None = None, fs: float | None = None,
                     lead: int = 0, confirm_lead: int | None = None, confirm_column: str | None = None,
                     hours: float = 20.0, seed: int = 0, out: str | None = None,
                     device: str = "cpu", workers: int | None = 2, partitions: int | None = None,
                     epochs: int = 10, batch_size: int = 1024, store: str | None = None,
                     cache: str | None = None, engine_backend: str = "auto", precision: str = "fp32",
                     train_precision: str = "auto", train_compile: bool | None = None,
                     rmm_pool_size: str | float | None = None, rmm_allocator: str = "async") -> dict:
    """Find abnormal heartbeats in a long ECG and write ``summary.json``, ``anomalies.parquet``,
    ``report.html``, the model and the engine to ``out``.

    Parameters
    ----------
    input : str, optional
        CSV / Parquet / ``.npy`` file or WFDB folder; synthetic ECG (``hours`` long) when omitted.
    column, fs, lead : optional
        Column of a CSV/Parquet file, its sampling rate (default 250 Hz), WFDB channel.
    confirm_lead, confirm_column : optional
        A second lead of the input (WFDB channel, or CSV/Parquet column) that checks the first one's
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
    """
    front_sigterm()  # (a command's SIGTERM before Prefect's handler: beatflow.terminal)
    log = get_run_logger()
    sw = _Stopwatch()
    final = Path(out) if out else default_out_dir()
    if final.exists() and any(final.iterdir()):
        raise InputError(f"{final}: output folder exists and is not empty")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_partials(final):
        log.info("removed %s, left by a run that was killed", stale)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    (work / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    on_interrupt(work, lambda: shutil.rmtree(work, ignore_errors=True))  # (a command stopped by force)
    try:
        summary = _run(log, sw, work, input, column, fs, lead, hours, seed, device, workers, partitions,
                       epochs, batch_size, cache, engine_backend, precision, train_precision, train_compile,
                       rmm_pool_size, rmm_allocator, confirm=(confirm_lead, confirm_column))
        if store:
            from beatflow.io.store import Store

            meta = json.loads((work / "model.json").read_text())
            summary["model_id"] = Store(store).register_model(work / "model.pt", meta)
            log.info("model registered in %s as %s", store, summary["model_id"])
        if final.exists():
            final.rmdir()
        (work / _OWNER).unlink(missing_ok=True)
        _join_writes(work)
        os.replace(work, final)
    except BaseException as e:
        _join_writes(work)  # (a write still going would leave a file in the folder removed here)
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, Exception):  # an interrupt keeps the undo: a worker may still write here
            done_interrupt(work)  # until the command has stopped it (beatflow.terminal.Interrupts)
        raise
    done_interrupt(work)
    log.info("outputs in %s", final)
    summary["out"] = str(final)
    return summary


_WRITES: dict[str, list] = {}  # the background writes of each run's work folder


def _write_in_background(work: Path, fn, *args):
    """``fn(*args)``, a write into ``work``, in a thread of its own while the flow goes on (a future);
    :func:`_join_writes` waits for it before the folder is moved or removed."""
    writing = ThreadPoolExecutor(1, thread_name_prefix="beatflow-write")
    future = writing.submit(fn, *args)
    writing.shutdown(wait=False)
    _WRITES.setdefault(str(work), []).append(future)
    return future


def _join_writes(work: Path) -> None:
    """Wait for the background writes into ``work`` (their errors are the flow's to raise)."""
    for future in _WRITES.pop(str(work), []):
        wait([future])


def _run(*args, **kwargs) -> dict:
    """:func:`_run_flow` with the report's figure processes (:func:`figure_pool`)."""
    return _run_flow(figure_pool(), *args, **kwargs)


def _run_flow(figures, log, sw, work: Path, input, column, fs, lead, hours, seed, device, workers, partitions,
              epochs, batch_size, cache=None, engine_backend="auto", precision="fp32", train_precision="auto",
              train_compile=None, rmm_pool_size=None, rmm_allocator="async", confirm=(None, None)) -> dict:
    threads = max(1, os.cpu_count() or 1)
    if device == "gpu":  # the Dask client here meets CuPy arrays' types (`beatflow run` started this before)
        import_in_background("cupy")
    truth_path = None
    wait_for_workers(1)  # a cluster whose workers cannot start is an error, not a hang
    if workers is None:  # a cluster given by --scheduler: as many as it has
        client = flow_client()
        workers = max(1, len(client.scheduler_info().get("workers", {}))) if client is not None else 1
    # every GPU worker allocates from one RMM pool for CuPy, Numba and PyTorch (set up if it was not)
    gpu_workers = prepare_gpu_workers(rmm_pool_size, rmm_allocator) if device == "gpu" else {}
    if input is None:
        # in the flow's process (a copy from the cache of generated recordings on a warm run): as a
        # task on a worker it cost the round trips of a remote Prefect task run too
        input, truth_path = T.synthesize(hours, fs or DEFAULT_FS, seed, str(work))
        sw.lap("synthesize")
    source = open_source(input, column=column, fs=fs, lead=lead)
    second = open_second_lead(source, input, fs, lead=lead, column=column, confirm_lead=confirm[0],
                              confirm_column=confirm[1])
    fs = source.fs
    s = SegmentParams().samples(fs)
    q = SecondLeadParams().samples(fs) if second is not None else None
    base_token = None
    if cache:
        digest = (token("synthetic", hours, fs, seed, code_version()) if truth_path
                  else input_digest(input))
        base_token = token(digest, column, fs, lead, s, code_version(), *((confirm, q) if second is not None else ()))
        log.info("cache: %s (input %s)", cache, digest[:12])
    specs = source.plan(partitions or 2 * max(1, workers))
    log.info("%s: %d recording(s), %d partitions, fs %g Hz", source.path, len(source.recordings), len(specs), fs)

    # load (each partition on one worker, where it stays) and exchange the small halos
    from prefect.runtime import flow_run

    parts, edges, load_detail = T.load(source, specs, device, s.halo, flow_run.id)
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
        parts2, edges2, load_detail2 = T.load(second, specs, device, s.halo, flow_run.id, beside=parts)
        load_detail = {"first_lead": load_detail, "second_lead": load_detail2}
        if [e[0] for e in edges2] != lengths:
            raise InputError(f"{source.path}: the second lead's partitions differ in length from the first's")
        second_parts = (parts2, *assemble_halos(specs, lengths, [e[1] for e in edges2], [e[2] for e in edges2],
                                                s.halo)[:2])
    rec_offset, acc = {}, 0
    for r in range(len(source.recordings)):
        rec_offset[r] = acc
        acc += n_samples.get(r, 0)
    # the whole-stream picture (per pixel column) is computed while the rest goes on
    overview_futures = T.map_partitions(T.stream_overview, parts,
                                        [rec_offset[sp.recording] + firsts[k] for k, sp in enumerate(specs)],
                                        name="stream-overview", total=total, ncols=N_COLUMNS)
    sw.lap("load")

    # segmentation
    seg_token = (token(base_token, "segment", [(sp.recording, firsts[k], lengths[k]) for k, sp in enumerate(specs)])
                 if cache else None)
    segmented = cached(T.segment, cache)(parts, lefts, rights, firsts, s, cache_token=seg_token, second=second_parts,
                                         n_totals=[n_samples[sp.recording] for sp in specs], q=q)
    peaks = [r[0] for r in segmented]
    second_lead = None
    if second is not None:  # rules 2 and 3 compare each peak with its neighbours: over the gathered peaks
        peaks, dropped, moved = second_lead_gathered(specs, peaks, [r[2] for r in segmented], q, s)
        second_lead = {"lead": confirm[0], "column": confirm[1], "params": SecondLeadParams().to_dict(),
                       "doubtful_peaks_dropped": dropped, "peaks_moved": moved}
        log.info("second lead %s: %d doubtful peak(s) dropped (no QRS on the second lead), %d moved to the "
                 "second lead's QRS", confirm[0] if confirm[0] is not None else confirm[1], dropped, moved)
    plan = plan_beats(specs, firsts, n_samples, peaks, s)
    episodes = _flutter_episodes(specs, [r[1] for r in segmented], source, fs)
    episodes.to_csv(work / "rhythm_episodes.csv", index=False)
    if len(episodes):
        log.warning("ventricular flutter/fibrillation: %d episode(s), %.1f s in all (rhythm_episodes.csv); "
                    "their waves are not counted as beats", len(episodes), float(episodes["duration_s"].sum()))
    if plan.n_detected == 0:
        raise InputError(f"{source.path}: no heartbeats found (flat line or no QRS-like peaks)")
    if plan.n_kept < 64:
        raise InputError(f"{source.path}: only {plan.n_kept} beats of plausible length "
                         f"(at least {s.lower} samples): too few to learn from")
    pruned = 1.0 - plan.n_kept / plan.n_detected
    kb = np.flatnonzero(plan.kept)  # beat numbers of kept beats, in the same order as the rows
    log.info("segmentation: %d beats detected, %d kept, removed %.2f percent of the candidates",
             plan.n_detected, plan.n_kept, 100 * pruned)
    # the beat lengths' figure needs nothing more: drawn now, so that its process is free by the time
    # the figures of the trained model and of the scores come (nine figures, up to eight processes)
    counts, edges_ = _length_histogram(plan, s)
    early = figures.draw(SimpleNamespace(fs=fs, length_hist_counts=counts, length_hist_edges=edges_,
                                         length_bounds=(s.lower, s.upper)), ("lengths",))
    sw.lap("segment")

    # pruning / embedding: each partition's kept beats become rows, on the partition's worker
    kept = [plan.kept_of(k) for k in range(len(specs))]
    embedded = T.embed(parts, lefts, rights, firsts, [k[0] for k in kept], [k[1] for k in kept], s)
    sw.lap("embed")

    # training: once, on one worker, on the gathered matrix
    train_token = (token(base_token, "train", plan.start[plan.kept].tobytes(), plan.length[plan.kept].tobytes(),
                         epochs, batch_size, seed, MODEL_INPUT, train_precision) if cache else None)
    model_folder = str(Path(cache).resolve() / "models" / train_token) if cache else str(work)
    compile_steps = (compile_pays(device, int(plan.n_kept * TRAIN_FRACTION), epochs) if train_compile is None
                     else bool(train_compile))
    # while the cluster trains, the matching of the beats to the synthetic truth (the part of its
    # check that needs no scores) runs in an idle figure process, not in a thread of this one, whose
    # GIL the stages need (on the H200 a thread here made the embedding stage 4x slower); only light
    # modules there: a job that made a process import Prefect cost seconds
    matching = None
    if truth_path:
        matching = figures.submit(match_truth, truth_path, np.concatenate(peaks), plan.peak[kb], fs)
    t_submit = time.time()
    # on the home worker, the same every run: its compiled steps and graphs stay warm
    trained = cached(T.train_model, cache)(embedded, model_folder, epochs, batch_size, seed, threads,
                                           [sp.recording for sp in specs], train_precision=train_precision,
                                           compile=compile_steps, cache_token=train_token)
    over = _task_overhead(t_submit, trained)  # (empty for a result from the cache: its phases are an earlier run's)
    queued = ({"epoch_gpu_ms": trained["epoch_gpu_ms"], "queue_s": trained.get("queue_s")}
              if trained.get("epoch_gpu_ms") else {})  # (the GPU's queued epochs: where their time went)
    detail = {"load": load_detail, "train": {**over, **(trained.get("phases_s") or {}), **queued} if over else {}}
    if cache:  # the cached model lives in the cache; the run's outputs get a copy
        for name in ("model.pt", "model.json", "validation_beats.npy"):
            shutil.copy(Path(model_folder) / name, work / name)
        trained = {**trained, "model": str(work / "model.pt"), "validation": str(work / "validation_beats.npy")}
    log.info("training: train loss %s, test loss %.5f", ", ".join(f"{v:.4f}" for v in trained["train_loss"]),
             trained["test_loss"])
    sw.lap("train")
    # the report's figures that need nothing more are drawn here, in the flow's process, while the
    # workers build the engine and score (the report task then renders only the rest)
    early.update(_draw_early_figures(figures, fs, trained))

    t_submit = time.time()
    engine = T.build_engine(trained["model"], trained["validation"], threads, device, engine_backend, precision)
    detail["engine"] = {**_task_overhead(t_submit, engine), **(engine.get("phases_s") or {})}
    shutil.copy(engine["path"], work / ("engine" + Path(engine["path"]).suffix))  # the run keeps its engine
    sw.lap("engine")

    # scoring goes back out to the partitions' workers; offsets of recordings on one time axis
    ph = _Stopwatch(4)
    dominant = np.asarray(trained["dominant"], np.float32)
    # (each partition also cuts the signal around its own top beats: those of the report's top anomalies are among them)
    bounds = [plan.kept & (plan.owner == k) for k in range(len(specs))]
    context = (parts, lefts, rights, firsts, [plan.start[m] for m in bounds], [plan.length[m] for m in bounds])
    scored, score_workers = T.score(embedded, engine["path"], trained["scale"],
                                    [dominant[sp.recording] for sp in specs], at=parts, context=context, top=N_TOP,
                                    pad=int(fs))
    scores = np.concatenate([sc[0] for sc in scored]) if scored else np.zeros(0, np.float32)
    mu = np.concatenate([sc[1] for sc in scored]) if scored else np.zeros((0, 2), np.float32)
    ctx = {k: sc[2] for k, sc in enumerate(scored)}
    ph.lap("engine")  # the partitions' rows through the engine, on their workers
    threshold = robust_threshold(scores, recording=plan.recording[kb])  # (the spread within recordings)
    flagged_mask = scores > threshold
    names = [r.name for r in source.recordings]
    matched = FigurePool.result(matching) if matching is not None else None  # (the truth's beats matched to ours)
    # the check against the synthetic truth (its ROC-AUCs), in a figure process while this one goes on
    checking = figures.submit(truth_check, matched, scores) if matched is not None else None
    # the report's figures that need the scores start first, in the figure processes: the top anomalies
    # (their context came with the scores; on the H100 host theirs was the longest drawing, 0.12-0.21 s),
    # then the stream, the scores and the latent space's two; the table, the truth's scores and the
    # summary are made while they are drawn
    per_kept = _truth_per_kept(matched, len(kb))
    top_rows = top_order(scores, N_TOP)  # (the anomaly table's ranks 1..N_TOP, in order)
    top_list = _top_list(names, fs, plan, top_rows, scores, ctx, kb, per_kept)
    late = figures.draw(SimpleNamespace(fs=fs, top=top_list), ("top", "top_right"))  # (its halves, side by side)
    ph.lap("context")
    view = _scored_view(fs, total, plan, trained, scores, mu, threshold, flagged_mask, T.gather(overview_futures),
                        per_kept, kb, rec_offset, names)
    late.update(figures.draw(SimpleNamespace(**view), LATE_FIGURES))
    ph.lap("figures_started")
    table = anomaly_table(kb, plan.recording[kb], plan.peak[kb], plan.start[kb], plan.length[kb], scores, fs,
                          threshold, names)
    top = table.iloc[top_rows]  # (the rows the report's top anomalies are)
    truth = None
    if checking is not None:
        truth = FigurePool.result(checking)
        log.info("truth: Se %.4f PPV %.4f, anomaly ROC-AUC %.4f", truth["se"], truth["ppv"], truth["auc"])
        ph.lap("truth")
    # the table's file written in a thread (pyarrow lets go of the interpreter) while the report is made
    written = _write_in_background(work, write_anomaly_table, table, work / "anomalies.parquet")
    meta = json.loads((work / "model.json").read_text())
    meta.update(threshold=threshold, fs=fs)
    (work / "model.json").write_text(json.dumps(meta, indent=1))
    flagged = int(flagged_mask.sum())
    log.info("scoring: %d of %d beats flagged (threshold %.4g)", flagged, len(table), threshold)
    ph.lap("table")
    detail["score"], ph = ph.times, _Stopwatch(4)
    sw.lap("score")

    # report: the summary, the figures that are left, the page
    summary = _summary(source, fs, total, plan, pruned, trained, engine, flagged, threshold, device, workers,
                       specs, truth, episodes)
    summary["per_recording"] = _per_recording(source, fs, n_samples, plan.recording[kb], flagged_mask)
    if second_lead is not None:
        summary["second_lead"] = second_lead
    summary["workers_scoring"] = score_workers
    if gpu_workers:
        summary["gpu_workers"] = gpu_workers
    if truth_path:  # the synthetic stream lives in the output folder, which is renamed at the end
        summary["input"] = f"synthetic ECG ({hours:g} h, seed {seed}): input.npy, truth.npz"
    summary["timings_s"] = dict(sw.times)  # the report's table: the stages up to this one (summary.json: all)
    data = _report_data(source, fs, s, plan, trained, top_list, summary, truth, view)
    from beatflow.report.figures import FIGURES

    last = figures.draw(data, [name for name in FIGURES if name not in early and name not in late])  # the rest
    ph.lap("data")
    # while the figures are drawn: this run's transfer counts from the workers (their device work is done);
    # the top anomalies' artifact, an API call for the UI only, in the background (settled at the flow's end:
    # once the figures drew in 70 ms or less, its 10-50 ms here would have been the report's wait)
    stats = run_on_workers(transfer_stats, flow_run.id)  # (workers may serve many runs)
    T.api_call_later(_publish_top, top)
    ph.lap("stats_artifact")
    futures = {**early, **late, **last}
    drawn = figures.collect(futures)
    ph.lap("figures_wait")
    written.result()  # (its error, if it failed)
    detail["figures"] = FigurePool.timings(futures)
    T.write_report(str(work / "report.html"), data, drawn)
    ph.lap("write")
    detail["report"] = ph.times
    sw.lap("report")

    summary["workers_reporting"] = len(stats)
    summary["transfers"] = {
        "d2h_bytes": int(sum(v.get("d2h_bytes", 0) for v in stats.values())),
        "stream_bytes": int(total * 4),
        "rmm_pool_bytes_per_worker": [v["rmm_pool_bytes"] for v in stats.values() if "rmm_pool_bytes" in v],
        "rmm_peak_bytes_per_worker": [v["rmm_peak_bytes"] for v in stats.values() if "rmm_peak_bytes" in v],
        "numba_memory_manager_per_worker": [v["numba_memory_manager"] for v in stats.values()
                                            if "numba_memory_manager" in v],
    }
    summary["timings_s"] = sw.total()
    summary["timings_detail_s"] = detail
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    for name in ("validation_beats.npy",):
        (work / name).unlink(missing_ok=True)
    _publish_summary(summary)
    # the training's progress artifact is updated in the background by the process that trained: a worker
    # (or this process, under another task runner)
    unsettled = [T.settle_api_calls(), *run_on_workers(T.settle_api_calls).values()]
    for line in (line for lines in unsettled for line in lines):
        log.warning("a Prefect UI update failed: %s", line)
    return summary


def _flutter_episodes(specs, per_partition, source, fs: float) -> pd.DataFrame:
    """The ventricular flutter/fibrillation episodes of every recording (partitions' ranges joined),
    as a table: recording, start_s, end_s, duration_s (rhythm_episodes.csv)."""
    from beatflow.detect.rhythm import merge_spans

    rows = []
    for rec in sorted({sp.recording for sp in specs}):
        spans = merge_spans([per_partition[k] for k, sp in enumerate(specs) if sp.recording == rec])
        for a, b in spans:
            rows.append((source.recordings[rec].name, a / fs, b / fs, (b - a) / fs))
    return pd.DataFrame(rows, columns=["recording", "start_s", "end_s", "duration_s"])


def _summary(source, fs, total, plan, pruned, trained, engine, flagged, threshold, device, workers, specs,
             truth, episodes) -> dict:
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


def _per_recording(source, fs, n_samples: dict, recording, flagged) -> list[dict]:
    """Per recording of the input: its name, hours (``n_samples``: its length as read), kept beats and
    flagged beats (``recording``: each kept beat's recording number; ``flagged``: whether it is flagged).
    (Counted on the numbers: the table's names as strings took 18 ms for 97 k beats.)"""
    n = len(source.recordings)
    recording = np.asarray(recording, np.int64)
    beats = np.bincount(recording, minlength=n)
    hits = np.bincount(recording[np.asarray(flagged, bool)], minlength=n)
    return [{"recording": r.name, "hours": n_samples.get(k, 0) / fs / 3600.0, "beats": int(beats[k]),
             "flagged": int(hits[k])} for k, r in enumerate(source.recordings)]


def _length_histogram(plan, s):
    """The report's histogram of beat lengths: (counts, edges), bins of 4 samples."""
    return np.histogram(plan.length, bins=np.arange(0, 3 * s.upper + 8, 4))


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


def _draw_early_figures(figures: FigurePool, fs, trained) -> dict:
    """Futures of the report's early figures (``beatflow.report.figures.EARLY_FIGURES``) but the beat lengths'
    (drawn after segmentation): they need only what is known once the model is trained, and are drawn
    while the workers build the engine and score."""
    from beatflow.report.figures import EARLY_FIGURES

    d = SimpleNamespace(fs=fs, aligned_beats=np.asarray(trained["sample_rows"]), train_loss=trained["train_loss"],
                        test_loss=trained["test_loss"])
    return figures.draw(d, [name for name in EARLY_FIGURES if name != "lengths"])


#: the report's figures drawn as soon as the scores are known (``beatflow.report.figures.FIGURES``)
LATE_FIGURES = ("stream", "scores", "latent", "latent_truth")


def _truth_per_kept(matched, n_kept: int):
    """The truth label of every kept beat (0 normal, 1 PVC, 2 artifact; an unmatched beat 0), or None
    without a truth (``matched``: :func:`beatflow.score.metrics.match_truth`'s result)."""
    if matched is None:
        return None
    m, labels = matched["matched"], matched["labels"]
    per_kept = np.zeros(n_kept, np.int64)
    per_kept[m[m >= 0]] = labels[m >= 0]
    return per_kept


def _scored_view(fs, total, plan, trained, scores, mu, threshold, flagged, overview, per_kept, kb, rec_offset,
                 names=()) -> dict:
    """The report's fields that the scores decide (what :data:`LATE_FIGURES` draw: the stream's picture
    with the flagged beats' times, every score, and a sample of at most 20 000 test beats' latent means
    with their scores and truth labels; ``per_kept``: :func:`_truth_per_kept`)."""
    from beatflow.report.figures import combine_minmax

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


def _top_list(names, fs, plan, rows, scores, ctx, kb, per_kept) -> list[dict]:
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


def _report_data(source, fs, s, plan, trained, top_list, summary, truth, view: dict):
    from beatflow.report.figures import ReportData

    counts, edges_ = _length_histogram(plan, s)
    return ReportData(
        title=f"beatflow: {Path(source.path).name if truth is None else 'synthetic ECG'}", summary=summary,
        length_hist_counts=counts, length_hist_edges=edges_, length_bounds=(s.lower, s.upper),
        aligned_beats=trained["sample_rows"], train_loss=trained["train_loss"], test_loss=trained["test_loss"],
        top=top_list, **view)


def _publish_top(top) -> None:
    """The Prefect UI's table of the top anomalies (an artifact)."""
    from prefect.artifacts import create_table_artifact

    rows = [{k: (round(float(v), 4) if isinstance(v, float) else (v if isinstance(v, (int, str, bool)) else str(v)))
             for k, v in r.items()} for r in top[["rank", "beat", "recording", "start", "time_s", "length", "score"]]
            .astype({"recording": str}).to_dict("records")]
    create_table_artifact(rows, key="beatflow-top-anomalies", description="most anomalous beats")


def _publish_summary(summary: dict) -> None:
    """The Prefect UI's summary of the run (a markdown artifact)."""
    from prefect.artifacts import create_markdown_artifact

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
    create_markdown_artifact("\n".join(lines), key="beatflow-summary", description="beatflow run summary")

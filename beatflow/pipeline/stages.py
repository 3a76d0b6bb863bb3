"""The pipeline's Prefect tasks: thin wrappers over ``beatflow``; the partitions' work runs on Dask.

Each stage (load, segment, embed, score) is one Prefect task, run in the flow's
process: it maps a plain function over the partitions with the flow's Dask client, so each
partition's work runs on the worker that holds its arrays (on its GPU on the GPU path), and waits
for it. The partition arrays stay there, as Dask futures the flow hands from stage to stage; what a
stage returns to the flow is small (edges, peaks, scores). Training and the engine build are
Prefect tasks run in the flow's process too, each following one plain Dask task on the cluster's
home worker (:func:`_follow`; training's epochs come back as Dask events, logged and shown as
progress as they arrive); the synthetic ECG is made (or copied from its cache) in the flow's process.

Why not one Prefect task per partition (the first design): a Prefect task run on a Dask worker
re-creates its settings and API client from the serialized context, about 0.1-0.2 s per run
(measured: 8 empty mapped tasks took 1.0 s on a standing cluster, a Dask map of 8 and its gather
34 ms, a Prefect task called in the flow's process 5 ms), which made up most of a warm GPU run.
"""
from __future__ import annotations

import functools
import json
import os
import time
import uuid

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from beatflow.embed import partitions as P
from beatflow.device import device_memory, namespace, to_host, to_namespace
from beatflow.errors import BeatflowError
from beatflow.terminal import Progress
from beatflow.params import SegmentSamples
from beatflow.io.sources import PartitionSpec, Source

#: tasks whose inputs or outputs are partition arrays (or futures of them): the default cache key
#: would pickle every input, and results are not persisted
partition_task = functools.partial(task, cache_policy=NO_CACHE, persist_result=False)

#: attempts at reading a partition (a file on a network share can fail once); bad input is not retried
LOAD_ATTEMPTS = 3
#: seconds between updates of the training progress artifact (the last epoch always updates it)
PROGRESS_EVERY_S = 0.5

_api_calls = {"executor": None, "pending": []}


def api_call_later(fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``, a Prefect API call that only updates the UI (a progress artifact), made in a
    background thread (one, so such calls keep their order) in this thread's context: the flow goes on
    meanwhile (each call is 10-20 ms, as long as a warm GPU run's whole epoch). :func:`settle_api_calls`
    waits for them."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    if _api_calls["executor"] is None:
        _api_calls["executor"] = ThreadPoolExecutor(1, thread_name_prefix="beatflow-api")
    ctx = contextvars.copy_context()  # (the Prefect settings and run context of the caller)
    _api_calls["pending"].append(_api_calls["executor"].submit(ctx.run, fn, *args, **kwargs))


def settle_api_calls(timeout: float = 30.0) -> list[str]:
    """Wait for the calls :func:`api_call_later` made; a line for each that failed or did not finish in time."""
    from concurrent.futures import wait

    pending, _api_calls["pending"] = _api_calls["pending"], []
    done, late = wait(pending, timeout=timeout)
    failed = [f"{type(e).__name__}: {e}" for e in (f.exception() for f in done) if e is not None]
    return failed + [f"{len(late)} Prefect API call(s) still running after {timeout:g} s"] * bool(late)


@partition_task(name="synthesize-ecg")
def synthesize(hours: float, fs: float, seed: int, folder: str) -> tuple[str, str]:
    """Generate the synthetic ECG (or copy it from the cache of generated recordings); write
    ``input.npy`` and the truth (``truth.npz``) to ``folder``."""
    from beatflow.io.synth import synthesize_cached

    sig, truth = os.path.join(folder, "input.npy"), os.path.join(folder, "truth.npz")
    _, hit = synthesize_cached(sig, truth, hours=hours, fs=fs, seed=seed)
    with np.load(truth) as t:
        labels, episodes = t["labels"], t["unreadable"]
        unreadable_s = float((episodes[:, 1] - episodes[:, 0]).sum() / fs)
    get_run_logger().info("synthesized %.1f h at %g Hz%s: %d beats (%d PVC, %d APC, %d artifacts), "
                          "%d unreadable episodes (%.0f s)", hours, fs,
                          " (from the cache of generated recordings)" if hit else "", len(labels),
                          int((labels == 1).sum()), int((labels == 3).sum()), int((labels == 2).sum()),
                          len(episodes), unreadable_s)
    return sig, truth


# --- the partitions' work: plain functions, run by Dask on the worker that holds the partition ---

def load_partition(spec: PartitionSpec, source: Source, device: str, run_id=None, stash: str | None = None):
    """Read one partition (host), then one copy to the device on the GPU path. A failed read is
    tried again (``LOAD_ATTEMPTS`` in all), except for bad input or no room on the GPU (:class:`BeatflowError`).
    ``stash``: a name under which this worker keeps the seconds of the set-up, of the reads (failed ones
    included) and of the device copy's call, and the call's wall-clock span, until :func:`partition_edges`
    returns them with the edges."""
    from beatflow.device import begin_run, track_rmm_statistics

    t0, began = time.perf_counter(), time.time()
    # this run's transfer counters and pool peak start on this worker before its first device allocation
    (track_rmm_statistics if device == "gpu" else begin_run)(run_id)
    t1 = time.perf_counter()
    for attempt in range(LOAD_ATTEMPTS):
        try:
            host = source.read(spec)
            t2 = time.perf_counter()
            with device_memory(f"partition {getattr(spec, 'index', spec)} ({host.shape[0]:,} samples)", host.nbytes,
                               device == "gpu"):
                out = to_namespace(host, namespace(device))
            if stash is not None:
                _LOAD_PHASES[stash] = {"setup": t1 - t0, "read": t2 - t1, "to_device": time.perf_counter() - t2,
                                       "attempts": attempt + 1, "span": (began, time.time())}
            return out
        except BeatflowError:  # bad input, or no room on the GPU: reading again changes nothing
            raise
        except Exception:
            if attempt + 1 == LOAD_ATTEMPTS:
                raise


def load_stashed(spec: PartitionSpec, stash: str, *, source: Source, device: str, run_id=None):
    """:func:`load_partition` keeping its phases under ``stash`` (as mapped by :func:`load`)."""
    return load_partition(spec, source, device, run_id, stash=stash)


#: per worker process: the phases of partitions loaded here, by their ``stash`` name, until their edges are taken
_LOAD_PHASES: dict[str, dict] = {}


def partition_edges(core, stash: str | None = None, *, halo: int):
    """Length and the head/tail slices a partition lends its neighbours as halos (host copies), and the
    phases of its load on this worker (``{}`` where it was not loaded here, or under no ``stash``)."""
    head, tail = P.edges(core, halo)
    return int(core.shape[0]), to_host(head), to_host(tail), _LOAD_PHASES.pop(stash, {}) if stash else {}


def segment_partition(core, left, right, first: int, core2=None, left2=None, right2=None, n_total: int | None = None,
                      *, s: SegmentSamples, q=None, quality=None):
    """Peaks of one partition (QRS envelope, non-maximum suppression, local thresholds; see beatflow.detect.peaks)
    and the ventricular flutter/fibrillation episodes in its core: ``(peaks, episodes)``, host arrays.
    With a second lead's partition (``core2``, its halos; ``q``: its rules, ``n_total``: the
    recording's length) also the peaks' measures for the second lead's rules 2 and 3:
    ``(peaks, episodes, measures)`` (:func:`beatflow.embed.partitions.segment_partition`,
    :func:`beatflow.detect.leads.peak_measures`). With ``quality`` (:class:`beatflow.params.QualitySamples`)
    the peaks in unreadable stretches are dropped and the result gains a last element, the
    stretches in the core and their reasons (:mod:`beatflow.detect.quality`)."""
    xp = namespace(_device_of(core))
    with device_memory(f"segmenting a partition of {core.shape[0]:,} samples", core.nbytes, xp is not np):
        if core2 is None:
            out = P.segment_partition(core, to_namespace(left, xp), to_namespace(right, xp), first, s,
                                      episodes=True, quality=quality)
        else:
            second = (to_namespace(core2, xp), to_namespace(left2, xp), to_namespace(right2, xp))
            out = P.segment_partition(core, to_namespace(left, xp), to_namespace(right, xp), first, s,
                                      episodes=True, second=second, q=q, n_total=n_total, quality=quality)
    host = [to_host(out[0]), to_host(out[1])]
    if core2 is not None:
        host.append(tuple(to_host(m) for m in out[2]))
    if quality is not None:
        host.append(tuple(to_host(v) for v in out[-1]))
    return tuple(host)


def embed_partition(core, left, right, first: int, start, length, s: SegmentSamples):
    """Padded beat matrix of a partition's kept beats and their peak-to-peak amplitudes; stays on
    the worker."""
    xp = namespace(_device_of(core))
    with device_memory(f"the beat rows of a partition of {core.shape[0]:,} samples", core.nbytes, xp is not np):
        return P.embed_partition(core, to_namespace(left, xp), to_namespace(right, xp), first, start, length, s)


def stream_overview(core, offset: int, total: int, ncols: int):
    """Per-pixel-column min/max of a partition for the whole-stream picture."""
    from beatflow.report.envelope import column_minmax

    return column_minmax(core, offset, total, ncols)


def partition_snippets(core, left, right, first: int, windows):
    """Small signal snippets around the top anomalies owned by this partition."""
    xp = namespace(_device_of(core))
    return P.snippets(core, to_namespace(left, xp), to_namespace(right, xp), first, windows)


def _device_of(x) -> str:
    from beatflow.device import is_device_array

    return "gpu" if is_device_array(x) else "cpu"


def map_partitions(fn, *iterables, name: str, at: list | None = None, **constants) -> list:
    """``fn`` over the partitions on the flow's Dask cluster: Dask futures, one per partition, each
    run where its partition's arrays live (futures among the arguments); ``constants`` go to every
    call. Keys read ``<name>-<partition>-<run>`` on the Dask dashboard.

    ``at``: futures, one per partition, each call placed explicitly on the worker holding its own
    (another, if that one is gone). Dask alone places a call where most of its inputs' bytes are,
    which goes wrong in two cases: a small group of calls that hang off one group of futures is
    placed without regard to where those live ("root-ish" tasks: the second lead's partitions are
    read beside the first's), and inputs copied to one worker draw every later call there
    (training gathers the beat matrix on the home worker, which then holds a copy of every
    partition's rows: scoring ran all partitions there, one after the other, 4-5 s instead of a
    tenth of that on 16 CPU workers).
    """
    client = _client()
    tag = uuid.uuid4().hex[:8]
    n = len(iterables[0]) if iterables else 0
    keys = [f"{name}-{k}-{tag}" for k in range(n)]
    if at is None:
        out = client.map(fn, *iterables, key=keys, pure=False, **constants)
    else:
        holders = client.who_has(at)
        out = []
        for f, key, args in zip(at, keys, zip(*iterables)):
            where = sorted(holders.get(f.key, ()))[:1]
            placed = {"workers": where, "allow_other_workers": True} if where else {}
            out.append(client.submit(fn, *args, key=key, pure=False, **placed, **constants))
    progress = Progress(name, n)  # the terminal's status line: this stage's partitions done, and the time left
    for f in out:
        f.add_done_callback(progress.done)
    return out


def _client():
    """The flow's Dask client (the stages run in the flow's process, on its Dask task runner)."""
    from beatflow.pipeline.cluster import flow_client

    client = flow_client()
    if client is None:
        raise RuntimeError("the pipeline's stages need the flow's Dask task runner")
    return client


def wait_partitions(futures) -> None:
    """Wait for partition futures; re-raise the first failed one's own error (a bad CSV line, say),
    so that no later stage waits on input that will not come. Results stay on the workers."""
    from distributed import wait

    with _client().as_current():  # the flow thread has no default client
        wait(futures)
    for f in futures:
        if f.status == "error":
            f.result()  # raises the task's exception


def gather(futures) -> list:
    """The (small) results of partition futures, in order; the first failure re-raised."""
    return _client().gather(futures) if futures else []


# --- the stages: Prefect tasks run in the flow's process ---

@partition_task(name="load")
def load(source: Source, specs: list, device: str, halo: int, run_id=None, beside: list | None = None
         ) -> tuple[list, list, dict]:
    """Read every partition onto a worker (where it stays); ``(partition futures, edges, phases)``, the
    edges being each partition's length and the halos it lends (:func:`partition_edges`), the phases
    where the stage's time went (:func:`load_phases`). ``beside``: the futures of another lead's
    partitions, each read here onto the worker that holds that one (:func:`map_partitions` with ``at``)."""
    t0, submitted = time.perf_counter(), time.time()
    stash = [f"{uuid.uuid4().hex}-{k}" for k in range(len(specs))]
    parts = map_partitions(load_stashed, list(specs), stash, name="load-partition", at=beside, source=source,
                           device=device, run_id=run_id)
    wait_partitions(parts)
    t1, returned = time.perf_counter(), time.time()
    edges = gather(map_partitions(partition_edges, parts, stash, name="partition-edges", halo=halo))
    t2 = time.perf_counter()
    get_run_logger().info("load: %d partitions on %d worker(s)", len(parts), len(_holders(parts)))
    return parts, [e[:3] for e in edges], load_phases(t1 - t0, t2 - t1, [e[3] for e in edges], (submitted, returned))


def load_phases(partitions_s: float, edges_s: float, per_partition: list[dict],
                window: tuple[float, float] | None = None) -> dict:
    """The load stage's time: ``partitions`` (from the first read's dispatch until every partition is on
    its worker), ``edges`` (their halos gathered), and per partition, on its worker, the largest and the
    sum of ``setup`` (the run's counters and, on a GPU, the pool's adaptors), ``read`` (the host read and
    its check) and ``to_device`` (the call that copies to the GPU; on the CPU path, nothing).

    ``window``: the wall-clock times here of the reads' dispatch and of the wait's return. With the
    partitions' own spans on their workers, ``partitions`` splits into ``dispatch`` (until the first
    read started), ``on_workers`` (from then until the last read ended) and ``return`` (until the wait
    here returned): wall clocks, exact on one host and approximate across hosts."""
    out = {"partitions": round(partitions_s, 4), "edges": round(edges_s, 4)}
    spans = [p["span"] for p in per_partition if "span" in p]
    if window is not None and spans:
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        out.update({"dispatch": round(first - window[0], 4), "on_workers": round(last - first, 4),
                    "return": round(window[1] - last, 4)})
    for name in ("setup", "read", "to_device"):
        vals = [p[name] for p in per_partition if name in p]
        if vals:
            out[f"{name}_max"] = round(max(vals), 4)
            out[f"{name}_sum"] = round(sum(vals), 4)
    retried = sum(p.get("attempts", 1) - 1 for p in per_partition)
    if retried:
        out["reads_retried"] = retried
    return out


def _holders(futures) -> set:
    try:
        return {w for ws in _client().who_has(futures).values() for w in ws}
    except Exception:
        return set()


@partition_task(name="segment")
def segment(parts: list, lefts: list, rights: list, firsts: list, s: SegmentSamples,
            cache_token: str | None = None, second: tuple | None = None, n_totals: list | None = None,
            q=None, quality=None) -> list:
    """Peaks and flutter episodes of every partition (:func:`segment_partition`), host arrays.
    ``cache_token`` keys the persisted result where the flow caches (``beatflow.pipeline.caching.cached``).
    ``second``: the second lead's ``(parts, lefts, rights)``, with ``n_totals`` (each partition's
    recording length) and its rules ``q``: then each result also holds the peaks' measures.
    ``quality``: the signal quality's rule (each result ends with its unreadable stretches)."""
    if second is None:
        return gather(map_partitions(segment_partition, parts, lefts, rights, firsts, name="segment-partition", s=s,
                                     quality=quality))
    return gather(map_partitions(segment_partition, parts, lefts, rights, firsts, *second, n_totals,
                                 name="segment-partition", s=s, q=q, quality=quality))


@partition_task(name="embed")
def embed(parts: list, lefts: list, rights: list, firsts: list, starts: list, lengths: list,
          s: SegmentSamples) -> list:
    """Each partition's kept beats as rows (:func:`embed_partition`), left on its worker: futures."""
    embedded = map_partitions(embed_partition, parts, lefts, rights, firsts, starts, lengths, name="embed-partition",
                              s=s)
    wait_partitions(embedded)
    return embedded


def take_rows(embedded, index):
    """The rows and peak-to-peak amplitudes ``index`` (host int64) of a partition's ``(rows, p2p)``, on its
    device (the training sample's share of the partition, :func:`beatflow.model.sample.training_sample`)."""
    rows, p2p = embedded
    xp = namespace(_device_of(rows))
    at = xp.asarray(index)
    return rows[at], p2p[at]


def sample_rows(embedded: list, picks: list) -> list:
    """Each partition's share of the training sample (:func:`take_rows`), left on its worker: futures."""
    out = map_partitions(take_rows, embedded, picks, name="sample-rows", at=embedded)
    wait_partitions(out)
    return out


@partition_task(name="score")
def score(embedded: list, engine_path: str, scale: float, dominants: list, at: list | None = None,
          context: tuple | None = None, top: int = 0, pad: int = 0, templates: list | None = None,
          beat_window: tuple[float, int] | None = None) -> tuple[list, int]:
    """``(scores, latent means, class shape features)`` of every partition's rows through the built engine
    (:func:`score_partition`; the features against ``templates``, each partition's recording's, with
    ``beat_window``, else None),
    each partition on the worker holding the future at its place in ``at`` (its partition: not the home worker,
    which training gave a copy of every partition's rows; :func:`map_partitions`); and how many workers scored.

    ``context``: the lists ``(parts, lefts, rights, firsts, starts, lengths)`` (the partitions and their
    halos, each kept row's start and length): the class features then hold each beat's P-wave window, and with
    ``top`` each partition's result also holds the signal around its ``top`` highest-scoring beats (``pad``
    samples either side)."""
    extra = list(context) if context is not None else []  # (the stream for the P waves, and the snippets)
    templates = templates if templates is not None else [None] * len(embedded)
    futures = map_partitions(score_partition, embedded, dominants, templates, *extra, name="score-partition",
                             at=at, engine_path=engine_path, scale=scale, top=top if extra else 0, pad=pad,
                             beat_window=beat_window)
    out = gather(futures)
    n = len(_holders(futures))  # (the results stay where they were computed until released)
    get_run_logger().info("score: %d partitions on %d worker(s)", len(futures), n)
    return out, n


def fit_model(embedded: list, folder: str, epochs: int, batch_size: int, seed: int, threads: int,
              recordings: list[int] | None = None, n_rows_sample: int = 40, train_precision: str = "auto",
              compile: bool = False, topic: str | None = None, beat_window: tuple[float, int] | None = None) -> dict:
    """The flow's training (:func:`beatflow.model.train.fit_beats`: the partitions' rows gathered once, made
    the model's input, the LightVAE trained on them, its files written to ``folder``). A plain function,
    run on the cluster's home worker by :func:`train_model`; each epoch is also sent as a Dask event on
    ``topic`` (the flow's process logs it and moves the progress artifact).

    ``recordings[k]`` is the recording of partition ``k`` (default: all one recording). Returns small
    things only (see ``fit_beats``), and the task's wall-clock span.
    """
    t_start = time.time()
    from beatflow.engine.cache import wait_gpu_warmup
    from beatflow.model.train import fit_beats

    wait_gpu_warmup()  # (the engine's warm-up, where one runs on this GPU worker, ends before training captures its graphs)

    out = fit_beats(embedded, folder, epochs=epochs, batch_size=batch_size, seed=seed, threads=threads,
                    recordings=recordings, n_rows_sample=n_rows_sample, train_precision=train_precision,
                    compile=compile, on_epoch=_event_sender(topic), beat_window=beat_window)
    return {**out, "task_span": (t_start, time.time())}


@partition_task(name="train-vae")
def train_model(embedded: list, folder: str, epochs: int, batch_size: int, seed: int, threads: int,
                recordings: list[int] | None = None, n_rows_sample: int = 40, train_precision: str = "auto",
                compile: bool = False, cache_token: str | None = None,
                beat_window: tuple[float, int] | None = None) -> dict:
    """Training (:func:`fit_model`) on the cluster's home worker, followed from the flow's process:
    each epoch logged and the progress artifact moved as the worker reports it (a Dask event). A
    Prefect task run on the worker itself cost ~0.2-0.3 s of API round trips before it started."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    log = get_run_logger()
    shown = {"epoch": 0, "at": time.monotonic(), "artifact": None}

    def started() -> None:  # (an API call, made while the worker already trains)
        shown["artifact"] = create_progress_artifact(progress=0.0, description="VAE training (epochs done, %)")

    def show(event) -> None:
        epoch, loss, elapsed = event
        if epoch <= shown["epoch"]:
            return
        shown["epoch"] = epoch
        log.info("epoch %d/%d  train loss per row %.5f  (%.1f s)", epoch, epochs, loss, elapsed)
        # the artifact at most twice a second, and at the end: each update is a call to the Prefect
        # API (10-20 ms), as long as a whole epoch of a warm GPU run; made in the background (the last
        # one was on the flow's path: a warm GPU run's epochs all end within 0.13 s)
        if epoch == epochs or time.monotonic() - shown["at"] >= PROGRESS_EVERY_S:
            api_call_later(update_progress_artifact, shown["artifact"], progress=100.0 * epoch / epochs)
            shown["at"] = time.monotonic()

    topic = f"beatflow-train-{uuid.uuid4().hex[:12]}"
    out = _follow(topic, show, fit_model, embedded, folder, epochs, batch_size, seed, threads, recordings,
                  n_rows_sample, train_precision, compile, topic=topic, name="train-vae", started=started,
                  beat_window=beat_window)
    for event in out.pop("epochs_done"):  # any the events did not bring before the result
        show(event)
    return out


def engine_for(model_path: str, validation_path: str, threads: int, device: str = "cpu",
               backend: str = "auto", precision: str = "fp32") -> dict:
    """The validated inference engine for the trained model, from the engine cache or built and
    cached (a plain function, run on the home worker by :func:`build_engine`); the cache's warnings
    come back in ``warnings``."""
    import warnings

    from beatflow.engine.cache import EngineCacheWarning, build_or_load_engine

    t_start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EngineCacheWarning)
        _, info = build_or_load_engine(model_path, np.load(validation_path), backend=backend, precision=precision,
                                       device=device, threads=threads)
    for w in caught:  # the others as they would have been shown
        if not issubclass(w.category, EngineCacheWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {**info, "warnings": [str(w.message) for w in caught if issubclass(w.category, EngineCacheWarning)],
            "task_span": (t_start, time.time())}


def start_engine_warmup(width: int) -> bool:
    """On the GPU: the engine stage's one-time costs (:func:`beatflow.engine.cache.start_gpu_warmup`) started
    now on the home worker, where the engine is built, and not waited for. False where the cluster has no
    worker yet."""
    from beatflow.engine.cache import start_gpu_warmup
    from beatflow.pipeline.cluster import home_worker

    client = _client()
    home = home_worker(client)
    if home is None:
        return False
    client.run(start_gpu_warmup, int(width), workers=[home], wait=False)
    return True


@partition_task(name="build-engine")
def build_engine(model_path: str, validation_path: str, threads: int, device: str = "cpu",
                 backend: str = "auto", precision: str = "fp32") -> dict:
    """The validated inference engine (:func:`engine_for`, on the home worker, where the engines it
    loaded before stay warm)."""
    info = _follow(None, None, engine_for, model_path, validation_path, threads, device, backend, precision,
                   name="build-engine")
    log = get_run_logger()
    for msg in info.get("warnings", []):
        log.warning("%s", msg)
    log.info("engine %s %s on %s: %s, max abs err %.2e vs PyTorch, %.0f beats/s", info["backend"],
             info["precision"], info["device"], info["cache"], info["max_abs_err"], info["throughput_beats_per_s"])
    return info


def _event_sender(topic: str | None):
    """On a Dask worker, a function that sends a message on ``topic`` (a Dask event the flow's
    process subscribed to); elsewhere, or without a topic, one that drops it."""
    if topic:
        try:
            from distributed import get_worker

            worker = get_worker()
            return lambda msg: worker.log_event(topic, msg)
        except ValueError:  # not in a worker
            pass
    return lambda msg: None


def _follow(events: str | None, handle, fn, *args, name: str, started=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on the cluster's home worker (another if it is gone) and return its
    result; meanwhile hand each message it sends on the topic ``events`` to ``handle``, in this thread
    (``started()`` first, once the task is submitted: work that need not delay it)."""
    import queue

    from distributed import wait

    from beatflow.pipeline.cluster import home_worker

    client = _client()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    if events:
        client.subscribe_topic(events, lambda event: inbox.put(event[1]))
    try:
        home = home_worker(client)  # (None where the client's view of the workers is empty: anywhere)
        placement = {"workers": [home], "allow_other_workers": True} if home else {}
        future = client.submit(fn, *args, key=f"{name}-{uuid.uuid4().hex[:8]}", pure=False, **placement, **kwargs)
        if started is not None:
            started()
        while True:
            try:
                with client.as_current():  # (this thread has no default client)
                    wait([future], timeout=0.25)
                finished = True
            except TimeoutError:
                finished = False
            while handle is not None:
                try:
                    handle(inbox.get_nowait())
                except queue.Empty:
                    break
            if finished:
                return future.result()  # the task's own exception, if it failed
    finally:
        if events:
            client.unsubscribe_topic(events)


@functools.lru_cache(maxsize=4)
def _engine(path: str):
    from beatflow.engine.cache import load_engine

    return load_engine(path, threads=1)


def score_partition(embedded, dominant=None, tmpl=None, core=None, left=None, right=None, first: int = 0,
                    start=None, length=None, *, engine_path: str, scale: float, top: int = 0, pad: int = 0,
                    beat_window: tuple[float, int] | None = None):
    """Anomaly score, latent mean and class shape (:func:`beatflow.score.classes.features` from
    ``tmpl``, the class template of the partition's recording, with ``beat_window = (fs, pre)``; else None;
    with the stream, ``core`` and its halos, and the rows' ``start``, followed by the columns of each beat's
    P-wave window, :func:`beatflow.score.classes.pre_qrs`) of each kept beat of a partition, through the built engine; with ``top``, also the signal around the
    partition's ``top`` highest-scoring beats.

    The engine's input is :func:`beatflow.score.rule.model_input` of the rows, as in training: each row
    divided by the model's ``scale``, minus ``dominant``, the dominant beat of the partition's recording
    (the training's; None: the partition's own). With a GPU engine the rows stay on the device (handed
    over by pointer); only the scores and latent means come back to the host.

    The snippets (:func:`beatflow.embed.partitions.top_windows` of the rows' ``start`` and ``length``,
    widened by ``pad`` samples; cut from ``core`` and its halos) hold those of the whole stream's top
    beats that this partition owns. Cut here, the report's top anomalies need no second round trip
    to the partitions after the scores (a Prefect task and a Dask map: 0.066 s of a warm GPU run).
    """
    from beatflow.score.classes import features, pre_qrs
    from beatflow.score.rule import model_input

    rows, _ = embedded
    engine = _engine(engine_path)
    with device_memory(f"scoring {rows.shape[0]:,} beats", int(rows.nbytes), engine.on_gpu):
        dev = None
        if tmpl is not None and beat_window is not None:  # (on the rows' device, before they become the model's input)
            dev = to_host(features(rows, tmpl, *beat_window))
            if core is not None and start is not None:  # the P wave's window, cut from the stream and its halos
                xp = namespace(_device_of(core))
                x = P.extend(core, to_namespace(left, xp), to_namespace(right, xp))
                at = xp.asarray(np.asarray(to_host(start), np.int64) + int(beat_window[1]))
                win = to_host(pre_qrs(x, first - int(left.shape[0]), at, float(beat_window[0])))
                dev = np.concatenate([dev, win], axis=1)
        score, mu = engine.infer(model_input(rows if engine.on_gpu else to_host(rows), scale, dominant))
    score, mu = to_host(score), to_host(mu)
    if not top or core is None:
        return score, mu, dev
    return score, mu, dev, partition_snippets(core, left, right, first,
                                              P.top_windows(score, start, length, top, pad))


@task(name="write-report", cache_policy=NO_CACHE, persist_result=False)
def write_report(path: str, data, figures: dict | None = None, viewer: dict | None = None) -> str:
    """Render ``report.html`` (self-contained) from the small results (``figures``: PNGs already
    rendered while the flow went on, see ``beatflow.report.figures.render_figures``). ``viewer``: the
    stream viewer's request (the flow's ``_viewer_request``): its partitions' futures are gathered here,
    in this task, so that no stream data passes through a task's result."""
    from beatflow.report.html import write_report as render

    payload = None
    if viewer is not None:
        from beatflow.report.viewer import viewer_payload

        pieces = [(off + a, x) for off, got in zip(viewer["raw_offsets"], gather(viewer["raw"])) for a, x in got]
        payload = viewer_payload(viewer["total"], viewer["fs"], gather(viewer["levels"]), pieces, viewer["beats"],
                                 viewer["unreadable_s"], viewer["recording_names"], viewer["recording_starts"],
                                 viewer["top_starts"])
    render(path, data, figures, payload)
    return path

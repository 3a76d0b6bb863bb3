"""Command line: ``beatflow run`` (the flow), ``beatflow score`` (an inbox), ``beatflow serve`` (a standing
Prefect server and Dask cluster), ``beatflow evaluate`` (MIT-BIH), ``beatflow engine clean``.

The numeric modules of ``beatflow`` know nothing of Prefect or Dask; this entry point imports the
flows and the Dask plumbing (:mod:`beatflow.pipeline`) only when a command needs them, and never
Prefect or Dask themselves.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from contextlib import contextmanager

from beatflow.errors import InputError
from beatflow.io.channels import parse_lead
from beatflow.params import TRAIN_BEATS


@contextmanager
def _long_lived_imports():
    """Import what a command needs with the cyclic garbage collector paused, then move every object
    made so far out of its sight (:func:`gc.freeze`).

    Prefect, Dask, pandas and PyTorch leave about half a million objects that live as long as the
    process. Each full collection walks all of them to find no garbage: six during a ``beatflow run``
    start-up, the last one inside the flow (0.2 s of a 2 s warm flow), 0.5 s in all on a 2-core
    machine (``bench/cli_wall.py``). Collections of what the command makes afterwards go on as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="find abnormal heartbeats in an ECG (synthetic 20 h by default)")
    p.add_argument("--input", help="CSV (header + float rows), Parquet, .npy, WFDB, EDF/BDF, or a folder of WFDB "
                   "records or of EDF/BDF files")
    p.add_argument("--column", help="column of a CSV/Parquet file with several")
    p.add_argument("--fs", type=float, help="sampling rate in Hz of CSV/Parquet/npy input (default 250)")
    p.add_argument("--lead", type=parse_lead, default=0, metavar="N|LABEL",
                   help="WFDB or EDF channel: its index or its label, e.g. MLII (default 0)")
    p.add_argument("--confirm-lead", type=parse_lead, metavar="N|LABEL",
                   help="a second WFDB or EDF channel (index or label) that checks the first one's beats "
                        "(beatflow.detect.leads: flutter on either lead, weak peaks with no QRS on the second lead "
                        "are dropped, a noise peak beside a QRS of the second lead is moved to it)")
    p.add_argument("--confirm-column", metavar="NAME",
                   help="the same for CSV/Parquet input: the column of the second lead")
    p.add_argument("--hours", type=float, default=20.0, help="length of the synthetic ECG (default 20)")
    p.add_argument("--workers", type=int, default=None,
                   help="Dask workers (default: CPU cores, at least 2; with --scheduler: the cluster's)")
    p.add_argument("--partitions", type=int, default=None, help="partitions of the stream (default 2 per worker)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when CuPy sees one here (with --scheduler: when every worker has one)")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (tcp://host:port) to use; with "
                   "--device gpu its workers need the GPUs (and get RMM set up if they lack it), not this machine")
    _no_service_flag(p)
    p.add_argument("--gpus", help="GPUs for --device gpu, as CUDA_VISIBLE_DEVICES lists them (default: all)")
    p.add_argument("--rmm-pool-size", default=None,
                   help="RMM pool per GPU: a share (80%%, 0.8) or a size (40GB); default 80%%; with --scheduler, "
                        "for workers started without one")
    p.add_argument("--rmm-allocator", choices=("async", "pool"), default="async",
                   help="RMM's resource on each GPU: CUDA's stream-ordered pool (async: PyTorch can capture "
                        "CUDA graphs in it) or RMM's pool; default async")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic ECG and of the train/test split")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-beats", type=int, default=TRAIN_BEATS, metavar="N",
                   help=f"train on at most N beats, stratified by recording and over time; every beat is scored "
                        f"(default {TRAIN_BEATS:,}; 0: all)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--out", help="output folder (default runs/<timestamp>); must not exist or be empty")
    p.add_argument("--store", default=os.environ.get("BEATFLOW_STORE"),
                   help="register the trained model in this store for `beatflow score` (default $BEATFLOW_STORE)")
    p.add_argument("--engine", choices=("auto", "onnxruntime", "compiled", "aoti", "tensorrt"), default="auto",
                   help="inference engine backend (default: the best available)")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16", "int8"), default="fp32",
                   help="inference engine precision (fp16/bf16 on GPU, int8 on CPU)")
    p.add_argument("--train-precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="VAE training on a GPU: auto = the step kernel in fp32 where Numba's CUDA target runs "
                        "(else bf16 where supported, fp16 with a gradient scaler otherwise); fp32 (the kernel "
                        "where it runs); bf16/fp16: compiled steps in mixed precision (the CPU always trains in fp32)")
    p.add_argument("--train-compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the training step (auto: on a GPU; on the CPU from 200 000 rows x epochs, "
                        "where a compiled epoch is ~2x faster once compiled: the 20 h default run)")
    p.add_argument("--cache", default=None, metavar="DIR|off",
                   help="reuse the segmentation and the trained model of an unchanged input and options from this "
                        "folder (default $BEATFLOW_CACHE, else ~/.cache/beatflow/runs; off: none)")
    _verbose_flag(p)


def _verbose_flag(p) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Prefect's and Dask's logs on the terminal (by default they go to the run's log "
                        "file, in $BEATFLOW_LOG_DIR or ~/.local/state/beatflow/logs)")


def _no_service_flag(p) -> None:
    p.add_argument("--no-service", action="store_true", default=False,
                   help="start a Prefect server and Dask cluster of the command's own even when `beatflow serve` "
                        "runs (also: BEATFLOW_NO_SERVICE=1)")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="a standing Prefect server and Dask cluster that later runs use (faster starts)",
                       description="Start one Prefect server and one Dask cluster and keep them until Ctrl-C or "
                                   "SIGTERM; `beatflow run` and `beatflow score` use them while they are up.")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="the cluster's device: auto = the GPU when CuPy sees one here")
    p.add_argument("--workers", type=int, default=None, help="CPU workers (default: CPU cores, at least 2)")
    p.add_argument("--gpus", help="GPUs for --device gpu, as CUDA_VISIBLE_DEVICES lists them (default: all)")
    p.add_argument("--rmm-pool-size", default=None, help="RMM pool per GPU (80%%, 0.8, 40GB; default 80%%)")
    p.add_argument("--rmm-allocator", choices=("async", "pool"), default="async", help="RMM's resource on each GPU")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--detach", action="store_true",
                      help="run in the background (log in the data folder); return once it serves")
    what.add_argument("--status", action="store_true", help="say whether it runs and where (exit 0 if up, 3 if not)")
    what.add_argument("--stop", action="store_true", help="stop the running service (exit 3 if none runs)")
    _verbose_flag(p)


def cmd_serve(args) -> int:
    """``beatflow serve``: :mod:`beatflow.pipeline.service`. Its answers (where the service is, that
    it stopped) go to standard output; errors, as every command's, are one line on standard error."""
    from beatflow.pipeline import service
    from beatflow.terminal import RunLog

    def out(line: str) -> None:
        print(line, flush=True)

    _positive("workers", args.workers)
    if args.status:
        return service.status(out=out)
    if args.stop:
        return service.stop(out=out)
    opts = ["--device", args.device] + (["--workers", str(args.workers)] if args.workers else []) + \
        (["--gpus", args.gpus] if args.gpus else []) + \
        (["--rmm-pool-size", str(args.rmm_pool_size)] if args.rmm_pool_size is not None else []) + \
        ["--rmm-allocator", args.rmm_allocator]
    if args.detach:
        return service.start_detached(opts, out=out)
    service.check_unlocked()  # (a second service: one line, before a log is opened)

    def ready(state):
        out("beatflow serve: ready (Ctrl-C stops it)")
        for line in service.describe(state)[:2]:
            out("  " + line)

    with RunLog("serve", verbose=args.verbose) as log:
        with _long_lived_imports():
            import beatflow.pipeline.cluster  # noqa: F401  (Prefect and Dask)
        rc = service.serve(args.device, args.workers, args.rmm_pool_size, args.gpus, args.rmm_allocator, ready=ready)
        log.stop_status()
    out("beatflow serve: stopped")
    return rc


def _find_service(args, explicit_device: str | None = None):
    """The running ``beatflow serve`` this command uses (its state), or None: none runs or answers,
    ``--no-service`` / ``BEATFLOW_NO_SERVICE``, ``--scheduler`` given, a ``PREFECT_API_URL`` that is not
    the service's, or an explicit ``--device`` the service does not run (then the command's own
    cluster, with one line that says why)."""
    from beatflow.pipeline.service import find_service, service_disabled
    from beatflow.terminal import say

    if getattr(args, "no_service", False) or service_disabled() or getattr(args, "scheduler", None):
        return None
    state = find_service()
    if state is None:
        return None
    api = os.environ.get("PREFECT_API_URL")
    if api and api.rstrip("/") != state["api_url"].rstrip("/"):
        import logging

        logging.getLogger("beatflow").debug("PREFECT_API_URL is not the service's API: own cluster")
        return None
    if explicit_device not in (None, "auto", state["device"]):
        say(f"beatflow: the service at {state['scheduler']} runs on the {state['device']}; this --device "
            f"{explicit_device} run starts its own cluster")
        return None
    return state


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="score new recordings in an inbox with the latest trained model")
    p.add_argument("--inbox", required=True, help="folder of new CSV/Parquet/npy/EDF/BDF files or WFDB records")
    p.add_argument("--store", default=os.environ.get("BEATFLOW_STORE", ".beatflow"),
                   help="results store holding the trained model (default $BEATFLOW_STORE or .beatflow)")
    p.add_argument("--fs", type=float, help="sampling rate of CSV/Parquet/npy files (default 250)")
    p.add_argument("--lead", type=parse_lead, default=0, metavar="N|LABEL",
                   help="WFDB or EDF channel: its index or its label (default 0)")
    p.add_argument("--column", help="column of CSV/Parquet files with several")
    p.add_argument("--confirm-lead", type=parse_lead, metavar="N|LABEL",
                   help="a second WFDB or EDF channel that checks the beats (as beatflow run --confirm-lead)")
    p.add_argument("--confirm-column", metavar="NAME", help="the same for CSV/Parquet files: a second column")
    _no_service_flag(p)
    _verbose_flag(p)


def cmd_score(args) -> int:
    from beatflow.params import check_fs
    from beatflow.io.store import Store, list_inbox, release_claims
    from beatflow.terminal import RunLog, done_interrupt, on_interrupt, say

    if args.fs is not None and check_fs(args.fs):
        raise InputError(f"--fs {args.fs:g}: {check_fs(args.fs)}")
    list_inbox(args.inbox)  # the inbox and the store are checked before anything starts
    Store(args.store).latest_model()
    service = _find_service(args)
    with RunLog("score", verbose=args.verbose) as log:
        on_interrupt("claims", release_claims, at_once=True)  # an item being scored goes back to the inbox
        early = _early_api_server(service)
        try:
            with _long_lived_imports():
                from beatflow.pipeline.inbox_flow import score_new_recordings
                from beatflow.pipeline.cluster import prefect_api

            log.show_progress()
            with prefect_api(service["api_url"] if service else None, early=early):
                res = score_new_recordings(inbox=args.inbox, store=args.store, fs=args.fs, lead=args.lead,
                                           column=args.column, confirm_lead=args.confirm_lead,
                                           confirm_column=args.confirm_column)
        finally:
            if early is not None:
                early.stop()
        log.stop_status()
        done_interrupt("claims")
    for r in res["processed"]:
        print(f"{r['status']:9s} {r['item']}: {r['beats']} beats, {r['flagged']} flagged {r['reason']}".rstrip())
    failed = sum(r["status"] == "failed" for r in res["processed"])
    if failed:
        say(f"beatflow: {failed} of {len(res['processed'])} recording(s) failed (reasons in "
            f"{os.path.join(args.inbox, 'failed')}){log.where()}")
        return 1
    return 0


def _positive(name: str, v, allow_none=True) -> None:
    if v is None and allow_none:
        return
    if v is None or not v > 0:
        raise InputError(f"--{name} must be positive, got {v}")


#: the synthetic ECG's length bounds (hours): two minutes give the training its 64 beats
SYNTH_HOURS = (2 / 60, 10000.0)


def _check_run_args(args) -> None:
    """What ``beatflow run``'s options can be checked for before anything starts (one line each)."""
    import math

    from beatflow.params import check_fs

    for name in ("workers", "partitions", "epochs", "batch_size"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.train_beats < 0:
        raise InputError(f"--train-beats {args.train_beats}: must be 0 (all) or a positive number of beats")
    if args.fs is not None and check_fs(args.fs):
        raise InputError(f"--fs {args.fs:g}: {check_fs(args.fs)}")
    if not args.input:
        lo, hi = SYNTH_HOURS
        if not (math.isfinite(args.hours) and lo <= args.hours <= hi):
            raise InputError(f"--hours {args.hours:g}: the synthetic ECG's length must be between {lo:.3g} h "
                             f"(two minutes) and {hi:g} h")
    if args.seed < 0:
        raise InputError(f"--seed {args.seed}: the seed must be a non-negative integer")


def _check_out(out) -> None:
    """The output folder can be made here: it is no file, not under one, empty if it exists, and its
    nearest existing folder takes a new folder (tried: a permission check says yes to root in /proc)."""
    import tempfile
    from pathlib import Path

    final = Path(out)
    if final.exists() and not final.is_dir():
        raise InputError(f"--out {final}: exists and is not a folder")
    if final.is_dir():
        if any(final.iterdir()):
            raise InputError(f"{final}: output folder exists and is not empty")
        return
    parent = final.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"--out {final}: {parent} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".beatflow-probe-", dir=parent))
    except OSError as e:
        raise InputError(f"--out {final}: cannot create a folder in {parent} ({e.strerror})") from None


def _undo_out(final, existed: bool) -> None:
    """Remove what an interrupted run left at ``--out`` (an empty folder stays if the user made it)."""
    import shutil

    if final.is_dir():
        if existed:
            for child in final.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        else:
            shutil.rmtree(final, ignore_errors=True)


#: called with ``beatflow run``'s output folder once it is checked (a runner of ``beatflow serve`` tells its
#: client, which removes the run's partial folder if the runner is killed: beatflow.pipeline.handoff)
OUT_CHOSEN: list = []


def cmd_run(args) -> int:
    from beatflow.device import resolve_device
    from beatflow.errors import DeviceError
    from beatflow.io.sources import open_source

    from beatflow.pipeline.caching import run_cache

    _check_run_args(args)
    args.cache = run_cache(args.cache)
    service = _find_service(args, args.device)
    args.service = service
    if service is not None:  # as if --scheduler were given (the service knows its device)
        args.scheduler = service["scheduler"]
        if args.device == "auto":
            args.device = service["device"]
    # with --scheduler the GPUs are the workers' (checked there: beatflow.pipeline.cluster.GPUMemorySetup), not this machine's
    if args.scheduler and args.device != "cpu":
        from beatflow.pipeline.cluster import cluster_device

        device = "gpu" if args.device == "gpu" else cluster_device(args.scheduler)
    else:
        device = resolve_device(args.device)
    if device == "gpu":  # the flow's Dask client meets CuPy arrays' types (a no-op where CuPy was imported)
        from beatflow.device import import_in_background

        import_in_background("cupy")
    if device == "cpu":  # what the CPU cannot run is an input error now, not after training
        from beatflow.engine.options import resolve_backend  # (not beatflow.engine.cache: no PyTorch in this process)

        if args.train_precision in ("bf16", "fp16"):
            raise InputError(f"--train-precision {args.train_precision} is for GPUs; the CPU trains in fp32")
        try:
            resolve_backend(args.engine, args.precision, "cpu")
        except (ValueError, DeviceError) as e:
            raise InputError(f"--engine {args.engine} --precision {args.precision}: {e}") from None
    if args.input:  # check the input before starting anything
        from beatflow.io.sources import open_second_lead

        source = open_source(args.input, column=args.column, fs=args.fs, lead=args.lead)
        open_second_lead(source, args.input, args.fs, lead=args.lead, column=args.column,
                         confirm_lead=args.confirm_lead, confirm_column=args.confirm_column)
    elif args.confirm_lead is not None or args.confirm_column:
        raise InputError("--confirm-lead/--confirm-column need --input (the synthetic ECG has one lead)")
    from pathlib import Path

    from beatflow.terminal import RunLog

    final = Path(args.out) if args.out else _default_out()
    _check_out(final)
    for fn in OUT_CHOSEN:
        fn(final)
    with RunLog("run", verbose=args.verbose) as log:
        return _run_logged(args, device, final, log)


def _default_out():
    from datetime import datetime
    from pathlib import Path

    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _run_logged(args, device: str, final, log) -> int:
    """``beatflow run`` once its options and input are checked, with the run's log (:class:`RunLog`)."""
    from beatflow.terminal import on_interrupt

    existed = final.is_dir()
    on_interrupt("out", lambda: _undo_out(final, existed))
    service = getattr(args, "service", None)
    early = _early_api_server(service)
    try:
        return _run_started(args, device, final, log, service, early)
    finally:
        if early is not None:
            early.stop()


def _early_api_server(service):
    """The run's temporary Prefect API server, started now (beside the imports and the figure processes'
    start) where the run would start one: :mod:`beatflow.pipeline.api_server`."""
    if service is not None:
        return None
    from beatflow.pipeline import api_server

    return api_server.start_early() if api_server.wanted() else None


def _run_started(args, device: str, final, log, service, early) -> int:
    from rich.console import Console
    from rich.table import Table

    from beatflow.report.pool import figure_pool
    from beatflow.terminal import done_interrupt

    figure_pool()  # the report's figure processes start now, while Prefect, Dask and the flow are imported and set up
    from beatflow.device import import_in_background

    import_in_background("scipy.stats")  # (1 s on 2 cores; the classes' rule, in this process, after the scores)
    with _long_lived_imports():  # (the task runner's prefect_dask with the rest: beatflow.pipeline.cluster)
        from beatflow.pipeline.flow import ecg_anomaly_flow
        from beatflow.pipeline.cluster import make_task_runner, parse_pool_size, prefect_api

    if device == "gpu" and args.rmm_pool_size is not None:
        parse_pool_size(args.rmm_pool_size)  # a bad size is an input error, before anything starts
    if args.scheduler:
        workers = args.workers  # None: as many as the cluster has
    elif device == "gpu":
        from beatflow.device import gpu_count

        n_gpus = gpu_count(args.gpus)
        if args.workers and n_gpus and args.workers != n_gpus:
            raise InputError(f"--workers {args.workers}: --device gpu runs one worker per GPU ({n_gpus})")
        workers = n_gpus or 1
    else:
        workers = args.workers or max(2, os.cpu_count() or 2)

    log.show_progress()
    with prefect_api(service["api_url"] if service else None, early=early):
        runner = make_task_runner(device, workers, scheduler=args.scheduler, rmm_pool_size=args.rmm_pool_size,
                                  gpus=args.gpus, rmm_allocator=args.rmm_allocator)
        summary = ecg_anomaly_flow.with_options(task_runner=runner)(
            input=args.input, column=args.column, fs=args.fs, lead=args.lead, confirm_lead=args.confirm_lead,
            confirm_column=args.confirm_column, hours=args.hours, seed=args.seed,
            out=str(final), device=device, workers=workers, partitions=args.partitions, epochs=args.epochs,
            batch_size=args.batch_size, train_beats=args.train_beats, store=args.store, cache=args.cache,
            engine_backend=args.engine,
            precision=args.precision, train_precision=args.train_precision,
            train_compile=None if args.train_compile == "auto" else args.train_compile == "on",
            rmm_pool_size=args.rmm_pool_size, rmm_allocator=args.rmm_allocator, service=service is not None)
    done_interrupt("out")
    log.stop_status()
    args.summary = summary
    if getattr(args, "quiet", False):  # (beatflow.run: the caller gets the summary, not a table)
        return 0
    con = Console()
    t = Table(title="beatflow run", show_header=False)
    for k in ("samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "test_loss", "anomalies_flagged",
              "device", "workers"):
        v = summary[k]
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    cl = summary.get("classes")
    if cl:
        t.add_row("classes", "  ".join(f"{k} {v}" for k, v in cl["counts"].items() if k in "NSV"))
        t.add_row("V / S burden", f"{cl['v_burden_pct']:.2f} % / {cl['s_burden_pct']:.2f} %  (V couplets "
                  f"{cl['v_runs']['couplets']}, V runs {cl['v_runs']['runs']})")
    e = summary["engine"]
    t.add_row("engine", f"{e['backend']} {e['precision']}, max abs err {e['max_abs_err']:.1e}")
    sl = summary.get("second_lead")
    if sl:
        t.add_row("second lead", _second_lead_text(sl))
    if "truth" in summary:
        tr = summary["truth"]
        t.add_row("truth", f"Se {tr['se']:.4f}  PPV {tr['ppv']:.4f}  ROC-AUC {tr['auc']:.4f}")
        tc = tr.get("classes")
        if tc:
            t.add_row("truth classes", "  ".join(f"{c} Se {tc[c]['se']:.3f} +P {tc[c]['ppv']:.3f}" for c in "VS"
                                                 if tc.get(c) and tc[c]["n"]))
        tq = tr.get("quality")
        if tq and tq["episodes"]:
            t.add_row("truth unreadable", f"{tq['episodes_found']} of {tq['episodes']} episodes found, "
                      f"{tq['seconds_found']:.0f} s found of {tq['seconds_true']:.0f} s")
    t.add_row("total time", f"{summary['timings_s']['total']:.1f} s")
    t.add_row("outputs", summary["out"])
    con.print(t)
    con.print(f"open {os.path.join(summary['out'], 'report.html')}")
    if log.path:
        con.print(f"log  {log.path}", soft_wrap=True)
    return 0


def _second_lead_text(sl: dict) -> str:
    """``summary.json["second_lead"]`` in one line: which lead checked the beats and what it changed."""
    which = f"lead {sl['lead']}" if sl.get("lead") is not None else f"column {sl.get('column')}"
    return (f"{which}: {sl.get('doubtful_peaks_dropped', 0)} doubtful peak(s) dropped, "
            f"{sl.get('peaks_moved', 0)} moved to its QRS")


_EXIT_FREEZE = False


def main(argv=None) -> int:
    """Entry point of the ``beatflow`` command. As a command (``argv`` None), ``run`` and ``score`` are
    first offered to a ready runner of ``beatflow serve`` (:mod:`beatflow.pipeline.handoff`: no Prefect,
    Dask or flow imported here then)."""
    if argv is None:
        from beatflow.pipeline.handoff import try_handoff

        rc = try_handoff(sys.argv[1:])
        if rc is not None:
            return rc
    from beatflow.errors import BeatflowError
    from beatflow.terminal import Interrupts, say

    global _EXIT_FREEZE
    if not _EXIT_FREEZE:  # at the process's exit, after the handlers registered later (they run first),
        # the objects still alive are left to the operating system instead of being walked by the
        # interpreter's last full collection: 0.7 s after a flow had ended, on 2 cores (bench/cli_wall.py)
        atexit.register(gc.freeze)
        _EXIT_FREEZE = True

    parser = argparse.ArgumentParser(prog="beatflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _score_parser(sub)
    _serve_parser(sub)
    commands = {"run": cmd_run, "score": cmd_score, "serve": cmd_serve}
    with _long_lived_imports():
        for module in ("score.evaluate", "engine.options"):  # subcommands that live beside the code they drive
            try:
                mod = __import__(f"beatflow.{module}", fromlist=["register"])
            except ImportError:
                continue
            if hasattr(mod, "register"):
                commands.update(mod.register(sub))
    args = parser.parse_args(argv)
    with Interrupts() as interrupts:
        try:
            return commands[args.command](args)
        except BeatflowError as e:
            say(f"beatflow: error: {e}{_details()}")
            return 2
        except KeyboardInterrupt:
            interrupts.finish()  # (exits: 130, or 143 for SIGTERM)
        except Exception as e:  # a fault of beatflow's own: its traceback to the run's log, one line here
            import traceback

            if _details() == "":
                traceback.print_exc()
            say(f"beatflow: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                f"{_details() or ' (traceback above)'}")
            return 1
    return 1


def _details() -> str:
    from beatflow.terminal import current_log

    log = current_log()
    return log.where() if log is not None else ""


if __name__ == "__main__":
    sys.exit(main())

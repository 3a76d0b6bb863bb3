"""The report's figure processes: a pool of spawned processes that draw the figures (and run the
truth check) while the flow goes on, kept from run to run in a process.

A light module (the standard library; the processes import :mod:`beatflow.report.figures` and what their
jobs name, no Prefect, no Dask), so that ``beatflow run`` starts the pool before it imports Prefect, Dask and
the flow: the processes' start (1-1.5 s each, spawned) then overlaps all of that.
"""

from __future__ import annotations

import atexit
import os
import threading
import time


class FigurePool:
    """The report's figures, drawn in processes of their own while the flow goes on.

    Matplotlib holds the GIL while it lays out and rasterizes, so threads of the flow's process
    draw one figure at a time (the seven took ~3 s in the report stage, the largest stage of a warm
    GPU flow). The processes are spawned (the flow's process has Dask and Prefect threads: no fork)
    and import Matplotlib at once, so they are ready by the time the first figures can be drawn
    (:func:`figure_pool`: one pool per process, kept from run to run); each figure is one job. A
    figure whose job fails (or a pool that cannot start) is simply not handed on: the report task
    draws it itself.
    """

    def __init__(self, processes: int | None = None):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        n = processes or figure_processes(os.cpu_count() or 1)
        try:
            self.pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_process)
            for _ in range(n):  # every process starts now (one per job while none is idle)
                self.pool.submit(int)
            if (os.cpu_count() or 1) < 2 * n:  # (a small machine: see _lower_priority)
                _lower_priority(getattr(self.pool, "_processes", None) or {})
        except Exception:  # no processes here: the report task draws everything
            self.pool = None

    def submit(self, fn, *args):
        """``fn(*args)`` in one of the processes (a future); in this thread, done, when there are none.
        Its :meth:`result` gives the value."""
        from concurrent.futures import Future

        if self.pool is not None:
            try:
                future = self.pool.submit(fn, *args)
                future.job = (fn, args)
                return future
            except Exception:  # a broken pool
                pass
        done = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done

    @staticmethod
    def result(future):
        """The value of a :meth:`submit` job; where its process died (a broken pool) or the job was
        cancelled, the job run again in this thread (an error of the job's own is raised again there)."""
        from concurrent.futures import CancelledError
        from concurrent.futures.process import BrokenProcessPool

        try:
            return future.result()
        except (BrokenProcessPool, CancelledError):
            if not hasattr(future, "job"):
                raise
            fn, args = future.job
            return fn(*args)

    def draw(self, data, names) -> dict:
        """Futures of the named figures (``beatflow.report.figures.FIGURES``), one job each."""
        from beatflow.report.figures import render_figures_timed

        if self.pool is None:
            return {}
        out = {}
        try:
            for name in names:
                submitted = time.time()
                out[name] = self.pool.submit(render_figures_timed, data, (name,))
                out[name].submitted = submitted
        except Exception:  # a broken pool
            return {}
        return out

    @staticmethod
    def collect(futures: dict) -> dict:
        """The PNGs of the figures that were drawn (the others are left to the report task)."""
        out = {}
        for f in futures.values():
            try:
                out.update(f.result()[0])
            except Exception:
                pass
        return out

    @staticmethod
    def timings(futures: dict) -> dict:
        """Per figure drawn (:meth:`collect` waited for them): seconds from its submission until a process
        took it (``queued``) and of its drawing there (``draw``); wall clocks of one host."""
        out = {}
        for name, f in futures.items():
            try:
                start, end = f.result(timeout=0)[1]
                out[name] = {"queued": round(max(0.0, start - f.submitted), 4), "draw": round(end - start, 4)}
            except Exception:  # not drawn there
                pass
        return out

    def broken(self) -> bool:
        """Whether the pool can take no more jobs (one of its processes died, or it was closed)."""
        return self.pool is None or bool(getattr(self.pool, "_broken", False)) or \
            bool(getattr(self.pool, "_shutdown_thread", False))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


#: the most figure jobs of one run that can be drawing at once: the 2 drawn once the model is trained
#: (aligned beats, training curves) and the 6 once the scores are known (stream, scores, the latent
#: space's two, the top anomalies' two halves); the beat lengths' and the truth matching are over by then
CONCURRENT_FIGURES = 8


def figure_processes(cores: int) -> int:
    """How many figure processes a host of ``cores`` gets: :data:`CONCURRENT_FIGURES` where it has at least
    twice that many cores (no figure then waits for a process: on a 16-core GPU host, 4 processes
    left the latent space's figure queued behind the early ones), else 4, never more than its cores."""
    cores = max(1, int(cores))
    return CONCURRENT_FIGURES if cores >= 2 * CONCURRENT_FIGURES else min(4, cores)


def _start_process() -> None:
    """A figure process's start: Ctrl-C is the command's to handle (:mod:`beatflow.terminal`), then
    Matplotlib warmed up (:func:`beatflow.report.figures.warm_up`)."""
    from beatflow.report.figures import warm_up
    from beatflow.terminal import ignore_interrupts_in_child

    ignore_interrupts_in_child()
    warm_up()


_POOL: FigurePool | None = None
_POOL_LOCK = threading.Lock()


def figure_pool() -> FigurePool:
    """This process's :class:`FigurePool`, started on first use and kept for its later flow runs (a
    pool broken by a process that died is replaced).

    Its processes take 1-1.5 s to start and import Matplotlib; a pool started with each run was not
    ready when a warm GPU run (1.3-1.9 s in all) first needed it, and the truth check and the figures
    waited for it (0.25 s and 0.26-0.30 s of the H200's warm runs). ``beatflow run`` starts it before
    Prefect sets the flow run up; a process that serves many runs (a deployment) starts it once.
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.broken():
            if _POOL is not None:
                _POOL.close()
            _POOL = FigurePool()
            atexit.register(_POOL.close)
        return _POOL


def _lower_priority(processes: dict) -> None:
    """Run the figure processes at a lower priority than the flow's workers: while they start
    (imports, seconds of CPU each) they would otherwise slow the stages on a small machine (training
    took 2x as long beside them on 2 cores). Not where the host has twice as many cores as processes:
    there they slowed nothing, and at the lower priority a fresh pool was not always ready by the time
    a warm GPU run's figures came (the H200 host, `beatflow run` after `beatflow run`: figures queued
    0.1-0.23 s for a process in the slower runs, against 1-10 ms in the others)."""
    for pid in list(processes):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 10)
        except (AttributeError, OSError):  # not on this platform, or already gone
            pass

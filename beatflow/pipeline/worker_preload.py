"""Preloaded by each worker of the flow's own Dask cluster (the clusters' ``preload`` option:
:data:`beatflow.pipeline.cluster.WORKER_PRELOAD`).

A worker process imports PyTorch, Prefect, pandas and ONNX Runtime for the stages; when the run's
cluster closes, each worker's interpreter then walked its half a million objects in a last full
garbage collection before it could exit, and the flow's run waited for it: closing two workers took
0.8 s against 0.1 s for workers that had imported nothing (2 cores). At exit the worker now leaves
them to the operating system (:func:`gc.freeze` after the exit handlers registered later), as the
``beatflow`` command does for its own process.

A Ctrl-C at the terminal reaches the workers too (they share the command's process group); the
command stops them itself (:mod:`beatflow.terminal`), so they ignore it instead of dying with
tracebacks of their own.
"""
from __future__ import annotations

import atexit
import gc


def dask_setup(worker) -> None:  # noqa: ARG001  (Dask's preload hook)
    from beatflow.terminal import ignore_interrupts_in_child

    atexit.register(gc.freeze)
    ignore_interrupts_in_child()

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


#: the modules a CPU worker starts importing at once, in a thread (:data:`WARM_IMPORTS_VAR`)
WARM_IMPORTS_VAR = "BEATFLOW_WORKER_IMPORTS"
#: set (to 1) in the workers' environment by the flow's own clusters: a closing worker ends its process at once
FAST_EXIT_VAR = "BEATFLOW_WORKER_FAST_EXIT"


def dask_setup(worker) -> None:  # noqa: ARG001  (Dask's preload hook)
    import os

    from beatflow.terminal import ignore_interrupts_in_child

    atexit.register(gc.freeze)
    ignore_interrupts_in_child()
    # PyTorch and the engine's module (1.3 s of a 2-core worker) while the first stages run, not when the
    # engine stage reaches the worker: a run whose training is a cache hit waited for them there
    # (beatflow.pipeline.cluster.cluster_spec names them for CPU workers; a GPU worker's PyTorch must
    # come after its RMM set-up)
    from beatflow.device import import_in_background

    for name in filter(None, os.environ.get(WARM_IMPORTS_VAR, "").split(",")):
        import_in_background(name)


def dask_teardown(worker) -> None:  # noqa: ARG001  (Dask's preload hook: the worker is closing)
    """With :data:`FAST_EXIT_VAR` set, end the worker's process now.

    Dask calls this once the worker has told its nanny and scheduler that it closes and has removed its
    plugins; what is left of its close is its comms and thread pools, then the interpreter's exit. A GPU
    worker's exit (CUDA's and PyTorch's teardown, Inductor's compile processes) outlasted the nanny's 4 s,
    so every run's close waited 4 s and ended in a kill ("Worker process still alive after 4.0 seconds,
    killing"). The flow's outputs are written by then, and a worker keeps nothing a later run could use.
    """
    import os
    import sys

    if os.environ.get(FAST_EXIT_VAR) != "1":
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)

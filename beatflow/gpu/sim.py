"""Numba's CUDA simulator as the kernels' test bed: its detection, and stand-ins for what it lacks.

With ``NUMBA_ENABLE_CUDASIM=1`` (set before Numba is imported) the kernels run on the CPU on NumPy
arrays, so CI (no GPU, no CuPy) tests them. The simulator runs each CUDA thread as a Python thread
and has no warp shuffles. Here a barrier is a ``threading.Barrier`` per block (the simulator's own
``syncthreads`` polls, ~20 ms a call on a busy machine; this is ~1 ms), and a shuffle is an exchange
through a per-block buffer between two barriers. A shuffle is a warp operation, so kernels that
shuffle run one-warp blocks there.

While a kernel runs, the simulator puts the launch's own ``cuda`` object in place of the ``cuda``
global of the kernel's module; that object is how a stand-in finds the launch, the block and the
thread. So each module of kernels gets stand-ins of its own (:func:`stand_ins`), reading its own
``cuda`` global (:func:`beatflow.gpu.runtime.bind` sets them up).
"""
from __future__ import annotations

import sys
import threading
import weakref

import numpy as np

#: lanes of a warp
WARP = 32


def simulator_active() -> bool:
    """Whether ``numba.cuda`` is the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before Numba's import)."""
    try:
        from numba import cuda as c
    except Exception:
        return False
    return c.is_available.__module__.endswith("simulator_init")


_lock = threading.Lock()
_blocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # launch -> {block: state}


def stand_ins(g: dict) -> dict:
    """The simulator's barrier and warp shuffles for the kernels of the module whose globals are
    ``g``: ``_shfl_idx``, ``_shfl_down``, ``_shfl_xor``, ``_syncthreads`` and ``_syncwarp`` (a
    barrier of the block: kernels that shuffle run one-warp blocks there), as the kernels call
    them. Each reads ``g["cuda"]``, the launch's object while a kernel of that module runs."""

    def block_state():
        cuda = g["cuda"]  # the simulator's per-launch module object, swapped in while a kernel runs
        launch = cuda
        block = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z)
        with _lock:
            per_launch = _blocks.setdefault(launch, {})
            state = per_launch.get(block)
            if state is None:
                d = cuda.blockDim
                state = per_launch[block] = (threading.Barrier(d.x * d.y * d.z), [None] * WARP)
        return state

    def syncthreads():
        block_state()[0].wait(timeout=120)  # a thread that failed breaks it instead of hanging the rest

    def exchange(value, src_lane):
        barrier, buf = block_state()
        lane = g["cuda"].threadIdx.x % WARP
        buf[lane] = value
        barrier.wait(timeout=120)
        out = buf[src_lane]
        barrier.wait(timeout=120)
        return out

    def shfl_idx(mask, value, src_lane):
        return exchange(value, src_lane)

    def shfl_down(mask, value, delta):
        lane = g["cuda"].threadIdx.x % WARP
        return exchange(value, lane + delta if lane + delta < WARP else lane)

    def shfl_xor(mask, value, lane_mask):
        return exchange(value, (g["cuda"].threadIdx.x % WARP) ^ lane_mask)

    return {"_shfl_idx": shfl_idx, "_shfl_down": shfl_down, "_shfl_xor": shfl_xor, "_syncthreads": syncthreads,
            "_syncwarp": syncthreads}


def lock_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` thread-safe.

    It finds a block's array by the calling line in a dict, and creates it on the first call
    without a lock: threads of a launch's first block that call it at the same time can each get an
    array of their own, so "shared" writes are lost (seen as a tile whose candidate count stayed 0,
    a rare failure of the kernel tests under the simulator). Same lookup, under a lock."""
    import traceback

    try:
        from numba.core import types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support

        shared = kernelapi.FakeCUDAShared
        if not hasattr(shared(0), "_allocations"):
            return
    except Exception:  # another simulator layout: leave it as it is
        return
    if getattr(shared.array, "_beatflow_locked", False):
        return
    orig = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one preallocated buffer, no race
            return orig(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2]  # (file, line) as the original
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array._beatflow_locked = True
    shared.array = array

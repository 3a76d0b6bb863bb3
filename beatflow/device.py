"""The one place that decides NumPy or CuPy and moves arrays between host and device.

Everything numeric in beatflow is written against an array namespace ``xp`` (NumPy or CuPy);
functions find it from their input with :func:`namespace_of`, so results stay where the input is.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import threading

import numpy as np

from beatflow.errors import DeviceError


def cupy_available() -> bool:
    """Whether CuPy is importable and sees at least one CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


_BACKGROUND_IMPORTS: dict = {}
_BACKGROUND_LOCK = threading.Lock()


def import_in_background(name: str):
    """Start importing module ``name`` in a daemon thread, once per process; the thread, or None when
    the module is imported already. An import that fails is left to fail where the module is used.

    The flow's process of a GPU run never uses CuPy itself, but its Dask client unpickles the type of
    every result a worker holds, so the first CuPy array (the load's partitions) imported CuPy there:
    in warm flows the load's return took 0.18-0.21 s after the last read's end on the GPU worker,
    against 1.2 ms in a process that had imported CuPy (H100, ``bench/results/flow.md``, CuPy import).
    Started before the flow run is set up, the import overlaps that set-up.
    """
    if name in sys.modules:
        return None
    with _BACKGROUND_LOCK:
        thread = _BACKGROUND_IMPORTS.get(name)
        if thread is None:
            thread = threading.Thread(target=_import_quietly, args=(name,), name=f"import-{name}", daemon=True)
            _BACKGROUND_IMPORTS[name] = thread
            thread.start()
    return thread


def _import_quietly(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # (not installed, no driver: said where it is used)
        pass


def gpu_count(gpus: str | None = None) -> int:
    """GPUs a run will use: those listed in ``gpus`` (``"0,1"``), else in ``CUDA_VISIBLE_DEVICES``,
    else all that CuPy sees (0 without CuPy or a device)."""
    listed = gpus if gpus is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return len([g for g in listed.split(",") if g.strip()])
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def resolve_device(device: str) -> str:
    """Turn ``auto|cpu|gpu`` into ``cpu`` or ``gpu``: the one meaning of ``auto`` in beatflow (a
    caller that takes ``auto``, for the flow's device or the engines', resolves it here).

    Parameters
    ----------
    device : str
        ``"auto"`` picks the GPU when CuPy is importable and sees a CUDA device
        (:func:`cupy_available`), else the CPU; ``"cpu"`` is always the CPU; ``"gpu"`` the GPU.

    Returns
    -------
    str
        ``"cpu"`` or ``"gpu"``.

    Raises
    ------
    DeviceError
        ``device="gpu"`` without CuPy or without a CUDA device.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise DeviceError(f"unknown device {device!r}: use auto, cpu or gpu")
    if device == "cpu":
        return "cpu"
    ok = cupy_available()
    if device == "gpu" and not ok:
        raise DeviceError("--device gpu: no CUDA device or CuPy is not installed (pip install 'beatflow[gpu]')")
    return "gpu" if ok else "cpu"


def namespace(device: str):
    """The array module for a resolved device (``numpy`` or ``cupy``)."""
    if device == "gpu":
        import cupy

        return cupy
    return np


def is_device_array(x) -> bool:
    """True for arrays living in GPU memory (CuPy, or anything with ``__cuda_array_interface__``)."""
    return hasattr(x, "__cuda_array_interface__")


def namespace_of(x):
    """The array module of ``x``: ``cupy`` for device arrays, ``numpy`` otherwise."""
    if is_device_array(x):
        import cupy

        return cupy
    return np


#: bytes copied from a device to the host by this process (see :func:`transfer_stats`)
_D2H_BYTES = [0]
#: the run this process counts for, and its device-to-host count when that run began here (a Dask
#: worker of a long-lived cluster serves run after run: each run reports its own bytes and peak)
_RUN = {"id": None, "d2h_base": 0, "pushed": False}


def to_host(x) -> np.ndarray:
    """A NumPy array with the contents of ``x`` (a no-op for NumPy input).

    Every device-to-host copy of beatflow goes through here and is counted.
    """
    if is_device_array(x):
        import cupy

        out = cupy.asnumpy(x)
        _D2H_BYTES[0] += out.nbytes
        return out
    if hasattr(x, "is_cuda") and x.is_cuda:  # a torch tensor on the GPU
        out = x.detach().cpu().numpy()
        _D2H_BYTES[0] += out.nbytes
        return out
    return np.asarray(x)


def begin_run(run_id) -> None:
    """Count device-to-host bytes and the RMM pool's peak from here on for run ``run_id`` (once per
    run and process: later calls for the same run change nothing)."""
    if run_id is None or _RUN["id"] == run_id:
        return
    _RUN.update(id=run_id, d2h_base=_D2H_BYTES[0])
    try:
        import rmm

        from beatflow.gpu.arena import resource_chain

        mr = next((m for m in resource_chain() if isinstance(m, rmm.mr.StatisticsResourceAdaptor)), None)
        if mr is not None and hasattr(mr, "push_counters"):
            if _RUN["pushed"]:
                mr.pop_counters()
            mr.push_counters()  # a fresh frame: its peak is this run's
            _RUN["pushed"] = True
    except Exception:  # no RMM here (CPU worker), or one without counter frames: the peak is since the start
        pass


def transfer_stats(run_id=None) -> dict:
    """Device-to-host bytes of this process and, on a GPU worker, the RMM pool's use; for run
    ``run_id`` only when :func:`begin_run` started counting for it here."""
    base = _RUN["d2h_base"] if run_id is not None and _RUN["id"] == run_id else 0
    out = {"d2h_bytes": int(_D2H_BYTES[0] - base)}
    try:
        import rmm

        from beatflow.gpu.arena import resource_chain

        for mr in resource_chain():
            if isinstance(mr, rmm.mr.StatisticsResourceAdaptor) and "rmm_peak_bytes" not in out:
                counts = mr.allocation_counts  # a Statistics object (a dict in older RMM)
                get = (lambda k: counts[k]) if isinstance(counts, dict) else (lambda k: getattr(counts, k))
                out["rmm_peak_bytes"] = int(get("peak_bytes"))
                out["rmm_current_bytes"] = int(get("current_bytes"))
            if isinstance(mr, rmm.mr.PoolMemoryResource):
                out["rmm_pool_bytes"] = int(mr.pool_size())
                out["rmm_resource"] = "pool"
            if isinstance(mr, rmm.mr.CudaAsyncMemoryResource):  # its reserve: dask-cuda's setting
                out["rmm_resource"] = "async"
                size = _rmm_setup_pool_size()
                if size:
                    out["rmm_pool_bytes"] = size
    except Exception:  # no rmm on CPU workers
        pass
    mm = _numba_memory_manager()
    if mm:
        out["numba_memory_manager"] = mm
    return out


def _numba_memory_manager():
    """Class name of the memory manager of Numba's CUDA context in this process (``RMMNumbaManager``
    when Numba allocates from RMM), if Numba has a real CUDA context here; else None."""
    import sys

    if "numba.cuda" not in sys.modules:
        return None
    try:
        from numba import cuda

        from beatflow.gpu.sim import simulator_active

        if simulator_active() or not cuda.is_available():
            return None
        return type(cuda.current_context().memory_manager).__name__
    except Exception:
        return None


def _rmm_setup_pool_size():
    """The pool reserved on this worker's GPU, from ``BEATFLOW_RMM_POOL_SIZE`` (set for the flow's GPU
    workers: a share of the device like ``0.8``, or bytes / a size like ``40GB``); None if unset."""
    value = os.environ.get("BEATFLOW_RMM_POOL_SIZE")
    if not value:
        return None
    try:
        share = float(value) <= 1.0
    except ValueError:  # a size with a unit
        share = False
    if not share:
        return _pool_bytes(value, 0)
    import cupy

    return _pool_bytes(value, int(cupy.cuda.Device().mem_info[1]))


def _pool_bytes(value, total: int) -> int:
    """An RMM pool size (a share of the device like ``0.8``, or bytes: sizes with units like ``"40GB"``
    are turned into bytes by :func:`beatflow.pipeline.cluster.parse_pool_size`) in bytes of a device of
    ``total`` bytes, rounded down to RMM's 256-byte alignment."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise DeviceError(f"RMM pool size {value!r}: a share of the GPU (0.8) or bytes") from None
    n = int(v * total) if v <= 1.0 else int(v)
    return n - n % 256


def setup_gpu_memory(pool_size=0.8, allocator: str = "async") -> dict:
    """Make this process's GPU allocate from one RMM pool, for CuPy, Numba and PyTorch alike.

    What a worker already has is kept (dask-cuda's workers come with their pool and CuPy/PyTorch
    allocators); what it lacks is set up: a plain ``dask worker`` on a GPU node, or a ``dask cuda
    worker`` started without ``--rmm-pool-size``, gets a pool of ``pool_size`` (``allocator``
    ``"async"``: CUDA's stream-ordered pool, or ``"pool"``: RMM's own), limited to that size (a
    partition that does not fit is a clear error: :func:`device_memory`), and the three libraries
    are pointed at it. Idempotent. Run on every GPU worker by :class:`beatflow.pipeline.cluster.GPUMemorySetup`.

    Returns
    -------
    dict
        :func:`gpu_memory_state` after the setup, plus ``pool_created`` (whether this call made the pool).

    Raises
    ------
    DeviceError
        No CuPy, no CUDA device, no RMM, or a pool that does not fit the device (one line, with the sizes).
    """
    if allocator not in ("async", "pool"):
        raise DeviceError(f"RMM allocator {allocator!r} is not one of async, pool")
    if not cupy_available():
        raise DeviceError("no CUDA device, or CuPy is not installed here (pip install 'beatflow[gpu]')")
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError:
        raise DeviceError("RMM is not installed here (pip install 'beatflow[gpu]')") from None
    import cupy

    from beatflow.gpu.arena import resource_chain

    created = False
    if not any(isinstance(m, (rmm.mr.CudaAsyncMemoryResource, rmm.mr.PoolMemoryResource)) for m in resource_chain()):
        free, total = (int(v) for v in cupy.cuda.runtime.memGetInfo())
        size = _pool_bytes(pool_size, total)
        try:
            if size > free:
                raise MemoryError(f"{size} > {free} bytes free")
            if allocator == "async":
                mr = rmm.mr.CudaAsyncMemoryResource(initial_pool_size=size)
            else:
                mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=size)
            mr = rmm.mr.LimitingResourceAdaptor(mr, allocation_limit=size)  # the pool is the worker's budget
        except Exception as e:
            raise DeviceError(f"cannot reserve an RMM pool of {size / 1e9:.2f} GB on a GPU with {free / 1e9:.2f} of "
                              f"{total / 1e9:.2f} GB free ({type(e).__name__}): lower --rmm-pool-size") from None
        rmm.mr.set_current_device_resource(mr)
        os.environ["BEATFLOW_RMM_POOL_SIZE"] = str(size)  # what transfer_stats reports as the pool
        created = True
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        import torch
        from rmm.allocators.torch import rmm_torch_allocator

        if torch.cuda.memory.get_allocator_backend() != "pluggable":
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    except ImportError:
        pass
    except RuntimeError:  # PyTorch allocated on this GPU before: its own allocator stays (reported)
        pass
    try:
        from numba import cuda
        from rmm.allocators.numba import RMMNumbaManager

        cuda.set_memory_manager(RMMNumbaManager)  # for the context Numba creates next (none yet on a fresh worker)
    except ImportError:
        pass
    return {**gpu_memory_state(), "pool_created": created}


def pool_limit() -> tuple[int | None, int | None]:
    """``(limit, in use)`` bytes of this process's RMM pool where it has a limit (a
    ``LimitingResourceAdaptor``: the flow's GPU workers have one of ``--rmm-pool-size``), else ``(None, None)``."""
    try:
        import rmm
    except ImportError:
        return None, None
    from beatflow.gpu.arena import resource_chain

    for mr in resource_chain():
        if isinstance(mr, rmm.mr.LimitingResourceAdaptor):
            return int(mr.get_allocation_limit()), int(mr.get_allocated_bytes())
    return None, None


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a failed device allocation (RMM's ``MemoryError``, CuPy's and PyTorch's
    ``OutOfMemoryError``, or a CUDA "out of memory" error)."""
    if isinstance(e, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__):
        return True
    text = str(e).lower()
    return "out of memory" in text or "out_of_memory" in text


@contextlib.contextmanager
def switch_interval(seconds):
    """The interpreter's thread switch interval at most ``seconds`` inside (None: unchanged), restored after.

    A thread that lets go of the interpreter's lock often (each PyTorch call, each barrier of the CUDA
    simulator's lanes) waits up to the interval, 5 ms by default, to take it back while another thread
    wants it."""
    old = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(min(old, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@contextlib.contextmanager
def device_memory(what: str, nbytes: int, gpu: bool = True):
    """Turn a failed device allocation inside into a :class:`DeviceError` naming the sizes: ``what``
    (e.g. "partition 3 (4 500 000 samples)") and its ``nbytes``, against the worker's pool limit and
    use (or the GPU's free memory), with what to change. Other errors pass unchanged, and all of
    them when the work is not on a GPU (``gpu=False``)."""
    try:
        yield
    except Exception as e:
        if not gpu or not is_out_of_memory(e):
            raise
        limit, used = pool_limit()
        if limit is not None:
            where = f"this worker's RMM pool (limit {limit / 1e9:.2f} GB, {used / 1e9:.2f} GB in use)"
        else:
            try:
                import cupy

                free, total = cupy.cuda.runtime.memGetInfo()
                where = f"this GPU ({free / 1e9:.2f} of {total / 1e9:.2f} GB free)"
            except Exception:
                where = "this GPU"
        raise DeviceError(f"{what} needs {nbytes / 1e6:.1f} MB on the GPU, more than {where} can give: raise "
                          "--rmm-pool-size or cut the stream into more --partitions") from None


def gpu_memory_state() -> dict:
    """Who allocates on this process's GPU: the RMM resources (outermost first), CuPy's allocator,
    PyTorch's allocator backend (``pluggable`` is RMM's) and Numba's memory manager (creating
    Numba's context if there is none)."""
    import sys

    from beatflow.gpu.arena import resource_chain

    out = {"rmm_resources": [type(m).__name__ for m in resource_chain()]}
    if "cupy" in sys.modules:
        alloc = sys.modules["cupy"].cuda.get_allocator()
        out["cupy_allocator"] = getattr(alloc, "__name__", type(alloc).__name__)
    if "torch" in sys.modules:
        out["torch_allocator"] = sys.modules["torch"].cuda.memory.get_allocator_backend()
    try:
        from numba import cuda

        out["numba_memory_manager"] = type(cuda.current_context().memory_manager).__name__
    except Exception:
        pass
    return out


def track_rmm_statistics(run_id=None) -> bool:
    """Wrap the current RMM resource (the worker's pool) in a statistics adaptor (peak use), put a
    :class:`~beatflow.gpu.arena.CaptureArena` in front of it, and count for run ``run_id`` from
    here on (:func:`begin_run`)."""
    try:
        import rmm
    except ImportError:
        begin_run(run_id)
        return False
    from beatflow.gpu import arena as capture_arena
    if not any(isinstance(m, rmm.mr.StatisticsResourceAdaptor) for m in capture_arena.resource_chain()):
        rmm.mr.set_current_device_resource(rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource()))
    capture_arena.install()  # in front: memory for captures of compiled steps (beatflow.gpu.arena)
    begin_run(run_id)
    return True


def to_namespace(x, xp):
    """``x`` as an array of module ``xp`` (one host-to-device copy when ``xp`` is CuPy)."""
    if xp is np:
        return to_host(x)
    return xp.asarray(x)


@functools.lru_cache(maxsize=None)
def scipy_for(xp):
    """``(signal, ndimage)`` modules of SciPy for NumPy, of ``cupyx.scipy`` for CuPy."""
    if xp is np:
        import scipy.ndimage as ndimage
        import scipy.signal as signal
    else:
        import cupyx.scipy.ndimage as ndimage
        import cupyx.scipy.signal as signal
    return signal, ndimage

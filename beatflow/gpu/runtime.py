"""What the CUDA kernels of beatflow (Numba CUDA) share: Numba's import, the names a module of
kernels is built with, and the launches (:class:`Ctx`, :class:`Workspace`, :class:`FastLaunch`).

The kernels live with their algorithms: :mod:`beatflow.detect.gpu_kernels` and
:mod:`beatflow.detect.gpu_vf` (detection and the flutter rule, driven by :mod:`beatflow.detect.gpu`)
and :mod:`beatflow.embed.gpu` (beat rows). Each module defines its kernels on first use, in a
cached build function that first calls :func:`bind` on its own globals.

Zero copy
    CuPy arrays go to the kernels as views (``cuda.as_cuda_array`` over their
    ``__cuda_array_interface__``, no host round trip, no device copy), outputs are allocated with
    CuPy, and the kernels are launched on CuPy's current stream so that they are ordered with the
    CuPy work around them (no extra synchronisation). A call may fork side streams of the calling
    thread (:meth:`Ctx.fork`) and join them back with events; every array they use stays
    referenced until its synchronisation.

Simulator
    With ``NUMBA_ENABLE_CUDASIM=1`` (set before Numba is imported) the same kernels run on the CPU
    on NumPy arrays (:mod:`beatflow.gpu.sim`).

Numba is imported lazily, on the first call (as STUMPY's gpu modules do): importing these modules
costs nothing, and without a CUDA GPU and without the simulator the wrappers raise
:class:`~beatflow.errors.DeviceError`.
"""
from __future__ import annotations

import functools
import os
import struct as _struct
import threading

import numpy as np

from beatflow.device import switch_interval
from beatflow.errors import DeviceError
from beatflow.gpu.sim import WARP, lock_shared_arrays, simulator_active, stand_ins

__all__ = ["WARP", "FULL_MASK", "SHARED_BYTES", "SIM_MAX_BLOCKS", "numba_cuda", "bind", "warp_intrinsics",
           "jit_kernel", "maxreg", "is_device", "Ctx", "Workspace", "FastLaunch", "ctx_for", "vector_call",
           "simulator_active", "lock_shared_arrays"]

FULL_MASK = 0xFFFFFFFF
#: static shared memory of a block
SHARED_BYTES = 48 * 1024
#: the simulator runs one Python thread per CUDA thread: few blocks, grid-stride loops do the rest
SIM_MAX_BLOCKS = 4

cuda = None  # numba.cuda, set by numba_cuda()


@functools.lru_cache(maxsize=None)
def numba_cuda():
    """Import Numba CUDA (once): ``(numba.cuda, simulator?)``.

    Raises
    ------
    DeviceError
        Numba CUDA is not importable, or there is neither a CUDA GPU nor the simulator.
    """
    global cuda
    try:
        from numba import cuda as nc
    except Exception as e:  # numba absent or broken (numba-cuda on numpy 2.5: "no attribute 'row_stack'")
        raise DeviceError(f"the GPU kernels need Numba CUDA (pip install numba-cuda): {e}") from e
    sim = nc.is_available.__module__.endswith("simulator_init")
    if not sim and not nc.is_available():
        raise DeviceError("no CUDA GPU for the Numba kernels (beatflow.gpu.runtime); set NUMBA_ENABLE_CUDASIM=1 "
                          "before Numba is imported to run them on the CPU simulator")
    cuda = nc
    if sim:
        lock_shared_arrays()
    return nc, sim


@functools.lru_cache(maxsize=None)
def warp_intrinsics() -> dict:
    """The warp shuffles and barriers as device functions on a GPU, under the names the kernels
    call: ``_shfl_idx``, ``_shfl_down``, ``_shfl_xor``, ``_syncthreads``, ``_syncwarp`` (thin
    wrappers, inlined by LLVM, so that the kernels name one function on a GPU and in the simulator,
    whose stand-ins are :func:`beatflow.gpu.sim.stand_ins`)."""
    numba_cuda()

    @cuda.jit(device=True)
    def _shfl_idx(mask, value, src_lane):
        return cuda.shfl_sync(mask, value, src_lane)

    @cuda.jit(device=True)
    def _shfl_down(mask, value, delta):
        return cuda.shfl_down_sync(mask, value, delta)

    @cuda.jit(device=True)
    def _shfl_xor(mask, value, lane_mask):
        return cuda.shfl_xor_sync(mask, value, lane_mask)

    @cuda.jit(device=True)
    def _syncthreads():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncwarp(FULL_MASK)

    return {"_shfl_idx": _shfl_idx, "_shfl_down": _shfl_down, "_shfl_xor": _shfl_xor, "_syncthreads": _syncthreads,
            "_syncwarp": _syncwarp}


def bind(g: dict) -> bool:
    """Set, in the globals ``g`` of a module of kernels, the names its kernels use: ``cuda`` (the
    simulator swaps it per launch), the warp shuffles and barriers (:func:`warp_intrinsics`, or
    the simulator's stand-ins for that module) and ``_F64``, the dtype of shared float64 arrays (the
    simulator's dynamic shared array wants a dtype instance). Returns whether it is the simulator."""
    nc, sim = numba_cuda()
    g["cuda"] = nc
    if sim:
        g.update(stand_ins(g))
        g["_F64"] = np.dtype(np.float64)  # its dynamic shared array reads dtype.itemsize
    else:
        g.update(warp_intrinsics())
        g["_F64"] = np.float64
    return sim


#: per-kernel register caps (``max_registers``; ptxas then spills what does not fit), a kernel
#: absent from it gets what ptxas chooses; ``BEATFLOW_MAXREG="dense=64,vf_energy=96"`` overrides
#: them (read once, when the kernels are first built: for benchmarks, each variant a process). On
#: the H200 (``bench/results/detection.md``, register caps): the dense kernel's register windows
#: (``beatflow.detect.gpu_kernels.DENSE_CHUNKS``) need 72 without spills (64 spills 4 bytes; 7 blocks
#: of 128 threads per SM either way, as shared memory allows); vf_energy at 96 instead of its 117 fits
#: 5 blocks of 128 threads per SM instead of 4 (the detection with the rule 1.69 -> 1.66 ms);
#: embed_warp, built per row width, needs 56 (48 spills 44 bytes; 0.136 ms against 0.143); the same
#: peaks and rows with or without the caps.
MAXREG_DEFAULT: dict = {"dense": 72, "embed_warp": 56, "vf_energy": 96}


def maxreg() -> dict:
    """The register caps in force: :data:`MAXREG_DEFAULT` with ``BEATFLOW_MAXREG``'s overrides."""
    out = dict(MAXREG_DEFAULT)
    for item in os.environ.get("BEATFLOW_MAXREG", "").split(","):
        if "=" in item:
            name, value = item.split("=", 1)
            out[name.strip()] = int(value)
    return {k: v for k, v in out.items() if v > 0}


def jit_kernel(name: str, sim: bool):
    """``cuda.jit`` for the kernel ``name``, with its register cap (none under the simulator)."""
    cap = None if sim else maxreg().get(name)
    return cuda.jit(max_registers=cap) if cap else cuda.jit


# --- host side -----------------------------------------------------------------------------------
def is_device(a) -> bool:
    """Whether ``a`` lives in GPU memory (``__cuda_array_interface__``)."""
    # the class first: CuPy builds the interface's dict on every access of the instance attribute
    return hasattr(type(a), "__cuda_array_interface__") or hasattr(a, "__cuda_array_interface__")


class Ctx:
    """Where one call's arrays live: ``xp`` (cupy on the GPU, numpy in the simulator), how kernel
    arguments are passed, and the stream to launch on."""

    #: where the call's arrays come from: None, fresh ones from the pool; a :class:`Workspace`, the
    #: same arrays on every pass (:class:`beatflow.detect.gpu.SegmentGraph`)
    ws = None

    def __init__(self, sim: bool):
        self.sim = sim
        if sim:
            self.xp = np
            self.stream_ptr = 0
        else:
            try:
                import cupy
            except ImportError as e:
                raise DeviceError("the GPU kernels return CuPy arrays: install cupy") from e
            self.xp = cupy
            self.cstream = cur = cupy.cuda.get_current_stream()
            self.stream_ptr = cur.ptr
            self.dev = cupy.cuda.runtime.getDevice()
            self._stream = None  # Numba's view of it: made for a launch through Numba only

    @property
    def stream(self):
        """The stream as Numba takes it (a kernel's first launch goes through Numba)."""
        if self.sim:
            return 0
        if self._stream is None:
            ptr = self.stream_ptr
            self._stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        return self._stream

    def arg(self, a):
        """A kernel argument as it is: NumPy in the simulator, the CuPy array itself on the GPU (the
        launch passes its device pointer, no copy and no synchronisation: the kernel runs on CuPy's
        stream, after the work that produced ``a``)."""
        return a

    def array(self, a, dtype=None):
        """``a`` in this call's namespace (no copy when it already is, with that dtype)."""
        if self.sim:
            if is_device(a):
                raise DeviceError("the CUDA simulator takes NumPy arrays, not device arrays")
            return np.ascontiguousarray(a, dtype=dtype)
        return self.xp.ascontiguousarray(self.xp.asarray(a), dtype=dtype)

    def empty(self, shape, dtype):
        """An array for this call's launches: from the pool, or the workspace's next one."""
        if self.ws is None:
            return self.xp.empty(shape, dtype=dtype)
        return self.ws.take(self.xp, shape, dtype)

    def zeros(self, shape, dtype):
        """:meth:`empty` set to zero (a memset on this call's stream)."""
        if self.ws is None:
            return self.xp.zeros(shape, dtype=dtype)
        a = self.ws.take(self.xp, shape, dtype)
        a.fill(0)
        return a

    def blocks(self, needed: int) -> int:
        return max(1, min(needed, SIM_MAX_BLOCKS)) if self.sim else max(1, needed)

    def fork(self, high: bool = False):
        """A context on one of this thread's two side streams (:func:`side_streams`; ``high``: the
        one of the device's highest priority), which starts behind the work queued on this one so
        far: ``(side, join)``, where ``join()`` makes this stream wait for what was by then
        launched on the side. In the simulator (one stream): ``(self, no-op)``.

        The caller keeps every array that a side launch uses referenced until after ``join`` and
        the synchronisation behind it: the memory pools are ordered by the allocating stream, so an
        array freed while the side stream still reads it could be handed to the next allocation
        on this one (a two-stream detection that let them go lost peaks that way)."""
        if self.sim:
            return self, _no_join
        stream = side_streams()[1 if high else 0]
        side = object.__new__(Ctx)
        side.sim, side.xp, side.cstream, side.stream_ptr, side._stream = False, self.xp, stream, stream.ptr, None
        side.dev, side.ws = self.dev, self.ws
        stream.wait_event(self.cstream.record())

        def join():
            self.cstream.wait_event(stream.record())

        return side, join

    def launch(self, kernel, blocks: int, threads: int, shared: int, *args, sig=None):
        """``kernel[blocks, threads, stream, shared](*args)``.

        ``sig``: where the call site's argument kinds (dtype, dimensions, contiguity; scalar types)
        follow from a few of them, a key made of those (the dtype of its input, or ``""`` when all
        its arrays are made with fixed dtypes by the caller). It selects the compiled kernel without
        reading every argument's kind on each launch (~0.5 µs an argument, 16 for ``dense``).

        On the GPU a kernel's first launch with a given signature goes through Numba (which compiles
        it), the next ones through :class:`FastLaunch` (CuPy's driver call with the arguments packed
        as Numba lays them out): Numba's own launch converts and types every argument on each call,
        about 14 µs per CuPy array, 100-270 µs per detection kernel on the H200
        (``bench/results/detection.md``, launches), which the GPU spends waiting. In the simulator
        the interpreter's thread switch interval is cut while a kernel runs: its block manager
        busy-polls, and with the default 5 ms every barrier of its Python threads waits for the GIL."""
        if not self.sim:
            fast = FastLaunch.get(kernel, args, self.dev, sig) if FAST_LAUNCH else None
            if fast is not None:
                fast(blocks, threads, shared, self.stream_ptr, args)
                return
            nargs = [cuda.as_cuda_array(a, sync=False) if is_device(a) else a for a in args]
            kernel[blocks, threads, self.stream, shared](*nargs)
            if FAST_LAUNCH:
                FastLaunch.register(kernel, args, nargs, self.dev, sig)
            return
        with switch_interval(2e-4):
            kernel[blocks, threads, 0, shared](*args)


def _no_join():
    pass


class Workspace:
    """The arrays of one sequence of launches, kept for the next passes over it: the first pass
    (``recording``) allocates them and keeps them in the order it asked for them; every later pass
    asks in the same order and gets the same arrays back, with no allocation (what capturing the
    launches in a CUDA graph needs: the pool's allocations are not stream-capture safe, and the
    graph's kernels keep the addresses they were captured with)."""

    def __init__(self):
        self.arrays: list = []
        self.recording = True
        self.i = 0

    def rewind(self):
        """Start a pass that hands out the kept arrays again."""
        self.recording, self.i = False, 0

    def take(self, xp, shape, dtype):
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(v) for v in shape)
        if self.recording:
            a = xp.empty(shape, dtype=dtype)
            self.arrays.append(a)
            return a
        if self.i >= len(self.arrays):
            raise RuntimeError(f"a replayed pass asked for array {self.i + 1}; the recorded pass made "
                               f"{len(self.arrays)}")
        a = self.arrays[self.i]
        if a.shape != shape or a.dtype != np.dtype(dtype):
            raise RuntimeError(f"a replayed pass asked for array {self.i + 1} as {shape} {np.dtype(dtype)}; "
                               f"the recorded pass made it {a.shape} {a.dtype}")
        self.i += 1
        return a


_side = threading.local()


def side_streams():
    """This thread's two side streams on the current device, made once: ``(low, high)``, both
    non-blocking, ``high`` at the device's highest priority (where the runtime offers none, a second
    stream of the default priority)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    streams = getattr(_side, "streams", None)
    if streams is None:
        streams = _side.streams = {}
    pair = streams.get(dev)
    if pair is None:
        rt = cupy.cuda.runtime
        try:
            _, greatest = rt.deviceGetStreamPriorityRange()
            high = cupy.cuda.ExternalStream(rt.streamCreateWithPriority(rt.streamNonBlocking, greatest))
        except Exception:  # (the stream lives as long as the thread's entry: for the process)
            high = cupy.cuda.Stream(non_blocking=True)
        pair = streams[dev] = (cupy.cuda.Stream(non_blocking=True), high)
    return pair


#: launch compiled kernels through CuPy's driver call (False, or BEATFLOW_FAST_LAUNCH=0: always through Numba)
FAST_LAUNCH = os.environ.get("BEATFLOW_FAST_LAUNCH", "1") not in ("0", "false", "no")


def _arg_key(a):
    """What selects a kernel's compiled signature: (dtype, ndim, C-contiguous) of an array, the
    Python type of a scalar. (Read per argument on every launch: CuPy's ``_c_contiguous`` attribute,
    not its ``flags`` object, which is built anew on each access.)"""
    c = getattr(a, "_c_contiguous", None)
    if c is not None:  # a CuPy array
        return (a.dtype, a.ndim, c)
    if is_device(a):
        return (a.dtype, a.ndim, bool(a.flags.c_contiguous))
    return type(a)


class FastLaunch:
    """A compiled Numba kernel launched with ``cupy.cuda.driver.launchKernel``.

    The kernel's cubin (Numba's, for this device) is loaded as a CuPy module once; each launch
    packs the arguments into one buffer of 8-byte slots in Numba's kernel ABI (per array: meminfo,
    parent, size, itemsize, data pointer, shape, strides in bytes; per scalar: its value; the driver
    reads as many bytes of a slot as the parameter has) with one ``struct.pack_into`` and launches.
    The slot pointers are fixed, so packing and launching hold a lock (Dask workers launch from
    several threads). Kernels with module set-up code, debug or cooperative kernels stay with Numba.
    """

    _cache: dict = {}
    _lock = threading.Lock()
    errors: dict = {}  #: kernel name -> why it stays with Numba's launch

    def __init__(self, fn, module, fmt: str, kinds: tuple, nslots: int):
        import ctypes

        self.fn, self.module, self.fmt, self.kinds = fn, module, fmt, kinds
        self.buf = (ctypes.c_int64 * max(1, nslots))()
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(1, nslots))(*[base + 8 * i for i in range(nslots)])
        self.params = ctypes.addressof(self.ptrs)
        self.lock = threading.Lock()

    @staticmethod
    def _key(kernel, args, dev, sig):
        """The launcher's key: the kernel, the device, and the arguments' kinds (or the call
        site's ``sig`` for them, see :meth:`Ctx.launch`)."""
        if sig is not None:
            return (id(kernel), dev, len(args), sig)
        return (id(kernel), dev, tuple(_arg_key(a) for a in args))

    @classmethod
    def get(cls, kernel, args, dev, sig=None):
        return cls._cache.get(cls._key(kernel, args, dev, sig))

    @classmethod
    def register(cls, kernel, args, nargs, dev, sig=None):
        """After Numba's launch of ``kernel`` with ``nargs`` (``args`` as Numba sees them): its
        compiled overload, as a fast launcher for calls with the same argument kinds."""
        import cupy

        key = cls._key(kernel, args, dev, sig)
        if key in cls._cache:
            return
        try:
            sig = tuple(kernel.typeof_pyval(a) for a in nargs)
            ov = kernel.overloads[sig]
            lib = ov._codelibrary
            if (getattr(ov, "debug", False) or getattr(ov, "cooperative", False)
                    or getattr(ov, "launch_config_sensitive", False) or getattr(lib, "_setup_functions", None)):
                cls._cache[key] = None
                return
            try:
                cubin = lib.get_cubin()  # bytes, or (recent numba-cuda) a cuda.core ObjectCode
                cubin = cubin if isinstance(cubin, (bytes, bytearray)) else getattr(cubin, "code", cubin)
                module = cupy.cuda.function.Module()
                module.load(bytes(cubin))
                fn = module.get_function(lib._entry_name).ptr
            except Exception:  # the function Numba loaded (a CUkernel, which cuLaunchKernel takes too)
                module, fn = None, int(lib.get_cufunc().handle)
        except Exception as e:  # an unexpected Numba layout: keep launching through Numba
            cls.errors[getattr(kernel, "__name__", str(kernel))] = f"{type(e).__name__}: {e}"
            cls._cache[key] = None
            return
        fmt, kinds, nslots = "<", [], 0
        for a in args:
            if is_device(a):
                fmt += "q" * (5 + 2 * a.ndim)
                kinds.append(a.ndim)
                nslots += 5 + 2 * a.ndim
            else:
                fmt += "d" if isinstance(a, (float, np.floating)) else "q"
                kinds.append(-1)
                nslots += 1
        with cls._lock:
            cls._cache[key] = cls(fn, module, fmt, tuple(kinds), nslots)

    def __call__(self, blocks: int, threads: int, shared: int, stream_ptr: int, args):
        import cupy

        vals = []
        for a, k in zip(args, self.kinds):
            if k >= 0:
                vals += (0, 0, a.size, a.itemsize, a.data.ptr)
                vals += a.shape
                vals += a.strides
            else:
                vals.append(a)
        with self.lock:
            _struct.pack_into(self.fmt, self.buf, 0, *vals)
            cupy.cuda.driver.launchKernel(self.fn, int(blocks), 1, 1, int(threads), 1, 1, int(shared),
                                          stream_ptr, self.params, 0)


def ctx_for(*arrays) -> tuple[Ctx, bool]:
    """The call's context, and whether results go back to the host (NumPy input on a real GPU)."""
    _, sim = numba_cuda()
    ctx = Ctx(sim)
    host_in = not sim and not any(is_device(a) for a in arrays)
    return ctx, host_in


def vector_call(a, name: str):
    """``(ctx, host_in, xp, a)`` for a kernel wrapper whose input ``a`` is a 1-D array."""
    ctx, host_in = ctx_for(a)
    a = ctx.array(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return ctx, host_in, ctx.xp, a

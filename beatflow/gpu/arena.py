"""Memory for CUDA graph captures while PyTorch allocates from RMM (the flow's GPU workers).

Under RMM's stream-ordered pool (``CudaAsyncMemoryResource``) an allocation made inside a CUDA graph
capture becomes a node of the graph: its address is reserved but not mapped until the graph runs.
PyTorch's own kernels do not mind, but a kernel launcher that asks the driver about its pointer
arguments (Triton's, under ``torch.compile``) gets ``CUDA driver error: invalid argument``, so a
compiled step could not be captured in the workers (H200, ``bench/results/gpu.md``).

:class:`CaptureArena` is an RMM resource put in front of the current one. Outside a capture it
forwards every allocation; inside :meth:`CaptureArena.capture` the allocations come from an *arena*:
one buffer taken from the upstream resource *before* the capture (so mapped), handed out by a bump
pointer and never reused (a freed block inside the arena is simply not given out again), which
makes every address of the captured work distinct and valid for as long as the arena lives. The
arena is released when the object that holds it (the captured graphs) is released and the graphs'
tensors are gone; a free of an arena address is a no-op, every other free goes upstream.
"""
from __future__ import annotations

import contextlib
import threading

_ALIGN = 256


class _Arena:
    """One buffer of the upstream resource and its bump pointer."""

    def __init__(self, buffer, size: int):
        self.buffer = buffer  # an rmm.DeviceBuffer: freed upstream when the last reference goes
        self.base = int(buffer.ptr)
        self.size = int(size)
        self.offset = 0
        self.overflow = 0  # allocations that did not fit (they went upstream)

    def take(self, nbytes: int):
        nbytes = max(int(nbytes), 1)  # a block of 0 bytes gets an address of its own too: PyTorch's
        # pluggable allocator keys its blocks by address ("Trying to free a pointer not allocated here")
        off = -(-self.offset // _ALIGN) * _ALIGN
        if off + nbytes > self.size:
            self.overflow += 1
            return None
        self.offset = off + nbytes
        return self.base + off

    def holds(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size


class CaptureArena:
    """An RMM resource in front of ``upstream`` (see the module's docstring); install with
    :func:`install`."""

    def __init__(self, upstream, *, callback_resource=None):
        self.upstream = upstream
        self._lock = threading.Lock()
        self._active: _Arena | None = None
        self._live: list = []  # weak references to the arenas alive (frees are checked against them)
        if callback_resource is None:
            import rmm

            callback_resource = rmm.mr.CallbackMemoryResource
        self.mr = callback_resource(self._allocate, self._deallocate)

    def _buffer(self, nbytes: int):
        """A buffer of ``nbytes`` from the upstream resource (freed there when released)."""
        import rmm

        return rmm.DeviceBuffer(size=int(nbytes), mr=self.upstream)

    def _allocate(self, nbytes, *stream):
        a = self._active
        if a is not None:
            with self._lock:
                ptr = a.take(int(nbytes))
            if ptr is not None:
                return ptr
        return self.upstream.allocate(int(nbytes), *stream)

    def _deallocate(self, ptr, nbytes, *stream):
        ptr = int(ptr)
        for ref in self._live:
            a = ref()
            if a is not None and a.holds(ptr):
                return
        self.upstream.deallocate(ptr, int(nbytes), *stream)

    @contextlib.contextmanager
    def capture(self, nbytes: int):
        """Within the block, allocations come from a new arena of ``nbytes``; yields the arena, which
        the caller keeps for as long as the captured graphs live."""
        import weakref

        arena = _Arena(self._buffer(nbytes), nbytes)
        with self._lock:
            self._live = [r for r in self._live if r() is not None] + [weakref.ref(arena)]
            previous, self._active = self._active, arena
        try:
            yield arena
        finally:
            with self._lock:
                self._active = previous


_INSTALLED: dict = {}


def install():
    """Put a :class:`CaptureArena` in front of this device's current RMM resource (once per device
    and process) and return it; None where RMM is not importable or no resource is set."""
    try:
        import rmm
    except ImportError:
        return None
    dev = _device_id()
    current = rmm.mr.get_current_device_resource()
    got = _INSTALLED.get(dev)
    if got is not None and current is got.mr:
        return got
    arena = CaptureArena(current)
    rmm.mr.set_current_device_resource(arena.mr)
    _INSTALLED[dev] = arena
    return arena


def installed():
    """The :class:`CaptureArena` in front of this device's current RMM resource, or None."""
    try:
        import rmm
    except ImportError:
        return None
    got = _INSTALLED.get(_device_id())
    return got if got is not None and rmm.mr.get_current_device_resource() is got.mr else None


def resource_chain():
    """This device's current RMM resource and its upstream resources, outermost first (through a
    :class:`CaptureArena` too); empty without RMM."""
    try:
        import rmm
    except ImportError:
        return []
    out, mr = [], rmm.mr.get_current_device_resource()
    while mr is not None:
        out.append(mr)
        arena = next((a for a in _INSTALLED.values() if a.mr is mr), None)
        mr = arena.upstream if arena is not None else getattr(mr, "upstream_mr", None)
    return out


def _device_id() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDevice())
    except Exception:
        return 0

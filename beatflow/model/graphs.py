"""The training's CUDA-graph and allocator runtime: which allocator can capture, the capture itself, captured
steps (one graph per batch shape, or a whole epoch of step-kernel steps), the steps kept for the next training,
and the epochs queued on the GPU before their losses are read.

:func:`beatflow.model.train.train_vae` decides when these run; the ``compiled`` engine
(:mod:`beatflow.engine.compiled`) captures its buckets with :func:`capture_graph` too.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Optional

import torch

from beatflow.model.threads import torch_threads

__all__ = [
    "native_allocator",
    "rmm_async_resource",
    "graph_allocator",
    "capture_graph",
    "set_start",
    "KeptSteps",
    "take_kept",
    "keep_steps",
    "GraphedSteps",
    "EpochGraph",
    "QUEUE_SWITCH_INTERVAL",
    "queued_epochs",
]


def native_allocator() -> bool:
    """Whether PyTorch allocates CUDA memory with its own caching allocator (needed by CUDA graphs)."""
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except Exception:  # pragma: no cover - older torch
        return False


def rmm_async_resource() -> bool:
    """Whether RMM's current device resource is (an adaptor over) ``CudaAsyncMemoryResource``: CUDA's
    own stream-ordered pool (``cudaMallocAsync``), which allocates inside a CUDA graph capture."""
    try:
        import rmm
    except ImportError:
        return False
    from beatflow.gpu.arena import resource_chain

    return any(isinstance(mr, rmm.mr.CudaAsyncMemoryResource) for mr in resource_chain())


def graph_allocator() -> bool:
    """Whether CUDA graphs can be captured with PyTorch's current CUDA allocator: its own caching
    allocator or its ``cudaMallocAsync`` backend, or RMM over CUDA's stream-ordered pool with a
    :class:`~beatflow.gpu.arena.CaptureArena` in front (the flow's GPU workers with
    ``--rmm-allocator async``). Not RMM's pool resource: its bookkeeping breaks the capture
    (``cudaErrorStreamCaptureInvalidated``), nor the async pool without the arena: the eager step's
    first replay then hit an illegal memory access, and compiled steps could not be captured (H200)."""
    try:
        backend = torch.cuda.memory.get_allocator_backend()
    except Exception:  # pragma: no cover - older torch
        return False
    if backend in ("native", "cudaMallocAsync"):
        return True
    from beatflow.gpu.arena import installed

    return rmm_async_resource() and installed() is not None


@contextlib.contextmanager
def capture_graph(graph, pool, stream, arena_bytes: int, arenas: list):
    """``torch.cuda.graph(graph, pool=pool)`` for the training steps and the compiled engine, thread-
    local (CUDA calls of a Dask worker's other threads do not invalidate it). Under RMM with a
    :class:`~beatflow.gpu.arena.CaptureArena` in front, the capture's memory comes from a new
    arena of ``arena_bytes`` (mapped before the capture; appended to ``arenas``, which must live as
    long as the graph) and the capture runs on ``stream``, the warm-up's, whose library workspaces
    the warm-up made outside the arena. An arena too small is a ``RuntimeError`` after the capture."""
    from beatflow.gpu.arena import installed

    front = None if native_allocator() else installed()
    if front is None:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
        return
    with front.capture(arena_bytes) as arena, \
            torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield
    arenas.append(arena)
    if arena.overflow:
        raise RuntimeError(f"the capture needed more than its arena of {arena.size} bytes")


def set_start(model, opt, state: dict) -> None:
    """Where training starts: the model's weights set to ``state``'s, the optimizer's state zeroed (the
    tensors stay: captured graphs read and write them)."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(state[k])
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()


class KeptSteps:
    """Captured training steps kept for the next :func:`~beatflow.model.train.train_vae` of the same key
    (``keep_graphs``): the model and optimizer whose tensors the graphs update, and the CUDA generator's
    offset right after the capture (where the epochs of a fresh call start drawing their noise)."""

    def __init__(self, model, opt, steps: "GraphedSteps | EpochGraph", device, compiled: bool):
        self.model, self.opt, self.steps = model, opt, steps
        self.offset = torch.cuda.default_generators[_cuda_index(device)].get_offset()
        self.compiled = compiled  # (whether the captured steps are the compiled ones)
        self.reused = False
        self.lock = threading.Lock()
        self.lock.acquire()  # (the call that captured them trains with them first)

    def reset(self, state: dict, device) -> None:
        """The weights to ``state``'s (a fresh model of this call's seed), the optimizer's state to zero,
        the generator (already seeded) to the offset its fresh capture left."""
        set_start(self.model, self.opt, state)
        torch.cuda.default_generators[_cuda_index(device)].set_offset(self.offset)
        self.reused = True


#: the kept steps of :func:`~beatflow.model.train.train_vae` (``keep_graphs``): at most one set, for one key
_KEPT: dict = {}
_KEPT_LOCK = threading.Lock()


def _cuda_index(device) -> int:
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def take_kept(key) -> Optional[KeptSteps]:
    """The kept steps of ``key``, locked for this call; None if there are none or another thread has them."""
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
        if kept is not None and kept.lock.acquire(blocking=False):
            return kept
    return None


def keep_steps(key, kept: KeptSteps) -> KeptSteps:
    """Keep ``kept`` (locked by its caller) for ``key``; sets kept for other keys are dropped (their graphs
    and arenas freed) unless in use, when they are only forgotten."""
    with _KEPT_LOCK:
        for other in list(_KEPT.values()):
            if other.lock.acquire(blocking=False):
                other.steps.release()
                other.lock.release()
        _KEPT.clear()
        _KEPT[key] = kept
    return kept


class GraphedSteps:
    """Whole training steps (forward, backward, optimizer update, gradients zeroed) captured once
    per batch shape in a CUDA graph; a call copies the batch into the static input, replays, and
    returns the step's loss (a device scalar the next replay overwrites).

    Capture is preceded by warm-up steps on a side stream (they compile, create the optimizer's
    state and the library workspaces); their effect is undone: the weights are set back to their
    values before them and the optimizer's state to zero, so training starts where it would have.
    """

    def __init__(self, model, opt, step_loss, shapes, width: int, device):
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.graphs = {}
        self.arenas = []
        # the step keeps what the graphs read and write outside their own pool (the step kernel's noise and
        # per-row gradient buffers): freed while kept graphs live on, their memory went to other tensors,
        # which the replays then overwrote (a flow run's training on an H100 hit a device-side assert)
        self.step_loss = step_loss
        try:
            self._capture(model, opt, step_loss, shapes, width, device)
        except BaseException:
            self.release()
            raise
        finally:  # also when capture fails: training then starts from the same weights
            set_start(model, opt, initial)

    def _capture(self, model, opt, step_loss, shapes, width, device):
        pool = torch.cuda.graph_pool_handle()
        for b in shapes:
            static = torch.zeros((b, width), dtype=torch.float32, device=device)

            def step(static=static):
                loss = step_loss(static)
                if getattr(step_loss, "computes_grads", False):  # (the step kernel filled the gradients)
                    opt.step()
                    return loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                return loss.detach()

            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, pool, side, self.arena_bytes(b, width), self.arenas):
                loss = step()
            self.graphs[b] = (graph, static, loss)

    @staticmethod
    def arena_bytes(batch: int, width: int) -> int:
        """Bytes of the arena of one step's capture: room for ~256 batch-sized float32 tensors (the
        step makes a few dozen; an arena address is never reused within a capture)."""
        return max(64 << 20, 256 * batch * width * 4)

    def __del__(self):
        self.release()

    def release(self):
        """Drop the graphs and their tensors, then the arenas they live in (in that order: a free
        of an arena address is a no-op only while its arena is alive)."""
        self.graphs.clear()
        self.arenas.clear()
        self.step_loss = None

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        graph, static, loss = self.graphs[xb.shape[0]]
        static.copy_(xb)
        graph.replay()
        return loss


class EpochGraph:
    """A whole epoch of step-kernel steps (``train_vae`` with ``kernel`` and graphs) in one CUDA graph.

    The epoch's rows are gathered, in the epoch's order, into a kept buffer; the graph replays every
    step on its slices (the noise, the step kernel, the rows' sum, Adam) and adds the steps' losses into a
    device total: one launch an epoch instead of three a step. (In the flow's training worker, which shares
    its process with Dask's threads, the per-step launches fell behind the GPU: 0.20-0.23 s of epochs
    where a bare process took 0.13 s, H100.) The step kernel allocates nothing; its buffers live in the
    step, which this keeps. Warm-up steps before the capture are undone as in :class:`GraphedSteps`.
    """

    def __init__(self, model, opt, step, n_train: int, batch_size: int, width: int, device):
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.step_loss = step
        self.graph = None
        self.arenas = []
        self.batches = [(a, min(a + batch_size, n_train)) for a in range(0, n_train, batch_size)]
        try:
            self.rows = torch.zeros((n_train, width), dtype=torch.float32, device=device)
            self.total = torch.zeros((), dtype=torch.float64, device=device)
            self._capture(opt, device)
        except BaseException:
            self.release()
            raise
        finally:  # also when capture fails: training then starts from the same weights
            set_start(model, opt, initial)

    def _capture(self, opt, device):
        step = self.step_loss
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: the kernel built, Adam's state made, every slice's view
            for a, b in self.batches[:2] + self.batches[-1:]:
                step(self.rows[a:b])
                opt.step()
            for a, b in self.batches:
                step.view_of(self.rows[a:b])
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, torch.cuda.graph_pool_handle(), side, 64 << 20, self.arenas):
            self.total.zero_()
            for a, b in self.batches:
                loss = step(self.rows[a:b])
                opt.step()
                self.total += loss
        self.graph = graph

    def run(self, data, order):
        """One epoch on ``data[order]``; the device total of its steps' losses (the next call overwrites it)."""
        torch.index_select(data, 0, order, out=self.rows)
        self.graph.replay()
        return self.total

    def __del__(self):
        self.release()

    def release(self):
        """Drop the graph, then its arenas and the step (in that order, as :meth:`GraphedSteps.release`)."""
        self.graph = None
        self.arenas.clear()
        self.step_loss = None


@contextlib.contextmanager
def _collector_watched():
    """``{"seconds", "collections"}`` of the garbage collector's passes inside, in any thread (filled on exit)."""
    import gc

    stats, began = {"seconds": 0.0, "collections": 0}, []

    def watch(phase, info):
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            stats["seconds"] += time.perf_counter() - began.pop()
            stats["collections"] += 1

    gc.callbacks.append(watch)
    try:
        yield stats
    finally:
        gc.callbacks.remove(watch)


@contextlib.contextmanager
def _collector_paused():
    """No automatic garbage collection inside (as it was after)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: the interpreter's thread switch interval (s) while :func:`queued_epochs` queues the epochs; None: unchanged
QUEUE_SWITCH_INTERVAL: Optional[float] = 1e-4


def queued_epochs(graph: "EpochGraph", data, train_idx, n_train: int, epochs: int, gen, on_epoch, t0,
                   then: Optional[Callable[[], torch.Tensor]] = None) -> tuple[list, Optional[torch.Tensor]]:
    """The epochs of an :class:`EpochGraph`, all queued on the GPU before the first epoch's loss is read.

    Epoch by epoch, reading a loss waited for the GPU, and the next epoch's batch order (a permutation
    made on the CPU, then copied) was made only then: the GPU idled for that host work and for whatever
    other thread held the interpreter meanwhile (in the flow's Dask worker the epochs took 0.21 s against
    0.13 s of GPU work, H100). Here the epochs' orders are made from the generator's sequence (the same
    orders as epoch by epoch), every replay is queued, each epoch's loss total is copied to pinned memory
    behind an event, and the losses are read (and reported) in order.

    Every PyTorch call lets go of the interpreter's lock and takes it back; where another thread of the
    process wants it (a Dask worker's), taking it back waited up to the switch interval, 5 ms: in the flow's
    worker the epochs took 0.27-0.31 s against 113 ms of GPU time (H200), where a bare process took 0.12 s.
    While the epochs are queued the interval is :data:`QUEUE_SWITCH_INTERVAL`, the garbage collector waits,
    and the orders are made on one intra-op thread (not a team of the machine's cores, which the flow's
    figure processes share): the flow's worker then queued ten epochs in 0.7 ms and trained them in 0.126 s
    (H100; ``bench/gpu_train_step_kernel.py``'s ``kernel-busy`` variants show the switch interval's part).
    Kept on the graph: each epoch's GPU time (``epoch_gpu_ms``); the host's seconds to make the orders, to
    queue the epochs and to read them, the garbage collector's seconds meanwhile and the process's other
    threads (``queue_s``).

    The first epoch is queued as soon as its order is made; the other orders are made while the GPU runs it
    and copied at once (pinned, not blocking: a blocking copy would wait for the GPU). ``then``, if given,
    is queued after the last epoch, before the first loss is read (the held-out loss: its launches overlap
    the epochs); its device result is returned beside the losses."""
    from beatflow.device import switch_interval

    device = data.device
    if not epochs:
        return [], (then() if then is not None else None)
    with _collector_watched() as in_gc:
        with switch_interval(QUEUE_SWITCH_INTERVAL), _collector_paused():
            t_start = time.perf_counter()
            host = torch.zeros(epochs, dtype=torch.float64).pin_memory()
            began = [torch.cuda.Event(enable_timing=True) for _ in range(epochs)]
            done = [torch.cuda.Event(enable_timing=True) for _ in range(epochs)]
            t_orders = t_queue = 0.0

            def queue(first, last):  # the epochs first..last-1: their orders (one copy), then their replays
                nonlocal t_orders, t_queue
                t = time.perf_counter()
                with torch_threads(1):  # (small: no intra-op team to wake beside the figure processes)
                    perms = torch.stack([torch.randperm(n_train, generator=gen) for _ in range(first, last)])
                # (pinned, not blocking: a blocking copy from pageable memory waits for the queued epochs)
                orders = train_idx[perms.pin_memory().to(device, non_blocking=True)]
                t_orders += time.perf_counter() - t
                t = time.perf_counter()
                for e in range(first, last):
                    began[e].record()
                    total = graph.run(data, orders[e - first])  # (the next replay overwrites it: copied first)
                    host[e].copy_(total, non_blocking=True)
                    done[e].record()
                t_queue += time.perf_counter() - t

            queue(0, 1)  # (the GPU starts on epoch 1 while the host makes the other orders)
            if epochs > 1:
                queue(1, epochs)
            t = time.perf_counter()
            after = then() if then is not None else None
            t_queued = time.perf_counter()
            t_then = t_queued - t
        losses: list[float] = []
        for e in range(epochs):
            done[e].synchronize()
            losses.append(float(host[e]) / n_train)
            if on_epoch is not None:
                on_epoch(e + 1, losses[-1], time.perf_counter() - t0)
    # each epoch's time on the GPU, from its gather to its loss's copy, and the host's side: where the
    # epochs' wall time went (the process's other threads by name: what may have held the interpreter)
    graph.epoch_gpu_ms = [round(b.elapsed_time(d), 3) for b, d in zip(began, done)]
    others = sorted({t.name.rstrip("0123456789-_") or t.name for t in threading.enumerate()
                     if t is not threading.current_thread()})
    graph.queue_s = {"orders": round(t_orders, 4), "queue": round(t_queue, 4),
                     "then": round(t_then, 4), "setup": round(t_queued - t_start - t_orders - t_queue - t_then, 4),
                     "read": round(time.perf_counter() - t_queued, 4), "gc": round(in_gc["seconds"], 4),
                     "gc_collections": in_gc["collections"], "other_threads": threading.active_count() - 1,
                     "thread_names": others[:16]}
    return losses, after

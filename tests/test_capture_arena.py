"""Tests of beatflow.gpu.arena: the arena's bookkeeping with a fake upstream resource (CPU), and
on a GPU with RMM the compiled training step captured in CUDA graphs through it."""
import os
import subprocess
import sys
import textwrap

import pytest

from beatflow.gpu.arena import CaptureArena


class FakeUpstream:
    """An upstream resource handing out distinct addresses and recording the frees."""

    def __init__(self):
        self.next = 1 << 40
        self.allocated, self.freed = [], []

    def allocate(self, nbytes, *stream):
        ptr = self.next
        self.next += -(-nbytes // 4096) * 4096 + 4096
        self.allocated.append((ptr, nbytes))
        return ptr

    def deallocate(self, ptr, nbytes, *stream):
        self.freed.append((ptr, nbytes))


class FakeBuffer:
    def __init__(self, upstream, nbytes):
        self.ptr = upstream.allocate(nbytes)


class Arena(CaptureArena):
    def _buffer(self, nbytes):
        return FakeBuffer(self.upstream, nbytes)


def make():
    up = FakeUpstream()
    return up, Arena(up, callback_resource=lambda alloc, free: (alloc, free))


def test_outside_a_capture_everything_goes_upstream():
    up, arena = make()
    alloc, free = arena.mr
    p = alloc(1000, "stream")
    assert up.allocated == [(p, 1000)]
    free(p, 1000, "stream")
    assert up.freed == [(p, 1000)]


def test_inside_a_capture_addresses_come_from_the_arena_distinct_and_aligned():
    up, arena = make()
    alloc, free = arena.mr
    with arena.capture(1 << 20) as a:
        ptrs = [alloc(n) for n in (1, 300, 0, 4096, 0, 7, 100_000)]
        for p in ptrs[:3]:
            free(p, 0)  # an arena address is never handed out again: the frees change nothing
        ptrs.append(alloc(300))
    assert len(up.allocated) == 1 and up.freed == []  # the arena's one buffer, nothing freed upstream
    assert all(a.base <= p < a.base + a.size for p in ptrs)
    assert all(p % 256 == 0 for p in ptrs) and len(set(ptrs)) == len(ptrs)
    sizes = (1, 300, 1, 4096, 1, 7, 100_000, 300)  # (a block of 0 bytes takes one)
    spans = sorted(zip(ptrs, sizes))
    assert all(p + n <= q for (p, n), (q, _) in zip(spans, spans[1:]))  # no two blocks overlap
    q = alloc(64)  # after the capture: upstream again
    assert not a.holds(q) and up.allocated[-1] == (q, 64)


def test_a_full_arena_sends_the_rest_upstream_and_counts_it():
    up, arena = make()
    alloc, _ = arena.mr
    with arena.capture(1024) as a:
        first = alloc(1000)
        second = alloc(100)  # 1024 aligned to 256 is past the end
    assert a.holds(first) and not a.holds(second) and a.overflow == 1
    assert up.allocated[-1] == (second, 100)


def test_frees_go_upstream_once_the_arena_is_released():
    up, arena = make()
    alloc, free = arena.mr
    with arena.capture(1 << 16) as a:
        p = alloc(512)
    free(p, 512)
    assert up.freed == []
    del a  # the holder of the graphs let it go
    free(p, 512)
    assert up.freed == [(p, 512)]


def _gpu_with_rmm():
    try:
        import cupy
        import rmm  # noqa: F401
        import torch

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(not _gpu_with_rmm(), reason="needs a CUDA device, CuPy and RMM")
def test_compiled_step_captured_under_rmm_through_the_arena():
    """In a fresh process (PyTorch's allocator must be RMM's before anything is allocated): RMM over
    CUDA's async pool; without the arena graphs are refused; with it in front ``train_vae`` compiles
    the step and captures it in graphs, with the loss of the compiled step launched without graphs
    (within 5 %), and the arenas are released with the graphs."""
    script = textwrap.dedent("""
        import json, sys
        import numpy as np, rmm, torch
        from rmm.allocators.torch import rmm_torch_allocator
        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        from beatflow.gpu import arena as capture_arena
        from beatflow.model import train as M
        rows = np.random.default_rng(0).standard_normal((6000, 256)).astype(np.float32) * 0.1
        plain = M.train_vae(rows, epochs=3, batch_size=1024, seed=0, device="cuda", compile=True, cudagraphs=None)
        try:
            M.train_vae(rows, epochs=1, batch_size=1024, device="cuda", cudagraphs=True)
            refused = False
        except ValueError:
            refused = True
        arena = capture_arena.install()
        fast = M.train_vae(rows, epochs=3, batch_size=1024, seed=0, device="cuda", compile=True, cudagraphs=True)
        torch.cuda.synchronize()
        print(json.dumps({"plain": [plain.compiled, plain.cudagraphs, plain.test_loss],
                          "fast": [fast.compiled, fast.cudagraphs, fast.test_loss],
                          "live_arenas": sum(r() is not None for r in arena._live), "refused": refused}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refused"]  # without the arena, graphs under RMM are refused (an illegal access otherwise)
    assert got["plain"][:2] == [True, False]  # ... and by default not used: the compiled step launched
    assert got["fast"][:2] == [True, True]  # with it: the compiled step in the graphs
    assert got["live_arenas"] == 0  # released with the graphs
    assert abs(got["fast"][2] - got["plain"][2]) <= 0.05 * got["plain"][2]


def test_capture_graph_takes_an_arena_only_where_one_is_installed(monkeypatch):
    # beatflow.model.graphs.capture_graph, the one capture of the training steps and of the compiled engine, with
    # torch.cuda.graph and the installed arena as stand-ins (CPU)
    import contextlib

    import torch

    from beatflow.gpu import arena as capture_arena
    from beatflow.model import graphs as M
    calls = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode="global"):
        calls.append((graph, pool, stream, capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(M, "native_allocator", lambda: False)
    monkeypatch.setattr(capture_arena, "installed", lambda: None)
    kept = []
    with M.capture_graph("g0", "pool", "side", 1 << 16, kept):  # no arena: plain capture, default stream
        pass
    assert calls == [("g0", "pool", None, "thread_local")] and kept == []

    up, arena = make()
    alloc, _ = arena.mr
    monkeypatch.setattr(capture_arena, "installed", lambda: arena)
    with M.capture_graph("g1", "pool", "side", 1 << 16, kept):
        p = alloc(100)  # the capture's allocations come from the arena
    assert calls[-1] == ("g1", "pool", "side", "thread_local")
    assert len(kept) == 1 and kept[0].holds(p)
    with pytest.raises(RuntimeError, match="more than its arena of 1024 bytes"):
        with M.capture_graph("g2", "pool", "side", 1024, kept):
            alloc(4096)
    assert len(kept) == 2  # kept all the same: the graph's tensors may live in it
    monkeypatch.setattr(M, "native_allocator", lambda: True)  # PyTorch's own allocator: never an arena
    with M.capture_graph("g3", "pool", "side", 1 << 16, kept):
        pass
    assert calls[-1] == ("g3", "pool", None, "thread_local") and len(kept) == 2

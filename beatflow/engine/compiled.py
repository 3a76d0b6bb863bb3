"""``compiled`` backend: the fusible scorer (:mod:`beatflow.model.fused`) through ``torch.compile`` on a GPU.

Why not AOTInductor for the fused form: with torch 2.11 on the H200 the AOTInductor package of the
fusible scorer compiles, but loading it crashes the process (segmentation fault in
``aoti_load_package``, also in a fresh process); the cuDNN-form package loads, but it is ~25 kernels
and its first load in a process took 38 s. ``torch.compile`` of the fused form gives a few Triton
kernels (H200, batch 8192: 216 µs, ~38 M beats/s in fp32), compiles in ~15 s once per process and
machine, and reuses Inductor's on-disk caches afterwards (whether it can run:
:func:`beatflow.engine.options.compiled_available`).

The engine file is the scorer's weights (``torch.save`` of the state dict and the width), so the
engine cache works as for the other backends (key: weights hash, precision, device, versions); the
compiled kernels live in Inductor's own cache.

CUDA graphs: each bucket's compiled call is captured once in a CUDA graph (static input buffer,
replayed per call, outputs copied out), which removes the per-kernel launch costs that dominate
small batches. Capture needs PyTorch's own caching allocator, so ``cudagraphs=None`` (the default)
uses graphs where that allocator is in place (a process that loads the engine with
``beatflow.engine.cache.load_engine``, the engine
benchmark) and not in the flow's GPU workers, where PyTorch allocates from the RMM pool;
``cudagraphs=True`` with another allocator is refused.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from beatflow.engine.aoti import AotInductorEngine
from beatflow.engine.base import (
    TORCH_DTYPES,
    BatchProfile,
    PathLike,
    array_kind,
    as_cuda_tensor,
    check_matrix,
    from_cuda_tensor,
)
from beatflow.engine.options import check_precision
from beatflow.errors import DeviceError
from beatflow.gpu import arena as capture_arena
from beatflow.model.graphs import capture_graph, native_allocator
from beatflow.model.vae import Scorer

__all__ = ["CompiledEngine"]

#: batch sizes the engine compiles a static graph for (up to its max batch)
BUCKETS = (1, 32, 256, 2048, 8192)



class _GraphedBuckets:
    """The compiled scorer with each input shape captured once in a CUDA graph.

    A call copies its rows into that shape's static input, replays the graph and returns copies
    of the static outputs (the next replay overwrites them). The graphs share one memory pool;
    a lock keeps concurrent callers from interleaving copy, replay and copy-out.
    """

    def __init__(self, compiled, device: torch.device):
        self.compiled = compiled
        self.device = device
        self.graphs: dict = {}
        self.arenas: list = []  # under RMM: the captures' memory (beatflow.gpu.arena)
        self.pool = None
        self.lock = threading.Lock()

    def __del__(self):  # the graphs' tensors before the arenas they live in
        self.graphs.clear()
        self.arenas.clear()

    def _capture(self, shape, dtype):
        static = torch.zeros(shape, dtype=dtype, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():  # warm-up (compiles) off the capture
            for _ in range(2):
                self.compiled(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, self.pool, side, max(32 << 20, 64 * static.numel() * 4), self.arenas), \
                torch.no_grad():
            outs = self.compiled(static)
        return graph, static, outs

    def __call__(self, x: torch.Tensor, rows: Optional[int] = None):
        """Scores of ``x`` through the graph of ``rows`` rows (default ``len(x)``; ``rows >= len(x)``:
        the rows past ``x`` hold whatever the last call left there, and each row is scored on its own,
        so they change nothing but their own discarded outputs)."""
        m = x.shape[0]
        key = (m if rows is None else rows, x.shape[1], x.dtype)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is None:
                try:
                    entry = self._capture(key[:2], key[2])
                except Exception as e:  # this allocator cannot capture after all: launch the kernels
                    import warnings

                    warnings.warn(f"compiled engine: CUDA graph capture failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); launching kernels", RuntimeWarning)
                    entry = None
                entry = self.graphs[key] = entry or "launch"
            if isinstance(entry, str):  # "launch"
                with torch.no_grad():
                    if m != key[0]:
                        padded = torch.zeros(key[:2], dtype=x.dtype, device=x.device)
                        padded[:m] = x
                        x = padded
                    s, mu = self.compiled(x)
                return s[:m], mu[:m]
            graph, static, (s, mu) = entry
            if m == key[0]:
                static.copy_(x)
                graph.replay()
                return s.clone(), mu.clone()
            static[:m].copy_(x)
            graph.replay()
            return s[:m].clone(), mu[:m].clone()


class CompiledEngine(AotInductorEngine):
    """``torch.compile``-d :class:`beatflow.model.fused.FusedScorer` on one GPU, one static graph per
    batch bucket (:data:`BUCKETS`).

    Same ``infer`` contract as :class:`AotInductorEngine` (device input used in place, results
    stay on the device).
    """

    name = "compiled"

    def __init__(self, path: PathLike, *, device: str = "cuda", precision: str = "fp32", max_batch: int = 8192,
                 cudagraphs: Optional[bool] = None):
        super().__init__(path, device=device, precision=precision, max_batch=max_batch)
        if self.device_index is None:
            raise DeviceError("the compiled engine runs on a CUDA device")
        if precision not in TORCH_DTYPES:
            raise ValueError(f"compiled engine: precision {precision!r} not supported (fp32, fp16, bf16)")
        # graphs by default where PyTorch allocates with its own allocator, or from RMM with a capture
        # arena in front (beatflow.gpu.arena; without it, capturing the compiled scorer under RMM's
        # async pool failed on an H200: "CUDA driver error: invalid argument",
        # bench/gpu_engine_async_probe.py); if a capture fails anyway, that bucket launches its kernels
        native = native_allocator() or capture_arena.installed() is not None
        if cudagraphs and not native:
            raise DeviceError("compiled engine: CUDA graphs need PyTorch's own CUDA allocator, and another "
                              f"({torch.cuda.memory.get_allocator_backend()}) is installed")
        self.cudagraphs = native if cudagraphs is None else bool(cudagraphs)
        self._bucket_list = self.buckets()

    @property
    def model(self):
        """The compiled scorer (weights loaded and compiled on first use)."""
        if self._model is None:
            with self._lock:
                if self._model is None:
                    from beatflow.model.fused import FusedScorer
                    from beatflow.model.vae import LightVAE

                    if not torch.cuda.is_available():
                        raise DeviceError("compiled engine: torch sees no CUDA device")
                    blob = torch.load(self.path, map_location="cpu", weights_only=True)
                    vae = LightVAE(int(blob["width"]))
                    vae.load_state_dict(blob["state_dict"])
                    module = FusedScorer(vae.to(self.torch_device), TORCH_DTYPES[self.precision]).eval()
                    # one static graph per batch bucket (dynamic shapes made slower kernels: 5.5 M
                    # beats/s at 8192 against 38 M static); every engine in a process recompiles the
                    # same forward, so allow more than dynamo's default 8 variants
                    import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make torch local)

                    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 256)
                    dynamo.config.accumulated_recompile_limit = max(dynamo.config.accumulated_recompile_limit, 4096)
                    compiled = torch.compile(module, dynamic=False)
                    self._model = _GraphedBuckets(compiled, self.torch_device) if self.cudagraphs else compiled
        return self._model

    @classmethod
    def build(cls, scorer: Scorer, path: PathLike, *, device: str = "cuda", precision: str = "fp32",
              batch_profile=(1, 1024, 8192), cudagraphs: Optional[bool] = None, **_ignored) -> "CompiledEngine":
        """Save the scorer's weights to ``path`` and compile (warm) for the profile's batches."""
        check_precision(precision)
        profile = BatchProfile.coerce(batch_profile)
        torch.save({"width": int(scorer.width), "state_dict": scorer.vae.state_dict()}, os.fspath(path))
        engine = cls(path, device=device, precision=precision, max_batch=max(profile.max, profile.example),
                     cudagraphs=cudagraphs)
        engine.warm(profile)
        return engine

    def buckets(self) -> list[int]:
        """Batch sizes compiled for: a call's rows are padded to the next one (chunks of the largest)."""
        return sorted({min(b, self.max_batch) for b in BUCKETS} | {self.max_batch})

    def warm(self, profile=None) -> None:
        """Compile every bucket now."""
        with torch.no_grad():
            for b in self.buckets():
                self.model(torch.zeros(b, self._width(), device=self.torch_device))

    def infer(self, beats, batch_size: int = 8192):
        """Score ``(n, D)`` beats on the device: chunks of the largest bucket, the last one padded
        with zero rows to the next bucket (device copies only); results stay on the device."""
        kind = array_kind(beats)
        x = as_cuda_tensor(beats, self.torch_device)
        check_matrix(x.shape)
        n, step = x.shape[0], max(1, min(int(batch_size), self.max_batch))
        buckets = [b for b in self._bucket_list if b <= step] or [step]
        model = self.model
        if self.cudagraphs:  # chunks go through their bucket's graph (padding stays inside it)
            def bucket(m):
                return next(q for q in self._bucket_list if q >= m)  # max_batch >= step >= m is one
            if 0 < n <= step:  # one call (batch-1 latency: nothing else on the way)
                s, mu = model(x, bucket(n))
                return from_cuda_tensor(s, kind), from_cuda_tensor(mu, kind)
            outs = [model(x[a:a + step], bucket(min(step, n - a))) for a in range(0, n, step)]
            if not outs:
                return (from_cuda_tensor(torch.zeros(0, dtype=torch.float32, device=x.device), kind),
                        from_cuda_tensor(torch.zeros((0, 2), dtype=torch.float32, device=x.device), kind))
            return (from_cuda_tensor(torch.cat([o[0] for o in outs]), kind),
                    from_cuda_tensor(torch.cat([o[1] for o in outs]), kind))
        parts_s, parts_m = [], []
        with torch.no_grad():
            for start in range(0, n, step):
                chunk = x[start:start + step]
                m = chunk.shape[0]
                b = next((q for q in buckets if q >= m), None)
                if b is None or b != m:
                    b = b or m
                    padded = torch.zeros((b, x.shape[1]), dtype=x.dtype, device=x.device)
                    padded[:m] = chunk
                    chunk = padded
                s, mu = model(chunk)
                parts_s.append(s[:m])
                parts_m.append(mu[:m])
        if not parts_s:
            s = torch.zeros(0, dtype=torch.float32, device=x.device)
            mu = torch.zeros((0, 2), dtype=torch.float32, device=x.device)
        else:
            s = parts_s[0] if len(parts_s) == 1 else torch.cat(parts_s)
            mu = parts_m[0] if len(parts_m) == 1 else torch.cat(parts_m)
        return from_cuda_tensor(s, kind), from_cuda_tensor(mu, kind)

    def _width(self) -> int:
        if not hasattr(self, "_w"):
            self._w = int(torch.load(self.path, map_location="cpu", weights_only=True)["width"])
        return self._w

    def save(self, path: PathLike) -> None:
        import shutil

        if os.path.abspath(path) != os.path.abspath(self.path):
            shutil.copyfile(self.path, path)

    @classmethod
    def load(cls, path: PathLike, *, device: str = "cuda", precision: str = "fp32", max_batch: int = 8192,
             cudagraphs: Optional[bool] = None, **_ignored) -> "CompiledEngine":
        """Load the weights (a bad file fails here); compiling waits for the first call."""
        engine = cls(path, device=device, precision=precision, max_batch=max_batch, cudagraphs=cudagraphs)
        try:
            engine._width()
        except Exception as e:
            raise ValueError(f"{path}: not a compiled-engine file ({type(e).__name__})") from None
        return engine

"""PyTorch AOTInductor backend: ``torch.export`` with a dynamic batch, compiled ahead of time.

The package (``.pt2``) is compiled for one device kind (CUDA, or the CPU with gcc) and loaded with
``torch._inductor.aoti_load_package``. On a GPU, device input (a CUDA torch tensor, or a CuPy array
wrapped through DLPack) is passed to the compiled model as it is and results stay on the device.

On this project's 2-core CPU, compiling takes ~1.5 min and the result scores ~7k beats/s (ONNX
Runtime: ~50k per core), so ``backend="auto"`` never picks it on the CPU; it is allowed there for
testing (whether it can run: :func:`beatflow.engine.options.aoti_available`). Import-safe without CUDA.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Optional

import numpy as np
import torch

from beatflow.engine.base import (
    TORCH_DTYPES,
    BatchProfile,
    Engine,
    PathLike,
    array_kind,
    as_cuda_tensor,
    check_matrix,
    from_cuda_tensor,
    precision_scorer,
)
from beatflow.engine.options import check_precision, cuda_device_index
from beatflow.errors import DeviceError
from beatflow.model.vae import Scorer

__all__ = ["AotInductorEngine"]



class AotInductorEngine(Engine):
    """AOTInductor-compiled scorer.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.pt2`` package.
    device : str
        ``"cpu"`` or ``"cuda[:N]"``: where the package was compiled for.
    precision : str
        ``"fp32"``, or ``"fp16"``/``"bf16"`` on a GPU (the VAE in half precision, the score in fp32).
    max_batch : int
        Largest batch per call (the ``max`` of the export's batch dimension).
    """

    name = "aoti"

    def __init__(self, path: PathLike, *, device: str = "cpu", precision: str = "fp32", max_batch: int = 8192):
        self.path = os.fspath(path)
        self.device_index = cuda_device_index(device)
        self.precision = check_precision(precision)
        self.max_batch = int(max_batch)
        self._model = None
        self._lock = threading.Lock()

    @property
    def on_gpu(self) -> bool:
        return self.device_index is not None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.device_index) if self.on_gpu else torch.device("cpu")

    @property
    def model(self):
        """The loaded ``AOTICompiledModel`` (loaded on first use)."""
        if self._model is None:
            with self._lock:
                if self._model is None:
                    from torch._inductor import aoti_load_package

                    if self.on_gpu and not torch.cuda.is_available():
                        raise DeviceError("AOTInductor engine compiled for CUDA, but torch sees no CUDA device")
                    self._model = aoti_load_package(self.path, device_index=self.device_index
                                                    if self.on_gpu else -1)
        return self._model

    _transient = ("_model",)

    @classmethod
    def build(cls, scorer: Scorer, path: PathLike, *, device: str = "cpu", precision: str = "fp32",
              batch_profile=(1, 1024, 8192), fused: Optional[bool] = None, **_ignored) -> "AotInductorEngine":
        """``torch.export`` the scorer (batch dimension ``min..max`` of the profile, example batch
        >= 2) and compile it with ``torch._inductor.aoti_compile_and_package`` to ``path``.

        ``fused`` exports the scorer's fusible form (:class:`beatflow.model.fused.FusedScorer`, same
        parameters and arithmetic) instead. Off by default: with torch 2.11 on the H200 that package
        compiles but crashes the process when loaded (see :mod:`beatflow.engine.compiled`, which
        runs the fused form through ``torch.compile`` instead)."""
        from torch._inductor import aoti_compile_and_package

        check_precision(precision)
        idx = cuda_device_index(device)
        if precision == "int8":
            raise ValueError("aoti: int8 is not supported (use onnxruntime on the CPU)")
        if precision in ("fp16", "bf16") and idx is None:
            raise ValueError(f"aoti: {precision} is for GPUs; on the CPU use fp32 (or onnxruntime int8)")
        profile = BatchProfile.coerce(batch_profile)
        dev = torch.device("cuda", idx) if idx is not None else torch.device("cpu")
        import copy

        if fused:
            from beatflow.model.fused import FusedScorer

            module = FusedScorer(copy.deepcopy(scorer.vae).to(dev), TORCH_DTYPES[precision]).to(dev).eval()
        else:
            module = precision_scorer(copy.deepcopy(scorer), precision).to(dev).eval()  # the caller's stays put
        hi = max(profile.max, profile.example)
        example = torch.zeros(profile.example, scorer.width, dtype=torch.float32, device=dev)
        batch = torch.export.Dim("batch", min=1, max=hi)
        quiet = logging.getLogger("torch")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                ep = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
                out = aoti_compile_and_package(ep, package_path=os.fspath(path))
        finally:
            quiet.setLevel(level)
        engine = cls(out, device=device, precision=precision, max_batch=hi)
        engine.model  # noqa: B018 - load now
        return engine

    def save(self, path: PathLike) -> None:
        """Copy the package to ``path``."""
        import shutil

        if os.path.abspath(path) != os.path.abspath(self.path):
            shutil.copyfile(self.path, path)

    @classmethod
    def load(cls, path: PathLike, *, device: str = "cpu", precision: str = "fp32", max_batch: int = 8192,
             threads: Optional[int] = None, **_ignored) -> "AotInductorEngine":
        """Load a ``.pt2`` package (immediately, so a bad file fails here).

        ``threads`` sets ``torch.set_num_threads`` (process-wide) for a CPU package.
        """
        engine = cls(path, device=device, precision=precision, max_batch=max_batch)
        if threads and not engine.on_gpu:
            torch.set_num_threads(int(threads))
        engine.model  # noqa: B018
        return engine

    def infer(self, beats, batch_size: int = 8192):
        """Score ``(n, D)`` beats; device input (GPU engine) is used in place, results stay there."""
        batch_size = max(1, min(int(batch_size), self.max_batch))
        kind = array_kind(beats)
        if self.on_gpu:
            x = as_cuda_tensor(beats, self.torch_device)
        else:
            if kind != "numpy":
                raise DeviceError("device beats given to a CPU AOTInductor engine: pass NumPy")
            x = torch.from_numpy(np.ascontiguousarray(beats, dtype=np.float32))
        check_matrix(x.shape)
        n = x.shape[0]
        model = self.model
        if n == 0:
            s = torch.zeros(0, dtype=torch.float32, device=x.device)
            m = torch.zeros((0, 2), dtype=torch.float32, device=x.device)
        else:
            parts_s, parts_m = [], []
            with torch.no_grad():
                for start in range(0, n, batch_size):
                    s, m = model(x[start:start + batch_size])
                    parts_s.append(s)
                    parts_m.append(m)
            s = parts_s[0] if len(parts_s) == 1 else torch.cat(parts_s)
            m = parts_m[0] if len(parts_m) == 1 else torch.cat(parts_m)
        if not self.on_gpu:
            return s.numpy(), m.numpy()
        return from_cuda_tensor(s, kind), from_cuda_tensor(m, kind)


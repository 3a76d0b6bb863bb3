"""Inference engines for the exported :class:`~beatflow.model.vae.Scorer`: the interface and what every backend shares.

An engine turns a beat matrix ``(n, D)`` float32 into ``(score (n,), mu (n, 2))`` float32 arrays.
:class:`Engine` is the small interface every backend implements (``build``, ``save``, ``load``,
``infer``). Backends:

* :class:`~beatflow.engine.onnx.OnnxRuntimeEngine`: ONNX Runtime, CPU execution provider by default, CUDA
  provider on a GPU (checked to really run there), int8 on CPU through static quantization.
* :class:`~beatflow.engine.compiled.CompiledEngine`: the fusible scorer through ``torch.compile`` (GPU).
* :class:`~beatflow.engine.aoti.AotInductorEngine`: ``torch.export`` + AOTInductor (GPU; CPU works
  but compiles for minutes and is slow).
* :class:`~beatflow.engine.tensorrt.TensorRtEngine`: TensorRT from the ONNX file, when ``tensorrt`` is
  importable.

Input is NumPy (results are NumPy) or, for a GPU engine, a CuPy array / CUDA torch tensor: then
it is handed to the runtime as device memory (no host copy) and the results stay on the device, of
the same kind as the input (:func:`array_kind`, :func:`as_cuda_tensor`, :func:`from_cuda_tensor`). Cached,
validated builds: :func:`beatflow.engine.cache.build_or_load_engine`; validation and timing:
:mod:`beatflow.engine.validate`.

Engines are picklable (they carry the serialized model, not the runtime session), so they can be
shipped to Dask workers; the session is re-created lazily on first use.

This module imports neither CuPy nor TensorRT, and GPU code paths import what they need lazily.
"""
from __future__ import annotations

import abc
import os
import threading
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from beatflow.engine.options import check_precision
from beatflow.errors import BeatflowError, DeviceError
from beatflow.model.vae import LightVAE, Scorer

__all__ = [
    "Engine",
    "EngineValidationError",
    "BatchProfile",
    "PathLike",
    "TORCH_DTYPES",
    "PrecisionScorer",
    "precision_scorer",
    "check_matrix",
    "array_kind",
    "as_cuda_tensor",
    "from_cuda_tensor",
]

PathLike = Union[str, os.PathLike]


class EngineValidationError(BeatflowError, RuntimeError):
    """An engine's scores differ from the PyTorch reference by more than the tolerance."""


# ----------------------------------------------------------------------------------------------
# batch profile, precision
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchProfile:
    """Batch sizes an engine is built for: ``min <= opt <= max`` (TensorRT's optimization profile).

    ONNX Runtime and AOTInductor graphs take any batch from 1 (ONNX) or ``min`` (AOTInductor) up
    to ``max``; :meth:`Engine.infer` feeds at most ``max`` rows per call.
    """

    min: int = 1
    opt: int = 1024
    max: int = 8192

    def __post_init__(self):
        if not (1 <= self.min <= self.opt <= self.max):
            raise ValueError(f"batch profile must satisfy 1 <= min <= opt <= max, got {tuple(self)}")

    def __iter__(self):
        return iter((self.min, self.opt, self.max))

    @classmethod
    def coerce(cls, profile) -> "BatchProfile":
        """A :class:`BatchProfile` from one, from ``(min, opt, max)`` or from a single int."""
        if isinstance(profile, cls):
            return profile
        if isinstance(profile, (int, np.integer)):
            return cls(1, int(profile), int(profile))
        lo, opt, hi = (int(v) for v in profile)
        return cls(lo, opt, hi)

    @property
    def example(self) -> int:
        """Batch of the example input used for export: at least 2 (so it is not specialised to 1)."""
        return max(2, min(self.opt, 16))


TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class PrecisionScorer(nn.Module):
    """The scorer with its VAE computed in ``dtype`` (fp16 or bf16) and fp32 input and outputs.

    The input beats stay float32 (so a device array from the pipeline is used as it is); the
    encoder/decoder run in ``dtype``; the reconstruction is cast back and the score (a mean of
    squares over ``D`` samples, where half precision would lose most) is computed in float32.

    Parameters
    ----------
    vae : LightVAE
        Trained model (copied, then cast).
    dtype : torch.dtype
        ``torch.float16`` or ``torch.bfloat16``.
    """

    def __init__(self, vae: LightVAE, dtype: torch.dtype):
        super().__init__()
        import copy

        self.vae = copy.deepcopy(vae).to(dtype).eval()
        self.width = vae.width
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, _ = self.vae.encode(x.to(self.dtype))
        recon = self.vae.decode(mu).to(torch.float32)
        score = (x - recon).square().mean(dim=1)
        return score, mu.to(torch.float32)


def precision_scorer(model: Union[Scorer, LightVAE], precision: str = "fp32") -> nn.Module:
    """The module to export for ``precision``: the :class:`Scorer` itself for fp32 and int8 (int8 is
    quantized after export), a :class:`PrecisionScorer` for fp16/bf16."""
    check_precision(precision)
    scorer = Scorer(model) if isinstance(model, LightVAE) else model
    if precision in ("fp32", "int8"):
        return scorer.eval()
    return PrecisionScorer(scorer.vae, TORCH_DTYPES[precision]).to(next(scorer.parameters()).device)


# ----------------------------------------------------------------------------------------------
# engine interface
# ----------------------------------------------------------------------------------------------

class Engine(abc.ABC):
    """Interface of an inference backend for the beat scorer.

    Engines travel to Dask workers by pickling: what a backend rebuilds lazily (sessions, compiled
    models) is named in ``_transient`` and dropped from the pickled state, with the lock.
    """

    #: attributes not pickled (rebuilt on first use after unpickling)
    _transient: tuple = ()

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in (*self._transient, "_lock"):
            state[key] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    #: Short backend name (``"onnxruntime"``, ``"tensorrt"``, ``"aoti"``).
    name: str = "engine"
    #: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"int8"``.
    precision: str = "fp32"
    #: Largest batch fed to the runtime in one call.
    max_batch: int = 8192

    @classmethod
    @abc.abstractmethod
    def build(cls, scorer: Scorer, path: PathLike, **options) -> "Engine":
        """Compile ``scorer`` into this backend's artifact at ``path`` and return a loaded engine."""

    @abc.abstractmethod
    def save(self, path: PathLike) -> None:
        """Write the engine's artifact to ``path``."""

    @classmethod
    @abc.abstractmethod
    def load(cls, path: PathLike, **options) -> "Engine":
        """Load an engine from an artifact written by :meth:`build` or :meth:`save`."""

    @abc.abstractmethod
    def infer(self, beats, batch_size: int = 8192):
        """``(score (n,), mu (n, 2))`` float32 for a beat matrix ``(n, D)``.

        NumPy in, NumPy out; on a GPU engine a CuPy array or CUDA torch tensor in gives results of
        the same kind on the same device (no host copy).
        """

    @property
    def on_gpu(self) -> bool:
        """Whether the engine computes on a CUDA device."""
        return False


def check_matrix(shape, width: Optional[int] = None) -> None:
    if len(shape) != 2:
        raise ValueError(f"beats must be a 2-D (n, D) matrix, got shape {tuple(shape)}")
    if width is not None and shape[1] != width:
        raise ValueError(f"beats have {shape[1]} samples per row, the engine expects {width}")


# ----------------------------------------------------------------------------------------------
# device arrays (CuPy / torch CUDA tensors) -- all imports lazy
# ----------------------------------------------------------------------------------------------

def array_kind(x) -> str:
    """``"torch"`` (a CUDA torch tensor), ``"cupy"`` (CuPy or any ``__cuda_array_interface__``
    array) or ``"numpy"`` (everything else, CPU torch tensors included)."""
    if isinstance(x, torch.Tensor):
        return "torch" if x.is_cuda else "numpy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cupy"
    return "numpy"


def as_cuda_tensor(x, device: Optional[torch.device] = None) -> torch.Tensor:
    """A contiguous float32 CUDA torch tensor over ``x``'s memory when possible.

    CuPy arrays are wrapped through DLPack (zero copy) after their stream is synchronised, so the
    data is complete before another stream reads it. A NumPy array is copied to ``device`` (the one
    host-to-device copy). Non-float32 or non-contiguous device input is converted on the device.
    """
    kind = array_kind(x)
    if kind == "torch":
        t = x
    elif kind == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        t = torch.from_dlpack(x)
    else:
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device or "cuda", non_blocking=False)
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    if device is not None and t.device != torch.device(device):
        raise DeviceError(f"beats are on {t.device}, the engine runs on {device}")
    return t.contiguous()


def from_cuda_tensor(t: torch.Tensor, kind: str):
    """Results in the caller's kind: the tensor itself, a CuPy view (DLPack) or a NumPy copy."""
    if kind == "torch":
        return t
    if kind == "cupy":
        import cupy

        torch.cuda.current_stream(t.device).synchronize()
        return cupy.from_dlpack(t)
    return t.cpu().numpy()

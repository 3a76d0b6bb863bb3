"""Inference engines for the exported :class:`~beatflow.model.vae.Scorer`.

An engine turns a beat matrix ``(n, D)`` float32 into ``(score (n,), mu (n, 2))`` float32 arrays.
:class:`Engine` is the small interface every backend implements (``build``, ``save``, ``load``,
``infer``). Backends:

* :class:`OnnxRuntimeEngine` (here): ONNX Runtime, CPU execution provider by default, CUDA provider
  on a GPU (checked to really run there), int8 on CPU through static quantization.
* :class:`~beatflow.engine.aoti.AotInductorEngine`: ``torch.export`` + AOTInductor (GPU; CPU works
  but compiles for minutes and is slow).
* :class:`~beatflow.engine.tensorrt.TensorRtEngine`: TensorRT from the ONNX file, when ``tensorrt`` is
  importable.

Input is NumPy (results are NumPy) or, for a GPU engine, a CuPy array / CUDA torch tensor: then
it is handed to the runtime as device memory (no host copy) and the results stay on the device, of
the same kind as the input. Cached, validated builds: :func:`beatflow.engine.cache.build_or_load_engine`.

Engines are picklable (they carry the serialized model, not the runtime session), so they can be
shipped to Dask workers; the session is re-created lazily on first use.

This module imports neither CuPy nor TensorRT, and GPU code paths import what they need lazily.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from beatflow.engine.options import PRECISIONS, check_precision, cuda_device_index  # noqa: F401  (re-exported)
from beatflow.errors import BeatflowError, DeviceError
from beatflow.model.vae import LATENT_DIM, Downsample, LightVAE, Scorer, score_beats

__all__ = [
    "Engine",
    "EngineValidationError",
    "OnnxRuntimeEngine",
    "BatchProfile",
    "Tolerance",
    "TOLERANCES",
    "PRECISIONS",
    "PrecisionScorer",
    "precision_scorer",
    "optimize_for_onnx_cpu",
    "export_onnx",
    "quantize_onnx_int8",
    "output_layers",
    "compare_engine",
    "validate_engine",
    "throughput",
]

INPUT_NAME = "beats"
#: ONNX operators quantized for int8 (see :func:`quantize_onnx_int8`).
INT8_OPS = ("Conv", "Gemm")
OUTPUT_NAMES = ("score", "mu")

PathLike = Union[str, os.PathLike]


class EngineValidationError(BeatflowError, RuntimeError):
    """An engine's scores differ from the PyTorch reference by more than the tolerance."""


# ----------------------------------------------------------------------------------------------
# batch profile, precision, tolerances
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


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted difference from the fp32 PyTorch reference, per value:
    ``|engine - torch| <= atol + rtol * |torch|`` for the score and ``mu_atol + mu_rtol * |torch|``
    for ``mu``."""

    atol: float
    rtol: float
    mu_atol: float
    mu_rtol: float

    def to_dict(self) -> dict:
        return asdict(self)


#: Per-precision validation tolerances, chosen from measured errors (``bench/RESULTS_engine.md``;
#: trained LightVAEs on synthetic beats, scores ~0.04..1.9, |mu| < 0.1):
#:
#: * fp32: all-float32 graph, only summation order differs (measured <= 1.2e-7) -- the seed's 1e-4.
#: * fp16 (GPU): VAE in half precision, the score's MSE in fp32. Measured on the H200 (AOTInductor):
#:   1.2e-4 abs / 3.4e-4 rel on scores, 7e-5 on mu -- ~30x inside the bound.
#: * bf16 (GPU): 3 fewer mantissa bits than fp16. Measured on the H200: 3.3e-3 abs / 1.1e-2 rel on
#:   scores, 4.3e-4 on mu -- ~4x inside the relative bound.
#: * int8 (CPU, ONNX Runtime static quantization of the inner convolutions and the linear layer):
#:   measured <= 2.3e-4 abs / 0.15 % rel on scores and <= 1.8e-3 on mu on two trained models;
#:   ~5x inside the relative bound.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-3, mu_atol=1e-4, mu_rtol=1e-3),
    "fp16": Tolerance(atol=5e-4, rtol=1e-2, mu_atol=2e-3, mu_rtol=1e-2),
    "bf16": Tolerance(atol=2e-3, rtol=5e-2, mu_atol=1e-2, mu_rtol=5e-2),
    "int8": Tolerance(atol=2e-4, rtol=1e-2, mu_atol=1e-2, mu_rtol=5e-2),
}

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    return PrecisionScorer(scorer.vae, _TORCH_DTYPES[precision]).to(next(scorer.parameters()).device)


# ----------------------------------------------------------------------------------------------
# exact graph rewrites for ONNX Runtime on the CPU
# ----------------------------------------------------------------------------------------------

class FlatDownsample(nn.Module):
    """:class:`~beatflow.model.vae.Downsample` as one single-channel 2-D convolution over all rows.

    ``(B, C, L)`` is viewed as one ``(1, 1, B*C, L)`` image and filtered with the ``(1, 3)`` kernel
    at stride ``(1, 2)``: one GEMM instead of ONNX Runtime's per-image, per-group depthwise
    convolution, which dominates the CPU profile (~30 %). Same arithmetic, bit for bit.
    """

    def __init__(self, ds: Downsample):
        super().__init__()
        kernel = ds.kernel[:1].detach().clone()  # every channel has the same [1, 2, 1] / 4 filter
        if not torch.equal(ds.kernel, kernel.expand_as(ds.kernel)):
            raise ValueError("FlatDownsample needs the same filter for every channel")
        self.register_buffer("kernel", kernel.unsqueeze(2), persistent=False)  # (1, 1, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, n = x.shape
        y = F.conv2d(x.reshape(1, 1, b * c, n), self.kernel, stride=(1, 2), padding=(0, 1))
        return y.reshape(b, c, y.shape[-1])


class UpsampleConv(nn.Module):
    """Nearest x2 upsampling followed by ``conv1d(k=3, padding=1)``, without the upsampled tensor.

    With ``u[2i] = u[2i+1] = h[i]``: ``y[2i] = w0 h[i-1] + (w1 + w2) h[i]`` and
    ``y[2i+1] = (w0 + w1) h[i] + w2 h[i+1]`` (zero padding maps to zero padding), i.e. one
    ``conv1d`` to ``2 * Cout`` channels (even and odd outputs) on the short signal, then an
    interleave. Half the multiply-adds and no Resize; equal up to float rounding (~1e-8).
    """

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        w = conv.weight.detach()
        cout, cin, _ = w.shape
        zero = torch.zeros_like(w[:, :, 0])
        even = torch.stack([w[:, :, 0], w[:, :, 1] + w[:, :, 2], zero], 2)
        odd = torch.stack([zero, w[:, :, 0] + w[:, :, 1], w[:, :, 2]], 2)
        self.conv = nn.Conv1d(cin, 2 * cout, 3, padding=1, bias=conv.bias is not None)
        with torch.no_grad():
            self.conv.weight.copy_(torch.stack([even, odd], 1).reshape(2 * cout, cin, 3))
            if conv.bias is not None:
                self.conv.bias.copy_(conv.bias.detach().repeat_interleave(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.conv(h)
        b, c2, n = y.shape
        return y.reshape(b, c2 // 2, 2, n).transpose(2, 3).reshape(b, c2 // 2, 2 * n)


def _is_nearest_x2(m: nn.Module) -> bool:
    if not isinstance(m, nn.Upsample) or m.mode != "nearest" or m.size is not None:
        return False
    sf = m.scale_factor
    sf = sf if isinstance(sf, (tuple, list)) else (sf,)
    return all(float(v) == 2.0 for v in sf)


def _is_plain_k3(m: nn.Module) -> bool:
    return (isinstance(m, nn.Conv1d) and m.kernel_size == (3,) and m.padding == (1,) and m.stride == (1,)
            and m.dilation == (1,) and m.groups == 1 and m.padding_mode == "zeros")


def optimize_for_onnx_cpu(scorer: Union[Scorer, LightVAE]) -> Scorer:
    """A copy of the scorer with the exact rewrites :class:`FlatDownsample` and :class:`UpsampleConv`
    applied inside its ``nn.Sequential`` blocks (~1.3x faster in ONNX Runtime on the CPU; see
    ``bench/RESULTS_engine.md``). Engines built from it are validated against the original."""
    import copy

    scorer = Scorer(scorer) if isinstance(scorer, LightVAE) else scorer
    out = copy.deepcopy(scorer).eval()
    for seq in [m for m in out.modules() if isinstance(m, nn.Sequential)]:
        items, new, i = list(seq), [], 0
        while i < len(items):
            m = items[i]
            if isinstance(m, Downsample):
                new.append(FlatDownsample(m))
                i += 1
            elif _is_nearest_x2(m) and i + 1 < len(items) and _is_plain_k3(items[i + 1]):
                new.append(UpsampleConv(items[i + 1]))
                i += 2
            else:
                new.append(m)
                i += 1
        seq._modules.clear()
        for j, m in enumerate(new):
            seq.add_module(str(j), m)
    return out


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


@contextlib.contextmanager
def torch_threads(n: int):
    """Temporarily ``torch.set_num_threads(n)`` (process-wide; restored after). Eager PyTorch on
    tiny-channel convolutions is as fast on one thread on a quiet machine and 10-30x faster on a
    busy one (OpenMP barriers); used for the reference scores and for export tracing."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_matrix(shape, width: Optional[int] = None) -> None:
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


# ----------------------------------------------------------------------------------------------
# ONNX export and int8 quantization
# ----------------------------------------------------------------------------------------------

def export_onnx(scorer: Union[Scorer, LightVAE, nn.Module], path: PathLike, width: Optional[int] = None,
                opset: int = 18, *, dynamo: bool = True, precision: str = "fp32", example_batch: int = 4,
                optimize: bool = False) -> str:
    """Export the scorer to ONNX with a dynamic batch dimension.

    Parameters
    ----------
    scorer : Scorer or LightVAE
        The model to export (a LightVAE is wrapped in a :class:`Scorer`).
    path : str or os.PathLike
        Destination ``.onnx`` file (the weights are stored inside it).
    width : int, optional
        Samples per beat ``D``; defaults to the model's width, and must match it.
    opset : int
        ONNX opset version.
    dynamo : bool
        Use the ``torch.export``-based exporter (default). ``False`` uses the legacy
        TorchScript exporter: deprecated upstream, but ~0.3 s instead of ~4-9 s on a small CPU.
    precision : str
        ``"fp32"`` (and ``"int8"``: quantize the fp32 graph afterwards with
        :func:`quantize_onnx_int8`), or ``"fp16"``/``"bf16"``: the graph of a
        :class:`PrecisionScorer` (float32 input and outputs, the VAE in half precision).
    example_batch : int
        Batch of the example input traced; at least 2 so the batch is not specialised to 1.
    optimize : bool
        Export :func:`optimize_for_onnx_cpu` of the scorer (exact rewrites that make ONNX Runtime
        on the CPU ~1.3x faster); fp32 only: do not quantize the result (ONNX Runtime 1.32 aborts
        on a C++ assertion creating a session for the quantized rewritten graph).

    Returns
    -------
    str
        ``path`` as a string.

    Notes
    -----
    The graph has one input ``"beats"`` of shape ``(batch, D)`` float32 and two outputs
    ``"score"`` ``(batch,)`` and ``"mu"`` ``(batch, 2)`` float32; the result is checked with
    :func:`onnx.checker.check_model`.
    """
    import onnx

    if isinstance(scorer, LightVAE):
        scorer = Scorer(scorer)
    width = scorer.width if width is None else int(width)
    if width != scorer.width:
        raise ValueError(f"export width {width} does not match the model width {scorer.width}")
    if optimize and isinstance(scorer, Scorer) and precision == "fp32":
        scorer = optimize_for_onnx_cpu(scorer)
    module = precision_scorer(scorer, precision) if isinstance(scorer, Scorer) else scorer.eval()
    device = next(module.parameters()).device
    example = torch.zeros(max(2, int(example_batch)), width, dtype=torch.float32, device=device)
    path = os.fspath(path)
    quiet = logging.getLogger("torch.onnx")  # "torchvision is not installed" chatter
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad(), torch_threads(1):
            warnings.simplefilter("ignore")
            if dynamo:
                program = torch.onnx.export(
                    module,
                    (example,),
                    dynamo=True,
                    input_names=[INPUT_NAME],
                    output_names=list(OUTPUT_NAMES),
                    dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
                    opset_version=opset,
                    verbose=False,
                )
                program.save(path, external_data=False)
            else:
                torch.onnx.export(
                    module,
                    (example,),
                    path,
                    dynamo=False,
                    input_names=[INPUT_NAME],
                    output_names=list(OUTPUT_NAMES),
                    dynamic_axes={name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)},
                    opset_version=opset,
                )
    finally:
        quiet.setLevel(level)
    onnx.checker.check_model(path, full_check=True)
    return path


def quantize_onnx_int8(fp32_path: PathLike, out_path: PathLike, calibration_beats: np.ndarray, *,
                       calibration_batch: int = 256) -> str:
    """Static int8 quantization of an fp32 ONNX scorer with ONNX Runtime.

    Parameters
    ----------
    fp32_path : str or os.PathLike
        ONNX file written by :func:`export_onnx` (fp32).
    out_path : str or os.PathLike
        Destination of the quantized model.
    calibration_beats : numpy.ndarray
        ``(n, D)`` beats, scaled as at inference, whose activation ranges set the quantization
        parameters (MinMax calibration). Use beats not used for validation.
    calibration_batch : int
        Rows per calibration batch.

    Returns
    -------
    str
        ``out_path``.

    Notes
    -----
    Only the convolutions and the linear layer (:data:`INT8_OPS`, where the arithmetic is) are
    quantized, and of those not the layers that produce the outputs (:func:`output_layers`: the
    latent head and the last decoder convolution); the Swish, the upsampling and the score
    (``mean((x - recon)^2)``) stay float32. Measured on trained LightVAEs:

    * quantizing every op also quantizes the residual ``x - recon`` and its square (small values on
      the scale of ``x``; the legacy exporter writes the square as a quantizable ``Mul``): up to
      10 % of a score;
    * the latent head in int8: |mu| error ~0.02 -- as large as mu itself when the posterior has
      collapsed (|mu| < 0.05), and the decoder amplifies it;
    * the last decoder convolution, fused by ONNX Runtime 1.32 into an int8 kernel: 0.024 abs
      (35 % rel) on every score of one model, 4.5e-4 without the fusion;
    * QDQ format, symmetric int8 activations and per-channel symmetric int8 weights: ~20x more
      accurate than asymmetric uint8 activations. Result: <= 1.5e-3 relative score error.
    """
    import tempfile

    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    x = np.ascontiguousarray(calibration_beats, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"int8 calibration needs a non-empty (n, D) beat matrix, got shape {x.shape}")
    batches = [x[i:i + calibration_batch] for i in range(0, x.shape[0], calibration_batch)]

    class _Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(batches)

        def get_next(self):
            b = next(self._it, None)
            return None if b is None else {INPUT_NAME: b}

        def rewind(self):
            self._it = iter(batches)

    out_path = os.fspath(out_path)
    with tempfile.TemporaryDirectory(prefix="beatflow-q-") as tmp:
        pre = os.path.join(tmp, "pre.onnx")
        # symbolic shape inference cannot resolve the dynamic batch through Resize: ONNX's suffices
        quant_pre_process(os.fspath(fp32_path), pre, skip_symbolic_shape=True)
        keep_float = output_layers(pre)
        quiet = logging.getLogger()
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            quantize_static(pre, out_path, _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            op_types_to_quantize=list(INT8_OPS), nodes_to_exclude=keep_float,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax,
                            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
        finally:
            quiet.setLevel(level)
    return out_path


def output_layers(onnx_path: PathLike) -> list[str]:
    """Names of the Conv/Gemm/MatMul nodes nearest to the graph outputs: on every path back from
    an output, the first such node (for the scorer: the latent head and the last decoder conv)."""
    import onnx

    model = onnx.load(os.fspath(onnx_path), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    found, seen, stack = [], set(), [o.name for o in model.graph.output]
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in ("Conv", "Gemm", "MatMul", "ConvTranspose"):
            found.append(node.name)
        else:
            stack.extend(node.input)
    return found


# ----------------------------------------------------------------------------------------------
# ONNX Runtime
# ----------------------------------------------------------------------------------------------

class OnnxRuntimeEngine(Engine):
    """ONNX Runtime backend.

    Parameters
    ----------
    model_bytes : bytes
        Serialized ONNX model (as written by :func:`export_onnx` or :func:`quantize_onnx_int8`).
    providers : sequence of str, optional
        ONNX Runtime execution providers; default ``["CPUExecutionProvider"]``. Prefer
        ``device=`` for the CUDA provider.
    intra_op_num_threads : int, optional
        Threads per operator (ONNX Runtime's default when omitted: one per physical core).
    device : str, optional
        ``"cpu"`` (default) or ``"cuda[:N]"``: the CUDA execution provider on GPU ``N``; the
        session is checked to really run on it (else :class:`~beatflow.errors.DeviceError`).
    feeders : int
        Batches run concurrently on the one session from this many Python threads (ONNX Runtime
        releases the GIL; ``session.run`` is thread-safe). On a small CPU, ``feeders=cores`` with
        ``intra_op_num_threads=1`` beats one run with ``cores`` intra-op threads (see
        ``bench/RESULTS_engine.md``). CPU only.
    precision : str
        What the graph computes in (informational; the graph decides).
    max_batch : int
        Largest batch per ``session.run``.
    graph_optimization_level : str
        ``"all"`` (default), ``"extended"``, ``"basic"`` or ``"disable"``.
    allow_spinning : bool, optional
        ONNX Runtime intra-op thread pool spin-waiting; default: ONNX Runtime's (on), turned off
        automatically when ``feeders > 1`` so the pools do not steal each other's cores.
    session_options : dict, optional
        Further ``onnxruntime.SessionOptions`` attributes, e.g. ``{"enable_cpu_mem_arena": False,
        "execution_mode": "parallel"}`` (used by the benchmark's configuration sweep).
    """

    name = "onnxruntime"

    def __init__(self, model_bytes: bytes, providers: Optional[Sequence[str]] = None,
                 intra_op_num_threads: Optional[int] = None, *, device: str = "cpu", feeders: int = 1,
                 precision: str = "fp32", max_batch: int = 8192, graph_optimization_level: str = "all",
                 allow_spinning: Optional[bool] = None, session_options: Optional[dict] = None):
        self.model_bytes = bytes(model_bytes)
        self.device_index = cuda_device_index(device)
        if providers:
            self.providers = list(providers)
        elif self.device_index is not None:
            self.providers = [("CUDAExecutionProvider", {"device_id": self.device_index}), "CPUExecutionProvider"]
        else:
            self.providers = ["CPUExecutionProvider"]
        self.intra_op_num_threads = intra_op_num_threads
        self.feeders = max(1, int(feeders)) if self.device_index is None else 1
        self.precision = check_precision(precision)
        self.max_batch = max(1, int(max_batch))
        self.graph_optimization_level = graph_optimization_level
        self.allow_spinning = allow_spinning
        self.session_options = dict(session_options or {})
        self._session = None
        self._pool = None
        self._lock = threading.Lock()

    @property
    def on_gpu(self) -> bool:
        return self.device_index is not None

    def _session_options(self):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if self.intra_op_num_threads:
            opts.intra_op_num_threads = int(self.intra_op_num_threads)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        levels = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
        opts.graph_optimization_level = levels[self.graph_optimization_level]
        spin = self.allow_spinning if self.allow_spinning is not None else (False if self.feeders > 1 else None)
        if spin is not None:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        for name, value in self.session_options.items():
            if name == "execution_mode" and isinstance(value, str):
                value = getattr(ort.ExecutionMode, f"ORT_{value.upper()}")
            setattr(opts, name, value)
        return opts

    @property
    def session(self):
        """The ``onnxruntime.InferenceSession`` (created on first use)."""
        if self._session is None:
            with self._lock:
                if self._session is None:
                    import onnxruntime as ort

                    if self.on_gpu and "CUDAExecutionProvider" not in ort.get_available_providers():
                        raise DeviceError("ONNX Runtime has no CUDA execution provider: pip install onnxruntime-gpu "
                                          f"(available: {', '.join(ort.get_available_providers())})")
                    # NCHWc blocks tiny-channel convolutions to 8 channels: 1.5-4x slower here
                    extra = {} if self.on_gpu else {"disabled_optimizers": ["NchwcTransformer"]}
                    sess = ort.InferenceSession(self.model_bytes, sess_options=self._session_options(),
                                                providers=self.providers, **extra)
                    if self.on_gpu and sess.get_providers()[0] != "CUDAExecutionProvider":
                        # ORT falls back to the CPU silently when the CUDA libraries fail to load
                        raise DeviceError("ONNX Runtime did not create a CUDA session (CUDA/cuDNN libraries "
                                          f"missing?): providers {sess.get_providers()}")
                    self._session = sess
        return self._session

    @property
    def width(self) -> int:
        """Samples per beat ``D`` expected by the model."""
        return int(self.session.get_inputs()[0].shape[1])

    _transient = ("_session", "_pool")

    @classmethod
    def build(cls, scorer: Scorer, path: PathLike, *, opset: int = 18, dynamo: bool = True,
              providers: Optional[Sequence[str]] = None, intra_op_num_threads: Optional[int] = None,
              precision: str = "fp32", calibration_beats: Optional[np.ndarray] = None, optimize: bool = False,
              **options) -> "OnnxRuntimeEngine":
        """Export ``scorer`` to ``path`` (see :func:`export_onnx`) and load it.

        For ``precision="int8"`` the fp32 export is quantized (:func:`quantize_onnx_int8`) with
        ``calibration_beats`` and ``path`` holds the quantized model. Other ``options`` go to
        :meth:`load`.
        """
        check_precision(precision)
        if precision == "int8":
            if calibration_beats is None:
                raise ValueError("int8 needs calibration_beats")
            path = os.fspath(path)
            fp32 = path + ".fp32.onnx"
            try:
                export_onnx(scorer, fp32, opset=opset, dynamo=dynamo)  # not optimize: see export_onnx
                quantize_onnx_int8(fp32, path, calibration_beats)
            finally:
                if os.path.exists(fp32):
                    os.unlink(fp32)
        else:
            export_onnx(scorer, path, opset=opset, dynamo=dynamo, precision=precision, optimize=optimize)
        return cls.load(path, providers=providers, intra_op_num_threads=intra_op_num_threads,
                        precision=precision, **options)

    def save(self, path: PathLike) -> None:
        """Write the ONNX model to ``path``."""
        with open(path, "wb") as fh:
            fh.write(self.model_bytes)

    @classmethod
    def load(cls, path: PathLike, providers: Optional[Sequence[str]] = None,
             intra_op_num_threads: Optional[int] = None, **options) -> "OnnxRuntimeEngine":
        """Load an ONNX file; the session is created immediately so a bad file fails here.

        Parameters
        ----------
        path : str or os.PathLike
            ONNX file written by :func:`export_onnx`.
        providers : sequence of str, optional
            Execution providers; default ``["CPUExecutionProvider"]`` (or CUDA for ``device=``).
        intra_op_num_threads : int, optional
            Threads per operator.
        **options
            ``device``, ``feeders``, ``precision``, ``max_batch``, ``graph_optimization_level``,
            ``allow_spinning`` (see the class).

        Returns
        -------
        OnnxRuntimeEngine
        """
        with open(path, "rb") as fh:
            engine = cls(fh.read(), providers=providers, intra_op_num_threads=intra_op_num_threads, **options)
        engine.session  # noqa: B018 - validate now
        return engine

    # -- inference ---------------------------------------------------------------------------

    def infer(self, beats, batch_size: int = 8192):
        """Score a beat matrix.

        Parameters
        ----------
        beats : numpy.ndarray, or on a CUDA engine a CuPy array / CUDA torch tensor
            ``(n, D)``; NumPy input is converted to contiguous float32 if needed. Device input is
            bound to the session as device memory (IOBinding), no host copy.
        batch_size : int
            Rows per ``session.run`` call (at most ``max_batch``).

        Returns
        -------
        score : float32 ``(n,)``
        mu : float32 ``(n, 2)``
            NumPy for NumPy input; of the input's kind and device otherwise.
        """
        batch_size = max(1, min(int(batch_size), self.max_batch))
        if array_kind(beats) != "numpy":
            if not self.on_gpu:
                raise DeviceError("device beats given to a CPU ONNX Runtime engine: pass NumPy")
            return self._infer_device(beats, batch_size)
        x = np.ascontiguousarray(beats, dtype=np.float32)
        _check_matrix(x.shape)
        n = x.shape[0]
        score = np.empty(n, dtype=np.float32)
        mu = np.empty((n, LATENT_DIM), dtype=np.float32)
        sess = self.session
        feeders = self.feeders
        if feeders > 1 and n > 1:
            # split so that every feeder has work, but not into tiny pieces
            per = max(1, min(batch_size, math.ceil(n / feeders)))
            if n > batch_size or per >= 64:
                batch_size = per
        starts = range(0, n, batch_size)

        def run(start: int) -> None:
            s, m = sess.run(list(OUTPUT_NAMES), {INPUT_NAME: x[start:start + batch_size]})
            score[start:start + len(s)] = s
            mu[start:start + len(s)] = m

        if feeders > 1 and len(starts) > 1:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(feeders, thread_name_prefix="beatflow-ort")
            for f in [self._pool.submit(run, st) for st in starts]:
                f.result()
        else:
            for st in starts:
                run(st)
        return score, mu

    def _infer_device(self, beats, batch_size: int):
        kind = array_kind(beats)
        dev = torch.device("cuda", self.device_index)
        x = as_cuda_tensor(beats, dev)
        _check_matrix(x.shape)
        n = x.shape[0]
        score = torch.empty(n, dtype=torch.float32, device=dev)
        mu = torch.empty((n, LATENT_DIM), dtype=torch.float32, device=dev)
        # the producer (torch's current stream) must be done before ORT's stream reads the input
        torch.cuda.current_stream(dev).synchronize()
        sess = self.session
        for start in range(0, n, batch_size):
            xb = x[start:start + batch_size]
            m = xb.shape[0]
            io = sess.io_binding()
            io.bind_input(INPUT_NAME, "cuda", self.device_index, np.float32, tuple(xb.shape), xb.data_ptr())
            io.bind_output(OUTPUT_NAMES[0], "cuda", self.device_index, np.float32, (m,), score[start:].data_ptr())
            io.bind_output(OUTPUT_NAMES[1], "cuda", self.device_index, np.float32, (m, LATENT_DIM),
                           mu[start:].data_ptr())
            sess.run_with_iobinding(io)
            io.synchronize_outputs()
        return from_cuda_tensor(score, kind), from_cuda_tensor(mu, kind)


# ----------------------------------------------------------------------------------------------
# validation and timing
# ----------------------------------------------------------------------------------------------

def compare_engine(engine: Engine, scorer: Union[Scorer, LightVAE], beats: np.ndarray,
                   reference: Optional[tuple] = None) -> dict:
    """Engine against the eager fp32 PyTorch scorer on ``beats``.

    ``reference``: the scorer's ``(score, mu)`` on these beats when already known (they are a pure
    function of the weights and the beats), else computed here.

    Returns
    -------
    dict
        ``ref_score``, ``ref_mu``, ``score``, ``mu`` (NumPy), ``max_abs_err`` (score) and
        ``max_abs_err_mu``; NaN errors when a value is not finite.
    """
    x = np.ascontiguousarray(beats, dtype=np.float32)
    if reference is None:
        with torch_threads(1):
            ref_s, ref_mu = score_beats(scorer, x)
    else:
        ref_s, ref_mu = reference
    got_s, got_mu = engine.infer(x)
    got_s, got_mu = np.asarray(got_s), np.asarray(got_mu)

    def err(a, b):
        if a.shape != b.shape:
            return float("nan")
        if a.size == 0:
            return 0.0
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return float(d.max()) if np.isfinite(d).all() else float("nan")

    return {"ref_score": ref_s, "ref_mu": ref_mu, "score": got_s, "mu": got_mu,
            "max_abs_err": err(got_s, ref_s), "max_abs_err_mu": err(got_mu, ref_mu)}


def validate_engine(engine: Engine, scorer: Union[Scorer, LightVAE], beats: np.ndarray, *,
                    atol: float = 1e-4, rtol: float = 1e-3, mu_atol: Optional[float] = None,
                    mu_rtol: Optional[float] = None, report: Optional[dict] = None,
                    reference: Optional[tuple] = None) -> float:
    """Compare an engine's scores with the eager PyTorch scorer (``reference``: its ``(score, mu)``
    on ``beats`` when already known, see :func:`compare_engine`).

    Parameters
    ----------
    engine : Engine
        Engine under test.
    scorer : Scorer or LightVAE
        Reference model (fp32).
    beats : numpy.ndarray
        Beats to compare on, ``(n, D)``.
    atol, rtol : float
        Tolerance: every score must satisfy ``|engine - torch| <= atol + rtol * |torch|``.
    mu_atol, mu_rtol : float, optional
        The same for ``mu``; default ``atol`` and ``rtol``.
    report : dict, optional
        Filled with what :func:`compare_engine` returns.

    Returns
    -------
    float
        Maximum absolute score difference.

    Raises
    ------
    EngineValidationError
        A score or ``mu`` is off by more than the tolerance, or is not finite (one-line message).
    """
    mu_atol = atol if mu_atol is None else mu_atol
    mu_rtol = rtol if mu_rtol is None else mu_rtol
    res = compare_engine(engine, scorer, beats, reference)
    if report is not None:
        report.update(res)
    name = getattr(engine, "name", type(engine).__name__)
    prec = getattr(engine, "precision", "")
    label = f"{name} {prec}".strip()
    ref_s, ref_mu, got_s, got_mu = res["ref_score"], res["ref_mu"], res["score"], res["mu"]
    if got_s.shape != ref_s.shape or got_mu.shape != ref_mu.shape:
        raise EngineValidationError(
            f"{label} engine output shapes {got_s.shape}, {got_mu.shape} differ from the reference "
            f"{ref_s.shape}, {ref_mu.shape}")
    for what, got, ref, a, r in (("score", got_s, ref_s, atol, rtol), ("mu", got_mu, ref_mu, mu_atol, mu_rtol)):
        if got.size == 0:
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        ok = np.isfinite(got) & (diff <= a + r * np.abs(ref))
        if not ok.all():
            worst = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("nan")
            raise EngineValidationError(
                f"{label} engine {what} differs from PyTorch: max abs error {worst:.3g} "
                f"exceeds tolerance atol={a:g}, rtol={r:g} on {int((~ok).sum())} of {got.size} values")
    return res["max_abs_err"]


def throughput(engine: Engine, beats, batch_size: int = 8192, *, repeats: int = 1,
               warmup: bool = True) -> float:
    """Beats per second of ``engine.infer`` on ``beats``.

    Parameters
    ----------
    engine : Engine
        Engine to time.
    beats : numpy.ndarray (or a device array for a GPU engine)
        Beat matrix ``(n, D)``.
    batch_size : int
        Batch size passed to :meth:`Engine.infer`.
    repeats : int
        Timed passes over ``beats``; the best pass counts.
    warmup : bool
        Run one untimed batch first (session creation, allocator warm-up).

    Returns
    -------
    float
        ``n / seconds`` of the fastest pass (monotonic clock; a device is synchronised after
        each pass).
    """
    x = np.ascontiguousarray(beats, dtype=np.float32) if array_kind(beats) == "numpy" else beats
    n = x.shape[0]
    if n == 0:
        return 0.0
    sync = _synchronizer(x)
    if warmup:
        engine.infer(x[:batch_size], batch_size=batch_size)
        sync()
    best = float("inf")
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        engine.infer(x, batch_size=batch_size)
        sync()
        best = min(best, time.perf_counter() - t0)
    return n / max(best, 1e-12)


PROFILE_BATCHES = (1, 32, 256, 1024, 8192)


def timer(gpu: bool) -> Callable[[Callable[[], Any]], float]:
    """``timed(fn)``: seconds ``fn()`` takes; on a GPU between two CUDA events on the current stream
    (then synchronised), else by the monotonic clock."""
    if gpu:
        def timed(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return timed

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def profile_engine(engine: Engine, beats, batches=PROFILE_BATCHES, *, latency_calls: int = 200,
                   min_rows: int = 4096) -> dict[str, Any]:
    """Latency at batch 1 and throughput by batch size of ``engine.infer``.

    Parameters
    ----------
    engine : Engine
        Engine to profile (a GPU engine gets device input: ``beats`` are copied to its device once).
    beats : numpy.ndarray
        ``(n, D)`` rows to feed (repeated up to ``max(min_rows, largest batch)`` rows).
    batches : sequence of int
        Batch sizes for the throughput (those above the engine's ``max_batch`` are skipped).
    latency_calls : int
        Timed single-beat calls (after 20 untimed ones).

    Returns
    -------
    dict
        ``latency_batch1_us`` {``p50``, ``p99``, ``calls``}; ``throughput_beats_per_s`` {batch:
        beats/s, best of 2 passes over the rows}; ``clock``: ``"cuda events"`` on a GPU (an event
        pair around each call, then a synchronisation), else ``"monotonic"``.
    """
    x = np.ascontiguousarray(beats, dtype=np.float32)
    if len(x) == 0:
        return {"latency_batch1_us": None, "throughput_beats_per_s": {}, "clock": None}
    limit = getattr(engine, "max_batch", None)
    sizes = [int(b) for b in batches if 0 < int(b) and (limit is None or int(b) <= int(limit))]
    rows = max(min_rows, max(sizes, default=1))
    if len(x) < rows:
        x = np.concatenate([x] * int(np.ceil(rows / len(x))))[:rows]
    if engine.on_gpu:
        x = torch.from_numpy(x).to(torch.device("cuda", getattr(engine, "device_index", 0) or 0))
    timed, clock = timer(engine.on_gpu), ("cuda events" if engine.on_gpu else "monotonic")
    one = x[:1]
    for _ in range(20):
        engine.infer(one, batch_size=1)
    lat = np.array([timed(lambda: engine.infer(one, batch_size=1)) for _ in range(max(1, int(latency_calls)))]) * 1e6
    out = {"latency_batch1_us": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
                                 "calls": int(lat.size)},
           "throughput_beats_per_s": {}, "clock": clock}
    for b in sizes:
        n = max(b, min(rows, 4 * b)) if b < 256 else rows  # small batches: fewer rows, as many calls
        chunk = x[:n]
        engine.infer(chunk, batch_size=b)  # warm-up: this shape's allocations, graphs, compilation
        best = min(timed(lambda: engine.infer(chunk, batch_size=b)) for _ in range(2))
        out["throughput_beats_per_s"][b] = float(n / max(best, 1e-12))
    return out


def _synchronizer(x):
    kind = array_kind(x)
    if kind == "torch":
        return lambda: torch.cuda.synchronize(x.device)
    if kind == "cupy":
        import cupy

        return lambda: cupy.cuda.get_current_stream().synchronize()
    return lambda: None


def engine_options_summary(engine: Engine) -> dict[str, Any]:
    """Small, JSON-able description of a loaded engine (for reports)."""
    out = {"backend": engine.name, "precision": engine.precision, "max_batch": engine.max_batch,
           "on_gpu": engine.on_gpu}
    if getattr(engine, "cudagraphs", None) is not None:
        out["cuda_graphs"] = bool(engine.cudagraphs)
    if isinstance(engine, OnnxRuntimeEngine):
        out.update(providers=[p if isinstance(p, str) else p[0] for p in engine.providers],
                   intra_op_num_threads=engine.intra_op_num_threads, feeders=engine.feeders)
    return out

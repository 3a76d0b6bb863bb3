"""ONNX: the scorer's export (with exact CPU rewrites), its int8 quantization, and the ONNX Runtime engine.

:func:`export_onnx` writes the scorer as an ONNX graph with a dynamic batch (input ``"beats"``, outputs
``"score"`` and ``"mu"``); :func:`optimize_for_onnx_cpu` rewrites it exactly for ONNX Runtime on the CPU;
:func:`quantize_onnx_int8` quantizes it statically. :class:`OnnxRuntimeEngine` runs it (CPU, or the CUDA
execution provider); the TensorRT backend builds from the same export.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from beatflow.engine.base import (
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
from beatflow.model.threads import torch_threads
from beatflow.model.vae import LATENT_DIM, Downsample, LightVAE, Scorer

__all__ = [
    "INPUT_NAME",
    "OUTPUT_NAMES",
    "INT8_OPS",
    "OnnxRuntimeEngine",
    "optimize_for_onnx_cpu",
    "export_onnx",
    "quantize_onnx_int8",
    "output_layers",
]

INPUT_NAME = "beats"
#: ONNX operators quantized for int8 (see :func:`quantize_onnx_int8`).
INT8_OPS = ("Conv", "Gemm")
OUTPUT_NAMES = ("score", "mu")


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
    ``bench/results/engine.md``). Engines built from it are validated against the original."""
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
        ``bench/results/engine.md``). CPU only.
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
        check_matrix(x.shape)
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
        check_matrix(x.shape)
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

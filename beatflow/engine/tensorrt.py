"""TensorRT backend: an engine built from the ONNX export with a min/opt/max batch profile.

Built only where ``tensorrt`` is importable and a CUDA device is present
(:func:`beatflow.engine.options.tensorrt_available`; import-safe anywhere).
The network is created *strongly typed* from an ONNX graph that carries its precision (fp32, or
the :class:`~beatflow.engine.base.PrecisionScorer` graph with explicit casts for fp16/bf16), so TensorRT
computes in exactly the types of the graph; TF32 is turned off so fp32 stays fp32.

Inference uses the name-based API (``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``) on the caller's stream: device input (a CUDA torch tensor, or a CuPy array
through DLPack) is bound by pointer, outputs are allocated on the device; nothing goes through the
host unless the input is NumPy.
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import Optional

import torch

from beatflow.engine.base import (
    BatchProfile,
    Engine,
    EngineValidationError,
    PathLike,
    array_kind,
    as_cuda_tensor,
    check_matrix,
    from_cuda_tensor,
)
from beatflow.engine.onnx import INPUT_NAME, OUTPUT_NAMES, export_onnx
from beatflow.engine.options import check_precision, cuda_device_index
from beatflow.errors import DeviceError
from beatflow.model.vae import LATENT_DIM, Scorer

__all__ = ["TensorRtEngine", "build_plan"]



def _logger():
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


def build_plan(onnx_bytes: bytes, width: int, profile: BatchProfile, *, precision: str = "fp32",
               workspace_bytes: int = 1 << 30) -> bytes:
    """Serialized TensorRT engine ("plan") for an ONNX scorer.

    Raises
    ------
    EngineValidationError
        The parser or the builder failed (one line with TensorRT's first error).
    """
    import tensorrt as trt

    logger = _logger()
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        strongly_typed = True
    else:  # TensorRT 8.x
        strongly_typed = False
        if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineValidationError(f"tensorrt could not parse the ONNX scorer: {errs}".replace("\n", " "))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if not strongly_typed and precision in ("fp16", "bf16"):
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
    opt = builder.create_optimization_profile()
    opt.set_shape(INPUT_NAME, (profile.min, width), (profile.opt, width), (profile.max, width))
    config.add_optimization_profile(opt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineValidationError(f"tensorrt failed to build the {precision} engine (see TensorRT's log)")
    return bytes(plan)


class TensorRtEngine(Engine):
    """TensorRT engine.

    Parameters
    ----------
    plan : bytes
        Serialized engine (:func:`build_plan`).
    device : str
        ``"cuda[:N]"``.
    precision : str
        ``"fp32"``, ``"fp16"`` or ``"bf16"``.
    profile : BatchProfile or (min, opt, max)
        The optimization profile it was built with; batches are fed in ``min..max`` rows.
    """

    name = "tensorrt"

    def __init__(self, plan: bytes, *, device: str = "cuda", precision: str = "fp32",
                 profile=(1, 1024, 8192)):
        self.plan = bytes(plan)
        idx = cuda_device_index(device)
        if idx is None:
            raise DeviceError("tensorrt engines run on a CUDA device")
        self.device_index = idx
        self.precision = check_precision(precision)
        self.profile = BatchProfile.coerce(profile)
        self.max_batch = self.profile.max
        self._engine = None
        self._context = None
        self._lock = threading.Lock()

    @property
    def on_gpu(self) -> bool:
        return True

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def _ensure(self):
        if self._context is None:
            with self._lock:
                if self._context is None:
                    import tensorrt as trt

                    with torch.cuda.device(self.device_index):
                        runtime = trt.Runtime(_logger())
                        engine = runtime.deserialize_cuda_engine(self.plan)
                        if engine is None:
                            raise EngineValidationError("tensorrt could not deserialize the engine (built by "
                                                        "another TensorRT version or for another GPU?)")
                        self._runtime, self._engine = runtime, engine
                        self._context = engine.create_execution_context()
        return self._context

    _transient = ("_engine", "_context", "_runtime")

    @property
    def width(self) -> int:
        self._ensure()
        return int(self._engine.get_tensor_shape(INPUT_NAME)[1])

    @classmethod
    def build(cls, scorer: Scorer, path: PathLike, *, device: str = "cuda", precision: str = "fp32",
              batch_profile=(1, 1024, 8192), onnx_path: Optional[PathLike] = None, dynamo: bool = True,
              workspace_bytes: int = 1 << 30, **_ignored) -> "TensorRtEngine":
        """Export ``scorer`` to ONNX (unless ``onnx_path`` is given: an ONNX file of the right
        precision), build the plan and write it to ``path``."""
        check_precision(precision)
        if precision == "int8":
            raise ValueError("tensorrt: int8 is not supported here (needs a calibrator); use fp16/bf16")
        profile = BatchProfile.coerce(batch_profile)
        with tempfile.TemporaryDirectory(prefix="beatflow-trt-") as tmp:
            if onnx_path is None:
                onnx_path = os.path.join(tmp, "scorer.onnx")
                export_onnx(scorer, onnx_path, precision=precision, dynamo=dynamo,
                            example_batch=profile.example)
            with open(onnx_path, "rb") as fh:
                onnx_bytes = fh.read()
        with torch.cuda.device(cuda_device_index(device)):
            plan = build_plan(onnx_bytes, scorer.width, profile, precision=precision,
                              workspace_bytes=workspace_bytes)
        with open(path, "wb") as fh:
            fh.write(plan)
        engine = cls(plan, device=device, precision=precision, profile=profile)
        engine._ensure()
        return engine

    def save(self, path: PathLike) -> None:
        with open(path, "wb") as fh:
            fh.write(self.plan)

    @classmethod
    def load(cls, path: PathLike, *, device: str = "cuda", precision: str = "fp32", batch_profile=(1, 1024, 8192),
             **_ignored) -> "TensorRtEngine":
        with open(path, "rb") as fh:
            engine = cls(fh.read(), device=device, precision=precision, profile=batch_profile)
        engine._ensure()
        return engine

    def infer(self, beats, batch_size: int = 8192):
        """Score ``(n, D)`` beats on the GPU; device input is bound by pointer (no host copy) and
        results stay on the device (same kind as the input); NumPy in gives NumPy out."""
        kind = array_kind(beats)
        dev = self.torch_device
        x = as_cuda_tensor(beats, dev)
        check_matrix(x.shape)
        n = x.shape[0]
        score = torch.empty(n, dtype=torch.float32, device=dev)
        mu = torch.empty((n, LATENT_DIM), dtype=torch.float32, device=dev)
        batch_size = max(self.profile.min, min(int(batch_size), self.profile.max))
        ctx = self._ensure()
        stream = torch.cuda.current_stream(dev)
        with self._lock:  # one execution context: calls are serialised
            start = 0
            while start < n:
                m = min(batch_size, n - start)
                if m < self.profile.min:  # a short tail: pad it up to the profile's minimum
                    xb = torch.zeros((self.profile.min, x.shape[1]), dtype=torch.float32, device=dev)
                    xb[:m] = x[start:start + m]
                    sb = torch.empty(self.profile.min, dtype=torch.float32, device=dev)
                    mb = torch.empty((self.profile.min, LATENT_DIM), dtype=torch.float32, device=dev)
                else:
                    xb, sb, mb = x[start:start + m], score[start:start + m], mu[start:start + m]
                ctx.set_input_shape(INPUT_NAME, tuple(xb.shape))
                ctx.set_tensor_address(INPUT_NAME, xb.data_ptr())
                ctx.set_tensor_address(OUTPUT_NAMES[0], sb.data_ptr())
                ctx.set_tensor_address(OUTPUT_NAMES[1], mb.data_ptr())
                if not ctx.execute_async_v3(stream.cuda_stream):
                    raise EngineValidationError("tensorrt execution failed")
                if sb.data_ptr() != score[start:].data_ptr():
                    score[start:start + m] = sb[:m]
                    mu[start:start + m] = mb[:m]
                start += m
        return from_cuda_tensor(score, kind), from_cuda_tensor(mu, kind)


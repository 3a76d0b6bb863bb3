"""The engine options of a run, without PyTorch: precisions, devices, backends, the engine cache's
folder, and the ``beatflow engine`` command's arguments.

The command line and the flow's process check a run's ``--engine``/``--precision``/``--device`` with
:func:`resolve_backend` before anything starts; importing :mod:`beatflow.engine.cache` for that would
import PyTorch into them (0.9 s of a ``beatflow run`` command's start on 2 cores, for a process that
trains and scores nothing: the workers do). :mod:`beatflow.engine.base` and :mod:`beatflow.engine.cache`
take these from here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from beatflow.errors import DeviceError

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "beatflow", "engines")
BACKENDS = ("onnxruntime", "compiled", "aoti", "tensorrt")
#: GPU preference order of ``backend="auto"``.
GPU_ORDER = ("tensorrt", "compiled", "aoti", "onnxruntime")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def cuda_device_index(device: Union[str, int, None]) -> Optional[int]:
    """CUDA ordinal of ``"cuda"``, ``"cuda:N"``, ``"gpu"``, ``"gpu:N"`` or an int; None for CPU."""
    if device is None:
        return None
    if isinstance(device, (int, np.integer)):
        return int(device)
    d = str(device).lower()
    if d == "cpu":
        return None
    for prefix in ("cuda", "gpu"):
        if d == prefix:
            return 0
        if d.startswith(prefix + ":"):
            return int(d.split(":", 1)[1])
    raise ValueError(f"unknown device {device!r}: use cpu, gpu, cuda or cuda:N")


def cache_dir(path: Union[str, os.PathLike, None] = None) -> Path:
    """The engine cache folder: ``path``, else ``$BEATFLOW_CACHE_DIR``, else
    ``~/.cache/beatflow/engines`` (not created here)."""
    p = path if path is not None else (os.environ.get("BEATFLOW_CACHE_DIR") or DEFAULT_CACHE_DIR)
    return Path(os.path.expanduser(os.fspath(p)))


def normalize_device(device: Union[str, int, None]) -> str:
    """``"cpu"`` or ``"cuda:N"`` for ``cpu``, ``gpu[:N]``, ``cuda[:N]``, ``auto`` (a CUDA device
    when torch sees one)."""
    if device is None or str(device).lower() == "auto":
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    idx = cuda_device_index(device)
    return "cpu" if idx is None else f"cuda:{idx}"


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime as ort

        return "CUDAExecutionProvider" in ort.get_available_providers()
    except Exception:
        return False


def _supports(backend: str, precision: str, gpu: bool) -> bool:
    if backend == "compiled":
        return gpu and precision in ("fp32", "fp16", "bf16")
    if precision == "int8":
        return backend == "onnxruntime" and not gpu
    if precision in ("fp16", "bf16"):
        if not gpu:
            return False
        return backend in ("tensorrt", "aoti") or (backend == "onnxruntime" and precision == "fp16")
    return True


def available_backends(device: str = "cpu") -> list[str]:
    """Backends usable on ``device``, in ``auto`` preference order."""
    dev = normalize_device(device)
    if dev == "cpu":
        from beatflow.engine.aoti import aoti_available

        return ["onnxruntime"] + (["aoti"] if aoti_available("cpu") else [])
    from beatflow.engine.aoti import aoti_available
    from beatflow.engine.tensorrt import tensorrt_available

    from beatflow.engine.compiled import compiled_available

    have = {"tensorrt": tensorrt_available(), "compiled": compiled_available(dev), "aoti": aoti_available(dev),
            "onnxruntime": _ort_has_cuda()}
    return [b for b in GPU_ORDER if have[b]]


def resolve_backend(backend: str, precision: str, device: str) -> str:
    """The concrete backend for ``backend`` (``"auto"`` or a name) on ``device``.

    Raises
    ------
    DeviceError
        No backend for this device/precision, or the named one is not available.
    ValueError
        Unknown backend, or a precision the backend does not do.
    """
    check_precision(precision)
    dev = normalize_device(device)
    gpu = dev != "cpu"
    if backend == "auto":
        if not gpu:
            if precision in ("fp16", "bf16"):
                raise ValueError(f"precision {precision} is for GPUs; on the CPU use fp32 or int8")
            return "onnxruntime"
        avail = available_backends(dev)
        for b in avail:
            if _supports(b, precision, gpu):
                return b
        raise DeviceError(f"no inference backend for {precision} on {dev} (available: {', '.join(avail) or 'none'}; "
                          "install tensorrt, CUDA torch or onnxruntime-gpu)")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use auto, {', '.join(BACKENDS)}")
    if not _supports(backend, precision, gpu):
        raise ValueError(f"backend {backend} does not do {precision} on {'the GPU' if gpu else 'the CPU'}")
    if backend == "tensorrt" and not gpu:
        raise DeviceError("tensorrt needs a CUDA device")
    if gpu and backend not in available_backends(dev):
        raise DeviceError(f"backend {backend} is not available on {dev}")
    return backend


def register(sub) -> dict:
    """Add ``beatflow engine clean|list [--cache-dir DIR]`` to the CLI's subparsers."""
    p = sub.add_parser("engine", help="inference engine cache: clean, list")
    esub = p.add_subparsers(dest="engine_command", required=True)
    for name, text in (("clean", "remove all cached engines"), ("list", "list cached engines")):
        c = esub.add_parser(name, help=text)
        c.add_argument("--cache-dir", help=f"cache folder (default $BEATFLOW_CACHE_DIR or {DEFAULT_CACHE_DIR})")
    return {"engine": _cmd_engine}


def _cmd_engine(args) -> int:
    from beatflow.engine.cache import engine_command  # (the cache's entries: PyTorch's engines)

    return engine_command(args)

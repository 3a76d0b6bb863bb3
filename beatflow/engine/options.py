"""The engine options of a run, without PyTorch: precisions, devices, backends and where they run, the
engine cache's folder and entries' names, and the ``beatflow engine clean|list`` command.

The command line and the flow's process check a run's ``--engine``/``--precision``/``--device`` with
:func:`resolve_backend` before anything starts; importing :mod:`beatflow.engine.cache` for that would
import PyTorch into them (0.9 s of a ``beatflow run`` command's start on 2 cores, for a process that
trains and scores nothing: the workers do). The backends' availability probes import what they probe
(PyTorch, TensorRT, ONNX Runtime) when called, on a GPU only where they must. The engine modules take
these from here; this module imports none of them.

**"auto" devices.** :func:`normalize_device` resolves ``auto`` by asking PyTorch (``torch.cuda.is_available()``),
not as :func:`beatflow.device.resolve_device` does (CuPy sees a CUDA device): every engine backend computes
through PyTorch's CUDA runtime (the ``compiled``, ``aoti`` and ``tensorrt`` engines need CUDA torch; ONNX
Runtime's CUDA engine binds torch tensors), never through CuPy, which is the pipeline's array library. The
two agree wherever both libraries see the GPU (a ``beatflow[gpu]`` install); they differ with CuPy beside a
CPU-only PyTorch (the pipeline's ``auto`` is the GPU, an engine's the CPU: the only device it can run on)
and with CUDA PyTorch without CuPy (the reverse). The flow resolves its device once
(:func:`~beatflow.device.resolve_device`) and hands the engine ``cpu`` or ``gpu``, never ``auto``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
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


def compiler_caches() -> None:
    """Put PyTorch Inductor's and Triton's on-disk caches (compiled training steps, compiled and AOTI
    engines) in beatflow's cache folder, ``<user cache>/beatflow/inductor`` and ``.../triton``, unless
    ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` say otherwise. (Their default, a folder under
    /tmp, goes with the machine's temporary files.) Called before anything is compiled; both read the
    variables when they first compile."""
    from platformdirs import user_cache_dir

    root = Path(user_cache_dir("beatflow"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def normalize_device(device: Union[str, int, None]) -> str:
    """``"cpu"`` or ``"cuda:N"`` for ``cpu``, ``gpu[:N]``, ``cuda[:N]``, ``auto`` (a CUDA device
    when torch sees one)."""
    if device is None or str(device).lower() == "auto":
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    idx = cuda_device_index(device)
    return "cpu" if idx is None else f"cuda:{idx}"


# ----------------------------------------------------------------------------------------------
# backends: which run here
# ----------------------------------------------------------------------------------------------

def aoti_available(device: str = "cuda") -> bool:
    """Whether AOTInductor can compile for ``device`` here (CUDA torch for a GPU; a C++ compiler
    for the CPU)."""
    try:
        import torch
        from torch import _inductor  # noqa: F401
    except Exception:  # pragma: no cover - broken install
        return False
    if cuda_device_index(device) is not None:
        return torch.cuda.is_available()
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


def compiled_available(device: str = "cuda") -> bool:
    """CUDA torch with Triton (what Inductor generates GPU kernels with)."""
    if cuda_device_index(device) is None:
        return False
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None


def tensorrt_available() -> bool:
    """Whether ``tensorrt`` is importable and torch sees a CUDA device."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        import tensorrt  # noqa: F401
    except Exception:
        return False
    import torch

    return torch.cuda.is_available()


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
        return ["onnxruntime"] + (["aoti"] if aoti_available("cpu") else [])
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


# ----------------------------------------------------------------------------------------------
# the cache folder's entries, and the CLI
# ----------------------------------------------------------------------------------------------

#: an entry's file is ``<backend>-<precision>-<key>.<extension>`` (``beatflow.engine.cache``), its sidecar ``….json``
EXTENSIONS = {"onnxruntime": "onnx", "compiled": "pt", "aoti": "pt2", "tensorrt": "plan"}
_KEY_LEN = 24
_ENTRY_RE = re.compile(r"^(%s)-(%s)-([0-9a-f]{%d})\.(%s|json)$"
                       % ("|".join(BACKENDS), "|".join(PRECISIONS), _KEY_LEN, "|".join(EXTENSIONS.values())))
_TMP_PREFIX = ".tmp-"
#: the stored validation references (:mod:`beatflow.engine.cache`): ``reference-<16 hex>.npz``
REFERENCE_RE = re.compile(r"^reference-[0-9a-f]{16}\.npz$")


def _ours(p: Path) -> bool:
    return bool(_ENTRY_RE.match(p.name) or REFERENCE_RE.match(p.name)) or p.name.startswith(_TMP_PREFIX)


def list_cache(path=None) -> list[dict]:
    """Sidecars of the entries in the cache folder (unreadable ones as ``{"file": name, "error": ...}``)."""
    folder = cache_dir(path)
    out = []
    if not folder.is_dir():
        return out
    for p in sorted(folder.glob("*.json")):
        if not _ENTRY_RE.match(p.name):
            continue
        try:
            meta = json.loads(p.read_text())
            meta["file"] = p.name
        except (OSError, ValueError) as e:
            meta = {"file": p.name, "error": e.__class__.__name__}
        out.append(meta)
    return out


def clean_cache(path=None) -> list[Path]:
    """Remove every engine, sidecar, stored validation reference and leftover temporary file from the cache folder.

    Files that do not look like cache entries are left alone (the folder may have been pointed
    somewhere else by mistake). Returns the removed paths.
    """
    folder = cache_dir(path)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        if not _ours(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def register(sub) -> dict:
    """Add ``beatflow engine clean|list [--cache-dir DIR]`` to the CLI's subparsers."""
    p = sub.add_parser("engine", help="inference engine cache: clean, list")
    esub = p.add_subparsers(dest="engine_command", required=True)
    for name, text in (("clean", "remove all cached engines"), ("list", "list cached engines")):
        c = esub.add_parser(name, help=text)
        c.add_argument("--cache-dir", help=f"cache folder (default $BEATFLOW_CACHE_DIR or {DEFAULT_CACHE_DIR})")
    return {"engine": engine_command}


def engine_command(args) -> int:
    """``beatflow engine clean|list`` (its arguments: :func:`register`)."""
    folder = cache_dir(args.cache_dir)
    if args.engine_command == "clean":
        sizes = {}
        for p in (folder.iterdir() if folder.is_dir() else []):
            if _ours(p) and p.is_file():
                sizes[p] = p.stat().st_size
        removed = clean_cache(folder)
        for p in removed:
            print(f"removed {p}")
        total = sum(sizes.get(p, 0) for p in removed)
        print(f"engine cache {folder}: removed {len(removed)} file(s), {total / 1e6:.1f} MB")
        return 0
    entries = list_cache(folder)
    if not entries:
        print(f"engine cache {folder}: empty")
    for e in entries:
        if "error" in e:
            print(f"{e['file']}  (unreadable: {e['error']})")
            continue
        v = e.get("validation", {})
        print(f"{e['engine_file']}  {e['backend']} {e['precision']} on {e['device_name']}  profile {e['batch_profile']}  "
              f"max abs err {v.get('max_abs_err', float('nan')):.1e}  {e.get('size', 0) / 1e3:.0f} kB  {e.get('created', '')}")
    return 0

"""Validated, cached inference engines: :func:`build_or_load_engine` and :func:`load_engine`.

One entry point for the flow::

    engine, info = build_or_load_engine("model.pt", validation_beats, backend="auto", precision="fp32",
                                        device="cpu", threads=2)
    score, mu = engine.infer(beats / scale)

Backends (see :mod:`beatflow.engine.base`; which run where: :mod:`beatflow.engine.options`):
``onnxruntime`` (CPU; CUDA with onnxruntime-gpu), ``compiled`` (the fusible scorer through
``torch.compile``; GPU), ``aoti`` (PyTorch AOTInductor; GPU, CPU allowed), ``tensorrt`` (GPU, when
importable). ``backend="auto"`` picks, on a GPU, tensorrt > compiled > aoti > onnxruntime-cuda, on the
CPU onnxruntime (the first available that supports the precision).

**Cache.** Engines live in a cache folder (``cache_dir`` argument, else ``$BEATFLOW_CACHE_DIR``,
else ``~/.cache/beatflow/engines``) as ``<backend>-<precision>-<key>.<ext>`` plus a sidecar
``….json`` holding the key, what it was computed from and the engine file's sha256. The key hashes
the model file's bytes, the backend, the precision, the batch profile, the device name (CPU model
or GPU name), the library versions (torch, onnxruntime, onnx, onnxscript, tensorrt if any, CUDA),
this module's engine format, and for int8 the calibration beats. A build with a key already in the
cache loads the entry instead of exporting; an entry whose sidecar is missing, unreadable, for
another key, or whose file's sha256 differs, is rebuilt with an :class:`EngineCacheWarning`,
never loaded. Files are written to a temporary name and renamed (``os.replace``), the sidecar
last, so a reader never sees half an entry. The entries' names, and ``beatflow engine clean|list``, are
:mod:`beatflow.engine.options`' (no PyTorch).

**Validation.** Every engine, built or loaded, is compared with the fp32 PyTorch scorer on the
validation beats with the precision's tolerance (:data:`beatflow.engine.validate.TOLERANCES`); a build that
fails raises :class:`~beatflow.engine.base.EngineValidationError` (one line) and is not cached. For int8
the validation beats are split: even rows calibrate, odd rows validate.

This module knows nothing of Prefect or Dask.
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional, Union

import numpy as np

from beatflow.engine.base import BatchProfile, Engine, EngineValidationError
from beatflow.engine.onnx import OnnxRuntimeEngine, export_onnx, quantize_onnx_int8
from beatflow.engine.options import (
    _ENTRY_RE,
    _KEY_LEN,
    _TMP_PREFIX,
    EXTENSIONS,
    _supports,
    available_backends,
    cache_dir,
    check_precision,
    cuda_device_index,
    normalize_device,
    resolve_backend,
)
from beatflow.engine.validate import PROFILE_BATCHES, TOLERANCES, profile_engine, validate_engine

__all__ = [
    "EngineCacheWarning",
    "build_or_load_engine",
    "cache_key",
    "device_name",
    "library_versions",
    "load_engine",
]

log = logging.getLogger(__name__)

#: Bump when what an engine file contains changes for the same inputs (invalidates caches).
ENGINE_FORMAT = 3  # 3: the compiled backend (fusible scorer through torch.compile)


class EngineCacheWarning(UserWarning):
    """A cache entry could not be used (corrupt, mismatched, failing validation) and is rebuilt."""


# ----------------------------------------------------------------------------------------------
# environment: cache folder, device, versions, backends
# ----------------------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: str = "cpu") -> str:
    """CPU model (``/proc/cpuinfo``) or GPU name with its compute capability."""
    idx = cuda_device_index(device)
    if idx is None:
        return f"{_cpu_model()} ({platform.machine()})"
    try:
        import torch

        if torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(idx)
            return f"{torch.cuda.get_device_name(idx)} (sm_{cc[0]}{cc[1]})"
    except Exception:
        pass
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(idx)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return f"{name} (sm_{props['major']}{props['minor']})"
    except Exception:
        return f"cuda:{idx} (unknown GPU)"


def library_versions(device: str = "cpu") -> dict:
    """Versions of the libraries an engine depends on (absent ones are left out)."""
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "onnxruntime", "onnxruntime-gpu", "onnx", "onnxscript", "tensorrt"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    if "tensorrt" not in out:
        try:
            import importlib.util

            if importlib.util.find_spec("tensorrt") is not None:
                import tensorrt

                out["tensorrt"] = tensorrt.__version__
        except Exception:
            pass
    if cuda_device_index(device) is not None:
        import torch

        out["cuda"] = str(torch.version.cuda)
    return out


# ----------------------------------------------------------------------------------------------
# keys and entries
# ----------------------------------------------------------------------------------------------

def _sha256_file(path: Union[str, os.PathLike]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(model_sha256: str, backend: str, precision: str, batch_profile, device: str, *,
              versions: Optional[dict] = None, dev_name: Optional[str] = None,
              calibration_sha256: Optional[str] = None) -> tuple[str, dict]:
    """``(key, material)``: the hex key and the JSON-able dict it hashes."""
    dev = normalize_device(device)
    material = {
        "format": ENGINE_FORMAT,
        "model_sha256": model_sha256,
        "backend": backend,
        "precision": precision,
        "batch_profile": list(BatchProfile.coerce(batch_profile)),
        "device": "cpu" if dev == "cpu" else "cuda",
        "device_name": dev_name if dev_name is not None else device_name(dev),
        "versions": versions if versions is not None else library_versions(dev),
    }
    if calibration_sha256 is not None:
        material["calibration_sha256"] = calibration_sha256
    blob = json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:_KEY_LEN], material


def _entry_paths(folder: Path, backend: str, precision: str, key: str) -> tuple[Path, Path]:
    stem = f"{backend}-{precision}-{key}"
    return folder / f"{stem}.{EXTENSIONS[backend]}", folder / f"{stem}.json"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _warn(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, EngineCacheWarning, stacklevel=3)


def _read_entry(engine_path: Path, meta_path: Path, key: str, material: dict) -> Optional[dict]:
    """The sidecar of a usable entry, or None (with a warning when something is there but wrong)."""
    if not meta_path.exists():
        if engine_path.exists():
            _warn(f"engine cache: {engine_path.name} has no sidecar; rebuilding")
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        _warn(f"engine cache: unreadable sidecar {meta_path.name} ({e.__class__.__name__}); rebuilding")
        return None
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("material") != material:
        _warn(f"engine cache: sidecar {meta_path.name} is for another key; rebuilding")
        return None
    if not engine_path.exists():
        _warn(f"engine cache: {engine_path.name} is missing; rebuilding")
        return None
    sha = _sha256_file(engine_path)
    if sha != meta.get("sha256"):
        _warn(f"engine cache: {engine_path.name} is corrupt (sha256 {sha[:12]}… != {str(meta.get('sha256'))[:12]}…); "
              "rebuilding")
        return None
    return meta


def _reference_name(ref_key: tuple, device_name: str, versions: dict) -> str:
    text = json.dumps([ref_key[0], ref_key[1], list(ref_key[2]), device_name, versions], sort_keys=True, default=str)
    return f"reference-{hashlib.sha256(text.encode()).hexdigest()[:16]}.npz"


def _read_reference(path: Path, n: int):
    """A stored validation reference ``(score, mu)`` for ``n`` beats, or None (missing or unreadable)."""
    try:
        with np.load(path) as z:
            score, mu = z["score"], z["mu"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    return (score, mu) if len(score) == n and len(mu) == n else None


def _write_reference(path: Path, score, mu) -> None:
    buf = io.BytesIO()
    np.savez(buf, score=np.asarray(score), mu=np.asarray(mu))
    try:
        _atomic_write_bytes(path, buf.getvalue())
    except OSError as e:  # a read-only cache still validates: the next process computes it again
        log.info("engine cache: cannot store the validation reference (%s)", e)


def _remove_entry(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


# ----------------------------------------------------------------------------------------------
# building and loading one backend
# ----------------------------------------------------------------------------------------------

def _runtime_options(backend: str, dev: str, threads: Optional[int], profile: BatchProfile, precision: str) -> dict:
    opts = {"device": dev, "precision": precision}
    if backend == "onnxruntime":
        opts["max_batch"] = profile.max
        if dev == "cpu":
            n = int(threads) if threads else _usable_cores()
            # measured on 2 cores: n concurrent single-threaded runs beat one run with n intra-op
            # threads (bench/results/engine.md)
            opts.update(intra_op_num_threads=1, feeders=max(1, n))
    elif backend == "aoti":
        opts.update(max_batch=max(profile.max, profile.example), threads=threads)
    elif backend == "compiled":
        opts.update(max_batch=max(profile.max, profile.example))
    elif backend == "tensorrt":
        opts["batch_profile"] = profile
    return opts


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _engine_class(backend: str):
    if backend == "onnxruntime":
        return OnnxRuntimeEngine
    if backend == "aoti":
        from beatflow.engine.aoti import AotInductorEngine

        return AotInductorEngine
    if backend == "compiled":
        from beatflow.engine.compiled import CompiledEngine

        return CompiledEngine
    from beatflow.engine.tensorrt import TensorRtEngine

    return TensorRtEngine


def _build(backend: str, scorer, path: str, *, precision: str, dev: str, profile: BatchProfile,
           calibration: Optional[np.ndarray], options: dict) -> Engine:
    """Build one engine into ``path`` (uses the module-level :func:`export_onnx`, which tests patch)."""
    if backend == "onnxruntime":
        if precision == "int8":
            fp32 = path + ".fp32.onnx"
            # plain graph: ONNX Runtime 1.32 aborts (C++ assertion) creating a session for the
            # quantized rewritten graph, and int8 is slower than fp32 on this model anyway
            export_onnx(scorer, fp32, example_batch=profile.example, optimize=False)
            quantize_onnx_int8(fp32, path, calibration)
            os.unlink(fp32)
        else:
            # the exact CPU rewrites only on the CPU; GPU runtimes get the plain graph
            export_onnx(scorer, path, precision=precision, example_batch=profile.example, optimize=dev == "cpu")
        return OnnxRuntimeEngine.load(path, **options)
    if backend == "tensorrt":
        from beatflow.engine.tensorrt import TensorRtEngine

        onnx_path = path + ".onnx"
        export_onnx(scorer, onnx_path, precision=precision, example_batch=profile.example)
        return TensorRtEngine.build(scorer, path, onnx_path=onnx_path, device=dev, precision=precision,
                                    batch_profile=profile)
    if backend == "compiled":
        from beatflow.engine.compiled import CompiledEngine

        return CompiledEngine.build(scorer, path, device=dev, precision=precision, batch_profile=profile)
    from beatflow.engine.aoti import AotInductorEngine

    engine = AotInductorEngine.build(scorer, path, device=dev, precision=precision, batch_profile=profile)
    if options.get("threads") and dev == "cpu":
        import torch

        torch.set_num_threads(int(options["threads"]))
    return engine


#: engines loaded in this process, by backend, file, sha256 and runtime options (most recent last):
#: a standing worker that runs the flow again reuses the engine it loaded, with its compiled code and
#: captured CUDA graphs, instead of compiling and capturing them anew (0.6-0.8 s of a warm GPU run)
_LOADED: "collections.OrderedDict[tuple, Engine]" = collections.OrderedDict()
_LOADED_MAX = 4
_LOADED_LOCK = threading.Lock()
#: the eager scorer's (score, mu) on validation beats, by model sha256 and beats (see _build_or_load)
_REFERENCES: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def _loaded_key(backend: str, path: Path, sha256: str, options: dict) -> tuple:
    return (backend, os.path.realpath(path), sha256, repr(sorted(options.items())))


def _keep(store: collections.OrderedDict, key: tuple, value) -> None:
    """``store[key] = value`` as its most recent entry, the oldest dropped past ``_LOADED_MAX``."""
    with _LOADED_LOCK:
        store[key] = value
        store.move_to_end(key)
        while len(store) > _LOADED_MAX:
            store.popitem(last=False)


def _forget(key: tuple) -> None:
    with _LOADED_LOCK:
        _LOADED.pop(key, None)


def _load(backend: str, path: Path, options: dict, sha256: Optional[str] = None) -> Engine:
    """Load an engine file; with its ``sha256`` (checked by the caller), the same engine object
    as an earlier load of the same bytes with the same options in this process."""
    key = None if sha256 is None else _loaded_key(backend, path, sha256, options)
    if key is not None:
        with _LOADED_LOCK:
            engine = _LOADED.get(key)
            if engine is not None:
                _LOADED.move_to_end(key)
                return engine
    engine = _engine_class(backend).load(path, **options)
    if key is not None:
        _keep(_LOADED, key, engine)
    return engine


# ----------------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------------

def build_or_load_engine(model_path: str, validation_beats: np.ndarray, *, backend="auto", precision="fp32",
                         device="cpu", cache_dir=None, threads=None,
                         batch_profile=(1, 1024, 8192)) -> tuple[Engine, dict]:
    """A validated inference engine for a saved model, from the cache or freshly built.

    Parameters
    ----------
    model_path : str
        File written by :func:`beatflow.model.vae.save_model`; its bytes are part of the cache key.
    validation_beats : numpy.ndarray
        Held-out ``(n, D)`` beats, already scaled as at inference; the engine must match the fp32
        PyTorch scorer on them within the precision's tolerance. For int8, even rows calibrate
        (at most 1024) and odd rows validate.
    backend : str
        ``"auto"``, ``"onnxruntime"``, ``"aoti"`` or ``"tensorrt"``.
    precision : str
        ``"fp32"``; ``"fp16"``/``"bf16"`` on a GPU; ``"int8"`` on the CPU (ONNX Runtime).
    device : str
        ``"cpu"``, ``"gpu"``, ``"cuda[:N]"`` or ``"auto"``.
    cache_dir : str, optional
        Cache folder; default ``$BEATFLOW_CACHE_DIR`` or ``~/.cache/beatflow/engines``.
    threads : int, optional
        CPU threads for inference (ONNX Runtime: concurrent single-threaded runs; default: the
        usable cores). Not part of the key.
    batch_profile : (min, opt, max)
        Batch sizes the engine is built for (TensorRT's optimization profile; the largest batch
        fed per call everywhere).

    Returns
    -------
    engine : Engine
        Ready for ``engine.infer(beats)``.
    info : dict
        ``backend``, ``precision``, ``device``, ``device_name``, ``cache`` (``"hit"`` or
        ``"built"``), ``max_abs_err`` and ``max_abs_err_mu`` (against PyTorch on the validation
        beats), ``tolerance``, ``throughput_beats_per_s`` (batches of 1024 on the validation beats),
        ``profile`` (batch-1 latency p50/p99 and throughput by batch size: :func:`beatflow.engine.validate.profile_engine`),
        ``key``, ``path`` (the cached engine file), ``build_s`` (export+build+validation, or
        load+validation on a hit), ``batch_profile``, ``versions``.

    Raises
    ------
    EngineValidationError
        The freshly built engine does not match PyTorch (nothing is cached).
    DeviceError, ValueError
        Backend/precision/device combination not available or not supported.

    Notes
    -----
    With ``backend="auto"`` on a GPU, a backend that fails to build or validate is skipped with an
    :class:`EngineCacheWarning` and the next one in preference order is tried.
    """
    check_precision(precision)
    dev = normalize_device(device)
    if dev != "cpu":
        wait_gpu_warmup()  # (one compile at a time in a process)
    first = resolve_backend(backend, precision, dev)
    if backend != "auto" or dev == "cpu":
        return _build_or_load(model_path, validation_beats, first, precision, dev, cache_dir, threads, batch_profile)
    # auto on a GPU: the best backend that builds and validates; the next one if it does not
    candidates = [b for b in available_backends(dev) if _supports(b, precision, True)]
    errors = []
    for b in candidates:
        try:
            return _build_or_load(model_path, validation_beats, b, precision, dev, cache_dir, threads, batch_profile)
        except (KeyboardInterrupt, ValueError):
            raise
        except Exception as e:  # a backend that fails to build here: fall back to the next
            errors.append(e)
            if b != candidates[-1]:
                _warn(f"engine: {b} {precision} failed on {dev} ({e.__class__.__name__}: {e}); trying the next backend")
    raise errors[0]


def _build_or_load(model_path, validation_beats, backend: str, precision: str, dev: str, cache_dir, threads,
                   batch_profile) -> tuple[Engine, dict]:
    from beatflow.device import to_host
    from beatflow.model.vae import Scorer, load_model

    t0 = time.perf_counter()
    profile = BatchProfile.coerce(batch_profile)
    val = np.ascontiguousarray(to_host(validation_beats), dtype=np.float32)
    if val.ndim != 2 or val.shape[0] == 0:
        raise ValueError(f"validation beats must be a non-empty (n, D) matrix, got shape {val.shape}")
    calibration = None
    check = val
    if precision == "int8":
        if len(val) >= 2:
            calibration, check = val[0::2][:1024], val[1::2]
        else:
            calibration = val
    model_sha = _sha256_file(model_path)
    scorer = Scorer(load_model(model_path)).eval()
    if scorer.width != val.shape[1]:
        raise ValueError(f"validation beats have {val.shape[1]} samples per row, the model {scorer.width}")
    versions = library_versions(dev)
    dname = device_name(dev)
    calib_sha = hashlib.sha256(calibration.tobytes()).hexdigest() if calibration is not None else None
    key, material = cache_key(model_sha, backend, precision, profile, dev, versions=versions, dev_name=dname,
                              calibration_sha256=calib_sha)
    tol = TOLERANCES[precision]
    options = _runtime_options(backend, dev, threads, profile, precision)

    folder = cache_dir_writable(cache_dir)
    engine_path, meta_path = _entry_paths(folder, backend, precision, key)
    report: dict = {}

    # the eager scorer's output on the validation beats, a pure function of the weights and the
    # beats (and of the device and PyTorch that computed it): kept per process, so that a standing
    # worker's next run with the same model (a cache hit) does not compute it again (0.2-0.4 s on one
    # CPU thread for 4096 beats), and stored with the engines, so that a new process loading a cached
    # engine (beatflow score) does not either (seconds on a GPU, whose eager scorer starts cold)
    ref_key = (model_sha, hashlib.sha256(check.tobytes()).hexdigest(), check.shape)
    ref_path = folder / _reference_name(ref_key, dname, versions)
    phases: dict = {}

    def validate(engine: Engine) -> float:
        t = time.perf_counter()
        with _LOADED_LOCK:
            reference = _REFERENCES.get(ref_key)
        source = "kept"
        if reference is None:
            reference, source = _read_reference(ref_path, check.shape[0]), "stored"
        try:
            return validate_engine(engine, scorer, check, atol=tol.atol, rtol=tol.rtol, mu_atol=tol.mu_atol,
                                   mu_rtol=tol.mu_rtol, report=report, reference=reference)
        finally:  # (also when the engine fails: the reference is right either way)
            if "ref_score" in report:
                _keep(_REFERENCES, ref_key, (report["ref_score"], report["ref_mu"]))
                if reference is None:
                    _write_reference(ref_path, report["ref_score"], report["ref_mu"])
            phases["validate"] = time.perf_counter() - t
            phases["reference"] = source if reference is not None else "computed"

    engine, status, meta = None, "built", _read_entry(engine_path, meta_path, key, material)
    phases["prepare"] = time.perf_counter() - t0
    if meta is not None:
        loaded = _loaded_key(backend, engine_path, meta["sha256"], options)
        try:
            t = time.perf_counter()
            engine = _load(backend, engine_path, options, meta["sha256"])
            phases["load"] = time.perf_counter() - t
            validate(engine)
            status = "hit"
        except EngineValidationError as e:
            _warn(f"engine cache: {engine_path.name} fails validation on these beats ({e}); rebuilding")
            engine = None
            _forget(loaded)
        except Exception as e:  # a file that sha-matches but does not load (other driver, ...)
            _warn(f"engine cache: {engine_path.name} does not load ({e.__class__.__name__}: {e}); rebuilding")
            engine = None
            _forget(loaded)
    if engine is None:
        _remove_entry(engine_path, meta_path)
        work = tempfile.mkdtemp(dir=folder, prefix=_TMP_PREFIX + "build-")
        try:
            tmp_engine = os.path.join(work, engine_path.name)
            t = time.perf_counter()
            engine = _build(backend, scorer, tmp_engine, precision=precision, dev=dev, profile=profile,
                            calibration=calibration, options=options)
            phases["build"] = time.perf_counter() - t
            validate(engine)  # raises EngineValidationError: nothing is cached
            os.replace(tmp_engine, engine_path)  # same filesystem: atomic
            if hasattr(engine, "path"):
                engine.path = os.fspath(engine_path)
            meta = {
                "key": key, "material": material, "engine_file": engine_path.name,
                "sha256": _sha256_file(engine_path), "size": engine_path.stat().st_size,
                "backend": backend, "precision": precision, "device": dev, "device_name": dname,
                "batch_profile": list(profile), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "build_s": time.perf_counter() - t0,
                "validation": {"n": int(len(check)), "max_abs_err": report.get("max_abs_err"),
                               "max_abs_err_mu": report.get("max_abs_err_mu"), "tolerance": tol.to_dict()},
            }
            _atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())  # the sidecar commits
            _keep(_LOADED, _loaded_key(backend, engine_path, meta["sha256"], options), engine)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    tput_batch = min(1024, profile.max)
    prof = _stored_profile(meta, options) if status == "hit" else None
    if prof is None:  # (built, or an entry without a profile for these threads: measured, and stored)
        t = time.perf_counter()
        prof = profile_engine(engine, check, sorted({b for b in PROFILE_BATCHES if b <= profile.max} | {tput_batch}))
        phases["profile"] = time.perf_counter() - t
        prof = {**prof, "threads": _profile_threads(options), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _store_profile(meta_path, meta, prof)
    else:
        phases["profile"] = "stored"
    info = {
        "backend": backend, "precision": precision, "device": dev, "device_name": dname, "cache": status,
        "max_abs_err": float(report["max_abs_err"]), "max_abs_err_mu": float(report["max_abs_err_mu"]),
        "tolerance": tol.to_dict(), "validated_on": int(len(check)),
        "throughput_beats_per_s": float(prof["throughput_beats_per_s"].get(tput_batch, 0.0)),
        "profile": prof,
        "key": key, "path": os.fspath(engine_path), "build_s": time.perf_counter() - t0,
        "phases_s": phases,
        "batch_profile": list(profile), "versions": versions,
    }
    if backend == "onnxruntime":
        info["threads"] = options.get("feeders", 1)
    log.info("engine %s %s on %s: %s in %.1f s, max abs err %.2e, %.0f beats/s", backend, precision, dev, status,
             info["build_s"], info["max_abs_err"], info["throughput_beats_per_s"])
    return engine, info


def _profile_threads(options: dict) -> int:
    return int(options.get("feeders", options.get("threads") or 1) or 1)


def _stored_profile(meta: dict, options: dict) -> Optional[dict]:
    """The engine's latency and throughput as measured when it was built (on a cache hit, the same
    engine file on the same kind of device with the same libraries: the key says so), if measured
    with the same CPU threads; its batch sizes back to ints. A profile costs 0.03-0.06 s on the H200
    and 0.1-0.3 s on a CPU at every run of a standing deployment."""
    stored = meta.get("profile") if isinstance(meta, dict) else None
    if not isinstance(stored, dict) or stored.get("threads") != _profile_threads(options):
        return None
    try:
        return {**stored, "throughput_beats_per_s": {int(b): float(v) for b, v in
                                                     stored["throughput_beats_per_s"].items()}}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _store_profile(meta_path: Path, meta: Optional[dict], prof: dict) -> None:
    """Put ``prof`` (which carries the threads it was measured with and when) in the entry's sidecar;
    a sidecar that cannot be rewritten only means measuring again next time."""
    if not isinstance(meta, dict):
        return
    meta = {**meta, "profile": prof}
    try:
        _atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    except OSError:
        pass


def cache_dir_writable(path=None) -> Path:
    """The cache folder, created; a per-user temporary folder (with a warning) if it cannot be."""
    folder = cache_dir(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{folder} is not writable")
        return folder
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / f"beatflow-engines-{os.getuid() if hasattr(os, 'getuid') else 0}"
        _warn(f"engine cache: cannot use {folder} ({e}); using {fallback}")
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def load_engine(path: Union[str, os.PathLike], *, threads: Optional[int] = None, device: Optional[str] = None) -> Engine:
    """Load a cached engine file written by :func:`build_or_load_engine` (e.g. ``info["path"]``) on
    a worker: its sidecar gives the backend, precision, device and profile, and its sha256 is
    checked first.

    Parameters
    ----------
    path : str or os.PathLike
        The engine file.
    threads : int, optional
        CPU inference threads (ONNX Runtime: concurrent runs; default 1, as on a Dask worker that
        shares the machine with others).
    device : str, optional
        Override the device recorded in the sidecar (e.g. another GPU of the same model).

    Raises
    ------
    EngineValidationError
        No sidecar, or the file's sha256 differs from it.
    """
    path = Path(path)
    m = _ENTRY_RE.match(path.name)
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise EngineValidationError(f"{path}: no readable engine sidecar ({e.__class__.__name__})") from None
    if m is None or meta.get("engine_file") != path.name or _sha256_file(path) != meta.get("sha256"):
        raise EngineValidationError(f"{path}: engine file does not match its sidecar (corrupt or replaced)")
    dev = normalize_device(device or meta["device"])
    profile = BatchProfile.coerce(meta["batch_profile"])
    options = _runtime_options(meta["backend"], dev, threads or 1, profile, meta["precision"])
    return _load(meta["backend"], path, options, meta["sha256"])



def warm_gpu_engine(width: int = 256, buckets=(8192,), compile: bool = True, device: str = "cuda") -> dict:
    """Take a fresh GPU process's one-time costs of the engine stage off its first engine call: the
    backends' probes, Inductor's imports and, with ``compile``, one ``torch.compile`` of a scorer of random
    weights for ``buckets`` rows of ``width`` samples (Dynamo, Inductor's caches and Triton's kernel loads,
    which the first compile of a process pays whatever its weights). Seconds per phase."""
    out: dict = {}
    t = time.perf_counter()
    first = resolve_backend("auto", "fp32", device)
    out["probe"] = time.perf_counter() - t
    if first != "compiled" or not compile:
        return out
    import torch

    from beatflow.model.vae import LightVAE, save_model

    t = time.perf_counter()
    engine_cls = _engine_class("compiled")
    folder = tempfile.mkdtemp(prefix=_TMP_PREFIX + "warm-")
    try:
        path = os.path.join(folder, "warm.pt")
        torch.save({"width": int(width), "state_dict": LightVAE(int(width)).state_dict()}, path)
        engine = engine_cls.load(path, device=device)
        with torch.no_grad():
            for b in buckets:
                engine.infer(torch.zeros((int(b), int(width)), device=engine.torch_device))
        torch.cuda.synchronize()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["compile"] = time.perf_counter() - t
    return out


#: the engine warm-ups started in this process (:func:`start_gpu_warmup`), by width
_WARMUPS: dict = {}
_WARMUPS_LOCK = threading.Lock()


def start_gpu_warmup(width: int) -> bool:
    """Run :func:`warm_gpu_engine` for ``width`` in a thread of this process (a GPU worker), once per width
    and process; False where one was started before. The flow starts it on the worker that builds the
    engine as soon as the input's width is known, so that the one-time costs of the engine stage (5-7 s of
    probes and Inductor's imports, the first compile) run beside segmentation, embedding and training."""
    with _WARMUPS_LOCK:
        if width in _WARMUPS:
            return False
        t = threading.Thread(target=_warm_quietly, args=(int(width),), daemon=True, name=f"beatflow-engine-warm-{width}")
        _WARMUPS[width] = t
        t.start()
        return True


def _warm_quietly(width: int) -> None:
    try:
        warm_gpu_engine(width)
    except Exception as e:  # (a warm-up only: the engine stage does the same work and reports what fails)
        logging.getLogger("beatflow").debug("engine warm-up for width %d: %s", width, e)


def wait_gpu_warmup(timeout: float = 300.0) -> None:
    """Wait for this process's engine warm-ups (:func:`start_gpu_warmup`) to end: the engine stage's own
    compile must not run beside one."""
    with _WARMUPS_LOCK:
        threads = list(_WARMUPS.values())
    for t in threads:
        t.join(timeout)

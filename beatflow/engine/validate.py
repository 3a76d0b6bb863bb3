"""An engine against the PyTorch reference, and its speed: tolerances, validation, throughput and profile.

Every engine, built or loaded from the cache, is compared with the eager fp32 scorer
(:func:`beatflow.model.vae.score_beats`) on held-out beats within its precision's :data:`TOLERANCES`
(:func:`validate_engine`); :func:`profile_engine` measures its batch-1 latency and throughput by batch size.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from beatflow.engine.base import Engine, EngineValidationError, array_kind
from beatflow.engine.onnx import OnnxRuntimeEngine
from beatflow.model.threads import torch_threads
from beatflow.model.vae import LightVAE, Scorer, score_beats

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "compare_engine",
    "validate_engine",
    "throughput",
    "PROFILE_BATCHES",
    "timer",
    "profile_engine",
    "engine_options_summary",
]

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


#: Per-precision validation tolerances, chosen from measured errors (``bench/results/engine.md``;
#: trained LightVAEs on synthetic beats, scores ~0.04..1.9, |mu| < 0.1):
#:
#: * fp32: all-float32 graph, only summation order differs (measured <= 1.2e-7): 1e-4.
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

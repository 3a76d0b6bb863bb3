"""Inference engines for the exported :class:`~beatflow.model.Scorer`.

An engine turns a beat matrix ``(n, D)`` float32 into ``(score (n,), mu (n, 2))`` float32 NumPy
arrays. :class:`Engine` is the small interface every backend implements (``build``, ``save``,
``load``, ``infer``); :class:`OnnxRuntimeEngine` is the ONNX Runtime backend, built from an ONNX
file written by :func:`export_onnx`. Other backends (TensorRT, AOTInductor) plug in the same way.

Engines are picklable (they carry the serialized model, not the runtime session), so they can be
shipped to Dask workers; the session is re-created lazily on first use.
"""
from __future__ import annotations

import abc
import logging
import os
import time
import warnings
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .errors import BeatflowError
from .model import LATENT_DIM, LightVAE, Scorer, score_beats

__all__ = [
    "Engine",
    "EngineValidationError",
    "OnnxRuntimeEngine",
    "export_onnx",
    "validate_engine",
    "throughput",
]

INPUT_NAME = "beats"
OUTPUT_NAMES = ("score", "mu")

PathLike = Union[str, os.PathLike]


class EngineValidationError(BeatflowError, RuntimeError):
    """An engine's scores differ from the PyTorch reference by more than the tolerance."""


class Engine(abc.ABC):
    """Interface of an inference backend for the beat scorer."""

    #: Short backend name (``"onnxruntime"``, ``"tensorrt"``...).
    name: str = "engine"

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
    def infer(self, beats: np.ndarray, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """``(score (n,), mu (n, 2))`` float32 for a beat matrix ``(n, D)``."""


def export_onnx(scorer: Union[Scorer, LightVAE], path: PathLike, width: Optional[int] = None, opset: int = 18,
                *, dynamo: bool = True) -> str:
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

    Returns
    -------
    str
        ``path`` as a string.

    Notes
    -----
    The graph has one input ``"beats"`` of shape ``(batch, D)`` float32 and two outputs
    ``"score"`` ``(batch,)`` and ``"mu"`` ``(batch, 2)``; the result is checked with
    :func:`onnx.checker.check_model`.
    """
    import onnx

    if isinstance(scorer, LightVAE):
        scorer = Scorer(scorer)
    width = scorer.width if width is None else int(width)
    if width != scorer.width:
        raise ValueError(f"export width {width} does not match the model width {scorer.width}")
    scorer = scorer.eval()
    device = next(scorer.parameters()).device
    example = torch.zeros(4, width, dtype=torch.float32, device=device)
    path = os.fspath(path)
    quiet = logging.getLogger("torch.onnx")  # "torchvision is not installed" chatter
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if dynamo:
                program = torch.onnx.export(
                    scorer,
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
                    scorer,
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


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime backend.

    Parameters
    ----------
    model_bytes : bytes
        Serialized ONNX model (as written by :func:`export_onnx`).
    providers : sequence of str, optional
        ONNX Runtime execution providers; default ``["CPUExecutionProvider"]``.
    intra_op_num_threads : int, optional
        Threads per operator (ONNX Runtime's default when omitted: one per physical core).
    """

    name = "onnxruntime"

    def __init__(self, model_bytes: bytes, providers: Optional[Sequence[str]] = None,
                 intra_op_num_threads: Optional[int] = None):
        self.model_bytes = bytes(model_bytes)
        self.providers = list(providers) if providers else ["CPUExecutionProvider"]
        self.intra_op_num_threads = intra_op_num_threads
        self._session = None

    @property
    def session(self):
        """The ``onnxruntime.InferenceSession`` (created on first use)."""
        if self._session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            if self.intra_op_num_threads:
                opts.intra_op_num_threads = int(self.intra_op_num_threads)
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            self._session = ort.InferenceSession(self.model_bytes, sess_options=opts, providers=self.providers)
        return self._session

    @property
    def width(self) -> int:
        """Samples per beat ``D`` expected by the model."""
        return int(self.session.get_inputs()[0].shape[1])

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_session"] = None
        return state

    @classmethod
    def build(cls, scorer: Scorer, path: PathLike, *, opset: int = 18, dynamo: bool = True,
              providers: Optional[Sequence[str]] = None,
              intra_op_num_threads: Optional[int] = None) -> "OnnxRuntimeEngine":
        """Export ``scorer`` to ``path`` (see :func:`export_onnx`) and load it."""
        export_onnx(scorer, path, opset=opset, dynamo=dynamo)
        return cls.load(path, providers=providers, intra_op_num_threads=intra_op_num_threads)

    def save(self, path: PathLike) -> None:
        """Write the ONNX model to ``path``."""
        with open(path, "wb") as fh:
            fh.write(self.model_bytes)

    @classmethod
    def load(cls, path: PathLike, providers: Optional[Sequence[str]] = None,
             intra_op_num_threads: Optional[int] = None) -> "OnnxRuntimeEngine":
        """Load an ONNX file; the session is created immediately so a bad file fails here.

        Parameters
        ----------
        path : str or os.PathLike
            ONNX file written by :func:`export_onnx`.
        providers : sequence of str, optional
            Execution providers; default ``["CPUExecutionProvider"]``.
        intra_op_num_threads : int, optional
            Threads per operator.

        Returns
        -------
        OnnxRuntimeEngine
        """
        with open(path, "rb") as fh:
            engine = cls(fh.read(), providers=providers, intra_op_num_threads=intra_op_num_threads)
        engine.session  # noqa: B018 - validate now
        return engine

    def infer(self, beats: np.ndarray, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """Score a beat matrix.

        Parameters
        ----------
        beats : numpy.ndarray
            ``(n, D)``; converted to contiguous float32 if needed.
        batch_size : int
            Rows per ``session.run`` call.

        Returns
        -------
        score : numpy.ndarray
            float32 ``(n,)``.
        mu : numpy.ndarray
            float32 ``(n, 2)``.
        """
        x = np.ascontiguousarray(beats, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"beats must be a 2-D (n, D) matrix, got shape {x.shape}")
        n = x.shape[0]
        score = np.empty(n, dtype=np.float32)
        mu = np.empty((n, LATENT_DIM), dtype=np.float32)
        sess = self.session
        batch_size = max(1, int(batch_size))
        for start in range(0, n, batch_size):
            s, m = sess.run(list(OUTPUT_NAMES), {INPUT_NAME: x[start:start + batch_size]})
            score[start:start + len(s)] = s
            mu[start:start + len(s)] = m
        return score, mu


def validate_engine(engine: Engine, scorer: Union[Scorer, LightVAE], beats: np.ndarray, *,
                    atol: float = 1e-4, rtol: float = 1e-3) -> float:
    """Compare an engine's scores with the eager PyTorch scorer.

    Parameters
    ----------
    engine : Engine
        Engine under test.
    scorer : Scorer or LightVAE
        Reference model.
    beats : numpy.ndarray
        Beats to compare on, ``(n, D)``.
    atol, rtol : float
        Tolerance: every score must satisfy ``|engine - torch| <= atol + rtol * |torch|``
        (and likewise every ``mu``).

    Returns
    -------
    float
        Maximum absolute score difference.

    Raises
    ------
    EngineValidationError
        A score or ``mu`` is off by more than the tolerance, or is not finite.
    """
    x = np.ascontiguousarray(beats, dtype=np.float32)
    ref_s, ref_mu = score_beats(scorer, x)
    got_s, got_mu = engine.infer(x)
    name = getattr(engine, "name", type(engine).__name__)
    if got_s.shape != ref_s.shape or got_mu.shape != ref_mu.shape:
        raise EngineValidationError(
            f"{name} engine output shapes {got_s.shape}, {got_mu.shape} differ from the reference "
            f"{ref_s.shape}, {ref_mu.shape}")
    err = float(np.max(np.abs(got_s - ref_s))) if len(ref_s) else 0.0
    for what, got, ref in (("score", got_s, ref_s), ("mu", got_mu, ref_mu)):
        if got.size == 0:
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        ok = np.isfinite(got) & (diff <= atol + rtol * np.abs(ref))
        if not ok.all():
            worst = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("nan")
            raise EngineValidationError(
                f"{name} engine {what} differs from PyTorch: max abs error {worst:.3g} "
                f"exceeds tolerance atol={atol:g}, rtol={rtol:g} on {int((~ok).sum())} of {got.size} values")
    return err


def throughput(engine: Engine, beats: np.ndarray, batch_size: int = 8192, *, repeats: int = 1,
               warmup: bool = True) -> float:
    """Beats per second of ``engine.infer`` on ``beats``.

    Parameters
    ----------
    engine : Engine
        Engine to time.
    beats : numpy.ndarray
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
        ``n / seconds`` of the fastest pass (monotonic clock).
    """
    x = np.ascontiguousarray(beats, dtype=np.float32)
    n = x.shape[0]
    if n == 0:
        return 0.0
    if warmup:
        engine.infer(x[:batch_size], batch_size=batch_size)
    best = float("inf")
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        engine.infer(x, batch_size=batch_size)
        best = min(best, time.perf_counter() - t0)
    return n / max(best, 1e-12)

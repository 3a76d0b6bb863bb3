"""Beat rows: the public functions, and the one place that chooses among their implementations.

:func:`embed` and :func:`beat_rows` have two implementations of one contract: the array code of
:mod:`beatflow.embed.beats` (the reference, NumPy or CuPy) and the CUDA kernels of
:mod:`beatflow.embed.gpu`. For device arrays (:func:`beatflow.device.is_device_array`) the kernels
run, for host arrays the array code; they are tested against each other and against the loop
references of ``tests/naive.py``.
"""
from __future__ import annotations

from beatflow.device import is_device_array
from beatflow.embed import beats
from beatflow.params import SegmentSamples

__all__ = ["embed", "beat_rows"]


def embed(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0, chunk: int = 8192):
    """Each beat in a row of a zero-padded ``(n, width)`` float32 matrix, and its peak-to-peak
    (:func:`beatflow.embed.beats.embed_xp`): for device arrays the warp-per-beat kernel
    (:func:`beatflow.embed.gpu.embed_gpu`, which takes no ``chunk``), for host arrays the array code
    ``chunk`` beats at a time."""
    if is_device_array(x):
        from beatflow.embed.gpu import embed_gpu

        return embed_gpu(x, start, length, width, first=first, baseline_samples=baseline_samples)
    return beats.embed_xp(x, start, length, width, first=first, baseline_samples=baseline_samples, chunk=chunk)


def beat_rows(x, peaks, s: SegmentSamples, n_samples: int, *, first: int = 0, baseline_samples: int = 0):
    """The beats of one recording's sorted peaks that get a row, and their rows
    (:func:`beatflow.embed.beats.beat_rows_xp`): for device arrays three kernels and one
    synchronisation (:func:`beatflow.embed.gpu.beat_rows_gpu`), for host arrays the array code."""
    if is_device_array(x):
        from beatflow.embed.gpu import beat_rows_gpu

        return beat_rows_gpu(x, peaks, s, n_samples, first=first, baseline_samples=baseline_samples)
    return beats.beat_rows_xp(x, peaks, s, n_samples, first=first, baseline_samples=baseline_samples)

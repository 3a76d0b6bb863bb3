"""Beat detection: the public functions, and the one place that chooses among their implementations.

Each step with more than one implementation has one contract and three implementations of it:

* the array code of :mod:`beatflow.detect.peaks`, :mod:`beatflow.detect.rhythm` and
  :mod:`beatflow.detect.leads` (NumPy or CuPy): the reference, whose composite functions take the
  fast steps as parameters (``envelope``, ``local_maxima``, ``steepest``, ``window_features``,
  ``lead_windows``);
* :mod:`beatflow.detect.cpu` (Numba): fused loops for NumPy streams of at least 3 samples;
* :mod:`beatflow.detect.gpu` (Numba CUDA): the whole detection as kernels, for device arrays.

The functions here look at their input's device (:func:`beatflow.device.is_device_array`) and
choose: for device arrays the kernels (the detection, the non-maximum suppression) or the array code
on the device; for host arrays the CPU's loops where they take the input, else the array code. The
reference and the fast implementations are tested against each other and against the loop
references of ``tests/naive.py``. (The CPU's module is imported on first use: it imports Numba.)
"""
from __future__ import annotations

from beatflow.detect import leads, peaks, quality, rhythm
from beatflow.detect.leads import SecondLeadParams, SecondLeadSamples
from beatflow.device import is_device_array
from beatflow.params import QualitySamples, SegmentSamples

__all__ = ["detect_peaks", "detect_beats", "qrs_envelope", "local_maxima", "steepest_at", "window_features",
           "lead_windows", "quality_features", "quality_rule", "flutter_keep", "peak_measures", "second_lead_keep", "second_lead_peaks",
           "SecondLeadParams", "SecondLeadSamples"]


def _cpu():
    from beatflow.detect import cpu

    return cpu


def _on_cpu(x) -> bool:
    """Whether the CPU's fused loops take ``x``: a host array of at least 3 samples."""
    return not is_device_array(x) and x.shape[0] >= 3


# --- the steps ------------------------------------------------------------------------------------
def qrs_envelope(x, s: SegmentSamples):
    """The QRS energy envelope of a stream (:func:`beatflow.detect.peaks.qrs_envelope_xp`): on the
    CPU one fused pass (:func:`beatflow.detect.cpu.envelope_cpu`, about 15× faster than the array
    code), on CuPy the array code on the device."""
    if _on_cpu(x):
        return _cpu().qrs_envelope_cpu(x, s)
    return peaks.qrs_envelope_xp(x, s)


def local_maxima(env, half_window: int):
    """Indices where ``env`` is the maximum of its ``±half_window`` neighbourhood and positive
    (:func:`beatflow.detect.peaks.local_maxima_xp`): the GPU's NMS kernel
    (:func:`beatflow.detect.gpu.local_maxima_gpu`) for device arrays, the CPU's scan with early exit
    (:func:`beatflow.detect.cpu.local_maxima_cpu`, ~30× SciPy's moving maximum) for host arrays."""
    if is_device_array(env):
        from beatflow.detect.gpu import local_maxima_gpu

        return local_maxima_gpu(env, half_window)
    return _cpu().local_maxima_cpu(env, half_window)


def steepest_at(x, at, s: SegmentSamples):
    """Steepest slope near each of the positions ``at`` (:func:`beatflow.detect.peaks.steepest_at_xp`):
    on the CPU a loop per position (:func:`beatflow.detect.cpu.steepest_at_cpu`)."""
    if _on_cpu(x):
        return _cpu().steepest_at_cpu(x, at, s)
    return peaks.steepest_at_xp(x, at, s)


def window_features(x, first: int, s: SegmentSamples):
    """The flutter rule's window quantities (:func:`beatflow.detect.rhythm.window_features_xp`): on
    the CPU in fused loops (:func:`beatflow.detect.cpu.window_features_cpu`)."""
    if _on_cpu(x):
        return _cpu().window_features_cpu(x, first, s)
    return rhythm.window_features_xp(x, first, s)


def lead_windows(x, first: int, s: SegmentSamples):
    """The second lead's window quantities (:func:`beatflow.detect.leads.lead_windows_xp`): on the
    CPU in fused loops (:func:`beatflow.detect.cpu.lead_windows_cpu`)."""
    if _on_cpu(x):
        return _cpu().lead_windows_cpu(x, first, s)
    return leads.lead_windows_xp(x, first, s)


def quality_features(x, first: int, q: QualitySamples):
    """The signal quality's window measures (:func:`beatflow.detect.quality.window_features`): on the
    CPU one loop per window (:func:`beatflow.detect.cpu.quality_features_cpu`), on CuPy the array code."""
    if _on_cpu(x):
        return _cpu().quality_features_cpu(x, first, q)
    return quality.window_features(x, first, q)


def quality_rule(x, peaks, first: int, q: QualitySamples, span: tuple[int, int] | None = None):
    """The peaks outside the unreadable stretches, and those stretches with their reasons:
    ``(keep, spans, reasons)`` (:func:`beatflow.detect.quality.quality_rule`, with
    :func:`quality_features`)."""
    return quality.quality_rule(x, peaks, first, q, span, features=quality_features)


#: the steps of the detection's references, each choosing by its input's device
_DETECT_STEPS = {"envelope": qrs_envelope, "local_maxima": local_maxima, "steepest": steepest_at,
                 "window_features": window_features}
#: the steps of the second lead's references
_LEAD_STEPS = {"envelope": qrs_envelope, "lead_windows": lead_windows}


# --- the detection ---------------------------------------------------------------------------------
def detect_peaks(x, s: SegmentSamples, *, first: int = 0, core: tuple[int, int] | None = None):
    """Beat fiducial points (QRS peaks) of a stream or of one extended partition.

    Parameters
    ----------
    x : array (NumPy or CuPy), 1-D
        Samples ``[first, first + len(x))`` of a recording: a partition's core with its halos.
    s : SegmentSamples
        Parameters in samples (``SegmentParams().samples(fs)``).
    first : int
        Global sample index of ``x[0]``.
    core : (int, int), optional
        Keep only peaks with ``core[0] <= peak < core[1]`` (global). Default: all of ``x``.

    Returns
    -------
    array of int64
        Sorted global sample indices of the detected peaks (maxima of the QRS energy envelope,
        :mod:`beatflow.detect.peaks`), in the namespace of ``x``. Peaks inside ventricular
        flutter/fibrillation episodes are dropped (:mod:`beatflow.detect.rhythm`, as kernels on the
        GPU; ``s.vf_baseline = 0`` switches that off).
    """
    return detect_beats(x, s, first=first, core=core)[0]


def detect_beats(x, s: SegmentSamples, *, first: int = 0, core: tuple[int, int] | None = None):
    """:func:`detect_peaks`, and the ventricular flutter/fibrillation episodes it dropped peaks in.

    Returns
    -------
    (peaks, episodes) : int64 arrays in the namespace of ``x``
        The peaks as :func:`detect_peaks`; the episodes as ``[start, end)`` global sample ranges
        within ``core`` (default: ``x``), shape ``(m, 2)`` (:func:`beatflow.detect.rhythm.flutter_rule`).
        Device arrays: the kernels of :func:`beatflow.detect.gpu.detect_beats_gpu`; host arrays:
        :func:`beatflow.detect.rhythm.detect_beats_xp` with the CPU's steps.
    """
    if is_device_array(x):  # the GPU runs the same steps as a few kernels
        from beatflow.detect.gpu import detect_beats_gpu

        return detect_beats_gpu(x, s, first=first, core=core)
    return rhythm.detect_beats_xp(x, s, first=first, core=core, **_DETECT_STEPS)


# --- the second lead -------------------------------------------------------------------------------
def flutter_keep(x0, x1, peaks, first: int, s: SegmentSamples, q: SecondLeadSamples, span: tuple[int, int]):
    """Rule 1 of the second lead on a partition (:func:`beatflow.detect.leads.flutter_keep_xp`)."""
    return leads.flutter_keep_xp(x0, x1, peaks, first, s, q, span, lead_windows=lead_windows)


def peak_measures(x0, x1, peaks, first: int, n_total: int, s: SegmentSamples, q: SecondLeadSamples):
    """The peaks' measures for rules 2 and 3 (:func:`beatflow.detect.leads.peak_measures_xp`)."""
    return leads.peak_measures_xp(x0, x1, peaks, first, n_total, s, q, envelope=qrs_envelope)


def second_lead_keep(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams = SecondLeadParams()):
    """Rules 1 and 2 on a whole recording: ``(keep, episodes)``
    (:func:`beatflow.detect.leads.second_lead_keep_xp`)."""
    return leads.second_lead_keep_xp(x0, x1, peaks, fs, s, p, **_LEAD_STEPS)


def second_lead_peaks(x0, x1, peaks, fs: float, s: SegmentSamples, p: SecondLeadParams = SecondLeadParams()):
    """The three rules of the second lead on a whole recording: ``(peaks, episodes, dropped, moved)``
    (:func:`beatflow.detect.leads.second_lead_peaks_xp`)."""
    return leads.second_lead_peaks_xp(x0, x1, peaks, fs, s, p, **_LEAD_STEPS)

"""Beat segmentation: Ricker-wavelet response, 1-D non-maximum suppression, local thresholds.

One implementation for NumPy and CuPy (the array namespace comes from the input). A stream may be
cut into partitions: each is processed with a halo of its neighbours (``SegmentSamples.halo``) and
keeps only the peaks in its own core, so the result does not depend on the partitioning.
"""
from __future__ import annotations

import numpy as np

from .backend import namespace_of, scipy_for
from .params import SegmentSamples


def ricker(points: int, a: float, xp=np):
    """Ricker wavelet (negative second derivative of a Gaussian, "Mexican hat"), zero mean.

    Parameters
    ----------
    points : int
        Number of taps (odd, centred).
    a : float
        Width in samples: the central lobe spans ``[-a, a]``.
    xp : module
        Array namespace of the result.

    Returns
    -------
    array, shape (points,), float64
        ``A (1 - t²/a²) exp(-t²/2a²)`` with its small truncation mean removed so that a constant
        (baseline) has no response.
    """
    t = xp.arange(points, dtype=xp.float64) - (points - 1) / 2.0
    amp = 2.0 / (np.sqrt(3.0 * a) * np.pi**0.25)
    w = amp * (1.0 - (t / a) ** 2) * xp.exp(-(t**2) / (2.0 * a**2))
    return w - w.mean()


def wavelet_response(x, s: SegmentSamples):
    """FFT convolution of ``x`` with the Ricker wavelet, same length as ``x``, float64.

    The ends are padded with the edge values (not zeros), so a baseline offset at the stream's ends
    does not look like a beat.
    """
    xp = namespace_of(x)
    signal, _ = scipy_for(xp)
    half = s.kernel // 2
    padded = xp.pad(x.astype(xp.float64, copy=False), half, mode="edge")
    return signal.fftconvolve(padded, ricker(s.kernel, s.a, xp), mode="valid")


def local_maxima(env, half_window: int):
    """Indices where ``env`` is the maximum of its ``±half_window`` neighbourhood and positive.

    The 1-D non-maximum suppression of the seed (a dense gate becomes a sparse index list).
    """
    xp = namespace_of(env)
    if xp is not np:  # the GPU has its own kernel (beatflow.kernels), tested against the same reference
        from .kernels import local_maxima_gpu

        return local_maxima_gpu(env, half_window)
    _, ndimage = scipy_for(xp)
    m = ndimage.maximum_filter1d(env, size=2 * half_window + 1, mode="nearest")
    return xp.flatnonzero((env == m) & (env > 0))


def block_amplitude(env, first: int, s: SegmentSamples):
    """Local amplitude per stream-aligned block: median over ``±blocks`` of block maxima of ``env``.

    Parameters
    ----------
    env : array
        Non-negative response over global samples ``[first, first + len(env))``.
    first : int
        Global index of ``env[0]``.

    Returns
    -------
    (amp, b0) : array, int
        ``amp[k]`` is the local amplitude of global block ``b0 + k``.
    """
    xp = namespace_of(env)
    n = env.shape[0]
    b0 = first // s.block
    lead = first - b0 * s.block  # samples of block b0 before env[0]
    nb = -(-(lead + n) // s.block)
    # blocks are aligned to the stream: pad to whole blocks (with -inf, never a maximum), reshape
    padded = xp.pad(env, (lead, nb * s.block - lead - n), constant_values=-np.inf)
    bmax = padded.reshape(nb, s.block).max(axis=1)
    k = s.blocks
    padded = xp.pad(bmax, k, constant_values=np.nan)
    win = xp.stack([padded[i : i + nb] for i in range(2 * k + 1)], axis=1)
    return xp.nanmedian(win, axis=1), b0


def drop_refractory(peaks, heights, refractory: int):
    """Of two consecutive peaks closer than ``refractory`` samples, drop the smaller one."""
    xp = namespace_of(peaks)
    if peaks.shape[0] < 2:
        return peaks
    close = xp.diff(peaks) < refractory
    left_smaller = heights[:-1] < heights[1:]
    drop = xp.zeros(peaks.shape[0], dtype=bool)
    drop[:-1] |= close & left_smaller
    drop[1:] |= close & ~left_smaller
    return peaks[~drop]


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
        Sorted global sample indices of the detected peaks, in the namespace of ``x``.
    """
    xp = namespace_of(x)
    env = xp.abs(wavelet_response(x, s))
    cand = local_maxima(env, s.nms)
    amp, b0 = block_amplitude(env, first, s)
    heights = env[cand]
    blocks = (cand + first) // s.block - b0
    # above the local threshold, and above float32 round-off of the signal's level (flat lines)
    floor = 1e-5 * float(xp.abs(x).max()) if x.shape[0] else 0.0
    keep = (heights > s.ratio * amp[blocks]) & (heights > floor)
    cand, heights = cand[keep], heights[keep]
    peaks = drop_refractory(cand, heights, s.refractory).astype(xp.int64) + first
    if core is not None:
        peaks = peaks[(peaks >= core[0]) & (peaks < core[1])]
    return peaks

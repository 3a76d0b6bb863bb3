"""Beats: from peaks to a ragged (CSR) view over the stream, pruning, and the padded beat matrix."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from beatflow.device import namespace_of
from beatflow.params import SegmentSamples


def beats_from_peaks(peaks, s: SegmentSamples, n_samples: int):
    """Beat boundaries of one recording from its sorted peaks.

    Beat ``i`` starts ``pre`` samples before peak ``i`` and ends where beat ``i+1`` starts, so its
    length is the interval to the next peak (the seed's "adjacent differences"). The last peak has
    no successor and makes no beat; a beat starting before sample 0 is dropped.

    Returns
    -------
    (peak, start, length) : int64 arrays, one entry per beat
    """
    xp = namespace_of(peaks)
    peaks = peaks.astype(xp.int64, copy=False)
    if peaks.shape[0] < 2:
        e = xp.zeros(0, dtype=xp.int64)
        return e, e, e
    start = peaks[:-1] - s.pre
    length = xp.diff(peaks)
    ok = xp.flatnonzero((start >= 0) & (start + length <= n_samples))  # one compaction (one sync on a GPU)
    return peaks[ok], start[ok], length[ok]


#: what the VAE is trained on and scores (recorded in model.json)
MODEL_INPUT = "beat rows / scale - dominant beat of their recording (elementwise median of its rows)"
#: at most this many rows (evenly spaced) enter a stream's dominant beat
DOMINANT_SAMPLE = 16384


def beat_rows(x, peaks, s: SegmentSamples, n_samples: int, *, first: int = 0, baseline_samples: int = 0):
    """The beats of one recording's sorted peaks that get a row, and their rows.

    :func:`beats_from_peaks`, :func:`kept_mask`, :func:`row_lengths` and :func:`embed` in one call;
    on the GPU (CuPy input) three kernels and one synchronisation (``kernels.beat_rows_gpu``).

    Parameters
    ----------
    x : array, 1-D
        Samples ``[first, first + len(x))`` of the recording (every kept beat lies in it).
    peaks : int array
        Sorted peaks of the whole recording (global sample indices).
    n_samples : int
        Length of the recording.

    Returns
    -------
    (index, peak, start, length, rows, p2p)
        For each kept beat: its index among the beats of :func:`beats_from_peaks`, its peak, start
        and length (int64), its row (float32, ``s.width``) and peak-to-peak.
    """
    xp = namespace_of(x)
    if xp is not np:
        from beatflow.gpu.kernels import beat_rows_gpu

        return beat_rows_gpu(x, peaks, s, n_samples, first=first, baseline_samples=baseline_samples)
    peak, start, length = beats_from_peaks(np.asarray(peaks), s, n_samples)
    kept = kept_mask(length, s)
    rows, p2p = embed(x, start[kept], row_lengths(length[kept], s), s.width, first=first,
                      baseline_samples=baseline_samples)
    return np.flatnonzero(kept), peak[kept], start[kept], length[kept], rows, p2p


def dominant_beat(rows):
    """A stream's dominant beat: the elementwise median of its (scaled) beat rows.

    Most beats of a recording are that patient's normal beats, so the median row is their shape,
    and a beat's difference from it (:func:`residual_rows`) is what makes it unusual *for this
    patient*; the VAE is trained on and scores those differences, which makes its score comparable
    across patients whose normal beats differ (bundle branch blocks, lead placement). Long streams
    use at most :data:`DOMINANT_SAMPLE` evenly spaced rows (deterministic).

    Parameters
    ----------
    rows : array (n, width), NumPy or CuPy

    Returns
    -------
    array (width,) of ``rows.dtype`` (zeros when there are no rows)
    """
    xp = namespace_of(rows)
    n = int(rows.shape[0])
    if n == 0:
        return xp.zeros(rows.shape[1], dtype=rows.dtype)
    step = -(-n // DOMINANT_SAMPLE)
    return xp.median(rows[::step], axis=0).astype(rows.dtype)


def residual_rows(rows, dominant):
    """The rows minus their stream's dominant beat (the VAE's input); a new array."""
    xp = namespace_of(rows)
    return rows - xp.asarray(dominant, dtype=rows.dtype)[None, :]


def prune_mask(length, lower: int, upper: int):
    """The seed's rule: beats kept when ``lower <= length <= upper``."""
    return (length >= lower) & (length <= upper)


def kept_mask(length, s: SegmentSamples):
    """Beats that get a row: ``length >= s.lower``, and ``length <= s.upper`` unless ``s.cut_long``
    (then a longer beat is kept with its row cut to ``s.upper`` samples, see :func:`row_lengths`)."""
    return (length >= s.lower) if s.cut_long else prune_mask(length, s.lower, s.upper)


def row_lengths(length, s: SegmentSamples):
    """Samples of each beat that go into its row: ``min(length, s.upper)``."""
    xp = namespace_of(length)
    return xp.minimum(length, s.upper)


@dataclass
class RaggedBeats:
    """Consecutive beats as a CSR matrix over the stream, with no copy of the samples.

    Row ``i`` is ``data[indptr[i]:indptr[i+1]]``: ``indptr`` are the beat boundaries and ``data``
    is the stream itself.
    """

    indptr: object
    data: object

    @classmethod
    def from_starts(cls, data, start, length) -> "RaggedBeats":
        xp = namespace_of(data)
        if start.shape[0] == 0:
            return cls(xp.zeros(1, dtype=xp.int64), data)
        indptr = xp.concatenate([start, start[-1:] + length[-1:]])
        return cls(indptr, data)

    @property
    def n_rows(self) -> int:
        return int(self.indptr.shape[0]) - 1

    @property
    def lengths(self):
        return self.indptr[1:] - self.indptr[:-1]

    def row(self, i: int):
        return self.data[int(self.indptr[i]) : int(self.indptr[i + 1])]

    def to_padded(self, width: int, rows=None, baseline_samples: int = 0):
        """The zero-padded ``(n, width)`` float32 matrix of the rows (all, or those in ``rows``).

        See :func:`embed`.
        """
        start, length = self.indptr[:-1], self.lengths
        if rows is not None:
            start, length = start[rows], length[rows]
        return embed(self.data, start, length, width, baseline_samples=baseline_samples)


def embed(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0, chunk: int = 8192):
    """Write each beat into a row of a zero-padded matrix.

    Parameters
    ----------
    x : array, 1-D
        Samples ``[first, first + len(x))`` of the recording.
    start, length : int arrays
        Global start and length of each beat (``length <= width``, beats inside ``x``).
    width : int
        Row width D.
    baseline_samples : int
        If > 0, each row has the mean of its first ``baseline_samples`` samples (the isoelectric
        stretch before the QRS) subtracted, so rows share a zero baseline.

    Returns
    -------
    rows : float32 array (n, width)
        Beat samples then zeros.
    peak_to_peak : float32 array (n,)
        Range of each beat's samples (for a stream-wide amplitude scale).
    """
    xp = namespace_of(x)
    if xp is not np:  # warp-per-beat CUDA kernel (beatflow.gpu.kernels), same contract
        from beatflow.gpu.kernels import embed_gpu

        return embed_gpu(x, start, length, width, first=first, baseline_samples=baseline_samples)
    n = int(start.shape[0])
    rows = xp.zeros((n, width), dtype=xp.float32)
    p2p = xp.zeros(n, dtype=xp.float32)
    cols = xp.arange(width)
    for lo in range(0, n, chunk):
        st = start[lo : lo + chunk] - first
        ln = length[lo : lo + chunk]
        idx = st[:, None] + cols[None, :]
        valid = cols[None, :] < ln[:, None]
        vals = x[xp.minimum(idx, x.shape[0] - 1)].astype(xp.float32)
        if baseline_samples > 0:
            vals = vals - vals[:, :baseline_samples].mean(axis=1, keepdims=True)
        hi = xp.where(valid, vals, -xp.inf).max(axis=1)
        lo_ = xp.where(valid, vals, xp.inf).min(axis=1)
        p2p[lo : lo + chunk] = hi - lo_
        rows[lo : lo + chunk] = xp.where(valid, vals, 0)
    return rows, p2p

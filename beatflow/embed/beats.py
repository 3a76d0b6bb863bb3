"""Beats: from peaks to a ragged (CSR) view over the stream, pruning, and the padded beat matrix.

Array code for NumPy and CuPy (the namespace comes from the input): the reference of the GPU's
kernels (:mod:`beatflow.embed.gpu`); :mod:`beatflow.embed` chooses between them
(:func:`beatflow.embed.embed`, :func:`beatflow.embed.beat_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

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


def beat_rows_xp(x, peaks, s: SegmentSamples, n_samples: int, *, first: int = 0, baseline_samples: int = 0):
    """The beats of one recording's sorted peaks that get a row, and their rows.

    :func:`beats_from_peaks`, :func:`kept_mask`, :func:`row_lengths` and :func:`embed_xp` in one call
    (on the GPU three kernels and one synchronisation do the same:
    :func:`beatflow.embed.gpu.beat_rows_gpu`).

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
    peak, start, length = beats_from_peaks(xp.asarray(peaks), s, n_samples)
    kept = kept_mask(length, s)
    rows, p2p = embed_xp(x, start[kept], row_lengths(length[kept], s), s.width, first=first,
                         baseline_samples=baseline_samples)
    return xp.flatnonzero(kept), peak[kept], start[kept], length[kept], rows, p2p


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

        See :func:`embed_xp`.
        """
        start, length = self.indptr[:-1], self.lengths
        if rows is not None:
            start, length = start[rows], length[rows]
        return embed_xp(self.data, start, length, width, baseline_samples=baseline_samples)


def embed_xp(x, start, length, width: int, *, first: int = 0, baseline_samples: int = 0, chunk: int = 8192):
    """Write each beat into a row of a zero-padded matrix (the warp-per-beat kernel of
    :func:`beatflow.embed.gpu.embed_gpu` has the same contract).

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

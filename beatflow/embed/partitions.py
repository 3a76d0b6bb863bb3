"""Partitions of a stream: halos from neighbours, per-partition work, and the stream-wide beat plan.

Pure functions on arrays (NumPy or CuPy); the Prefect tasks of :mod:`beatflow.pipeline.stages` call
them on workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from beatflow.detect import detect_beats, flutter_keep, peak_measures, quality_rule
from beatflow.detect.leads import doubtful, misplaced
from beatflow.device import namespace_of, to_host
from beatflow.embed import embed
from beatflow.embed.beats import beats_from_peaks, kept_mask
from beatflow.io.sources import PartitionSpec
from beatflow.params import SegmentSamples


def edges(x, halo: int):
    """The first and last ``halo`` samples of a partition (copies: small, they travel)."""
    return x[:halo].copy(), x[max(0, x.shape[0] - halo):].copy()


def assemble_halos(specs: list[PartitionSpec], lengths: list[int], heads: list, tails: list, halo: int):
    """Left and right halos of every partition, and the global first sample of each core.

    A halo never crosses into another recording, and collects as many neighbours as it needs
    (a neighbour may be shorter than the halo).

    Returns
    -------
    (lefts, rights, firsts)
    """
    n = len(specs)
    firsts, pos = [], {}
    for k, sp in enumerate(specs):
        pos.setdefault(sp.recording, 0)
        firsts.append(pos[sp.recording])
        pos[sp.recording] += lengths[k]
    lefts, rights = [], []
    for k, sp in enumerate(specs):
        xp = namespace_of(heads[k])
        left, need, j = [], halo, k - 1
        while need > 0 and j >= 0 and specs[j].recording == sp.recording:
            piece = tails[j][max(0, tails[j].shape[0] - need):]
            left.insert(0, piece)
            need -= piece.shape[0]
            j -= 1
        right, need, j = [], halo, k + 1
        while need > 0 and j < n and specs[j].recording == sp.recording:
            piece = heads[j][:need]
            right.append(piece)
            need -= piece.shape[0]
            j += 1
        empty = xp.zeros(0, dtype=heads[k].dtype)
        lefts.append(xp.concatenate(left) if left else empty)
        rights.append(xp.concatenate(right) if right else empty)
    return lefts, rights, firsts


def extend(core, left, right):
    """``left + core + right`` as one array (the partition with its halos)."""
    xp = namespace_of(core)
    return xp.concatenate([xp.asarray(left, dtype=core.dtype), core, xp.asarray(right, dtype=core.dtype)])


def segment_partition(core, left, right, first: int, s: SegmentSamples, *, episodes: bool = False, second=None,
                      q=None, n_total: int | None = None, quality=None):
    """Peaks (global sample indices in the recording) whose position lies in this partition's core;
    with ``episodes``, also the ventricular flutter/fibrillation episodes within the core
    (``[start, end)`` ranges, :func:`beatflow.detect.detect_beats`).

    With ``second = (core, left, right)`` of a second lead (the same halos) and its rules ``q``
    (:class:`beatflow.detect.leads.SecondLeadSamples`; ``n_total``: the recording's length):
    ``(peaks, episodes, measures)``, the peaks outside the flutter episodes of either lead, those
    episodes, and the peaks' measures (:func:`beatflow.detect.peak_measures`) for rules 2 and 3, which
    compare each peak with its neighbours and so run once the partitions' peaks are gathered
    (:func:`second_lead_gathered`).

    With ``quality`` (:class:`beatflow.params.QualitySamples`; the halos at least its ``halo``), the
    peaks inside unreadable stretches are dropped (:func:`beatflow.detect.quality_rule`, on the first
    lead) and the result gains a last element, ``(spans, reasons)``: those stretches within the core
    (the result is then a tuple even without ``episodes``)."""
    x = extend(core, left, right)
    x_first, span = first - left.shape[0], (first, first + core.shape[0])
    peaks, eps = detect_beats(x, s, first=x_first, core=span)
    unreadable = ()
    if quality is not None:
        keep, spans, reasons = quality_rule(x, peaks, x_first, quality, span)
        peaks, unreadable = peaks[keep], ((spans, reasons),)
    if second is None:
        if quality is None:
            return (peaks, eps) if episodes else peaks
        return ((peaks, eps) if episodes else (peaks,)) + unreadable
    x1 = extend(*second)
    if x1.shape != x.shape:
        raise ValueError(f"the two leads' partitions differ in length ({x.shape[0]} and {x1.shape[0]} samples)")
    keep, both = flutter_keep(x, x1, peaks, x_first, s, q, span)
    if q.baseline > 0 and s.vf_baseline > 0:  # (the first lead's episodes lie within both leads')
        peaks, eps = peaks[keep], both
    return (peaks, eps, peak_measures(x, x1, peaks, x_first, int(n_total), s, q)) + unreadable


def second_lead_gathered(specs: list[PartitionSpec], peaks: list, measures: list, q, s: SegmentSamples):
    """Rules 2 and 3 of the second lead (:func:`beatflow.detect.leads.doubtful`,
    :func:`beatflow.detect.leads.misplaced`), which compare each peak with its neighbours, over each recording's gathered peaks and measures
    (its partitions in order): ``(peaks per partition, number dropped, number moved)``. A moved peak
    stays in its partition's list (its place between its neighbours keeps the concatenation sorted;
    :func:`plan_beats` gives it to the partition that holds its new position)."""
    out, dropped, moved = list(peaks), 0, 0
    for rec in sorted({sp.recording for sp in specs}):
        idx = [k for k, sp in enumerate(specs) if sp.recording == rec]
        m = [np.concatenate([to_host(measures[k][i]) for k in idx]) for i in range(6)]
        pk = np.concatenate([to_host(peaks[k]).astype(np.int64) for k in idx])
        keep = ~doubtful(*m[:3], q)
        move, new = misplaced(pk[keep], *(v[keep] for v in m), q, s.refractory, s.twave)
        full = pk.copy()
        full[np.flatnonzero(keep)] = new
        bounds = np.cumsum([0] + [len(peaks[k]) for k in idx])
        for k, a, b in zip(idx, bounds[:-1], bounds[1:]):
            out[k] = full[a:b][keep[a:b]]
        dropped += int((~keep).sum())
        moved += int(move.sum())
    return out, dropped, moved


def embed_partition(core, left, right, first: int, start, length, s: SegmentSamples):
    """Padded beat rows and peak-to-peak amplitudes of this partition's kept beats."""
    xp = namespace_of(core)
    x = extend(core, left, right)
    return embed(x, xp.asarray(start), xp.asarray(length), s.width, first=first - left.shape[0],
                 baseline_samples=max(1, s.pre // 2))


def snippets(core, left, right, first: int, windows):
    """Signal snippets ``[(a, b), ...]`` (global, clipped to what this partition sees), as NumPy."""
    x = extend(core, left, right)
    x0 = first - left.shape[0]
    out = []
    for a, b in windows:
        lo, hi = max(a, x0), min(b, x0 + x.shape[0])
        out.append((lo, to_host(x[lo - x0 : hi - x0]).astype(np.float32)))
    return out


def top_windows(score, start, length, top: int, pad: int) -> list[tuple[int, int]]:
    """The windows ``(start - pad, start + length + pad)`` of the ``top`` highest ``score`` rows, highest
    first (ties in row order, as the anomaly table ranks them). A partition's own top rows include every
    beat of it among the whole stream's top: a beat with fewer than ``top`` higher-ranked beats in the
    stream has fewer in its partition."""
    from beatflow.score.rule import top_order

    order = top_order(score, max(0, int(top)))
    return [(int(start[i]) - int(pad), int(start[i]) + int(length[i]) + int(pad)) for i in order]


@dataclass
class BeatPlan:
    """All detected beats of the stream (host arrays, small) and which partition owns each."""

    recording: np.ndarray
    peak: np.ndarray
    start: np.ndarray
    length: np.ndarray
    kept: np.ndarray
    owner: np.ndarray
    upper: int = 1 << 62  # row length cap (SegmentSamples.upper)

    @property
    def n_detected(self) -> int:
        return int(self.peak.shape[0])

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    def kept_of(self, partition: int):
        """(start, row length) of the kept beats owned by ``partition``, in stream order (a beat
        longer than the row is cut to it: :func:`beatflow.embed.beats.row_lengths`)."""
        m = self.kept & (self.owner == partition)
        return self.start[m], np.minimum(self.length[m], self.upper)


def peaks_by_recording(specs: list[PartitionSpec], peaks: list) -> dict[int, np.ndarray]:
    """Each recording's sorted peaks (host int64), from its partitions' (in order)."""
    out = {}
    for rec in sorted({sp.recording for sp in specs}):
        out[rec] = np.concatenate([to_host(peaks[k]).astype(np.int64) for k, sp in enumerate(specs)
                                   if sp.recording == rec])
    return out


def plan_beats(specs: list[PartitionSpec], firsts: list[int], n_samples: dict[int, int], peaks: list,
               s: SegmentSamples) -> BeatPlan:
    """Beats of every recording from the peaks of its partitions (in order); too short ones pruned."""
    cols = {k: [] for k in ("recording", "peak", "start", "length", "owner")}
    for rec in sorted({sp.recording for sp in specs}):
        idx = [k for k, sp in enumerate(specs) if sp.recording == rec]
        pk = np.concatenate([to_host(peaks[k]).astype(np.int64) for k in idx])
        peak, start, length = beats_from_peaks(pk, s, n_samples[rec])
        part_first = np.asarray([firsts[k] for k in idx])
        owner = np.asarray(idx)[np.searchsorted(part_first, peak, side="right") - 1]
        for key, val in (("recording", np.full(peak.shape[0], rec)), ("peak", peak), ("start", start),
                         ("length", length), ("owner", owner)):
            cols[key].append(val)
    cat = {k: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for k, v in cols.items()}
    return BeatPlan(kept=kept_mask(cat["length"], s), upper=s.upper, **cat)

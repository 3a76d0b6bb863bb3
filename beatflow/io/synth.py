"""Synthetic long ECG recordings with known beats, for testing beat detection, beat classes, signal
quality and anomaly scoring.

The generator is vectorised NumPy (no loop over beats except chunking) and deterministic for a
seed. Its parts, each drawn from its own child stream of ``np.random.SeedSequence(seed)`` so that
beat timing, labels and morphology do not depend on the sampling rate:

* **Rhythm** -- an integral pulse frequency modulation model: the instantaneous heart rate is a
  day-long drift of the mean rate (60..95 bpm) plus LF (~0.1 Hz) and respiratory HF (~0.25 Hz)
  modulation; beats fall where the integrated rate crosses whole numbers, then get a small
  random jitter. Normal RR intervals stay within 0.47..0.98 s.
* **Beats** -- each beat is a sum of five (possibly asymmetric) Gaussian waves P, Q, R, S, T in the
  spirit of McSharry's ECGSYN, with widths in seconds, per-beat jitter, ~±10 % respiratory
  amplitude modulation, and a T wave whose delay scales with ``sqrt(RR)`` (QT ~ sqrt(RR)). Normal
  R is about 1 mV and the QRS about 90 ms wide.
* **PVCs** (label 1, AAMI class V) -- ectopic events start at a sinus beat with probability
  ``pvc_rate``; an event is a single PVC, a couplet (share ``couplet_share``) or a run of 3..8
  (non-sustained VT, share ``run_share``). The first PVC is premature (coupling 0.55..0.75 x RR, at
  least 0.41 s); a couplet's second PVC follows 0.41..0.55 s later, a run's beats every 0.41..0.50 s
  (each run at its own rate, with a little jitter, as fast as the segmenter's shortest beat allows;
  never slower than 0.95 sinus RR). After a single PVC
  the next sinus beat keeps its sinus time (full compensatory pause) unless that pause would
  exceed 1 s, where the sinus rhythm resets instead; after a couplet or a run the sinus rhythm
  resets (a pause of 1.05..1.3 RR, at most 1 s). Every beat-to-beat interval lies in 0.41..1.0 s
  (100..256 samples at 250 Hz: the segmenter's beat lengths, ``SegmentParams.min_length_s`` and
  ``max_length_s``). No P wave, a wide (~140 ms) high-amplitude QRS and a broad discordant T wave,
  from one of three foci (multiform; ``pvc_form``): 0 the usual one (~65 %, positive, ~1.8 mV),
  1 inverted (~20 %), 2 wide and biphasic (~15 %, an initial opposite notch). A run keeps the focus
  of its first beat; single PVCs and couplets draw theirs.
* **APCs** (label 3, AAMI class S) -- a sinus beat becomes an atrial premature contraction with
  probability ``apc_rate``: premature (coupling 0.6..0.85 x RR, at least 0.41 s unless that is not
  premature), the patient's usual narrow QRS and T, and a changed P wave: inverted with a short PR
  (40 %), peaked and narrow (30 %), or early enough to hide in the previous beat's T wave (30 %).
  The sinus node is reset, so the pause is not compensatory: the next beat comes 1.0..1.1 sinus RR
  after the APC (at most 1 s). Ectopic events never touch: each has a sinus beat before and after.
* **Artifacts** (label 2) -- a 0.2..0.6 s burst (band-limited noise, or a motion-like transient)
  over one normal beat, kept short enough that its neighbours' QRS complexes are untouched.
* **Unreadable episodes** -- ``episodes_per_hour`` (stochastically rounded: 20 h at the default 0.25
  make exactly 5) non-overlapping episodes of 5..60 s (log-uniform), of three kinds in turn
  (``unreadable_reason``): ``"noise"``, strong broadband muscle-like noise (0.5..1.2 mV RMS, white to
  the Nyquist rate, its envelope ramped in over 0.3 s and swelling like contractions) that hides
  the QRS; ``"lead_off"``, a flat line at a rail (±:data:`RAIL_MV`) or at a constant level a step
  away from the signal, with a step at its start and end; ``"clipping"``, an offset that jumps
  past a rail and recovers over the episode while the amplifier clips at the rail. The beats under
  them stay in the truth with their class, flagged in ``beat_unreadable``.
* **Noise** -- baseline wander (a few 0.05..0.5 Hz sinusoids, a respiratory component and a slow
  random drift), white noise, and a small 50 Hz hum.

The truth (:meth:`SyntheticECG.save`, :func:`truth_path`; ``truth.npz`` of the flow) holds, per beat,
``r_peaks`` (int64 samples), ``labels`` (int8 codes of :data:`LABEL_NAMES`: 0 normal N, 1 PVC V,
2 artifact, 3 APC S; :data:`AAMI_CLASS` gives the letters), ``beat_unreadable`` (bool),
``run_length`` (int8: the number of consecutive PVCs the beat belongs to, 1 single, 2 couplet,
3..8 run; 0 for other beats) and ``pvc_form`` (int8 focus, -1 for other beats); per episode
``unreadable`` (int64 ``(m, 2)``, ``[start, end)`` samples, sorted) and ``unreadable_reason``
(unicode strings); and ``fs``.

Beat windows are rendered in chunks and accumulated into the stream with ``np.bincount``, so a
20 h recording at 250 Hz (18 M samples) takes a few seconds and a few hundred MB.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["AAMI_CLASS", "LABEL_NAMES", "RAIL_MV", "UNREADABLE_REASONS", "SyntheticECG", "synthesize_ecg",
           "truth_path"]

#: the truth's beat labels (``labels``): the beat's class, or an artifact over a normal beat
LABEL_NAMES = {0: "normal", 1: "pvc", 2: "artifact", 3: "apc"}
#: the AAMI class letter of each label that is a beat class (an artifact, 2, is none)
AAMI_CLASS = {0: "N", 1: "V", 3: "S"}
#: the kinds of unreadable episode (``unreadable_reason``)
UNREADABLE_REASONS = ("noise", "lead_off", "clipping")
#: the amplifier's rails (mV): a lead-off may sit at one, a saturated signal is clipped at them
RAIL_MV = 5.0

# Coarse time grid (Hz) for the slow processes (heart rate, respiration, baseline wander).
_GRID_FS = 10.0
# Beat window relative to the R fiducial (seconds): covers the P wave and a late PVC T wave.
_WIN_PRE_S = 0.30
_WIN_POST_S = 0.62
# Half-width (seconds) of the region searched for the QRS main deflection.
_QRS_HALF_S = 0.06
# Normal RR limits (seconds).
_RR_MIN_S = 0.47
_RR_MAX_S = 0.98
# Shortest PVC coupling interval and longest post-PVC pause (seconds): every beat-to-beat interval
# stays within 0.41..1.0 s, i.e. 100..256 samples at 250 Hz (the segmenter's beat lengths).
_PVC_MIN_COUPLING_S = 0.41
_MAX_PAUSE_S = 1.0
# Beat-to-beat interval inside a couplet and inside a run (seconds; runs also have a rate of their own).
_COUPLET_S = (0.41, 0.55)
_RUN_S = (0.41, 0.50)
_RUN_LENGTHS = (3, 8)
# Unreadable episodes: duration range (s, log-uniform), the quiet time kept at the stream's ends
# and between two episodes (s), and the noise envelope's ramp (s).
_EPISODE_S = (5.0, 60.0)
_EPISODE_EDGE_S = 2.0
_EPISODE_GAP_S = 10.0
_EPISODE_RAMP_S = 0.3
_BEAT_CHUNK = 2048
_SAMPLE_CHUNK = 1 << 20
# Wave slots: P, Q, R, S, T.
_N_WAVES = 5


def truth_path(path) -> Path:
    """Where :meth:`SyntheticECG.save` writes the truth of a signal saved at ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        Path of the signal (``.npy`` is appended if missing).

    Returns
    -------
    pathlib.Path
        ``<stem>.truth.npz`` next to the signal file.
    """
    p = _signal_path(path)
    return p.with_name(p.name[: -len(".npy")] + ".truth.npz")


def _signal_path(path) -> Path:
    p = Path(path)
    return p if p.name.endswith(".npy") else p.with_name(p.name + ".npy")


@dataclass(eq=False)
class SyntheticECG:
    """A synthetic ECG stream and its ground truth.

    Attributes
    ----------
    signal : numpy.ndarray
        float32, shape ``(n_samples,)``, millivolts.
    fs : float
        Sampling rate in Hz.
    r_peaks : numpy.ndarray
        int64, sorted sample index of each true beat's QRS main deflection (R peak; the trough
        for a negative PVC).
    labels : numpy.ndarray
        int8 per beat: 0 normal (N), 1 PVC (V), 2 artifact-corrupted normal beat, 3 APC (S) (see
        :data:`LABEL_NAMES`, :data:`AAMI_CLASS`).
    beat_unreadable : numpy.ndarray
        bool per beat: its R peak lies inside an unreadable episode (default: none).
    run_length : numpy.ndarray
        int8 per beat: for a PVC, how many PVCs in a row it belongs to (1 single, 2 couplet, 3..8
        run); 0 for other beats (default: from ``labels``).
    pvc_form : numpy.ndarray
        int8 per beat: a PVC's focus (0 usual, 1 inverted, 2 wide biphasic); -1 for other beats
        (default: -1 for all).
    unreadable : numpy.ndarray
        int64 ``(m, 2)``: the unreadable episodes' ``[start, end)`` samples, sorted, not overlapping.
    unreadable_reason : numpy.ndarray
        unicode, ``(m,)``: each episode's kind (:data:`UNREADABLE_REASONS`).
    """

    signal: np.ndarray
    fs: float
    r_peaks: np.ndarray
    labels: np.ndarray
    beat_unreadable: np.ndarray | None = None
    run_length: np.ndarray | None = None
    pvc_form: np.ndarray | None = None
    unreadable: np.ndarray | None = None
    unreadable_reason: np.ndarray | None = None

    def __post_init__(self):
        n = np.shape(self.labels)[0]
        if self.beat_unreadable is None:
            self.beat_unreadable = np.zeros(n, bool)
        if self.run_length is None:
            self.run_length = _run_lengths(np.asarray(self.labels) == 1)
        if self.pvc_form is None:
            self.pvc_form = np.full(n, -1, np.int8)
        if self.unreadable is None:
            self.unreadable = np.zeros((0, 2), np.int64)
        if self.unreadable_reason is None:
            self.unreadable_reason = np.zeros(0, "<U8")

    def truth(self) -> dict:
        """The truth's arrays as :meth:`save` writes them (the module docstring lists them)."""
        return {"r_peaks": np.asarray(self.r_peaks, np.int64), "labels": np.asarray(self.labels, np.int8),
                "fs": np.float64(self.fs), "beat_unreadable": np.asarray(self.beat_unreadable, bool),
                "run_length": np.asarray(self.run_length, np.int8), "pvc_form": np.asarray(self.pvc_form, np.int8),
                "unreadable": np.asarray(self.unreadable, np.int64).reshape(-1, 2),
                "unreadable_reason": np.asarray(self.unreadable_reason, dtype=str).astype("<U8")}

    @property
    def duration_s(self) -> float:
        """Length of the stream in seconds."""
        return self.signal.shape[0] / self.fs

    def save(self, path) -> None:
        """Write the signal as a float32 ``.npy`` and the truth next to it.

        Parameters
        ----------
        path : str or os.PathLike
            Signal path; ``.npy`` is appended if missing. The truth (:meth:`truth`: ``r_peaks``,
            ``labels``, ``fs``, ``beat_unreadable``, ``run_length``, ``pvc_form``, ``unreadable``,
            ``unreadable_reason``) goes to :func:`truth_path` ``(path)``, i.e. ``<stem>.truth.npz``.
            Parent folders are created.

        Returns
        -------
        None
        """
        sig = _signal_path(path)
        sig.parent.mkdir(parents=True, exist_ok=True)
        np.save(sig, np.ascontiguousarray(self.signal, dtype=np.float32))
        np.savez(truth_path(sig), **self.truth())

    @classmethod
    def load(cls, path, *, mmap: bool = False) -> "SyntheticECG":
        """Read what :meth:`save` wrote (a truth of ``r_peaks``, ``labels`` and ``fs`` alone gets the
        other arrays' defaults).

        Parameters
        ----------
        path : str or os.PathLike
            Signal path given to :meth:`save`.
        mmap : bool, optional
            Memory-map the signal instead of reading it.

        Returns
        -------
        SyntheticECG
        """
        sig = _signal_path(path)
        signal = np.load(sig, mmap_mode="r" if mmap else None)
        with np.load(truth_path(sig)) as t:
            extra = {k: t[k] for k in ("beat_unreadable", "run_length", "pvc_form", "unreadable",
                                       "unreadable_reason") if k in t.files}
            return cls(signal=signal, fs=float(t["fs"]), r_peaks=t["r_peaks"].astype(np.int64),
                       labels=t["labels"].astype(np.int8), **extra)


# ----------------------------------------------------------------------------------------------
# a cache of generated recordings
# ----------------------------------------------------------------------------------------------

#: where :func:`synthesize_cached` keeps recordings, unless ``$BEATFLOW_SYNTH_CACHE`` says otherwise
#: (``off`` turns the cache off)
DEFAULT_SYNTH_CACHE = os.path.join("~", ".cache", "beatflow", "synthetic")


def synthesize_cached(out_signal, out_truth, hours: float = 20.0, fs: float = 250.0, seed: int = 0,
                      cache_dir=None) -> tuple[SyntheticECG | None, bool]:
    """Write the recording of :func:`synthesize_ecg` ``(hours, fs, seed)`` to ``out_signal``
    (float32 ``.npy``) and its truth to ``out_truth`` (``.npz``: :meth:`SyntheticECG.truth`),
    linked (or copied) from a cache when it was generated before.

    The recording is a pure function of its arguments and of this module's code, so the cache key
    is a hash of both; a changed generator never serves an old recording. Entries are written
    atomically (a partial file is never taken for an entry); a cache that cannot be written only
    costs the time of generating.

    Parameters
    ----------
    out_signal, out_truth : path-like
        Files to write.
    hours, fs, seed : as :func:`synthesize_ecg`.
    cache_dir : path-like, optional
        Cache folder; default ``$BEATFLOW_SYNTH_CACHE`` or :data:`DEFAULT_SYNTH_CACHE`; ``"off"``: none.

    Returns
    -------
    (ecg, hit) : (SyntheticECG or None, bool)
        The generated recording (None on a hit: the files were linked or copied, :func:`_place`) and
        whether it came from the cache.
    """
    import hashlib
    import shutil
    import tempfile

    folder = cache_dir if cache_dir is not None else os.environ.get("BEATFLOW_SYNTH_CACHE", DEFAULT_SYNTH_CACHE)
    entry = None
    if os.fspath(folder) != "off":
        code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
        key = hashlib.sha256(repr((float(hours), float(fs), int(seed), code)).encode()).hexdigest()[:24]
        entry = Path(os.path.expanduser(os.fspath(folder))) / f"ecg-{key}.npy"
        if entry.is_file() and truth_path(entry).is_file():
            _place(entry, out_signal)
            _place(truth_path(entry), out_truth)
            return None, True
    ecg = synthesize_ecg(hours=hours, fs=fs, seed=seed)
    for out in (out_signal, out_truth):  # (a link to an entry is replaced, never written through)
        Path(out).unlink(missing_ok=True)
    np.save(out_signal, np.ascontiguousarray(ecg.signal, dtype=np.float32))
    np.savez(out_truth, **ecg.truth())
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=entry.parent, prefix=".tmp-") as tmp:
                shutil.copyfile(out_truth, Path(tmp) / "t.npz")
                shutil.copyfile(out_signal, Path(tmp) / "s.npy")
                os.replace(Path(tmp) / "t.npz", truth_path(entry))  # the truth first: the signal commits
                os.replace(Path(tmp) / "s.npy", entry)
        except OSError:
            pass
    return ecg, False


def _place(entry: Path, out) -> None:
    """``out`` becomes the cache's ``entry``: a hard link where both are on one file system (the
    20-hour recording is 72 MB: a copy cost 0.03-0.1 s of every warm run), else a copy. The entries
    are never changed in place (a new one replaces the file), and neither is ``out``: whatever was
    there is removed first, and :func:`synthesize_cached` removes its outputs before writing them."""
    import shutil

    Path(out).unlink(missing_ok=True)
    try:
        os.link(entry, out)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(entry, out)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _check_number(name: str, value, lo: float, hi: float = math.inf, *, lo_open=False,
                  hi_open=True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    bad_lo = v <= lo if lo_open else v < lo
    bad_hi = v >= hi if hi_open else v > hi
    if bad_lo or bad_hi:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{name} must be in {lb}{lo:g}, {hi:g}{rb}, got {value!r}")
    return v


def _smooth_noise(rng: np.random.Generator, n_grid: int, knot_s: float) -> np.ndarray:
    """A smooth random process on the coarse grid: N(0, 1) knots every ``knot_s`` seconds,
    cosine-interpolated (``n_grid`` values, one per ``1 / _GRID_FS`` s)."""
    m = max(1, int(round(knot_s * _GRID_FS)))  # grid points per knot
    knots = rng.standard_normal(n_grid // m + 2)
    w = 0.5 - 0.5 * np.cos(np.pi * np.arange(m) / m)
    return (knots[:-1, None] * (1.0 - w) + knots[1:, None] * w).ravel()[:n_grid]


def _run_lengths(mask: np.ndarray) -> np.ndarray:
    """int8 per element: the length of the run of consecutive True values it belongs to (0 where False)."""
    m = np.asarray(mask, bool)
    out = np.zeros(m.shape[0], np.int8)
    if m.any():
        d = np.diff(np.concatenate([[0], m.astype(np.int8), [0]]))
        lengths = np.flatnonzero(d == -1) - np.flatnonzero(d == 1)
        out[m] = np.repeat(np.minimum(lengths, 127), lengths)
    return out


def _ectopy(rng: np.random.Generator, t: np.ndarray, rr: np.ndarray, pvc_rate: float, couplet_share: float,
            run_share: float, apc_rate: float):
    """Ectopic events on the sinus beats ``t`` (s; ``rr``: the sinus RR ending at each beat).

    Each beat starts a PVC event with probability ``pvc_rate`` (a couplet with probability
    ``couplet_share``, a run of 3..8 with ``run_share``, else a single PVC) or is an APC with
    probability ``apc_rate``; the event's beats take the places of as many sinus beats. An event is
    kept when it starts after two beats, is followed by a beat, and starts after the sinus beat that
    follows the previous candidate event (candidates dropped this way included: a vectorised rule),
    so every event has a sinus beat before and after it.

    Returns
    -------
    gap : ndarray of float64, the interval (s) ending at each beat (``t[0] + cumsum(gap)`` are the times)
    labels : ndarray of int8, 0 sinus, 1 PVC, 3 APC
    form : ndarray of int8, each PVC's focus (0 usual, 1 inverted, 2 wide biphasic; a run shares its
        first beat's), -1 for other beats
    """
    n = t.shape[0]
    u = rng.random(n)
    kind_u = rng.random(n)
    run_len = rng.integers(_RUN_LENGTHS[0], _RUN_LENGTHS[1] + 1, n)
    coupling_v = rng.uniform(0.55, 0.75, n)
    coupling_a = rng.uniform(0.60, 0.85, n)
    couplet_s = rng.uniform(*_COUPLET_S, n)
    run_s = rng.uniform(*_RUN_S, n)
    jitter = rng.normal(0.0, 0.005, n)
    pause_run = rng.uniform(1.05, 1.3, n)
    pause_apc = rng.uniform(1.0, 1.1, n)
    form_u = rng.random(n)

    v = u < pvc_rate
    start = np.flatnonzero(u < pvc_rate + apc_rate)
    length = np.where(~v[start], 1, np.where(kind_u[start] < couplet_share, 2,
                                             np.where(kind_u[start] < couplet_share + run_share, run_len[start], 1)))
    after = start + length  # the sinus beat after each event
    prev_after = np.concatenate([[-1], np.maximum.accumulate(after)[:-1]]) if start.size else after
    ok = (start >= 2) & (after < n) & (start > prev_after)
    start, length, after = start[ok], length[ok], after[ok]
    ev = np.repeat(np.arange(start.size), length)  # event of each ectopic beat
    offs = np.arange(ev.size) - np.repeat(np.cumsum(length) - length, length)  # its place in the event
    idx = start[ev] + offs
    is_v = v[start]
    labels = np.zeros(n, np.int8)
    labels[idx] = np.where(is_v[ev], 1, 3)
    form = np.full(n, -1, np.int8)
    key = np.where(length[ev] >= 3, form_u[start[ev]], form_u[idx])
    form[idx[is_v[ev]]] = np.searchsorted([0.65, 0.85], key[is_v[ev]], side="right").astype(np.int8)

    # The intervals. A premature beat comes early after the beat before it (never under 0.41 s
    # unless that would not be premature); a couplet's or run's next PVCs follow at their fast rate.
    gap = np.diff(t, prepend=t[0])
    floor = np.minimum(_PVC_MIN_COUPLING_S, 0.85 * rr)
    first = start
    gap[first] = np.maximum(np.where(is_v, coupling_v[first], coupling_a[first]) * rr[first], floor[first])
    later = idx[offs > 0]
    fast = np.where(length[ev[offs > 0]] == 2, couplet_s[start[ev[offs > 0]]],
                    run_s[start[ev[offs > 0]]] + jitter[later])  # a run's own rate, a little jitter per beat
    gap[later] = np.maximum(np.minimum(fast, 0.95 * rr[later]), _PVC_MIN_COUPLING_S)
    # The sinus beat after: a single PVC keeps its sinus time (full compensatory pause) unless the
    # pause would pass _MAX_PAUSE_S; after a couplet or a run, and after an APC, the sinus node is
    # reset (the next beat about one RR later: no compensatory pause).
    single = is_v & (length == 1)
    pause = np.where(single, rr[first] - gap[first] + rr[after],
                     np.where(is_v, pause_run[start], pause_apc[start]) * rr[after])
    gap[after] = np.minimum(pause, _MAX_PAUSE_S)
    return gap, labels, form


def _episodes(rng: np.random.Generator, duration_s: float, per_hour: float):
    """Unreadable episodes in seconds: ``(start, end, kind)`` arrays, sorted and apart (kind indexes
    :data:`UNREADABLE_REASONS`). Their count is ``per_hour`` x hours, stochastically rounded, less
    those that do not fit in half the stream with their gaps; kinds come in turn, shuffled."""
    count = int(math.floor(per_hour * duration_s / 3600.0 + rng.random()))
    d = np.exp(rng.uniform(math.log(_EPISODE_S[0]), math.log(_EPISODE_S[1]), count))
    kinds = rng.permutation(np.arange(count) % len(UNREADABLE_REASONS))
    room = duration_s - 2.0 * _EPISODE_EDGE_S
    fits = np.cumsum(d + _EPISODE_GAP_S) - _EPISODE_GAP_S <= 0.5 * room
    d, kinds = d[fits], kinds[fits]
    m = d.size
    free = room - d.sum() - _EPISODE_GAP_S * max(m - 1, 0)
    u = np.sort(rng.uniform(0.0, max(free, 0.0), m))
    start = _EPISODE_EDGE_S + u + np.concatenate([[0.0], np.cumsum(d)[:-1]]) + _EPISODE_GAP_S * np.arange(m)
    return start, start + d, kinds


def _render_episodes(out: np.ndarray, rng: np.random.Generator, fs: float, start_s, end_s, kinds) -> np.ndarray:
    """Make the episodes unreadable in the finished stream ``out``; return their ``[start, end)`` samples.

    A loop over the few episodes, each vectorised over its samples."""
    n = out.shape[0]
    spans = np.stack([np.round(np.asarray(start_s) * fs), np.round(np.asarray(end_s) * fs)], axis=1)
    spans = np.clip(spans, 0, n).astype(np.int64).reshape(-1, 2)
    f32 = np.float32
    for (a, b), kind in zip(spans.tolist(), np.asarray(kinds).tolist()):
        length = b - a
        if length <= 1:
            continue
        tt = np.arange(length) / fs
        reason = UNREADABLE_REASONS[kind]
        if reason == "noise":
            # white (broadband) noise, ramped in and out, swelling like muscle contractions
            edge = np.clip(np.minimum(tt, tt[-1] - tt) / _EPISODE_RAMP_S, 0.0, 1.0)
            swell = _smooth_noise(rng, int(tt[-1] * _GRID_FS) + 2, 0.7)
            swell = np.interp(tt * _GRID_FS, np.arange(swell.size), swell)
            env = rng.uniform(0.5, 1.2) * (0.5 - 0.5 * np.cos(np.pi * edge)) * np.clip(1.0 + 0.4 * swell, 0.3, None)
            out[a:b] += (env * rng.standard_normal(length)).astype(f32)
        elif reason == "lead_off":
            # a flat line at a rail, or at a level a step away from the signal
            sign = 1.0 if rng.random() < 0.5 else -1.0
            rail = rng.random() < 0.5
            level = sign * RAIL_MV if rail else float(out[a]) + sign * rng.uniform(0.5, 2.0)
            out[a:b] = f32(level)
        else:
            # an offset past a rail, held, then recovering over the last fifth;
            # the amplifier clips at the rails
            sign = 1.0 if rng.random() < 0.5 else -1.0
            peak = RAIL_MV + rng.uniform(0.0, 1.2)
            rise = np.clip(tt / rng.uniform(0.05, 0.2), 0.0, 1.0)
            late = np.clip((tt - 0.8 * tt[-1]) / (0.05 * tt[-1]), 0.0, None)
            offset = (sign * peak) * rise * np.exp(-late)
            np.clip(out[a:b] + offset.astype(f32), -RAIL_MV, RAIL_MV, out=out[a:b])
    return spans


def _rhythm(rng: np.random.Generator, duration_s: float):
    """Normal beat times (s) and the respiratory phase on the coarse grid.

    Returns
    -------
    t_beats : ndarray of float64, sinus beat times in [_WIN_PRE_S, ...) (not yet cut at the end)
    tg : ndarray, coarse grid times
    resp_phase : ndarray, respiratory phase (rad) on ``tg``
    """
    tg = np.arange(0.0, duration_s + 5.0, 1.0 / _GRID_FS)
    # Mean heart rate: circadian drift plus slow random excursions, kept in 60..95 bpm.
    hr_centre = rng.uniform(72.0, 80.0)
    circ = rng.uniform(6.0, 10.0) * np.sin(2 * np.pi * tg / 86400.0 + rng.uniform(0, 2 * np.pi))
    slow = 4.0 * _smooth_noise(rng, tg.size, 600.0) + 2.0 * _smooth_noise(rng, tg.size, 60.0)
    hr_mean = np.clip(hr_centre + circ + slow, 60.0, 95.0)
    # LF (~0.1 Hz, Mayer waves) with a slowly wandering frequency and amplitude.
    f_lf = np.clip(0.1 + 0.01 * _smooth_noise(rng, tg.size, 120.0), 0.07, 0.14)
    ph_lf = 2 * np.pi * np.cumsum(f_lf) / _GRID_FS + rng.uniform(0, 2 * np.pi)
    a_lf = rng.uniform(1.0, 2.5) * (1.0 + 0.3 * _smooth_noise(rng, tg.size, 300.0))
    # Respiration (~0.25 Hz) drives RSA (HF) and, later, amplitude modulation and wander.
    f_resp = np.clip(rng.uniform(0.22, 0.28) + 0.02 * _smooth_noise(rng, tg.size, 60.0), 0.15, 0.40)
    resp_phase = 2 * np.pi * np.cumsum(f_resp) / _GRID_FS + rng.uniform(0, 2 * np.pi)
    a_hf = rng.uniform(1.5, 3.5) * (1.0 + 0.3 * _smooth_noise(rng, tg.size, 300.0))
    hr = hr_mean + a_lf * np.sin(ph_lf) + a_hf * np.sin(resp_phase)
    hr = np.clip(hr, 60.0 / _RR_MAX_S + 0.5, 60.0 / _RR_MIN_S - 0.5)
    # IPFM: a beat wherever the integrated rate crosses an integer.
    beat_phase = np.concatenate([[0.0], np.cumsum(hr[:-1] / 60.0) / _GRID_FS])
    n_beats = int(beat_phase[-1] - 1.0)
    t = np.interp(np.arange(n_beats) + rng.uniform(0.0, 1.0), beat_phase, tg)
    rr = np.diff(t) + rng.normal(0.0, 0.006, max(n_beats - 1, 0))
    rr = np.clip(rr, _RR_MIN_S, _RR_MAX_S)
    t0 = _WIN_PRE_S + 0.02 + rng.uniform(0.0, 0.5)
    t = t0 + np.concatenate([[0.0], np.cumsum(rr)])
    return t, tg, resp_phase


def _morphology(rng: np.random.Generator, rr: np.ndarray, labels: np.ndarray, form: np.ndarray,
                gain: np.ndarray):
    """Per-beat wave parameters, arrays of shape (n_beats, 5): amp (mV), mu, sigma_l, sigma_r (s).

    ``labels``: 1 PVC (its focus in ``form``), 3 APC (a normal beat with a changed P wave), else a
    normal beat."""
    n = rr.shape[0]
    shape = (n, _N_WAVES)
    j = lambda s: 1.0 + s * rng.standard_normal(shape)  # noqa: E731 - relative jitter
    sq = np.sqrt(rr)[:, None]
    # Normal beats: P, Q, R, S, T.
    amp = np.array([0.12, -0.08, 1.00, -0.22, 0.30]) * j(np.array([0.12, 0.15, 0.05, 0.12, 0.10]))
    mu = np.zeros(shape)
    mu[:, 0] = -(0.14 + 0.04 * rr)
    mu[:, 1] = -0.028
    mu[:, 3] = 0.027
    mu[:, 4] = 0.27 * sq[:, 0]
    mu += rng.normal(0.0, 1.0, shape) * np.array([0.004, 0.001, 0.0, 0.001, 0.006])
    sl = np.array([0.025, 0.0085, 0.0105, 0.011, 0.055]) * j(np.array([0.08, 0.05, 0.04, 0.05, 0.08]))
    sr = sl.copy()
    sr[:, 4] = 0.040 * j(0.08)[:, 4]
    sl[:, 4] *= sq[:, 0] / math.sqrt(0.8)

    # APCs: the usual QRS and T; the P wave inverted with a short PR (40 %), peaked and narrow (30 %),
    # or early enough to fall into the previous beat's T wave (30 %).
    a = np.flatnonzero(labels == 3)
    if a.size:
        kind = np.searchsorted([0.4, 0.7], rng.random(a.size), side="right")
        u1, u2 = rng.random(a.size), rng.random(a.size)
        amp[a, 0] = np.where(kind == 0, -(0.06 + 0.06 * u1), np.where(kind == 1, 0.14 + 0.08 * u1, amp[a, 0]))
        mu[a, 0] = -np.where(kind == 0, 0.10 + 0.03 * u2, np.where(kind == 1, 0.15 + 0.04 * u2, 0.19 + 0.03 * u2))
        sl[a, 0] = sr[a, 0] = np.where(kind == 1, 0.014, 0.020)

    k = np.flatnonzero(labels == 1)
    if k.size:
        # Three ectopic foci per record: 0 positive, 1 inverted, 2 wide and biphasic.
        focus = form[k].astype(np.int64)
        focus_gain = rng.uniform(0.9, 1.2, 3)
        pol = np.where(focus == 1, -1.0, 1.0)
        g = focus_gain[focus]
        m = k.size
        jj = lambda s: 1.0 + s * rng.standard_normal(m)  # noqa: E731
        amp[k] = 0.0
        mu[k] = 0.0
        amp[k, 2] = pol * 1.8 * g * jj(0.08)  # wide main deflection
        sl[k, 2] = 0.020 * jj(0.05)
        sr[k, 2] = 0.028 * jj(0.05)
        amp[k, 3] = -pol * 0.35 * g * jj(0.15)  # terminal opposite deflection
        mu[k, 3] = 0.055 + 0.002 * rng.standard_normal(m)
        sl[k, 3] = sr[k, 3] = 0.020 * jj(0.05)
        amp[k, 4] = -pol * 0.50 * g * jj(0.10)  # broad discordant T
        mu[k, 4] = 0.30 * sq[k, 0] + 0.03 + 0.005 * rng.standard_normal(m)
        sl[k, 4] = 0.075 * jj(0.06)
        sr[k, 4] = 0.055 * jj(0.06)
        sl[k, 0] = sr[k, 0] = sl[k, 1] = sr[k, 1] = 0.01  # unused slots (amplitude 0)
        b = k[focus == 2]  # lower, wider, with an initial opposite notch in the Q slot
        amp[b, 2] *= 0.8
        sl[b, 2] *= 1.3
        sr[b, 2] *= 1.25
        amp[b, 1] = -0.6 * focus_gain[2] * (1.0 + 0.1 * rng.standard_normal(b.size))
        mu[b, 1] = -0.045
        sl[b, 1] = sr[b, 1] = 0.014
    amp *= gain[:, None]
    return amp, mu, sl, sr


def _render_beats(out: np.ndarray, fs: float, t: np.ndarray, amp, mu, sl, sr) -> np.ndarray:
    """Add every beat's waveform into ``out``; return each beat's QRS main-deflection sample."""
    w0 = int(math.ceil(_WIN_PRE_S * fs))
    w1 = int(math.ceil(_WIN_POST_S * fs))
    cols = np.arange(-w0, w1 + 1)
    # Each wave is evaluated only over the part of the window where it is not negligible (> ~4
    # sigma from its centre for every beat): P before the QRS, Q/R/S around it, T after it.
    spans = [(-_WIN_PRE_S, 0.0), (-0.12, 0.16), (-0.12, 0.16), (-0.12, 0.16), (-0.08, _WIN_POST_S)]
    spans = [slice(max(0, w0 + int(math.floor(lo * fs))), min(cols.size, w0 + int(math.ceil(hi * fs)) + 1))
             for lo, hi in spans]
    q = int(math.ceil(_QRS_HALF_S * fs))
    qrs = slice(w0 - q, w0 + q + 1)
    r_idx = np.empty(t.shape[0], np.int64)
    f32 = np.float32
    for a in range(0, t.shape[0], _BEAT_CHUNK):
        b = min(a + _BEAT_CHUNK, t.shape[0])
        pos = t[a:b] * fs
        start = np.floor(pos).astype(np.int64)
        frac = (start - pos) / fs  # <= 0: the fiducial lies frac seconds after sample ``start``
        x = (cols[None, :] / fs + frac[:, None]).astype(f32)  # seconds relative to the fiducial
        wave = np.zeros(x.shape, f32)
        for w, span in enumerate(spans):
            d = x[:, span] - mu[a:b, w, None].astype(f32)
            inv = np.where(d < 0, (1.0 / sl[a:b, w, None]).astype(f32), (1.0 / sr[a:b, w, None]).astype(f32))
            d *= inv
            d *= d
            d *= f32(-0.5)
            np.exp(d, out=d)
            d *= amp[a:b, w, None].astype(f32)
            wave[:, span] += d
        r_idx[a:b] = start + (np.argmax(np.abs(wave[:, qrs]), axis=1) - q)
        idx = start[:, None] + cols[None, :]
        lo = int(idx[0, 0])
        hi = int(idx[-1, -1]) + 1
        acc = np.bincount((idx - lo).ravel(), weights=wave.ravel(), minlength=hi - lo)
        out[lo:hi] += acc.astype(f32)
    return r_idx


def _render_artifacts(out: np.ndarray, rng: np.random.Generator, fs: float, centre_s: np.ndarray,
                      half_s: np.ndarray) -> None:
    """Add short bursts (band-limited noise or motion-like transients) centred at ``centre_s``."""
    m = centre_s.shape[0]
    if m == 0:
        return
    n = out.shape[0]
    lmax = int(math.ceil(2 * half_s.max() * fs)) + 1
    start = np.round((centre_s - half_s) * fs).astype(np.int64)
    length = np.round(2 * half_s * fs).astype(np.int64) + 1
    c = np.arange(lmax)
    u = c[None, :] / np.maximum(length - 1, 1)[:, None]  # 0..1 across each burst
    inside = c[None, :] < length[:, None]
    tt = c[None, :] / fs
    env = np.where(inside, np.sin(np.pi * np.clip(u, 0.0, 1.0)) ** 2, 0.0)
    # Band-limited noise: a handful of random sinusoids 1..45 Hz (below 0.4 fs).
    fmax = min(45.0, 0.4 * fs)
    burst = np.zeros((m, lmax))
    for _ in range(8):
        f = rng.uniform(1.0, fmax, m)[:, None]
        burst += rng.uniform(0.3, 1.0, m)[:, None] * np.sin(2 * np.pi * f * tt + rng.uniform(0, 2 * np.pi, m)[:, None])
    burst /= np.maximum(np.abs(burst * env).max(axis=1, keepdims=True), 1e-9)
    # Motion-like transient: an asymmetric bump (fast rise, slower fall) plus some noise.
    peak = rng.uniform(0.2, 0.5, m)[:, None]
    bump = np.where(u < peak, np.sin(0.5 * np.pi * u / peak), np.cos(0.5 * np.pi * (u - peak) / (1 - peak)))
    bump = np.where(inside, bump, 0.0) * np.where(rng.random(m) < 0.5, 1.0, -1.0)[:, None]
    motion = rng.random(m) < 0.4
    shape = np.where(motion[:, None], bump + 0.3 * burst * env, burst * env)
    a_mv = np.where(motion, rng.uniform(0.8, 2.5, m), rng.uniform(0.6, 2.0, m))
    shape *= a_mv[:, None]
    idx = start[:, None] + c[None, :]
    ok = inside & (idx >= 0) & (idx < n)
    np.add.at(out, idx[ok], shape[ok].astype(np.float32))


# ----------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------

def synthesize_ecg(hours: float = 20.0, fs: float = 250.0, seed: int = 0, *,
                   pvc_rate: float = 0.02, artifacts_per_hour: float = 4.0,
                   noise_mv: float = 0.03, wander_mv: float = 0.15,
                   powerline_mv: float = 0.01, apc_rate: float = 0.01, couplet_share: float = 0.03,
                   run_share: float = 0.005, episodes_per_hour: float = 0.25) -> SyntheticECG:
    """Generate a reproducible synthetic single-lead ECG with labelled beats.

    Parameters
    ----------
    hours : float, optional
        Duration in hours (> 0, at least 2 seconds). ``n_samples = round(hours * 3600 * fs)``.
    fs : float, optional
        Sampling rate in Hz (>= 100). All widths are in seconds, so the waveform is the same at
        any rate; beat times, labels and morphology do not depend on ``fs``.
    seed : int, optional
        Seed (non-negative int) of ``np.random.SeedSequence``; same seed, same recording.
    pvc_rate : float, optional
        Probability that a sinus beat starts a PVC event (a single PVC, a couplet or a run), in [0, 1).
    artifacts_per_hour : float, optional
        Mean number (Poisson) of artifact bursts per hour, >= 0; each corrupts one normal beat.
    noise_mv : float, optional
        Standard deviation of the white noise, mV (>= 0).
    wander_mv : float, optional
        Scale of the baseline wander, mV (>= 0); its peaks are about this size.
    powerline_mv : float, optional
        Amplitude of a 50 Hz hum, mV (>= 0; 0 disables it).
    apc_rate : float, optional
        Probability that a sinus beat is an atrial premature contraction, in [0, 1);
        ``pvc_rate + apc_rate`` below 1.
    couplet_share, run_share : float, optional
        Shares of the PVC events that are couplets and runs of 3..8 (non-sustained VT), each in
        [0, 1], their sum at most 1.
    episodes_per_hour : float, optional
        Unreadable episodes (noise, lead-off, clipping) per hour, >= 0 (stochastically rounded).

    Returns
    -------
    SyntheticECG
        ``signal`` (float32, mV), ``fs``, sorted ``r_peaks`` (int64; each beat's QRS main
        deflection, whole window inside the signal), ``labels`` (int8: 0 normal, 1 PVC,
        2 artifact, 3 APC), ``beat_unreadable``, ``run_length``, ``pvc_form``, ``unreadable``
        and ``unreadable_reason`` (the module docstring describes them).

    Raises
    ------
    ValueError
        If an argument is out of range.
    """
    hours = _check_number("hours", hours, 0.0, lo_open=True)
    fs = _check_number("fs", fs, 100.0)
    pvc_rate = _check_number("pvc_rate", pvc_rate, 0.0, 1.0)
    artifacts_per_hour = _check_number("artifacts_per_hour", artifacts_per_hour, 0.0)
    noise_mv = _check_number("noise_mv", noise_mv, 0.0)
    wander_mv = _check_number("wander_mv", wander_mv, 0.0)
    powerline_mv = _check_number("powerline_mv", powerline_mv, 0.0)
    apc_rate = _check_number("apc_rate", apc_rate, 0.0, 1.0)
    if pvc_rate + apc_rate >= 1.0:
        raise ValueError(f"pvc_rate + apc_rate must be below 1, got {pvc_rate!r} + {apc_rate!r}")
    couplet_share = _check_number("couplet_share", couplet_share, 0.0, 1.0, hi_open=False)
    run_share = _check_number("run_share", run_share, 0.0, 1.0, hi_open=False)
    if couplet_share + run_share > 1.0:
        raise ValueError(f"couplet_share + run_share must be at most 1, got {couplet_share!r} + {run_share!r}")
    episodes_per_hour = _check_number("episodes_per_hour", episodes_per_hour, 0.0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    n = int(round(hours * 3600.0 * fs))
    if n / fs < 2.0:
        raise ValueError(f"hours must give at least 2 s of signal, got {hours!r} h")
    if n > 2**31:
        raise ValueError(f"hours * 3600 * fs must stay below 2**31 samples, got {n}")
    duration = n / fs

    s_rhythm, s_labels, s_morph, s_art, s_noise, s_wander, s_episodes = np.random.SeedSequence(int(seed)).spawn(7)
    rng_lab = np.random.default_rng(s_labels)

    # --- rhythm and labels (independent of fs) ---
    # Twice the duration: premature beats shorten the beat sequence, which must still reach the end.
    t, tg, resp_phase = _rhythm(np.random.default_rng(s_rhythm), 2.0 * duration + 10.0)
    rr = np.diff(t, prepend=t[0] - (t[1] - t[0] if t.size > 1 else 0.8))  # sinus RR ending at each beat
    gap, labels, form = _ectopy(rng_lab, t, rr, pvc_rate, couplet_share, run_share, apc_rate)
    t = t[0] + np.cumsum(gap)
    # Keep beats whose whole window lies inside the signal.
    pos = np.floor(t * fs).astype(np.int64)
    keep = (pos - int(math.ceil(_WIN_PRE_S * fs)) >= 0) & (pos + int(math.ceil(_WIN_POST_S * fs)) < n)
    t, rr, labels, form = t[keep], rr[keep], labels[keep], form[keep]
    if t.size == 0:
        raise ValueError(f"hours={hours!r} is too short to hold a beat")

    # Unreadable episodes (seconds; rendered once the stream is finished).
    rng_ep = np.random.default_rng(s_episodes)
    ep_start, ep_end, ep_kind = _episodes(rng_ep, duration, episodes_per_hour)

    # Artifacts: Poisson count over normal beats that have both neighbours, away from the episodes.
    rng_art = np.random.default_rng(s_art)
    n_art = rng_art.poisson(artifacts_per_hour * hours)
    eligible = np.flatnonzero(labels == 0)
    eligible = eligible[(eligible > 0) & (eligible < t.size - 1)]
    if ep_start.size:  # (episodes are sorted and apart: the one starting last before a beat is the one)
        k = np.searchsorted(ep_start - 1.0, t[eligible], side="right") - 1
        eligible = eligible[~((k >= 0) & (t[eligible] < ep_end[np.maximum(k, 0)] + 1.0))]
    n_art = int(min(n_art, eligible.size))
    art = np.sort(rng_art.choice(eligible, n_art, replace=False)) if n_art else np.zeros(0, np.int64)
    labels[art] = 2

    # --- beats ---
    resp_at_beat = np.interp(t, tg, resp_phase)
    rng_m = np.random.default_rng(s_morph)
    gain = rng_m.uniform(0.9, 1.1) * (1.0 + 0.1 * np.sin(resp_at_beat + 0.5))
    gain *= 1.0 + 0.05 * np.interp(t, tg, _smooth_noise(rng_m, tg.size, 1800.0))
    amp, mu, sl, sr = _morphology(rng_m, rr, labels, form, gain)
    signal = np.zeros(n, np.float32)
    r_peaks = _render_beats(signal, fs, t, amp, mu, sl, sr)

    # --- artifact bursts ---
    if n_art:
        shift = rng_art.uniform(-0.05, 0.05, n_art)
        gap = np.minimum(t[art] - t[art - 1], t[art + 1] - t[art])
        half = np.minimum(rng_art.uniform(0.1, 0.3, n_art), gap - 0.08 - np.abs(shift))
        _render_artifacts(signal, rng_art, fs, t[art] + shift, half)

    # --- baseline wander (on the coarse grid, interpolated), hum and white noise ---
    rng_w = np.random.default_rng(s_wander)
    wander = np.zeros_like(tg)
    if wander_mv > 0:
        for (f_lo, f_hi), share in (((0.05, 0.12), 0.5), ((0.12, 0.25), 0.3), ((0.25, 0.5), 0.15)):
            a = wander_mv * share * rng_w.uniform(0.7, 1.3) * (1.0 + 0.4 * _smooth_noise(rng_w, tg.size, 600.0))
            wander += a * np.sin(2 * np.pi * rng_w.uniform(f_lo, f_hi) * tg + rng_w.uniform(0, 2 * np.pi))
        wander += 0.25 * wander_mv * np.sin(resp_phase + rng_w.uniform(0, 2 * np.pi))
        wander += 0.4 * wander_mv * _smooth_noise(rng_w, tg.size, 20.0)
    hum_phase = rng_w.uniform(0.0, 1.0)  # in cycles
    rng_n = np.random.default_rng(s_noise)
    step = 50.0 / fs
    for a in range(0, n, _SAMPLE_CHUNK):
        b = min(a + _SAMPLE_CHUNK, n)
        i = np.arange(a, b, dtype=np.float64)
        chunk = np.interp(i / fs, tg, wander)
        seg = signal[a:b]
        seg += chunk.astype(np.float32)
        if powerline_mv > 0:
            hum = (np.mod(i * step + hum_phase, 1.0) * (2 * np.pi)).astype(np.float32)
            np.sin(hum, out=hum)
            hum *= np.float32(powerline_mv)
            seg += hum
        if noise_mv > 0:
            noise = rng_n.standard_normal(b - a, dtype=np.float32)
            noise *= np.float32(noise_mv)
            seg += noise
    # --- unreadable episodes, over the finished stream ---
    spans = _render_episodes(signal, rng_ep, fs, ep_start, ep_end, ep_kind)
    np.clip(signal, -RAIL_MV, RAIL_MV, out=signal)  # the amplifier's range
    order = np.argsort(r_peaks, kind="stable")  # already sorted; guards against ties
    r_peaks, labels, form = r_peaks[order], labels[order], form[order]
    k = np.searchsorted(spans[:, 0], r_peaks, side="right") - 1
    unreadable = (k >= 0) & (r_peaks < spans[np.maximum(k, 0), 1]) if spans.shape[0] else np.zeros(r_peaks.size, bool)
    return SyntheticECG(signal=signal, fs=fs, r_peaks=r_peaks, labels=labels, beat_unreadable=unreadable,
                        run_length=_run_lengths(labels == 1), pvc_form=form, unreadable=spans,
                        unreadable_reason=np.asarray([UNREADABLE_REASONS[i] for i in ep_kind[: spans.shape[0]]],
                                                     dtype="<U8"))

"""Parameters of segmentation and embedding, in seconds; converted to samples for a sampling rate.
Also the training's split and when its step is compiled (read by the flow's process, which does not
import PyTorch).

The seed's values (lengths 100..256 samples, width 256) are those of a 250 Hz stream; every width
here is given in seconds so that other rates (MIT-BIH: 360 Hz) get the same physical windows.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DEFAULT_FS = 250.0
# the sampling rates beatflow accepts (Hz): below 50 Hz a QRS (80-120 ms) spans too few samples to be
# found; above 20 kHz the windows of one second no longer fit a partition's working set
FS_RANGE = (50.0, 20000.0)


def check_fs(fs: float) -> str | None:
    """Why ``fs`` is no usable sampling rate, or None where it is one (finite, inside :data:`FS_RANGE`)."""
    lo, hi = FS_RANGE
    try:
        ok = math.isfinite(fs) and lo <= fs <= hi
    except TypeError:
        ok = False
    return None if ok else f"sampling rate must be between {lo:g} and {hi:g} Hz, got {fs}"


@dataclass(frozen=True)
class SegmentParams:
    """Beat segmentation and pruning parameters (seconds unless noted); see :mod:`beatflow.detect.peaks`.

    Attributes
    ----------
    wavelet_width_s : float
        σ of the derivative-of-Gaussian slope filter (8 ms: a band-pass around 20 Hz, the QRS band).
    energy_window_s : float
        The QRS energy envelope is the RMS of the slope over this window (about one QRS).
    slope_width_s, slope_window_s : float
        σ of the fine slope filter, and the ``±`` window of its steepest value around a peak
        (the QRS-versus-T-wave measure).
    nms_half_window_s : float
        A position is a candidate if its envelope is the largest within ``±`` this.
    refractory_s : float
        Of two accepted peaks closer than this, the smaller is dropped (the shortest RR interval in
        the MIT-BIH records is 0.25 s, in ventricular tachycardia).
    fast_nms_s, fast_rr_s, fast_rr_window_s, fast_dip : float
        Fast rhythms (``fast_nms_s = 0``: off, the default): where the mean RR of the strong beats found
        within ``±fast_rr_window_s`` is below ``fast_rr_s``, the maxima of the envelope over
        ``±fast_nms_s`` are candidates too, those around which the envelope falls to at most
        ``fast_dip`` × their height on both sides within that window (1: no such test) (in ventricular
        tachycardia the flank of a wide beat hides its smaller neighbour from the ``±nms_half_window_s`` window;
        :func:`beatflow.detect.peaks.fast_candidates`). The GPU runs the array code when it is on.
    threshold_ratio : float
        A candidate above this fraction of the local amplitude is a beat (subject to the T-wave test).
    noise_valley_ratio, noise_slope_ratio, noise_level_ratio : float
        A candidate is dropped as a peak of a noise burst when the envelope stays above
        ``noise_valley_ratio`` × its height within ``±nms_half_window_s`` on both sides, its steepest
        slope exceeds ``noise_slope_ratio`` × its envelope height, and its height is below
        ``noise_level_ratio`` × the local amplitude (:func:`beatflow.detect.peaks.noise_mask`;
        ``noise_slope_ratio=inf`` switches the test off).
    weak_ratio : float
        Candidates between this fraction and ``threshold_ratio`` are only taken by search-back.
    block_s, threshold_blocks : float, int
        Local amplitude: median over ``±threshold_blocks`` blocks of each block's largest envelope.
        Blocks are aligned to the stream, so any partitioning gives the same thresholds.
    twave_window_s, twave_slope_ratio : float
        A beat within this time of the previous beat whose steepest slope is below this fraction of
        that beat's is taken for its T wave and dropped.
    searchback_factor, searchback_margin : float
        Search-back: in a gap longer than ``factor`` × the mean RR, a weak candidate at least
        ``margin`` × RR from both neighbours is a missed beat.
    rr_window_s : float
        The mean RR around a candidate is taken over the beats within ``±`` this.
    max_gap_s : float
        Gaps are measured up to this length (keeps every decision local to a bounded window).
    edge_s : float
        Peaks this close to the ends of the stream are not trusted (a QRS cut by the record's end).
    pre_peak_s : float
        A beat starts this long before its detected peak (so its QRS is inside its row).
    min_length_s, max_length_s : float
        The seed's length bounds (100..256 samples at 250 Hz): a beat's row holds at most
        ``max_length_s``; beats shorter than ``min_length_s`` are pruned.
    cut_long : bool
        Beats longer than ``max_length_s`` are kept with their row cut to that length (default), or
        pruned as in the seed (``False``). A premature beat is followed by a long compensatory
        pause, so pruning long beats drops ~40 % of the ventricular ectopic beats of MIT-BIH.
    vf_window_s, vf_context, vf_min_windows : float, int, int
        Ventricular flutter/fibrillation episodes (:mod:`beatflow.detect.rhythm`): windows of this length,
        aligned to the stream; each is judged on itself and ``±vf_context`` neighbours, and an
        episode is at least ``vf_min_windows`` consecutive such windows. Peaks inside an episode are
        dropped (flutter waves are no beats).
    vf_baseline_ratio, vf_baseline_tol : float
        A window has no isoelectric baseline when fewer than ``vf_baseline_ratio`` of its samples
        (high-passed) lie within ``vf_baseline_tol`` × its 3–97 % range of its median
        (``vf_baseline_ratio=0`` switches the rule off).
    vf_max_freq_hz : float
        ... and its mean frequency (the Hjorth mobility of the high-passed signal, from the QRS-band
        slope) is below this: smooth, sinusoid-like waves rather than sharp QRS complexes or noise.
    vf_highpass_s : float
        The high-pass of these measures: the signal minus its moving mean over this time.
    """

    wavelet_width_s: float = 0.008
    energy_window_s: float = 0.1
    slope_width_s: float = 0.004
    slope_window_s: float = 0.05
    nms_half_window_s: float = 0.23
    refractory_s: float = 0.25
    fast_nms_s: float = 0.0
    fast_rr_s: float = 0.5
    fast_rr_window_s: float = 2.0
    fast_dip: float = 1.0
    threshold_ratio: float = 0.35
    weak_ratio: float = 0.15
    noise_valley_ratio: float = 0.25
    noise_slope_ratio: float = 3.5
    noise_level_ratio: float = 0.8
    block_s: float = 1.0
    threshold_blocks: int = 5
    twave_window_s: float = 0.36
    twave_slope_ratio: float = 0.4
    searchback_factor: float = 1.66
    searchback_margin: float = 0.3
    rr_window_s: float = 5.0
    max_gap_s: float = 3.0
    edge_s: float = 0.05
    pre_peak_s: float = 0.1
    min_length_s: float = 0.4
    max_length_s: float = 1.024
    cut_long: bool = True
    vf_window_s: float = 1.0
    vf_context: int = 2
    vf_min_windows: int = 5
    vf_baseline_ratio: float = 0.35
    vf_baseline_tol: float = 0.1
    vf_max_freq_hz: float = 5.5
    vf_highpass_s: float = 0.6

    def samples(self, fs: float) -> "SegmentSamples":
        """These parameters in samples at rate ``fs``."""
        if not fs > 0:
            raise ValueError(f"sampling rate must be positive, got {fs}")
        r = lambda s: max(1, int(round(s * fs)))  # noqa: E731
        a = max(1.0, self.wavelet_width_s * fs)
        kernel = 2 * int(math.ceil(4 * a)) + 1
        fine_a = max(0.5, self.slope_width_s * fs)
        fine_kernel = 2 * int(math.ceil(4 * fine_a)) + 1
        box = 2 * (r(self.energy_window_s) // 2) + 1
        slope_half = r(self.slope_window_s)
        block = r(self.block_s)
        lower, upper = r(self.min_length_s), r(self.max_length_s)
        width = 8 * int(math.ceil(upper / 8))
        nms = r(self.nms_half_window_s)
        refractory = r(self.refractory_s)
        twave = r(self.twave_window_s)
        rr_window = r(self.rr_window_s)
        max_gap = r(self.max_gap_s)
        edge = int(round(self.edge_s * fs))
        pre = r(self.pre_peak_s)
        # how far a decision about a peak looks (each step adds its radius to the one it builds on)
        point = max(kernel // 2 + box // 2, fine_kernel // 2 + slope_half) + 1  # envelope, slope
        # candidate, its threshold and its noise test (the envelope within ±nms)
        strong = point + max(nms, (self.threshold_blocks + 1) * block)
        accepted = strong + twave + refractory  # T-wave test, then refractory between neighbours
        searched = accepted + max(rr_window, max_gap) + twave  # search-back, then its refractory
        fast_nms = int(round(self.fast_nms_s * fs)) if self.fast_nms_s > 0 else 0
        fast_window = r(self.fast_rr_window_s)
        if fast_nms:  # a fast candidate depends on the beats within ±fast_window of it, then is decided
            searched += fast_window + accepted + fast_nms
        halo = max(accepted, searched) + edge + upper + pre  # + the beats a partition embeds
        # the VF episode rule (beatflow.detect.rhythm): a peak's window, its episode's run of windows on
        # either side, their ±context windows, and the filters' radius around those samples
        vf_window = r(self.vf_window_s)
        vf_highpass = 2 * (r(self.vf_highpass_s) // 2) + 1
        vf_runs = max(1, int(self.vf_min_windows))
        vf_halo = (vf_runs + int(self.vf_context)) * vf_window + max(vf_highpass // 2, kernel // 2) + 2
        if self.vf_baseline_ratio > 0:
            halo = max(halo, vf_halo)
        return SegmentSamples(a=a, kernel=kernel, fine_a=fine_a, fine_kernel=fine_kernel, box=box,
                              slope_half=slope_half, nms=nms, refractory=refractory, ratio=self.threshold_ratio,
                              fast_nms=fast_nms, fast_rr=float(self.fast_rr_s) * fs, fast_window=fast_window,
                              fast_dip=float(self.fast_dip),
                              weak_ratio=self.weak_ratio, block=block, blocks=self.threshold_blocks, twave=twave,
                              twave_slope=self.twave_slope_ratio, searchback=self.searchback_factor,
                              margin=self.searchback_margin, rr_window=rr_window, max_gap=max_gap, edge=edge,
                              pre=pre, lower=lower, upper=upper, width=width, halo=int(halo),
                              cut_long=bool(self.cut_long), noise_valley=float(self.noise_valley_ratio),
                              noise_slope=float(self.noise_slope_ratio), noise_level=float(self.noise_level_ratio),
                              vf_window=vf_window, vf_context=int(self.vf_context), vf_runs=vf_runs,
                              vf_baseline=float(self.vf_baseline_ratio), vf_tol=float(self.vf_baseline_tol),
                              vf_omega=2.0 * math.pi * float(self.vf_max_freq_hz) / fs, vf_highpass=vf_highpass)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SegmentSamples:
    """:class:`SegmentParams` in samples for one sampling rate; ``halo`` is what a partition needs of
    each neighbour so that its beats do not depend on where the stream was cut."""

    a: float
    kernel: int
    fine_a: float
    fine_kernel: int
    box: int
    slope_half: int
    nms: int
    refractory: int
    ratio: float
    weak_ratio: float
    block: int
    blocks: int
    twave: int
    twave_slope: float
    searchback: float
    margin: float
    rr_window: int
    max_gap: int
    edge: int
    pre: int
    lower: int
    upper: int
    width: int
    halo: int
    cut_long: bool = True
    noise_valley: float = 0.25
    noise_slope: float = 3.5
    noise_level: float = 0.8
    vf_window: int = 250  # beatflow.detect.rhythm: window length, context and minimum episode (windows)
    vf_context: int = 2
    vf_runs: int = 5
    vf_baseline: float = 0.0  # below this fraction of near-median samples (0: the rule is off)
    vf_tol: float = 0.1
    vf_omega: float = 2.0 * math.pi * 5.5 / 250.0  # largest mean frequency, radians per sample
    vf_highpass: int = 151  # moving-mean length of the high-pass (odd)
    fast_nms: int = 0  # fast rhythms' narrow NMS half window (0: off), mean RR below which, its window
    fast_rr: float = 125.0
    fast_window: int = 500
    fast_dip: float = 1.0


# ---- signal quality (beatflow.detect.quality) -----------------------------------------------------

@dataclass(frozen=True)
class QualityParams:
    """What makes a stretch of the recording unreadable (:mod:`beatflow.detect.quality`; seconds
    unless noted).

    Attributes
    ----------
    window_s : float
        The signal is judged in windows of this length, aligned to the recording (window ``k`` covers
        its samples ``[k·W, (k+1)·W)``).
    min_windows : int
        An unreadable episode is at least this many consecutive unreadable windows.
    flat_levels : float
        A window is *flat* (lead-off, a flat line) when its range is at most this many of its
        quantisation steps (its smallest nonzero change from one sample to the next; a constant
        window has none and is flat).
    saturated_share : float
        A window is *saturated* (clipped at the converter's rails) when at least this share of its
        samples sit exactly at its largest or at its smallest value.
    noise_kurtosis, noise_hf_share : float
        A window is *noise* when the kurtosis of its high-passed samples is below ``noise_kurtosis``
        (QRS complexes make an ECG's distribution peaked: white noise has 3, uniform noise 1.8) and
        at least ``noise_hf_share`` of their energy lies above ``hf_cutoff_hz`` (an ECG's energy is
        below 40 Hz; a smooth wave, such as ventricular flutter, has none there either).
    highpass_s : float
        The high-pass of those measures: the signal minus its moving mean over this time.
    hf_cutoff_hz : float
        The half-power frequency of the Gaussian low-pass whose residue is the high-frequency part
        (at most ``fs / 6``, so that low sampling rates keep a high band).
    """

    window_s: float = 4.0
    min_windows: int = 1
    flat_levels: float = 8.0
    saturated_share: float = 0.5
    noise_kurtosis: float = 5.0
    noise_hf_share: float = 0.2
    highpass_s: float = 0.6
    hf_cutoff_hz: float = 40.0

    def samples(self, fs: float) -> "QualitySamples":
        """These parameters at sampling rate ``fs``."""
        if not fs > 0:
            raise ValueError(f"sampling rate must be positive, got {fs}")
        window = max(2, int(round(self.window_s * fs)))
        runs = max(1, int(self.min_windows))
        highpass = 2 * (max(1, int(round(self.highpass_s * fs))) // 2) + 1
        cutoff = min(float(self.hf_cutoff_hz), fs / 6.0)
        sigma = math.sqrt(math.log(2.0)) / (2.0 * math.pi * cutoff) * fs  # |H(cutoff)|^2 = 1/2
        # a window's decision reads its own samples and the filters' radius around them; an episode's
        # run reaches (runs - 1) windows to either side
        halo = runs * window + highpass // 2 + int(math.ceil(4.0 * sigma)) + 2
        return QualitySamples(window=window, runs=runs, flat_levels=float(self.flat_levels),
                              saturated=float(self.saturated_share), kurtosis=float(self.noise_kurtosis),
                              hf_share=float(self.noise_hf_share), highpass=highpass, hf_sigma=sigma,
                              halo=int(halo))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QualitySamples:
    """:class:`QualityParams` at one sampling rate (``window``, ``highpass``, ``halo``: samples;
    ``hf_sigma``: the low-pass's σ in samples; ``halo``: what a partition needs of each neighbour
    for its windows' decisions, within :class:`SegmentSamples`'s ``halo``)."""

    window: int
    runs: int
    flat_levels: float
    saturated: float
    kurtosis: float
    hf_share: float
    highpass: int
    hf_sigma: float
    halo: int


# ---- training (beatflow.model.vae) ---------------------------------------------------------------

#: the flow trains on at most this many beats (:func:`beatflow.model.sample.training_sample`: stratified by
#: recording and over time) and scores every beat, so training costs the same for 20 h as for 1000 h; the
#: size was chosen by ``bench/train_sample_study.py`` (``bench/results/training.md``)
TRAIN_BEATS = 20_000

#: fraction of the beat matrix :func:`beatflow.model.train.train_vae` trains on (after a seeded shuffle); the rest
#: is held out
TRAIN_FRACTION = 0.75

#: on the CPU, ``compile="auto"`` compiles the training step from this many rows × epochs on: a
#: compiled epoch is about 2.2x faster (dev, 2 cores, 55 k rows: 1.55 s against 3.4 s), and the
#: compilation (one graph: full batches) costs 5-15 s from Inductor's disk cache (a later run on the
#: machine) or about 30 s the first time; 200 000 row-epochs save about 7 s of eager steps, so the
#: default 20 h run (728 000) gains from its second run on (flow 30-37 s instead of 48 s; 66 s the
#: first time), and small trainings (tests, short recordings) stay eager
CPU_COMPILE_MIN_ROW_EPOCHS = 200_000


def compile_pays(device: str, n_train_rows: int, epochs: int) -> bool:
    """Whether ``compile="auto"`` compiles the training step: always on a GPU (launches are what its
    steps cost), on the CPU for trainings of at least :data:`CPU_COMPILE_MIN_ROW_EPOCHS` rows × epochs."""
    return device == "gpu" or int(n_train_rows) * int(epochs) >= CPU_COMPILE_MIN_ROW_EPOCHS

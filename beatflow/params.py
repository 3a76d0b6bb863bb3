"""Parameters of segmentation and embedding, in seconds; converted to samples for a sampling rate.

The seed's values (lengths 100..256 samples, width 256) are those of a 250 Hz stream; every width
here is given in seconds so that other rates (MIT-BIH: 360 Hz) get the same physical windows.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DEFAULT_FS = 250.0


@dataclass(frozen=True)
class SegmentParams:
    """Beat segmentation and pruning parameters (seconds unless noted).

    Attributes
    ----------
    wavelet_width_s : float
        Ricker (Mexican hat) width ``a``: its central lobe spans ``±a``; 25 ms matches an R wave.
    nms_half_window_s : float
        A position is a local maximum if its |response| is the largest within ``±`` this.
    refractory_s : float
        Of two peaks closer than this, the smaller is dropped (no heart beats twice in 250 ms).
    threshold_ratio : float
        A peak must exceed this fraction of the local amplitude.
    block_s, threshold_blocks : float, int
        Local amplitude: median over ``±threshold_blocks`` blocks of each block's largest |response|.
        Blocks are aligned to the stream, so any partitioning gives the same thresholds.
    pre_peak_s : float
        A beat starts this long before its detected peak (so its QRS is inside its row).
    min_length_s, max_length_s : float
        Kept beats have ``min <= length <= max`` (seed: 100..256 samples at 250 Hz).
    """

    wavelet_width_s: float = 0.025
    nms_half_window_s: float = 0.2
    refractory_s: float = 0.3
    threshold_ratio: float = 0.3
    block_s: float = 1.0
    threshold_blocks: int = 5
    pre_peak_s: float = 0.1
    min_length_s: float = 0.4
    max_length_s: float = 1.024

    def samples(self, fs: float) -> "SegmentSamples":
        """These parameters in samples at rate ``fs``."""
        if not fs > 0:
            raise ValueError(f"sampling rate must be positive, got {fs}")
        r = lambda s: max(1, int(round(s * fs)))  # noqa: E731
        a = max(1.0, self.wavelet_width_s * fs)
        kernel = 2 * int(math.ceil(5 * a)) + 1
        block = r(self.block_s)
        lower, upper = r(self.min_length_s), r(self.max_length_s)
        width = 8 * int(math.ceil(upper / 8))
        nms = r(self.nms_half_window_s)
        refractory = r(self.refractory_s)
        pre = r(self.pre_peak_s)
        halo = (self.threshold_blocks + 2) * block + kernel + 2 * max(nms, refractory) + upper + pre
        return SegmentSamples(a=a, kernel=kernel, nms=nms, refractory=refractory, ratio=self.threshold_ratio,
                              block=block, blocks=self.threshold_blocks, pre=pre, lower=lower, upper=upper,
                              width=width, halo=int(halo))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SegmentSamples:
    """:class:`SegmentParams` in samples for one sampling rate; ``halo`` is what a partition needs of
    each neighbour so that its beats do not depend on where the stream was cut."""

    a: float
    kernel: int
    nms: int
    refractory: int
    ratio: float
    block: int
    blocks: int
    pre: int
    lower: int
    upper: int
    width: int
    halo: int

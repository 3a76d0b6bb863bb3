"""The 20 h stream on the device, and segmentation + embedding as the GPU benchmarks run it.

Shared by ``bench/gpu_segment.py``, ``bench/gpu_launch_probe.py``, ``bench/gpu_embed_probe.py`` and the
Nsight Compute steps of ``bench/gpu_*.sh``; as a script it runs segmentation + embedding twice (for
a profiler). Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kept_bounds(peaks, s, n: int):
    """Start and row length of the kept beats of ``peaks`` (CuPy): ``beats.beats_from_peaks`` and
    ``beats.kept_mask`` in one compaction (one synchronisation)."""
    import cupy

    from beatflow.embed import beats as B
    start, length = peaks[:-1] - s.pre, cupy.diff(peaks)
    kept = cupy.flatnonzero((start >= 0) & (start + length <= n) & B.kept_mask(length, s))
    return start[kept], B.row_lengths(length[kept], s)


def setup(hours: float = 20.0, cache: str | None = None):
    """``(s, x, xg, seg_embed)``: the segmentation parameters at 250 Hz, the synthetic stream (seed 0)
    on the host and on the device, and a function doing detection as the product does it (the
    kernels, with the flutter-episode rule's), then the kept beats' bounds and rows (three kernels),
    all before one synchronisation (``kernels.segment_rows_gpu``), returning ``(rows, p2p)``. ``cache``: a ``.npy`` path where the stream is kept between
    processes."""
    import cupy

    from beatflow.gpu import kernels as K
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(250.0)
    if cache and os.path.exists(cache):
        import numpy as np

        x = np.load(cache)
    else:
        x = synthesize_ecg(hours=hours, fs=250.0, seed=0).signal
        if cache:
            import numpy as np

            np.save(cache, x)
    xg = cupy.asarray(x)
    base = max(1, s.pre // 2)

    def seg_embed():  # the detection and flutter-rule kernels, then the kept beats' bounds and rows
        out = K.segment_rows_gpu(xg, s, baseline_samples=base)  # (3 kernels) before the one synchronisation
        return out[6], out[7]

    return s, x, xg, seg_embed


if __name__ == "__main__":
    import cupy

    _, _, _, run = setup()
    for _ in range(2):
        run()
    cupy.cuda.Device().synchronize()

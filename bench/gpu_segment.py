"""GPU: segmentation + embedding of the 20-hour stream, the detection kernels against the array code.

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python bench/gpu_segment.py       # table on stdout, gpu_segment.json under $OUT (or bench/out)

Data: the pipeline's 20 h synthetic ECG (250 Hz, seed 0, 18 M samples, float32) on the device.
Checks: the peaks of ``kernels.detect_beats_gpu`` (detection and flutter rule as kernels) equal
the CPU path's and the array code's on CuPy (``segment._detect_beats_xp``). Times: ``cupyx.profiler.benchmark`` (CUDA events on the
stream, so host stalls between launches count; median of 20) of each step and of
segmentation + embedding as the flow's embed step does it (detect, beat bounds, kept mask, row
lengths, ``embed_gpu``).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

OUT = os.environ.get("OUT", "bench/out")


def main():
    import cupy
    from cupyx.profiler import benchmark

    from beatflow.embed import beats as B
    from beatflow.gpu import kernels as K
    from beatflow.detect import peaks as S
    os.makedirs(OUT, exist_ok=True)
    res = {"checks": {}, "ms": {}, "errors": {}}

    def save():
        with open(os.path.join(OUT, "gpu_segment.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    def time_it(name, fn, n_repeat=20):
        """GPU time (CUDA events around the call: host stalls between launches count), host time
        of the call, and end to end (the call and a device synchronisation), medians."""
        try:
            r = benchmark(fn, (), n_repeat=n_repeat, n_warmup=3)
            e2e = []
            for _ in range(n_repeat):
                t0 = time.perf_counter()
                fn()
                cupy.cuda.Device().synchronize()
                e2e.append(time.perf_counter() - t0)
            res["ms"][name] = {"gpu_ms": round(float(np.median(r.gpu_times[0])) * 1e3, 3),
                               "host_ms": round(float(np.median(r.cpu_times)) * 1e3, 3),
                               "e2e_ms": round(float(np.median(e2e)) * 1e3, 3)}
            m = res["ms"][name]
            print(f"   {name:58s} {m['gpu_ms']:8.3f} GPU {m['host_ms']:8.3f} host {m['e2e_ms']:8.3f} end-to-end ms",
                  flush=True)
        except Exception:
            res["errors"][name] = traceback.format_exc()[-2000:]
            print(res["errors"][name], flush=True)
        save()

    from gpu_seg_embed import kept_bounds, setup

    s, x, xg, seg_embed = setup()
    res["samples"] = int(x.shape[0])
    t = time.perf_counter()
    peaks_h = S.detect_peaks(x, s)
    res["cpu_detect_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    peaks_k = cupy.asnumpy(K.detect_beats_gpu(xg, s)[0])  # the kernels with the flutter rule's
    res["first_call_s (compiles the kernels)"] = round(time.perf_counter() - t, 3)
    peaks_a = cupy.asnumpy(S._detect_beats_xp(xg, s)[0])  # array code on CuPy, the rule as array code
    c = res["checks"]
    c["peaks_cpu"], c["peaks_kernels"], c["peaks_array_code_gpu"] = len(peaks_h), len(peaks_k), len(peaks_a)
    c["peaks_kernels_without_rule"] = int(K.detect_peaks_gpu(xg, s).shape[0])
    c["kernels_vs_cpu_symmetric_difference"] = int(np.setxor1d(peaks_h, peaks_k).size)
    c["kernels_vs_array_code_symmetric_difference"] = int(np.setxor1d(peaks_a, peaks_k).size)
    env_k = K.qrs_envelope_gpu(xg, s)
    env_h = S.qrs_envelope(x, s)
    c["envelope_max_rel_diff_vs_cpu"] = float(cupy.abs(env_k - cupy.asarray(env_h)).max() / float(env_h.max()))
    print(json.dumps(c, indent=1), flush=True)
    save()

    base = max(1, s.pre // 2)

    rows, _ = seg_embed()
    c["rows"] = int(rows.shape[0])
    _, st0, ln0 = B.beats_from_peaks(S.detect_peaks(x, s), s, x.shape[0])
    k0 = B.kept_mask(ln0, s)
    rows_h, _ = B.embed(x, st0[k0], B.row_lengths(ln0[k0], s), s.width, baseline_samples=base)
    c["seg_embed_rows_equal_cpu"] = bool(rows_h.shape == rows.shape) and float(
        np.abs(cupy.asnumpy(rows) - rows_h).max()) < 1e-4 * (1 + float(np.abs(x).max()))
    print(f"rows of segmentation + embedding on the GPU = the CPU path's: {c['seg_embed_rows_equal_cpu']} "
          f"({rows.shape[0]} rows)", flush=True)
    env = K.qrs_envelope_gpu(xg, s)
    cand = K.local_maxima_gpu(env, s.nms)
    c["candidates"] = int(cand.shape[0])
    peaks = K.detect_peaks_gpu(xg, s)
    _, start, length = B.beats_from_peaks(peaks, s, xg.shape[0])
    kept = B.kept_mask(length, s)
    st, ln = start[kept], B.row_lengths(length[kept], s)
    print("== times (20 h, 18 M samples)", flush=True)
    time_it("dense kernel, envelope written (qrs_envelope_gpu)", lambda: K.qrs_envelope_gpu(xg, s))
    time_it("NMS kernel alone + flatnonzero (local_maxima_gpu)", lambda: K.local_maxima_gpu(env, s.nms))
    time_it("detect_peaks_gpu (whole detection)", lambda: K.detect_peaks_gpu(xg, s))
    from beatflow.detect.rhythm import flutter_keep_mask

    time_it("detect_beats_gpu (whole detection + flutter rule kernels)", lambda: K.detect_beats_gpu(xg, s))
    time_it("flutter rule as CuPy array code (rhythm.flutter_keep_mask, before)",
            lambda: flutter_keep_mask(xg, peaks, 0, s))
    time_it("beat bounds + kept beats + row lengths", lambda: kept_bounds(peaks, s, xg.shape[0]))
    time_it("embed_gpu", lambda: K.embed_gpu(xg, st, ln, s.width, baseline_samples=base))
    time_it("beat_rows (bounds and embedding kernels, one sync)",
            lambda: B.beat_rows(xg, peaks, s, xg.shape[0], baseline_samples=base))
    time_it("segmentation + embedding (segment_rows_gpu: one sync)", seg_embed)
    time_it("segmentation + embedding, detection then beat_rows (two syncs)",
            lambda: B.beat_rows(xg, S.detect_peaks(xg, s), s, xg.shape[0], baseline_samples=base))

    def seg_embed_cupy_bounds():  # session 13's: the bounds as CuPy array code (14 small kernels, a sync)
        p = S.detect_peaks(xg, s)
        st_, ln_ = kept_bounds(p, s, xg.shape[0])
        return K.embed_gpu(xg, st_, ln_, s.width, baseline_samples=base)

    time_it("segmentation + embedding, bounds as CuPy array code (before)", seg_embed_cupy_bounds)
    time_it("array code on CuPy (segment._detect_peaks_xp, before)", lambda: S._detect_peaks_xp(xg, s), n_repeat=5)
    print("== launch shapes of the detection kernels (threads per tile, samples per tile)", flush=True)
    default = (K._DET_TPB, K._DET_TILE)
    shapes = ((256, 1024), (128, 1024), (256, 2048), (512, 2048), (128, 512), (512, 4096))
    for tpb, tile in shapes[:int(os.environ.get("SHAPES", len(shapes)))]:
        K._DET_TPB, K._DET_TILE = tpb, tile
        try:
            same = bool(np.array_equal(cupy.asnumpy(K.detect_peaks_gpu(xg, s)), peaks_h))
            c[f"peaks_equal_tpb{tpb}_tile{tile}"] = same
        except Exception:
            res["errors"][f"tpb{tpb}_tile{tile}"] = traceback.format_exc()[-2000:]
            continue
        time_it(f"detect_peaks_gpu, tpb {tpb}, tile {tile}", lambda: K.detect_peaks_gpu(xg, s))
    K._DET_TPB, K._DET_TILE = default
    save()


if __name__ == "__main__":
    main()

"""GPU: where the wall time of segmentation + embedding goes, launch by launch, and the variants of
how its kernels are queued.

For the 20 h synthetic stream (``common.gpu_stream``) and ``detect.gpu.segment_rows_gpu``:

1. **Wall time** per variant (``VARIANTS``, ";"-separated: "one", every kernel on one stream;
   "streams", the product's default: the flutter rule's kernels on a side stream behind the dense
   kernel's blocks, the candidates' on a high-priority one, ``detect.gpu._STREAMS``; "slow-launch", every
   launch through Numba; "vfall", ``vf_energy`` on a block per tile of windows instead of the default
   4 blocks per SM (``detect.gpu_vf._VF_ENERGY_PER_SM``); "scan256", the one-block scans in 256 threads;
   "graph", ``detect.gpu.SegmentGraph`` over the same buffer: the launches captured once in a CUDA graph
   and replayed; "ws", its kept arrays with the kernels launched one by one, no graph):
   median and spread of ``RUNS`` calls, each timed from the call to its return (the call ends with
   its one synchronisation). Before that, ``CHECKS`` calls of each variant must give the peaks,
   episodes and rows of the first variant's first call, exactly. (On 2026-12-04 the flutter side
   stream started behind the block levels, and a scan by runs of counts per thread with 1024 or 128
   threads, were measured too: all slower, dropped.) A summary table of the variants ends this part.
2. **Timeline** of one call per variant: every launch is followed by a CUDA event on its stream, so
   each kernel's host launch time (from the call's start) sits beside the time its stream finished it on
   the GPU. Where a kernel's launch comes after the previous kernel of its stream ended, the GPU waited
   for the host. (The events cost the host a few µs each: the timeline's total is above the wall time.)
3. **Host profile** (``PROFILE`` calls under ``cProfile``, the functions by their own time): what the
   host does between the launches.

Run on the GPU machine from the repository root: ``python3 bench/gpu_seg_timeline.py`` (``bash bench/gpu.sh
detect``; results: ``bench/results/detection.md``).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RUNS = int(os.environ.get("RUNS", "40"))
VARIANTS = os.environ.get("VARIANTS", "one;streams").split(";")
CHECKS = int(os.environ.get("CHECKS", "10"))
PROFILE = int(os.environ.get("PROFILE", "200"))


def apply(variant: str):
    from beatflow.detect import gpu as K
    from beatflow.detect import gpu_kernels as GK
    from beatflow.detect import gpu_vf as VF
    from beatflow.gpu import runtime as RT
    items = variant.split(",")
    RT.FAST_LAUNCH = "slow-launch" not in items
    K._STREAMS = "one" not in items
    # vf_energy's blocks per SM: 4, the product's default since 2026-12-04 ("vfcap" names it), or one
    # block per tile of windows ("vfall", the default before)
    VF._VF_ENERGY_PER_SM = None if "vfall" in items else 4
    GK.SCAN_TPB = 256 if "scan256" in items else 1024


def _pct(values, q: float) -> float:
    """The ``q``-th percentile of ``values`` (the nearest rank)."""
    import math

    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def timeline(fn):
    """Run ``fn()`` once with an event behind every launch: rows of (kernel, stream, host µs at the
    launch's start, at its end, GPU µs at the kernel's end), all from the call's start."""
    import cupy

    from beatflow.gpu import runtime as RT
    rows, orig = [], RT.Ctx.launch

    def launch(self, kernel, blocks, threads, shared, *args, **kw):
        h0 = time.perf_counter()
        orig(self, kernel, blocks, threads, shared, *args, **kw)
        h1 = time.perf_counter()
        rows.append((getattr(kernel, "__name__", "?"), self.stream_ptr, h0, h1, self.cstream.record()))

    cupy.cuda.Device().synchronize()
    start = cupy.cuda.get_current_stream().record()
    t0 = time.perf_counter()
    RT.Ctx.launch = launch
    try:
        fn()
    finally:
        RT.Ctx.launch = orig
    t_end = time.perf_counter()
    cupy.cuda.Device().synchronize()
    streams = {}
    out = []
    for name, ptr, h0, h1, ev in rows:
        sid = streams.setdefault(ptr, len(streams))
        out.append((name, sid, (h0 - t0) * 1e6, (h1 - t0) * 1e6, cupy.cuda.get_elapsed_time(start, ev) * 1e3))
    return out, (t_end - t0) * 1e6


def main():
    import cupy
    import numpy as np

    from common import gpu_stream, print_header, print_table

    from beatflow.detect import gpu as K
    print_header()
    s, x, xg, _ = gpu_stream(cache="/tmp/beatflow_timeline_x.npy")
    base = max(1, s.pre // 2)

    graphs = {}  # SegmentGraph per variant ("graph": its launches captured in a CUDA graph; "ws": the
    # same kept arrays, launched one by one), made at the variant's first call

    def call(v="streams"):
        items = v.split(",")
        if "graph" in items or "ws" in items:
            g = graphs.get(v)
            if g is None:
                g = graphs[v] = K.SegmentGraph(xg, s, baseline_samples=base, graph="graph" in items)
            return g()
        return K.segment_rows_gpu(xg, s, baseline_samples=base)

    print(f"stream: {x.shape[0]} samples; {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    ref = None
    results, sames = {}, {}
    for v in list(VARIANTS):
        apply(v)
        try:
            for _ in range(2):
                call(v)
        except Exception as e:  # (a variant that fails is reported and left out; the others go on)
            print(f"variant {v}: failed: {type(e).__name__}: {e}")
            VARIANTS.remove(v)
            continue
        same = True
        for _ in range(max(1, CHECKS)):
            host = [cupy.asnumpy(a) for a in call(v)]
            if ref is None:
                ref = host
            same = same and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ref, host))
        walls = []
        for _ in range(RUNS):
            cupy.cuda.Device().synchronize()
            t = time.perf_counter()
            call(v)
            walls.append((time.perf_counter() - t) * 1e3)
        results[v] = walls
        sames[v] = bool(same)
        print(f"variant {v:>16}: {CHECKS} calls, the same result as '{VARIANTS[0]}': {same}; {len(host[0])} peaks, {len(host[1])} episodes, "
              f"{host[6].shape[0]} rows; wall ms median {statistics.median(walls):.3f} "
              f"(min {min(walls):.3f}, max {max(walls):.3f}, {RUNS} calls)")
    # interleaved rounds, so that a drift of the machine hits every variant alike
    inter = {v: [] for v in VARIANTS}
    for _ in range(RUNS // 2):
        for v in VARIANTS:
            apply(v)
            cupy.cuda.Device().synchronize()
            t = time.perf_counter()
            call(v)
            inter[v].append((time.perf_counter() - t) * 1e3)
    summary = {v: {"same": sames[v], "wall_ms": results[v], "interleaved_ms": inter[v]} for v in VARIANTS}
    if os.environ.get("OUT"):  # the figures also as a file (a device call's output keeps only its tail)
        import json

        with open(os.path.join(os.environ["OUT"], "seg_timeline.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print("interleaved:", "; ".join(f"{v} median {statistics.median(w):.3f} ms (min {min(w):.3f})"
                                    for v, w in inter.items()))
    print()
    print_table(["variant", "median ms", "min", "p90", "p99", "max", "calls over 1 ms", "interleaved median",
                 "interleaved min", "same result"],
                [[v, f"{statistics.median(w):.3f}", f"{min(w):.3f}", f"{_pct(w, 90):.3f}", f"{_pct(w, 99):.3f}",
                  f"{max(w):.3f}", f"{sum(t > 1.0 for t in w)} of {len(w)}", f"{statistics.median(inter[v]):.3f}",
                  f"{min(inter[v]):.3f}", sames[v]] for v, w in results.items() if v in inter and inter[v]],
                "lrrrrrrrrl")
    for v in VARIANTS:
        if "graph" in v.split(","):  # (one launch for the whole graph: no timeline by launch)
            continue
        apply(v)
        call(v)
        rows, host_total = timeline(lambda: call(v))
        print(f"\ntimeline, variant {v} (µs from the call's start; host: the launch call's start-end; "
              f"gpu end: when its stream finished the kernel; wait: GPU idle on that stream before it)")
        print(f"{'kernel':<18} {'stream':>6} {'host start':>10} {'host end':>9} {'gpu end':>9} {'gpu Δ':>8}")
        last = {}
        for name, sid, h0, h1, g in rows:
            prev = last.get(sid, 0.0)
            print(f"{name:<18} {sid:>6} {h0:>10.1f} {h1:>9.1f} {g:>9.1f} {g - prev:>8.1f}"
                  + ("  (gpu waited for launch)" if h1 > prev + 2 else ""))
            last[sid] = g
        print(f"host time of the instrumented call: {host_total:.1f} µs; last kernel ended at {max(last.values()):.1f} µs")
    apply("streams")
    if PROFILE:
        import cProfile
        import io
        import pstats

        call()
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(PROFILE):
            call()
        prof.disable()
        wall = (time.perf_counter() - t) / PROFILE * 1e3
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
        print(f"\nhost profile, {PROFILE} calls under cProfile ({wall:.3f} ms a call with the profiler on):")
        print("\n".join(line[:150] for line in buf.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()

"""GPU check of the CUDA path on one machine: correctness, zero copy, timings, one RMM pool.

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python bench/gpu_check.py            # writes gpu_check.json / gpu_check.md under $OUT (or bench/out)

(``bash bench/gpu.sh check``; results: ``bench/results/gpu.md``.)

(a) checks the CUDA kernels (NMS: ``beatflow.detect.gpu``, warp-per-beat embedding: ``beatflow.embed.gpu``)
    and the whole CuPy segmentation against the NumPy implementations on a 20 h synthetic ECG (250 Hz, 18 M samples);
(b) follows one partition's device array CuPy -> Numba (``cuda.as_cuda_array``) -> PyTorch
    (``torch.from_dlpack``) and asserts one device pointer throughout;
(c) times (CUDA events, ``cupyx.profiler.benchmark``) the wavelet response, the NMS kernel against
    ``cupyx`` ``maximum_filter1d``, the block amplitude, ``detect.detect_peaks`` and ``embed_gpu``,
    then trains the VAE 10 epochs (``model.train_vae``, fp32) and a copy of its loop in fp32 and
    under bf16 autocast;
(d) runs CuPy, PyTorch and Numba on one RMM pool and reports the pool's peak use.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

# before Numba is imported: its device memory comes from RMM too
os.environ.setdefault("NUMBA_CUDA_MEMORY_MANAGER", "rmm.allocators.numba")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

from common import Sections, header, machine, markdown_table  # noqa: E402

HOURS, FS = 20, 250.0
POOL_BYTES = 16 << 30
EPOCHS = 10


class Report:
    def __init__(self):
        self.data: dict = {"errors": {}, "section_s": {}, "machine": machine()}
        self.timings: list[dict] = []
        # ``with rep.section(name):`` times a block; one that fails is recorded and the next goes on
        self.section = Sections(self.data["errors"], self.data["section_s"])

    def timing(self, name, gpu_ms, cpu_ms=None, note=""):
        row = {"what": name, "gpu_ms": round(float(gpu_ms), 3),
               "wall_ms": None if cpu_ms is None else round(float(cpu_ms), 3), "note": note}
        self.timings.append(row)
        print(f"   {name}: {row['gpu_ms']} ms (GPU), wall {row['wall_ms']} ms {note}", flush=True)


def bench(rep, name, fn, *args, n_repeat=20, n_warmup=3, note=""):
    """Median GPU time (CUDA events on the current stream) and median wall time of ``fn(*args)``."""
    from cupyx.profiler import benchmark

    r = benchmark(fn, args, n_repeat=n_repeat, n_warmup=n_warmup)
    rep.timing(name, np.median(r.gpu_times[0]) * 1e3, np.median(r.cpu_times) * 1e3, note)
    return r


def main() -> int:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    rep = Report()
    d = rep.data

    # (d) one RMM pool for CuPy, PyTorch and Numba: before any of them allocates
    with rep.section("rmm"):
        import rmm
        import rmm.statistics

        rmm.reinitialize(pool_allocator=True, initial_pool_size=POOL_BYTES)
        pool = rmm.mr.get_current_device_resource()
        rmm.statistics.enable_statistics()  # a StatisticsResourceAdaptor over the pool
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator

        cupy.cuda.set_allocator(rmm_cupy_allocator)
        import torch
        from rmm.allocators.torch import rmm_torch_allocator

        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        from numba import cuda

        d["rmm"] = {"pool": type(pool).__name__, "initial_pool_bytes": POOL_BYTES,
                    "numba_memory_manager": type(cuda.current_context().memory_manager).__name__}

        def used():
            return rmm.statistics.get_statistics().current_bytes

        probes = {}
        b = used(); a = cupy.empty(1 << 20, dtype=cupy.uint8); probes["cupy"] = used() - b  # noqa: E702
        b = used(); t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # noqa: E702
        probes["torch"] = used() - b
        b = used(); nb = cuda.device_array(1 << 20, dtype=np.uint8); probes["numba"] = used() - b  # noqa: E702
        del a, t, nb
        d["rmm"]["bytes_from_pool_for_1MiB"] = probes
        assert all(v >= 1 << 20 for v in probes.values()), probes

    with rep.section("versions"):
        import cupy
        import numba
        import torch

        props = cupy.cuda.runtime.getDeviceProperties(0)
        d["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        d["versions"] = {"numpy": np.__version__, "cupy": cupy.__version__, "torch": torch.__version__,
                         "numba": numba.__version__}
        try:
            from importlib.metadata import version

            d["versions"]["numba-cuda"] = version("numba-cuda")
            d["versions"]["rmm"] = version("rmm-cu13")
        except Exception:
            pass

    import cupy

    import beatflow.detect as D
    import beatflow.embed as E
    from beatflow.detect import gpu as DG, gpu_kernels as GK, peaks as S
    from beatflow.embed import beats as B, gpu as EG
    from beatflow.gpu import runtime as RT
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(FS)
    base = max(1, s.pre // 2)  # as partitions.embed_partition

    with rep.section("data"):
        t0 = time.perf_counter()
        ecg = synthesize_ecg(HOURS, FS)
        x = ecg.signal
        d["data"] = {"hours": HOURS, "fs": FS, "samples": int(x.shape[0]), "true_beats": int(len(ecg.r_peaks)),
                     "synth_s": round(time.perf_counter() - t0, 2)}
        xg = cupy.asarray(x)
        cupy.cuda.Device().synchronize()

    # (a) correctness against NumPy on the same data
    with rep.section("correctness"):
        c = d["correctness"] = {}
        env_g = D.qrs_envelope(xg, s)
        env_h = cupy.asnumpy(env_g)
        env_cpu = D.qrs_envelope(x, s)  # the fused Numba kernel of the CPU path
        c["envelope_max_rel_diff_gpu_vs_cpu_kernel"] = float(np.abs(env_h - env_cpu).max() / env_cpu.max())
        t0 = time.perf_counter()
        nms_h = D.local_maxima(env_h, s.nms)
        c["cpu_local_maxima_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        nms_g = DG.local_maxima_gpu(env_g, s.nms)  # first call compiles
        cupy.cuda.Device().synchronize()
        c["first_call_nms_s (compile)"] = round(time.perf_counter() - t0, 3)
        nms_g2 = DG.local_maxima_gpu(env_g, s.nms, tiled=False)
        c["nms_candidates"] = int(nms_h.shape[0])
        c["nms_tiled_equal"] = bool(np.array_equal(cupy.asnumpy(nms_g), nms_h))
        c["nms_global_equal"] = bool(np.array_equal(cupy.asnumpy(nms_g2), nms_h))

        t0 = time.perf_counter()
        peaks_h = D.detect_peaks(x, s)
        c["cpu_detect_peaks_s"] = round(time.perf_counter() - t0, 3)
        peaks_g = cupy.asnumpy(D.detect_peaks(xg, s))
        c["peaks_cpu"], c["peaks_gpu"] = int(peaks_h.shape[0]), int(peaks_g.shape[0])
        c["peaks_equal"] = bool(np.array_equal(peaks_h, peaks_g))
        c["peaks_symmetric_difference"] = int(np.setxor1d(peaks_h, peaks_g).shape[0])

        _, start, length = B.beats_from_peaks(peaks_h, s, x.shape[0])
        keep = B.prune_mask(length, s.lower, s.upper)
        start, length = start[keep], length[keep]
        t0 = time.perf_counter()
        rows_h, p2p_h = E.embed(x, start, length, s.width, baseline_samples=base)
        c["cpu_embed_s"] = round(time.perf_counter() - t0, 3)
        start_g, length_g = cupy.asarray(start), cupy.asarray(length)
        t0 = time.perf_counter()
        rows_g, p2p_g = EG.embed_gpu(xg, start_g, length_g, s.width, baseline_samples=base)
        cupy.cuda.Device().synchronize()
        c["first_call_embed_s (compile)"] = round(time.perf_counter() - t0, 3)
        c["beats"] = int(start.shape[0])
        c["embed_rows_max_abs_diff"] = float(np.abs(cupy.asnumpy(rows_g) - rows_h).max())
        c["embed_p2p_max_abs_diff"] = float(np.abs(cupy.asnumpy(p2p_g) - p2p_h).max())
        c["embed_signal_max_abs"] = float(np.abs(x).max())
        # the dispatch from beatflow.embed.embed (CuPy input) gives the same
        rows_d, _ = E.embed(xg, start_g, length_g, s.width, baseline_samples=base)
        c["beats_embed_dispatch_equal"] = bool(cupy.array_equal(rows_d, rows_g))

        # rows in beat order for every claim size (the seed's one row per claim included)
        c["embed_claims_equal"] = {str(k): bool(cupy.array_equal(
            EG.embed_gpu(xg, start_g, length_g, s.width, baseline_samples=base, claim=k)[0], rows_g)) for k in (1, 8)}
        assert c["nms_tiled_equal"] and c["nms_global_equal"], "NMS differs from NumPy"
        assert c["embed_rows_max_abs_diff"] < 1e-4 * (1 + c["embed_signal_max_abs"]), "embedding differs"

    # (b) zero copy: one partition CuPy -> Numba -> PyTorch
    with rep.section("zero_copy"):
        import torch
        from numba import cuda

        z = d["zero_copy"] = {}
        a, b = 3_600_000, 7_200_000  # one partition (4 h) of the stream, a view of xg
        part = xg[a:b]
        p0 = part.data.ptr
        nview = cuda.as_cuda_array(part)  # Numba view
        p1 = nview.device_ctypes_pointer.value
        t_part = torch.from_dlpack(part)  # PyTorch view of the CuPy partition
        t_numba = torch.as_tensor(nview, device="cuda")  # PyTorch from the Numba view (CUDA array interface)
        z["cupy_ptr"], z["numba_ptr"] = hex(p0), hex(p1)
        z["torch_from_dlpack_ptr"], z["torch_from_numba_ptr"] = hex(t_part.data_ptr()), hex(t_numba.data_ptr())
        z["partition_is_view_of_stream"] = p0 == xg.data.ptr + a * xg.itemsize
        assert p0 == p1 == t_part.data_ptr() == t_numba.data_ptr(), z
        # the beat matrix the kernel writes for this partition goes to the model the same way
        sel = (start >= a) & (start + length <= b)
        rows_p, _ = EG.embed_gpu(part, cupy.asarray(start[sel]), cupy.asarray(length[sel]), s.width, first=a,
                                baseline_samples=base)
        t_rows = torch.from_dlpack(rows_p)
        z["rows_ptr"], z["torch_rows_ptr"] = hex(rows_p.data.ptr), hex(t_rows.data_ptr())
        assert rows_p.data.ptr == t_rows.data_ptr()
        t_rows[0, 0] += 1.0  # a write through torch is seen by CuPy: one buffer
        torch.cuda.synchronize()
        z["write_through_seen"] = bool(float(rows_p[0, 0].get()) == float(t_rows[0, 0].item()))
        z["ok"] = True

    # (c) timings on the whole 20 h stream
    with rep.section("timings"):
        from cupyx.scipy import ndimage as cnd

        bench(rep, "wavelet response (despike + cupyx convolve1d)", S.wavelet_response, xg, s)
        bench(rep, "QRS envelope (wavelet + moving RMS)", D.qrs_envelope, xg, s)
        env_g = D.qrs_envelope(xg, s)
        cand_g = DG.local_maxima_gpu(env_g, s.nms)
        bench(rep, "steepest slope at the NMS candidates (gathered windows)", D.steepest_at, xg, cand_g, s,
              note=f"{int(cand_g.shape[0])} candidates")
        bench(rep, "NMS kernel, shared tiles (+flatnonzero)", DG.local_maxima_gpu, env_g, s.nms)
        bench(rep, "NMS kernel, global memory (+flatnonzero)", lambda e: DG.local_maxima_gpu(e, s.nms, tiled=False),
              env_g)

        def nms_cupyx(e):
            m = cnd.maximum_filter1d(e, size=2 * s.nms + 1, mode="nearest")
            return cupy.flatnonzero((e == m) & (e > 0))

        bench(rep, "NMS by cupyx maximum_filter1d (+flatnonzero)", nms_cupyx, env_g)
        gate = cupy.empty(env_g.shape[0], cupy.uint8)
        ctx = RT.Ctx(False)
        kern, _ = GK.build()

        def nms_kernel_only():
            ctx.launch(kern["nms_tiled"], -(-env_g.shape[0] // DG._NMS_TPB), DG._NMS_TPB, (DG._NMS_TPB + 2 * s.nms) * 8,
                       ctx.arg(env_g), s.nms, ctx.arg(gate))

        bench(rep, "NMS kernel alone, shared tiles (gate only)", nms_kernel_only)
        bench(rep, "block amplitude", S.block_amplitude, env_g, 0, s)
        bench(rep, "detect.detect_peaks (whole)", D.detect_peaks, xg, s, n_repeat=10)
        for k in (1, EG._EMBED_CLAIM):
            bench(rep, f"embed_gpu (warp per beat, {k} row(s) per claim)",
                  lambda k=k: EG.embed_gpu(xg, start_g, length_g, s.width, baseline_samples=base, claim=k),
                  note=f"{int(start.shape[0])} beats x {s.width}")
        c = d["correctness"]
        rep.timing("CPU: detect.detect_peaks (NumPy/SciPy)", float("nan"), c["cpu_detect_peaks_s"] * 1e3, "1 run")
        rep.timing("CPU: local_maxima (SciPy)", float("nan"), c["cpu_local_maxima_s"] * 1e3, "1 run")
        rep.timing("CPU: embed.embed (NumPy)", float("nan"), c["cpu_embed_s"] * 1e3, "1 run")

    # VAE training on the beat matrix, straight from the device (no copy)
    with rep.section("vae"):
        import torch

        from beatflow.model.train import train_vae
        from beatflow.model.vae import LightVAE, vae_loss

        v = d["vae"] = {}
        beats_t = torch.from_dlpack(rows_g)
        v["rows"] = int(beats_t.shape[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_vae(beats_t[:4096], epochs=1, device="cuda")  # warm-up (CUDA/cuDNN start, first kernels)
        v["warmup_s"] = round(time.perf_counter() - t0, 3)
        res = train_vae(beats_t, epochs=EPOCHS, device="cuda")
        v["train_vae_fp32_s"] = round(res.seconds, 3)
        v["train_vae_fp32_loss"] = res.train_loss
        v["train_vae_fp32_test_loss"] = round(res.test_loss, 5)

        def loop(dtype, epochs=EPOCHS, batch_size=1024, seed=42):
            """train_vae's loop (same split, seeds, batches); ``dtype`` None = fp32, else autocast."""
            n = beats_t.shape[0]
            n_train = int(n * 0.75)
            perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
            torch.manual_seed(seed)
            model = LightVAE(beats_t.shape[1]).cuda()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
            gen = torch.Generator().manual_seed(seed)
            idx = torch.from_numpy(perm[:n_train]).cuda()
            losses = []
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(epochs):
                model.train()
                order = idx[torch.randperm(n_train, generator=gen).cuda()]
                total = torch.zeros((), dtype=torch.float64, device="cuda")
                shuffled = beats_t[order]
                for st in range(0, n_train, batch_size):
                    xb = shuffled[st:st + batch_size]
                    amp = torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()
                    with amp:
                        recon, mu, logvar = model(xb)
                        loss = vae_loss(xb, recon.float(), mu.float(), logvar.float())
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    total += loss.detach()
                losses.append(float(total) / n_train)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, losses

        for name, dt in (("fp32", None), ("bf16_autocast", torch.bfloat16)):
            loop(dt, epochs=1)  # warm-up of this variant's kernels
            secs, losses = loop(dt)
            v[f"loop_{name}_s"] = round(secs, 3)
            v[f"loop_{name}_loss"] = losses
            rep.timing(f"VAE {EPOCHS} epochs, {name} (copy of train_vae's loop)", float("nan"), secs * 1e3,
                       f"{v['rows']} rows, batch 1024")
        rep.timing(f"VAE {EPOCHS} epochs, model.train_vae fp32", float("nan"), res.seconds * 1e3, "incl. test eval")
        v["bf16_vs_fp32_max_abs_loss_diff"] = float(np.max(np.abs(np.subtract(v["loop_fp32_loss"],
                                                                             v["loop_bf16_autocast_loss"]))))
        v["loop_fp32_vs_train_vae_max_abs_loss_diff"] = float(np.max(np.abs(np.subtract(v["loop_fp32_loss"],
                                                                                       res.train_loss))))

    with rep.section("rmm_peak"):
        import rmm.statistics

        st = rmm.statistics.get_statistics()
        d["rmm"]["peak_bytes"] = int(st.peak_bytes)
        d["rmm"]["peak_GiB"] = round(st.peak_bytes / 2**30, 3)
        d["rmm"]["total_allocated_GiB"] = round(st.total_bytes / 2**30, 3)
        d["rmm"]["allocations"] = int(st.total_count)
        d["rmm"]["pool_size_GiB"] = round(pool.pool_size() / 2**30, 3)

    d["timings"] = rep.timings
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(d, f, indent=2, default=str)
    md = [f"# beatflow GPU check ({d.get('device', '?')})", "", header(info=d["machine"]), "",
          f"{HOURS} h synthetic ECG at {FS:g} Hz ({d.get('data', {}).get('samples', '?')} samples)", "",
          markdown_table(["what", "GPU ms (CUDA events, median)", "wall ms (median)", "note"],
                         [(r["what"], "" if r["gpu_ms"] != r["gpu_ms"] else f"{r['gpu_ms']:.3f}",
                           "" if r["wall_ms"] is None else f"{r['wall_ms']:.3f}", r["note"]) for r in rep.timings],
                         "lrrl")]
    md += ["", "## checks", "", "```json", json.dumps({k: d.get(k) for k in ("correctness", "zero_copy", "rmm", "vae",
                                                                             "versions", "section_s")},
                                                      indent=1, default=str), "```"]
    if d["errors"]:
        md += ["", "## errors", ""] + [f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in d["errors"].items()]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    if d["errors"]:
        for k, v in d["errors"].items():
            print(f"--- {k}\n{v}", flush=True)
    return 1 if d["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

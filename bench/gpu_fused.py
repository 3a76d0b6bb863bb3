"""GPU: compiled (fused) VAE training and fused AOTInductor engines against the eager/cuDNN forms.

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python bench/gpu_fused.py            # writes gpu_fused.json / gpu_fused.md under $OUT (or bench/out)

Data: the 20 h synthetic ECG of the pipeline (250 Hz, seed 0), segmented and embedded as the
pipeline does, scaled, minus its dominant beat (the VAE's input, ~72 k rows of 256).

(a) training, 10 epochs, batch 1024, seed 0: eager fp32 (the previous default), eager bf16 autocast,
    compiled fusible step (``train_vae(compile=True)``) in fp32, bf16 and fp16 (gradient scaler); the
    compiled variants run twice, the second time with the compile caches warm (a flow's warm run);
    final test loss of each against fp32 (goal: within 5 %).
(b) engines: AOTInductor of the cuDNN-form scorer (fp32; the previous engine) and the ``compiled``
    backend (the fusible form through ``torch.compile``) in fp32, bf16 and fp16, with and without
    CUDA graphs (``mode="reduce-overhead"``); max abs score error against the eager fp32 scorer on all rows;
    throughput by batch (CUDA events around ``engine.infer``, device input) and batch-1 latency
    p50/p99 over 2000 calls (each timed with CUDA events).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

OUT = os.environ.get("OUT", "bench/out")
RES: dict = {"errors": {}}


def section(name, fn):
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        RES[name] = fn()
    except Exception:
        RES["errors"][name] = traceback.format_exc()[-3000:]
        print(RES["errors"][name], flush=True)
    print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
    with open(os.path.join(OUT, "gpu_fused.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def beats_matrix():
    from beatflow.embed.beats import beats_from_peaks, dominant_beat, embed, prune_mask, residual_rows
    from beatflow.params import SegmentParams
    from beatflow.detect.peaks import detect_peaks
    from beatflow.io.synth import synthesize_ecg

    ecg = synthesize_ecg(hours=20, fs=250.0, seed=0)
    s = SegmentParams().samples(250.0)
    peak, start, length = beats_from_peaks(detect_peaks(ecg.signal, s), s, len(ecg.signal))
    kept = prune_mask(length, s.lower, s.upper)
    rows, p2p = embed(ecg.signal, start[kept], length[kept], s.width, baseline_samples=max(1, s.pre // 2))
    rows = rows / np.float32(np.median(p2p))
    return residual_rows(rows, dominant_beat(rows)).astype(np.float32)


def training(x):
    from beatflow.model.vae import train_vae

    data = torch.from_numpy(x).cuda()
    out = {}
    runs = [("eager fp32", "fp32", False), ("eager bf16", "bf16", False),
            ("compiled fp32 (first)", "fp32", True), ("compiled fp32", "fp32", True),
            ("compiled bf16 (first)", "bf16", True), ("compiled bf16", "bf16", True),
            ("compiled fp16 (first)", "fp16", True), ("compiled fp16", "fp16", True)]
    models = {}
    for name, prec, comp in runs:
        torch.cuda.synchronize()
        r = train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", precision=prec, compile=comp)
        out[name] = {"seconds": round(r.seconds, 3), "test_loss": r.test_loss, "train_loss_last": r.train_loss[-1]}
        models[name] = r.model
        print(f"   {name:24s} {r.seconds:7.2f} s  test loss {r.test_loss:.5f}", flush=True)
    ref = out["eager fp32"]["test_loss"]
    for v in out.values():
        v["test_loss_vs_fp32"] = v["test_loss"] / ref - 1
    out["rows"] = int(x.shape[0])
    return out, models["eager fp32"]


def engines(x, vae):
    from beatflow.engine.aoti import AotInductorEngine
    from beatflow.model.vae import Scorer

    scorer = Scorer(vae).eval()
    xd = torch.from_numpy(x).cuda()
    with torch.no_grad():
        ref_s, ref_m = scorer.cuda()(xd)
    scorer = scorer.cpu()
    out = {}
    tmp = tempfile.mkdtemp()
    from beatflow.engine.compiled import CompiledEngine

    variants = [("compiled fp32", "fp32", False), ("compiled fp16", "fp16", False),
                ("compiled fp32 + CUDA graphs", "fp32", True)]
    if not os.environ.get("GPU_FUSED_QUICK"):
        variants.append(("compiled bf16", "bf16", False))
    if os.environ.get("GPU_FUSED_AOTI"):  # its load crashed the process on the H200 (torch 2.11)
        variants.append(("aoti cudnn-form fp32", "fp32", None))
    for name, prec, graphs in variants:
        print(f"   building {name}", flush=True)
        t = time.perf_counter()
        path = os.path.join(tmp, name.replace(" ", "_").replace("+", ""))
        if graphs is None:
            eng = AotInductorEngine.build(scorer, path + ".pt2", device="cuda", precision=prec)
        else:
            eng = CompiledEngine.build(scorer, path + ".pt", device="cuda", precision=prec, cudagraphs=graphs)
        build_s = time.perf_counter() - t
        s, m = eng.infer(xd)
        torch.cuda.synchronize()
        err = float((s - ref_s).abs().max())
        rel = float(((s - ref_s).abs() / ref_s.abs().clamp_min(1e-6)).max())
        row = {"build_s": round(build_s, 1), "max_abs_err": err, "max_rel_err": rel, "throughput": {}}
        for b in (1, 8, 64, 256, 1024, 4096, 8192):
            xb = xd[:b].contiguous()
            for _ in range(5):
                eng.infer(xb, batch_size=b)
            reps = max(20, min(2000, (1 << 17) // b))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            for _ in range(reps):
                eng.infer(xb, batch_size=b)
            e1.record()
            e1.synchronize()
            row["throughput"][b] = b * reps / (e0.elapsed_time(e1) / 1e3)
        x1 = xd[:1].contiguous()
        lat = []
        for _ in range(2000):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            eng.infer(x1, batch_size=1)
            e1.record()
            e1.synchronize()
            lat.append(e0.elapsed_time(e1) * 1e3)
        raw = []
        if hasattr(eng, "buckets"):  # the compiled callable alone, without infer's chunking/padding
            with torch.no_grad():
                for _ in range(2000):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    eng.model(x1)
                    e1.record()
                    e1.synchronize()
                    raw.append(e0.elapsed_time(e1) * 1e3)
            row["p50_us_batch1_module"] = float(np.percentile(raw, 50))
        row["p50_us_batch1"] = float(np.percentile(lat, 50))
        row["p99_us_batch1"] = float(np.percentile(lat, 99))
        out[name] = row
        print(f"   {name:22s} build {build_s:5.1f} s  err {err:.1e}  b8192 {row['throughput'][8192] / 1e6:6.2f} M/s"
              f"  b1 p50 {row['p50_us_batch1']:.0f} us p99 {row['p99_us_batch1']:.0f} us"
              f" (module alone {row.get('p50_us_batch1_module', float('nan')):.0f} us)", flush=True)
    return out


def markdown() -> str:
    lines = [f"GPU: {RES.get('gpu')}; torch {torch.__version__}", ""]
    tr = RES.get("training", {})
    if isinstance(tr, dict) and tr:
        lines += [f"Training, 10 epochs, batch 1024, {tr.get('rows')} rows:", "",
                  "| variant | seconds | test loss | vs eager fp32 |", "|---|---|---|---|"]
        for k, v in tr.items():
            if isinstance(v, dict):
                lines.append(f"| {k} | {v['seconds']:.2f} | {v['test_loss']:.5f} | {100 * v['test_loss_vs_fp32']:+.1f} % |")
    en = RES.get("engines", {})
    if en:
        bs = [1, 8, 64, 256, 1024, 4096, 8192]
        lines += ["", "| engine | build s | max abs err | p50 b1 µs | p99 b1 µs | " + " | ".join(f"b{b} M/s" for b in bs)
                  + " |", "|---" * (5 + len(bs)) + "|"]
        for k, v in en.items():
            lines.append(f"| {k} | {v['build_s']} | {v['max_abs_err']:.1e} | {v['p50_us_batch1']:.0f} | "
                         f"{v['p99_us_batch1']:.0f} | " + " | ".join(f"{v['throughput'][b] / 1e6:.2f}" for b in bs) + " |")
    return "\n".join(lines) + "\n"


def main():
    os.makedirs(OUT, exist_ok=True)
    RES["gpu"] = torch.cuda.get_device_name(0)
    t = time.perf_counter()
    x = beats_matrix()
    print(f"beat matrix {x.shape} in {time.perf_counter() - t:.1f} s", flush=True)
    holder = {}

    def tr():
        out, vae = training(x)
        holder["vae"] = vae
        return out

    if os.environ.get("GPU_FUSED_SKIP_TRAIN"):
        RES["training"] = "skipped (GPU_FUSED_SKIP_TRAIN)"
    else:
        section("training", tr)
    if "vae" not in holder:
        from beatflow.model.vae import train_vae

        holder["vae"] = train_vae(x, epochs=1, batch_size=1024, seed=0).model
    section("engines", lambda: engines(x, holder["vae"]))
    md = markdown()
    with open(os.path.join(OUT, "gpu_fused.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

"""GPU: what one training step of the flow's VAE costs, kernel by kernel, in a process set up as a
flow GPU worker (RMM async pool for CuPy, Numba and PyTorch, the statistics adaptor and the capture
arena in front: ``backend.setup_gpu_memory`` + ``backend.track_rmm_statistics``).

The beat matrix is the 20 h stream's kept rows (about 97 k x 256, scaled, minus the dominant beat,
as the training task gives them). For each precision in ``PRECISIONS`` (default ``bf16 fp32``),
``train_vae`` runs twice as the flow runs it (compiled step, CUDA graphs through the arena); then
``PROFILE`` steps of the compiled step *without* graphs are profiled with ``torch.profiler`` (the
same kernels the graph holds, launched one by one): per kernel, calls per step and GPU µs per
call, and the sum per step against the wall time per step of the graphed run. Run on the GPU
machine (``PYTHONPATH=$PWD``)::

    python3 bench/gpu_train_kernels.py               # table + kernels, JSON to $OUT/train_kernels_<variant>.json

``VARIANTS="default;coordinate_descent_tuning=1"``: each a fresh process with those settings of
``torch._inductor.config`` (``default``: none), its table and kernels; JSON per variant.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def inductor_settings(spec: str) -> dict:
    """``"a=1,b.c=0,d=x"`` -> ``{"a": True, "b.c": False, "d": "x"}`` (other values stay strings)."""
    out = {}
    for item in filter(None, (spec or "").split(",")):
        k, v = item.split("=")
        out[k] = {"1": True, "0": False}.get(v, v)
    return out


def main():
    import cupy
    import torch
    import torch._inductor.config as ic

    variant = os.environ.get("VARIANT", "default")
    for k, v in inductor_settings("" if variant == "default" else variant).items():
        obj = ic
        *path, last = k.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, v)
    print(f"variant {variant}", flush=True)

    from beatflow import device as backend
    from beatflow.embed import beats as B
    from beatflow.model import vae as M
    backend.setup_gpu_memory(0.5)
    backend.track_rmm_statistics()
    from gpu_seg_embed import setup

    _, _, _, seg_embed = setup()
    rows, p2p = seg_embed()
    rows /= float(cupy.median(p2p))
    rows = B.residual_rows(rows, B.dominant_beat(rows))
    data = torch.from_dlpack(rows)
    n_train = int(data.shape[0] * M.TRAIN_FRACTION)
    steps = -(-n_train // 1024)
    print(f"rows {tuple(data.shape)}, {steps} steps per epoch, graph allocator {M.graph_allocator()}", flush=True)
    out = {"rows": list(data.shape), "steps_per_epoch": steps, "runs": [], "kernels": {}}
    print("| precision | run | graphs | compiled | total s | epoch 1 s | epochs 2-10 s | ms per step | test loss |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for prec in os.environ.get("PRECISIONS", "bf16 fp32").split():
        for run in (1, 2):
            marks = []
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = M.train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", precision=prec,
                              compile=True, cudagraphs=None, on_epoch=lambda e, loss, s: marks.append(s))
            total = time.perf_counter() - t
            per_step = (marks[-1] - marks[0]) / (9 * steps) * 1e3
            out["runs"].append(dict(precision=prec, run=run, graphs=res.cudagraphs, compiled=res.compiled,
                                    total_s=total, epoch1_s=marks[0], epochs_2_10_s=marks[-1] - marks[0],
                                    ms_per_step=per_step, test_loss=res.test_loss))
            print(f"| {prec} | {run} | {res.cudagraphs} | {res.compiled} | {total:.3f} | {marks[0]:.3f} | "
                  f"{marks[-1] - marks[0]:.3f} | {per_step:.3f} | {res.test_loss:.6f} |", flush=True)
        if prec in os.environ.get("PROFILE_PRECISIONS", "bf16").split():
            out["kernels"][prec] = profile_steps(M, data, prec, int(os.environ.get("PROFILE", "20")))
    dest = os.environ.get("OUT")
    if dest:
        tag = "".join(ch if ch.isalnum() else "_" for ch in variant)[:60]
        with open(os.path.join(dest, f"train_kernels_{tag}.json"), "w") as f:
            json.dump(out, f, indent=1)


def profile_steps(M, data, prec: str, n: int) -> list:
    """Kernels of ``n`` compiled training steps launched without graphs (as ``train_vae`` does
    inside its graphs: forward + backward + fused Adam), per step."""
    import torch

    torch.manual_seed(0)
    model = M.LightVAE(data.shape[1]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    amp = M._autocast_dtype(M.training_precision(prec, data.device))
    step_loss = M._step_loss(model, "cuda", amp, True, fused=True)
    xb = data[:1024].contiguous()

    def step():
        loss = step_loss(xb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):  # compile, warm
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ka = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    rows, total = [], 0.0
    for e in ka:
        t = getattr(e, "device_time_total", 0)
        if t <= 0:
            continue
        total += t
        rows.append(dict(kernel=e.key[:90], calls_per_step=e.count / n, us_per_call=t / max(1, e.count),
                         us_per_step=t / n))
    print(f"{prec}: GPU time of the step's kernels {total / n:.1f} us per step ({len(rows)} kinds)")
    for r in rows[:int(os.environ.get("TOP", "10"))]:
        print(f"  {r['kernel'][:80]:80s} {r['calls_per_step']:5.1f}/step {r['us_per_call']:8.2f} us "
              f"{r['us_per_step']:8.2f} us/step")
    return rows


def driver():
    for v in os.environ.get("VARIANTS", "default").split(";"):
        try:
            r = subprocess.run([sys.executable, __file__, "--one"], env={**os.environ, "VARIANT": v},
                               capture_output=True, text=True, timeout=float(os.environ.get("VARIANT_LIMIT", "200")))
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            text = "timed out\n" + (e.stdout or b"").decode(errors="replace")[-3000:]
        lines = [ln for ln in text.splitlines() if "arn" not in ln]
        print(f"== {v}\n" + "\n".join(lines[-int(os.environ.get("LINES", "24")):]), flush=True)


if __name__ == "__main__":
    main() if "--one" in sys.argv else driver()

"""Probe (H200, session 3): AOTInductor package of the fusible scorer, and plain ``torch.compile`` of it.

    python3 bench/gpu_compile_probe.py build /tmp/f.pt2    # export + aoti_compile_and_package the FusedScorer
    python3 bench/gpu_compile_probe.py load /tmp/f.pt2     # load it in a fresh process (crashed: segfault)
    python3 bench/gpu_compile_probe.py jit                 # torch.compile(FusedScorer), fp32 and bf16, b1 and b8192

Random LightVAE weights (seed 0); figures in bench/RESULTS.md.
"""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from beatflow.model.vae import LightVAE, Scorer
from beatflow.model.fused import FusedScorer
mode = sys.argv[1]
torch.manual_seed(0)
vae = LightVAE(256).eval()
if mode == "build":
    from torch._inductor import aoti_compile_and_package
    m = FusedScorer(vae.cuda()).eval()
    b = torch.export.Dim("batch", min=1, max=8192)
    with torch.no_grad():
        ep = torch.export.export(m, (torch.zeros(4, 256, device="cuda"),), dynamic_shapes=({0: b},))
        p = aoti_compile_and_package(ep, package_path=sys.argv[2])
    print("built", p, os.path.getsize(p), flush=True)
elif mode == "load":
    from torch._inductor import aoti_load_package
    x = torch.randn(8192, 256, device="cuda")
    t = time.time(); mdl = aoti_load_package(sys.argv[2], device_index=0); print("loaded", time.time()-t, flush=True)
    s, mu = mdl(x); torch.cuda.synchronize(); print("ran", s.shape, flush=True)
elif mode == "jit":
    x = torch.randn(8192, 256, device="cuda")
    ref = Scorer(vae.cuda()).eval()
    for dt in (torch.float32, torch.bfloat16):
        m = FusedScorer(vae.cuda(), dt).eval()
        c = torch.compile(m, dynamic=False)
        t = time.time()
        with torch.no_grad():
            for bsz in (1, 8192):
                c(x[:bsz])
        print("compiled", dt, time.time()-t, flush=True)
        with torch.no_grad():
            err = (c(x)[0] - ref(x)[0]).abs().max().item()
            for bsz in (1, 8192):
                xb = x[:bsz].contiguous()
                for _ in range(10): c(xb)
                torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                reps = 200; e0.record()
                for _ in range(reps): c(xb)
                e1.record(); e1.synchronize(); ms = e0.elapsed_time(e1)/reps
                print(f"  {dt} b{bsz}: {ms*1e3:.1f} us/call, {bsz/ms*1e3/1e6:.2f} M beats/s, err {err:.1e}", flush=True)

"""GPU: can the *compiled* training step be captured in a CUDA graph when PyTorch allocates from
RMM's async pool (as in the flow's GPU workers)? Session 7 saw ``CUDA driver error: invalid argument``.
Variants, each in a fresh process (allocator and compile caches are per process), 10 epochs of
97 102 x 256 in bf16, twice:

- ``uncompiled``: the eager model (``compile=False``) captured under the async pool without the
  arena (session 9: an illegal memory access at the first replay);
- ``async``: the compiled step captured, allocations inside the capture from the async pool (the
  traceback shows where it fails; the step then falls back to the fusible form uncompiled, as in the
  flow's workers until session 8);
- ``arena``: the compiled step captured with :mod:`beatflow.gpu.arena` in front of the pool;
- ``nostatic``: as ``async`` with Triton's own launcher instead of Inductor's static one;
- ``eager``: the eager model (``compile=False``: cuDNN convolutions) captured with the arena (without
  it, session 9 saw an illegal memory access at the first replay).

    python3 bench/gpu_capture_probe.py            # VARIANTS="uncompiled async arena" by default
    VARIANT=arena python3 bench/gpu_capture_probe.py --one
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one():
    import cupy
    import rmm
    import torch
    from rmm.allocators.cupy import rmm_cupy_allocator
    from rmm.allocators.torch import rmm_torch_allocator

    rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource(initial_pool_size=4 << 30))
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    variant = os.environ.get("VARIANT", "async")
    import torch._inductor.config as ic

    from beatflow.gpu import arena as capture_arena
    from beatflow.model import vae as M
    if variant == "nostatic":
        ic.use_static_cuda_launcher = False
    if variant in ("arena", "eager"):
        capture_arena.install()
    else:
        M.training_compiled = lambda compile, graphs: bool(compile)  # force: compile even when capturing
    compile = variant not in ("uncompiled", "eager")
    orig = M._GraphedSteps._capture

    def capture(self, *a, **k):
        try:
            return orig(self, *a, **k)
        except Exception:
            traceback.print_exc(limit=-10)
            raise

    M._GraphedSteps._capture = capture
    data = torch.from_dlpack(cupy.random.standard_normal((97102, 256), dtype=cupy.float32) * 0.1)
    for run in (1, 2):
        t = time.perf_counter()
        r = M.train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", precision="bf16", compile=compile,
                        cudagraphs=True)
        torch.cuda.synchronize()
        print(f"variant {variant} run {run}: {time.perf_counter() - t:.2f} s (train_vae {r.seconds:.2f} s), graphs "
              f"{r.cudagraphs}, compiled {r.compiled}, test loss {r.test_loss:.6f}, train loss {r.train_loss[-1]:.6f}, "
              f"RMM resource {type(rmm.mr.get_current_device_resource()).__name__}", flush=True)


def main():
    for v in os.environ.get("VARIANTS", "uncompiled async arena").split():
        env = {**os.environ, "VARIANT": v}
        try:
            out = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True,
                                 timeout=float(os.environ.get("LIMIT", "110")))
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            text = f"timed out\n{(e.stdout or b'').decode()[-3000:]}"
        lines = [ln for ln in text.splitlines() if "Warning" not in ln and "warn" not in ln]
        print(f"== {v}\n" + "\n".join(lines[-30:]), flush=True)


if __name__ == "__main__":
    one() if "--one" in sys.argv else main()

"""GPU: where the flow's VAE training time goes, in a process set up as a flow worker.

PyTorch allocates from RMM over CUDA's async pool (as the flow's GPU workers); the beat matrix is
the 20 h stream's kept rows (about 97 k x 256, scaled, minus the dominant beat, as the training task
gives them). ``train_vae`` runs twice per setting (the second as on a standing worker: the inductor
cache is warm, a new closure still recompiles) for bf16 and fp32, compiled, CUDA graphs where they
can be captured; per run: total seconds, the first epoch (compilation, capture) and the other nine,
the test loss. Run on the GPU machine (``PYTHONPATH=$PWD``)::

    python3 bench/gpu_train_probe.py                # as a flow worker (RMM async pool)
    ALLOC=native python3 bench/gpu_train_probe.py   # PyTorch's and CuPy's own allocators, to compare

The last run (fp32, second) is also profiled (``torch.profiler``): the GPU time per kernel.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import cupy
    import rmm
    import torch
    from rmm.allocators.cupy import rmm_cupy_allocator
    from rmm.allocators.torch import rmm_torch_allocator

    native = os.environ.get("ALLOC") == "native"
    if not native:
        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource(initial_pool_size=8 << 30))
        cupy.cuda.set_allocator(rmm_cupy_allocator)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    from gpu_seg_embed import setup

    from beatflow.embed import beats as B
    from beatflow.model import vae as M
    _, _, _, seg_embed = setup()
    rows, p2p = seg_embed()
    rows /= float(cupy.median(p2p))
    rows = B.residual_rows(rows, B.dominant_beat(rows))
    data = torch.from_dlpack(rows)
    print(f"rows {tuple(data.shape)}, allocator {torch.cuda.memory.get_allocator_backend()}, "
          f"graph allocator {M.graph_allocator()}")
    print("| precision | compile | run | graphs | total s | epoch 1 s | epochs 2-10 s | test loss |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    settings = (("fp32", True),) if native else (("bf16", True), ("fp32", True))
    for prec, comp in settings:
        for run in (1, 2):
            marks = []
            last = (prec, run) == (settings[-1][0], 2)
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if last else None
            torch.cuda.synchronize()
            t = time.perf_counter()
            if prof is not None:
                prof.__enter__()
            res = M.train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", precision=prec,
                              compile=comp, cudagraphs=None, on_epoch=lambda e, loss, s: marks.append(s))
            total = time.perf_counter() - t
            if prof is not None:
                prof.__exit__(None, None, None)
            print(f"| {prec} | {comp} | {run} | {res.cudagraphs} | {total:.3f} | {marks[0]:.3f} | "
                  f"{marks[-1] - marks[0]:.3f} | {res.test_loss:.6f} |", flush=True)
            if prof is not None:
                ka = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
                print("kernel (profiled run), calls, GPU ms total")
                for e in ka[:12]:
                    print(f"  {e.key[:70]:70s} {e.count:6d} {getattr(e, 'device_time_total', 0) / 1e3:9.2f}")


if __name__ == "__main__":
    main()

"""GPU: can training steps be captured in CUDA graphs when PyTorch allocates from RMM?

With RMM's pool resource as PyTorch's allocator, capture fails (session 4). Here RMM's
``CudaAsyncMemoryResource`` (CUDA's stream-ordered pool, ``cudaMallocAsync``, which graph capture
supports) is the resource that CuPy and PyTorch share, as ``LocalCUDACluster(rmm_async=True)`` sets
it up; ``train_vae`` runs launched and with graphs, compiled, on 97 k random rows.

    python3 bench/gpu_rmm_async_probe.py      # JSON lines on stdout
"""
import json
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

    mode = sys.argv[1] if len(sys.argv) > 1 else "async"
    if mode == "async":
        mr = rmm.mr.CudaAsyncMemoryResource(initial_pool_size=8 << 30)
    else:
        mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=8 << 30)
    rmm.mr.set_current_device_resource(rmm.mr.StatisticsResourceAdaptor(mr))
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    from beatflow.model import vae as M
    out0 = {"graph_allocator": M.graph_allocator()}
    M.graph_allocator = lambda: True  # let train_vae try capture under either resource
    rows = cupy.random.standard_normal((97_000, 256), dtype=cupy.float32) * 0.05
    data = torch.from_dlpack(rows)
    out = {"mode": mode, "allocator": torch.cuda.memory.get_allocator_backend(), **out0}
    for name, graphs in (("compiled launched", False), ("compiled graphs", True), ("compiled graphs again", True)):
        t = time.perf_counter()
        try:
            import warnings

            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                r = M.train_vae(data, epochs=10, batch_size=1024, device="cuda", compile=True, cudagraphs=graphs)
            out[name] = {"s": round(time.perf_counter() - t, 3), "test_loss": r.test_loss,
                         "warnings": [str(x.message)[:300] for x in w if "graph" in str(x.message).lower()]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps({name: out[name]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""GPU: the compiled engine's CUDA graphs when PyTorch allocates from RMM over the async pool.

    python3 bench/gpu_engine_async_probe.py     # JSON on stdout
"""
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import rmm
    import torch
    from rmm.allocators.torch import rmm_torch_allocator

    rmm.mr.set_current_device_resource(rmm.mr.StatisticsResourceAdaptor(
        rmm.mr.CudaAsyncMemoryResource(initial_pool_size=4 << 30)))
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    from beatflow.model import vae as M
    from beatflow.engine.compiled import CompiledEngine

    mr = rmm.mr.get_current_device_resource()
    out = {"backend": torch.cuda.memory.get_allocator_backend(), "graph_allocator": M.graph_allocator(),
           "mr": type(mr).__name__, "mr_attrs": [a for a in dir(mr) if "upstream" in a]}
    vae = M.LightVAE(256)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = CompiledEngine.build(M.Scorer(vae), "/tmp/e.pt", batch_profile=(1, 1024, 8192))
        x = torch.zeros(1, 256, device="cuda")
        for _ in range(20):
            eng.infer(x, batch_size=1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            eng.infer(x, batch_size=1)
        torch.cuda.synchronize()
        out["batch1_us"] = round((time.perf_counter() - t) / 200 * 1e6, 1)
    out["cudagraphs"] = eng.cudagraphs
    out["graphs"] = {str(k): (v if isinstance(v, str) else "graph") for k, v in eng.model.graphs.items()} \
        if hasattr(eng.model, "graphs") else None
    out["warnings"] = [str(x.message)[:400] for x in w if "graph" in str(x.message).lower()]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

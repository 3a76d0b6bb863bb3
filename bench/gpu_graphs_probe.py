"""GPU probe: CUDA graphs for the engine's batch-1 latency and for whole training steps, with
PyTorch's own allocator and with the graph's memory drawn from an RMM pool (``torch.cuda.MemPool``
over RMM's pluggable allocator).

Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python bench/gpu_graphs_probe.py            # all modes, each in its own process

Modes (the CUDA allocator is per process):

* ``native``: PyTorch's caching allocator;
* ``mempool``: an RMM pool; PyTorch keeps its caching allocator, and graphs are captured into a
  ``torch.cuda.MemPool`` whose segments come from RMM;
* ``rmm``: the Dask worker's set-up today (RMM as PyTorch's allocator): capture is expected to fail;
  a profile of the compiled (un-graphed) training step says where its time goes.

Figures go to ``$OUT/graphs_<mode>.json`` and stdout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.environ.get("OUT", "bench/out")
RES: dict = {"errors": {}}


def save(mode):
    with open(os.path.join(OUT, f"graphs_{mode}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def section(mode, name, fn):
    print(f"== [{mode}] {name}", flush=True)
    t = time.perf_counter()
    try:
        RES[name] = fn()
        print(f"   {RES[name]}", flush=True)
    except Exception:
        RES["errors"][name] = traceback.format_exc()[-2500:]
        print(RES["errors"][name], flush=True)
    print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
    save(mode)


def setup(mode):
    import torch

    pool = None
    if mode in ("mempool", "rmm"):
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.reinitialize(pool_allocator=True, initial_pool_size=8 << 30)
        rmm.mr.set_current_device_resource(rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource()))
        if mode == "rmm":
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        else:
            pool = torch.cuda.MemPool(rmm_torch_allocator.allocator())
    torch.zeros(1, device="cuda")
    return pool


def rmm_bytes():
    try:
        import rmm

        mr = rmm.mr.get_current_device_resource()
        st = mr.allocation_counts
        return {"current": int(st["current_bytes"]), "peak": int(st["peak_bytes"])}
    except Exception as e:
        return str(e)


def data(n=97_000, width=256, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, width)
    base = torch.exp(-((t - 0.3) ** 2) / 0.002) - 0.3 * torch.exp(-((t - 0.6) ** 2) / 0.01)
    x = base[None] * (1 + 0.2 * torch.randn(n, 1, generator=g)) + 0.05 * torch.randn(n, width, generator=g)
    return (x - base[None]).float().cuda()


def latency(fn, x1, calls=3000):
    import torch

    for _ in range(50):
        fn(x1)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    walls = []
    for a, b in ev:
        w = time.perf_counter()
        a.record()
        fn(x1)
        b.record()
        b.synchronize()
        walls.append(time.perf_counter() - w)
    import numpy as np

    dev = np.array([a.elapsed_time(b) for a, b in ev]) * 1e3
    walls = np.array(walls) * 1e6
    return {"p50_us": round(float(np.percentile(dev, 50)), 1), "p99_us": round(float(np.percentile(dev, 99)), 1),
            "wall_p50_us": round(float(np.percentile(walls, 50)), 1),
            "wall_p99_us": round(float(np.percentile(walls, 99)), 1)}


def engine_graph(pool, precision="fp32"):
    """Batch-1 latency: compiled fused scorer without and with a manually captured CUDA graph."""
    import torch

    from beatflow.engine.base import _TORCH_DTYPES
    from beatflow.model.fused import FusedScorer
    from beatflow.model.vae import LightVAE

    torch.manual_seed(0)
    vae = LightVAE(256).cuda().eval()
    mod = FusedScorer(vae, _TORCH_DTYPES[precision]).eval()
    comp = torch.compile(mod, dynamic=False)
    x1 = torch.randn(1, 256, device="cuda")
    out = {}
    with torch.no_grad():
        ref = mod(x1)
        out["eager_module"] = latency(lambda x: mod(x), x1, 1000)
        out["compiled"] = latency(lambda x: comp(x), x1)
        static = torch.zeros(1, 256, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                comp(static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        before = rmm_bytes()
        with torch.cuda.graph(g, pool=pool.id if pool is not None else None):
            so, mo = comp(static)
        out["rmm_during_capture"] = {"before": before, "after": rmm_bytes()}

        def run(x):
            static.copy_(x)
            g.replay()
            return so.clone(), mo.clone()

        got = run(x1)
        torch.cuda.synchronize()
        out["graph_max_abs_err"] = float(max((got[0] - ref[0]).abs().max(), (got[1] - ref[1]).abs().max()))
        out["graph"] = latency(run, x1)

        def run_noclone(x):
            static.copy_(x)
            g.replay()
            return so, mo
        out["graph_noclone"] = latency(run_noclone, x1)
        # batch 8192 throughput in a graph
        x8 = torch.randn(8192, 256, device="cuda")
        st8 = torch.zeros_like(x8)
        with torch.cuda.stream(s):
            for _ in range(3):
                comp(st8)
        torch.cuda.current_stream().wait_stream(s)
        g8 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g8, pool=pool.id if pool is not None else None):
            s8, m8 = comp(st8)
        for _ in range(10):
            st8.copy_(x8)
            g8.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200):
            st8.copy_(x8)
            g8.replay()
        b.record()
        b.synchronize()
        out["graph_8192_beats_per_s"] = round(8192 * 200 / (a.elapsed_time(b) / 1e3))
    return out


def engine_infer(precision="fp32"):
    """CompiledEngine.infer at batch 1 (the engine's whole call path), with and without CUDA graphs."""
    import tempfile

    import torch

    from beatflow.engine.compiled import CompiledEngine
    from beatflow.model.vae import LightVAE, Scorer

    torch.manual_seed(0)
    scorer = Scorer(LightVAE(256)).eval()
    x = torch.randn(300, 256, device="cuda")
    out = {}
    ref = None
    for graphs in (False, True):
        eng = CompiledEngine.build(scorer, os.path.join(tempfile.mkdtemp(), "e.pt"), precision=precision,
                                   batch_profile=(1, 256, 8192), cudagraphs=graphs)
        s, _ = eng.infer(x, batch_size=256)
        ref = s if ref is None else ref
        key = "graphs" if graphs else "no_graphs"
        out[key] = latency(lambda v: eng.infer(v, batch_size=1), x[:1])
        out[key]["max_abs_diff_vs_no_graphs"] = float((s - ref).abs().max())
        big = torch.randn(8192 * 8, 256, device="cuda")
        eng.infer(big)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            eng.infer(big)
        b.record()
        b.synchronize()
        out[key]["beats_per_s_8192"] = round(5 * big.shape[0] / (a.elapsed_time(b) / 1e3))
    return out


def train_graph(pool, precision="fp32", epochs=10, batch=1024):
    """10 epochs: the compiled step as in train_vae, then the whole step (forward, backward, fused
    Adam) captured in one CUDA graph; loss trajectories compared."""
    import torch

    from beatflow.model.fused import fused_forward
    from beatflow.model.vae import LATENT_DIM, LightVAE, vae_loss

    x = data()
    n = x.shape[0]
    n_train = int(n * 0.75)
    out = {"rows": n, "train_rows": n_train}
    amp = {"fp32": None, "bf16": torch.bfloat16}[precision]

    def loss_fn(model):
        def f(xb, eps):
            if amp is None:
                r, mu, lv = fused_forward(model, xb, eps)
            else:
                with torch.autocast("cuda", dtype=amp, cache_enabled=False):
                    r, mu, lv = fused_forward(model, xb, eps)
            return vae_loss(xb, r.float(), mu.float(), lv.float())
        return torch.compile(f, dynamic=False)

    def batches(gen):
        order = torch.randperm(n_train, generator=gen).cuda()
        sh = x[:n_train][order]
        return [sh[i:i + batch] for i in range(0, n_train, batch)]

    # (a) compiled, no graph (train_vae's loop)
    for label in ("compiled_first", "compiled"):
        torch.manual_seed(0)
        model = LightVAE(256).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        f = loss_fn(model)
        gen = torch.Generator().manual_seed(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses = []
        for _ in range(epochs):
            tot = torch.zeros((), device="cuda", dtype=torch.float64)
            for xb in batches(gen):
                eps = torch.randn(xb.shape[0], LATENT_DIM, device="cuda")
                loss = f(xb, eps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += loss.detach()
            losses.append(float(tot) / n_train)
        out[label] = {"seconds": round(time.perf_counter() - t, 3), "loss_last": losses[-1], "loss_first": losses[0]}
        print(f"   {label}: {out[label]}", flush=True)

    # (b) one graph per step shape
    torch.manual_seed(0)
    model = LightVAE(256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
    f = loss_fn(model)
    t = time.perf_counter()
    full, last = batch, n_train % batch
    shapes = [full] + ([last] if last else [])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    graphs = {}
    for b in shapes:
        sx = torch.zeros(b, 256, device="cuda")

        def step(sx=sx):
            eps = torch.randn(sx.shape[0], LATENT_DIM, device="cuda")
            loss = f(sx, eps)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id if pool is not None else None):
            sl = step()
        graphs[b] = (g, sx, sl)
    # undo the warm-up steps: weights back to the initial ones, Adam state zeroed
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(state[k])
        for st in opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    v.zero_()
    torch.cuda.synchronize()
    out["graph_setup_s"] = round(time.perf_counter() - t, 3)
    out["rmm_after_capture"] = rmm_bytes()
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    losses = []
    a, bev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(epochs):
        tot = torch.zeros((), device="cuda", dtype=torch.float64)
        for xb in batches(gen):
            g, sx, sl = graphs[xb.shape[0]]
            sx.copy_(xb)
            g.replay()
            tot += sl
        losses.append(float(tot) / n_train)
    bev.record()
    bev.synchronize()
    out["graph"] = {"seconds": round(time.perf_counter() - t, 3), "gpu_s": round(a.elapsed_time(bev) / 1e3, 3),
                    "loss_last": losses[-1], "loss_first": losses[0]}
    out["graph_vs_compiled_loss_last"] = losses[-1] / out["compiled"]["loss_last"] - 1
    print(f"   graph: {out['graph']}", flush=True)
    return out


def profile_step(pool):
    """torch.profiler over 50 compiled training steps (no graph): CPU and CUDA time per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from beatflow.model.fused import fused_forward
    from beatflow.model.vae import LATENT_DIM, LightVAE, vae_loss

    x = data(20_000)
    torch.manual_seed(0)
    model = LightVAE(256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    f = torch.compile(lambda xb, eps: vae_loss(xb, *fused_forward(model, xb, eps)), dynamic=False)

    def step(xb):
        eps = torch.randn(xb.shape[0], LATENT_DIM, device="cuda")
        loss = f(xb, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for i in range(5):
        step(x[:1024])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(50):
        step(x[(i % 19) * 1024:(i % 19 + 1) * 1024])
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 50
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(20):
            step(x[(i % 19) * 1024:(i % 19 + 1) * 1024])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(OUT, "train_step_profile.txt"), "w") as fh:
        fh.write(table)
    print(table[:6000], flush=True)
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"wall_ms_per_step": round(wall * 1e3, 3), "cuda_kernels_per_step": len(kern) / 20,
            "cuda_ms_per_step": round(sum(e.device_time for e in kern) / 20 / 1e3, 3)}


def child(mode):
    import torch

    RES["mode"] = mode
    RES["torch"] = torch.__version__
    pool = setup(mode)
    RES["allocator"] = torch.cuda.memory.get_allocator_backend()
    if mode == "rmm":
        def capture():
            g = torch.cuda.CUDAGraph()
            x = torch.zeros(4, device="cuda")
            with torch.cuda.graph(g):
                y = x * 2
            return "captured"
        section(mode, "capture_under_rmm_allocator", capture)
        section(mode, "profile_train_step", lambda: profile_step(None))
        return
    if mode == "native":
        section(mode, "engine_infer_fp32", lambda: engine_infer("fp32"))
        section(mode, "engine_infer_fp16", lambda: engine_infer("fp16"))
    section(mode, "engine_graph_fp32", lambda: engine_graph(pool, "fp32"))
    section(mode, "engine_graph_fp16", lambda: engine_graph(pool, "fp16"))
    section(mode, "train_graph_fp32", lambda: train_graph(pool, "fp32"))
    if mode == "native":
        section(mode, "train_graph_bf16", lambda: train_graph(pool, "bf16"))


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    limit = int(os.environ.get("PROBE_LIMIT", "200"))
    for mode in os.environ.get("PROBE_MODES", "native mempool rmm").split():
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, mode], timeout=limit)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== mode {mode}: rc={rc} ({time.perf_counter() - t:.1f} s)", flush=True)

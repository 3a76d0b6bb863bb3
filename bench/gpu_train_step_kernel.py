"""GPU: the training step kernel (``beatflow.model.step_kernel``) against the compiled bf16 steps, as the flow trains.

In a process set up as a flow GPU worker (RMM async pool for CuPy, Numba and PyTorch, statistics adaptor,
capture arena: ``backend.setup_gpu_memory`` + ``backend.track_rmm_statistics`` + ``capture_arena.install``),
on the 20 h stream's kept rows (about 97 k x 256, scaled, minus the dominant beat), ``train_vae`` runs
``RUNS`` times per variant with ``keep_graphs`` (run 1 captures, later runs replay the kept graphs), as
the flow's training task calls it. Variants (``VARIANTS``, default all):

* ``bf16``: the compiled fusible form cast to bf16, CUDA graphs (the flow's training before 2026-12-05);
* ``kernel``: the step kernel in fp32, CUDA graphs (a whole epoch a graph);
* ``kernel-eager``: the step kernel launched step by step (no graphs);
* ``kernel-transposed`` (not in the default ``VARIANTS``): the epoch graph of the step kernel with its weight-gradient
  sums 32 at a time by a transposed butterfly (``BEATFLOW_STEP_SUMS``), the flow's default since 2026-12-06; here
  ``kernel`` keeps a butterfly each (the default before), so that the two compare as they were measured.

``IDLE_S``: seconds the GPU idles before each run (as between the flow's stages); the epoch graph's runs
also print their epochs' GPU time and the host's time to queue them (``TrainResult.epoch_gpu_ms``, ``queue_s``).
``kernel-busy`` and ``kernel-busy-5ms`` (not in the default ``VARIANTS``): the epoch graph while another
thread runs Python, with the queued epochs' switch interval (``model.QUEUE_SWITCH_INTERVAL``) and without.

A table: seconds of ``train_vae`` and its parts, ms per step over epochs 2-10, test loss; JSON to
``$OUT/train_step_kernel.json``. Then (``PROFILE`` steps, default 20) the kernel step's GPU kernels by
``torch.profiler``. Run on the GPU machine from the repository root (``PYTHONPATH=$PWD``)::

    python3 bench/gpu_train_step_kernel.py     (bash bench/gpu.sh train; results: bench/results/training.md)
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

VARIANTS = {"bf16": dict(precision="bf16", compile=True, kernel=False, cudagraphs=None),
            "kernel": dict(precision="fp32", compile=False, kernel=True, cudagraphs=None),
            "kernel-eager": dict(precision="fp32", compile=False, kernel=True, cudagraphs=False)}
# the epoch graph with another thread of the process busy in Python (as a Dask worker's), the queued
# epochs' switch interval as it is (model.QUEUE_SWITCH_INTERVAL) or left at the interpreter's 5 ms
for _busy, _switch in (("kernel-busy", "default"), ("kernel-busy-5ms", None)):
    VARIANTS[_busy] = dict(VARIANTS["kernel"], busy=True, switch=_switch)
# the step kernel's weight-gradient sums 32 at a time, transposed (the flow's default; "kernel": a butterfly each)
VARIANTS["kernel-transposed"] = dict(VARIANTS["kernel"], sums="transposed")


class Busy:
    """A thread that runs Python until stopped (it wants the interpreter's lock all the time)."""

    def __init__(self):
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self):
        n = 0
        while not self.stop.is_set():
            for _ in range(1000):
                n += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main() -> int:
    import cupy
    import torch

    from beatflow import device as backend
    from beatflow.model import graphs as G
    from beatflow.model import train as M
    from beatflow.score import rule as B
    from beatflow.gpu.arena import install
    from common import Table, gpu_stream, print_header

    print_header()
    backend.setup_gpu_memory(0.5)
    backend.track_rmm_statistics()
    install()
    _, _, _, seg_embed = gpu_stream()
    rows, p2p = seg_embed()
    rows /= float(cupy.median(p2p))
    rows = B.residual_rows(rows, B.dominant_beat(rows))
    data = torch.from_dlpack(rows)
    steps = -(-int(data.shape[0] * M.TRAIN_FRACTION) // 1024)
    print(f"rows {tuple(data.shape)}, {steps} steps per epoch, graph allocator {G.graph_allocator()}", flush=True)
    out = {"rows": list(data.shape), "steps_per_epoch": steps, "runs": []}
    table = Table(["variant", "run", "kernel", "graphs", "kept", "compiled", "total s", "setup s", "epochs s",
                   "ms per step (2-10)", "test loss"], "lrllllrrrrr")
    table.header()
    import contextlib

    default_switch = G.QUEUE_SWITCH_INTERVAL
    for name in os.environ.get("VARIANTS", "bf16 kernel kernel-eager").split():
        kw = dict(VARIANTS[name])
        busy, switch = kw.pop("busy", False), kw.pop("switch", "default")
        os.environ["BEATFLOW_STEP_SUMS"] = kw.pop("sums", "butterfly")
        G.QUEUE_SWITCH_INTERVAL = default_switch if switch == "default" else switch
        for run in range(1, int(os.environ.get("RUNS", "3")) + 1):
            marks = []
            torch.cuda.synchronize()
            time.sleep(float(os.environ.get("IDLE_S", "0")))  # (the GPU idle before, as in the flow between runs)
            t = time.perf_counter()
            try:
                with Busy() if busy else contextlib.nullcontext():
                    res = M.train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", keep_graphs=True,
                                      on_epoch=lambda e, loss, s: marks.append(s), **kw)
            except Exception as e:  # a variant that fails is a row, not the end of the call
                table.row(name, run, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                break
            total = time.perf_counter() - t
            per_step = (marks[-1] - marks[0]) / (9 * steps) * 1e3
            row = dict(variant=name, run=run, kernel=res.kernel, graphs=res.cudagraphs, kept=res.graphs_kept,
                       epoch_graph=res.epoch_graph,
                       compiled=res.compiled, total_s=total, phases=res.phases, ms_per_step=per_step,
                       test_loss=res.test_loss, train_loss=res.train_loss)
            out["runs"].append(row)
            graphs = "epoch" if res.epoch_graph else res.cudagraphs
            row["epoch_gpu_ms"] = res.epoch_gpu_ms
            row["queue_s"] = res.queue_s
            gpu = (f" (GPU {sum(res.epoch_gpu_ms):.1f} ms; host: orders {res.queue_s.get('orders', 0) * 1e3:.1f} ms, "
                   f"queue {res.queue_s.get('queue', 0) * 1e3:.1f} ms, GC {res.queue_s.get('gc', 0) * 1e3:.1f} ms)"
                   if res.epoch_gpu_ms else "")
            table.row(name, run, res.kernel, graphs, res.graphs_kept, res.compiled, f"{total:.3f}",
                      f"{res.phases['setup']:.3f}", f"{res.phases['epochs']:.3f}{gpu}", f"{per_step:.3f}",
                      f"{res.test_loss:.6f}")
    for name in {r["variant"] for r in out["runs"]}:  # kept graphs train to the fresh capture's weights
        runs = [r for r in out["runs"] if r["variant"] == name]
        same = all(r["train_loss"] == runs[0]["train_loss"] for r in runs)
        print(f"{name}: the runs' losses {'agree' if same else 'DIFFER'}")
    by = {(r["variant"], r["run"]): r for r in out["runs"]}
    for run in sorted({r["run"] for r in out["runs"]}):  # (the sums' two ways: the same bits, the same losses)
        a, b = by.get(("kernel", run)), by.get(("kernel-transposed", run))
        if a and b:
            first = next((e for e, (x, y) in enumerate(zip(a["train_loss"], b["train_loss"]), 1) if x != y), None)
            how = (f"DIFFER from epoch {first}" if first else "DIFFER in the test loss"
                   if a["test_loss"] != b["test_loss"] else "identical")
            print(f"run {run}: kernel (butterfly sums) and kernel-transposed: losses {how}")
    n = int(os.environ.get("PROFILE", "20"))
    if n:
        profile_kernel_step(M, data, n)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "train_step_kernel.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


def profile_kernel_step(M, data, n: int) -> None:
    """The GPU kernels of ``n`` kernel steps (step kernel, the rows' sum, fused Adam), launched one by one."""
    import torch

    from beatflow.model.step_kernel import KernelStep

    torch.manual_seed(0)
    model = M.LightVAE(data.shape[1]).cuda()
    step = KernelStep(model, "cuda")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    xb = data[:1024].contiguous()
    for _ in range(5):
        step(xb)
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step(xb)
            opt.step()
        torch.cuda.synchronize()
    total = 0.0
    lines = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0)):
        t = getattr(e, "device_time_total", 0)
        if t > 0:
            total += t
            lines.append(f"  {e.key[:70]:70s} {e.count / n:5.1f}/step {t / max(1, e.count):8.2f} us")
    print(f"kernel step: GPU time {total / n:.1f} us per step")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    sys.exit(main())

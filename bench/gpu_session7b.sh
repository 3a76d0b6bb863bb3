#!/usr/bin/env bash
# One short H200 call (session 7, last): the flutter rule's CuPy test and its time after fewer
# launches, segmentation + embedding with it, and the VAE training in a worker-like process (RMM
# over the async pool as PyTorch's allocator) compiled without CUDA graphs, against the graphed
# uncompiled step the flow falls back to (a compiled step cannot be captured there).
#   bash bench/gpu_session7b.sh      (from the repository root; .whl carried)
set -u
t0=$(date +%s)
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
el() { echo "$(( $(date +%s) - t0 )) s"; }
echo "== rhythm tests on CuPy ($(el))"
timeout 60 python3 -m pytest -x -q --tb=short -p no:cacheprovider -p no:warnings tests/test_rhythm.py 2>&1 | tail -4
echo "== times ($(el))"
timeout 90 python3 - <<'PY' 2>&1 | grep -v "cupy._util"
import sys; sys.path.insert(0, "bench")
import numpy as np, cupy
from cupyx.profiler import benchmark
from gpu_seg_embed import setup
from beatflow.gpu import kernels as K
from beatflow.detect.rhythm import flutter_keep_mask
s, x, xg, seg_embed = setup()
peaks = K.detect_peaks_gpu(xg, s)
seg_embed()
for name, fn in (("detect_peaks_gpu", lambda: K.detect_peaks_gpu(xg, s)),
                 ("flutter rule on CuPy", lambda: flutter_keep_mask(xg, peaks, 0, s)),
                 ("segmentation + embedding (with the rule)", seg_embed)):
    r = benchmark(fn, (), n_repeat=20, n_warmup=3)
    print(f"  {name:45s} {np.median(r.gpu_times[0]) * 1e3:8.3f} ms GPU  {np.median(r.cpu_times) * 1e3:8.3f} ms host")
PY
echo "== training, RMM async as PyTorch's allocator ($(el))"
timeout 200 python3 - <<'PY' 2>&1 | grep -v "cupy._util\|script_method\|requires_grad"
import time, warnings, rmm, torch, cupy
from rmm.allocators.torch import rmm_torch_allocator
from rmm.allocators.cupy import rmm_cupy_allocator
rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource(initial_pool_size=4 << 30))
cupy.cuda.set_allocator(rmm_cupy_allocator)
torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
from beatflow.model.vae import vae as M
data = torch.from_dlpack(cupy.random.standard_normal((97102, 256), dtype=cupy.float32) * 0.1)
warnings.simplefilter("ignore")
print("| precision | compiled | graphs | run | total s | epochs 2-10 s | test loss |")
print("|---|---|---|---|---:|---:|---:|")
for prec, comp, g in (("fp32", True, False), ("fp32", True, False), ("bf16", True, False), ("bf16", True, False),
                      ("bf16", False, None), ("bf16", False, None), ("bf16", True, None)):
    marks = []
    t = time.perf_counter()
    r = M.train_vae(data, epochs=10, batch_size=1024, seed=0, device="cuda", precision=prec, compile=comp,
                    cudagraphs=g, on_epoch=lambda e, l, s: marks.append(s))
    print(f"| {prec} | {comp} | {r.cudagraphs} | | {time.perf_counter() - t:.3f} | {marks[-1] - marks[0]:.3f} | "
          f"{r.test_loss:.6f} |", flush=True)
PY
echo "done ($(el))"

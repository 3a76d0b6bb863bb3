"""Compile every CUDA kernel of beatflow (``beatflow.detect.gpu_kernels``, ``beatflow.detect.gpu_vf``,
``beatflow.embed.gpu``) for sm_90 (H100/H200) on a machine without a GPU.

The CUDA simulator checks what the kernels compute, not that Numba can compile them for a real
device, nor what code they become. NVVM runs without a GPU, so this compiles each kernel to PTX
for compute capability 9.0 and counts its instructions by kind (the static count, a proxy for the
per-sample instruction count that Nsight Compute measures on the H200).

Needs Numba's CUDA target and NVVM/NVRTC, e.g. in a separate environment::

    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install numba numba-cuda nvidia-cuda-nvcc-cu12 \
        nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 numpy
    /tmp/nv/bin/python bench/ptx_check.py            # PTX of the dense kernel under bench/out/dense.ptx
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numba  # noqa: E402
import numba.cuda  # noqa: E402
import numba.cuda.api as _api  # noqa: E402
import numba.cuda.dispatcher as _dispatcher  # noqa: E402
from numba import boolean, cuda, float32, float64, int8, int32, int64, uint8  # noqa: E402


class _H200:  # what Numba asks of "the current device" when it compiles device functions
    compute_capability = (9, 0)
    id = 0


numba.cuda.is_available = lambda: True
_api.get_current_device = lambda: _H200()
numba.cuda.get_current_device = lambda: _H200()
if hasattr(_dispatcher, "get_current_device"):
    _dispatcher.get_current_device = lambda: _H200()

from beatflow.detect import gpu as DG  # noqa: E402
from beatflow.detect import gpu_kernels as GK  # noqa: E402
from beatflow.detect import gpu_vf as VF  # noqa: E402
from beatflow.embed import gpu as EG  # noqa: E402
from beatflow.gpu.runtime import maxreg  # noqa: E402
from beatflow.params import SegmentParams  # noqa: E402


def count(ptx: str):
    ins = [ln.strip() for ln in ptx.splitlines()]
    ins = [ln for ln in ins if ln and not ln.startswith(("//", ".", "$", "{", "}", ")")) and not ln.endswith(":")]
    return len(ins), collections.Counter(ln.split()[0].split(".")[0] for ln in ins).most_common(8)


def ptxas_usage(ptx: str, out: str, name: str) -> str:
    """Registers, spills and shared memory that ptxas (of the nvcc wheel, when present) gives the
    kernel for sm_90, or '' without ptxas."""
    import glob
    import re
    import subprocess

    exe = glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cuda_nvcc", "bin", "ptxas"))
    if not exe:
        return ""
    path = os.path.join(out, f"{name}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    cap = maxreg().get(name)  # the product's register cap of this kernel (runtime.MAXREG_DEFAULT)
    r = subprocess.run([exe[0], "-arch=sm_90", "-v", path, "-o", os.devnull] + ([f"-maxrregcount={cap}"] if cap else []),
                       capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return f"regs {regs.group(1) if regs else '?'}{f' (cap {cap})' if cap else ''} spill {spill.group(1) if spill else '?'}"


def main():
    out = os.environ.get("OUT", "bench/out")
    os.makedirs(out, exist_ok=True)
    s = SegmentParams().samples(250.0)
    det = GK.build_detect(int(s.kernel), int(s.box), int(s.nms), int(s.block), int(s.fine_kernel),
                          int(s.slope_half), DG._DET_TILE, DG._DET_TPB, GK.kernel_taps(int(s.kernel), float(s.a), True),
                          GK.kernel_taps(int(s.fine_kernel), float(s.fine_a)), tuple(GK.DENSE_CHUNKS))
    base = {**GK.build()[0], **EG._build()[0]}
    vf = VF.build_vf(int(s.vf_window), int(s.vf_highpass), int(s.kernel), VF._VF_CHUNKS * VF._VF_TILE,
                     GK.kernel_taps(int(s.kernel), float(s.a), True))
    A = lambda t: t[::1]  # noqa: E731
    todo = [
        ("dense", det["dense"], (A(float32), int64, int64, boolean, A(float64), A(float64), A(float64),
                                 int64, A(int64), A(int64), A(float64), A(float64), A(int64))),
        ("cand_eval", det["cand_eval"], (A(float32), A(int64), A(int64), int64, A(int64), A(float64), A(float64),
                                         A(float64), int64, int64, int64, float64, float64, A(float64),
                                         float64, float64, float64,
                                         A(int64), A(float64), A(float64), A(int8))),
        ("emit_count", det["emit_count"], (A(int64), A(int64), A(int8), int64, int64, int64, A(int8), int64, int64,
                                           A(int64))),
        ("emit", det["emit"], (A(int64), A(int64), A(int8), int64, int64, int64, A(int8), int64, int64, A(int64),
                               A(int64))),
        ("vf_energy", vf["vf_energy"], (A(float32), int64, int64, A(float64), A(float64))),
        ("vf_need", vf["vf_need"], (A(float64), A(float64), int64, float64, A(int64), A(int64))),
        ("vf_near", vf["vf_near"], (A(float32), int64, int64, A(int64), A(int64), float64, A(float64))),
        ("vf_episodes", vf["vf_episodes"], (A(float64), A(float64), A(float64), int64, float64, float64, int64, int64,
                                            int64, int64, A(int8), int64[:, ::1], A(int64))),
        ("nms_tiled", base["nms_tiled"], (A(float64), int64, A(uint8))),
        ("cand_twave", base["cand_twave"], (A(int64), A(int64), A(int8), A(float64), int64, float64, A(int8))),
        ("cand_refractory", base["cand_refractory"], (A(int64), A(int64), A(int8), int64, A(float64), int64,
                                                      A(int8), int64)),
        ("cand_search_back", base["cand_search_back"], (A(int64), A(int64), A(int8), A(float64), int64, int64, int64,
                                                        float64, float64, float64, A(int8))),
        ("block_median", base["block_median"], (A(float64), int64, A(float64))),
        ("exclusive_scan", base["exclusive_scan"], (A(int64), A(int64), A(int64))),
        ("beats_count", base["beats_count"], (A(int64), A(int64), int64, int64, int64, boolean, int64, A(int64))),
        ("beats_write", base["beats_write"], (A(int64), A(int64), int64, int64, int64, boolean, int64, A(int64),
                                              A(int64), A(int64), A(int64), A(int64), A(int64), A(int64))),
        ("embed_warp", EG._embed_build(256), (A(float32), A(int64), A(int64), int64, int64, float32[:, ::1],
                                             A(float32), A(int32), int64, A(int64))),
    ]
    for name, kern, sig in todo:
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
        if name == "dense":
            with open(os.path.join(out, "dense.ptx"), "w") as f:
                f.write(ptx)
        n, kinds = count(ptx)
        print(f"{name:18s} {n:6d} PTX instructions  {ptxas_usage(ptx, out, name)}  {kinds}")


if __name__ == "__main__":
    main()

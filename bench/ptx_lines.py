"""Static PTX instructions per source line of one detection kernel, compiled for sm_90 without a GPU.

Where a kernel's instructions come from (session 13: the dense kernel's rolled block-stride loops and
slices; ``vf_energy``'s moving-mean sums). Needs the environment of ``bench/ptx_check.py``::

    /tmp/nv/bin/python bench/ptx_lines.py dense        # or vf_energy, cand_eval, embed_warp

Prints ``line  instructions  source  [most common opcodes]`` in source order (an unrolled loop's lines
count every copy).
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_check as P  # noqa: E402  (sets up Numba's CUDA target for an H200 without a GPU)
from numba import boolean, cuda, float32, float64, int32, int64  # noqa: E402


def kernel_and_signature(name: str):
    K, s = P.K, P.SegmentParams().samples(250.0)
    A = lambda t: t[::1]  # noqa: E731
    taps = K._taps(int(s.kernel), float(s.a), True)
    if name == "vf_energy":
        vf = K._vf_build(int(s.vf_window), int(s.vf_highpass), int(s.kernel), K._VF_CHUNKS * K._VF_TILE, taps)
        return vf[name], (A(float32), int64, int64, A(float64), A(float64))
    if name == "embed_warp":
        return K._embed_build(256), (A(float32), A(int64), A(int64), int64, int64, float32[:, ::1], A(float32),
                                     A(int32), int64)
    det = K._detect_build(int(s.kernel), int(s.box), int(s.nms), int(s.block), int(s.fine_kernel),
                          int(s.slope_half), K._DET_TILE, K._DET_TPB, taps,
                          K._taps(int(s.fine_kernel), float(s.fine_a)))
    sigs = {"dense": (A(float32), int64, int64, boolean, A(float64), A(float64), A(float64), int64, A(int64),
                      A(int64), A(float64), A(float64), A(int64)),
            "cand_eval": (A(float32), A(int64), A(int64), int64, A(int64), A(float64), A(float64), A(float64), int64,
                          int64, int64, float64, float64, A(float64), float64, float64, float64, A(int64),
                          A(float64), A(float64), P.int8[::1])}
    return det[name], sigs[name]


def main(name: str = "dense") -> None:
    kern, sig = kernel_and_signature(name)
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), lineinfo=True)
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    cur, count, kinds = None, collections.Counter(), collections.defaultdict(collections.Counter)
    for ln in ptx.splitlines():
        t = ln.strip()
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)", t)
        if m:
            cur = (os.path.basename(files.get(m.group(1), "?")), int(m.group(2)))
            continue
        if not t or t.startswith(("//", ".", "$", "{", "}", ")")) or t.endswith(":"):
            continue
        count[cur] += 1
        kinds[cur][t.split()[0]] += 1
    src = open(P.K.__file__).read().splitlines()
    print(f"{name}: {sum(count.values())} PTX instructions")
    mine = [k for k in count if k and k[0] == "kernels.py" and k[1] > 0]
    for key in sorted(mine, key=lambda k: k[1]):
        print(f"{key[1]:5d} {count[key]:5d}  {src[key[1] - 1].strip()[:60]:60s} {kinds[key].most_common(3)}")
    other = sum(v for k, v in count.items() if k not in mine)
    print(f"      {other:5d}  (no line of kernels.py: Numba's and NVVM's own code)")


if __name__ == "__main__":
    main(*sys.argv[1:2])

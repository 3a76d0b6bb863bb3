"""The training step kernel's PTX, compiled without a GPU: its size, shuffles and local memory for each way of
summing (``beatflow.model.step_kernel.step_sums``), and with ``--dump DIR`` the PTX files (to diff two trees).

Needs Numba's CUDA target with NVVM, which the project's own environment lacks on a machine without a GPU:
a separate venv, e.g. ``python3 -m venv /tmp/ptx && /tmp/ptx/bin/pip install "numba-cuda[cu13]==0.30.4" numpy``,
then from the repository root (or with ``--root`` another checkout)::

    /tmp/ptx/bin/python bench/ptx_stats.py [--width 256] [--cc 9.0] [--root PATH] [--dump DIR]

The device queries compilation makes (is there a GPU, its compute capability) are answered with ``--cc``:
nothing is launched. Session 33 used it to find that a change to the butterfly sums' loop had changed the
default kernel's code (``bench/RESULTS.md``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import types


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    cc = tuple(int(v) for v in args.cc.split("."))
    sys.path.insert(0, os.path.abspath(args.root))

    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    cuda.is_available = lambda: True  # (compiling only)
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    import beatflow.model.step_kernel as TK

    sums_ways = ("butterfly", "transposed") if hasattr(TK, "step_sums") else (None,)
    print(f"| sums | PTX lines | shfl.sync | ld.local | st.local |  (width {args.width}, cc {args.cc}, {args.root})")
    print("|---|---:|---:|---:|---:|")
    for sums in sums_ways:
        kernel = TK.build_step_kernel(args.width, sums) if sums else TK.build_step_kernel(args.width)
        ptx, _ = cuda.compile_ptx(kernel.py_func, "void(float32[:,:], float32[:,:], float32[:], float32[:,:])",
                                  cc=cc)
        print(f"| {sums or 'the only'} | {len(ptx.splitlines())} | {len(re.findall(r'shfl[.]sync', ptx))} | "
              f"{ptx.count('ld.local')} | {ptx.count('st.local')} |")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"step-{sums or 'kernel'}-{args.width}.ptx"), "w") as f:
                f.write(re.sub(r"_Z\w+", "", ptx))  # (mangled names differ from tree to tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())

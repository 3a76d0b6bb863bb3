"""GPU: how Numba CUDA's code style changes a kernel's instruction count (copy and envelope variants).

    python bench/gpu_numba_probe.py     # times (CUDA events, median of 20) and PTX sizes; JSON under $OUT
"""
import json, os
import numpy as np

OUT = os.environ.get("OUT", "bench/out")


def main():
    import cupy
    import numba
    from numba import cuda
    from numba.core import config
    res = {"numba": numba.__version__, "OPT": config.OPT, "DEBUGINFO": config.DEBUGINFO_DEFAULT,
           "env": {k: v for k, v in os.environ.items() if k.startswith("NUMBA")}, "ms": {}, "ptx_lines": {}}
    n = 18_000_000
    a = cupy.random.standard_normal(n, dtype=cupy.float32)
    b = cupy.empty_like(a)

    @cuda.jit
    def copy_stride(a, b):
        for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
            b[i] = a[i]

    @cuda.jit
    def copy_plain(a, b):
        i = cuda.grid(1)
        if i < a.shape[0]:
            b[i] = a[i]

    @cuda.jit(fastmath=False, opt=True)
    def copy_opt(a, b):
        i = cuda.grid(1)
        if i < a.shape[0]:
            b[i] = a[i]

    K = 17
    @cuda.jit
    def conv_runtime(x, k, y):
        i = cuda.grid(1)
        n = x.shape[0]
        if i < n - k.shape[0]:
            acc = 0.0
            for j in range(k.shape[0]):
                acc += np.float64(x[i + j]) * k[j]
            y[i] = acc

    @cuda.jit
    def conv_const(x, k, y):
        i = cuda.grid(1)
        n = x.shape[0]
        if i < n - K:
            acc = 0.0
            for j in range(K):
                acc += np.float64(x[i + j]) * k[j]
            y[i] = acc

    k = cupy.random.standard_normal(K)
    y = cupy.empty(n, dtype=cupy.float64)
    cases = {
        "copy_stride": lambda: copy_stride[-(-n // 256), 256](a, b),
        "copy_plain": lambda: copy_plain[-(-n // 256), 256](a, b),
        "copy_opt": lambda: copy_opt[-(-n // 256), 256](a, b),
        "cupy copy": lambda: cupy.copyto(b, a),
        "conv17_runtime_K": lambda: conv_runtime[-(-n // 256), 256](a, k, y),
        "conv17_const_K": lambda: conv_const[-(-n // 256), 256](a, k, y),
    }
    for f in cases.values():
        f()
    cupy.cuda.Device().synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    for name, f in cases.items():
        ts = []
        for _ in range(20):
            e0.record(); f(); e1.record(); e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1))
        res["ms"][name] = round(float(np.median(ts)), 4)
        print(f"{name:24s} {res['ms'][name]:8.4f} ms", flush=True)
    for name, kern in [("copy_stride", copy_stride), ("copy_plain", copy_plain), ("conv_runtime", conv_runtime),
                       ("conv_const", conv_const)]:
        for sig in kern.overloads:
            ptx = kern.inspect_asm(sig)
            res["ptx_lines"][name] = len(ptx.splitlines())
            with open(os.path.join(OUT, f"{name}.ptx"), "w") as f:
                f.write(ptx)
    print(json.dumps({k: v for k, v in res.items() if k != "ms"}, indent=1))
    with open(os.path.join(OUT, "numba_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    main()

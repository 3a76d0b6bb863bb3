"""Kernel durations from an Nsight Compute text report of ``bench/gpu_seg_embed.py`` (which runs
segmentation + embedding twice): per kernel name, the launches and the µs of the second call.

    python3 bench/ncu_durations.py ncu.txt
"""
import collections
import re
import sys


def main(path: str) -> None:
    name, tot = None, collections.defaultdict(list)
    for ln in open(path, errors="replace"):
        if ln.startswith("  ") and not ln.startswith("   ") and "(" in ln:
            name = ln.strip().split("(")[0].split("[abi")[0].split("::")[-1][:40]
        m = re.search(r"Duration\s+(\S+)\s+([\d.,]+)", ln)
        if m and name:
            v = float(m.group(2).replace(",", ""))
            v = v / 1000 if m.group(1) == "ns" else (v * 1000 if m.group(1) == "ms" else v)
            tot[name].append(v)
    allk = 0.0
    for k, v in tot.items():
        h = v[len(v) // 2:]
        allk += sum(h)
        print(f"  {k:42s} n={len(v):3d}  µs (second call) {sum(h):9.1f}")
    print(f"  all kernels of the second call: {allk:.1f} µs")


if __name__ == "__main__":
    main(sys.argv[1])

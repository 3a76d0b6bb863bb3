"""GPU: does a CUDA graph captured after another one in the same process draw the same noise as in a fresh
process? (Session 34: the step kernel's second fresh epoch-graph capture in a process trained to other losses
from epoch 2, its kept replays to the first's.) Each case in its own process; each prints the sums of the noise
that three replays of graph B drew (``randn`` of 4096 in the graph), as ``train_vae`` orders things: seed, three
warm-up draws on a side stream, capture, the generator's offset read, replays.

* ``fresh``: B is the process's only graph;
* ``second``: graph A (another size) captured and replayed first, then B (A kept alive);
* ``second-release``: as ``second``, A dropped after B's capture and before B's replays (as ``model._keep`` does);
* ``second-release-reset``: as ``second-release``, the generator set to the offset read right after B's capture
  before the replays (as a kept run's ``reset`` does).

    python3 bench/gpu_graph_rng.py      (prints a line per case and whether each is the fresh one's)
"""
import subprocess
import sys

import torch


def capture(n):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.randn(n, device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.randn(n, device="cuda") * 1.0
    return g, out


def replays(g, out, k=3):
    sums = []
    for _ in range(k):
        g.replay()
        sums.append(float(out.double().sum()))
    return sums


def case(name):
    torch.cuda.init()  # (the default generators exist once CUDA is initialised)
    gen = torch.cuda.default_generators[0]
    a = None
    if name != "fresh":
        torch.manual_seed(0)
        a = capture(1000)
        replays(*a)
    torch.manual_seed(0)
    b = capture(4096)
    offset = gen.get_offset()
    if "release" in name:
        del a
    if "reset" in name:
        gen.set_offset(offset)
    print(name, offset, replays(*b), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case(sys.argv[1])
        sys.exit(0)
    lines = {}
    for name in ("fresh", "second", "second-release", "second-release-reset"):
        out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
        line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
        lines[name] = line
        print(line)
    ok = {name: line.startswith(name + " ") for name, line in lines.items()}
    for name, line in lines.items():
        same = ok[name] and ok["fresh"] and line.split(" ", 2)[2] == lines["fresh"].split(" ", 2)[2]
        print(f"{name}: {'failed' if not ok[name] else 'the fresh noise' if same else 'OTHER noise'}")

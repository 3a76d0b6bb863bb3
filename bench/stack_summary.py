"""Where a thread's time went, from a raw ``py-spy record -f raw --threads --idle`` file.

Each line of the file is a stack (frames ``func (file:line)`` joined by ``;``, outermost first)
and its sample count. The stacks that pass through ``ANCHOR`` (default ``_run_flow``, the flow's
body) are kept, and two tables are printed in milliseconds at the sampling rate:

* the anchor's own lines (which statement of the flow the time went to, in order of the source);
* the functions below it, by inclusive time (a function counted once per stack).

Run::

    python bench/stack_summary.py pyspy.txt [RATE_HZ] [ANCHOR] [TOP]
"""
from __future__ import annotations

import re
import sys
from collections import Counter

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def parse(path: str, anchor: str):
    """``(by_line, inclusive, total)``: the anchor's lines and the functions below it, in samples."""
    by_line, inclusive, total = Counter(), Counter(), 0
    for raw in open(path, encoding="utf-8", errors="replace"):
        raw = raw.rstrip("\n")
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(anchor + " ")), None)
        if at is None:
            continue
        total += n
        m = FRAME.match(frames[at])
        by_line[int(m.group("line")) if m else -1] += n
        seen = set()
        for f in frames[at + 1:]:
            m = FRAME.match(f)
            key = f"{m.group('func')} ({m.group('file').rsplit('/', 2)[-1]})" if m else f
            if key not in seen:
                seen.add(key)
                inclusive[key] += n
    return by_line, inclusive, total


def main(argv: list[str]) -> int:
    path = argv[1]
    rate = float(argv[2]) if len(argv) > 2 else 1000.0
    anchor = argv[3] if len(argv) > 3 else "_run_flow"
    top = int(argv[4]) if len(argv) > 4 else 40
    by_line, inclusive, total = parse(path, anchor)
    ms = 1000.0 / rate
    print(f"{path}: {total} samples through {anchor} ({total * ms:.0f} ms at {rate:g} Hz)")
    print(f"\n| {anchor} line | ms |\n|---:|---:|")
    for line, n in sorted(by_line.items()):
        if n * ms >= 2:
            print(f"| {line} | {n * ms:.0f} |")
    print("\n| function (below the anchor, inclusive) | ms |\n|---|---:|")
    for key, n in inclusive.most_common(top):
        print(f"| {key} | {n * ms:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

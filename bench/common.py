"""What the bench scripts share: timing, markdown tables, the machine header, the GPU benches' stream.

* ``timed(fn, ...)``, ``timeit(fn, ..., repeats=, warmup=)``: seconds of a call; a :class:`Timing`
  holds every repeat and gives ``median``, ``min``, ``max``;
* ``markdown_table(columns, rows, align=)`` / ``print_table``: a whole table; :class:`Table` prints
  its header, then each row as it comes (a long run shows its rows as it goes);
* ``machine()``, ``header()``, ``print_header()``: CPU model and cores, RAM, the GPU if any, Python,
  torch, numba versions, the date and the git commit, as the results files quote them;
* :class:`Sections`: ``with sections("name"):`` prints ``== name`` and its seconds, and a block that
  fails is recorded (its traceback) and skipped, so that a device call goes on with the next block;
* ``gpu_stream()``: the 20 h synthetic stream on the device and segmentation + embedding as the
  flow's GPU path runs it (``beatflow.detect.gpu.segment_rows_gpu``).

Nothing heavy is imported here: versions come from the installed packages' metadata, the GPU's name
from ``nvidia-smi``. ``python bench/common.py [TITLE]`` prints the machine header (``bench/gpu.sh setup``).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- timing

@dataclass
class Timing:
    """Seconds of each timed repeat."""

    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def min(self) -> float:
        return min(self.runs)

    @property
    def max(self) -> float:
        return max(self.runs)


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``."""
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def timeit(fn, *args, repeats: int = 7, warmup: int = 1, **kwargs) -> Timing:
    """``repeats`` timed calls of ``fn(*args, **kwargs)`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    out = Timing()
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args, **kwargs)
        out.runs.append(time.perf_counter() - t)
    return out


# ---------------------------------------------------------------------------------------------- tables

def _rule(align: str | None, n: int) -> str:
    align = (align or "").ljust(n, "l")
    return "|" + "".join("---:|" if a == "r" else "---|" for a in align[:n])


def _line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(columns, rows, align: str | None = None) -> str:
    """A markdown table; ``align`` has an ``l`` or ``r`` per column (default: all left)."""
    columns = list(columns)
    return "\n".join([_line(columns), _rule(align, len(columns))] + [_line(r) for r in rows])


def print_table(columns, rows, align: str | None = None, file=None) -> None:
    print(markdown_table(columns, rows, align), file=file or sys.stdout, flush=True)


class Table:
    """A markdown table printed as it is made: ``t = Table(cols, "lrr"); t.header(); t.row(a, b, c)``.
    A row may have fewer cells than the header (a run that failed)."""

    def __init__(self, columns, align: str | None = None, file=None):
        self.columns, self.align, self.file = list(columns), align, file

    def header(self) -> None:
        print(_line(self.columns) + "\n" + _rule(self.align, len(self.columns)), file=self.file or sys.stdout,
              flush=True)

    def row(self, *cells) -> None:
        print(_line(cells), file=self.file or sys.stdout, flush=True)


# ---------------------------------------------------------------------------------------------- the machine

def _run(cmd: list[str], timeout: float = 10.0) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _threads_per_core() -> str:
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Thread(s) per core"):
            return line.split(":", 1)[1].strip()
    return "?"


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _cpu_max() -> str:
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            return f.read().strip()
    except OSError:
        return "none"


def _version(*names: str) -> str:
    """The installed version of the first of ``names`` found (a name ending in ``*``: any distribution so
    named, e.g. ``cupy-cuda13x``)."""
    from importlib import metadata

    for name in names:
        if name.endswith("*"):
            for d in metadata.distributions():
                n = (d.metadata["Name"] or "").lower()
                if n.startswith(name[:-1]):
                    return f"{d.version} ({n})"
            continue
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return "absent"


def _commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # (a copy of the tree without its .git, e.g. on a device machine)
        return os.environ["BENCH_COMMIT"]
    head = _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    if not head:
        return "unknown (no git checkout)"
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head + (" + uncommitted changes" if dirty else "")


def machine() -> dict:
    """The machine, the software and the tree a figure comes from."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    ram = _ram_gib()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "threads_per_core": _threads_per_core(),
        "cpu_max": _cpu_max(),
        "ram_gib": None if ram is None else round(ram, 1),
        "gpu": "; ".join(g.strip() for g in gpus.splitlines()) or "none",
        "python": platform.python_version(),
        "versions": {"torch": _version("torch"), "numba": _version("numba"), "numba-cuda": _version("numba-cuda"),
                     "cupy": _version("cupy", "cupy-*"), "numpy": _version("numpy")},
        "commit": _commit(),
        "load": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }


def header(title: str | None = None, info: dict | None = None) -> str:
    """The machine header as markdown lines (``title`` first, as a heading)."""
    m = info or machine()
    ram = "?" if m["ram_gib"] is None else f"{m['ram_gib']:g} GiB"
    lines = [f"## {title}", ""] if title else []
    lines += [f"- machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable, {m['threads_per_core']} "
              f"thread(s) per core, cpu.max {m['cpu_max']}), {ram} RAM; GPU: {m['gpu']}",
              f"- software: Python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
              f"- date: {m['date']}; commit: {m['commit']}; load average: {m['load']}"]
    return "\n".join(lines)


def print_header(title: str | None = None, file=None) -> dict:
    """Print the machine header and a blank line; returns the machine's dict (for a script's JSON)."""
    info = machine()
    print(header(title, info) + "\n", file=file or sys.stdout, flush=True)
    return info


# ---------------------------------------------------------------------------------------------- sections

class Sections:
    """``with sections(name):`` prints ``== name``, then the block's seconds; a block that raises is
    recorded (``errors[name]``: the traceback's last ``keep`` characters) and skipped, and the script goes on.
    ``seconds[name]`` holds each block's time."""

    def __init__(self, errors: dict | None = None, seconds: dict | None = None, keep: int = 3000):
        self.errors = {} if errors is None else errors
        self.seconds = {} if seconds is None else seconds
        self.keep = keep

    @contextlib.contextmanager
    def __call__(self, name: str):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.seconds[name] = round(time.perf_counter() - t0, 2)
            self.errors[name] = traceback.format_exc()[-self.keep:]
            print(f"!! {name} failed: {e!r}", flush=True)
            return
        self.seconds[name] = round(time.perf_counter() - t0, 2)
        print(f"   ({self.seconds[name]:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------------------- GPU data

def gpu_stream(hours: float = 20.0, cache: str | None = None):
    """``(s, x, xg, seg_embed)``: the segmentation parameters at 250 Hz, the synthetic stream (seed 0)
    on the host and on the device, and a function that runs detection as the flow's GPU path does (the
    detection and flutter-rule kernels, then the kept beats' bounds and rows, one synchronisation:
    ``beatflow.detect.gpu.segment_rows_gpu``) and returns ``(rows, p2p)``. ``cache``: a ``.npy`` path where the
    stream is kept between processes."""
    import cupy
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from beatflow.detect import gpu as K
    from beatflow.io.synth import synthesize_ecg
    from beatflow.params import SegmentParams

    s = SegmentParams().samples(250.0)
    if cache and os.path.exists(cache):
        x = np.load(cache)
    else:
        x = synthesize_ecg(hours=hours, fs=250.0, seed=0).signal
        if cache:
            np.save(cache, x)
    xg = cupy.asarray(x)
    base = max(1, s.pre // 2)

    def seg_embed():
        out = K.segment_rows_gpu(xg, s, baseline_samples=base)
        return out[6], out[7]

    return s, x, xg, seg_embed


if __name__ == "__main__":
    print(header(" ".join(sys.argv[1:]) or None))

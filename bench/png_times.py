"""The report figures' PNG encoding, by library and by hand, on the report's own figures (the test suite's
fake report data with 20 000 latent points, as ``bench/figure_times.py``). Results: bench/results/report.md.

Table 1: each figure drawn once, its canvas's pixels encoded again and again by each encoder (interleaved,
so that a busy moment of the machine hits all alike): median and minimum milliseconds and the file's size;
the last row sums them over the figures. Every file is decoded (Pillow) and checked against the canvas's RGB.

* ``numpy-up``: a hand-written encoder: each row by PNG's "Up" filter in NumPy (unfiltered for the latent
  figures' scattered pixels, which compress better so), one IDAT by ``zlib.compress`` at level 1, RGB;
* ``pillow-rgb-1``: Pillow's ``Image.save(format="PNG", compress_level=1)``, its default (adaptive) filter,
  of the canvas as RGB (what ``beatflow.report.png`` does);
* ``pillow-rgba-1``: the same of the canvas as it is, RGBA;
* ``mpl-imsave``: Matplotlib's ``imsave`` of the canvas (what ``savefig`` does once it has drawn: Pillow,
  RGBA, its default level 6);
* ``mpl-imsave-1``: the same with ``pil_kwargs={"compress_level": 1}``.

Table 2: each figure whole, as the report draws it (``beatflow.report.figures.FIGURES``: build, draw,
encode), its PNG written by ``numpy-up`` and by ``pillow-rgb-1`` in turn; then the slowest of the late
figures with each (they are drawn at once in the figure processes: the report waits for the slowest).
Each timed call follows a ``gc.collect()``: the rounds repeat the same allocations, and a full collection
(about 100 ms among the figures' objects) fell at the same place of each round.

    python bench/png_times.py [REPEATS]        (default 15)
"""
from __future__ import annotations

import base64
import gc
import io
import os
import statistics
import struct
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

from common import Table, print_header  # noqa: E402


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def numpy_up(rgba: np.ndarray, up: bool) -> bytes:
    h, w = rgba.shape[:2]
    rows = np.empty((h, 1 + 3 * w), np.uint8)
    rows[:, 0] = 2 if up else 0  # (the filter type of each row: 2 "Up", 0 none)
    out = rows[:, 1:].reshape(h, w, 3)
    if up:
        out[0] = rgba[0, :, :3]  # (above the first row PNG takes zeros)
        np.subtract(rgba[1:, :, :3], rgba[:-1, :, :3], out=out[1:])  # (uint8: modulo 256, as PNG's filter)
    else:
        out[:] = rgba[:, :, :3]
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits a sample, RGB, deflate, filtered, not interlaced
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.data, 1))
            + _chunk(b"IEND", b""))


def pillow(rgba: np.ndarray, rgb: bool) -> bytes:
    from PIL import Image

    h, w = rgba.shape[:2]
    img = Image.frombuffer("RGBA", (w, h), rgba, "raw", "RGBA", 0, 1)
    if rgb:
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def mpl_imsave(rgba: np.ndarray, level: int | None) -> bytes:
    from matplotlib.image import imsave

    buf = io.BytesIO()
    imsave(buf, rgba, format="png", origin="upper", dpi=100,
           pil_kwargs=None if level is None else {"compress_level": level})
    return buf.getvalue()


ENCODERS = {
    "numpy-up": numpy_up,
    "pillow-rgb-1": lambda a, up: pillow(a, True),
    "pillow-rgba-1": lambda a, up: pillow(a, False),
    "mpl-imsave": lambda a, up: mpl_imsave(a, None),
    "mpl-imsave-1": lambda a, up: mpl_imsave(a, 1),
}
#: the figures whose scattered pixels ``numpy-up`` writes unfiltered
UNFILTERED = ("latent", "latent_truth")


def main() -> int:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    import beatflow.report.figures as R
    from test_report import _fake_data

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    print_header("PNG encoders on the report's figures")
    R.warm_up()
    d = _fake_data(m=20_000, ncols=4000)
    drawn, real = {}, R.figure_png  # (the figures as drawn, before their encoding)
    try:
        for name, draw in R.FIGURES.items():
            R.figure_png = lambda fig, name=name: drawn.__setitem__(name, fig) or ""
            draw(d)
    finally:
        R.figure_png = real

    print(f"Table 1: encoding, {repeats} repeats; ms median (min), kB\n")
    table = Table(["figure", "pixels", *ENCODERS], "ll" + "r" * len(ENCODERS))
    table.header()
    sums = {e: [0.0, 0.0, 0] for e in ENCODERS}
    for name, fig in drawn.items():
        up = name not in UNFILTERED
        with matplotlib.rc_context(R._RC):
            canvas = FigureCanvasAgg(fig)
            canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
        took, size = {e: [] for e in ENCODERS}, {}
        for _ in range(repeats):
            for e, enc in ENCODERS.items():
                gc.collect()
                t = time.perf_counter()
                png = enc(rgba, up)
                took[e].append((time.perf_counter() - t) * 1e3)
                size[e] = len(png)
        for e, enc in ENCODERS.items():
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(enc(rgba, up))))[..., :3], rgba[..., :3]), (name, e)
        cells = []
        for e in ENCODERS:
            med, low = statistics.median(took[e]), min(took[e])
            sums[e][0] += med
            sums[e][1] += low
            sums[e][2] += size[e]
            cells.append(f"{med:.1f} ({low:.1f}), {size[e] / 1e3:.1f}")
        h, w = rgba.shape[:2]
        table.row(name + ("" if up else " (numpy-up unfiltered)"), f"{w}×{h}", *cells)
    table.row("**sum**", "", *(f"{s[0]:.1f} ({s[1]:.1f}), {s[2] / 1e3:.1f}" for s in sums.values()))

    def writes(encode):
        def png(fig, name):
            canvas = FigureCanvasAgg(fig)
            canvas.draw()
            return base64.b64encode(encode(np.asarray(canvas.buffer_rgba()), name not in UNFILTERED)).decode("ascii")
        return png

    whole = {e: writes(ENCODERS[e]) for e in ("numpy-up", "pillow-rgb-1")}
    rounds = max(5, repeats)
    took = {(name, e): [] for name in R.FIGURES for e in whole}
    try:
        for _ in range(rounds):
            for name, draw in R.FIGURES.items():
                for e, png in whole.items():
                    R.figure_png = lambda fig, png=png, name=name: png(fig, name)
                    gc.collect()  # (else a full collection falls at the same place of every round)
                    t = time.perf_counter()
                    draw(d)
                    took[name, e].append((time.perf_counter() - t) * 1e3)
    finally:
        R.figure_png = real
    print(f"\nTable 2: whole figures, {rounds} repeats; ms median (min)\n")
    table = Table(["figure", *whole], "l" + "r" * len(whole))
    table.header()
    for name in R.FIGURES:
        table.row(name, *(f"{statistics.median(took[name, e]):.1f} ({min(took[name, e]):.1f})" for e in whole))
    late = [n for n in R.FIGURES if n not in R.EARLY_FIGURES]
    print()
    for e in whole:
        slowest = max(late, key=lambda n: statistics.median(took[n, e]))
        print(f"slowest late figure, {e}: {slowest}, {statistics.median(took[slowest, e]):.1f} ms median "
              f"({min(took[slowest, e]):.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

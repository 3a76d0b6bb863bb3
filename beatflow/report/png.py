"""The report's figures as PNG files: a Matplotlib figure drawn by Agg and written by Pillow.

RGB, not the RGBA of Matplotlib's ``savefig``: the figures are opaque (a white face), so the alpha carries
nothing. zlib at level 1, each row's filter Pillow's own (adaptive) choice: Pillow's default level, 6 (what
``savefig`` writes), took 100-101 against 64-65 ms on the nine figures of a report (RGBA), for files 6 % smaller.

Pillow, not a hand-written encoder (rows by PNG's "Up" filter in NumPy, or unfiltered for the latent figures'
scattered pixels, zlib level 1), though that one is faster: on the nine figures of a report, 38-39 against
52-53 ms of encoding in all (the latent figures 4.6-4.8 and 3.3 against 10.2-10.4 and 7.0 ms, the others
within 20 %), 547 against 602 kB of files. In the report's total that gain is small: the figures whole
(built, drawn and encoded) 324-338 against 336-350 ms in all, and the slowest of the late figures, which the
report waits for (the latent space's), 45-48 against 51-54 ms (``bench/results/report.md``: ``python
bench/png_times.py``, 2 cores, two runs).
"""

from __future__ import annotations

import base64
import io
import struct

__all__ = ["figure_png", "png_bytes", "png_width"]


def png_bytes(rgba) -> bytes:
    """An opaque RGBA image (``(h, w, 4)`` uint8, C-contiguous, as Agg's buffer) as an RGB PNG at zlib
    level 1."""
    from PIL import Image  # noqa: PLC0415

    h, w = rgba.shape[:2]
    img = Image.frombuffer("RGBA", (w, h), rgba, "raw", "RGBA", 0, 1).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def figure_png(fig) -> str:
    """``fig`` drawn by Agg and written as an RGB PNG (:func:`png_bytes`), base64."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return base64.b64encode(png_bytes(canvas.buffer_rgba())).decode("ascii")


def png_width(b64: str) -> int:
    """The width in pixels of a base64 PNG: its header's (the IHDR chunk first, the width at bytes 16-19).
    Read here, not by Pillow: the page needs nothing else of the file, and in the flow's process (which
    draws no figure) importing Pillow took 28 ms (2 cores)."""
    return struct.unpack(">I", base64.b64decode(b64[:32])[16:20])[0]

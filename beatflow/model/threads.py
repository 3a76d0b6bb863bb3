"""PyTorch's intra-op threads, set for a while: shared by the trainer, the reference scorer and the engines."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int):
    """Temporarily ``torch.set_num_threads(n)`` (process-wide; restored after). Eager PyTorch on
    tiny-channel convolutions is as fast on one thread on a quiet machine and 10-30x faster on a
    busy one (OpenMP barriers); used for the reference scores and for export tracing."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)

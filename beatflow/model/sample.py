"""The training sample: which beats the LightVAE trains on (NumPy only: the flow's process, which imports no
PyTorch, chooses them)."""
from __future__ import annotations

import numpy as np


def training_sample(counts, n: int | None) -> np.ndarray:
    """Rows of a stacked beat matrix to train on: at most ``n`` (None: all), stratified by recording and
    over time.

    ``counts``: the rows of each recording, in the order they are stacked. Each recording gets a share of
    ``n`` in proportion to its rows (its own rows where it has fewer; what those leave goes to the others),
    taken evenly spaced over its rows, so that every stretch of every recording is seen: one busy hour
    cannot fill the sample. Returns sorted int64 indices into the stacked rows."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if n is None or n >= total:
        return np.arange(total, dtype=np.int64)
    n = max(0, int(n))
    take = np.zeros(len(counts), np.int64)
    left, open_ = n, counts > 0
    while left > 0 and open_.any():  # (proportional shares; a recording that fills up gives the rest back)
        share = np.floor(left * counts * open_ / max(1, int((counts * open_).sum()))).astype(np.int64)
        share[open_ & (share == 0)] = 1
        share = np.minimum(share, counts - take)
        if share.sum() > left:  # (the ones of tiny shares: as many as there is room for, largest first)
            order = np.argsort(-counts * open_, kind="stable")
            cum = np.cumsum(share[order])
            share[order[cum > left]] = 0
        take += share
        left -= int(share.sum())
        open_ = take < counts
        if share.sum() == 0:
            break
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    parts = [a + np.unique(np.round(np.linspace(0, c - 1, k)).astype(np.int64)) if k else np.zeros(0, np.int64)
             for a, c, k in zip(starts, counts, take)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)

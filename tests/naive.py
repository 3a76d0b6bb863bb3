"""Slow, obviously-correct reference implementations (plain loops) of the fast code."""
from __future__ import annotations

import math

import numpy as np


def ricker(points: int, a: float) -> np.ndarray:
    w = np.empty(points)
    amp = 2.0 / (math.sqrt(3.0 * a) * math.pi**0.25)
    for i in range(points):
        t = i - (points - 1) / 2.0
        w[i] = amp * (1.0 - (t / a) ** 2) * math.exp(-(t * t) / (2.0 * a * a))
    return w - w.sum() / points


def convolve_same_edge(x, kernel) -> np.ndarray:
    """Direct convolution, output aligned with x, ends padded with the edge values."""
    n, k = len(x), len(kernel)
    half = k // 2
    out = np.zeros(n)
    for i in range(n):
        acc = 0.0
        for j in range(k):
            src = min(max(i + half - j, 0), n - 1)
            acc += float(x[src]) * kernel[j]
        out[i] = acc
    return out


def local_maxima(env, half: int) -> np.ndarray:
    out = []
    for i in range(len(env)):
        lo, hi = max(0, i - half), min(len(env), i + half + 1)
        if env[i] > 0 and env[i] == max(env[lo:hi]):
            out.append(i)
    return np.asarray(out, dtype=np.int64)


def block_amplitude(env, first: int, block: int, blocks: int):
    """Median over ±blocks of stream-aligned block maxima; returns a dict global block -> amplitude."""
    maxima = {}
    for i, v in enumerate(env):
        b = (first + i) // block
        maxima[b] = max(maxima.get(b, -np.inf), v)
    amp = {}
    for b in maxima:
        vals = [maxima[c] for c in range(b - blocks, b + blocks + 1) if c in maxima]
        amp[b] = float(np.median(vals))
    return amp


def drop_refractory(peaks, heights, refractory: int) -> np.ndarray:
    drop = set()
    for i in range(len(peaks) - 1):
        if peaks[i + 1] - peaks[i] < refractory:
            drop.add(i if heights[i] < heights[i + 1] else i + 1)
    return np.asarray([p for i, p in enumerate(peaks) if i not in drop], dtype=np.int64)


def detect_peaks(x, s, first: int = 0) -> np.ndarray:
    """The whole segmentation, by loops."""
    env = np.abs(convolve_same_edge(np.asarray(x, dtype=np.float64), ricker(s.kernel, s.a)))
    cand = local_maxima(env, s.nms)
    amp = block_amplitude(env, first, s.block, s.blocks)
    floor = 1e-5 * float(np.abs(x).max())
    kept = [c for c in cand if env[c] > s.ratio * amp[(c + first) // s.block] and env[c] > floor]
    return drop_refractory(np.asarray(kept, dtype=np.int64), env[kept] if kept else np.zeros(0), s.refractory) + first


def embed(x, start, length, width: int, baseline_samples: int = 0):
    rows = np.zeros((len(start), width), dtype=np.float32)
    p2p = np.zeros(len(start), dtype=np.float32)
    for r, (st, ln) in enumerate(zip(start, length)):
        vals = [float(np.float32(x[st + j])) for j in range(ln)]
        base = sum(vals[:baseline_samples]) / baseline_samples if baseline_samples else 0.0
        for j in range(ln):
            rows[r, j] = vals[j] - base
        p2p[r] = max(rows[r, :ln]) - min(rows[r, :ln])
    return rows, p2p


def match_count(detected, reference, tol: int) -> int:
    """Maximum one-to-one matching size (brute force over a small bipartite graph via augmenting paths)."""
    adj = [[j for j, d in enumerate(detected) if abs(d - r) <= tol] for r in reference]
    owner = {}

    def augment(i, seen):
        for j in adj[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = i
                return True
        return False

    return sum(augment(i, set()) for i in range(len(reference)))

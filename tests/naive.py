"""Slow, obviously-correct reference implementations (plain loops) of the fast code."""
from __future__ import annotations

import math

import numpy as np


def gaussian_derivative(points: int, sigma: float) -> np.ndarray:
    t = [i - (points - 1) / 2.0 for i in range(points)]
    g = [math.exp(-(u * u) / (2.0 * sigma * sigma)) for u in t]
    norm = sum(u * u * v for u, v in zip(t, g))
    return np.asarray([-u * v / norm for u, v in zip(t, g)])


def despike(x) -> np.ndarray:
    """3-point median; beyond each end the neighbour is mirrored."""
    x = [float(v) for v in x]
    n = len(x)
    if n < 3:
        return np.asarray(x, dtype=np.float64)
    out = []
    for i in range(n):
        left = x[i - 1] if i > 0 else x[1]
        right = x[i + 1] if i < n - 1 else x[n - 2]
        out.append(sorted([left, x[i], right])[1])
    return np.asarray(out)


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


def wavelet_response(x, s) -> np.ndarray:
    return convolve_same_edge(despike(x), gaussian_derivative(s.kernel, s.a))


def energy_envelope(y, box: int) -> np.ndarray:
    """RMS over a centred window of ``box`` samples, the ends repeating the edge values."""
    n, half = len(y), box // 2
    out = np.zeros(n)
    for i in range(n):
        acc = 0.0
        for j in range(i - half, i + half + 1):
            v = y[min(max(j, 0), n - 1)]
            acc += v * v
        out[i] = math.sqrt(max(acc / box, 0.0))
    return out


def slope_envelope(x, s) -> np.ndarray:
    d = np.abs(convolve_same_edge(despike(x), gaussian_derivative(s.fine_kernel, s.fine_a)))
    n = len(d)
    return np.asarray([max(d[max(0, i - s.slope_half):min(n, i + s.slope_half + 1)]) for i in range(n)])


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


def t_wave_mask(peaks, slopes, window: int, ratio: float) -> np.ndarray:
    out = [False] * len(peaks)
    for i in range(1, len(peaks)):
        out[i] = peaks[i] - peaks[i - 1] < window and slopes[i] < ratio * slopes[i - 1]
    return np.asarray(out, dtype=bool)


def mean_rr(beats, at: int, window: int) -> float:
    inside = [b for b in beats if at - window <= b <= at + window]
    if len(inside) < 3:
        return float("nan")
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def search_back(beats, beat_slopes, cand, cand_slopes, cand_heights, s, length=None) -> np.ndarray:
    """``length``: the stream's ends (samples 0 and length - 1) bound a gap as beats do."""
    ok = []
    for c, sl in zip(cand, cand_slopes):
        before = [k for k, b in enumerate(beats) if b < c]
        after = [b for b in beats if b >= c]
        prev = beats[before[-1]] if before else None
        if prev is not None:
            dp = min(c - prev, s.max_gap)
        else:
            dp = s.max_gap if length is None else min(c, s.max_gap)
        if after:
            dn = min(after[0] - c, s.max_gap)
        else:
            dn = s.max_gap if length is None else min(length - 1 - c, s.max_gap)
        prev_slope = beat_slopes[before[-1]] if before and c - prev <= s.max_gap else 0.0
        rr = mean_rr(beats, c, s.rr_window) if len(beats) >= 2 else float("nan")
        ok.append(bool(dp + dn > s.searchback * rr and dp > s.margin * rr and dn > s.margin * rr
                       and sl >= s.twave_slope * prev_slope))
    chosen = [k for k in range(len(cand)) if ok[k]]
    for a, b in zip(chosen[:-1], chosen[1:]):
        if cand[b] - cand[a] < s.twave:
            ok[a if cand_heights[a] < cand_heights[b] else b] = False
    return np.asarray(ok, dtype=bool)


def noise_mask(env, cand, heights, level, slopes, s) -> np.ndarray:
    """Peaks of noise bursts: no quiet envelope within ±nms on either side, spiky, not tall."""
    out = []
    for c, h, lv, sl in zip(cand, heights, level, slopes):
        left = min(env[max(0, c - s.nms):c + 1])
        right = min(env[c:c + s.nms + 1])
        out.append(bool(min(left, right) > s.noise_valley * h and sl > s.noise_slope * h and h < s.noise_level * lv))
    return np.asarray(out, dtype=bool)


def detect_peaks(x, s, first: int = 0, vf: bool = False) -> np.ndarray:
    """The whole segmentation, by loops (with ``vf``: and the flutter rule of :func:`flutter_keep_mask`,
    as ``beatflow.detect.detect_peaks`` applies it after either backend's detection); with
    ``s.fast_nms > 0`` the fast-rhythm candidates (maxima over ``±fast_nms`` that are none over
    ``±nms``, where the strong beats' mean RR within ``±fast_window`` is below ``fast_rr``, and, with
    ``fast_dip < 1``, the envelope falls to ``fast_dip`` × their height on both sides) join the
    candidates of a second pass of the decisions."""
    n = len(x)
    env = energy_envelope(wavelet_response(x, s), s.box)
    slopes = slope_envelope(x, s)
    amp = block_amplitude(env, first, s.block, s.blocks)
    floor = 1e-7 * float(np.abs(x).max())

    def decide(cand):
        cand = [c for c in cand if s.edge <= c < n - s.edge]
        level = {c: amp[(c + first) // s.block] for c in cand}
        cand = [c for c in cand if env[c] > s.weak_ratio * level[c] and env[c] > floor]
        noisy = noise_mask(env, cand, [env[c] for c in cand], [level[c] for c in cand], [slopes[c] for c in cand], s)
        cand = [c for c, z in zip(cand, noisy) if not z]
        strong = [c for c in cand if env[c] > s.ratio * level[c]]
        weak = [c for c in cand if env[c] <= s.ratio * level[c]]
        t_like = t_wave_mask(strong, [slopes[c] for c in strong], s.twave, s.twave_slope)
        strong = [c for c, t in zip(strong, t_like) if not t]
        strong = [int(c) for c in drop_refractory(np.asarray(strong, dtype=np.int64), [env[c] for c in strong],
                                                  s.refractory)]
        added = search_back(strong, [slopes[c] for c in strong], weak, [slopes[c] for c in weak],
                            [env[c] for c in weak], s, length=n)
        return strong, sorted(strong + [c for c, a in zip(weak, added) if a])

    wide = [int(c) for c in local_maxima(env, s.nms)]
    strong, peaks = decide(wide)
    if s.fast_nms > 0:
        extra = [int(c) for c in local_maxima(env, s.fast_nms)
                 if int(c) not in wide and mean_rr(strong, int(c), s.fast_window) < s.fast_rr]
        if s.fast_dip < 1.0:  # a peak of its own: the envelope falls on both sides within ±fast_nms
            extra = [c for c in extra if max(min(env[max(0, c - s.fast_nms):c + 1]),
                                             min(env[c:c + s.fast_nms + 1])) <= s.fast_dip * env[c]]
        if extra:
            peaks = decide(sorted(wide + extra))[1]
    peaks = np.asarray(peaks, dtype=np.int64) + first
    if vf:
        peaks = peaks[flutter_keep_mask(x, peaks, first, s)]
    return peaks


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


def flutter_keep_mask(x, peaks, first: int, s) -> np.ndarray:
    """Ventricular flutter rule (``beatflow.detect.rhythm``) by loops over windows and peaks."""
    peaks = [int(p) for p in peaks]
    n, W, c, L = len(x), s.vf_window, s.vf_context, max(1, s.vf_runs)
    if not peaks or n == 0 or not s.vf_baseline > 0:
        return np.ones(len(peaks), dtype=bool)
    xd = despike(x)
    half = s.vf_highpass // 2
    high = np.asarray([xd[i] - sum(xd[min(max(j, 0), n - 1)] for j in range(i - half, i + half + 1)) / s.vf_highpass
                       for i in range(n)])
    slope = wavelet_response(x, s)
    w0 = first // W
    nw = -(-(first + n) // W) - w0
    near, e0, e1 = [], [], []
    for k in range(nw):  # window w0 + k, its samples outside x repeat x's first or last one
        idx = [min(max((w0 + k) * W + i - first, 0), n - 1) for i in range(W)]
        h, d = high[idx], slope[idx]
        med, rng = np.median(h), np.percentile(h, 97.0) - np.percentile(h, 3.0)
        near.append(sum(1 for v in h if abs(v - med) < s.vf_tol * rng) / float(W))
        e0.append(float(np.sum(h * h)))
        e1.append(float(np.sum(d * d)))
    like = []
    for k in range(nw):
        base, es, ed, cnt = 0.0, 0.0, 0.0, 0.0
        for j in range(k - c, k + c + 1):
            if 0 <= j < nw:
                base += near[j]
                es += e0[j]
                ed += e1[j]
                cnt += 1.0
        like.append(base / cnt < s.vf_baseline and ed < s.vf_omega ** 2 * es)
    episode = [False] * nw
    for j in range(nw - L + 1):
        if all(like[j:j + L]):
            for k in range(j, j + L):
                episode[k] = True
    return np.asarray([not episode[p // W - w0] for p in peaks], dtype=bool)


def _lead_windows(x, s):
    """Per window of a whole recording: (near-median fraction, signal energy, slope energy) by loops."""
    n, W = len(x), s.vf_window
    xd = despike(x)
    half = s.vf_highpass // 2
    high = np.asarray([xd[i] - sum(xd[min(max(j, 0), n - 1)] for j in range(i - half, i + half + 1)) / s.vf_highpass
                       for i in range(n)])
    slope = wavelet_response(x, s)
    out = []
    for k in range(-(-n // W)):
        idx = [min(k * W + i, n - 1) for i in range(W)]
        h, d = high[idx], slope[idx]
        med, rng = np.median(h), np.percentile(h, 97.0) - np.percentile(h, 3.0)
        out.append((sum(1 for v in h if abs(v - med) < s.vf_tol * rng) / float(W), float(np.sum(h * h)),
                    float(np.sum(d * d))))
    return out


def second_lead_keep(x0, x1, peaks, fs: float, s, p) -> np.ndarray:
    """``beatflow.detect.second_lead_keep`` by loops: the flutter rule on either lead, then the
    doubtful-peak rule, peak by peak."""
    peaks = [int(q) for q in peaks]
    n, W, c, L = len(x0), s.vf_window, s.vf_context, max(1, s.vf_runs)
    keep = [True] * len(peaks)
    if p.flutter_baseline_ratio > 0 and s.vf_baseline > 0:
        f0, f1 = _lead_windows(x0, s), _lead_windows(x1, s)
        nw = len(f0)
        omega1 = 2.0 * math.pi * p.flutter_max_freq_hz / fs
        like = []
        for k in range(nw):
            sums = np.zeros((2, 3))
            cnt = 0
            for j in range(max(0, k - c), min(nw, k + c + 1)):
                sums += np.asarray([f0[j], f1[j]])
                cnt += 1
            b0, b1 = sums[0, 0] / cnt, sums[1, 0] / cnt
            like.append((sums[0, 2] < s.vf_omega ** 2 * sums[0, 1] and b0 < s.vf_baseline)
                        or (sums[1, 2] < omega1 ** 2 * sums[1, 1] and b1 < p.flutter_baseline_ratio
                            and b0 < p.flutter_gate_ratio))
        episode = [False] * nw
        for j in range(nw - L + 1):
            if all(like[j:j + L]):
                episode[j:j + L] = [True] * L
        keep = [not episode[min(q // W, nw - 1)] for q in peaks]
    if p.weak_ratio > 0:
        env0, env1 = (energy_envelope(wavelet_response(x, s), s.box) for x in (x0, x1))
        reach, k = int(round(p.reach_s * fs)), p.neighbours
        rest = [q for q, ok in zip(peaks, keep) if ok]
        h0 = [env0[q] for q in rest]
        h1 = [max(env1[max(0, q - reach):q + reach + 1]) for q in rest]
        doubt = set()
        for i, q in enumerate(rest):
            nb = [j for j in range(i - k, i + k + 1) if j != i and 0 <= j < len(rest)]
            if not nb:
                continue
            med0 = np.median([h0[j] for j in nb])
            q25, med1 = np.quantile([h1[j] for j in nb], 0.25), np.median([h1[j] for j in nb])
            w = q // W
            window = [env1[min(w * W + i, n - 1)] for i in range(W)]
            background = max(float(np.median(window)), 1e-12)
            weak = h0[i] / med0 if med0 > 0 else math.inf
            quiet = h1[i] / q25 if q25 > 0 else math.inf
            if weak < p.weak_ratio and quiet < p.quiet_ratio and med1 / background > p.quality_ratio:
                doubt.add(q)
        keep = [ok and q not in doubt for q, ok in zip(peaks, keep)]
    return np.asarray(keep, dtype=bool)


def second_lead_peaks(x0, x1, peaks, fs: float, s, p) -> np.ndarray:
    """``beatflow.detect.second_lead_peaks`` by loops: rules 1 and 2 (:func:`second_lead_keep`), then
    rule 3 peak by peak (a peak moves to the second lead's largest envelope maximum 0.15-0.4 s away)."""
    rest = [int(q) for q, ok in zip(peaks, second_lead_keep(x0, x1, peaks, fs, s, p)) if ok]
    if not (p.move_quiet_ratio > 0 and rest):
        return np.asarray(rest, dtype=np.int64)
    n, W = len(x0), s.vf_window
    env0, env1 = (energy_envelope(wavelet_response(x, s), s.box) for x in (x0, x1))
    reach, k = int(round(p.reach_s * fs)), p.neighbours
    lo_r, hi_r = max(1, int(round(p.move_min_s * fs))), max(1, int(round(p.move_max_s * fs)))

    def is_maximum(i):  # equals the envelope's max over ±reach, and rises into it (a plateau's first sample)
        return (env1[i] >= max(env1[max(0, i - reach):i + reach + 1])) and (i == 0 or env1[i] > env1[i - 1])

    h1 = [max(env1[max(0, q - reach):q + reach + 1]) for q in rest]
    target = []
    for i, q in enumerate(rest):
        best, at = -math.inf, -1
        for j in range(q - hi_r, q + hi_r + 1):
            if lo_r <= abs(j - q) and 0 <= j < n and is_maximum(j) and env1[j] > best:
                best, at = float(env1[j]), j
        nb = [h1[j] for j in range(i - k, i + k + 1) if j != i and 0 <= j < len(rest)]
        if at < 0 or not nb:
            target.append(None)
            continue
        q25, med1 = np.quantile(nb, 0.25), np.median(nb)
        w = q // W
        background = max(float(np.median([env1[min(w * W + j, n - 1)] for j in range(W)])), 1e-12)
        ok = (med1 / background > p.quality_ratio and (h1[i] / q25 if q25 > 0 else math.inf) < p.move_quiet_ratio
              and (best / med1 if med1 > 0 else math.inf) > p.move_found_ratio
              and env0[at] / env0[q] > p.move_first_ratio)
        target.append(at if ok else None)

    def apart(i, at, moved_too):  # far enough behind the previous peak and before the next, where each stands
        for j, side in ((i - 1, -1), (i + 1, 1)):
            if 0 <= j < len(rest):
                where = [rest[j]] + ([target[j]] if moved_too and target[j] is not None else [])
                limit = s.twave if side < 0 else s.refractory
                if any(abs(at - w) <= limit or (w > at) != (side > 0) for w in where):
                    return False
        return True

    target = [t if t is not None and apart(i, t, False) else None for i, t in enumerate(target)]
    final = [t if t is not None and apart(i, t, True) else None for i, t in enumerate(target)]
    return np.asarray([t if t is not None else q for q, t in zip(rest, final)], dtype=np.int64)


def imported(names) -> dict:
    """Which of ``names`` this process has imported (a job for the flow's figure processes)."""
    import sys

    return {n: n in sys.modules for n in names}


def slow_in_child(value, seconds: float):
    """``value``, after ``seconds`` when run in a child process (a figure process's job that is still
    running when its process is killed); at once in the main process."""
    import multiprocessing
    import time

    if multiprocessing.parent_process() is not None:
        time.sleep(seconds)
    return value


def best_aligned_corr(row, ref, a: int, b: int, lag: int) -> tuple[float, int]:
    """Largest Pearson correlation of ``row[a+l:b+l]`` with ``ref[a:b]`` over ``-lag <= l <= lag``
    (the first such ``l`` on ties), by ``np.corrcoef`` one lag at a time."""
    best, at = -2.0, 0
    for l in range(-lag, lag + 1):
        w = np.asarray(row[a + l : b + l], np.float64)
        d = np.asarray(ref[a:b], np.float64)
        c = float(np.corrcoef(w, d)[0, 1]) if w.std() > 0 and d.std() > 0 else 0.0
        if c > best + 1e-6:
            best, at = c, l
    return best, at


def beat_timing(peaks, at, fs: float, k: int, m: int) -> list[dict]:
    """Per beat at peak ``at[i]``: RR before/after, the median of the ``k`` intervals either side but its own
    two, and the irregularity (median |successive difference| over median) of the ``m`` either side."""
    peaks = [int(p) for p in peaks]
    rr = [(peaks[j + 1] - peaks[j]) / fs for j in range(len(peaks) - 1)]
    out = []
    for p in at:
        i = peaks.index(int(p))
        prev = rr[i - 1] if i > 0 else math.nan
        nxt = rr[i] if i < len(rr) else math.nan

        def around(h):
            idx = list(range(i - 1 - h, i - 1)) + list(range(i + 1, i + 1 + h))
            return [rr[j] if 0 <= j < len(rr) else math.nan for j in idx]

        near = around(k)
        vals = [v for v in near if not math.isnan(v)]
        local = float(np.median(vals)) if vals else math.nan
        w = around(m)
        diffs = [abs(w[j + 1] - w[j]) for j in range(len(w) - 1) if not (math.isnan(w[j]) or math.isnan(w[j + 1]))]
        wv = [v for v in w if not math.isnan(v)]
        irr = float(np.median(diffs)) / float(np.median(wv)) if diffs and wv else math.nan
        out.append({"rr_prev_s": prev, "rr_next_s": nxt, "local_rr_s": local, "irregularity": irr,
                    "prematurity": 1 - prev / local, "pause": nxt / local})
    return out

def quality_features(x, first: int, q):
    """The signal quality's window measures (:func:`beatflow.detect.quality.window_features`) as loops:
    per stream-aligned window, over its samples inside ``x``, the high-pass (minus the mean of the
    ``q.highpass`` samples around, ends repeated) and the Gaussian low-pass's residue computed sample by
    sample."""
    x = np.asarray(x, np.float64)
    n, W, hp = x.shape[0], q.window, q.highpass
    r = max(1, int(math.ceil(4.0 * q.hf_sigma)))
    g = [math.exp(-0.5 * (t / q.hf_sigma) ** 2) for t in range(-r, r + 1)]
    g = [v / sum(g) for v in g]
    at = lambda i: float(x[min(max(i, 0), n - 1)])  # noqa: E731
    w0 = first // W
    nw = -(-(first - w0 * W + n) // W)
    out = [np.zeros(nw) for _ in range(4)]
    for k in range(nw):
        idx = [i for i in range((w0 + k) * W - first, (w0 + k + 1) * W - first) if 0 <= i < n]
        v = [at(i) for i in idx]
        h = [at(i) - sum(at(i + j) for j in range(-(hp // 2), hp // 2 + 1)) / hp for i in idx]
        f = [at(i) - sum(g[j + r] * at(i + j) for j in range(-r, r + 1)) for i in idx]
        hi, lo, m = max(v), min(v), len(v)
        steps = [abs(b - a) for a, b in zip(v[:-1], v[1:]) if b != a]
        out[0][k] = (hi - lo) / min(steps) if steps else 0.0
        out[1][k] = (sum(1 for u in v if u == hi) + sum(1 for u in v if u == lo)) / m
        mean = sum(h) / m
        m2 = sum((u - mean) ** 2 for u in h)
        m4 = sum((u - mean) ** 4 for u in h)
        out[2][k] = m * m4 / (m2 * m2) if m2 > 0 else 0.0
        e_high = sum(u * u for u in h)
        out[3][k] = sum(u * u for u in f) / e_high if e_high > 0 else 0.0
    return (*out, w0)


def pre_qrs(x, x0: int, peaks, fs: float, before_s: float, after_s: float) -> np.ndarray:
    """The window ``x[peak - before : peak - after]`` of each peak (global samples, ``x`` starting at ``x0``),
    an index past either end taking the end sample, one sample at a time."""
    a, b = int(round(before_s * fs)), int(round(after_s * fs))
    out = np.zeros((len(peaks), a - b), np.float32)
    for i, pk in enumerate(peaks):
        for j in range(a - b):
            out[i, j] = x[min(max(int(pk) - int(x0) - a + j, 0), len(x) - 1)]
    return out


def p_deviation(windows, dominant) -> np.ndarray:
    """One minus ``np.corrcoef`` of each window with the elementwise median of the dominant windows (each
    window's mean removed first), one window at a time."""
    w = [np.asarray(r, np.float64) - np.mean(r) for r in windows]
    ref = np.median(np.stack([r for r, d in zip(w, dominant) if d]), axis=0)
    return np.asarray([1.0 - (float(np.corrcoef(r, ref)[0, 1]) if r.std() > 0 else 0.0) for r in w])


def long_rr(peaks, at, fs: float, beats: int) -> np.ndarray:
    """The larger of the medians of the ``beats`` (made odd) intervals before a beat's own two and of the
    ``beats`` after them (the intervals' ends repeated where a window runs past them; centred windows clipped
    to the ends), one beat at a time."""
    rr = np.diff(np.asarray(peaks, np.int64)) / fs
    h = beats // 2
    pad = np.concatenate([np.full(h, rr[0]), rr, np.full(h, rr[-1])])
    out = []
    for q in at:
        i = int(np.searchsorted(peaks, q))
        b = min(max(i - 2 - h, 0), len(rr) - 1)
        a = min(max(i + 1 + h, 0), len(rr) - 1)
        out.append(max(np.median(pad[b : b + 2 * h + 1]), np.median(pad[a : a + 2 * h + 1])))
    return np.asarray(out)


def qrs_width(win, fs: float, k: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """The time (s) between the points where a window's cumulative absolute difference over ``k`` samples crosses
    ``lo`` and ``hi`` of its total, linearly interpolated, one sample at a time (0 for a flat window)."""
    w = [float(v) for v in win]
    cum = [0.0]
    for j in range(k, len(w)):
        cum.append(cum[-1] + abs(w[j] - w[j - k]))
    total = cum[-1]
    if total <= 0:
        return 0.0

    def crossing(q):
        for i in range(1, len(cum)):
            if cum[i] / total >= q:
                a, b = cum[i - 1] / total, cum[i] / total
                return i - 1 + (q - a) / max(b - a, 1e-12)
        return len(cum) - 2 + 1.0

    return (crossing(hi) - crossing(lo)) / fs

from collections import Counter

import numpy as np
import pytest

import naive
import beatflow.detect as D
from beatflow.detect import peaks as S
from beatflow.detect import rhythm as R
from beatflow.params import SegmentParams
from beatflow.embed.partitions import assemble_halos, edges, plan_beats, segment_partition
from beatflow.io.sources import PartitionSpec, _split_even

S250 = SegmentParams().samples(250.0)


def small_params(**kw):
    base = dict(wavelet_width_s=0.02, energy_window_s=0.05, slope_width_s=0.01, slope_window_s=0.03,
                nms_half_window_s=0.04, refractory_s=0.06, block_s=0.1, threshold_blocks=2, twave_window_s=0.1,
                rr_window_s=0.8, max_gap_s=0.6, edge_s=0.03, pre_peak_s=0.02, min_length_s=0.1,
                max_length_s=0.3)
    base.update(kw)
    return SegmentParams(**base).samples(100.0)


def test_gaussian_derivative_matches_formula_and_measures_slope():
    k = S.gaussian_derivative(25, 3.0)
    np.testing.assert_allclose(k, naive.gaussian_derivative(25, 3.0), atol=1e-12)
    assert abs(k.sum()) < 1e-12
    np.testing.assert_allclose(k, -k[::-1], atol=1e-15)  # antisymmetric
    ramp = np.arange(100, dtype=np.float64) * 0.5
    np.testing.assert_allclose(np.convolve(ramp, k, mode="valid"), 0.5, atol=1e-12)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 57])
def test_despike_matches_loop(n):
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    np.testing.assert_array_equal(S.despike(x), naive.despike(x))


def test_despike_removes_single_sample_glitches_only():
    x = np.zeros(50)
    x[10] = 5.0  # one-sample glitch
    x[30:33] = 5.0  # three samples: a (tiny) complex
    y = S.despike(x)
    assert y[10] == 0 and (y[30:33] == 5).all()
    x[-1] = -9.0  # truncated last sample
    assert S.despike(x)[-1] == 0


@pytest.mark.parametrize("n", [1, 7, 60, 257])
def test_wavelet_response_matches_direct_convolution(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=n).astype(np.float32) + 3.0
    s = small_params()
    np.testing.assert_allclose(S.wavelet_response(x, s), naive.wavelet_response(x, s), atol=1e-9)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 60, 257])
def test_envelopes_match_loops(n):
    rng = np.random.default_rng(n + 1)
    x = rng.normal(size=n).astype(np.float32)
    s = small_params()
    y = S.wavelet_response(x, s)
    want = naive.energy_envelope(y, s.box)
    np.testing.assert_allclose(S.energy_envelope(y, s), want, atol=1e-9)
    np.testing.assert_allclose(D.qrs_envelope(x, s), want, atol=1e-9)  # the fused CPU kernel
    np.testing.assert_allclose(S.qrs_envelope_xp(x, s), want, atol=1e-9)  # the array code
    slopes = naive.slope_envelope(x, s)
    at = np.arange(n, dtype=np.int64)
    np.testing.assert_allclose(D.steepest_at(x, at, s), slopes, atol=1e-9)  # the CPU kernel
    np.testing.assert_allclose(S.steepest_at_xp(x, at, s), slopes, atol=1e-9)  # the array code (GPU path)


@pytest.mark.parametrize("fs", [250.0, 360.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_envelope_matches_array_code_across_chunks(fs, dtype):
    """Long enough for many chunks of the CPU kernel, and the seed's real window sizes."""
    from beatflow.detect.cpu import _CHUNK

    s = SegmentParams().samples(fs)
    rng = np.random.default_rng(int(fs))
    n = 3 * _CHUNK + 123
    x = (np.cumsum(rng.normal(size=n)) * 0.01 + rng.normal(size=n)).astype(dtype)
    want = S.energy_envelope(S.wavelet_response(x, s), s)
    got = D.qrs_envelope(x, s)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12 * float(want.max()))
    # each sample's value does not depend on where the stream starts (partitions agree bit for bit)
    np.testing.assert_array_equal(D.qrs_envelope(x[777:], s)[500:-500], got[777:][500:-500])
    at = np.sort(rng.integers(0, n, 300))
    np.testing.assert_allclose(D.steepest_at(x, at, s), S.steepest_at_xp(x, at, s), rtol=1e-12, atol=1e-12)


def test_constant_and_baseline_have_no_response():
    s = small_params()
    assert np.abs(S.wavelet_response(np.full(500, 7.5, np.float32), s)).max() < 1e-9
    ramp = np.linspace(0.0, 1.0, 500)  # slow drift: a constant slope, far below any QRS
    assert np.abs(S.wavelet_response(ramp, s)[20:-20] - 1 / 499).max() < 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_local_maxima_match_loop(seed):
    rng = np.random.default_rng(seed)
    env = np.abs(rng.normal(size=400))
    env[rng.integers(0, 400, 20)] = 0.5  # ties
    env[100:110] = 3.0  # a plateau: every sample of it is a maximum
    for half in (1, 3, 8, 500):
        want = naive.local_maxima(env, half)
        np.testing.assert_array_equal(D.local_maxima(env, half), want)  # the CPU kernel
        np.testing.assert_array_equal(S.local_maxima_xp(env, half), want)  # the array code


def test_local_maxima_match_scipy_moving_maximum():
    from scipy.ndimage import maximum_filter1d

    env = np.abs(np.random.default_rng(3).normal(size=200_000)).round(2)  # many ties
    env[:50] = 0.0
    for half in (2, 58):
        m = maximum_filter1d(env, 2 * half + 1, mode="nearest")
        np.testing.assert_array_equal(D.local_maxima(env, half), np.flatnonzero((env == m) & (env > 0)))


@pytest.mark.parametrize("first", [0, 3, 17, 250])
def test_block_amplitude_matches_loop(first):
    rng = np.random.default_rng(first)
    env = np.abs(rng.normal(size=333))
    s = small_params()
    amp, b0 = S.block_amplitude(env, first, s)
    want = naive.block_amplitude(env, first, s.block, s.blocks)
    assert b0 == first // s.block
    np.testing.assert_allclose(amp, [want[b0 + k] for k in range(len(amp))])


def test_drop_refractory_matches_loop():
    rng = np.random.default_rng(1)
    peaks = np.cumsum(rng.integers(1, 12, 200))
    h = rng.random(200)
    np.testing.assert_array_equal(S.drop_refractory(peaks, h, 6), naive.drop_refractory(peaks, h, 6))
    assert S.drop_refractory(peaks[:1], h[:1], 6).tolist() == peaks[:1].tolist()


@pytest.mark.parametrize("seed", range(3))
def test_t_wave_mask_matches_loop(seed):
    rng = np.random.default_rng(seed)
    peaks = np.cumsum(rng.integers(1, 20, 300))
    slopes = rng.random(300)
    for window, ratio in ((5, 0.5), (12, 0.3), (30, 1.0)):
        np.testing.assert_array_equal(S.t_wave_mask(peaks, slopes, window, ratio),
                                      naive.t_wave_mask(peaks, slopes, window, ratio))


@pytest.mark.parametrize("seed", range(6))
def test_mean_rr_and_search_back_match_loops(seed):
    rng = np.random.default_rng(seed)
    s = small_params()
    # beats every ~0.3 s with random holes (missed beats), candidates anywhere
    beats = np.sort(rng.choice(np.arange(0, 3000, 30), size=70, replace=False) + rng.integers(-3, 4, 70))
    beats = np.unique(beats)
    cand = np.setdiff1d(rng.integers(0, 3000, 150), beats)
    bs, cs, ch = rng.random(len(beats)), rng.random(len(cand)), rng.random(len(cand))
    np.testing.assert_array_equal(
        S.mean_rr(beats, cand, s.rr_window), [naive.mean_rr(list(beats), c, s.rr_window) for c in cand])
    got = S.search_back(beats, bs, cand, cs, ch, s)
    np.testing.assert_array_equal(got, naive.search_back(list(beats), list(bs), list(cand), list(cs), list(ch), s))
    assert got.any() and not got.all()
    for length in (3000, 3005, 3200):  # the stream's ends bound the first and the last gap
        np.testing.assert_array_equal(
            S.search_back(beats, bs, cand, cs, ch, s, length=length),
            naive.search_back(list(beats), list(bs), list(cand), list(cs), list(ch), s, length=length))
    none = S.search_back(beats[:1], bs[:1], cand, cs, ch, s)
    assert not none.any()


def test_search_back_finds_a_small_beat_in_a_gap():
    s = SegmentParams().samples(250.0)
    beats = np.arange(0, 250 * 20, 250)  # 1 beat/s
    beats = beats[beats != 2500]  # missed at 10 s
    cand = np.array([2300, 2502, 2600])  # too close to the beat at 9 s, the missed beat, its T wave
    slopes = np.array([1.0, 1.0, 0.1])
    got = S.search_back(beats, np.ones(len(beats)), cand, slopes, np.array([0.2, 0.3, 0.2]), s)
    assert got.tolist() == [False, True, False]


def test_search_back_does_not_fill_the_stream_start():
    s = SegmentParams().samples(250.0)
    beats = np.arange(200, 250 * 20, 250)  # 1 beat/s from 0.8 s
    cand = np.array([40])  # a T wave (or a cut beat) 0.16 s into the stream, 0.64 s before the first beat
    args = (beats, np.ones(len(beats)), cand, np.ones(1), np.array([0.2]), s)
    assert S.search_back(*args).tolist() == [True]  # no beat before it: an unbounded gap
    assert S.search_back(*args, length=250 * 20).tolist() == [False]  # 0.8 s from the start to the beat
    # the same for the stream's end
    cand = np.array([beats[-1] + 150])
    args = (beats, np.ones(len(beats)), cand, np.ones(1), np.array([0.2]), s)
    assert S.search_back(*args).tolist() == [True]
    assert S.search_back(*args, length=int(beats[-1]) + 250).tolist() == [False]


@pytest.mark.parametrize("seed", range(4))
def test_valley_and_noise_mask_match_loops(seed):
    rng = np.random.default_rng(seed)
    env = rng.random(300)
    at = np.sort(rng.choice(300, 40, replace=False))
    at[0], at[-1] = 0, 299  # windows clipped at both ends
    left, right = S.valley_at(env, at, 7)
    np.testing.assert_array_equal(left, [env[max(0, a - 7):a + 1].min() for a in at])
    np.testing.assert_array_equal(right, [env[a:a + 8].min() for a in at])
    s = small_params(nms_half_window_s=0.07)
    assert s.nms == 7
    heights, level, slopes = env[at], 2 * rng.random(40), 6 * rng.random(40) * env[at]
    got = S.noise_mask(env, at, heights, level, slopes, s)
    np.testing.assert_array_equal(got, naive.noise_mask(env, list(at), heights, level, slopes, s))
    assert got.any() and not got.all()
    off = SegmentParams(noise_slope_ratio=float("inf")).samples(100.0)
    assert not S.noise_mask(env, at, heights, level, slopes, off).any()


def test_noise_burst_peaks_are_no_beats():
    """Beats every 0.8 s at 250 Hz, and 10 s of broadband (muscle-like) noise between them."""
    rng = np.random.default_rng(1)
    fs, n = 250, 250 * 30
    t = np.arange(n)
    beats = np.arange(100, n - 100, 200)
    x = np.zeros(n)
    for b in beats:
        x += np.exp(-0.5 * ((t - b) / 4.0) ** 2)
    x[fs * 10:fs * 20] += 0.2 * rng.normal(size=10 * fs)
    x = x.astype(np.float32)
    on = D.detect_peaks(x, S250)
    off = D.detect_peaks(x, SegmentParams(noise_slope_ratio=float("inf")).samples(fs))
    from beatflow.score.metrics import match_beats

    d_on, _ = match_beats(on, beats, int(0.15 * fs))
    d_off, _ = match_beats(off, beats, int(0.15 * fs))
    assert d_on.fn == d_off.fn == 0 and d_on.fp < d_off.fp - 3, (d_on, d_off)


def _random_beats(seed, n=1200):
    """Gaussian "QRS" bumps every ~0.4 s at 100 Hz, of random size (some weak: search-back), half of them
    with a broad "T wave" (T-wave test), on noise, with a few one-sample spikes."""
    rng = np.random.default_rng(seed)
    x = (0.03 * rng.normal(size=n)).astype(np.float32)
    t = np.arange(n)
    for b in np.arange(20, n - 20, 40) + rng.integers(-3, 4, len(range(20, n - 20, 40))):
        a = rng.choice([0.25, 1.0, 1.0, 2.0])
        x += a * np.exp(-0.5 * ((t - b) / 1.2) ** 2).astype(np.float32)
        x += rng.choice([0.0, 0.8]) * a * np.exp(-0.5 * ((t - b - 14) / 5.0) ** 2).astype(np.float32)
    x[rng.integers(0, n, 4)] += 3.0
    return x


def test_detect_peaks_matches_naive_on_random_input(monkeypatch):
    used = {"t_wave": 0, "search_back": 0, "noise": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            used[name] += int(out.sum())
            return out
        return wrapped

    monkeypatch.setattr(S, "t_wave_mask", counting("t_wave", S.t_wave_mask))
    monkeypatch.setattr(S, "search_back", counting("search_back", S.search_back))
    monkeypatch.setattr(S, "noise_mask", counting("noise", S.noise_mask))
    s = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3, block_s=0.3)
    for seed in range(6):
        x = _random_beats(seed)
        noisy = x.copy()
        noisy[400:800] += (0.15 * np.random.default_rng(100 + seed).normal(size=400)).astype(np.float32)
        for first in (0, 55):
            for xs in (x, noisy):
                want = naive.detect_peaks(xs, s, first=first, vf=True)
                np.testing.assert_array_equal(D.detect_peaks(xs, s, first=first), want)  # the CPU's steps
                np.testing.assert_array_equal(R.detect_beats_xp(xs, s, first=first)[0], want)  # the array code
    assert used["t_wave"] > 0 and used["search_back"] > 0 and used["noise"] > 0  # every decision was exercised


def _partitioned_peaks(x, s, n_parts):
    spans = _split_even(len(x), n_parts)
    specs = [PartitionSpec(0, k, a, b) for k, (a, b) in enumerate(spans)]
    parts = [x[a:b] for a, b in spans]
    e = [edges(p, s.halo) for p in parts]
    lefts, rights, firsts = assemble_halos(specs, [len(p) for p in parts], [h for h, _ in e], [t for _, t in e],
                                           s.halo)
    return specs, firsts, [segment_partition(p, l, r, f, s) for p, l, r, f in zip(parts, lefts, rights, firsts)]


def test_partition_count_does_not_change_beats(synthetic_ecg):
    x = synthetic_ecg.signal
    whole = D.detect_peaks(x, S250)
    assert len(whole) > 100
    for n in (1, 2, 7, 40):  # 40 partitions are shorter than one halo
        specs, firsts, peaks = _partitioned_peaks(x, S250, n)
        np.testing.assert_array_equal(np.concatenate(peaks), whole)
        plan = plan_beats(specs, firsts, {0: len(x)}, peaks, S250)
        assert plan.n_detected == len(whole) - 1


def test_detects_synthetic_beats(synthetic_ecg):
    from beatflow.score.metrics import match_beats

    p = D.detect_peaks(synthetic_ecg.signal, S250)
    d, _ = match_beats(p, synthetic_ecg.r_peaks, int(0.15 * 250))
    assert d.se > 0.995 and d.ppv > 0.995, d.to_dict()


def test_flat_line_has_no_peaks():
    assert D.detect_peaks(np.zeros(5000, np.float32), S250).size == 0
    assert D.detect_peaks(np.full(5000, 2.0, np.float32), S250).size == 0


# --- fast rhythms (SegmentParams.fast_nms_s) -------------------------------------------------------
def _beat_train(rrs, amps, width_s, fs=250.0, t_wave=0.0, seed=0):
    """Gaussian QRS complexes (σ = ``width_s``) after the intervals ``rrs`` (s), heights ``amps``, each
    with a T wave of ``t_wave`` × its height 0.25 s after it, in a little noise; and the beats' samples."""
    rng = np.random.default_rng(seed)
    beats = np.cumsum(rrs) + 1.0
    n = int((beats[-1] + 1.0) * fs)
    t = np.arange(n) / fs
    x = 0.01 * rng.normal(size=n)
    for b, a in zip(beats, amps):
        x += a * np.exp(-0.5 * ((t - b) / width_s) ** 2)
        x += t_wave * a * np.exp(-0.5 * ((t - b - 0.25) / 0.05) ** 2)
    return x.astype(np.float32), np.round(beats * fs).astype(np.int64)


def test_fast_candidates_match_naive_on_random_input():
    # the random beats (0.4 s apart) are a fast rhythm below fast_rr: the narrow window's maxima join
    added, extra = Counter(), Counter()
    for fast_rr, dip in ((0.45, 1.0), (1.0, 1.0), (1.0, 0.8), (np.inf, 0.3)):
        s = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3,
                         block_s=0.3, fast_nms_s=0.03, fast_rr_s=fast_rr, fast_rr_window_s=1.5, fast_dip=dip)
        assert s.fast_nms == 3 and s.fast_rr == 100.0 * fast_rr and s.fast_dip == dip
        off = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3,
                           block_s=0.3)
        for seed in range(6):
            x = _random_beats(seed)
            for first in (0, 55):
                want = naive.detect_peaks(x, s, first=first, vf=True)
                np.testing.assert_array_equal(D.detect_peaks(x, s, first=first), want)  # the CPU's steps
                np.testing.assert_array_equal(R.detect_beats_xp(x, s, first=first)[0], want)  # the array code
                added[dip] += int(not np.array_equal(want, naive.detect_peaks(x, off, first=first, vf=True)))
            env = D.qrs_envelope(x, s)
            wide = D.local_maxima(env, s.nms)
            extra[(fast_rr, dip)] += len(S.fast_candidates(env, wide, S.decide(x, env, wide, 0, s)[0], s))
    assert added[1.0] > 0  # the fast candidates changed the beats of some streams
    assert extra[(1.0, 1.0)] > extra[(1.0, 0.8)] > 0  # the dip test drops some of them (bumps on a flank)


def test_fast_candidates_find_every_beat_of_a_ventricular_tachycardia():
    from beatflow.score.metrics import match_beats

    rng = np.random.default_rng(1)
    k = 60  # RR 0.25-0.3 s, wide beats of alternating heights: the tall one's flank hides the next
    x, ref = _beat_train(rng.uniform(0.25, 0.3, k), np.where(np.arange(k) % 2 == 0, 1.0, 0.6), 0.025)
    off = D.detect_peaks(x, S250)
    on_params = SegmentParams(fast_nms_s=0.12, fast_rr_s=0.6)
    on = D.detect_peaks(x, on_params.samples(250.0))
    d_off, _ = match_beats(off, ref, 37)
    d_on, _ = match_beats(on, ref, 37)
    assert d_off.fn == k // 2  # the ±0.23 s window alone keeps only the tall ones
    assert (d_on.tp, d_on.fp, d_on.fn) == (k, 0, 0)
    np.testing.assert_array_equal(on, naive.detect_peaks(x, on_params.samples(250.0), vf=True))
    dip = SegmentParams(fast_nms_s=0.12, fast_rr_s=float("inf"), fast_dip=0.5).samples(250.0)
    np.testing.assert_array_equal(D.detect_peaks(x, dip), on)  # the hidden beats are peaks of their own
    # a normal rhythm (RR 0.75-0.9 s) with tall T waves: the same beats as without, no T wave counted
    y, ref_y = _beat_train(rng.uniform(0.75, 0.9, 40), np.ones(40), 0.012, t_wave=0.35)
    got = D.detect_peaks(y, on_params.samples(250.0))
    np.testing.assert_array_equal(got, D.detect_peaks(y, S250))
    d, _ = match_beats(got, ref_y, 37)
    assert (d.tp, d.fp, d.fn) == (40, 0, 0)


def test_fast_candidates_keep_partitions_exact():
    rng = np.random.default_rng(2)
    k = 120
    x, _ = _beat_train(np.concatenate([rng.uniform(0.75, 0.9, 40), rng.uniform(0.25, 0.3, k)]),
                       np.concatenate([np.ones(40), np.where(np.arange(k) % 2 == 0, 1.0, 0.6)]), 0.025)
    s = SegmentParams(fast_nms_s=0.12, fast_rr_s=0.6).samples(250.0)
    assert s.halo > S250.halo
    whole = D.detect_peaks(x, s)
    for n in (2, 5):
        _, _, peaks = _partitioned_peaks(x, s, n)
        np.testing.assert_array_equal(np.concatenate(peaks), whole)

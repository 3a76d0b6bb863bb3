import numpy as np
import pytest

import naive
from beatflow import segment as S
from beatflow.params import SegmentParams
from beatflow.partitions import assemble_halos, edges, plan_beats, segment_partition
from beatflow.reading import PartitionSpec, _split_even

S250 = SegmentParams().samples(250.0)


def small_params(**kw):
    base = dict(wavelet_width_s=0.02, nms_half_window_s=0.04, refractory_s=0.06, block_s=0.1,
                threshold_blocks=2, pre_peak_s=0.02, min_length_s=0.1, max_length_s=0.3)
    base.update(kw)
    return SegmentParams(**base).samples(100.0)


def test_ricker_matches_formula_and_has_zero_mean():
    w = S.ricker(41, 4.0)
    np.testing.assert_allclose(w, naive.ricker(41, 4.0), atol=1e-12)
    assert abs(w.sum()) < 1e-12
    assert np.argmax(w) == 20


@pytest.mark.parametrize("n", [1, 7, 60, 257])
def test_wavelet_response_matches_direct_convolution(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=n).astype(np.float32) + 3.0
    s = small_params()
    got = S.wavelet_response(x, s)
    want = naive.convolve_same_edge(x, naive.ricker(s.kernel, s.a))
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_constant_has_no_response():
    s = small_params()
    assert np.abs(S.wavelet_response(np.full(500, 7.5, np.float32), s)).max() < 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_local_maxima_match_loop(seed):
    rng = np.random.default_rng(seed)
    env = np.abs(rng.normal(size=400))
    env[rng.integers(0, 400, 20)] = 0.5  # ties
    for half in (1, 3, 8):
        np.testing.assert_array_equal(S.local_maxima(env, half), naive.local_maxima(env, half))


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


@pytest.mark.parametrize("seed", range(4))
def test_detect_peaks_matches_naive_on_random_input(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=900).astype(np.float32)
    x[rng.integers(0, 900, 12)] += 6.0  # spikes
    s = small_params()
    for first in (0, 55):
        np.testing.assert_array_equal(S.detect_peaks(x, s, first=first), naive.detect_peaks(x, s, first=first))


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
    whole = S.detect_peaks(x, S250)
    assert len(whole) > 100
    for n in (1, 2, 7, 40):  # 40 partitions are shorter than one halo
        specs, firsts, peaks = _partitioned_peaks(x, S250, n)
        np.testing.assert_array_equal(np.concatenate(peaks), whole)
        plan = plan_beats(specs, firsts, {0: len(x)}, peaks, S250)
        assert plan.n_detected == len(whole) - 1


def test_detects_synthetic_beats(synthetic_ecg):
    from beatflow.metrics import match_beats

    p = S.detect_peaks(synthetic_ecg.signal, S250)
    d, _ = match_beats(p, synthetic_ecg.r_peaks, int(0.15 * 250))
    assert d.se > 0.995 and d.ppv > 0.995, d.to_dict()


def test_flat_line_has_no_peaks():
    assert S.detect_peaks(np.zeros(5000, np.float32), S250).size == 0
    assert S.detect_peaks(np.full(5000, 2.0, np.float32), S250).size == 0

import numpy as np
import pytest

import naive
from beatflow.beats import RaggedBeats, beats_from_peaks, embed, prune_mask
from beatflow.params import SegmentParams

S250 = SegmentParams().samples(250.0)


def test_beats_from_peaks_lengths_are_adjacent_differences():
    peaks = np.array([10, 40, 300, 520, 800])
    peak, start, length = beats_from_peaks(peaks, S250, 1000)
    # the first beat would start before sample 0 (10 - 25): dropped; the last peak has no successor
    np.testing.assert_array_equal(peak, [40, 300, 520])
    np.testing.assert_array_equal(start, [15, 275, 495])
    np.testing.assert_array_equal(length, [260, 220, 280])


def test_prune_mask_bounds_inclusive():
    np.testing.assert_array_equal(prune_mask(np.array([99, 100, 256, 257]), 100, 256), [False, True, True, False])


def test_ragged_rows_are_views_of_the_stream():
    x = np.arange(100, dtype=np.float32)
    rb = RaggedBeats.from_starts(x, np.array([5, 20, 50]), np.array([15, 30, 40]))
    assert rb.n_rows == 3
    np.testing.assert_array_equal(rb.lengths, [15, 30, 40])
    assert np.shares_memory(rb.row(1), x)
    np.testing.assert_array_equal(rb.row(2), x[50:90])
    m = rb.to_padded(48, rows=np.array([0, 2]))[0]
    np.testing.assert_array_equal(m[1, :40], x[50:90])
    assert (m[1, 40:] == 0).all() and (m[0, 15:] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_embed_matches_loop(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=3000).astype(np.float32)
    n = 60
    start = np.sort(rng.choice(2500, n, replace=False))
    length = rng.integers(8, 64, n)
    for base in (0, 5):
        got, p2p = embed(x, start, length, 64, baseline_samples=base, chunk=7)
        want, wp2p = naive.embed(x, start, length, 64, baseline_samples=base)
        np.testing.assert_allclose(got, want, atol=1e-6)
        np.testing.assert_allclose(p2p, wp2p, atol=1e-6)


def test_embed_with_offset_partition():
    rng = np.random.default_rng(9)
    x = rng.normal(size=1000).astype(np.float32)
    start, length = np.array([300, 450]), np.array([100, 150])
    whole, _ = embed(x, start, length, 160)
    part, _ = embed(x[200:800], start, length, 160, first=200)
    np.testing.assert_array_equal(whole, part)

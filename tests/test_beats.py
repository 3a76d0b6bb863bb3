import numpy as np
import pytest

import naive
from beatflow.embed import embed
from beatflow.embed.beats import RaggedBeats, beats_from_peaks, prune_mask
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


@pytest.mark.parametrize("n", [1, 7, 300])
def test_dominant_beat_is_the_columnwise_median(n):
    from beatflow.score.rule import dominant_beat, residual_rows

    rows = np.random.default_rng(n).normal(size=(n, 16)).astype(np.float32)
    want = np.array([sorted(rows[:, j])[n // 2] if n % 2 else 0.5 * (sorted(rows[:, j])[n // 2 - 1]
                     + sorted(rows[:, j])[n // 2]) for j in range(16)], np.float32)
    np.testing.assert_allclose(dominant_beat(rows), want, rtol=1e-6)
    r = residual_rows(rows, want)
    np.testing.assert_allclose(r + want[None, :], rows, atol=1e-6)
    assert not np.shares_memory(r, rows)


def test_dominant_beat_of_a_long_stream_uses_evenly_spaced_rows(monkeypatch):
    import beatflow.score.rule as B

    monkeypatch.setattr(B, "DOMINANT_SAMPLE", 10)
    rows = np.arange(25 * 3, dtype=np.float32).reshape(25, 3)  # 25 rows -> every 3rd: rows 0, 3, ..., 24
    np.testing.assert_array_equal(B.dominant_beat(rows), np.median(rows[::3], axis=0))
    assert B.dominant_beat(np.zeros((0, 3), np.float32)).tolist() == [0, 0, 0]


def test_residuals_make_one_patients_normal_beats_small_and_others_large():
    """Two 'patients' with different normal shapes: after subtracting each one's dominant beat, the
    normal beats of both are near zero and each one's odd beats stand out."""
    from beatflow.score.rule import dominant_beat, residual_rows

    rng = np.random.default_rng(0)
    t = np.linspace(0, 1, 64, dtype=np.float32)
    shapes = [np.exp(-((t - 0.3) / 0.03) ** 2), -np.exp(-((t - 0.3) / 0.06) ** 2)]  # upright vs inverted QRS
    for normal, odd in (shapes, shapes[::-1]):
        rows = np.vstack([normal + 0.02 * rng.normal(size=(95, 64)), odd + 0.02 * rng.normal(size=(5, 64))])
        res = residual_rows(rows.astype(np.float32), dominant_beat(rows.astype(np.float32)))
        err = (res ** 2).mean(axis=1)
        assert err[:95].max() < 0.01 < err[95:].min()


def test_long_beats_are_cut_to_the_row_unless_pruned_as_in_the_seed():
    import dataclasses

    from beatflow.embed.beats import kept_mask, row_lengths

    length = np.array([99, 100, 256, 257, 600])
    s = dataclasses.replace(S250, lower=100, upper=256)
    np.testing.assert_array_equal(kept_mask(length, s), [False, True, True, True, True])
    np.testing.assert_array_equal(row_lengths(length, s), [99, 100, 256, 256, 256])
    seed = dataclasses.replace(s, cut_long=False)
    np.testing.assert_array_equal(kept_mask(length, seed), [False, True, True, False, False])
    assert SegmentParams(cut_long=False).samples(250.0).cut_long is False and S250.cut_long is True


def test_a_premature_beat_before_a_pause_gets_a_row():
    """Peaks of a regular rhythm with one early beat followed by a compensatory pause: the early
    beat's row is cut to the row width instead of being dropped."""
    from beatflow.embed.partitions import plan_beats
    from beatflow.io.sources import PartitionSpec

    peaks = np.array([100, 300, 500, 620, 900, 1100, 1300])  # 620: early; 620 -> 900 is 280 > 256
    s = SegmentParams(min_length_s=0.4, max_length_s=1.024).samples(250.0)
    plan = plan_beats([PartitionSpec(0, 0, 0, 1400)], [0], {0: 1400}, [peaks], s)
    i = int(np.flatnonzero(plan.peak == 620)[0])
    assert plan.length[i] == 280 > s.upper and plan.kept[i]
    start, row_len = plan.kept_of(0)
    assert row_len.max() == s.upper and row_len[list(plan.peak[plan.kept]).index(620)] == s.upper

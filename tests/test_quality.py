"""Signal quality (:mod:`beatflow.detect.quality`): unreadable windows and stretches, the CPU's loop
against the array code and the loop reference, partition independence, real and synthetic ECG kept."""
from __future__ import annotations

import numpy as np
import pytest

import naive
from beatflow.detect import detect_beats, quality_features, quality_rule
from beatflow.detect import quality as Q
from beatflow.detect.cpu import quality_features_cpu
from beatflow.embed.partitions import assemble_halos, edges, segment_partition
from beatflow.io.sources import PartitionSpec
from beatflow.params import QualityParams, SegmentParams


def _bad_signals(fs: float, seconds: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = int(seconds * fs)
    half = n // 2
    return {
        "white noise": rng.normal(0.0, 1e-3, n),
        "white noise, large": rng.normal(0.0, 300.0, n),
        "uniform noise": rng.uniform(-2.0, 2.0, n),
        "flat line": np.full(n, 0.25),
        "lead-off (constant with a jump)": np.r_[np.full(half, -0.4), np.full(n - half, 1.7)],
        "quantised flat line": np.round(rng.normal(0.0, 0.6, n)) * 0.005 + 1.0,
        "clipped": np.clip(rng.normal(0.0, 5.0, n), -1.0, 1.0),
    }


@pytest.mark.parametrize("fs", [100.0, 250.0, 360.0, 1000.0])
def test_bad_signals_are_unreadable_over_their_whole_length(fs):
    q = QualityParams().samples(fs)
    s = SegmentParams().samples(fs)
    expect = {"white noise": "noise", "white noise, large": "noise", "uniform noise": "noise", "flat line": "flat",
              "lead-off (constant with a jump)": "flat", "quantised flat line": "flat", "clipped": "saturated"}
    for name, x in _bad_signals(fs, 120.0).items():
        x = x.astype(np.float32)
        peaks, _ = detect_beats(x, s)
        keep, spans, reasons = quality_rule(x, peaks, 0, q)
        assert not keep.any(), name
        np.testing.assert_array_equal(spans, [[0, x.shape[0]]], err_msg=name)
        assert [Q.REASONS[int(r)] for r in reasons] == [expect[name]], name


def test_synthetic_ecg_is_readable():
    from beatflow.io.synth import synthesize_ecg

    syn = synthesize_ecg(hours=0.5)
    q = QualityParams().samples(syn.fs)
    codes, _ = Q.quality_windows(syn.signal, 0, q)
    assert (codes == Q.OK).mean() > 0.999


def test_mitdb_records_are_readable(mitdb):
    """The first 5 minutes of a noisy record (203), one with flutter (207) and one whose R waves and
    baseline reach the converter's rails (116): no window with an annotated beat is unreadable, and the
    detection keeps every beat it found."""
    from beatflow.score.evaluate import detection_of, load_record, record_beats

    for name in ("116", "203", "207"):
        rec = load_record(str(mitdb / name), max_seconds=300)
        q = QualityParams().samples(rec.fs)
        codes, w0 = Q.quality_windows(rec.signal, 0, q)
        ref, _ = rec.beats
        assert (codes[ref // q.window - w0] == Q.OK).all(), name
        with_rule, without = record_beats(rec), record_beats(rec, quality=None)
        assert with_rule.unreadable_s < 0.01 * 300
        assert detection_of(with_rule.peaks, rec).tp == detection_of(without.peaks, rec).tp


def test_noise_inside_an_ecg_is_a_stretch_and_its_peaks_go():
    from beatflow.io.synth import synthesize_ecg

    syn = synthesize_ecg(hours=0.05, seed=3)
    x = syn.signal.copy()
    fs = syn.fs
    a, b = int(60 * fs), int(90 * fs)
    x[a:b] = np.random.default_rng(0).normal(0.0, 0.5, b - a).astype(np.float32)
    s, q = SegmentParams().samples(fs), QualityParams().samples(fs)
    peaks, _ = detect_beats(x, s)
    assert ((peaks >= a) & (peaks < b)).sum() > 10  # the detector alone takes noise for beats
    keep, spans, reasons = quality_rule(x, peaks, 0, q)
    assert spans.shape == (1, 2) and Q.REASONS[int(reasons[0])] == "noise"
    assert a - q.window < spans[0, 0] <= a + q.window and b - q.window <= spans[0, 1] < b + q.window
    kept = peaks[keep]
    assert not ((kept >= spans[0, 0]) & (kept < spans[0, 1])).any()
    assert keep.sum() > 0.9 * ((peaks < a) | (peaks >= b)).sum()


@pytest.mark.parametrize("first", [0, 7, 1000, 1440 * 3])
def test_cpu_loop_matches_the_array_code_and_the_loops(first):
    rng = np.random.default_rng(first)
    fs = 360.0
    q = QualityParams(window_s=0.5).samples(fs)  # small windows: the loop reference is slow
    from beatflow.io.synth import synthesize_ecg

    ecg = synthesize_ecg(hours=0.002, fs=fs, seed=1).signal[: int(2.3 * fs)]
    for x in (rng.normal(size=1000), np.round(rng.normal(size=997) * 3) / 3, ecg,
              np.clip(rng.normal(size=800), -0.5, 0.5), np.full(500, 2.0), rng.normal(size=5)):
        x = x.astype(np.float32)
        ref = Q.window_features(x, first, q)
        cpu = quality_features_cpu(x, first, q)
        loops = naive.quality_features(x, first, q)
        assert ref[-1] == cpu[-1] == loops[-1]
        for a, b, c in zip(ref[:4], cpu[:4], loops[:4]):
            np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(c, a, rtol=1e-9, atol=1e-12)
    assert quality_features(x, first, q)[0].shape == ref[0].shape  # the dispatch takes the CPU's loop


def _partitions(x, s, n_parts):
    bounds = np.linspace(0, len(x), n_parts + 1).astype(int)
    spans = list(zip(bounds[:-1], bounds[1:]))
    specs = [PartitionSpec(0, k, lo, hi) for k, (lo, hi) in enumerate(spans)]
    parts = [x[lo:hi] for lo, hi in spans]
    e = [edges(p, s.halo) for p in parts]
    return specs, parts, assemble_halos(specs, [len(p) for p in parts], [h for h, _ in e], [t for _, t in e], s.halo)


def test_partitions_give_the_whole_streams_stretches_and_peaks():
    from beatflow.io.synth import synthesize_ecg

    syn = synthesize_ecg(hours=0.05, seed=5)
    fs, x = syn.fs, syn.signal.copy()
    rng = np.random.default_rng(1)
    x[int(30 * fs) : int(47.3 * fs)] = rng.normal(0, 1, int(47.3 * fs) - int(30 * fs))
    x[int(100 * fs) : int(111 * fs)] = 0.1
    x[int(150 * fs) : int(150 * fs) + 4] = 3.0
    s, q = SegmentParams().samples(fs), QualityParams().samples(fs)
    assert q.halo <= s.halo
    peaks, _ = detect_beats(x, s)
    keep, spans, reasons = quality_rule(x, peaks, 0, q)
    assert {Q.REASONS[int(r)] for r in reasons} == {"noise", "flat"}
    whole = peaks[keep]
    for n_parts in (3, 7):
        specs, parts, (lefts, rights, firsts) = _partitions(x, s, n_parts)
        got = [segment_partition(p, lo, hi, f, s, episodes=True, quality=q)
               for p, lo, hi, f in zip(parts, lefts, rights, firsts)]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), whole)
        m_spans, m_reasons = Q.merge_episodes([g[2][0] for g in got], [g[2][1] for g in got])
        np.testing.assert_array_equal(m_spans, spans)
        np.testing.assert_array_equal(m_reasons, reasons)


def test_quality_halo_fits_the_detections():
    for fs in (50.0, 100.0, 250.0, 360.0, 1000.0, 20000.0):
        assert QualityParams().samples(fs).halo <= SegmentParams().samples(fs).halo, fs


def test_merge_episodes_joins_one_reason_across_partitions():
    spans, reasons = Q.merge_episodes([np.array([[0, 10], [10, 20]]), np.array([[20, 30], [40, 50]])],
                                      [np.array([3, 1]), np.array([1, 3])])
    np.testing.assert_array_equal(spans, [[0, 10], [10, 30], [40, 50]])
    np.testing.assert_array_equal(reasons, [3, 1, 3])
    assert Q.merge_episodes([], [])[0].shape == (0, 2)

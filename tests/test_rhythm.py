"""The ventricular flutter episode rule (beatflow.detect.rhythm): array code against the loop reference,
partition invariance, and MIT-BIH 207 (flutter) and VT runs (203, 205, 207)."""
import numpy as np
import pytest

import naive
import beatflow.detect as D
from beatflow.detect import rhythm as R
from beatflow.detect import peaks as S
from beatflow.device import cupy_available
from beatflow.params import SegmentParams
from beatflow.embed.partitions import assemble_halos, edges, segment_partition
from beatflow.io.sources import PartitionSpec, _split_even


def _flutter(rng, n, fs, amp=1.0):
    """A flutter-like wave: a 4–5 Hz sinusoid with a slowly drifting phase and a little noise."""
    t = np.arange(n) / fs
    f = rng.uniform(4.0, 5.0)
    return (amp * np.sin(2 * np.pi * f * t + 0.3 * np.sin(0.5 * t)) + 0.05 * rng.normal(size=n)).astype(np.float32)


def _stream(seed, fs=250.0, seconds=60.0):
    """Synthetic ECG with one flutter episode of 15–25 s replacing part of it."""
    from beatflow.io.synth import synthesize_ecg

    rng = np.random.default_rng(seed)
    x = synthesize_ecg(hours=seconds / 3600.0, fs=fs, seed=seed).signal.astype(np.float32).copy()
    a = int(rng.uniform(0.2, 0.4) * x.shape[0])
    b = a + int(rng.uniform(0.3, 0.5) * seconds * fs)
    x[a:b] = _flutter(rng, b - a, fs, amp=float(np.percentile(np.abs(x), 99)))
    return x, a, b


def test_rhythm_matches_loop_reference():
    fs = 250.0
    s = SegmentParams().samples(fs)
    fired = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x, a, b = _stream(seed, fs, seconds=24.0)
        if seed == 3:  # plain noise and a bare sinusoid too
            x = np.concatenate([rng.normal(size=3000).astype(np.float32), _flutter(rng, 4000, fs)])
        peaks = np.sort(rng.choice(x.shape[0], 200, replace=False)).astype(np.int64)
        for first in (0, 1137):
            want = naive.flutter_keep_mask(x, peaks + first, first, s)
            got = R.flutter_keep_mask(x, peaks + first, first, s)  # the array code
            np.testing.assert_array_equal(got, want)
            # and with the CPU's fused loops, as beatflow.detect passes them
            np.testing.assert_array_equal(R.flutter_keep_mask(x, peaks + first, first, s,
                                                              window_features=D.window_features), want)
            fired += int((~got).sum())
        sh = SegmentParams(vf_context=1, vf_min_windows=3, vf_window_s=0.7).samples(fs)
        np.testing.assert_array_equal(R.flutter_keep_mask(x, peaks, 0, sh), naive.flutter_keep_mask(x, peaks, 0, sh))
    assert fired > 0


def test_cpu_loops_match_array_code():
    """The fused CPU loops (cpu.flutter_features_cpu) give the array code's window
    quantities: energies to round-off, the same smooth windows and near-median fractions, for even
    and odd windows, unaligned starts and streams shorter than a window."""
    from beatflow.detect.cpu import flutter_features_cpu, window_features_cpu

    fs = 250.0
    for seed, params in ((0, {}), (1, {"vf_window_s": 0.71, "vf_context": 1}), (2, {"vf_highpass_s": 0.02})):
        s = SegmentParams(**params).samples(fs)
        rng = np.random.default_rng(seed)
        x, a, b = _stream(seed, fs, seconds=24.0)
        for first, xs in ((0, x), (1137, x), (3, x[:100]), (0, rng.normal(size=4000).astype(np.float32))):
            got_s, got_b, w0 = window_features_cpu(xs, first, s)
            want_s, want_b, ww0 = R.window_features_xp(xs, first, s)
            assert w0 == ww0
            np.testing.assert_array_equal(got_s, want_s)
            np.testing.assert_allclose(got_b[got_s], want_b[want_s], rtol=0, atol=1e-12)
            # the energies themselves, against the array code's sums
            e_sig, e_slope = flutter_features_cpu(xs, first, s.vf_window, s.vf_highpass,
                                                  S.gaussian_derivative(s.kernel, s.a))
            xd = S.despike(xs)
            from scipy.ndimage import uniform_filter1d

            W, lead = s.vf_window, first - w0 * s.vf_window
            tail = e_sig.shape[0] * W - lead - xs.shape[0]
            h = np.pad(xd - uniform_filter1d(xd, s.vf_highpass, mode="nearest"), (lead, tail), mode="edge")
            d = np.pad(S.despiked_slope(xd, s.kernel, s.a), (lead, tail), mode="edge")
            np.testing.assert_allclose(e_sig, (h.reshape(-1, W) ** 2).sum(axis=1), rtol=1e-9)
            np.testing.assert_allclose(e_slope, (d.reshape(-1, W) ** 2).sum(axis=1), rtol=1e-9)


def test_rhythm_fires_on_flutter_only_and_can_be_switched_off():
    fs = 250.0
    s = SegmentParams().samples(fs)
    off = SegmentParams(vf_baseline_ratio=0.0).samples(fs)
    for seed in range(3):
        x, a, b = _stream(seed, fs)
        on_peaks, off_peaks = D.detect_peaks(x, s), D.detect_peaks(x, off)
        gone = np.setdiff1d(off_peaks, on_peaks)
        assert gone.size > 0.5 * ((off_peaks >= a) & (off_peaks < b)).sum()
        assert ((gone >= a - 2 * fs) & (gone < b + 2 * fs)).all()  # nothing outside the episode
    clean = np.concatenate([_stream(5, fs)[0][: int(0.2 * 60 * fs)]] * 3)  # no flutter: nothing dropped
    np.testing.assert_array_equal(D.detect_peaks(clean, s), D.detect_peaks(clean, off))


def test_episodes_are_the_ranges_of_the_dropped_peaks():
    """flutter_rule's episodes hold exactly the peaks its mask drops; merge_spans joins touching ranges."""
    fs = 250.0
    s = SegmentParams().samples(fs)
    for seed in range(3):
        x, a, b = _stream(seed, fs, seconds=90.0)
        peaks = D.detect_peaks(x, SegmentParams(vf_baseline_ratio=0.0).samples(fs))
        for first in (0, 777):
            keep, ep = R.flutter_rule(x, peaks + first, first, s)
            assert ep.shape[1] == 2 and len(ep) >= 1 and (ep[:, 0] < ep[:, 1]).all()
            assert (ep[:, 0] >= first).all() and (ep[:, 1] <= first + len(x)).all()
            inside = ((peaks[:, None] + first >= ep[:, 0]) & (peaks[:, None] + first < ep[:, 1])).any(axis=1)
            np.testing.assert_array_equal(keep, ~inside)
            assert ((ep[:, 0] - first < b + 2 * fs) & (ep[:, 1] - first > a - 2 * fs)).all()  # at the flutter
    off = SegmentParams(vf_baseline_ratio=0.0).samples(fs)
    assert R.flutter_rule(x, peaks, 0, off)[1].shape == (0, 2)
    np.testing.assert_array_equal(R.merge_spans([np.array([[10, 20], [40, 50]]), np.array([[20, 30]]),
                                                 np.zeros((0, 2), np.int64), np.array([[45, 60]])]),
                                  [[10, 30], [40, 60]])
    assert R.merge_spans([]).shape == (0, 2)


def test_rhythm_partition_invariance():
    fs = 250.0
    s = SegmentParams().samples(fs)
    x, a, b = _stream(7, fs, seconds=90.0)
    whole, whole_episodes = D.detect_beats(x, s)
    assert whole.size < D.detect_peaks(x, SegmentParams(vf_baseline_ratio=0.0).samples(fs)).size
    assert len(whole_episodes) >= 1
    for n_parts in (2, 5, 13):
        spans = _split_even(len(x), n_parts)
        specs = [PartitionSpec(0, k, lo, hi) for k, (lo, hi) in enumerate(spans)]
        parts = [x[lo:hi] for lo, hi in spans]
        e = [edges(p, s.halo) for p in parts]
        lefts, rights, firsts = assemble_halos(specs, [len(p) for p in parts], [h for h, _ in e],
                                               [t for _, t in e], s.halo)
        got = [segment_partition(p, lo, hi, f, s, episodes=True) for p, lo, hi, f in zip(parts, lefts, rights, firsts)]
        np.testing.assert_array_equal(np.concatenate([pk for pk, _ in got]), whole)
        np.testing.assert_array_equal(R.merge_spans([ep for _, ep in got]), whole_episodes)


def _beats_kept(rec, lo, hi, s):
    """Annotated beats in [lo, hi) and how many of them the detection matches with the rule on/off."""
    from beatflow.score.metrics import match_beats

    ref, _ = rec.beats
    ref = ref[(ref >= lo) & (ref < hi)]
    tol = int(round(0.15 * rec.fs))
    on = match_beats(D.detect_peaks(rec.signal, s), ref, tol)[0].tp
    off = match_beats(D.detect_peaks(rec.signal, SegmentParams(vf_baseline_ratio=0.0).samples(rec.fs)), ref, tol)[0].tp
    return ref.size, on, off


def test_mitdb_207_flutter_dropped_and_vt_runs_kept(mitdb):
    from beatflow.score.evaluate import load_record

    rec = load_record(str(mitdb / "207"), max_seconds=70.0)
    s = SegmentParams().samples(rec.fs)
    on, off = D.detect_peaks(rec.signal, s), D.detect_peaks(rec.signal, SegmentParams(vf_baseline_ratio=0.0)
                                                            .samples(rec.fs))
    a, b = 14665, 18350  # the first (VFL episode
    inside = lambda p: ((p >= a) & (p <= b)).sum()  # noqa: E731
    assert inside(off) > 20 and inside(on) <= 0.3 * inside(off)
    n, kept_on, kept_off = _beats_kept(rec, 13868, 14414, s)  # the VT run just before it
    assert n > 0 and kept_on == kept_off
    n, kept_on, kept_off = _beats_kept(rec, 22262, 22774, s)  # and the one after the second episode
    assert n > 0 and kept_on == kept_off


@pytest.mark.parametrize("name, seconds, runs", [("203", 120.0, [(16689, 17156), (33033, 33602), (37837, 38291)]),
                                                  ("205", 310.0, [(107561, 108650), (109089, 110272)])])
def test_mitdb_vt_runs_keep_their_beats(mitdb, name, seconds, runs):
    from beatflow.score.evaluate import load_record

    rec = load_record(str(mitdb / name), max_seconds=seconds)
    s = SegmentParams().samples(rec.fs)
    for lo, hi in runs:
        n, kept_on, kept_off = _beats_kept(rec, lo, hi, s)
        assert n > 0 and kept_on == kept_off
    off = D.detect_peaks(rec.signal, SegmentParams(vf_baseline_ratio=0.0).samples(rec.fs))
    np.testing.assert_array_equal(D.detect_peaks(rec.signal, s), off)  # nothing dropped in these records


@pytest.mark.skipif(not cupy_available(), reason="needs CuPy on a CUDA GPU")
def test_rhythm_on_cupy_same_as_numpy():
    """The GPU path runs the same array code on CuPy: the same mask, and detect_peaks drops the same peaks."""
    import cupy

    fs = 250.0
    s = SegmentParams().samples(fs)
    for seed in range(3):
        x, a, b = _stream(seed, fs)
        rng = np.random.default_rng(seed)
        peaks = np.sort(rng.choice(x.shape[0], 300, replace=False)).astype(np.int64)
        for first in (0, 1137):
            want = R.flutter_keep_mask(x, peaks + first, first, s)
            got = R.flutter_keep_mask(cupy.asarray(x), cupy.asarray(peaks + first), first, s)
            np.testing.assert_array_equal(cupy.asnumpy(got), want)
        want, want_ep = D.detect_beats(x, s)
        assert want.size < D.detect_peaks(x, SegmentParams(vf_baseline_ratio=0.0).samples(fs)).size  # it fired
        got, got_ep = D.detect_beats(cupy.asarray(x), s)
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
        np.testing.assert_array_equal(cupy.asnumpy(got_ep), want_ep)

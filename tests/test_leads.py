"""The second lead's rules (beatflow.detect.leads): array code against the loop reference, switched off,
bad input, and MIT-BIH 207 (flutter seen on lead 1) with its reference beats."""
import numpy as np
import pytest

import naive
import beatflow.detect as D
from beatflow.detect import detect_peaks
from beatflow.detect import leads as LD
from beatflow.device import cupy_available
from beatflow.params import SegmentParams


def _two_leads(seed, fs, seconds):
    """Two leads of one synthetic ECG: the second a scaled, noisier copy; a flutter-like wave on the
    first lead over a stretch, smoother on the second; noise bursts on the first lead only."""
    from beatflow.io.synth import synthesize_ecg

    rng = np.random.default_rng(seed)
    x0 = synthesize_ecg(hours=seconds / 3600.0, fs=fs, seed=seed).signal.astype(np.float32).copy()
    n = x0.shape[0]
    x1 = (0.6 * x0 + 0.03 * rng.normal(size=n)).astype(np.float32)
    amp = float(np.percentile(np.abs(x0), 99))
    a = int(rng.uniform(0.25, 0.4) * n)
    b = a + int(rng.uniform(0.25, 0.35) * n)
    t = np.arange(b - a) / fs
    f = rng.uniform(4.0, 5.0)
    x0[a:b] = amp * np.sin(2 * np.pi * f * t) + 0.3 * amp * np.sign(np.sin(2 * np.pi * 2 * f * t))
    x1[a:b] = 0.8 * amp * np.sin(2 * np.pi * f * t + 0.5)
    for _ in range(4):  # short bursts on the first lead only
        c = int(rng.uniform(0.05, 0.95) * n)
        x0[c:c + int(0.05 * fs)] += (0.5 * amp * rng.normal(size=min(int(0.05 * fs), n - c))).astype(np.float32)
    return x0, x1


def _misplaced_leads(seed, fs, seconds, n_spikes=8):
    """Two leads where noise spikes on the first lead, 0.2-0.3 s beside ``n_spikes`` of its QRS
    complexes, win the detection's suppression window (a misplaced peak: one false beat, one missed);
    the second lead (a scaled, noisy copy of the clean first) shows every QRS. Returns the leads and
    the clean first lead's peaks."""
    from beatflow.io.synth import synthesize_ecg

    rng = np.random.default_rng(seed)
    x0 = synthesize_ecg(hours=seconds / 3600.0, fs=fs, seed=seed).signal.astype(np.float32).copy()
    x1 = (0.6 * x0 + 0.02 * rng.normal(size=x0.shape[0])).astype(np.float32)
    clean = detect_peaks(x0, SegmentParams().samples(fs))
    amp = float(np.percentile(np.abs(x0), 99.5))
    w = max(3, int(0.03 * fs))
    burst = (2.5 * amp * np.sin(np.pi * np.arange(w) / w) * np.sign(np.sin(6 * np.pi * np.arange(w) / w)))
    for q in clean[rng.choice(np.arange(5, len(clean) - 5), size=n_spikes, replace=False)]:
        c = q + int(rng.uniform(0.2, 0.3) * fs) * (1 if rng.random() < 0.5 else -1)
        x0[c:c + w] += burst.astype(np.float32)
    return x0, x1, clean


@pytest.mark.parametrize("params", [
    LD.SecondLeadParams(),
    # looser limits: both rules drop some of the peaks of these short streams (and keep others)
    LD.SecondLeadParams(flutter_max_freq_hz=6.0, flutter_baseline_ratio=0.5, flutter_gate_ratio=0.45,
                        weak_ratio=1.0, quiet_ratio=1.0, quality_ratio=1.0, neighbours=3),
])
def test_second_lead_matches_loop_reference(params):
    fs = 125.0
    s = SegmentParams().samples(fs)
    by_flutter = by_doubt = total = 0
    for seed in range(3):
        x0, x1 = _two_leads(seed, fs, 40.0)
        peaks = detect_peaks(x0, s)
        keep, episodes = D.second_lead_keep(x0, x1, peaks, fs, s, params)
        want = naive.second_lead_keep(x0, x1, peaks, fs, s, params)
        np.testing.assert_array_equal(keep, want, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(LD.second_lead_keep_xp(x0, x1, peaks, fs, s, params)[0], want)  # array code
        flutter_only = D.second_lead_keep(x0, x1, peaks, fs, s, LD.SecondLeadParams(**{**params.to_dict(),
                                                                                        "weak_ratio": 0.0}))[0]
        np.testing.assert_array_equal(flutter_only, naive.second_lead_keep(
            x0, x1, peaks, fs, s, LD.SecondLeadParams(**{**params.to_dict(), "weak_ratio": 0.0})))
        by_flutter += int((~flutter_only).sum())
        by_doubt += int((flutter_only & ~keep).sum())
        total += peaks.shape[0]
        assert episodes.ndim == 2 and episodes.shape[1] == 2 and (episodes[:, 1] > episodes[:, 0]).all()
    if params.flutter_baseline_ratio > 0.4:  # (the comparisons are not of two all-True or all-False masks)
        assert 0 < by_flutter < total and 0 < by_doubt < total - by_flutter


@pytest.mark.parametrize("params", [
    LD.SecondLeadParams(),
    LD.SecondLeadParams(move_quiet_ratio=1.0, move_found_ratio=0.3, move_first_ratio=0.0, quality_ratio=1.5,
                        move_min_s=0.1, move_max_s=0.5, neighbours=3),
    LD.SecondLeadParams(move_quiet_ratio=0.0),  # rule 3 off
])
def test_misplaced_peaks_match_loop_reference(params):
    """Rule 3 against its loop reference; with the defaults it moves the misplaced peaks back onto
    the QRS complexes (on the first lead's streams with noise spikes) and no other."""
    fs = 125.0
    s = SegmentParams().samples(fs)
    moved_total = 0
    for seed in range(3):
        for x0, x1, clean in (_misplaced_leads(seed, fs, 60.0), (*_two_leads(seed, fs, 40.0), None)):
            peaks = detect_peaks(x0, s)
            got, _, _, moved = D.second_lead_peaks(x0, x1, peaks, fs, s, params)
            want = naive.second_lead_peaks(x0, x1, peaks, fs, s, params)
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
            np.testing.assert_array_equal(LD.second_lead_peaks_xp(x0, x1, peaks, fs, s, params)[0], want)
            assert (np.diff(got) > 0).all()
            keep, _ = D.second_lead_keep(x0, x1, peaks, fs, s, params)
            assert got.shape[0] == int(keep.sum()) and moved == int((got != peaks[keep]).sum())
            moved_total += moved
            if clean is not None and params == LD.SecondLeadParams():
                on_qrs = lambda v: np.abs(v[:, None] - clean[None, :]).min(axis=1) <= 0.05 * fs  # noqa: E731
                new = got[got != peaks[keep]]
                assert moved >= 4 and on_qrs(new).all(), (seed, moved)
                assert on_qrs(got).sum() == on_qrs(peaks[keep]).sum() + moved
    assert (moved_total > 0) == (params.move_quiet_ratio > 0)


def test_neighbour_quantiles_match_numpy():
    """Quantiles of the existing neighbours of every position, as numpy.quantile of them."""
    rng = np.random.default_rng(3)
    for n, k in ((1, 4), (2, 1), (5, 4), (30, 4), (30, 1)):
        v = rng.gamma(2.0, size=n)
        got = LD._neighbour_quantiles(v, k, (0.25, 0.5))
        for i in range(n):
            nb = [v[j] for j in range(i - k, i + k + 1) if j != i and 0 <= j < n]
            for q, g in zip((0.25, 0.5), got):
                if nb:
                    assert g[i] == pytest.approx(np.quantile(nb, q), rel=1e-12)
                else:
                    assert np.isnan(g[i])


@pytest.mark.parametrize("first", [0, 1234])
def test_lead_windows_array_code_matches_fused_loops(first):
    """The array code of ``lead_windows`` (CuPy's path) against the fused CPU loops on NumPy: the
    same energies and near-median fractions for any rows asked, and the same episodes of rule 1."""
    x0, x1 = _two_leads(4, 250.0, 120.0)
    s = SegmentParams().samples(250.0)
    q = LD.SecondLeadParams().samples(250.0)
    rng = np.random.default_rng(first)
    both = []
    for x in (x0, x1):
        fused, array = D.lead_windows(x, first, s), LD.lead_windows_xp(x, first, s)
        assert fused[3] == array[3]
        np.testing.assert_allclose(array[0], fused[0], rtol=1e-9)
        np.testing.assert_allclose(array[1], fused[1], rtol=1e-9)
        rows = np.sort(rng.choice(fused[0].shape[0], 17, replace=False))
        near_f, near_a = fused[2](rows), array[2](rows)
        np.testing.assert_allclose(near_a, near_f, rtol=1e-12)
        assert (near_f[rows] > 0).any() and not near_f[np.setdiff1d(np.arange(near_f.shape[0]), rows)].any()
        both.append((fused, array))
    episodes = [LD.flutter_either_lead(both[0][i][:3], both[1][i][:3], s, q) for i in (0, 1)]
    np.testing.assert_array_equal(episodes[0], episodes[1])
    assert episodes[0].any()  # (the first lead's flutter stretch)


def test_rules_off_keep_every_peak_and_bad_input():
    fs = 125.0
    s = SegmentParams().samples(fs)
    x0, x1 = _two_leads(1, fs, 30.0)
    peaks = detect_peaks(x0, s)
    off = LD.SecondLeadParams(flutter_baseline_ratio=0.0, weak_ratio=0.0)
    keep, episodes = D.second_lead_keep(x0, x1, peaks, fs, s, off)
    assert keep.all() and keep.shape == peaks.shape and episodes.shape == (0, 2)
    # the first lead's own rule off too: no flutter episodes from either lead
    s_off = SegmentParams(vf_baseline_ratio=0.0).samples(fs)
    keep, episodes = D.second_lead_keep(x0, x1, peaks, fs, s_off, LD.SecondLeadParams(weak_ratio=0.0))
    assert keep.all() and episodes.shape == (0, 2)
    with pytest.raises(ValueError, match="differ in length"):
        D.second_lead_keep(x0, x1[:-1], peaks, fs, s)


def test_mitbih_207_second_lead_finds_more_of_the_flutter(mitdb):
    """Record 207: lead 1 confirms flutter that lead 0's rule misses; fewer false beats inside the
    annotated episodes, no reference beat lost."""
    from beatflow.score.evaluate import detection_of, load_record

    r0, r1 = load_record(str(mitdb / "207"), lead=0), load_record(str(mitdb / "207"), lead=1)
    s = SegmentParams().samples(r0.fs)
    peaks = detect_peaks(r0.signal, s)
    keep, episodes = D.second_lead_keep(r0.signal, r1.signal, peaks, r0.fs, s)
    before, after = detection_of(peaks, r0), detection_of(peaks[keep], r0)
    vf_before = before.fp - detection_of(peaks, r0, exclude_vf=True).fp
    vf_after = after.fp - detection_of(peaks[keep], r0, exclude_vf=True).fp
    assert after.tp == before.tp and after.fn == before.fn
    assert vf_after <= vf_before - 15, (vf_before, vf_after)
    assert len(episodes) > 0


@pytest.mark.skipif(not cupy_available(), reason="needs CuPy on a CUDA GPU")
def test_second_lead_on_cupy_equals_numpy():
    import cupy

    fs = 125.0
    s = SegmentParams().samples(fs)
    for seed in range(2):
        x0, x1 = _two_leads(seed, fs, 40.0)
        peaks = detect_peaks(x0, s)
        for p in (LD.SecondLeadParams(), LD.SecondLeadParams(weak_ratio=1.2, quiet_ratio=1.5, quality_ratio=0.0)):
            keep, ep = D.second_lead_keep(x0, x1, peaks, fs, s, p)
            gkeep, gep = D.second_lead_keep(cupy.asarray(x0), cupy.asarray(x1), cupy.asarray(peaks), fs, s, p)
            np.testing.assert_array_equal(cupy.asnumpy(gkeep), keep)
            np.testing.assert_array_equal(cupy.asnumpy(gep), ep)
        x0, x1, _ = _misplaced_leads(seed, fs, 60.0)
        peaks = detect_peaks(x0, s)
        want, _, _, moved = D.second_lead_peaks(x0, x1, peaks, fs, s)
        got, _, _, gmoved = D.second_lead_peaks(cupy.asarray(x0), cupy.asarray(x1), cupy.asarray(peaks), fs, s)
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
        assert gmoved == moved > 0


def _partitioned(x0, x1, n_parts, s, q):
    """The flow's steps: each partition (with halos of both leads) segmented with the second lead,
    then rules 2 and 3 over the gathered measures."""
    from beatflow.embed.partitions import assemble_halos, edges, second_lead_gathered, segment_partition
    from beatflow.io.sources import PartitionSpec, _split_even
    from beatflow.detect.rhythm import merge_spans

    spans = _split_even(len(x0), n_parts)
    specs = [PartitionSpec(0, k, lo, hi) for k, (lo, hi) in enumerate(spans)]
    halos = []
    for x in (x0, x1):
        parts = [x[lo:hi] for lo, hi in spans]
        e = [edges(p, s.halo) for p in parts]
        halos.append((parts, *assemble_halos(specs, [len(p) for p in parts], [h for h, _ in e], [t for _, t in e],
                                             s.halo)))
    (p0, l0, r0, firsts), (p1, l1, r1, _) = halos
    got = [segment_partition(p0[k], l0[k], r0[k], firsts[k], s, episodes=True, second=(p1[k], l1[k], r1[k]), q=q,
                             n_total=len(x0)) for k in range(n_parts)]
    peaks, dropped, moved = second_lead_gathered(specs, [g[0] for g in got], [g[2] for g in got], q, s)
    return np.concatenate(peaks), merge_spans([g[1] for g in got]), (dropped, moved)


def test_second_lead_partition_invariance():
    """Any partitioning gives the whole recording's peaks and episodes (the flow's path), with the
    peaks that rule 2 drops and rule 3 moves."""
    fs = 125.0
    s = SegmentParams().samples(fs)
    for params in (LD.SecondLeadParams(), LD.SecondLeadParams(
            flutter_max_freq_hz=6.0, flutter_baseline_ratio=0.5, flutter_gate_ratio=0.45, weak_ratio=1.0,
            quiet_ratio=1.0, quality_ratio=1.0, neighbours=3)):
        for x0, x1 in (_two_leads(2, fs, 120.0), _misplaced_leads(4, fs, 120.0, n_spikes=16)[:2]):
            peaks = detect_peaks(x0, s)
            want, episodes, dropped, moved = D.second_lead_peaks(x0, x1, peaks, fs, s, params)
            for n_parts in (1, 3, 8):
                got, got_ep, counts = _partitioned(x0, x1, n_parts, s, params.samples(fs))
                np.testing.assert_array_equal(got, want, err_msg=f"{n_parts} partitions")
                np.testing.assert_array_equal(got_ep, episodes, err_msg=f"{n_parts} partitions")
                assert counts == (dropped, moved)
        assert moved >= 8  # (rule 3 acts on the second stream, whose misplaced peaks lie in all partitions)


def test_second_lead_partition_invariance_mitbih_207(mitdb):
    from beatflow.score.evaluate import load_record

    rec = load_record(str(mitdb / "207"), 0, max_seconds=900.0, second=1)
    s = SegmentParams().samples(rec.fs)
    peaks = detect_peaks(rec.signal, s)
    want, episodes, _, _ = D.second_lead_peaks(rec.signal, rec.second, peaks, rec.fs, s)
    assert want.shape[0] < peaks.shape[0] - 10  # (the rules act on this stretch)
    for n_parts in (4, 11):
        got, got_ep, _ = _partitioned(rec.signal, rec.second, n_parts, s, LD.SecondLeadParams().samples(rec.fs))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_ep, episodes)


def test_mitbih_misplaced_peaks_move_onto_reference_beats(mitdb):
    """Records 108 and 203 (noise on lead 0): every peak that rule 3 moves was a false beat beside a
    missed one, and lands on a reference beat (150 ms)."""
    from beatflow.score.evaluate import detection_of, load_record

    moved_total = 0
    for name in ("108", "203"):
        rec = load_record(str(mitdb / name), 0, second=1)
        s = SegmentParams().samples(rec.fs)
        peaks = detect_peaks(rec.signal, s)
        keep, _ = D.second_lead_keep(rec.signal, rec.second, peaks, rec.fs, s)
        got, _, _, moved = D.second_lead_peaks(rec.signal, rec.second, peaks, rec.fs, s)
        before, after = detection_of(peaks[keep], rec), detection_of(got, rec)
        assert moved >= 3 and after.tp == before.tp + moved and after.fp == before.fp - moved, (name, moved)
        ref = rec.beats[0]
        tol = int(round(0.15 * rec.fs))
        old, new = peaks[keep][got != peaks[keep]], got[got != peaks[keep]]
        assert (np.abs(new[:, None] - ref[None, :]).min(axis=1) <= tol).all()
        assert (np.abs(old[:, None] - ref[None, :]).min(axis=1) > tol).all()
        moved_total += moved
    assert moved_total >= 8

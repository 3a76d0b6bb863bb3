"""Tests of the synthetic ECG generator (beatflow.io.synth)."""
from __future__ import annotations

import numpy as np
import pytest

from beatflow.io.synth import (AAMI_CLASS, LABEL_NAMES, RAIL_MV, UNREADABLE_REASONS, SyntheticECG, synthesize_ecg,
                                truth_path)


@pytest.fixture(scope="module")
def hour():
    """One hour at 250 Hz with default settings (shared by the statistical tests)."""
    return synthesize_ecg(1.0, fs=250.0, seed=7)


def _baseline(sig: np.ndarray, r: int, half: int) -> float:
    return float(np.median(sig[max(r - half, 0) : r + half + 1]))


def _half_amplitude_width(sig: np.ndarray, r: int, fs: float) -> float:
    """Seconds around ``r`` where |sig - baseline| stays above half its value at ``r``."""
    x = np.abs(sig[r - int(0.3 * fs) : r + int(0.3 * fs) + 1] - _baseline(sig, r, int(0.3 * fs)))
    c = int(0.3 * fs)
    above = x >= 0.5 * x[c]
    lo = c
    while lo > 0 and above[lo - 1]:
        lo -= 1
    hi = c
    while hi < x.size - 1 and above[hi + 1]:
        hi += 1
    return (hi - lo + 1) / fs


def test_label_names():
    """0, 1, 2 keep their meaning; 3 is the APC; the beat classes' AAMI letters (an artifact has none)."""
    assert LABEL_NAMES == {0: "normal", 1: "pvc", 2: "artifact", 3: "apc"}
    assert AAMI_CLASS == {0: "N", 1: "V", 3: "S"}
    assert UNREADABLE_REASONS == ("noise", "lead_off", "clipping")


def test_deterministic_for_a_seed():
    a = synthesize_ecg(0.05, seed=3)
    b = synthesize_ecg(0.05, seed=3)
    c = synthesize_ecg(0.05, seed=4)
    np.testing.assert_array_equal(a.signal, b.signal)
    np.testing.assert_array_equal(a.r_peaks, b.r_peaks)
    np.testing.assert_array_equal(a.labels, b.labels)
    for k, v in a.truth().items():
        np.testing.assert_array_equal(v, b.truth()[k], err_msg=k)
    assert a.signal.shape == c.signal.shape
    assert not np.array_equal(a.signal, c.signal)
    assert not np.array_equal(a.r_peaks[:20], c.r_peaks[:20])


@pytest.mark.parametrize("fs", [250.0, 360.0])
def test_shape_dtype_and_fs_scaling(fs):
    hours = 0.05
    e = synthesize_ecg(hours, fs=fs, seed=1)
    assert isinstance(e, SyntheticECG)
    assert e.fs == fs
    assert e.signal.shape == (round(hours * 3600 * fs),)
    assert e.signal.dtype == np.float32
    assert np.isfinite(e.signal).all()
    assert e.r_peaks.dtype == np.int64 and e.labels.dtype == np.int8
    assert e.r_peaks.shape == e.labels.shape
    assert e.duration_s == pytest.approx(hours * 3600, abs=1 / fs)


def test_beat_times_do_not_depend_on_fs():
    a = synthesize_ecg(0.05, fs=250.0, seed=2)
    b = synthesize_ecg(0.05, fs=360.0, seed=2)
    assert a.r_peaks.size == b.r_peaks.size
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_allclose(a.r_peaks / 250.0, b.r_peaks / 360.0, atol=0.012)


def test_r_peaks_sorted_and_inside(hour):
    e = hour
    n = e.signal.size
    assert np.all(np.diff(e.r_peaks) > 0)
    # the whole beat (P wave before, T wave after) lies inside the signal
    assert e.r_peaks[0] >= 0.25 * e.fs
    assert e.r_peaks[-1] + 0.45 * e.fs < n
    assert set(np.unique(e.labels)) <= {0, 1, 2, 3}
    assert 3600 / 1.0 <= e.r_peaks.size <= 3600 / 0.45


def test_label_counts(hour):
    counts = np.bincount(hour.labels, minlength=3)
    frac = counts[1] / hour.labels.size
    assert abs(frac - 0.02) < 0.008, frac
    assert 1 <= counts[2] <= 15, counts
    # the rates are honoured at other settings too
    e = synthesize_ecg(0.25, seed=5, pvc_rate=0.1, artifacts_per_hour=40.0)
    counts = np.bincount(e.labels, minlength=3)
    assert abs(counts[1] / e.labels.size - 0.1) < 0.03, counts
    assert 3 <= counts[2] <= 20, counts
    e = synthesize_ecg(0.1, seed=5, pvc_rate=0.0, artifacts_per_hour=0.0, apc_rate=0.0)
    assert np.all(e.labels == 0)


def test_rr_intervals_and_pvc_timing(hour):
    e = hour
    r = e.r_peaks / e.fs
    lab = e.labels
    rr = np.diff(r)
    sinus = np.isin(lab, (0, 2))  # artifact beats keep their sinus timing
    nn = sinus[:-1] & sinus[1:]
    assert nn.sum() > 1000
    assert rr[nn].min() >= 0.45 and rr[nn].max() <= 1.05, (rr[nn].min(), rr[nn].max())
    assert rr[nn].std() > 0.01  # there is heart-rate variability
    # PVCs preceded by two sinus beats and followed by one
    i = np.flatnonzero(lab == 1)
    i = i[(i >= 2) & (i < lab.size - 1)]
    i = i[sinus[i - 1] & sinus[i - 2] & sinus[i + 1]]
    assert i.size > 20
    coupling = r[i] - r[i - 1]
    prev_rr = r[i - 1] - r[i - 2]
    assert np.all(coupling < prev_rr)
    assert np.all(coupling / prev_rr < 0.85)
    # compensatory pause: the next sinus beat about 2 RR after the previous sinus beat, unless
    # that would make the pause longer than 1 s (then the sinus rhythm resets)
    pause = r[i + 1] - r[i]
    assert pause.max() <= 1.0 + 2 / e.fs
    ratio = (r[i + 1] - r[i - 1]) / prev_rr
    full = pause < 0.99
    assert full.sum() > 10
    assert np.all(np.abs(ratio[full] - 2.0) < 0.2), ratio[full]
    assert np.all(ratio > 1.5)
    # every beat-to-beat interval fits the segmenter's 100..256 samples at 250 Hz
    d = np.diff(e.r_peaks)
    assert d.min() >= 100 and d.max() <= 256, (d.min(), d.max())


def test_beats_reach_the_end_of_the_signal():
    e = synthesize_ecg(0.5, seed=8, pvc_rate=0.3)
    assert (e.signal.size - e.r_peaks[-1]) / e.fs < 1.7
    assert e.r_peaks[0] / e.fs < 1.0


@pytest.mark.parametrize("fs", [250.0, 360.0])
def test_r_peak_is_local_maximum_of_normal_beats(fs):
    e = synthesize_ecg(0.15, fs=fs, seed=11)
    sig = e.signal.astype(np.float64)
    h40 = int(round(0.04 * fs))
    offsets = []
    for r in e.r_peaks[(e.labels == 0) & ~e.beat_unreadable]:
        w = sig[r - h40 : r + h40 + 1] - _baseline(sig, r, int(0.3 * fs))
        offsets.append(int(np.argmax(w)) - h40)
        assert w[h40] > 0.4  # a clear positive R wave (mV) above the baseline
    offsets = np.abs(np.array(offsets))
    # the truth is the clean beat's peak sample; noise may move the sampled maximum by one
    assert offsets.max() <= 2
    assert np.mean(offsets <= 1) > 0.98
    assert np.mean(offsets == 0) > 0.5


def test_r_peak_exact_without_noise():
    e = synthesize_ecg(0.1, fs=250.0, seed=12, noise_mv=0.0, powerline_mv=0.0)
    sig = e.signal.astype(np.float64)
    h = int(round(0.04 * e.fs))
    for r, lab, bad in zip(e.r_peaks, e.labels, e.beat_unreadable):
        if lab == 2 or bad:
            continue
        w = np.abs(sig[r - h : r + h + 1] - _baseline(sig, r, int(0.3 * e.fs)))
        assert abs(int(np.argmax(w)) - h) <= 1


def test_pvc_morphology_differs():
    fs = 250.0
    e = synthesize_ecg(0.2, fs=fs, seed=13, pvc_rate=0.1, artifacts_per_hour=0.0, episodes_per_hour=0.0)
    sig = e.signal.astype(np.float64)
    normal = e.r_peaks[e.labels == 0]
    pvc = e.r_peaks[e.labels == 1]
    assert pvc.size > 50
    w_n = np.mean([_half_amplitude_width(sig, r, fs) for r in normal])
    w_p = np.mean([_half_amplitude_width(sig, r, fs) for r in pvc])
    assert 0.015 < w_n < 0.04, w_n
    assert w_p > 1.6 * w_n, (w_n, w_p)
    amp = lambda r: abs(sig[r] - _baseline(sig, r, int(0.3 * fs)))  # noqa: E731
    a_n = np.median([amp(r) for r in normal])
    a_p = np.median([amp(r) for r in pvc])
    assert 0.7 < a_n < 1.3, a_n  # R about 1 mV
    assert a_p > 1.2 * a_n, (a_n, a_p)


def test_artifact_bursts_are_loud_and_short():
    fs = 250.0
    e = synthesize_ecg(0.25, fs=fs, seed=14, artifacts_per_hour=40.0, noise_mv=0.01)
    sig = e.signal.astype(np.float64)
    idx = np.flatnonzero(e.labels == 2)
    assert idx.size >= 3

    def hf_energy(r):  # sample-to-sample variation around the beat, QRS excluded
        seg = np.r_[sig[r - int(0.3 * fs) : r - int(0.06 * fs)], sig[r + int(0.06 * fs) : r + int(0.3 * fs)]]
        return np.std(np.diff(seg))

    normal = e.r_peaks[e.labels == 0][:200]
    assert np.median([hf_energy(e.r_peaks[i]) for i in idx]) > 5 * np.median([hf_energy(r) for r in normal])
    # neighbours of an artifact beat keep a clean, detectable R peak
    h = int(round(0.04 * fs))
    for i in idx:
        for j in (i - 1, i + 1):
            if e.labels[j] != 0:
                continue
            r = e.r_peaks[j]
            w = sig[r - h : r + h + 1] - _baseline(sig, r, int(0.3 * fs))
            assert abs(int(np.argmax(w)) - h) <= 2


def test_save_and_load(tmp_path):
    e = synthesize_ecg(0.02, seed=9)
    e.save(tmp_path / "sub" / "rec")
    assert (tmp_path / "sub" / "rec.npy").exists()
    assert truth_path(tmp_path / "sub" / "rec.npy") == tmp_path / "sub" / "rec.truth.npz"
    x = np.load(tmp_path / "sub" / "rec.npy")
    np.testing.assert_array_equal(x, e.signal)
    with np.load(truth_path(tmp_path / "sub" / "rec")) as t:
        np.testing.assert_array_equal(t["r_peaks"], e.r_peaks)
        np.testing.assert_array_equal(t["labels"], e.labels)
        assert float(t["fs"]) == e.fs
    f = SyntheticECG.load(tmp_path / "sub" / "rec.npy")
    np.testing.assert_array_equal(f.signal, e.signal)
    np.testing.assert_array_equal(f.r_peaks, e.r_peaks)
    assert f.fs == e.fs
    # every truth array reads back with its dtype and shape (the episodes' reasons as plain strings)
    e = synthesize_ecg(0.3, seed=9, episodes_per_hour=10.0)
    e.save(tmp_path / "ep")
    with np.load(truth_path(tmp_path / "ep")) as t:  # (no pickled objects in the file)
        assert set(t.files) == {"r_peaks", "labels", "fs", "beat_unreadable", "run_length", "pvc_form",
                                "unreadable", "unreadable_reason"}
        assert t["unreadable"].dtype == np.int64 and t["unreadable"].shape == (3, 2)
        assert t["unreadable_reason"].dtype.kind == "U" and t["beat_unreadable"].dtype == bool
    f = SyntheticECG.load(tmp_path / "ep")
    for k, v in e.truth().items():
        np.testing.assert_array_equal(getattr(f, k), v, err_msg=k)
        assert np.asarray(getattr(f, k)).dtype == v.dtype, k
    # a truth of r_peaks, labels and fs alone (as older files are) reads with the defaults
    np.savez(truth_path(tmp_path / "old"), r_peaks=e.r_peaks, labels=e.labels, fs=np.float64(e.fs))
    np.save(tmp_path / "old.npy", e.signal)
    g = SyntheticECG.load(tmp_path / "old")
    assert not g.beat_unreadable.any() and g.unreadable.shape == (0, 2) and g.unreadable_reason.size == 0
    np.testing.assert_array_equal(g.run_length, e.run_length)  # (from the labels)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hours": 0.0},
        {"hours": -1.0},
        {"hours": float("nan")},
        {"hours": 1e-5},  # under 2 s
        {"fs": 0.0},
        {"fs": 50.0},
        {"fs": float("inf")},
        {"seed": -1},
        {"seed": 1.5},
        {"pvc_rate": 1.0},
        {"pvc_rate": -0.1},
        {"artifacts_per_hour": -1.0},
        {"noise_mv": -0.01},
        {"wander_mv": float("nan")},
        {"powerline_mv": -1.0},
        {"apc_rate": 1.0},
        {"apc_rate": -0.01},
        {"pvc_rate": 0.6, "apc_rate": 0.4},
        {"couplet_share": -0.1},
        {"run_share": 1.5},
        {"couplet_share": 0.6, "run_share": 0.5},
        {"episodes_per_hour": -1.0},
        {"hours": "ten"},
    ],
)
def test_bad_arguments_raise(kwargs):
    args = {"hours": 0.01, **kwargs}
    with pytest.raises(ValueError):
        synthesize_ecg(**args)


def test_cache_of_generated_recordings(tmp_path, monkeypatch):
    from beatflow.io import synth
    cache = tmp_path / "cache"
    a = (tmp_path / "a.npy", tmp_path / "a.npz")
    ecg, hit = synth.synthesize_cached(*a, hours=0.01, fs=250.0, seed=4, cache_dir=cache)
    assert not hit and ecg is not None
    ref = synthesize_ecg(hours=0.01, fs=250.0, seed=4)
    np.testing.assert_array_equal(np.load(a[0]), ref.signal)
    assert len(list(cache.glob("ecg-*.npy"))) == 1 and len(list(cache.glob("ecg-*.truth.npz"))) == 1
    assert not list(cache.glob(".tmp-*"))  # nothing half-written is left
    b = (tmp_path / "b.npy", tmp_path / "b.npz")
    ecg, hit = synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=4, cache_dir=cache)
    assert hit and ecg is None
    np.testing.assert_array_equal(np.load(b[0]), ref.signal)
    with np.load(b[1]) as t:
        np.testing.assert_array_equal(t["r_peaks"], ref.r_peaks)
        np.testing.assert_array_equal(t["labels"], ref.labels)
        assert float(t["fs"]) == 250.0
    entry = next(cache.glob("ecg-*[0-9a-f].npy"))
    assert b[0].stat().st_ino == entry.stat().st_ino  # a hit links the entry (one file system here)
    # another seed, or a changed generator, is another entry; writing it where a link to an entry
    # was replaces the link and leaves the entry as it was
    assert not synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=5, cache_dir=cache)[1]
    assert b[0].stat().st_ino != entry.stat().st_ino
    np.testing.assert_array_equal(np.load(entry), ref.signal)
    np.testing.assert_array_equal(np.load(b[0]), synthesize_ecg(hours=0.01, fs=250.0, seed=5).signal)
    # where no hard link can be made, the entry is copied
    c = (tmp_path / "c.npy", tmp_path / "c.npz")

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(synth.os, "link", no_link)
    assert synth.synthesize_cached(*c, hours=0.01, fs=250.0, seed=4, cache_dir=cache)[1]
    assert c[0].stat().st_ino != entry.stat().st_ino
    np.testing.assert_array_equal(np.load(c[0]), ref.signal)
    monkeypatch.undo()
    real = synth.Path.read_bytes
    monkeypatch.setattr(synth.Path, "read_bytes", lambda self: real(self) + b"# changed")
    assert not synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=4, cache_dir=cache)[1]
    monkeypatch.undo()
    # an entry missing its truth is not an entry; "off" and an unwritable folder only cost the generation
    for t in cache.glob("ecg-*.truth.npz"):
        t.unlink()
    assert not synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=4, cache_dir=cache)[1]
    assert not synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=4, cache_dir="off")[1]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert not synth.synthesize_cached(*b, hours=0.01, fs=250.0, seed=4, cache_dir=blocker / "sub")[1]
    np.testing.assert_array_equal(np.load(b[0]), ref.signal)


# ----------------------------------------------------------------------------------------------
# ectopy (APCs, couplets, runs, multiform PVCs) and unreadable episodes
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ectopic():
    """Two hours with much ectopy (many APCs, couplets and runs), clean enough to measure waves."""
    return synthesize_ecg(2.0, fs=250.0, seed=21, pvc_rate=0.05, apc_rate=0.05, couplet_share=0.2,
                          run_share=0.1, noise_mv=0.005, wander_mv=0.0, powerline_mv=0.0, episodes_per_hour=0.0)


def test_apc_prematurity_and_non_compensatory_pause(ectopic):
    e = ectopic
    r, lab = e.r_peaks / e.fs, e.labels
    sinus = np.isin(lab, (0, 2))
    i = np.flatnonzero(lab == 3)
    i = i[(i >= 2) & (i < lab.size - 1)]
    i = i[sinus[i - 1] & sinus[i - 2] & sinus[i + 1]]
    assert i.size > 200  # (every APC has a sinus beat before and after it; two before for most)
    prev_rr = r[i - 1] - r[i - 2]
    coupling = (r[i] - r[i - 1]) / prev_rr
    assert np.all(coupling < 0.95) and np.median(coupling) < 0.8 and np.quantile(coupling, 0.05) < 0.65, (coupling.min(), coupling.max())
    # the sinus node is reset: the next beat about one RR after the APC, and the interval around the
    # APC well short of two RR (a PVC's compensatory pause makes it two)
    pause = (r[i + 1] - r[i]) / prev_rr
    assert 0.9 < np.median(pause) < 1.15 and np.all(pause < 1.3), (np.median(pause), pause.max())
    around = (r[i + 1] - r[i - 1]) / prev_rr
    assert np.median(around) < 1.85 and np.quantile(around, 0.9) < 1.95, np.quantile(around, [0.5, 0.9])
    # every beat-to-beat interval fits the segmenter's 100..256 samples at 250 Hz
    d = np.diff(e.r_peaks)
    assert d.min() >= 100 and d.max() <= 256, (d.min(), d.max())


def test_apc_has_the_usual_qrs_and_a_changed_p_wave(ectopic):
    e, fs = ectopic, ectopic.fs
    sig = e.signal.astype(np.float64)
    normal = e.r_peaks[e.labels == 0][5:-5]
    apc = e.r_peaks[e.labels == 3]
    w_n = np.median([_half_amplitude_width(sig, r, fs) for r in normal[:500]])
    w_a = np.median([_half_amplitude_width(sig, r, fs) for r in apc])
    assert abs(w_a / w_n - 1.0) < 0.15, (w_n, w_a)  # narrow: not a PVC's
    amp = lambda r: sig[r] - _baseline(sig, r, int(0.3 * fs))  # noqa: E731
    assert abs(np.median([amp(r) for r in apc]) / np.median([amp(r) for r in normal[:500]]) - 1.0) < 0.15
    # the P-wave stretch (250..60 ms before R) against the normal beats' median stretch
    seg = lambda r: sig[r - int(0.25 * fs) : r - int(0.06 * fs)] - sig[r - int(0.06 * fs)]  # noqa: E731
    template = np.median([seg(r) for r in normal[:500]], axis=0)
    dist = lambda rs: np.median([np.sqrt(np.mean((seg(r) - template) ** 2)) for r in rs])  # noqa: E731
    assert dist(apc) > 3 * dist(normal[500:1000]), (dist(apc), dist(normal[500:1000]))


def test_couplets_and_runs(ectopic):
    e = ectopic
    lab, rl, d = e.labels, e.run_length, np.diff(e.r_peaks)
    v = lab == 1
    # run_length is the length of each stretch of consecutive PVCs; 0 off them
    edges = np.diff(np.r_[0, v.astype(int), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    lengths = ends - starts
    np.testing.assert_array_equal(rl[v], np.repeat(lengths, lengths))
    assert np.all(rl[~v] == 0)
    assert (lengths == 2).sum() > 10 and (lengths >= 3).sum() > 5 and lengths.max() <= 8
    assert set(np.unique(lengths[lengths >= 3])) >= {3, 8}
    # a couplet's and a run's later beats come fast, at no less than 0.41 s, and a sinus beat follows
    inner = np.concatenate([d[s : s + n - 1] for s, n in zip(starts, lengths) if n >= 3])
    assert inner.min() >= 0.41 * e.fs - 1 and inner.max() <= 0.52 * e.fs, (inner.min(), inner.max())
    couplet = np.array([d[s] for s, n in zip(starts, lengths) if n == 2])
    assert couplet.min() >= 0.41 * e.fs - 1 and couplet.max() <= 0.56 * e.fs
    assert np.all(np.isin(lab[ends[ends < lab.size]], (0, 2)))
    assert d.min() >= 100 and d.max() <= 256, (d.min(), d.max())
    # the pause after a couplet or run resets the sinus rhythm: at most 1 s
    assert np.all(d[ends[(lengths >= 2) & (ends < lab.size)] - 1] <= 1.0 * e.fs + 1)


def test_pvcs_are_multiform(ectopic):
    e, fs = ectopic, ectopic.fs
    sig = e.signal.astype(np.float64)
    v = e.labels == 1
    assert np.all(e.pvc_form[~v] == -1)
    forms = np.bincount(e.pvc_form[v], minlength=3)
    assert forms.size == 3 and np.all(forms / v.sum() > 0.08), forms
    sign = np.sign([sig[r] - _baseline(sig, r, int(0.3 * fs)) for r in e.r_peaks[v]])
    assert np.all(sign[e.pvc_form[v] == 1] < 0)  # the inverted focus
    assert np.all(sign[e.pvc_form[v] != 1] > 0)
    # a run keeps the form of its first beat
    runs = np.flatnonzero(np.diff(np.r_[0, (e.run_length >= 3).astype(int)]) == 1)
    for s in runs:
        n = e.run_length[s]
        assert np.all(e.pvc_form[s : s + n] == e.pvc_form[s])


def test_unreadable_episodes_in_the_truth():
    fs = 250.0
    e = synthesize_ecg(1.0, fs=fs, seed=23, episodes_per_hour=6.0)
    spans, why = e.unreadable, e.unreadable_reason
    assert spans.dtype == np.int64 and spans.shape == (6, 2)
    assert sorted(why.tolist()) == sorted(UNREADABLE_REASONS * 2)  # the kinds come in turn
    dur = (spans[:, 1] - spans[:, 0]) / fs
    assert np.all(dur >= 5.0 - 1 / fs) and np.all(dur <= 60.0 + 1 / fs), dur
    assert np.all(spans[1:, 0] > spans[:-1, 1]) and spans[0, 0] > 0 and spans[-1, 1] < e.signal.size
    inside = np.zeros(e.signal.size, bool)
    for a, b in spans:
        inside[a:b] = True
    # the beats under them stay in the truth, with their class, flagged
    np.testing.assert_array_equal(e.beat_unreadable, inside[e.r_peaks])
    assert e.beat_unreadable.sum() > 0.8 * dur.sum() * 0.8
    assert np.all(np.isin(e.labels[e.beat_unreadable], (0, 1, 3)))
    sig = e.signal.astype(np.float64)
    hf_out = np.std(np.diff(sig[~inside]))
    for (a, b), reason in zip(spans, why):
        x = sig[a:b]
        if reason == "lead_off":  # a flat line, a step at its ends
            assert np.ptp(x) == 0.0
            assert abs(x[0] - np.median(sig[a - 50 : a])) > 0.4 and abs(x[-1] - np.median(sig[b : b + 50])) > 0.4
        elif reason == "noise":  # broadband, far above the QRS's slopes
            mid = x[int(0.3 * fs) : -int(0.3 * fs)]
            assert np.std(np.diff(mid)) > 10 * hf_out and np.std(mid) > 0.4
        else:  # clipped at a rail
            assert np.mean(np.abs(x) >= RAIL_MV - 1e-6) > 0.4
    assert np.abs(sig).max() <= RAIL_MV
    # none at all without episodes
    e = synthesize_ecg(0.5, seed=23, episodes_per_hour=0.0)
    assert e.unreadable.shape == (0, 2) and not e.beat_unreadable.any()


def test_episodes_fit_short_recordings():
    """Episodes that do not fit half of a short stream are left out, never made to overlap."""
    e = synthesize_ecg(0.02, seed=3, episodes_per_hour=500.0)  # 72 s
    spans = e.unreadable
    assert spans.shape[0] >= 1
    assert np.all(spans[1:, 0] > spans[:-1, 1])
    assert (spans[:, 1] - spans[:, 0]).sum() <= 0.5 * e.signal.size


def test_default_run_has_every_kind_of_event():
    """The default run's recording (20 h, seed 0): PVCs ~2 % with couplets and runs, APCs ~1 %,
    3..6 unreadable episodes of 5..60 s of every kind, and intervals in the segmenter's range."""
    e = synthesize_ecg()
    counts = np.bincount(e.labels, minlength=4)
    assert 0.015 < counts[1] / e.labels.size < 0.025 and 0.006 < counts[3] / e.labels.size < 0.014, counts
    assert counts[2] > 40
    rl = e.run_length
    assert (rl == 2).sum() // 2 >= 20 and len(np.flatnonzero(np.diff(np.r_[0, rl >= 3]) == 1)) >= 3
    assert len(set(e.pvc_form[e.labels == 1].tolist())) == 3
    assert 3 <= e.unreadable.shape[0] <= 6 and set(e.unreadable_reason.tolist()) == set(UNREADABLE_REASONS)
    dur = np.diff(e.unreadable, axis=1).ravel() / e.fs
    assert np.all((dur >= 5.0 - 0.01) & (dur <= 60.0 + 0.01))
    d = np.diff(e.r_peaks)
    assert d.min() >= 100 and d.max() <= 256

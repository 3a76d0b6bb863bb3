"""Beat classes (beatflow.score.classes): the array code against loop references, the rule on made-up beats
and on the synthetic ECG's truth, the runs and burden a Holter report counts."""
import math

import numpy as np
import pytest

from beatflow.detect import detect_peaks
from beatflow.embed import beat_rows
from beatflow.io.synth import synthesize_ecg
from beatflow.params import SegmentParams
from beatflow.score import classes as C
from beatflow.score.metrics import match_beats
from tests import naive

FS = 250.0
PRE = SegmentParams().samples(FS).pre


def _qrs(width: int, shift: int = 0, wide: float = 1.0, sign: float = 1.0):
    t = np.arange(width, dtype=np.float64) - PRE - shift
    return sign * (np.exp(-0.5 * (t / (3.0 * wide)) ** 2) - 0.3 * np.exp(-0.5 * ((t - 8 * wide) / (4.0 * wide)) ** 2))


def test_morphology_is_the_best_aligned_correlation_of_a_loop(rng=np.random.default_rng(0)):
    p = C.ClassParams()
    a, b, lag = p.window(FS, PRE)
    rows = rng.normal(size=(40, 256)).astype(np.float32)
    rows[:20] += 5 * _qrs(256, shift=3).astype(np.float32)  # half of them a QRS, moved by 3 samples
    tmpl = _qrs(256).astype(np.float32)
    dev = C.morphology(rows, tmpl, FS, PRE)
    _, at = C._best_lag(rows, tmpl, a, b, lag)
    for i in range(len(rows)):
        want, l = naive.best_aligned_corr(rows[i], tmpl, a, b, lag)
        assert dev[i] == pytest.approx(1 - want, abs=2e-5)
        assert abs(at[i] - l) <= 1  # (ties within float32 round-off may pick a neighbour)
    assert (dev[:20] < 0.2).all() and (dev[20:] > 0.5).all()


def test_template_aligns_the_beats_before_the_median(rng=np.random.default_rng(1)):
    shifts = rng.integers(-6, 7, size=400)
    rows = np.stack([_qrs(256, int(s)) for s in shifts]).astype(np.float32)
    rows += rng.normal(scale=0.02, size=rows.shape).astype(np.float32)
    plain = np.median(rows, axis=0)
    tmpl = C.template(rows, FS, PRE)
    truth = _qrs(256, int(np.median(shifts)))
    assert np.abs(tmpl - truth).max() < 0.1 < np.abs(plain - truth).max()
    assert C.template(np.zeros((0, 256), np.float32), FS, PRE).shape == (256,)


def test_rhythm_against_a_loop(rng=np.random.default_rng(2)):
    peaks = np.cumsum(rng.integers(120, 260, size=300))
    at = np.sort(rng.choice(peaks, size=120, replace=False))
    p = C.ClassParams()
    want = naive.beat_timing(peaks, at, FS, p.local_beats, p.irregular_beats)
    for chunk in (65536, 7):  # (7: the neighbourhoods taken in chunks, some of one beat)
        got = C.rhythm(peaks, at, FS, p, chunk=chunk)
        for key in ("rr_prev_s", "rr_next_s", "local_rr_s", "prematurity", "pause", "irregularity"):
            w = np.asarray([d[key] for d in want])
            np.testing.assert_allclose(got[key], w, rtol=1e-12, equal_nan=True, err_msg=key)
    assert math.isnan(C.rhythm(peaks, peaks[:1], FS)["rr_prev_s"][0])  # the first beat has none before it
    for beats in (p.long_beats, 31):  # (31: windows inside the 300 beats; 150: clipped at both ends)
        t = C.rhythm(peaks, at, FS, C.ClassParams(long_beats=beats))
        np.testing.assert_allclose(t["long_prematurity"], 1.0 - t["rr_prev_s"] / naive.long_rr(peaks, at, FS, beats),
                                   rtol=1e-12, equal_nan=True)


def _stream(n=600, every=7, rng=np.random.default_rng(3)):
    """Beats at a steady 0.8 s with noise; every ``every``-th a wide inverted premature beat (V) followed by
    a pause, a few narrow premature ones (S) with a reset."""
    gaps, kind = [], []
    for i in range(n):
        if i % every == 3:
            gaps += [0.5, 1.1]
            kind += ["V", "N"]
        elif i % 50 == 20:
            gaps += [0.55, 0.8]
            kind += ["S", "N"]
        else:
            gaps.append(0.8 + rng.normal(scale=0.01))
            kind.append("N")
    peaks = np.round(np.cumsum(gaps) * FS).astype(np.int64)
    rows = np.stack([_qrs(256, wide=2.2, sign=-1.0) if k == "V" else _qrs(256) for k in kind]).astype(np.float32)
    rows += rng.normal(scale=0.03, size=rows.shape).astype(np.float32)
    return peaks, rows, np.asarray(kind)


def test_the_rule_finds_made_up_v_and_s_beats():
    peaks, rows, kind = _stream()
    dev = C.morphology(rows, C.template(rows, FS, PRE), FS, PRE)
    got, timing = C.classify({0: peaks}, peaks, np.zeros(len(peaks), np.int64), dev, FS)
    inner = slice(25, -25)  # (the ends lack the local rhythm's neighbours)
    assert (got[inner] == kind[inner]).mean() > 0.99
    assert ((got == "V") == (kind == "V"))[inner].all()
    assert timing["prematurity"][kind == "S"][1:-1].min() > 0.25


def test_atrial_fibrillation_is_not_called_s(rng=np.random.default_rng(4)):
    """An irregular rhythm with normal QRS complexes: its early beats are N (AAMI), not S."""
    gaps = rng.uniform(0.45, 1.1, size=800)
    peaks = np.round(np.cumsum(gaps) * FS).astype(np.int64)
    rows = np.stack([_qrs(256) for _ in peaks]).astype(np.float32) + rng.normal(scale=0.03, size=(800, 256)).astype(np.float32)
    dev = C.morphology(rows, C.template(rows, FS, PRE), FS, PRE)
    got, _ = C.classify({0: peaks}, peaks, np.zeros(800, np.int64), dev, FS)
    assert (got == "S").mean() < 0.02 and (got == "V").mean() < 0.01  # (1.6 % S: the windows that happen to look regular)


def test_each_recording_is_judged_on_its_own_spread():
    """Two recordings, one noisier: the noisier one's normal beats are not V for the other's spread."""
    p1, r1, k1 = _stream(rng=np.random.default_rng(5))
    p2, r2, k2 = _stream(rng=np.random.default_rng(6))
    r2 = r2 + np.random.default_rng(7).normal(scale=0.15, size=r2.shape).astype(np.float32)
    devs = [C.morphology(r, C.template(r, FS, PRE), FS, PRE) for r in (r1, r2)]
    rec = np.repeat([0, 1], [len(p1), len(p2)])
    got, _ = C.classify({0: p1, 1: p2}, np.concatenate([p1, p2]), rec, np.concatenate(devs), FS)
    kind = np.concatenate([k1, k2])
    v = kind == "V"
    assert ((got == "V") & v).sum() / v.sum() > 0.95 and ((got == "V") & ~v).sum() / (got == "V").sum() < 0.05
    with pytest.raises(ValueError, match="recording labels"):
        C.assign(np.zeros(3), {"prematurity": np.zeros(3), "pause": np.zeros(3), "irregularity": np.zeros(3)},
                 np.zeros(2))


def test_runs_and_burden():
    c = np.asarray(list("NVNVVNVVVVNSNSSNNV"))
    rec = np.zeros(len(c), np.int64)
    assert C.runs(c, "V", rec) == {"isolated": 2, "couplets": 1, "runs": 1, "longest": 4}
    assert C.runs(c, "S", rec) == {"isolated": 1, "couplets": 1, "runs": 0, "longest": 2}
    # a run does not cross from one recording into the next
    rec2 = np.asarray([0] * 8 + [1] * 10)
    assert C.runs(c, "V", rec2) == {"isolated": 2, "couplets": 3, "runs": 0, "longest": 2}
    s = C.class_summary(c, rec)
    assert s["counts"] == {"N": 7, "S": 3, "V": 8, "F": 0, "Q": 0} and s["v_burden_pct"] == pytest.approx(800 / 18)
    assert C.class_summary(np.zeros(0, "<U1"))["v_burden_pct"] == 0.0


def test_synthetic_pvcs_are_found():
    e = synthesize_ecg(hours=0.5, seed=11)
    s = SegmentParams().samples(e.fs)
    pk = np.asarray(detect_peaks(e.signal, s))
    kb, peak, start, length, rows, _ = beat_rows(e.signal, pk, s, e.signal.shape[0], baseline_samples=max(1, s.pre // 2))
    rows = np.asarray(rows)
    dev = C.morphology(rows, C.template(rows, e.fs, s.pre), e.fs, s.pre)
    got, _ = C.classify({0: pk}, peak, np.zeros(len(peak), np.int64), dev, e.fs)
    _, m = match_beats(np.asarray(peak), e.r_peaks, int(0.15 * e.fs))
    ok = m >= 0
    truth_v = e.labels[ok] == 1
    assigned_v = got[m[ok]] == "V"
    assert truth_v.sum() > 20
    assert (assigned_v & truth_v).sum() / truth_v.sum() > 0.95
    assert (assigned_v & truth_v).sum() / assigned_v.sum() > 0.9


def test_classes_on_cupy_equal_numpy():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no CUDA device")
    peaks, rows, _ = _stream()
    t = C.template(rows, FS, PRE)
    d = C.morphology(rows, t, FS, PRE)
    td = C.template(cp.asarray(rows), FS, PRE)
    dd = C.morphology(cp.asarray(rows), td, FS, PRE)
    np.testing.assert_allclose(cp.asnumpy(td), t, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(dd), d, atol=1e-5)
    f = C.features(rows, t, FS, PRE)
    fd = C.features(cp.asarray(rows), td, FS, PRE)
    assert isinstance(fd, cp.ndarray) and fd.shape == f.shape
    np.testing.assert_allclose(cp.asnumpy(fd), f, atol=1e-4)
    np.testing.assert_array_equal(C.assign(fd, C.rhythm(peaks, peaks, FS)), C.assign(f, C.rhythm(peaks, peaks, FS)))
    w = C.qrs_width(rows, FS)
    wd = C.qrs_width(cp.asarray(rows), FS)
    assert isinstance(wd, cp.ndarray) and wd.dtype == cp.float32
    np.testing.assert_allclose(cp.asnumpy(wd), w, atol=1e-5)


def test_features_against_a_loop(rng=np.random.default_rng(8)):
    p = C.ClassParams()
    a, b, lag = p.window(FS, PRE)
    k = round(p.width_slope_s * FS)
    rows = rng.normal(scale=0.2, size=(30, 256)).astype(np.float32)
    rows[:15] += 3 * _qrs(256, shift=2).astype(np.float32)
    rows[15:] += 2 * _qrs(256, wide=2.0, sign=-1.0).astype(np.float32)
    tmpl = (2 * _qrs(256)).astype(np.float32)
    got = C.features(rows, tmpl, FS, PRE)
    assert got.shape == (30, len(C.FEATURES)) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0], C.morphology(rows, tmpl, FS, PRE), atol=1e-6)
    for i in range(len(rows)):
        corr, l = naive.best_aligned_corr(rows[i], tmpl, a, b, lag)
        w = [float(x) for x in rows[i][a + l : b + l]]
        t = [float(x) for x in tmpl[a:b]]
        mean_w, mean_t = sum(w) / len(w), sum(t) / len(t)
        sd_w = math.sqrt(sum((x - mean_w) ** 2 for x in w) / len(w))
        sd_t = math.sqrt(sum((x - mean_t) ** 2 for x in t) / len(t))
        assert got[i, 0] == pytest.approx(1 - corr, abs=2e-5)
        assert got[i, 1] == pytest.approx(math.log(sd_w / sd_t), abs=1e-4)
        assert got[i, 2] == pytest.approx(sum(w) / sum(abs(x) for x in t), abs=1e-4)
        assert got[i, 3] == pytest.approx(naive.qrs_width(w, FS, k) - naive.qrs_width(t, FS, k), abs=1e-5)
    # the upright beats' area is positive (1.5 times the template's), the inverted wide ones' negative
    assert (got[:15, 2] > 0.5).all() and (got[15:, 2] < 0).all()


def test_qrs_width_against_a_loop(rng=np.random.default_rng(15)):
    win = rng.normal(size=(50, 60)).astype(np.float32)
    win[:10] = np.cumsum(win[:10], axis=1)  # (random walks: their slope's mass anywhere)
    win[10:20] = 3 * _qrs(60, shift=20 - PRE, wide=0.5 + 0.1 * np.arange(10)[:, None]).astype(np.float32)
    win[20] = 0.0  # flat: 0
    win[21, :] = 1.0
    win[21, 17] = 4.0  # one spike: its mass is in the two differences over it, crossed at 0.2 and 0.8 of them
    k = round(C.ClassParams().width_slope_s * FS)  # (2 samples)
    got = C.qrs_width(win, FS)
    assert got.shape == (50,) and got.dtype == np.float32
    for i in range(len(win)):
        assert got[i] == pytest.approx(naive.qrs_width(win[i], FS, k), abs=1e-5), i
    assert got[20] == 0.0 and got[21] == pytest.approx(2.6 / FS, abs=1e-6)
    one = C.qrs_width(win, FS, C.ClassParams(width_slope_s=1 / FS))
    np.testing.assert_allclose(one, [naive.qrs_width(w, FS, 1) for w in win], atol=1e-5)
    with pytest.raises(ValueError, match="too short"):
        C.qrs_width(win[:, :2], FS)
    # a wider QRS (the same shape stretched in time) is measured wider, in proportion
    assert (np.diff(got[10:20]) > 0).all()
    assert got[19] / got[10] == pytest.approx(1.4 / 0.5, rel=0.15)
    assert C.qrs_width(np.zeros((0, 60), np.float32), FS).shape == (0,)


def test_shape_z_against_a_loop(rng=np.random.default_rng(9)):
    p = C.ClassParams()
    n = 300
    f = np.stack([rng.lognormal(-4, 0.5, n), rng.normal(0, 0.1, n), rng.normal(1, 0.1, n), rng.normal(0, 0.004, n)],
                 axis=1)
    f[::7, 3] += 0.04  # some of them wide
    f[::5, 0] = rng.uniform(0.2, 0.6, len(f[::5]))  # a fifth of the beats unlike the template
    rec = np.repeat([0, 1, 2], [120, 100, 80])
    got = C.shape_z(f, rec, p)
    lo_q, span = 0.05, float(__import__("scipy.stats").stats.norm.ppf(p.z_low) - __import__("scipy.stats").stats.norm.ppf(0.05))
    for r in range(3):
        idx = [i for i in range(n) if rec[i] == r]
        logd = [math.log(min(max(f[i, 0], 1e-4), 2.0)) for i in idx]
        lo, mid, half = (float(np.quantile(logd, q)) for q in (lo_q, p.z_low, 0.5))
        dom = [i for i, d in zip(idx, logd) if d <= half]
        for k, i in enumerate(idx):
            assert got[i, 0] == pytest.approx((logd[k] - mid) / max((mid - lo) / span, 0.05), rel=1e-9)
        for col in (1, 2):
            ref = sorted(f[j, col] for j in dom)
            med = float(np.median(ref))
            mad = float(np.median([abs(x - med) for x in ref])) * 1.482602218505602
            for i in idx:
                assert got[i, col] == pytest.approx(abs(f[i, col] - med) / max(mad, 0.01), rel=1e-9)
        med = float(np.median([f[j, 3] for j in dom]))
        mad = float(np.median([abs(f[j, 3] - med) for j in dom])) * 1.482602218505602
        for i in idx:  # (one-sided: a QRS narrower than the usual is 0)
            want = (f[i, 3] - med) / max(mad, C.WIDTH_FLOOR_S) if f[i, 3] > med else 0.0
            assert got[i, 3] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert got[::7, 3].min() > 5 and (got[:, 3] == 0).mean() > 0.4
    # the deviation alone: the amplitude's, area's and width's z are 0; the first three columns: the width's
    assert (C.shape_z(f[:, 0], rec, p)[:, 1:] == 0).all()
    np.testing.assert_array_equal(C.shape_z(f[:, :3], rec, p), np.concatenate([got[:, :3], np.zeros((n, 1))], 1))
    with pytest.raises(ValueError, match="recording labels"):
        C.shape_z(f, rec[:10], p)


def test_a_recording_of_many_v_beats_keeps_its_normal_spread(rng=np.random.default_rng(10)):
    """208-like: 45 % of the beats V, deviating only about 0.3 from the template, not premature (a V beat in
    place of a normal one): the normal beats' spread (the dominant half's) finds every one of them."""
    n = 800
    kind = np.where(rng.random(n) < 0.45, "V", "N")
    peaks = np.round(np.cumsum(0.8 + rng.normal(scale=0.01, size=n)) * FS).astype(np.int64)
    rows = np.stack([_qrs(256, wide=1.6) if k == "V" else _qrs(256) for k in kind]).astype(np.float32)
    rows += rng.normal(scale=0.03, size=rows.shape).astype(np.float32)
    f = C.features(rows, C.template(rows, FS, PRE), FS, PRE)
    assert np.median(f[kind == "V", 0]) < 0.4
    got, _ = C.classify({0: peaks}, peaks, np.zeros(n, np.int64), f, FS)
    inner = slice(25, -25)
    assert (got[inner] == kind[inner]).mean() > 0.98


def test_compensation_keeps_an_aberrant_atrial_beat_from_v():
    """An early beat of a changed QRS with a non-compensatory pause (it resets the sinus rhythm) is V without the
    compensation gates and S with them (that of the early criterion and that of the early-regular path); one
    with a full compensatory pause stays V."""
    peaks, rows, kind = _stream()
    s = np.flatnonzero(kind == "S")
    rows = rows.copy()
    rows[s] = 0.7 * rows[s] + 0.3 * _qrs(256, wide=2.2, sign=-1.0).astype(np.float32)  # aberrant (deviation 0.16)
    f = C.features(rows, C.template(rows, FS, PRE), FS, PRE)
    rec = np.zeros(len(peaks), np.int64)
    plain, timing = C.classify({0: peaks}, peaks, rec, f, FS, C.ClassParams(v_z_alone=np.inf))
    gated, _ = C.classify({0: peaks}, peaks, rec, f, FS, C.ClassParams(v_z_alone=np.inf, v_compensation=1.8,
                                                                      v_early_compensation=1.8))
    comp = (timing["rr_prev_s"] + timing["rr_next_s"]) / timing["local_rr_s"]
    inner = s[(s > 25) & (s < len(peaks) - 25)]
    assert (plain[inner] == "V").all() and (comp[inner] < 1.8).all()
    assert (gated[inner] == "S").all()
    v = np.flatnonzero(kind == "V")[5:-5]
    assert (gated[v] == "V").all()


def test_pre_qrs_and_p_wave_against_a_loop(rng=np.random.default_rng(11)):
    p = C.ClassParams()
    x = rng.normal(size=3000).astype(np.float32)
    x0 = 500  # (the stretch starts at sample 500 of the stream)
    peaks = np.sort(rng.choice(np.arange(x0 + 10, x0 + 3000), size=60, replace=False))  # some windows clipped
    got = C.pre_qrs(x, x0, peaks, FS, p)
    want = naive.pre_qrs(x, x0, peaks, FS, p.p_before_s, p.p_after_s)
    assert got.dtype == np.float32 and got.shape == (60, int(round(p.p_before_s * FS)) - int(round(p.p_after_s * FS)))
    np.testing.assert_array_equal(got, want)
    dom = rng.random(60) < 0.5
    np.testing.assert_allclose(C.p_wave(got, dom), naive.p_deviation(got, dom), atol=1e-9)
    np.testing.assert_allclose(C.p_wave(got, dom, chunk=7), C.p_wave(got, dom), atol=1e-12)  # (in chunks: the same)
    assert C.p_wave(np.zeros((0, 10), np.float32), np.zeros(0, bool)).shape == (0,)


def _p_stream(rng, n=900, s_every=30, run_at=None, p_sign=-1.0, run=40):
    """A steady rhythm (0.8 s) whose sinus beats have an upright P wave 160 ms before the R peak; every
    ``s_every``-th beat an atrial one, only 10 % early, its P wave ``p_sign`` (inverted: from low in the atria).
    With ``run_at`` (and no ``s_every``), a run of ``run`` atrial beats there, 0.5 s after the beat before it,
    then at 0.62 s. Returns the stream, the peaks, the rows and the
    kinds."""
    gaps, kind = [], []
    for i in range(n):
        if run_at is not None and run_at <= i < run_at + run:
            gaps.append((0.5 if i == run_at else 0.62) + rng.normal(scale=0.004))
            kind.append("S")
        elif s_every and i % s_every == 15:
            gaps += [0.72, 0.85]
            kind += ["S", "N"]
        else:
            gaps.append(0.8 + rng.normal(scale=0.01))
            kind.append("N")
    peaks = np.round(np.cumsum(gaps) * FS).astype(np.int64)
    x = rng.normal(scale=0.02, size=int(peaks[-1] + FS)).astype(np.float32)
    t = np.arange(-40, 41)
    for pk, k in zip(peaks, kind):
        x[pk - 40 : pk + 41] += np.exp(-0.5 * (t / 3.0) ** 2)  # the QRS
        at = pk - int(0.16 * FS)
        x[at - 40 : at + 41] += (p_sign if k == "S" else 1.0) * 0.15 * np.exp(-0.5 * (t / 6.0) ** 2)
    rows = np.stack([x[pk - PRE : pk - PRE + 256] for pk in peaks]).astype(np.float32)
    return x, peaks, rows, np.asarray(kind)


def test_the_p_wave_finds_atrial_beats_that_timing_alone_misses(rng=np.random.default_rng(12)):
    x, peaks, rows, kind = _p_stream(rng)
    f = C.features(rows, C.template(rows, FS, PRE), FS, PRE)
    p = C.ClassParams()
    rec = np.zeros(len(peaks), np.int64)
    plain, _ = C.classify({0: peaks}, peaks, rec, f, FS, p)
    win = C.pre_qrs(x, 0, peaks, FS, p)
    got, timing = C.classify({0: peaks}, peaks, rec, np.concatenate([f, win], axis=1), FS, p)
    # the partitions' pieces (uneven, one empty) give the same as the whole, two recordings too
    whole = np.concatenate([f, win], axis=1)
    cuts = [0, 7, 7, len(peaks) // 2, len(peaks)]
    pieces = [whole[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    got2, timing2 = C.classify({0: peaks}, peaks, rec, pieces, FS, p)
    np.testing.assert_array_equal(got2, got)
    np.testing.assert_array_equal(timing2["p_deviation"], timing["p_deviation"])
    np.testing.assert_array_equal(timing2["episode_p"], timing["episode_p"])
    ep = C.episode(timing, p)  # (one recording: the episode of its whole timing)
    np.testing.assert_array_equal(timing["episode_p"], ep["episode_p"])
    np.testing.assert_array_equal(timing["episode_irregularity"], ep["episode_irregularity"])
    assert "episode_p" not in C.classify({0: peaks}, peaks, rec, f, FS, p)[1]  # (no P windows: no episode)
    rec2 = (np.arange(len(peaks)) >= len(peaks) // 3).astype(np.int64)
    peaks_of = {0: peaks[rec2 == 0], 1: peaks[rec2 == 1]}
    np.testing.assert_array_equal(C.classify(peaks_of, peaks, rec2, pieces, FS, p)[0],
                                  C.classify(peaks_of, peaks, rec2, whole, FS, p)[0])
    s = kind == "S"
    assert (plain[s] == "S").mean() < 0.1  # (10 % early: below s_premature)
    assert (got[s] == "S").mean() > 0.9 and (got[~s] == "S").sum() <= 2
    assert np.median(timing["p_deviation"][s]) > 1.0 > 0.2 > np.median(timing["p_deviation"][~s])
    np.testing.assert_allclose(C.s_score(timing, p)[1:], (timing["prematurity"] + p.s_score_p * timing["p_deviation"])[1:])
    assert C.s_score(timing, p)[0] == p.s_score_p * timing["p_deviation"][0]  # (the first beat has no prematurity)
    # irregular (atrial fibrillation: no P wave, f waves) stays N
    gaps = rng.uniform(0.45, 1.1, size=800)
    pk = np.round(np.cumsum(gaps) * FS).astype(np.int64)
    xf = (0.05 * np.sin(2 * np.pi * 6.0 * np.arange(pk[-1] + 250) / FS) + rng.normal(scale=0.02, size=pk[-1] + 250))
    tq = np.arange(-40, 41)
    for q in pk:
        xf[q - 40 : q + 41] += np.exp(-0.5 * (tq / 3.0) ** 2)
    rf = np.stack([xf[q - PRE : q - PRE + 256] for q in pk]).astype(np.float32)
    ff = np.concatenate([C.features(rf, C.template(rf, FS, PRE), FS, PRE), C.pre_qrs(xf.astype(np.float32), 0, pk, FS, p)], 1)
    af, _ = C.classify({0: pk}, pk, np.zeros(len(pk), np.int64), ff, FS, p)
    assert (af == "S").mean() < 0.02


def test_pre_qrs_on_cupy_equals_numpy(rng=np.random.default_rng(14)):
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no CUDA device")
    x, peaks, rows, _ = _p_stream(rng, n=300)
    p = C.ClassParams()
    win = C.pre_qrs(x, 100, peaks + 100, FS, p)
    wd = C.pre_qrs(cp.asarray(x), 100, cp.asarray(peaks + 100), FS, p)
    assert isinstance(wd, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(wd), win)
    f = C.features(cp.asarray(rows), C.template(cp.asarray(rows), FS, PRE), FS, PRE)
    rec = np.zeros(len(peaks), np.int64)
    got, t = C.classify({0: peaks}, peaks, rec, cp.concatenate([f, wd], axis=1), FS, p)
    want, tw = C.classify({0: peaks}, peaks, rec, np.concatenate([cp.asnumpy(f), win], axis=1), FS, p)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(t["p_deviation"], tw["p_deviation"], atol=1e-6)


def test_a_wide_qrs_has_a_large_width_z(rng=np.random.default_rng(16)):
    """A tenth of the beats of a wider QRS (1.5 times), in noise: their width is larger than the narrow beats' by
    its own measure, and their width's z is above nearly every narrow beat's."""
    n = 900
    kind = np.where(rng.random(n) < 0.1, "V", "N")
    rows = np.stack([_qrs(256, wide=1.5) if k == "V" else _qrs(256) for k in kind]).astype(np.float32)
    rows += rng.normal(scale=0.02, size=rows.shape).astype(np.float32)
    f = C.features(rows, C.template(rows, FS, PRE), FS, PRE)
    v = kind == "V"
    a, b, _ = C.ClassParams().window(FS, PRE)
    clean = C.qrs_width(np.stack([_qrs(256, wide=1.5), _qrs(256)])[:, a:b], FS)  # (no noise, no lag)
    assert np.median(f[v, 3]) - np.median(f[~v, 3]) == pytest.approx(clean[0] - clean[1], rel=0.3)
    assert clean[0] - clean[1] > 0.008
    z = C.shape_z(f)
    assert np.quantile(z[v, 3], 0.05) > np.quantile(z[~v, 3], 0.99) and np.median(z[v, 3]) > 5
    assert np.median(z[~v, 3]) < 1 and (z[:, 3] >= 0).all()


def test_the_width_paths_of_the_rule():
    """On time, deviating (z 3.5: above ``v_z``, below ``v_z_alone``): N by default; V when also wide, by the
    ``v_wide`` path or by the width's weight in the shape z, a narrow one staying N."""
    n = 6
    dev = np.full(n, 0.1)
    z = np.zeros((n, 4))
    z[:, 0] = 3.5
    z[:3, 3], z[3:, 3] = 6.0, 0.5  # the first three wide
    timing = {"prematurity": np.zeros(n), "pause": np.ones(n), "irregularity": np.full(n, 0.02),
              "rr_prev_s": np.full(n, 0.8), "rr_next_s": np.full(n, 0.8), "local_rr_s": np.full(n, 0.8)}
    assert (C.judge(dev, z, timing, C.ClassParams(v_z=3.0, v_z_alone=8.0, v_width=0.0)) == "N").all()
    want = np.asarray(list("VVVNNN"))
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(v_z=3.0, v_z_alone=8.0, v_width=0.0, v_wide=4.0)), want)
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(v_z=3.0, v_width=1.0, v_z_alone=5.0)), want)
    assert (C.judge(dev, z, timing, C.ClassParams(v_z=3.0, v_z_alone=8.0, v_width=0.0, v_wide=8.0)) == "N").all()
    assert (C.judge(np.full(n, 0.04), z, timing, C.ClassParams(v_z=3.0, v_z_alone=8.0, v_width=0.0, v_wide=4.0)) == "N").all()  # (below v_min_dev)
    assert (C.judge(dev, z[:, :3], timing, C.ClassParams(v_z=3.0, v_z_alone=8.0, v_width=0.0, v_wide=4.0)) == "N").all()  # (no width: none wide)


def test_the_early_regular_path_of_the_rule():
    """Premature, in a regular rhythm, without the sinus P wave, before a compensatory pause, deviating with a
    shape z of 4.5 (below ``v_z`` 6): N with the path off, V with ``v_z_early`` 3; each gate it fails keeps a beat N (an
    irregular rhythm, atrial fibrillation's; a sinus P wave; no compensatory pause; too little prematurity; a
    shape z or a deviation too small)."""
    #             V    irregular  sinus P  no pause  on time  z 2.5  dev 0.04
    prem = np.array([0.35, 0.35, 0.35, 0.35, 0.05, 0.35, 0.35])
    irr = np.array([0.02, 0.25, 0.02, 0.02, 0.02, 0.02, 0.02])
    pdev = np.array([1.5, 1.5, 0.1, 1.5, 1.5, 1.5, 1.5])
    rr_next = np.array([1.05, 1.05, 1.05, 0.65, 1.05, 1.05, 1.05])  # (the local RR 0.8: 0.52 + 1.05 = 1.96 of it)
    zs = np.array([4.5, 4.5, 4.5, 4.5, 4.5, 2.5, 4.5])
    dev = np.array([0.35, 0.35, 0.35, 0.35, 0.35, 0.35, 0.04])  # (correlation 0.65: below s_corr, never S)
    n = len(prem)
    local = np.full(n, 0.8)
    timing = {"prematurity": prem, "pause": rr_next / local, "irregularity": irr, "rr_prev_s": (1 - prem) * local,
              "rr_next_s": rr_next, "local_rr_s": local, "p_deviation": pdev}
    z = np.zeros((n, 4))
    z[:, 0] = zs
    on = C.ClassParams(v_z_early=3.0, v_early_premature=0.15, v_early_irregular=0.1, v_early_p_dev=0.3,
                       v_early_compensation=1.8)
    # (the path off: the shape z is below v_z; the last beat, of the usual QRS, is premature without the sinus P: S)
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(v_z_early=np.inf)), np.asarray(list("NNNNNNS")))
    # the defaults: the path on, the P deviation's and the compensatory pause's gates off
    np.testing.assert_array_equal(C.judge(dev, z, timing), np.asarray(list("VNVVNNS")))
    np.testing.assert_array_equal(C.judge(dev, z, timing, on), np.asarray(list("VNNNNNS")))
    # each gate off lets its beat through
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(**{**on.to_dict(), "v_early_p_dev": -np.inf})),
                                  np.asarray(list("VNVNNNS")))
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(**{**on.to_dict(), "v_early_compensation": 0.0})),
                                  np.asarray(list("VNNVNNS")))
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(**{**on.to_dict(), "v_early_irregular": 0.3})),
                                  np.asarray(list("VVNNNNS")))
    # without the P windows the P deviation counts as the sinus P wave's: the gate keeps every beat N
    no_p = {k: v for k, v in timing.items() if k != "p_deviation"}
    np.testing.assert_array_equal(C.judge(dev, z, no_p, on), np.asarray(list("NNNNNNS")))


def _wide_beats(n, z0, area, wide=20.0):
    """Shape z rows of beats unlike the template by their width (z ``wide``: above ``v_z_alone`` with ``v_width``
    1), their deviation's and area's z ``z0`` and ``area``."""
    z = np.zeros((n, 4))
    z[:, 0], z[:, 2], z[:, 3] = z0, area, wide
    return z


def _timing(prem, pause, irr, pdev=None, long_prem=None, local=0.8):
    prem, pause = np.asarray(prem, float), np.asarray(pause, float)
    n = len(prem)
    loc = np.full(n, local)
    t = {"prematurity": prem, "pause": pause, "irregularity": np.broadcast_to(np.asarray(irr, float), (n,)).copy(),
         "rr_prev_s": (1 - prem) * loc, "rr_next_s": pause * loc, "local_rr_s": loc}
    if pdev is not None:
        t["p_deviation"] = np.asarray(pdev, float)
    if long_prem is not None:
        t["long_prematurity"] = np.asarray(long_prem, float)
    return t


def test_the_aberrant_gate_of_the_rule():
    """Wide (the width's z 20: V by the shape alone), its deviation's and area's z low: very early, before no
    compensatory pause (the sinus node reset), in a regular enough rhythm, an aberrated atrial beat: not V with
    ``v_aberrant_premature`` 0.45 (of the usual QRS correlation, premature with a changed P wave: S); each gate
    it fails keeps a beat V (a compensatory pause; less early; an irregular rhythm; a deviation's z above
    ``v_aberrant_z``; the next beat early too, with ``v_aberrant_pause`` 0.8)."""
    #        aberrated  pause  less early  irregular  z 7   next early
    prem = [0.5, 0.5, 0.3, 0.5, 0.5, 0.5]
    pause = [1.1, 1.5, 1.3, 1.1, 1.1, 0.5]
    irr = [0.1, 0.1, 0.1, 0.4, 0.1, 0.1]
    z0 = np.array([5.4, 5.4, 5.4, 5.4, 7.0, 5.4])
    n = len(prem)
    z = _wide_beats(n, 0.0, 2.0)
    z[:, 0] = z0
    dev = np.full(n, 0.25)
    timing = _timing(prem, pause, irr, pdev=np.full(n, 1.0))
    assert (C.judge(dev, z, timing, C.ClassParams(v_aberrant_premature=np.inf)) == "V").all()
    on = C.ClassParams(v_aberrant_premature=0.45, v_aberrant_compensation=1.7, v_aberrant_irregular=0.3,
                       v_aberrant_z=6.0, v_aberrant_pause=0.0)
    np.testing.assert_array_equal(C.judge(dev, z, timing, on), np.asarray(list("SVVVVS")))
    np.testing.assert_array_equal(C.judge(dev, z, timing, C.ClassParams(**{**on.to_dict(), "v_aberrant_pause": 0.8})),
                                  np.asarray(list("SVVVVV")))


def test_the_sinus_and_on_time_gates_of_the_rule():
    """Wide (V by the shape alone), its deviation's and area's z low: after a sinus P wave (P deviation below
    ``v_sinus_p_dev``) not V; on time, its deviation's z below ``v_ontime_z``, a P wave before it (below
    ``v_ontime_p_dev``): not V; each gate it fails keeps a beat V (a changed or missing P wave, a deviation's z
    too high, premature)."""
    #                 sinus P  no P  P unknown  z 5   |  on time  z 3.5  premature  P changed
    pdev = np.array([0.2, 1.2, np.nan, 0.2, 0.5, 0.5, 0.5, 1.2])
    z0 = np.array([3.0, 3.0, 3.0, 5.0, 2.0, 3.5, 2.0, 2.0])
    prem = np.array([0.3, 0.3, 0.3, 0.3, 0.0, 0.0, 0.2, 0.0])
    n = len(pdev)
    z = _wide_beats(n, 0.0, 1.0)
    z[:, 0] = z0
    dev = np.full(n, 0.35)  # (correlation 0.65: below s_corr, never S)
    timing = _timing(prem, np.full(n, 1.4), 0.02, pdev=pdev)
    off = C.ClassParams(v_sinus_p_dev=-np.inf, v_ontime_z=-np.inf)
    assert (C.judge(dev, z, timing, off) == "V").all()
    sinus = C.ClassParams(**{**off.to_dict(), "v_sinus_p_dev": 0.5, "v_sinus_z": 4.0})
    np.testing.assert_array_equal(C.judge(dev, z, timing, sinus), np.asarray(list("NVVVVVVV")))
    ontime = C.ClassParams(**{**off.to_dict(), "v_ontime_z": 3.0, "v_ontime_premature": 0.1, "v_ontime_p_dev": 0.9})
    np.testing.assert_array_equal(C.judge(dev, z, timing, ontime), np.asarray(list("VVVVNVVV")))
    # without the P windows neither gate acts
    no_p = {k: v for k, v in timing.items() if k != "p_deviation"}
    both = C.ClassParams(**{**sinus.to_dict(), "v_ontime_z": 3.0})
    assert (C.judge(dev, z, no_p, both) == "V").all()


def test_s_runs_carried_on():
    """A run of atrial beats at its own rate: its first beat premature with a changed P wave (S), the next ones
    not premature against a local RR the run sets, at the first one's rate with its P wave: S with ``s_run_rr``
    0.1 (N with it off); a beat of another P wave ends the run, and so does one of another rate (the sinus beat
    after the run), one of another QRS, and one as slow as the longer rhythm."""
    #         sinus  S    run  run  other P  run?  |  S   run  slower | S  run  other QRS  run | S  not faster
    prem = [0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0, -0.4, 0.3, 0.0, 0.0, 0.0, 0.3, 0.0]
    pdev = [0.05, 0.9, 0.9, 0.95, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    lp = [0.0, 0.3, 0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 0.1, 0.3, 0.1, 0.1, 0.1, 0.3, -0.01]  # (the run's below s_long)
    n = len(prem)
    t = _timing(prem, np.ones(n), 0.02, pdev=pdev, long_prem=lp)
    t["rr_prev_s"] = np.where(np.arange(n) >= 1, 0.56, 0.8)  # (the run's rate; the local RR follows it)
    t["rr_prev_s"][8] = 0.8
    dev = np.full(n, 0.05)
    dev[11] = 0.5  # (correlation 0.5: not the usual QRS)
    z = np.zeros((n, 4))
    off = C.ClassParams(s_run_rr=0.0)
    np.testing.assert_array_equal(C.judge(dev, z, t, off), np.asarray(list("NSNNNNSNNSNNNSN")))
    on = C.ClassParams(s_run_rr=0.1, s_run_p_dev=0.2, s_run_p=0.6)
    np.testing.assert_array_equal(C.judge(dev, z, t, on), np.asarray(list("NSSSNNSSNSSNNSN")))


def test_episode_against_a_loop(rng=np.random.default_rng(17)):
    """The episode's medians: over the ``episode_beats`` beats centred on each beat, the ends repeated, NaN
    counted as 1."""
    n = 90
    t = {"p_deviation": rng.uniform(0, 1.5, size=n), "irregularity": rng.uniform(0, 0.4, size=n)}
    t["p_deviation"][[0, 40]] = np.nan
    t["irregularity"][[1, 2, 89]] = np.nan
    for beats in (31, 5, 1):
        got = C.episode(t, C.ClassParams(episode_beats=beats))
        h = beats // 2
        for key, name in (("p_deviation", "episode_p"), ("irregularity", "episode_irregularity")):
            v = np.nan_to_num(t[key], nan=1.0)
            want = [np.median(v[np.clip(np.arange(i - h, i + h + 1), 0, n - 1)]) for i in range(n)]
            np.testing.assert_allclose(got[name], want, err_msg=f"{name} {beats}")
    assert C.episode({"p_deviation": np.zeros(0), "irregularity": np.zeros(0)})["episode_p"].shape == (0,)


def _episode_timing(prem, irr, pdev, long_prem=None, p=C.ClassParams()):
    t = _timing(prem, np.ones(len(prem)), irr, pdev=pdev, long_prem=long_prem)
    return {**t, **C.episode(t, p)}


def test_no_s_within_atrial_fibrillation():
    """Early beats of the usual QRS in a stretch of no sinus P wave (P deviation about 1 throughout) and an
    irregularity of 0.13, below ``s_irregular``: within atrial fibrillation, N (AAMI); S with the gate off
    (``s_af_p`` off). The same early beat in a sinus stretch as irregular, its own P wave changed, is S; and so
    is one in a regular stretch without the sinus P wave (an ectopic atrial rhythm, not fibrillation)."""
    n = 120
    prem = np.zeros(n)
    early = [20, 50, 80, 100]
    prem[early] = 0.3
    af = _episode_timing(prem, 0.13, np.full(n, 1.0))
    assert (C.judge(np.full(n, 0.01), np.zeros((n, 4)), af) == "N").all()
    got = C.judge(np.full(n, 0.01), np.zeros((n, 4)), af, C.ClassParams(s_af_p=np.inf))
    np.testing.assert_array_equal(np.flatnonzero(got == "S"), early)
    pdev = np.full(n, 0.05)
    pdev[early] = 1.0
    sinus = _episode_timing(prem, 0.13, pdev)
    assert (sinus["episode_p"] < 0.1).all()
    np.testing.assert_array_equal(np.flatnonzero(C.judge(np.full(n, 0.01), np.zeros((n, 4)), sinus) == "S"), early)
    regular = _episode_timing(prem, 0.05, np.full(n, 1.0))  # (no sinus P wave, regular: not fibrillation)
    np.testing.assert_array_equal(np.flatnonzero(C.judge(np.full(n, 0.01), np.zeros((n, 4)), regular) == "S"), early)
    # the gate's two thresholds: an episode irregularity at or below s_af_irregular, a P deviation at or below s_af_p
    assert (C.judge(np.full(n, 0.01), np.zeros((n, 4)), af, C.ClassParams(s_af_irregular=0.13)) == "S").sum() == 4
    assert (C.judge(np.full(n, 0.01), np.zeros((n, 4)), af, C.ClassParams(s_af_p=1.0)) == "S").sum() == 4


def test_s_by_the_long_prematurity_alone():
    """A beat of the usual QRS and of the sinus P wave, on time against the local rhythm (an atrial run sets
    it) but faster by more than ``s_long_alone`` (0.3) than the rhythm on both sides: S whatever its P wave;
    N at 0.25, and N with the path off (its P deviation below ``s_p_long``)."""
    n = 6
    lp = np.array([0.0, 0.35, 0.45, 0.25, 0.31, 0.0])
    t = _episode_timing(np.zeros(n), 0.03, np.full(n, 0.1), long_prem=lp)
    np.testing.assert_array_equal(C.judge(np.full(n, 0.01), np.zeros((n, 4)), t), np.asarray(list("NSSNSN")))
    assert (C.judge(np.full(n, 0.01), np.zeros((n, 4)), t, C.ClassParams(s_long_alone=np.inf)) == "N").all()
    wide = np.full(n, 0.5)  # (correlation 0.5: not the usual QRS)
    assert (C.judge(wide, np.zeros((n, 4)), t) == "N").all()

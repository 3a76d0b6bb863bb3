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
    got = C.rhythm(peaks, at, FS, p)
    want = naive.beat_timing(peaks, at, FS, p.local_beats, p.irregular_beats)
    for key in ("rr_prev_s", "rr_next_s", "local_rr_s", "prematurity", "pause", "irregularity"):
        w = np.asarray([d[key] for d in want])
        np.testing.assert_allclose(got[key], w, rtol=1e-12, equal_nan=True, err_msg=key)
    assert math.isnan(C.rhythm(peaks, peaks[:1], FS)["rr_prev_s"][0])  # the first beat has none before it


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

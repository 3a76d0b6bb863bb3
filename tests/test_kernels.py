"""The CUDA kernels (beatflow.detect.gpu, beatflow.embed.gpu) against the array code and the loop
references of tests/naive.py.

On a machine with a CUDA GPU and CuPy they run there, on CuPy arrays. Elsewhere they run under
Numba's CUDA simulator (scripts/test.sh exports NUMBA_ENABLE_CUDASIM=1; this module also turns it
on when Numba's CUDA target has not been imported yet). Sizes are small: the simulator runs one
Python thread per CUDA thread.
"""
import os
import subprocess
import sys

import warnings

import numpy as np
import pytest

import naive
import beatflow.detect as D
import beatflow.embed as E
from beatflow.embed import beats as B
from beatflow.detect import peaks as S
from beatflow.device import cupy_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mode():
    """``"gpu"`` (CuPy + CUDA), ``"sim"`` (Numba's simulator) or None (neither can run here)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        pass
    elif cupy_available():
        return "gpu"
    elif "numba.cuda" not in sys.modules:  # not imported yet: it can still become the simulator
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        if "numba.core.config" in sys.modules:
            sys.modules["numba.core.config"].reload_config()
    try:
        from beatflow.gpu.sim import simulator_active

        return "sim" if simulator_active() else None
    except Exception:
        return None


MODE = _mode()
pytestmark = pytest.mark.skipif(MODE is None, reason="no CUDA GPU and the Numba CUDA simulator is not active")

from beatflow.detect import gpu as K  # noqa: E402
from beatflow.detect import gpu_kernels as GK  # noqa: E402
from beatflow.detect import gpu_vf as VF  # noqa: E402
from beatflow.detect.gpu import local_maxima_gpu  # noqa: E402
from beatflow.embed import gpu as EG  # noqa: E402
from beatflow.embed.gpu import embed_gpu  # noqa: E402
from beatflow.gpu import runtime as RT  # noqa: E402


def dev(a):
    """An input array for the kernels: CuPy on a GPU, NumPy under the simulator."""
    if MODE == "gpu":
        import cupy

        return cupy.asarray(a)
    return np.asarray(a)


def host(a):
    return a.get() if hasattr(a, "__cuda_array_interface__") else np.asarray(a)


# --- non-maximum suppression ---------------------------------------------------------------------
def _env_cases():
    rng = np.random.default_rng(7)
    env = np.abs(rng.normal(size=300))
    env[rng.integers(0, 300, 25)] = 0.5  # ties
    env[40:52] = 3.0  # a plateau: every sample of it is a maximum
    env[100:110] = 0.0  # zeros are never maxima
    env[0], env[-1] = 9.0, 8.0  # maxima at both ends (clipped window)
    env[200:203] = [-1.0, -2.0, -1.0]  # negative values are not maxima either
    return env


@pytest.mark.parametrize("tiled", [True, False])
def test_local_maxima_matches_loop(tiled):
    env = _env_cases()
    for name, env, halves in (("float64", env, (0, 1, 4, 50)), ("float32", env.astype(np.float32), (4,))):
        for half in halves:
            got = local_maxima_gpu(dev(env), half, tiled=tiled)
            assert got.dtype == np.int64
            want = naive.local_maxima(env, half)
            np.testing.assert_array_equal(host(got), want, err_msg=f"{name} half={half} tiled={tiled}")
            if name == "float64":
                np.testing.assert_array_equal(want, S.local_maxima_xp(env, half))  # the array code's contract


def test_local_maxima_short_and_flat():
    for env in ([], [1.0], [0.0], [2.0, 2.0], [1.0, 3.0], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0]):
        env = np.asarray(env, dtype=np.float64)
        for half in (1, 3):
            got = host(local_maxima_gpu(dev(env), half))
            np.testing.assert_array_equal(got, naive.local_maxima(env, half), err_msg=f"{env} half={half}")


def test_local_maxima_grid_stride_over_many_tiles():
    # more tiles than the simulator's blocks (and a window wider than a tile's halo is cheap to stage)
    rng = np.random.default_rng(3)
    env = np.round(np.abs(rng.normal(size=1100)), 1)  # rounding makes many ties
    for half in (2, 70):
        np.testing.assert_array_equal(host(local_maxima_gpu(dev(env), half)), naive.local_maxima(env, half))


def test_local_maxima_rejects_negative_window():
    with pytest.raises(ValueError):
        local_maxima_gpu(dev(np.ones(4)), -1)


# --- beat embedding ------------------------------------------------------------------------------
def _beats(rng, nx, n, width, lo=1):
    length = rng.integers(lo, width + 1, n)
    start = rng.integers(0, nx - width, n)
    return start, length


def _check_embed(x, start, length, width, first, base, claim=EG._EMBED_CLAIM):
    """Kernel vs loop reference and beats.embed_xp for valid beats (0 < length <= width), zeros for the others."""
    got, p2p = embed_gpu(dev(x), dev(start + first), dev(length), width, first=first, baseline_samples=base,
                         claim=claim)
    got, p2p = host(got), host(p2p)
    assert got.shape == (len(start), width) and got.dtype == np.float32 and p2p.dtype == np.float32
    ok = (length > 0) & (length <= width)
    # the loop averages a beat shorter than the baseline stretch over its own samples only
    full = ok & (length >= base)
    want, wp2p = naive.embed(x, start[full], length[full], width, baseline_samples=base)
    # float32 round-off of the baseline mean (float64 in the kernel and the loop, float32 in NumPy)
    tol = dict(rtol=0, atol=8 * np.finfo(np.float32).eps * (1 + float(np.abs(x).max())))
    np.testing.assert_allclose(got[full], want, **tol)
    np.testing.assert_allclose(p2p[full], wp2p, **tol)
    assert not got[~ok].any() and not p2p[~ok].any()  # skipped beats: zero rows
    # and the NumPy implementation it stands in for (same rows, same order)
    np_rows, np_p2p = B.embed_xp(x, start[ok] + first, length[ok], width, first=first, baseline_samples=base)
    np.testing.assert_allclose(got[ok], np_rows, **tol)
    np.testing.assert_allclose(p2p[ok], np_p2p, **tol)


@pytest.mark.parametrize("width,first", [(64, 0), (256, 37), (376, 1000)])
def test_embed_matches_loop(width, first):
    rng = np.random.default_rng(width)
    x = (rng.normal(size=3 * width) * 100 + 50).astype(np.float32)
    start, length = _beats(rng, len(x), 9, width)
    length[0], length[1] = width, 1  # full row; a single sample
    for base in (0, 5):
        _check_embed(x, start, length, width, first, base)


def test_embed_skips_bad_lengths_and_keeps_beat_order():
    rng = np.random.default_rng(11)
    width = 64
    x = rng.normal(size=900)  # float64 input: rows are float32 like beats.embed_xp's
    start, length = _beats(rng, len(x), 24, width)
    length[[2, 9, 17]] = [0, width + 1, 5 * width]  # skipped zero rows among the others
    # warps claim one row at a time (the seed's), a few, more than a warp's share, more than all
    for claim in (1, 3, 4, 7, 100):
        _check_embed(x, start, length, width, 0, 3, claim=claim)
    with pytest.raises(ValueError, match="claim must be positive"):
        embed_gpu(dev(x), dev(start), dev(length), width, claim=0)


def test_embed_beat_at_the_end_of_x():
    x = np.arange(100, dtype=np.float32)
    start, length = np.array([60, 0]), np.array([40, 10])
    rows, p2p = embed_gpu(dev(x), dev(start), dev(length), 48)
    np.testing.assert_array_equal(host(rows)[0, :40], x[60:])
    assert not host(rows)[0, 40:].any()
    np.testing.assert_array_equal(host(p2p), [39.0, 9.0])


def test_embed_never_reads_outside_x():
    # beats outside x break the contract; the kernel clips its reads (the simulator raises on any
    # out-of-range index) and still writes only its own rows
    x = np.ones(50, dtype=np.float32)
    start, length = np.array([-20, 45, 500]), np.array([30, 30, 10])
    rows, p2p = embed_gpu(dev(x), dev(start), dev(length), 32, baseline_samples=4)
    assert host(rows).shape == (3, 32) and np.isfinite(host(rows)).all() and np.isfinite(host(p2p)).all()


def test_embed_empty():
    rows, p2p = embed_gpu(dev(np.ones(10, np.float32)), dev(np.zeros(0, np.int64)), dev(np.zeros(0, np.int64)), 16)
    assert host(rows).shape == (0, 16) and host(p2p).shape == (0,)


def test_exclusive_scan_kernel_matches_cumsum():
    # one block over pieces of _SCAN_PER counts per thread: empty, partial and several pieces, the total
    _, sim = GK.build()
    ctx = RT.Ctx(sim)
    rng = np.random.default_rng(13)
    for n in (0, 1, 31, 128, 129, 1000, 5000):
        counts = rng.integers(0, 40, n).astype(np.int64)
        offsets, total = dev(np.full(n + 1, -1, np.int64)), dev(np.zeros(1, np.int64))
        K._exclusive_scan(ctx, dev(counts), offsets, total)
        want = np.concatenate([[0], np.cumsum(counts)])
        np.testing.assert_array_equal(host(offsets), want)
        assert int(host(total)[0]) == want[-1]


def test_beat_rows_kernels_match_the_array_code():
    # beats_count / beats_write / embed_warp with the count on the device against beats_from_peaks,
    # kept_mask, row_lengths and embed_xp: random gaps around the prune limits, peaks before `pre`,
    # long beats cut or dropped, several chunks of beats per block (grid-stride)
    import dataclasses

    from beatflow.embed.gpu import beat_rows_gpu

    rng = np.random.default_rng(12)
    base = small_params()
    for cut_long, first in ((True, 0), (False, 0), (True, 40)):
        s = dataclasses.replace(base, cut_long=cut_long)
        gaps = rng.integers(1, 2 * s.upper, size=330)
        peaks = np.cumsum(gaps) - gaps[0] + rng.integers(0, s.pre)  # the first peaks before `pre`
        peaks = np.concatenate([[0], peaks[peaks > 0]])
        if first:  # x starts at `first`: the beats lie in it
            peaks = peaks[peaks >= first + s.pre]
        n = int(peaks[-1]) + int(rng.integers(1, 50))
        x = (rng.normal(size=n) * 10).astype(np.float32)
        want = B.beat_rows_xp(x[first:], peaks, s, n, first=first, baseline_samples=3)  # the array code
        pk, st, ln = B.beats_from_peaks(peaks, s, n)
        kept = B.kept_mask(ln, s)
        np.testing.assert_array_equal(want[0], np.flatnonzero(kept))
        np.testing.assert_array_equal(want[1], pk[kept])
        got = beat_rows_gpu(dev(x[first:]), dev(peaks), s, n, first=first, baseline_samples=3)
        assert 0 < got[0].shape[0] < peaks.shape[0] - 1  # some beats dropped, some kept
        for g, w in zip(got[:4], want[:4]):
            assert host(g).dtype == np.int64
            np.testing.assert_array_equal(host(g), w)
        np.testing.assert_allclose(host(got[4]), want[4], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(host(got[5]), want[5], rtol=1e-5, atol=1e-4)
    for few in (np.zeros(0, np.int64), np.array([5]), np.array([1, 3])):  # no beat, or none kept
        got = beat_rows_gpu(dev(np.ones(20, np.float32)), dev(few), base, 20)
        assert [host(g).shape[0] for g in got] == [0] * 6 and host(got[4]).shape == (0, base.width)


def test_segment_rows_one_sync_matches_detection_then_beat_rows(monkeypatch):
    # the detection and the rows launched behind it before the one synchronisation: the peaks and
    # episodes of detect_beats, the kept beats and rows of beat_rows (NumPy), also when a tile's
    # candidate slots overflow (the whole launch runs again) and when the kernels cannot take x
    from beatflow.detect.gpu import segment_rows_gpu
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(250.0)
    # 40 s drawn at 125 Hz read as 20 s at 250 Hz: a fast rhythm (RR under a simulator tile's 128
    # samples), so one candidate slot per tile overflows
    x = synthesize_ecg(hours=40 / 3600, fs=125.0, seed=3).signal
    peaks, ep = D.detect_beats(x, s)
    want = E.beat_rows(x, peaks, s, x.shape[0], baseline_samples=12)
    assert want[0].shape[0] > 10
    orig = K._detect_gpu
    for slots in (None, 1):  # one slot per tile in the first launch: overflow and the rerun
        calls = []

        def first_with(*a, **k):
            calls.append(a[4])
            return orig(*a[:4], slots if len(calls) == 1 else a[4], *a[5:], **k)

        monkeypatch.setattr(K, "_detect_gpu", first_with)
        got = segment_rows_gpu(dev(x), s, baseline_samples=12)
        assert len(calls) == (1 if slots is None else 2)
        np.testing.assert_array_equal(host(got[0]), peaks)
        np.testing.assert_array_equal(host(got[1]).reshape(-1, 2), ep.reshape(-1, 2))
        for g, w in zip(got[2:6], want[:4]):
            np.testing.assert_array_equal(host(g), w)
        np.testing.assert_allclose(host(got[6]), want[4], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(host(got[7]), want[5], rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(K, "_detect_gpu", orig)
    got = segment_rows_gpu(dev(np.ones(2, np.float32)), s)  # too short for the kernels: the array code
    assert host(got[0]).size == 0 and host(got[6]).shape == (0, s.width)


def test_segment_graph_replays_the_launches_over_the_buffers_contents(monkeypatch):
    # SegmentGraph: segment_rows_gpu's results for what the buffer holds at each call (new contents
    # written into it between calls), from the arrays kept by its first pass (no allocation after
    # it; the results are views of them); a CUDA graph on a GPU, the launches one by one under the
    # simulator; on an overflow of the candidate slots the retry's fresh arrays; bad buffers refused
    from beatflow.detect.gpu import SegmentGraph, segment_rows_gpu
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(250.0)
    # seed 3 fast (40 s drawn at 125 Hz read at 250 Hz: one candidate slot per tile overflows), seed 6
    # at its own pace
    xs = [synthesize_ecg(hours=40 / 3600, fs=125.0, seed=3).signal,
          synthesize_ecg(hours=20 / 3600, fs=250.0, seed=6).signal]
    want = [[host(v) for v in segment_rows_gpu(dev(x), s, baseline_samples=12)] for x in xs]
    assert want[0][0].shape != want[1][0].shape or not np.array_equal(want[0][0], want[1][0])

    def same(got, w):
        assert len(got) == 8
        for g, v in zip(got, w):
            np.testing.assert_array_equal(host(g), v)

    buf = dev(xs[0].copy())
    g = SegmentGraph(buf, s, baseline_samples=12)
    assert (g.graph is not None) == (MODE == "gpu")
    kept = len(g.ws.arrays)
    assert kept > 20
    for k in (0, 1, 0):
        buf[...] = dev(xs[k])
        got = g()
        same(got, want[k])
        assert len(g.ws.arrays) == kept and g.ws.i == kept and not g.ws.recording
        if MODE == "sim":  # the peaks and the rows are views of kept arrays
            for v in (got[0], got[6]):
                assert any(np.shares_memory(v, a) for a in g.ws.arrays)

    orig, retries = K._detect_launch, []  # the graph's passes with one candidate slot per tile: each call
    # overflows and runs the retry (with a slot per sample)

    def one_slot(ctx, plan, x, s_, first, core, _cap, rule, rows):
        if _cap is not None:
            retries.append(_cap)
        return orig(ctx, plan, x, s_, first, core, 1 if _cap is None else _cap, rule, rows)

    monkeypatch.setattr(K, "_detect_launch", one_slot)
    g1 = SegmentGraph(buf, s, baseline_samples=12)
    for k in (0, 1):
        buf[...] = dev(xs[k])
        got = g1()
        same(got, want[k])
        if k == 0:  # (the fast stream overflows one slot per tile; seed 6's may not)
            assert len(retries) == 1
            if MODE == "sim":
                assert not any(np.shares_memory(got[0], a) for a in g1.ws.arrays)
    monkeypatch.setattr(K, "_detect_launch", orig)

    for bad, msg in ((dev(np.ones((4, 4))), "contiguous 1-D"), (dev(np.ones(2)), "at least 3 samples"),
                     (dev(np.ones(40))[::2], "contiguous 1-D")):
        with pytest.raises(ValueError, match=msg) as e:
            SegmentGraph(bad, s)
        assert "\n" not in str(e.value)


def test_workspace_hands_out_its_arrays_in_order_and_refuses_another_pass():
    ws = RT.Workspace()
    a, b = ws.take(np, 3, np.int64), ws.take(np, (2, 4), np.float32)
    assert len(ws.arrays) == 2
    ws.rewind()
    assert ws.take(np, 3, np.int64) is a and ws.take(np, (2, 4), np.float32) is b
    with pytest.raises(RuntimeError, match="asked for array 3"):
        ws.take(np, 1, np.int8)
    ws.rewind()
    with pytest.raises(RuntimeError, match=r"as \(4,\) int64; the recorded pass made it \(3,\) int64"):
        ws.take(np, 4, np.int64)


@pytest.mark.skipif(MODE != "gpu", reason="needs CuPy on a CUDA GPU")
def test_host_input_gets_host_results_after_the_overflow_rerun(monkeypatch):
    # NumPy in, NumPy out, also when a tile's candidate slots overflow and the launch runs again
    # (the rerun sees the samples on the device); the same peaks and rows as without the overflow;
    # both stream layouts of the detection
    from beatflow.detect.gpu import segment_rows_gpu
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(250.0)
    x = synthesize_ecg(hours=60 / 3600, fs=250.0, seed=4).signal
    want = segment_rows_gpu(x, s, baseline_samples=12)
    assert all(isinstance(v, np.ndarray) for v in want)
    orig = K._detect_gpu
    for streams in (True, False):
        monkeypatch.setattr(K, "_STREAMS", streams)
        calls = []

        def first_with(*a, **k):
            calls.append(1)
            return orig(*a[:4], 1 if len(calls) == 1 else a[4], *a[5:], **k)

        monkeypatch.setattr(K, "_detect_gpu", first_with)
        got = segment_rows_gpu(x, s, baseline_samples=12)
        monkeypatch.setattr(K, "_detect_gpu", orig)
        assert len(calls) == 2
        assert all(isinstance(v, np.ndarray) for v in got)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


# --- without a GPU and without the simulator: one clear error -----------------------------------
def test_clear_error_without_cuda_or_simulator():
    # (on a GPU machine the device is hidden from the child: Numba then finds no CUDA GPU)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = ("from beatflow.errors import DeviceError\nfrom beatflow.detect.gpu import local_maxima_gpu\n"
            "import numpy as np\ntry:\n    local_maxima_gpu(np.ones(3), 1)\nexcept DeviceError as e:\n"
            "    print('DeviceError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert "DeviceError:" in r.stdout, r.stdout + r.stderr


# --- on a GPU: the dispatch from the NumPy-or-CuPy functions -------------------------------------
@pytest.mark.skipif(MODE != "gpu", reason="needs CuPy on a CUDA GPU")
def test_cupy_input_dispatches_to_kernels(synthetic_ecg):
    from beatflow.params import SegmentParams

    s = SegmentParams().samples(250.0)
    x = synthetic_ecg.signal
    peaks = D.detect_peaks(x, s)
    gpeaks = D.detect_peaks(dev(x), s)
    np.testing.assert_array_equal(host(gpeaks), peaks)
    _, start, length = B.beats_from_peaks(peaks, s, len(x))
    keep = B.prune_mask(length, s.lower, s.upper)
    rows, p2p = E.embed(x, start[keep], length[keep], s.width, baseline_samples=12)
    grows, gp2p = E.embed(dev(x), dev(start[keep]), dev(length[keep]), s.width, baseline_samples=12)
    np.testing.assert_allclose(host(grows), rows, atol=1e-5)
    np.testing.assert_allclose(host(gp2p), p2p, atol=1e-5)


# --- beat detection (beatflow.detect.detect_peaks on the GPU) ----------------------------------
from test_segment import _random_beats, small_params  # noqa: E402

from beatflow.detect.gpu import _detect_plan, detect_peaks_gpu, qrs_envelope_gpu  # noqa: E402


def test_envelope_kernel_matches_cpu_kernel_and_array_code():
    from beatflow.params import SegmentParams

    rng = np.random.default_rng(5)
    for fs, n, dtype in ((100.0, 700, np.float32), (250.0, 1100, np.float64), (360.0, 5, np.float32)):
        s = SegmentParams().samples(fs)
        x = (np.cumsum(rng.normal(size=n)) + 3 * rng.normal(size=n)).astype(dtype)
        got = host(qrs_envelope_gpu(dev(x), s))
        cpu = D.qrs_envelope(x, s)  # the fused CPU kernel: same sums in the same order
        ref = S.energy_envelope(S.wavelet_response(x, s), s)  # the array code
        np.testing.assert_allclose(got, cpu, rtol=1e-13, atol=1e-13 * np.abs(cpu).max())
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_block_median_kernel_is_nanmedian_of_the_window():
    # the median by ranks: ties, NaN blocks (left out), windows cut by the ends, a window of NaN only
    kernels, sim = GK.build()
    ctx = RT.Ctx(sim)
    rng = np.random.default_rng(21)
    for n, k in ((1, 2), (7, 1), (40, 3), (97, 5), (300, 0)):
        b = rng.integers(0, 6, n).astype(np.float64) * 0.25  # many equal values
        b[rng.random(n) < 0.2] = np.nan
        if n >= 40:
            b[10:10 + 2 * k + 3] = np.nan  # some windows with no value at all
        amp = dev(np.full(n, -1.0))
        ctx.launch(kernels["block_median"], ctx.blocks(-(-n // 32)), 32, 0, dev(b), k, amp)
        padded = np.concatenate([np.full(k, np.nan), b, np.full(k, np.nan)])
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows
            want = np.array([np.nanmedian(padded[i:i + 2 * k + 1]) for i in range(n)])
        np.testing.assert_array_equal(host(amp), want)


def test_block_levels_of_the_dense_kernel_match_array_code():
    rng = np.random.default_rng(6)
    x = (np.cumsum(rng.normal(size=1337)) + 3 * rng.normal(size=1337)).astype(np.float32)
    for blocks, block, first in ((2, 10, 0), (5, 25, 13), (1, 7, 300), (3, 600, 5)):
        s = small_params(block_s=block / 100.0, threshold_blocks=blocks)
        env, amp, b0 = qrs_envelope_gpu(dev(x), s, first=first, levels=True)
        want, wb0 = S.block_amplitude(D.qrs_envelope(x, s), first, s)
        assert b0 == wb0
        np.testing.assert_allclose(host(amp), want, rtol=1e-13)


@pytest.mark.parametrize("first", [0, 55])
def test_detect_peaks_kernels_match_array_code_and_loops(first, monkeypatch):
    # the random beats of test_segment exercise the T-wave test and the search-back with these params,
    # and a burst of noise in two of them the noise rule
    s = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3, block_s=0.3)
    assert _detect_plan(s, MODE == "sim") is not None  # the kernels run, not the array code's fallback
    noise = []
    orig = S.noise_mask
    monkeypatch.setattr(S, "noise_mask", lambda *a: (lambda m: (noise.append(int(m.sum())), m)[1])(orig(*a)))
    for seed in range(4):
        x = _random_beats(seed)
        if seed >= 2:
            x[400:800] += (0.15 * np.random.default_rng(100 + seed).normal(size=400)).astype(np.float32)
        want = naive.detect_peaks(x, s, first=first)
        np.testing.assert_array_equal(S.detect_peaks_xp(x, s, first=first), want)
        got = detect_peaks_gpu(dev(x), s, first=first)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(host(got), want, err_msg=f"seed {seed}")
        # one candidate slot per tile: the slots overflow and the detection reruns with one per sample
        np.testing.assert_array_equal(host(detect_peaks_gpu(dev(x), s, first=first, _cap=1)), want)
        core = (first + 300, first + 900)
        np.testing.assert_array_equal(host(detect_peaks_gpu(dev(x), s, first=first, core=core)),
                                      want[(want >= core[0]) & (want < core[1])])
    assert sum(noise) > 0  # the noise rule dropped candidates (in the array code, so in the kernels too)


def test_detect_peaks_kernels_on_synthetic_ecg_and_edge_cases():
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    s = SegmentParams().samples(250.0)
    x = synthesize_ecg(hours=20 / 3600, fs=250.0, seed=11).signal  # 20 s, default parameters
    want = D.detect_peaks(x, s)
    assert len(want) > 15
    np.testing.assert_array_equal(host(detect_peaks_gpu(dev(x), s)), want)
    for flat in (np.zeros(900, np.float32), np.full(900, 2.0, np.float32), np.ones(2, np.float32)):
        assert host(detect_peaks_gpu(dev(flat), s)).size == 0


@pytest.mark.parametrize("dip", [1.0, 0.8])
def test_detect_with_fast_candidates_runs_the_array_code_on_the_device(dip):
    # the fast-rhythm candidates (SegmentParams.fast_nms_s) are array code only: on the device the
    # detection runs it (with the NMS kernel) and gives the CPU's and the loops' peaks
    from beatflow.detect.gpu import SegmentGraph, detect_beats_gpu

    s = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3, block_s=0.3,
                     fast_nms_s=0.03, fast_rr_s=1.0, fast_rr_window_s=1.5, fast_dip=dip)
    off = small_params(nms_half_window_s=0.08, refractory_s=0.08, twave_window_s=0.2, threshold_blocks=3, block_s=0.3)
    changed = 0
    for seed in range(3):
        x = _random_beats(seed)
        want = naive.detect_peaks(x, s, first=55)
        np.testing.assert_array_equal(D.detect_peaks(x, s, first=55), want)
        np.testing.assert_array_equal(host(detect_peaks_gpu(dev(x), s, first=55)), naive.detect_peaks(x, s, first=55))
        np.testing.assert_array_equal(host(detect_beats_gpu(dev(x), s, first=55)[0]), want)
        changed += int(not np.array_equal(want, naive.detect_peaks(x, off, first=55)))
    assert changed > 0
    with pytest.raises(ValueError, match="fast-rhythm"):
        SegmentGraph(dev(_random_beats(0)), s)


# --- on a GPU: one partition's device memory through CuPy, Numba and PyTorch (no copies) ---------
@pytest.mark.skipif(MODE != "gpu", reason="needs CuPy on a CUDA GPU")
def test_zero_copy_one_partition_cupy_numba_torch(synthetic_ecg):
    import cupy
    import torch
    from numba import cuda

    from beatflow.engine.base import as_cuda_tensor, from_cuda_tensor
    from beatflow.params import SegmentParams

    s = SegmentParams().samples(250.0)
    stream = cupy.asarray(synthetic_ecg.signal)  # the loaded stream on the device
    a, b = 2000, 6000
    part = stream[a:b]  # one partition: a view, not a copy
    assert part.data.ptr == stream.data.ptr + a * stream.itemsize
    view = cuda.as_cuda_array(part)  # what Numba receives (CUDA array interface); later launches pack part.data.ptr
    assert view.device_ctypes_pointer.value == part.data.ptr
    peaks = D.detect_peaks(stream, s)  # the kernels, on CuPy arrays
    _, start, length = B.beats_from_peaks(peaks, s, stream.shape[0])
    sel = (start >= a) & (start + length <= b)
    rows, _ = E.embed(part, start[sel], length[sel], s.width, first=a)  # the warp-per-beat kernel
    assert isinstance(rows, cupy.ndarray) and rows.shape[0] == int(sel.sum()) > 3
    t = as_cuda_tensor(rows)  # to PyTorch for the engine: DLPack
    assert t.data_ptr() == rows.data.ptr and t.is_cuda
    t[0, 0] += 1.0  # one buffer: a write through PyTorch is seen by CuPy
    torch.cuda.synchronize()
    assert float(rows[0, 0]) == float(t[0, 0])
    back = from_cuda_tensor(t, "cupy")  # and back (scores come this way)
    assert back.data.ptr == rows.data.ptr


@pytest.mark.skipif(MODE != "gpu", reason="needs CuPy on a CUDA GPU")
def test_fast_launch_same_results_as_numba_launch(synthetic_ecg, monkeypatch):
    """Launches through CuPy's driver call (runtime.FastLaunch, arguments packed in Numba's ABI)
    give exactly what Numba's own launches give, and are the ones taken after the first call."""
    import cupy

    from beatflow.params import SegmentParams

    s = SegmentParams().samples(250.0)
    x = cupy.asarray(synthetic_ecg.signal)

    def run():
        peaks = K.detect_peaks_gpu(x, s)
        _, start, length = B.beats_from_peaks(peaks, s, x.shape[0])
        k = cupy.flatnonzero(B.kept_mask(length, s))
        rows, p2p = embed_gpu(x, start[k], B.row_lengths(length[k], s), s.width, baseline_samples=12)
        return host(peaks), host(rows), host(p2p)

    monkeypatch.setattr(RT, "FAST_LAUNCH", False)
    want = run()
    monkeypatch.setattr(RT, "FAST_LAUNCH", True)
    run()  # registers the compiled kernels
    fast = []
    orig = RT.FastLaunch.__call__
    monkeypatch.setattr(RT.FastLaunch, "__call__", lambda self, *a: (fast.append(self), orig(self, *a))[1])
    got = run()
    assert len(fast) >= 10, RT.FastLaunch.errors  # the detection's kernels and the embedding's
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


# --- the flutter rule (beatflow.detect.rhythm) as kernels: vf_energy, vf_near, vf_episodes ---------------
def test_flutter_kernels_match_array_code():
    """The kernels' flutter windows and episodes, and the peaks they let through, equal the array
    code's (rhythm.flutter_windows / flutter_rule / detect_beats_xp) on streams with a
    flutter episode, for even and odd windows, unaligned starts, a core, and runs of one window."""
    from test_rhythm import _flutter, _stream

    from beatflow.detect import rhythm as R
    from beatflow.params import SegmentParams

    fs = 100.0
    fired = 0
    # (the simulator takes ~15 s per pass over 24 s at 100 Hz: one start and one core per case)
    for seed, first, core, params in ((0, 0, None, {}),
                                      (1, 1137, (1137 + 700, 1137 + 2100),
                                       {"vf_window_s": 0.71, "vf_context": 1, "vf_min_windows": 3}),
                                      (2, 37, None, {"vf_min_windows": 1})):
        s = SegmentParams(**params).samples(fs)
        x, a, b = _stream(seed, fs, seconds=24.0)
        if seed == 2:  # noise, then a bare sinusoid: several short runs
            rng = np.random.default_rng(seed)
            x = np.concatenate([x[:900], rng.normal(size=400).astype(np.float32), _flutter(rng, 900, fs)])
        ctx, _, xp, xd = RT.vector_call(dev(x), "x")
        info = xp.zeros(4, dtype=xp.int64)
        episode, w0, spans = VF.flutter_pass(ctx, xd, s, first, first, first + x.shape[0], info)
        want, ww0 = R.flutter_windows(x, first, s)
        assert w0 == ww0
        np.testing.assert_array_equal(host(episode).astype(bool), want)
        fired += int(want.sum())
        spans = host(spans)[: int(host(info)[2])]
        np.testing.assert_array_equal(spans[np.argsort(spans[:, 0])], R.flutter_rule(x, np.zeros(0, np.int64), first, s)[1])
        peaks, ep = K.detect_beats_gpu(dev(x), s, first=first, core=core)
        wpeaks, wep = R.detect_beats_xp(x, s, first=first, core=core)
        np.testing.assert_array_equal(host(peaks), wpeaks)
        np.testing.assert_array_equal(host(ep), wep)
        assert wep.shape[0] > 0
    assert fired > 0


def _flutter_energies(x, s, first, blocks=4):
    """The flutter windows' energies ``(e_sig, e_slope)`` from the ``vf_energy`` kernel on
    ``blocks`` blocks (its loop strides over the tiles of windows)."""
    ctx, _, xp, xd = RT.vector_call(dev(x), "x")
    W = int(s.vf_window)
    nw = -(-(first - first // W * W + x.shape[0]) // W)
    e_sig, e_slope = xp.empty(nw), xp.empty(nw)
    tpb = RT.WARP if ctx.sim else VF._VF_CHUNKS * VF._VF_TILE
    kern = VF.build_vf(W, int(s.vf_highpass), int(s.kernel), tpb, GK.kernel_taps(int(s.kernel), float(s.a), True))
    ctx.launch(kern["vf_energy"], blocks, tpb, 0, xd, first, first // W, e_sig, e_slope)
    return host(e_sig), host(e_slope)

def test_flutter_energies_match_the_cpu_loops():
    """The flutter rule's per-window energies of the high-passed signal and of its slope from
    ``vf_energy`` equal ``cpu.flutter_features_cpu``'s to round-off: windows of several
    lengths, unaligned starts (the first window's samples before the stream repeat its first), a
    stream shorter than a window, and a high-pass reach beyond the slopes'. (Summed in the dense
    kernel instead, they made it 186 µs longer on the H200, more than ``vf_energy`` takes:
    ``bench/results/detection.md``.)"""
    from beatflow.detect.cpu import flutter_features_cpu
    from beatflow.params import SegmentParams

    rng = np.random.default_rng(5)
    x = (np.cumsum(rng.normal(size=1500)) * 0.05 + rng.normal(size=1500)).astype(np.float32)
    cases = ((250.0, {}, 0, x), (100.0, {"vf_window_s": 0.71}, 1137, x[:700]), (250.0, {}, 3, x[:100]),
             (100.0, {"vf_highpass_s": 1.5}, 37, x[:900]))
    for fs, params, first, xs in cases:
        s = SegmentParams(**params).samples(fs)
        want_sig, want_slope = flutter_features_cpu(xs, first, s.vf_window, s.vf_highpass,
                                                    S.gaussian_derivative(s.kernel, s.a))
        e_sig, e_slope = _flutter_energies(xs, s, first)
        np.testing.assert_allclose(e_sig, want_sig, rtol=1e-9, err_msg=f"{fs} {params} {first}")
        np.testing.assert_allclose(e_slope, want_slope, rtol=1e-9, err_msg=f"{fs} {params} {first}")
        one = _flutter_energies(xs, s, first, blocks=1)  # one block walks every tile of windows
        np.testing.assert_array_equal(one[0], e_sig)
        np.testing.assert_array_equal(one[1], e_slope)


def test_flutter_kernels_off_and_on_a_plain_ecg():
    """With the rule off the kernels' beats are the detection's; on an ECG without flutter, the
    rule changes nothing and lists no episode."""
    from beatflow.params import SegmentParams
    from beatflow.io.synth import synthesize_ecg

    x = synthesize_ecg(hours=12 / 3600, fs=100.0, seed=4).signal
    on = SegmentParams().samples(100.0)
    off = SegmentParams(vf_baseline_ratio=0.0).samples(100.0)
    want = S.detect_peaks_xp(x, on)
    for s in (on, off):
        peaks, ep = K.detect_beats_gpu(dev(x), s)
        np.testing.assert_array_equal(host(peaks), want)
        assert host(ep).shape == (0, 2)

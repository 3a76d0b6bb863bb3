"""Tests of beatflow.engine.base, .onnx and .validate: ONNX export, the ONNX Runtime engine and its validation."""
import copy
import pickle

import numpy as np
import onnx
import pytest
import torch

from beatflow.engine.base import Engine, EngineValidationError
from beatflow.engine.onnx import OnnxRuntimeEngine, export_onnx
from beatflow.engine.validate import profile_engine, throughput, validate_engine
from beatflow.model.train import train_vae
from beatflow.model.vae import LightVAE, Scorer, score_beats

WIDTH = 64


def beats(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, WIDTH, dtype=np.float32)
    centre = 0.5 + 0.03 * rng.standard_normal((n, 1))
    x = np.exp(-0.5 * ((t - centre) / 0.04) ** 2) + 0.05 * rng.standard_normal((n, WIDTH))
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def scorer():
    res = train_vae(beats(600, 0), epochs=2, batch_size=128, seed=3, lr=1e-2)
    return Scorer(res.model)


@pytest.fixture(scope="module")
def onnx_path(scorer, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "scorer.onnx"
    assert export_onnx(scorer, path, WIDTH) == str(path)
    return path


@pytest.fixture(scope="module")
def engine(onnx_path):
    return OnnxRuntimeEngine.load(onnx_path, intra_op_num_threads=1)


def test_exported_graph_has_named_dynamic_io(onnx_path):
    model = onnx.load(str(onnx_path))
    onnx.checker.check_model(model)
    (inp,) = model.graph.input
    assert inp.name == "beats"
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    dims = inp.type.tensor_type.shape.dim
    assert len(dims) == 2 and dims[0].dim_param and not dims[0].dim_value and dims[1].dim_value == WIDTH
    assert [o.name for o in model.graph.output] == ["score", "mu"]
    assert isinstance(OnnxRuntimeEngine.load(onnx_path), Engine)


@pytest.mark.parametrize("n", [1, 3, 1000])
def test_ort_matches_torch_for_any_batch(engine, scorer, n):
    x = beats(n, seed=10 + n)
    ref_s, ref_mu = score_beats(scorer, x)
    got_s, got_mu = engine.infer(x)
    assert got_s.dtype == np.float32 and got_s.shape == (n,)
    assert got_mu.dtype == np.float32 and got_mu.shape == (n, 2)
    np.testing.assert_allclose(got_s, ref_s, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_mu, ref_mu, atol=1e-4, rtol=0)


def test_chunked_inference_equals_single_batch(engine):
    x = beats(1000, seed=4).astype(np.float64)  # converted to float32 by infer
    s1, m1 = engine.infer(x, batch_size=8192)
    s2, m2 = engine.infer(x, batch_size=333)
    np.testing.assert_allclose(s1, s2, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(m1, m2, atol=1e-6, rtol=1e-5)
    s0, m0 = engine.infer(np.empty((0, WIDTH), np.float32))
    assert s0.shape == (0,) and m0.shape == (0, 2)


def test_validate_engine_accepts_the_right_engine(engine, scorer):
    err = validate_engine(engine, scorer, beats(500, seed=5))
    assert 0.0 <= err < 1e-4


def test_validate_engine_rejects_a_wrong_engine(scorer, tmp_path):
    wrong = copy.deepcopy(scorer)
    with torch.no_grad():
        wrong.vae.fc.bias.add_(0.5)
    path = export_onnx(wrong, tmp_path / "wrong.onnx", WIDTH, dynamo=False)  # legacy exporter: fast
    wrong_engine = OnnxRuntimeEngine.load(path)
    x = beats(200, seed=6)
    with pytest.raises(EngineValidationError, match=r"max abs error .* exceeds tolerance atol=0.0001") as info:
        validate_engine(wrong_engine, scorer, x)
    assert isinstance(info.value, RuntimeError)
    assert "\n" not in str(info.value)
    # ... while it does agree with the model it was exported from.
    assert validate_engine(wrong_engine, wrong, x) < 1e-4


def test_engine_pickles_and_saves(engine, scorer, tmp_path):
    x = beats(50, seed=7)
    clone = pickle.loads(pickle.dumps(engine))  # ships to Dask workers: bytes, not a session
    np.testing.assert_array_equal(clone.infer(x)[0], engine.infer(x)[0])
    engine.save(tmp_path / "copy.onnx")
    again = OnnxRuntimeEngine.load(tmp_path / "copy.onnx")
    np.testing.assert_array_equal(again.infer(x)[0], engine.infer(x)[0])
    assert again.width == WIDTH


def test_export_rejects_wrong_width(scorer, tmp_path):
    with pytest.raises(ValueError):
        export_onnx(scorer, tmp_path / "x.onnx", WIDTH * 2)


def test_build_from_lightvae_and_throughput(tmp_path):
    torch.manual_seed(0)
    vae = LightVAE(WIDTH)
    eng = OnnxRuntimeEngine.build(Scorer(vae), tmp_path / "fresh.onnx", dynamo=False)
    assert validate_engine(eng, vae, beats(64, seed=8)) < 1e-4
    rate = throughput(eng, beats(2048, seed=9), batch_size=512)
    assert np.isfinite(rate) and rate > 0


def test_profile_engine_times_latency_and_throughput_by_batch():
    import time

    class Slow(Engine):
        """1 ms per chunk of ``batch_size`` rows: latency 1 ms, throughput batch/1 ms."""
        name, precision, on_gpu, max_batch = "slow", "fp32", False, 1024

        def __init__(self):
            self.calls = 0

        @classmethod
        def build(cls, scorer, path, **options):
            return cls()

        def save(self, path):
            pass

        @classmethod
        def load(cls, path, **options):
            return cls()

        def infer(self, x, batch_size=8192):
            for _ in range(0, len(x), batch_size):
                self.calls += 1
                time.sleep(0.001)
            return np.zeros(len(x), np.float32), np.zeros((len(x), 2), np.float32)

    eng = Slow()
    prof = profile_engine(eng, beats(100, seed=1), (1, 32, 256, 8192), latency_calls=30, min_rows=512)
    assert prof["clock"] == "monotonic"
    lat = prof["latency_batch1_us"]
    assert lat["calls"] == 30 and 1000 <= lat["p50"] <= lat["p99"] < 50_000
    tp = prof["throughput_beats_per_s"]
    assert set(tp) == {1, 32, 256}  # 8192 is above the engine's max batch
    for b, rate in tp.items():
        assert 0.2 * b / 1e-3 < rate <= 1.01 * b / 1e-3, (b, rate)


# -- backends, precisions, rewrites (beatflow.engine.base, .onnx, .options) ---------------------------

def test_batch_profile():
    from beatflow.engine.base import BatchProfile

    assert tuple(BatchProfile.coerce((1, 1024, 8192))) == (1, 1024, 8192)
    assert tuple(BatchProfile.coerce(64)) == (1, 64, 64)
    assert BatchProfile(1, 1, 1).example == 2  # exported with a batch >= 2
    with pytest.raises(ValueError):
        BatchProfile(4, 2, 8)


def test_cpu_rewrites_are_exact(scorer, tmp_path):
    from beatflow.engine.onnx import FlatDownsample, UpsampleConv, optimize_for_onnx_cpu

    fast = optimize_for_onnx_cpu(scorer)
    kinds = [type(m) for m in fast.modules()]
    assert kinds.count(FlatDownsample) == 3 and kinds.count(UpsampleConv) == 3
    assert not any(isinstance(m, torch.nn.Upsample) for m in fast.modules())
    x = torch.from_numpy(beats(300, seed=11))
    with torch.no_grad():
        (s0, m0), (s1, m1) = scorer(x), fast(x)
    torch.testing.assert_close(s1, s0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m1, m0, atol=1e-6, rtol=1e-5)
    path = export_onnx(scorer, tmp_path / "fast.onnx", dynamo=False, optimize=True)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert "Resize" not in ops and "Upsample" not in ops
    eng = OnnxRuntimeEngine.load(path, intra_op_num_threads=1)
    assert validate_engine(eng, scorer, x.numpy()) < 1e-5


def test_concurrent_feeders_match_one(onnx_path):
    x = beats(3000, seed=12)
    one = OnnxRuntimeEngine.load(onnx_path, intra_op_num_threads=1)
    two = OnnxRuntimeEngine.load(onnx_path, intra_op_num_threads=1, feeders=2)
    for bs in (8192, 700, 1):
        np.testing.assert_array_equal(two.infer(x[: 50 if bs == 1 else None], bs)[0],
                                      one.infer(x[: 50 if bs == 1 else None], bs)[0])
    clone = pickle.loads(pickle.dumps(two))
    np.testing.assert_array_equal(clone.infer(x)[1], one.infer(x)[1])


def test_half_precision_scorer_within_tolerance(scorer, tmp_path):
    from beatflow.engine.base import PrecisionScorer
    from beatflow.engine.validate import TOLERANCES

    x = torch.from_numpy(beats(200, seed=13))
    with torch.no_grad():
        ref_s, ref_mu = scorer(x)
        s, mu = PrecisionScorer(scorer.vae, torch.bfloat16)(x)  # bf16 runs on the CPU too
    tol = TOLERANCES["bf16"]
    assert s.dtype == torch.float32 and mu.dtype == torch.float32
    assert bool(((s - ref_s).abs() <= tol.atol + tol.rtol * ref_s.abs()).all())
    path = export_onnx(scorer, tmp_path / "fp16.onnx", dynamo=False, precision="fp16")
    g = onnx.load(path).graph
    assert all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for v in [*g.input, *g.output])
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in g.initializer)


def test_device_input_and_gpu_providers_fail_clearly_on_cpu(engine):
    import onnxruntime as ort

    from beatflow.errors import DeviceError

    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (1, WIDTH), "typestr": "<f4", "data": (0, False), "version": 3}
        shape = (1, WIDTH)

    with pytest.raises(DeviceError, match="CPU ONNX Runtime engine"):
        engine.infer(FakeDeviceArray())
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(DeviceError, match="onnxruntime-gpu"):
            OnnxRuntimeEngine(engine.model_bytes, device="cuda").session


def test_gpu_backends_import_without_a_gpu():
    from beatflow.engine import aoti, compiled, tensorrt  # noqa: F401  (import-safe without a GPU)
    from beatflow.engine.options import aoti_available, compiled_available, tensorrt_available
    assert tensorrt_available() in (True, False)
    assert aoti_available("cpu") in (True, False)
    if not torch.cuda.is_available():
        assert not tensorrt_available() and not aoti_available("cuda") and not compiled_available("cuda")

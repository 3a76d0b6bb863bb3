"""Tests of beatflow.engine.cache: cached, validated engine builds and ``beatflow engine clean``.

The exporter is patched to the legacy TorchScript one (~0.3 s instead of ~5-10 s on 2 cores); the
patched function also counts exports, so "loaded from the cache" means "no export happened".
GPU backends are tested only where a CUDA device (and TensorRT) is present; AOTInductor on the CPU
compiles for ~1.5 min and runs only with BEATFLOW_SLOW_TESTS=1.
"""
import copy
import functools
import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from beatflow.engine import cache as engines
from beatflow.engine import onnx as E
from beatflow.engine import options
from beatflow.engine.base import EngineValidationError
from beatflow.engine.onnx import OnnxRuntimeEngine
from beatflow.engine.validate import TOLERANCES
from beatflow.errors import DeviceError
from beatflow.engine.cache import EngineCacheWarning, build_or_load_engine
from beatflow.model.threads import torch_threads
from beatflow.model.train import train_vae
from beatflow.model.vae import load_model, save_model, score_beats

PROFILE = (1, 256, 2048)


@pytest.fixture(scope="module")
def labelled_beats(synthetic_ecg):
    """Scaled beat rows of the 0.1 h synthetic ECG cut at its true R peaks, and their labels."""
    from beatflow.embed import embed
    from beatflow.embed.beats import beats_from_peaks, prune_mask
    from beatflow.params import SegmentParams

    ecg = synthetic_ecg
    s = SegmentParams().samples(ecg.fs)
    peak, start, length = beats_from_peaks(ecg.r_peaks, s, len(ecg.signal))
    keep = prune_mask(length, s.lower, s.upper)
    rows, p2p = embed(ecg.signal, start[keep], length[keep], s.width, baseline_samples=max(1, s.pre // 2))
    rows /= np.median(p2p)
    labels = ecg.labels[np.searchsorted(ecg.r_peaks, peak[keep])]
    return rows.astype(np.float32), labels


@pytest.fixture(scope="module")
def trained(labelled_beats, tmp_path_factory):
    rows, _ = labelled_beats
    with torch_threads(1):  # tiny model: one thread is faster than two busy ones
        res = train_vae(rows, epochs=3, batch_size=128, seed=0, lr=3e-3)
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model(res.model, path)
    return str(path), rows[res.test_index]


@pytest.fixture
def exports(monkeypatch):
    """Fast exporter that records its calls; ``exports.fail = True`` makes it raise."""
    calls = []
    fast = functools.partial(E.export_onnx, dynamo=False)

    def exporter(*args, **kwargs):
        if exporter.fail:
            raise AssertionError("export_onnx called although the engine should come from the cache")
        calls.append(kwargs.get("precision", "fp32"))
        return fast(*args, **kwargs)

    exporter.fail = False
    exporter.calls = calls
    monkeypatch.setattr(engines, "export_onnx", exporter)
    return exporter


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "engines"


def entries(folder):
    # (engines, sidecars and anything left behind; not the stored validation references)
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("reference-")) if folder.exists() else []


def build(trained, cache, **kw):
    model, val = trained
    kw.setdefault("batch_profile", PROFILE)
    return build_or_load_engine(model, val, cache_dir=cache, threads=1, **kw)


def test_build_then_cache_hit_without_export(trained, cache, exports):
    eng, info = build(trained, cache)
    assert info["cache"] == "built" and exports.calls == ["fp32"]
    for k in ("backend", "precision", "cache", "max_abs_err", "throughput_beats_per_s", "key", "path"):
        assert k in info
    assert info["backend"] == "onnxruntime" and info["precision"] == "fp32"
    assert 0 <= info["max_abs_err"] < TOLERANCES["fp32"].atol and info["throughput_beats_per_s"] > 0
    stem = f"onnxruntime-fp32-{info['key']}"
    assert entries(cache) == [f"{stem}.json", f"{stem}.onnx"]  # no temporary files left
    assert len(list(cache.glob("reference-*.npz"))) == 1  # the validation reference, stored with the engines
    meta = json.loads((cache / f"{stem}.json").read_text())
    assert meta["key"] == info["key"] and meta["material"]["batch_profile"] == list(PROFILE)
    assert set(meta["material"]["versions"]) >= {"torch", "onnxruntime", "onnx"}
    assert meta["material"]["model_sha256"] == engines._sha256_file(trained[0])

    exports.fail = True
    eng2, info2 = build(trained, cache)
    assert info2["cache"] == "hit" and info2["key"] == info["key"] and info2["path"] == info["path"]
    x = trained[1][:50]
    np.testing.assert_array_equal(eng2.infer(x)[0], eng.infer(x)[0])
    np.testing.assert_allclose(eng2.infer(x)[0], score_beats(load_model(trained[0]), x)[0], atol=1e-4)


def test_a_hit_reuses_the_profile_measured_at_build(trained, cache, exports, monkeypatch):
    """The engine's latency and throughput are measured once, when it is built, and kept in its
    sidecar (with the threads they were measured with); a hit with the same threads reports them
    without measuring, one with other threads measures (and keeps) its own."""
    _, info = build(trained, cache)
    assert isinstance(info["phases_s"]["profile"], float)
    meta = json.loads(Path(info["path"]).with_suffix(".json").read_text())
    assert meta["profile"]["threads"] == 1 and meta["profile"]["measured"] == info["profile"]["measured"]
    exports.fail = True
    measured = []
    real = engines.profile_engine
    monkeypatch.setattr(engines, "profile_engine", lambda *a, **k: measured.append(1) or real(*a, **k))
    _, hit = build(trained, cache)
    assert hit["cache"] == "hit" and hit["phases_s"]["profile"] == "stored" and not measured
    assert hit["profile"]["throughput_beats_per_s"] == info["profile"]["throughput_beats_per_s"]  # (int batch keys)
    assert hit["profile"]["latency_batch1_us"] == info["profile"]["latency_batch1_us"]
    assert hit["throughput_beats_per_s"] == info["throughput_beats_per_s"] > 0
    model, val = trained
    _, two = build_or_load_engine(model, val, cache_dir=cache, threads=2, batch_profile=PROFILE)
    assert two["cache"] == "hit" and isinstance(two["phases_s"]["profile"], float) and measured == [1]
    assert json.loads(Path(info["path"]).with_suffix(".json").read_text())["profile"]["threads"] == 2


def test_a_hit_in_the_same_process_reuses_the_loaded_engine(trained, cache, exports):
    """A standing worker that runs the flow again gets the engine object it already loaded (its
    compiled code and graphs); after the file changes, or in another process, it loads anew."""
    engines._REFERENCES.clear()
    eng, info = build(trained, cache)
    assert info["phases_s"]["reference"] == "computed" and info["phases_s"]["build"] > 0
    exports.fail = True
    eng2, info2 = build(trained, cache)
    assert info2["cache"] == "hit" and eng2 is eng
    # the eager scorer's output on the same beats is kept too, and gives the same error
    assert info2["phases_s"]["reference"] == "kept" and info2["max_abs_err"] == info["max_abs_err"]
    assert engines.load_engine(info["path"], threads=1) is eng  # the scoring tasks' load, same options
    engines._LOADED.clear()  # another process
    engines._REFERENCES.clear()
    eng3, info3 = build(trained, cache)
    # another process reads the reference stored with the engines, equal to the computed one
    assert info3["cache"] == "hit" and eng3 is not eng and info3["phases_s"]["reference"] == "stored"
    assert info3["max_abs_err"] == info["max_abs_err"]
    x = trained[1][:30]
    np.testing.assert_array_equal(eng3.infer(x)[0], eng.infer(x)[0])
    # a damaged stored reference is computed again (and stored anew)
    refs = sorted(Path(info["path"]).parent.glob("reference-*.npz"))
    assert len(refs) == 1
    refs[0].write_bytes(b"not a npz")
    engines._LOADED.clear()
    engines._REFERENCES.clear()
    _, info4 = build(trained, cache)
    assert info4["phases_s"]["reference"] == "computed" and info4["max_abs_err"] == info["max_abs_err"]
    engines._LOADED.clear()
    engines._REFERENCES.clear()
    assert build(trained, cache)[1]["phases_s"]["reference"] == "stored"


@pytest.mark.parametrize("change", ["batch_profile", "weights", "versions", "device_name"])
def test_changed_key_rebuilds(trained, cache, exports, monkeypatch, tmp_path, change):
    _, info = build(trained, cache)
    model, val = trained
    kw = {}
    if change == "batch_profile":
        kw["batch_profile"] = (1, 512, 2048)
    elif change == "weights":
        vae = load_model(model)
        with torch.no_grad():
            vae.fc.bias.add_(1e-3)
        model = str(tmp_path / "other.pt")
        save_model(vae, model)
    elif change == "versions":
        real = engines.library_versions
        monkeypatch.setattr(engines, "library_versions", lambda d="cpu": {**real(d), "onnxruntime": "0.0.0"})
    else:
        monkeypatch.setattr(engines, "device_name", lambda d="cpu": "Some Other CPU")
    _, info2 = build((model, val), cache, **kw)
    assert info2["cache"] == "built" and info2["key"] != info["key"] and len(exports.calls) == 2
    assert len(entries(cache)) == 4  # both entries, each engine + sidecar


def test_cache_key_is_deterministic_and_covers_its_inputs():
    base = dict(versions={"torch": "1"}, dev_name="cpu X")
    k, material = engines.cache_key("ab" * 32, "onnxruntime", "fp32", (1, 1024, 8192), "cpu", **base)
    assert k == engines.cache_key("ab" * 32, "onnxruntime", "fp32", [1, 1024, 8192], "cpu", **base)[0]
    assert len(k) == 24 and material["model_sha256"] == "ab" * 32
    for args in [("cd" * 32, "onnxruntime", "fp32", (1, 1024, 8192)), ("ab" * 32, "aoti", "fp32", (1, 1024, 8192)),
                 ("ab" * 32, "onnxruntime", "int8", (1, 1024, 8192)), ("ab" * 32, "onnxruntime", "fp32", (1, 64, 8192))]:
        assert engines.cache_key(*args, "cpu", **base)[0] != k
    assert engines.cache_key("ab" * 32, "onnxruntime", "fp32", (1, 1024, 8192), "cpu", versions={"torch": "2"},
                             dev_name="cpu X")[0] != k


def test_corrupt_engine_file_is_rebuilt_with_a_warning(trained, cache, exports):
    _, info = build(trained, cache)
    path = info["path"]
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.warns(EngineCacheWarning, match="corrupt"):
        eng, info2 = build(trained, cache)
    assert info2["cache"] == "built" and len(exports.calls) == 2 and info2["key"] == info["key"]
    meta = json.loads(open(path[: -len(".onnx")] + ".json").read())
    assert meta["sha256"] == engines._sha256_file(path)
    exports.fail = True
    assert build(trained, cache)[1]["cache"] == "hit"


@pytest.mark.parametrize("damage,match", [("garbage", "unreadable"), ("other_key", "another key"),
                                          ("no_sidecar", "no sidecar")])
def test_bad_sidecar_is_rebuilt_never_loaded(trained, cache, exports, damage, match):
    _, info = build(trained, cache)
    meta_path = cache / f"onnxruntime-fp32-{info['key']}.json"
    if damage == "garbage":
        meta_path.write_text("{not json")
    elif damage == "other_key":
        meta = json.loads(meta_path.read_text())
        meta["material"]["batch_profile"] = [1, 2, 3]
        meta_path.write_text(json.dumps(meta))
    else:
        meta_path.unlink()
    with pytest.warns(EngineCacheWarning, match=match):
        _, info2 = build(trained, cache)
    assert info2["cache"] == "built" and len(exports.calls) == 2


def test_failed_validation_is_not_cached(trained, cache, exports, monkeypatch):
    def wrong_exporter(scorer, path, *a, **kw):  # exports a model with other weights
        bad = copy.deepcopy(scorer)
        with torch.no_grad():
            bad.vae.fc.bias.add_(0.5)
        return E.export_onnx(bad, path, *a, dynamo=False, **kw)

    monkeypatch.setattr(engines, "export_onnx", wrong_exporter)
    with pytest.raises(EngineValidationError, match=r"onnxruntime fp32 engine .* exceeds tolerance") as err:
        build(trained, cache)
    assert "\n" not in str(err.value)
    assert entries(cache) == []  # neither the engine nor a temporary file


def test_entry_failing_validation_on_new_beats_is_rebuilt(trained, cache, exports, monkeypatch):
    _, info = build(trained, cache)
    # a sha-consistent entry whose engine is wrong (e.g. written by a buggy older version)
    path = info["path"]
    bad = load_model(trained[0])
    with torch.no_grad():
        bad.fc.bias.add_(0.5)
    E.export_onnx(bad, path, dynamo=False)
    meta_path = path[: -len(".onnx")] + ".json"
    meta = json.loads(open(meta_path).read())
    meta["sha256"] = engines._sha256_file(path)
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.warns(EngineCacheWarning, match="fails validation"):
        _, info2 = build(trained, cache)
    assert info2["cache"] == "built" and info2["max_abs_err"] < 1e-4


def test_int8_within_tolerance_and_auc(trained, cache, exports, labelled_beats):
    from beatflow.score.metrics import roc_auc

    eng, info = build(trained, cache, precision="int8")
    tol = TOLERANCES["int8"]
    assert info["precision"] == "int8" and info["cache"] == "built"
    assert 0 < info["max_abs_err"] and info["max_abs_err_mu"] <= tol.mu_atol + tol.mu_rtol * 0.3
    assert info["validated_on"] == len(trained[1]) // 2  # odd rows validate, even rows calibrated
    rows, labels = labelled_beats
    with torch_threads(1):
        ref, _ = score_beats(load_model(trained[0]), rows)
    got, _ = eng.infer(rows)
    assert np.max(np.abs(got - ref) / (tol.atol + tol.rtol * ref)) <= 1.0
    v = labels >= 0
    assert abs(roc_auc(got[v], labels[v] > 0) - roc_auc(ref[v], labels[v] > 0)) < 0.01
    import onnx

    graph = onnx.load(info["path"]).graph
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in graph.node}
    floats = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    heads = [n for n in graph.node if n.name in E.output_layers(info["path"])]
    assert len(heads) == 2 and all(n.input[1] in floats for n in heads)  # latent head, last conv: float
    exports.fail = True
    assert build(trained, cache, precision="int8")[1]["cache"] == "hit"


def test_env_var_and_parameter_choose_the_folder(trained, tmp_path, exports, monkeypatch):
    monkeypatch.setenv("BEATFLOW_CACHE_DIR", str(tmp_path / "from-env"))
    assert options.cache_dir() == tmp_path / "from-env"
    assert options.cache_dir(tmp_path / "param") == tmp_path / "param"
    monkeypatch.delenv("BEATFLOW_CACHE_DIR")
    assert str(options.cache_dir()).endswith(os.path.join(".cache", "beatflow", "engines"))
    monkeypatch.setenv("BEATFLOW_CACHE_DIR", str(tmp_path / "from-env"))
    model, val = trained
    _, info = build_or_load_engine(model, val, threads=1, batch_profile=PROFILE)
    assert os.path.dirname(info["path"]) == str(tmp_path / "from-env")


def test_load_engine_on_a_worker_checks_the_file(trained, cache, exports):
    eng, info = build(trained, cache)
    worker = engines.load_engine(info["path"])
    assert isinstance(worker, OnnxRuntimeEngine) and worker.feeders == 1 and worker.max_batch == PROFILE[2]
    x = trained[1][:20]
    np.testing.assert_array_equal(worker.infer(x)[0], eng.infer(x)[0])
    clone = pickle.loads(pickle.dumps(eng))
    np.testing.assert_array_equal(clone.infer(x)[0], eng.infer(x)[0])
    with open(info["path"], "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(EngineValidationError, match="does not match its sidecar"):
        engines.load_engine(info["path"])


def test_engine_clean_cli(trained, cache, exports, capsys):
    from beatflow.cli import main

    engines._REFERENCES.clear()  # (computed here, so stored with the engine)
    _, info = build(trained, cache)
    assert len(list(cache.glob("reference-*.npz"))) == 1
    (cache / ".tmp-leftover.onnx").write_bytes(b"x")
    (cache / "notes.txt").write_text("not ours")
    assert main(["engine", "list", "--cache-dir", str(cache)]) == 0
    assert os.path.basename(info["path"]) in capsys.readouterr().out
    assert main(["engine", "clean", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"removed {info['path']}" in out and "removed 4 file(s)" in out
    assert sorted(p.name for p in cache.iterdir()) == ["notes.txt"]
    assert main(["engine", "clean", "--cache-dir", str(cache)]) == 0
    assert "removed 0 file(s)" in capsys.readouterr().out


def test_backend_resolution_on_cpu():
    assert options.resolve_backend("auto", "fp32", "cpu") == "onnxruntime"
    assert options.resolve_backend("auto", "int8", "cpu") == "onnxruntime"
    assert options.available_backends("cpu")[0] == "onnxruntime"
    with pytest.raises(ValueError, match="for GPUs"):
        options.resolve_backend("auto", "fp16", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        options.resolve_backend("onnx", "fp32", "cpu")
    with pytest.raises(ValueError, match="does not do int8"):
        options.resolve_backend("aoti", "int8", "cpu")
    with pytest.raises(Exception, match="CUDA"):
        options.resolve_backend("tensorrt", "fp32", "cpu")
    assert options.normalize_device("gpu") == "cuda:0" and options.normalize_device("cuda:1") == "cuda:1"
    assert "(" in engines.device_name("cpu")


# -- GPU and slow paths ----------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("backend,precision", [("auto", "fp32"), ("auto", "fp16"), ("aoti", "bf16"),
                                               ("compiled", "bf16"), ("aoti", "fp32"),
                                               ("onnxruntime", "fp32"), ("tensorrt", "fp16")])
def test_gpu_backends_keep_device_results(trained, cache, backend, precision):
    if backend != "auto" and backend not in options.available_backends("cuda"):
        pytest.skip(f"{backend} not available")
    model, val = trained
    eng, info = build_or_load_engine(model, val, backend=backend, precision=precision, device="cuda",
                                     cache_dir=cache, batch_profile=PROFILE)
    assert eng.on_gpu and info["max_abs_err"] <= TOLERANCES[precision].atol + TOLERANCES[precision].rtol
    x = torch.from_numpy(val[:100]).cuda()
    s, m = eng.infer(x)
    assert isinstance(s, torch.Tensor) and s.is_cuda and m.shape == (100, 2)
    ref, _ = score_beats(load_model(model), val[:100])
    np.testing.assert_allclose(s.cpu().numpy(), ref, atol=TOLERANCES[precision].atol, rtol=TOLERANCES[precision].rtol)
    assert build_or_load_engine(model, val, backend=info["backend"], precision=precision, device="cuda",
                                cache_dir=cache, batch_profile=PROFILE)[1]["cache"] == "hit"
    again = engines.load_engine(info["path"])  # as a Dask worker loads it for scoring
    np.testing.assert_allclose(again.infer(x)[0].cpu().numpy(), s.cpu().numpy(), rtol=1e-6, atol=1e-7)


@cuda
def test_gpu_auto_prefers_tensorrt_then_compiled_then_aoti():
    avail = options.available_backends("cuda")
    assert avail == [b for b in ("tensorrt", "compiled", "aoti", "onnxruntime") if b in avail]
    assert options.resolve_backend("auto", "fp32", "cuda") == avail[0]


@pytest.mark.parametrize("backend", options.BACKENDS)
def test_every_backends_cache_file_name_is_recognised(backend):
    """load_engine and `engine clean` recognise entries by name: each backend's extension must match."""
    name = f"{backend}-fp32-{'0' * options._KEY_LEN}.{options.EXTENSIONS[backend]}"
    assert options._ENTRY_RE.match(name) and options._ours(Path(name))


def test_compiled_backend_is_for_gpus_only():
    with pytest.raises(ValueError, match="backend compiled does not do fp32 on the CPU"):
        options.resolve_backend("compiled", "fp32", "cpu")


@cuda
def test_compiled_engine_with_cuda_graphs_needs_the_native_allocator(trained, tmp_path):
    from beatflow.engine.compiled import CompiledEngine
    from beatflow.model.graphs import native_allocator
    from beatflow.model.vae import Scorer, load_model

    model, val = trained
    if not native_allocator():
        with pytest.raises(DeviceError, match="CUDA graphs need PyTorch's own CUDA allocator"):
            CompiledEngine.build(Scorer(load_model(model)), tmp_path / "e.pt", cudagraphs=True)
        return
    eng = CompiledEngine.build(Scorer(load_model(model)), tmp_path / "e.pt", batch_profile=PROFILE)
    assert eng.cudagraphs  # the default where PyTorch's allocator is in place
    x = torch.from_numpy(val[:64]).cuda()
    s1, _ = eng.infer(x)
    s2, _ = eng.infer(torch.zeros_like(x))  # a replay must not overwrite what the first call returned
    ref, _ = score_beats(load_model(model), val[:300])
    np.testing.assert_allclose(s1.cpu().numpy(), ref[:64], atol=1e-4, rtol=1e-4)
    assert not torch.equal(s1, s2)
    for n in (1, 7, 300):  # one bucket exactly, padded buckets, several chunks
        got, _ = eng.infer(torch.from_numpy(val[:n]).cuda(), batch_size=256)
        np.testing.assert_allclose(got.cpu().numpy(), ref[:n], atol=1e-4, rtol=1e-4)
    assert len(eng.model.graphs) >= 3


@pytest.mark.skipif(os.environ.get("BEATFLOW_SLOW_TESTS") != "1", reason="AOTInductor on the CPU compiles ~1.5 min")
def test_aoti_on_cpu(trained, cache):
    pytest.importorskip("torch._inductor")
    model, val = trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng, info = build_or_load_engine(model, val, backend="aoti", device="cpu", cache_dir=cache, threads=2,
                                         batch_profile=PROFILE)
    assert info["cache"] == "built" and info["path"].endswith(".pt2") and info["max_abs_err"] < 1e-4
    assert eng.infer(val[:1])[0].shape == (1,)
    assert build_or_load_engine(model, val, backend="aoti", device="cpu", cache_dir=cache,
                                batch_profile=PROFILE)[1]["cache"] == "hit"


def test_graphed_buckets_fall_back_to_launching_when_capture_fails(monkeypatch):
    # where an allocator cannot capture after all, the engine launches the compiled kernels instead
    from beatflow.engine import compiled as EC
    calls = []

    def scorer(x):
        calls.append(tuple(x.shape))
        return x.sum(dim=1), x[:, :2]

    g = EC._GraphedBuckets(scorer, torch.device("cpu"))
    monkeypatch.setattr(g, "_capture", lambda shape, dtype: (_ for _ in ()).throw(RuntimeError("capture invalidated")))
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed .*RuntimeError: capture invalidated"):
        s, mu = g(x, 8)  # padded to the bucket of 8 rows
    assert calls == [(8, 4)] and torch.equal(s, x.sum(dim=1)) and torch.equal(mu, x[:, :2])
    s, _ = g(x, 8)  # the failure is remembered: no second capture attempt, no second warning
    assert calls == [(8, 4), (8, 4)] and torch.equal(s, x.sum(dim=1))


# --- the GPU engine's warm-up: once per width and process, waited for by the engine stage ---------------

def test_the_engine_warmup_runs_once_per_width_and_is_waited_for(monkeypatch):
    import threading
    import time

    from beatflow.engine import cache

    calls, gate = [], threading.Event()

    def fake_warm(width):
        calls.append(width)
        gate.wait(10)
        if width == 136:
            raise RuntimeError("no GPU here")  # a failing warm-up stays quiet: the engine stage reports for itself
        return {}

    monkeypatch.setattr(cache, "warm_gpu_engine", fake_warm)
    monkeypatch.setattr(cache, "_WARMUPS", {})
    assert cache.start_gpu_warmup(256) is True
    assert cache.start_gpu_warmup(256) is False  # the same width: started before
    assert cache.start_gpu_warmup(136) is True
    t0 = time.perf_counter()
    threading.Timer(0.3, gate.set).start()
    cache.wait_gpu_warmup()
    assert time.perf_counter() - t0 >= 0.25  # it waited for both to end
    assert sorted(calls) == [136, 256] and not any(t.is_alive() for t in cache._WARMUPS.values())

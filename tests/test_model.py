"""Tests of beatflow.model: the LightVAE and its loss (vae), training (train), its CUDA-graph runtime
(graphs), scoring and persistence."""
import numpy as np
import pytest
import torch

from beatflow.model.train import TrainResult, train_vae
from beatflow.model.vae import (
    Downsample,
    LightVAE,
    Scorer,
    Swish,
    load_model,
    save_model,
    score_beats,
    vae_loss,
)


def synthetic_beats(n: int, width: int = 64, seed: int = 0) -> np.ndarray:
    """Beat-like rows: a Gaussian bump with jittered position/height/width plus a slow wave and noise."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, width, dtype=np.float32)
    centre = 0.5 + 0.03 * rng.standard_normal((n, 1))
    height = 1.0 + 0.1 * rng.standard_normal((n, 1))
    sigma = 0.04 + 0.005 * rng.standard_normal((n, 1))
    beats = height * np.exp(-0.5 * ((t - centre) / sigma) ** 2)
    beats += 0.2 * np.sin(2 * np.pi * (t + 0.05 * rng.standard_normal((n, 1))))
    beats += 0.02 * rng.standard_normal((n, width))
    return beats.astype(np.float32)


@pytest.fixture(scope="module")
def trained():
    beats = synthetic_beats(2000, 64, seed=0)
    return beats, train_vae(beats, epochs=3, batch_size=256, seed=7, lr=1e-2)


@pytest.mark.parametrize("width", [256, 64])
def test_shapes(width):
    torch.manual_seed(0)
    model = LightVAE(width)
    x = torch.randn(5, width)
    recon, mu, logvar = model(x)
    assert recon.shape == (5, width)
    assert mu.shape == (5, 2) and logvar.shape == (5, 2)
    score, mu2 = Scorer(model)(x)
    assert score.shape == (5,) and mu2.shape == (5, 2)
    torch.testing.assert_close(mu2, mu)


@pytest.mark.parametrize("width", [0, 12, 100])
def test_width_must_be_multiple_of_8(width):
    with pytest.raises(ValueError):
        LightVAE(width)


def test_downsample_matches_naive_loop():
    torch.manual_seed(1)
    channels, length = 3, 20
    x = torch.randn(2, channels, length, dtype=torch.float32)
    out = Downsample(channels)(x)
    assert out.shape == (2, channels, length // 2)
    padded = torch.nn.functional.pad(x, (1, 1)).double()
    ref = torch.zeros(2, channels, length // 2, dtype=torch.float64)
    w = [0.25, 0.5, 0.25]
    for b in range(2):
        for c in range(channels):
            for i in range(length // 2):
                ref[b, c, i] = sum(w[k] * padded[b, c, 2 * i + k] for k in range(3))
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
    # The filter is fixed: not a parameter, so not trained.
    assert list(Downsample(channels).parameters()) == []


def test_swish_alpha_is_learnable():
    act = Swish()
    params = dict(act.named_parameters())
    assert set(params) == {"alpha"}
    assert params["alpha"].requires_grad and params["alpha"].item() == 1.0
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(act(x), x * torch.sigmoid(x))
    act(x).sum().backward()
    assert act.alpha.grad is not None and act.alpha.grad.item() != 0.0
    # Every Swish of the model has its own alpha, all handed to the optimiser.
    names = [n for n, _ in LightVAE(64).named_parameters() if n.endswith("alpha")]
    assert len(names) == 5


def test_vae_loss_matches_naive_reference():
    torch.manual_seed(2)
    b, d = 4, 16
    x, recon = torch.randn(b, d), torch.randn(b, d)
    mu, logvar = torch.randn(b, 2), torch.randn(b, 2)
    total = 0.0
    for i in range(b):
        mse = sum((x[i, j].item() - recon[i, j].item()) ** 2 for j in range(d)) / d
        kl = sum(1 + logvar[i, k].item() - mu[i, k].item() ** 2 - np.exp(logvar[i, k].item()) for k in range(2)) / 2
        total += mse - 0.1 * kl
    got = vae_loss(x, recon, mu, logvar)
    assert got.ndim == 0
    assert got.item() == pytest.approx(total, rel=1e-5)


def test_eval_mode_is_deterministic_and_uses_mu():
    torch.manual_seed(3)
    model = LightVAE(64).eval()
    x = torch.randn(3, 64)
    r1, mu, _ = model(x)
    r2, _, _ = model(x)
    torch.testing.assert_close(r1, r2)
    torch.testing.assert_close(r1, model.decode(mu))
    model.train()
    r3, _, _ = model(x)
    assert not torch.allclose(r3, r1)  # sampled latent in training mode


def test_training_decreases_loss_and_is_reproducible(trained):
    beats, res = trained
    assert isinstance(res, TrainResult)
    assert len(res.train_loss) == 3
    assert res.train_loss[-1] < res.train_loss[0]
    assert np.isfinite(res.test_loss) and res.test_loss < res.train_loss[0]
    assert res.train_index.dtype == np.int64 and res.test_index.dtype == np.int64
    assert len(res.train_index) == 1500 and len(res.test_index) == 500
    assert np.array_equal(np.sort(np.concatenate([res.train_index, res.test_index])), np.arange(2000))
    np.testing.assert_array_equal(res.train_index, np.random.default_rng(7).permutation(2000)[:1500])
    assert not res.model.training
    assert next(res.model.parameters()).device.type == "cpu"
    assert res.seconds > 0

    calls = []
    again = train_vae(torch.from_numpy(beats), epochs=3, batch_size=256, seed=7, lr=1e-2,
                      on_epoch=lambda *a: calls.append(a))
    assert again.train_loss == res.train_loss
    assert again.test_loss == res.test_loss
    assert [c[0] for c in calls] == [1, 2, 3]
    assert [c[1] for c in calls] == res.train_loss
    assert all(c[2] >= 0 for c in calls)
    for p, q in zip(res.model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)


def test_other_seed_gives_other_split():
    beats = synthetic_beats(200, 64, seed=1)
    a = train_vae(beats, epochs=1, batch_size=64, seed=1)
    b = train_vae(beats, epochs=1, batch_size=64, seed=2)
    assert not np.array_equal(a.train_index, b.train_index)


def test_scorer_flags_out_of_distribution_rows(trained):
    beats, res = trained
    normal = synthetic_beats(300, 64, seed=123)
    rng = np.random.default_rng(5)
    noise = rng.standard_normal((1, 64)).astype(np.float32)
    spike = np.zeros((1, 64), np.float32)
    spike[0, 10] = 5.0
    inverted = -normal[:1]
    scores, mu = score_beats(res.model, np.concatenate([normal, noise, spike, inverted]), batch_size=128)
    assert scores.dtype == np.float32 and scores.shape == (303,)
    assert mu.dtype == np.float32 and mu.shape == (303, 2)
    typical = np.percentile(scores[:300], 99)
    assert scores[300] > 3 * typical and scores[301] > 3 * typical, (scores[300:], typical)
    assert scores[302] > typical, (scores[302], typical)


def test_score_beats_matches_scorer_and_batches_agree(trained):
    beats, res = trained
    x = beats[:700]
    s1, m1 = score_beats(res.model, x, batch_size=8192)
    s2, m2 = score_beats(Scorer(res.model), torch.from_numpy(x), batch_size=64)
    np.testing.assert_allclose(s1, s2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m1, m2, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        recon = res.model.decode(res.model.encode(torch.from_numpy(x))[0]).numpy()
    np.testing.assert_allclose(s1, ((x - recon) ** 2).mean(axis=1), rtol=1e-4, atol=1e-7)


def test_save_load_roundtrip(tmp_path, trained):
    beats, res = trained
    path = tmp_path / "model.pt"
    save_model(res.model, path)
    loaded = load_model(path)
    assert isinstance(loaded, LightVAE) and loaded.width == 64 and not loaded.training
    s1, m1 = score_beats(res.model, beats[:100])
    s2, m2 = score_beats(loaded, beats[:100])
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(m1, m2)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["width"] == 64 and "state_dict" in ckpt


def test_cuda_graph_training_is_refused_where_it_cannot_run():
    beats = synthetic_beats(64)
    with pytest.raises(ValueError, match="training with CUDA graphs: they run on a CUDA device"):
        train_vae(beats, epochs=1, batch_size=16, cudagraphs=True)
    assert train_vae(beats, epochs=1, batch_size=16, cudagraphs=None).cudagraphs is False  # auto: not on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_training_matches_launched_steps(compile):
    from beatflow.model.train import training_graphs

    if not training_graphs(None, "cuda"):
        pytest.skip("PyTorch allocates from another allocator here: no capture")
    beats = synthetic_beats(3000, width=64)
    plain = train_vae(beats, epochs=4, batch_size=512, device="cuda", compile=compile, cudagraphs=False)
    graphed = train_vae(beats, epochs=4, batch_size=512, device="cuda", compile=compile, cudagraphs=True)
    assert graphed.cudagraphs and not plain.cudagraphs
    # the same data order and start; only the reparameterisation noise differs (the RNG's offsets)
    assert abs(graphed.train_loss[0] / plain.train_loss[0] - 1) < 0.05
    assert abs(graphed.test_loss / plain.test_loss - 1) < 0.05
    assert graphed.train_loss[-1] < graphed.train_loss[0]


def test_set_start_restores_weights_and_zeroes_adam_in_place():
    """What the captured and kept training graphs start from: the weights given, Adam's state zero, in
    the same tensors (the graphs hold their addresses)."""
    from beatflow.model import graphs as G
    torch.manual_seed(0)
    m = LightVAE(16)
    start = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    recon, mu, logvar = m(x)
    vae_loss(x, recon, mu, logvar).backward()
    opt.step()
    tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    ptrs = [v.data_ptr() for v in tensors] + [p.data_ptr() for p in m.parameters()]
    assert any(not torch.equal(v, start[k]) for k, v in m.state_dict().items())
    G.set_start(m, opt, start)
    for k, v in m.state_dict().items():
        assert torch.equal(v, start[k])
    assert all(not v.any() for v in tensors)
    assert ptrs == [v.data_ptr() for v in tensors] + [p.data_ptr() for p in m.parameters()]


def test_keep_graphs_without_graphs_changes_nothing():
    """On the CPU (no CUDA graphs) ``keep_graphs`` keeps nothing, and training is the same."""
    from beatflow.model import graphs as G
    beats = synthetic_beats(400, width=64)
    a = train_vae(beats, epochs=2, batch_size=64, seed=3, keep_graphs=True)
    b = train_vae(beats, epochs=2, batch_size=64, seed=3)
    assert not a.graphs_kept and not a.cudagraphs and not G._KEPT
    assert a.train_loss == b.train_loss
    for k, v in a.model.state_dict().items():
        torch.testing.assert_close(v, b.model.state_dict()[k], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile,kernel", [(False, False), (True, False), (False, True)])
def test_kept_training_graphs_train_to_the_weights_of_a_fresh_capture(compile, kernel):
    """``keep_graphs``: the second call replays the first one's captured steps, reset to its own seed's
    weights and generator offset, and ends where a fresh capture of that seed ends: the same losses and
    weights, for the same seed and for another; other shapes capture anew (and drop the kept set)."""
    from beatflow.model import graphs as G
    from beatflow.model import train as T
    if not T.training_graphs(None, "cuda"):
        pytest.skip("PyTorch allocates from another allocator here: no capture")
    beats = torch.as_tensor(synthetic_beats(3000, width=64)).cuda()
    kw = dict(epochs=3, batch_size=512, device="cuda", compile=compile, cudagraphs=True, kernel=kernel)
    G._KEPT.clear()
    fresh = {seed: train_vae(beats, seed=seed, **kw) for seed in (1, 2)}
    assert fresh[1].cudagraphs and not fresh[1].graphs_kept and not G._KEPT  # (without keep_graphs: nothing kept)
    assert fresh[1].kernel == kernel
    first = train_vae(beats, seed=1, keep_graphs=True, **kw)
    assert not first.graphs_kept and len(G._KEPT) == 1
    assert first.train_loss == fresh[1].train_loss  # (two fresh captures of one seed agree: the baseline)
    # memory freed after the first call goes to new tensors, filled with NaN: the kept graphs must not read
    # or write any (the step kernel's noise and per-row gradient buffers once did, after the call returned)
    import gc

    from beatflow.model.step_kernel import param_layout

    gc.collect()
    n_train = int(len(beats) * T.TRAIN_FRACTION)
    junk = [torch.full((rows, cols), float("nan"), device="cuda")
            for rows in (512, n_train % 512) for cols in (2, param_layout(64)["size"] + 1) for _ in range(4)]
    for seed in (1, 2, 1):
        again = train_vae(beats, seed=seed, keep_graphs=True, **kw)
        assert again.graphs_kept and again.cudagraphs and again.compiled == fresh[seed].compiled
        assert again.train_loss == fresh[seed].train_loss and again.test_loss == fresh[seed].test_loss
        for k, v in again.model.state_dict().items():
            torch.testing.assert_close(v, fresh[seed].model.state_dict()[k], rtol=0, atol=0)
        assert again.model.fc.weight.device.type == "cpu"
    assert all(torch.isnan(j).all() for j in junk)
    other = train_vae(beats[:2000], seed=1, keep_graphs=True, **kw)  # other shapes: a new capture, kept instead
    assert not other.graphs_kept and len(G._KEPT) == 1
    assert train_vae(beats[:2000], seed=1, keep_graphs=True, **kw).graphs_kept
    G._KEPT.clear()


def test_graph_allocator_rule(monkeypatch):
    import sys

    from beatflow.model import graphs as G
    from beatflow.model import train as T
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    assert G.graph_allocator()
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "pluggable")
    monkeypatch.setitem(sys.modules, "rmm", None)  # no RMM: a pluggable allocator cannot capture
    assert not G.rmm_async_resource() and not G.graph_allocator()

    class Async:
        upstream_mr = None

    class Stats:
        upstream_mr = Async()

    class Pool:
        upstream_mr = None

    fake = type(sys)("rmm")
    fake.mr = type(sys)("rmm.mr")
    fake.mr.CudaAsyncMemoryResource = Async
    from beatflow.gpu import arena as capture_arena
    class Front:  # the arena's callback resource (no upstream_mr: capture_arena knows what is behind it)
        pass

    arena = capture_arena.CaptureArena(Stats(), callback_resource=lambda alloc, free: Front())
    monkeypatch.setitem(capture_arena._INSTALLED, capture_arena._device_id(), arena)
    # an adaptor over the async pool, with and without the arena in front; RMM's own pool
    for current, is_async, graphs in ((arena.mr, True, True), (Stats(), True, False), (Pool(), False, False)):
        fake.mr.get_current_device_resource = lambda c=current: c
        monkeypatch.setitem(sys.modules, "rmm", fake)
        assert G.rmm_async_resource() is is_async and G.graph_allocator() is graphs
        assert T.training_compiled(True, True) is graphs  # compiled steps captured only through the arena
        assert T.training_compiled(True, False) and not T.training_compiled(False, True)


class _FakeEvent:
    """A CUDA event's stand-in on the CPU: it records when it was recorded."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        import time

        self.at = time.perf_counter()

    def synchronize(self):
        assert self.at is not None, "read before it was queued"

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3


class _FakeEpochGraph:
    """An epoch graph's stand-in: the epoch's "loss" is the sum of its rows in its order's first half."""

    def __init__(self):
        self.total = torch.zeros((), dtype=torch.float64)
        self.orders = []

    def run(self, data, order):
        self.orders.append(order.clone())
        self.total.fill_(float(data[order[: len(order) // 2]].sum()))
        return self.total


def test_queued_epochs_host_side_matches_epoch_by_epoch_and_restores_the_process(monkeypatch):
    """``queued_epochs`` on the host (the GPU's events and pinned memory stood in for): the same orders and
    losses as epoch by epoch from the same generator, each epoch reported once in order, and the process's
    switch interval, garbage collector and PyTorch threads as they were, also when an epoch fails."""
    import gc
    import sys
    import time

    from beatflow.model import graphs as G
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    data = torch.randn(300, 8, dtype=torch.float64)
    train_idx = torch.arange(7, 257)
    n = int(train_idx.shape[0])
    gen = torch.Generator().manual_seed(5)
    want_orders = [train_idx[torch.randperm(n, generator=gen)] for _ in range(4)]
    want = [float(data[o[: n // 2]].sum()) / n for o in want_orders]
    before = (sys.getswitchinterval(), gc.isenabled(), torch.get_num_threads(), list(gc.callbacks))
    graph, seen, then_saw = _FakeEpochGraph(), [], []

    def then():  # (queued after every epoch, before the first loss is read)
        then_saw.append((len(graph.orders), len(seen)))
        return torch.ones(())

    got, after = G.queued_epochs(graph, data, train_idx, n, 4, torch.Generator().manual_seed(5),
                                 lambda e, loss, t: seen.append((e, loss)), time.perf_counter(), then=then)
    assert got == want and then_saw == [(4, 0)] and float(after) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(graph.orders, want_orders))
    assert seen == list(enumerate(want, start=1))
    assert len(graph.epoch_gpu_ms) == 4
    assert {"orders", "queue", "then", "read", "gc", "other_threads"} <= set(graph.queue_s)
    assert (sys.getswitchinterval(), gc.isenabled(), torch.get_num_threads(), list(gc.callbacks)) == before
    assert G.queued_epochs(graph, data, train_idx, n, 0, gen, None, 0.0) == ([], None)
    assert G.queued_epochs(graph, data, train_idx, n, 1, torch.Generator().manual_seed(5), None, 0.0)[0] == want[:1]

    class Failing(_FakeEpochGraph):
        def run(self, data, order):
            raise RuntimeError("replay failed")

    with pytest.raises(RuntimeError, match="replay failed"):
        G.queued_epochs(Failing(), data, train_idx, n, 3, gen, None, time.perf_counter())
    assert (sys.getswitchinterval(), gc.isenabled(), torch.get_num_threads(), list(gc.callbacks)) == before


def test_training_sample_is_stratified_by_recording_and_over_time():
    from beatflow.model.sample import training_sample

    counts = [60_000, 30_000, 500, 0, 9_500]
    pick = training_sample(counts, 20_000)
    assert len(pick) == 20_000 and (np.diff(pick) > 0).all()
    rec = np.searchsorted(np.cumsum(counts), pick, side="right")
    got = np.bincount(rec, minlength=len(counts))
    # in proportion to each recording's beats (the small one whole, as its share is below its beats)
    np.testing.assert_allclose(got, [12_000, 6_000, 100, 0, 1_900], atol=2)
    # evenly over each recording's time: every tenth of the biggest recording holds a tenth of its share
    first = pick[rec == 0]
    assert np.allclose(np.histogram(first, bins=10, range=(0, 60_000))[0], got[0] / 10, atol=2)
    # a recording's share is at least one beat; the shares add up to the sample
    small = training_sample([5, 1000], 100)
    assert np.bincount(np.searchsorted(np.cumsum([5, 1000]), small, side="right")).tolist() == [1, 99]
    assert training_sample([10, 10], 100).tolist() == list(range(20))  # all, when fewer than asked
    assert training_sample([10, 10], None).tolist() == list(range(20))
    assert len(training_sample([3, 3, 3], 2)) == 2

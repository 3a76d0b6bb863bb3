"""The training step kernel (``beatflow.model.step_kernel``) against PyTorch's autograd of the LightVAE.

On CI it runs under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, exported by ``scripts/test.sh``), on
small rows; on a GPU the same tests run on the device, with more of them on the flow's shapes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from beatflow.model.train import train_vae
from beatflow.model.vae import LightVAE, vae_loss
from beatflow.model.step_kernel import param_layout, row_grads


def _mode():
    """``"gpu"``, ``"sim"`` (Numba's CUDA simulator: ``NUMBA_ENABLE_CUDASIM=1``, as scripts/test.sh sets) or None."""
    from beatflow.gpu.sim import simulator_active

    if simulator_active():
        return "sim"
    try:
        from numba import cuda

        return "gpu" if cuda.is_available() else None
    except Exception:
        return None


MODE = _mode()
needs_kernel = pytest.mark.skipif(MODE is None, reason="no CUDA GPU and the Numba CUDA simulator is not active")
needs_gpu = pytest.mark.skipif(MODE != "gpu" or not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")


def random_model(width: int, seed: int) -> LightVAE:
    """A LightVAE with every parameter random (the Swish slopes away from their initial 1, biases nonzero)."""
    torch.manual_seed(seed)
    m = LightVAE(width)
    with torch.no_grad():
        for name, p in m.named_parameters():
            slope = name.endswith("alpha")
            p.copy_(torch.randn_like(p) * (0.5 if slope else 0.3) + (1.0 if slope else 0.0))
    return m


def reference(model: LightVAE, x: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Each row's gradient (parameters in ``parameters()`` order) and loss, by autograd in float64."""
    m = LightVAE(model.width).double()
    m.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    out = []
    for b in range(x.shape[0]):
        xb = torch.as_tensor(x[b:b + 1], dtype=torch.float64)
        mu, logvar = m.encode(xb)
        z = mu + torch.exp(0.5 * logvar) * torch.as_tensor(eps[b:b + 1], dtype=torch.float64)
        loss = vae_loss(xb, m.decode(z), mu, logvar)
        m.zero_grad()
        loss.backward()
        out.append(np.concatenate([p.grad.reshape(-1).numpy() for p in m.parameters()] + [[loss.item()]]))
    return np.stack(out)


def flat_params(model: LightVAE) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def test_layout_follows_the_models_parameters():
    for width in (8, 64, 256):
        lay = param_layout(width)
        named = list(LightVAE(width).named_parameters())
        assert [n for n, _ in named] == [n for n in lay if n != "size"]
        off = 0
        for n, p in named:
            assert lay[n] == (off, tuple(p.shape))
            off += p.numel()
        assert lay["size"] == off


@needs_kernel
@pytest.mark.parametrize("width,rows,seed,sums", [(16, 2, 0, "transposed"), (24, 2, 1, "transposed"),
                                                   (8, 2, 2, "transposed"), (16, 2, 0, "butterfly")])
def test_each_rows_gradient_and_loss_match_autograd(width, rows, seed, sums):
    rng = np.random.default_rng(seed)
    model = random_model(width, seed)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    eps = rng.normal(size=(rows, 2)).astype(np.float32)
    got = row_grads(x, eps, flat_params(model), sums=sums)
    want = reference(model, x, eps)
    assert got.shape == want.shape == (rows, param_layout(width)["size"] + 1)
    for b in range(rows):  # per row: relative to the row's largest gradient
        scale = np.abs(want[b, :-1]).max()
        np.testing.assert_allclose(got[b, :-1], want[b, :-1], rtol=2e-4, atol=2e-5 * scale)
        assert got[b, -1] == pytest.approx(want[b, -1], rel=1e-5)


@needs_kernel
def test_the_transposed_sums_are_the_butterflys_bit_for_bit():
    """``tsum`` (a warp's 32 totals in 31 shuffles, lane l the l-th) gives each total bit for bit as the
    butterfly ``wsum`` does (on a GPU: the same pairs added in the same order), and the sums are the columns'."""
    from beatflow.model.step_kernel import warp_totals

    rng = np.random.default_rng(5)
    for scale in (1.0, 1e-4, 3e4):
        vals = (rng.normal(size=(32, 32)) * rng.lognormal(sigma=2.0, size=(32, 32)) * scale).astype(np.float32)
        t, w = warp_totals(vals)
        assert np.array_equal(t.view(np.uint32), w.view(np.uint32))
        want = vals.astype(np.float64).sum(axis=0)
        np.testing.assert_allclose(t, want, rtol=1e-5, atol=1e-6 * float(np.abs(vals).sum(axis=0).max()))


@needs_kernel
def test_the_step_kernels_transposed_sums_give_the_butterflies_gradients():
    """The step kernel as the GPU runs it (its shuffles; the simulator's here), its weight gradients summed
    32 at a time transposed and a butterfly each: the same gradients to the bit, and autograd's."""
    rng = np.random.default_rng(8)
    width = 16
    model = random_model(width, 8)
    x = rng.normal(size=(1, width)).astype(np.float32)
    eps = rng.normal(size=(1, 2)).astype(np.float32)
    got = row_grads(x, eps, flat_params(model), sums="transposed", shuffles=True)
    assert np.array_equal(got, row_grads(x, eps, flat_params(model), sums="butterfly", shuffles=True))
    want = reference(model, x, eps)
    np.testing.assert_allclose(got[0, :-1], want[0, :-1], rtol=2e-4, atol=2e-5 * np.abs(want[0, :-1]).max())


@pytest.mark.skipif(MODE != "sim", reason="counts the simulator's stand-ins for the warp's sums")
@pytest.mark.parametrize("width", [8, 16])
def test_each_weight_gradient_sum_is_made_once(monkeypatch, width):
    """The step kernel makes each of a row's sums once: with butterflies, no more warp sums than the model has
    parameters (each sum gives at least one gradient; a loop that went over the rest of a layer's sums from
    each chunk of 32 made 537 at width 16, against the 309 before the transposed sums); transposed, a sixth
    of them or fewer (32 at a time)."""
    import beatflow.model.step_kernel as TK

    made = {"wsum": 0, "tsum": 0}
    wsum, tsum = TK._sim_wsum, TK._sim_tsum

    def counted(name, fn):
        def sum_(*args):
            made[name] += 1
            return fn(*args)
        return sum_

    monkeypatch.setattr(TK, "_sim_wsum", counted("wsum", wsum))
    monkeypatch.setattr(TK, "_sim_tsum", counted("tsum", tsum))
    rng = np.random.default_rng(width)
    x, eps = rng.normal(size=(1, width)).astype(np.float32), rng.normal(size=(1, 2)).astype(np.float32)
    params = flat_params(random_model(width, 3))
    per_lane = {}
    try:
        for sums in ("butterfly", "transposed"):
            TK.warp_sums.cache_clear()
            TK._build_step_kernel.cache_clear()  # (built again: with the counted stand-ins)
            made.update(wsum=0, tsum=0)
            row_grads(x, eps, params, sums=sums)
            per_lane[sums] = {k: v // TK.WARP for k, v in made.items()}
    finally:
        TK.warp_sums.cache_clear()
        TK._build_step_kernel.cache_clear()
    assert per_lane["butterfly"]["tsum"] == 0 and 0 < per_lane["butterfly"]["wsum"] <= params.size
    transposed = per_lane["transposed"]
    assert 0 < transposed["tsum"] and transposed["tsum"] + transposed["wsum"] <= per_lane["butterfly"]["wsum"] / 6


def test_sums_that_are_neither_are_refused(monkeypatch):
    from beatflow.model.step_kernel import step_sums

    monkeypatch.setenv("BEATFLOW_STEP_SUMS", "pairwise")
    with pytest.raises(ValueError, match="'transposed' or 'butterfly', got 'pairwise'"):
        step_sums()
    assert step_sums("butterfly") == "butterfly"
    monkeypatch.setenv("BEATFLOW_STEP_SUMS", "transposed")
    assert step_sums() == "transposed"
    monkeypatch.delenv("BEATFLOW_STEP_SUMS")
    assert step_sums() == "transposed"  # (the default: the faster, the same bits on the GPU)


def test_kernel_training_is_refused_where_it_cannot_run():
    beats = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="training with the step kernel: it runs on a CUDA device"):
        train_vae(beats, epochs=1, batch_size=16, kernel=True)
    res = train_vae(beats, epochs=1, batch_size=16, kernel=None)  # auto: not on the CPU
    assert not res.kernel


def test_a_kernel_that_cannot_run_falls_back_to_pytorchs_steps(monkeypatch):
    """Where the step kernel is chosen but cannot be built or launched (here: a CPU tensor), training
    warns once and runs PyTorch's steps: the same result as without the kernel, nothing kept."""
    from beatflow.model import graphs as G
    from beatflow.model import train as T
    beats = np.random.default_rng(1).normal(size=(200, 16)).astype(np.float32)
    monkeypatch.setattr(T, "training_kernel", lambda kernel, device, amp=None: True)
    with pytest.warns(RuntimeWarning, match="the training step kernel cannot run here"):
        res = train_vae(beats, epochs=2, batch_size=32, seed=4, keep_graphs=True)
    monkeypatch.undo()
    plain = train_vae(beats, epochs=2, batch_size=32, seed=4)
    assert not res.kernel and not res.graphs_kept and not G._KEPT
    assert res.train_loss == plain.train_loss and res.test_loss == plain.test_loss


@needs_gpu
def test_kernel_step_fills_the_models_gradients():
    """``KernelStep``: the batch's gradient in each parameter's ``.grad`` and the batch's loss, against
    autograd with the noise the step drew; the parameters are views of the kernel's flat vector."""
    from beatflow.model.step_kernel import KernelStep

    model = random_model(64, 3)
    before = _copy(model)
    model = model.cuda()
    step = KernelStep(model, "cuda")
    x = torch.as_tensor(np.random.default_rng(3).normal(size=(100, 64)).astype(np.float32)).cuda()
    loss = float(step(x))
    eps = step._buffers[100][0].cpu().numpy()
    want = reference(before, x.cpu().numpy(), eps).sum(axis=0)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy()
    np.testing.assert_allclose(got, want[:-1], rtol=1e-3, atol=1e-4 * np.abs(want[:-1]).max())
    assert loss == pytest.approx(want[-1], rel=1e-4)
    lo, hi = step.flat.data_ptr(), step.flat.data_ptr() + 4 * step.flat.numel()
    assert all(lo <= p.data_ptr() < hi for p in model.parameters())


def _copy(model: LightVAE) -> LightVAE:
    m = LightVAE(model.width)
    m.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return m


@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_training_with_the_kernel_reaches_the_models_loss(graphs):
    """Training by the step kernel (launched, or replayed from CUDA graphs) against PyTorch's own steps in
    fp32: the same split and start, other noise; the losses agree within 5 %."""
    from beatflow.model.train import training_graphs

    if graphs and not training_graphs(None, "cuda"):
        pytest.skip("PyTorch allocates from another allocator here: no capture")
    from test_model import synthetic_beats

    beats = torch.as_tensor(synthetic_beats(4000, width=64)).cuda()
    plain = train_vae(beats, epochs=4, batch_size=512, device="cuda", seed=2, kernel=False)
    mine = train_vae(beats, epochs=4, batch_size=512, device="cuda", seed=2, kernel=True, cudagraphs=graphs)
    assert mine.kernel and not plain.kernel and mine.cudagraphs == graphs and not mine.compiled
    assert mine.train_loss[-1] < mine.train_loss[0]
    assert abs(mine.test_loss / plain.test_loss - 1) < 0.05, (mine.test_loss, plain.test_loss)
    assert abs(mine.train_loss[-1] / plain.train_loss[-1] - 1) < 0.05
    assert mine.model.fc.weight.device.type == "cpu"


@needs_gpu
def test_an_epoch_graph_trains_as_a_graph_per_step(monkeypatch):
    """With the kernel, an epoch is one CUDA graph; refused, a graph per step: the same training (other
    noise: the warm-ups draw differently), and the epoch graph's kept replays equal its fresh capture."""
    from beatflow.model import train as T
    from test_model import synthetic_beats

    if not T.training_graphs(None, "cuda"):
        pytest.skip("PyTorch allocates from another allocator here: no capture")
    beats = torch.as_tensor(synthetic_beats(4000, width=64)).cuda()
    kw = dict(epochs=4, batch_size=512, device="cuda", seed=2, kernel=True, cudagraphs=True)
    seen = []
    whole = train_vae(beats, on_epoch=lambda e, loss, t: seen.append((e, loss)), **kw)
    assert whole.epoch_graph and whole.cudagraphs and whole.kernel
    assert seen == list(enumerate(whole.train_loss, start=1))  # (each epoch reported once, in order)

    class Refused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no epoch graph here")

    monkeypatch.setattr(T, "EpochGraph", Refused)
    with pytest.warns(RuntimeWarning, match="a graph per step instead"):
        steps = train_vae(beats, **kw)
    assert steps.cudagraphs and not steps.epoch_graph
    assert abs(whole.test_loss / steps.test_loss - 1) < 0.02
    assert abs(whole.train_loss[-1] / steps.train_loss[-1] - 1) < 0.02


@needs_gpu
def test_flow_shapes_on_the_gpu():
    """The flow's rows (256 samples), a full batch of 1024 and a partial one, on the device; the
    transposed sums give the butterflies' gradients bit for bit."""

    rng = np.random.default_rng(7)
    model = random_model(256, 7)
    for rows in (1024, 77):
        x = (rng.normal(size=(rows, 256)) * 0.2).astype(np.float32)
        eps = rng.normal(size=(rows, 2)).astype(np.float32)
        got = row_grads(x, eps, flat_params(model), sums="transposed")
        assert np.array_equal(got, row_grads(x, eps, flat_params(model), sums="butterfly"))
        want = reference(model, x[:16], eps[:16])
        scale = np.abs(want[:, :-1]).max(axis=1, keepdims=True)
        np.testing.assert_allclose(got[:16, :-1], want[:, :-1], rtol=1e-3, atol=1e-4 * float(scale.max()))
        np.testing.assert_allclose(got[:16, -1], want[:, -1], rtol=1e-4)
        assert np.isfinite(got).all()


@needs_gpu
def test_queued_epochs_train_as_epoch_by_epoch(monkeypatch):
    """All epochs queued before a loss is read (``queued_epochs``) train exactly as the epochs run one
    at a time, each order made and each loss read before the next epoch (the naive loop, here)."""
    from beatflow.model import train as T
    from test_model import synthetic_beats

    if not T.training_graphs(None, "cuda"):
        pytest.skip("PyTorch allocates from another allocator here: no capture")
    beats = torch.as_tensor(synthetic_beats(3000, width=64)).cuda()
    kw = dict(epochs=5, batch_size=256, device="cuda", seed=4, kernel=True, cudagraphs=True)
    queued = train_vae(beats, **kw)
    assert queued.epoch_graph
    assert len(queued.epoch_gpu_ms) == 5 and all(ms > 0 for ms in queued.epoch_gpu_ms)

    def one_at_a_time(graph, data, train_idx, n_train, epochs, gen, on_epoch, t0, then=None):
        losses = []
        for e in range(epochs):
            order = train_idx[torch.randperm(n_train, generator=gen).to(data.device)]
            losses.append(float(graph.run(data, order)) / n_train)
        return losses, None  # (the held-out loss then computed after the epochs, by train_vae)

    monkeypatch.setattr(T, "queued_epochs", one_at_a_time)
    naive = train_vae(beats, **kw)
    assert naive.epoch_graph
    assert queued.train_loss == naive.train_loss and queued.test_loss == naive.test_loss
    for (k, a), b in zip(queued.model.state_dict().items(), naive.model.state_dict().values()):
        assert torch.equal(a, b), k

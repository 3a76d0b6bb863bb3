"""The fusible form of the LightVAE (beatflow.model.fused) against the nn.Module it restates."""
import numpy as np
import pytest
import torch

from beatflow.model.fused import FusedScorer, conv3, downsample, fused_forward, upsample2
from beatflow.model.train import train_vae, training_precision
from beatflow.model.vae import Downsample, LightVAE, Scorer


def _random_vae(seed, width=64):
    torch.manual_seed(seed)
    vae = LightVAE(width)
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.5)  # away from the initialisation, all weights matter
    return vae.eval()


@pytest.mark.parametrize("cin,cout,n", [(1, 2, 16), (8, 4, 10), (2, 1, 7)])
def test_conv3_is_conv1d_with_padding_1(cin, cout, n):
    g = torch.Generator().manual_seed(cin * 10 + cout)
    x, w, b = torch.randn(5, cin, n, generator=g), torch.randn(cout, cin, 3, generator=g), torch.randn(cout, generator=g)
    torch.testing.assert_close(conv3(x, w, b), torch.nn.functional.conv1d(x, w, b, padding=1), rtol=1e-5, atol=1e-6)


def test_downsample_and_upsample_match_the_modules():
    x = torch.randn(3, 4, 32)
    torch.testing.assert_close(downsample(x), Downsample(4)(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(upsample2(x), torch.nn.Upsample(scale_factor=2, mode="nearest")(x))


@pytest.mark.parametrize("seed", range(3))
def test_fused_scorer_and_forward_match_the_model(seed):
    vae = _random_vae(seed)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        s0, m0 = Scorer(vae).eval()(x)
        s1, m1 = FusedScorer(vae)(x)
        r0, mu0, lv0 = vae(x)
        eps = torch.randn(37, 2)
        r1, mu1, lv1 = fused_forward(vae, x, eps)
        z = mu0 + torch.exp(0.5 * lv0) * eps
        r2 = vae.decode(z)
        r3, _, _ = fused_forward(vae, x)
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m1, m0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lv1, lv0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r1, r2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r3, r0, rtol=1e-5, atol=1e-5)
    assert FusedScorer(vae).vae is vae  # shares the parameters, no copy


def test_fused_gradients_match_the_model():
    vae = _random_vae(4)
    x = torch.randn(16, 64)
    vae.zero_grad()
    r, mu, lv = vae(x)
    (((x - r) ** 2).mean() + lv.square().mean() + mu.square().mean()).backward()
    g0 = {n: p.grad.clone() for n, p in vae.named_parameters()}
    vae.zero_grad()
    r, mu, lv = fused_forward(vae, x)
    (((x - r) ** 2).mean() + lv.square().mean() + mu.square().mean()).backward()
    for n, p in vae.named_parameters():
        torch.testing.assert_close(p.grad, g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_training_precision_rules():
    assert training_precision("auto", "cpu") == "fp32"
    with pytest.raises(ValueError, match="for GPUs"):
        training_precision("bf16", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        training_precision("fp8", "cpu")


def test_compiled_training_matches_eager_training():
    """torch.compile of the fusible step (Inductor's C++ backend on the CPU) trains to the same
    losses as the eager model, seed for seed; falls back to uncompiled steps if compiling fails."""
    x = (0.3 * np.random.default_rng(0).normal(size=(600, 64))).astype(np.float32)
    a = train_vae(x, epochs=2, batch_size=128, seed=1)
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        b = train_vae(x, epochs=2, batch_size=128, seed=1, compile=True)
    assert not [w for w in seen if "training uncompiled" in str(w.message)]  # it did compile
    assert b.compiled and not a.compiled
    np.testing.assert_allclose(b.train_loss, a.train_loss, rtol=1e-4)
    np.testing.assert_allclose(b.test_loss, a.test_loss, rtol=1e-4)


def test_compiled_steps_take_full_batches_only(monkeypatch):
    """Without CUDA graphs an epoch's last, shorter batch runs the fusible step uncompiled: the
    compiled function sees one batch shape, so Inductor compiles one graph, not two."""
    import torch

    seen = []

    def fake_compile(fn, **kw):
        def run(xb, eps):
            seen.append(int(xb.shape[0]))
            return fn(xb, eps)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    x = (0.3 * np.random.default_rng(0).normal(size=(600, 64))).astype(np.float32)  # 450 training rows
    r = train_vae(x, epochs=2, batch_size=128, seed=1, compile=True)
    assert r.compiled
    assert seen == [128] * 6  # 3 full batches an epoch; the 66 rows of the last one ran uncompiled
    eager = train_vae(x, epochs=2, batch_size=128, seed=1)
    np.testing.assert_allclose(r.train_loss, eager.train_loss, rtol=1e-5)


def test_steps_uncompiled_in_graphs_under_a_pluggable_allocator(monkeypatch):
    """Captured steps are compiled only with PyTorch's own allocator (Inductor's kernels cannot be
    launched inside a capture under RMM's async pool); there the fusible form runs uncompiled and
    gives the compiled step's loss."""
    import torch

    from beatflow.model import train as T
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    assert T.training_compiled(True, graphs=True) and T.training_compiled(True, graphs=False)
    assert not T.training_compiled(False, graphs=True)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "pluggable")
    assert not T.training_compiled(True, graphs=True) and T.training_compiled(True, graphs=False)
    torch.manual_seed(0)
    model = LightVAE(64)
    xb = torch.from_numpy((0.3 * np.random.default_rng(1).normal(size=(32, 64))).astype(np.float32))
    losses = []
    for compile in (True, False):
        step = T._step_loss(model, "cpu", None, compile, fused=True)
        torch.manual_seed(5)  # the same reparameterisation noise
        losses.append(float(step(xb)))
        assert not step.failed
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_fused_forward_in_half_precision_casts_the_arithmetic_and_keeps_float32_gradients(half):
    """``dtype``: the form computes in bf16 / fp16 (outputs of that type, close to float32), the
    parameters and their gradients stay float32 (autocast left this form's multiply-adds in float32)."""
    vae = _random_vae(7)
    x = 0.3 * torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    eps = torch.randn(32, 2, generator=torch.Generator().manual_seed(8))
    grads = []
    for dtype in (None, half):
        vae.zero_grad()
        r, mu, lv = fused_forward(vae, x, eps, dtype=dtype)
        assert r.dtype == mu.dtype == lv.dtype == (dtype or torch.float32)
        (((x - r.float()) ** 2).mean() + lv.float().square().mean()).backward()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in vae.parameters())
        grads.append(torch.cat([p.grad.flatten() for p in vae.parameters()]))
        if dtype is None:
            r32 = r.detach()
    torch.testing.assert_close(r.float().detach(), r32, rtol=0.05, atol=0.05 * float(r32.abs().max()))
    assert not torch.equal(r.float().detach(), r32)  # it did compute in half precision
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos > 0.99


def test_bf16_steps_train_to_within_5_percent_of_float32():
    """The training step of the fusible form with bf16 arithmetic (as on a GPU) reaches a loss
    within 5 % of the float32 step's on the same data and seed (the mixed-precision criterion)."""
    from beatflow.model import train as T
    from beatflow.model.vae import vae_loss
    rng = np.random.default_rng(3)
    t = np.linspace(0, 1, 64, dtype=np.float32)
    x = (np.exp(-((t - 0.3) / 0.03) ** 2)[None, :] * rng.uniform(0.5, 1.5, (512, 1))
         + 0.02 * rng.normal(size=(512, 64))).astype(np.float32)
    xb = torch.from_numpy(x)
    final = {}
    for amp in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = LightVAE(64)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        step = T._step_loss(model, "cpu", amp, False, fused=True)
        for _ in range(150):
            loss = step(xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            r, mu, lv = model(xb)
            final[amp] = float(vae_loss(xb, r, mu, lv)) / len(x)
    assert final[torch.bfloat16] != final[None]  # (not the same arithmetic)
    assert abs(final[torch.bfloat16] - final[None]) <= 0.05 * final[None], final


def test_compile_pays_on_the_gpu_and_for_large_cpu_trainings():
    """``--train-compile auto``: always on a GPU; on the CPU from CPU_COMPILE_MIN_ROW_EPOCHS rows x
    epochs (the 20 h default run: 72 826 training rows x 10 epochs), not for small trainings."""
    from beatflow.params import CPU_COMPILE_MIN_ROW_EPOCHS, TRAIN_FRACTION, compile_pays

    assert compile_pays("gpu", 10, 1)
    assert compile_pays("cpu", int(97102 * TRAIN_FRACTION), 10)
    assert not compile_pays("cpu", int(97102 * TRAIN_FRACTION), 2)
    assert not compile_pays("cpu", 500, 10)
    assert compile_pays("cpu", CPU_COMPILE_MIN_ROW_EPOCHS, 1) and not compile_pays("cpu", CPU_COMPILE_MIN_ROW_EPOCHS - 1, 1)

"""The LightVAE's arithmetic as shifted slices and small sums, for a compiler to fuse on the GPU.

The LightVAE's convolutions have 1 to 8 channels and 3 taps. cuDNN runs each of them (and each
``Upsample``, ``Swish`` and depthwise ``Downsample``) as a kernel of its own that is mostly launch
and memory traffic: the exported scorer was ~25 kernels, 310 µs at batch 1 on an H200. Written as
shifted views of the input and multiply-adds (the same operations, in the same parameters),
TorchInductor fuses a whole block (convolution, activation, downsampling or upsampling) into one
Triton kernel, so the scorer becomes a handful of kernels.

Nothing here is a new model: :class:`FusedScorer` and :func:`fused_forward` compute what
:class:`beatflow.model.vae.Scorer` and ``LightVAE.forward`` compute, with the LightVAE's own parameters
(shared, not copied), up to float rounding; ``tests/test_fused.py`` checks both against the
``nn.Module`` versions on random weights and inputs. Used by the ``compiled`` engine on GPUs
(:mod:`beatflow.engine.compiled`) and for compiled training steps
(``beatflow.model.train.train_vae(compile=True)``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from beatflow.model.vae import LightVAE


def conv3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``conv1d(x, weight, bias, padding=1)`` for a 3-tap kernel, as ``Σ_c Σ_k w[o,c,k] x[c, t+k-1]``.

    ``x``: (B, Cin, L), ``weight``: (Cout, Cin, 3), ``bias``: (Cout,) -> (B, Cout, L).
    """
    n = x.shape[-1]
    xp = F.pad(x, (1, 1))
    y = bias[None, :, None]
    for k in range(3):
        y = y + (weight[None, :, :, k, None] * xp[:, None, :, k:k + n]).sum(dim=2)
    return y


def swish(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


def downsample(x: torch.Tensor) -> torch.Tensor:
    """The fixed ``[1, 2, 1] / 4`` filter at stride 2 with zero padding 1 (even lengths)."""
    n = x.shape[-1]
    xp = F.pad(x, (1, 1))
    return 0.25 * xp[..., 0:n:2] + 0.5 * xp[..., 1:n + 1:2] + 0.25 * xp[..., 2:n + 2:2]


def upsample2(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour upsampling by 2 along the last axis."""
    b, c, n = x.shape
    return x.unsqueeze(-1).expand(b, c, n, 2).reshape(b, c, 2 * n)


def _caster(dtype: torch.dtype | None):
    """``t -> t.to(dtype)`` (the identity when ``dtype`` is None): a parameter used in ``dtype``, its
    gradient flowing back to the float32 parameter (mixed precision without autocast, which leaves
    the multiply-adds and sums of this form in float32)."""
    return (lambda t: t) if dtype is None else (lambda t: t.to(dtype))


def fused_encode(vae: LightVAE, x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``vae.encode(x)``: ``(mu, logvar)`` of beats ``x`` (B, D); computed in ``dtype`` (input and
    parameters cast) when given."""
    c = _caster(dtype)
    h = c(x).unsqueeze(1)
    for i in (0, 3, 6):  # conv, Swish, Downsample
        conv, act = vae.enc[i], vae.enc[i + 1]
        h = downsample(swish(conv3(h, c(conv.weight), c(conv.bias)), c(act.alpha)))
    mu = conv3(h, c(vae.mu_head.weight), c(vae.mu_head.bias)).mean(dim=2)
    logvar = conv3(h, c(vae.logvar_head.weight), c(vae.logvar_head.bias)).mean(dim=2)
    return mu, logvar


def fused_decode(vae: LightVAE, z: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``vae.decode(z)``: reconstructed beats (B, D) of latents ``z`` (B, 2); computed in ``dtype``
    (latents and parameters cast) when given."""
    c = _caster(dtype)
    z = c(z)
    w, b = c(vae.fc.weight), c(vae.fc.bias)  # (8·D/8, 2), (8·D/8,)
    h = b[None, :]
    for j in range(w.shape[1]):  # a 2-input linear layer as multiply-adds (no GEMM kernel)
        h = h + z[:, j:j + 1] * w[None, :, j]
    h = h.view(-1, 8, vae.width // 8)
    for i in (1, 4):  # Upsample, conv, Swish
        conv, act = vae.dec[i], vae.dec[i + 1]
        h = swish(conv3(upsample2(h), c(conv.weight), c(conv.bias)), c(act.alpha))
    conv = vae.dec[7]
    return conv3(upsample2(h), c(conv.weight), c(conv.bias)).squeeze(1)


def fused_forward(vae: LightVAE, x: torch.Tensor, eps: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None):
    """``vae(x)`` with the noise given: ``(recon, mu, logvar)``, ``z = mu + exp(logvar/2)·eps``
    (``z = mu`` when ``eps`` is None). ``dtype`` (bf16, fp16): the arithmetic in that type, the
    parameters staying float32 (their gradients too); the outputs are then of that type."""
    mu, logvar = fused_encode(vae, x, dtype)
    z = mu if eps is None else mu + torch.exp(0.5 * logvar) * _caster(dtype)(eps)
    return fused_decode(vae, z, dtype), mu, logvar


class FusedScorer(nn.Module):
    """:class:`beatflow.model.vae.Scorer` (score = per-row MSE of the decoded ``mu``, and ``mu``) in the
    fusible form, optionally with the VAE in ``dtype`` (fp16/bf16: a cast copy; the input, the
    score and ``mu`` stay float32, as in :class:`beatflow.engine.base.PrecisionScorer`)."""

    def __init__(self, vae: LightVAE, dtype: torch.dtype = torch.float32):
        super().__init__()
        if dtype != torch.float32:
            import copy

            vae = copy.deepcopy(vae).to(dtype)
        self.vae = vae.eval()
        self.width = vae.width
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, _ = fused_encode(self.vae, x.to(self.dtype))
        recon = fused_decode(self.vae, mu).to(torch.float32)
        return (x - recon).square().mean(dim=1), mu.to(torch.float32)

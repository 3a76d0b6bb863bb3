"""LightVAE: a small 1-D convolutional variational autoencoder for heartbeat anomaly scoring.

A beat matrix of shape ``(B, D)`` (``D`` a multiple of 8) is encoded to a 2-dimensional latent
``(mu, logvar)`` and decoded back to ``(B, D)``. The anomaly score of a beat is the mean squared
error between the beat and the decoding of its latent mean (see :class:`Scorer`). Here: the model,
its loss, the reference (eager) scores and the weights' file; training is :mod:`beatflow.model.train`.

This module only needs PyTorch and NumPy (no Prefect, no Dask).
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LATENT_DIM",
    "Swish",
    "Downsample",
    "LightVAE",
    "Scorer",
    "vae_loss",
    "as_float_tensor",
    "score_beats",
    "save_model",
    "load_model",
]

LATENT_DIM = 2
KL_WEIGHT = 0.1

ArrayLike = Union[np.ndarray, torch.Tensor]


class Swish(nn.Module):
    """``x * sigmoid(alpha * x)`` with a learnable scalar ``alpha`` (initialised to 1)."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.alpha * x)


class Downsample(nn.Module):
    """Halve the length with a fixed depthwise ``[1, 2, 1] / 4`` filter (stride 2, padding 1).

    Parameters
    ----------
    channels : int
        Number of channels; the filter is applied to each channel separately.
    """

    def __init__(self, channels: int):
        super().__init__()
        self.channels = int(channels)
        kernel = torch.tensor([1.0, 2.0, 1.0]) / 4.0
        # A constant, not a parameter: excluded from the state dict and from the optimizer.
        self.register_buffer("kernel", kernel.repeat(self.channels, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.kernel, stride=2, padding=1, groups=self.channels)


class LightVAE(nn.Module):
    """Convolutional VAE for beats of ``width`` samples with a 2-dimensional latent.

    Parameters
    ----------
    width : int
        Samples per beat ``D``; must be a positive multiple of 8.

    Notes
    -----
    Encoder: three blocks ``conv1d(k=3, p=1) -> Swish -> Downsample`` with channels
    1→2→4→8 (length ``D → D/8``), then two ``conv1d`` heads 8→2 averaged over time giving
    ``mu`` and ``logvar``. Decoder: ``linear(2 → 8·D/8)`` reshaped to ``(8, D/8)``, then three
    times nearest-upsample ×2 and ``conv1d`` (8→4, 4→2, 2→1), Swish after the first two.
    :meth:`forward` samples ``z`` with the reparameterisation trick in training mode and uses
    ``z = mu`` in eval mode.
    """

    def __init__(self, width: int = 256):
        super().__init__()
        width = int(width)
        if width <= 0 or width % 8:
            raise ValueError(f"LightVAE width must be a positive multiple of 8, got {width}")
        self.width = width
        self.enc = nn.Sequential(
            nn.Conv1d(1, 2, 3, padding=1), Swish(), Downsample(2),
            nn.Conv1d(2, 4, 3, padding=1), Swish(), Downsample(4),
            nn.Conv1d(4, 8, 3, padding=1), Swish(), Downsample(8),
        )
        self.mu_head = nn.Conv1d(8, LATENT_DIM, 3, padding=1)
        self.logvar_head = nn.Conv1d(8, LATENT_DIM, 3, padding=1)
        self.fc = nn.Linear(LATENT_DIM, 8 * (width // 8))
        self.dec = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv1d(8, 4, 3, padding=1), Swish(),
            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv1d(4, 2, 3, padding=1), Swish(),
            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv1d(2, 1, 3, padding=1),
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)``, each ``(B, 2)``, for beats ``x`` of shape ``(B, D)``."""
        h = self.enc(x.unsqueeze(1))
        return self.mu_head(h).mean(dim=2), self.logvar_head(h).mean(dim=2)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstructed beats ``(B, D)`` for latents ``z`` of shape ``(B, 2)``."""
        h = self.fc(z).view(-1, 8, self.width // 8)
        return self.dec(h).squeeze(1)

    @staticmethod
    def reparameterize(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        """Sample ``z = mu + exp(logvar / 2) * eps`` with ``eps ~ N(0, 1)``."""
        return mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(recon (B, D), mu (B, 2), logvar (B, 2))``; sampled ``z`` only in training mode."""
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar) if self.training else mu
        return self.decode(z), mu, logvar


class Scorer(nn.Module):
    """Deterministic anomaly scorer around a :class:`LightVAE` (the exported inference graph).

    Parameters
    ----------
    vae : LightVAE
        The trained autoencoder.
    """

    def __init__(self, vae: LightVAE):
        super().__init__()
        self.vae = vae
        self.width = vae.width

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(score (B,), mu (B, 2))``: per-row MSE between ``x`` and the decoding of ``mu``."""
        mu, _ = self.vae.encode(x)
        recon = self.vae.decode(mu)
        score = (x - recon).square().mean(dim=1)
        return score, mu


def vae_loss(x: torch.Tensor, recon: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """Batch total of the VAE loss.

    Parameters
    ----------
    x, recon : torch.Tensor
        Beats and their reconstructions, shape ``(B, D)``.
    mu, logvar : torch.Tensor
        Latent mean and log-variance, shape ``(B, 2)``.

    Returns
    -------
    torch.Tensor
        Scalar ``sum_b [ mean_d (x - recon)^2  -  0.1 * mean_k (1 + logvar - mu^2 - exp(logvar)) ]``.
        Divide by the number of rows for the average loss per row.
    """
    mse = (x - recon).square().mean(dim=1)
    kl = -KL_WEIGHT * (1.0 + logvar - mu.square() - logvar.exp()).mean(dim=1)
    return (mse + kl).sum()


def as_float_tensor(beats: ArrayLike, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """``beats`` as a float32 tensor without copying when it already is one (or float32 NumPy)."""
    t = beats if isinstance(beats, torch.Tensor) else torch.as_tensor(beats)
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    if device is not None:
        t = t.to(device)
    return t


def score_beats(model: Union[LightVAE, Scorer], beats: ArrayLike, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Reference (eager PyTorch) anomaly scores.

    Parameters
    ----------
    model : LightVAE or Scorer
        Trained model; scoring runs on the device of its parameters.
    beats : numpy.ndarray or torch.Tensor
        Beat matrix ``(n, D)``.
    batch_size : int
        Rows per forward pass.

    Returns
    -------
    scores : numpy.ndarray
        float32 ``(n,)``: per-row MSE between the beat and the decoding of its latent mean.
    mu : numpy.ndarray
        float32 ``(n, 2)`` latent means.
    """
    scorer = model if isinstance(model, Scorer) else Scorer(model)
    dev = next(scorer.parameters()).device
    data = as_float_tensor(beats)
    n = data.shape[0]
    scores = np.empty(n, dtype=np.float32)
    mus = np.empty((n, LATENT_DIM), dtype=np.float32)
    batch_size = max(1, int(batch_size))
    with torch.no_grad():
        for start in range(0, n, batch_size):
            s, m = scorer(data[start:start + batch_size].to(dev))
            scores[start:start + len(s)] = s.cpu().numpy()
            mus[start:start + len(s)] = m.cpu().numpy()
    return scores, mus


def save_model(model: Union[LightVAE, Scorer], path: Union[str, os.PathLike]) -> None:
    """Write ``{"width": D, "state_dict": ...}`` with :func:`torch.save`.

    Parameters
    ----------
    model : LightVAE or Scorer
        Model to save (a Scorer saves its wrapped LightVAE).
    path : str or os.PathLike
        Destination file (conventionally ``*.pt``).
    """
    vae = model.vae if isinstance(model, Scorer) else model
    state = {k: v.detach().cpu() for k, v in vae.state_dict().items()}
    torch.save({"width": int(vae.width), "state_dict": state}, path)


def load_model(path: Union[str, os.PathLike]) -> LightVAE:
    """Load a model written by :func:`save_model`.

    Parameters
    ----------
    path : str or os.PathLike
        File written by :func:`save_model`.

    Returns
    -------
    LightVAE
        The model, on the CPU, in eval mode.
    """
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = LightVAE(int(ckpt["width"]))
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()

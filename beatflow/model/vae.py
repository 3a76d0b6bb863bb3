"""LightVAE: a small 1-D convolutional variational autoencoder for heartbeat anomaly scoring.

A beat matrix of shape ``(B, D)`` (``D`` a multiple of 8) is encoded to a 2-dimensional latent
``(mu, logvar)`` and decoded back to ``(B, D)``. The anomaly score of a beat is the mean squared
error between the beat and the decoding of its latent mean (see :class:`Scorer`).

This module only needs PyTorch and NumPy (no Prefect, no Dask).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# (defined with the parameters, where the flow's process reads them without importing PyTorch)
from beatflow.params import CPU_COMPILE_MIN_ROW_EPOCHS, TRAIN_FRACTION, compile_pays  # noqa: F401

__all__ = [
    "Swish",
    "Downsample",
    "LightVAE",
    "Scorer",
    "TrainResult",
    "vae_loss",
    "train_vae",
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


@dataclass
class TrainResult:
    """Outcome of :func:`train_vae`.

    Attributes
    ----------
    model : LightVAE
        Trained model, in eval mode, on the CPU.
    train_loss : list of float
        Average training loss per row, one value per epoch.
    test_loss : float
        Average loss per row on the held-out rows (eval mode); NaN when there are none.
    train_index, test_index : numpy.ndarray
        int64 row indices of the training and held-out rows.
    seconds : float
        Wall-clock training time (including the test evaluation).
    """

    model: LightVAE
    train_loss: list = field(default_factory=list)
    test_loss: float = float("nan")
    train_index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    test_index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    seconds: float = 0.0
    cudagraphs: bool = False  # whether the steps ran as replayed CUDA graphs
    compiled: bool = False  # whether the steps ran torch.compile-d (see train_vae's ``compile``)
    graphs_kept: bool = False  # whether the steps were graphs kept from an earlier call (``keep_graphs``)
    kernel: bool = False  # whether the steps ran as the step kernel (``beatflow.model.step_kernel``)
    epoch_graph: bool = False  # whether each epoch was one CUDA graph (the step kernel's, see ``_EpochGraph``)
    #: seconds of its parts: ``setup`` (the model, the optimizer, graph capture), ``epochs``, ``test``
    phases: dict = field(default_factory=dict)
    epoch_gpu_ms: list = field(default_factory=list)  # each epoch's GPU time (the epoch graph's queued epochs)
    queue_s: dict = field(default_factory=dict)  # the host's seconds of the queued epochs (``_queued_epochs``)


def _as_float_tensor(beats: ArrayLike, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """``beats`` as a float32 tensor without copying when it already is one (or float32 NumPy)."""
    t = beats if isinstance(beats, torch.Tensor) else torch.as_tensor(beats)
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    if device is not None:
        t = t.to(device)
    return t


def train_vae(
    beats: ArrayLike,
    *,
    epochs: int = 10,
    batch_size: int = 1024,
    train_fraction: float = TRAIN_FRACTION,
    seed: int = 42,
    lr: float = 1e-3,
    device: Union[str, torch.device] = "cpu",
    on_epoch: Optional[Callable[[int, float, float], None]] = None,
    precision: str = "fp32",
    compile: bool = False,
    cudagraphs: Optional[bool] = False,
    keep_graphs: bool = False,
    kernel: Optional[bool] = False,
) -> TrainResult:
    """Train a :class:`LightVAE` on a beat matrix.

    Parameters
    ----------
    beats : numpy.ndarray or torch.Tensor
        Beat matrix ``(n, D)``; ``D`` a multiple of 8. Float32 input is used without a copy
        (a tensor already on ``device`` stays where it is).
    epochs : int
        Passes over the training rows.
    batch_size : int
        Rows per optimiser step.
    train_fraction : float
        Fraction of rows (after a seeded shuffle) used for training; the rest is held out.
    seed : int
        Seeds the row split (``np.random.default_rng(seed).permutation``), the weight
        initialisation, the per-epoch batch order and the reparameterisation noise
        (``torch.manual_seed(seed)``), so runs are reproducible on one machine.
    lr : float
        Adam learning rate.
    device : str or torch.device
        Where to train (``"cpu"``, ``"cuda"``...).
    on_epoch : callable, optional
        Called as ``on_epoch(epoch, train_loss, elapsed_s)`` after each epoch, ``epoch``
        counting from 1 and ``elapsed_s`` the time since training started.
    precision : ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"``
        Mixed precision on a GPU: the forward pass in bf16 (the eager model under ``torch.autocast``,
        the fusible form of ``compile`` by casting its input and parameters), or in fp16
        with a gradient scaler; the loss, the weights and Adam stay fp32. ``"auto"``: bf16 where
        the GPU supports it, else fp16; fp32 on the CPU (see :func:`training_precision`).
    compile : bool
        Run each step's forward and backward as one ``torch.compile``-d function of the fusible
        form of the model (:mod:`beatflow.model.fused`, same parameters and arithmetic): a few fused
        kernels per step instead of dozens of cuDNN/elementwise launches. The first steps compile.
        Where the steps are captured in CUDA graphs while PyTorch allocates from RMM (a pluggable
        allocator: the flow's GPU workers), the fusible form runs uncompiled: Inductor's kernels
        cannot be launched inside such a capture. ``TrainResult.compiled`` tells what ran.
    cudagraphs : bool or None
        On a GPU, capture each step shape's whole step (forward, backward, fused Adam) once in a
        CUDA graph and replay it: one launch per step instead of dozens (the steps are tiny, so
        launches are what they cost). ``None``: where it can run (a CUDA device, PyTorch's own
        allocator (not RMM's), fp32 or bf16; fp16's gradient scaler is not captured). The weights
        are set back to their initial values after the warm-up steps that precede the capture.
    keep_graphs : bool
        With CUDA graphs: keep the captured steps, with the model and optimizer whose tensors they
        update, in this process for the next call of the same shapes and settings (one set at a time).
        That call sets their weights to its own initial ones (``seed``), zeroes the optimizer's state
        and starts the CUDA generator where a fresh capture would have left it, instead of compiling,
        warming up and capturing again (0.056 s of a warm flow run on an H100): it trains to the same
        weights. A second thread training meanwhile captures its own. ``TrainResult.graphs_kept`` tells.
    kernel : bool or None
        On a GPU, in fp32: each step's forward, loss and backward as one CUDA kernel, a warp per row
        (:mod:`beatflow.model.step_kernel`; the same arithmetic as the model's), instead of PyTorch's (or
        Inductor's) dozens of kernels; ``compile`` then does not apply. ``None``: where it can run (a
        CUDA device with Numba's CUDA target, fp32). ``TrainResult.kernel`` tells.

    Returns
    -------
    TrainResult
        The trained model (eval mode, CPU), per-epoch train losses, held-out loss, split
        indices and the elapsed time.

    Raises
    ------
    ValueError
        ``beats`` is not 2-D with a width that is a multiple of 8, or leaves no training rows.
    """
    t0 = time.perf_counter()
    data = _as_float_tensor(beats, device)
    if data.ndim != 2:
        raise ValueError(f"beats must be a 2-D (n, D) matrix, got shape {tuple(data.shape)}")
    n, width = data.shape
    n_train = int(n * train_fraction)
    if n_train < 1:
        raise ValueError(f"no training rows: {n} beats with train_fraction={train_fraction}")
    batch_size = max(1, int(batch_size))

    perm = np.random.default_rng(seed).permutation(n).astype(np.int64)

    torch.manual_seed(seed)
    on_cuda = data.device.type == "cuda"
    # on the GPU the step is launch-bound: one fused Adam kernel instead of a dozen per parameter;
    # deterministic cuDNN so that the same data and seed give the same weights (and so the same
    # engine-cache key) run after run
    amp = _autocast_dtype(training_precision(precision, data.device))
    graphs = training_graphs(cudagraphs, data.device, amp)
    use_kernel = training_kernel(kernel, data.device, amp)
    compiled = training_compiled(compile, graphs) and not use_kernel
    if on_cuda:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    scaler = torch.amp.GradScaler(data.device.type) if amp == torch.float16 else None
    shapes = sorted({min(batch_size, n_train), n_train % batch_size or min(batch_size, n_train)})
    key = (str(data.device), width, tuple(shapes), str(amp), compiled, bool(compile), use_kernel, float(lr),
           _kernel_sums() if use_kernel else None)  # (kept steps with the other sums are another kernel's)
    kept = _take_kept(key) if graphs and keep_graphs else None
    try:
        if kept is not None:  # the kept steps, from this call's initial weights and the generator's offset
            model, opt, step_loss = kept.model, kept.opt, kept.steps
            kept.reset(LightVAE(width).state_dict(), data.device)
            raw_step = None
        else:
            model = LightVAE(width).to(device)
            if use_kernel:  # (the parameters become views of the kernel's flat vector before Adam sees them)
                from beatflow.model.step_kernel import KernelStep

                try:
                    step_loss = raw_step = KernelStep(model, data.device)
                except Exception as e:  # not built or not launched here: PyTorch's steps
                    import warnings

                    warnings.warn(f"the training step kernel cannot run here ({_why(e)}); training with "
                                  "PyTorch's steps", RuntimeWarning)
                    use_kernel = keep_graphs = False  # (kept under the kernel's key, they would be misread)
                    compiled = training_compiled(compile, graphs)
            opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True if on_cuda else None, capturable=graphs)
            # (graphs capture each batch shape once, compiled; without them the last short batch of an
            # epoch runs uncompiled instead of compiling a second graph)
            if not use_kernel:
                step_loss = raw_step = _step_loss(model, data.device.type, amp, compiled, fused=bool(compile),
                                                  full=None if graphs else min(batch_size, n_train))
        if graphs and kept is None:
            try:
                if use_kernel:  # a whole epoch of kernel steps in one graph; else one graph per step shape
                    try:
                        step_loss = _EpochGraph(model, opt, step_loss, n_train, batch_size, width, data.device)
                    except Exception as e:
                        import warnings

                        warnings.warn(f"CUDA graph capture of a whole epoch failed ({_why(e)}); a graph per "
                                      "step instead", RuntimeWarning)
                        step_loss = _GraphedSteps(model, opt, step_loss, shapes, width, data.device)
                else:
                    step_loss = _GraphedSteps(model, opt, step_loss, shapes, width, data.device)
            except Exception as e:  # capture failed: the same steps, launched one by one
                import warnings

                warnings.warn(f"CUDA graph capture of the training step failed ({_why(e)}); training without "
                              "graphs", RuntimeWarning)
                graphs = False
            else:
                if keep_graphs:
                    kept = _keep(key, _KeptSteps(model, opt, step_loss, data.device,
                                                 compiled and not getattr(raw_step, "failed", False)))
        res = _train_epochs(t0, data, n_train, width, epochs, batch_size, seed, on_epoch, model, opt, step_loss,
                            raw_step, graphs, scaler, compiled, kept, perm[:n_train], perm[n_train:])
        res.kernel = use_kernel
        res.epoch_graph = isinstance(step_loss, _EpochGraph)
        res.epoch_gpu_ms = list(getattr(step_loss, "epoch_gpu_ms", None) or [])
        res.queue_s = dict(getattr(step_loss, "queue_s", None) or {})
        return res
    finally:
        if kept is not None:
            kept.lock.release()


def _train_epochs(t0, data, n_train, width, epochs, batch_size, seed, on_epoch, model, opt, step_loss, raw_step,
                  graphs, scaler, compiled, kept, train_index, test_index) -> TrainResult:
    """:func:`train_vae`'s epochs and held-out loss, once the model and its steps are set up."""
    on_cuda = data.device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)  # batch order; CPU generator works for any device
    train_idx = torch.from_numpy(train_index).to(data.device)

    losses: list[float] = []
    t_setup = time.perf_counter()
    queued = isinstance(step_loss, _EpochGraph)
    test_idx = torch.from_numpy(test_index).to(data.device) if len(test_index) else None
    # on the GPU few large batches (launch-bound); on the CPU the training's own batches: 8192
    # rows at a time took 2.2x as long (0.77 against 0.35 s for 19 k rows on 2 cores)
    chunk = max(batch_size, 8192) if on_cuda else batch_size
    test_total = None
    if queued:  # every epoch queued on the GPU (one replay each), then the held-out loss, before a loss is read
        model.train()
        losses, test_total = _queued_epochs(
            step_loss, data, train_idx, n_train, int(epochs), gen, on_epoch, t0,
            then=None if test_idx is None else lambda: _held_out_total(model, data, test_idx, chunk))
    for epoch in ([] if queued else range(1, int(epochs) + 1)):
        model.train()
        order = train_idx[torch.randperm(n_train, generator=gen).to(data.device)]
        # on the GPU one gather per epoch (the batches are views of it: fewer launches); on the CPU
        # a gather per batch (1 MB, stays in cache; a 75 MB copy per epoch cost page faults)
        shuffled = data[order] if on_cuda else None
        total = torch.zeros((), dtype=torch.float64, device=data.device)
        for start in range(0, n_train, batch_size):
            xb = shuffled[start:start + batch_size] if on_cuda else data[order[start:start + batch_size]]
            loss = step_loss(xb)
            if graphs:  # the replayed graph did the backward pass and the update
                total += loss
                continue
            if getattr(step_loss, "computes_grads", False):  # (the step kernel filled the gradients)
                opt.step()
                total += loss
                continue
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            total += loss.detach()
        losses.append(float(total) / n_train)
        if on_epoch is not None:
            on_epoch(epoch, losses[-1], time.perf_counter() - t0)

    if graphs and kept is None:
        step_loss.release()
    t_epochs = time.perf_counter()
    model.eval()
    test_loss = float("nan")
    if test_idx is not None:
        if test_total is None:
            test_total = _held_out_total(model, data, test_idx, chunk)
        test_loss = float(test_total) / len(test_index)

    t_end = time.perf_counter()
    if kept is not None:  # the kept steps update these tensors: the result is a copy
        out = LightVAE(width)
        out.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
        model = out
    return TrainResult(
        model=model.cpu().eval(),
        train_loss=losses,
        test_loss=test_loss,
        train_index=train_index,
        test_index=test_index,
        seconds=time.perf_counter() - t0,
        cudagraphs=graphs,
        compiled=compiled and not getattr(raw_step, "failed", False) if kept is None else kept.compiled,
        graphs_kept=kept is not None and kept.reused,
        phases={"setup": round(t_setup - t0, 4), "epochs": round(t_epochs - t_setup, 4),
                "test": round(t_end - t_epochs, 4)},
    )


def _held_out_total(model, data, test_idx, chunk: int) -> torch.Tensor:
    """The model's (eval mode) total VAE loss over ``data[test_idx]``, ``chunk`` rows at a time: a device scalar."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=data.device)
    with torch.no_grad():
        for start in range(0, len(test_idx), chunk):
            xb = data[test_idx[start:start + chunk]]
            recon, mu, logvar = model(xb)
            total += vae_loss(xb, recon, mu, logvar)
    return total


TRAINING_PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def native_allocator() -> bool:
    """Whether PyTorch allocates CUDA memory with its own caching allocator (needed by CUDA graphs)."""
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except Exception:  # pragma: no cover - older torch
        return False


def rmm_async_resource() -> bool:
    """Whether RMM's current device resource is (an adaptor over) ``CudaAsyncMemoryResource``: CUDA's
    own stream-ordered pool (``cudaMallocAsync``), which allocates inside a CUDA graph capture."""
    try:
        import rmm
    except ImportError:
        return False
    from beatflow.gpu.arena import resource_chain

    return any(isinstance(mr, rmm.mr.CudaAsyncMemoryResource) for mr in resource_chain())


def graph_allocator() -> bool:
    """Whether CUDA graphs can be captured with PyTorch's current CUDA allocator: its own caching
    allocator or its ``cudaMallocAsync`` backend, or RMM over CUDA's stream-ordered pool with a
    :class:`~beatflow.gpu.arena.CaptureArena` in front (the flow's GPU workers with
    ``--rmm-allocator async``). Not RMM's pool resource: its bookkeeping breaks the capture
    (``cudaErrorStreamCaptureInvalidated``), nor the async pool without the arena: the eager step's
    first replay then hit an illegal memory access, and compiled steps could not be captured (H200)."""
    try:
        backend = torch.cuda.memory.get_allocator_backend()
    except Exception:  # pragma: no cover - older torch
        return False
    if backend in ("native", "cudaMallocAsync"):
        return True
    from beatflow.gpu.arena import installed

    return rmm_async_resource() and installed() is not None


def training_graphs(cudagraphs: Optional[bool], device, amp=None) -> bool:
    """Whether :func:`train_vae` captures its steps in CUDA graphs (see its ``cudagraphs``)."""
    dev = torch.device(device)
    possible = dev.type == "cuda" and amp != torch.float16 and graph_allocator()
    if cudagraphs is None:
        return possible
    if cudagraphs and not possible:
        why = ("they run on a CUDA device" if dev.type != "cuda" else
               "fp16's gradient scaler is not captured: use bf16 or fp32" if amp == torch.float16 else
               "capture needs PyTorch's own CUDA allocator, or RMM over cudaMallocAsync with "
               "beatflow.gpu.arena.install() in front, and "
               f"{torch.cuda.memory.get_allocator_backend()} with another resource is installed")
        raise ValueError(f"training with CUDA graphs: {why}")
    return bool(cudagraphs)


@contextlib.contextmanager
def capture_graph(graph, pool, stream, arena_bytes: int, arenas: list):
    """``torch.cuda.graph(graph, pool=pool)`` for the training steps and the compiled engine, thread-
    local (CUDA calls of a Dask worker's other threads do not invalidate it). Under RMM with a
    :class:`~beatflow.gpu.arena.CaptureArena` in front, the capture's memory comes from a new
    arena of ``arena_bytes`` (mapped before the capture; appended to ``arenas``, which must live as
    long as the graph) and the capture runs on ``stream``, the warm-up's, whose library workspaces
    the warm-up made outside the arena. An arena too small is a ``RuntimeError`` after the capture."""
    from beatflow.gpu.arena import installed

    front = None if native_allocator() else installed()
    if front is None:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
        return
    with front.capture(arena_bytes) as arena, \
            torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield
    arenas.append(arena)
    if arena.overflow:
        raise RuntimeError(f"the capture needed more than its arena of {arena.size} bytes")


def _why(e: BaseException) -> str:
    """An exception as a warning names it: its type and the first line of its message."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _set_start(model, opt, state: dict) -> None:
    """Where training starts: the model's weights set to ``state``'s, the optimizer's state zeroed (the
    tensors stay: captured graphs read and write them)."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(state[k])
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()


class _KeptSteps:
    """Captured training steps kept for the next :func:`train_vae` of the same key (``keep_graphs``):
    the model and optimizer whose tensors the graphs update, and the CUDA generator's offset right
    after the capture (where the epochs of a fresh call start drawing their noise)."""

    def __init__(self, model, opt, steps: "_GraphedSteps | _EpochGraph", device, compiled: bool):
        self.model, self.opt, self.steps = model, opt, steps
        self.offset = torch.cuda.default_generators[_cuda_index(device)].get_offset()
        self.compiled = compiled  # (whether the captured steps are the compiled ones)
        self.reused = False
        self.lock = threading.Lock()
        self.lock.acquire()  # (the call that captured them trains with them first)

    def reset(self, state: dict, device) -> None:
        """The weights to ``state``'s (a fresh model of this call's seed), the optimizer's state to zero,
        the generator (already seeded) to the offset its fresh capture left."""
        _set_start(self.model, self.opt, state)
        torch.cuda.default_generators[_cuda_index(device)].set_offset(self.offset)
        self.reused = True


#: the kept steps of :func:`train_vae` (``keep_graphs``): at most one set, for one key
_KEPT: dict = {}
_KEPT_LOCK = threading.Lock()


def _cuda_index(device) -> int:
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _take_kept(key) -> Optional[_KeptSteps]:
    """The kept steps of ``key``, locked for this call; None if there are none or another thread has them."""
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
        if kept is not None and kept.lock.acquire(blocking=False):
            return kept
    return None


def _keep(key, kept: _KeptSteps) -> _KeptSteps:
    """Keep ``kept`` (locked by its caller) for ``key``; sets kept for other keys are dropped (their graphs
    and arenas freed) unless in use, when they are only forgotten."""
    with _KEPT_LOCK:
        for other in list(_KEPT.values()):
            if other.lock.acquire(blocking=False):
                other.steps.release()
                other.lock.release()
        _KEPT.clear()
        _KEPT[key] = kept
    return kept


class _GraphedSteps:
    """Whole training steps (forward, backward, optimizer update, gradients zeroed) captured once
    per batch shape in a CUDA graph; a call copies the batch into the static input, replays, and
    returns the step's loss (a device scalar the next replay overwrites).

    Capture is preceded by warm-up steps on a side stream (they compile, create the optimizer's
    state and the library workspaces); their effect is undone: the weights are set back to their
    values before them and the optimizer's state to zero, so training starts where it would have.
    """

    def __init__(self, model, opt, step_loss, shapes, width: int, device):
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.graphs = {}
        self.arenas = []
        # the step keeps what the graphs read and write outside their own pool (the step kernel's noise and
        # per-row gradient buffers): freed while kept graphs live on, their memory went to other tensors,
        # which the replays then overwrote (a flow run's training on an H100 hit a device-side assert)
        self.step_loss = step_loss
        try:
            self._capture(model, opt, step_loss, shapes, width, device)
        except BaseException:
            self.release()
            raise
        finally:  # also when capture fails: training then starts from the same weights
            _set_start(model, opt, initial)

    def _capture(self, model, opt, step_loss, shapes, width, device):
        pool = torch.cuda.graph_pool_handle()
        for b in shapes:
            static = torch.zeros((b, width), dtype=torch.float32, device=device)

            def step(static=static):
                loss = step_loss(static)
                if getattr(step_loss, "computes_grads", False):  # (the step kernel filled the gradients)
                    opt.step()
                    return loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                return loss.detach()

            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, pool, side, self.arena_bytes(b, width), self.arenas):
                loss = step()
            self.graphs[b] = (graph, static, loss)

    @staticmethod
    def arena_bytes(batch: int, width: int) -> int:
        """Bytes of the arena of one step's capture: room for ~256 batch-sized float32 tensors (the
        step makes a few dozen; an arena address is never reused within a capture)."""
        return max(64 << 20, 256 * batch * width * 4)

    def __del__(self):
        self.release()

    def release(self):
        """Drop the graphs and their tensors, then the arenas they live in (in that order: a free
        of an arena address is a no-op only while its arena is alive)."""
        self.graphs.clear()
        self.arenas.clear()
        self.step_loss = None

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        graph, static, loss = self.graphs[xb.shape[0]]
        static.copy_(xb)
        graph.replay()
        return loss


@contextlib.contextmanager
def _collector_watched():
    """``{"seconds", "collections"}`` of the garbage collector's passes inside, in any thread (filled on exit)."""
    import gc

    stats, began = {"seconds": 0.0, "collections": 0}, []

    def watch(phase, info):
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            stats["seconds"] += time.perf_counter() - began.pop()
            stats["collections"] += 1

    gc.callbacks.append(watch)
    try:
        yield stats
    finally:
        gc.callbacks.remove(watch)


@contextlib.contextmanager
def _collector_paused():
    """No automatic garbage collection inside (as it was after)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: the interpreter's thread switch interval (s) while :func:`_queued_epochs` queues the epochs; None: unchanged
QUEUE_SWITCH_INTERVAL: Optional[float] = 1e-4


def _queued_epochs(graph: "_EpochGraph", data, train_idx, n_train: int, epochs: int, gen, on_epoch, t0,
                   then: Optional[Callable[[], torch.Tensor]] = None) -> tuple[list, Optional[torch.Tensor]]:
    """The epochs of an :class:`_EpochGraph`, all queued on the GPU before the first epoch's loss is read.

    Epoch by epoch, reading a loss waited for the GPU, and the next epoch's batch order (a permutation
    made on the CPU, then copied) was made only then: the GPU idled for that host work and for whatever
    other thread held the interpreter meanwhile (in the flow's Dask worker the epochs took 0.21 s against
    0.13 s of GPU work, H100). Here the epochs' orders are made from the generator's sequence (the same
    orders as epoch by epoch), every replay is queued, each epoch's loss total is copied to pinned memory
    behind an event, and the losses are read (and reported) in order.

    Every PyTorch call lets go of the interpreter's lock and takes it back; where another thread of the
    process wants it (a Dask worker's), taking it back waited up to the switch interval, 5 ms: in the flow's
    worker the epochs took 0.27-0.31 s against 113 ms of GPU time (H200), where a bare process took 0.12 s.
    While the epochs are queued the interval is :data:`QUEUE_SWITCH_INTERVAL`, the garbage collector waits,
    and the orders are made on one intra-op thread (not a team of the machine's cores, which the flow's
    figure processes share): the flow's worker then queued ten epochs in 0.7 ms and trained them in 0.126 s
    (H100; ``bench/gpu_train_step_kernel.py``'s ``kernel-busy`` variants show the switch interval's part).
    Kept on the graph: each epoch's GPU time (``epoch_gpu_ms``); the host's seconds to make the orders, to
    queue the epochs and to read them, the garbage collector's seconds meanwhile and the process's other
    threads (``queue_s``).

    The first epoch is queued as soon as its order is made; the other orders are made while the GPU runs it
    and copied at once (pinned, not blocking: a blocking copy would wait for the GPU). ``then``, if given,
    is queued after the last epoch, before the first loss is read (the held-out loss: its launches overlap
    the epochs); its device result is returned beside the losses."""
    from beatflow.device import switch_interval
    from beatflow.engine.base import torch_threads

    device = data.device
    if not epochs:
        return [], (then() if then is not None else None)
    with _collector_watched() as in_gc:
        with switch_interval(QUEUE_SWITCH_INTERVAL), _collector_paused():
            t_start = time.perf_counter()
            host = torch.zeros(epochs, dtype=torch.float64).pin_memory()
            began = [torch.cuda.Event(enable_timing=True) for _ in range(epochs)]
            done = [torch.cuda.Event(enable_timing=True) for _ in range(epochs)]
            t_orders = t_queue = 0.0

            def queue(first, last):  # the epochs first..last-1: their orders (one copy), then their replays
                nonlocal t_orders, t_queue
                t = time.perf_counter()
                with torch_threads(1):  # (small: no intra-op team to wake beside the figure processes)
                    perms = torch.stack([torch.randperm(n_train, generator=gen) for _ in range(first, last)])
                # (pinned, not blocking: a blocking copy from pageable memory waits for the queued epochs)
                orders = train_idx[perms.pin_memory().to(device, non_blocking=True)]
                t_orders += time.perf_counter() - t
                t = time.perf_counter()
                for e in range(first, last):
                    began[e].record()
                    total = graph.run(data, orders[e - first])  # (the next replay overwrites it: copied first)
                    host[e].copy_(total, non_blocking=True)
                    done[e].record()
                t_queue += time.perf_counter() - t

            queue(0, 1)  # (the GPU starts on epoch 1 while the host makes the other orders)
            if epochs > 1:
                queue(1, epochs)
            t = time.perf_counter()
            after = then() if then is not None else None
            t_queued = time.perf_counter()
            t_then = t_queued - t
        losses: list[float] = []
        for e in range(epochs):
            done[e].synchronize()
            losses.append(float(host[e]) / n_train)
            if on_epoch is not None:
                on_epoch(e + 1, losses[-1], time.perf_counter() - t0)
    # each epoch's time on the GPU, from its gather to its loss's copy, and the host's side: where the
    # epochs' wall time went (the process's other threads by name: what may have held the interpreter)
    graph.epoch_gpu_ms = [round(b.elapsed_time(d), 3) for b, d in zip(began, done)]
    others = sorted({t.name.rstrip("0123456789-_") or t.name for t in threading.enumerate()
                     if t is not threading.current_thread()})
    graph.queue_s = {"orders": round(t_orders, 4), "queue": round(t_queue, 4),
                     "then": round(t_then, 4), "setup": round(t_queued - t_start - t_orders - t_queue - t_then, 4),
                     "read": round(time.perf_counter() - t_queued, 4), "gc": round(in_gc["seconds"], 4),
                     "gc_collections": in_gc["collections"], "other_threads": threading.active_count() - 1,
                     "thread_names": others[:16]}
    return losses, after


class _EpochGraph:
    """A whole epoch of step-kernel steps (``train_vae`` with ``kernel`` and graphs) in one CUDA graph.

    The epoch's rows are gathered, in the epoch's order, into a kept buffer; the graph replays every
    step on its slices (the noise, the step kernel, the rows' sum, Adam) and adds the steps' losses into a
    device total: one launch an epoch instead of three a step. (In the flow's training worker, which shares
    its process with Dask's threads, the per-step launches fell behind the GPU: 0.20-0.23 s of epochs
    where a bare process took 0.13 s, H100.) The step kernel allocates nothing; its buffers live in the
    step, which this keeps. Warm-up steps before the capture are undone as in :class:`_GraphedSteps`.
    """

    def __init__(self, model, opt, step, n_train: int, batch_size: int, width: int, device):
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.step_loss = step
        self.graph = None
        self.arenas = []
        self.batches = [(a, min(a + batch_size, n_train)) for a in range(0, n_train, batch_size)]
        try:
            self.rows = torch.zeros((n_train, width), dtype=torch.float32, device=device)
            self.total = torch.zeros((), dtype=torch.float64, device=device)
            self._capture(opt, device)
        except BaseException:
            self.release()
            raise
        finally:  # also when capture fails: training then starts from the same weights
            _set_start(model, opt, initial)

    def _capture(self, opt, device):
        step = self.step_loss
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: the kernel built, Adam's state made, every slice's view
            for a, b in self.batches[:2] + self.batches[-1:]:
                step(self.rows[a:b])
                opt.step()
            for a, b in self.batches:
                step.view_of(self.rows[a:b])
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, torch.cuda.graph_pool_handle(), side, 64 << 20, self.arenas):
            self.total.zero_()
            for a, b in self.batches:
                loss = step(self.rows[a:b])
                opt.step()
                self.total += loss
        self.graph = graph

    def run(self, data, order):
        """One epoch on ``data[order]``; the device total of its steps' losses (the next call overwrites it)."""
        torch.index_select(data, 0, order, out=self.rows)
        self.graph.replay()
        return self.total

    def __del__(self):
        self.release()

    def release(self):
        """Drop the graph, then its arenas and the step (in that order, as :meth:`_GraphedSteps.release`)."""
        self.graph = None
        self.arenas.clear()
        self.step_loss = None


def _kernel_sums() -> str:
    from beatflow.model.step_kernel import step_sums

    return step_sums()


def training_kernel(kernel: Optional[bool], device, amp=None) -> bool:
    """Whether :func:`train_vae` runs its steps as the step kernel (see its ``kernel``)."""
    dev = torch.device(device)
    if kernel is False:
        return False
    from beatflow.model.step_kernel import kernel_available

    possible = dev.type == "cuda" and amp is None and kernel_available()
    if kernel and not possible:
        why = ("it runs on a CUDA device" if dev.type != "cuda" else "it computes in fp32" if amp is not None
               else "Numba's CUDA target is not available")
        raise ValueError(f"training with the step kernel: {why}")
    return possible


def training_compiled(compile: bool, graphs: bool) -> bool:
    """Whether :func:`train_vae` compiles its steps: as asked, except when they are captured in CUDA
    graphs while PyTorch allocates through a pluggable allocator (RMM) with no capture arena in
    front: Inductor's kernels cannot be launched inside such a capture ("CUDA driver error: invalid
    argument", H200), so the compilation would be spent for nothing. With the arena (the flow's GPU
    workers) the compiled step is captured: 10 epochs of 97 k rows in 0.43 s against 1.33 s for the
    fusible form uncompiled in graphs (H200, session 9)."""
    if not (compile and graphs) or native_allocator():
        return bool(compile)
    from beatflow.gpu.arena import installed

    return installed() is not None


def training_precision(precision: str, device) -> str:
    """The precision ``train_vae`` uses: ``auto`` is bf16 on a GPU that supports it, fp16 on
    another GPU, fp32 on the CPU; fp16/bf16 on the CPU are refused (no tensor cores to gain from)."""
    if precision not in TRAINING_PRECISIONS:
        raise ValueError(f"training precision must be one of {', '.join(TRAINING_PRECISIONS)}, got {precision!r}")
    dev = torch.device(device)
    if dev.type != "cuda":
        if precision in ("bf16", "fp16"):
            raise ValueError(f"{precision} training is for GPUs; train in fp32 on the CPU")
        return "fp32"
    if precision == "auto":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return precision


def _autocast_dtype(precision: str):
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _step_loss(model: "LightVAE", device_type: str, amp, compile: bool, fused: bool | None = None,
               full: int | None = None):
    """``loss(xb)`` of one training step: eager ``model(xb)``, or the fusible form
    (:mod:`beatflow.model.fused`, ``fused``; default: when ``compile``), ``torch.compile``-d when
    ``compile``. A compiled step that fails (no Triton, no compiler) runs uncompiled from then on;
    the returned function's ``failed`` attribute tells. With ``full``, only batches of ``full`` rows
    run compiled and an epoch's last, shorter batch runs the same fusible form uncompiled: its shape
    would be a second graph to compile (``dynamic=False``), which on a CPU costs as much as the first
    one and its cache load on every later run, for one step an epoch."""
    fused = compile if fused is None else fused

    def cast():
        return torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()

    if not fused:
        def eager(xb):
            with cast():
                recon, mu, logvar = model(xb)
            return vae_loss(xb, recon.float(), mu.float(), logvar.float())
        return eager

    from beatflow.model.fused import fused_forward

    def fusible(xb, eps):
        # mixed precision by casts (autocast changes matrix products and convolutions, of which this
        # form has none: under autocast it computed in float32 whatever the precision asked)
        recon, mu, logvar = fused_forward(model, xb, eps, dtype=amp)
        return vae_loss(xb, recon.float(), mu.float(), logvar.float())

    compiled = torch.compile(fusible, dynamic=False) if compile else None

    def step(xb):
        eps = torch.randn(xb.shape[0], LATENT_DIM, device=xb.device, dtype=xb.dtype)
        if compiled is not None and not step.failed and (full is None or xb.shape[0] == full):
            try:
                return compiled(xb, eps)
            except Exception as e:  # no Triton / compiler here: the same step, uncompiled
                import warnings

                warnings.warn(f"torch.compile of the training step failed ({_why(e)}); training uncompiled",
                              RuntimeWarning)
                step.failed = True
        return fusible(xb, eps)

    step.failed = False
    return step


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
    data = _as_float_tensor(beats)
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

"""Training the LightVAE: one trainer (:func:`train_vae`) and one training policy (:func:`fit_beats`).

:func:`train_vae` trains a :class:`~beatflow.model.vae.LightVAE` on a beat matrix: eager PyTorch steps, the
fusible form compiled (:mod:`beatflow.model.fused`), or the step kernel (:mod:`beatflow.model.step_kernel`),
each optionally captured in CUDA graphs (:mod:`beatflow.model.graphs`). :func:`fit_beats` is what the flow
trains: the partitions' rows made the model's input (:mod:`beatflow.score.rule`), the kernel, precision and
compile choice of the flow, and the files a trained model leaves (``model.pt``, ``model.json``: see
:func:`model_record`, and the validation beats of the engine build).

This module only needs PyTorch and NumPy (no Prefect, no Dask).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch

from beatflow.device import device_memory, is_device_array, namespace_of, to_host
from beatflow.model.graphs import (
    EpochGraph,
    GraphedSteps,
    KeptSteps,
    graph_allocator,
    keep_steps,
    native_allocator,
    queued_epochs,
    take_kept,
)
from beatflow.model.vae import LATENT_DIM, ArrayLike, LightVAE, as_float_tensor, save_model, vae_loss
from beatflow.params import TRAIN_FRACTION
from beatflow.score.classes import template
from beatflow.score.rule import MODEL_INPUT, dominant_beat, input_scale, model_input, scale_rows

__all__ = [
    "TrainResult",
    "TRAINING_PRECISIONS",
    "train_vae",
    "training_graphs",
    "training_kernel",
    "training_compiled",
    "training_precision",
    "fit_beats",
    "model_record",
]


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
    epoch_graph: bool = False  # whether each epoch was one CUDA graph (the step kernel's, see ``EpochGraph``)
    #: seconds of its parts: ``setup`` (the model, the optimizer, graph capture), ``epochs``, ``test``
    phases: dict = field(default_factory=dict)
    epoch_gpu_ms: list = field(default_factory=list)  # each epoch's GPU time (the epoch graph's queued epochs)
    queue_s: dict = field(default_factory=dict)  # the host's seconds of the queued epochs (``queued_epochs``)


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
    data = as_float_tensor(beats, device)
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
    kept = take_kept(key) if graphs and keep_graphs else None
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
                        step_loss = EpochGraph(model, opt, step_loss, n_train, batch_size, width, data.device)
                    except Exception as e:
                        import warnings

                        warnings.warn(f"CUDA graph capture of a whole epoch failed ({_why(e)}); a graph per "
                                      "step instead", RuntimeWarning)
                        step_loss = GraphedSteps(model, opt, step_loss, shapes, width, data.device)
                else:
                    step_loss = GraphedSteps(model, opt, step_loss, shapes, width, data.device)
            except Exception as e:  # capture failed: the same steps, launched one by one
                import warnings

                warnings.warn(f"CUDA graph capture of the training step failed ({_why(e)}); training without "
                              "graphs", RuntimeWarning)
                graphs = False
            else:
                if keep_graphs:
                    kept = keep_steps(key, KeptSteps(model, opt, step_loss, data.device,
                                                 compiled and not getattr(raw_step, "failed", False)))
        res = _train_epochs(t0, data, n_train, width, epochs, batch_size, seed, on_epoch, model, opt, step_loss,
                            raw_step, graphs, scaler, compiled, kept, perm[:n_train], perm[n_train:])
        res.kernel = use_kernel
        res.epoch_graph = isinstance(step_loss, EpochGraph)
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
    queued = isinstance(step_loss, EpochGraph)
    test_idx = torch.from_numpy(test_index).to(data.device) if len(test_index) else None
    # on the GPU few large batches (launch-bound); on the CPU the training's own batches: 8192
    # rows at a time took 2.2x as long (0.77 against 0.35 s for 19 k rows on 2 cores)
    chunk = max(batch_size, 8192) if on_cuda else batch_size
    test_total = None
    if queued:  # every epoch queued on the GPU (one replay each), then the held-out loss, before a loss is read
        model.train()
        losses, test_total = queued_epochs(
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
    fusible form uncompiled in graphs (H200, ``bench/results/training.md``)."""
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


def _why(e: BaseException) -> str:
    """An exception as a warning names it: its type and the first line of its message."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ---------------------------------------------------------------------------------------------
# the flow's training policy

def fit_beats(embedded: list, folder: str, *, epochs: int, batch_size: int, seed: int, threads: int,
              recordings: list[int] | None = None, n_rows_sample: int = 40, train_precision: str = "auto",
              compile: bool = False, on_epoch: Optional[Callable[[tuple], None]] = None,
              beat_window: tuple[float, int] | None = None) -> dict:
    """Train the flow's LightVAE on the partitions' rows and write what a trained model leaves in ``folder``.

    The rows (``embedded``: each partition's ``(rows, p2p)``, NumPy or CuPy, one device) are gathered once,
    made the model's input (:func:`beatflow.score.rule.model_input`: divided by the scale of all of them,
    :func:`~beatflow.score.rule.input_scale`, minus each recording's dominant beat; ``recordings[k]`` is the
    recording of partition ``k``, default all one recording; a recording's partitions are consecutive), and
    trained on with :func:`train_vae` where they are: on a GPU with the step kernel where it can run for
    ``train_precision`` ``auto`` or ``fp32`` (one kernel a step in fp32 was faster than the compiled bf16
    steps: ``bench/results/training.md``), else in :func:`training_precision`'s precision, the steps in CUDA
    graphs where they can be and kept for the next training of the same shapes.

    Written to ``folder``: ``model.pt`` (:func:`~beatflow.model.vae.save_model`), ``model.json``
    (:func:`model_record`) and ``validation_beats.npy`` (at most 4096 held-out inputs, for the engine's
    validation). ``on_epoch`` gets each epoch's ``(epoch, loss, seconds)`` as it ends.

    With ``beat_window = (fs, pre)`` (the rate, and the samples before the peak in a row), each recording's
    class template too (:func:`beatflow.score.classes.template`, of its scaled rows).

    Returns small things only: paths, losses, the test split, the dominant beats (one row per recording), the
    class templates (one row per recording, or None), a few rows for the report, the epochs' ``(epoch, loss, seconds)``, where the time went.
    """
    marks = [time.perf_counter()]
    torch.set_num_threads(max(1, threads))
    rows = [r for r, _ in embedded]
    xp = namespace_of(rows[0]) if rows else np
    beats = xp.concatenate(rows)
    scale = input_scale(xp.concatenate([p for _, p in embedded]))
    n = int(beats.shape[0])
    raw_rows = None
    if n:  # a few rows for the report (scaled, then back), before they become the model's input
        pick = xp.asarray(np.sort(np.random.default_rng(seed).choice(n, size=min(n_rows_sample, n), replace=False)))
        raw_rows = to_host(scale_rows(beats[pick], scale)) * scale
    # each recording's dominant beat, from its own rows (its partitions are consecutive); the rows are
    # replaced by the model's input
    recordings = list(recordings) if recordings is not None else [0] * len(rows)
    ends = np.cumsum([int(r.shape[0]) for r in rows])
    starts = ends - [int(r.shape[0]) for r in rows]
    dominant = np.zeros((max(recordings, default=0) + 1, int(beats.shape[1])), np.float32)
    templates = np.zeros_like(dominant) if beat_window is not None else None
    for r in sorted(set(recordings)):
        ks = [k for k, q in enumerate(recordings) if q == r]
        if ks != list(range(ks[0], ks[-1] + 1)):
            raise ValueError("a recording's partitions must be consecutive")
        lo, hi = int(starts[ks[0]]), int(ends[ks[-1]])
        dom = dominant_beat(beats[lo:hi], scale)
        dominant[r] = to_host(dom)
        if templates is not None:  # (the rows' scale does not matter to the class rule: it correlates)
            templates[r] = to_host(template(beats[lo:hi], *beat_window))
        model_input(beats[lo:hi], scale, dom, out=beats[lo:hi])
    marks.append(time.perf_counter())  # the matrix gathered, made the model's input
    done: list = []

    def epoch_done(epoch: int, loss: float, elapsed: float) -> None:
        done.append((int(epoch), float(loss), float(elapsed)))
        if on_epoch is not None:
            on_epoch(done[-1])

    device = "cuda" if is_device_array(beats) else "cpu"
    if device == "cuda":  # compiled steps captured in graphs under RMM need it (the load task installed it
        from beatflow.gpu.arena import install  # on the workers that loaded partitions)

        install()
    data = torch.from_dlpack(beats) if device == "cuda" else torch.from_numpy(to_host(beats))
    # on a GPU, "auto" (and fp32) train with the step kernel where it can run: one kernel a step in fp32
    # was faster than the compiled bf16 steps (bench/results/training.md); bf16 stays an option
    kernel = device == "cuda" and train_precision in ("auto", "fp32") and training_kernel(None, device)
    precision = "fp32" if kernel else training_precision(train_precision, device)
    with device_memory(f"training on {n:,} beats", int(beats.nbytes), device == "cuda"):
        res = train_vae(data, epochs=epochs, batch_size=batch_size, seed=seed, device=device, on_epoch=epoch_done,
                        precision=precision, compile=compile, cudagraphs=None, keep_graphs=True, kernel=kernel)
    marks.append(time.perf_counter())
    os.makedirs(folder, exist_ok=True)
    model_path = os.path.join(folder, "model.pt")
    save_model(res.model, model_path)
    rng = np.random.default_rng(seed)
    val_idx = np.sort(rng.choice(res.test_index, size=min(4096, len(res.test_index)), replace=False))
    val_path = os.path.join(folder, "validation_beats.npy")
    np.save(val_path, to_host(beats[xp.asarray(val_idx)]))
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump(model_record(res, scale=scale, width=int(beats.shape[1]), epochs=epochs, batch_size=batch_size,
                               seed=seed, precision=precision), f, indent=1)
    return {
        "model": model_path, "validation": val_path, "scale": scale, "train_loss": res.train_loss,
        "test_loss": res.test_loss, "test_index": res.test_index, "seconds": res.seconds,
        "sample_rows": raw_rows, "rows": int(beats.shape[0]), "dominant": dominant, "templates": templates,
        "precision": precision,
        "compiled": res.compiled, "cuda_graphs": res.cudagraphs, "graphs_kept": res.graphs_kept, "kernel": res.kernel,
        "epoch_graph": res.epoch_graph,
        "epochs_done": done,
        "epoch_gpu_ms": res.epoch_gpu_ms, "queue_s": res.queue_s,
        # where the time went: the matrix's set-up, train_vae's parts, saving the outputs
        "phases_s": {"rows": round(marks[1] - marks[0], 4), **{f"train_{k}": v for k, v in res.phases.items()},
                     "train_other": round(marks[2] - marks[1] - sum(res.phases.values()), 4),
                     "save": round(time.perf_counter() - marks[2], 4)},
    }


def model_record(res: TrainResult, *, scale: float, width: int, epochs: int, batch_size: int, seed: int,
                 precision: str) -> dict:
    """``model.json`` as training writes it: the model's input (``scale``, ``width``, ``input``: the rule's
    name, :data:`beatflow.score.rule.MODEL_INPUT`), the training's settings and losses, and how its steps
    ran. The flow adds ``threshold`` and ``fs`` once it has scored; the results store adds ``sha256`` and
    ``id`` (:meth:`beatflow.io.store.Store.register_model`)."""
    return {"scale": scale, "width": width, "epochs": epochs, "batch_size": batch_size,
            "seed": seed, "train_loss": res.train_loss, "test_loss": res.test_loss,
            "input": MODEL_INPUT, "precision": precision, "compiled": res.compiled,
            "cuda_graphs": res.cudagraphs, "kernel": res.kernel}

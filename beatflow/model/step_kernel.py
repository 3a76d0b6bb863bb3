"""The LightVAE's training step as one CUDA kernel: forward, loss and backward of every row, a warp per row.

Why a kernel of its own: the step is tiny (about 25 k multiply-adds a row through convolutions of 1 to
8 channels) and, even compiled by Inductor and replayed from a CUDA graph, it was 76 kernels and
290-370 µs a step on an H200 (``bench/results/training.md``), most of it launch gaps and
small reductions, while its memory traffic is tens of microseconds. Here a warp computes one row's
whole forward pass (its activations in shared memory, the lanes along the row), its loss, and its
backward pass, and writes that row's gradient of every parameter (and its loss) into a row of ``g``.
Summing ``g`` over the rows (``torch.sum``: a fixed order, so the weights are the same run after
run) gives the batch's gradient; a fused Adam updates the parameters. A step is four kernels (the
noise, this one, the sum, Adam), 156 µs of GPU time on an H100, of which this kernel 142 µs; 10 epochs
of the 20 h stream train in 0.15 s against 0.28 s for the compiled bf16 steps (``bench/results/training.md``).

The arithmetic is the model's (:class:`beatflow.model.vae.LightVAE`, :func:`beatflow.model.vae.vae_loss`) in
float32: ``tests/test_train_kernel.py`` checks each row's gradient and loss against PyTorch's autograd
of the ``nn.Module`` on random weights and inputs (on the CPU under ``NUMBA_ENABLE_CUDASIM=1``, and on
a GPU). It knows nothing of the flow: :func:`beatflow.model.train.train_vae` uses it through
:class:`KernelStep`.

Layout: ``p`` is every parameter flattened in ``LightVAE.parameters()`` order (:func:`param_layout`);
``g[b, :NP]`` the gradient of row ``b``'s loss in that order, ``g[b, NP]`` the loss.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref

import numpy as np

WARP = 32
cuda = None  # numba.cuda, set by build_step_kernel
#: warps (rows) per block on a GPU; under the simulator one (its warp shuffles are per block)
WARPS_PER_BLOCK = 2
#: the LightVAE's parameters in ``parameters()`` order: (name, shape as a function of the width)
_PARAMS = (
    ("enc.0.weight", lambda w: (2, 1, 3)), ("enc.0.bias", lambda w: (2,)), ("enc.1.alpha", lambda w: ()),
    ("enc.3.weight", lambda w: (4, 2, 3)), ("enc.3.bias", lambda w: (4,)), ("enc.4.alpha", lambda w: ()),
    ("enc.6.weight", lambda w: (8, 4, 3)), ("enc.6.bias", lambda w: (8,)), ("enc.7.alpha", lambda w: ()),
    ("mu_head.weight", lambda w: (2, 8, 3)), ("mu_head.bias", lambda w: (2,)),
    ("logvar_head.weight", lambda w: (2, 8, 3)), ("logvar_head.bias", lambda w: (2,)),
    ("fc.weight", lambda w: (w, 2)), ("fc.bias", lambda w: (w,)),
    ("dec.1.weight", lambda w: (4, 8, 3)), ("dec.1.bias", lambda w: (4,)), ("dec.2.alpha", lambda w: ()),
    ("dec.4.weight", lambda w: (2, 4, 3)), ("dec.4.bias", lambda w: (2,)), ("dec.5.alpha", lambda w: ()),
    ("dec.7.weight", lambda w: (1, 2, 3)), ("dec.7.bias", lambda w: (1,)),
)


def param_layout(width: int) -> dict:
    """``{name: (offset, shape)}`` of the LightVAE's parameters in one flat vector, and ``"size"``."""
    out, off = {}, 0
    for name, shape in _PARAMS:
        s = shape(int(width))
        out[name] = (off, s)
        off += int(np.prod(s, dtype=np.int64)) if s else 1
    out["size"] = off
    return out


@functools.lru_cache(maxsize=None)
def warp_sums(shuffles: bool = False):
    """``(wsum, tsum)``, the warp's sums as device functions: ``wsum(v)`` the total of every lane's ``v``,
    in every lane; ``tsum(v, lane)`` the totals of 32 values (``v``, each lane's local array of 32,
    overwritten), lane ``l`` given that of ``v[l]``. Under the simulator, stand-ins that add in lane order
    (one exchange each), unless ``shuffles``: then the GPU's own, on the simulator's shuffles (slow; tests)."""
    global cuda
    from numba import cuda as numba_cuda

    from beatflow.gpu import runtime as K
    cuda = numba_cuda
    K.numba_cuda()
    sim = K.simulator_active()
    shfl_xor = _sim_shfl_xor if sim else K.warp_intrinsics()["_shfl_xor"]
    FULL = 0xFFFFFFFF
    if sim and not shuffles:
        wsum, tsum = _sim_wsum, _sim_tsum
    else:
        @cuda.jit(device=True)
        def wsum(v):
            """The warp's total of ``v``, in every lane (a butterfly of shuffles)."""
            for m in (16, 8, 4, 2, 1):
                v += shfl_xor(FULL, v, m)
            return v

        @cuda.jit(device=True)
        def tsum(v, lane):
            """The warp's totals of 32 values, lane ``l`` given that of ``v[l]`` (``v``: each lane's 32, a
            local array, overwritten): a transposed butterfly. At each round a lane keeps the half of its
            values its partner does not and adds the partner's partial of the same values: 31 shuffles where
            32 butterflies take 160, and the same pairs added (own + partner's, as the butterfly's lanes
            add theirs), so each total is bit for bit :func:`wsum`'s."""
            # (the rounds written out: as a loop over (16, 8, 4, 2, 1) NVVM kept v in local memory, 98 loads
            # and 168 stores in the PTX against 32 and 18 written out: numba-cuda 0.30.4, cc 9.0)
            hi = (lane >> 4) & 1
            for i in range(16):
                a, z = v[i], v[i + 16]
                v[i] = (z if hi else a) + shfl_xor(FULL, a if hi else z, 16)
            hi = (lane >> 3) & 1
            for i in range(8):
                a, z = v[i], v[i + 8]
                v[i] = (z if hi else a) + shfl_xor(FULL, a if hi else z, 8)
            hi = (lane >> 2) & 1
            for i in range(4):
                a, z = v[i], v[i + 4]
                v[i] = (z if hi else a) + shfl_xor(FULL, a if hi else z, 4)
            hi = (lane >> 1) & 1
            for i in range(2):
                a, z = v[i], v[i + 2]
                v[i] = (z if hi else a) + shfl_xor(FULL, a if hi else z, 2)
            hi = lane & 1
            a, z = v[0], v[1]
            return (z if hi else a) + shfl_xor(FULL, a if hi else z, 1)
    return wsum, tsum


def step_sums(sums: str | None = None) -> str:
    """How the step kernel sums a layer's weight gradients over a row: ``"transposed"`` (:func:`warp_sums`'
    ``tsum``, 32 at a time; the default) or ``"butterfly"`` (a ``wsum`` each); ``sums``, else
    ``$BEATFLOW_STEP_SUMS``, else transposed. Both give the same bits (tested under the simulator's shuffles and
    on the GPU); the transposed sums took 10 epochs of the flow's rows in 83.5 ms of GPU time against the
    butterflies' 113.4 ms (H200; 83.4 against 115.5 ms, H100), and trained the flow to the same losses to the
    bit (``bench/results/training.md``)."""
    import os

    got = sums or os.environ.get("BEATFLOW_STEP_SUMS") or "transposed"
    if got not in ("transposed", "butterfly"):
        raise ValueError(f"the step kernel's sums are 'transposed' or 'butterfly', got {got!r}")
    return got


def build_step_kernel(width: int, sums: str | None = None, shuffles: bool = False):
    """The step kernel for rows of ``width`` samples (a multiple of 8; compiled on first launch):
    ``kernel[grid, block, stream](x, eps, p, g)`` with ``x`` (B, width), ``eps`` (B, 2), ``p`` (NP,),
    ``g`` (B, NP + 1), all float32; a warp per row (:func:`launch_config`); ``sums``: :func:`step_sums`;
    ``shuffles``: under the simulator, the GPU's sums on its shuffles (:func:`warp_sums`; slow, for tests)."""
    return _build_step_kernel(int(width), step_sums(sums), bool(shuffles))


@functools.lru_cache(maxsize=None)
def _build_step_kernel(width: int, sums: str, shuffles: bool = False):
    global cuda
    from numba import cuda as numba_cuda
    from numba import float32

    from beatflow.gpu import runtime as K
    cuda = numba_cuda  # (a module global: the simulator swaps it in the kernels' globals per launch)

    K.numba_cuda()
    sim = K.simulator_active()
    if sim:
        K.lock_shared_arrays()
        syncwarp = _sim_syncwarp
    else:
        syncwarp = K.warp_intrinsics()["_syncwarp"]  # the warp shuffles and barriers on a GPU
    W = int(width)
    if W <= 0 or W % 8:
        raise ValueError(f"LightVAE width must be a positive multiple of 8, got {W}")
    L0, L1, L2, L3 = W, W // 2, W // 4, W // 8
    lay = param_layout(W)
    NP = lay["size"]
    o = {name: lay[name][0] for name, _ in _PARAMS}
    W1, B1, A1 = o["enc.0.weight"], o["enc.0.bias"], o["enc.1.alpha"]
    W2, B2, A2 = o["enc.3.weight"], o["enc.3.bias"], o["enc.4.alpha"]
    W3, B3, A3 = o["enc.6.weight"], o["enc.6.bias"], o["enc.7.alpha"]
    WM, BM, WL, BL = o["mu_head.weight"], o["mu_head.bias"], o["logvar_head.weight"], o["logvar_head.bias"]
    FW, FB = o["fc.weight"], o["fc.bias"]
    D1, C1, G1 = o["dec.1.weight"], o["dec.1.bias"], o["dec.2.alpha"]
    D2, C2, G2 = o["dec.4.weight"], o["dec.4.bias"], o["dec.5.alpha"]
    D3, C3 = o["dec.7.weight"], o["dec.7.bias"]
    # one warp's shared memory, in floats: the activations the backward pass needs, two gradient buffers
    RX, RE1, RD1, RE2, RD2, RE3, RD3 = 0, W, 3 * W, 4 * W, 6 * W, 7 * W, 9 * W
    RH0, RF1, RF2, RGA, RGB = 10 * W, 11 * W, 12 * W, 13 * W, 15 * W
    S = 17 * W
    WPB = 1 if sim else WARPS_PER_BLOCK
    FEW_SUMS = 6  # (up to this many sums left: a butterfly each, 5 shuffles, rather than a transposed round's 31)
    TRANSPOSED = sums == "transposed"
    NONE = -1

    wsum, tsum = warp_sums(shuffles)

    @cuda.jit(device=True)
    def _exp(v):
        return math.exp(v)

    @cuda.jit(device=True)
    def act(e, a):
        """Swish: ``e * sigmoid(a * e)``."""
        return e / (float32(1.0) + _exp(-a * e))

    @cuda.jit(device=True)
    def src_val(s, p, src, c, lsrc, up, alpha, i):
        """The convolution's input at channel ``c``, position ``i`` (of the upsampled length): the
        stored activation ``s[src + c*lsrc + (i >> up)]``, through Swish(``p[alpha]``) when ``alpha`` >= 0."""
        v = s[src + c * lsrc + (i >> up)]
        if alpha >= 0:
            v = act(v, p[alpha])
        return v

    @cuda.jit(device=True)
    def conv_fwd(s, p, lane, src, cin, lsrc, up, alpha, ow, ob, cout, dst):
        """``s[dst + o*lout + t] = b[o] + Σ_c Σ_k w[o,c,k] in(c, t+k-1)`` (zero padding 1), lout = lsrc << up."""
        lout = lsrc << up
        win = cuda.local.array(24, float32)
        for t in range(lane, lout, WARP):
            for c in range(cin):
                for k in range(3):
                    i = t + k - 1
                    win[c * 3 + k] = src_val(s, p, src, c, lsrc, up, alpha, i) if 0 <= i < lout else float32(0.0)
            for oc in range(cout):
                acc = p[ob + oc]
                for j in range(cin * 3):
                    acc += p[ow + oc * cin * 3 + j] * win[j]
                s[dst + oc * lout + t] = acc

    @cuda.jit(device=True)
    def act_down(s, p, lane, src, cn, lin, alpha, dst):
        """``s[dst + c*lin/2 + t]``: the [1, 2, 1]/4 stride-2 filter (zero padding 1) of Swish(``p[alpha]``)
        of the ``cn`` channels of length ``lin`` at ``src``."""
        lout = lin // 2
        a = p[alpha]
        for t in range(lane, lout, WARP):
            for c in range(cn):
                base = src + c * lin
                v = float32(0.5) * act(s[base + 2 * t], a) + float32(0.25) * act(s[base + 2 * t + 1], a)
                if t > 0:
                    v += float32(0.25) * act(s[base + 2 * t - 1], a)
                s[dst + c * lout + t] = v

    @cuda.jit(device=True)
    def conv_wgrad(s, p, g, b, lane, gsrc, cout, lout, src, cin, lsrc, up, alpha, ow, ob):
        """Row ``b``'s gradient of the convolution's weights and biases into ``g[b, ow...]``, ``g[b, ob...]``:
        ``Σ_t gout[o,t] in(c, t+k-1)`` and ``Σ_t gout[o,t]`` (gout at ``gsrc``, (cout, lout))."""
        acc = cuda.local.array(104, float32)
        n = cout * cin * 3
        for j in range(n + cout):
            acc[j] = float32(0.0)
        win = cuda.local.array(24, float32)
        for t in range(lane, lout, WARP):
            for c in range(cin):
                for k in range(3):
                    i = t + k - 1
                    win[c * 3 + k] = src_val(s, p, src, c, lsrc, up, alpha, i) if 0 <= i < lout else float32(0.0)
            for oc in range(cout):
                go = s[gsrc + oc * lout + t]
                acc[n + oc] += go
                for j in range(cin * 3):
                    acc[oc * cin * 3 + j] += go * win[j]
        # the sums over the row's positions
        nj = n + cout
        if TRANSPOSED:  # 32 at a time (lane l writes the l-th), a butterfly each for a last few (a transposed
            v = cuda.local.array(32, float32)  # round costs 31 shuffles whatever its count)
            for j0 in range(0, nj, WARP):
                if nj - j0 > FEW_SUMS:
                    for i in range(WARP):
                        v[i] = acc[j0 + i] if j0 + i < nj else float32(0.0)
                    tot = tsum(v, lane)
                    j = j0 + lane
                    if j < nj:
                        g[b, (ow + j) if j < n else (ob + j - n)] = tot
                else:  # (the last chunk only)
                    for j in range(j0, nj):
                        tot = wsum(acc[j])
                        if lane == j % WARP:
                            g[b, (ow + j) if j < n else (ob + j - n)] = tot
        else:  # a butterfly each (the loop without the transposed sums)
            for j in range(nj):
                tot = wsum(acc[j])
                if lane == j % WARP:
                    g[b, (ow + j) if j < n else (ob + j - n)] = tot

    @cuda.jit(device=True)
    def conv_igrad(s, p, lane, gsrc, cout, lout, ow, cin, up, fsrc, alpha, dst):
        """The gradient of the convolution's input, collapsed through the nearest upsampling by 2 (``up``)
        and through Swish(``p[alpha]``) of the stored ``fsrc`` (``alpha`` >= 0), into ``s[dst + c*lsrc + j]``;
        returns this lane's part of the Swish's ``alpha`` gradient."""
        lsrc = lout >> up
        ga = float32(0.0)
        for j in range(lane, lsrc, WARP):
            for c in range(cin):
                v = float32(0.0)
                for i in range(j << up, (j + 1) << up):
                    for k in range(3):
                        t = i - k + 1
                        if 0 <= t < lout:
                            for oc in range(cout):
                                v += p[ow + (oc * cin + c) * 3 + k] * s[gsrc + oc * lout + t]
                if alpha >= 0:
                    e = s[fsrc + c * lsrc + j]
                    a = p[alpha]
                    sg = float32(1.0) / (float32(1.0) + _exp(-a * e))
                    ga += v * e * e * sg * (float32(1.0) - sg)
                    v *= sg + a * e * sg * (float32(1.0) - sg)
                s[dst + c * lsrc + j] = v
        return ga

    @cuda.jit(device=True)
    def down_act_bwd(s, p, lane, gsrc, cn, lin, esrc, alpha, dst):
        """Through the stride-2 filter and Swish(``p[alpha]``) of the stored ``esrc``: the gradient of the
        pre-activations (cn, lin) into ``dst`` from that of the filtered (cn, lin/2) at ``gsrc``; returns
        this lane's part of the ``alpha`` gradient."""
        lout = lin // 2
        a = p[alpha]
        ga = float32(0.0)
        for i in range(lane, lin, WARP):
            t = i // 2
            for c in range(cn):
                if i % 2 == 0:
                    v = float32(0.5) * s[gsrc + c * lout + t]
                else:
                    v = float32(0.25) * s[gsrc + c * lout + t]
                    if t + 1 < lout:
                        v += float32(0.25) * s[gsrc + c * lout + t + 1]
                e = s[esrc + c * lin + i]
                sg = float32(1.0) / (float32(1.0) + _exp(-a * e))
                ga += v * e * e * sg * (float32(1.0) - sg)
                s[dst + c * lin + i] = v * (sg + a * e * sg * (float32(1.0) - sg))
        return ga

    @cuda.jit
    def step_kernel(x, eps, p, g):
        sm = cuda.shared.array((WPB, S), float32)
        lane = cuda.threadIdx.x % WARP
        w = cuda.threadIdx.x // WARP
        b = cuda.blockIdx.x * WPB + w
        if b >= x.shape[0]:
            return  # (whole warps: the row count decides per warp)
        s = sm[w]
        # ---- forward
        for t in range(lane, L0, WARP):
            s[RX + t] = x[b, t]
        syncwarp()
        conv_fwd(s, p, lane, RX, 1, L0, 0, NONE, W1, B1, 2, RE1)
        syncwarp()
        act_down(s, p, lane, RE1, 2, L0, A1, RD1)
        syncwarp()
        conv_fwd(s, p, lane, RD1, 2, L1, 0, NONE, W2, B2, 4, RE2)
        syncwarp()
        act_down(s, p, lane, RE2, 4, L1, A2, RD2)
        syncwarp()
        conv_fwd(s, p, lane, RD2, 4, L2, 0, NONE, W3, B3, 8, RE3)
        syncwarp()
        act_down(s, p, lane, RE3, 8, L2, A3, RD3)
        syncwarp()
        # the heads, averaged over time: (mu, logvar), every lane
        m0 = float32(0.0)
        m1 = float32(0.0)
        v0 = float32(0.0)
        v1 = float32(0.0)
        for t in range(lane, L3, WARP):
            for c in range(8):
                for k in range(3):
                    i = t + k - 1
                    if 0 <= i < L3:
                        d = s[RD3 + c * L3 + i]
                        m0 += p[WM + (0 * 8 + c) * 3 + k] * d
                        m1 += p[WM + (1 * 8 + c) * 3 + k] * d
                        v0 += p[WL + (0 * 8 + c) * 3 + k] * d
                        v1 += p[WL + (1 * 8 + c) * 3 + k] * d
        inv3 = float32(1.0) / float32(L3)
        mu0 = p[BM] + wsum(m0) * inv3
        mu1 = p[BM + 1] + wsum(m1) * inv3
        lv0 = p[BL] + wsum(v0) * inv3
        lv1 = p[BL + 1] + wsum(v1) * inv3
        sd0 = _exp(float32(0.5) * lv0)
        sd1 = _exp(float32(0.5) * lv1)
        z0 = mu0 + sd0 * eps[b, 0]
        z1 = mu1 + sd1 * eps[b, 1]
        for q in range(lane, 8 * L3, WARP):
            s[RH0 + q] = p[FB + q] + p[FW + 2 * q] * z0 + p[FW + 2 * q + 1] * z1
        syncwarp()
        conv_fwd(s, p, lane, RH0, 8, L3, 1, NONE, D1, C1, 4, RF1)
        syncwarp()
        conv_fwd(s, p, lane, RF1, 4, L2, 1, G1, D2, C2, 2, RF2)
        syncwarp()
        conv_fwd(s, p, lane, RF2, 2, L1, 1, G2, D3, C3, 1, RGA)  # the reconstruction, into GA
        syncwarp()
        # ---- loss and the gradient of the reconstruction (in place)
        se = float32(0.0)
        for t in range(lane, L0, WARP):
            r = s[RGA + t] - s[RX + t]
            se += r * r
            s[RGA + t] = float32(2.0) * r / float32(L0)
        e0 = _exp(lv0)
        e1 = _exp(lv1)
        kl = float32(-0.05) * ((float32(1.0) + lv0 - mu0 * mu0 - e0) + (float32(1.0) + lv1 - mu1 * mu1 - e1))
        loss = wsum(se) / float32(L0) + kl
        if lane == 0:
            g[b, NP] = loss
        syncwarp()
        # ---- backward through the decoder
        conv_wgrad(s, p, g, b, lane, RGA, 1, L0, RF2, 2, L1, 1, G2, D3, C3)
        ga = conv_igrad(s, p, lane, RGA, 1, L0, D3, 2, 1, RF2, G2, RGB)  # gF2 (2, L1)
        ga = wsum(ga)
        if lane == 0:
            g[b, G2] = ga
        syncwarp()
        conv_wgrad(s, p, g, b, lane, RGB, 2, L1, RF1, 4, L2, 1, G1, D2, C2)
        ga = conv_igrad(s, p, lane, RGB, 2, L1, D2, 4, 1, RF1, G1, RGA)  # gF1 (4, L2)
        ga = wsum(ga)
        if lane == 0:
            g[b, G1] = ga
        syncwarp()
        conv_wgrad(s, p, g, b, lane, RGA, 4, L2, RH0, 8, L3, 1, NONE, D1, C1)
        conv_igrad(s, p, lane, RGA, 4, L2, D1, 8, 1, 0, NONE, RGB)  # gH0 (8·L3)
        syncwarp()
        # the linear layer (each lane owns its outputs' weights) and the latent
        gz0 = float32(0.0)
        gz1 = float32(0.0)
        for q in range(lane, 8 * L3, WARP):
            gh = s[RGB + q]
            g[b, FB + q] = gh
            g[b, FW + 2 * q] = gh * z0
            g[b, FW + 2 * q + 1] = gh * z1
            gz0 += p[FW + 2 * q] * gh
            gz1 += p[FW + 2 * q + 1] * gh
        gz0 = wsum(gz0)
        gz1 = wsum(gz1)
        gm0 = gz0 + float32(0.1) * mu0
        gm1 = gz1 + float32(0.1) * mu1
        gl0 = gz0 * float32(0.5) * sd0 * eps[b, 0] - float32(0.05) * (float32(1.0) - e0)
        gl1 = gz1 * float32(0.5) * sd1 * eps[b, 1] - float32(0.05) * (float32(1.0) - e1)
        # the heads: weights from the time sums of their input, the input's gradient into GA
        if TRANSPOSED:  # (positions outside, the 24 sums inside: their indices constant, the sums in registers)
            hv = cuda.local.array(32, float32)
            for j in range(32):
                hv[j] = float32(0.0)
            for t in range(lane, L3, WARP):
                for j in range(24):  # (c, k)
                    i = t + j % 3 - 1
                    if 0 <= i < L3:
                        hv[j] += s[RD3 + (j // 3) * L3 + i]
            tot = tsum(hv, lane) * inv3  # (lane j: the j-th sum)
            if lane < 24:
                g[b, WM + lane] = gm0 * tot
                g[b, WM + 24 + lane] = gm1 * tot
                g[b, WL + lane] = gl0 * tot
                g[b, WL + 24 + lane] = gl1 * tot
        else:
            for j in range(24):  # (c, k)
                c = j // 3
                k = j % 3
                acc = float32(0.0)
                for t in range(lane, L3, WARP):
                    i = t + k - 1
                    if 0 <= i < L3:
                        acc += s[RD3 + c * L3 + i]
                tot = wsum(acc) * inv3
                if lane == j % WARP:
                    g[b, WM + j] = gm0 * tot
                    g[b, WM + 24 + j] = gm1 * tot
                    g[b, WL + j] = gl0 * tot
                    g[b, WL + 24 + j] = gl1 * tot
        if lane == 0:
            g[b, BM] = gm0
            g[b, BM + 1] = gm1
            g[b, BL] = gl0
            g[b, BL + 1] = gl1
        for i in range(lane, L3, WARP):
            for c in range(8):
                v = float32(0.0)
                for k in range(3):
                    t = i - k + 1
                    if 0 <= t < L3:
                        v += (p[WM + c * 3 + k] * gm0 + p[WM + 24 + c * 3 + k] * gm1
                              + p[WL + c * 3 + k] * gl0 + p[WL + 24 + c * 3 + k] * gl1)
                s[RGA + c * L3 + i] = v * inv3
        syncwarp()
        # ---- backward through the encoder
        ga = wsum(down_act_bwd(s, p, lane, RGA, 8, L2, RE3, A3, RGB))  # gE3 (8, L2)
        if lane == 0:
            g[b, A3] = ga
        syncwarp()
        conv_wgrad(s, p, g, b, lane, RGB, 8, L2, RD2, 4, L2, 0, NONE, W3, B3)
        conv_igrad(s, p, lane, RGB, 8, L2, W3, 4, 0, 0, NONE, RGA)  # gD2 (4, L2)
        syncwarp()
        ga = wsum(down_act_bwd(s, p, lane, RGA, 4, L1, RE2, A2, RGB))  # gE2 (4, L1)
        if lane == 0:
            g[b, A2] = ga
        syncwarp()
        conv_wgrad(s, p, g, b, lane, RGB, 4, L1, RD1, 2, L1, 0, NONE, W2, B2)
        conv_igrad(s, p, lane, RGB, 4, L1, W2, 2, 0, 0, NONE, RGA)  # gD1 (2, L1)
        syncwarp()
        ga = wsum(down_act_bwd(s, p, lane, RGA, 2, L0, RE1, A1, RGB))  # gE1 (2, L0)
        if lane == 0:
            g[b, A1] = ga
        syncwarp()
        conv_wgrad(s, p, g, b, lane, RGB, 2, L0, RX, 1, L0, 0, NONE, W1, B1)

    step_kernel.params = NP
    step_kernel.warps_per_block = WPB
    return step_kernel


# --- the simulator's warp: a block of one warp, a barrier per block, sums through a buffer ----------
# (the simulator runs a thread per lane and has no shuffles; five shuffle rounds of two barriers each
# were most of a launch there, so its sum is one exchange. These live in this module: the simulator
# swaps the ``cuda`` global of a kernel's own module for the whole launch.)
_sim_lock = threading.Lock()
_sim_blocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # launch -> {block: state}


def _sim_state():
    launch = cuda  # the launch's stand-in module
    block = cuda.blockIdx.x
    with _sim_lock:
        per = _sim_blocks.setdefault(launch, {})
        if block not in per:
            per[block] = (threading.Barrier(cuda.blockDim.x), [0.0] * WARP)
        return per[block]


def _sim_syncwarp():
    _sim_state()[0].wait(timeout=120)


def _sim_shfl_xor(mask, value, lane_mask):
    """The simulator's ``shfl_xor_sync`` for this module's kernels (:func:`warp_sums` ``shuffles``)."""
    barrier, buf = _sim_state()
    lane = cuda.threadIdx.x % WARP
    buf[lane] = value
    barrier.wait(timeout=120)
    out = buf[lane ^ lane_mask]
    barrier.wait(timeout=120)
    return out


def _sim_tsum(v, lane):
    """The simulator's :func:`tsum`: lane ``l`` the warp's total of ``v[l]``, added in lane order (as
    :func:`_sim_wsum` adds)."""
    barrier, buf = _sim_state()
    buf[cuda.threadIdx.x % WARP] = [np.float32(u) for u in v[:WARP]]
    barrier.wait(timeout=120)
    total = np.float32(0.0)
    for u in buf:
        total = np.float32(total + u[lane])
    barrier.wait(timeout=120)
    return total


def _sim_wsum(v):
    barrier, buf = _sim_state()
    buf[cuda.threadIdx.x % WARP] = v
    barrier.wait(timeout=120)
    total = np.float32(0.0)
    for u in buf:  # (in lane order in every lane: the same total everywhere)
        total = np.float32(total + np.float32(u))
    barrier.wait(timeout=120)
    return total


def launch_config(kernel, rows: int) -> tuple[int, int]:
    """``(blocks, threads)`` for ``rows`` rows: a warp per row."""
    wpb = kernel.warps_per_block
    return max(1, -(-int(rows) // wpb)), wpb * WARP


def row_grads(x, eps, params, width: int | None = None, sums: str | None = None, shuffles: bool = False):
    """Each row's gradient and loss (``g``, (B, NP + 1)) of the step kernel for NumPy inputs, on the GPU
    (or the simulator); for tests and checks. ``params``: the flat vector (:func:`param_layout`)."""
    from numba import cuda

    x = np.ascontiguousarray(x, np.float32)
    kernel = build_step_kernel(int(width or x.shape[1]), sums, shuffles)
    g = np.zeros((x.shape[0], kernel.params + 1), np.float32)
    dx, de, dp, dg = (cuda.to_device(a) for a in (x, np.ascontiguousarray(eps, np.float32),
                                                   np.ascontiguousarray(params, np.float32), g))
    blocks, threads = launch_config(kernel, x.shape[0])
    from beatflow.device import switch_interval
    from beatflow.gpu.sim import simulator_active

    # (the simulator's lanes are threads: with the default 5 ms each barrier waits for the GIL)
    with switch_interval(2e-4 if simulator_active() else None):
        kernel[blocks, threads](dx, de, dp, dg)
    return dg.copy_to_host()


@functools.lru_cache(maxsize=None)
def _totals_kernel():
    from numba import float32

    wsum, tsum = warp_sums(shuffles=True)

    @cuda.jit
    def totals(vals, t_out, w_out):
        lane = cuda.threadIdx.x
        v = cuda.local.array(32, float32)
        for i in range(WARP):
            v[i] = vals[lane, i]
        for j in range(WARP):
            tot = wsum(vals[lane, j])
            if lane == j:
                w_out[j] = tot
        t_out[lane] = tsum(v, lane)

    return totals


def warp_totals(values):
    """For tests: the warp's totals of each column of ``values`` (32 × 32, row ``l`` lane ``l``'s values),
    ``(by tsum, by wsum)``, each read from the lane that writes it in the step kernel (lane ``j`` column ``j``);
    the GPU's shuffles, or the simulator's (:func:`warp_sums` ``shuffles``)."""
    from numba import cuda

    from beatflow.device import switch_interval
    from beatflow.gpu.sim import simulator_active

    vals = np.ascontiguousarray(values, np.float32)
    if vals.shape != (WARP, WARP):
        raise ValueError(f"warp_totals takes {WARP} x {WARP} values, got {vals.shape}")
    kernel = _totals_kernel()
    t, w = cuda.to_device(np.zeros(WARP, np.float32)), cuda.to_device(np.zeros(WARP, np.float32))
    with switch_interval(2e-4 if simulator_active() else None):
        kernel[1, WARP](cuda.to_device(vals), t, w)
    return t.copy_to_host(), w.copy_to_host()


def kernel_available() -> bool:
    """Whether the step kernel can run on a GPU here (Numba's CUDA target on a CUDA device, not the simulator)."""
    from beatflow.gpu.sim import simulator_active

    try:
        from numba import cuda as numba_cuda

        return not simulator_active() and numba_cuda.is_available()
    except Exception:
        return False


class KernelStep:
    """``loss = step(xb)``: a training step's forward, loss and backward by the step kernel, for
    :func:`beatflow.model.train.train_vae` (``kernel``). The model's parameters become views of one flat
    float32 vector (what the kernel reads) and their ``.grad`` views of another, which each call fills
    with the batch's gradient (the rows' sum); the optimizer's step follows. The returned loss (the
    batch's total) is a device scalar the next call overwrites. Each call draws the batch's noise
    with ``Tensor.normal_`` (graph-safe) and launches on PyTorch's current stream, so a step can be
    captured in a CUDA graph; buffers are kept per batch size (the first call of a size makes them,
    outside a capture: the warm-up steps)."""

    computes_grads = True  # (train_vae: no backward pass, no zeroing of the gradients)

    def __init__(self, model, device):
        import torch

        self.kernel = build_step_kernel(int(model.width))
        lay = param_layout(model.width)
        n = self.kernel.params
        self.device = torch.device(device)
        self.flat = torch.empty(n, dtype=torch.float32, device=self.device)
        self.gsum = torch.zeros(n + 1, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for name, prm in model.named_parameters():
                off, _ = lay[name]
                view = self.flat[off:off + prm.numel()].view(prm.shape)
                view.copy_(prm.detach())
                prm.data = view
                prm.grad = self.gsum[off:off + prm.numel()].view(prm.shape)
        self.loss = self.gsum[n]
        self._buffers: dict = {}
        self._views: dict = {}
        self._streams: dict = {}
        self._dp = cuda.as_cuda_array(self.flat, sync=False)
        # one row through the kernel now: it is compiled here, and a kernel that cannot run on this GPU
        # is an error of the constructor (train_vae then trains with PyTorch's steps), not of a step
        row = torch.zeros((1, model.width), dtype=torch.float32, device=self.device)
        g = torch.empty((1, n + 1), dtype=torch.float32, device=self.device)
        self.kernel[1, WARP](cuda.as_cuda_array(row, sync=False), cuda.as_cuda_array(row[:, :2], sync=False),
                            self._dp, cuda.as_cuda_array(g, sync=False))
        torch.cuda.synchronize(self.device)
        if not torch.isfinite(g).all():
            raise RuntimeError("the step kernel's trial row gave a non-finite gradient")

    def view_of(self, t):
        """Numba's view of tensor ``t``, kept per address and shape: a graph's batches are made once,
        before its capture (the warm-up calls this for each)."""
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 1024:  # (launched step by step, every epoch's batches are new tensors)
                self._views.clear()
            v = self._views[key] = cuda.as_cuda_array(t, sync=False)
        return v

    def __call__(self, xb):
        import torch

        rows = int(xb.shape[0])
        buf = self._buffers.get(rows)
        if buf is None:
            eps = torch.empty((rows, 2), dtype=torch.float32, device=self.device)
            g = torch.empty((rows, self.kernel.params + 1), dtype=torch.float32, device=self.device)
            buf = self._buffers[rows] = (eps, g, cuda.as_cuda_array(eps, sync=False), cuda.as_cuda_array(g, sync=False))
        eps, g, deps, dg = buf
        eps.normal_()
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = cuda.external_stream(handle)
        blocks, threads = launch_config(self.kernel, rows)
        self.kernel[blocks, threads, stream](self.view_of(xb.contiguous()), deps, self._dp, dg)
        torch.sum(g, dim=0, out=self.gsum)
        return self.loss

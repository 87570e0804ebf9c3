"""Causal depthwise conv1d in Triton: forward, backward and decode update (the Mamba block's conv).

``causal_conv1d(x, weight, bias=None, activation=None)`` and ``causal_conv1d_update(x, conv_state,
weight, bias=None, activation=None)`` have exactly the semantics, shapes, dtypes and errors of
:func:`kernels.reference.causal_conv1d` / :func:`kernels.reference.causal_conv1d_update` (those of
``causal_conv1d_fn`` / ``causal_conv1d_update`` in Dao's causal-conv1d package, which mamba_ssm's
Mamba block calls, with the mixers' cache layout for the window); :mod:`kernels` dispatches here for
CUDA tensors and for ``backend="triton"`` (CPU tensors run under ``TRITON_INTERPRET=1``).

Math (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", Fig. 3:
the short convolution before the SSM), per channel with taps w = weight[d, :] of width W, where
tap k (k = 0 the current step) is w_{W-1-k}, and x_t = 0 for t < 0:

    p_t = bias + sum_{k<W} w_{W-1-k} x_{t-k},   y_t = act(p_t),   act = identity or silu
    backward, with g_t = dy_t act'(p_t),  silu'(p) = s (1 + p (1 - s)),  s = sigmoid(p):
    dx_s = sum_{k<W} w_{W-1-k} g_{s+k}   (g_t = 0 for t >= L; the anti-causal correlation)
    dw_{W-1-k} = sum_{batch, t} g_t x_{t-k},   dbias = sum_{batch, t} g_t

The backward recomputes p from x (the pre-activation is never stored).

Layout. A program owns ``BLOCK_D`` channels of one sequence and a segment of ``SEG_STEPS`` steps,
walked in chunks of ``BLOCK_T`` steps; grid (segments x batch, channel blocks). Two algorithms,
picked on the host from the strides and the width (both are correct for any strides; only speed
differs):

- **Register window** (``REG_WINDOW``; x, and dy in the backward, contiguous along time: the
  layout of ``(batch, dim, L)`` tensors; at most ``MAX_REGISTER_WINDOW_WIDTH`` taps). A chunk is a ``(BLOCK_T, BLOCK_D)`` tile with each
  thread holding its channel's BLOCK_T steps (one 16-byte access: BLOCK_T = 8 for 16-bit inputs,
  4 for fp32), and the previous chunk stays in registers, so every input is read once (plus one
  chunk per segment). The W taps are applied as one banded product: for output step i and input
  step r of a chunk, ``k = (i - r) mod BLOCK_T`` is the tap that links them when ``0 <= i - r < W``
  (r in this chunk) or ``i - r + BLOCK_T < W`` (r in the chunk before); ``taps[i, r] = w_{W-1-k}``
  on those two bands, built once per program, and ``p[i] = sum_r taps[i, r] window[i, r]``,
  ``window`` being this chunk's or the previous chunk's input on the bands and 0 elsewhere. Time
  lives in each thread's registers, so the band masks are compile-time constants: the selects
  fold away and each output costs its W multiply-adds (the selective scan's ``_add`` trick, in
  one more dimension). BLOCK_T >= W keeps the two bands disjoint. The backward walks the segment
  one chunk ahead (g of the next chunk feeds dx of this one: ``dx[r] = sum_i taps[i, r] g[i]``,
  the same bands read the other way) and accumulates ``g[i] window[i, r]`` on the bands, folded
  into the W taps once at the end.
- **Shifted loads** (anything else: wider taps, or other strides, e.g. the ``(batch, L, dim)`` buffers the mixers' in_proj makes,
  viewed as ``(batch, dim, L)``: channels contiguous). Tap k is a load of the tile shifted k steps
  back; the shifts move along the strided axis, so every load stays coalesced along the channels
  and the overlap is served from L1. The backward recomputes p at the W steps ahead (W^2 loads
  per tile, all cache hits).

Sums over time (dweight, dbias) are written per program (``(batch, segments, dim, W)`` partials in
the compute dtype) and added up on the host: no atomics, so results are deterministic and
autotuning (which reruns kernels) is safe. The output is always a contiguous ``(batch, dim, L)``
tensor; dx is dense in x's stride order (``torch.empty_like``).

Decode, ``causal_conv1d_update_kernel``: a program owns ``BLOCK_D`` channels of ``UPDATE_ROWS``
sequences: it reads each ``(BLOCK_D, W)`` window once (16-byte rows for fp32, W = 4), shifts it in
registers (the same compile-time select), stores it back in place with the new input last and
dots it with the taps, which are loaded once per program.

Numerics: loads are converted to the compute dtype at once (float32; float64 for float64 x, and in
the update for a float64 x or window) and the taps accumulate in it; silu is
``p / (1 + exp(-p))``, as PyTorch computes it (exp overflowing for p < -88 gives the correct limit
-0). On the GPU, ``tl.exp`` is ``ex2.approx``: about 2^-21 relative error in s for |p| <~ 20 in
fp32, which the fp32 GPU tests allow for. The update stores the new input in the window's dtype
and reads it back from there, as the reference (``conv_state[..., -1] = x``) does.

Sources: Gu & Dao 2023 (above) and the reference block mamba_simple.py (``step``); the op's
interface is that of Dao's causal-conv1d (github.com/Dao-AILab/causal-conv1d), whose CUDA kernels
likewise give each thread a run of contiguous steps and fetch the W - 1 previous inputs once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels._host import INTERPRET as _INTERPRET
from kernels._host import (
    cdiv,
    check_device,
    check_no_grad,
    device_guard,
    mark_written,
    next_power_of_2,
    strides,
)
from kernels.reference import (
    _check_causal_conv1d_args,
    _check_causal_conv1d_update_args,
    _compute_dtype,
)

__all__ = ["causal_conv1d", "causal_conv1d_update"]


# ----------------------------------------------------------------------------------------------
# Block sizes and autotune configs
# ----------------------------------------------------------------------------------------------

# Under the interpreter: chunks of 8 steps, segments of 2 chunks and 8 channels per program, so the
# tiny test lengths (17, 65, 127) cross chunks, segments and channel blocks, with partial ones at
# the end. Under the interpreter an op costs about the same whatever its tile size, so chunks are
# not made smaller than 8 (the GPU's fp32 chunk is 4: the band logic is the same at any BLOCK_T).
INTERPRET_BLOCK_T = 8
INTERPRET_SEGMENT_STEPS = 16
INTERPRET_BLOCK_D = 8
# Shifted-load algorithm on CUDA: time rows per tile (the tile is coalesced along the channels).
SHIFTED_BLOCK_T = 16
# Segment length on CUDA: as long as possible (each segment reads one extra chunk, and the backward
# computes one extra chunk) while the grid still has about TARGET_PROGRAMS programs of 128
# channels (enough to fill an H200's 132 SMs several times over).
MAX_SEGMENT_STEPS = 256
MIN_SEGMENT_CHUNKS = 4
TARGET_PROGRAMS = 1024
# (BLOCK_D, num_warps) on CUDA: one channel per thread in the register-window algorithm (a warp
# keeps 32 channels, each thread its channel's steps in registers: 16-32 accumulators of the
# backward's band), so BLOCK_D = 32 * num_warps.
_CUDA_CONFIGS = [(128, 4), (256, 8), (64, 2)]
# Decode update: channels per program and sequences per program (the taps are read once for all).
UPDATE_BLOCK_D = INTERPRET_BLOCK_D if _INTERPRET else 256
UPDATE_ROWS = 2 if _INTERPRET else 4
UPDATE_WARPS = 4
# The update shifts the window through a (BLOCK_D, W, W) selection tile: widths up to 64 (Mamba uses
# 2-4), with BLOCK_D shrunk so the tile stays within UPDATE_TILE elements (Triton caps a tile at 2^20).
UPDATE_MAX_WIDTH = 64
UPDATE_TILE = 16384


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_D": INTERPRET_BLOCK_D}, num_warps=1)]
    return [triton.Config({"BLOCK_D": d}, num_warps=w, num_stages=1) for d, w in _CUDA_CONFIGS]


def _prune_configs(configs, named_args, **kwargs):
    """Clamp BLOCK_D to the channels (padded to a power of two, at least a warp's 32 lanes) and the
    warps to one per 32 channels; drop duplicates."""
    channels = max(next_power_of_2({**named_args, **kwargs}["dim"]), 32)
    pruned = {}
    for c in configs:
        block_d = min(c.kwargs["BLOCK_D"], channels)
        warps = max(1, min(c.num_warps, block_d // 32))
        if (block_d, warps) not in pruned:
            pruned[(block_d, warps)] = triton.Config(
                {**c.kwargs, "BLOCK_D": block_d}, num_warps=warps, num_stages=c.num_stages
            )
    return list(pruned.values())


def _bucket(n: int) -> int:
    """Autotune key for a size: the next power of two, clamped to [64, 8192]."""
    return min(max(next_power_of_2(max(n, 1)), 64), 8192)


# Widest taps the register window takes: its tap tile is (W_PAD, BLOCK_T, BLOCK_T, BLOCK_D) with
# BLOCK_T >= width, so it grows as width^2 (past 32 taps it even exceeds Triton's largest tensor).
# Wider convs run the shifted loads, whose cost is linear in the width.
MAX_REGISTER_WINDOW_WIDTH = 8


def _register_window(width: int, *tensors: torch.Tensor) -> bool:
    """Whether the register-window algorithm serves these (batch, dim, L) tensors: at most
    MAX_REGISTER_WINDOW_WIDTH taps and all contiguous along time (or one step long). Otherwise the
    shifted-load algorithm runs."""
    if width > MAX_REGISTER_WINDOW_WIDTH:
        return False
    return all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in tensors)


def _block_t(dtype: torch.dtype, width: int, reg_window: bool) -> int:
    """Steps per chunk: one 16-byte access per thread and channel for the register window, at least
    the width (so that its two bands are disjoint)."""
    if not reg_window:
        return INTERPRET_BLOCK_T if _INTERPRET else SHIFTED_BLOCK_T
    base = INTERPRET_BLOCK_T if _INTERPRET else 16 // dtype.itemsize
    return max(base, next_power_of_2(width))


def _segment_steps(batch: int, dim: int, seqlen: int, block_t: int) -> int:
    """Steps per program: a power of two, a multiple of block_t."""
    if _INTERPRET:
        return max(INTERPRET_SEGMENT_STEPS, block_t)
    rows = max(1, batch * cdiv(dim, 128))
    segments = cdiv(TARGET_PROGRAMS, rows)
    steps = next_power_of_2(cdiv(seqlen, segments))
    return min(max(steps, MIN_SEGMENT_CHUNKS * block_t), max(MAX_SEGMENT_STEPS, block_t))


# Sizes that only feed loop bounds, masks and program ids: specialising on them would compile a
# kernel per value class for nothing. L and the strides do specialise: their divisibility by 16 is
# what tells Triton that rows are aligned for 16-byte accesses.
_RUNTIME_INTS = ["dim", "n_seg", "D_BUCKET"]

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
# Kernel argument lists stay packed (one per line would triple this section's length).
# fmt: off

# Sums over an axis use the builtin tl.reduce with tl.sum's own combine instead of calling tl.sum
# (or tl.sigmoid): those are jit functions, and under the interpreter every device-function call
# re-patches triton.language (a fraction of a millisecond), which would dominate the CPU tests; the
# GPU code is the same. The selects of one value and -0.0s (x + -0.0 == x exactly) fold away
# where the mask is a compile-time constant.
_add = tl.standard._sum_combine


@triton.autotune(
    configs=_configs(), key=["WIDTH", "BLOCK_T", "SEG_STEPS", "REG_WINDOW", "SILU", "D_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def causal_conv1d_fwd_kernel(
    X, WEIGHT, BIAS, Y,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bd,
    dim, L, n_seg, D_BUCKET,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    REG_WINDOW: tl.constexpr, FP64: tl.constexpr, BLOCK_T: tl.constexpr, SEG_STEPS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """y of one (segment, sequence, channel block); grid (n_seg * batch, cdiv(dim, BLOCK_D)).
    y is a contiguous (batch, dim, L) tensor."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid = tl.program_id(0)
    seg = pid % n_seg
    batch = (pid // n_seg).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    offs_d = offs_d.to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, W_PAD)
    seg_start = seg * SEG_STEPS
    n_chunks = tl.cdiv(tl.minimum(L - seg_start, SEG_STEPS), BLOCK_T)

    x_base = X + batch * stride_xb + offs_d[None, :] * stride_xd  # (1, D)
    y_base = Y + (batch * dim + offs_d[None, :]) * L  # (1, D): rows of the contiguous output
    wt = tl.load(WEIGHT + offs_d[None, :] * stride_wd + offs_j[:, None] * stride_wk,
                 mask=(offs_j < WIDTH)[:, None] & d_mask[None, :], other=0.0).to(ACC)  # (W_PAD, D), row j = weight[:, j]
    bias = tl.load(BIAS + offs_d * stride_bd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None

    if REG_WINDOW:
        i = offs_t[:, None]  # output step of the chunk
        r = offs_t[None, :]  # input step, of this chunk or of the one before
        band = (i - r >= 0) & (i - r < WIDTH)  # (T, T): tap k = i - r reads this chunk
        band_prev = i - r + BLOCK_T < WIDTH  # tap k = i - r + BLOCK_T reads the chunk before
        j = WIDTH - 1 - (i - r + BLOCK_T) % BLOCK_T  # weight column of the tap
        sel = (offs_j[:, None, None] == j[None, :, :]) & (band | band_prev)[None, :, :]  # (W_PAD, T, T)
        # taps[i, r] = weight[:, j(i, r)] on the bands, -0.0 elsewhere (a constant: see window).
        taps = tl.reduce(tl.where(sel[:, :, :, None], wt[:, None, None, :], -0.0), 0, _add)  # (T, T, D)
        t = seg_start - BLOCK_T + offs_t
        prev = tl.load(x_base + t.to(tl.int64)[:, None] * stride_xl, mask=(t >= 0)[:, None] & d_mask[None, :],
                       other=0.0).to(ACC)  # (T, D), zeros before t = 0
    else:
        prev = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)  # (unused: the loop carries it)

    for c in range(0, n_chunks):
        t = seg_start + c * BLOCK_T + offs_t
        # Triton proves `t < L` constant over a chunk when L is a multiple of BLOCK_T (L specialises
        # on divisibility by 16), so full chunks keep their 16-byte accesses; other L mask per step.
        td_mask = (t < L)[:, None] & d_mask[None, :]
        if REG_WINDOW:
            cur = tl.load(x_base + t.to(tl.int64)[:, None] * stride_xl, mask=td_mask, other=0.0).to(ACC)
            # window[i, r] = x at step i - k of the chunk on the bands, 0.0 elsewhere, where
            # -0.0 * 0.0 folds to a constant and the sum drops it.
            window = tl.where(band[:, :, None], cur[None, :, :],
                              tl.where(band_prev[:, :, None], prev[None, :, :], 0.0))  # (T, T, D)
            p = tl.reduce(taps * window, 1, _add)  # (T, D)
            prev = cur
        else:
            p = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
            for k in tl.static_range(WIDTH):
                w_k = tl.reduce(tl.where(offs_j[:, None] == WIDTH - 1 - k, wt, -0.0), 0, _add)  # (D,)
                x_k = tl.load(x_base + (t - k).to(tl.int64)[:, None] * stride_xl,
                              mask=td_mask & (t >= k)[:, None], other=0.0).to(ACC)
                p += w_k[None, :] * x_k
        if HAS_BIAS:
            p += bias[None, :]
        if SILU:
            p = p / (1.0 + tl.exp(-p))
        tl.store(y_base + t[:, None], p.to(Y.dtype.element_ty), mask=td_mask)


@triton.autotune(
    configs=_configs(), key=["WIDTH", "BLOCK_T", "SEG_STEPS", "REG_WINDOW", "SILU", "D_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def causal_conv1d_bwd_kernel(
    X, WEIGHT, BIAS, DY, DX, DW_PART, DB_PART,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bd,
    stride_dyb, stride_dyd, stride_dyl, stride_dxb, stride_dxd, stride_dxl,
    dim, L, n_seg, D_BUCKET,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    REG_WINDOW: tl.constexpr, FP64: tl.constexpr, BLOCK_T: tl.constexpr, SEG_STEPS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dx of one (segment, sequence, channel block) and its partial sums over the segment's steps
    of dweight (into DW_PART (batch, n_seg, dim, WIDTH)) and dbias (DB_PART (batch, n_seg, dim));
    grid (n_seg * batch, cdiv(dim, BLOCK_D))."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid = tl.program_id(0)
    seg = pid % n_seg
    batch = (pid // n_seg).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    offs_d = offs_d.to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, W_PAD)
    seg_start = seg * SEG_STEPS
    n_chunks = tl.cdiv(tl.minimum(L - seg_start, SEG_STEPS), BLOCK_T)

    x_base = X + batch * stride_xb + offs_d[None, :] * stride_xd  # (1, D)
    dy_base = DY + batch * stride_dyb + offs_d[None, :] * stride_dyd
    dx_base = DX + batch * stride_dxb + offs_d[None, :] * stride_dxd
    wt = tl.load(WEIGHT + offs_d[None, :] * stride_wd + offs_j[:, None] * stride_wk,
                 mask=(offs_j < WIDTH)[:, None] & d_mask[None, :], other=0.0).to(ACC)  # (W_PAD, D), row j = weight[:, j]
    bias = tl.load(BIAS + offs_d * stride_bd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None
    grad_bias = tl.zeros([BLOCK_D], dtype=ACC)

    if REG_WINDOW:
        i = offs_t[:, None]
        r = offs_t[None, :]
        band = (i - r >= 0) & (i - r < WIDTH)
        band_prev = i - r + BLOCK_T < WIDTH
        bands = (band | band_prev)[:, :, None]  # (T, T, 1)
        j = WIDTH - 1 - (i - r + BLOCK_T) % BLOCK_T
        sel = ((offs_j[:, None, None] == j[None, :, :]) & (band | band_prev)[None, :, :])[:, :, :, None]  # (W_PAD, T, T, 1)
        taps = tl.reduce(tl.where(sel, wt[:, None, None, :], -0.0), 0, _add)  # (T, T, D), as in the forward
        # grad_taps[i, r] = sum over the segment's chunks of g[i] x[step i - k]: the (i, r) terms of
        # every tap, kept apart until the end (the bands' entries only; the rest stay constant).
        grad_taps = tl.zeros([BLOCK_T, BLOCK_T, BLOCK_D], dtype=ACC)
        t = seg_start - BLOCK_T + offs_t
        x_cur = tl.load(x_base + t.to(tl.int64)[:, None] * stride_xl, mask=(t >= 0)[:, None] & d_mask[None, :],
                        other=0.0).to(ACC)
        g_cur = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
        # Iteration c forms g of chunk c + 1 (and its sums), then dx of chunk c, which needs g up
        # to W - 1 steps ahead; c = -1 only primes g of the segment's first chunk.
        for c in range(-1, n_chunks):
            t_next = seg_start + (c + 1) * BLOCK_T + offs_t
            next_mask = (t_next < L)[:, None] & d_mask[None, :]
            x_next = tl.load(x_base + t_next.to(tl.int64)[:, None] * stride_xl, mask=next_mask, other=0.0).to(ACC)
            g_next = tl.load(dy_base + t_next.to(tl.int64)[:, None] * stride_dyl, mask=next_mask, other=0.0).to(ACC)
            window = tl.where(band[:, :, None], x_next[None, :, :],
                              tl.where(band_prev[:, :, None], x_cur[None, :, :], 0.0))  # (T, T, D)
            if SILU:
                p = tl.reduce(taps * window, 1, _add)
                if HAS_BIAS:
                    p += bias[None, :]
                s = 1.0 / (1.0 + tl.exp(-p))
                g_next = g_next * (s * (1.0 + p * (1.0 - s)))
            # Sums over time take chunk c + 1 only inside the segment (the next segment's program
            # counts the chunk after its end); steps past L have dy = 0, hence g = 0.
            g_sum = tl.where(c + 1 < n_chunks, g_next, 0.0)
            grad_taps += tl.where(bands, g_sum[:, None, :] * window, -0.0)
            grad_bias += tl.reduce(g_sum, 0, _add)
            # dx of chunk c: dx[r] = sum_i taps[i, r] g[i], g of chunk c on the band, of chunk
            # c + 1 on band_prev (the forward's bands seen from the input step).
            g_win = tl.where(band[:, :, None], g_cur[:, None, :],
                             tl.where(band_prev[:, :, None], g_next[:, None, :], 0.0))
            dx = tl.reduce(taps * g_win, 0, _add)  # (T, D)
            t = t_next - BLOCK_T
            tl.store(dx_base + t.to(tl.int64)[:, None] * stride_dxl, dx.to(DX.dtype.element_ty),
                     mask=((t >= seg_start) & (t < L))[:, None] & d_mask[None, :])
            x_cur = x_next
            g_cur = g_next
        # Tap j collects the (i, r) entries with weight column j.
        grad_w = tl.reduce(tl.reduce(tl.where(sel, grad_taps[None, :, :, :], -0.0), 2, _add), 1, _add)  # (W_PAD, D)
    else:
        grad_w = tl.zeros([W_PAD, BLOCK_D], dtype=ACC)
        for c in range(0, n_chunks):
            t = seg_start + c * BLOCK_T + offs_t
            td_mask = (t < L)[:, None] & d_mask[None, :]
            dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
            g_here = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
            for k in tl.static_range(WIDTH):  # g at the steps t + k, each reaching dx through tap k
                tk = t + k
                k_mask = (tk < L)[:, None] & d_mask[None, :]
                g = tl.load(dy_base + tk.to(tl.int64)[:, None] * stride_dyl, mask=k_mask, other=0.0).to(ACC)
                if SILU:
                    p = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
                    for jj in tl.static_range(WIDTH):
                        src = tk - (WIDTH - 1 - jj)
                        w_j = tl.reduce(tl.where(offs_j[:, None] == jj, wt, -0.0), 0, _add)
                        x_j = tl.load(x_base + src.to(tl.int64)[:, None] * stride_xl,
                                      mask=k_mask & (src >= 0)[:, None], other=0.0).to(ACC)
                        p += w_j[None, :] * x_j
                    if HAS_BIAS:
                        p += bias[None, :]
                    s = 1.0 / (1.0 + tl.exp(-p))
                    g = g * (s * (1.0 + p * (1.0 - s)))
                w_k = tl.reduce(tl.where(offs_j[:, None] == WIDTH - 1 - k, wt, -0.0), 0, _add)
                dx += w_k[None, :] * g
                if k == 0:
                    g_here = g
            tl.store(dx_base + t.to(tl.int64)[:, None] * stride_dxl, dx.to(DX.dtype.element_ty), mask=td_mask)
            for jj in tl.static_range(WIDTH):  # dweight[:, jj] += sum_t g_t x_{t - (W - 1 - jj)}
                src = t - (WIDTH - 1 - jj)
                x_j = tl.load(x_base + src.to(tl.int64)[:, None] * stride_xl,
                              mask=td_mask & (src >= 0)[:, None], other=0.0).to(ACC)
                grad_w += tl.where(offs_j[:, None] == jj, tl.reduce(g_here * x_j, 0, _add)[None, :], -0.0)
            grad_bias += tl.reduce(g_here, 0, _add)

    part = (batch * n_seg + seg) * dim + offs_d  # (D,): rows of the (batch, n_seg, dim) partials
    tl.store(DW_PART + part[None, :] * WIDTH + offs_j[:, None], grad_w,
             mask=(offs_j < WIDTH)[:, None] & d_mask[None, :])
    if HAS_BIAS:
        tl.store(DB_PART + part, grad_bias, mask=d_mask)


@triton.jit(do_not_specialize=["batch", "dim"])
def causal_conv1d_update_kernel(
    X, STATE, WEIGHT, BIAS, Y,
    stride_xb, stride_xd, stride_sb, stride_sd, stride_sk, stride_wd, stride_wk, stride_bd,
    batch, dim,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    FP64: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One step for ROWS sequences' (BLOCK_D, W) windows, in place, and y (batch, dim) contiguous;
    grid (cdiv(dim, BLOCK_D), cdiv(batch, ROWS))."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    offs_d = offs_d.to(tl.int64)
    offs_k = tl.arange(0, W_PAD)
    dk_mask = d_mask[:, None] & (offs_k < WIDTH)[None, :]
    w = tl.load(WEIGHT + offs_d[:, None] * stride_wd + offs_k[None, :] * stride_wk, mask=dk_mask,
                other=0.0).to(ACC)  # (D, W_PAD)
    bias = tl.load(BIAS + offs_d * stride_bd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None
    # shift[k, m]: entry k of the new window is entry m = k + 1 of the old one.
    shift = (offs_k[None, :] == offs_k[:, None] + 1)[None, :, :]  # (1, W_PAD, W_PAD)
    is_new = (offs_k == WIDTH - 1)[None, :]  # (1, W_PAD): the new input goes last
    for row in tl.static_range(ROWS):
        b = tl.program_id(1) * ROWS + row
        # The row's mask as a (D,) vector: the interpreter rejects masks built with a scalar.
        row_mask = d_mask & ((tl.zeros([BLOCK_D], dtype=tl.int32) + b) < batch)
        b = b.to(tl.int64)
        state_ptrs = STATE + b * stride_sb + offs_d[:, None] * stride_sd + offs_k[None, :] * stride_sk
        old = tl.load(state_ptrs, mask=dk_mask & row_mask[:, None], other=0.0).to(ACC)  # (D, W_PAD), exact
        # x as the window stores it (its dtype), read back from there.
        x = tl.load(X + b * stride_xb + offs_d * stride_xd, mask=row_mask, other=0.0)
        x = x.to(STATE.dtype.element_ty).to(ACC)
        window = tl.where(is_new, x[:, None], tl.reduce(tl.where(shift, old[:, None, :], -0.0), 2, _add))
        tl.store(state_ptrs, window.to(STATE.dtype.element_ty), mask=dk_mask & row_mask[:, None])
        y = tl.reduce(window * w, 1, _add)  # (D,)
        if HAS_BIAS:
            y += bias
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(Y + b * dim + offs_d, y.to(Y.dtype.element_ty), mask=row_mask)


# fmt: on

# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _launch_meta(x: torch.Tensor, width: int, *others: torch.Tensor) -> dict:
    """Algorithm, chunk and segment of a (batch, dim, L) launch (``others``: more (batch, dim, L)
    tensors the kernel walks, e.g. dy)."""
    batch, dim, seqlen = x.shape
    reg_window = _register_window(width, x, *others)
    block_t = _block_t(x.dtype, width, reg_window)
    seg = _segment_steps(batch, dim, seqlen, block_t)
    return dict(
        n_seg=cdiv(seqlen, seg),
        meta=dict(
            WIDTH=width, W_PAD=next_power_of_2(width), REG_WINDOW=reg_window,
            FP64=_compute_dtype(x.dtype) == torch.float64, BLOCK_T=block_t, SEG_STEPS=seg,
        ),
    )  # fmt: skip


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """Launch the forward kernel: y, a contiguous (batch, dim, L) tensor in x's dtype."""
    batch, dim, seqlen = x.shape
    y = torch.empty((batch, dim, seqlen), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    launch = _launch_meta(x, weight.shape[1])
    n_seg = launch["n_seg"]

    def grid(meta):
        return (n_seg * batch, cdiv(dim, meta["BLOCK_D"]))

    causal_conv1d_fwd_kernel[grid](
        x, weight, bias, y, *x.stride(), *weight.stride(), *strides(bias, 1),
        dim, seqlen, n_seg, _bucket(dim), HAS_BIAS=bias is not None, SILU=silu, **launch["meta"],
    )  # fmt: skip
    return y


def _backward(dy, x, weight, bias, silu: bool):
    """Launch the backward kernel and add up its partials. Returns dx (x's dtype and stride order),
    dweight and dbias (None without a bias) in their inputs' dtypes."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    dtype = _compute_dtype(x.dtype)
    dx = torch.empty_like(x)
    if x.numel() == 0:
        dweight = torch.zeros_like(weight)
        return dx, dweight, torch.zeros_like(bias) if bias is not None else None
    launch = _launch_meta(x, width, dy)
    n_seg = launch["n_seg"]
    dw_part = torch.empty((batch, n_seg, dim, width), dtype=dtype, device=x.device)
    db_part = torch.empty((batch, n_seg, dim), dtype=dtype, device=x.device) if bias is not None else None

    def grid(meta):
        return (n_seg * batch, cdiv(dim, meta["BLOCK_D"]))

    causal_conv1d_bwd_kernel[grid](
        x, weight, bias, dy, dx, dw_part, db_part,
        *x.stride(), *weight.stride(), *strides(bias, 1), *dy.stride(), *dx.stride(),
        dim, seqlen, n_seg, _bucket(dim), HAS_BIAS=bias is not None, SILU=silu, **launch["meta"],
    )  # fmt: skip
    dweight = dw_part.sum((0, 1)).to(weight.dtype)
    dbias = db_part.sum((0, 1)).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


class _CausalConv1dFunction(torch.autograd.Function):
    """Autograd glue: saves x, weight and bias only; the backward recomputes the pre-activation."""

    @staticmethod
    def forward(ctx, x, weight, bias, silu):
        with device_guard(x):
            y = _forward(x, weight, bias, silu)
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        with device_guard(x):
            grads = _backward(dy, x, weight, bias, ctx.silu)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)), None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d with an optional fused silu (Gu & Dao 2023, Fig. 3; causal-conv1d's
    ``causal_conv1d_fn`` semantics) in Triton; differentiable in x, weight and bias.

        y[b, d, t] = act(bias[d] + sum_j weight[d, j] * x[b, d, t - (width - 1) + j]),  x = 0 before t = 0

    Args:
        x: (batch, dim, L) input, float16 / bfloat16 / float32 / float64, any strides (contiguous
            along time with at most MAX_REGISTER_WINDOW_WIDTH taps runs the register-window
            algorithm, anything else the shifted loads).
        weight: (dim, width) taps, width >= 1 (one kernel is compiled per width; Mamba uses 2-4),
            any floating dtype.
        bias: (dim,) in weight's dtype, or None.
        activation: None or "silu".

    Computes in float32 (float64 when x is float64), like the reference.

    Returns:
        y (batch, dim, L) in x's dtype, contiguous.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor or non-floating inputs,
        bias of another dtype than weight; ValueError: wrong ndim or shapes, width 0, an unknown
        activation, tensors on different devices), and, for this backend only, ValueError for CPU
        inputs without ``TRITON_INTERPRET=1`` (or bfloat16 ones under it).
    """
    _check_causal_conv1d_args(x, weight, bias, activation)
    check_device("causal_conv1d", x, weight, bias)  # one device: checked by the shared validation
    silu = activation == "silu"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _CausalConv1dFunction.apply(x, weight, bias, silu)
    with device_guard(x):  # inference (prefill): no graph
        return _forward(x, weight, bias, silu)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One decode step of :func:`causal_conv1d` in Triton, updating ``conv_state`` in place:
    shift the window left by one, append x (stored in the window's dtype), then

        y[b, d] = act(bias[d] + sum_j weight[d, j] * conv_state[b, d, j])

    Args:
        x: (batch, dim) the new input.
        conv_state: (batch, dim, width) the last width inputs, oldest first (the mixers' cache
            layout; float32, float64 for float64 models), any strides; overwritten. A 16-bit
            window is accepted: it holds inputs, not sums (x is stored rounded to its dtype).
        weight: (dim, width).   bias: (dim,) in weight's dtype, or None.
        activation: None or "silu".

    Computes in float32 (float64 when x or conv_state is float64). Not differentiable: it is the
    inference (decode) path.

    Returns:
        y (batch, dim) in x's dtype.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor or non-floating inputs,
        bias of another dtype than weight; ValueError: wrong ndim or shapes, width 0, an expanded
        conv_state or an input sharing its memory, an unknown activation, tensors on different
        devices), and, for this backend only, ValueError for width above UPDATE_MAX_WIDTH (64) or
        CPU inputs without ``TRITON_INTERPRET=1`` (or bfloat16 ones under it), and RuntimeError
        when called with grad mode on and an input that requires grad (use torch.no_grad(), or
        backend='reference').
    """
    batch, dim, width = _check_causal_conv1d_update_args(x, conv_state, weight, bias, activation)
    check_device("causal_conv1d_update", x, conv_state, weight, bias)  # one device: checked above
    check_no_grad("causal_conv1d_update", x=x, conv_state=conv_state, weight=weight, bias=bias)
    if width > UPDATE_MAX_WIDTH:
        raise ValueError(
            f"the Triton causal_conv1d_update supports width up to {UPDATE_MAX_WIDTH}, got {width}; "
            "use backend='reference'"
        )
    fp64 = torch.float64 in (x.dtype, conv_state.dtype)
    y = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    w_pad = next_power_of_2(width)
    block_d = min(UPDATE_BLOCK_D, max(next_power_of_2(dim), 32 if not _INTERPRET else 1), UPDATE_TILE // w_pad**2)
    mark_written(conv_state=conv_state)
    with device_guard(x):
        causal_conv1d_update_kernel[(cdiv(dim, block_d), cdiv(batch, UPDATE_ROWS))](
            x, conv_state, weight, bias, y,
            *x.stride(), *conv_state.stride(), *weight.stride(), *strides(bias, 1),
            batch, dim,
            WIDTH=width, W_PAD=w_pad, HAS_BIAS=bias is not None,
            SILU=activation == "silu", FP64=fp64, ROWS=UPDATE_ROWS, BLOCK_D=block_d, num_warps=UPDATE_WARPS,
        )  # fmt: skip
    return y

"""Mamba-1 selective scan in Triton: forward, backward (chunk-checkpointed reverse walk), decode step.

``selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
return_last_state=False, initial_state=None)`` and ``selective_state_update(state, x, dt, A, B, C,
D=None, z=None, dt_bias=None, dt_softplus=False)`` have exactly the semantics, shapes, dtypes and
errors of :func:`kernels.reference.selective_scan` / :func:`kernels.reference.selective_state_update`
(mamba_ssm's ``selective_scan_fn`` semantics); :mod:`kernels` dispatches here for CUDA tensors and
for ``backend="triton"`` (CPU tensors run under ``TRITON_INTERPRET=1``).

Math (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
Algorithm 2 and eq. 2a-2b), per channel d and state n, with group g(d) of B and C:

    dt_t = delta_t (+ delta_bias) (softplus if asked),   x_t = dt_t u_t,   a_t = exp(dt_t A)
    h_t = a_t h_{t-1} + x_t B_t,   y_t = (C_t . h_t + D u_t) * silu(z_t)

Layout. A program owns a block of channels of one (batch element, B/C group) and keeps their
states ``h (N, BLOCK_D)`` in registers: the channels are spread over the lanes (one channel per
thread, or two threads per channel when BLOCK_D is half the warp width) and every thread holds
its channels' whole state vectors. Time is walked in chunks of BLOCK_T steps: a chunk loads
``(BLOCK_T, BLOCK_D)`` tiles of u, delta, z (contiguous along time: one 16-byte access per thread
and row) and ``(BLOCK_T, N)`` tiles of B, C, then runs its steps in an unrolled loop, each step
picking its row out of the tiles in registers (see ``_add`` below). The recurrence is a chain of
fused multiply-adds per state, sums over states stay in-thread, and the exponential is one
``exp2`` with log2(e) folded into A once per program. Only the partial last chunk of a sequence
masks time: a mask that may vary along time would keep Triton from vectorising the loads. B and
C are passed in the compute dtype, so the values every thread reads are converted once, on the
host. The state is never stored per step.

Forward, ``selective_scan_fwd_kernel``: grid (channel blocks, groups, batch x parts); y per chunk,
the last state at the end and, when gradients are needed, the state every ``CHECKPOINT_STEPS`` steps
(``(batch, dim, n_checkpoints, N)`` in the compute dtype). With few (batch, channel block) programs,
e.g. a batch-1 prefill, the sequence is cut into parts that run in parallel (``sequence_parts``):
``selective_scan_part_kernel`` first walks every part but the last from a zero state, which gives
the part's affine map of the state, ``h_end = decay * h_start + h_local`` with ``decay = exp(A sum
dt)`` (the recurrence is linear in h), and each part of the forward starts from h_0 mapped through
the earlier parts in order: the parallel-prefix idea of Blelloch (1990) with one level of blocks.

Backward, ``selective_scan_bwd_kernel``: grid (channel blocks, groups, batch x parts); a program
walks its part's checkpoint segments from last to first, in two passes per segment (mamba_ssm's
chunked recomputation, Gu & Dao 2023 Sec. 3.3.2, with a second level of chunks):

1. from the segment's checkpoint, advance the state chunk by chunk and write the state before
   each chunk to a per-channel scratch slot (written and read back by the same program, so it
   stays in L2);
2. for the segment's chunks in reverse (``_bwd_chunk``): reload the chunk's starting state,
   recompute its states forward (keeping the state before each step in registers), then walk the
   chunk backwards with the state gradient ``q_t = C_t dy_t + a_{t+1} q_{t+1}``, seeded by the
   gradient carried from the chunk after (the last state's gradient at the end), forming every
   input gradient on the way; ``a_0 q_0`` carries to the chunk before and finally becomes the
   initial state's gradient.

Few programs (a batch-1 step over a long sequence) cut the backward into sequence parts too
(``backward_sequence_parts``), by the forward's one-level parallel prefix (Blelloch 1990) applied
to the state gradient: it flows from the end to the start and is linear in the gradient after a part,
``g_start = decay * g_end + g_local`` with ``decay = exp(A sum dt)`` over the part. First
``selective_scan_adjoint_part_kernel`` walks every part but the first backwards from a zero
gradient, running only that recurrence (no states: it needs dt, C and dy alone), which gives the
part's (decay, g_local); then each part of the main kernel starts from the last state's gradient
carried through the later parts' maps, last first, and walks only its own segments, starting
from their checkpoints (the forward saved them all, so no part walks an earlier one). Only the
first part writes the initial state's gradient; the parts write disjoint steps of every per-step
gradient. Each part's gradient entering it differs from one walk's by the association only (one
exponential of the summed exponent instead of the product of the per-step decays): a few
roundings of the carried value, which then decays.

Sums over channels (dB, dC) reduce within the warp, then each channel block adds its (N,) share
of a step into fp32 ``(batch, G, L, N)`` buffers with atomic adds, as mamba_ssm's backward does:
the order of those adds varies from run to run, so dB and dC may differ in the last bits between
runs. Under ``torch.use_deterministic_algorithms(True)`` each block instead writes its own partial
(``(batch, G, n_blocks, L, N)``) and the host adds them up: bitwise reproducible, about 4% slower
(H200, bf16, dim 2048, N 16: 9.66 vs 9.26 ms at 32x2048; the partials are 2 x 537 MB of fp32
written and read back). Sums over time (dA, dD, d delta_bias) are written per (part, batch element)
and added up on the host in both modes, so every other gradient is always deterministic. Autotuning
reruns the kernel, so the atomic buffers are zeroed before each of its trial runs.

Decode, ``selective_state_update_kernel``: one program per (channel block, group, batch) reads its
``(BLOCK_D, N)`` state tile once (16-byte accesses along N), applies one step, writes it back in
place and reduces ``C . h``; the state bytes dominate, so it runs at memory speed.
An eager decode step is host-bound (the argument checks and ``JITFunction.run``'s binding cost far
more host time than the launch), so a call whose signature was seen before replays that call's
compiled launch (``_StepPlan``, as :mod:`kernels.flash_decode` does).

Numerics: accumulation in fp32 (fp64 for fp64 inputs, which are supported for completeness and
use ``exp``); softplus as torch's (identity above 20, else ``log1p(exp(v))`` with log1p by
Goldberg's correction, so dt near 0 keeps its digits); exponentials that underflow give a = 0,
which the recurrence handles like any other decay. Folding log2(e) into A rounds A once, so a
product of decays carries a relative error of about |sum dt A| 2^-24; for decaying states
(Mamba's regime: dt > 0, A < 0) that is at most about 2^-24 / e of the contribution in absolute
terms, but it grows with states that explode (negative dt without softplus). Masked steps (beyond L) get dt = 0, i.e. a = 1
and no input, so padding never changes a state, an output or a gradient. Sums over the whole
sequence (dA, dD, d delta_bias) add per-chunk sums with Kahan's compensated summation within a
sequence part, and the host adds the few (part, batch element) sums in fp32 (fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels._host import INTERPRET as _INTERPRET
from kernels._host import (
    CompiledLaunch,
    LaunchPlans,
    WrittenApart,
    cdiv,
    check_device,
    check_no_grad,
    device_guard,
    mark_written,
    next_power_of_2,
    replay_guard,
    sm_count,
    strides,
)
from kernels.reference import (
    _check_selective_scan_args,
    _check_selective_state_update_args,
    _compute_dtype,
)

__all__ = ["selective_scan", "selective_state_update"]


# ----------------------------------------------------------------------------------------------
# Chunk sizes and autotune configs
# ----------------------------------------------------------------------------------------------

# Steps between the forward's saved states. Under the interpreter: 8 steps in chunks of 4, so tiny
# test lengths (7, 64, 65, 300) span several chunks and segments, with partial ones at the end. On
# CUDA: 32 steps, i.e. 4 N / 32 bytes of saved state per (channel, step) (2 bytes at N = 16, the
# size of a bf16 input), which keeps the backward's scratch per program at
# (32 / BLOCK_T) * N * BLOCK_D * 4 bytes (16-32 KB): the scratch of all resident programs stays in L2.
CHECKPOINT_STEPS = 8 if _INTERPRET else 32
INTERPRET_BLOCK_T = 4
INTERPRET_BLOCK_D = 8

# Forward: (BLOCK_T, BLOCK_D, num_warps). BLOCK_D = 32 * num_warps gives each thread one channel
# with its whole state vector (no shuffles in the y reduction); BLOCK_D = 16 * num_warps splits the
# states over two lanes, doubling the threads when batch * dim is small. BLOCK_T = 8 keeps a bf16
# chunk row in one 16-byte load per thread, BLOCK_T = 4 an fp32 one. Compiled for sm_90 (Triton
# 3.6), (8, 32, 1) takes 136 registers and about 13 instructions per (channel, state, step).
_FWD_CUDA = [(8, 32, 1), (8, 16, 1), (4, 32, 1)]
# Backward: (BLOCK_T, num_warps), channel block BWD_BLOCK_D = 16 (fixed by the host: it sizes the dB /
# dC partials). One warp per program: the sums over channels (dB, dC) then stay within the warp
# (shuffles, no shared memory or barriers). With 16 channels per warp the default layout gives each
# channel two lanes holding 8 of its 16 states: half the registers of one lane per channel (which
# took 255 registers and spilled), twice the programs, and the sums over states cost one shuffle.
# Measured on the H200 (bf16, dim 2048, N 16, 2026-11-30), backward at 32x2048 / 8x8192:
# (BLOCK_D, BLOCK_T, warps) = (32, 4, 1) 22.9 / 22.8 ms, (32, 2, 1) 14.0 / 19.1 ms, (32, 4, 2)
# 14.2 / 14.5 ms, (64, 4, 4) 18.4 / 19.0 ms, (16, 2, 1) 11.8 / 12.3 ms, (16, 4, 1) 9.7 / 9.9 ms.
_BWD_CUDA = [(4, 1), (8, 1)]
BWD_BLOCK_D = INTERPRET_BLOCK_D if _INTERPRET else 16
# Sequence parts of the forward and the backward (see sequence_parts, backward_sequence_parts):
# one-warp programs per SM to aim for, and the shortest part. Under the interpreter, the SM count
# INTERPRET_SMS and parts of one checkpoint interval make the tests' tiny shapes (batch 2, 8
# channels, L 64-300) run in several parts.
MIN_FWD_BLOCK_D = INTERPRET_BLOCK_D if _INTERPRET else min(d for _, d, _ in _FWD_CUDA)
PART_TARGET_WARPS = 8
MIN_PART_STEPS = CHECKPOINT_STEPS if _INTERPRET else 512
INTERPRET_SMS = 1
# Decode step: state elements per program (enough bytes in flight per SM, few enough registers)
# and its warps.
DECODE_BLOCK_ELEMENTS = 2048
DECODE_WARPS = 4


def _fwd_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_T": INTERPRET_BLOCK_T, "BLOCK_D": INTERPRET_BLOCK_D}, num_warps=1)]
    return [triton.Config({"BLOCK_T": t, "BLOCK_D": d}, num_warps=w, num_stages=1) for t, d, w in _FWD_CUDA]


def _bwd_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_T": INTERPRET_BLOCK_T}, num_warps=1)]
    return [triton.Config({"BLOCK_T": t}, num_warps=w, num_stages=1) for t, w in _BWD_CUDA]


# Smallest chunk any backward config uses: it sizes the scratch (one slot per chunk of a segment).
_MIN_BWD_BLOCK_T = INTERPRET_BLOCK_T if _INTERPRET else min(t for t, _ in _BWD_CUDA)


def _prune_fwd_configs(configs, named_args, **kwargs):
    """Clamp BLOCK_D to the channels per group (padded to a power of two) and drop duplicates."""
    channels = next_power_of_2({**named_args, **kwargs}["P"])
    pruned = {}
    for c in configs:
        block_d = min(c.kwargs["BLOCK_D"], channels)
        key = (c.kwargs["BLOCK_T"], block_d, c.num_warps)
        if key not in pruned:
            pruned[key] = triton.Config(
                {**c.kwargs, "BLOCK_D": block_d}, num_warps=c.num_warps, num_stages=c.num_stages
            )
    return list(pruned.values())


def _bucket(n: int) -> int:
    """Autotune key for a length: the next power of two, clamped to [256, 16384] (short sequences
    share one tuning instead of re-benchmarking at every prefill length)."""
    return min(max(next_power_of_2(max(n, 1)), 256), 16384)


# Sizes that only feed loop bounds and masks: specialising on them would compile a kernel per value
# class for nothing. L, d_state and the strides do specialise: their divisibility by 16 is what tells
# Triton that rows are aligned for 16-byte accesses.
_FWD_RUNTIME_INTS = ["batch_size", "dim", "P", "n_ckpt", "part_len", "L_BUCKET", "P_BUCKET"]
_PART_RUNTIME_INTS = ["batch_size", "dim", "P", "part_len", "L_BUCKET", "P_BUCKET"]
_BWD_RUNTIME_INTS = ["batch_size", "dim", "P", "n_ckpt", "part_len", "n_blocks", "scratch_slots", "L_BUCKET"]

# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
# Kernel argument lists stay packed (one per line would triple this section's length).
# fmt: off

# The per-step loops below pick step i out of (T, X) register tiles with
# ``tl.reduce(tl.where(sel, tile, -0.0), 0, _add)``, sel = (offs_t == i): time lives in each
# thread's registers, so the select resolves at compile time and the sum of one value and -0.0s
# folds away. They reduce with the builtin tl.reduce and tl.sum's own combine instead of calling
# tl.sum: tl.sum is itself a jit function, and under the interpreter every device-function call
# re-patches triton.language (about a millisecond), which would dominate the CPU tests; the GPU
# code is the same.
_add = tl.standard._sum_combine


@triton.jit
def _softplus(v):
    """torch's softplus: v above 20, else log(1 + e^v) with log1p done by Goldberg's correction:
    ``log(w) * e / (w - 1)`` with w = 1 + e cancels the rounding of w, and where w rounds to 1,
    log1p(e) = e to working precision (libdevice's log1p is not available to the interpreter)."""
    e = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + e
    log1p = tl.where(w == 1.0, e, tl.log(w) * (e / (w - 1.0)))
    return tl.where(v > 20.0, v, log1p)


@triton.jit
def _kahan_add(total, compensation, value):
    """total + value with Kahan's compensated summation (Higham 2002, Algorithm 4.2), returning the
    new total and compensation. dA, dD and d delta_bias add one term per chunk over the whole
    sequence (thousands of chunks); plain fp32 accumulation would lose about log2(L / BLOCK_T) bits."""
    y = value - compensation
    t = total + y
    return t, (t - total) - y


@triton.jit
def _channel_block(A, stride_ad, stride_an, P, d_state, ACC: tl.constexpr, FP64: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The channels and states of this program's (channel block, group) -- program axes 0 and 1 of
    the four sequence kernels: ``offs_d`` (BLOCK_D,) int64 channel indices, ``d_mask``, ``offs_n``
    (BLOCK_N,), ``n_mask``, ``nd_mask`` (N, D), and ``A2`` (N, D) in ACC: A log2(e), so that the
    decays are exp2 (A itself for fp64, which keeps exp)."""
    offs_p = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_p < P
    offs_d = tl.program_id(1).to(tl.int64) * P + offs_p
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_state
    nd_mask = n_mask[:, None] & d_mask[None, :]
    A2 = tl.load(A + offs_d[None, :] * stride_ad + offs_n[:, None] * stride_an, mask=nd_mask, other=0.0)
    A2 = A2.to(ACC) if FP64 else A2.to(ACC) * 1.4426950408889634
    return offs_d, d_mask, offs_n, n_mask, nd_mask, A2


@triton.jit
def _chunk_masks(t, L, d_mask, n_mask, MASKED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Masks of a chunk's (T, D) and (T, N) tiles. Only the sequence's last, partial chunk masks
    time: a mask that may vary along time keeps Triton from vectorising the loads along it."""
    if MASKED:
        t_mask = (t < L)[:, None]
    else:
        t_mask = tl.full([BLOCK_T, 1], True, tl.int1)
    return d_mask[None, :] & t_mask, n_mask[None, :] & t_mask


@triton.jit
def _chunk_dt(delta_ptrs, bias, td_mask, ACC: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """dt (T, D) and the pre-softplus value v of a chunk; masked steps get dt = 0, i.e. a = 1 and
    no input, so padding never changes a state, an output or a gradient."""
    v = tl.load(delta_ptrs, mask=td_mask, other=0.0).to(ACC)
    if HAS_BIAS:
        v = v + bias[None, :]
    dt = _softplus(v) if SOFTPLUS else v
    return tl.where(td_mask, dt, 0.0), v


@triton.jit
def _fwd_chunk(
    h, t0, L, u_base, delta_base, z_base, y_base, b_base, c_base, stride_ul, stride_deltal, stride_zl,
    stride_yl, stride_bn, stride_bl, stride_cn, stride_cl, A2, skip, bias, d_mask, offs_n, n_mask,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, FP64: tl.constexpr, OUTPUT: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Advance the state h (N, D) over the chunk of steps [t0, t0 + BLOCK_T); with OUTPUT also
    compute and store the chunk's y. Returns the state after the chunk and the chunk's sum of dt
    (D,) (masked steps add 0; unused by the callers that discard it, and then compiled away)."""
    offs_t = tl.arange(0, BLOCK_T)
    t = t0 + offs_t.to(tl.int64)  # int64: t * stride may pass 2^31 for inputs strided along time
    td_mask, tn_mask = _chunk_masks(t, L, d_mask, n_mask, MASKED, BLOCK_T)
    u = tl.load(u_base + t[:, None] * stride_ul, mask=td_mask, other=0.0).to(ACC)  # (T, D)
    dt, _ = _chunk_dt(delta_base + t[:, None] * stride_deltal, bias, td_mask, ACC, HAS_BIAS, SOFTPLUS)
    Bc = tl.load(b_base + offs_n[None, :] * stride_bn + t[:, None] * stride_bl, mask=tn_mask, other=0.0)  # (T, N)
    if OUTPUT:
        Cc = tl.load(c_base + offs_n[None, :] * stride_cn + t[:, None] * stride_cl, mask=tn_mask, other=0.0)
    x = dt * u
    y = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for i in tl.static_range(BLOCK_T):
        sel = (offs_t == i)[:, None]
        dt_i = tl.reduce(tl.where(sel, dt, -0.0), 0, _add)  # (D,)
        x_i = tl.reduce(tl.where(sel, x, -0.0), 0, _add)
        B_i = tl.reduce(tl.where(sel, Bc, -0.0), 0, _add)  # (N,)
        a = tl.exp(dt_i[None, :] * A2) if FP64 else tl.exp2(dt_i[None, :] * A2)  # (N, D)
        h = a * h + x_i[None, :] * B_i[:, None]
        if OUTPUT:
            C_i = tl.reduce(tl.where(sel, Cc, -0.0), 0, _add)
            y = tl.where(sel, tl.reduce(h * C_i[:, None], 0, _add)[None, :], y)
    if OUTPUT:
        if HAS_D:
            y = y + skip[None, :] * u
        if HAS_Z:
            z = tl.load(z_base + t[:, None] * stride_zl, mask=td_mask, other=0.0).to(ACC)
            y = y * z * tl.sigmoid(z)
        tl.store(y_base + t[:, None] * stride_yl, y.to(y_base.dtype.element_ty), mask=td_mask)
    return h, tl.reduce(dt, 0, _add)


@triton.jit
def _chunk_dy(dout_base, z_base, t, stride_dol, stride_zl, td_mask, ACC: tl.constexpr, HAS_Z: tl.constexpr):
    """A chunk's (T, D) gradient of y before the gate, ``dy = dout silu(z)`` (dout without z), and
    ``dout silu'(z)``, which the gate's gradient dz = dout silu'(z) (C . h + D u) needs (zeros
    without z: unused then, and compiled away; a None in a returned tuple does not compile with
    Triton 3.6). Masked steps give 0. silu'(z) = s (1 + z (1 - s)) with s = sigmoid(z)."""
    dout = tl.load(dout_base + t[:, None] * stride_dol, mask=td_mask, other=0.0).to(ACC)
    dy = dout
    dz_scale = tl.zeros(dout.shape, dtype=ACC)
    if HAS_Z:
        z = tl.load(z_base + t[:, None] * stride_zl, mask=td_mask, other=0.0).to(ACC)
        gate = tl.sigmoid(z)
        dy = dout * z * gate
        dz_scale = dout * gate * (1.0 + z * (1.0 - gate))
    return dy, dz_scale


@triton.jit
def _put(ptrs, values, mask, ATOMIC: tl.constexpr):
    """Add ``values`` into ``ptrs`` (relaxed atomics: only the sum matters) or store them."""
    if ATOMIC:
        tl.atomic_add(ptrs, values, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _bwd_chunk(
    h_start, grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c,
    t0, L, d_state, u_base, delta_base, z_base, dout_base, du_base, ddelta_base, dz_base, b_base, c_base,
    db_base, dc_base, stride_ul, stride_deltal, stride_zl, stride_dol, stride_bn, stride_bl, stride_cn,
    stride_cl, A2, skip, bias, d_mask, offs_n, n_mask,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, FP64: tl.constexpr, MASKED: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Gradients of the chunk [t0, t0 + BLOCK_T) from its starting state h_start (N, D) and
    grad_h = dL/dh after the chunk. Stores du, ddelta, dz and adds (ATOMIC) or stores this channel
    block's share of the chunk's dB / dC; returns
    dL/dh before the chunk and the running sums over time dA (N, D), dD (D,) and dbias (D,), each
    with its Kahan compensation (one compensated add per chunk). sum_n A g is formed from
    A2 = A log2(e) and ln 2, sparing the registers of a second copy of A.

        q_t = dL/dh_t = C_t dy_t + a_{t+1} q_{t+1},   g_t = q_t a_t h_{t-1} = dL/d(dt_t A)
        dx_t = sum_n q B,   du = dx dt + D dy,   ddt = dx u + sum_n A g,   dA += sum_t g dt
        dB_t = sum_d q x,   dC_t = sum_d dy h,   dz = dout (C . h + D u) silu'(z),   dy = dout silu(z)
    """
    offs_t = tl.arange(0, BLOCK_T)
    t = t0 + offs_t.to(tl.int64)  # int64: t * stride may pass 2^31 for inputs strided along time
    td_mask, tn_mask = _chunk_masks(t, L, d_mask, n_mask, MASKED, BLOCK_T)
    u = tl.load(u_base + t[:, None] * stride_ul, mask=td_mask, other=0.0).to(ACC)  # (T, D)
    dt, v = _chunk_dt(delta_base + t[:, None] * stride_deltal, bias, td_mask, ACC, HAS_BIAS, SOFTPLUS)
    dy, dz_scale = _chunk_dy(dout_base, z_base, t, stride_dol, stride_zl, td_mask, ACC, HAS_Z)
    Bc = tl.load(b_base + offs_n[None, :] * stride_bn + t[:, None] * stride_bl, mask=tn_mask, other=0.0)  # (T, N)
    Cc = tl.load(c_base + offs_n[None, :] * stride_cn + t[:, None] * stride_cl, mask=tn_mask, other=0.0)
    x = dt * u

    # Forward over the chunk: the state before each step (for the reverse below), dC_t and, for dz,
    # the output before the gate C_t . h_t.
    h = h_start
    h_before = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_D], dtype=ACC)
    y_pre = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for i in tl.static_range(BLOCK_T):
        sel = (offs_t == i)[:, None]
        dt_i = tl.reduce(tl.where(sel, dt, -0.0), 0, _add)
        x_i = tl.reduce(tl.where(sel, x, -0.0), 0, _add)
        B_i = tl.reduce(tl.where(sel, Bc, -0.0), 0, _add)
        dy_i = tl.reduce(tl.where(sel, dy, -0.0), 0, _add)
        h_before = tl.where(sel[:, :, None], h[None, :, :], h_before)
        a = tl.exp(dt_i[None, :] * A2) if FP64 else tl.exp2(dt_i[None, :] * A2)
        h = a * h + x_i[None, :] * B_i[:, None]
        step_ok = n_mask & (t0 + i + 0 * offs_n < L)
        _put(dc_base + (t0 + i) * d_state + offs_n, tl.reduce(h * dy_i[None, :], 1, _add), step_ok, ATOMIC)
        if HAS_Z:
            C_i = tl.reduce(tl.where(sel, Cc, -0.0), 0, _add)
            y_pre = tl.where(sel, tl.reduce(h * C_i[:, None], 0, _add)[None, :], y_pre)
    if HAS_Z:
        if HAS_D:
            y_pre = y_pre + skip[None, :] * u
        tl.store(dz_base + t[:, None], (dz_scale * y_pre).to(dz_base.dtype.element_ty), mask=td_mask)

    # Reverse over the chunk; grad_h carries a_{t+1} q_{t+1}.
    dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)  # dL/dx_t = sum_n q B
    dlog = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)  # sum_n A2 g (A2 = A log2 e in fp32)
    chunk_A = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)  # sum_t g dt over the chunk
    for i in tl.static_range(BLOCK_T - 1, -1, -1):
        sel = (offs_t == i)[:, None]
        dt_i = tl.reduce(tl.where(sel, dt, -0.0), 0, _add)
        x_i = tl.reduce(tl.where(sel, x, -0.0), 0, _add)
        B_i = tl.reduce(tl.where(sel, Bc, -0.0), 0, _add)
        C_i = tl.reduce(tl.where(sel, Cc, -0.0), 0, _add)
        dy_i = tl.reduce(tl.where(sel, dy, -0.0), 0, _add)
        h_prev = tl.reduce(tl.where(sel[:, :, None], h_before, -0.0), 0, _add)  # (N, D)
        a = tl.exp(dt_i[None, :] * A2) if FP64 else tl.exp2(dt_i[None, :] * A2)
        q = C_i[:, None] * dy_i[None, :] + grad_h  # (N, D)
        g = q * a * h_prev
        dx = tl.where(sel, tl.reduce(q * B_i[:, None], 0, _add)[None, :], dx)
        dlog = tl.where(sel, tl.reduce(g * A2, 0, _add)[None, :], dlog)
        chunk_A += g * dt_i[None, :]
        grad_h = a * q
        step_ok = n_mask & (t0 + i + 0 * offs_n < L)
        _put(db_base + (t0 + i) * d_state + offs_n, tl.reduce(q * x_i[None, :], 1, _add), step_ok, ATOMIC)

    grad_A, grad_A_c = _kahan_add(grad_A, grad_A_c, chunk_A)
    ddt = dx * u + (dlog if FP64 else dlog * 0.6931471805599453)  # A = A2 ln 2
    du = dx * dt
    if HAS_D:
        du = du + skip[None, :] * dy
        grad_skip, grad_skip_c = _kahan_add(grad_skip, grad_skip_c, tl.sum(dy * u, axis=0))
    if SOFTPLUS:
        # torch's softplus gradient: 1 above the threshold, else sigmoid(v).
        ddt = tl.where(v > 20.0, ddt, ddt * tl.sigmoid(v))
    ddt = tl.where(td_mask, ddt, 0.0)  # masked steps have dt = 0 but a nonzero dlog
    if HAS_BIAS:
        grad_bias, grad_bias_c = _kahan_add(grad_bias, grad_bias_c, tl.sum(ddt, axis=0))
    tl.store(du_base + t[:, None], du.to(du_base.dtype.element_ty), mask=td_mask)
    tl.store(ddelta_base + t[:, None], ddt.to(ddelta_base.dtype.element_ty), mask=td_mask)
    return grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c


@triton.jit
def _adjoint_chunk(
    grad_h, t0, L, delta_base, z_base, dout_base, c_base, stride_deltal, stride_zl, stride_dol, stride_cn,
    stride_cl, A2, bias, d_mask, offs_n, n_mask,
    ACC: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    FP64: tl.constexpr, MASKED: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """dL/dh before the chunk [t0, t0 + BLOCK_T) from grad_h = dL/dh after it (N, D), by the state
    gradient's recurrence alone: ``_bwd_chunk``'s reverse walk, step for step the same operations
    (``q_t = C_t dy_t + grad_h``, carrying ``a_t q_t``), without the states or any input gradient.
    Returns it and the chunk's sum of dt (D,) (masked steps add 0 and have a = 1, dy = 0, C = 0)."""
    offs_t = tl.arange(0, BLOCK_T)
    t = t0 + offs_t.to(tl.int64)  # int64: t * stride may pass 2^31 for inputs strided along time
    td_mask, tn_mask = _chunk_masks(t, L, d_mask, n_mask, MASKED, BLOCK_T)
    dt, _ = _chunk_dt(delta_base + t[:, None] * stride_deltal, bias, td_mask, ACC, HAS_BIAS, SOFTPLUS)
    dy, _ = _chunk_dy(dout_base, z_base, t, stride_dol, stride_zl, td_mask, ACC, HAS_Z)
    Cc = tl.load(c_base + offs_n[None, :] * stride_cn + t[:, None] * stride_cl, mask=tn_mask, other=0.0)  # (T, N)
    for i in tl.static_range(BLOCK_T - 1, -1, -1):
        sel = (offs_t == i)[:, None]
        dt_i = tl.reduce(tl.where(sel, dt, -0.0), 0, _add)
        C_i = tl.reduce(tl.where(sel, Cc, -0.0), 0, _add)
        dy_i = tl.reduce(tl.where(sel, dy, -0.0), 0, _add)
        a = tl.exp(dt_i[None, :] * A2) if FP64 else tl.exp2(dt_i[None, :] * A2)
        grad_h = a * (C_i[:, None] * dy_i[None, :] + grad_h)
    return grad_h, tl.reduce(dt, 0, _add)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.autotune(
    configs=_fwd_configs(), key=["BLOCK_N", "L_BUCKET", "P_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_fwd_configs},
)
@triton.jit(do_not_specialize=_PART_RUNTIME_INTS)
def selective_scan_part_kernel(
    U, DELTA, A, B, DELTA_BIAS, PART_H, PART_DECAY,
    stride_ub, stride_ud, stride_ul,
    stride_deltab, stride_deltad, stride_deltal,
    stride_ad, stride_an,
    stride_bb, stride_bg, stride_bn, stride_bl,
    stride_biasd,
    batch_size, dim, P, d_state, L, part_len, L_BUCKET, P_BUCKET,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, FP64: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """What part p of the sequence (steps [p part_len, (p + 1) part_len), every part but the last)
    does to the state of one (channel block, group, batch): ``h_end = decay * h_start + h_local``
    with ``h_local`` the state after the part from a zero state and ``decay = prod_t a_t =
    exp(A sum_t dt_t)`` (N, D), stored to PART_H / PART_DECAY ((n_parts - 1, batch, dim, N), the
    compute dtype). Grid (cdiv(P, BLOCK_D), G, batch * (n_parts - 1)), program (.., .., p * batch + b).
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    group = tl.program_id(1)
    part = tl.program_id(2) // batch_size
    batch = (tl.program_id(2) % batch_size).to(tl.int64)
    offs_d, d_mask, offs_n, n_mask, nd_mask, A2 = _channel_block(
        A, stride_ad, stride_an, P, d_state, ACC, FP64, BLOCK_N, BLOCK_D
    )
    bias = tl.load(DELTA_BIAS + offs_d * stride_biasd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None
    u_base = U + batch * stride_ub + offs_d[None, :] * stride_ud
    delta_base = DELTA + batch * stride_deltab + offs_d[None, :] * stride_deltad
    b_base = B + batch * stride_bb + group * stride_bg

    h = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dt_total = tl.zeros([BLOCK_D], dtype=ACC)
    first = part * (part_len // BLOCK_T)
    for chunk in range(first, first + part_len // BLOCK_T):  # whole chunks: part_len is a multiple
        h, dt_sum = _fwd_chunk(
            h, chunk * BLOCK_T, L, u_base, delta_base, None, None, b_base, None, stride_ul, stride_deltal,
            0, 0, stride_bn, stride_bl, 0, 0, A2, None, bias, d_mask, offs_n, n_mask,
            ACC, False, False, HAS_BIAS, SOFTPLUS, FP64, False, False, BLOCK_T, BLOCK_D,
        )
        dt_total += dt_sum
    # One exponential of the summed exponent: the product of the part's decays, rounded once.
    decay = tl.exp(dt_total[None, :] * A2) if FP64 else tl.exp2(dt_total[None, :] * A2)
    out = ((part * batch_size + batch) * dim + offs_d[None, :]) * d_state + offs_n[:, None]
    tl.store(PART_H + out, h, mask=nd_mask)
    tl.store(PART_DECAY + out, decay, mask=nd_mask)


@triton.autotune(
    configs=_fwd_configs(), key=["BLOCK_N", "L_BUCKET", "P_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_fwd_configs},
)
@triton.jit(do_not_specialize=_FWD_RUNTIME_INTS)
def selective_scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, DELTA_BIAS, H0, Y, LAST, CKPT, PART_H, PART_DECAY,
    stride_ub, stride_ud, stride_ul,
    stride_deltab, stride_deltad, stride_deltal,
    stride_ad, stride_an,
    stride_bb, stride_bg, stride_bn, stride_bl,
    stride_cb, stride_cg, stride_cn, stride_cl,
    stride_Dd, stride_biasd,
    stride_zb, stride_zd, stride_zl,
    stride_hb, stride_hd, stride_hn,
    stride_yb, stride_yd, stride_yl,
    batch_size, dim, P, d_state, L, n_ckpt, part_len, L_BUCKET, P_BUCKET,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_CKPT: tl.constexpr, FP64: tl.constexpr, CKPT_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """y, the last state and (optionally) the checkpoints of one (channel block, group, batch) over
    part p of the sequence; grid (cdiv(P, BLOCK_D), G, batch * n_parts), program (.., .., p * batch
    + b), with P = dim / G channels per group. Part p starts from h_0 carried through the earlier
    parts' (decay, h_local) pairs of :func:`selective_scan_part_kernel`; the last part stores LAST."""
    tl.static_assert(CKPT_STEPS % BLOCK_T == 0)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    group = tl.program_id(1)
    part = tl.program_id(2) // batch_size
    n_parts = tl.num_programs(2) // batch_size
    batch = (tl.program_id(2) % batch_size).to(tl.int64)
    offs_d, d_mask, offs_n, n_mask, nd_mask, A2 = _channel_block(
        A, stride_ad, stride_an, P, d_state, ACC, FP64, BLOCK_N, BLOCK_D
    )
    skip = tl.load(D + offs_d * stride_Dd, mask=d_mask, other=0.0).to(ACC) if HAS_D else None
    bias = tl.load(DELTA_BIAS + offs_d * stride_biasd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None
    if HAS_H0:
        h = tl.load(H0 + batch * stride_hb + offs_d[None, :] * stride_hd + offs_n[:, None] * stride_hn,
                    mask=nd_mask, other=0.0).to(ACC)
    else:
        h = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    # The state entering this part: h_0 through every earlier part's affine map, in order (one fma
    # per state and part instead of the part's steps).
    part_offs = (batch * dim + offs_d[None, :]) * d_state + offs_n[:, None]  # (N, D)
    for prev in range(0, part):
        at = prev * batch_size * dim * d_state + part_offs
        h = tl.load(PART_DECAY + at, mask=nd_mask, other=0.0) * h + tl.load(PART_H + at, mask=nd_mask, other=0.0)

    u_base = U + batch * stride_ub + offs_d[None, :] * stride_ud  # (1, D)
    delta_base = DELTA + batch * stride_deltab + offs_d[None, :] * stride_deltad
    z_base = Z + batch * stride_zb + offs_d[None, :] * stride_zd if HAS_Z else None
    y_base = Y + batch * stride_yb + offs_d[None, :] * stride_yd
    b_base = B + batch * stride_bb + group * stride_bg
    c_base = C + batch * stride_cb + group * stride_cg
    ckpt_base = CKPT + ((batch * dim + offs_d[None, :]) * n_ckpt) * d_state + offs_n[:, None]  # (N, D)

    # The part's full chunks, saving the state every CKPT_STEPS steps (parts start on a checkpoint:
    # part_len is a multiple of CKPT_STEPS); then the sequence's partial last chunk, if any.
    first = part * (part_len // BLOCK_T)
    n_full = tl.minimum(first + part_len // BLOCK_T, L // BLOCK_T)
    for chunk in range(first, n_full):
        if STORE_CKPT:
            if chunk % (CKPT_STEPS // BLOCK_T) == 0:
                tl.store(ckpt_base + (chunk // (CKPT_STEPS // BLOCK_T)) * d_state, h, mask=nd_mask)
        h, _ = _fwd_chunk(
            h, chunk * BLOCK_T, L, u_base, delta_base, z_base, y_base, b_base, c_base, stride_ul, stride_deltal,
            stride_zl, stride_yl, stride_bn, stride_bl, stride_cn, stride_cl, A2, skip, bias, d_mask, offs_n, n_mask,
            ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, True, False, BLOCK_T, BLOCK_D,
        )
    if part == n_parts - 1:
        if n_full * BLOCK_T < L:
            if STORE_CKPT:
                if n_full % (CKPT_STEPS // BLOCK_T) == 0:
                    tl.store(ckpt_base + (n_full // (CKPT_STEPS // BLOCK_T)) * d_state, h, mask=nd_mask)
            h, _ = _fwd_chunk(
                h, n_full * BLOCK_T, L, u_base, delta_base, z_base, y_base, b_base, c_base, stride_ul,
                stride_deltal, stride_zl, stride_yl, stride_bn, stride_bl, stride_cn, stride_cl, A2, skip, bias,
                d_mask, offs_n, n_mask, ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, True, True, BLOCK_T, BLOCK_D,
            )
        tl.store(LAST + (batch * dim + offs_d[None, :]) * d_state + offs_n[:, None], h, mask=nd_mask)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.autotune(
    configs=_fwd_configs(), key=["BLOCK_N", "L_BUCKET", "P_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_fwd_configs},
)
@triton.jit(do_not_specialize=_PART_RUNTIME_INTS)
def selective_scan_adjoint_part_kernel(
    DELTA, A, C, Z, DELTA_BIAS, DOUT, PART_G, PART_DECAY,
    stride_deltab, stride_deltad, stride_deltal,
    stride_ad, stride_an,
    stride_cb, stride_cg, stride_cn, stride_cl,
    stride_biasd,
    stride_zb, stride_zd, stride_zl,
    stride_dob, stride_dod, stride_dol,
    batch_size, dim, P, d_state, L, part_len, L_BUCKET, P_BUCKET,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, FP64: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """What part p of the sequence (steps [p part_len, (p + 1) part_len) clipped to L, every part but
    the first) does to the state gradient of one (channel block, group, batch), walked backwards:
    ``g_start = decay * g_end + g_local`` with ``g_local`` = dL/dh at the part's start from a zero
    gradient at its end (the C_t dy_t terms of its steps carried back) and ``decay = prod_t a_t =
    exp(A sum_t dt_t)`` (N, D), stored to PART_G / PART_DECAY ((n_parts - 1, batch, dim, N), the
    compute dtype; part p at index p - 1). Grid (cdiv(P, BLOCK_D), G, batch * (n_parts - 1)),
    program (.., .., (p - 1) * batch + b). The last part ends with the sequence's partial last chunk.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    group = tl.program_id(1)
    part = tl.program_id(2) // batch_size + 1
    n_parts = tl.num_programs(2) // batch_size + 1
    batch = (tl.program_id(2) % batch_size).to(tl.int64)
    offs_d, d_mask, offs_n, n_mask, nd_mask, A2 = _channel_block(
        A, stride_ad, stride_an, P, d_state, ACC, FP64, BLOCK_N, BLOCK_D
    )
    bias = tl.load(DELTA_BIAS + offs_d * stride_biasd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None
    delta_base = DELTA + batch * stride_deltab + offs_d[None, :] * stride_deltad
    z_base = Z + batch * stride_zb + offs_d[None, :] * stride_zd if HAS_Z else None
    dout_base = DOUT + batch * stride_dob + offs_d[None, :] * stride_dod
    c_base = C + batch * stride_cb + group * stride_cg

    grad_h = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dt_total = tl.zeros([BLOCK_D], dtype=ACC)
    # Whole chunks (part_len is a multiple of CHECKPOINT_STEPS, hence of BLOCK_T), after the
    # sequence's partial last chunk, if any, in the last part.
    first = part * (part_len // BLOCK_T)
    n_full = tl.minimum(first + part_len // BLOCK_T, L // BLOCK_T)
    if part == n_parts - 1:
        if n_full * BLOCK_T < L:
            grad_h, dt_sum = _adjoint_chunk(
                grad_h, n_full * BLOCK_T, L, delta_base, z_base, dout_base, c_base, stride_deltal, stride_zl,
                stride_dol, stride_cn, stride_cl, A2, bias, d_mask, offs_n, n_mask,
                ACC, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, True, BLOCK_T,
            )
            dt_total += dt_sum
    for chunk_rev in range(0, n_full - first):
        grad_h, dt_sum = _adjoint_chunk(
            grad_h, (n_full - 1 - chunk_rev) * BLOCK_T, L, delta_base, z_base, dout_base, c_base, stride_deltal,
            stride_zl, stride_dol, stride_cn, stride_cl, A2, bias, d_mask, offs_n, n_mask,
            ACC, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, False, BLOCK_T,
        )
        dt_total += dt_sum
    # One exponential of the summed exponent, as the forward's part kernel: the product of the
    # part's decays rounded once (the walk above rounds it per step).
    decay = tl.exp(dt_total[None, :] * A2) if FP64 else tl.exp2(dt_total[None, :] * A2)
    out = (((part - 1) * batch_size + batch) * dim + offs_d[None, :]) * d_state + offs_n[:, None]
    tl.store(PART_G + out, grad_h, mask=nd_mask)
    tl.store(PART_DECAY + out, decay, mask=nd_mask)


# ATOMIC is left out of the key: both modes run the config tuned first, so they differ only in the
# order of the dB / dC adds (a different chunk length would also change every other gradient's
# rounding).
@triton.autotune(configs=_bwd_configs(), key=["BLOCK_N", "BLOCK_D", "L_BUCKET"], reset_to_zero=["DB_PART", "DC_PART"])
@triton.jit(do_not_specialize=_BWD_RUNTIME_INTS)
def selective_scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, DELTA_BIAS, CKPT, DOUT, DLAST, PART_G, PART_DECAY, SCRATCH,
    DU, DDELTA, DZ, DB_PART, DC_PART, DA_PART, DD_PART, DBIAS_PART, DH0,
    stride_ub, stride_ud, stride_ul,
    stride_deltab, stride_deltad, stride_deltal,
    stride_ad, stride_an,
    stride_bb, stride_bg, stride_bn, stride_bl,
    stride_cb, stride_cg, stride_cn, stride_cl,
    stride_Dd, stride_biasd,
    stride_zb, stride_zd, stride_zl,
    stride_dob, stride_dod, stride_dol,
    stride_dlb, stride_dld, stride_dln,
    batch_size, dim, P, d_state, L, n_ckpt, part_len, n_blocks, scratch_slots, L_BUCKET,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DLAST: tl.constexpr, FP64: tl.constexpr, CKPT_STEPS: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """All gradients of one (channel block, group, batch) over part p of the sequence (its
    checkpoint segments [p part_len, (p + 1) part_len) / CKPT_STEPS, clipped to n_ckpt); grid
    (n_blocks, G, batch * n_parts), program (.., .., p * batch + b).

    The state gradient after the part is dL/dh_L (DLAST, or zero) carried back through the later
    parts' (decay, g_local) pairs of :func:`selective_scan_adjoint_part_kernel` (PART_DECAY /
    PART_G, (n_parts - 1, batch, dim, N)). Writes du, ddelta, dz (batch, dim, L) over the part's
    steps; dB / dC summed over this block's channels, added into the zeroed (batch, G, L, N) sums
    (ATOMIC) or written as this block's partials of (batch, G, n_blocks, L, N) (parts cover
    disjoint steps); dA (n_parts, batch, dim, N), dD and d delta_bias (n_parts, batch, dim) summed
    over the part's steps; the first part writes dh0 (batch, dim, N). SCRATCH is (n_parts, batch,
    dim, scratch_slots, N): a slot per chunk of a segment, per program.
    """
    tl.static_assert(CKPT_STEPS % BLOCK_T == 0)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    block = tl.program_id(0)
    group = tl.program_id(1)
    part = tl.program_id(2) // batch_size
    n_parts = tl.num_programs(2) // batch_size
    batch = (tl.program_id(2) % batch_size).to(tl.int64)
    offs_d, d_mask, offs_n, n_mask, nd_mask, A2 = _channel_block(
        A, stride_ad, stride_an, P, d_state, ACC, FP64, BLOCK_N, BLOCK_D
    )
    skip = tl.load(D + offs_d * stride_Dd, mask=d_mask, other=0.0).to(ACC) if HAS_D else None
    bias = tl.load(DELTA_BIAS + offs_d * stride_biasd, mask=d_mask, other=0.0).to(ACC) if HAS_BIAS else None

    u_base = U + batch * stride_ub + offs_d[None, :] * stride_ud  # (1, D)
    delta_base = DELTA + batch * stride_deltab + offs_d[None, :] * stride_deltad
    z_base = Z + batch * stride_zb + offs_d[None, :] * stride_zd if HAS_Z else None
    dout_base = DOUT + batch * stride_dob + offs_d[None, :] * stride_dod
    row = (batch * dim + offs_d[None, :]) * L  # (1, D): rows of the contiguous (batch, dim, L) outputs
    dz_base = DZ + row if HAS_Z else None
    b_base = B + batch * stride_bb + group * stride_bg
    c_base = C + batch * stride_cb + group * stride_cg
    bc_offs = (batch * tl.num_programs(1) + group) * L * d_state  # this (batch, group)'s dB / dC
    if not ATOMIC:
        bc_offs = bc_offs * n_blocks + block * L * d_state  # this block's partials
    part_row = part * batch_size + batch  # this (part, batch)'s row of the per-part buffers
    ckpt_base = CKPT + ((batch * dim + offs_d[None, :]) * n_ckpt) * d_state + offs_n[:, None]  # (N, D)
    scratch_base = SCRATCH + ((part_row * dim + offs_d[None, :]) * scratch_slots) * d_state + offs_n[:, None]
    state_offs = (batch * dim + offs_d[None, :]) * d_state + offs_n[:, None]  # (N, D) in (batch, dim, N)

    # dL/dh after the part: the last state's gradient at the end of the sequence, mapped through
    # every later part, last first (one fma per state and part instead of the part's steps).
    if HAS_DLAST:
        grad_h = tl.load(DLAST + batch * stride_dlb + offs_d[None, :] * stride_dld + offs_n[:, None] * stride_dln,
                         mask=nd_mask, other=0.0).to(ACC)
    else:
        grad_h = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for later_rev in range(0, n_parts - 1 - part):  # part n_parts - 1 - later_rev, at index n_parts - 2 - later_rev
        at = (((n_parts - 2 - later_rev) * batch_size + batch) * dim + offs_d[None, :]) * d_state + offs_n[:, None]
        grad_h = tl.load(PART_DECAY + at, mask=nd_mask, other=0.0) * grad_h + tl.load(PART_G + at, mask=nd_mask, other=0.0)
    # Running sums over the part's steps, with their Kahan compensations.
    grad_A = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)  # sum_t g dt
    grad_A_c = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    grad_skip = tl.zeros([BLOCK_D], dtype=ACC)
    grad_skip_c = tl.zeros([BLOCK_D], dtype=ACC)
    grad_bias = tl.zeros([BLOCK_D], dtype=ACC)
    grad_bias_c = tl.zeros([BLOCK_D], dtype=ACC)

    # The part's checkpoint segments from last to first (parts start on a checkpoint: part_len is a
    # multiple of CKPT_STEPS); the last part's last segment ends with the partial last chunk.
    seg_first = part * (part_len // CKPT_STEPS)
    seg_end = tl.minimum(seg_first + part_len // CKPT_STEPS, n_ckpt)
    for seg_rev in range(0, seg_end - seg_first):
        seg = seg_end - 1 - seg_rev
        seg_start = seg * CKPT_STEPS
        n_chunks = tl.cdiv(tl.minimum(CKPT_STEPS, L - seg_start), BLOCK_T)

        # Pass 1: the state before each chunk of the segment, from the segment's checkpoint, into
        # the scratch slots. It never crosses the sequence's partial last chunk (the state after
        # it is not needed). The barriers order the slots between threads (a slot may be stored
        # and loaded in different layouts), against the previous segment's pass 2 and this one's.
        tl.debug_barrier()
        h = tl.load(ckpt_base + seg * d_state, mask=nd_mask, other=0.0)
        tl.store(scratch_base, h, mask=nd_mask)
        for k in range(1, n_chunks):
            h, _ = _fwd_chunk(
                h, seg_start + (k - 1) * BLOCK_T, L, u_base, delta_base, None, None, b_base, None, stride_ul,
                stride_deltal, 0, 0, stride_bn, stride_bl, 0, 0, A2, skip, bias, d_mask, offs_n, n_mask,
                ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, False, False, BLOCK_T, BLOCK_D,
            )
            tl.store(scratch_base + k * d_state, h, mask=nd_mask)
        tl.debug_barrier()

        # Pass 2: the segment's chunks in reverse.
        for k_rev in range(0, n_chunks):
            k = n_chunks - 1 - k_rev
            t0 = seg_start + k * BLOCK_T
            h_start = tl.load(scratch_base + k * d_state, mask=nd_mask, other=0.0)
            if t0 + BLOCK_T > L:  # the sequence's partial last chunk
                grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c = _bwd_chunk(
                    h_start, grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c,
                    t0, L, d_state, u_base, delta_base, z_base, dout_base, DU + row, DDELTA + row, dz_base,
                    b_base, c_base, DB_PART + bc_offs, DC_PART + bc_offs, stride_ul, stride_deltal, stride_zl,
                    stride_dol, stride_bn, stride_bl, stride_cn, stride_cl, A2, skip, bias, d_mask, offs_n, n_mask,
                    ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, True, ATOMIC, BLOCK_T, BLOCK_N, BLOCK_D,
                )
            else:
                grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c = _bwd_chunk(
                    h_start, grad_h, grad_A, grad_A_c, grad_skip, grad_skip_c, grad_bias, grad_bias_c,
                    t0, L, d_state, u_base, delta_base, z_base, dout_base, DU + row, DDELTA + row, dz_base,
                    b_base, c_base, DB_PART + bc_offs, DC_PART + bc_offs, stride_ul, stride_deltal, stride_zl,
                    stride_dol, stride_bn, stride_bl, stride_cn, stride_cl, A2, skip, bias, d_mask, offs_n, n_mask,
                    ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FP64, False, ATOMIC, BLOCK_T, BLOCK_N, BLOCK_D,
                )

    if part == 0:
        tl.store(DH0 + state_offs, grad_h, mask=nd_mask)
    part_state_offs = (part_row * dim + offs_d[None, :]) * d_state + offs_n[:, None]  # (N, D)
    tl.store(DA_PART + part_state_offs, grad_A, mask=nd_mask)
    if HAS_D:
        tl.store(DD_PART + part_row * dim + offs_d, grad_skip, mask=d_mask)
    if HAS_BIAS:
        tl.store(DBIAS_PART + part_row * dim + offs_d, grad_bias, mask=d_mask)


# ----------------------------------------------------------------------------------------------
# Decode step
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["dim", "P"])
def selective_state_update_kernel(
    STATE, X, DT, A, B, C, D, Z, DT_BIAS, Y,
    stride_sb, stride_sd, stride_sn,
    stride_xb, stride_xd, stride_dtb, stride_dtd,
    stride_ad, stride_an,
    stride_bb, stride_bg, stride_bn, stride_cb, stride_cg, stride_cn,
    stride_Dd, stride_biasd, stride_zb, stride_zd,
    dim, P, d_state,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    FP64: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One step for a (BLOCK_D, N) state tile, in place, and y (batch, dim) contiguous; grid
    (cdiv(P, BLOCK_D), G, batch). d_state specialises: knowing it is a multiple of 16 lets the
    N-masked state loads and stores use 16-byte accesses."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    group = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_p = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_p < P
    offs_d = group.to(tl.int64) * P + offs_p
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < d_state
    dn_mask = d_mask[:, None] & n_mask[None, :]

    state_ptr = STATE + batch * stride_sb + offs_d[:, None] * stride_sd + offs_n[None, :] * stride_sn
    h = tl.load(state_ptr, mask=dn_mask, other=0.0).to(ACC)  # (D, N)
    x = tl.load(X + batch * stride_xb + offs_d * stride_xd, mask=d_mask, other=0.0).to(ACC)
    dt = tl.load(DT + batch * stride_dtb + offs_d * stride_dtd, mask=d_mask, other=0.0).to(ACC)
    if HAS_BIAS:
        dt = dt + tl.load(DT_BIAS + offs_d * stride_biasd, mask=d_mask, other=0.0).to(ACC)
    if SOFTPLUS:
        dt = _softplus(dt)
    A_tile = tl.load(A + offs_d[:, None] * stride_ad + offs_n[None, :] * stride_an, mask=dn_mask, other=0.0)
    Bv = tl.load(B + batch * stride_bb + group * stride_bg + offs_n * stride_bn, mask=n_mask, other=0.0).to(ACC)
    Cv = tl.load(C + batch * stride_cb + group * stride_cg + offs_n * stride_cn, mask=n_mask, other=0.0).to(ACC)
    if FP64:
        a = tl.exp(dt[:, None] * A_tile.to(ACC))
    else:
        a = tl.exp2(dt[:, None] * (A_tile.to(ACC) * 1.4426950408889634))
    h = a * h + (dt * x)[:, None] * Bv[None, :]
    tl.store(state_ptr, h.to(STATE.dtype.element_ty), mask=dn_mask)
    y = tl.sum(h * Cv[None, :], axis=1)  # (D,)
    if HAS_D:
        y = y + tl.load(D + offs_d * stride_Dd, mask=d_mask, other=0.0).to(ACC) * x
    if HAS_Z:
        z = tl.load(Z + batch * stride_zb + offs_d * stride_zd, mask=d_mask, other=0.0).to(ACC)
        y = y * z * tl.sigmoid(z)
    tl.store(Y + batch * dim + offs_d, y.to(Y.dtype.element_ty), mask=d_mask)


# fmt: on

# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def sequence_parts(programs: int, seqlen: int, num_sms: int) -> tuple[int, int]:
    """``(n_parts, part_len)``: how many parts the forward cuts the sequence into, and their length
    in steps (a multiple of CHECKPOINT_STEPS; the last part may be shorter).

    A program walks its channels' whole sequence, so with few (batch, channel block) programs, e.g.
    a batch-1 prefill (96 one-warp programs for Mamba at d_inner 1536), most of the GPU idles. Parts
    run in parallel: a first kernel walks every part but the last from a zero state, keeping the
    part's (decay, h_local); the forward then starts each part from h_0 carried through the earlier
    parts' pairs. That walks the sequence about 1.6 times instead of once, so the parts times
    ``programs`` (counted at the smallest channel block) stay within PART_TARGET_WARPS one-warp
    programs per SM, and no part is shorter than MIN_PART_STEPS. Training batches (B8 at d_inner 2048:
    1024 programs) keep one part.
    """
    return _split_sequence(programs, seqlen, num_sms)


def backward_sequence_parts(programs: int, seqlen: int, num_sms: int) -> tuple[int, int]:
    """``(n_parts, part_len)`` of the backward: :func:`sequence_parts`'s rule, with ``programs`` the
    backward's (batch, group, channel block) programs at its own channel block (:func:`_bwd_block_d`,
    16 channels on CUDA: a batch-1 Mamba at d_inner 1536 and N = 16 is 96 programs, 11 parts of
    3008 steps over 32768 on an H200's 132 SMs; a training batch, B8 at d_inner 2048, is 1024
    programs and keeps one part).

    Why the same rule. The backward's programs are one warp too, and the same cap of
    PART_TARGET_WARPS per SM keeps them all resident (what a program holds in registers is bounded:
    see _BWD_CUDA). Parts add less work to the backward than to the forward: every part but the
    first is walked once more by :func:`selective_scan_adjoint_part_kernel`, which loads delta, C,
    dout (and z) and runs one multiply-add per state and step, against the main kernel's two
    recomputations of the states and its gradient arithmetic; the carries between parts cost one
    multiply-add per state and later part. MIN_PART_STEPS keeps those per-part costs small against a
    part's steps. Parts are whole checkpoint segments (part_len a multiple of CHECKPOINT_STEPS), so
    each part starts its reverse walk from its own last checkpoint without walking earlier parts.
    A separate function from :func:`sequence_parts` so that each pass's count can be changed (and is
    tested) on its own.
    """
    return _split_sequence(programs, seqlen, num_sms)


def _split_sequence(programs: int, seqlen: int, num_sms: int) -> tuple[int, int]:
    """The parts rule shared by the forward and the backward (see :func:`sequence_parts`)."""
    want = PART_TARGET_WARPS * num_sms // max(programs, 1)
    n_parts = max(1, min(want, seqlen // MIN_PART_STEPS))
    part_len = cdiv(cdiv(max(seqlen, 1), n_parts), CHECKPOINT_STEPS) * CHECKPOINT_STEPS
    return cdiv(max(seqlen, 1), part_len), part_len


def _bwd_block_d(P: int, block_n: int) -> int:
    """The backward's channel block for P channels per group and BLOCK_N states. A warp keeps at
    most BWD_BLOCK_D * 16 states: past N = 16 the channel block shrinks and the default layout
    spreads each channel's states over more lanes (the registers stay bounded)."""
    return min(BWD_BLOCK_D, next_power_of_2(P), max(1, BWD_BLOCK_D * 16 // block_n))


def _grouped(t: torch.Tensor, dtype: torch.dtype, grouped_ndim: int) -> torch.Tensor:
    """B or C in the compute dtype with a group dim: (batch, G, N, L) for the scan
    (``grouped_ndim=4``), (batch, G, N) for the decode step (``grouped_ndim=3``)."""
    t = t.to(dtype)
    return t if t.ndim == grouped_ndim else t.unsqueeze(1)


def _forward(u, delta, A, B, C, D, z, delta_bias, h0, softplus: bool, store_ckpt: bool):
    """Launch the forward kernel. Returns y (u's dtype), the last state and the checkpoints (None
    unless ``store_ckpt``), both in the compute dtype."""
    batch, dim, seqlen = u.shape
    d_state = A.shape[1]
    dtype = _compute_dtype(u.dtype)
    B, C = _grouped(B, dtype, 4), _grouped(C, dtype, 4)
    groups = B.shape[1]
    P = dim // groups
    n_ckpt = cdiv(seqlen, CHECKPOINT_STEPS)
    y = torch.empty((batch, dim, seqlen), dtype=u.dtype, device=u.device)
    last = torch.empty((batch, dim, d_state), dtype=dtype, device=u.device)
    ckpt = torch.empty((batch, dim, n_ckpt if store_ckpt else 0, d_state), dtype=dtype, device=u.device)
    if batch * dim == 0:
        return y, last, ckpt

    n_parts, part_len = sequence_parts(
        batch * groups * cdiv(P, MIN_FWD_BLOCK_D), seqlen, sm_count(u.device, INTERPRET_SMS)
    )
    l_bucket, p_bucket = _bucket(seqlen), min(next_power_of_2(P), 128)
    part_h = part_decay = last  # dummies with one part (never read)
    if n_parts > 1:
        part_h = torch.empty((n_parts - 1, batch, dim, d_state), dtype=dtype, device=u.device)
        part_decay = torch.empty_like(part_h)

        def part_grid(meta):
            return (cdiv(P, meta["BLOCK_D"]), groups, batch * (n_parts - 1))

        selective_scan_part_kernel[part_grid](
            u, delta, A, B, delta_bias, part_h, part_decay,
            *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *strides(delta_bias, 1),
            batch, dim, P, d_state, seqlen, part_len, l_bucket, p_bucket,
            HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus, FP64=dtype == torch.float64,
            BLOCK_N=next_power_of_2(d_state),
        )  # fmt: skip

    def grid(meta):
        return (cdiv(P, meta["BLOCK_D"]), groups, batch * n_parts)

    selective_scan_fwd_kernel[grid](
        u, delta, A, B, C, D, z, delta_bias, h0, y, last, ckpt, part_h, part_decay,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
        *strides(D, 1), *strides(delta_bias, 1), *strides(z, 3), *strides(h0, 3), *y.stride(),
        batch, dim, P, d_state, seqlen, n_ckpt, part_len, l_bucket, p_bucket,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus,
        HAS_H0=h0 is not None, STORE_CKPT=store_ckpt, FP64=dtype == torch.float64,
        CKPT_STEPS=CHECKPOINT_STEPS, BLOCK_N=next_power_of_2(d_state),
    )  # fmt: skip
    return y, last, ckpt


def _backward(dy, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus: bool):
    """Launch the backward kernels and reduce their partials. Returns the gradients of u, delta, A,
    B, C, D, z, delta_bias and the initial state, each in its input's dtype (the initial state's
    in the compute dtype).

    With several sequence parts (:func:`backward_sequence_parts`), the adjoint part kernel first
    gives every part but the first its (decay, g_local) map of the state gradient; the main kernel
    then runs every (part, batch) in parallel. The sums over time (dA, dD, d delta_bias) come back
    per (part, batch) and are added here, in a fixed order (deterministic).
    """
    batch, dim, seqlen = u.shape
    d_state = A.shape[1]
    dtype = _compute_dtype(u.dtype)
    Bg, Cg = _grouped(B, dtype, 4), _grouped(C, dtype, 4)
    groups = Bg.shape[1]
    P = dim // groups
    block_n = next_power_of_2(d_state)
    block_d = _bwd_block_d(P, block_n)
    n_blocks = cdiv(P, block_d)
    n_ckpt = ckpt.shape[2]
    slots = CHECKPOINT_STEPS // _MIN_BWD_BLOCK_T
    device = u.device
    n_parts, part_len = backward_sequence_parts(
        batch * groups * n_blocks, seqlen, sm_count(device, INTERPRET_SMS)
    )

    du = torch.empty((batch, dim, seqlen), dtype=u.dtype, device=device)
    ddelta = torch.empty((batch, dim, seqlen), dtype=delta.dtype, device=device)
    dz = torch.empty((batch, dim, seqlen), dtype=z.dtype, device=device) if z is not None else None
    # dB / dC: atomic sums, or per-block partials when PyTorch is asked for deterministic algorithms.
    atomic = not torch.are_deterministic_algorithms_enabled()
    new_part = torch.zeros if atomic else torch.empty
    db_part = new_part(
        (batch, groups, 1 if atomic else n_blocks, seqlen, d_state), dtype=dtype, device=device
    )
    dc_part = new_part(db_part.shape, dtype=dtype, device=device)
    da_part = torch.empty((n_parts, batch, dim, d_state), dtype=dtype, device=device)
    dd_part = torch.empty((n_parts, batch, dim), dtype=dtype, device=device) if D is not None else None
    dbias_part = (
        torch.empty((n_parts, batch, dim), dtype=dtype, device=device) if delta_bias is not None else None
    )
    dh0 = torch.empty((batch, dim, d_state), dtype=dtype, device=device)
    scratch = torch.empty((n_parts, batch, dim, slots, d_state), dtype=dtype, device=device)
    if dy is None:  # only the last state was used
        dy = torch.zeros_like(u)

    if batch * dim > 0:
        part_g = part_decay = dh0  # dummies with one part (never read)
        if n_parts > 1:
            part_g = torch.empty((n_parts - 1, batch, dim, d_state), dtype=dtype, device=device)
            part_decay = torch.empty_like(part_g)

            def part_grid(meta):
                return (cdiv(P, meta["BLOCK_D"]), groups, batch * (n_parts - 1))

            selective_scan_adjoint_part_kernel[part_grid](
                delta, A, Cg, z, delta_bias, dy, part_g, part_decay,
                *delta.stride(), *A.stride(), *Cg.stride(), *strides(delta_bias, 1), *strides(z, 3), *dy.stride(),
                batch, dim, P, d_state, seqlen, part_len, _bucket(seqlen), min(next_power_of_2(P), 128),
                HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus,
                FP64=dtype == torch.float64, BLOCK_N=block_n,
            )  # fmt: skip

        selective_scan_bwd_kernel[(n_blocks, groups, batch * n_parts)](
            u, delta, A, Bg, Cg, D, z, delta_bias, ckpt, dy, dlast, part_g, part_decay, scratch,
            du, ddelta, dz, db_part, dc_part, da_part, dd_part, dbias_part, dh0,
            *u.stride(), *delta.stride(), *A.stride(), *Bg.stride(), *Cg.stride(),
            *strides(D, 1), *strides(delta_bias, 1), *strides(z, 3), *dy.stride(), *strides(dlast, 3),
            batch, dim, P, d_state, seqlen, n_ckpt, part_len, n_blocks, slots, _bucket(seqlen),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            SOFTPLUS=softplus, HAS_DLAST=dlast is not None, FP64=dtype == torch.float64,
            CKPT_STEPS=CHECKPOINT_STEPS, ATOMIC=atomic, BLOCK_N=block_n, BLOCK_D=block_d,
        )  # fmt: skip
    else:
        for t in (da_part, dd_part, dbias_part, db_part, dc_part):
            if t is not None:
                t.zero_()
        dh0.copy_(dlast if dlast is not None else torch.zeros_like(dh0))

    dB = db_part.sum(2).transpose(-1, -2).reshape(B.shape).to(B.dtype)
    dC = dc_part.sum(2).transpose(-1, -2).reshape(C.shape).to(C.dtype)
    dA = da_part.sum((0, 1)).to(A.dtype)
    dD = dd_part.sum((0, 1)).to(D.dtype) if D is not None else None
    dbias = dbias_part.sum((0, 1)).to(delta_bias.dtype) if delta_bias is not None else None
    return du, ddelta, dA, dB, dC, dD, dz, dbias, dh0


class _SelectiveScanFunction(torch.autograd.Function):
    """Autograd glue: saves the inputs and the checkpoints (4 N / CHECKPOINT_STEPS bytes per
    (channel, step)); the backward recomputes everything else."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus):
        with device_guard(u):
            y, last, ckpt = _forward(u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, True)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, ckpt)
        ctx.softplus = softplus
        ctx.initial_state_dtype = initial_state.dtype if initial_state is not None else None
        # Unused outputs (the last state when not returned) arrive as None instead of zeros.
        ctx.set_materialize_grads(False)
        return y, last

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dlast):
        u, delta, A, B, C, D, z, delta_bias, ckpt = ctx.saved_tensors
        with device_guard(u):
            du, ddelta, dA, dB, dC, dD, dz, dbias, dh0 = _backward(
                dy, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, ctx.softplus
            )
        dh0 = dh0.to(ctx.initial_state_dtype) if ctx.initial_state_dtype is not None else None
        grads = (du, ddelta, dA, dB, dC, dD, dz, dbias, dh0)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)), None


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Selective state-space scan (Gu & Dao 2023, Algorithm 2, eq. 2a-2b) in Triton, with
    mamba_ssm's ``selective_scan_fn`` semantics; differentiable in u, delta, A, B, C, D, z,
    delta_bias and initial_state.

        dt = delta (+ delta_bias) (softplus if delta_softplus)
        h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t,   h_0 = initial_state (zeros if None)
        y_t = C_t . h_t + D u_t,   then y *= silu(z)

    Args:
        u: (batch, dim, L) input, float16 / bfloat16 / float32 / float64, any strides.
        delta: (batch, dim, L) step sizes before bias / softplus.
        A: (dim, d_state) state matrix (diagonal per channel).
        B: (batch, d_state, L), or grouped (batch, G, d_state, L) with G dividing dim: group g
            serves channels g * dim / G ... (g + 1) * dim / G - 1.
        C: same shape as B.
        D: (dim,) skip connection, or None.
        z: (batch, dim, L) gate, or None.
        delta_bias: (dim,) added to delta, or None.
        delta_softplus: apply softplus to dt.
        return_last_state: also return h_L.
        initial_state: (batch, dim, d_state) h_0 (float32, float64 for float64 inputs), or None.

    Every input may have its own floating dtype; the compute dtype is float32 (float64 when u is
    float64), as in the reference, and exponentials are evaluated in it. The gradients of B and C
    are sums over channels added with atomics on the GPU, so they may differ in the last bits
    between runs; under ``torch.use_deterministic_algorithms(True)`` they are bitwise reproducible
    (about 4% slower). Every other output and gradient is always deterministic.

    Returns:
        y (batch, dim, L) in u's dtype; with return_last_state also last_state (batch, dim,
        d_state) in the compute dtype.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor or non-floating
        inputs, delta_softplus or return_last_state not a bool; ValueError: wrong ndim or any shape
        mismatch, G not dividing dim, tensors on different devices), and, for this backend only,
        ValueError for CPU inputs without ``TRITON_INTERPRET=1`` (or bfloat16 ones under it).
    """
    _check_selective_scan_args(
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, return_last_state
    )
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_device("selective_scan", *tensors)  # one device: checked by the shared validation
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        y, last = _SelectiveScanFunction.apply(*tensors, bool(delta_softplus))
    else:  # inference (prefill): no graph, no checkpoints
        with device_guard(u):
            y, last, _ = _forward(*tensors, bool(delta_softplus), False)
    return (y, last) if return_last_state else y


# Replayable launches of recent selective_state_update call signatures (_step_key).
_STEP_PLANS = LaunchPlans()


def _step_key(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) -> tuple | None:
    """Everything a :func:`selective_state_update` call's checks, tile choice and launch depend on
    except the tensors' addresses (:meth:`kernels._host.LaunchPlans.key`): dt_softplus with its type,
    and every tensor (or its absence) with its shape, strides, dtype, device and 16-byte alignment.
    None where no plan applies (see there)."""
    return _STEP_PLANS.key((dt_softplus,), state, x, dt, A, B, C, D, z, dt_bias)


def _aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


class _StepPlan:
    """The launch of one :func:`selective_state_update` call signature (:func:`_step_key`), replayed
    by later eager calls with their own tensors: the argument checks, the tile choice and Triton's
    argument binding ran once, for the first call (:class:`kernels._host.CompiledLaunch`). B and C
    are cast to the compute dtype and y allocated on every call, as on the ordinary path; the state
    is updated in place by the same kernel.

    Args:
        tensors: the first call's (state, x, dt, A, B, C, D, z, dt_bias), for the spans the overlap
            check needs.
        Bg, Cg: its B and C as launched (compute dtype, group dim), for their dtype and alignment.
        y: its (batch, dim) output, for its shape and alignment.
        launch: the step kernel's launch.
    """

    def __init__(self, tensors, Bg, Cg, y, launch):
        self.dtype, self.y_shape, self.device, self.launch = Bg.dtype, y.shape, y.device, launch
        self.aligned = _aligned(Bg, Cg, y)
        # The address check of _check_read_apart: nothing read may share the state's memory.
        self.apart = WrittenApart(tensors, written=(0,))

    def __call__(self, state, x, dt, A, B, C, D, z, dt_bias) -> torch.Tensor | None:
        """y of the replayed launch, or None (nothing launched) when the state's address span
        overlaps another tensor's (the ordinary path's checks decide) or a fresh tensor (y, a cast
        B or C) has another 16-byte alignment than the one the kernel was specialized for."""
        if not self.apart((state, x, dt, A, B, C, D, z, dt_bias)):
            return None
        Bg, Cg = _grouped(B, self.dtype, 3), _grouped(C, self.dtype, 3)
        y = x.new_empty(self.y_shape)
        if _aligned(Bg, Cg, y) != self.aligned:
            return None
        with replay_guard(self.device):
            mark_written(state=state)
            self.launch(state, x, dt, A, Bg, Cg, D, z, dt_bias, y)
        return y


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """One decode step of the selective scan (Gu & Dao 2023, eq. 2a-2b; mamba_ssm's
    selective_state_update) in Triton, updating ``state`` in place:

        dt = dt (+ dt_bias) (softplus if dt_softplus)
        state = exp(dt A) * state + dt B x,   y = C . state + D x,   y *= silu(z)

    Args:
        state: (batch, dim, d_state) float32 (or float64) SSM state, any strides; overwritten. A
            16-bit state is accepted, as mamba_ssm's step does (it keeps the state in the model's
            dtype unless told otherwise), and rounded at every step; the mixers allocate float32.
        x: (batch, dim) input of this step.
        dt: (batch, dim) step size before bias / softplus.
        A: (dim, d_state).
        B, C: (batch, d_state) or grouped (batch, G, d_state) with G dividing dim.
        D: (dim,) or None.   z: (batch, dim) or None.   dt_bias: (dim,) or None.
        dt_softplus: apply softplus to dt.

    Computes in float32 (float64 when x or state is float64). Not differentiable: it is the
    inference (decode) path.

    An eager step is host-bound: a CUDA call whose signature (dt_softplus, and every tensor's
    presence, shape, strides, dtype, device and 16-byte alignment) an earlier call that succeeded had
    replays that call's compiled launch on its own tensors, skipping the checks whose outcome the
    signature fixes (``_StepPlan``); the ordinary path runs while a Triton launch hook is installed.

    Returns:
        y (batch, dim) in x's dtype.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor or non-floating
        inputs, dt_softplus not a bool; ValueError: wrong ndim or any shape mismatch, G not
        dividing dim, tensors on different devices, an input sharing the state's memory), and, for
        this backend only, ValueError for CPU inputs without ``TRITON_INTERPRET=1`` (or bfloat16
        ones under it), and RuntimeError when called with grad mode on and an input that requires
        grad (use torch.no_grad(), or backend='reference').
    """
    # An eager decode loop repeats one call signature: replay its launch (see _StepPlan).
    key = _step_key(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    plan = _STEP_PLANS.get(key)
    if plan is not None:
        y = plan(state, x, dt, A, B, C, D, z, dt_bias)
        if y is not None:
            return y

    batch, dim, d_state, groups = _check_selective_state_update_args(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus
    )
    check_device("selective_state_update", state, x, dt, A, B, C, D, z, dt_bias)  # one device: checked above
    check_no_grad("selective_state_update", state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    dtype = torch.float64 if torch.float64 in (x.dtype, state.dtype) else torch.float32
    Bg, Cg = _grouped(B, dtype, 3), _grouped(C, dtype, 3)
    P = dim // groups
    y = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    if batch * dim == 0:
        return y
    block_n = next_power_of_2(d_state)
    block_d = min(
        next_power_of_2(P),
        max(1, DECODE_BLOCK_ELEMENTS // block_n),
        INTERPRET_BLOCK_D if _INTERPRET else DECODE_BLOCK_ELEMENTS,
    )
    tensors = (state, x, dt, A, Bg, Cg, D, z, dt_bias, y)
    grid = (cdiv(P, block_d), groups, batch)
    args = (
        *tensors,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *Bg.stride(), *Cg.stride(),
        *strides(D, 1), *strides(dt_bias, 1), *strides(z, 2),
        dim, P, d_state,
    )  # fmt: skip
    kwargs = dict(
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        FP64=dtype == torch.float64, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=DECODE_WARPS,
    )  # fmt: skip
    with device_guard(x):
        mark_written(state=state)
        compiled = selective_state_update_kernel[grid](*args, **kwargs)
    if key is not None:
        launch = CompiledLaunch.build(selective_state_update_kernel, compiled, grid, args, kwargs, len(tensors))
        if launch is not None:
            _STEP_PLANS.remember(key, _StepPlan((state, x, dt, A, B, C, D, z, dt_bias), Bg, Cg, y, launch))
    return y

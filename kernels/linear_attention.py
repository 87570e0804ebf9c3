"""Causal linear attention in Triton: chunked forward and backward, recurrent decode step.

``linear_attention(q, k, v, *, scale=None, normalize=True, eps=1e-10, initial_state=None,
output_final_state=False)`` and ``linear_attention_step(q, k, v, state, *, scale=None, z_state=None,
eps=1e-10)`` have exactly the semantics, shapes, dtypes, state forms and errors of
:func:`kernels.reference.linear_attention` / :func:`kernels.reference.linear_attention_step`;
:mod:`kernels` dispatches here for CUDA tensors and for ``backend="triton"`` (CPU tensors run under
``TRITON_INTERPRET=1``).

Math (Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6), q, k already feature-mapped:

    S_t = S_0 + sum_{s<=t} k_s v_s^T,   z_t = z_0 + sum_{s<=t} k_s
    o_t = scale q_t S_t   [ / (scale q_t . z_t + eps) with normalize ]

Chunkwise-parallel form (Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", Sec. 3 / eq. 3-4 with the gates set to 1; fla's ``chunk_fwd_h`` /
``chunk_fwd_o``): the sequence is cut into chunks of C tokens. With S_c the state before chunk c,

    O_c = scale (Q_c S_c + (Q_c K_c^T * M) V_c),   S_{c+1} = S_c + K_c^T V_c,   M = tril(ones(C, C))

Forward for K <= 128, fused (``uses_fused_forward``):

- ``linear_attention_segment_kernel``: the sequence is cut into a few segments of whole chunks
  (``num_segments``: enough (V tile, segment, head) programs to fill the SMs once); one program per
  (K tile, V tile, segment, batch * head) sums its segment's K_c^T V_c in fp32. Skipped with one
  segment (B8 T2048 H32 on an H200) unless it has z programs: with normalize and K padded to 128
  (``loads_chunk_z``), one program per (K tile, batch * head) also writes z_c before every chunk
  (and the final z), for the fused kernel to load instead of carrying z through its chunks. With
  few heads (batch * heads < ``CHUNK_Z_PARTS_BELOW_HEADS``, where that serial walk, not bandwidth,
  sets the kernel's time; ``chunk_z_parts``) the z programs walk parts of ``CHUNK_Z_PART_CHUNKS``
  chunks in parallel, writing z from the part's start and the part's sum, and
  ``linear_attention_chunk_z_kernel`` adds the earlier parts' sums and Z_IN (and the final z).
- ``linear_attention_fused_fwd_kernel``: one program per (V tile, segment, batch * head) starts from
  the initial state plus the earlier segments' sums, keeps the whole (K, V tile) state in fp32
  registers and walks its chunks in order: O_c from S_c and the masked (C x C) scores, then
  S_{c+1} = S_c + K_c^T V_c. The per-chunk states never make the round trip through HBM that the
  two-kernel path takes (written once for the backward, only when autograd will need them);
  1.25x fla's forward at B2 T8192 H16 D128 and 1.8x at B8 T2048 H32 D64 with the states stored
  (H200, 2026-12-01). With normalize, q . z_c is one more tensor-core product per chunk: loaded
  (``loads_chunk_z``), z_c is a (K, 2) hi / lo pair in the input dtype (lo = 0 for fp32 / fp64)
  read into columns 0 and 1 of a (K, 16) operand; carried, z_c (z_c / max|z_c| for fp16) sits in
  column 0 of a 64-wide operand built in registers. Wider K would not fit the state in registers:
  it keeps the two launches below.

Forward otherwise, two launches:

- ``linear_attention_state_kernel``: one program per (K tile, V tile, batch * head) runs over the
  chunks in order, keeps S in fp32 registers and writes every S_c (in the input dtype: it only
  feeds tensor-core products, which would round it to that dtype anyway; fp32 for fp16, see
  Numerics) and the final state (fp32).
  Programs of the first V tile also write z_c (fp32) when normalising.
- ``linear_attention_fwd_kernel``: one program per (V tile, chunk, batch * head), fully parallel:
  ``Q_c S_c`` and the masked ``Q_c K_c^T`` accumulated over K tiles on the tensor cores, then the
  (C x C) product with V_c; with normalize the denominator ``scale (rowsum(masked Q K^T) + Q_c z_c)
  + eps`` is formed in fp32 and saved for the backward.

Backward, five launches (six with normalize) of the same two kinds of kernel: a state scan run in
reverse and three chunk-parallel products. With G = dO / den (the numerator's gradient; dO itself
without normalize), r_t = -rowsum(dO_t * O_t) / den_t (the denominator's) and dS_c the gradient
reaching the state after chunk c,

    dS_c = dS_N + scale sum_{c' > c} Q_{c'}^T G_{c'}                       (state kernel, REVERSE)
    dQ_c = scale (G_c S_c^T + ((G_c V_c^T + r 1^T) * M) K_c + r z_c^T)   (bwd_dq kernel)
    dK_c = V_c dS_c^T + scale ((V_c G_c^T + 1 r^T) * M^T) Q_c + dz_c     (bwd_dk kernel)
    dV_c = K_c dS_c + scale ((K_c Q_c^T) * M^T) G_c                      (bwd_dv kernel)
    dS_0, dz_0 = the reverse scan's final values

where dz_c is the normaliser-state gradient carried alongside dS. The forward's S_c (and z_c) are
saved for the backward rather than recomputed: one sequential scan less, for memory of V / C times
q's size (2x at V = 128, C = 64). ``linear_attention_bwd_preprocess_kernel`` forms G and r.

Miscompile-avoidance (Triton 3.4-3.7.0 on Hopper miscompiles ``tl.dot(tl.trans(x), y)`` when ``x``
is itself a dot result, fla-org/flash-linear-attention#640): every (C x C) product is computed in
the orientation it is consumed in (dK uses ``V G^T``, dV uses ``K Q^T``, each its own dot), the
transposed operands of the loads are read through swapped strides, and no kernel calls
``tl.trans``. Triton 3.6 on Hopper also miscompiles a ``tl.sum`` of a loaded tile that feeds a
``tl.dot`` (the normaliser's z and q . z sums): the forward scan's z is a dot of the k tile with
ones instead, the reverse scan's dz a dot of the q tile with r (as a hi / lo pair of bf16 columns;
fp16 sums a reload), and the chunk kernels' sums read their own copy of the tile (``_own_copy``); the fused
forward's q . z_c is a tensor-core product with a loaded (K, 16) operand or, z carried, a 64-wide one
(16- and 32-wide operands built in registers were miscompiled: wrong values, then illegal addresses,
2026-12-01). No atomics:
every output element is written by exactly one program, so forward and backward are deterministic.

Numerics: products of 16-bit inputs are exact on the tensor cores and accumulate in fp32; the
running states (and the final and initial-state gradients), the normaliser, its denominator and
the decode step are fp32 (fp64 for fp64 inputs); the per-chunk states handed to the chunk kernels
are stored in the input dtype, the rounding their tensor-core products would apply anyway. The
fused forward's q . z_c takes z_c as a hi / lo pair of the input dtype (about 16 bits in bf16;
exact in fp32 / fp64) where it loads z, and carried z_c (z_c / max|z_c| for fp16, rescaled in fp32
after) rounded once to the input dtype. The states
grow linearly in T, beyond fp16's 65504: for fp16 inputs each is divided by a power of two that
brings it into range before its fp16 rounding, and the product multiplied back in fp32 (exact, and
a no-op for states already in range): per register tile in the fused forward (``_state_dot``), per
(batch, head, chunk) for the stored states, which the scans write in fp32 (``chunk_states``). fp32
inputs use IEEE fp32 products (TF32 would cost ~1e-3 relative error). Triton passes Python floats
as fp32, so for fp64 inputs the scale arrives as two fp32 halves; every ``tl.dot`` names its accumulator
dtype (``out_dtype=ACC``), which Triton 3.6 requires of fp64 accumulators.

Decode, ``linear_attention_step_kernel``: one program per (batch, head) streams its (K, V) state
through registers in K tiles, adds ``k v^T``, writes it back in place and reduces ``q . S`` on the
way (and ``z += k``, ``q . z`` when normalising): each state byte is read and written once.
An eager decode step is host-bound (on the H200 machine ~83 µs of host time a call against a few
µs of launch, most of it the argument checks and ``JITFunction.run``'s binding), so a call whose
signature was seen before replays that call's compiled launch (``_StepPlan``, as
:mod:`kernels.flash_decode` does).
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
    check_fp32_scalars,
    check_int32_offsets,
    check_no_grad,
    device_guard,
    mark_written,
    next_power_of_2,
    replay_guard,
    sm_count,
    split_fp64,
    strides,
)
from kernels.reference import (
    _check_linear_attention_args,
    _check_linear_attention_step_args,
    _compute_dtype,
    _split_linear_state,
)

__all__ = ["linear_attention", "linear_attention_step"]


# ----------------------------------------------------------------------------------------------
# Chunk size and autotune configs
# ----------------------------------------------------------------------------------------------

# Under the interpreter: chunks of 16 and 32-wide K / V tiles, so that tiny test shapes (T = 17, 65;
# K, V = 80, 273) still span several chunks and tiles, with partial ones at the ends.
INTERPRET_CHUNK = 16
INTERPRET_BLOCK = 32


def chunk_size(dtype: torch.dtype) -> int:
    """Tokens per chunk C for inputs of ``dtype``.

    64 for 16-bit inputs on CUDA (fla's choice: the (C x C) products fill the tensor cores, the
    per-chunk states cost K V / C per token); 32 for fp32 / fp64, whose IEEE products run on FMA
    units and which Triton unrolls completely (large tiles make ptxas very slow); 16 under the
    interpreter.
    """
    if _INTERPRET:
        return INTERPRET_CHUNK
    return 64 if dtype in (torch.float16, torch.bfloat16) else 32


def _configs(cuda_configs):
    """``triton.Config`` list from (BLOCK_D, BLOCK_E, num_warps, num_stages) tuples; one config
    of INTERPRET_BLOCK-wide tiles under the interpreter."""
    if _INTERPRET:
        block = {"BLOCK_D": INTERPRET_BLOCK, "BLOCK_E": INTERPRET_BLOCK}
        return [triton.Config(block, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_D": bd, "BLOCK_E": be}, num_warps=w, num_stages=s)
        for bd, be, w, s in cuda_configs
    ]


# BLOCK_D tiles the contraction dim, BLOCK_E the output dim (state kernel: K and V tiles). The state
# scan is sequential over chunks, so its configs trade tile size for programs (memory parallelism).
_STATE_CONFIGS = _configs([(64, 64, 4, 3), (32, 64, 4, 4), (32, 32, 2, 4)])
_FWD_CONFIGS = _configs([(64, 128, 8, 2), (64, 64, 4, 3)])
# Backward chunk kernels: 4 warps only (fla keeps its chunk backward kernels at 2-4 warps on Hopper).
_BWD_CONFIGS = _configs([(64, 64, 4, 2), (64, 128, 4, 2)])


def _pad(n: int) -> int:
    """A dim rounded up to a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, next_power_of_2(n))


def _prune_configs(configs, named_args, **kwargs):
    """Clamp the tiles to the (padded) dims, keeping the first config of each tile shape (CUDA only).

    fp32 / fp64 inputs (IEEE products) get one config of 32-wide tiles, keeping compile time low.
    """
    if _INTERPRET:
        return configs
    args = {**named_args, **kwargs}
    d_pad, e_pad = _pad(args["D_DIM"]), _pad(args["E_DIM"])
    if args["DOT_PRECISION"] == "ieee":
        block = {"BLOCK_D": min(32, d_pad), "BLOCK_E": min(32, e_pad)}
        return [triton.Config(block, num_warps=4, num_stages=2)]
    pruned = {}
    for c in configs:
        bd, be = min(c.kwargs["BLOCK_D"], d_pad), min(c.kwargs["BLOCK_E"], e_pad)
        pruned.setdefault(
            (bd, be),
            triton.Config({"BLOCK_D": bd, "BLOCK_E": be}, num_warps=c.num_warps, num_stages=c.num_stages),
        )
    return list(pruned.values())


def _bucket(n: int) -> int:
    """Autotune key for the number of (batch, head) pairs: the state scan's parallelism."""
    return min(max(next_power_of_2(max(n, 1)), 16), 1024)


# Dims enter the keys padded (K = 80 tunes like 128); lengths not at all (they only size the grid).
_CHUNK_KEY = ["D_BUCKET", "E_BUCKET", "BLOCK_T", "NORMALIZE"]
_STATE_KEY = ["D_BUCKET", "E_BUCKET", "BLOCK_T", "BH_BUCKET", "REVERSE", "HAS_Z"]
# Runtime ints that must not multiply compilations. The dims D_DIM / E_DIM are left to Triton's
# specialisation (% 16), which keeps masked loads along them vectorised.
_RUNTIME_INTS = ["num_heads", "T", "D_BUCKET", "E_BUCKET", "BH_BUCKET"]

# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------
# Kernel argument lists stay packed (one per line would triple this file's length).
# fmt: off


@triton.jit
def _scaled(x, scale, scale_lo, FP64: tl.constexpr):
    """x * scale; for fp64 the scale arrives as two fp32 halves (Triton passes floats as fp32)."""
    if FP64:
        return x * scale + x * scale_lo
    else:
        return x * scale


@triton.jit
def _own_copy(base, offs_t, offs_d, stride_t, stride_d, T, D_DIM, ACC: tl.constexpr):
    """The (BLOCK_T, BLOCK_D) tile at rows offs_t, columns offs_d, in ACC, from a load of its own.

    For the normaliser's sums (the reverse scan's z, the chunk kernels' q . z) of a tile that is
    also a ``tl.dot`` operand. Summing the dot operand itself is miscompiled by Triton 3.6 on
    Hopper (H200, 2026-11-30: z states 100% off for fp32 with K >= 64, bf16 outputs off by ~0.1
    under the 32-wide state tiles; the interpreter and the unnormalised path were right). The
    ``.cg`` cache modifier makes this a different load op, so the compiler cannot merge it back
    into the dot operand's; the bytes come from L2.
    """
    tile = tl.load(
        base + offs_t[:, None] * stride_t + offs_d[None, :] * stride_d,
        mask=(offs_t < T)[:, None] & (offs_d < D_DIM)[None, :], other=0.0, cache_modifier=".cg"
    )
    return tile.to(ACC)


@triton.jit
def _fp16_range_scale(h_max):
    """The power of two m by which a state with largest magnitude h_max (fp32 scalar) is divided
    before its fp16 rounding: 1 for h_max <= 2^15, else the m that brings h_max into [2^14, 2^15),
    read from h_max's exponent bits (no transcendental, whose rounding could miss by a binade)."""
    binade = (h_max.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # <= h_max
    return tl.where(h_max > 32768.0, binade * (1.0 / 16384.0), 1.0)


@triton.jit
def _state_dot(x, h, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``x @ h`` on the tensor cores for the fused forward's fp32 state h (registers), rounded to
    x's dtype for the product.

    States grow linearly in T, and fp16's 65504 would overflow them: for fp16, h is first divided
    by a power of two m that brings max|h| into [2^14, 2^15) when it exceeds 2^15 (m = 1 otherwise,
    the rounding of an in-range state unchanged), and the product is multiplied back by m in fp32.
    Dividing and multiplying by a power of two is exact, so the result is what fp16 with fp32's
    exponent range would give. (The chunk kernels get their states scaled by
    :func:`chunk_states` instead: the same reduction and cast on a loaded fp32 tile, feeding a
    ``tl.dot``, was miscompiled by Triton 3.6 on the H200, NaN and illegal addresses at K = 273.)
    """
    if x.dtype == tl.float16:
        m = _fp16_range_scale(tl.max(tl.max(tl.abs(h), 1), 0))
        prod = tl.dot(x, (h / m).to(x.dtype), input_precision=DOT_PRECISION, out_dtype=ACC) * m
    else:
        prod = tl.dot(x, h.to(x.dtype), input_precision=DOT_PRECISION, out_dtype=ACC)
    return prod


@triton.jit
def _chunk_program(num_heads, T, E_DIM, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(E tile, chunk, batch, head, batch * H + head, row in the per-chunk buffers) of this program
    of a chunk kernel; grid (cdiv(E, BLOCK_E) * n_chunks, H, B). The E tiles of a chunk are adjacent
    programs (they read the same X, Y tiles, from L2); the long axis is the first (no 65535 limit)."""
    n_e = tl.cdiv(E_DIM, BLOCK_E)
    pid_e = tl.program_id(0) % n_e
    chunk = tl.program_id(0) // n_e
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bh = batch * num_heads + head
    return pid_e, chunk, batch, head, bh, bh * tl.cdiv(T, BLOCK_T) + chunk


@triton.jit
def _chunk_products(
    x_base, y_base, h_base, h_scale_ptr, vec_base, stride_xt, stride_xd, stride_yt, stride_yd, stride_hd,
    stride_he, offs_t, offs_e, T, D_DIM, E_DIM, HAS_VEC: tl.constexpr, H_SCALED: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr
):
    """The three products of one chunk, accumulated over the contraction dim in BLOCK_D tiles.

    X, Y: (T, D) rows offs_t of one head; H: a (D, E) state, columns offs_e, times the scalar at
    h_scale_ptr with H_SCALED (fp16's scaled states, see :func:`chunk_states`); vec: (D,) or unused.
    Returns ``inter = X H`` (BLOCK_T, BLOCK_E), ``intra = X Y^T`` (BLOCK_T, BLOCK_T) unmasked and
    ``xv = X vec`` (BLOCK_T,) (zeros without HAS_VEC), all in ACC. Rows >= T and columns >= D / E
    load as zeros. Y^T is loaded transposed through its strides (no tl.trans).
    """
    t_mask = offs_t < T
    e_mask = offs_e < E_DIM
    inter = tl.zeros([BLOCK_T, BLOCK_E], dtype=ACC)
    intra = tl.zeros([BLOCK_T, BLOCK_T], dtype=ACC)
    xv = tl.zeros([BLOCK_T], dtype=ACC)
    for d0 in range(0, D_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D_DIM
        x = tl.load(
            x_base + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd,
            mask=t_mask[:, None] & d_mask[None, :], other=0.0
        )
        y_t = tl.load(
            y_base + offs_d[:, None] * stride_yd + offs_t[None, :] * stride_yt,
            mask=d_mask[:, None] & t_mask[None, :], other=0.0
        )
        h = tl.load(
            h_base + offs_d[:, None] * stride_hd + offs_e[None, :] * stride_he,
            mask=d_mask[:, None] & e_mask[None, :], other=0.0
        )
        intra = tl.dot(x, y_t, intra, input_precision=DOT_PRECISION, out_dtype=ACC)
        inter = tl.dot(x, h, inter, input_precision=DOT_PRECISION, out_dtype=ACC)
        if HAS_VEC:
            vec = tl.load(vec_base + offs_d, mask=d_mask, other=0.0)
            xv += tl.sum(_own_copy(x_base, offs_t, offs_d, stride_xt, stride_xd, T, D_DIM, ACC) * vec[None, :], 1)
    if H_SCALED:
        inter = inter * tl.load(h_scale_ptr)
    return inter, intra, xv


# ----------------------------------------------------------------------------------------------
# The state scan (forward and reverse)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _z_total(z, z_acc, scale, scale_lo, REVERSE: tl.constexpr, FP64: tl.constexpr):
    """The state kernel's z (or dz) so far: z plus what the tensor cores accumulated in z_acc
    (BLOCK_D, 16): column 0 forward (X^T times ones), columns 0 + 1 in reverse (Q^T times r's hi /
    lo pair), scaled there."""
    z_cols = tl.arange(0, 16)
    if REVERSE:
        return z + _scaled(tl.sum(tl.where(z_cols[None, :] < 2, z_acc, 0.0), 1), scale, scale_lo, FP64)
    else:
        return z + tl.sum(tl.where(z_cols[None, :] == 0, z_acc, 0.0), 1)


@triton.autotune(configs=_STATE_CONFIGS, key=_STATE_KEY, prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def linear_attention_state_kernel(
    X, Y, W, WP, S_IN, Z_IN, STATES, ZSTATES, S_OUT, Z_OUT,
    stride_xb, stride_xt, stride_xh, stride_xd,
    stride_yb, stride_yt, stride_yh, stride_ye,
    stride_sb, stride_sh, stride_sd, stride_se,
    stride_zb, stride_zh, stride_zd,
    num_heads, T, D_DIM, E_DIM, scale, scale_lo, D_BUCKET, E_BUCKET, BH_BUCKET,
    HAS_S_IN: tl.constexpr, HAS_Z_IN: tl.constexpr,
    HAS_Z: tl.constexpr, REVERSE: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Running (D, E) state over the chunks of one head; grid (cdiv(D, BLOCK_D) * max(1, cdiv(E, BLOCK_E)), H, B).

    Forward (REVERSE=False; X = k, Y = v, D = K, E = V, scale = 1): STATES[c] = S_c = S_IN +
    sum_{c' < c} X_{c'}^T Y_{c'}, S_OUT = S_N; with HAS_Z, ZSTATES[c] = z_c = Z_IN + the sum of X's
    rows before chunk c, Z_OUT = z_N.
    Reverse (X = q, Y = G, W = r (B*H, T), WP = r's hi / lo pair (B*H, T, 2) in X's dtype, read
    instead of W unless X is fp16): STATES[c] = dS_c = S_IN + scale sum_{c' > c} X_{c'}^T Y_{c'},
    S_OUT = dS_0; with HAS_Z, ZSTATES[c] = dz_c = Z_IN + scale sum_{t after chunk c} r_t q_t.
    STATES (B*H, n_chunks, D, E) in ``state_dtype``; ZSTATES (B*H, n_chunks, D), S_OUT (B*H, D, E),
    Z_OUT (B*H, D) in the accumulator dtype, all contiguous. S_IN / Z_IN: any strides, any float dtype.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    n_e = tl.maximum(tl.cdiv(E_DIM, BLOCK_E), 1)
    pid_d = tl.program_id(0) // n_e
    pid_e = tl.program_id(0) % n_e
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bh64 = batch * num_heads + head
    n_chunks = tl.cdiv(T, BLOCK_T)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    d_mask = offs_d < D_DIM
    de_mask = d_mask[:, None] & (offs_e < E_DIM)[None, :]
    # Every E tile computes z (a cheap row sum); only the first one stores it. (The pid test is
    # broadcast to a block: the interpreter rejects a scalar bool inside a block mask.)
    z_mask = d_mask & (tl.zeros_like(offs_d) + pid_e == 0)

    s = tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC)
    if HAS_S_IN:
        s = tl.load(
            S_IN + batch * stride_sb + head * stride_sh + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
            mask=de_mask, other=0.0
        ).to(ACC)
    z = tl.zeros([BLOCK_D], dtype=ACC)
    # Forward: the chunks' row sums of X come from the tensor cores, X_c^T times a (BLOCK_T, 16)
    # tile of ones, accumulated over the chunks in fp32 like S (every column of z_acc is the
    # running sum; z adds column 0). Summing X_c^T itself (tl.sum of a dot operand) is miscompiled
    # by Triton 3.6 on Hopper, and its own reload (_own_copy) sat on this sequential loop's path:
    # 1.51x the unnormalised forward at B2 T8192 H16 D128 on the H200, 1.12x with the dot.
    z_cols = tl.arange(0, 16)
    z_acc = tl.zeros([BLOCK_D, 16], dtype=ACC)
    ones = tl.full([BLOCK_T, 16], 1.0, dtype=X.dtype.element_ty)
    if HAS_Z and HAS_Z_IN:
        z = tl.load(Z_IN + batch * stride_zb + head * stride_zh + offs_d * stride_zd, mask=d_mask, other=0.0).to(ACC)

    x_base = X + batch * stride_xb + head * stride_xh
    y_base = Y + batch * stride_yb + head * stride_yh
    state_offs = offs_d[:, None] * E_DIM + offs_e[None, :]
    for i in range(0, n_chunks):
        if REVERSE:
            chunk = n_chunks - 1 - i
        else:
            chunk = i
        row = bh64 * n_chunks + chunk
        tl.store(STATES + row * (D_DIM * E_DIM) + state_offs, s.to(STATES.dtype.element_ty), mask=de_mask)
        if HAS_Z:
            tl.store(ZSTATES + row * D_DIM + offs_d, _z_total(z, z_acc, scale, scale_lo, REVERSE, FP64), mask=z_mask)
        offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        x_t = tl.load(
            x_base + offs_d[:, None] * stride_xd + offs_t[None, :] * stride_xt,
            mask=d_mask[:, None] & t_mask[None, :], other=0.0
        )  # (BLOCK_D, BLOCK_T): X_c^T through its strides
        y = tl.load(
            y_base + offs_t[:, None] * stride_yt + offs_e[None, :] * stride_ye,
            mask=t_mask[:, None] & (offs_e < E_DIM)[None, :], other=0.0
        )
        if REVERSE:
            s += _scaled(tl.dot(x_t, y, input_precision=DOT_PRECISION, out_dtype=ACC), scale, scale_lo, FP64)
            if HAS_Z:
                if X.dtype.element_ty == tl.float16:
                    # fp16's 65504 range cannot hold r: the elementwise sum over a reload of Q_c.
                    w = tl.load(W + bh64 * T + offs_t, mask=t_mask, other=0.0)
                    z += _scaled(tl.sum(_own_copy(x_base, offs_t, offs_d, stride_xt, stride_xd, T, D_DIM, ACC) * w[:, None], 0),
                                 scale, scale_lo, FP64)
                else:
                    # sum_t r_t q_t = Q_c^T r on the tensor cores, r as the preprocess kernel's hi /
                    # lo pair loaded into columns 0 and 1 of a (BLOCK_T, 16) tile in X's dtype (hi + lo = r
                    # to ~16 bits in bf16, exact in fp32 / fp64; r rounded to bf16 alone would add
                    # 2^-9 relative error per term). The pair is loaded, not built here: built in
                    # registers, the operand made Triton 3.6 access memory illegally on the H200
                    # (2026-12-02). The fp16 path's reload and elementwise product sat on the scan's
                    # sequential path: at B2 T8192 H16 D128 (H200, 2026-12-02, bf16) the reverse scan
                    # took 192.5 us that way (88.1 us without the normaliser); with the dot the
                    # normalised forward + backward went from 812 to 699 us (unnormalised 545).
                    w_pair = tl.load(WP + (bh64 * T + offs_t)[:, None] * 2 + z_cols[None, :],
                                     mask=t_mask[:, None] & (z_cols[None, :] < 2), other=0.0)
                    z_acc = tl.dot(x_t, w_pair, z_acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        else:
            s = tl.dot(x_t, y, s, input_precision=DOT_PRECISION, out_dtype=ACC)
            if HAS_Z:
                z_acc = tl.dot(x_t, ones, z_acc, input_precision=DOT_PRECISION, out_dtype=ACC)

    tl.store(S_OUT + bh64 * (D_DIM * E_DIM) + state_offs, s, mask=de_mask)
    if HAS_Z:
        tl.store(Z_OUT + bh64 * D_DIM + offs_d, _z_total(z, z_acc, scale, scale_lo, REVERSE, FP64), mask=z_mask)


# ----------------------------------------------------------------------------------------------
# Forward output
# ----------------------------------------------------------------------------------------------


@triton.autotune(configs=_FWD_CONFIGS, key=_CHUNK_KEY, prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def linear_attention_fwd_kernel(
    Q, K, V, STATES, SSCALES, ZSTATES, Out, DEN,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    num_heads, T, D_DIM, E_DIM, scale, scale_lo, eps, D_BUCKET, E_BUCKET,
    NORMALIZE: tl.constexpr, H_SCALED: tl.constexpr, FP64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """O_c = scale (Q_c S_c + (Q_c K_c^T * M) V_c) [/ den] for one (V tile, chunk, batch * head);
    grid (cdiv(V, BLOCK_E) * n_chunks, H, B); D = K, E = V. S_c = STATES[c] (times SSCALES[c] with
    H_SCALED: fp16, see :func:`chunk_states`; the backward's kernels read their states alike).

    With NORMALIZE, den = scale (rowsum(Q_c K_c^T * M) + Q_c z_c) + eps is also written to DEN
    (B*H, T) by the first V tile's programs.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_e, chunk, batch, head, bh64, row = _chunk_program(num_heads, T, E_DIM, BLOCK_T, BLOCK_E)
    offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    out_mask = (offs_t < T)[:, None] & (offs_e < E_DIM)[None, :]

    inter, scores, qz = _chunk_products(
        Q + batch * stride_qb + head * stride_qh, K + batch * stride_kb + head * stride_kh,
        STATES + row * (D_DIM * E_DIM), SSCALES + row, ZSTATES + row * D_DIM, stride_qt, stride_qd, stride_kt,
        stride_kd, E_DIM, 1, offs_t, offs_e, T, D_DIM, E_DIM, NORMALIZE, H_SCALED, ACC, DOT_PRECISION, BLOCK_T,
        BLOCK_D, BLOCK_E
    )
    # Query t sees keys s <= t of its chunk; earlier chunks are in S_c.
    scores = tl.where(offs_t[:, None] >= offs_t[None, :], scores, 0.0)
    v = tl.load(
        V + batch * stride_vb + head * stride_vh + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_vd,
        mask=out_mask, other=0.0
    )
    o = _scaled(tl.dot(scores.to(v.dtype), v, inter, input_precision=DOT_PRECISION, out_dtype=ACC), scale, scale_lo, FP64)
    if NORMALIZE:
        # The in-chunk part of q_t . z_t is the row sum of the masked scores, taken in fp32 before
        # they are rounded for the product with V.
        den = _scaled(tl.sum(scores, 1) + qz, scale, scale_lo, FP64) + eps
        den = tl.where(offs_t < T, den, 1.0)  # padding rows (never stored) must not divide 0 by 0
        o = o / den[:, None]
        tl.store(DEN + bh64 * T + offs_t, den, mask=(offs_t < T) & (tl.zeros_like(offs_t) + pid_e == 0))
    tl.store(
        Out + batch * stride_ob + head * stride_oh + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_od,
        o.to(Out.dtype.element_ty), mask=out_mask
    )


# ----------------------------------------------------------------------------------------------
# Fused forward (K <= 128): segment sums, then one scan-and-output kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _chunk_z_program(
    K, Z_IN, ZC, ZW, ZEND, pid, head, bh, stride_kb, stride_kt, stride_kh, stride_kd,
    stride_zb, stride_zh, stride_zd, batch, T, D_DIM, chunks_per_part,
    IN_PARTS: tl.constexpr, HAS_Z_IN: tl.constexpr, STORE_Z: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, Z_STEP: tl.constexpr,
):  # fmt: skip
    """z before each chunk for rows offs_d of K (``pid`` % cdiv(D, BLOCK_D)) over the chunks of part
    ``pid`` // cdiv(D, BLOCK_D) (``chunks_per_part`` chunks a part; see :func:`chunk_z_parts`), stored
    in one of two schemes:

    - one walk (not IN_PARTS: one part, the whole sequence): z_0 = Z_IN (or 0); ZC[bh, c] (D, 2) =
      z_c as a (hi, lo) pair in K's dtype (lo = z_c - hi, zero for fp32 / fp64), ZW[bh, c] (D,) = z_c
      in ACC with STORE_Z (the saved zstates), ZEND[bh] (D,) = the final z (Z_OUT).
    - IN_PARTS: z counted from the part's start: ZW[bh, c] (D,) = z within the part, ZEND[bh, part]
      (D,) = the part's sum, both in ACC (B*H, n_chunks, D) and (B*H, n_parts, D);
      :func:`linear_attention_chunk_z_kernel` adds Z_IN and the earlier parts' sums and writes ZC,
      the zstates and the final z.

    The sums run on the tensor cores, Z_STEP chunks a step: K^T of the step's (Z_STEP * BLOCK_T)
    tokens times an indicator whose column j marks the tokens of the step's chunks before its j-th
    gives, added to z (held in every column of a (BLOCK_D, 16) accumulator), z before each of the
    step's chunks in its own column, and K^T times ones moves z past the step. Neither product reads
    z, so the chain from step to step is one addition, not a product (CHUNK_Z_STEP gives the
    timings)."""
    n_chunks = tl.cdiv(T, BLOCK_T)
    n_d = tl.cdiv(D_DIM, BLOCK_D)
    part = pid // n_d
    offs_d = (pid % n_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_DIM
    z_cols = tl.arange(0, 16)
    z_acc = tl.zeros([BLOCK_D, 16], dtype=ACC)
    if HAS_Z_IN and not IN_PARTS:  # in parts, the chunk-z kernel adds Z_IN to every part
        z_in = tl.load(Z_IN + batch * stride_zb + head * stride_zh + offs_d * stride_zd, mask=d_mask,
                       other=0.0)  # fmt: skip
        z_acc += z_in.to(ACC)[:, None]
    rows = tl.arange(0, Z_STEP * BLOCK_T)
    before = ((rows // BLOCK_T)[:, None] < z_cols[None, :]).to(K.dtype.element_ty)  # (Z_STEP * BLOCK_T, 16)
    ones = tl.full([Z_STEP * BLOCK_T, 16], 1.0, dtype=K.dtype.element_ty)
    k_base = K + batch * stride_kb + head * stride_kh
    first = part * chunks_per_part
    last = tl.minimum(first + chunks_per_part, n_chunks)
    for step in range(0, tl.cdiv(last - first, Z_STEP)):
        chunk0 = first + step * Z_STEP
        offs_t = chunk0 * BLOCK_T + rows
        k_t = tl.load(
            k_base + offs_d[:, None] * stride_kd + offs_t[None, :] * stride_kt,
            mask=d_mask[:, None] & (offs_t < tl.minimum(last * BLOCK_T, T))[None, :], other=0.0
        )  # (BLOCK_D, Z_STEP * BLOCK_T): K^T of the step through its strides, none past the part
        # column j: z before the step's chunk j
        z_c = z_acc + tl.dot(k_t, before, input_precision=DOT_PRECISION, out_dtype=ACC)
        chunk = chunk0 + z_cols
        col_mask = d_mask[:, None] & ((z_cols < Z_STEP) & (chunk < last))[None, :]
        # (BLOCK_D, 16): where z_c of the step's chunks sits in (B*H, n_chunks, D)
        z_offs = (bh * n_chunks + chunk[None, :]) * D_DIM + offs_d[:, None]
        if not IN_PARTS:  # z_c is final: the fused forward's operand now
            hi = z_c.to(ZC.dtype.element_ty)
            tl.store(ZC + z_offs * 2, hi, mask=col_mask)
            tl.store(ZC + z_offs * 2 + 1, (z_c - hi.to(ACC)).to(ZC.dtype.element_ty), mask=col_mask)
        if IN_PARTS or STORE_Z:  # in parts, the chunk-z kernel still has to add the earlier parts
            tl.store(ZW + z_offs, z_c, mask=col_mask)
        z_acc += tl.dot(k_t, ones, input_precision=DOT_PRECISION, out_dtype=ACC)
    n_parts = tl.cdiv(n_chunks, chunks_per_part)  # one walk: 1, and ZEND[bh] is the final z
    tl.store(ZEND + (bh * n_parts + part) * D_DIM + offs_d[:, None] + z_cols[None, :], z_acc,
             mask=d_mask[:, None] & (z_cols[None, :] == 0))


@triton.jit(do_not_specialize=["num_heads", "T", "chunks_per_seg", "n_prev", "chunks_per_part"])
def linear_attention_segment_kernel(
    K, V, SEG, ZSEG, Z_IN, ZC, ZW, ZEND,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_ve,
    stride_zb, stride_zh, stride_zd,
    num_heads, T, D_DIM, E_DIM, chunks_per_seg, n_prev, chunks_per_part,
    HAS_Z: tl.constexpr, CHUNK_Z: tl.constexpr, IN_PARTS: tl.constexpr, HAS_Z_IN: tl.constexpr,
    STORE_Z: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, Z_BLOCK_D: tl.constexpr,
    Z_STEP: tl.constexpr,
):  # fmt: skip
    """SEG[bh, g] = sum over the chunks of segment g of K_c^T V_c (and ZSEG[bh, g] = the sum of those
    rows of K with HAS_Z), in the accumulator dtype, for the ``n_prev`` = n_seg - 1 first segments
    (the last segment's sum is never needed): the first cdiv(D, BLOCK_D) * cdiv(E, BLOCK_E) * n_prev
    programs of axis 0. SEG (B*H, n_prev, D, E) and ZSEG (B*H, n_prev, D) contiguous. Segments hold
    ``chunks_per_seg`` chunks of BLOCK_T tokens. With CHUNK_Z, cdiv(D, Z_BLOCK_D) * n_parts more
    programs on axis 0 write the normaliser's z before every chunk for the fused forward
    (:func:`_chunk_z_program`, parts of ``chunks_per_part`` chunks): with one part (not IN_PARTS) the
    finished z_c to ZC (B*H, n_chunks, D, 2) and, with STORE_Z, ZW (B*H, n_chunks, D), the final z to
    ZEND (B*H, D), from Z_IN with HAS_Z_IN; IN_PARTS, z within its part to ZW and each part's sum to
    ZEND (B*H, n_parts, D), for :func:`linear_attention_chunk_z_kernel`. Grid (that total, H, B).
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    n_d = tl.cdiv(D_DIM, BLOCK_D)
    n_e = tl.cdiv(E_DIM, BLOCK_E)
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bh = batch * num_heads + head
    n_kv = n_d * n_e * n_prev
    if CHUNK_Z and pid >= n_kv:
        _chunk_z_program(
            K, Z_IN, ZC, ZW, ZEND, pid - n_kv, head, bh, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_zb, stride_zh, stride_zd, batch, T, D_DIM, chunks_per_part,
            IN_PARTS, HAS_Z_IN, STORE_Z, ACC, DOT_PRECISION, BLOCK_T, Z_BLOCK_D, Z_STEP,
        )  # fmt: skip
    else:
        pid_e = pid % n_e
        pid_d = (pid // n_e) % n_d
        seg = pid // (n_e * n_d)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        d_mask = offs_d < D_DIM
        z_cols = tl.arange(0, 16)
        # The row sums of K come from the tensor cores (see the state kernel): K_c^T times a
        # (BLOCK_T, 16) tile whose column 0 is ones and the rest zeros, so z is the sum of z_acc's row.
        ones = tl.where(z_cols[None, :] == 0, tl.full([BLOCK_T, 16], 1.0, dtype=ACC), 0.0).to(K.dtype.element_ty)
        s = tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC)
        z_acc = tl.zeros([BLOCK_D, 16], dtype=ACC)
        k_base = K + batch * stride_kb + head * stride_kh
        v_base = V + batch * stride_vb + head * stride_vh
        first = seg * chunks_per_seg
        for chunk in range(first, first + chunks_per_seg):
            offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
            t_mask = offs_t < T
            k_t = tl.load(
                k_base + offs_d[:, None] * stride_kd + offs_t[None, :] * stride_kt,
                mask=d_mask[:, None] & t_mask[None, :], other=0.0
            )  # (BLOCK_D, BLOCK_T): K_c^T through its strides
            v = tl.load(
                v_base + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                mask=t_mask[:, None] & (offs_e < E_DIM)[None, :], other=0.0
            )
            s = tl.dot(k_t, v, s, input_precision=DOT_PRECISION, out_dtype=ACC)
            if HAS_Z:
                z_acc += tl.dot(k_t, ones, input_precision=DOT_PRECISION, out_dtype=ACC)
        row = bh * n_prev + seg
        tl.store(
            SEG + row * (D_DIM * E_DIM) + offs_d[:, None] * E_DIM + offs_e[None, :], s,
            mask=d_mask[:, None] & (offs_e < E_DIM)[None, :]
        )
        if HAS_Z:
            tl.store(ZSEG + row * D_DIM + offs_d, tl.sum(z_acc, 1), mask=d_mask & (tl.zeros_like(offs_d) + pid_e == 0))


@triton.jit(do_not_specialize=["num_heads", "n_chunks", "chunks_per_part"])
def linear_attention_chunk_z_kernel(
    ZW, ZPART, Z_IN, ZC, Z_OUT,
    stride_zb, stride_zh, stride_zd,
    num_heads, D_DIM, n_chunks, chunks_per_part,
    HAS_Z_IN: tl.constexpr, STORE_Z: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """z before every chunk from the segment kernel's per-part sums, when its z programs walk parts
    (IN_PARTS: see :func:`chunk_z_parts`); one program per BLOCK_C chunks of a part, grid (n_parts *
    cdiv(chunks_per_part, BLOCK_C), H, B); BLOCK_D >= D, BLOCK_P >= n_parts.

    With base = Z_IN[b, h] (or 0) plus ZPART[bh, p] (B*H, n_parts, D) for every part p before this
    one, z_c = base + ZW[bh, c] (B*H, n_chunks, D) for the program's chunks: to ZC[bh, c] (B*H,
    n_chunks, D, 2) as a (hi, lo) pair in ZC's dtype (lo = z_c - hi, zero for fp32 / fp64) for the
    fused forward's q . z_c, and back to ZW with STORE_Z (ZW is then the saved zstates). The first
    program of the last part writes the final z, base plus its part's sum, to Z_OUT (B*H, D).
    Elementwise: the split into parts is what lets the z programs walk the sequence in parallel.
    """
    blocks_per_part = tl.cdiv(chunks_per_part, BLOCK_C)
    part = tl.program_id(0) // blocks_per_part
    n_parts = tl.cdiv(n_chunks, chunks_per_part)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bh = batch * num_heads + head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_DIM
    # The parts' sums up to this program's part in one load, (BLOCK_P, BLOCK_D): a loop over the earlier
    # parts would chain their loads (each chunk-z program summed them one by one: 13.5 us at B2 T8192
    # H16 in 4 parts, H100).
    offs_p = tl.arange(0, BLOCK_P)
    sums = tl.load(ZPART + (bh * n_parts + offs_p[:, None]) * D_DIM + offs_d[None, :],
                   mask=(offs_p <= part)[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    base = tl.sum(tl.where((offs_p < part)[:, None], sums, 0.0), 0)  # (BLOCK_D,)
    if HAS_Z_IN:
        base += tl.load(Z_IN + batch * stride_zb + head * stride_zh + offs_d * stride_zd, mask=d_mask,
                        other=0.0).to(base.dtype)  # fmt: skip
    block = part * chunks_per_part + (tl.program_id(0) % blocks_per_part) * BLOCK_C
    last = tl.minimum((part + 1) * chunks_per_part, n_chunks)
    offs_c = block + tl.arange(0, BLOCK_C)
    rows = bh * n_chunks + offs_c
    mask = (offs_c < last)[:, None] & d_mask[None, :]
    zw_ptr = ZW + rows[:, None] * D_DIM + offs_d[None, :]
    z_c = tl.load(zw_ptr, mask=mask, other=0.0) + base[None, :]  # (BLOCK_C, BLOCK_D)
    hi = z_c.to(ZC.dtype.element_ty)
    zc_ptr = ZC + (rows[:, None] * D_DIM + offs_d[None, :]) * 2
    tl.store(zc_ptr, hi, mask=mask)
    tl.store(zc_ptr + 1, (z_c - hi.to(z_c.dtype)).to(ZC.dtype.element_ty), mask=mask)
    if STORE_Z:
        tl.store(zw_ptr, z_c, mask=mask)
    if (part == n_parts - 1) & (block == part * chunks_per_part):
        total = base + tl.sum(tl.where((offs_p == part)[:, None], sums, 0.0), 0)
        tl.store(Z_OUT + bh * D_DIM + offs_d, total, mask=d_mask)


@triton.jit(do_not_specialize=["num_heads", "T", "chunks_per_seg"])
def linear_attention_fused_fwd_kernel(
    Q, K, V, S_IN, Z_IN, SEG, ZSEG, STATES, ZSTATES, Out, DEN, S_OUT, Z_OUT, ZC,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_ve,
    stride_ob, stride_ot, stride_oh, stride_oe,
    stride_sb, stride_sh, stride_sd, stride_se,
    stride_zb, stride_zh, stride_zd,
    num_heads, T, D_DIM, E_DIM, chunks_per_seg, scale, scale_lo, eps,
    HAS_S_IN: tl.constexpr, HAS_Z_IN: tl.constexpr, NORMALIZE: tl.constexpr, STORE_STATES: tl.constexpr,
    FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, ZC_LOADED: tl.constexpr, LATE_STATE_STORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """The state scan and the output of one (V tile, segment, batch * head) in one pass; grid
    (cdiv(E, BLOCK_E) * n_seg, H, B), BLOCK_D >= D (the whole (D, BLOCK_E) state stays in registers).

    S starts as S_IN plus SEG[bh, g'] for every earlier segment g' (z likewise), then for each chunk
    c of the segment: O_c = scale (Q_c S_c + (Q_c K_c^T * M) V_c) [/ den], S_{c+1} = S_c + K_c^T V_c.
    The last segment writes the final S_OUT (B*H, D, E) and, z carried, Z_OUT (B*H, D) in the
    accumulator dtype.
    With STORE_STATES, S_c (``state_dtype``) and z_c (accumulator dtype) go to STATES (B*H, n_chunks,
    D, E) / ZSTATES (B*H, n_chunks, D) for the backward (S_c at the end of chunk c - 1 with
    LATE_STATE_STORE); with NORMALIZE, den to DEN (B*H, T). With ZC_LOADED, z_c comes from ZC
    (B*H, n_chunks, D, 2), written with ZSTATES and Z_OUT by the segment kernel's z programs (one
    walk) or by linear_attention_chunk_z_kernel (parts; see :func:`chunk_z_parts`).
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    # z carried in registers through the chunks, or each chunk's z loaded (ZC_LOADED, summed by the
    # segment kernel's z programs, and completed by linear_attention_chunk_z_kernel in parts).
    Z_CARRIED: tl.constexpr = NORMALIZE and not ZC_LOADED
    n_e = tl.cdiv(E_DIM, BLOCK_E)
    pid_e = tl.program_id(0) % n_e
    seg = tl.program_id(0) // n_e
    n_seg = tl.num_programs(0) // n_e
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bh = batch * num_heads + head
    n_chunks = tl.cdiv(T, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    d_mask = offs_d < D_DIM
    e_mask = offs_e < E_DIM
    de_mask = d_mask[:, None] & e_mask[None, :]
    z_first = d_mask & (tl.zeros_like(offs_d) + pid_e == 0)  # z is stored by the first V tile only
    state_offs = offs_d[:, None] * E_DIM + offs_e[None, :]

    s = tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC)
    z = tl.zeros([BLOCK_D], dtype=ACC)
    if HAS_S_IN:
        s = tl.load(
            S_IN + batch * stride_sb + head * stride_sh + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
            mask=de_mask, other=0.0
        ).to(ACC)
    if Z_CARRIED and HAS_Z_IN:
        z = tl.load(Z_IN + batch * stride_zb + head * stride_zh + offs_d * stride_zd, mask=d_mask, other=0.0).to(ACC)
    for prev in range(0, seg):
        row = bh * (n_seg - 1) + prev
        s += tl.load(SEG + row * (D_DIM * E_DIM) + state_offs, mask=de_mask, other=0.0)
        if Z_CARRIED:
            z += tl.load(ZSEG + row * D_DIM + offs_d, mask=d_mask, other=0.0)
    # z rides in column 0 of a (BLOCK_D, 16) tile that the tensor cores update (the segment kernel's
    # ones trick); tl.sum(z_acc, 1) reads it back.
    z_cols = tl.arange(0, 16)
    z_acc = tl.where(z_cols[None, :] == 0, z[:, None], 0.0)
    ones = tl.where(z_cols[None, :] == 0, tl.full([BLOCK_T, 16], 1.0, dtype=ACC), 0.0).to(K.dtype.element_ty)
    zc_cols = tl.arange(0, 64)

    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    o_base = Out + batch * stride_ob + head * stride_oh
    first = seg * chunks_per_seg
    last = tl.minimum(first + chunks_per_seg, n_chunks)
    if STORE_STATES and LATE_STATE_STORE:
        tl.store(STATES + (bh * n_chunks + first) * (D_DIM * E_DIM) + state_offs, s.to(STATES.dtype.element_ty),
                 mask=(de_mask & (first < last)) != 0)  # != 0: the interpreter makes the & int32
    for chunk in range(first, last):
        offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        q = tl.load(
            q_base + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
            mask=t_mask[:, None] & d_mask[None, :], other=0.0
        )
        k_t = tl.load(
            k_base + offs_d[:, None] * stride_kd + offs_t[None, :] * stride_kt,
            mask=d_mask[:, None] & t_mask[None, :], other=0.0
        )  # (BLOCK_D, BLOCK_T): K_c^T through its strides, operand of both Q K^T and K^T V
        v = tl.load(
            v_base + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
            mask=t_mask[:, None] & e_mask[None, :], other=0.0
        )
        # S_c as the state kernel of the two-kernel path writes it (``state_dtype``: fp32 for fp16).
        if STORE_STATES:
            if not LATE_STATE_STORE:
                tl.store(STATES + (bh * n_chunks + chunk) * (D_DIM * E_DIM) + state_offs,
                         s.to(STATES.dtype.element_ty), mask=de_mask)
            if Z_CARRIED:
                tl.store(ZSTATES + (bh * n_chunks + chunk) * D_DIM + offs_d, tl.sum(z_acc, 1), mask=z_first)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION, out_dtype=ACC)
        scores = tl.where(offs_t[:, None] >= offs_t[None, :], scores, 0.0)
        if NORMALIZE:
            # den before O_c's products, so the fp32 scores die at their 16-bit cast instead of
            # living across two dots: at K = 128 and 4 warps the spills halved (136 -> 72 bytes a
            # thread, Triton 3.9) and the forward storing states took 223 instead of 246 us at B2
            # T8192 H16 (H200, 2026-12-02; without autograd 176 either way). 8 warps, 32- or
            # 128-wide V tiles and 2 stages were all slower (219-350 us).
            # q . z_c on the tensor cores, the in-chunk part from the fp32 masked scores.
            if ZC_LOADED:
                # z_c's hi / lo pair as columns 0 and 1 of a loaded (BLOCK_D, 16) operand: q . hi +
                # q . lo in fp32 is q . z_c to about 16 bits in bf16.
                zc = tl.load(
                    ZC + ((bh * n_chunks + chunk) * D_DIM + offs_d[:, None]) * 2 + z_cols[None, :],
                    mask=d_mask[:, None] & (z_cols[None, :] < 2), other=0.0
                )
                qz = tl.sum(tl.dot(q, zc, input_precision=DOT_PRECISION, out_dtype=ACC), 1)
            else:
                # z grows linearly in T, so its fp16 copy is z / max|z| (no overflow past 65504,
                # relative rounding as for S_c), rescaled in the accumulator. bf16 has fp32's exponent
                # range: its copy is z itself, the same relative rounding without the cross-warp max
                # (which cost 36 us of 277 at B2 T8192 H16 D128; H200, 2026-12-02). z_c is a 64-wide
                # operand with z in column 0: as 16- or 32-wide operands built in registers, Triton
                # 3.6 miscompiled the product on the H200 (wrong values, NaN; 2026-12-01 and -02).
                z_now = tl.sum(z_acc, 1)
                if Q.dtype.element_ty == tl.float16:
                    z_max = tl.max(tl.abs(z_now), 0)
                    z_max = tl.where(z_max > 0, z_max, 1.0)
                else:
                    z_max = 1.0
                z_c = tl.where(zc_cols[None, :] == 0, (z_now / z_max)[:, None], 0.0).to(Q.dtype.element_ty)
                qz = tl.sum(tl.dot(q, z_c, input_precision=DOT_PRECISION, out_dtype=ACC), 1) * z_max
            den = _scaled(tl.sum(scores, 1) + qz, scale, scale_lo, FP64) + eps
            den = tl.where(t_mask, den, 1.0)  # padding rows (never stored) must not divide 0 by 0
            tl.store(DEN + bh * T + offs_t, den, mask=t_mask & (tl.zeros_like(offs_t) + pid_e == 0))
            if Z_CARRIED:
                z_acc += tl.dot(k_t, ones, input_precision=DOT_PRECISION, out_dtype=ACC)
        o = _state_dot(q, s, ACC, DOT_PRECISION)
        o = _scaled(tl.dot(scores.to(v.dtype), v, o, input_precision=DOT_PRECISION, out_dtype=ACC), scale, scale_lo, FP64)
        if NORMALIZE:
            o = o / den[:, None]
        tl.store(o_base + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_oe, o.to(Out.dtype.element_ty),
                 mask=t_mask[:, None] & e_mask[None, :])
        s = tl.dot(k_t, v, s, input_precision=DOT_PRECISION, out_dtype=ACC)
        if STORE_STATES and LATE_STATE_STORE:
            # Not past the segment: the next segment's program stores its own first state. (A scalar
            # in the mask: as an if or a vector, the kernel spilled at K = 128, 56 / 32 bytes a
            # thread normalised.)
            tl.store(STATES + (bh * n_chunks + chunk + 1) * (D_DIM * E_DIM) + state_offs,
                     s.to(STATES.dtype.element_ty), mask=(de_mask & (chunk + 1 < last)) != 0)

    if seg == n_seg - 1:
        tl.store(S_OUT + bh * (D_DIM * E_DIM) + state_offs, s, mask=de_mask)
        if Z_CARRIED:
            tl.store(Z_OUT + bh * D_DIM + offs_d, tl.sum(z_acc, 1), mask=z_first)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_heads", "T"])
def linear_attention_bwd_preprocess_kernel(
    DO, Out, DEN, G, R, RP,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_gb, stride_gt, stride_gh, stride_gd,
    num_heads, T, E_DIM,
    FP64: tl.constexpr, PAIR: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """G = dO / den and r = -rowsum(dO * O) / den (normalize only); grid (cdiv(T, BLOCK_T), H, B).

    O = N / den, so dL/dN = dO / den and dL/dden = -rowsum(dO * N) / den^2 = -rowsum(dO * O) / den.
    G (B, T, H, V) in the input dtype; R (B*H, T) in the accumulator dtype. With PAIR, also RP
    (B*H, T, 2) in G's dtype: r as hi = r rounded and lo = (r - hi) rounded, which the reverse scan
    loads as columns 0 and 1 of its dz product's (BLOCK_T, 16) operand (the rest masked to zeros;
    a (B*H, T, 16) pair holding the zeros was 8 MB more written and read at B2 T8192 H16).
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    t_mask = offs_t < T
    row = (batch * num_heads + head) * T
    den = tl.load(DEN + row + offs_t, mask=t_mask, other=1.0)
    r = tl.zeros([BLOCK_T], dtype=ACC)
    for e0 in range(0, E_DIM, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        mask = t_mask[:, None] & (offs_e < E_DIM)[None, :]
        do = tl.load(
            DO + batch * stride_dob + head * stride_doh + offs_t[:, None] * stride_dot + offs_e[None, :] * stride_dod,
            mask=mask, other=0.0
        ).to(ACC)
        o = tl.load(
            Out + batch * stride_ob + head * stride_oh + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_od,
            mask=mask, other=0.0
        ).to(ACC)
        r += tl.sum(do * o, 1)
        tl.store(
            G + batch * stride_gb + head * stride_gh + offs_t[:, None] * stride_gt + offs_e[None, :] * stride_gd,
            (do / den[:, None]).to(G.dtype.element_ty), mask=mask
        )
    r = -r / den
    tl.store(R + row + offs_t, r, mask=t_mask)
    if PAIR:
        cols = tl.arange(0, 2)
        hi = r.to(G.dtype.element_ty).to(ACC)
        lo = (r - hi).to(G.dtype.element_ty).to(ACC)
        pair = tl.where(cols[None, :] == 0, hi[:, None], lo[:, None])
        tl.store(RP + (row + offs_t)[:, None] * 2 + cols[None, :], pair.to(G.dtype.element_ty),
                 mask=t_mask[:, None])


@triton.autotune(configs=_BWD_CONFIGS, key=_CHUNK_KEY, prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def linear_attention_bwd_dq_kernel(
    G, V, K, STATES, SSCALES, ZSTATES, R, DQ,
    stride_gb, stride_gt, stride_gh, stride_gd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    num_heads, T, D_DIM, E_DIM, scale, scale_lo, D_BUCKET, E_BUCKET,
    NORMALIZE: tl.constexpr, H_SCALED: tl.constexpr, FP64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """dQ_c = scale (G_c S_c^T + ((G_c V_c^T + r 1^T) * M) K_c + r z_c^T) for one (K tile, chunk,
    batch * head); grid (cdiv(K, BLOCK_E) * n_chunks, H, B); D = V, E = K.

    The r terms (NORMALIZE) are the denominator's: d den_t / d q_t = scale z_t, z_t = z_c + the keys
    s <= t of the chunk.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_e, chunk, batch, head, bh64, row = _chunk_program(num_heads, T, E_DIM, BLOCK_T, BLOCK_E)
    offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e < E_DIM
    out_mask = t_mask[:, None] & e_mask[None, :]

    # S_c is stored (K, V): read as (V, K) = S_c^T through swapped strides.
    inter, dp, _ = _chunk_products(
        G + batch * stride_gb + head * stride_gh, V + batch * stride_vb + head * stride_vh,
        STATES + row * (D_DIM * E_DIM), SSCALES + row, ZSTATES, stride_gt, stride_gd, stride_vt, stride_vd,
        1, D_DIM, offs_t, offs_e, T, D_DIM, E_DIM, False, H_SCALED, ACC, DOT_PRECISION, BLOCK_T, BLOCK_D, BLOCK_E
    )
    if NORMALIZE:
        r = tl.load(R + bh64 * T + offs_t, mask=t_mask, other=0.0)
        dp += r[:, None]
    dp = tl.where(offs_t[:, None] >= offs_t[None, :], dp, 0.0)
    k = tl.load(
        K + batch * stride_kb + head * stride_kh + offs_t[:, None] * stride_kt + offs_e[None, :] * stride_kd,
        mask=out_mask, other=0.0
    )
    dq = tl.dot(dp.to(k.dtype), k, inter, input_precision=DOT_PRECISION, out_dtype=ACC)
    if NORMALIZE:
        z = tl.load(ZSTATES + row * E_DIM + offs_e, mask=e_mask, other=0.0)
        dq += r[:, None] * z[None, :]
    dq = _scaled(dq, scale, scale_lo, FP64)
    tl.store(
        DQ + batch * stride_dqb + head * stride_dqh + offs_t[:, None] * stride_dqt + offs_e[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=out_mask
    )


@triton.autotune(configs=_BWD_CONFIGS, key=_CHUNK_KEY, prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def linear_attention_bwd_dk_kernel(
    V, G, Q, DSTATES, SSCALES, DZSTATES, R, DK,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_gb, stride_gt, stride_gh, stride_gd,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_dkb, stride_dkt, stride_dkh, stride_dkd,
    num_heads, T, D_DIM, E_DIM, scale, scale_lo, D_BUCKET, E_BUCKET,
    NORMALIZE: tl.constexpr, H_SCALED: tl.constexpr, FP64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """dK_c = V_c dS_c^T + scale ((V_c G_c^T + 1 r^T) * M^T) Q_c + dz_c for one (K tile, chunk,
    batch * head); grid (cdiv(K, BLOCK_E) * n_chunks, H, B); D = V, E = K.

    Key s is seen by the queries t >= s of its chunk (M^T) and by every later chunk (dS_c, dz_c).
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_e, chunk, batch, head, bh64, row = _chunk_program(num_heads, T, E_DIM, BLOCK_T, BLOCK_E)
    offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e < E_DIM
    out_mask = t_mask[:, None] & e_mask[None, :]

    # (V G^T)[s, t] computed in this orientation rather than transposing G V^T (see the module notes).
    inter, dp_t, _ = _chunk_products(
        V + batch * stride_vb + head * stride_vh, G + batch * stride_gb + head * stride_gh,
        DSTATES + row * (D_DIM * E_DIM), SSCALES + row, DZSTATES, stride_vt, stride_vd, stride_gt, stride_gd,
        1, D_DIM, offs_t, offs_e, T, D_DIM, E_DIM, False, H_SCALED, ACC, DOT_PRECISION, BLOCK_T, BLOCK_D, BLOCK_E
    )
    if NORMALIZE:
        r = tl.load(R + bh64 * T + offs_t, mask=t_mask, other=0.0)
        dp_t += r[None, :]
    dp_t = _scaled(tl.where(offs_t[None, :] >= offs_t[:, None], dp_t, 0.0), scale, scale_lo, FP64)
    q = tl.load(
        Q + batch * stride_qb + head * stride_qh + offs_t[:, None] * stride_qt + offs_e[None, :] * stride_qd,
        mask=out_mask, other=0.0
    )
    dk = tl.dot(dp_t.to(q.dtype), q, inter, input_precision=DOT_PRECISION, out_dtype=ACC)
    if NORMALIZE:
        dz = tl.load(DZSTATES + row * E_DIM + offs_e, mask=e_mask, other=0.0)
        dk += dz[None, :]
    tl.store(
        DK + batch * stride_dkb + head * stride_dkh + offs_t[:, None] * stride_dkt + offs_e[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty), mask=out_mask
    )


@triton.autotune(configs=_BWD_CONFIGS, key=_CHUNK_KEY, prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def linear_attention_bwd_dv_kernel(
    K, Q, G, DSTATES, SSCALES, DV,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_gb, stride_gt, stride_gh, stride_gd,
    stride_dvb, stride_dvt, stride_dvh, stride_dvd,
    num_heads, T, D_DIM, E_DIM, scale, scale_lo, D_BUCKET, E_BUCKET,
    NORMALIZE: tl.constexpr, H_SCALED: tl.constexpr, FP64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """dV_c = K_c dS_c + scale ((K_c Q_c^T) * M^T) G_c for one (V tile, chunk, batch * head);
    grid (cdiv(V, BLOCK_E) * n_chunks, H, B); D = K, E = V. NORMALIZE only keys the autotuner
    (G already carries the division by den)."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_e, chunk, batch, head, _, row = _chunk_program(num_heads, T, E_DIM, BLOCK_T, BLOCK_E)
    offs_t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    out_mask = (offs_t < T)[:, None] & (offs_e < E_DIM)[None, :]

    inter, scores_t, _ = _chunk_products(
        K + batch * stride_kb + head * stride_kh, Q + batch * stride_qb + head * stride_qh,
        DSTATES + row * (D_DIM * E_DIM), SSCALES + row, DSTATES, stride_kt, stride_kd, stride_qt, stride_qd,
        E_DIM, 1, offs_t, offs_e, T, D_DIM, E_DIM, False, H_SCALED, ACC, DOT_PRECISION, BLOCK_T, BLOCK_D, BLOCK_E
    )
    scores_t = _scaled(tl.where(offs_t[None, :] >= offs_t[:, None], scores_t, 0.0), scale, scale_lo, FP64)
    g = tl.load(
        G + batch * stride_gb + head * stride_gh + offs_t[:, None] * stride_gt + offs_e[None, :] * stride_gd,
        mask=out_mask, other=0.0
    )
    dv = tl.dot(scores_t.to(g.dtype), g, inter, input_precision=DOT_PRECISION, out_dtype=ACC)
    tl.store(
        DV + batch * stride_dvb + head * stride_dvh + offs_t[:, None] * stride_dvt + offs_e[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty), mask=out_mask
    )


@triton.jit(do_not_specialize=["n_elem"])
def linear_attention_state_cast_kernel(S32, S16, SCALES, n_elem, BLOCK: tl.constexpr):
    """fp16 copy of one per-chunk state for the chunk kernels; grid (B * H * n_chunks,).

    S32 (rows, n_elem) fp32 contiguous, one (D, E) state a row; S16 the same shape in fp16 gets
    S32 / m and SCALES (rows,) fp32 gets m, the row's :func:`_fp16_range_scale`. Two passes over
    the row: its max, then the scaled copy (a row is at most D E 4 bytes, read again from L2).
    """
    row = tl.program_id(0).to(tl.int64) * n_elem
    row_max = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_elem, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        row_max = tl.maximum(row_max, tl.abs(tl.load(S32 + row + offs, mask=offs < n_elem, other=0.0)))
    m = _fp16_range_scale(tl.max(row_max, 0))
    tl.store(SCALES + tl.program_id(0), m)
    for i in range(0, n_elem, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(S32 + row + offs, mask=offs < n_elem, other=0.0)
        tl.store(S16 + row + offs, (x / m).to(tl.float16), mask=offs < n_elem)


# ----------------------------------------------------------------------------------------------
# Decode step
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_heads"])
def linear_attention_step_kernel(
    Q, K, V, S, Z, Out,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kd,
    stride_vb, stride_vh, stride_ve,
    stride_sb, stride_sh, stride_sd, stride_se,
    stride_zb, stride_zh, stride_zd,
    num_heads, D_DIM, E_DIM, scale, scale_lo, eps,
    HAS_Z: tl.constexpr, FP64: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One token of one (batch, head): S += k v^T in place, o = scale q . S [/ (scale q . z + eps)
    after z += k]; grid (B*H,); D = K, E = V <= BLOCK_E. Out (B*H, V) contiguous."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    bh = tl.program_id(0)
    batch = (bh // num_heads).to(tl.int64)
    head = (bh % num_heads).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E_DIM
    v = tl.load(V + batch * stride_vb + head * stride_vh + offs_e * stride_ve, mask=e_mask, other=0.0).to(ACC)
    s_base = S + batch * stride_sb + head * stride_sh
    o = tl.zeros([BLOCK_E], dtype=ACC)
    qz = tl.zeros([BLOCK_D], dtype=ACC)
    for d0 in range(0, D_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D_DIM
        q = tl.load(Q + batch * stride_qb + head * stride_qh + offs_d * stride_qd, mask=d_mask, other=0.0).to(ACC)
        k = tl.load(K + batch * stride_kb + head * stride_kh + offs_d * stride_kd, mask=d_mask, other=0.0).to(ACC)
        s_ptrs = s_base + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se
        s_mask = d_mask[:, None] & e_mask[None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(ACC) + k[:, None] * v[None, :]
        tl.store(s_ptrs, s.to(S.dtype.element_ty), mask=s_mask)
        o += tl.sum(q[:, None] * s, 0)
        if HAS_Z:
            z_ptrs = Z + batch * stride_zb + head * stride_zh + offs_d * stride_zd
            z = tl.load(z_ptrs, mask=d_mask, other=0.0).to(ACC) + k
            tl.store(z_ptrs, z.to(Z.dtype.element_ty), mask=d_mask)
            qz += q * z
    o = _scaled(o, scale, scale_lo, FP64)
    if HAS_Z:
        o = o / (_scaled(tl.sum(qz, 0), scale, scale_lo, FP64) + eps)
    tl.store(Out + bh.to(tl.int64) * E_DIM + offs_e, o.to(Out.dtype.element_ty), mask=e_mask)


# fmt: on


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _scale_args(scale: float, fp64: bool) -> tuple[float, float]:
    return split_fp64(scale) if fp64 else (scale, 0.0)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE fp32 products (TF32 would cost ~1e-3 relative error); 16-bit inputs multiply
    # exactly on the tensor cores either way.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scans write the per-chunk states S_c (and the backward's dS_c) in for inputs
    of ``dtype``: the input dtype, whose rounding the tensor-core products apply anyway, except fp32
    for fp16, whose 65504 range a state growing linearly in T outgrows (:func:`chunk_states` then
    scales them into range). bf16 has fp32's range."""
    return torch.float32 if dtype == torch.float16 else dtype


def chunk_states(
    states: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-chunk states as the chunk kernels read them: (states, None), except for fp16 inputs
    (and (None, None) for None: states not stored).

    For ``dtype`` fp16, states (B, H, n_chunks, D, E) arrive in fp32 (:func:`state_dtype`) and leave
    as fp16 ``S_c / m_c`` with scales m_c (B, H, n_chunks) fp32: the power of two that brings
    max|S_c| into [2^14, 2^15) when it is above 2^15, else 1 (in-range states round as before). A
    power of two makes the division and the kernels' multiplication of Q_c (S_c / m_c) by m_c exact:
    the products are those of fp16 with fp32's exponent range. One scale per (batch, head, chunk)
    is what every kernel's tiles share; a per-tile scale would need the same reduction and cast in
    each kernel, on a loaded tile feeding ``tl.dot``, which Triton 3.6 miscompiled on the H200.
    One launch of ``linear_attention_state_cast_kernel``: the states (contiguous) are read about
    twice and written once in fp16.
    """
    if states is None or dtype != torch.float16:
        return states, None
    half = torch.empty(states.shape, dtype=torch.float16, device=states.device)
    scales = torch.empty(states.shape[:3], dtype=torch.float32, device=states.device)
    if scales.numel():
        linear_attention_state_cast_kernel[(scales.numel(),)](
            states, half, scales, states.shape[3] * states.shape[4], BLOCK=1024, num_warps=4
        )
    return half, scales


def _scan(x, y, w, wp, s_in, z_in, *, chunk: int, reverse: bool, normalize: bool, scale: float):
    """Launch the state scan over (B, T, H, D) x and (B, T, H, E) y; returns
    (states (B, H, n_chunks, D, E) in ``state_dtype(x.dtype)``, zstates (B, H, n_chunks, D) or None,
    s_out (B, H, D, E), z_out (B, H, D) or None), the last three in the accumulator dtype."""
    batch, seqlen, num_heads, d_dim = x.shape
    e_dim = y.shape[3]
    acc = _compute_dtype(x.dtype)
    n_chunks = cdiv(seqlen, chunk)
    device = x.device
    states = torch.empty(
        (batch, num_heads, n_chunks, d_dim, e_dim), dtype=state_dtype(x.dtype), device=device
    )
    s_out = torch.empty((batch, num_heads, d_dim, e_dim), dtype=acc, device=device)
    zstates = z_out = None
    if normalize:
        zstates = torch.empty((batch, num_heads, n_chunks, d_dim), dtype=acc, device=device)
        z_out = torch.empty((batch, num_heads, d_dim), dtype=acc, device=device)
    bh = batch * num_heads
    if bh == 0 or d_dim == 0:  # nothing to scan (K == 0: every state is empty)
        return states, zstates, s_out, z_out
    fp64 = acc == torch.float64

    def grid(meta):
        # At least one E tile, so that z is still summed when E == 0.
        e_tiles = max(1, cdiv(e_dim, meta["BLOCK_E"]))
        return (cdiv(d_dim, meta["BLOCK_D"]) * e_tiles, num_heads, batch)

    linear_attention_state_kernel[grid](
        x, y, w if w is not None else s_out, wp if wp is not None else s_out, s_in if s_in is not None else s_out,
        z_in if z_in is not None else s_out, states, zstates if normalize else s_out, s_out,
        z_out if normalize else s_out,
        *x.stride(), *y.stride(), *strides(s_in, 4), *strides(z_in, 3),
        num_heads, seqlen, d_dim, e_dim, *_scale_args(scale, fp64), _pad(d_dim), _pad(e_dim), _bucket(bh),
        HAS_S_IN=s_in is not None, HAS_Z_IN=z_in is not None, HAS_Z=normalize,
        REVERSE=reverse, FP64=fp64, DOT_PRECISION=_dot_precision(x.dtype), BLOCK_T=chunk,
    )  # fmt: skip
    return states, zstates, s_out, z_out


# What to do about a sequence whose offsets pass int32 (check_int32_offsets).
_OFFSETS_FIX = (
    "split the sequence into calls that carry the state (initial_state=..., output_final_state=True), "
    "or pass contiguous tensors if a wider stride (a view of a fused projection) made it"
)

# The fused forward holds the whole (K, BLOCK_E) state in registers: K up to 128.
FUSED_MAX_K = 128
# Off CUDA (the interpreter), the SM count the segment rule sees: small test shapes split into segments.
INTERPRET_SMS = 4


def uses_fused_forward(k_dim: int, v_dim: int) -> bool:
    """Whether :func:`linear_attention`'s forward runs the fused scan-and-output kernel (else the
    state kernel plus the chunk-parallel output kernel): K, V >= 1 and K padded to a power of two at
    most FUSED_MAX_K, with or without normalize."""
    return k_dim > 0 and v_dim > 0 and _pad(k_dim) <= FUSED_MAX_K


# Smallest K (padded) whose normalised fused forward loads each chunk's z (see loads_chunk_z).
CHUNK_Z_MIN_K = 128

# Rows of K a z program of the segment kernel sums (see _chunk_z_program). Each program walks the
# chunks of its part in order; the width sets how many programs share that walk (H200, 2026-12-05,
# bf16, B2 T8192 H16 K=V=128, one chunk a step: the segment kernel 41 us with 32 rows against 52 with
# 64 and 71 with 16 at 6 stages; 91 with 128 against 63 with 64 at 3 stages).
CHUNK_Z_BLOCK_D = 32

# Chunks a z program sums in one step (see _chunk_z_program): a power of two, at most 16. On an H100
# (2026-12-05, bf16, B2 T8192 H16 K=V=128, CUDA-graph GPU time, 5 interleaved rounds in one process)
# the normalised forward storing states took 0.230 / 0.210 / 0.216 / 0.210 ms with 1 / 2 / 4 / 8 chunks
# a step (the segment kernel 67 / 56 / 60 / 57 us, torch.profiler), against 0.175 unnormalised; without
# states 0.171 with 1 and 0.174 with 4. Four: within 3% of the fastest step, and the one the GPU
# suite passed with (70 of 70 on that H100; 2 and 8 were not run there).
CHUNK_Z_STEP = 4

# Chunks a z program walks (a part; see _chunk_z_program) below CHUNK_Z_PARTS_BELOW_HEADS: the
# sequence is cut into parts of this many chunks, summed in parallel, and
# linear_attention_chunk_z_kernel adds the earlier parts' sums. One part walks the whole sequence in
# order, there the segment kernel's critical path: 60 us against 31.5 unnormalised at B2 T8192 H16
# K=V=128 (H100, 2026-12-05, bf16, torch.profiler) and 158 against 62 at B1 T32768 H8 (2026-12-06).
# Parts of 32 and 64 chunks timed the same (H100, 2026-12-06, bf16, the normalised forward storing
# states at B1 T32768 H8: 0.2456 / 0.2436 ms; segment kernel 69.7 / 66.2 us plus the chunk-z
# kernel's 14.2 / 18.8; ...-zparts-always-branch.json). CHUNK_Z_BLOCK_D, CHUNK_Z_STEP and
# SEGMENT_STAGES_16BIT were measured with one part.
CHUNK_Z_PART_CHUNKS = 32

# Most parts a sequence is cut into: each chunk-z program sums the parts before its own, so the
# prefix loads grow as the square of the parts (beyond this, parts hold more chunks).
CHUNK_Z_MAX_PARTS = 64

# Chunks a program of linear_attention_chunk_z_kernel completes (one block of a part a program).
CHUNK_Z_BLOCK_C = 16

# Batch * heads from which the z programs walk the whole sequence in one part (see chunk_z_parts).
# The serial walk's time grows with n_chunks alone, the segment kernel's bandwidth time with B*H*T:
# measured, walk / bandwidth ~ (29.4 / 52.5) * 32 / (B*H), so the walk is the critical path only for
# B*H below about 16-18. Elsewhere parts only add the chunk-z kernel and the ZW round trip. H100,
# 2026-12-06, bf16, torch.profiler, K=V=128, the normalised forward storing states, CUDA-graph ms,
# one walk against parts (segment kernel us, plus the chunk-z kernel's with parts):
# B1 T32768 H8 0.313 against 0.2456 (149.6 against 69.7 + 14.2: the walk of 512 chunks dominates);
# B2 T8192 H16 0.2128 against 0.2264 (57.5 against 55.6 + 13.5: bandwidth-bound);
# B8 T2048 H32 0.3832 against 0.4006 (one part of 32 chunks, still the extra kernel and round trip).
# With this rule (benchmarks/results/2026-12-06-nvidia-h100-linear-attention-zparts.json): B1 T32768
# H8 0.317 -> 0.245 ms, B1 T8192 H8 0.092 -> 0.082, B2 T8192 H16 and B8 T2048 H32 unchanged.
CHUNK_Z_PARTS_BELOW_HEADS = 16

# Pipeline stages of the segment kernel for 16-bit inputs. Its programs only load and accumulate,
# so the depth of loads in flight sets their time: at B2 T8192 H16 K=V=128 (H200, 2026-12-05, bf16)
# unnormalised 37.2 / 30.0 / 27.2 / 24.2 / 23.2 us with 3 / 4 / 5 / 6 / 8 stages (the forward
# storing states 154 -> 143 us at 6); with 64-row z programs 106 / 63 / 55 / 53 / 52 / 66 us with
# 2 / 3 / 4 / 5 / 6 / 8 stages, with 32-row ones 44 / 41 / 60 us with 5 / 6 / 8. Eight stages win
# nothing unnormalised and lose with the z programs, so six.
SEGMENT_STAGES_16BIT = 6


def chunk_z_parts(n_chunks: int, batch_heads: int) -> tuple[int, int]:
    """(chunks a part, parts) of the z programs for ``batch_heads`` sequences of ``n_chunks`` chunks:
    one part, the whole sequence, from CHUNK_Z_PARTS_BELOW_HEADS batch * heads on; below, parts of
    CHUNK_Z_PART_CHUNKS chunks, longer where that would make more than CHUNK_Z_MAX_PARTS, never
    longer than the sequence; (1, 0) for an empty one, which has no z programs. With more than one
    part the z programs walk them in parallel (IN_PARTS) and linear_attention_chunk_z_kernel
    completes z; with one they write the finished z themselves (see _chunk_z_program)."""
    per_part = n_chunks
    if batch_heads < CHUNK_Z_PARTS_BELOW_HEADS:
        per_part = max(CHUNK_Z_PART_CHUNKS, cdiv(n_chunks, CHUNK_Z_MAX_PARTS))
    per_part = max(1, min(per_part, n_chunks))
    return per_part, cdiv(n_chunks, per_part)


def loads_chunk_z(dtype: torch.dtype, k_dim: int) -> bool:
    """Whether the normalised fused forward loads each chunk's z_c, written before it by the segment
    kernel's z programs (completed by linear_attention_chunk_z_kernel in parts: see chunk_z_parts),
    instead of carrying z through the chunks in registers: for K padded to at least CHUNK_Z_MIN_K
    (where the carried z, its 64-wide q . z operand built in registers and its per-chunk sums made
    the kernel spill at 4 warps: 168 / 80 bytes a thread without / with the states stored at K =
    128, against none loaded; Triton 3.9, sm_90), and for the dtypes with fp32's exponent range (z
    grows linearly in T, past fp16's 65504: fp16 keeps the carried z, rescaled)."""
    return dtype != torch.float16 and _pad(k_dim) >= CHUNK_Z_MIN_K


def fused_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_E, num_warps, num_stages) of the fused forward kernel for inputs of ``dtype``.

    16-bit: 64-wide V tiles in 3 stages, 4 warps (H200, 2026-12-01, bf16, fastest of 32 / 64 / 128 x
    4 / 8 warps x 2 / 3 stages at B2 T8192 H16 D128 and B8 T2048 H32 D64 with the states stored;
    normalised too on 2026-12-02, where (64, 8, 3), (64, 8, 2), (32, 4, 3) and (128, 8, 2) took
    1.1-3.1x as long, with or without states, despite spilling less).
    fp32 / fp64 (IEEE products on the FMA units): 32-wide tiles, 2 stages. Interpreter: one stage.
    """
    if _INTERPRET:
        return INTERPRET_BLOCK, 4, 1
    if dtype in (torch.float16, torch.bfloat16):
        return 64, 4, 3
    return 32, 4, 2


def segment_stages(dtype: torch.dtype, fused_stages: int) -> int:
    """Pipeline stages of ``linear_attention_segment_kernel``: SEGMENT_STAGES_16BIT for fp16 / bf16 on a
    GPU, else ``fused_stages`` (the fused kernel's, from :func:`fused_config`)."""
    if not _INTERPRET and dtype in (torch.float16, torch.bfloat16):
        return SEGMENT_STAGES_16BIT
    return fused_stages


def num_segments(programs: int, n_chunks: int, num_sms: int) -> int:
    """Segments the sequence is cut into for the fused forward: enough that the (V tile, segment,
    head) programs fill the SMs once, ``max(1, min(n_chunks, num_sms // programs))``.

    More segments add parallelism but cost a segment-sum pass over K and V and the prefix loads;
    one wave was the fastest split measured (H200, 2026-12-01: B2 T8192 H16 D128, 64 programs ->
    2 segments, 157 us against 158 / 188 us for 4 / 8; B8 T2048 H32 D64, 256 programs -> 1, 96 us
    against 117 / 129 us for 2 / 4; states stored).
    """
    return max(1, min(n_chunks, num_sms // max(programs, 1)))


def _fused_forward(q, k, v, kv0, z0, scale: float, normalize: bool, eps: float, store_states: bool):
    """The fused path of :func:`_forward` (same returns); states, sscales and zstates are None
    unless ``store_states`` (only the backward reads them)."""
    batch, seqlen, num_heads, k_dim = q.shape
    v_dim = v.shape[3]
    acc = _compute_dtype(q.dtype)
    fp64 = acc == torch.float64
    device = q.device
    chunk = chunk_size(q.dtype)
    n_chunks = cdiv(seqlen, chunk)
    block_e, num_warps, num_stages = fused_config(q.dtype)
    e_tiles = cdiv(v_dim, block_e)
    n_seg = num_segments(batch * num_heads * e_tiles, n_chunks, sm_count(device, INTERPRET_SMS))
    chunks_per_seg = cdiv(n_chunks, n_seg) if n_chunks else 1
    n_seg = max(1, cdiv(n_chunks, chunks_per_seg))  # no empty trailing segment

    o = torch.empty((batch, seqlen, num_heads, v_dim), dtype=q.dtype, device=device)
    kv = torch.empty((batch, num_heads, k_dim, v_dim), dtype=acc, device=device)
    z = torch.empty((batch, num_heads, k_dim), dtype=acc, device=device) if normalize else None
    den = torch.empty((batch, num_heads, seqlen), dtype=acc, device=device) if normalize else None
    states = zstates = None
    if store_states:
        states = torch.empty(
            (batch, num_heads, n_chunks, k_dim, v_dim), dtype=state_dtype(q.dtype), device=device
        )
        if normalize:
            zstates = torch.empty((batch, num_heads, n_chunks, k_dim), dtype=acc, device=device)
    if batch * num_heads == 0:
        return o, kv, z, *chunk_states(states, q.dtype), zstates, den
    dummy = kv  # for the pointers a launch does not read
    dot_precision = _dot_precision(q.dtype)
    chunk_z = normalize and n_chunks > 0 and loads_chunk_z(q.dtype, k_dim)
    block_d = min(_pad(k_dim), block_e)
    seg = zseg = zc = dummy
    if n_seg > 1:
        seg = torch.empty((batch * num_heads, n_seg - 1, k_dim, v_dim), dtype=acc, device=device)
        if normalize and not chunk_z:
            zseg = torch.empty((batch * num_heads, n_seg - 1, k_dim), dtype=acc, device=device)
    chunks_per_part, n_parts = chunk_z_parts(n_chunks, batch * num_heads)
    in_parts = chunk_z and n_parts > 1
    # One walk: the z programs write the saved zstates and the final z themselves.
    zw = zstates if zstates is not None else dummy
    zend = z if normalize else dummy
    if chunk_z:
        zc = torch.empty((batch * num_heads, n_chunks, k_dim, 2), dtype=q.dtype, device=device)
    if in_parts:
        # z within its part (completed in place by the chunk-z kernel when it is the saved zstates)
        # and the parts' sums
        if zstates is None:
            zw = torch.empty((batch * num_heads, n_chunks, k_dim), dtype=acc, device=device)
        zend = torch.empty((batch * num_heads, n_parts, k_dim), dtype=acc, device=device)
    kv_programs = cdiv(k_dim, block_d) * e_tiles * (n_seg - 1)
    z_block_d = min(CHUNK_Z_BLOCK_D, block_d)
    z_programs = cdiv(k_dim, z_block_d) * n_parts if chunk_z else 0
    if kv_programs + z_programs:
        linear_attention_segment_kernel[(kv_programs + z_programs, num_heads, batch)](
            k, v, seg, zseg, z0 if z0 is not None else dummy, zc, zw, zend,
            *k.stride(), *v.stride(), *strides(z0, 3),
            num_heads, seqlen, k_dim, v_dim, chunks_per_seg, n_seg - 1, chunks_per_part,
            HAS_Z=normalize and not chunk_z, CHUNK_Z=chunk_z, IN_PARTS=in_parts, HAS_Z_IN=z0 is not None,
            STORE_Z=zstates is not None, FP64=fp64, DOT_PRECISION=dot_precision, BLOCK_T=chunk,
            BLOCK_D=block_d, BLOCK_E=block_e, Z_BLOCK_D=z_block_d, Z_STEP=CHUNK_Z_STEP,
            num_warps=num_warps, num_stages=segment_stages(q.dtype, num_stages),
        )  # fmt: skip
    if in_parts:
        linear_attention_chunk_z_kernel[(n_parts * cdiv(chunks_per_part, CHUNK_Z_BLOCK_C), num_heads, batch)](
            zw, zend, z0 if z0 is not None else dummy, zc, z, *strides(z0, 3),
            num_heads, k_dim, n_chunks, chunks_per_part,
            HAS_Z_IN=z0 is not None, STORE_Z=zstates is not None, BLOCK_C=CHUNK_Z_BLOCK_C,
            BLOCK_D=_pad(k_dim), BLOCK_P=max(2, next_power_of_2(n_parts)), num_warps=4,
        )  # fmt: skip
    # With z loaded (loads_chunk_z) the fused forward stores S_{c+1} after its update at the end of chunk
    # c (S_first before the loop), rather than S_c at the start of chunk c, where the fp32 -> 16-bit
    # conversion overlaps the chunk's loads: at K = 128 and 4 warps no spills against 40 bytes a thread
    # (Triton 3.9, sm_90). The other paths keep the early store: with z carried the late one spilled more
    # (152 against 80 bytes), and unnormalised it was slower on the H200 (2026-12-05, bf16, B2 T8192 H16
    # K=V=128, storing states: 148.6 against 143.3 us, the fused kernel 122.7 against 116.2).
    linear_attention_fused_fwd_kernel[(e_tiles * n_seg, num_heads, batch)](
        q, k, v, kv0 if kv0 is not None else dummy, z0 if z0 is not None else dummy, seg, zseg,
        states if store_states else dummy, zstates if zstates is not None else dummy, o,
        den if normalize else dummy, kv, z if normalize else dummy, zc,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *strides(kv0, 4), *strides(z0, 3),
        num_heads, seqlen, k_dim, v_dim, chunks_per_seg, *_scale_args(scale, fp64), eps,
        HAS_S_IN=kv0 is not None, HAS_Z_IN=z0 is not None, NORMALIZE=normalize, STORE_STATES=store_states,
        FP64=fp64, DOT_PRECISION=dot_precision, ZC_LOADED=chunk_z,
        LATE_STATE_STORE=chunk_z, BLOCK_T=chunk,
        BLOCK_D=_pad(k_dim), BLOCK_E=block_e, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o, kv, z, *chunk_states(states, q.dtype), zstates, den


def _forward(q, k, v, kv0, z0, scale: float, normalize: bool, eps: float, store_states: bool):
    """o (B, T, H, V), final kv, final z (or None), and what the backward needs:
    states and their scales (:func:`chunk_states`), zstates (or None), den (B, H, T) (or None)."""
    if uses_fused_forward(q.shape[3], v.shape[3]):
        return _fused_forward(q, k, v, kv0, z0, scale, normalize, eps, store_states)
    batch, seqlen, num_heads, k_dim = q.shape
    v_dim = v.shape[3]
    chunk = chunk_size(q.dtype)
    states, zstates, kv, z = _scan(
        k, v, None, None, kv0, z0, chunk=chunk, reverse=False, normalize=normalize, scale=1.0
    )
    states, sscales = chunk_states(states, q.dtype)
    o = torch.empty((batch, seqlen, num_heads, v_dim), dtype=q.dtype, device=q.device)
    den = torch.empty((batch, num_heads, seqlen), dtype=kv.dtype, device=q.device) if normalize else None
    if o.numel() == 0:
        return o, kv, z, states, sscales, zstates, den
    fp64 = kv.dtype == torch.float64

    def grid(meta):
        return (cdiv(v_dim, meta["BLOCK_E"]) * cdiv(seqlen, chunk), num_heads, batch)

    linear_attention_fwd_kernel[grid](
        q, k, v, states, sscales if sscales is not None else kv, zstates if normalize else kv, o,
        den if normalize else kv, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        num_heads, seqlen, k_dim, v_dim, *_scale_args(scale, fp64), eps, _pad(k_dim), _pad(v_dim),
        NORMALIZE=normalize, H_SCALED=sscales is not None, FP64=fp64, DOT_PRECISION=_dot_precision(q.dtype),
        BLOCK_T=chunk,
    )  # fmt: skip
    return o, kv, z, states, sscales, zstates, den


def _backward(do, dkv, dz, q, k, v, o, states, sscales, zstates, den, scale: float, normalize: bool):
    """dq, dk, dv (input dtype) and the initial state's dkv0, dz0 (accumulator dtype; dz0 None
    without normalize). do / dkv / dz: gradients of o and of the final state, each possibly None;
    the rest as :func:`_forward` returned them."""
    batch, seqlen, num_heads, k_dim = q.shape
    v_dim = v.shape[3]
    chunk = chunk_size(q.dtype)
    acc = _compute_dtype(q.dtype)
    fp64 = acc == torch.float64
    if do is None:  # only the final state was used
        do = torch.zeros((batch, seqlen, num_heads, v_dim), dtype=q.dtype, device=q.device)
    check_int32_offsets("linear_attention", _OFFSETS_FIX, (1, 3), do=do)
    g, r, rp = do, None, None
    # r's hi / lo pair for the reverse scan's dz product (fp16 sums r itself there: see the kernel).
    pair = normalize and q.dtype != torch.float16
    if normalize and do.numel() == 0:  # no output element (V == 0): nothing reaches the normaliser
        r = torch.zeros((batch, num_heads, seqlen), dtype=acc, device=q.device)
        rp = torch.zeros((batch, num_heads, seqlen, 2), dtype=q.dtype, device=q.device) if pair else None
    elif normalize:
        g = torch.empty(do.shape, dtype=q.dtype, device=q.device)
        r = torch.empty((batch, num_heads, seqlen), dtype=acc, device=q.device)
        rp = torch.empty((batch, num_heads, seqlen, 2), dtype=q.dtype, device=q.device) if pair else None
        block_t = 32 if _INTERPRET else 64
        linear_attention_bwd_preprocess_kernel[(cdiv(seqlen, block_t), num_heads, batch)](
            do, o, den, g, r, rp if pair else r, *do.stride(), *o.stride(), *g.stride(), num_heads, seqlen, v_dim,
            FP64=fp64, PAIR=pair, BLOCK_T=block_t, BLOCK_E=min(_pad(v_dim), 64),
        )  # fmt: skip
    dz_in = dz if normalize else None
    dstates, dzstates, dkv0, dz0 = _scan(
        q, g, r, rp, dkv, dz_in, chunk=chunk, reverse=True, normalize=normalize, scale=scale
    )
    dstates, dscales = chunk_states(dstates, q.dtype)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    n_chunks = cdiv(seqlen, chunk)
    scale_args = _scale_args(scale, fp64)
    meta = dict(NORMALIZE=normalize, H_SCALED=dscales is not None, FP64=fp64, BLOCK_T=chunk)
    meta["DOT_PRECISION"] = _dot_precision(q.dtype)
    dummy = dkv0
    if dscales is None:  # then sscales is None too (both fp16 only)
        dscales = sscales = dummy
    # A launch per gradient that has elements (with K == 0 or V == 0 the other two still may).
    if dv.numel() > 0:
        linear_attention_bwd_dv_kernel[lambda m: (cdiv(v_dim, m["BLOCK_E"]) * n_chunks, num_heads, batch)](
            k, q, g, dstates, dscales, dv, *k.stride(), *q.stride(), *g.stride(), *dv.stride(),
            num_heads, seqlen, k_dim, v_dim, *scale_args, _pad(k_dim), _pad(v_dim), **meta,
        )  # fmt: skip
    if dk.numel() > 0:
        linear_attention_bwd_dk_kernel[lambda m: (cdiv(k_dim, m["BLOCK_E"]) * n_chunks, num_heads, batch)](
            v, g, q, dstates, dscales, dzstates if normalize else dummy, r if normalize else dummy, dk,
            *v.stride(), *g.stride(), *q.stride(), *dk.stride(),
            num_heads, seqlen, v_dim, k_dim, *scale_args, _pad(v_dim), _pad(k_dim), **meta,
        )  # fmt: skip
        linear_attention_bwd_dq_kernel[lambda m: (cdiv(k_dim, m["BLOCK_E"]) * n_chunks, num_heads, batch)](
            g, v, k, states, sscales, zstates if normalize else dummy, r if normalize else dummy, dq,
            *g.stride(), *v.stride(), *k.stride(), *dq.stride(),
            num_heads, seqlen, v_dim, k_dim, *scale_args, _pad(v_dim), _pad(k_dim), **meta,
        )  # fmt: skip
    return dq, dk, dv, dkv0, dz0


class _LinearAttentionFunction(torch.autograd.Function):
    """Autograd glue: saves q, k, v, the per-chunk states (and o, z states, den when normalising)."""

    @staticmethod
    def forward(ctx, q, k, v, kv0, z0, scale, normalize, eps, store_states):
        with device_guard(q):
            o, kv, z, states, sscales, zstates, den = _forward(
                q, k, v, kv0, z0, scale, normalize, eps, store_states
            )
        ctx.save_for_backward(q, k, v, o if normalize else None, states, sscales, zstates, den)
        ctx.scale, ctx.normalize = scale, normalize
        ctx.state_dtypes = (kv0.dtype if kv0 is not None else None, z0.dtype if z0 is not None else None)
        # Unused outputs (the final state, or o when only the state is used) arrive as None.
        ctx.set_materialize_grads(False)
        return o, kv, z

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dkv, dz):
        q, k, v, o, states, sscales, zstates, den = ctx.saved_tensors
        with device_guard(q):
            dq, dk, dv, dkv0, dz0 = _backward(
                do, dkv, dz, q, k, v, o, states, sscales, zstates, den, ctx.scale, ctx.normalize
            )
        kv0_dtype, z0_dtype = ctx.state_dtypes
        dkv0 = dkv0.to(kv0_dtype) if ctx.needs_input_grad[3] else None
        dz0 = dz0.to(z0_dtype) if ctx.needs_input_grad[4] else None
        return dq, dk, dv, dkv0, dz0, None, None, None, None


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    normalize: bool = True,
    eps: float = 1e-10,
    initial_state: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
):
    """Causal linear attention over feature-mapped queries and keys, chunked, in Triton.

    Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6, in the chunkwise-parallel form of
    Yang et al. 2024 (GLA, Sec. 3, gates = 1) / fla's ``chunk_linear_attn``; exactly
    :func:`kernels.reference.linear_attention`:

        o_t = scale q_t . (S_0 + sum_{s<=t} k_s v_s^T)
        with normalize: o_t /= scale q_t . (z_0 + sum_{s<=t} k_s) + eps

    Differentiable in q, k, v and the initial state (and through the returned final state).

    Args:
        q: (B, T, H, K) feature-mapped queries, float16 / bfloat16 / float32 / float64, any strides.
        k: (B, T, H, K) feature-mapped keys, same dtype as q.
        v: (B, T, H, V) values, same dtype as q.
        scale: defaults to ``K ** -0.5``.
        normalize: divide by the normaliser above (needs non-negative feature inner products).
        eps: added to the normaliser (>= 0; with 0 a row whose normaliser is 0, e.g. relu
            features that are all zero, comes out NaN: the default 1e-10 avoids that).
        initial_state: kv (B, H, K, V) when normalize=False, the pair (kv, z (B, H, K)) when
            normalize=True, or None (zeros); any float dtype (computed in fp32, fp64 for fp64 inputs).
        output_final_state: also return the state after the last token, in the same form.

    Any K, V >= 1 (tiled; padded to powers of two with masks) and any T >= 0. Accumulation, the
    running state and the returned states are fp32 (fp64 for fp64 inputs); 16-bit products run on
    the tensor cores, so the per-chunk states they multiply are rounded to the input dtype. With
    fp16 inputs the states (S and z) are scaled by powers of two into fp16's range before that
    rounding, so they may grow past 65504; the in-chunk scores ``q_t . k_s`` (before ``scale``),
    the outputs and the gradients must still fit fp16, as in any fp16 attention.

    Returns:
        o (B, T, H, V) in q's dtype, or (o, final_state) with output_final_state; the state is kv
        (B, H, K, V) or (kv, z (B, H, K)) in float32 (float64 for float64 inputs).

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor / non-floating inputs,
        mismatched dtypes, bad scale, a normalize or output_final_state that is not a bool, the wrong
        state form for ``normalize``; ValueError: wrong ndim or mismatched shapes, tensors on
        different devices, K = 0 without a scale), and, for this backend only, ValueError for a scale
        or eps beyond fp32's range, devices other than CUDA, CPU tensors without
        ``TRITON_INTERPRET=1`` (or bfloat16 ones under it), or a sequence whose offsets in q, k, v,
        o or the output gradient reach 2**31 elements (``(T - 1) * stride``: the kernels index
        the sequence in int32; ``kernels._host.check_int32_offsets``).
    """
    # The reference's validation: same checks, order and messages.
    batch, _, num_heads, k_dim, v_dim, scale = _check_linear_attention_args(
        q, k, v, scale, normalize, eps, output_final_state
    )
    kv0 = z0 = None
    if initial_state is not None:
        kv0, z0 = _split_linear_state(initial_state, normalize, q, v_dim)
    check_device("linear_attention", q, k, v, kv0, z0)  # one device: checked above
    check_fp32_scalars("linear_attention", scale=scale, eps=eps)
    # o (v's shape) and the gradients are allocated contiguous.
    check_int32_offsets("linear_attention", _OFFSETS_FIX, (1, 3), q=q, k=k, v=v, o=v.shape, dq=q.shape)

    normalize = bool(normalize)
    # The per-chunk states are only written when a backward can follow.
    store_states = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, kv0, z0)
    )
    o, kv, z = _LinearAttentionFunction.apply(
        q, k, v, kv0, z0, float(scale), normalize, float(eps), store_states
    )
    if not output_final_state:
        return o
    return o, ((kv, z) if normalize else kv)


# Replayable launches of recent linear_attention_step call signatures (_step_key).
_STEP_PLANS = LaunchPlans()


def _step_key(q, k, v, state, z_state, scale, eps) -> tuple | None:
    """Everything a :func:`linear_attention_step` call's checks, tile choice and launch depend on
    except the tensors' addresses (:meth:`kernels._host.LaunchPlans.key`): scale and eps with their
    types, and q, k, v, state and z_state (or its absence) with their shapes, strides, dtypes,
    devices and 16-byte alignment. None where no plan applies (see there)."""
    return _STEP_PLANS.key((scale, eps), q, k, v, state, z_state)


class _StepPlan:
    """The launch of one :func:`linear_attention_step` call signature (:func:`_step_key`), replayed
    by later eager calls with their own tensors: the argument checks, the tile choice and Triton's
    argument binding ran once, for the first call (:class:`kernels._host.CompiledLaunch`). The
    output is a fresh allocation on every call, as on the ordinary path; the states are updated in
    place by the same kernel.

    Args:
        tensors: the first call's (q, k, v, state, z_state), for the spans the overlap checks need.
        out: its (B, H, V) output, for its shape and alignment.
        launch: the step kernel's launch.
    """

    def __init__(self, tensors, out, launch):
        self.out_shape, self.device, self.launch = out.shape, out.device, launch
        self.out_aligned = out.data_ptr() % 16 == 0
        # The address check of _check_updated_in_place / _check_read_apart: state and z_state.
        self.apart = WrittenApart(tensors, written=(3, 4))

    def __call__(self, q, k, v, state, z_state) -> torch.Tensor | None:
        """(B, H, V) output of the replayed launch, or None (nothing launched) when a state's address
        span overlaps another tensor's (the ordinary path's checks decide) or the allocator returned
        an output of another 16-byte alignment than the one the kernel was specialized for."""
        if not self.apart((q, k, v, state, z_state)):
            return None
        out = q.new_empty(self.out_shape)
        if (out.data_ptr() % 16 == 0) is not self.out_aligned:
            return None
        with replay_guard(self.device):
            mark_written(state=state, z_state=z_state)
            self.launch(q, k, v, state, state if z_state is None else z_state, out)
        return out


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    z_state: torch.Tensor | None = None,
    eps: float = 1e-10,
) -> torch.Tensor:
    """One recurrent decode step of causal linear attention, updating the state in place, in Triton.

    Katharopoulos et al. 2020, "Transformers are RNNs", eq. 5-6 (the RNN form); exactly
    :func:`kernels.reference.linear_attention_step`:

        state += k v^T;  o = scale q . state
        with z_state:  z_state += k;  o /= scale q . z_state + eps

    Args:
        q: (B, H, K) feature-mapped query.   k: (B, H, K) feature-mapped key.   v: (B, H, V).
        state: (B, H, K, V) kv state, float32 (or float64), any strides, updated in place.
        scale: defaults to ``K ** -0.5``.
        z_state: (B, H, K) normaliser state, float32 (or float64), updated in place; normalises exactly
            when given.
        eps: added to the normaliser (>= 0; with 0 a row whose normaliser is 0, e.g. relu
            features that are all zero, comes out NaN: the default 1e-10 avoids that).

    Computes in float32 (float64 when q or the state is float64); each state element is read and
    written once. Not differentiable (a decode-time op, like the reference's in-place update).

    An eager step is host-bound: a CUDA call whose signature (scale, eps, and every tensor's shape,
    strides, dtype, device and 16-byte alignment) an earlier call that succeeded had replays that
    call's compiled launch on its own tensors, skipping the checks whose outcome the signature fixes
    (``_StepPlan``); the ordinary path runs while a Triton launch hook is installed.

    Returns:
        (B, H, V) in q's dtype.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor / non-floating inputs or
        mismatched q / k / v dtypes, bad scale; ValueError: wrong ndim or mismatched shapes, tensors
        on different devices, K = 0 without a scale; states written in place that are expanded views,
        overlap each other or require grad), and, for this backend only, RuntimeError for q, k or v
        requiring grad in grad mode (no backward: run it under torch.no_grad()), ValueError for a
        scale or eps beyond fp32's range, devices other than CUDA, or CPU tensors without
        ``TRITON_INTERPRET=1`` (or bfloat16 ones under it).
    """
    # An eager decode loop repeats one call signature: replay its launch (see _StepPlan).
    key = _step_key(q, k, v, state, z_state, scale, eps)
    plan = _STEP_PLANS.get(key)
    if plan is not None:
        out = plan(q, k, v, state, z_state)
        if out is not None:
            return out

    scale = _check_linear_attention_step_args(q, k, v, state, z_state, scale, eps)
    check_no_grad("linear_attention_step", q=q, k=k, v=v)
    check_device("linear_attention_step", q, k, v, state, z_state)  # one device: checked above
    check_fp32_scalars("linear_attention_step", scale=scale, eps=eps)
    batch, num_heads, k_dim = q.shape
    v_dim = v.shape[2]
    out = torch.empty((batch, num_heads, v_dim), dtype=q.dtype, device=q.device)
    if batch * num_heads == 0 or k_dim == 0:
        return out.zero_()  # K == 0: the state is empty and q . state is 0 (0 / eps normalised)
    fp64 = torch.float64 in (q.dtype, state.dtype)
    # V == 0 still launches (one masked column) so that z_state is updated.
    block_e = max(1, next_power_of_2(v_dim))
    # (BLOCK_D, BLOCK_E) tiles of at most 4096 elements: 32 fp32 registers a thread at 4 warps.
    block_d = min(next_power_of_2(k_dim), max(1, 4096 // block_e))
    tensors = (q, k, v, state, z_state if z_state is not None else state, out)
    grid = (batch * num_heads,)
    args = (
        *tensors,
        *q.stride(), *k.stride(), *v.stride(), *state.stride(), *strides(z_state, 3),
        num_heads, k_dim, v_dim, *_scale_args(float(scale), fp64), float(eps),
    )  # fmt: skip
    kwargs = dict(HAS_Z=z_state is not None, FP64=fp64, BLOCK_D=block_d, BLOCK_E=block_e, num_warps=4)
    with device_guard(q):
        mark_written(state=state, z_state=z_state)
        compiled = linear_attention_step_kernel[grid](*args, **kwargs)
    if key is not None:
        launch = CompiledLaunch.build(linear_attention_step_kernel, compiled, grid, args, kwargs, len(tensors))
        if launch is not None:
            _STEP_PLANS.remember(key, _StepPlan((q, k, v, state, z_state), out, launch))
    return out

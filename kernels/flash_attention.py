"""FlashAttention-2 in Triton: exact masked softmax attention, forward and backward.

``flash_attention(q, k, v, *, causal=True, window=None, scale=None, return_lse=False)`` has exactly
the semantics, shapes, dtypes and errors of :func:`kernels.reference.flash_attention` (bottom-right
aligned causal mask, sliding window counting the current token, GQA, rows without keys -> 0 /
lse -inf / zero gradients) for finite inputs; with a NaN or infinity in a key or value it keeps
IEEE arithmetic over a row's keys, where the reference returns NaN for the rows that see it and
leaves other rows exact (the reference's docstring lists the differences: a hidden non-finite
value reaches the rows of a query tile that loads its key tile). :func:`kernels.flash_attention`
dispatches here for CUDA tensors and for ``backend="triton"`` (CPU tensors run under
``TRITON_INTERPRET=1``).

Algorithm (Dao 2022, "FlashAttention", Algorithm 1; Dao 2023, "FlashAttention-2", Algorithms 1-2):

- forward, ``flash_attention_fwd_kernel``: one program per (query block, head, batch) keeps its Q
  tile on chip and streams the K/V tiles it can see, with the online softmax -- a running row max
  ``m`` and row sum ``l`` rescale the fp32 accumulator, so scores never reach HBM. It writes O and
  the log-sum-exp (LSE), which is all the backward needs.
- backward: ``flash_attention_bwd_preprocess_kernel`` computes ``delta = rowsum(dO * O)``;
  ``flash_attention_bwd_dkdv_kernel`` keeps a K/V block on chip and loops over the query blocks
  (of every query head of its GQA group, so dK/dV are reduced over the group in registers, without
  atomics); ``flash_attention_bwd_dq_kernel`` keeps a query block and loops over K/V blocks. Both
  recompute ``P = exp(S - LSE)`` from Q, K and the saved LSE. Every output element is written by
  exactly one program in a fixed order, so forward and backward are bitwise deterministic.

Masking: for each block the kernels compute which tiles of the other operand can be visible
(causal diagonal, window edge) and loop only over those, in three segments -- boundary tiles
``[lo, a)`` that need the elementwise mask, interior tiles ``[a, b)`` that every row of the block
sees entirely (no mask), boundary tiles ``[b, hi)`` (the diagonal and the sequence tail). The
forward splits ``[lo, a)`` once more and masks each segment only by the edges it can cross (the
window edge alone on ``[lo, w)``), because at small head dims its softmax, not the matrix products,
bounds the speed. Tiles outside ``[lo, hi)`` are never loaded.

Scores are kept in base 2: ``S * scale * log2(e)`` feeds ``exp2`` (one multiply folded into the
scale); the saved LSE stays in base 2 for the backward, and callers get its natural log. float64 inputs (supported for
completeness) use ``exp`` / ``log`` and an fp64 scale split into two fp32 halves, since Triton
passes Python floats as fp32.

Limits of this backend beyond the reference's: head_dim must be in [1, 256]; q, k, v on one
device (CUDA, or CPU under the interpreter). The gradient of the returned lse is supported
(``dS += dlse * P`` folds into ``delta``); double backward is not.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels._host import INTERPRET as _INTERPRET
from kernels._host import (
    cdiv,
    check_device,
    check_fp32_scalars,
    check_int32_offsets,
    device_guard,
    next_power_of_2,
    split_fp64,
)
from kernels.reference import (
    _check_attention_args,
    _compute_dtype,
)

__all__ = ["flash_attention"]

_MAX_HEAD_DIM = 256
# What to do about a sequence whose offsets pass int32 (check_int32_offsets).
_OFFSETS_FIX = (
    "attend over fewer heads a call (contiguous slices, q[:, :, a:b].contiguous()), or pass contiguous "
    "tensors if a wider stride (a view of a fused projection) made it"
)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

# ----------------------------------------------------------------------------------------------
# Autotune configs
# ----------------------------------------------------------------------------------------------

# Under the interpreter: one small config, so that tiny test lengths (17, 65, ...) still span several
# tiles and exercise the skip / boundary / interior segments; BLOCK_M != BLOCK_N so the diagonal
# crosses tile boundaries. On CUDA: a short list per kernel, pruned by head dim (registers / shared
# memory), keyed on head dim, masking mode and power-of-two length buckets.
INTERPRET_FWD_BLOCKS = (32, 16)  # (BLOCK_M, BLOCK_N)
INTERPRET_DKDV_BLOCKS = (16, 32)  # (BLOCK_M inner query tiles, BLOCK_N outer key block)
INTERPRET_DQ_BLOCKS = (32, 16)  # (BLOCK_M outer query block, BLOCK_N inner key tiles)
# Largest tile any config uses (tests poison data just beyond what the first block may touch).
MAX_BLOCK = 32 if _INTERPRET else 128


def _configs(interpret_blocks, cuda_configs):
    if _INTERPRET:
        block_m, block_n = interpret_blocks
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "MAX_D": max_d}, num_warps=w, num_stages=s)
        for bm, bn, w, s, max_d in cuda_configs
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages, largest BLOCK_D the config is meant for). Two or three
# configs per head-dim range and kernel keep autotuning (and compiling) cheap. The forward at head
# dims <= 64 keeps both 4 and 8 warps: on an H200 (Triton 3.6, bf16, T = 8192) 8 warps ran causal
# / non-causal 7-9% faster, 4 warps the sliding window 25% faster. Head dim 256 takes smaller
# tiles and 2 stages: its fp32 accumulators and K/V (or Q/dO) tiles would spill registers or
# overflow shared memory at 128-wide blocks.
_FWD_CONFIGS = _configs(
    INTERPRET_FWD_BLOCKS,
    [
        (128, 64, 4, 3, 64),
        (128, 64, 8, 3, 64),
        (64, 64, 4, 3, 64),
        (128, 64, 8, 3, 128),
        (64, 64, 4, 3, 128),
        (64, 64, 8, 2, 256),
        (64, 32, 4, 2, 256),
    ],
)
# dK/dV: BLOCK_N is the key block a program owns, BLOCK_M the query tiles it streams.
_DKDV_CONFIGS = _configs(
    INTERPRET_DKDV_BLOCKS,
    [
        (32, 128, 4, 3, 64),
        (64, 64, 4, 3, 64),
        (32, 128, 8, 3, 128),
        (32, 64, 4, 3, 128),
        (32, 64, 8, 2, 256),
        (16, 64, 4, 2, 256),
    ],
)
# dQ: BLOCK_M is the query block a program owns, BLOCK_N the key tiles it streams.
_DQ_CONFIGS = _configs(
    INTERPRET_DQ_BLOCKS,
    [
        (128, 32, 4, 3, 64),
        (64, 64, 4, 3, 64),
        (128, 32, 8, 3, 128),
        (64, 32, 4, 3, 128),
        (64, 32, 8, 2, 256),
        (32, 32, 4, 2, 256),
    ],
)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs meant for this head dim: the smallest MAX_D >= BLOCK_D (CUDA only).

    fp32 / fp64 inputs get one small config instead: their IEEE products run on FMA units, not
    tensor cores, and Triton unrolls such a dot completely -- with 64 x 64 tiles ptxas took ~100 s
    for the three kernels on an H200 (Triton 3.6), so tiles shrink to 32 (16 at head dim 256) and
    nothing is autotuned.
    """
    if _INTERPRET:
        return configs
    args = {**named_args, **kwargs}
    fitting = sorted({c.kwargs["MAX_D"] for c in configs if c.kwargs["MAX_D"] >= args["BLOCK_D"]})
    target = fitting[0] if fitting else max(c.kwargs["MAX_D"] for c in configs)
    if args["Q"].dtype in (torch.float32, torch.float64):
        block = 32 if args["BLOCK_D"] <= 128 else 16
        return [
            triton.Config({"BLOCK_M": block, "BLOCK_N": block, "MAX_D": target}, num_warps=4, num_stages=2)
        ]
    return [c for c in configs if c.kwargs["MAX_D"] == target]


_AUTOTUNE_KEY = ["Q_BUCKET", "K_BUCKET", "BLOCK_D", "CAUSAL", "HAS_WINDOW"]
# Lengths, head counts and the window vary at run time; specialising on them (== 1, % 16) would
# compile a kernel per length class for no speed gain (they only feed bounds and masks).
_RUNTIME_INTS = ["num_heads", "group", "Tq", "Tk", "window", "Q_BUCKET", "K_BUCKET"]


def _bucket(n: int) -> int:
    """Autotune key for a length: the next power of two, clamped to [1024, 16384]. Short sequences
    (launch-bound, or chunked prefill at many lengths) share one tuning instead of re-benchmarking."""
    return min(max(next_power_of_2(max(n, 1)), 1024), 16384)


# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------
# Kernel argument lists stay packed (one per line would triple this section's length).
# fmt: off


@triton.jit
def _kv_tile_bounds(
    start_m, Tq, Tk, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr
):
    """Key-tile starts for query rows [start_m, start_m + BLOCK_M): window-edge tiles [lo, w),
    tiles on both edges [w, a), full [a, b), causal-edge / tail tiles [b, hi);
    lo <= w <= a <= b <= hi, lo a multiple of BLOCK_N, w, a and b multiples or == hi.

    Query i sees key j iff j <= i + diag (causal) and j > i + diag - window, diag = Tk - Tq. Tiles in
    [lo, w) are in bounds and causally visible to every row of the block, so only the window edge
    needs a mask there; tiles in [b, hi) lie inside every row's window.
    """
    diag = Tk - Tq
    m_last = tl.minimum(start_m + BLOCK_M, Tq) - 1
    if CAUSAL:
        # Last visible key of the block's last row; interior tiles end at the first row's diagonal.
        hi = tl.minimum(tl.maximum(m_last + diag + 1, 0), Tk)
        b = tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N
    else:
        hi = Tk
        b = Tk
    b = tl.minimum(b, Tk // BLOCK_N * BLOCK_N)  # the key tail is a boundary tile
    if HAS_WINDOW:
        # First visible key of the first row; interior tiles start where the last row's window does.
        lo = tl.maximum(start_m + diag - window + 1, 0) // BLOCK_N * BLOCK_N
        a = tl.cdiv(tl.maximum(start_m + BLOCK_M + diag - window, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        a = 0
    a = tl.minimum(tl.maximum(a, lo), hi)
    w = tl.maximum(tl.minimum(a, b), lo)  # before b is clamped: tiles below b are causally visible
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, w, a, b, hi


@triton.jit
def _q_tile_bounds(
    start_n, Tq, Tk, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr
):
    """Query-tile starts for keys [start_n, start_n + BLOCK_N): masked [lo, a), full [a, b),
    masked [b, hi), same conventions as :func:`_kv_tile_bounds` with the roles swapped.

    Key j is seen by query i iff i >= j - diag (causal) and i < j - diag + window.
    """
    diag = Tk - Tq
    n_last = tl.minimum(start_n + BLOCK_N, Tk) - 1
    if CAUSAL:
        # First query that sees the block's first key; interior tiles start where the first row
        # already sees the block's last key.
        lo = tl.minimum(tl.maximum(start_n - diag, 0), Tq) // BLOCK_M * BLOCK_M
        a = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        a = 0
    if HAS_WINDOW:
        # One past the last query whose window still holds the block's last key; interior tiles
        # end where the last row's window still holds the block's first key.
        hi = tl.minimum(tl.maximum(n_last - diag + window, 0), Tq)
        b = tl.maximum(start_n - diag + window, 0) // BLOCK_M * BLOCK_M
    else:
        hi = Tq
        b = Tq
    b = tl.minimum(b, Tq // BLOCK_M * BLOCK_M)  # the query tail is a boundary tile
    a = tl.minimum(tl.maximum(a, lo), hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def _visible(offs_m, offs_n, Tq, Tk, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the pairs query i sees key j, in-bounds pairs only."""
    visible = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        last = offs_m[:, None] + (Tk - Tq)
        visible = visible & (offs_n[None, :] <= last)
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > last - window)
    return visible


@triton.jit
def _scale_scores(s, qk_scale, qk_scale_lo, FP64: tl.constexpr):
    """Scaled scores: base-2 (``scale * log2 e`` folded in) for fp32 math; natural for fp64, where
    the scale arrives as two fp32 halves (Triton passes Python floats as fp32)."""
    if FP64:
        # One multiply by the rejoined fp64 scale: s * hi + s * lo would turn an infinite score
        # into inf * 0 = NaN whenever lo is 0.
        return s * (tl.cast(qk_scale, tl.float64) + tl.cast(qk_scale_lo, tl.float64))
    else:
        return s * qk_scale


@triton.jit
def _exp(x, FP64: tl.constexpr):
    if FP64:
        return tl.exp(x)
    else:
        return tl.exp2(x)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, start, end,
    Tk, diag, window, qk_scale, qk_scale_lo, WINDOW_EDGE: tl.constexpr, CAUSAL_EDGE: tl.constexpr,
    KEY_TAIL: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Online softmax over the key tiles starting in [start, end) (FA2 Alg. 1, lines 6-10).

    The mask applies only the edges a segment can cross (see :func:`_kv_tile_bounds`): per score
    the softmax is the bottleneck at small head dims, so every compare counts. Rows past Tq are
    never stored and need no mask; with CAUSAL_EDGE, ``j <= i + diag`` already implies ``j < Tk``
    for the rows that are.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32  # the dots accumulate in fp64 for fp64
    MASKED: tl.constexpr = WINDOW_EDGE or CAUSAL_EDGE or KEY_TAIL
    d_mask = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CAUSAL_EDGE or KEY_TAIL:
            kv_mask = (offs_n < Tk)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(
            k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
        s = _scale_scores(s, qk_scale, qk_scale_lo, FP64)
        if CAUSAL_EDGE:
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + diag, s, float("-inf"))
        if WINDOW_EDGE:
            s = tl.where(offs_n[None, :] > offs_m[:, None] + (diag - window), s, float("-inf"))
        if KEY_TAIL:
            s = tl.where((offs_n < Tk)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that has seen no visible key yet has m_new = -inf; shifting by a finite 0 keeps
            # exp(-inf - -inf) = NaN out: its p and alpha become 0 and l stays 0.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new  # interior tiles: every score is finite, so m_new is too
        p = _exp(s - m_shift[:, None], FP64)
        alpha = _exp(m_i - m_shift, FP64)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(
    configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_configs}
)
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def flash_attention_fwd_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    num_heads, group, Tq, Tk, window, qk_scale, qk_scale_lo,
    Q_BUCKET, K_BUCKET,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_D: tl.constexpr = 0,
):  # fmt: skip
    """O and LSE for one (query block, head, batch); grid (cdiv(Tq, BLOCK_M), Hq, B)."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest rows (most key tiles) start first
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // group).to(tl.int64)
    head = head.to(tl.int64)
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_base = Q + batch * stride_qb + head * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)

    lo, w, a, b, hi = _kv_tile_bounds(start_m, Tq, Tk, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    diag = Tk - Tq
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, lo, w,
        Tk, diag, window, qk_scale, qk_scale_lo, True, False, False, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N, BLOCK_D
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, w, a,
        Tk, diag, window, qk_scale, qk_scale_lo, True, True, False, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N, BLOCK_D
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, a, b,
        Tk, diag, window, qk_scale, qk_scale_lo, False, False, False, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N, BLOCK_D
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, b, hi,
        Tk, diag, window, qk_scale, qk_scale_lo, False, CAUSAL, not CAUSAL, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N, BLOCK_D
    )

    # A row with a visible key has l >= 1 (its max contributes exp(0)); l == 0 means no key: the
    # output is 0 (acc is 0, divided by 1) and the lse is -inf, never NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    # The lse stays in the scores' base (base 2 unless fp64): the backward recomputes
    # P = exp2(S - lse) from it without a round trip through the natural log, whose two extra
    # roundings would perturb every P by ~ulp(lse) (a row seeing one key would get P != 1).
    if FP64:
        lse = m_i + tl.log(l_safe)
    else:
        lse = m_i + tl.log2(l_safe)
    lse = tl.where(empty, float("-inf"), lse)

    o_base = Out + batch * stride_ob + head * stride_oh
    tl.store(
        o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty),
        mask=q_mask
    )
    lse_base = LSE + (batch * num_heads + head) * Tq
    tl.store(lse_base + offs_m, lse.to(LSE.dtype.element_ty), mask=offs_m < Tq)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_heads", "Tq"])
def flash_attention_bwd_preprocess_kernel(
    Out, DO, DLSE, DELTA,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lt,
    num_heads, Tq,
    HAS_DLSE: tl.constexpr, FP64: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) - dlse (FA2 Alg. 2, line 4); grid (cdiv(Tq, BLOCK_M), Hq, B).

    With the lse's gradient: d lse_i / d S_ij = P_ij, so dS = P * (dP - delta) still holds with
    ``dlse`` subtracted from delta; dV does not depend on the lse.
    """
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out
        + batch * stride_ob
        + head * stride_oh
        + offs_m[:, None] * stride_ot
        + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    ).to(ACC)
    do = tl.load(
        DO
        + batch * stride_dob
        + head * stride_doh
        + offs_m[:, None] * stride_dot
        + offs_d[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    ).to(ACC)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        dlse = tl.load(
            DLSE + batch * stride_lb + head * stride_lh + offs_m * stride_lt, mask=offs_m < Tq, other=0.0
        ).to(ACC)
        delta = delta - dlse
    tl.store(DELTA + (batch * num_heads + head) * Tq + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _load_row_stats(LSE, DELTA, row_base, offs_m, Tq, FP64: tl.constexpr):
    """LSE (stored in the scores' base by the forward) and delta for query rows offs_m. Rows without
    keys (lse = -inf) get +inf, so their recomputed P = exp(S - lse) is 0 even before any mask."""
    in_bounds = offs_m < Tq
    lse = tl.load(LSE + row_base + offs_m, mask=in_bounds, other=0.0)
    lse_b = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + row_base + offs_m, mask=in_bounds, other=0.0)
    return lse_b, delta


@triton.jit
def _bwd_dkdv_tiles(
    dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qd, stride_dot, stride_dod, offs_n,
    offs_d, start, end, Tq, Tk, window, qk_scale, qk_scale_lo, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr
):
    """dK, dV contributions of the query tiles starting in [start, end) (FA2 Alg. 2, lines 11-21),
    in the transposed layout (keys along rows) so dK and dV accumulate without transposes."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    d_mask = offs_d < HEAD_DIM
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if MASKED:
            q_mask = (offs_m < Tq)[:, None] & d_mask[None, :]
        else:
            q_mask = d_mask[None, :]
        q = tl.load(
            q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0
        )
        do = tl.load(
            do_base + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0
        )
        lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Tq, FP64)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC)  # (BLOCK_N, BLOCK_M) = S^T
        p_t = _exp(_scale_scores(s_t, qk_scale, qk_scale_lo, FP64) - lse[None, :], FP64)
        if MASKED:
            # where() selects, so an inf or NaN computed at an invisible pair never propagates.
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, Tq, Tk, window, CAUSAL, HAS_WINDOW)), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC)  # dP^T = V dO^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS = P * (dP - delta); the scale is applied at the end
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dk, dv


@triton.autotune(
    configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_configs}
)
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def flash_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_dkb, stride_dkt, stride_dkh, stride_dkd,
    stride_dvb, stride_dvt, stride_dvh, stride_dvd,
    num_heads, group, Tq, Tk, window, qk_scale, qk_scale_lo, scale, scale_lo,
    Q_BUCKET, K_BUCKET,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_D: tl.constexpr = 0,
):  # fmt: skip
    """dK, dV of one (key block, KV head, batch), summed over the KV head's query heads;
    grid (cdiv(Tk, BLOCK_N), Hkv, B)."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n < Tk)[:, None] & (offs_d < HEAD_DIM)[None, :]
    kv_head64 = kv_head.to(tl.int64)
    k = tl.load(
        K
        + batch * stride_kb
        + kv_head64 * stride_kh
        + offs_n[:, None] * stride_kt
        + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + batch * stride_vb
        + kv_head64 * stride_vh
        + offs_n[:, None] * stride_vt
        + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)

    # Key rows >= Tk are zero-padded and never stored; each row of dK / dV only sums its own key's
    # terms, so they need no mask here.
    lo, a, b, hi = _q_tile_bounds(start_n, Tq, Tk, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for g in range(0, group):
        # GQA: query heads kv_head * group + g all read this K/V block; their terms add up here.
        head = (kv_head * group + g).to(tl.int64)
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = DO + batch * stride_dob + head * stride_doh
        row_base = (batch * num_heads + head) * Tq
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, offs_d, lo, a, Tq, Tk, window, qk_scale, qk_scale_lo, True, CAUSAL, HAS_WINDOW, FP64,
            DOT_PRECISION, HEAD_DIM, BLOCK_M
        )
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, offs_d, a, b, Tq, Tk, window, qk_scale, qk_scale_lo, False, CAUSAL, HAS_WINDOW, FP64,
            DOT_PRECISION, HEAD_DIM, BLOCK_M
        )
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, offs_d, b, hi, Tq, Tk, window, qk_scale, qk_scale_lo, True, CAUSAL, HAS_WINDOW, FP64,
            DOT_PRECISION, HEAD_DIM, BLOCK_M
        )

    dk = _scale_scores(dk, scale, scale_lo, FP64)  # dS/dK = scale * dS^T Q (true scale, not base 2)
    tl.store(
        DK + batch * stride_dkb + kv_head64 * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None,
        :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=kv_mask
    )
    tl.store(
        DV + batch * stride_dvb + kv_head64 * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None,
        :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kv_mask
    )


@triton.jit
def _bwd_dq_tiles(
    dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, start,
    end, Tq, Tk, window, qk_scale, qk_scale_lo, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr
):
    """dQ contributions of the key tiles starting in [start, end) (FA2 Alg. 2, lines 12-20)."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    d_mask = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            kv_mask = (offs_n < Tk)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(
            k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
        p = _exp(_scale_scores(s, qk_scale, qk_scale_lo, FP64) - lse[:, None], FP64)
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, Tq, Tk, window, CAUSAL, HAS_WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dq


@triton.autotune(
    configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_configs}
)
@triton.jit(do_not_specialize=_RUNTIME_INTS)
def flash_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    num_heads, group, Tq, Tk, window, qk_scale, qk_scale_lo, scale, scale_lo,
    Q_BUCKET, K_BUCKET,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_D: tl.constexpr = 0,
):  # fmt: skip
    """dQ of one (query block, head, batch); grid (cdiv(Tq, BLOCK_M), Hq, B)."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // group).to(tl.int64)
    head = head.to(tl.int64)
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(
        DO
        + batch * stride_dob
        + head * stride_doh
        + offs_m[:, None] * stride_dot
        + offs_d[None, :] * stride_dod,
        mask=q_mask,
        other=0.0,
    )
    lse, delta = _load_row_stats(LSE, DELTA, (batch * num_heads + head) * Tq, offs_m, Tq, FP64)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)

    # The window-edge-only split [lo, w) is a forward refinement; here [lo, a) takes the full mask.
    lo, _, a, b, hi = _kv_tile_bounds(start_m, Tq, Tk, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    dq = _bwd_dq_tiles(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, lo,
        a, Tq, Tk, window, qk_scale, qk_scale_lo, True, CAUSAL, HAS_WINDOW, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N
    )
    dq = _bwd_dq_tiles(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, a,
        b, Tq, Tk, window, qk_scale, qk_scale_lo, False, CAUSAL, HAS_WINDOW, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N
    )
    dq = _bwd_dq_tiles(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, offs_m, offs_d, b,
        hi, Tq, Tk, window, qk_scale, qk_scale_lo, True, CAUSAL, HAS_WINDOW, FP64, DOT_PRECISION, HEAD_DIM,
        BLOCK_N
    )

    dq = _scale_scores(dq, scale, scale_lo, FP64)
    tl.store(
        DQ + batch * stride_dqb + head * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None,
        :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=q_mask
    )


# fmt: on


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _launch_params(q: torch.Tensor, scale: float, window: int | None, seqlen_k: int) -> dict:
    fp64 = q.dtype == torch.float64
    # scale * log2(e) turns exp into exp2 (the scores live in base 2); fp64 keeps the natural base.
    qk_scale, qk_scale_lo = split_fp64(scale) if fp64 else (scale * _LOG2E, 0.0)
    scale_hi, scale_lo = split_fp64(scale) if fp64 else (scale, 0.0)
    head_dim = q.shape[3]
    return dict(
        qk=(qk_scale, qk_scale_lo),
        scale=(scale_hi, scale_lo),
        # A window at least Tk long excludes nothing (query i's first candidate is
        # i + Tk - Tq - window + 1 <= 0): take the plain causal path and skip the window compares.
        window=window if window is not None and window < seqlen_k else None,
        meta=dict(
            FP64=fp64,
            # fp32 inputs: IEEE fp32 products (TF32 would cost ~1e-3 relative error); 16-bit inputs
            # multiply exactly in the tensor cores either way.
            DOT_PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, next_power_of_2(head_dim)),
        ),
    )


def _forward(q, k, v, causal: bool, window: int | None, scale: float):
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    o = torch.empty((batch, seqlen_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=_compute_dtype(q.dtype), device=q.device)
    if o.numel() == 0:
        return o, lse
    params = _launch_params(q, scale, window, seqlen_k)
    window = params["window"]

    def grid(meta):
        return (cdiv(seqlen_q, meta["BLOCK_M"]), num_heads, batch)

    flash_attention_fwd_kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, window or 0, *params["qk"],
        _bucket(seqlen_q), _bucket(seqlen_k),
        CAUSAL=causal, HAS_WINDOW=window is not None, **params["meta"],
    )  # fmt: skip
    return o, lse


def _backward(do, dlse, q, k, v, o, lse, causal: bool, window: int | None, scale: float):
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if o.numel() == 0:  # no query rows: nothing reads K or V
        return dq, dk.zero_(), dv.zero_()
    if do is None:  # only the lse was used
        do = torch.zeros_like(o)
    check_int32_offsets("flash_attention", _OFFSETS_FIX, (1, 3), do=do)
    params = _launch_params(q, scale, window, seqlen_k)
    window = params["window"]
    meta = params["meta"]

    delta = torch.empty((batch, num_heads, seqlen_q), dtype=lse.dtype, device=q.device)
    block_m = 32 if _INTERPRET else max(16, min(128, 8192 // meta["BLOCK_D"]))
    flash_attention_bwd_preprocess_kernel[(cdiv(seqlen_q, block_m), num_heads, batch)](
        o, do, dlse if dlse is not None else delta, delta,
        *o.stride(), *do.stride(), *(dlse.stride() if dlse is not None else (0, 0, 0)),
        num_heads, seqlen_q,
        HAS_DLSE=dlse is not None, FP64=meta["FP64"], HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"],
        BLOCK_M=block_m,
    )  # fmt: skip

    common = (
        num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, window or 0, *params["qk"], *params["scale"],
        _bucket(seqlen_q), _bucket(seqlen_k),
    )  # fmt: skip
    flash_attention_bwd_dkdv_kernel[lambda m: (cdiv(seqlen_k, m["BLOCK_N"]), num_kv_heads, batch)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *common, CAUSAL=causal, HAS_WINDOW=window is not None, **meta,
    )  # fmt: skip
    flash_attention_bwd_dq_kernel[lambda m: (cdiv(seqlen_q, m["BLOCK_M"]), num_heads, batch)](
        q, k, v, do, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        *common, CAUSAL=causal, HAS_WINDOW=window is not None, **meta,
    )  # fmt: skip
    return dq, dk, dv


class _FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: saves q, k, v, o and the lse (O(T) extra memory, no scores)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale, return_lse):
        with device_guard(q):
            o, lse = _forward(q, k, v, causal, window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.window, ctx.scale = causal, window, scale
        if not return_lse:
            return o
        # The kernels keep the lse in the scores' base (2, or e for fp64); callers get the natural log.
        # The unused output's gradient arrives as None instead of zeros.
        ctx.set_materialize_grads(False)
        # A copy either way, so that the caller may modify it in place without touching the saved lse.
        return o, lse.clone() if q.dtype == torch.float64 else lse * _LN2

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse=None):
        q, k, v, o, lse = ctx.saved_tensors
        with device_guard(q):
            dq, dk, dv = _backward(do, dlse, q, k, v, o, lse, ctx.causal, ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact masked softmax attention ``o = softmax(scale * q k^T + mask) v``, FlashAttention-2 in
    Triton (Dao 2022, Algorithm 1; Dao 2023, Algorithms 1-2), differentiable in q, k, v (and
    through the returned lse).

    Args:
        q: (B, Tq, Hq, D) queries, float16 / bfloat16 / float32 / float64, any strides.
        k: (B, Tk, Hkv, D) keys, same dtype as q.
        v: (B, Tk, Hkv, D) values, same shape and dtype as k.
        causal: mask bottom-right aligned: query i sees key j iff ``j <= i + Tk - Tq``.
        window: sliding window w > 0 (only with causal=True), counting the current token:
            query i additionally needs ``j > i + Tk - Tq - w``.
        scale: score scale; defaults to ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled, masked scores.

    Grouped-query attention: query head h reads KV head ``h // (Hq // Hkv)``.
    Rows that see no key return 0, lse -inf and finite (zero) gradients.
    Accumulation is fp32 for 16-bit and fp32 inputs (fp64 for fp64); fp32 products are IEEE, not TF32.

    Returns:
        o (B, Tq, Hq, D) in q's dtype; with return_lse also lse (B, Hq, Tq), natural log, float32
        for 16-bit inputs and the input dtype otherwise.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor inputs, dtypes other
        than fp16/bf16/fp32/fp64, mismatched dtypes, non-bool causal or return_lse, non-int window,
        non-float scale; ValueError: wrong ndim, mismatched batch / head_dim / k-v shapes, no heads or
        head_dim 0, Hq not a multiple of Hkv, Tk == 0, window <= 0 or beyond int64, window with
        causal=False, non-finite scale, tensors on different devices), and, for this backend only,
        ValueError for head_dim above 256, a scale beyond float32's range, inputs on a device other
        than CUDA / CPU, CPU inputs without ``TRITON_INTERPRET=1`` (or bfloat16 ones under it), or a
        sequence whose offsets in q, k, v, o or the output gradient reach 2**31 elements
        (``(T - 1) * stride``: the kernels index the sequence in int32;
        ``kernels._host.check_int32_offsets``).
    """
    # The reference's validation: same checks, order and messages.
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, scale = _check_attention_args(
        q, k, v, causal, window, scale, return_lse
    )

    # This backend's own limits.
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"the Triton flash_attention supports head_dim in [1, {_MAX_HEAD_DIM}], got {head_dim}; "
            "use backend='reference'"
        )
    check_fp32_scalars("flash_attention", _LOG2E, scale=scale)
    check_device("flash_attention", q, k, v)  # one device: checked by the shared validation
    # o, dq (q's shape) and dk, dv (k's) are allocated contiguous.
    check_int32_offsets("flash_attention", _OFFSETS_FIX, (1, 3), q=q, k=k, v=v, o=q.shape, dk=k.shape)

    return _FlashAttentionFunction.apply(q, k, v, bool(causal), window, float(scale), bool(return_lse))

"""FlashDecoding in Triton: one decode step of attention over a paged KV cache, split along the keys.

``flash_decode(q, k_cache, v_cache, block_table, seqlens, *, window=None, scale=None, num_splits=None)``
has exactly the semantics, shapes, dtypes and errors of :func:`kernels.reference.flash_decode`
(vLLM-style pages gathered through a block table, per-sequence lengths, a window counting the current
token, GQA, sequences of length 0 -> 0); :func:`kernels.flash_decode` dispatches here for CUDA
tensors and for ``backend="triton"`` (CPU tensors run under ``TRITON_INTERPRET=1``).

Why a split: at decode each sequence has one query per head, so FlashAttention's parallelism over
query blocks is gone and a (batch, KV head) grid leaves most SMs idle at small batch -- while the
step is bound by reading the KV cache. FlashDecoding (Dao, Haziza, Massa, Sizov 2023,
"Flash-Decoding for long-context inference") also splits the keys ``num_splits`` ways:

- ``flash_decode_split_kernel``, grid ``(B, Hkv, num_splits)``: a program owns one KV head of one
  sequence and one split of its visible keys. It loads the queries of *all* the KV head's GQA group
  as one ``(BLOCK_G, D)`` tile (the group padded to >= 16 rows, the smallest ``tl.dot`` tile), so
  each K/V tile is read from HBM once per group, not once per query head. It streams its split's
  keys ``BLOCK_N`` at a time, gathering every key's page through the block table, with the online
  softmax of FlashAttention-2 (Dao 2023, Algorithm 1, lines 6-10): running row max ``m``, row sum
  ``l`` and the unnormalised fp32 accumulator ``acc``. It writes ``(acc, m, l)`` to a small fp32
  workspace -- ``(B, Hq, num_splits, D)`` plus two ``(B, Hq, num_splits)`` -- or, with one split,
  the normalised output directly (one launch).
- ``flash_decode_combine_kernel``, grid ``(Hq, B)``: merges the splits of one query head with the
  same rescaling, ``M = max_s m_s``, ``o = sum_s e^{m_s - M} acc_s / sum_s e^{m_s - M} l_s``
  (FlashAttention-2's rescaling algebra applied across splits instead of across tiles), reading the
  splits ``BLOCK_S`` at a time with a running max so any ``num_splits`` fits in registers.

A sequence's visible keys are ``[lo, seqlens[b])`` with ``lo = max(0, seqlens[b] - window)``, cut
into ``BLOCK_N``-key tiles; split ``s`` takes tiles ``s, s + S, s + 2S, ...`` of ``S = num_splits``,
so the splits of each sequence stay balanced to one tile whatever its length, and, without a
window, the position of a split's first tile does not depend on ``seqlens[b]``. That is what the
tile order is for. Each program starts with a chain of dependent loads -- its length, then
block-table entries, then K and V -- and after a cold L2 every link is a DRAM round trip; so the
first tile's table entries are loaded beside the length (bounded by the table's capacity: entries
past the sequence's pages may be loaded, but no K / V is read through them), and every later
tile's one tile ahead of its K and V, in the loop. On the H200 (2026-12-02, bf16, CUDA graphs
after a read flush; ``2026-12-02-nvidia-h200-decode-tile-order.json``), against the same tiles
and splits in contiguous chunks with each tile's entries loaded just before its K: with the
64-key tiles in 3 stages of :func:`split_config`, B8 2k (4 splits) 23.8 against 31.8 µs and B1
32k (32 splits) 39.4 against 54.1; with 32-key tiles in 3 stages, B1 8k 16.9 against 18.1 and B8
8k 69.6 against 77.6.
Splits past the end (short sequences, more splits than tiles, empty sequences) run no tile and write
``m = -inf, l = 0, acc = 0``, which the combine weighs by ``e^{-inf} = 0``; a head whose splits are
all empty returns 0. Keys beyond ``seqlens[b]`` (the tail of the last page) and pages outside the
window are never loaded: K and V loads are masked per key, so NaN in unused memory cannot leak.

The number of splits when ``num_splits=None`` comes from :func:`num_splits_heuristic`: from the
shapes only (batch, KV heads and the table's capacity, capped by the window), never from the
values of ``seqlens``, so it stays constant across the steps of a decode loop.

Scores are kept in base 2 (``scale * log2 e`` folded into one multiply, ``exp2``), like
:mod:`kernels.flash_attention`; float64 inputs (supported for exact tests) use ``exp`` and an fp64
scale split into two fp32 halves, since Triton passes Python floats as fp32.

Host side: an eager call costs more host time than the kernels take at short contexts (checks, tile
choice and two launches through ``JITFunction.run``). A call with ``check_values=False`` (the
mixers' caches) stores a plan of its launches under its signature (:func:`_plan_key`), and later
calls with the same signature replay the compiled kernels (:class:`_DecodePlan`): on the H200
machine 44-72 against 96-186 µs of host time a call (2026-12-03,
``2026-12-03-nvidia-h200-decode-replay-1.json``). A CUDA graph of the decode step removes the rest.

Limits of this backend beyond the reference's: head_dim in [1, 256]; all tensors on one device
(CUDA, or CPU under the interpreter); batch <= 65535 and KV heads <= 65535 (CUDA grid axes).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from kernels._host import INTERPRET as _INTERPRET
from kernels._host import (
    CompiledLaunch,
    check_device,
    check_fp32_scalars,
    check_no_grad,
    device_guard,
    launch_hooks_installed,
    next_power_of_2,
    sm_count,
    split_fp64,
)
from kernels.reference import _check_decode_args

__all__ = ["flash_decode", "num_splits_heuristic", "split_config"]

_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2
_LOG2E = math.log2(math.e)

# ----------------------------------------------------------------------------------------------
# Split heuristic
# ----------------------------------------------------------------------------------------------

# SM count assumed where there is none to query (the interpreter): an H100 / H200 SXM.
NOMINAL_SMS = 132
# Split programs per SM when the GPU counts as full. split_config's 16-bit rule gives each program
# 64-key K and V tiles in 3 pipeline stages, two tiles' loads in flight; two such programs per SM
# (256 at batch 1 on an H200) beat four of 32-key tiles (512) at every measured shape but one
# (see split_config): a choice from measurement, not an occupancy limit.
PROGRAMS_PER_SM = 2
# A split shorter than this many keys spends more on its Q load, its partial write and the combine
# than it gains from parallelism.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 128
# Smallest acceptable fraction of the last wave's program slots in use.
WAVE_EFFICIENCY = 0.9


# Cached: it runs on every eager decode call, and a decode loop asks for the same few shapes again
# and again.
@functools.lru_cache(maxsize=4096)
def num_splits_heuristic(batch: int, num_kv_heads: int, seqlen: int, num_sms: int = NOMINAL_SMS) -> int:
    """Number of key splits of :func:`flash_decode` for a step, from shapes only.

    The split kernel launches ``batch * num_kv_heads * s`` programs; a GPU is full when each of its
    ``num_sms`` SMs holds ``PROGRAMS_PER_SM`` of them (one *wave*). With ``waves(s) = programs /
    (num_sms * PROGRAMS_PER_SM)`` the fraction of program slots doing work is ``waves / ceil(waves)``
    (below one wave: the fraction of the GPU used; above: the last wave's tail). The heuristic
    returns the smallest power of two ``s`` in ``[1, s_max]`` whose efficiency reaches
    ``WAVE_EFFICIENCY``, else the most efficient one (the smallest among ties), where ``s_max =
    clamp(seqlen // MIN_SPLIT_TOKENS, 1, MAX_SPLITS)`` keeps every split at least
    ``MIN_SPLIT_TOKENS`` keys long. Powers of two share the usual power-of-two lengths out in
    equal numbers of whole tiles (on the H200, with the keys in contiguous chunks, 64 splits beat 60
    at 8k and 128k keys, and 8 beat 6, 11 and 12 at batch 8; 2026-12-01). Large batches thus get
    one split (no workspace, no combine), batch 1 at long context many: B = 1, 8 KV heads, 132 SMs
    -> 16 splits at 2k keys (128 programs, one an SM), 32 from 8k on (256 programs of 264 slots);
    B = 8 -> 4 splits.

    The same idea as FlashAttention's ``num_splits_heuristic`` (flash-attn ``flash_api.cpp``,
    wave efficiency over a range of split counts); the constants here are our own.

    Args:
        batch: sequences in the step (>= 0).
        num_kv_heads: KV heads (one program per KV head and split: the GQA group shares it).
        seqlen: keys a sequence may see: the block table's capacity, capped by the window.
        num_sms: streaming multiprocessors of the GPU.

    Returns:
        int >= 1.
    """
    programs = max(batch * num_kv_heads, 1)
    slots = max(num_sms, 1) * PROGRAMS_PER_SM
    s_max = min(max(seqlen // MIN_SPLIT_TOKENS, 1), MAX_SPLITS)
    best, best_efficiency = 1, 0.0
    splits = 1
    while splits <= s_max:
        waves = programs * splits / slots
        efficiency = waves / math.ceil(waves)
        if efficiency >= WAVE_EFFICIENCY:
            return splits
        if efficiency > best_efficiency:
            best, best_efficiency = splits, efficiency
        splits *= 2
    return best


# Shared memory a program may opt into where there is none to query: an H100 / H200's 227 KB.
NOMINAL_SHARED_BYTES = 232448


@functools.cache
def _max_shared_bytes(device: torch.device) -> int:
    """Opt-in shared memory per program in bytes (Triton's own figure, which it checks launches
    against); the nominal H200 figure off CUDA."""
    if device.type != "cuda":
        return NOMINAL_SHARED_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


# ----------------------------------------------------------------------------------------------
# Tile configs
# ----------------------------------------------------------------------------------------------

# Under the interpreter: 16-key tiles, so test lengths (17, 65, 127) span several tiles and splits.
INTERPRET_BLOCK_N = 16
# Splits the combine kernel reads per pass. On CUDA up to 64 (the heuristic's 64 at batch 1 in one
# pass: a (64, 128) fp32 tile is 64 registers a thread at 4 warps), since each extra pass adds a
# dependent round trip to L2 while the step waits on the combine. Under the interpreter 4, so the
# tests' 5 and 16 splits run the running-max merge across passes.
COMBINE_BLOCK_S = 4 if _INTERPRET else 64
# Lengths, the group size, the page size and the split count vary at run time; specialising on
# them would compile a kernel per value class for no speed gain (they only feed bounds and masks).
_RUNTIME_INTS = ["group", "block_size", "window", "num_splits", "capacity"]


def split_config(
    dtype: torch.dtype,
    block_d: int,
    programs: int,
    num_sms: int = NOMINAL_SMS,
    max_shared: int = NOMINAL_SHARED_BYTES,
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel, chosen from the launch's shape.

    A rule rather than Triton's autotuner: the autotuner times eager launches, and from Python a
    decode launch costs ~100 µs of host time against a 10-20 µs kernel at batch 1, so it timed the
    host and picked at random (on the H200 the step was 20.4 µs at B1 8k where the best config
    takes 18.2). The rule, from sweeps in CUDA graphs on the H200 (bf16, head dim 128, GQA 4,
    batch 1 and 8, 2k-128k keys, power-of-two splits; 2026-12-01, and 2026-12-02 with this
    kernel's tile order and table prefetch): at most one program per SM (batch 1, 2k keys: 128
    programs) -> 128-key tiles, the most bytes in flight per program (10.5 µs against 12.6 with
    32-key tiles); otherwise 64-key tiles in 3 stages, two programs per SM (``PROGRAMS_PER_SM``),
    two tiles' loads in flight each. Against 32-key tiles in 3 stages with twice the splits (four
    programs per SM), at SDPA's 16.5 / 38.7 / 23.3 / 67.6 / 246.4 µs (B1 8k, B1 32k, B8 2k, B8 8k,
    B8 32k): 17.2 / 39.4 / 23.5 / 68.0 / 244.6 µs against 16.9 / 39.8 / 24.6 / 69.8 / 249.6
    (``2026-12-02-nvidia-h200-decode-tile-rule.json``); 64-key tiles in 2 stages, the rule before
    the table prefetch, lost up to 40% with it. Tiles stay <= 32 KB a stage in 16 bits (head dim
    256: 64 keys), and the K and V tiles of all stages within 3/4 of ``max_shared`` (the rest is
    room for the compiler's own buffers): on a GPU with ~100 KB a program (sm_86 / sm_89) the key
    tile halves, then the stages drop, until they fit; the H200's 227 KB fits both choices above.
    fp32 / fp64 inputs get 32-key tiles in 2 stages: their IEEE dots run on FMA units and unroll
    completely. Under the interpreter, INTERPRET_BLOCK_N keys in one stage.

    Args:
        dtype: q's dtype.
        block_d: head dim padded to a power of two (>= 16).
        programs: split programs launched, ``B * Hkv * num_splits``.
        num_sms: streaming multiprocessors of the GPU.
        max_shared: opt-in shared memory per program of the GPU, bytes.

    Returns:
        (BLOCK_N, num_warps, num_stages).
    """
    if _INTERPRET:
        return INTERPRET_BLOCK_N, 4, 1
    if dtype in (torch.float32, torch.float64):
        return 32, 4, 2
    block_n, stages = (128, 2) if programs <= num_sms else (64, 3)
    block_n = min(block_n, 16384 // block_d)
    # K and V tiles of every stage, 16-bit: 2 * stages * block_n * block_d * 2 bytes.
    while 4 * stages * block_n * block_d > max_shared * 3 // 4 and (block_n > 16 or stages > 1):
        if block_n > 16:
            block_n //= 2
        else:
            stages -= 1
    return block_n, 4, stages


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
# fmt: off


@triton.jit
def _exp(x, FP64: tl.constexpr):
    if FP64:
        return tl.exp(x)
    else:
        return tl.exp2(x)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def flash_decode_split_kernel(
    Q, K, V, BLOCK_TABLE, SEQLENS, OUT, O_PART, M_PART, L_PART,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tp, stride_sb,
    stride_ob, stride_oh, stride_od,
    group, block_size, window, num_splits, qk_scale, qk_scale_lo, capacity,
    HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, key split); grid (B, Hkv, num_splits). Writes the split's
    unnormalised output and (m, l) per query head of the group to the workspace, or with SPLIT
    False (one split) the normalised output."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    batch = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * group + offs_g  # (BLOCK_G,) the query heads of this KV head's group
    table = BLOCK_TABLE + batch * stride_tb

    seqlen = tl.load(SEQLENS + batch * stride_sb).to(tl.int32)
    lo = 0
    bound = capacity
    if HAS_WINDOW:
        lo = tl.maximum(seqlen - window, 0)
        bound = seqlen
    # The visible keys [lo, seqlen) in BLOCK_N-key tiles; this split takes tiles pid_s, pid_s +
    # num_splits, ... (see the module docstring). Key t lives in page block_table[b, t //
    # block_size], slot t % block_size. The table entries of a tile are loaded one tile ahead of
    # its K / V, and the first tile's, without a window, before seqlen arrives: its keys do not
    # depend on it, so the load is bounded by the table's capacity instead (entries past the
    # sequence's pages may be loaded here, but no K / V is read through them).
    offs_next = lo + pid_s * BLOCK_N + tl.arange(0, BLOCK_N)
    page_next = tl.load(table + (offs_next // block_size) * stride_tp, mask=offs_next < bound, other=0)
    q = tl.load(
        Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_G], dtype=ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=ACC)
    k_base = K + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + kv_head * stride_vh + offs_d[None, :] * stride_vd
    for tile in range(pid_s, tl.cdiv(seqlen - lo, BLOCK_N), num_splits):
        offs_n = lo + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Masked keys (past seqlen) load no K / V: unused memory may hold NaN.
        n_mask = offs_n < seqlen
        page = page_next.to(tl.int64)
        offs_next = offs_n + num_splits * BLOCK_N
        page_next = tl.load(table + (offs_next // block_size) * stride_tp, mask=offs_next < seqlen, other=0)
        slot = (offs_n % block_size).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + page[:, None] * stride_kp + slot[:, None] * stride_ks, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)  # (BLOCK_G, BLOCK_N)
        if FP64:
            s = s * qk_scale + s * qk_scale_lo
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile run holds a visible key, so m_new is finite for every row (padded rows see
        # scores of 0): no -inf - -inf can occur.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = _exp(s - m_new[:, None], FP64)
        alpha = _exp(m_i - m_new, FP64)  # rescales what was accumulated under the old max (0 at first)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + page[:, None] * stride_vp + slot[:, None] * stride_vs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        m_i = m_new

    if SPLIT:
        num_heads = tl.num_programs(1) * group
        part = (batch * num_heads + heads) * num_splits + pid_s  # (BLOCK_G,) workspace rows
        tl.store(M_PART + part, m_i, mask=g_mask)
        tl.store(L_PART + part, l_i, mask=g_mask)
        tl.store(
            O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # l = 0 only when the sequence is empty (no tile ran): its output is 0, not 0 / 0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(OUT.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def flash_decode_combine_kernel(
    O_PART, M_PART, L_PART, OUT,
    stride_ob, stride_oh, stride_od,
    num_splits,
    FP64: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (query head, sequence); grid (Hq, B). Reads BLOCK_S splits at a time
    and keeps a running max, so the rescaling is the online softmax's, one level up."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    head = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    row = (batch * tl.num_programs(0) + head) * num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m_run = tl.full([1], float("-inf"), dtype=ACC)
    l_run = tl.zeros([1], dtype=ACC)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        m = tl.load(M_PART + row + offs_s, mask=s_mask, other=float("-inf"))
        l_s = tl.load(L_PART + row + offs_s, mask=s_mask, other=0.0)
        o = tl.load(O_PART + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 0))
        # Empty splits hold m = -inf; while every split so far is empty, shift by a finite 0 so
        # their weights are e^-inf = 0 instead of e^(-inf - -inf) = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_run - m_shift, FP64)
        w = _exp(m - m_shift, FP64)  # (BLOCK_S,) weight of each split
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m_run = m_new
    # l = 0 only when every split is empty (seqlens[b] == 0): the output is 0.
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(OUT + batch * stride_ob + head * stride_oh + offs_d * stride_od, out.to(OUT.dtype.element_ty),
             mask=d_mask)  # fmt: skip


# fmt: on


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


# Cached launches of recent call signatures; a decode loop uses one or two (the mixers' caches keep
# their shapes), so a small bound only stops a sweep over many shapes from holding them all.
_MAX_PLANS = 64
_PLANS: dict[tuple, _DecodePlan] = {}


def _plan_key(q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values) -> tuple | None:
    """Everything a :func:`flash_decode` call's checks, tile choice and launches depend on except the
    tensors' addresses: the arguments with their types, and each tensor's shape, strides, dtype,
    device and 16-byte alignment (Triton's pointer specialization). None where no plan applies:
    ``check_values`` not False (its device sync costs far more than the launches), or an input that
    is not a plain strided tensor, or q off CUDA (the ordinary path checks them and raises)."""
    if check_values is not False:
        return None
    tensors = (q, k_cache, v_cache, block_table, seqlens)
    if any(type(t) is not torch.Tensor or t.layout is not torch.strided for t in tensors) or not q.is_cuda:
        return None
    # One flat tuple (a decode step builds it on every call); the devices are in it, so a mix of
    # devices never matches a stored plan (the ordinary path refuses it and stores none).
    return (
        type(window), window, type(scale), scale, type(num_splits), num_splits,
        q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() % 16 == 0,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() % 16 == 0,
        block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
        block_table.data_ptr() % 16 == 0,
        seqlens.shape, seqlens.stride(), seqlens.dtype, seqlens.device, seqlens.data_ptr() % 16 == 0,
    )  # fmt: skip


def _remember(key: tuple, plan: _DecodePlan) -> None:
    """Store a plan, dropping the oldest beyond ``_MAX_PLANS``."""
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan


def _split_workspace(rows: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """The split kernel's fp32 (fp64 for fp64) workspace, one flat allocation (an eager step is
    host-bound at small batch): the (B, Hq, num_splits, D) partial outputs, then the (B, Hq,
    num_splits) m and l, indexed by the kernels' row; ``rows = B * Hq * num_splits``. Returns the
    allocation (the partial outputs at its start) and the views of m and l."""
    o_part = torch.empty(rows * (head_dim + 2), dtype=dtype, device=device)
    return o_part, o_part[rows * head_dim :], o_part[rows * (head_dim + 1) :]


class _DecodePlan:
    """The launches of one :func:`flash_decode` call signature (:func:`_plan_key`), replayed by later
    eager calls with their own tensors: the argument checks, the split and tile choice and Triton's
    argument binding ran once, for the first call (:class:`kernels._host.CompiledLaunch`). The output
    and the fp32 workspace are fresh allocations on every call, as on the ordinary path.

    Args:
        out: the first call's (B, Hq, D) output, for its shape, dtype and device.
        rows: its workspace rows (B * Hq * num_splits, :func:`_split_workspace`), or 0 for one split.
        acc_dtype: the workspace's dtype.
        split_launch / combine_launch: the two launches (no combine for one split).
    """

    def __init__(self, out, rows, acc_dtype, split_launch, combine_launch):
        self.out_shape, self.dtype, self.device = out.shape, out.dtype, out.device
        self.rows, self.acc_dtype = rows, acc_dtype
        self.split_launch, self.combine_launch = split_launch, combine_launch

    def __call__(self, q, k_cache, v_cache, block_table, seqlens) -> torch.Tensor | None:
        """(B, Hq, D) output of the replayed launches, or None (nothing launched) when the allocator
        returned an address without the 16-byte alignment the kernels were specialized for."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.rows:
            workspace, m_part, l_part = _split_workspace(self.rows, self.out_shape[-1], self.acc_dtype, self.device)
        else:
            workspace = m_part = l_part = out
        if (out.data_ptr() | workspace.data_ptr()) % 16:
            return None
        # The launcher launches on the current device's context: switch only when q lives elsewhere.
        with contextlib.nullcontext() if torch.cuda.current_device() == self.device.index else device_guard(q):
            self.split_launch(q, k_cache, v_cache, block_table, seqlens, out, workspace, m_part, l_part)
            if self.combine_launch is not None:
                self.combine_launch(workspace, m_part, l_part, out)
        return out


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """One decode step of attention over a paged KV cache, FlashDecoding in Triton (Dao, Haziza,
    Massa, Sizov 2023; online softmax of FlashAttention-2, Dao 2023, Algorithm 1; paging after
    vLLM's PagedAttention, Kwon et al. 2023). Not differentiable (the decode path).

    Sequence b's token t lives at ``k_cache[block_table[b, t // block_size], t % block_size]``; the
    query of sequence b attends to its first ``seqlens[b]`` tokens (the cache already holds the new
    token), only the last ``window`` of them when a window is set. Query head h reads KV head
    ``h // (Hq // Hkv)``. Table entries past a sequence's used pages may hold any value (e.g. -1):
    no page is read through them (one tile's worth of them may be loaded, see the module
    docstring); slots past its length and pages outside its window are never read.

    Args:
        q: (B, Hq, D) queries, float16 / bfloat16 / float32 / float64, any strides.
        k_cache: (num_blocks, block_size, Hkv, D) key pages, same dtype as q, any strides.
        v_cache: (num_blocks, block_size, Hkv, D) value pages, same shape and dtype as k_cache.
        block_table: (B, max_blocks) integer (int32) page indices.
        seqlens: (B,) integer (int32) cached tokens per sequence, in [0, max_blocks * block_size].
        window: sliding window w > 0 counting the current token, or None.
        scale: score scale; defaults to ``D ** -0.5``.
        num_splits: key splits per sequence processed in parallel (>= 1); None picks
            :func:`num_splits_heuristic` for this GPU. Splits beyond a sequence's keys are empty
            and contribute nothing; results differ between split counts only by rounding.
        check_values: check the ranges of ``seqlens`` and the used ``block_table`` entries on the
            host (a device sync costing far more than the kernel); False for callers that build
            them, like the mixers' caches. Out-of-range values with False read arbitrary memory.
            With False, a call whose signature was seen replays that call's compiled launches.

    Accumulation is fp32 for 16-bit and fp32 inputs (fp64 for fp64); fp32 products are IEEE, not TF32.

    Returns:
        (B, Hq, D) in q's dtype; sequences with seqlens == 0 return 0.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor inputs, non-floating q /
        caches or mismatched dtypes, non-integer block_table / seqlens, non-int window or
        num_splits; ValueError: wrong ndim or mismatched shapes, no query or KV head, Hq not a multiple of Hkv, seqlens
        out of [0, max_blocks * block_size], a used page index outside [0, num_blocks), window <= 0,
        num_splits < 1, head_dim 0 without a scale, tensors on different devices), and, for this
        backend only, RuntimeError for inputs that require grad in grad mode (no backward: run it
        under torch.no_grad()), ValueError for head_dim outside [1, 256], a scale beyond fp32's
        range, batch or KV heads above 65535, devices other than CUDA, or CPU inputs without
        ``TRITON_INTERPRET=1`` (or bfloat16 ones under it).
    """
    # An eager decode loop repeats one call signature: replay its launches (see _DecodePlan).
    key = _plan_key(q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None and not launch_hooks_installed():
        check_no_grad("flash_decode", q=q, k_cache=k_cache, v_cache=v_cache)
        out = plan(q, k_cache, v_cache, block_table, seqlens)
        if out is not None:
            return out

    # The reference's validation: same checks, order and messages.
    batch, num_heads, num_kv_heads, head_dim, _, block_size, max_blocks, scale = _check_decode_args(
        q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values
    )

    # This backend's own limits.
    check_no_grad("flash_decode", q=q, k_cache=k_cache, v_cache=v_cache)
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"the Triton flash_decode supports head_dim in [1, {_MAX_HEAD_DIM}], got {head_dim}; "
            "use backend='reference'"
        )
    check_device("flash_decode", q, k_cache, v_cache, block_table, seqlens)  # one device: checked above
    check_fp32_scalars("flash_decode", _LOG2E, scale=scale)
    if batch > _MAX_GRID_YZ or num_kv_heads > _MAX_GRID_YZ:
        raise ValueError(
            f"the Triton flash_decode supports batch and num_kv_heads up to {_MAX_GRID_YZ}, got "
            f"{batch} and {num_kv_heads}; split the batch"
        )

    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    seqlen = max_blocks * block_size  # keys a sequence may hold: a shape, not a device read
    if window is not None:
        seqlen = min(seqlen, window)
    num_sms = sm_count(q.device, NOMINAL_SMS)
    if num_splits is None:
        num_splits = num_splits_heuristic(batch, num_kv_heads, seqlen, num_sms)
    # Splits past the longest possible sequence would all be empty; the grid axis caps it anyway.
    num_splits = min(num_splits, max(seqlen, 1), _MAX_GRID_YZ)

    fp64 = q.dtype == torch.float64
    # scale * log2(e) turns exp into exp2 (scores in base 2); fp64 keeps the natural base, exact.
    qk_scale, qk_scale_lo = split_fp64(scale) if fp64 else (scale * _LOG2E, 0.0)
    block_d = max(16, next_power_of_2(head_dim))
    block_n, num_warps, num_stages = split_config(
        q.dtype, block_d, batch * num_kv_heads * num_splits, num_sms, _max_shared_bytes(q.device)
    )
    group = num_heads // num_kv_heads
    split = num_splits > 1
    acc_dtype = torch.float64 if fp64 else torch.float32
    if split:
        rows = batch * num_heads * num_splits
        o_part, m_part, l_part = _split_workspace(rows, head_dim, acc_dtype, q.device)
    else:  # one split writes the output itself; the workspace pointers are unused
        o_part = m_part = l_part = out

    tensors = (q, k_cache, v_cache, block_table, seqlens)
    split_grid = (batch, num_kv_heads, num_splits)
    split_args = (
        *tensors, out, o_part, m_part, l_part,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_table.stride(), seqlens.stride(0), *out.stride(),
        group, block_size, window or 0, num_splits, qk_scale, qk_scale_lo, max_blocks * block_size,
    )  # fmt: skip
    split_kwargs = dict(
        HAS_WINDOW=window is not None, SPLIT=split, FP64=fp64,
        # fp32 inputs: IEEE fp32 products (TF32 would cost ~1e-3 relative error); 16-bit inputs
        # multiply exactly in the tensor cores either way.
        DOT_PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    combine_grid = (num_heads, batch)
    combine_args = (o_part, m_part, l_part, out, *out.stride(), num_splits)
    combine_kwargs = dict(
        FP64=fp64, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=min(next_power_of_2(num_splits), COMBINE_BLOCK_S)
    )
    with device_guard(q):
        split_kernel = flash_decode_split_kernel[split_grid](*split_args, **split_kwargs)
        if split:
            combine_kernel = flash_decode_combine_kernel[combine_grid](*combine_args, **combine_kwargs)
    if key is not None:
        split_launch = CompiledLaunch.build(
            flash_decode_split_kernel, split_kernel, split_grid, split_args, split_kwargs, len(tensors) + 4
        )
        combine_launch = (
            CompiledLaunch.build(flash_decode_combine_kernel, combine_kernel, combine_grid, combine_args,
                                 combine_kwargs, 4)
            if split else None
        )  # fmt: skip
        # The replay allocates its own output and workspace; it needs them aligned as these were.
        aligned = (out.data_ptr() | o_part.data_ptr()) % 16 == 0
        if aligned and split_launch is not None and (combine_launch is not None or not split):
            _remember(key, _DecodePlan(out, rows if split else 0, acc_dtype, split_launch, combine_launch))
    return out

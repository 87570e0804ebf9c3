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
  the normalised output directly.
- The combine, in the same launch: each split program then adds one to an int32 counter of its
  (sequence, KV head) (an acquire-release atomic), and the one that finishes last -- it sees
  ``num_splits - 1`` -- merges the splits of the group's query heads with the same rescaling,
  ``M = max_s m_s``, ``o = sum_s e^{m_s - M} acc_s / sum_s e^{m_s - M} l_s`` (FlashAttention-2's
  rescaling algebra applied across splits instead of across tiles), reading the splits ``BLOCK_S``
  at a time with a running max so any ``num_splits`` fits in registers, and zeroes the counter
  again. The "last block" pattern of CUDA's threadFenceReduction sample (and of split-K GEMMs'
  serial reduction): one launch instead of a split kernel plus a combine kernel, which at batch 1
  saves a launch's host time eagerly and a kernel boundary in a CUDA graph. The counters live in a
  small buffer kept per (device, stream) (:func:`_split_counters`).

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

Host side: an eager call costs more host time than the kernel takes at short contexts (checks,
tile choice and the launch through ``JITFunction.run``). A call with ``check_values=False`` (the
mixers' caches) stores a plan of its launch under its signature (:func:`_plan_key`), and later
calls with the same signature replay the compiled kernel (:class:`_DecodePlan`): on the H200
machine 44-72 against 96-186 µs of host time a call with two launches (2026-12-03,
``2026-12-03-nvidia-h200-decode-replay-1.json``), 23-27 µs with the merge in the same launch
(2026-12-04, ``2026-12-04-nvidia-h200-decode-fused-2.json``; SDPA 25-30 µs there). A CUDA graph of
the decode step removes the rest. The merge by the last split program took the CUDA-graph step on
the H200 from 9.4-9.5 / 17.0-17.2 / 39.2-39.9 µs to 9.0 / 16.2-16.4 / 38.5-39.0 µs at batch 1 and
2k / 8k / 32k keys, and from 23.7-23.8 to 22.4-22.8 µs at batch 8 and 2k (two runs of each,
alternating in one device call, ``...-decode-{before,fused}-{1,2}.json``); at batch 8 and 128k keys
it was 2.5% slower (980 against 956 µs, SDPA 963-965), not explained yet: the main loop's PTX is
the same instruction for instruction (compiled for sm_90 offline with Triton 3.9,
``benchmarks/kernel_resources.py``: 159 against 161 registers), and times at B8 128k have moved
with the process before (see the README).

Limits of this backend beyond the reference's: head_dim in [1, 256]; all tensors on one device
(CUDA, or CPU under the interpreter); batch <= 65535 and KV heads <= 65535 (CUDA grid axes).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from kernels._host import INTERPRET as _INTERPRET
from kernels._host import (
    CompiledLaunch,
    LaunchPlans,
    check_device,
    check_fp32_scalars,
    check_no_grad,
    device_guard,
    next_power_of_2,
    replay_guard,
    sm_count,
    split_fp64,
)
from kernels.reference import _check_decode_args

__all__ = ["flash_decode", "num_splits_heuristic", "split_config"]

_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2
_MAX_KEYS = 2**31 - 1  # the kernel holds lengths and key positions in int32
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
# Elements of the (heads, splits, D) fp32 tile the merge reads per pass: 8192 is 64 registers a
# thread at 4 warps, e.g. a GQA group of 4 at D = 128 takes 16 splits a pass (the batch-1
# heuristic's 16 at 2k keys in one pass, 32 from 8k in two), MHA 64. Each extra pass adds a
# dependent round trip to L2 while the launch's last program merges. Under the interpreter 512, so
# the tests' 5, 9 and 16 splits run the running max across passes.
COMBINE_ELEMENTS = 512 if _INTERPRET else 8192
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


@triton.jit
def _combine_splits(
    WORKSPACE, M_PART, L_PART, row, group, num_splits, OUT, stride_oh, stride_od,
    FP64: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Merge the splits of ``group`` query heads of one sequence -- workspace rows ``row + h *
    num_splits + s`` -- into their output rows ``OUT + h * stride_oh``. All the heads at once, as
    (BLOCK_H, BLOCK_S, D) tiles BLOCK_S splits at a time, with a running max per head: the
    rescaling is the online softmax's, one level up, and each pass costs one round trip to L2. The
    loads skip L1 (``.cg``): other SMs wrote these rows during this launch."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < group
    d_mask = offs_d < HEAD_DIM
    rows = row + offs_h * num_splits  # (BLOCK_H,) each head's first row
    m_run = tl.full([BLOCK_H], float("-inf"), dtype=ACC)
    l_run = tl.zeros([BLOCK_H], dtype=ACC)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=ACC)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        rs = rows[:, None] + offs_s[None, :]  # (BLOCK_H, BLOCK_S) workspace rows
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        m = tl.load(M_PART + rs, mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(L_PART + rs, mask=hs_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(WORKSPACE + rs[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 1))
        # Empty splits hold m = -inf; while every split so far is empty, shift by a finite 0 so
        # their weights are e^-inf = 0 instead of e^(-inf - -inf) = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_run - m_shift, FP64)
        w = _exp(m - m_shift[:, None], FP64)  # (BLOCK_H, BLOCK_S) weight of each split
        l_run = l_run * alpha + tl.sum(w * l_s, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        m_run = m_new
    # l = 0 only when every split is empty (seqlens[b] == 0): the output is 0.
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(OUT + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def flash_decode_split_kernel(
    Q, K, V, BLOCK_TABLE, SEQLENS, OUT, WORKSPACE, COUNTERS,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tp, stride_sb,
    stride_ob, stride_oh, stride_od,
    group, block_size, window, num_splits, qk_scale, qk_scale_lo, capacity,
    HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, FP64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, key split); grid (B, Hkv, num_splits). Writes the split's
    unnormalised output and (m, l) per query head of the group to the workspace; the split program
    of a (sequence, KV head) that finishes last then merges all its splits into the output. With
    SPLIT False (one split) it writes the normalised output directly."""
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
        # The workspace: (B, Hq, num_splits, D) partial outputs, then (B, Hq, num_splits) m and l.
        num_heads = tl.num_programs(1) * group
        rows = tl.num_programs(0).to(tl.int64) * num_heads * num_splits
        M_PART = WORKSPACE + rows * HEAD_DIM
        L_PART = M_PART + rows
        part = (batch * num_heads + heads) * num_splits + pid_s  # (BLOCK_G,) workspace rows
        tl.store(M_PART + part, m_i, mask=g_mask)
        tl.store(L_PART + part, l_i, mask=g_mask)
        tl.store(
            WORKSPACE + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        # Count the finished splits of this (sequence, KV head); the last one merges them, which
        # saves the combine its own launch (host time eagerly, a kernel boundary in a graph). The
        # barrier orders every thread's stores above before the counter's release (one thread
        # performs the atomic), as in CUDA's threadFenceReduction sample; the acquire orders the
        # last program's loads of the other splits after their stores.
        tl.debug_barrier()
        counter = COUNTERS + batch * tl.num_programs(1) + kv_head
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == num_splits - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next call
            head = kv_head * group
            _combine_splits(
                WORKSPACE, M_PART, L_PART, (batch * num_heads + head) * num_splits, group, num_splits,
                OUT + batch * stride_ob + head * stride_oh, stride_oh, stride_od,
                FP64, HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_S,
            )
    else:
        # l = 0 only when the sequence is empty (no tile ran): its output is 0, not 0 / 0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(OUT.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )


# fmt: on


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


# Replayable launches of recent call signatures; a decode loop uses one or two (the mixers' caches
# keep their shapes).
_PLANS = LaunchPlans()


def _plan_key(q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values) -> tuple | None:
    """Everything a :func:`flash_decode` call's checks, tile choice and launch depend on except the
    tensors' addresses (:meth:`kernels._host.LaunchPlans.key`): window, scale and num_splits with
    their types, and each tensor's shape, strides, dtype, device and 16-byte alignment (Triton's
    pointer specialization). None where no plan applies: ``check_values`` not False (its device sync
    costs far more than the launch), and LaunchPlans' cases (an input that is not a plain strided
    tensor, q off CUDA, an input requiring grad in grad mode: the ordinary path checks and raises)."""
    if check_values is not False:
        return None
    return _PLANS.key((window, scale, num_splits), q, k_cache, v_cache, block_table, seqlens)


def _split_workspace(q: torch.Tensor, rows: int, head_dim: int) -> torch.Tensor:
    """The split kernel's fp32 (fp64 for fp64) workspace on q's device, one flat allocation (an eager
    step is host-bound at small batch): the (B, Hq, num_splits, D) partial outputs, then the (B, Hq,
    num_splits) m and l, which the kernel finds from ``rows = B * Hq * num_splits``."""
    return q.new_empty(rows * (head_dim + 2), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


# The split kernels' finished-split counters, one int32 per (sequence, KV head), zero between
# launches (each launch's last split program resets its own). One buffer per (device, stream):
# launches on one stream run in order, so they never count into a counter at the same time, while
# launches on two streams may overlap. Buffers outgrown by a larger batch are kept, never freed: a
# CUDA graph captured with one keeps its address.
_COUNTERS: dict[tuple, torch.Tensor] = {}
_OUTGROWN_COUNTERS: list[torch.Tensor] = []


def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """(>= count,) int32 zeros for the split kernel's counters on the current stream of ``device``.

    During a CUDA-graph capture on a stream that has none yet, a fresh buffer from the graph's pool
    whose zero fill is captured with it (every replay starts from zeros), and it is not kept: memory
    allocated while capturing may not outlive the graph, and its zero fill only runs at replay.
    Graphs captured on a stream that had a buffer share it with that stream's eager calls: replay
    them on that stream, or not while calls run there."""
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else None
    counters = _COUNTERS.get((device, stream))
    if counters is not None and counters.numel() >= count:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    grown = count if counters is None else max(count, 2 * counters.numel())
    return _replace_counters((device, stream), grown)


def _replace_counters(key: tuple, count: int) -> torch.Tensor:
    """A new zeroed (count,) int32 buffer for ``key`` = (device, stream); the one it replaces, if
    any, joins ``_OUTGROWN_COUNTERS`` (a captured graph may still hold it)."""
    if key in _COUNTERS:
        _OUTGROWN_COUNTERS.append(_COUNTERS[key])
    counters = _COUNTERS[key] = torch.zeros(count, dtype=torch.int32, device=key[0])
    return counters


# Counters reserve_split_counters makes for a capture stream: batch * KV heads up to this many.
RESERVED_COUNTERS = 4096


def reserve_split_counters(stream: torch.cuda.Stream, count: int = RESERVED_COUNTERS) -> None:
    """Make ``stream``'s split counters now, before a CUDA graph is captured on it: (count,) int32
    zeros, filled on the current stream, which is then synchronised. The graph's launches with at
    most ``count`` (sequence, KV head) pairs count in them instead of zero-filling a buffer of their
    own at every replay (:func:`_split_counters`): one fill kernel less per call, without an eager
    call on ``stream`` (a decode step warmed up on a side stream replayed 18% slower in a graph,
    see :class:`models.model.DecodeStep`). A stream that already has enough keeps its buffer.

    Args:
        stream: the CUDA stream the capture will use; not while a capture is under way.
        count: counters to hold, one per (sequence, KV head) of a launch (>= 1).

    Raises:
        TypeError: ``stream`` is not a ``torch.cuda.Stream`` or ``count`` not an int.
        ValueError: ``count`` < 1.
        RuntimeError: called while the current stream is capturing a graph.
    """
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"reserve_split_counters: count must be an int, got {type(count).__name__}")
    if count < 1:
        raise ValueError(f"reserve_split_counters: count must be >= 1, got {count}")
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(
            f"reserve_split_counters: stream must be a torch.cuda.Stream, got {type(stream).__name__}"
        )
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "reserve_split_counters: call it before the capture, not while a graph is being captured"
        )
    key = (stream.device, stream.cuda_stream)
    if key in _COUNTERS and _COUNTERS[key].numel() >= count:
        return
    _replace_counters(key, count)
    torch.cuda.current_stream(stream.device).synchronize()  # zero before any launch on ``stream``


class _DecodePlan:
    """The launch of one :func:`flash_decode` call signature (:func:`_plan_key`), replayed by later
    eager calls with their own tensors: the argument checks, the split and tile choice and Triton's
    argument binding ran once, for the first call (:class:`kernels._host.CompiledLaunch`). The output
    and the fp32 workspace are fresh allocations on every call, as on the ordinary path, and the
    counters those of the current stream (:func:`_split_counters`).

    Args:
        out: the first call's (B, Hq, D) output, for its shape.
        rows: its workspace rows (B * Hq * num_splits, :func:`_split_workspace`), or 0 for one split.
        num_counters: its split counters (B * Hkv), or 0 for one split.
        launch: the split kernel's launch.
    """

    def __init__(self, out, rows, num_counters, launch):
        self.out_shape, self.device = out.shape, out.device
        self.rows, self.num_counters, self.launch = rows, num_counters, launch

    def __call__(self, q, k_cache, v_cache, block_table, seqlens) -> torch.Tensor | None:
        """(B, Hq, D) output of the replayed launch, or None (nothing launched) when the allocator
        returned an address without the 16-byte alignment the kernel was specialized for."""
        out = q.new_empty(self.out_shape)
        if self.rows:
            workspace = _split_workspace(q, self.rows, self.out_shape[-1])
            counters = _split_counters(self.device, self.num_counters)
        else:
            workspace = counters = out
        if (out.data_ptr() | workspace.data_ptr() | counters.data_ptr()) % 16:
            return None
        with replay_guard(self.device):
            self.launch(q, k_cache, v_cache, block_table, seqlens, out, workspace, counters)
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

    Streams: with several splits the launch counts finished splits in a small buffer kept per
    (device, stream) (:func:`_split_counters`), so calls on different streams may overlap. A CUDA
    graph captured on a stream that had run an eager call counts in that stream's buffer: replay it
    on that stream, or while nothing else runs there. Captured on a stream with none, it zero-fills
    a buffer of its own at every replay (one small fill kernel a call), unless
    :func:`reserve_split_counters` made that stream's buffer first, as
    :class:`models.model.DecodeStep` does through :func:`kernels.prepare_graph_capture`.

    Returns:
        (B, Hq, D) in q's dtype; sequences with seqlens == 0 return 0.

    Raises:
        The reference's errors, from the same checks (TypeError: non-tensor inputs, non-floating q /
        caches or mismatched dtypes, non-integer block_table / seqlens, non-int window or
        num_splits; ValueError: wrong ndim or mismatched shapes, no query or KV head or head_dim 0,
        Hq not a multiple of Hkv, seqlens out of [0, max_blocks * block_size], a used page index
        outside [0, num_blocks), window <= 0, num_splits < 1, tensors on different devices), and,
        for this backend only, RuntimeError for inputs that require grad in grad mode (no backward: run it
        under torch.no_grad()), ValueError for head_dim outside [1, 256], a scale beyond fp32's
        range, batch or KV heads above 65535, a table of more than 2**31 - 1 keys a sequence
        (``max_blocks * block_size``: lengths are int32 in the kernel), devices other than CUDA, or
        CPU inputs without ``TRITON_INTERPRET=1`` (or bfloat16 ones under it).
    """
    # An eager decode loop repeats one call signature: replay its launches (see _DecodePlan).
    key = _plan_key(q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values)
    plan = _PLANS.get(key)
    if plan is not None:
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
    if max_blocks * block_size > _MAX_KEYS:
        raise ValueError(
            f"the Triton flash_decode supports block tables of up to 2**31 - 1 keys a sequence, got "
            f"max_blocks * block_size = {max_blocks} * {block_size} = {max_blocks * block_size}; drop the "
            "table's unused columns (the reference is no way out: it builds every position of the table)"
        )

    out = q.new_empty((batch, num_heads, head_dim))
    if out.numel() == 0:
        return out
    seqlen = max_blocks * block_size  # keys a sequence may hold: a shape, not a device read
    if seqlen == 0:  # no key at all (pages of 0 slots, or an empty table): 0, as for seqlens == 0
        return out.zero_()
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
    if split:
        rows = batch * num_heads * num_splits
        workspace = _split_workspace(q, rows, head_dim)
        counters = _split_counters(q.device, batch * num_kv_heads)
    else:  # one split writes the output itself; the workspace and counter pointers are unused
        workspace = counters = out

    tensors = (q, k_cache, v_cache, block_table, seqlens)
    grid = (batch, num_kv_heads, num_splits)
    args = (
        *tensors, out, workspace, counters,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_table.stride(), seqlens.stride(0), *out.stride(),
        group, block_size, window or 0, num_splits, qk_scale, qk_scale_lo, max_blocks * block_size,
    )  # fmt: skip
    kwargs = dict(
        HAS_WINDOW=window is not None, SPLIT=split, FP64=fp64,
        # fp32 inputs: IEEE fp32 products (TF32 would cost ~1e-3 relative error); 16-bit inputs
        # multiply exactly in the tensor cores either way.
        DOT_PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_H=next_power_of_2(group),
        BLOCK_S=min(next_power_of_2(num_splits), max(COMBINE_ELEMENTS // (next_power_of_2(group) * block_d), 1)),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    try:
        with device_guard(q):
            kernel = flash_decode_split_kernel[grid](*args, **kwargs)
    except BaseException:
        # A launch stopped part-way (Ctrl+C under the interpreter, which runs the programs on the
        # host) would leave counts behind for the next launch to merge early: zero them again.
        if split:
            counters.zero_()
        raise
    if key is not None:
        launch = CompiledLaunch.build(flash_decode_split_kernel, kernel, grid, args, kwargs, len(tensors) + 3)
        # The replay allocates its own output and workspace; it needs them aligned as these were.
        if launch is not None and (out.data_ptr() | workspace.data_ptr() | counters.data_ptr()) % 16 == 0:
            _PLANS.remember(key, _DecodePlan(out, rows if split else 0, batch * num_kv_heads if split else 0, launch))
    return out

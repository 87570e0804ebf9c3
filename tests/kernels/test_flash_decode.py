"""The FlashDecoding Triton kernel (kernels/flash_decode.py) against the reference.

Accuracy rule (flash-attention's test suite, as in test_flash_attention.py): with the float64
reference on the same (dtype-rounded) inputs as ground truth,

    err(kernel in dtype X)  <=  2 * err(naive decode attention computed in dtype X) + atol

where "naive" gathers the keys and computes scores, softmax and output with every intermediate
rounded to X, and ``atol = 2 * |(x + 0.3) - 0.3 - x|`` in X is X's rounding step at the values'
magnitude (it only matters where the naive error is ~0, e.g. a sequence of one token). float64
runs are compared with the reference directly at 1e-12.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with
16-key tiles, so the CPU cases are tiny and cover every kind of case once: one batch mixing
sequence lengths 1, 17, 0, 65, 127 (one key, a partial tile, an empty sequence, several tiles and
pages); page sizes 16, 32 and 5 (not a power of two, smaller than a tile); GQA groups 1, 2, 3;
head dims 64, 80, 96, 128; windows 1, 20, 64 and none; 1, 2, several and more splits than pages;
non-contiguous q and caches; shuffled page tables; NaN in every byte no program may read; errors.
The whole product in bf16, realistic shapes (B = 64 at 32k keys) and the default split heuristic
at GPU sizes are marked ``gpu`` (``pytest -m gpu tests/kernels/test_flash_decode.py`` on a CUDA
machine).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import KernelParams, gpu

import kernels
from kernels import reference
from kernels._host import launch_hooks_installed

# ``kernels.flash_decode`` is the public function (it shadows the submodule's name on the
# package), so the kernel module is taken from sys.modules.
fd = sys.modules["kernels.flash_decode"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
SEQLENS = [1, 17, 0, 65, 127]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make_paged(
    seqlens, num_heads, num_kv_heads, head_dim, page_size, dtype, *, spare_pages=3, layout="contiguous"
):
    """A paged decode problem on DEVICE: q (B, Hq, D), caches (num_blocks, page_size, Hkv, D),
    block_table (B, max_blocks) int32 with each sequence's pages drawn in shuffled order from the
    pool, -1 in unused entries, and NaN in every unused page and every slot past a sequence's end.

    ``layout="strided"``: q and the caches are non-contiguous views (q transposed from (B, D, Hq)
    storage, caches a slice of a wider head dim).
    """
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32)
    batch = len(seqlens)
    pages_needed = [math.ceil(n / page_size) for n in seqlens]
    max_blocks = max(max(pages_needed), 1) + 1  # one table entry more than any sequence needs
    num_blocks = sum(pages_needed) + spare_pages
    order = torch.randperm(num_blocks).tolist()
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, n_pages in enumerate(pages_needed):
        for p in range(n_pages):
            block_table[b, p] = order.pop()

    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    if layout == "strided":
        k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim + 8)[..., 3 : 3 + head_dim]
        v_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim + 8)[..., 3 : 3 + head_dim]
        q = torch.randn(batch, head_dim, num_heads).transpose(1, 2)
    else:
        k_cache, v_cache, q = torch.randn(shape), torch.randn(shape), torch.randn(batch, num_heads, head_dim)
    used = torch.zeros(num_blocks, page_size, dtype=torch.bool)
    for b, n in enumerate(seqlens):
        t = torch.arange(n)
        used[block_table[b, t // page_size].long(), t % page_size] = True
    k_cache[~used], v_cache[~used] = math.nan, math.nan

    def to_device(x):  # keeps the view's strides
        return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=DEVICE).copy_(x)

    q, k_cache, v_cache = to_device(q), to_device(k_cache), to_device(v_cache)
    if layout == "strided":
        assert not (q.is_contiguous() or k_cache.is_contiguous() or v_cache.is_contiguous())
    return q, k_cache, v_cache, block_table.to(DEVICE), seqlens_t.to(DEVICE)


def without_nan(x):
    """The caches with the never-read NaN replaced by 0, for the references (whose gather reads
    every slot and multiplies unused ones by a zero probability)."""
    return torch.nan_to_num(x, nan=0.0)


def naive_decode(q, k_cache, v_cache, block_table, seqlens, window, scale=None):
    """Decode attention with every intermediate in q's dtype: per sequence, gather its keys, repeat
    the KV heads over the group, scores, softmax, output. Empty sequences give 0."""
    group = q.shape[1] // k_cache.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    page_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    for b, n in enumerate(seqlens.tolist()):
        lo = 0 if window is None else max(0, n - window)
        if n == lo:
            continue
        t = torch.arange(lo, n, device=q.device)
        pages = block_table[b].long()[t // page_size]
        k = k_cache[pages, t % page_size].repeat_interleave(group, dim=1)  # (n, Hq, D)
        v = v_cache[pages, t % page_size].repeat_interleave(group, dim=1)
        if q.dtype == torch.float32 and q.is_cuda:
            # On the GPU Triton's IEEE fp32 dot is an in-order FMA chain along D, whose rounding error
            # grows with D several times faster than cuBLAS's blocked sums (test_flash_attention.py's
            # naive_attention measured it): the baseline sums the scores in the same order.
            scores = torch.zeros(q.shape[1], n - lo, dtype=q.dtype, device=q.device)  # (Hq, keys)
            for d in range(q.shape[-1]):
                scores = scores + q[b, :, d, None] * k[:, :, d].T
            scores = scores * scale
        else:
            scores = torch.einsum("hd,thd->ht", q[b], k) * scale  # (Hq, n) in q's dtype
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out


def rounding_atol(x_ref, dtype):
    """flash-attn's atol: twice dtype's rounding step at the magnitude of x_ref (and of 0.3)."""
    x = x_ref.to(dtype)
    return 2 * (x + 0.3 - 0.3 - x).abs().max().item()


def assert_decode_accuracy(q, k_cache, v_cache, block_table, seqlens, *, window, num_splits, scale=None):
    """Kernel vs float64 reference, bounded by the naive same-dtype error (see module docstring)."""
    dtype = q.dtype
    out = kernels.flash_decode(
        q, k_cache, v_cache, block_table, seqlens, window=window, scale=scale, num_splits=num_splits,
        backend="triton",
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "the kernel read NaN it must never read"
    k_clean, v_clean = without_nan(k_cache), without_nan(v_cache)
    ref = reference.flash_decode(
        q.double(), k_clean.double(), v_clean.double(), block_table, seqlens, window=window, scale=scale
    )
    empty = seqlens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert_counters_zero()
    if q.is_cuda:
        # An eager decode loop's calls (check_values=False): the first stores the signature's plan,
        # the second replays its compiled launches; both launch what the checked call launched.
        for _ in range(2):
            again = kernels.flash_decode(
                q, k_cache, v_cache, block_table, seqlens, window=window, scale=scale, num_splits=num_splits,
                check_values=False, backend="triton",
            )  # fmt: skip
            assert torch.equal(again, out)
    if dtype == F64:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        return
    naive = naive_decode(q, k_clean, v_clean, block_table, seqlens, window, scale)
    err = (out.double() - ref).abs().max().item()
    base_err = (naive.double() - ref).abs().max().item()
    # On the GPU, tl.exp2 is ex2.approx.f32 (relative error ~2^-22) and the scale * log2(e) is
    # fp32-rounded: a few fp32 ulps the naive path (exact expf) lacks; visible only in fp32.
    atol = rounding_atol(ref, dtype) + 2.0**-20 * ref.abs().max().item()
    assert err <= 2 * base_err + atol, (
        f"kernel error {err:.3g} > 2 x naive {dtype} error {base_err:.3g} + atol {atol:.3g}"
    )


def assert_counters_zero():
    """Every split-counter buffer is back to zero once its launches are done: each launch's last
    split program must reset the counters it counted with, or the next launch merges too early."""
    for counters in [*fd._COUNTERS.values(), *fd._OUTGROWN_COUNTERS]:
        assert counters.dtype == torch.int32 and not counters.any(), f"split counters left at {counters.tolist()}"


def decode(inputs, **kwargs):
    return kernels.flash_decode(*inputs, backend="triton", **kwargs)


# ----------------------------------------------------------------------------------------------
# Accuracy: every kind of case once, at tiny sizes
# ----------------------------------------------------------------------------------------------

# (Hq, Hkv, D, page_size, window, num_splits, dtype, layout). Interpreter tiles hold 16 keys; the
# longest sequence (127 keys) spans 8 tiles and 8 / 4 / 26 pages of 16 / 32 / 5 slots.
CASES = [
    (2, 2, 64, 16, None, None, torch.float32, "contiguous"),  # MHA, default heuristic (1 split)
    (4, 2, 80, 32, None, 2, torch.float16, "contiguous"),  # group 2, D 80
    (3, 1, 96, 16, 20, 3, torch.float32, "strided"),  # group 3, window > tile, non-contiguous
    (6, 2, 128, 16, 1, 1, torch.float16, "contiguous"),  # window 1: only the new token
    (4, 2, 64, 32, 64, 9, torch.float32, "contiguous"),  # 9 splits > 4 pages of the longest sequence
    (2, 1, 64, 5, None, 4, torch.float16, "strided"),  # pages of 5 slots (smaller than a tile)
    (6, 2, 80, 16, 17, 5, F64, "contiguous"),  # float64 vs reference at 1e-12
    (4, 2, 128, 32, None, 1, F64, "strided"),
]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,window,num_splits,dtype,layout",
    CASES,
    ids=[f"h{c[0]}kv{c[1]}-d{c[2]}-p{c[3]}-w{c[4]}-s{c[5]}-{str(c[6])[6:]}-{c[7]}" for c in CASES],
)
def test_matches_reference(num_heads, num_kv_heads, head_dim, page_size, window, num_splits, dtype, layout):
    inputs = make_paged(SEQLENS, num_heads, num_kv_heads, head_dim, page_size, dtype, layout=layout)
    assert_decode_accuracy(*inputs, window=window, num_splits=num_splits)


def test_split_counts_agree_and_custom_scale():
    # 1, 2, 5 and 16 splits on identical inputs (16 splits of the 40-key window take 3 keys each:
    # the last two are empty, and so are most splits of the 1- and 17-key sequences): each within
    # the accuracy rule, and all within fp32 rounding of one another.
    inputs = make_paged(SEQLENS, 6, 2, 64, 16, torch.float32)
    outs = []
    for num_splits in (1, 2, 5, 16):
        assert_decode_accuracy(*inputs, window=40, num_splits=num_splits, scale=0.3)
        outs.append(decode(inputs, window=40, num_splits=num_splits, scale=0.3))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_page_order_and_layout_do_not_change_bits():
    # The same keys in other pages (another shuffle, a different pool) or in non-contiguous storage:
    # the kernel reads them in the same order, so the output is bitwise identical.
    q, k_cache, v_cache, table, seqlens = make_paged(SEQLENS, 4, 2, 64, 16, torch.float16)
    want = decode((q, k_cache, v_cache, table, seqlens), num_splits=3)
    perm = torch.randperm(k_cache.shape[0], device=DEVICE)
    inverse = torch.argsort(perm)  # page p moves to slot inverse[p]
    moved_table = torch.where(table >= 0, inverse[table.clamp(min=0).long()].int(), table)
    moved = (q, k_cache[perm], v_cache[perm], moved_table, seqlens)
    assert torch.equal(decode(moved, num_splits=3), want)
    q_t = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype, device=DEVICE).transpose(1, 2)
    q_t.copy_(q)
    assert torch.equal(decode((q_t, k_cache, v_cache, table, seqlens), num_splits=3), want)


def test_nothing_outside_the_window_is_read():
    # Whole pages before a sequence's window hold NaN: with window 20 at length 127 (pages of 16),
    # pages 0-5 are never loaded, and the result equals the clean run bit for bit.
    q, k_cache, v_cache, table, seqlens = make_paged([127, 40], 4, 2, 64, 16, torch.float32)
    want = decode((q, k_cache, v_cache, table, seqlens), window=20, num_splits=2)
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    for page in table[0, :6].long().tolist() + [table[1, 0].item()]:  # [0, 96) and [0, 16)
        k_bad[page], v_bad[page] = math.nan, math.nan
    got = decode((q, k_bad, v_bad, table, seqlens), window=20, num_splits=2)
    assert torch.equal(got, want)


def test_reference_ignores_unread_slots():
    # NaN in every slot the kernel never reads (before the window, past the length in the last page,
    # table pages past the length): the reference must give the clean run's output too, as the
    # kernel does (decode on CPU runs the reference).
    q, k_cache, v_cache, table, seqlens = make_paged([37, 40], 4, 2, 64, 16, torch.float32)
    want = kernels.flash_decode(q, k_cache, v_cache, table, seqlens, window=20, backend="reference")
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    for b, length in enumerate(seqlens.tolist()):
        for t in [*range(length - 20), *range(length, table.shape[1] * 16)]:
            page = table[b, t // 16].item()
            if page >= 0:  # -1: an unused table entry (make_paged fills unused pages with NaN already)
                k_bad[page, t % 16], v_bad[page, t % 16] = math.nan, math.inf
    got = kernels.flash_decode(q, k_bad, v_bad, table, seqlens, window=20, backend="reference")
    assert torch.equal(got, want)
    assert torch.equal(decode((q, k_bad, v_bad, table, seqlens), window=20), decode((q, k_cache, v_cache, table, seqlens), window=20))


def test_empty_batch_and_all_empty_sequences():
    q, k_cache, v_cache, table, seqlens = make_paged([0, 0], 4, 2, 64, 16, torch.float32)
    for num_splits in (1, 3):
        out = decode((q, k_cache, v_cache, table, seqlens), num_splits=num_splits)
        assert torch.equal(out, torch.zeros_like(out))
    out = decode((q[:0], k_cache, v_cache, table[:0], seqlens[:0]))
    assert out.shape == (0, 4, 64)
    # A pool, a table or pages of size 0 hold no token: both backends return zeros.
    for k0, t0 in ((k_cache[:0], table), (k_cache, table[:, :0]), (k_cache[:, :0], table)):
        for backend in ("reference", "triton"):
            out = kernels.flash_decode(q, k0, k0.clone(), t0, seqlens, backend=backend)
            assert torch.equal(out, torch.zeros_like(out))


def test_num_splits_heuristic():
    heuristic = fd.num_splits_heuristic
    # Batch 1, 8 KV heads on 132 SMs: split until ~2 programs per SM, at >= 128 keys per split.
    assert heuristic(1, 8, 2048, 132) == 16  # 128 programs: 2048 // MIN_SPLIT_TOKENS caps it
    assert heuristic(1, 8, 8192, 132) == 32  # 256 programs: first power of two filling >= 90% of 264
    assert heuristic(1, 8, 131072, 132) == 32
    assert heuristic(8, 8, 8192, 132) == 4
    assert heuristic(2, 8, 8192, 132) == 16
    assert heuristic(32, 8, 32768, 132) == 1  # 256 programs already fill 264 slots
    assert heuristic(64, 8, 32768, 132) == 1  # 512 programs: two waves, 97% of their slots used
    assert heuristic(1, 8, 100, 132) == 1  # too short to split
    for batch in (1, 3, 17, 64, 1000):
        for seqlen in (1, 129, 4096, 1 << 17):
            splits = heuristic(batch, 8, seqlen, 132)
            assert 1 <= splits <= max(1, min(fd.MAX_SPLITS, seqlen // fd.MIN_SPLIT_TOKENS))
            assert splits & (splits - 1) == 0  # a power of two


def test_split_config(monkeypatch):
    # The interpreter's config, then the CUDA rule (whichever one this machine imported the module under).
    monkeypatch.setattr(fd, "_INTERPRET", True)
    assert fd.split_config(torch.bfloat16, 128, 128, 128) == (fd.INTERPRET_BLOCK_N, 4, 1)
    monkeypatch.setattr(fd, "_INTERPRET", False)
    assert fd.split_config(torch.bfloat16, 128, 8 * 16, 132) == (128, 4, 2)  # B1 2k: <= 1 program / SM
    assert fd.split_config(torch.bfloat16, 256, 8 * 16, 132) == (64, 4, 2)  # <= 32 KB tiles
    assert fd.split_config(torch.float16, 128, 8 * 32, 132) == (64, 4, 3)  # B1 8k-128k
    assert fd.split_config(torch.bfloat16, 128, 8 * 8 * 4, 132) == (64, 4, 3)  # B8
    assert fd.split_config(torch.bfloat16, 256, 8 * 32, 132) == (32, 4, 3)  # 3 stages of 32 KB exceed 3/4
    assert fd.split_config(torch.float32, 128, 8, 132) == (32, 4, 2)
    # ~100 KB of shared memory (sm_86 / sm_89): the tiles shrink until K and V of all stages fit 3/4 of it.
    small = 101376
    assert fd.split_config(torch.bfloat16, 128, 8 * 16, 132, small) == (64, 4, 2)
    assert fd.split_config(torch.bfloat16, 128, 8 * 32, 132, small) == (32, 4, 3)
    assert fd.split_config(torch.bfloat16, 256, 8 * 32, 132, small) == (16, 4, 3)
    assert fd.split_config(torch.bfloat16, 256, 8 * 16, 132, small) == (32, 4, 2)
    for block_d in (16, 64, 128):  # the H200's 227 KB keeps both choices of the rule
        for programs in (8, 1000):
            assert fd.split_config(torch.float16, block_d, programs, 132) == fd.split_config(
                torch.float16, block_d, programs, 132, 1 << 30
            )
    assert fd.split_config(torch.float64, 64, 1000, 132) == (32, 4, 2)


# ----------------------------------------------------------------------------------------------
# Dispatch and errors
# ----------------------------------------------------------------------------------------------


def test_registered_for_triton_backend():
    assert kernels._TRITON_OPS["flash_decode"] is fd.flash_decode
    inputs = make_paged([3, 9], 2, 1, 16, 4, torch.float32)
    expected = "triton" if DEVICE == "cuda" else "reference"
    q, k, v, table, seqlens = inputs
    k, v = without_nan(k), without_nan(v)
    assert torch.equal(
        kernels.flash_decode(q, k, v, table, seqlens),
        kernels.flash_decode(q, k, v, table, seqlens, backend=expected),
    )


def _call(backend, *args, **kwargs):
    try:
        kernels.flash_decode(*args, backend=backend, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _i(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


_Q, _CACHE, _TABLE, _LENS = _t(2, 2, 8), _t(3, 4, 1, 8), _i(0, 0, 0, 0).view(2, 2), _i(3, 8)


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((_Q, _CACHE, _CACHE, _TABLE, _i(3, 9)), {}),  # seqlens beyond the table's capacity
        ((_Q, _CACHE, _CACHE, _TABLE, _i(-1, 3)), {}),
        ((_Q, _CACHE, _CACHE, _TABLE.float(), _LENS), {}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS.double()), {}),
        ((_Q, _CACHE, _CACHE, _TABLE.bool(), _LENS), {}),
        ((_Q, _CACHE, _CACHE, _i(0, 0, 1, 3).view(2, 2), _LENS), {}),  # page 3
        ((_Q, _CACHE, _CACHE, _TABLE[:1], _LENS), {}),
        ((_t(2, 3, 8), _t(3, 4, 2, 8), _t(3, 4, 2, 8), _TABLE, _LENS), {}),  # 3 heads over 2 KV heads
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"window": 0}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"window": 2.0}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"scale": "0.1"}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"num_splits": 0}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"num_splits": 2.0}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"num_splits": True}),
        ((_Q, _CACHE, _CACHE, _TABLE, _LENS), {"check_values": 1}),
        ((_Q, _CACHE.to("meta"), _CACHE.to("meta"), _TABLE, _LENS), {}),  # mixed devices
        ((_Q, _CACHE, _t(3, 4, 1, 4), _TABLE, _LENS), {}),  # k / v shapes differ
        ((_Q, _t(3, 4, 1, 4), _t(3, 4, 1, 4), _TABLE, _LENS), {}),  # head dims differ
        ((_Q, _CACHE.double(), _CACHE.double(), _TABLE, _LENS), {}),
        ((_Q, _t(4, 1, 8), _t(4, 1, 8), _TABLE, _LENS), {}),
        (([1.0], _CACHE, _CACHE, _TABLE, _LENS), {}),
        ((_t(2, 2, 0), _t(3, 4, 1, 0), _t(3, 4, 1, 0), _TABLE, _LENS), {}),  # head_dim 0: no default scale
        ((_Q, _t(3, 4, 0, 8), _t(3, 4, 0, 8), _TABLE, _LENS), {}),  # no KV head (was a ZeroDivisionError)
        ((_t(2, 0, 8), _t(3, 4, 2, 8), _t(3, 4, 2, 8), _TABLE, _LENS), {}),  # no query head
    ],
)
def test_errors_identical_to_reference(args, kwargs):
    triton_error, reference_error = _call("triton", *args, **kwargs), _call("reference", *args, **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_zero_heads_are_refused(backend):
    for q, cache in ((_Q, _t(3, 4, 0, 8)), (_t(2, 0, 8), _t(3, 4, 2, 8))):
        with pytest.raises(ValueError, match=r"need at least one head each"):
            kernels.flash_decode(q, cache, cache, _TABLE, _LENS, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_head_dim_zero_is_refused(backend):
    # Found by a new-user check: with a scale the reference returned a (B, Hq, 0) output where the
    # Triton backend refused; both refuse it now, as flash_attention does.
    empty = (_t(2, 2, 0), _t(3, 4, 1, 0), _t(3, 4, 1, 0), _TABLE, _LENS)
    for scale in (None, 1.0):
        with pytest.raises(ValueError, match=r"need at least one head each and head_dim >= 1"):
            kernels.flash_decode(*empty, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_check_values_false_skips_only_the_value_checks(backend):
    """check_values=False (the mixers' caches: no device sync) gives the same result on valid
    inputs, still checks shapes, and no longer reads seqlens back (out of range: no error)."""
    q, k, v, table, seqlens = make_paged([3, 9], 2, 1, 16, 4, torch.float32)
    k, v = without_nan(k), without_nan(v)
    checked = kernels.flash_decode(q, k, v, table, seqlens, backend=backend)
    assert torch.equal(
        kernels.flash_decode(q, k, v, table, seqlens, check_values=False, backend=backend), checked
    )
    with pytest.raises(ValueError, match="B = 2 rows"):
        kernels.flash_decode(_Q, _CACHE, _CACHE, _TABLE[:1], _LENS, check_values=False, backend=backend)
    with pytest.raises(ValueError, match="seqlens must lie"):
        kernels.flash_decode(_Q, _CACHE, _CACHE, _TABLE, _i(3, 9), backend=backend)
    # Out-of-range values are undefined behaviour with False: only that nothing raises is checked.
    assert _call(backend, _Q, _CACHE, _CACHE, _TABLE, _i(-1, 3), check_values=False) is None


def test_backend_specific_errors():
    big = _t(1, 2, 264)
    with pytest.raises(ValueError, match=r"head_dim in \[1, 256\].*backend='reference'"):
        kernels.flash_decode(big, _t(1, 4, 1, 264), _t(1, 4, 1, 264), _i(0)[None], _i(2), backend="triton")
    # Triton receives the scale as an fp32 scalar: beyond its range it would be inf (NaN outputs).
    with pytest.raises(ValueError, match="scale .* overflows float32.*backend='reference'"):
        kernels.flash_decode(_Q.double(), _CACHE.double(), _CACHE.double(), _TABLE, _LENS, scale=1e300,
                             backend="triton")  # fmt: skip
    # No backward: an output that silently stopped the gradient.
    q = _Q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable .*, but q requires grad.*torch.no_grad"):
        kernels.flash_decode(q, _CACHE, _CACHE, _TABLE, _LENS, backend="triton")
    with torch.no_grad():  # as decoding runs it
        got = kernels.flash_decode(q, _CACHE, _CACHE, _TABLE, _LENS, backend="triton")
        want = kernels.flash_decode(q, _CACHE, _CACHE, _TABLE, _LENS, backend="reference")
    torch.testing.assert_close(got, want)
    if DEVICE == "cpu":
        metas = [t.to("meta") for t in (_Q, _CACHE, _CACHE, _TABLE, _LENS)]
        for check_values in (True, False):
            with pytest.raises(ValueError, match="runs on CUDA .* got meta"):
                kernels.flash_decode(*metas, check_values=check_values, backend="triton")


# ----------------------------------------------------------------------------------------------
# Replayed launches (an eager decode loop's calls with check_values=False)
# ----------------------------------------------------------------------------------------------


_KERNEL = KernelParams(("X", "Y", "n", "BLOCK", "FLAG"))


class _Compiled:
    """A stand-in for the CompiledKernel a launch returns: records what its launcher receives."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def test_compiled_launch_passes_arguments_in_parameter_order(monkeypatch):
    """The replay hands the launcher what JITFunction.run does: grid padded to 3, the current stream
    of the kernel's device, function and metadata, no hooks, then every parameter in the kernel's
    order (the new tensors first, the fixed scalars and constexprs after; launch options dropped)."""
    from types import SimpleNamespace

    from kernels import _host

    streams = []
    monkeypatch.setattr(
        _host, "driver", SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda d: streams.append(d) or 7))
    )
    x, y, x2, y2 = _t(2), _t(3), _t(2), _t(3)
    compiled = _Compiled()
    launch = _host.CompiledLaunch.build(
        _KERNEL, compiled, (4, 2), (x, y, 5), {"FLAG": True, "BLOCK": 16, "num_warps": 4}, num_tensors=2
    )
    launch(x2, y2)
    assert streams == [x.device.index]
    (call,) = compiled.calls
    assert call[:9] == (4, 2, 1, 7, "function", "packed", None, None, None)
    assert call[9] is x2 and call[10] is y2 and call[11:] == (5, 16, True)
    # Nothing to replay: the interpreter's launch returns no compiled kernel; a parameter left to its
    # default is not known to the replay.
    assert _host.CompiledLaunch.build(_KERNEL, None, (1,), (x, y, 5), {"FLAG": 1, "BLOCK": 16}, 2) is None
    assert _host.CompiledLaunch.build(_KERNEL, compiled, (1,), (x, y, 5), {"BLOCK": 16}, 2) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,window,num_splits,dtype,layout",
    [
        (32, 8, 128, None, None, torch.bfloat16, "contiguous"),  # many splits: split + combine
        (6, 2, 80, 100, 1, torch.float32, "strided"),  # one split: the split kernel alone
        (3, 1, 64, 17, 5, torch.float16, "contiguous"),
    ],
)
def test_gpu_replayed_launches(num_heads, num_kv_heads, head_dim, window, num_splits, dtype, layout, monkeypatch):
    """A signature's second call replays its plan on new tensors: the same bits as the checked
    (ordinary) call on those tensors, a new plan for another alignment, gradients refused, a launch
    hook honoured, and the replay captured in a CUDA graph reads the graph's inputs."""
    from triton import knobs

    kw = dict(window=window, num_splits=num_splits, backend="triton")
    seqlens = [1000, 17, 0, 65]

    def fresh():  # same shapes and strides each time; new values and a new page order
        return list(make_paged(seqlens, num_heads, num_kv_heads, head_dim, 16, dtype, layout=layout))

    first, second = fresh(), fresh()
    # The ordinary path checks its arguments; a replay does not: count the checks.
    checks = []
    check_decode_args = fd._check_decode_args
    monkeypatch.setattr(fd, "_check_decode_args", lambda *a: checks.append(1) or check_decode_args(*a))
    fd._PLANS.clear()
    kernels.flash_decode(*first, check_values=False, **kw)
    assert len(fd._PLANS) == 1 and len(checks) == 1
    got = kernels.flash_decode(*second, check_values=False, **kw)
    assert len(checks) == 1, "the second call of a signature must replay the first call's plan"
    assert torch.equal(got, kernels.flash_decode(*second, **kw))

    # q at an address that is not 16-byte aligned: Triton specializes on alignment, so another plan.
    q = second[0]
    shifted = torch.empty(q.numel() + 1, dtype=dtype, device=q.device)[1:].view(q.shape).copy_(q)
    if layout == "contiguous":
        assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
        assert torch.equal(kernels.flash_decode(shifted, *second[1:], check_values=False, **kw), got)
        assert len(fd._PLANS) == 2

    with pytest.raises(RuntimeError, match="not differentiable"):
        kernels.flash_decode(q.clone().requires_grad_(), *second[1:], check_values=False, **kw)

    seen, calls = [], len(checks)
    assert not launch_hooks_installed()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    assert launch_hooks_installed()
    assert torch.equal(kernels.flash_decode(*second, check_values=False, **kw), got)
    assert seen and len(checks) == calls + 1, "with a launch hook the ordinary launch (which calls it) must run"
    monkeypatch.undo()

    # As LanguageModel.generate does: one eager step stores the plan, the capture replays it.
    static = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t) for t in second]
    kernels.flash_decode(*static, check_values=False, **kw)
    assert fd._plan_key(*static, window, None, num_splits, False) in fd._PLANS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = kernels.flash_decode(*static, check_values=False, **kw)
    for t, new in zip(static, first, strict=True):
        t.copy_(new)
    graph.replay()
    assert torch.equal(graphed, kernels.flash_decode(*first, **kw))


@pytest.mark.gpu
@gpu
def test_gpu_merge_by_the_last_split_is_race_free():
    """The last split program of each (sequence, KV head) merges what the others wrote in the same
    launch. Many back-to-back launches (replayed and checked) give the same bits, on one stream and
    on two streams at once (each stream counts in its own buffer), and the counters end at zero."""
    seqlens = [8192, 5000, 1, 0, 8191, 64]
    inputs = make_paged(seqlens, 32, 8, 128, 64, torch.bfloat16)
    assert_decode_accuracy(*inputs, window=None, num_splits=64)
    want = kernels.flash_decode(*inputs, num_splits=64, backend="triton")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(400):
        with torch.cuda.stream(streams[i % 2] if i >= 200 else torch.cuda.current_stream()):
            outs.append(kernels.flash_decode(*inputs, num_splits=64, check_values=False, backend="triton"))
    torch.cuda.synchronize()
    bad = [i for i, out in enumerate(outs) if not torch.equal(out, want)]
    assert not bad, f"calls {bad[:10]} (of {len(bad)}) differ from the first: a merge read a split too early"
    assert_counters_zero()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("stream_state", ["new", "seen", "reserved"])
def test_gpu_graph_capture_counters(stream_state):
    """Captured on a stream that has no counters yet, the graph zero-fills its own buffer at every
    replay; on a stream that has them (an eager call ran there, or kernels.prepare_graph_capture
    made them), it counts in that buffer. Either way every replay is right, and the eager calls
    after it too."""
    first, second = (make_paged([3000, 17, 0, 2049], 8, 2, 128, 16, torch.bfloat16) for _ in range(2))
    static = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t) for t in first]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if stream_state == "seen":
        with torch.cuda.stream(stream):
            kernels.flash_decode(*static, num_splits=16, check_values=False, backend="triton")
    elif stream_state == "reserved":
        kernels.prepare_graph_capture(stream)
    stream.synchronize()
    known = len(fd._COUNTERS)
    own = fd._COUNTERS.get((stream.device, stream.cuda_stream))
    assert (own is not None) == (stream_state != "new")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        graphed = kernels.flash_decode(*static, num_splits=16, check_values=False, backend="triton")
        used = fd._split_counters(stream.device, 8)
    assert len(fd._COUNTERS) == known, "a buffer allocated while capturing must not be kept"
    assert (used is own) == (stream_state != "new"), "the capture must count in the stream's own buffer"
    for inputs in (second, first, second):
        for t, new in zip(static, inputs, strict=True):
            t.copy_(new)
        graph.replay()
        assert torch.equal(graphed, kernels.flash_decode(*inputs, num_splits=16, backend="triton"))
    torch.cuda.synchronize()
    assert_counters_zero()


def test_split_counters_per_stream_grow_and_are_kept():
    """One zeroed buffer per (device, stream), reused while large enough; a larger batch gets a new
    one of at least twice the size and the old one is kept (a captured graph may hold it)."""
    device = torch.device(DEVICE)
    fd._COUNTERS.clear()
    small = fd._split_counters(device, 3)
    assert small.dtype == torch.int32 and small.numel() == 3 and not small.any()
    assert fd._split_counters(device, 2) is small
    kept = len(fd._OUTGROWN_COUNTERS)
    large = fd._split_counters(device, 4)
    assert large.numel() == 6 and fd._OUTGROWN_COUNTERS[kept] is small
    assert fd._split_counters(device, 5) is large
    # A batch with many splits per (sequence, KV head) leaves them at zero.
    inputs = make_paged(SEQLENS * 3, 6, 2, 64, 16, torch.float32)
    assert_decode_accuracy(*inputs, window=None, num_splits=5)


def test_a_table_past_int32_keys_is_refused():
    """The kernel holds lengths in int32: a table of 2**31 keys a sequence (here 2**21 columns of
    1024-token pages, all naming page 0) is refused, not truncated into wrong outputs."""
    q = torch.randn(1, 2, 16)
    k_cache = torch.randn(1, 1024, 1, 16)
    table = torch.zeros(1, 2**21, dtype=torch.int32)
    seqlens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"up to 2\*\*31 - 1 keys a sequence, got max_blocks \* block_size = "
                       r"2097152 \* 1024 = 2147483648; drop the table's unused columns"):
        kernels.flash_decode(q, k_cache, k_cache, table, seqlens, backend="triton")
    ok = kernels.flash_decode(q, k_cache, k_cache, table[:, : 2**21 - 1], seqlens, backend="triton")
    want = kernels.flash_decode(q, k_cache, k_cache, table[:, :1], seqlens, backend="reference")
    torch.testing.assert_close(ok, want)


def test_reserve_split_counters_refuses_bad_arguments():
    """Not a CUDA stream, a count that is not a positive int: clear errors before anything is made."""
    message = "^prepare_graph_capture: stream must be a torch.cuda.Stream, got str"
    with pytest.raises(TypeError, match=message):
        kernels.prepare_graph_capture("cuda")
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream, got NoneType"):
        fd.reserve_split_counters(None)
    with pytest.raises(TypeError, match="count must be an int, got bool"):
        fd.reserve_split_counters(None, True)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        fd.reserve_split_counters(None, 0)


def test_an_interrupted_launch_leaves_the_counters_at_zero(monkeypatch):
    """A launch stopped part-way (Ctrl+C while the interpreter runs its programs on the host) has
    counted some splits; they are zeroed again, or every later call would merge too early."""

    class Interrupted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                args[7].add_(1)  # COUNTERS: some splits counted, then the launch stops
                raise KeyboardInterrupt

            return launch

    inputs = make_paged(SEQLENS, 4, 2, 64, 16, torch.float32)
    monkeypatch.setattr(fd, "flash_decode_split_kernel", Interrupted())
    with pytest.raises(KeyboardInterrupt):
        decode(inputs, num_splits=4)
    monkeypatch.undo()
    assert_counters_zero()
    assert_decode_accuracy(*inputs, window=None, num_splits=4)


# ----------------------------------------------------------------------------------------------
# GPU: the full sweep, bf16, realistic shapes (pytest -m gpu)
# ----------------------------------------------------------------------------------------------

GPU_SEQLENS = [1, 15, 16, 17, 0, 64, 65, 127, 1000, 2049]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2), (8, 2)])
def test_gpu_sweep(dtype, head_dim, num_heads, num_kv_heads):
    for page_size in (16, 64, 256, 5):
        inputs = make_paged(GPU_SEQLENS, num_heads, num_kv_heads, head_dim, page_size, dtype)
        for window in (None, 1, 16, 100, 4096):
            for num_splits in (None, 1, 3, 64):
                try:
                    assert_decode_accuracy(*inputs, window=window, num_splits=num_splits)
                except AssertionError as exc:
                    raise AssertionError(
                        f"page={page_size} window={window} splits={num_splits}: {exc}"
                    ) from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_strided(dtype):
    inputs = make_paged(GPU_SEQLENS, 8, 2, 128, 64, dtype, layout="strided")
    for window in (None, 100):
        assert_decode_accuracy(*inputs, window=window, num_splits=None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "batch,seqlen,num_heads,num_kv_heads,page_size,window",
    [
        (64, 32768, 8, 2, 64, None),  # B = 64 at 32k: one split per (sequence, KV head)
        (1, 32768, 32, 8, 16, None),  # batch 1: the heuristic splits the keys
        (8, 8192, 32, 8, 256, 4096),
        (3, 131072, 8, 1, 64, None),
    ],
)
def test_gpu_realistic_shapes(batch, seqlen, num_heads, num_kv_heads, page_size, window):
    # Lengths around seqlen, one sequence a little shorter than a page multiple.
    lengths = [seqlen - (b * 37) % 300 for b in range(batch)]
    inputs = make_paged(lengths, num_heads, num_kv_heads, 128, page_size, torch.bfloat16, spare_pages=1)
    assert_decode_accuracy(*inputs, window=window, num_splits=None)

"""The FlashAttention-2 Triton kernel (kernels/flash_attention.py) against the reference.

Accuracy rule (flash-attention's test suite, tests/test_flash_attn.py): with the float64 reference
on the same (dtype-rounded) inputs as ground truth,

    err(kernel in dtype X)  <=  2 * err(naive attention computed in dtype X) + atol   (output)
                                3 * ...                                            (dq, dk, dv)

where the "naive" baseline is the textbook formula with every intermediate tensor (scores,
probabilities, output, and their gradients) rounded to X -- written out below, because the
reference upcasts 16-bit inputs to fp32 -- and ``atol = 2 * |(x + 0.3) - 0.3 - x|`` in dtype X is
X's rounding step at the values' magnitude (flash-attn's ``fwd_atol`` / ``dq_atol``): it only
matters where the naive error happens to be ~0 (a row seeing one key copies its value exactly).
float64 runs are compared to the reference directly at 1e-12.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which is
slow, so the CPU cases are tiny and cover every *kind* of case once: lengths 1, 17, 64, 65, 127,
200 with Tq < Tk and Tq > Tk; windows below, at and above the interpreter's block sizes (32 x 16)
and beyond the sequence; head dims 16, 64, 80, 96, 128 (and 8, below a tl.dot tile); GQA groups
1, 2, 3; non-contiguous inputs; NaN-poisoned allocations; determinism; rows without keys; the lse
and its gradient; skipped tiles (NaN placed where no program may read); non-finite keys and values
(the reference's confinement, the kernel's for keys); errors. The whole product, bf16, and
realistic shapes are marked ``gpu`` (``pytest -m gpu`` on a CUDA machine). Without CUDA every test
here runs on CPU; with CUDA the unmarked tests run on the GPU too.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch
import triton
import triton.language as tl
from helpers import dtype_id, gpu

import kernels
from kernels.flash_attention import _kv_tile_bounds, _q_tile_bounds

# ``kernels.flash_attention`` is the public function (it shadows the submodule's name on the
# package), so the kernel module is taken from sys.modules.
fa = sys.modules["kernels.flash_attention"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype, layout="contiguous"):
    """q (B, Tq, Hq, D), k / v (B, Tk, Hkv, D) in ``dtype`` on DEVICE, laid out as ``layout``:

    - "contiguous";
    - "transposed": allocated (B, H, T, D) and viewed as (B, T, H, D);
    - "sliced": a window of a larger (B, T + 3, H + 1, D + 8) tensor (odd offsets, padded rows);
    - "strided_d": every other element of the last dim (stride 2 along D).
    """

    def one(seqlen, heads):
        shape = (batch, seqlen, heads, head_dim)
        if layout == "contiguous":
            x = torch.randn(shape)
        elif layout == "transposed":
            x = torch.randn(batch, heads, seqlen, head_dim).transpose(1, 2)
        elif layout == "sliced":
            x = torch.randn(batch, seqlen + 3, heads + 1, head_dim + 8)[
                :, 2 : 2 + seqlen, 1:, 3 : 3 + head_dim
            ]
        elif layout == "strided_d":
            x = torch.randn(batch, seqlen, heads, 2 * head_dim)[..., ::2]
        else:
            raise ValueError(layout)
        assert x.shape == shape
        # Cast without copying into a contiguous tensor: the view keeps its strides.
        return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=DEVICE).copy_(x)

    q, k, v = one(seqlen_q, num_heads), one(seqlen_k, num_kv_heads), one(seqlen_k, num_kv_heads)
    if layout != "contiguous":
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    return q, k, v


def visible_mask(seqlen_q, seqlen_k, causal, window, device):
    """(Tq, Tk) bool: query i sees key j (bottom-right aligned causal, window counting the token)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if not causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    last = i + seqlen_k - seqlen_q
    visible = j <= last
    if window is not None:
        visible = visible & (j > last - window)
    return visible


def naive_attention(q, k, v, causal, window, scale=None):
    """The textbook formula with every intermediate in q's dtype: scores, softmax, output (and, by
    autograd, the gradients). Rows without keys give 0 (their softmax is taken over a dummy row and
    multiplied by 0, so no NaN reaches the gradients)."""
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    if q.dtype == torch.float32 and q.is_cuda:
        # On the GPU Triton's IEEE fp32 dot is an in-order FMA chain along D, whose rounding error
        # (growing with D) is several times that of cuBLAS's blocked sums: at D = 128-256 it, not the
        # softmax, dominates fp32 errors (kernel / in-order naive ~1-2x, kernel / cuBLAS naive
        # ~3-8x on an H200). The textbook baseline sums the scores in the same order.
        scores = torch.zeros(q.shape[0], q.shape[2], q.shape[1], k.shape[1], device=q.device)
        for d in range(q.shape[-1]):
            scores = (
                scores + q[..., d].transpose(1, 2)[..., :, None] * k[..., d].transpose(1, 2)[..., None, :]
            )
        scores = scores * scale
    else:
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # (B, H, Tq, Tk) in q's dtype
    visible = visible_mask(q.shape[1], k.shape[1], causal, window, q.device)
    has_key = visible.any(-1, keepdim=True)  # (Tq, 1)
    scores = scores.masked_fill(~(visible | ~has_key), float("-inf"))
    probs = torch.softmax(scores, dim=-1) * has_key
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def run(impl, q, k, v, do, *, causal, window, scale=None, dlse=None):
    """(o, lse, dq, dk, dv) of ``impl``; grads of sum(o * do) (+ sum(lse * dlse) where given)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if impl == "naive":
        o, lse = naive_attention(q, k, v, causal, window, scale), None
    else:
        o, lse = kernels.flash_attention(
            q, k, v, causal=causal, window=window, scale=scale, return_lse=True, backend=impl
        )
    loss = (o * do).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return o, lse, dq, dk, dv


def rounding_atol(x_ref, dtype):
    """flash-attn's atol: twice dtype's rounding step at the magnitude of x_ref (and of 0.3)."""
    x = x_ref.to(dtype)
    return 2 * (x + 0.3 - 0.3 - x).abs().max().item()


def assert_flash_accuracy(q, k, v, *, causal, window, scale=None, check_grads=True):
    """Kernel vs float64 reference, bounded by the naive same-dtype error (see module docstring)."""
    dtype = q.dtype
    do = torch.randn(q.shape, device=q.device).to(dtype)
    o, lse, *grads = run("triton", q, k, v, do, causal=causal, window=window, scale=scale)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref = run(
        "reference",
        q.double(),
        k.double(),
        v.double(),
        do.double(),
        causal=causal,
        window=window,
        scale=scale,
    )
    names = ("o", "lse", "dq", "dk", "dv")
    # Rows without keys: exactly 0 and -inf, and identical finiteness everywhere.
    torch.testing.assert_close(torch.isfinite(lse), torch.isfinite(ref[1]))
    for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads), strict=True):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
    finite = torch.isfinite(ref[1])
    if dtype == F64:
        for name, x, r in zip(names, (o, lse, *grads), ref, strict=True):
            if name == "lse":
                x, r = x[finite], r[finite]
            torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        return
    naive = run("naive", q, k, v, do, causal=causal, window=window, scale=scale)
    # FA2 forms dS = P * (dP - delta), with delta = rowsum(dO * O) taken from the output as stored
    # in dtype X and dP = dO V^T from another summation, so dS carries an absolute error of about
    # eps(X) * sum_d |dO_d O_d| (the dot products' rounding bound), which the naive softmax backward
    # does not have on rows that see a single key (its dS is exactly 0 there, e.g. T = 1 or window
    # = 1). Carried into dq = scale * dS K and dk = scale * dS^T Q (summed over the group's query
    # heads), that is the floor for dq and dk.
    # Both dot products also round in their fp32 accumulation, ~sqrt(D) fp32 ulps of the same sum
    # (the usual probabilistic bound for a D-term sum): negligible beside eps(X) for 16-bit X, the
    # larger term for fp32 inputs.
    eps = 2 * torch.finfo(dtype).eps + math.sqrt(q.shape[-1]) * torch.finfo(torch.float32).eps
    scale_ = q.shape[-1] ** -0.5 if scale is None else scale
    delta = (do.double().abs() * ref[0].abs()).sum(-1).max().item()
    group = q.shape[2] // k.shape[2]
    floors = {
        "o": 0.0,
        "dq": eps * delta * scale_ * k.abs().max().item(),
        "dk": eps * delta * scale_ * q.abs().max().item() * group,
        "dv": 0.0,
    }
    # On the GPU, tl.exp2 is ex2.approx.f32 (relative error about 2^-22, PTX ISA) and the scores
    # are scaled by an fp32-rounded scale * log2(e): a few fp32 ulps of relative error that the
    # naive path (exact expf) lacks. It only shows in fp32, where the naive error is itself ~1 ulp.
    intrinsics = 2.0**-20
    checks = [("o", o, ref[0], naive[0], 2)]
    if check_grads:
        checks += [(n, x, r, b, 3) for n, x, r, b in zip(names[2:], grads, ref[2:], naive[2:], strict=True)]
    for name, x, r, base, factor in checks:
        err = (x.double() - r).abs().max().item()
        base_err = (base.double() - r).abs().max().item()
        atol = rounding_atol(r, dtype) + floors[name] + intrinsics * r.abs().max().item()
        assert err <= factor * base_err + atol, (
            f"{name}: kernel error {err:.3g} > {factor} x naive {dtype} error {base_err:.3g} + atol {atol:.3g}"
        )
    # The lse has no naive twin (it is fp32 for 16-bit inputs): compare at fp32 accuracy.
    torch.testing.assert_close(lse[finite].double(), ref[1][finite], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Accuracy: every kind of case once, at tiny sizes
# ----------------------------------------------------------------------------------------------

# (batch, Tq, Tk, Hq, Hkv, D, causal, window, dtype, layout). The interpreter's blocks are
# BLOCK_M = 32 (query) x BLOCK_N = 16 (key) in the forward and dQ kernels, 16 x 32 in dK/dV.
CASES = [
    (1, 1, 1, 1, 1, 16, True, None, torch.float32, "contiguous"),  # one token
    (1, 17, 17, 2, 2, 64, True, None, torch.float16, "contiguous"),  # one partial tile
    (1, 64, 64, 2, 1, 16, True, 16, torch.float32, "contiguous"),  # window == BLOCK_N, GQA 2
    (1, 65, 65, 3, 1, 80, True, 7, torch.float16, "contiguous"),  # window < block, GQA 3, D 80
    (1, 127, 200, 4, 2, 96, True, 40, torch.float32, "contiguous"),  # Tq < Tk, window > block, D 96
    (1, 200, 127, 2, 1, 32, True, None, torch.float16, "contiguous"),  # Tq > Tk: rows without keys
    (1, 127, 64, 3, 3, 16, True, 32, torch.float32, "contiguous"),  # Tq > Tk with window == BLOCK_M
    (1, 65, 17, 2, 2, 128, False, None, torch.float32, "contiguous"),  # non-causal, Tq > Tk, D 128
    (1, 17, 65, 3, 1, 16, False, None, torch.float16, "contiguous"),  # non-causal, Tq < Tk
    (1, 200, 200, 1, 1, 64, True, 500, torch.float32, "contiguous"),  # window beyond the sequence
    (2, 33, 64, 2, 1, 8, True, 33, torch.float16, "contiguous"),  # D 8 < tl.dot's 16, batch 2
    (1, 65, 127, 6, 2, 64, True, None, torch.float64, "contiguous"),  # fp64 vs reference at 1e-12
    (1, 127, 65, 2, 2, 80, True, 17, torch.float64, "contiguous"),
    (1, 64, 64, 2, 2, 16, False, None, torch.float64, "contiguous"),
]


@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,num_heads,num_kv_heads,head_dim,causal,window,dtype,layout",
    CASES,
    ids=[
        f"B{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}kv{c[4]}-d{c[5]}-{'c' if c[6] else 'nc'}-w{c[7]}-{c[8]}"
        for c in CASES
    ],
)
def test_matches_reference(
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, causal, window, dtype, layout
):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype, layout)
    assert_flash_accuracy(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("window", [1, 15, 16, 17, 31, 32, 33, 64, 65])
def test_windows_around_block_sizes_float64(window):
    # Windows on both sides of every tile size the interpreter uses (16, 32), Tq < Tk and Tq == Tk.
    for seqlen_q, seqlen_k in [(65, 65), (40, 97)]:
        q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 16, F64)
        assert_flash_accuracy(q, k, v, causal=True, window=window)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_d"])
def test_non_contiguous_inputs(layout):
    q, k, v = make_qkv(1, 40, 57, 4, 2, 80, torch.float32, layout)
    assert_flash_accuracy(q, k, v, causal=True, window=20)
    # Same bits as on contiguous copies: only the addressing differs.
    contiguous = [x.contiguous() for x in (q, k, v)]
    assert torch.equal(kernels.flash_attention(q, k, v, backend="triton"),
                       kernels.flash_attention(*contiguous, backend="triton"))  # fmt: skip


def test_non_contiguous_output_gradient():
    # o.sum() backpropagates an expanded all-ones gradient (every stride 0); a transposed one too.
    q, k, v = make_qkv(1, 33, 33, 2, 2, 16, F64)
    for make_do in (
        lambda o: o.new_ones(()).expand(o.shape),
        # Drawn by shape, not randn_like(o): that follows o's strides, which differ between the
        # backends, and would hand them different gradients.
        lambda o: torch.randn(
            o.shape[0], o.shape[2], o.shape[1], o.shape[3], dtype=o.dtype, device=o.device
        ).transpose(1, 2),
    ):
        grads = []
        for backend in ("triton", "reference"):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            o = kernels.flash_attention(qq, kk, vv, backend=backend)
            torch.manual_seed(1)
            grads.append(torch.autograd.grad(o, (qq, kk, vv), make_do(o)))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [0.37, 0.0, -0.5])  # 0: a uniform average over the visible keys
def test_scale_argument(scale):
    q, k, v = make_qkv(1, 30, 30, 2, 2, 16, F64)
    assert_flash_accuracy(q, k, v, causal=True, window=None, scale=scale)


# ----------------------------------------------------------------------------------------------
# Edge cases: rows without keys, lse, empty batches
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_rows_without_keys(dtype):
    # Tq > Tk causal: query i < Tq - Tk sees no key -> output 0, lse -inf, zero (finite) gradients.
    seqlen_q, seqlen_k = 70, 20
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 16, dtype)
    do = torch.randn(q.shape, device=DEVICE).to(dtype)
    o, lse, dq, dk, dv = run("triton", q, k, v, do, causal=True, window=None)
    empty = seqlen_q - seqlen_k
    assert torch.equal(o[:, :empty], torch.zeros_like(o[:, :empty]))
    assert torch.equal(lse[..., :empty], torch.full_like(lse[..., :empty], -math.inf))
    assert torch.isfinite(lse[..., empty:]).all()
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize(
    "dtype,lse_dtype",
    [(torch.float16, torch.float32), (torch.float32, torch.float32), (F64, F64)],
    ids=["fp16", "fp32", "fp64"],
)
def test_return_lse_values_and_dtype(dtype, lse_dtype):
    q, k, v = make_qkv(2, 50, 37, 4, 2, 32, dtype)
    o, lse = kernels.flash_attention(q, k, v, window=9, return_lse=True, backend="triton")
    o_ref, lse_ref = kernels.flash_attention(q, k, v, window=9, return_lse=True, backend="reference")
    assert lse.dtype == lse_dtype == lse_ref.dtype and lse.shape == (2, 4, 50) and o.dtype == dtype
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == -math.inf).all()
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=tol, atol=tol)
    # Without return_lse: the same output alone.
    assert torch.equal(kernels.flash_attention(q, k, v, window=9, backend="triton"), o)


def test_lse_gradient():
    # d lse / d S = P: supported by folding dlse into delta; checked with and without a dO.
    q, k, v = make_qkv(1, 45, 30, 2, 1, 16, F64)
    do = torch.randn(q.shape, device=DEVICE, dtype=F64)
    dlse = torch.randn(1, 2, 45, device=DEVICE, dtype=F64)
    for scale_do in (1.0, 0.0):
        got = run("triton", q, k, v, do * scale_do, causal=True, window=12, dlse=dlse)
        want = run("reference", q, k, v, do * scale_do, causal=True, window=12, dlse=dlse)
        for a, b in zip(got[2:], want[2:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Only the lse used: the output's gradient arrives as None.
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    _, lse = kernels.flash_attention(qq, kk, vv, return_lse=True, backend="triton")
    got = torch.autograd.grad(lse[torch.isfinite(lse)].sum(), (qq, kk, vv))
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    _, lse = kernels.flash_attention(qq, kk, vv, return_lse=True, backend="reference")
    want = torch.autograd.grad(lse[torch.isfinite(lse)].sum(), (qq, kk, vv), allow_unused=True)
    assert want[2] is None and torch.equal(got[2], torch.zeros_like(got[2]))  # the lse ignores V
    for a, b in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_empty_query_and_batch():
    for shape_q, shape_k in [((1, 0, 2, 16), (1, 5, 1, 16)), ((0, 4, 2, 16), (0, 5, 1, 16))]:
        q = torch.randn(shape_q, device=DEVICE, requires_grad=True)
        k = torch.randn(shape_k, device=DEVICE, requires_grad=True)
        v = torch.randn(shape_k, device=DEVICE, requires_grad=True)
        o, lse = kernels.flash_attention(q, k, v, return_lse=True, backend="triton")
        assert o.shape == shape_q and lse.shape == (shape_q[0], 2, shape_q[1])
        o.sum().backward()
        assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


# ----------------------------------------------------------------------------------------------
# Memory discipline: every output element written, nothing read outside the visible tiles
# ----------------------------------------------------------------------------------------------


def test_outputs_fully_written_and_deterministic(monkeypatch):
    # Every buffer the kernel allocates is filled with NaN first: an element a program forgot to
    # store (a skipped tile's dK/dV rows, the rows without keys) would surface as NaN. The kernels
    # use no atomics, so results are bitwise equal run to run (and to the un-poisoned run).
    q, k, v = make_qkv(1, 90, 70, 4, 2, 24, torch.float32)  # 20 rows without keys, Hq/Hkv = 2
    do = torch.randn(q.shape, device=DEVICE)
    dlse = torch.randn(1, 4, 90, device=DEVICE)
    clean = run("triton", q, k, v, do, causal=True, window=13, dlse=dlse)
    again = run("triton", q, k, v, do, causal=True, window=13, dlse=dlse)

    def nan_filled(factory):
        @functools.wraps(factory)
        def wrapper(*args, **kwargs):
            out = factory(*args, **kwargs)
            return out.fill_(math.nan) if out.is_floating_point() else out

        return wrapper

    if DEVICE == "cuda":  # also leave NaN in the caching allocator's free blocks
        junk = [torch.full((1 << 20,), math.nan, device=DEVICE) for _ in range(8)]
        del junk
    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
    poisoned = run("triton", q, k, v, do, causal=True, window=13, dlse=dlse)
    monkeypatch.undo()
    for name, a, b, c in zip(("o", "lse", "dq", "dk", "dv"), clean, again, poisoned, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical calls"
        assert torch.equal(a, c), f"{name} differs when its buffers start as NaN"
    assert torch.isfinite(clean[0]).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max over NaN rows
def test_invisible_tiles_are_never_read():
    # NaN placed where no tile of a program may reach: a kernel that loaded a fully masked tile
    # and masked it elementwise would still propagate NaN (0 * NaN in P @ V, dS^T @ Q, ...). Tiles
    # are powers of two <= fa.MAX_BLOCK, so with T a multiple of MAX_BLOCK:
    blk = fa.MAX_BLOCK
    nan = math.nan

    # (1) Causal: query rows < blk never read keys >= blk, and keys >= blk never read query rows
    # (or dO rows) < blk.
    q, k, v = make_qkv(1, 2 * blk + 5, 2 * blk + 5, 2, 1, 16, torch.float32)
    do = torch.randn(q.shape, device=DEVICE)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, blk:], v_bad[:, blk:] = nan, nan
    o, lse, dq, dk, dv = run("triton", q, k_bad, v_bad, do, causal=True, window=None)
    o_ref, _, dq_ref, dk_ref, dv_ref = run("triton", q, k, v, do, causal=True, window=None)
    assert torch.equal(o[:, :blk], o_ref[:, :blk]) and torch.equal(dq[:, :blk], dq_ref[:, :blk])
    q_bad, do_bad = q.clone(), do.clone()
    q_bad[:, :blk], do_bad[:, :blk] = nan, nan
    _, _, _, dk, dv = run("triton", q_bad, k, v, do_bad, causal=True, window=None)
    assert torch.equal(dk[:, blk:], dk_ref[:, blk:]) and torch.equal(dv[:, blk:], dv_ref[:, blk:])

    # (2) Window, Tq << Tk: keys [0, 2 blk) are outside every query's window (the first visible key
    # is Tk - Tq - window + 1 >= 2 blk): never read, and their dK / dV are exact zeros.
    seqlen_q, seqlen_k, window = 20, 3 * blk, 9
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 2, 16, torch.float32)
    do = torch.randn(q.shape, device=DEVICE)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, : 2 * blk], v_bad[:, : 2 * blk] = nan, nan
    got = run("triton", q, k_bad, v_bad, do, causal=True, window=window)
    want = run("triton", q, k, v, do, causal=True, window=window)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[3][:, : 2 * blk], torch.zeros_like(got[3][:, : 2 * blk]))

    # (3) Window, Tq == Tk: queries >= 2 blk never read keys < blk (and vice versa for dK / dV).
    q, k, v = make_qkv(1, 3 * blk, 3 * blk, 2, 1, 16, torch.float32)
    do = torch.randn(q.shape, device=DEVICE)
    want = run("triton", q, k, v, do, causal=True, window=5)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :blk], v_bad[:, :blk] = nan, nan
    got = run("triton", q, k_bad, v_bad, do, causal=True, window=5)
    assert torch.equal(got[0][:, 2 * blk :], want[0][:, 2 * blk :])
    q_bad, do_bad = q.clone(), do.clone()
    q_bad[:, 2 * blk :], do_bad[:, 2 * blk :] = nan, nan
    got = run("triton", q_bad, k, v, do_bad, causal=True, window=5)
    assert torch.equal(got[3][:, :blk], want[3][:, :blk]) and torch.equal(got[4][:, :blk], want[4][:, :blk])


@triton.jit
def _tile_bounds_probe_kernel(
    Out,
    Tq,
    Tk,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUTER_IS_Q: tl.constexpr,
):
    """Writes the kernels' (lo, w, a, b, hi) tile bounds for outer block program_id(0); the key-side
    bounds of the dK/dV kernel have no w, written as lo."""
    pid = tl.program_id(0)
    if OUTER_IS_Q:
        lo, w, a, b, hi = _kv_tile_bounds(pid * BLOCK_M, Tq, Tk, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    else:
        lo, a, b, hi = _q_tile_bounds(pid * BLOCK_N, Tq, Tk, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
        w = lo
    tl.store(Out + pid * 5 + 0, lo)
    tl.store(Out + pid * 5 + 1, w)
    tl.store(Out + pid * 5 + 2, a)
    tl.store(Out + pid * 5 + 3, b)
    tl.store(Out + pid * 5 + 4, hi)  # fmt: skip


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32), (64, 64), (128, 64), (32, 128)])
def test_tile_bounds_skip_invisible_and_mask_only_boundary_tiles(block_m, block_n):
    # The loop bounds every kernel uses, evaluated by a probe kernel for several block shapes: tiles
    # outside [lo, hi) have no visible pair (never loaded), every tile inside has one, and interior
    # tiles [a, b) -- the ones run without the elementwise mask -- are entirely visible; the forward's
    # window-edge tiles [lo, w) are complete and causally visible to every row (only the window
    # masks them), and tiles from a on lie inside every row's window.
    for (tq, tk), causal, window in itertools.product(
        [(1, 1), (17, 17), (64, 64), (65, 127), (127, 65), (40, 97), (300, 300)],
        [True, False],
        [None, 1, 16, 17, 40, 200],
    ):
        if window is not None and not causal:
            continue
        visible = visible_mask(tq, tk, causal, window, "cpu")
        for outer_is_q in (True, False):
            outer_block, inner_block = (block_m, block_n) if outer_is_q else (block_n, block_m)
            vis = visible if outer_is_q else visible.T
            num_blocks = triton.cdiv(vis.shape[0], outer_block)
            out = torch.full((num_blocks, 5), -1, dtype=torch.int32, device=DEVICE)
            _tile_bounds_probe_kernel[(num_blocks,)](
                out, tq, tk, window or 0, causal, window is not None, block_m, block_n, outer_is_q
            )
            no_window = visible_mask(tq, tk, causal, None, "cpu")
            no_window = no_window if outer_is_q else no_window.T
            in_window = vis | ~no_window  # pairs the window edge alone would keep
            for block, (lo, w, a, b, hi) in enumerate(out.tolist()):
                where = (tq, tk, causal, window, outer_is_q, block)
                assert 0 <= lo <= w <= a <= b <= hi <= vis.shape[1] and lo % inner_block == 0, where
                rows = vis[block * outer_block : (block + 1) * outer_block]
                for tile in range(0, vis.shape[1], inner_block):
                    seen = rows[:, tile : tile + inner_block]
                    assert (lo <= tile < hi) == bool(seen.any()), where + (tile,)
                    block_rows = slice(block * outer_block, (block + 1) * outer_block)
                    tile_cols = slice(tile, tile + inner_block)
                    if outer_is_q and lo <= tile < w:
                        assert no_window[block_rows, tile_cols].all(), where + (tile,)
                        assert tile + inner_block <= tk, where + (tile,)
                    if outer_is_q and tile >= a and window is not None:
                        assert in_window[block_rows, tile_cols].all(), where + (tile,)
                    if a <= tile < b:
                        # Rows past the outer length are padding that is never stored; the inner
                        # tile itself must be complete (its tail is a boundary tile).
                        assert seen.all() and seen.shape[1] == inner_block, where + (tile,)


# ----------------------------------------------------------------------------------------------
# Dispatch and errors
# ----------------------------------------------------------------------------------------------


def test_registered_for_triton_backend():
    assert kernels._TRITON_OPS["flash_attention"] is fa.flash_attention
    q, k, v = make_qkv(1, 5, 5, 2, 1, 16, torch.float32)
    expected = "triton" if DEVICE == "cuda" else "reference"
    assert torch.equal(kernels.flash_attention(q, k, v), kernels.flash_attention(q, k, v, backend=expected))


def _call(backend, q, k, v, **kwargs):
    try:
        kernels.flash_attention(q, k, v, backend=backend, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"window": 0}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"window": -3}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"window": 2.0}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"window": True}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"window": 2, "causal": False}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"scale": "0.1"}),
        ((_t(1, 4, 6, 8), _t(1, 4, 4, 8), _t(1, 4, 4, 8)), {}),
        ((_t(1, 4, 6, 8), _t(1, 4, 2, 4), _t(1, 4, 2, 4)), {}),
        ((_t(1, 4, 6, 8), _t(2, 4, 2, 8), _t(2, 4, 2, 8)), {}),
        ((_t(1, 4, 6, 8), _t(4, 2, 8), _t(4, 2, 8)), {}),
        ((_t(1, 4, 6, 8), _t(1, 0, 2, 8), _t(1, 0, 2, 8)), {}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8, dtype=F64), _t(1, 4, 2, 8)), {}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 5, 2, 8)), {}),
        (
            (
                _t(1, 4, 2, 8),
                torch.ones(1, 4, 2, 8, dtype=torch.int64),
                torch.ones(1, 4, 2, 8, dtype=torch.int64),
            ),
            {},
        ),
        (([1.0], _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {}),
        ((_t(1, 4, 2, 8).to(torch.float8_e4m3fn),) * 3, {}),
        ((_t(1, 4, 2, 0), _t(1, 4, 2, 0), _t(1, 4, 2, 0)), {}),
        ((_t(1, 4, 2, 8), _t(1, 4, 0, 8), _t(1, 4, 0, 8)), {}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"causal": "no"}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"causal": None}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"return_lse": "no"}),  # truthy, not True
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"return_lse": 1}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"scale": float("inf")}),
        ((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {"scale": float("nan")}),
    ],
)
def test_errors_identical_to_reference(args, kwargs):
    triton_error, reference_error = _call("triton", *args, **kwargs), _call("reference", *args, **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


def test_backend_specific_errors():
    with pytest.raises(ValueError, match=r"head_dim in \[1, 256\].*backend='reference'"):
        kernels.flash_attention(_t(1, 4, 2, 264), _t(1, 4, 2, 264), _t(1, 4, 2, 264), backend="triton")
    # Triton's scale is an fp32 scalar: beyond its range only the reference with float64 inputs
    # computes (float32 inputs compute in float32 on both backends, and are refused alike).
    x64 = _t(1, 4, 2, 8).double()
    with pytest.raises(ValueError, match="overflows float32.*backend='reference' with float64 inputs"):
        kernels.flash_attention(x64, x64, x64, scale=1e39, backend="triton")
    assert torch.isfinite(kernels.flash_attention(x64, x64, x64, scale=1e39, backend="reference")).all()
    x32 = _t(1, 4, 2, 8)
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match="overflows float32, in which torch.float32 inputs .*float64"):
            kernels.flash_attention(x32, x32, x32, scale=1e39, backend=backend)
    meta = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="runs on CUDA"):
        kernels.flash_attention(meta, meta, meta, backend="triton")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="one device"):
            kernels.flash_attention(_t(1, 4, 2, 8), meta, meta, backend="triton")


def test_sequences_past_int32_offsets_are_refused(monkeypatch):
    # The kernels index the sequence in int32: (T - 1) * stride from 2**31 on would wrap. A lower
    # limit stands in for 2**31 (nothing that large is allocated); the output gradient is checked
    # when the backward gets it.
    import kernels._host as host

    q = _t(1, 20, 2, 16).requires_grad_()
    k, v = _t(1, 20, 2, 16), _t(1, 20, 2, 16)
    monkeypatch.setattr(host, "INT32_OFFSETS", 2**8)
    message = (r"^the Triton flash_attention indexes q with int32 offsets, but its dim 1 spans \(20 - 1\) x "
               r"stride 32 = 608 elements, past 2\*\*31 - 1; attend over fewer heads a call")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        kernels.flash_attention(q, k, v, backend="triton")
    monkeypatch.setattr(host, "INT32_OFFSETS", 2**10)
    o = kernels.flash_attention(q, k, v, backend="triton")
    do = _t(1, 20, 2, 64)[..., :16]  # stride 128: 19 x 128 = 2432
    message = r"indexes do with int32 offsets, but its dim 1 spans \(20 - 1\) x stride 128 "
    with pytest.raises(ValueError, match=message):
        torch.autograd.grad(o, q, do)


def test_error_messages_say_how_to_fix():
    q = _t(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"pass int\(window\)"):
        kernels.flash_attention(q, q, q, window=torch.tensor(2).numpy()[()], backend="triton")
    with pytest.raises(TypeError, match=r"pass float\(scale\)"):
        kernels.flash_attention(q, q, q, scale=torch.tensor(0.5).numpy()[()], backend="triton")
    with pytest.raises(TypeError, match=r"float16, bfloat16, float32 or float64.*\.to\("):
        kernels.flash_attention(*(q.to(torch.float8_e5m2),) * 3, backend="triton")


def test_float64_infinite_score_and_returned_lse():
    # The kernel keeps IEEE arithmetic over the keys a row sees: an infinite score gets weight 0
    # (-inf) or takes the row (+inf); the fp64 scale is applied in one multiply, never as inf * 0.
    # Weight 0 is the key left out, which the reference computes from the other keys (given the
    # key itself, it returns NaN on the rows that see it: see its docstring).
    q = torch.ones(1, 4, 1, 16, dtype=F64, device=DEVICE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    k[0, 0, 0, 0] = -math.inf
    want = kernels.flash_attention(q, k[:, 1:], v[:, 1:], backend="reference")  # row 0 sees no key: 0
    got = kernels.flash_attention(q, k, v, backend="triton")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert kernels.flash_attention(q, k, v, backend="reference").isnan().all()
    # The returned lse is the caller's: modifying it in place leaves the backward intact.
    qq = q.clone().requires_grad_()
    o, lse = kernels.flash_attention(qq, k.nan_to_num(neginf=0.0), v, return_lse=True, backend="triton")
    lse.clamp_(min=-1e4)
    o.sum().backward()
    assert torch.isfinite(qq.grad).all()


# ----------------------------------------------------------------------------------------------
# Non-finite keys and values reach only the rows that see them
# ----------------------------------------------------------------------------------------------

# (Tq, Tk, causal, window, position of the non-finite key): rows of the same batch element and KV
# head on both sides of it.
NON_FINITE_CASES = [
    (8, 8, True, None, 5),  # rows 5.. see key 5
    (12, 12, True, 3, 4),  # rows 4..6 see key 4, later rows have left it behind
    (6, 10, True, None, 7),  # Tq < Tk: row i sees keys <= i + 4
    (7, 10, True, 2, 6),  # Tq < Tk with a window: rows 2 and 3
    (9, 5, True, None, 3),  # Tq > Tk (the explicit path): rows 7, 8; rows 0..3 see no key
    (5, 7, False, None, 2),  # non-causal: every row
]


def _outputs_and_grads(q, k, v, do, dlse, *, return_lse, **kwargs):
    """(o, lse or None, dq, dk, dv) of the reference; grads of sum(o * do) (+ sum(lse * dlse))."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = kernels.flash_attention(q, k, v, return_lse=return_lse, backend="reference", **kwargs)
    o, lse = out if return_lse else (out, None)
    loss = (o * do).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()  # rows without keys: -inf
    return o, lse, *torch.autograd.grad(loss, (q, k, v))


@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "lse"])
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,window,pos",
    NON_FINITE_CASES,
    ids=[f"q{c[0]}-k{c[1]}-{'c' if c[2] else 'nc'}-w{c[3]}-at{c[4]}" for c in NON_FINITE_CASES],
)
def test_reference_confines_non_finite_keys_and_values(seqlen_q, seqlen_k, causal, window, pos, return_lse):
    # One entry of key (or value) `pos` of batch 1, KV head 1 (query heads 2, 3) is non-finite.
    # Rows that see it: NaN output and lse, NaN gradients of their query and of every key and value
    # they see. Everything else: as with a finite entry there (fp64, to 1e-12). Used to leak: the
    # fused call adds the mask as -inf (NaN + -inf = NaN), probs @ v has 0 * NaN = NaN.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 8, F64)
    do = torch.randn(q.shape, dtype=F64, device=DEVICE)
    dlse = torch.randn(2, 4, seqlen_q, dtype=F64, device=DEVICE)
    kwargs = dict(causal=causal, window=window, return_lse=return_lse)
    want = _outputs_and_grads(q, k, v, do, dlse, **kwargs)

    visible = visible_mask(seqlen_q, seqlen_k, causal, window, DEVICE)
    sees = visible[:, pos]  # (Tq,) the rows that see the key
    assert sees.any() and (not causal or not sees.all())  # a case with both kinds of rows
    nan_rows = torch.zeros(2, seqlen_q, 4, dtype=torch.bool, device=DEVICE)
    nan_rows[1, :, 2:] = sees[:, None]
    nan_keys = torch.zeros(2, seqlen_k, 2, dtype=torch.bool, device=DEVICE)
    nan_keys[1, :, 1] = visible[sees].any(0)  # the keys those rows see
    masks = {"o": nan_rows, "lse": nan_rows.transpose(1, 2), "dq": nan_rows, "dk": nan_keys, "dv": nan_keys}
    for tensor, bad in [("key", math.nan), ("key", math.inf), ("value", math.nan), ("value", -math.inf)]:
        k_bad, v_bad = k.clone(), v.clone()
        (k_bad if tensor == "key" else v_bad)[1, pos, 1, 3] = bad
        got = _outputs_and_grads(q, k_bad, v_bad, do, dlse, **kwargs)
        for (name, nan), x, x_want in zip(masks.items(), got, want, strict=True):
            if x is None:
                continue
            nan = nan[..., None].expand_as(x) if name != "lse" else nan
            where = f"{bad} in a {tensor}: {name}"
            assert torch.equal(x.isnan(), nan), f"{where} NaN at {(x.isnan() != nan).nonzero().tolist()}"
            torch.testing.assert_close(
                x[~nan], x_want[~nan], rtol=1e-12, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}"
            )


def test_reference_lse_gradient_with_non_finite_key():
    # Only the lse in the loss: V's gradient stays None (the lse ignores V) with the guard too, and
    # the rows that see the NaN key pass NaN to their queries and the keys they see.
    q, k, v = make_qkv(1, 8, 8, 2, 1, 8, F64)
    k[0, 5, 0, 2] = math.nan
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    _, lse = kernels.flash_attention(q, k, v, return_lse=True, backend="reference")
    assert torch.equal(lse.isnan()[0, 0], torch.arange(8, device=DEVICE) >= 5)
    dq, dk, dv = torch.autograd.grad(lse[~lse.isnan()].sum(), (q, k, v), allow_unused=True)
    assert dv is None
    assert torch.equal(dq.isnan().any(-1)[0, :, 0], torch.arange(8, device=DEVICE) >= 5)
    assert dk.isnan().all()  # row 7 sees every key


# (Tq, Tk, causal, window): PyTorch's fused call with is_causal, with a mask, without one; the
# explicit path (Tq > Tk, rows 0..2 see no key).
NON_FINITE_QUERY_CASES = [(8, 8, True, None), (8, 8, True, 3), (5, 7, False, None), (8, 5, True, None)]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "lse"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=dtype_id)
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,window",
    NON_FINITE_QUERY_CASES,
    ids=[f"q{c[0]}-k{c[1]}-{'c' if c[2] else 'nc'}-w{c[3]}" for c in NON_FINITE_QUERY_CASES],
)
def test_non_finite_query_gives_nan_in_its_row(
    seqlen_q, seqlen_k, causal, window, dtype, return_lse, backend
):
    # A query with a NaN entry, or infinite entries (scores inf - inf = NaN): its row's output and lse
    # are NaN where the row sees a key, 0 and -inf where it sees none; other rows are unchanged. The
    # reference used to return 0 there (PyTorch's fused CPU attention, float64 too: silent wrong
    # numbers) and an lse of -inf or +inf. (A -inf entry that makes every score -inf is NaN in the
    # reference and an empty row, 0, in the kernel: not tested.)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 16, dtype)
    kwargs = dict(causal=causal, window=window, return_lse=return_lse, backend=backend)
    want = kernels.flash_attention(q, k, v, **kwargs)
    sees_a_key = visible_mask(seqlen_q, seqlen_k, causal, window, DEVICE).any(1)  # (Tq,)
    for row in (seqlen_q - 1, 0):
        for bad, entries in [(math.nan, 3), (math.inf, slice(None)), (-math.inf, slice(None))]:
            q_bad = q.clone()
            q_bad[1, row, 2, entries] = bad
            got = kernels.flash_attention(q_bad, k, v, **kwargs)
            o, lse = got if return_lse else (got, None)
            o_want, lse_want = want if return_lse else (want, None)
            nan = torch.zeros(2, seqlen_q, 4, dtype=torch.bool, device=DEVICE)
            nan[1, row, 2] = bool(sees_a_key[row])
            where = f"{bad} in query row {row}"
            assert torch.equal(o.isnan(), nan[..., None].expand_as(o)), where
            torch.testing.assert_close(o[~o.isnan()], o_want[~o.isnan()], msg=lambda m, w=where: f"{w}: {m}")
            if lse is not None:
                assert torch.equal(lse.isnan(), nan.transpose(1, 2)), where
                torch.testing.assert_close(lse[~nan.transpose(1, 2)], lse_want[~nan.transpose(1, 2)])


# The interpreter's numpy warns on the NaN / inf tiles.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_triton_confines_non_finite_hidden_keys():
    # The kernel masks scores with where(), so a NaN or infinite score of a hidden key reaches no
    # row, even in a key tile the row's block loads (interpreter tiles: 32 query rows x 16 keys).
    # Values are not confined that way (0 * NaN in P @ V, see the reference's docstring).
    for seqlen_q, seqlen_k, window, pos in [(40, 40, None, 39), (20, 45, 7, 40)]:
        q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 16, torch.float32)
        want = kernels.flash_attention(q, k, v, window=window, backend="triton")
        hidden = ~visible_mask(seqlen_q, seqlen_k, True, window, DEVICE)[:, pos]  # (Tq,)
        assert hidden.any() and not hidden.all()
        for bad in (math.nan, math.inf):
            k_bad = k.clone()
            k_bad[0, pos, 0, 3] = bad
            got = kernels.flash_attention(q, k_bad, v, window=window, backend="triton")
            assert torch.equal(got[:, hidden], want[:, hidden])
            if math.isnan(bad):
                assert got[:, ~hidden].isnan().all()


# ----------------------------------------------------------------------------------------------
# GPU: the full sweep, bf16, realistic shapes, the mixers (pytest -m gpu)
# ----------------------------------------------------------------------------------------------

GPU_LENGTHS = [(1, 1), (17, 17), (64, 64), (65, 65), (127, 127), (200, 200), (1, 200), (200, 1), (17, 65),
               (65, 17), (64, 127), (127, 64), (113, 203), (203, 113), (512, 512), (257, 1023)]  # fmt: skip
GPU_MASKS = [(False, None), (True, None), (True, 1), (True, 16), (True, 64), (True, 100), (True, 4096)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2)])
def test_gpu_sweep(dtype, head_dim, num_heads, num_kv_heads):
    # All lengths x masks for this (dtype, head dim, GQA group); one test id per compile key.
    for (seqlen_q, seqlen_k), (causal, window) in itertools.product(GPU_LENGTHS, GPU_MASKS):
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype)
        try:
            assert_flash_accuracy(q, k, v, causal=causal, window=window)
        except AssertionError as exc:
            raise AssertionError(
                f"Tq={seqlen_q} Tk={seqlen_k} causal={causal} window={window}: {exc}"
            ) from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_non_contiguous(layout, dtype):
    q, k, v = make_qkv(2, 300, 333, 6, 2, 96, dtype, layout)
    for causal, window in GPU_MASKS[:4]:
        assert_flash_accuracy(q, k, v, causal=causal, window=window)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(
    "batch,seqlen,num_heads,num_kv_heads,head_dim,window",
    [
        (2, 1024, 16, 16, 128, None),
        (2, 1024, 16, 4, 128, 256),
        (1, 4096, 8, 2, 64, None),
        (4, 512, 8, 8, 256, 100),
    ],
)
def test_gpu_realistic_shapes(dtype, batch, seqlen, num_heads, num_kv_heads, head_dim, window):
    q, k, v = make_qkv(batch, seqlen, seqlen, num_heads, num_kv_heads, head_dim, dtype)
    assert_flash_accuracy(q, k, v, causal=True, window=window)


@pytest.mark.gpu
@gpu
def test_gpu_float64():
    for (seqlen_q, seqlen_k), (causal, window) in itertools.product(GPU_LENGTHS[:8], GPU_MASKS[:4]):
        q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 2, 64, F64)
        assert_flash_accuracy(q, k, v, causal=causal, window=window)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "name,settings",
    [
        ("attention", dict(num_heads=8)),
        ("attention", dict(num_heads=6, num_kv_heads=2)),
        ("sliding_window", dict(num_heads=6, num_kv_heads=2, window=37)),
        ("sliding_window", dict(num_heads=4, window=64)),
    ],
    ids=["mha", "gqa3", "swa-gqa3", "swa-64"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_mixers_match_reference_backend(monkeypatch, name, settings, dtype):
    # Mixers call kernels.flash_attention(...) with backend=None: the Triton kernel on CUDA. Same
    # mixer, same input, once more with the reference forced: outputs and parameter gradients agree.
    from mixers import build_mixer

    mixer = build_mixer(name, 384, **settings).to(DEVICE, dtype)
    x = torch.randn(2, 300, 384, device=DEVICE, dtype=dtype)
    results = []
    for backend in ("triton", "reference"):
        if backend == "reference":
            forced = functools.partial(kernels.flash_attention, backend="reference")
            monkeypatch.setattr(kernels, "flash_attention", forced)
        mixer.zero_grad()
        y = mixer(x)
        y.float().square().mean().backward()
        results.append((y.float(), [p.grad.float().clone() for p in mixer.parameters()]))
    (y_tr, g_tr), (y_ref, g_ref) = results
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y_tr, y_ref, **tol)
    for a, b in zip(g_tr, g_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)

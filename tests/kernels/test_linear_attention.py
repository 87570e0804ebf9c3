"""The chunked linear-attention Triton kernels (kernels/linear_attention.py) against the reference.

Accuracy rule (flash-attention's, as in test_flash_attention.py): with the float64 reference on the
same (dtype-rounded) inputs as ground truth,

    err(kernel in dtype X)  <=  2 * err(naive linear attention in dtype X) + atol   (output)
                                3 * ...                                          (dq, dk, dv,
                                                                                  d initial state)

where "naive" is the textbook parallel form (Katharopoulos et al. 2020, eq. 4: masked
``(scale q) k^T`` times v, over its row sum) with every intermediate rounded to X -- written out
below, because the reference upcasts 16-bit inputs; in fp32 on the GPU its contractions over K
and V are summed in order, as Triton's IEEE fp32 dot does, and the scale multiplies q's products, as
in the kernel -- and its gradients by autograd in X; ``atol``
is X's rounding step at the values' magnitude (flash-attn's). The kernel rounds the per-chunk
states to X before their tensor-core products, as the naive form rounds its scores, so the two
errors are of one size. The final state is accumulated in fp32 (fp64), not in X, so it is held to
the bound of fp32 summation instead: ``n u (|S_0| + |k|^T |v|)`` elementwise, n the number of
terms summed along one path (a chunk, then one add per chunk), u = 2^-23 (2^-52), which also holds
for accumulators that truncate. float64 runs are compared with the reference at ~1e-10.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with
chunks of 16 and 32-wide K / V tiles, so the tiny cases below span several chunks and tiles and
cover every *kind* of case once: T = 1, 17, 64, 65, 300; K and V of 16, 64, 80, 128, 273; normalize
on and off; initial state given or not (and its gradient); gradients of the final state; prefill +
decode; two calls with a carried state; non-contiguous inputs and output gradients; NaN-poisoned
buffers; empty sequences; errors. The full product, bf16 and realistic shapes (chunks of 64, the
CUDA autotune configs, each one forced in turn to catch a miscompiled config) are marked ``gpu``
(``pytest -m gpu`` on a CUDA machine). Without CUDA every test here runs on CPU; with CUDA the
unmarked tests run on the GPU too.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
from helpers import dtype_id, forced_config, gpu, record_step_plans, same_layout

import kernels
from kernels import reference
from kernels._host import sm_count

# ``kernels.linear_attention`` is the public function (it shadows the submodule's name on the
# package), so the kernel module is taken from sys.modules.
la = sys.modules["kernels.linear_attention"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
# Five fp32 chunks, the last ragged: T 70 under the interpreter (chunks of 16), 134 on CUDA (32). The
# tests of the segment and z-program layouts count on five (a plain T 70 made three on a GPU, where
# their layout checks failed: 2026-12-07, H100).
FIVE_CHUNKS = 4 * la.chunk_size(torch.float32) + 6


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _place(x: torch.Tensor, dtype, layout: str) -> torch.Tensor:
    """x (B, T, H, D) in ``dtype`` on DEVICE, laid out as ``layout``: "contiguous"; "transposed"
    (allocated (B, H, T, D)); "sliced" (a window of a larger tensor: odd offsets, padded rows);
    "strided_d" (stride 2 along D)."""
    if layout == "contiguous":
        y = x
    elif layout == "transposed":
        y = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "sliced":
        b, t, h, d = x.shape
        y = torch.zeros(b, t + 3, h + 1, d + 8)
        y[:, 2 : 2 + t, 1:, 3 : 3 + d] = x
        y = y[:, 2 : 2 + t, 1:, 3 : 3 + d]
    elif layout == "strided_d":
        y = torch.zeros(*x.shape[:3], 2 * x.shape[3])
        y[..., ::2] = x
        y = y[..., ::2]
    else:
        raise ValueError(layout)
    # Cast without copying into a contiguous tensor: the view keeps its strides.
    return torch.empty_strided(y.shape, y.stride(), dtype=dtype, device=DEVICE).copy_(y)


def make_inputs(batch, seqlen, num_heads, k_dim, v_dim, dtype, *, normalize, init, layout="contiguous"):
    """q, k (B, T, H, K), v (B, T, H, V) and the initial state (or None).

    Normalised runs get positive features (elu + 1 of a Gaussian, as the mixer's default map);
    unnormalised ones signed (identity) features. The initial state looks like the state after ~10
    earlier tokens: kv ~ N(0, 10), z ~ 10 positive features; fp32 (fp64 for fp64 inputs).
    """

    def features(*shape):
        x = torch.randn(*shape)
        return F.elu(x) + 1 if normalize else x

    q = _place(features(batch, seqlen, num_heads, k_dim), dtype, layout)
    k = _place(features(batch, seqlen, num_heads, k_dim), dtype, layout)
    v = _place(torch.randn(batch, seqlen, num_heads, v_dim), dtype, layout)
    state = None
    if init:
        sdtype = F64 if dtype == F64 else torch.float32
        kv0 = (torch.randn(batch, num_heads, k_dim, v_dim) * math.sqrt(10)).to(DEVICE, sdtype)
        z0 = (10 * features(batch, num_heads, k_dim).abs()).to(DEVICE, sdtype)
        state = (kv0, z0) if normalize else kv0
    return q, k, v, state


def _einsum2(equation, a, b, ordered):
    """torch.einsum of two operands; with ``ordered``, a contraction over a feature index (k or v)
    is summed term by term in index order."""
    ins, out = equation.split("->")
    ia, ib = ins.split(",")
    contracted = (set(ia) & set(ib)) - set(out)
    if not ordered or len(contracted) != 1 or not contracted <= set("kv"):
        return torch.einsum(equation, a, b)
    (c,) = contracted
    term = f"{ia.replace(c, '')},{ib.replace(c, '')}->{out}"
    acc = torch.einsum(term, a.select(ia.index(c), 0), b.select(ib.index(c), 0))
    for i in range(1, a.shape[ia.index(c)]):
        acc = acc + torch.einsum(term, a.select(ia.index(c), i), b.select(ib.index(c), i))
    return acc


class _OrderedEinsum(torch.autograd.Function):
    """Two-operand einsum whose feature-dim contractions (over K or V), forward and backward, are
    in-order sums: on the GPU Triton's IEEE fp32 ``tl.dot`` is an in-order FMA chain along its
    contraction dim, whose rounding error (growing with K, V) is several times that of cuBLAS's
    blocked sums (kernel / cuBLAS naive up to ~5x at T = 1 on an H200, where nothing else rounds);
    the fp32 textbook baseline sums in the same order, as in test_flash_attention.py."""

    @staticmethod
    def forward(ctx, equation, a, b):
        ctx.equation = equation
        ctx.save_for_backward(a, b)
        return _einsum2(equation, a, b, ordered=True)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ins, out = ctx.equation.split("->")
        ia, ib = ins.split(",")
        ga = _einsum2(f"{out},{ib}->{ia}", grad, b, ordered=True) if ctx.needs_input_grad[1] else None
        gb = _einsum2(f"{out},{ia}->{ib}", grad, a, ordered=True) if ctx.needs_input_grad[2] else None
        return None, ga, gb


def naive_linear_attention(q, k, v, *, normalize, initial_state, scale=None, eps=1e-10):
    """Katharopoulos et al. 2020, eq. 4 (the parallel form), every intermediate in q's dtype:
    ``o = (tril(scale q k^T) v + scale q S_0) / (rowsum(tril(scale q k^T)) + scale q z_0 + eps)``;
    final state ``S_0 + k^T v`` (and ``z_0 + sum k``). Returns (o, kv, z or None)."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if dtype == torch.float32 and q.is_cuda:
        # The GPU kernel's order of operations (see _OrderedEinsum): in-order sums over K and V,
        # the scale applied to q's products rather than to q.
        def q_product(equation, other):
            return _OrderedEinsum.apply(equation, q, other) * scale

        einsum = _OrderedEinsum.apply
    else:
        qs = q * scale

        def q_product(equation, other):
            return torch.einsum(equation, qs, other)

        einsum = torch.einsum
    seqlen = q.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
    scores = q_product("bthk,bshk->bhts", k).masked_fill(~causal, 0)  # (B, H, T, T)
    num = einsum("bhts,bshv->bthv", scores, v)
    kv = einsum("bthk,bthv->bhkv", k, v)
    if normalize:
        kv0, z0 = initial_state if initial_state is not None else (None, None)
    else:
        kv0, z0 = initial_state, None
    if kv0 is not None:
        num = num + q_product("bthk,bhkv->bthv", kv0.to(dtype))
        kv = kv + kv0.to(dtype)
    if not normalize:
        return num, kv, None
    den = scores.sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, T, H, 1)
    z = k.sum(1)
    if z0 is not None:
        den = den + q_product("bthk,bhk->bth", z0.to(dtype)).unsqueeze(-1)
        z = z + z0.to(dtype)
    return num / (den + eps), kv, z


def run(impl, q, k, v, initial_state, do, dstate, *, normalize, scale=None):
    """(o, kv, z, dq, dk, dv, dkv0, dz0) of ``impl`` ("naive", "reference", "triton"), the grads of
    ``sum(o * do) + sum(kv * dkv) [+ sum(z * dz)]`` with dstate = (dkv, dz); absent ones are None."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if initial_state is None:
        state, leaves = None, []
    elif normalize:
        state = tuple(s.detach().requires_grad_() for s in initial_state)
        leaves = list(state)
    else:
        state = initial_state.detach().requires_grad_()
        leaves = [state]
    if impl == "naive":
        o, kv, z = naive_linear_attention(q, k, v, normalize=normalize, initial_state=state, scale=scale)
    else:
        o, final = kernels.linear_attention(
            q, k, v, scale=scale, normalize=normalize, initial_state=state, output_final_state=True,
            backend=impl,
        )  # fmt: skip
        kv, z = final if normalize else (final, None)
    dkv, dz = dstate
    loss = (o * do.to(o.dtype)).sum() + (kv * dkv.to(kv.dtype)).sum()
    if normalize:
        loss = loss + (z * dz.to(z.dtype)).sum()
    grads = torch.autograd.grad(loss, [q, k, v, *leaves])
    dkv0, dz0 = (grads[3:] + (None, None))[:2] if normalize else ((grads[3:] + (None,))[0], None)
    return o, kv, z, *grads[:3], dkv0, dz0


NAMES = ("o", "kv", "z", "dq", "dk", "dv", "dkv0", "dz0")


def rounding_atol(x_ref, dtype):
    """flash-attn's atol: twice dtype's rounding step at the magnitude of x_ref (and of 0.3)."""
    x = x_ref.to(dtype)
    return 2 * (x + 0.3 - 0.3 - x).abs().max().item()


def summation_bound(k, v, kv0, z0, dtype):
    """Elementwise bounds on the final state's error (kv, z): n u (|S_0| + |k|^T |v|) (see the
    module docstring), in fp64."""
    seqlen = k.shape[1]
    chunk = la.chunk_size(dtype)
    u = 2.0**-52 if dtype == F64 else 2.0**-23
    n = chunk + triton.cdiv(seqlen, chunk) + 2
    kd, vd = k.double().abs(), v.double().abs()
    kv_mag = torch.einsum("bthk,bthv->bhkv", kd, vd)
    z_mag = kd.sum(1)
    if kv0 is not None:
        kv_mag = kv_mag + kv0.double().abs()
    if z0 is not None:
        z_mag = z_mag + z0.double().abs()
    return n * u * kv_mag, n * u * z_mag


def _normaliser_terms(q, k, z0, do, o_ref, scale):
    """fp64 z_t (B, T, H, K), den_t = scale q_t . z_t (B, T, H) and sum_v |dO_tv O_tv| / den_t."""
    qd, kd = q.double(), k.double()
    z = kd.cumsum(1) + (z0.double()[:, None] if z0 is not None else 0)
    den = scale * (qd * z).sum(-1)
    return z, den, (do.double().abs() * o_ref.abs()).sum(-1) / den


def normaliser_floors(q, k, z0, do, o_ref, scale):
    """Error floors of dq, dk, dz0 from the normaliser's gradient r_t = -rowsum(dO_t * O_t) / den_t.

    Like FA2's delta = rowsum(dO * O), r is formed from the output as stored in dtype X, so it
    carries an absolute error of about eps(X) sum_v |dO_tv O_tv| / den_t, while the terms it cancels
    against (dO_t / den_t . v_s) are O(1): at T = 1, or wherever o_t ~ v_t, the exact gradient is
    ~0 and the naive backward (whose two terms round alike) can be far more accurate than any
    kernel that saves O. Carried into dq_t = ... + scale r_t z_t, dk_s = ... + scale sum_{t>=s} r_t q_t
    and dz0 = scale sum_t r_t q_t, that is the floor of each.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    z, _, r_mag = _normaliser_terms(q, k, z0, do, o_ref, scale)
    r_err = torch.finfo(q.dtype).eps * r_mag
    weighted_q = r_err[..., None] * q.double().abs()  # (B, T, H, K)
    after = weighted_q.flip(1).cumsum(1).flip(1)  # sum over t >= s
    return {
        "dq": 2 * scale * (r_err[..., None] * z.abs()).max().item(),
        "dk": 2 * scale * after.max().item(),
        "dz0": 2 * scale * weighted_q.sum(1).max().item(),
    }


def state_gradient_bounds(q, k, z0, do, o_ref, dstate, normalize, scale):
    """Summation bounds (max over elements, as in :func:`summation_bound`) of the initial state's
    gradient dkv0 = dkv + scale sum_t q_t g_t^T and dz0 = dz + scale sum_t r_t q_t, where
    g_t = dO_t [/ den_t] and r_t = -rowsum(dO_t * O_t) / den_t."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chunk = la.chunk_size(dtype)
    u = 2.0**-52 if dtype == F64 else 2.0**-23
    n = chunk + triton.cdiv(q.shape[1], chunk) + 2
    qd, g = q.double().abs(), do.double().abs()
    dkv, dz = (x.double().abs() for x in dstate)
    bounds = {}
    if normalize:
        _, den, r_mag = _normaliser_terms(q, k, z0, do, o_ref, scale)
        g = g / den[..., None]
        bounds["dz0"] = n * u * (dz + scale * torch.einsum("bthk,bth->bhk", qd, r_mag)).max().item()
    bounds["dkv0"] = n * u * (dkv + scale * torch.einsum("bthk,bthv->bhkv", qd, g)).max().item()
    return bounds


def assert_linear_accuracy(
    q, k, v, initial_state, *, normalize, scale=None, check_grads=True, do=None, dstate=None, kernel=None
):
    """Kernel vs float64 reference, bounded by the naive same-dtype error (module docstring).

    do (B, T, H, V) and dstate = (dkv, dz) are the gradients of the output and the final state
    (random when None); ``kernel(q, k, v, initial_state, do, dstate)`` returns the outputs of
    :func:`run` to check (the Triton kernel's when None).
    """
    dtype = q.dtype
    batch, _, num_heads, k_dim = q.shape
    v_dim = v.shape[3]
    if do is None:
        do = torch.randn(v.shape, device=q.device).to(dtype)
    if dstate is None:
        dstate = (torch.randn(batch, num_heads, k_dim, v_dim, device=q.device),
                  torch.randn(batch, num_heads, k_dim, device=q.device))  # fmt: skip
    if kernel is None:
        got = run("triton", q, k, v, initial_state, do, dstate, normalize=normalize, scale=scale)
    else:
        got = kernel(q, k, v, initial_state, do, dstate)
    state64 = None
    if initial_state is not None:
        state64 = tuple(s.double() for s in initial_state) if normalize else initial_state.double()
    ref = run("reference", q.double(), k.double(), v.double(), state64, do.double(), dstate,
              normalize=normalize, scale=scale)  # fmt: skip

    acc = F64 if dtype == F64 else torch.float32
    assert got[0].dtype == dtype and got[0].shape == v.shape
    assert got[1].dtype == acc and got[1].shape == (batch, num_heads, k_dim, v_dim)
    if normalize:
        assert got[2].dtype == acc and got[2].shape == (batch, num_heads, k_dim)
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert (x is None) == (r is None), name
        if x is not None:
            assert x.shape == r.shape and torch.isfinite(x).all(), f"{name}: bad shape or non-finite values"
    if initial_state is not None:
        assert got[6].dtype == (initial_state[0] if normalize else initial_state).dtype

    if dtype == F64:
        for name, x, r in zip(NAMES, got, ref, strict=True):
            if x is not None and (check_grads or name in ("o", "kv", "z")):
                tol = 1e-10 * max(1.0, r.abs().max().item())
                torch.testing.assert_close(x, r, rtol=1e-10, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
        return

    kv0, z0 = (
        (initial_state if normalize else (initial_state, None)) if initial_state is not None else (None, None)
    )
    kv_bound, z_bound = summation_bound(k, v, kv0, z0, dtype)
    for name, x, r, bound in (("kv", got[1], ref[1], kv_bound), ("z", got[2], ref[2], z_bound)):
        if x is not None:
            excess = ((x.double() - r).abs() - bound).max().item()
            assert excess <= 0, f"{name}: final-state error beyond the fp32 summation bound by {excess:.3g}"

    naive = run("naive", q, k, v, initial_state, do, dstate, normalize=normalize, scale=scale)
    floors = normaliser_floors(q, k, z0, do, ref[0], scale) if normalize else {}
    # The initial state's gradient is a state too: the reverse scan adds one chunk's terms at a
    # time to an fp32 accumulator that starts at the final state's gradient (~sqrt(n_chunks) ulps
    # of it, where the naive form adds one product): the summation bound applies, as for kv, z.
    if initial_state is not None:
        for name, bound in state_gradient_bounds(q, k, z0, do, ref[0], dstate, normalize, scale).items():
            floors[name] = floors.get(name, 0.0) + bound
    checks = [("o", 0, 2)]
    if check_grads:
        checks += [(n, i, 3) for i, n in enumerate(NAMES) if i >= 3 and got[i] is not None]
    for name, i, factor in checks:
        err = (got[i].double() - ref[i]).abs().max().item()
        base_err = (naive[i].double() - ref[i]).abs().max().item()
        atol = rounding_atol(ref[i], dtype) + floors.get(name, 0.0)
        assert err <= factor * base_err + atol, (
            f"{name}: kernel error {err:.3g} > {factor} x naive {dtype} error {base_err:.3g} + atol {atol:.3g}"
        )


# ----------------------------------------------------------------------------------------------
# Accuracy: every kind of case once, at tiny sizes
# ----------------------------------------------------------------------------------------------

# (batch, T, H, K, V, normalize, initial state, dtype). The interpreter's chunks are 16 tokens, its
# K / V tiles 32 wide.
CASES = [
    (1, 1, 1, 16, 16, True, False, torch.float32),  # one token
    (1, 17, 2, 64, 16, False, True, torch.float16),  # one chunk + 1, a tile wider than V
    (1, 64, 1, 16, 80, True, True, torch.float16),  # four whole chunks, V 80 (3 tiles, last partial)
    (2, 65, 1, 80, 64, False, False, torch.float32),  # four chunks + 1, K 80, batch 2
    (1, 300, 1, 16, 16, True, True, torch.float32),  # 19 chunks, long state carry
    (1, 40, 1, 273, 32, True, True, torch.float16),  # Based's 273 Taylor features
    (1, 33, 1, 32, 273, False, True, torch.float32),  # V 273
    (1, 48, 1, 128, 128, True, False, torch.float16),  # 4 x 4 tiles
    (1, 45, 2, 80, 48, True, True, F64),  # fp64 vs reference at 1e-10
    (1, 37, 1, 20, 273, False, True, F64),
    (1, 70, 1, 273, 16, True, False, F64),
]


@pytest.mark.parametrize(
    "batch,seqlen,num_heads,k_dim,v_dim,normalize,init,dtype",
    CASES,
    ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-{'norm' if c[5] else 'raw'}-{'s0' if c[6] else 'nos0'}-"
         f"{dtype_id(c[7])}" for c in CASES],
)  # fmt: skip
def test_matches_reference(batch, seqlen, num_heads, k_dim, v_dim, normalize, init, dtype):
    q, k, v, state = make_inputs(
        batch, seqlen, num_heads, k_dim, v_dim, dtype, normalize=normalize, init=init
    )
    assert_linear_accuracy(q, k, v, state, normalize=normalize)


def test_normaliser_beyond_the_fp16_range():
    # z grows linearly in T: here it starts at ~1e5, beyond fp16's 65504 (kv0 stays in range, as
    # for zero-mean v), so a 16-bit copy of z (the fused forward's tensor-core q . z operand) must be
    # rescaled, not overflow to inf. The naive fp16 form overflows, so the bound is first-order
    # rounding: a few fp16 units (2^-11) of |q| . |S| / den per output, S rounded to fp16 per chunk.
    q, k, v, (kv0, z0) = make_inputs(1, 40, 1, 16, 16, torch.float16, normalize=True, init=True)
    kv0, z0 = kv0 * 1e3, z0 * 1e4
    assert z0.max() > 65504 > kv0.abs().max()
    got = kernels.linear_attention(q, k, v, initial_state=(kv0, z0), backend="triton")
    q64, k64, v64 = q.double(), k.double(), v.double()
    want = reference.linear_attention(q64, k64, v64, initial_state=(kv0.double(), z0.double()))
    q64, k64, v64 = q64[0, :, 0], k64[0, :, 0], v64[0, :, 0]  # (T, K), (T, K), (T, V)
    scale = 16**-0.5
    den = scale * (q64 * (z0.double()[0, 0] + k64.cumsum(0))).sum(1)  # (T,)
    s_abs = kv0.double().abs()[0, 0] + k64.T @ v64.abs()  # (K, V): bounds every |S_c|
    bound = 8 * 2.0**-11 * (scale * (q64 @ s_abs) / den[:, None] + want[0, :, 0].abs())
    assert torch.isfinite(got).all()
    err = (got.double() - want)[0, :, 0].abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} beyond the rounding bound (max {bound.max():.3g})"


def test_chunk_states_scales_fp16_states_into_range():
    # (B=1, H=2, n_chunks=3, D=5, E=7) fp32 states from 1e-3 to 1e9 in magnitude: each (b, h, chunk)
    # state's scale is 1 when it fits fp16 (max <= 2^15), else the power of two that puts its max
    # in [2^14, 2^15); the fp16 copy times its scale is the state rounded to fp16's precision.
    magnitudes = torch.tensor([1e-3, 1e2, 3e4, 4e4, 1e6, 1e9], device=DEVICE).view(1, 2, 3, 1, 1)
    states = torch.randn(1, 2, 3, 5, 7, device=DEVICE) * magnitudes
    half, scales = la.chunk_states(states, torch.float16)
    assert half.dtype == torch.float16 and half.shape == states.shape and scales.shape == (1, 2, 3)
    amax = states.abs().amax(dim=(-2, -1))
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all(), "scales must be powers of two"
    assert (scales[amax <= 2**15] == 1).all()
    scaled_max = amax / scales
    assert ((scaled_max >= 2**14) | (amax <= 2**15)).all() and (scaled_max < 2**15 + 1).all()
    back = half.double() * scales.double()[..., None, None]
    err = (back - states.double()).abs()
    assert (err <= 2.0**-11 * states.double().abs() + 2.0**-24 * scales.double()[..., None, None]).all()
    same, no_scales = la.chunk_states(states, torch.bfloat16)
    assert same is states and no_scales is None
    assert la.chunk_states(None, torch.float16) == (None, None)


# (grown, normalize, K): which per-chunk states pass fp16's range -- the forward's S_c ("S", in the
# fused forward at K <= 128 and in the state kernel beyond) or the reverse scan's dS_c ("dS").
BEYOND_FP16 = [("S", True, 16), ("S", False, 16), ("S", True, 144), ("dS", True, 16), ("dS", False, 16)]


@pytest.mark.parametrize(
    "grown,normalize,k_dim",
    BEYOND_FP16,
    ids=[f"{g}-{'norm' if n else 'raw'}-K{k}" for g, n, k in BEYOND_FP16],
)
def test_states_beyond_the_fp16_range(grown, normalize, k_dim):
    # Linear attention is linear in (v, S_0) and in (dO, dS_N, dz_N): scaling v and kv0 by alpha,
    # dO and dkv by beta and dz by alpha beta (powers of two, exact in fp16) scales o and kv by
    # alpha, dv and dkv0 by beta, dq, dk and dz0 by alpha beta, and leaves z. The kernel on the
    # scaled inputs, whose states pass 65504, scaled back, must meet the accuracy rule of the
    # in-range problem (the naive fp16 form of the scaled one overflows).
    q, k, v, state = make_inputs(1, 40, 1, k_dim, 16, torch.float16, normalize=normalize, init=True)
    do = torch.randn(v.shape, device=DEVICE).to(torch.float16)
    dkv, dz = torch.randn(1, 1, k_dim, 16, device=DEVICE), torch.randn(1, 1, k_dim, device=DEVICE)
    # Every scaled output must still fit fp16 (the float64 reference's magnitudes were checked):
    # where S grows, dq and dk grow by alpha beta (beta < 1) and the raw o = scale q S needs small
    # q; where dS grows, dk = V dS^T + dz_c and dv = K dS by beta: small k, v, dO and dz beside dkv.
    if grown == "S":
        alpha, beta = 2.0**13, 2.0**-6
        if not normalize:
            q = q / 16
    else:
        alpha, beta = 1.0, 2.0**15
        k, v, do, dz = k / 64, v / 64, do / 256, dz / 64
    big = {}

    def scaled_kernel(q, k, v, state, do, dstate):
        kv0, z0 = state if normalize else (state, None)
        dkv, dz = dstate
        big_state = (kv0 * alpha, z0) if normalize else kv0 * alpha
        big_dstate = (dkv * beta, dz * alpha * beta)
        got = run("triton", q, k, v * alpha, big_state, do * beta, big_dstate, normalize=normalize)
        big["kv"], big["dkv0"] = got[1], got[6]
        factors = (alpha, alpha, 1.0, alpha * beta, alpha * beta, beta, beta, alpha * beta)
        return tuple(None if x is None else x / f for x, f in zip(got, factors, strict=True))

    assert_linear_accuracy(q, k, v, state, normalize=normalize, do=do, dstate=(dkv, dz), kernel=scaled_kernel)
    grew = big["kv"] if grown == "S" else big["dkv0"]
    assert grew.abs().max() > 65504, f"the test's {grown} stayed within fp16's range: {grew.abs().max():.3g}"


def test_scale_and_eps_arguments():
    q, k, v, state = make_inputs(1, 20, 2, 16, 16, F64, normalize=True, init=True)
    assert_linear_accuracy(q, k, v, state, normalize=True, scale=0.37)
    for eps in (0.0, 0.5):
        got = kernels.linear_attention(q, k, v, eps=eps, initial_state=state, backend="triton")
        want = reference.linear_attention(q, k, v, eps=eps, initial_state=state)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_d"])
def test_non_contiguous_inputs(layout):
    # q, k, v, the initial state and the output gradient as views: same bits as contiguous copies.
    q, k, v, (kv0, z0) = make_inputs(
        1, 23, 2, 24, 40, torch.float32, normalize=True, init=True, layout=layout
    )
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    kv0_t = kv0.transpose(2, 3).contiguous().transpose(2, 3)  # (B, H, K, V) with K innermost
    z0_s = torch.zeros(1, 2, 2 * 24, device=DEVICE)[..., ::2].copy_(z0)
    do = torch.randn(v.shape, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    dstate = (torch.randn(kv0.shape, device=DEVICE), torch.randn(z0.shape, device=DEVICE))
    strided = run("triton", q, k, v, (kv0_t, z0_s), do, dstate, normalize=True)
    contiguous = run("triton", q.contiguous(), k.contiguous(), v.contiguous(), (kv0, z0), do.contiguous(),
                     dstate, normalize=True)  # fmt: skip
    for name, a, b in zip(NAMES, strided, contiguous, strict=True):
        # On CUDA, dz0 (one chunk here) is a tl.sum over q's rows in the register layout Triton
        # picks from the strides it specialises on (stride 1, multiples of 16): another summation
        # order, so other bits. The accuracy check below bounds it against float64 instead.
        if not (DEVICE == "cuda" and name == "dz0"):
            assert torch.equal(a, b), name
    assert_linear_accuracy(q, k, v, (kv0_t, z0_s), normalize=True)


def test_expanded_output_gradient():
    # o.sum() backpropagates an all-ones gradient with every stride 0.
    q, k, v, state = make_inputs(1, 21, 1, 16, 24, F64, normalize=False, init=True)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, state)]
        o = kernels.linear_attention(*leaves[:3], normalize=False, initial_state=leaves[3], backend=backend)
        grads.append(torch.autograd.grad(o.sum(), leaves))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# State: prefill + decode, carried state, decode step
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=dtype_id)
def test_prefill_then_decode_equals_full_forward(normalize, dtype):
    # Full forward over 45 tokens == prefill 20 + chunked prefill 17 (carried state) + 8 decode steps.
    q, k, v, _ = make_inputs(2, 45, 2, 24, 40, dtype, normalize=normalize, init=False)
    full, final = kernels.linear_attention(
        q, k, v, normalize=normalize, output_final_state=True, backend="triton"
    )
    o1, state = kernels.linear_attention(
        q[:, :20], k[:, :20], v[:, :20], normalize=normalize, output_final_state=True, backend="triton"
    )
    o2, state = kernels.linear_attention(
        q[:, 20:37], k[:, 20:37], v[:, 20:37], normalize=normalize, initial_state=state,
        output_final_state=True, backend="triton",
    )  # fmt: skip
    kv, z = (t.clone() for t in state) if normalize else (state.clone(), None)
    steps = [
        kernels.linear_attention_step(q[:, t], k[:, t], v[:, t], kv, z_state=z, backend="triton")
        for t in range(37, 45)
    ]
    pieces = torch.cat([o1, o2, torch.stack(steps, dim=1)], dim=1)
    # fp32: the two paths sum the same terms in other orders (chunk products vs token by token):
    # a few ulps of sums of up to 45 O(1)-O(10) terms.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pieces, full, **tol)
    torch.testing.assert_close(kv, final[0] if normalize else final, **tol)
    if normalize:
        torch.testing.assert_close(z, final[1], **tol)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
def test_two_calls_with_carried_state_equal_one(normalize):
    # Forward and every gradient (through the carried state too), split mid-chunk at 23.
    q, k, v, state = make_inputs(1, 50, 2, 20, 36, F64, normalize=normalize, init=True)
    do = torch.randn(v.shape, device=DEVICE, dtype=F64)

    def losses(split):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        s0 = (
            tuple(x.detach().requires_grad_() for x in state)
            if normalize
            else state.detach().requires_grad_()
        )
        s = s0
        outs = []
        for lo, hi in ((0, split), (split, 50)) if split else ((0, 50),):
            o, s = kernels.linear_attention(
                *(x[:, lo:hi] for x in leaves), normalize=normalize, initial_state=s,
                output_final_state=True, backend="triton",
            )  # fmt: skip
            outs.append(o)
        o = torch.cat(outs, dim=1)
        final = s if normalize else (s,)
        loss = (o * do).sum() + sum((f * f).sum() for f in final)
        s0_leaves = list(s0) if normalize else [s0]
        return o, final, torch.autograd.grad(loss, leaves + s0_leaves)

    one, two = losses(None), losses(23)
    torch.testing.assert_close(two[0], one[0], rtol=1e-12, atol=1e-12)
    for a, b in zip((*two[1], *two[2]), (*one[1], *one[2]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


STEP_CASES = [
    # (K, V, normalise, q dtype, state dtype, non-contiguous state)
    (16, 16, True, torch.float32, torch.float32, False),
    (80, 273, False, torch.float16, torch.float32, True),
    (273, 64, True, torch.float16, torch.float32, False),
    (128, 128, True, F64, F64, True),
    (64, 20, False, torch.float32, F64, False),  # fp64 state: computes in fp64, like the reference
]


@pytest.mark.parametrize("k_dim,v_dim,normalize,dtype,state_dtype,strided", STEP_CASES)
def test_step_matches_reference(k_dim, v_dim, normalize, dtype, state_dtype, strided):
    batch, num_heads = 3, 2
    q, k = (F.elu(torch.randn(batch, num_heads, k_dim)) + 1 for _ in range(2))
    q, k = q.to(DEVICE, dtype), k.to(DEVICE, dtype)
    v = torch.randn(batch, num_heads, v_dim).to(DEVICE, dtype)
    if strided:  # a (B, H, K, V) view with V outermost, and a z view with stride 2
        state = torch.randn(batch, num_heads, v_dim, k_dim, device=DEVICE, dtype=state_dtype).transpose(2, 3)
        z = torch.rand(batch, num_heads, 2 * k_dim, device=DEVICE, dtype=state_dtype)[..., ::2] * 10
    else:
        state = torch.randn(batch, num_heads, k_dim, v_dim, device=DEVICE, dtype=state_dtype)
        z = torch.rand(batch, num_heads, k_dim, device=DEVICE, dtype=state_dtype) * 10
    z = z if normalize else None
    state_ref, z_ref = state.clone(), (z.clone() if normalize else None)
    out = kernels.linear_attention_step(q, k, v, state, z_state=z, backend="triton")
    want = reference.linear_attention_step(q, k, v, state_ref, z_state=z_ref)
    assert out.dtype == dtype and out.shape == (batch, num_heads, v_dim)
    # Same fp32 (fp64) math in another summation order: q . S sums K <= 273 terms (a few ulps); an fp16
    # output may then round to the neighbouring fp16 value (2^-11 relative).
    tight = torch.float64 in (dtype, state_dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if tight else dict(rtol=1e-5, atol=1e-5)
    out_tol = tol if tight or dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, want, **out_tol)
    torch.testing.assert_close(state, state_ref, **tol)  # updated in place, through the view
    if normalize:
        torch.testing.assert_close(z, z_ref, **tol)


# ----------------------------------------------------------------------------------------------
# Memory discipline and edge cases
# ----------------------------------------------------------------------------------------------


def test_outputs_fully_written_and_deterministic(monkeypatch):
    # Every buffer the kernels allocate (outputs, per-chunk states, normaliser terms) starts as NaN:
    # an element a program forgot to store, or read before it was written, surfaces as NaN. No
    # atomics, so results are bitwise equal run to run (and to the un-poisoned run).
    q, k, v, state = make_inputs(2, 37, 2, 40, 24, torch.float32, normalize=True, init=True)
    do = torch.randn(v.shape, device=DEVICE)
    dstate = (torch.randn(2, 2, 40, 24, device=DEVICE), torch.randn(2, 2, 40, device=DEVICE))
    clean = run("triton", q, k, v, state, do, dstate, normalize=True)
    again = run("triton", q, k, v, state, do, dstate, normalize=True)

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
    poisoned = run("triton", q, k, v, state, do, dstate, normalize=True)
    out_step = kernels.linear_attention_step(
        q[:, 0], k[:, 0], v[:, 0], state[0].clone(), z_state=state[1].clone(), backend="triton"
    )
    monkeypatch.undo()
    for name, a, b, c in zip(NAMES, clean, again, poisoned, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical calls"
        assert torch.equal(a, c), f"{name} differs when its buffers start as NaN"
    assert torch.isfinite(out_step).all()


def test_raw_mode_without_final_state_use():
    # normalize=False, final state unused (its gradient arrives as None), no initial state.
    q, k, v, _ = make_inputs(1, 30, 1, 16, 16, F64, normalize=False, init=False)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = kernels.linear_attention(*leaves, normalize=False, backend=backend)
        grads.append(torch.autograd.grad((o * o).sum(), leaves))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Only the final state used: the output's gradient arrives as None.
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    _, kv = kernels.linear_attention(*leaves, normalize=False, output_final_state=True, backend="triton")
    dq, dk, dv = torch.autograd.grad(kv.sum(), leaves)
    assert torch.equal(dq, torch.zeros_like(dq))
    torch.testing.assert_close(dk, v.sum(-1, keepdim=True).expand_as(k), rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
def test_non_finite_key_and_value_reach_the_rows_documented(normalize, backend):
    # kernels.reference.linear_attention's docstring: a NaN in k at position s reaches rows t >= s only
    # (the scores are masked with a select); one in v also the rows t < s of its chunk (0 * NaN in the
    # masked product), in both backends alike. An audit found the v case undocumented.
    seqlen, pos = 70, 40
    chunk = la.chunk_size(torch.float32) if backend == "triton" else reference._LINEAR_ATTENTION_CHUNK_SIZE
    start = pos // chunk * chunk  # the first row of the NaN's chunk
    rows = torch.arange(seqlen, device=DEVICE)
    for name, want in (("k", rows >= pos), ("v", rows >= start)):
        q, k, v, _ = make_inputs(1, seqlen, 2, 16, 16, torch.float32, normalize=normalize, init=False)
        {"k": k, "v": v}[name][0, pos, 1, 3] = math.nan
        o = kernels.linear_attention(q, k, v, normalize=normalize, backend=backend)
        assert torch.equal(o[0, :, 1].isnan().any(-1), want), name
        assert not o[0, :, 0].isnan().any(), name  # the other head


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
def test_empty_sequence_and_batch(normalize):
    for batch, seqlen in ((2, 0), (0, 5)):
        q, k, v, state = make_inputs(batch, seqlen, 2, 16, 8, torch.float32, normalize=normalize, init=True)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        s0 = (
            tuple(s.detach().requires_grad_() for s in state)
            if normalize
            else state.detach().requires_grad_()
        )
        o, final = kernels.linear_attention(
            *leaves, normalize=normalize, initial_state=s0, output_final_state=True, backend="triton"
        )
        assert o.shape == (batch, seqlen, 2, 8) and o.dtype == torch.float32
        finals = final if normalize else (final,)
        s0s = s0 if normalize else (s0,)
        for f, s in zip(finals, s0s, strict=True):
            assert torch.equal(f, s.detach())  # no token: the state passes through
        grads = torch.autograd.grad(sum((f * 2).sum() for f in finals), list(s0s))
        for g in grads:
            assert torch.equal(g, torch.full_like(g, 2.0))


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("k_dim,v_dim", [(0, 6), (8, 0)], ids=["K0", "V0"])
def test_zero_feature_dims_forward_and_backward(normalize, k_dim, v_dim):
    # K == 0 (every term of dV has a factor of K: zero) and V == 0 (no output element reaches the
    # normaliser), with an initial state: outputs and every gradient as the float64 reference's.
    q, k, v, state = make_inputs(2, 21, 2, k_dim, v_dim, F64, normalize=normalize, init=True)
    do = torch.randn(v.shape, dtype=F64, device=DEVICE)
    dstate = (
        torch.randn(2, 2, k_dim, v_dim, dtype=F64, device=DEVICE),
        torch.randn(2, 2, k_dim, dtype=F64, device=DEVICE),
    )
    got = run("triton", q, k, v, state, do, dstate, normalize=normalize, scale=1.0)
    ref = run("reference", q, k, v, state, do, dstate, normalize=normalize, scale=1.0)
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert (x is None) == (r is None), name
        if x is not None:
            torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)
    if k_dim == 0:
        assert torch.equal(got[5], torch.zeros_like(v))


def test_fused_forward_rule_and_segments():
    # K up to 128, normalised or not, takes the fused scan-and-output kernel, wider K the two-kernel
    # path; CASES cover both, and segments (interpreter: 4 SMs, so one program splits into 4).
    assert la.uses_fused_forward(128, 512) and la.uses_fused_forward(80, 16)
    assert not la.uses_fused_forward(129, 16) and not la.uses_fused_forward(273, 16)
    assert not la.uses_fused_forward(0, 16) and not la.uses_fused_forward(16, 0)
    assert la.num_segments(64, 128, 132) == 2  # B2 H16, 2 V tiles: one wave of 128 programs
    assert la.num_segments(256, 32, 132) == 1
    assert la.num_segments(1, 3, 132) == 3  # never more segments than chunks
    assert la.num_segments(0, 5, 4) == 4
    # The normalised fused forward loads each chunk's z from K padded to 128 on, except in fp16.
    assert la.loads_chunk_z(torch.bfloat16, 128) and la.loads_chunk_z(torch.float32, 65)
    assert not la.loads_chunk_z(torch.float16, 128) and not la.loads_chunk_z(torch.float32, 64)


def test_chunk_z_parts_choice():
    # Below 16 batch * heads the z programs walk parts of 32 chunks (T 8192 in bf16: 4 parts), at most
    # 64 parts, none empty; from 16 on one walk over the whole sequence, however long.
    assert la.CHUNK_Z_PARTS_BELOW_HEADS == 16 and la.CHUNK_Z_PART_CHUNKS == 32
    assert la.chunk_z_parts(128, 8) == (32, 4) and la.chunk_z_parts(512, 15) == (32, 16)
    assert la.chunk_z_parts(20, 1) == (20, 1) and la.chunk_z_parts(64 * 32 + 1, 1) == (33, 63)
    assert la.chunk_z_parts(128, 16) == (128, 1) and la.chunk_z_parts(512, 32) == (512, 1)
    assert la.chunk_z_parts(0, 1) == (1, 0) and la.chunk_z_parts(0, 32) == (1, 0)


@pytest.mark.parametrize("v_dim, layout", [(24, (1, 3)), (40, (2, 2))], ids=["V24", "V40"])
@pytest.mark.parametrize("chunk_z", [True, False], ids=["z-loaded", "z-carried"])
def test_fused_forward_normaliser_paths(monkeypatch, chunk_z, v_dim, layout):
    # K 80 pads to 128: in fp32 the normalised fused forward loads each chunk's z from the segment
    # kernel's z programs and the chunk-z kernel (and stores the states at the end of a chunk), unless
    # CHUNK_Z_MIN_K says otherwise. Both against the float64 reference, with an initial state, forward
    # and backward, at B1 H1 and 5 chunks (T 70 under the interpreter) in (V tiles, segments) = layout
    # under the interpreter's 4 SMs (on a GPU its own tiles and SMs, and more than one segment): the
    # segment sums, the z programs and the states at segment boundaries all take part.
    monkeypatch.setattr(la, "CHUNK_Z_MIN_K", 128 if chunk_z else 1 << 30)
    assert la.loads_chunk_z(torch.float32, 80) == chunk_z
    n_chunks = -(-FIVE_CHUNKS // la.chunk_size(torch.float32))
    e_tiles = -(-v_dim // la.fused_config(torch.float32)[0])
    sms = sm_count(torch.device(DEVICE), la.INTERPRET_SMS)
    per_segment = -(-n_chunks // la.num_segments(e_tiles, n_chunks, sms))
    n_segments = -(-n_chunks // per_segment)
    assert n_chunks == 5 and ((e_tiles, n_segments) == layout if DEVICE == "cpu" else n_segments > 1)
    q, k, v, state = make_inputs(1, FIVE_CHUNKS, 1, 80, v_dim, torch.float32, normalize=True, init=True)
    assert_linear_accuracy(q, k, v, state, normalize=True)


@pytest.mark.parametrize("z_step", [1, 2, 8])
def test_chunk_z_steps(monkeypatch, z_step):
    # The z programs sum CHUNK_Z_STEP chunks a step (4 in the other tests): one a step, a step that
    # leaves a ragged last step (5 chunks in steps of 2) and one longer than the sequence (8 > 5),
    # against the float64 reference with an initial state, forward and backward.
    monkeypatch.setattr(la, "CHUNK_Z_STEP", z_step)
    assert la.loads_chunk_z(torch.float32, 80)
    q, k, v, state = make_inputs(1, FIVE_CHUNKS, 1, 80, 24, torch.float32, normalize=True, init=True)
    assert_linear_accuracy(q, k, v, state, normalize=True)


class _Launches:
    """Stands in for a Triton kernel: records each launch's grid and keyword arguments, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize(
    "part_chunks, z_step, below_heads, batch, num_heads, n_parts, block_c",
    [(1, 4, 16, 1, 1, 5, 16), (2, 1, 16, 1, 2, 3, 16), (3, 2, 16, 2, 1, 2, 16), (3, 4, 16, 1, 1, 2, 2),
     (2, 4, 2, 1, 2, 1, 16), (2, 2, 2, 2, 1, 1, 16)],
    ids=["parts1", "parts2-H2", "parts3-B2", "parts3-blocks2", "walk-H2", "walk-B2"],
)  # fmt: skip
def test_chunk_z_parts(monkeypatch, part_chunks, z_step, below_heads, batch, num_heads, n_parts, block_c):
    # Below CHUNK_Z_PARTS_BELOW_HEADS batch * heads the z programs walk parts of CHUNK_Z_PART_CHUNKS
    # chunks in parallel and the chunk-z kernel adds the earlier parts' sums and the initial z: 5
    # chunks (FIVE_CHUNKS, a ragged last chunk) in parts of one (a step past every part), two (a ragged last
    # part) and three, over two heads or two batches, and parts of three in chunk-z programs of two
    # chunks (CHUNK_Z_BLOCK_C: a part in two programs, the last part's second one empty). From it on,
    # one walk writes z itself, with no chunk-z kernel, even with parts of two chunks. Against the
    # float64 reference with an initial state, forward, backward and final state, and without
    # autograd (z not stored) bitwise the same forward.
    monkeypatch.setattr(la, "CHUNK_Z_PART_CHUNKS", part_chunks)
    monkeypatch.setattr(la, "CHUNK_Z_STEP", z_step)
    monkeypatch.setattr(la, "CHUNK_Z_PARTS_BELOW_HEADS", below_heads)
    monkeypatch.setattr(la, "CHUNK_Z_BLOCK_C", block_c)
    segment = _Launches(la.linear_attention_segment_kernel)
    chunk_z = _Launches(la.linear_attention_chunk_z_kernel)
    monkeypatch.setattr(la, "linear_attention_segment_kernel", segment)
    monkeypatch.setattr(la, "linear_attention_chunk_z_kernel", chunk_z)
    assert la.loads_chunk_z(torch.float32, 80)
    n_chunks = -(-FIVE_CHUNKS // la.chunk_size(torch.float32))
    assert n_chunks == 5 and la.chunk_z_parts(n_chunks, batch * num_heads)[1] == n_parts
    q, k, v, state = make_inputs(batch, FIVE_CHUNKS, num_heads, 80, 24, torch.float32, normalize=True,
                                 init=True)  # fmt: skip
    assert_linear_accuracy(q, k, v, state, normalize=True)
    kwargs = dict(normalize=True, initial_state=state, output_final_state=True, backend="triton")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o_train, (s_train, z_train) = kernels.linear_attention(*leaves, **kwargs)
    with torch.no_grad():
        o_eval, (s_eval, z_eval) = kernels.linear_attention(*leaves, **kwargs)
    assert torch.equal(o_train.detach(), o_eval) and torch.equal(z_train.detach(), z_eval)
    # Every forward took the path chosen: the segment kernel's z programs in parts (plus the chunk-z
    # kernel over (parts * blocks a part, H, B)) or in one walk (no chunk-z kernel).
    assert len(segment.calls) == 3
    assert all(kw["IN_PARTS"] == (n_parts > 1) and kw["CHUNK_Z"] for _, kw in segment.calls)
    programs = n_parts * -(-part_chunks // block_c)
    assert [grid for grid, _ in chunk_z.calls] == ([(programs, num_heads, batch)] * 3 if n_parts > 1 else [])


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("k_dim", [16, 80], ids=["K16", "K80"])
def test_forward_without_grad_matches_training_forward(normalize, k_dim):
    # Without autograd the fused forward skips the per-chunk states; the output and final state
    # must be bitwise those of the forward that stores them (5 chunks: 3 segments under the
    # interpreter, 5 on a GPU).
    q, k, v, state = make_inputs(1, FIVE_CHUNKS, 1, k_dim, 24, torch.float32, normalize=normalize, init=True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    kwargs = dict(normalize=normalize, initial_state=state, output_final_state=True, backend="triton")
    o_train, s_train = kernels.linear_attention(*leaves, **kwargs)
    with torch.no_grad():
        o_eval, s_eval = kernels.linear_attention(*leaves, **kwargs)
    assert o_train.requires_grad and not o_eval.requires_grad
    assert torch.equal(o_train.detach(), o_eval)
    for a, b in zip(s_train if normalize else (s_train,), s_eval if normalize else (s_eval,), strict=True):
        assert torch.equal(a.detach(), b)


# ----------------------------------------------------------------------------------------------
# Dispatch and errors
# ----------------------------------------------------------------------------------------------


def test_registered_for_triton_backend():
    assert kernels._TRITON_OPS["linear_attention"] is la.linear_attention
    assert kernels._TRITON_OPS["linear_attention_step"] is la.linear_attention_step
    q, k, v, _ = make_inputs(1, 5, 2, 16, 16, torch.float32, normalize=True, init=False)
    expected = "triton" if DEVICE == "cuda" else "reference"
    assert torch.equal(kernels.linear_attention(q, k, v), kernels.linear_attention(q, k, v, backend=expected))


def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _call(op, backend, *args, **kwargs):
    try:
        getattr(kernels, op)(*args, backend=backend, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


QKV = (_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 6))


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((_t(4, 2, 8), QKV[1], QKV[2]), {}),
        ((QKV[0], _t(1, 4, 2, 7), QKV[2]), {}),
        ((QKV[0], QKV[1], _t(1, 5, 2, 6)), {}),
        ((QKV[0], QKV[1], _t(1, 4, 2, 6, dtype=F64)), {}),
        ((QKV[0], torch.ones(1, 4, 2, 8, dtype=torch.int64), QKV[2]), {}),
        (([1.0], QKV[1], QKV[2]), {}),
        (QKV, {"scale": "0.1"}),
        (QKV, {"scale": True}),
        (QKV, {"initial_state": _t(1, 2, 8, 6)}),  # normalize=True needs (kv, z)
        (QKV, {"initial_state": (_t(1, 2, 8, 6),)}),
        (QKV, {"initial_state": (_t(1, 2, 8, 6), None)}),  # z None: the reference raised AttributeError
        (QKV, {"initial_state": (_t(1, 2, 8, 6), _t(1, 2, 7))}),
        (QKV, {"initial_state": (_t(1, 2, 6, 8), _t(1, 2, 8))}),
        (QKV, {"normalize": False, "initial_state": (_t(1, 2, 8, 6), _t(1, 2, 8))}),
        (QKV, {"normalize": False, "initial_state": _t(2, 8, 6)}),
        (QKV, {"normalize": False, "initial_state": torch.ones(1, 2, 8, 6, dtype=torch.int32)}),
        (QKV, {"normalize": "false"}),  # a truthy string must not mean True
        (QKV, {"output_final_state": "yes"}),
        (QKV, {"output_final_state": 1}),
        (QKV, {"output_final_state": None}),
        (QKV, {"eps": -1.0}),
        (QKV, {"eps": float("nan")}),
        (QKV, {"eps": "1e-6"}),
    ],
)
def test_errors_identical_to_reference(args, kwargs):
    triton_error = _call("linear_attention", "triton", *args, **kwargs)
    reference_error = _call("linear_attention", "reference", *args, **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_zero_features_need_an_explicit_scale(backend):
    # K = 0 has no default scale K ** -0.5: a clear error, not Python's ZeroDivisionError.
    q = _t(1, 4, 2, 0)
    v = _t(1, 4, 2, 6)
    for op, args in (
        ("linear_attention", (q, q, v)),
        ("linear_attention_step", (q[:, 0], q[:, 0], v[:, 0], _t(1, 2, 0, 6))),
    ):
        error = _call(op, backend, *args)
        assert error is not None and error[0] is ValueError and "pass scale=" in error[1], (op, error)
        assert _call(op, backend, *args, scale=1.0) is None  # an explicit scale works


STEP_ARGS = (_t(2, 3, 8), _t(2, 3, 8), _t(2, 3, 6), _t(2, 3, 8, 6))
_SHARED = _t(400)


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((_t(2, 3, 8, 1), *STEP_ARGS[1:]), {}),
        ((STEP_ARGS[0], _t(2, 3, 7), *STEP_ARGS[2:]), {}),
        ((*STEP_ARGS[:2], _t(2, 4, 6), STEP_ARGS[3]), {}),
        ((*STEP_ARGS[:3], _t(2, 3, 6, 8)), {}),
        ((*STEP_ARGS[:3], _t(2, 3, 8)), {}),
        ((*STEP_ARGS[:3], (_t(2, 3, 8, 6), _t(2, 3, 8))), {}),
        ((*STEP_ARGS[:2], _t(2, 3, 6, dtype=torch.float16), STEP_ARGS[3]), {}),
        ((*STEP_ARGS[:3], torch.zeros(2, 3, 8, 6, dtype=torch.int32)), {}),
        (STEP_ARGS, {"z_state": _t(2, 3, 6)}),
        (STEP_ARGS, {"z_state": torch.zeros(2, 3, 8, dtype=torch.int64)}),
        (STEP_ARGS, {"scale": [0.5]}),
        (STEP_ARGS, {"eps": -1e-3}),
        # States written in place: an expanded view (its heads would share one state), a z_state
        # overlapping state, a state that requires grad.
        ((*STEP_ARGS[:3], _t(1, 1, 8, 6).expand(2, 3, 8, 6)), {}),
        ((*STEP_ARGS[:3], _SHARED[:288].view(2, 3, 8, 6)), {"z_state": _SHARED[280:328].view(2, 3, 8)}),
        ((*STEP_ARGS[:3], _t(2, 3, 8, 6).requires_grad_()), {}),
        # 16-bit states: the running sums would lose each new token's update to rounding.
        ((*STEP_ARGS[:3], _t(2, 3, 8, 6, dtype=torch.float16)), {}),
        (STEP_ARGS, {"z_state": _t(2, 3, 8, dtype=torch.float16)}),
    ],
)
def test_step_errors_identical_to_reference(args, kwargs):
    triton_error = _call("linear_attention_step", "triton", *args, **kwargs)
    reference_error = _call("linear_attention_step", "reference", *args, **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mixed_devices_name_each_tensor(backend):
    # The shared validation: the reference would otherwise fail inside torch's ops.
    meta = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="one device.*k on meta, v on meta"):
        kernels.linear_attention(QKV[0], meta, QKV[2].new_empty(1, 4, 2, 6).to("meta"), backend=backend)
    with pytest.raises(ValueError, match="one device.*initial_state kv on meta"):
        kernels.linear_attention(
            *QKV, normalize=False, initial_state=torch.empty(1, 2, 8, 6, device="meta"), backend=backend
        )
    kv0, z0 = torch.zeros(1, 2, 8, 6, device=DEVICE), torch.zeros(1, 2, 8, device="meta")
    with pytest.raises(ValueError, match="one device.*initial_state z on meta"):
        kernels.linear_attention(*QKV, initial_state=(kv0, z0), backend=backend)
    with pytest.raises(ValueError, match="one device.*state on meta"):
        kernels.linear_attention_step(*STEP_ARGS[:3], STEP_ARGS[3].to("meta"), backend=backend)


def test_triton_step_refuses_inputs_that_require_grad():
    # No backward: the output would not require grad and the gradient would stop there silently.
    q = STEP_ARGS[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable .*, but q requires grad.*torch.no_grad"):
        kernels.linear_attention_step(q, *STEP_ARGS[1:3], STEP_ARGS[3].clone(), backend="triton")
    with torch.no_grad():  # as decoding runs it
        got = kernels.linear_attention_step(q, *STEP_ARGS[1:3], STEP_ARGS[3].clone(), backend="triton")
        want = reference.linear_attention_step(q, *STEP_ARGS[1:3], STEP_ARGS[3].clone())
    torch.testing.assert_close(got, want)


def test_backend_specific_errors():
    # Triton receives scale and eps as fp32 scalars: beyond its range they would be inf.
    q64, k64, v64 = (t.double() for t in QKV)
    with pytest.raises(ValueError, match="scale 1e\\+300 overflows float32.*backend='reference'"):
        kernels.linear_attention(q64, k64, v64, scale=1e300, backend="triton")
    with pytest.raises(ValueError, match="eps 1e\\+39 overflows float32"):
        kernels.linear_attention(q64, k64, v64, eps=1e39, backend="triton")
    with pytest.raises(ValueError, match="scale 1e\\+300 overflows float32"):
        kernels.linear_attention_step(*STEP_ARGS, scale=1e300, backend="triton")


def test_sequences_past_int32_offsets_are_refused(monkeypatch):
    # The kernels index the sequence in int32: (T - 1) * stride from 2**31 on would wrap (a fused
    # qkv view, stride 6144, from ~350k tokens). A lower limit stands in for 2**31, so nothing that
    # large is allocated; the output gradient is checked when the backward gets it.
    import kernels._host as host

    q = torch.rand(1, 20, 2, 16, device=DEVICE, requires_grad=True)
    k, v = torch.rand(1, 20, 2, 16, device=DEVICE), torch.randn(1, 20, 2, 8, device=DEVICE)
    monkeypatch.setattr(host, "INT32_OFFSETS", 2**8)
    message = (r"^the Triton linear_attention indexes q with int32 offsets, but its dim 1 spans \(20 - 1\) x "
               r"stride 32 = 608 elements, past 2\*\*31 - 1; split the sequence into calls that carry "
               r"the state")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        kernels.linear_attention(q, k, v, backend="triton")
    monkeypatch.setattr(host, "INT32_OFFSETS", 2**10)  # q, k, v (stride 32) and o (16) pass
    o = kernels.linear_attention(q, k, v, backend="triton")
    do = torch.randn(1, 20, 2, 64, device=DEVICE)[..., :8]  # stride 128: 19 x 128 = 2432
    message = r"indexes do with int32 offsets, but its dim 1 spans \(20 - 1\) x stride 128 "
    with pytest.raises(ValueError, match=message):
        torch.autograd.grad(o, q, do)


# ----------------------------------------------------------------------------------------------
# Replayed launches (an eager decode loop repeats one call signature)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def recorded_plans(monkeypatch):
    """Plans for DEVICE's calls (CPU ones too), each replayed through a RecordingCompiled; yields the
    builds as (recording, args, kwargs) of the ordinary launch each was built from."""
    builds = record_step_plans(monkeypatch, la)
    yield builds
    la._STEP_PLANS.clear()


def _step_key(**overrides):
    """la._step_key of a (2, 3, 8) / (2, 3, 6) step's arguments with ``overrides``."""
    args = dict(q=_t(2, 3, 8), k=_t(2, 3, 8), v=_t(2, 3, 6), state=_t(2, 3, 8, 6), z_state=_t(2, 3, 8))
    args = args | dict(scale=None, eps=1e-10) | overrides
    return la._step_key(*args.values())


class _Subclass(torch.Tensor):
    pass


def test_step_plan_key_captures_the_specialization(monkeypatch):
    """The plan key of linear_attention_step: equal for new tensors of the same signature, different
    when anything Triton specializes on or the checks read differs, None where no plan applies."""
    if DEVICE == "cpu":
        assert _step_key() is None  # plans are for CUDA calls only
    monkeypatch.setattr(la._STEP_PLANS, "device_types", ("cuda", "cpu"))
    base = _step_key()
    assert base is not None and _step_key() == base  # new tensors at new addresses: one signature
    variants = [
        _step_key(state=_t(2, 3, 6, 8).transpose(2, 3)),  # strides
        _step_key(z_state=_t(2, 3, 16)[..., ::2]),
        _step_key(q=_t(2 * 3 * 8 + 1)[1:].view(2, 3, 8)),  # 4-byte alignment
        _step_key(v=_t(2, 3, 6, dtype=F64)),  # dtype
        _step_key(state=_t(2, 3, 8, 6, dtype=F64)),
        _step_key(q=_t(2, 4, 8), k=_t(2, 4, 8), v=_t(2, 4, 6), state=_t(2, 4, 8, 6), z_state=_t(2, 4, 8)),  # shape
        _step_key(v=_t(2, 3, 5), state=_t(2, 3, 8, 5)),
        _step_key(z_state=None),  # no normaliser
        _step_key(scale=0.5),  # scalar arguments: value, type, the sign of a zero
        _step_key(scale=1),
        _step_key(scale=1.0),
        _step_key(scale=True),  # refused by the checks, so never stored, but not scale=1's key
        _step_key(scale=0.0),
        _step_key(scale=-0.0),
        _step_key(eps=1e-6),
        _step_key(eps=0),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    # No plan: grad mode with a tensor that requires grad (the step refuses it), a tensor subclass or
    # another layout, a scalar that is not a plain number.
    assert _step_key(q=_t(2, 3, 8).requires_grad_()) is None
    assert _step_key(state=_t(2, 3, 8, 6).requires_grad_()) is None
    with torch.no_grad():
        assert _step_key(q=_t(2, 3, 8).requires_grad_()) == base
    assert _step_key(v=_t(2, 3, 6).as_subclass(_Subclass)) is None
    assert _step_key(state=_t(2, 3, 8, 6).to_sparse()) is None
    assert _step_key(scale=[0.5]) is None and _step_key(q=[1.0]) is None


def _step_problem(num_heads=3, k_dim=8, v_dim=6):
    """q, k, v and a state and z_state side by side (apart) in one buffer, on DEVICE."""
    q, k = (F.elu(torch.randn(2, num_heads, k_dim, device=DEVICE)) + 1 for _ in range(2))
    v = torch.randn(2, num_heads, v_dim, device=DEVICE)
    size = 2 * num_heads * k_dim * v_dim
    buffer = torch.randn(size + 2 * num_heads * k_dim, device=DEVICE)
    buffer[size:].uniform_(1.0, 10.0)
    return [q, k, v, buffer[:size].view(2, num_heads, k_dim, v_dim), buffer[size:].view(2, num_heads, k_dim)]


def test_step_replays_a_seen_signature(recorded_plans, monkeypatch):
    """A signature's second call replays the first call's launch: the checks skipped, the new
    tensors handed to the launcher in the kernel's parameter order with the first call's scalars and
    constexprs, the same output and in-place state updates (bits) as the ordinary path; states that
    share memory with another tensor, inputs that require grad and launch hooks take the ordinary
    path, with its errors."""
    from triton import knobs

    checks = []
    check = la._check_linear_attention_step_args
    monkeypatch.setattr(la, "_check_linear_attention_step_args", lambda *a: checks.append(1) or check(*a))

    def step(q, k, v, state, z_state, **kw):
        return kernels.linear_attention_step(q, k, v, state, z_state=z_state, scale=0.3, backend="triton", **kw)

    step(*_step_problem())
    ((recording, args, kwargs),) = recorded_plans
    assert len(la._STEP_PLANS) == 1 and len(checks) == 1 and not recording.calls
    second = _step_problem()
    copies = [t.clone() for t in second]
    versions = [t._version for t in second[3:]]
    got = step(*second)
    assert len(checks) == 1, "the second call of a signature must replay the first call's plan"
    assert all(t._version > n for t, n in zip(second[3:], versions, strict=True)), "the replay's writes count too"
    (call,) = recording.calls
    q, k, v, state, z = second
    assert all(a is b for a, b in zip(call[9:15], (q, k, v, state, z, got), strict=True))
    names = la.linear_attention_step_kernel.arg_names
    assert call[15:] == args[6:] + tuple(kwargs[name] for name in names[len(args) :])
    with monkeypatch.context() as m:  # the ordinary path, on copies
        m.setattr(la, "_step_key", lambda *a: None)
        assert torch.equal(got, step(*copies)) and len(checks) == 2
    assert torch.equal(state, copies[3]) and torch.equal(z, copies[4])  # updated in place alike

    # Without a normaliser the kernel gets the state in Z's place (its pointer is never read).
    q, k, v, state, _ = _step_problem()
    step(q, k, v, state, None)
    step(q, k, v, state, None)
    assert len(recorded_plans) == 2 and recorded_plans[1][0].calls[0][13] is state

    # The same signature with states that share memory: the ordinary path's checks and errors.
    q, k, v, state, z = _step_problem()
    z_over_state = state.view(-1)[8:56].view(z.shape)  # 16-byte aligned, like z
    q_in_state = state.view(-1)[:48].view(q.shape)
    for args_ in ((q, k, v, state, z_over_state), (q_in_state, k, v, state, z)):
        assert la._step_key(*args_, 0.3, 1e-10) in la._STEP_PLANS  # a plan is found, but not replayed
        calls = len(checks)
        error = _call("linear_attention_step", "triton", *args_[:4], z_state=args_[4], scale=0.3)
        assert error == _call("linear_attention_step", "reference", *args_[:4], z_state=args_[4], scale=0.3)
        assert error[0] is ValueError and "share" in error[1] and len(checks) == calls + 1
    # Inputs that require grad in grad mode: the ordinary path's error.
    with pytest.raises(RuntimeError, match="not differentiable"):
        step(q.clone().requires_grad_(), k, v, state, z)
    with pytest.raises(ValueError, match="requires grad"):
        step(q, k, v, state.clone().requires_grad_(), z)

    # While a launch hook is installed the ordinary launch runs (and calls it).
    seen, calls, replays = [], len(checks), len(recording.calls)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    step(*_step_problem())
    assert len(checks) == calls + 1 and len(recording.calls) == replays
    assert bool(seen) == (DEVICE == "cuda")  # the interpreter calls no launch hook


# ----------------------------------------------------------------------------------------------
# GPU: the full product, bf16, realistic shapes, every autotune config, the mixers (pytest -m gpu)
# ----------------------------------------------------------------------------------------------

GPU_LENGTHS = [1, 17, 64, 65, 300]
GPU_DIMS = [16, 64, 80, 128, 273]
AUTOTUNED = (
    "linear_attention_state_kernel",
    "linear_attention_fwd_kernel",
    "linear_attention_bwd_dq_kernel",
    "linear_attention_bwd_dk_kernel",
    "linear_attention_bwd_dv_kernel",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("k_dim", GPU_DIMS)
def test_gpu_sweep(dtype, normalize, k_dim):
    # Every V and length for this (dtype, normalize, K), with and without an initial state.
    for v_dim, seqlen, init in itertools.product(GPU_DIMS, GPU_LENGTHS, [False, True]):
        q, k, v, state = make_inputs(2, seqlen, 3, k_dim, v_dim, dtype, normalize=normalize, init=init)
        try:
            assert_linear_accuracy(q, k, v, state, normalize=normalize)
        except AssertionError as exc:
            raise AssertionError(f"V={v_dim} T={seqlen} init={init}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_non_contiguous(layout, dtype):
    for normalize in (True, False):
        q, k, v, state = make_inputs(2, 333, 4, 80, 96, dtype, normalize=normalize, init=True, layout=layout)
        assert_linear_accuracy(q, k, v, state, normalize=normalize)


REALISTIC = [
    # (batch, T, H, K, V): the benchmark's head shapes, Based's 273 features, the widest dims
    (2, 2048, 4, 128, 128),
    (4, 1024, 8, 64, 64),
    (1, 2048, 4, 273, 64),
    (1, 1031, 2, 512, 512),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("batch,seqlen,num_heads,k_dim,v_dim", REALISTIC)
def test_gpu_realistic_shapes(dtype, normalize, batch, seqlen, num_heads, k_dim, v_dim):
    q, k, v, state = make_inputs(
        batch, seqlen, num_heads, k_dim, v_dim, dtype, normalize=normalize, init=True
    )
    assert_linear_accuracy(q, k, v, state, normalize=normalize)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "part_chunks, below_heads", [(5, 16), (8, 16), (20, 16), (1 << 20, 16), (5, 8)],
    ids=["parts5", "parts8", "parts20", "one-part", "one-walk"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_chunk_z_parts(monkeypatch, dtype, part_chunks, below_heads):
    # The z programs' parts at a realistic shape (T 2100: 33 chunks of 64 in bf16, 66 of 32 in fp32), a
    # ragged last part, parts of 20 chunks in two chunk-z programs each (CHUNK_Z_BLOCK_C 16), one part
    # and one walk for B*H 8 at CHUNK_Z_PARTS_BELOW_HEADS 8, with an initial state, forward, backward
    # and final state.
    monkeypatch.setattr(la, "CHUNK_Z_PART_CHUNKS", part_chunks)
    monkeypatch.setattr(la, "CHUNK_Z_PARTS_BELOW_HEADS", below_heads)
    assert la.loads_chunk_z(dtype, 128)
    q, k, v, state = make_inputs(2, 2100, 4, 128, 128, dtype, normalize=True, init=True)
    assert_linear_accuracy(q, k, v, state, normalize=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
def test_gpu_every_autotune_config(dtype, normalize):
    # A config the autotuner may pick on another shape or run must be correct too: Triton 3.4-3.7.0
    # on Hopper is known to miscompile some chunked linear-attention backward kernels for some
    # tile / warp choices only. Each config of every kernel in turn, at chunks of 64, vs float64.
    n_configs = max(len(getattr(la, name).configs) for name in AUTOTUNED)
    for index in range(n_configs):
        with forced_config([getattr(la, name) for name in AUTOTUNED], index):
            for batch, seqlen, num_heads, k_dim, v_dim in [(2, 1024, 4, 128, 128), (2, 777, 4, 64, 64),
                                                         (1, 500, 2, 273, 64)]:  # fmt: skip
                q, k, v, state = make_inputs(
                    batch, seqlen, num_heads, k_dim, v_dim, dtype, normalize=normalize, init=True
                )
                try:
                    assert_linear_accuracy(q, k, v, state, normalize=normalize)
                except AssertionError as exc:
                    raise AssertionError(f"config #{index}, K={k_dim} V={v_dim} T={seqlen}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_prefill_and_decode(dtype):
    # Mixer-style use at a realistic size: prefill 1000 tokens, then 40 decode steps (backend=None:
    # the Triton kernels on CUDA). Against float64, as accurate as one call over all 1040 tokens.
    for normalize in (True, False):
        q, k, v, _ = make_inputs(8, 1040, 4, 128, 64, dtype, normalize=normalize, init=False)
        want = reference.linear_attention(q.double(), k.double(), v.double(), normalize=normalize)
        full = kernels.linear_attention(q, k, v, normalize=normalize)
        o1, state = kernels.linear_attention(
            q[:, :1000], k[:, :1000], v[:, :1000], normalize=normalize, output_final_state=True
        )
        kv, z = (t.clone() for t in state) if normalize else (state.clone(), None)
        steps = [
            kernels.linear_attention_step(q[:, t], k[:, t], v[:, t], kv, z_state=z) for t in range(1000, 1040)
        ]
        got = torch.cat([o1, torch.stack(steps, 1)], 1)
        err = (got.double() - want).abs().max().item()
        full_err = (full.double() - want).abs().max().item()
        assert err <= 2 * full_err + rounding_atol(want, dtype), (normalize, err, full_err)


@pytest.mark.gpu
@gpu
def test_gpu_decode_step_large_batch():
    for dtype, normalize in [(torch.bfloat16, True), (torch.float32, False)]:
        batch, num_heads, k_dim, v_dim = 256, 16, 128, 128
        q, k = ((F.elu(torch.randn(batch, num_heads, k_dim, device=DEVICE)) + 1).to(dtype) for _ in range(2))
        v = torch.randn(batch, num_heads, v_dim, device=DEVICE).to(dtype)
        state = torch.randn(batch, num_heads, k_dim, v_dim, device=DEVICE)
        z = torch.rand(batch, num_heads, k_dim, device=DEVICE) * 10 if normalize else None
        state_ref, z_ref = state.clone(), (z.clone() if normalize else None)
        out = kernels.linear_attention_step(q, k, v, state, z_state=z)
        want = reference.linear_attention_step(q, k, v, state_ref, z_state=z_ref)
        torch.testing.assert_close(state, state_ref, rtol=1e-6, atol=1e-6)  # one add of an exact product
        # fp32 sums over K = 128 in another order; a bf16 output may round one bf16 ulp (2^-8) apart.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "settings",
    [
        dict(num_heads=4, feature_map="elu"),
        dict(num_heads=4, feature_map="relu", normalize=False, short_conv=True),
        dict(num_heads=2, feature_map="taylor", feature_dim=16, short_conv=True),
        dict(num_heads=2, feature_map="identity", normalize=False),
    ],
    ids=["elu", "relu-raw-conv", "taylor273", "identity"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_mixer_matches_reference_backend(monkeypatch, settings, dtype):
    # The mixer calls kernels.linear_attention(...) with backend=None: the Triton kernel on CUDA.
    # Same mixer and input, once more with the reference forced: outputs and parameter gradients agree.
    from mixers import build_mixer

    mixer = build_mixer("linear_attention", 256, **settings).to(DEVICE, dtype)
    x = torch.randn(2, 300, 256, device=DEVICE, dtype=dtype)
    results = []
    for backend in ("triton", "reference"):
        if backend == "reference":
            forced = functools.partial(kernels.linear_attention, backend="reference")
            monkeypatch.setattr(kernels, "linear_attention", forced)
        mixer.zero_grad()
        y = mixer(x)
        y.float().square().mean().backward()
        results.append((y.float(), [p.grad.float().clone() for p in mixer.parameters()]))
    (y_tr, g_tr), (y_ref, g_ref) = results
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y_tr, y_ref, **tol)
    for a, b in zip(g_tr, g_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "normalize,dtype,layout",
    [(True, torch.bfloat16, "contiguous"), (False, torch.float32, "strided"), (True, torch.float16, "strided")],
)
def test_gpu_step_replayed_launches(normalize, dtype, layout, monkeypatch):
    """A signature's second call replays its plan on new tensors: the same output and in-place state
    updates (bits) as the checked (ordinary) call on copies, a new plan for another alignment,
    gradients refused, a launch hook honoured, and the replay captured in a CUDA graph reads the
    graph's inputs."""
    from triton import knobs

    from kernels._host import launch_hooks_installed

    batch, num_heads, k_dim, v_dim = 4, 8, 64, 80

    def fresh():  # same shapes and strides each time; new values
        q, k = ((F.elu(torch.randn(batch, num_heads, k_dim, device=DEVICE)) + 1).to(dtype) for _ in range(2))
        v = torch.randn(batch, num_heads, v_dim, device=DEVICE).to(dtype)
        if layout == "strided":  # q from (B, K, H) storage, a (B, H, K, V) state with V outermost, z every other
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
            state = torch.randn(batch, num_heads, v_dim, k_dim, device=DEVICE).transpose(2, 3)
            z = (torch.rand(batch, num_heads, 2 * k_dim, device=DEVICE) * 10)[..., ::2]
        else:
            state = torch.randn(batch, num_heads, k_dim, v_dim, device=DEVICE)
            z = torch.rand(batch, num_heads, k_dim, device=DEVICE) * 10
        return [q, k, v, state, z if normalize else None]

    def step(q, k, v, state, z_state):
        return kernels.linear_attention_step(q, k, v, state, z_state=z_state, scale=0.125, backend="triton")

    def ordinary(inputs):  # the checked path on copies: (output, state, z_state)
        inputs = [same_layout(t) for t in inputs]
        with monkeypatch.context() as m:
            m.setattr(la, "_step_key", lambda *a: None)
            return step(*inputs), inputs[3], inputs[4]

    def assert_equal(got, want):
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)

    # The ordinary path checks its arguments; a replay does not: count the checks.
    checks = []
    check = la._check_linear_attention_step_args
    monkeypatch.setattr(la, "_check_linear_attention_step_args", lambda *a: checks.append(1) or check(*a))
    la._STEP_PLANS.clear()
    step(*fresh())
    assert len(la._STEP_PLANS) == 1 and len(checks) == 1
    second = fresh()
    want = ordinary(second)
    calls = len(checks)
    got = step(*second)
    assert len(checks) == calls, "the second call of a signature must replay the first call's plan"
    assert_equal((got, second[3], second[4]), want)

    # q at an address that is not 16-byte aligned: Triton specializes on alignment, so another plan.
    q = second[0]
    shifted = torch.empty(q.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(q.shape).copy_(q)
    if layout == "contiguous":
        assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
        inputs = [shifted, *fresh()[1:]]
        want = ordinary(inputs)
        assert_equal((step(*inputs), inputs[3], inputs[4]), want)
        assert len(la._STEP_PLANS) == 2

    with pytest.raises(RuntimeError, match="not differentiable"):
        step(q.clone().requires_grad_(), *second[1:])

    seen = []
    assert not launch_hooks_installed()
    inputs = fresh()
    want = ordinary(inputs)
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", seen.append)
        assert launch_hooks_installed()
        calls = len(checks)
        assert_equal((step(*inputs), inputs[3], inputs[4]), want)
    assert seen and len(checks) == calls + 1, "with a launch hook the ordinary launch (which calls it) must run"

    # As LanguageModel.generate does: one eager step stores the plan, the capture replays it.
    static = [same_layout(t) for t in fresh()]
    step(*static)
    assert la._step_key(*static, 0.125, 1e-10) in la._STEP_PLANS
    calls = len(checks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = step(*static)
    assert len(checks) == calls, "the capture must replay the plan"
    new = fresh()
    want = ordinary(new)
    for t, values in zip(static, new, strict=True):
        if t is not None:
            t.copy_(values)
    graph.replay()
    assert_equal((graphed, static[3], static[4]), want)

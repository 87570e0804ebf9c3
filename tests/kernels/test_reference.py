"""The pure-PyTorch references against explicit Python loops in float64.

Each loop version below spells the op out per batch element, head and position, so a reader can
check it against the paper's equation; the references (vectorised, chunked, custom backward) must
agree with it to float64 rounding. Decode / step ops are checked against the full-sequence ops.
"""

import math

import pytest
import torch

import kernels
from kernels import reference

F64 = torch.float64


def rand(*shape, dtype=F64, requires_grad=False, positive=False):
    x = torch.rand(*shape, dtype=dtype) if positive else torch.randn(*shape, dtype=dtype)
    return x.requires_grad_(requires_grad)


# ----------------------------------------------------------------------------------------------
# flash_attention
# ----------------------------------------------------------------------------------------------


def attention_loop(q, k, v, *, causal, window=None, scale=None):
    """softmax(scale q k^T + mask) v one query row at a time; returns o (B, Tq, Hq, D), lse (B, Hq, Tq)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    rows, lses = [], []
    for b in range(batch):
        for i in range(seqlen_q):
            for h in range(num_heads):
                kv_head = h // group
                last = i + seqlen_k - seqlen_q
                keys = [
                    j
                    for j in range(seqlen_k)
                    if not causal or (j <= last and (window is None or j > last - window))
                ]
                if not keys:
                    rows.append(torch.zeros(head_dim, dtype=q.dtype))
                    lses.append(torch.tensor(-math.inf, dtype=q.dtype))
                    continue
                scores = torch.stack([scale * torch.dot(q[b, i, h], k[b, j, kv_head]) for j in keys])
                lse = torch.logsumexp(scores, dim=0)
                probs = torch.exp(scores - lse)
                rows.append(sum(p * v[b, j, kv_head] for p, j in zip(probs, keys, strict=True)))
                lses.append(lse)
    o = torch.stack(rows).reshape(batch, seqlen_q, num_heads, head_dim)
    lse = torch.stack(lses).reshape(batch, seqlen_q, num_heads).transpose(1, 2)
    return o, lse


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(5, 9), (9, 5), (7, 7)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 1), (True, 3), (True, 20)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2)])
def test_flash_attention_matches_loop(seqlen_q, seqlen_k, causal, window, num_heads, num_kv_heads):
    q = rand(2, seqlen_q, num_heads, 16)
    k, v = rand(2, seqlen_k, num_kv_heads, 16), rand(2, seqlen_k, num_kv_heads, 16)
    o, lse = reference.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    o_loop, lse_loop = attention_loop(q, k, v, causal=causal, window=window)
    assert o.shape == (2, seqlen_q, num_heads, 16) and o.dtype == F64
    assert lse.shape == (2, num_heads, seqlen_q) and lse.dtype == F64
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_loop, rtol=1e-12, atol=1e-12)
    # Without the lse, rows that all see a key take the fused-attention path: same result.
    o_only = reference.flash_attention(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(o_only, o_loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim", [16, 80])
def test_flash_attention_scale_and_head_dim(head_dim):
    q, k, v = rand(1, 6, 3, head_dim), rand(1, 6, 1, head_dim), rand(1, 6, 1, head_dim)
    o, lse = reference.flash_attention(q, k, v, scale=0.3, return_lse=True)
    o_loop, lse_loop = attention_loop(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [0.0, -0.5])
@pytest.mark.parametrize("causal,window", [(True, None), (True, 2), (False, None)])
def test_flash_attention_scale_zero_or_negative(scale, causal, window):
    """A new-user check: scale=0.0 (a uniform average over the visible keys) or a negative scale gave
    NaN in every row but the last of plain causal attention (PyTorch's fused is_causal path)."""
    q, k, v = rand(1, 7, 4, 16), rand(1, 7, 2, 16), rand(1, 7, 2, 16)
    o = reference.flash_attention(q, k, v, causal=causal, window=window, scale=scale)
    o_loop, _ = attention_loop(q, k, v, causal=causal, window=window, scale=scale)
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)


def test_flash_attention_scales_float32_cannot_hold():
    """A new-user check: scale=1e-46 is positive but 0 in float32, the compute dtype of float32 and
    16-bit inputs, and took the fused is_causal path, which returned NaN in every row but the last;
    now the uniform average over the visible keys. A scale beyond float32 (1e39) made every score
    inf and every output NaN: it is refused for such inputs, and float64 inputs give the answer."""
    q, k, v = rand(1, 6, 2, 16), rand(1, 6, 2, 16), rand(1, 6, 2, 16)
    for dtype in (torch.float32, torch.float16):
        o = reference.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=1e-46)
        # the float64 answer of the inputs as given (rounded to dtype), rounded to dtype
        rounded = [t.to(dtype).double() for t in (q, k, v)]
        want = attention_loop(*rounded, causal=True, scale=0.0)[0].to(dtype)
        torch.testing.assert_close(o, want)
        with pytest.raises(
            ValueError, match=rf"scale 1e\+39 overflows float32, in which {dtype} inputs .*float64"
        ):
            reference.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=1e39)
        with pytest.raises(ValueError, match=r"scale 1e\+39 overflows float32"):
            reference.linear_attention(q.to(dtype).abs(), k.to(dtype).abs(), v.to(dtype), scale=1e39)
    o = reference.flash_attention(q, k, v, scale=1e39)
    torch.testing.assert_close(o, attention_loop(q, k, v, causal=True, scale=1e39)[0], rtol=1e-12, atol=1e-12)
    assert torch.isfinite(o).all()


def test_flash_attention_non_contiguous_inputs():
    base = rand(2, 3, 7, 16)  # (B, H, T, D) transposed into (B, T, H, D) views
    q, k, v = (base.transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    torch.testing.assert_close(
        reference.flash_attention(q, k, v), attention_loop(q, k, v, causal=True)[0], rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(9, 5), (5, 9)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 2)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_flash_attention_backward_matches_loop(seqlen_q, seqlen_k, causal, window, return_lse):
    # Tq > Tk with a causal mask leaves rows with no visible key; their lse is -inf and is left
    # out of the loss, their outputs (0) stay in it.
    inputs = [rand(2, seqlen_q, 6, 16, requires_grad=True), rand(2, seqlen_k, 2, 16, requires_grad=True)]
    inputs.append(rand(2, seqlen_k, 2, 16, requires_grad=True))
    weight_o, weight_lse = rand(2, seqlen_q, 6, 16), rand(2, 6, seqlen_q)

    def loss(o, lse=None):
        loss = (o * weight_o).sum()
        if lse is not None:
            loss = loss + torch.where(torch.isfinite(lse), lse * weight_lse, 0).sum()
        return loss

    out = reference.flash_attention(*inputs, causal=causal, window=window, return_lse=return_lse)
    grads = torch.autograd.grad(loss(*out) if return_lse else loss(out), inputs)
    o_loop, lse_loop = attention_loop(*inputs, causal=causal, window=window)
    grads_loop = torch.autograd.grad(loss(o_loop, lse_loop if return_lse else None), inputs)
    for grad, grad_loop in zip(grads, grads_loop, strict=True):
        torch.testing.assert_close(grad, grad_loop, rtol=1e-10, atol=1e-12)


def test_flash_attention_rows_without_keys():
    # Bottom-right causal with Tq=9, Tk=5: queries 0..3 see no key.
    q = rand(1, 9, 2, 16, requires_grad=True)
    k, v = rand(1, 5, 2, 16, requires_grad=True), rand(1, 5, 2, 16, requires_grad=True)
    o, lse = reference.flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(o[:, :4], torch.zeros_like(o[:, :4]))
    assert torch.equal(lse[:, :, :4], torch.full_like(lse[:, :, :4], -math.inf))
    assert torch.isfinite(o[:, 4:]).all() and torch.isfinite(lse[:, :, 4:]).all()
    o.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :4], torch.zeros_like(q.grad[:, :4]))


def test_flash_attention_window_leaves_rows_without_keys_when_tq_exceeds_tk():
    q, k, v = rand(1, 6, 1, 16), rand(1, 2, 1, 16), rand(1, 2, 1, 16)
    o, lse = reference.flash_attention(q, k, v, window=1, return_lse=True)
    o_loop, lse_loop = attention_loop(q, k, v, causal=True, window=1)
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_loop, rtol=1e-12, atol=1e-12)
    assert torch.isinf(lse[0, 0, :4]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_flash_attention_dtypes(dtype):
    q, k, v = rand(2, 6, 4, 16), rand(2, 6, 2, 16), rand(2, 6, 2, 16)
    o, lse = reference.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True)
    assert o.dtype == dtype
    assert lse.dtype == torch.float32
    # The reference upcasts to float32, so it equals the float64 loop on the rounded inputs up to
    # float32 accumulation and the final rounding of o to dtype.
    o_loop, lse_loop = attention_loop(*(t.to(dtype).to(F64) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(o.to(F64), o_loop.to(dtype).to(F64), rtol=0, atol=2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(lse.to(F64), lse_loop, rtol=1e-6, atol=1e-6)


def spy_on_sdpa(monkeypatch):
    """Record every fused-attention call the reference makes: (k's shape, keyword arguments)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((tuple(k.shape), kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("num_kv_heads", [3, 1])
def test_flash_attention_causal_square_builds_no_mask(requires_grad, num_kv_heads, monkeypatch):
    # Causal with Tq == Tk and no window passes is_causal to the fused call (enable_gqa under GQA),
    # with no (T, T) mask (its memory grows with T^2); output and gradients equal the explicit mask's.
    calls = spy_on_sdpa(monkeypatch)
    inputs = [rand(2, 33, 3, 16, requires_grad=requires_grad)]
    inputs += [rand(2, 33, num_kv_heads, 16, requires_grad=requires_grad) for _ in range(2)]
    o = reference.flash_attention(*inputs, causal=True)
    assert len(calls) == 1
    assert calls[0][1]["attn_mask"] is None and calls[0][1]["is_causal"] is True
    assert calls[0][1]["enable_gqa"] is (num_kv_heads == 1)
    q, k, v = (t.transpose(1, 2) for t in inputs)  # (B, H, T, D)
    mask = torch.ones(33, 33, dtype=torch.bool).tril()
    o_masked = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=num_kv_heads == 1
    ).transpose(1, 2)
    assert torch.equal(o, o_masked)
    torch.testing.assert_close(o, attention_loop(*inputs, causal=True)[0], rtol=1e-12, atol=1e-12)
    if requires_grad:
        weight = rand(*o.shape)
        grads = torch.autograd.grad((o * weight).sum(), inputs)
        grads_masked = torch.autograd.grad((o_masked * weight).sum(), inputs)
        for grad, grad_masked in zip(grads, grads_masked, strict=True):
            torch.testing.assert_close(grad, grad_masked, rtol=1e-12, atol=1e-12)
    # Windows and Tq != Tk build one (Tq, Tk) mask, broadcast over the heads.
    calls.clear()
    reference.flash_attention(*inputs, causal=True, window=4)
    reference.flash_attention(inputs[0][:, :20], inputs[1], inputs[2], causal=True)
    assert [tuple(c[1]["attn_mask"].shape) for c in calls] == [(33, 33), (20, 33)]
    assert not any(c[1]["is_causal"] for c in calls)


def attention_repeated_kv(q, k, v, *, causal, window=None):
    """Plain float64 softmax(q k^T / sqrt(D) + mask) v with K and V repeated per query head;
    returns o (B, Tq, Hq, D), lse (B, Hq, Tq). Rows that see no key give 0 and lse -inf."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.to(F64).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, Hq, Tk, D)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, Hq, Tq, Tk)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if causal:
        last = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q  # the last key query i sees
        j = torch.arange(seqlen_k)[None, :]
        visible = j <= last
        if window is not None:
            visible = visible & (j > last - window)
        scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Tq), -inf for rows with no key
    has_key = torch.isfinite(lse)[..., None]
    probs = torch.where(has_key, torch.exp(scores - torch.where(has_key, lse[..., None], 0.0)), 0.0)
    return (probs @ v).transpose(1, 2), lse


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_flash_attention_gqa_equals_repeated_kv(
    group, seqlen_q, seqlen_k, causal, window, return_lse, monkeypatch
):
    # GQA through enable_gqa (no lse) or per-KV-head query rows (lse) equals repeating K and V;
    # (9, 5) causal leaves rows 0..3 with no key. K and V reach the fused call unrepeated, with at
    # most one (Tq, Tk) mask.
    calls = spy_on_sdpa(monkeypatch)
    q, k, v = rand(2, seqlen_q, 2 * group, 16), rand(2, seqlen_k, 2, 16), rand(2, seqlen_k, 2, 16)
    out = reference.flash_attention(q, k, v, causal=causal, window=window, return_lse=return_lse)
    o_ref, lse_ref = attention_repeated_kv(q, k, v, causal=causal, window=window)
    o = out[0] if return_lse else out
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    if return_lse:
        torch.testing.assert_close(out[1], lse_ref, rtol=1e-12, atol=1e-12)
    empty = torch.isinf(lse_ref).transpose(1, 2)  # (B, Tq, Hq): rows that see no key
    assert bool(empty.any()) is (causal and seqlen_q > seqlen_k)
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
    assert len(calls) == (not return_lse and not (causal and seqlen_q > seqlen_k))  # the fused path
    for k_shape, kwargs in calls:
        assert k_shape == (2, 2, seqlen_k, 16)
        assert kwargs["attn_mask"] is None or kwargs["attn_mask"].shape == (seqlen_q, seqlen_k)


# ----------------------------------------------------------------------------------------------
# flash_decode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 5, 30])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)])
def test_flash_decode_matches_attention_on_gathered_sequence(window, num_heads, num_kv_heads):
    block_size, max_blocks, head_dim = 4, 6, 16
    seqlens = torch.tensor([0, 1, 7, 24, 13], dtype=torch.int32)
    batch = len(seqlens)
    pages_needed = [math.ceil(int(n) / block_size) for n in seqlens]
    num_blocks = sum(pages_needed) + 3  # a few pages nobody uses
    pages = torch.randperm(num_blocks).tolist()  # each sequence gets shuffled, scattered pages
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)  # -1: unused entry
    for b, n_pages in enumerate(pages_needed):
        for p in range(n_pages):
            block_table[b, p] = pages.pop()
    k_cache, v_cache = (rand(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2))
    q = rand(batch, num_heads, head_dim)

    out = reference.flash_decode(q, k_cache, v_cache, block_table, seqlens, window=window, num_splits=3)
    assert out.shape == (batch, num_heads, head_dim) and out.dtype == F64
    for b in range(batch):
        n = int(seqlens[b])
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        slots = [(int(block_table[b, t // block_size]), t % block_size) for t in range(n)]
        k_seq = torch.stack([k_cache[page, slot] for page, slot in slots])[None]  # (1, n, Hkv, D)
        v_seq = torch.stack([v_cache[page, slot] for page, slot in slots])[None]
        expected = reference.flash_attention(q[b][None, None], k_seq, v_seq, causal=True, window=window)
        torch.testing.assert_close(out[b], expected[0, 0], rtol=1e-12, atol=1e-12)


def test_flash_decode_float16_output_dtype():
    k_cache = rand(2, 4, 1, 16).half()
    out = reference.flash_decode(
        rand(1, 3, 16).half(),
        k_cache,
        k_cache,
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
    )
    assert out.dtype == torch.float16 and out.shape == (1, 3, 16)


# ----------------------------------------------------------------------------------------------
# selective_scan / selective_state_update
# ----------------------------------------------------------------------------------------------


def scan_loop(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None):
    """Mamba's recurrence one (batch element, channel, step) at a time; returns y, last_state."""
    batch, dim, seqlen = u.shape
    d_state = A.shape[1]
    groups = B.shape[1] if B.ndim == 4 else 1
    ys, last_states = [], []
    for b in range(batch):
        for d in range(dim):
            g = d // (dim // groups)
            h = initial_state[b, d] if initial_state is not None else torch.zeros(d_state, dtype=u.dtype)
            for t in range(seqlen):
                dt = delta[b, d, t] + (delta_bias[d] if delta_bias is not None else 0)
                if delta_softplus:
                    dt = torch.log1p(torch.exp(dt))
                B_t = B[b, g, :, t] if B.ndim == 4 else B[b, :, t]
                C_t = C[b, g, :, t] if C.ndim == 4 else C[b, :, t]
                h = torch.exp(dt * A[d]) * h + dt * B_t * u[b, d, t]
                y = torch.dot(C_t, h)
                if D is not None:
                    y = y + D[d] * u[b, d, t]
                if z is not None:
                    y = y * z[b, d, t] * torch.sigmoid(z[b, d, t])
                ys.append(y)
            last_states.append(h)
    return torch.stack(ys).reshape(batch, dim, seqlen), torch.stack(last_states).reshape(batch, dim, d_state)


def scan_inputs(
    batch=2, dim=4, seqlen=7, d_state=4, groups=None, extras=True, initial=False, requires_grad=False
):
    """Keyword inputs of selective_scan in float64; A negative so the state decays like Mamba's."""
    bc_shape = (batch, d_state, seqlen) if groups is None else (batch, groups, d_state, seqlen)
    inputs = {
        "u": rand(batch, dim, seqlen),
        "delta": rand(batch, dim, seqlen, positive=not extras),
        "A": -torch.rand(dim, d_state, dtype=F64) - 0.1,
        "B": rand(*bc_shape),
        "C": rand(*bc_shape),
    }
    if extras:
        inputs |= {"D": rand(dim), "z": rand(batch, dim, seqlen), "delta_bias": rand(dim)}
    if initial:
        inputs["initial_state"] = rand(batch, dim, d_state)
    for t in inputs.values():
        t.requires_grad_(requires_grad)
    return inputs


@pytest.mark.parametrize("seqlen", [1, 7, 37])
@pytest.mark.parametrize("d_state", [1, 4])
@pytest.mark.parametrize("groups", [None, 2])
@pytest.mark.parametrize("extras,initial", [(False, False), (True, True)])
def test_selective_scan_matches_loop(seqlen, d_state, groups, extras, initial):
    inputs = scan_inputs(seqlen=seqlen, d_state=d_state, groups=groups, extras=extras, initial=initial)
    y, last = reference.selective_scan(**inputs, delta_softplus=extras, return_last_state=True)
    y_loop, last_loop = scan_loop(**inputs, delta_softplus=extras)
    assert y.dtype == F64 and last.dtype == F64 and last.shape == (2, 4, d_state)
    torch.testing.assert_close(y, y_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, last_loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups,checkpoint_steps", [(None, 16), (2, 3)])
def test_selective_scan_gradcheck(groups, checkpoint_steps, monkeypatch):
    # checkpoint_steps=3 splits the 7 steps into chunks, exercising the recompute and the gradient
    # carried between chunks of the hand-written backward.
    monkeypatch.setattr(reference, "_SCAN_CHECKPOINT_STEPS", checkpoint_steps)
    inputs = scan_inputs(batch=2, dim=4, seqlen=7, d_state=3, groups=groups, initial=True, requires_grad=True)
    names = list(inputs)

    def fn(*tensors):
        return reference.selective_scan(
            **dict(zip(names, tensors, strict=True)), delta_softplus=True, return_last_state=True
        )

    assert torch.autograd.gradcheck(fn, tuple(inputs.values()))


def test_selective_scan_backward_matches_loop_over_several_chunks():
    inputs = scan_inputs(seqlen=37, groups=2, initial=True, requires_grad=True)
    weight_y, weight_last = rand(2, 4, 37), rand(2, 4, 4)

    def loss(y, last):
        return (y * weight_y).sum() + (last * weight_last).sum()

    tensors = list(inputs.values())
    grads = torch.autograd.grad(
        loss(*reference.selective_scan(**inputs, delta_softplus=True, return_last_state=True)), tensors
    )
    grads_loop = torch.autograd.grad(loss(*scan_loop(**inputs, delta_softplus=True)), tensors)
    for grad, grad_loop in zip(grads, grads_loop, strict=True):
        torch.testing.assert_close(grad, grad_loop, rtol=1e-10, atol=1e-12)


def test_selective_scan_carried_state_equals_one_call():
    inputs = scan_inputs(seqlen=11, groups=2)
    y, last = reference.selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    first = {n: (t[..., :4] if t.shape[-1] == 11 else t) for n, t in inputs.items()}
    second = {n: (t[..., 4:] if t.shape[-1] == 11 else t) for n, t in inputs.items()}
    y1, state = reference.selective_scan(**first, delta_softplus=True, return_last_state=True)
    y2, last2 = reference.selective_scan(
        **second, delta_softplus=True, return_last_state=True, initial_state=state
    )
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last2, last, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [None, 2])
def test_selective_state_update_steps_equal_scan(groups):
    inputs = scan_inputs(seqlen=6, groups=groups, initial=True)
    y, last = reference.selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    state = inputs["initial_state"].clone()
    for t in range(6):
        y_t = reference.selective_state_update(
            state,
            inputs["u"][:, :, t],
            inputs["delta"][:, :, t],
            inputs["A"],
            inputs["B"][..., t],
            inputs["C"][..., t],
            D=inputs["D"],
            z=inputs["z"][:, :, t],
            dt_bias=inputs["delta_bias"],
            dt_softplus=True,
        )
        torch.testing.assert_close(y_t, y[:, :, t], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, last, rtol=1e-12, atol=1e-12)


def test_selective_scan_16_bit_dtypes():
    inputs = scan_inputs(initial=True)
    u = inputs.pop("u").to(torch.bfloat16)
    inputs["initial_state"] = inputs["initial_state"].float()
    y, last = reference.selective_scan(u, **inputs, return_last_state=True)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    state = torch.zeros(2, 4, 4)
    y_t = reference.selective_state_update(
        state, u[:, :, 0], inputs["delta"][:, :, 0], inputs["A"], inputs["B"][..., 0], inputs["C"][..., 0]
    )
    assert y_t.dtype == torch.bfloat16 and state.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# linear_attention / linear_attention_step
# ----------------------------------------------------------------------------------------------


def linear_attention_loop(q, k, v, *, normalize, scale=None, eps=1e-10, kv0=None, z0=None):
    """o_t = scale q_t . (S_0 + sum_{s<=t} k_s v_s^T) [/ (scale q_t . (z_0 + sum_{s<=t} k_s) + eps)]."""
    batch, seqlen, num_heads, k_dim = q.shape
    v_dim = v.shape[-1]
    scale = k_dim**-0.5 if scale is None else scale
    rows, kvs, zs = [], [], []
    for b in range(batch):
        for h in range(num_heads):
            kv = kv0[b, h] if kv0 is not None else torch.zeros(k_dim, v_dim, dtype=q.dtype)
            z = z0[b, h] if z0 is not None else torch.zeros(k_dim, dtype=q.dtype)
            for t in range(seqlen):
                kv = kv + torch.outer(k[b, t, h], v[b, t, h])
                z = z + k[b, t, h]
                o = scale * q[b, t, h] @ kv
                if normalize:
                    o = o / (scale * torch.dot(q[b, t, h], z) + eps)
                rows.append(o)
            kvs.append(kv)
            zs.append(z)
    o = torch.stack(rows).reshape(batch, num_heads, seqlen, v_dim).transpose(1, 2)
    return (
        o,
        torch.stack(kvs).reshape(batch, num_heads, k_dim, v_dim),
        torch.stack(zs).reshape(batch, num_heads, k_dim),
    )


def linear_inputs(batch=2, seqlen=9, num_heads=3, k_dim=5, v_dim=3, requires_grad=False):
    # Positive q, k stand in for a positive feature map (elu + 1), keeping the normaliser away from 0.
    return (
        rand(batch, seqlen, num_heads, k_dim, positive=True, requires_grad=requires_grad),
        rand(batch, seqlen, num_heads, k_dim, positive=True, requires_grad=requires_grad),
        rand(batch, seqlen, num_heads, v_dim, requires_grad=requires_grad),
    )


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_linear_attention_matches_loop(normalize, initial, chunk_size, monkeypatch):
    monkeypatch.setattr(reference, "_LINEAR_ATTENTION_CHUNK_SIZE", chunk_size)
    q, k, v = linear_inputs()
    kv0 = rand(2, 3, 5, 3) if initial else None
    z0 = rand(2, 3, 5, positive=True) if initial else None
    state = None
    if initial:
        state = (kv0, z0) if normalize else kv0
    o, final = reference.linear_attention(
        q, k, v, normalize=normalize, scale=0.7, initial_state=state, output_final_state=True
    )
    o_loop, kv_loop, z_loop = linear_attention_loop(q, k, v, normalize=normalize, scale=0.7, kv0=kv0, z0=z0)
    assert o.shape == (2, 9, 3, 3) and o.dtype == F64
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)
    if normalize:
        kv, z = final
        torch.testing.assert_close(z, z_loop, rtol=1e-12, atol=1e-12)
    else:
        kv = final
    assert kv.dtype == F64
    torch.testing.assert_close(kv, kv_loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attention_carried_state_equals_one_call(normalize):
    q, k, v = linear_inputs()
    o, final = reference.linear_attention(q, k, v, normalize=normalize, output_final_state=True)
    o1, state = reference.linear_attention(
        q[:, :4], k[:, :4], v[:, :4], normalize=normalize, output_final_state=True
    )
    o2, final2 = reference.linear_attention(
        q[:, 4:], k[:, 4:], v[:, 4:], normalize=normalize, initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, rtol=1e-12, atol=1e-12)
    for a, b in zip(final2 if normalize else [final2], final if normalize else [final], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attention_gradcheck(normalize, monkeypatch):
    monkeypatch.setattr(reference, "_LINEAR_ATTENTION_CHUNK_SIZE", 3)
    q, k, v = linear_inputs(batch=1, seqlen=5, num_heads=2, k_dim=4, v_dim=3, requires_grad=True)
    kv0 = rand(1, 2, 4, 3, requires_grad=True)
    z0 = rand(1, 2, 4, positive=True, requires_grad=True)

    def fn(q, k, v, kv0, z0):
        state = (kv0, z0) if normalize else kv0
        o, final = reference.linear_attention(
            q, k, v, normalize=normalize, initial_state=state, output_final_state=True
        )
        return (o, *final) if normalize else (o, final)

    assert torch.autograd.gradcheck(fn, (q, k, v, kv0, z0))


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attention_step_equals_full(normalize):
    q, k, v = linear_inputs(seqlen=6)
    o, final = reference.linear_attention(q, k, v, normalize=normalize, output_final_state=True)
    state = torch.zeros(2, 3, 5, 3, dtype=F64)
    z_state = torch.zeros(2, 3, 5, dtype=F64) if normalize else None
    for t in range(6):
        o_t = reference.linear_attention_step(q[:, t], k[:, t], v[:, t], state, z_state=z_state)
        torch.testing.assert_close(o_t, o[:, t], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, final[0] if normalize else final, rtol=1e-12, atol=1e-12)
    if normalize:
        torch.testing.assert_close(z_state, final[1], rtol=1e-12, atol=1e-12)


def test_linear_attention_16_bit_dtypes():
    q, k, v = (t.half() for t in linear_inputs())
    o, (kv, z) = reference.linear_attention(q, k, v, output_final_state=True)
    assert o.dtype == torch.float16 and kv.dtype == torch.float32 and z.dtype == torch.float32
    o_t = reference.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], kv, z_state=z)
    assert o_t.dtype == torch.float16


# ----------------------------------------------------------------------------------------------
# Dispatch and input validation
# ----------------------------------------------------------------------------------------------


def test_dispatch_none_and_reference_equal_reference():
    q, k, v = rand(1, 4, 2, 16), rand(1, 4, 1, 16), rand(1, 4, 1, 16)
    expected = reference.flash_attention(q, k, v, window=2)
    assert torch.equal(kernels.flash_attention(q, k, v, window=2), expected)
    assert torch.equal(kernels.flash_attention(q, k, v, window=2, backend="reference"), expected)
    inputs = scan_inputs()
    assert torch.equal(kernels.selective_scan(**inputs), reference.selective_scan(**inputs))
    ql, kl, vl = linear_inputs()
    assert torch.equal(kernels.linear_attention(ql, kl, vl), reference.linear_attention(ql, kl, vl))


OP_CALLS = {
    "flash_attention": lambda **kw: kernels.flash_attention(
        rand(1, 2, 1, 4), rand(1, 2, 1, 4), rand(1, 2, 1, 4), **kw
    ),
    "flash_decode": lambda **kw: kernels.flash_decode(
        rand(1, 1, 4),
        rand(1, 2, 1, 4),
        rand(1, 2, 1, 4),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        **kw,
    ),
    "selective_scan": lambda **kw: kernels.selective_scan(**scan_inputs(), **kw),
    "selective_state_update": lambda **kw: kernels.selective_state_update(
        rand(1, 2, 3), rand(1, 2), rand(1, 2), rand(2, 3), rand(1, 3), rand(1, 3), **kw
    ),
    "causal_conv1d": lambda **kw: kernels.causal_conv1d(rand(1, 2, 5), rand(2, 4), rand(2), "silu", **kw),
    "causal_conv1d_update": lambda **kw: kernels.causal_conv1d_update(
        rand(1, 2), rand(1, 2, 4), rand(2, 4), rand(2), "silu", **kw
    ),
    "linear_attention": lambda **kw: kernels.linear_attention(*linear_inputs(), **kw),
    "linear_attention_step": lambda **kw: kernels.linear_attention_step(
        rand(1, 1, 2), rand(1, 1, 2), rand(1, 1, 3), rand(1, 1, 2, 3), **kw
    ),
}


@pytest.mark.parametrize("op", sorted(OP_CALLS))
def test_backends(op):
    assert OP_CALLS[op](backend="reference").dtype == F64
    if op in kernels._TRITON_OPS:  # landed: "triton" runs the kernel (interpreted on CPU)
        # A GPU machine runs the Triton backend compiled, on CUDA tensors (conftest sets the
        # interpreter only where there is no GPU).
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            assert OP_CALLS[op](backend="triton").dtype == F64
    else:
        with pytest.raises(
            NotImplementedError, match=f"{op}.*Triton kernel has not landed.*backend='reference'"
        ):
            OP_CALLS[op](backend="triton")
    with pytest.raises(ValueError, match="valid backends"):
        OP_CALLS[op](backend="cuda")
    assert set(kernels.__all__) == set(OP_CALLS)


@pytest.mark.parametrize(
    "kwargs,k_shape,error,match",
    [
        ({"window": 0}, (1, 4, 2, 8), ValueError, "window must be > 0"),
        ({"window": -3}, (1, 4, 2, 8), ValueError, "window must be > 0"),
        ({"window": 2.0}, (1, 4, 2, 8), TypeError, "window must be a positive int"),
        ({"window": 2, "causal": False}, (1, 4, 2, 8), ValueError, "window requires causal=True"),
        ({}, (1, 4, 4, 8), ValueError, "multiple of num_kv_heads"),
        ({}, (1, 4, 2, 4), ValueError, "must agree on B and D"),
        ({}, (4, 2, 8), ValueError, "k must have 4 dimensions"),
    ],
)
def test_flash_attention_errors(kwargs, k_shape, error, match):
    q = rand(1, 4, 6, 8)
    with pytest.raises(error, match=match):
        kernels.flash_attention(q, rand(*k_shape), rand(*k_shape), **kwargs)


def test_flash_attention_dtype_and_kv_shape_errors():
    q, k = rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(TypeError, match="dtypes must match"):
        kernels.flash_attention(q, k.float(), k)
    with pytest.raises(ValueError, match="same shape"):
        kernels.flash_attention(q, k, rand(1, 5, 2, 8))


def test_flash_decode_errors():
    q, cache = rand(2, 2, 8), rand(3, 4, 1, 8)
    table, seqlens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqlens must lie in \[0, max_blocks \* block_size\] = \[0, 8\], "
                       r"got seqlens\[1\] = 9 \(min 3, max 9\)$"):  # fmt: skip
        kernels.flash_decode(q, cache, cache, table, torch.tensor([3, 9], dtype=torch.int32))
    # A long batch names the first bad length, not every length.
    many = torch.full((5000,), 3, dtype=torch.int32)
    many[4321] = -1
    with pytest.raises(ValueError, match=r"got seqlens\[4321\] = -1 \(min -1, max 3\)$"):
        kernels.flash_decode(rand(5000, 2, 8), cache, cache, torch.zeros(5000, 2, dtype=torch.int32), many)
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        kernels.flash_decode(q, cache, cache, table.float(), seqlens)
    with pytest.raises(TypeError, match="seqlens must be an integer tensor"):
        kernels.flash_decode(q, cache, cache, table, seqlens.double())
    with pytest.raises(
        ValueError, match=r"block_table entries used by seqlens must lie in \[0, num_blocks\)"
    ):
        kernels.flash_decode(q, cache, cache, torch.tensor([[0, 0], [1, 3]], dtype=torch.int32), seqlens)
    with pytest.raises(ValueError, match="must have B = 2 rows"):
        kernels.flash_decode(q, cache, cache, table[:1], seqlens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.flash_decode(rand(2, 3, 8), rand(3, 4, 2, 8), rand(3, 4, 2, 8), table, seqlens)
    with pytest.raises(ValueError, match="window must be > 0"):
        kernels.flash_decode(q, cache, cache, table, seqlens, window=0)


def test_selective_scan_errors():
    inputs = scan_inputs(groups=2)
    with pytest.raises(ValueError, match="groups .3. must divide dim .4."):
        kernels.selective_scan(**(inputs | {"B": rand(2, 3, 4, 7), "C": rand(2, 3, 4, 7)}))
    with pytest.raises(ValueError, match="delta must have u's shape"):
        kernels.selective_scan(**(inputs | {"delta": rand(2, 4, 6)}))
    with pytest.raises(ValueError, match="B and C must have the same shape"):
        kernels.selective_scan(**(inputs | {"C": rand(2, 4, 7)}))
    with pytest.raises(ValueError, match="initial_state must be"):
        kernels.selective_scan(**inputs, initial_state=rand(2, 4, 3))
    with pytest.raises(ValueError, match="D must have shape"):
        kernels.selective_scan(**(inputs | {"D": rand(3)}))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_causal_conv1d_is_padded_depthwise_conv(width):
    # The reference's shifted multiply-adds are PyTorch's depthwise conv with width - 1 zeros on
    # the left (cut to L outputs), then silu; gradients included.
    x, weight, bias = rand(2, 3, 7, requires_grad=True), rand(3, width, requires_grad=True), rand(3)
    y = reference.causal_conv1d(x, weight, bias, "silu")
    want = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x, weight[:, None], bias, padding=width - 1, groups=3)[..., :7]
    )
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = rand(2, 3, 7)
    got = torch.autograd.grad(y, (x, weight), dy)
    for a, b in zip(got, torch.autograd.grad(want, (x, weight), dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_update_shifts_the_window():
    # The window drops its oldest input and appends x; y is the dot of the new window with the taps.
    x, state, weight = rand(2, 3), rand(2, 3, 4), rand(3, 4)
    old = state.clone()
    y = reference.causal_conv1d_update(x, state, weight)
    assert torch.equal(state, torch.cat([old[..., 1:], x[..., None]], -1))
    torch.testing.assert_close(y, (state * weight).sum(-1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"conv_state must be \(batch, dim, width\)"):
        reference.causal_conv1d_update(x, rand(2, 3, 3), weight)
    with pytest.raises(ValueError, match="activation must be None or 'silu'"):
        reference.causal_conv1d(rand(1, 3, 4), weight, activation="gelu")
    with pytest.raises(TypeError, match="dtypes must match"):
        reference.causal_conv1d(rand(1, 3, 4), weight, rand(3).float())


def test_linear_attention_state_form_errors():
    q, k, v = linear_inputs()
    with pytest.raises(TypeError, match="normalize=True, initial_state must be the pair"):
        kernels.linear_attention(q, k, v, initial_state=rand(2, 3, 5, 3))
    with pytest.raises(TypeError, match="normalize=False, initial_state must be the tensor"):
        kernels.linear_attention(q, k, v, normalize=False, initial_state=(rand(2, 3, 5, 3), rand(2, 3, 5)))
    with pytest.raises(ValueError, match="kv must be"):
        kernels.linear_attention(q, k, v, normalize=False, initial_state=rand(2, 3, 3, 5))
    with pytest.raises(ValueError, match="state must be"):
        kernels.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], rand(2, 3, 5, 4))
    # Found by a fresh-clone check: the pair linear_attention returns, handed back whole.
    _, (kv, z) = kernels.linear_attention(q, k, v, output_final_state=True)
    with pytest.raises(
        TypeError, match=r"got a pair: .* pass linear_attention_step\(q, k, v, kv, z_state=z\)"
    ):
        kernels.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], (kv, z))


def test_every_op_refuses_tensors_on_two_devices():
    # Found by a fresh-clone check: the reference ops failed inside torch (or, for the conv update
    # with a meta state, returned uninitialised memory), where the Triton backend named the tensors.
    meta = torch.empty(1, 4, 2, 8, dtype=F64, device="meta")
    q = rand(1, 4, 2, 8)
    with pytest.raises(
        ValueError, match="flash_attention: all tensors must be on one device, got q on cpu, k on meta"
    ):
        kernels.flash_attention(q, meta, q)
    inputs = scan_inputs()
    with pytest.raises(ValueError, match="selective_scan: all tensors must be on one device.*A on meta"):
        kernels.selective_scan(**(inputs | {"A": inputs["A"].to("meta")}))
    state, x = rand(2, 4, 3), rand(2, 4)
    with pytest.raises(
        ValueError, match="selective_state_update: all tensors must be on one device.*B on meta"
    ):
        kernels.selective_state_update(
            state, x, x.abs(), -rand(4, 3).abs(), rand(2, 3).to("meta"), rand(2, 3)
        )
    weight = rand(4, 3)
    with pytest.raises(ValueError, match="causal_conv1d: all tensors must be on one device.*weight on meta"):
        kernels.causal_conv1d(rand(2, 4, 5), weight.to("meta"))
    with pytest.raises(
        ValueError, match="causal_conv1d_update: all tensors must be on one device.*conv_state on meta"
    ):
        kernels.causal_conv1d_update(x, torch.zeros(2, 4, 3, dtype=F64, device="meta"), weight)


def test_selective_scan_refuses_an_A_that_is_not_2_d():
    inputs = scan_inputs()
    with pytest.raises(ValueError, match=r"A must have 2 dimensions, got shape \(4,\)"):
        kernels.selective_scan(**(inputs | {"A": inputs["A"][:, 0]}))
    with pytest.raises(TypeError, match="A must be a torch.Tensor, got NoneType"):
        kernels.selective_scan(**(inputs | {"A": None}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sparse_inputs_are_refused_by_name(backend):
    """A sparse tensor anywhere is a clear TypeError naming it, not an aten error from inside an op."""
    q, k = rand(1, 2, 16), rand(4, 16, 2, 16)
    table, seqlens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    for name, args in (
        ("q", (q.to_sparse(), k, k, table, seqlens)),
        ("k_cache", (q, k.to_sparse(), k, table, seqlens)),
        ("block_table", (q, k, k, table.to_sparse(), seqlens)),
        ("seqlens", (q, k, k, table, seqlens.to_sparse())),
    ):
        with pytest.raises(
            TypeError, match=rf"{name} must be a dense \(strided\) tensor, got layout torch.sparse_coo"
        ):
            kernels.flash_decode(*args, backend=backend)
    with pytest.raises(TypeError, match=r"k must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        kernels.flash_attention(
            rand(1, 4, 2, 16), rand(1, 4, 2, 16).to_sparse(), rand(1, 4, 2, 16), backend=backend
        )


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nested_inputs_are_refused_by_name(backend, layout):
    """Found by an audit: a nested tensor (sequences of several lengths) failed with torch's
    "Internal error: NestedTensorImpl doesn't support sizes", or (jagged) was told to use .to_dense()."""
    nested = torch.nested.nested_tensor([rand(4, 2, 16), rand(3, 2, 16)], layout=layout)
    match = r"^k must be a dense \(strided\) tensor, got a nested tensor; pass sequences of one length"
    with pytest.raises(TypeError, match=match):
        kernels.flash_attention(rand(2, 4, 2, 16), nested, rand(2, 4, 2, 16), backend=backend)
    with pytest.raises(TypeError, match=r"^q must be a dense \(strided\) tensor, got a nested tensor"):
        kernels.linear_attention(nested, nested, nested, backend=backend)


def _decode_steps():
    """Each decode step that writes a state in place: (call(state, backend), state) with float64
    inputs (the interpreter runs them too)."""
    q, state, z = rand(2, 3, 4), rand(2, 3, 4, 5), rand(2, 3, 4, positive=True)
    x, ssm_state, A = rand(2, 4), rand(2, 4, 3), -rand(4, 3, positive=True)
    conv_state, weight = rand(2, 4, 3), rand(4, 3)
    return [
        (lambda s, backend: kernels.linear_attention_step(q, q, rand(2, 3, 5), s, z_state=z.clone(), backend=backend),
         state),
        (lambda s, backend: kernels.selective_state_update(s, x, x.abs(), A, rand(2, 3), rand(2, 3), backend=backend),
         ssm_state),
        (lambda s, backend: kernels.causal_conv1d_update(x, s, weight, backend=backend),
         conv_state),
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_steps_count_their_in_place_writes_as_pytorch_does(backend):
    """A state a step overwrote can no longer be backpropagated through (its version counter went up,
    as for any in-place op; the Triton kernels' writes were invisible to autograd, which then gave
    wrong gradients), and a state made under inference_mode is refused outside it, before any write."""
    for step, state in _decode_steps():
        w = rand(*state.shape, requires_grad=True)
        y = (w * state).sum()  # saves state for w's gradient
        with torch.no_grad():
            step(state, backend)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        with torch.inference_mode():
            frozen = state.clone()
        with pytest.raises(RuntimeError, match="is updated in place, but it is an inference tensor"):
            step(frozen, backend)
        assert torch.equal(frozen, state), "a refused step must not have written the state"
        with torch.inference_mode():
            step(frozen, backend)  # inside inference mode it is an ordinary step


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_state_whose_elements_overlap_is_refused_before_any_write(backend):
    """Found by an audit: an as_strided state whose rows overlap (no stride 0) was stepped, with
    results that differed between the backends; now refused, on both, before anything is written.
    Views whose elements stay apart (a slice, a permutation, every other channel) still step."""
    for (step, state), name in zip(_decode_steps(), ["state", "state", "conv_state"], strict=True):
        storage = torch.zeros(state.numel() * 2, dtype=state.dtype)
        # The last dim's rows overlap: stride of the second-to-last dim smaller than the last's span.
        strides = [*state.stride()[:-2], 1, 1]
        overlapping = storage.as_strided(state.shape, strides)
        with pytest.raises(ValueError, match=f"{name} is updated in place, so its elements must not share"):
            step(overlapping, backend)
        assert not storage.any(), "a refused step must not have written the state"
        spaced = torch.zeros(*state.shape[:-1], state.shape[-1] * 2, dtype=state.dtype)[..., ::2]
        step(spaced, backend)  # every other element: apart
        step(state.transpose(-1, -2).contiguous().transpose(-1, -2), backend)  # a permuted layout


def test_a_16_bit_ssm_state_is_refused():
    # Found by an audit: a bf16 / fp16 state was accepted and drifted (0.2-0.35% after 300 steps).
    x = rand(2, 4)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(TypeError, match=f"state must be float32 \\(or float64\\), got {dtype}"):
            kernels.selective_state_update(
                rand(2, 4, 3).to(dtype), x, x.abs(), -rand(4, 3, positive=True), rand(2, 3), rand(2, 3)
            )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_missing_first_tensor_is_a_type_error(backend):
    """None in the first tensor's place is the checks' TypeError on both backends (the Triton ops key
    their replayed launches on it first)."""
    q, cache = rand(1, 2, 8), rand(3, 4, 1, 8)
    table, seqlens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got NoneType"):
        kernels.flash_decode(None, cache, cache, table, seqlens, check_values=False, backend=backend)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got NoneType"):
        kernels.linear_attention_step(None, q, q, rand(1, 2, 8, 8), backend=backend)
    x = rand(2, 4)
    with pytest.raises(TypeError, match="state must be a torch.Tensor, got NoneType"):
        kernels.selective_state_update(None, x, x.abs(), -rand(4, 3), rand(2, 3), rand(2, 3), backend=backend)


def test_decode_inputs_that_share_memory_with_the_updated_state_are_refused():
    # The step reads them while it writes the state in place, in an order each backend chooses.
    state, z = rand(1, 1, 4, 4), rand(1, 1, 4)
    q = rand(1, 1, 4)
    with pytest.raises(ValueError, match=r"k shares memory with state.*pass k.clone\(\)"):
        kernels.linear_attention_step(q, state[..., 0], q, state, z_state=z)
    with pytest.raises(ValueError, match="q shares memory with z_state"):
        kernels.linear_attention_step(z, q, q, state, z_state=z)
    conv_state = rand(2, 4, 4)
    with pytest.raises(ValueError, match="x shares memory with conv_state"):
        kernels.causal_conv1d_update(conv_state[:, :, 0], conv_state, rand(4, 4))
    ssm = rand(1, 4, 4)
    with pytest.raises(ValueError, match="z shares memory with state"):
        kernels.selective_state_update(
            ssm, rand(1, 4), rand(1, 4).abs(), -rand(4, 4).abs(), rand(1, 4), rand(1, 4), z=ssm[:, :, 1]
        )
    # Clones are fine, and views of other tensors too.
    kernels.linear_attention_step(q, state[..., 0].clone(), q, state, z_state=z)


def test_selective_state_update_is_differentiable_in_its_parameters():
    # The reference's h was a view of the state it then overwrote: backward through A or dt failed.
    A = (-rand(2, 3).abs()).requires_grad_()
    dt = rand(1, 2, positive=True, requires_grad=True)
    B, C, x = rand(1, 3), rand(1, 3), rand(1, 2)

    def step(A, dt):
        return kernels.selective_state_update(torch.ones(1, 2, 3, dtype=F64), x, dt, A, B, C)  # a fresh state

    assert torch.autograd.gradcheck(step, (A, dt))


def test_linear_attention_of_an_empty_sequence_has_empty_gradients():
    q, k, v = linear_inputs(seqlen=0, requires_grad=True)
    out = kernels.linear_attention(q, k, v)
    assert out.shape == (2, 0, 3, 3)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_window_beyond_int64_is_refused_clearly():
    q = rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"window must be at most 2\*\*63 - 1.*pass window=None"):
        kernels.flash_attention(q, q, q, causal=True, window=10**20)
    torch.testing.assert_close(
        kernels.flash_attention(q, q, q, causal=True, window=2**63 - 1),
        kernels.flash_attention(q, q, q, causal=True),
    )


def test_attention_loop_sanity():
    # The loop reference itself: a row seeing one key copies its value, lse = its scaled score.
    q, k, v = rand(1, 1, 1, 4), rand(1, 1, 1, 4), rand(1, 1, 1, 4)
    o, lse = attention_loop(q, k, v, causal=True)
    torch.testing.assert_close(o, v)
    torch.testing.assert_close(lse[0, 0, 0], 0.5 * torch.dot(q.flatten(), k.flatten()))

"""Pure-PyTorch references for every kernel op.

These are the ground truth the Triton kernels are tested against and the path models take on CPU,
so they are exact (no approximations beyond floating-point rounding) and written to be read.

Precision policy, shared by every op: the reference computes in the dtype it is given, except that
16-bit inputs (float16, bfloat16) are upcast to float32 internally; outputs are cast back to the
input's dtype, while log-sum-exps and recurrent states stay in the compute dtype (float32, or
float64 for float64 inputs).

Shapes follow the field's conventions so results compare directly with public kernels: attention
and linear attention use ``(batch, seqlen, num_heads, head_dim)`` like flash-attn and fla; the
selective scan and the causal conv1d use mamba_ssm's ``(batch, dim, seqlen)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.autograd.function import once_differentiable

__all__ = [
    "flash_attention",
    "flash_decode",
    "selective_scan",
    "selective_state_update",
    "causal_conv1d",
    "causal_conv1d_update",
    "linear_attention",
    "linear_attention_step",
]

# Sequence chunk of the chunked linear-attention form (fla's chunk_linear_attn): a chunk is handled
# in its quadratic form, the state carries between chunks. It only bounds memory; results are exact.
_LINEAR_ATTENTION_CHUNK_SIZE = 64

# The selective scan processes time in chunks of this many steps: the forward keeps only the state
# before each chunk and the backward recomputes the chunk's states from it, so memory holds
# O(L / chunk + chunk) states instead of O(L). 16 steps of (64, 256, 16) fp32 states stay in cache.
_SCAN_CHECKPOINT_STEPS = 16


# ----------------------------------------------------------------------------------------------
# Shared validation helpers
# ----------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (16-bit, float32) computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The floating dtypes every op computes in (float8 and complex would need other accumulation rules).
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, x, ndim: int | tuple[int, ...], *, floating: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got a nested tensor; pass sequences of one length "
            "(e.g. one call per length)"
        )
    if x.layout is not torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {x.layout}; convert it with .to_dense()"
        )
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        expected = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {expected} dimensions, got shape {tuple(x.shape)}")
    if floating and x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a float16, bfloat16, float32 or float64 tensor, got dtype {x.dtype}; "
            "cast it with .to(...)"
        )


def _check_inference_write(name: str, t: torch.Tensor) -> None:
    """Refuse an in-place write to an inference tensor outside ``torch.inference_mode()``, as PyTorch's
    in-place ops do, but before anything is written.

    Raises:
        RuntimeError: ``t`` was made under ``torch.inference_mode()`` and the mode is off now.
    """
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{name} is updated in place, but it is an inference tensor (made under torch.inference_mode()) "
            f"and this runs outside it; step inside torch.inference_mode() too, or pass {name}.clone()"
        )


def _check_updated_in_place(**states: torch.Tensor | None) -> None:
    """States a decode step writes in place (None ones skipped): no element may share memory with
    another (an expanded view would mix its rows' updates; two states that overlap would mix each
    other's), and none may require grad in grad mode (the write would bypass autograd). Overlap is
    judged by byte ranges in one storage: interleaved disjoint views count as overlapping.

    Raises:
        ValueError: a stride-0 dim of size > 1, strides that make elements overlap
            (:func:`_elements_apart`), two states whose byte ranges in one storage overlap, or a
            state that requires grad; each message says what to pass instead.
        RuntimeError: an inference tensor outside inference mode (:func:`_check_inference_write`).
    """
    present = {name: t for name, t in states.items() if t is not None}
    for name, t in present.items():
        _check_inference_write(name, t)
        for axis, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
            if size > 1 and stride == 0:
                raise ValueError(
                    f"{name} is updated in place, so its elements must not share memory: it is an expanded "
                    f"view (stride 0 along dim {axis}); pass {name}.clone()"
                )
        if not _elements_apart(t):
            raise ValueError(
                f"{name} is updated in place, so its elements must not share memory, but its strides "
                f"{t.stride()} for shape {tuple(t.shape)} make some overlap (an as_strided view); pass "
                f"{name}.clone()"
            )
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} is updated in place, which autograd cannot follow, but it requires grad; pass "
                f"{name}.detach() or step under torch.no_grad()"
            )
    names = list(present)
    for i, name_a in enumerate(names):
        for name_b in names[i + 1 :]:
            if _share_memory(present[name_a], present[name_b]):
                raise ValueError(
                    f"{name_a} and {name_b} are both updated in place but share memory; pass separate "
                    f"tensors (e.g. {name_b}.clone())"
                )


def _elements_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, by a sufficient test: with the dims of size > 1
    sorted by stride, each stride passes the span of the dims before it (contiguous tensors, their
    permutations and slices, and views with gaps pass; a view that interleaves dims without overlap
    would not, and is refused with its fix, a clone)."""
    span = 0  # elements spanned by the dims so far, minus one
    dims = sorted((abs(stride), size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)
    for stride, size in dims:
        if stride <= span:
            return False
        span += stride * (size - 1)
    return True


def _check_read_apart(states: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Inputs a decode step reads must not share memory with the states it updates in place: the
    write may land before the read (the backends order them differently), so the result would
    depend on the backend. Judged like :func:`_check_updated_in_place` (None ones skipped); the
    tensors are on one device (checked before).

    Raises:
        ValueError: an input whose byte range overlaps a state's in one storage.
    """
    # On every eager decode step: the storage pointers are compared first, the spans only computed
    # for an input in the state's storage.
    for state_name, state in states.items():
        if state is None or not state.numel() or state.device.type == "meta":
            continue
        storage = state.untyped_storage().data_ptr()
        for name, t in inputs.items():
            if (
                t is not None
                and t.numel()
                and t.untyped_storage().data_ptr() == storage
                and _spans_overlap(state, t)
            ):
                raise ValueError(
                    f"{name} shares memory with {state_name}, which is updated in place while {name} is "
                    f"read; pass {name}.clone()"
                )


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges overlap in one storage (empty and meta tensors never do)."""
    if not (a.numel() and b.numel()) or "meta" in (a.device.type, b.device.type):
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and _spans_overlap(a, b)


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-empty tensors of one storage can touch a common byte."""
    (start_a, end_a), (start_b, end_b) = _byte_span(a), _byte_span(b)
    return start_a < end_b and start_b < end_a


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of the storage elements a non-empty tensor can touch."""
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.storage_offset() * t.element_size()
    return start, start + (last + 1) * t.element_size()


def _check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{name}={dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"dtypes must match, got {listing}; cast them to one dtype")


def _check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """ValueError naming each tensor's device when the present ones are not all on one device."""
    present = {name: t for name, t in tensors.items() if t is not None}
    if len({t.device for t in present.values()}) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(
            f"{op}: all tensors must be on one device, got {listing}; move them with .to(device)"
        )


MAX_WINDOW = 2**63 - 1  # the largest window the kernels take: they hold it as an int64


def _check_window(window, causal: bool = True) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be a positive int or None, got {window!r}; pass int(window)")
    if window <= 0:
        raise ValueError(f"window must be > 0 (it counts the current token), got {window}")
    if window > MAX_WINDOW:
        raise ValueError(
            f"window must be at most 2**63 - 1 (the kernels' int64), got {window}; a window at least as "
            "long as the sequence excludes nothing: pass window=None"
        )
    if not causal:
        raise ValueError("window requires causal=True: a sliding window is only defined for causal attention")


def _check_scale(scale, dtype: torch.dtype) -> None:
    """Refuse a scale that is not a finite Python number, or (inputs of ``dtype`` other than float64)
    one beyond float32's range, their compute dtype: it would become inf there, and every score and
    output NaN (a new-user check), where float64 inputs give the answer."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float or None, got {scale!r}; pass float(scale)")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if _compute_dtype(dtype) == torch.float32 and abs(scale) > torch.finfo(torch.float32).max:
        raise ValueError(
            f"scale {scale:g} overflows float32, in which {dtype} inputs are computed; pass float64 inputs"
        )


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a Python float, got {eps!r}; pass float(eps)")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0 (it is added to the normaliser), got {eps}")


def _check_bool(name: str, value) -> None:
    # A string such as "False" is truthy: taking it as a flag would silently do the opposite.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}; pass a bool")


def _check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for "
            "grouped-query attention"
        )


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim restricted to ``visible`` keys, plus its natural-log sum-exp.

    Rows with no visible key get all-zero probabilities and lse = -inf. The row max is taken
    over visible scores only and replaced by 0 for empty rows, so no exp(-inf - -inf) = NaN appears;
    it is detached because the softmax and lse do not depend on the shift (exact gradients). The
    denominator is guarded the same way, so empty rows give zero (finite) gradients.
    """
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    safe_denom = torch.where(has_key, denom, torch.ones_like(denom))
    probs = weights / safe_denom
    lse = torch.where(has_key, torch.log(safe_denom) + row_max, torch.full_like(denom, float("-inf")))
    return probs, lse.squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Exact attention
# ----------------------------------------------------------------------------------------------


def _key_ranges(seqlen_q: int, seqlen_k: int, causal: bool, window, device) -> tuple[torch.Tensor, ...]:
    """The keys each query row sees, ``[start_i, end_i)``, as two nondecreasing (Tq,) int64 tensors.

    Causal: query i sees key j iff ``j <= i + Tk - Tq`` (bottom-right aligned) and, with a window
    w, ``j > i + Tk - Tq - w``; rows that see no key get an empty range. Non-causal: every key.
    This is the one statement of flash_attention's visibility rule: the mask is built from it.
    """
    i = torch.arange(seqlen_q, device=device)
    if not causal:
        return torch.zeros_like(i), torch.full_like(i, seqlen_k)
    end = (i + (seqlen_k - seqlen_q + 1)).clamp(0, seqlen_k)
    start = torch.zeros_like(end) if window is None else (end - window).clamp(min=0)
    return start, end


def _any_in_ranges(flags: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """(B, len(start), H) bool: whether ``flags`` (B, T, H) holds a True in ``[start_r, end_r)`` along
    dim 1, for each range r. A cumulative count makes it O(B * (T + R) * H), with no (R, T) mask."""
    counts = F.pad(flags.cumsum(1), (0, 0, 1, 0))  # (B, T + 1, H): counts[:, t] = Trues before t
    return counts[:, end] > counts[:, start]


def _has_non_finite(x: torch.Tensor) -> torch.Tensor:
    """Whether each vector along the last dim holds a NaN or an infinity, exactly (read-only
    reductions: the max propagates NaN and +inf, the min -inf; a sum could overflow)."""
    return ~(torch.isfinite(x.amax(-1)) & torch.isfinite(x.amin(-1)))


def _nan_where(flags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flags[..., None]`` as an additive bias: NaN where set, else -0.0 (``x + -0.0`` is x, bit for
    bit, -0.0 included). One pass that leaves gradients unchanged, unlike ``masked_fill``."""
    return torch.where(flags, math.nan, -0.0).to(dtype).unsqueeze(-1)


class _ConfineNonFinite(torch.autograd.Function):
    """flash_attention's guard against non-finite keys and values (see the comment there).

    Forward: q unchanged, k and v (B, Tk, Hkv, D) with their non-finite entries replaced by 0.
    Backward: the gradients passed on (None stays None), except NaN for the queries of the rows
    ``bad_rows`` (B, Tq, Hkv) marks and for the keys and values such a row sees (row i sees keys
    ``[start_i, end_i)``).
    """

    @staticmethod
    def forward(ctx, q, k, v, bad_rows, start, end):
        ctx.save_for_backward(bad_rows, start, end)
        ctx.group, ctx.seqlen_k = q.shape[2] // k.shape[2], k.shape[1]
        ctx.set_materialize_grads(False)  # v's gradient stays None when only the lse is used
        return q.view_as(q), k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        bad_rows, start, end = ctx.saved_tensors
        # The rows that see key j form the range [first_j, stop_j): start and end are nondecreasing.
        keys = torch.arange(ctx.seqlen_k, device=bad_rows.device)
        first, stop = torch.searchsorted(end, keys, right=True), torch.searchsorted(start, keys, right=True)
        seen_by_bad_row = _any_in_ranges(bad_rows, first, stop)  # (B, Tk, Hkv)
        bad_queries = repeat(bad_rows, "b t h -> b t (h g)", g=ctx.group)  # (B, Tq, Hq)

        def poison(grad, flags):
            return None if grad is None else grad + _nan_where(flags, grad.dtype)

        return (
            poison(dq, bad_queries),
            poison(dk, seen_by_bad_row),
            poison(dv, seen_by_bad_row),
            None,
            None,
            None,
        )


def _check_attention_args(q, k, v, causal: bool, window, scale, return_lse=False):
    """Validate flash_attention's arguments (shared by the reference and the Triton backend).

    Returns ``(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, scale)`` with the
    default scale ``head_dim ** -0.5`` filled in.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_same_dtype(q=q, k=k, v=v)
    _check_same_device("flash_attention", q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (B, Tk, Hkv, D), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch, seqlen_q, num_heads, head_dim = q.shape
    _, seqlen_k, num_kv_heads, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"q (B, Tq, Hq, D) = {tuple(q.shape)} and k (B, Tk, Hkv, D) = {tuple(k.shape)} must agree on B and D"
        )
    if head_dim == 0 or num_heads == 0 or num_kv_heads == 0:
        raise ValueError(
            f"q (B, Tq, Hq, D) = {tuple(q.shape)} and k (B, Tk, Hkv, D) = {tuple(k.shape)} need at least one "
            "head and head_dim >= 1"
        )
    if seqlen_k == 0:
        raise ValueError("k and v must hold at least one key (Tk >= 1)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    _check_bool("return_lse", return_lse)
    _check_heads(num_heads, num_kv_heads)
    _check_window(window, causal)
    _check_scale(scale, q.dtype)
    if scale is None:
        scale = _default_scale(head_dim, "head_dim")
    return batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, scale


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
    """Exact masked softmax attention, ``o = softmax(scale * q k^T + mask) v``.

    Follows FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact
    Attention with IO-Awareness", eq. 1 / Algorithm 1), computed directly: scores materialised and
    a masked softmax, or PyTorch's fused ``scaled_dot_product_attention`` (same math, faster on
    CPU) when no lse is asked for and every query row sees a key, with ``enable_gqa`` under GQA.
    Memory: the masked softmax holds (B, Hkv, G*Tq, Tk) scores; K and V are never repeated per
    query head. A causal mask is built once as a (Tq, Tk) bool and broadcast over batch and heads,
    except for plain causal attention in the fused call (Tq == Tk, no window), which uses its
    ``is_causal`` and no mask.

    Args:
        q: (B, Tq, Hq, D) queries, float16 / bfloat16 / float32 / float64.
        k: (B, Tk, Hkv, D) keys, same dtype as q.
        v: (B, Tk, Hkv, D) values, same shape and dtype as k.
        causal: mask bottom-right aligned: query i sees key j iff ``j <= i + Tk - Tq``.
        window: sliding window w > 0 (only with causal=True), counting the current token:
            query i additionally needs ``j > i + Tk - Tq - w``.
        scale: score scale; defaults to ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled, masked scores.

    Grouped-query attention: query head h reads KV head ``h // (Hq // Hkv)``.
    Rows that see no key return 0, lse -inf and finite (zero) gradients.

    Non-finite inputs: keys and values a row cannot see never reach it; its output, lse and
    gradients are those it has when they are finite. A row that sees a key or value with a NaN or
    infinite entry returns NaN in its whole output and lse (even where IEEE arithmetic could give a
    number, e.g. a -inf score of weight 0), and the gradients of its query and of every key and
    value it sees are NaN. A query with a NaN or infinite entry returns NaN in its row's output and
    lse where the row sees a key (PyTorch's fused CPU attention would return 0); its backward
    follows IEEE arithmetic and may reach keys the row cannot see. The Triton backend keeps IEEE
    arithmetic over the keys a row sees (a -inf score gets weight 0); its forward confines hidden
    keys, but a NaN or infinite value at a hidden key (in the backward, a key too) reaches the rows
    of every query tile that loads its key tile (64 keys or fewer: 0 * NaN in P @ V, as in
    flash-attn), a known difference that a fix would pay for in the kernel's speed; and a row whose
    scores are all -inf (a -inf query entry) is an empty row there, 0 and lse -inf.

    Returns:
        o (B, Tq, Hq, D) in q's dtype; with return_lse also lse (B, Hq, Tq), natural log, float32
        for 16-bit inputs and the input dtype otherwise.

    Raises:
        TypeError: non-tensor inputs, dtypes other than fp16/bf16/fp32/fp64, mismatched dtypes,
            non-bool causal or return_lse, non-int window, non-float scale.
        ValueError: wrong ndim, mismatched batch / head_dim / k-v shapes, no heads or head_dim 0,
            Hq not a multiple of Hkv, Tk == 0, window <= 0 or beyond int64, window with
            causal=False, non-finite scale, tensors on different devices.
    """
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, scale = _check_attention_args(
        q, k, v, causal, window, scale, return_lse
    )

    dtype = _compute_dtype(q.dtype)
    group = num_heads // num_kv_heads
    start, end = _key_ranges(seqlen_q, seqlen_k, causal, window, q.device)  # (Tq,) each
    q_in, k_in, v_in = q.to(dtype), k.to(dtype), v.to(dtype)

    # Non-finite keys and values. Both paths below compute every query row against every key and
    # mask afterwards: the fused call adds the mask as -inf (a hidden score of NaN or +inf stays
    # NaN), and a hidden value meets its probability 0 in probs @ v (0 * NaN = NaN), so one NaN
    # would reach rows that cannot see it. The guard replaces non-finite entries by 0 for the
    # computation and sets the rows that see one to NaN afterwards, from per-key flags and a count
    # over each row's key range: O(B * T * H) side work and no host sync (CUDA graph capture); its
    # backward confines the gradients the same way. For finite inputs it is an identity (same bits,
    # same gradients), so on CPU, where reading a value back costs no device sync, all-finite
    # inputs skip it: its extra passes over K, V and the output cost 10-70% of a CPU forward at
    # B=8, T=256, Hq=8, D=64, the one read of K and V that decides 1-5%. (A sum is non-finite
    # whenever an entry is; one that merely overflows takes the guarded path, which is exact too.)
    # Non-finite queries: IEEE arithmetic makes the row of a query with a NaN or infinite entry NaN
    # (its scores are NaN or +-inf), as the Triton kernel computes it, but PyTorch's fused CPU call
    # returns 0 there (torch 2.13, float64 too) and the masked softmax an lse of -inf or +inf: such
    # rows that see a key are set to NaN below. On CPU one sum of q, k and v (one read back) decides
    # whether any flag is needed.
    bad_rows = None  # (B, Tq, Hkv): the row sees a non-finite key or value entry
    with torch.no_grad():  # flags, not part of the function
        guard = q.device.type != "cpu" or not bool(torch.isfinite(q.sum() + k.sum() + v.sum()))
        bad_keys = _has_non_finite(k) | _has_non_finite(v) if guard else None  # (B, Tk, Hkv)
        # (B, Tq, Hq): the query holds a non-finite entry and its row sees a key
        bad_queries = _has_non_finite(q) & (end > start)[:, None] if guard else None
    if guard:
        bad_rows = _any_in_ranges(bad_keys, start, end)
        q_in, k_in, v_in = _ConfineNonFinite.apply(q_in, k_in, v_in, bad_rows, start, end)

    kh = rearrange(k_in, "b s h d -> b h s d")  # (B, Hkv, Tk, D)
    vh = rearrange(v_in, "b s h d -> b h s d")  # (B, Hkv, Tk, D)

    # Every row sees at least its diagonal key, where PyTorch's fused attention computes the same
    # exact softmax several times faster on CPU (it is undefined for rows with no key). Its
    # enable_gqa lets query head h read KV head h // G itself, so K and V are never repeated.
    fused = not return_lse and (not causal or seqlen_q <= seqlen_k)
    # Plain causal attention (Tq == Tk, no window) is the fused call's own is_causal, which builds
    # no (Tq, Tk) mask: the mask's memory grows with T^2 (B1 T32768 H4 D16 float32 forward on CPU:
    # peak RSS 5.5 GB with it, 0.34 GB without). The other causal cases (windows, Tq != Tk, the
    # lse path) build one (Tq, Tk) mask, broadcast over batch and heads.
    # Not for a scale <= 0 (legal: 0 gives a uniform average over the visible keys): PyTorch's fused
    # is_causal path returns NaN in every row but the last then (torch 2.13 on CPU, float64 too; a
    # new-user check), while its boolean attn_mask path stays right. Nor for a positive scale that
    # is 0 in the compute dtype (1e-46 in float32; a denormal one where denormals are flushed).
    positive = scale >= torch.finfo(dtype).tiny
    is_causal = fused and causal and window is None and seqlen_q == seqlen_k and positive
    visible = None
    if causal and not is_causal:
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        visible = (j >= start[:, None]) & (j < end[:, None])  # (Tq, Tk)

    if fused:
        qh = rearrange(q_in, "b t h d -> b h t d")  # (B, Hq, Tq, D)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=visible, is_causal=is_causal, scale=scale, enable_gqa=group > 1
        )  # (B, Hq, Tq, D)
        lse = None
    else:
        # Query heads sharing a KV head (h = kv_head * G + g) become extra query rows of that KV
        # head, so one matmul per KV head shares K and V across its group without repeating them.
        qg = rearrange(q_in, "b t (h g) d -> b h (g t) d", g=group)  # (B, Hkv, G*Tq, D)
        scores = (qg @ kh.transpose(-1, -2)) * scale  # (B, Hkv, G*Tq, Tk)
        scores = rearrange(scores, "b h (g t) s -> b h g t s", g=group)  # a view, for the (Tq, Tk) mask
        probs, lse = _masked_softmax(scores, visible)  # (B, Hkv, G, Tq, Tk), (B, Hkv, G, Tq)
        out = rearrange(probs, "b h g t s -> b h (g t) s") @ vh  # (B, Hkv, G*Tq, D)
        out = rearrange(out, "b h (g t) d -> b (h g) t d", g=group)  # (B, Hq, Tq, D)
        lse = rearrange(lse, "b h g t -> b (h g) t")  # (B, Hq, Tq)

    nan_rows = None if bad_rows is None else repeat(bad_rows, "b t h -> b (h g) t", g=group)  # (B, Hq, Tq)
    if bad_queries is not None:
        query_rows = rearrange(bad_queries, "b t h -> b h t")
        nan_rows = query_rows if nan_rows is None else nan_rows | query_rows
    if nan_rows is not None:
        nan_rows = _nan_where(nan_rows, out.dtype)  # (B, Hq, Tq, 1)
        out = out + nan_rows
        lse = None if lse is None else lse + nan_rows.squeeze(-1)

    out = rearrange(out, "b h t d -> b t h d").to(q.dtype)
    if not return_lse:
        return out
    return out, lse


def _check_decode_values(block_table, seqlens, num_blocks: int, block_size: int, max_blocks: int) -> None:
    """flash_decode's checks of values (a device sync): seqlens within the table's capacity, and
    the table entries a sequence uses within the pool.

    Raises:
        ValueError: seqlens out of [0, max_blocks * block_size], a used page outside [0, num_blocks).
    """
    capacity = max_blocks * block_size
    if seqlens.numel() > 0 and (int(seqlens.min()) < 0 or int(seqlens.max()) > capacity):
        bad = int(torch.nonzero((seqlens < 0) | (seqlens > capacity))[0, 0])
        raise ValueError(
            f"seqlens must lie in [0, max_blocks * block_size] = [0, {capacity}], got seqlens[{bad}] = "
            f"{int(seqlens[bad])} (min {int(seqlens.min())}, max {int(seqlens.max())})"
        )
    # Pages a sequence actually uses must exist; unused table entries may hold anything.
    page_starts = (
        torch.arange(max_blocks, device=block_table.device) * block_size
    )  # (max_blocks,) first token of each page
    used = page_starts[None, :] < seqlens.long()[:, None]  # (B, max_blocks)
    used_pages = block_table[used]
    if used_pages.numel() > 0 and (int(used_pages.min()) < 0 or int(used_pages.max()) >= num_blocks):
        raise ValueError(
            f"block_table entries used by seqlens must lie in [0, num_blocks) = [0, {num_blocks})"
        )


def _check_decode_args(q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values):
    """Validate flash_decode's arguments (shared by the reference and the Triton backend).

    With ``check_values`` reads ``seqlens`` and the used ``block_table`` entries on the host (a
    device sync) to check their ranges, except while a CUDA graph is being captured. Returns ``(batch, num_heads,
    num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale)`` with the default scale
    ``head_dim ** -0.5`` filled in.
    """
    _check_tensor("q", q, 3)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    _check_tensor("block_table", block_table, 2, floating=False)
    _check_tensor("seqlens", seqlens, 1, floating=False)
    _check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    _check_same_device(
        "flash_decode", q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seqlens=seqlens
    )
    for name, t in (("block_table", block_table), ("seqlens", seqlens)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32), got dtype {t.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    max_blocks = block_table.shape[1]
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim ({head_dim}) must equal the cache head_dim ({cache_head_dim})")
    if block_table.shape[0] != batch or seqlens.shape[0] != batch:
        raise ValueError(
            f"block_table (B, max_blocks) = {tuple(block_table.shape)} and seqlens (B,) = "
            f"{tuple(seqlens.shape)} must have B = {batch} rows like q"
        )
    if num_heads == 0 or num_kv_heads == 0 or head_dim == 0:  # as flash_attention, on both backends
        raise ValueError(
            f"q (B, Hq, D) = {tuple(q.shape)} and k_cache (num_blocks, block_size, Hkv, D) = "
            f"{tuple(k_cache.shape)} need at least one head each and head_dim >= 1"
        )
    _check_heads(num_heads, num_kv_heads)
    _check_window(window)
    _check_scale(scale, q.dtype)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be a positive int or None, got {num_splits!r}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if scale is None:
        scale = _default_scale(head_dim, "head_dim")
    # A decode step being captured in a CUDA graph cannot read values back to the host: the value
    # checks run on eager calls (LanguageModel.generate runs a step eagerly before capturing it).
    # Meta tensors (shape-only tracing) have no values to check.
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {check_values!r}")
    has_values = "meta" not in (block_table.device.type, seqlens.device.type)
    if check_values and has_values and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_decode_values(block_table, seqlens, num_blocks, block_size, max_blocks)
    return batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale


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
    """One decode step of attention over a paged KV cache.

    Follows Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
    inference", PyTorch blog) with vLLM-style paging (Kwon et al. 2023, PagedAttention); the
    reference gathers each sequence's pages and does one masked softmax, so ``num_splits`` (the
    split-K factor of the kernel) is accepted and ignored.

    Sequence b's token t lives at ``k_cache[block_table[b, t // block_size], t % block_size]``.
    The cache already holds the new token: the query of sequence b attends to its first
    ``seqlens[b]`` tokens, only the last ``window`` of them when a window is set. Table entries
    beyond ``ceil(seqlens[b] / block_size)`` are never read (they may hold any value, e.g. -1).
    Under GQA query head h reads KV head ``h // (Hq // Hkv)``.

    Args:
        q: (B, Hq, D) queries, float16 / bfloat16 / float32 / float64.
        k_cache: (num_blocks, block_size, Hkv, D) key pages, same dtype as q.
        v_cache: (num_blocks, block_size, Hkv, D) value pages, same shape and dtype as k_cache.
        block_table: (B, max_blocks) integer (int32) page indices.
        seqlens: (B,) integer (int32) number of cached tokens per sequence,
            0 <= seqlens[b] <= max_blocks * block_size.
        window: sliding window w > 0 counting the current token, or None.
        scale: score scale; defaults to ``D ** -0.5``.
        num_splits: ignored by the reference (None or a positive int).
        check_values: read ``seqlens`` and the used ``block_table`` entries back to the host to
            check their ranges (a device sync: on an H200 it dominates a decode step's time, some
            hundreds of µs). Callers that build the table and lengths themselves, like the mixers'
            caches, pass False; with False, out-of-range values are undefined behaviour.

    Returns:
        (B, Hq, D) in q's dtype; sequences with seqlens == 0 return 0.

    Raises:
        TypeError: non-tensor inputs, non-floating q / caches or mismatched dtypes, non-integer
            block_table / seqlens, non-int window or num_splits.
        ValueError: wrong ndim or mismatched shapes, tensors on different devices, no query or KV
            head or head_dim 0 (as :func:`flash_attention`), Hq not a multiple of Hkv, seqlens out of
            [0, max_blocks * block_size], a used page index outside [0, num_blocks) (those two only
            with ``check_values``), window <= 0, num_splits < 1.
    """
    batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale = _check_decode_args(
        q, k_cache, v_cache, block_table, seqlens, window, scale, num_splits, check_values
    )
    capacity = max_blocks * block_size
    if capacity == 0 or num_blocks == 0:
        # No token can be cached (a pool or table of size 0): every sequence has length 0 (checked
        # with check_values), and an empty sequence's output is 0.
        return torch.zeros_like(q)
    seqlens = seqlens.long()

    dtype = _compute_dtype(q.dtype)
    group = num_heads // num_kv_heads
    pos = torch.arange(capacity, device=q.device)  # (T,) token positions, T = max_blocks * block_size
    pages = block_table.long().clamp(0, num_blocks - 1)[:, pos // block_size]  # (B, T)
    slots = (pos % block_size).expand_as(pages)  # (B, T)
    visible = pos[None, :] < seqlens[:, None]  # (B, T)
    if window is not None:
        visible = visible & (pos[None, :] >= seqlens[:, None] - window)
    # Slots the kernel never reads (past a sequence's length, outside its window) are zeroed, not
    # just masked: a NaN there would survive the masked softmax as 0 * NaN.
    hidden = ~visible[:, :, None, None]
    keys = k_cache[pages, slots].to(dtype).masked_fill(hidden, 0.0)  # (B, T, Hkv, D)
    values = v_cache[pages, slots].to(dtype).masked_fill(hidden, 0.0)  # (B, T, Hkv, D)

    qg = rearrange(q.to(dtype), "b (h g) d -> b h g d", g=group)  # (B, Hkv, G, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, keys) * scale  # (B, Hkv, G, T)
    probs, _ = _masked_softmax(scores, visible[:, None, None, :])
    out = torch.einsum("bhgt,bthd->bhgd", probs, values)  # (B, Hkv, G, D)
    return rearrange(out, "b h g d -> b (h g) d").to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Selective scan (Mamba)
# ----------------------------------------------------------------------------------------------


def _scan_chunk_states(h, u, dt, A, B):
    """States and decays of consecutive scan steps, starting from the state ``h`` before them.

    Shapes (c steps): h (batch, G, P, N); u, dt (c, batch, G, P); A (G, P, N); B (c, batch, G, N).
    Returns states h_t and decays exp(dt_t A), both (c, batch, G, P, N). Everything but the
    one-line recurrence is vectorised over the chunk, so the Python loop does one op per step.
    """
    decays = torch.exp(dt.unsqueeze(-1) * A)  # (c, batch, G, P, N)
    states = (dt * u).unsqueeze(-1) * B.unsqueeze(3)  # (c, batch, G, P, N): the input term dt_t u_t B_t
    states[0].addcmul_(decays[0], h)
    for i in range(1, states.shape[0]):
        states[i].addcmul_(decays[i], states[i - 1])  # h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t
    return states, decays


class _SelectiveScanRecurrence(torch.autograd.Function):
    """The linear recurrence of the selective scan, with a hand-written reverse-time backward.

    Inputs are time-major and grouped so every step is a broadcast op on (batch, G, P, N) states,
    where channel ``g * P + p`` uses group g of B and C:

        u, dt: (L, batch, G, P)   A: (G, P, N)   B, C: (L, batch, G, N)   h0: (batch, G, P, N)

        h_t = exp(dt_t A) * h_{t-1} + (dt_t u_t) B_t,    y_t = sum_n C_t h_t

    Returns y (L, batch, G, P) and h_L (batch, G, P, N). A plain loop over time is used because on
    CPU it is several times faster than vectorised log-space / cumsum scans at these sizes. The
    forward keeps only the state before every chunk of ``_SCAN_CHECKPOINT_STEPS`` steps; the
    backward recomputes a chunk's states from it and walks the chunk backwards in time:

        dL/dh_t = C_t dL/dy_t + exp(dt_{t+1} A) dL/dh_{t+1}
    """

    @staticmethod
    def forward(ctx, u, dt, A, B, C, h0):
        # h0 may be a view of a caller's cache state that is updated in place after this call, so
        # the first checkpoint is a copy.
        h = h0.clone()
        checkpoints = []
        outputs = []
        for start in range(0, u.shape[0], _SCAN_CHECKPOINT_STEPS):
            steps = slice(start, start + _SCAN_CHECKPOINT_STEPS)
            checkpoints.append(h)
            states, _ = _scan_chunk_states(h, u[steps], dt[steps], A, B[steps])
            outputs.append((states * C[steps].unsqueeze(3)).sum(-1))  # (c, batch, G, P)
            h = states[-1].clone()  # a copy, so the chunk's states are freed
        ctx.save_for_backward(u, dt, A, B, C, *checkpoints)
        y = torch.cat(outputs) if outputs else u.new_empty(u.shape)
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_last):
        u, dt, A, B, C, *checkpoints = ctx.saved_tensors
        grad_u, grad_dt = torch.empty_like(u), torch.empty_like(dt)
        grad_B, grad_C = torch.empty_like(B), torch.empty_like(C)
        grad_A = torch.zeros_like(A)
        grad_h = grad_last.clone()  # dL/dh after the current chunk (autograd passes zeros if unused)
        for chunk in reversed(range(len(checkpoints))):
            steps = slice(chunk * _SCAN_CHECKPOINT_STEPS, (chunk + 1) * _SCAN_CHECKPOINT_STEPS)
            h_before = checkpoints[chunk]
            u_c, dt_c, B_c, C_c, grad_y_c = u[steps], dt[steps], B[steps], C[steps], grad_y[steps]
            states, decays = _scan_chunk_states(h_before, u_c, dt_c, A, B_c)
            # dL/dh_t for every step of the chunk: the y_t term, then the reverse recurrence.
            grad_states = grad_y_c.unsqueeze(-1) * C_c.unsqueeze(3)  # (c, batch, G, P, N)
            grad_states[-1].add_(grad_h)
            for i in reversed(range(grad_states.shape[0] - 1)):
                grad_states[i].addcmul_(decays[i + 1], grad_states[i + 1])
            grad_h = decays[0] * grad_states[0]  # dL/dh before the chunk

            x = dt_c * u_c  # (c, batch, G, P): the scalar input of each step
            grad_C[steps] = (grad_y_c.unsqueeze(-1) * states).sum(3)
            grad_B[steps] = (grad_states * x.unsqueeze(-1)).sum(3)
            grad_x = (grad_states * B_c.unsqueeze(3)).sum(-1)  # (c, batch, G, P)
            # dL/d(dt_t A) = dL/dh_t * h_{t-1} * exp(dt_t A)
            grad_log_decay = grad_states * decays
            grad_log_decay[1:] *= states[:-1]
            grad_log_decay[0] *= h_before
            grad_dt[steps] = (grad_log_decay * A).sum(-1) + grad_x * u_c
            grad_u[steps] = grad_x * dt_c
            grad_A += (grad_log_decay * dt_c.unsqueeze(-1)).sum((0, 1))
        return grad_u, grad_dt, grad_A, grad_B, grad_C, grad_h


def _check_scan_params(
    dim: int,
    d_state: int,
    A,
    B,
    C,
    D,
    bias,
    *,
    bc_ndims: tuple[int, ...],
    batch: int,
    bias_name: str = "delta_bias",
):
    """Validate the shared selective-scan parameters; returns the number of B/C groups. ``bias_name``
    is the op's name for the dt bias (``delta_bias`` or ``dt_bias``), for the error messages."""
    if d_state < 1:
        raise ValueError(f"d_state (A's second dim, the state size N) must be >= 1, got {d_state}")
    _check_tensor("A", A, 2)
    if A.shape[0] != dim:
        raise ValueError(f"A must be (dim, d_state) with dim = {dim}, got {tuple(A.shape)}")
    _check_tensor("B", B, bc_ndims)
    _check_tensor("C", C, bc_ndims)
    if B.shape != C.shape:
        raise ValueError(f"B and C must have the same shape, got {tuple(B.shape)} and {tuple(C.shape)}")
    grouped = B.ndim == bc_ndims[1]
    groups = B.shape[1] if grouped else 1
    n_axis = 2 if grouped else 1
    if B.shape[0] != batch or B.shape[n_axis] != d_state:
        raise ValueError(
            f"B and C must have batch {batch} and d_state {d_state} (A is (dim, d_state)), got {tuple(B.shape)}"
        )
    if groups < 1 or dim % groups != 0:
        raise ValueError(f"the number of B/C groups ({groups}) must divide dim ({dim})")
    for name, t in (("D", D), (bias_name, bias)):
        if t is not None:
            _check_tensor(name, t, 1)
            if t.shape[0] != dim:
                raise ValueError(f"{name} must have shape (dim,) = ({dim},), got {tuple(t.shape)}")
    return groups


def _check_selective_scan_args(
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus=False, return_last_state=False
):
    """Validate selective_scan's arguments (shared by the reference and the Triton backend).

    Returns ``(batch, dim, seqlen, d_state, groups)``.
    """
    _check_bool("delta_softplus", delta_softplus)
    _check_bool("return_last_state", return_last_state)
    _check_tensor("u", u, 3)
    batch, dim, seqlen = u.shape
    _check_tensor("delta", delta, 3)
    if delta.shape != u.shape:
        raise ValueError(
            f"delta must have u's shape (batch, dim, L) = {tuple(u.shape)}, got {tuple(delta.shape)}"
        )
    if z is not None:
        _check_tensor("z", z, 3)
        if z.shape != u.shape:
            raise ValueError(
                f"z must have u's shape (batch, dim, L) = {tuple(u.shape)}, got {tuple(z.shape)}"
            )
    _check_tensor("A", A, 2)
    d_state = A.shape[1]
    groups = _check_scan_params(dim, d_state, A, B, C, D, delta_bias, bc_ndims=(3, 4), batch=batch)
    if B.shape[-1] != seqlen:
        raise ValueError(f"B and C must have L = {seqlen} steps in their last dim, got {tuple(B.shape)}")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 3)
        if initial_state.shape != (batch, dim, d_state):
            raise ValueError(
                f"initial_state must be (batch, dim, d_state) = {(batch, dim, d_state)}, got {tuple(initial_state.shape)}"
            )
    _check_same_device(
        "selective_scan", u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
        initial_state=initial_state,
    )  # fmt: skip
    return batch, dim, seqlen, d_state, groups


def _check_selective_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=False):
    """Validate selective_state_update's arguments (shared by the reference and the Triton backend).

    Returns ``(batch, dim, d_state, groups)``.
    """
    _check_bool("dt_softplus", dt_softplus)
    _check_tensor("state", state, 3)
    if state.dtype not in (torch.float32, torch.float64):
        # A 16-bit state would round the sum of every step so far at each step (0.2-0.35% after 300).
        raise TypeError(
            f"state must be float32 (or float64), got {state.dtype}: it accumulates every step; allocate it "
            "with dtype=torch.float32"
        )
    batch, dim, d_state = state.shape
    for name, t in (("x", x), ("dt", dt), ("z", z)):
        if t is not None or name != "z":
            _check_tensor(name, t, 2)
            if t.shape != (batch, dim):
                raise ValueError(
                    f"{name} must be (batch, dim) = {(batch, dim)} like state, got {tuple(t.shape)}"
                )
    _check_updated_in_place(state=state)
    _check_tensor("A", A, 2)
    if A.shape[1] != d_state:
        raise ValueError(
            f"state is (batch, dim, d_state) = {tuple(state.shape)} with d_state {d_state}, but A is "
            f"(dim, d_state) = {tuple(A.shape)} with d_state {A.shape[1]}; A sets the state size: "
            f"pass a state of shape (batch, dim, {A.shape[1]}) (e.g. a cache allocated by the mixer "
            "that owns A)"
        )
    groups = _check_scan_params(
        dim, d_state, A, B, C, D, dt_bias, bc_ndims=(2, 3), batch=batch, bias_name="dt_bias"
    )
    inputs = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias}
    _check_same_device("selective_state_update", state=state, **inputs)
    _check_read_apart({"state": state}, inputs)
    return batch, dim, d_state, groups


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
    """Selective state-space scan with mamba_ssm's ``selective_scan_fn`` semantics.

    Follows Mamba (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
    Spaces", Algorithm 2 and eq. 2a-2b, zero-order-hold discretisation of A and Euler for B):

        dt = delta (+ delta_bias) (softplus if delta_softplus)
        h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t,   h_0 = initial_state (zeros if None)
        y_t = C_t . h_t + D u_t,   then y *= silu(z)

    Args:
        u: (batch, dim, L) input.
        delta: (batch, dim, L) step sizes dt before bias / softplus.
        A: (dim, d_state) state matrix (diagonal per channel; negative for a decaying state).
        B: (batch, d_state, L), or grouped (batch, G, d_state, L) with G dividing dim: group g
            serves channels g * dim / G ... (g + 1) * dim / G - 1.
        C: same shape as B.
        D: (dim,) skip connection, or None.
        z: (batch, dim, L) gate, or None.
        delta_bias: (dim,) added to delta, or None.
        delta_softplus: apply softplus to dt.
        return_last_state: also return h_L.
        initial_state: (batch, dim, d_state) h_0, float32 (float64 for float64 inputs), or None.

    Computes in float32 (float64 when u is float64); every floating input is cast to that dtype.
    Differentiable w.r.t. u, delta, A, B, C, D, z, delta_bias and initial_state.

    Returns:
        y (batch, dim, L) in u's dtype; with return_last_state also last_state
        (batch, dim, d_state) in the compute dtype.

    Raises:
        TypeError: non-tensor or non-floating inputs; delta_softplus or return_last_state not a bool.
        ValueError: wrong ndim or any shape mismatch, G not dividing dim, tensors on different
            devices.
    """
    batch, dim, _, d_state, groups = _check_selective_scan_args(
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, return_last_state
    )

    dtype = _compute_dtype(u.dtype)
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    if B.ndim == 3:
        B, C = B.unsqueeze(1), C.unsqueeze(1)  # (batch, 1, d_state, L)
    if initial_state is None:
        h0 = u.new_zeros(batch, groups, dim // groups, d_state, dtype=dtype)
    else:
        h0 = rearrange(initial_state.to(dtype), "b (g p) n -> b g p n", g=groups)

    # Time-major, contiguous layouts so each step of the loop reads one contiguous slab.
    y, last_state = _SelectiveScanRecurrence.apply(
        rearrange(u.to(dtype), "b (g p) l -> l b g p", g=groups).contiguous(),
        rearrange(dt, "b (g p) l -> l b g p", g=groups).contiguous(),
        rearrange(A.to(dtype), "(g p) n -> g p n", g=groups).contiguous(),
        rearrange(B.to(dtype), "b g n l -> l b g n").contiguous(),
        rearrange(C.to(dtype), "b g n l -> l b g n").contiguous(),
        h0.contiguous(),
    )
    y = rearrange(y, "l b g p -> b (g p) l")  # (batch, dim, L)
    if D is not None:
        y = y + D.to(dtype)[:, None] * u.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(u.dtype)
    if not return_last_state:
        return y
    return y, rearrange(last_state, "b g p n -> b (g p) n")


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
    """One recurrent decode step of the selective scan, updating ``state`` in place.

    Follows Mamba (Gu & Dao 2023, eq. 2a-2b; mamba_ssm's selective_state_update), one step of
    :func:`selective_scan`:

        dt = dt (+ dt_bias) (softplus if dt_softplus)
        state = exp(dt A) * state + dt B x,   y = C . state + D x,   y *= silu(z)

    Args:
        state: (batch, dim, d_state) float32 (or float64) SSM state; overwritten with the new state.
        x: (batch, dim) input of this step.
        dt: (batch, dim) step size before bias / softplus.
        A: (dim, d_state).
        B, C: (batch, d_state) or grouped (batch, G, d_state) with G dividing dim.
        D: (dim,) or None.   z: (batch, dim) or None.   dt_bias: (dim,) or None.
        dt_softplus: apply softplus to dt.

    Computes in float32 (float64 when x or state is float64).

    Returns:
        y (batch, dim) in x's dtype.

    Raises:
        TypeError: non-tensor or non-floating inputs; a state that is not float32 / float64;
            dt_softplus not a bool.
        ValueError: wrong ndim or any shape mismatch (a state whose d_state is not A's names both),
            G not dividing dim, tensors on different devices, an input that shares memory with the
            state, a state whose elements overlap in memory.
    """
    batch, dim, d_state, groups = _check_selective_state_update_args(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus
    )

    dtype = torch.float64 if torch.float64 in (x.dtype, state.dtype) else torch.float32
    step = dt.to(dtype)
    if dt_bias is not None:
        step = step + dt_bias.to(dtype)
    if dt_softplus:
        step = F.softplus(step)
    Bg = B.to(dtype).reshape(batch, groups, 1, d_state)  # (batch, G, 1, N)
    Cg = C.to(dtype).reshape(batch, groups, 1, d_state)
    # A copy even in state's dtype: autograd saves h, and state is overwritten below.
    h = rearrange(state.to(dtype, copy=True), "b (g p) n -> b g p n", g=groups)
    step_g = rearrange(step, "b (g p) -> b g p", g=groups)
    x_g = rearrange(x.to(dtype), "b (g p) -> b g p", g=groups)
    h = torch.exp(step_g.unsqueeze(-1) * rearrange(A.to(dtype), "(g p) n -> g p n", g=groups)) * h
    h = h + (step_g * x_g).unsqueeze(-1) * Bg  # (batch, G, P, N)
    y = rearrange((h * Cg).sum(-1), "b g p -> b (g p)")  # (batch, dim)
    state.copy_(rearrange(h, "b g p n -> b (g p) n"))
    if D is not None:
        y = y + D.to(dtype) * x.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Causal depthwise conv1d (Mamba's short convolution)
# ----------------------------------------------------------------------------------------------


def _check_conv_activation(activation) -> None:
    if not (activation is None or (isinstance(activation, str) and activation == "silu")):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")


def _check_conv_weight_bias(dim: int, weight, bias) -> int:
    """Validate the conv's weight (dim, width) and bias (dim,) or None; returns the width."""
    _check_tensor("weight", weight, 2)
    if weight.shape[0] != dim:
        raise ValueError(f"weight must be (dim, width) with dim = {dim}, got {tuple(weight.shape)}")
    width = weight.shape[1]
    if width <= 0:
        raise ValueError(f"weight must have at least one tap (width >= 1), got shape {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, 1)
        if bias.shape[0] != dim:
            raise ValueError(f"bias must have shape (dim,) = ({dim},), got {tuple(bias.shape)}")
        _check_same_dtype(weight=weight, bias=bias)
    return width


def _check_causal_conv1d_args(x, weight, bias, activation):
    """Validate causal_conv1d's arguments (shared by the reference and the Triton backend).

    Returns ``(batch, dim, seqlen, width)``.
    """
    _check_tensor("x", x, 3)
    batch, dim, seqlen = x.shape
    width = _check_conv_weight_bias(dim, weight, bias)
    _check_conv_activation(activation)
    _check_same_device("causal_conv1d", x=x, weight=weight, bias=bias)
    return batch, dim, seqlen, width


def _check_causal_conv1d_update_args(x, conv_state, weight, bias, activation):
    """Validate causal_conv1d_update's arguments (shared by the reference and the Triton backend).

    Returns ``(batch, dim, width)``.
    """
    _check_tensor("x", x, 2)
    _check_tensor("conv_state", conv_state, 3)
    batch, dim = x.shape
    width = _check_conv_weight_bias(dim, weight, bias)
    if conv_state.shape != (batch, dim, width):
        raise ValueError(
            f"conv_state must be (batch, dim, width) = {(batch, dim, width)} for x (batch, dim) = "
            f"{(batch, dim)} and weight (dim, width) = {tuple(weight.shape)}, got {tuple(conv_state.shape)}"
        )
    _check_updated_in_place(conv_state=conv_state)
    _check_conv_activation(activation)
    _check_same_device("causal_conv1d_update", x=x, conv_state=conv_state, weight=weight, bias=bias)
    _check_read_apart({"conv_state": conv_state}, {"x": x, "weight": weight, "bias": bias})
    return batch, dim, width


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal depthwise 1-D convolution over time, with an optional fused silu.

    The short convolution of the Mamba block (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling
    with Selective State Spaces", Fig. 3 and Sec. 3.4), with the semantics of ``causal_conv1d_fn``
    from Dao's causal-conv1d package that mamba_ssm calls (x (batch, dim, L), weight (dim, width)):

        y[b, d, t] = act(bias[d] + sum_j weight[d, j] * x[b, d, t - (width - 1) + j])

    with x = 0 before t = 0 (zero left padding), act the identity or silu.

    The taps are written out as ``width`` shifted multiply-adds rather than ``F.conv1d``: PyTorch's
    CPU depthwise conv loops over channels in parallel regions (float64 falls back to a per-channel
    slow convolution), which costs milliseconds per call at test sizes.

    Args:
        x: (batch, dim, L) input, float16 / bfloat16 / float32 / float64, any strides.
        weight: (dim, width) taps, width >= 1 (Mamba uses 2-4); weight[:, -1] multiplies the current
            step. Any floating dtype (e.g. float32 parameters with 16-bit activations under autocast).
        bias: (dim,) in weight's dtype, or None.
        activation: None or "silu".

    Computes in float32 (float64 when x is float64); weight and bias are cast to that dtype.
    Differentiable w.r.t. x, weight and bias.

    Returns:
        y (batch, dim, L) in x's dtype.

    Raises:
        TypeError: non-tensor or non-floating inputs, bias of another dtype than weight.
        ValueError: x not 3-D, weight not (dim, width) or with width 0, bias not (dim,), an
            activation other than None / "silu", tensors on different devices.
    """
    _, _, seqlen, width = _check_causal_conv1d_args(x, weight, bias, activation)

    dtype = _compute_dtype(x.dtype)
    w = weight.to(dtype)
    # Zero left-padding of width - 1 makes the convolution causal.
    x_padded = F.pad(x.to(dtype), (width - 1, 0))  # (batch, dim, width - 1 + L)
    out = w[:, 0, None] * x_padded[..., :seqlen]  # (batch, dim, L)
    for j in range(1, width):
        out = out + w[:, j, None] * x_padded[..., j : j + seqlen]
    if bias is not None:
        out = out + bias.to(dtype)[:, None]
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One decode step of :func:`causal_conv1d`, updating the cached window in place.

    The recurrent form of the causal conv (mamba_simple.py's ``step``; causal-conv1d's
    ``causal_conv1d_update`` with a window of exactly ``width`` inputs): shift the window left by
    one, append x, then

        y[b, d] = act(bias[d] + sum_j weight[d, j] * conv_state[b, d, j])

    Args:
        x: (batch, dim) the new input.
        conv_state: (batch, dim, width) the last ``width`` inputs, oldest first (the mixers' cache:
            float32, float64 for float64 models); any strides. Overwritten with the shifted window;
            x is stored in the state's dtype and the dot product reads it back from there.
        weight: (dim, width).   bias: (dim,) in weight's dtype, or None.
        activation: None or "silu".

    Computes in float32 (float64 when x or conv_state is float64).

    Returns:
        y (batch, dim) in x's dtype.

    Raises:
        TypeError: non-tensor or non-floating inputs, bias of another dtype than weight.
        ValueError: wrong ndim, weight not (dim, width) or with width 0, bias not (dim,),
            conv_state not (batch, dim, width) or an expanded view (stride 0: its rows would share
            memory), an input that shares memory with conv_state, tensors on different devices, an
            activation other than None / "silu".
    """
    _check_causal_conv1d_update_args(x, conv_state, weight, bias, activation)

    dtype = torch.float64 if torch.float64 in (x.dtype, conv_state.dtype) else torch.float32
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = torch.einsum("bdw,dw->bd", conv_state.to(dtype), weight.to(dtype))  # (batch, dim)
    if bias is not None:
        out = out + bias.to(dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Linear attention
# ----------------------------------------------------------------------------------------------


def _describe(state) -> str:
    if isinstance(state, torch.Tensor):
        return f"a single tensor of shape {tuple(state.shape)}"
    if isinstance(state, (tuple, list)):
        return f"a {type(state).__name__} of {len(state)} items"
    return type(state).__name__


def _split_linear_state(initial_state, normalize: bool, q: torch.Tensor, v_dim: int):
    """Validate a linear-attention state for the (B, T, H, K) ``q`` and return (kv, z) (z is None
    without normalisation)."""
    batch, _, num_heads, k_dim = q.shape
    if normalize:
        if isinstance(initial_state, torch.Tensor) or not (
            isinstance(initial_state, (tuple, list)) and len(initial_state) == 2
        ):
            raise TypeError(
                "with normalize=True, initial_state must be the pair (kv (B, H, K, V), z (B, H, K)) returned "
                f"by linear_attention(..., output_final_state=True), got {_describe(initial_state)}"
            )
        kv, z = initial_state
        if z is None:  # a fresh normaliser state is zeros, not None: say so rather than guess
            raise TypeError(
                "with normalize=True, initial_state's z must be a (B, H, K) tensor, got None; pass the pair "
                "returned by linear_attention(..., output_final_state=True) (or torch.zeros(B, H, K) for a "
                "fresh normaliser)"
            )
    else:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(
                f"with normalize=False, initial_state must be the tensor kv (B, H, K, V), got {_describe(initial_state)}"
            )
        kv, z = initial_state, None
    _check_tensor("initial_state kv", kv, 4)
    if kv.shape != (batch, num_heads, k_dim, v_dim):
        raise ValueError(
            f"initial_state kv must be (B, H, K, V) = {(batch, num_heads, k_dim, v_dim)}, got {tuple(kv.shape)}"
        )
    if z is not None:
        _check_tensor("initial_state z", z, 3)
        if z.shape != (batch, num_heads, k_dim):
            raise ValueError(
                f"initial_state z must be (B, H, K) = {(batch, num_heads, k_dim)}, got {tuple(z.shape)}"
            )
    _check_same_device("linear_attention", **{"q": q, "initial_state kv": kv, "initial_state z": z})
    return kv, z


def _check_linear_attention_args(q, k, v, scale, normalize=True, eps=1e-10, output_final_state=False):
    """Validate linear_attention's q, k, v, scale, normalize, eps and output_final_state (shared by the
    reference and the Triton backend).

    Returns ``(batch, seqlen, num_heads, k_dim, v_dim, scale)`` with the default scale
    ``k_dim ** -0.5`` filled in. The initial state is checked by :func:`_split_linear_state`.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_same_dtype(q=q, k=k, v=v)
    _check_same_device("linear_attention", q=q, k=k, v=v)
    _check_scale(scale, q.dtype)
    _check_bool("normalize", normalize)
    _check_bool("output_final_state", output_final_state)
    _check_eps(eps)
    if k.shape != q.shape:
        raise ValueError(
            f"q and k must have the same shape (B, T, H, K), got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    batch, seqlen, num_heads, k_dim = q.shape
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must be (B, T, H, V) with (B, T, H) = {tuple(q.shape[:3])}, got {tuple(v.shape)}"
        )
    v_dim = v.shape[3]
    if scale is None:
        scale = _default_scale(k_dim, "K")
    return batch, seqlen, num_heads, k_dim, v_dim, scale


def _default_scale(dim: int, name: str) -> float:
    """``dim ** -0.5``, the default score scale (attention's head_dim, linear attention's K);
    ValueError for ``dim`` = 0, which has none (``name`` says which dim, for the message)."""
    if dim == 0:
        raise ValueError(f"{name} is 0, so the default scale {name} ** -0.5 is undefined; pass scale=")
    return dim**-0.5


def _check_linear_attention_step_args(q, k, v, state, z_state, scale, eps=1e-10):
    """Validate linear_attention_step's arguments (shared by the reference and the Triton backend).

    Returns the scale, with the default ``k_dim ** -0.5`` filled in.
    """
    _check_tensor("q", q, 3)
    _check_tensor("k", k, 3)
    _check_tensor("v", v, 3)
    if isinstance(state, (tuple, list)):
        raise TypeError(
            "state must be the (B, H, K, V) tensor, got a pair: linear_attention(..., normalize=True) "
            "returns its state as (kv, z); pass linear_attention_step(q, k, v, kv, z_state=z)"
        )
    _check_tensor("state", state, 4)
    _check_same_dtype(q=q, k=k, v=v)
    _check_scale(scale, q.dtype)
    _check_eps(eps)
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k must be (B, H, K) and v (B, H, V) with equal (B, H), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, num_heads, k_dim = q.shape
    expected = (batch, num_heads, k_dim, v.shape[2])
    if state.shape != expected:
        raise ValueError(f"state must be (B, H, K, V) = {expected}, got {tuple(state.shape)}")
    if z_state is not None:
        _check_tensor("z_state", z_state, 3)
        if z_state.shape != q.shape:
            raise ValueError(f"z_state must be (B, H, K) = {tuple(q.shape)}, got {tuple(z_state.shape)}")
    for name, t in (("state", state), ("z_state", z_state)):
        # The running sums grow with every token: 16-bit states lose the new token's update to
        # rounding (bf16: relative error ~0.1 after 2000 steps).
        if t is not None and t.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"{name} must be float32 (or float64), got {t.dtype}; allocate it with dtype=torch.float32"
            )
    _check_same_device("linear_attention_step", q=q, k=k, v=v, state=state, z_state=z_state)
    _check_updated_in_place(state=state, z_state=z_state)
    _check_read_apart({"state": state, "z_state": z_state}, {"q": q, "k": k, "v": v})
    if scale is None:
        scale = _default_scale(k_dim, "K")
    return scale


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
    """Causal linear attention over feature-mapped queries and keys.

    Follows Katharopoulos et al. 2020, "Transformers are RNNs" (eq. 4-6), in the chunked form of
    fla's ``chunk_linear_attn``: within a chunk the quadratic form ``tril(scale q k^T) v``, across
    chunks the state ``S = sum_s k_s v_s^T``. Exact (no approximation):

        o_t = scale q_t . (S_0 + sum_{s<=t} k_s v_s^T)
        with normalize: o_t /= scale q_t . (z_0 + sum_{s<=t} k_s) + eps

    Non-finite values follow IEEE arithmetic in the chunked product, as in the Triton kernel: a NaN or
    infinite entry of v at position s also reaches the rows t < s of its chunk (0 * NaN in the masked
    ``tril(q k^T) v``), not only the rows t >= s of the formula above; one of k reaches only those
    (the scores are masked with a select, not a product).

    Args:
        q: (B, T, H, K) feature-mapped queries.
        k: (B, T, H, K) feature-mapped keys, same dtype as q.
        v: (B, T, H, V) values, same dtype as q.
        scale: defaults to ``K ** -0.5``.
        normalize: divide by the normaliser above.
        eps: added to the normaliser (>= 0; with 0 a row whose normaliser is 0, e.g. relu
            features that are all zero, comes out NaN: the default 1e-10 avoids that).
        initial_state: kv (B, H, K, V) when normalize=False, the pair (kv, z (B, H, K)) when
            normalize=True, or None (zeros); float32 (float64 for float64 inputs).
        output_final_state: also return the state after the last token, in the same form.

    Returns:
        o (B, T, H, V) in q's dtype, or (o, final_state) with output_final_state; the state is in
        the compute dtype (float32, float64 for float64 inputs).

    Raises:
        TypeError: non-tensor / non-floating inputs, mismatched dtypes, the wrong state form for
            ``normalize`` (e.g. a bare tensor with normalize=True), a scale or eps that is not a
            number, a normalize or output_final_state that is not a bool.
        ValueError: wrong ndim or mismatched shapes, tensors on different devices, a non-finite
            scale, eps < 0 or not finite, K = 0 without an explicit scale.
    """
    batch, seqlen, num_heads, k_dim, v_dim, scale = _check_linear_attention_args(
        q, k, v, scale, normalize, eps, output_final_state
    )

    dtype = _compute_dtype(q.dtype)
    if initial_state is None:
        kv = q.new_zeros(batch, num_heads, k_dim, v_dim, dtype=dtype)
        z = q.new_zeros(batch, num_heads, k_dim, dtype=dtype) if normalize else None
    else:
        kv, z = _split_linear_state(initial_state, normalize, q, v_dim)
        kv = kv.to(dtype)
        z = z.to(dtype) if z is not None else None

    qh = rearrange(q.to(dtype), "b t h k -> b h t k") * scale
    kh = rearrange(k.to(dtype), "b t h k -> b h t k")
    vh = rearrange(v.to(dtype), "b t h v -> b h t v")
    outputs = []
    pos = torch.arange(_LINEAR_ATTENTION_CHUNK_SIZE, device=q.device)
    # Built by comparison rather than torch.tril, whose CPU kernel is slow on tiny chunks.
    causal = pos[:, None] >= pos[None, :]  # (C, C): query t sees keys s <= t of its chunk
    for start in range(0, seqlen, _LINEAR_ATTENTION_CHUNK_SIZE):
        qc, kc, vc = (t[:, :, start : start + _LINEAR_ATTENTION_CHUNK_SIZE] for t in (qh, kh, vh))
        size = qc.shape[2]
        scores = torch.where(causal[:size, :size], qc @ kc.transpose(-1, -2), 0)  # (B, H, C, C)
        out = scores @ vc + qc @ kv  # (B, H, C, V)
        if normalize:
            # scale q_t . (z_0 + sum_{s<=t} k_s): the in-chunk part is the row sum of the scores.
            out = out / (scores.sum(-1, keepdim=True) + qc @ z.unsqueeze(-1) + eps)
            z = z + kc.sum(2)
        kv = kv + kc.transpose(-1, -2) @ vc
        outputs.append(out)
    # With T = 0 there is no chunk: the empty output still comes from q, k, v (connected to
    # autograd, empty gradients), as the other backend's does.
    o = torch.cat(outputs, dim=2) if outputs else (qh.sum(-1, keepdim=True) + kh.sum(-1, keepdim=True)) * vh
    o = rearrange(o, "b h t v -> b t h v").to(q.dtype)
    if not output_final_state:
        return o
    return o, ((kv, z) if normalize else kv)


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
    """One recurrent decode step of causal linear attention, updating the state in place.

    Follows Katharopoulos et al. 2020, "Transformers are RNNs", eq. 5-6 (the RNN form):

        state += k v^T;  o = scale q . state
        with z_state:  z_state += k;  o /= scale q . z_state + eps

    Args:
        q: (B, H, K) feature-mapped query.   k: (B, H, K) feature-mapped key.   v: (B, H, V).
        state: (B, H, K, V) float32 (float64) kv state, updated in place.
        scale: defaults to ``K ** -0.5``.
        z_state: (B, H, K) normaliser state updated in place; normalises exactly when given.
        eps: added to the normaliser (>= 0; with 0 a row whose normaliser is 0, e.g. relu
            features that are all zero, comes out NaN: the default 1e-10 avoids that).

    Computes in float32 (float64 when q or the state is float64).

    Returns:
        (B, H, V) in q's dtype.

    Raises:
        TypeError: non-tensor / non-floating inputs or mismatched q / k / v dtypes, a state or
            z_state that is not float32 / float64, a scale or eps that is not a number.
        ValueError: wrong ndim or mismatched shapes, tensors on different devices, states that
            share memory with each other or with q / k / v, a non-finite scale, eps < 0 or not
            finite, K = 0 without an explicit scale.
    """
    scale = _check_linear_attention_step_args(q, k, v, state, z_state, scale, eps)

    dtype = torch.float64 if torch.float64 in (q.dtype, state.dtype) else torch.float32
    qs = q.to(dtype) * scale
    kf = k.to(dtype)
    kv = state.to(dtype) + kf.unsqueeze(-1) * v.to(dtype).unsqueeze(-2)  # (B, H, K, V)
    state.copy_(kv)
    out = torch.einsum("bhk,bhkv->bhv", qs, kv)
    if z_state is not None:
        z = z_state.to(dtype) + kf
        z_state.copy_(z)
        out = out / ((qs * z).sum(-1, keepdim=True) + eps)
    return out.to(q.dtype)

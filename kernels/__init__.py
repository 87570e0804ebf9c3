"""Kernel ops: the functional API every mixer calls (DESIGN.md, contract 1).

Each op takes the same arguments as its twin in :mod:`kernels.reference` plus a keyword
``backend``:

- ``None``: pick the implementation for the tensors' device. Triton kernels for CUDA tensors are
  registered here as they land; until then (and always for CPU tensors) this is the reference.
- ``"reference"``: force the pure-PyTorch reference (:mod:`kernels.reference`).
- ``"triton"``: force the Triton kernel; raises ``NotImplementedError`` while the op has none.
- anything else: ``ValueError`` listing the valid backends.

A Triton kernel is plugged in by adding it to ``_TRITON_OPS`` under the op's name.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from kernels import reference

# Triton is a Linux-only dependency; elsewhere every op runs its reference. The kernel modules must be
# imported before the ``def flash_attention`` / ``def linear_attention`` below: importing the submodule
# ``kernels.flash_attention`` binds that name on this package, and the public function has to be
# what the name ends up meaning.
if importlib.util.find_spec("triton") is not None:
    from kernels.causal_conv1d import causal_conv1d as _triton_causal_conv1d
    from kernels.causal_conv1d import causal_conv1d_update as _triton_causal_conv1d_update
    from kernels.flash_attention import flash_attention as _triton_flash_attention
    from kernels.flash_decode import flash_decode as _triton_flash_decode
    from kernels.flash_decode import reserve_split_counters as _reserve_split_counters
    from kernels.linear_attention import linear_attention as _triton_linear_attention
    from kernels.linear_attention import linear_attention_step as _triton_linear_attention_step
    from kernels.selective_scan import selective_scan as _triton_selective_scan
    from kernels.selective_scan import selective_state_update as _triton_selective_state_update
else:  # pragma: no cover
    _triton_flash_attention = _triton_linear_attention = _triton_linear_attention_step = None
    _triton_flash_decode = _reserve_split_counters = None
    _triton_selective_scan = _triton_selective_state_update = None
    _triton_causal_conv1d = _triton_causal_conv1d_update = None

# The ops (DESIGN.md); prepare_graph_capture below is a helper for CUDA-graph capture, not an op.
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

# The values every op's ``backend`` keyword accepts.
BACKENDS = (None, "reference", "triton")

# Op name -> Triton implementation with the reference's signature; ops not listed run the reference.
_TRITON_OPS: dict[str, Callable] = {}

if _triton_flash_attention is not None:
    _TRITON_OPS["flash_attention"] = _triton_flash_attention  # kernels/flash_attention.py (FlashAttention-2)
if _triton_flash_decode is not None:
    _TRITON_OPS["flash_decode"] = _triton_flash_decode  # kernels/flash_decode.py (FlashDecoding, split-K)
if _triton_linear_attention is not None:  # kernels/linear_attention.py (chunked form, recurrent step)
    _TRITON_OPS["linear_attention"] = _triton_linear_attention
    _TRITON_OPS["linear_attention_step"] = _triton_linear_attention_step
if _triton_selective_scan is not None:  # kernels/selective_scan.py (chunked scan, checkpointed backward)
    _TRITON_OPS["selective_scan"] = _triton_selective_scan
    _TRITON_OPS["selective_state_update"] = _triton_selective_state_update
if _triton_causal_conv1d is not None:  # kernels/causal_conv1d.py (register window, decode update)
    _TRITON_OPS["causal_conv1d"] = _triton_causal_conv1d
    _TRITON_OPS["causal_conv1d_update"] = _triton_causal_conv1d_update


def _dispatch(op_name: str, backend: str | None, tensor: torch.Tensor) -> Callable:
    """Return the implementation of ``op_name`` for ``backend`` and the device of ``tensor``.

    Raises:
        ValueError: ``backend`` is not one of None, "reference", "triton".
        NotImplementedError: ``backend="triton"`` for an op whose Triton kernel has not landed.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"{op_name}: unknown backend {backend!r}; valid backends are None, 'reference', 'triton'"
        )
    if backend == "reference":
        return getattr(reference, op_name)
    if backend == "triton":
        if op_name not in _TRITON_OPS:
            raise NotImplementedError(
                f"{op_name}: the Triton kernel has not landed yet; use backend='reference' (or backend=None)"
            )
        return _TRITON_OPS[op_name]
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda and op_name in _TRITON_OPS:
        return _TRITON_OPS[op_name]
    return getattr(reference, op_name)


def prepare_graph_capture(stream: torch.cuda.Stream) -> None:
    """Make, before a CUDA graph is captured on ``stream``, what the Triton ops keep per stream:
    :func:`kernels.flash_decode.reserve_split_counters` (its split counters, for launches of up to
    4096 (sequence, KV head) pairs), so the graph does not zero-fill buffers of its own at every
    replay. Nothing to do without Triton.

    Raises:
        TypeError: ``stream`` is not a ``torch.cuda.Stream``.
        RuntimeError: called while a graph is being captured.
    """
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(
            f"prepare_graph_capture: stream must be a torch.cuda.Stream, got {type(stream).__name__}"
        )
    if _reserve_split_counters is not None:
        _reserve_split_counters(stream)


def flash_attention(q, k, v, *, causal=True, window=None, scale=None, return_lse=False, backend=None):
    """Exact masked softmax attention; see :func:`kernels.reference.flash_attention` for shapes,
    dtypes, masking semantics, errors and sources.

    q (B, Tq, Hq, D), k / v (B, Tk, Hkv, D) -> o (B, Tq, Hq, D) in q's dtype [, lse (B, Hq, Tq)].
    ``backend``: None (the Triton FlashAttention-2 kernel, :mod:`kernels.flash_attention`, for CUDA
    tensors; the reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``); anything else is a ValueError.
    Differentiable once, on both backends: no double backward (a gradient taken through it with
    ``torch.autograd.grad(..., create_graph=True)`` cannot be differentiated again; the reference
    calls PyTorch's fused attention, whose CPU backward has no derivative of its own, except where
    the lse is asked for).
    """
    impl = _dispatch("flash_attention", backend, q)
    return impl(q, k, v, causal=causal, window=window, scale=scale, return_lse=return_lse)


def flash_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seqlens,
    *,
    window=None,
    scale=None,
    num_splits=None,
    check_values=True,
    backend=None,
):
    """Paged-KV-cache decode attention; see :func:`kernels.reference.flash_decode` for shapes,
    dtypes, paging semantics, errors and sources.

    q (B, Hq, D), caches (num_blocks, block_size, Hkv, D), block_table (B, max_blocks) int32,
    seqlens (B,) int32 -> (B, Hq, D) in q's dtype.
    ``backend``: None (the split-K FlashDecoding kernel, :mod:`kernels.flash_decode`, for CUDA
    tensors; the reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``; not differentiable, it is the decode path); anything else is a
    ValueError.
    """
    impl = _dispatch("flash_decode", backend, q)
    return impl(
        q,
        k_cache,
        v_cache,
        block_table,
        seqlens,
        window=window,
        scale=scale,
        num_splits=num_splits,
        check_values=check_values,
    )


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    initial_state=None,
    *,
    backend=None,
):
    """Mamba selective scan (mamba_ssm selective_scan_fn semantics); see
    :func:`kernels.reference.selective_scan` for shapes, dtypes, errors and sources.

    u, delta, z (batch, dim, L); A (dim, N); B, C (batch, N, L) or (batch, G, N, L)
    -> y (batch, dim, L) in u's dtype [, last_state (batch, dim, N) fp32 / fp64].
    ``backend``: None (the Triton kernel, :mod:`kernels.selective_scan`, for CUDA tensors; the
    reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``); anything else is a ValueError.
    Differentiable once, on both backends: no double backward (a gradient taken through it with
    ``torch.autograd.grad(..., create_graph=True)`` cannot be differentiated again).
    """
    impl = _dispatch("selective_scan", backend, u)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, initial_state)


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *, backend=None
):
    """One selective-scan decode step, updating ``state`` in place; see
    :func:`kernels.reference.selective_state_update` for shapes, dtypes, errors and sources.

    state (batch, dim, N) fp32, x / dt / z (batch, dim), B / C (batch, N) or (batch, G, N)
    -> y (batch, dim) in x's dtype.
    ``backend``: None (the Triton kernel, :mod:`kernels.selective_scan`, for CUDA tensors; the
    reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``; not differentiable, it is the decode path); anything else is a
    ValueError.
    """
    impl = _dispatch("selective_state_update", backend, x)
    return impl(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def causal_conv1d(x, weight, bias=None, activation=None, *, backend=None):
    """Causal depthwise conv1d with an optional fused silu (causal-conv1d's ``causal_conv1d_fn``
    semantics, the Mamba block's conv); see :func:`kernels.reference.causal_conv1d` for shapes,
    dtypes, errors and sources.

    x (batch, dim, L), weight (dim, width), bias (dim,) or None, activation None or "silu"
    -> y (batch, dim, L) in x's dtype.
    ``backend``: None (the Triton kernel, :mod:`kernels.causal_conv1d`, for CUDA tensors; the
    reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``); anything else is a ValueError.
    The Triton kernel is differentiable once: no double backward (a gradient taken through it with
    ``torch.autograd.grad(..., create_graph=True)`` cannot be differentiated again).
    """
    impl = _dispatch("causal_conv1d", backend, x)
    return impl(x, weight, bias, activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *, backend=None):
    """One causal-conv1d decode step, updating ``conv_state`` in place; see
    :func:`kernels.reference.causal_conv1d_update` for shapes, dtypes, errors and sources.

    x (batch, dim), conv_state (batch, dim, width) (the last width inputs, oldest first; fp32 in the
    mixers' caches), weight (dim, width), bias (dim,) or None -> y (batch, dim) in x's dtype.
    ``backend``: None (the Triton kernel, :mod:`kernels.causal_conv1d`, for CUDA tensors; the
    reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``; not differentiable, it is the decode path); anything else is a
    ValueError.
    """
    impl = _dispatch("causal_conv1d_update", backend, x)
    return impl(x, conv_state, weight, bias, activation)


def linear_attention(
    q,
    k,
    v,
    *,
    scale=None,
    normalize=True,
    eps=1e-10,
    initial_state=None,
    output_final_state=False,
    backend=None,
):
    """Causal linear attention; see :func:`kernels.reference.linear_attention` for shapes, dtypes,
    state forms, errors and sources.

    q, k (B, T, H, K), v (B, T, H, V) -> o (B, T, H, V) in q's dtype [, final_state: kv (B, H, K, V)
    or (kv, z (B, H, K)) when normalize, fp32 / fp64].
    ``backend``: None (the chunked Triton kernel, :mod:`kernels.linear_attention`, for CUDA tensors;
    the reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``); anything else is a ValueError.
    The Triton kernel is differentiable once: no double backward (a gradient taken through it with
    ``torch.autograd.grad(..., create_graph=True)`` cannot be differentiated again).
    """
    impl = _dispatch("linear_attention", backend, q)
    return impl(
        q,
        k,
        v,
        scale=scale,
        normalize=normalize,
        eps=eps,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def linear_attention_step(q, k, v, state, *, scale=None, z_state=None, eps=1e-10, backend=None):
    """One linear-attention decode step, updating ``state`` (and ``z_state``) in place; see
    :func:`kernels.reference.linear_attention_step` for shapes, dtypes, errors and sources.

    q, k (B, H, K), v (B, H, V), state (B, H, K, V) fp32, z_state (B, H, K) or None
    -> (B, H, V) in q's dtype.
    ``backend``: None (the Triton decode kernel, :mod:`kernels.linear_attention`, for CUDA tensors;
    the reference for CPU tensors), "reference", "triton" (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``); anything else is a ValueError.
    """
    impl = _dispatch("linear_attention_step", backend, q)
    return impl(q, k, v, state, scale=scale, z_state=z_state, eps=eps)

"""Pieces shared by every mixer: the cache base class, input checks, dtype rules, causal conv.

The short causal depthwise convolution lives here because two mixers use it with a decode cache:
Mamba's conv on x (Gu & Dao 2023, Fig. 3) and the optional short convolutions on q, k, v of linear
attention (Based, Arora et al. 2024; fla's ShortConvolution). Its math runs in the kernel ops
`kernels.causal_conv1d` / `kernels.causal_conv1d_update`; this module adds the cache handling.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

import kernels


def check_input(x: torch.Tensor, d_model: int, mixer: str, weight: torch.Tensor) -> tuple[int, int]:
    """Check a mixer input and return its (batch, seqlen).

    Args:
        x: (B, T, d_model) float tensor on the mixer's device, in its weight dtype (any float dtype
            under autocast).
        d_model: the mixer's model width.
        mixer: the mixer's name, for the error message.
        weight: a parameter of the mixer (its first projection's weight), for its device and dtype.

    Raises:
        TypeError: x is not a floating-point tensor (e.g. token ids, which go through the model's
            embedding first) or is a nested one, or, outside autocast for x's device, its dtype is not
            weight's.
        ValueError: x is not 3-D, its last dim is not d_model, T == 0, or x is on another device
            than weight (which failed deep in torch, or ran on the meta device).
    """
    expected = f"a floating-point tensor of shape (B, T, d_model={d_model})"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{mixer}: x must be {expected}, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(
            f"{mixer}: x must be {expected}, got a nested tensor; pass sequences of one length "
            "(e.g. one call per length)"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"{mixer}: x must be {expected} in {weight.dtype}, got a {x.dtype} tensor of shape "
            f"{tuple(x.shape)}; token ids go through the model's embedding (models.LanguageModel), "
            "a mixer takes hidden states"
        )
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{mixer}: x must have shape (B, T, d_model={d_model}), got {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{mixer}: x has no tokens (T == 0); pass at least one token")
    if x.device != weight.device:
        raise ValueError(
            f"{mixer}: x is on {x.device} but the mixer's weights are on {weight.device}: move x with "
            f"x.to('{weight.device}') or the module with .to('{x.device}')"
        )
    # Under autocast (training's bf16-mixed) the matmuls cast x themselves; without it torch would
    # fail in the first projection with "mat1 and mat2 must have the same dtype".
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{mixer}: x is {x.dtype} but the mixer's weights are {weight.dtype}: cast x with "
            f"x.to({weight.dtype}) or the module with .to({x.dtype}); under autocast "
            "(torch.autocast) 16-bit inputs are fine"
        )
    return x.shape[0], x.shape[1]


def check_positive_int(value: object, name: str, mixer: str) -> int:
    """Return `value` if it is an int > 0.

    Raises:
        TypeError: value is not an int (bools are rejected too).
        ValueError: value <= 0.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{mixer}: {name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{mixer}: {name} must be > 0, got {value}")
    return value


def check_number(
    value: object, name: str, mixer: str, *, low: float = 0.0, low_inclusive: bool = False
) -> float:
    """Return ``value`` as a float if it is a finite real number above ``low`` (or equal to it with
    ``low_inclusive``).

    Raises:
        TypeError: value is not an int or float (bools and strings such as "1e-3" are rejected).
        ValueError: value is NaN, infinite or not above ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{mixer}: {name} must be a number, got {value!r}")
    above = value >= low if low_inclusive else value > low
    if not math.isfinite(value) or not above:
        bound = f"{'>=' if low_inclusive else '>'} {low:g}"
        raise ValueError(f"{mixer}: {name} must be a finite number {bound}, got {value}")
    return float(value)


def check_bool(value: object, name: str, mixer: str) -> bool:
    """Return `value` if it is a bool.

    Config strings such as "no" or "false" and ints such as 0 are rejected rather than converted
    with bool(), which would turn "no" into True.

    Raises:
        TypeError: value is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{mixer}: {name} must be true or false, got {value!r}")
    return value


def check_cache_dtype(dtype: object, mixer: str | None = None) -> None:
    """Refuse a cache dtype that is neither None nor a floating-point torch.dtype.

    Raises:
        TypeError: a string, an int or bool dtype, anything else (prefixed with ``mixer``'s name).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        prefix = f"{mixer}: " if mixer else ""
        raise TypeError(f"{prefix}the cache dtype must be a floating-point torch.dtype, got {dtype!r}")


def state_dtype(module_dtype: torch.dtype, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a recurrent state (linear attention, Mamba) for a given compute dtype.

    A recurrent state sums contributions over the whole sequence, so it is kept in float32 even for
    16-bit models (mamba_ssm and fla do the same); float64 models keep float64 so that float64
    tests compare exactly. `dtype` (the caller's request, e.g. a model-wide cache dtype) wins over
    the module's parameter dtype when given.

    Returns:
        torch.float64 if the requested (else the module's) dtype is float64, else torch.float32.

    Raises:
        TypeError: ``dtype`` is neither None nor a floating-point torch.dtype (a string, an int dtype).
    """
    check_cache_dtype(dtype)
    return torch.float64 if (dtype or module_dtype) == torch.float64 else torch.float32


@dataclasses.dataclass
class MixerCache:
    """Base class of the per-layer decode caches.

    Subclasses are dataclasses whose tensor fields (batch first) are the state; `seqlen` counts the
    tokens consumed so far (all sequences of a batch advance together) and `max_seqlen` is the
    number of tokens the cache accepts in total (a recurrent state does not grow, but keeping the
    limit on every cache makes the caches of a hybrid model interchangeable).
    """

    max_seqlen: int
    seqlen: int = 0
    # (id of the mixer, its device) that check_cache last accepted this cache for: checked once.
    checked_for: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def allocate(
        cls,
        mixer: str,
        batch_size: int,
        max_seqlen: int,
        shapes: dict[str, tuple[int, ...]],
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> MixerCache:
        """A cache of zero tensors: field name -> shape (batch first), all of one device and dtype.

        Raises:
            TypeError / ValueError: batch_size or max_seqlen not an int > 0 (naming `mixer`).
        """
        check_positive_int(batch_size, "batch_size", mixer)
        check_positive_int(max_seqlen, "max_seqlen", mixer)
        tensors = {name: torch.zeros(shape, device=device, dtype=dtype) for name, shape in shapes.items()}
        return cls(max_seqlen=max_seqlen, **tensors)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this cache holds (fields that are None are skipped)."""
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (int)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def batch_size(self) -> int:
        """Number of sequences the cache holds."""
        return self.tensors()[0].shape[0]

    def check_step(self, batch_size: int, seqlen: int, mixer: str) -> None:
        """Check that `seqlen` new tokens of `batch_size` sequences fit in this cache.

        Raises:
            ValueError: batch size differs from the cache's, or seqlen + new tokens > max_seqlen.
        """
        if batch_size != self.batch_size:
            raise ValueError(
                f"{mixer}: x has batch size {batch_size} but the cache was allocated for "
                f"{self.batch_size} sequences; allocate a cache with batch_size={batch_size}"
            )
        if self.seqlen + seqlen > self.max_seqlen:
            raise ValueError(
                f"{mixer}: cache overflow: it holds {self.seqlen} tokens, {seqlen} more would exceed "
                f"max_seqlen={self.max_seqlen}; allocate the cache with a larger max_seqlen"
            )


def check_cache(
    cache: object,
    mixer: nn.Module,
    cls: type,
    fields: dict[str, tuple[int, ...] | None],
    device: torch.device,
) -> None:
    """Refuse a cache that ``mixer`` did not allocate (another mixer's, or one of other settings),
    which would fail deep inside a kernel or, for a missing field, run without it. Checked once
    per cache and mixer (remembered in ``cache.checked_for``); every step checks the batch size and
    the room left (:meth:`MixerCache.check_step`).

    Args:
        cache: what the caller passed as the mixer's cache.
        mixer: the mixer (its ``name`` goes into the messages).
        cls: the cache class ``mixer.allocate_cache`` returns.
        fields: per tensor field, the trailing shape it must end with, or None where the field
            must be absent (linear attention without normalising has no ``z``).
        device: the mixer's parameters' device.

    Raises:
        TypeError: ``cache`` is not a ``cls``.
        ValueError: a field missing, present where it should not be, of another trailing shape, or
            on another device; each message says to allocate the cache with this mixer.
    """
    key = (id(mixer), device)
    if getattr(cache, "checked_for", None) == key:
        return
    fix = "allocate it with this mixer's (or model's) allocate_cache"
    if type(cache) is not cls:
        raise TypeError(
            f"{mixer.name}: the cache is a {type(cache).__name__}, but this layer keeps a {cls.__name__}: a "
            f"cache of another mixer or model; {fix}"
        )
    for name, trailing in fields.items():
        tensor = getattr(cache, name)
        if (tensor is None) != (trailing is None):
            state = "has no" if tensor is None else "has a"
            raise ValueError(
                f"{mixer.name}: the cache {state} {name}, which this layer's settings "
                f"{'need' if tensor is None else 'do not use'}: a cache of a mixer with other settings; {fix}"
            )
        if tensor is None:
            continue
        if tuple(tensor.shape[tensor.dim() - len(trailing) :]) != trailing:
            raise ValueError(
                f"{mixer.name}: the cache's {name} is {tuple(tensor.shape)}, but this layer needs (..., "
                f"{', '.join(map(str, trailing))}): a cache of a mixer with other settings; {fix}"
            )
        if tensor.device != device:
            raise ValueError(
                f"{mixer.name}: the cache's {name} is on {tensor.device} but the layer's weights are on "
                f"{device}; {fix} (device={device})"
            )
    cache.checked_for = key


def causal_conv1d(
    x: torch.Tensor,
    conv: nn.Conv1d,
    conv_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal depthwise convolution over time, optionally continuing from a cached window.

    out[:, c, t] = act(bias[c] + sum_i weight[c, 0, i] * x[:, c, t - (d_conv - 1) + i]), with inputs
    before the start taken from `conv_state` (zeros without a cache or on a fresh one). Runs
    `kernels.causal_conv1d` (looked up as a module attribute): the Triton kernel for CUDA tensors,
    the PyTorch reference on CPU.

    Args:
        x: (B, C, T) input in the compute dtype.
        conv: depthwise nn.Conv1d(C, C, d_conv, groups=C), holding weight (C, 1, d_conv) and bias (C,)
            (mamba_simple.py's layout); its padding is not used here.
        conv_state: optional (B, C, d_conv) window of the last d_conv inputs seen (fp32/fp64);
            updated in place to the last d_conv inputs including x.
        activation: None or "silu", fused into the kernel.

    Returns:
        (B, C, T) in x's dtype.
    """
    weight = conv.weight[:, 0]  # (C, d_conv)
    if conv_state is None:
        return kernels.causal_conv1d(x, weight, conv.bias, activation=activation)  # (B, C, T)
    d_conv = conv.kernel_size[0]
    # The oldest of the d_conv cached inputs is one step too far back to reach the first new token.
    x_padded = torch.cat([conv_state[..., 1:].to(x.dtype), x], dim=-1)  # (B, C, d_conv - 1 + T)
    # T >= 1, so the last d_conv inputs are all inside x_padded.
    conv_state.copy_(x_padded[..., -d_conv:])
    # The first d_conv - 1 outputs would see zeros before the cached inputs: dropped.
    out = kernels.causal_conv1d(x_padded, weight, conv.bias, activation=activation)
    return out[..., d_conv - 1 :]  # (B, C, T)


def causal_conv1d_step(
    x: torch.Tensor, conv: nn.Conv1d, conv_state: torch.Tensor, activation: str | None = None
) -> torch.Tensor:
    """One decode step of `causal_conv1d`: shift the cached window, append x, dot with the kernel
    (`kernels.causal_conv1d_update`: Triton for CUDA tensors, the reference on CPU).

    Args:
        x: (B, C) the new input in the compute dtype.
        conv: depthwise nn.Conv1d(C, C, d_conv, groups=C).
        conv_state: (B, C, d_conv) window of the last d_conv inputs (fp32/fp64), updated in place;
            the sum accumulates in its (fp32 or fp64) precision.
        activation: None or "silu", fused into the kernel.

    Returns:
        (B, C) in x's dtype.
    """
    return kernels.causal_conv1d_update(x, conv_state, conv.weight[:, 0], conv.bias, activation=activation)

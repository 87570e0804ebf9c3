"""Causal linear attention with a feature map, optional short convolutions and a recurrent cache.

Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6) replaces
softmax(q·k) by a kernel phi(q)·phi(k), so causal attention becomes a recurrence over a constant-size
state S_t = sum_{s<=t} phi(k_s) v_s^T (and z_t = sum_{s<=t} phi(k_s) when normalising):

    o_t = scale phi(q_t)^T S_t / (scale phi(q_t)^T z_t + eps)

Feature maps: "elu" (elu + 1, Katharopoulos et al. 2020), "relu", "identity", and "taylor", the
2nd-order Taylor approximation of exp used by Based (Arora et al. 2024, "Simple linear attention
language models balance the recall-throughput tradeoff", Sec. 3.1). Optional short causal depthwise
convolutions on the q, k, v projections follow Based and fla's ShortConvolution.

The math runs in `kernels.linear_attention` (full forward and prefill, chunked form) and
`kernels.linear_attention_step` (one decode step, recurrent form); both are looked up as module
attributes so tests can count calls.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import kernels
from mixers.common import (
    MixerCache,
    causal_conv1d,
    causal_conv1d_step,
    check_bool,
    check_cache,
    check_input,
    check_positive_int,
    state_dtype,
)

FEATURE_MAPS = ("elu", "relu", "identity", "taylor")


@dataclasses.dataclass(kw_only=True)
class LinearAttentionCache(MixerCache):
    """Recurrent state of one linear-attention layer (constant size in seqlen).

    Fields:
        kv: (B, H, F, head_dim) state S = sum_s phi(k_s) v_s^T, float32 (float64 for float64 models);
            F is the feature-mapped dim (feature_dim, or 1 + feature_dim + feature_dim^2 for "taylor").
        z: (B, H, F) normaliser sum_s phi(k_s) when normalize, else None; same dtype as kv.
        conv_state: (B, channels, d_conv) last d_conv inputs of the short convolutions when short_conv,
            else None; channels = num_heads * (2 * feature_dim + head_dim); same dtype as kv.
        max_seqlen: tokens each sequence may hold in total.
        seqlen: tokens consumed so far.
    """

    kv: torch.Tensor
    z: torch.Tensor | None = None
    conv_state: torch.Tensor | None = None


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """Based's 2nd-order Taylor feature map (Arora et al. 2024, Sec. 3.1).

    phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))], so that
    phi(q)·phi(k) = 1 + q·k / sqrt(d) + (q·k)^2 / (2 d), the Taylor expansion of exp(q·k / sqrt(d)).
    The kernel is always positive ((a + 1)^2 + 1) / 2 > 0 with a = q·k / sqrt(d), so normalising is safe.

    Args:
        x: (..., d).

    Returns:
        (..., 1 + d + d^2) in x's dtype.
    """
    d = x.shape[-1]
    ones = torch.ones_like(x[..., :1])  # (..., 1)
    x2 = rearrange(x[..., :, None] * x[..., None, :], "... i j -> ... (i j)")  # (..., d^2)
    return torch.cat([ones, x / d**0.25, x2 / (math.sqrt(2) * math.sqrt(d))], dim=-1)


class LinearAttention(nn.Module):
    """Causal multi-head linear attention (Katharopoulos et al. 2020; Based, Arora et al. 2024).

    Args:
        d_model: model width; input and output are (B, T, d_model).
        num_heads: heads; must divide d_model (head_dim = d_model // num_heads is the value width).
        feature_dim: per-head width of the q and k projections, before the feature map.
        feature_map: "elu" (elu + 1), "relu", "identity" or "taylor" (1 + d + d^2 features).
        normalize: divide by scale phi(q_t)·sum_{s<=t} phi(k_s) + eps (needs a positive kernel).
        short_conv: apply a causal depthwise convolution of width d_conv + SiLU to the q, k, v
            projections (Based; fla's ShortConvolution).
        d_conv: width of the short convolutions.
        bias: whether the projections have biases.

    Raises:
        TypeError: normalize, short_conv or bias is not a bool (e.g. the config string "no").
        TypeError / ValueError: non-positive or non-int sizes, num_heads not dividing d_model, unknown
            feature_map, normalize=True with feature_map="identity".
    """

    name = "linear_attention"

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        feature_dim: int = 16,
        feature_map: str = "elu",
        normalize: bool = True,
        short_conv: bool = False,
        d_conv: int = 4,
        bias: bool = False,
    ):
        super().__init__()
        check_positive_int(d_model, "d_model", self.name)
        check_positive_int(num_heads, "num_heads", self.name)
        check_positive_int(feature_dim, "feature_dim", self.name)
        check_positive_int(d_conv, "d_conv", self.name)
        check_bool(normalize, "normalize", self.name)
        check_bool(short_conv, "short_conv", self.name)
        check_bool(bias, "bias", self.name)
        if d_model % num_heads != 0:
            raise ValueError(f"{self.name}: num_heads={num_heads} does not divide d_model={d_model}")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"{self.name}: unknown feature_map {feature_map!r}; choose one of {FEATURE_MAPS} (elu is "
                "elu(x) + 1, the positive map of Katharopoulos et al.; taylor is Based's)"
            )
        if normalize and feature_map == "identity":
            raise ValueError(
                f"{self.name}: normalize=True needs a positive kernel, but identity features give q·k < 0 "
                "and a normaliser that can cross zero; use feature_map 'elu', 'relu' or 'taylor', or "
                "normalize=False"
            )

        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.feature_dim = feature_dim
        self.feature_map = feature_map
        self.normalize = normalize
        self.short_conv = short_conv
        self.d_conv = d_conv
        self.expanded_dim = 1 + feature_dim + feature_dim**2 if feature_map == "taylor" else feature_dim
        # The scale multiplies phi(q)·phi(k). Taylor's map already carries the 1/sqrt(d) of
        # exp(q·k / sqrt(d)), so 1.0. Otherwise 1/sqrt(feature_dim), as in softmax attention, keeps
        # q·k of unit-variance features O(1). With normalize the scale cancels between numerator
        # and normaliser and only sets the normaliser's size relative to eps.
        self.scale = 1.0 if feature_map == "taylor" else feature_dim**-0.5

        self.conv_channels = num_heads * (2 * feature_dim + self.head_dim)
        # Trailing shapes of the cache's tensors (mixers.common.check_cache); None: absent.
        shapes = self._state_shapes(1)
        self._cache_layout = {
            name: shapes[name][1:] if name in shapes else None for name in ("kv", "z", "conv_state")
        }
        self.qkv_proj = nn.Linear(d_model, self.conv_channels, bias=bias)
        # Depthwise over the fused q, k, v channels: the same as three separate short convolutions.
        # PyTorch's default init (uniform +-1/sqrt(d_conv)) is kept, as in Mamba's conv.
        self.conv = (
            nn.Conv1d(self.conv_channels, self.conv_channels, d_conv, groups=self.conv_channels, bias=False)
            if self.short_conv
            else None
        )
        self.out_proj = nn.Linear(num_heads * self.head_dim, d_model, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Projections N(0, 0.02), biases zero (GPT-2 / nanoGPT init).

        Small q, k keep the feature-mapped kernel near its value at zero at init (elu+1: ~1, taylor:
        ~1), i.e. attention starts close to a uniform average of past values, as softmax attention does.
        """
        for linear in (self.qkv_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feature map to (..., feature_dim); returns (..., expanded_dim) in x's dtype."""
        if self.feature_map == "elu":
            return F.elu(x) + 1  # positive; elu + 1 keeps a gradient for negative inputs, unlike relu
        if self.feature_map == "relu":
            return F.relu(x)
        if self.feature_map == "taylor":
            return taylor_feature_map(x)
        return x

    def forward(self, x: torch.Tensor, cache: LinearAttentionCache | None = None) -> torch.Tensor:
        """Causal linear attention over x, continuing the cached state when a cache is given.

        Args:
            x: (B, T, d_model). With a cache: T new tokens after cache.seqlen, a prefill / chunked
                prefill (T > 1) or a decode step (T == 1).
            cache: from `allocate_cache`; updated in place (state and conv window, seqlen += T).

        Returns:
            (B, T, d_model) in x's dtype.

        Raises:
            TypeError: x is not a float tensor, or (outside autocast) not in the weights' dtype.
            ValueError: x of the wrong shape or on another device than the weights, a cache of
                another batch size, or cache overflow.
        """
        B, T = check_input(x, self.d_model, self.name, self.qkv_proj.weight)
        if cache is not None:
            check_cache(cache, self, LinearAttentionCache, self._cache_layout, self.qkv_proj.weight.device)
            cache.check_step(B, T, self.name)
        decode = cache is not None and T == 1

        qkv = self.qkv_proj(x)  # (B, T, C)
        if self.conv is not None:
            qkv = rearrange(qkv, "b t c -> b c t")
            if decode:  # silu fused into the conv kernels
                qkv = causal_conv1d_step(qkv[..., 0], self.conv, cache.conv_state, activation="silu")
                qkv = qkv[..., None]  # (B, C, 1)
            else:
                conv_state = None if cache is None else cache.conv_state
                qkv = causal_conv1d(qkv, self.conv, conv_state, activation="silu")
            qkv = rearrange(qkv, "b c t -> b t c")  # (B, T, C)
        qk_dim = self.num_heads * self.feature_dim
        q, k, v = qkv.split([qk_dim, qk_dim, self.num_heads * self.head_dim], dim=-1)
        q = self.phi(rearrange(q, "b t (h d) -> b t h d", h=self.num_heads))  # (B, T, H, F)
        k = self.phi(rearrange(k, "b t (h d) -> b t h d", h=self.num_heads))  # (B, T, H, F)
        v = rearrange(v, "b t (h d) -> b t h d", h=self.num_heads)  # (B, T, H, head_dim)

        if cache is None:
            o = kernels.linear_attention(q, k, v, scale=self.scale, normalize=self.normalize)
        elif decode:
            o = kernels.linear_attention_step(
                q[:, 0], k[:, 0], v[:, 0], cache.kv, scale=self.scale, z_state=cache.z
            )
            o = o[:, None]  # (B, 1, H, head_dim)
        else:
            state = (cache.kv, cache.z) if self.normalize else cache.kv
            o, final = kernels.linear_attention(
                q,
                k,
                v,
                scale=self.scale,
                normalize=self.normalize,
                initial_state=state,
                output_final_state=True,
            )
            if self.normalize:
                cache.kv.copy_(final[0])
                cache.z.copy_(final[1])
            else:
                cache.kv.copy_(final)
        if cache is not None:
            cache.seqlen += T
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)"))

    def _state_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the cache tensors by field name."""
        shapes = {"kv": (batch_size, self.num_heads, self.expanded_dim, self.head_dim)}
        if self.normalize:
            shapes["z"] = (batch_size, self.num_heads, self.expanded_dim)
        if self.short_conv:
            shapes["conv_state"] = (batch_size, self.conv_channels, self.d_conv)
        return shapes

    def allocate_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> LinearAttentionCache:
        """Allocate a zero state (see `LinearAttentionCache` for the tensors and shapes).

        Args:
            batch_size: sequences decoded together.
            max_seqlen: tokens each sequence may consume in total.
            device: defaults to the parameters' device.
            dtype: compute dtype hint; the state is float64 if it (default: the parameters' dtype) is
                float64, else float32 (see `mixers.common.state_dtype`).

        Raises:
            TypeError / ValueError: batch_size or max_seqlen not an int > 0.
        """
        weight = self.qkv_proj.weight
        return LinearAttentionCache.allocate(
            self.name,
            batch_size,
            max_seqlen,
            self._state_shapes(batch_size),
            device=device or weight.device,
            dtype=state_dtype(weight.dtype, dtype),
        )

    def state_size(self, seqlen: int, dtype: torch.dtype | None = None) -> int:
        """Bytes per sequence, independent of seqlen: (H F head_dim [+ H F if normalize]
        [+ channels d_conv if short_conv]) * itemsize of the state dtype (float32, or float64).

        Raises:
            TypeError / ValueError: seqlen not an int > 0 (as ``allocate_cache``'s max_seqlen).
        """
        check_positive_int(seqlen, "seqlen", self.name)
        itemsize = state_dtype(self.qkv_proj.weight.dtype, dtype).itemsize
        return sum(math.prod(shape) for shape in self._state_shapes(1).values()) * itemsize

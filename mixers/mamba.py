"""The Mamba (S6) block with a recurrent decode cache.

Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", Fig. 3 and
Algorithm 2, with the semantics of the reference implementation's block (mamba_simple.py):

    x, z = in_proj(x)                                  expand d_model -> 2 * d_inner
    x = silu(causal depthwise conv1d(x))               width d_conv
    dt, B, C = x_proj(x)                               input-dependent ("selective") parameters
    dt = softplus(dt_proj(dt))                         low rank dt_rank -> d_inner, bias = dt init
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,  y_t = C_t h_t + D x_t      (eq. 2a-2b, ZOH for A)
    out = out_proj(y * silu(z))

The conv and its silu run in `kernels.causal_conv1d` / `kernels.causal_conv1d_update` (through
`mixers.common`), the scan in `kernels.selective_scan` (full forward and prefill) and a decode step
in `kernels.selective_state_update`; all are looked up as module attributes so tests can count calls.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from torch import nn

import kernels
from mixers.common import (
    MixerCache,
    causal_conv1d,
    causal_conv1d_step,
    check_bool,
    check_input,
    check_positive_int,
    state_dtype,
)


@dataclasses.dataclass(kw_only=True)
class MambaCache(MixerCache):
    """Recurrent state of one Mamba layer (constant size in seqlen).

    Fields:
        conv_state: (B, d_inner, d_conv) the last d_conv inputs of the causal conv, oldest first.
        ssm_state: (B, d_inner, d_state) the SSM state h_t.
        Both float32 (float64 for float64 models).
        max_seqlen: tokens each sequence may consume in total.
        seqlen: tokens consumed so far.
    """

    conv_state: torch.Tensor
    ssm_state: torch.Tensor


class Mamba(nn.Module):
    """Mamba block (Gu & Dao 2023, Fig. 3; mamba_simple.py).

    Args:
        d_model: model width; input and output are (B, T, d_model).
        d_state: SSM state size N per channel.
        d_conv: width of the causal depthwise convolution.
        expand: d_inner = expand * d_model.
        dt_rank: rank of the dt projection; "auto" is ceil(d_model / 16).
        dt_min, dt_max: range of the initial step size dt (sampled log-uniformly), in units of tokens.
        dt_init_floor: lower clamp of the initial dt.
        dt_scale: scales the dt_proj weight init.
        conv_bias: whether the conv has a bias.
        bias: whether in_proj and out_proj have biases.

    Raises:
        TypeError: conv_bias or bias is not a bool (e.g. the config string "no").
        TypeError / ValueError: non-positive or non-int sizes, dt_rank neither "auto" nor an int > 0,
            not 0 < dt_min <= dt_max, negative dt_init_floor, non-positive dt_scale.
    """

    name = "mamba"

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_scale: float = 1.0,
        conv_bias: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        check_positive_int(d_model, "d_model", self.name)
        check_positive_int(d_state, "d_state", self.name)
        check_positive_int(d_conv, "d_conv", self.name)
        check_positive_int(expand, "expand", self.name)
        check_bool(conv_bias, "conv_bias", self.name)
        check_bool(bias, "bias", self.name)
        if dt_rank == "auto":
            dt_rank = math.ceil(d_model / 16)
        elif isinstance(dt_rank, str):
            raise ValueError(f"{self.name}: dt_rank must be 'auto' or an int > 0, got {dt_rank!r}")
        check_positive_int(dt_rank, "dt_rank", self.name)
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"{self.name}: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        if dt_init_floor < 0:
            raise ValueError(f"{self.name}: dt_init_floor must be >= 0, got {dt_init_floor}")
        if not dt_scale > 0:
            raise ValueError(f"{self.name}: dt_scale must be > 0, got {dt_scale}")

        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = expand * d_model
        self.dt_rank = dt_rank
        self.dt_min, self.dt_max, self.dt_init_floor, self.dt_scale = dt_min, dt_max, dt_init_floor, dt_scale

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        # Causal padding is applied by mixers.common.causal_conv1d (left zeros, or the cached window).
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, bias=conv_bias)
        self.x_proj = nn.Linear(self.d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        # Decaying A_log would shrink every state's timescale and weight-decaying D would remove the
        # skip; optimisers read this flag to exclude them (as mamba_ssm does).
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise as the Mamba paper / mamba_simple.py do.

        - A_log = log(1, ..., d_state) per channel: the S4D-real init (A_n = -n, Gu et al. 2022), a
          spread of decay rates so that the states cover short to long memories.
        - D = 1: the skip starts as identity.
        - dt_proj.bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] (floored at
          dt_init_floor), so softplus(dt_proj(...)) starts in the intended range of timescales.
        - dt_proj.weight uniform +-dt_rank^-0.5 * dt_scale, keeping the input-dependent part of dt
          comparable to the bias at init.
        - in_proj, x_proj, out_proj: N(0, 0.02) (biases zero); a small x_proj keeps the low-rank dt
          input near zero, so dt starts where its bias puts it.
        """
        for linear in (self.in_proj, self.x_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.conv1d.reset_parameters()
        dt_init_std = self.dt_rank**-0.5 * self.dt_scale
        with torch.no_grad():
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
            device = self.dt_proj.bias.device
            log_dt = torch.empty(self.d_inner, device=device).uniform_(
                math.log(self.dt_min), math.log(self.dt_max)
            )
            dt = torch.exp(log_dt).clamp(min=self.dt_init_floor)  # (d_inner,)
            # softplus^-1(dt) = log(exp(dt) - 1) = dt + log(1 - exp(-dt)); expm1 keeps small dt exact.
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            A = torch.arange(1, self.d_state + 1, device=device, dtype=torch.float32).repeat(
                self.d_inner, 1
            )  # (d_inner, N)
            self.A_log.copy_(torch.log(A))
            self.D.fill_(1.0)

    def _ssm_params(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The selective parameters for x (..., d_inner): dt (..., d_inner) before bias and softplus,
        B and C (..., d_state); plus A (d_inner, d_state), D (d_inner,), dt bias (d_inner,) in the
        state dtype (float32, or float64 for float64 models)."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = dt @ self.dt_proj.weight.T  # (..., d_inner); the bias goes to the kernel as delta_bias
        # A, D and the dt bias enter exp / softplus and the state update: keep them at state precision.
        dtype = state_dtype(x.dtype)
        A = -torch.exp(self.A_log.to(dtype))  # (d_inner, N), negative so that the state decays
        return dt, B, C, A, self.D.to(dtype), self.dt_proj.bias.to(dtype)

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None) -> torch.Tensor:
        """Mamba block over x, continuing the cached state when a cache is given.

        Args:
            x: (B, T, d_model). With a cache: T new tokens after cache.seqlen, a prefill / chunked
                prefill (T > 1) or a decode step (T == 1).
            cache: from `allocate_cache`; updated in place (conv window, SSM state, seqlen += T).

        Returns:
            (B, T, d_model) in x's dtype.

        Raises:
            TypeError: x is not a float tensor, or (outside autocast) not in the weights' dtype.
            ValueError: x of the wrong shape, a cache of another batch size, or cache overflow.
        """
        batch, T = check_input(x, self.d_model, self.name, self.in_proj.weight.dtype)
        if cache is not None:
            cache.check_step(batch, T, self.name)
        if cache is not None and T == 1:
            y = self._step(x[:, 0], cache)[:, None]  # (B, 1, d_inner)
        else:
            xz = rearrange(self.in_proj(x), "b l d -> b d l")  # (B, 2 d_inner, T)
            x, z = xz.chunk(2, dim=1)  # (B, d_inner, T) each
            # silu fused into the conv kernel
            x = causal_conv1d(x, self.conv1d, None if cache is None else cache.conv_state, activation="silu")
            dt, B, C, A, D, dt_bias = self._ssm_params(rearrange(x, "b d l -> b l d"))
            dt = rearrange(dt, "b l d -> b d l")  # (B, d_inner, T)
            B = rearrange(B, "b l n -> b n l")  # (B, N, T)
            C = rearrange(C, "b l n -> b n l")  # (B, N, T)
            if cache is None:
                y = kernels.selective_scan(x, dt, A, B, C, D, z=z, delta_bias=dt_bias, delta_softplus=True)
            else:
                y, last_state = kernels.selective_scan(
                    x,
                    dt,
                    A,
                    B,
                    C,
                    D,
                    z=z,
                    delta_bias=dt_bias,
                    delta_softplus=True,
                    return_last_state=True,
                    initial_state=cache.ssm_state,
                )
                cache.ssm_state.copy_(last_state)
            y = rearrange(y, "b d l -> b l d")  # (B, T, d_inner)
        if cache is not None:
            cache.seqlen += T
        return self.out_proj(y)

    def _step(self, x: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """One decode step: x (B, d_model) -> y (B, d_inner), updating the cache's conv window and SSM
        state in place (the recurrent form of the block, as mamba_simple.py's step)."""
        x, z = self.in_proj(x).chunk(2, dim=-1)  # (B, d_inner) each
        x = causal_conv1d_step(x, self.conv1d, cache.conv_state, activation="silu")  # (B, d_inner)
        dt, B, C, A, D, dt_bias = self._ssm_params(x)  # dt (B, d_inner), B and C (B, N)
        return kernels.selective_state_update(
            cache.ssm_state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True
        )

    def allocate_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MambaCache:
        """Allocate a zero conv window (B, d_inner, d_conv) and SSM state (B, d_inner, d_state).

        Args:
            batch_size: sequences decoded together.
            max_seqlen: tokens each sequence may consume in total.
            device: defaults to the parameters' device.
            dtype: compute dtype hint; the state is float64 if it (default: the parameters' dtype) is
                float64, else float32 (see `mixers.common.state_dtype`).

        Raises:
            TypeError / ValueError: batch_size or max_seqlen not an int > 0.
        """
        weight = self.in_proj.weight
        shapes = {
            "conv_state": (batch_size, self.d_inner, self.d_conv),
            "ssm_state": (batch_size, self.d_inner, self.d_state),
        }
        return MambaCache.allocate(
            self.name,
            batch_size,
            max_seqlen,
            shapes,
            device=device or weight.device,
            dtype=state_dtype(weight.dtype, dtype),
        )

    def state_size(self, seqlen: int, dtype: torch.dtype | None = None) -> int:
        """Bytes per sequence, independent of seqlen: (d_inner * d_conv + d_inner * d_state) * itemsize,
        itemsize 4 (float32 state) or 8 for float64 models."""
        itemsize = state_dtype(self.in_proj.weight.dtype, dtype).itemsize
        return (self.d_inner * self.d_conv + self.d_inner * self.d_state) * itemsize

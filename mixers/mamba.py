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
    check_cache,
    check_input,
    check_number,
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
            not 0 < dt_min <= dt_max, negative dt_init_floor, non-positive dt_scale, a dt_* that
            is not a finite number.
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
        # Finite: a NaN or infinite one would give NaN biases or fail inside torch's init.
        dt_min, dt_max = check_number(dt_min, "dt_min", self.name), check_number(dt_max, "dt_max", self.name)
        if dt_min > dt_max:
            raise ValueError(f"{self.name}: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        dt_init_floor = check_number(dt_init_floor, "dt_init_floor", self.name, low_inclusive=True)
        dt_scale = check_number(dt_scale, "dt_scale", self.name)

        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = expand * d_model
        self.dt_rank = dt_rank
        # Trailing shapes of the cache's tensors (mixers.common.check_cache).
        self._cache_layout = {"conv_state": (self.d_inner, d_conv), "ssm_state": (self.d_inner, d_state)}
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

    def _ssm_constants(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A (d_inner, d_state), D (d_inner,) and the dt bias (d_inner,) in the state dtype of a
        compute dtype (float32, or float64 for float64 models): they enter exp / softplus and the
        state update, so they keep state precision."""
        dtype = state_dtype(dtype)
        A = -torch.exp(self.A_log.to(dtype))  # negative, so that the state decays
        return A, self.D.to(dtype), self.dt_proj.bias.to(dtype)

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
            ValueError: x of the wrong shape or on another device than the weights, a cache of
                another batch size, or cache overflow.
        """
        batch, T = check_input(x, self.d_model, self.name, self.in_proj.weight)
        if cache is not None:
            check_cache(cache, self, MambaCache, self._cache_layout, self.in_proj.weight.device)
            cache.check_step(batch, T, self.name)
        if cache is not None and T == 1:
            out = self.out_proj(self._step(x[:, 0], cache)[:, None])  # (B, 1, d_model)
        else:
            y = self._scan_block(x, cache)  # (B, d_inner, T), time-contiguous
            # out_proj reads y through its transpose (no copy) and writes (B, T, d_model).
            out = torch.bmm(y.mT, self._weight(self.out_proj, x).mT.expand(batch, -1, -1))
            if self.out_proj.bias is not None:
                out = out + self.out_proj.bias.to(out.dtype)
        if cache is not None:
            cache.seqlen += T
        return out

    def _scan_block(self, x: torch.Tensor, cache: MambaCache | None) -> torch.Tensor:
        """in_proj, conv and selective scan: x (B, T, d_model) -> y * silu(z), (B, d_inner, T) in the
        compute dtype, continuing the cache's conv window and SSM state when given (updated in place).

        Layouts, as mamba_simple.py's: the scan reads each channel's steps with 16-byte loads along
        time, so every tensor it reads (u, dt, z, B, C) leaves the GEMM that makes it
        time-contiguous, the weight on the left: in_proj over (d_model, B T) columns, x_proj and
        dt_proj as batched products on (B, ., T). Taking them from nn.Linear's (B, T, .) outputs
        instead, the scan read dt, z, B and C strided along time and the layer copied activations
        between the two layouts: on an H200 (model=small's layer, bf16) its training step took
        6.38 ms instead of 4.48 at B8 T2048 and a 32k-token prefill 4.13 ms instead of 2.29
        (benchmarks/results/2026-12-03-nvidia-h200-mamba-layouts.json).
        """
        batch, T, _ = x.shape
        w_in = self._weight(self.in_proj, x)  # (2 d_inner, d_model)
        columns = rearrange(x.to(w_in.dtype), "b l d -> d (b l)")  # a transposed view, no copy
        if self.in_proj.bias is None:
            xz = w_in @ columns
        else:
            xz = torch.addmm(self.in_proj.bias.to(w_in.dtype)[:, None], w_in, columns)
        xz = rearrange(xz, "d (b l) -> b d l", l=T)  # (B, 2 d_inner, T), a view: channel stride B T
        x, z = xz.chunk(2, dim=1)
        # silu fused into the conv kernel
        u = causal_conv1d(x, self.conv1d, None if cache is None else cache.conv_state, activation="silu")
        if cache is not None:
            # Past the cached window the conv's output starts d_conv - 1 steps into its rows: copied,
            # so that the scan's rows are 16-byte aligned again (its loads slowed 2x otherwise).
            u = u.contiguous()
        w_x = self._weight(self.x_proj, x)  # (dt_rank + 2 N, d_inner)
        dt, B, C = torch.bmm(w_x.expand(batch, -1, -1), u).split([self.dt_rank, self.d_state, self.d_state], dim=1)
        dt = torch.bmm(self._weight(self.dt_proj, x).expand(batch, -1, -1), dt)  # (B, d_inner, T)
        A, D, dt_bias = self._ssm_constants(u.dtype)  # the dt bias is added in the kernel
        if cache is None:
            return kernels.selective_scan(u, dt, A, B, C, D, z=z, delta_bias=dt_bias, delta_softplus=True)
        y, last_state = kernels.selective_scan(
            u,
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
        return y

    @staticmethod
    def _weight(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """linear's weight in the compute dtype: autocast's when it is on, else x's. Cast before the
        batched products expand it over the batch (autocast would cast the expanded view into a
        copy per sequence)."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return linear.weight.to(dtype)

    def _step(self, x: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """One decode step: x (B, d_model) -> y (B, d_inner), updating the cache's conv window and SSM
        state in place (the recurrent form of the block, as mamba_simple.py's step)."""
        x, z = self.in_proj(x).chunk(2, dim=-1)  # (B, d_inner) each
        x = causal_conv1d_step(x, self.conv1d, cache.conv_state, activation="silu")  # (B, d_inner)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)  # B, C (B, N)
        dt = dt @ self.dt_proj.weight.T  # (B, d_inner); the bias goes to the kernel
        A, D, dt_bias = self._ssm_constants(x.dtype)
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
        itemsize 4 (float32 state) or 8 for float64 models.

        Raises:
            TypeError / ValueError: seqlen not an int > 0 (as ``allocate_cache``'s max_seqlen).
        """
        check_positive_int(seqlen, "seqlen", self.name)
        itemsize = state_dtype(self.in_proj.weight.dtype, dtype).itemsize
        return (self.d_inner * self.d_conv + self.d_inner * self.d_state) * itemsize

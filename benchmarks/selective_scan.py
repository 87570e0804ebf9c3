"""Selective-scan benchmark: mixerlab's Triton Mamba scan against the PyTorch reference and the
issue's mamba_ssm figures, plus the decode step and the Mamba block's causal conv1d.

    python benchmarks/selective_scan.py                  # everything below (~minutes on an H200)
    python benchmarks/selective_scan.py --quick          # smoke run: 8x2048 only, no conv
    python benchmarks/selective_scan.py --shapes 32x2048 8x8192 --providers ours --no-conv

Four parts, bf16 unless ``--dtype``, in one process on one GPU:

1. **Ceilings**, measured first: the copy bandwidth (``dst.copy_(src)`` of 1 GiB; 2 bytes move per
   byte copied) and the exp2 rate (a Triton kernel that only chains ``tl.exp2`` on registers: the
   ``ex2.approx`` instruction the scan's decays use; nominally 16 per clock per SM, on an H200
   132 x 16 x 1.98 GHz = 4.2e12/s).
2. **Scan** (``--shapes BxL`` at ``--dim`` channels and ``--d-state`` N; default the issue's 32x2048,
   8x8192 and 8x2048 at dim 2048, N 16) with z, D and softplus (the issue's setting; A is
   S4D-real, -1..-N, delta puts softplus(dt) near 0.08), forward and backward. Providers:

   - ``ours``: ``kernels.selective_scan(..., backend="triton")``;
   - ``reference``: :func:`kernels.reference.selective_scan` (the PyTorch loop over time; slow);
   - ``mamba_ssm``: the issue's times for mamba_ssm's CUDA ``selective_scan_fn`` on an H200
     (sm_90 build, torch 2.11, 2026-11-30): not run, mamba_ssm is not on the GPU machine.

   Per row: ms, ours' speedup over mamba_ssm (the issue's target: >= 1.0) and over the reference
   (target >= 50; mamba_ssm's own PyTorch reference took 116.8 ms forward at 8x2048, shown as
   ``x mamba_ref``), achieved bandwidth (the bytes that must move: u, delta, z, B, C read and y
   written; backward also dout read and du, ddelta, dz, dB, dC written) against the copy
   bandwidth, and exponentials per second (N per (channel, step) in either direction, the
   algorithm's count) against the exp2 rate. mamba_ssm reached neither: 0.47 TB/s and about a
   fifth of the exp rate.
3. **Decode** (``--decode BxDxN``, default 1024x4096x16, an fp32 state of 268 MB): one
   ``selective_state_update``, counted on the state bytes read and written, against the copy
   bandwidth of a same-size copy (target >= 70%).
4. **Conv** (``--conv-width``, default 4): the block's causal depthwise conv1d on (batch, dim, L) at
   each scan shape, in both input layouts (``contiguous``, time fastest, and ``channel_last``, the
   transposed (batch, L, dim) view the mamba mixer passes), forward and backward, and its decode update at the decode shape, each as
   bandwidth against copy and as speedups over the baselines (``x torch``, ``x old mixer``: their
   time over the row's). Providers: ``triton_causal_conv1d`` / ``triton_causal_conv1d_update``
   (``kernels.causal_conv1d`` / ``kernels.causal_conv1d_update``, backend="triton": the Triton
   kernels of kernels/causal_conv1d.py, with the forward's output checked against float64);
   ``torch_conv1d`` (``F.conv1d``, cuDNN, groups=dim, left padding); ``mixer_multiply_add`` /
   ``mixer_multiply_add_step`` (the d_conv shifted multiply-adds and the roll + einsum step that
   mixers/common.py ran before the kernel, reproduced here). mixerlab's mixers now run the Triton
   kernels on CUDA (mixers/common.py dispatches through ``kernels``, silu fused).

Timing follows benchmarks/attention.py (DESIGN.md "Measuring"): ``triton.testing.do_bench`` median
with the L2 flushed, after a warm-up call that also autotunes / compiles; forwards run on inputs that
require grad (the training forward, which also saves the backward's checkpoints); the backward is
timed alone, ``torch.autograd.grad(y, inputs, dy, retain_graph=True)`` on one forward.

Correctness column: the forward's y and the backward's du, ddelta, dz on one slice (the first
sequence, the first 64 channels; the scan is independent across both) are compared with the float64
reference run on that slice, next to the error of the reference run on the slice's 16-bit inputs
(float32 inside, rounded like ours): ``err ours`` is flagged ``!`` beyond 2x (forward) / 3x
(backward) that error plus two units in the last place, the test suite's rule. Writes every row with
the ceilings and versions to ``benchmarks/results/<date>-<gpu>-selective-scan.json``
(``...-quick.json`` for ``--quick``), rewritten after each part so an interrupted run keeps what it
measured.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kernels  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DO_BENCH_REP_MS,
    DO_BENCH_WARMUP_MS,
    RESULTS_DIR,
    bench_ms,
    check_out_dir,
    fmt_ratio,
    fmt_sci,
    format_table,
    ratio,
    require_cuda,
    results_path,
    short_reason,
    versions,
    write_json,
)
from kernels import reference  # noqa: E402

DEVICE = "cuda"  # every tensor of the run (a module constant, so the CPU tests can smoke-run the parts)
DIM = 2048
D_STATE = 16
SHAPES = ((32, 2048), (8, 8192), (8, 2048))  # (batch, L)
QUICK_SHAPES = ((8, 2048),)
DECODE = (1024, 4096, 16)  # (batch, dim, N)
CONV_WIDTH = 4
PROVIDERS = ("ours", "reference")
DIRECTIONS = ("fwd", "bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The figures (H200, bf16, dim 2048, N 16, z, D, softplus): mamba_ssm's CUDA selective_scan_fn,
# and its PyTorch reference (selective_scan_ref) where measured.
MAMBA_SSM_MS = {(32, 2048): {"fwd": 2.30, "bwd": 9.61}, (8, 8192): {"fwd": 2.56, "bwd": 9.81}}
MAMBA_REF_MS = {(8, 2048): {"fwd": 116.8}}
REFERENCE_SPEEDUP_TARGET = 50.0
COPY_TARGET = 0.7  # decode: fraction of the copy bandwidth
CHECK_CHANNELS = 64
SUSPECT_FACTOR = {"fwd": 2.0, "bwd": 3.0}  # the test suite's bound on ours vs the naive error


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested on CPU)
# ----------------------------------------------------------------------------------------------


def parse_shape(text: str, parts: int = 2) -> tuple[int, ...]:
    """``"32x2048"`` -> (32, 2048) (batch, L); with ``parts=3``, ``"1024x4096x16"`` -> (batch, dim, N).

    Raises:
        ValueError: not ``parts`` positive integers separated by ``x``.
    """
    try:
        dims = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != parts or any(d <= 0 for d in dims):
        names = "BxL" if parts == 2 else "BxDxN"
        raise ValueError(f"shape {text!r}: expected {names} with positive integers")
    return dims


def scan_bytes(
    batch: int, dim: int, seqlen: int, d_state: int, itemsize: int, direction: str, groups: int = 1
) -> int:
    """Bytes a scan must move in ``direction`` (each tensor read or written once, in its dtype).

    Forward: u, delta, z read and y written (4 (batch, dim, L) tensors), B and C read (2 (batch, G,
    N, L)). Backward: u, delta, z, dout read and du, ddelta, dz written (7), B, C read and dB, dC
    written (4). A, D and delta_bias are negligible.

    Raises:
        ValueError: unknown direction.
    """
    per_channel = batch * dim * seqlen * itemsize
    per_state = batch * groups * d_state * seqlen * itemsize
    if direction == "fwd":
        return 4 * per_channel + 2 * per_state
    if direction == "bwd":
        return 7 * per_channel + 4 * per_state
    raise ValueError(f"unknown direction {direction!r}; valid directions are {', '.join(DIRECTIONS)}")


def scan_exps(batch: int, dim: int, seqlen: int, d_state: int) -> int:
    """Exponentials exp(dt A) of a scan: one per (batch, channel, step, state), in either direction."""
    return batch * dim * seqlen * d_state


def per_second(amount: float, ms: float | None) -> float | None:
    """``amount`` per second over ``ms`` milliseconds; None when the time is missing."""
    if ms is None or ms <= 0:
        return None
    return amount / (ms * 1e-3)


def fmt_ms(value: float | None) -> str:
    """A time cell in ms with three decimals (``"2.301"``); ``"-"`` when missing."""
    return "-" if value is None else f"{value:.3f}"


def fmt_pct(value: float | None) -> str:
    """A fraction as a whole percentage (``"47%"``); ``"-"`` when missing."""
    return "-" if value is None else f"{100 * value:.0f}%"


def fmt_rate(value: float | None, unit: float = 1e12) -> str:
    """A rate in units of ``unit`` with two decimals (TB/s, T exps/s); ``"-"`` when missing."""
    return "-" if value is None else f"{value / unit:.2f}"


def scan_table_header() -> list[str]:
    """Column names of the scan table (one :func:`scan_table_row` per row)."""
    return [
        "shape", "dir", "ours ms", "ref ms", "mamba_ssm ms", "x mamba_ssm", "x ref", "x mamba_ref",
        "TB/s", "of copy", "T exp/s", "of exp2", "err ours", "err naive",
    ]  # fmt: skip


def scan_table_row(row: dict[str, Any]) -> list[str]:
    """One printed line of the scan part: times (``fail`` / ``-``), speedups (the other's time
    over ours'), ours' bandwidth and exp rate with their fractions of the ceilings, max abs errors
    (``!``: ours beyond the test suite's bound)."""

    def cell(p: str) -> str:
        status = row["status"].get(p, "not run")
        if status == "ok":
            return fmt_ms(row["ms"][p])
        return "fail" if status.startswith("failed") else "-"

    err_ours = fmt_sci(row["max_abs_err"].get("ours"))
    if row["ours_err_suspect"]:
        err_ours += "!"
    return [
        f"{row['batch']}x{row['seqlen']}",
        row["direction"],
        cell("ours"),
        cell("reference"),
        fmt_ms(row["mamba_ssm_ms"]),
        fmt_ratio(row["speedup"]["vs_mamba_ssm"]),
        fmt_ratio(row["speedup"]["vs_reference"]),
        fmt_ratio(row["speedup"]["vs_mamba_ref"]),
        fmt_rate(row["bytes_per_s"]),
        fmt_pct(row["fraction_of_copy"]),
        fmt_rate(row["exps_per_s"]),
        fmt_pct(row["fraction_of_exp2"]),
        err_ours,
        fmt_sci(row["max_abs_err"].get("naive")),
    ]


def scan_row(
    batch: int,
    seqlen: int,
    direction: str,
    *,
    dim: int,
    d_state: int,
    itemsize: int,
    ms: dict[str, float],
    status: dict[str, str],
    errors: dict[str, float],
    copy_bytes_per_s: float | None,
    exp2_per_s: float | None,
) -> dict[str, Any]:
    """The JSON row of one (shape, direction): times, speedups, ceilings, errors."""
    ours = ms.get("ours")
    moved = scan_bytes(batch, dim, seqlen, d_state, itemsize, direction)
    bps = per_second(moved, ours)
    eps = per_second(scan_exps(batch, dim, seqlen, d_state), ours)
    mamba = MAMBA_SSM_MS.get((batch, seqlen), {}).get(direction) if (dim, d_state) == (DIM, D_STATE) else None
    mamba_ref = (
        MAMBA_REF_MS.get((batch, seqlen), {}).get(direction) if (dim, d_state) == (DIM, D_STATE) else None
    )
    naive = errors.get("naive")
    suspect = None
    if "ours" in errors and naive is not None:
        # "not <=" so that a NaN error is suspect too
        suspect = not (errors["ours"] <= SUSPECT_FACTOR[direction] * naive + errors.get("atol", 0.0))
    return {
        "batch": batch,
        "seqlen": seqlen,
        "dim": dim,
        "d_state": d_state,
        "direction": direction,
        "bytes": moved,
        "exps": scan_exps(batch, dim, seqlen, d_state),
        "ms": dict(ms),
        "status": dict(status),
        "mamba_ssm_ms": mamba,
        "mamba_ref_ms": mamba_ref,
        "speedup": {
            "vs_mamba_ssm": ratio(mamba, ours),
            "vs_reference": ratio(ms.get("reference"), ours),
            "vs_mamba_ref": ratio(mamba_ref, ours),
        },
        "bytes_per_s": bps,
        "fraction_of_copy": ratio(bps, copy_bytes_per_s),
        "exps_per_s": eps,
        "fraction_of_exp2": ratio(eps, exp2_per_s),
        "max_abs_err": {k: v for k, v in errors.items() if k != "atol"},
        "ours_err_suspect": suspect,
    }


def verdicts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets against the measured rows: one line per target that could be judged."""
    lines = []
    for row in rows:
        label = f"{row['batch']}x{row['seqlen']} {row['direction']}"
        vs_mamba = row["speedup"]["vs_mamba_ssm"]
        if vs_mamba is not None:
            ok = "met" if vs_mamba >= 1.0 else "MISSED"
            lines.append(f"  {label}: {vs_mamba:.2f}x mamba_ssm's CUDA kernel (target >= 1.0): {ok}")
        vs_ref = row["speedup"]["vs_reference"]
        if vs_ref is not None:
            ok = "met" if vs_ref >= REFERENCE_SPEEDUP_TARGET else "MISSED"
            lines.append(f"  {label}: {vs_ref:.1f}x the PyTorch reference (target >= 50): {ok}")
    return lines


# ----------------------------------------------------------------------------------------------
# Ceilings
# ----------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """Bytes per second of ``dst.copy_(src)`` (both read and write counted) on ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "bytes_per_s": 2 * nbytes / (ms * 1e-3)}


@functools.cache
def _exp2_chain_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def exp2_chain_kernel(X, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        """ITERS dependent exp2 per element, BLOCK elements per program (8 independent chains per
        thread at 4 warps): the multiply is 1 of the FP32 pipe's 32 lanes, the exp2 1 of the
        special-function unit's 4, so the loop runs at the exp2 rate."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs)
        for _ in range(ITERS):
            x = tl.exp2(x * -0.5)  # stays in (0, 1]
        tl.store(X + offs, x)

    return exp2_chain_kernel


def exp2_rate(iters: int = 4096, block: int = 1024) -> dict[str, float]:
    """Exponentials per second of the exp2 chain kernel over 8 programs per multiprocessor."""
    programs = 8 * torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 2
    x = torch.rand(programs * block, device=DEVICE)
    kernel = _exp2_chain_kernel()
    ms = bench_ms(lambda: kernel[(programs,)](x, ITERS=iters, BLOCK=block, num_warps=4))
    count = programs * block * iters
    return {"exps": count, "ms": ms, "exps_per_s": count / (ms * 1e-3)}


# ----------------------------------------------------------------------------------------------
# Scan
# ----------------------------------------------------------------------------------------------


def make_scan_inputs(
    batch: int, dim: int, seqlen: int, d_state: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Mamba-like inputs requiring grad: u, delta, z, B, C in ``dtype``; A = -(1..N) per channel
    (S4D-real), D = 1, fp32; delta around -2.5, so softplus(delta) ~ 0.08."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, mean=0.0, std=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * std + mean).to(dtype)

    inputs = {
        "u": randn(batch, dim, seqlen),
        "delta": randn(batch, dim, seqlen, mean=-2.5, std=0.5),
        "A": -torch.arange(1, d_state + 1, device=DEVICE, dtype=torch.float32).repeat(dim, 1),
        "B": randn(batch, d_state, seqlen),
        "C": randn(batch, d_state, seqlen),
        "D": torch.ones(dim, device=DEVICE),
        "z": randn(batch, dim, seqlen),
    }
    return {k: v.requires_grad_() for k, v in inputs.items()}


def scan_fn(provider: str) -> Callable:
    """``fn(**inputs) -> y`` of a provider (the issue's setting: z, D, softplus, no delta_bias)."""
    if provider == "ours":
        return functools.partial(kernels.selective_scan, delta_softplus=True, backend="triton")
    if provider == "reference":
        return functools.partial(reference.selective_scan, delta_softplus=True)
    raise ValueError(f"unknown provider {provider!r}; valid providers are {', '.join(PROVIDERS)}")


class Check:
    """float64 and 16-bit reference results on one slice: the first sequence, the first channels."""

    GRADS = ("u", "delta", "z")

    def __init__(self, inputs: dict[str, torch.Tensor], dy: torch.Tensor):
        channels = min(CHECK_CHANNELS, inputs["u"].shape[1])
        self.channels = channels
        sliced = self.slice_inputs(inputs)
        self.want = self._run({k: v.double() for k, v in sliced.items()}, self.take(dy).double())
        self.naive = self._run(sliced, self.take(dy))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, dim, L) -> the slice (1, channels, L)."""
        return x[:1, : self.channels]

    def slice_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The slice's inputs as new leaves: u, delta, z (1, channels, L); A, D of those channels;
        B, C of the first sequence."""
        per_channel = {"A": lambda t: t[: self.channels], "D": lambda t: t[: self.channels]}
        per_batch = {"B": lambda t: t[:1], "C": lambda t: t[:1]}
        return {
            k: per_channel.get(k, per_batch.get(k, self.take))(v).detach().clone().requires_grad_()
            for k, v in inputs.items()
        }

    def _run(self, inputs: dict[str, torch.Tensor], dy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The reference's y ("fwd") and du, ddelta, dz ("bwd", for the output gradient dy)."""
        y = reference.selective_scan(**inputs, delta_softplus=True)
        grads = torch.autograd.grad(y, [inputs[k] for k in self.GRADS], dy)
        return {"fwd": [y.detach()], "bwd": list(grads)}

    def errors(self, direction: str, got: Sequence[torch.Tensor]) -> dict[str, float]:
        """Max abs error of ours (the full tensors, restricted to the slice) and of the naive run,
        against float64, and the two-ulp atol of the test suite."""

        def max_err(xs: Sequence[torch.Tensor]) -> float:
            errs = [
                (x.double() - w).abs().max().item() for x, w in zip(xs, self.want[direction], strict=True)
            ]
            return math.nan if any(math.isnan(e) for e in errs) else max(errs)

        dtype = self.naive[direction][0].dtype
        magnitude = max(w.abs().max().item() for w in self.want[direction])
        return {
            "ours": max_err([self.take(x) for x in got]),
            "naive": max_err(self.naive[direction]),
            "atol": 2 * torch.finfo(dtype).eps * magnitude,
        }


def _measure(
    fn: Callable, direction: str, inputs: dict[str, torch.Tensor], dy: torch.Tensor, check: Check | None
) -> tuple[float, dict[str, float]]:
    """Warm up (and check, when ``check`` is given) one provider in one direction, then time it.

    ``fwd`` times ``fn(**inputs)``; ``bwd`` times only ``autograd.grad(y, inputs, dy, retain_graph=True)``
    on one forward. Returns (median ms, errors).
    """
    y = fn(**inputs)
    errors: dict[str, float] = {}
    if direction == "fwd":
        if check is not None:
            errors = check.errors("fwd", [y.detach()])
        y = None  # each timed forward builds its own graph
        return bench_ms(functools.partial(fn, **inputs)), errors
    if check is not None:
        grads = torch.autograd.grad(y, [inputs[k] for k in Check.GRADS], dy, retain_graph=True)
        errors = check.errors("bwd", grads)
        del grads
    return bench_ms(
        functools.partial(torch.autograd.grad, y, list(inputs.values()), dy, retain_graph=True)
    ), errors


def run_scan(
    batch: int,
    seqlen: int,
    *,
    dim: int,
    d_state: int,
    dtype: torch.dtype,
    providers: Sequence[str],
    ceilings: dict[str, Any],
) -> list[dict[str, Any]]:
    """Check and time every provider on one shape; returns the fwd and bwd rows."""
    inputs = make_scan_inputs(batch, dim, seqlen, d_state, dtype)
    dy = torch.randn(batch, dim, seqlen, device=DEVICE).to(dtype)
    check = Check(inputs, dy)
    res = {d: {"ms": {}, "status": {}, "err": {}} for d in DIRECTIONS}
    for name in providers:
        for direction in DIRECTIONS:
            caught: list[warnings.WarningMessage] = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ms, errors = _measure(
                        scan_fn(name), direction, inputs, dy, check if name == "ours" else None
                    )
                res[direction]["ms"][name] = ms
                res[direction]["err"].update(errors)
                res[direction]["status"][name] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
                res[direction]["status"][name] = "failed: " + short_reason(
                    exc, [str(w.message) for w in caught]
                )
            finally:
                torch.cuda.empty_cache()
    return [
        scan_row(
            batch,
            seqlen,
            d,
            dim=dim,
            d_state=d_state,
            itemsize=torch.finfo(dtype).bits // 8,
            ms=res[d]["ms"],
            status=res[d]["status"],
            errors=res[d]["err"],
            copy_bytes_per_s=ceilings["copy"]["bytes_per_s"],
            exp2_per_s=ceilings["exp2"]["exps_per_s"],
        )  # fmt: skip
        for d in DIRECTIONS
    ]


# ----------------------------------------------------------------------------------------------
# Decode and conv
# ----------------------------------------------------------------------------------------------


def run_decode(shape: tuple[int, int, int], dtype: torch.dtype, copy_bytes_per_s: float) -> dict[str, Any]:
    """Time one selective_state_update (fp32 state) and check it against the reference."""
    batch, dim, d_state = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=DEVICE, generator=gen).to(dt)

    state = randn(batch, dim, d_state, dt=torch.float32)
    args = dict(x=randn(batch, dim), dt=randn(batch, dim), B=randn(batch, d_state), C=randn(batch, d_state),
                z=randn(batch, dim))  # fmt: skip
    A = -torch.arange(1, d_state + 1, device=DEVICE, dtype=torch.float32).repeat(dim, 1)
    D, dt_bias = torch.ones(dim, device=DEVICE), torch.full((dim,), -2.5, device=DEVICE)
    want_state = state.clone()
    want = reference.selective_state_update(want_state, **args, A=A, D=D, dt_bias=dt_bias, dt_softplus=True)
    got_state = state.clone()
    got = kernels.selective_state_update(
        got_state, **args, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, backend="triton"
    )
    err = max((got.float() - want.float()).abs().max().item(), (got_state - want_state).abs().max().item())
    ms = bench_ms(
        lambda: kernels.selective_state_update(
            state, **args, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, backend="triton"
        )
    )
    moved = 2 * state.numel() * state.element_size()  # the state, read and written once
    bps = per_second(moved, ms)
    return {
        "batch": batch,
        "dim": dim,
        "d_state": d_state,
        "dtype": str(dtype).removeprefix("torch."),
        "state_bytes_moved": moved,
        "ms": ms,
        "bytes_per_s": bps,
        "fraction_of_copy": ratio(bps, copy_bytes_per_s),
        "target_fraction": COPY_TARGET,
        "max_abs_err": err,
    }


def mixer_multiply_add(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """The causal conv as mixers/common.py computed it before the Triton kernel (the baseline
    ``mixer_multiply_add``): d_conv shifted multiply-adds on the zero-padded input, in x's dtype."""
    d_conv = conv.kernel_size[0]
    x_padded = F.pad(x, (d_conv - 1, 0))  # (B, C, d_conv - 1 + T)
    T = x.shape[-1]
    weight = conv.weight[:, 0]  # (C, d_conv)
    out = sum(weight[:, i, None] * x_padded[..., i : i + T] for i in range(d_conv))
    return out if conv.bias is None else out + conv.bias[:, None]


def mixer_multiply_add_step(x: torch.Tensor, conv: nn.Conv1d, conv_state: torch.Tensor) -> torch.Tensor:
    """The decode step as mixers/common.py computed it before the Triton kernel: roll the window,
    append x, einsum with the taps in the window's dtype."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = torch.einsum("bcw,cw->bc", conv_state, conv.weight[:, 0].to(conv_state.dtype))  # (B, C)
    if conv.bias is not None:
        out = out + conv.bias.to(conv_state.dtype)
    return out.to(x.dtype)


# Providers whose times the conv rows' speedups are taken against: their name -> the row key.
CONV_BASELINES = {"torch_conv1d": "vs_torch_conv1d", "mixer_multiply_add": "vs_mixer_multiply_add"}


def conv_providers(conv: nn.Conv1d) -> dict[str, Callable]:
    """``fn(x) -> y`` on (batch, dim, L) of each causal-conv implementation (no activation)."""
    width = conv.kernel_size[0]

    def torch_conv1d(x):
        return F.conv1d(x, conv.weight, conv.bias, padding=width - 1, groups=conv.in_channels)[
            ..., : x.shape[-1]
        ]

    def triton_causal_conv1d(x):
        return kernels.causal_conv1d(x, conv.weight[:, 0], conv.bias, backend="triton")

    return {
        "torch_conv1d": torch_conv1d,
        "mixer_multiply_add": functools.partial(mixer_multiply_add, conv=conv),
        "triton_causal_conv1d": triton_causal_conv1d,
    }


def _conv_key(row: dict[str, Any]) -> tuple:
    """What two conv rows must share to be compared: shape, width, layout and direction."""
    return (row["batch"], row["dim"], row.get("seqlen", 1), row["width"], row.get("layout"), row["direction"])


def add_conv_speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the conv rows with ``speedup``: for each baseline in ``CONV_BASELINES`` its time
    over the row's, at the same shape, layout and direction (None where that baseline did not run; a decode
    step's old-mixer baseline is ``mixer_multiply_add_step``)."""
    times = {}
    for r in rows:
        provider = r["provider"].removesuffix("_step")
        times[(provider, *_conv_key(r))] = r["ms"]
    out = []
    for r in rows:
        key = _conv_key(r)
        speedup = {name: ratio(times.get((base, *key)), r["ms"]) for base, name in CONV_BASELINES.items()}
        out.append({**r, "speedup": speedup})
    return out


def conv_table_row(row: dict[str, Any]) -> list[str]:
    """One printed line of the conv part (see :func:`conv_table_header`)."""
    return [
        row["provider"],
        f"{row['batch']}x{row['dim']}x{row.get('seqlen', 1)}",
        row.get("layout", "-"),
        row["direction"],
        fmt_ms(row["ms"]),
        fmt_rate(row["bytes_per_s"]),
        fmt_pct(row["fraction_of_copy"]),
        fmt_ratio(row.get("speedup", {}).get("vs_torch_conv1d")),
        fmt_ratio(row.get("speedup", {}).get("vs_mixer_multiply_add")),
        fmt_sci(row.get("max_abs_err")),
    ]


def conv_table_header() -> list[str]:
    """Column names of the conv table."""
    return ["provider", "BxDxL", "layout", "dir", "ms", "TB/s", "of copy", "x torch", "x old mixer", "err"]


# Memory layouts of the conv's (batch, dim, L) input: ``contiguous`` (time fastest) and
# ``channel_last``, the transposed view of a (batch, L, dim) tensor that the mamba mixer passes (its
# in_proj output, channels fastest).
CONV_LAYOUTS = ("contiguous", "channel_last")


def conv_input(batch: int, dim: int, seqlen: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A random (batch, dim, seqlen) leaf tensor requiring grad, in one of ``CONV_LAYOUTS``.

    Raises:
        ValueError: unknown ``layout``.
    """
    if layout == "contiguous":
        x = torch.randn(batch, dim, seqlen, device=DEVICE, dtype=dtype)
    elif layout == "channel_last":
        x = torch.randn(batch, seqlen, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        raise ValueError(f"unknown conv layout {layout!r}; use one of {CONV_LAYOUTS}")
    return x.requires_grad_()


def run_conv(
    batch: int,
    seqlen: int,
    dim: int,
    width: int,
    dtype: torch.dtype,
    copy_bytes_per_s: float,
    layout: str = "contiguous",
) -> list[dict[str, Any]]:
    """Forward and backward of each causal-conv implementation at one shape and input layout (one
    of ``CONV_LAYOUTS``); bytes = x read and y written (forward), x and dy read and dx written
    (backward). Forward rows carry the max abs error of y on the first sequence against the float64
    reference."""
    conv = nn.Conv1d(dim, dim, width, groups=dim, device=DEVICE, dtype=dtype)
    x = conv_input(batch, dim, seqlen, dtype, layout)
    dy = torch.randn_like(x)
    with torch.no_grad():
        want = reference.causal_conv1d(x[:1].double(), conv.weight[:, 0].double(), conv.bias.double())
    itemsize = torch.finfo(dtype).bits // 8
    rows = []
    for name, fn in conv_providers(conv).items():
        y = fn(x)
        err = (y[:1].double() - want).abs().max().item()
        for direction, moved in (("fwd", 2), ("bwd", 3)):
            if direction == "fwd":
                ms = bench_ms(functools.partial(fn, x))
            else:
                ms = bench_ms(
                    functools.partial(
                        torch.autograd.grad, y, (x, conv.weight, conv.bias), dy, retain_graph=True
                    )
                )
            nbytes = moved * batch * dim * seqlen * itemsize
            bps = per_second(nbytes, ms)
            rows.append({"provider": name, "batch": batch, "seqlen": seqlen, "dim": dim, "width": width,
                         "layout": layout, "direction": direction, "bytes": nbytes, "ms": ms, "bytes_per_s": bps,
                         "fraction_of_copy": ratio(bps, copy_bytes_per_s),
                         "max_abs_err": err if direction == "fwd" else None})  # fmt: skip
        del y
        torch.cuda.empty_cache()
    return rows


def run_conv_step(
    shape: tuple[int, int, int], width: int, dtype: torch.dtype, copy_bytes_per_s: float
) -> list[dict[str, Any]]:
    """The decode update, old mixer step and Triton kernel: the fp32 window read and written, x
    read, y written. Each row carries its max abs error against the float64 reference step."""
    batch, dim, _ = shape
    conv = nn.Conv1d(dim, dim, width, groups=dim, device=DEVICE, dtype=dtype)
    x = torch.randn(batch, dim, device=DEVICE, dtype=dtype)
    window = torch.randn(batch, dim, width, device=DEVICE)
    want_window = window.double()
    with torch.no_grad():
        want = reference.causal_conv1d_update(
            x.double(), want_window, conv.weight[:, 0].double(), conv.bias.double()
        )
    providers = {
        "mixer_multiply_add_step": lambda w: mixer_multiply_add_step(x, conv, w),
        "triton_causal_conv1d_update": lambda w: kernels.causal_conv1d_update(
            x, w, conv.weight[:, 0], conv.bias, backend="triton"
        ),
    }
    nbytes = 2 * window.numel() * 4 + 2 * x.numel() * x.element_size()
    rows = []
    for name, fn in providers.items():
        with torch.no_grad():
            err = (fn(window.clone()).double() - want).abs().max().item()
            state = window.clone()
            ms = bench_ms(lambda fn=fn, state=state: fn(state))
        bps = per_second(nbytes, ms)
        rows.append({"provider": name, "batch": batch, "dim": dim, "width": width, "direction": "step",
                     "bytes": nbytes, "ms": ms, "bytes_per_s": bps, "fraction_of_copy": ratio(bps, copy_bytes_per_s),
                     "max_abs_err": err})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); exits with a usage error on bad shapes or sizes."""
    parser = argparse.ArgumentParser(
        description="Time mixerlab's Triton selective scan against the PyTorch reference and mamba_ssm's figures.",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8x2048 only, no conv")
    parser.add_argument("--shapes", nargs="+", help="BxL scan shapes (default 32x2048 8x8192 8x2048)")
    parser.add_argument("--dim", type=int, default=DIM, help=f"channels (default {DIM})")
    parser.add_argument("--d-state", type=int, default=D_STATE, help=f"N (default {D_STATE})")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--decode", help="BxDxN of the decode step (default 1024x4096x16)")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--conv-width", type=int, default=CONV_WIDTH, help="causal conv width (default 4)")
    parser.add_argument("--no-conv", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--name", help="results name (default selective-scan, selective-scan-quick with --quick)"
    )
    args = parser.parse_args(argv)
    try:
        args.shapes = (
            [parse_shape(s) for s in args.shapes]
            if args.shapes
            else list(QUICK_SHAPES if args.quick else SHAPES)
        )
        args.decode = parse_shape(args.decode, parts=3) if args.decode else DECODE
    except ValueError as exc:
        parser.error(str(exc))
    if args.dim <= 0 or args.d_state <= 0:
        parser.error("--dim and --d-state must be positive")
    if not 2 <= args.conv_width <= 4:
        parser.error("--conv-width must be 2, 3 or 4 (the Mamba block's range)")
    args.no_conv = args.no_conv or args.quick
    args.providers = list(dict.fromkeys(args.providers))
    args.name = args.name or ("selective-scan-quick" if args.quick else "selective-scan")
    check_out_dir(parser, args.out)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ceilings, scan, decode and conv parts; print the tables and write the JSON record."""
    args = parse_args(argv)
    require_cuda("benchmarks/selective_scan.py")
    dtype = DTYPES[args.dtype]
    path = results_path(args.name, args.out)
    info = versions()
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"{args.dtype} | results -> {path}", flush=True)  # fmt: skip
    settings = {
        "dtype": args.dtype,
        "dim": args.dim,
        "d_state": args.d_state,
        "shapes": [list(s) for s in args.shapes],
        "providers": args.providers,
        "options": "z, D, delta_softplus=True, no delta_bias; A = -(1..N); softplus(delta) ~ 0.08",
        "decode": None if args.no_decode else list(args.decode),
        "conv_width": None if args.no_conv else args.conv_width,
        "conv": "no activation; providers triton_causal_conv1d(_update), torch_conv1d, mixer_multiply_add(_step) "
        "(the pre-kernel mixer path); speedups = baseline ms / row ms",
        "quick": args.quick,
        "bytes": "fwd: u, delta, z, B, C read + y written; bwd: + dout read, du, ddelta, dz, dB, dC written",
        "exps": "batch * dim * L * N per direction",
        "mamba_ssm_ms": {f"{b}x{t}": v for (b, t), v in MAMBA_SSM_MS.items()},
        "mamba_ref_ms": {f"{b}x{t}": v for (b, t), v in MAMBA_REF_MS.items()},
        "timing": {
            "tool": "triton.testing.do_bench",
            "return_mode": "median",
            "warmup_ms": DO_BENCH_WARMUP_MS,
            "rep_ms": DO_BENCH_REP_MS,
        },  # fmt: skip
        "check": f"max abs error vs float64 reference on (first sequence, first {CHECK_CHANNELS} channels)",
    }
    start = time.perf_counter()
    ceilings = {"copy": copy_bandwidth(), "exp2": exp2_rate()}
    print(f"copy {ceilings['copy']['bytes_per_s'] / 1e12:.2f} TB/s | exp2 {ceilings['exp2']['exps_per_s'] / 1e12:.2f} "
          "T/s", flush=True)  # fmt: skip
    payload: dict[str, Any] = {"benchmark": "selective_scan", "versions": info, "settings": settings,
                               "ceilings": ceilings, "scan_rows": [], "decode": None, "conv_rows": []}  # fmt: skip

    for i, (batch, seqlen) in enumerate(args.shapes, 1):
        t0 = time.perf_counter()
        new = run_scan(batch, seqlen, dim=args.dim, d_state=args.d_state, dtype=dtype, providers=args.providers,
                       ceilings=ceilings)  # fmt: skip
        payload["scan_rows"] += new
        fwd, bwd = new
        print(f"[{i}/{len(args.shapes)}] scan {batch}x{seqlen} {time.perf_counter() - t0:.1f}s | ours "
              f"{fmt_ms(fwd['ms'].get('ours'))} / {fmt_ms(bwd['ms'].get('ours'))} ms | reference "
              f"{fmt_ms(fwd['ms'].get('reference'))} / {fmt_ms(bwd['ms'].get('reference'))} ms", flush=True)  # fmt: skip
        write_json(path, payload)
    if not args.no_decode:
        payload["decode"] = run_decode(args.decode, dtype, ceilings["copy"]["bytes_per_s"])
        write_json(path, payload)
    if not args.no_conv:
        for (batch, seqlen), layout in itertools.product(args.shapes, CONV_LAYOUTS):
            payload["conv_rows"] += run_conv(batch, seqlen, args.dim, args.conv_width, dtype,
                                             ceilings["copy"]["bytes_per_s"], layout)  # fmt: skip
        payload["conv_rows"] += run_conv_step(
            args.decode, args.conv_width, dtype, ceilings["copy"]["bytes_per_s"]
        )
        payload["conv_rows"] = add_conv_speedups(payload["conv_rows"])
        write_json(path, payload)

    print()
    print(
        f"scan ({args.dtype}, dim {args.dim}, N {args.d_state}); x X = X's time over ours; TB/s and T exp/s are ours,"
    )
    print(
        "against the copy bandwidth and the exp2 rate measured above; err = max abs error vs float64 on a slice,"
    )
    print("'!' = ours beyond 2x (fwd) / 3x (bwd) the naive error + 2 ulps\n")
    print(format_table(scan_table_header(), [scan_table_row(r) for r in payload["scan_rows"]]))
    judged = verdicts(payload["scan_rows"])
    if judged:
        print("\nthe issue's targets:")
        print("\n".join(judged))
    if payload["decode"] is not None:
        dec = payload["decode"]
        print(f"\ndecode: selective_state_update {dec['batch']}x{dec['dim']}x{dec['d_state']} (fp32 state, "
              f"{dec['state_bytes_moved'] / 1e6:.0f} MB moved) {dec['ms']:.3f} ms = {fmt_rate(dec['bytes_per_s'])} TB/s, "
              f"{fmt_pct(dec['fraction_of_copy'])} of copy (target >= {COPY_TARGET:.0%}); max abs err vs reference "
              f"{fmt_sci(dec['max_abs_err'])}")  # fmt: skip
    if payload["conv_rows"]:
        print(f"\ncausal depthwise conv1d (width {args.conv_width}, no activation), bandwidth against copy; "
              "x torch / x old mixer = F.conv1d's / the old multiply-add path's time over the row's; "
              "err = max abs error vs float64 (y on the first sequence; the step's y)")  # fmt: skip
        print(format_table(conv_table_header(), [conv_table_row(r) for r in payload["conv_rows"]]))
    failures = sorted(
        {f"  {p}: {s}" for r in payload["scan_rows"] for p, s in r["status"].items() if s != "ok"}
    )
    if failures:
        print("\nnot measured:")
        print("\n".join(failures))
    print(f"\n{len(payload['scan_rows'])} scan rows in {time.perf_counter() - start:.0f}s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention benchmark: mixerlab's Triton FlashAttention against PyTorch's public kernels.

    python benchmarks/attention.py                 # full sweep (~minutes on an H200)
    python benchmarks/attention.py --quick         # smoke run: head dim 128, seqlen 1k and 4k
    python benchmarks/attention.py --head-dims 128 --seqlens 2048 8192 --modes causal

Follows flash-attention's ``benchmarks/benchmark_flash_attention.py`` and DESIGN.md ("Measuring"):
bf16, 16k tokens per batch (``batch = 16384 // seqlen``), ``heads = 2048 // head_dim``, modes
non-causal / causal / causal sliding window (1024), forward and backward. FLOPs are
``4 * batch * heads * head_dim * visible_pairs`` (= ``4·batch·heads·seqlen²·head_dim`` non-causal;
the exact count of visible query-key pairs under a causal mask or a window); backward = 2.5 x forward.
The backward is timed alone: one forward with ``requires_grad``, then
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` repeated. The forward is timed
with inputs that require grad (the training forward, as flash-attention's benchmark does).

Providers, all in this process, each measured with ``triton.testing.do_bench`` (median, L2 flushed)
after a warm-up call that also autotunes / compiles:

- ``ours``: ``kernels.flash_attention(q, k, v, causal=..., window=..., backend="triton")``;
- ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` on transposed views with the
  backend pinned by ``sdpa_kernel``. SDPA has no sliding window, so these are ``n/a`` in window mode
  (a masked run would be a different kernel, and must not be labelled flash);
- ``flex``: ``flex_attention`` under ``torch.compile(dynamic=False)``, with a block mask built once
  per (mode, seqlen) outside the timed region (``q_idx >= kv_idx``, and ``q_idx - kv_idx < window``).

Before timing, every provider's output and gradients on one (batch, 2 heads) slice are compared to
an fp32 reference (:func:`kernels.reference.flash_attention`) and the max abs error is printed, so a
fast-but-wrong kernel shows: ``ours`` is flagged ``!`` when its error exceeds 2x (forward) / 3x
(backward) the best baseline's. A provider that fails records the reason in its row (the run goes
on). Prints a table of TFLOP/s with ours/baseline ratios and writes every row, with versions, to
``benchmarks/results/<date>-<gpu>-attention.json`` (``...-attention-quick.json`` for ``--quick``),
rewritten atomically after each config so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
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

import kernels  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DO_BENCH_REP_MS,
    DO_BENCH_WARMUP_MS,
    RESULTS_DIR,
    bench_ms,
    check_out_dir,
    fmt_ratio,
    fmt_sci,
    fmt_tflops,
    format_table,
    ratio,
    require_cuda,
    results_path,
    short_reason,
    tflops,
    versions,
    write_json,
)
from kernels import reference  # noqa: E402

TOKENS = 16384  # tokens per batch: batch = TOKENS // seqlen
MODEL_DIM = 2048  # heads = MODEL_DIM // head_dim
WINDOW = 1024
MODES = ("noncausal", "causal", "window")
HEAD_DIMS = (64, 128)
SEQLENS = (1024, 2048, 4096, 8192, 16384)
QUICK_HEAD_DIMS = (128,)
QUICK_SEQLENS = (1024, 4096)
PROVIDERS = ("ours", "sdpa_flash", "sdpa_cudnn", "flex")
BASELINES = PROVIDERS[1:]
DIRECTIONS = ("fwd", "bwd")
BWD_FLOPS_FACTOR = 2.5  # backward = 2.5 x forward (flash-attention's convention)
# ours is flagged when its max abs error exceeds this multiple of the best baseline's
# (DESIGN.md's tolerances: 2x forward, 3x backward).
SUSPECT_FACTOR = {"fwd": 2.0, "bwd": 3.0}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: int | None = None) -> int:
    """Number of (query, key) pairs attention computes under mixerlab's masks (DESIGN.md).

    Non-causal: every pair, ``seqlen_q * seqlen_k``. Causal (bottom-right aligned): query ``i`` sees
    key ``j`` iff ``j <= a_i`` with ``a_i = i + seqlen_k - seqlen_q``; a window ``w`` also needs
    ``j > a_i - w``. Since ``a_i <= seqlen_k - 1``, query ``i`` sees ``min(a_i + 1, w)`` keys when
    ``a_i >= 0`` and none otherwise, so with ``m = a_i + 1`` the count is
    ``sum_{m = max(1, seqlen_k - seqlen_q + 1)}^{seqlen_k} min(m, w)``, summed in closed form.

    Raises:
        TypeError: non-integer lengths or window.
        ValueError: negative lengths, ``window <= 0``, or a window with ``causal=False``.
    """
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool):
            raise TypeError(f"window must be an int or None, got {window!r}")
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        if not causal:
            raise ValueError("a window is only defined together with causal=True")
    if not causal:
        return seqlen_q * seqlen_k

    def prefix(n: int) -> int:  # sum_{m=1}^{n} min(m, window)
        if n <= 0:
            return 0
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    lo = max(1, seqlen_k - seqlen_q + 1)
    return prefix(seqlen_k) - prefix(lo - 1)


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, mode: str, window: int) -> int:
    """Forward FLOPs: ``4 * batch * heads * head_dim * visible_pairs`` (two matmuls, 2 FLOPs per MAC)."""
    causal, win = mode_mask(mode, window)
    return 4 * batch * heads * head_dim * visible_pairs(seqlen, seqlen, causal, win)


def mode_mask(mode: str, window: int) -> tuple[bool, int | None]:
    """``(causal, window)`` for a mode name."""
    if mode == "noncausal":
        return False, None
    if mode == "causal":
        return True, None
    if mode == "window":
        return True, window
    raise ValueError(f"unknown mode {mode!r}; valid modes are {', '.join(MODES)}")


# ----------------------------------------------------------------------------------------------
# Providers: fn(q, k, v) with q, k, v (B, T, H, D) -> o (B, T, H, D)
# ----------------------------------------------------------------------------------------------


class NotApplicable(Exception):
    """The provider has no kernel for this config (recorded as ``n/a``, not as a failure)."""


@functools.cache
def _flex_compiled() -> Callable:
    """``flex_attention`` compiled once for the whole run; dynamo re-specialises it per shape and mask.

    dynamic=False gives flex its fastest (shape-specialised) kernels; the recompile limit is raised
    so that the sweep's shapes never fall back to the eager (materialising) path.
    """
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    limit = 4 * len(MODES) * len(HEAD_DIMS) * len(SEQLENS)
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, limit)
    else:  # older torch
        config.cache_size_limit = max(config.cache_size_limit, limit)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * limit)
    return torch.compile(flex_attention, dynamic=False)


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def _window_mask(window: int) -> Callable:
    """Causal sliding window counting the current token: query p sees keys ``p - window < j <= p``.

    Cached so every block mask of one window shares the same mask_mod (dynamo guards on its identity).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


@functools.cache
def flex_block_mask(seqlen: int, mode: str, window: int):
    """The block mask for (seqlen, mode), built once and reused by every head dim; None if non-causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    causal, win = mode_mask(mode, window)
    if not causal:
        return None
    mask_mod = _causal_mask if win is None else _window_mask(win)
    return create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")


def make_provider(name: str, mode: str, seqlen: int, window: int) -> Callable:
    """``fn(q, k, v) -> o`` for provider ``name``; raises :class:`NotApplicable` if it has no kernel."""
    causal, win = mode_mask(mode, window)
    if name == "ours":

        def ours(q, k, v):
            return kernels.flash_attention(q, k, v, causal=causal, window=win, backend="triton")

        return ours
    if name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if win is not None:
            raise NotApplicable("SDPA has no sliding-window kernel")
        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel(backend):  # only this backend: no silent fallback to another kernel
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
                )  # (B, H, T, D)
            return o.transpose(1, 2)

        return sdpa
    if name == "flex":
        flex = _flex_compiled()
        block_mask = flex_block_mask(seqlen, mode, window)

        def flex_fn(q, k, v):
            o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
            return o.transpose(1, 2)

        return flex_fn
    raise ValueError(f"unknown provider {name!r}; valid providers are {', '.join(PROVIDERS)}")


# ----------------------------------------------------------------------------------------------
# One config: correctness check, then timings
# ----------------------------------------------------------------------------------------------


class Check:
    """fp32 reference output and gradients on one slice: the last sequence, heads 0 and H-1.

    Attention is independent across sequences and heads, so a provider's output and gradients
    restricted to the slice must match the reference computed on the slice alone (cheap even at 16k).
    """

    def __init__(self, q, k, v, dout, causal: bool, window: int | None):
        batch, _, heads, _ = q.shape
        self.b = batch - 1
        self.heads = torch.tensor([0, heads - 1] if heads > 1 else [0], device=q.device)
        ref_in = [self.take(x).detach().requires_grad_() for x in (q, k, v)]
        out = reference.flash_attention(*ref_in, causal=causal, window=window)
        self.grads = torch.autograd.grad(out, ref_in, self.take(dout))  # dq, dk, dv on the slice
        self.out = out.detach()

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) -> the slice (1, T, h, D) in fp32."""
        return x[self.b : self.b + 1].index_select(2, self.heads).float()

    def max_abs_err(self, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
        """Largest |got - want| over the slice of every tensor of ``got`` (NaN if any is NaN)."""
        errs = [(self.take(g) - w).abs().max().item() for g, w in zip(got, want, strict=True)]
        return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def _measure(fn: Callable, direction: str, qkv, dout, check: Check) -> tuple[float, float, float]:
    """Warm up, check and time one provider in one direction.

    The warm-up call (autotuning / compilation) is also the checked one. ``fwd`` times ``fn(q, k, v)``;
    ``bwd`` times only ``autograd.grad(out, (q, k, v), dout, retain_graph=True)`` on one forward.

    Returns:
        (max abs error vs the reference, median ms, seconds of the warm-up call).
    """
    t0 = time.perf_counter()
    out = fn(*qkv)
    if direction == "fwd":
        err = check.max_abs_err([out.detach()], [check.out])
        out = None  # each timed forward builds its own graph
        timed = functools.partial(fn, *qkv)
    else:
        grads = torch.autograd.grad(out, qkv, dout, retain_graph=True)
        err = check.max_abs_err(grads, check.grads)
        del grads
        timed = functools.partial(torch.autograd.grad, out, qkv, dout, retain_graph=True)
    warm = time.perf_counter() - t0  # max_abs_err's .item() synchronised
    return err, bench_ms(timed), warm


def run_config(
    mode: str, head_dim: int, seqlen: int, *, providers: Sequence[str], window: int, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Check and time every provider on one (mode, head_dim, seqlen); returns the fwd and bwd rows."""
    batch, heads = max(1, TOKENS // seqlen), MODEL_DIM // head_dim
    causal, win = mode_mask(mode, window)
    fwd_flops = attention_flops(batch, heads, seqlen, head_dim, mode, window)
    flops = {"fwd": fwd_flops, "bwd": BWD_FLOPS_FACTOR * fwd_flops}

    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = functools.partial(
        torch.randn, batch, seqlen, heads, head_dim, device="cuda", dtype=dtype, generator=gen
    )
    q, k, v = (randn().requires_grad_() for _ in range(3))  # (B, T, H, D)
    dout = randn()

    check = Check(q, k, v, dout, causal, win)

    res = {d: {"ms": {}, "status": {}, "err": {}, "warmup_s": {}} for d in DIRECTIONS}
    for name in providers:
        try:
            fn = make_provider(name, mode, seqlen, window)
        except NotApplicable as err:
            for d in DIRECTIONS:
                res[d]["status"][name] = f"n/a: {err}"
            continue
        for direction in DIRECTIONS:
            caught: list[warnings.WarningMessage] = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    err, ms, warm = _measure(fn, direction, (q, k, v), dout, check)
                res[direction]["err"][name] = err
                res[direction]["ms"][name] = ms
                res[direction]["warmup_s"][name] = warm
                res[direction]["status"][name] = "ok"
            except NotApplicable as exc:
                res[direction]["status"][name] = f"n/a: {exc}"
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the sweep goes on
                reason = short_reason(exc, [str(w.message) for w in caught])
                res[direction]["status"][name] = "failed: " + reason
            finally:
                torch.cuda.empty_cache()

    rows = []
    for direction in DIRECTIONS:
        r = res[direction]
        tf = {p: tflops(flops[direction], r["ms"].get(p)) for p in providers}
        errs = r["err"]
        base_errs = [errs[p] for p in BASELINES if p in errs and r["status"].get(p) == "ok"]
        best_base = min(base_errs) if base_errs else None
        suspect = None
        if "ours" in errs and best_base is not None:
            # "not <=" so that a NaN error is suspect too
            suspect = not (errs["ours"] <= SUSPECT_FACTOR[direction] * best_base)
        rows.append(
            {
                "mode": mode,
                "window": win,
                "head_dim": head_dim,
                "seqlen": seqlen,
                "batch": batch,
                "heads": heads,
                "dtype": str(dtype).removeprefix("torch."),
                "direction": direction,
                "flops": flops[direction],
                "tflops": tf,
                "ms": {p: r["ms"].get(p) for p in providers},
                "status": {p: r["status"].get(p, "not run") for p in providers},
                "ratio": {f"ours/{p}": ratio(tf.get("ours"), tf.get(p)) for p in BASELINES if p in providers},
                "max_abs_err": {p: errs.get(p) for p in providers},
                "best_baseline_err": best_base,
                "ours_err_suspect": suspect,
                "warmup_s": {p: r["warmup_s"].get(p) for p in providers},
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def table_header(providers: Sequence[str]) -> list[str]:
    """The printed table's column names for ``providers`` (ratios ours / each baseline timed)."""
    ratios = [f"ours/{p}" for p in BASELINES if "ours" in providers and p in providers]
    return ["mode", "hd", "seqlen", "dir", *providers, *ratios, "err ours", "err best base"]


def table_row(row: dict[str, Any], providers: Sequence[str]) -> list[str]:
    """One printed line: TFLOP/s per provider (``n/a`` / ``fail``), ratios, max abs errors."""

    def cell(p: str) -> str:
        status = row["status"][p]
        if status == "ok":
            return fmt_tflops(row["tflops"][p])
        return "n/a" if status.startswith("n/a") else "fail"

    ratios = [
        fmt_ratio(row["ratio"][f"ours/{p}"]) for p in BASELINES if "ours" in providers and p in providers
    ]
    err_ours = fmt_sci(row["max_abs_err"].get("ours"))
    if row["ours_err_suspect"]:
        err_ours += "!"
    mode = f"window{row['window']}" if row["window"] is not None else row["mode"]
    return [
        mode,
        row["head_dim"],
        row["seqlen"],
        row["direction"],
        *[cell(p) for p in providers],
        *ratios,
        err_ours,
        fmt_sci(row["best_baseline_err"]),
    ]


def failure_summary(rows: Sequence[dict[str, Any]], providers: Sequence[str]) -> list[str]:
    """Each distinct non-ok status per provider, with how many rows it affected."""
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        for p in providers:
            status = row["status"][p]
            if status != "ok":
                counts[(p, status)] = counts.get((p, status), 0) + 1
    return [f"  {p}: {status} ({n} rows)" for (p, status), n in counts.items()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options (``--help`` lists them)."""
    parser = argparse.ArgumentParser(
        description="Time mixerlab's Triton FlashAttention against SDPA (flash, cuDNN) and compiled FlexAttention.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: head dim 128, seqlens 1024 and 4096 (unless given)"
    )
    parser.add_argument("--head-dims", type=int, nargs="+", help=f"default {' '.join(map(str, HEAD_DIMS))}")
    parser.add_argument("--seqlens", type=int, nargs="+", help=f"default {' '.join(map(str, SEQLENS))}")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--window", type=int, default=WINDOW, help="sliding window of the window mode")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--name",
        help="results name: <date>-<gpu>-<name>.json (default attention, attention-quick with --quick)",
    )
    args = parser.parse_args(argv)
    args.head_dims = args.head_dims or list(QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    args.name = args.name or ("attention-quick" if args.quick else "attention")
    for hd in args.head_dims:
        if not 0 < hd <= MODEL_DIM:
            parser.error(f"--head-dims: {hd} is not in 1..{MODEL_DIM}")
    for t in args.seqlens:
        if t <= 0:
            parser.error(f"--seqlens: {t} is not positive")
    if args.window <= 0:
        parser.error("--window must be positive")
    check_out_dir(parser, args.out)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its table and write its JSON; returns the exit status."""
    args = parse_args(argv)
    require_cuda("benchmarks/attention.py")
    dtype = DTYPES[args.dtype]
    providers = list(dict.fromkeys(args.providers))
    path = results_path(args.name, args.out)
    info = versions()
    print(
        f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
        f"cuDNN {info['cudnn']} | {args.dtype} | results -> {path}",
        flush=True,
    )
    settings = {
        "dtype": args.dtype,
        "tokens_per_batch": TOKENS,
        "model_dim": MODEL_DIM,
        "window": args.window,
        "modes": args.modes,
        "head_dims": args.head_dims,
        "seqlens": args.seqlens,
        "providers": providers,
        "quick": args.quick,
        "flops": "fwd = 4*batch*heads*head_dim*visible_pairs; bwd = 2.5*fwd",
        "timing": {
            "tool": "triton.testing.do_bench",
            "return_mode": "median",
            "warmup_ms": DO_BENCH_WARMUP_MS,
            "rep_ms": DO_BENCH_REP_MS,
        },
        "check": "max abs error vs fp32 kernels.reference.flash_attention on (last batch, heads 0 and H-1)",
    }

    configs = [(m, hd, t) for m in args.modes for hd in args.head_dims for t in args.seqlens]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, (mode, hd, t) in enumerate(configs, 1):
        t0 = time.perf_counter()
        new = run_config(mode, hd, t, providers=providers, window=args.window, dtype=dtype)
        rows += new
        fwd, bwd = new
        errs = "  ".join(
            f"{p} {fmt_sci(fwd['max_abs_err'][p])}/{fmt_sci(bwd['max_abs_err'][p])}" for p in providers
        )
        speed = "  ".join(
            f"{p} {fmt_tflops(fwd['tflops'][p])}/{fmt_tflops(bwd['tflops'][p])}" for p in providers
        )
        flag = "  <-- ours' error is suspect" if fwd["ours_err_suspect"] or bwd["ours_err_suspect"] else ""
        print(
            f"[{i}/{len(configs)}] {mode} hd={hd} T={t} (B={fwd['batch']} H={fwd['heads']}) "
            f"{time.perf_counter() - t0:.1f}s | max abs err fwd/bwd vs fp32 ref: {errs}{flag} | "
            f"TFLOP/s fwd/bwd: {speed}",
            flush=True,
        )
        write_json(path, {"benchmark": "attention", "versions": info, "settings": settings, "rows": rows})

    print()
    print(f"TFLOP/s ({args.dtype}; higher is better); ours/X = ours' TFLOP/s over X's; err = max abs error")
    print("vs the fp32 reference (fwd: output, bwd: dq/dk/dv); '!' = ours beyond 2x/3x the best baseline's\n")
    print(format_table(table_header(providers), [table_row(r, providers) for r in rows]))
    failures = failure_summary(rows, providers)
    if failures:
        print("\nnot measured:")
        print("\n".join(failures))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f}s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

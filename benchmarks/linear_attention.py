"""Linear-attention benchmark: mixerlab's chunked Triton kernels against fla-core's chunk_linear_attn
and our causal FlashAttention at the same shapes, plus the decode step against copy bandwidth.

    python benchmarks/linear_attention.py            # issue shapes, T sweep (crossover), decode
    python benchmarks/linear_attention.py --quick    # smoke run: first shape, sweep 1k / 4k, decode
    python benchmarks/linear_attention.py --shapes 2x8192x16x128 --no-sweep --no-decode

Three parts, each in bf16 unless ``--dtype fp16``, on one process and GPU:

1. **Shapes** (``--shapes``, ``BxTxHxD`` or ``BxTxHxKxV``; default the issue's 2x8192x16x128 and
   8x2048x32x64), forward and backward, providers:

   - ``ours``: ``kernels.linear_attention(q, k, v, normalize=False, backend="triton")``;
   - ``ours_norm``: the same with ``normalize=True`` (the issue's target: within 1.15x of ``ours``);
   - ``fla``: fla-core's ``chunk_linear_attn(q, k, v, scale=K**-0.5, normalize=False)`` (same layout
     (B, T, H, K), same formula), ``n/a`` when fla-core is not installed;
   - ``fla_norm``: the same with ``normalize=True`` (fla-core's default), the public baseline of
     ``ours_norm``: fla divides the unnormalised output by q . cumsum(k) formed in separate passes
     (a cumulative sum of K in K's dtype, then PyTorch elementwise ops), where ours forms the
     denominator inside the chunked kernels;
   - ``flash``: our causal FlashAttention ``kernels.flash_attention(q, k, v, causal=True)`` with
     head dim K (``n/a`` when K != V), the exact attention the linear form replaces.

2. **Sweep** of T (``--seqlens``; default 256..16384) at 16k tokens per batch (``batch = 16384 //
   T``, as the attention benchmark), ``--sweep-heads`` heads of dim ``--sweep-dim``: causal
   FlashAttention costs O(T) per token, linear attention O(1), so past some length the linear form
   wins. The **crossover** is reported per direction (fwd, bwd, fwd+bwd): the first measured T from
   which ``ours`` stays faster than ``flash``, and an estimate interpolating log(time ratio)
   linearly in log T between the two measured lengths around it.

3. **Decode** (``--decode``, ``BxHxKxV``; default 256x16x128x128, an fp32 state of 268 MB, well
   above L2): one ``linear_attention_step`` without and with the normaliser, counted on the state
   bytes read and written (2 x B H K V x 4), against the copy bandwidth of a same-size
   ``dst.copy_(src)`` measured in the same run (the issue's target: at least 70%).

Timing follows benchmarks/attention.py (DESIGN.md "Measuring"): ``triton.testing.do_bench`` median
with the L2 flushed, after a warm-up call that also autotunes / compiles; every provider and
direction of a row is warmed up and checked first, then timed in ``--rounds`` interleaved rounds
(default 3) and reported as the median over rounds (every round in the JSON's ``ms_rounds``),
because timings of the same code drifted between runs far more than the gaps being measured
(:func:`time_rounds`); the backward is timed
alone, ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` on one forward; forwards
are timed with inputs that require grad. q and k are positive feature maps (elu + 1 of a Gaussian,
the mixer's default), so normalising is well defined; v is Gaussian.

**GPU time** (``--no-graph`` skips it): every provider is timed a second time with no host
overhead, captured in a CUDA graph (:func:`benchmarks.common.bench_graph_ms`, L2 flushed), the
forward alone and forward + backward, in the same interleaved rounds; the graph backward is
their difference per round (:func:`graph_backward_rounds`). Why: an eager call also waits on the
host's launch work, which on the H200 machine was longer than some kernels (2026-12-01, B2 T8192
H16 D128: 200 us of host time per forward call against 153 us on the GPU), so eager figures hide
GPU-side differences like the normaliser's cost; rows keep both (``ms`` eager, ``graph_ms``).

Correctness column: before timing, every provider's output and gradients on one slice (last
sequence, heads 0 and H-1) are compared with an fp32 reference of its own op
(:func:`kernels.reference.linear_attention` with the provider's ``normalize``, or
:func:`kernels.reference.flash_attention`) and the max abs error is printed; ``ours`` is flagged
``!`` when its error exceeds 2x (forward) / 3x (backward) fla's. Writes every row, the crossover and
the decode figures, with versions (fla-core's included), to
``benchmarks/results/<date>-<gpu>-linear-attention.json`` (``...-quick.json`` for ``--quick``),
rewritten after each config so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
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
    bench_graph_ms,
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

SHAPES = ((2, 8192, 16, 128, 128), (8, 2048, 32, 64, 64))  # (B, T, H, K, V): the targets
SEQLENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
SWEEP_TOKENS = 16384  # tokens per batch in the sweep: batch = SWEEP_TOKENS // T
SWEEP_HEADS = 16
SWEEP_DIM = 128
DECODE = (256, 16, 128, 128)  # (B, H, K, V)
QUICK_SEQLENS = (1024, 4096)
PROVIDERS = ("ours", "ours_norm", "fla", "fla_norm", "flash")
NORMALISED = ("ours_norm", "fla_norm")  # providers computing the normalised op
DIRECTIONS = ("fwd", "bwd")
# ours is flagged when its max abs error exceeds this multiple of fla's (DESIGN.md's tolerances).
SUSPECT_FACTOR = {"fwd": 2.0, "bwd": 3.0}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COPY_TARGET = 0.7  # the decode target: fraction of the copy bandwidth
ROUNDS = 3  # interleaved timing rounds per row (time_rounds)


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested on CPU)
# ----------------------------------------------------------------------------------------------


def parse_shape(text: str, parts: int = 4) -> tuple[int, ...]:
    """``"2x8192x16x128"`` -> (2, 8192, 16, 128, 128) (K = V = the last) or ``"BxTxHxKxV"`` as given;
    with ``parts=3``, ``"BxHxD"`` -> (B, H, D, D) or ``"BxHxKxV"`` (the decode shape).

    Raises:
        ValueError: not ``parts`` or ``parts + 1`` positive integers separated by ``x``.
    """
    try:
        dims = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (parts, parts + 1) or any(d <= 0 for d in dims):
        names = "BxTxHxD or BxTxHxKxV" if parts == 4 else "BxHxD or BxHxKxV"
        raise ValueError(f"shape {text!r}: expected {names} with positive integers")
    return dims if len(dims) == parts + 1 else (*dims, dims[-1])


def crossover(seqlens: Sequence[int], ours_ms: Sequence[float | None], other_ms: Sequence[float | None]):
    """Where ``ours`` becomes faster than ``other`` along a sweep of sequence lengths.

    Points where either time is missing are ignored. ``first_faster`` is the smallest measured T
    from which ours is faster at every larger measured T; ``estimate`` interpolates
    ``log(other / ours)`` linearly in ``log T`` between that T and the previous measured one, and
    returns the T where the ratio crosses 1 (None when ours is already faster at the shortest T, or
    never). ``note`` says which case applies.

    Returns:
        ``{"first_faster": int | None, "estimate": float | None, "note": str}``.
    """
    points = sorted(
        (t, o, x)
        for t, o, x in zip(seqlens, ours_ms, other_ms, strict=True)
        if o is not None and x is not None
    )
    if not points:
        return {"first_faster": None, "estimate": None, "note": "no length measured by both"}
    start = next((i for i in range(len(points)) if all(o < x for _, o, x in points[i:])), None)
    if start is None:
        return {"first_faster": None, "estimate": None, "note": f"slower up to T={points[-1][0]}"}
    if start == 0:
        return {
            "first_faster": points[0][0],
            "estimate": None,
            "note": f"faster from the shortest measured T={points[0][0]}",
        }
    (t0, o0, x0), (t1, o1, x1) = points[start - 1], points[start]
    r0, r1 = math.log(x0 / o0), math.log(x1 / o1)  # r0 <= 0 < r1
    frac = -r0 / (r1 - r0)
    estimate = math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0)))
    return {"first_faster": t1, "estimate": estimate, "note": f"between T={t0} and T={t1}"}


def shape_label(batch: int, seqlen: int, heads: int, k_dim: int, v_dim: int) -> str:
    """``B2 T8192 H16 K128 V128``-style label; ``D128`` when K == V."""
    dims = f"D{k_dim}" if k_dim == v_dim else f"K{k_dim} V{v_dim}"
    return f"B{batch} T{seqlen} H{heads} {dims}"


def fmt_ms(value: float | None) -> str:
    """A time cell in ms with three decimals (``"0.267"``); ``"-"`` when missing."""
    return "-" if value is None else f"{value:.3f}"


def table_header() -> list[str]:
    """The printed table's column names (times in ms, ratios, max abs errors)."""
    return [
        "part", "shape", "dir", *(f"{p} ms" for p in PROVIDERS), "x fla", "x flash", "norm/raw",
        "norm x fla_norm", "err ours", "err fla",
    ]  # fmt: skip


def table_row(row: dict[str, Any], timing: str = "ms") -> list[str]:
    """One printed line: ms per provider (``n/a`` / ``fail``), ours' speedups over fla and flash
    (their time over ours), the normalised-over-raw time, max abs errors (``!``: ours suspect);
    eager times with ``timing="ms"``, GPU times with ``"graph_ms"`` (``-``: not measured)."""
    speedup = row["speedup"] if timing == "ms" else row["graph_speedup"]

    def cell(p: str) -> str:
        status = row["status"].get(p, "n/a (not asked for: --providers)")
        if status == "ok":
            return fmt_ms(row[timing].get(p))
        return "n/a" if status.startswith("n/a") else "fail"

    err_ours = fmt_sci(row["max_abs_err"].get("ours"))
    if row["ours_err_suspect"]:
        err_ours += "!"
    return [
        row["part"],
        shape_label(row["batch"], row["seqlen"], row["heads"], row["k_dim"], row["v_dim"]),
        row["direction"],
        *[cell(p) for p in PROVIDERS],
        fmt_ratio(speedup["vs_fla"]),
        fmt_ratio(speedup["vs_flash"]),
        fmt_ratio(speedup["norm_over_raw"]),
        fmt_ratio(speedup["norm_vs_fla_norm"]),
        err_ours,
        fmt_sci(row["max_abs_err"].get("fla")),
    ]


def speedups(ms: dict[str, float | None]) -> dict[str, float | None]:
    """ours' speedup over fla and flash (their time over ours'), the normalised-over-raw time
    (a slowdown) and ours_norm's speedup over fla_norm from one row's provider -> ms; None where a
    time is missing."""
    return {
        "vs_fla": ratio(ms.get("fla"), ms.get("ours")),
        "vs_flash": ratio(ms.get("flash"), ms.get("ours")),
        "norm_over_raw": ratio(ms.get("ours_norm"), ms.get("ours")),
        "norm_vs_fla_norm": ratio(ms.get("fla_norm"), ms.get("ours_norm")),
    }


def graph_backward_rounds(fwd: Sequence[float], fwd_bwd: Sequence[float]) -> list[float]:
    """Per-round backward time in ms from the graph times of the forward alone and of forward +
    backward measured in the same rounds (a captured backward needs its forward in the graph)."""
    if len(fwd) != len(fwd_bwd):
        raise ValueError(f"{len(fwd)} forward rounds but {len(fwd_bwd)} forward + backward rounds")
    return [both - alone for alone, both in zip(fwd, fwd_bwd, strict=True)]


def sweep_crossovers(rows: Sequence[dict[str, Any]], timing: str = "ms") -> dict[str, dict[str, Any]]:
    """Crossover of ours vs flash per direction (and fwd+bwd) over the sweep's rows, on the eager
    times (``timing="ms"``) or the GPU times (``"graph_ms"``)."""
    sweep = [r for r in rows if r["part"] == "sweep"]
    result = {}
    for direction in (*DIRECTIONS, "fwd+bwd"):
        by_t: dict[int, list[float | None]] = {}
        for r in sweep:
            if direction in (r["direction"], "fwd+bwd"):
                ours, flash = r[timing].get("ours"), r[timing].get("flash")
                acc = by_t.setdefault(r["seqlen"], [0.0, 0.0])
                acc[0] = None if acc[0] is None or ours is None else acc[0] + ours
                acc[1] = None if acc[1] is None or flash is None else acc[1] + flash
        seqlens = sorted(by_t)
        result[direction] = crossover(seqlens, [by_t[t][0] for t in seqlens], [by_t[t][1] for t in seqlens])
    return result


# ----------------------------------------------------------------------------------------------
# Providers: fn(q, k, v) with q, k (B, T, H, K), v (B, T, H, V) -> o (B, T, H, V)
# ----------------------------------------------------------------------------------------------


class NotApplicable(Exception):
    """The provider has no kernel for this config (recorded as ``n/a``, not as a failure)."""


def make_provider(name: str, k_dim: int, v_dim: int) -> Callable:
    """``fn(q, k, v) -> o`` for provider ``name``; raises :class:`NotApplicable` if it has none."""
    scale = k_dim**-0.5
    if name in ("ours", "ours_norm"):
        return functools.partial(
            kernels.linear_attention, scale=scale, normalize=name == "ours_norm", backend="triton"
        )
    if name in ("fla", "fla_norm"):
        try:
            from fla.ops.linear_attn import chunk_linear_attn
        except ImportError as exc:
            raise NotApplicable(f"fla-core is not installed ({exc})") from exc

        def fla(q, k, v):
            return chunk_linear_attn(q, k, v, scale=scale, normalize=name == "fla_norm")[0]

        return fla
    if name == "flash":
        if k_dim != v_dim:
            raise NotApplicable("FlashAttention needs K == V")
        return functools.partial(kernels.flash_attention, causal=True, backend="triton")
    raise ValueError(f"unknown provider {name!r}; valid providers are {', '.join(PROVIDERS)}")


def reference_fn(name: str, k_dim: int) -> Callable:
    """The fp32 reference of provider ``name``'s op."""
    if name == "flash":
        return functools.partial(reference.flash_attention, causal=True)
    return functools.partial(reference.linear_attention, scale=k_dim**-0.5, normalize=name in NORMALISED)


# ----------------------------------------------------------------------------------------------
# One config: correctness check, then timings
# ----------------------------------------------------------------------------------------------


class Check:
    """fp32 reference outputs and gradients on one slice (the last sequence, heads 0 and H-1), per
    reference op, computed once and shared by the providers that use it."""

    def __init__(self, q, k, v, dout):
        batch, _, heads, _ = q.shape
        self.b = batch - 1
        self.heads = torch.tensor([0, heads - 1] if heads > 1 else [0], device=q.device)
        self.inputs = [self.take(x).detach() for x in (q, k, v)]
        self.dout = self.take(dout)
        self.k_dim = q.shape[3]
        self._cache: dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) -> the slice (1, T, h, D) in fp32."""
        return x[self.b : self.b + 1].index_select(2, self.heads).float()

    def expected(self, provider: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(output, (dq, dk, dv)) of the provider's reference op on the slice."""
        key = "flash" if provider == "flash" else ("norm" if provider in NORMALISED else "raw")
        if key not in self._cache:
            leaves = [x.clone().requires_grad_() for x in self.inputs]
            out = reference_fn(provider, self.k_dim)(*leaves)
            grads = torch.autograd.grad(out, leaves, self.dout)
            self._cache[key] = (out.detach(), grads)
        return self._cache[key]

    def max_abs_err(self, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
        """Largest |got - want| over the slice of every tensor of ``got`` (NaN if any is NaN)."""
        errs = [(self.take(g) - w).abs().max().item() for g, w in zip(got, want, strict=True)]
        return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def _prepare(
    name: str, fn: Callable, direction: str, qkv, dout, check: Check
) -> tuple[float, Callable, float]:
    """Warm up (autotune, compile) and check one provider in one direction.

    Returns:
        (max abs error vs the reference, the callable to time, seconds of the warm-up call).
        The backward's callable reuses one forward's graph (``retain_graph=True``).
    """
    t0 = time.perf_counter()
    out = fn(*qkv)
    want_out, want_grads = check.expected(name)
    if direction == "fwd":
        err = check.max_abs_err([out.detach()], [want_out])
        out = None  # each timed forward builds its own graph
        timed = functools.partial(fn, *qkv)
    else:
        grads = torch.autograd.grad(out, qkv, dout, retain_graph=True)
        err = check.max_abs_err(grads, want_grads)
        del grads
        timed = functools.partial(torch.autograd.grad, out, qkv, dout, retain_graph=True)
    return err, timed, time.perf_counter() - t0


def _forward_backward(fn: Callable, qkv: tuple[torch.Tensor, ...], dout: torch.Tensor):
    """dq, dk, dv of ``fn(*qkv)`` with output gradient ``dout``: forward and backward in one call,
    the unit a CUDA graph can capture."""
    return torch.autograd.grad(fn(*qkv), qkv, dout)


def time_rounds(
    timed: dict[Any, Callable[[], Any]],
    rounds: int,
    bench: Callable[[Callable[[], Any]], float] | None = None,
) -> tuple[dict[Any, list[float]], dict[Any, Exception]]:
    """Time every callable of ``timed`` once per round, the rounds interleaved (a, b, c, a, b, c, ...).

    Why: the same kernel's do_bench median moved by up to 50% between runs on the H200
    (2026-12-01), so every provider of a row is measured in each round and a provider's figure is
    the median over rounds: a drift in clocks or in a neighbour's load then shifts all providers
    of a round alike instead of whichever happened to run during it.

    Args:
        timed: key -> zero-argument callable (already warmed up).
        rounds: number of rounds (>= 1).
        bench: ``fn -> ms`` (default :func:`benchmarks.common.bench_ms`).

    Returns:
        (key -> per-round times in ms, in round order; key -> the exception that stopped it). A key
        whose call raises is left out of the later rounds and keeps the times measured before.

    Raises:
        ValueError: rounds < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    bench = bench or bench_ms
    times: dict[Any, list[float]] = {key: [] for key in timed}
    errors: dict[Any, Exception] = {}
    for _ in range(rounds):
        for key, fn in timed.items():
            if key in errors:
                continue
            try:
                times[key].append(bench(fn))
            except Exception as exc:  # noqa: BLE001 - reported per key by the caller
                errors[key] = exc
    return times, errors


def make_inputs(batch: int, seqlen: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype):
    """q, k (positive features, elu + 1), v and dout, all requiring grad except dout."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(dim):
        return torch.randn(batch, seqlen, heads, dim, device="cuda", generator=gen)

    q = (F.elu(randn(k_dim)) + 1).to(dtype).requires_grad_()
    k = (F.elu(randn(k_dim)) + 1).to(dtype).requires_grad_()
    v = randn(v_dim).to(dtype).requires_grad_()
    return q, k, v, randn(v_dim).to(dtype)


def run_config(
    part: str,
    shape: tuple[int, int, int, int, int],
    *,
    providers: Sequence[str],
    dtype: torch.dtype,
    rounds: int = 1,
    graph: bool = True,
) -> list[dict[str, Any]]:
    """Check every provider on one (B, T, H, K, V), then time them in ``rounds`` interleaved rounds
    (:func:`time_rounds`), eagerly and, with ``graph``, in CUDA graphs; returns the fwd and bwd
    rows, ``ms`` / ``graph_ms`` the medians over rounds (``graph_ms`` values None when not run)."""
    batch, seqlen, heads, k_dim, v_dim = shape
    q, k, v, dout = make_inputs(batch, seqlen, heads, k_dim, v_dim, dtype)
    check = Check(q, k, v, dout)
    res = {
        d: {
            "ms": {},
            "rounds": {},
            "graph_rounds": {},
            "graph_status": {},
            "status": {},
            "err": {},
            "warmup_s": {},
        }
        for d in DIRECTIONS
    }
    timed: dict[tuple[str, str], Callable[[], Any]] = {}
    fns: dict[str, Callable] = {}
    for name in providers:
        try:
            fn = fns[name] = make_provider(name, k_dim, v_dim)
        except NotApplicable as exc:
            for d in DIRECTIONS:
                res[d]["status"][name] = f"n/a: {exc}"
            continue
        for direction in DIRECTIONS:
            caught: list[warnings.WarningMessage] = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    err, timed[(name, direction)], warm = _prepare(
                        name, fn, direction, (q, k, v), dout, check
                    )
                res[direction]["err"][name] = err
                res[direction]["warmup_s"][name] = warm
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
                res[direction]["status"][name] = "failed: " + short_reason(
                    exc, [str(w.message) for w in caught]
                )
    times, errors = time_rounds(timed, rounds)
    for (name, direction), exc in errors.items():
        res[direction]["status"][name] = "failed: " + short_reason(exc, [])
    timed.clear()
    if graph:
        ok = [n for n in fns if all(res[d]["status"].get(n) is None for d in DIRECTIONS)]
        for name in ok:
            timed[(name, "fwd")] = functools.partial(fns[name], q, k, v)
            timed[(name, "fwd+bwd")] = functools.partial(_forward_backward, fns[name], (q, k, v), dout)
        graph_times, graph_errors = time_rounds(timed, rounds, bench=bench_graph_ms)
        for name in ok:
            exc = graph_errors.get((name, "fwd")) or graph_errors.get((name, "fwd+bwd"))
            if exc is not None:
                for d in DIRECTIONS:
                    res[d]["graph_status"][name] = "failed: " + short_reason(exc, [])
                continue
            fwd, fwd_bwd = graph_times[(name, "fwd")], graph_times[(name, "fwd+bwd")]
            res["fwd"]["graph_rounds"][name] = fwd
            res["bwd"]["graph_rounds"][name] = graph_backward_rounds(fwd, fwd_bwd)
            for d in DIRECTIONS:
                res[d]["graph_status"][name] = "ok"
    for (name, direction), per_round in times.items():
        if per_round and (name, direction) not in errors:
            res[direction]["rounds"][name] = per_round
    for direction in DIRECTIONS:
        r = res[direction]
        for name, per_round in r["rounds"].items():
            r["ms"][name] = statistics.median(per_round)
            r["status"][name] = "ok"
    torch.cuda.empty_cache()

    rows = []
    for direction in DIRECTIONS:
        r = res[direction]
        ms = {p: r["ms"].get(p) for p in providers}
        graph_ms = {
            p: statistics.median(r["graph_rounds"][p]) if p in r["graph_rounds"] and p in r["ms"] else None
            for p in providers
        }
        errs = r["err"]
        suspect = None
        if "ours" in errs and "fla" in errs:
            suspect = not (errs["ours"] <= SUSPECT_FACTOR[direction] * errs["fla"])  # NaN is suspect too
        rows.append(
            {
                "part": part,
                "batch": batch,
                "seqlen": seqlen,
                "heads": heads,
                "k_dim": k_dim,
                "v_dim": v_dim,
                "dtype": str(dtype).removeprefix("torch."),
                "direction": direction,
                "ms": ms,
                "ms_rounds": {p: r["rounds"].get(p) for p in providers},
                "status": {p: r["status"].get(p, "not run") for p in providers},
                "speedup": speedups(ms),
                "graph_ms": graph_ms,
                "graph_ms_rounds": {p: r["graph_rounds"].get(p) for p in providers},
                "graph_status": {p: r["graph_status"].get(p, "not run") for p in providers},
                "graph_speedup": speedups(graph_ms),
                "max_abs_err": {p: errs.get(p) for p in providers},
                "ours_err_suspect": suspect,
                "warmup_s": {p: r["warmup_s"].get(p) for p in providers},
            }
        )
    return rows


def run_decode(shape: tuple[int, int, int, int], dtype: torch.dtype) -> dict[str, Any]:
    """Time the decode step (without / with the normaliser) and a same-size copy; check one step."""
    batch, heads, k_dim, v_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (
        (F.elu(torch.randn(batch, heads, k_dim, device="cuda", generator=gen)) + 1).to(dtype)
        for _ in range(2)
    )
    v = torch.randn(batch, heads, v_dim, device="cuda", generator=gen).to(dtype)
    state = torch.randn(batch, heads, k_dim, v_dim, device="cuda", generator=gen)
    z = torch.rand(batch, heads, k_dim, device="cuda", generator=gen) * 10

    want_state, want_z = state.clone(), z.clone()
    want = reference.linear_attention_step(q, k, v, want_state, z_state=want_z)
    got = kernels.linear_attention_step(q, k, v, state, z_state=z, backend="triton")
    err = max(
        (got.float() - want.float()).abs().max().item(),
        (state - want_state).abs().max().item(),
        (z - want_z).abs().max().item(),
    )

    state_bytes = 2 * state.numel() * state.element_size()  # read + written once
    raw_ms = bench_ms(lambda: kernels.linear_attention_step(q, k, v, state, backend="triton"))
    norm_ms = bench_ms(lambda: kernels.linear_attention_step(q, k, v, state, z_state=z, backend="triton"))
    src = torch.empty_like(state)
    dst = torch.empty_like(state)
    copy_ms = bench_ms(lambda: dst.copy_(src))

    def gbps(ms: float) -> float:
        return state_bytes / (ms * 1e-3) / 1e9

    return {
        "batch": batch,
        "heads": heads,
        "k_dim": k_dim,
        "v_dim": v_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "state_bytes_moved": state_bytes,
        "ms": {"step": raw_ms, "step_norm": norm_ms, "copy": copy_ms},
        "gb_per_s": {"step": gbps(raw_ms), "step_norm": gbps(norm_ms), "copy": gbps(copy_ms)},
        "fraction_of_copy": {"step": copy_ms / raw_ms, "step_norm": copy_ms / norm_ms},
        "target_fraction": COPY_TARGET,
        "max_abs_err": err,
    }


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options (``--help`` lists them)."""
    parser = argparse.ArgumentParser(
        description="Time mixerlab's Triton linear attention against fla-core and causal FlashAttention.",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: first shape, sweep 1k / 4k")
    parser.add_argument("--shapes", nargs="+", help="BxTxHxD or BxTxHxKxV (default: the issue's two)")
    parser.add_argument("--seqlens", type=int, nargs="+", help=f"sweep lengths (default {SEQLENS})")
    parser.add_argument("--sweep-heads", type=int, default=SWEEP_HEADS)
    parser.add_argument("--sweep-dim", type=int, default=SWEEP_DIM, help="K = V of the sweep")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--decode", help="BxHxKxV of the decode step (default 256x16x128x128)")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument(
        "--no-graph", action="store_true", help="eager timings only (no CUDA-graph GPU times)"
    )
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS,
        help=f"interleaved timing rounds per row, the median reported (default {ROUNDS})",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--name", help="results name (default linear-attention, linear-attention-quick with --quick)"
    )
    args = parser.parse_args(argv)
    try:
        args.shapes = (
            [parse_shape(s) for s in args.shapes]
            if args.shapes
            else list(SHAPES[:1] if args.quick else SHAPES)
        )
        args.decode = parse_shape(args.decode, parts=3) if args.decode else DECODE
    except ValueError as exc:
        parser.error(str(exc))
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    for t in args.seqlens:
        if t <= 0:
            parser.error(f"--seqlens: {t} is not positive")
    if args.sweep_heads <= 0 or args.sweep_dim <= 0:
        parser.error("--sweep-heads and --sweep-dim must be positive")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    args.providers = list(dict.fromkeys(args.providers))
    args.name = args.name or ("linear-attention-quick" if args.quick else "linear-attention")
    check_out_dir(parser, args.out)
    return args


def _fla_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its table and write its JSON; returns the exit status."""
    args = parse_args(argv)
    require_cuda("benchmarks/linear_attention.py")
    dtype = DTYPES[args.dtype]
    path = results_path(args.name, args.out)
    info = {**versions(), "fla_core": _fla_version()}
    print(
        f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
        f"fla-core {info['fla_core']} | {args.dtype} | results -> {path}",
        flush=True,
    )
    settings = {
        "dtype": args.dtype,
        "shapes": args.shapes,
        "sweep": None
        if args.no_sweep
        else {
            "seqlens": args.seqlens,
            "tokens_per_batch": SWEEP_TOKENS,
            "heads": args.sweep_heads,
            "dim": args.sweep_dim,
        },  # fmt: skip
        "decode": None if args.no_decode else args.decode,
        "providers": args.providers,
        "quick": args.quick,
        "timing": {
            "tool": "triton.testing.do_bench",
            "return_mode": "median",
            "warmup_ms": DO_BENCH_WARMUP_MS,
            "rep_ms": DO_BENCH_REP_MS,
            "rounds": args.rounds,
            "ms": "median over the rounds of each provider's do_bench median (ms_rounds: every round)",
        },
        "graph_timing": None
        if args.no_graph
        else (
            "benchmarks.common.bench_graph_ms in the same rounds (L2 flushed by a 256 MB read, no host overhead); "
            "graph_ms: fwd = the forward's graph, bwd = the forward + backward graph minus the forward's, "
            "per round, then the median"
        ),
        "check": "max abs error vs the fp32 reference of each provider's op on (last batch, heads 0 and H-1)",
        "speedup": (
            "X's ms over ours' ms (> 1: ours faster); norm_over_raw = ours_norm ms / ours ms; "
            "norm_vs_fla_norm = fla_norm ms / ours_norm ms"
        ),
    }
    configs = [("shape", s) for s in args.shapes]
    if not args.no_sweep:
        d = args.sweep_dim
        configs += [("sweep", (max(1, SWEEP_TOKENS // t), t, args.sweep_heads, d, d)) for t in args.seqlens]

    record: dict[str, Any] = {"benchmark": "linear_attention", "versions": info, "settings": settings}
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, (part, shape) in enumerate(configs, 1):
        t0 = time.perf_counter()
        new = run_config(
            part, shape, providers=args.providers, dtype=dtype, rounds=args.rounds, graph=not args.no_graph
        )
        rows += new
        times = "  ".join(f"{p} {fmt_ms(new[0]['ms'][p])}/{fmt_ms(new[1]['ms'][p])}" for p in args.providers)
        errs = "  ".join(
            f"{p} {fmt_sci(new[0]['max_abs_err'][p])}/{fmt_sci(new[1]['max_abs_err'][p])}"
            for p in args.providers
        )
        print(
            f"[{i}/{len(configs)}] {part} {shape_label(*shape)} {time.perf_counter() - t0:.1f}s | "
            f"ms fwd/bwd: {times} | max abs err fwd/bwd: {errs}",
            flush=True,
        )
        record["rows"] = rows
        write_json(path, record)

    if not args.no_sweep:
        record["crossover_vs_flash"] = sweep_crossovers(rows)
        if not args.no_graph:
            record["crossover_vs_flash_graph"] = sweep_crossovers(rows, "graph_ms")
    if not args.no_decode:
        record["decode"] = run_decode(args.decode, dtype)
    write_json(path, record)

    print(f"\nms ({args.dtype}; lower is better); x X = X's ms over ours' (ours' speedup); norm/raw = ours")
    print("normalised over unnormalised; norm x fla_norm = fla_norm's ms over ours_norm's; err = max abs")
    print("error vs the fp32 reference of the provider's op")
    print("(fwd: output, bwd: dq/dk/dv); '!' = ours beyond 2x/3x fla's\n")
    print(format_table(table_header(), [table_row(r) for r in rows]))
    if not args.no_graph:
        print("\nGPU time: the same, captured in CUDA graphs (no host overhead; bwd = fwd+bwd - fwd)\n")
        print(format_table(table_header(), [table_row(r, "graph_ms") for r in rows]))
    failures = sorted(
        {f"  {p}: {r['status'][p]}" for r in rows for p in args.providers if r["status"][p] != "ok"}
        | {
            f"  {p} (CUDA graph): {r['graph_status'][p]}"
            for r in rows
            for p in args.providers
            if r["graph_status"][p].startswith("failed")
        }
    )
    if failures:
        print("\nnot measured:")
        print("\n".join(failures))
    if not args.no_sweep:
        print(f"\ncrossover of ours vs causal FlashAttention (sweep: {SWEEP_TOKENS} tokens per batch):")
        crossings = [("eager", record["crossover_vs_flash"])]
        if not args.no_graph:
            crossings.append(("GPU time", record["crossover_vs_flash_graph"]))
        print(
            format_table(
                ["timing", "dir", "first faster T", "estimated T", "note"],
                [
                    [
                        timing,
                        d,
                        c["first_faster"],
                        None if c["estimate"] is None else f"{c['estimate']:.0f}",
                        c["note"],
                    ]
                    for timing, cross in crossings
                    for d, c in cross.items()
                ],
            )
        )
    if not args.no_decode:
        dec = record["decode"]
        print(
            f"\ndecode step B={dec['batch']} H={dec['heads']} K={dec['k_dim']} V={dec['v_dim']} "
            f"(fp32 state, {dec['state_bytes_moved'] / 1e6:.0f} MB moved): "
            f"{dec['ms']['step']:.3f} ms = {dec['gb_per_s']['step']:.0f} GB/s "
            f"({dec['fraction_of_copy']['step']:.0%} of copy), normalised {dec['ms']['step_norm']:.3f} ms "
            f"({dec['fraction_of_copy']['step_norm']:.0%}); copy {dec['gb_per_s']['copy']:.0f} GB/s; "
            f"target {COPY_TARGET:.0%}; max abs err {fmt_sci(dec['max_abs_err'])}"
        )
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f}s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

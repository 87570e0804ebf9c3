"""Decode-attention benchmark: mixerlab's split-K FlashDecoding kernel against SDPA and a KV read.

    python benchmarks/decode.py                 # full sweep: batch 1 and 8, KV length 2k..128k
    python benchmarks/decode.py --quick         # smoke run: batch 1, KV length 8k and 32k
    python benchmarks/decode.py --batches 1 --seqlens 8192 32768 --page-size 16
    python benchmarks/decode.py --batches 1 --seqlens 8192 --num-splits 16 32 60 96 128  # split sweep
    python benchmarks/decode.py --quick --flush zero   # graph timing after a zero-fill L2 flush (dirty lines)

The issue's setting (issue 6): one query token per sequence, 32 query heads over 8 KV heads, head
dim 128, bf16, every sequence of the batch at the full KV length. Providers, all in this process,
each timed with ``triton.testing.do_bench`` (median, L2 flushed before every repetition) after a
warm-up call (compilation; its tiles come from ``kernels.flash_decode.split_config``):

- ``ours``: ``kernels.flash_decode(..., check_values=False, backend="triton")`` (as the mixers call
  it: no device sync to check the table's values) on a contiguous cache (one page of the whole
  length per sequence) and ``ours_paged`` on a pool of ``--page-size`` pages handed out in
  shuffled order (the target: within 5% of contiguous);
- ``sdpa_gqa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with its default
  backend choice, and ``sdpa_flash`` with the flash backend pinned (``sdpa_kernel``);
- ``sdpa_repeat``: SDPA after ``repeat_interleave`` of the KV heads (the copy is timed: it is what a
  caller without GQA support pays);
- ``ours_splits<N>`` (with ``--num-splits N ...``): ``ours`` with ``num_splits=N`` forced instead of
  :func:`kernels.flash_decode.num_splits_heuristic`'s choice, to tune the heuristic against SDPA
  in the same process;
- ``read``: one ``copy_`` of the K and V caches: its bandwidth (bytes read + written over time) is
  the copy bandwidth the kernels' KV-read bandwidth is compared with (the issue's 85% target);
- ``read_kv``: one Triton launch that reads K and V once and sums them into a few KB
  (:func:`read_kv`), no dependent loads and no softmax: the time below which no decode kernel
  reading the same bytes can go. ``sdpa_gqa / read_kv`` (the ``ceiling`` column) bounds the speedup
  over SDPA any kernel could reach at that shape.

KV-read bandwidth = ``2 * batch * seqlen * Hkv * D * itemsize`` bytes (K and V, each read once)
over the time. Before timing, each provider's output is compared with the fp32 reference
(:func:`kernels.reference.flash_decode`). Every provider is also timed captured in a CUDA graph
(:func:`benchmarks.common.bench_graph_ms`, the L2 evicted before each call by a 256 MB read; ``--flush
zero`` zero-fills instead, as ``do_bench`` does, leaving dirty lines that the timed kernel writes back:
6-8 us more per call from 134 MB of KV on the H200): a Triton launch from Python costs far more host time
than the kernel takes at small KV lengths, and graph-captured decode (``LanguageModel.generate``)
pays none of it; the host time of one eager call (:func:`benchmarks.common.host_us`: launches
issued back to back without waiting for the GPU) shows how much of an eager time is the host's.
Prints three tables, eager and graph (µs, TB/s, ours / SDPA, SDPA / read_kv, fraction of the copy
bandwidth) and host µs per call and writes every row, with versions, to
``benchmarks/results/<date>-<gpu>-decode.json`` (``decode-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DO_BENCH_REP_MS,
    DO_BENCH_WARMUP_MS,
    FLUSH_MODES,
    RESULTS_DIR,
    bench_graph_ms,
    bench_ms,
    check_out_dir,
    fmt_ratio,
    fmt_sci,
    format_table,
    host_us,
    ratio,
    require_cuda,
    results_path,
    short_reason,
    versions,
    write_json,
)
from kernels import reference  # noqa: E402
from kernels._host import cdiv  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 8)
SEQLENS = (2048, 8192, 32768, 131072)
QUICK_BATCHES = (1,)
QUICK_SEQLENS = (8192, 32768)
PAGE_SIZE = 64
PROVIDERS = ("ours", "ours_paged", "sdpa_gqa", "sdpa_flash", "sdpa_repeat", "read", "read_kv")
# Providers that return no attention output (not checked against the reference).
READ_PROVIDERS = ("read", "read_kv")
# read_kv's launch: 1024-element tiles at 4 warps, n // READ_KV_ELEMENTS programs clamped to
# [READ_KV_MIN_PROGRAMS, READ_KV_MAX_PROGRAMS]: the fastest of 3 tile shapes x 4 program counts
# (256-2048) at B1 2k / 8k / 32k and B8 8k on the H200 (2026-12-02, graph timing after the read
# flush; `benchmarks/results/2026-12-02-nvidia-h200-decode-read-floor.json`).
READ_KV_BLOCK = 1024
READ_KV_ELEMENTS = 8192
READ_KV_MIN_PROGRAMS = 512
READ_KV_MAX_PROGRAMS = 2048


def kv_bytes(batch: int, seqlen: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V a decode step must read: ``2 * batch * seqlen * Hkv * D * itemsize``."""
    return 2 * batch * seqlen * num_kv_heads * head_dim * itemsize


def tb_per_s(nbytes: float, us: float | None) -> float | None:
    """Bandwidth in TB/s (10^12 bytes/s) of ``nbytes`` moved in ``us`` microseconds."""
    if us is None or us <= 0:
        return None
    return nbytes / (us * 1e-6) / 1e12


@triton.jit
def read_kv_kernel(K, V, OUT, n, per_program, BLOCK: tl.constexpr):
    """Sum of K[i] + V[i] over this program's ``per_program`` elements of the flat K and V into
    OUT[pid, :BLOCK] (fp32); grid (programs,)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        mask = offs < n
        acc += tl.load(K + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + pid * BLOCK + tl.arange(0, BLOCK), acc)


def read_kv(k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read contiguous ``k`` and ``v`` (same shape and dtype) once, in one launch: the KV-read floor.

    Returns (programs, READ_KV_BLOCK) fp32 partial sums of ``k + v`` (their total is
    ``(k.float() + v.float()).sum()``); ``out`` of that shape is reused when given, as a CUDA graph
    needs. Every element is loaded once, in contiguous 1024-element tiles with no dependent load.

    Raises:
        ValueError: ``k`` and ``v`` differ in shape or dtype or are not contiguous, or ``out`` has
            the wrong shape.
    """
    if k.shape != v.shape or k.dtype != v.dtype or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(
            f"read_kv needs contiguous k and v of one shape and dtype, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    n = k.numel()
    programs = min(max(n // READ_KV_ELEMENTS, READ_KV_MIN_PROGRAMS), READ_KV_MAX_PROGRAMS)
    per_program = cdiv(cdiv(n, programs), READ_KV_BLOCK) * READ_KV_BLOCK  # whole tiles
    if out is None:
        out = torch.empty(programs, READ_KV_BLOCK, dtype=torch.float32, device=k.device)
    elif out.shape != (programs, READ_KV_BLOCK):
        raise ValueError(f"read_kv: out must have shape {(programs, READ_KV_BLOCK)}, got {tuple(out.shape)}")
    read_kv_kernel[(programs,)](k, v, out, n, per_program, BLOCK=READ_KV_BLOCK, num_warps=4)
    return out


def make_inputs(batch: int, seqlen: int, page_size: int, dtype: torch.dtype, device: str = "cuda") -> dict:
    """q (B, Hq, D); contiguous caches (B, T, Hkv, D) viewed as one page per sequence; a paged pool
    of ``page_size`` pages with a shuffled (B, T / page_size) table; seqlens (B,) = T."""
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    pages_per_seq = -(-seqlen // page_size)
    num_pages = batch * pages_per_seq
    table = torch.randperm(num_pages, device=device).view(batch, pages_per_seq).int()
    k_pool = torch.empty(num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_pool = torch.empty_like(k_pool)
    # Scatter each sequence's tokens into its shuffled pages (a padded copy when T % page_size != 0).
    pad = pages_per_seq * page_size - seqlen
    k_padded = F.pad(k, (0, 0, 0, 0, 0, pad)).view(batch, pages_per_seq, page_size, NUM_KV_HEADS, HEAD_DIM)
    v_padded = F.pad(v, (0, 0, 0, 0, 0, pad)).view_as(k_padded)
    k_pool[table.long()] = k_padded
    v_pool[table.long()] = v_padded
    return {
        "q": q,
        "k": k,
        "v": v,
        "contiguous_table": torch.arange(batch, device=device, dtype=torch.int32)[:, None],
        "k_pool": k_pool,
        "v_pool": v_pool,
        "table": table,
        "seqlens": torch.full((batch,), seqlen, device=device, dtype=torch.int32),
    }


def make_provider(name: str, x: dict) -> Callable[[], torch.Tensor]:
    """A zero-argument callable computing decode attention (B, Hq, D) with provider ``name``
    (``read`` returns the copied cache, ``read_kv`` the partial sums of :func:`read_kv` instead)."""
    group = NUM_HEADS // NUM_KV_HEADS
    if name == "ours":
        return lambda: kernels.flash_decode(
            x["q"], x["k"], x["v"], x["contiguous_table"], x["seqlens"], check_values=False, backend="triton"
        )
    if name.startswith("ours_splits") and name[len("ours_splits"):].isdigit():
        num_splits = int(name[len("ours_splits"):])
        return lambda: kernels.flash_decode(
            x["q"], x["k"], x["v"], x["contiguous_table"], x["seqlens"], num_splits=num_splits,
            check_values=False, backend="triton",
        )  # fmt: skip
    if name == "ours_paged":
        return lambda: kernels.flash_decode(
            x["q"], x["k_pool"], x["v_pool"], x["table"], x["seqlens"], check_values=False, backend="triton"
        )
    q4 = x["q"][:, :, None]  # (B, Hq, 1, D)
    k4, v4 = x["k"].transpose(1, 2), x["v"].transpose(1, 2)  # (B, Hkv, T, D) views
    if name == "sdpa_gqa":
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)[:, :, 0]
    if name == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)[:, :, 0]

        return flash
    if name == "sdpa_repeat":
        return lambda: F.scaled_dot_product_attention(
            q4, k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        )[:, :, 0]
    if name == "read":
        k_dst, v_dst = torch.empty_like(x["k"]), torch.empty_like(x["v"])

        def read():
            k_dst.copy_(x["k"])
            return v_dst.copy_(x["v"])

        return read
    if name == "read_kv":
        sums = read_kv(x["k"], x["v"])
        return lambda: read_kv(x["k"], x["v"], sums)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS} or ours_splits<N>")


def run_config(
    batch: int, seqlen: int, providers: Sequence[str], page_size: int, dtype: torch.dtype, flush: str = "read"
) -> dict:
    """Check and time every provider at one (batch, seqlen), the graph timings with the L2 ``flush``
    of :func:`benchmarks.common.bench_graph_ms`; returns the row."""
    x = make_inputs(batch, seqlen, page_size, dtype)
    nbytes = kv_bytes(batch, seqlen, NUM_KV_HEADS, HEAD_DIM, x["k"].element_size())
    # Reference on the last sequence only (fp32 gathers the whole cache).
    last = slice(batch - 1, batch)
    want = reference.flash_decode(
        x["q"][last].float(), x["k"][last].float(), x["v"][last].float(),
        torch.zeros(1, 1, dtype=torch.int32, device="cuda"), x["seqlens"][last],
    )  # fmt: skip
    row: dict[str, Any] = {"batch": batch, "seqlen": seqlen, "page_size": page_size, "kv_bytes": nbytes,
                           "us": {}, "tb_s": {}, "graph_us": {}, "graph_tb_s": {}, "host_us": {},
                           "max_abs_err": {}, "error": {}}  # fmt: skip
    for name in providers:
        fn = make_provider(name, x)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()
                if name not in READ_PROVIDERS:
                    row["max_abs_err"][name] = (out[last].float() - want).abs().max().item()
                row["us"][name] = 1e3 * bench_ms(fn, warmup=DO_BENCH_WARMUP_MS, rep=DO_BENCH_REP_MS)
                row["graph_us"][name] = 1e3 * bench_graph_ms(fn, flush=flush)
                row["host_us"][name] = host_us(fn)
        except (RuntimeError, ValueError) as err:  # OOM is a RuntimeError: recorded, the sweep goes on
            row["error"][name] = short_reason(err, [str(w.message) for w in caught])
            row["us"][name] = None
        row["tb_s"][name] = tb_per_s(nbytes, row["us"][name])
        row["graph_tb_s"][name] = tb_per_s(nbytes, row["graph_us"].get(name))
    copy_tb_s = tb_per_s(2 * nbytes, row["us"].get("read"))  # a copy reads and writes nbytes
    row["copy_tb_s"] = copy_tb_s
    row["ours_vs_sdpa_gqa"] = ratio(row["us"].get("sdpa_gqa"), row["us"].get("ours"))
    row["paged_vs_contiguous"] = ratio(row["us"].get("ours"), row["us"].get("ours_paged"))
    row["ours_of_copy_bw"] = ratio(row["tb_s"].get("ours"), copy_tb_s)
    graph_copy_tb_s = tb_per_s(2 * nbytes, row["graph_us"].get("read"))
    row["graph_copy_tb_s"] = graph_copy_tb_s
    row["graph_ours_vs_sdpa_gqa"] = ratio(row["graph_us"].get("sdpa_gqa"), row["graph_us"].get("ours"))
    row["graph_paged_vs_contiguous"] = ratio(row["graph_us"].get("ours"), row["graph_us"].get("ours_paged"))
    row["graph_ours_of_copy_bw"] = ratio(row["graph_tb_s"].get("ours"), graph_copy_tb_s)
    row["ceiling_vs_sdpa_gqa"] = ratio(row["us"].get("sdpa_gqa"), row["us"].get("read_kv"))
    row["graph_ceiling_vs_sdpa_gqa"] = ratio(row["graph_us"].get("sdpa_gqa"), row["graph_us"].get("read_kv"))
    return row


def table_header(providers: Sequence[str]) -> list[str]:
    """Columns: shape, µs and TB/s per provider, then the ratios."""
    cols = ["batch", "seqlen", "KV MB"]
    cols += [f"{p} us (TB/s)" for p in providers]
    return cols + ["ours/sdpa_gqa", "ceiling", "paged/contig", "ours of copy BW", "ours err"]


def table_row(row: dict[str, Any], providers: Sequence[str], timing: str = "eager") -> list[str]:
    """One printed line of a result row (``-`` for missing values); ``timing`` "eager" (do_bench,
    host overhead included) or "graph" (captured in a CUDA graph: GPU time only)."""
    pre = "graph_" if timing == "graph" else ""

    def cell(p: str) -> str:
        us, tb = row[f"{pre}us"].get(p), row[f"{pre}tb_s"].get(p)
        return "-" if us is None else f"{us:.1f} ({tb:.2f})"

    ours_of_copy = row.get(f"{pre}ours_of_copy_bw")
    return [
        str(row["batch"]),
        str(row["seqlen"]),
        f"{row['kv_bytes'] / 1e6:.0f}",
        *[cell(p) for p in providers],
        fmt_ratio(row.get(f"{pre}ours_vs_sdpa_gqa")),
        fmt_ratio(row.get(f"{pre}ceiling_vs_sdpa_gqa")),
        fmt_ratio(row.get(f"{pre}paged_vs_contiguous")),
        "-" if ours_of_copy is None else f"{ours_of_copy:.0%}",
        fmt_sci(row["max_abs_err"].get("ours")),
    ]


def host_row(row: dict[str, Any], providers: Sequence[str]) -> list[str]:
    """One printed line of host µs per eager call (``-`` where not measured)."""
    cells = [row.get("host_us", {}).get(p) for p in providers]
    return [str(row["batch"]), str(row["seqlen"]), *("-" if c is None else f"{c:.1f}" for c in cells)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` shrinks the default sweep."""
    parser = argparse.ArgumentParser(
        description="Time mixerlab's split-K decode kernel against SDPA (GQA, flash, replicated KV), a KV copy "
        "and a one-pass KV read."
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 1, seqlens 8192 and 32768")
    parser.add_argument("--batches", type=int, nargs="+", help=f"default {' '.join(map(str, BATCHES))}")
    parser.add_argument("--seqlens", type=int, nargs="+", help=f"default {' '.join(map(str, SEQLENS))}")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens per page of ours_paged")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument(
        "--num-splits", type=int, nargs="+", default=[],
        help="also time ours with each of these forced split counts (providers ours_splits<N>)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (default benchmarks/results)"
    )
    parser.add_argument("--name", help="results name (default decode, decode-quick with --quick)")
    parser.add_argument(
        "--flush", choices=FLUSH_MODES, default="read",
        help="how the graph timing evicts the L2 before each call: read a 256 MB buffer (default) or zero "
        "it (leaves dirty lines the timed kernel writes back; see benchmarks.common.bench_graph_ms)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.batches = args.batches or list(QUICK_BATCHES if args.quick else BATCHES)
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    args.name = args.name or ("decode-quick" if args.quick else "decode")
    for name, values in (("--batches", args.batches), ("--seqlens", args.seqlens)):
        if any(n <= 0 for n in values):
            parser.error(f"{name}: values must be positive, got {values}")
    if args.page_size <= 0:
        parser.error("--page-size must be positive")
    if any(n <= 0 for n in args.num_splits):
        parser.error(f"--num-splits: values must be positive, got {args.num_splits}")
    check_out_dir(parser, args.out)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, print the table, write the JSON; returns the exit status."""
    args = parse_args(argv)
    require_cuda("benchmarks/decode.py")
    providers = list(dict.fromkeys(args.providers + [f"ours_splits{n}" for n in args.num_splits]))
    path = results_path(args.name, args.out)
    info = versions()
    print(
        f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | bf16 | results -> {path}",
        flush=True,
    )
    settings = {
        "dtype": "bf16",
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "page_size": args.page_size,
        "batches": args.batches,
        "seqlens": args.seqlens,
        "providers": providers,
        "kv_bytes": "2 * batch * seqlen * Hkv * D * itemsize (K and V read once)",
        "timing": {"tool": "triton.testing.do_bench", "return_mode": "median",
                   "warmup_ms": DO_BENCH_WARMUP_MS, "rep_ms": DO_BENCH_REP_MS},
        "graph_timing": "benchmarks.common.bench_graph_ms: 20 (L2 flush, call) pairs in one CUDA graph, "
                        "minus a graph of the flushes alone, median of 15 replays",
        "graph_flush": f"{args.flush}: the L2 flush of 256 MB before each graph-timed call",
        "host_timing": "benchmarks.common.host_us: 50 eager calls issued back to back, host clock, "
                       "no wait on the GPU in between (launch-side time per call)",
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for batch in args.batches:
        for seqlen in args.seqlens:
            rows.append(run_config(batch, seqlen, providers, args.page_size, torch.bfloat16, args.flush))
            print(format_table(table_header(providers), [table_row(rows[-1], providers)]).splitlines()[-1])
            write_json(path, {"benchmark": "decode", "versions": info, "settings": settings, "rows": rows})
            torch.cuda.empty_cache()
    print("\neager: do_bench median, host overhead included (an eager decode step)")
    print(format_table(table_header(providers), [table_row(r, providers) for r in rows]))
    print("\ngraph: captured in a CUDA graph, L2 flushed between calls (a graph-captured decode step)")
    print(format_table(table_header(providers), [table_row(r, providers, "graph") for r in rows]))
    print("\nhost: us of host time per eager call (launches issued back to back, no wait on the GPU)")
    print(format_table(["batch", "seqlen", *providers], [host_row(r, providers) for r in rows]))
    for row in rows:
        for name, reason in row["error"].items():
            print(f"not measured: {name} at batch {row['batch']}, seqlen {row['seqlen']}: {reason}")
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f}s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

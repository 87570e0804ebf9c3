"""Plumbing shared by the GPU microbenchmarks under ``benchmarks/`` (DESIGN.md, "Measuring").

Every benchmark script follows the same steps, and this module holds the parts they share:

1. :func:`require_cuda` — stop with a clear message on a machine without a CUDA GPU;
2. :func:`bench_ms` — one warm-up call (autotuning, compilation), then ``triton.testing.do_bench``'s
   median, which clears the L2 cache between repetitions so memory-bound kernels are timed from HBM;
3. :func:`tflops` / :func:`fmt_tflops` / :func:`fmt_ratio` / :func:`format_table` — the printed table;
4. :func:`versions` + :func:`results_path` + :func:`write_json` — the JSON record of the run,
   ``benchmarks/results/<date>-<gpu>-<name>.json``, written atomically.

Triton is imported lazily, so this module (and the scripts' CPU-side logic) imports without it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import kernels
from eval.records import check_creatable_dir, git_dirty, git_sha
from models.checkpoint import atomic_write_bytes

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# do_bench's defaults, spelled out so they land in the JSON: 25 ms of warm-up launches, then as
# many timed repetitions as fit in 100 ms (at least one), each preceded by an L2 flush.
DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100


def check_out_dir(parser: argparse.ArgumentParser, out: Path) -> None:
    """Stop with argparse's one-line error (exit status 2) when the ``--out`` folder cannot be
    created or written, before anything is timed: the results are written after the first
    measured shape, minutes in.

    Raises:
        SystemExit: from ``parser.error`` with :func:`eval.records.check_creatable_dir`'s message.
    """
    try:
        check_creatable_dir(out, f"--out {out}", "pass --out <a writable folder>")
    except ValueError as err:
        parser.error(str(err))


def require_cuda(script: str) -> None:
    """Exit (status 1, message on stderr) unless a CUDA GPU is usable.

    Args:
        script: what is being run, for the message (e.g. ``"benchmarks/attention.py"``).

    Raises:
        SystemExit: no CUDA GPU (CPU-only torch build, no device, or ``CUDA_VISIBLE_DEVICES=""``).
    """
    if torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise SystemExit(
        f"benchmarks need a CUDA GPU; torch {torch.__version__} ({build}) sees none on this machine. "
        f"Run {script} on a machine with an NVIDIA GPU (and Triton installed)."
    )


def slugify(text: str) -> str:
    """Lower-case ``text`` with every run of non-alphanumerics turned into one ``-``.

    ``"NVIDIA H200"`` -> ``"nvidia-h200"``; ``"NVIDIA GeForce RTX 4090 (x2)"`` -> ``"nvidia-geforce-rtx-4090-x2"``.
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def gpu_name(device: int | None = None) -> str:
    """The CUDA device's name as the driver reports it, e.g. ``"NVIDIA H200"``."""
    return torch.cuda.get_device_name(device)


def today() -> str:
    """Today's date in UTC, ``YYYY-MM-DD`` (the date in result file names)."""
    return _dt.datetime.now(_dt.timezone.utc).date().isoformat()


def versions() -> dict[str, Any]:
    """What produced a result: torch, Triton, CUDA, cuDNN, GPU name and capability, date, git commit (and
    whether the tree had uncommitted changes).

    Entries that cannot be determined (no GPU, no Triton, not a git checkout) are ``None``.
    """
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": gpu_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "python": platform.python_version(),
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "git_dirty": git_dirty(),
    }


def results_path(
    name: str, out_dir: str | os.PathLike = RESULTS_DIR, *, gpu: str | None = None, date: str | None = None
) -> Path:
    """``<out_dir>/<date>-<gpu slug>-<name>.json`` (DESIGN.md's naming), or, when a run of the same
    day already wrote that file, the first free ``...-<name>-2.json``, ``-3``, ...: a second run
    never overwrites the first's results.

    Args:
        name: the benchmark, e.g. ``"attention"``.
        out_dir: folder of the results (default ``benchmarks/results``).
        gpu: GPU name (slugified here); defaults to the current CUDA device's name.
        date: ``YYYY-MM-DD``; defaults to :func:`today`.
    """
    gpu = gpu if gpu is not None else gpu_name()
    date = date if date is not None else today()
    stem = f"{date}-{slugify(gpu)}-{slugify(name)}"
    path, n = Path(out_dir) / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = Path(out_dir) / f"{stem}-{n}.json"
    return path


def _jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"nan"`` / ``"inf"`` / ``"-inf"`` (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write ``payload`` as indented strict JSON to ``path`` atomically (temp file + rename).

    Non-finite floats (a kernel that returned NaN) are written as strings, so the file stays
    readable by any JSON parser. The folder is created if missing. Returns the path.
    """
    path = Path(path)
    data = (json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n").encode()
    atomic_write_bytes(path, lambda f: f.write(data))
    return path


def bench_ms(fn: Callable[[], Any], *, warmup: int = DO_BENCH_WARMUP_MS, rep: int = DO_BENCH_REP_MS) -> float:
    """Median time of ``fn()`` in milliseconds, from ``triton.testing.do_bench``.

    ``fn`` is called once first and the device synchronised, so autotuning and compilation happen
    outside the measurement; do_bench then flushes the L2 cache before every timed repetition.
    """
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_us(
    fn: Callable[[], Any],
    *,
    calls: int = 50,
    sync: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Host time of one ``fn()`` call in microseconds: ``calls`` calls issued back to back on an idle
    GPU, timed on the host without waiting for their kernels (``sync``, default
    ``torch.cuda.synchronize``, runs only before and after). This is what an eager call costs the
    CPU: Python, argument checks and the launches. When it exceeds the GPU time, eager timings
    measure it instead of the kernel. ``fn`` is called once first (compilation); ``calls`` must stay
    below the launch queue's depth (about a thousand launches), or the host waits on the GPU.

    Raises:
        ValueError: calls < 1.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    start = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - start
    sync()
    return elapsed / calls * 1e6


FLUSH_MODES = ("read", "zero")


def bench_graph_ms(
    fn: Callable[[], Any],
    *,
    reps: int = 20,
    replays: int = 15,
    flush_bytes: int = 256 << 20,
    flush: str = "read",
) -> float:
    """Median GPU time of ``fn()`` in milliseconds with no host overhead: ``fn`` captured in a CUDA
    graph, as a graph-captured decode step runs it.

    One graph holds ``reps`` pairs (L2 flush over a ``flush_bytes`` buffer; ``fn()``), a second the
    flushes alone; each is replayed ``replays`` times and timed with CUDA events, and the result
    is (median pair graph - median flush graph) / reps. ``fn`` is called once first (autotuning,
    compilation) and must be capturable: no host syncs, no allocations that change per call.

    ``flush="read"`` (default) evicts the L2 by reading the buffer (an ``amax``): ``fn`` starts on a
    cold cache of clean lines. ``"zero"`` writes it (a zero fill, as ``triton.testing.do_bench``
    does), which leaves the L2 full of dirty lines that ``fn``'s first misses must write back to
    HBM: on the H200 (2026-12-02) that added 6-8 us to every decode kernel reading >= 134 MB
    (ours, SDPA and a copy alike; ``benchmarks/results/2026-12-02-nvidia-h200-decode-flush.json``),
    traffic the kernel does not cause.

    Raises:
        ValueError: ``flush`` not in :data:`FLUSH_MODES`.
        RuntimeError: from CUDA graph capture when ``fn`` is not capturable.
    """
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
    buffer = torch.empty(flush_bytes // 4, dtype=torch.float32, device="cuda").zero_()
    flush_l2 = buffer.zero_ if flush == "zero" else buffer.amax
    fn()
    torch.cuda.synchronize()

    def capture(body: Callable[[], Any]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        # As LanguageModel.generate's decode step (models.model.DecodeStep): the warm-up on the
        # current stream, the capture on a fresh stream whose per-stream buffers the ops made first.
        body()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        kernels.prepare_graph_capture(stream)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                body()
        return graph

    def median_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def flush_then_fn() -> None:
        flush_l2()
        fn()

    with_fn = median_ms(capture(flush_then_fn))
    flush_only = median_ms(capture(flush_l2))
    return max(with_fn - flush_only, 0.0) / reps


def tflops(flops: float, ms: float | None) -> float | None:
    """Throughput in TFLOP/s of ``flops`` floating-point operations done in ``ms`` milliseconds."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt_tflops(value: float | None) -> str:
    """A TFLOP/s cell: one decimal (``"512.3"``); ``"-"`` when missing."""
    return "-" if value is None else f"{value:.1f}"


def fmt_ratio(value: float | None) -> str:
    """A ratio cell: two decimals and an ``x`` (``"1.05x"``); ``"-"`` when missing."""
    return "-" if value is None else f"{value:.2f}x"


def fmt_sci(value: float | None) -> str:
    """An error cell in scientific notation (``"3.9e-03"``); ``"-"`` when missing."""
    return "-" if value is None else f"{value:.1e}"


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: the header, a rule of dashes, then one line per row.

    Cells are ``str(cell)`` (``None`` becomes ``"-"``); numbers and number-like strings are
    right-aligned, other text left-aligned; columns are two spaces apart and every line has the
    same width.

    Raises:
        ValueError: a row whose length differs from the header's.
    """
    header = [str(h) for h in header]
    body = []
    for row in rows:
        cells = ["-" if c is None else str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"row has {len(cells)} cells but the header has {len(header)}: {cells}")
        body.append(cells)
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]

    def numeric(cell: str) -> bool:
        return bool(re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?x?!?|-", cell))

    def line(cells: Sequence[str], align_numbers: bool) -> str:
        parts = [
            c.rjust(w) if align_numbers and numeric(c) else c.ljust(w)
            for c, w in zip(cells, widths, strict=True)
        ]
        return "  ".join(parts)

    lines = [line(header, False), "  ".join("-" * w for w in widths)]
    lines += [line(r, True) for r in body]
    return "\n".join(lines)


def short_reason(err: BaseException, warning_messages: Iterable[str] = (), limit: int = 300) -> str:
    """One line saying why a provider failed: ``"Type: first line of message"``, plus the first
    warnings raised on the way (SDPA explains "No available kernel" only in warnings), cut to ``limit``.
    """
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    reason = f"{type(err).__name__}: {first}" if first else type(err).__name__
    extra = [m.strip().splitlines()[0] for m in warning_messages if m and m.strip()][:2]
    if extra:
        reason += " [warnings: " + " | ".join(extra) + "]"
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."

"""The HBM-traffic model of attention: ``python eval/roofline.py [records=[a.json,...]] [overrides]``.

Attention over N tokens with head dim d in a b-byte dtype moves, per head (FlashAttention, Dao et al.
2022, Sec. 3.2 and Theorem 2; the standard-attention IO count of its Algorithm 0):

- the ``N x d`` terms -- Q, K, V read and O written, ``N * d * b`` bytes each (2.1 MB at N = 8192,
  d = 128, fp16) -- which every implementation moves once;
- the ``N x N`` terms -- the score matrix S and probabilities P, ``N^2 * b`` bytes each (134 MB) --
  which naive attention moves four times (S written by ``QK^T``, read by the softmax, P written,
  read by ``PV``) and FlashAttention never (tiles stay on chip).

So one 8k-token prefill of a 32-layer, 32-head model moves ``4 * N^2 * b * 32 * 32`` = 549.8 GB of
scores naively: 164 ms at an H100's 3.35 TB/s, 129 ms at the H200's measured 4.27 TB/s, against
``4 * N^2 * d`` FLOPs per head (``QK^T`` and ``PV``, 2 FLOPs per multiply-add) that a
989 TFLOP/s tensor core finishes in 36 ms -- naive attention is memory-bound, FlashAttention
compute-bound. At decode the step is a read of the weights and the KV cache; a 32-layer model
that launches ~7 elementwise kernels per layer at ~5 us each spends 1.12 ms in launch overhead
alone, a quarter of a 4.5 ms step: what a CUDA graph (and kernel fusion) removes.

With ``records=[...]`` (JSON lists written by ``eval/decode.py``), every prefill / decode
throughput record is printed beside the floor for its shape: decode moves the weights plus every
sequence's cache once per step, prefill at least moves those bytes and does its FLOPs. The cache
bytes are the records' ``state_bytes``: the cache eval/decode.py allocated for the context plus its
decode steps (``cache_seqlen``), not the part a step reads -- an attention step reads only the
tokens cached so far, up to ``decode_steps`` fewer -- so the floor counts a little more cache than
a step moves. A file eval/decode.py wrote before its sweep finished (killed at a later length: its
records carry ``partial``) is printed with a note naming it and the lengths it holds; one whose every
length ran out of memory (``decode_oom`` records only) with a note too. A file that holds no
eval/decode.py record (a ``recall.json``, ``train.json`` or an empty list) is refused.
"""

from __future__ import annotations

import difflib
import glob
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from eval.cli import CONF_DIR, check_known_settings, run_command_line, user_errors
from eval.records import partial_note

GB = 1e9
MB = 1e6

# Record metrics eval/decode.py writes (value in tokens/s) that this script sets beside a floor.
PREFILL_METRIC = "prefill_tokens_per_s"
DECODE_METRIC = "decode_tokens_per_s"
# The task of every eval/decode.py record (its decode_oom records too).
DECODE_TASK = "decode"
# The evaluations whose record files (``<checkpoint>.<script>.json``) are named in the message refusing one.
RECORD_SCRIPTS = ("recall", "copying", "long_context", "perplexity")


@dataclass(frozen=True)
class AttentionShape:
    """One attention prefill: ``seqlen`` tokens, ``num_heads`` heads of ``head_dim`` in each of
    ``num_layers`` layers, elements of ``dtype_bytes`` bytes (2 for fp16 / bf16)."""

    seqlen: int = 8192
    head_dim: int = 128
    num_heads: int = 32
    num_layers: int = 32
    dtype_bytes: int = 2


def nd_bytes(shape: AttentionShape) -> int:
    """Bytes of one ``(N, d)`` operand of one head (Q, K, V or O): ``N * d * b``."""
    return shape.seqlen * shape.head_dim * shape.dtype_bytes


def n2_bytes(shape: AttentionShape) -> int:
    """Bytes of one ``(N, N)`` matrix of one head (scores S or probabilities P): ``N^2 * b``."""
    return shape.seqlen**2 * shape.dtype_bytes


# Times naive attention moves an N x N matrix through HBM: write S, read S, write P, read P.
NAIVE_N2_PASSES = 4
# N x d operands every attention reads or writes once: Q, K, V in, O out.
ND_PASSES = 4


def naive_bytes_per_head(shape: AttentionShape) -> dict[str, int]:
    """HBM bytes of naive attention for one head: ``{"nd": 4 N d b, "n2": 4 N^2 b}`` (FlashAttention,
    Dao et al. 2022, Algorithm 0 and Theorem 2: Theta(N d + N^2) accesses)."""
    return {"nd": ND_PASSES * nd_bytes(shape), "n2": NAIVE_N2_PASSES * n2_bytes(shape)}


def flash_bytes_per_head(shape: AttentionShape) -> int:
    """HBM bytes of FlashAttention for one head when K and V fit one pass: ``4 N d b`` (the N x N
    matrices never leave the chip; Dao et al. 2022, Sec. 3.2)."""
    return ND_PASSES * nd_bytes(shape)


def flops_per_head(shape: AttentionShape) -> int:
    """Forward FLOPs of one non-causal head: ``4 N^2 d`` (``QK^T`` and ``PV``, 2 per multiply-add)."""
    return 4 * shape.seqlen**2 * shape.head_dim


def prefill_traffic(shape: AttentionShape) -> dict[str, float]:
    """Bytes of one prefill over every head and layer: naive score traffic (``n2``), naive total
    (``naive``, with the N x d terms) and FlashAttention's (``flash``); FLOPs (``flops``)."""
    heads = shape.num_heads * shape.num_layers
    naive = naive_bytes_per_head(shape)
    return {
        "n2": heads * naive["n2"],
        "naive": heads * (naive["n2"] + naive["nd"]),
        "flash": heads * flash_bytes_per_head(shape),
        "flops": heads * flops_per_head(shape),
    }


def seconds_at(nbytes: float, bandwidth_tb_s: float) -> float:
    """Time in seconds to move ``nbytes`` at ``bandwidth_tb_s`` TB/s (10^12 bytes/s)."""
    return nbytes / (bandwidth_tb_s * 1e12)


def launch_overhead_s(num_layers: int, launches_per_layer: int, launch_us: float) -> float:
    """Seconds of kernel-launch overhead of one decode step: layers x launches x per-launch cost."""
    return num_layers * launches_per_layer * launch_us * 1e-6


def decode_floor_s(weight_bytes: float, cache_bytes: float, bandwidth_tb_s: float) -> float:
    """Floor of one decode step: every weight and every byte of every sequence's cache read once."""
    return seconds_at(weight_bytes + cache_bytes, bandwidth_tb_s)


def prefill_floor_s(nbytes: float, flops: float, bandwidth_tb_s: float, peak_tflops: float) -> float:
    """Floor of a prefill: the larger of its memory time and its compute time (the roofline)."""
    return max(seconds_at(nbytes, bandwidth_tb_s), flops / (peak_tflops * 1e12))


def issue_figures(cfg: DictConfig | dict) -> dict[str, float]:
    """The traffic model's figures for ``cfg`` (the keys of ``conf/eval/roofline.yaml``): per-head
    operand sizes, prefill traffic and times at each bandwidth, FLOPs, and the decode-step launch
    overhead. Sizes in bytes, times in seconds."""
    shape = AttentionShape(
        cfg["seqlen"], cfg["head_dim"], cfg["num_heads"], cfg["num_layers"], cfg["dtype_bytes"]
    )
    traffic = prefill_traffic(shape)
    figures = {
        "nd_bytes": nd_bytes(shape),
        "n2_bytes": n2_bytes(shape),
        "naive_n2_passes": NAIVE_N2_PASSES,
        "prefill_n2_bytes": traffic["n2"],
        "prefill_naive_bytes": traffic["naive"],
        "prefill_flash_bytes": traffic["flash"],
        "flops_per_head": flops_per_head(shape),
        "prefill_flops": traffic["flops"],
        "prefill_compute_s": traffic["flops"] / (cfg["peak_tflops"] * 1e12),
    }
    for name, bandwidth in cfg["bandwidths_tb_s"].items():
        figures[f"prefill_naive_s@{name}"] = seconds_at(traffic["n2"], bandwidth)
        figures[f"prefill_flash_s@{name}"] = seconds_at(traffic["flash"], bandwidth)
    decode = cfg["decode"]
    figures["decode_launch_s"] = launch_overhead_s(
        cfg["num_layers"], decode["launches_per_layer"], decode["launch_us"]
    )
    figures["decode_step_s"] = decode["step_ms"] * 1e-3
    return figures


def format_figures(cfg: DictConfig | dict, figures: dict[str, float]) -> str:
    """The figures as the printed report (one line each, formula then value)."""
    n, d, b = cfg["seqlen"], cfg["head_dim"], cfg["dtype_bytes"]
    heads, layers = cfg["num_heads"], cfg["num_layers"]
    lines = [
        f"Attention HBM traffic, N={n}, d={d}, {b}-byte elements, {heads} heads x {layers} layers",
        f"  N x d term (Q, K, V or O of one head)   N*d*b            = {figures['nd_bytes'] / MB:8.2f} MB",
        f"  N x N term (S or P of one head)         N^2*b            = {figures['n2_bytes'] / MB:8.2f} MB",
        f"  naive attention moves S/P               write S, read S, write P, read P = "
        f"{figures['naive_n2_passes']}x",
        f"  naive score traffic, one prefill        4*N^2*b*H*L      = {figures['prefill_n2_bytes'] / GB:8.1f} GB",
        f"  naive total with the N x d terms        +4*N*d*b*H*L     = {figures['prefill_naive_bytes'] / GB:8.1f} GB",
        f"  FlashAttention traffic                  4*N*d*b*H*L      = {figures['prefill_flash_bytes'] / GB:8.2f} GB",
    ]
    for name, bandwidth in cfg["bandwidths_tb_s"].items():
        lines.append(
            f"  at {name} ({bandwidth} TB/s): naive scores {figures[f'prefill_naive_s@{name}'] * 1e3:7.1f} ms, "
            f"FlashAttention {figures[f'prefill_flash_s@{name}'] * 1e3:6.2f} ms"
        )
    lines += [
        f"  FLOPs per head                          4*N^2*d          = {figures['flops_per_head'] / 1e9:8.2f} GFLOP",
        f"  FLOPs per prefill                       4*N^2*d*H*L      = {figures['prefill_flops'] / 1e12:8.2f} TFLOP"
        f" ({figures['prefill_compute_s'] * 1e3:.1f} ms at {cfg['peak_tflops']} TFLOP/s)",
        f"  decode launch overhead                  {layers} layers x {cfg['decode']['launches_per_layer']} "
        f"launches x {cfg['decode']['launch_us']} us = {figures['decode_launch_s'] * 1e3:.2f} ms of a "
        f"{figures['decode_step_s'] * 1e3:.1f} ms step ({figures['decode_launch_s'] / figures['decode_step_s']:.0%})",
    ]
    return "\n".join(lines)


def measured_vs_floor(records: list[dict[str, Any]], bandwidth_tb_s: float, peak_tflops: float) -> list[dict]:
    """Rows of measured prefill / decode throughput beside the traffic model's floor.

    A record (eval/decode.py) is used when its ``metric`` is ``prefill_tokens_per_s`` or
    ``decode_tokens_per_s`` (``value`` in tokens/s); it carries ``batch``, ``seqlen`` (the context),
    ``weight_bytes`` and ``state_bytes`` -- the bytes of one sequence's cache as allocated for
    ``cache_seqlen`` tokens (the context plus ``decode_steps``), not those a step reads -- and a
    prefill record may add ``flops`` (:func:`check_record` checks them). Decode: a step produces
    ``batch`` tokens and reads the weights and ``batch * state_bytes`` of cache. Prefill: ``batch *
    seqlen`` tokens that read the weights, write the caches and do ``flops``.

    Returns:
        dicts with mixer, device (the record's; None where it has none), kind, batch, seqlen,
        cache_seqlen (the tokens ``state_bytes`` was allocated for; None where the record gives
        neither it nor ``decode_steps``), measured_tokens_per_s, floor_tokens_per_s and fraction
        (measured / floor, <= 1 unless the model's byte count is too high).

    Raises:
        ValueError: a record that :func:`check_record` refuses.
    """
    rows = []
    for i, rec in enumerate(records):
        if not check_record(rec, f"record {i}"):
            continue
        batch, seqlen = rec["batch"], rec["seqlen"]
        nbytes = rec["weight_bytes"] + batch * rec["state_bytes"]
        if rec["metric"] == DECODE_METRIC:
            kind, tokens = "decode", batch
            floor = decode_floor_s(rec["weight_bytes"], batch * rec["state_bytes"], bandwidth_tb_s)
        else:
            kind, tokens = "prefill", batch * seqlen
            floor = prefill_floor_s(nbytes, rec.get("flops") or 0.0, bandwidth_tb_s, peak_tflops)
        floor_tps = tokens / floor
        cache_seqlen = rec.get("cache_seqlen")
        if cache_seqlen is None and rec.get("decode_steps") is not None:
            cache_seqlen = seqlen + rec["decode_steps"]
        rows.append(
            {
                "mixer": rec.get("mixer"),
                "device": rec.get("device"),
                "kind": kind + (f" ({rec['mode']})" if rec.get("mode") else ""),
                "batch": batch,
                "seqlen": seqlen,
                "cache_seqlen": cache_seqlen,
                "measured_tokens_per_s": rec["value"],
                "floor_tokens_per_s": floor_tps,
                "fraction": rec["value"] / floor_tps,
            }
        )
    return rows


# The numeric fields of a throughput record: (name, integer, zero allowed, required).
RECORD_FIELDS = (
    ("value", False, True, True),
    ("batch", True, False, True),
    ("seqlen", True, False, True),
    ("weight_bytes", False, False, True),
    ("state_bytes", False, True, True),
    ("flops", False, True, False),
    ("decode_steps", True, True, False),
    ("cache_seqlen", True, False, False),
)


def check_record(rec: Any, where: str) -> bool:
    """Whether ``rec`` is a prefill / decode throughput record, which :func:`measured_vs_floor` sets
    beside a floor (False for records of other metrics); one whose fields the floor cannot use is refused.

    Args:
        rec: one item of a records file.
        where: how a message names it (``decode.json: record 3``).

    Raises:
        ValueError: ``rec`` is not a JSON object; or it is a throughput record that lacks ``value``,
            ``batch``, ``seqlen``, ``weight_bytes`` or ``state_bytes`` or has one of them null, or has a
            field of :data:`RECORD_FIELDS` that is not a finite non-negative number (an integer for counts
            and lengths; ``batch``, ``seqlen``, ``cache_seqlen`` and ``weight_bytes`` > 0: a step
            that moves no bytes has no floor).
    """
    if not isinstance(rec, dict):
        raise ValueError(
            f"{where} is {rec!r}, not a result record (a JSON object); pass files written by eval/decode.py"
        )
    if rec.get("metric") not in (PREFILL_METRIC, DECODE_METRIC):
        return False
    what = f"{where} (run {rec.get('run')!r}, {rec['metric']})"
    missing = [name for name, _, _, required in RECORD_FIELDS if required and name not in rec]
    if missing:
        raise ValueError(f"{what} lacks {missing}; was it written by eval/decode.py?")
    nulls = [name for name, _, _, required in RECORD_FIELDS if required and rec[name] is None]
    if nulls:
        raise ValueError(
            f"{what} has {nulls} = null; it needs numbers there (rewrite it with eval/decode.py)"
        )
    for name, integer, zero, _ in RECORD_FIELDS:
        value = rec.get(name)
        if value is None:
            continue
        ok = isinstance(value, int if integer else int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            kind = ("an integer" if integer else "a finite number") + (" >= 0" if zero else " > 0")
            raise ValueError(
                f"{what} has {name}={value!r}; it must be {kind} (rewrite it with eval/decode.py)"
            )
    return True


def record_paths(given: list[str]) -> list[str]:
    """The files ``records=`` names: paths as given (``~`` expanded), glob patterns expanded to the
    ``.json`` files they match, sorted (``decode-*.json``, ``runs/**/decode*.json``), as
    eval/report.py's ``runs=`` takes them; a file named twice (by a pattern and by its path) once.

    Raises:
        FileNotFoundError: a pattern that matches no ``.json`` file.
    """
    paths = []
    for entry in given:
        entry = os.path.expanduser(entry)
        if not glob.has_magic(entry):
            paths.append(entry)
            continue
        matches = [m for m in sorted(glob.glob(entry, recursive=True)) if m.endswith(".json")]
        if not matches:
            raise FileNotFoundError(
                f"records pattern {entry!r} matches no .json file; pass files written by eval/decode.py"
            )
        paths += matches
    unique: dict[Path, str] = {}
    for path in paths:
        unique.setdefault(Path(path).resolve(), path)
    return list(unique.values())


def _records_kind(path: str, data: list[dict[str, Any]]) -> str:
    """What a records file that holds no eval/decode.py record holds, for the message refusing it:
    the script that writes files of its name (``results/train.json``, ``<checkpoint>.recall.json``,
    ``recall-short.json``) where it has one, the records' tasks and their first metrics."""
    if not data:
        return "no records (it is an empty list)"
    parts = re.split(r"[.-]", Path(path).name.removesuffix(".json"))
    scripts = [script for script in RECORD_SCRIPTS if script in parts]
    writer = "records"
    if Path(path).name == "train.json":
        writer = "train.py's records"
    elif scripts:
        writer = f"eval/{scripts[0]}.py's records"
    tasks = sorted({str(rec.get("task")) for rec in data})
    metrics = sorted({str(rec.get("metric")) for rec in data})
    shown = ", ".join(metrics)
    if len(metrics) > 5:
        shown = f"{', '.join(metrics[:4])}, ... ({len(metrics)} in all)"
    return f"{writer} (task {', '.join(tasks)}; metrics {shown})"


def load_records(paths: list[str], notes: list[str] | None = None) -> list[dict[str, Any]]:
    """Concatenate the JSON record lists at ``paths`` (glob patterns expanded: :func:`record_paths`),
    checking every item (:func:`check_record`) so that a bad file is refused before anything is
    printed. To ``notes``, where given, one line per file written before its sweep finished
    (:func:`eval.records.partial_note`, naming the file) and per eval/decode.py file without a
    throughput record (a sweep whose every length ran out of memory: ``decode_oom`` records).

    Raises:
        FileNotFoundError: a path does not exist, or a pattern matches no ``.json`` file (named).
        ValueError: a path is a directory; a file cannot be read, is not UTF-8 JSON or not a JSON
            list; it holds an item :func:`check_record` refuses (file and record named); or it holds
            no eval/decode.py record (``task: decode``) -- another script's records (named, with
            their tasks and metrics) or none.
    """
    records = []
    for path in record_paths(paths):
        if Path(path).is_dir():
            example = min(Path(path).glob("*.json"), default=Path(path) / "decode-attention-small.json")
            raise ValueError(
                f"records file {path} is a directory; records= takes the JSON files eval/decode.py "
                f"writes, e.g. records=[{example}]"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(f"records file not found: {path}; pass files written by eval/decode.py")
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"cannot read records file {path}: {err.strerror or err}") from err
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{path} is not valid JSON ({err}); pass files written by eval/decode.py"
            ) from err
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of result records")
        used = [check_record(rec, f"{path}: record {i}") for i, rec in enumerate(data)]
        if not any(used) and not any(rec.get("task") == DECODE_TASK for rec in data):
            # a new-user check: a recall.json (or train.json) passed here printed a note and exit status 0
            raise ValueError(
                f"{path} holds {_records_kind(path, data)}, not eval/decode.py's; give records= the "
                "decode-*.json files eval/decode.py writes"
            )
        note = partial_note(str(path), data)
        if notes is not None and note is not None:
            notes.append(note)
        if notes is not None and not any(used):
            # eval/decode.py's file of a sweep where every length ran out of memory (decode_oom records)
            metrics = sorted({str(rec.get("metric")) for rec in data})
            notes.append(
                f"{path} holds no {PREFILL_METRIC} or {DECODE_METRIC} record; its metrics are "
                + ", ".join(metrics)
            )
        records.extend(data)
    return records


def format_measured(rows: list[dict]) -> str:
    """The measured-vs-floor rows as a table (``cache len``: the tokens ``state_bytes`` was allocated
    for, ``?`` where the record does not say)."""
    lines = [
        f"{'mixer':<16}{'kind':<20}{'batch':>6}{'seqlen':>8}{'cache len':>10}{'measured tok/s':>16}"
        f"{'floor tok/s':>14}{'of floor':>10}  measured on"
    ]
    for r in rows:
        cache = "?" if r["cache_seqlen"] is None else r["cache_seqlen"]
        lines.append(
            f"{str(r['mixer']):<16}{r['kind']:<20}{r['batch']:>6}{r['seqlen']:>8}{cache:>10}"
            f"{r['measured_tokens_per_s']:>16.1f}{r['floor_tokens_per_s']:>14.1f}{r['fraction']:>10.1%}"
            f"  {r['device'] or '?'}"
        )
    return "\n".join(lines)


# What the floor of the measured rows counts as cache: the records give only the allocated cache.
CACHE_NOTE = (
    "cache len: the tokens each sequence's cache was allocated for (context + decode steps); the floor\n"
    "counts that whole cache (eval/decode.py's state_bytes), though an attention step reads only the\n"
    "tokens cached so far. measured on: the record's device; the floor is the one of bandwidth_tb_s and\n"
    "peak_tflops (an H200's by default) whatever the device, so set them to that device's figures."
)


def check_config(cfg: DictConfig | dict) -> None:
    """Refuse settings the traffic model cannot use: the shape's sizes must be positive integers,
    ``bandwidths_tb_s`` and ``decode`` mappings, the bandwidths, peak and step time finite positive
    numbers, the launch count an integer >= 0 and the launch cost a finite number >= 0.

    Raises:
        ValueError: the first bad setting, named with its value and how to set it.
    """

    def number(name: str, value: Any, *, integer: bool, positive: bool) -> None:
        kind = int if integer else (int, float)
        ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0) or (not positive and value < 0):
            sign = "positive" if positive else "non-negative"
            what = f"a {sign} integer" if integer else f"a finite {sign} number"
            raise ValueError(f"{name} must be {what}, got {value!r}")

    for key in ("seqlen", "head_dim", "num_heads", "num_layers", "dtype_bytes"):
        number(key, cfg[key], integer=True, positive=True)
    bandwidths = cfg["bandwidths_tb_s"]
    if not isinstance(bandwidths, dict | DictConfig):
        raise ValueError(
            f"bandwidths_tb_s must be a mapping of name: TB/s, got {bandwidths!r}; set one with "
            "bandwidths_tb_s.h100=3.35, add one with +bandwidths_tb_s.b200=8"
        )
    for key, value in bandwidths.items():
        number(f"bandwidths_tb_s.{key}", value, integer=False, positive=True)
    number("peak_tflops", cfg["peak_tflops"], integer=False, positive=True)
    number("bandwidth_tb_s", cfg["bandwidth_tb_s"], integer=False, positive=True)
    decode = cfg["decode"]
    if not isinstance(decode, dict | DictConfig):
        raise ValueError(
            f"decode must be a mapping of launches_per_layer, launch_us and step_ms, got {decode!r}; "
            "set them one by one, e.g. decode.step_ms=4.5"
        )
    decode_keys = ("launches_per_layer", "launch_us", "step_ms")
    unknown = sorted(str(key) for key in decode if key not in decode_keys)
    if unknown:  # a new-user check: +decode.launch_uss=3 ran with the default launch_us, without a word
        guesses = [difflib.get_close_matches(key, decode_keys, n=1) for key in unknown]
        pairs = zip(unknown, guesses, strict=True)
        meant = "; ".join(f"decode.{key}: did you mean decode.{guess[0]}?" for key, guess in pairs if guess)
        raise ValueError(
            f"unknown decode keys {unknown}{f' ({meant})' if meant else ''}; decode holds "
            f"{', '.join(decode_keys)}"
        )
    number("decode.launches_per_layer", decode["launches_per_layer"], integer=True, positive=False)
    number("decode.launch_us", decode["launch_us"], integer=False, positive=False)
    number("decode.step_ms", decode["step_ms"], integer=False, positive=True)


def roofline(cfg: DictConfig) -> dict[str, Any]:
    """Print the traffic model's figures and, with ``cfg.records``, measured rows beside the floor;
    every setting and record is checked before anything is printed.

    Returns:
        ``{"figures": ..., "measured": [...]}``.

    Raises:
        ValueError: a top-level setting ``conf/eval/roofline.yaml`` does not define and nothing
            reads (:func:`eval.cli.check_known_settings`), a bad setting (:func:`check_config`),
            records file (:func:`load_records`) or record (:func:`check_record`).
        FileNotFoundError: a records file that does not exist.
    """
    check_known_settings(cfg, "eval/roofline")
    check_config(cfg)
    given = cfg.records
    if isinstance(given, str):  # records=a.json: one file (list(a string) was its characters)
        given = [given]
    elif given is not None and not isinstance(given, (list, ListConfig)):
        raise ValueError(f"records must be a file or a list of files (records=[a.json,b.json]), got {given!r}")
    notes: list[str] = []
    records = load_records([str(path) for path in given], notes) if given else None
    rows = measured_vs_floor(records, cfg.bandwidth_tb_s, cfg.peak_tflops) if records is not None else []
    figures = issue_figures(cfg)
    print(format_figures(cfg, figures))
    if records is not None:
        print(f"\nMeasured beside the floor ({cfg.bandwidth_tb_s} TB/s, {cfg.peak_tflops} TFLOP/s)")
        print(
            f"{format_measured(rows)}\n{CACHE_NOTE}" if rows else "(no prefill / decode throughput records)"
        )
        for note in notes:
            print(f"note: {note}")
    return {"figures": figures, "measured": rows}


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="roofline")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        roofline(cfg)


if __name__ == "__main__":
    run_command_line(main, "roofline", CONF_DIR / "eval")

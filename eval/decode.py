"""Decode memory and throughput per mixer: ``python eval/decode.py -m mixer=attention,mamba model=small``.

For one model size (``model=tiny|small|base``) and mixer layout (``mixer=...``; ``-m`` sweeps), a
randomly initialised model (throughput and memory do not depend on the weights) is measured at
each context length of ``context_lengths``, for ``batch_size`` sequences:

- ``state_bytes``: decode-state bytes per sequence measured from the cache tensors
  (``cache.nbytes() / batch``) and checked against the analytic ``model.state_size`` (DESIGN.md,
  contract 2, invariant (b)); a mismatch is an error;
- ``prefill_tokens_per_s``: one prefill of ``context`` tokens per sequence (wall clock, after a
  warm-up at the same shape);
- ``decode_tokens_per_s``: ``decode_steps`` single-token steps after that prefill, ``mode="eager"``
  (each step launches its kernels from Python) and, on CUDA, ``mode="cuda_graph"`` (the step of
  :class:`models.model.DecodeStep` captured once and replayed; needs ``decode_steps >= 3``: one
  eager warm-up step and one capture step are not timed);
- ``decode_bandwidth``: bytes a step must read -- every weight and every sequence's cache, i.e.
  the roofline floor of ``eval/roofline.py`` -- over the measured step time, in bytes/s, beside the
  copy bandwidth measured in the same run (CUDA only);
- peak GPU memory during prefill and during decode (``torch.cuda.max_memory_allocated``, CUDA only);
- ``kernels_per_step``: GPU operations one eager decode step launches (``torch.profiler``, CUDA
  only): what the CUDA graph replays in one launch and what fused kernels would cut.

A context length that runs out of memory is recorded as ``metric="decode_oom"`` (with the
error's first line as ``reason``) and the sweep goes on.

Every measurement is a result record (DESIGN.md, contract 5) with ``batch``, ``seqlen`` (the
context length), ``weight_bytes`` and ``state_bytes`` so ``eval/roofline.py records=[...]`` can set
it beside its floor. Records go to ``output`` (default ``decode-<mixer>-<model>.json`` in the
working directory), a plot of state bytes and decode tokens/s versus context length next to it
(``.png``), and to W&B when ``wandb.enabled=true``. It runs on CPU too (tiny sizes, for tests).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eval.cli import user_errors
from eval.common import check_lengths, resolve_device
from eval.records import (
    check_output,
    check_sweep_output,
    git_sha,
    log_records_to_wandb,
    make_record,
    say_if_replacing,
    write_records,
)
from models import LanguageModel
from models.config import config_from_groups
from models.model import DecodeStep

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: DictConfig) -> LanguageModel:
    """A randomly initialised :class:`LanguageModel` of the composed ``model`` and ``mixer`` groups.

    Raises:
        ValueError: as :func:`models.config.config_from_groups`.
    """
    model = OmegaConf.to_container(cfg.model, resolve=True)
    mixer = OmegaConf.to_container(cfg.mixer, resolve=True)
    return LanguageModel(config_from_groups(model, mixer, int(cfg.vocab_size)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write of ``nbytes``), CUDA only; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


@torch.no_grad()
def measure(model: LanguageModel, batch: int, context: int, decode_steps: int, device: torch.device) -> dict:
    """Prefill ``context`` random tokens for ``batch`` sequences, then decode ``decode_steps`` tokens.

    Returns:
        dict with state_bytes (measured per sequence), state_bytes_analytic, prefill_s, decode_step_s
        (mean seconds per eager step), graph_step_s (per replayed CUDA-graph step; None on CPU, with
        fewer than 3 steps, or when the step could not be captured), prefill_peak_bytes,
        decode_peak_bytes and kernels_per_step (GPU operations of one eager step, needs
        decode_steps >= 2) (None on CPU).

    Raises:
        ValueError: measured cache bytes differ from ``model.state_size``.
    """
    max_seqlen = context + decode_steps
    vocab = model.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    tokens = torch.randint(0, vocab, (batch, decode_steps), generator=generator).to(device)

    # Warm-up at the same shapes (autotuning, allocator, first-call overheads), then measure.
    kernels_per_step = None
    for timed in (False, True):
        cache = model.allocate_cache(batch, max_seqlen)
        _sync(device)
        _peak_reset(device)
        start = time.perf_counter()
        model(prompt, cache=cache)
        _sync(device)
        prefill_s = time.perf_counter() - start
        prefill_peak = _peak(device)
        _peak_reset(device)
        steps = decode_steps if timed else min(decode_steps, 2)
        start = time.perf_counter()
        for t in range(steps):
            if not timed and t == 1 and device.type == "cuda":
                # The second warm-up step (the first one autotunes) under the profiler.
                kernels_per_step = count_kernels(
                    lambda t=t, cache=cache: model(tokens[:, t : t + 1], cache=cache)
                )
            else:
                model(tokens[:, t : t + 1], cache=cache)
        _sync(device)
        decode_step_s = (time.perf_counter() - start) / max(steps, 1)
        decode_peak = _peak(device)

    graph_step_s = None
    if device.type == "cuda" and decode_steps >= 3:
        cache = model.allocate_cache(batch, max_seqlen)
        model(prompt, cache=cache)
        step = DecodeStep(model, cache, graphed=True)
        step(tokens[:, 0])  # eager warm-up
        step(tokens[:, 1])  # capture, then the first replay
        _sync(device)
        start = time.perf_counter()
        for t in range(2, decode_steps):
            step(tokens[:, t])
        _sync(device)
        if step.graph is not None:
            graph_step_s = (time.perf_counter() - start) / (decode_steps - 2)

    measured = cache.nbytes() // batch
    analytic = model.state_size(max_seqlen)
    if measured * batch != cache.nbytes() or measured != analytic:
        raise ValueError(
            f"{model.config.name}: cache holds {cache.nbytes()} bytes for {batch} sequences, but "
            f"state_size({max_seqlen}) = {analytic} per sequence; a mixer's state_size is out of date"
        )
    return {
        "state_bytes": measured,
        "state_bytes_analytic": analytic,
        "prefill_s": prefill_s,
        "decode_step_s": decode_step_s,
        "graph_step_s": graph_step_s,
        "prefill_peak_bytes": prefill_peak,
        "decode_peak_bytes": decode_peak,
        "kernels_per_step": kernels_per_step,
    }


def count_kernels(step) -> int:
    """GPU operations (kernels, memsets, copies) that one call of ``step`` launches, counted with
    ``torch.profiler`` (CUDA activity); the figure a fused decode step has to bring down."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def decode_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the measurement ``cfg`` (``conf/eval/decode.yaml``) describes; returns the records.

    Raises:
        ValueError: invalid settings (non-positive sizes, context_lengths not a list of them, unknown
            dtype or device, an ``output``, or the default one, that cannot be written as a file or
            that an earlier job of the same ``-m`` sweep wrote) or a cache whose bytes differ from
            the mixer's state_size.
    """
    for key in ("batch_size", "decode_steps", "vocab_size"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    lengths = check_lengths(cfg.context_lengths, "context_lengths")
    if cfg.output:
        check_output(cfg.output, "decode.json")
    device = resolve_device(cfg.device)
    dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    torch.manual_seed(0)
    model = build_model(cfg).to(device=device, dtype=DTYPES[dtype_name]).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    run = f"decode-{model.config.name}-{cfg.model.name}"
    output = Path(cfg.output or f"{run}.json")
    if not cfg.output:  # before the measurements, not after them
        check_output(output, "decode.json", option="the default output")
    check_sweep_output(output, option="output" if cfg.output else "the default output")
    copy_bw = copy_bandwidth(device)
    sha = git_sha()
    batch = cfg.batch_size
    records: list[dict[str, Any]] = []
    print(f"{run}: {model.num_params() / 1e6:.2f}M parameters, {dtype_name}, batch {batch}, {device}")
    print(f"{'context':>8}{'state B/seq':>14}{'prefill tok/s':>15}{'decode tok/s':>14}{'step GB/s':>11}"
          f"{'graph tok/s':>13}{'kernels/step':>14}")  # fmt: skip
    for context in lengths:
        try:
            m = measure(model, batch, context, cfg.decode_steps, device)
        except (torch.cuda.OutOfMemoryError, MemoryError) as err:
            # Past the memory limit: say so in a record and go on with the next length.
            reason = str(err).splitlines()[0][:200]
            print(f"{context:>8}  skipped: out of memory ({reason})")
            records.append(
                make_record(
                    metric="decode_oom", value=1.0, run=run, model=model, task="decode", seqlen=context,
                    device=device, sha=sha, batch=batch, dtype=dtype_name, model_size=cfg.model.name,
                    reason=reason,
                )
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        # A step reads every weight and every sequence's cache (roofline floor bytes).
        step_bytes = weight_bytes + batch * m["state_bytes"]
        common = dict(
            run=run, model=model, task="decode", seqlen=context, device=device, sha=sha, batch=batch,
            weight_bytes=weight_bytes, dtype=dtype_name, model_size=cfg.model.name,
            decode_steps=cfg.decode_steps, prefill_peak_bytes=m["prefill_peak_bytes"],
            decode_peak_bytes=m["decode_peak_bytes"], copy_bandwidth=copy_bw,
        )  # fmt: skip
        prefill_tps = batch * context / m["prefill_s"]
        decode_tps = batch / m["decode_step_s"]
        bandwidth = step_bytes / m["decode_step_s"]
        # state_bytes in every record is the cache allocated for context + decode_steps tokens.
        state = {"state_bytes": m["state_bytes"]}
        records += [
            make_record(metric="state_bytes", value=m["state_bytes"], **common) | state,
            # flops: 2 per weight per token (the matmuls; attention's score FLOPs are left out, so the
            # roofline's compute floor stays a lower bound).
            make_record(
                metric="prefill_tokens_per_s",
                value=prefill_tps,
                tokens_per_s=prefill_tps,
                flops=2 * model.num_params() * batch * context,
                **common,
            )
            | state,
            make_record(
                metric="decode_tokens_per_s",
                value=decode_tps,
                tokens_per_s=decode_tps,
                mode="eager",
                **common,
            )
            | state,
            make_record(metric="decode_bandwidth", value=bandwidth, mode="eager", **common) | state,
        ]
        if m["kernels_per_step"] is not None:
            records.append(
                make_record(metric="kernels_per_step", value=m["kernels_per_step"], mode="eager", **common)
                | state
            )
        if m["graph_step_s"] is not None:
            graph_tps = batch / m["graph_step_s"]
            records += [
                make_record(
                    metric="decode_tokens_per_s", value=graph_tps, tokens_per_s=graph_tps, mode="cuda_graph",
                    speedup_over_eager=m["decode_step_s"] / m["graph_step_s"], **common,
                ) | state,
                make_record(
                    metric="decode_bandwidth", value=step_bytes / m["graph_step_s"], mode="cuda_graph", **common
                ) | state,
            ]  # fmt: skip
        graph = "-" if m["graph_step_s"] is None else f"{batch / m['graph_step_s']:.1f}"
        kernels = "-" if m["kernels_per_step"] is None else str(m["kernels_per_step"])
        print(
            f"{context:>8}{m['state_bytes']:>14}{prefill_tps:>15.1f}{decode_tps:>14.1f}{bandwidth / 1e9:>11.2f}"
            f"{graph:>13}{kernels:>14}"
        )
    say_if_replacing(output, bool(cfg.output))  # a run in another dtype or batch replaces this one
    write_records(output, records)
    plot(records, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}")
    log_records_to_wandb(
        records,
        enabled=cfg.wandb.enabled,
        project=cfg.wandb.project,
        name=run,
        mode=cfg.wandb.mode,
        save_dir=output.parent,
        table="decode",
    )
    return records


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """State bytes per sequence and eager decode tokens/s versus context length, one line per mixer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_state, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in (
        (ax_state, "state_bytes", "decode state (bytes / sequence)"),
        (ax_speed, "decode_tokens_per_s", "decode tokens/s (eager)"),
    ):
        by_mixer: dict[str, list[tuple[int, float]]] = {}
        for r in records:
            if r["metric"] == metric and r.get("mode", "eager") == "eager":
                by_mixer.setdefault(r["mixer"], []).append((r["seqlen"], r["value"]))
        for mixer, points in sorted(by_mixer.items()):
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=mixer)
        ax.set_xscale("log", base=2)
        values = [y for points in by_mixer.values() for _, y in points]
        # Log only where the values span a factor of 10 (a log axis over 350-361 shows no labels).
        ax.set_yscale("log" if values and min(values) > 0 and max(values) >= 10 * min(values) else "linear")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval/decode")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        decode_eval(cfg)


if __name__ == "__main__":
    main()

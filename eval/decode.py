"""Decode memory and throughput per mixer: ``python eval/decode.py -m mixer=attention,mamba model=small``.

For one model size (``model=tiny|small|base``) and mixer layout (``mixer=...``; ``-m`` sweeps), a
randomly initialised model (throughput and memory do not depend on the weights) is measured at
each context length of ``context_lengths``, for ``batch_size`` sequences:

- ``state_bytes``: decode-state bytes per sequence of the cache allocated for the run, which holds
  ``cache_seqlen = context + decode_steps`` tokens, measured from the cache tensors
  (``cache.nbytes() / batch``) and checked against the analytic ``model.state_size(cache_seqlen)``
  (DESIGN.md, contract 2, invariant (b)); a mismatch is an error;
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

A context length that runs out of memory (on the GPU, or on the CPU when the allocation fails, or
when its cache and prefill logits alone exceed the host memory left: :func:`check_host_memory`) is
recorded as ``metric="decode_oom"`` (with the error's first line as ``reason``) and the sweep goes
on. On CPU, Linux may overcommit memory and kill the process past that estimate: the records and the
plot, rewritten after each context length, then keep the lengths measured before it, marked partial.

Every measurement is a result record (DESIGN.md, contract 5) with ``batch``, ``seqlen`` (the
context length), ``decode_steps``, ``cache_seqlen`` (``seqlen + decode_steps``: the tokens the
cache is allocated for), ``weight_bytes`` and ``state_bytes`` (bytes per sequence of that cache;
in a ``decode_oom`` record the analytic bytes of the cache that did not fit) so
``eval/roofline.py records=[...]`` can set it beside its floor. Every setting is checked before
anything is measured: a context length listed twice, or one whose ``context + decode_steps``
tokens pass a learned position table (``pos_emb=learned``), is refused. Records go to ``output``
(default ``decode-<mixer>-<model>.json`` in the working directory; a ``.png`` output is refused),
a plot of state bytes and decode tokens/s versus context length beside them (``<stem>.png``),
both written atomically after each context length, and to W&B when ``wandb.enabled=true`` at the
end. Until the last length is done every record carries ``partial``: ``{"seqlens_done": [...],
"seqlens_planned": [...]}`` (:func:`eval.records.write_sweep_records`; the plot's title says so too),
which ``eval/report.py`` and ``eval/roofline.py`` note; the files of an earlier run that this one
replaces are kept as ``<name>.earlier`` until then. It runs on CPU too (tiny sizes, for tests).
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eval.cli import check_known_settings, run_command_line, user_errors
from eval.common import check_lengths, check_replaceable, is_out_of_memory, resolve_device
from eval.records import (
    check_output,
    check_same_writer,
    check_sweep_output,
    check_wandb_settings,
    git_sha,
    log_records_to_wandb,
    make_record,
    write_sweep_records,
)
from models import LanguageModel
from models.checkpoint import atomic_write_bytes
from models.config import config_from_groups
from models.model import DecodeStep
from training.settings import name_mixer_settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: DictConfig) -> LanguageModel:
    """A randomly initialised :class:`LanguageModel` of the composed ``model`` and ``mixer`` groups.

    Raises:
        ValueError: as :func:`models.config.config_from_groups`; a mixer's refusal of its settings,
            with the overrides of the settings it names (:func:`training.settings.name_mixer_settings`).
    """
    model = OmegaConf.to_container(cfg.model, resolve=True)
    mixer = OmegaConf.to_container(cfg.mixer, resolve=True)
    config = config_from_groups(model, mixer, int(cfg.vocab_size))
    try:
        return LanguageModel(config)
    except (ValueError, TypeError) as err:
        raise type(err)(name_mixer_settings(str(err), cfg.mixer)) from err


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
        cache = None  # the warm-up's cache freed before the next is allocated: one cache at a time
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
        cache = None  # the timed run's cache freed first
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


def host_memory_available() -> int | None:
    """Bytes the host can still give this process (int, bytes): ``MemAvailable`` of /proc/meminfo,
    lowered to what is left under the process's cgroup limit (v2 ``memory.max - memory.current``, v1
    ``memory.limit_in_bytes - memory.usage_in_bytes``); None where /proc/meminfo cannot be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        return None
    free = int(fields["MemAvailable"].split()[0]) * 1024  # kB
    cgroup = Path("/sys/fs/cgroup")
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit, usage in (("memory.max", "memory.current"), v1):
        try:
            limit_text = (cgroup / limit).read_text().strip()
            usage_text = (cgroup / usage).read_text().strip()
        except OSError:
            continue
        if limit_text.isdigit() and usage_text.isdigit():
            free = min(free, max(int(limit_text) - int(usage_text), 0))
        break
    return free


def check_host_memory(model: LanguageModel, batch: int, context: int, cache_seqlen: int) -> None:
    """Refuse a CPU measurement whose cache (``batch`` sequences of ``cache_seqlen`` tokens) and
    prefill logits (``batch`` x ``context`` x vocab_size, the parameters' dtype) together exceed
    :func:`host_memory_available`: Linux grants large allocations one by one and its out-of-memory
    killer then ends the process (status 137) without a word, where CUDA raises an error that
    becomes a ``decode_oom`` record. A lower bound of the peak (the layers' activations come on
    top), so a length that passes can still be killed; the lengths before it are on disk by then.

    Raises:
        MemoryError: they do not fit (the caller records it as ``decode_oom``).
    """
    free = host_memory_available()
    itemsize = next(model.parameters()).element_size()
    need = batch * model.state_size(cache_seqlen) + batch * context * model.config.vocab_size * itemsize
    if free is not None and need > free:
        raise MemoryError(
            f"the cache and the prefill's logits need {need / 2**30:.2f} GiB ({batch} sequences of "
            f"{cache_seqlen} tokens), more than the {free / 2**30:.2f} GiB of host memory available"
        )


def count_kernels(step) -> int:
    """GPU operations (kernels, memsets, copies) that one call of ``step`` launches, counted with
    ``torch.profiler`` (CUDA activity); the figure a fused decode step has to bring down."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def check_decode_settings(cfg: DictConfig) -> list[int]:
    """Check the settings of ``cfg`` that need no model, before any work; returns the context lengths.

    Raises:
        ValueError: a top-level setting ``conf/eval/decode.yaml`` does not define and nothing reads
            (:func:`eval.cli.check_known_settings`); ``wandb.enabled`` not a bool, or ``wandb.mode`` not
            online / offline while enabled; ``batch_size``, ``decode_steps`` or ``vocab_size`` not an integer
            >= 1 (``true`` is not one); ``context_lengths`` not a list of them or listing a length twice;
            ``output`` not one file path, a ``.png`` path (the plot's, beside the records), a path that
            cannot be written as a file (:func:`eval.records.check_output`), or whose file or plot
            cannot be replaced (:func:`eval.common.check_replaceable`).
    """
    check_known_settings(cfg, "eval/decode")
    check_wandb_settings(cfg.wandb)
    for key in ("batch_size", "decode_steps", "vocab_size"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    lengths = check_lengths(cfg.context_lengths, "context_lengths")
    if cfg.output is not None and not isinstance(cfg.output, str):
        raise ValueError(
            f"output must be one file path, got {cfg.output!r}; give one, e.g. output=decode.json "
            "(quote a name that Hydra reads as a number or a list: \"output='123'\")"
        )
    if cfg.output:
        output = Path(cfg.output)
        if output.suffix.lower() == ".png":
            raise ValueError(
                f"output={output} is a .png path, but the plot is written beside the records as "
                f"{output.stem}.png and would replace them; give a .json path such as "
                f"output={output.with_suffix('.json')}"
            )
        check_writable(output, "output")
    return lengths


def check_writable(output: Path, option: str) -> None:
    """Refuse, before anything is measured, a record file ``output`` (named ``option``: ``output`` or
    ``the default output``) that cannot be written (:func:`eval.records.check_output`), or whose file
    or plot beside it cannot be replaced (:func:`eval.common.check_replaceable`).

    Raises:
        ValueError: naming the file and the fix.
    """
    check_output(output, "decode.json", option=option)
    check_same_writer(output, "decode", option=option)
    check_replaceable(output, option=option)
    check_replaceable(output.with_suffix(".png"), option="the plot beside it,")


def check_positions(model: LanguageModel, lengths: list[int], decode_steps: int) -> None:
    """Refuse, before anything is measured, a context length whose ``context + decode_steps`` tokens
    pass the model's learned position table (:meth:`models.LanguageModel.position_limit`): the run
    would stop at that length and lose the lengths measured before it.

    Raises:
        ValueError: naming the mixer, its table size, the lengths that do not fit and the fix.
    """
    limit = model.position_limit()
    if limit is None:
        return
    name, size = limit
    too_long = [context for context in lengths if context + decode_steps > size]
    if too_long:
        raise ValueError(
            f"{name}: the learned position table has max_position={size} rows, but context_lengths "
            f"{too_long} with decode_steps={decode_steps} need up to {max(too_long) + decode_steps} "
            f"positions; keep every context length + decode_steps at most {size} (or raise it: "
            f"++mixer.settings.{name}.max_position={max(too_long) + decode_steps})"
        )


def oom_reason(err: BaseException) -> str:
    """The first line of an out-of-memory error's message (at most 200 characters), or the error's
    type when it has no message (``MemoryError()``)."""
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__


def decode_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the measurement ``cfg`` (``conf/eval/decode.yaml``) describes; returns the records.

    Raises:
        ValueError: invalid settings (:func:`check_decode_settings`; unknown dtype or device; a
            default output that cannot be written as a file; an output that an earlier job of the
            same ``-m`` sweep wrote), a model that does not fit in memory, a context length past a
            learned position table (:func:`check_positions`), or a cache whose bytes differ from
            the mixer's state_size.
    """
    lengths = check_decode_settings(cfg)
    device = resolve_device(cfg.device)
    dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    torch.manual_seed(0)
    try:
        model = build_model(cfg).to(device=device, dtype=DTYPES[dtype_name]).eval()
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        raise ValueError(
            f"the model (model={cfg.model.name}, mixer={cfg.mixer.name}, vocab_size={cfg.vocab_size}, "
            f"{dtype_name}) does not fit in memory on {device}: {oom_reason(err)}; lower vocab_size or "
            "choose a smaller model="
        ) from err
    check_positions(model, lengths, cfg.decode_steps)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    run = default_output(cfg).removesuffix(".json")
    output = Path(cfg.output or f"{run}.json")
    if not cfg.output:  # before the measurements, not after them
        check_writable(output, "the default output")
    check_sweep_output(output, option="output" if cfg.output else "the default output")
    copy_bw = copy_bandwidth(device)
    sha = git_sha()
    batch = cfg.batch_size
    records: list[dict[str, Any]] = []
    print(f"{run}: {model.num_params() / 1e6:.2f}M parameters, {dtype_name}, batch {batch}, {device}")
    print(f"{'context':>8}{'state B/seq':>14}{'prefill tok/s':>15}{'decode tok/s':>14}{'step GB/s':>11}"
          f"{'graph tok/s':>13}{'kernels/step':>14}")  # fmt: skip
    for i, context in enumerate(lengths):
        if i:  # the lengths so far, kept should a longer one kill the process (out of memory on CPU)
            write_results(output, records, lengths[:i], lengths, output_given=bool(cfg.output))
        cache_seqlen = context + cfg.decode_steps
        base = dict(
            run=run, model=model, task="decode", seqlen=context, cache_seqlen=cache_seqlen, device=device,
            sha=sha, batch=batch, weight_bytes=weight_bytes, dtype=dtype_name, model_size=cfg.model.name,
            decode_steps=cfg.decode_steps,
        )  # fmt: skip
        try:
            if device.type == "cpu":
                check_host_memory(model, batch, context, cache_seqlen)
            m = measure(model, batch, context, cfg.decode_steps, device)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            # Past the memory limit: say so in a record (its state_bytes: the cache for cache_seqlen tokens
            # that did not fit, as in every row of the file) and go on with the next length.
            reason = oom_reason(err)
            print(f"{context:>8}  skipped: out of memory ({reason})")
            records.append(
                make_record(
                    metric="decode_oom", value=1.0, state_bytes=model.state_size(cache_seqlen), reason=reason,
                    **base,
                )
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        # A step reads every weight and every sequence's cache (roofline floor bytes).
        step_bytes = weight_bytes + batch * m["state_bytes"]
        # state_bytes in every record is the cache measured for cache_seqlen tokens (the keyword
        # replaces make_record's state_size(seqlen), which is for the context alone).
        common = base | dict(
            state_bytes=m["state_bytes"], prefill_peak_bytes=m["prefill_peak_bytes"],
            decode_peak_bytes=m["decode_peak_bytes"], copy_bandwidth=copy_bw,
        )  # fmt: skip
        prefill_tps = batch * context / m["prefill_s"]
        decode_tps = batch / m["decode_step_s"]
        bandwidth = step_bytes / m["decode_step_s"]
        records += [
            make_record(metric="state_bytes", value=m["state_bytes"], **common),
            # flops: 2 per weight per token (the matmuls; attention's score FLOPs are left out, so the
            # roofline's compute floor stays a lower bound).
            make_record(
                metric="prefill_tokens_per_s",
                value=prefill_tps,
                tokens_per_s=prefill_tps,
                flops=2 * model.num_params() * batch * context,
                **common,
            ),
            make_record(
                metric="decode_tokens_per_s",
                value=decode_tps,
                tokens_per_s=decode_tps,
                mode="eager",
                **common,
            ),
            make_record(metric="decode_bandwidth", value=bandwidth, mode="eager", **common),
        ]
        if m["kernels_per_step"] is not None:
            records.append(
                make_record(metric="kernels_per_step", value=m["kernels_per_step"], mode="eager", **common)
            )
        if m["graph_step_s"] is not None:
            graph_tps = batch / m["graph_step_s"]
            records += [
                make_record(
                    metric="decode_tokens_per_s", value=graph_tps, tokens_per_s=graph_tps, mode="cuda_graph",
                    speedup_over_eager=m["decode_step_s"] / m["graph_step_s"], **common,
                ),
                make_record(
                    metric="decode_bandwidth", value=step_bytes / m["graph_step_s"], mode="cuda_graph",
                    **common,
                ),
            ]  # fmt: skip
        graph = "-" if m["graph_step_s"] is None else f"{batch / m['graph_step_s']:.1f}"
        kernels = "-" if m["kernels_per_step"] is None else str(m["kernels_per_step"])
        print(
            f"{context:>8}{m['state_bytes']:>14}{prefill_tps:>15.1f}{decode_tps:>14.1f}{bandwidth / 1e9:>11.2f}"
            f"{graph:>13}{kernels:>14}"
        )
    write_results(output, records, lengths, lengths, output_given=bool(cfg.output))
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


def write_results(
    output: Path, records: list[dict[str, Any]], done: list[int], planned: list[int], *, output_given: bool
) -> None:
    """Write the records of the context lengths ``done`` (tokens) of ``planned`` to ``output``, marked
    partial until all are done (:func:`eval.records.write_sweep_records`), and their plot beside them
    (:func:`plot`, ``<stem>.png``), each atomically; an earlier file of each is kept as
    ``<name>.earlier`` until the last length is written (:func:`eval.records.earlier_copy`).

    Raises:
        models.checkpoint.WriteError: a file cannot be written (an earlier one there is left as it was).
    """
    title = None if done == planned else f"partial: context lengths {done} of {planned}"
    png = output.with_suffix(".png")
    write_sweep_records(
        output,
        records,
        done,
        planned,
        output_given=output_given,
        beside=[(png, lambda: plot(records, png, title))],
    )


def plot(records: list[dict[str, Any]], path: Path, title: str | None = None) -> None:
    """State bytes per sequence and eager decode tokens/s versus context length, one line per mixer,
    written to ``path`` as a PNG atomically (rendered in memory, then a temporary file renamed over it),
    under ``title`` where one is given.

    Raises:
        OSError: ``path`` cannot be written (an earlier plot there is left as it was).
    """
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
        if by_mixer:
            ax.legend()
        else:  # an interrupted run that measured no length of this metric (matplotlib warned of no labels)
            ax.text(0.5, 0.5, "none measured", ha="center", va="center", transform=ax.transAxes)
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, lambda f: f.write(buffer.getvalue()))


def default_output(cfg: DictConfig) -> str:
    """The record file of a run without ``output=``: ``decode-<mixer>-<model>.json`` in the working
    folder."""
    return f"decode-{cfg.mixer.name}-{cfg.model.name}.json"


def check_sweep_job(cfg: DictConfig) -> str:
    """The ``-m`` sweep pre-check's ``check_job`` (:func:`eval.cli.check_command_line`): the checks of
    a job that need no weights, run on every job before the first measures anything (a new-user
    check: ``-m mixer=attention,mamba model.num_heads=4,3`` measured its first job, then stopped at
    the second without naming it); returns the job's default record file (:func:`default_output`),
    so that a sweep whose jobs would all write it is refused too.

    Raises:
        ValueError, TypeError: as :func:`check_decode_settings`, :func:`build_model` (the model is
            built on the meta device: no weights) and :func:`check_positions`.
    """
    lengths = check_decode_settings(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    check_positions(model, lengths, int(cfg.decode_steps))
    return default_output(cfg)


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval/decode")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        decode_eval(cfg)


if __name__ == "__main__":
    run_command_line(main, "eval/decode", check_job=check_sweep_job)

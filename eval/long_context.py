"""Long-context retrieval of a trained checkpoint: ``python eval/long_context.py ckpt=PATH``.

Byte-level needle retrieval at lengths far beyond training, per length x needle-depth cell:

- ``passkey`` (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): a pass key hidden
  at some depth of repeated filler, asked for at the end;
- ``multikey_needle`` (Hsieh et al. 2024, "RULER", multi-key NIAH): one of many key-value needles
  queried at the end.

(:mod:`data.retrieval` describes the prompts.) Lengths are ``length_multipliers`` (default 1x, 2x,
4x, 8x and 16x) times the training seqlen, or the absolute ``seqlens`` (not both); each is cut into
``num_depth_buckets`` depth ranges. Every cell is scored twice (``decode_paths``), by exact match of
the whole answer:

- ``parallel``: teacher forcing, one forward over prompt and answer;
- ``decode``: the prompt prefilled into the caches, then the answer generated greedily one token
  per decode step (:func:`eval.common.decode_predictions`, the step of ``LanguageModel.generate``).

The two exact matches agree (a greedy generation is right exactly when every teacher-forced
prediction is), up to argmax ties. A length that does not fit in memory -- ``torch.OutOfMemoryError``
on CUDA, ``MemoryError`` or PyTorch's CPU allocator error -- is recorded as skipped with the reason
and the sweep goes on to the next length. (On CPU, Linux may overcommit and kill the process instead
of failing the allocation: the record file, rewritten after each length, then keeps the lengths
finished before, marked ``partial``.)

The checkpoint may be trained on ``passkey`` or ``multikey_needle`` (``task=auto`` evaluates that
task with its training settings), or on any other byte-level data whose vocabulary is 256 bytes --
a ``data=text data.tokenizer=byte`` run -- with ``task=passkey`` or ``task=multikey_needle`` (the
task's default settings, lengths relative to the text seqlen; use ``seqlens=[...]`` when 1x is
shorter than the prompt, about 260 bytes for passkey).

Records (next to the checkpoint, ``<checkpoint>.long_context.json``, or
``<checkpoint>.long_context.<task>.json`` for a task the checkpoint was not trained on, so the two
tasks of a text checkpoint keep their own files; and to W&B when ``wandb.enabled=true``):
``exact_match`` per cell (``slice`` ``T{seqlen}_depth{lo}-{hi}``, ``depth_min``, ``depth_max``),
``accuracy`` per length over all its depths (``slice`` ``T{seqlen}``: what ``eval/report.py
task=passkey`` plots), and ``skipped`` per skipped length and path (``value`` the examples not
evaluated, ``reason``). The file is rewritten atomically after each length; until the last one is
done every record carries ``partial``: ``{"seqlens_done": [...], "seqlens_planned": [...]}``
(:func:`eval.records.write_sweep_records`), which ``eval/report.py`` notes; an earlier run's file
that it replaces is kept as ``<name>.earlier`` until then.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.mqar import MAX_SLICES
from data.synthetic import TaskSlice, exact_match
from eval.cli import CONF_DIR, run_command_line, user_errors
from eval.common import (
    EvalContext,
    Scores,
    build_datamodule,
    check_default_output,
    check_position_limit,
    check_settings,
    checkpoint_sweep_check,
    evaluate,
    finish,
    is_out_of_memory,
    length_settings,
    load_checkpoint,
    per_example,
    print_table,
    resolve_device,
    wrong_task_error,
)

TASKS = ("passkey", "multikey_needle")
SCORERS = {"exact_match": per_example(exact_match)}
BYTE_VOCAB = 256
DEFAULT_MULTIPLIERS = (1, 2, 4, 8, 16)
"""``length_multipliers`` when neither it nor ``seqlens`` is given."""


def _retrieval_plan(batch: dict[str, Any]) -> tuple[int, torch.Tensor]:
    """Decode plan of a retrieval slice: prefill the prompt (one length per slice), generate the answer."""
    prompt_len = batch["prompt_len"]  # (B,), all equal
    return int(prompt_len[0]), prompt_len


def output_variant(ctx: EvalContext, task: str) -> str | None:
    """The variant of the default record file (:func:`eval.common.output_path`) for ``task`` on
    ``ctx``'s checkpoint: None for the task it was trained on, else the task's name."""
    return None if task == ctx.task else task


def choose_task(ctx: EvalContext, task: str) -> str:
    """The retrieval task to run on ``ctx``'s checkpoint: its own for ``task=auto``.

    Raises:
        ValueError: ``task`` not auto/passkey/multikey_needle; ``auto`` for a checkpoint not trained
            on a retrieval task; a checkpoint whose data is not byte-level (vocabulary 256; text
            trained with ``data.tokenizer=byte``), naming the script for its task.
    """
    if task not in ("auto", *TASKS):
        raise ValueError(f"task must be auto, passkey or multikey_needle, got {task!r}")
    trained = ctx.task
    if trained == "text":
        tokenizer = (ctx.lit.hparams.get("tokenizer_config") or {}).get("kind")
        if tokenizer != "byte" or ctx.model.config.vocab_size != BYTE_VOCAB:
            raise ValueError(
                f"{ctx.ckpt} was trained on {tokenizer or 'non-byte'}-level text (vocabulary "
                f"{ctx.model.config.vocab_size}); eval/long_context.py needs byte-level data (vocabulary "
                f"{BYTE_VOCAB}: train with data.tokenizer=byte); evaluate it with python eval/perplexity.py"
            )
        if task == "auto":
            raise ValueError(
                f"{ctx.ckpt} was trained on byte-level text, not on a retrieval task: pass task=passkey or "
                "task=multikey_needle"
            )
        return task
    if trained not in TASKS:
        raise wrong_task_error(ctx.ckpt, trained, "eval/long_context.py", (*TASKS, "text (byte-level)"))
    return trained if task == "auto" else task


def _test_grid(lengths: Sequence[int], buckets: int) -> list[dict[str, Any]]:
    """``{seqlen, depth_min, depth_max}`` for every length x depth range."""
    return [
        {"seqlen": n, "depth_min": b / buckets, "depth_max": (b + 1) / buckets}
        for n in lengths
        for b in range(buckets)
    ]


def _fitting_length(data_cfg: dict[str, Any], own_settings: bool, buckets: int, length: int) -> int | None:
    """A length from ``length`` on that every depth cell of the task accepts, or ``None`` if unknown.

    The data module checks one config at a time and names the shortest length that fits the first one
    it refuses (the whole context [0, 1) first when the task's settings are its defaults, then each
    depth range); a narrower range may need more. Following each ``use seqlen >= N`` until every check
    passes gives a length the user can be told that is accepted.

    Args:
        data_cfg: the task's data config (``name`` and its settings).
        own_settings: ``data_cfg`` is the checkpoint's own training config (its seqlen is kept);
            otherwise its seqlen is the length tried.
        buckets: ``num_depth_buckets``.
        length: the first length to try (the data module's first advice).
    """
    for _ in range(64):  # each step moves to a strictly longer length; a few suffice
        cfg = data_cfg if own_settings else {**data_cfg, "seqlen": length}
        try:
            build_datamodule(cfg, test_configs=_test_grid([length], buckets))
        except ValueError as exc:
            needed = re.search(r"use seqlen >= (\d+)", str(exc))
            if needed is None or int(needed.group(1)) <= length:
                return None
            length = int(needed.group(1))
        else:
            return length
    return None


def _score_length(ctx: EvalContext, dm, cells: list[TaskSlice], path: str) -> list[Scores] | str:
    """Scores of every cell of one length through ``path``, or the reason it was skipped (out of memory)."""
    try:
        return [
            evaluate(ctx.model, dm.dataloader(cell), path, ctx.device, SCORERS, _retrieval_plan)
            for cell in cells
        ]
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        reason = f"out of memory: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return reason


def long_context_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the evaluation that ``cfg`` (``conf/eval/long_context.yaml``) describes; returns the records.

    Records carry the fields of :meth:`eval.common.EvalContext.record` with ``task`` (``passkey`` or
    ``multikey_needle``), ``metric`` (``exact_match`` per cell, ``accuracy`` per length, both in
    [0, 1]; ``skipped``), ``slice``, ``seqlen``, ``length_multiplier`` (seqlen over the training
    seqlen), ``examples`` and ``tokens_per_s``. The record file is rewritten after each length, its
    records marked ``partial`` until the last length is done (see the module docstring).

    Raises:
        FileNotFoundError: missing checkpoint.
        ValueError/TypeError: corrupt checkpoint, a checkpoint without byte-level data or trained on
            another task (see :func:`choose_task`), invalid settings, or a length too short for the
            task's prompt (the message gives a length that every depth range accepts).
    """
    check_settings(cfg, "long_context")
    length_option, values = length_settings(cfg, DEFAULT_MULTIPLIERS)
    device = resolve_device(cfg.device)
    ctx = load_checkpoint(cfg.ckpt, device, None, "eval/long_context.py")
    task = choose_task(ctx, cfg.task)
    check_default_output(cfg, ctx, "long_context", variant=output_variant(ctx, task))
    train_seqlen = int(ctx.data["seqlen"])
    lengths = sorted(set(values if length_option == "seqlens" else [train_seqlen * m for m in values]))
    buckets = cfg.num_depth_buckets
    if buckets is None:
        buckets = int(ctx.data.get("num_depth_buckets") or 4)
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"num_depth_buckets must be null or an integer >= 1, got {buckets!r}")
    if len(lengths) * buckets > MAX_SLICES:
        # Each cell is a test slice with examples of its own (a new-user check: the data module's
        # words about test_configs advised longer lengths, which cannot help).
        given = cfg.seqlens is not None or cfg.length_multipliers is not None
        source = f"from {length_option}" if given else f"the default length_multipliers={values}"
        raise ValueError(
            f"eval/long_context.py: {len(lengths)} length{'s' if len(lengths) > 1 else ''} ({source}) x "
            f"num_depth_buckets={buckets} make {len(lengths) * buckets} cells, more than the {MAX_SLICES} "
            "test slices a task holds; lower num_depth_buckets or give fewer lengths"
        )
    # The task's settings: the checkpoint's when it trained on this task, else the task's defaults.
    data_cfg = ctx.data if ctx.task == task else {"name": task, "seqlen": lengths[0]}
    try:
        dm = build_datamodule(
            data_cfg,
            test_configs=_test_grid(lengths, buckets),
            num_test_examples=cfg.num_examples,
            batch_size=cfg.batch_size,
        )
        dm.setup("test")
    except ValueError as exc:
        # The data module speaks of its own settings (test_configs[i], seqlen): its cell i is named
        # by its length and depths, which this evaluation's options give.
        grid = _test_grid(lengths, buckets)

        def cell(match: re.Match) -> str:
            i = int(match.group(1))
            if i >= len(grid):
                return match.group(0)
            depths = f"[{grid[i]['depth_min']:g}, {grid[i]['depth_max']:g})"
            return f"the length {grid[i]['seqlen']} at depths {depths}"

        reason = re.sub(r"test_configs\[(\d+)\]", cell, str(exc))
        # A length too short for the prompt is the usual case (a new-user check was told to lower the
        # buckets first, which could not help): the minimum length first, one that passes every cell's
        # check, not only the one refused first (a new-user check was told 254 for the whole context,
        # then refused 254 for a quarter of it).
        needed = re.search(r"use seqlen >= (\d+)", reason)
        shortest = None
        if needed is not None:
            shortest = _fitting_length(data_cfg, ctx.task == task, buckets, int(needed.group(1)))
        if shortest is None:
            fix = f"use longer {length_option}"
        else:  # the data module's own advice is for the one config it refused: ours replaces it
            reason = re.sub(r"; use seqlen >= \d+( \(\d+ needles\))?", "", reason)
            fix = f"give lengths of at least {shortest} tokens (e.g. seqlens=[{shortest}])"
        raise ValueError(
            f"eval/long_context.py: the lengths {lengths} (from {length_option}) x "
            f"num_depth_buckets={buckets} do not fit the {task} task: {reason} (the task's seqlen is each "
            f"length); {fix}, or lower num_depth_buckets"
        ) from exc

    records, rows = [], []
    check_position_limit(ctx.model, max(lengths), length_option)
    # A task other than the checkpoint's own gets a file of its own, so evaluating one checkpoint on
    # both tasks keeps both results.
    variant = None if task == ctx.task else task
    for i, seqlen in enumerate(lengths):
        if i:  # the lengths so far, kept should a longer one kill the process (out of memory on CPU)
            finish(records, cfg, ctx, "long_context", variant, progress=(lengths[:i], lengths))
        cells = [s for s in dm.test_sets if s.seqlen == seqlen]
        common = {"task": task, "seqlen": seqlen, "length_multiplier": seqlen / train_seqlen}
        length_row = {"slice": f"T{seqlen} (all)"}
        cell_rows = [{"slice": cell.name} for cell in cells]
        for path in cfg.decode_paths:
            print(f"evaluating T{seqlen} ({len(cells)} depth ranges) through the {path} path ...", flush=True)
            scores = _score_length(ctx, dm, cells, path)
            if isinstance(scores, str):
                print(f"  skipped: {scores}", flush=True)
                examples = sum(len(cell) for cell in cells)
                records.append(
                    ctx.record(
                        metric="skipped",
                        value=examples,
                        path=path,
                        slice=f"T{seqlen}",
                        reason=scores,
                        **common,
                    )
                )
                length_row[path] = "skipped"
                continue
            for cell, cell_scores, row in zip(cells, scores, cell_rows, strict=True):
                row[path] = cell_scores.value("exact_match")
                records.append(
                    ctx.record(
                        metric="exact_match",
                        value=cell_scores.value("exact_match"),
                        path=path,
                        slice=cell.name,
                        depth_min=cell.config["depth_min"],
                        depth_max=cell.config["depth_max"],
                        examples=cell_scores.examples,
                        tokens_per_s=cell_scores.tokens_per_s,
                        **common,
                    )
                )
            pooled = Scores.pool(scores)
            length_row[path] = pooled.value("exact_match")
            records.append(
                ctx.record(
                    metric="accuracy",
                    value=pooled.value("exact_match"),
                    path=path,
                    slice=f"T{seqlen}",
                    examples=pooled.examples,
                    tokens_per_s=pooled.tokens_per_s,
                    **common,
                )
            )
        rows += cell_rows + [length_row]

    print_table(f"{task} exact match ({ctx.model.config.name})", list(cfg.decode_paths), rows)
    finish(records, cfg, ctx, "long_context", variant, progress=(lengths, lengths))
    return records


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="long_context")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        long_context_eval(cfg)


if __name__ == "__main__":
    # Each job's task too (task=auto for a text checkpoint) before the first runs.
    check_job = checkpoint_sweep_check(
        None,
        "eval/long_context.py",
        lambda ctx, cfg: output_variant(ctx, choose_task(ctx, cfg.task)),
        name="long_context",
        settings=lambda cfg: (check_settings(cfg, "long_context"), length_settings(cfg, DEFAULT_MULTIPLIERS)),
    )
    run_command_line(main, "long_context", CONF_DIR / "eval", check_job=check_job)

"""Recall evaluation of a trained checkpoint: ``python eval/recall.py ckpt=PATH``.

Rebuilds the model and its data module from the checkpoint alone and evaluates the recall task it
was trained on (``data.name`` of the checkpoint), at the training seqlen and at longer ones
(``length_multipliers``, 1x, 2x and 4x by default):

- ``mqar``: multi-query associative recall (Arora et al. 2024, "Zoology", Sec. 3), with
  proportionally more key-value pairs at longer lengths; accuracy over all query positions.
- ``induction_heads``: induction heads (Gu & Dao 2023, "Mamba", Sec. 4.1.2 and App. E.1; Olsson et
  al. 2022); accuracy of the one answer at the last position (the paper tests from 2^6 up to 2^20
  tokens: pass e.g. ``length_multipliers=[1,4,16]``, or absolute lengths, shorter than the
  training length too, with ``seqlens=[64,128,256,1024]``, which replaces the multipliers: giving
  both is an error).

Twice per slice (``decode_paths``):

- ``parallel``: one forward over the whole sequence (training's path);
- ``decode``: a context prefilled into the caches, then every further token fed one at a time
  through the decode step (generation's path; :func:`eval.common.decode_predictions`). The
  context is the key-value pairs for MQAR and the first half of the sequence for induction heads
  (so the first trigger lies in the prefilled part or in the stepped part about equally often).

Every scored token is an input token, never the model's own output, so the two paths compute the
same function and must agree; a gap is a bug in a cache or decode kernel. Prints a table per slice,
writes result records (metric ``accuracy``, per slice and path) next to the checkpoint
(``<checkpoint>.recall.json``) and logs them to W&B when ``wandb.enabled=true``.
"""

from __future__ import annotations

import re
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eval.cli import CONF_DIR, run_command_line, user_errors
from eval.common import (
    EvalContext,
    build_datamodule,
    check_default_output,
    check_position_limit,
    check_settings,
    checkpoint_sweep_check,
    evaluate,
    finish,
    length_settings,
    load_checkpoint,
    per_position,
    print_table,
    resolve_device,
)

TASKS = ("mqar", "induction_heads")
TITLES = {"mqar": "MQAR recall accuracy", "induction_heads": "induction-heads accuracy"}
DEFAULT_MULTIPLIERS = (1, 2, 4)
"""``length_multipliers`` when neither it nor ``seqlens`` is given."""


def _mqar_slices(
    ctx: EvalContext, cfg: DictConfig, multipliers: list[int]
) -> tuple[Any, list[dict[str, Any]]]:
    """The MQAR data module of the checkpoint with one test slice per multiplier, and per slice
    ``{seqlen, num_kv_pairs, prefill_len, extra}``."""
    data_cfg = ctx.data
    seqlen, num_kv_pairs = int(data_cfg["seqlen"]), int(data_cfg["num_kv_pairs"])
    vocab_size = int(data_cfg["vocab_size"])
    limit = -(-vocab_size // seqlen)  # the smallest multiplier whose seqlen reaches the vocabulary
    too_long = [m for m in multipliers if m >= limit]
    if too_long:
        # Training needs vocab_size > seqlen, so limit >= 2 and 1x always fits.
        example = [m for m in multipliers if m < limit] or [1]
        raise ValueError(
            f"length_multipliers {too_long} give seqlens of at least the checkpoint's MQAR vocabulary "
            f"({vocab_size}), which the generator cannot fill with distinct keys; use multipliers "
            f"below {limit} (e.g. length_multipliers=[{','.join(map(str, example))}])"
        )
    tests = [{"seqlen": seqlen * m, "num_kv_pairs": num_kv_pairs * m} for m in multipliers]
    dm = build_datamodule(
        data_cfg, test_configs=tests, num_test_examples=cfg.num_examples, batch_size=cfg.batch_size
    )
    slices = [
        {
            "seqlen": t["seqlen"],
            "prefill_len": 2 * t["num_kv_pairs"],
            "extra": {"num_kv_pairs": t["num_kv_pairs"]},
        }
        for t in tests
    ]
    return dm, slices


def _induction_slices(
    ctx: EvalContext, cfg: DictConfig, seqlens: list[int], option: str
) -> tuple[Any, list[dict[str, Any]]]:
    """The induction-heads data module with one test slice per length, and per slice
    ``{seqlen, prefill_len, extra}``; ``option`` is the setting the lengths come from, for messages.

    Raises:
        ValueError: a length the task refuses, named by ``option`` (the data module's message
            named its own ``test_configs[i]``).
    """
    try:
        dm = build_datamodule(
            ctx.data,
            test_configs=[{"seqlen": n} for n in seqlens],
            num_test_examples=cfg.num_examples,
            batch_size=cfg.batch_size,
        )
    except ValueError as exc:
        refused = re.match(r"test_configs\[(\d+)\]: (.*)", str(exc), re.DOTALL)
        if refused is None:
            raise
        n = seqlens[int(refused.group(1))]
        raise ValueError(f"{option} gives the length {n}, which the induction_heads task refuses: "
                         f"{refused.group(2)}") from exc  # fmt: skip
    return dm, [{"seqlen": n, "prefill_len": n // 2, "extra": {}} for n in seqlens]


def recall_lengths(ctx: EvalContext, cfg: DictConfig) -> tuple[str, list]:
    """The setting the lengths come from and its values (:func:`eval.common.length_settings`) for
    ``ctx``'s checkpoint.

    Raises:
        ValueError: ``seqlens`` for an MQAR checkpoint (with the fix), or as ``length_settings``.
    """
    if ctx.task == "mqar" and cfg.seqlens is not None:
        # before seqlens' own checks: any advice on its form would lead to this error next
        raise ValueError(
            "seqlens is for induction_heads checkpoints; an MQAR slice scales its key-value pairs "
            f"with the length, so give length_multipliers instead (the multiples of its training "
            f"seqlen, {ctx.data['seqlen']}, to test)"
        )
    return length_settings(cfg, DEFAULT_MULTIPLIERS)


def check_recall_job(ctx: EvalContext, cfg: DictConfig) -> None:
    """The ``-m`` sweep pre-check's checks of a job with its checkpoint (:func:`recall_lengths`), for
    :func:`eval.common.checkpoint_sweep_check`; the default record file has no variant."""
    recall_lengths(ctx, cfg)


def recall_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the evaluation that ``cfg`` (``conf/eval/recall.yaml``) describes; returns the records.

    Records carry the fields of :meth:`eval.common.EvalContext.record` with ``task`` (``mqar`` or
    ``induction_heads``), ``metric: accuracy`` (in [0, 1]), ``slice``, ``tokens_per_s`` and
    ``scored_positions``; MQAR records add ``num_kv_pairs``.

    Raises:
        FileNotFoundError: missing checkpoint.
        ValueError: corrupt checkpoint, a checkpoint not trained on a recall task (the message
            names the supported tasks and the script for the checkpoint's), or invalid settings
            (unknown decode path, both ``seqlens`` and ``length_multipliers``, a longer MQAR slice
            that the vocabulary cannot hold, ``seqlens`` for an MQAR checkpoint).
    """
    check_settings(cfg, "recall")
    device = resolve_device(cfg.device)
    ctx = load_checkpoint(cfg.ckpt, device, TASKS, "eval/recall.py")
    check_default_output(cfg, ctx, "recall")
    option, values = recall_lengths(ctx, cfg)
    if ctx.task == "mqar":
        dm, slices = _mqar_slices(ctx, cfg, values)
    else:
        lengths = values if option == "seqlens" else [int(ctx.data["seqlen"]) * m for m in values]
        dm, slices = _induction_slices(ctx, cfg, lengths, option)
    check_position_limit(ctx.model, max(test["seqlen"] for test in slices), option)
    dm.setup("test")

    records, rows = [], []
    for loader, slice_name, test in zip(dm.test_dataloader(), dm.slice_names, slices, strict=True):
        row = {"slice": slice_name}
        for path in cfg.decode_paths:
            print(f"evaluating {slice_name} through the {path} path ...", flush=True)
            scores = evaluate(
                ctx.model,
                loader,
                path,
                device,
                {"accuracy": per_position},
                lambda batch, n=test["prefill_len"]: (n, None),
            )
            row[path] = scores.value("accuracy")
            records.append(
                ctx.record(
                    task=ctx.task,
                    metric="accuracy",
                    value=scores.value("accuracy"),
                    seqlen=test["seqlen"],
                    path=path,
                    slice=slice_name,
                    tokens_per_s=scores.tokens_per_s,
                    scored_positions=int(scores.weights["accuracy"]),
                    **test["extra"],
                )
            )
        if len(cfg.decode_paths) == 2:
            row["|diff| pt"] = 100 * abs(row["parallel"] - row["decode"])
        rows.append(row)

    columns = list(cfg.decode_paths) + (["|diff| pt"] if len(cfg.decode_paths) == 2 else [])
    print_table(f"{TITLES[ctx.task]} ({ctx.model.config.name})", columns, rows)
    finish(records, cfg, ctx, "recall")
    return records


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="recall")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        recall_eval(cfg)


if __name__ == "__main__":
    run_command_line(
        main,
        "recall",
        CONF_DIR / "eval",
        check_job=checkpoint_sweep_check(
            TASKS, "eval/recall.py", check_recall_job, name="recall",
            settings=lambda cfg: check_settings(cfg, "recall"),
        ),
    )

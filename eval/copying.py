"""Copying evaluation of a trained checkpoint: ``python eval/copying.py ckpt=PATH``.

(Named ``copying.py``, not ``copy.py``, which would shadow the standard library's ``copy``.)
Rebuilds the model and its data module from the checkpoint alone and evaluates the copy task it
was trained on (``data.name``), on the data module's test slices -- the training range and, by
default, longer strings / sequences than training -- or on ``test_configs`` given on the command
line:

- ``copy`` (Jelassi et al. 2024, "Repeat After Me", arXiv 2402.01032): ``BOS s SEP s EOS``; the
  prompt is ``BOS s SEP`` and the answer the copy and its EOS. Slices ``len{min}-{max}`` of string
  lengths; override with e.g. ``'test_configs=[{min_len:41,max_len:80}]'``.
- ``selective_copying`` (Gu & Dao 2023, "Mamba", Sec. 4.1.1 and App. E.1): the data tokens
  scattered in noise must be reproduced at the markers. The prompt is the noise-and-data region;
  slices ``T{seqlen}_data{M}``; override with e.g. ``'test_configs=[{seqlen:256}]'``.

Metrics per slice and path (records ``metric`` in [0, 1]):

- ``accuracy``: string-level exact match, the whole answer right (Jelassi et al.'s accuracy;
  :func:`data.copying.string_exact_match`, :func:`data.synthetic.exact_match`);
- ``char_accuracy``: the fraction of the string's characters right, averaged over examples
  (:func:`data.copying.char_accuracy`, EOS not counted; for selective copying
  :func:`data.synthetic.token_accuracy` over the data tokens, whose values may equal copy's EOS id).

Paths: ``parallel`` scores the teacher-forced forward; ``decode`` prefills each prompt into the
caches and decodes greedily token by token (:func:`eval.common.decode_predictions`). For ``copy``
the decode path generates: each copied token is the model's own previous prediction, so exact match
equals the teacher-forced one (a greedy generation is all right exactly when every teacher-forced
prediction is) while character accuracy may differ either way: a generation that slips can stay off
course (lower), or its own earlier outputs can lead it to characters that the teacher-forced pass,
fed the true prefix, gets wrong (higher; seen on a briefly trained copy checkpoint).
Selective copying feeds the markers, never the model's outputs, so both metrics must agree across
paths. Prints a table, writes the records next to the checkpoint (``<checkpoint>.copying.json``) and
logs them to W&B when ``wandb.enabled=true``.
"""

from __future__ import annotations

from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from data.copying import char_accuracy, string_exact_match
from data.mqar import IGNORE_INDEX
from data.synthetic import exact_match, token_accuracy
from eval.cli import CONF_DIR, run_command_line, user_errors
from eval.common import (
    build_datamodule,
    check_default_output,
    check_position_limit,
    check_settings,
    checkpoint_sweep_check,
    evaluate,
    finish,
    load_checkpoint,
    per_example,
    print_table,
    resolve_device,
)

TASKS = ("copy", "selective_copying")
SCORERS = {
    "copy": {"accuracy": per_example(string_exact_match), "char_accuracy": per_example(char_accuracy)},
    "selective_copying": {"accuracy": per_example(exact_match), "char_accuracy": per_example(token_accuracy)},
}


def _copy_plan(batch: dict[str, Any]) -> tuple[int, torch.Tensor]:
    """Decode plan of copy: prefill the shortest prompt of the batch, generate from each prompt's end."""
    prompt_len = batch["prompt_len"]  # (B,) n + 2: BOS, the string, SEP
    return int(prompt_len.min()), prompt_len


def _selective_plan(batch: dict[str, Any]) -> tuple[int, None]:
    """Decode plan of selective copying: prefill the noise-and-data region, step through the markers."""
    labels = batch["labels"]  # (B, T), scored exactly at the M markers
    return labels.shape[1] - int((labels[0] != IGNORE_INDEX).sum()), None


def copying_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the evaluation that ``cfg`` (``conf/eval/copying.yaml``) describes; returns the records.

    Records carry the fields of :meth:`eval.common.EvalContext.record` with ``task`` (``copy`` or
    ``selective_copying``), ``metric`` (``accuracy`` = string exact match, ``char_accuracy``),
    ``slice``, ``seqlen`` (the slice's example length), ``tokens_per_s``, ``examples`` and the
    slice's settings (``min_len``/``max_len`` or ``num_data_tokens``).

    Raises:
        FileNotFoundError: missing checkpoint.
        ValueError/TypeError: corrupt checkpoint, a checkpoint not trained on a copy task (the
            message names the script for its task), or invalid settings (unknown decode path,
            ``test_configs`` the task rejects).
    """
    check_settings(cfg, "copying")
    device = resolve_device(cfg.device)
    ctx = load_checkpoint(cfg.ckpt, device, TASKS, "eval/copying.py")
    check_default_output(cfg, ctx, "copying")
    overrides: dict[str, Any] = {"num_test_examples": cfg.num_examples, "batch_size": cfg.batch_size}
    if cfg.test_configs is not None:
        if not isinstance(cfg.test_configs, ListConfig):
            raise ValueError(
                f"test_configs must be a list of slice configs, e.g. 'test_configs=[{{min_len:41,max_len:80}}]' "
                f"(copy) or 'test_configs=[{{seqlen:256}}]' (selective copying), got {cfg.test_configs!r}"
            )
        if not cfg.test_configs:  # the data module's words were training's ("val/acc and val/loss")
            raise ValueError(
                "test_configs is empty: give at least one slice, e.g. "
                "'test_configs=[{min_len:41,max_len:80}]' (copy) or 'test_configs=[{seqlen:256}]' (selective "
                "copying), or leave it out for the default"
            )
        overrides["test_configs"] = OmegaConf.to_container(cfg.test_configs, resolve=True)
    dm = build_datamodule(ctx.data, **overrides)
    dm.setup("test")
    check_position_limit(ctx.model, max(s.seqlen for s in dm.test_sets), "test_configs")
    plan = _copy_plan if ctx.task == "copy" else _selective_plan

    records, rows = [], []
    for loader, test_set in zip(dm.test_dataloader(), dm.test_sets, strict=True):
        row = {"slice": test_set.name}
        settings = {k: v for k, v in test_set.config.items() if k != "seqlen"}
        for path in cfg.decode_paths:
            print(f"evaluating {test_set.name} through the {path} path ...", flush=True)
            scores = evaluate(ctx.model, loader, path, device, SCORERS[ctx.task], plan)
            for metric in SCORERS[ctx.task]:
                row[f"{metric} {path}"] = scores.value(metric)
                records.append(
                    ctx.record(
                        task=ctx.task,
                        metric=metric,
                        value=scores.value(metric),
                        seqlen=test_set.seqlen,
                        path=path,
                        slice=test_set.name,
                        tokens_per_s=scores.tokens_per_s,
                        examples=scores.examples,
                        **settings,
                    )
                )
        rows.append(row)

    columns = [f"{m} {p}" for m in SCORERS[ctx.task] for p in cfg.decode_paths]
    meaning = "the whole string right" if ctx.task == "copy" else "every data token right"
    print_table(f"{ctx.task} ({ctx.model.config.name}); accuracy = {meaning}", columns, rows)
    finish(records, cfg, ctx, "copying")
    return records


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="copying")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        copying_eval(cfg)


if __name__ == "__main__":
    run_command_line(
        main,
        "copying",
        CONF_DIR / "eval",
        check_job=checkpoint_sweep_check(
            TASKS, "eval/copying.py", name="copying", settings=lambda cfg: check_settings(cfg, "copying")
        ),
    )

"""Perplexity of a text checkpoint on its held-out split: ``python eval/perplexity.py ckpt=PATH``.

Rebuilds the model and its :class:`data.text.TextDataModule` from the checkpoint alone -- the same
corpus (a local file or a ``datasets`` hub dataset) and the tokenizer stored in the checkpoint, so
token ids are the ones the model was trained with -- and reports on the validation split (the last
10% of the corpus' characters, which training never saw; non-overlapping blocks of ``seqlen``
tokens, every position scored):

- ``loss``: mean next-token cross-entropy in nats per token, and ``perplexity = exp(loss)``,
  through the ``parallel`` path (one forward per block);
- a consistency check of the decode path: on the first ``decode_prefix`` tokens of the first
  ``decode_examples`` blocks, the loss through the parallel forward and through the decode path
  (half the prefix prefilled into the caches, the rest fed one token per step,
  ``LanguageModel.decode_logits``). Both compute the same function, so the losses must agree within
  ``tolerance`` (fp32); a larger gap is warned about and recorded (``agrees: false``) -- it is a bug in
  a cache or decode kernel.

``data.*`` overrides evaluate on another corpus or length: ``data.path=other.txt`` (its last 10%),
``data.dataset_name=... data.config_name=...``, ``data.seqlen=1024`` (a context longer than
training). Prints a table, writes records next to the checkpoint (``<checkpoint>.perplexity.json``)
and logs them to W&B when ``wandb.enabled=true``.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data import UnknownCharacterError
from data.text import NO_CORPUS_ADVICE
from eval.cli import CONF_DIR, run_command_line, user_errors
from eval.common import (
    EvalContext,
    build_datamodule,
    check_default_output,
    check_position_limit,
    check_settings,
    checkpoint_sweep_check,
    finish,
    load_checkpoint,
    print_table,
    resolve_device,
)
from models.lit import scored_metrics
from training.settings import name_data_setting

TASKS = ("text",)
# Data settings of the checkpoint that an evaluation does not change, and why.
REFUSED_DATA_SETTINGS = {
    "train_fraction": "the held-out split is the part of the corpus the checkpoint did not train on (its "
    "train_fraction), and another fraction would score text it trained on or leave held-out text out",
    "batch_size": "give batch_size=<n>",
    "seed": "the validation split is read in order, so no seed draws anything",
}
CORPUS_KEYS = ("path", "dataset_name")


def text_datamodule(ctx: EvalContext, overrides: dict[str, Any], batch_size: int):
    """The checkpoint's text data module (its stored tokenizer) with ``overrides`` of its data
    config applied (``None`` values ignored; a new ``path`` or ``dataset_name`` replaces the
    corpus), set up.

    Raises:
        FileNotFoundError: the corpus file does not exist (the checkpoint's own: said so, with how to
            give its new path).
        ValueError: a corpus character outside a char tokenizer's vocabulary, a split too short
            for one block, the checkpoint's own corpus (no corpus override) whose contents differ
            from those it was trained on (by the stored SHA-256), a vocabulary that differs from the model's, a ``tokenizer`` override of
            a checkpoint that stores its tokenizer, or a ``seqlen`` beyond a learned position table.
    """
    data_cfg = dict(ctx.data)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if any(key in overrides for key in CORPUS_KEYS):
        # Another corpus: none of the checkpoint's (a hub dataset's split, config and column stay
        # only where given again).
        data_cfg.update(dict.fromkeys(CORPUS_KEYS), split="train", config_name=None, text_column="text")
    stored = ctx.lit.hparams.get("tokenizer_config")
    if stored and "tokenizer" in overrides:  # it was replaced by the stored one without a word
        raise ValueError(
            f"data.tokenizer={overrides['tokenizer']!r}: the checkpoint's tokenizer ({stored.get('kind')}) is "
            "the one its model's vocabulary was trained with; remove the override"
        )
    data_cfg.update(overrides)
    data_cfg["tokenizer"] = stored or data_cfg.get("tokenizer", "char")
    try:
        dm = build_datamodule(data_cfg, batch_size=batch_size)
    except ValueError as err:  # the module names its own argument: an override is data.<it>
        message = name_data_setting(str(err), overrides)
        if message == str(err):
            raise
        raise ValueError(message) from err
    # before the corpus is read: a learned position table refused the length only inside the model
    check_position_limit(ctx.model, dm.seqlen, "data.seqlen")
    try:
        dm.setup("validate")
    except FileNotFoundError as err:
        if any(key in overrides for key in CORPUS_KEYS) or not data_cfg.get("path"):
            raise
        # A new-user check: the moved corpus was told "set data.path to a text file", as if none were set.
        raise FileNotFoundError(
            f"the checkpoint's training corpus is not found ({str(err).removesuffix(NO_CORPUS_ADVICE)}); if "
            "it moved, pass data.path=<its new path> (its SHA-256 must match the checkpoint's), or evaluate "
            "another text with data.path=<file>"
        ) from None
    except UnknownCharacterError as err:
        if not stored:
            raise
        # The model's vocabulary is the stored tokenizer's: another tokenizer is no way out here.
        raise ValueError(
            f"character {err.char!r} (U+{ord(err.char):04X}) at index {err.index} of the corpus is not in "
            f"the checkpoint's tokenizer ({err.vocab_size} characters, which its model was trained on); "
            "evaluate on a text written in those characters"
        ) from None
    trained_on = ctx.lit.hparams.get("corpus_sha256")
    if not any(key in overrides for key in CORPUS_KEYS) and trained_on and dm.corpus_sha256 != trained_on:
        # A new-user check: the corpus edited in place (its lines reversed) was evaluated without a
        # word, its "held-out" split then holding text the model trained on.
        raise ValueError(
            f"the checkpoint's corpus {dm.path or dm.dataset_name!r} has changed since training (its SHA-256 "
            f"begins {dm.corpus_sha256[:12]}, the checkpoint's {trained_on[:12]}): its last 10% is no longer "
            "the held-out text; evaluate on the training corpus as it was, or name another text on purpose "
            "with data.path=<file>"
        )
    if dm.vocab_size != ctx.model.config.vocab_size:
        raise ValueError(
            f"the corpus' vocabulary has {dm.vocab_size} tokens but the model's has "
            f"{ctx.model.config.vocab_size}: the checkpoint stores no tokenizer and the corpus differs "
            "from the one it was trained on"
        )
    return dm


@torch.no_grad()
def split_loss(model, loader, device: torch.device, max_batches: int | None) -> tuple[float, int, float]:
    """Mean next-token cross-entropy over the batches of ``loader`` (parallel forward).

    Args:
        model: a :class:`models.LanguageModel` in eval mode.
        loader: batches ``{"input_ids", "labels"}`` of ``(B, T)`` int64.
        device: where the model runs.
        max_batches: stop after this many batches (``None``: all).

    Returns:
        ``(loss in nats per token, tokens scored, tokens/s)``.
    """
    loss_sum, count, seconds = 0.0, 0, 0.0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        start = time.perf_counter()
        logits = model(batch["input_ids"].to(device))
        batch_loss, _, batch_count = scored_metrics(logits, batch["labels"].to(device))
        loss_sum += float(batch_loss)
        count += int(batch_count)
        seconds += time.perf_counter() - start
    return loss_sum / max(count, 1), count, count / max(seconds, 1e-9)


@torch.no_grad()
def prefix_losses(model, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Loss (nats per token) of the same blocks through the parallel forward and the decode path.

    Args:
        model: a :class:`models.LanguageModel` in eval mode.
        input_ids, labels: ``(B, T)`` int64 on the model's device, ``T >= 1``.

    Returns:
        ``{"parallel": loss, "decode": loss}``; the decode path prefills ``max(1, T // 2)`` tokens
        and feeds the rest one per step (``LanguageModel.decode_logits``).
    """
    losses = {}
    for path, logits in (
        ("parallel", model(input_ids)),
        ("decode", model.decode_logits(input_ids, max(1, input_ids.shape[1] // 2))),
    ):
        loss_sum, _, count = scored_metrics(logits, labels)
        losses[path] = float(loss_sum / count)
    return losses


def check_perplexity_settings(cfg: DictConfig) -> None:
    """Check the settings of ``cfg`` (``conf/eval/perplexity.yaml``) that need no checkpoint.

    Raises:
        ValueError: as :func:`eval.common.check_settings`; ``max_batches`` / ``decode_prefix`` not
            null or an integer >= 1 / >= 0, ``decode_prefix=1``; a ``data.`` setting this script takes
            no part of; ``tolerance`` not a number >= 0 (nats).
    """
    check_settings(cfg, "perplexity", positive=("batch_size", "decode_examples"))
    for key in ("max_batches", "decode_prefix"):
        value, low = cfg[key], 1 if key == "max_batches" else 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{key} must be null or an integer >= {low}, got {value!r}")
    if cfg.decode_prefix == 1:  # one token is all prefill: the check would run no decode step
        raise ValueError(
            "decode_prefix=1 leaves no token for a decode step: give 0 (no decode check) or a length >= 2 "
            "(its first half is prefilled, the rest decoded one token at a time)"
        )
    # Data settings that would change nothing or the wrong thing (a new-user check: +data.train_fraction
    # =0.5 put training text into the "held-out" split; +data.batch_size=0 and +data.seed=5 were
    # ignored without a word).
    for key, reason in REFUSED_DATA_SETTINGS.items():
        if key in cfg.data:
            raise ValueError(f"data.{key}: eval/perplexity.py takes no such setting: {reason}")
    tolerance = cfg.tolerance
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0 (nats), got {tolerance!r}")


def perplexity_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the evaluation that ``cfg`` (``conf/eval/perplexity.yaml``) describes; returns the records.

    Records carry the fields of :meth:`eval.common.EvalContext.record` with ``task: text``,
    ``split: val``, ``slice`` (``val``: the whole split; ``val_prefix{N}``: the decode check),
    ``metric`` (``loss`` in nats per token, ``perplexity``), ``seqlen`` (block length), ``tokens``
    (scored) and ``tokens_per_s``; the decode check's decode record adds ``abs_diff`` (nats) and
    ``agrees``.

    Raises:
        FileNotFoundError: missing checkpoint or corpus file.
        ValueError: corrupt checkpoint, a checkpoint not trained on text (the message names the
            script for its task), invalid settings, or a corpus that does not fit the tokenizer.
    """
    check_perplexity_settings(cfg)
    device = resolve_device(cfg.device)
    ctx = load_checkpoint(cfg.ckpt, device, TASKS, "eval/perplexity.py")
    check_default_output(cfg, ctx, "perplexity")
    dm = text_datamodule(ctx, OmegaConf.to_container(cfg.data, resolve=True), cfg.batch_size)
    seqlen, model = dm.seqlen, ctx.model
    # What was evaluated, so a run on another corpus or on a few batches is never taken for the
    # held-out split of the training corpus.
    common = {
        "task": "text",
        "split": "val",
        "corpus": dm.path or dm.dataset_name,
        "corpus_sha256": dm.corpus_sha256,
        "max_batches": cfg.max_batches,
    }

    part = f"the first {cfg.max_batches} batches of " if cfg.max_batches is not None else ""
    print(
        f"evaluating {part}the validation split ({dm.val_tokens.numel()} tokens, blocks of {seqlen}) ...",
        flush=True,
    )
    loss, tokens, tokens_per_s = split_loss(model, dm.val_dataloader(), device, cfg.max_batches)
    ppl = math.exp(min(loss, 50.0))
    records = [
        ctx.record(metric=metric, value=value, seqlen=seqlen, path="parallel", slice="val", tokens=tokens,
                   tokens_per_s=tokens_per_s, **common)
        for metric, value in (("loss", loss), ("perplexity", ppl))
    ]  # fmt: skip
    # a loss over the first batches only is labelled so (a new-user check: it read as the split's)
    shown = "val" if cfg.max_batches is None else f"val (first {cfg.max_batches} batches, {tokens} tokens)"
    rows = [{"slice": shown, "path": "parallel", "loss": loss, "perplexity": ppl}]

    prefix = min(cfg.decode_prefix or 0, seqlen)
    if (cfg.decode_prefix or 0) > seqlen:
        print(
            f"decode_prefix={cfg.decode_prefix} is longer than the blocks of {seqlen} tokens: checking {seqlen}"
        )
    if prefix == 1:
        print(f"blocks of {seqlen} token leave no decode step: no decode check")
    if prefix >= 2:
        input_ids, labels = first_blocks(dm.val_dataloader(), cfg.decode_examples, prefix)
        input_ids, labels = input_ids.to(device), labels.to(device)
        losses = prefix_losses(model, input_ids, labels)
        diff = abs(losses["parallel"] - losses["decode"])
        agrees = diff <= cfg.tolerance
        if not agrees:
            warnings.warn(
                f"decode-path loss {losses['decode']:.6f} differs from the parallel loss {losses['parallel']:.6f} "
                f"by {diff:.2e} nats (> tolerance {cfg.tolerance}): a cache or decode kernel computes "
                "something else than the parallel forward",
                RuntimeWarning,
                stacklevel=2,
            )
        name = f"val_prefix{prefix}"
        for path, value in losses.items():
            check = {"abs_diff": diff, "agrees": agrees} if path == "decode" else {}
            records.append(
                ctx.record(metric="loss", value=value, seqlen=prefix, path=path, slice=name,
                           tokens=input_ids.numel(), **check, **common)
            )  # fmt: skip
            rows.append(
                {"slice": name, "path": path, "loss": value, "perplexity": math.exp(min(value, 50.0))}
            )

    print_table(
        f"validation loss, nats per token ({model.config.name})", ["path", "loss", "perplexity"], rows
    )
    finish(records, cfg, ctx, "perplexity")
    return records


def first_blocks(loader, count: int, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``prefix`` tokens of the first ``count`` blocks ``loader`` yields, over as many
    batches as that takes (fewer blocks when the split has fewer): ``(input_ids, labels)``, each
    ``(min(count, blocks), prefix)`` int64 on the CPU."""
    inputs, labels, have = [], [], 0
    for batch in loader:
        take = min(count - have, batch["input_ids"].shape[0])
        inputs.append(batch["input_ids"][:take, :prefix])
        labels.append(batch["labels"][:take, :prefix])
        have += take
        if have == count:
            break
    return torch.cat(inputs), torch.cat(labels)


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="perplexity")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        perplexity_eval(cfg)


if __name__ == "__main__":
    run_command_line(
        main,
        "perplexity",
        CONF_DIR / "eval",
        check_job=checkpoint_sweep_check(
            TASKS, "eval/perplexity.py", name="perplexity", settings=check_perplexity_settings
        ),
    )

"""What the checkpoint evaluations share: ``eval/recall.py``, ``eval/copying.py``,
``eval/long_context.py`` and ``eval/perplexity.py``.

- settings checks (:func:`check_settings`, :func:`check_lengths`, :func:`length_settings`) and
  device resolution;
- :func:`load_checkpoint`: the model *and* its data config from the checkpoint alone (DESIGN.md,
  contract 4), with a clear error when the checkpoint was trained on a task the script does not
  evaluate (naming the script that does, :data:`TASK_SCRIPTS`);
- the two scoring paths over a batch of examples: ``parallel`` (one forward over the whole
  sequence, i.e. teacher forcing) and ``decode`` (:func:`decode_predictions`: the prompt prefilled
  into fresh caches, then one token per step through :class:`models.model.DecodeStep`, the step
  ``LanguageModel.generate`` runs -- a CUDA graph on GPUs); :func:`evaluate` runs either over a
  loader and pools the scorers' sums (:class:`Scores`);
- :func:`is_out_of_memory` (from :mod:`models.model`) for sweeps that skip lengths which do not fit;
- records (:meth:`EvalContext.record`), the printed table and the result file next to the
  checkpoint plus the W&B table (:func:`finish`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import data as data_lib
from data.mqar import IGNORE_INDEX
from eval.cli import check_known_settings, override_value, pasteable
from eval.records import (
    check_output,
    check_same_writer,
    check_sweep_output,
    check_wandb_settings,
    git_sha,
    log_records_to_wandb,
    make_record,
    training_settings,
    write_sweep_records,
)
from models.checkpoint import replace_refusal
from models.lit import LitLM, load_model
from models.model import (
    DecodeStep,
    LanguageModel,
    is_out_of_memory,  # noqa: F401  (the evaluations' import of it)
)

DATA_META_KEYS = ("name", "monitor", "monitor_mode")
"""Keys of a run's data config that describe training, not the data module's arguments."""

PATHS = ("parallel", "decode")
"""The two ways every evaluation computes the model's outputs (see the module docstring)."""

TASK_SCRIPTS = {
    "mqar": "eval/recall.py",
    "induction_heads": "eval/recall.py",
    "copy": "eval/copying.py",
    "selective_copying": "eval/copying.py",
    "passkey": "eval/long_context.py",
    "multikey_needle": "eval/long_context.py",
    "text": "eval/perplexity.py",
}
"""The evaluation script of each training task (``data.name`` of ``conf/data/<name>.yaml``)."""

Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``scorer(predictions (B, T) int64, labels (B, T) int64) -> (values (B,), weights (B,))``: a metric
is ``sum(values) / sum(weights)`` over every example of a slice."""


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``/``cuda`` as given.

    Raises:
        ValueError: unknown name, or ``cuda`` without a GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device=cuda was asked for but no CUDA GPU is available; use device=auto or device=cpu"
        )
    return torch.device(name)


def _is_list(value: Any) -> bool:
    """Whether a setting is a list (a Python list or tuple, or OmegaConf's ``ListConfig``), not a
    single value: ``seqlens=64`` gives an int, ``decode_paths=parallel`` a string."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def _typed_value(key: str) -> str | None:
    """The text given for ``key`` on the command line (``1e3`` where Hydra parsed the float 1000.0),
    from Hydra's record of the overrides; None outside a Hydra run or where ``key`` was not given."""
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:  # composed in Python (tests, notebooks): no command line
        return None
    for text in overrides:
        name, sep, value = text.partition("=")
        if sep and name.lstrip("+~") == key:
            return value
    return None


def check_settings(
    cfg: DictConfig, name: str, positive: Sequence[str] = ("num_examples", "batch_size")
) -> None:
    """Validate the settings every evaluation config shares, before the checkpoint is loaded.

    Args:
        cfg: an ``conf/eval/*.yaml`` config with ``ckpt``, ``output`` and, where present,
            ``decode_paths``.
        name: the evaluation (``recall``), for the example file name of the ``output`` message.
        positive: keys that must hold integers >= 1.

    Raises:
        ValueError: a top-level setting ``conf/eval/<name>.yaml`` does not define and nothing reads
            (:func:`eval.cli.check_known_settings`); ``wandb.enabled`` not a bool, or ``wandb.mode`` not
            online / offline while enabled; no checkpoint given; ``decode_paths`` not a list, empty, with an
            unknown or a repeated path; a non-positive count; an ``output`` that cannot be written as a file
            (:func:`eval.records.check_output`), whose existing file cannot be replaced
            (:func:`check_replaceable`) or that an earlier job of the same ``-m`` sweep wrote
            (:func:`eval.records.check_sweep_output`).
    """
    check_known_settings(cfg, f"eval/{name}")
    if "decode_paths" in cfg:
        paths = cfg.decode_paths
        choices = f"choose from [{', '.join(PATHS)}], e.g. decode_paths=[{','.join(PATHS)}]"
        if not _is_list(paths):
            hint = f"write decode_paths=[{paths}]" if paths in PATHS else choices
            raise ValueError(f"decode_paths must be a list, got {paths!r}; {hint}")
        if not paths:
            raise ValueError(f"decode_paths is empty: give at least one path; {choices}")
        unknown = sorted(set(paths) - set(PATHS), key=str)
        if unknown:
            raise ValueError(f"unknown decode_paths {unknown}; {choices}")
        if len(set(paths)) < len(paths):
            raise ValueError(f"decode_paths lists a path twice: {list(paths)}; give each path once")
    if "wandb" in cfg:
        check_wandb_settings(cfg.wandb)
    # ckpt=0 (a file named 0) is a number, not "no checkpoint": refused below with the fix
    if OmegaConf.is_missing(cfg, "ckpt") or cfg.ckpt is None or cfg.ckpt == "":
        raise ValueError("no checkpoint given: pass ckpt=<a .ckpt file written by train.py>")
    if not isinstance(cfg.ckpt, str):
        # A list is several checkpoints; anything else Hydra parsed as a number, a bool or a mapping
        # (a new-user check: ckpt=123 was told to evaluate several with -m), quoted as typed (ckpt=1e3
        # is the float 1000.0, and "ckpt='1000.0'" names another file).
        quoted = f"\"ckpt='{_typed_value('ckpt') or cfg.ckpt}'\""
        fix = (
            "evaluate several with -m ckpt=A,B"
            if _is_list(cfg.ckpt)
            else f"give the .ckpt file's path (a path Hydra reads as another type: quote it, {quoted})"
        )
        raise ValueError(f"ckpt must be one checkpoint path, got {cfg.ckpt!r}; {fix}")
    for key in positive:
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    if cfg.output:
        check_output(cfg.output, f"{name}.json")
        check_same_writer(cfg.output, "checkpoint")
        check_replaceable(cfg.output)
        check_sweep_output(cfg.output)


def check_replaceable(path: str | Path, *, option: str = "output") -> None:
    """Refuse, before evaluating, an existing output file that writing the results could not replace
    although its folder takes new files (:func:`models.checkpoint.replace_refusal`: an immutable or
    append-only file, another user's in a sticky folder).

    Args:
        path: the ``output`` setting, or the default path an evaluation would write.
        option: how the message names ``path``: ``output`` (the setting) or a phrase such as
            ``the default output`` or ``the plot``, as in :func:`eval.records.check_output`.

    Raises:
        ValueError: ``"<option> <path> cannot be replaced: <reason>; ..."`` with the fix.
    """
    why = replace_refusal(path)
    if why is None:
        return
    name = f"output={path}" if option == "output" else f"{option} {path}"
    # A new-user check: the evaluation ran, then could not write, and was told to make the folder writable.
    raise ValueError(f"{name} cannot be replaced: {why}; lift that, or give output= another path")


def check_lengths(values: Any, key: str) -> list[int]:
    """``values`` as a non-empty list of distinct integers >= 1 (length multipliers or lengths).

    A single number is refused like any other non-list, with the list it probably meant in the
    message (``seqlens=64``: write ``seqlens=[64]``), as every list setting of the evaluations is.

    Raises:
        ValueError: not a list, empty, an entry that is not an integer >= 1, or a value given twice
            (each value is one slice or measurement); the message names ``key``.
    """
    entries = list(values) if _is_list(values) else []
    if not entries or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in entries):
        single = isinstance(values, int) and not isinstance(values, bool) and values >= 1
        hint = f"; write {key}=[{values}]" if single else ""
        raise ValueError(f"{key} must be a list of integers >= 1, got {values!r}{hint}")
    if len(set(entries)) < len(entries):
        raise ValueError(f"{key} lists a value twice: {entries}; give each value once")
    return entries


def length_settings(cfg: DictConfig, default_multipliers: Sequence[int]) -> tuple[str, list[int]]:
    """The setting that gives the test lengths and its checked values: ``("seqlens", lengths)``,
    or ``("length_multipliers", multipliers of the training seqlen)`` -- ``default_multipliers``
    when neither is given (both default to null in the config, so giving both is seen).

    Raises:
        ValueError: both given (seqlens would silently replace the multipliers), or a value that
            :func:`check_lengths` refuses.
    """
    if cfg.seqlens is not None:
        if cfg.length_multipliers is not None:
            raise ValueError(
                f"give seqlens or length_multipliers, not both: seqlens={cfg.seqlens} sets the test lengths "
                f"itself, so length_multipliers={cfg.length_multipliers} would be ignored; drop one of them"
            )
        return "seqlens", check_lengths(cfg.seqlens, "seqlens")
    if cfg.length_multipliers is None:
        return "length_multipliers", list(default_multipliers)
    return "length_multipliers", check_lengths(cfg.length_multipliers, "length_multipliers")


def hydra_override(key: str, value: str) -> str:
    """``key=value`` as one shell word that Hydra parses back to ``value``, for commands printed in
    messages: :func:`eval.cli.override_value` (Hydra's quoting, ``${`` escaped) inside
    :func:`eval.cli.pasteable` (the shell's), as train.py prints its overrides."""
    return pasteable(f"{key}={override_value(value)}")


def wrong_task_error(ckpt: Path, task: str | None, script: str, tasks: Sequence[str]) -> ValueError:
    """The error for a checkpoint trained on ``task`` given to ``script``, which evaluates ``tasks``.

    The message names the supported tasks and, for a known task, the command that evaluates it
    (the ``ckpt=`` override quoted for the shell and Hydra when the path holds ``=``, ``,``, brackets,
    quotes or spaces).
    """
    hint = ""
    if task in TASK_SCRIPTS:
        hint = f"; evaluate it with python {TASK_SCRIPTS[task]} {hydra_override('ckpt', str(ckpt))}"
    return ValueError(
        f"{ckpt} was trained on {task!r} data, which {script} does not evaluate: it evaluates checkpoints "
        f"trained on {', '.join(tasks)} (python train.py data={tasks[0]} ...){hint}"
    )


@dataclass
class EvalContext:
    """A checkpoint loaded for evaluation and what its records need.

    Attributes:
        ckpt: the checkpoint path as given (``~`` expanded).
        lit: the :class:`models.lit.LitLM`, in eval mode on ``device``.
        data: the data config it was trained on (``data.name`` is the task).
        device: where the model runs.
        run_dir: ``<run_dir>`` of ``<run_dir>/checkpoints/<name>.ckpt`` (train.py's layout), else
            the checkpoint's folder (a checkpoint kept elsewhere: its W&B run is written there).
        sha: the mixerlab commit (:func:`eval.records.git_sha`).
    """

    ckpt: Path
    lit: LitLM
    data: dict[str, Any]
    device: torch.device
    run_dir: Path
    sha: str | None = None

    @property
    def model(self) -> LanguageModel:
        """The :class:`models.LanguageModel`."""
        return self.lit.model

    @property
    def run(self) -> str:
        """The run's name: its directory's name, shared with train.py's records; for a checkpoint
        kept outside a ``checkpoints/`` folder, the checkpoint's file name without ``.ckpt`` (a
        new-user check: ``/tmp/ck/att.ckpt`` and ``/tmp/ck/mamba.ckpt`` were one run, ``tmp``)."""
        if self.ckpt.resolve().parent.name != "checkpoints":
            return self.ckpt.resolve().stem
        return self.run_dir.name

    @property
    def task(self) -> str | None:
        """The training task, ``data.name``."""
        return self.data.get("name")

    def record(self, *, task: str, metric: str, value: float, seqlen: int, path: str, **extra: Any) -> dict:
        """One result record (:func:`eval.records.make_record`) of this checkpoint.

        Adds ``path`` (parallel | decode), ``checkpoint`` (absolute path), ``split`` (default
        ``"test"``), ``train_seqlen`` (the training example length, so lengths beyond training
        can be told apart) and the training settings train.py's records carry (``lr``,
        ``d_model``, ``n_layers``, ``batch_size`` per process: eval/report.py groups learning-rate
        sweeps by them, also for a checkpoint kept outside its run directory) to the fields of
        ``make_record``; ``state_bytes`` is the decode state per sequence of a cache for ``seqlen``
        tokens.
        """
        extra = {"split": "test", **training_settings(self.lit, self.data), **extra}
        return make_record(
            run=self.run,
            model=self.model,
            task=task,
            metric=metric,
            value=value,
            seqlen=seqlen,
            device=self.device,
            sha=self.sha,
            path=path,
            checkpoint=str(self.ckpt.resolve()),
            train_seqlen=self.data.get("seqlen"),
            **extra,
        )


def check_position_limit(model: LanguageModel, longest: int, option: str) -> None:
    """Refuse, before any slice is scored, a test length beyond a learned position table (an
    attention mixer with ``pos_emb=learned`` has no row for positions >= its ``max_position``).

    Args:
        model: the model to evaluate.
        longest: the longest test sequence in tokens.
        option: the setting that picks the lengths, for the message (``length_multipliers``).

    Raises:
        ValueError: naming the mixer, its table size and the setting to lower.
    """
    limit = model.position_limit()
    if limit is not None and limit[1] < longest:
        name, size = limit
        raise ValueError(
            f"{name}: the checkpoint's learned position table has max_position={size} rows, but the "
            f"longest test sequence has {longest} tokens; lower {option} so no length passes {size} "
            f"(or train with ++mixer.settings.{name}.max_position={longest} or more)"
        )


def load_checkpoint(
    ckpt: str | Path, device: torch.device, tasks: Sequence[str] | None, script: str
) -> EvalContext:
    """Rebuild the model and its data config from a checkpoint written by train.py.

    Args:
        ckpt: the ``.ckpt`` file.
        device: where to put the model.
        tasks: the ``data.name`` values the calling script evaluates (``None``: the caller checks).
        script: the calling script (``eval/copying.py``), for error messages.

    Raises:
        FileNotFoundError: missing checkpoint.
        ValueError: corrupt checkpoint, one whose weights hold NaN or inf, one trained on a task
            not in ``tasks`` (:func:`wrong_task_error`), or one whose data settings its data
            module refuses (an edited config).
    """
    ckpt = Path(ckpt).expanduser()
    lit = load_model(ckpt, map_location=device, arg="ckpt")
    data_cfg = dict(lit.hparams.data or {})
    if tasks is not None and data_cfg.get("name") not in tasks:
        raise wrong_task_error(ckpt, data_cfg.get("name"), script, tasks)
    if data_cfg.get("name") in data_lib.DATAMODULES:
        # The evaluations derive their slices from these settings (MQAR's longer slices divide by
        # seqlen and check it against the vocabulary): settings that train.py would have refused
        # (an edited checkpoint) are named here, not met as a ZeroDivisionError or a contradiction.
        try:
            build_datamodule(data_cfg)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"checkpoint {ckpt} holds data settings that train.py refuses ({err}): was its config "
                f"edited? pass ckpt=<a .ckpt file written by train.py>"
            ) from err
    # train.py writes <run_dir>/checkpoints/<name>.ckpt: records and W&B runs belong to that run.
    folder = ckpt.resolve().parent
    run_dir = folder.parent if folder.name == "checkpoints" else folder
    return EvalContext(ckpt, lit, data_cfg, device, run_dir, git_sha())


def checkpoint_sweep_check(
    tasks: Sequence[str] | None,
    script: str,
    check: Callable[[EvalContext, DictConfig], str | None] | None = None,
    *,
    name: str | None = None,
    settings: Callable[[DictConfig], Any] | None = None,
) -> Callable[[DictConfig], str | None]:
    """An evaluation's ``check_job`` for :func:`eval.cli.run_command_line`: each job of a ``-m``
    sweep has ``settings(cfg)`` run, its checkpoint loaded on the CPU (:func:`load_checkpoint`:
    missing, corrupt, trained on another task) and ``check(ctx, cfg)`` run, before the first job
    evaluates anything (a new-user check: ``-m ckpt=a.ckpt,broken.ckpt,c.ckpt`` evaluated ``a``,
    stopped at ``broken`` with status 2, and never said that ``c`` was not evaluated; a second one:
    ``-m num_examples=20,abc`` and ``-m num_examples=20,30`` with the default output ran the first
    job, then refused the second). A job whose ``ckpt`` is not one path is left to its own check.

    Args:
        tasks, script: :func:`load_checkpoint`'s.
        check: the evaluation's checks of a job with its checkpoint; returns the variant of the
            default record file (:func:`output_path`; None for ``<checkpoint>.<name>.json``).
        name: the evaluation (``recall``): the returned function gives the job's default record
            file, checked with :func:`check_default_output`, so that :func:`eval.cli` refuses a
            sweep whose jobs would all write it; without ``name`` it returns None.
        settings: the evaluation's checks of its settings, run before the checkpoint is read.

    Raises (from the returned function):
        FileNotFoundError, ValueError: :func:`load_checkpoint`'s, ``settings``' or ``check``'s;
            :func:`eval.cli` names the job (``the sweep's job with ckpt=...: ...``).
    """

    last: dict[str, EvalContext] = {}  # the latest checkpoint read: a sweep over other settings reads it once

    def check_job(cfg: DictConfig) -> str | None:
        if settings is not None:
            settings(cfg)
        if not isinstance(cfg.get("ckpt"), str):
            return None
        if cfg.ckpt not in last:
            last.clear()
            last[cfg.ckpt] = load_checkpoint(cfg.ckpt, torch.device("cpu"), tasks, script)
        variant = check(last[cfg.ckpt], cfg) if check is not None else None
        if name is None or cfg.get("output"):
            return None
        check_default_output(cfg, last[cfg.ckpt], name, variant)
        return str(output_path(cfg, last[cfg.ckpt], name, variant))

    return check_job


def build_datamodule(data_cfg: Mapping[str, Any], **overrides: Any):
    """The data module of a run's data config (``data.build_datamodule``) with ``overrides`` applied.

    Raises:
        ValueError/TypeError: an override the data module rejects (its own message).
    """
    kwargs = {k: v for k, v in data_cfg.items() if k not in DATA_META_KEYS}
    kwargs.update(overrides)
    return data_lib.build_datamodule(data_cfg["name"], **kwargs)


@torch.no_grad()
def decode_predictions(
    model: LanguageModel,
    input_ids: torch.Tensor,
    prefill_len: int,
    free_from: torch.Tensor | None = None,
    end: int | None = None,
) -> torch.Tensor:
    """Greedy predictions through the decode path: prefill, then one token per decode step.

    The first ``prefill_len`` tokens go through the model in one call into fresh caches (sized for
    all ``T`` tokens, so their bytes are ``model.state_size(T)`` per sequence); every later position
    is fed alone through :class:`models.model.DecodeStep` (the step of ``LanguageModel.generate``,
    captured in a CUDA graph on GPUs). Position ``t`` is fed ``input_ids[:, t]`` (teacher forcing)
    or, from ``free_from`` on, the model's own greedy prediction made at ``t - 1`` (generation).
    With one prompt length ``P = prefill_len = free_from`` this is ``generate(input_ids[:, :P],
    greedy=True)`` aligned by :func:`data.synthetic.generated_to_predictions`; per-example prompt
    lengths let a batch of prompts of different lengths decode together (a prompt's tokens beyond
    ``prefill_len`` are fed step by step, which computes the same as prefilling them).

    Args:
        model: a :class:`models.LanguageModel` in eval mode.
        input_ids: ``(B, T)`` int64 examples.
        prefill_len: tokens prefilled at once, ``1 <= prefill_len <= end``.
        free_from: ``(B,)`` int64 first generated position of each example (``>= prefill_len``);
            ``None`` feeds every position from ``input_ids``.
        end: positions to compute, ``prefill_len <= end <= T`` (default ``T``): predictions from
            ``end`` on are not needed by the caller.

    Returns:
        ``(B, T)`` int64: ``predictions[:, t]`` is the argmax of the logits at position ``t`` (what
        labels at ``t`` are scored against), ``-1`` from ``end`` on.

    Raises:
        ValueError: ``prefill_len`` or ``end`` out of range, or a ``free_from`` before ``prefill_len``.
    """
    batch, seqlen = input_ids.shape
    end = seqlen if end is None else end
    if not 1 <= prefill_len <= end <= seqlen:
        raise ValueError(f"need 1 <= prefill_len ({prefill_len}) <= end ({end}) <= seqlen ({seqlen})")
    if free_from is not None and bool((free_from < prefill_len).any()):
        raise ValueError(
            f"free_from must not start before prefill_len={prefill_len} (the prefill is teacher-forced), "
            f"got {free_from.tolist()}"
        )
    cache = model.allocate_cache(batch, seqlen)
    predictions = input_ids.new_full((batch, seqlen), -1)
    predictions[:, :prefill_len] = model(input_ids[:, :prefill_len], cache=cache).argmax(-1)
    step = DecodeStep(model, cache, graphed=input_ids.is_cuda)
    for t in range(prefill_len, end):
        token = input_ids[:, t]
        if free_from is not None:
            token = torch.where(free_from <= t, predictions[:, t - 1], token)
        predictions[:, t] = step(token).argmax(-1)
    return predictions


@dataclass
class Scores:
    """Scorer sums over the examples of one slice (or several, pooled with :meth:`pool`).

    Attributes:
        sums, weights: per metric, ``sum(values)`` and ``sum(weights)`` of its :data:`Scorer`.
        examples: examples scored.
        tokens: tokens run through the model.
        seconds: wall-clock seconds of the model calls (synchronised on CUDA).
    """

    sums: dict[str, float]
    weights: dict[str, float]
    examples: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def value(self, metric: str) -> float:
        """The pooled metric, ``sums / weights`` (0 without weight)."""
        return self.sums[metric] / self.weights[metric] if self.weights[metric] else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens processed per second of model time."""
        return self.tokens / max(self.seconds, 1e-9)

    @staticmethod
    def pool(scores: Sequence[Scores]) -> Scores:
        """The scores of several slices pooled into one (sums and counts added)."""
        metrics = scores[0].sums
        return Scores(
            {m: sum(s.sums[m] for s in scores) for m in metrics},
            {m: sum(s.weights[m] for s in scores) for m in metrics},
            sum(s.examples for s in scores),
            sum(s.tokens for s in scores),
            sum(s.seconds for s in scores),
        )


def per_example(metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Scorer:
    """A :data:`Scorer` averaging a per-example metric ``(B, T), (B, T) -> (B,)`` over examples
    (e.g. :func:`data.copying.string_exact_match`)."""

    def scorer(predictions: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = metric(predictions, labels).double()
        return values, torch.ones_like(values)

    return scorer


def per_position(predictions: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`Scorer` of the accuracy over all scored positions pooled (MQAR's, Arora et al. 2024):
    per example, ``(correct scored positions, scored positions)``, shapes ``(B,)``."""
    scored = labels != IGNORE_INDEX
    correct = (predictions == labels) & scored
    return correct.sum(1, dtype=torch.float64), scored.sum(1, dtype=torch.float64)


DecodePlan = Callable[[dict[str, Any]], tuple[int, torch.Tensor | None]]
"""``plan(batch) -> (prefill_len, free_from or None)``: how the decode path runs a batch (see
:func:`decode_predictions`)."""


@torch.no_grad()
def evaluate(
    model: LanguageModel,
    loader: Iterable[dict[str, Any]],
    path: str,
    device: torch.device,
    scorers: Mapping[str, Scorer],
    plan: DecodePlan,
) -> Scores:
    """Score every batch of ``loader`` through ``path``.

    ``parallel`` takes the argmax of one forward over each whole example (teacher forcing);
    ``decode`` runs :func:`decode_predictions` with the ``(prefill_len, free_from)`` that ``plan``
    gives for the batch, up to the last scored position.

    Args:
        model: a :class:`models.LanguageModel` in eval mode on ``device``.
        loader: batches ``{"input_ids": (B, T) int64, "labels": (B, T) int64, ...}``.
        path: ``"parallel"`` or ``"decode"``.
        device: where the model runs.
        scorers: metric name -> :data:`Scorer`.
        plan: the decode path's prefill and generation start per batch (unused by ``parallel``).

    Returns:
        :class:`Scores` summed over the loader.

    Raises:
        ValueError: an unknown ``path``, or a plan :func:`decode_predictions` rejects.
    """
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose from {list(PATHS)}")
    scores = Scores(dict.fromkeys(scorers, 0.0), dict.fromkeys(scorers, 0.0))
    for batch in loader:
        input_ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        start = time.perf_counter()
        if path == "parallel":
            predictions = model(input_ids).argmax(-1)  # (B, T)
            tokens = input_ids.numel()
        else:
            prefill_len, free_from = plan(batch)
            end = int((labels != IGNORE_INDEX).any(0).nonzero().max()) + 1
            if free_from is not None:
                free_from = free_from.to(device)
            predictions = decode_predictions(model, input_ids, prefill_len, free_from, end)
            tokens = input_ids.shape[0] * end
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        scores.seconds += time.perf_counter() - start
        scores.tokens += tokens
        scores.examples += input_ids.shape[0]
        for name, scorer in scorers.items():
            values, weights = scorer(predictions, labels)
            scores.sums[name] += float(values.sum())
            scores.weights[name] += float(weights.sum())
    return scores


def print_table(title: str, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """Print ``rows`` (dicts with a ``slice`` and the ``columns``) as a fixed-width table; floats
    with 4 decimals, missing cells as ``-``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4f}"
        return "-" if value is None else str(value)

    width = max([14] + [len(str(row["slice"])) + 2 for row in rows])
    print(title)
    print(f"{'slice':<{width}}" + "".join(f"{c:>{max(12, len(c) + 2)}}" for c in columns))
    for row in rows:
        line = f"{row['slice']:<{width}}"
        line += "".join(f"{cell(row.get(c)):>{max(12, len(c) + 2)}}" for c in columns)
        print(line)


def _output_suffix(name: str, variant: str | None) -> str:
    """``name`` or ``name.variant``: the part of a default record file name after the checkpoint's."""
    return name if variant is None else f"{name}.{variant}"


def output_path(cfg: DictConfig, ctx: EvalContext, name: str, variant: str | None = None) -> Path:
    """Where :func:`finish` writes the records: ``cfg.output``, else ``<checkpoint>.<name>.json``
    next to the checkpoint (``<checkpoint>.<name>.<variant>.json`` with a ``variant``)."""
    suffix = _output_suffix(name, variant)
    return Path(cfg.output) if cfg.output else ctx.ckpt.with_name(f"{ctx.ckpt.name}.{suffix}.json")


def check_default_output(cfg: DictConfig, ctx: EvalContext, name: str, variant: str | None = None) -> None:
    """Refuse, before evaluating, a default output path (no ``output=``) that is a directory or
    cannot be written, e.g. a checkpoint on read-only storage (``output=`` itself is checked by
    :func:`check_settings`).

    Raises:
        ValueError: ``<checkpoint>.<name>[.<variant>].json`` exists as a directory, no file can
            be created next to the checkpoint, it exists and cannot be replaced
            (:func:`check_replaceable`), or an earlier job of the same ``-m`` sweep wrote it.
    """
    if cfg.output:
        return
    path = output_path(cfg, ctx, name, variant)
    if path.is_dir():
        example = path.parent / f"{_output_suffix(name, variant)}.json"
        raise ValueError(
            f"the default output {path} is a directory, so the results cannot be written there; "
            f"move it away or pass output=<a file path> (e.g. output={example})"
        )
    check_output(path, f"{_output_suffix(name, variant)}.json", option="the default output")
    check_replaceable(path, option="the default output")
    check_sweep_output(path, option="the default output")


def finish(
    records: list[dict[str, Any]],
    cfg: DictConfig,
    ctx: EvalContext,
    name: str,
    variant: str | None = None,
    *,
    progress: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Path:
    """Write ``records`` to ``cfg.output`` (default ``<checkpoint>.<name>.json`` next to the
    checkpoint, ``<checkpoint>.<name>.<variant>.json`` with a ``variant``) atomically and log them to
    W&B when ``cfg.wandb.enabled`` (a table ``name`` in a run ``<name>-<run>`` under the run
    directory, offline unless ``wandb.mode=online``).

    A sweep over lengths calls it after each length with ``progress=(done, planned)`` (lengths in
    tokens): until ``done`` is all of ``planned`` the records are written marked ``partial``
    (:func:`eval.records.write_sweep_records`), and only the last call prints the path and logs to W&B.

    Returns:
        The path of the record file.
    """
    output = output_path(cfg, ctx, name, variant)
    done, planned = progress or ((), ())
    write_sweep_records(output, records, done, planned, output_given=bool(cfg.output))
    if list(done) != list(planned):
        return output
    print(f"results: {output}")
    log_records_to_wandb(
        records,
        enabled=cfg.wandb.enabled,
        project=cfg.wandb.project,
        name=f"{name}-{ctx.run}",
        mode=cfg.wandb.mode,
        save_dir=ctx.run_dir,
        table=name,
    )
    return output

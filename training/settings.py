"""Checks of a composed training config (``conf/train.yaml``) that :func:`train.train` makes before it
seeds, builds the model or trains, so that a bad setting is refused in one line naming its override
(status 2 from the command line) rather than by Lightning in a traceback after a step.

- The settings that need neither data nor model (:func:`check_settings`): every top-level key known,
  ``mixer.name`` (:func:`check_mixer_name`), ``trainer.*`` against Lightning's own arguments and
  precisions (:func:`check_trainer_settings`, :func:`lightning_settings`,
  :func:`lightning_precisions`), ``logger.*``, ``optim.*``, the form of ``early_stopping``
  (:func:`check_early_stopping_arguments`).
- The data module of the ``data.*`` settings, its refusals named as ``data.*`` overrides
  (:func:`build_datamodule`), and what the run reads of it: the validation batches per process
  (:func:`check_val_batches`), the slices' lengths and a learned position table long enough for them,
  and the metrics ``early_stopping`` and ``data.monitor`` name.
- The process count a Trainer of the ``trainer.*`` settings runs with (:func:`resolved_world_size`),
  with Lightning's refusals as settings errors (:func:`trainer_settings_errors`).
- ``run_dir`` under Hydra (``python train.py``): Hydra's run directory, as the config defines it
  (:func:`check_run_dir`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import re
import typing
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from omegaconf import DictConfig, OmegaConf

import data as datasets_lib
from data.mqar import parse_slice_name
from eval.cli import check_known_settings, closest_settings, override_value, pasteable
from eval.records import WANDB_KEYS, check_flag, check_wandb_settings
from mixers import MIXERS, setting_names
from models.lit import check_optim, improving_mode, logged_metrics


def check_settings(cfg: DictConfig) -> None:
    """The checks of a run's settings that need neither its data nor its model, which
    :func:`train.train` makes first: every top-level key known (:func:`eval.cli.check_known_settings`),
    each group of settings a mapping, ``mixer.name`` (:func:`check_mixer_name`), a GPU for
    ``trainer.accelerator=gpu``, then :func:`check_trainer_settings`, :func:`check_logger_settings`,
    :func:`models.lit.check_optim` and :func:`check_early_stopping_arguments`.

    Raises:
        ValueError / TypeError: the first setting refused, named as its override.
    """
    check_known_settings(cfg, "train", hints=SETTING_HINTS, settings=lightning_settings())
    for section in ("model", "mixer", "data", "optim", "trainer", "logger"):
        if not OmegaConf.is_dict(cfg[section]):  # optim=5 replaced the whole group of settings
            raise ValueError(
                f"{section} must be a group of settings, got {section}={cfg[section]!r}; set one of them "
                f"instead, e.g. {section}.<key>=<value> (conf/train.yaml lists them)"
            )
    check_mixer_name(cfg.mixer.get("name"))
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={cfg.trainer.accelerator} needs a CUDA GPU and none is available; "
            "use trainer=cpu (or trainer=ddp for several CPU processes)"
        )
    check_trainer_settings(cfg)
    check_logger_settings(cfg.logger)
    check_optim(OmegaConf.to_container(cfg.optim, resolve=True))  # LitLM checks it too, after the seeding
    check_early_stopping_arguments(cfg.get("early_stopping"))


def check_mixer_name(name: Any) -> None:
    """``mixer.name``, which names the run's folder (``hydra.run.dir``:
    ``<time>-<mixer.name>-<data.name>``; a sweep job's ``<num>-<mixer.name>-<data.name>``) and the
    mixer in its result records and checkpoint: a non-empty string usable as one folder name. Any
    such name is taken (``mixer.name=my_attention``), not only a ``conf/mixer`` option's.

    Raises:
        ValueError: a name that is not a string (``mixer.name=5``: the records' mixer, which the report
            sorts with the other runs' names), empty, with whitespace at either end, holding a path
            separator (``foo/bar``: a nested run folder) or ``.`` / ``..``.
    """
    if not isinstance(name, str):
        problem = "is not a string"
        if isinstance(name, (bool, int, float)):  # Hydra reads mixer.name=5 as a number: quoted, a string
            quoted = override_value(override_value(name))
            problem += f" (quote it to keep it as a name: {pasteable(f'mixer.name={quoted}')})"
    elif not name:
        problem = "is empty"
    elif name != name.strip():
        problem = "begins or ends with whitespace"
    elif separators := [sep for sep in sorted({"/", os.sep, os.altsep} - {None}) if sep in name]:
        problem = f"holds {separators[0]!r}, which would nest the run's folder in another"
    elif name in (".", ".."):
        problem = "is no folder name"
    else:
        return
    raise ValueError(
        f"{pasteable(f'mixer.name={override_value(name)}')} {problem}: mixer.name must be a non-empty string "
        "usable as one folder name (it names the run's folder, <time>-<mixer.name>-<data.name>, and the "
        "mixer in the run's records), e.g. mixer.name=my_attention"
    )


def check_run_dir(run_dir: Any, output_dir: str, sweep: bool) -> None:
    """``run_dir`` of a run under Hydra (``python train.py``), which ``conf/train.yaml`` defines as
    Hydra's run directory (``${hydra:runtime.output_dir}``): the folder that holds the run's ``.hydra/``
    and ``train.log`` beside its checkpoints and records. An override naming another folder split
    the run in two, which a later ``resume=`` or report reads as two runs.

    Args:
        run_dir: the ``run_dir`` setting.
        output_dir: Hydra's run directory for this run (a sweep's job: its folder in the sweep's).
        sweep: whether the run is a job of a ``-m`` sweep.

    Raises:
        ValueError: ``run_dir`` that is not Hydra's run directory (as a path), naming the setting that
            moves both (``hydra.run.dir``, or ``hydra.sweep.dir`` for a sweep).
    """
    if isinstance(run_dir, str) and Path(run_dir).resolve() == Path(output_dir).resolve():
        return
    given = pasteable(f"run_dir={override_value(run_dir)}")
    if sweep:
        instead = "hydra.sweep.dir=<folder> (each job gets a folder in it, hydra.sweep.subdir)"
    elif isinstance(run_dir, str):
        instead = pasteable(f"hydra.run.dir={override_value(run_dir)}")
    else:
        instead = "hydra.run.dir=<folder>"
    raise ValueError(
        f"{given}: run_dir is Hydra's run directory, {output_dir} for this run, which holds the run's "
        f".hydra/ and train.log beside its checkpoints and records; remove the run_dir override and set "
        f"{instead} instead"
    )


# What a top-level key that is no setting's name means, for check_known_settings' message.
SETTING_HINTS = {"device": "trainer=cpu or trainer=gpu", "gpu": "trainer=gpu", "gpus": "trainer=gpu"}


def lightning_settings() -> tuple[str, ...]:
    """``trainer.<name>`` for every argument of Lightning's Trainer and ``early_stopping.<name>`` for
    EarlyStopping's: settings the configs do not spell out (``+trainer.max_time=...``), for the
    guesses of :func:`eval.cli.check_known_settings`."""
    return tuple(
        f"{group}.{name}"
        for group, cls in (("trainer", L.Trainer), ("early_stopping", EarlyStopping))
        for name in inspect.signature(cls.__init__).parameters
        if name != "self"
    )


def lightning_precisions() -> tuple[int | str, ...]:
    """The values Lightning's Trainer takes for ``precision`` (``bf16-mixed``, ``32-true``, ``16``,
    ...), read from the Literal types of its signature, so that they follow the installed version."""

    def literals(hint: Any) -> list[int | str]:
        if typing.get_origin(hint) is typing.Literal:
            return list(typing.get_args(hint))
        return [value for arg in typing.get_args(hint) for value in literals(arg)]

    return tuple(literals(inspect.signature(L.Trainer.__init__).parameters["precision"].annotation))


def check_logger_settings(logger: DictConfig) -> None:
    """The ``logger.*`` group (``conf/logger/*.yaml``): only the ``wandb`` and ``csv`` loggers and
    the keys :func:`train._loggers` reads (a ``+logger.wandb.entity=...`` or ``+logger.csv.foo=...``
    would be dropped without a word), the flags booleans, W&B's mode online / offline.

    Raises:
        ValueError: an unknown logger or key, named with the valid ones; a flag that is not true /
            false; ``logger.wandb.mode`` not online / offline with W&B enabled.
    """
    unknown = sorted(str(key) for key in logger.keys() if key not in ("wandb", "csv"))
    if unknown:
        raise ValueError(
            f"unknown loggers {unknown}; valid ones: ['csv', 'wandb'] (logger.csv, logger.wandb)"
        )
    check_wandb_settings(logger.wandb, "logger.wandb", (*WANDB_KEYS, "tags"))
    unknown = sorted(str(key) for key in logger.csv.keys() if key != "enabled")
    if unknown:
        raise ValueError(f"unknown logger.csv keys {unknown}; valid keys: ['enabled']")
    check_flag(logger.csv.enabled, "logger.csv.enabled")


# Trainer arguments that train() passes itself, from the run's folder and its loggers, callbacks
# and checkpoint writer: a trainer.* key of the same name would clash with them.
TRAINER_ARGS_SET_BY_TRAIN = frozenset({"default_root_dir", "logger", "callbacks", "plugins"})


# A new-user check: the run's loss was NaN from its second step, and the divergence warning advised a
# lower optim.lr. AdamW's eps (1e-8) rounds to 0 in float16, so a parameter whose gradient is 0 (the
# embedding row of a token no batch holds yet) is updated by 0 / 0.
FLOAT16_WEIGHTS_NAN = (
    "trainer.precision=16-true keeps the weights and AdamW's state in float16, where its eps (1e-8) is 0: "
    "a parameter without a gradient (the embedding of a token not in the batch) becomes NaN at the first "
    "step; use trainer.precision=bf16-mixed (or 16-mixed on a GPU, bf16-true)"
)


def check_trainer_settings(cfg: DictConfig) -> None:
    """The ``trainer.*`` and ``seed`` settings that Lightning would reject late (after a step, with
    a traceback) or take silently in a wrong type, checked before anything starts.

    Raises:
        TypeError: a setting of the wrong type (``trainer.max_steps=abc`` or ``=2.5``, ``seed=abc``,
            ``trainer.enable_progress_bar=no``: Lightning's flags must be booleans).
        ValueError: a ``trainer.*`` key that is no argument of Lightning's Trainer
            (``+trainer.max_step=3``, named with a guess) or one that train.py passes itself
            (:data:`TRAINER_ARGS_SET_BY_TRAIN`); ``seed`` outside [0, 2**32),
            ``trainer.gradient_clip_val`` < 0,
            ``trainer.max_steps`` or ``trainer.max_epochs`` not -1 (no limit) or >= 1, or
            both -1 (the schedule needs a length),
            ``trainer.val_check_interval`` not a step count >= 1 or an epoch fraction in (0, 1],
            ``trainer.check_val_every_n_epoch`` not null or >= 1, or a fractional interval with it
            null; ``trainer.precision`` none of :func:`lightning_precisions` (``bf17``);
            ``trainer.limit_val_batches`` <= 0 (no validation, so no best.ckpt and no records);
            ``trainer.limit_train_batches`` <= 0 (no training step, yet the run reported success);
            ``trainer.accumulate_grad_batches`` not an integer >= 1; ``trainer.overfit_batches``
            other than 0 (Lightning cannot re-sample the resumable training loader);
            ``trainer.precision=16-true`` (:data:`FLOAT16_WEIGHTS_NAN`);
            ``trainer.max_time`` neither ``DD:HH:MM:SS`` nor a mapping of ``datetime.timedelta``'s
            keywords, or not a positive duration (:func:`_check_max_time`).
    """

    def integer(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value

    if not 0 <= integer("seed", cfg.seed) < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) (numpy's seed range), got {cfg.seed}")
    trainer = cfg.trainer
    accepted = {name.removeprefix("trainer.") for name in lightning_settings() if name.startswith("trainer.")}
    accepted -= TRAINER_ARGS_SET_BY_TRAIN
    unknown = sorted(str(key) for key in trainer.keys() if key not in accepted)
    if unknown:
        arguments = {name: [name] for name in accepted}
        named = []
        for key in unknown:
            meant = closest_settings(key, arguments) if key not in TRAINER_ARGS_SET_BY_TRAIN else []
            guess = " or ".join(f"trainer.{name}" for name in meant)
            named.append(f"'{key}'" + (f" (did you mean {guess}?)" if meant else ""))
        raise ValueError(
            f"unknown trainer keys {', '.join(named)}: the trainer.* settings are Lightning Trainer's "
            f"arguments, less {', '.join(sorted(TRAINER_ARGS_SET_BY_TRAIN))}, which train.py sets itself "
            "(logger=... chooses the loggers)"
        )
    clip = trainer.get("gradient_clip_val")
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)):
            raise TypeError(f"trainer.gradient_clip_val must be a number or null, got {clip!r}")
        if clip < 0:  # Lightning takes any value <= 0 as "no clipping", silently
            raise ValueError(f"trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
    for name in ("max_steps", "max_epochs"):
        value = trainer.get(name)
        if value is not None and integer(f"trainer.{name}", value) != -1 and value < 1:
            raise ValueError(f"trainer.{name} must be -1 (no limit) or >= 1, got {value}")
    if trainer.get("max_steps") == -1 and trainer.get("max_epochs") == -1:
        raise ValueError(
            "trainer.max_steps=-1 and trainer.max_epochs=-1 leave the run without a length, which the "
            "learning-rate schedule decays over; set one of them (with +trainer.max_time=..., a "
            "max_steps the clock will not reach, e.g. trainer.max_steps=100000)"
        )
    interval = trainer.get("val_check_interval")
    if interval is not None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(
                f"trainer.val_check_interval must be a number of steps (int) or a fraction of an epoch "
                f"(float), got {interval!r}"
            )
        if (isinstance(interval, int) and interval < 1) or (
            isinstance(interval, float) and not 0 < interval <= 1
        ):
            raise ValueError(
                f"trainer.val_check_interval must be >= 1 (steps) or in (0, 1] (a fraction of an epoch), "
                f"got {interval}"
            )
    for name in ("enable_progress_bar", "enable_checkpointing", "enable_model_summary", "deterministic"):
        value = trainer.get(name)
        # Hydra passes enable_progress_bar=no as the string "no", which Lightning takes as true.
        warn_only = name == "deterministic" and value == "warn"
        if value is not None and not isinstance(value, bool) and not warn_only:
            choices = "true, false or warn" if name == "deterministic" else "true or false"
            raise TypeError(f"trainer.{name} must be {choices}, got {value!r}")
    limit = trainer.get("limit_val_batches")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(
                f"trainer.limit_val_batches must be a batch count (int) or a fraction (float), got {limit!r}"
            )
        if limit <= 0:  # Lightning skips validation silently; the run kept no best.ckpt and no records
            raise ValueError(
                f"trainer.limit_val_batches={limit} turns validation off, but validation picks best.ckpt "
                "and gives the final metrics and result records; give a batch count >= 1 or a fraction "
                "in (0, 1] (data.num_test_examples sets the validation sets' size)"
            )
    train_limit = trainer.get("limit_train_batches")
    if train_limit is not None:
        if isinstance(train_limit, bool) or not isinstance(train_limit, (int, float)):
            raise TypeError(
                "trainer.limit_train_batches must be a batch count (int) or a fraction (float), "
                f"got {train_limit!r}"
            )
        if train_limit <= 0:  # a new-user check: no step trained, and the run reported its records
            raise ValueError(
                f"trainer.limit_train_batches={train_limit} trains no batch; give a batch count >= 1 or a "
                "fraction in (0, 1] (trainer.max_steps sets the run's length)"
            )
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and integer("trainer.accumulate_grad_batches", accumulate) < 1:
        # Lightning failed on 0 with a ZeroDivisionError traceback, and took 2.5 silently.
        raise ValueError(f"trainer.accumulate_grad_batches must be >= 1, got {accumulate}")
    if trainer.get("overfit_batches") not in (None, 0, 0.0):
        # Lightning's replacement of the training sampler failed on the resumable loader, in a traceback.
        raise ValueError(
            f"trainer.overfit_batches={trainer.overfit_batches} is not supported: train.py's training "
            "loader keeps its own order (for resume=) and Lightning cannot re-sample it; "
            "+trainer.limit_train_batches=<count> shortens each epoch instead"
        )
    max_time = trainer.get("max_time")
    # Lightning parses it only when the Trainer is built: in a sweep, after the jobs before it ran.
    if max_time is not None:
        _check_max_time(max_time)
    precision = trainer.get("precision")
    allowed = lightning_precisions()
    # bool before the membership test: True == 1 and 16.0 == 16, which Lightning takes and then fails on.
    if precision is not None and (not isinstance(precision, (int, str)) or isinstance(precision, bool)
                                  or precision not in allowed):  # fmt: skip
        named = ", ".join(str(value) for value in allowed if isinstance(value, str))
        raise ValueError(
            f"trainer.precision must be one of Lightning's precisions ({named}), got {precision!r}"
        )
    if precision == "16-true":
        raise ValueError(FLOAT16_WEIGHTS_NAN)
    every = trainer.get("check_val_every_n_epoch")
    if every is not None and integer("trainer.check_val_every_n_epoch", every) < 1:
        raise ValueError(f"trainer.check_val_every_n_epoch must be null or >= 1, got {every}")
    if isinstance(interval, float) and every is None:
        # Lightning counts a null check_val_every_n_epoch's interval in steps across epochs and
        # refuses a fraction from inside Trainer() with a traceback.
        raise ValueError(
            f"trainer.val_check_interval={interval} (a fraction of an epoch) needs validation counted "
            "per epoch, but trainer.check_val_every_n_epoch is null (steps across epochs); add "
            "trainer.check_val_every_n_epoch=1, or give the interval in steps (an int)"
        )


DATA_META_KEYS = ("name", "monitor", "monitor_mode")


def _check_max_time(max_time: Any) -> None:
    """Refuse a ``trainer.max_time`` Lightning would fail on when it builds the Trainer (in a sweep,
    after the jobs before it ran) or that is no positive duration (a new-user check: ``00:00:00:00``
    and ``{seconds: -5}`` trained nothing and the run still reported its untrained last.ckpt as the
    best checkpoint, with result records).

    Args:
        max_time: ``"DD:HH:MM:SS"`` or a mapping of ``datetime.timedelta``'s keywords (``{hours: 12}``).

    Raises:
        ValueError: any other form, a keyword timedelta does not take or a value that is no number,
            or a total of zero or less.
    """
    example = "00:12:00:00 for 12 hours, or a mapping such as {hours: 12}"
    if OmegaConf.is_dict(max_time):
        parts = OmegaConf.to_container(max_time)
        keywords = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")
        unknown = sorted(str(key) for key in parts if key not in keywords)
        if unknown:
            raise ValueError(f"trainer.max_time takes {', '.join(keywords)}, got {unknown}: e.g. {example}")
        for key, value in parts.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"trainer.max_time.{key} must be a finite number, got {value!r}")
    elif not isinstance(max_time, str) or not re.fullmatch(r"\d+:\d+:\d+:\d+", max_time.strip()):
        raise ValueError(f"trainer.max_time must be DD:HH:MM:SS, e.g. {example}; got {max_time!r}")
    else:
        fields = map(int, max_time.strip().split(":"))
        parts = dict(zip(("days", "hours", "minutes", "seconds"), fields, strict=True))
    try:
        span = timedelta(**parts)
    except OverflowError:  # past timedelta's 999999999 days (a new-user check: a traceback)
        raise ValueError(
            f"trainer.max_time={override_value(max_time)} is longer than Python's timedelta holds "
            f"(999999999 days); give a duration that fits, e.g. {example}"
        ) from None
    if span <= timedelta(0):
        raise ValueError(
            f"trainer.max_time={override_value(max_time)} is no time to train (training would stop before "
            f"its first step); give a positive duration, e.g. {example}"
        )


def build_datamodule(data_cfg: dict[str, Any], setup: bool) -> L.LightningDataModule:
    """The data module of the ``data.*`` settings, its training and validation sets drawn or read
    when ``setup`` (``setup("fit")``); a module's refusal names the ``data.*`` setting.

    Raises:
        ValueError / TypeError: an unknown data module or key, or a value the module refuses
            (``data.seqlen=7``: ``data.seqlen must be even ...``).
    """
    try:
        dm = datasets_lib.build_datamodule(
            data_cfg["name"], **{k: v for k, v in data_cfg.items() if k not in DATA_META_KEYS}
        )
        if setup:
            dm.setup("fit")
    except (TypeError, ValueError) as err:
        message = name_data_setting(str(err), data_cfg)
        # Only the plain types are rebuilt from a message (UnicodeDecodeError's constructor takes five
        # arguments): any other error, or one not naming a setting, goes on as it was raised.
        if message == str(err) or type(err) not in (TypeError, ValueError):
            raise
        raise type(err)(message) from err
    return dm


def check_val_batches(dm, limit: Any, world_size: int) -> None:
    """Refuse a fractional ``trainer.limit_val_batches`` that leaves a validation slice no batch:
    Lightning checks it only when validation starts, after a whole interval of training, and fails
    with a traceback. The batches per process are counted as at least ``ceil(batches / world_size)``,
    so a run Lightning would accept is never refused here.

    Raises:
        ValueError: ``limit * batches < 1`` for a slice, naming it and what to set.
    """
    if not isinstance(limit, float) or not 0 < limit < 1:
        return
    loaders = dm.val_dataloader()
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    names = list(getattr(dm, "slice_names", [])) or [f"slice {i}" for i in range(len(loaders))]
    for name, loader in zip(names, loaders, strict=False):
        batches = math.ceil(len(loader) / world_size)
        if int(limit * batches) < 1:
            raise ValueError(
                f"trainer.limit_val_batches={limit} of the {batches} validation batch(es) of {name} "
                f"(a process) is less than one batch, which Lightning refuses when validation starts; "
                f"raise it to at least {1 / batches:.3g} (1.0: all), or validate on more examples"
            )


def slice_lengths(dm, slice_names: list[str], train_seqlen: int) -> dict[str, int]:
    """Example length of every validation slice of a data module: its ``slice_seqlens`` where it has
    one (the synthetic tasks), else read from MQAR slice names (``T128_kv8``), else ``train_seqlen``
    (text, whose one slice is at the training length)."""
    known = getattr(dm, "slice_seqlens", None)
    if known is not None:
        return {name: int(known[name]) for name in slice_names}
    lengths = {}
    for name in slice_names:
        try:
            lengths[name] = parse_slice_name(name)[0]
        except ValueError:
            lengths[name] = train_seqlen
    return lengths


def check_learned_positions(model, longest: int) -> None:
    """Refuse, before any training, a learned position table shorter than the longest sequence the
    run will see (training or validation): such a position has no row, so the mixer would fail at
    the first validation of that slice.

    Raises:
        ValueError: naming the mixer, its ``max_position`` and the override that fixes it.
    """
    limit = model.position_limit()
    if limit is not None and limit[1] < longest:
        name, size = limit
        raise ValueError(
            f"{name}: pos_emb=learned has max_position={size} rows, but the run trains or validates "
            f"sequences of {longest} tokens; set ++mixer.settings.{name}.max_position={longest} (rows "
            "past the training length stay untrained, which is what a length-extrapolation test of learned "
            "positions measures; ++ sets the key whether or not the config has it) or drop the longer slices "
            "from data.test_configs"
        )


# What early_stopping may be, for the refusals of check_early_stopping_arguments.
EARLY_STOPPING_FORMS = (
    "null (or false: no early stopping) or a mapping of Lightning EarlyStopping's arguments, e.g. "
    "early_stopping={monitor:val/loss,mode:min,patience:3}"
)


def check_early_stopping_arguments(settings: Any) -> None:
    """The form of ``early_stopping`` (``conf/train.yaml``), checked with the settings that need
    neither data nor model: null or false (no early stopping), or a mapping of arguments of
    Lightning's ``EarlyStopping``. Which metric it monitors, and how, :func:`check_early_stopping`
    checks once the run's slices are known.

    Raises:
        ValueError: any other value (``early_stopping=3``, ``=true``, ``=val/acc``, ``=[1]``: Lightning
            has no such form), a key that is no argument of EarlyStopping (named with the valid
            ones: it would refuse it only after the seeding), or a ``patience`` below 0.
        TypeError: a ``patience`` that is not an integer (null included).
    """
    if settings is None or settings is False:
        return
    if not OmegaConf.is_dict(settings) and not isinstance(settings, Mapping):
        raise ValueError(
            f"{pasteable(f'early_stopping={override_value(settings)}')}: early_stopping must be "
            f"{EARLY_STOPPING_FORMS}"
        )
    valid = sorted(
        name.removeprefix("early_stopping.")
        for name in lightning_settings()
        if name.startswith("early_stopping.")
    )
    unknown = sorted(str(key) for key in settings.keys() if key not in valid)
    if unknown:
        raise ValueError(
            f"unknown early_stopping keys {unknown}; valid keys (the arguments of Lightning's "
            f"EarlyStopping): {valid}"
        )
    if "patience" in settings:  # Lightning's default (3) where it is left out
        patience = settings["patience"]  # a DictConfig or a plain mapping
        if isinstance(patience, bool) or not isinstance(patience, int):
            raise TypeError(f"early_stopping.patience must be an integer, got {patience!r}")
        if patience < 0:
            raise ValueError(
                f"early_stopping.patience must be >= 0 (the validations without improvement before "
                f"training stops), got {patience}"
            )


def check_early_stopping(settings: Any, slice_names: list[str]) -> None:
    """``early_stopping`` (EarlyStopping's arguments, their form checked by
    :func:`check_early_stopping_arguments`) checked before training: Lightning finds a metric name it
    never sees only at the first validation, with a traceback.

    Args:
        settings: the ``early_stopping`` config, or None / false / empty (no early stopping).
        slice_names: the validation slices of the task (``val/acc_<slice>``, ``val/loss_<slice>``).

    Raises:
        ValueError: no ``monitor``, a ``monitor`` that is not a metric this run logs (listing them),
            a ``mode`` other than min / max, or one that counts an accuracy's rise (a loss's fall) as
            no improvement: ``+early_stopping.monitor=val/acc`` with EarlyStopping's default mode,
            min, stopped the run at its first validation (a new-user check).
    """
    if not settings:
        return
    monitor, mode = settings.get("monitor"), settings.get("mode", "min")
    known = logged_metrics(slice_names)
    if monitor not in known:
        given = "no early_stopping.monitor" if monitor is None else f"early_stopping.monitor={monitor!r}"
        raise ValueError(
            f"{given}: monitor one of the metrics this run logs, {sorted(known)} "
            "(e.g. early_stopping={monitor:val/loss,mode:min,patience:3})"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"early_stopping.mode must be min or max, got {mode!r}")
    better = improving_mode(monitor)
    if better is not None and mode != better:
        given = f"early_stopping.mode={mode}" if "mode" in settings else "no early_stopping.mode (min)"
        fix = "early_stopping.mode" if "mode" in settings else "+early_stopping.mode"
        direction = "falling" if better == "max" else "rising"
        raise ValueError(
            f"early_stopping.monitor={monitor} with {given} would stop training once it stops {direction} "
            f"(with a stopping_threshold, at its first validation); give {fix}={better}"
        )


def check_monitor(monitor: Any, mode: Any, slice_names: list[str]) -> None:
    """``data.monitor`` / ``data.monitor_mode`` (best.ckpt's selection) checked before training:
    Lightning refuses an unknown mode in ModelCheckpoint's constructor and an unlogged metric at
    the first validation, both with a traceback.

    Raises:
        ValueError: a ``monitor`` that is not a metric this run logs (listing them), a ``mode`` other
            than min / max, or a loss or perplexity monitored with ``max`` (best.ckpt would be the
            worst checkpoint).
    """
    known = logged_metrics(slice_names)
    if monitor not in known:
        raise ValueError(
            f"data.monitor={monitor!r}: monitor one of the metrics this run logs, {sorted(known)} "
            "(e.g. data.monitor=val/loss data.monitor_mode=min)"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"data.monitor_mode must be min or max, got {mode!r}")
    if mode == "max" and improving_mode(monitor) == "min":
        raise ValueError(
            f"data.monitor={monitor} with data.monitor_mode=max would keep the highest-loss checkpoint as "
            "best.ckpt; add data.monitor_mode=min"
        )


def name_data_setting(message: str, data_cfg: Mapping[str, Any]) -> str:
    """A data module's error ``message`` with ``data.`` before the setting it starts with, so that it
    names the override (``test_configs[0].seqlen must be >= 4`` -> ``data.test_configs[0].seqlen ...``):
    the modules name their own arguments. Any other message is returned as it is."""
    key = re.match(r"\w+", message)
    return f"data.{message}" if key is not None and key.group() in data_cfg else message


def name_mixer_settings(message: str, mixer_group: DictConfig) -> str:
    """A mixer's refusal of its settings, which names its constructor's arguments (``attention:
    num_kv_heads=3 must divide num_heads=4``), with the override of each setting it names (``
    (num_kv_heads is mixer.settings.attention.num_kv_heads, num_heads is model.num_heads)``): a
    setting that the unresolved mixer group links to ``${model.*}`` by that key, ``d_model`` by
    ``model.d_model``, one the group lacks with ``+`` (a new-user check: ``model.d_model=63`` was
    refused in words naming no override). Any other message is returned as it is."""
    name = message.split(":", 1)[0]
    settings = mixer_group.get("settings")
    if name not in MIXERS or not isinstance(settings, DictConfig):
        return message
    own = settings.get(name)
    raw = OmegaConf.to_container(own, resolve=False) if isinstance(own, DictConfig) else {}
    said = []
    for key in ("d_model", *setting_names(name)):
        if re.search(rf"\b{key}\b", message.split(":", 1)[1]) is None:
            continue
        value = raw.get(key)
        if key == "d_model":
            said.append("d_model is model.d_model")
        elif isinstance(value, str) and re.fullmatch(r"\$\{model\.\w+\}", value):
            said.append(f"{key} is {value[2:-1]}")
        else:
            said.append(f"{key} is {'' if key in raw else '+'}mixer.settings.{name}.{key}")
    return f"{message} ({', '.join(said)})" if said else message


def configured_world_size(trainer_cfg: Mapping[str, Any]) -> int | None:
    """The process count (``trainer.devices`` x ``trainer.num_nodes``) when the config states it: a
    device count >= 1 or a list of device ids, on a node count >= 1. None when Lightning derives it
    from the machine (``auto``, ``-1``, a string) or the values are invalid (Lightning refuses them)."""
    devices, nodes = trainer_cfg.get("devices"), trainer_cfg.get("num_nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return None
    if isinstance(devices, list) and devices:
        return len(devices) * nodes
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices * nodes
    return None


class TrainerSettingsError(ValueError):
    """Lightning refused the ``trainer.*`` settings (:func:`trainer_settings_errors`)."""


@contextlib.contextmanager
def trainer_settings_errors(trainer_cfg: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Lightning's refusal of ``trainer.*`` settings it cannot run as the ValueError of a settings
    error: one line and status 2 from the command line, and the run's folders undone, as for other
    settings. Taken are ``MisconfigurationException`` (``trainer.devices=0``, an accelerator this
    machine lacks), the ValueError / TypeError of Lightning's argument checks
    (``trainer.devices=abc``: "`devices` selected with `CPUAccelerator` should be an int > 0") and
    the ModuleNotFoundError of an accelerator whose package is missing (``trainer.accelerator=tpu``:
    a traceback before). The setting the message is about (:func:`_named_trainer_key`; for a missing
    package the one whose value names it, :func:`_key_naming_package`, else the accelerator, or else
    the strategy) is named first (``trainer.devices=abc: ...``).

    Raises:
        TrainerSettingsError: the exception's message, prefixed with ``trainer settings``.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        yield
    except TrainerSettingsError:
        raise
    except (MisconfigurationException, ValueError, TypeError, ModuleNotFoundError) as err:
        message = str(err)
        key = _named_trainer_key(message, trainer_cfg or {})
        if isinstance(err, ModuleNotFoundError):  # torch_xla's requirement names no setting
            accelerator = str((trainer_cfg or {}).get("accelerator", "auto"))
            # A new-user check: precision=transformer-engine (transformer_engine) was named as strategy=auto.
            key = key or _key_naming_package(message, trainer_cfg or {})
            key = key or ("accelerator" if accelerator not in ("auto", "cpu", "gpu", "cuda") else "strategy")
            message = f"a package it needs is not installed: {message}"
        if key is not None and trainer_cfg is not None and key in trainer_cfg:
            message = f"{pasteable(f'trainer.{key}={override_value(trainer_cfg[key])}')}: {message}"
        raise TrainerSettingsError(f"trainer settings: {message}") from err


def _named_trainer_key(message: str, trainer_cfg: Mapping[str, Any]) -> str | None:
    """The ``trainer.*`` setting a Lightning message is about: the key of ``trainer_cfg`` it names
    first, in backticks (`` `devices` ``, ``Trainer(devices=0)``) or in a class name
    (``DeepSpeedStrategy``, ``MPSAccelerator``); None where it names none."""
    lowered = message.lower()
    found = {lowered.find(key.lower()): key for key in trainer_cfg if key.lower() in lowered}
    return found[min(found)] if found else None


def _key_naming_package(message: str, trainer_cfg: Mapping[str, Any]) -> str | None:
    """The ``trainer.*`` setting whose value names the package a ModuleNotFoundError's ``message``
    asks for, ``-`` read as ``_`` (``precision=transformer-engine``: ``transformer_engine``); None
    where no value (but ``auto``) does."""
    lowered = message.lower()
    for key, value in trainer_cfg.items():
        if isinstance(value, str) and value != "auto" and value.lower().replace("-", "_") in lowered:
            return key
    return None


def resolved_world_size(trainer_cfg: Mapping[str, Any]) -> int:
    """The process count a ``L.Trainer(**trainer_cfg)`` runs with on this machine, its settings
    checked as the Trainer checks them: the count the config states (:func:`configured_world_size`),
    else ``trainer.devices`` (``auto``, ``-1``, a string such as ``"2"`` or ``"0,1"``) resolved as the
    Trainer resolves it, by Lightning's own accelerator connector (which the Trainer runs first): on
    CPU ``auto`` is one process, on GPUs
    ``auto`` and ``-1`` are one process per visible GPU (one in a notebook). It builds no Trainer and
    prints nothing (the connector's info lines, such as the precision in use, come again from the
    Trainer).

    Raises:
        TrainerSettingsError: the settings the Trainer would refuse (``trainer.devices=-1`` on CPU,
            an unavailable accelerator, ``trainer.strategy=bogus``), named by
            :func:`trainer_settings_errors`; a strategy that spawns or forks its processes
            (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), whose results train.py would not see;
            ``trainer.num_nodes`` > 1 with no cluster manager and no ``MASTER_ADDR`` (the run would
            wait for nodes that cannot reach it).
    """
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    arguments = inspect.signature(_AcceleratorConnector).parameters
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = rank_zero_log.level
    rank_zero_log.setLevel(logging.WARNING)
    try:
        with trainer_settings_errors(trainer_cfg):
            connector = _AcceleratorConnector(**{k: v for k, v in trainer_cfg.items() if k in arguments})
    finally:
        rank_zero_log.setLevel(level)
    # A new-user check: ddp_spawn trained, but the processes it spawns keep what they computed (the
    # final validation, the records: train.json was [], exit status 0) and Lightning cleared the CSV.
    if getattr(connector.strategy, "_start_method", "popen") != "popen":
        given = pasteable(f"trainer.strategy={override_value(trainer_cfg.get('strategy'))}")
        raise TrainerSettingsError(
            f"trainer settings: {given} starts its processes by {connector.strategy._start_method}, and what "
            "they compute (the final validation, the records) does not come back to train.py; use "
            "trainer=ddp (trainer.strategy=ddp: each process runs train.py)"
        )
    # A new-user check: trainer.num_nodes=2 on one machine waited for the second node at the first
    # rendezvous, without a word and past SIGTERM. Without a cluster manager (SLURM, torchrun, ...)
    # Lightning's own environment meets the other nodes at MASTER_ADDR, which defaults to this
    # machine's loopback address, where no other node can reach it.
    nodes = trainer_cfg.get("num_nodes", 1)
    if (
        isinstance(nodes, int)
        and nodes > 1
        and isinstance(connector.cluster_environment, LightningEnvironment)
        and "MASTER_ADDR" not in os.environ
    ):
        given = pasteable(f"trainer.num_nodes={override_value(nodes)}")
        raise TrainerSettingsError(
            f"trainer settings: {given} would wait for {nodes - 1} more node(s) with no address to meet them "
            "at (MASTER_ADDR is not set, and no cluster manager such as SLURM or torchrun started this "
            "run); on each node run this command with MASTER_ADDR=<node 0's address> MASTER_PORT=<a free "
            f"port> NODE_RANK=<0 to {nodes - 1}>, or launch it through your cluster manager; on this "
            "machine alone use trainer.num_nodes=1"
        )
    # The connector runs for a stated count too: it checks what the Trainer would (strategy=bogus,
    # an accelerator whose package is missing) before the seeding, not after it.
    stated = configured_world_size(trainer_cfg)
    if stated is not None:
        return stated
    return int(getattr(connector.strategy, "world_size", 1))  # as Trainer.world_size reads it

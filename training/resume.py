"""Continuing an earlier run from its checkpoint (``resume=<ckpt>``), checked before training.

A continued run must train on the batches, in the order and with the optimizer of the run it
continues: :func:`check_resume` compares this run's settings with the checkpoint's
(:func:`resume_settings`, with the data module's defaults resolved by :func:`resolve_defaults`;
:data:`RESUME_EXEMPT_DATA_KEYS` may differ) and refuses a checkpoint that has nothing left to train.
Each optimizer step trains on ``data.batch_size`` examples per process, so the process count must
match too: :class:`WorldSizeRecord` stores it in every checkpoint, and
:func:`refuse_another_world_size` / :func:`check_resume_world_size` compare it. A continued run may
train for another length; its learning-rate schedule is then recomputed over that length, which
:class:`ScheduleRecord` notes.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, Timer

import data as datasets_lib
from eval.cli import override_value, pasteable
from models import ModelConfig
from models.checkpoint import numpy_scalars_loadable, read_checkpoint
from models.lit import DEFAULT_OPTIM

# The data.* keys a resumed run may change (check_resume compares every other data.* key, optim.*,
# the model and seed= with the checkpoint's): they change how the batches reach the model or which
# checkpoint is kept as best.ckpt, not which batches it trains on, in what order, or what it is
# validated on.
RESUME_EXEMPT_DATA_KEYS = (
    # loader processes: the order is the sampler's (data/resumable.py), whatever process builds a batch
    "num_workers",
    # where `datasets` caches a corpus (data=text): the same text, read from another folder
    "cache_dir",
    # best.ckpt's selection: a resumed run writes into a new directory, so Lightning's ModelCheckpoint
    # restores no best score from the checkpoint and best.ckpt is the best of this run's own
    # validations; selecting them by another metric changes no weight and no validation number.
    "monitor",
    "monitor_mode",
)

# The data.* keys whose null stands for values the data module derives from the other settings
# (test_configs: the default evaluation slices): check_resume compares them as the module resolves
# them (resolve_defaults), so that a list written out equal to the default is the same setting.
RESOLVED_DATA_KEYS = ("test_configs",)

# resume_settings' name of a text run's tokenizer (its character vocabulary, from the corpus).
TOKENIZER_SETTING = "tokenizer"
# resume_settings' name of a text run's corpus digest (LitLM's corpus_sha256).
CORPUS_SETTING = "corpus"

# resume_settings' names of the model config's keys that the mixer group sets, as the overrides that
# give them (the others are model.<key>); its name is the mixer group chosen (mixer=hybrid_jamba). The
# mixers' settings are mixer.settings.<mixer>, one per mixer the model builds.
MIXER_SETTINGS = {
    "name": "mixer",
    "pattern": "mixer.pattern",
    "shared_block": "mixer.shared_block",
}


def _days_hms(span: timedelta) -> str:
    """``span`` as Lightning's ``DD:HH:MM:SS`` duration."""
    seconds = int(span.total_seconds())
    return f"{seconds // 86400:02d}:{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def absolute_paths(path: str | os.PathLike | Sequence[str | os.PathLike]) -> str | list[str]:
    """``data.path`` -- a corpus file or a list of files -- as absolute paths (relative ones are read
    from the working directory, which Hydra leaves as it is); a one-file list gives that file's path.

    Why: the checkpoint stores the corpus by these paths, so that a resume or an evaluation started
    from another folder reads, and is compared with, the same file.
    """
    files = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    resolved = [str(Path(f).expanduser().resolve()) for f in files]
    return resolved[0] if len(resolved) == 1 else resolved


def resume_settings(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a run that a resume of it must keep, in the order :func:`check_resume` names
    a difference: ``data.name``, the other ``data.*`` keys (sorted, without
    :data:`RESUME_EXEMPT_DATA_KEYS`; ``data.path`` resolved to absolute paths), a text run's
    tokenizer and corpus digest (only where ``hparams`` holds one), the model config's keys
    (completed by :class:`ModelConfig`; the mixer first, then sorted; named by their overrides,
    ``model.<key>`` or :data:`MIXER_SETTINGS`) and ``mixer.settings.<mixer>`` of each mixer the
    model builds (sorted; the settings of mixers it does not build change nothing),
    ``optim.*`` (completed with :data:`models.lit.DEFAULT_OPTIM`) and ``seed`` (only where
    ``hparams`` holds one).

    Args:
        hparams: a run's :class:`models.lit.LitLM` hyperparameters (``model``, ``optim``, ``data``,
            ``tokenizer_config``, ``run_seed``, ``corpus_sha256``): a checkpoint's
            ``hyper_parameters`` or this run's ``lit.hparams``. A ``data.*`` key it lacks (a
            checkpoint written before the key existed) takes its data module's default.

    Returns:
        ``{name: value}`` in that order, tuples (``optim.betas``) as lists, as the config gives them.
    """
    data = dict(hparams.get("data") or {})
    module = datasets_lib.DATAMODULES.get(data.get("name"))
    if module is not None:
        defaults = inspect.signature(module).parameters.values()
        data = {p.name: p.default for p in defaults if p.default is not p.empty} | data
    if data.get("path") is not None:
        # The file named by any path. train.py stores absolute paths; a checkpoint written before
        # that holds the path as typed, read here from this run's working directory.
        data["path"] = absolute_paths(data["path"])
    data_keys = sorted(set(data) - set(RESUME_EXEMPT_DATA_KEYS), key=lambda k: (k != "name", k))
    config = ModelConfig.from_dict(hparams["model"])
    model = config.to_dict()
    # Only the mixers the model builds: another mixer's settings change no weight (a new-user check:
    # +mixer.settings.attention.pos_emb=learned on a mamba run refused its resume without it).
    used = set(config.layout) | ({config.shared_block.mixer} if config.shared_block is not None else set())
    every_mixer = model.pop("mixer_settings")
    mixer_settings = {name: every_mixer.get(name, {}) for name in sorted(used)}
    model_keys = sorted(model, key=lambda k: (k != "name", k))  # the mixer first: the likeliest difference
    optim = {**DEFAULT_OPTIM, **(hparams.get("optim") or {})}
    tokenizer = hparams.get("tokenizer_config")
    settings = {
        **{f"data.{k}": data[k] for k in data_keys},
        # A text run's vocabulary comes from its corpus: another one (the file edited, or another
        # file at the same relative path) would silently map the token ids to other characters.
        **({TOKENIZER_SETTING: tokenizer} if tokenizer is not None else {}),
        # The same file edited in place (same path, often the same characters) would train on other
        # batches, unnoticed (a new-user check reversed the corpus and resumed).
        **({CORPUS_SETTING: hparams["corpus_sha256"]} if hparams.get("corpus_sha256") is not None else {}),
        **{MIXER_SETTINGS.get(k, f"model.{k}"): model[k] for k in model_keys},
        **{f"mixer.settings.{name}": value for name, value in mixer_settings.items()},
        **{f"optim.{k}": optim[k] for k in sorted(optim)},
        **({"seed": hparams["run_seed"]} if hparams.get("run_seed") is not None else {}),
    }
    return {name: list(value) if isinstance(value, tuple) else value for name, value in settings.items()}


def resolve_defaults(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (:func:`resume_settings`) with each :data:`RESOLVED_DATA_KEYS` value as the data
    module resolves it, e.g. ``data.test_configs=null`` as the default slices it stands for,
    normalised as an explicit list is, in the form a config writes it (MQAR's slices as
    ``{seqlen, num_kv_pairs}`` mappings): what :func:`check_resume` compares, so that a value and the
    default it stands for are equal while any other difference stays one, and shows. Settings the
    data module refuses (a checkpoint of another mixerlab version) are returned as given.
    """
    data = {key.removeprefix("data."): value for key, value in settings.items() if key.startswith("data.")}
    module = datasets_lib.DATAMODULES.get(data.pop("name", None))
    keys = [key for key in RESOLVED_DATA_KEYS if key in data]
    if module is None or not keys:
        return dict(settings)
    try:
        resolved = module(**data)  # derives its settings only: no data is generated before setup()
    except (TypeError, ValueError):
        return dict(settings)
    values = {key: getattr(resolved, key) for key in keys}
    if isinstance(resolved, datasets_lib.MQARDataModule):  # its slices are (seqlen, num_kv_pairs) pairs
        values["test_configs"] = [{"seqlen": t, "num_kv_pairs": kv} for t, kv in values["test_configs"]]
    return {**settings, **{f"data.{key}": value for key, value in values.items()}}


def check_resume(
    resume: str | None,
    hparams: Mapping[str, Any],
    max_steps: int | None = None,
    max_epochs: int | None = None,
    max_time: str | dict[str, int] | None = None,
    world_size: int | None = None,
) -> str | None:
    """The checkpoint path to continue from (``resume=``), checked before training starts.

    Args:
        resume: a ``.ckpt`` written by train.py, or None (a new run).
        hparams: this run's :class:`models.lit.LitLM` hyperparameters (``lit.hparams``: ``model``,
            ``optim``, ``data``, ``tokenizer_config``, ``run_seed``), compared with the checkpoint's
            (:func:`resume_settings`).
        max_steps: this run's ``trainer.max_steps`` (-1 or None: no step limit).
        max_epochs: this run's ``trainer.max_epochs`` (-1 or None: no epoch limit).
        max_time: this run's ``trainer.max_time`` (``"DD:HH:MM:SS"`` or a timedelta's keywords;
            None: no time limit). Lightning's Timer counts the checkpoint's training time in it.
        world_size: this run's process count where the config states it
            (:func:`training.settings.configured_world_size`), compared with the checkpoint's
            (:func:`refuse_another_world_size`); None: not compared here.

    Returns:
        The path as an absolute string, or None.

    Raises:
        ValueError: a ``resume`` that is no path (``resume=3``, ``=true``, ``=[a]``).
        FileNotFoundError / ValueError: a missing, corrupt or non-mixerlab checkpoint, or one whose
            weights hold NaN or inf (:func:`models.checkpoint.read_checkpoint`: training on from a
            diverged run stays NaN), or one without the trainer state to resume
            (a weights-only file); ValueError: the checkpoint was trained with other settings than
            this run's -- another data task or ``data.*`` value (except
            :data:`RESUME_EXEMPT_DATA_KEYS`; ``data.path`` as the file it names, or not at all where
            both runs store their corpus digest, which compares the contents; a default such as
            ``data.test_configs=null`` as the values it stands for, :func:`resolve_defaults`), a
            text corpus of another vocabulary or other contents (compared when the checkpoint stores
            its digest), model, ``optim.*`` value or ``seed`` (compared when
            the checkpoint stores one) -- naming every differing key with both values (a
            default as the values it stands for), in Hydra's override form (:func:`override_value`)
            (the continued run would train on other batches, in another order or with another
            optimizer than the run it continues), or on another process count than ``world_size``,
            or the checkpoint already reached ``max_steps`` or
            ``max_epochs``, or has trained for ``max_time`` (Lightning would train nothing and the
            new run would repeat the old one's results). The messages name the checkpoint as given,
            ``resume=<path>`` in Hydra's override form.
    """
    if resume is None:
        return None
    given = pasteable(f"resume={override_value(resume)}")
    if not isinstance(resume, str):
        quote = ""
        if isinstance(resume, (bool, int, float)):  # Hydra reads resume=3 as a number: quoted, a path
            quoted = pasteable(f"resume={override_value(override_value(resume))}")
            quote = f" (a file named like a number or true / false is quoted: {quoted})"
        raise ValueError(
            f"{given}: resume takes the path of a checkpoint written by train.py (e.g. "
            f"resume=outputs/<run>/checkpoints/last.ckpt), or null for a new run{quote}"
        )
    checkpoint = read_checkpoint(resume, arg="resume")
    if "optimizer_states" not in checkpoint or "loops" not in checkpoint:
        raise ValueError(
            f"{given} holds no trainer state (optimizer, loops) to continue from; give a "
            "checkpoint written by train.py (checkpoints/last.ckpt or best.ckpt)"
        )
    # Read as mappings below (the Timer's and WorldSizeRecord's states, the fit loop's progress).
    for entry in ("callbacks", "loops"):
        if not isinstance(checkpoint.get(entry, {}), Mapping):
            raise ValueError(
                f"{given}: the checkpoint is corrupt (its {entry} entry is a "
                f"{type(checkpoint[entry]).__name__}, not a mapping); resume from an intact copy of it or "
                "from another checkpoint of the run"
            )
    step = int(checkpoint.get("global_step", 0))
    if max_steps is not None and max_steps != -1 and step >= max_steps:
        raise ValueError(
            f"{given} is already at step {step}, and trainer.max_steps={max_steps}: nothing is "
            f"left to train; raise trainer.max_steps to continue (e.g. trainer.max_steps={2 * step})"
        )
    # Lightning stops at max_epochs by the epochs its fit loop has processed (FitLoop.done).
    progress = checkpoint["loops"].get("fit_loop", {}).get("epoch_progress", {})
    epochs = progress.get("current", {}).get("processed")
    if max_epochs is not None and max_epochs != -1 and isinstance(epochs, int) and epochs >= max_epochs:
        raise ValueError(
            f"{given} has already trained {epochs} epoch(s), and trainer.max_epochs={max_epochs}: "
            f"nothing is left to train; raise trainer.max_epochs to continue (e.g. "
            f"trainer.max_epochs={2 * epochs})"
        )
    # Lightning's Timer restores the training time it saved (its state is under its class name) and
    # stops at once when that reaches max_time: the README's second session gives the total.
    timers = [state for key, state in checkpoint.get("callbacks", {}).items() if str(key).startswith("Timer")]
    timer_state = timers[0] if timers else None
    if max_time is not None and timer_state is not None:
        timer = Timer(duration=max_time)
        timer.load_state_dict(timer_state)
        if timer.time_remaining() <= 0:
            spent = timedelta(seconds=round(timer.time_elapsed()))
            raise ValueError(
                f"{given} has already trained for {spent} (Lightning's timer counts it), and "
                f"trainer.max_time={override_value(max_time)}: nothing is left to train; give the total "
                f"time, e.g. +trainer.max_time={_days_hms(spent + timedelta(minutes=30))} for 30 more minutes"
            )
    current = resume_settings(hparams)
    try:
        saved = resume_settings(checkpoint["hyper_parameters"])
    except (ValueError, TypeError) as err:  # read as a refusal of this run's own settings otherwise
        raise ValueError(
            f"{given} holds settings that do not validate ({err}): the checkpoint is corrupt, or was edited "
            "or written by another mixerlab version; resume from an intact copy or another checkpoint"
        ) from err
    if CORPUS_SETTING in current and CORPUS_SETTING in saved:
        # The digests compare the corpus itself: a copy, a hard link or the file moved resumes, and
        # another file or an edit is refused by its vocabulary or its digest, whatever its path.
        for settings in (current, saved):
            settings.pop("data.path", None)
    # Compared and named as resolved: a default and the value it stands for are one setting.
    # The checkpoint's keys: a checkpoint written before the seed was stored resumes with any seed=.
    resolved = resolve_defaults(current)
    differences = []  # (override, this run's value): every one named at once (a new-user check)
    for key, value in resolve_defaults(saved).items():
        if value == resolved.get(key):
            continue
        if key == TOKENIZER_SETTING:
            was, now = (set((t or {}).get("vocab") or "") for t in (value, current.get(key)))
            # Only the differences there are (an appended 'z' has no missing characters).
            new, missing = ("".join(sorted(chars)) for chars in (now - was, was - now))
            named = [f"new characters {new!r}"] * bool(new) + [f"missing {missing!r}"] * bool(missing)
            changes = ", ".join(named)
            raise ValueError(
                f"{given}: this run's corpus has another vocabulary than the checkpoint's "
                f"({changes or 'the same characters in another order'}; the token ids would mean "
                "other characters): data.path names another file than the checkpoint's corpus, or the file "
                "was edited; resume on the checkpoint's corpus"
            )
        if key == CORPUS_SETTING:
            raise ValueError(
                f"{given}: this run's corpus is not the checkpoint's (its SHA-256 begins "
                f"{str(current.get(key))[:12]}, the checkpoint's {str(value)[:12]}): the file data.path "
                "names was edited or replaced since that run (or its files are listed in another order), so "
                "the continued run would train on other batches; resume on the checkpoint's corpus, or start "
                "a new run"
            )
        # The data module's name is chosen by the data group: data=mqar gives it (and its defaults).
        shown = "data" if key == "data.name" else key
        difference = (pasteable(f"{shown}={override_value(value)}"), override_value(resolved.get(key)))
        if key == "data.name":  # another task: its other data.* keys differ with it, named alone
            differences = [difference]
            break
        differences.append(difference)
    if differences:
        trained = (
            f"{differences[0][0]}, this run has {differences[0][1]}" if len(differences) == 1
            else ", ".join(f"{override} (this run has {now})" for override, now in differences)
        )  # fmt: skip
        raise ValueError(
            f"{given} was trained with {trained}; resume with the checkpoint's settings (its run "
            "directory's .hydra/overrides.yaml lists them)"
        )
    if world_size is not None:
        refuse_another_world_size(checkpoint, resume, world_size)
    return str(Path(resume).resolve())


# The largest process count (and node count) a WorldSizeRecord may hold: far above any training run's
# (the largest use some 10**5 GPUs); a larger one is a corrupt record, not a count to resume on.
MAX_PROCESSES = 2**20


class WorldSizeRecord(Callback):
    """Stores the run's process count (``trainer.world_size``) and ``trainer.num_nodes`` in its
    checkpoints, as this callback's state (``checkpoint["callbacks"]["WorldSizeRecord"]``), for
    :func:`check_resume_world_size`. Checkpoints written before it hold none."""

    def __init__(self) -> None:
        self.processes: dict[str, int] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Note the process count of the Trainer this callback runs in."""
        self.processes = {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes}

    def state_dict(self) -> dict[str, int]:
        """``{"world_size": int, "num_nodes": int}`` (empty, so not stored, before :meth:`setup`)."""
        return dict(self.processes)


class ScheduleRecord(Callback):
    """Stores the learning-rate schedule's length and warmup (:attr:`models.lit.LitLM.lr_schedule`:
    ``total``, ``warmup`` in its ``interval``'s units) in the run's checkpoints, as this callback's
    state, and notes when a resumed run recomputes that schedule over another length.

    A resumed run continues on its own schedule (``LitLM.on_train_start``: warmup, then the cosine
    decay over this run's ``trainer.max_steps``), which is legitimate (training on for longer) but
    changes the learning rate of every later step: a run stopped at step 40 of 400 and resumed with
    ``trainer.max_steps=60`` decays to its floor within 20 steps. So at the start of training a
    resumed run logs one note (train.py's logger, process 0) naming both lengths, the learning rate
    at the resume step under the checkpoint's schedule and under this run's, and where the decay now
    ends. A checkpoint written before the schedule was stored gets the note where the two rates at
    the resume step differ.
    """

    def __init__(self) -> None:
        self.module: L.LightningModule | None = None
        self.saved: dict[str, Any] | None = None  # the resumed checkpoint's schedule

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Note the module whose schedule the checkpoints store."""
        self.module = pl_module

    def state_dict(self) -> dict[str, Any]:
        """``{"total": int, "warmup": int, "interval": "step" | "epoch"}`` (empty, so not stored,
        before the optimizers are configured)."""
        return dict(getattr(self.module, "lr_schedule", None) or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the resumed checkpoint's schedule for :meth:`on_train_start`."""
        self.saved = dict(state_dict) if isinstance(state_dict, Mapping) else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Log the note of a resumed run whose schedule differs from the checkpoint's (before
        ``LitLM.on_train_start`` sets this run's rate: the optimizer still holds the checkpoint's)."""
        if trainer.ckpt_path is None or not trainer.is_global_zero:
            return
        note = schedule_note(trainer, getattr(pl_module, "lr_schedule", None) or {}, self.saved)
        if note is not None:
            logging.getLogger("mixerlab.train").info(note)


def schedule_note(
    trainer: L.Trainer, current: Mapping[str, Any], saved: Mapping[str, Any] | None
) -> str | None:
    """The note of :class:`ScheduleRecord` for a resumed run: ``current`` is this run's schedule
    (``LitLM.lr_schedule``), ``saved`` the checkpoint's (None: not stored). None when the two agree
    (or neither the schedule nor a rate to compare is known).

    Returns:
        e.g. ``"note: resumed at step 40, the learning-rate schedule (warmup, then cosine decay) is
        recomputed over this run's 60 steps (trainer.max_steps=60), not the checkpoint's 400: the lr
        at step 40 is 0.00246 (0.00246 on the checkpoint's schedule), and it reaches its floor 0.0003
        at step 60 (at step 400 before)"``.
    """
    scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
    scheds = [sched for sched in scheds if isinstance(sched, torch.optim.lr_scheduler.LambdaLR)]
    if not scheds or not current:
        return None
    sched = scheds[0]
    at = sched.last_epoch  # the steps (or epochs) the checkpoint's schedule has counted
    was = sched.optimizer.param_groups[0]["lr"]  # restored: the checkpoint's schedule's rate there
    now = sched.base_lrs[0] * sched.lr_lambdas[0](at)
    known = isinstance(saved, Mapping) and all(isinstance(saved.get(key), int) for key in ("total", "warmup"))
    if known:
        if (saved["total"], saved["warmup"]) == (current["total"], current["warmup"]):
            return None
    elif math.isclose(was, now, rel_tol=1e-9):
        return None
    unit = "epoch" if current["interval"] == "epoch" else "step"
    total = current["total"]
    if unit == "epoch":
        setting = f"trainer.max_epochs={trainer.max_epochs}"
    elif trainer.max_steps not in (None, -1) and trainer.max_steps == total:
        setting = f"trainer.max_steps={trainer.max_steps}"
    else:
        setting = f"from trainer.max_epochs={trainer.max_epochs}"
    last = sched.base_lrs[0] * sched.lr_lambdas[0](total)  # the floor, or the peak when all is warmup
    before = f", not the checkpoint's {saved['total']}" if known else ""
    end = f" ({unit} {saved['total']} before)" if known else ""
    if current["warmup"] >= total:
        # models.lit cuts the warmup to the run's length: a run no longer than optim.warmup_steps
        # only warms up, and its last rate is the peak, not the floor (a new-user check).
        ending = (
            f"it warms up over the whole run (optim.warmup_steps >= {total} {unit}s), to {last:.3g} at "
            f"{unit} {total}{end}, with no cosine decay"
        )
    else:
        ending = f"it reaches its floor {last:.3g} at {unit} {total}{end}"
        if known and saved["warmup"] != current["warmup"]:
            ending += f"; its warmup ends at {unit} {current['warmup']} ({unit} {saved['warmup']} before)"
    return (
        f"note: resumed at {unit} {at}, the learning-rate schedule (warmup, then cosine decay) is recomputed "
        f"over this run's {total} {unit}s ({setting}){before}: the lr at {unit} {at} is {now:.3g} ({was:.3g} "
        f"on the checkpoint's schedule), and {ending}"
    )


def refuse_another_world_size(checkpoint: Mapping[str, Any], resume: str, world_size: int) -> None:
    """Refuse to resume ``checkpoint`` (read from ``resume``, the path as given) on another number of
    processes than it was trained on, as its :class:`WorldSizeRecord` stores it.

    Under DDP each optimizer step averages the gradients of ``data.batch_size`` examples per
    process. The training stream (:mod:`data.resumable`) continues the same order of examples on
    any process count, but cuts it into steps of ``batch_size x processes`` examples (and drops
    another remainder at the end of each pass), so on another count the continued run would take
    other steps than the run it continues. A checkpoint written before the count was stored resumes
    on any.

    Raises:
        ValueError: another process count, naming both and the ``trainer.devices`` /
            ``trainer.num_nodes`` pair that gives the checkpoint's; or a corrupt record (an entry
            that is not a mapping, None included; a key missing; a count that is not an int or a
            numpy integer, a bool, None, below 1 or above :data:`MAX_PROCESSES`), naming the checkpoint.
    """
    given = pasteable(f"resume={override_value(resume)}")
    callbacks = checkpoint.get("callbacks", {})
    if WorldSizeRecord.__qualname__ not in callbacks:
        return
    record = callbacks[WorldSizeRecord.__qualname__]
    counts = [record.get(key) if isinstance(record, Mapping) else None for key in ("world_size", "num_nodes")]
    # A numpy integer (np.int64) is a count; a bool (Python's or numpy's) or a float is not.
    integers = all(isinstance(n, int | np.integer) and not isinstance(n, bool) for n in counts)
    if not (integers and all(1 <= n <= MAX_PROCESSES for n in counts)):
        raise ValueError(
            f"{given}: the checkpoint is corrupt (its {WorldSizeRecord.__qualname__} entry, the process "
            f"count it was trained on, is {record!r}, not the integers world_size and num_nodes, each from 1 "
            f"to {MAX_PROCESSES}); resume from an intact copy of it or from another checkpoint of the run"
        )
    saved, nodes = (int(n) for n in counts)
    if saved == world_size:
        return
    if saved % nodes:  # a count no real run stores (Lightning runs as many devices on every node)
        nodes = 1
    raise ValueError(
        f"{given} was trained on {saved} process(es), this run has {world_size}: each optimizer step "
        "trains on data.batch_size examples per process, so the continued run would take other steps "
        f"than the run it continues; resume with trainer.devices={saved // nodes} trainer.num_nodes={nodes}"
    )


def check_resume_world_size(resume: str | None, world_size: int) -> None:
    """:func:`refuse_another_world_size` for the checkpoint at ``resume`` (the path as given; None:
    a new run, nothing to check): for a run whose process count is known only once the Trainer has
    resolved ``trainer.devices`` (``auto``, ``-1``); :func:`check_resume` checks a count the config
    states.

    Raises:
        ValueError: as :func:`refuse_another_world_size`.
    """
    if resume is None:
        return
    # Memory-mapped: check_resume has read and checked the whole file; this reads its small entries.
    with numpy_scalars_loadable():
        checkpoint = torch.load(resume, map_location="cpu", weights_only=True, mmap=True)
    refuse_another_world_size(checkpoint, resume, world_size)

"""Train a language model whose mixer layers follow a layout: ``python train.py mixer=hybrid_jamba``.

Hydra composes the config (``conf/train.yaml`` and its groups), :func:`train` runs it under
Lightning: one run directory per run (also under DDP, whose launcher re-runs this command line
with the same ``hydra.run.dir``), checkpoints ``best.ckpt`` and ``last.ckpt`` written atomically,
W&B (offline by default) and CSV logs, optional early stopping (``early_stopping``: the arguments of
Lightning's ``EarlyStopping``), and result records of the final validation. A failed write (full
disk) is one line naming the file. The rest of a run is in :mod:`training`:

- :mod:`training.settings`: the checks of the config before training (one line, status 2).
- :mod:`training.resume`: ``resume=<ckpt>``, an earlier run continued in a new run directory.
- :mod:`training.signals`: Ctrl+C or SIGTERM during training stops gracefully and still saves
  ``last.ckpt`` and the records, marked ``interrupted`` (status 1; a DDP run stops at once).
- :mod:`training.sweep_stop`: a ``hydra/launcher=joblib`` sweep that stops (Ctrl+C, SIGTERM, a refused
  job) waits while its running jobs stop the same way; queued jobs do not start.
- :mod:`training.run_folders`: a run refused, or stopped by Ctrl+C before training (one line,
  status 130), removes what Hydra made for it and puts back the files of Hydra's it overwrote.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below (training/ too)

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from data.text import local_corpus_files
from eval.cli import INTERRUPTED, run_command_line, signal_handlers, user_errors
from eval.records import (
    check_wandb_login,
    git_sha,
    make_record,
    run_settings,
    training_settings,
    wandb_start_refused,
    write_records,
)
from models import LanguageModel, ModelConfig
from models.checkpoint import AtomicCheckpointIO, numpy_scalars_loadable
from models.config import config_from_groups
from models.lit import LitLM
from training import run_folders
from training.resume import (
    ScheduleRecord,
    WorldSizeRecord,
    absolute_paths,
    check_resume,
    check_resume_world_size,
)
from training.settings import (
    SETTING_HINTS,
    build_datamodule,
    check_early_stopping,
    check_learned_positions,
    check_monitor,
    check_run_dir,
    check_settings,
    check_val_batches,
    lightning_settings,
    name_mixer_settings,
    resolved_world_size,
    slice_lengths,
    trainer_settings_errors,
)
from training.signals import (
    StopDDPOnSigterm,
    defer_stop_signals,
    discard_unfinished_batch,
    sigterm_as_keyboard_interrupt,
)
from training.sweep_stop import (
    StopWhenSweepStops,
    graceful_joblib_sweeps,
    note_trained_nothing,
    stop_requested,
    trained_nothing_in_workers,
)

# Hydra writes its records to the console and to <run_dir>/train.log (conf/train.yaml).
log = logging.getLogger("mixerlab.train")


def no_validation_reason(val_check_interval: int | float) -> str:
    """Why a run that was not interrupted never validated: an int ``trainer.val_check_interval``
    counts batches, a float is a fraction of an epoch (1.0: at its end; a new-user check read "never
    reached a multiple of trainer.val_check_interval" for a run stopped by max_steps within its first
    epoch)."""
    if isinstance(val_check_interval, float):
        point = "the end" if val_check_interval == 1.0 else f"{val_check_interval!r}"
        return (
            f"it stopped before {point} of its first epoch, where trainer.val_check_interval="
            f"{val_check_interval!r} validates"
        )
    return f"its steps never reached a multiple of trainer.val_check_interval={val_check_interval}"


def interval_past_epoch(trainer_cfg: dict[str, Any], epoch_batches: int) -> str:
    """The settings error for an int ``trainer.val_check_interval`` (optimizer steps) longer than an
    epoch of ``epoch_batches`` training batches while ``trainer.check_val_every_n_epoch`` is set
    (Lightning then validates within each epoch, and refuses such an interval as fit starts)."""
    accumulate = trainer_cfg.get("accumulate_grad_batches") or 1
    steps = epoch_batches // accumulate
    return (
        f"trainer.val_check_interval={trainer_cfg.get('val_check_interval')} steps is longer than an epoch "
        f"({epoch_batches} training batches"
        + (f", {steps} steps of {accumulate} batches" if accumulate > 1 else "")
        + f") with trainer.check_val_every_n_epoch={trainer_cfg.get('check_val_every_n_epoch')}, which "
        f"validates within each epoch; give trainer.val_check_interval of at most {max(steps, 1)}, or "
        "trainer.check_val_every_n_epoch=null to count the steps across epochs"
    )


def batch_val_check_interval(trainer_cfg: dict[str, Any]) -> dict[str, Any]:
    """Lightning's Trainer arguments for ``trainer_cfg``, whose ``val_check_interval`` counts optimizer
    steps (``conf/trainer/cpu.yaml``): Lightning counts training batches, so a step count is multiplied
    by ``accumulate_grad_batches`` (a new-user check: ``val_check_interval=5`` with 2 batches a step
    validated every 2.5 steps, and ``max_steps=10`` left its last steps unvalidated)."""
    interval = trainer_cfg.get("val_check_interval")
    accumulate = trainer_cfg.get("accumulate_grad_batches") or 1
    if isinstance(interval, bool) or not isinstance(interval, int) or accumulate == 1:
        return trainer_cfg
    return {**trainer_cfg, "val_check_interval": interval * accumulate}


class NotedEarlyStopping(EarlyStopping):
    """Lightning's ``EarlyStopping`` that notes the step and the reason when it stops this run, for
    train.py's one line about it (Lightning says so only with ``verbose``, which also logs every
    improvement; ended by early stopping, a run otherwise finished before trainer.max_steps without a
    word). ``stopped_at``: (global step, Lightning's reason), or None while it has not stopped this run;
    its reason restored from a resumed checkpoint does not count."""

    stopped_at: tuple[int, str] | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._noted(trainer, super().on_validation_end, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._noted(trainer, super().on_train_epoch_end, pl_module)

    def _noted(self, trainer: L.Trainer, hook, pl_module: L.LightningModule) -> None:
        stopping = trainer.should_stop
        hook(trainer, pl_module)
        if trainer.should_stop and not stopping and self.stopping_reason_message:
            self.stopped_at = (trainer.global_step, self.stopping_reason_message)


class StepLearningRateMonitor(LearningRateMonitor):
    """Lightning's ``LearningRateMonitor(logging_interval="step")`` that logs once per optimizer step.

    Lightning's logs at the start of every training batch whose step is due, and with
    ``trainer.accumulate_grad_batches`` > 1 the batches of one step share it: the CSV log had one lr
    row per batch, the same step repeated (a new-user check). The learning rate cannot change between
    them (the scheduler steps with the optimizer), so the first batch of a step logs it.
    """

    def __init__(self) -> None:
        super().__init__(logging_interval="step")
        self._step_seen: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning's logs at
        if step != self._step_seen:
            self._step_seen = step
            super().on_train_batch_start(trainer, *args, **kwargs)


def build_meta_model(cfg: DictConfig, model_config: dict[str, Any]) -> LanguageModel:
    """The model of ``model_config`` on the meta device (no weights allocated), built so that the
    mixers check their settings' values (``pos_emb=ropee``, ``num_heads=0``) before anything runs.

    Raises:
        ValueError, TypeError: a mixer's refusal, with where the command line sets the settings it
            names (:func:`training.settings.name_mixer_settings`).
    """
    try:
        with torch.device("meta"):
            return LanguageModel(model_config)
    except (ValueError, TypeError) as err:
        raise type(err)(name_mixer_settings(str(err), cfg.mixer)) from err


def build_model_config(cfg: DictConfig, vocab_size: int) -> dict[str, Any]:
    """The plain-dict model config of a composed run config: model size + mixer layout and settings.

    Raises:
        ValueError: an unknown model key or an invalid combination
            (:func:`models.config.config_from_groups`).
    """
    model = OmegaConf.to_container(cfg.model, resolve=True)
    mixer = OmegaConf.to_container(cfg.mixer, resolve=True)
    return config_from_groups(model, mixer, vocab_size)


def _loggers(cfg: DictConfig, run_dir: Path, run_name: str) -> list:
    """The run's Lightning loggers (CSV, W&B) as ``cfg.logger`` enables them; W&B is left out, with a
    note, where wandb is not installed. An online W&B run is started here, before training, so that
    W&B's refusal (no API key, no connection) is one line (:func:`_start_wandb_run`).

    Raises:
        ValueError: W&B could not start an online run.
    """
    loggers = []
    if cfg.logger.csv.enabled:
        loggers.append(L.pytorch.loggers.CSVLogger(save_dir=str(run_dir), name="csv", version=""))
    if cfg.logger.wandb.enabled:
        try:
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(
                WandbLogger(
                    project=cfg.logger.wandb.project,
                    name=run_name,
                    save_dir=str(run_dir),
                    offline=cfg.logger.wandb.mode != "online",
                    # Named explicitly too: Lightning's `offline` only sets WANDB_MODE, which an
                    # earlier wandb.init in the same process (an evaluation's) has already read.
                    mode="online" if cfg.logger.wandb.mode == "online" else "offline",
                    tags=list(cfg.logger.wandb.tags),
                    config=OmegaConf.to_container(cfg, resolve=True),
                )
            )
        except ModuleNotFoundError:
            log.info("wandb is not installed: logging to CSV only (pip install wandb, or use logger=csv)")
        else:
            if cfg.logger.wandb.mode == "online":
                _start_wandb_run(loggers[-1])
    return loggers


def _start_wandb_run(logger: Any) -> None:
    """Start the W&B run of an online ``WandbLogger`` now (on the global rank 0; Lightning gives the
    other ranks a stand-in). Lightning would start it at fit, where W&B's refusal (no API key, W&B
    unreachable) came as a traceback.

    Raises:
        ValueError: :class:`eval.records.WandbStartRefused`, W&B's message with the fixes.
    """
    with wandb_start_refused("logger.wandb.mode"):
        logger.experiment  # noqa: B018 (the property starts the run)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train one model as ``cfg`` says and return its final metrics and checkpoint paths.

    Args:
        cfg: the composed config of ``conf/train.yaml`` (``run_dir`` must resolve: under
            ``@hydra.main`` it is Hydra's run directory, which :func:`main` checks; tests set it
            explicitly).

    Returns:
        ``{"run_dir", "best_ckpt", "last_ckpt", "metrics", "interrupted"}`` (paths as strings;
        metrics the validation of the best checkpoint: ``val/acc``, ``val/loss``, per-slice values;
        interrupted True when Ctrl+C or SIGTERM stopped training early).

    Raises:
        ValueError: invalid model, mixer or data settings, with the offending key named; a top-level
            setting conf/train.yaml does not define and nothing reads
            (:func:`eval.cli.check_known_settings`); a group of settings replaced by a value
            (``optim=5``); an int ``trainer.val_check_interval`` longer than an epoch while
            ``trainer.check_val_every_n_epoch`` is set, found as fit starts (:func:`interval_past_epoch`).
    """
    check_settings(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    earlier = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    if earlier:
        # An explicit hydra.run.dir may name an old run: its checkpoints, records and metrics would
        # be replaced. (DDP's launcher re-runs this command line with the run's directory before any
        # checkpoint exists.)
        in_sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
        folder = "hydra.run.dir"
        if in_sweep:
            folder = "hydra.sweep.dir (or a hydra.sweep.subdir that differs per job)"
        raise ValueError(
            f"the run directory {run_dir} already holds another run's checkpoints ({', '.join(earlier)}), "
            f"which this run would overwrite; give a new {folder}, "
            "or resume=<that run>/checkpoints/last.ckpt to continue it (in a new directory)"
        )
    run_name = f"{run_dir.name}"

    # The data (drawn from its own seeded generators, not the global random state) and this run's
    # settings come before the seeding, so that a refused resume is the first line the run prints
    # (not after Lightning's "Seed set to ...").
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    dm = build_datamodule(data_cfg, setup=True)
    model_config = build_model_config(cfg, dm.vocab_size)
    # The mixers check their settings' values as they are built (pos_emb=ropee, num_heads=0): built
    # once on the meta device (no weights allocated), a refusal comes before the seeding too.
    meta_model = build_meta_model(cfg, model_config)
    tokenizer = getattr(dm, "tokenizer", None)
    slice_names = list(getattr(dm, "slice_names", ["val"]))
    slice_seqlens = slice_lengths(dm, slice_names, int(data_cfg["seqlen"]))
    # Before the seeding too (a new-user check: it came after Lightning's "Seed set to 0").
    check_learned_positions(meta_model, max([int(data_cfg["seqlen"]), *slice_seqlens.values()]))
    check_early_stopping(cfg.get("early_stopping"), slice_names)
    check_monitor(data_cfg.get("monitor"), data_cfg.get("monitor_mode"), slice_names)
    hparams = {
        "model": model_config,
        "optim": OmegaConf.to_container(cfg.optim, resolve=True),
        "data": {**data_cfg, **({"path": absolute_paths(data_cfg["path"])} if data_cfg.get("path") else {})},
        "slice_names": slice_names,
        "tokenizer_config": tokenizer.to_config() if tokenizer is not None else None,
        "run_seed": cfg.seed,
        "corpus_sha256": getattr(dm, "corpus_sha256", None),
    }
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    # Resolved now (trainer.devices=auto, "2", ...), by Lightning's own connector, so that settings it
    # refuses (trainer.devices=0) and a resume on another process count are refused before the seeding
    # too; a new run compares no count.
    with trainer_settings_errors(trainer_cfg):
        world_size = resolved_world_size(trainer_cfg)
    check_val_batches(dm, trainer_cfg.get("limit_val_batches"), world_size)
    settings = run_settings(
        {"data": hparams["data"], "optim": hparams["optim"], "trainer": trainer_cfg, "seed": cfg.seed},
        model_config,
        world_size,
    )
    resume = check_resume(
        cfg.get("resume"),
        hparams,
        trainer_cfg.get("max_steps"),
        trainer_cfg.get("max_epochs"),
        trainer_cfg.get("max_time"),
        world_size if cfg.get("resume") is not None else None,
    )
    if cfg.logger.wandb.enabled and cfg.logger.wandb.mode == "online":
        # Before the seeding (a new-user check: W&B's refusal came after "Seed set to 0").
        check_wandb_login("logger.wandb.mode")
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    lit = LitLM(**hparams)

    # best.ckpt: the callback, on each validation that improves the monitor. last.ckpt: written
    # after fit (below), because Lightning's save_last only refreshes it together with a new best,
    # so it would hold the best weights rather than the final ones.
    checkpoint_cb = ModelCheckpoint(
        dirpath=str(run_dir / "checkpoints"),
        filename="best",
        monitor=data_cfg["monitor"],
        mode=data_cfg["monitor_mode"],
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
        # At the end of each validation, as Lightning does unless validation is once an epoch
        # (trainer.val_check_interval=1.0, check_val_every_n_epoch=1): it then saved at the end of the
        # training epoch instead, and at one that max_steps cut before its validation, warned that it
        # "could not find the monitored key", beside train.py's clearer "no validation ran" line.
        save_on_train_epoch_end=False,
    )
    loggers = _loggers(cfg, run_dir, run_name)
    callbacks = [checkpoint_cb, WorldSizeRecord(), ScheduleRecord(), StopDDPOnSigterm(), StopWhenSweepStops()]
    callbacks += [StepLearningRateMonitor()] if loggers else []
    stopper = None
    if cfg.get("early_stopping"):
        early_stopping = OmegaConf.to_container(cfg.early_stopping, resolve=True)
        # Not strict unless asked: the monitor was checked against the metrics this run logs
        # (check_early_stopping), and Lightning's strict check raised instead when a run
        # validating once an epoch stopped mid-epoch (max_steps, max_time) before its first
        # validation, with the metric not logged yet.
        early_stopping.setdefault("strict", False)
        stopper = NotedEarlyStopping(**early_stopping)
        callbacks.append(stopper)
    with trainer_settings_errors(trainer_cfg):
        trainer = L.Trainer(
            **batch_val_check_interval(trainer_cfg),
            default_root_dir=str(run_dir),
            logger=loggers or False,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
        )
    if resume is not None and trainer.world_size != world_size:
        # resolved_world_size runs the Trainer's own resolution, so the counts agree; should a
        # Lightning version resolve otherwise, the Trainer's count is the one the run trains on.
        check_resume_world_size(cfg.get("resume"), trainer.world_size)
    try:
        if trainer.is_global_zero:
            shared = model_config.get("shared_block")  # Zamba's block, which the layout does not list
            log.info(
                f"mixerlab: {model_config['name']} layout={ModelConfig.from_dict(model_config).layout} "
                + (f"shared_block={shared['mixer']} every {shared['every']} layers " if shared else "")
                + f"params={lit.model.num_params():,} data={data_cfg['name']} run_dir={run_dir}"
            )
        interrupted = False
        # numpy_scalars_loadable: fit loads resume= again (Lightning's restore), as check_resume read it.
        with sigterm_as_keyboard_interrupt(), numpy_scalars_loadable():
            try:
                trainer.fit(lit, datamodule=dm, ckpt_path=resume)
            except (ValueError, MisconfigurationException) as err:  # a ValueError in Lightning 2.6
                if lit.first_step is not None or not str(err).strip().startswith("`val_check_interval`"):
                    raise
                # Lightning checks the interval against an epoch's batches only here, as fit starts: a
                # new-user check got its message naming its own arguments (limit_val_batches=0, which
                # mixerlab refuses) and kept the folder with the loggers' first files.
                run_folders.TRAINED_NOTHING.add(run_dir)
                note_trained_nothing(run_dir)
                raise ValueError(interval_past_epoch(trainer_cfg, trainer.num_training_batches)) from err
            except SystemExit:
                # Lightning answers Ctrl+C (and SIGTERM, made one above) with a graceful shutdown,
                # then sys.exit(1). One process can still save and evaluate what it trained; DDP's
                # other ranks are gone, so a DDP run stops here.
                if not trainer.interrupted or trainer.world_size > 1:
                    raise
                if lit.first_step is None or trainer.global_step == lit.first_step:
                    # Nothing trained yet in this run (fresh, or resumed): saving and evaluating
                    # would leave records of an untrained model (or a copy of the resumed run's
                    # last.ckpt and records) for the report to pick up.
                    log.info("training interrupted before its first step: nothing saved")
                    # Nor its lines in train.log and its loggers' records: its folder is undone
                    # (run_folders.remove_unused_folders).
                    run_folders.TRAINED_NOTHING.add(run_dir)
                    note_trained_nothing(run_dir)  # for the sweep's own process, where this is a joblib job
                    # user_errors (main) reports it as Ctrl+C before training: one line, status 130.
                    raise KeyboardInterrupt("interrupted before the first optimizer step") from None
                interrupted = True
                discard_unfinished_batch(trainer)
                log.info(
                    f"training interrupted at step {trainer.global_step}: "
                    "saving and evaluating the best checkpoint"
                )
        if stopper is not None and stopper.stopped_at is not None and trainer.is_global_zero:
            step, reason = stopper.stopped_at
            reason = reason.removesuffix(" Signaling Trainer to stop.")
            log.info(f"early stopping ended training at step {step}: {reason}")
        # The final save and evaluation take seconds and are what an interrupted run exists to
        # keep: a Ctrl+C or SIGTERM now is noted and acted on after them.
        with defer_stop_signals(trainer):
            last = str(run_dir / "checkpoints" / "last.ckpt")
            # every rank calls it; rank 0 writes (atomically: AtomicCheckpointIO)
            trainer.save_checkpoint(last)
            last_finite = all(bool(torch.isfinite(p).all()) for p in lit.parameters())
            # Read the path now: validating from best.ckpt restores the callback's state saved in it.
            # A resumed run restores the earlier run's best_model_path; until one of this run's own
            # validations replaces it, this run has no best checkpoint of its own.
            own_best = checkpoint_cb.best_model_path
            if own_best and Path(own_best).resolve().parent != (run_dir / "checkpoints").resolve():
                own_best = ""
            # ModelCheckpoint names its new best before saving it: a Ctrl+C during that save (an
            # atomic write: all of it or nothing) leaves the name without the file.
            best_unsaved = bool(own_best) and not Path(own_best).is_file()
            if best_unsaved:
                own_best = ""
            best = own_best or last
            last_validated = lit.last_fit_validation_step
            trainer.validate(lit, datamodule=dm, ckpt_path=best or None, verbose=False)
            metrics = dict(lit.val_metrics)  # exact (float64) values of the best checkpoint
            if trainer.is_global_zero:
                _write_train_records(
                    run_dir, lit, data_cfg, settings, metrics, slice_seqlens, trainer.strategy.root_device,
                    interrupted,
                )  # fmt: skip
                if best_unsaved:
                    log.info(
                        "training was interrupted while best.ckpt was being saved, so it was not: the best "
                        "checkpoint is the last one"
                    )
                elif not own_best:
                    # The setting, in optimizer steps (Lightning's counts batches: batch_val_check_interval).
                    interval = trainer_cfg.get("val_check_interval") or trainer.val_check_interval
                    log.info(
                        "training was interrupted before its first validation: "
                        "the best checkpoint is the last one"
                        if interrupted
                        else "no validation ran during this run "
                        f"({no_validation_reason(interval)}): the best checkpoint is the "
                        "last one"
                    )
                elif last_validated is not None and trainer.global_step > last_validated:
                    advice = ""
                    if not interrupted:
                        advice = (
                            " (a trainer.max_steps that trainer.val_check_interval divides validates them)"
                        )
                    unvalidated = trainer.global_step - last_validated
                    steps = "step was" if unvalidated == 1 else f"{unvalidated} training steps were"
                    log.info(
                        f"the last {steps} not validated (after step {last_validated}, the last "
                        "validation): best.ckpt and the final "
                        f"validation are of step {last_validated} or earlier, "
                        f"last.ckpt holds the final weights{advice}"
                    )
                log.info(f"best checkpoint: {best}")
                log.info(f"last checkpoint: {last}")
                log.info("final validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
                diverged = [k for k, v in sorted(metrics.items()) if not math.isfinite(v)]
                if diverged or not last_finite:
                    # A NaN loss ends nothing in Lightning: the run would finish as if it had trained.
                    found = [f"{diverged[0]} is {metrics[diverged[0]]}"] if diverged else []
                    found += [] if last_finite else ["last.ckpt holds NaN or inf weights"]
                    log.warning(
                        f"training diverged ({'; '.join(found)}): evaluations and resume= refuse NaN "
                        "weights; train again with a lower optim.lr or with gradient clipping "
                        "(trainer.gradient_clip_val=1.0, the default)"
                    )
        return {
            "run_dir": str(run_dir),
            "best_ckpt": best,
            "last_ckpt": last,
            "metrics": metrics,
            "interrupted": interrupted,
        }
    finally:
        if cfg.logger.wandb.enabled:
            # Only a wandb that imported whole can hold a run: a Ctrl+C during Lightning's import of
            # it leaves a half-initialised module, which a second import would trip over.
            wandb = sys.modules.get("wandb")
            if getattr(wandb, "run", None) is not None:
                wandb.finish()


# The vocabulary check_sweep_job builds the model with: a text corpus's is known only once it is
# read, and it sizes only the embedding and the head, whose settings the mixers' checks do not read.
STAND_IN_VOCAB_SIZE = 256


def check_sweep_job(cfg: DictConfig) -> None:
    """What :func:`train` would refuse in a sweep's job before it draws or reads any data:
    :func:`training.settings.check_settings`, the data module's arguments, the model's settings (built
    on the meta device with :data:`STAND_IN_VOCAB_SIZE`), a learned position table long enough for the
    slices (:func:`training.settings.check_learned_positions`), the metrics ``early_stopping`` and
    ``data.monitor`` name (:func:`training.settings.check_early_stopping`,
    :func:`training.settings.check_monitor`), the text corpus's files
    (:func:`data.text.local_corpus_files`) and the process count Lightning resolves
    (:func:`training.settings.resolved_world_size`), so that ``-m optim.lr=1e-3,abc`` or
    ``mixer.settings.mamba.d_state=8,0`` is refused before the first job trains; and a ``run_dir``
    other than the job's Hydra folder (:func:`training.settings.check_run_dir`, which :func:`main`
    applies to every run).

    Raises:
        ValueError / TypeError / FileNotFoundError: as :func:`train` raises them.
    """
    run_dir = OmegaConf.to_container(cfg, resolve=False)["run_dir"]
    # The job's folder is known only when it starts: a run_dir that names it through ${hydra:...} (the
    # config's own, ${hydra:runtime.output_dir}) is left to main's check then.
    if "${" not in str(run_dir):
        check_run_dir(run_dir, "the job's folder in hydra.sweep.dir", sweep=True)
    check_settings(cfg)
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    dm = build_datamodule(data_cfg, setup=False)
    model = build_meta_model(cfg, build_model_config(cfg, STAND_IN_VOCAB_SIZE))
    # The slices' lengths come from the settings (a new-user check: a later job's learned position
    # table too short for them was refused only when that job started, after the first had trained).
    seqlen = int(data_cfg["seqlen"])
    slice_names = list(getattr(dm, "slice_names", ["val"]))
    slice_seqlens = slice_lengths(dm, slice_names, seqlen)
    check_learned_positions(model, max([seqlen, *slice_seqlens.values()]))
    # The metrics they name (a new-user check: -m +early_stopping.monitor=val/loss,val/accc refused its
    # second job after the first had trained).
    check_early_stopping(cfg.get("early_stopping"), slice_names)
    check_monitor(data_cfg.get("monitor"), data_cfg.get("monitor_mode"), slice_names)
    if data_cfg.get("path") is not None:  # a missing corpus was found only when its job started
        local_corpus_files(data_cfg["path"])
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    with trainer_settings_errors(trainer_cfg):  # trainer.devices=0, an accelerator this machine lacks
        resolved_world_size(trainer_cfg)


def _write_train_records(
    run_dir: Path,
    lit: LitLM,
    data_cfg: dict[str, Any],
    settings: dict[str, Any],
    metrics: dict[str, float],
    slice_seqlens: dict[str, int],
    device: torch.device,
    interrupted: bool = False,
) -> None:
    # ``device`` is the one trained on: Lightning's teardown has moved ``lit`` back to the CPU by now.
    sha = git_sha()
    first = lit.slice_names[0]

    def slice_of(metric: str) -> str:
        # per-slice metrics end in their slice name (val/acc_T128_kv8, val/loss_T1024); the
        # aggregates (val/acc, val/loss, val/ppl) are the first slice's
        name = metric.rpartition("/")[2].partition("_")[2]
        return name if name in slice_seqlens else first

    records = [
        make_record(
            run=run_dir.name,
            model=lit.model,
            task=data_cfg["name"],
            metric=name,
            value=value,
            seqlen=slice_seqlens[slice_of(name)],
            device=device,
            sha=sha,
            split="val",
            slice=slice_of(name),
            train_tokens=int(lit.tokens_seen),  # tokens the validated (best) checkpoint was trained on
            # so a sweep can report its best run over learning rates per width (eval/report.py)
            **training_settings(lit, data_cfg),
            settings=settings,  # all but lr (eval.records.run_settings): what tells two groups apart
            **({"interrupted": True} if interrupted else {}),
        )
        for name, value in sorted(metrics.items())
    ]
    write_records(run_dir / "results" / "train.json", records)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    """Command-line entry point: compose with Hydra, then :func:`train`; a failed write (full disk)
    is one line naming the file (:func:`eval.cli.user_errors`). A ``run_dir`` other than Hydra's run
    directory is refused (:func:`training.settings.check_run_dir`). A run refused by a settings error,
    or stopped by Ctrl+C before training, exits with status 2 or 130, after which
    :func:`run_from_command_line` undoes what Hydra wrote for it."""
    torch.set_flush_denormal(True)
    os.environ.setdefault("WANDB_SILENT", "true")
    hydra_cfg = HydraConfig.get()
    if run_folders.JOBS_RUN_HERE is not None:
        run_folders.JOBS_RUN_HERE.append(Path(hydra_cfg.runtime.output_dir).resolve())
    with user_errors(retry="hydra.run.dir=<another folder>"):
        if stop_requested():  # a joblib sweep stopped before this job started (training.sweep_stop)
            # Not user_errors' "interrupted: kept ...": that would list the files of the jobs this
            # worker process ran before.
            print(f"not started: the sweep was stopped ({hydra_cfg.runtime.output_dir})", file=sys.stderr)
            raise SystemExit(INTERRUPTED)
        check_run_dir(cfg.run_dir, hydra_cfg.runtime.output_dir, hydra_cfg.mode == RunMode.MULTIRUN)
        result = train(cfg)
    if result["interrupted"]:
        raise SystemExit(1)


def run_from_command_line() -> None:
    """``python train.py ...``: the command line's checks and :func:`main` in one
    :func:`eval.cli.user_errors` block (:func:`eval.cli.run_command_line`), and after a run or sweep
    refused by a settings error or stopped by Ctrl+C or SIGTERM before training (status 2 or 130),
    :func:`training.run_folders.remove_unused_folders` in this, the process that recorded the folders
    (a joblib sweep's jobs run in other processes, and a refused one ends the sweep): removed are what
    Hydra made for it, its run directory and the empty folders made with it, such as a new outputs/,
    or a refused sweep's new folders; Hydra's files in a folder that was there before are put back as
    they were; nothing else of such a folder is touched.

    Raises:
        SystemExit: :func:`main`'s (Hydra's) exit.
    """
    with graceful_joblib_sweeps():
        try:
            # One user_errors block from the command line's checks to Hydra's exit (run_command_line): a
            # Ctrl+C or SIGTERM (kill, timeout, a scheduler) before training, Hydra's composition
            # included, ends the run in one line, status 130, Hydra's folder undone; training and its
            # final evaluation handle them their own way inside.
            run_command_line(
                main, "train", hints=SETTING_HINTS, settings=lightning_settings(), check_job=check_sweep_job
            )
        except SystemExit as exc:
            if exc.code in (2, INTERRUPTED):
                # Not stopped half-way by a second Ctrl+C or a SIGTERM: it writes an earlier run's
                # records back.
                with signal_handlers((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN):
                    try:
                        run_folders.TRAINED_NOTHING.update(trained_nothing_in_workers())
                        run_folders.remove_unused_folders(
                            run_folders.RUN_FOLDERS_BEFORE, run_folders.JOBS_RUN_HERE
                        )
                    except OSError as err:  # the refusal above stays the run's one line of output
                        message = f"warning: could not undo what Hydra wrote for this run: {err}"
                        print(message, file=sys.stderr)
            raise


if __name__ == "__main__":
    run_from_command_line()

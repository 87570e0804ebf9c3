"""Train a language model whose mixer layers follow a layout: ``python train.py mixer=hybrid_jamba``.

Hydra composes the config (``conf/train.yaml`` and its groups), :func:`train` runs it under
Lightning: one run directory per run (also under DDP, whose launcher re-runs this command line
with the same ``hydra.run.dir``), checkpoints ``best.ckpt`` and ``last.ckpt`` written atomically,
W&B (offline by default) and CSV logs, optional early stopping (``early_stopping``: the arguments of
Lightning's ``EarlyStopping``), and result records of the final validation. ``resume=<ckpt>``
continues an earlier run (weights, optimizer, schedule, step and token counts, and the training
data order from the next batch) in a new run directory, e.g. a long run cut by ``trainer.max_time``
into several sessions. A run stopped by
Ctrl+C or SIGTERM (``kill``, ``timeout``, a scheduler) shuts down as Lightning does for Ctrl+C,
then still saves ``last.ckpt`` and writes the records of its best checkpoint, marked
``interrupted``, and exits with status 1 (single-process runs; a DDP run stops at once, see
:class:`training.signals.StopDDPOnSigterm`). Ctrl+C before
training (while the modules import, the config is composed or the data prepared) ends it with one
line and status 130; such a run, and one refused by a settings error, removes what Hydra made for
it (its run directory, when that holds only Hydra's files), never a folder that was there before,
and puts back the files of Hydra's it overwrote there (an earlier run's ``.hydra/``); a failed write
(full disk) is one line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import logging
import math
import os
import shutil
import signal
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from eval.startup import end_quiet_sigterm, quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below (training/ too)

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eval.cli import INTERRUPTED, check_command_line, override_value, pasteable, signal_handlers, user_errors
from eval.records import (
    git_sha,
    make_record,
    run_settings,
    training_settings,
    wandb_start_refused,
    write_records,
)
from models import LanguageModel, ModelConfig
from models.checkpoint import AtomicCheckpointIO, atomic_write_bytes, numpy_scalars_loadable
from models.config import config_from_groups
from models.lit import LitLM
from training.resume import WorldSizeRecord, absolute_paths, check_resume, check_resume_world_size
from training.settings import (
    SETTING_HINTS,
    build_datamodule,
    check_early_stopping,
    check_learned_positions,
    check_monitor,
    check_settings,
    check_val_batches,
    lightning_settings,
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

# Hydra writes its records to the console and to <run_dir>/train.log (conf/train.yaml).
log = logging.getLogger("mixerlab.train")


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
            ``@hydra.main`` it is Hydra's run directory; tests set it explicitly).

    Returns:
        ``{"run_dir", "best_ckpt", "last_ckpt", "metrics", "interrupted"}`` (paths as strings;
        metrics the validation of the best checkpoint: ``val/acc``, ``val/loss``, per-slice values;
        interrupted True when Ctrl+C or SIGTERM stopped training early).

    Raises:
        ValueError: invalid model, mixer or data settings, with the offending key named; a top-level
            setting conf/train.yaml does not define and nothing reads
            (:func:`eval.cli.check_known_settings`); a group of settings replaced by a value
            (``optim=5``).
    """
    check_settings(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    earlier = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    if earlier:
        # An explicit hydra.run.dir may name an old run: its checkpoints, records and metrics would
        # be replaced. (DDP's launcher re-runs this command line with the run's directory before any
        # checkpoint exists.)
        raise ValueError(
            f"the run directory {run_dir} already holds another run's checkpoints ({', '.join(earlier)}), "
            "which this run would overwrite; give a new hydra.run.dir, or resume=<that run>/checkpoints/"
            "last.ckpt to continue it (in a new directory)"
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
    with torch.device("meta"):
        LanguageModel(model_config)
    tokenizer = getattr(dm, "tokenizer", None)
    slice_names = list(getattr(dm, "slice_names", ["val"]))
    slice_seqlens = slice_lengths(dm, slice_names, int(data_cfg["seqlen"]))
    check_early_stopping(cfg.get("early_stopping"), slice_names)
    check_monitor(data_cfg.get("monitor"), data_cfg.get("monitor_mode"), slice_names)
    hparams = {
        "model": model_config,
        "optim": OmegaConf.to_container(cfg.optim, resolve=True),
        "data": {**data_cfg, **({"path": absolute_paths(data_cfg["path"])} if data_cfg.get("path") else {})},
        "slice_names": slice_names,
        "tokenizer_config": tokenizer.to_config() if tokenizer is not None else None,
        "run_seed": cfg.seed,
    }
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    # Resolved now (trainer.devices=auto, "2", ...), by Lightning's own connector, so that settings it
    # refuses (trainer.devices=0) and a resume on another process count are refused before the seeding
    # too; a new run compares no count.
    with trainer_settings_errors():
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
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    lit = LitLM(**hparams)
    check_learned_positions(lit.model, max([int(data_cfg["seqlen"]), *slice_seqlens.values()]))

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
    )
    loggers = _loggers(cfg, run_dir, run_name)
    callbacks = [checkpoint_cb, WorldSizeRecord(), StopDDPOnSigterm()]
    callbacks += [LearningRateMonitor(logging_interval="step")] if loggers else []
    if cfg.get("early_stopping"):
        early_stopping = OmegaConf.to_container(cfg.early_stopping, resolve=True)
        # Not strict unless asked: the monitor was checked against the metrics this run logs
        # (check_early_stopping), and Lightning's strict check raised instead when a run
        # validating once an epoch stopped mid-epoch (max_steps, max_time) before its first
        # validation, with the metric not logged yet.
        early_stopping.setdefault("strict", False)
        callbacks.append(EarlyStopping(**early_stopping))
    with trainer_settings_errors():
        trainer = L.Trainer(
            **trainer_cfg,
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
                    # user_errors (main) reports it as Ctrl+C before training: one line, status 130.
                    raise KeyboardInterrupt("interrupted before the first optimizer step") from None
                interrupted = True
                discard_unfinished_batch(trainer)
                log.info(
                    f"training interrupted at step {trainer.global_step}: saving and evaluating the best checkpoint"
                )
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
                    log.info(
                        "training was interrupted before its first validation: the best checkpoint is the last one"
                        if interrupted
                        else "no validation ran during this run (its steps never reached a multiple of "
                        "trainer.val_check_interval): the best checkpoint is the last one"
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
                        f"validation are of step {last_validated} or earlier, last.ckpt holds the final weights{advice}"
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
    on the meta device with :data:`STAND_IN_VOCAB_SIZE`) and the process count Lightning resolves
    (:func:`training.settings.resolved_world_size`), so that ``-m optim.lr=1e-3,abc`` or
    ``mixer.settings.mamba.d_state=8,0`` is refused before the first job trains.

    Raises:
        ValueError / TypeError: as :func:`train` raises them.
    """
    check_settings(cfg)
    build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), setup=False)
    with torch.device("meta"):
        LanguageModel(build_model_config(cfg, STAND_IN_VOCAB_SIZE))
    with trainer_settings_errors():  # trainer.devices=0, an accelerator this machine lacks
        resolved_world_size(OmegaConf.to_container(cfg.trainer, resolve=True))


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


# What Hydra writes before the task runs: into the run directory (its config records in .hydra/, and
# train.log, which its log handler opens to append to), and into a sweep's directory (-m).
HYDRA_RUN_FILES = (".hydra", "train.log")
HYDRA_SWEEP_FILES = ("multirun.yaml",)
HYDRA_CONFIG_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "multirun.yaml")


@dataclasses.dataclass(frozen=True)
class FolderBefore:
    """What one folder that Hydra writes its files into held before a run: ``names``, its entries;
    ``configs``, the bytes and permission bits of Hydra's config files in it
    (:data:`HYDRA_CONFIG_FILES`, relative paths; a few kB each); ``log_size``, the size of its
    ``train.log`` (None: there was none)."""

    names: frozenset[str]
    configs: Mapping[str, tuple[bytes, int]]
    log_size: int | None

    @classmethod
    def of(cls, folder: Path) -> FolderBefore:
        """The record of ``folder`` (an existing folder) now.

        Raises:
            OSError: ``folder`` or one of Hydra's files in it cannot be read.
        """
        configs = {
            rel: ((folder / rel).read_bytes(), stat.S_IMODE((folder / rel).stat().st_mode))
            for rel in HYDRA_CONFIG_FILES
            if (folder / rel).is_file()
        }
        log = folder / "train.log"
        return cls(frozenset(os.listdir(folder)), configs, log.stat().st_size if log.is_file() else None)

    def unchanged(self, folder: Path) -> bool:
        """Whether ``folder`` holds the same entries, Hydra config files and ``train.log`` size as then."""
        return FolderBefore.of(folder) == self


@dataclasses.dataclass(frozen=True)
class FoldersBefore:
    """What existed of a folder's path before Hydra made the folder: ``deepest``, its deepest folder
    that existed (the folder itself when it existed), and ``entries``, the names in ``deepest`` then.
    Whatever lies below ``deepest`` under another name was made after, by the run.

    ``folder`` is the folder recorded: a run directory (``job_depth`` None), or a sweep directory
    whose jobs' run directories lie ``job_depth`` folders below it. ``known`` holds what the folder
    held, and for a sweep what each folder down to its jobs' held (:class:`FolderBefore`), where it
    existed: what a refused run restores of Hydra's files (:func:`remove_unused_run_dir`)."""

    deepest: Path
    entries: frozenset[str]
    folder: Path | None = None
    job_depth: int | None = None
    known: Mapping[Path, FolderBefore] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, folder: str | os.PathLike, job_depth: int | None = None) -> FoldersBefore:
        """The record of ``folder`` (relative to the working directory) now; of a sweep directory
        with ``job_depth`` (1 for Hydra's default ``hydra.sweep.subdir``, a folder per job).

        Raises:
            OSError: ``deepest`` or a folder below it, or one of Hydra's files there, cannot be read.
        """
        folder = Path(folder).resolve()
        deepest = next(p for p in (folder, *folder.parents) if p.is_dir())
        known: dict[Path, FolderBefore] = {}
        level = [folder] if deepest == folder else []
        for depth in range(job_depth or 0, -1, -1):
            for path in level:
                known[path] = FolderBefore.of(path)
            if depth:
                level = [p / name for p in level for name in sorted(known[p].names) if (p / name).is_dir()]
        return cls(deepest, frozenset(os.listdir(deepest)), folder, job_depth, known)

    def made_after(self, path: Path) -> bool:
        """Whether ``path`` (absolute, symbolic links resolved) was not there when the record was taken."""
        return (
            path != self.deepest
            and path.is_relative_to(self.deepest)
            and path.relative_to(self.deepest).parts[0] not in self.entries
        )


def remove_unused_run_dir(run_dir: Path, before: FoldersBefore | None, sweep_dir: Path | None = None) -> bool:
    """Undo what a run wrote when it wrote nothing but what Hydra writes before the task runs
    (``.hydra/`` and ``train.log``, which such a run leaves as it found it): a run refused by a
    settings error would otherwise leave one such folder per attempt under outputs/, or Hydra's
    records of its refused settings in the run directory of an earlier run it was pointed at
    (``hydra.run.dir=<that run>``), over that run's own. A run that wrote anything else, or
    appended to ``train.log``, keeps its run directory as it is.

    ``before`` (taken of ``run_dir``, or of ``sweep_dir`` for a job of ``-m``, before Hydra made it;
    None: unknown, nothing is touched) says what the run made. Hydra's files that were there before
    (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) are written back as they were
    (atomically), those that were not are removed, then ``run_dir`` and each folder above it while
    the run made it and it is left empty (Hydra makes the missing parents, such as a new outputs/ and
    its date folder). A folder that was there before stays, empty or not, with its other files
    untouched; so does a run directory below a folder that existed but that ``before`` does not
    describe (a sweep's job folder deeper than ``before.job_depth``). Under ``sweep_dir``, the
    sweep's ``multirun.yaml`` is then undone too (removed, with the sweep's folders made for it,
    or written back as it was) where the sweep holds nothing else of its own: no other job's run
    directory, and each folder that existed as it was.

    Returns:
        Whether ``run_dir`` was removed.

    Raises:
        OSError: a file or folder that cannot be read, written or removed (``WriteError`` for a
            config file that cannot be written back).
    """
    run_dir = run_dir.resolve()
    if before is None or not run_dir.is_dir():
        return False
    sweep_dir = sweep_dir.resolve() if sweep_dir is not None else None
    _undo_unused_run_dir(run_dir, before, sweep_dir)
    if sweep_dir is not None and sweep_dir.is_dir():
        _restore_unused_sweep_dir(sweep_dir, before)
    return not run_dir.exists()


def _undo_unused_run_dir(run_dir: Path, before: FoldersBefore, sweep_dir: Path | None) -> None:
    """:func:`remove_unused_run_dir` for ``run_dir`` (absolute, resolved; an existing folder) alone:
    the folders it removes stop below ``sweep_dir``."""
    was = before.known.get(run_dir)
    if was is None and not before.made_after(run_dir):
        return  # what it held before is unknown
    names = was.names if was is not None else frozenset()
    log = run_dir / "train.log"
    if log.is_file() and log.stat().st_size > ((was.log_size or 0) if was is not None else 0):
        return  # the run logged: it started
    if set(os.listdir(run_dir)) - names - set(HYDRA_RUN_FILES):
        return  # the run wrote more than Hydra's files
    _restore_hydra_files(run_dir, was, HYDRA_RUN_FILES)
    _remove_folders_made(run_dir, before, stop=sweep_dir)


def _restore_hydra_files(folder: Path, was: FolderBefore | None, names: Sequence[str]) -> None:
    """Put Hydra's files ``names`` (of :data:`HYDRA_RUN_FILES` / :data:`HYDRA_SWEEP_FILES`) in
    ``folder`` back as ``was`` records them: config files written back where they differ, the
    others removed, and a ``.hydra/`` or ``train.log`` that was not there removed (``train.log`` is
    only appended to, and the caller has checked it did not grow). A config file is replaced
    atomically with its permission bits, unless it is a symbolic link or has other hard links: Hydra
    wrote through those into the file they share, so the old bytes go back into that file."""
    configs = was.configs if was is not None else {}
    for rel in HYDRA_CONFIG_FILES:
        path = folder / rel
        if Path(rel).parts[0] not in names or not path.is_file():
            continue
        if rel not in configs:
            path.unlink()
            continue
        data, mode = configs[rel]
        if path.read_bytes() == data:
            continue
        if path.is_symlink() or path.stat().st_nlink > 1:
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
        else:
            atomic_write_bytes(path, lambda f, data=data: f.write(data))
            os.chmod(path, mode)
    existed = was.names if was is not None else frozenset()
    for name in set(names) - existed:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _remove_folders_made(folder: Path, before: FoldersBefore, stop: Path | None = None) -> None:
    """Remove ``folder`` and each folder above it (below ``stop``) while the run made it and it is
    empty; the first one that was there before, holds something, or is ``stop`` ends it."""
    while folder != stop and before.made_after(folder):
        try:
            folder.rmdir()
        except OSError:  # not empty: another job of the sweep has written into it since
            return
        folder = folder.parent


def _restore_unused_sweep_dir(sweep_dir: Path, before: FoldersBefore) -> None:
    """Undo the sweep's ``multirun.yaml`` (removed, or written back as it was) and remove the folders
    made for the sweep, when ``sweep_dir`` holds nothing else that the sweep made: each entry was
    there before or is ``multirun.yaml``, and each folder recorded below it is as it was."""
    was = before.known.get(sweep_dir)
    if was is None and not before.made_after(sweep_dir):
        return  # what it held before is unknown
    names = was.names if was is not None else frozenset()
    if set(os.listdir(sweep_dir)) - names - set(HYDRA_SWEEP_FILES):
        return
    below = [path for path in before.known if path != sweep_dir and path.is_dir()]
    if not all(before.known[path].unchanged(path) for path in below):
        return  # another job of the sweep ran in a folder that was there before
    _restore_hydra_files(sweep_dir, was, HYDRA_SWEEP_FILES)
    _remove_folders_made(sweep_dir, before)


def remove_unused_folders(before: FoldersBefore | None, jobs: Sequence[Path] | None = None) -> None:
    """After a run or ``-m`` sweep that ended with a settings error or Ctrl+C before training, in the
    process that took ``before`` (:class:`RecordRunFolders`): undo what it wrote in each run
    directory that it used for nothing else (:func:`remove_unused_run_dir`), and then in the sweep
    directory. Under ``-m`` these are the run directories of all the sweep's jobs, ``before.job_depth``
    folders below the sweep directory: with ``hydra/launcher=joblib`` a refused job stops the sweep,
    and joblib kills the jobs still running, some before they reached their own checks. None (no
    record): nothing is touched. ``jobs``, where known (the run directories of the jobs that ran in
    this process: Hydra's basic launcher), limits the jobs' folders to those, so that another
    sweep writing into the same sweep directory at the same time keeps its jobs' records.

    Raises:
        OSError: as :func:`remove_unused_run_dir`.
    """
    if before is None or before.folder is None:
        return
    if before.job_depth is None:
        remove_unused_run_dir(before.folder, before)
        return
    if not before.folder.is_dir():
        return
    for job in sorted(before.folder.glob("/".join(["*"] * before.job_depth))) if jobs is None else jobs:
        if job.is_dir() and job.resolve() == job:  # not through a symbolic link: the sweep's own
            _undo_unused_run_dir(job, before, before.folder)
    _restore_unused_sweep_dir(before.folder, before)


class RecordRunFolders(HydraCallback):
    """Hydra callback (``hydra.callbacks`` of ``conf/train.yaml``): takes :data:`RUN_FOLDERS_BEFORE`,
    what existed of the run directory (of the sweep directory and its jobs' folders under ``-m``)
    before Hydra makes it and writes its files there, so that a refused run removes only what it
    made and puts back what Hydra overwrote (:func:`remove_unused_folders`). Hydra calls these hooks
    in the process that runs Hydra, before it makes the directory (``on_job_start`` comes only after
    it has written ``.hydra/``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a ``hydra.run.dir`` Hydra cannot make or write its records into
        (:func:`check_hydra_folder`); record it."""
        with _refused_in_one_line():
            check_hydra_folder(config.hydra.run.dir, "hydra.run.dir", config.hydra.output_subdir)
        _record_folders_before(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a ``hydra.sweep.dir`` Hydra cannot make (:func:`check_hydra_folder`) and a
        ``hydra.sweep.subdir`` that leads outside it (:func:`check_sweep_subdir`); record
        ``hydra.sweep.dir`` and its folders down to its jobs' run directories, as deep as
        ``hydra.sweep.subdir`` has parts (resolved only per job: its ``/`` as written are counted)."""
        global JOBS_RUN_HERE
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        with _refused_in_one_line():
            check_hydra_folder(config.hydra.sweep.dir, "hydra.sweep.dir")
            check_sweep_subdir(config.hydra.sweep.dir, subdir)
            resolved = sweep_subdir_known_now(config, subdir)
            if resolved is not None:
                check_sweep_subdir(config.hydra.sweep.dir, resolved, written=subdir)
        _record_folders_before(config.hydra.sweep.dir, max(1, len(Path(str(subdir or "")).parts)))
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
        JOBS_RUN_HERE = [] if launcher.endswith(".BasicLauncher") else None


def _link_loops(path: Path) -> bool:
    """Whether following the symbolic link ``path`` runs into a loop of links (``ln -s a a``, a -> b
    -> a, or a -> b -> c -> b; the OS's limit on links followed, 40 on Linux, counts as one)."""
    try:
        path.resolve(strict=True)
    except RuntimeError:  # how Python < 3.13 reports a loop
        return True
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def check_hydra_folder(folder: str, option: str, output_subdir: str | None = None) -> None:
    """Refuse, before Hydra makes ``folder`` (``option``: ``hydra.run.dir`` or ``hydra.sweep.dir``)
    and writes its records there, what Hydra fails on in a traceback (``FileExistsError``): a
    symbolic link to a missing folder (or a loop of links) as ``folder``, as one above it or as
    ``output_subdir`` in it (``hydra.output_subdir``, ``.hydra``: the run's settings), or a file of
    that name in it; and a path holding a literal ``${`` (Hydra's ``InterpolationKeyError``
    traceback: it names the run's log file by interpolating the folder's path again). Nothing is
    touched: the link or file is the user's.

    Raises:
        ValueError: naming the link and its missing target (or its loop), the file, or the ``${``,
            and the fixes.
    """
    given = pasteable(f"{option}={override_value(folder)}")
    if "${" in folder:
        raise ValueError(
            f"{given}: the path holds '${{', which Hydra reads as an interpolation where it names the run's "
            "log file (hydra.job_logging); use a folder whose path has no '${'"
        )
    path = Path(folder).absolute()
    records = [path / output_subdir] if output_subdir is not None else []
    for entry in [*reversed(path.parents), path, *records]:
        if entry.is_symlink() and not entry.exists():
            target = Path(os.path.normpath(entry.parent / os.readlink(entry)))
            if _link_loops(entry):
                raise ValueError(
                    f"{given}: {entry} is a symbolic link to {target}, and following it runs into a loop "
                    f"of symbolic links (never a folder); remove the loop, or pass {option}=<another folder>"
                )
            raise ValueError(
                f"{given}: {entry} is a symbolic link to {target}, which does not exist; make "
                f"that folder or remove the link, or pass {option}=<another folder>"
            )
    if records and records[0].exists() and not records[0].is_dir():
        raise ValueError(
            f"{given}: {records[0]} is a file, not a folder; Hydra writes the run's settings "
            f"into a folder of that name (hydra.output_subdir): move the file away or pass "
            f"{option}=<another folder>"
        )


def sweep_subdir_known_now(config: DictConfig, subdir: str | None) -> str | None:
    """``hydra.sweep.subdir`` resolved when it depends on nothing that only a job knows (no
    ``hydra.job.*``): an environment variable (``${oc.env:X}``), ``${hydra:runtime.cwd}``, the base
    config's values (which a sweep's overrides may change per job: those are not seen here). None
    when it has no interpolation, names job values, or does not resolve yet."""
    if subdir is None or "${" not in subdir or "hydra.job" in subdir or "hydra:job" in subdir:
        return None
    if not HydraConfig.initialized():  # ${hydra:...} reads it; Hydra sets it again for every job
        HydraConfig.instance().set_config(config)
    try:
        return str(OmegaConf.select(config, "hydra.sweep.subdir", throw_on_resolution_failure=True))
    except OmegaConfBaseException:
        return None


def check_sweep_subdir(sweep_dir: str, subdir: str | None, written: str | None = None) -> None:
    """Refuse a ``hydra.sweep.subdir`` (as written: its interpolations are resolved only per job)
    that does not lead to a folder inside ``hydra.sweep.dir``: an absolute path, one with a ``..``
    part, one that is the sweep folder itself (``.``), or one through a symbolic link (among its
    parts before the first interpolation) to a folder outside it.

    Why refused rather than cleaned up after: a refused sweep undoes what Hydra wrote by its record
    of the sweep folder (:class:`FoldersBefore`), which covers the folders inside it only. A job
    folder elsewhere (the working directory for ``..``, an earlier run's folder) would keep the
    refused sweep's ``.hydra/`` over the records there, and a folder it made there would stay; a
    job folder that is the sweep folder shares it with ``multirun.yaml``, and the clean-up tells
    neither apart from the other. (With ``.``, ``..`` or an absolute path without interpolation,
    every job of the sweep would also train into one folder.)

    ``written``: the subdir as given when ``subdir`` is its resolved value
    (:func:`sweep_subdir_known_now`); the message then names both.

    Raises:
        ValueError: naming the subdir, the sweep folder and the fix (a symbolic link with its target).
    """
    if subdir is None:  # Hydra names the jobs' folder "None"
        return
    sweep = Path(sweep_dir)
    parts = Path(subdir).parts
    named = f"hydra.sweep.subdir={written or subdir}" + ("" if written is None else f" (= {subdir})")
    where = f"{named} leads outside hydra.sweep.dir={sweep_dir}"
    fix = "use a relative path inside it (without hydra.sweep.subdir: the default, a folder per job)"
    if Path(subdir).is_absolute() or ".." in parts:
        raise ValueError(f"{where}; {fix}")
    if not parts:
        raise ValueError(
            f"{named} leads to hydra.sweep.dir={sweep_dir} itself, not to a folder "
            f"inside it; {fix}"
        )
    folder = sweep
    for part in itertools.takewhile(lambda part: "${" not in part, parts):
        folder = folder / part
        if folder.is_symlink() and not folder.resolve().is_relative_to(sweep.resolve()):
            raise ValueError(f"{where}: {folder} is a symbolic link to {os.readlink(folder)}; {fix}")


@contextlib.contextmanager
def _refused_in_one_line() -> Iterator[None]:
    """A ValueError of the block as one line on stderr and exit status 2 (``HYDRA_FULL_ERROR=1``: raised
    as it is), as :class:`eval.cli.OutputDirCheck` refuses a folder: in a Hydra callback, before the
    run's own :func:`eval.cli.user_errors`. Nothing has been recorded yet, so nothing is undone."""
    try:
        yield
    except ValueError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _record_folders_before(folder: str, job_depth: int | None = None) -> None:
    """Set :data:`RUN_FOLDERS_BEFORE` to the record of ``folder`` (None where it cannot be taken)."""
    global RUN_FOLDERS_BEFORE
    try:
        RUN_FOLDERS_BEFORE = FoldersBefore.of(folder, job_depth)
    except OSError:  # a folder that cannot be listed: what the run makes there stays
        RUN_FOLDERS_BEFORE = None


# What existed of this process' run (or sweep) directory before Hydra made it (RecordRunFolders).
RUN_FOLDERS_BEFORE: FoldersBefore | None = None
# The run directories of the sweep's jobs that ran in this process, in order (main() adds each):
# Hydra's basic launcher; None for a single run, or where the jobs run in other processes (joblib).
JOBS_RUN_HERE: list[Path] | None = None


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    """Command-line entry point: compose with Hydra, then :func:`train`; a failed write (full disk)
    is one line naming the file (:func:`eval.cli.user_errors`). A run refused by a settings error,
    or stopped by Ctrl+C before training, exits with status 2 or 130, after which
    :func:`run_from_command_line` undoes what Hydra wrote for it."""
    torch.set_flush_denormal(True)
    os.environ.setdefault("WANDB_SILENT", "true")
    if JOBS_RUN_HERE is not None:
        JOBS_RUN_HERE.append(Path(HydraConfig.get().runtime.output_dir).resolve())
    with user_errors(retry="hydra.run.dir=<another folder>"):
        result = train(cfg)
    if result["interrupted"]:
        raise SystemExit(1)


def run_from_command_line() -> None:
    """``python train.py ...``: :func:`main`, and after a run or sweep refused by a settings error or
    stopped by Ctrl+C or SIGTERM before training (status 2 or 130), :func:`remove_unused_folders` in this, the
    process that recorded the folders (a joblib sweep's jobs run in other processes, and a refused
    one ends the sweep): removed are what Hydra made for it, its run directory and the empty folders
    made with it, such as a new outputs/, or a refused sweep's new folders; Hydra's files in a folder
    that was there before are put back as they were; nothing else of such a folder is touched.

    Raises:
        SystemExit: :func:`main`'s (Hydra's) exit.
    """
    with user_errors():  # before Hydra, whose own messages run over several lines
        check_command_line(
            sys.argv[1:],
            "train",
            hints=SETTING_HINTS,
            settings=lightning_settings(),
            check_job=check_sweep_job,
        )
    try:
        # A SIGTERM (kill, timeout, a scheduler) before training ends the run as Ctrl+C does: one
        # line, status 130, Hydra's folder undone; training and its final evaluation handle it their
        # own way inside. After it, SIGTERM's default (not the start-up's quiet exit).
        end_quiet_sigterm()
        with sigterm_as_keyboard_interrupt():
            main()
    except SystemExit as exc:
        if exc.code in (2, INTERRUPTED):
            # Not stopped half-way by a second Ctrl+C or a SIGTERM: it writes an earlier run's
            # records back.
            with signal_handlers((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN):
                try:
                    remove_unused_folders(RUN_FOLDERS_BEFORE, JOBS_RUN_HERE)
                except OSError as err:  # the refusal above stays the run's one line of output
                    print(f"warning: could not undo what Hydra wrote for this run: {err}", file=sys.stderr)
        raise


if __name__ == "__main__":
    # conf/train.yaml's hydra.callbacks name train.RecordRunFolders: this module, not a second copy of it.
    sys.modules.setdefault("train", sys.modules[__name__])
    run_from_command_line()

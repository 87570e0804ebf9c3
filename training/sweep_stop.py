"""Stopping a ``hydra/launcher=joblib`` sweep without cutting its jobs' final saves.

Hydra's joblib launcher runs the jobs in loky worker processes. Left as joblib sets them up, a
Ctrl+C or SIGTERM reaches those workers too: an idle one dies of it, which breaks the pool, and the
sweep's own process answers its KeyboardInterrupt by SIGKILLing every worker, so a job that had
started its final save (``last.ckpt``, ``results/train.json``) lost it (a SIGTERM to the process
group lost both jobs' last checkpoints and records; 2026-12-06, CPU).

Here the stop goes through one channel, a file. train.py's own process, for the duration of its
command line (:func:`graceful_joblib_sweeps`):

- has loky start its workers with SIGINT and SIGTERM ignored (:func:`init_sweep_worker`, the
  executor's ``initializer``; SIGTERM ends a worker orphaned by a SIGKILLed sweep), so a signal to
  the whole process group (a terminal's Ctrl+C, a scheduler) leaves the idle ones alone (a job still
  takes a SIGTERM of its own as Ctrl+C: :mod:`training.signals`);
- when the sweep ends early (a Ctrl+C or SIGTERM of its own, or a refused job: an error inside a
  job is kept by Hydra, which reports it once the other jobs have ended),
  creates the stop file named by ``MIXERLAB_SWEEP_STOP`` (its workers inherit the variable) and
  waits for the workers instead of killing them (:class:`GracefulLokyBackend`); a second Ctrl+C or
  SIGTERM during that wait kills them, as joblib did at once.

A job that sees the stop file stops as at a Ctrl+C: during training at the start of a batch, within
about a second (:class:`StopWhenSweepStops`), so it saves ``last.ckpt``, evaluates its best
checkpoint and writes its records marked ``interrupted``; before training (a queued job) at once,
with nothing saved (:func:`stop_requested`).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
from joblib import register_parallel_backend
from joblib.parallel import BACKENDS, LokyBackend
from lightning.pytorch.callbacks import Callback

# The environment variable naming the stop file of the sweep this process's jobs belong to.
STOP_ENV = "MIXERLAB_SWEEP_STOP"
# How often, in seconds, a job looks for the stop file during training (StopWhenSweepStops): a stop
# is noticed at the first batch that starts this long after its last look.
STOP_CHECK_INTERVAL_S = 1.0
# The stop files' folders this process made (GracefulLokyBackend), removed by graceful_joblib_sweeps.
_STOP_FOLDERS: list[str] = []


def stop_requested() -> bool:
    """Whether the joblib sweep this process runs jobs for has been stopped: the file named by
    ``MIXERLAB_SWEEP_STOP`` exists. False outside such a sweep (the variable unset)."""
    path = os.environ.get(STOP_ENV)
    return bool(path) and os.path.exists(path)


def _stop_folder() -> Path | None:
    """The folder of this sweep's stop file (``MIXERLAB_SWEEP_STOP``), None outside such a sweep or
    once it is gone."""
    path = os.environ.get(STOP_ENV)
    folder = Path(path).parent if path else None
    return folder if folder is not None and folder.is_dir() else None


def note_trained_nothing(run_dir: Path) -> None:
    """In a joblib sweep's job, tell the sweep's own process that ``run_dir`` (resolved) trained
    nothing before it was stopped, so that its folder is undone there as a single run's is
    (:data:`training.run_folders.TRAINED_NOTHING`, a set of the process that holds it): a file in the
    stop file's folder holding the path. Nothing outside such a sweep."""
    folder = _stop_folder()
    if folder is not None:
        handle, _ = tempfile.mkstemp(prefix="trained-nothing-", dir=folder)
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(str(run_dir))


def trained_nothing_in_workers() -> set[Path]:
    """The run directories the jobs of this process's joblib sweep noted as having trained nothing
    (:func:`note_trained_nothing`); empty outside such a sweep."""
    folder = _stop_folder()
    if folder is None:
        return set()
    return {Path(note.read_text(encoding="utf-8")) for note in folder.glob("trained-nothing-*")}


class StopWhenSweepStops(Callback):
    """Stops training at the start of a batch once the sweep is stopped (:func:`stop_requested`), by
    the KeyboardInterrupt a Ctrl+C would raise there, so the run takes the same graceful path:
    Lightning's shutdown, then train.py's final save, evaluation and records (``interrupted: true``).
    The batch is not trained (train.py puts it back for a resume).

    It looks for the stop file at the first batch of each epoch (training's first included) and then
    at the first batch that starts :data:`STOP_CHECK_INTERVAL_S` or more after its last look (one
    ``os.stat`` a second rather than one a batch: thousands a second for a small model), so a stop is
    noticed within about a second, or at the next batch where batches take longer."""

    def __init__(self) -> None:
        super().__init__()
        self._next_look = -math.inf  # time.monotonic() from which the next batch looks

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        """Raise ``KeyboardInterrupt`` once the sweep is stopped (looked at as the class says)."""
        now = time.monotonic()
        if batch_idx != 0 and now < self._next_look:
            return
        self._next_look = now + STOP_CHECK_INTERVAL_S
        if stop_requested():
            raise KeyboardInterrupt("the sweep was stopped")


def init_sweep_worker() -> None:
    """A loky worker's initializer.

    - Stop signals, so that an idle worker outlives a signal to the process group (the sweep's own
      process tells the jobs to stop through the stop file): SIGINT ignored (train.py's
      :func:`eval.cli.user_errors` leaves it ignored in the jobs too), and SIGTERM ignored while the
      process that started the worker lives; once it is gone (SIGKILLed), a SIGTERM ends the orphaned
      worker, status 143, so that ``kill -- -<group>`` still clears the sweep away. A job takes
      SIGTERM as Ctrl+C meanwhile (:func:`eval.cli.user_errors`, :mod:`training.signals`).
    - multiprocessing's start method back to the platform's default: loky makes its own (``loky``)
      the worker's default, whose processes the data loaders' workers cannot be started as
      (``data.num_workers`` >= 1 failed in every job: "'Process' object has no attribute 'env'").
    """
    parent = os.getppid()

    def exit_if_orphaned(signum: int, frame: Any) -> None:
        if os.getppid() != parent:
            os._exit(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_if_orphaned)
    multiprocessing.set_start_method(None, force=True)


class GracefulLokyBackend(LokyBackend):
    """joblib's loky backend whose idle workers outlive stop signals (:func:`init_sweep_worker`)
    and whose abort waits for the running jobs instead of killing them.

    joblib calls :meth:`abort_everything` when its ``Parallel`` call ends early: a KeyboardInterrupt
    in this process (Ctrl+C, or SIGTERM made one by :func:`eval.cli.user_errors`) or what a job
    raised past Hydra (a refused job's SystemExit). Registered as ``loky`` by
    :func:`graceful_joblib_sweeps`, which is what Hydra's joblib launcher asks for.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, initializer=init_sweep_worker, **kwargs)
        if STOP_ENV not in os.environ:  # this process's first pool: a folder for its stop file
            # Made here, not for every run: a DDP run stopped by SIGTERM leaves by os._exit, which
            # would leave the folder behind (training.signals.StopDDPOnSigterm).
            folder = tempfile.mkdtemp(prefix="mixerlab-sweep-")
            _STOP_FOLDERS.append(folder)
            os.environ[STOP_ENV] = os.path.join(folder, "stop")  # before the workers start

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """Create the stop file, then wait until the workers have finished: running jobs stop within
        about a second, at a batch's start (:class:`StopWhenSweepStops`), and save, queued ones start
        and stop at once. A KeyboardInterrupt during the wait (a second Ctrl+C or SIGTERM) kills the
        workers and is raised on.

        Raises:
            KeyboardInterrupt: a second stop signal during the wait.
        """
        stop_file = os.environ.get(STOP_ENV)
        if stop_file is None:
            super().abort_everything(ensure_ready)
            return
        if self._workers is None:  # no pool started: nothing to wait for
            return
        Path(stop_file).touch()
        print(
            "stopping the sweep: its running jobs stop within about a second, save and write their "
            "records first (Ctrl+C again to kill them now)",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._workers.terminate(kill_workers=False)
        except KeyboardInterrupt:
            self._workers.terminate(kill_workers=True)
            self._workers = None
            raise
        self._workers = None
        if ensure_ready:
            self.configure(n_jobs=self.parallel.n_jobs, parallel=self.parallel)


@contextlib.contextmanager
def graceful_joblib_sweeps() -> Iterator[None]:
    """Within the block, this process's joblib ``loky`` backend is :class:`GracefulLokyBackend`,
    whose first instance (a ``hydra/launcher=joblib`` sweep's) sets ``MIXERLAB_SWEEP_STOP`` to a stop
    file in a new temporary folder, for the workers it starts. After the block the backend and the
    variable are put back and the folder is removed."""
    previous_backend = BACKENDS.get("loky")
    previous_env = os.environ.get(STOP_ENV)
    register_parallel_backend("loky", GracefulLokyBackend)
    try:
        yield
    finally:
        if previous_backend is not None:
            BACKENDS["loky"] = previous_backend
        while _STOP_FOLDERS:
            shutil.rmtree(_STOP_FOLDERS.pop(), ignore_errors=True)
        if previous_env is None:
            os.environ.pop(STOP_ENV, None)
        else:
            os.environ[STOP_ENV] = previous_env

"""How a training run answers Ctrl+C and SIGTERM (``kill``, ``timeout``, a scheduler).

A single process takes SIGTERM as Ctrl+C during training (:func:`sigterm_as_keyboard_interrupt`),
so Lightning shuts down gracefully; the batch an interrupt stopped before its optimizer step is
forgotten (:func:`discard_unfinished_batch`) so that ``last.ckpt`` resumes on the uninterrupted
run's schedule, and a stop signal during the final save and evaluation waits for them
(:func:`defer_stop_signals`). A DDP run stops at once instead (:class:`StopDDPOnSigterm`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from data.resumable import ResumableLoader
from eval.cli import raise_keyboard_interrupt, signal_handlers


class StopDDPOnSigterm(Callback):
    """Under DDP (``world_size > 1``), a SIGTERM from the start of the sanity check, of training or
    of the final evaluation on stops the run at once: the process that launched the others (local
    rank 0) SIGKILLs them, prints one line and exits with status 1; the others ignore the signal
    (their launcher stops them). Nothing more is saved: the checkpoints already written stay, each
    whole.

    Why: Lightning 2.x answers SIGTERM with a ``torch.distributed.broadcast`` made inside the signal
    handler, a collective at whatever point each process has reached; with train.py's KeyboardInterrupt
    on top, a CPU (gloo) run hung for good in one of three SIGTERMs, its processes waiting on each
    other's collectives (a new-user check). Lightning registers its handler after ``on_fit_start``,
    so this one replaces it from ``on_sanity_check_start`` / ``on_train_start`` on; Lightning puts
    the earlier handlers back after fit. A single process keeps the graceful stop (final save,
    evaluation and records). Main thread only: Python sets signal handlers there alone.
    """

    def _install(self, trainer: L.Trainer) -> None:
        if trainer.world_size <= 1 or threading.current_thread() is not threading.main_thread():
            return
        if trainer.local_rank != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return

        def stop(signum: int, frame: Any) -> None:
            print(
                f"{signal.Signals(signum).name}: stopping the DDP run now, without a final save or "
                "evaluation (the checkpoints written so far stay)",
                flush=True,
            )
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signal.SIGKILL)  # the other processes of this node, wherever they wait
            # No Python exit: its clean-up (Lightning's teardown, the process group) would wait on
            # the processes just killed.
            os._exit(1)

        signal.signal(signal.SIGTERM, stop)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take SIGTERM over from Lightning's handler before the sanity check's collectives."""
        self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take SIGTERM over from Lightning's handler (a run without a sanity check)."""
        self._install(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take SIGTERM over from Lightning's handler in ``trainer.validate`` (the final evaluation)."""
        self._install(trainer)


def discard_unfinished_batch(trainer: L.Trainer) -> None:
    """Forget the batch a Ctrl+C or SIGTERM stopped before its optimizer step, so that ``last.ckpt``
    resumes on the uninterrupted run's schedule.

    Lightning counts a batch as ready and started before its training step and as processed and
    completed after its optimizer step. An interrupt in between (in ``training_step``, the backward
    or ``on_train_batch_start``: most of a step's time) leaves the batch counted as ready and
    started, while the weights, ``global_step``, the schedule and ``tokens_seen`` are those of the
    batches before it. On resume Lightning rolls the epoch's counters back to the completed batches,
    but not the run's totals, which ``trainer.val_check_interval`` counts batches by (across epochs),
    so the resumed run validated one step early (at steps 399 and 599 for an interval of 200), and
    Lightning also counted the unfinished batch as a stepped one (its logged steps one ahead). The
    progress trackers' own ``reset_on_restart`` (back to the completed count), applied here to the
    totals too, makes the checkpoint the one the run would have saved between the two batches.
    The training loader (:class:`data.resumable.ResumableLoader`) had handed the batch out: it takes
    it back, so the resumed run trains on it next, as the uninterrupted run did.
    An interrupt after the optimizer step (the batch processed, not completed) is left as it is:
    Lightning resumes that state by completing the batch.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.total.processed == progress.total.completed < progress.total.ready:
        progress.total.reset_on_restart()
        progress.current.reset_on_restart()
        loader = trainer.train_dataloader
        if isinstance(loader, ResumableLoader):
            loader.put_back()


def sigterm_as_keyboard_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, so ``kill``,
    ``timeout`` and schedulers get Lightning's graceful Ctrl+C shutdown instead of an abrupt exit
    that would leave no last checkpoint and no records. Not where SIGTERM's handler was set outside
    Python (:func:`eval.cli.signal_handlers`: it could not be put back)."""

    return signal_handlers((signal.SIGTERM,), raise_keyboard_interrupt)


@contextlib.contextmanager
def defer_stop_signals(trainer: L.Trainer | None = None) -> Iterator[None]:
    """Within the block, a first SIGINT or SIGTERM is noted (one line printed) instead of acted on;
    after the block the previous handlers are back, and a noted signal ends the process with status
    1. A second signal within the block ends it at once (SystemExit(1): the final evaluation is
    lost; checkpoints are written atomically, so none is left half-written). Main thread only
    (elsewhere it does nothing), and not for a signal whose handler was set outside Python
    (:func:`eval.cli.signal_handlers`).

    ``trainer``: the Trainer whose ``validate`` runs in the block. ``validate`` registers Lightning's
    own SIGTERM handler, which runs before this one and flags the trainer; its evaluation loop then
    stops at the next batch with ``SIGTERMException`` (a SystemExit without a code: status 0, no
    records). The note clears that flag, so the evaluation finishes first.
    """
    received: list[str] = []

    def note(signum, frame):
        name = signal.Signals(signum).name
        if received:
            print(f"{name} again: stopping now, without the final save and evaluation", flush=True)
            raise SystemExit(1)
        if trainer is not None:
            trainer._signal_connector.received_sigterm = False  # Lightning 2.x: what the loops check
        print(
            f"{name}: finishing the final save and evaluation first (send it again to stop now)", flush=True
        )
        received.append(name)

    with signal_handlers((signal.SIGINT, signal.SIGTERM), note):
        yield
    if received:
        # A new-user check: a run stopped this way ended with status 1 and no word of why.
        print(f"{received[0]}: the final save and evaluation are done; stopping (status 1)", flush=True)
        raise SystemExit(1)

"""A training data stream that a resumed run continues where its checkpoint left it.

A run cut into sessions (``trainer.max_time``, then ``resume=``) must train on the batches an
uninterrupted run would. Lightning restarts a mid-epoch checkpoint's epoch from its first batch
unless the training DataLoader is stateful, and its own epoch count is not the data's pass either:
a run stopped by ``max_steps`` or ``max_time`` mid-epoch resumes as the *next* epoch (with the
rest of the old one's length), and a step-based one stopped at an epoch's last batch resumes with
a one-batch epoch. So the stream keeps its own position, ``(epoch, examples)``: pass ``epoch`` over
the training set visits the base sampler's order for that pass, and ``examples`` of it have been
handed out. A step interrupted before its optimizer step gives its batch back
(``training.signals.discard_unfinished_batch`` calls :meth:`ResumableLoader.put_back`).

- :class:`ResumableSampler` orders one pass: the base sampler's order for the pass (a function of
  its seed and the pass, e.g. :class:`ShuffledSampler`), split over the processes, from a start.
- :class:`ResumableLoader` counts the batches it hands out and saves / loads the position through
  ``state_dict()`` / ``load_state_dict()``, the protocol by which Lightning's fit loop checkpoints a
  training loader.
- :class:`ResumableTrainData`, a mixin of the data modules, also saves the position through the
  data module's checkpoint hooks. Those are restored before Lightning builds any dataloader; the fit
  loop's own restore is skipped when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``
  with ``max_epochs`` set (Lightning 2.6, issue #20550: the loader is built before the checkpoint is
  read and never given its state), which :class:`models.lit.LitLM` does.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


class ShuffledSampler(Sampler[int]):
    """Indices ``0 .. num_examples - 1`` in a random order that is a function of ``(seed, epoch)``
    (numpy's generator seeded with both; ``seed`` an int >= 0 or a tuple of them): the order of pass
    ``epoch`` after :meth:`set_epoch`."""

    def __init__(self, num_examples: int, seed: int | tuple[int, ...]):
        self.num_examples = num_examples
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_examples

    def set_epoch(self, epoch: int) -> None:
        """Select the pass whose order the next iteration gives."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        seed = list(self.seed) if isinstance(self.seed, tuple) else [self.seed]
        return iter(np.random.default_rng([*seed, self.epoch]).permutation(self.num_examples).tolist())


class ResumableSampler(DistributedSampler):
    """This process's indices of one pass of a training stream, from the pass's ``start`` on.

    Pass ``epoch`` orders the examples as ``sampler`` does after ``sampler.set_epoch(epoch)``; the
    first ``start`` of that order have been handed out already (to all processes together). Process
    ``rank`` of ``num_replicas`` takes positions ``start + rank``, ``start + rank + num_replicas``,
    ..., as many as every process gets, so the processes together continue the order where they
    left it, and a pass resumed at ``start`` gives each process the rest of what it got without the
    interruption. ``len()`` is a whole pass's share, ``len(sampler) // num_replicas``.

    It is a ``DistributedSampler`` so that Lightning does not wrap it in one of its own under DDP
    (which would reshuffle by Lightning's epoch count). :meth:`set_epoch` does nothing: the pass is
    the stream's (:class:`ResumableLoader` moves ``epoch`` and ``start``), not Lightning's epoch.

    Raises:
        ValueError: ``sampler`` has fewer examples than processes (a process would have no batch).
    """

    def __init__(self, sampler: Sampler[int], num_replicas: int = 1, rank: int = 0):
        if len(sampler) < num_replicas:
            raise ValueError(
                f"the training set has {len(sampler)} examples, fewer than the {num_replicas} processes: "
                "every process needs at least one; use more training examples or fewer trainer.devices"
            )
        super().__init__(sampler, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=True)
        self.sampler = sampler
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Lightning's epoch count is not the stream's pass after a resume (module docstring)."""

    def remaining(self) -> int:
        """How many examples of the pass this process has left from ``start``."""
        return max(0, len(self.sampler) - self.start) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self.sampler.set_epoch(self.epoch)
        order = list(self.sampler)
        return iter(order[self.start + self.rank :: self.num_replicas][: self.remaining()])


class ResumableLoader(DataLoader):
    """A training DataLoader over a :class:`ResumableSampler` whose stream a checkpoint can continue.

    Iterating hands out the rest of the current pass; once a pass is used up the next iteration
    starts the next pass (a new order). An iteration started before a pass is used up (Lightning
    starts one per epoch) continues it, so the stream is the same however Lightning cuts it into
    epochs. A batch counts as handed out when the loader yields it; :meth:`put_back` undoes that
    for a batch that was never trained on.

    ``state_dict()`` is ``{"epoch": pass, "examples": examples of the pass handed out, all processes
    together}``: independent of the batch size and the process count, so a run may resume with
    other ones (it then continues the same order, in other batches).
    """

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, batch_size: int, **kwargs: Any):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._batches = 0  # handed out since sampler.start

    def state_dict(self) -> dict[str, int]:
        """The stream's position: ``{"epoch": int, "examples": int}`` (see the class docstring)."""
        sampler = self.sampler
        handed_out = min(self._batches * self.batch_size, sampler.remaining())
        return {"epoch": sampler.epoch, "examples": sampler.start + handed_out * sampler.num_replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the stream at a position from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is not such a position (two integers >= 0).
        """
        check_stream_state(state)
        self.sampler.epoch, self.sampler.start = state["epoch"], state["examples"]
        self._batches = 0

    def put_back(self) -> None:
        """Forget the last batch handed out (an interrupted step did not train on it): a resume
        from the next checkpoint hands it out again.

        Raises:
            RuntimeError: no batch of this pass was handed out since the position was set.
        """
        if self._batches == 0:
            raise RuntimeError("no training batch was handed out since the stream's position was set")
        self._batches -= 1

    def __iter__(self) -> Iterator[Any]:
        # A generator: the position is read at the first batch, after Lightning (and a checkpoint)
        # have set it, and the sampler's order is drawn only then.
        self.load_state_dict(self.state_dict())  # fold the last iteration's batches into `start`
        if self.sampler.remaining() == 0:
            self.sampler.epoch, self.sampler.start = self.sampler.epoch + 1, 0
        for batch in super().__iter__():
            self._batches += 1
            yield batch


def check_stream_state(state: Any) -> None:
    """Raise ValueError unless ``state`` is a stream position ``{"epoch": int >= 0, "examples": int >= 0}``."""
    ok = isinstance(state, Mapping) and set(state) == {"epoch", "examples"}
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in state.values()):
        raise ValueError(
            f"a training stream position must be {{'epoch': int >= 0, 'examples': int >= 0}}, got {state!r}: "
            "was the checkpoint edited, or written by another mixerlab version?"
        )


def worker_init_fn(num_workers: int, trainer: Any = None) -> Callable[[int], None] | None:
    """The ``worker_init_fn`` of every data module's loaders: None without workers, else
    :func:`_worker_init` for this process's rank (``trainer.global_rank``, 0 without a trainer)."""
    if num_workers == 0:
        return None
    rank = trainer.global_rank if trainer is not None else 0
    return functools.partial(_worker_init, rank=rank)


def _worker_init(worker_id: int, rank: int) -> None:
    """A loader worker's setup: SIGTERM taken as PyTorch's workers take Ctrl+C, then Lightning's
    worker seeding when ``seed_everything(..., workers=True)`` asked for it.

    Why: ``kill``, ``timeout`` and schedulers send SIGTERM to the whole process group. A worker
    killed by it made the main process fail with "DataLoader worker ... is killed by signal:
    Terminated" (a traceback, no last.ckpt) while train.py was stopping gracefully. With SIGTERM
    raising KeyboardInterrupt, the worker ends quietly, as PyTorch's worker loop ends on Ctrl+C.
    Lightning adds its own ``pl_worker_init_function`` only to loaders without a ``worker_init_fn``.
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if int(os.environ.get("PL_SEED_WORKERS", "0")):
        pl_worker_init_function(worker_id, rank=rank)


class ResumableTrainData:
    """Mixin of the data modules: a resumable training stream, checkpointed with the data module.

    ``state_dict()`` (Lightning stores it in every checkpoint) is ``{"train_stream": position}`` of
    the last training loader built (:meth:`resumable_loader`), and ``load_state_dict()`` (Lightning
    calls it when a fit resumes, before building any dataloader) sets the position the next loader
    starts from. A new training loader continues the previous one's stream. The data modules define
    ``seed``, ``batch_size`` and ``num_workers``, which :meth:`training_order_seed` and
    :meth:`shuffled_loader` read.
    """

    _train_loader: ResumableLoader | None = None
    _train_position: dict[str, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        """``{"train_stream": position}``, or ``{}`` before any training loader or loaded position."""
        if self._train_loader is not None:
            return {"train_stream": self._train_loader.state_dict()}
        return {"train_stream": dict(self._train_position)} if self._train_position else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the training stream at a checkpoint's position (none in the state: unchanged).

        Raises:
            ValueError: the position is malformed (:func:`check_stream_state`).
        """
        if "train_stream" not in state_dict:
            return
        position = state_dict["train_stream"]
        check_stream_state(position)
        self._train_position = dict(position)
        if self._train_loader is not None:
            self._train_loader.load_state_dict(position)

    def training_order_seed(self) -> tuple[int, int]:
        """The seed of the training order: ``(data seed, the run's torch seed)``.

        The run's torch seed (``torch.initial_seed()``: train.py's ``seed=``, through
        ``seed_everything``) joins the data module's ``seed``, so runs that differ only in ``seed=``
        see the data in different orders, as with a shuffled DataLoader.
        """
        return (self.seed, torch.initial_seed())

    def shuffled_loader(self, dataset: Dataset) -> ResumableLoader:
        """:meth:`resumable_loader` over ``dataset`` in a new permutation every pass
        (:class:`ShuffledSampler` seeded by :meth:`training_order_seed`), in batches of the data
        module's ``batch_size`` with its ``num_workers``."""
        order = ShuffledSampler(len(dataset), self.training_order_seed())
        return self.resumable_loader(dataset, order, self.batch_size, self.num_workers)

    def resumable_loader(
        self, dataset: Dataset, sampler: Sampler[int], batch_size: int, num_workers: int
    ) -> ResumableLoader:
        """The training loader over ``dataset`` in ``sampler``'s order per pass (a sampler with
        ``set_epoch``, its order a function of its seed and the pass), this process's share under a
        multi-process Trainer, continuing the stream where the previous training loader (or a loaded
        checkpoint) left it.

        Raises:
            ValueError: under a multi-process Trainer, fewer examples than processes.
        """
        trainer = getattr(self, "trainer", None)
        world_size = getattr(trainer, "world_size", 1) if trainer is not None else 1
        rank = trainer.global_rank if world_size > 1 else 0
        loader = ResumableLoader(
            dataset,
            ResumableSampler(sampler, num_replicas=world_size, rank=rank),
            batch_size=batch_size,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            worker_init_fn=worker_init_fn(num_workers, trainer),
        )
        position = self._train_loader.state_dict() if self._train_loader is not None else self._train_position
        if position:
            loader.load_state_dict(position)
        self._train_loader = loader
        return loader

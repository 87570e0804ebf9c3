"""Evaluation samplers under distributed data parallel: every example scored exactly once.

Lightning gives an evaluation DataLoader a ``DistributedSampler``, which pads the dataset to a
multiple of the process count by repeating its first examples: with 63 validation examples on 2
processes one is scored twice, so ``val/loss`` and ``val/acc`` are not those of the validation set
(and differ from a single-process evaluation of the same checkpoint). The data modules hand their
evaluation loaders Lightning's ``UnrepeatedDistributedSamplerWrapper`` instead (the sampler
Lightning itself uses for prediction): each process takes every ``world_size``-th example from its
rank on, so the processes' counts differ by at most one and no example repeats. That is safe here
because evaluation runs no per-step collective: DDP syncs buffers only on the first forward after
training (every process has at least one batch, which :func:`eval_sampler` checks), and
:class:`models.lit.LitLM` sums loss, correct and count over processes once at the end of
the epoch, so the metrics are exact means over the set.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from torch.utils.data import Sampler


def eval_sampler(sampler: Sampler, trainer: Any, what: str = "evaluation") -> Sampler:
    """``sampler`` itself in one process; with a Lightning ``trainer`` of ``world_size`` > 1, this
    process's share of its indices (rank ``r`` takes positions ``r, r + world_size, ...``), none
    repeated. Lightning leaves a loader whose sampler is a ``DistributedSampler`` as it is.

    Args:
        sampler: a sized sampler of the evaluation set (``len(sampler)`` examples), in order.
        trainer: the data module's ``trainer`` (None outside a Trainer, e.g. the eval scripts).
        what: the set's name for the error message.

    Raises:
        ValueError: the set has fewer examples than processes (a process would have no batch, and
            DDP's first-forward buffer sync would wait on it forever).
    """
    world_size = getattr(trainer, "world_size", 1) if trainer is not None else 1
    if world_size <= 1:
        return sampler
    if len(sampler) < world_size:
        raise ValueError(
            f"the {what} set has {len(sampler)} examples, fewer than the {world_size} processes: every process "
            "needs at least one; use more evaluation examples (or a shorter data.seqlen for text) or fewer "
            "trainer.devices"
        )
    return UnrepeatedDistributedSamplerWrapper(
        sampler, num_replicas=world_size, rank=trainer.global_rank, shuffle=False
    )

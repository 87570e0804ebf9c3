"""The induction-heads task of Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces" (arXiv 2312.00752), Section 4.1.2 and Appendix E.1 (after Olsson et al. 2022, "In-context
Learning and Induction Heads").

With ``vocab_size = V`` and ``seqlen = T``, one example is::

    position   0 ...  p     p+1 ... T-2 | T-1
    input_ids  random trigger  a   random | trigger
    labels     -100 everywhere            | a

* every other token is uniform over ``[0, V - 1)``; the trigger is ``V - 1`` and appears exactly
  twice: once at a uniform position ``p`` in ``[0, T - 3]`` and once at the end;
* the only label is at the last position: having read the trigger again, the model must predict
  the token ``a`` that followed its first occurrence (associative recall plus copying).

The paper trains at T = 256 with V = 16 and tests at lengths 2^6 ... 2^20; test slices here may
likewise be longer than training.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.mqar import IGNORE_INDEX, _check_int
from data.synthetic import SyntheticDataModule, TaskSlice


def check_induction_config(vocab_size: int, seqlen: int) -> None:
    """Validate one induction-heads configuration.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``vocab_size < 3`` (the trigger plus at least two answer values are needed) or
            ``seqlen < 3`` (trigger, answer, trigger); each message says how to fix it.
    """
    vocab_size = _check_int(vocab_size, "vocab_size", 1)
    seqlen = _check_int(seqlen, "seqlen", 1)
    if vocab_size < 3:
        raise ValueError(
            f"vocab_size must be >= 3 (the trigger V-1 and at least two answer values), got {vocab_size}; "
            "the paper uses 16"
        )
    if seqlen < 3:
        raise ValueError(
            f"seqlen must be >= 3 (trigger, answer, trigger), got {seqlen}; the paper trains at 256"
        )


def induction_heads(
    num_examples: int, seqlen: int, vocab_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate induction-heads examples (see the module docstring for the layout).

    Args:
        num_examples: N (>= 1).
        seqlen: T (>= 3).
        vocab_size: V (>= 3); the trigger is ``V - 1``.
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched).

    Returns:
        ``(input_ids, labels, trigger_pos)``: (N, T) int64, (N, T) int64 (``IGNORE_INDEX`` except
        the answer at position T - 1) and (N,) int64 position p of the first trigger.

    Raises:
        TypeError/ValueError: see :func:`check_induction_config`; ``num_examples < 1``; a negative
            seed.
    """
    check_induction_config(vocab_size, seqlen)
    num_examples = _check_int(num_examples, "num_examples", 1)
    rng = np.random.default_rng(_check_int(seed, "seed", 0))
    trigger = vocab_size - 1
    input_ids = rng.integers(0, trigger, size=(num_examples, seqlen))  # (N, T), no trigger yet
    trigger_pos = rng.integers(0, seqlen - 2, size=num_examples)  # (N,), in [0, T - 3]
    rows = np.arange(num_examples)
    input_ids[rows, trigger_pos] = trigger
    input_ids[:, -1] = trigger
    labels = np.full((num_examples, seqlen), IGNORE_INDEX, dtype=np.int64)
    labels[:, -1] = input_ids[rows, trigger_pos + 1]
    return (
        torch.from_numpy(input_ids.astype(np.int64)),
        torch.from_numpy(labels),
        torch.from_numpy(trigger_pos.astype(np.int64)),
    )


class InductionHeadsDataModule(SyntheticDataModule):
    """Induction heads (Gu & Dao 2023) as a seeded data module.

    Slice configs are ``{"seqlen"}``; slice keys read ``T{seqlen}`` (e.g. ``"T64"``). Items carry,
    besides ``input_ids``/``labels``/``slice``, ``"trigger_pos"``, the first trigger's position.

    Args:
        vocab_size: V (default 16, the paper's), the trigger included.
        seqlen: training length T (default 64; the paper's is 256).
        test_configs: list of ``{"seqlen"}``; default 1x, 4x and 16x the training seqlen.
        num_train_examples: training examples (default 20_000).
        num_test_examples: examples per test slice (default 1_000).
        batch_size: examples per batch (default 64).
        seed: base seed of the scheme of :class:`data.synthetic.SyntheticDataModule` (default 0).
        num_workers: DataLoader worker processes (default 0).

    Raises:
        TypeError/ValueError: an invalid setting (see :func:`check_induction_config`).
    """

    def __init__(
        self,
        vocab_size: int = 16,
        seqlen: int = 64,
        test_configs: list[dict[str, int]] | None = None,
        num_train_examples: int = 20_000,
        num_test_examples: int = 1_000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = _check_int(vocab_size, "vocab_size", 1)
        self.configure(
            {"seqlen": seqlen},
            test_configs,
            num_train_examples=num_train_examples,
            num_test_examples=num_test_examples,
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
        )

    def check_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``{"seqlen"}`` (see :func:`check_induction_config`)."""
        if "seqlen" not in config:
            raise ValueError("an induction-heads slice config needs the key 'seqlen'")
        check_induction_config(self.vocab_size, config["seqlen"])
        return {"seqlen": int(config["seqlen"])}

    def slice_name(self, config) -> str:
        """``T{seqlen}``, e.g. ``"T256"``."""
        return f"T{config['seqlen']}"

    def default_test_configs(self) -> list[dict[str, Any]]:
        """1x, 4x and 16x the training seqlen."""
        return [{"seqlen": self.train_config["seqlen"] * m} for m in (1, 4, 16)]

    def make_slice(self, config, num_examples: int, seed: int) -> TaskSlice:
        """Induction-heads examples of ``config`` from ``seed``; extra ``trigger_pos``."""
        input_ids, labels, trigger_pos = induction_heads(
            num_examples, config["seqlen"], self.vocab_size, seed
        )
        return TaskSlice(
            input_ids, labels, self.slice_name(config), config, seed, {"trigger_pos": trigger_pos}
        )

"""The selective copying task of Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces" (arXiv 2312.00752), Section 4.1.1 (task of Figure 2) and Appendix E.1.

The semantics follow the generator of the paper's code base (``torch_copying_data`` with
``variable=True``, state-spaces/s4, ``src/dataloaders/datasets/copying.py``), written here with a
local numpy generator. With ``vocab_size = V``, ``num_data_tokens = M`` and ``seqlen = T``::

    position   0 ............................ T-M-1 | T-M ...  T-1
    input_ids  noise (0) with the M data tokens       | M markers (V-1)
               at M random distinct positions, in order
    labels     -100 everywhere                        | d_1 ...  d_M

* data tokens are uniform over ``[1, V - 1)`` (repeats allowed), noise is 0 and the marker V - 1;
* the data positions are M distinct uniform positions of the first ``T - M`` tokens, sorted, so
  the data must be reproduced in the order it appeared while skipping the noise -- the
  content-aware selection that a time-invariant recurrence cannot do;
* the label sits at the markers: the model's output at marker j must be data token j (the model
  reads markers, never its own outputs, so teacher-forced and free-running scoring coincide).

The paper uses 4096 noise tokens (so T = 4096 + 2 * 16), V = 16 and M = 16; test slices may be
longer than training (the noise region grows, M stays).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.mqar import IGNORE_INDEX, _check_int
from data.synthetic import SyntheticDataModule, TaskSlice

NOISE_ID = 0
"""The noise (blank) token; the marker is ``vocab_size - 1`` and data tokens lie in between."""


def check_selective_copying_config(vocab_size: int, seqlen: int, num_data_tokens: int) -> None:
    """Validate one selective-copying configuration.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``vocab_size < 4`` (noise, marker and at least two data values are needed),
            ``num_data_tokens < 1``, or ``seqlen < 2 * num_data_tokens`` (the data tokens need M
            distinct positions before the M markers); each message says how to fix it.
    """
    vocab_size = _check_int(vocab_size, "vocab_size", 1)
    seqlen = _check_int(seqlen, "seqlen", 1)
    num_data_tokens = _check_int(num_data_tokens, "num_data_tokens", 0)
    if num_data_tokens < 1:
        raise ValueError(
            f"num_data_tokens must be >= 1 (there must be something to copy), got {num_data_tokens}; "
            "the paper uses 16"
        )
    if vocab_size < 4:
        raise ValueError(
            f"vocab_size must be >= 4 (noise 0, marker V-1 and at least two data values), got {vocab_size}; "
            "the paper uses 16"
        )
    if seqlen < 2 * num_data_tokens:
        raise ValueError(
            f"seqlen={seqlen} cannot hold num_data_tokens={num_data_tokens}: the data needs M distinct "
            f"positions before the M markers, so seqlen >= 2 * M = {2 * num_data_tokens}; raise seqlen "
            f"or lower num_data_tokens to {seqlen // 2}"
        )


def selective_copying(
    num_examples: int, seqlen: int, num_data_tokens: int, vocab_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate selective-copying examples (see the module docstring for the layout).

    Args:
        num_examples: N (>= 1).
        seqlen: T, tokens per example: ``T - M`` noise-and-data tokens, then M markers.
        num_data_tokens: M, data tokens to copy (>= 1, ``2 M <= T``).
        vocab_size: V (>= 4); data tokens are drawn from ``[1, V - 1)``.
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched).

    Returns:
        ``(input_ids, labels)``, both (N, T) int64; ``labels`` holds the data tokens at the M marker
        positions and ``IGNORE_INDEX`` elsewhere.

    Raises:
        TypeError/ValueError: see :func:`check_selective_copying_config`; ``num_examples < 1``; a
            negative seed.
    """
    check_selective_copying_config(vocab_size, seqlen, num_data_tokens)
    num_examples = _check_int(num_examples, "num_examples", 1)
    rng = np.random.default_rng(_check_int(seed, "seed", 0))
    region = seqlen - num_data_tokens
    data = rng.integers(1, vocab_size - 1, size=(num_examples, num_data_tokens))  # (N, M)
    positions = np.empty((num_examples, num_data_tokens), dtype=np.int64)  # (N, M)
    for row in range(num_examples):
        # choice(replace=False) is a partial shuffle in C: a few µs per row, cheaper than a
        # vectorised top-k over an (N, T - M) random matrix at the paper's T = 4096
        positions[row] = np.sort(rng.choice(region, size=num_data_tokens, replace=False))

    input_ids = np.full((num_examples, seqlen), NOISE_ID, dtype=np.int64)
    np.put_along_axis(input_ids, positions, data, axis=1)
    input_ids[:, region:] = vocab_size - 1
    labels = np.full((num_examples, seqlen), IGNORE_INDEX, dtype=np.int64)
    labels[:, region:] = data
    return torch.from_numpy(input_ids), torch.from_numpy(labels)


class SelectiveCopyingDataModule(SyntheticDataModule):
    """Selective copying (Gu & Dao 2023) as a seeded data module.

    Slice configs are ``{"seqlen", "num_data_tokens"}``; a test config may omit
    ``num_data_tokens`` (the training value). Slice keys read ``T{seqlen}_data{M}`` (e.g.
    ``"T64_data16"``).

    Args:
        vocab_size: V (default 16, the paper's), including noise and marker.
        seqlen: training example length T (default 64; the paper's is 4096 + 2 * 16).
        num_data_tokens: M (default 16, the paper's).
        test_configs: list of ``{"seqlen"[, "num_data_tokens"]}``; default 1x, 2x and 4x the
            training seqlen with the training M (longer noise to skip).
        num_train_examples: training examples (default 20_000).
        num_test_examples: examples per test slice (default 1_000).
        batch_size: examples per batch (default 64).
        seed: base seed of the scheme of :class:`data.synthetic.SyntheticDataModule` (default 0).
        num_workers: DataLoader worker processes (default 0).

    Raises:
        TypeError/ValueError: an invalid setting (see :func:`check_selective_copying_config`).
    """

    test_config_inherits = ("num_data_tokens",)

    def __init__(
        self,
        vocab_size: int = 16,
        seqlen: int = 64,
        num_data_tokens: int = 16,
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
            {"seqlen": seqlen, "num_data_tokens": num_data_tokens},
            test_configs,
            num_train_examples=num_train_examples,
            num_test_examples=num_test_examples,
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
        )

    def check_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``{"seqlen", "num_data_tokens"}`` (see :func:`check_selective_copying_config`)."""
        if "seqlen" not in config:
            raise ValueError("a selective-copying slice config needs the key 'seqlen'")
        check_selective_copying_config(self.vocab_size, config["seqlen"], config["num_data_tokens"])
        return {"seqlen": int(config["seqlen"]), "num_data_tokens": int(config["num_data_tokens"])}

    def slice_name(self, config) -> str:
        """``T{seqlen}_data{num_data_tokens}``, e.g. ``"T64_data16"``."""
        return f"T{config['seqlen']}_data{config['num_data_tokens']}"

    def default_test_configs(self) -> list[dict[str, Any]]:
        """1x, 2x and 4x the training seqlen, the training number of data tokens."""
        return [{**self.train_config, "seqlen": self.train_config["seqlen"] * m} for m in (1, 2, 4)]

    def make_slice(self, config, num_examples: int, seed: int) -> TaskSlice:
        """Selective-copying examples of ``config`` from ``seed``."""
        input_ids, labels = selective_copying(num_examples, vocab_size=self.vocab_size, seed=seed, **config)
        return TaskSlice(input_ids, labels, self.slice_name(config), config, seed)

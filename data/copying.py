"""The copy task of Jelassi, Brandfonbrener, Kakade & Malach, "Repeat After Me: Transformers are
Better than State Space Models at Copying" (ICML 2024, arXiv 2402.01032).

A random string s of n characters over an alphabet of A letters is written once and must be
repeated. Token ids put the four special tokens first, so they do not depend on A (the paper's
vocabulary: 26 letters plus BOS, EOS, PAD and the copy token, 30 ids)::

    PAD_ID = 0, BOS_ID = 1, SEP_ID = 2 (the paper's copy token), EOS_ID = 3,
    letters FIRST_LETTER_ID = 4 ... 4 + A - 1

One example of length T (``seqlen``) with a string of n characters::

    position   0    1 ... n    n+1   n+2 ... 2n+1   2n+2   2n+3 ... T-1
    input_ids  BOS  s_1 .. s_n SEP   s_1 ... s_n    EOS    PAD  ... PAD
    labels     -100 ....  -100 s_1   s_2 ... EOS    -100   -100 ... -100

Only the copy is scored: the output at SEP and at each copied character predicts the next copied
character, and the last one predicts EOS (so a generation knows when to stop). The string length n
is uniform in ``[min_len, max_len]`` and the characters are uniform, as in the paper; test slices
may use longer strings than training (the paper's length-generalisation experiments).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.mqar import IGNORE_INDEX, _check_int
from data.synthetic import SyntheticDataModule, TaskSlice, exact_match, scored_correct

PAD_ID, BOS_ID, SEP_ID, EOS_ID = 0, 1, 2, 3
"""Special token ids of the copy task (letters start after them)."""

FIRST_LETTER_ID = 4
"""Id of the alphabet's first letter; letter j has id ``FIRST_LETTER_ID + j``."""


def min_copy_seqlen(max_len: int) -> int:
    """Tokens an example with a string of ``max_len`` characters needs: ``2 * max_len + 3``."""
    return 2 * max_len + 3


def check_copy_config(alphabet_size: int, min_len: int, max_len: int, seqlen: int) -> None:
    """Validate one copy-task configuration.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``alphabet_size < 2`` (one letter leaves nothing to copy), ``min_len < 1``,
            ``max_len < min_len``, or ``seqlen < 2 * max_len + 3`` (the longest string and its copy
            do not fit); each message says how to fix it.
    """
    alphabet_size = _check_int(alphabet_size, "alphabet_size", 1)
    min_len = _check_int(min_len, "min_len", 1)
    max_len = _check_int(max_len, "max_len", 1)
    seqlen = _check_int(seqlen, "seqlen", 1)
    if alphabet_size < 2:
        raise ValueError(
            f"alphabet_size must be >= 2 (a one-letter string is determined by its length), got "
            f"{alphabet_size}; the paper uses 26"
        )
    if max_len < min_len:
        raise ValueError(f"max_len ({max_len}) must be >= min_len ({min_len}); swap them or raise max_len")
    if seqlen < min_copy_seqlen(max_len):
        raise ValueError(
            f"a string of max_len={max_len} characters is too long for seqlen={seqlen}: BOS, the string, "
            f"SEP, its copy and EOS take 2 * max_len + 3 = {min_copy_seqlen(max_len)} tokens; raise seqlen "
            f"to {min_copy_seqlen(max_len)} or lower max_len to {(seqlen - 3) // 2}"
        )


def copy_examples(
    num_examples: int, seqlen: int, min_len: int, max_len: int, alphabet_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate copy-task examples (see the module docstring for the layout).

    Args:
        num_examples: N (>= 1).
        seqlen: T, tokens per example, padded with ``PAD_ID`` (>= ``2 * max_len + 3``).
        min_len: shortest string (>= 1).
        max_len: longest string (>= min_len).
        alphabet_size: A, letters (>= 2); the vocabulary has ``A + 4`` ids.
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched).

    Returns:
        ``(input_ids, labels, lengths)``: (N, T) int64, (N, T) int64 (``IGNORE_INDEX`` outside the
        copy) and (N,) int64 string lengths n.

    Raises:
        TypeError/ValueError: see :func:`check_copy_config`; ``num_examples < 1``; a negative seed.
    """
    check_copy_config(alphabet_size, min_len, max_len, seqlen)
    num_examples = _check_int(num_examples, "num_examples", 1)
    rng = np.random.default_rng(_check_int(seed, "seed", 0))
    lengths = rng.integers(min_len, max_len + 1, size=num_examples)  # (N,)
    letters = rng.integers(0, alphabet_size, size=(num_examples, max_len)) + FIRST_LETTER_ID  # (N, max_len)

    pos = np.arange(seqlen)[None, :]  # (1, T)
    n = lengths[:, None]  # (N, 1)
    rows = np.arange(num_examples)[:, None]
    source = letters[rows, np.clip(pos - 1, 0, max_len - 1)]  # (N, T): s_{t} at position t
    copy = letters[rows, np.clip(pos - n - 2, 0, max_len - 1)]  # (N, T): s_{t-n-1} at position t
    input_ids = np.select(
        [pos == 0, pos <= n, pos == n + 1, pos <= 2 * n + 1, pos == 2 * n + 2],
        [BOS_ID, source, SEP_ID, copy, EOS_ID],
        default=PAD_ID,
    )
    next_ids = np.concatenate([input_ids[:, 1:], np.full((num_examples, 1), PAD_ID)], axis=1)  # (N, T)
    labels = np.where((pos >= n + 1) & (pos <= 2 * n + 1), next_ids, IGNORE_INDEX)
    return (
        torch.from_numpy(input_ids.astype(np.int64)),
        torch.from_numpy(labels.astype(np.int64)),
        torch.from_numpy(lengths.astype(np.int64)),
    )


def decode_copy(ids) -> str:
    """Readable text of copy-task ids: letters as ``a, b, ...`` (then ``[26]``, ... past z) and the
    special tokens as ``^`` (BOS), ``|`` (SEP), ``$`` (EOS), ``_`` (PAD), e.g. ``"^abc|abc$__"``.

    Args:
        ids: a 1-D tensor or sequence of token ids.

    Raises:
        ValueError: a negative id, or ``ids`` not 1-D.
    """
    if isinstance(ids, torch.Tensor):
        if ids.ndim != 1:
            raise ValueError(f"decode_copy expects a 1-D sequence of ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    special = {PAD_ID: "_", BOS_ID: "^", SEP_ID: "|", EOS_ID: "$"}
    out = []
    for i in ids:
        if i < 0:
            raise ValueError(f"token id {i} is negative")
        letter = i - FIRST_LETTER_ID
        out.append(special.get(i) or (chr(ord("a") + letter) if letter < 26 else f"[{letter}]"))
    return "".join(out)


def string_exact_match(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, whether the whole copy is right: every character and the closing EOS.

    Jelassi et al. (2024) report this string-level accuracy. Works on teacher-forced outputs and,
    through :func:`data.synthetic.generated_to_predictions`, on a greedy generation from the
    prompt ``input_ids[:, :prompt_len]``.

    Args:
        outputs: logits ``(B, T, V)`` or predicted ids ``(B, T)`` aligned with ``labels``.
        labels: ``(B, T)`` int64 copy-task labels.

    Returns:
        ``(B,)`` bool.

    Raises:
        ValueError: see :func:`data.synthetic.scored_correct`.
    """
    return exact_match(outputs, labels)


def char_accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, the fraction of the string's n characters copied right (EOS not counted).

    Args:
        outputs: logits ``(B, T, V)`` or predicted ids ``(B, T)`` aligned with ``labels``.
        labels: ``(B, T)`` int64 copy-task labels.

    Returns:
        ``(B,)`` float64 in [0, 1].

    Raises:
        ValueError: see :func:`data.synthetic.scored_correct`, or a row with no character label.
    """
    correct, scored = scored_correct(outputs, labels)
    chars = scored & (labels != EOS_ID)  # (B, T)
    counts = chars.sum(dim=1, dtype=torch.float64)
    if not counts.all():
        raise ValueError("a labels row scores no character (only EOS); is it a copy-task row?")
    return (correct & chars).sum(dim=1, dtype=torch.float64) / counts


class CopyDataModule(SyntheticDataModule):
    """The copy task (Jelassi et al. 2024) as a seeded data module.

    Slice configs are ``{"min_len", "max_len", "seqlen"}``; a test config may omit ``seqlen``, which
    then is the shortest that fits (``2 * max_len + 3``). Slice keys read ``len{min_len}-{max_len}``
    (e.g. ``"len1-20"``). Items carry, besides ``input_ids``/``labels``/``slice``, the string length
    ``"length"`` and ``"prompt_len"`` (``n + 2``: BOS, the string, SEP), so an eval can generate
    from ``input_ids[:, :prompt_len]``.

    Args:
        alphabet_size: letters A (default 26, the paper's); ``vocab_size`` is ``A + 4``.
        min_len: shortest training string (default 1).
        max_len: longest training string (default 20).
        seqlen: training example length (default 48 >= 2 * 20 + 3).
        test_configs: list of ``{"min_len", "max_len"[, "seqlen"]}``; default the training range and
            the two ranges beyond it, ``(max_len, 2 max_len]`` and ``(2 max_len, 4 max_len]``.
        num_train_examples: training examples (default 20_000).
        num_test_examples: examples per test slice (default 1_000).
        batch_size: examples per batch (default 64).
        seed: base seed of the scheme of :class:`data.synthetic.SyntheticDataModule` (default 0).
        num_workers: DataLoader worker processes (default 0).

    Raises:
        TypeError/ValueError: an invalid setting (see :func:`check_copy_config`), e.g. a string
            longer than the sequence.
    """

    def __init__(
        self,
        alphabet_size: int = 26,
        min_len: int = 1,
        max_len: int = 20,
        seqlen: int = 48,
        test_configs: list[dict[str, int]] | None = None,
        num_train_examples: int = 20_000,
        num_test_examples: int = 1_000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.alphabet_size = _check_int(alphabet_size, "alphabet_size", 1)
        self.vocab_size = self.alphabet_size + FIRST_LETTER_ID
        self.configure(
            {"min_len": min_len, "max_len": max_len, "seqlen": seqlen},
            test_configs,
            num_train_examples=num_train_examples,
            num_test_examples=num_test_examples,
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
        )

    def check_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``{"min_len", "max_len"[, "seqlen"]}`` (see :func:`check_copy_config`)."""
        missing = sorted({"min_len", "max_len"} - set(config))
        if missing:
            raise ValueError(f"a copy slice config needs the keys {missing}")
        max_len = _check_int(config["max_len"], "max_len", 1)
        seqlen = config.get("seqlen")
        config = {
            "min_len": config["min_len"],
            "max_len": max_len,
            "seqlen": min_copy_seqlen(max_len) if seqlen is None else seqlen,
        }
        check_copy_config(self.alphabet_size, **config)
        return {key: int(value) for key, value in config.items()}

    def slice_name(self, config) -> str:
        """``len{min_len}-{max_len}``, e.g. ``"len21-40"``."""
        return f"len{config['min_len']}-{config['max_len']}"

    def default_test_configs(self) -> list[dict[str, Any]]:
        """The training range, then ``(max_len, 2 max_len]`` and ``(2 max_len, 4 max_len]``."""
        hi = self.train_config["max_len"]
        return [
            dict(self.train_config),
            {"min_len": hi + 1, "max_len": 2 * hi},
            {"min_len": 2 * hi + 1, "max_len": 4 * hi},
        ]

    def make_slice(self, config, num_examples: int, seed: int) -> TaskSlice:
        """Copy examples of ``config`` from ``seed``; extras ``length`` and ``prompt_len``."""
        input_ids, labels, lengths = copy_examples(
            num_examples, alphabet_size=self.alphabet_size, seed=seed, **config
        )
        extras = {"length": lengths, "prompt_len": lengths + 2}
        return TaskSlice(input_ids, labels, self.slice_name(config), config, seed, extras)

"""Long-context retrieval at byte level: passkey retrieval and multi-key needle retrieval.

Every example is pure UTF-8 (here ASCII) bytes, so ``vocab_size`` is 256 and
:class:`data.text.ByteTokenizer` decodes it. An example of ``seqlen`` bytes is a *prompt* of
``prompt_len`` bytes that ends in a continuation cue, followed by the *answer*::

    input_ids  prompt (haystack with the needle, then the question) | answer
    labels     -100 ..............................             -100 a_1 ... a_m | -100

so ``labels[t] = input_ids[t + 1]`` exactly for ``prompt_len - 1 <= t < seqlen - 1``: the output at
the prompt's last byte predicts the answer's first. Within a slice every example has the same
``prompt_len`` (the haystack is sized to the slice's ``seqlen``), so an eval can score with teacher
forcing (:func:`data.synthetic.exact_match` on the logits) or generate greedily from
``input_ids[:, :prompt_len]`` for ``seqlen - prompt_len`` bytes in one batch
(:func:`data.synthetic.generated_to_predictions`, then the same scorer).

The needle's *depth* is its relative position in the haystack, from 0 (first) to 1 (last, just
before the question). A slice draws depths uniformly inside ``[depth_min, depth_max)`` (closed at
1), so a length x depth grid of slices gives the usual needle-in-a-haystack table.

* **Passkey** (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300; the prompt of
  their ``llama/run_test.py``): the task description, the filler "The grass is green. The sky is blue.
  ..." repeated, the line "The pass key is 12345. Remember it. 12345 is the pass key." at a random
  byte offset of the filler, more filler, then "What is the pass key? The pass key is ", answered by
  the ``num_digits`` digits. As in the original, the filler before and after the needle are prefixes
  of the repeated filler cut at a byte count; the needle's depth is the byte length before it over
  the total filler length. Here the question ends in a space so the answer is the digits alone.
* **Multi-key needle** (Hsieh et al. 2024, "RULER", arXiv 2404.06654, Section 3.1, multi-key NIAH
  whose haystack is the distractor needles): needles "The value of key 4821 is 5937." with distinct
  keys fill the haystack, then "What is the value of key 4821? The value of key 4821 is ", answered
  by the queried value. The needle count is the most that fits; the few bytes left over are spaces
  at the start of the prompt. Depth is the queried needle's index over (needles - 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.mqar import IGNORE_INDEX, _check_int
from data.synthetic import (
    SyntheticDataModule,
    TaskSlice,
    check_depth_range,
    depth_bucket_name,
    depth_positions,
)

# The passkey prompt of Landmark Attention's run_test.py (question with a trailing space, see above).
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is "
# The multi-key needle and its question.
NEEDLE = "The value of key {key} is {value}."
NEEDLE_QUESTION = "What is the value of key {key}? The value of key {key} is "


def _random_numbers(rng: np.random.Generator, num: int, digits: int) -> list[str]:
    """``num`` uniform ``digits``-digit decimal numbers without a leading zero, as strings."""
    return [str(x) for x in rng.integers(10 ** (digits - 1), 10**digits, size=num)]


def _to_examples(texts: list[bytes], answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte strings of one length (prompt + answer) as ``(input_ids, labels)``, (N, T) int64 each."""
    input_ids = torch.from_numpy(np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.int64))
    input_ids = input_ids.view(len(texts), -1)  # (N, T)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, -answer_len - 1 : -1] = input_ids[:, -answer_len:]
    return input_ids, labels


def passkey_filler_len(seqlen: int, num_digits: int) -> int:
    """Bytes of filler a passkey example of ``seqlen`` bytes holds (negative: it does not fit)."""
    needle = PASSKEY_NEEDLE.format(key="0" * num_digits)
    return seqlen - num_digits - (len(PASSKEY_INTRO) + len(needle) + len(PASSKEY_QUESTION) + 4)


def check_passkey_config(seqlen: int, num_digits: int, depth_min: float, depth_max: float) -> None:
    """Validate one passkey configuration.

    Raises:
        TypeError: a non-integer length or count, or a non-numeric depth.
        ValueError: ``num_digits < 1``; a bad depth range (see
            :func:`data.synthetic.check_depth_range`); or ``seqlen`` too short for the description,
            needle, question and answer plus enough filler to place the needle in the depth range
            (the message gives the smallest seqlen that works).
    """
    seqlen = _check_int(seqlen, "seqlen", 1)
    num_digits = _check_int(num_digits, "num_digits", 1)
    depth_min, depth_max = check_depth_range(depth_min, depth_max)
    filler = passkey_filler_len(seqlen, num_digits)
    first, last = depth_positions(depth_min, depth_max, max(filler, 0))
    if filler < 0 or first > last:
        # a filler of ceil(1 / width) bytes always has an offset inside a range of that width
        needed = seqlen - filler + int(np.ceil(1.0 / (depth_max - depth_min)))
        raise ValueError(
            f"seqlen={seqlen} is too short for a passkey example with the needle at depth "
            f"[{depth_min}, {depth_max}): the task description, needle, question and {num_digits}-digit "
            f"answer take {seqlen - filler} bytes; use seqlen >= {needed}"
        )


def passkey_examples(
    num_examples: int,
    seqlen: int,
    seed: int,
    depth_min: float = 0.0,
    depth_max: float = 1.0,
    num_digits: int = 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate passkey-retrieval examples (Mohtashami & Jaggi 2023; see the module docstring).

    Args:
        num_examples: N (>= 1).
        seqlen: T, bytes per example (prompt + answer).
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched).
        depth_min, depth_max: the needle's depth range, ``0 <= depth_min < depth_max <= 1``.
        num_digits: digits of the pass key (no leading zero); the answer's length.

    Returns:
        ``(input_ids, labels, depth)``: (N, T) int64 bytes, (N, T) int64 (the answer's bytes at
        positions ``T - num_digits - 1 ... T - 2``, ``IGNORE_INDEX`` elsewhere) and (N,) float64
        depths. The prompt is ``input_ids[:, : T - num_digits]``.

    Raises:
        TypeError/ValueError: see :func:`check_passkey_config`; ``num_examples < 1``; a negative seed.
    """
    check_passkey_config(seqlen, num_digits, depth_min, depth_max)
    num_examples = _check_int(num_examples, "num_examples", 1)
    rng = np.random.default_rng(_check_int(seed, "seed", 0))
    filler_len = passkey_filler_len(seqlen, num_digits)
    first, last = depth_positions(depth_min, depth_max, filler_len)
    filler = " ".join([PASSKEY_FILLER] * (filler_len // (len(PASSKEY_FILLER) + 1) + 1))
    offsets = rng.integers(first, last + 1, size=num_examples)  # (N,) filler bytes before the needle
    keys = _random_numbers(rng, num_examples, num_digits)
    texts = [
        "\n".join(
            [
                PASSKEY_INTRO,
                filler[:offset],
                PASSKEY_NEEDLE.format(key=key),
                filler[: filler_len - offset],
                PASSKEY_QUESTION + key,
            ]
        ).encode("ascii")
        for offset, key in zip(offsets.tolist(), keys, strict=True)
    ]
    input_ids, labels = _to_examples(texts, num_digits)
    depth = torch.from_numpy(offsets / max(filler_len, 1))
    return input_ids, labels, depth


def _needle_sizes(key_digits: int, value_digits: int) -> tuple[int, int]:
    """``(bytes per needle with its separator, bytes of the question plus answer)`` of a multi-key example."""
    needle_len = len(NEEDLE.format(key="0" * key_digits, value="0" * value_digits)) + 1  # + " " or "\n"
    return needle_len, len(NEEDLE_QUESTION.format(key="0" * key_digits)) + value_digits


def _needle_layout(seqlen: int, key_digits: int, value_digits: int) -> tuple[int, int]:
    """``(needles, leading spaces)`` of a multi-key example of ``seqlen`` bytes (needles may be < 2)."""
    needle_len, fixed_len = _needle_sizes(key_digits, value_digits)
    room = max(seqlen - fixed_len, 0)
    return room // needle_len, room % needle_len


def check_multikey_config(
    seqlen: int, key_digits: int, value_digits: int, depth_min: float, depth_max: float
) -> None:
    """Validate one multi-key needle configuration.

    Raises:
        TypeError: a non-integer length or count, or a non-numeric depth.
        ValueError: ``key_digits`` or ``value_digits`` < 1; a bad depth range (see
            :func:`data.synthetic.check_depth_range`); ``seqlen`` too short for two needles (the
            queried one and a distractor) or for a needle index inside the depth range; or more
            needles than distinct ``key_digits``-digit keys. Each message says how to fix it.
    """
    seqlen = _check_int(seqlen, "seqlen", 1)
    key_digits = _check_int(key_digits, "key_digits", 1)
    value_digits = _check_int(value_digits, "value_digits", 1)
    depth_min, depth_max = check_depth_range(depth_min, depth_max)
    num_needles, _ = _needle_layout(seqlen, key_digits, value_digits)
    first, last = depth_positions(depth_min, depth_max, max(num_needles - 1, 0))
    if num_needles < 2 or first > last:
        needle_len, fixed_len = _needle_sizes(key_digits, value_digits)
        # needles - 1 >= ceil(1 / width) always puts a needle index inside a range of that width
        wanted = max(2, int(np.ceil(1.0 / (depth_max - depth_min))) + 1)
        needed = fixed_len + wanted * needle_len
        raise ValueError(
            f"seqlen={seqlen} holds {num_needles} key-value needles, too few for a queried needle and "
            f"distractors at depth [{depth_min}, {depth_max}); use seqlen >= {needed} ({wanted} needles)"
        )
    num_keys = 9 * 10 ** (key_digits - 1)
    if num_needles > num_keys:
        raise ValueError(
            f"seqlen={seqlen} holds {num_needles} needles but there are only {num_keys} distinct "
            f"{key_digits}-digit keys; raise key_digits"
        )


def multikey_needle_examples(
    num_examples: int,
    seqlen: int,
    seed: int,
    depth_min: float = 0.0,
    depth_max: float = 1.0,
    key_digits: int = 4,
    value_digits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate multi-key needle-retrieval examples (RULER's multi-key NIAH; see the module docstring).

    Args:
        num_examples: N (>= 1).
        seqlen: T, bytes per example (prompt + answer).
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched).
        depth_min, depth_max: the queried needle's depth range, ``0 <= depth_min < depth_max <= 1``.
        key_digits: digits of each key (keys are distinct within an example, no leading zero).
        value_digits: digits of each value (no leading zero); the answer's length.

    Returns:
        ``(input_ids, labels, depth)``: (N, T) int64 bytes, (N, T) int64 (the queried value's bytes
        at positions ``T - value_digits - 1 ... T - 2``, ``IGNORE_INDEX`` elsewhere) and (N,)
        float64 depths. The prompt is ``input_ids[:, : T - value_digits]``.

    Raises:
        TypeError/ValueError: see :func:`check_multikey_config`; ``num_examples < 1``; a negative seed.
    """
    check_multikey_config(seqlen, key_digits, value_digits, depth_min, depth_max)
    num_examples = _check_int(num_examples, "num_examples", 1)
    rng = np.random.default_rng(_check_int(seed, "seed", 0))
    num_needles, pad = _needle_layout(seqlen, key_digits, value_digits)
    first, last = depth_positions(depth_min, depth_max, num_needles - 1)
    low = 10 ** (key_digits - 1)
    texts, queried = [], rng.integers(first, last + 1, size=num_examples)  # (N,) queried needle index
    for query in queried.tolist():
        keys = [str(low + k) for k in rng.choice(9 * low, size=num_needles, replace=False)]
        values = _random_numbers(rng, num_needles, value_digits)
        needles = " ".join(NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True))
        question = NEEDLE_QUESTION.format(key=keys[query])
        texts.append((" " * pad + needles + "\n" + question + values[query]).encode("ascii"))
    input_ids, labels = _to_examples(texts, value_digits)
    depth = torch.from_numpy(queried / (num_needles - 1))
    return input_ids, labels, depth


class _RetrievalDataModule(SyntheticDataModule):
    """Slices ``{"seqlen", "depth_min", "depth_max"}`` of a byte-level retrieval task.

    Test configs may omit the depth keys (then the whole context, [0, 1]). Slice keys read
    ``T{seqlen}_depth{100 depth_min}-{100 depth_max}`` (e.g. ``"T1024_depth25-50"``; the training
    slice is ``T{seqlen}_depth0-100``). The default test grid is 1x, 2x and 4x the training seqlen
    crossed with ``num_depth_buckets`` equal depth ranges. Items carry, besides
    ``input_ids``/``labels``/``slice``, ``"prompt_len"`` (the same for the whole slice) and
    ``"depth"`` (float64).
    """

    vocab_size = 256

    def _configure_retrieval(self, seqlen, test_configs, num_depth_buckets, **kwargs) -> None:
        self.num_depth_buckets = _check_int(num_depth_buckets, "num_depth_buckets", 1)
        self.configure({"seqlen": seqlen, "depth_min": 0.0, "depth_max": 1.0}, test_configs, **kwargs)

    def check_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``{"seqlen"[, "depth_min", "depth_max"]}`` for this task's settings."""
        if "seqlen" not in config:
            raise ValueError("a retrieval slice config needs the key 'seqlen'")
        config = {"depth_min": 0.0, "depth_max": 1.0, **config}
        self._check_task_config(config["seqlen"], config["depth_min"], config["depth_max"])
        return {
            "seqlen": int(config["seqlen"]),
            "depth_min": float(config["depth_min"]),
            "depth_max": float(config["depth_max"]),
        }

    def _check_task_config(self, seqlen, depth_min, depth_max) -> None:
        raise NotImplementedError

    def slice_name(self, config) -> str:
        """``T{seqlen}_depth{lo}-{hi}`` with the depth range in percent, e.g. ``"T512_depth0-25"``."""
        return f"T{config['seqlen']}_{depth_bucket_name(config['depth_min'], config['depth_max'])}"

    def default_test_configs(self) -> list[dict[str, Any]]:
        """1x, 2x and 4x the training seqlen, each cut into ``num_depth_buckets`` depth ranges."""
        buckets = self.num_depth_buckets
        return [
            {
                "seqlen": self.train_config["seqlen"] * m,
                "depth_min": b / buckets,
                "depth_max": (b + 1) / buckets,
            }
            for m in (1, 2, 4)
            for b in range(buckets)
        ]


class PasskeyDataModule(_RetrievalDataModule):
    """Passkey retrieval (Mohtashami & Jaggi 2023) at byte level, as a seeded data module.

    See :mod:`data.retrieval` for the prompt and the slice configs. ``vocab_size`` is 256.

    Args:
        seqlen: training example length in bytes (default 512).
        num_digits: pass-key digits, the answer's length (default 5, as the paper's up to 50000).
        test_configs: list of ``{"seqlen"[, "depth_min", "depth_max"]}``; default the grid of
            1x/2x/4x seqlen by ``num_depth_buckets`` depth ranges.
        num_depth_buckets: depth ranges per length of the default grid (default 4).
        num_train_examples: training examples (default 5_000).
        num_test_examples: examples per test slice (default 100).
        batch_size: examples per batch (default 32).
        seed: base seed of the scheme of :class:`data.synthetic.SyntheticDataModule` (default 0).
        num_workers: DataLoader worker processes (default 0).

    Raises:
        TypeError/ValueError: an invalid setting (see :func:`check_passkey_config`), e.g. a seqlen
            too short for the prompt.
    """

    def __init__(
        self,
        seqlen: int = 512,
        num_digits: int = 5,
        test_configs: list[dict[str, Any]] | None = None,
        num_depth_buckets: int = 4,
        num_train_examples: int = 5_000,
        num_test_examples: int = 100,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.num_digits = _check_int(num_digits, "num_digits", 1)
        self._configure_retrieval(
            seqlen,
            test_configs,
            num_depth_buckets,
            num_train_examples=num_train_examples,
            num_test_examples=num_test_examples,
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
        )

    def _check_task_config(self, seqlen, depth_min, depth_max) -> None:
        check_passkey_config(seqlen, self.num_digits, depth_min, depth_max)

    def make_slice(self, config, num_examples: int, seed: int) -> TaskSlice:
        """Passkey examples of ``config`` from ``seed``; extras ``prompt_len`` and ``depth``."""
        input_ids, labels, depth = passkey_examples(
            num_examples, seed=seed, num_digits=self.num_digits, **config
        )
        prompt_len = torch.full((num_examples,), config["seqlen"] - self.num_digits, dtype=torch.int64)
        extras = {"prompt_len": prompt_len, "depth": depth}
        return TaskSlice(input_ids, labels, self.slice_name(config), config, seed, extras)


class MultiKeyNeedleDataModule(_RetrievalDataModule):
    """Multi-key needle retrieval (RULER's multi-key NIAH) at byte level, as a seeded data module.

    See :mod:`data.retrieval` for the prompt and the slice configs. ``vocab_size`` is 256.

    Args:
        seqlen: training example length in bytes (default 512).
        key_digits: digits per key (default 4).
        value_digits: digits per value, the answer's length (default 4).
        test_configs: list of ``{"seqlen"[, "depth_min", "depth_max"]}``; default the grid of
            1x/2x/4x seqlen by ``num_depth_buckets`` depth ranges.
        num_depth_buckets: depth ranges per length of the default grid (default 4).
        num_train_examples: training examples (default 5_000).
        num_test_examples: examples per test slice (default 100).
        batch_size: examples per batch (default 32).
        seed: base seed of the scheme of :class:`data.synthetic.SyntheticDataModule` (default 0).
        num_workers: DataLoader worker processes (default 0).

    Raises:
        TypeError/ValueError: an invalid setting (see :func:`check_multikey_config`), e.g. a seqlen
            too short for two needles.
    """

    def __init__(
        self,
        seqlen: int = 512,
        key_digits: int = 4,
        value_digits: int = 4,
        test_configs: list[dict[str, Any]] | None = None,
        num_depth_buckets: int = 4,
        num_train_examples: int = 5_000,
        num_test_examples: int = 100,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.key_digits = _check_int(key_digits, "key_digits", 1)
        self.value_digits = _check_int(value_digits, "value_digits", 1)
        self._configure_retrieval(
            seqlen,
            test_configs,
            num_depth_buckets,
            num_train_examples=num_train_examples,
            num_test_examples=num_test_examples,
            batch_size=batch_size,
            seed=seed,
            num_workers=num_workers,
        )

    def _check_task_config(self, seqlen, depth_min, depth_max) -> None:
        check_multikey_config(seqlen, self.key_digits, self.value_digits, depth_min, depth_max)

    def make_slice(self, config, num_examples: int, seed: int) -> TaskSlice:
        """Multi-key needle examples of ``config`` from ``seed``; extras ``prompt_len`` and ``depth``."""
        input_ids, labels, depth = multikey_needle_examples(
            num_examples, seed=seed, key_digits=self.key_digits, value_digits=self.value_digits, **config
        )
        prompt_len = torch.full((num_examples,), config["seqlen"] - self.value_digits, dtype=torch.int64)
        extras = {"prompt_len": prompt_len, "depth": depth}
        return TaskSlice(input_ids, labels, self.slice_name(config), config, seed, extras)

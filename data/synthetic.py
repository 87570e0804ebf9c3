"""Shared machinery of the synthetic evaluation tasks: slices, the seed scheme, the data module base
class and the scorers.

The tasks themselves live in :mod:`data.copying` (Jelassi et al. 2024), :mod:`data.selective_copying`
and :mod:`data.induction` (Gu & Dao 2023) and :mod:`data.retrieval` (passkey, Mohtashami & Jaggi
2023; multi-key needle, Hsieh et al. 2024). Each is a :class:`SyntheticDataModule` subclass that
describes one *slice* (a fixed set of examples of one setting, e.g. one length range) by a plain
dict of settings, its ``config``; the base class turns a training config and a list of test configs
into seeded training, validation and test slices exactly as :class:`data.mqar.MQARDataModule` does.

Scoring follows the language-model convention of every data module here: the model's output at
position t predicts token t + 1, and ``labels`` holds the token to predict at the scored positions
and ``IGNORE_INDEX`` elsewhere. The scorers take either logits ``(B, T, V)`` or predicted token ids
``(B, T)`` aligned with ``labels``; :func:`generated_to_predictions` aligns a greedy generation the
same way, so teacher-forced and generated outputs are scored by the same functions.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from data.distributed import eval_sampler
from data.mqar import IGNORE_INDEX, MAX_SLICES, SEED_STRIDE, SLICES_WHY, _check_int
from data.resumable import ResumableTrainData, worker_init_fn


def check_depth_range(depth_min, depth_max) -> tuple[float, float]:
    """Validate a needle-depth range ``[depth_min, depth_max)`` (closed at 1.0) and return it as floats.

    Raises:
        TypeError: a bound is not a real number.
        ValueError: not ``0 <= depth_min < depth_max <= 1``.
    """
    for name, value in (("depth_min", depth_min), ("depth_max", depth_max)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= depth_min < depth_max <= 1.0:
        raise ValueError(
            f"the depth range must satisfy 0 <= depth_min < depth_max <= 1, got [{depth_min}, {depth_max}); "
            "e.g. depth_min=0.0 depth_max=0.25 for the first quarter of the context"
        )
    return float(depth_min), float(depth_max)


def depth_positions(depth_min: float, depth_max: float, num_positions: int) -> tuple[int, int]:
    """The positions ``a`` in ``{0, ..., num_positions}`` whose depth ``a / num_positions`` lies in
    ``[depth_min, depth_max)`` (or in ``[depth_min, 1]`` when ``depth_max == 1``).

    Returns:
        ``(first, last)``, inclusive; ``first > last`` when no position qualifies. With
        ``num_positions == 0`` the only position is 0, at depth 0.
    """
    if num_positions == 0:
        return (0, 0) if depth_min == 0.0 else (1, 0)
    eps = 1e-9  # depth_min * n may round just above an integer that belongs to the range
    first = math.ceil(depth_min * num_positions - eps)
    last = num_positions if depth_max >= 1.0 else math.ceil(depth_max * num_positions - eps) - 1
    return first, last


def depth_bucket_name(depth_min: float, depth_max: float) -> str:
    """Slice-name part of a depth range in percent, e.g. ``(0.25, 0.5) -> "depth25-50"``."""
    return f"depth{round(100 * depth_min)}-{round(100 * depth_max)}"


class TaskSlice(Dataset):
    """A fixed set of examples of one synthetic-task setting.

    Attributes: ``input_ids`` and ``labels`` (N, T) int64 (``labels`` is ``IGNORE_INDEX`` where
    unscored), ``name`` (the slice key), ``config`` (the task settings that produced it), ``seed``,
    ``seqlen`` (T) and ``extras`` (per-example values such as ``prompt_len`` or ``depth``, each an
    (N,) tensor). Item i is ``{"input_ids": (T,) int64, "labels": (T,) int64, "slice": name,
    **{key: extras[key][i]}}``; PyTorch's default collate turns a list of items into a batch with
    (B, T) tensors, ``"slice"`` a list of B names and each extra a (B,) tensor.

    Raises:
        ValueError: ``input_ids`` and ``labels`` differ in shape or are not 2-D, or an extra does
            not hold one value per example.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        name: str,
        config: Mapping[str, Any],
        seed: int,
        extras: Mapping[str, torch.Tensor] | None = None,
    ):
        if input_ids.ndim != 2 or input_ids.shape != labels.shape:
            raise ValueError(
                f"input_ids and labels must both be (N, T), got {tuple(input_ids.shape)} and {tuple(labels.shape)}"
            )
        extras = dict(extras or {})
        for key, values in extras.items():
            if values.shape != input_ids.shape[:1]:
                raise ValueError(
                    f"extra {key!r} must hold one value per example, got shape {tuple(values.shape)}"
                )
        self.input_ids = input_ids
        self.labels = labels
        self.name = name
        self.config = dict(config)
        self.seed = seed
        self.seqlen = input_ids.shape[1]
        self.extras = extras

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        item = {"input_ids": self.input_ids[index], "labels": self.labels[index], "slice": self.name}
        item.update({key: values[index] for key, values in self.extras.items()})
        return item


class SyntheticDataModule(ResumableTrainData, L.LightningDataModule):
    """Base class of the synthetic-task data modules: seeded train / validation / test slices.

    A subclass describes its task through four methods -- :meth:`check_config` (validate and
    normalise one slice config), :meth:`slice_name`, :meth:`make_slice` (generate examples) and
    :meth:`default_test_configs` -- and calls :meth:`configure` from its ``__init__``.

    Seed scheme (the one of :class:`data.mqar.MQARDataModule`, so no seed of one set equals a seed
    of another, for any base seed): training examples use ``train_seed = seed * SEED_STRIDE``; the
    i-th test config is drawn as a test slice from ``seed * SEED_STRIDE + 1 + i`` and as a
    validation slice from ``seed * SEED_STRIDE + SEED_STRIDE // 2 + i``. The training order of each
    pass is a permutation seeded by ``(seed, the run's torch seed, pass)`` (:meth:`train_dataloader`).

    Attributes (after :meth:`configure`): ``train_config``, ``test_configs`` (normalised dicts),
    ``train_slice_name``, ``slice_names`` (evaluation slices in ``test_configs`` order),
    ``slice_seqlens`` (slice name -> example length, training slice included), ``train_seed``,
    ``val_seeds``, ``test_seeds``, ``batch_size``; after the matching ``setup`` stage ``train_set``,
    ``val_sets`` and ``test_sets`` (:class:`TaskSlice` objects). Subclasses set ``vocab_size``.

    Batches are ``{"input_ids": (B, T) int64, "labels": (B, T) int64, "slice": list[str] of B, ...}``
    plus the task's per-example extras; ``val_dataloader()`` and ``test_dataloader()`` return one
    DataLoader per slice, in ``slice_names`` order.
    """

    test_config_inherits: tuple[str, ...] = ()
    """Keys a test config may omit, taking the training config's value instead."""

    def configure(
        self,
        train_config: Mapping[str, Any],
        test_configs: Sequence[Mapping[str, Any]] | None,
        *,
        num_train_examples: int,
        num_test_examples: int,
        batch_size: int,
        seed: int,
        num_workers: int,
    ) -> None:
        """Validate the settings and derive the slices and seeds (no data is generated here).

        Raises:
            TypeError/ValueError: an invalid setting, a malformed ``test_configs`` list (not a list
                of mappings, unknown or missing keys, more than ``MAX_SLICES`` entries, two entries
                with the same slice name), or a config the task rejects.
        """
        self.num_train_examples = _check_int(num_train_examples, "num_train_examples", 1)
        self.num_test_examples = _check_int(num_test_examples, "num_test_examples", 1)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.num_workers = _check_int(num_workers, "num_workers", 0)
        self.train_config = self.check_config(dict(train_config))
        if test_configs is None:
            self.test_configs = [self.check_config(cfg) for cfg in self.default_test_configs()]
        else:
            self.test_configs = self._parse_test_configs(test_configs)
        self.train_slice_name = self.slice_name(self.train_config)
        self.slice_names = [self.slice_name(cfg) for cfg in self.test_configs]
        duplicates = sorted({n for n in self.slice_names if self.slice_names.count(n) > 1})
        if duplicates:
            raise ValueError(f"test_configs lists the same slice more than once: {duplicates}")
        self.slice_seqlens = {self.train_slice_name: self.train_config["seqlen"]}
        self.slice_seqlens.update(
            {name: cfg["seqlen"] for name, cfg in zip(self.slice_names, self.test_configs, strict=True)}
        )
        self.train_seed = self.seed * SEED_STRIDE
        self.test_seeds = [self.train_seed + 1 + i for i in range(len(self.test_configs))]
        self.val_seeds = [self.train_seed + SEED_STRIDE // 2 + i for i in range(len(self.test_configs))]
        self.train_set: TaskSlice | None = None
        self.val_sets: list[TaskSlice] | None = None
        self.test_sets: list[TaskSlice] | None = None

    def _parse_test_configs(self, test_configs) -> list[dict[str, Any]]:
        """Normalised test configs from a list of mappings; omitted inheritable keys come from training."""
        if isinstance(test_configs, (str, Mapping)) or not isinstance(test_configs, Sequence):
            raise TypeError(
                f"test_configs must be a list of mappings with keys from {sorted(self.train_config)}, "
                f"got {type(test_configs).__name__}"
            )
        if not 1 <= len(test_configs) <= MAX_SLICES:
            raise ValueError(
                f"test_configs must hold between 1 and {MAX_SLICES} slices ({SLICES_WHY}), "
                f"got {len(test_configs)}"
            )
        configs = []
        for i, cfg in enumerate(test_configs):
            if not isinstance(cfg, Mapping):
                raise ValueError(f"test_configs[{i}] must be a mapping, got {cfg!r}")
            unknown = sorted(set(cfg) - set(self.train_config))
            if unknown:
                raise ValueError(
                    f"test_configs[{i}] has unknown keys {unknown}; valid keys: {sorted(self.train_config)}"
                )
            inherited = {key: self.train_config[key] for key in self.test_config_inherits}
            try:
                configs.append(self.check_config({**inherited, **cfg}))
            except (TypeError, ValueError) as err:  # say which entry, keep the type
                raise type(err)(f"test_configs[{i}]: {err}") from None
        return configs

    def check_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate one slice config and return it normalised (every key present, plain types).

        Implemented by each task; errors in ``test_configs`` entries get the entry's index prefixed
        (``"test_configs[1]: ..."``) by the caller.

        Raises:
            TypeError/ValueError: a missing key or an invalid setting, saying how to fix it.
        """
        raise NotImplementedError

    def slice_name(self, config: Mapping[str, Any]) -> str:
        """The slice key of a normalised config (no ``=``: it ends up in metric and file names)."""
        raise NotImplementedError

    def make_slice(self, config: Mapping[str, Any], num_examples: int, seed: int) -> TaskSlice:
        """Generate ``num_examples`` examples of a normalised config from ``seed`` (deterministic)."""
        raise NotImplementedError

    def default_test_configs(self) -> list[dict[str, Any]]:
        """The test configs used when ``test_configs`` is None (unvalidated; :meth:`configure` checks them)."""
        raise NotImplementedError

    def generate_slice(
        self, config: Mapping[str, Any], num_examples: int, seed: int | None = None
    ) -> TaskSlice:
        """Build one extra evaluation slice with this module's task settings (for eval scripts).

        Args:
            config: slice settings; omitted keys are inherited as for ``test_configs``.
            num_examples: examples to draw (>= 1).
            seed: ``None`` takes the next unused test seed (``seed * SEED_STRIDE + 1 +
                len(test_configs)``).

        Returns:
            :class:`TaskSlice` of (N, T) int64 tensors.

        Raises:
            ValueError: an invalid config or count, or ``seed`` equal to the training or a validation
                seed (the slice would repeat examples the model was trained or selected on).
        """
        config = self._parse_test_configs([config])[0]
        num_examples = _check_int(num_examples, "num_examples", 1)
        if seed is None:
            seed = self.train_seed + 1 + len(self.test_configs)
        if seed == self.train_seed or seed in self.val_seeds:
            raise ValueError(
                f"seed {seed} is this module's training or validation seed, so the slice would repeat "
                "examples the model was trained or selected on; pass another seed or None"
            )
        return self.make_slice(config, num_examples, _check_int(seed, "seed", 0))

    def setup(self, stage: str | None = None) -> None:
        """Generate the data a stage needs (deterministic; each set is made once, then cached).

        ``stage`` None makes every set; ``"fit"`` the training set and the validation slices;
        ``"validate"`` the validation slices; ``"test"`` and ``"predict"`` the test slices.
        """
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = self.make_slice(self.train_config, self.num_train_examples, self.train_seed)
        if stage in (None, "fit", "validate") and self.val_sets is None:
            self.val_sets = self._slices(self.val_seeds)
        if stage in (None, "test", "predict") and self.test_sets is None:
            self.test_sets = self._slices(self.test_seeds)

    def _slices(self, seeds: list[int]) -> list[TaskSlice]:
        return [
            self.make_slice(cfg, self.num_test_examples, seed)
            for cfg, seed in zip(self.test_configs, seeds, strict=True)
        ]

    def dataloader(self, dataset: Dataset, shuffle: bool = False) -> DataLoader:
        """A DataLoader over ``dataset`` (e.g. from :meth:`generate_slice`) with this module's settings.

        ``shuffle=False`` (evaluation): in order; under a multi-process Trainer, this process's
        share of the examples, none repeated (:func:`data.distributed.eval_sampler`).

        Raises:
            ValueError: under a multi-process Trainer, fewer examples than processes.
        """
        sampler = None if shuffle else eval_sampler(SequentialSampler(dataset), self.trainer)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=worker_init_fn(self.num_workers, self.trainer),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of the training set, a new order every pass, a function of (``seed``, the
        process's torch seed (``torch.initial_seed()``: train.py's ``seed=``), pass); a resumed fit
        continues the order where its checkpoint left it (:class:`data.resumable.ResumableLoader`).

        Raises:
            RuntimeError: :meth:`setup` has not made the training set.
        """
        if self.train_set is None:
            raise RuntimeError(
                "call setup() or setup('fit') before train_dataloader() (Lightning's Trainer does it)"
            )
        return self.shuffled_loader(self.train_set)

    def val_dataloader(self) -> list[DataLoader]:
        """One DataLoader per validation slice, in ``slice_names`` order.

        Raises:
            RuntimeError: :meth:`setup` has not made the validation slices.
        """
        if self.val_sets is None:
            raise RuntimeError(
                "call setup('fit') or setup('validate') before val_dataloader() (Lightning's Trainer does it)"
            )
        return [self.dataloader(val_set) for val_set in self.val_sets]

    def test_dataloader(self) -> list[DataLoader]:
        """One DataLoader per test slice (other examples than validation's), in ``slice_names`` order.

        Raises:
            RuntimeError: :meth:`setup` has not made the test slices.
        """
        if self.test_sets is None:
            raise RuntimeError("call setup('test') before test_dataloader() (Lightning's Trainer does it)")
        return [self.dataloader(test_set) for test_set in self.test_sets]


def scored_correct(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions are scored and which of them the outputs get right.

    Args:
        outputs: logits ``(B, T, V)`` (any float dtype; the argmax is the prediction) or predicted
            token ids ``(B, T)`` (any integer dtype), aligned with ``labels``: the output at
            position t predicts token t + 1.
        labels: ``(B, T)`` integer, ``IGNORE_INDEX`` (-100) where unscored.

    Returns:
        ``(correct, scored)``, both ``(B, T)`` bool; ``correct`` is False where unscored.

    Raises:
        ValueError: shapes that do not match as above, non-integer labels, or a row of ``labels``
            without any scored position (its exact match would be undefined).
    """
    if outputs.is_floating_point():
        if outputs.ndim != 3:
            raise ValueError(f"logits must be (B, T, V), got shape {tuple(outputs.shape)}")
        outputs = outputs.argmax(-1)  # (B, T)
    if outputs.shape != labels.shape or labels.ndim != 2:
        raise ValueError(
            f"predictions {tuple(outputs.shape)} and labels {tuple(labels.shape)} must both be (B, T)"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
    scored = labels != IGNORE_INDEX  # (B, T)
    if not scored.any(dim=1).all():
        row = int((~scored.any(dim=1)).nonzero()[0])
        raise ValueError(f"labels row {row} has no scored position (every label is {IGNORE_INDEX})")
    return (outputs == labels) & scored, scored


def exact_match(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, whether every scored position is predicted right (a whole answer is correct).

    Args:
        outputs: logits ``(B, T, V)`` or predictions ``(B, T)``, see :func:`scored_correct`.
        labels: ``(B, T)`` integer, ``IGNORE_INDEX`` where unscored.

    Returns:
        ``(B,)`` bool.

    Raises:
        ValueError: see :func:`scored_correct`.
    """
    correct, scored = scored_correct(outputs, labels)
    return (correct == scored).all(dim=1)


def token_accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, the fraction of scored positions predicted right.

    Args:
        outputs: logits ``(B, T, V)`` or predictions ``(B, T)``, see :func:`scored_correct`.
        labels: ``(B, T)`` integer, ``IGNORE_INDEX`` where unscored.

    Returns:
        ``(B,)`` float64 in [0, 1].

    Raises:
        ValueError: see :func:`scored_correct`.
    """
    correct, scored = scored_correct(outputs, labels)
    return correct.sum(dim=1, dtype=torch.float64) / scored.sum(dim=1, dtype=torch.float64)


def generated_to_predictions(sequences: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Align generated sequences with ``labels`` so the scorers above can score a generation.

    A generation from a prompt of P tokens returns the prompt followed by the new tokens
    (``LanguageModel.generate``); the token it emitted after position t is ``sequences[:, t + 1]``,
    which is what a teacher-forced argmax at position t predicts. So ``predictions[:, t] =
    sequences[:, t + 1]`` for ``t < seqlen``, and -1 (never a label) where the generation stopped
    short. Pass the task's ``input_ids[:, :P]`` as the prompt and generate at least
    ``seqlen - P`` tokens to cover every label.

    Args:
        sequences: ``(B, S)`` integer, prompt plus generated tokens.
        seqlen: T, the length of the ``labels`` to score against.

    Returns:
        ``(B, T)`` int64.

    Raises:
        ValueError: ``sequences`` is not 2-D or ``seqlen < 1``.
    """
    seqlen = _check_int(seqlen, "seqlen", 1)
    if sequences.ndim != 2:
        raise ValueError(f"sequences must be (B, S), got shape {tuple(sequences.shape)}")
    predictions = sequences.new_full((sequences.shape[0], seqlen), -1, dtype=torch.int64)
    shifted = sequences[:, 1 : seqlen + 1]  # (B, min(S - 1, T))
    predictions[:, : shifted.shape[1]] = shifted
    return predictions

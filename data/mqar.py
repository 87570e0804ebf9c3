"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology.

Source: Arora, Eyuboglu, Timalsina et al., "Zoology: Measuring and Improving Recall in Efficient
Language Models" (ICLR 2024), Section 3.1 and Appendix E.1; the semantics below follow the
`multiquery_ar` generator of the reference implementation (HazyResearch/zoology,
`zoology/data/associative_recall.py`), re-implemented here with a local random generator.

One example of length T with ``num_kv_pairs = k`` (written with ``vocab_size = V``)::

    position   0   1   2   3  ...  2k-2 2k-1 | 2k ...                               T-1
    input_ids  k1  v1  k2  v2 ...  kk   vk   | filler, with key k_j at 2k + 2*gap_j
    labels    -100 everywhere except at 2k + 2*gap_j, where the label is v_j

* keys are k distinct tokens from ``[1, V // 2)``, values k distinct tokens from ``[V // 2, V)``;
* every key is queried exactly once, in the region after the context, at an even offset
  ``2 * gap_j``; the gaps are k distinct draws from ``{0, ..., T/2 - k - 1}`` with the power law
  ``p(gap = i - 1) ∝ power_a * i ** (power_a - 1)``, so small gaps (queries close to the context)
  are most likely (Zoology Appendix E.1: in real text, the distance between repeated bigrams
  follows a power law); ``power_a = 1`` is uniform;
* the label sits at the query key's own position because a language model's output at position t
  predicts token t + 1: the model must answer "which value followed this key?" right after
  reading the key again. The value itself is never written after the query;
* filler tokens are 0, or, with ``random_non_queries``, uniform random tokens from ``[0, V)``
  (which may coincide with keys or values, as in Zoology).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from data.distributed import eval_sampler
from data.resumable import ResumableTrainData, worker_init_fn

IGNORE_INDEX = -100
"""Label of every position that carries no loss (PyTorch's ``cross_entropy`` default)."""

SEED_STRIDE = 1000
"""Seeds of one data module are ``seed * SEED_STRIDE + i``: i = 0 trains, ``1 <= i < SEED_STRIDE/2``
are test slices, ``i >= SEED_STRIDE/2`` validation slices (see :class:`MQARDataModule`)."""

MAX_SLICES = SEED_STRIDE // 2 - 2
"""Most evaluation slices one module may hold (its test seeds, plus one extra for
:meth:`MQARDataModule.generate_slice`, stay below the validation seeds)."""

SLICES_WHY = (
    "at least one, whose metrics are val/acc and val/loss, and at most the slices whose examples have "
    "seeds of their own"
)
"""Why test_configs' length is bounded, for the refusal's message."""


def _check_int(value, name: str, minimum: int) -> int:
    """Return ``value`` as an ``int``; raise ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_mqar_config(vocab_size: int, seqlen: int, num_kv_pairs: int) -> None:
    """Validate one MQAR configuration (Zoology's generator asserts, as clear errors).

    Args:
        vocab_size: number of token ids V.
        seqlen: example length T in tokens.
        num_kv_pairs: key-value pairs k per example.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: T is odd (queries sit at even offsets); ``vocab_size <= seqlen``; or
            ``4 * num_kv_pairs > seqlen`` (the context takes 2k tokens and the k queries need k
            distinct even slots after it).
    """
    vocab_size = _check_int(vocab_size, "vocab_size", 4)
    seqlen = _check_int(seqlen, "seqlen", 4)
    num_kv_pairs = _check_int(num_kv_pairs, "num_kv_pairs", 1)
    if seqlen % 2 != 0:
        raise ValueError(f"seqlen must be even (queries sit at even offsets), got {seqlen}")
    if vocab_size <= seqlen:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be larger than seqlen ({seqlen}), as in Zoology's MQAR; "
            f"raise vocab_size to at least {seqlen + 1} or use a shorter seqlen"
        )
    if 4 * num_kv_pairs > seqlen:
        raise ValueError(
            f"num_kv_pairs * 4 must be <= seqlen (2k context tokens plus k queries at distinct even "
            f"offsets), got num_kv_pairs={num_kv_pairs}, seqlen={seqlen}; use num_kv_pairs <= {seqlen // 4}"
        )


def _sample_distinct_uniform(rng: np.random.Generator, num_rows: int, low: int, high: int, size: int):
    """``size`` distinct integers from ``[low, high)`` per row, in random order: (num_rows, size) int64.

    A per-row loop: numpy's ``choice(replace=False)`` is a partial shuffle in C (a few µs per row),
    while a vectorised top-k over a (rows, high - low) random matrix costs far more for large V.
    """
    out = np.empty((num_rows, size), dtype=np.int64)
    for row in range(num_rows):
        out[row] = rng.choice(high - low, size=size, replace=False)
    return out + low


def _sample_distinct_weighted(rng: np.random.Generator, num_rows: int, log_w: np.ndarray, size: int):
    """``size`` distinct indices of ``log_w`` per row, drawn one after another without replacement
    ∝ p = exp(log_w) (unnormalised: a constant shift of log_w changes nothing).

    Gumbel-top-k (Kool, van Hoof & Welling 2019, "Stochastic Beams and Where to Find Them", Eq. 2):
    the indices of the k largest ``log p_i + Gumbel_i`` in decreasing order have exactly the law of
    k successive draws without replacement ∝ p, which is what ``choice(replace=False, p=p)`` does
    row by row, here vectorised over rows. Returns (num_rows, size) int64.
    """
    scores = log_w[None, :] + rng.gumbel(size=(num_rows, log_w.shape[0]))  # (N, space)
    top = np.argpartition(-scores, size - 1, axis=1)[:, :size]  # (N, k), unordered
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1).astype(np.int64)


def check_power_a(power_a: float) -> None:
    """Validate MQAR's query-gap exponent: a finite real number > 0.

    Raises:
        ValueError: ``power_a`` is not a number (or is a bool), is <= 0, or is not finite.
    """
    if isinstance(power_a, bool) or not isinstance(power_a, numbers.Real) or not power_a > 0:
        raise ValueError(f"power_a must be a number > 0 (1.0 is uniform query placement), got {power_a!r}")
    if not math.isfinite(power_a):
        raise ValueError(
            f"power_a must be finite, got {power_a!r}; a large value (e.g. 1000) puts the queries at the "
            "largest gaps from the context"
        )


def multiquery_ar(
    vocab_size: int,
    num_examples: int,
    input_seq_len: int,
    seed: int,
    power_a: float = 0.01,
    num_kv_pairs: int = 8,
    random_non_queries: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate MQAR examples with Zoology's ``multiquery_ar`` semantics (see the module docstring).

    Args:
        vocab_size: V; keys come from ``[1, V // 2)``, values from ``[V // 2, V)``.
        num_examples: N, number of examples (>= 1).
        input_seq_len: T, tokens per example (even, < V, >= 4 * num_kv_pairs).
        seed: seed of a local ``numpy.random.Generator`` (the global RNGs are untouched); the same
            arguments give the same tensors.
        power_a: exponent a > 0 of the query-gap law ``p(i) ∝ a * i**(a - 1)``, i = 1 ... T/2 - k;
            small a puts queries close to the context, a = 1 is uniform.
        num_kv_pairs: k, key-value pairs per example; each key is queried once.
        random_non_queries: replace the filler token 0 with uniform random tokens from [0, V).

    Returns:
        ``(input_ids, labels)``, both (N, T) int64. ``labels`` is ``IGNORE_INDEX`` (-100) except
        at the k query positions, where it holds the queried key's value.

    Raises:
        TypeError: a count is not an integer.
        ValueError: an invalid configuration (see :func:`check_mqar_config`), ``num_examples < 1``,
            ``power_a`` not a finite number > 0 (:func:`check_power_a`) or a negative seed.
    """
    check_mqar_config(vocab_size, input_seq_len, num_kv_pairs)
    num_examples = _check_int(num_examples, "num_examples", 1)
    seed = _check_int(seed, "seed", 0)
    check_power_a(power_a)
    rng = np.random.default_rng(seed)
    k, T = num_kv_pairs, input_seq_len
    context_len = 2 * k
    half = vocab_size // 2

    keys = _sample_distinct_uniform(rng, num_examples, 1, half, k)  # (N, k)
    values = _sample_distinct_uniform(rng, num_examples, half, vocab_size, k)  # (N, k)

    # Gap i - 1 for i = 1 ... space has weight a * i**(a - 1): a power law decaying with the gap.
    # In log space, less log(a * space**(a - 1)): i**(a - 1) itself overflowed from a ~ 200 at T 64,
    # and the NaN weights gave every example the same gaps. Here the log weights lie in
    # [-(a - 1) log(space), 0] for a >= 1 (-inf where that underflows, never chosen) and in
    # [0, log(space)) for a < 1.
    space = (T - context_len) // 2
    log_ranks = np.log(np.arange(1, space + 1, dtype=np.float64))
    with np.errstate(over="ignore"):
        log_w = (power_a - 1.0) * (log_ranks - log_ranks[-1])
    gaps = _sample_distinct_weighted(rng, num_examples, log_w, k)  # (N, k), key j is queried at gap j

    input_ids = np.zeros((num_examples, T), dtype=np.int64)
    input_ids[:, 0:context_len:2] = keys
    input_ids[:, 1:context_len:2] = values
    query_pos = context_len + 2 * gaps  # (N, k), <= T - 2
    np.put_along_axis(input_ids, query_pos, keys, axis=1)

    labels = np.full((num_examples, T), IGNORE_INDEX, dtype=np.int64)
    np.put_along_axis(labels, query_pos, values, axis=1)

    if random_non_queries:
        # Keys are >= 1 and values >= V // 2 >= 1, so the zeros are exactly the filler.
        filler = input_ids == 0
        input_ids[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    return torch.from_numpy(input_ids), torch.from_numpy(labels)


def slice_name(seqlen: int, num_kv_pairs: int) -> str:
    """Name of the MQAR slice with these settings, e.g. ``slice_name(64, 4) == "T64_kv4"``.

    Names contain no ``=`` (they end up in metric keys and file names).
    """
    return f"T{seqlen}_kv{num_kv_pairs}"


def parse_slice_name(name: str) -> tuple[int, int]:
    """Inverse of :func:`slice_name`: ``"T64_kv4" -> (64, 4)``; ``ValueError`` on another format."""
    match = re.fullmatch(r"T(\d+)_kv(\d+)", name)
    if match is None:
        raise ValueError(f"not an MQAR slice name (expected like 'T64_kv4'): {name!r}")
    return int(match.group(1)), int(match.group(2))


class MQARSlice(Dataset):
    """A fixed set of MQAR examples sharing one ``(seqlen, num_kv_pairs)`` setting.

    Attributes: ``input_ids`` and ``labels`` (N, T) int64, ``seqlen``, ``num_kv_pairs``, ``seed``,
    ``name`` (:func:`slice_name`). Item i is ``{"input_ids": (T,) int64, "labels": (T,) int64,
    "slice": name}``; PyTorch's default collate turns a list of items into a batch dict with
    (B, T) tensors and ``"slice"`` a list of B names.
    """

    def __init__(
        self, input_ids: torch.Tensor, labels: torch.Tensor, seqlen: int, num_kv_pairs: int, seed: int
    ):
        self.input_ids = input_ids
        self.labels = labels
        self.seqlen = seqlen
        self.num_kv_pairs = num_kv_pairs
        self.seed = seed
        self.name = slice_name(seqlen, num_kv_pairs)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index], "slice": self.name}


def _parse_test_configs(test_configs, seqlen: int, num_kv_pairs: int) -> list[tuple[int, int]]:
    """Turn ``test_configs`` (None or a list of ``{seqlen, num_kv_pairs}`` mappings) into pairs."""
    if test_configs is None:
        return [(seqlen * m, num_kv_pairs * m) for m in (1, 2, 4)]
    if isinstance(test_configs, (str, Mapping)) or not isinstance(test_configs, Sequence):
        raise TypeError(
            "test_configs must be a list of {seqlen: int, num_kv_pairs: int} mappings, "
            f"got {type(test_configs).__name__}"
        )
    if not 1 <= len(test_configs) <= MAX_SLICES:
        raise ValueError(
            f"test_configs must hold between 1 and {MAX_SLICES} slices ({SLICES_WHY}), "
            f"got {len(test_configs)}"
        )
    pairs = []
    for i, cfg in enumerate(test_configs):
        if not isinstance(cfg, Mapping) or set(cfg.keys()) != {"seqlen", "num_kv_pairs"}:
            raise ValueError(
                f"test_configs[{i}] must be a mapping with exactly the keys 'seqlen' and 'num_kv_pairs', "
                f"got {cfg!r}"
            )
        pairs.append(
            (
                _check_int(cfg["seqlen"], f"test_configs[{i}].seqlen", 4),
                _check_int(cfg["num_kv_pairs"], f"test_configs[{i}].num_kv_pairs", 1),
            )
        )
    names = [slice_name(*pair) for pair in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"test_configs lists the same slice more than once: {duplicates}")
    return pairs


class MQARDataModule(ResumableTrainData, L.LightningDataModule):
    """MQAR training data and one evaluation slice per ``(seqlen, num_kv_pairs)`` test setting.

    Seed scheme (documented so results are reproducible and test data never equals training data):
    training examples use ``train_seed = seed * SEED_STRIDE``; the i-th slice (0-based, in
    ``test_configs`` order) is drawn twice, as a test slice from ``seed * SEED_STRIDE + 1 + i`` and
    as a validation slice from ``seed * SEED_STRIDE + SEED_STRIDE // 2 + i``. Validation (which
    training monitors and selects checkpoints on) and test (which evaluations report) therefore
    hold different examples of the same settings, and since at most ``MAX_SLICES`` slices are
    allowed, no seed of any set of any base seed equals a seed of another set.

    Args:
        vocab_size: V (default 512); must exceed every seqlen.
        seqlen: training example length T (default 64).
        num_kv_pairs: training key-value pairs per example (default 4).
        num_train_examples: training examples (default 20_000).
        num_test_examples: examples per test slice (default 1_000).
        test_configs: list of ``{"seqlen": int, "num_kv_pairs": int}``; default the training
            setting plus 2x and 4x seqlen with 2x and 4x pairs. Test slices may be longer than any
            training example (length extrapolation).
        batch_size: examples per batch for every loader (default 64).
        seed: base seed (>= 0) of the scheme above and, with the run's seed, of the training order
            (default 0).
        power_a: query-gap power law exponent, see :func:`multiquery_ar` (default 0.01).
        random_non_queries: random filler instead of 0 (default True).
        num_workers: DataLoader worker processes (default 0).

    Attributes: ``vocab_size``, ``train_slice_name``, ``slice_names`` (evaluation slices, in
    ``test_configs`` order), ``test_configs`` (list of ``(seqlen, num_kv_pairs)``), ``train_seed``,
    ``val_seeds``, ``test_seeds``; after the matching ``setup`` stage, ``train_set``, ``val_sets``
    and ``test_sets`` (:class:`MQARSlice` objects).

    Batches are ``{"input_ids": (B, T) int64, "labels": (B, T) int64, "slice": list[str] of B}``.
    ``val_dataloader()`` and ``test_dataloader()`` return one DataLoader per slice, in
    ``slice_names`` order (Lightning's ``dataloader_idx`` indexes ``slice_names``).

    Raises:
        TypeError/ValueError: an invalid setting, e.g. ``vocab_size`` not larger than a test
            slice's seqlen (the message says how to fix it).
    """

    def __init__(
        self,
        vocab_size: int = 512,
        seqlen: int = 64,
        num_kv_pairs: int = 4,
        num_train_examples: int = 20_000,
        num_test_examples: int = 1_000,
        test_configs: Sequence[Mapping[str, int]] | None = None,
        batch_size: int = 64,
        seed: int = 0,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_mqar_config(vocab_size, seqlen, num_kv_pairs)
        self.num_train_examples = _check_int(num_train_examples, "num_train_examples", 1)
        self.num_test_examples = _check_int(num_test_examples, "num_test_examples", 1)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.num_workers = _check_int(num_workers, "num_workers", 0)
        check_power_a(power_a)
        self.vocab_size = int(vocab_size)
        self.seqlen = int(seqlen)
        self.num_kv_pairs = int(num_kv_pairs)
        self.power_a = float(power_a)
        if not isinstance(random_non_queries, bool):  # Hydra passes random_non_queries=no as "no"
            raise TypeError(f"random_non_queries must be true or false, got {random_non_queries!r}")
        self.random_non_queries = random_non_queries

        self.test_configs = _parse_test_configs(test_configs, self.seqlen, self.num_kv_pairs)
        longest = max(self.test_configs)
        if self.vocab_size <= longest[0]:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be larger than every MQAR seqlen, but test slice "
                f"{slice_name(*longest)} has seqlen {longest[0]}; set vocab_size to at least "
                f"{longest[0] + 1} (e.g. data.vocab_size={longest[0] + 1}) or remove that slice from test_configs"
            )
        for test_seqlen, test_kv in self.test_configs:
            check_mqar_config(self.vocab_size, test_seqlen, test_kv)

        self.train_slice_name = slice_name(self.seqlen, self.num_kv_pairs)
        self.slice_names = [slice_name(*cfg) for cfg in self.test_configs]
        self.train_seed = self.seed * SEED_STRIDE
        self.test_seeds = [self.train_seed + 1 + i for i in range(len(self.test_configs))]
        self.val_seeds = [self.train_seed + SEED_STRIDE // 2 + i for i in range(len(self.test_configs))]
        self.train_set: MQARSlice | None = None
        self.val_sets: list[MQARSlice] | None = None
        self.test_sets: list[MQARSlice] | None = None

    def generate_slice(
        self, seqlen: int, num_kv_pairs: int, num_examples: int, seed: int | None = None
    ) -> MQARSlice:
        """Build one MQAR slice with this module's vocab_size, power_a and filler setting.

        For eval scripts that need extra test slices. ``seed=None`` takes the next unused test seed
        of the scheme (``seed * SEED_STRIDE + 1 + len(test_configs)``).

        Returns:
            :class:`MQARSlice` of ``num_examples`` examples, (N, seqlen) int64 tensors.

        Raises:
            ValueError: an invalid configuration, or ``seed`` equal to the training seed (the slice
                would repeat training examples).
        """
        if seed is None:
            seed = self.train_seed + 1 + len(self.test_configs)
        if seed == self.train_seed or seed in self.val_seeds:
            raise ValueError(
                f"seed {seed} is this module's training or validation seed, so the slice would repeat "
                "examples the model was trained or selected on; pass another seed or None"
            )
        input_ids, labels = multiquery_ar(
            self.vocab_size,
            num_examples,
            seqlen,
            seed,
            power_a=self.power_a,
            num_kv_pairs=num_kv_pairs,
            random_non_queries=self.random_non_queries,
        )
        return MQARSlice(input_ids, labels, seqlen, num_kv_pairs, seed)

    def setup(self, stage: str | None = None) -> None:
        """Generate the data a stage needs (deterministic; each set is made once, then cached).

        ``stage`` None makes every set; ``"fit"`` the training set and the validation slices;
        ``"validate"`` the validation slices; ``"test"`` and ``"predict"`` the test slices (so an
        evaluation never generates the training set).
        """
        if stage in (None, "fit") and self.train_set is None:
            input_ids, labels = multiquery_ar(
                self.vocab_size,
                self.num_train_examples,
                self.seqlen,
                self.train_seed,
                power_a=self.power_a,
                num_kv_pairs=self.num_kv_pairs,
                random_non_queries=self.random_non_queries,
            )
            self.train_set = MQARSlice(input_ids, labels, self.seqlen, self.num_kv_pairs, self.train_seed)
        if stage in (None, "fit", "validate") and self.val_sets is None:
            self.val_sets = self._slices(self.val_seeds)
        if stage in (None, "test", "predict") and self.test_sets is None:
            self.test_sets = self._slices(self.test_seeds)

    def _slices(self, seeds: list[int]) -> list[MQARSlice]:
        """One slice per test config, drawn from the given seeds (no seed check: internal use)."""
        return [
            MQARSlice(
                *multiquery_ar(
                    self.vocab_size,
                    self.num_test_examples,
                    seqlen,
                    seed,
                    power_a=self.power_a,
                    num_kv_pairs=num_kv_pairs,
                    random_non_queries=self.random_non_queries,
                ),
                seqlen,
                num_kv_pairs,
                seed,
            )
            for (seqlen, num_kv_pairs), seed in zip(self.test_configs, seeds, strict=True)
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
        continues the order where its checkpoint left it (:class:`data.resumable.ResumableLoader`)."""
        if self.train_set is None:
            raise RuntimeError(
                "call setup() or setup('fit') before train_dataloader() (Lightning's Trainer does it)"
            )
        return self.shuffled_loader(self.train_set)

    def val_dataloader(self) -> list[DataLoader]:
        """One DataLoader per validation slice, in ``slice_names`` order."""
        if self.val_sets is None:
            raise RuntimeError(
                "call setup('fit') or setup('validate') before val_dataloader() (Lightning's Trainer does it)"
            )
        return [self.dataloader(val_set) for val_set in self.val_sets]

    def test_dataloader(self) -> list[DataLoader]:
        """One DataLoader per test slice (other examples than validation's), in ``slice_names`` order."""
        if self.test_sets is None:
            raise RuntimeError("call setup('test') before test_dataloader() (Lightning's Trainer does it)")
        return [self.dataloader(test_set) for test_set in self.test_sets]

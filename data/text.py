"""Character- and byte-level text corpora for next-token language modelling.

Follows nanoGPT's ``shakespeare_char`` recipe (Karpathy, github.com/karpathy/nanoGPT,
``data/shakespeare_char/prepare.py``): the vocabulary is the sorted set of characters of the whole
corpus, the first 90% of the characters train and the last 10% validate, and a training example is
``seqlen + 1`` consecutive tokens split into inputs ``block[:-1]`` and next-token labels
``block[1:]``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data.distributed import eval_sampler
from data.mqar import _check_int
from data.resumable import ResumableTrainData, worker_init_fn


def _ids_to_list(ids) -> list[int]:
    """A 1-D tensor / array / iterable of token ids as a list of Python ints."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1:
            raise ValueError(f"decode expects a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        return [int(i) for i in ids.tolist()]
    return [int(i) for i in ids]


class UnknownCharacterError(ValueError):
    """A character that a :class:`CharTokenizer`'s vocabulary lacks: ``char`` at ``index`` (characters
    into the text encoded) of a vocabulary of ``vocab_size`` characters."""

    def __init__(self, char: str, index: int, vocab_size: int):
        self.char, self.index, self.vocab_size = char, index, vocab_size
        super().__init__(
            f"character {char!r} (U+{ord(char):04X}) at index {index} is not in this tokenizer's "
            f"vocabulary of {vocab_size} characters; build the tokenizer from a corpus that contains it, "
            "or use tokenizer='byte'"
        )


class CharTokenizer:
    """One token per character; ids index the vocabulary string.

    Build it from a corpus with :meth:`from_corpus` (vocabulary = sorted distinct characters,
    newlines included), or from a stored vocabulary with :meth:`from_vocab` (``vocab`` round-trips
    through a checkpoint; :meth:`to_config` / :func:`tokenizer_from_config` do it as a dict).

    Args:
        vocab: the vocabulary, one distinct character per id, in id order.

    Raises:
        TypeError: ``vocab`` is not a string.
        ValueError: ``vocab`` is empty or repeats a character.
    """

    kind = "char"

    def __init__(self, vocab: str):
        if not isinstance(vocab, str):
            raise TypeError(f"vocab must be a string of characters, got {type(vocab).__name__}")
        if not vocab:
            raise ValueError("vocab must hold at least one character")
        if len(set(vocab)) != len(vocab):
            repeated = sorted({c for c in vocab if vocab.count(c) > 1})
            raise ValueError(f"vocab repeats characters {repeated!r}; each character must appear once")
        self._vocab = vocab
        self._ids = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_corpus(cls, text: str) -> CharTokenizer:
        """Tokenizer whose vocabulary is the sorted distinct characters of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return cls("".join(sorted(set(text))))

    @classmethod
    def from_vocab(cls, vocab: str) -> CharTokenizer:
        """Rebuild a tokenizer from its :attr:`vocab` string (ids keep their order)."""
        return cls(vocab)

    @property
    def vocab(self) -> str:
        """The vocabulary string: character ``vocab[i]`` has id i."""
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self._vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character.

        Raises:
            UnknownCharacterError: (a ValueError) a character of ``text`` is not in the vocabulary
                (the message names it and its position).
        """
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            char = err.args[0]
            raise UnknownCharacterError(char, text.index(char), self.vocab_size) from None

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of a 1-D sequence of token ids (list, array or tensor).

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``, or ``ids`` is not 1-D.
        """
        ids = _ids_to_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside [0, {self.vocab_size}) of this character tokenizer"
            )
        return "".join(self._vocab[i] for i in ids)

    def to_config(self) -> dict:
        """Plain dict that :func:`tokenizer_from_config` turns back into this tokenizer."""
        return {"kind": self.kind, "vocab": self._vocab}


class ByteTokenizer:
    """One token per UTF-8 byte; ``vocab_size`` is 256 and every string can be encoded."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes (a non-ASCII character gives 2-4 ids)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of a 1-D sequence of byte ids.

        Byte sequences that are not valid UTF-8 (a model may sample a partial character) decode
        to U+FFFD instead of raising.

        Raises:
            ValueError: an id is outside [0, 256), or ``ids`` is not 1-D.
        """
        ids = _ids_to_list(ids)
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside [0, 256) of the byte tokenizer")
        return bytes(ids).decode("utf-8", errors="replace")

    def to_config(self) -> dict:
        """Plain dict that :func:`tokenizer_from_config` turns back into this tokenizer."""
        return {"kind": self.kind}


def tokenizer_from_config(config: Mapping | None) -> CharTokenizer | ByteTokenizer:
    """Rebuild a tokenizer from its ``to_config()`` dict (e.g. stored in a checkpoint).

    Raises:
        ValueError: ``config`` is None (a checkpoint of a task other than ``data=text`` stores no
            tokenizer), unknown ``kind``, or a char config without ``vocab``.
        TypeError: ``config`` is not a mapping.
    """
    if config is None:
        raise ValueError(
            "no tokenizer config (None): only data=text checkpoints store a tokenizer; a synthetic "
            "task's model takes its token ids directly (passkey and multikey_needle are bytes: "
            "data.text.ByteTokenizer)"
        )
    if not isinstance(config, Mapping):
        raise TypeError(f"a tokenizer config is a to_config() dict, got {type(config).__name__}")
    kind = config.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        if "vocab" not in config:
            raise ValueError("a char tokenizer config needs its 'vocab' string")
        return CharTokenizer.from_vocab(config["vocab"])
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'char' or 'byte'")


class TokenWindows(Dataset):
    """Windows of ``seqlen + 1`` consecutive tokens of one token stream, indexed by start position.

    Item ``start`` (0 <= start <= len(tokens) - seqlen - 1) is ``{"input_ids": tokens[start :
    start + seqlen], "labels": tokens[start + 1 : start + seqlen + 1], "slice": "text"}`` with
    (seqlen,) int64 tensors. Which starts are visited is up to the sampler (:class:`BlockSampler`).
    """

    def __init__(self, tokens: torch.Tensor, seqlen: int):
        self.tokens = tokens
        self.seqlen = seqlen

    def __len__(self) -> int:
        return max(0, self.tokens.shape[0] - self.seqlen)

    def __getitem__(self, start: int) -> dict:
        block = self.tokens[start : start + self.seqlen + 1]  # (seqlen + 1,)
        return {"input_ids": block[:-1], "labels": block[1:], "slice": "text"}


class BlockSampler(Sampler[int]):
    """Start positions of non-overlapping blocks of ``block_len`` tokens in a stream of ``num_tokens``.

    ``shuffle=False`` (validation): blocks at 0, block_len, 2 * block_len, ..., in order, as many as
    fit (``num_tokens // block_len``). ``shuffle=True`` (training): every epoch draws an offset r
    uniformly from [0, block_len) and visits the blocks at ``r + j * block_len`` in random order,
    so over epochs the model sees every block boundary; the count is fixed at
    ``(num_tokens - block_len + 1) // block_len`` so that every offset fits. The epoch's draw is a
    function of ``(seed, epoch)``: the training loader (:class:`data.resumable.ResumableLoader`) calls
    :meth:`set_epoch` with its pass before each pass; without it, each pass advances the epoch.
    """

    def __init__(self, num_tokens: int, block_len: int, shuffle: bool, seed: int | tuple[int, ...] = 0):
        self.num_tokens = num_tokens
        self.block_len = block_len
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        if self.shuffle:
            return (self.num_tokens - self.block_len + 1) // self.block_len
        return self.num_tokens // self.block_len

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose offset and order the next pass uses."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(0, len(self) * self.block_len, self.block_len))
        seed = list(self.seed) if isinstance(self.seed, tuple) else [self.seed]
        rng = np.random.default_rng([*seed, self.epoch])
        offset = int(rng.integers(self.block_len))
        order = rng.permutation(len(self))
        self.epoch += 1
        return iter((offset + order * self.block_len).tolist())


def local_corpus_files(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The files of ``data.path`` (one path or a list), ``~`` expanded, each checked to be an existing
    file: read by ``setup``, and checked on their own before a sweep's first job trains.

    Raises:
        ValueError: an empty list, an empty path or one that is no path (``data.path=[[]]``), a folder.
        FileNotFoundError: a file that does not exist (a relative path named as it was resolved).
    """
    paths = list(path) if isinstance(path, Sequence) and not isinstance(path, str) else [path]
    if not paths:  # datasets' own message names no setting
        raise ValueError(
            "text corpus path is an empty list; set data.path to a text file, or a list of files, "
            "e.g. data.path='[a.txt,b.txt]'"
        )
    for file in paths:
        # A new-user check: data.path=[[]] failed in os.fspath's words, data.path='' was called a
        # directory (the working one).
        if not isinstance(file, (str, os.PathLike)) or not str(file):
            what = "an empty path" if isinstance(file, (str, os.PathLike)) else f"{file!r}, no path"
            raise ValueError(
                f"data.path holds {what}; set data.path to a text file, or a list of files, e.g. "
                "data.path='[a.txt,b.txt]'"
            )
    # ~ as the shell would expand it (train.py stores the corpus by this path: absolute_paths).
    paths = [Path(file).expanduser() for file in paths]
    for file in paths:
        if Path(file).is_dir():
            raise ValueError(
                f"text corpus {str(file)!r} is a directory; set data.path to a text file, or a list of "
                f"files, e.g. data.path='[{Path(file) / 'a.txt'},{Path(file) / 'b.txt'}]'"
            )
        if not Path(file).is_file():
            # a relative path is read from the working directory: say which one that was
            where = "" if Path(file).is_absolute() else f", looked for at {Path(file).resolve()}"
            raise FileNotFoundError(f"text corpus file not found: {str(file)!r}{where}{NO_CORPUS_ADVICE}")
    return paths


# What the missing-corpus error advises (eval/perplexity.py replaces it for a checkpoint's own corpus).
NO_CORPUS_ADVICE = " (set data.path to a text file)"


def unreachable(url: str, timeout: float = 3.0) -> bool:
    """Whether no TCP connection to the host of ``url`` (its port, else 443 for https and 80 for
    http) opens within ``timeout`` seconds: the host unknown (no DNS: a machine without network) or
    not answering. One connection attempt, about a round trip where the host is reachable."""
    parts = urlsplit(url)
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((parts.hostname or url, port), timeout):
            return False
    except OSError:
        return True


def hub_unreachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub (``HF_ENDPOINT``, default https://huggingface.co) is
    :func:`unreachable`."""
    return unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", timeout)


def _http_status(err: BaseException) -> int | None:
    """The HTTP status of the first response in ``err``'s chain of causes (huggingface_hub's
    HfHubHTTPError and httpx's errors carry one), None where none does."""
    seen = 0
    while err is not None and seen < 10:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _hub_failure(err: BaseException, offline: bool, cache_dir) -> str:
    """Why a hub dataset could not be loaded, and what to do, for :func:`_load_text`'s message."""
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    local = "or give a local text file with data.path=..."
    where = cache_dir or "the cache"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    status = _http_status(err)
    if offline:
        reason = f"the Hub cannot be reached from this machine and {where} holds no copy"
    elif os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no", "off"):
        reason = f"HF_HUB_OFFLINE is set and {where} holds no copy"
    elif status is not None and status >= 500:  # a new-user check: it was called "no such dataset"
        return f"the Hub ({endpoint}) answered with a server error (HTTP {status}); try again later, {local}"
    elif status in (401, 403):
        return (
            f"the Hub ({endpoint}) refused access (HTTP {status}): a private or gated dataset needs "
            f"`hf auth login` (and the dataset's terms accepted on its page); check the name, {local}"
        )
    elif not isinstance(err, ConnectionError):  # the Hub answered: no such dataset for us
        if isinstance(err, FileNotFoundError):
            # datasets looks for a local folder of that name first, and its message named that folder
            # before the Hub (a new-user check: it read as a mistyped data.path).
            reason = f"the Hub ({endpoint}) has no dataset of that name that this machine may read"
        return (
            f"{reason}; check the name (owner/name, as in the dataset page's address; a private or gated "
            f"dataset needs `hf auth login`), {local}"
        )
    return (
        f"{reason}; on a machine without network, load it once where there is one (into the same cache_dir "
        f"or HF_DATASETS_CACHE), {local}"
    )


def _load_text(path, name, config_name, split, text_column, separator, cache_dir) -> str:
    """The corpus as one string: local text file(s) or a Hugging Face hub dataset, via ``datasets``.
    A hub dataset on a machine that cannot reach the Hub (:func:`hub_unreachable`) is read from the
    cache alone (``HF_HUB_OFFLINE=1`` for this process, where ``datasets`` is not imported yet):
    ``datasets`` would retry the Hub for about 25 s first, printing a dozen warnings."""
    offline = path is None and "datasets" not in sys.modules and "HF_HUB_OFFLINE" not in os.environ
    offline = offline and hub_unreachable()
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets  # imported here: it takes about a second and MQAR-only users never need it

    if path is not None:
        paths = local_corpus_files(path)
        # sample_by="document" makes each file one row with its newlines intact (line ends are
        # normalised to "\n", as Python's text mode does). Without a user cache_dir the Arrow cache
        # goes to a temporary directory, deleted once the text has been copied out.
        # datasets' progress bar counts files here (one example each), and its line came before any
        # refusal of the text that follows (a short corpus): off while they load.
        bars_were_off = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        with tempfile.TemporaryDirectory(prefix="mixerlab-text-") as tmp:
            try:
                ds = datasets.load_dataset(
                    "text",
                    data_files=[str(file) for file in paths],
                    sample_by="document",
                    split="train",
                    cache_dir=cache_dir if cache_dir is not None else tmp,
                )
            except datasets.exceptions.DatasetGenerationError as err:
                cause = err.__cause__ or err.__context__
                if not isinstance(cause, UnicodeDecodeError):
                    raise
                where = f"{str(paths[0])!r} is" if len(paths) == 1 else f"one of {[str(p) for p in paths]} is"
                raise ValueError(
                    f"text corpus {where} not UTF-8 text ({cause}); convert it first, e.g. "
                    "iconv -f latin1 -t utf-8 corpus.txt > corpus.utf8.txt (every tokenizer reads text, "
                    "the byte tokenizer its UTF-8 bytes)"
                ) from err
            finally:
                if not bars_were_off:
                    datasets.enable_progress_bars()
            return separator.join(ds["text"])
    from huggingface_hub.errors import HfHubHTTPError

    try:
        ds = datasets.load_dataset(name, config_name, split=split, cache_dir=cache_dir)
    except (
        ConnectionError,
        FileNotFoundError,
        HfHubHTTPError,
        datasets.exceptions.DatasetNotFoundError,
    ) as err:
        # Offline without a cached copy, no such dataset, or the Hub failing: datasets' own traceback.
        raise ValueError(
            f"dataset_name={name!r} could not be loaded: {_hub_failure(err, offline, cache_dir)}"
        ) from err
    if text_column not in ds.column_names:
        raise ValueError(
            f"dataset {name!r} has no column {text_column!r} (columns: {ds.column_names}); set text_column"
        )
    return separator.join(ds[text_column])


def _build_tokenizer(tokenizer, corpus: str):
    """A tokenizer from a kind name ("char": fitted on ``corpus``; "byte"), a config dict or an instance."""
    if isinstance(tokenizer, str):
        if tokenizer == "char":
            return CharTokenizer.from_corpus(corpus)
        if tokenizer == "byte":
            return ByteTokenizer()
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected 'char' or 'byte'")
    if isinstance(tokenizer, Mapping):
        return tokenizer_from_config(tokenizer)
    if all(hasattr(tokenizer, attr) for attr in ("encode", "decode", "vocab_size")):
        return tokenizer
    raise TypeError(
        "tokenizer must be 'char', 'byte', a to_config() dict, or an object with encode, decode and "
        f"vocab_size; got {type(tokenizer).__name__}"
    )


class TextDataModule(ResumableTrainData, L.LightningDataModule):
    """Next-token prediction on one text corpus, split 90/10 by characters.

    The corpus is a local file (``path``; a list of files is joined with ``separator``) or, for
    online users, a Hugging Face hub dataset (``dataset_name``, ``config_name``, ``split``, ``text_column``;
    its rows are joined with ``separator``). Both go through ``datasets.load_dataset``. The first
    ``train_fraction`` of the *characters* is training text and the rest validation text; each part
    is tokenized separately. The char vocabulary is fitted on the whole corpus (as nanoGPT does), so
    validation text never holds an unknown character.

    Training visits non-overlapping blocks of ``seqlen + 1`` tokens from a random offset re-drawn
    every epoch, in random order (:class:`BlockSampler`); validation visits the fixed
    non-overlapping blocks from offset 0, in order. ``test_dataloader`` is the validation data.

    Args:
        path: local text file (or list of files); exactly one of ``path`` and ``dataset_name``.
        dataset_name: hub dataset name (needs network or a warm ``cache_dir``).
        config_name: hub dataset configuration (e.g. ``"wikitext-2-raw-v1"``).
        split: hub split to read (default ``"train"``); it is then split 90/10 as above.
        text_column: hub column holding the text (default ``"text"``).
        separator: string placed between rows / files (default ``"\\n"``).
        tokenizer: ``"char"`` (default), ``"byte"``, a ``to_config()`` dict or a tokenizer object.
        seqlen: tokens per example (default 256).
        batch_size: examples per batch (default 32).
        train_fraction: fraction of characters used for training, in (0, 1) (default 0.9).
        num_workers: DataLoader worker processes (default 0).
        seed: seed of the per-epoch training offsets and order, with the run's torch seed (default 0).
        cache_dir: ``datasets`` cache directory. Default: a temporary directory deleted after
            loading for local files (nothing is left behind), the Hugging Face default cache for
            hub datasets (so downloads are reused).

    Attributes (after :meth:`setup`): ``tokenizer``, ``vocab_size``, ``train_tokens`` and
    ``val_tokens`` (1-D int64 tensors), ``num_train_chars``, ``num_val_chars``, ``corpus_sha256``
    (the SHA-256 hex digest of the corpus text as read, UTF-8: what ``resume=`` compares, since a
    file edited in place keeps its path and often its vocabulary). Always:
    ``slice_names == ["text"]``, ``dataset_name``.

    Batches are ``{"input_ids": (B, seqlen) int64, "labels": (B, seqlen) int64, "slice": ["text"] * B}``
    with ``labels[:, t] == input_ids[:, t + 1]`` inside a block; every position is labelled.

    Raises:
        ValueError: neither or both of ``path`` and ``dataset_name``; a hub dataset's ``split``,
            ``config_name`` or ``text_column`` other than its default beside ``path``; a bad setting;
            (in ``setup``) a split too short for one block of ``seqlen + 1`` tokens.
        FileNotFoundError: (in ``setup``) ``path`` does not exist.
    """

    def __init__(
        self,
        path: str | Path | list[str | Path] | None = None,
        dataset_name: str | None = None,
        config_name: str | None = None,
        split: str = "train",
        text_column: str = "text",
        separator: str = "\n",
        tokenizer: str | Mapping | object = "char",
        seqlen: int = 256,
        batch_size: int = 32,
        train_fraction: float = 0.9,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if (path is None) == (dataset_name is None):
            raise ValueError(
                "give exactly one corpus: path (a local text file, e.g. data.path=/path/to/corpus.txt) "
                "or dataset_name (a Hugging Face hub dataset)"
            )
        if isinstance(train_fraction, bool) or not isinstance(train_fraction, (int, float)):
            raise ValueError(f"train_fraction must be a number in (0, 1), got {train_fraction!r}")
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        # A new-user check: data.split=test with a local file was ignored without a word.
        hub_only = {"split": (split, "train"), "config_name": (config_name, None)}
        for key, (value, default) in {**hub_only, "text_column": (text_column, "text")}.items():
            if path is not None and value != default:
                raise ValueError(
                    f"{key}={value!r} is read from a hub dataset (dataset_name) only: a local text file "
                    f"(path) is split by train_fraction, its last {1 - train_fraction:.0%} validating; "
                    "leave it out"
                )
        self.path = path
        self.dataset_name = dataset_name
        self.config_name = config_name
        self.split = split
        self.text_column = text_column
        self.separator = separator
        self._tokenizer_spec = tokenizer
        self.seqlen = _check_int(seqlen, "seqlen", 1)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.num_workers = _check_int(num_workers, "num_workers", 0)
        self.seed = _check_int(seed, "seed", 0)
        self.train_fraction = float(train_fraction)
        self.cache_dir = cache_dir
        self.slice_names = ["text"]
        self.tokenizer = None
        self.vocab_size: int | None = None
        self.train_tokens: torch.Tensor | None = None
        self.val_tokens: torch.Tensor | None = None
        self.num_train_chars: int | None = None
        self.num_val_chars: int | None = None
        self.corpus_sha256: str | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load, split and tokenize the corpus (once; later calls only check), and check that the
        splits ``stage`` uses hold a block: validation always, training too for ``fit`` (or None).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: a split this stage uses holds fewer tokens than its blocks need (naming the
                split, its token count and the count needed).
        """
        if self.train_tokens is None:
            self._load()
        block_len = self.seqlen + 1
        # Training needs one full block at every offset in [0, block_len): 2 * block_len - 1 tokens.
        parts = [("validation", self.val_tokens, block_len, "one block of seqlen + 1")]
        if stage in (None, "fit"):
            why = (
                "a block of seqlen + 1 whatever the random offset in [0, seqlen] an epoch starts at: "
                "2 * seqlen + 1"
            )
            parts.insert(0, ("training", self.train_tokens, 2 * block_len - 1, why))
        for part, tokens, needed, why in parts:
            if tokens.shape[0] < needed:
                raise ValueError(
                    f"the {part} split has {tokens.shape[0]} tokens, fewer than the {needed} that "
                    f"seqlen={self.seqlen} needs ({why}); use a longer corpus or a smaller seqlen"
                )

    def _load(self) -> None:
        """Read, split and tokenize the corpus into this module's tokenizer and token tensors."""
        text = _load_text(
            self.path,
            self.dataset_name,
            self.config_name,
            self.split,
            self.text_column,
            self.separator,
            self.cache_dir,
        )
        if not text:
            raise ValueError(f"the corpus {self.path or self.dataset_name!r} is empty")
        tokenizer = _build_tokenizer(self._tokenizer_spec, text)
        split_at = int(len(text) * self.train_fraction)
        train_tokens = torch.tensor(tokenizer.encode(text[:split_at]), dtype=torch.int64)
        try:
            val_tokens = torch.tensor(tokenizer.encode(text[split_at:]), dtype=torch.int64)
        except UnknownCharacterError as err:  # its index in the corpus, not in the validation part
            raise UnknownCharacterError(err.char, err.index + split_at, err.vocab_size) from None
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.num_train_chars = split_at
        self.num_val_chars = len(text) - split_at
        self.corpus_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self.train_tokens = train_tokens
        self.val_tokens = val_tokens

    def _loader(self, tokens: torch.Tensor, shuffle: bool) -> DataLoader:
        if tokens is None:
            raise RuntimeError("call setup() before asking for dataloaders (Lightning's Trainer does it)")
        # Training: offsets and order seeded with the run's seed too (training_order_seed).
        seed = self.training_order_seed() if shuffle else self.seed
        sampler = BlockSampler(tokens.shape[0], self.seqlen + 1, shuffle=shuffle, seed=seed)
        if shuffle:  # training: a stream of passes that a resumed fit continues
            return self.resumable_loader(
                TokenWindows(tokens, self.seqlen), sampler, self.batch_size, self.num_workers
            )
        # evaluation under DDP: each block once (Lightning's sampler would repeat some)
        sampler = eval_sampler(sampler, self.trainer, "validation")
        return DataLoader(
            TokenWindows(tokens, self.seqlen),
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=worker_init_fn(self.num_workers, self.trainer),
        )

    def train_dataloader(self) -> DataLoader:
        """Training blocks: random offset and order, re-drawn every pass; a resumed fit continues
        them where its checkpoint left them (:class:`data.resumable.ResumableLoader`)."""
        return self._loader(self.train_tokens, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation blocks: fixed, non-overlapping, in order."""
        return self._loader(self.val_tokens, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Same as :meth:`val_dataloader` (the corpus has two parts, not three)."""
        return self.val_dataloader()

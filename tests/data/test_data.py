"""Tests of the data package: the MQAR generator and data module, tokenizers, the text data module."""

import inspect
import os
import re
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import datasets as datasets_lib
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import (
    IGNORE_INDEX,
    BlockSampler,
    ByteTokenizer,
    CharTokenizer,
    MQARDataModule,
    TextDataModule,
    build_datamodule,
    multiquery_ar,
    parse_slice_name,
    slice_name,
    tokenizer_from_config,
)

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared/data/tiny_shakespeare.txt"


def _mqar(**overrides):
    args = dict(vocab_size=64, num_examples=300, input_seq_len=32, seed=0, num_kv_pairs=4)
    args.update(overrides)
    return multiquery_ar(**args)


# ----------------------------------------------------------------------------------------------
# MQAR generator


def test_mqar_shapes_and_dtypes():
    input_ids, labels = _mqar()
    assert input_ids.shape == labels.shape == (300, 32)
    assert input_ids.dtype == labels.dtype == torch.int64


def test_mqar_keys_lower_half_values_upper_half_distinct():
    vocab_size, k = 64, 4
    input_ids, _ = _mqar(vocab_size=vocab_size, num_kv_pairs=k)
    keys, values = input_ids[:, 0 : 2 * k : 2], input_ids[:, 1 : 2 * k : 2]
    assert ((keys >= 1) & (keys < vocab_size // 2)).all()
    assert ((values >= vocab_size // 2) & (values < vocab_size)).all()
    for row_keys, row_values in zip(keys.tolist(), values.tolist(), strict=True):
        assert len(set(row_keys)) == k
        assert len(set(row_values)) == k


@pytest.mark.parametrize("random_non_queries", [True, False])
def test_mqar_every_key_queried_once_with_its_value_as_label(random_non_queries):
    k = 4
    input_ids, labels = _mqar(num_kv_pairs=k, random_non_queries=random_non_queries)
    for row_inputs, row_labels in zip(input_ids.tolist(), labels.tolist(), strict=True):
        pairs = dict(zip(row_inputs[0 : 2 * k : 2], row_inputs[1 : 2 * k : 2], strict=True))
        labelled = [t for t, label in enumerate(row_labels) if label != IGNORE_INDEX]
        assert len(labelled) == k
        assert sum(label == IGNORE_INDEX for label in row_labels) == len(row_labels) - k
        queried = []
        for t in labelled:
            assert t >= 2 * k and (t - 2 * k) % 2 == 0  # after the context, at an even offset
            key = row_inputs[t]
            assert key in pairs
            assert row_labels[t] == pairs[key]
            queried.append(key)
        assert sorted(queried) == sorted(pairs)


def test_mqar_zoology_layout_without_random_filler():
    # Zoology's docstring example layout: k1 v1 k2 v2, then queries at even offsets, 0 elsewhere.
    input_ids, labels = multiquery_ar(20, 50, 16, seed=3, num_kv_pairs=2, random_non_queries=False)
    query_mask = labels != IGNORE_INDEX
    query_mask[:, :4] = True  # the context
    assert (input_ids[~query_mask] == 0).all()
    assert (input_ids[:, :4] != 0).all()


def test_mqar_random_non_queries_only_changes_filler():
    on_inputs, on_labels = _mqar(seed=7, random_non_queries=True)
    off_inputs, off_labels = _mqar(seed=7, random_non_queries=False)
    assert torch.equal(on_labels, off_labels)
    filler = off_inputs == 0
    assert filler.any()
    assert torch.equal(on_inputs[~filler], off_inputs[~filler])
    on_filler = on_inputs[filler]
    assert ((on_filler >= 0) & (on_filler < 64)).all()
    # Uniform over 64 tokens: zeros survive about 1/64 of the time, and many tokens appear.
    assert (on_filler == 0).float().mean() < 0.05
    assert on_filler.unique().numel() > 50


def test_mqar_power_law_gap_distribution():
    # The first context key is queried at the first gap drawn, whose law is exactly
    # p(gap = i - 1) ∝ a * i**(a - 1): compare the empirical frequencies with it.
    num_examples, seqlen, k, power_a = 4000, 64, 4, 0.01
    input_ids, labels = multiquery_ar(128, num_examples, seqlen, seed=11, power_a=power_a, num_kv_pairs=k)
    first_keys = input_ids[:, 0]
    is_first_query = (input_ids == first_keys[:, None]) & (labels != IGNORE_INDEX)
    assert (is_first_query.sum(1) == 1).all()
    gaps = (is_first_query.int().argmax(1) - 2 * k) // 2
    space = seqlen // 2 - k
    ranks = np.arange(1, space + 1)
    p = power_a * ranks ** (power_a - 1.0)
    p /= p.sum()
    freq = np.bincount(gaps.numpy(), minlength=space) / num_examples
    sigma = np.sqrt(p * (1 - p) / num_examples)
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-3)
    # And over all queries: early gaps are much more common than late ones, unlike power_a = 1.
    all_gaps = ((labels != IGNORE_INDEX).nonzero()[:, 1] - 2 * k) // 2
    assert (all_gaps == 0).sum() > 5 * (all_gaps == space - 1).sum()
    _, uniform_labels = multiquery_ar(128, num_examples, seqlen, seed=11, power_a=1.0, num_kv_pairs=k)
    uniform_gaps = ((uniform_labels != IGNORE_INDEX).nonzero()[:, 1] - 2 * k) // 2
    assert all_gaps.float().mean() < 0.75 * uniform_gaps.float().mean()
    assert abs(uniform_gaps.float().mean().item() - (space - 1) / 2) < 0.5


@pytest.mark.parametrize("power_a", [250.0, 1e300])
def test_mqar_large_power_a_follows_its_law(power_a):
    """Found by a new-user check: from a ~ 200 at T 64, a * i**(a - 1) overflowed, the weights became
    NaN and every example got the same query positions, with only numpy's overflow warning. The
    first gap's law is checked as in the test above, its weights computed in log space here."""
    num_examples, seqlen, k = 2000, 64, 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        input_ids, labels = multiquery_ar(128, num_examples, seqlen, seed=3, power_a=power_a, num_kv_pairs=k)
    is_first_query = (input_ids == input_ids[:, :1]) & (labels != IGNORE_INDEX)
    gaps = (is_first_query.int().argmax(1) - 2 * k) // 2
    space = seqlen // 2 - k
    log_w = (power_a - 1.0) * np.log(np.arange(1, space + 1) / space)
    p = np.exp(log_w - log_w.max())
    p /= p.sum()
    freq = np.bincount(gaps.numpy(), minlength=space) / num_examples
    sigma = np.sqrt(p * (1 - p) / num_examples)
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-3)
    # All k queries sit in the last k slots (the next gap's weight is below 1e-4 at a = 250).
    assert ((labels != IGNORE_INDEX).nonzero()[:, 1] >= seqlen - 2 * k).all()


def test_mqar_deterministic_per_seed_and_leaves_global_rng_alone():
    np_state = np.random.get_state()[1].copy()
    torch_state = torch.random.get_rng_state().clone()
    first = _mqar(seed=5)
    second = _mqar(seed=5)
    other = _mqar(seed=6)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[1], other[1])
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(torch.random.get_rng_state(), torch_state)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(input_seq_len=31), ValueError, "even"),
        (dict(vocab_size=32), ValueError, "vocab_size"),
        (dict(num_kv_pairs=9), ValueError, "num_kv_pairs"),
        (dict(power_a=0.0), ValueError, "power_a"),
        (dict(power_a="abc"), ValueError, "power_a must be a number > 0 .*got 'abc'"),
        (dict(power_a=float("inf")), ValueError, "power_a must be finite, got inf"),
        (dict(num_examples=0), ValueError, "num_examples"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(input_seq_len=32.0), TypeError, "integer"),
    ],
)
def test_mqar_bad_arguments_raise_clear_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        _mqar(**overrides)


# ----------------------------------------------------------------------------------------------
# MQAR data module


def _mqar_module(**overrides):
    args = dict(seqlen=16, num_kv_pairs=2, num_train_examples=40, num_test_examples=12, batch_size=8)
    args.update(overrides)
    return MQARDataModule(**args)


def test_slice_names():
    assert slice_name(64, 4) == "T64_kv4"
    assert parse_slice_name("T64_kv4") == (64, 4)
    with pytest.raises(ValueError, match="slice name"):
        parse_slice_name("T=64")


def test_mqar_datamodule_batches():
    dm = _mqar_module()
    assert dm.vocab_size == 512
    assert dm.slice_names == ["T16_kv2", "T32_kv4", "T64_kv8"]
    assert all("=" not in name for name in dm.slice_names)
    dm.setup("fit")
    train_batch = next(iter(dm.train_dataloader()))
    assert train_batch["input_ids"].shape == train_batch["labels"].shape == (8, 16)
    assert train_batch["input_ids"].dtype == train_batch["labels"].dtype == torch.int64
    assert train_batch["slice"] == ["T16_kv2"] * 8
    dm.setup("test")
    for loaders in (dm.val_dataloader(), dm.test_dataloader()):
        assert len(loaders) == 3
        for name, loader in zip(dm.slice_names, loaders, strict=True):
            seqlen, num_kv_pairs = parse_slice_name(name)
            batches = list(loader)
            assert sum(b["input_ids"].shape[0] for b in batches) == 12
            for batch in batches:
                assert batch["input_ids"].shape[1] == batch["labels"].shape[1] == seqlen
                assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
                assert batch["slice"] == [name] * batch["input_ids"].shape[0]
                assert ((batch["labels"] != IGNORE_INDEX).sum(1) == num_kv_pairs).all()


def test_mqar_datamodule_train_val_and_test_seeds_are_disjoint():
    dm = _mqar_module(seed=3)
    assert dm.train_seed not in dm.test_seeds + dm.val_seeds
    assert len(set(dm.test_seeds + dm.val_seeds)) == 2 * len(dm.test_seeds)
    train_seeds = {_mqar_module(seed=s).train_seed for s in range(20)}
    test_seeds = {t for s in range(20) for t in _mqar_module(seed=s).test_seeds}
    val_seeds = {t for s in range(20) for t in _mqar_module(seed=s).val_seeds}
    assert not train_seeds & test_seeds and not train_seeds & val_seeds and not test_seeds & val_seeds
    dm.setup()
    assert dm.train_set.seed == dm.train_seed
    assert [s.seed for s in dm.test_sets] == dm.test_seeds
    assert [s.seed for s in dm.val_sets] == dm.val_seeds
    # The slices with the training setting hold other examples than the training set, and
    # validation (model selection) and test (reported) hold different examples.
    train_rows = {tuple(row) for row in dm.train_set.input_ids.tolist()}
    test_rows = {tuple(row) for row in dm.test_sets[0].input_ids.tolist()}
    val_rows = {tuple(row) for row in dm.val_sets[0].input_ids.tolist()}
    assert not train_rows & test_rows and not train_rows & val_rows and not val_rows & test_rows


def test_mqar_datamodule_custom_longer_test_slices():
    configs = [{"seqlen": 16, "num_kv_pairs": 2}, {"seqlen": 128, "num_kv_pairs": 8}]
    dm = _mqar_module(test_configs=configs)
    assert dm.slice_names == ["T16_kv2", "T128_kv8"]
    dm.setup()
    assert dm.test_sets[1].input_ids.shape == (12, 128)
    assert max(s.seqlen for s in dm.test_sets) > dm.train_set.seqlen


def test_mqar_datamodule_setup_is_deterministic():
    first, second = _mqar_module(seed=1), _mqar_module(seed=1)
    first.setup()
    second.setup()
    assert torch.equal(first.train_set.input_ids, second.train_set.input_ids)
    assert torch.equal(first.test_sets[2].labels, second.test_sets[2].labels)


def test_mqar_generate_slice():
    dm = _mqar_module()
    extra = dm.generate_slice(48, 6, 10)
    assert extra.name == "T48_kv6"
    assert extra.input_ids.shape == extra.labels.shape == (10, 48)
    assert extra.seed != dm.train_seed and extra.seed not in dm.test_seeds + dm.val_seeds
    assert torch.equal(extra.input_ids, dm.generate_slice(48, 6, 10).input_ids)
    batch = next(iter(dm.dataloader(extra)))
    assert batch["slice"] == ["T48_kv6"] * 8
    with pytest.raises(ValueError, match="training or validation seed"):
        dm.generate_slice(48, 6, 10, seed=dm.train_seed)
    with pytest.raises(ValueError, match="training or validation seed"):
        dm.generate_slice(48, 6, 10, seed=dm.val_seeds[0])


def test_mqar_datamodule_vocab_error_says_how_to_fix():
    with pytest.raises(ValueError, match=r"T64_kv8.*at least 65"):
        _mqar_module(vocab_size=64)
    assert _mqar_module(vocab_size=65).vocab_size == 65


@pytest.mark.parametrize(
    "test_configs, error, match",
    [
        ([{"seqlen": 16}], ValueError, "num_kv_pairs"),
        ([{"seqlen": 16, "num_kv_pairs": 2}] * 2, ValueError, "more than once"),
        ([{"seqlen": 18, "num_kv_pairs": 5}], ValueError, "num_kv_pairs \\* 4"),
        ([{"seqlen": "16", "num_kv_pairs": 2}], TypeError, "integer"),
        ({"seqlen": 16, "num_kv_pairs": 2}, TypeError, "list"),
        # The bound explained (a new-user check: "between 1 and 498 slices" said nothing of 498).
        ([], ValueError, r"between 1 and 498 slices \(at least one, whose metrics are val/acc and val/loss, "
         r"and at most the slices whose examples have seeds of their own\), got 0"),
    ],
)
def test_mqar_datamodule_bad_test_configs(test_configs, error, match):
    with pytest.raises(error, match=match):
        _mqar_module(test_configs=test_configs)


def test_mqar_setup_per_stage():
    dm = _mqar_module()
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match="setup"):
        dm.val_dataloader()
    dm.setup("test")  # evaluation needs only the test slices
    assert dm.train_set is None and dm.val_sets is None and len(dm.test_dataloader()) == 3
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match="setup"):
        dm.val_dataloader()
    test_sets = dm.test_sets
    dm.setup("fit")
    assert dm.test_sets is test_sets
    assert len(dm.train_dataloader().dataset) == 40


def test_build_datamodule():
    assert isinstance(build_datamodule("mqar", seqlen=16, num_kv_pairs=2), MQARDataModule)
    with pytest.raises(ValueError, match="unknown data module 'bogus'"):
        build_datamodule("bogus")
    # A key the module does not take is named with the module's keys, not as its TypeError.
    valid = sorted(inspect.signature(MQARDataModule).parameters)
    message = f"unknown data keys ['foo', 'seq_len'] for data=mqar; valid keys: {valid}"
    assert "seqlen" in valid
    with pytest.raises(ValueError, match=re.escape(message)):
        build_datamodule("mqar", seqlen=16, seq_len=16, foo=1)


class _Probe(L.LightningModule):
    """A bigram model that records what Lightning feeds it."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)
        self.train_inputs = []
        self.val_slices = {}

    def training_step(self, batch, batch_idx):
        self.train_inputs.append((self.current_epoch, batch["input_ids"].clone()))
        logits = self.logits(batch["input_ids"])  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.val_slices.setdefault(dataloader_idx, set()).update(batch["slice"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module, datamodule, max_epochs):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=datamodule)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mqar_datamodule_in_lightning_trainer():
    dm = _mqar_module()
    probe = _Probe(dm.vocab_size)
    _fit(probe, dm, max_epochs=1)
    assert probe.val_slices == {i: {name} for i, name in enumerate(dm.slice_names)}
    assert len(probe.train_inputs) == 2


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_char_tokenizer_round_trip_with_newlines():
    text = "To be,\nor not to be:\n\n  that is the question.\n"
    tok = CharTokenizer.from_corpus(text)
    assert tok.vocab == "".join(sorted(set(text)))
    assert "\n" in tok.vocab
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    rebuilt = CharTokenizer.from_vocab(tok.vocab)
    assert rebuilt.encode(text) == ids
    assert tokenizer_from_config(tok.to_config()).encode(text) == ids


def test_char_tokenizer_errors():
    tok = CharTokenizer.from_corpus("abc\n")
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at index 2"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([4])
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer.from_vocab("abca")
    with pytest.raises(TypeError, match="string"):
        CharTokenizer.from_vocab(["a", "b"])
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tokenizer_from_config({"kind": "bpe"})
    # A new user's finding: the README's sampling snippet on an MQAR checkpoint (tokenizer_config
    # None) failed with "'NoneType' object has no attribute 'get'".
    with pytest.raises(ValueError, match=r"^no tokenizer config \(None\): only data=text checkpoints"):
        tokenizer_from_config(None)
    with pytest.raises(TypeError, match="a tokenizer config is a to_config\\(\\) dict, got str"):
        tokenizer_from_config("char")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo\nwörld — ✓\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tokenizer_from_config(tok.to_config()).decode(ids) == text
    assert tok.decode(ids[:2]) == "h\ufffd"  # a cut multi-byte character decodes to U+FFFD
    with pytest.raises(ValueError, match="outside"):
        tok.decode([256])


# ----------------------------------------------------------------------------------------------
# Text data module


@pytest.fixture
def corpus(tmp_path):
    """A 2000-character random text with newlines: every 9-character window occurs once."""
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    text = "".join(rng.choice(alphabet, size=2000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path, text


def _find_start(tokens: torch.Tensor, window: torch.Tensor) -> int:
    """The unique start position of ``window`` in ``tokens``."""
    matches = (tokens.unfold(0, window.shape[0], 1) == window).all(1).nonzero().flatten()
    assert matches.numel() == 1
    return int(matches[0])


def test_text_split_by_characters(corpus):
    path, text = corpus
    dm = TextDataModule(path=str(path), seqlen=8, batch_size=4)
    dm.setup()
    split = int(len(text) * 0.9)
    assert dm.num_train_chars == split and dm.num_val_chars == len(text) - split
    assert dm.tokenizer.decode(dm.train_tokens) == text[:split]
    assert dm.tokenizer.decode(dm.val_tokens) == text[split:]
    assert dm.vocab_size == len(set(text))
    assert dm.train_tokens.dtype == dm.val_tokens.dtype == torch.int64


def test_text_path_expands_the_home_folder_as_resume_does(corpus, tmp_path, monkeypatch):
    """A new-user check: data.path='~/corpus.txt' was looked for in a folder named ~, while the
    checkpoint stores it expanded (training.resume.absolute_paths)."""
    path, text = corpus
    monkeypatch.setenv("HOME", str(path.parent))
    dm = TextDataModule(path=f"~/{path.name}", seqlen=8)
    dm.setup()
    assert dm.tokenizer.decode(dm.train_tokens) == text[: dm.num_train_chars]


def test_text_loading_a_file_shows_no_progress_bar_and_keeps_the_setting(corpus, capfd):
    """A new-user check: datasets' "Generating train split" line (it counts files) came before a
    refusal of the text, two lines where one was meant. Off while the files load, as it was after."""
    path, _ = corpus
    assert not datasets_lib.are_progress_bars_disabled()
    TextDataModule(path=str(path), seqlen=8, cache_dir=None).setup()
    assert capfd.readouterr().err == ""
    assert not datasets_lib.are_progress_bars_disabled()


def test_text_byte_tokenizer_splits_characters_not_bytes(tmp_path):
    text = "é\n" * 300
    path = tmp_path / "accents.txt"
    path.write_text(text, encoding="utf-8")
    dm = TextDataModule(path=path, tokenizer="byte", seqlen=8, train_fraction=0.5)
    dm.setup()
    assert dm.vocab_size == 256
    assert dm.tokenizer.decode(dm.train_tokens) == text[:300]
    assert dm.train_tokens.shape[0] == len(text[:300].encode("utf-8"))


def test_text_train_batches_are_contiguous_shifted_blocks(corpus):
    path, _ = corpus
    seqlen = 8
    dm = TextDataModule(path=path, seqlen=seqlen, batch_size=5, seed=2)
    dm.setup()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(0)
    starts = []
    for batch in loader:
        inputs, labels = batch["input_ids"], batch["labels"]
        assert inputs.shape[1] == labels.shape[1] == seqlen
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(labels[:, :-1], inputs[:, 1:])
        assert batch["slice"] == ["text"] * inputs.shape[0]
        for row_inputs, row_labels in zip(inputs, labels, strict=True):
            block = torch.cat([row_inputs, row_labels[-1:]])  # seqlen + 1 consecutive tokens
            starts.append(_find_start(dm.train_tokens, block))
    block_len = seqlen + 1
    num_train = dm.train_tokens.shape[0]
    offset = starts[0] % block_len
    assert sorted(starts) == list(range(offset, offset + len(starts) * block_len, block_len))
    assert len(starts) == (num_train - block_len + 1) // block_len
    assert max(starts) + block_len <= num_train
    assert starts != sorted(starts)  # visited in random order


def test_block_sampler_offsets_per_epoch():
    sampler = BlockSampler(num_tokens=1000, block_len=9, shuffle=True, seed=4)
    offsets = []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        starts = list(sampler)
        sampler.set_epoch(epoch)
        assert list(sampler) == starts  # a function of (seed, epoch)
        assert len(starts) == len(sampler) == (1000 - 8) // 9
        assert len({s % 9 for s in starts}) == 1
        assert min(starts) < 9 and max(starts) + 9 <= 1000
        offsets.append(starts[0] % 9)
    assert len(set(offsets)) > 1  # the offset is re-drawn each epoch
    # Without set_epoch every pass advances the epoch.
    fresh = BlockSampler(num_tokens=1000, block_len=9, shuffle=True, seed=4)
    first, second = list(fresh), list(fresh)
    sampler.set_epoch(1)
    assert second == list(sampler) and first != second


def test_text_validation_blocks_fixed_and_in_order(corpus):
    path, _ = corpus
    dm = TextDataModule(path=path, seqlen=8, batch_size=4)
    dm.setup()
    tokens = dm.val_tokens
    batches = list(dm.val_dataloader())
    assert all(
        torch.equal(a["input_ids"], b["input_ids"])
        for a, b in zip(batches, dm.test_dataloader(), strict=True)
    )
    inputs = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    assert inputs.shape == (tokens.shape[0] // 9, 8)
    for j in range(inputs.shape[0]):
        assert torch.equal(inputs[j], tokens[9 * j : 9 * j + 8])
        assert torch.equal(labels[j], tokens[9 * j + 1 : 9 * j + 9])


class _Ranks:
    """What the data modules read of a Lightning Trainer under DDP."""

    def __init__(self, world_size: int, global_rank: int):
        self.world_size, self.global_rank = world_size, global_rank


def _rows(loader) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for batch in loader for row in batch["input_ids"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_loaders_under_ddp_score_every_example_once(corpus, world_size):
    # Lightning's DistributedSampler pads 61 examples on 2 processes to 62 by repeating the first:
    # validation metrics then differ from a single-process evaluation of the same weights.
    path, _ = corpus
    text = TextDataModule(path=path, seqlen=14, batch_size=4)  # 13 blocks of 15 tokens
    text.setup()
    mqar = _mqar_module(num_test_examples=61)
    mqar.setup()
    copy = build_datamodule("copy", alphabet_size=8, max_len=6, seqlen=16, num_train_examples=4,
                            num_test_examples=7, batch_size=2)  # fmt: skip
    copy.setup()
    for dm, loaders in ((text, lambda: [text.val_dataloader()]), (mqar, mqar.val_dataloader),
                        (copy, copy.test_dataloader)):  # fmt: skip
        single = [_rows(loader) for loader in loaders()]
        shares = []
        for rank in range(world_size):
            dm.trainer = _Ranks(world_size, rank)
            shares.append([_rows(loader) for loader in loaders()])
        dm.trainer = None
        for slice_idx, rows in enumerate(single):
            assert len(rows) % world_size != 0  # the case Lightning's sampler pads
            parts = [share[slice_idx] for share in shares]
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
            assert sorted(row for part in parts for row in part) == sorted(rows)


def test_evaluation_loader_with_fewer_examples_than_processes_says_so():
    dm = _mqar_module(num_test_examples=1)
    dm.setup()
    dm.trainer = _Ranks(2, 0)
    with pytest.raises(ValueError, match="has 1 examples, fewer than the 2 processes"):
        dm.val_dataloader()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_text_datamodule_refuses_a_hub_datasets_settings_beside_a_local_file(tmp_path):
    """A new-user check: ``data.split=test`` with ``data.path`` was ignored without a word (a local
    file is split by train_fraction)."""
    path = tmp_path / "c.txt"
    path.write_text("abc " * 100)
    for key, value in {"split": "test", "config_name": "wikitext-2", "text_column": "body"}.items():
        message = f"{key}={value!r} is read from a hub dataset (dataset_name) only: a local text file (path) "
        with pytest.raises(ValueError, match="^" + re.escape(message + "is split by train_fraction, its last 10%")):
            TextDataModule(path=str(path), **{key: value})
    TextDataModule(path=str(path), split="train", config_name=None, text_column="text")  # the defaults


def test_text_datamodule_in_lightning_trainer_redraws_offsets(corpus):
    path, _ = corpus
    # 199 training blocks: a pass is 2 batches, so each of the 2-batch epochs is one pass (the
    # stream continues a pass across epochs that stop short of its end: see test_resumable.py).
    dm = TextDataModule(path=path, seqlen=8, batch_size=100, seed=1)
    dm.setup()
    probe = _Probe(dm.vocab_size)
    _fit(probe, dm, max_epochs=3)
    assert len(probe.train_inputs) == 6
    assert probe.val_slices == {0: {"text"}}
    # The training order's seed: the data seed with the run's torch seed (data/text.py).
    expected = BlockSampler(dm.train_tokens.shape[0], 9, shuffle=True, seed=(1, torch.initial_seed()))
    for epoch, inputs in probe.train_inputs:
        expected.set_epoch(epoch)
        offset = next(iter(expected)) % 9
        assert {_find_start(dm.train_tokens, row) % 9 for row in inputs} == {offset}


def test_text_cache_stays_in_given_or_temporary_directory(corpus, tmp_path, monkeypatch):
    path, _ = corpus
    cache = tmp_path / "cache"
    TextDataModule(path=path, seqlen=8, cache_dir=cache).setup()
    assert any(cache.iterdir())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    TextDataModule(path=path, seqlen=8).setup()
    assert not any(scratch.iterdir())


def test_text_errors(corpus, tmp_path, monkeypatch):
    path, _ = corpus
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextDataModule(path=missing).setup()
    with pytest.raises(FileNotFoundError, match=re.escape(f"'nope.txt', looked for at {Path.cwd() / 'nope.txt'}")):
        TextDataModule(path="nope.txt").setup()
    with pytest.raises(ValueError, match="exactly one"):
        TextDataModule()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        TextDataModule(path=empty).setup()
    with pytest.raises(ValueError, match="exactly one"):
        TextDataModule(path=path, dataset_name="tiny_shakespeare")
    with pytest.raises(ValueError, match="train_fraction"):
        TextDataModule(path=path, train_fraction=1.0)
    # A hub dataset on a machine without network (a new-user check: datasets' traceback after 30 s
    # of retries, and train.py left its run folder). Simulated: no network is reached here.
    with monkeypatch.context() as patch:
        message = "Couldn't reach 'karpathy/tiny_shakespeare' on the Hub (LocalEntryNotFoundError)"
        patch.setattr(datasets_lib, "load_dataset", mock.Mock(side_effect=ConnectionError(message)))
        expected = f"dataset_name='karpathy/tiny_shakespeare' could not be loaded: {message}; on a machine"
        with pytest.raises(ValueError, match=re.escape(expected)):
            TextDataModule(dataset_name="karpathy/tiny_shakespeare").setup()
    with pytest.raises(ValueError, match="is a directory; set data.path to a text file"):
        TextDataModule(path=tmp_path, seqlen=8).setup()
    # A new-user check: data.path=[] gave datasets' message, which names no setting.
    empty = "text corpus path is an empty list; set data.path to a text file"
    with pytest.raises(ValueError, match=re.escape(empty)):
        TextDataModule(path=[], seqlen=8).setup()
    # Another: data.path=[[]] failed in os.fspath's words, naming no setting; data.path='' was called
    # a directory (the working one).
    bad_paths = [([[]], "[], no path"), ([path, 3], "3, no path"), ("", "an empty path"), (3, "3, no path")]
    for bad, what in [*bad_paths, (True, "True, no path")]:
        message = f"data.path holds {what}; set data.path to a text file"
        with pytest.raises(ValueError, match=re.escape(message)):
            TextDataModule(path=bad, seqlen=8).setup()
    with pytest.raises(ValueError, match="train_fraction must be a number in \\(0, 1\\), got 'abc'"):
        TextDataModule(path=path, train_fraction="abc")
    short_val = r"the validation split has 200 tokens, fewer than the 257 that seqlen=256 needs \(one block"
    with pytest.raises(ValueError, match=short_val):
        TextDataModule(path=path, seqlen=256).setup()
    # Both splits too short: training names the training split, an evaluation (stage "validate"),
    # which reads only the validation split, that one.
    # Each count with its reason (a new-user check: 2 * seqlen + 1 against seqlen + 1, unexplained).
    with pytest.raises(ValueError, match=re.escape(
        "the training split has 1800 tokens, fewer than the 2001 that seqlen=1000 needs (a block of "
        "seqlen + 1 whatever the random offset in [0, seqlen] an epoch starts at: 2 * seqlen + 1); use a "
        "longer corpus")):
        TextDataModule(path=path, seqlen=1000).setup()
    short = TextDataModule(path=path, seqlen=1000)
    with pytest.raises(ValueError, match="the validation split has .* smaller seqlen"):
        short.setup("validate")
    with pytest.raises(ValueError, match="the training split has"):
        short.setup("fit")  # loaded once, still checked
    with pytest.raises(ValueError, match="unknown tokenizer"):
        TextDataModule(path=path, tokenizer="bpe").setup()
    with pytest.raises(RuntimeError, match="setup"):
        TextDataModule(path=path).train_dataloader()
    with pytest.raises(ValueError, match=r"not in this tokenizer's vocabulary.*tokenizer='byte'"):
        TextDataModule(path=path, tokenizer={"kind": "char", "vocab": "abc"}).setup()
    # A character of the validation part only is named at its index in the corpus (it was its index in
    # that part, a new-user check).
    last = tmp_path / "last.txt"
    last.write_text("abc\n" * 100 + "z")
    with pytest.raises(ValueError, match=re.escape("character 'z' (U+007A) at index 400 is not in")):
        TextDataModule(path=last, seqlen=4, tokenizer={"kind": "char", "vocab": "\nabc"}).setup()
    # A Latin-1 corpus failed inside datasets (UnicodeDecodeError under DatasetGenerationError).
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin1") * 50)
    for tokenizer in ("char", "byte"):
        with pytest.raises(ValueError, match=r"'.*latin1.txt' is not UTF-8 text \(.*byte 0xe9.*iconv"):
            TextDataModule(path=latin1, tokenizer=tokenizer, seqlen=8).setup()


def test_build_text_datamodule(corpus):
    path, _ = corpus
    dm = build_datamodule("text", path=path, seqlen=8)
    assert isinstance(dm, TextDataModule)
    dm.setup()
    assert dm.vocab_size == 28


def test_tiny_shakespeare():
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    dm = TextDataModule(path=SHAKESPEARE, seqlen=64, batch_size=4)
    dm.setup()
    assert dm.vocab_size == 65
    assert "\n" in dm.tokenizer.vocab
    text = SHAKESPEARE.read_text()
    assert dm.train_tokens.shape[0] == int(len(text) * 0.9)
    assert dm.tokenizer.decode(dm.val_tokens[:100]) == text[int(len(text) * 0.9) :][:100]


def test_a_hub_dataset_the_hub_cannot_be_reached_for_is_read_from_the_cache_alone(tmp_path):
    """Found by a new-user check: on a machine without network, datasets retried the Hub for about
    25 s, printing a dozen warnings, before the one-line refusal. An unreachable Hub (here a local
    port nothing listens on) now sets HF_HUB_OFFLINE=1 first: the cache alone is read."""
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_DATASETS_OFFLINE", None)
    code = (
        "from data.text import TextDataModule\n"
        "try:\n    TextDataModule(dataset_name='karpathy/tiny_shakespeare').setup()\n"
        "except ValueError as err:\n    print(err)\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(
        "dataset_name='karpathy/tiny_shakespeare' could not be loaded: the Hub cannot be reached from this "
        "machine and the cache holds no copy; on a machine without network, load it once"
    ), result.stdout
    assert "Retrying" not in result.stderr and "thrown while requesting" not in result.stderr, result.stderr


def test_hub_unreachable_tries_one_connection(monkeypatch):
    from data.text import hub_unreachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert not hub_unreachable()
    assert hub_unreachable()  # the same port, closed

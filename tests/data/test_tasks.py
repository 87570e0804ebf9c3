"""Tests of the synthetic evaluation tasks: copying, selective copying, induction heads, passkey and
multi-key needle retrieval -- formats, label masks, seeds, lengths, slice keys and scorers."""

import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import compose_train
from omegaconf import OmegaConf

from data import (
    DATAMODULES,
    IGNORE_INDEX,
    SEED_STRIDE,
    ByteTokenizer,
    CopyDataModule,
    InductionHeadsDataModule,
    MultiKeyNeedleDataModule,
    PasskeyDataModule,
    SelectiveCopyingDataModule,
    build_datamodule,
    char_accuracy,
    copy_examples,
    exact_match,
    generated_to_predictions,
    induction_heads,
    multikey_needle_examples,
    passkey_examples,
    selective_copying,
    string_exact_match,
    token_accuracy,
)
from data.copying import BOS_ID, EOS_ID, FIRST_LETTER_ID, PAD_ID, SEP_ID, decode_copy
from data.retrieval import PASSKEY_QUESTION, passkey_filler_len
from data.synthetic import depth_bucket_name, depth_positions

SMALL = {"num_train_examples": 40, "num_test_examples": 12, "batch_size": 8}

# Tiny settings per task, with test slices longer than training.
TASKS = {
    "copy": (CopyDataModule, {"min_len": 8, "max_len": 12, "seqlen": 28}),
    "selective_copying": (SelectiveCopyingDataModule, {"seqlen": 32, "num_data_tokens": 6}),
    "induction_heads": (InductionHeadsDataModule, {"seqlen": 32}),
    "passkey": (PasskeyDataModule, {"seqlen": 300, "num_depth_buckets": 2}),
    "multikey_needle": (MultiKeyNeedleDataModule, {"seqlen": 200, "num_depth_buckets": 2}),
}


def _module(task: str, **overrides):
    cls, settings = TASKS[task]
    return cls(**{**settings, **SMALL, **overrides})


def _rows(ids: torch.Tensor) -> set:
    return {tuple(row) for row in ids.tolist()}


# ----------------------------------------------------------------------------------------------
# Copying (Jelassi et al. 2024)


def test_copy_layout_and_label_mask():
    ids, labels, lengths = copy_examples(200, seqlen=20, min_len=2, max_len=8, alphabet_size=5, seed=3)
    assert ids.shape == labels.shape == (200, 20) and ids.dtype == labels.dtype == torch.int64
    assert set(lengths.tolist()) == set(range(2, 9))  # uniform over the whole range
    for row, lab, n in zip(ids.tolist(), labels.tolist(), lengths.tolist(), strict=True):
        s = row[1 : n + 1]
        assert all(FIRST_LETTER_ID <= c < FIRST_LETTER_ID + 5 for c in s)
        assert row == [BOS_ID, *s, SEP_ID, *s, EOS_ID] + [PAD_ID] * (20 - 2 * n - 3)
        # only the copy is scored: SEP predicts s_1, ..., the copied s_n predicts EOS
        assert lab == [IGNORE_INDEX] * (n + 1) + s + [EOS_ID] + [IGNORE_INDEX] * (20 - 2 * n - 2)
    assert decode_copy(ids[0]) == decode_copy(ids[0].tolist())
    assert decode_copy(torch.tensor([1, 4, 5, 29, 30, 2, 3, 0])) == "^abz[26]|$_"


def test_copy_scorers_on_hand_made_predictions():
    ids, labels, _ = copy_examples(1, seqlen=9, min_len=2, max_len=2, alphabet_size=26, seed=0)
    labels = labels.repeat(4, 1)  # (4, 9): scored at positions 3 (s_1), 4 (s_2), 5 (EOS)
    a, b = labels[0, 3].item(), labels[0, 4].item()
    predictions = torch.full((4, 9), PAD_ID)
    predictions[:, 3:6] = torch.tensor([a, b, EOS_ID])
    predictions[1, 4] = a if a != b else a + 1  # second character wrong
    predictions[2, 5] = a  # characters right, no EOS: the output runs on
    predictions[3, 3:6] = torch.tensor([EOS_ID, EOS_ID, EOS_ID])  # stopped at once
    assert string_exact_match(predictions, labels).tolist() == [True, False, False, False]
    assert char_accuracy(predictions, labels).tolist() == [1.0, 0.5, 1.0, 0.0]
    assert token_accuracy(predictions, labels).tolist() == pytest.approx([1.0, 2 / 3, 2 / 3, 1 / 3])
    logits = F.one_hot(predictions, 30).float() * 5.0  # (4, 9, 30): the argmax is the prediction
    assert torch.equal(string_exact_match(logits, labels), string_exact_match(predictions, labels))
    # A greedy generation from the prompt BOS s SEP (length 4), scored through the same functions.
    generated = torch.cat([ids[:, :4], torch.tensor([[a, b, EOS_ID]])], dim=1)  # (1, 7)
    aligned = generated_to_predictions(generated, 9)
    assert string_exact_match(aligned, labels[:1]).tolist() == [True]
    assert string_exact_match(generated_to_predictions(generated[:, :6], 9), labels[:1]).tolist() == [False]


def test_copy_bad_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="too long for seqlen=40.*raise seqlen to 43 or lower max_len to 18"):
        CopyDataModule(max_len=20, seqlen=40)
    with pytest.raises(ValueError, match="alphabet_size must be >= 2"):
        CopyDataModule(alphabet_size=1)
    with pytest.raises(ValueError, match=r"max_len \(3\) must be >= min_len \(5\)"):
        copy_examples(4, seqlen=20, min_len=5, max_len=3, alphabet_size=4, seed=0)
    with pytest.raises(ValueError, match="min_len must be >= 1"):
        CopyDataModule(min_len=0)
    with pytest.raises(ValueError, match=r"test_configs\[0\]: .*raise seqlen to 83"):
        CopyDataModule(test_configs=[{"min_len": 21, "max_len": 40, "seqlen": 60}])
    with pytest.raises(ValueError, match=r"needs the keys \['min_len'\]"):
        CopyDataModule(test_configs=[{"max_len": 40}])


def test_copy_test_slices_default_to_longer_strings():
    dm = CopyDataModule(min_len=1, max_len=10, seqlen=23, **SMALL)
    assert dm.vocab_size == 30 and dm.train_slice_name == "len1-10"
    assert dm.slice_names == ["len1-10", "len11-20", "len21-40"]
    assert dm.slice_seqlens == {"len1-10": 23, "len11-20": 43, "len21-40": 83}
    dm.setup("test")
    lengths = [s.extras["length"] for s in dm.test_sets]
    assert lengths[1].min() >= 11 and lengths[2].max() <= 40 and dm.test_sets[2].seqlen == 83
    batch = next(iter(dm.test_dataloader()[2]))
    assert torch.equal(batch["prompt_len"], batch["length"] + 2)
    assert (batch["input_ids"].gather(1, batch["prompt_len"][:, None] - 1) == SEP_ID).all()


# ----------------------------------------------------------------------------------------------
# Selective copying (Gu & Dao 2023, App. E.1)


def test_selective_copying_layout_and_label_mask():
    V, T, M = 10, 40, 5
    ids, labels = selective_copying(100, seqlen=T, num_data_tokens=M, vocab_size=V, seed=1)
    assert ids.shape == labels.shape == (100, T)
    assert (ids[:, T - M :] == V - 1).all()  # the markers
    region = ids[:, : T - M]
    assert ((region == 0) | ((region >= 1) & (region < V - 1))).all()
    assert ((region != 0).sum(1) == M).all()
    for row, lab in zip(region, labels, strict=True):
        assert torch.equal(lab[T - M :], row[row != 0])  # the data, in order of appearance
    assert (labels[:, : T - M] == IGNORE_INDEX).all()
    positions = (region != 0).nonzero()[:, 1]
    assert positions.min() < 3 and positions.max() > T - M - 4  # scattered over the whole region


def test_selective_copying_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="num_data_tokens must be >= 1"):
        SelectiveCopyingDataModule(num_data_tokens=0)
    with pytest.raises(ValueError, match="vocab_size must be >= 4"):
        SelectiveCopyingDataModule(vocab_size=3)
    with pytest.raises(ValueError, match=r"seqlen >= 2 \* M = 32.*lower num_data_tokens to 15"):
        SelectiveCopyingDataModule(seqlen=31, num_data_tokens=16)
    with pytest.raises(ValueError, match=r"test_configs\[0\]: seqlen=20"):
        SelectiveCopyingDataModule(seqlen=64, num_data_tokens=16, test_configs=[{"seqlen": 20}])
    with pytest.raises(TypeError, match="integer"):
        selective_copying(4, seqlen=32.0, num_data_tokens=4, vocab_size=16, seed=0)


def test_selective_copying_test_configs_inherit_data_tokens():
    dm = SelectiveCopyingDataModule(seqlen=32, num_data_tokens=6, test_configs=[{"seqlen": 96}], **SMALL)
    assert dm.slice_names == ["T96_data6"] and dm.test_configs == [{"seqlen": 96, "num_data_tokens": 6}]


# ----------------------------------------------------------------------------------------------
# Induction heads (Gu & Dao 2023, Sec. 4.1.2)


def test_induction_heads_layout_and_label_mask():
    V, T = 6, 12
    ids, labels, trigger_pos = induction_heads(400, seqlen=T, vocab_size=V, seed=2)
    assert ids.shape == labels.shape == (400, T)
    assert ((ids == V - 1).sum(1) == 2).all() and (ids[:, -1] == V - 1).all()
    rows = torch.arange(400)
    assert (ids[rows, trigger_pos] == V - 1).all()
    assert set(trigger_pos.tolist()) == set(range(T - 2))  # uniform over [0, T - 3]
    assert torch.equal(labels[:, -1], ids[rows, trigger_pos + 1])
    assert (labels[:, :-1] == IGNORE_INDEX).all() and (labels[:, -1] < V - 1).all()


def test_induction_heads_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="vocab_size must be >= 3"):
        InductionHeadsDataModule(vocab_size=2)
    with pytest.raises(ValueError, match="seqlen must be >= 3"):
        induction_heads(2, seqlen=2, vocab_size=16, seed=0)
    with pytest.raises(ValueError, match=r"needs the key 'seqlen'"):
        InductionHeadsDataModule(test_configs=[{}])


# ----------------------------------------------------------------------------------------------
# Byte-level retrieval: passkey (Mohtashami & Jaggi 2023) and multi-key needle (RULER)


def _answer_bytes(ids: torch.Tensor, labels: torch.Tensor) -> str:
    return ByteTokenizer().decode(labels[labels != IGNORE_INDEX])


def test_passkey_prompt_answer_and_depth():
    T = 400
    ids, labels, depth = passkey_examples(30, seqlen=T, seed=4, depth_min=0.25, depth_max=0.5, num_digits=6)
    assert ids.shape == labels.shape == (30, T) and ((ids >= 0) & (ids < 256)).all()
    filler_len = passkey_filler_len(T, 6)
    for row, lab, d in zip(ids, labels, depth.tolist(), strict=True):
        text = ByteTokenizer().decode(row)
        prompt, answer = text[: T - 6], text[T - 6 :]
        assert prompt.endswith(PASSKEY_QUESTION) and re.fullmatch(r"[1-9]\d{5}", answer)
        assert f"The pass key is {answer}. Remember it. {answer} is the pass key." in prompt
        assert _answer_bytes(row, lab) == answer
        assert torch.equal(lab[T - 7 : T - 1], row[T - 6 :]) and (lab[: T - 7] == IGNORE_INDEX).all()
        before = prompt.split("\n")[1]  # the filler in front of the needle
        assert d == len(before) / filler_len and 0.25 <= d < 0.5
    assert len(set(depth.tolist())) > 5


def test_multikey_needle_prompt_answer_and_depth():
    T = 260
    ids, labels, depth = multikey_needle_examples(20, seqlen=T, seed=5, depth_min=0.5, depth_max=1.0)
    for row, lab, d in zip(ids, labels, depth.tolist(), strict=True):
        text = ByteTokenizer().decode(row)
        needles = re.findall(r"The value of key (\d{4}) is (\d{4})\.", text)
        assert len(needles) == (T - 58) // 32 == 6  # as many as fit: 31 bytes + separator each
        keys = [k for k, _ in needles]
        assert len(set(keys)) == len(keys)  # distinct keys: one right answer
        query = re.search(r"What is the value of key (\d{4})\? The value of key \1 is (\d{4})$", text)
        assert query is not None and _answer_bytes(row, lab) == query.group(2)
        assert dict(needles)[query.group(1)] == query.group(2)
        assert d == keys.index(query.group(1)) / (len(keys) - 1) and d >= 0.5
    assert len(set(depth.tolist())) == 3  # needle indices 3, 4, 5 of 0..5


def test_retrieval_slices_are_length_by_depth_cells():
    dm = _module("passkey")
    assert dm.vocab_size == 256 and dm.train_slice_name == "T300_depth0-100"
    assert dm.slice_names == [f"T{t}_depth{r}" for t in (300, 600, 1200) for r in ("0-50", "50-100")]
    dm.setup("test")
    for test_set, cfg in zip(dm.test_sets, dm.test_configs, strict=True):
        depth = test_set.extras["depth"]
        assert test_set.seqlen == cfg["seqlen"] and (depth >= cfg["depth_min"]).all()
        assert (depth < cfg["depth_max"]).all() or cfg["depth_max"] == 1.0
        assert set(test_set.extras["prompt_len"].tolist()) == {cfg["seqlen"] - 5}
    custom = _module("multikey_needle", test_configs=[{"seqlen": 400}, {"seqlen": 400, "depth_max": 0.1}])
    assert custom.slice_names == ["T400_depth0-100", "T400_depth0-10"]


def test_retrieval_errors_say_how_to_fix():
    with pytest.raises(ValueError, match=r"use seqlen >= 254") as err:
        PasskeyDataModule(seqlen=200, num_depth_buckets=1)
    assert "253 bytes" in str(err.value)
    assert PasskeyDataModule(seqlen=254, num_depth_buckets=1, **SMALL).train_config["seqlen"] == 254
    with pytest.raises(ValueError, match=r"holds 1 key-value needles.*use seqlen >= 122 \(2 needles\)"):
        MultiKeyNeedleDataModule(seqlen=100, num_depth_buckets=1)
    assert len(MultiKeyNeedleDataModule(seqlen=122, num_depth_buckets=1, **SMALL).slice_names) == 3
    with pytest.raises(ValueError, match=r"test_configs\[0\]: .*too few.*\[0.4, 0.45\)"):
        MultiKeyNeedleDataModule(test_configs=[{"seqlen": 300, "depth_min": 0.4, "depth_max": 0.45}])
    with pytest.raises(ValueError, match="0 <= depth_min < depth_max <= 1"):
        passkey_examples(2, seqlen=512, seed=0, depth_min=0.5, depth_max=0.5)
    with pytest.raises(ValueError, match="raise key_digits"):
        multikey_needle_examples(2, seqlen=400, seed=0, key_digits=1)
    with pytest.raises(ValueError, match="unknown keys"):
        PasskeyDataModule(test_configs=[{"seqlen": 512, "depth": 0.5}])


def test_depth_helpers():
    assert depth_positions(0.07, 0.08, 100) == (7, 7)  # 0.07 * 100 is 7.000000000000001 in floating point
    assert depth_positions(0.75, 1.0, 4) == (3, 4)  # the last range is closed at 1
    assert depth_positions(0.0, 1.0, 0) == (0, 0)
    first, last = depth_positions(0.3, 0.4, 2)
    assert first > last
    assert depth_bucket_name(0.25, 0.5) == "depth25-50"


# ----------------------------------------------------------------------------------------------
# Every task: data module contract


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_per_seed(task):
    first, second, other = _module(task, seed=3), _module(task, seed=3), _module(task, seed=4)
    for dm in (first, second, other):
        dm.setup()
    assert torch.equal(first.train_set.input_ids, second.train_set.input_ids)
    assert torch.equal(first.test_sets[-1].labels, second.test_sets[-1].labels)
    assert torch.equal(first.val_sets[0].input_ids, second.val_sets[0].input_ids)
    assert not torch.equal(first.train_set.input_ids, other.train_set.input_ids)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_validation_and_test_are_disjoint(task):
    dm = _module(task, seed=2)
    assert dm.train_seed == 2 * SEED_STRIDE
    seeds = [dm.train_seed, *dm.test_seeds, *dm.val_seeds]
    assert len(set(seeds)) == len(seeds)
    dm.setup()
    assert [s.seed for s in dm.test_sets] == dm.test_seeds and [s.seed for s in dm.val_sets] == dm.val_seeds
    # The slices with the training setting hold other examples than the training set.
    train, val, test = (
        _rows(dm.train_set.input_ids),
        _rows(dm.val_sets[0].input_ids),
        _rows(dm.test_sets[0].input_ids),
    )
    assert dm.test_configs[0]["seqlen"] == dm.train_config["seqlen"]
    assert not train & test and not train & val and not val & test


@pytest.mark.parametrize("task", sorted(TASKS))
def test_batches_carry_slice_keys_and_longer_test_lengths(task):
    dm = _module(task)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.setup("test")
    assert dm.train_set is None and dm.val_sets is None
    loaders = dm.test_dataloader()
    assert len(loaders) == len(dm.slice_names) >= 3
    seqlens = []
    for loader, name in zip(loaders, dm.slice_names, strict=True):
        batch = next(iter(loader))
        assert batch["slice"] == [name] * 8
        assert batch["input_ids"].shape == batch["labels"].shape == (8, dm.slice_seqlens[name])
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
        assert ((batch["labels"] != IGNORE_INDEX).sum(1) > 0).all()
        assert (batch["input_ids"] < dm.vocab_size).all() and (batch["input_ids"] >= 0).all()
        seqlens.append(batch["input_ids"].shape[1])
    assert max(seqlens) > dm.train_config["seqlen"]
    dm.setup("fit")
    train_batch = next(iter(dm.train_dataloader()))
    assert train_batch["slice"] == [dm.train_slice_name] * 8 and len(dm.train_set) == 40


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generate_slice_and_bad_test_configs(task):
    dm = _module(task)
    extra = dm.generate_slice(dict(dm.test_configs[-1]), 5)
    assert extra.seed == dm.train_seed + 1 + len(dm.test_configs) and len(extra) == 5
    assert extra.name == dm.slice_names[-1]
    assert torch.equal(extra.input_ids, dm.generate_slice(dm.test_configs[-1], 5).input_ids)
    with pytest.raises(ValueError, match="training or validation seed"):
        dm.generate_slice(dm.test_configs[0], 5, seed=dm.val_seeds[0])
    with pytest.raises(ValueError, match="more than once"):
        _module(task, test_configs=[dm.test_configs[0]] * 2)
    with pytest.raises(TypeError, match="list of mappings"):
        _module(task, test_configs=dm.test_configs[0])
    with pytest.raises(ValueError, match="unknown keys"):
        _module(task, test_configs=[{**dm.test_configs[0], "bogus": 1}])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_hydra_config_builds_the_module(task):
    cfg = compose_train([f"data={task}"])
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    assert data_cfg["name"] == task and DATAMODULES[task] is TASKS[task][0]
    assert data_cfg["monitor"] == "val/acc" and isinstance(data_cfg["seqlen"], int)  # train.py reads both
    kwargs = {k: v for k, v in data_cfg.items() if k not in ("name", "monitor", "monitor_mode")}
    dm = build_datamodule(task, **{**kwargs, "num_train_examples": 4, "num_test_examples": 2})
    assert dm.train_config["seqlen"] == data_cfg["seqlen"] and len(dm.slice_names) >= 3


def test_scorers_generic_and_errors():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6], [7, IGNORE_INDEX, IGNORE_INDEX]])
    predictions = torch.tensor([[0, 5, 1], [7, 0, 0]])
    assert exact_match(predictions, labels).tolist() == [False, True]
    assert token_accuracy(predictions, labels).tolist() == [0.5, 1.0]
    assert token_accuracy(predictions, labels).dtype == torch.float64
    with pytest.raises(ValueError, match="must both be"):
        exact_match(predictions[:, :2], labels)
    with pytest.raises(ValueError, match="row 1 has no scored position"):
        exact_match(predictions, torch.tensor([[1, 2, 3], [IGNORE_INDEX] * 3]))
    with pytest.raises(ValueError, match="logits must be"):
        token_accuracy(torch.zeros(2, 3), labels)
    with pytest.raises(ValueError, match="only EOS"):
        char_accuracy(torch.full((1, 3), EOS_ID), torch.tensor([[IGNORE_INDEX, EOS_ID, IGNORE_INDEX]]))
    aligned = generated_to_predictions(torch.tensor([[9, 8, 7]]), 4)
    assert aligned.tolist() == [[8, 7, -1, -1]]
    assert generated_to_predictions(torch.arange(10)[None], 3).tolist() == [[1, 2, 3]]


class _Bigram(L.LightningModule):
    """A bigram model that records the validation slices Lightning feeds it."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)
        self.val_slices = {}
        self.losses = []

    def training_step(self, batch, batch_idx):
        logits = self.logits(batch["input_ids"])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.val_slices.setdefault(dataloader_idx, set()).update(batch["slice"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_copy_datamodule_in_lightning_trainer():
    dm = _module("copy")
    probe = _Bigram(dm.vocab_size)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(probe, datamodule=dm)
    assert probe.val_slices == {i: {name} for i, name in enumerate(dm.slice_names)}
    assert len(probe.losses) == 5 and all(torch.isfinite(torch.tensor(probe.losses)))

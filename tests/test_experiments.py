"""The paper experiments of conf/experiment/: their composed values, and a few real CPU steps of each.

Sources of the expected values: Zoology Figure 2 (HazyResearch/zoology, iclr24_zoology_figure2
configs), nanoGPT's config/train_shakespeare_char.py, Mamba Sec. 4.1.2 / App. E.1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import compose_train, metrics_rows

import train as train_module
from models import LanguageModel
from models.checkpoint import read_checkpoint

ZOOLOGY_MIXERS = ["attention", "mamba", "sliding_window", "linear_attention", "hybrid_based"]
QUIET = ["logger=csv", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]


def model_of(overrides: list[str], vocab_size: int) -> LanguageModel:
    cfg = compose_train(overrides)
    return LanguageModel(train_module.build_model_config(cfg, vocab_size))


def test_zoology_mqar_composes_to_figure2_at_seqlen_256():
    cfg = compose_train(["experiment=zoology_mqar"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.num_heads, cfg.model.mlp) == (2, 64, 1, "none")
    assert (cfg.model.embed_dropout, cfg.model.resid_dropout) == (0.1, 0.0)
    data = cfg.data
    assert (data.name, data.vocab_size, data.seqlen, data.num_kv_pairs) == ("mqar", 8192, 256, 16)
    assert data.random_non_queries is False and data.power_a == 0.01
    assert (data.num_train_examples, data.num_test_examples, data.batch_size) == (100_000, 3_000, 256)
    assert [dict(c) for c in data.test_configs] == [{"seqlen": 256, "num_kv_pairs": 16}]
    assert cfg.optim.weight_decay == 0.1 and list(cfg.optim.betas) == [0.9, 0.999]
    assert (cfg.optim.warmup_steps, cfg.optim.min_lr_ratio, cfg.optim.schedule_interval) == (0, 0.0, "epoch")
    assert cfg.trainer.max_epochs == 64 and cfg.trainer.max_steps == -1
    assert cfg.trainer.check_val_every_n_epoch == 1 and cfg.trainer.gradient_clip_val is None
    assert dict(cfg.early_stopping) == {
        "monitor": "val/acc",
        "mode": "max",
        "stopping_threshold": 0.99,
        "patience": 64,
    }
    attention = cfg.mixer.settings.attention
    assert (attention.num_heads, attention.pos_emb, attention.max_position, attention.bias) == (
        1,
        "learned",
        256,
        True,
    )
    model = model_of(["experiment=zoology_mqar"], 8192)
    assert model.config.layout == ["attention", "attention"] and model.config.d_intermediate == 0
    assert all(block.mlp is None and block.mixer.wpe.num_embeddings == 256 for block in model.layers)


@pytest.mark.parametrize("mixer", ZOOLOGY_MIXERS)
def test_zoology_mqar_sweeps_every_mixer_and_width(mixer):
    cfg = compose_train(["experiment=zoology_mqar", f"mixer={mixer}", "model.d_model=128", "optim.lr=4.6e-4"])
    assert cfg.mixer.name == mixer and cfg.optim.lr == 4.6e-4 and cfg.data.name == "mqar"
    model = model_of(["experiment=zoology_mqar", f"mixer={mixer}", "model.d_model=128"], 8192)
    assert model.config.d_model == 128 and len(model.config.layout) == 2
    assert all(block.mlp is None for block in model.layers)


def test_nanogpt_shakespeare_composes_to_train_shakespeare_char():
    cfg = compose_train(["experiment=nanogpt_shakespeare"])
    assert (cfg.model.n_layers, cfg.model.num_heads, cfg.model.d_model) == (6, 6, 384)
    assert (cfg.model.embed_dropout, cfg.model.resid_dropout, cfg.model.mlp) == (0.2, 0.2, "swiglu")
    assert (cfg.data.name, cfg.data.tokenizer, cfg.data.train_fraction) == ("text", "char", 0.9)
    assert (cfg.data.seqlen, cfg.data.batch_size) == (256, 64)
    assert cfg.data.path.endswith("tiny_shakespeare.txt")
    assert (cfg.optim.lr, cfg.optim.weight_decay, list(cfg.optim.betas)) == (1e-3, 0.1, [0.9, 0.99])
    assert (cfg.optim.warmup_steps, cfg.optim.min_lr_ratio * cfg.optim.lr) == (100, pytest.approx(1e-4))
    assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval) == (5000, 250)
    assert cfg.trainer.gradient_clip_val == 1.0
    assert cfg.early_stopping is None
    model = model_of(["experiment=nanogpt_shakespeare"], 65)
    assert model.config.layout == ["attention"] * 6 and model.layers[0].mixer.num_heads == 6
    assert model.embed_dropout.p == 0.2 and model.layers[5].dropout.p == 0.2


@pytest.mark.parametrize(
    ("mixer", "layout"),
    [
        ("hybrid_jamba", ["mamba"] * 4 + ["attention"] + ["mamba"] * 3),
        ("hybrid_samba", ["mamba", "sliding_window"] * 4),
    ],
)
def test_nanogpt_shakespeare_hybrids_at_8_layers(mixer, layout):
    overrides = ["experiment=nanogpt_shakespeare", f"mixer={mixer}", "model.n_layers=8"]
    assert model_of(overrides, 65).config.layout == layout
    with pytest.raises(ValueError, match="does not divide n_layers=6"):
        model_of(["experiment=nanogpt_shakespeare", "mixer=hybrid_jamba"], 65)


def test_induction_extrapolation_composes_to_mamba_sec_4_1_2():
    cfg = compose_train(["experiment=induction_extrapolation"])
    assert (cfg.model.n_layers, cfg.model.d_model) == (2, 64)
    assert (cfg.data.name, cfg.data.vocab_size, cfg.data.seqlen, cfg.data.batch_size) == (
        "induction_heads",
        16,
        256,
        8,
    )
    assert [c.seqlen for c in cfg.data.test_configs] == [256, 64, 128, 512, 1024, 2048, 4096, 8192, 16384]
    assert cfg.trainer.max_steps == 8192 and cfg.data.num_train_examples == 8192 * 8
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.min_lr_ratio, cfg.optim.warmup_steps) == (
        1e-3,
        0.0,
        1.0,
        0,
    )
    learned = model_of(["experiment=induction_extrapolation"], 16)
    assert all(block.mixer.wpe.num_embeddings == 16384 for block in learned.layers)
    rope = model_of(["experiment=induction_extrapolation", "mixer.settings.attention.pos_emb=rope"], 16)
    assert all(block.mixer.pos_emb == "rope" and block.mixer.wpe is None for block in rope.layers)
    mamba = model_of(["experiment=induction_extrapolation", "mixer=mamba"], 16)
    assert mamba.config.layout == ["mamba", "mamba"]
    longer = compose_train(
        ["experiment=induction_extrapolation", "data.test_configs=[{seqlen:256},{seqlen:1048576}]"]
    )
    assert [c.seqlen for c in longer.data.test_configs] == [256, 1048576]


def run(tmp_path: Path, overrides: list[str]) -> dict:
    return train_module.train(compose_train(overrides + QUIET + [f"run_dir={tmp_path}"]))


ZOOLOGY_TINY = [
    "experiment=zoology_mqar",
    "model.d_model=16",
    "data.vocab_size=64",
    "data.seqlen=32",
    "data.num_kv_pairs=4",
    "data.test_configs=[{seqlen:32,num_kv_pairs:4}]",
    "data.num_train_examples=64",
    "data.num_test_examples=32",
    "data.batch_size=32",
    "trainer.max_epochs=3",
]


def test_zoology_mqar_trains_with_cosine_per_epoch(tmp_path):
    out = run(tmp_path, ZOOLOGY_TINY)
    rows = metrics_rows(out["run_dir"])
    lr_by_epoch: dict[int, set[float]] = {}
    for row in rows:
        if row.get("lr-AdamW/pg1"):  # 64 examples in batches of 32: steps 2e and 2e + 1 are epoch e
            lr_by_epoch.setdefault(int(row["step"]) // 2, set()).add(float(row["lr-AdamW/pg1"]))
    # the rate changes only between epochs, to lr (1 + cos(pi e / 3)) / 2 in epoch e
    assert sorted(lr_by_epoch) == [0, 1, 2] and all(len(lrs) == 1 for lrs in lr_by_epoch.values())
    for epoch, (lr,) in lr_by_epoch.items():
        assert lr == pytest.approx(2.2e-3 * 0.5 * (1 + math.cos(math.pi * epoch / 3)))
    assert sum(1 for row in rows if row.get("train/loss")) == 6  # 3 epochs of 2 steps: no early stop
    assert sum(1 for row in rows if row.get("val/acc")) >= 3  # validated after each epoch
    lit_model = read_checkpoint(out["last_ckpt"])["hyper_parameters"]["model"]
    assert lit_model["embed_dropout"] == 0.1 and lit_model["mlp"] == "none"


def test_zoology_mqar_stops_early_at_the_accuracy_threshold(tmp_path):
    out = run(tmp_path, ZOOLOGY_TINY + ["early_stopping.stopping_threshold=-1.0"])  # any accuracy exceeds it
    steps = [row["step"] for row in metrics_rows(out["run_dir"]) if row.get("train/loss")]
    assert steps == ["0", "1"]  # stopped after the first epoch's validation, not after 3 epochs


@pytest.mark.parametrize(("mixer", "n_layers"), [("attention", 2), ("hybrid_jamba", 8)])
def test_nanogpt_shakespeare_trains_a_few_steps(tmp_path, mixer, n_layers):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 40)
    overrides = [
        "experiment=nanogpt_shakespeare",
        f"mixer={mixer}",
        f"data.path={corpus}",
        f"model.n_layers={n_layers}",
        "model.d_model=32",
        "model.num_heads=2",
        "data.seqlen=16",
        "data.batch_size=8",
        "optim.warmup_steps=1",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
    ]
    out = run(tmp_path / "run", overrides)
    losses = [float(r["train/loss"]) for r in metrics_rows(out["run_dir"]) if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert sum(1 for r in metrics_rows(out["run_dir"]) if r.get("val/loss")) >= 2  # every 2 steps
    hparams = read_checkpoint(out["last_ckpt"])["hyper_parameters"]
    assert hparams["model"]["resid_dropout"] == 0.2 and hparams["optim"]["betas"] == [0.9, 0.99]
    assert hparams["tokenizer_config"]["kind"] == "char" and "\n" in hparams["tokenizer_config"]["vocab"]


INDUCTION_TINY = [
    "experiment=induction_extrapolation",
    "model.d_model=16",
    "data.seqlen=16",
    "data.test_configs=[{seqlen:16},{seqlen:8},{seqlen:64}]",
    "data.num_train_examples=32",
    "data.num_test_examples=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
]


@pytest.mark.parametrize(
    "overrides",
    [
        ["mixer.settings.attention.max_position=64"],
        ["mixer.settings.attention.pos_emb=rope"],
        ["mixer=mamba"],
    ],
    ids=["learned", "rope", "mamba"],
)
def test_induction_extrapolation_records_each_slice_at_its_length(tmp_path, overrides):
    out = run(tmp_path, INDUCTION_TINY + overrides)
    records = json.loads((Path(out["run_dir"]) / "results" / "train.json").read_text())
    model = LanguageModel(read_checkpoint(out["last_ckpt"])["hyper_parameters"]["model"])
    seqlens = {r["metric"]: r["seqlen"] for r in records}
    assert seqlens["val/acc_T8"] == 8 and seqlens["val/acc_T64"] == 64
    assert seqlens["val/acc"] == seqlens["val/loss_T16"] == 16  # the first slice is the training length
    assert all(r["state_bytes"] == model.state_size(r["seqlen"]) for r in records)
    assert all(r["lr"] == 1e-3 for r in records)
    assert (0.0 <= out["metrics"]["val/acc_T64"] <= 1.0) and (out["metrics"]["val/acc_T64"] * 8).is_integer()


def test_learned_positions_shorter_than_the_longest_slice_fail_before_training(tmp_path, monkeypatch):
    # Before the seeding too (a new-user check: the refusal came after Lightning's "Seed set to 0").
    def seeded(*args, **kwargs):
        raise AssertionError("seeded before the refusal")

    monkeypatch.setattr(train_module.L, "seed_everything", seeded)
    with pytest.raises(ValueError, match=r"max_position=32 rows.*max_position=64"):
        run(tmp_path, INDUCTION_TINY + ["mixer.settings.attention.max_position=32"])
    assert not (tmp_path / "checkpoints").exists()

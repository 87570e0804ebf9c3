"""End to end: every mixer config trains under Lightning, DDP on gloo, checkpoints, recall eval, CLI errors."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import http.server
import inspect
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import wandb
from helpers import (
    MIXER_CONFIGS,
    REPO_ROOT,
    SHAKESPEARE,
    compose_eval,
    compose_train,
    metrics_rows,
    without_wandb_key,
)
from lightning.pytorch.callbacks import EarlyStopping, model_checkpoint
from lightning.pytorch.utilities.rank_zero import WarningCache
from omegaconf import OmegaConf

import train as train_module
import training.settings
from data import build_datamodule
from eval.cli import INTERRUPTED, override_value, pasteable
from eval.recall import recall_eval
from eval.records import check_wandb_login
from models.checkpoint import AtomicCheckpointIO, read_checkpoint
from models.lit import LitLM, load_model, logged_metrics
from training.resume import (
    MAX_PROCESSES,
    RESUME_EXEMPT_DATA_KEYS,
    check_resume,
    check_resume_world_size,
    resolve_defaults,
    resume_settings,
)
from training.run_folders import (
    HYDRA_RUN_FILES,
    FolderBefore,
    FoldersBefore,
    _restore_hydra_files,
    check_subdir_varies,
    remove_unused_folders,
    remove_unused_run_dir,
)
from training.settings import (
    TrainerSettingsError,
    check_logger_settings,
    check_run_dir,
    check_settings,
    check_trainer_settings,
    check_val_batches,
    lightning_precisions,
    resolved_world_size,
)
from training.signals import defer_stop_signals

# A tiny but real run: 20 optimizer steps of a 32-wide model on MQAR, one validation at the end.
TINY = [
    "model.d_model=32",
    "trainer.max_steps=20",
    "trainer.val_check_interval=20",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=5",
    "data.batch_size=32",
    "logger=csv",
]
MQAR_TINY = ["data.num_train_examples=640", "data.num_test_examples=64"]


@contextlib.contextmanager
def train_log_heard(monkeypatch, caplog) -> Iterator[None]:
    """train.py's logger heard directly by ``caplog`` at INFO within the block, and the SIGINT
    handler put back after it (Lightning ignores Ctrl+C from an interrupt on)."""
    logger = logging.getLogger("mixerlab.train")
    monkeypatch.setattr(logger, "disabled", False)
    level, sigint = logger.level, signal.getsignal(signal.SIGINT)
    logger.setLevel(logging.INFO)
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        signal.signal(signal.SIGINT, sigint)


def run_train(tmp_path: Path, overrides: list[str]) -> dict:
    data = [] if "data=text" in overrides else MQAR_TINY
    cfg = compose_train(TINY + data + overrides + [f"run_dir={tmp_path}"])
    return train_module.train(cfg)


def logged(run_dir: str, key: str) -> list[float]:
    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.mark.parametrize("mixer", MIXER_CONFIGS)
def test_every_mixer_config_trains_20_steps(tmp_path, mixer, monkeypatch, caplog):
    with train_log_heard(monkeypatch, caplog):
        out = run_train(tmp_path, [f"mixer={mixer}"])
    # The start line names Zamba's shared block, which its layout does not list (a new-user check).
    started = next(line for line in caplog.messages if line.startswith("mixerlab: "))
    assert ("shared_block=attention every 4 layers params=" in started) == (mixer == "hybrid_zamba"), started
    losses = logged(out["run_dir"], "train/loss")
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns something
    assert Path(out["best_ckpt"]).name == "best.ckpt" and Path(out["last_ckpt"]).name == "last.ckpt"
    assert 0.0 <= out["metrics"]["val/acc"] <= 1.0
    lit = load_model(out["last_ckpt"])
    assert lit.model.config.name == mixer
    # The names early_stopping.monitor is checked against are the ones this run logged.
    with open(Path(out["run_dir"]) / "csv" / "metrics.csv") as f:
        columns = set(next(csv.reader(f)))
    assert {c for c in columns if c.startswith(("train/", "val/"))} == logged_metrics(lit.slice_names)
    records = json.loads((Path(out["run_dir"]) / "results" / "train.json").read_text())
    assert {r["metric"] for r in records} >= {"val/acc", "val/loss"}
    assert all(r["mixer"] == mixer and r["state_bytes"] == lit.model.state_size(r["seqlen"]) for r in records)
    # Every setting but the learning rate, for eval/report.py's groups; mixer settings of the
    # mixers the model builds only (the configs carry others for sweeps).
    settings = records[0]["settings"]
    shared = lit.model.config.shared_block
    built = set(lit.model.config.layout) | ({shared.mixer} if shared else set())
    assert {key.split(".")[2] for key in settings if key.startswith("mixer.settings.")} == built
    assert "optim.lr" not in settings and settings["optim.weight_decay"] == lit.optim["weight_decay"]
    assert settings["world_size"] == 1 and settings["trainer.max_steps"] == 20
    assert settings["mixer.name"] == mixer
    seqlens = {r["metric"]: r["seqlen"] for r in records}
    assert seqlens["val/acc"] == seqlens["val/acc_T64_kv4"] == 64 and seqlens["val/acc_T256_kv16"] == 256
    slices = {r["metric"]: r["slice"] for r in records}
    assert (
        slices["val/acc"] == slices["val/loss_T64_kv4"] == "T64_kv4"
        and slices["val/acc_T256_kv16"] == "T256_kv16"
    )
    config = lit.model.config  # what eval/report.py groups a learning-rate sweep by
    assert {(r["lr"], r["d_model"], r["n_layers"], r["batch_size"]) for r in records} == {
        (3e-3, config.d_model, config.n_layers, 32)
    }
    assert (out["metrics"]["val/acc"] * 64 * 4).is_integer()  # exact counts over 64 examples x 4 queries


def test_last_checkpoint_holds_the_final_weights_and_best_the_best(tmp_path, caplog, monkeypatch):
    # 7 steps validated at step 5 only: best.ckpt is step 5's, last.ckpt the weights after step 7
    # (Lightning's own save_last would refresh last.ckpt only together with a new best).
    # train.py's logger, heard directly: an in-process Hydra run of an evaluation earlier in the
    # session (hydra/job_logging: disabled) disables existing loggers and raises the root's level.
    logger = logging.getLogger("mixerlab.train")
    monkeypatch.setattr(logger, "disabled", False)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it also clears the loggers' level caches
    logger.addHandler(caplog.handler)
    try:
        out = run_train(tmp_path, ["mixer=attention", "trainer.max_steps=7", "trainer.val_check_interval=5"])
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
    # The log says that the final weights were never validated.
    assert "the last 2 training steps were not validated (after step 5, the last validation)" in caplog.text
    assert "a trainer.max_steps that trainer.val_check_interval divides validates them" in caplog.text
    assert read_checkpoint(out["best_ckpt"])["global_step"] == 5
    last = read_checkpoint(out["last_ckpt"])
    assert last["global_step"] == 7 and Path(out["last_ckpt"]).name == "last.ckpt"
    with torch.no_grad():
        final = {k: v.clone() for k, v in load_model(out["last_ckpt"]).state_dict().items()}
        best = load_model(out["best_ckpt"]).state_dict()
    assert any(not torch.equal(final[k], best[k]) for k in final)


@pytest.fixture(scope="module")
def jamba_run(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("jamba"), ["mixer=hybrid_jamba", "logger=wandb"])


def test_default_logger_writes_wandb_offline_and_csv(jamba_run):
    run_dir = Path(jamba_run["run_dir"])
    assert (run_dir / "csv" / "metrics.csv").exists()
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline W&B run was written"


def test_checkpoint_rebuilds_the_model_alone(jamba_run):
    checkpoint = read_checkpoint(jamba_run["best_ckpt"])
    assert checkpoint["hyper_parameters"]["model"]["pattern"][4] == "attention"
    lit = load_model(jamba_run["best_ckpt"])
    ids = torch.randint(0, 512, (2, 16))
    torch.testing.assert_close(lit.model(ids), lit.model.decode_logits(ids, 8), rtol=1e-4, atol=1e-4)
    assert not list(Path(jamba_run["run_dir"], "checkpoints").glob("*.tmp")), "temporary files left behind"
    assert not any("=" in p.name for p in Path(jamba_run["run_dir"], "checkpoints").iterdir())


def test_recall_eval_parallel_and_decode_agree(jamba_run, tmp_path, capsys):
    output = tmp_path / "recall.json"
    cfg = compose_eval(
        "recall", [f"ckpt={jamba_run['best_ckpt']}", "num_examples=48", "batch_size=24", f"output={output}"]
    )
    records = recall_eval(cfg)
    assert {r["slice"] for r in records} == {"T64_kv4", "T128_kv8", "T256_kv16"}
    by_slice = {}
    for r in records:
        by_slice.setdefault(r["slice"], {})[r["path"]] = r["value"]
        assert r["state_bytes"] > 0 and r["tokens_per_s"] > 0
    for acc in by_slice.values():
        assert abs(acc["parallel"] - acc["decode"]) <= 0.005
    assert json.loads(output.read_text()) == records
    printed = capsys.readouterr().out
    assert "T256_kv16" in printed and "decode" in printed


def test_recall_default_output_lies_next_to_the_checkpoint_and_logs_to_wandb(jamba_run):
    overrides = [
        f"ckpt={jamba_run['last_ckpt']}",
        "num_examples=8",
        "length_multipliers=[1]",
        "wandb.enabled=true",
    ]
    before = set(Path(jamba_run["run_dir"], "wandb").glob("offline-run-*"))
    recall_eval(compose_eval("recall", overrides))
    assert Path(jamba_run["last_ckpt"] + ".recall.json").exists()
    assert len(set(Path(jamba_run["run_dir"], "wandb").glob("offline-run-*")) - before) == 1


def test_text_training_stores_its_tokenizer(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    text = "to be, or not to be: that is the question.\n"
    corpus.write_text(text * 200)
    settings = ["data=text", "data.seqlen=32", "mixer=attention"]
    monkeypatch.chdir(tmp_path)
    out = run_train(tmp_path / "run", [*settings, "data.path=corpus.txt"])
    hparams = read_checkpoint(out["last_ckpt"])["hyper_parameters"]
    tokenizer = hparams["tokenizer_config"]
    vocab_size = len(set(corpus.read_text()))
    assert out["metrics"]["val/loss"] < torch.tensor(vocab_size).log()  # better than uniform guessing
    assert tokenizer["kind"] == "char" and "q" in tokenizer["vocab"]
    # The corpus is stored by its absolute path, so that a resume (or an evaluation) from another
    # folder reads and compares the same file; a review found the same file refused when named by
    # another path, and another file at the same relative path accepted.
    assert hparams["data"]["path"] == str(corpus)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "corpus.txt").write_text(text[::-1] * 200)  # the same characters, another text
    monkeypatch.chdir(elsewhere)
    resume = [*settings, "trainer.max_steps=21", f"resume={out['last_ckpt']}"]
    resumed = run_train(tmp_path / "resumed", [*resume, "data.path=../corpus.txt"])
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 21
    # Where both runs store the corpus digest, the contents are compared, not the path: a copy and a
    # hard link resume (a new-user check found them refused: a moved corpus could never resume), and
    # another text at the same relative path is refused by its digest.
    shutil.copy(corpus, elsewhere / "copy.txt")
    os.link(corpus, elsewhere / "link.txt")
    for name in ("copy.txt", "link.txt"):
        resumed = run_train(tmp_path / name, [*resume, f"data.path={name}"])
        assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 21
    with pytest.raises(ValueError, match=re.escape("this run's corpus is not the checkpoint's")):
        run_train(tmp_path / "other", [*resume, "data.path=corpus.txt"])
    # A checkpoint written before the digest was stored is compared by the file data.path names.
    checkpoint = torch.load(out["last_ckpt"], weights_only=False)
    del checkpoint["hyper_parameters"]["corpus_sha256"]
    undigested = tmp_path / "undigested.ckpt"
    torch.save(checkpoint, undigested)
    with pytest.raises(
        ValueError, match=re.escape(f"data.path={corpus}, this run has {elsewhere / 'copy.txt'};")
    ):
        run_train(tmp_path / "old", [*resume[:-1], f"resume={undigested}", "data.path=copy.txt"])
    # Another text at the corpus' own path, whose vocabulary would give the token ids other
    # characters, is refused, naming the characters that differ.
    corpus.write_text("TO BE, OR NOT TO BE: THAT IS THE QUESTION.\n" * 200)
    with pytest.raises(
        ValueError,
        match=r"another vocabulary than the checkpoint's \(new characters 'ABEHINOQRSTU', missing 'abehinoqrstu';",
    ):
        run_train(tmp_path / "edited", [*resume, f"data.path={corpus}"])
    # Only what differs is named (a new-user check: "new characters 'z', missing ''").
    corpus.write_text(text * 200 + "zzzz")
    with pytest.raises(ValueError, match=r"than the checkpoint's \(new characters 'z'; the token ids"):
        run_train(tmp_path / "appended", [*resume, f"data.path={corpus}"])
    # The same characters in another text at the same path (a new-user check reversed the corpus in
    # place, and the resume trained on other batches): refused by the corpus digest.
    assert hparams["corpus_sha256"] == hashlib.sha256((text * 200).encode()).hexdigest()
    corpus.write_text(text[::-1] * 200)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"resume={out['last_ckpt']}: this run's corpus is not the checkpoint's (its SHA-256 begins "
            f"{hashlib.sha256((text[::-1] * 200).encode()).hexdigest()[:12]}, the checkpoint's "
            f"{hparams['corpus_sha256'][:12]}): the file data.path names was edited or replaced"
        ),
    ):
        run_train(tmp_path / "reversed", [*resume, f"data.path={corpus}"])


def test_a_run_seed_other_than_the_data_seed_trains_with_a_logger(tmp_path):
    # Lightning merges the module's and the data module's hyperparameters for its loggers and refuses
    # one name with two values: the run's seed stored as "seed" beside data.seed crashed such runs.
    out = run_train(
        tmp_path, ["seed=1", "model.n_layers=2", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    )
    assert read_checkpoint(out["last_ckpt"])["hyper_parameters"]["run_seed"] == 1


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="tiny_shakespeare.txt is not beside the repo")
def test_text_training_on_tiny_shakespeare(tmp_path):
    out = run_train(tmp_path, ["data=text", f"data.path={SHAKESPEARE}", "data.seqlen=64", "mixer=attention"])
    assert read_checkpoint(out["last_ckpt"])["hyper_parameters"]["model"]["vocab_size"] == 65
    assert logged(out["run_dir"], "val/loss")[-1] < 4.17  # below uniform over 65 characters


def test_bad_configs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not divide n_layers=6"):
        run_train(tmp_path, ["mixer=hybrid_jamba", "model.n_layers=6"])
    with pytest.raises(ValueError, match="window"):
        run_train(tmp_path, ["mixer=sliding_window", "mixer.settings.sliding_window.window=0"])
    with pytest.raises(ValueError, match="divide"):
        run_train(tmp_path, ["mixer=attention", "model.num_heads=5"])
    with pytest.raises(ValueError, match="unknown optim keys"):
        run_train(tmp_path, ["+optim.momentum=0.9"])
    with pytest.raises(ValueError, match=r"unknown model keys \['foo'\]; valid keys: \['d_model', "):
        run_train(tmp_path, ["+model.foo=1"])
    # Keys no logger reads (W&B's entity, a logger mixerlab does not build) are refused, not dropped.
    for overrides, message in [
        (
            ["logger=wandb", "+logger.wandb.entity=team"],
            "unknown logger.wandb keys ['entity']; valid keys: ['enabled', ",
        ),
        (["+logger.csv.flush=1"], "unknown logger.csv keys ['flush']; valid keys: ['enabled']"),
        (
            ["+logger.tensorboard.enabled=true"],
            "unknown loggers ['tensorboard']; valid ones: ['csv', 'wandb']",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            run_train(tmp_path, overrides)
    with pytest.raises(ValueError, match="logger.wandb.mode must be 'online' or 'offline', got 'onlin'"):
        run_train(tmp_path, ["logger=wandb", "logger.wandb.mode=onlin"])
    # Hydra passes enabled=no as the string "no", which Python takes as true (W&B was switched on).
    with pytest.raises(ValueError, match="logger.wandb.enabled must be true or false, got 'no'"):
        run_train(tmp_path, ["logger.wandb.enabled=no"])
    with pytest.raises(ValueError, match="logger.csv.enabled must be true or false, got 'off'"):
        run_train(tmp_path, ["logger.csv.enabled=off"])
    with pytest.raises(ValueError, match="optim.lr must be > 0"):
        run_train(tmp_path, ["optim.lr=-1"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            run_train(tmp_path, ["trainer=gpu"])


def test_recall_eval_rejects_bad_settings(jamba_run):
    ckpt = f"ckpt={jamba_run['best_ckpt']}"
    with pytest.raises(ValueError, match="no checkpoint given"):
        recall_eval(compose_eval("recall", []))
    with pytest.raises(ValueError, match="num_examples must be an integer >= 1"):
        recall_eval(compose_eval("recall", [ckpt, "num_examples=0"]))
    with pytest.raises(ValueError, match="use multipliers below 8"):
        recall_eval(compose_eval("recall", [ckpt, "length_multipliers=[1,8]"]))
    with pytest.raises(ValueError, match="unknown decode_paths"):
        recall_eval(compose_eval("recall", [ckpt, "decode_paths=[parallel,beam]"]))
    # W&B settings are checked before the work, not when the records are about to be logged.
    with pytest.raises(ValueError, match="wandb.enabled must be true or false, got 'no'"):
        recall_eval(compose_eval("recall", [ckpt, "wandb.enabled=no"]))
    with pytest.raises(ValueError, match="wandb.mode must be 'online' or 'offline', got 'onlin'"):
        recall_eval(compose_eval("recall", [ckpt, "wandb.enabled=true", "wandb.mode=onlin"]))
    # The same error for any seqlens on an MQAR checkpoint: advice on its form (a list, not both
    # settings) would only lead to this one next.
    for seqlens in ("seqlens=[64,128]", "seqlens=64", "seqlens=[64]"):
        extra = ["length_multipliers=[1,2]"] if seqlens == "seqlens=[64]" else []
        with pytest.raises(
            ValueError, match="seqlens is for induction_heads checkpoints.*length_multipliers"
        ):
            recall_eval(compose_eval("recall", [ckpt, seqlens, *extra]))


def test_recall_eval_refuses_edited_checkpoints_in_one_line(jamba_run, tmp_path):
    """Data settings train.py refuses (seqlen 0 divided the slice lengths; a vocabulary below seqlen
    gave advice no multiplier could follow) and weights cast to integers (they loaded truncated and
    scored 0) are named as an edited checkpoint."""
    checkpoint = torch.load(jamba_run["best_ckpt"], map_location="cpu", weights_only=True)
    data = checkpoint["hyper_parameters"]["data"]
    edits = {
        "seqlen0": ({"seqlen": 0}, "seqlen must be >= 4, got 0"),
        "vocab16": ({"vocab_size": 16}, f"vocab_size (16) must be larger than seqlen ({data['seqlen']})"),
    }
    for name, (change, reason) in edits.items():
        edited = {
            **checkpoint,
            "hyper_parameters": {**checkpoint["hyper_parameters"], "data": {**data, **change}},
        }
        path = tmp_path / f"{name}.ckpt"
        torch.save(edited, path)
        with pytest.raises(
            ValueError,
            match=re.escape(f"checkpoint {path} holds data settings that train.py refuses ({reason}"),
        ):
            recall_eval(compose_eval("recall", [f"ckpt={path}", "device=cpu"]))
    weights = dict(checkpoint["state_dict"])
    first = next(name for name, t in weights.items() if t.is_floating_point())
    weights = {name: t.to(torch.int32) if t.is_floating_point() else t for name, t in weights.items()}
    path = tmp_path / "int32.ckpt"
    torch.save({**checkpoint, "state_dict": weights}, path)
    message = f"holds non-floating-point weights in {len(weights)} tensors (the first: {first} (torch.int32))"
    with pytest.raises(ValueError, match=re.escape(message) + ".*give a .ckpt file written by train.py"):
        load_model(path)
    # A model config that does not validate is named as the checkpoint's (a new-user check: it read as
    # a refusal of the user's own model.d_model), on evaluation and on resume.
    with pytest.raises(ValueError, match=re.escape(message) + ".*pass ckpt=<a .ckpt file"):
        recall_eval(compose_eval("recall", [f"ckpt={path}", "device=cpu"]))
    # A model config that does not validate is named as the checkpoint's (a new-user check: it read as
    # a refusal of the user's own model.d_model), on evaluation and on resume.
    model = {**checkpoint["hyper_parameters"]["model"], "d_model": -3}
    path = tmp_path / "d_model.ckpt"
    torch.save({**checkpoint, "hyper_parameters": {**checkpoint["hyper_parameters"], "model": model}}, path)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"checkpoint {path} holds a model config that does not validate (model.d_model must be a positive "
            "integer, got -3): was it edited, or written by another mixerlab version?"
        ),
    ):
        load_model(path)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"resume={path} holds settings that do not validate (model.d_model must be a positive integer, got "
            "-3): the checkpoint is corrupt"
        ),
    ):
        run_train(tmp_path / "resumed", [*JAMBA_RESUME, f"resume={path}"])


def test_resume_refuses_a_checkpoint_at_max_epochs(jamba_run, tmp_path):
    """An epoch-based run (zoology_mqar) resumed at its trainer.max_epochs trained nothing and
    repeated the old run's records, blaming max_steps; it is refused up front like max_steps."""
    checkpoint = torch.load(jamba_run["last_ckpt"], map_location="cpu", weights_only=True)
    checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] = 3
    path = tmp_path / "three-epochs.ckpt"
    torch.save(checkpoint, path)
    saved = checkpoint["hyper_parameters"]  # the run's own settings
    with pytest.raises(
        ValueError, match=re.escape("has already trained 3 epoch(s), and trainer.max_epochs=3")
    ):
        check_resume(str(path), saved, max_steps=-1, max_epochs=3)
    assert check_resume(str(path), saved, max_steps=-1, max_epochs=4) == str(path.resolve())
    assert check_resume(str(path), saved, max_steps=10**6, max_epochs=-1) == str(path.resolve())


def test_a_run_directory_holding_checkpoints_is_not_reused(jamba_run):
    """hydra.run.dir naming an earlier run (or two runs started together) replaced its checkpoints,
    metrics and records without a word; the new run now stops before writing anything."""
    run_dir = Path(jamba_run["run_dir"])
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    message = f"the run directory {run_dir} already holds another run's checkpoints (best.ckpt, last.ckpt)"
    with pytest.raises(ValueError, match=re.escape(message)):
        train_module.train(compose_train(TINY + MQAR_TINY + [f"run_dir={run_dir}"]))
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before


def test_a_diverged_run_says_so(tmp_path, caplog, monkeypatch):
    """A NaN loss ends nothing in Lightning: the run finished like any other, its checkpoints full of
    NaN (which every evaluation then refuses). It now ends with a warning naming the cause."""
    overrides = ["optim.lr=1e6", "optim.warmup_steps=0", "trainer.gradient_clip_val=null",
                 "trainer.max_steps=6", "trainer.val_check_interval=3"]  # fmt: skip
    # train.py's logger heard directly, as in test_last_checkpoint_holds_the_final_weights_and_best_the_best
    # (an in-process Hydra evaluation earlier in the session disables existing loggers).
    logger = logging.getLogger("mixerlab.train")
    monkeypatch.setattr(logger, "disabled", False)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(caplog.handler)
    try:
        result = run_train(tmp_path, overrides)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
    assert math.isnan(result["metrics"]["val/loss"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith("training diverged (val/loss is nan; last.ckpt holds NaN or inf weights)")
        for m in warnings
    ), warnings


def test_atomic_checkpoint_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        io.save_checkpoint({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    umask = os.umask(0o022)
    try:
        io.save_checkpoint({"step": 3}, path)
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644  # as open() would create it, not mkstemp's 0600


def cli(
    args: list[str], cwd: Path, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def sigterm_once(
    args: list[str],
    cwd: Path,
    ready: Path | list[Path],
    *,
    wait: float,
    settle: float = 0.0,
    to: str = "process",
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    """Run ``python args`` (a train.py command line), send it SIGTERM ``settle`` seconds after
    ``ready`` exists (every one of a list; waiting at most ``wait`` seconds: an AssertionError past
    that), to the process or, ``to="group"``, to its whole new process group (as ``timeout`` and
    schedulers do); returns ``(status, stdout, stderr)``."""
    paths = ready if isinstance(ready, list) else [ready]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=to == "group")  # fmt: skip
    deadline = time.monotonic() + wait
    while not all(p.exists() for p in paths) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not all(p.exists() for p in paths):
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{[str(p) for p in paths if not p.exists()]} did not appear within {wait} s")
    time.sleep(settle)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_recall_cli_reports_missing_and_corrupt_checkpoints(tmp_path):
    result = cli([str(REPO_ROOT / "eval" / "recall.py"), f"ckpt={tmp_path / 'nope.ckpt'}"], cwd=tmp_path)
    assert result.returncode == 2 and "checkpoint not found" in result.stderr
    assert "Traceback" not in result.stderr
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 definitely not a checkpoint")
    result = cli([str(REPO_ROOT / "eval" / "recall.py"), f"ckpt={corrupt}"], cwd=tmp_path)
    assert result.returncode == 2 and "truncated or corrupt" in result.stderr
    assert list(tmp_path.iterdir()) == [corrupt]  # an evaluation writes nothing but its results


def test_train_cli_rejects_unknown_mixer(tmp_path):
    result = cli([str(REPO_ROOT / "train.py"), "mixer=transformer"], cwd=tmp_path)
    options = ", ".join(sorted(p.stem for p in (REPO_ROOT / "conf" / "mixer").glob("*.yaml")))
    assert result.returncode == 2
    assert result.stderr == (
        "error: unknown mixer 'transformer' in mixer=transformer: conf/mixer has no transformer.yaml; "
        f"the mixer options are {options}\n"
    )
    assert "hybrid_jamba" in options and list(tmp_path.iterdir()) == []  # no outputs/ folder made


def test_train_help_lists_only_the_groups_train_py_takes(tmp_path):
    # Hydra's list named every folder of conf/, "eval: copying, decode, ..." too, which train.py refuses.
    result = cli([str(REPO_ROOT / "train.py"), "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = result.stdout.partition("(group=option)\n\n")[2].partition("\n\n")[0].splitlines()
    groups = ("data", "experiment", "logger", "mixer", "model", "trainer")
    options = {group: sorted(p.stem for p in (REPO_ROOT / "conf" / group).glob("*.yaml")) for group in groups}
    assert listed == [f"{group}: {', '.join(options[group])}" for group in groups]
    assert "\n== Config ==\n" in result.stdout and "\nseed: 0\n" in result.stdout  # as before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override,message",
    [
        ("+trainer.max_step=3",
         "unknown trainer keys 'max_step' (did you mean trainer.max_steps?): the trainer.* settings are "
         "Lightning Trainer's arguments, less callbacks, default_root_dir, logger, plugins, which train.py "
         "sets itself (logger=... chooses the loggers)"),
        ("+trainer.logger=false", "unknown trainer keys 'logger': the trainer.* settings are Lightning"),
        ("+optim.lrr=1", "unknown optim keys ['lrr']; valid keys: ['betas', 'lr', "),
        ("+data.foo=1", "unknown data keys ['foo'] for data=mqar; valid keys: ['batch_size', "),
        # Found by a new-user check: these came after the seeding, or not at all (+mixer.foo, a key
        # of a mixer the layout does not use), or as a traceback leaving the run's folder.
        ("mixer.settings.attention.pos_emb=ropee", "attention: unknown pos_emb 'ropee'; choose one of"),
        # A new-user check: the mixer's words named no override; now each setting it names is given one.
        ("model.d_model=63", "attention: num_heads=4 does not divide d_model=63; choose num_heads dividing "
         "d_model or pass head_dim explicitly (d_model is model.d_model, num_heads is model.num_heads, "
         "head_dim is +mixer.settings.attention.head_dim)"),
        ("mixer.settings.attention.num_kv_heads=3", "attention: num_kv_heads=3 must divide num_heads=4 (each "
         "KV head serves a whole group of query heads) (num_heads is model.num_heads, num_kv_heads is "
         "mixer.settings.attention.num_kv_heads)"),
        ("+mixer.foo=1", "unknown mixer keys ['foo']; valid keys: ['name', 'pattern', 'settings', "),
        ("+mixer.settings.mamba.foo=8", "mixer 'mamba' has no setting(s) ['foo']; its settings are ['bias'"),
        # A new-user check: a bad value of a mixer the layout does not use was taken without a word.
        ("+mixer.settings.mamba.d_state=0", "mamba: d_state must be > 0, got 0 (in the settings of mamba, "
         "which this model's layout does not use: correct or remove them)"),
        # Another new-user check: one whose required settings nothing gives (window) was not checked.
        ("+mixer.settings.sliding_window.pos_emb=bogus", "sliding_window: unknown pos_emb 'bogus'; choose one "
         "of ('rope', 'learned', 'none') (window not given for sliding_window: tried at each divisor of "
         "d_model=64, from window=1) (in the settings of sliding_window, which this model's layout does not "
         "use: correct or remove them)"),
        ("+mixer.settings.linear_attention.feature_map=bogus",  # num_heads taken from attention's
         "linear_attention: unknown feature_map 'bogus'; choose one of ('elu', 'relu', 'identity', "),
        ("mixer.settings=5", "mixer.settings must map mixer names to their settings, got 5"),
        # A new-user check: this one was named as the model config's key, model.mixer_settings.
        ("mixer.settings.attention=5", "mixer.settings.attention must map attention's settings to their "
         "values, got 5; write e.g. mixer.settings.attention.<setting>=<value>"),
        # A new-user check: these named the model config's field, not the override.
        ("mixer.shared_block=foo", "mixer.shared_block must be null or {every: <layers>, mixer: <name>}"),
        ("mixer=hybrid_zamba,mixer.shared_block.every=0", "mixer.shared_block.every must be an integer >= 1"),
        ("optim=5", "optim must be a group of settings, got optim=5; set one of them instead"),
        ("trainer.devices=0", "trainer settings: trainer.devices=0: `Trainer(devices=0)` value is not a valid "
         "input"),
        # A carried new-user note: Lightning's own words, naming `devices` but not the override.
        ("trainer.devices=abc", "trainer settings: trainer.devices=abc: `devices` selected with "
         "`CPUAccelerator` should be an int > 0."),
        ("trainer.strategy=bogus", "trainer settings: trainer.strategy=bogus: You selected an invalid strategy "),
        ("trainer.num_nodes=0", "trainer settings: trainer.num_nodes=0: `num_nodes` must be a positive "),
        # Was a ModuleNotFoundError traceback.
        ("trainer.accelerator=tpu", "trainer settings: trainer.accelerator=tpu: a package it needs is not "
         "installed: Requirement 'torch_xla"),
        ("trainer.strategy=deepspeed", "trainer settings: trainer.strategy=deepspeed: To use the "),
        # A new-user check: this was named as trainer.strategy=auto.
        ("trainer.precision=transformer-engine", "trainer settings: trainer.precision=transformer-engine: a "
         "package it needs is not installed: Requirement 'transformer_engine"),
        # A new-user check: ddp_spawn's processes kept the final validation and the records (train.json
        # was [], exit status 0).
        ("trainer.strategy=ddp_spawn", "trainer settings: trainer.strategy=ddp_spawn starts its processes by "
         "spawn, and what they compute (the final validation, the records) does not come back to train.py; "
         "use trainer=ddp"),
        # A new-user check: early_stopping=3 (true, val/acc) failed in check_early_stopping with an
        # AttributeError, [1] with OmegaConf's three lines, an unknown key after the seeding without
        # the valid ones, and patience:-1 was taken.
        ("early_stopping=3", "early_stopping=3: early_stopping must be null (or false: no early stopping) "
         "or a mapping of Lightning EarlyStopping's arguments, e.g. early_stopping={monitor:val/loss,"),
        ("early_stopping=true", "early_stopping=true: early_stopping must be null (or false: no early "),
        ("early_stopping=val/acc", "early_stopping=val/acc: early_stopping must be null (or false: no "),
        ("early_stopping=[1]", '"early_stopping=[1]": early_stopping must be null (or false: no early '),
        ("early_stopping={monitor:val/acc,foo:3}",
         "unknown early_stopping keys ['foo']; valid keys (the arguments of Lightning's EarlyStopping): "
         "['check_finite', 'check_on_train_epoch_end', "),
        ("early_stopping={monitor:val/acc,patience:-1}",
         "early_stopping.patience must be >= 0 (the validations without improvement before training "
         "stops), got -1"),
        # A new-user check: mixer.name=5 trained (its records broke eval/report.py), foo/bar nested the
        # run's folder, '' named it <time>--mqar.
        ("mixer.name=5", "mixer.name=5 is not a string (quote it to keep it as a name: \"mixer.name='5'\"): "
         "mixer.name must be a non-empty string usable as one folder name (it names the run's folder, "
         "<time>-<mixer.name>-<data.name>, and the mixer in the run's records), e.g. "
         "mixer.name=my_attention"),
        ("mixer.name=foo/bar", "mixer.name=foo/bar holds '/', which would nest the run's folder in another"),
        ("mixer.name=''", "mixer.name= is empty: mixer.name must be a non-empty string"),
        ("mixer.name=' a'", "\"mixer.name=' a'\" begins or ends with whitespace: mixer.name must be"),
        ("mixer.name=..", "mixer.name=.. is no folder name: mixer.name must be"),
        ("mixer.name=null", "mixer.name=null is not a string: mixer.name must be"),
        # A new-user check: "expected str, bytes or os.PathLike object, not int", naming no setting.
        ("resume=3", "resume=3: resume takes the path of a checkpoint written by train.py (e.g. "
         "resume=outputs/<run>/checkpoints/last.ckpt), or null for a new run (a file named like a number "
         "or true / false is quoted: \"resume='3'\")"),
        ("resume=true", "resume=true: resume takes the path of a checkpoint written by train.py "),
        ("resume=[a]", '"resume=[a]": resume takes the path of a checkpoint written by train.py (e.g. '
         "resume=outputs/<run>/checkpoints/last.ckpt), or null for a new run"),
    ],
)  # fmt: skip
def test_unknown_group_keys_are_refused_before_the_seeding(tmp_path, monkeypatch, override, message):
    # Found by a new-user check: these refusals came after Lightning's "Seed set to 0" line, or (data,
    # trainer) as the constructor's TypeError without the valid keys.
    def seeded(*args, **kwargs):
        raise AssertionError("seeded before the refusal")

    monkeypatch.setattr(train_module.L, "seed_everything", seeded)
    overrides = override.split(",") if override.startswith("mixer=hybrid_zamba,") else [override]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        train_module.train(compose_train([f"run_dir={tmp_path}", *overrides]))
    assert list(tmp_path.iterdir()) == []


def test_a_run_without_validation_says_so_without_lightnings_warning(tmp_path, monkeypatch, caplog):
    # Lightning's "ModelCheckpoint(monitor='val/acc') could not find the monitored key in the returned
    # metrics ... HINT: Did you call `log('val/acc', value)`" came right beside train.py's clearer line.
    monkeypatch.setattr(model_checkpoint, "warning_cache", WarningCache())  # not shown earlier in the session
    once_an_epoch = ["trainer.val_check_interval=1.0", "trainer.check_val_every_n_epoch=1"]
    with train_log_heard(monkeypatch, caplog), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        run_train(tmp_path / "cut", ["trainer.max_steps=2", *once_an_epoch])
    assert "no validation ran during this run (it stopped before the end of its first epoch" in caplog.text
    lightnings = [str(w.message) for w in shown if "could not find the monitored key" in str(w.message)]
    assert not lightnings, lightnings
    # best.ckpt is still written at the validation at the end of an epoch (20 batches).
    out = run_train(tmp_path / "epoch", ["trainer.max_steps=20", *once_an_epoch])
    assert Path(out["best_ckpt"]).name == "best.ckpt"
    assert read_checkpoint(out["best_ckpt"])["global_step"] == 20


def test_val_check_interval_counts_optimizer_steps_with_accumulated_batches(tmp_path, monkeypatch, caplog):
    # A new-user check: Lightning counts the interval in batches, so 5 with 2 batches a step validated
    # every 2.5 steps (4 times in 10 steps), where conf/trainer/cpu.yaml says optimizer steps.
    accumulate = ["+trainer.accumulate_grad_batches=2", "trainer.max_steps=10"]
    with train_log_heard(monkeypatch, caplog):
        out = run_train(tmp_path / "five", [*accumulate, "trainer.val_check_interval=5"])
    assert len(logged(out["run_dir"], "val/loss")) == 2 + 1  # steps 5 and 10, and the final validation
    # One learning-rate row a step (Lightning's monitor wrote one a batch, each step twice).
    lr_steps = [row["step"] for row in metrics_rows(out["run_dir"]) if row.get("lr-AdamW/pg1")]
    assert lr_steps == [str(step) for step in range(10)], lr_steps
    assert read_checkpoint(out["last_ckpt"])["global_step"] == 10 and "not validated" not in caplog.text
    caplog.clear()
    with train_log_heard(monkeypatch, caplog):
        run_train(tmp_path / "never", [*accumulate, "trainer.val_check_interval=11"])
    assert "its steps never reached a multiple of trainer.val_check_interval=11)" in caplog.text


def test_the_reason_no_validation_ran_follows_the_kind_of_interval():
    # A new-user check: a run stopped by max_steps inside its first epoch (val_check_interval=1.0,
    # once an epoch) was told its steps never reached a multiple of the interval.
    assert train_module.no_validation_reason(1.0) == (
        "it stopped before the end of its first epoch, where trainer.val_check_interval=1.0 validates"
    )
    assert train_module.no_validation_reason(0.5) == (
        "it stopped before 0.5 of its first epoch, where trainer.val_check_interval=0.5 validates"
    )
    assert (
        train_module.no_validation_reason(50)
        == "its steps never reached a multiple of trainer.val_check_interval=50"
    )


def test_a_hub_datasets_split_beside_a_local_corpus_is_refused(tmp_path):
    """A new-user check: data.split=test with data.path trained on the file's usual split, the setting
    ignored without a word."""
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "data=text",
        f"data.path={tmp_path / 'c.txt'}",
        "data.split=test",
    ]
    with pytest.raises(ValueError, match="^" + re.escape("data.split='test' is read from a hub dataset ")):
        train_module.train(compose_train(overrides))
    assert list(tmp_path.iterdir()) == []


def test_train_cli_reports_a_mistyped_setting_in_one_line(tmp_path):
    # A TypeError from a setting of the wrong type is a user error too: one line, exit status 2,
    # before any training.
    result = cli(
        [str(REPO_ROOT / "train.py"), "mixer=mamba", "mixer.settings.mamba.d_state=abc"], cwd=tmp_path
    )
    assert result.returncode == 2 and "error: mamba: d_state must be an int, got 'abc'" in result.stderr
    assert "Traceback" not in result.stderr and "Callback OutputDirCheck" not in result.stderr
    assert not list(
        tmp_path.glob("outputs/*")
    )  # the run directory Hydra made and its date folder are removed


@pytest.mark.parametrize(
    "override,message",
    [
        # A traceback (status 1), Hydra's folder left behind.
        ("early_stopping=3", "error: early_stopping=3: early_stopping must be null (or false: no early "),
        # Trained, in a nested folder.
        ("mixer.name=foo/bar", "error: mixer.name=foo/bar holds '/', which would nest the run's folder in "),
        # "error: expected str, bytes or os.PathLike object, not int", naming no setting.
        ("resume=3", "error: resume=3: resume takes the path of a checkpoint written by train.py (e.g. "),
        # Trained, checkpoints/ and results/ in that folder, .hydra/ and train.log in Hydra's.
        ("run_dir={tmp_path}/xx", "error: run_dir={tmp_path}/xx: run_dir is Hydra's run directory, "
         "{tmp_path}/work/outputs/"),
    ],
)  # fmt: skip
def test_train_cli_refuses_bad_settings_in_one_line_and_leaves_no_folder(tmp_path, override, message):
    """Found by a new-user check: these settings were refused late, unnamed, or not at all. Each is
    one line now, status 2, before training; the folder Hydra made goes, and no other is made."""
    (tmp_path / "work").mkdir()
    override, message = override.format(tmp_path=tmp_path), message.format(tmp_path=tmp_path)
    result = cli([str(REPO_ROOT / "train.py"), *TINY, *MQAR_TINY, override], cwd=tmp_path / "work")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and result.stderr.startswith(message), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["work"]  # no outputs/, nor any other folder


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_interval_longer_than_an_epoch_is_refused_in_one_line_and_leaves_no_folder(tmp_path, accumulate):
    """A new-user check: with trainer.check_val_every_n_epoch set, Lightning refuses an interval longer
    than an epoch only as fit starts, in its own terms (limit_val_batches to 0, which mixerlab refuses),
    and the loggers' first files (csv/hparams.yaml) kept the run's folder. Now one line naming the
    trainer.* settings, in steps of accumulate_grad_batches batches, status 2, the folder undone."""
    (tmp_path / "work").mkdir()
    # 640 examples in batches of 32: 20 batches an epoch
    overrides = ["trainer.val_check_interval=30", "trainer.check_val_every_n_epoch=1", "logger=csv",
                 f"+trainer.accumulate_grad_batches={accumulate}"]  # fmt: skip
    result = cli([str(REPO_ROOT / "train.py"), *TINY, *MQAR_TINY, *overrides], cwd=tmp_path / "work")
    assert result.returncode == 2, result.stderr[-3000:]
    steps = "20 training batches" if accumulate == 1 else "20 training batches, 10 steps of 2 batches"
    assert result.stderr.splitlines()[-1] == (
        f"error: trainer.val_check_interval=30 steps is longer than an epoch ({steps}) with "
        "trainer.check_val_every_n_epoch=1, which validates within each epoch; give "
        f"trainer.val_check_interval of at most {20 // accumulate}, or trainer.check_val_every_n_epoch=null "
        "to count the steps across epochs"
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["work"]  # no outputs/, nor any other folder


def test_train_cli_refuses_a_mismatched_resume_first_and_leaves_no_folder(jamba_run, tmp_path):
    # Found by a review: the refusal came after Lightning's "Seed set to 0", and a run started in a
    # folder without outputs/ left an empty outputs/ behind (Hydra makes the run directory's parents).
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), *settings, f"resume={jamba_run['last_ckpt']}"]
    result = cli([*args, "data.random_non_queries=false"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and result.stderr == (
        f"error: resume={jamba_run['last_ckpt']} was trained with data.random_non_queries=true, this run "
        "has false; resume with the checkpoint's settings (its run directory's .hydra/overrides.yaml lists them)\n"
    )
    assert list(tmp_path.iterdir()) == []


# A refused run's folders: (where it runs, the folders made before it, relative to tmp_path; the
# cwd is tmp_path / "work").
REFUSED_RUN_FOLDERS = {
    "premade run dir": (["hydra.run.dir=my_run"], ["work/my_run"]),
    "premade absolute nested run dir": (
        ["hydra.run.dir={tmp_path}/elsewhere/outer/run"],
        ["elsewhere/outer/run"],
    ),
    "new sweep": (["-m"], []),
    "premade sweep dir": (["-m", "hydra.sweep.dir=my_sweep"], ["work/my_sweep"]),
}


@pytest.mark.parametrize("case", REFUSED_RUN_FOLDERS)
def test_a_refused_run_removes_only_the_folders_it_made(jamba_run, tmp_path, case):
    """Found by a new-user check: a refused run deleted a run folder the user had made (it held only
    Hydra's files by then), and a refused -m job left multirun/<date>/<time>/multirun.yaml behind.
    A refused run now removes what it made, and nothing that was there before."""
    args, premade = REFUSED_RUN_FOLDERS[case]
    (tmp_path / "work").mkdir()
    for folder in premade:
        (tmp_path / folder).mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), *(a.format(tmp_path=tmp_path) for a in args), *settings]
    result = cli([*args, f"resume={jamba_run['last_ckpt']}", "data.seed=1"], cwd=tmp_path / "work")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.endswith(
        "was trained with data.seed=0, this run has 1; resume with the checkpoint's settings (its run "
        "directory's .hydra/overrides.yaml lists them)\n"
    )
    assert sorted(tmp_path.rglob("*")) == before


def test_train_cli_refuses_another_process_count_first(jamba_run, tmp_path):
    """The process-count refusal came after Lightning's first lines ("Seed set to 0", "GPU
    available: ...") and named the checkpoint by its absolute path where the user gave a relative
    one; it now comes first, like the other settings refusals, naming the checkpoint as typed."""
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    resume = os.path.relpath(jamba_run["last_ckpt"], tmp_path)
    args = [str(REPO_ROOT / "train.py"), *settings, f"resume={resume}"]
    result = cli([*args, "trainer.strategy=ddp", "trainer.devices=2"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and result.stderr == (
        f"error: resume={resume} was trained on 1 process(es), this run has 2: each optimizer step trains "
        "on data.batch_size examples per process, so the continued run would take other steps than the run "
        "it continues; resume with trainer.devices=1 trainer.num_nodes=1\n"
    )
    assert list(tmp_path.iterdir()) == []


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root`` (relative, as a string): a file's bytes, None for a folder."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def earlier_run(folder: Path) -> None:
    """Make ``folder`` as a finished ``python train.py`` run leaves it: Hydra's records of its settings
    in ``.hydra/``, its ``train.log``, a checkpoint."""
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text(f"# the earlier run's {name}\n- mixer=mamba\n")
    (folder / "train.log").write_text("[2026-12-01 10:00:00,000] mixerlab: mamba layout=[...]\n")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"the earlier run's weights")


@pytest.mark.parametrize("sweep", [False, True], ids=["run dir", "sweep dir"])
def test_a_refused_run_leaves_a_premade_folder_holding_files_as_it_was(jamba_run, tmp_path, sweep):
    """Found by a new-user review: a refused run in a folder the user had made and put files in
    (hydra.run.dir=mine, or -m hydra.sweep.dir=mine) kept Hydra's .hydra/ and train.log (a sweep's
    multirun.yaml), where the README said the folder was emptied of them. All the run wrote goes;
    all that was there stays, byte for byte."""
    folder = tmp_path / "mine"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    before = tree(tmp_path)
    where = ["-m", f"hydra.sweep.dir={folder}"] if sweep else [f"hydra.run.dir={folder}"]
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), *where, *settings, f"resume={jamba_run['last_ckpt']}", "data.seed=1"]
    result = cli(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.endswith("was trained with data.seed=0, this run has 1; resume with the checkpoint's "
                                  "settings (its run directory's .hydra/overrides.yaml lists them)\n")  # fmt: skip
    assert tree(tmp_path) == before


@pytest.mark.parametrize("sweep", [False, True], ids=["run dir", "sweep job"])
def test_a_refused_run_keeps_an_earlier_runs_records_byte_for_byte(tmp_path, sweep):
    """DATA LOSS found by a new-user review: a run pointed at an earlier run's folder
    (hydra.run.dir=<that run>, or -m hydra.sweep.dir=<that sweep>) and refused for it overwrote that
    run's .hydra/config.yaml, hydra.yaml and overrides.yaml (which the README tells users to read
    its settings from) and the sweep's multirun.yaml with its own. They are put back as they were."""
    if sweep:
        target = tmp_path / "old_sweep"
        earlier_run(target / "0-attention-mqar")
        (target / "notes").mkdir()
        (target / "multirun.yaml").write_text("# the earlier sweep's settings\n")
        where = ["-m", f"hydra.sweep.dir={target}", "mixer=attention,mamba"]
    else:
        target = tmp_path / "old_run"
        earlier_run(target)
        where = [f"hydra.run.dir={target}"]
    before = tree(tmp_path)
    result = cli([str(REPO_ROOT / "train.py"), *where, *TINY, *MQAR_TINY], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "already holds another run's checkpoints (last.ckpt)" in result.stderr
    # The folder to change is the sweep's in a sweep (a new-user check: it said hydra.run.dir there).
    folder = "hydra.sweep.dir (or a hydra.sweep.subdir that differs per job)"
    folder = folder if where[0] == "-m" else "hydra.run.dir"
    assert f"give a new {folder}, or resume=" in result.stderr
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("subdir", "task", "refused"),
    [
        ("${hydra.job.num}-${mixer.name}-${data.name}", ["optim.lr=1e-3,2e-3"], False),  # train.yaml's
        ("${hydra.job.num}", ["seed=1,2"], False),  # Hydra's default
        ("${hydra:job.num}", ["seed=1,2"], False),
        ("${seed}", ["seed=1,2"], False),
        ("${optim.lr}", ["experiment=zoology_mqar,induction_extrapolation"], False),  # a group may set it
        ("${mixer.name}", ["mixer=attention,mamba"], False),
        ("${tag}", ["+tag=a,b"], False),
        ("${optim.lr}", ["optim.lr=1e-3,2e-3"], False),
        ("${oc.env:X}", ["seed=1,2"], False),  # a resolver: not known here
        ("fixed", ["seed=1"], False),  # one job
        ("fixed", ["seed=1,2"], True),
        ("${seed}", ["optim.lr=1e-3,2e-3"], True),
        ("a/${data.name}", ["optim.lr=1e-3,2e-3"], True),
        # A group sweep changes its own settings only (a new-user check: job 1 of mixer=attention,mamba
        # wrote its .hydra/ over job 0's in the folder ${seed} gave both).
        ("${seed}", ["mixer=attention,mamba"], True),
        ("${mixer.name}", ["mixer=attention,mamba", "optim.lr=1e-3,2e-3"], True),
    ],
)
def test_a_sweep_subdir_varies_over_the_jobs(subdir, task, refused):
    """check_subdir_varies, unit by unit: a review found train.yaml's own subdir refused at first
    (${hydra.job.num} read as a setting no sweep changes)."""
    config = OmegaConf.create({"hydra": {"overrides": {"task": task}}})
    if refused:
        with pytest.raises(ValueError, match=re.escape(f"hydra.sweep.subdir={subdir} gives jobs of this")):
            check_subdir_varies(config, subdir, None)
    else:
        check_subdir_varies(config, subdir, None)


def test_a_sweep_subdir_the_same_for_every_job_is_refused_before_the_first(tmp_path):
    """A new-user check: with hydra.sweep.subdir=fixed (or ${seed}, no seed sweep) the second job was
    refused for the first one's checkpoints, after Hydra had written its .hydra/ over the first job's
    (optim.lr=0.002 recorded beside checkpoints trained at 0.001)."""
    args = [str(REPO_ROOT / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", *TINY, *MQAR_TINY]
    for subdir, shown in (("fixed", "fixed"), ("${seed}", "${seed} (= 0)")):
        result = cli([*args, f"hydra.sweep.subdir={subdir}", "optim.lr=1e-3,2e-3"], cwd=tmp_path)
        assert result.returncode == 2 and result.stderr == (
            f"error: hydra.sweep.subdir={shown} gives jobs of this sweep the same folder, where each would "
            "train over the one before it; put a job value in it, e.g. "
            f"'hydra.sweep.subdir={subdir}-${{hydra.job.num}}' (without hydra.sweep.subdir: the default, a "
            "folder per job)\n"
        )
        assert list(tmp_path.iterdir()) == []


# A -m sweep's hydra.sweep.subdir that does not lead to a folder of its own inside hydra.sweep.dir
# (which is tmp_path / "work" / "sweep"; the cwd is tmp_path / "work"): (the value, the message's reason).
SUBDIRS_OUTSIDE_THE_SWEEP = {
    "itself": (".", "leads to hydra.sweep.dir={sweep} itself, not to a folder inside it"),
    "parent": ("..", "leads outside hydra.sweep.dir={sweep}"),
    "absolute": ("{tmp_path}/elsewhere/${{hydra.job.num}}", "leads outside hydra.sweep.dir={sweep}"),
    "symlink": (
        "link/${{hydra.job.num}}",
        "leads outside hydra.sweep.dir={sweep}: {sweep}/link is a symbolic link to {tmp_path}/elsewhere",
    ),
    # Interpolations no job value enters are resolved before the sweep (a new user's finding: they
    # wrote over an earlier run's records, or trained outside the sweep folder).
    "environment": ("${{oc.env:SUBX}}", "(= {tmp_path}/elsewhere) leads outside hydra.sweep.dir={sweep}"),
    "working dir": (
        "${{hydra:runtime.cwd}}/zz",
        "(= {tmp_path}/work/zz) leads outside hydra.sweep.dir={sweep}",
    ),
}


@pytest.mark.parametrize("case", SUBDIRS_OUTSIDE_THE_SWEEP)
def test_a_sweep_subdir_outside_the_sweep_dir_is_refused_before_hydra_writes(tmp_path, case, monkeypatch):
    """Found by a review: with hydra.sweep.subdir=. or .. a refused sweep's Hydra records went over an
    earlier run's (.hydra/ of the sweep folder or of the working directory) and were not put back:
    the clean-up's record covers the folders inside the sweep folder only. An absolute subdir or one
    through a symbolic link wrote into folders elsewhere, which it left behind. Such a subdir is
    refused before Hydra makes or writes anything."""
    subdir, reason = SUBDIRS_OUTSIDE_THE_SWEEP[case]
    monkeypatch.setenv("SUBX", str(tmp_path / "elsewhere"))
    work, sweep = tmp_path / "work", tmp_path / "work" / "sweep"
    earlier_run(work)
    earlier_run(sweep)
    (tmp_path / "elsewhere").mkdir()
    (sweep / "link").symlink_to(tmp_path / "elsewhere")
    before = tree(tmp_path)
    subdir = subdir.format(tmp_path=tmp_path)
    args = [str(REPO_ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep}", f"hydra.sweep.subdir={subdir}"]
    # A job that would train and write (the run's -m check refuses a bad value before the subdir's).
    result = cli([*args, *TINY, *MQAR_TINY, "trainer.max_steps=1"], cwd=work)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and result.stderr == (
        f"error: hydra.sweep.subdir={subdir} {reason.format(sweep=sweep, tmp_path=tmp_path)}; use a relative "
        "path inside it (without hydra.sweep.subdir: the default, a folder per job)\n"
    )
    assert tree(tmp_path) == before


def test_a_sweep_subdir_reading_a_key_no_override_sets_is_refused_in_one_line(tmp_path):
    """A new-user check: ``-m 'hydra.sweep.subdir=${nope}'`` printed Hydra's "An error occurred during
    Hydra's exception formatting: AssertionError()" before the one-line error, from the job. A key that
    no override sets is missing in every job: refused before the sweep, in one line; one that the
    sweep's overrides set per job (``+tag=a,b``) is left to the jobs."""
    sweep = tmp_path / "sweep"
    args = [str(REPO_ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep}", *TINY, *MQAR_TINY]
    args.append("trainer.max_steps=1")
    result = cli([*args, "hydra.sweep.subdir=${nope}"], cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "error: hydra.sweep.subdir: Interpolation key 'nope' not found: name a setting that exists (and not "
        "a literal '${': a folder whose path holds one cannot be Hydra's)\n"
    )
    assert list(tmp_path.iterdir()) == []
    # An environment variable that is not set: the same (another new-user check).
    result = cli([*args, "hydra.sweep.subdir=${oc.env:MIXERLAB_NOT_SET}"], cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == (
        'error: hydra.sweep.subdir: KeyError raised while resolving interpolation: "Environment variable '
        "'MIXERLAB_NOT_SET' not found\"; set it, or give the interpolation a default: "
        "${oc.env:NAME,default}\n"
    )
    assert list(tmp_path.iterdir()) == []
    result = cli([*args, "hydra.sweep.subdir=${tag}", "+tag=a"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (sweep / "a" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize(
    ("devices", "record", "message"),
    [
        ("auto", {"world_size": 2, "num_nodes": 1}, " was trained on 2 process(es), this run has 1: "),
        ("'1'", {"world_size": 2, "num_nodes": 1}, " was trained on 2 process(es), this run has 1: "),
        ("auto", {"world_size": 0, "num_nodes": 1}, ": the checkpoint is corrupt (its WorldSizeRecord"),
    ],
    ids=["auto", "string", "corrupt record"],
)
def test_train_cli_refuses_another_process_count_first_for_any_devices(
    jamba_run, tmp_path, devices, record, message
):
    """Found by a new-user review: with trainer.devices=auto or a string ("1"), which Lightning
    resolves, the process-count refusal (and the corrupt-record one) came after Lightning's "Seed set
    to 0" and device lines; it now comes first, as for a count the config states."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    checkpoint["callbacks"]["WorldSizeRecord"] = record
    torch.save(checkpoint, tmp_path / "last.ckpt")
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), *settings, "resume=last.ckpt", f"trainer.devices={devices}"]
    result = cli(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and result.stderr.startswith(f"error: resume=last.ckpt{message}")
    assert result.stderr.count("\n") == 1, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("resume", [False, True])
def test_trainer_settings_lightning_refuses_are_one_line_and_leave_no_folder(jamba_run, tmp_path, resume):
    """Found by a new-user check: trainer.devices=0, which Lightning refuses
    (MisconfigurationException), printed a traceback with status 1 and left Hydra's folder; it is a
    settings error like the others now."""
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + MQAR_TINY + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), *settings, "trainer.devices=0"]
    if resume:
        shutil.copy(jamba_run["last_ckpt"], tmp_path / "last.ckpt")
        args.append("resume=last.ckpt")
    result = cli(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    # Every run resolves the devices before the seeding (a new run too since the twenty-sixth session:
    # it came after Lightning's "Seed set to 0" line): the refusal is the only line.
    lines = result.stderr.splitlines()
    assert lines[:-1] == [], result.stderr
    assert lines[-1].startswith("error: trainer settings: ") and "devices=0" in lines[-1]
    assert [p.name for p in tmp_path.iterdir()] == (["last.ckpt"] if resume else [])


def test_a_refused_joblib_sweep_leaves_no_folder(jamba_run, tmp_path):
    """Found by a new-user review: a refused job of a joblib sweep sometimes left a job's folder.
    A refused job ends the sweep, and joblib kills the jobs still running, some after Hydra made
    their folders but before their own checks (here the second job, slower to build its larger
    training set): the process that ran Hydra now removes what they made."""
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + JAMBA_RESUME
    args = [str(REPO_ROOT / "train.py"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *settings]
    args += ["data.num_test_examples=64", "data.num_train_examples=640,100000", "data.seed=1"]
    result = cli([*args, f"resume={jamba_run['last_ckpt']}"], cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: resume=" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_joblib_job_stopped_before_its_first_step_leaves_no_folder(tmp_path):
    """Found by a new-user check of the graceful stop (training.sweep_stop): a job stopped by the
    sweep before its first step (here when the other job is refused: its folder holds another run's
    checkpoint) undid nothing, since only its own worker process knew it trained nothing; the
    sweep's process undoes its folder now, and multirun.yaml with it."""
    sweep = tmp_path / "sweep"
    taken = sweep / "1-attention-mqar" / "checkpoints" / "last.ckpt"
    taken.parent.mkdir(parents=True)
    taken.write_bytes(b"another run's")
    settings = [a for a in TINY if not a.startswith("trainer.max_steps=")] + ["trainer.max_steps=100000"]
    args = [str(REPO_ROOT / "train.py"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *settings]
    # The first job builds a larger training set: the second is refused before it trains a step.
    args += ["data.num_test_examples=64", "data.num_train_examples=100000,640", f"hydra.sweep.dir={sweep}"]
    result = cli(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "already holds another run's checkpoints (last.ckpt)" in result.stderr
    # Job 0 is stopped in its setup, or (its worker slower to start than job 1's refusal, 2 runs in 14
    # on 2 cores) before it starts: either way it trains nothing and its folder is undone.
    stopped = ("training interrupted before its first step: nothing saved",
               "not started: the sweep was stopped")  # fmt: skip
    assert any(line in result.stdout + result.stderr for line in stopped), result.stderr[-3000:]
    assert sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*")) == [
        "1-attention-mqar", "1-attention-mqar/checkpoints", "1-attention-mqar/checkpoints/last.ckpt"
    ]  # fmt: skip


def test_train_cli_reports_an_uncreatable_run_dir_in_one_line(tmp_path):
    # Found by a fresh-clone check: Hydra failed to create it in a chained traceback.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for option in ("hydra.run.dir", "hydra.sweep.dir"):
        args = [str(REPO_ROOT / "train.py"), f"{option}={blocker / 'run'}"] + (
            ["-m"] if "sweep" in option else []
        )
        result = cli(args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert (
            f"error: {option}={blocker / 'run'} cannot be created: {blocker} is a file, not a folder"
            in result.stderr
        )
        assert "Traceback" not in result.stderr
        # Hydra warns about every hook a callback lacks unless it subclasses Hydra's Callback.
        assert "Callback OutputDirCheck" not in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("script", ["train.py", "eval/recall.py"])
def test_an_unresolvable_run_dir_is_one_line(tmp_path, script):
    """A new-user check: hydra.run.dir=/tmp/a${x} gave Hydra's warning about the callback's error
    (five lines) and then the error again (four lines); an evaluation, a line about Hydra's own
    exception formatting before it."""
    extra = ["ckpt=x.ckpt"] if script.startswith("eval") else []
    for option, value in (("hydra.run.dir", "a${x}"), ("hydra.sweep.dir", "b${oc.env:MIXERLAB_NOT_SET}")):
        args = [str(REPO_ROOT / script), *extra, f"{option}={tmp_path / value}"]
        result = cli(args + (["-m"] if "sweep" in option else []), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {option}: "), result.stderr
    # Not "pass it escaped", which is refused in turn (a new-user check went round in that loop).
    result = cli([str(REPO_ROOT / script), *extra, f"hydra.run.dir={tmp_path / 'a${x}'}"], cwd=tmp_path)
    literal = "a folder whose path holds one cannot be Hydra's"
    named = f"Interpolation key 'x' not found: name a setting that exists (and not a literal '${{': {literal}"
    assert named in result.stderr
    assert list(tmp_path.iterdir()) == []


# Folders Hydra cannot make or write its records into (tmp_path holds a file "mine", and "gone" is
# missing): (the option, its value, the folder setup, the message after "error: <option>=<value>: ").
UNUSABLE_RUN_DIRS = {
    "dangling run dir": (
        "hydra.run.dir", "run", lambda t: (t / "run").symlink_to(t / "gone"),
        "{t}/run is a symbolic link to {t}/gone, which does not exist; make that folder or remove the link, "
        "or pass hydra.run.dir=<another folder>",
    ),
    "dangling parent": (
        "hydra.run.dir", "link/run", lambda t: (t / "link").symlink_to(t / "gone"),
        "{t}/link is a symbolic link to {t}/gone, which does not exist; make that folder or remove the link, "
        "or pass hydra.run.dir=<another folder>",
    ),
    "looping run dir": (
        "hydra.run.dir", "run", lambda t: (t / "run").symlink_to(t / "run"),
        "{t}/run is a symbolic link to {t}/run, and following it runs into a loop of symbolic links (never a "
        "folder); remove the loop, or pass hydra.run.dir=<another folder>",
    ),
    "looping parent": (
        "hydra.run.dir", "a/run", lambda t: ((t / "a").symlink_to(t / "b"), (t / "b").symlink_to(t / "c"),
                                            (t / "c").symlink_to(t / "b")),
        "{t}/a is a symbolic link to {t}/b, and following it runs into a loop of symbolic links (never a "
        "folder); remove the loop, or pass hydra.run.dir=<another folder>",
    ),
    "dangling sweep dir": (
        "hydra.sweep.dir", "sweep", lambda t: (t / "sweep").symlink_to(t / "gone"),
        "{t}/sweep is a symbolic link to {t}/gone, which does not exist; make that folder or remove the "
        "link, or pass hydra.sweep.dir=<another folder>",
    ),
    ".hydra file": (
        "hydra.run.dir", "run", lambda t: ((t / "run").mkdir(), (t / "run" / ".hydra").write_text("mine\n")),
        "{t}/run/.hydra is a file, not a folder; Hydra writes the run's settings into a folder of that name "
        "(hydra.output_subdir): move the file away or pass hydra.run.dir=<another folder>",
    ),
    "${ in the path": (
        "hydra.run.dir", "d\\${x}/run", lambda t: None,
        "the path holds '${{', which Hydra reads as an interpolation where it names the run's log file "
        "(hydra.job_logging); use a folder whose path has no '${{'",
    ),
    "${ in the sweep dir": (
        "hydra.sweep.dir", "s\\${x}", lambda t: None,
        "the path holds '${{', which Hydra reads as an interpolation where it names the run's log file "
        "(hydra.job_logging); use a folder whose path has no '${{'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", UNUSABLE_RUN_DIRS)
def test_a_dangling_link_or_a_hydra_file_in_the_run_dir_is_one_line(tmp_path, case):
    """Found by a review: a run directory that is a symbolic link to a missing folder (or lies below
    one), or that holds a file named .hydra, failed in Hydra's traceback (FileExistsError) and left
    Hydra's train.log (a sweep's multirun.yaml) behind; a path through a folder named ${x} failed in
    InterpolationKeyError (a new user's finding); a link that loops was called a link to a missing
    folder. It is one line saying what is in the way and how to
    fix it, before Hydra makes or writes anything; the user's link and file stay as they were."""
    option, value, make, message = UNUSABLE_RUN_DIRS[case]
    (tmp_path / "mine").write_text("my file\n")
    make(tmp_path)

    def entries() -> list[tuple[str, str | bytes | None]]:  # a link's target, a file's bytes
        return [
            (str(p), os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(tmp_path.rglob("*"))
        ]

    before = entries()
    args = [str(REPO_ROOT / "train.py"), *(["-m"] if "sweep" in option else []), f"{option}={value}"]
    result = cli([*args, *TINY, *MQAR_TINY], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    given = pasteable(f"{option}={value}")
    assert result.stdout == "" and result.stderr == f"error: {given}: {message.format(t=tmp_path)}\n"
    assert entries() == before


def make_run_dir(path: Path, log: str = "", extra: str | None = None) -> FoldersBefore:
    """Make ``path`` as Hydra makes a run directory (``.hydra/``, ``train.log`` holding ``log``), plus
    a folder ``extra``; return the record of what existed of it before (what train.py's Hydra
    callback notes)."""
    before = FoldersBefore.of(path)
    (path / ".hydra").mkdir(parents=True, exist_ok=True)
    (path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (path / "train.log").write_text(log)
    if extra:
        (path / extra).mkdir()
    return before


def test_remove_unused_run_dir_keeps_anything_with_content(tmp_path):
    fresh = tmp_path / "fresh"
    assert remove_unused_run_dir(fresh, make_run_dir(fresh)) and not fresh.exists()
    kept = {tmp_path / "logged": "[INFO] model: ...\n", tmp_path / "trained": ""}
    befores = {run: make_run_dir(run, log, extra=None if log else "checkpoints") for run, log in kept.items()}
    assert not any(remove_unused_run_dir(run, before) for run, before in befores.items())
    assert all((run / ".hydra" / "config.yaml").exists() for run in kept)
    missing = tmp_path / "missing"
    assert not remove_unused_run_dir(missing, FoldersBefore.of(missing))
    # Without the record (what existed before is unknown) nothing is removed.
    unknown = tmp_path / "unknown"
    make_run_dir(unknown)
    assert not remove_unused_run_dir(unknown, None)
    assert sorted(p.name for p in unknown.iterdir()) == [".hydra", "train.log"]


def test_remove_unused_run_dir_removes_the_folders_made_for_the_run(tmp_path, monkeypatch):
    """A refused run started in a folder without outputs/ left an empty outputs/ (Hydra makes the
    missing parents of the run directory). The empty folders the run made go with it; folders
    that were there before it stay, empty or not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    (tmp_path / "full" / "old-run").mkdir(parents=True)
    for name in ("outputs/2026-12-02/10-00-00", "runs/a/b", "kept/run", "full/run"):
        assert remove_unused_run_dir(Path(name), make_run_dir(Path(name)))
    assert sorted(os.listdir()) == ["full", "kept"]
    assert os.listdir("kept") == [] and os.listdir("full") == ["old-run"]
    # A folder that holds another run stays.
    make_run_dir(Path("outputs/2026-12-02/10-00-01"))
    run = Path("outputs/2026-12-02/10-00-02")
    assert remove_unused_run_dir(run, make_run_dir(run))
    assert os.listdir("outputs/2026-12-02") == ["10-00-01"]


def test_remove_unused_run_dir_keeps_the_folders_that_existed_before(tmp_path, monkeypatch):
    """A refused run deleted a run folder the user had made (hydra.run.dir=my_run, a nested or
    absolute path): it held only Hydra's files by then. Only what the run made goes: Hydra's files
    in a folder that existed, the folder itself and its new parents when the run made them."""
    monkeypatch.chdir(tmp_path)
    for folder in ("my_run", "outer/inner/run", "outputs/2026-12-02"):
        Path(folder).mkdir(parents=True)
    for run in (Path("my_run"), tmp_path / "outer" / "inner" / "run"):
        assert not remove_unused_run_dir(run, make_run_dir(run))
    run = Path("outputs/2026-12-02/10-00-00")
    assert remove_unused_run_dir(run, make_run_dir(run))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "my_run", "outer", "outer/inner", "outer/inner/run", "outputs", "outputs/2026-12-02",
    ]  # fmt: skip
    # The working directory itself (hydra.run.dir=.) stays.
    monkeypatch.chdir(tmp_path / "my_run")
    assert not remove_unused_run_dir(Path("."), make_run_dir(Path(".")))
    assert os.listdir() == [] and Path.cwd() == tmp_path / "my_run"
    # So do Hydra's files that were there before (an earlier run's .hydra/ and empty train.log).
    make_run_dir(Path("."))
    assert not remove_unused_run_dir(Path("."), make_run_dir(Path(".")))
    assert sorted(os.listdir()) == [".hydra", "train.log"]


def sweep_job(sweep: Path, job: str = "0-attention-mqar") -> FoldersBefore:
    """Make a -m job's folders as Hydra does: ``sweep`` holding ``multirun.yaml`` and the job's run
    directory; return the record of what existed of ``sweep`` before (Hydra's multirun start)."""
    before = FoldersBefore.of(sweep)
    make_run_dir(sweep / job)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return before


def test_remove_unused_run_dir_removes_a_refused_sweeps_folders(tmp_path, monkeypatch):
    """A refused -m job left multirun/<date>/<time>/multirun.yaml behind."""
    monkeypatch.chdir(tmp_path)
    sweep = Path("multirun/2026-12-02/10-00-00")
    before = sweep_job(sweep)
    assert remove_unused_run_dir(sweep / "0-attention-mqar", before, sweep)
    assert os.listdir() == []
    # A sweep folder the user made stays (empty); one holding another job's run keeps its multirun.yaml.
    Path("my_sweep").mkdir()
    before = sweep_job(Path("my_sweep"))
    assert remove_unused_run_dir(Path("my_sweep/0-attention-mqar"), before, Path("my_sweep"))
    assert os.listdir() == ["my_sweep"] and os.listdir("my_sweep") == []
    before = sweep_job(sweep)
    make_run_dir(sweep / "1-mamba-mqar", extra="checkpoints")
    assert remove_unused_run_dir(sweep / "0-attention-mqar", before, sweep)
    assert sorted(os.listdir(sweep)) == ["1-mamba-mqar", "multirun.yaml"]


def test_hydra_files_shared_by_links_or_with_their_own_modes_are_put_back(tmp_path):
    """Found by a new-user check: a refused run pointed at a folder whose .hydra files are hard links
    (a `cp -al` backup) or symbolic links left the files they share holding the refused run's
    config (the atomic rewrite replaced the link, Hydra had written through it), and a 0600 file came
    back 0644. The old bytes now go back into the shared file, and a replaced file keeps its mode."""
    run, backup, elsewhere = tmp_path / "run", tmp_path / "backup", tmp_path / "elsewhere"
    (run / ".hydra").mkdir(parents=True)
    backup.mkdir()
    elsewhere.mkdir()
    (run / ".hydra" / "config.yaml").write_text("config: old\n")
    os.link(run / ".hydra" / "config.yaml", backup / "config.yaml")
    (elsewhere / "overrides.yaml").write_text("- old=1\n")
    (run / ".hydra" / "overrides.yaml").symlink_to(elsewhere / "overrides.yaml")
    (run / ".hydra" / "hydra.yaml").write_text("hydra: old\n")
    os.chmod(run / ".hydra" / "hydra.yaml", 0o600)
    was = FolderBefore.of(run)
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):  # as Hydra writes: through the links
        with open(run / ".hydra" / name, "w") as f:
            f.write("refused: run\n")
    _restore_hydra_files(run, was, HYDRA_RUN_FILES)
    assert (backup / "config.yaml").read_text() == "config: old\n"
    assert os.stat(backup / "config.yaml").st_ino == os.stat(run / ".hydra" / "config.yaml").st_ino
    assert (run / ".hydra" / "overrides.yaml").is_symlink()
    assert (elsewhere / "overrides.yaml").read_text() == "- old=1\n"
    assert (run / ".hydra" / "hydra.yaml").read_text() == "hydra: old\n"
    assert os.stat(run / ".hydra" / "hydra.yaml").st_mode & 0o777 == 0o600


def test_a_refused_sweep_leaves_another_sweeps_jobs_in_the_same_folder(tmp_path, monkeypatch):
    """Found by a new-user check: two sweeps sharing hydra.sweep.dir (other subdirs), one refused
    while the other's job was still preparing its data, removed that job's .hydra/ and train.log
    (it held only Hydra's files then). The jobs that ran in this process (the basic launcher) are
    known, and only their folders are undone; the sweep's multirun.yaml stays, the folder in use."""
    monkeypatch.chdir(tmp_path)
    sweep = Path("shared_sweep")
    before = FoldersBefore.of(sweep, job_depth=1)
    make_run_dir(sweep / "a0")  # the other sweep's job, made after this sweep's record
    make_run_dir(sweep / "b0")  # this sweep's refused job
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    others = tree(sweep / "a0")
    remove_unused_folders(before, jobs=[(sweep / "b0").resolve()])
    assert sorted(os.listdir(sweep)) == ["a0", "multirun.yaml"] and tree(sweep / "a0") == others


def test_remove_unused_folders_undoes_the_jobs_a_joblib_sweep_killed(tmp_path, monkeypatch):
    """A refused job of a joblib sweep ends the sweep, and joblib kills the jobs still running: one
    killed after Hydra made its folder (or half wrote its .hydra/) never reached its own clean-up.
    The process that ran Hydra undoes every job's folder that holds only Hydra's files, then the
    sweep's; a job that trained keeps its folder, and the sweep its multirun.yaml."""
    monkeypatch.chdir(tmp_path)
    sweep = Path("multirun/2026-12-02/10-00-00")
    before = FoldersBefore.of(sweep, job_depth=1)
    (sweep / "0-attention-mqar" / ".hydra").mkdir(parents=True)  # killed while Hydra wrote its config
    (sweep / "0-attention-mqar" / ".hydra" / "config.yaml").write_text("seed: ")
    (sweep / "1-mamba-mqar").mkdir()  # killed right after Hydra made it
    make_run_dir(sweep / "2-hybrid_jamba-mqar")  # refused
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    remove_unused_folders(before)
    assert os.listdir() == []
    # Into an earlier sweep's folder: its job's records and multirun.yaml are put back as they were.
    old = Path("old_sweep")
    earlier_run(old / "0-attention-mqar")
    (old / "multirun.yaml").write_text("# the earlier sweep\n")
    was = tree(old)
    before = FoldersBefore.of(old, job_depth=1)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (old / "0-attention-mqar" / ".hydra" / name).write_text("# the refused job's\n")
    (old / "multirun.yaml").write_text("# this sweep\n")
    make_run_dir(old / "1-mamba-mqar")
    remove_unused_folders(before)
    assert tree(old) == was
    # A job that trained keeps its folder, and the sweep its multirun.yaml.
    before = FoldersBefore.of(sweep, job_depth=1)
    make_run_dir(sweep / "0-attention-mqar", log="[...] mixerlab: attention\n")
    make_run_dir(sweep / "1-mamba-mqar")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    remove_unused_folders(before)
    assert sorted(os.listdir(sweep)) == ["0-attention-mqar", "multirun.yaml"]
    assert (sweep / "0-attention-mqar" / "train.log").read_text() == "[...] mixerlab: attention\n"


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_stops_training_gracefully_and_keeps_its_results(tmp_path, to):
    # kill / timeout / a scheduler send SIGTERM: the run saves last.ckpt, evaluates its best
    # checkpoint, writes records marked interrupted and exits with status 1, no traceback. "group":
    # to the whole process group, as timeout and schedulers do, with two loader workers, which then
    # get it too (a worker killed by it made the main process fail with a traceback).
    run_dir = tmp_path / "run"
    tiny = [a for a in TINY if not a.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    args = [str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", "trainer.max_steps=100000"]
    args += ["trainer.val_check_interval=5", *tiny, *MQAR_TINY]
    args += ["data.num_workers=2"] if to == "group" else []
    status, out, err = sigterm_once(args, tmp_path, run_dir / "checkpoints" / "best.ckpt", wait=300, to=to)
    assert status == 1, err[-3000:]
    assert "training interrupted at step" in out and "Traceback" not in err
    # The run's own lines, timestamped, in the run directory's train.log (Hydra's job log).
    train_log = (run_dir / "train.log").read_text()
    for line in ("mixerlab: ", "training interrupted at step", "best checkpoint: ", "final validation: "):
        assert line in train_log, (line, train_log[-2000:])
    records = json.loads((run_dir / "results" / "train.json").read_text())
    assert records and all(r["interrupted"] is True and r["task"] == "mqar" for r in records)
    assert 0 < records[0]["train_tokens"] < 100000 * 32 * 64
    assert load_model(run_dir / "checkpoints" / "last.ckpt").model.config.d_model == 32
    # Tokens of the steps taken, not one batch more (the interrupted step was counted).
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["state_dict"]["tokens_seen"].item() == last["global_step"] * 32 * 64


def test_sigterm_before_training_ends_the_run_as_ctrl_c_does(tmp_path):
    """Found by a new-user check: a SIGTERM while the run prepared its data killed the process with
    no message and left Hydra's folder (in a user's folder, Hydra's files over theirs); it now ends
    the run as Ctrl+C does: one line, status 130, the folder undone."""
    run_dir = tmp_path / "run"
    tiny = [a for a in TINY if not a.startswith("trainer.max_steps=")]
    args = [str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", "trainer.max_steps=4", *tiny, *MQAR_TINY]
    args += ["data.num_train_examples=400000"]  # seconds of data preparation to signal it in
    status, _, err = sigterm_once(args, tmp_path, run_dir / ".hydra" / "overrides.yaml", wait=120, settle=0.5)
    assert status == 130, err[-3000:]
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("resumed", [False, True])
def test_an_interrupt_before_the_first_step_saves_nothing(tmp_path, monkeypatch, caplog, resumed):
    # A Ctrl+C while training starts (before any optimizer step) saved the initial weights, validated
    # them and wrote records of an untrained model, which the report then showed. Resumed: a Ctrl+C
    # in the first step of the resumed run saved a copy of the checkpoint and its records.
    settings = []
    if resumed:
        short = ["model.n_layers=2", "trainer.max_steps=2", "trainer.val_check_interval=2"]
        part = run_train(tmp_path / "part", short)
        settings = ["model.n_layers=2", f"resume={part['last_ckpt']}"]

    def interrupt(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(LitLM, "training_step" if resumed else "on_train_start", interrupt)
    # As in test_a_diverged_run_says_so: an in-process Hydra evaluation earlier in the session
    # disables existing loggers.
    logger = logging.getLogger("mixerlab.train")
    monkeypatch.setattr(logger, "disabled", False)
    caplog.set_level(logging.INFO, logger="mixerlab.train")
    logger.addHandler(caplog.handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_train(tmp_path / "run", settings)
    finally:
        logger.removeHandler(caplog.handler)
    assert "training interrupted before its first step: nothing saved" in caplog.text
    run = tmp_path / "run"
    assert not list(run.rglob("*.ckpt")) and not list(run.rglob("train.json"))


@pytest.mark.parametrize("folder", ["new", "premade"])
def test_an_interrupt_before_the_first_step_undoes_the_run_folder(tmp_path, folder):
    """Found by a new-user check: Ctrl+C or SIGTERM after training started, before its first optimizer
    step, said "nothing saved" and "interrupted: nothing written" (status 130) but left the run
    folder with .hydra/, a train.log of two lines (which counted as a run that had trained) and the
    loggers' records. It is undone as after an interrupt while the data is prepared; in a folder
    that was there, Hydra's files go back as they were, its train.log to the lines it held."""
    run_dir = tmp_path / "run"
    if folder == "premade":
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("my notes\n")
        (run_dir / "train.log").write_text("[2026-12-01 10:00:00,000] an earlier line\n")
    before = tree(tmp_path)
    settings = [*TINY, *MQAR_TINY, f"hydra.run.dir={run_dir}"]  # logger=csv: its csv/hparams.yaml goes too
    program = (
        "import runpy, sys\n"
        "from models.lit import LitLM\n"
        "def interrupt(self):\n"
        "    raise KeyboardInterrupt\n"
        "LitLM.on_train_start = interrupt\n"
        f"sys.argv = ['train.py', *{settings!r}]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    result = cli(["-c", program], cwd=REPO_ROOT)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.endswith("interrupted: nothing written\n")
    assert "training interrupted before its first step: nothing saved" in result.stdout
    assert tree(tmp_path) == before


def test_early_stopping_says_when_it_ends_a_run(tmp_path, monkeypatch, caplog):
    # A new-user check: a run that early stopping ended before trainer.max_steps finished without a
    # word (Lightning says so only with verbose, which logs every improvement too). A resumed run does
    # not repeat the reason restored from the checkpoint it continues.
    stop = "early_stopping={monitor:val/acc,mode:max,stopping_threshold:0.0}"
    with train_log_heard(monkeypatch, caplog):
        out = run_train(tmp_path / "a", ["trainer.val_check_interval=5", stop])
    assert read_checkpoint(out["last_ckpt"])["global_step"] == 5
    assert re.search(r"early stopping ended training at step 5: Stopping threshold reached: val/acc = "
                     r"[0-9.e-]+ > 0\.0\.$", caplog.text, re.M), caplog.text  # fmt: skip
    caplog.clear()
    keep_going = "early_stopping={monitor:val/acc,mode:max,stopping_threshold:1.5,patience:100}"
    with train_log_heard(monkeypatch, caplog):
        resumed = run_train(
            tmp_path / "b", ["trainer.val_check_interval=5", keep_going, f"resume={out['last_ckpt']}"]
        )
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 20
    assert "early stopping" not in caplog.text


def test_early_stopping_survives_a_run_cut_before_its_first_validation(tmp_path):
    # Validation once an epoch, the run cut mid-epoch by max_steps: Lightning's strict check raised
    # "Early stopping conditioned on metric `val/acc` which is not available" (a new-user check found
    # it with experiment=zoology_mqar). The monitor is checked before training instead.
    out = run_train(tmp_path, [
        "trainer.max_steps=3", "trainer.max_epochs=1", "trainer.val_check_interval=1.0",
        "trainer.check_val_every_n_epoch=1", "early_stopping={monitor:val/acc,mode:max}",
    ])  # fmt: skip
    assert 0.0 <= out["metrics"]["val/acc"] <= 1.0 and Path(out["last_ckpt"]).exists()


@pytest.mark.parametrize(
    "override,error,message",
    [
        ("trainer.max_steps=abc", TypeError, "trainer.max_steps must be an integer, got 'abc'"),
        ("trainer.max_steps=2.5", TypeError, "trainer.max_steps must be an integer, got 2.5"),
        ("trainer.max_steps=-5", ValueError, "trainer.max_steps must be -1 (no limit) or >= 1"),
        ("trainer.max_epochs=0", ValueError, "trainer.max_epochs must be -1 (no limit) or >= 1"),
        ("trainer.max_steps=-1", ValueError, "max_epochs=-1 leave the run without a length"),
        ("early_stopping={monitor:val/acx}", ValueError, "early_stopping.monitor='val/acx': monitor one of"),
        ("early_stopping={monitor:val/acc,mode:up}", ValueError, "early_stopping.mode must be min or max"),
        # New-user checks: EarlyStopping's default mode (min) stopped a val/acc run at its first
        # validation, below the stopping_threshold, with status 0 and no line saying so.
        (
            "early_stopping={monitor:val/acc,stopping_threshold:0.99}",
            ValueError,
            "early_stopping.monitor=val/acc with no early_stopping.mode (min) would stop training once it "
            "stops falling (with a stopping_threshold, at its first validation); "
            "give +early_stopping.mode=max",
        ),
        (
            "early_stopping={monitor:val/loss_T128_kv8,mode:max}",
            ValueError,
            "with early_stopping.mode=max would stop training once it stops rising (with a stopping",
        ),
        (
            "early_stopping={monitor:val/acc,patience:1.5}",
            TypeError,
            "early_stopping.patience must be an integer, got 1.5",
        ),
        (
            "early_stopping={monitor:val/acc,patience:null}",
            TypeError,
            "early_stopping.patience must be an integer, got None",
        ),
        ("trainer.val_check_interval=0", ValueError, "trainer.val_check_interval must be >= 1 (steps)"),
        ("trainer.val_check_interval=1.5", ValueError, "or in (0, 1] (a fraction of an epoch), got 1.5"),
        ("trainer.val_check_interval=abc", TypeError, "trainer.val_check_interval must be a number"),
        ("trainer.check_val_every_n_epoch=0", ValueError, "check_val_every_n_epoch must be null or >= 1"),
        # Lightning refused these itself, but after its "Seed set to 0" line (a carried new-user note).
        ("trainer.precision=bf17", ValueError, "trainer.precision must be one of Lightning's precisions ("),
        ("trainer.precision=true", ValueError, "bf16-mixed, 32-true, 64-true, 64, 32, 16, bf16), got True"),
        ("trainer.precision=16.0", ValueError, "got 16.0"),
        # A new-user check: rc 0, "no validation ran ... trainer.val_check_interval", no best.ckpt.
        ("trainer.limit_val_batches=0", ValueError, "trainer.limit_val_batches=0 turns validation off, but"),
        ("trainer.limit_val_batches=0.0", ValueError, "trainer.limit_val_batches=0.0 turns validation off"),
        ("trainer.limit_val_batches=abc", TypeError, "trainer.limit_val_batches must be a batch count (int)"),
        # New-user checks: 0 trained no step, yet the run reported its untrained weights with status 0;
        # Lightning failed on accumulate_grad_batches=0 with a ZeroDivisionError traceback, took 2.5
        # silently, and failed on overfit_batches with a traceback.
        ("+trainer.limit_train_batches=0", ValueError, "trainer.limit_train_batches=0 trains no batch; give"),
        ("+trainer.limit_train_batches=x", TypeError, "trainer.limit_train_batches must be a batch count"),
        ("+trainer.accumulate_grad_batches=0", ValueError, "trainer.accumulate_grad_batches must be >= 1"),
        ("+trainer.accumulate_grad_batches=2.5", TypeError, "accumulate_grad_batches must be an integer"),
        ("+trainer.overfit_batches=1", ValueError, "trainer.overfit_batches=1 is not supported: train.py's"),
        # NaN from the second step, at any optim.lr (the divergence warning advised a lower one).
        ("trainer.precision=16-true", ValueError, "keeps the weights and AdamW's state in float16, where"),
        ("seed=abc", TypeError, "seed must be an integer, got 'abc'"),
        ("seed=-1", ValueError, "seed must be in [0, 2**32) (numpy's seed range), got -1"),
        (
            "trainer.gradient_clip_val=-1",
            ValueError,
            "gradient_clip_val must be >= 0 (0 or null: no clipping)",
        ),
        ("trainer.val_check_interval=0.5", ValueError, "add trainer.check_val_every_n_epoch=1, or give"),
        (
            "mixer.pattern=attention",
            ValueError,
            "got the string 'attention'; write mixer.pattern=[attention]",
        ),
        ("optim.lr=abc", TypeError, "optim.lr must be a number, got 'abc'"),
        ("optim.warmup_steps=1.5", TypeError, "optim.warmup_steps must be an integer"),
        (
            "trainer.enable_progress_bar=no",
            TypeError,
            "trainer.enable_progress_bar must be true or false, got 'no'",
        ),
        (
            "trainer.deterministic=no",
            TypeError,
            "trainer.deterministic must be true, false or warn, got 'no'",
        ),
        ("data.random_non_queries=no", TypeError, "random_non_queries must be true or false, got 'no'"),
        ("data.monitor_mode=maxx", ValueError, "data.monitor_mode must be min or max, got 'maxx'"),
        ("data.monitor=val/accc", ValueError, "data.monitor='val/accc': monitor one of the metrics this run"),
        ("data.monitor=val/loss", ValueError, "would keep the highest-loss checkpoint as best.ckpt"),
        # The data module's errors name the data.* setting (they named test_configs[0], seqlen).
        (
            "data.test_configs=[{seqlen:2,num_kv_pairs:1}]",
            ValueError,
            "data.test_configs[0].seqlen must be >= 4",
        ),
        ("data.test_configs=[{seqlen:64}]", ValueError, "data.test_configs[0] must be a mapping with"),
        ("data.seqlen=7", ValueError, "data.seqlen must be even (queries sit at even offsets), got 7"),
    ],
)
def test_bad_trainer_and_optim_settings_fail_before_training(tmp_path, override, error, message):
    key = override.split("=")[0] + "="
    tiny = [a for a in TINY if not a.startswith(key)]
    cfg = compose_train(tiny + MQAR_TINY + [override, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(error, match=re.escape(message)):
        train_module.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_early_stopping_keys_are_lightnings_and_its_off_forms_pass(tmp_path):
    # The valid keys named are EarlyStopping's arguments, as the installed Lightning has them.
    valid = sorted(name for name in inspect.signature(EarlyStopping.__init__).parameters if name != "self")
    with pytest.raises(ValueError, match=re.escape(f"(the arguments of Lightning's EarlyStopping): {valid}")):
        check_settings(compose_train([f"run_dir={tmp_path}", "early_stopping={monitor:val/acc,foo:3}"]))
    for off in ("null", "false"):  # no early stopping
        check_settings(compose_train([f"run_dir={tmp_path}", f"early_stopping={off}"]))
    nulls = ",".join(f"{key}:null" for key in valid if key not in ("monitor", "patience"))
    every = f"early_stopping={{{nulls},monitor:val/acc,patience:0}}"  # every key given
    check_settings(compose_train([f"run_dir={tmp_path}", every]))


@pytest.mark.parametrize(
    "overrides",
    [[f"mixer={mixer}"] for mixer in MIXER_CONFIGS]
    + [["experiment=zoology_mqar"], ["mixer.name=my attention 2"], ["mixer.name=my_attention.v2"]],
)
def test_shipped_mixer_names_and_early_stopping_pass_the_settings_check(tmp_path, overrides):
    check_settings(compose_train([f"run_dir={tmp_path}", *overrides]))


def test_a_run_dir_other_than_hydras_is_refused(tmp_path, monkeypatch):
    # A new-user check: run_dir=/tmp/xx put checkpoints/ and results/ there, .hydra/ and train.log in
    # Hydra's run directory.
    monkeypatch.chdir(tmp_path)
    hydras = str(tmp_path / "outputs" / "run")
    check_run_dir(hydras, hydras, sweep=False)
    check_run_dir("outputs/run", hydras, sweep=False)  # the same folder, relative
    message = (
        f"run_dir={tmp_path}/xx: run_dir is Hydra's run directory, {hydras} for this run, which holds the "
        "run's .hydra/ and train.log beside its checkpoints and records; remove the run_dir override and "
        f"set hydra.run.dir={tmp_path}/xx instead"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_run_dir(f"{tmp_path}/xx", hydras, sweep=False)
    with pytest.raises(ValueError, match=re.escape("set hydra.sweep.dir=<folder> (each job gets a folder")):
        check_run_dir(f"{tmp_path}/xx", hydras, sweep=True)
    with pytest.raises(ValueError, match=re.escape("run_dir=3: run_dir is Hydra's run directory, ")):
        check_run_dir(3, hydras, sweep=False)


def test_a_validation_fraction_below_one_batch_is_refused_before_training():
    """Found by a fresh-clone check: trainer.limit_val_batches=0.5 of one batch trained a whole
    interval, then Lightning failed with a traceback at validation."""
    dm = types.SimpleNamespace(slice_names=["T64_kv4", "T128_kv8"], val_dataloader=lambda: [[0, 1], [0]])
    message = "trainer.limit_val_batches=0.5 of the 1 validation batch(es) of T128_kv8 (a process) is less"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_val_batches(dm, 0.5, world_size=1)
    check_val_batches(dm, 1.0, world_size=1)  # all batches
    check_val_batches(dm, 1, world_size=1)  # a batch count: Lightning takes min(1, batches)
    with pytest.raises(ValueError, match=r"of the 1 validation batch\(es\) of T64_kv4"):  # 2 processes
        check_val_batches(dm, 0.6, world_size=2)
    one_loader = types.SimpleNamespace(val_dataloader=lambda: range(4))  # 4 batches: 0.5 keeps 2
    check_val_batches(one_loader, 0.5, world_size=1)


@pytest.mark.parametrize("logger,csv", [("csv", True), ("none", False)])
def test_wandb_can_be_enabled_from_every_logger_option(tmp_path, logger, csv):
    """Found by a new-user check: logger=csv logger.wandb.enabled=true failed with a traceback
    ("Key 'mode' is not in struct") and left the run folder: only logger=wandb had W&B's settings."""
    cfg = compose_train([*TINY, f"logger={logger}", "logger.wandb.enabled=true", f"run_dir={tmp_path}"])
    check_logger_settings(cfg.logger)
    loggers = train_module._loggers(cfg, tmp_path, "run")
    assert [type(one).__name__ for one in loggers] == ["CSVLogger"] * csv + ["WandbLogger"]
    wandb = cfg.logger.wandb
    assert (wandb.mode, wandb.project, list(wandb.tags)) == ("offline", "mixerlab", [])


def test_online_wandb_without_an_api_key_is_one_line_before_training(tmp_path, monkeypatch):
    """Found by a new-user check: logger.wandb.mode=online without a W&B key ended in a traceback from
    inside Lightning's fit (wandb's UsageError). The run now starts with the loggers, and W&B's
    refusal is a ValueError naming the fixes."""
    without_wandb_key(monkeypatch, tmp_path)
    cfg = compose_train([*TINY, "logger=wandb", "logger.wandb.mode=online", f"run_dir={tmp_path}"])
    refusal = (
        r"W&B could not start an online run \(.*API key.*\); log in with `wandb login` \(or set "
        r"WANDB_API_KEY\), or log offline with logger.wandb.mode=offline"
    )
    with pytest.raises(ValueError, match=refusal):
        train_module._loggers(cfg, tmp_path, "run")


def test_online_wandb_without_an_api_key_is_refused_before_the_seeding(tmp_path, monkeypatch):
    """Found by a new-user check: the refusal came after Lightning's "Seed set to 0" and a wandb
    warning; it is now the run's one line, and no folder is left."""
    without_wandb_key(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    args = [str(REPO_ROOT / "train.py"), *TINY, *MQAR_TINY, f"hydra.run.dir={run_dir}"]
    result = cli([*args, "logger=wandb", "logger.wandb.mode=online"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    refusal = "error: W&B could not start an online run (no API key found); log in with"
    assert result.stderr.startswith(refusal)
    assert len(result.stderr.splitlines()) == 1 and "Seed set" not in result.stdout + result.stderr
    assert not run_dir.exists()
    # A key (wandb.login's answer stood in for: a real one in this process would stay in wandb's
    # session for the tests after it) and a server that answers: the run goes on to start W&B. With
    # the server unreachable (a port nothing listens on) the refusal comes at once: wandb.init waited
    # 90 s, after the seeding.
    monkeypatch.setattr(wandb, "login", lambda **kwargs: True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        check_wandb_login("logger.wandb.mode")
    unreachable = r"online run \(http://127.0.0.1:\d+ cannot be reached from this machine\)"
    with pytest.raises(ValueError, match=unreachable):
        check_wandb_login("logger.wandb.mode")


def _hub_answering(status: int) -> type[http.server.BaseHTTPRequestHandler]:
    """A stand-in Hub that answers every request with ``status``, logging nothing."""

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_error(status)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    return Hub


@pytest.mark.parametrize(
    "status,reason",
    [
        (
            404,
            "has no dataset of that name that this machine may read; check the name (owner/name, as "
            "in the dataset page's address; a private or gated dataset needs `hf auth login`), or give a "
            "local text file with data.path=...\n",
        ),
        # A second new-user check: a server error (after the Hub client's retries) was called "no dataset
        # of that name" and its retry warnings in train.log kept the folder; a 401 without the Hub's
        # error header was a traceback.
        (
            503,
            "answered with a server error (HTTP 503); try again later, or give a local text file with "
            "data.path=...\n",
        ),
        (
            401,
            "refused access (HTTP 401): a private or gated dataset needs `hf auth login` (and the "
            "dataset's terms accepted on its page); check the name, or give a local text file with "
            "data.path=...\n",
        ),
    ],
    ids=["404", "503", "401"],
)
def test_a_dataset_the_hub_does_not_give_is_refused_in_one_line(tmp_path, status, reason):
    """Found by a new-user check: with the Hub reachable, data.dataset_name naming no dataset gave
    datasets' message, which named a local folder first ("Couldn't find any data file at
    <cwd>/nobody/nothing"), after the Hub client's INFO line per HTTP request; those lines in train.log
    made the refused run look started, so its folder stayed."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _hub_answering(status))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    run_dir = tmp_path / "run"
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_ETAG_TIMEOUT": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "1"}  # fmt: skip
    args = [str(REPO_ROOT / "train.py"), *TINY, "data=text", "data.dataset_name=nobody/nothing",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    try:
        result = cli(args, cwd=tmp_path, env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 2, result.stderr[-3000:]
    refusal = "error: data.dataset_name='nobody/nothing' could not be loaded: "
    refusal += f"the Hub ({env['HF_ENDPOINT']}) "
    assert result.stderr.splitlines(keepends=True)[-1] == refusal + reason, result.stderr[-3000:]
    assert "HTTP Request" not in result.stdout + result.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "16", "32", "bf16"])
def test_lightning_precisions_pass_the_trainer_check(precision):
    # The values are read from the Trainer's signature: a reading that lost its Literal types would
    # refuse every precision, the config's own 32-true included.
    cfg = compose_train([*TINY, f"trainer.precision={precision}"])
    check_trainer_settings(cfg)
    assert cfg.trainer.precision in lightning_precisions()


@pytest.mark.parametrize(
    "max_time,message",
    [
        # A new-user check: a zero or negative time trained nothing, exit 0, its untrained last.ckpt
        # reported as the best checkpoint, with result records.
        ("00:00:00:00", "trainer.max_time=00:00:00:00 is no time to train (training would stop before its "
         "first step); give a positive duration, e.g. 00:12:00:00 for 12 hours, or a mapping such as "
         "{hours: 12}"),
        ("{seconds:-5}", "trainer.max_time={seconds:-5} is no time to train "),
        ("{hourz:1}", "trainer.max_time takes weeks, days, hours, minutes, seconds, milliseconds, "
         "microseconds, got ['hourz']"),
        ("{hours:abc}", "trainer.max_time.hours must be a finite number, got 'abc'"),
        # A new-user check: past timedelta's range, an OverflowError's traceback.
        ("{days:1000000000}", "trainer.max_time={days:1000000000} is longer than Python's timedelta holds "),
        ("99999999999:00:00:00", "trainer.max_time=99999999999:00:00:00 is longer than Python's timedelta "),
        ("5", "trainer.max_time must be DD:HH:MM:SS, e.g. 00:12:00:00 for 12 hours, or a mapping such as "
         "{hours: 12}; got 5"),
        ("00:00:00:01", None),
        ("{minutes:0.5}", None),
    ],
)  # fmt: skip
def test_max_time_must_be_a_positive_duration(max_time, message):
    cfg = compose_train([*TINY, f"+trainer.max_time={max_time}"])
    if message is None:
        check_trainer_settings(cfg)
        return
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_trainer_settings(cfg)


def test_a_data_error_of_another_type_is_raised_as_it_was(tmp_path, monkeypatch):
    """The data module's errors gain a data. prefix by being rebuilt from their message; an error
    whose constructor takes more than a message (UnicodeDecodeError: five arguments) was turned into a
    TypeError about that constructor. It goes on unchanged."""
    error = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(training.settings.datasets_lib, "build_datamodule", refuse)
    cfg = compose_train(TINY + MQAR_TINY + [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(UnicodeDecodeError) as raised:
        train_module.train(cfg)
    assert raised.value is error


def test_a_stop_signal_during_the_final_evaluation_waits_for_it(capsys):
    # The final save and evaluation finish; the signal then ends the process with status 1.
    before = signal.getsignal(signal.SIGTERM)
    finished = []
    with pytest.raises(SystemExit) as exc:
        with defer_stop_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs in this (main) thread at the next bytecode
            finished.append(True)
    assert exc.value.code == 1 and finished == [True]
    assert signal.getsignal(signal.SIGTERM) is before
    out = capsys.readouterr().out
    assert "SIGTERM: finishing the final save and evaluation first" in out
    # and why the status is 1 (a new-user check found no word of it)
    assert out.endswith("SIGTERM: the final save and evaluation are done; stopping (status 1)\n")
    with defer_stop_signals():  # no signal: nothing happens
        pass
    # A second signal stops at once: the block's remaining work does not run.
    with pytest.raises(SystemExit) as exc:
        with defer_stop_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            finished.append("after the second signal")
    assert exc.value.code == 1 and finished == [True]
    assert "SIGTERM again: stopping now" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_the_final_validation_lets_it_finish(tmp_path, monkeypatch, capsys):
    # trainer.validate registers Lightning's SIGTERM handler beside defer_stop_signals' note: it
    # used to end the final evaluation at its next batch with SIGTERMException, a SystemExit without
    # a code (status 0), before any record was written.
    validation_step = LitLM.validation_step
    sent = []

    def sigterm_once_in_the_final_validation(self, batch, batch_idx, dataloader_idx=0):
        if self.trainer.state.fn == "validate" and not sent:
            sent.append(batch_idx)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handlers run in this (main) thread at the next bytecode
        return validation_step(self, batch, batch_idx, dataloader_idx)

    monkeypatch.setattr(LitLM, "validation_step", sigterm_once_in_the_final_validation)
    with pytest.raises(SystemExit) as exc:
        run_train(tmp_path / "run", ["model.n_layers=2"])
    assert exc.value.code == 1 and sent == [0]
    assert "SIGTERM: finishing the final save and evaluation first" in capsys.readouterr().out
    records = json.loads((tmp_path / "run" / "results" / "train.json").read_text())
    assert records and {r["task"] for r in records} == {"mqar"}


def test_ddp_on_two_cpu_processes_leaves_one_run_dir(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    args = [str(REPO_ROOT / "train.py"), "trainer=ddp", f"hydra.run.dir={run_dir}", "mixer=hybrid_jamba"]
    # 61 validation examples per slice: not a multiple of the 2 processes (see below)
    data = ["data.num_train_examples=640", "data.num_test_examples=61"]
    result = cli(args + TINY + data, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run"]
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert "best checkpoint:" in result.stdout
    # One log, rank 0's (process 1, which logs nothing, left an empty train_ddp_process_1.log).
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log"]
    assert load_model(run_dir / "checkpoints" / "last.ckpt").model.config.name == "hybrid_jamba"
    tokens = logged(str(run_dir), "train/tokens")
    assert tokens[-1] == 20 * 32 * 64 * 2  # 20 steps x batch 32 x seqlen 64 x 2 processes

    # The run's validation metrics are those of one process on the same checkpoint: every example
    # scored once (Lightning's DistributedSampler would score one of the 61 twice on each slice).
    records = json.loads((run_dir / "results" / "train.json").read_text())
    distributed = {r["metric"]: r["value"] for r in records if r["metric"].startswith("val/")}
    lit = load_model(run_dir / "checkpoints" / "best.ckpt")
    dm = build_datamodule("mqar", num_train_examples=640, num_test_examples=61, batch_size=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.validate(lit, datamodule=dm, verbose=False)
    single = lit.val_metrics
    assert {f"val/loss_{name}" for name in dm.slice_names} <= distributed.keys()
    for key, value in single.items():
        if key in distributed:
            assert distributed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_sigterm_stops_a_ddp_run_at_once(tmp_path):
    """Found by a new-user check: a SIGTERM to a CPU DDP run hung both processes for good (one try
    in three), in Lightning's broadcast from inside its signal handler. The launching process now
    SIGKILLs the other and exits with status 1 (StopDDPOnSigterm): no collective in the handler."""
    run_dir = tmp_path / "run"
    tiny = [a for a in TINY if not a.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    args = [str(REPO_ROOT / "train.py"), "trainer=ddp", f"hydra.run.dir={run_dir}", *tiny, *MQAR_TINY]
    args += ["trainer.max_steps=100000", "trainer.val_check_interval=50", "data.num_train_examples=2048"]
    logged_step = run_dir / "csv" / "metrics.csv"  # training is under way in both processes
    one_thread = {"OMP_NUM_THREADS": "1"}
    status, out, err = sigterm_once(args, tmp_path, logged_step, wait=240, settle=1.0, env=one_thread)
    assert status == 1, err[-3000:]
    assert "SIGTERM: stopping the DDP run now, without a final save or evaluation" in out
    assert "Traceback" not in err, err[-3000:]
    # The other process is gone too (it would hold the run's command line).
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps


def test_joblib_launcher_runs_a_sweep_in_parallel_processes(tmp_path):
    # Three jobs on two worker processes: one worker runs two jobs in turn, so state left over from
    # a job (seeds, the Lightning trainer, the run dir's logging) must not leak into the next. With a
    # loader worker each (a new-user check: "'Process' object has no attribute 'env'" in every job,
    # loky's start method being the worker's default; training.sweep_stop.init_sweep_worker).
    sweep = tmp_path / "multirun"
    args = [
        str(REPO_ROOT / "train.py"),
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep}",
        "mixer=attention,linear_attention,mamba",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "data.num_workers=1",
    ]
    result = cli(args + TINY[:1] + TINY[3:] + MQAR_TINY, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["0-attention-mqar", "1-linear_attention-mqar", "2-mamba-mqar"]
    assert "Joblib.Parallel(n_jobs=2" in result.stdout + result.stderr
    for run in runs:
        records = json.loads((sweep / run / "results" / "train.json").read_text())
        assert {r["mixer"] for r in records} == {run.split("-")[1]}
        assert load_model(sweep / run / "checkpoints" / "last.ckpt").model.config.name == run.split("-")[1]
        assert logged(str(sweep / run), "train/tokens")[-1] == 4 * 32 * 64


@pytest.mark.parametrize("to", ["process", "group"])
def test_a_stopped_joblib_sweep_lets_its_running_jobs_save(tmp_path, to):
    """Found in the thirty-seventh session: a SIGTERM to a joblib sweep (to its own process, or to
    the process group as a scheduler or a terminal's Ctrl+C sends it) had joblib SIGKILL the
    workers, and jobs that had started their final save lost last.ckpt and train.json. Now the
    running jobs stop at their next batch and save; a queued job does not start ("process": two
    workers, three jobs), and an idle worker the signal reaches stays ("group": four workers)."""
    sweep = tmp_path / "multirun"
    tiny = [a for a in TINY if not a.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    args = [str(REPO_ROOT / "train.py"), "-m", "hydra/launcher=joblib", f"hydra.sweep.dir={sweep}"]
    args += [f"hydra.launcher.n_jobs={2 if to == 'process' else 4}", "optim.lr=1e-3,2e-3,3e-3"]
    args += ["trainer.max_steps=100000", "trainer.val_check_interval=5", *tiny, *MQAR_TINY]
    running = ["0-attention-mqar", "1-attention-mqar"] + (["2-attention-mqar"] if to == "group" else [])
    ready = [sweep / run / "checkpoints" / "best.ckpt" for run in running]
    status, out, err = sigterm_once(args, tmp_path, ready, wait=400, to=to, env={"OMP_NUM_THREADS": "1"})
    assert status == INTERRUPTED, err[-3000:]
    assert "stopping the sweep: its running jobs stop within about a second" in err
    assert "Traceback" not in err, err[-3000:]
    for run in running:
        records = json.loads((sweep / run / "results" / "train.json").read_text())
        assert records and all(r["interrupted"] is True for r in records)
        assert load_model(sweep / run / "checkpoints" / "last.ckpt").model.config.d_model == 32
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == running  # the queued job's folder is undone
    if to == "process":
        assert f"not started: the sweep was stopped ({sweep / '2-attention-mqar'})" in err


def test_resume_continues_steps_tokens_and_schedule(tmp_path):
    # Reference: 30 uninterrupted steps. Resumed: 20 steps, then 10 more from last.ckpt in a new run dir.
    full = run_train(tmp_path / "full", ["trainer.max_steps=30", "trainer.val_check_interval=10"])
    part = run_train(tmp_path / "part", ["trainer.max_steps=20", "trainer.val_check_interval=10"])
    resumed = run_train(
        tmp_path / "resumed",
        ["trainer.max_steps=30", "trainer.val_check_interval=10", f"resume={part['last_ckpt']}"],
    )
    state = read_checkpoint(resumed["last_ckpt"])
    assert state["global_step"] == 30
    adam_steps = {float(s["step"]) for s in state["optimizer_states"][0]["state"].values()}
    assert adam_steps == {30.0}  # the optimizer's moments were restored, not restarted
    rows = metrics_rows(resumed["run_dir"])
    # Ten more steps, logged after the first run's (a fresh run labels its steps 0..29; Lightning
    # labels a resumed run's one higher, 21..30).
    steps = [int(r["step"]) for r in rows if r.get("train/tokens")]
    assert len(steps) == 10 and min(steps) > max(int(r["step"]) for r in metrics_rows(part["run_dir"]))
    assert logged(resumed["run_dir"], "train/tokens") == [n * 32 * 64 for n in range(21, 31)]
    # The warmup + cosine schedule, over the new 30 steps, continues at step 21: the lr of each of
    # the ten steps is the uninterrupted run's (the first too, though the checkpoint's optimizer
    # held the rate of a 20-step schedule's end).
    lr_key = next(k for k in rows[0] if k.startswith("lr-"))
    lrs = [float(r[lr_key]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get(lr_key)]
    full_rows = sorted(metrics_rows(full["run_dir"]), key=lambda r: int(r["step"]))
    full_lrs = [float(r[lr_key]) for r in full_rows if r.get(lr_key)]
    assert len(full_lrs) == 30 and lrs == pytest.approx(full_lrs[20:], rel=1e-12)
    records = json.loads((Path(resumed["run_dir"]) / "results" / "train.json").read_text())
    # Its one validation (step 30) is its best: the records count the tokens of all 30 steps.
    assert {r["train_tokens"] for r in records} == {30 * 32 * 64}


@contextlib.contextmanager
def stopped_after_step(monkeypatch, step: int) -> Iterator[None]:
    """Within the block, a run stops after its optimizer step ``step``, as trainer.max_time stops it
    (Lightning's Timer sets trainer.should_stop after a step): not interrupted, mid-epoch."""
    on_train_batch_end = LitLM.on_train_batch_end

    def stopping(self, outputs, batch, batch_idx):
        on_train_batch_end(self, outputs, batch, batch_idx)
        if self.global_step == step:
            self.trainer.should_stop = True

    with monkeypatch.context() as patch:
        patch.setattr(LitLM, "on_train_batch_end", stopping)
        yield


def test_a_resume_on_another_max_steps_notes_the_recomputed_schedule(tmp_path, monkeypatch, caplog):
    """A new-user check: resumed at step 12 of a 40-step run with trainer.max_steps=16, the cosine
    schedule was recomputed over 16 steps without a word (its floor at step 16, not 40). The run
    resumes (training on for longer, or less, is legitimate) and says so once, with the rates."""
    settings = ["model.n_layers=2", "trainer.val_check_interval=4", "optim.warmup_steps=4"]
    with stopped_after_step(monkeypatch, 12):
        part = run_train(tmp_path / "part", [*settings, "trainer.max_steps=40"])
    assert read_checkpoint(part["last_ckpt"])["callbacks"]["ScheduleRecord"] == {
        "total": 40, "warmup": 4, "interval": "step"
    }  # fmt: skip
    lr, floor = 3e-3, 3e-4  # optim.lr, times optim.min_lr_ratio=0.1

    def cosine(step: int, total: int) -> float:
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (step - 4) / (total - 4)))

    def notes() -> list[str]:
        """The notes logged, each once per run (caplog hears train.py's lines here as often as the
        run's last line)."""
        found = [m for m in caplog.messages if m.startswith("note: resumed")]
        runs = sum(m.startswith("last checkpoint: ") for m in caplog.messages)
        assert runs and len(found) % runs == 0
        return found[: len(found) // runs]

    with train_log_heard(monkeypatch, caplog):
        run_train(tmp_path / "shorter", [*settings, "trainer.max_steps=16", f"resume={part['last_ckpt']}"])
    assert notes() == [
        "note: resumed at step 12, the learning-rate schedule (warmup, then cosine decay) is recomputed over "
        "this run's 16 steps (trainer.max_steps=16), not the checkpoint's 40: the lr at step 12 is "
        f"{cosine(12, 16):.3g} ({cosine(12, 40):.3g} on the checkpoint's schedule), and it reaches its floor "
        "0.0003 at step 16 (step 40 before)"
    ]
    # The checkpoint's own length: no note.
    caplog.clear()
    with train_log_heard(monkeypatch, caplog):
        run_train(tmp_path / "same", [*settings, "trainer.max_steps=40", f"resume={part['last_ckpt']}"])
    assert notes() == []
    # A checkpoint written before the schedule was stored: noted where the rates at the step differ.
    checkpoint = read_checkpoint(part["last_ckpt"])
    del checkpoint["callbacks"]["ScheduleRecord"]
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    caplog.clear()
    with train_log_heard(monkeypatch, caplog):
        run_train(tmp_path / "older", [*settings, "trainer.max_steps=16", f"resume={older}"])
    assert notes() == [
        "note: resumed at step 12, the learning-rate schedule (warmup, then cosine decay) is recomputed over "
        f"this run's 16 steps (trainer.max_steps=16): the lr at step 12 is {cosine(12, 16):.3g} "
        f"({cosine(12, 40):.3g} on the checkpoint's schedule), and it reaches its floor 0.0003 at step 16"
    ]


def assert_same_training(resumed: dict, full: dict, first_step: int) -> None:
    """``resumed`` (a run resumed at ``first_step``) logged the training losses of the uninterrupted
    run ``full`` from that step on and ended on its weights, bit for bit: on CPU in fp32 the same
    batches in the same order give the same arithmetic (a checkpoint restores weights, optimizer
    moments and the schedule exactly)."""
    assert logged(resumed["run_dir"], "train/loss") == logged(full["run_dir"], "train/loss")[first_step:]
    weights = read_checkpoint(resumed["last_ckpt"])["state_dict"]
    expected = read_checkpoint(full["last_ckpt"])["state_dict"]
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def schedule(run_dir: str, first_step: int = 0) -> list[tuple[int, str]]:
    """(logged step, tokens trained) of each training row and (logged step, "val") of each
    validation in a run's CSV log, from logged step ``first_step`` on."""
    return [
        (int(row["step"]), row["train/tokens"] or "val")
        for row in metrics_rows(run_dir)
        if (row["train/tokens"] or row["val/acc"]) and int(row["step"]) >= first_step
    ]


def test_a_session_stopped_mid_epoch_resumes_on_the_uninterrupted_batches(tmp_path, monkeypatch):
    # A long run cut into sessions: the first stops at step 10 as trainer.max_time stops it (Lightning's
    # Timer sets trainer.should_stop after a step), mid-epoch (20 batches an epoch: 640 examples,
    # batch 32). Resumed, it restarted the epoch's data order from its first batch, in a new shuffle
    # (and shuffled its later epochs anew); it now trains on the uninterrupted run's batches 11 to
    # 20, then on its next epoch's.
    settings = ["model.n_layers=2", "trainer.max_steps=30", "trainer.val_check_interval=10"]
    full = run_train(tmp_path / "full", settings)
    with stopped_after_step(monkeypatch, 10):
        part = run_train(tmp_path / "part", settings)
    assert not part["interrupted"] and read_checkpoint(part["last_ckpt"])["global_step"] == 10
    resumed = run_train(tmp_path / "resumed", [*settings, f"resume={part['last_ckpt']}"])
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 30
    assert_same_training(resumed, full, first_step=10)


def test_a_resume_from_a_mid_run_best_checkpoint_logs_the_uninterrupted_steps(tmp_path):
    # Reported by a review: a resume from a best.ckpt saved at a mid-epoch validation logged its
    # steps one low. Lightning saves that checkpoint before it counts the step for its loggers (its
    # _batches_that_stepped is one below global_step); resumed, it first finishes that step's end,
    # counting it without validating again, so the resumed run logs, validates and trains on the
    # uninterrupted run's steps.
    settings = ["model.n_layers=2", "trainer.max_steps=12", "trainer.val_check_interval=4"]
    full = run_train(tmp_path / "full", settings)
    part = run_train(tmp_path / "part", [*settings, "trainer.max_steps=6"])
    best = read_checkpoint(part["best_ckpt"])
    assert best["global_step"] == 4
    assert best["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 3
    resumed = run_train(tmp_path / "resumed", [*settings, f"resume={part['best_ckpt']}"])

    assert schedule(resumed["run_dir"]) == schedule(full["run_dir"], first_step=4)
    assert_same_training(resumed, full, first_step=4)


def test_resume_refuses_a_checkpoint_that_used_up_max_time(tmp_path):
    # Lightning's Timer counts the checkpoint's training time: resumed with the run's own
    # +trainer.max_time, the run trained nothing, wrote a new run directory and said only that no
    # validation ran.
    settings = ["model.n_layers=2", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    part = run_train(tmp_path / "part", [*settings, "+trainer.max_time=00:00:10:00"])
    saved = read_checkpoint(part["last_ckpt"])["hyper_parameters"]  # the run's own settings
    # Two steps take seconds, tens of them on a loaded machine (0:00:10 in a CI run): any time under
    # the run's 10 minutes.
    message = (r"has already trained for 0:0\d:\d\d \(Lightning's timer counts it\), "
               r"and trainer.max_time=00:00:00:00")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check_resume(part["last_ckpt"], saved, max_steps=10, max_time="00:00:00:00")
    with pytest.raises(ValueError, match=r"trainer.max_time=\{seconds:0\}: nothing is left to train"):
        check_resume(part["last_ckpt"], saved, max_steps=10, max_time={"seconds": 0})
    resolved = str(Path(part["last_ckpt"]).resolve())
    assert check_resume(part["last_ckpt"], saved, max_steps=10, max_time="00:00:10:00") == resolved
    assert check_resume(part["last_ckpt"], saved, max_steps=10) == resolved


def test_resume_rejects_missing_weights_only_and_mismatched_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        run_train(tmp_path / "a", [f"resume={tmp_path / 'nope.ckpt'}"])
    part = run_train(tmp_path / "part", ["trainer.max_steps=2", "trainer.val_check_interval=2"])
    with pytest.raises(ValueError, match=r"model\.d_model=32.*this run has 64.*overrides.yaml"):
        run_train(tmp_path / "b", [f"resume={part['last_ckpt']}", "model.d_model=64"])
    weights_only = tmp_path / "weights.ckpt"
    state = read_checkpoint(part["last_ckpt"])
    torch.save(
        {"state_dict": state["state_dict"], "hyper_parameters": state["hyper_parameters"]}, weights_only
    )
    with pytest.raises(ValueError, match="holds no trainer state"):
        run_train(tmp_path / "c", [f"resume={weights_only}"])
    # One more step and no validation: the best checkpoint is this run's last, not the earlier run's best.
    more = run_train(tmp_path / "more", [f"resume={part['last_ckpt']}", "trainer.max_steps=3"])
    assert (
        more["best_ckpt"] == more["last_ckpt"]
        and Path(more["last_ckpt"]).parent == tmp_path / "more" / "checkpoints"
    )
    # A finished run: Lightning would train nothing and the new run would repeat the old records.
    with pytest.raises(ValueError, match=r"already at step 2, and trainer.max_steps=2: nothing is left"):
        run_train(tmp_path / "e", [f"resume={part['last_ckpt']}", "trainer.max_steps=2"])
    # A diverged run: training on from NaN weights stays NaN, so resuming is refused up front.
    diverged = tmp_path / "diverged.ckpt"
    weights = state["state_dict"]
    weights["model.norm_f.weight"] = torch.full_like(weights["model.norm_f.weight"], torch.nan)
    torch.save(state, diverged)
    message = r"NaN or inf weights in 1 of .*\(the first: model\.norm_f\.weight\).*diverged; pass resume="
    with pytest.raises(ValueError, match=message):
        run_train(tmp_path / "d", [f"resume={diverged}"])
    assert not (tmp_path / "d" / "checkpoints").exists() and not (tmp_path / "e" / "checkpoints").exists()


# jamba_run resumed: its mixer, and a step limit past its 20 steps.
JAMBA_RESUME = ["mixer=hybrid_jamba", "trainer.max_steps=21"]
# jamba_run's (MQAR's default) evaluation slices, written out.
DEFAULT_MQAR_SLICES = "[{seqlen:64,num_kv_pairs:4},{seqlen:128,num_kv_pairs:8},{seqlen:256,num_kv_pairs:16}]"


@pytest.mark.parametrize(
    "override",
    [
        "model.d_model=64",
        "resume=/runs/a/last.ckpt",
        "data.test_configs=[{seqlen:64,num_kv_pairs:4},{seqlen:128,num_kv_pairs:8}]",
        "resume='my runs/last.ckpt'",
        "resume=/runs/$HOME/last.ckpt",
        "data.path='it\"s, mine.txt'",
        "resume=/runs/a*b?/[c]/last.ckpt",
        "data.path=/tmp/back\\slash!",
    ],
)
def test_printed_overrides_paste_into_a_shell_unchanged(override, tmp_path):
    """What a refusal prints (train.pasteable) reaches the program as exactly the override when
    pasted into bash: no word splitting, globbing (a file here matches the brackets and stars), brace
    expansion of a mapping's commas, or variable expansion."""
    for name in ("c", "ab", "axb"):
        (tmp_path / name).touch()
    printed = pasteable(override)
    out = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {printed}"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\0")[:-1] == [override], printed
    assert printed == override or printed[0] in "'\"", "bare only where nothing needs quoting"


@pytest.mark.parametrize(
    "value",
    # a backslash before the ${, two of them, and an unclosed ${ (which Hydra refuses unescaped)
    ["/runs/${x}/last.ckpt", "my runs/${now:%H}/last.ckpt", "/a\\${x}", "/a\\\\${x}", "/runs/${oops"],
)
@pytest.mark.parametrize("key", ["resume", "data.path"])
def test_printed_overrides_paste_back_to_the_same_value(key, value, tmp_path):
    """Found by a review: a path holding a literal ${...} (a folder named so) was printed as it is, so
    the override pasted back made Hydra interpolate it (another value, or an error). It is printed
    escaped (\\${), which a shell passes through and Hydra's composed config reads as the path."""
    printed = pasteable(f"{key}={override_value(value)}")
    out = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {printed}"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    pasted = out.stdout.split("\0")[:-1]
    assert len(pasted) == 1, printed
    cfg = compose_train(["data=text", *pasted])
    assert OmegaConf.select(cfg, key) == value, printed


@pytest.mark.parametrize(
    "override,message",
    [
        # The slices' default follows data.seqlen: both named.
        (
            "data.seqlen=32",
            f'data.seqlen=64 (this run has 32), "data.test_configs={DEFAULT_MQAR_SLICES}" (this '
            "run has [{seqlen:32,num_kv_pairs:4},{seqlen:64,num_kv_pairs:8},{seqlen:128,num_kv_pairs:16}])",
        ),
        ("data.seed=1", "data.seed=0, this run has 1"),
        ("data=copy", "data=mqar, this run has copy"),  # the group's option, not data.name=mqar
        ("optim.lr=0.001", "optim.lr=0.003, this run has 0.001"),
        ("seed=1", "seed=0, this run has 1"),
        ("data.random_non_queries=false", "data.random_non_queries=true, this run has false"),
        # The checkpoint's null is shown as the slices it stands for (it showed as null), in double
        # quotes: a shell would glob the brackets and brace-expand {seqlen:64,num_kv_pairs:4}.
        (
            "data.test_configs=[{seqlen:64,num_kv_pairs:4}]",
            f'"data.test_configs={DEFAULT_MQAR_SLICES}", this run has [{{seqlen:64,num_kv_pairs:4}}]',
        ),
        ("model.d_model=16", "model.d_model=32, this run has 16"),
        # Every difference at once (a new-user check: fixed one at a time, each found by another try).
        ("data.seed=1 optim.lr=0.001", "data.seed=0 (this run has 1), optim.lr=0.003 (this run has 0.001)"),
    ],
)
def test_resume_refuses_other_data_optim_or_seed_settings(jamba_run, tmp_path, override, message):
    """A resume given other data, optimizer or seed= settings was accepted and trained on other
    batches (the order is a function of data.seed and seed=) or with another optimizer than the run
    it claimed to continue; it is refused up front, naming the key and both values, as Hydra
    overrides write them (they printed as Python values: True, None, 'copy'; model keys as
    `model d_model`)."""
    settings = [*JAMBA_RESUME, f"resume={jamba_run['last_ckpt']}", *override.split()]
    expected = f"was trained with {message}; resume with the checkpoint's settings"
    with pytest.raises(ValueError, match=re.escape(expected) + ".*overrides.yaml"):
        run_train(tmp_path, settings)
    assert not (tmp_path / "checkpoints").exists()


def test_resume_accepts_other_loader_and_selection_settings(jamba_run, tmp_path):
    """data.num_workers, data.cache_dir and data.monitor / monitor_mode change how batches are loaded
    and which checkpoint is kept, not what is trained: a resume may change them."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    hparams = checkpoint["hyper_parameters"]
    changed = {"num_workers": 2, "cache_dir": str(tmp_path), "monitor": "val/loss", "monitor_mode": "min"}
    for key, value in changed.items():
        edited = {**hparams, "data": {**hparams["data"], key: value}}
        assert check_resume(jamba_run["last_ckpt"], edited, max_steps=21)
    resumed = run_train(tmp_path, [*JAMBA_RESUME, f"resume={jamba_run['last_ckpt']}", "data.num_workers=1"])
    state = read_checkpoint(resumed["last_ckpt"])
    assert state["global_step"] == 21 and state["hyper_parameters"]["data"]["num_workers"] == 1
    assert set(changed) == set(RESUME_EXEMPT_DATA_KEYS)  # every exempt key is tested
    # The settings of a mixer the model does not build change no weight (a new-user check: a mamba run
    # trained with +mixer.settings.attention.pos_emb=learned was refused its resume without it).
    edited = {
        **hparams,
        "model": {
            **hparams["model"],
            "mixer_settings": {**hparams["model"]["mixer_settings"], "sliding_window": {"window": 8}},
        },
    }
    assert check_resume(jamba_run["last_ckpt"], edited, max_steps=21)
    # Another value in a built mixer's settings is named by that mixer, not the whole mapping.
    mamba = {**hparams["model"]["mixer_settings"]["mamba"], "d_state": 8}
    edited = {
        **hparams,
        "model": {
            **hparams["model"],
            "mixer_settings": {**hparams["model"]["mixer_settings"], "mamba": mamba},
        },
    }
    with pytest.raises(ValueError, match=r"was trained with \"mixer\.settings\.mamba=\{[^ ]*d_state:16"):
        check_resume(jamba_run["last_ckpt"], edited, max_steps=21)


def test_resume_accepts_a_default_written_out(jamba_run, tmp_path):
    """data.test_configs written out equal to the default slices that the checkpoint's null stands
    for was refused as another setting; a value and the default it stands for are one setting now,
    either way round (another list is still refused:
    test_resume_refuses_other_data_optim_or_seed_settings)."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    hparams = checkpoint["hyper_parameters"]
    assert hparams["data"]["test_configs"] is None
    resumed = run_train(
        tmp_path / "resumed",
        [*JAMBA_RESUME, f"resume={jamba_run['last_ckpt']}", f"data.test_configs={DEFAULT_MQAR_SLICES}"],
    )
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 21
    # The checkpoint holding the list, this run the default.
    resolved_path = str(Path(resumed["last_ckpt"]).resolve())
    assert check_resume(resumed["last_ckpt"], hparams, max_steps=22) == resolved_path
    # A synthetic task's slices, normalised (a copy slice's seqlen defaults to 2 * max_len + 3).
    copy = {"model": hparams["model"], "data": {"name": "copy", "test_configs": None}}
    written = [{"min_len": 1, "max_len": 20, "seqlen": 48}, {"min_len": 21, "max_len": 40},
               {"min_len": 41, "max_len": 80}]  # fmt: skip
    resolved = [
        resolve_defaults(resume_settings(h))
        for h in (copy, {**copy, "data": {"name": "copy", "test_configs": written}})
    ]
    assert resolved[0] == resolved[1]


def test_resume_refuses_another_process_count(jamba_run, tmp_path):
    """DDP splits each step's examples over the processes: the training stream continues the same
    order on any count, but in steps of data.batch_size x processes examples, so a resume on
    another trainer.devices or num_nodes trained other steps than the run it continued. Checkpoints
    store the run's process count; one written before that resumes on any."""
    assert read_checkpoint(jamba_run["last_ckpt"])["callbacks"]["WorldSizeRecord"] == {
        "world_size": 1,
        "num_nodes": 1,
    }
    message = (
        "was trained on 1 process(es), this run has 2: each optimizer step trains on data.batch_size "
        "examples per process"
    )
    fix = "resume with trainer.devices=1 trainer.num_nodes=1"
    with pytest.raises(ValueError, match=re.escape(message) + ".*" + fix):
        run_train(
            tmp_path,
            [*JAMBA_RESUME, f"resume={jamba_run['last_ckpt']}", "trainer.strategy=ddp", "trainer.devices=2"],
        )
    assert not (tmp_path / "checkpoints").exists()
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    del checkpoint["callbacks"]["WorldSizeRecord"]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    assert check_resume_world_size(str(old), 2) is None
    assert check_resume_world_size(jamba_run["last_ckpt"], 1) is None


def test_resume_refuses_a_corrupt_process_count_record_clearly(jamba_run, tmp_path):
    """A hand-edited WorldSizeRecord entry (a key missing, a wrong type, a count below 1), or a whole
    callbacks / loops entry, failed in a traceback (KeyError, ZeroDivisionError, AttributeError); it is
    an error naming the checkpoint as corrupt. A
    count its num_nodes does not divide got a hint of devices x nodes giving another count."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    saved = checkpoint["hyper_parameters"]
    edits = {
        "missing": {"world_size": 1},
        "text": {"world_size": "1", "num_nodes": 1},
        "no_nodes": {"world_size": 1, "num_nodes": 0},
        "negative": {"world_size": -2, "num_nodes": 1},
        "list": [1, 1],
    }
    for name, record in edits.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save({**checkpoint, "callbacks": {**checkpoint["callbacks"], "WorldSizeRecord": record}}, path)
        message = re.escape(f"resume={path}: the checkpoint is corrupt (its WorldSizeRecord entry, ")
        with pytest.raises(ValueError, match=message + ".*another checkpoint of the run"):
            check_resume(str(path), saved, max_steps=21, world_size=1)
        with pytest.raises(ValueError, match=message):
            check_resume_world_size(str(path), 1)
    # The whole callbacks (or loops) entry hand-edited: a traceback from the Timer's lookup before.
    for entry in ("callbacks", "loops"):
        path = tmp_path / f"{entry}.ckpt"
        torch.save({**checkpoint, entry: [1, 2]}, path)
        message = re.escape(
            f"resume={path}: the checkpoint is corrupt (its {entry} entry is a list, not a mapping)"
        )
        with pytest.raises(ValueError, match=message):
            check_resume(str(path), saved, max_steps=21, max_time="00:01:00:00", world_size=1)
    path = tmp_path / "odd.ckpt"
    record = {"world_size": 3, "num_nodes": 2}
    torch.save({**checkpoint, "callbacks": {**checkpoint["callbacks"], "WorldSizeRecord": record}}, path)
    message = re.escape("was trained on 3 process(es), this run has 1: ")
    with pytest.raises(ValueError, match=message + ".*resume with trainer.devices=3 trainer.num_nodes=1$"):
        check_resume_world_size(str(path), 1)


def test_resume_refuses_a_process_count_record_of_none_or_out_of_range(jamba_run, tmp_path):
    """Found by a new-user review: a WorldSizeRecord entry of None resumed on any process count, and a
    huge count was taken as one (suggesting trainer.devices=10**30). Any record but the integers
    world_size and num_nodes from 1 to MAX_PROCESSES (bool excluded) is a corrupt record; a checkpoint
    without the entry (written before it existed) still resumes on any count."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    saved = checkpoint["hyper_parameters"]
    too_many = MAX_PROCESSES + 1
    edits = {
        "none": None,
        "none_count": {"world_size": None, "num_nodes": 1},
        "huge": {"world_size": 10**30, "num_nodes": 1},
        "too_many": {"world_size": too_many, "num_nodes": 1},
        "too_many_nodes": {"world_size": 1, "num_nodes": too_many},
        "bool": {"world_size": True, "num_nodes": 1},
        "negative": {"world_size": -1, "num_nodes": 1},
    }
    for name, record in edits.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save({**checkpoint, "callbacks": {**checkpoint["callbacks"], "WorldSizeRecord": record}}, path)
        message = re.escape(f"resume={path}: the checkpoint is corrupt (its WorldSizeRecord entry, ")
        for world_size in (1, 2):
            with pytest.raises(ValueError, match=message + ".*another checkpoint of the run"):
                check_resume(str(path), saved, max_steps=21, world_size=world_size)
            with pytest.raises(ValueError, match=message):
                check_resume_world_size(str(path), world_size)
    largest = {"world_size": MAX_PROCESSES, "num_nodes": 1}
    path = tmp_path / "largest.ckpt"
    torch.save({**checkpoint, "callbacks": {**checkpoint["callbacks"], "WorldSizeRecord": largest}}, path)
    assert check_resume_world_size(str(path), MAX_PROCESSES) is None


def test_resume_accepts_a_process_count_record_of_numpy_integers(jamba_run, tmp_path):
    """Found by a review: a WorldSizeRecord holding numpy integers (np.int64(1), which some tools write)
    was reported as a truncated or corrupt file: the weights-only load refuses numpy scalars. A numpy
    integer is a count, in the check and in Lightning's own load of the checkpoint; a numpy bool or
    float is named as a corrupt record, not a corrupt file. LitLM.load_from_checkpoint reads it too."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    saved = checkpoint["hyper_parameters"]

    def with_record(name: str, record: dict) -> Path:
        path = tmp_path / f"{name}.ckpt"
        torch.save({**checkpoint, "callbacks": {**checkpoint["callbacks"], "WorldSizeRecord": record}}, path)
        return path

    path = with_record("numpy", {"world_size": np.int64(1), "num_nodes": np.int32(1)})
    # The evaluations read it too (models.checkpoint.read_checkpoint), the values as they were saved.
    record = read_checkpoint(path)["callbacks"]["WorldSizeRecord"]
    assert record == {"world_size": 1, "num_nodes": 1} and type(record["world_size"]) is np.int64
    # So do load_model and Lightning's own classmethod (the weights-only unpickler refused it there).
    want = load_model(path).state_dict()
    loaded = LitLM.load_from_checkpoint(path, map_location="cpu")
    assert all(torch.equal(t, want[name]) for name, t in loaded.state_dict().items())
    with pytest.raises(TypeError, match="cannot be called on an instance"):
        loaded.load_from_checkpoint(path)
    # help() shows Lightning's named arguments, not the wrapper's *args / **kwargs (a carried note).
    parameters = inspect.signature(LitLM.load_from_checkpoint).parameters
    assert list(parameters)[:4] == ["cls", "checkpoint_path", "map_location", "hparams_file"], parameters
    assert check_resume(str(path), saved, max_steps=21, world_size=1) == str(path.resolve())
    message = re.escape("was trained on 1 process(es), this run has 2: ")
    with pytest.raises(ValueError, match=message + ".*trainer.devices=1 trainer.num_nodes=1$"):
        check_resume(str(path), saved, max_steps=21, world_size=2)
    resumed = run_train(tmp_path / "resumed", [*JAMBA_RESUME, f"resume={path}"])
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 21
    # As numpy 1 names the scalar's rebuilder (numpy.core), in torch's legacy format: its pickle is not
    # in a zip archive, so the name can be edited in place.
    numpy1 = tmp_path / "numpy1.ckpt"
    torch.save(torch.load(path, weights_only=False), numpy1, _use_new_zipfile_serialization=False)
    written = numpy1.read_bytes()
    assert b"numpy._core.multiarray\nscalar" in written
    numpy1.write_bytes(written.replace(b"numpy._core.multiarray\nscalar", b"numpy.core.multiarray\nscalar"))
    assert check_resume(str(numpy1), saved, max_steps=21, world_size=1) == str(numpy1.resolve())
    for name, count in {"numpy_bool": np.bool_(True), "numpy_float": np.float64(1.0)}.items():
        path = with_record(name, {"world_size": count, "num_nodes": 1})
        message = re.escape(f"resume={path}: the checkpoint is corrupt (its WorldSizeRecord entry, ")
        with pytest.raises(ValueError, match=message + ".*not the integers world_size and num_nodes"):
            check_resume(str(path), saved, max_steps=21, world_size=1)


@pytest.mark.parametrize(
    "settings",
    [
        {"accelerator": "cpu", "devices": "auto"},
        {"accelerator": "cpu", "devices": "1"},
        {"accelerator": "cpu", "devices": "3", "strategy": "ddp"},
        {"accelerator": "cpu", "devices": 2, "num_nodes": 2, "strategy": "ddp"},
        {"accelerator": "auto", "devices": "auto"},
    ],
    ids=["cpu-auto", "cpu-string", "cpu-ddp-string", "two-nodes", "auto-auto"],
)
def test_resolved_world_size_is_the_trainers(settings, capfd, monkeypatch):
    """train.py resolves the process count before seeding (so that a resume on another count is
    refused first): the count the Trainer then runs with, printing nothing of its own."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # two nodes meet there (see the test below)
    world_size = resolved_world_size(settings)
    assert capfd.readouterr() == ("", "")
    assert world_size == L.Trainer(**settings, logger=False, enable_progress_bar=False).world_size


def test_several_nodes_need_an_address_to_meet_at(monkeypatch):
    """Found by a new-user check: trainer.num_nodes=2 on one machine waited for the second node at
    the first rendezvous, silently and past SIGTERM. Without a cluster manager and MASTER_ADDR it is
    refused, saying how to launch on several nodes; with MASTER_ADDR (set on every node) it runs."""
    for name in ("MASTER_ADDR", "SLURM_NTASKS", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    settings = {"accelerator": "cpu", "devices": 1, "num_nodes": 2, "strategy": "ddp"}
    message = (r"^trainer settings: trainer.num_nodes=2 would wait for 1 more node\(s\) with no address "
               r"to meet them at \(MASTER_ADDR is not set.*NODE_RANK=<0 to 1>.*"
               r"use trainer.num_nodes=1$")  # fmt: skip
    with pytest.raises(TrainerSettingsError, match=message):
        resolved_world_size(settings)
    assert resolved_world_size({**settings, "num_nodes": 1}) == 1
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert resolved_world_size(settings) == 2


def test_resume_refusals_paste_back_as_overrides(jamba_run, tmp_path):
    """Found by a new-user check: resume= printed a path Hydra reads otherwise bare (a comma makes a
    sweep, a space splits the shell's argument), and the model's keys as `model d_model=32`. The mixer,
    the likeliest difference, is named first, as the choice that selects it (mixer=hybrid_jamba)."""
    hparams = read_checkpoint(jamba_run["last_ckpt"])["hyper_parameters"]
    width = {**hparams, "model": {**hparams["model"], "d_model": 16}}
    mixer = {**hparams, "model": {**width["model"], "name": "attention"}}
    refusals = [  # (this run's hparams, world_size, max_steps, the message after resume=...)
        (width, None, 21, "was trained with model.d_model=32, this run has 16;"),
        (
            mixer,
            None,
            21,
            "was trained with mixer=hybrid_jamba (this run has attention), model.d_model=32 "
            "(this run has 16);",
        ),
        (hparams, 2, 21, "was trained on 1 process(es), this run has 2:"),
        (hparams, None, 20, "is already at step 20"),
    ]
    for folder in ("runs, v2", "my runs"):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "last.ckpt"
        shutil.copy(jamba_run["last_ckpt"], path)
        for settings, world_size, max_steps, message in refusals:
            # Double-quoted for the shell around Hydra's single quotes (test_printed_overrides_...).
            with pytest.raises(ValueError, match=re.escape(f"\"resume='{path}'\" {message}")):
                check_resume(str(path), settings, max_steps=max_steps, world_size=world_size)


def test_a_checkpoint_without_its_seed_still_resumes_and_loads(jamba_run, tmp_path):
    """Checkpoints written before the run's seed was stored hold no seed hyperparameter: they still
    resume (their seed is unknown, so not compared) and load for evaluations."""
    checkpoint = read_checkpoint(jamba_run["last_ckpt"])
    assert checkpoint["hyper_parameters"]["run_seed"] == 0
    del checkpoint["hyper_parameters"]["run_seed"]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    assert load_model(old).hparams["run_seed"] is None
    resumed = run_train(tmp_path / "resumed", [*JAMBA_RESUME, f"resume={old}"])
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 21


def test_a_run_interrupted_mid_step_resumes_on_the_uninterrupted_schedule(tmp_path, monkeypatch, caplog):
    # A Ctrl+C inside a training step saved that batch as started in last.ckpt: the resumed run
    # validated one step early (steps 7 and 11 instead of 8 and 12, every 4 steps), logged each
    # step one ahead, and ended saying that step 12, which it should have validated, was not.
    settings = ["model.n_layers=2", "trainer.max_steps=12", "trainer.val_check_interval=4"]
    validated = []  # the global_step of each validation during fit
    validation_epoch_end = LitLM.on_validation_epoch_end

    def record_validation(self):
        validation_epoch_end(self)
        if self.trainer.state.fn == "fit":
            validated.append(self.global_step)

    training_step = LitLM.training_step

    def interrupted_in_step_7(self, batch, batch_idx):
        if self.global_step == 6:
            raise KeyboardInterrupt
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(LitLM, "on_validation_epoch_end", record_validation)
    with train_log_heard(monkeypatch, caplog):
        full = run_train(tmp_path / "full", settings)
        assert validated == [4, 8, 12]
        with monkeypatch.context() as patch:
            patch.setattr(LitLM, "training_step", interrupted_in_step_7)
            part = run_train(tmp_path / "part", settings)
        assert part["interrupted"] and read_checkpoint(part["last_ckpt"])["global_step"] == 6
        assert (
            "the last 2 training steps were not validated (after step 4, the last validation)" in caplog.text
        )
        caplog.clear()
        validated.clear()
        resumed = run_train(tmp_path / "resumed", [*settings, f"resume={part['last_ckpt']}"])
    assert validated == [8, 12]
    assert "were not validated" not in caplog.text
    # Steps 7 to 12 logged as the uninterrupted run logged them (Lightning labels step n as n - 1),
    # with its token counts, and validated (and the best checkpoint validated again) at its steps.
    assert schedule(resumed["run_dir"]) == schedule(full["run_dir"], first_step=6)
    assert read_checkpoint(resumed["last_ckpt"])["global_step"] == 12
    # The interrupted batch was put back: the resumed run trains on it first, as the uninterrupted
    # run did, then on its next batches.
    assert_same_training(resumed, full, first_step=6)


def test_a_ctrl_c_while_best_ckpt_is_saved_still_keeps_the_runs_records(tmp_path, monkeypatch, caplog):
    """Found by a new-user check: a Ctrl+C while ModelCheckpoint wrote best.ckpt (it names the new
    best before the save, which the interrupt stops) ended with "Checkpoint file not found" and no
    results/train.json. The interrupted run now evaluates last.ckpt instead and says why."""
    save = AtomicCheckpointIO.save_checkpoint

    def interrupted_at_best(self, checkpoint, path, storage_options=None):
        if Path(path).name == "best.ckpt":
            raise KeyboardInterrupt  # before the atomic write: no file
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", interrupted_at_best)
    with train_log_heard(monkeypatch, caplog):
        result = run_train(
            tmp_path, ["model.n_layers=2", "trainer.max_steps=8", "trainer.val_check_interval=4"]
        )
    assert result["interrupted"] and not (tmp_path / "checkpoints" / "best.ckpt").exists()
    assert read_checkpoint(result["last_ckpt"])["global_step"] == 4
    assert "interrupted while best.ckpt was being saved" in caplog.text
    records = json.loads((tmp_path / "results" / "train.json").read_text())
    assert records and all(r["interrupted"] for r in records)


@pytest.mark.parametrize("failure", ["interrupt", "full disk"])
def test_train_cli_reports_an_interrupt_or_a_failed_write_in_one_line(tmp_path, failure):
    # train() stopped by Ctrl+C outside training's own handling (e.g. while the data is prepared), or
    # by a full disk: one line, no traceback; an interrupted run's empty run directory is removed.
    # The first call of train() (checking the W&B settings) fails, in `python train.py` itself.
    run_dir = tmp_path / "run"
    raiser = (
        "raise KeyboardInterrupt" if failure == "interrupt"
        else "raise WriteError(28, 'No space left on device', 'run/checkpoints/best.ckpt')"
    )  # fmt: skip
    program = (
        "import runpy, sys\n"
        "import eval.records\n"
        "from models.checkpoint import WriteError\n"
        "def fail(*args):\n"
        f"    {raiser}\n"
        "eval.records.check_wandb_settings = fail\n"
        f"sys.argv = ['train.py', 'hydra.run.dir={run_dir}']\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    result = cli(["-c", program], cwd=REPO_ROOT)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if failure == "interrupt":
        assert result.returncode == 130 and result.stderr == "interrupted: nothing written\n"
        assert not run_dir.exists()
    else:
        assert result.returncode == 1
        assert result.stderr == (
            "error: cannot write run/checkpoints/best.ckpt: No space left on device; free space or pass "
            "hydra.run.dir=<another folder>\n"
        )

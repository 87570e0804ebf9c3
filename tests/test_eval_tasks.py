"""The task evaluations (eval/copying.py, eval/recall.py on induction heads and MQAR's vocabulary
limit, eval/long_context.py, eval/perplexity.py) on tiny checkpoints trained for two steps on CPU,
their shared decode path and their checks of settings and checkpoints."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, compose_eval, compose_train, refuse_files_in
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import eval.copying as copying_module
import eval.long_context as long_context
import train as train_module
from data.synthetic import generated_to_predictions
from eval.cli import write_error_message
from eval.common import (
    decode_predictions,
    hydra_override,
    is_out_of_memory,
    load_checkpoint,
    wrong_task_error,
)
from eval.copying import copying_eval
from eval.long_context import long_context_eval
from eval.perplexity import perplexity_eval
from eval.recall import recall_eval
from eval.records import make_record
from models import LanguageModel
from models.checkpoint import WriteError, read_checkpoint
from models.lit import load_model

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=1",
    "logger=none",
]
SYNTHETIC = ["data.num_train_examples=32", "data.num_test_examples=4", "data.batch_size=16"]
PASSKEY_LEN = 280  # the passkey prompt without filler takes 253 bytes
FIELDS = {"run", "mixer", "layout", "params", "task", "metric", "value", "state_bytes", "seqlen", "slice",
          "path", "split", "checkpoint", "train_seqlen", "tokens_per_s", "device", "git_sha"}  # fmt: skip


def train_tiny(tmp_path_factory, name: str, overrides: list[str]) -> dict:
    run_dir = tmp_path_factory.mktemp(name)
    return train_module.train(compose_train(TINY + overrides + [f"run_dir={run_dir}"]))


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    data = ["data=copy", "data.max_len=6", "data.seqlen=16"]
    return train_tiny(tmp_path_factory, "copy", ["mixer=hybrid_samba"] + data + SYNTHETIC)


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    data = ["data=passkey", f"data.seqlen={PASSKEY_LEN}", f"data.test_configs=[{{seqlen:{PASSKEY_LEN}}}]"]
    return train_tiny(
        tmp_path_factory, "passkey", ["mixer=attention"] + data + SYNTHETIC[:2] + ["data.batch_size=4"]
    )


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text("to be, or not to be: that is the question.\n" * 40)
    data = ["data=text", f"data.path={corpus}", "data.tokenizer=byte", "data.seqlen=32", "data.batch_size=8"]
    return train_tiny(tmp_path_factory, "text", ["mixer=sliding_window"] + data)


def evaluate_with(fn, name: str, run: dict, tmp_path: Path, *overrides: str) -> tuple[list[dict], Path]:
    output = tmp_path / f"{name}.json"
    records = fn(
        compose_eval(name, [f"ckpt={run['last_ckpt']}", "device=cpu", f"output={output}", *overrides])
    )
    assert json.loads(output.read_text()) == records
    return records, output


def check_records(records: list[dict], task: str, accuracy_metrics: set[str]) -> dict:
    """Common record checks; returns {(metric, slice, path): record}."""
    model = load_model(records[0]["checkpoint"]).model
    table = {}
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["task"] == task and r["split"] == "test" and r["path"] in ("parallel", "decode")
        assert r["state_bytes"] == model.state_size(r["seqlen"]) > 0
        # the training settings, so the report groups a checkpoint kept outside its run directory
        assert (r["d_model"], r["n_layers"], r["lr"]) == (model.config.d_model, model.config.n_layers, 3e-3)
        assert isinstance(r["batch_size"], int) and r["batch_size"] >= 1
        if r["metric"] in accuracy_metrics:
            assert 0.0 <= r["value"] <= 1.0 and r["tokens_per_s"] > 0
        table[r["metric"], r["slice"], r["path"]] = r
    for metric, slice_name, path in list(table):
        assert (metric, slice_name, "decode" if path == "parallel" else "parallel") in table
    return table


# --- the decode path -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_model(copy_run):
    return load_model(copy_run["last_ckpt"]).model.double()


def test_decode_predictions_teacher_forced_equal_the_parallel_argmax(hybrid_model):
    ids = torch.randint(0, 30, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parallel = hybrid_model(ids).argmax(-1)
    decoded = decode_predictions(hybrid_model, ids, prefill_len=7)
    assert torch.equal(decoded, parallel)
    partial = decode_predictions(hybrid_model, ids, prefill_len=7, end=12)
    assert torch.equal(partial[:, :12], parallel[:, :12]) and (partial[:, 12:] == -1).all()


def test_decode_predictions_generate_from_each_prompt(hybrid_model):
    ids = torch.randint(0, 30, (3, 20), generator=torch.Generator().manual_seed(1))
    # One prompt length: exactly LanguageModel.generate(greedy=True), aligned with the labels.
    prompt = torch.full((3,), 8)
    decoded = decode_predictions(hybrid_model, ids, 8, free_from=prompt)
    generated = hybrid_model.generate(ids[:, :8], 12, greedy=True)
    assert torch.equal(decoded[:, 7:19], generated_to_predictions(generated, 20)[:, 7:19])
    # Prompts of different lengths in one batch: each sequence feeds its own predictions from its
    # prompt's end, which the parallel forward over the self-fed sequence must reproduce.
    prompt = torch.tensor([4, 9, 13])
    decoded = decode_predictions(hybrid_model, ids, 4, free_from=prompt)
    fed = ids.clone()
    for b, p in enumerate(prompt.tolist()):
        fed[b, p:] = decoded[b, p - 1 : -1]
    with torch.no_grad():
        assert torch.equal(decoded, hybrid_model(fed).argmax(-1))
    assert not torch.equal(fed, ids)  # the untrained model does not reproduce the data
    with pytest.raises(ValueError, match="free_from must not start before prefill_len"):
        decode_predictions(hybrid_model, ids, 5, free_from=prompt)
    with pytest.raises(ValueError, match="prefill_len"):
        decode_predictions(hybrid_model, ids, 0)


def test_is_out_of_memory():
    with pytest.raises(RuntimeError) as err:
        torch.empty(2**60, dtype=torch.uint8)  # PyTorch's CPU allocator refuses at once
    assert is_out_of_memory(err.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))


def test_records_name_zambas_shared_block():
    # The layout lists the backbone only: Zamba's shared attention block showed as "mamba x8".
    records = {}
    for mixer in ("hybrid_zamba", "mamba"):
        cfg = compose_train([f"mixer={mixer}", "model.d_model=32", "model.n_layers=6"])
        model = LanguageModel(train_module.build_model_config(cfg, 37))
        records[mixer] = make_record(run="r", model=model, task="mqar", metric="acc", value=1.0)
    every = compose_train(["mixer=hybrid_zamba"]).mixer.shared_block.every
    assert records["hybrid_zamba"]["shared_block"] == {"mixer": "attention", "every": every}
    assert records["hybrid_zamba"]["layout"] == ["mamba"] * 6 and records["mamba"]["shared_block"] is None


# --- eval/copying.py -----------------------------------------------------------------------------


def test_copying_eval_on_copy(copy_run, tmp_path, capsys):
    records, _ = evaluate_with(copying_eval, "copying", copy_run, tmp_path, "num_examples=6", "batch_size=4")
    table = check_records(records, "copy", {"accuracy", "char_accuracy"})
    # The data module's slices: the training range and strings 2x and 4x longer than training's.
    assert {s for _, s, _ in table} == {"len1-6", "len7-12", "len13-24"}
    assert {r["seqlen"] for r in records} == {16, 27, 51} and all(r["train_seqlen"] == 16 for r in records)
    assert {r["metric"] for r in records} == {"accuracy", "char_accuracy"}
    for slice_name in ("len1-6", "len7-12", "len13-24"):
        # Greedy generation is exactly right iff every teacher-forced prediction is.
        assert (
            table["accuracy", slice_name, "parallel"]["value"]
            == table["accuracy", slice_name, "decode"]["value"]
        )
        assert table["accuracy", slice_name, "decode"]["examples"] == 6
    assert table["accuracy", "len13-24", "decode"]["max_len"] == 24
    printed = capsys.readouterr().out
    assert "len13-24" in printed and "char_accuracy decode" in printed
    assert "accuracy = the whole string right" in printed


def test_copying_eval_test_lengths_override_and_default_output(copy_run):
    overrides = [f"ckpt={copy_run['last_ckpt']}", "device=cpu", "num_examples=2", "decode_paths=[decode]",
                 "test_configs=[{min_len:25,max_len:30}]"]  # fmt: skip
    records = copying_eval(compose_eval("copying", overrides))
    assert {(r["slice"], r["seqlen"], r["path"]) for r in records} == {("len25-30", 63, "decode")}
    assert json.loads(Path(copy_run["last_ckpt"] + ".copying.json").read_text()) == records
    with pytest.raises(ValueError, match="max_len"):
        copying_eval(compose_eval("copying", overrides[:-1] + ["test_configs=[{min_len:9,max_len:3}]"]))
    with pytest.raises(ValueError, match=r"test_configs must be a list of slice configs, e.g. .*got 5"):
        copying_eval(compose_eval("copying", overrides[:-1] + ["test_configs=5"]))
    with pytest.raises(ValueError, match=r"^test_configs is empty: give at least one slice, e.g. "):
        copying_eval(compose_eval("copying", overrides[:-1] + ["test_configs=[]"]))


def test_checkpoints_kept_outside_a_run_folder_are_runs_of_their_own(copy_run, tmp_path):
    """A new-user check: /tmp/ck/att.ckpt and /tmp/ck/mam.ckpt were both recorded as run "tmp" (the
    checkpoint's grandparent), which the report merged into one run, and /tmp/top.ckpt as run "".
    A checkpoint outside a checkpoints/ folder is now the run named by its file."""
    loose = tmp_path / "ck"
    loose.mkdir()
    runs = {}
    for name in ("att", "mam"):
        shutil.copy(copy_run["last_ckpt"], loose / f"{name}.ckpt")
        ctx = load_checkpoint(loose / f"{name}.ckpt", torch.device("cpu"), None, "eval/copying.py")
        runs[name] = (ctx.run, ctx.run_dir)
    assert runs == {"att": ("att", loose), "mam": ("mam", loose)}
    # train.py's layout: <run_dir>/checkpoints/last.ckpt
    ctx = load_checkpoint(copy_run["last_ckpt"], torch.device("cpu"), None, "eval/copying.py")
    assert ctx.run_dir == Path(copy_run["last_ckpt"]).parents[1] and ctx.run == ctx.run_dir.name


def test_copying_eval_checks_a_learned_position_table_first(copy_run, monkeypatch):
    # A review found the eval failing mid-way, after some slices, with a hint to rebuild the mixer.
    # (copy_run's model uses RoPE: a 62-row table is posed; the 63-token examples need 63 rows.)
    monkeypatch.setattr(LanguageModel, "position_limit", lambda self: ("attention", 62))
    monkeypatch.setattr(copying_module, "evaluate", lambda *a, **k: pytest.fail("evaluated before the check"))
    overrides = [f"ckpt={copy_run['last_ckpt']}", "device=cpu", "num_examples=2",
                 "test_configs=[{min_len:25,max_len:30}]"]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"max_position=62 rows, but the longest test sequence has 63 tokens; lower test_configs",
    ):
        copying_eval(compose_eval("copying", overrides))


def test_default_output_that_is_a_directory_is_refused_before_evaluating(
    copy_run, passkey_run, tmp_path, monkeypatch
):
    def copy_of(run, name):
        ckpt = tmp_path / name
        ckpt.write_bytes(Path(run["last_ckpt"]).read_bytes())
        return ckpt

    def no_data(*args, **kwargs):
        pytest.fail("the evaluation started before the output check")

    monkeypatch.setattr(copying_module, "build_datamodule", no_data)
    monkeypatch.setattr(long_context, "build_datamodule", no_data)
    ckpt = copy_of(copy_run, "copy.ckpt")
    (tmp_path / "copy.ckpt.copying.json").mkdir()
    with pytest.raises(
        ValueError, match=r"default output .*copy\.ckpt\.copying\.json is a directory.*output="
    ):
        copying_eval(compose_eval("copying", [f"ckpt={ckpt}", "device=cpu"]))
    ckpt = copy_of(passkey_run, "passkey.ckpt")
    (tmp_path / "passkey.ckpt.long_context.multikey_needle.json").mkdir()
    with pytest.raises(
        ValueError,
        match=r"passkey\.ckpt\.long_context\.multikey_needle\.json is a directory.*output=.*/long_context\.multikey_needle\.json\)",
    ):
        long_context_eval(
            compose_eval("long_context", [f"ckpt={ckpt}", "device=cpu", "task=multikey_needle"])
        )


def test_copying_eval_on_selective_copying(tmp_path_factory, tmp_path, capsys):
    data = ["data=selective_copying", "data.seqlen=16", "data.num_data_tokens=4"]
    run = train_tiny(tmp_path_factory, "selective", ["mixer=mamba"] + data + SYNTHETIC)
    records, _ = evaluate_with(copying_eval, "copying", run, tmp_path, "num_examples=4")
    assert "accuracy = every data token right" in capsys.readouterr().out
    table = check_records(records, "selective_copying", {"accuracy", "char_accuracy"})
    assert {s for _, s, _ in table} == {"T16_data4", "T32_data4", "T64_data4"}
    # The markers are inputs, never the model's outputs: both paths compute the same predictions.
    for (metric, slice_name, _), r in table.items():
        assert r["value"] == table[metric, slice_name, "parallel"]["value"]
        assert r["num_data_tokens"] == 4


# --- eval/recall.py on induction heads -----------------------------------------------------------


def test_recall_eval_on_induction_heads(tmp_path_factory, tmp_path, capsys):
    run = train_tiny(tmp_path_factory, "induction", ["mixer=linear_attention", "data=induction_heads",
                                                     "data.seqlen=16"] + SYNTHETIC)  # fmt: skip
    records, _ = evaluate_with(recall_eval, "recall", run, tmp_path, "num_examples=8", "batch_size=8")
    table = check_records(records, "induction_heads", {"accuracy"})
    assert {(s, r["seqlen"]) for (_, s, _), r in table.items()} == {("T16", 16), ("T32", 32), ("T64", 64)}
    for (_, slice_name, _), r in table.items():
        assert r["value"] == table["accuracy", slice_name, "parallel"]["value"]
        assert r["scored_positions"] == 8  # one answer per example
    assert "induction-heads accuracy" in capsys.readouterr().out
    # Absolute lengths, shorter than the training length too (the Mamba paper tests from 2^6).
    records, _ = evaluate_with(recall_eval, "recall", run, tmp_path, "num_examples=8", "batch_size=8",
                               "seqlens=[8,24]", "decode_paths=[parallel]")  # fmt: skip
    assert sorted((r["slice"], r["seqlen"]) for r in records) == [("T24", 24), ("T8", 8)]
    with pytest.raises(ValueError, match=r"seqlens must be a list of integers >= 1"):
        evaluate_with(recall_eval, "recall", run, tmp_path, "seqlens=[0]")
    # A single number, not a list: the message shows the list that was meant. seqlens and
    # length_multipliers both given: refused (seqlens replaces the multipliers), not half ignored.
    for overrides, message in [
        (["seqlens=64"], "seqlens must be a list of integers >= 1, got 64; write seqlens=[64]"),
        (["length_multipliers=2"], "length_multipliers must be a list of integers >= 1, got 2; write "
                                   "length_multipliers=[2]"),
        (["seqlens=[64]", "length_multipliers=[1,2]"], "not both: seqlens=[64] sets the test lengths itself, so "
                                                       "length_multipliers=[1, 2] would be ignored"),
        # Found by a new-user check: these named the data module's test_configs, not the option given.
        (["seqlens=[8,2]"], "seqlens gives the length 2, which the induction_heads task refuses: seqlen must "
                            "be >= 3 (trigger, answer, trigger), got 2"),
        (["length_multipliers=[1,1]"], "length_multipliers lists a value twice: [1, 1]; give each value "
                                       "once"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            evaluate_with(recall_eval, "recall", run, tmp_path, *overrides)


def test_recall_eval_mqar_vocabulary_limit_suggests_multipliers_that_fit(tmp_path_factory, tmp_path):
    """A vocabulary of 200 at seqlen 64 holds 1x and 2x but not the default's 4x: the error's
    example must be one that works (it once suggested the failing default, [1,2,4])."""
    data = ["data=mqar", "data.vocab_size=200", "data.seqlen=64", "data.num_kv_pairs=4",
            "data.test_configs=[{seqlen:64,num_kv_pairs:4}]"]  # fmt: skip
    run = train_tiny(tmp_path_factory, "mqar", ["mixer=attention"] + data + SYNTHETIC)
    with pytest.raises(ValueError, match=r"length_multipliers \[4\] give seqlens.*below 4") as info:
        evaluate_with(recall_eval, "recall", run, tmp_path)  # the default multipliers, 1x, 2x and 4x
    example = re.search(r"e\.g\. (length_multipliers=\[[0-9,]+\])", str(info.value)).group(1)
    assert example == "length_multipliers=[1,2]"
    records, _ = evaluate_with(
        recall_eval, "recall", run, tmp_path, example, "num_examples=4", "batch_size=4"
    )
    assert {(r["slice"], r["num_kv_pairs"]) for r in records} == {("T64_kv4", 4), ("T128_kv8", 8)}
    with pytest.raises(ValueError, match=r"length_multipliers \[8\].*e\.g\. length_multipliers=\[1,3\]\)"):
        evaluate_with(recall_eval, "recall", run, tmp_path, "length_multipliers=[1,3,8]")


# --- eval/long_context.py ------------------------------------------------------------------------


def test_long_context_eval_on_passkey(passkey_run, tmp_path):
    records, _ = evaluate_with(long_context_eval, "long_context", passkey_run, tmp_path, "length_multipliers=[1,2]",
                               "num_examples=2", "batch_size=2", "num_depth_buckets=2")  # fmt: skip
    table = check_records(records, "passkey", {"accuracy", "exact_match"})
    cells = {s for m, s, _ in table if m == "exact_match"}
    assert cells == {f"T{n}_depth{d}" for n in (280, 560) for d in ("0-50", "50-100")}
    assert {s for m, s, _ in table if m == "accuracy"} == {"T280", "T560"}
    assert table["accuracy", "T560", "decode"]["length_multiplier"] == 2.0
    assert table["exact_match", "T560_depth50-100", "parallel"]["depth_min"] == 0.5
    for (metric, slice_name, _), r in table.items():
        assert r["value"] == table[metric, slice_name, "parallel"]["value"]  # exact match agrees
        assert r["examples"] == (2 if metric == "exact_match" else 4)


def test_long_context_default_output_names_a_task_other_than_the_checkpoints(passkey_run):
    """The checkpoint's own task writes <ckpt>.long_context.json (as before); another task writes
    <ckpt>.long_context.<task>.json instead of replacing those results."""
    ckpt = Path(passkey_run["last_ckpt"])
    overrides = [f"ckpt={ckpt}", "device=cpu", "length_multipliers=[1]", "num_examples=1",
                 "num_depth_buckets=1"]  # fmt: skip
    own = long_context_eval(compose_eval("long_context", overrides))
    other = long_context_eval(compose_eval("long_context", overrides + ["task=multikey_needle"]))
    assert {r["task"] for r in own} == {"passkey"} and {r["task"] for r in other} == {"multikey_needle"}
    assert json.loads(ckpt.with_name(f"{ckpt.name}.long_context.json").read_text()) == own
    assert json.loads(ckpt.with_name(f"{ckpt.name}.long_context.multikey_needle.json").read_text()) == other


def test_long_context_skips_lengths_that_run_out_of_memory(passkey_run, tmp_path, monkeypatch, capsys):
    evaluate = long_context.evaluate

    def limited(model, loader, path, *args):
        seqlen = loader.dataset.seqlen
        if seqlen > 2 * PASSKEY_LEN or (seqlen > PASSKEY_LEN and path == "decode"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return evaluate(model, loader, path, *args)

    monkeypatch.setattr(long_context, "evaluate", limited)
    records, _ = evaluate_with(long_context_eval, "long_context", passkey_run, tmp_path, "length_multipliers=[1,2,4]",
                               "num_examples=1", "num_depth_buckets=1")  # fmt: skip
    skipped = {(r["seqlen"], r["path"]): r for r in records if r["metric"] == "skipped"}
    assert set(skipped) == {(560, "decode"), (1120, "parallel"), (1120, "decode")}  # the sweep went on
    assert all("out of memory" in r["reason"] and r["value"] == 1 for r in skipped.values())
    measured = {(r["seqlen"], r["path"]) for r in records if r["metric"] == "accuracy"}
    assert measured == {(280, "parallel"), (280, "decode"), (560, "parallel")}
    assert "skipped" in capsys.readouterr().out

    def broken(*args):
        raise RuntimeError("shape mismatch")  # not a memory error: it must surface

    monkeypatch.setattr(long_context, "evaluate", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        evaluate_with(long_context_eval, "long_context", passkey_run, tmp_path, "length_multipliers=[1]")


def test_long_context_keeps_the_lengths_done_when_a_later_one_stops_the_run(
    passkey_run, tmp_path, monkeypatch, capsys
):
    """The file is rewritten after each length, so a run stopped at the second (here by an error; on
    CPU the system may kill it out of memory) keeps the first one's records, marked partial; a run
    that finishes replaces them with unmarked records, saying so once."""
    evaluate = long_context.evaluate

    def stopped_at_560(model, loader, path, *args):
        if loader.dataset.seqlen == 2 * PASSKEY_LEN:
            raise RuntimeError("killed")
        return evaluate(model, loader, path, *args)

    overrides = ["length_multipliers=[1,2]", "num_examples=1", "num_depth_buckets=1"]
    monkeypatch.setattr(long_context, "evaluate", stopped_at_560)
    with pytest.raises(RuntimeError, match="killed"):
        evaluate_with(long_context_eval, "long_context", passkey_run, tmp_path, *overrides)
    kept = json.loads((tmp_path / "long_context.json").read_text())
    assert sorted((r["metric"], r["path"]) for r in kept) == [
        ("accuracy", "decode"), ("accuracy", "parallel"), ("exact_match", "decode"), ("exact_match", "parallel"),
    ]  # fmt: skip
    assert {r["seqlen"] for r in kept} == {PASSKEY_LEN}
    assert all(r["partial"] == {"seqlens_done": [280], "seqlens_planned": [280, 560]} for r in kept)

    monkeypatch.setattr(long_context, "evaluate", evaluate)
    capsys.readouterr()
    records, output = evaluate_with(long_context_eval, "long_context", passkey_run, tmp_path, *overrides)
    assert {r["seqlen"] for r in records} == {280, 560} and not any("partial" in r for r in records)
    assert capsys.readouterr().out.count(f"replacing the earlier results in {output}") == 1


def test_long_context_on_byte_level_text(text_run, tmp_path):
    records, _ = evaluate_with(long_context_eval, "long_context", text_run, tmp_path, "task=multikey_needle",
                               "seqlens=[128]", "num_examples=1", "num_depth_buckets=1")  # fmt: skip
    assert {(r["task"], r["seqlen"], r["metric"]) for r in records} >= {("multikey_needle", 128, "accuracy")}
    assert all(r["train_seqlen"] == 32 and r["length_multiplier"] == 4.0 for r in records)
    with pytest.raises(ValueError, match="pass task=passkey or task=multikey_needle"):
        evaluate_with(long_context_eval, "long_context", text_run, tmp_path)
    with pytest.raises(ValueError, match=r"from length_multipliers\) x num_depth_buckets=4 do not fit"):
        evaluate_with(long_context_eval, "long_context", text_run, tmp_path, "task=passkey")  # 32 bytes
    # A cell is named by its length and depths (a new-user check read "test_configs[1]" as an index
    # into the lengths): at 255 bytes the second quarter's needle does not fit (test_configs[1]).
    message = (
        r"do not fit the passkey task: the length 255 at depths \[0.25, 0.5\): seqlen=255 is too "
        r"short .*take 253 bytes \(the task's seqlen is each length\); give lengths of at least 257 "
        r"tokens \(e.g. seqlens=\[257\]\), or lower num_depth_buckets$"
    )
    with pytest.raises(ValueError, match=message):
        evaluate_with(long_context_eval, "long_context", text_run, tmp_path, "task=passkey",
                      "seqlens=[512,255]")  # fmt: skip
    cells = r"1 length \(from seqlens\) x num_depth_buckets=600 make 600 cells, more than the 498 test slices"
    with pytest.raises(ValueError, match=cells):
        evaluate_with(long_context_eval, "long_context", text_run, tmp_path, "task=passkey", "seqlens=[512]",
                      "num_depth_buckets=600")  # fmt: skip


@pytest.mark.parametrize(
    ("task", "overrides"),
    [("passkey", ["length_multipliers=[1]"]), ("multikey_needle", ["seqlens=[100]", "num_depth_buckets=3"])],
)
def test_long_context_advised_length_is_accepted(text_run, tmp_path, task, overrides):
    """The length the message advises passes every depth range's check (a new-user check was told
    254, the whole context's minimum, then refused 254 for a quarter of it: use seqlen >= 257)."""
    with pytest.raises(ValueError, match=r"give lengths of at least (\d+) tokens") as refused:
        evaluate_with(long_context_eval, "long_context", text_run, tmp_path, f"task={task}", *overrides)
    advised = int(re.search(r"at least (\d+) tokens", str(refused.value)).group(1))
    assert "use seqlen >=" not in str(refused.value)  # one piece of advice, not two that disagree
    buckets = [o for o in overrides if o.startswith("num_depth_buckets")]
    records, _ = evaluate_with(long_context_eval, "long_context", text_run, tmp_path, f"task={task}",
                               f"seqlens=[{advised}]", "num_examples=1", "decode_paths=[parallel]",
                               *buckets)  # fmt: skip
    assert {r["seqlen"] for r in records} == {advised}


# --- eval/perplexity.py --------------------------------------------------------------------------


def test_perplexity_eval(text_run, tmp_path):
    records, _ = evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=16")
    by_key = {(r["metric"], r["slice"], r["path"]): r for r in records}
    loss = by_key["loss", "val", "parallel"]["value"]
    # The held-out loss is the one train.py's final validation reported for that checkpoint.
    assert loss == pytest.approx(text_run["metrics"]["val/loss"], rel=1e-5)
    assert by_key["perplexity", "val", "parallel"]["value"] == pytest.approx(math.exp(loss))
    assert all(r["split"] == "val" and r["task"] == "text" and r["state_bytes"] > 0 for r in records)
    parallel, decode = by_key["loss", "val_prefix16", "parallel"], by_key["loss", "val_prefix16", "decode"]
    assert decode["agrees"] and decode["abs_diff"] < 1e-4 and decode["seqlen"] == 16
    assert decode["value"] == pytest.approx(parallel["value"], abs=1e-4)
    with pytest.raises(ValueError, match="tolerance must be a number >= 0 \\(nats\\), got 'abc'"):
        evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "tolerance=abc")
    # one token would be all prefill: a decode check that ran no decode step was recorded as agreeing
    with pytest.raises(ValueError, match=r"decode_prefix=1 leaves no token for a decode step: give 0"):
        evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=1")
    # decode_examples above batch_size: the check reads as many batches as it takes
    records, _ = evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=16",
                               "batch_size=2", "decode_examples=3", "max_batches=1")  # fmt: skip
    decode = next(r for r in records if r["path"] == "decode")
    assert decode["tokens"] == 3 * 16 and decode["agrees"]


def test_perplexity_on_another_corpus_and_length(text_run, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("all the world's a stage, and all the men and women merely players.\n" * 30)
    records, _ = evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, f"data.path={other}",
                               "data.seqlen=64", "decode_prefix=0", "max_batches=1")  # fmt: skip
    assert [(r["metric"], r["seqlen"]) for r in records] == [("loss", 64), ("perplexity", 64)]
    assert records[0]["tokens"] <= 8 * 64  # one batch of blocks
    # A part of the split is said to be one (a new-user check: it was printed as the split's loss).
    printed = capsys.readouterr().out
    assert "evaluating the first 1 batches of the validation split (" in printed
    assert f"val (first 1 batches, {records[0]['tokens']} tokens)" in printed
    assert all(r["corpus"] == str(other) and r["max_batches"] == 1 for r in records)
    with pytest.raises(FileNotFoundError, match="text corpus file not found"):
        evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, f"data.path={tmp_path / 'nope.txt'}")
    # The stored tokenizer replaced an override without a word.
    with pytest.raises(ValueError, match=r"data.tokenizer='char': the checkpoint's tokenizer \(byte\)"):
        evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "+data.tokenizer=char")
    # A carried new-user note: a hub dataset's split beside a local file was ignored without a word.
    with pytest.raises(
        ValueError, match=r"^data.split='test' is read from a hub dataset \(dataset_name\) only"
    ):
        evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "data.split=test")
    # A new-user check: +data.train_fraction=0.5 scored training text as held-out; +data.batch_size and
    # +data.seed were ignored without a word.
    for override, reason in [
        ("+data.train_fraction=0.5", "the held-out split is the part of the corpus the checkpoint did not"),
        ("+data.batch_size=0", "give batch_size=<n>"),
        ("+data.seed=5", "the validation split is read in order"),
    ]:
        message = f"{override[1:].split('=')[0]}: eval/perplexity.py takes no such setting: {reason}"
        with pytest.raises(ValueError, match=re.escape(message)):
            evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, override)


def test_perplexity_refuses_the_training_corpus_edited_since(text_run, tmp_path):
    """A new-user check: the corpus reversed in place was evaluated without a word (exit 0), its
    "held-out" last 10% then text the model trained on. The checkpoint stores the corpus' SHA-256."""
    corpus = Path(read_checkpoint(text_run["last_ckpt"])["hyper_parameters"]["data"]["path"])
    text = corpus.read_text()
    records, _ = evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=0")
    assert {r["corpus_sha256"] for r in records} == {hashlib.sha256(text.encode()).hexdigest()}
    try:
        corpus.write_text(text[::-1])  # the same characters, another text
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"the checkpoint's corpus {str(corpus)!r} has changed since training (its SHA-256 begins "
            ),
        ):
            evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=0")
        # Named on purpose, another text is evaluated (and recorded with its own digest).
        records, _ = evaluate_with(
            perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=0", f"data.path={corpus}"
        )
        assert records[0]["corpus_sha256"] != hashlib.sha256(text.encode()).hexdigest()
        # Moved away: said to be the checkpoint's corpus, with how to give its new path (a new-user
        # check: "set data.path to a text file" read as if none were set).
        corpus.rename(corpus.with_suffix(".moved"))
        with pytest.raises(FileNotFoundError, match=re.escape(
            f"the checkpoint's training corpus is not found (text corpus file not found: {str(corpus)!r}); if "
            "it moved, pass data.path=<its new path> (its SHA-256 must match the checkpoint's)"
        )):  # fmt: skip
            evaluate_with(perplexity_eval, "perplexity", text_run, tmp_path, "decode_prefix=0")
        corpus.with_suffix(".moved").rename(corpus)
    finally:
        corpus.write_text(text)


def test_perplexity_names_a_character_the_checkpoints_tokenizer_lacks(tmp_path_factory, tmp_path):
    """A new-user check: a character new to a char-tokenized checkpoint was reported at its index in
    the validation part (0 for the corpus' last character) with advice to use tokenizer='byte', which
    an evaluation of that checkpoint cannot take."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be, or not to be: that is the question.\n" * 40)
    data = ["data=text", f"data.path={corpus}", "data.seqlen=32", "data.batch_size=8"]
    run = train_tiny(tmp_path_factory, "text_char", ["mixer=attention", *data])
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text() + "\u00a7")
    index = len(other.read_text()) - 1
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"character '\u00a7' (U+00A7) at index {index} of the corpus is not in the checkpoint's tokenizer "
            "(17 characters, which its model was trained on); evaluate on a text written in those characters"
        ),
    ):
        evaluate_with(perplexity_eval, "perplexity", run, tmp_path, f"data.path={other}")


# --- bad input -----------------------------------------------------------------------------------


def test_checkpoints_of_another_task_are_refused(copy_run, passkey_run, text_run):
    def run(fn, name, ckpt):
        fn(compose_eval(name, [f"ckpt={ckpt}", "device=cpu"]))

    with pytest.raises(ValueError, match=r"'copy' data.*mqar, induction_heads.*eval/copying\.py"):
        run(recall_eval, "recall", copy_run["last_ckpt"])
    with pytest.raises(ValueError, match=r"'passkey' data.*copy, selective_copying.*eval/long_context\.py"):
        run(copying_eval, "copying", passkey_run["last_ckpt"])
    with pytest.raises(ValueError, match=r"'copy' data.*passkey, multikey_needle.*eval/copying\.py"):
        run(long_context_eval, "long_context", copy_run["last_ckpt"])
    with pytest.raises(ValueError, match=r"'text' data.*eval/perplexity\.py"):
        run(copying_eval, "copying", text_run["last_ckpt"])
    with pytest.raises(ValueError, match=r"'passkey' data.*text.*eval/long_context\.py"):
        run(perplexity_eval, "perplexity", passkey_run["last_ckpt"])
    message = str(wrong_task_error(Path("x.ckpt"), None, "eval/recall.py", ("mqar", "induction_heads")))
    assert "None" in message and "mqar, induction_heads" in message and "evaluate it with" not in message
    # A path Hydra's override grammar would reject unquoted gets a quoted override in the hint.
    odd = Path("runs/lr=1e-3,b=8/best.ckpt")
    message = str(wrong_task_error(odd, "copy", "eval/recall.py", ("mqar",)))
    assert message.endswith("evaluate it with python eval/copying.py " + f"\"ckpt='{odd}'\"")
    assert str(wrong_task_error(Path("a/b.ckpt"), "copy", "eval/recall.py", ("mqar",))).endswith(
        "evaluate it with python eval/copying.py ckpt=a/b.ckpt"
    )


def test_hydra_override_round_trips_through_the_shell_and_hydra():
    """The commands printed in messages work when pasted: one shell word, parsed back by Hydra and
    resolved by OmegaConf to the same path, whatever the path holds (a new user's findings: a
    folder named ``${x}`` was interpolated, ``!``, a trailing backslash and a leading ``~`` broke)."""
    parser = OverridesParser.create()
    paths = ["a/b.ckpt", "runs/lr=1e-3,b=8/best.ckpt", "x [1]/y.ckpt", "it's/lr=1/b.ckpt", 'q"uo/t.ckpt',
             "a$b/c.ckpt", "back\\slash/x.ckpt", "c:d/x", "~/x y/z", "d${x}/best.ckpt", "e\\${y}/z",
             "a!b/x.ckpt", "trail\\", "back\\'quote", "~/x"]  # fmt: skip
    for path in paths:
        words = shlex.split(hydra_override("ckpt", path))
        assert len(words) == 1, (path, words)
        override = parser.parse_override(words[0])
        assert override.key_or_group == "ckpt"
        assert OmegaConf.create({"ckpt": override.value()}).ckpt == path, (path, words[0])
    assert hydra_override("ckpt", "a/b.ckpt") == "ckpt=a/b.ckpt"


@pytest.mark.parametrize("name", ["recall", "copying", "long_context", "perplexity"])
def test_missing_corrupt_checkpoints_and_bad_settings(name, tmp_path):
    fn = {"recall": recall_eval, "copying": copying_eval, "long_context": long_context_eval,
          "perplexity": perplexity_eval}[name]  # fmt: skip
    with pytest.raises(ValueError, match="no checkpoint given"):
        fn(compose_eval(name, []))
    with pytest.raises(
        ValueError, match=r"ckpt must be one checkpoint path, got \[1, 2\]; evaluate several with -m"
    ):
        fn(compose_eval(name, ["ckpt=[1,2]"]))
    # One value Hydra reads as a number (a new-user check: it was told to evaluate several with -m).
    number = "ckpt must be one checkpoint path, got 123; give the .ckpt file's path (a path Hydra reads as"
    with pytest.raises(ValueError, match=re.escape(number) + r".*quote it, \"ckpt='123'\"\)$"):
        fn(compose_eval(name, ["ckpt=123"]))
    with pytest.raises(ValueError, match=r"got 0; give the .ckpt file's path .*quote it, \"ckpt='0'\"\)$"):
        fn(compose_eval(name, ["ckpt=0"]))  # a file named 0: it was "no checkpoint given"
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        fn(compose_eval(name, [f"ckpt={tmp_path / 'nope.ckpt'}"]))
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 not a checkpoint")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fn(compose_eval(name, [f"ckpt={corrupt}"]))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        fn(compose_eval(name, [f"ckpt={corrupt}", "batch_size=0"]))
    # output= is checked before the checkpoint is read (here: before the corrupt one fails), so a bad
    # one never costs a whole evaluation: a directory, or a path under a file.
    message = f"output={tmp_path} is a directory; give a file path such as output={tmp_path / name}.json"
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(compose_eval(name, [f"ckpt={corrupt}", f"output={tmp_path}"]))
    with pytest.raises(ValueError, match=r"lies under .*corrupt\.ckpt, which is a file, not a directory"):
        fn(compose_eval(name, [f"ckpt={corrupt}", f"output={corrupt / 'sub' / 'results.json'}"]))
    if name != "perplexity":
        choices = "choose from [parallel, decode]"
        for paths, message in [
            ("[parallel,beam]", f"unknown decode_paths ['beam']; {choices}"),
            ("[]", f"decode_paths is empty: give at least one path; {choices}"),
            ("decode", "decode_paths must be a list, got 'decode'; write decode_paths=[decode]"),
            ("[parallel,parallel]", "decode_paths lists a path twice: ['parallel', 'parallel']"),
        ]:
            with pytest.raises(ValueError, match=re.escape(message)):
                fn(compose_eval(name, [f"ckpt={corrupt}", f"decode_paths={paths}"]))


def test_long_context_rejects_bad_lengths_and_task(passkey_run):
    ckpt = f"ckpt={passkey_run['last_ckpt']}"
    with pytest.raises(ValueError, match="length_multipliers must be a list of integers >= 1"):
        long_context_eval(compose_eval("long_context", [ckpt, "length_multipliers=[0]"]))
    for overrides, message in [
        (["length_multipliers=4"], "length_multipliers must be a list of integers >= 1, got 4; write "
                                   "length_multipliers=[4]"),
        (["seqlens=512"], "seqlens must be a list of integers >= 1, got 512; write seqlens=[512]"),
        (["seqlens=[512]", "length_multipliers=[1,2]"], "give seqlens or length_multipliers, not both"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            long_context_eval(compose_eval("long_context", [ckpt, *overrides]))
    with pytest.raises(ValueError, match="num_depth_buckets must be null or an integer >= 1"):
        long_context_eval(compose_eval("long_context", [ckpt, "num_depth_buckets=0"]))
    # More cells than test slices (a new-user check: the data module's message advised longer lengths).
    too_many = (
        "eval/long_context.py: 5 lengths (the default length_multipliers=[1, 2, 4, 8, 16]) x "
        "num_depth_buckets=200 make 1000 cells, more than the 498 test slices a task holds; lower "
        "num_depth_buckets or give fewer lengths"
    )
    with pytest.raises(ValueError, match="^" + re.escape(too_many) + "$"):
        long_context_eval(compose_eval("long_context", [ckpt, "num_depth_buckets=200"]))
    with pytest.raises(ValueError, match="task must be auto, passkey or multikey_needle"):
        long_context_eval(compose_eval("long_context", [ckpt, "task=mqar"]))


def test_a_sweep_checks_every_checkpoint_before_the_first_job(copy_run, passkey_run, tmp_path):
    """A new-user check: ``-m ckpt=good,truncated,good2`` evaluated the first, stopped at the second
    with status 2, and never said that the third was not evaluated. Each job's checkpoint (and, in
    long_context, its task) is now read before any job runs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    good = tmp_path / "run" / "checkpoints" / "last.ckpt"
    good.parent.mkdir(parents=True)
    shutil.copy(copy_run["last_ckpt"], good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:1000])
    unreadable = f"error: the sweep's job with ckpt={truncated}: could not read checkpoint "
    wrong_task = f"error: the sweep's job with ckpt={good}: {good} was trained on 'copy' data, which "
    for script, ckpts, message in [
        ("copying.py", [good, truncated], unreadable),
        ("long_context.py", [passkey_run["last_ckpt"], good], wrong_task + "eval/long_context.py does not"),
    ]:
        args = [str(REPO_ROOT / "eval" / script), "-m", f"ckpt={','.join(map(str, ckpts))}", "device=cpu"]
        result = subprocess.run(
            [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.startswith(message), result.stderr[-3000:]
        assert "results:" not in result.stdout and not list(tmp_path.rglob("*.json")), result.stdout
    # One output= file for two checkpoints: refused before the first job too (it was written by the
    # first job, then the second stopped: a new-user check).
    again = tmp_path / "again.ckpt"
    shutil.copy(good, again)
    shared = tmp_path / "shared.json"
    args = [
        str(REPO_ROOT / "eval" / "copying.py"),
        "-m",
        f"ckpt={good},{again}",
        f"output={shared}",
        "device=cpu",
    ]
    result = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"error: the sweep's job with ckpt={again}: output={shared} would be written by the job with ckpt={good} too"
    ), result.stderr[-3000:]
    assert not shared.exists()


def test_a_sweep_checks_every_jobs_settings_and_default_output_before_the_first_job(copy_run, tmp_path):
    """A new-user check: ``-m num_examples=20,abc`` and ``-m num_examples=20,30`` (both jobs writing
    ``<checkpoint>.copying.json``) ran and wrote the first job, then refused the second."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    shutil.copy(copy_run["last_ckpt"], ckpt)
    default = ckpt.with_name("last.ckpt.copying.json")
    per_job = f"{ckpt.parent}/last.ckpt.copying-${{hydra:job.num}}.json"
    for sweep, message in (
        ("num_examples=2,abc", "the sweep's job with num_examples=abc: num_examples must be an integer >= 1, "
                               "got 'abc'"),
        ("num_examples=2,3", f"the sweep's job with num_examples=3: the default output {default} would be "
                             "written by the job with num_examples=2 too: each job would replace the one "
                             f"before it; give each job its own file, e.g. output='{per_job}'"),
    ):  # fmt: skip
        args = [str(REPO_ROOT / "eval" / "copying.py"), "-m", f"ckpt={ckpt}", sweep, "device=cpu"]
        result = subprocess.run(
            [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2 and result.stderr == f"error: {message}\n", result.stderr[-3000:]
        assert "results:" not in result.stdout and not list(tmp_path.rglob("*.json")), result.stdout


def test_the_sweep_check_reads_a_checkpoint_shared_by_consecutive_jobs_once(monkeypatch):
    import eval.common as common

    reads = []
    monkeypatch.setattr(common, "load_checkpoint", lambda ckpt, *args: reads.append(ckpt) or ckpt)
    tasks_seen = []
    check_job = common.checkpoint_sweep_check(
        None, "eval/long_context.py", lambda ctx, cfg: tasks_seen.append(cfg.task)
    )
    jobs = [("a.ckpt", "passkey"), ("a.ckpt", "multikey_needle"), ("b.ckpt", "passkey"), ("a.ckpt", "x")]
    for ckpt, task in jobs:
        check_job(OmegaConf.create({"ckpt": ckpt, "task": task}))
    check_job(OmegaConf.create({"ckpt": None, "task": "passkey"}))  # left to the job's own check
    assert reads == ["a.ckpt", "b.ckpt", "a.ckpt"]
    assert tasks_seen == ["passkey", "multikey_needle", "passkey", "x"]


def test_a_checkpoint_path_hydra_reads_as_a_number_is_quoted_as_typed(tmp_path):
    """A second new-user check: ckpt=1e3 was told to quote "ckpt='1000.0'", another file's name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    for typed, parsed in (("1e3", "1000.0"), ("true", "True")):
        args = [sys.executable, str(REPO_ROOT / "eval" / "recall.py"), f"ckpt={typed}"]
        result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr == (
            f"error: ckpt must be one checkpoint path, got {parsed}; give the .ckpt file's path (a path "
            f"Hydra reads as another type: quote it, \"ckpt='{typed}'\")\n"
        ), result.stderr


def test_cli_reports_a_missing_checkpoint_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    script = str(REPO_ROOT / "eval" / "long_context.py")
    result = subprocess.run([sys.executable, script, f"ckpt={tmp_path / 'nope.ckpt'}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "checkpoint not found" in result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_unwritable_output_is_refused_before_evaluating(copy_run, tmp_path, monkeypatch):
    # Found by a fresh-clone check: a checkpoint on read-only storage (default output next to it)
    # or a read-only output= ran the whole evaluation, then lost it in a PermissionError traceback.
    read_only = tmp_path / "shared"
    read_only.mkdir()
    ckpt = read_only / "copy.ckpt"
    ckpt.write_bytes(Path(copy_run["last_ckpt"]).read_bytes())
    refuse_files_in(monkeypatch, read_only)
    monkeypatch.setattr(copying_module, "build_datamodule", lambda *a, **k: pytest.fail("evaluation started"))
    with pytest.raises(
        ValueError,
        match=rf"the default output {re.escape(str(ckpt))}\.copying\.json cannot be written: "
        rf"creating a file in {re.escape(str(read_only))} failed: Permission denied; pass output=<a writable file path>",
    ):
        copying_eval(compose_eval("copying", [f"ckpt={ckpt}", "device=cpu"]))
    output = read_only / "r.json"
    with pytest.raises(ValueError, match=rf"output={re.escape(str(output))} cannot be written: "):
        copying_eval(compose_eval("copying", [f"ckpt={ckpt}", "device=cpu", f"output={output}"]))
    output = read_only / "new" / "r.json"  # the message names the nearest existing folder, which refused
    with pytest.raises(
        ValueError,
        match=rf"output={re.escape(str(output))} cannot be written: its missing folders would be created "
        rf"in {re.escape(str(read_only))}, where creating a file failed: Permission",
    ):
        copying_eval(compose_eval("copying", [f"ckpt={ckpt}", "device=cpu", f"output={output}"]))
    assert sorted(p.name for p in read_only.iterdir()) == ["copy.ckpt"]


def test_an_output_holding_another_tools_records_is_refused_before_evaluating(copy_run, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    # A new-user check: output=<run>/results/train.json replaced train.py's records with the
    # evaluation's, and output=decode-mamba-tiny.json eval/decode.py's, with only a "replacing" line.
    monkeypatch.setattr(copying_module, "build_datamodule", lambda *a, **k: pytest.fail("evaluation started"))
    settings = [f"ckpt={copy_run['last_ckpt']}", "device=cpu"]
    train_json = Path(copy_run["run_dir"]) / "results" / "train.json"
    before = train_json.read_bytes()
    n = len(json.loads(before))
    refusal = rf"^output={re.escape(str(train_json))} holds {n} records of train\.py, which this run would "
    with pytest.raises(ValueError, match=refusal + r"replace; give output= a path of its own"):
        copying_eval(compose_eval("copying", [*settings, f"output={train_json}"]))
    assert train_json.read_bytes() == before
    decode_json = tmp_path / "decode-mamba-tiny.json"
    record = {"run": "d", "mixer": "mamba", "task": "decode", "metric": "state_bytes", "value": 8.0}
    decode_json.write_text(json.dumps([record]))
    with pytest.raises(ValueError, match=r"holds 1 records of eval/decode\.py, which this run would replace"):
        copying_eval(compose_eval("copying", [*settings, f"output={decode_json}"]))


def test_an_output_file_that_cannot_be_replaced_is_told_apart_from_its_folder(copy_run, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    """A new-user check: output= an immutable file (chattr +i) in a writable folder ran the evaluation,
    then said "make its folder writable". Here the file refuses as an immutable one does: opened for
    writing (EPERM, root too) and renamed over (EPERM)."""
    output = tmp_path / "r.json"
    output.write_text("[]")
    os_open, os_replace = os.open, os.replace

    def immutable_open(path, flags, *args, **kwargs):
        if Path(path) == output and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return os_open(path, flags, *args, **kwargs)

    def immutable_replace(src, dst, **kwargs):
        if Path(dst) == output:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))
        return os_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "open", immutable_open)
    monkeypatch.setattr(os, "replace", immutable_replace)
    cfg = compose_eval("copying", [f"ckpt={copy_run['last_ckpt']}", "device=cpu", f"output={output}"])
    evaluate = copying_module.build_datamodule
    monkeypatch.setattr(copying_module, "build_datamodule", lambda *a, **k: pytest.fail("evaluation started"))
    # Before the evaluation: the file's own refusal, not the folder's.
    with pytest.raises(
        ValueError,
        match=rf"^output={re.escape(str(output))} cannot be replaced: it is immutable or append-only "
        r"\(lsattr shows it; chattr -i or chattr -a lifts it\); lift that, or give output= another path$",
    ):
        copying_eval(cfg)
    # Should it come to the write (a file made immutable during the evaluation): the same advice.
    monkeypatch.setattr(copying_module, "build_datamodule", evaluate)
    monkeypatch.setattr(copying_module, "check_settings", lambda *a: None)
    with pytest.raises(WriteError) as failed:
        copying_eval(cfg)
    assert write_error_message(failed.value, "output=<another path>") == (
        f"cannot write {output}: Operation not permitted; its folder is writable, but the file there "
        "cannot be replaced: it is immutable or append-only (lsattr shows it; chattr -i or chattr -a lifts "
        "it); or pass output=<another path>"
    )
    assert output.read_text() == "[]" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_cli_reports_an_output_directory_in_one_line_before_evaluating(tmp_path):
    """output=<a directory> used to fail in os.replace after the whole evaluation, losing the
    results; it is refused first (here before the checkpoint, which does not exist, is looked at)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    script = str(REPO_ROOT / "eval" / "recall.py")
    result = subprocess.run([sys.executable, script, f"ckpt={tmp_path / 'nope.ckpt'}", f"output={tmp_path}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = f"output={tmp_path} is a directory; give a file path such as output={tmp_path / 'recall.json'}"
    assert result.stderr.strip() == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_foreign_files_and_edited_configs_give_clear_checkpoint_errors(copy_run, tmp_path):
    """A text file, random bytes and a checkpoint whose config no longer matches its weights: one
    ValueError each naming the problem, never the unpickler's advice or a size-mismatch dump."""
    text = tmp_path / "notes.ckpt"
    text.write_text("hello world, this is text\n" * 10)
    noise = tmp_path / "noise.ckpt"
    noise.write_bytes(bytes(range(256)) * 8)
    short = tmp_path / "short.ckpt"  # a few bytes: the unpickler raised IndexError, a traceback
    short.write_text("bad\n")
    cut = tmp_path / "cut.ckpt"  # an opcode whose argument is cut short: struct.error, a traceback
    cut.write_text("junk")
    with pytest.raises(ValueError, match="truncated or corrupt.*tensors and plain containers") as info:
        load_model(noise)
    assert "weights_only" not in str(info.value)
    # Text is said to be text, not a corrupt checkpoint (a new-user check passed a record .json).
    records = tmp_path / "best.ckpt.recall.json"
    records.write_text('[\n  {\n    "run": "r"}]')
    for path, start in ((text, "hello world, this is text"), (short, "bad"), (cut, "junk"), (records, "[")):
        with pytest.raises(
            ValueError, match=rf"{path} is a text file \(it begins '{re.escape(start)}'\), not a checkpoint"
        ):
            load_model(path)
    # Bytes overwritten inside a weight tensor (finite garbage): caught by the zip entry's CRC-32.
    raw = bytearray(Path(copy_run["last_ckpt"]).read_bytes())
    with zipfile.ZipFile(copy_run["last_ckpt"]) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)  # the largest tensor
    start = entry.header_offset + 30 + len(entry.filename.encode()) + len(entry.extra) + 16
    raw[start : start + 64] = bytes(range(64))
    overwritten = tmp_path / "overwritten.ckpt"
    overwritten.write_bytes(bytes(raw))
    with pytest.raises(
        ValueError, match=r"truncated or corrupt \(the bytes of .* do not match its stored CRC-32\)"
    ):
        load_model(overwritten)
    checkpoint = torch.load(copy_run["last_ckpt"], map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["model"]["d_model"] *= 2
    edited = tmp_path / "edited.ckpt"
    torch.save(checkpoint, edited)
    with pytest.raises(ValueError, match="does not match the model its config describes: .*size mismatch"):
        load_model(edited)
    # A hyper_parameter LitLM does not take: one line, not LitLM's TypeError (found by an audit).
    checkpoint["hyper_parameters"]["extra"] = 1
    torch.save(checkpoint, edited)
    message = f"checkpoint {edited} holds hyper_parameters that this mixerlab's LitLM does not take"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(edited)


def test_load_model_refuses_a_wrong_path_or_device_in_one_line(copy_run, monkeypatch):
    """A new-user check from Python: load_model(5) was pathlib's TypeError, and map_location="cuda" on a
    CPU-only machine torch's AssertionError once the checkpoint was read."""
    with pytest.raises(TypeError, match=r"^a checkpoint path must be a str or os.PathLike, got int 5; give "):
        load_model(5)
    ckpt = copy_run["last_ckpt"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_gpu = r"^map_location='cuda' asks for a CUDA GPU, but .*; use map_location='cpu'$"
    with pytest.raises(ValueError, match=no_gpu):
        load_model(ckpt, map_location="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^map_location='cuda:1' asks for GPU 1, but this machine has 1 "):
        load_model(ckpt, map_location="cuda:1")
    with pytest.raises(ValueError, match=r"^map_location='gpu' is not a device; give e.g. map_location="):
        load_model(ckpt, map_location="gpu")
    with pytest.raises(TypeError, match=r"^map_location must be a device name or torch.device .*, got int 0"):
        load_model(ckpt, map_location=0)
    assert load_model(ckpt, map_location=torch.device("cpu")).device.type == "cpu"


def test_checkpoints_without_weights_or_model_config_are_refused_in_one_line(copy_run, tmp_path):
    """A dict that torch.load reads but that lacks the state_dict, or whose hyper_parameters hold no
    model config dict, is 'not a mixerlab checkpoint', never a KeyError or TypeError from inside."""
    checkpoint = torch.load(copy_run["last_ckpt"], map_location="cpu", weights_only=True)
    edits = {
        "no_state_dict": ({k: v for k, v in checkpoint.items() if k != "state_dict"},
                          "no state_dict of model weights"),
        "list_state_dict": (checkpoint | {"state_dict": [1]}, "no state_dict of model weights"),
        "foreign": ({"foo": 1}, "no model config in its hyper_parameters"),
        "int_hparams": (checkpoint | {"hyper_parameters": 3}, "no model config in its hyper_parameters"),
        "int_model": (checkpoint | {"hyper_parameters": checkpoint["hyper_parameters"] | {"model": 5}},
                      "no model config in its hyper_parameters"),
    }  # fmt: skip
    for name, (content, reason) in edits.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save(content, path)
        with pytest.raises(ValueError, match=re.escape(f"{path} is not a mixerlab checkpoint")) as info:
            load_model(path)
        # From Python the hint names no command-line setting; from an evaluation it names ckpt=.
        assert f"({reason}); give a .ckpt file written by train.py" in str(info.value)
        assert "ckpt=" not in str(info.value)
    no_weights = r"truncated or corrupt one \(no state_dict of model weights\); pass ckpt=<"
    with pytest.raises(ValueError, match=no_weights):
        copying_eval(compose_eval("copying", [f"ckpt={tmp_path / 'no_state_dict.ckpt'}", "device=cpu"]))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_checkpoints_with_non_finite_weights_are_refused(copy_run, tmp_path, value):
    """A diverged run's weights used to score 0.0 everywhere with exit status 0: loading for an
    evaluation now fails, counting the tensors and naming the first."""
    checkpoint = torch.load(copy_run["last_ckpt"], map_location="cpu", weights_only=True)
    weights = checkpoint["state_dict"]
    names = [k for k, v in weights.items() if v.is_floating_point()]
    for name in names[3], names[-1]:
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = value
    path = tmp_path / "diverged.ckpt"
    torch.save(checkpoint, path)
    message = (
        f"checkpoint {path} has NaN or inf weights in 2 of its {len(names)} floating-point tensors "
        f"(the first: {names[3]}): the run likely diverged; "
    )
    with pytest.raises(ValueError, match=re.escape(message + "use an earlier checkpoint of the run")):
        load_model(path)
    with pytest.raises(ValueError, match=re.escape(message + "pass ckpt=<an earlier checkpoint of the run")):
        copying_eval(compose_eval("copying", [f"ckpt={path}", "device=cpu", f"output={tmp_path / 'c.json'}"]))
    assert not (tmp_path / "c.json").exists()


def test_test_lengths_beyond_a_learned_position_table_are_refused_up_front(copy_run):
    """A learned table of 64 rows: 64 tokens pass, 65 are refused before any slice is scored, with
    the setting to lower named; a model without a learned table has no limit."""
    from eval.common import check_position_limit

    class Learned:
        def position_limit(self):
            return "attention", 64

    check_position_limit(Learned(), 64, "length_multipliers")
    with pytest.raises(
        ValueError, match=r"attention: .*max_position=64 rows.*65 tokens; lower length_multipliers"
    ):
        check_position_limit(Learned(), 65, "length_multipliers")
    # The override as it must be typed (a new-user check: without ++ it was refused as unknown, the
    # attention config having no max_position key).
    typed = "(or train with ++mixer.settings.attention.max_position=65 or more)"
    with pytest.raises(ValueError, match=re.escape(typed)):
        check_position_limit(Learned(), 65, "length_multipliers")
    model = load_model(copy_run["last_ckpt"]).model
    assert model.position_limit() is None  # RoPE: no table
    check_position_limit(model, 10**6, "seqlens")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_during_an_evaluation_is_one_line_and_status_130(copy_run, tmp_path, sig):
    # It printed a KeyboardInterrupt traceback through the evaluation loop and Hydra; SIGTERM
    # (`timeout -s TERM`, a new-user check) ended it with status 143 and no word.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    output = tmp_path / "copying.json"
    args = [str(REPO_ROOT / "eval" / "copying.py"), f"ckpt={copy_run['last_ckpt']}", "device=cpu",
            "num_examples=100000", "decode_paths=[decode]", f"output={output}"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if line.startswith("evaluating"):
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "interrupted: nothing written\n", err[-3000:]
    assert list(tmp_path.iterdir()) == []

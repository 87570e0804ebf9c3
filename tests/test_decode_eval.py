"""eval/decode.py at tiny sizes on CPU: records, measured state bytes, the roofline hand-off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import refuse_files_in
from hydra import compose, initialize_config_dir

import eval.decode as decode_module
from eval import roofline as rl
from eval.decode import build_model, decode_eval
from eval.records import REPO_ROOT, check_sweep_output, write_records


def compose_decode(*overrides):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="eval/decode", overrides=list(overrides))


@pytest.mark.parametrize("mixer", ["attention", "sliding_window"])
def test_decode_eval_writes_records_and_plot(tmp_path, mixer, capsys):
    output = tmp_path / "decode.json"
    cfg = compose_decode(
        f"mixer={mixer}", "model.n_layers=2", "context_lengths=[8,40]", "decode_steps=2", "batch_size=2",
        "device=cpu", f"output={output}",
    )  # fmt: skip
    records = decode_eval(cfg)
    assert json.loads(output.read_text()) == records
    assert output.with_suffix(".png").stat().st_size > 0
    assert "replacing" not in capsys.readouterr().out
    if mixer == "attention":  # a second run says that it replaces the first one's records
        records = decode_eval(cfg)
        assert f"replacing the earlier results in {output}" in capsys.readouterr().out
    model = build_model(cfg)
    metrics = {(r["metric"], r["seqlen"]) for r in records}
    for context in (8, 40):
        for metric in ("state_bytes", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_bandwidth"):
            assert (metric, context) in metrics
    for r in records:
        assert r["mixer"] == mixer and r["batch"] == 2 and r["value"] > 0
        # Measured from the cache tensors, equal to the analytic size of a cache for context + steps.
        assert r["state_bytes"] == model.state_size(r["seqlen"] + 2)
    if mixer == "sliding_window":  # the ring stops growing at the window (32)
        sizes = {r["seqlen"]: r["state_bytes"] for r in records}
        assert sizes[40] == model.state_size(32) == model.state_size(10_000) > sizes[8]
    rows = rl.measured_vs_floor(records, 4.27, 989)
    assert {row["kind"] for row in rows} == {"prefill", "decode (eager)"}
    assert all(row["floor_tokens_per_s"] > 0 for row in rows)


def test_decode_eval_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="context_lengths must be a list of integers >= 1"):
        decode_eval(compose_decode("context_lengths=[0]", f"output={tmp_path / 'x.json'}"))
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        decode_eval(compose_decode("dtype=int8", "device=cpu", f"output={tmp_path / 'x.json'}"))
    with pytest.raises(ValueError, match=re.escape("got 64; write context_lengths=[64]")):
        decode_eval(compose_decode("context_lengths=64", f"output={tmp_path / 'x.json'}"))
    # An output directory is refused before anything is measured, not by os.replace after it.
    with pytest.raises(ValueError, match=re.escape(f"output={tmp_path} is a directory; give a file path")):
        decode_eval(compose_decode("context_lengths=[8]", "device=cpu", f"output={tmp_path}"))


def test_decode_eval_refuses_an_unwritable_default_output_before_measuring(tmp_path, monkeypatch):
    refuse_files_in(monkeypatch, tmp_path)  # the working directory, on read-only storage
    monkeypatch.setattr(decode_module, "copy_bandwidth", lambda device: pytest.fail("measuring started"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the default output decode-attention-tiny\.json cannot be written: .*"
                       r"Permission denied; pass output=<a writable file path>"):  # fmt: skip
        decode_eval(compose_decode("mixer=attention", "context_lengths=[8]", "device=cpu"))


def test_decode_eval_skips_contexts_past_the_memory_limit(tmp_path, monkeypatch):
    """A context that runs out of memory becomes a decode_oom record; the sweep goes on."""
    real_measure = decode_module.measure

    def measure(model, batch, context, decode_steps, device):
        if context == 40:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore detail")
        return real_measure(model, batch, context, decode_steps, device)

    monkeypatch.setattr(decode_module, "measure", measure)
    output = tmp_path / "decode.json"
    cfg = compose_decode(
        "model.n_layers=2", "context_lengths=[40,8]", "decode_steps=2", "device=cpu", f"output={output}"
    )
    records = decode_eval(cfg)
    assert json.loads(output.read_text()) == records
    skipped = [r for r in records if r["seqlen"] == 40]
    assert [r["metric"] for r in skipped] == ["decode_oom"]
    assert skipped[0]["reason"] == "CUDA out of memory. Tried to allocate 64.00 GiB"
    assert {r["metric"] for r in records if r["seqlen"] == 8} == {
        "state_bytes",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "decode_bandwidth",
    }  # fmt: skip (on CPU: no CUDA-graph, no kernel count)
    rows = rl.measured_vs_floor(records, 4.27, 989)
    assert {row["seqlen"] for row in rows} == {8}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_eval_counts_kernels_per_step_on_cuda(tmp_path):
    cfg = compose_decode(
        "model.n_layers=2",
        "context_lengths=[64]",
        "decode_steps=4",
        "device=cuda",
        f"output={tmp_path / 'd.json'}",
    )
    records = decode_eval(cfg)
    kernels = [r for r in records if r["metric"] == "kernels_per_step"]
    # Two attention layers each need at least the split-K kernel, plus projections and the head.
    assert len(kernels) == 1 and kernels[0]["value"] >= 8
    assert any(r["metric"] == "decode_tokens_per_s" and r["mode"] == "cuda_graph" for r in records)


def test_decode_sweep_refuses_one_output_file_for_every_job(tmp_path):
    # `-m` runs the jobs one after another in this process: with one output= path, the second job
    # would replace the first one's records; it stops before measuring, naming a per-job path.
    output = tmp_path / "dd.json"
    args = [
        sys.executable, str(REPO_ROOT / "eval" / "decode.py"), "-m", "mixer=attention,mamba",
        "context_lengths=[8]", "decode_steps=1", "device=cpu", f"output={output}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    want = (
        f"output={output} was written by an earlier job of this sweep (-m): each job would replace the "
        f"one before it; give each job its own file, e.g. output='{tmp_path / 'dd-${hydra:job.num}.json'}'"
    )
    assert want in result.stderr
    assert {r["mixer"] for r in json.loads(output.read_text())} == {"attention"}  # the first job's records stay
    assert "decode-mamba" not in result.stdout  # the second job measured nothing


def test_sweep_output_check_is_silent_outside_a_sweep(tmp_path):
    output = tmp_path / "dd.json"
    write_records(output, [])
    check_sweep_output(output)  # a second plain run replaces its results, saying so (see above)

"""eval/decode.py at tiny sizes on CPU: records, measured state bytes, the roofline hand-off."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import compose_eval, refuse_files_in
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
        records = decode_eval(cfg)  # at its first length, not again at the last
        assert capsys.readouterr().out.count(f"replacing the earlier results in {output}") == 1
    model = build_model(cfg)
    metrics = {(r["metric"], r["seqlen"]) for r in records}
    for context in (8, 40):
        for metric in ("state_bytes", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_bandwidth"):
            assert (metric, context) in metrics
    for r in records:
        assert r["mixer"] == mixer and r["batch"] == 2 and r["value"] > 0
        # Measured from the cache tensors, equal to the analytic size of a cache for context + steps,
        # the length each record names.
        assert r["cache_seqlen"] == r["seqlen"] + 2 and r["decode_steps"] == 2
        assert r["state_bytes"] == model.state_size(r["cache_seqlen"])
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


def test_decode_eval_refuses_an_output_holding_an_evaluations_records(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_module, "copy_bandwidth", lambda device: pytest.fail("measuring started"))
    recall = tmp_path / "last.ckpt.recall.json"
    record = {"run": "r", "mixer": "mamba", "task": "mqar", "metric": "accuracy", "value": 0.5}
    recall.write_text(json.dumps([{**record, "checkpoint": "/x/last.ckpt", "split": "test"}]))
    settings = ("mixer=attention", "context_lengths=[8]", "device=cpu", f"output={recall}")
    with pytest.raises(ValueError, match=r"holds 1 records of another tool, which this run would replace"):
        decode_eval(compose_decode(*settings))
    # Its own kind of file is replaced, as before (said when written).
    recall.write_text(json.dumps([{"run": "d", "mixer": "mamba", "task": "decode", "metric": "state_bytes",
                                   "value": 8.0}]))  # fmt: skip
    monkeypatch.undo()
    decode_eval(compose_decode(*settings))
    assert {r["mixer"] for r in json.loads(recall.read_text())} == {"attention"}


def test_decode_eval_refuses_a_records_file_or_plot_that_cannot_be_replaced_before_measuring(
    tmp_path, monkeypatch
):
    """An immutable file (chattr +i; opening it for writing is refused with EPERM, root too) in a
    writable folder: the records or their plot would be lost after the measurements."""
    monkeypatch.setattr(decode_module, "copy_bandwidth", lambda device: pytest.fail("measuring started"))
    monkeypatch.chdir(tmp_path)
    os_open = os.open
    immutable: set[Path] = set()

    def refusing_open(path, flags, *args, **kwargs):
        if Path(path).absolute() in immutable and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    why = r"cannot be replaced: it is immutable or append-only \(lsattr shows it; chattr -i or chattr -a "
    for name, given, shown in [
        ("x.json", [f"output={tmp_path / 'x.json'}"], f"output={tmp_path / 'x.json'}"),
        ("x.png", [f"output={tmp_path / 'x.json'}"], f"the plot beside it, {tmp_path / 'x.png'}"),
        ("decode-attention-tiny.json", [], "the default output decode-attention-tiny.json"),
    ]:
        (tmp_path / name).write_text("kept")
        immutable.add(tmp_path / name)
        with pytest.raises(ValueError, match="^" + re.escape(shown) + " " + why):
            decode_eval(compose_decode("mixer=attention", "context_lengths=[8]", "device=cpu", *given))
        immutable.clear()
        (tmp_path / name).unlink()


CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
    "to allocate 512016384 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore detail"),
         "CUDA out of memory. Tried to allocate 64.00 GiB"),
        (RuntimeError(CPU_OOM), CPU_OOM),  # PyTorch's CPU allocator (ulimit -v, a full machine)
        (MemoryError(), "MemoryError"),  # no message: the type names it
    ],
    ids=["cuda", "cpu", "memory_error"],
)  # fmt: skip
def test_decode_eval_skips_contexts_past_the_memory_limit(tmp_path, monkeypatch, error, reason):
    """A context that runs out of memory becomes a decode_oom record; the sweep goes on."""
    real_measure = decode_module.measure

    def measure(model, batch, context, decode_steps, device):
        if context == 64:
            raise error
        return real_measure(model, batch, context, decode_steps, device)

    monkeypatch.setattr(decode_module, "measure", measure)
    output = tmp_path / "decode.json"
    cfg = compose_decode(
        "model.n_layers=2", "context_lengths=[64,8]", "decode_steps=2", "device=cpu", f"output={output}"
    )
    records = decode_eval(cfg)
    assert json.loads(output.read_text()) == records
    skipped = [r for r in records if r["seqlen"] == 64]
    assert [r["metric"] for r in skipped] == ["decode_oom"]
    assert skipped[0]["reason"] == reason
    # Like every other row, its state_bytes is the cache for context + decode_steps tokens (66: two
    # 64-token pages, where the 64-token context alone would fill one).
    model = build_model(cfg)
    assert skipped[0]["cache_seqlen"] == 66 and skipped[0]["decode_steps"] == 2
    assert skipped[0]["state_bytes"] == model.state_size(66) > model.state_size(64)
    assert {r["metric"] for r in records if r["seqlen"] == 8} == {
        "state_bytes",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "decode_bandwidth",
    }  # fmt: skip (on CPU: no CUDA-graph, no kernel count)
    rows = rl.measured_vs_floor(records, 4.27, 989)
    assert {row["seqlen"] for row in rows} == {8}


def test_decode_eval_on_cpu_skips_a_cache_larger_than_host_memory(tmp_path, monkeypatch, capsys):
    """On CPU a cache and prefill logits larger than the memory left are a decode_oom record before
    anything is allocated (Linux would grant the per-layer allocations one by one, then kill the process
    silently: batch_size=100000 ended with status 137 and no message); lengths that fit still run."""
    cfg = compose_decode("model.n_layers=2", "context_lengths=[64,8]", "decode_steps=2", "device=cpu",
                         "batch_size=3", f"output={tmp_path / 'decode.json'}")  # fmt: skip
    model = build_model(cfg)
    need = 3 * model.state_size(66) + 3 * 64 * 512 * 4  # its cache and its prefill's fp32 logits
    free = need - 1  # one byte short for the 64-token context
    monkeypatch.setattr(decode_module, "host_memory_available", lambda: free)
    real_measure = decode_module.measure
    measured = []

    def measure(model, batch, context, decode_steps, device):
        measured.append(context)
        return real_measure(model, batch, context, decode_steps, device)

    monkeypatch.setattr(decode_module, "measure", measure)
    records = decode_eval(cfg)
    assert measured == [8]
    skipped = [r for r in records if r["seqlen"] == 64]
    assert [r["metric"] for r in skipped] == ["decode_oom"]
    assert skipped[0]["reason"] == (
        f"the cache and the prefill's logits need {need / 2**30:.2f} GiB (3 sequences of 66 tokens), "
        f"more than the {free / 2**30:.2f} GiB of host memory available"
    )
    assert "64  skipped: out of memory (the cache and the prefill's logits need" in capsys.readouterr().out
    assert "decode_tokens_per_s" in {r["metric"] for r in records if r["seqlen"] == 8}


def test_host_memory_available_is_at_most_the_machine_memory():
    """MemAvailable (lowered by a cgroup limit) in bytes: positive and at most MemTotal."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        assert decode_module.host_memory_available() is None
        return
    total = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text()).group(1)) * 1024
    assert 0 < decode_module.host_memory_available() <= total


def test_decode_eval_killed_at_a_later_length_keeps_the_lengths_before_it(tmp_path, capsys):
    """Records and plot are rewritten after each context length: a process killed at the third one
    (os._exit, as the system's out-of-memory killer ends it: no exception, no cleanup) leaves the first
    two lengths' records, marked partial, which eval/roofline.py reads with a note."""
    output = tmp_path / "decode.json"
    overrides = ["model.n_layers=2", "context_lengths=[8,16,24]", "decode_steps=2", "device=cpu",
                 f"output={output}"]  # fmt: skip
    script = f"""
import os, sys
sys.path.insert(0, {str(REPO_ROOT)!r})
from hydra import compose, initialize_config_dir
import eval.decode as decode
measure = decode.measure
def killed_at_24(model, batch, context, *args):
    if context == 24:
        os._exit(137)
    return measure(model, batch, context, *args)
decode.measure = killed_at_24
with initialize_config_dir(config_dir={str(REPO_ROOT / "conf")!r}, version_base="1.3"):
    decode.decode_eval(compose(config_name="eval/decode", overrides={overrides!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 137, result.stderr[-2000:]
    kept = json.loads(output.read_text())
    assert {r["seqlen"] for r in kept} == {8, 16} and "decode_tokens_per_s" in {r["metric"] for r in kept}
    assert all(r["partial"] == {"seqlens_done": [8, 16], "seqlens_planned": [8, 16, 24]} for r in kept)
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json", "decode.png"]  # no temporary file

    rows = rl.roofline(compose_eval("roofline", [f"records=[{output}]"]))["measured"]
    assert {row["seqlen"] for row in rows} == {8, 16}
    assert (
        f"note: {output}: partial results, seqlens [8, 16] of [8, 16, 24] only (its sweep "
        "was cut short, e.g. killed out of memory on CPU, or is still running)\n"
    ) in capsys.readouterr().out


def test_decode_eval_lets_other_errors_through(tmp_path, monkeypatch):
    """Only allocation failures become decode_oom records: a bug stops the run, writing nothing."""

    def measure(model, batch, context, decode_steps, device):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(decode_module, "measure", measure)
    output = tmp_path / "decode.json"
    with pytest.raises(RuntimeError, match="shape mismatch"):
        decode_eval(compose_decode("context_lengths=[8]", "device=cpu", f"output={output}"))
    assert not output.exists()


def test_decode_eval_refuses_a_model_that_does_not_fit_in_memory(tmp_path):
    # A 256 TB embedding: past any machine's address space, so the allocation fails at once.
    output = tmp_path / "decode.json"
    want = (
        r"^the model \(model=tiny, mixer=attention, vocab_size=1000000000000, float32\) does not fit in "
        r"memory on cpu: .*can't allocate memory.*; lower vocab_size or choose a smaller model=$"
    )
    with pytest.raises(ValueError, match=want):
        decode_eval(compose_decode("vocab_size=1000000000000", "context_lengths=[8]", "device=cpu",
                                   f"output={output}"))  # fmt: skip
    assert not output.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["output={tmp}/x.png"], "output={tmp}/x.png is a .png path, but the plot is written beside the "
         "records as x.png and would replace them; give a .json path such as output={tmp}/x.json"),
        (["output={tmp}/x.PNG"], "output={tmp}/x.PNG is a .png path"),
        (["wandb.enabled=no"], "wandb.enabled must be true or false, got 'no'"),
        (["wandb.enabled=true", "wandb.mode=bogus"], "wandb.mode must be 'online' or 'offline', got 'bogus'"),
        (["batch_size=true"], "batch_size must be an integer >= 1, got True"),
        (["decode_steps=true"], "decode_steps must be an integer >= 1, got True"),
        (["vocab_size=true"], "vocab_size must be an integer >= 1, got True"),
        (["output=[a.json]"],
         "output must be one file path, got ['a.json']; give one, e.g. output=decode.json"),
        (["output=123"], "output must be one file path, got 123; give one"),
        (["context_lengths=[64,8,8]"],
         "context_lengths lists a value twice: [64, 8, 8]; give each value once"),
        (["mixer.settings.attention.pos_emb=learned", "+mixer.settings.attention.max_position=16",
          "context_lengths=[8,32]"],
         "attention: the learned position table has max_position=16 rows, but context_lengths [32] with "
         "decode_steps=2 need up to 34 positions; keep every context length + decode_steps at most 16 (or "
         "raise it: ++mixer.settings.attention.max_position=34)"),
        # The last decode step's position counts: 15 + 2 tokens need position 16.
        (["mixer.settings.attention.pos_emb=learned", "+mixer.settings.attention.max_position=16",
          "context_lengths=[15]"], "context_lengths [15] with decode_steps=2 need up to 17 positions"),
    ],
    ids=["png", "png_upper", "wandb_enabled", "wandb_mode", "batch_bool", "steps_bool", "vocab_bool",
         "output_list", "output_int", "duplicate_length", "position_table", "position_table_edge"],
)  # fmt: skip
def test_decode_eval_refuses_bad_settings_before_measuring(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(decode_module, "copy_bandwidth", lambda device: pytest.fail("measuring started"))
    monkeypatch.chdir(tmp_path)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    cfg = compose_decode("decode_steps=2", "device=cpu", *overrides)
    with pytest.raises(ValueError, match=re.escape(message.replace("{tmp}", str(tmp_path)))):
        decode_eval(cfg)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_decode_eval_measures_up_to_the_last_learned_position(tmp_path):
    output = tmp_path / "decode.json"
    cfg = compose_decode(
        "model.n_layers=2", "mixer.settings.attention.pos_emb=learned",
        "+mixer.settings.attention.max_position=16", "context_lengths=[14]", "decode_steps=2", "device=cpu",
        f"output={output}",
    )  # fmt: skip
    records = decode_eval(cfg)
    assert {r["cache_seqlen"] for r in records} == {16}
    assert "decode_tokens_per_s" in {r["metric"] for r in records}


def test_plot_replaces_an_earlier_plot_atomically(tmp_path, monkeypatch):
    records = [
        {"metric": "state_bytes", "mixer": "attention", "seqlen": 8, "value": 1024.0},
        {"metric": "decode_tokens_per_s", "mode": "eager", "mixer": "attention", "seqlen": 8, "value": 50.0},
    ]
    path = tmp_path / "decode.png"
    decode_module.plot(records, path)
    assert path.read_bytes().startswith(b"\x89PNG") and list(tmp_path.iterdir()) == [path]
    path.write_bytes(b"an earlier plot")

    def savefig(self, fname, **kwargs):  # fails half-way, as on a full disk
        if isinstance(fname, io.BytesIO):
            fname.write(b"half a PNG")
        else:
            with open(fname, "wb") as f:
                f.write(b"half a PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", savefig)
    with pytest.raises(OSError, match="No space left on device"):
        decode_module.plot(records, path)
    assert path.read_bytes() == b"an earlier plot" and list(tmp_path.iterdir()) == [path]


def test_plot_of_a_metric_with_no_measurement_says_so(tmp_path, monkeypatch):
    """An interrupted run's plot with no eager decode speed yet: matplotlib warned "No artists with
    labels found to put in legend" and drew an empty panel; the panel says none was measured."""
    texts = []
    monkeypatch.setattr("matplotlib.axes.Axes.text", lambda self, x, y, s, **kw: texts.append(s))
    records = [{"metric": "state_bytes", "mixer": "attention", "seqlen": 8, "value": 1024.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode_module.plot(records, tmp_path / "decode.png")
    assert texts == ["none measured"]
    assert (tmp_path / "decode.png").read_bytes().startswith(b"\x89PNG")


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
    # With one output= path every job would replace the one before it: refused before the first job
    # measures anything (a new-user check: the first job ran and wrote its file, then the second
    # stopped), naming a per-job path; so is a sweep whose jobs share the default file.
    output = tmp_path / "dd.json"
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    script = [sys.executable, str(REPO_ROOT / "eval" / "decode.py"), "-m"]
    settings = ["context_lengths=[8]", "decode_steps=1", "device=cpu"]
    default = "decode-attention-tiny.json"
    cases = (
        (["mixer=attention,mamba", f"output={output}"], "mixer=mamba", "mixer=attention", f"output={output}",
         tmp_path / "dd-${hydra:job.num}.json"),
        (["batch_size=1,2"], "batch_size=2", "batch_size=1", f"the default output {default}",
         "decode-attention-tiny-${hydra:job.num}.json"),
    )  # fmt: skip
    for sweep, job, earlier, written, per_job in cases:
        command = script + sweep + settings
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr == (
            f"error: the sweep's job with {job}: {written} would be written by the job with {earlier} too: "
            f"each job would replace the one before it; give each job its own file, e.g. output='{per_job}'\n"
        )
        assert list(tmp_path.iterdir()) == []  # nothing measured, no sweep folder


def test_decode_sweep_checks_every_jobs_model_before_the_first_job(tmp_path):
    """A new-user check: ``-m mixer=attention,mamba model.num_heads=4,3`` with per-job outputs
    measured and wrote its first job, then stopped at the second without naming it; and so did a
    bad value of a later job (``context_lengths=[64],[0]``)."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    script = [sys.executable, str(REPO_ROOT / "eval" / "decode.py"), "-m", "output=e${hydra:job.num}.json"]
    settings = ["decode_steps=1", "device=cpu"]
    cases = (
        (["mixer=attention,mamba", "context_lengths=[8]", "model.num_heads=4,3"],
         "mixer=attention model.num_heads=3: attention: num_heads=3 does not divide d_model=64"),
        (["context_lengths=[8],[0]"], "context_lengths=[0]: context_lengths must be a list of integers >= 1"),
    )  # fmt: skip
    for sweep, message in cases:
        result = subprocess.run(
            script + sweep + settings, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith(f"error: the sweep's job with {message}"), result.stderr[-2000:]
        assert list(tmp_path.iterdir()) == []  # nothing measured, no sweep folder


def test_a_report_sweep_sharing_one_out_folder_is_refused_before_the_first_job(tmp_path):
    """A new-user check: ``eval/report.py -m task=mqar,copy out=X`` wrote the first job's report into
    X, then refused the second."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    out = tmp_path / "rep"
    command = [sys.executable, str(REPO_ROOT / "eval" / "report.py"), "-m", "task=mqar,copy", f"out={out}",
               f"runs=[{tmp_path}/none]"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr == (
        f"error: the sweep's job with task=copy: out={out} would be written by the job with task=mqar too: "
        f"each job would replace the one before it; give each job its own folder, e.g. "
        f"out='{out}-${{hydra:job.num}}'\n"
    ), result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_check_numbers_each_job_as_hydra_does():
    """``${hydra:job.num}`` (the per-job output the refusals advise) resolves in the pre-check as in
    the job: Hydra's basic sweeper numbers the product of the sweeps in command-line order."""
    from hydra.core.hydra_config import HydraConfig

    from eval.cli import CONF_DIR, _compose, _hydra_job, _job_number

    values = {0: ["a", "b"], 2: ["x", "y", "z"]}
    assert [_job_number(values, {0: i, 2: j}) for i in "ab" for j in "xyz"] == list(range(6))
    cfg = _compose(CONF_DIR, "eval/decode", ["output=e${hydra:job.num}.json"], with_hydra=True)
    with _hydra_job(cfg, 4):
        assert cfg.output == "e4.json"
    assert not HydraConfig.initialized()


def test_decode_help_lists_only_the_groups_decode_takes(tmp_path):
    # Hydra's list named every folder of conf/ ("data: ...", "eval: ..."); decode chooses model and mixer.
    result = subprocess.run([sys.executable, str(REPO_ROOT / "eval" / "decode.py"), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    listed = result.stdout.partition("(group=option)\n\n")[2].partition("\n\n")[0].splitlines()
    conf = REPO_ROOT / "conf"
    options = {group: sorted(p.stem for p in (conf / group).glob("*.yaml")) for group in ("mixer", "model")}
    assert listed == [f"{group}: {', '.join(names)}" for group, names in options.items()]
    assert list(tmp_path.iterdir()) == []


def test_decode_refuses_an_unknown_mixer_of_a_sweep_before_hydra(tmp_path):
    # Checked on the command line, before Hydra composes or makes anything (its own message is
    # several lines with its search path, and a refused sweep would leave multirun.yaml behind).
    args = [sys.executable, str(REPO_ROOT / "eval" / "decode.py"), "-m", "mixer=attention,mambaa"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: unknown mixer 'mambaa' in mixer=attention,mambaa: conf/mixer has no mambaa.yaml (did you "
        "mean mamba?); the mixer options are attention, "
    )
    assert result.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_a_sweep_output_refusal_gives_a_per_job_name_that_pastes(tmp_path, monkeypatch):
    """New-user checks: the per-job name advised for a path holding a literal ${ failed when pasted
    (Hydra interpolated it), and eval/report.py -m with one out= folder kept only the last job's
    report without a word."""
    import eval.records as records

    monkeypatch.setattr(records, "_in_sweep", lambda: True)
    monkeypatch.setattr(records, "_SWEEP_OUTPUTS", set())
    output = tmp_path / "d${x}" / "y.json"
    records.note_sweep_output(output)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"output={output} was written by an earlier job of this sweep (-m): each job would replace the one "
            f"before it; give each job its own file, e.g. output='{tmp_path}/d\\${{x}}/y-${{hydra:job.num}}.json'"
        ),
    ):
        check_sweep_output(output)
    out = tmp_path / "report"
    check_sweep_output(out, option="out", folder=True)  # not written yet
    records.note_sweep_output(out)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"out={out} was written by an earlier job of this sweep (-m): each job would replace the one before "
            f"it; give each job its own folder, e.g. out='{out}-${{hydra:job.num}}'"
        ),
    ):
        check_sweep_output(out, option="out", folder=True)
    # A path Hydra takes only quoted (a carried new-user note: the advice for a path holding = did not
    # paste, bash stripping the quotes and Hydra then refusing the =): Hydra's quotes in the shell's.
    output = tmp_path / "lr=1e-3" / "y.json"
    records.note_sweep_output(output)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"give each job its own file, e.g. 'output=\"{tmp_path}/lr=1e-3/y-${{hydra:job.num}}.json\"'"
        ),
    ):
        check_sweep_output(output)


def test_sweep_output_check_is_silent_outside_a_sweep(tmp_path):
    output = tmp_path / "dd.json"
    write_records(output, [])
    check_sweep_output(output)  # a second plain run replaces its results, saying so (see above)


def test_a_mixer_refusal_names_the_overrides_of_its_settings():
    # A new-user check: "num_heads=4 does not divide d_model=63" named the mixer's arguments only.
    with pytest.raises(ValueError, match=re.escape(
        "(d_model is model.d_model, num_heads is model.num_heads, head_dim is +mixer.settings.attention.head_dim)"
    )):  # fmt: skip
        build_model(compose_decode("model.d_model=63"))

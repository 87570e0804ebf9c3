"""benchmarks/train_parity.py on CPU: gaps, verdicts, CSV reading, backend forcing, CLI errors, and one
tiny end-to-end run of both trainings (the "triton" one through the Triton interpreter)."""

from __future__ import annotations

import collections
import functools
import json
import math

import pytest

import kernels
from benchmarks import train_parity as bench

# A 1-layer, 16-wide Mamba (32 channels) on 8-token MQAR, 3 steps of batch 1, no validation before the
# final one (on 1 example): the interpreter runs the Triton scan and conv (about 0.5 s per step at
# this size, 4 s at 32 wide, 16 tokens, batch 2), so everything stays tiny.
TINY = [
    "model.n_layers=1",
    "model.d_model=16",
    "data.seqlen=8",
    "data.num_kv_pairs=1",
    "data.vocab_size=16",
    "data.batch_size=1",
    "data.num_train_examples=16",
    "data.num_test_examples=1",
    "data.test_configs=[{seqlen:8,num_kv_pairs:1}]",
    "trainer=cpu",
    "trainer.val_check_interval=16",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=1",
]


def test_relative_gap():
    assert bench.relative_gap(2.1, 2.0) == pytest.approx(0.05)
    assert bench.relative_gap(1.9, 2.0) == pytest.approx(0.05)
    assert bench.relative_gap(-1.0, -2.0) == pytest.approx(0.5)
    assert bench.relative_gap(0.0, 0.0) == 0.0
    assert bench.relative_gap(1.0, 0.0) == math.inf
    assert math.isnan(bench.relative_gap(math.nan, 1.0))


def test_compare_curves_aligns_on_common_steps_and_finds_the_largest_gap():
    ours = {0: 4.0, 1: 3.3, 2: 3.0, 3: 2.02, 9: 1.0}
    ref = {0: 4.0, 1: 3.0, 2: 3.0, 3: 2.0, 5: 1.0}
    got = bench.compare_curves(ours, ref)
    assert got["steps"] == [0, 1, 2, 3]
    assert got["ours"] == [4.0, 3.3, 3.0, 2.02] and got["reference"] == [4.0, 3.0, 3.0, 2.0]
    assert got["gaps"] == pytest.approx([0.0, 0.1, 0.0, 0.01])
    assert got["max_gap"] == pytest.approx(0.1) and got["max_gap_step"] == 1
    assert got["final_gap"] == pytest.approx(0.01)
    assert bench.verdicts(got) == {"max_gap": False, "final_gap": True}
    line = bench.summary_line(got, bench.verdicts(got))
    assert "max gap 10.00% at step 1" in line and "MISS" in line and "final gap 1.00% at step 3" in line
    assert "PASS" in line


def test_a_nan_loss_is_the_largest_gap_and_misses():
    got = bench.compare_curves({0: 2.0, 1: math.nan, 2: 2.5}, {0: 2.0, 1: 1.5, 2: 1.0})
    assert got["max_gap_step"] == 1 and math.isnan(got["max_gap"])
    assert bench.verdicts(got) == {"max_gap": False, "final_gap": False}


def test_compare_curves_without_common_steps_is_an_error():
    with pytest.raises(ValueError, match="share no step"):
        bench.compare_curves({0: 1.0}, {1: 1.0})


def test_table_samples_the_curve_and_marks_the_largest_gap():
    steps = range(200)
    ref = {s: 5.0 - s / 100 for s in steps}
    ours = {s: v * (1.03 if s == 137 else 1.001) for s, v in ref.items()}
    rows = bench.table_rows(bench.compare_curves(ours, ref))
    picked = [int(r[0]) for r in rows]
    assert picked[:3] == [0, 20, 40] and 137 in picked and picked[-1] == 199 and len(rows) == 12
    assert [r[0] for r in rows if r[4] == "max"] == ["137"]
    assert rows[-1][1:4] == [f"{ours[199]:.4f}", f"{ref[199]:.4f}", "0.10%"]


def test_read_losses_skips_rows_without_a_loss(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,lr-AdamW,step,train/acc,train/loss\n,0.001,0,,\n0,,0,0.5,4.25\n,0.001,1,,\n0,,1,0.5,4.0\n"
    )
    assert bench.read_losses(path) == {0: 4.25, 1: 4.0}


def test_read_losses_errors_name_the_file_and_the_csv_logger(tmp_path):
    path = tmp_path / "metrics.csv"
    with pytest.raises(ValueError, match="no metrics.csv.*logger.csv enabled"):
        bench.read_losses(path)
    path.write_text("epoch,step,val/acc\n0,2,0.5\n")
    with pytest.raises(ValueError, match=f"{path}.*no train/loss.*keep logger.csv enabled"):
        bench.read_losses(path)


def test_forced_backend_swaps_every_op_and_restores_it_on_error():
    originals = {name: getattr(kernels, name) for name in kernels.__all__}
    with pytest.raises(RuntimeError, match="boom"), bench.forced_backend("triton"):
        for name, op in originals.items():
            forced = getattr(kernels, name)
            assert isinstance(forced, functools.partial) and forced.func is op
            assert forced.keywords == {"backend": "triton"}
        raise RuntimeError("boom")
    assert all(getattr(kernels, name) is op for name, op in originals.items())
    with pytest.raises(ValueError, match="'triton' or 'reference'"), bench.forced_backend("cuda"):
        pass
    assert all(getattr(kernels, name) is op for name, op in originals.items())


def test_compose_config_defaults_to_mamba_and_forces_the_logging(tmp_path):
    cfg = bench.compose_config(["trainer.max_steps=999", "logger=wandb"], 7, tmp_path)
    assert cfg.mixer.name == "mamba" and cfg.run_dir == str(tmp_path)
    assert cfg.trainer.max_steps == 7 and cfg.trainer.log_every_n_steps == 1
    assert cfg.logger.csv.enabled and not cfg.logger.wandb.enabled
    assert bench.compose_config(["mixer=attention"], 7, tmp_path).mixer.name == "attention"


def test_triton_on_a_cpu_trainer_without_the_interpreter_asks_for_trainer_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU machine
    with pytest.raises(ValueError, match="trainer=gpu"):
        bench.run_training("triton", ["trainer=cpu"], 2, tmp_path)
    assert not list(tmp_path.iterdir())


def test_bad_overrides_and_multi_process_trainers_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="bad override: unknown mixer 'nosuch' in mixer=nosuch: conf/mixer "):
        bench.compose_config(["mixer=nosuch"], 2, tmp_path)
    with pytest.raises(ValueError, match=r"bad override: unknown setting 'model.bogus' in model.bogus=3: "):
        bench.compose_config(["model.bogus=3"], 2, tmp_path)
    with pytest.raises(ValueError, match=r"bad override: cannot parse the override 'model.d_model=\[': no "):
        bench.compose_config(["model.d_model=["], 2, tmp_path)  # Hydra's reason, in one line
    with pytest.raises(ValueError, match="one process on one device; use trainer=gpu"):
        bench.compose_config(["trainer=ddp"], 2, tmp_path)
    # Validation is not compared: one batch per slice, whatever the command line says.
    assert bench.compose_config(["trainer.limit_val_batches=1.0"], 2, tmp_path).trainer.limit_val_batches == 1


def test_fewer_than_two_steps_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--steps", "1", "--out-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--steps must be at least 2" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_tiny_run_trains_on_both_backends_and_writes_the_record(tmp_path, monkeypatch, capsys):
    # Count what each run really executes: the Triton implementations behind backend="triton" and
    # the references behind backend="reference" (both looked up by kernels' dispatcher at call time).
    calls = collections.Counter()

    def counted(kind, op, impl):
        def wrapper(*args, **kwargs):
            calls[kind, op] += 1
            return impl(*args, **kwargs)

        return wrapper

    for op in ("selective_scan", "causal_conv1d"):
        monkeypatch.setitem(kernels._TRITON_OPS, op, counted("triton", op, kernels._TRITON_OPS[op]))
        monkeypatch.setattr(kernels.reference, op, counted("reference", op, getattr(kernels.reference, op)))
    originals = {name: getattr(kernels, name) for name in kernels.__all__}

    assert bench.main(["--steps", "3", "--out-dir", str(tmp_path), *TINY]) == 0

    assert all(getattr(kernels, name) is op for name, op in originals.items())
    # Each run trained 3 steps and validated on one op backend only, the same number of times.
    for op in ("selective_scan", "causal_conv1d"):
        assert calls["triton", op] == calls["reference", op] >= 3, calls
    (path,) = tmp_path.glob("*-cpu-train-parity.json")
    record = json.loads(path.read_text())
    assert record["device"] == "cpu" and record["steps"] == 3 and record["overrides"] == TINY
    assert record["curves"]["steps"] == [0, 1, 2]
    assert len(record["curves"]["ours"]) == len(record["curves"]["reference"]) == len(record["gaps"]) == 3
    assert all(math.isfinite(g) for g in record["gaps"]) and record["max_gap"] < 0.05
    assert record["met"] == {"max_gap": True, "final_gap": True}
    assert record["targets"] == {"max_gap": 0.05, "final_gap": 0.02}
    assert {run["backend"] for run in record["runs"].values()} == {"triton", "reference"}
    assert all(run["wall_s"] > 0 and run["run_dir"] is None for run in record["runs"].values())
    assert record["versions"]["torch"]
    out = capsys.readouterr().out
    assert "max gap" in out and out.count("PASS") == 2 and str(path) in out

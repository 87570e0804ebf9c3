"""benchmarks/selective_scan.py's CPU-side logic: byte and exp counts, rows, table, targets, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import selective_scan as bench
from kernels import reference

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_parse_shape():
    assert bench.parse_shape("32x2048") == (32, 2048)
    assert bench.parse_shape("1024X4096x16", parts=3) == (1024, 4096, 16)
    for bad in ("32", "32x0", "axb", "32x2048x16"):
        with pytest.raises(ValueError, match="BxL"):
            bench.parse_shape(bad)
    with pytest.raises(ValueError, match="BxDxN"):
        bench.parse_shape("8x8", parts=3)


def test_scan_bytes_and_exps_count_each_tensor_once():
    # The first shape in bf16: u, delta, z, y are 268 MB each, B and C 2 MB each.
    channel = 32 * 2048 * 2048 * 2
    state = 32 * 16 * 2048 * 2
    assert bench.scan_bytes(32, 2048, 2048, 16, 2, "fwd") == 4 * channel + 2 * state
    assert bench.scan_bytes(32, 2048, 2048, 16, 2, "bwd") == 7 * channel + 4 * state
    assert bench.scan_bytes(1, 4, 8, 2, 4, "fwd", groups=2) == 4 * 1 * 4 * 8 * 4 + 2 * 2 * 2 * 8 * 4
    with pytest.raises(ValueError, match="direction"):
        bench.scan_bytes(1, 1, 1, 1, 2, "sideways")
    assert bench.scan_exps(32, 2048, 2048, 16) == 32 * 2048 * 2048 * 16
    # mamba_ssm's forward at 32x2048 (2.30 ms) is the 0.47 TB/s and 0.93e12 exps/s.
    assert bench.per_second(bench.scan_bytes(32, 2048, 2048, 16, 2, "fwd"), 2.30) == pytest.approx(
        0.47e12, rel=0.01
    )
    assert bench.per_second(bench.scan_exps(32, 2048, 2048, 16), 2.30) == pytest.approx(0.93e12, rel=0.01)
    assert bench.per_second(1.0, None) is None and bench.per_second(1.0, 0.0) is None


def make_row(**overrides):
    kwargs = dict(
        dim=2048,
        d_state=16,
        itemsize=2,
        ms={"ours": 1.15, "reference": 400.0},
        status={"ours": "ok", "reference": "ok"},
        errors={"ours": 0.01, "naive": 0.008, "atol": 0.001},
        copy_bytes_per_s=4.0e12,
        exp2_per_s=4.0e12,
    )
    return bench.scan_row(32, 2048, "fwd", **(kwargs | overrides))


def test_scan_row_speedups_ceilings_and_suspect_flag():
    row = make_row()
    assert row["mamba_ssm_ms"] == 2.30 and row["speedup"]["vs_mamba_ssm"] == pytest.approx(2.0)
    assert row["speedup"]["vs_reference"] == pytest.approx(400 / 1.15)
    assert row["speedup"]["vs_mamba_ref"] is None  # measured at 8x2048 only
    assert row["bytes_per_s"] == pytest.approx(0.47e12 * 2, rel=0.01)
    assert row["fraction_of_copy"] == pytest.approx(row["bytes_per_s"] / 4.0e12)
    assert row["fraction_of_exp2"] == pytest.approx(row["exps_per_s"] / 4.0e12)
    assert row["ours_err_suspect"] is False and "atol" not in row["max_abs_err"]
    assert make_row(errors={"ours": 0.1, "naive": 0.008, "atol": 0.001})["ours_err_suspect"] is True
    assert make_row(errors={"ours": float("nan"), "naive": 0.008})["ours_err_suspect"] is True
    assert make_row(errors={})["ours_err_suspect"] is None
    # Another dim or N: the figures do not apply.
    assert make_row(dim=1024)["mamba_ssm_ms"] is None
    other = bench.scan_row(
        8, 2048, "fwd", dim=2048, d_state=16, itemsize=2, ms={"ours": 0.5}, status={"ours": "ok"}, errors={},
        copy_bytes_per_s=None, exp2_per_s=None,
    )  # fmt: skip
    assert other["speedup"]["vs_mamba_ref"] == pytest.approx(116.8 / 0.5)
    assert other["fraction_of_copy"] is None and other["speedup"]["vs_reference"] is None


def test_table_row_and_verdicts_render_a_row():
    row = make_row(status={"ours": "ok", "reference": "failed: RuntimeError: out of memory"})
    cells = dict(zip(bench.scan_table_header(), bench.scan_table_row(row), strict=True))
    assert cells["shape"] == "32x2048" and cells["dir"] == "fwd"
    assert cells["ours ms"] == "1.150" and cells["ref ms"] == "fail" and cells["mamba_ssm ms"] == "2.300"
    assert cells["x mamba_ssm"] == "2.00x" and cells["x mamba_ref"] == "-"
    assert cells["err ours"] == "1.0e-02" and cells["err naive"] == "8.0e-03"
    assert cells["of copy"].endswith("%") and cells["of exp2"].endswith("%")
    suspect = make_row(errors={"ours": 0.1, "naive": 0.008, "atol": 0.0})
    assert bench.scan_table_row(suspect)[bench.scan_table_header().index("err ours")] == "1.0e-01!"
    lines = bench.verdicts([make_row(), make_row(ms={"ours": 3.0, "reference": 100.0})])
    assert lines == [
        "  32x2048 fwd: 2.00x mamba_ssm's CUDA kernel (target >= 1.0): met",
        "  32x2048 fwd: 347.8x the PyTorch reference (target >= 50): met",
        "  32x2048 fwd: 0.77x mamba_ssm's CUDA kernel (target >= 1.0): MISSED",
        "  32x2048 fwd: 33.3x the PyTorch reference (target >= 50): MISSED",
    ]


def test_conv_speedups_and_table():
    # Speedups are each baseline's time over the row's at the same shape, layout and direction; the
    # decode step's old-mixer baseline is the old step.
    def row(provider, ms, direction="fwd", seqlen=2048, layout="contiguous"):
        return {"provider": provider, "batch": 32, "dim": 2048, "seqlen": seqlen, "width": 4,
                "layout": layout, "direction": direction, "ms": ms, "bytes_per_s": 4.0e11, "fraction_of_copy": 0.1,
                "max_abs_err": None}  # fmt: skip

    step = {"provider": "mixer_multiply_add_step", "batch": 8, "dim": 16, "width": 4, "direction": "step",
            "ms": 0.4, "bytes_per_s": 1e11, "fraction_of_copy": 0.09, "max_abs_err": 0.0}  # fmt: skip
    rows = [
        row("torch_conv1d", 1.37), row("mixer_multiply_add", 2.8), row("triton_causal_conv1d", 0.137),
        row("torch_conv1d", 2.56, "bwd"), row("triton_causal_conv1d", 0.5, "bwd"),
        row("triton_causal_conv1d", 0.1, seqlen=1024), step,
        {**step, "provider": "triton_causal_conv1d_update", "ms": 0.04},
        row("torch_conv1d", 2.55, layout="channel_last"), row("triton_causal_conv1d", 0.255, layout="channel_last"),
    ]  # fmt: skip
    out = bench.add_conv_speedups(rows)
    assert "speedup" not in rows[0]  # copies
    assert out[2]["speedup"] == {
        "vs_torch_conv1d": pytest.approx(10.0),
        "vs_mixer_multiply_add": pytest.approx(2.8 / 0.137),
    }
    assert out[4]["speedup"] == {"vs_torch_conv1d": pytest.approx(5.12), "vs_mixer_multiply_add": None}
    assert out[5]["speedup"] == {"vs_torch_conv1d": None, "vs_mixer_multiply_add": None}
    assert out[7]["speedup"] == {"vs_torch_conv1d": None, "vs_mixer_multiply_add": pytest.approx(10.0)}
    # The channel-last rows compare with each other only.
    assert out[9]["speedup"] == {"vs_torch_conv1d": pytest.approx(10.0), "vs_mixer_multiply_add": None}
    cells = dict(zip(bench.conv_table_header(), bench.conv_table_row(out[2]), strict=True))
    assert cells["BxDxL"] == "32x2048x2048" and cells["layout"] == "contiguous"
    assert cells["x torch"] == "10.00x" and cells["x old mixer"] == "20.44x"
    assert bench.conv_table_row(out[7])[1] == "8x16x1" and bench.conv_table_row(out[7])[2] == "-"
    assert (
        dict(zip(bench.conv_table_header(), bench.conv_table_row(out[4]), strict=True))["x old mixer"] == "-"
    )


def test_conv_input_layouts(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    for layout, fastest in (("contiguous", 2), ("channel_last", 1)):
        x = bench.conv_input(2, 3, 5, torch.float32, layout)
        assert x.shape == (2, 3, 5) and x.requires_grad and x.is_leaf and x.stride(fastest) == 1
    with pytest.raises(ValueError, match="unknown conv layout"):
        bench.conv_input(2, 3, 5, torch.float32, "sideways")


def test_old_mixer_conv_baselines_compute_the_conv():
    # The reproduced pre-kernel mixer path computes the same conv and step as the reference.
    conv = nn.Conv1d(6, 6, 4, groups=6).double()
    x = torch.randn(2, 6, 11, dtype=torch.float64)
    want = reference.causal_conv1d(x, conv.weight[:, 0], conv.bias)
    torch.testing.assert_close(bench.mixer_multiply_add(x, conv), want, rtol=1e-12, atol=1e-12)
    state = torch.randn(2, 6, 4, dtype=torch.float64)
    ref_state = state.clone()
    got = bench.mixer_multiply_add_step(x[..., 0], conv, state)
    want = reference.causal_conv1d_update(x[..., 0], ref_state, conv.weight[:, 0], conv.bias)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(state, ref_state)


def test_formatting_helpers():
    assert bench.fmt_ms(2.30123) == "2.301" and bench.fmt_ms(None) == "-"
    assert bench.fmt_pct(0.467) == "47%" and bench.fmt_pct(None) == "-"
    assert bench.fmt_rate(4.7e11) == "0.47" and bench.fmt_rate(None) == "-"


def test_parse_args_quick_and_defaults():
    full = bench.parse_args([])
    assert full.shapes == [(32, 2048), (8, 8192), (8, 2048)] and full.decode == (1024, 4096, 16)
    assert full.providers == ["ours", "reference"] and not full.no_conv and full.name == "selective-scan"
    quick = bench.parse_args(["--quick"])
    assert quick.shapes == [(8, 2048)] and quick.no_conv and quick.name == "selective-scan-quick"
    mixed = bench.parse_args(["--shapes", "4x512", "--providers", "ours", "ours", "--decode", "2x8x4"])
    assert mixed.shapes == [(4, 512)] and mixed.providers == ["ours"] and mixed.decode == (2, 8, 4)
    for bad in (["--shapes", "4"], ["--conv-width", "5"], ["--dim", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_script_without_gpu_exits_with_clear_message():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "selective_scan.py"), "--quick"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "benchmarks need a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr

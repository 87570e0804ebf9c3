"""The benchmarks' CPU-side logic: FLOP counts, table and JSON helpers, the no-GPU exit."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import common
from benchmarks.attention import (
    PROVIDERS,
    attention_flops,
    failure_summary,
    parse_args,
    table_header,
    table_row,
    visible_pairs,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def brute_force_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: int | None) -> int:
    """DESIGN.md's mask spelled out: query i sees key j iff j <= i + Tk - Tq (and j > that - w)."""
    if not causal:
        return seqlen_q * seqlen_k
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    last = i + seqlen_k - seqlen_q
    visible = j <= last
    if window is not None:
        visible &= j > last - window
    return int(visible.sum())


LENGTHS = [0, 1, 2, 3, 7, 16, 33, 64, 100]
WINDOWS = [None, 1, 2, 5, 16, 63, 64, 200]


@pytest.mark.parametrize("seqlen_q", LENGTHS)
@pytest.mark.parametrize("seqlen_k", LENGTHS)
def test_visible_pairs_matches_brute_force(seqlen_q, seqlen_k):
    assert visible_pairs(seqlen_q, seqlen_k, False) == seqlen_q * seqlen_k
    for window in WINDOWS:
        want = brute_force_pairs(seqlen_q, seqlen_k, True, window)
        assert visible_pairs(seqlen_q, seqlen_k, True, window) == want, (seqlen_q, seqlen_k, window)


def test_visible_pairs_matches_the_reference_mask():
    """Cross-check with the kernels' reference: rows it gives lse -inf see no key, and causal
    attention of all-zero scores averages exactly the visible values."""
    from kernels import reference

    tq, tk, w = 9, 13, 4
    q = torch.zeros(1, tq, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, tk, 1, 4, dtype=torch.float64)
    v = torch.ones(1, tk, 1, 4, dtype=torch.float64)
    _, lse = reference.flash_attention(q, k, v, causal=True, window=w, return_lse=True)
    # all scores are 0, so each row's lse is log(#visible keys)
    counts = torch.where(torch.isfinite(lse), lse.exp(), torch.zeros_like(lse)).round().sum()
    assert int(counts) == visible_pairs(tq, tk, True, w) == brute_force_pairs(tq, tk, True, w)


def test_visible_pairs_closed_forms_at_benchmark_sizes():
    t = 16384
    assert visible_pairs(t, t, True) == t * (t + 1) // 2
    w = 1024
    assert visible_pairs(t, t, True, w) == w * (w + 1) // 2 + (t - w) * w
    # a window at least as long as the sequence is plain causal
    assert visible_pairs(1024, 1024, True, 1024) == visible_pairs(1024, 1024, True)
    assert visible_pairs(1024, 1024, True, 5000) == visible_pairs(1024, 1024, True)


def test_visible_pairs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="causal"):
        visible_pairs(8, 8, False, 4)
    with pytest.raises(ValueError, match="window"):
        visible_pairs(8, 8, True, 0)
    with pytest.raises(ValueError, match="seqlen_q"):
        visible_pairs(-1, 8, True)
    with pytest.raises(TypeError):
        visible_pairs(8.0, 8, True)
    with pytest.raises(TypeError):
        visible_pairs(8, 8, True, 2.5)


def test_attention_flops_follows_flash_attention_convention():
    # non-causal: 4 * batch * heads * seqlen^2 * head_dim
    assert attention_flops(4, 16, 4096, 128, "noncausal", 1024) == 4 * 4 * 16 * 4096**2 * 128
    causal = attention_flops(4, 16, 4096, 128, "causal", 1024)
    assert causal == 4 * 4 * 16 * 128 * (4096 * 4097 // 2)
    assert abs(causal / (4 * 4 * 16 * 4096**2 * 128) - 0.5) < 1e-3  # about half
    window = attention_flops(4, 16, 4096, 128, "window", 1024)
    assert window == 4 * 4 * 16 * 128 * visible_pairs(4096, 4096, True, 1024)
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 8, 8, "sideways", 4)


def test_parse_args_quick_and_defaults():
    quick = parse_args(["--quick"])
    assert quick.head_dims == [128] and quick.seqlens == [1024, 4096] and quick.name == "attention-quick"
    full = parse_args([])
    assert full.head_dims == [64, 128] and full.seqlens == [1024, 2048, 4096, 8192, 16384]
    assert full.name == "attention" and full.providers == list(PROVIDERS)
    mixed = parse_args(["--quick", "--seqlens", "2048", "--head-dims", "64", "--out", "/tmp/x"])
    assert mixed.seqlens == [2048] and mixed.head_dims == [64] and mixed.out == Path("/tmp/x")


# ----------------------------------------------------------------------------------------------
# benchmarks/common.py
# ----------------------------------------------------------------------------------------------


def test_slugify_and_results_path(tmp_path):
    assert common.slugify("NVIDIA H200") == "nvidia-h200"
    assert common.slugify("NVIDIA GeForce RTX 4090 (x2)") == "nvidia-geforce-rtx-4090-x2"
    assert common.slugify("  ") == "unknown"
    path = common.results_path("attention", tmp_path, gpu="NVIDIA H200", date="2026-01-02")
    assert path == tmp_path / "2026-01-02-nvidia-h200-attention.json"
    # A second run of the same day keeps the first's file.
    path.write_text("[]")
    second = common.results_path("attention", tmp_path, gpu="NVIDIA H200", date="2026-01-02")
    assert second == tmp_path / "2026-01-02-nvidia-h200-attention-2.json"
    second.write_text("[]")
    assert common.results_path("attention", tmp_path, gpu="NVIDIA H200", date="2026-01-02").name.endswith("-3.json")
    assert common.results_path("x", gpu="A100").parent == common.RESULTS_DIR
    assert common.results_path("x", gpu="A100").name.startswith(common.today())


def test_tflops_ratio_and_formatting():
    assert common.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert common.tflops(1e12, 2.0) == pytest.approx(500.0)
    assert common.tflops(1e12, None) is None
    assert common.ratio(3.0, 2.0) == 1.5
    assert (
        common.ratio(None, 2.0) is None and common.ratio(1.0, None) is None and common.ratio(1.0, 0) is None
    )
    assert common.fmt_tflops(512.345) == "512.3" and common.fmt_tflops(None) == "-"
    assert common.fmt_ratio(1.049) == "1.05x" and common.fmt_ratio(None) == "-"
    assert common.fmt_sci(0.00391) == "3.9e-03" and common.fmt_sci(None) == "-"


def test_host_us_times_the_calls_between_the_syncs():
    events = []
    ticks = iter([10.0, 10.5])  # host clock at the start and the end of the timed calls
    got = common.host_us(
        lambda: events.append("call"), calls=5, sync=lambda: events.append("sync"), clock=lambda: next(ticks)
    )
    # warm-up call, sync, 5 timed calls, sync: 0.5 s over 5 calls = 100000 us per call
    assert events == ["call", "sync", *["call"] * 5, "sync"] and got == pytest.approx(1e5)
    with pytest.raises(ValueError, match="calls must be >= 1"):
        common.host_us(lambda: None, calls=0, sync=lambda: None)


def test_format_table_aligns_columns():
    text = common.format_table(
        ["mode", "seqlen", "ours"], [["causal", 1024, "512.3"], ["window1024", 16384, None]]
    )
    lines = text.splitlines()
    assert len(lines) == 4
    assert len({len(line) for line in lines}) == 1  # every line has the same width
    assert lines[0].split() == ["mode", "seqlen", "ours"]
    assert set(lines[1].replace("  ", "")) == {"-"}
    assert lines[2].split() == ["causal", "1024", "512.3"]
    assert lines[3].split() == ["window1024", "16384", "-"]
    assert lines[2].startswith("causal ")  # text left-aligned
    assert lines[2].endswith("512.3") and " 1024" in lines[2]  # numbers right-aligned
    with pytest.raises(ValueError, match="header"):
        common.format_table(["a", "b"], [[1]])


def test_write_json_is_atomic_strict_json(tmp_path):
    path = tmp_path / "sub" / "r.json"
    payload = {"rows": [{"tflops": 1.5, "err": float("nan"), "x": None, "t": (1, 2)}], "inf": float("inf")}
    assert common.write_json(path, payload) == path
    data = json.loads(path.read_text())  # strict parser: NaN would be an error in other readers
    assert data == {"rows": [{"tflops": 1.5, "err": "nan", "x": None, "t": [1, 2]}], "inf": "inf"}
    common.write_json(path, {"rows": []})  # overwrite in place, no temp files left behind
    assert json.loads(path.read_text()) == {"rows": []}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_versions_has_the_design_fields():
    info = common.versions()
    for key in ("torch", "triton", "cuda", "gpu", "date", "git_sha"):
        assert key in info
    assert info["torch"] == torch.__version__
    assert len(info["date"]) == 10 and info["date"] == common.today()


def test_short_reason_is_one_line():
    err = RuntimeError("No available kernel. Aborting execution.\nmore detail")
    reason = common.short_reason(err, ["cuDNN attention: head dim 256 unsupported\nstack", ""])
    assert reason == (
        "RuntimeError: No available kernel. Aborting execution. [warnings: cuDNN attention: head dim 256 unsupported]"
    )
    assert common.short_reason(ValueError()) == "ValueError"
    assert len(common.short_reason(ValueError("x" * 1000))) == 300


def test_table_row_and_failure_summary_render_a_result_row():
    """A row as run_config builds it renders as the table says: TFLOP/s, n/a, fail, ratios, errors."""
    row = {
        "mode": "window",
        "window": 1024,
        "head_dim": 128,
        "seqlen": 4096,
        "direction": "fwd",
        "tflops": {"ours": 400.0, "sdpa_flash": None, "sdpa_cudnn": None, "flex": 200.0},
        "status": {
            "ours": "ok",
            "sdpa_flash": "n/a: SDPA has no sliding-window kernel",
            "sdpa_cudnn": "failed: RuntimeError: boom",
            "flex": "ok",
        },
        "ratio": {"ours/sdpa_flash": None, "ours/sdpa_cudnn": None, "ours/flex": 2.0},
        "max_abs_err": {"ours": 0.01, "sdpa_flash": None, "sdpa_cudnn": None, "flex": 0.002},
        "best_baseline_err": 0.002,
        "ours_err_suspect": True,
    }
    header = table_header(PROVIDERS)
    cells = table_row(row, PROVIDERS)
    assert len(header) == len(cells)
    got = dict(zip(header, cells, strict=True))
    assert got["mode"] == "window1024" and got["dir"] == "fwd"
    assert got["ours"] == "400.0" and got["sdpa_flash"] == "n/a" and got["sdpa_cudnn"] == "fail"
    assert got["ours/flex"] == "2.00x" and got["ours/sdpa_flash"] == "-"
    assert got["err ours"] == "1.0e-02!" and got["err best base"] == "2.0e-03"
    summary = failure_summary([row, row], PROVIDERS)
    assert summary == [
        "  sdpa_flash: n/a: SDPA has no sliding-window kernel (2 rows)",
        "  sdpa_cudnn: failed: RuntimeError: boom (2 rows)",
    ]
    # without ours there are no ratio columns
    assert not [h for h in table_header(["flex"]) if "/" in h]


def test_script_without_gpu_exits_with_clear_message():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "attention.py"), "--quick"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "benchmarks need a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_graph_ms_refuses_an_unknown_flush_before_touching_cuda():
    with pytest.raises(ValueError, match=r"flush must be one of \('read', 'zero'\), got 'clean'"):
        common.bench_graph_ms(lambda: None, flush="clean")


@pytest.mark.parametrize("script", ["attention", "decode", "linear_attention", "selective_scan"])
def test_benchmarks_refuse_an_unusable_out_folder_before_timing(tmp_path, script, capsys):
    # The results are written after the first measured shape: an unusable --out must stop the run
    # at argument parsing, with argparse's one-line error, not with a traceback minutes in.
    module = importlib.import_module(f"benchmarks.{script}")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--out", str(blocker / "results")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {blocker / 'results'}: {blocker} is a file, not a folder; pass --out <a writable folder>" in err
    assert module.parse_args(["--out", str(tmp_path / "new" / "folder")]).out == tmp_path / "new" / "folder"

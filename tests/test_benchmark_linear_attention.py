"""benchmarks/linear_attention.py's CPU-side logic: shapes, the crossover, table rows, CLI, no-GPU exit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.linear_attention import (
    DECODE,
    PROVIDERS,
    SHAPES,
    crossover,
    graph_backward_rounds,
    parse_args,
    parse_shape,
    reference_fn,
    speedups,
    sweep_crossovers,
    table_header,
    table_row,
    time_rounds,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_parse_shape():
    assert parse_shape("2x8192x16x128") == (2, 8192, 16, 128, 128)
    assert parse_shape("1X300x2x273x64") == (1, 300, 2, 273, 64)
    assert parse_shape("256x16x128", parts=3) == (256, 16, 128, 128)
    assert parse_shape("256x16x128x64", parts=3) == (256, 16, 128, 64)
    for bad in ("2x8192x16", "2x8192x16x0", "2xTx16x128", "", "1x2x3x4x5x6"):
        with pytest.raises(ValueError, match="expected BxTxHxD"):
            parse_shape(bad)
    with pytest.raises(ValueError, match="expected BxHxD"):
        parse_shape("256x16", parts=3)


def test_crossover_interpolates_the_crossing():
    seqlens = [512, 1024, 2048, 4096, 8192]
    ours = [1.0] * 5
    # other / ours = T / 1500: a power law in T, so the log-log interpolation is exact.
    other = [t / 1500 for t in seqlens]
    got = crossover(seqlens, ours, other)
    assert got["first_faster"] == 2048
    assert got["estimate"] == pytest.approx(1500)
    assert "T=1024 and T=2048" in got["note"]


def test_crossover_edge_cases():
    seqlens = [256, 512, 1024]
    # Faster everywhere: no estimate below the shortest length.
    got = crossover(seqlens, [1, 1, 1], [2, 3, 4])
    assert got == {"first_faster": 256, "estimate": None, "note": "faster from the shortest measured T=256"}
    # Never faster.
    assert crossover(seqlens, [2, 2, 2], [1, 1, 2])["first_faster"] is None
    # Faster, slower, faster: the crossover is where ours *stays* faster.
    got = crossover([256, 512, 1024, 2048], [1, 1, 1, 1], [2, 0.5, 2, 4])
    assert got["first_faster"] == 1024 and 512 < got["estimate"] < 1024
    # Missing measurements are skipped (and order does not matter).
    got = crossover([1024, 256, 512], [1, None, 1], [4, 9, 0.5])
    assert got["first_faster"] == 1024 and 512 < got["estimate"] < 1024
    assert crossover([256], [None], [1.0])["note"] == "no length measured by both"


def _row(part, seqlen, direction, ours, flash, **extra):
    ms = {
        "ours": ours,
        "ours_norm": extra.get("norm"),
        "fla": extra.get("fla"),
        "fla_norm": extra.get("fla_norm"),
        "flash": flash,
    }
    status = {p: "ok" if ms[p] is not None else "n/a: fla-core is not installed" for p in PROVIDERS}
    return {
        "part": part,
        "batch": 2,
        "seqlen": seqlen,
        "heads": 16,
        "k_dim": 128,
        "v_dim": 128,
        "direction": direction,
        "ms": ms,
        "status": status,
        "speedup": speedups(ms),
        "max_abs_err": {"ours": 0.01, "ours_norm": 0.001, "fla": 0.002, "fla_norm": 0.004, "flash": 0.003},
        "ours_err_suspect": True,
        # GPU times: half the eager ones (the host's share gone), flash's not measured
        "graph_ms": {p: None if v is None or p == "flash" else v / 2 for p, v in ms.items()},
        "graph_speedup": speedups({**ms, "flash": None}),
    }


def test_sweep_crossovers_per_direction_and_total():
    rows = [_row("shape", 8192, "fwd", 1.0, 0.1)]  # not part of the sweep: ignored
    for t in (1024, 2048, 4096):
        rows.append(_row("sweep", t, "fwd", 1.0, t / 2048))  # crosses at 2048 (equal there: not faster)
        rows.append(_row("sweep", t, "bwd", 2.0, t / 1024))  # crosses at 2048
    got = sweep_crossovers(rows)
    assert got["fwd"]["first_faster"] == 4096
    assert got["bwd"]["first_faster"] == 4096 and got["bwd"]["estimate"] == pytest.approx(2048)
    # fwd+bwd: ours 3.0 vs flash 1.5 T / 1024 -> equal at T = 2048
    assert got["fwd+bwd"]["first_faster"] == 4096 and got["fwd+bwd"]["estimate"] == pytest.approx(2048)
    assert math.isclose(got["fwd"]["estimate"], 2048)
    # On the GPU times, which lack flash here: no length measured by both.
    assert sweep_crossovers(rows, "graph_ms")["fwd"]["note"] == "no length measured by both"
    for r in rows:
        r["graph_ms"]["flash"] = r["ms"]["flash"]  # flash's GPU time = eager, ours' halved: earlier crossing
    assert sweep_crossovers(rows, "graph_ms")["fwd"]["estimate"] == pytest.approx(1024)


def test_speedups_are_the_others_time_over_ours():
    got = speedups({"ours": 0.5, "ours_norm": 0.6, "fla": 1.0, "fla_norm": 1.5, "flash": None})
    assert got == {
        "vs_fla": 2.0,
        "vs_flash": None,
        "norm_over_raw": pytest.approx(1.2),
        "norm_vs_fla_norm": pytest.approx(2.5),
    }
    assert speedups({"ours": 0.5, "ours_norm": None, "fla_norm": 1.5})["norm_vs_fla_norm"] is None


def test_each_provider_is_checked_against_its_own_op():
    for name, normalize in (("ours", False), ("fla", False), ("ours_norm", True), ("fla_norm", True)):
        assert reference_fn(name, 64).keywords == {"scale": 64**-0.5, "normalize": normalize}
    assert reference_fn("flash", 64).keywords == {"causal": True}


def test_graph_backward_rounds_subtract_the_forward_per_round():
    assert graph_backward_rounds([0.2, 0.25], [0.9, 0.8]) == pytest.approx([0.7, 0.55])
    with pytest.raises(ValueError, match="2 forward rounds but 1"):
        graph_backward_rounds([0.2, 0.25], [0.9])


def test_table_row_renders_a_result_row():
    row = _row("shape", 8192, "bwd", 0.8, 2.4, norm=0.88, fla=0.924, fla_norm=1.76)
    row["status"]["fla"] = "failed: RuntimeError: boom"
    header, cells = table_header(), table_row(row)
    assert len(header) == len(cells)
    got = dict(zip(header, cells, strict=True))
    assert got["shape"] == "B2 T8192 H16 D128" and got["dir"] == "bwd"
    assert got["ours ms"] == "0.800" and got["ours_norm ms"] == "0.880" and got["fla ms"] == "fail"
    assert got["x fla"] == "1.16x" and got["x flash"] == "3.00x" and got["norm/raw"] == "1.10x"
    assert got["fla_norm ms"] == "1.760" and got["norm x fla_norm"] == "2.00x"
    assert got["err ours"] == "1.0e-02!" and got["err fla"] == "2.0e-03"
    missing = _row("sweep", 1024, "fwd", 1.0, 0.5)
    missing["k_dim"] = 273
    got = dict(zip(header, table_row(missing), strict=True))
    assert got["fla_norm ms"] == "n/a" and got["norm x fla_norm"] == "-"
    assert got["fla ms"] == "n/a" and got["x fla"] == "-" and got["shape"] == "B2 T1024 H16 K273 V128"
    # --providers ours ours_norm: the rows hold no status for the providers not asked for
    subset = _row("shape", 8192, "fwd", 1.0, 0.5, norm=1.1)
    del subset["status"]["fla"], subset["status"]["fla_norm"], subset["status"]["flash"]
    got = dict(zip(header, table_row(subset), strict=True))
    assert got["fla ms"] == "n/a" and got["flash ms"] == "n/a" and got["ours_norm ms"] == "1.100"
    # The GPU-time line of the same row: its own times and ratios, "-" where none was measured.
    got = dict(zip(header, table_row(row, "graph_ms"), strict=True))
    assert got["ours ms"] == "0.400" and got["ours_norm ms"] == "0.440" and got["flash ms"] == "-"
    assert got["fla ms"] == "fail" and got["x flash"] == "-" and got["norm/raw"] == "1.10x"


def test_parse_args_defaults_and_quick():
    full = parse_args([])
    assert full.shapes == list(SHAPES) and full.decode == DECODE and full.name == "linear-attention"
    assert full.seqlens == [256, 512, 1024, 2048, 4096, 8192, 16384] and full.providers == list(PROVIDERS)
    quick = parse_args(["--quick"])
    assert (
        quick.shapes == [SHAPES[0]]
        and quick.seqlens == [1024, 4096]
        and quick.name == "linear-attention-quick"
    )
    mixed = parse_args(["--shapes", "1x300x2x273x64", "--decode", "8x4x64", "--providers", "ours", "ours"])
    assert (
        mixed.shapes == [(1, 300, 2, 273, 64)]
        and mixed.decode == (8, 4, 64, 64)
        and mixed.providers == ["ours"]
    )
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "1x2x3"])
    with pytest.raises(SystemExit):
        parse_args(["--seqlens", "0"])
    assert full.rounds == 3 and parse_args(["--rounds", "5"]).rounds == 5
    assert not full.no_graph and parse_args(["--no-graph"]).no_graph
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_time_rounds_interleaves_and_isolates_failures():
    calls = []

    def bench(fn):
        calls.append(fn())
        if calls[-1] == "bad" and calls.count("bad") == 2:
            raise RuntimeError("out of memory")
        return float(len(calls))

    timed = {"a": lambda: "a", "b": lambda: "bad", "c": lambda: "c"}
    times, errors = time_rounds(timed, 3, bench=bench)
    # round-robin order, and "b" is dropped after its failure in round 2 (keeping round 1's time)
    assert calls == ["a", "bad", "c", "a", "bad", "c", "a", "c"]
    assert times == {"a": [1.0, 4.0, 7.0], "b": [2.0], "c": [3.0, 6.0, 8.0]}
    assert list(errors) == ["b"] and "out of memory" in str(errors["b"])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        time_rounds(timed, 0, bench=bench)


def test_script_without_gpu_exits_with_clear_message():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "linear_attention.py"), "--quick"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "benchmarks need a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr

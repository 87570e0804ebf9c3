"""benchmarks/kernel_resources.py: kernels compiled for sm_90 on a CPU, registers and spills read back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kernel_resources as tool

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_tool(*argv: str, interpret: str | None = None) -> subprocess.CompletedProcess:
    # conftest sets TRITON_INTERPRET=1 for this process on a CPU machine; the tool needs the compiler.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "kernel_resources.py"), *argv],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )  # fmt: skip


def test_decode_kernel_compiles_for_sm90_and_reports_its_resources():
    out = run_tool("--kernel", "flash_decode_split")
    assert out.returncode == 0, out.stderr
    lines = re.findall(r"B(\d+) KV (\d+), (\d+) splits: tile (\d+), (\d+) warps, (\d+) stages -> "
                       r"REG (\d+), STACK (\d+), smem (\d+)", out.stdout)  # fmt: skip
    assert [(b, kv) for b, kv, *_ in lines] == [("1", "8192"), ("1", "32768"), ("8", "8192"), ("8", "131072")]
    for *_, warps, stages, regs, stack, smem in lines:
        assert warps == "4" and 1 <= int(stages) <= 3
        assert 16 <= int(regs) <= 255 and int(stack) >= 0
        assert int(smem) > 0  # the pipeline's K / V buffers
    # A larger key tile holds more in registers: the tool really recompiles with the override.
    regs = {}
    for block in ("16", "128"):
        forced = run_tool("--kernel", "flash_decode_split", "--block", block, "--stages", "1")
        assert forced.returncode == 0, forced.stderr
        regs[block] = [int(r) for r in re.findall(rf"tile {block}, 4 warps, 1 stages -> REG (\d+)", forced.stdout)]
        assert len(regs[block]) == 4
    assert regs["128"][0] > regs["16"][0]
    # Tiles whose buffers exceed what a program may use are flagged, not printed as if they ran.
    huge = run_tool("--kernel", "flash_decode_split", "--block", "1024", "--stages", "2")
    assert huge.returncode == 0, huge.stderr
    assert huge.stdout.count("(over sm_90's 232448: cannot launch)") == 4
    assert "cannot launch" not in out.stdout


def test_refuses_the_interpreter_and_bad_options():
    out = run_tool("--kernel", "flash_decode_split", interpret="1")
    assert out.returncode != 0 and "unset TRITON_INTERPRET" in out.stderr
    bad = (["--block", "24"], ["--warps", "0"], ["--warps", "3"], ["--warps", "64"], ["--stages", "50"],
           ["--kernel", "flash_attention"], ["--arch", "12"], ["--arch", "75"])  # fmt: skip
    for argv in bad:
        with pytest.raises(SystemExit):
            tool.parse_args(argv)
    assert tool.parse_args([]).kernel == list(tool.KERNELS)


def test_compile_for_names_a_missing_argument():
    import importlib

    fd = importlib.import_module("kernels.flash_decode")
    with pytest.raises(ValueError, match="flash_decode_split_kernel: no value for argument 'Q'"):
        tool.compile_for(fd.flash_decode_split_kernel, {}, {}, num_warps=4, num_stages=1)

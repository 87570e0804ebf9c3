"""Registers, spills and shared memory of mixerlab's Triton kernels, compiled for an NVIDIA GPU
architecture on a machine without one.

    python benchmarks/kernel_resources.py                          # both kernels, sm_90 (H100 / H200)
    python benchmarks/kernel_resources.py --kernel linear_attention_fused_fwd --warps 8
    python benchmarks/kernel_resources.py --kernel flash_decode_split --arch 80

Triton compiles to a cubin without a device (its wheel bundles ``ptxas``); the wheel's
``cuobjdump -res-usage`` then reads the registers per thread (``REG``), the stack frame per thread in
bytes (``STACK``: spilled registers live there, so > 0 means spills) and the static shared memory;
Triton's own figure for the shared memory a launch needs (its pipeline buffers) is printed beside
them. Each kernel is specialised as a launch would specialise it (integer arguments equal to 1 are
constants, pointers and multiples of 16 are marked 16-divisible, the run-time integers each kernel
names in ``do_not_specialize`` are left alone), at the issue shapes, with the tiles the host code
picks for them (``kernels.linear_attention.fused_config``, ``kernels.flash_decode.split_config``)
unless ``--block``, ``--warps`` or ``--stages`` override them.

Why: a kernel that spills or overflows its registers is slow for reasons no CPU test shows, and the
GPU machine's time is scarce. The figures depend on the Triton (and ``ptxas``) version, which is
printed: read them as a guide to the GPU's build (the H200 ran Triton 3.6 in 2026-12), not as its
figures. Needs the compiler, so not under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

KERNELS = ("linear_attention_fused_fwd", "flash_decode_split")
# Compute capabilities with bf16 tensor cores that Triton's NVIDIA backend compiles for (others abort
# inside LLVM, and sm_75 emulates bf16), and the shared memory one program may opt into there, bytes
# (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                    120: 101376}  # fmt: skip
ARCHS = tuple(MAX_SHARED_BYTES)


def compile_for(
    fn: Any,
    args: dict[str, Any],
    constexprs: dict[str, Any],
    *,
    num_warps: int,
    num_stages: int,
    arch: int = 90,
) -> Any:
    """Compile the ``@triton.jit`` function ``fn`` for ``sm_<arch>`` without a GPU.

    Args:
        fn: the JIT function (not an autotuner: pass ``kernel.fn``).
        args: every non-constexpr argument: a pointer's element type as a string (``"*bf16"``), a
            Python float (fp32) or a Python int (its value decides the specialisation: 1 becomes a
            constant, multiples of 16 are marked 16-divisible, unless ``fn`` lists the argument in
            ``do_not_specialize``).
        constexprs: the ``tl.constexpr`` arguments.
        num_warps, num_stages: the launch options.
        arch: compute capability as an int (90 = sm_90).

    Returns:
        Triton's ``CompiledKernel`` (``.asm["cubin"]``, ``.metadata.shared``).

    Raises:
        ValueError: an argument of ``fn`` missing from ``args`` and ``constexprs``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # do_not_specialize holds indices or names depending on the Triton version.
    plain = {fn.arg_names[x] if isinstance(x, int) else x for x in getattr(fn, "do_not_specialize", ())}
    signature: dict[str, str] = {}
    constants = dict(constexprs)
    attrs: dict[tuple[int, ...], list] = {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name not in args:
            raise ValueError(f"{fn.__name__}: no value for argument {name!r}; pass it in args or constexprs")
        value = args[name]
        if isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and name not in plain:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in plain:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constants, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(kernel: Any) -> dict[str, int]:
    """``{"registers", "stack_bytes", "static_shared_bytes", "shared_bytes"}`` of a compiled kernel:
    per-thread registers and stack (bytes) from ``cuobjdump -res-usage`` (the Triton wheel's), the
    static shared memory it reports, and Triton's shared memory per launch (bytes).

    Raises:
        RuntimeError: cuobjdump missing from the Triton wheel, or its output unreadable.
    """
    import triton

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        raise RuntimeError(f"cuobjdump not found at {cuobjdump}: this Triton wheel has no NVIDIA tools")
    with tempfile.TemporaryDirectory() as folder:
        cubin = pathlib.Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True)
    fields = {}
    for line in out.stdout.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    try:
        return {
            "registers": int(fields["REG"]),
            "stack_bytes": int(fields["STACK"]),
            "static_shared_bytes": int(fields["SHARED"]),
            "shared_bytes": int(kernel.metadata.shared),
        }
    except (KeyError, ValueError) as err:
        raise RuntimeError(f"could not read cuobjdump's resource usage: {out.stdout!r} {out.stderr!r}") from err


def _strides(names: Sequence[str], *shape: int) -> dict[str, int]:
    """The contiguous strides of ``shape`` (elements), keyed by the kernel's stride argument names."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return dict(zip(names, strides[::-1], strict=True))


def linear_attention_cases(block: int | None, warps: int | None, stages: int | None) -> Iterator[tuple]:
    """(label, fn, args, constexprs, warps, stages) of the fused LA forward at issue 5's shapes (bf16):
    unnormalised, normalised with z carried and normalised with z loaded (the path
    ``kernels.linear_attention.loads_chunk_z`` picks at K = 128; at K = 64 it is compiled for
    comparison only), each without / with the per-chunk states stored for the backward."""
    import torch

    la = importlib.import_module("kernels.linear_attention")
    block_e, num_warps, num_stages = la.fused_config(torch.bfloat16)
    block_e, num_warps, num_stages = block or block_e, warps or num_warps, stages or num_stages
    for batch, seqlen, heads, dim in ((2, 8192, 16, 128), (8, 2048, 32, 64)):
        args: dict[str, Any] = {name: "*bf16" for name in ("Q", "K", "V", "Out", "STATES", "ZC")}
        args |= {name: "*fp32" for name in ("S_IN", "Z_IN", "SEG", "ZSEG", "ZSTATES", "DEN", "S_OUT", "Z_OUT")}
        for tensor, last in (("q", "d"), ("k", "d"), ("v", "e"), ("o", "e")):
            names = [f"stride_{tensor}{axis}" for axis in ("b", "t", "h", last)]
            args |= _strides(names, batch, seqlen, heads, dim)
        args |= _strides(["stride_sb", "stride_sh", "stride_sd", "stride_se"], batch, heads, dim, dim)
        args |= _strides(["stride_zb", "stride_zh", "stride_zd"], batch, heads, dim)
        args |= {"num_heads": heads, "T": seqlen, "D_DIM": dim, "E_DIM": dim, "chunks_per_seg": 8,
                 "scale": dim**-0.5, "scale_lo": 0.0, "eps": 1e-10}  # fmt: skip
        for normalize, zc_loaded in ((False, False), (True, False), (True, True)):
            for store in (False, True):
                constexprs = {"ZC_LOADED": zc_loaded, "LATE_STATE_STORE": zc_loaded,
                              "HAS_S_IN": False, "HAS_Z_IN": False, "NORMALIZE": normalize, "STORE_STATES": store,
                              "FP64": False, "DOT_PRECISION": "tf32", "BLOCK_T": la.chunk_size(torch.bfloat16),
                              "BLOCK_D": max(16, dim), "BLOCK_E": min(block_e, dim)}  # fmt: skip
                label = (f"B{batch} T{seqlen} H{heads} K=V={dim} {'normalised' if normalize else 'raw'}"
                         f"{', states stored' if store else ''}{', z loaded' if zc_loaded else ''}")  # fmt: skip
                yield label, la.linear_attention_fused_fwd_kernel, args, constexprs, num_warps, num_stages


def flash_decode_cases(block: int | None, warps: int | None, stages: int | None) -> Iterator[tuple]:
    """(label, fn, args, constexprs, warps, stages) of the split-K decode kernel at issue 6's shapes
    (bf16, 32 query heads over 8 KV heads, head dim 128, contiguous cache), split counts and tiles
    as ``kernels.flash_decode`` picks them for an H200."""
    import torch

    fd = importlib.import_module("kernels.flash_decode")
    heads, kv_heads, dim = 32, 8, 128
    group = heads // kv_heads
    for batch, seqlen in ((1, 8192), (1, 32768), (8, 8192), (8, 131072)):
        splits = fd.num_splits_heuristic(batch, kv_heads, seqlen)
        block_n, num_warps, num_stages = fd.split_config(torch.bfloat16, dim, batch * kv_heads * splits)
        block_n, num_warps, num_stages = block or block_n, warps or num_warps, stages or num_stages
        args: dict[str, Any] = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BLOCK_TABLE": "*i32", "SEQLENS": "*i32",
                                "OUT": "*bf16", "WORKSPACE": "*fp32", "COUNTERS": "*i32"}  # fmt: skip
        args |= _strides(["stride_qb", "stride_qh", "stride_qd"], batch, heads, dim)
        for tensor in ("k", "v"):  # one page of the whole length per sequence
            names = [f"stride_{tensor}{axis}" for axis in ("p", "s", "h", "d")]
            args |= _strides(names, batch, seqlen, kv_heads, dim)
        args |= {"stride_tb": 1, "stride_tp": 1, "stride_sb": 1}
        args |= _strides(["stride_ob", "stride_oh", "stride_od"], batch, heads, dim)
        args |= {"group": group, "block_size": seqlen, "window": 0, "num_splits": splits,
                 "qk_scale": dim**-0.5, "qk_scale_lo": 0.0, "capacity": seqlen}  # fmt: skip
        constexprs = {"HAS_WINDOW": False, "SPLIT": splits > 1, "FP64": False, "DOT_PRECISION": "tf32",
                      "HEAD_DIM": dim, "BLOCK_D": dim, "BLOCK_G": 16, "BLOCK_N": block_n, "BLOCK_H": group,
                      "BLOCK_S": min(fd.next_power_of_2(splits), fd.COMBINE_ELEMENTS // (group * dim))}  # fmt: skip
        label = f"B{batch} KV {seqlen}, {splits} splits"
        yield label, fd.flash_decode_split_kernel, args, constexprs, num_warps, num_stages


CASES = {"linear_attention_fused_fwd": linear_attention_cases, "flash_decode_split": flash_decode_cases}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Registers, spills and shared memory of mixerlab's Triton kernels, compiled without a GPU."
    )
    parser.add_argument("--kernel", choices=KERNELS, nargs="+", default=list(KERNELS))
    parser.add_argument(
        "--arch", type=int, choices=ARCHS, default=90, help="compute capability as an int (default 90: H100 / H200)"
    )
    parser.add_argument("--block", type=int, help="override the tile (BLOCK_E of the LA forward, BLOCK_N of decode)")
    parser.add_argument("--warps", type=int, help="override num_warps")
    parser.add_argument("--stages", type=int, help="override num_stages")
    args = parser.parse_args(argv)
    if args.warps is not None and args.warps not in (1, 2, 4, 8, 16, 32):
        parser.error(f"--warps must be a power of two from 1 to 32 (1024 threads a program), got {args.warps}")
    if args.stages is not None and not 1 <= args.stages <= 8:
        parser.error(f"--stages must be in [1, 8], got {args.stages}")
    if args.block is not None and (args.block < 16 or args.block & (args.block - 1)):
        parser.error(f"--block must be a power of two >= 16 (tl.dot's smallest tile), got {args.block}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Compile every case of the chosen kernels and print one line each; returns the exit status."""
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit(
            "benchmarks/kernel_resources.py compiles the kernels, which the interpreter cannot: unset "
            "TRITON_INTERPRET (it is only for running kernels on a CPU)"
        )
    import triton

    print(f"Triton {triton.__version__}, sm_{args.arch}; REG = registers per thread, STACK = stack bytes per "
          "thread (> 0: spills), smem = Triton's shared memory per launch", flush=True)  # fmt: skip
    for kernel in args.kernel:
        print(f"\n{kernel}")
        for label, fn, kernel_args, constexprs, warps, stages in CASES[kernel](args.block, args.warps, args.stages):
            tile = constexprs.get("BLOCK_E", constexprs.get("BLOCK_N"))
            compiled = compile_for(fn, kernel_args, constexprs, num_warps=warps, num_stages=stages, arch=args.arch)
            usage = resource_usage(compiled)
            limit = MAX_SHARED_BYTES[args.arch]
            fits = "" if usage["shared_bytes"] <= limit else f" (over sm_{args.arch}'s {limit}: cannot launch)"
            print(f"  {label}: tile {tile}, {warps} warps, {stages} stages -> REG {usage['registers']}, "
                  f"STACK {usage['stack_bytes']}, smem {usage['shared_bytes']}{fits}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Under the CPU interpreter every Triton op refuses bfloat16 (Triton's CPU emulation computes bf16
arithmetic and bf16 ``tl.dot`` wrongly: silent garbage), with a message naming the way out."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import _host

pytestmark = pytest.mark.skipif(
    not _host.INTERPRET, reason="the guard applies under TRITON_INTERPRET=1 (CPU runs)"
)

BF16 = torch.bfloat16


def _inputs(op):
    r = torch.randn
    if op == "flash_attention":
        return lambda dt: kernels.flash_attention(
            *(r(1, 5, 2, 16, dtype=dt) for _ in range(3)), backend="triton"
        )
    if op == "flash_decode":
        table, seqlens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        return lambda dt: kernels.flash_decode(
            r(1, 2, 16, dtype=dt),
            r(1, 4, 1, 16, dtype=dt),
            r(1, 4, 1, 16, dtype=dt),
            table,
            seqlens,
            backend="triton",
        )
    if op == "linear_attention":
        return lambda dt: kernels.linear_attention(
            *(r(1, 5, 2, 16, dtype=dt).abs() for _ in range(3)), backend="triton"
        )
    if op == "selective_scan":
        return lambda dt: kernels.selective_scan(
            r(1, 4, 6, dtype=dt),
            r(1, 4, 6, dtype=dt),
            -torch.rand(4, 8),
            r(1, 8, 6, dtype=dt),
            r(1, 8, 6, dtype=dt),
            backend="triton",
        )
    if op == "causal_conv1d":
        return lambda dt: kernels.causal_conv1d(r(1, 4, 6, dtype=dt), r(4, 3, dtype=dt), backend="triton")
    raise AssertionError(op)


@pytest.mark.parametrize(
    "op", ["flash_attention", "flash_decode", "linear_attention", "selective_scan", "causal_conv1d"]
)
def test_bfloat16_is_refused_under_the_interpreter(op):
    call = _inputs(op)
    call(torch.float32)  # the same inputs in float32 run
    with pytest.raises(
        ValueError, match=rf"Triton {op} cannot run bfloat16 under the CPU interpreter.*float16 or float32"
    ):
        call(BF16)

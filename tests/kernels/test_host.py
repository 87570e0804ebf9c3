"""The kernels' shared host helpers (kernels._host): they decide launch shapes and scalar arguments,
so a wrong value here is a wrong kernel call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from kernels import _host


def test_next_power_of_2_matches_triton():
    # Used for every tile shape on the host (faster than Triton's wrapper); must agree everywhere.
    for n in [*range(-3, 4100), 2**20 - 1, 2**20, 2**20 + 1, 2**40 + 3]:
        assert _host.next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 127, 128):
            assert _host.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert _host.cdiv(2**40 + 3, 64) == triton.cdiv(2**40 + 3, 64)


def test_split_fp64_and_fp32_range():
    for x in (0.1, 1 / 3, 88.0**-0.5, 1e-30, -7.25e37):
        hi, lo = _host.split_fp64(x)
        assert float(np.float32(hi)) == hi  # hi is fp32-representable
        assert abs(hi + lo - x) <= abs(x) * 2.0**-52
    _host.check_fp32_scalars("op", scale=3.0e38, eps=0.0)
    with pytest.raises(ValueError, match=r"op: scale 3e\+38 overflows float32.*backend='reference'"):
        _host.check_fp32_scalars("op", 1.4426950408889634, scale=3.0e38)
    with pytest.raises(ValueError, match="eps -1e\\+39 overflows"):
        _host.check_fp32_scalars("op", eps=-1e39)


def test_check_int32_offsets_bounds():
    # (size - 1) * stride along a checked dim must stay below 2**31 where the stride fits int32;
    # a stride of 2**31 or more reaches the kernel as int64. Meta tensors and shapes: no memory.
    check = _host.check_int32_offsets
    fits = torch.Size((1, 2**21, 16, 64))  # contiguous: (2**21 - 1) * 1024 = 2**31 - 1024
    int64_stride = torch.empty_strided((1, 9, 1, 16), (0, 2**31, 0, 1), device="meta")
    check("op", "fix it", (1, 3), o=fits, q=int64_stride)
    message = (r"^the Triton op indexes o with int32 offsets, but its dim 1 spans \(2097153 - 1\) x "
               r"stride 1024 = 2147483648 elements, past 2\*\*31 - 1; fix it$")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check("op", "fix it", (1, 3), o=torch.Size((1, 2**21 + 1, 16, 64)))
    wide = torch.empty_strided((1, 4, 1, 9), (0, 1, 0, 2**28), device="meta")  # the feature dim
    with pytest.raises(ValueError, match=r"indexes k with int32 offsets, but its dim 3 spans \(9 - 1\)"):
        check("op", "fix it", (1, 3), q=None, k=wide)
    check("op", "fix it", (1,), k=wide)  # dims not checked are left alone

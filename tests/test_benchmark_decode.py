"""benchmarks/decode.py's CPU-side logic: byte counts, inputs (paged == contiguous), table, args."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode as bench
from kernels import reference


def test_kv_bytes_and_bandwidth():
    # Batch 1, 8k keys, 8 KV heads of 128, bf16: K and V are 2 x 16.8 MB.
    assert bench.kv_bytes(1, 8192, 8, 128, 2) == 2 * 8192 * 8 * 128 * 2 == 33_554_432
    assert bench.tb_per_s(33_554_432, 10.0) == pytest.approx(3.3554432)
    assert bench.tb_per_s(1.0, None) is None and bench.tb_per_s(1.0, 0.0) is None


def test_paged_inputs_hold_the_contiguous_cache_and_providers_agree():
    torch.manual_seed(0)
    x = bench.make_inputs(2, 40, 16, torch.float32, device="cpu")  # 40 keys: a partial third page
    assert x["k_pool"].shape == (2 * 3, 16, bench.NUM_KV_HEADS, bench.HEAD_DIM)
    pos = torch.arange(40)
    for b in range(2):
        pages = x["table"][b, pos // 16].long()
        assert torch.equal(x["k_pool"][pages, pos % 16], x["k"][b])
        assert torch.equal(x["v_pool"][pages, pos % 16], x["v"][b])
    want = reference.flash_decode(x["q"], x["k"], x["v"], x["contiguous_table"], x["seqlens"])
    for name in ("ours", "ours_paged", "sdpa_gqa", "sdpa_repeat"):
        torch.testing.assert_close(bench.make_provider(name, x)(), want, rtol=1e-5, atol=1e-5)
    for splits in (1, 3, 40):  # forced split counts: one chunk, uneven chunks, one key per split
        torch.testing.assert_close(bench.make_provider(f"ours_splits{splits}", x)(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(bench.make_provider("read", x)(), x["v"])
    # The one-pass read floor loads every element of K and V once: its partial sums add up to theirs.
    sums = bench.make_provider("read_kv", x)()
    assert sums.shape == (bench.READ_KV_MIN_PROGRAMS, bench.READ_KV_BLOCK)
    want_sum = (x["k"].double() + x["v"].double()).sum()
    torch.testing.assert_close(sums.double().sum(), want_sum, rtol=1e-6, atol=1e-3)
    with pytest.raises(ValueError, match="contiguous k and v of one shape"):
        bench.read_kv(x["k"], x["v"][:, :39])
    with pytest.raises(ValueError, match="contiguous k and v of one shape"):
        bench.read_kv(x["k"].transpose(1, 2), x["v"].transpose(1, 2))
    with pytest.raises(ValueError, match="out must have shape"):
        bench.read_kv(x["k"], x["v"], torch.empty(3, bench.READ_KV_BLOCK))
    with pytest.raises(ValueError, match="unknown provider"):
        bench.make_provider("flashinfer", x)


def test_parse_args_and_table_row():
    args = bench.parse_args(["--quick"])
    assert args.batches == [1] and args.seqlens == [8192, 32768] and args.name == "decode-quick"
    args = bench.parse_args([])
    assert args.batches == [1, 8] and args.seqlens == [2048, 8192, 32768, 131072] and args.page_size == 64
    with pytest.raises(SystemExit):
        bench.parse_args(["--seqlens", "0"])
    assert bench.parse_args(["--num-splits", "16", "60"]).num_splits == [16, 60]
    with pytest.raises(SystemExit):
        bench.parse_args(["--num-splits", "0"])
    assert args.flush == "read" and bench.parse_args(["--flush", "zero"]).flush == "zero"
    with pytest.raises(SystemExit):
        bench.parse_args(["--flush", "none"])
    row = {
        "batch": 1, "seqlen": 8192, "page_size": 64, "kv_bytes": 33_554_432,
        "us": {"ours": 10.0, "sdpa_gqa": 22.5, "read": 16.0}, "tb_s": {"ours": 3.36, "sdpa_gqa": 1.49, "read": 2.1},
        "max_abs_err": {"ours": 1e-3}, "error": {}, "copy_tb_s": 4.2, "ours_vs_sdpa_gqa": 2.25,
        "paged_vs_contiguous": 0.98, "ours_of_copy_bw": 0.8, "ceiling_vs_sdpa_gqa": 1.86,
    }  # fmt: skip
    providers = ["ours", "sdpa_gqa", "read"]
    cells = bench.table_row(row, providers)
    assert len(cells) == len(bench.table_header(providers))
    assert cells[3] == "10.0 (3.36)" and "2.25x" in cells and "80%" in cells
    assert cells[len(providers) + 4] == "1.86x"  # the ceiling column, after ours/sdpa_gqa
    assert bench.host_row(row, providers) == ["1", "8192", "-", "-", "-"]  # no host times: an old row
    row["host_us"] = {"ours": 61.25, "sdpa_gqa": 19.0}
    assert bench.host_row(row, providers) == ["1", "8192", "61.2", "19.0", "-"]


def test_script_without_gpu_exits_with_clear_message():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="benchmarks need a CUDA GPU.*benchmarks/decode.py"):
        bench.main(["--quick"])

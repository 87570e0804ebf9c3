"""eval/decode.py at tiny sizes on CPU: records, measured state bytes, the roofline hand-off."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from eval import roofline as rl
from eval.decode import build_model, decode_eval
from eval.records import REPO_ROOT


def compose_decode(*overrides):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="eval/decode", overrides=list(overrides))


@pytest.mark.parametrize("mixer", ["attention", "sliding_window"])
def test_decode_eval_writes_records_and_plot(tmp_path, mixer):
    output = tmp_path / "decode.json"
    cfg = compose_decode(
        f"mixer={mixer}", "model.n_layers=2", "context_lengths=[8,40]", "decode_steps=2", "batch_size=2",
        "device=cpu", f"output={output}",
    )  # fmt: skip
    records = decode_eval(cfg)
    assert json.loads(output.read_text()) == records
    assert output.with_suffix(".png").stat().st_size > 0
    model = build_model(cfg)
    metrics = {(r["metric"], r["seqlen"]) for r in records}
    for context in (8, 40):
        for metric in ("state_bytes", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_bandwidth"):
            assert (metric, context) in metrics
    for r in records:
        assert r["mixer"] == mixer and r["batch"] == 2 and r["value"] > 0
        # Measured from the cache tensors, equal to the analytic size of a cache for context + steps.
        assert r["state_bytes"] == model.state_size(r["seqlen"] + 2)
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

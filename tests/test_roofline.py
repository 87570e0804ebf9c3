"""eval/roofline.py: the issue's attention-traffic figures, reproduced from the formulas."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import compose_eval
from hydra import compose, initialize_config_dir

from eval import roofline as rl
from eval.records import REPO_ROOT


@pytest.fixture(scope="module")
def cfg():
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf" / "eval"), version_base="1.3"):
        return compose(config_name="roofline")


def test_issue_figures(cfg):
    f = rl.issue_figures(cfg)
    # N x d terms ~2 MB, N^2 terms ~134 MB (N = 8192, d = 128, fp16).
    assert f["nd_bytes"] == 8192 * 128 * 2 and round(f["nd_bytes"] / 1e6, 1) == 2.1
    assert f["n2_bytes"] == 8192**2 * 2 and round(f["n2_bytes"] / 1e6) == 134
    # Naive attention moves the score matrix four times; 32 heads x 32 layers -> ~549 GB.
    assert f["naive_n2_passes"] == 4
    assert f["prefill_n2_bytes"] == 4 * 8192**2 * 2 * 32 * 32
    assert 549e9 <= f["prefill_n2_bytes"] < 550e9
    # ~164 ms at 3.35 TB/s, ~129 ms at 4.27 TB/s.
    assert round(f["prefill_naive_s@h100"] * 1e3) == 164
    assert round(f["prefill_naive_s@h200_measured"] * 1e3) == 129
    # FLOPs 4 N^2 d per head.
    assert f["flops_per_head"] == 4 * 8192**2 * 128
    assert f["prefill_flops"] == 32 * 32 * 4 * 8192**2 * 128
    # 32-layer decode: 7 launches x 5 us per layer = 1.12 ms against a 4.5 ms step.
    assert f["decode_launch_s"] == pytest.approx(1.12e-3)
    assert f["decode_step_s"] == pytest.approx(4.5e-3)
    # FlashAttention keeps only the N x d terms: 4 N d b per head.
    assert f["prefill_flash_bytes"] == 32 * 32 * 4 * 8192 * 128 * 2


def test_printed_report_and_measured_rows(cfg, tmp_path, capsys):
    records = [
        # A decode step of batch 4 reading 1 GB of weights and 4 x 0.25 GB of cache: 2 GB at
        # 4.27 TB/s -> 0.468 ms floor, 8540 tokens/s; measured 4270 tokens/s = 50%.
        {"run": "r", "mixer": "attention", "metric": "decode_tokens_per_s", "value": 4270.0, "batch": 4,
         "seqlen": 1024, "weight_bytes": 1e9, "state_bytes": 0.25e9, "mode": "eager"},
        # A prefill bound by its FLOPs: 989e12 FLOPs take 1 s at 989 TFLOP/s.
        {"run": "r", "mixer": "mamba", "metric": "prefill_tokens_per_s", "value": 1000.0, "batch": 2,
         "seqlen": 1000, "weight_bytes": 1e6, "state_bytes": 1e3, "flops": 989e12},
        {"run": "r", "mixer": "mamba", "metric": "state_bytes", "value": 1.0},  # not a throughput
    ]  # fmt: skip
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(records))
    run_cfg = cfg.copy()
    run_cfg.records = [str(path)]
    out = rl.roofline(run_cfg)
    printed = capsys.readouterr().out
    for text in ("2.10 MB", "134.22 MB", "4x", "549.8 GB", "164.1 ms", "128.7 ms", "1.12 ms", "4.5 ms"):
        assert text in printed
    decode, prefill = out["measured"]
    assert decode["kind"] == "decode (eager)"
    assert decode["floor_tokens_per_s"] == pytest.approx(4 / (2e9 / 4.27e12))
    assert decode["fraction"] == pytest.approx(4270 / decode["floor_tokens_per_s"])
    assert prefill["floor_tokens_per_s"] == pytest.approx(2000.0)
    assert prefill["fraction"] == pytest.approx(0.5)
    # records=decode.json (one file, no brackets) was read as a list of its characters.
    run_cfg.records = str(path)
    assert rl.roofline(run_cfg)["measured"] == out["measured"]
    run_cfg.records = 5
    with pytest.raises(ValueError, match=r"records must be a file or a list of files \(records=\[a.json,b.json\]\), got 5"):
        rl.roofline(run_cfg)


def test_records_missing_fields_raise(cfg, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"run": "r", "metric": "decode_tokens_per_s", "value": 1.0, "batch": 1}]))
    with pytest.raises(ValueError, match=r"lacks \['seqlen', 'weight_bytes', 'state_bytes'\]"):
        rl.measured_vs_floor(rl.load_records([str(path)]), 4.27, 989)
    # A new user's finding: a null value was reported as missing.
    record = {"run": "r", "metric": "decode_tokens_per_s", "value": None, "batch": 1, "seqlen": 8,
              "weight_bytes": 10, "state_bytes": 4}  # fmt: skip
    path.write_text(json.dumps([record]))
    with pytest.raises(ValueError, match=r"has \['value'\] = null; it needs numbers there"):
        rl.load_records([str(path)])
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="JSON list"):
        rl.load_records([str(path)])


def test_bad_settings_and_record_files_are_named(cfg, tmp_path):
    from omegaconf import OmegaConf

    for override, message in [
        ("seqlen=0", "seqlen must be a positive integer, got 0"),
        ("seqlen=-5", "seqlen must be a positive integer, got -5"),
        ("head_dim=abc", "head_dim must be a positive integer, got 'abc'"),
        ("bandwidth_tb_s=0", "bandwidth_tb_s must be a finite positive number"),
        ("decode.launch_us=-1", "decode.launch_us must be a finite non-negative number"),
    ]:
        bad = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
        with pytest.raises(ValueError, match=message):
            rl.roofline(bad)
    empty = tmp_path / "decode-empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match="decode-empty.json is not valid JSON"):
        rl.load_records([str(empty)])
    with pytest.raises(FileNotFoundError, match="records file not found: .*missing.json"):
        rl.load_records([str(tmp_path / "missing.json")])


# A decode record as eval/decode.py writes it: 32 decode steps after a 1024-token context.
DECODE_RECORD = {"run": "r", "mixer": "attention", "metric": "decode_tokens_per_s", "value": 4270.0, "batch": 4,
                 "seqlen": 1024, "weight_bytes": 1e9, "state_bytes": 0.25e9, "decode_steps": 32}  # fmt: skip


@pytest.mark.parametrize(
    "override, message",
    [
        # Found by a review: nan and inf passed the "<= 0" checks and printed nan figures, or divided by zero.
        ("bandwidths_tb_s.h100=nan", "bandwidths_tb_s.h100 must be a finite positive number, got nan"),
        ("peak_tflops=nan", "peak_tflops must be a finite positive number, got nan"),
        ("decode.launch_us=nan", "decode.launch_us must be a finite non-negative number, got nan"),
        ("decode.step_ms=inf", "decode.step_ms must be a finite positive number, got inf"),
        ("bandwidth_tb_s=inf", "bandwidth_tb_s must be a finite positive number, got inf"),
        ("bandwidth_tb_s=nan", "bandwidth_tb_s must be a finite positive number, got nan"),
        ("bandwidths_tb_s=5", r"bandwidths_tb_s must be a mapping of name: TB/s, got 5; set one with "),
        ("decode=5", "decode must be a mapping of launches_per_layer, launch_us and step_ms, got 5"),
        # A new-user check: a misspelt key ran with the default value, without a word.
        ("+decode.launch_uss=3", r"unknown decode keys \['launch_uss'\] \(decode.launch_uss: did you mean "
         r"decode.launch_us\?\); decode holds launches_per_layer, launch_us, step_ms"),
    ],
)
def test_non_finite_and_malformed_settings_are_refused(override, message, tmp_path, capsys):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps([DECODE_RECORD]))
    bad = compose_eval("roofline", [override, f"records=[{path}]"])
    with pytest.raises(ValueError, match=message):
        rl.roofline(bad)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "change, message",
    [
        # weight and cache bytes 0: the floor was 0 s, and tokens / floor a ZeroDivisionError.
        ({"weight_bytes": 0, "state_bytes": 0}, "has weight_bytes=0; it must be a finite number > 0"),
        # "unsupported operand type(s) for +: 'int' and 'str'", printed after the figures.
        ({"state_bytes": "1000"}, "has state_bytes='1000'; it must be a finite number >= 0"),
        ({"batch": 4.0}, r"has batch=4.0; it must be an integer > 0"),
        ({"value": math.nan}, "has value=nan; it must be a finite number >= 0"),
        ({"value": -1.0}, "has value=-1.0; it must be a finite number >= 0"),
        ({"decode_steps": -2}, "has decode_steps=-2; it must be an integer >= 0"),
    ],
)
def test_bad_records_are_refused_naming_the_file_before_anything_is_printed(
    cfg, tmp_path, capsys, change, message
):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps([{"run": "r", "metric": "state_bytes", "value": 1.0}, DECODE_RECORD | change]))
    run_cfg = cfg.copy()
    run_cfg.records = [str(path)]
    with pytest.raises(
        ValueError, match=rf"decode\.json: record 1 \(run 'r', decode_tokens_per_s\) {message}"
    ):
        rl.roofline(run_cfg)
    assert capsys.readouterr().out == ""


def test_record_files_that_are_not_record_lists_are_named(cfg, tmp_path):
    ints = tmp_path / "ints.json"
    ints.write_text("[1, 2]")  # was: AttributeError: 'int' object has no attribute 'get'
    with pytest.raises(ValueError, match=r"ints\.json: record 0 is 1, not a result record \(a JSON object\)"):
        rl.load_records([str(ints)])
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")  # was: a utf-8 decode error that did not name the file
    with pytest.raises(ValueError, match=r"plot\.png is not valid JSON \('utf-8' codec can't decode"):
        rl.load_records([str(png)])
    folder = tmp_path / "dec"
    folder.mkdir()  # was: "records file not found: dec"
    with pytest.raises(
        ValueError, match=rf"records file {folder} is a directory; records= takes the JSON files"
    ):
        rl.load_records([str(folder)])
    (folder / "decode-mamba-tiny.json").write_text("[]")
    with pytest.raises(ValueError, match=rf"e\.g\. records=\[{folder}/decode-mamba-tiny\.json\]"):
        rl.load_records([str(folder)])


def test_measured_rows_say_the_cache_is_the_allocated_one(cfg, tmp_path, capsys):
    # eval/decode.py's state_bytes is the cache allocated for the context plus the decode steps.
    given = DECODE_RECORD | {"seqlen": 2048, "cache_seqlen": 2080, "device": "NVIDIA H200"}
    older = {k: v for k, v in DECODE_RECORD.items() if k != "decode_steps"}  # says neither
    path = tmp_path / "decode.json"
    path.write_text(json.dumps([DECODE_RECORD, given, older]))
    run_cfg = cfg.copy()
    run_cfg.records = [str(path)]
    rows = rl.roofline(run_cfg)["measured"]
    assert [r["cache_seqlen"] for r in rows] == [1056, 2080, None]
    table = capsys.readouterr().out.split("Measured beside the floor")[1].splitlines()
    assert "cache len" in table[1]
    assert [line.split()[4] for line in table[2:5]] == ["1056", "2080", "?"]
    assert table[5].startswith("cache len: the tokens each sequence's cache was allocated for")
    assert "though an attention step reads only the" in table[6]
    # Found by a new-user check: CPU records against the H200's floor, with nothing saying so.
    assert table[1].endswith("measured on") and [r["device"] for r in rows] == [None, "NVIDIA H200", None]
    assert table[2].endswith("%  ?") and table[3].endswith("%  NVIDIA H200")
    assert "measured on: the record's device; the floor is the one of bandwidth_tb_s" in table[7]


def test_records_take_glob_patterns(cfg, tmp_path):
    """Found by a new-user check: records=[dec/decode-*.json] was "records file not found", where
    eval/report.py's runs= expands patterns."""
    for name in ("decode-attention-tiny.json", "decode-mamba-tiny.json"):
        (tmp_path / name).write_text(json.dumps([DECODE_RECORD | {"mixer": name.split("-")[1]}]))
    (tmp_path / "decode-notes.txt").write_text("not records")
    records = rl.load_records([str(tmp_path / "decode-*")])
    assert [r["mixer"] for r in records] == ["attention", "mamba"]
    everything = rl.record_paths([str(tmp_path / "**" / "*.json")])
    assert everything == sorted(str(p) for p in tmp_path.glob("*.json"))
    # A file named by a pattern and by its path is read once (a fresh-clone check got its rows twice).
    twice = [str(tmp_path / "decode-*.json"), str(tmp_path / "decode-mamba-tiny.json")]
    assert [r["mixer"] for r in rl.load_records(twice)] == ["attention", "mamba"]
    missing = r"records pattern '.*nothing-\*\.json' matches no \.json file"
    with pytest.raises(FileNotFoundError, match=missing):
        rl.load_records([str(tmp_path / "nothing-*.json")])


def test_a_records_file_of_another_script_is_refused(tmp_path, capsys):
    # A new-user check: records=[<a recall .json>] (or a train.json) printed a note and exited with
    # status 0, where the other evaluations refuse a wrong kind of input.
    recall = tmp_path / "best.ckpt.recall.json"
    recall.write_text(json.dumps([{"run": "r", "mixer": "attention", "task": "mqar", "metric": "accuracy",
                                   "value": 0.5}]))  # fmt: skip
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(recall))} holds eval/recall.py's records \(task mqar; metrics accuracy\), "
        r"not eval/decode.py's; give records= the decode-\*.json files eval/decode.py writes$",
    ):
        rl.load_records([str(recall)], [])
    train = tmp_path / "results" / "train.json"
    train.parent.mkdir()
    metrics = ["val/acc", "val/acc_T64", "val/acc_T128", "val/loss", "val/loss_T64", "val/loss_T128"]
    train.write_text(json.dumps([{"run": "r", "task": "mqar", "metric": m, "value": 0.5} for m in metrics]))
    train_records = (
        r"train.py's records \(task mqar; metrics val/acc, val/acc_T128, val/acc_T64, val/loss, "
        r"\.\.\. \(6 in all\)\), not eval/decode.py's"
    )
    (tmp_path / "empty.json").write_text("[]")
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps([DECODE_RECORD]))
    empty = (tmp_path / "empty.json", r"no records \(it is an empty list\)")
    for path, what in [(train, train_records), empty]:
        bad = compose_eval("roofline", [f"records=[{decode},{path}]"])
        with pytest.raises(ValueError, match=f"holds {what}"):
            rl.roofline(bad)
        assert capsys.readouterr().out == ""  # refused before anything is printed
    notes: list[str] = []
    rl.load_records([str(decode)], notes)
    assert notes == []


def test_a_decode_file_without_throughput_records_is_noted(tmp_path):
    """eval/decode.py's file of a sweep whose every length ran out of memory holds decode_oom records
    only: read, with a note naming it (it is eval/decode.py's, so not refused)."""
    oom = tmp_path / "decode-attention-base.json"
    oom.write_text(json.dumps([{"run": "r", "task": "decode", "metric": "decode_oom", "value": 1.0,
                                "reason": "CUDA out of memory"}]))  # fmt: skip
    notes: list[str] = []
    records = rl.load_records([str(oom)], notes)
    assert records == json.loads(oom.read_text())
    assert notes == [
        f"{oom} holds no prefill_tokens_per_s or decode_tokens_per_s record; its metrics are decode_oom"
    ]


def test_a_sweep_leaves_no_multirun_yaml_and_refuses_an_unwritable_folder_in_one_line(tmp_path):
    """A new-user check: ``eval/*.py -m`` left Hydra's multirun.yaml in the working folder (the
    evaluations make no Hydra folder), and failed in an OSError traceback in a read-only one."""
    script = [sys.executable, str(REPO_ROOT / "eval" / "roofline.py"), "-m", "seqlen=1024,2048"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("FLOPs per head") == 2 and list(tmp_path.iterdir()) == []
    # One that was there (another sweep's) is written back as it was, with its permission bits (they
    # were the temporary file's 0600: a carried new-user note), and into the file a hard link shares.
    (tmp_path / "multirun.yaml").write_text("# an earlier sweep's\n")
    (tmp_path / "multirun.yaml").chmod(0o640)
    result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["multirun.yaml"]
    assert (tmp_path / "multirun.yaml").read_text() == "# an earlier sweep's\n"
    assert (tmp_path / "multirun.yaml").stat().st_mode & 0o777 == 0o640
    (tmp_path / "keep").mkdir()
    os.link(tmp_path / "multirun.yaml", tmp_path / "keep" / "linked.yaml")
    result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "keep" / "linked.yaml").read_text() == "# an earlier sweep's\n"
    assert (tmp_path / "multirun.yaml").stat().st_ino == (tmp_path / "keep" / "linked.yaml").stat().st_ino
    shutil.rmtree(tmp_path / "keep")
    # A symbolic link, dangling too (a new-user check: the link was removed and the file Hydra wrote at
    # its target left there); a folder of that name is refused (was an IsADirectoryError traceback).
    (tmp_path / "multirun.yaml").unlink()
    for target in ("kept.yaml", "missing.yaml"):
        (tmp_path / "multirun.yaml").symlink_to(target)
        result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert os.readlink(tmp_path / "multirun.yaml") == target and not (tmp_path / "missing.yaml").exists()
        (tmp_path / "multirun.yaml").unlink()
        (tmp_path / "kept.yaml").write_text("# kept\n")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.yaml"] and (tmp_path / "kept.yaml").read_text() == "# kept\n"
    (tmp_path / "kept.yaml").unlink()
    (tmp_path / "multirun.yaml").mkdir()
    result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr == (
        "error: hydra.sweep.dir=. holds a folder named multirun.yaml, where Hydra saves the sweep's file; pass "
        "hydra.sweep.dir=<another folder>\n"
    )
    (tmp_path / "multirun.yaml").rmdir()
    # Nor the jobs' folders that Hydra makes, nor a sweep folder made for it (another new-user check),
    # while folders that were there stay.
    (tmp_path / "mine").mkdir()
    for where in (["hydra.sweep.subdir=${seqlen}"], ["hydra.sweep.dir=a/b", "hydra.sweep.subdir=x/${seqlen}"],
                  ["hydra.sweep.dir=mine", "hydra.sweep.subdir=${seqlen}"]):  # fmt: skip
        args = [*script, *where]
        result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert [p.name for p in tmp_path.iterdir()] == ["mine"] and not any((tmp_path / "mine").iterdir())
    (tmp_path / "mine").rmdir()
    # A subdir leading outside the sweep folder is refused: Hydra's empty job folders there stayed (a
    # carried new-user note).
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "lnk").symlink_to(tmp_path)
    for subdir in ("../out/${seqlen}", str(tmp_path / "abs" / "${seqlen}"), "lnk/${seqlen}"):
        args = [*script, f"hydra.sweep.subdir={subdir}"]
        result = subprocess.run(args, cwd=tmp_path / "in", env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and result.stdout == ""
        link = f": {tmp_path / 'in' / 'lnk'} is a symbolic link to {tmp_path}" if subdir.startswith("lnk") else ""
        assert result.stderr == (
            f"error: hydra.sweep.subdir={subdir} leads outside hydra.sweep.dir=.{link}: an evaluation writes "
            "nothing into its jobs' folders, and Hydra would leave them there empty; leave hydra.sweep.subdir "
            "out (or keep it inside hydra.sweep.dir)\n"
        )
        assert [p.name for p in tmp_path.iterdir()] == ["in"] and os.listdir(tmp_path / "in") == ["lnk"]
    shutil.rmtree(tmp_path / "in")
    # /proc refuses new files, root's too (chmod would not stop root, which CI may run as).
    result = subprocess.run(script, cwd="/proc", env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "error: hydra.sweep.dir=. cannot be written (Hydra saves a sweep's multirun.yaml there): creating "
        "a file in /proc failed: No such file or directory; pass hydra.sweep.dir=<a writable folder>\n"
    )

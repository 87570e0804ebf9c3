"""eval/report.py on hand-written run directories: plots, tables, HTML and markdown, W&B, errors."""

from __future__ import annotations

import base64
import itertools
import json
import math
import random
import re
import runpy
import shutil
import sys
import warnings
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import REPO_ROOT, compose_eval, refuse_files_in, without_wandb_key
from matplotlib import rcParams
from matplotlib.text import Text
from matplotlib.ticker import ScalarFormatter
from matplotlib.transforms import Bbox

import data as data_lib
from eval.records import write_sweep_records
from eval.report import (
    Sources,
    _loss_scale_notes,
    _md_row,
    accuracy_points,
    build_report,
    read_val_loss_curve,
    recall_vs_state_points,
    val_loss_points,
)
from eval.report_plots import PLOTS, plain_text, plot_points
from eval.report_tables import (
    compact_layout,
    differing_settings,
    fold_slice,
    lr_groups,
    run_scores,
    summary_tables,
)

STATE = {  # decode-state bytes per sequence at a length, per mixer (made up, of the right shape)
    "attention": lambda t: 2048 * t,
    "mamba": lambda t: 40960,
    "hybrid_jamba": lambda t: 8192 + 256 * t,
}
PARAMS = {"attention": 123_424, "mamba": 170_016, "hybrid_jamba": 150_000}


def rec(run, mixer, metric, value, seqlen, **extra):
    """A record as eval/records.py's make_record writes it."""
    return {
        "run": run, "mixer": mixer, "layout": [mixer] * 2, "params": PARAMS[mixer], "task": "mqar",
        "metric": metric, "value": value, "state_bytes": STATE[mixer](seqlen), "seqlen": seqlen,
        "tokens_per_s": None, "device": "cpu", "git_sha": None, "time": "2026-11-30T00:00:00+00:00", **extra,
    }  # fmt: skip


def recall_records(run, mixer, accs, paths):
    """eval/recall.py's records: accuracy at 64, 128, 256 tokens through each path in ``paths``
    (the parallel path scores 0.01 lower, so the preferred path is visible)."""
    ckpt = f"/runs/{run}/checkpoints/last.ckpt"
    return [
        rec(
            run,
            mixer,
            "accuracy",
            acc - (0.01 if path == "parallel" else 0.0),
            t,
            path=path,
            split="test",
            slice=f"T{t}_kv{t // 16}",
            checkpoint=ckpt,
        )
        for t, acc in zip((64, 128, 256), accs, strict=True)
        for path in paths
    ]


def train_records(run, mixer, accs, loss, train_tokens=None):
    """train.py's results/train.json: per-slice val/acc, val/acc and val/loss at the training seqlen."""
    extra = {"split": "val"} | ({"train_tokens": train_tokens} if train_tokens is not None else {})
    slices = [
        rec(run, mixer, f"val/acc_T{t}_kv{t // 16}", a, t, **extra)
        for t, a in zip((64, 128), accs, strict=True)
    ]
    return slices + [
        rec(run, mixer, "val/acc", accs[0], 64, **extra),
        rec(run, mixer, "val/loss", loss, 64, **extra),
    ]


def decode_records(mixer, speeds, graph_speeds=()):
    """eval/decode.py's records at contexts 1024 and 4096 (eager, and CUDA-graph where given)."""
    run = f"decode-{mixer}-tiny"
    common = {"task": "decode", "batch": 1, "dtype": "float32", "weight_bytes": 10**6, "decode_steps": 32}
    out = []
    for i, t in enumerate((1024, 4096)):
        out += [
            rec(run, mixer, "state_bytes", STATE[mixer](t), t, **common),
            rec(run, mixer, "decode_tokens_per_s", speeds[i], t, mode="eager", **common),
            rec(run, mixer, "prefill_tokens_per_s", 1e5, t, **common),
        ]
        if graph_speeds:
            out.append(
                rec(run, mixer, "decode_tokens_per_s", graph_speeds[i], t, mode="cuda_graph", **common)
            )
    return out


METRICS_CSV = """epoch,lr-AdamW/pg1,step,train/acc,train/loss,train/tokens,val/acc,val/loss
,0.001,4,,,,,
0,,4,0.1,4.0,1000.0,,
0,,4,,,,0.2,3.0
,0.002,9,,,,,
0,,9,0.3,2.5,2000.0,,
0,,9,,,,0.5,2.0
1,,10,,,,0.5,2.0
"""


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Three train runs (CSV curve; records with train_tokens; W&B summary only), two decode record
    files and an unrelated JSON file."""
    root = tmp_path_factory.mktemp("runs")
    att = root / "att-run"
    write_json(att / "checkpoints" / "last.ckpt.recall.json",
               recall_records("att-run", "attention", [0.99, 0.9, 0.6], ["parallel", "decode"]))  # fmt: skip
    write_json(att / "results" / "train.json", train_records("att-run", "attention", [0.97, 0.8], 0.5, 4096))
    (att / "csv").mkdir()
    (att / "csv" / "metrics.csv").write_text(METRICS_CSV)
    (att / "csv" / "hparams.yaml").write_text("model:\n  name: attention\n")
    mamba = root / "mamba-run"
    write_json(mamba / "checkpoints" / "last.ckpt.recall.json",
               recall_records("mamba-run", "mamba", [0.51, 0.31, 0.11], ["parallel"]))  # fmt: skip
    write_json(mamba / "results" / "train.json", train_records("mamba-run", "mamba", [0.5, 0.3], 1.5, 8192))
    jamba = root / "jamba-run"
    write_json(jamba / "results" / "train.json", train_records("jamba-run", "hybrid_jamba", [0.7, 0.6], 1.0))
    write_json(jamba / "wandb" / "offline-run-1" / "files" / "wandb-summary.json",
               {"train/tokens": 3000, "val/loss": 1.0, "_step": 9})  # fmt: skip
    decode = root / "decode"
    write_json(
        decode / "decode-attention-tiny.json", decode_records("attention", [500.0, 200.0], [900.0, 400.0])
    )
    write_json(decode / "decode-mamba-tiny.json", decode_records("mamba", [800.0, 800.0]))
    write_json(decode / "benchmark.json", {"rows": [], "gpu": "none"})
    return root


def make_report(runs_arg, out: Path, *overrides):
    cfg = compose_eval("report", [f"runs={runs_arg}", f"out={out}", *overrides])
    return build_report(cfg)


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    dirs = ",".join(str(runs / d) for d in ("att-run", "mamba-run", "jamba-run", "decode"))
    return make_report(f"[{dirs}]", out)


class Page(HTMLParser):
    """The parts of the report page the tests look at: h2 titles, images, tables, tags, notes."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.h2, self.images, self.tables, self.tags, self.notes = [], [], [], set(), []
        self._in, self._text = None, ""
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        if tag in ("h2", "td", "th", "p", "li"):
            self._in, self._text = (tag, attrs.get("class")), ""

    def handle_data(self, data):
        self._text += data

    def handle_endtag(self, tag):
        if self._in is None or tag != self._in[0]:
            return
        if tag == "h2":
            self.h2.append(self._text)
        elif tag in ("td", "th"):
            self.tables[-1][-1].append(self._text)
        elif self._in[1] == "note" or tag == "li":
            self.notes.append(self._text)
        self._in = None


def legend(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_recall_vs_state_bytes_plot(report):
    fig = report.figures["recall_vs_state_bytes"]
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "bytes" in ax.get_xlabel() and "accuracy" in ax.get_ylabel()
    # One marker set per run and mixer; jamba has only train.py's validation records.
    assert legend(fig) == ["attention [att-run]", "hybrid_jamba [jamba-run] (val)", "mamba [mamba-run]"]
    offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
    # At each run's shortest length (64): the decode path where both ran, parallel where only it did.
    assert offsets == [(2048 * 64, 0.99), (8192 + 256 * 64, 0.7), (40960, 0.5)]
    assert sorted(t.get_text() for t in ax.texts) == ["attention @ 64", "hybrid_jamba @ 64", "mamba @ 64"]


def test_accuracy_vs_length_plot(report):
    ax = report.figures["accuracy_vs_length"].axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert isinstance(ax.xaxis.get_major_formatter(), ScalarFormatter)  # 64, 128, not 2^6, 2^7
    assert "tokens" in ax.get_xlabel() and "accuracy" in ax.get_ylabel()
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {
        "attention [att-run]": ([64, 128, 256], [0.99, 0.9, 0.6]),
        "hybrid_jamba [jamba-run] (val)": ([64, 128], [0.7, 0.6]),
        "mamba [mamba-run]": ([64, 128, 256], pytest.approx([0.5, 0.3, 0.1])),
    }


def test_val_loss_vs_tokens_plot(report):
    ax = report.figures["val_loss_vs_tokens"].axes[0]
    assert ax.get_xlabel() == "training tokens" and "loss" in ax.get_ylabel()
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {
        # metrics.csv: validations at steps 4 and 9 placed at those steps' train/tokens; the final
        # re-validation (step 10, after the last training step) dropped. The CSV wins over the record.
        "attention [att-run]": ([1000.0, 2000.0], [3.0, 2.0]),
        "mamba [mamba-run]": ([8192.0], [1.5]),  # val/loss record with train_tokens
        "hybrid_jamba [jamba-run]": ([3000.0], [1.0]),  # W&B summary
    }


def test_val_loss_curve_keeps_the_last_epoch_end_validation(tmp_path):
    # An MQAR run logs train/tokens every 10 steps (last at 779) and validates at each epoch's end
    # (step 781), then train.py re-validates the best checkpoint after fit (step 782, epoch 2). The
    # epoch-end validation at 781 is real: it used to be dropped with the re-validation, so a run
    # that reached loss 0.0016 was drawn ending at its first epoch's 5.55.
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train/tokens,val/loss\n"
        "0,389,24960.0,\n0,390,,5.55\n"
        "1,779,49920.0,\n1,781,,0.0016\n"
        "2,782,,0.0016\n"
    )
    curve = read_val_loss_curve(path)
    # 64 tokens a step: 390 interpolated between the logs, 781 extrapolated past the last one
    assert curve == [(24960.0 + 64.0, 5.55), (49920.0 + 2 * 64.0, 0.0016)]


def test_val_loss_curve_of_an_interrupted_run_ends_at_its_last_validation(tmp_path):
    # A run stopped by SIGTERM at step 59 (validations every 20 steps) never advances the epoch: its
    # final re-validation of best.ckpt (step 40's weights) is logged at step 59 in the training
    # epoch and was drawn as a last point of the curve. Its train.json records say interrupted.
    run_dir = tmp_path / "intr-run"
    path = run_dir / "csv" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(
        "epoch,step,train/tokens,val/loss\n"
        "2,19,40960.0,\n2,19,,6.0\n2,39,81920.0,\n2,39,,5.6\n2,58,120832.0,\n2,59,,5.9\n"
    )
    expected = [(40960.0, 6.0), (81920.0, 5.6)]
    assert read_val_loss_curve(path, interrupted=True) == expected
    (run_dir / "results").mkdir()
    record = {
        "run": "intr-run",
        "mixer": "attention",
        "metric": "val/loss",
        "value": 5.6,
        "interrupted": True,
    }
    (run_dir / "results" / "train.json").write_text(json.dumps([record]))
    points, _ = val_loss_points([], Sources(searched=[tmp_path], metrics_csvs=[path]), skip_invalid=False)
    assert [(p["train_tokens"], p["val_loss"]) for p in points] == expected
    (run_dir / "results" / "train.json").write_text(json.dumps([{**record, "interrupted": False}]))
    points, _ = val_loss_points([], Sources(searched=[tmp_path], metrics_csvs=[path]), skip_invalid=False)
    assert len(points) == 3  # a finished run's row at step 59 is a validation of its own


def test_val_loss_of_reruns_with_one_name(tmp_path):
    # The same run name in two session folders (a rerun) gives two curves, each named with its
    # folder; one curve used to be dropped silently, and then the first kept the bare name (a
    # new-user check: "[nanogpt-run]" beside "[day2/nanogpt-run]" read as two different runs).
    paths = []
    for session in ("day1", "day2"):
        path = tmp_path / session / "nanogpt-run" / "csv" / "metrics.csv"
        path.parent.mkdir(parents=True)
        path.write_text(METRICS_CSV)
        (path.parent / "hparams.yaml").write_text("model:\n  name: linear_attention\n")
        paths.append(path)
    points, notes = val_loss_points([], Sources(searched=[tmp_path], metrics_csvs=paths), skip_invalid=False)
    assert not notes
    assert sorted({p["run"] for p in points}) == ["day1/nanogpt-run", "day2/nanogpt-run"]
    assert sorted({p["series"] for p in points}) == [
        "linear_attention [day1/nanogpt-run]",
        "linear_attention [day2/nanogpt-run]",
    ]


def test_val_loss_plot_notes_runs_whose_losses_are_not_on_one_scale(tmp_path):
    """Found by a new-user check: char-level and byte-level runs (and runs on other corpora) shared
    the nats-per-token axis without a word. The records' settings tell them apart now."""

    def record(run: str, tokenizer: str) -> dict:
        settings = {"data.name": "text", "data.path": "/c/a.txt", "data.tokenizer": tokenizer, "seed": 0}
        return {"run": run, "mixer": "attention", "metric": "val/loss", "value": 1.5, "train_tokens": 1000,
                "record_file": str(tmp_path / run / "train.json"), "settings": settings}  # fmt: skip

    same = [record("a", "char"), record("b", "char")]
    assert _loss_scale_notes(same, ["a", "b"]) == []
    mixed = [record("a", "char"), record("b", "byte"), record("c", "byte")]
    assert _loss_scale_notes(mixed, ["b", "c"]) == []  # only the runs plotted count
    assert _loss_scale_notes(mixed, ["a", "b", "c"]) == [
        "Validation loss vs training tokens: the runs were trained on other tasks, corpora or tokenizers, "
        'whose losses per token are not on one scale: name="text", path="/c/a.txt", tokenizer="byte" '
        '(b, c); name="text", path="/c/a.txt", tokenizer="char" (a); compare within one (report them '
        "with separate runs=)"
    ]


def test_reruns_with_one_name_stay_apart_in_records(tmp_path):
    # Records of two run directories with one name (a rerun in another session's folder) used to
    # merge into one run: one row in the Runs table, one series, the second run's numbers lost.
    for session, accs in (("day1", [0.5, 0.4]), ("day2", [0.9, 0.8])):
        write_json(
            tmp_path / session / "run" / "results" / "train.json", train_records("run", "mamba", accs, 1.0)
        )
    rep = make_report(f"[{tmp_path}/day1/run,{tmp_path}/day2/run]", tmp_path / "out")
    runs = next(t for t in rep.tables if t.title == "Runs")
    assert [row[0] for row in runs.rows] == ["day1/run", "day2/run"]
    series = {p["series"]: p["accuracy"] for p in rep.points["accuracy_vs_length"] if p["seqlen"] == 64}
    assert series == {"mamba [day1/run] (val)": 0.5, "mamba [day2/run] (val)": 0.9}


def test_a_rerun_with_records_and_one_with_a_curve_only_are_named_alike(tmp_path):
    # A new-user check: the run with records kept its bare name and the other was named with its
    # folder, so the legend read "[run]" beside "[day2/run]". Two runs' records in one flat folder
    # stay two runs.
    records = train_records("run", "mamba", [0.5, 0.4], 1.0)
    write_json(tmp_path / "day1" / "run" / "results" / "train.json", records)
    (tmp_path / "day1" / "run" / "csv").mkdir()
    (tmp_path / "day1" / "run" / "csv" / "metrics.csv").write_text(METRICS_CSV)
    (tmp_path / "day2" / "run" / "csv").mkdir(parents=True)
    (tmp_path / "day2" / "run" / "csv" / "metrics.csv").write_text(METRICS_CSV)
    flat = tmp_path / "flat"
    write_json(flat / "a.json", train_records("x", "attention", [0.7, 0.6], 2.0))
    write_json(flat / "b.json", train_records("y", "attention", [0.3, 0.2], 2.0))
    rep = make_report(f"[{tmp_path}/day1/run,{tmp_path}/day2/run,{flat}]", tmp_path / "out")
    runs = next(t for t in rep.tables if t.title == "Runs")
    assert sorted(row[0] for row in runs.rows) == ["day1/run", "x", "y"]
    curves = {p["series"] for p in rep.points["val_loss_vs_tokens"]}
    assert curves == {"mamba [day1/run]", "unknown [day2/run]"}


def test_loose_checkpoints_of_one_name_are_named_by_their_folders(tmp_path):
    # A second new-user check: ck/run.ckpt and ck2/run.ckpt (eval records of checkpoints kept outside
    # a run folder, named by their files) were /tmp/.../ck/run and /tmp/.../ck2/run in full, and
    # ck/run.ckpt beside day1/run/ was "<tmp>/run", a folder that does not exist.
    for folder in ("ck", "ck2"):
        records = recall_records("run", "mamba", [0.5, 0.4, 0.1], ["decode"])
        write_json(tmp_path / folder / "run.ckpt.recall.json", records)
    records = train_records("run", "mamba", [0.5, 0.4], 1.0)
    write_json(tmp_path / "day1" / "run" / "results" / "train.json", records)
    rep = make_report(f"[{tmp_path}/ck,{tmp_path}/ck2,{tmp_path}/day1]", tmp_path / "out")
    runs = next(t for t in rep.tables if t.title == "Runs")
    assert sorted(row[0] for row in runs.rows) == ["ck/run", "ck2/run", "day1/run"]


def test_run_names_across_folders_and_renamed_run_folders(tmp_path):
    # Three folders whose parents share a name stay three runs, named alike by the fewest parents
    # that tell them apart (they were runx, same/runx and r/same/runx); a run folder renamed after the run
    # (records name "x-run", the folder is "renamed-x-run") gives one curve under the records' name,
    # not a second one under the folder's; a curve without records in its folder takes the name the
    # tables give that folder.
    for top in ("p", "q", "r"):
        write_json(tmp_path / top / "same" / "runx" / "results" / "train.json",
                   train_records("runx", "mamba", [0.5, 0.4], 1.0, 1000))  # fmt: skip
    renamed = tmp_path / "renamed-x-run"
    write_json(renamed / "results" / "train.json", train_records("x-run", "attention", [0.7, 0.6], 2.0, 1000))
    (renamed / "csv").mkdir()
    (renamed / "csv" / "metrics.csv").write_text(METRICS_CSV)
    rep = make_report(f"[{tmp_path}/p/same/runx,{tmp_path}/q/same/runx,{tmp_path}/r/same/runx,{renamed}]",
                      tmp_path / "out")  # fmt: skip
    runs = next(t for t in rep.tables if t.title == "Runs")
    assert sorted(row[0] for row in runs.rows) == ["p/same/runx", "q/same/runx", "r/same/runx", "x-run"]
    curves = {p["series"] for p in rep.points["val_loss_vs_tokens"]}
    assert curves == {
        "attention [x-run]", "mamba [p/same/runx]", "mamba [q/same/runx]", "mamba [r/same/runx]",
    }  # fmt: skip


def test_markdown_cells_show_names_as_written():
    # a run named *bold* or <b>x</b> rendered as formatting in report.md (the HTML page escapes)
    assert _md_row(["*bold*", "<b>x</b>", "a|b", "linear_attention", "[x](y)"]) == (
        r"| \*bold\* | \<b\>x\</b\> | a\|b | linear_attention | \[x\](y) |"
    )


def test_decode_throughput_plot(report):
    ax = report.figures["decode_tokens_per_s"].axes[0]
    # 200-900 tokens/s span less than 10x: a linear y axis, labelled without "log scale".
    assert ax.get_yscale() == "linear" and "log" not in ax.get_ylabel()
    assert "context length" in ax.get_xlabel() and "tokens/s" in ax.get_ylabel()
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines == {
        "attention [decode-attention-tiny] cuda_graph": [900.0, 400.0],
        "attention [decode-attention-tiny] eager": [500.0, 200.0],
        "mamba [decode-mamba-tiny]": [800.0, 800.0],
    }
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    assert (
        styles["attention [decode-attention-tiny] eager"] == "--"
        and styles["mamba [decode-mamba-tiny]"] == "--"
    )
    assert styles["attention [decode-attention-tiny] cuda_graph"] == "-"
    assert all(list(line.get_xdata()) == [1024, 4096] for line in ax.get_lines())


def test_plot_points_log_axes_colours_and_legend():
    spec = next(p for p in PLOTS if p.name == "decode_tokens_per_s")  # log2 x, log y
    wide = [
        {"series": f"s{i}", "seqlen": 2**k, "tokens_per_s": 10.0 ** (k / 4)}
        for i in range(12)
        for k in (6, 10)
    ]
    fig = plot_points(wide, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "log scale" in ax.get_ylabel()  # 10^1.5 .. 10^2.5: 10x
    colours = {tuple(line.get_color()) for line in ax.get_lines()}
    assert len(colours) == 12  # tab20 past 10 series: no colour repeats
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1  # beside the axes


def test_log_axis_tick_labels_do_not_overlap():
    # decode state bytes 2e4 .. 6e5: labels at every minor tick (3x10^4, 4x10^4, ...) overlapped
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    for xs in ((2e4, 4.1e4, 8e4, 6e5), (2e4, 3e4, 4e4, 5e4), (1e3, 1e7), (3e4, 3.2e4), (1.04e5,)):
        points = [{"series": "s", "state_bytes": x, "accuracy": 0.5} for x in xs]
        fig = plot_points(points, spec)
        fig.canvas.draw()
        ax = fig.axes[0]
        assert ax.get_xscale() == "log"
        lo, hi = ax.get_xlim()
        labels = [
            t for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
            if t.get_text() and lo <= t.get_position()[0] <= hi
        ]  # fmt: skip
        assert len(labels) >= 2, xs  # the axis can be read
        boxes = sorted((t.get_window_extent() for t in labels), key=lambda b: b.x0)
        assert all(left.x1 <= right.x0 for left, right in itertools.pairwise(boxes)), xs
        # a labelled tick near the points: one run alone at 1.04e5 bytes got ticks at 3e5, 6e5, 9e5
        ticks = [t.get_position()[0] for t in labels]
        assert any(min(xs) / 2 <= t <= max(xs) * 2 for t in ticks), (xs, ticks)


def test_marker_labels_name_the_width_and_tell_alike_runs_apart():
    # eval/recall.py's records carry no d_model: the label takes it from train.py's records of the
    # run. Two runs alike in mixer, width and length were both "attention d64 @ 64", by swapped
    # markers in the README's induction plot; their run names now tell them apart.
    records = []
    for run in ("rope-bs256", "rope-bs64"):
        records += recall_records(run, "attention", [0.8, 0.6, 0.2], ["parallel"])
        records += [r | {"d_model": 64} for r in train_records(run, "attention", [0.8, 0.6], 0.5)]
    records += recall_records("mamba-run", "mamba", [0.9, 0.9, 0.9], ["parallel"])
    points, _ = recall_vs_state_points(accuracy_points(records, "mqar", "decode")[0], None)
    assert sorted(p["label"] for p in points) == [
        "attention d64 [rope-bs256] @ 64", "attention d64 [rope-bs64] @ 64", "mamba @ 64",
    ]  # fmt: skip
    # Runs that differ in learning rate (or depth) are told apart by it: run names in every label of
    # a 20-run learning-rate sweep made its plot unreadable (a new-user check).
    records = []
    for run, lr, n_layers in (("a-lr1e-3", 1e-3, 2), ("a-lr3e-4", 3e-4, 2), ("a-L4", 3e-4, 4)):
        records += recall_records(run, "attention", [0.8, 0.6, 0.2], ["parallel"])
        records += [
            r | {"d_model": 64, "lr": lr, "n_layers": n_layers}
            for r in train_records(run, "attention", [0.8, 0.6], 0.5)
        ]
    points, _ = recall_vs_state_points(accuracy_points(records, "mqar", "decode")[0], None)
    assert sorted(p["label"] for p in points) == [
        "attention d64 L2 lr 0.0003 @ 64",
        "attention d64 L2 lr 0.001 @ 64",
        "attention d64 L4 lr 0.0003 @ 64",
    ]


def test_a_point_drawn_away_from_its_training_length_is_noted():
    # A new-user check: an induction run trained at 64 and evaluated from 65 on was drawn "@ 65"
    # without a word.
    accuracy = [
        {"series": "attention [r]", "mixer": "attention", "run": "r", "seqlen": n, "train_seqlen": 64,
         "state_bytes": 100 * n, "accuracy": a}
        for n, a in ((65, 0.5), (128, 0.2))
    ]  # fmt: skip
    points, notes = recall_vs_state_points(accuracy, None)
    assert [p["label"] for p in points] == ["attention @ 65"]
    assert notes == [
        "attention [r]: no recall accuracy at its training length 64; the quality-vs-memory plot shows its "
        "shortest length evaluated, 65 (seqlen= picks one length for every run)"
    ]
    points, notes = recall_vs_state_points([p | {"train_seqlen": 65} for p in accuracy], None)
    assert [p["label"] for p in points] == ["attention @ 65"] and not notes


def label_box(annotation, renderer):
    """The box of a marker label's text (an annotation's own extent also spans its leader line's
    bounding rectangle)."""
    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer)


def test_marker_labels_do_not_overlap():
    # The 2026-12-01 MQAR cells: attention at d64 and d128 side by side at 1.0, hybrid_based just
    # below, and linear attention and mamba d64 close together near 0.1 -- labels ran into each
    # other, into markers and past the axes when all sat above-right of their markers.
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    cells = [
        ("attention", 128, 524328, 1.0), ("attention", 64, 262184, 1.0), ("hybrid_based", 128, 159816, 0.981),
        ("hybrid_based", 64, 80712, 0.991), ("mamba", 128, 40960, 0.963), ("mamba", 64, 20480, 0.096),
        ("linear_attention", 128, 16512, 0.069), ("linear_attention", 64, 8320, 0.121),
        ("sliding_window", 128, 65544, 0.588), ("sliding_window", 64, 32776, 0.587),
    ]  # fmt: skip
    accuracy = [
        {"series": f"{m} [d{d}]", "mixer": m, "d_model": d, "seqlen": 256, "state_bytes": b, "accuracy": a}
        for m, d, b, a in cells
    ]
    points, notes = recall_vs_state_points(accuracy, 256)
    assert not notes
    assert sorted(p["label"] for p in points) == sorted(f"{m} d{d} @ 256" for m, d, _, _ in cells)
    fig = plot_points(points, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    boxes = [label_box(t, renderer) for t in ax.texts]
    assert len(boxes) == len(cells)
    for box in boxes:
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    markers = ax.transData.transform([(p["state_bytes"], p["accuracy"]) for p in points])
    for box in boxes:
        assert not any(box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1 for x, y in markers)


def test_marker_labels_stay_inside_the_figure():
    """Found by a new-user check: the label of the right-most marker ran past the figure's edge,
    where the saved picture cut it ("linear" of a linear_attention label). Three markers at the
    right edge, their long labels: every label drawn lies inside the figure."""
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    cells = [("attention", 0, 653830, 0.432, 128), ("mamba", 1, 219473, 0.361, 64),
             ("attention", 2, 663333, 0.106, 128), ("attention", 3, 8634, 0.179, 64),
             ("attention", 4, 669314, 0.441, 128)]  # fmt: skip
    points = [
        {"series": f"{m} [r{i}]", "mixer": m, "seqlen": 64, "state_bytes": b, "accuracy": a,
         "label": f"{m} d{d} taylor feature_dim 16 @ 64"}
        for m, i, b, a, d in cells
    ]  # fmt: skip
    fig = plot_points(points, spec)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox
    boxes = [label_box(t, renderer) for t in fig.axes[0].texts]
    assert len(boxes) >= 4  # at most one left out
    for box in boxes:
        assert edge.x0 <= box.x0 and box.x1 <= edge.x1 and edge.y0 <= box.y0 and box.y1 <= edge.y1


def test_markers_at_accuracy_zero_are_whole_and_their_labels_keep_off_the_ticks():
    """A carried finding: markers at accuracy 0 were cut in half by the axes, and a label with no
    free place above its marker could go below it, onto the x tick labels. Five runs at 0 side by
    side: the y axis starts below 0, and every label lies inside the axes above the tick labels."""
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    cells = [("linear_attention", 8320, 0.0), ("mamba", 20480, 0.0), ("linear_attention", 16512, 0.0),
             ("mamba", 40960, 0.0), ("sliding_window", 65544, 0.0), ("attention", 262184, 1.0),
             ("hybrid", 80712, 0.02)]  # fmt: skip
    points = [
        {"series": f"{m} [r{i}]", "mixer": m, "seqlen": 256, "state_bytes": b, "accuracy": a,
         "label": f"{m} d64 @ 256"}
        for i, (m, b, a) in enumerate(cells)
    ]  # fmt: skip
    fig = plot_points(points, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    assert ax.get_ylim()[0] < 0 < ax.get_ylim()[1]
    frame = ax.get_window_extent(renderer)
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels(which="both") if t.get_text()]
    boxes = [label_box(t, renderer) for t in ax.texts]
    assert len(boxes) == len(cells) and ticks
    for box in boxes:
        assert box.y0 >= frame.y0 and box.x0 >= frame.x0
        assert not any(box.overlaps(tick) for tick in ticks)


def test_labels_of_many_runs_keep_inside_the_axes_and_off_the_markers():
    """A new-user check: 20 runs of a learning-rate sweep (best_over_lr=false) had labels over the
    plot's title, past the axes into the legend's side, and over other runs' markers. Each label
    drawn lies inside the axes and covers no other marker (some are left out: the legend names all)."""
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    rng = random.Random(0)
    points = []
    for i in range(20):
        mixer = ("attention", "mamba", "linear_attention", "sliding_window", "hybrid_based")[i % 5]
        bytes_ = {"attention": 5e5, "mamba": 2e4, "linear_attention": 8e3, "sliding_window": 6e4}.get(
            mixer, 1.6e5
        )
        accuracy = rng.choice([1.0, 0.98, 0.6, 0.1, 0.03]) if mixer != "attention" else 1.0
        run = f"mqar-{mixer}-d{64 << i % 2}-lr{i}e-4"
        points.append({"series": f"{mixer} [{run}] (val)", "mixer": mixer, "seqlen": 256,
                       "state_bytes": bytes_ * (1 + i % 2), "accuracy": accuracy,
                       "label": f"{mixer} d{64 << i % 2} [{run}] @ 256"})  # fmt: skip
    fig = plot_points(points, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    centres = ax.transData.transform([(p["state_bytes"], p["accuracy"]) for p in points])
    half = (rcParams["lines.markersize"] / 2 + 1) * fig.dpi / 72
    drawn = {t.get_text(): label_box(t, renderer) for t in ax.texts}
    assert 5 <= len(drawn) < len(points)
    for p, (x, y) in zip(points, centres, strict=True):
        marker = Bbox.from_bounds(x - half, y - half, 2 * half, 2 * half)
        for text, box in drawn.items():
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            assert text == plain_text(p["label"]) or not box.overlaps(marker), (text, p["label"])


def test_crowded_markers_leave_out_labels_rather_than_stack_them():
    # The induction-heads runs: seven attention runs at one state size, all near chance; their
    # labels were drawn over one another. Here 14 runs at one point: the labels drawn cover no other
    # label's text, and those with no free place left are left out (the legend names every series).
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    crowd = [(f"attention [run-{i}]", 65576, 0.06) for i in range(14)]
    apart = [("mamba [alone]", 20480, 1.0)]
    points = [
        {
            "series": s,
            "mixer": s.split()[0],
            "seqlen": 64,
            "state_bytes": b,
            "accuracy": a,
            "label": f"{s} @ 64",
        }
        for s, b, a in crowd + apart
    ]
    fig = plot_points(points, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    texts = {t.get_text(): label_box(t, renderer) for t in ax.texts}
    assert "mamba [alone] @ 64" in texts and 2 <= len(texts) < len(points)
    assert not any(a.overlaps(b) for a, b in itertools.combinations(texts.values(), 2))
    assert len(ax.get_legend().get_texts()) == len(points)


def test_long_names_keep_the_plot_readable():
    # A 150-character run name with an 80-character mixer name collapsed the constrained layout
    # (matplotlib warned, the axes shrank to nothing, the legend ran off the figure).
    spec = next(p for p in PLOTS if p.name == "recall_vs_state_bytes")
    name = "r" * 150
    points = [{"series": f"{'m' * 80} [{name}]", "state_bytes": 1e4, "accuracy": 0.5, "label": name}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_points(points, spec)
        fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_texts()[0].get_text()
    assert len(legend) <= 70 and legend.startswith("m" * 30) and legend.endswith("r" * 30 + "]")
    assert all(len(t.get_text()) <= 70 for t in ax.texts)
    assert ax.get_window_extent().width > 0.5 * fig.bbox.width


def test_a_partial_record_file_is_read_with_a_note(tmp_path):
    """eval/decode.py and eval/long_context.py rewrite their file after each length: one whose run was
    killed at a later length is read, and the report names it and the lengths it holds; the file of
    a finished run has no such note."""
    path = tmp_path / "decode" / "decode-attention-tiny.json"
    records = decode_records("attention", [500.0, 200.0])
    write_sweep_records(path, records, [1024, 4096], [1024, 4096, 16384], output_given=True)
    rep = make_report(str(tmp_path / "decode"), tmp_path / "out")
    assert len(rep.records) == len(records)
    assert {p["seqlen"] for p in rep.points["decode_tokens_per_s"]} == {1024, 4096}
    note = (
        f"{path}: partial results, seqlens [1024, 4096] of [1024, 4096, 16384] only (its sweep was cut "
        "short, e.g. killed out of memory on CPU, or is still running)"
    )
    assert note in rep.notes and f"- {note}\n" in rep.markdown.read_text()
    write_sweep_records(path, records, [1024, 4096], [1024, 4096], output_given=True)  # finished
    rep = make_report(str(tmp_path / "decode"), tmp_path / "out")
    assert not any("partial" in n for n in rep.notes)
    # A long_context sweep cut after its first length: "evaluated at one length" says why (a new-user
    # check read it as a wrong claim).
    passkey = tmp_path / "lc" / "last.ckpt.long_context.json"
    one = [rec("lc-run", "mamba", "accuracy", 0.5, 300, task="passkey", split="test", slice="T300")]
    write_sweep_records(passkey, one, [300], [300, 600], output_given=True)
    rep = make_report(str(tmp_path / "lc"), tmp_path / "out", "task=passkey")
    assert (
        f"Length generalisation: not drawn, every run was evaluated at one length (300 tokens); {passkey} holds "
        "a sweep that was cut short (see its note)"
    ) in rep.notes


def test_a_rerun_cut_short_keeps_the_earlier_file(tmp_path, capsys):
    """A rerun of eval/decode.py or eval/long_context.py replaces the earlier file at its first length:
    one killed at its second length left one length where the earlier complete file held all (a
    carried finding). The earlier file (and decode's plot) is kept as ``<name>.earlier`` until the
    rerun's last length is written; the report reads only the rerun's file and names the copy."""
    from eval.decode import write_results
    from eval.records import earlier_copy, partial_files

    path = tmp_path / "decode" / "decode-attention-tiny.json"
    planned = [1024, 4096]
    write_results(path, decode_records("attention", [500.0, 200.0]), planned, planned, output_given=True)
    complete, plot = path.read_bytes(), path.with_suffix(".png").read_bytes()
    assert not earlier_copy(path).exists() and "replacing" not in capsys.readouterr().out
    rerun = [r for r in decode_records("attention", [400.0, 300.0]) if r["seqlen"] == 1024]
    write_results(path, rerun, [1024], planned, output_given=True)  # cut short after its first length
    assert capsys.readouterr().out == (
        f"replacing the earlier results in {path} (kept in {earlier_copy(path)} until the last length is "
        "done; give output= another path to keep both)\n"
    )
    assert earlier_copy(path).read_bytes() == complete
    assert earlier_copy(path.with_suffix(".png")).read_bytes() == plot
    assert partial_files()[
        path
    ] == f"context lengths [1024] of {planned}, the earlier file it replaces kept in " + str(
        earlier_copy(path)
    )
    rep = make_report(str(tmp_path / "decode"), tmp_path / "out")
    assert len(rep.records) == len(rerun)
    assert (
        f"{path}: partial results, seqlens [1024] of {planned} only (its sweep was cut short, e.g. killed out "
        f"of memory on CPU, or is still running); the earlier results it replaced are in "
        f"{earlier_copy(path)} (rename it to {path.name} to use them)"
    ) in rep.notes
    # A second rerun cut short keeps the complete copy, not the first rerun's partial file.
    capsys.readouterr()
    write_results(path, rerun, [1024], planned, output_given=True)
    assert earlier_copy(path).read_bytes() == complete
    assert capsys.readouterr().out == (
        f"replacing the earlier results in {path} (a partial file; the one it replaced stays in "
        f"{earlier_copy(path)} until the last length is done; give output= another path to keep both)\n"
    )
    # The rerun that finishes removes the copies; a sweep of one length never makes one.
    write_results(path, rerun, planned, planned, output_given=True)
    assert not earlier_copy(path).exists() and not earlier_copy(path.with_suffix(".png")).exists()
    assert path not in partial_files()
    # A copy given to the report itself is refused with how to use it (a new-user check).
    copy = tmp_path / "decode-attention-tiny.json.earlier"
    copy.write_bytes(complete)
    with pytest.raises(
        ValueError,
        match=r"is the earlier results a cut-short rerun kept .*rename it to decode-attention-tiny.json",
    ):
        make_report(str(copy), tmp_path / "out")
    write_results(path, rerun, [1024], [1024], output_given=True)
    assert not earlier_copy(path).exists()


def test_a_rerun_killed_before_its_plot_leaves_no_plot_of_the_earlier_run(tmp_path):
    """A carried finding: a rerun killed (kill -9) between writing its records and its plot left the
    earlier run's plot beside the new records. The plot is removed once copied to its ``.earlier``."""
    from eval.records import earlier_copy, write_sweep_records

    path, plot = tmp_path / "decode.json", tmp_path / "decode.png"
    planned = [1024, 4096]
    write_sweep_records(path, [{"seqlen": 1024}, {"seqlen": 4096}], planned, planned, output_given=True,
                        beside=[(plot, lambda: plot.write_bytes(b"earlier plot"))])  # fmt: skip
    seen = []
    write_sweep_records(path, [{"seqlen": 1024}], [1024], planned, output_given=True,
                        beside=[(plot, lambda: seen.append(plot.exists()))])  # fmt: skip
    assert seen == [False] and not plot.exists()  # killed here: no plot rather than the earlier one
    assert earlier_copy(plot).read_bytes() == b"earlier plot"


def test_an_interrupt_while_drawing_leaves_the_earlier_report_whole(runs, tmp_path, monkeypatch):
    """A new-user check: Ctrl+C during a rerun into an existing report folder left new plots beside
    the earlier report.md. Every file is drawn and rendered before the first is written."""
    import eval.report as report_module

    out = tmp_path / "out"
    dirs = ",".join(str(runs / d) for d in ("att-run", "decode"))
    make_report(f"[{dirs}]", out)
    before = {path.name: path.stat().st_ino for path in out.iterdir()}
    assert {"report.md", "report.html"} < set(before) and any(name.endswith(".png") for name in before)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_module, "render_html", interrupted)  # the last step before the writes
    with pytest.raises(KeyboardInterrupt):
        make_report(f"[{dirs}]", out)
    assert {path.name: path.stat().st_ino for path in out.iterdir()} == before  # nothing replaced


def test_tables(report):
    tables = {t.title: t for t in report.tables}
    runs = tables["Runs"]
    assert [row[:2] for row in runs.rows] == [
        ["att-run", "attention"], ["decode-attention-tiny", "attention"], ["decode-mamba-tiny", "mamba"],
        ["jamba-run", "hybrid_jamba"], ["mamba-run", "mamba"],
    ]  # fmt: skip
    assert runs.rows[0][3] == PARAMS["attention"] and runs.rows[0][4] == "mqar (test), mqar (val)"
    test = tables["Results: mqar (test)"]
    assert test.columns[:6] == ["run", "mixer", "params", "seqlen", "slice", "state bytes"]
    assert {"accuracy [decode]", "accuracy [parallel]"} <= set(test.columns)
    row = dict(zip(test.columns, test.rows[0], strict=True))
    assert row["run"] == "att-run" and row["seqlen"] == 64 and row["state bytes"] == 2048 * 64
    assert row["slice"] == "T64_kv4"
    assert row["accuracy [decode]"] == 0.99 and row["accuracy [parallel]"] == pytest.approx(0.98)
    decode = tables["Results: decode"]
    assert "state_bytes" not in decode.columns and "decode_tokens_per_s [cuda_graph]" in decode.columns
    assert len(decode.rows) == 4  # two mixers x two context lengths
    assert decode.columns[:8] == [
        "run",
        "mixer",
        "params",
        "seqlen",
        "slice",
        "dtype",
        "batch",
        "state bytes",
    ]
    assert [row[5:7] for row in decode.rows] == [["float32", 1]] * 4
    assert "dtype" not in test.columns and "batch" not in test.columns  # no record there has them
    val = tables["Results: mqar (val)"]
    assert "val/acc" in val.columns and not any("_T128" in c for c in val.columns)
    assert report.sources.ignored == [Path(report.sources.searched[3]) / "benchmark.json"]


def test_interrupted_runs_are_marked_in_the_runs_table_and_noted(runs, tmp_path, report):
    # A new-user check: a run stopped by Ctrl+C at step 2 of 60 was tabled and ranked beside the
    # finished ones, and "interrupted" appeared nowhere in report.md.
    assert "interrupted" not in {t.title: t for t in report.tables}["Runs"].columns  # none was
    shutil.copytree(runs / "att-run", tmp_path / "att-run")
    train_json = tmp_path / "att-run" / "results" / "train.json"
    write_json(train_json, [{**r, "interrupted": True} for r in json.loads(train_json.read_text())])
    rep = make_report(f"[{tmp_path / 'att-run'},{runs / 'mamba-run'}]", tmp_path / "out")
    table = {t.title: t for t in rep.tables}["Runs"]
    assert table.columns[-1] == "interrupted"
    assert [(row[0], row[-1]) for row in table.rows] == [("att-run", "yes"), ("mamba-run", "")]
    note = ("1 run(s) were stopped before their end (Ctrl+C or SIGTERM; their records say interrupted) "
            "and are tabled and ranked as they stood: att-run; resume one with train.py resume=")  # fmt: skip
    assert any(n.startswith(note) for n in rep.notes)
    assert any(n.startswith(note) for n in Page(rep.html.read_text()).notes)


def test_decode_measurements_of_two_dtypes_keep_their_own_rows():
    # One record file holding an fp32 and a bf16 measurement at each length (a rerun with dtype=):
    # a row each, told apart by the dtype column, never one row showing the later value.
    records = []
    for dtype, speed in (("float32", 100.0), ("bfloat16", 300.0)):
        for r in decode_records("attention", [speed, speed / 2]):
            r["dtype"], r["record_file"] = dtype, "decode-attention-tiny.json"
            r["state_bytes"] = r["state_bytes"] * (2 if dtype == "float32" else 1)
            records.append(r)
    decode = {t.title: t for t in summary_tables(records)}["Results: decode"]
    rows = [dict(zip(decode.columns, row, strict=True)) for row in decode.rows]
    got = {(r["seqlen"], r["dtype"]): r["decode_tokens_per_s [eager]"] for r in rows}
    assert got == {(1024, "bfloat16"): 300.0, (1024, "float32"): 100.0, (4096, "bfloat16"): 150.0,
                   (4096, "float32"): 50.0}  # fmt: skip
    assert len(rows) == 4


def test_decode_bandwidth_is_shown_in_gb_per_s():
    # eval/decode.py writes bytes/s and prints GB/s; the table showed 529,674,592 under no unit.
    records = decode_records("attention", [500.0, 200.0])
    for r in records[1::3]:
        bandwidth = {**r, "metric": "decode_bandwidth", "value": 529_674_592.0 * r["seqlen"] / 1024}
        records.append(bandwidth)
    for r in records:
        r["record_file"] = "decode-attention-tiny.json"
    decode = {t.title: t for t in summary_tables(records)}["Results: decode"]
    rows = [dict(zip(decode.columns, row, strict=True)) for row in decode.rows]
    assert [r["decode_bandwidth (GB/s) [eager]"] for r in rows] == pytest.approx([0.529674592, 2.118698368])
    assert [r["decode_tokens_per_s [eager]"] for r in rows] == [500.0, 200.0]  # other metrics as recorded


def test_html_is_self_contained_with_plots_and_tables(report):
    text = report.html.read_text()
    page = Page(text)
    assert len(page.images) == 4
    for image, name in zip(page.images, ("recall_vs_state_bytes", "accuracy_vs_length", "val_loss_vs_tokens",
                                         "decode_tokens_per_s"), strict=True):  # fmt: skip
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        assert base64.b64decode(image["src"][len(prefix) :]) == report.pngs[name].read_bytes()
        assert report.pngs[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not page.tags & {"script", "link", "iframe"} and "http" not in text
    assert page.h2[:4] == ["Recall accuracy vs decode state", "Length generalisation",
                           "Validation loss vs training tokens", "Decode throughput"]  # fmt: skip
    assert "Runs" in page.h2 and "Results: mqar (test)" in page.h2
    runs_table = page.tables[0]
    assert runs_table[0][:2] == ["run", "mixer"] and ["att-run", "attention"] == runs_table[1][:2]
    assert ["jamba-run", "hybrid_jamba", "hybrid_jamba x2", "150,000"] == runs_table[4][:4]


def test_markdown_table_and_plot_links(report):
    text = report.markdown.read_text()
    assert "![Recall accuracy vs decode state](recall_vs_state_bytes.png)" in text
    assert "| run | mixer | layout | params | tasks | record files |" in text
    assert "| mamba-run | mamba | mamba x2 | 170,016 | mqar (test), mqar (val) | 2 |" in text
    assert "| att-run | attention | 123,424 | 64 | T64_kv4 | 131,072 | 0.99 | 0.98 |" in text


def test_plots_without_data_are_noted_not_errors(runs, tmp_path):
    rep = make_report(f"[{runs}/*-run]", tmp_path)  # a glob: the three train runs, no decode records
    assert rep.figures["decode_tokens_per_s"] is None and "decode_tokens_per_s" not in rep.pngs
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "accuracy_vs_length.png", "recall_vs_state_bytes.png", "val_loss_vs_tokens.png",
    ]  # fmt: skip
    page = Page(rep.html.read_text())
    assert len(page.images) == 3
    assert any(n.startswith("No data: needs eval/decode.py records") for n in page.notes)
    assert "*No data: needs eval/decode.py records (metric decode_tokens_per_s).*" in rep.markdown.read_text()


def test_a_plot_not_drawn_again_leaves_no_stale_png(runs, tmp_path, capsys):
    make_report(f"[{runs}]", tmp_path)  # with the decode records: the decode plot is drawn
    assert (tmp_path / "decode_tokens_per_s.png").exists()
    assert "replacing" not in capsys.readouterr().out
    make_report(f"[{runs}/*-run]", tmp_path)  # the same folder, no decode records
    assert not (tmp_path / "decode_tokens_per_s.png").exists()
    # Said (a new-user check: the earlier report and its plot went without a word).
    printed = capsys.readouterr().out
    assert f"plots (replacing the earlier report in {tmp_path})\n" in printed
    removed = f"removed decode_tokens_per_s.png of the earlier report in {tmp_path}: no data for that plot"
    assert removed in printed


def test_an_out_folder_holding_report_files_of_its_own_is_refused(runs, tmp_path):
    # A second new-user check: a hand-written report.md was overwritten and the user's PNG of a plot's
    # name deleted, both called "the earlier report".
    for name, text in (("report.md", "# my notes\n"), ("report.html", "<html><title>mine</title></html>")):
        out = tmp_path / name.replace(".", "-")
        out.mkdir()
        (out / name).write_text(text)
        (out / "decode_tokens_per_s.png").write_bytes(b"mine")
        message = f"out={out} holds a {name} that eval/report.py did not write, which the report would "
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            make_report(f"[{runs}/*-run]", out)
        assert (out / name).read_text() == text and (out / "decode_tokens_per_s.png").read_bytes() == b"mine"
    # A folder without a report: a PNG of a plot's name that is not drawn is left alone.
    out = tmp_path / "plain"
    out.mkdir()
    (out / "decode_tokens_per_s.png").write_bytes(b"mine")
    make_report(f"[{runs}/*-run]", out)
    assert (out / "decode_tokens_per_s.png").read_bytes() == b"mine"


def test_seqlen_picks_the_quality_vs_memory_length(runs, tmp_path):
    rep = make_report(f"[{runs}/*-run]", tmp_path, "seqlen=256")
    points = {p["series"]: (p["state_bytes"], p["accuracy"]) for p in rep.points["recall_vs_state_bytes"]}
    assert points == {
        "attention [att-run]": (2048 * 256, 0.6),
        "mamba [mamba-run]": (40960, pytest.approx(0.1)),
    }
    assert any("hybrid_jamba [jamba-run] (val): no recall accuracy at seqlen 256" in n for n in rep.notes)


def test_nothing_found_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    write_json(tmp_path / "empty" / "other.json", {"not": "records"})
    with pytest.raises(
        FileNotFoundError, match=r"no result records found in .*empty: looked for \*\.json.*metrics\.csv"
    ):
        make_report(f"[{tmp_path / 'empty'}]", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_report(f"[{tmp_path / 'missing'}]", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        make_report(f"[{tmp_path}/nothing-*]", tmp_path / "out")


def test_recursive_pattern_skips_files_that_hold_no_records(runs, tmp_path):
    # outputs/** also matches every checkpoint and log of the runs: found by a fresh-clone check, the
    # first best.ckpt stopped the report. A pattern keeps directories, .json and metrics.csv files;
    # a non-record file named outright is still an error.
    ckpt = runs / "mamba-run" / "checkpoints" / "best.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(b"not read")
    (runs / "mamba-run" / "train.log").write_text("")
    every = make_report(f"[{runs}/**]", tmp_path / "all")
    assert {p["run"] for p in every.points["accuracy_vs_length"]} == {"att-run", "mamba-run", "jamba-run"}
    with pytest.raises(
        FileNotFoundError, match=r"matches no run directory, \.json record file or metrics\.csv"
    ):
        make_report(f"[{runs}/**/*.ckpt]", tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is neither a run directory, a .json record file nor a metrics.csv"):
        make_report(f"[{ckpt}]", tmp_path / "named")


def test_validation_loss_plot_keeps_to_the_task(runs, tmp_path):
    # A text run among MQAR runs: its loss (nats per character) shares no scale with theirs, so
    # task=mqar leaves its curve out with a note, and task=text draws it alone.
    text = tmp_path / "text-run"
    write_json(text / "results" / "train.json",
               [rec("text-run", "mamba", "val/loss", 1.5, 256, task="text", split="val", train_tokens=10**6)])  # fmt: skip
    dirs = f"[{runs / 'att-run'},{runs / 'mamba-run'},{text}]"
    rep = make_report(dirs, tmp_path / "mqar")
    assert {p["run"] for p in rep.points["val_loss_vs_tokens"]} == {"att-run", "mamba-run"}
    assert any("1 run(s) of other tasks than task=mqar left out: text-run" in n for n in rep.notes)
    rep = make_report(dirs, tmp_path / "text", "task=text")
    assert {p["run"] for p in rep.points["val_loss_vs_tokens"]} == {"text-run"}


def test_loss_scale_note_counts_only_the_runs_plotted(tmp_path):
    """Found by a new-user check: with task=mqar one note said the text run was left out of the
    validation-loss plot, and the next still listed it among runs "not on one scale" (the scale
    was judged before the task filter)."""

    def write_run(run: str, task: str, settings: dict) -> Path:
        record = rec(run, "mamba", "val/loss", 1.5, 64, task=task, split="val", train_tokens=10**6,
                     settings={"data.name": task, **settings})  # fmt: skip
        write_json(tmp_path / run / "results" / "train.json", [record])
        return tmp_path / run

    a = write_run("mqar-a", "mqar", {"model.vocab_size": 8192})
    b = write_run("mqar-b", "mqar", {"model.vocab_size": 8192})
    text = write_run("text-run", "text", {"data.tokenizer": "char", "model.vocab_size": 65})
    rep = make_report(f"[{a},{b},{text}]", tmp_path / "out")
    assert {p["run"] for p in rep.points["val_loss_vs_tokens"]} == {"mqar-a", "mqar-b"}
    assert any("other tasks than task=mqar left out: text-run" in n for n in rep.notes)
    assert not [n for n in rep.notes if "not on one scale" in n]
    # Plotted runs of one task on other scales still get the note, without the run left out.
    c = write_run("mqar-c", "mqar", {"model.vocab_size": 4096})
    rep = make_report(f"[{a},{c},{text}]", tmp_path / "out")
    (scale,) = [n for n in rep.notes if "not on one scale" in n]
    assert "mqar-a" in scale and "mqar-c" in scale and "text-run" not in scale


def test_bad_runs_out_seqlen_and_record_fields_are_clear_errors(runs, tmp_path):
    # Found by a fresh-clone check: runs= (empty) reported the whole working directory, out= a file
    # raised FileExistsError from deep inside, seqlen=true passed as a length, and a string seqlen
    # in a record surfaced as "'<' not supported between instances of 'str' and 'int'".
    with pytest.raises(ValueError, match="runs has an empty entry"):
        make_report("''", tmp_path / "out")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        with pytest.raises(ValueError, match=r"a-file is a file, not a folder; pass out=<folder>"):
            make_report(f"[{runs / 'mamba-run'}]", out)
    with pytest.raises(ValueError, match="out is empty: pass out=<folder>"):
        make_report(f"[{runs / 'mamba-run'}]", "''")
    with pytest.raises(ValueError, match="seqlen must be null or an integer >= 1, got True"):
        make_report(f"[{runs / 'mamba-run'}]", tmp_path / "out", "seqlen=true")
    bad = tmp_path / "str-run" / "results" / "train.json"
    for key, value in (("seqlen", "256"), ("state_bytes", -1), ("params", True), ("state_bytes", math.inf)):
        record = {"run": "str-run", "mixer": "mamba", "metric": "val/acc", "value": 0.5, key: value}
        write_json(bad, [record])
        with pytest.raises(
            ValueError, match=rf"record 0 has {key}={value!r}; it must be a finite non-negative number"
        ):
            make_report(f"[{tmp_path / 'str-run'}]", tmp_path / "out")


def test_unwritable_out_is_refused_before_the_report_is_built(runs, tmp_path, monkeypatch):
    read_only = tmp_path / "shared"
    read_only.mkdir()
    refuse_files_in(monkeypatch, read_only)
    folder = re.escape(str(read_only))
    created_in = rf"its missing folders would be created in {folder}, where creating a file failed"
    for out, detail in (
        (read_only, rf"creating a file in {folder} failed"),
        (read_only / "report", created_in),
    ):
        with pytest.raises(ValueError, match=rf"cannot be written: {detail}: Permission denied; "
                           r"pass out=<a writable folder>"):  # fmt: skip
            make_report(f"[{runs / 'mamba-run'}]", out)
    assert list(read_only.iterdir()) == []


def test_runs_that_are_not_folders_or_globs_are_refused(tmp_path):
    for value, shown in (("null", "None"), ("5", "5"), ("[]", r"\[\]")):
        with pytest.raises(
            ValueError, match=rf"runs must be a folder, a glob or a list of them, got {shown}; "
        ):
            make_report(value, tmp_path / "out")


def test_corrupt_record_file_errors_or_is_skipped(runs, tmp_path, capsys):
    bad = tmp_path / "bad-run" / "results" / "train.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('[{"run": "bad-run", ')  # truncated
    dirs = f"[{runs / 'mamba-run'},{tmp_path / 'bad-run'}]"
    with pytest.raises(ValueError, match=r"cannot read result records from .*bad-run/results/train\.json"):
        make_report(dirs, tmp_path / "out")
    capsys.readouterr()
    with warnings.catch_warnings():
        # Found by a new-user check: the skip was a UserWarning printed with file, line and source.
        warnings.simplefilter("error")
        rep = make_report(dirs, tmp_path / "out", "skip_invalid=true")
    skip_note = [line for line in capsys.readouterr().out.splitlines() if "bad-run" in line]
    assert len(skip_note) == 1
    assert re.fullmatch(r"note: skipped invalid file: cannot read result records from .*/bad-run/results/"
                        r"train\.json: .*", skip_note[0])  # fmt: skip
    assert rep.figures["recall_vs_state_bytes"] is not None
    assert any("bad-run/results/train.json" in n for n in Page(rep.html.read_text()).notes)
    # With nothing else found, the error still names the file skipped.
    with pytest.raises(FileNotFoundError, match=r"; skipped invalid file: cannot read result records from "):
        make_report(f"[{tmp_path / 'bad-run'}]", tmp_path / "out", "skip_invalid=true")
    bad.write_text(json.dumps([{"run": "bad-run", "metric": "val/loss", "value": 1.0}]))
    with pytest.raises(ValueError, match=r"train\.json: record 0 lacks \['mixer'\]"):
        make_report(dirs, tmp_path / "out")
    # A new-user check: valid JSON that is not a record list in train.py's own file dropped the run
    # without a word (other JSON beside a run's files is passed over, as benchmark.json in test_tables).
    bad.write_text("{}")
    refusal = r"bad-run/results/train\.json: train\.py writes a JSON list of records there, but it holds a "
    with pytest.raises(ValueError, match=refusal + r"dict \(fix or delete the file, or pass skip_invalid"):
        make_report(dirs, tmp_path / "out")


@pytest.mark.parametrize(
    "metric, value",
    [
        ("decode_tokens_per_s", math.nan),
        ("decode_tokens_per_s", math.inf),
        ("decode_tokens_per_s", -3.0),
        ("prefill_tokens_per_s", -1.0),
        ("decode_bandwidth", math.nan),
        ("state_bytes", -4096.0),
    ],
)
def test_impossible_decode_values_are_errors_or_skipped(runs, tmp_path, metric, value):
    # Found by a review: a NaN, inf or negative tokens/s was drawn and tabled without a word.
    records = decode_records("mamba", [800.0, 800.0])
    records.append({**records[1], "metric": "decode_bandwidth", "value": 5e8})
    index = next(i for i, r in enumerate(records) if r["metric"] == metric)
    records[index] = {**records[index], "value": value}
    bad = tmp_path / "bad-decode" / "decode-mamba-tiny.json"
    write_json(bad, records)
    dirs = f"[{runs / 'decode'},{bad.parent}]"
    message = (
        rf"bad-decode/decode-mamba-tiny\.json: record {index} \({metric}\) has value={value!r}; "
        "it must be a finite non-negative number"
    )
    with pytest.raises(ValueError, match=message):
        make_report(dirs, tmp_path / "out")
    rep = make_report(dirs, tmp_path / "out", "skip_invalid=true")
    assert any(re.search(message, n) for n in rep.notes)
    assert str(bad) not in {r["record_file"] for r in rep.records}
    assert rep.figures["decode_tokens_per_s"] is not None


def test_size_and_rate_fields_must_be_finite(tmp_path):
    bad = tmp_path / "run" / "results" / "train.json"
    for key, value in (("tokens_per_s", math.nan), ("train_tokens", -1), ("weight_bytes", math.inf)):
        write_json(bad, [{"run": "run", "mixer": "mamba", "metric": "val/loss", "value": 1.0, key: value}])
        with pytest.raises(
            ValueError, match=rf"record 0 has {key}={value!r}; it must be a finite non-negative"
        ):
            make_report(f"[{bad.parent.parent}]", tmp_path / "out")


@pytest.mark.parametrize("flag", ["wandb.enabled", "skip_invalid"])
def test_flags_that_are_not_booleans_are_refused_before_the_report_is_built(
    runs, tmp_path, flag, monkeypatch
):
    # Hydra passes wandb.enabled=no as the string "no", which is true: it started a W&B run, and
    # skip_invalid=no skipped invalid files.
    monkeypatch.setitem(sys.modules, "wandb", None)  # were the flag taken as true, no W&B run is made
    with pytest.raises(ValueError, match=rf"^{re.escape(flag)} must be true or false, got 'no'$"):
        make_report(f"[{runs / 'decode'}]", tmp_path / "out", f"{flag}=no")
    assert not (tmp_path / "out").exists()


def test_out_must_be_one_folder_path(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"out must be one folder path, got \['a'\]; e.g. out=report"):
        build_report(compose_eval("report", [f"runs=[{runs / 'decode'}]", "out=[a]"]))
    assert list(tmp_path.iterdir()) == []


def test_works_without_wandb(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    rep = make_report(f"[{runs / 'decode'}]", tmp_path, "wandb.enabled=true")
    assert "wandb is not installed" in capsys.readouterr().out
    assert rep.figures["decode_tokens_per_s"] is not None and rep.html.exists()
    assert not (tmp_path / "wandb").exists()


def test_a_mistyped_wandb_mode_is_refused_before_the_report_is_built(runs, tmp_path):
    # Found by a fresh-clone check: any mode but "online" logged offline without a word.
    with pytest.raises(ValueError, match="wandb.mode must be 'online' or 'offline', got 'onlin'"):
        make_report(f"[{runs / 'decode'}]", tmp_path / "out", "wandb.enabled=true", "wandb.mode=onlin")
    assert not (tmp_path / "out").exists()


def test_wandb_offline_tables_and_scatter(runs, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    make_report(f"[{runs / 'decode'}]", tmp_path, "wandb.enabled=true")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = {p.name.split("_")[0]: json.loads(p.read_text()) for p in run_dir.rglob("*.table.json")}
    points = tables["points"]
    assert points["columns"] == ["series", "run", "mixer", "seqlen", "tokens_per_s"]
    assert len(points["data"]) == 6 and {row[2] for row in points["data"]} == {"attention", "mamba"}
    assert tables["runs"]["columns"][:2] == ["run", "mixer"]
    assert list(run_dir.rglob("*.png")), "the plot image was not logged"


def test_an_online_wandb_run_refused_leaves_the_report_and_warns(runs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    without_wandb_key(monkeypatch, tmp_path / "home")
    report = make_report(f"[{runs / 'decode'}]", tmp_path / "out", "wandb.enabled=true", "wandb.mode=online")
    assert report.pngs and all(path.exists() for path in report.pngs.values())
    err = capsys.readouterr().err
    assert "warning: W&B could not start an online run (" in err and "API key" in err
    assert "or log offline with wandb.mode=offline" in err and "the report was written as files only" in err


def run_script(*args: str) -> None:
    """``python eval/report.py ARGS`` in this process (a subprocess would spend seconds importing torch)."""
    sys.argv = ["eval/report.py", *args]
    runpy.run_path(str(REPO_ROOT / "eval" / "report.py"), run_name="__main__")


def test_command_line(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", sys.argv)  # restored after the test
    out = tmp_path / "cli"
    run_script(f"runs=[{runs}/decode]", f"out={out}")
    printed = capsys.readouterr().out
    assert "wrote" in printed and (out / "decode_tokens_per_s.png").exists()
    assert "not drawn, no data" in printed  # the recall and loss plots are noted
    with pytest.raises(SystemExit) as exit_info:
        run_script(f"runs=[{tmp_path}/missing]")
    assert exit_info.value.code == 2 and "missing' does not exist" in capsys.readouterr().err


def test_slices_of_one_length_get_their_own_rows(tmp_path):
    """eval/perplexity.py's full split and its decode-check prefix share a seqlen: two rows, so the
    perplexity never sits beside the prefix's loss."""
    run = tmp_path / "text-run"
    common = {"task": "text", "split": "val", "path": "parallel"}
    write_json(run / "checkpoints" / "best.ckpt.perplexity.json", [
        rec("text-run", "attention", "loss", 4.771, 64, slice="val", **common),
        rec("text-run", "attention", "perplexity", 118.0, 64, slice="val", **common),
        rec("text-run", "attention", "loss", 4.753, 64, slice="val_prefix64", **common),
    ])  # fmt: skip
    rep = make_report(f"[{run}]", tmp_path / "out")
    table = {t.title: t for t in rep.tables}["Results: text (val)"]
    rows = [dict(zip(table.columns, row, strict=True)) for row in table.rows]
    assert [(r["slice"], r["loss [parallel]"], r["perplexity [parallel]"]) for r in rows] == [
        ("val", 4.771, 118.0), ("val_prefix64", 4.753, None)
    ]  # fmt: skip
    assert "max_batches" not in table.columns  # the full split: no column
    # A loss over the first batches of the split stays apart and says so (a new-user check: it read as
    # the held-out loss).
    write_json(run / "checkpoints" / "last.ckpt.perplexity.json", [
        rec("text-run", "attention", "loss", 4.5, 64, slice="val", max_batches=2, **common),
    ])  # fmt: skip
    rep = make_report(f"[{run}]", tmp_path / "out2")
    table = {t.title: t for t in rep.tables}["Results: text (val)"]
    rows = [dict(zip(table.columns, row, strict=True)) for row in table.rows]
    assert [(r["slice"], r["max_batches"], r["loss [parallel]"]) for r in rows] == [
        ("val", 2, 4.5), ("val", None, 4.771), ("val_prefix64", None, 4.753)
    ]  # fmt: skip


def test_text_task_draws_no_recall_plot(tmp_path):
    # next-token accuracy of a text run is not recall: no point on the quality-vs-memory plot
    run = tmp_path / "text-run"
    common = {"task": "text", "split": "val", "lr": 1e-3, "d_model": 64, "n_layers": 2}
    write_json(run / "results" / "train.json", [rec("text-run", "attention", "val/acc", 0.6, 64, **common)])
    rep = make_report(f"[{run}]", tmp_path / "out", "task=text")
    for name in ("recall_vs_state_bytes", "accuracy_vs_length"):  # the latter was labelled recall accuracy
        assert rep.figures[name] is None and name not in rep.pngs
    not_drawn = [n for n in rep.notes if "not drawn" in n]
    markdown = rep.markdown.read_text()  # each plot's section says why it is missing
    assert "*Not drawn for task=text (next-token accuracy is not recall).*" in markdown
    assert not_drawn[:2] == [  # once each (the recall plot was also noted as having no data)
        "Recall accuracy vs decode state: not drawn for task=text (next-token accuracy is not recall)",
        "Length generalisation: not drawn for task=text (next-token accuracy is not recall)",
    ]
    assert all("not drawn, no data" in n for n in not_drawn[2:]) and len(not_drawn) == 4
    assert "Results: text (val)" in {t.title for t in rep.tables}


def test_text_runs_are_ranked_by_validation_loss(tmp_path):
    # The lr with the higher next-token accuracy has the worse loss (it overfit): loss decides.
    common = {"task": "text", "split": "val", "d_model": 64, "n_layers": 2}
    for lr, acc, loss in ((1e-3, 0.57, 1.49), (3e-3, 0.58, 1.62)):
        run = f"text-lr{lr}"
        write_json(tmp_path / run / "results" / "train.json", [
            rec(run, "attention", "val/acc", acc, 256, lr=lr, **common),
            rec(run, "attention", "val/loss", loss, 256, lr=lr, **common),
        ])  # fmt: skip
    # A MQAR sweep in the same folder keeps ranking by accuracy.
    for lr, acc in ((1e-3, 0.4), (3e-3, 0.5)):
        run = f"mqar-lr{lr}"
        write_json(tmp_path / run / "results" / "train.json",
                   sweep_records(run, "attention", 64, lr, {"T64_kv4": (64, acc)}))  # fmt: skip
    rep = make_report(f"[{tmp_path}/text-*]", tmp_path / "text", "task=text")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.rows == [["attention", "loss 1.490, acc 0.570 (lr 1e-3, 2 lrs)"]]
    assert any("text runs are ranked by their best validation loss" in n for n in rep.notes)
    # A run without val/loss (and the best accuracy) ranks after every run with one, said in the note.
    write_json(tmp_path / "text-lr1e-2" / "results" / "train.json", [
        rec("text-lr1e-2", "attention", "val/acc", 0.6, 256, lr=1e-2, **common),
    ])  # fmt: skip
    rep = make_report(f"[{tmp_path}/text-*]", tmp_path / "text2", "task=text")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.rows == [["attention", "loss 1.490, acc 0.570 (lr 1e-3, 3 lrs)"]]
    assert any("runs without a val/loss record rank last: text-lr1e-2" in n for n in rep.notes)
    rep = make_report(f"[{tmp_path}/mqar-*]", tmp_path / "mqar")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.rows == [["attention", "0.500 (lr 3e-3, 2 lrs)"]]
    assert not any("ranked by their best validation loss" in n for n in rep.notes)


# Best over learning rates (Zoology, Figure 2): a sweep of mixer x d_model x lr, as train.py writes it.

LRS = (4.6e-4, 2.2e-3)
GRID_ACC = {  # (mixer, d_model) -> val/acc per lr in LRS; mamba at 128 has no record
    ("attention", 64): (0.8, 0.95),
    ("attention", 128): (0.99, 0.9),
    ("mamba", 64): (0.3, 0.6),
}


def sweep_records(run, mixer, d_model, lr, accs, task="mqar", params=None):
    """train.py's results/train.json of one sweep run: ``accs`` maps slice name -> (seqlen, val
    accuracy); per-slice val/acc and val/loss, the first slice's as val/acc and val/loss, each record
    with the slice, lr, d_model and n_layers."""
    common = {
        "task": task, "split": "val", "lr": lr, "d_model": d_model, "n_layers": 2,
        "params": params or PARAMS[mixer] * d_model // 64,
    }  # fmt: skip
    out = []
    for i, (name, (t, acc)) in enumerate(accs.items()):
        for suffix in (f"_{name}", "") if i == 0 else (f"_{name}",):
            out += [
                rec(run, mixer, f"val/acc{suffix}", acc, t, slice=name, **common),
                rec(run, mixer, f"val/loss{suffix}", 1.0 - acc, t, slice=name, **common),
            ]
    return out


@pytest.fixture
def grid(tmp_path) -> Path:
    root = tmp_path / "sweep"
    for (mixer, d_model), accs in GRID_ACC.items():
        for lr, acc in zip(LRS, accs, strict=True):
            run = f"{mixer}-d{d_model}-lr{lr}"
            write_json(root / run / "results" / "train.json",
                       sweep_records(run, mixer, d_model, lr, {"T64_kv4": (64, acc)}))  # fmt: skip
    return root


def test_best_over_learning_rates_table(grid, tmp_path):
    rep = make_report(f"[{grid}]", tmp_path / "out")
    title = "Best over learning rates: mqar (val) at T64_kv4, 2 layers"
    table = {t.title: t for t in rep.tables}[title]
    assert table.columns == ["mixer", "d_model 64", "d_model 128"]
    assert table.rows == [
        ["attention", "0.950 (lr 2.2e-3, 2 lrs)", "0.990 (lr 4.6e-4, 2 lrs)"],
        ["mamba", "0.600 (lr 2.2e-3, 2 lrs)", "no record"],
    ]
    assert [t.title for t in rep.tables][:2] == ["Runs", title]
    assert "| attention | 0.950 (lr 2.2e-3, 2 lrs) | 0.990 (lr 4.6e-4, 2 lrs) |" in rep.markdown.read_text()
    page = Page(rep.html.read_text())
    assert title in page.h2 and ["mamba", "0.600 (lr 2.2e-3, 2 lrs)", "no record"] in page.tables[1]


def test_best_over_lr_keeps_only_the_best_run_in_the_quality_vs_memory_plot(grid, tmp_path):
    best = make_report(f"[{grid}]", tmp_path / "best")
    shown = {p["run"]: p["accuracy"] for p in best.points["recall_vs_state_bytes"]}
    assert shown == {
        "attention-d64-lr0.0022": 0.95,
        "attention-d128-lr0.00046": 0.99,
        "mamba-d64-lr0.0022": 0.6,
    }
    assert any("3 of 6 runs left out" in n for n in best.notes)
    every = make_report(f"[{grid}]", tmp_path / "every", "best_over_lr=false")
    runs = {f"{mixer}-d{d_model}-lr{lr}" for mixer, d_model in GRID_ACC for lr in LRS}
    assert sorted(p["run"] for p in every.points["recall_vs_state_bytes"]) == sorted(runs)
    assert not any("left out" in n for n in every.notes)
    assert [t.rows for t in every.tables if t.title.startswith("Best")] == [
        t.rows for t in best.tables if t.title.startswith("Best")
    ]
    with pytest.raises(ValueError, match="best_over_lr must be true or false"):
        make_report(f"[{grid}]", tmp_path / "bad", "best_over_lr=3")


def test_best_over_lr_with_runs_sharing_a_learning_rate(grid, tmp_path):
    # A rerun at another batch size has the same records but its lr: the group's cell and a note
    # say so, instead of "1 lr" and "runs left out" as if an lr sweep had been won.
    run = "mamba-d64-lr0.0022-bs256"
    write_json(grid / run / "results" / "train.json",
               sweep_records(run, "mamba", 64, 2.2e-3, {"T64_kv4": (64, 0.7)}))  # fmt: skip
    rep = make_report(f"[{grid}]", tmp_path / "out")
    table = next(t for t in rep.tables if t.title.startswith("Best"))
    assert table.rows[1] == ["mamba", "0.700 (lr 2.2e-3, 2 lrs, 3 runs)", "no record"]
    (note,) = [n for n in rep.notes if "share a learning rate" in n]
    assert "1 group(s)" in note and run in note and "best_over_lr=false shows every run" in note


def test_best_over_lr_keeps_batch_sizes_apart(grid, tmp_path):
    # train.py records its batch size: runs at another batch size are their own group, shown in
    # the same cell with their batch size, and no note about shared learning rates.
    for lr, acc in zip(LRS, (0.2, 0.7), strict=True):
        run = f"mamba-d64-lr{lr}-bs256"
        records = sweep_records(run, "mamba", 64, lr, {"T64_kv4": (64, acc)})
        write_json(grid / run / "results" / "train.json", [r | {"batch_size": 256} for r in records])
    for lr in LRS:  # the grid's runs, now recording their batch of 64
        path = grid / f"mamba-d64-lr{lr}" / "results" / "train.json"
        write_json(path, [r | {"batch_size": 64} for r in json.loads(path.read_text())])
    rep = make_report(f"[{grid}]", tmp_path / "out")
    table = next(t for t in rep.tables if t.title.startswith("Best"))
    params = f"{PARAMS['mamba']:,} params"
    assert table.rows[1] == [
        "mamba",
        f"0.600 (lr 2.2e-3, 2 lrs, batch 64, {params}); 0.700 (lr 2.2e-3, 2 lrs, batch 256, {params})",
        "no record",
    ]
    assert not any("share a learning rate" in n for n in rep.notes)


def test_a_setting_given_as_null_groups_with_it_unset():
    """A new-user check: runs given +trainer.max_time=null (which trains as no max_time) and runs
    without it formed two groups, labelled max_time=null and max_time=unset."""
    records = []
    for lr, settings in ((1e-3, {"seed": 0}), (2e-3, {"seed": 0, "trainer.max_time": None})):
        run = f"attention-lr{lr}"
        one = sweep_records(run, "attention", 64, lr, {"T64_kv4": (64, 0.5)})
        records += [r | {"settings": settings} for r in one]
    groups = lr_groups(run_scores(records, "mqar", "graph"))
    assert len(groups) == 1 and groups[0].lrs == [1e-3, 2e-3]


def test_best_over_lr_keeps_runs_of_other_settings_apart(grid, tmp_path):
    """Found by a new-user check: sliding windows of 1 and 1000 tokens (same params, same batch)
    were one group, its cell the better window's score with "2 runs". train.py now records its
    other settings; groups that share a cell are led by the settings that tell them apart."""

    def settings(window: int, seed: int) -> dict:
        return {"mixer.settings.mamba.d_state": window, "seed": seed, "optim.weight_decay": 0.1}

    for lr in LRS:  # the grid's mamba runs: d_state 16, seed 0
        path = grid / f"mamba-d64-lr{lr}" / "results" / "train.json"
        write_json(path, [r | {"settings": settings(16, 0)} for r in json.loads(path.read_text())])
    for lr, acc in zip(LRS, (0.3, 0.8), strict=True):
        run = f"mamba-d64-lr{lr}-state4"
        records = sweep_records(run, "mamba", 64, lr, {"T64_kv4": (64, acc)})
        records = [r | {"settings": settings(4, 0)} for r in records]
        write_json(grid / run / "results" / "train.json", records)
    rep = make_report(f"[{grid}]", tmp_path / "out")
    table = next(t for t in rep.tables if t.title.startswith("Best"))
    params = f"{PARAMS['mamba']:,} params"
    assert table.rows[1] == [
        "mamba",
        # by value, 4 before 16 (a fresh-clone check saw "16" first: the JSON texts' order)
        f"d_state=4: 0.800 (lr 2.2e-3, 2 lrs, {params}); d_state=16: 0.600 (lr 2.2e-3, 2 lrs, {params})",
        "no record",
    ]
    assert not any("share a learning rate" in n for n in rep.notes)
    # Only what differs is named, by its full name where two settings end alike.
    three = [{"a.seed": "0", "b.seed": "1", "x": "2"}, {"a.seed": "0", "b.seed": "2", "x": "2"},
             {"a.seed": "1", "b.seed": "2", "x": "2"}]  # fmt: skip
    assert differing_settings(three) == ["a.seed=0 b.seed=1", "a.seed=0 b.seed=2", "a.seed=1 b.seed=2"]
    assert differing_settings([{"x": "1"}, {"x": "1"}]) == ["", ""]
    # Records from before train.py recorded settings, beside newer ones (a fresh-clone check got
    # every setting of the newer groups listed, and "x=?" for each of the old one's).
    mixed = [{}, {"a": "1", "b": "2", "c": "0"}, {"a": "1", "b": "3"}]
    assert differing_settings(mixed) == ["settings not recorded", "b=2 c=0", "b=3 c=unset"]
    # A setting only some runs were given (+trainer.max_time=...) tells their groups apart: both
    # cells were unlabelled.
    timed = [{"trainer.max_steps": "100"}, {"trainer.max_steps": "100", "trainer.max_time": '"00:00:01:00"'}]
    assert differing_settings(timed) == ["max_time=unset", 'max_time="00:00:01:00"']
    assert differing_settings([{}, {}]) == ["", ""]
    # A loose checkpoint's group (no settings) beside one train.py group: both labelled (the second
    # label was empty, so its figure read as part of the first's).
    assert differing_settings([{}, {"x": "1"}]) == ["settings not recorded", "settings recorded"]


def test_best_over_lr_with_bad_or_missing_learning_rates(grid, tmp_path):
    # A diverged run (NaN accuracy) never wins its group.
    run = "mamba-d64-lr0.0022"
    records = sweep_records(run, "mamba", 64, 2.2e-3, {"T64_kv4": (64, float("nan"))})
    write_json(grid / run / "results" / "train.json", records)
    rep = make_report(f"[{grid}]", tmp_path / "nan")
    table = next(t for t in rep.tables if t.title.startswith("Best"))
    assert table.rows[1] == ["mamba", "0.300 (lr 4.6e-4, 2 lrs)", "no record"]
    # A run without lr is left out of its group, and the report says so.
    write_json(
        grid / run / "results" / "train.json", [{k: v for k, v in r.items() if k != "lr"} for r in records]
    )
    rep = make_report(f"[{grid}]", tmp_path / "nolr")
    table = next(t for t in rep.tables if t.title.startswith("Best"))
    assert table.rows[1] == ["mamba", "0.300 (lr 4.6e-4, 1 lr)", "no record"]
    assert any("1 run(s) of task=mqar record no learning rate" in n and run in n for n in rep.notes)
    # An lr that is not a number is an error naming the run, not a crash in the sort.
    write_json(grid / run / "results" / "train.json", [r | {"lr": "2.2e-3"} for r in records])
    with pytest.raises(
        ValueError, match=f"run '{run}': its records give lr = '2.2e-3', which is not a number"
    ):
        make_report(f"[{grid}]", tmp_path / "strlr")


def test_unknown_task_is_an_error_listing_the_tasks_present(grid, tmp_path, monkeypatch, capsys):
    match = r"^unknown task='MQAR': the records hold task=mqar; known tasks: copy, .*; pass one of them, e\.g\. task=mqar$"
    with pytest.raises(ValueError, match=match):
        make_report(f"[{grid}]", tmp_path / "out", "task=MQAR")
    assert not (tmp_path / "out").exists()  # no empty plots written
    monkeypatch.setattr(sys, "argv", sys.argv)  # restored after the test
    with pytest.raises(SystemExit) as exit_info:
        run_script(f"runs=[{grid}]", f"out={tmp_path / 'cli'}", "task=nosuch")
    assert exit_info.value.code == 2 and "error: unknown task='nosuch'" in capsys.readouterr().err
    # A known task the records lack is noted, not an error (e.g. decode-only or text runs).
    rep = make_report(f"[{grid}]", tmp_path / "known", "task=induction_heads")
    assert any(
        "no accuracy records for task=induction_heads; the records hold task=mqar" in n for n in rep.notes
    )


def test_best_over_lr_scores_recall_accuracy_at_the_training_length(tmp_path):
    """eval/recall.py's accuracy wins over val/acc, at train_seqlen (not the shortest length), through
    the preferred path (recall_path=decode)."""
    for lr, val_acc, test_accs in ((1e-3, 0.9, [0.95, 0.5, 0.2]), (3e-3, 0.8, [0.9, 0.7, 0.2])):
        run_dir = tmp_path / "runs" / f"attention-lr{lr}"
        train = sweep_records(run_dir.name, "attention", 64, lr, {"T128_kv8": (128, val_acc)})
        write_json(run_dir / "results" / "train.json", train)
        recall = recall_records(run_dir.name, "attention", test_accs, ["parallel", "decode"])
        write_json(
            run_dir / "checkpoints" / "best.ckpt.recall.json", [r | {"train_seqlen": 128} for r in recall]
        )
    rep = make_report(f"[{tmp_path / 'runs'}]", tmp_path / "out")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.title == "Best over learning rates: mqar (test) at T128_kv8, 2 layers"
    assert table.rows == [["attention", "0.700 (lr 3e-3, 2 lrs)"]]  # decode path: parallel scores 0.69
    # Without seqlen=, the quality-vs-memory plot is drawn at the training length too, not at the
    # shortest length evaluated (64), where the two tables would disagree.
    (point,) = rep.points["recall_vs_state_bytes"]
    assert (point["run"], point["seqlen"], point["accuracy"], point["label"]) == (
        "attention-lr0.003",
        128,
        0.7,
        "attention d64 @ 128",
    )
    rep = make_report(f"[{tmp_path / 'runs'}]", tmp_path / "out", "seqlen=256")  # both 0.2 at 256
    (point,) = rep.points["recall_vs_state_bytes"]
    assert point["run"] == "attention-lr0.003"  # the best at the training length, drawn at seqlen 256


def test_runs_scored_on_recall_records_leave_the_val_table_with_a_note(grid, tmp_path):
    # One grid run evaluated with eval/recall.py: it moves to a (test) table, and a note says why
    # the (val) table no longer lists it.
    run = "mamba-d64-lr0.0022"
    write_json(
        grid / run / "checkpoints" / "best.ckpt.recall.json",
        recall_records(run, "mamba", [0.9, 0.8, 0.1], ["decode"]),
    )
    rep = make_report(f"[{grid}]", tmp_path / "out")
    titles = [t.title for t in rep.tables if t.title.startswith("Best")]
    assert titles == [
        "Best over learning rates: mqar (test) at T64_kv4, 2 layers",
        "Best over learning rates: mqar (val) at T64_kv4, 2 layers",
    ]
    assert any("is scored on them, in the (test) table only" in n for n in rep.notes)
    # The sweep it belongs to is split between the tables, each picking the best of its part (a
    # new-user check: the (test) table's "1 lr" read as the sweep's best).
    (split,) = [n for n in rep.notes if "is split between" in n]
    assert split.startswith(
        "Best over learning rates: the sweep of mamba (d_model 64) is split between the (test) table (lr "
        "2.2e-3, evaluated with eval/recall.py) and the (val) table (lr "
    ), split
    assert split.endswith("each picks the best of its part only; evaluate every lr of it with eval/recall.py "
                          "to compare them on one split")  # fmt: skip


def test_length_plot_needs_more_than_one_length(grid, tmp_path):
    # A sweep validated at its training length only (Zoology's MQAR cells): all its points would sit
    # on one x value, so the plot is left out with a note.
    rep = make_report(f"[{grid}]", tmp_path / "out")
    assert rep.figures["accuracy_vs_length"] is None and "accuracy_vs_length" not in rep.pngs
    assert "every run was evaluated at one length (64 tokens)" in rep.markdown.read_text()
    assert any(n.startswith("Length generalisation: not drawn, every run was evaluated") for n in rep.notes)
    assert rep.figures["recall_vs_state_bytes"] is not None


def test_equal_accuracies_pick_the_smaller_lr(tmp_path):
    for lr in (1e-2, 1e-4, 1e-3):  # none learnt anything
        run = f"mamba-lr{lr}"
        write_json(tmp_path / run / "results" / "train.json",
                   sweep_records(run, "mamba", 64, lr, {"T64_kv4": (64, 0.0)}))  # fmt: skip
    rep = make_report(f"[{tmp_path}]", tmp_path / "out")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.rows == [["mamba", "0.000 (lr 1e-4, 3 lrs)"]]
    assert [p["run"] for p in rep.points["recall_vs_state_bytes"]] == ["mamba-lr0.0001"]


def test_records_without_width_or_slice_still_group_by_lr(tmp_path):
    """train.json written before train.py recorded d_model, n_layers and slice (lr only)."""
    for lr, acc in ((1e-3, 0.4), (1e-2, 0.5)):
        run = f"attention-lr{lr}"
        old = [
            {k: v for k, v in r.items() if k not in ("d_model", "n_layers", "slice")}
            for r in sweep_records(run, "attention", 64, lr, {"T64_kv4": (64, acc)})
        ]
        write_json(tmp_path / run / "results" / "train.json", old)
    rep = make_report(f"[{tmp_path}]", tmp_path / "out")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.title == "Best over learning rates: mqar (val) at seqlen 64"
    assert table.columns == ["mixer", "d_model ?"] and table.rows == [["attention", "0.500 (lr 1e-2, 2 lrs)"]]


def test_runs_without_lr_get_no_best_lr_table(report):
    assert not any(t.title.startswith("Best over learning rates") for t in report.tables)
    assert any("no run of task=mqar records its learning rate" in n for n in report.notes)
    assert len(report.points["recall_vs_state_bytes"]) == 3  # nothing left out


INDUCTION_SLICES = {"T256": 256, "T64": 64, "T512": 512, "T1024": 1024, "T16384": 16384}


def test_induction_slices_get_their_lengths_and_settings_stay_apart(tmp_path):
    """induction_extrapolation's val slices (T64 ... T16384) fold into val/acc at their lengths; learned
    and RoPE positions (different params) are two groups sharing a cell."""
    for pos, params, accs in (("learned", 600_000, (0.9, 1.0)), ("rope", 500_000, (0.7, 0.6))):
        for lr, acc in zip((2e-4, 1e-3), accs, strict=True):
            run = f"attention-attn_{pos}-lr{lr}"
            slices = {name: (t, acc if t <= 256 else acc / 2) for name, t in INDUCTION_SLICES.items()}
            train = sweep_records(run, "attention", 64, lr, slices, task="induction_heads", params=params)
            write_json(tmp_path / "runs" / run / "results" / "train.json", train)
    rep = make_report(
        f"[{tmp_path / 'runs'}]", tmp_path / "out", "task=induction_heads", "best_over_lr=false"
    )
    lines = {
        line.get_label(): list(line.get_xdata())
        for line in rep.figures["accuracy_vs_length"].axes[0].get_lines()
    }
    assert len(lines) == 4 and all(x == [64, 256, 512, 1024, 16384] for x in lines.values())
    results = {t.title: t for t in rep.tables}["Results: induction_heads (val)"]
    assert [c for c in results.columns if c.startswith("val/")] == ["val/acc", "val/loss"]
    rows = [dict(zip(results.columns, row, strict=True)) for row in results.rows]
    learned = [
        (r["seqlen"], r["slice"], r["val/acc"]) for r in rows if r["run"] == "attention-attn_learned-lr0.001"
    ]
    assert learned == [(64, "T64", 1.0), (256, "T256", 1.0), (512, "T512", 0.5), (1024, "T1024", 0.5),
                       (16384, "T16384", 0.5)]  # fmt: skip
    (best,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert best.title == "Best over learning rates: induction_heads (val) at T256, 2 layers"
    assert best.rows == [
        ["attention", "0.700 (lr 2e-4, 2 lrs, 500,000 params); 1.000 (lr 1e-3, 2 lrs, 600,000 params)"]
    ]


@pytest.mark.parametrize(
    "module",
    [
        data_lib.MQARDataModule,
        data_lib.InductionHeadsDataModule,
        data_lib.CopyDataModule,
        data_lib.SelectiveCopyingDataModule,
        data_lib.PasskeyDataModule,
        data_lib.MultiKeyNeedleDataModule,
    ],
)
def test_every_data_modules_slice_names_fold(module):
    names = module().slice_names
    assert names and all(fold_slice(f"val/acc_{n}") == ("val/acc", n) for n in names)
    assert fold_slice("val/loss_text") == ("val/loss", "text")  # TextDataModule's one slice
    assert fold_slice("val/acc") == ("val/acc", None) and fold_slice("loss") == ("loss", None)


def test_evaluations_of_one_checkpoint_in_several_files_make_one_curve(tmp_path):
    # eval/recall.py run twice on one checkpoint (short lengths, then long ones with output=...),
    # and best.ckpt beside last.ckpt: one curve per checkpoint, a length evaluated twice drawn once.
    run_dir = tmp_path / "mamba-run"
    short = recall_records("mamba-run", "mamba", [1.0, 1.0, 0.9], ["parallel"])  # scored 0.01 lower
    long = [r | {"seqlen": r["seqlen"] * 16, "value": 0.5} for r in short[1:]]
    again = [short[0] | {"value": 0.0}]  # 64 tokens once more, as large, as new: the first path stays
    best = [r | {"checkpoint": r["checkpoint"].replace("last", "best"), "value": 0.2} for r in short]
    write_json(run_dir / "checkpoints" / "a-short.json", short)
    write_json(run_dir / "checkpoints" / "b-long.json", long)
    write_json(run_dir / "checkpoints" / "c-again.json", again)
    write_json(run_dir / "checkpoints" / "d-best.json", best)
    rep = make_report(f"[{run_dir}]", tmp_path / "out")
    ax = rep.figures["accuracy_vs_length"].axes[0]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {
        "mamba [mamba-run] last.ckpt": (
            [64, 128, 256, 2048, 4096],
            pytest.approx([0.99, 0.99, 0.89, 0.5, 0.5]),
        ),
        "mamba [mamba-run] best.ckpt": ([64, 128, 256], pytest.approx([0.2, 0.2, 0.2])),
    }


@pytest.mark.parametrize(
    ("full_name", "quick_name"), [("best.ckpt.recall.json", "a-quick.json"), ("a-full.json", "z-quick.json")]
)
def test_a_length_evaluated_in_two_files_keeps_the_larger_evaluation(tmp_path, full_name, quick_name):
    # A later 3-example check of one checkpoint (output=...) beside its full evaluation: the plots
    # and the best-over-lr table keep the full one whichever file name sorts first, and a note
    # names the file kept and the one set aside.
    run = "attention-lr0.001"
    run_dir = tmp_path / "runs" / run
    write_json(run_dir / "results" / "train.json",
               sweep_records(run, "attention", 64, 1e-3, {"T64_kv4": (64, 0.5)}))  # fmt: skip
    full = [
        r | {"scored_positions": 4096 * r["seqlen"] // 64}
        for r in recall_records(run, "attention", [0.9, 0.8, 0.7], ["parallel", "decode"])
    ]
    later = "2026-12-02T00:00:00+00:00"
    quick = [r | {"value": 0.0, "scored_positions": 12, "time": later} for r in full if r["seqlen"] == 64]
    full_file, quick_file = run_dir / "checkpoints" / full_name, run_dir / "checkpoints" / quick_name
    write_json(full_file, full)
    write_json(quick_file, quick)
    rep = make_report(f"[{tmp_path / 'runs'}]", tmp_path / "out")
    (table,) = [t for t in rep.tables if t.title.startswith("Best over learning rates")]
    assert table.rows == [["attention", "0.900 (lr 1e-3, 1 lr)"]]
    assert [p["accuracy"] for p in rep.points["recall_vs_state_bytes"]] == [0.9]
    ax = rep.figures["accuracy_vs_length"].axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.9, 0.8, 0.7]]
    (note,) = [n for n in rep.notes if "set aside" in n]
    assert note.startswith("attention [attention-lr0.001] at 64 tokens is in several record files: ")
    assert f"kept {full_file} (decode path, 4,096 scored positions, " in note
    assert f"set aside {quick_file} (decode path, 12 scored positions, {later})" in note
    assert note in rep.markdown.read_text()
    # As many scored positions in a third file: the newer record is kept.
    write_json(run_dir / "checkpoints" / "m-again.json", [r | {"value": 0.95, "time": later} for r in full])
    rep = make_report(f"[{tmp_path / 'runs'}]", tmp_path / "again")
    assert [p["accuracy"] for p in rep.points["recall_vs_state_bytes"]] == [0.95]
    (note,) = [n for n in rep.notes if "set aside" in n and " at 64 tokens " in n]
    assert f"kept {run_dir / 'checkpoints' / 'm-again.json'} " in note
    assert str(full_file) in note and str(quick_file) in note


def test_accuracy_axes_span_zero_to_one():
    # All accuracies 0 drew a y axis from -0.06 to 0.06; 0.2-0.5 one from 0.18 to 0.52.
    for name, accs in (("recall_vs_state_bytes", (0.0, 0.0)), ("accuracy_vs_length", (0.2, 0.5))):
        spec = next(p for p in PLOTS if p.name == name)
        points = [
            {"series": f"s{i}", "state_bytes": 1e4 * (i + 1), "seqlen": 64 * (i + 1), "accuracy": a}
            for i, a in enumerate(accs)
        ]
        ax = plot_points(points, spec).axes[0]
        low, high = ax.get_ylim()
        # labelled markers keep room above 1 for their labels, and a little below 0 so that a marker
        # at 0 is drawn whole; no tick is labelled there
        lines = low == 0.0 and high == 1.0
        assert lines if spec.lines else (-0.05 < low < 0.0 and 1.0 < high <= 1.15), (name, low, high)
        ticks = [t for t in ax.get_yticks() if low <= t <= high]
        assert ticks[0] == 0.0 and ticks[-1] == pytest.approx(1.0), (name, ticks)


def test_decode_log_axis_labels_a_tick_near_slow_points():
    # 40-55 tokens/s beside 300-1200: ticks were labelled at 10^2 and 10^3 only.
    spec = next(p for p in PLOTS if p.name == "decode_tokens_per_s")
    speeds = {"slow": (55.0, 48.0, 40.0), "fast": (1200.0, 900.0, 300.0)}
    points = [
        {"series": s, "seqlen": 2**k, "tokens_per_s": y}
        for s, ys in speeds.items()
        for k, y in zip((10, 12, 14), ys, strict=True)
    ]
    fig = plot_points(points, spec)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    labels = {
        t.get_position()[1]: t.get_text()
        for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
        if t.get_text() and low <= t.get_position()[1] <= high
    }
    assert labels[50.0] == "50" and labels[1000.0] == "1,000", labels
    boxes = sorted((t.get_window_extent() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
                    if t.get_text() and low <= t.get_position()[1] <= high), key=lambda b: b.y0)  # fmt: skip
    assert all(below.y1 <= above.y0 for below, above in itertools.pairwise(boxes))


def test_layout_text_names_zambas_shared_block():
    assert compact_layout(["mamba", "mamba", "attention", "mamba"]) == "mamba x2, attention, mamba"
    shared = {"mixer": "attention", "every": 6}
    assert compact_layout(["mamba"] * 12, shared) == "mamba x12 + shared attention every 6"

"""Quality-vs-memory report of any set of runs: ``python eval/report.py runs=[dir1,dir2] out=report``.

Reads the result records (DESIGN.md, contract 5) under every directory of ``runs`` (entries may be
glob patterns, ``**`` recursing, or record files themselves) and draws, with matplotlib:

- recall accuracy versus decode state bytes per sequence, one labelled point per run and mixer
  (at ``seqlen``, or each run's training length), log x; with ``best_over_lr=true`` (the
  default) only the best run over learning rates of each group (see below), ``false`` every run;
- recall accuracy versus sequence length (length generalisation), one line per run and mixer;
- validation loss versus training tokens, one line per run;
- decode tokens/s versus context length, one line per run, mixer and decode mode.

The plots are drawn by :mod:`eval.report_plots`. The tables (:mod:`eval.report_tables`): the runs;
Zoology's "best over learning rates" (Arora et al. 2024, Figure 2) -- runs of ``task`` that differ
only in ``lr`` (same mixer, layout, ``d_model``, ``n_layers``, params and main slice) grouped, a
table of mixer x ``d_model`` holding each group's best accuracy (eval/recall.py's at the training
length, else ``val/acc``), its ``lr`` and the number of learning rates tried, or ``no record``; and
the results of every task and split (eval/decode.py's ``decode_bandwidth`` in GB/s).

Outputs go to ``out``: one PNG per plot, ``report.md`` (the tables, the plots as links) and
``report.html`` (self-contained: plots embedded as base64 PNG, tables inline, no network), all
written atomically. With ``wandb.enabled=true`` the tables, the plotted points (as W&B tables with
``wandb.plot.scatter`` charts) and the PNGs are logged to a W&B run (offline unless
``wandb.mode=online``); without wandb installed the files are still written.

What is read:

- record files: every ``*.json`` under a run directory (W&B and hidden directories excluded) that
  holds a list of records -- ``results/train.json`` (train.py), ``checkpoints/<ckpt>.recall.json``
  (eval/recall.py), ``decode-<mixer>-<model>.json`` (eval/decode.py). Other JSON (a dict, a list of
  non-records) is listed as ignored. A file that is not valid JSON, or a list mixing records with
  other things, or records without ``run``, ``mixer`` or a numeric ``value`` (finite and
  non-negative for eval/decode.py's tokens/s, bytes and counts; ``null``, which strict JSON holds
  for a NaN or inf such as a diverged model's loss, is read as NaN), or with a size, count or rate field
  that is negative, nan or inf, is an error naming the file; ``skip_invalid=true`` skips it with a
  note (printed and in the report) instead. A file of eval/long_context.py or eval/decode.py whose
  sweep had not finished when it was written (killed at a later length, or still running: its
  records carry ``partial``) is read, with a note naming it and the lengths it holds.
- recall accuracy: eval/recall.py's records (``metric: accuracy``, ``task``, ``seqlen``,
  ``state_bytes``, ``path``, ``checkpoint``, ``split: test``); for a run that has none, train.py's
  validation records (``val/acc`` and ``val/acc_<slice>``, shown with a ``(val)`` label; the slice
  names of every task are folded, :data:`eval.report_tables.SLICE_NAME`). Where several files
  hold one checkpoint's accuracy at one length (``output=``), the plots and the best-over-learning-
  rates table use the record through ``recall_path``, then the one of most scored positions (else
  examples), then the newest, then the one whose file path sorts first, and a note names the file
  kept and those set aside; the per-task results tables keep a row per file.
- learning rate and width: the ``lr``, ``d_model`` and ``n_layers`` of train.py's records, shared
  with the eval/recall.py records of the same run and mixer.
- validation loss: Lightning's ``metrics.csv`` (train.py's ``<run>/csv/metrics.csv``: ``step``,
  ``train/tokens`` and ``val/loss`` columns); else train.py's ``val/loss`` records carrying
  ``train_tokens``; else the ``val/loss`` and ``train/tokens`` of a W&B run's
  ``files/wandb-summary.json`` where present (offline runs of recent wandb keep their summary only
  in the binary ``.wandb`` file, which is not read).
- decode throughput: eval/decode.py's records (``metric: decode_tokens_per_s``, ``seqlen`` the
  context length, ``mode``, ``batch``).

A plot without data is skipped with a note in both pages. Nothing found at all -- no record file,
no metrics.csv, no W&B summary -- is an error naming the directories searched and the files looked
for.
"""

from __future__ import annotations

import base64
import csv
import datetime as _dt
import glob
import html
import io
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eval.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting(__name__)  # before the seconds of imports below

import hydra
import numpy as np
import yaml
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

from data import DATAMODULES
from eval.cli import CONF_DIR, SweepOutput, check_known_settings, run_command_line, user_errors
from eval.records import (
    check_creatable_dir,
    check_flag,
    check_sweep_output,
    check_wandb_settings,
    note_sweep_output,
    partial_note,
    start_wandb_run,
)
from eval.report_plots import PLOTS, plot_points
from eval.report_tables import (
    COUNT_FIELDS,
    LrGroup,
    Table,
    best_lr_tables,
    drop_worse_lrs,
    format_lr,
    format_value,
    lr_groups,
    measurement_rank,
    run_scores,
    summary_tables,
)
from models.checkpoint import atomic_write_bytes

REQUIRED_KEYS = ("run", "mixer", "metric", "value")
# eval/decode.py's metrics whose value is a rate, a byte count or a count: finite and never negative.
NON_NEGATIVE_METRICS = (
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "decode_bandwidth",
    "state_bytes",
    "kernels_per_step",
)
# Record fields that are sizes, counts or rates: a finite non-negative number, or null.
NON_NEGATIVE_FIELDS = (
    "seqlen",
    "state_bytes",
    "params",
    "d_model",
    "n_layers",
    "batch",
    "weight_bytes",
    "tokens_per_s",
    "train_tokens",
    *COUNT_FIELDS,
)
TRAIN_TOKENS, VAL_LOSS = "train/tokens", "val/loss"
LOOKED_FOR = (
    "*.json record lists (results/train.json, checkpoints/*.recall.json, decode-*.json), "
    "metrics.csv (Lightning CSVLogger) and wandb/*/files/wandb-summary.json"
)


@dataclass
class Sources:
    """Files found under the searched paths (record candidates are classified when read)."""

    searched: list[Path]
    json_files: list[Path] = field(default_factory=list)
    metrics_csvs: list[Path] = field(default_factory=list)
    wandb_summaries: list[Path] = field(default_factory=list)
    record_files: list[Path] = field(default_factory=list)
    ignored: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    # the name of each run that records, a metrics.csv or a W&B summary came from, by (resolved run
    # directory, the run's own name): qualify_rerun_names
    run_names: dict[tuple[Path, str], str] = field(default_factory=dict)


@dataclass
class Report:
    """What :func:`build_report` made: its figures (``None`` for plots without data), points, tables,
    notes and the paths written."""

    out: Path
    html: Path
    markdown: Path
    pngs: dict[str, Path]
    figures: dict[str, Figure | None]
    points: dict[str, list[dict[str, Any]]]
    tables: list[Table]
    notes: list[str]
    sources: Sources
    records: list[dict[str, Any]]


def expand_runs(runs: str | list[str]) -> list[Path]:
    """The paths ``runs`` names: directories and files as given, glob patterns expanded (``**`` recursive).

    A pattern keeps the directories, ``.json`` files and ``metrics.csv`` files it matches: the other
    files of a run tree (checkpoints, logs) that ``outputs/**`` sweeps up hold no records.

    Args:
        runs: one entry or a list; each a directory, a ``.json`` / ``metrics.csv`` file, or a pattern.

    Raises:
        ValueError: ``runs`` is empty or has an empty entry (``runs=`` would otherwise read ``.``).
        FileNotFoundError: an entry that exists nowhere, or a pattern that matches nothing or only
            files that cannot hold records (named).
    """
    entries = [runs] if isinstance(runs, str) else list(runs)
    if not entries:
        raise ValueError("runs is empty: pass runs=[<run directory or glob>,...]")
    paths: list[Path] = []
    for entry in entries:
        entry = os.path.expanduser(str(entry))
        if not entry.strip():
            raise ValueError("runs has an empty entry: pass runs=[<run directory or glob>,...]")
        if glob.has_magic(entry):
            matches = [Path(m) for m in sorted(glob.glob(entry, recursive=True))]
            if not matches:
                raise FileNotFoundError(f"runs pattern {entry!r} matches no file or directory")
            kept = [m for m in matches if m.is_dir() or m.suffix == ".json" or m.name == "metrics.csv"]
            if not kept:
                raise FileNotFoundError(
                    f"runs pattern {entry!r} matches no run directory, .json record file or metrics.csv "
                    f"(only files such as {matches[0]})"
                )
            paths += kept
        elif Path(entry).exists():
            paths.append(Path(entry))
        else:
            raise FileNotFoundError(f"run directory or record file {entry!r} does not exist")
    unique: dict[Path, Path] = {}
    for path in paths:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def find_files(paths: list[Path]) -> Sources:
    """Record candidates (``*.json`` outside ``wandb/`` and hidden directories), ``metrics.csv`` files
    and W&B summaries under ``paths`` (directories searched recursively, files taken as given).

    Raises:
        ValueError: a file that is neither ``.json`` nor ``metrics.csv`` (a ``.json.earlier`` copy told
            how to use it).
    """
    sources = Sources(searched=list(paths))
    seen: set[Path] = set()
    for root in paths:
        if root.is_file():
            if root.name.endswith(".json.earlier"):
                raise ValueError(
                    f"{root} is the earlier results a cut-short rerun kept (eval/decode.py, "
                    f"eval/long_context.py): rename it to {root.name.removesuffix('.earlier')} to use it, or "
                    "copy it to a .json name"
                )
            if root.suffix != ".json" and root.name != "metrics.csv":
                raise ValueError(f"{root} is neither a run directory, a .json record file nor a metrics.csv")
            candidates = [(root, ())]
        else:
            candidates = [(p, p.relative_to(root).parts) for p in sorted(root.rglob("*")) if p.is_file()]
        for path, parts in candidates:
            if path.resolve() in seen or any(part.startswith(".") for part in parts):
                continue
            seen.add(path.resolve())
            in_wandb = "wandb" in parts[:-1]
            if path.name == "wandb-summary.json" and in_wandb:
                sources.wandb_summaries.append(path)
            elif path.suffix == ".json" and not in_wandb:
                sources.json_files.append(path)
            elif path.name == "metrics.csv" and not in_wandb:
                sources.metrics_csvs.append(path)
    return sources


def read_record_file(path: Path) -> list[dict[str, Any]] | None:
    """The records of one JSON file, each with ``record_file`` set to ``path``; ``None`` when the file
    holds valid JSON that is not a list of records (a dict, a list of other things).

    Raises:
        ValueError: unreadable or invalid JSON, train.py's ``results/train.json`` not a list, a list
            mixing records (dicts with ``metric`` and ``value``) with other items, a record without
            ``run`` or ``mixer``, a ``value`` neither a number nor null (NaN or inf written as strict
            JSON: read as NaN), a ``value`` of a :data:`NON_NEGATIVE_METRICS` metric (tokens/s, bytes) that
            is not a finite non-negative number, or a field of :data:`NON_NEGATIVE_FIELDS` that is
            not a finite non-negative number or null; the message names the file and the item.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read result records from {path}: {err}") from err
    if not isinstance(data, list):
        if path.name == "train.json" and path.parent.name == "results":
            # train.py's own record file: anything else there is a damaged run, not another tool's
            # JSON to pass over (a new-user check: {} there dropped the run from the report silently)
            held = type(data).__name__
            raise ValueError(f"{path}: train.py writes a JSON list of records there, but it holds a {held}")
        return None
    is_record = [isinstance(item, dict) and "metric" in item and "value" in item for item in data]
    if data and not any(is_record):
        return None
    records = []
    for i, (item, ok) in enumerate(zip(data, is_record, strict=True)):
        if not ok:
            raise ValueError(f"{path}: item {i} is not a result record (a dict with metric and value)")
        missing = [key for key in REQUIRED_KEYS if key not in item]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {missing} (records need {list(REQUIRED_KEYS)})")
        value = item["value"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{path}: record {i} has a non-numeric value {value!r}")
        finite_non_negative = value is not None and math.isfinite(value) and value >= 0
        if item["metric"] in NON_NEGATIVE_METRICS and not finite_non_negative:
            raise ValueError(
                f"{path}: record {i} ({item['metric']}) has value={value!r}; it must be a finite "
                "non-negative number (tokens/s, bytes or a count)"
            )
        for key in NON_NEGATIVE_FIELDS:  # lr: lr_groups
            field_value = item.get(key)
            if field_value is not None and (
                isinstance(field_value, bool)
                or not isinstance(field_value, int | float)
                or not math.isfinite(field_value)
                or field_value < 0
            ):
                raise ValueError(
                    f"{path}: record {i} has {key}={field_value!r}; it must be a finite non-negative "
                    "number or null"
                )
        # null: a NaN or inf (a diverged model's loss) in strict JSON (eval.records.write_records),
        # shown as nan like one read from a file that holds NaN
        records.append({**item, "value": math.nan if value is None else value, "record_file": str(path)})
    return records


def load_records(sources: Sources, skip_invalid: bool) -> list[dict[str, Any]]:
    """Read every record candidate of ``sources``, filling its ``record_files``, ``ignored`` and
    ``skipped`` lists and ``partial`` (a note per file of a sweep that had not finished,
    :func:`eval.records.partial_note`); returns all records.

    Raises:
        ValueError: an invalid file (see :func:`read_record_file`), unless ``skip_invalid``, which
            records the file in ``sources.skipped`` instead (the report notes it).
    """
    records: list[dict[str, Any]] = []
    for path in sources.json_files:
        try:
            found = read_record_file(path)
        except ValueError as err:
            _skip_or_raise(sources, err, skip_invalid)
            continue
        if found is None:
            sources.ignored.append(path)
        else:
            sources.record_files.append(path)
            records += found
            note = partial_note(str(path), found)
            if note is not None:
                sources.partial.append(note)
    return qualify_rerun_names(records, sources)


def curve_dirs(sources: Sources) -> tuple[list[Path], list[Path]]:
    """The run directories of ``sources``' metrics.csv files (the folder's parent when the folder is
    train.py's ``csv/``, else the folder) and W&B summaries (the directory holding ``wandb/``)."""
    csvs = [p.parent.parent if p.parent.name == "csv" else p.parent for p in sources.metrics_csvs]
    return csvs, [p.parents[3] if len(p.parents) > 3 else p.parent for p in sources.wandb_summaries]


def qualify_rerun_names(
    records: list[dict[str, Any]], sources: Sources | None = None
) -> list[dict[str, Any]]:
    """Tell apart runs of one name in different directories (a rerun in another session's folder):
    their records are renamed with their directories' parents, ``<parent>/<run>`` for each (more
    levels where that does not tell them apart; :func:`run_names`), as their metrics.csv curves are
    in :func:`val_loss_points`; every record gets ``run_dir``. A record's directory is its file's
    nearest ancestor named after its run (``<run>/results/train.json``), else the folder holding
    the file's ``results/`` or ``checkpoints/`` folder (a run directory renamed after the run),
    else the file's folder. With ``sources``, the run directories of its curves (:func:`curve_dirs`)
    are named with them, by their folders' names where they have no records, into
    ``sources.run_names``."""
    keys: list[tuple[Path, str]] = []
    for r in records:
        path = Path(r["record_file"])
        run_dir = next((p for p in path.parents if p.name == r["run"]), None)
        if run_dir is None:
            run_dir = path.parent.parent if path.parent.name in ("results", "checkpoints") else path.parent
        keys.append((run_dir.resolve(), r["run"]))
    runs = list(dict.fromkeys(keys))
    if sources is not None:
        csvs, summaries = curve_dirs(sources)
        recorded = {run_dir for run_dir, _ in runs}
        curves = [d.resolve() for d in [*csvs, *summaries] if d.resolve() not in recorded]
        runs += list(dict.fromkeys((d, d.name) for d in curves))
    named = run_names(runs)
    if sources is not None:
        sources.run_names.update(named)
    for r, key in zip(records, keys, strict=True):
        r["run"], r["run_dir"] = named[key], str(key[0])
    return records


def run_names(
    runs: list[tuple[Path, str]], taken: dict[str, Path] | None = None
) -> dict[tuple[Path, str], str]:
    """A name for each run ``(resolved run directory, the run's own name)`` of ``runs`` (distinct):
    its own name where no other directory has a run of that name; else, for every directory of that
    name alike, ``<parent>/<run>``, then ``<grandparent>/<parent>/<run>``, ...: the fewest levels of
    the folders above the run that tell them apart (``day1/run`` and ``day2/run``; a run not named
    after its directory, a loose checkpoint's, starts from the directory: ``ck/run``), else
    ``<directory>/<run>`` in full. ``taken`` holds names already given to other directories, which
    these avoid; it gets theirs."""
    taken = {} if taken is None else taken
    by_name: dict[str, list[Path]] = defaultdict(list)
    for run_dir, run in runs:
        by_name[run].append(run_dir)
    named: dict[tuple[Path, str], str] = {}
    for run, dirs in by_name.items():
        # The folders above a run: its directory's parents, from the directory itself where the run
        # is not named after it (a checkpoint kept outside a run folder, ck/att.ckpt: ck/att).
        above = {d: ([] if d.name == run else [d]) + list(d.parents) for d in dirs}
        levels = 0 if len(dirs) == 1 else 1
        while True:
            names = {d: "/".join([*(p.name for p in reversed(above[d][:levels])), run]) for d in dirs}
            if levels > max(len(folders) for folders in above.values()):
                names = {d: f"{d}/{run}" for d in dirs}  # every level taken
            if len(set(names.values())) == len(dirs) and all(taken.get(n, d) == d for d, n in names.items()):
                break
            levels += 1
        for run_dir, name in names.items():
            named[(run_dir, run)] = name
            taken[name] = run_dir
    return named


def _skip_or_raise(sources: Sources, err: ValueError, skip_invalid: bool) -> None:
    if not skip_invalid:
        raise ValueError(f"{err} (fix or delete the file, or pass skip_invalid=true to skip it)") from err
    sources.skipped.append(str(err))


def _was_interrupted(run_dir: Path) -> bool:
    """Whether ``run_dir``'s ``results/train.json`` (train.py's records) marks the run interrupted;
    False when the file is missing or unreadable (the curve is then read as a finished run's)."""
    try:
        records = json.loads((run_dir / "results" / "train.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(records, list) and any(
        isinstance(r, dict) and r.get("interrupted") is True for r in records
    )


def read_val_loss_curve(path: Path, interrupted: bool = False) -> list[tuple[float, float]]:
    """``(training tokens, validation loss in nats/token)`` of each validation in a Lightning
    CSVLogger ``metrics.csv``.

    A validation row's tokens are ``train/tokens`` interpolated at its ``step`` (``train/tokens`` at
    step ``s`` counts ``s + 1`` steps, so step -1 is 0 tokens); past the last logged training step
    (an epoch-end validation a step or two after the last log) they are extrapolated at the last
    logged tokens per step. train.py's final re-validation of the best checkpoint is dropped: it is
    logged after ``fit`` has ended, at an ``epoch`` above every training row's and a ``step`` past
    every training step (without an ``epoch`` column, every validation past the last training step
    is dropped). A run stopped by Ctrl+C or SIGTERM (``interrupted``: its train.json records say so)
    never advances the epoch, so there the last validation row, which that re-validation always
    is, is dropped instead.

    Returns:
        The points in file order; ``[]`` when the file has no ``val/loss`` or no ``train/tokens`` values.

    Raises:
        ValueError: the file cannot be read, or a ``step``, ``epoch``, ``train/tokens`` or
            ``val/loss`` value is not a number (file and line named).
    """
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"cannot read metrics from {path}: {err}") from err
    train, val = [], []  # (step, epoch or None, tokens / loss)
    for line, row in enumerate(rows, start=2):
        try:
            epoch = float(row["epoch"]) if row.get("epoch") else None
            if row.get(TRAIN_TOKENS):
                train.append((float(row["step"]), epoch, float(row[TRAIN_TOKENS])))
            if row.get(VAL_LOSS):
                val.append((float(row["step"]), epoch, float(row[VAL_LOSS])))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"{path}, line {line}: step, epoch, {TRAIN_TOKENS} or {VAL_LOSS} is not a number"
            ) from err
    if interrupted:
        val = val[:-1]
    if not train or not val:
        return []
    train.sort()
    last_step, last_tokens = train[-1][0], train[-1][2]
    train_epochs = [epoch for _, epoch, _ in train if epoch is not None]
    last_epoch = max(train_epochs) if len(train_epochs) == len(train) else None

    def after_fit(step: float, epoch: float | None) -> bool:
        if last_epoch is None or epoch is None:
            return step > last_step
        return step > last_step and epoch > last_epoch

    steps = [-1.0] + [step for step, _, _ in train]
    tokens = [0.0] + [count for _, _, count in train]
    per_step = last_tokens / (last_step + 1)
    return [
        (float(np.interp(step, steps, tokens)) + max(step - last_step, 0.0) * per_step, loss)
        for step, epoch, loss in val
        if not after_fit(step, epoch)
    ]


def read_wandb_summary(path: Path) -> dict[str, Any]:
    """The summary dict of a W&B run (``files/wandb-summary.json``).

    Raises:
        ValueError: unreadable or invalid JSON, or JSON that is not an object.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read W&B summary {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"W&B summary {path} is not a JSON object")
    return data


def series_labels(keys: list[tuple[str, str, tuple[str, ...]]]) -> dict[tuple, str]:
    """Legend labels ``"<mixer> [<run>]"`` for series keys ``(mixer, run, extras)``. Where one run and
    mixer has several series, extras that differ between them are appended, in order, until the
    labels of that run and mixer are unique (``"attention [run] cuda_graph"``)."""
    groups: dict[tuple[str, str], list[tuple[str, ...]]] = defaultdict(list)
    for mixer, run, extras in dict.fromkeys(keys):
        groups[(mixer, run)].append(extras)
    labels = {}
    for (mixer, run), group in groups.items():
        shown: list[int] = []
        for i in range(len(group[0]) if len(group) > 1 else 0):
            if len({extras[i] for extras in group}) > 1:
                shown.append(i)
            if len({tuple(extras[j] for j in shown) for extras in group}) == len(group):
                break
        for extras in group:
            suffix = ", ".join(extras[i] for i in shown if extras[i])
            labels[(mixer, run, extras)] = f"{mixer} [{run}]" + (f" {suffix}" if suffix else "")
    return labels


def accuracy_points(
    records: list[dict[str, Any]], task: str, path: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """Recall accuracy per series and length.

    One series per checkpoint (run, mixer, checkpoint file name and split): evaluations of it at
    other lengths written to other files (``output=...``) extend its curve. Of several records at
    one length, the one through ``path`` is kept, then the first by
    :func:`eval.report_tables.measurement_rank` (most scored positions, else examples, then newest,
    then first file path), so a quick check written beside a full evaluation does not replace it.

    Args:
        records: result records.
        task: the task whose accuracy counts (``mqar``).
        path: eval/recall.py path preferred where a checkpoint was evaluated through both.

    Returns:
        ``(points, notes)``. Points ``{series, run, mixer, split, seqlen (tokens), accuracy in [0,
        1], state_bytes (bytes per sequence, or None), params, d_model, n_layers, lr (each from any
        record of the run and mixer, or None), train_seqlen (tokens, or None)}``: eval/recall.py's
        ``accuracy`` records (their ``train_seqlen``), and for runs without any, train.py's
        ``val/acc`` / ``val/acc_<slice>`` records (series labelled ``(val)``; the training length is
        the plain ``val/acc``'s seqlen). Notes: one per series and length whose records come from several
        files, naming the file kept and those set aside.
    """
    mine = [r for r in records if r.get("task") == task and r.get("seqlen")]
    test = [r for r in mine if r["metric"] == "accuracy"]
    tested = {(r["run"], r["mixer"]) for r in test}
    val = [
        r
        for r in mine
        if (r["metric"] == "val/acc" or r["metric"].startswith("val/acc_"))
        and (r["run"], r["mixer"]) not in tested
    ]
    candidates: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r, split in [(r, str(r.get("split") or "test")) for r in test] + [(r, "val") for r in val]:
        checkpoint = Path(r["checkpoint"]).name if r.get("checkpoint") else ""
        candidates[((r["mixer"], r["run"], (checkpoint, split)), r["seqlen"])].append(r)

    def rank(r: dict[str, Any]) -> tuple:
        return (r.get("path") != path, *measurement_rank(r))

    chosen = {slot: min(rows, key=rank) for slot, rows in candidates.items()}
    labels = series_labels(list(dict.fromkeys(key for key, _ in chosen)))
    notes = []
    for (key, seqlen), kept in chosen.items():
        others: dict[str, dict[str, Any]] = {}  # file set aside -> its best record here
        for r in sorted(candidates[(key, seqlen)], key=rank):
            if r.get("record_file") != kept.get("record_file"):
                others.setdefault(r.get("record_file"), r)
        if others:
            aside = ", ".join(f"{file} ({_measurement(r)})" for file, r in others.items())
            notes.append(
                f"{labels[key]}{' (val)' if key[2][1] == 'val' else ''} at {seqlen} tokens is in several "
                f"record files: kept {kept.get('record_file')} ({_measurement(kept)}); set aside {aside} "
                f"(rule: the recall_path={path} record, then the most scored positions or examples, then "
                "the newest time, then the first file path)"
            )
    # recall records lack d_model, n_layers and lr: train.py's give them
    model_sizes: dict[str, dict[tuple[str, str], Any]] = {"d_model": {}, "n_layers": {}, "lr": {}}
    for r in records:
        for name, values in model_sizes.items():
            if r.get(name) is not None:
                values.setdefault((r["run"], r["mixer"]), r[name])
    # train.py's configs make the first validation slice (the plain val/acc) the training length
    trained_at = {(r["run"], r["mixer"]): r["seqlen"] for r in val if r["metric"] == "val/acc"}
    for r in test:
        trained_at.setdefault((r["run"], r["mixer"]), r.get("train_seqlen"))
    return [
        {
            "series": labels[key] + (" (val)" if key[2][1] == "val" else ""),
            "run": r["run"],
            "mixer": r["mixer"],
            "split": key[2][1],
            "seqlen": r["seqlen"],
            "accuracy": r["value"],
            "state_bytes": r.get("state_bytes"),
            "params": r.get("params"),
            **{name: values.get((r["run"], r["mixer"])) for name, values in model_sizes.items()},
            "train_seqlen": trained_at.get((r["run"], r["mixer"])),
        }
        for (key, _), r in chosen.items()
    ], notes


def _measurement(r: dict[str, Any]) -> str:
    """What a record says of its measurement, for a note: its path, counts and time, if given
    (``decode path, 12,288 scored positions, 2026-12-01T10:00:00+00:00``)."""
    parts = [f"{r['path']} path"] if r.get("path") else []
    parts += [f"{format_value(r[f])} {f.replace('_', ' ')}" for f in COUNT_FIELDS if r.get(f) is not None]
    parts += [str(r["time"])] if r.get("time") else []
    return ", ".join(parts) or "no count or time"


def recall_vs_state_points(
    accuracy: list[dict[str, Any]], seqlen: int | None
) -> tuple[list[dict], list[str]]:
    """One point per series of :func:`accuracy_points`: the one at ``seqlen`` tokens, or, when
    ``seqlen`` is None, at the series' training length (else its shortest length, for records that
    do not give it); points without ``state_bytes`` are left out.
    Labels read ``<mixer> d<d_model> @ <seqlen>`` (no width where the records give none); where
    several points would otherwise share a label, the layer count and learning rate where those
    differ among them (``attention d128 lr 0.00046 @ 256``), else ``[<run>]``, before the ``@``
    (run names in every label made 20 runs' plot unreadable: the legend names the runs).

    Returns:
        ``(points with a "label" for annotation, notes on series left out or drawn at a length other
        than their training length)``.
    """
    by_series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in accuracy:
        if p["state_bytes"]:
            by_series[p["series"]].append(p)
    points, notes = [], []
    for series, pts in sorted(by_series.items()):
        if seqlen:
            at = [p for p in pts if p["seqlen"] == seqlen]
        else:
            trained = [p for p in pts if p["seqlen"] == p.get("train_seqlen")]
            at = trained or [min(pts, key=lambda p: p["seqlen"])]
            if not trained and at[0].get("train_seqlen") is not None:
                # said (a new-user check: a run trained at 64 was drawn "@ 65" without a word)
                notes.append(
                    f"{series}: no recall accuracy at its training length {at[0]['train_seqlen']}; the "
                    f"quality-vs-memory plot shows its shortest length evaluated, {at[0]['seqlen']} (seqlen= "
                    "picks one length for every run)"
                )
        if not at:
            notes.append(f"{series}: no recall accuracy at seqlen {seqlen} for the quality-vs-memory plot")
            continue
        width = f" d{at[0]['d_model']}" if at[0].get("d_model") else ""
        points.append({**at[0], "label": f"{at[0]['mixer']}{width} @ {at[0]['seqlen']}"})
    alike: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        alike[p["label"]].append(p)
    for label, group in alike.items():  # runs alike in mixer, width and length
        if len(group) == 1:
            continue
        differ = [name for name in ("n_layers", "lr") if len({p.get(name) for p in group}) > 1]
        told = [" ".join(_setting_text(name, p.get(name)) for name in differ) for p in group]
        if not differ or len(set(told)) < len(group):
            told = [f"[{p['run']}]" for p in group]  # their run names tell them apart
        for p, text in zip(group, told, strict=True):
            p["label"] = label.replace(" @ ", f" {text} @ ")
    return points, notes


def _setting_text(name: str, value: Any) -> str:
    """``lr 0.00046``, ``L8`` (n_layers) or ``<name> ?`` where a run's records do not give it."""
    if value is None:
        return f"{name} ?"
    return f"L{value}" if name == "n_layers" else f"{name} {value:g}"


def decode_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode throughput points ``{series, run, mixer, mode, seqlen (context tokens), tokens_per_s}``
    of eval/decode.py's ``decode_tokens_per_s`` records; one series per run, mixer, mode, batch,
    dtype, device and record file."""
    rows = [r for r in records if r["metric"] == "decode_tokens_per_s" and r.get("seqlen")]
    keys = []
    for r in rows:
        extras = (
            str(r.get("mode") or ""),
            f"batch {r['batch']}" if r.get("batch") else "",
            str(r.get("dtype") or ""),
            str(r.get("device") or ""),
            r["record_file"],
        )
        keys.append((r["mixer"], r["run"], extras))
    labels = series_labels(list(dict.fromkeys(keys)))
    return [
        {
            "series": labels[key],
            "run": r["run"],
            "mixer": r["mixer"],
            "mode": r.get("mode"),
            "seqlen": r["seqlen"],
            "tokens_per_s": r["value"],
            "linestyle": "--" if r.get("mode") == "eager" else "-",
        }
        for key, r in zip(keys, rows, strict=True)
    ]


# The settings (train.py's records' ``settings``) that decide what one unit of validation loss means:
# the task, the corpus and the tokens it is cut into.
LOSS_SCALE_SETTINGS = ("data.name", "data.path", "data.dataset_name", "data.tokenizer", "model.vocab_size")


def _loss_scale_notes(records: list[dict[str, Any]], runs: list[str]) -> list[str]:
    """A note when the runs of the validation-loss plot were trained on other tasks, corpora or
    tokenizers (:data:`LOSS_SCALE_SETTINGS`, from the records' ``settings``): nats per token of a
    character and of a byte tokenizer, or of MQAR's answers and of text, are not one scale. Runs
    whose records carry no settings are not compared."""
    scales: dict[str, list[str]] = defaultdict(list)
    seen = set()
    for r in records:
        settings = r.get("settings")
        if r["run"] in runs and r["run"] not in seen and isinstance(settings, dict):
            seen.add(r["run"])
            shown = [name for name in LOSS_SCALE_SETTINGS if name in settings]
            scale = ", ".join(f"{name.split('.', 1)[1]}={json.dumps(settings[name])}" for name in shown)
            scales[scale].append(r["run"])
    if len(scales) < 2:
        return []
    listed = "; ".join(f"{scale} ({', '.join(sorted(names))})" for scale, names in sorted(scales.items()))
    return [
        f"Validation loss vs training tokens: the runs were trained on other tasks, corpora or tokenizers, "
        f"whose losses per token are not on one scale: {listed}; compare within one (report them with "
        "separate runs=)"
    ]


def val_loss_points(
    records: list[dict[str, Any]], sources: Sources, skip_invalid: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """Validation loss (nats/token) versus training tokens per run: the metrics.csv curve, else
    ``val/loss`` records with ``train_tokens``, else a W&B summary's ``val/loss`` at ``train/tokens``.

    A metrics.csv's run directory is its folder's parent when the folder is train.py's ``csv/``,
    else its folder; a W&B summary's is the directory holding ``wandb/``. The run is the one the
    directory's records name (see :func:`qualify_rerun_names`), else the directory's name
    (``<parent>/<name>`` where other directories have that name: :func:`run_names`). The mixer is the one of
    that run's records, else ``model.name`` of the CSV logger's ``hparams.yaml``, else ``unknown``.

    Returns:
        ``(points {series, run, mixer, train_tokens, val_loss, source}, notes on files without a curve)``;
        whether the runs' losses share a scale is :func:`_loss_scale_notes`' question, asked of the
        runs left after the task filter.

    Raises:
        ValueError: an unreadable metrics.csv or W&B summary, unless ``skip_invalid`` (then skipped
            and listed in ``sources.skipped``, which the report notes).
    """
    # a directory's run is the one its records name (qualify_rerun_names), else the folder's name,
    # with its parents where another directory has that name (run_names)
    by_dir: dict[Path, tuple[str, str]] = {}
    taken: dict[str, Path] = {}
    for r in records:
        run_dir = Path(r.get("run_dir") or Path(r["record_file"]).parent).resolve()
        by_dir.setdefault(run_dir, (r["run"], r["mixer"]))
        taken.setdefault(r["run"], run_dir)
    csv_dirs, wandb_dirs = curve_dirs(sources)
    # named with the records where load_records read them, else here, all at once, so that reruns
    # of one name are named alike (day1/run and day2/run)
    names = dict(sources.run_names)
    unnamed = [(d.resolve(), d.resolve().name) for d in [*csv_dirs, *wandb_dirs]]
    names |= run_names([k for k in dict.fromkeys(unnamed) if k[0] not in by_dir and k not in names], taken)

    def run_of(run_dir: Path, hparams: Path) -> tuple[str, str]:
        run_dir = run_dir.resolve()
        if run_dir not in by_dir:
            by_dir[run_dir] = (names[(run_dir, run_dir.name)], _hparams_mixer(hparams))
        return by_dir[run_dir]

    curves: dict[str, tuple[str, list[tuple[float, float]], str]] = {}
    notes = []
    for path, run_dir in zip(sources.metrics_csvs, csv_dirs, strict=True):
        try:
            curve = read_val_loss_curve(path, _was_interrupted(run_dir))
        except ValueError as err:
            _skip_or_raise(sources, err, skip_invalid)
            continue
        if not curve:
            notes.append(f"{path}: no {VAL_LOSS} rows with {TRAIN_TOKENS} logged by then; not plotted")
            continue
        name, mixer = run_of(run_dir, path.parent / "hparams.yaml")
        curves.setdefault(name, (mixer, curve, str(path)))
    for r in records:
        if r["metric"] == VAL_LOSS and r.get("train_tokens") is not None and r["run"] not in curves:
            curves[r["run"]] = (r["mixer"], [(float(r["train_tokens"]), r["value"])], r["record_file"])
    for path, run_dir in zip(sources.wandb_summaries, wandb_dirs, strict=True):
        try:
            summary = read_wandb_summary(path)
        except ValueError as err:
            _skip_or_raise(sources, err, skip_invalid)
            continue
        tokens, loss = summary.get(TRAIN_TOKENS), summary.get(VAL_LOSS)
        name, mixer = run_of(run_dir, run_dir / "csv" / "hparams.yaml")
        if name in curves or not isinstance(tokens, int | float) or not isinstance(loss, int | float):
            continue
        curves[name] = (mixer, [(float(tokens), float(loss))], str(path))
    labels = series_labels([(mixer, run, ()) for run, (mixer, _, _) in curves.items()])
    points = [
        {
            "series": labels[(mixer, run, ())],
            "run": run,
            "mixer": mixer,
            "train_tokens": tokens,
            "val_loss": loss,
            "source": source,
        }
        for run, (mixer, curve, source) in curves.items()
        for tokens, loss in curve
    ]
    return points, notes


def _hparams_mixer(path: Path) -> str:
    # Lightning's CSVLogger writes the LightningModule's hyperparameters there: model.name is the mixer.
    try:
        hparams = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return "unknown"
    model = hparams.get("model") if isinstance(hparams, dict) else None
    return str(model.get("name")) if isinstance(model, dict) and model.get("name") else "unknown"


def render_markdown(
    report_title: str,
    figures: dict[str, str | None],
    skipped: dict[str, str],
    tables: list[Table],
    notes: list[str],
    sources: Sources,
) -> str:
    """The report as markdown: plots as links to their PNG files (``figures``: plot name -> file name),
    a skipped plot's section saying why (``skipped``: plot name -> sentence), the tables, notes and
    sources."""
    lines = [f"# {report_title}", ""]
    for spec in PLOTS:
        lines += [f"## {spec.title}", ""]
        png = figures.get(spec.name)
        lines += [f"![{spec.title}]({png})" if png else f"*{skipped[spec.name]}*", ""]
    for table in tables:
        lines += [f"## {table.title}", "", _md_row(table.columns), _md_row(["---"] * len(table.columns))]
        lines += [_md_row([format_value(v) for v in row]) for row in table.rows]
        lines.append("")
    lines += ["## Notes", ""] + [f"- {n}" for n in notes or ["none"]] + [""]
    lines += ["## Sources", ""] + [f"- {s}" for s in _source_lines(sources)] + [""]
    return "\n".join(lines)


# characters that would format a table cell in markdown (a run named *bold* or <b>x</b>)
_MD_SPECIAL = re.compile(r"([\\`*|<>\[\]])")


def _md_row(cells: list[str]) -> str:
    """One markdown table row, each cell's text shown as written (formatting characters escaped)."""
    return "| " + " | ".join(_MD_SPECIAL.sub(r"\\\1", str(c)) for c in cells) + " |"


def _source_lines(sources: Sources) -> list[str]:
    return [
        "searched: " + ", ".join(str(p) for p in sources.searched),
        *(f"record file: {p}" for p in sources.record_files),
        *(f"metrics.csv: {p}" for p in sources.metrics_csvs),
        *(f"W&B summary: {p}" for p in sources.wandb_summaries),
        *(f"ignored (not a record list): {p}" for p in sources.ignored),
        *(f"skipped (invalid): {s}" for s in sources.skipped),
    ]


def render_html(
    report_title: str,
    pngs: dict[str, bytes | None],
    skipped: dict[str, str],
    tables: list[Table],
    notes: list[str],
    sources: Sources,
) -> str:
    """The report as one self-contained HTML page: each plot an ``<img>`` holding its PNG bytes as a
    base64 data URI (``pngs``: plot name -> bytes, or None for a skipped plot, whose section says why:
    ``skipped``), tables inline, no script, stylesheet or network reference."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(report_title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:80em}"
        "table{border-collapse:collapse;margin-bottom:1.5em}"
        "th,td{border:1px solid #bbb;padding:.2em .5em;text-align:right}"
        "td:nth-child(-n+2),th{text-align:left}.note{color:#a33}img{max-width:100%}</style>",
        "</head><body>",
        f"<h1>{esc(report_title)}</h1>",
    ]
    for spec in PLOTS:
        parts.append(f"<h2>{esc(spec.title)}</h2>")
        png = pngs.get(spec.name)
        if png is None:
            parts.append(f'<p class="note">{esc(skipped[spec.name])}</p>')
        else:
            data = base64.b64encode(png).decode("ascii")
            parts.append(f'<figure><img alt="{esc(spec.title)}" src="data:image/png;base64,{data}"></figure>')
    for table in tables:
        parts += [f"<h2>{esc(table.title)}</h2>", "<table>"]
        parts.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>")
        for row in table.rows:
            parts.append("<tr>" + "".join(f"<td>{esc(format_value(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
    parts += ["<h2>Notes</h2>", "<ul>"] + [f"<li>{esc(n)}</li>" for n in notes or ["none"]] + ["</ul>"]
    parts += ["<h2>Sources</h2>", "<ul>"] + [f"<li>{esc(s)}</li>" for s in _source_lines(sources)] + ["</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def log_report_to_wandb(report: Report, *, enabled: bool, project: str, mode: str, name: str) -> bool:
    """Log the report to a new W&B run (offline unless ``mode="online"``, under ``report.out``): each
    table as a ``wandb.Table``, each plot's points as a table with a ``wandb.plot.scatter`` chart
    (``<plot>/points``, ``<plot>/scatter``) and each PNG as a ``wandb.Image``.

    Returns:
        True when logged; False when disabled, wandb is not installed (reported on stdout) or W&B
        refuses to start an online run (:func:`eval.records.wandb_start_refused`, reported on stderr);
        the files remain the report.
    """
    if not enabled:
        return False
    run = start_wandb_run(
        project=project, name=name, mode=mode, save_dir=report.out, job_type="report",
        kept="the report was written as files only",
    )  # fmt: skip
    if run is None:
        return False
    import wandb

    try:
        log: dict[str, Any] = {}
        for table in report.tables:
            key = "table/" + re.sub(r"[^a-z0-9]+", "_", table.title.lower()).strip("_")
            log[key] = wandb.Table(columns=table.columns, data=[list(row) for row in table.rows])
        for spec in PLOTS:
            points = report.points[spec.name]
            if not points:
                continue
            columns = ["series", "run", "mixer", spec.x, spec.y]
            points_table = wandb.Table(columns=columns, data=[[p[c] for c in columns] for p in points])
            log[f"{spec.name}/points"] = points_table
            log[f"{spec.name}/scatter"] = wandb.plot.scatter(points_table, spec.x, spec.y, title=spec.title)
            log[f"{spec.name}/png"] = wandb.Image(str(report.pngs[spec.name]))
        run.log(log)
    finally:
        wandb.finish()
    return True


def check_earlier_report(out: Path) -> bool:
    """Whether ``out`` holds an earlier report of this script (``report.md`` opening with ``# mixerlab
    report``, ``report.html`` titled so), which the new one replaces, stale plots included.

    Raises:
        ValueError: ``out`` holds a ``report.md`` or ``report.html`` this script did not write (a
            new-user check: a hand-written report.md was overwritten, and a plot of the same name as
            one not drawn deleted, as if both were an earlier report's).
    """
    marks = {"report.md": "# mixerlab report (", "report.html": "<title>mixerlab report ("}
    found = False
    for name, mark in marks.items():
        path = out / name
        if not path.exists():
            continue
        try:
            head = path.read_bytes()[:4096].decode("utf-8", errors="replace")
        except OSError as err:
            raise ValueError(f"out={out}: cannot read its {name} ({err.strerror or err})") from err
        if mark not in head:
            raise ValueError(
                f"out={out} holds a {name} that eval/report.py did not write, which the report would "
                "replace; pass another out= folder (or move that file)"
            )
        found = True
    return found


def build_report(cfg: DictConfig) -> Report:
    """Build the report ``cfg`` (``conf/eval/report.yaml``) describes and write it under ``cfg.out``.

    Returns:
        The :class:`Report` (figures, points, tables, notes, paths written).

    Raises:
        FileNotFoundError: a ``runs`` entry that matches nothing, or no record file, metrics.csv or
            W&B summary under any of them (the message lists the paths searched and the files looked for).
        ValueError: a top-level setting ``conf/eval/report.yaml`` does not define and nothing reads (checked
            first, :func:`eval.cli.check_known_settings`); ``wandb.enabled``, ``skip_invalid`` or
            ``best_over_lr`` not true / false (checked next, with a ``wandb.mode`` other than online / offline
            with W&B enabled); empty ``runs`` or an empty entry; an ``out`` that is not one folder path, is
            (inside) a file, cannot be written or holds a report file this script did not write
            (:func:`check_earlier_report`); a bad ``recall_path`` or ``seqlen``; a ``task`` that is
            neither a known task nor in the records; or an invalid record file, metrics.csv or W&B summary
            (named; unless ``skip_invalid=true``).
    """
    check_known_settings(cfg, "eval/report")
    check_wandb_settings(cfg.wandb)
    skip_invalid = check_flag(cfg.skip_invalid, "skip_invalid")
    best_over_lr = check_flag(cfg.best_over_lr, "best_over_lr")
    if cfg.out is not None and not isinstance(cfg.out, str):
        raise ValueError(
            f"out must be one folder path, got {cfg.out!r}; e.g. out=report (quote a name that Hydra "
            "reads as a number or list: out='2026')"
        )
    if not (cfg.out or "").strip():
        raise ValueError("out is empty: pass out=<folder> for the report's files")
    out = Path(cfg.out)
    check_creatable_dir(out, f"out={cfg.out!r} cannot be written", "pass out=<a writable folder>",
                        file_fix="pass out=<folder>")  # fmt: skip
    # A new-user check: -m task=mqar,copy out=rep left the last job's report only, without a word.
    check_sweep_output(out, option="out", folder=True)
    earlier = check_earlier_report(out)
    if cfg.recall_path not in ("decode", "parallel"):
        raise ValueError(f"recall_path must be decode or parallel, got {cfg.recall_path!r}")
    if cfg.seqlen is not None and (
        isinstance(cfg.seqlen, bool) or not isinstance(cfg.seqlen, int) or cfg.seqlen < 1
    ):
        raise ValueError(f"seqlen must be null or an integer >= 1, got {cfg.seqlen!r}")
    if not (isinstance(cfg.runs, str) or (OmegaConf.is_list(cfg.runs) and len(cfg.runs))):
        raise ValueError(
            f"runs must be a folder, a glob or a list of them, got {cfg.runs!r}; e.g. runs='outputs/*' "
            "or runs=[runA,runB]"
        )
    runs = cfg.runs if isinstance(cfg.runs, str) else list(cfg.runs)
    sources = find_files(expand_runs(runs))
    records = load_records(sources, skip_invalid)
    accuracy, duplicates = accuracy_points(records, cfg.task, cfg.recall_path)
    scores = run_scores(records, cfg.task, cfg.recall_path)
    groups = lr_groups(scores)
    shown, dropped = drop_worse_lrs(accuracy, groups) if best_over_lr else (accuracy, 0)
    by_length = accuracy
    skipped: dict[str, str] = {}  # plot name -> why its section has no plot
    if cfg.task == "text":
        # a text run's accuracy is next-token prediction, not recall: no recall plots
        recall, by_length = [], []
        why = "not drawn for task=text (next-token accuracy is not recall)"
        notes = []
        for spec in PLOTS:
            if spec.name in ("recall_vs_state_bytes", "accuracy_vs_length"):
                skipped[spec.name] = f"{why[0].upper()}{why[1:]}."
                notes.append(f"{spec.title}: {why}")
    else:
        recall, notes = recall_vs_state_points(shown, cfg.seqlen)
    notes += duplicates
    if by_length and len({p["seqlen"] for p in by_length}) == 1:
        why = f"every run was evaluated at one length ({by_length[0]['seqlen']} tokens)"
        cut = {r["record_file"] for r in records if r.get("task") == cfg.task and r.get("partial")}
        if cut:  # a cut-short length sweep (a new-user check: "one length" read as a wrong claim)
            why += f"; {', '.join(sorted(map(str, cut)))} holds a sweep that was cut short (see its note)"
        by_length = []  # one x value: nothing to generalise over
        skipped["accuracy_vs_length"] = f"Not drawn: {why}."
        notes.insert(0, f"Length generalisation: not drawn, {why}")
    if dropped and recall:
        notes.append(
            f"Recall accuracy vs decode state: only the best learning rate of each group (best_over_lr=true): "
            f"{dropped} of {len(scores)} runs left out"
        )
    if {"test", "val"} <= {g.best.split for g in groups}:
        notes.append(
            "Best over learning rates: a run with eval/recall.py records is scored on them, in the "
            "(test) table only; the (val) table holds the runs without any (train.py's validation)"
        )
    notes += split_sweep_notes(groups)
    interrupted = sorted({r["run"] for r in records if r.get("interrupted") is True})
    if interrupted:  # a new-user check: a run cut at step 2 of 60 was ranked beside finished ones unmarked
        notes.append(
            f"{len(interrupted)} run(s) were stopped before their end (Ctrl+C or SIGTERM; their records "
            f"say interrupted) and are tabled and ranked as they stood: {', '.join(interrupted)}; resume "
            "one with train.py resume=<its run folder>/checkpoints/last.ckpt to finish it"
        )
    if any(g.by_loss for g in groups):
        lossless = sorted(s.run for g in groups if g.by_loss for s in g.runs if s.loss is None)
        missing = f"; runs without a val/loss record rank last: {', '.join(lossless)}" if lossless else ""
        notes.append(
            "Best over learning rates: text runs are ranked by their best validation loss (lowest first), "
            f"with next-token accuracy beside it{missing}"
        )
    shared = [g for g in groups if len(g.runs) > len(g.lrs)]
    if shared:
        notes.append(
            f"Best over learning rates: {len(shared)} group(s) hold runs that share a learning rate "
            f"({'; '.join(', '.join(s.run for s in g.runs) for g in shared)}): they differ in a setting "
            "the records do not carry (steps, dropout, a batch size older records lack, ...), and each such group shows its best run "
            "(its cell counts the runs); best_over_lr=false shows every run, separate runs= keep them apart"
        )
    without_lr = sorted({s.run for s in scores if s.lr is None})
    if scores and not groups:
        notes.append(
            f"Best over learning rates: no table, no run of task={cfg.task} records its learning rate "
            "(lr, which train.py writes to results/train.json)"
        )
    elif without_lr:
        notes.append(
            f"Best over learning rates: {len(without_lr)} run(s) of task={cfg.task} record no learning rate "
            f"and are left out of the table: {', '.join(without_lr)}"
        )
    if not accuracy:
        tasks = accuracy_tasks(records)
        if tasks:
            notes.append(f"no accuracy records for task={cfg.task}; the records hold task={', '.join(tasks)}")
    val_loss, csv_notes = val_loss_points(records, sources, skip_invalid)
    if not (records or val_loss):
        raise FileNotFoundError(_nothing_found(sources, csv_notes))
    tasks_of: dict[str, set[str]] = defaultdict(set)
    for r in records:
        tasks_of[r["run"]].add(r.get("task"))
    # losses of different tasks share no scale: the curves of runs recorded for other tasks go
    other_task = sorted(
        {p["run"] for p in val_loss if tasks_of[p["run"]] and cfg.task not in tasks_of[p["run"]]}
    )
    if other_task:
        val_loss = [p for p in val_loss if p["run"] not in other_task]
        notes.append(
            f"Validation loss vs training tokens: {len(other_task)} run(s) of other tasks than task={cfg.task} "
            f"left out: {', '.join(other_task)}"
        )
    # after the task filter: the scale is that of the curves drawn, not of the ones left out
    notes += _loss_scale_notes(records, sorted({p["run"] for p in val_loss}))
    check_task(cfg.task, records)
    points = {
        "recall_vs_state_bytes": recall,
        "accuracy_vs_length": by_length,
        "val_loss_vs_tokens": val_loss,
        "decode_tokens_per_s": decode_points(records),
    }
    notes += sources.partial + csv_notes + [f"skipped invalid file: {s}" for s in sources.skipped]
    figures, pngs, png_bytes = {}, {}, {}
    stale = []  # an earlier report's plots that this one does not draw
    for spec in PLOTS:
        fig = figures[spec.name] = plot_points(points[spec.name], spec)
        if fig is None:
            if spec.name not in skipped:
                skipped[spec.name] = f"No data: needs {spec.missing}."
                notes.append(f"{spec.title}: not drawn, no data (needs {spec.missing})")
            png_bytes[spec.name] = None
            if earlier and (out / f"{spec.name}.png").is_file():
                stale.append(out / f"{spec.name}.png")
            continue
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        png_bytes[spec.name] = buffer.getvalue()
        pngs[spec.name] = out / f"{spec.name}.png"
    tables = summary_tables(records)
    tables[1:1] = best_lr_tables(groups)  # after Runs, before the per-task results
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    title = f"mixerlab report ({len(records)} records, {stamp})"
    markdown = render_markdown(title, {n: p.name for n, p in pngs.items()}, skipped, tables, notes, sources)
    page = render_html(title, png_bytes, skipped, tables, notes, sources)
    # Every file is drawn and rendered before the first is written, so that Ctrl+C while drawing
    # (seconds) leaves the earlier report whole, not new plots beside its report.md (a new-user
    # check); the writes that follow take milliseconds.
    removed = []
    for path in stale:
        path.unlink()
        removed.append(path.name)
    for name, path in pngs.items():
        atomic_write_bytes(path, lambda f, data=png_bytes[name]: f.write(data))
    atomic_write_bytes(out / "report.md", lambda f: f.write(markdown.encode()))
    atomic_write_bytes(out / "report.html", lambda f: f.write(page.encode()))
    note_sweep_output(out)
    report = Report(
        out=out,
        html=out / "report.html",
        markdown=out / "report.md",
        pngs=pngs,
        figures=figures,
        points=points,
        tables=tables,
        notes=notes,
        sources=sources,
        records=records,
    )
    print(
        f"{len(records)} records from {len(sources.record_files)} files, {len(sources.metrics_csvs)} metrics.csv; "
        f"wrote {report.html}, {report.markdown} and {len(pngs)} plots"
        + (f" (replacing the earlier report in {out})" if earlier else "")
    )
    if removed:
        print(f"removed {', '.join(removed)} of the earlier report in {out}: no data for that plot now")
    for note in notes:
        print(f"note: {note}")
    log_report_to_wandb(
        report,
        enabled=cfg.wandb.enabled,
        project=cfg.wandb.project,
        mode=cfg.wandb.mode,
        name=f"report-{out.resolve().name}",
    )
    return report


def split_sweep_notes(groups: list[LrGroup]) -> list[str]:
    """A note per learning-rate sweep whose runs fell into both the (test) and the (val) table, some
    evaluated with eval/recall.py and some not: each table then picks the best of a part of the
    sweep (a new-user check: the (test) table showed the lr that lost on validation as the best,
    with "1 lr")."""
    by_key: dict[tuple, dict[str, LrGroup]] = defaultdict(dict)
    for g in groups:
        # the group's key with the split left out: its (test) and (val) parts share it
        by_key[replace(g.best, split="").group_key()][g.best.split] = g
    notes = []
    for parts in by_key.values():
        if {"test", "val"} <= set(parts):
            best = parts["test"].best
            lrs = {split: ", ".join(format_lr(lr) for lr in parts[split].lrs) for split in ("test", "val")}
            notes.append(
                f"Best over learning rates: the sweep of {best.mixer} (d_model {best.d_model}) is split "
                f"between the (test) table (lr {lrs['test']}, evaluated with eval/recall.py) and the (val) "
                f"table (lr {lrs['val']}): each picks the best of its part only; evaluate every lr of it "
                "with eval/recall.py to compare them on one split"
            )
    return notes


def accuracy_tasks(records: list[dict[str, Any]]) -> list[str]:
    """The tasks, sorted, of the records holding an accuracy (``accuracy`` or ``val/acc``)."""
    return sorted(
        {str(r["task"]) for r in records if r["metric"] in ("accuracy", "val/acc") and r.get("task")}
    )


def check_task(task: str, records: list[dict[str, Any]]) -> None:
    """Check that ``task`` is a known task (a key of :data:`data.DATAMODULES`) or one the records hold.

    Raises:
        ValueError: it is neither; the message lists the tasks with accuracy records and the known ones.
    """
    if isinstance(task, str) and (task in DATAMODULES or task in {r.get("task") for r in records}):
        return
    present = accuracy_tasks(records)
    held = f"the records hold task={', '.join(present)}; " if present else ""
    raise ValueError(
        f"unknown task={task!r}: {held}known tasks: {', '.join(sorted(DATAMODULES))}; "
        f"pass one of them, e.g. task={(present or sorted(DATAMODULES))[0]}"
    )


def _nothing_found(sources: Sources, notes: list[str]) -> str:
    message = f"no result records found in {', '.join(map(str, sources.searched))}: looked for {LOOKED_FOR}"
    if sources.ignored:
        message += f"; ignored JSON that is not a record list: {', '.join(map(str, sources.ignored))}"
    message += "".join(f"; skipped invalid file: {skipped}" for skipped in sources.skipped)
    return "; ".join([message, *notes])


def sweep_output(cfg: DictConfig) -> SweepOutput | None:
    """The ``-m`` sweep pre-check's ``check_job`` (:func:`eval.cli.check_command_line`): the ``out``
    folder a job writes, so that a sweep whose jobs share one is refused before the first job (a
    new-user check: ``-m task=mqar,copy out=rep`` wrote the first job's report, then stopped); None
    for an ``out`` that is not one path, which the job refuses itself."""
    return SweepOutput(cfg.out, "out", folder=True) if isinstance(cfg.out, str) else None


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="report")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    OmegaConf.set_readonly(cfg, True)
    os.environ.setdefault("WANDB_SILENT", "true")
    with user_errors(retry="out=<another folder>"):
        build_report(cfg)


if __name__ == "__main__":
    run_command_line(
        main, "report", CONF_DIR / "eval", check_job=sweep_output
    )

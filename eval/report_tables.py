"""The tables of ``eval/report.py``: runs, results per task and split, and the best run over learning rates.

All of them are built from result records (DESIGN.md, contract 5, as ``eval/report.py`` reads them:
each record carries ``record_file``):

- ``Runs``: one row per run and mixer (layout, params, tasks, record files);
- ``Results: <task> (<split>)``: a row per run, mixer, seqlen, slice and record file, a column per
  metric; train.py's per-slice ``val/<metric>_<slice>`` records are folded into ``val/<metric>`` at
  the slice's seqlen (slice names of every data module: :data:`SLICE_NAME`);
- ``Best over learning rates: ...`` (Zoology, Arora et al. 2024, Figure 2): runs that differ only in
  the learning rate form a group (:func:`lr_groups`); a table per task, split, main slice and depth
  has a row per mixer and a column per ``d_model``, each cell the group's best accuracy with its
  learning rate and the number of learning rates tried (``0.987 (lr 2.2e-3, 2 lrs)``; for
  ``task=text`` the lowest validation loss, ``loss 1.490, acc 0.569 (lr 1e-3, 1 lr)``), or ``no
  record`` (no run of that mixer and width recorded its accuracy: not run, or run without writing
  records).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLICE_NAME = (
    r"T\d+(?:_kv\d+|_data\d+|_depth\d+-\d+)?"  # mqar T256_kv16, induction_heads T256, selective_copying
    # T64_data16, passkey / multikey_needle T512_depth0-25 (data/*.py: each module's slice_name)
    r"|len\d+-\d+"  # copy: a band of string lengths, len21-40
    r"|text"  # text: its one slice
)
"""The slice names of every data module (``slice_names`` of ``data/*.py``), as a regex."""

PER_SLICE_METRIC = re.compile(rf"(val/[^/_]+)_({SLICE_NAME})")
"""train.py's per-slice metric names, ``val/acc_T256`` -> (``val/acc``, ``T256``)."""

NO_RECORD = "no record"


@dataclass
class Table:
    """A table of the report: ``rows`` hold raw values (``None`` where a run has no such value)."""

    title: str
    columns: list[str]
    rows: list[list[Any]]


def fold_slice(metric: str) -> tuple[str, str | None]:
    """Split a train.py metric name into the metric and its slice: ``val/acc_T64_kv4`` -> (``val/acc``,
    ``T64_kv4``), ``val/loss_len21-40`` -> (``val/loss``, ``len21-40``); a name without a slice
    (``val/acc``, ``accuracy``) -> (the name, None)."""
    match = PER_SLICE_METRIC.fullmatch(metric)
    return (match.group(1), match.group(2)) if match else (metric, None)


def compact_layout(layout: list[str] | None, shared_block: dict[str, Any] | None = None) -> str:
    """A layout list as text, runs of one mixer collapsed: ``mamba x4, attention, mamba x3``; with a
    record's ``shared_block`` (Zamba's), ``mamba x6 + shared attention every 6``."""
    parts: list[list[Any]] = []
    for name in layout or []:
        if parts and parts[-1][0] == name:
            parts[-1][1] += 1
        else:
            parts.append([name, 1])
    text = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in parts)
    if isinstance(shared_block, dict):
        text += f" + shared {shared_block.get('mixer')} every {shared_block.get('every')}"
    return text


def format_value(value: Any) -> str:
    """A table cell as text: ``""`` for None, integers with thousands separators, floats to 4
    significant digits (whole numbers at or above 1000 without decimals)."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isfinite(value) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def format_lr(lr: float) -> str:
    """A learning rate in short scientific notation: ``0.0022`` -> ``2.2e-3``, ``1e-4`` -> ``1e-4``."""
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


METRIC_UNITS = {"decode_bandwidth": ("GB/s", 1e-9)}
"""Metrics shown in another unit than their records' ``value``: name -> (unit, factor). eval/decode.py
writes ``decode_bandwidth`` in bytes/s and prints it in GB/s."""


def _metric_column(r: dict[str, Any]) -> str:
    metric = fold_slice(r["metric"])[0] if r.get("split") == "val" else r["metric"]
    if metric in METRIC_UNITS:
        metric = f"{metric} ({METRIC_UNITS[metric][0]})"
    variant = r.get("path") or r.get("mode")
    return f"{metric} [{variant}]" if variant else metric


def _shown_value(r: dict[str, Any]) -> float:
    """A record's ``value`` in the unit of its column (:data:`METRIC_UNITS`)."""
    unit = METRIC_UNITS.get(r["metric"])
    return r["value"] * unit[1] if unit else r["value"]


COUNT_FIELDS = ("scored_positions", "examples")
"""Record fields counting what a measurement scored, most telling first: eval/recall.py's
``scored_positions``, eval/copying.py's and eval/long_context.py's ``examples``."""


def measurement_rank(r: dict[str, Any]) -> tuple:
    """Sort key, lowest first, choosing among records of one measurement (one checkpoint, task,
    split and length, written to several files with ``output=``): the most scored positions, then
    the most examples (:data:`COUNT_FIELDS`; a record without the count ranks below any with it),
    then the newest ``time`` (ISO 8601; a missing or unreadable one ranks last, one without a
    timezone is read as UTC), then the ``record_file`` first in path order."""
    counts = [r.get(f) for f in COUNT_FIELDS]
    sizes = [-c if isinstance(c, int | float) and not isinstance(c, bool) else 1 for c in counts]
    return (*sizes, -_timestamp(r.get("time")), str(r.get("record_file") or ""))


def _timestamp(text: Any) -> float:
    """POSIX seconds of an ISO 8601 time (UTC where it names no timezone); -inf for anything else."""
    try:
        when = _dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return -math.inf
    return (when if when.tzinfo else when.replace(tzinfo=_dt.timezone.utc)).timestamp()


# Record fields that tell apart measurements of one run, mixer and length (see summary_tables):
# eval/decode.py's dtype and batch, and eval/perplexity.py's max_batches (a new-user check: a loss
# over the first 2 batches of the split read as the held-out loss).
_SETTINGS = ("dtype", "batch", "max_batches")


def _task_title(r: dict[str, Any]) -> str:
    task = r.get("task") or "?"
    return f"{task} ({r['split']})" if r.get("split") else task


def summary_tables(records: list[dict[str, Any]]) -> list[Table]:
    """The report's tables: ``Runs`` (one row per run and mixer: layout, params, tasks, record files,
    and ``interrupted`` where any run's records say it was stopped by Ctrl+C or SIGTERM)
    and one table per task and split with a row per run, mixer, seqlen, slice, dtype and batch (the
    last two where the task's records carry them: eval/decode.py's; ``max_batches`` where a record
    of eval/perplexity.py covers only that many batches of the split) and record file: params,
    state bytes (per sequence) and one column per metric (``accuracy [decode]``, ``decode_tokens_per_s
    [eager]``, ``decode_bandwidth (GB/s) [eager]``: a unit of :data:`METRIC_UNITS` is named; train.py's
    per-slice ``val/acc_<slice>`` folded into ``val/acc`` at the slice's seqlen).
    """
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        row = runs.setdefault(
            (r["run"], r["mixer"]),
            {"layout": compact_layout(r.get("layout"), r.get("shared_block")), "params": r.get("params"), "tasks": {}, "files": {},
             "interrupted": False},  # fmt: skip
        )
        row["tasks"][_task_title(r)] = None
        row["files"][r["record_file"]] = None
        row["interrupted"] |= r.get("interrupted") is True
    # train.py's records of a run stopped by Ctrl+C or SIGTERM say so: a column where any does
    stopped = any(v["interrupted"] for v in runs.values())
    columns = ["run", "mixer", "layout", "params", "tasks", "record files"]
    if stopped:
        columns.append("interrupted")
    tables = [
        Table(
            "Runs",
            columns,
            [
                [run, mixer, v["layout"], v["params"], ", ".join(v["tasks"]), len(v["files"]),
                 *(["yes" if v["interrupted"] else ""] if stopped else [])]  # fmt: skip
                for (run, mixer), v in sorted(runs.items())
            ],
        )
    ]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[_task_title(r)].append(r)
    for title, rows in sorted(groups.items()):
        # eval/decode.py's state_bytes records fill the state bytes column, not a metric column of their own.
        metrics = sorted({_metric_column(r) for r in rows if r["metric"] != "state_bytes"})
        # Settings a task's records may differ in within one run and length (eval/decode.py's dtype
        # and batch): a column each where any record has them, and part of the row key, so that an
        # fp16 and an fp32 measurement never share a row.
        settings = [f for f in _SETTINGS if any(r.get(f) is not None for r in rows)]
        table_rows: dict[tuple, dict[str, Any]] = {}
        for r in sorted(
            rows,
            key=lambda r: (
                r["run"],
                r["mixer"],
                r.get("seqlen") or 0,
                r.get("slice") or "",
                *(str(r.get(f)) for f in settings),
                r["record_file"],
            ),
        ):
            # Slices of one length (perplexity's val and val_prefix<N>, copy's length bands) stay apart.
            key = (r["run"], r["mixer"], r.get("seqlen"), r.get("slice"), *(r.get(f) for f in settings),
                   r["record_file"])  # fmt: skip
            row = table_rows.setdefault(key, {"params": r.get("params"), "state_bytes": r.get("state_bytes")})
            if r["metric"] != "state_bytes":
                row[_metric_column(r)] = _shown_value(r)
        tables.append(
            Table(
                f"Results: {title}",
                ["run", "mixer", "params", "seqlen", "slice", *settings, "state bytes", *metrics, "record file"],
                [
                    [
                        *key[:2],
                        row["params"],
                        *key[2:-1],
                        row["state_bytes"],
                        *(row.get(m) for m in metrics),
                        key[-1],
                    ]
                    for key, row in table_rows.items()
                ],
            )
        )
    return tables


@dataclass(frozen=True)
class RunScore:
    """One run's accuracy at its task's main slice, and what it was trained with.

    Attributes:
        split: ``test`` (eval/recall.py's accuracy) or ``val`` (train.py's ``val/acc``).
        seqlen, slice: the main slice (``slice`` is None where the records do not name it).
        lr, d_model, n_layers, batch_size: from any record of the run (train.py writes them, the
            batch size per process); None where none has it.
        settings: the run's other settings (train.py's ``settings``,
            :func:`eval.records.run_settings`) as sorted ``(name, JSON text)`` pairs; () where its
            records predate them.
        loss: train.py's best ``val/loss`` (nats per token) for ``task=text``, whose runs are ranked
            by it (next-token accuracy is not what a language model is compared on); None otherwise.
    """

    run: str
    mixer: str
    task: str
    split: str
    accuracy: float
    seqlen: int | None
    slice: str | None
    lr: float | None
    d_model: int | None
    n_layers: int | None
    params: int | None
    layout: tuple[str, ...]
    batch_size: int | None = None
    loss: float | None = None
    settings: tuple[tuple[str, str], ...] = ()

    def group_key(self) -> tuple:
        """What runs that differ only in the learning rate share: everything but run, lr, accuracy and loss."""
        return (
            self.task,
            self.split,
            self.n_layers,
            self.seqlen,
            self.slice,
            self.mixer,
            self.layout,
            self.d_model,
            self.params,
            self.batch_size,
            self.settings,
        )


def run_scores(records: list[dict[str, Any]], task: str, path: str) -> list[RunScore]:
    """The accuracy of every run (run and mixer) of ``task`` at the task's main slice.

    A run with eval/recall.py records (``metric: accuracy`` with a ``seqlen``) is scored on them, at
    its training length (``train_seqlen``; else its shortest length), through ``path`` where both
    decode paths ran and of ``best.ckpt`` where several checkpoints were evaluated. A run without
    them is scored on train.py's ``val/acc`` (the first validation slice, which train.py's configs
    make the training length). Where several records hold one such measurement (files written with
    ``output=``), :func:`measurement_rank` picks one. ``lr``, ``d_model`` and ``n_layers`` come from
    any record of the run (run and mixer, as in the rest of the report): recall records get them from
    train.py's. For ``task=text`` each score also carries the run's ``val/loss``.
    """
    info: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    test: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    val: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    val_loss: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = (r["run"], r["mixer"])
        if isinstance(r.get("settings"), dict):
            # A setting given as null counts as unset (+trainer.max_time=null trains as no max_time).
            items = [(name, value) for name, value in r["settings"].items() if value is not None]
            pairs = ((str(name), json.dumps(value, sort_keys=True)) for name, value in items)
            info[key].setdefault("settings", tuple(sorted(pairs)))
        for field in ("lr", "d_model", "n_layers", "batch_size"):
            value = r.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(
                    f"run {r['run']!r}: its records give {field} = {value!r}, which is not a number "
                    f"(train.py writes {field} as a number to results/train.json); fix or remove the field"
                )
            info[key].setdefault(field, value)
        if r.get("task") != task:
            continue
        if r["metric"] == "accuracy" and r.get("seqlen"):
            test[key].append(r)
        elif r["metric"] == "val/acc":
            val[key].append(r)
        elif r["metric"] == "val/loss" and task == "text":
            val_loss[key].append(r)
    scores = []
    for key in dict.fromkeys([*test, *val]):
        if key in test:
            r = _main_test_record(test[key], path)
            split = str(r.get("split") or "test")
        else:
            r, split = min(val[key], key=measurement_rank), "val"
        scores.append(
            RunScore(
                run=r["run"],
                mixer=r["mixer"],
                task=task,
                split=split,
                accuracy=float(r["value"]),
                seqlen=r.get("seqlen"),
                slice=r.get("slice"),
                lr=info[key].get("lr"),
                d_model=info[key].get("d_model"),
                n_layers=info[key].get("n_layers"),
                params=r.get("params"),
                layout=tuple(r.get("layout") or ()),
                batch_size=info[key].get("batch_size"),
                settings=info[key].get("settings", ()),
                loss=float(min(val_loss[key], key=measurement_rank)["value"])
                if split == "val" and val_loss[key]
                else None,
            )
        )
    return scores


def _main_test_record(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    main = [r for r in rows if r.get("train_seqlen") and r["seqlen"] == r["train_seqlen"]]
    if not main:
        shortest = min(r["seqlen"] for r in rows)
        main = [r for r in rows if r["seqlen"] == shortest]
    return min(
        main,
        key=lambda r: (
            r.get("path") != path,
            Path(r.get("checkpoint") or "").name != "best.ckpt",
            *measurement_rank(r),
        ),
    )


@dataclass(frozen=True)
class LrGroup:
    """Runs that differ only in the learning rate (their :meth:`RunScore.group_key` is equal)."""

    runs: tuple[RunScore, ...]

    @property
    def by_loss(self) -> bool:
        """Whether the group is ranked by validation loss: a run of it records one (``task=text``)."""
        return any(s.loss is not None for s in self.runs)

    @property
    def best(self) -> RunScore:
        """The run of lowest validation loss where :attr:`by_loss`, else of highest accuracy; on a
        tie the smaller learning rate, then the run name. A NaN (a diverged run), or a missing loss
        where the group is ranked by loss, ranks below every number."""

        def rank(s: RunScore) -> float:
            value = (s.loss if s.loss is not None else math.nan) if self.by_loss else -s.accuracy
            return math.inf if math.isnan(value) else value

        return min(self.runs, key=lambda s: (rank(s), s.lr, s.run))

    @property
    def lrs(self) -> list[float]:
        """The distinct learning rates tried, ascending."""
        return sorted({s.lr for s in self.runs})

    def cell(self, with_params: bool = False, with_batch: bool = False) -> str:
        """``0.987 (lr 2.2e-3, 2 lrs)`` (ranked by loss: ``loss 1.490, acc 0.569 (lr 1e-3, 1 lr)``);
        ``, 4 runs`` where runs share a learning rate (they differ in
        a setting the records do not carry); with ``with_batch`` the group's batch size, with
        ``with_params`` its parameter count."""
        best, n = self.best, len(self.lrs)
        runs = f", {len(self.runs)} runs" if len(self.runs) > n else ""
        batch = f", batch {best.batch_size}" if with_batch and best.batch_size is not None else ""
        params = f", {best.params:,} params" if with_params and best.params is not None else ""
        score = f"loss {best.loss:.3f}, acc {best.accuracy:.3f}" if self.by_loss else f"{best.accuracy:.3f}"
        return f"{score} (lr {format_lr(best.lr)}, {n} lr{'s' if n != 1 else ''}{runs}{batch}{params})"


def lr_groups(scores: list[RunScore]) -> list[LrGroup]:
    """Group the scores of runs that record their learning rate by everything else they record
    (:meth:`RunScore.group_key`: task, split, depth, main slice, mixer, layout, width, params,
    batch size, and the run's other settings where train.py recorded them).

    For records written before train.py recorded its settings, settings that none of the other
    fields reflect (e.g. attention heads, dropout, training length in steps) are not told apart:
    report such sweeps from separate ``runs=``. Runs without ``lr`` form no group.
    """
    groups: dict[tuple, list[RunScore]] = defaultdict(list)
    for s in scores:
        if s.lr is not None:
            groups[s.group_key()].append(s)
    return [LrGroup(tuple(sorted(runs, key=lambda s: (s.lr, s.run)))) for runs in groups.values()]


def best_lr_tables(groups: list[LrGroup]) -> list[Table]:
    """One ``Best over learning rates`` table per task, split, main slice and ``n_layers``: a row per
    mixer, a column per ``d_model`` (``d_model ?`` for runs whose records lack it), each cell
    :meth:`LrGroup.cell` or ``no record``. Where several groups of one mixer share a cell (learned
    versus RoPE positions, another batch size, window or seed), the cell lists each, led by the
    recorded settings that differ among them (:func:`differing_settings`: ``window=1000: ...``),
    with its parameter count (and batch size, where those differ), separated by ``;``."""
    tables: dict[tuple, list[LrGroup]] = defaultdict(list)
    for g in groups:
        s = g.best
        tables[(s.task, s.split, s.seqlen or 0, s.slice or "", s.n_layers or 0)].append(g)
    out = []
    for (task, split, seqlen, slice_name, n_layers), members in sorted(tables.items()):
        widths = sorted({g.best.d_model for g in members}, key=lambda d: (d is None, d or 0))
        cells: dict[tuple[str, int | None], list[LrGroup]] = defaultdict(list)
        for g in members:
            cells[(g.best.mixer, g.best.d_model)].append(g)
        where = slice_name or f"seqlen {seqlen}"
        depth = f", {n_layers} layers" if n_layers else ""
        out.append(
            Table(
                f"Best over learning rates: {task} ({split}) at {where}{depth}",
                ["mixer", *(f"d_model {d if d is not None else '?'}" for d in widths)],
                [
                    [mixer, *(_cell(cells.get((mixer, d), [])) for d in widths)]
                    for mixer in sorted({g.best.mixer for g in members})
                ],
            )
        )
    return out


def _cell(groups: list[LrGroup]) -> str:
    if not groups:
        return NO_RECORD
    ordered = sorted(groups, key=lambda g: (g.best.params or 0, g.best.batch_size or 0, _settings_order(g)))
    many = len(groups) > 1
    with_batch = many and len({g.best.batch_size for g in groups}) > 1
    labels = differing_settings([dict(g.best.settings) for g in ordered])
    return "; ".join(
        (f"{label}: " if label else "") + g.cell(with_params=many, with_batch=with_batch)
        for g, label in zip(ordered, labels, strict=True)
    )


def _settings_order(group: LrGroup) -> tuple:
    """A group's settings as a sort key: numbers by value (window 4 before 16), then text."""

    def key(text: str) -> tuple:
        value = json.loads(text)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return (0, value, "") if number else (1, 0, text)

    return tuple((name, key(text)) for name, text in group.best.settings)


def differing_settings(settings: list[dict[str, str]]) -> list[str]:
    """For the settings of groups that share a table cell (``{name: JSON text}``), each group's
    values of the settings that differ among them, as ``name=value`` joined by spaces (a name by its
    last part where that is unambiguous: ``window=1000``), ``name=unset`` where a group's records
    lack a setting that others record (``+trainer.max_time=...`` given to some runs only); "" for a
    group where none differs, ``settings not recorded`` for a group whose records predate them or
    come from a checkpoint outside a train.py run (beside groups that have them, which are then
    ``settings recorded`` where no setting differs among them: an empty label read as the second
    half of the first)."""
    recorded = [one for one in settings if one]
    names = sorted(set().union(*recorded))
    differ = [name for name in names if len({one.get(name) for one in recorded}) > 1]
    last = [name.rsplit(".", 1)[-1] for name in differ]
    shown = [short if last.count(short) == 1 else name for name, short in zip(differ, last, strict=True)]
    some_missing = len(recorded) < len(settings)
    return [
        " ".join(f"{label}={one.get(name, 'unset')}" for name, label in zip(differ, shown, strict=True))
        or ("settings recorded" if some_missing else "")
        if one
        else ("settings not recorded" if recorded else "")
        for one in settings
    ]


def drop_worse_lrs(points: list[dict[str, Any]], groups: list[LrGroup]) -> tuple[list[dict[str, Any]], int]:
    """``points`` (dicts with ``run`` and ``mixer``) without those of runs that are not their
    group's best; runs outside every group are kept. Returns ``(points, number of runs dropped)``."""
    dropped = {(s.run, s.mixer) for g in groups for s in g.runs if s is not g.best}
    return [p for p in points if (p["run"], p["mixer"]) not in dropped], len(dropped)

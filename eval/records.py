"""Result records: the JSON rows every table and plot of mixerlab is rebuilt from.

A record is one measurement (DESIGN.md, contract 5)::

    {run, mixer, layout, params, task, metric, value, state_bytes, seqlen, tokens_per_s,
     device, git_sha, time, ...extra keys such as slice, path, split}

Records are written next to the run (``<run_dir>/results/<name>.json``, a JSON list) atomically,
so ``eval/report.py`` can rebuild everything offline, and are also logged to W&B when enabled.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from data.text import unreachable
from models.checkpoint import atomic_write_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_sha() -> str | None:
    """The commit of the mixerlab checkout that produced a result, or ``None`` outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_dirty() -> bool | None:
    """Whether tracked files of the checkout differ from its commit (the result then came from code
    that :func:`git_sha` alone does not identify), or ``None`` outside git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip())


def device_name(device: torch.device | str) -> str:
    """Human-readable device for records: the GPU's name on CUDA, ``cpu`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def make_record(
    *,
    run: str,
    model,
    task: str,
    metric: str,
    value: float,
    seqlen: int | None = None,
    tokens_per_s: float | None = None,
    device: torch.device | str = "cpu",
    sha: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build one result record for ``model`` (a :class:`models.LanguageModel`).

    ``state_bytes`` is the analytic decode-state bytes per sequence at ``seqlen``
    (``model.state_size(seqlen)``), ``None`` without a seqlen; ``tokens_per_s`` is in tokens/s.
    ``layout`` lists the backbone's mixer per layer; ``shared_block`` is Zamba's shared block
    (``{"mixer": ..., "every": ...}``), which the layout does not show, or None.
    """
    config = model.config
    shared = config.shared_block
    return {
        "run": run,
        "mixer": config.name,
        "layout": config.layout,
        "shared_block": {"mixer": shared.mixer, "every": shared.every} if shared is not None else None,
        "params": model.num_params(),
        "task": task,
        "metric": metric,
        "value": float(value),
        "state_bytes": model.state_size(seqlen) if seqlen else None,
        "seqlen": seqlen,
        "tokens_per_s": tokens_per_s,
        "device": device_name(device),
        "git_sha": sha,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def training_settings(lit, data_cfg: dict[str, Any]) -> dict[str, Any]:
    """The training settings a run's records carry, so that eval/report.py can group a
    learning-rate sweep: ``lr`` (peak), ``d_model``, ``n_layers`` and ``batch_size`` (per process).

    Args:
        lit: the run's :class:`models.lit.LitLM`.
        data_cfg: the data config it was trained with (``batch_size`` may be absent: None).
    """
    config = lit.model.config
    batch_size = data_cfg.get("batch_size")
    return {
        "lr": float(lit.optim["lr"]),
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "batch_size": int(batch_size) if batch_size is not None else None,
    }


# Trainer settings that change what a run learns (the others change how it runs: devices, logging).
TRAINER_SETTINGS_RECORDED = (
    "max_steps", "max_epochs", "max_time", "accumulate_grad_batches", "gradient_clip_val", "precision",
)  # fmt: skip


def run_settings(cfg: Mapping[str, Any], model_config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """Every setting of a training run but its learning rate, flat (``mixer.settings.sliding_window
    .window``: 1000), so that eval/report.py groups a learning-rate sweep by them and names the ones
    that tell two of its groups apart: runs that differ in a window, a feature map, a corpus, a
    seed, the training length or the process count are not one group.

    Args:
        cfg: the run's config, resolved to plain containers (``model``, ``mixer``, ``data``,
            ``optim``, ``trainer``, ``seed``).
        model_config: the model config built from it (:func:`models.config.config_from_groups`), of
            which the mixers' settings are kept only for the mixers the model builds.
        world_size: the run's process count (``data.batch_size`` is per process).

    Returns:
        ``{dotted setting: value}``, values as JSON has them.
    """
    flat: dict[str, Any] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                add(f"{prefix}.{key}", item)
        else:
            flat[prefix] = value

    shared = model_config.get("shared_block")
    used = {*model_config["pattern"], *([shared["mixer"]] if shared else [])}
    for key, value in model_config.items():
        if key == "mixer_settings":
            for name in sorted(used):
                add(f"mixer.settings.{name}", value.get(name) or {})
        elif key in ("pattern", "shared_block", "name"):
            add(f"mixer.{key}", value)
        else:
            add(f"model.{key}", value)
    add("data", {key: value for key, value in cfg["data"].items() if key != "num_workers"})  # how, not what
    add("optim", {key: value for key, value in cfg["optim"].items() if key != "lr"})
    add("trainer", {key: cfg["trainer"][key] for key in TRAINER_SETTINGS_RECORDED if key in cfg["trainer"]})
    flat["seed"] = cfg["seed"]
    flat["world_size"] = int(world_size)
    return flat


def check_output(path: str | os.PathLike, example: str, *, option: str = "output") -> None:
    """Refuse, before any work is done, a path that records cannot be written to as a file (missing
    parent directories are fine: :func:`write_records` creates them).

    Args:
        path: the ``output`` setting, or the default path an evaluation would write.
        example: a file name for the message (``recall.json``).
        option: how the message names ``path``: ``output`` (the setting) or a phrase such as
            ``the default output`` (``path`` then follows it).

    Raises:
        ValueError: ``path`` is an existing directory, does not end in ``.json`` (the records are a
            JSON list: ``output=x.png`` would write JSON under a picture's name), lies under an
            existing file, or its nearest existing directory does not let this process create a
            file in it (read-only storage, permissions).
    """
    path = Path(path)
    name = f"output={path}" if option == "output" else f"{option} {path}"
    if path.is_dir():
        raise ValueError(f"{name} is a directory; give a file path such as output={path / example}")
    if path.suffix.lower() != ".json":
        named = f"a {path.suffix} file name" if path.suffix else "a file name without the .json suffix"
        raise ValueError(
            f"{name} is {named}, but the results are written as JSON; pass output=<name>.json, "
            f"e.g. output={path.with_suffix('.json')}"
        )
    ancestor = next(parent for parent in path.parents if parent.exists())
    if not ancestor.is_dir():
        raise ValueError(
            f"{name} lies under {ancestor}, which is a file, not a directory; give a file path in a "
            f"directory, such as output={ancestor.parent / example}"
        )
    fix = f"pass output=<a writable file path>, e.g. output={example}"
    check_writable_dir(ancestor, f"{name} cannot be written", fix, target=path.parent)


def check_same_writer(path: str | os.PathLike, writer: str, *, option: str = "output") -> None:
    """Refuse, before any work, an existing record file at ``path`` that another tool wrote: writing
    there would replace its records (a new-user check: ``eval/recall.py output=<run>/results/train.json``
    replaced train.py's records). ``writer`` is ``"checkpoint"`` (an evaluation of a checkpoint, whose
    records carry ``checkpoint``) or ``"decode"`` (eval/decode.py's, ``task: decode``). A missing,
    unreadable or empty file, or one holding no records, is left to the other checks.

    Raises:
        ValueError: every record of the file is another tool's; the message names the tool and the fix.
    """
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(records, list):
        return
    records = [r for r in records if isinstance(r, dict) and "metric" in r]
    ours = (lambda r: "checkpoint" in r) if writer == "checkpoint" else (lambda r: r.get("task") == "decode")
    if not records or any(ours(r) for r in records):
        return
    if all(r.get("task") == "decode" for r in records):
        other = "eval/decode.py"
    elif all("checkpoint" not in r and r.get("split") == "val" for r in records):
        other = "train.py"
    else:
        other = "another tool"
    name = f"output={path}" if option == "output" else f"{option} {path}"
    raise ValueError(
        f"{name} holds {len(records)} records of {other}, which this run would replace; give output= "
        "a path of its own (an evaluation's records are read beside the others by eval/report.py)"
    )


def check_writable_dir(directory: Path, what: str, fix: str, *, target: Path | None = None) -> None:
    """Create and remove a probe file in ``directory``, so that a run fails before its work, not
    when it writes its results (the atomic writers create their temporary file there too).

    Args:
        directory: an existing folder.
        what, fix: the message's start and end.
        target: the folder the caller will write to, when it does not exist yet and ``directory``
            is its nearest existing ancestor: the message then says the missing folders would be
            created in ``directory`` (naming the folder that refused, not one that does not exist).

    Raises:
        ValueError: the probe cannot be created: ``"<what>: creating a file in <directory> failed:
            <OS reason>; <fix>"``, or with ``target`` below ``directory``, ``"<what>: its missing
            folders would be created in <directory>, where creating a file failed: <OS reason>; <fix>"``.
    """
    where = Path(directory).absolute()
    try:
        fd, probe = tempfile.mkstemp(prefix=".mixerlab-write-check-", dir=directory)
    except OSError as err:
        # The OS's reason as it gives it: /proc, say, refuses a new file with "No such file or
        # directory" although the folder exists.
        reason = err.strerror or err
        if target is not None and Path(target) != Path(directory):
            detail = f"its missing folders would be created in {where}, where creating a file failed"
        else:
            detail = f"creating a file in {where} failed"
        raise ValueError(f"{what}: {detail}: {reason}; {fix}") from None
    os.close(fd)
    os.unlink(probe)


def check_creatable_dir(path: str | os.PathLike, what: str, fix: str, *, file_fix: str | None = None) -> None:
    """Refuse, before any work, a folder that cannot be made or written: ``path`` or one of its
    parents is a file, or the nearest existing folder refuses new files (:func:`check_writable_dir`).

    Args:
        path: the folder the caller will create (if missing) and write to.
        what, fix: the message's start and end; ``file_fix`` replaces ``fix`` when a file is in the way.

    Raises:
        ValueError: ``"<what>: <file> is a file, not a folder; <file_fix or fix>"``, or
            :func:`check_writable_dir`'s message.
    """
    path = Path(path)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{what}: {blocking} is a file, not a folder; {file_fix or fix}")
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    check_writable_dir(ancestor, what, fix, target=path)


# Record files written by the jobs of a Hydra sweep (``-m``) in this process: the default launcher
# runs a sweep's jobs one after another in one process, so a later job can see an earlier one's.
_SWEEP_OUTPUTS: set[Path] = set()


def _in_sweep() -> bool:
    """Whether this process is running a job of a Hydra multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_sweep_output(path: str | os.PathLike, *, option: str = "output", folder: bool = False) -> None:
    """Refuse, before a sweep job's work, a record file (or, ``folder``, an output folder: the
    report's ``out``) that an earlier job of the same ``-m`` sweep wrote: every job would replace the
    one before it, and only the last job's results would stay. Outside a sweep nothing is checked;
    with Hydra's joblib launcher only the jobs that ran earlier in the same worker process are seen.

    Args:
        path: the ``output`` setting or the default output path of this job (``out``'s folder).
        option: ``output`` (the setting; ``out`` with ``folder``) or a phrase such as ``the default
            output``, as in :func:`check_output`.
        folder: ``path`` is a folder that the job writes its files into (:func:`note_sweep_output`).

    Raises:
        ValueError: ``"<option> <path> was written by an earlier job of this sweep (-m) ..."``, with
            the fix: a name that differs per job, a literal ``${`` of the path escaped (``\\${``).
    """
    path = Path(path)
    if not (_in_sweep() and path.resolve() in _SWEEP_OUTPUTS):
        return
    name = f"{option}={path}" if option in ("output", "out") else f"{option} {path}"
    own = f"its own {'folder' if folder else 'file'}, e.g. {per_job_output(path, folder)}"
    raise ValueError(
        f"{name} was written by an earlier job of this sweep (-m): each job would replace the one "
        f"before it; give each job {own}"
    )


def per_job_output(path: Path, folder: bool = False) -> str:
    """The override that gives each job of a sweep its own record file (or ``out`` folder) beside
    ``path``: ``output='<stem>-${hydra:job.num}<suffix>'``, ready to paste (a literal ``${`` of the
    path escaped; quoted for Hydra where it needs it)."""
    per_job = path.with_name(f"{path.name}-" if folder else f"{path.stem}-")
    # A literal ${ of the path must reach the config escaped, the job number not (a new-user check).
    per_job_text = re.sub(r"\$\{", r"\${", str(per_job)) + "${hydra:job.num}"
    per_job_text += "" if folder else (path.suffix or ".json")
    setting = "out" if folder else "output"
    advice = f"{setting}='{per_job_text}'"
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Quote, QuotedString
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_overrides([f"{setting}={per_job_text}"])
    except HydraException:
        # A path Hydra takes only quoted (=, non-ASCII letters: the advice did not paste, a new-user
        # check): Hydra's double quotes inside the shell's single ones.
        advice = shlex.quote(f"{setting}={QuotedString(text=per_job_text, quote=Quote.double).with_quotes()}")
    return advice


def note_sweep_output(path: str | os.PathLike) -> None:
    """Remember, in a Hydra sweep, a file or folder this job wrote, for :func:`check_sweep_output`."""
    if _in_sweep():
        _SWEEP_OUTPUTS.add(Path(path).resolve())


def say_if_replacing(path: Path, output_given: bool, kept: str = "") -> None:
    """Print that ``path`` already holds records which this run replaces (a quick check with fewer
    examples would otherwise silently replace a full run), with how to keep both, and ``kept``: where
    a length sweep keeps them until its last length is written (:func:`write_sweep_records`)."""
    if path.exists():
        keep = "give output= another path" if output_given else "pass output=PATH"
        print(f"replacing the earlier results in {path} ({kept + '; ' if kept else ''}{keep} to keep both)")


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float, at any depth of its dicts, lists and tuples
    (tuples become lists), replaced by ``None``: JSON has no NaN, and strict parsers (jq,
    JavaScript, W&B tables) refuse the ``NaN`` that ``json.dumps`` writes by default. Everything
    else is returned as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(item) for item in value]
    return value


def write_records(path: str | os.PathLike, records: list[dict[str, Any]]) -> Path:
    """Write ``records`` as a strict JSON list to ``path`` atomically (temp file + rename); returns
    the path. A NaN or infinite value (a diverged model's loss) is written as ``null``
    (:func:`finite_or_none`), which eval/report.py reads back as NaN (tabled as ``nan``). In a
    Hydra sweep the path is remembered for :func:`check_sweep_output`.

    Raises:
        models.checkpoint.WriteError: the file cannot be written (full disk, read-only storage); an
            earlier file at ``path`` is left as it was.
    """
    path = Path(path)
    payload = json.dumps(finite_or_none(records), indent=2, allow_nan=False).encode()
    atomic_write_bytes(path, lambda f: f.write(payload))
    note_sweep_output(path)
    return path


# The record files of length sweeps whose last write was partial, with the lengths they hold.
_partial: dict[Path, str] = {}


def partial_files() -> dict[Path, str]:
    """The files :func:`write_sweep_records` last wrote partial in this process, each with what it
    holds (``context lengths [512, 1024] of [512, 1024, 2048]``, in tokens): what an interrupted
    command line says of the files it kept."""
    return dict(_partial)


def earlier_copy(path: str | os.PathLike) -> Path:
    """Where a sweep over lengths keeps the file ``path`` it replaces until its last length is written:
    ``<path>.earlier`` (a suffix eval/report.py and eval/roofline.py do not read; rename it back to
    use it). See :func:`write_sweep_records`."""
    path = Path(path)
    return path.with_name(f"{path.name}.earlier")


def _partial_mark(records: Any) -> Any:
    """The ``partial`` mark of the first record of ``records`` (a file's JSON) that has one, or None."""
    if not isinstance(records, list):
        return None
    return next((r["partial"] for r in records if isinstance(r, dict) and r.get("partial")), None)


def _is_partial(path: Path) -> bool:
    """Whether the record file at ``path`` was written before its sweep finished (unreadable: no)."""
    try:
        return _partial_mark(json.loads(path.read_text())) is not None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def write_sweep_records(
    path: str | os.PathLike,
    records: list[dict[str, Any]],
    done: Sequence[int],
    planned: Sequence[int],
    *,
    output_given: bool,
    beside: Sequence[tuple[Path, Callable[[], None]]] = (),
) -> Path:
    """Write the records of a sweep over lengths (eval/long_context.py, eval/decode.py) after each
    finished length, so that a process killed at a later one (out of memory on CPU) keeps them.

    While ``done`` is not all of ``planned`` every record gets ``partial``: ``{"seqlens_done": done,
    "seqlens_planned": planned}`` (lengths in tokens, in the sweep's order); the write of the last
    length leaves it out, as records written before it was added do. The first write of a run
    (``done`` of at most one length) says when it replaces an earlier file (:func:`say_if_replacing`)
    and, unless it is also the last, first copies that file (and the files ``beside`` it) to
    :func:`earlier_copy`, so that a run cut short does not lose an earlier complete one: a rerun killed
    at its second length left one length where the earlier file held all. The last write removes
    those copies. A copy already there is kept when ``path`` is itself partial: it holds what an
    earlier cut-short run replaced.

    Args:
        path: the record file.
        records: the records of the lengths ``done``.
        done: the lengths finished (measured or recorded as skipped), a prefix of ``planned``.
        planned: every length of the sweep.
        output_given: whether ``path`` is the user's ``output=`` (for the replacing message).
        beside: files drawn from the records (eval/decode.py's plot), each with a function writing it
            atomically, called after the records are written; copied, noted partial
            (:func:`note_partial`) and cleaned up with them, and removed once copied, so that a
            process killed before ``write`` leaves no drawing of the earlier run.

    Returns:
        ``path``.

    Raises:
        models.checkpoint.WriteError: as :func:`write_records`, also for a copy :func:`earlier_copy`.
    """
    path = Path(path)
    files = [path, *(file for file, _ in beside)]
    last = list(done) == list(planned)
    if len(done) <= 1:
        kept = ""
        if not last and path.exists():
            until = "until the last length is done"
            if _is_partial(path) and earlier_copy(path).exists():
                kept = f"a partial file; the one it replaced stays in {earlier_copy(path)} {until}"
            else:
                kept = f"kept in {earlier_copy(path)} {until}"
                for file in files:
                    if file.exists():
                        earlier = file.read_bytes()
                        atomic_write_bytes(earlier_copy(file), lambda f, data=earlier: f.write(data))
                # A process killed between the records and a file drawn from them (decode's plot)
                # must not leave the earlier run's drawing beside the new records: it is in its copy.
                for file, _ in beside:
                    file.unlink(missing_ok=True)
        say_if_replacing(path, output_given, kept)
    partial = None
    if not last:
        partial = {"seqlens_done": list(done), "seqlens_planned": list(planned)}
        records = [{**r, "partial": partial} for r in records]
    written = write_records(path, records)
    # Each file's note follows its own write: an interrupt while the plot is drawn must not leave
    # the records' note of the previous length (a new-user check: a finished file said partial).
    note_partial(path, done, planned)
    for file, write in beside:
        write()
        note_partial(file, done, planned)
    if last:
        for file in files:
            earlier_copy(file).unlink(missing_ok=True)
    return written


def note_partial(path: str | os.PathLike, done: Sequence[int], planned: Sequence[int]) -> None:
    """Record that the file just written at ``path`` holds the lengths ``done`` (tokens) of a sweep
    over ``planned`` (:func:`partial_files`; none while they are all done), and where the earlier
    file it replaced is kept (:func:`earlier_copy`): the records of :func:`write_sweep_records`, and
    a plot of them (eval/decode.py's, beside its records)."""
    _partial.pop(Path(path), None)
    if list(done) != list(planned):
        earlier = earlier_copy(path)
        kept = f", the earlier file it replaces kept in {earlier}" if earlier.exists() else ""
        _partial[Path(path)] = f"context lengths {list(done)} of {list(planned)}{kept}"


def partial_note(path: str | os.PathLike, records: list[Any]) -> str | None:
    """One line saying that ``records`` (those of the file at ``path``) are those of a sweep that had
    not finished when they were written (:func:`write_sweep_records`), and where the earlier file it
    replaced is kept, if it is (:func:`earlier_copy`); None when none is marked."""
    mark = _partial_mark(records)
    if mark is None:
        return None
    if not isinstance(mark, dict):  # not written by write_sweep_records
        mark = {}
    earlier = earlier_copy(path)
    kept = (
        f"; the earlier results it replaced are in {earlier} (rename it to {Path(path).name} to use them)"
        if earlier.exists()
        else ""
    )
    return (
        f"{path}: partial results, seqlens {mark.get('seqlens_done', '?')} of "
        f"{mark.get('seqlens_planned', '?')} only (its sweep was cut short, e.g. killed out of memory on "
        f"CPU, or is still running){kept}"
    )


WANDB_MODES = ("online", "offline")


def check_wandb_mode(mode: Any, option: str) -> None:
    """Refuse a W&B mode other than ``online`` / ``offline``: anything else used to log offline
    without a word (a typo such as ``mode=onlin``).

    Raises:
        ValueError: ``"<option> must be 'online' or 'offline', got ..."``.
    """
    if mode not in WANDB_MODES:
        raise ValueError(
            f"{option} must be 'online' or 'offline', got {mode!r} (to turn W&B off, set its enabled=false)"
        )


def check_flag(value: Any, option: str) -> bool:
    """``value`` itself when it is a bool. Hydra reads ``enabled=no`` as the string ``"no"``, which
    Python takes as true (W&B switched on by ``wandb.enabled=no``), so anything else is refused.

    Raises:
        ValueError: ``"<option> must be true or false, got ..."``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{option} must be true or false, got {value!r}")
    return value


WANDB_KEYS = ("enabled", "project", "mode")


def check_wandb_settings(wandb_cfg: Any, prefix: str = "wandb", keys: tuple[str, ...] = WANDB_KEYS) -> None:
    """Check a ``wandb`` config group before any work: no key but ``keys`` (the ones mixerlab passes
    to W&B: ``+wandb.entity=team`` would be dropped without a word), ``enabled`` a bool and, when it
    is true, ``mode`` online / offline (checked only when records were about to be logged, a typo
    cost a whole evaluation).

    Raises:
        ValueError: a key not in ``keys``, named with the valid ones; from :func:`check_flag` or
            :func:`check_wandb_mode`, naming ``<prefix>.enabled`` or ``<prefix>.mode``.
    """
    unknown = sorted(str(key) for key in wandb_cfg.keys() if key not in keys)
    if unknown:
        raise ValueError(
            f"unknown {prefix} keys {unknown}; valid keys: {sorted(keys)} (mixerlab passes no other "
            "setting to W&B)"
        )
    if check_flag(wandb_cfg.enabled, f"{prefix}.enabled"):
        check_wandb_mode(wandb_cfg.mode, f"{prefix}.mode")


class WandbStartRefused(ValueError):
    """W&B refused to start an online run (no API key, W&B unreachable); the message names the fixes."""


@contextlib.contextmanager
def wandb_start_refused(option: str) -> Iterator[None]:
    """Within the block (a ``wandb.init``, a ``WandbLogger.experiment``), wandb's refusal to start an
    online run becomes a :class:`WandbStartRefused` whose message is wandb's in one line plus the fixes:
    ``wandb login`` (or WANDB_API_KEY), or ``<option>=offline`` and ``wandb sync`` later. Without it the
    refusal is a traceback from inside wandb.

    Raises:
        WandbStartRefused: from ``wandb.errors.UsageError`` (no API key) or ``wandb.errors.CommError``
            (W&B unreachable).
    """
    import wandb

    try:
        yield
    except (wandb.errors.UsageError, wandb.errors.CommError) as err:
        message = " ".join(str(err).split()).rstrip(".")
        raise WandbStartRefused(
            f"W&B could not start an online run ({message}); log in with `wandb login` (or set "
            f"WANDB_API_KEY), or log offline with {option}=offline and upload the run later with `wandb sync`"
        ) from err


def check_wandb_login(option: str) -> None:
    """Refuse an online W&B run before any work is done where it has no API key (``wandb.login(
    prompt=False, verify=False)`` looks for one, WANDB_API_KEY or ``wandb login``'s netrc entry,
    without a network call; quiet under WANDB_SILENT, which train.py sets) or where the W&B server
    (``WANDB_BASE_URL``, default https://api.wandb.ai) is :func:`data.text.unreachable` (wandb.init
    would wait 90 s). A key W&B refuses is found when the run starts (:func:`wandb_start_refused`).
    Nothing where wandb is not installed.

    Raises:
        WandbStartRefused: no API key, or no connection; the message names the fixes.
    """
    try:
        import wandb
    except ImportError:
        return
    if not wandb.login(prompt=False, verify=False):
        raise WandbStartRefused(
            f"W&B could not start an online run (no API key found); log in with `wandb login` (or set "
            f"WANDB_API_KEY), or log offline with {option}=offline and upload the run later with `wandb sync`"
        )
    server = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    if unreachable(server):
        raise WandbStartRefused(
            f"W&B could not start an online run ({server} cannot be reached from this machine); log offline "
            f"with {option}=offline and upload the run later with `wandb sync`"
        )


def start_wandb_run(
    *, project: str, name: str, mode: str, save_dir: str | os.PathLike, job_type: str, kept: str
) -> Any:
    """A new W&B run (``wandb.init``, ending any earlier run of the process) for logging files already
    written, or None where wandb is not installed (said on stdout) or W&B refuses to start an online
    run (:func:`wandb_start_refused`, a warning on stderr): ``kept`` says what remains (``"the records
    were written as JSON only"``).
    """
    try:
        import wandb
    except ImportError:
        print(f"wandb is not installed: {kept}")
        return None
    try:
        with wandb_start_refused("wandb.mode"):
            return wandb.init(
                project=project,
                name=name,
                mode=mode,
                dir=str(save_dir),
                job_type=job_type,
                reinit="finish_previous",
            )
    except WandbStartRefused as err:
        print(f"warning: {err}; {kept}", file=sys.stderr)
        return None


def log_records_to_wandb(
    records: list[dict[str, Any]],
    *,
    enabled: bool,
    project: str,
    name: str,
    mode: str,
    save_dir: str | os.PathLike,
    table: str,
) -> None:
    """Log records as a W&B table in a new run (offline unless ``mode="online"``); no-op when disabled.

    NaN and infinite values are logged as None, as in the JSON file (:func:`finite_or_none`). A
    missing wandb install, or an online run W&B refuses to start (:func:`wandb_start_refused`), is
    reported on stdout / stderr and otherwise ignored: the JSON records remain the source of truth.
    """
    if not enabled or not records:
        return
    check_wandb_mode(mode, "wandb.mode")
    records = finite_or_none(records)
    run = start_wandb_run(
        project=project,
        name=name,
        mode=mode,
        save_dir=save_dir,
        job_type="eval",
        kept="the records were written as JSON only",
    )
    if run is None:
        return
    import wandb

    try:
        columns = sorted({k for r in records for k in r})
        rows = [
            [json.dumps(r.get(c)) if isinstance(r.get(c), list | dict) else r.get(c) for c in columns]
            for r in records
        ]
        run.log({table: wandb.Table(columns=columns, data=rows)})
    finally:
        wandb.finish()

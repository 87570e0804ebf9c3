"""What Hydra makes and writes for a run (its run directory, or a sweep's directory and its jobs'
folders), undone after a run refused by a settings error or stopped by Ctrl+C before training.

:class:`RecordRunFolders`, the Hydra callback of ``conf/train.yaml``, refuses a run or sweep folder
Hydra would fail on in a traceback (:func:`check_hydra_folder`, :func:`check_sweep_subdir`) and
records what existed of it before Hydra makes it (:class:`FoldersBefore`) in this module's
:data:`RUN_FOLDERS_BEFORE` (and :data:`JOBS_RUN_HERE`, the jobs of a sweep run in this process).
``train.run_from_command_line`` then passes them to :func:`remove_unused_folders`, which removes
only what the run made and puts back the files of Hydra's it overwrote. Hydra instantiates the
callback by its path, ``training.run_folders.RecordRunFolders``: the one module object that
``train.py`` imports, so both read and write the same records (as ``run_folders.RUN_FOLDERS_BEFORE``,
never a copy taken by ``from ... import``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import re
import shutil
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, OmegaConfBaseException

from eval.cli import (
    CONF_DIR,
    interpolation_error_message,
    is_group,
    outside_sweep_dir,
    override_value,
    pasteable,
)
from models.checkpoint import write_back

# What Hydra writes before the task runs: into the run directory (its config records in .hydra/, and
# train.log, which its log handler opens to append to), and into a sweep's directory (-m).
HYDRA_RUN_FILES = (".hydra", "train.log")
HYDRA_SWEEP_FILES = ("multirun.yaml",)
HYDRA_CONFIG_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "multirun.yaml")


@dataclasses.dataclass(frozen=True)
class FolderBefore:
    """What one folder that Hydra writes its files into held before a run: ``names``, its entries;
    ``configs``, the bytes and permission bits of Hydra's config files in it
    (:data:`HYDRA_CONFIG_FILES`, relative paths; a few kB each); ``log_size``, the size of its
    ``train.log`` (None: there was none)."""

    names: frozenset[str]
    configs: Mapping[str, tuple[bytes, int]]
    log_size: int | None

    @classmethod
    def of(cls, folder: Path) -> FolderBefore:
        """The record of ``folder`` (an existing folder) now.

        Raises:
            OSError: ``folder`` or one of Hydra's files in it cannot be read.
        """
        configs = {
            rel: ((folder / rel).read_bytes(), stat.S_IMODE((folder / rel).stat().st_mode))
            for rel in HYDRA_CONFIG_FILES
            if (folder / rel).is_file()
        }
        log = folder / "train.log"
        return cls(frozenset(os.listdir(folder)), configs, log.stat().st_size if log.is_file() else None)

    def unchanged(self, folder: Path) -> bool:
        """Whether ``folder`` holds the same entries, Hydra config files and ``train.log`` size as then."""
        return FolderBefore.of(folder) == self


@dataclasses.dataclass(frozen=True)
class FoldersBefore:
    """What existed of a folder's path before Hydra made the folder: ``deepest``, its deepest folder
    that existed (the folder itself when it existed), and ``entries``, the names in ``deepest`` then.
    Whatever lies below ``deepest`` under another name was made after, by the run.

    ``folder`` is the folder recorded: a run directory (``job_depth`` None), or a sweep directory
    whose jobs' run directories lie ``job_depth`` folders below it. ``known`` holds what the folder
    held, and for a sweep what each folder down to its jobs' held (:class:`FolderBefore`), where it
    existed: what a refused run restores of Hydra's files (:func:`remove_unused_run_dir`)."""

    deepest: Path
    entries: frozenset[str]
    folder: Path | None = None
    job_depth: int | None = None
    known: Mapping[Path, FolderBefore] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, folder: str | os.PathLike, job_depth: int | None = None) -> FoldersBefore:
        """The record of ``folder`` (relative to the working directory) now; of a sweep directory
        with ``job_depth`` (1 for Hydra's default ``hydra.sweep.subdir``, a folder per job).

        Raises:
            OSError: ``deepest`` or a folder below it, or one of Hydra's files there, cannot be read.
        """
        folder = Path(folder).resolve()
        deepest = next(p for p in (folder, *folder.parents) if p.is_dir())
        known: dict[Path, FolderBefore] = {}
        level = [folder] if deepest == folder else []
        for depth in range(job_depth or 0, -1, -1):
            for path in level:
                known[path] = FolderBefore.of(path)
            if depth:
                level = [p / name for p in level for name in sorted(known[p].names) if (p / name).is_dir()]
        return cls(deepest, frozenset(os.listdir(deepest)), folder, job_depth, known)

    def made_after(self, path: Path) -> bool:
        """Whether ``path`` (absolute, symbolic links resolved) was not there when the record was taken."""
        return (
            path != self.deepest
            and path.is_relative_to(self.deepest)
            and path.relative_to(self.deepest).parts[0] not in self.entries
        )


def remove_unused_run_dir(run_dir: Path, before: FoldersBefore | None, sweep_dir: Path | None = None) -> bool:
    """Undo what a run wrote when it wrote nothing but what Hydra writes before the task runs
    (``.hydra/`` and ``train.log``, which such a run leaves as it found it): a run refused by a
    settings error would otherwise leave one such folder per attempt under outputs/, or Hydra's
    records of its refused settings in the run directory of an earlier run it was pointed at
    (``hydra.run.dir=<that run>``), over that run's own. A run that wrote anything else, or
    appended to ``train.log`` (it started training: a job of a joblib sweep, killed, leaves no other
    sign of it), keeps its run directory as it is; unless it trained nothing, stopped by Ctrl+C or
    SIGTERM before its first optimizer step (:data:`TRAINED_NOTHING`): what it made in the folder
    goes too (its loggers' records, ``csv/``, ``wandb/``), and its lines in ``train.log``.

    ``before`` (taken of ``run_dir``, or of ``sweep_dir`` for a job of ``-m``, before Hydra made it;
    None: unknown, nothing is touched) says what the run made. Hydra's files that were there before
    (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) are written back as they were
    (atomically), those that were not are removed, then ``run_dir`` and each folder above it while
    the run made it and it is left empty (Hydra makes the missing parents, such as a new outputs/ and
    its date folder). A folder that was there before stays, empty or not, with its other files
    untouched; so does a run directory below a folder that existed but that ``before`` does not
    describe (a sweep's job folder deeper than ``before.job_depth``). Under ``sweep_dir``, the
    sweep's ``multirun.yaml`` is then undone too (removed, with the sweep's folders made for it,
    or written back as it was) where the sweep holds nothing else of its own: no other job's run
    directory, and each folder that existed as it was.

    Returns:
        Whether ``run_dir`` was removed.

    Raises:
        OSError: a file or folder that cannot be read, written or removed (``WriteError`` for a
            config file that cannot be written back).
    """
    run_dir = run_dir.resolve()
    if before is None or not run_dir.is_dir():
        return False
    sweep_dir = sweep_dir.resolve() if sweep_dir is not None else None
    _undo_unused_run_dir(run_dir, before, sweep_dir)
    if sweep_dir is not None and sweep_dir.is_dir():
        _restore_unused_sweep_dir(sweep_dir, before)
    return not run_dir.exists()


def _undo_unused_run_dir(run_dir: Path, before: FoldersBefore, sweep_dir: Path | None) -> None:
    """:func:`remove_unused_run_dir` for ``run_dir`` (absolute, resolved; an existing folder) alone:
    the folders it removes stop below ``sweep_dir``."""
    was = before.known.get(run_dir)
    if was is None and not before.made_after(run_dir):
        return  # what it held before is unknown
    names = was.names if was is not None else frozenset()
    log = run_dir / "train.log"
    logged = log.is_file() and log.stat().st_size > ((was.log_size or 0) if was is not None else 0)
    made = set(os.listdir(run_dir)) - names - set(HYDRA_RUN_FILES)
    if run_dir not in TRAINED_NOTHING and (logged or made):
        return  # the run logged (it started training) or wrote more than Hydra's files
    for name in made:  # of a run that trained nothing: its loggers' records (csv/, wandb/)
        _remove(run_dir / name)
    _restore_hydra_files(run_dir, was, HYDRA_RUN_FILES)
    _remove_folders_made(run_dir, before, stop=sweep_dir)


def _restore_hydra_files(folder: Path, was: FolderBefore | None, names: Sequence[str]) -> None:
    """Put Hydra's files ``names`` (of :data:`HYDRA_RUN_FILES` / :data:`HYDRA_SWEEP_FILES`) in
    ``folder`` back as ``was`` records them: config files written back where they differ, the
    others removed, a ``.hydra/`` or ``train.log`` that was not there removed, and a ``train.log``
    that was there cut back to its size then (it is only appended to; the caller has checked that it
    did not grow, or grew by the lines of a run that trained nothing). A config file is replaced
    atomically with its permission bits, unless it is a symbolic link or has other hard links: Hydra
    wrote through those into the file they share, so the old bytes go back into that file
    (:func:`models.checkpoint.write_back`)."""
    configs = was.configs if was is not None else {}
    for rel in HYDRA_CONFIG_FILES:
        path = folder / rel
        if Path(rel).parts[0] not in names or not path.is_file():
            continue
        if rel not in configs:
            path.unlink()
            continue
        data, mode = configs[rel]
        if path.read_bytes() == data:
            continue
        write_back(path, data, mode)
    log = folder / "train.log"
    if "train.log" in names and was is not None and was.log_size is not None and log.is_file():
        if log.stat().st_size > was.log_size:
            os.truncate(log, was.log_size)
    existed = was.names if was is not None else frozenset()
    for name in set(names) - existed:
        _remove(folder / name)


def _remove(path: Path) -> None:
    """Remove ``path``: a folder with what it holds, a file or a symbolic link (not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_folders_made(folder: Path, before: FoldersBefore, stop: Path | None = None) -> None:
    """Remove ``folder`` and each folder above it (below ``stop``) while the run made it and it is
    empty; the first one that was there before, holds something, or is ``stop`` ends it."""
    while folder != stop and before.made_after(folder):
        try:
            folder.rmdir()
        except OSError:  # not empty: another job of the sweep has written into it since
            return
        folder = folder.parent


def _restore_unused_sweep_dir(sweep_dir: Path, before: FoldersBefore) -> None:
    """Undo the sweep's ``multirun.yaml`` (removed, or written back as it was) and remove the folders
    made for the sweep, when ``sweep_dir`` holds nothing else that the sweep made: each entry was
    there before or is ``multirun.yaml``, and each folder recorded below it is as it was."""
    was = before.known.get(sweep_dir)
    if was is None and not before.made_after(sweep_dir):
        return  # what it held before is unknown
    names = was.names if was is not None else frozenset()
    if set(os.listdir(sweep_dir)) - names - set(HYDRA_SWEEP_FILES):
        return
    below = [path for path in before.known if path != sweep_dir and path.is_dir()]
    if not all(before.known[path].unchanged(path) for path in below):
        return  # another job of the sweep ran in a folder that was there before
    _restore_hydra_files(sweep_dir, was, HYDRA_SWEEP_FILES)
    _remove_folders_made(sweep_dir, before)


def remove_unused_folders(before: FoldersBefore | None, jobs: Sequence[Path] | None = None) -> None:
    """After a run or ``-m`` sweep that ended with a settings error or Ctrl+C before training, in the
    process that took ``before`` (:class:`RecordRunFolders`): undo what it wrote in each run
    directory that it used for nothing else (:func:`remove_unused_run_dir`), and then in the sweep
    directory. Under ``-m`` these are the run directories of all the sweep's jobs, ``before.job_depth``
    folders below the sweep directory: with ``hydra/launcher=joblib`` a refused job stops the sweep,
    and joblib kills the jobs still running, some before they reached their own checks. None (no
    record): nothing is touched. ``jobs``, where known (the run directories of the jobs that ran in
    this process: Hydra's basic launcher), limits the jobs' folders to those, so that another
    sweep writing into the same sweep directory at the same time keeps its jobs' records.

    Raises:
        OSError: as :func:`remove_unused_run_dir`.
    """
    if before is None or before.folder is None:
        return
    if before.job_depth is None:
        remove_unused_run_dir(before.folder, before)
        return
    if not before.folder.is_dir():
        return
    for job in sorted(before.folder.glob("/".join(["*"] * before.job_depth))) if jobs is None else jobs:
        if job.is_dir() and job.resolve() == job:  # not through a symbolic link: the sweep's own
            _undo_unused_run_dir(job, before, before.folder)
    _restore_unused_sweep_dir(before.folder, before)


class RecordRunFolders(HydraCallback):
    """Hydra callback (``hydra.callbacks`` of ``conf/train.yaml``): takes :data:`RUN_FOLDERS_BEFORE`,
    what existed of the run directory (of the sweep directory and its jobs' folders under ``-m``)
    before Hydra makes it and writes its files there, so that a refused run removes only what it
    made and puts back what Hydra overwrote (:func:`remove_unused_folders`). Hydra calls these hooks
    in the process that runs Hydra, before it makes the directory (``on_job_start`` comes only after
    it has written ``.hydra/``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a ``hydra.run.dir`` Hydra cannot make or write its records into
        (:func:`check_hydra_folder`); record it."""
        with _refused_in_one_line():
            check_hydra_folder(config.hydra.run.dir, "hydra.run.dir", config.hydra.output_subdir)
        _record_folders_before(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a ``hydra.sweep.dir`` Hydra cannot make (:func:`check_hydra_folder`) and a
        ``hydra.sweep.subdir`` that leads outside it (:func:`check_sweep_subdir`); record
        ``hydra.sweep.dir`` and its folders down to its jobs' run directories, as deep as
        ``hydra.sweep.subdir`` has parts (resolved only per job: its ``/`` as written are counted)."""
        global JOBS_RUN_HERE
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        with _refused_in_one_line():
            check_hydra_folder(config.hydra.sweep.dir, "hydra.sweep.dir")
            check_sweep_subdir(config.hydra.sweep.dir, subdir)
            resolved = sweep_subdir_known_now(config, subdir)
            if resolved is not None:
                check_sweep_subdir(config.hydra.sweep.dir, resolved, written=subdir)
            check_subdir_varies(config, subdir, resolved)
        _record_folders_before(config.hydra.sweep.dir, max(1, len(Path(str(subdir or "")).parts)))
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
        JOBS_RUN_HERE = [] if launcher.endswith(".BasicLauncher") else None


def _link_loops(path: Path) -> bool:
    """Whether following the symbolic link ``path`` runs into a loop of links (``ln -s a a``, a -> b
    -> a, or a -> b -> c -> b; the OS's limit on links followed, 40 on Linux, counts as one)."""
    try:
        path.resolve(strict=True)
    except RuntimeError:  # how Python < 3.13 reports a loop
        return True
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def check_hydra_folder(folder: str, option: str, output_subdir: str | None = None) -> None:
    """Refuse, before Hydra makes ``folder`` (``option``: ``hydra.run.dir`` or ``hydra.sweep.dir``)
    and writes its records there, what Hydra fails on in a traceback (``FileExistsError``): a
    symbolic link to a missing folder (or a loop of links) as ``folder``, as one above it or as
    ``output_subdir`` in it (``hydra.output_subdir``, ``.hydra``: the run's settings), or a file of
    that name in it; and a path holding a literal ``${`` (Hydra's ``InterpolationKeyError``
    traceback: it names the run's log file by interpolating the folder's path again). Nothing is
    touched: the link or file is the user's.

    Raises:
        ValueError: naming the link and its missing target (or its loop), the file, or the ``${``,
            and the fixes.
    """
    given = pasteable(f"{option}={override_value(folder)}")
    if "${" in folder:
        raise ValueError(
            f"{given}: the path holds '${{', which Hydra reads as an interpolation where it names the run's "
            "log file (hydra.job_logging); use a folder whose path has no '${'"
        )
    path = Path(folder).absolute()
    records = [path / output_subdir] if output_subdir is not None else []
    for entry in [*reversed(path.parents), path, *records]:
        if entry.is_symlink() and not entry.exists():
            target = Path(os.path.normpath(entry.parent / os.readlink(entry)))
            if _link_loops(entry):
                raise ValueError(
                    f"{given}: {entry} is a symbolic link to {target}, and following it runs into a loop "
                    f"of symbolic links (never a folder); remove the loop, or pass {option}=<another folder>"
                )
            raise ValueError(
                f"{given}: {entry} is a symbolic link to {target}, which does not exist; make "
                f"that folder or remove the link, or pass {option}=<another folder>"
            )
    if records and records[0].exists() and not records[0].is_dir():
        raise ValueError(
            f"{given}: {records[0]} is a file, not a folder; Hydra writes the run's settings "
            f"into a folder of that name (hydra.output_subdir): move the file away or pass "
            f"{option}=<another folder>"
        )


def sweep_subdir_known_now(config: DictConfig, subdir: str | None) -> str | None:
    """``hydra.sweep.subdir`` resolved when it depends on nothing that only a job knows (no
    ``hydra.job.*``): an environment variable (``${oc.env:X}``), ``${hydra:runtime.cwd}``, the base
    config's values (which a sweep's overrides may change per job: those are not seen here). None
    when it has no interpolation, names job values, or does not resolve yet."""
    if subdir is None or "${" not in subdir or "hydra.job" in subdir or "hydra:job" in subdir:
        return None
    if not HydraConfig.initialized():  # ${hydra:...} reads it; Hydra sets it again for every job
        HydraConfig.instance().set_config(config)
    try:
        return str(OmegaConf.select(config, "hydra.sweep.subdir", throw_on_resolution_failure=True))
    except InterpolationKeyError as err:
        # A key that no override of the sweep sets (+tag=a,b would, per job) is missing in every job:
        # refused now, in one line (in the job, Hydra's own report failed, "AssertionError()").
        given = {override.key_or_group for override in _task_overrides(config) or []}
        if not given & set(re.findall(r"\$\{([\w.]+)\}", subdir)):
            raise ValueError(interpolation_error_message(err)) from None
        return None
    except InterpolationResolutionError as err:
        # ${oc.env:X} of a variable that is not set (a new-user check: Hydra's "AssertionError()"
        # lines again): missing in every job too, unless hydra.job.env_set sets variables for them.
        if not OmegaConf.select(config, "hydra.job.env_set", default=None):
            raise ValueError(interpolation_error_message(err)) from None
        return None
    except OmegaConfBaseException:
        return None


def check_subdir_varies(config: DictConfig, subdir: str | None, resolved: str | None) -> None:
    """Refuse a ``hydra.sweep.subdir`` that gives two jobs of a sweep the same folder: no
    interpolation, or none of settings that one of the command line's sweeps changes (``fixed``,
    ``${seed}`` without a seed sweep, ``${mixer.name}`` with an ``optim.lr`` sweep beside the
    mixers'). A new-user check: the second job found the first one's checkpoints there and was
    refused, but Hydra had already written its ``.hydra/`` over the first job's, which the clean-up
    could not put back (its record of the folder predates the first job). A resolver
    (``${now:...}``, ``${hydra:job.num}``) or Hydra's job values count as varying.

    Raises:
        ValueError: naming the subdir, the folder and the fix.
    """
    overrides = _task_overrides(config)
    if overrides is None:
        return  # Hydra reports it
    swept = [o for o in overrides if o.is_sweep_override()]
    if subdir is None or not swept:
        return
    keys = re.findall(r"\$\{([^}]*)\}", str(subdir))
    if any(not re.fullmatch(r"[\w.]+", key) or key.split(".")[0] == "hydra" for key in keys):
        return  # a resolver, a nested interpolation, or Hydra's (${hydra.job.num}: the default's)

    def varies_with(override: Any, key: str) -> bool:
        """Whether the sweep ``override`` may change setting ``key``: a key, a section of keys (+tag,
        optim), a group (mixer=a,b sets mixer.*), or a global group (experiment=a,b: any setting)."""
        changed = override.key_or_group
        if is_group(override) and _global_group(changed):
            return True
        return f"{key}.".startswith(f"{changed}.") or f"{changed}.".startswith(f"{key}.")

    # Two jobs that differ only in a sweep that no key of the subdir follows would share a folder.
    if all(any(varies_with(override, key) for key in keys) for override in swept):
        return
    shown = f"{subdir}" + (f" (= {resolved})" if resolved is not None and resolved != subdir else "")
    raise ValueError(
        f"hydra.sweep.subdir={shown} gives jobs of this sweep the same folder, where each would train "
        "over the one before it; put a job value in it, e.g. "
        f"{pasteable(f'hydra.sweep.subdir={subdir}-${{hydra.job.num}}')} (without hydra.sweep.subdir: "
        "the default, a folder per job)"
    )


def _task_overrides(config: DictConfig) -> list[Any] | None:
    """The command line's overrides of a sweep (``hydra.overrides.task``) as Hydra parses them (their
    ``key_or_group`` without ``+`` / ``~``); None where they do not parse (Hydra reports that)."""
    task = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    try:
        return OverridesParser.create().parse_overrides([str(o) for o in task])
    except HydraException:
        return None


@functools.cache
def _global_group(group: str) -> bool:
    """Whether an option of config group ``group`` (``conf/<group>/*.yaml``) is of the global package
    (``# @package _global_``, as the experiments are): it may set any setting, not only ``<group>.*``."""
    folder = CONF_DIR / group
    return any("@package _global_" in path.read_text().split("\n", 1)[0] for path in folder.glob("*.yaml"))


def check_sweep_subdir(sweep_dir: str, subdir: str | None, written: str | None = None) -> None:
    """Refuse a ``hydra.sweep.subdir`` (as written: its interpolations are resolved only per job)
    that does not lead to a folder inside ``hydra.sweep.dir``: an absolute path, one with a ``..``
    part, one that is the sweep folder itself (``.``), or one through a symbolic link (among its
    parts before the first interpolation) to a folder outside it.

    Why refused rather than cleaned up after: a refused sweep undoes what Hydra wrote by its record
    of the sweep folder (:class:`FoldersBefore`), which covers the folders inside it only. A job
    folder elsewhere (the working directory for ``..``, an earlier run's folder) would keep the
    refused sweep's ``.hydra/`` over the records there, and a folder it made there would stay; a
    job folder that is the sweep folder shares it with ``multirun.yaml``, and the clean-up tells
    neither apart from the other. (With ``.``, ``..`` or an absolute path without interpolation,
    every job of the sweep would also train into one folder.)

    ``written``: the subdir as given when ``subdir`` is its resolved value
    (:func:`sweep_subdir_known_now`); the message then names both.

    Raises:
        ValueError: naming the subdir, the sweep folder and the fix (a symbolic link with its target).
    """
    if subdir is None:  # Hydra names the jobs' folder "None"
        return
    named = f"hydra.sweep.subdir={written or subdir}" + ("" if written is None else f" (= {subdir})")
    fix = "use a relative path inside it (without hydra.sweep.subdir: the default, a folder per job)"
    outside = outside_sweep_dir(Path(sweep_dir), subdir)
    if outside is not None:
        raise ValueError(f"{named} leads outside hydra.sweep.dir={sweep_dir}{outside}; {fix}")
    if not Path(subdir).parts:
        raise ValueError(
            f"{named} leads to hydra.sweep.dir={sweep_dir} itself, not to a folder inside it; {fix}"
        )


@contextlib.contextmanager
def _refused_in_one_line() -> Iterator[None]:
    """A ValueError of the block as one line on stderr and exit status 2 (``HYDRA_FULL_ERROR=1``: raised
    as it is), as :class:`eval.cli.OutputDirCheck` refuses a folder: in a Hydra callback, before the
    run's own :func:`eval.cli.user_errors`. Nothing has been recorded yet, so nothing is undone."""
    try:
        yield
    except ValueError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _record_folders_before(folder: str, job_depth: int | None = None) -> None:
    """Set :data:`RUN_FOLDERS_BEFORE` to the record of ``folder`` (None where it cannot be taken)."""
    global RUN_FOLDERS_BEFORE
    try:
        RUN_FOLDERS_BEFORE = FoldersBefore.of(folder, job_depth)
    except OSError:  # a folder that cannot be listed: what the run makes there stays
        RUN_FOLDERS_BEFORE = None


# What existed of this process' run (or sweep) directory before Hydra made it (RecordRunFolders).
RUN_FOLDERS_BEFORE: FoldersBefore | None = None
# The run directories of the sweep's jobs that ran in this process, in order (train.main adds each):
# Hydra's basic launcher; None for a single run, or where the jobs run in other processes (joblib).
JOBS_RUN_HERE: list[Path] | None = None
# The run directories (resolved) of this process' runs stopped by Ctrl+C or SIGTERM before their
# first optimizer step (train.train adds each): neither their lines in train.log nor their loggers'
# records keep their folders.
TRAINED_NOTHING: set[Path] = set()

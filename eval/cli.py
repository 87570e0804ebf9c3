"""Command-line plumbing shared by ``train.py`` and the ``eval/*.py`` scripts."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import errno
import functools
import itertools
import math
import os
import re
import shlex
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    Glob,
    IntervalSweep,
    Override,
    OverrideType,
    Quote,
    QuotedString,
)
from hydra.errors import ConfigCompositionException, HydraException
from hydra.experimental.callback import Callback
from omegaconf import ListConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, OmegaConfBaseException

from eval.records import check_creatable_dir, partial_files, per_job_output
from eval.startup import INTERRUPTED, end_quiet_sigterm
from models.checkpoint import (
    WriteError,
    atomic_write_bytes,
    raised_from,
    replace_refusal,
    write_back,
    written_files,
)


def write_error_message(err: WriteError, retry: str) -> str:
    """One line for a failed write: the file, the OS's reason and the fix.

    Args:
        err: from :func:`models.checkpoint.atomic_write_bytes` (``filename`` the destination).
        retry: the setting that writes elsewhere, as the user would pass it
            (``output=<another path>``).

    Returns:
        ``"cannot write <path>: <reason>; <fix>"``: ``free space or pass <retry>`` for a full disk
        or quota, ``make its folder writable or pass <retry>`` for read-only storage or
        permissions, ``pass <retry>`` otherwise; where the folder took the new file but the file
        already there refused to be replaced (``err.replacing``), that, with the reason
        :func:`models.checkpoint.replace_refusal` sees.
    """
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space or pass {retry}"
    elif err.errno in (errno.EACCES, errno.EPERM) and getattr(err, "replacing", False):
        # A new-user check: an immutable file in a writable folder was told to make the folder writable.
        why = replace_refusal(err.filename) or "check its attributes (lsattr) and owner"
        fix = f"its folder is writable, but the file there cannot be replaced: {why}; or pass {retry}"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"make its folder writable or pass {retry}"
    else:
        fix = f"pass {retry}"
    return f"cannot write {err.filename}: {reason}; {fix}"


# The launcher of this process's -m sweep where its jobs run in other processes (Hydra's joblib
# launcher): set by OutputDirCheck.on_multirun_start; what those jobs wrote is not seen here.
_WORKER_LAUNCHER: str | None = None


def _interrupted_message() -> str:
    """What an interrupted command line kept: the files it wrote whole (atomically), each a length
    sweep's records left partial with the lengths it holds, or nothing; in a sweep whose jobs ran
    in worker processes, that those keep what they wrote (a new-user check: the parent said "nothing
    written" while its jobs had saved their checkpoints)."""
    # Only the files still there: a length sweep removes its .earlier copies when it finishes (a
    # new-user check: an interrupted sweep named the copies its finished first job had removed).
    kept = [path for path in written_files() if path.exists()]
    if not kept and _WORKER_LAUNCHER is not None:
        return (
            f"interrupted: this process wrote nothing; the sweep's jobs ran in worker processes "
            f"({_WORKER_LAUNCHER}), which keep what they wrote before it (their own lines above say what)"
        )
    if not kept:
        return "interrupted: nothing written"
    partial = partial_files()
    names = [f"{path}, partial: {partial[path]}" if path in partial else str(path) for path in kept]
    return f"interrupted: kept the files written before it ({'; '.join(names)})"


def interpolation_error_message(err: InterpolationResolutionError) -> str:
    """One line for a setting whose ``${...}`` does not resolve: the setting and OmegaConf's reason
    (its own message runs over three lines, with ``full_key`` and ``object_type``). For a key that
    is not found (``InterpolationKeyError``, as for a path holding a literal ``${``, a folder named
    ``${x}``), also the override that reads the value literally, ready to paste (``\\${`` escaped,
    quoted for the shell), where the setting can be named on the command line."""
    key = getattr(err, "full_key", None) or ""
    reason = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    message = f"{key}: {reason}" if key else reason
    if "Environment variable" in reason:  # ${oc.env:X}: OmegaConf's words give no fix
        return f"{message}; set it, or give the interpolation a default: ${{oc.env:NAME,default}}"
    if not isinstance(err, InterpolationKeyError):
        return message
    if key in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir"):
        # Escaped, it is refused still (training.run_folders.check_hydra_folder: Hydra interpolates the
        # folder's path again where it names the run's log file): a new-user check went round in a loop.
        return (
            f"{message}: name a setting that exists (and not a literal '${{': a folder whose path holds one "
            "cannot be Hydra's)"
        )
    node = getattr(err, "child_node", None)
    raw = node._value() if node is not None else None
    if isinstance(raw, str) and re.fullmatch(r"[\w.]+", key):
        fix = f": {pasteable(f'{key}={override_value(raw)}')}"
    else:
        fix = ", as '\\${'"
    return f"{message}; if its '${{' is meant literally (a folder named '${{x}}'), pass it escaped{fix}"


# The configs the command lines compose (conf/train.yaml, conf/eval/*.yaml).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _shown_config(config_dir: Path, config_name: str) -> str:
    """A config's path as messages show it, relative to the repository (``conf/eval/recall.yaml``)."""
    return f"{config_dir.relative_to(CONF_DIR.parent) / config_name}.yaml"


def _default_groups(path: Path) -> set[str]:
    """The config groups a config's defaults list chooses (``model: tiny`` or ``/model: tiny`` ->
    ``model``, ``experiment: null``), not Hydra's own; a ``+group=...`` of one of them makes Hydra
    fail with "Multiple values"."""
    groups = set()
    for entry in OmegaConf.load(path).get("defaults") or []:
        for group in entry if not isinstance(entry, str) else ():  # "_self_" is a string
            group = group.removeprefix("/").split("/")[0]
            if not group.startswith(("override ", "hydra")):
                groups.add(group)
    return groups


@functools.cache
def config_settings(config_name: str) -> frozenset[str]:
    """The top-level settings of ``conf/<config_name>.yaml``: its keys and the config groups of its
    defaults list (``model: tiny`` or ``/model: tiny`` -> ``model``), without ``defaults``,
    ``hydra`` and Hydra's own groups.

    Raises:
        FileNotFoundError: no such config (a caller's bug: the names are fixed in the scripts).
    """
    path = CONF_DIR / f"{config_name}.yaml"
    return frozenset((set(OmegaConf.load(path).keys()) - {"defaults", "hydra"}) | _default_groups(path))


def help_groups(config_name: str) -> str:
    """The config groups that ``conf/<config_name>.yaml`` chooses in its defaults list, one a line with
    their options (``mixer: attention, hybrid_based, ...``): the group list of its ``--help``, the
    resolver ``${mixerlab.groups:<config_name>}`` of ``hydra.help.template``. Hydra's own list
    (``$APP_CONFIG_GROUPS``) names every folder of ``conf/``, so ``train.py --help`` listed ``eval``
    (the evaluations' configs), which train.py refuses."""
    groups = sorted(_default_groups(CONF_DIR / f"{config_name}.yaml"))
    return "\n".join(f"{group}: {', '.join(group_options(group) or ())}" for group in groups)


OmegaConf.register_new_resolver("mixerlab.groups", help_groups)


# The first key of a ${...} interpolation (``${tag}``, ``${model.d_model}``), not a resolver's name
# (``${now:...}``, ``${oc.env:X}``); and the key that ``${oc.select:tag,default}`` reads.
_INTERPOLATED_KEY = re.compile(r"\$\{\s*([A-Za-z_]\w*)(?![\w.]*\s*:)")
_SELECTED_KEY = re.compile(r"\$\{\s*oc\.select\s*:\s*([A-Za-z_]\w*)")
# Hydra's folder name made of the command line's overrides: every key given there is read by it.
_OVERRIDE_DIRNAME = re.compile(r"\$\{\s*hydra\s*[.:]\s*job\.override_dirname")


def _strings(value: Any) -> Iterator[str]:
    """Every string of a nested container (OmegaConf's raw values, lists and dicts)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _leaf_paths(value: Any, prefix: str = "") -> Iterator[str]:
    """The dotted paths of a nested dict's leaves (``optim.lr``, ``model.d_model``)."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            yield from _leaf_paths(item, f"{prefix}{key}.")
    elif prefix:
        yield prefix[:-1]


def _bare(name: str) -> str:
    """A name's letters without the underscores, lower case: ``dmodel`` and ``d_model`` compare equal."""
    return name.replace("_", "").lower()


def _likeness(key: str, name: str) -> float:
    """How much ``key`` looks like the setting name ``name``: 2 for the same letters (``dmodel``,
    ``d_model``), 1.5 for the same letters in another order (``modle``, ``model``), else difflib's
    ratio, with 0.15 more when one is the start of the other (``batch`` / ``batch_size``, ``seeds`` /
    ``seed``)."""
    key_bare, name_bare = _bare(key), _bare(name)
    if key_bare == name_bare:
        return 2.0
    if sorted(key_bare) == sorted(name_bare):  # letters swapped: modle, lenght
        return 1.5
    score = max(difflib.SequenceMatcher(None, key, name).ratio(),
                difflib.SequenceMatcher(None, key_bare, name_bare).ratio())  # fmt: skip
    if key_bare.startswith(name_bare) or name_bare.startswith(key_bare):
        score += 0.15
    return score


# Below this likeness no guess is printed (``dstate`` is not ``strategy``).
_GUESS_LIKENESS = 0.75


def closest_settings(key: str, candidates: dict[str, list[str]]) -> list[str]:
    """What a misplaced or misspelt top-level ``key`` probably meant: the settings whose name (the
    last part of its path, or the whole path with ``_`` for the dots: ``data_seed`` ->
    ``data.seed``) looks most like it (:func:`_likeness`), up to three that tie; [] when none comes
    near. ``candidates``: setting -> the names it goes by."""
    scored = sorted(
        ((max(_likeness(key, name) for name in names), setting) for setting, names in candidates.items()),
        key=lambda item: (-item[0], len(item[1]), item[1]),
    )
    if not scored or scored[0][0] < _GUESS_LIKENESS:
        return []
    return [setting for score, setting in scored[:3] if score >= scored[0][0] - 0.005]


def _setting_candidates(raw: Mapping[str, Any], settings: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The guesses :func:`closest_settings` weighs for a config (``raw``, unresolved): each top-level
    key by its name, and each leaf and each of ``settings`` by its last part and by its path with
    ``_`` for the dots (``data.seed``: ``seed``, ``data_seed``)."""
    candidates = {str(name): [str(name)] for name in raw}
    for path in [*_leaf_paths(raw), *settings]:
        candidates.setdefault(path, [path.rsplit(".", 1)[-1], path.replace(".", "_")])
    return candidates


def check_known_settings(cfg: Mapping, config_name: str, hints: Mapping[str, str] | None = None,
                         settings: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Refuse top-level settings that ``conf/<config_name>.yaml`` does not define and that nothing
    refers to: Hydra composes a ``+key=value`` override whatever its name, and a misspelt one
    (``+seeds=1``, ``+lr=1e-3`` for ``optim.lr``) would be ignored without a word, the run going on
    with the defaults. A key that a ``${...}`` of the config or of Hydra's settings reads is kept:
    ``+tag=x 'hydra.run.dir=runs/${tag}'``, ``${oc.select:tag,none}``, a folder named by
    ``${hydra.job.override_dirname}`` (every key of the command line), a helper key of an experiment
    config. Settings below the top level are checked where they are read (``model.*``, ``optim.*``,
    ``trainer.*``, ``logger.*``).

    Args:
        cfg: the composed config (``hydra`` left out, as the task function receives it).
        config_name: ``train`` or ``eval/<name>``.
        hints: what a key that is no setting's name means (train.py: ``device`` -> ``trainer=cpu or
            trainer=gpu``), given instead of a guess.
        settings: dotted settings the config does not spell out but the command reads, for the
            guesses (train.py: Lightning's Trainer arguments as ``trainer.<name>``).

    Raises:
        ValueError: such keys, each named with what it probably meant (:func:`closest_settings`),
            and the list of top-level settings.
    """
    known = config_settings(config_name)
    unknown = sorted(str(key) for key in cfg.keys() if key not in known and key != "hydra")
    if not unknown:
        return
    raw = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else dict(cfg)
    texts = list(_strings(raw))
    if HydraConfig.initialized():  # hydra.run.dir=runs/${tag}, in Hydra's config and its overrides
        texts += _strings(OmegaConf.to_container(HydraConfig.get(), resolve=False))
    if any(_OVERRIDE_DIRNAME.search(text) for text in texts):
        return
    patterns = (_INTERPOLATED_KEY, _SELECTED_KEY)
    read = {key for text in texts for pattern in patterns for key in pattern.findall(text)}
    unread = [key for key in unknown if key not in read]
    if not unread:
        return
    candidates = _setting_candidates({key: raw[key] for key in raw if key in known}, settings)
    named = []
    for key in unread:
        meant = [hints[key]] if hints and key in hints else closest_settings(key, candidates)
        named.append(f"'{key}'" + (f" (did you mean {' or '.join(meant)}?)" if meant else ""))
    raise ValueError(
        f"unknown setting {', '.join(named)}: conf/{config_name}.yaml has no such key and no setting "
        "refers to it, so nothing would read it (Hydra adds any key given with '+'); remove it or fix "
        f"its name. The top-level settings are {', '.join(sorted(known))}"
    )


def _command_line_overrides(argv: list[str]) -> list[Override] | None:
    """The overrides of a script's command line (``sys.argv[1:]``) as Hydra parses them; None where
    Hydra is left to judge them: flags it refuses, shell completion, and a command line that changes
    the config's location (``--config-dir``, ``--config-path``, ``--config-name``,
    ``hydra.searchpath=...``).

    Raises:
        ValueError: an override Hydra cannot parse (``seed``, ``model.d_model=[``), with its reason
            in one line.
    """
    from hydra._internal.utils import get_args_parser  # Hydra's own command-line grammar

    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:
        return None  # Hydra reports these itself
    overrides = []
    for text in args.overrides:
        try:
            overrides += OverridesParser.create().parse_overrides([text])
        except HydraException as err:
            lines = [line.strip() for line in str(err).splitlines()]
            reason = [line for line in lines if line and not line.startswith(("Error parsing", "See ", "^"))]
            grammar = [line[4:].removesuffix(" for details") for line in lines if line.startswith("See ")]
            quoted = _quoted_override(text, sweep=bool(args.multirun))
            raise ValueError(
                f"cannot parse the override {text!r}: {' '.join(reason) or 'not key=value'}"
                + (f"; to give the value as a string, quote it for Hydra: {quoted}" if quoted else "")
                + (f"; see Hydra's override grammar, {grammar[0]}" if grammar else "")
            ) from None
    if args.config_dir or args.config_path or args.config_name or args.shell_completion:
        return None
    if any(override.key_or_group.startswith("hydra.searchpath") for override in overrides):
        return None
    return overrides


def _multirun(argv: list[str]) -> bool:
    """Whether a script's command line asks Hydra for a multirun (``-m`` / ``--multirun``)."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    return bool(args.multirun)


def is_group(override: Override, config_dir: Path = CONF_DIR) -> bool:
    """Whether ``override`` chooses a config group's option (``mixer=mamba``, ``hydra/launcher=...``)
    rather than a setting's value."""
    group = override.key_or_group
    return "/" in group or (config_dir / group).is_dir()


def _quoted_override(text: str, sweep: bool = False) -> str | None:
    """``key=value`` with the value in Hydra's quotes, ready to paste (:func:`pasteable`), where that
    parses and the text as given did not (a path holding ``~``, a new-user check: only the grammar's
    link was given); with ``sweep`` (``-m``) and a comma in the value, each comma-separated value
    quoted on its own, and the whole value quoted as the alternative. None where the key itself is
    at fault, the value opens a list, mapping or function call (a typo there, not a string), or
    quoting does not help."""
    key, sep, value = text.partition("=")
    if not sep or not value or value[0] in "'\"[{(" or not re.fullmatch(r"[+~]{0,2}[\w.@/-]+", key):
        return None

    def quoted(parts: list[str]) -> str | None:
        line = f"{key}=" + ",".join(QuotedString(text=p, quote=Quote.single).with_quotes() for p in parts)
        try:
            OverridesParser.create().parse_overrides([line])
        except HydraException:
            return None
        return pasteable(line)

    # Each value of a sweep on its own (a,b quoted whole would be one value: a new-user check);
    # without -m a comma is the value's own (ckpt=runs/lr=1e-3,wd=0/best.ckpt, another new-user
    # check: quoted in parts, the suggestion was refused as a sweep), and with -m it may be too.
    whole = quoted([value])
    if not sweep or "," not in value:
        return whole
    each = quoted(value.split(","))
    if each is None or whole is None:
        return each or whole
    return f"{each} (each value of the sweep on its own; {whole} if the commas belong to one value)"


def check_group_options(argv: list[str], config_dir: Path = CONF_DIR) -> None:
    """Refuse, before Hydra composes anything, a config group option of the command line that has no
    file: ``mixer=nonexistent``, ``experiment=zoology``, or one choice of a sweep
    (``-m mixer=attention,mambaa``). Hydra's own error for it is several lines with its search path
    and status 1; this is one line naming the group's options, with a guess when one is close.

    Hydra's own groups (``hydra/launcher=jobli``) are checked against the options Hydra finds for
    them (its packages and plugins); sweeps other than a list of choices, and the command lines
    :func:`_command_line_overrides` leaves to it, are left to Hydra.

    Args:
        argv: the command line's arguments after the script (``sys.argv[1:]``).
        config_dir: the folder of the config groups (``conf/``).

    Raises:
        ValueError: ``unknown <group> '<option>' in <override>: conf/<group> has no <option>.yaml; the
            <group> options are ...`` (for Hydra's groups: ``Hydra has no <group> option <option>``,
            or ``Hydra has no config group <group>``); a value that is no option's name (``trainer=5``);
            a list of options (``mixer=[attention,mamba]``, which Hydra would merge into one run: a
            forgotten ``-m``).
    """
    _check_group_options(_command_line_overrides(argv) or [], config_dir)


def _check_group_options(overrides: list[Override], config_dir: Path) -> None:
    """:func:`check_group_options` on a command line's parsed overrides."""
    for override in overrides:
        group = override.key_or_group
        folder = config_dir / group
        if override.is_delete() or not is_group(override, config_dir):
            continue
        options = group_options(group, config_dir)
        if options is None:  # hydra/launchr=basic: Hydra would list its search path
            where, groups = (
                ("Hydra has no config group", _hydra_groups(config_dir)) if group.startswith("hydra/")
                else ("conf has no folder", sorted(p.name for p in config_dir.iterdir() if p.is_dir()))
            )  # fmt: skip
            raise ValueError(
                f"unknown config group '{group}' in {override.input_line}: {where} {group}; the groups are "
                + ", ".join(groups)
            )
        value = override.value()
        if override.is_sweep_override() and not isinstance(value, ChoiceSweep):
            continue  # glob(*), range(...): Hydra expands them itself
        if isinstance(value, list):  # Hydra would merge the configs of all of them into one run
            raise ValueError(
                f"{override.input_line}: a list of {group} options merges their configs into one run; to "
                f"run each, add -m and write {group}={','.join(map(str, value))}"
            )
        choices = value.list if isinstance(value, ChoiceSweep) else [value]
        for choice in choices:
            if choice is not None and not isinstance(choice, str):  # trainer=5: Hydra's traceback
                raise ValueError(
                    f"{override.input_line}: {group} takes the name of one of its options: "
                    + ", ".join(options)
                )
            if choice is None:  # Hydra: "Config group override must be a string or a list" (a traceback)
                raise ValueError(
                    f"{override.input_line}: {group} takes the name of one of its options "
                    f"({', '.join(options)}), and null is none of them; leave {group} out for the config's "
                    "own choice"
                )
            if choice in options:
                continue
            meant = closest_settings(choice, {option: [option] for option in options})
            where = f"Hydra has no {group} option {choice}"
            if folder.is_dir():
                where = f"conf/{group} has no {choice}.yaml"
            raise ValueError(
                f"unknown {group} '{choice}' in {override.input_line}: {where}"
                + (f" (did you mean {' or '.join(meant)}?)" if meant else "")
                + f"; the {group} options are {', '.join(options)}"
            )


def group_options(group: str, config_dir: Path = CONF_DIR) -> tuple[str, ...] | None:
    """The sorted option names of config group ``group``: ``conf/<group>/*.yaml`` for mixerlab's groups
    (``mixer``), or those Hydra finds on its search path for its own (``hydra/launcher``: ``basic``,
    ``joblib`` from the installed plugin). None where no such group exists."""
    folder = config_dir / group
    if folder.is_dir():
        return tuple(sorted(path.stem for path in folder.glob("*.yaml")))
    return _hydra_group_options(group, config_dir) if group.startswith("hydra/") else None


@functools.cache
def _hydra_group_options(group: str, config_dir: Path) -> tuple[str, ...] | None:
    """:func:`group_options` of one of Hydra's groups, from Hydra's config loader (installed packages
    and plugins: read once a process, some 50 ms a call)."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        if not loader.repository.group_exists(group):
            return None
        return tuple(sorted(loader.get_group_options(group)))


def _hydra_groups(config_dir: Path) -> list[str]:
    """Hydra's own config groups (``hydra/launcher``, ``hydra/sweeper``, ...), sorted."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        repository = GlobalHydra.instance().config_loader().repository
        return sorted(f"hydra/{name}" for name in repository.get_group_options("hydra", ObjectType.GROUP))


def _compose(config_dir: Path, config_name: str, overrides: list[str], with_hydra: bool = False) -> Any:
    """``<config_dir>/<config_name>.yaml`` composed with ``overrides`` by Hydra's compose API, as the
    script's ``@hydra.main`` composes it (unresolved); ``with_hydra`` keeps Hydra's own ``hydra``
    node."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)


def _hydra_key_problem(hydra_cfg: Any, key: str, line: str) -> str | None:
    """What is wrong with ``line``, an override of Hydra's own setting ``key`` (``hydra.run.dirr=x``)
    that Hydra refused to compose, given the composed ``hydra`` node: a key no setting has (named
    with a guess and the settings where it was looked for), or a new key of an open mapping
    (``hydra.job.env_set.X``), which needs a ``+``. None where the key exists."""
    raw = OmegaConf.to_container(hydra_cfg, resolve=False)
    path = key.split(".")[1:]
    if _node(raw, path)[0]:
        return None
    found = max(i for i in range(len(path)) if _node(raw, path[:i])[0])
    _, parent = _node(raw, path[:found])
    where = ".".join(["hydra", *path[:found]])
    if not isinstance(parent, Mapping):
        return f"unknown setting '{key}' in {line}: {where} is a value, not a group of settings"
    parent_cfg = OmegaConf.select(hydra_cfg, ".".join(path[:found])) if found else hydra_cfg
    if found == len(path) - 1 and OmegaConf.get_type(parent_cfg) is dict:  # env_set: any key, added
        return f"{line} sets a key {where} does not hold yet; write +{line} to add it"
    leaves = {f"hydra.{leaf}": [leaf.rsplit(".", 1)[-1]] for leaf in _leaf_paths(raw)}
    guesses = closest_settings(path[-1], leaves)
    # hydra.run.dirr: hydra.run.dir, not also hydra.sweep.dir (both end in "dir").
    guesses = [guess for guess in guesses if guess.startswith(f"{where}.")] or guesses
    return (
        f"unknown setting '{key}' in {line}"
        + (f" (did you mean {' or '.join(guesses)}?)" if guesses else "")
        + f": Hydra's settings have no such key; the settings under {where} are "
        + ", ".join(sorted(map(str, parent)))
    )


def _node(raw: Any, path: list[str]) -> tuple[bool, Any]:
    """(whether the dotted ``path`` names a key of the nested dict ``raw``, the value there)."""
    for part in path:
        if not isinstance(raw, Mapping) or part not in raw:
            return False, None
        raw = raw[part]
    return True, raw


def _raw_setting(
    overrides: list[Override], config_dir: Path, config_name: str, key: str
) -> tuple[bool | None, Any]:
    """(whether the dotted ``key`` names a setting, its value unresolved) in the config composed
    with the command line's group choices (``mixer=hybrid_jamba``, ``experiment=...``, whose options
    may add keys to other groups); (None, None) where that config does not compose (Hydra reports why)."""
    groups = [o.input_line for o in overrides if is_group(o, config_dir) and not o.is_delete()]
    hydra = key == "hydra" or key.startswith("hydra.")  # Hydra's own node, composed on request
    try:
        base = _compose(config_dir, config_name, groups, with_hydra=hydra)
    except Exception:  # noqa: BLE001 -- Hydra composes again and reports it its own way
        return None, None
    return _node(OmegaConf.to_container(base, resolve=False), key.split("."))


def _deletion_problem(overrides: list[Override], config_dir: Path, config_name: str) -> str | None:
    """What is wrong with a ``~key`` override (``~seed``, ``~mixer.name``, ``~logger``), as
    :func:`check_command_line`'s message; None without one. mixerlab's scripts read every setting they
    compose, so a deleted one failed in a traceback (``~seed``), in OmegaConf's lines where another
    setting reads it (``~mixer.name``: ``hydra.run.dir``), in Hydra's (``~early_stopping``, whose value is
    null), or fell back silently to a default of the code (``~optim.warmup_steps``: 100 where the config
    says 50, and no record of it). The advice names a group's options (``~logger``), a section's
    settings as the script's own config file or the chosen group option gives them (``~optim``:
    ``optim.<lr|...>=<value>``; ``~mixer.settings``: ``mixer.settings.<attention>.<setting>=<value>``), or the
    key itself; a key that is no setting of the script (``~run_dir`` of an evaluation) is said to be
    none. Values are not resolved (``run_dir: ${hydra:...}`` failed to resolve here)."""
    for override in overrides:
        if not override.is_delete():
            continue
        key = override.key_or_group
        options = group_options(key, config_dir) if is_group(override, config_dir) else None
        found, section = False, None
        if options is None:
            found, section = _raw_setting(overrides, config_dir, config_name, key)
        if options is not None:
            instead = f"choose another option instead: {key}=<{'|'.join(options)}>"
        elif isinstance(section, Mapping) and len(section):
            # Mappings of mappings (mixer.settings) are set a level deeper (a new-user check).
            deeper = ".<setting>" * all(isinstance(value, Mapping) for value in section.values())
            instead = (
                f"set its settings instead: {key}.<{'|'.join(str(name) for name in section)}>{deeper}=<value>"
            )
        elif isinstance(section, str) and section.startswith("${hydra:"):
            return (
                f"{override.input_line}: {key} is given by Hydra ({section}), so it cannot be deleted; leave "
                f"{override.input_line} out (hydra.run.dir=<folder> chooses a run's folder)"
            )
        elif found is False:
            return (
                f"{override.input_line}: {key} is no setting of this script, so there is nothing to delete "
                f"(and deleting a setting is not supported); leave {override.input_line} out"
            )
        else:
            instead = f"set it instead: {key}=<value>"
        return (
            f"{override.input_line}: deleting a setting is not supported (the scripts read every setting "
            f"they compose: a deleted one fails, or falls back silently to a default of the code); {instead}"
        )
    return None


def check_command_line(
    argv: list[str],
    config_name: str,
    config_dir: Path = CONF_DIR,
    hints: Mapping[str, str] | None = None,
    settings: tuple[str, ...] = (),
    check_job: Callable[[Any], Any] | None = None,
) -> None:
    """Refuse, in one line and before Hydra runs, a command line that Hydra would answer with a
    message of several lines and status 1 (and for a misspelt key, advice to add it with ``+``):

    - an unknown config group option (:func:`check_group_options`);
    - a setting given a value that the composed config does not have (``trainer.max_step=3``,
      ``modle.d_model=64``): named with a guess (:func:`closest_settings`; a ``+`` before a setting
      the config leaves out, such as ``+trainer.max_time``) and the settings where it was looked for;
    - a sweep (``mixer=attention,mamba``) without ``-m``;
    - ``+key=value`` for a key the config already sets (``+seed=3``), and ``+group=option`` for a
      group its defaults already choose (``+experiment=zoology_mqar``: ``experiment: null``), with the
      override to use;
    - a group of ``config_dir`` that the config does not choose (``eval/decode.py
      experiment=zoology_mqar`` or ``+data=text``: decode chooses only model and mixer).
    - ``~key``, deleting a setting (:func:`_deletion_problem`).

    In a sweep (``-m`` with several values) each combination of its group options is composed (up
    to :data:`MAX_SWEEP_JOBS_CHECKED`), its key sweeps at their first value: a key only some of the
    choices have (``-m mixer=attention,mamba mixer.settings.attention.pos_emb=learned``) is named
    with the job, before any job runs. With ``check_job``, each job's composed config is also given
    to it (:func:`_check_sweep_jobs`), so that a bad value (``-m optim.lr=1e-3,abc``) is refused
    before the first job runs rather than when its own job starts. Anything else Hydra refuses is
    left to it.

    Args:
        argv: the command line's arguments after the script (``sys.argv[1:]``).
        config_name, config_dir: the script's config and the folder of its groups, as its
            ``@hydra.main`` names them (``train`` in ``conf/``, ``recall`` in ``conf/eval/``).
        hints: what a key that is no setting's name means, given instead of a guess (train.py:
            ``device`` -> ``trainer=cpu or trainer=gpu``).
        settings: dotted settings the config leaves out but the command reads (train.py: Lightning's
            Trainer arguments as ``trainer.<name>``), for the guesses.
        check_job: the script's own checks of one job's config, raising ValueError / TypeError
            (train.py: :func:`train.check_sweep_job`), returning the job's default record file or
            None; with ``-m`` only (one job too), a single run checks itself.

    Raises:
        ValueError: as above, naming the override.
    """
    overrides = _command_line_overrides(argv)
    if overrides is None:
        return
    if not _multirun(argv):  # Hydra: "Ambiguous value for argument ..." over five lines
        for override in overrides:
            if override.is_sweep_override():
                key = override.key_or_group
                other = f" (a list is {key}=[a,b], a string with commas \"{key}='a,b'\")"
                raise ValueError(
                    f"{override.input_line} gives several values, a sweep: add -m to run one job per value"
                    + ("" if is_group(override, config_dir) else other)
                )
    shown = _shown_config(config_dir, config_name)
    chosen = _default_groups(config_dir / f"{config_name}.yaml")
    for override in overrides:
        group = override.key_or_group
        # eval/decode.py's config shares conf/ with train.py's groups but chooses only some; Hydra
        # looks for the others beside it (eval/experiment/...) or advises a '+' that fails too.
        if group not in chosen and (config_dir / group).is_dir():
            raise ValueError(
                f"{override.input_line}: {shown} takes no {group} option (it chooses "
                f"{', '.join(sorted(chosen)) or 'none'}); remove it"
            )
    problem = _deletion_problem(overrides, config_dir, config_name)
    if problem:
        raise ValueError(problem)
    _check_group_options(overrides, config_dir)
    for override in overrides:
        # Hydra: "Multiple values for ..." (+), "force-add of config groups is not supported" (++); Hydra's
        # own groups are chosen by Hydra's defaults.
        group, forced = override.key_or_group, override.is_force_add()
        hydra_group = group.startswith("hydra/") and group_options(group, config_dir) is not None
        if (override.is_add() or forced) and (group in chosen or hydra_group):
            raise ValueError(
                f"{override.input_line} {'force-adds' if forced else 'adds'} {group}, which "
                f"{'Hydra' if hydra_group else shown} already chooses in its defaults; write "
                f"{override.input_line.lstrip('+')} to choose it"
            )
    sweeps = [override for override in overrides if override.is_sweep_override()]
    if not sweeps:
        problem = _composition_problem(config_dir, config_name, overrides, hints, settings)
        if problem:
            raise ValueError(problem)
        if check_job is not None and _multirun(argv):  # -m, one job: before Hydra makes its folder
            _check_sweep_jobs(config_dir, config_name, overrides, {}, check_job)
        return
    values = _sweep_values(overrides, config_dir)
    # Each job of a sweep over group options has its own config (mixer=attention,mamba): one composed
    # per combination of the group choices (at most MAX_SWEEP_JOBS_CHECKED), a key sweep at its first
    # value (its key, not its values, is what composing checks).
    groups = {i for i in values if is_group(overrides[i], config_dir)}
    firsts = {i: choices[0] for i, choices in values.items()}
    combinations = itertools.product(*(values[i] for i in sorted(groups)))
    problems = {}  # the job's group choices -> what is wrong in it
    for combination in itertools.islice(combinations, MAX_SWEEP_JOBS_CHECKED):
        chosen = {**firsts, **dict(zip(sorted(groups), combination, strict=True))}
        job = _job_overrides(overrides, chosen)
        problems[" ".join(job[i] for i in sorted(groups))] = _composition_problem(
            config_dir, config_name, OverridesParser.create().parse_overrides(job), hints, settings
        )
    failed = {job: problem for job, problem in problems.items() if problem}
    if failed and len(failed) == len(problems):  # wrong in every job: a typo
        raise ValueError(next(iter(failed.values())))
    if failed:  # a key only some of the choices have (mixer.settings.attention.* with mixer=mamba)
        job, problem = next(iter(failed.items()))
        raise ValueError(
            f"the sweep's job with {job}: {problem} (to set a key in the jobs that have it and add it to "
            "those that lack it, write ++key=value)"
        )
    if check_job is not None:
        _check_sweep_jobs(config_dir, config_name, overrides, values, check_job)


def _sweep_values(overrides: list[Override], config_dir: Path = CONF_DIR) -> dict[int, list[str]]:
    """The values of each sweep of a command line (by its index among ``overrides``), each as Hydra's
    basic sweeper writes it into its job's override (``'a,b'`` keeps its quotes, ``range(0,3)`` gives
    0, 1, 2, a group's ``glob(mamb*)`` its matching options).

    Raises:
        ValueError: a sweep Hydra's basic sweeper cannot run or that gives no job: a list holding a
            function's sweep (``seed=range(0,3),4``: OmegaConf's "Unexpected type annotation" in
            three lines), ``interval(...)`` (a traceback), an empty range (``range(5,0)``: an
            IndexError), ``glob(...)`` of a setting rather than a config group (no job at all, exit
            status 0), a range with step 0.
    """
    values: dict[int, list[str]] = {}
    for i, override in enumerate(overrides):
        if not override.is_sweep_override():
            continue
        key, value = override.get_key_element(), override.value()
        if isinstance(value, IntervalSweep):
            raise ValueError(
                f"{override.input_line}: interval(...) is for the sweepers that search a range (Optuna, "
                f"Nevergrad); Hydra's basic sweeper takes a list of values, {key}=<a>,<b>,..., or a "
                "range(...)"
            )
        if isinstance(value, Glob):
            if not is_group(override, config_dir):
                raise ValueError(
                    f"{override.input_line}: glob(...) chooses among a config group's options "
                    f"(mixer=glob(*)), and {key} is a setting: it would run no job; write its values, "
                    f"{key}=<a>,<b>,..."
                )
            # Hydra's basic sweeper expands it the same way, against the group's options.
            options = list(group_options(override.key_or_group, config_dir) or ())
            values[i] = value.filter(options)
            if not values[i]:
                raise ValueError(
                    f"{override.input_line} matches none of the {override.key_or_group} options "
                    f"({', '.join(options)}): the sweep would run no job"
                )
            continue
        try:
            values[i] = list(override.sweep_string_iterator())
        except OmegaConfBaseException:
            raise ValueError(
                f"{override.input_line}: a list of a sweep's values holds another sweep (range(...), "
                f"choice(...)), which Hydra cannot enumerate; write the values as one list, "
                f"{key}=<a>,<b>,..., or a range(...) alone"
            ) from None
        except (HydraException, ValueError) as err:  # range(0,3,0): Python's "arg 3 must not be zero"
            raise ValueError(f"{override.input_line}: {err}") from None
        if not values[i]:
            raise ValueError(
                f"{override.input_line} gives no value (range(start, stop[, step]) stops before stop): the "
                "sweep would run no job"
            )
    return values


def _job_overrides(overrides: list[Override], chosen: dict[int, str]) -> list[str]:
    """One job's overrides, in the command line's order (a later override of a key wins, as in the
    job): each sweep at its ``chosen`` value, the others as given."""
    return [
        f"{override.get_key_element()}={chosen[i]}" if i in chosen else override.input_line
        for i, override in enumerate(overrides)
    ]


def _sweep_jobs(values: dict[int, list[str]]) -> list[dict[int, str]]:
    """The jobs :func:`_check_sweep_jobs` composes, as the value of each sweep (by its index): every
    combination when there are at most :data:`MAX_SWEEP_JOBS_CHECKED`, else each value of each sweep
    once, the other sweeps at their first value (so every value is seen, if not every pairing)."""
    indices = sorted(values)
    if math.prod(len(values[i]) for i in indices) <= MAX_SWEEP_JOBS_CHECKED:
        combinations = itertools.product(*(values[i] for i in indices))
        return [dict(zip(indices, combination, strict=True)) for combination in combinations]
    firsts = {i: values[i][0] for i in indices}
    return [firsts] + [{**firsts, i: value} for i in indices for value in values[i][1:]]


class SweepOutput(NamedTuple):
    """What a job of a ``-m`` sweep writes, as a script's ``check_job`` may return it (a plain string
    is a default record file): ``path``, named in messages by ``option`` (``out`` for a setting,
    ``the default output`` for a file the script names itself), a folder of files with ``folder``
    (eval/report.py's ``out``)."""

    path: str
    option: str = "the default output"
    folder: bool = False


def _job_number(values: dict[int, list[str]], chosen: dict[int, str]) -> int:
    """The ``hydra.job.num`` Hydra's basic sweeper gives the job with the sweeps' ``chosen`` values:
    its index in the product of the sweeps' values in command-line order."""
    number = 0
    for i in sorted(values):
        number = number * len(values[i]) + values[i].index(chosen[i])
    return number


@contextmanager
def _hydra_job(cfg: Any, number: int) -> Iterator[None]:
    """Hydra's config of one job set as its runtime has it, ``job.num`` ``number`` included, so
    that a ``${hydra:job.num}`` in the job's settings (the per-job ``output=`` that
    :func:`eval.records.per_job_output` advises) resolves as in the job; the previous one after."""
    instance = HydraConfig.instance()
    previous = instance.cfg
    with open_dict(cfg):
        cfg.hydra.job.num = number
    instance.set_config(cfg)
    try:
        yield
    finally:
        instance.cfg = previous


def _check_sweep_jobs(
    config_dir: Path,
    config_name: str,
    overrides: list[Override],
    values: dict[int, list[str]],
    check_job: Callable[[Any], Any],
) -> None:
    """``check_job`` on the composed config of each of a sweep's jobs (:func:`_sweep_jobs`), Hydra's
    own settings included (a ``+tag=a,b`` that ``hydra.sweep.subdir=${tag}`` reads is a setting;
    ``${hydra:job.num}`` resolves to the job's number).

    An evaluation's ``output`` record file that two jobs would write is refused here too (a
    new-user check: ``eval/decode.py -m mixer=attention,mamba output=x.json`` ran the first job and
    stopped at the second, :func:`eval.records.check_sweep_output`), and so is what ``check_job``
    may return as the job's output: a default record file (eval/decode.py's
    ``decode-<mixer>-<model>.json``, recall's ``<checkpoint>.recall.json``) or a
    :class:`SweepOutput` (eval/report.py's ``out`` folder).

    Raises:
        ValueError: the first refusal, as ``the sweep's job with <its values>: <message>``.
    """
    outputs: dict[Path, str] = {}  # resolved record file -> the job that writes it
    for chosen in _sweep_jobs(values):
        job = _job_overrides(overrides, chosen)
        named = " ".join(job[i] for i in sorted(chosen))
        try:
            cfg = _compose(config_dir, config_name, job, with_hydra=True)
            with _hydra_job(cfg, _job_number(values, chosen)):
                # A sweep folder that does not resolve is the whole command line's problem, which
                # OutputDirCheck names before any job (not a job's checkpoint that is missing too).
                OmegaConf.select(cfg, "hydra.sweep.dir", throw_on_resolution_failure=True)
                written = check_job(cfg)
                given = cfg.get("output")
            if isinstance(given, str) and given:
                written = SweepOutput(given, "output")
            elif isinstance(written, str):
                written = SweepOutput(written)
            if isinstance(written, SweepOutput) and written.path:
                earlier = outputs.setdefault(Path(written.path).expanduser().resolve(), named)
                if earlier != named:
                    option, path = written.option, written.path
                    name = f"{option}={path}" if option in ("output", "out") else f"{option} {path}"
                    own = f"its own {'folder' if written.folder else 'file'}"
                    raise ValueError(
                        f"{name} would be written by the job with {earlier} too: each job would replace "
                        f"the one before it; give each job {own}, e.g. "
                        f"{per_job_output(Path(written.path), written.folder)}"
                    )
        except OmegaConfBaseException:  # a ${...} only the job resolves: its own check
            continue
        except (TypeError, ValueError, FileNotFoundError) as err:
            raise ValueError(f"the sweep's job{f' with {named}' if named else ''}: {err}") from err
        except Exception:  # noqa: BLE001 -- Hydra composes again in the job and reports it its own way
            continue


# Sweeps over group options are checked job by job up to this many combinations.
MAX_SWEEP_JOBS_CHECKED = 64


def _composition_problem(
    config_dir: Path,
    config_name: str,
    overrides: list[Override],
    hints: Mapping[str, str] | None,
    settings: tuple[str, ...],
) -> str | None:
    """What :func:`check_command_line` refuses in one job's ``overrides`` (none a sweep), as its
    message: a setting given a value that the composed config lacks, or ``+key`` for a key it sets.
    None when Hydra composes them, or fails for another reason (it reports that itself)."""
    shown = _shown_config(config_dir, config_name)
    try:
        _compose(config_dir, config_name, [override.input_line for override in overrides])
        return None
    except ConfigCompositionException:
        pass
    except Exception:  # noqa: BLE001 -- Hydra composes again and reports it its own way
        return None
    groups = [override for override in overrides if is_group(override, config_dir)]
    try:
        base = _compose(config_dir, config_name, [override.input_line for override in groups])
    except Exception:  # noqa: BLE001 -- as above
        return None
    raw = OmegaConf.to_container(base, resolve=False)
    for override in overrides:
        key, line = override.key_or_group, override.input_line
        if key.startswith("hydra.") and override.type is OverrideType.CHANGE:
            try:  # Hydra's own settings: "Could not override ... Key 'dirr' not in 'RunDir'" over 4 lines
                chosen = [group.input_line for group in groups]
                hydra_cfg = _compose(config_dir, config_name, chosen, with_hydra=True).hydra
            except Exception:  # noqa: BLE001 -- as above
                return None
            problem = _hydra_key_problem(hydra_cfg, key, line)
            if problem:
                return problem
            continue
        if override in groups or key.startswith("hydra") or override.is_delete():
            continue
        path = key.split(".")
        exists, _ = _node(raw, path)
        if override.is_add() and exists:
            return (
                f"{line} adds {key}, which {shown} already sets; write {line[1:]} to "
                "change it ('+' adds a key the config lacks)"
            )
        if override.type is not OverrideType.CHANGE or exists:
            continue
        found = max(i for i in range(len(path)) if _node(raw, path[:i])[0])
        _, node = _node(raw, path[:found])
        unused = _unused_mixer_problem(raw, path, found, line)
        if unused:
            return unused
        if hints and key in hints:
            meant = [hints[key]]
        else:
            # A dotted key by its last part: model.lr means optim.lr (its full path looks like model).
            guesses = closest_settings(path[-1], _setting_candidates(raw, settings))
            leaves = set(_leaf_paths(raw)) | set(raw)
            meant = [name if name in leaves else f"+{name}" for name in guesses]
        where = "top-level settings" if not found else f"settings under {'.'.join(path[:found])}"
        listing = (f"the {where} are {', '.join(sorted(map(str, node)))}" if isinstance(node, Mapping)
                   else f"{'.'.join(path[:found])} is a value, not a group of settings")  # fmt: skip
        return (
            f"unknown setting '{key}' in {line}"
            + (f" (did you mean {' or '.join(meant)}?)" if meant else "")
            + f": {shown} and its groups have no such key to change; {listing}"
        )
    return None


def _unused_mixer_problem(raw: Mapping[str, Any], path: list[str], found: int, line: str) -> str | None:
    """For ``mixer.settings.<kind>.<key>=...`` where the chosen mixer has no ``<kind>`` layer but
    other mixer configs (``conf/mixer/*.yaml``) do: a message naming them (a new-user check: with
    ``mixer=mamba``, ``mixer.settings.attention.num_kv_heads=3`` was answered "did you mean
    model.num_heads?"). None for any other unknown key."""
    if path[:2] != ["mixer", "settings"] or found != 2 or len(path) < 3:
        return None
    having = sorted(
        config.stem for config in (CONF_DIR / "mixer").glob("*.yaml")
        if path[2] in (OmegaConf.load(config).get("settings") or {})
    )  # fmt: skip
    if not having:
        return None
    mixer = raw.get("mixer") or {}
    kinds = ", ".join(sorted(map(str, mixer.get("settings") or {}))) or "none"
    choices = having[0] if len(having) == 1 else f"{', '.join(having[:-1])} or {having[-1]}"
    return (
        f"{line}: mixer={mixer.get('name')} has no {path[2]} layer (its settings are {kinds}), so nothing "
        f"would read it; choose a mixer that has one ({choices}), or remove it"
    )


@contextmanager
def signal_handlers(signals: tuple[signal.Signals, ...], handler) -> Iterator[None]:
    """``handler`` for ``signals`` within the block, the previous handlers back after it. Nothing
    outside the main thread (where Python cannot set handlers), and nothing for a signal whose
    handler was set outside Python (``signal.getsignal`` gives None: it could not be put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not None}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def raise_keyboard_interrupt(signum, frame) -> None:
    """A signal handler answering like Ctrl+C: raises ``KeyboardInterrupt("signal SIGTERM")``."""
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextmanager
def user_errors(retry: str = "output=<another path>") -> Iterator[None]:
    """Report a user's mistake, a failed write or Ctrl+C as one line on stderr, not a traceback.

    - ``ValueError``, ``TypeError`` (e.g. ``mixer.settings.mamba.d_state=abc``) and
      ``FileNotFoundError`` raised by mixerlab carry messages that say what is wrong and how to fix
      it; a traceback through Hydra and Lightning would bury them: ``error: <message>``, exit
      status 2. A ``${...}`` that does not resolve (a path holding a literal ``${``) is one line
      too (:func:`interpolation_error_message`).
    - :class:`models.checkpoint.WriteError` (a full disk, read-only storage while writing records,
      plots or checkpoints): ``error: cannot write <path>: <reason>; <fix>``
      (:func:`write_error_message`), exit status 1. Other ``OSError`` keep their traceback.
    - ``KeyboardInterrupt`` (Ctrl+C): ``interrupted: nothing written`` or the files kept (each
      written whole or not at all), exit status 130. From the block on, Ctrl+C raises it
      (Python's own handler, replacing for good the quiet exit a script sets while it imports;
      in the main thread, and not where SIGINT is ignored), and within the block SIGTERM raises
      it too (``kill``, ``timeout``: the same line and status; not where SIGTERM is ignored, nor
      with ``HYDRA_FULL_ERROR=1``). After the block SIGTERM has the handler it had before, or the
      default where that was the quiet exit a script sets while it imports
      (:func:`eval.startup.end_quiet_sigterm`).

    Set ``HYDRA_FULL_ERROR=1`` to get the full traceback instead.

    Args:
        retry: the setting that writes elsewhere, for the failed-write message (train.py:
            ``hydra.run.dir=<another folder>``).

    Raises:
        SystemExit: status 2, 1 or 130, as above.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # SIG_IGN: a background job
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if main_thread:
        end_quiet_sigterm()
    sigterm_taken = (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN and os.environ.get("HYDRA_FULL_ERROR") != "1"
    )
    with signal_handlers((signal.SIGTERM,) if sigterm_taken else (), raise_keyboard_interrupt):
        try:
            yield
        except (ValueError, TypeError, FileNotFoundError, WriteError, KeyboardInterrupt) as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            # raised_from: an error raised while Ctrl+C unwound (a new-user check: matplotlib's "Invalid
            # bounding box" from a figure interrupted mid-draw was reported as the user's, status 2)
            if raised_from(err, KeyboardInterrupt) is not None:
                print(_interrupted_message(), file=sys.stderr)
                sys.exit(INTERRUPTED)
            if isinstance(err, WriteError):
                print(f"error: {write_error_message(err, retry)}", file=sys.stderr)
                sys.exit(1)
            if isinstance(err, InterpolationResolutionError):
                print(f"error: {interpolation_error_message(err)}", file=sys.stderr)
            else:
                print(f"error: {err}", file=sys.stderr)
            sys.exit(2)


def run_command_line(main: Callable[[], Any], config_name: str, config_dir: Path = CONF_DIR,
                     **checks: Any) -> None:  # fmt: skip
    """A script's ``__main__``: :func:`check_command_line` of ``sys.argv[1:]`` (before Hydra, whose own
    messages run over several lines), then ``main``, the script's ``@hydra.main`` function, in one
    :func:`user_errors` block, so that Ctrl+C or SIGTERM while Hydra composes the config and sets
    the run up, or after the task, is one line and status 130 as it is before and during the task.
    (A new-user check found a ``KeyboardInterrupt`` traceback, or death by SIGTERM, between the
    check's block and the task's own :func:`user_errors`: Hydra composed outside either.)

    Args:
        main: the ``@hydra.main`` function, called without arguments (Hydra reads the command line).
        config_name, config_dir, checks: :func:`check_command_line`'s (``hints``, ``settings``,
            ``check_job``).

    Raises:
        SystemExit: :func:`user_errors`' status 2 or 130, or ``main``'s (Hydra's) exit.
    """
    with user_errors():
        check_command_line(sys.argv[1:], config_name, config_dir, **checks)
        main()


class OutputDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` of ``conf/train.yaml``): refuse, as one line, a run or
    sweep directory that cannot be created, before Hydra tries to and fails in a traceback
    (``hydra.run.dir=/read-only/run``).

    Hydra calls ``on_run_start`` / ``on_multirun_start`` before it creates the directory; this
    creates and removes a probe file in the nearest existing folder of ``hydra.run.dir`` (or
    ``hydra.sweep.dir``). A directory whose ``${...}`` does not resolve is refused here too
    (:func:`interpolation_error_message`): Hydra would print the callback's error as a warning of
    five lines and then fail on it again in four more.

    Args:
        probe: whether to probe the directory (the evaluations, which write nothing there and run
            in ``.`` by default, only resolve it: a read-only working folder must not refuse them).
            Without it, a sweep (``-m``) still probes ``hydra.sweep.dir``, where Hydra saves its
            ``multirun.yaml`` before the jobs (a read-only working folder failed there in a
            traceback), and that file is removed, or written back as it was, when the process
            exits: the evaluations' records hold their settings, and nothing else of theirs is there.

    Raises:
        SystemExit: status 2, with ``error: hydra.run.dir=... cannot be created: ...`` (or
            ``error: hydra.run.dir: Interpolation key 'x' not found; ...``) on stderr.
    """

    def __init__(self, probe: bool = True) -> None:
        self.probe = probe

    def on_run_start(self, config, **kwargs) -> None:
        """Check the single run's folder (Hydra callback)."""
        self._check(config.hydra.run, "hydra.run.dir", self.probe)

    def on_multirun_start(self, config, **kwargs) -> None:
        """Check the sweep's folder and remember a launcher whose jobs run in other processes."""
        global _WORKER_LAUNCHER
        sweep_dir = self._check(config.hydra.sweep, "hydra.sweep.dir", True)
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
        _WORKER_LAUNCHER = None if launcher.endswith(".BasicLauncher") else launcher
        if not self.probe:
            # The jobs' folders, which Hydra makes though an evaluation writes nothing there (a new-user
            # check: hydra.sweep.subdir=${mixer.name} left empty attention/ and mamba/ behind). Registered
            # first, so run last (atexit runs in reverse): after multirun.yaml is gone.
            root = Path(sweep_dir).absolute()
            subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
            outside = outside_sweep_dir(root, str(subdir)) if subdir is not None else None
            if outside is not None:
                # The folders Hydra would make there, empty, are outside what is cleaned up below.
                _exit_refused(
                    f"hydra.sweep.subdir={subdir} leads outside hydra.sweep.dir={sweep_dir}{outside}: an "
                    "evaluation writes nothing into its jobs' folders, and Hydra would leave them there "
                    "empty; leave hydra.sweep.subdir out (or keep it inside hydra.sweep.dir)"
                )
            depth = len(Path(str(subdir or "")).parts)
            made = [p for p in (root, *root.parents) if not p.exists()]
            atexit.register(_remove_empty_folders_made, root, depth, _folders_below(root, depth), made)
            path = Path(sweep_dir, "multirun.yaml")
            if path.is_dir():  # Hydra failed in an IsADirectoryError traceback
                _exit_refused(
                    f"hydra.sweep.dir={sweep_dir} holds a folder named multirun.yaml, where Hydra saves the "
                    "sweep's file; pass hydra.sweep.dir=<another folder>"
                )
            # Hydra writes through a symbolic link (a new-user check: a dangling one was removed and the
            # file Hydra made at its target left), so what is put back is the link's target.
            path = path.resolve() if path.is_symlink() else path
            was = (path.read_bytes(), stat.S_IMODE(path.stat().st_mode)) if path.is_file() else None
            atexit.register(_restore_file, path, was)

    def _check(self, section, option: str, probe: bool) -> str:
        """``section.dir``, resolved and (``probe``) checked as creatable; exits with status 2 where not."""
        try:
            try:
                directory = section.dir
            except InterpolationResolutionError as err:
                raise ValueError(interpolation_error_message(err)) from err
            if probe:
                what = (
                    f"{option}={directory} cannot be created"
                    if self.probe
                    else f"{option}={directory} cannot be written (Hydra saves a sweep's multirun.yaml there)"
                )
                check_creatable_dir(directory, what, f"pass {option}=<a writable folder>")
            return directory
        except ValueError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _exit_refused(str(err))


def outside_sweep_dir(root: Path, subdir: str) -> str | None:
    """Where a sweep's ``subdir`` leads out of the sweep folder ``root``: ``""`` for an absolute path
    or one with ``..``, ``": <folder> is a symbolic link to <target>"`` for a link (among the parts
    before the first ``${``) to a folder outside ``root``; None where it stays inside. Used by the
    evaluations' sweeps here and train.py's (:func:`training.run_folders.check_sweep_subdir`)."""
    if Path(subdir).is_absolute() or ".." in Path(subdir).parts:
        return ""
    folder = root
    for part in itertools.takewhile(lambda part: "${" not in part, Path(subdir).parts):
        folder = folder / part
        if folder.is_symlink() and not folder.resolve().is_relative_to(root.resolve()):
            return f": {folder} is a symbolic link to {os.readlink(folder)}"
    return None


def _exit_refused(message: str) -> None:
    """``error: <message>`` on stderr and exit status 2, from a Hydra callback (before
    :func:`user_errors` of the run)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _ignore_interrupts_while_exiting() -> None:
    """Ctrl+C from here on is ignored: the process is exiting, and a KeyboardInterrupt inside an atexit
    function printed a traceback and left the exit status 0 (a new-user check)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _restore_file(path: Path, was: tuple[bytes, int] | None) -> None:
    """Put ``path`` back as it was: removed where ``was`` is None, else its (bytes, permission bits)
    written back (a file written since, Hydra's ``multirun.yaml`` of an evaluation's sweep), into the
    file it shares through a link (:func:`models.checkpoint.write_back`)."""
    _ignore_interrupts_while_exiting()
    try:
        if was is None:
            path.unlink(missing_ok=True)
        elif not path.is_file():
            atomic_write_bytes(path, lambda f: f.write(was[0]))
            os.chmod(path, was[1])
        elif path.read_bytes() != was[0]:
            write_back(path, *was)
    except OSError as err:  # WriteError is one
        print(f"warning: {path} could not be put back as it was: {err}", file=sys.stderr)


def _folders_below(root: Path, depth: int) -> set[Path]:
    """The folders down to ``depth`` levels below ``root`` (symbolic links not followed)."""
    level, found = [root], set()
    for _ in range(depth):
        level = [
            Path(entry.path) for folder in level if folder.is_dir() and not folder.is_symlink()
            for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)
        ]  # fmt: skip
        found.update(level)
    return found


def _remove_empty_folders_made(root: Path, depth: int, existed: set[Path], made: list[Path]) -> None:
    """Remove the empty folders down to ``depth`` levels below ``root`` that were not among
    ``existed``, deepest first, then those of ``made`` (``root`` and its parents that did not exist,
    innermost first) while empty: an evaluation sweep's job folders, which hold nothing of it."""
    _ignore_interrupts_while_exiting()
    try:
        new = sorted(_folders_below(root, depth) - existed, key=lambda p: len(p.parts), reverse=True)
        for folder in [*new, *made]:
            with contextlib.suppress(OSError):  # not empty: something was written there
                folder.rmdir()
    except OSError as err:
        print(f"warning: the sweep's empty folders in {root} could not be removed: {err}", file=sys.stderr)


def override_value(value: Any) -> str:
    """``value`` as a Hydra command-line override writes it, so that a message's ``key=value`` can be
    pasted back: ``true`` / ``false``, ``null``, lists as ``[a,b]``, mappings as ``{k:v}``, numbers
    as Python writes them, and a string bare where Hydra reads it back as that string and it holds
    no whitespace (where a shell splits its argument), else quoted (``'1'``, ``'true'``, ``'a,b'``,
    ``'my runs/last.ckpt'``). A literal ``${`` in a string (a folder named ``${x}``) is escaped as
    ``\\${`` (:func:`escape_interpolations`), which the composed config reads back as ``${`` instead
    of interpolating it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, ListConfig)):  # a config's list too (resume=[a], as composed)
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{override_value(k)}:{override_value(v)}" for k, v in value.items()) + "}"
    if not isinstance(value, str):
        return str(value)
    text = escape_interpolations(value)
    try:
        bare = OverridesParser.create().parse_override(f"key={text}").value() == text
    except HydraException:
        bare = False
    if bare and not any(c.isspace() for c in text):
        return text
    return QuotedString(text=text, quote=Quote.single).with_quotes()


def escape_interpolations(text: str) -> str:
    """``text`` as a config string that OmegaConf resolves back to ``text``: each ``${`` escaped as
    ``\\${``, with the backslashes before it doubled (OmegaConf reads ``\\\\`` before ``${`` as one
    backslash, and leaves the other backslashes as they are)."""
    return re.sub(r"(\\*)\$\{", lambda m: 2 * m.group(1) + "\\${", text)


# Characters a POSIX shell passes through unquoted (no globbing, brace expansion, variables, quotes).
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")


def pasteable(override: str) -> str:
    """A ``key=value`` override as a message prints it to paste into a shell: bare where the shell
    leaves it as it is, else in double quotes (a list or mapping, ``[{seqlen:64,...}]``, whose brackets
    and braces a shell would glob or expand; a Hydra-quoted path, ``resume='my runs/last.ckpt'``),
    or single-quoted by :func:`shlex.quote` where double quotes would still expand something (``$``,
    a backquote, a backslash, ``!``, ``"``)."""
    if _SHELL_SAFE.fullmatch(override):
        return override
    if not any(c in override for c in '"$`\\!'):
        return f'"{override}"'
    return shlex.quote(override)

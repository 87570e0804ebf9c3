"""Command-line plumbing shared by ``train.py`` and the ``eval/*.py`` scripts."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Quote, QuotedString
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

from eval.records import check_creatable_dir
from eval.startup import INTERRUPTED, end_quiet_sigterm
from models.checkpoint import WriteError, written_files


def write_error_message(err: WriteError, retry: str) -> str:
    """One line for a failed write: the file, the OS's reason and the fix.

    Args:
        err: from :func:`models.checkpoint.atomic_write_bytes` (``filename`` the destination).
        retry: the setting that writes elsewhere, as the user would pass it
            (``output=<another path>``).

    Returns:
        ``"cannot write <path>: <reason>; <fix>"``: ``free space or pass <retry>`` for a full disk
        or quota, ``make its folder writable or pass <retry>`` for read-only storage or
        permissions, ``pass <retry>`` otherwise.
    """
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space or pass {retry}"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"make its folder writable or pass {retry}"
    else:
        fix = f"pass {retry}"
    return f"cannot write {err.filename}: {reason}; {fix}"


def _interrupted_message() -> str:
    """What an interrupted command line kept: the files it wrote whole (atomically), or nothing."""
    kept = written_files()
    if not kept:
        return "interrupted: nothing written"
    return f"interrupted: kept the files written before it ({', '.join(map(str, kept))})"


def interpolation_error_message(err: InterpolationResolutionError) -> str:
    """One line for a setting whose ``${...}`` does not resolve: the setting and OmegaConf's reason
    (its own message runs over three lines, with ``full_key`` and ``object_type``). For a key that
    is not found (``InterpolationKeyError``, as for a path holding a literal ``${``, a folder named
    ``${x}``), also the override that reads the value literally, ready to paste (``\\${`` escaped,
    quoted for the shell), where the setting can be named on the command line."""
    key = getattr(err, "full_key", None) or ""
    reason = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    message = f"{key}: {reason}" if key else reason
    if not isinstance(err, InterpolationKeyError):
        return message
    node = getattr(err, "child_node", None)
    raw = node._value() if node is not None else None
    if isinstance(raw, str) and re.fullmatch(r"[\w.]+", key):
        fix = f": {pasteable(f'{key}={override_value(raw)}')}"
    else:
        fix = ", as '\\${'"
    return f"{message}; if its '${{' is meant literally (a folder named '${{x}}'), pass it escaped{fix}"


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
    # None: a handler set outside Python, which signal.signal could not put back.
    sigterm_before = signal.getsignal(signal.SIGTERM) if main_thread else None
    sigterm_taken = sigterm_before not in (None, signal.SIG_IGN) and os.environ.get("HYDRA_FULL_ERROR") != "1"
    if sigterm_taken:
        signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError, WriteError, KeyboardInterrupt) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(err, KeyboardInterrupt):
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
    finally:
        if sigterm_taken:
            signal.signal(signal.SIGTERM, sigterm_before)


class OutputDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` of ``conf/train.yaml``): refuse, as one line, a run or
    sweep directory that cannot be created, before Hydra tries to and fails in a traceback
    (``hydra.run.dir=/read-only/run``).

    Hydra calls ``on_run_start`` / ``on_multirun_start`` before it creates the directory; this
    creates and removes a probe file in the nearest existing folder of ``hydra.run.dir`` (or
    ``hydra.sweep.dir``).

    Raises:
        SystemExit: status 2, with ``error: hydra.run.dir=... cannot be created: ...`` on stderr.
    """

    def on_run_start(self, config, **kwargs) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")

    @staticmethod
    def _check(directory: str, option: str) -> None:
        try:
            check_creatable_dir(directory, f"{option}={directory} cannot be created", f"pass {option}=<a writable folder>")
        except ValueError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)


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
    if isinstance(value, (list, tuple)):
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

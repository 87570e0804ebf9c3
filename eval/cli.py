"""Command-line plumbing shared by ``train.py`` and the ``eval/*.py`` scripts."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hydra.experimental.callback import Callback

from eval.records import check_creatable_dir
from eval.startup import INTERRUPTED
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


@contextmanager
def user_errors(retry: str = "output=<another path>") -> Iterator[None]:
    """Report a user's mistake, a failed write or Ctrl+C as one line on stderr, not a traceback.

    - ``ValueError``, ``TypeError`` (e.g. ``mixer.settings.mamba.d_state=abc``) and
      ``FileNotFoundError`` raised by mixerlab carry messages that say what is wrong and how to fix
      it; a traceback through Hydra and Lightning would bury them: ``error: <message>``, exit
      status 2.
    - :class:`models.checkpoint.WriteError` (a full disk, read-only storage while writing records,
      plots or checkpoints): ``error: cannot write <path>: <reason>; <fix>``
      (:func:`write_error_message`), exit status 1. Other ``OSError`` keep their traceback.
    - ``KeyboardInterrupt`` (Ctrl+C): ``interrupted: nothing written`` or the files kept (each
      written whole or not at all), exit status 130. From the block on, Ctrl+C raises it
      (Python's own handler, replacing for good the quiet exit a script sets while it imports;
      in the main thread, and not where SIGINT is ignored).

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
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


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

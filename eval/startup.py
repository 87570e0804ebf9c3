"""Ctrl+C (or SIGTERM) while a command line starts: one line and the shell's interrupt status, not
a traceback (Ctrl+C) or a silent death (SIGTERM, status 143).

Standard library only, so that ``train.py`` and the ``eval/*.py`` scripts install it before they
import torch, Lightning and Hydra (seconds), where Python would print a ``KeyboardInterrupt``
traceback from inside those imports. :func:`eval.cli.user_errors` hands Ctrl+C back to Python's
own handler when the command's work starts, and reports it there.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130
"""Exit status of a process ended by Ctrl+C (the shell's 128 + SIGINT)."""


def _interrupted_while_starting(signum, frame) -> None:
    print("interrupted: nothing written", file=sys.stderr)
    raise SystemExit(INTERRUPTED)


def quiet_interrupt_while_starting(module_name: str) -> None:
    """Make Ctrl+C or SIGTERM (``kill``, ``timeout``, a scheduler) end a starting command with
    ``interrupted: nothing written`` on stderr and exit status 130 (:data:`INTERRUPTED`), as
    train.py's SIGTERM before training does.

    Args:
        module_name: the calling script's ``__name__``; nothing happens unless it is ``"__main__"``
            (an import by a test or another module keeps Python's handler).

    Nothing happens either with ``HYDRA_FULL_ERROR=1`` (which asks for full tracebacks), and a
    signal whose handler is not Python's default (ignored, as SIGINT in a background job, or taken
    by the caller) keeps it.
    """
    if module_name != "__main__" or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted_while_starting)


def end_quiet_sigterm() -> None:
    """The command has started: a SIGTERM taken by :func:`quiet_interrupt_while_starting` goes back to
    the default (death by SIGTERM, status 143), so that a handler saved now and restored later
    (:func:`eval.cli.user_errors`, train.py's) does not bring back ``interrupted: nothing written``
    after files were written. Main thread only (elsewhere Python cannot set handlers)."""
    if signal.getsignal(signal.SIGTERM) is _interrupted_while_starting:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

"""Command-line plumbing shared by ``train.py`` and the ``eval/*.py`` scripts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hydra.experimental.callback import Callback

from eval.records import check_creatable_dir


@contextmanager
def user_errors() -> Iterator[None]:
    """Report a user's mistake (bad config value or type, missing or corrupt checkpoint) as one line.

    ``ValueError``, ``TypeError`` (e.g. ``mixer.settings.mamba.d_state=abc``) and
    ``FileNotFoundError`` raised by mixerlab carry messages that say what is wrong and how to fix
    it; a traceback through Hydra and Lightning would bury them. The message goes to stderr and the
    process exits with status 2. Set ``HYDRA_FULL_ERROR=1`` to get the full traceback instead.
    """
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
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

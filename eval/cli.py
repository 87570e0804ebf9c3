"""Command-line plumbing shared by ``train.py`` and the ``eval/*.py`` scripts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


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

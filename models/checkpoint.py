"""Writing checkpoints atomically and reading them back with clear errors.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then renamed
over the target (``os.replace`` is atomic on POSIX), so an interrupted run never leaves a
truncated ``last.ckpt`` behind: the reader sees the old file or the new one.
"""

from __future__ import annotations

import errno
import os
import pickle
import stat
import struct
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class WriteError(OSError):
    """Writing a file failed for a reason of its storage: a full disk (``ENOSPC``), a quota
    (``EDQUOT``), read-only storage (``EROFS``), no permission (``EACCES``). Raised by
    :func:`atomic_write_bytes` with the OS's ``errno`` and ``strerror`` and the destination as
    ``filename``, so that a command line can report it as one line (:func:`eval.cli.user_errors`)
    while an ``OSError`` of anything else (reading, a bug) keeps its traceback.

    ``replacing`` is True where the new file was written in the folder but could not take the place
    of the file already there (the folder takes new files; that file refuses: :func:`replace_refusal`)."""

    replacing: bool = False


_written: list[Path] = []


def _write_error(err: OSError, path: Path, replacing: bool = False) -> WriteError:
    """``err`` (from writing ``path``) as a :class:`WriteError` naming ``path``; ``replacing``: it
    came from renaming the written temporary file over the file already at ``path``."""
    error = WriteError(err.errno, err.strerror or str(err), str(path))
    error.replacing = replacing
    return error


def replace_refusal(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` would refuse to be replaced (renamed over) although its folder takes
    new files, where that shows without changing anything; None where it does not (no file there,
    or nothing seen).

    Two cases show: an immutable or append-only file (Linux ``chattr +i`` / ``+a``: opening it for
    writing is refused with ``EPERM`` whoever asks, root too; opened, nothing is written), and a file
    that another user owns in a folder with the sticky bit (``/tmp``) that this user does not own either.
    A file that is only read-only (``chmod a-w``) is replaced: a rename needs the folder's permission.

    Returns:
        the reason, as a clause (``"it is immutable or append-only ..."``), or None.
    """
    path = Path(path)
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.EPERM:
            return "it is immutable or append-only (lsattr shows it; chattr -i or chattr -a lifts it)"
    else:
        os.close(fd)
    try:
        folder = path.parent.stat()
    except OSError:
        return None
    if folder.st_mode & stat.S_ISVTX and os.geteuid() not in (0, st.st_uid, folder.st_uid):
        return (
            f"it belongs to another user (uid {st.st_uid}) in a folder with the sticky bit, where only "
            "its owner (or the folder's) may replace it"
        )
    return None


def raised_from(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` that ``err`` is or was raised from or while handling
    (its ``__cause__`` / ``__context__`` chain), or None: torch.save reports a full disk as a
    RuntimeError raised while handling ``OSError(ENOSPC)``; matplotlib may fail in turn while Ctrl+C's
    ``KeyboardInterrupt`` unwinds it (:func:`eval.cli.user_errors`)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def written_files() -> list[Path]:
    """The files this process has written with :func:`atomic_write_bytes`, each once, in the order
    of their first write (what an interrupted command line can say it kept)."""
    return list(_written)


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Write a file atomically: ``write(fileobj)`` fills a temporary file that then replaces ``path``.

    Args:
        path: destination; its directory is created if missing.
        write: callable taking a binary file object.

    Raises:
        WriteError: an ``OSError`` from creating the directory, or from creating, writing, syncing
            or renaming the temporary file (a full disk, read-only storage, no permission; its
            ``replacing`` True where the rename over an existing file failed): the
            destination is left untouched and the temporary file removed. Only a failure to sync
            the directory after the rename (rare: storage that refuses it) leaves the new file in
            place.
            An exception raised from an ``OSError`` (torch.save's RuntimeError on a full disk) is one
            too.
        Exception: whatever else ``write`` raises (e.g. an unpicklable object), the destination
            likewise untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _write_error(err, path) from err
    renaming = False
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the mode an ordinary open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        renaming = True
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        cause = raised_from(err, OSError) if isinstance(err, Exception) else None  # not Ctrl+C
        if cause is not None and not isinstance(err, WriteError):
            raise _write_error(cause, path, replacing=renaming and os.path.lexists(path)) from err
        raise
    if path not in _written:
        _written.append(path)
    # Make the rename itself durable: fsync the directory entry.
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise _write_error(err, path) from err


def write_back(path: Path, data: bytes, mode: int) -> None:
    """Put a file's earlier ``data`` and permission bits ``mode`` back at ``path`` (a file that was
    rewritten since: Hydra's ``multirun.yaml`` and ``.hydra/*.yaml`` of a refused or evaluating run).
    Replaced atomically (:func:`atomic_write_bytes`) with ``mode``, unless ``path`` is a symbolic link
    or has other hard links: whatever rewrote it wrote through those into the file they share, so
    the old bytes go back into that file (its mode unchanged).

    Raises:
        WriteError / OSError: the file cannot be written (it is then left as it was, or, where
            shared, possibly cut short: a full disk).
    """
    if path.is_symlink() or path.stat().st_nlink > 1:
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    else:
        atomic_write_bytes(path, lambda f: f.write(data))
        os.chmod(path, mode)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes every checkpoint atomically (see module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` (Lightning's dict) to ``path`` atomically.

        Raises:
            TypeError: ``storage_options`` given (only local files are supported).
        """
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO writes local files only and takes no storage_options")
        atomic_write_bytes(path, lambda f: torch.save(checkpoint, f))


# numpy's rebuilder of a scalar from its dtype and bytes, as a numpy scalar pickles (numpy 2 names it
# numpy._core.multiarray.scalar; files numpy 1 wrote, numpy.core.multiarray.scalar).
_NUMPY_SCALAR = np.int64(0).__reduce__()[0]
# The dtypes of numpy's bool, integer and float scalars.
_NUMPY_NUMBER_DTYPES = {type(np.dtype(c)) for c in "?" + np.typecodes["AllInteger"] + np.typecodes["Float"]}


def numpy_scalars_loadable() -> torch.serialization.safe_globals:
    """Within the block, weights-only loads (:func:`read_checkpoint` uses it; train.py wraps
    Lightning's restore of ``resume=`` in it) accept numpy's bool, integer and float scalars, which
    some tools write into a checkpoint (``training.resume.WorldSizeRecord``'s count as ``np.int64(2)``),
    and which would otherwise fail as an unreadable ("truncated or corrupt") file. Each is rebuilt
    from its dtype and bytes: a plain value, no code run (other numpy types stay refused)."""
    return torch.serialization.safe_globals(
        [_NUMPY_SCALAR, (_NUMPY_SCALAR, "numpy.core.multiarray.scalar"), np.dtype, *_NUMPY_NUMBER_DTYPES]
    )


def read_checkpoint(path: str | os.PathLike, arg: str | None = None) -> dict[str, Any]:
    """Load a checkpoint dict on the CPU, turning every failure into an actionable error.

    Args:
        path: a ``.ckpt`` file written by ``train.py``.
        arg: the command-line setting that named it, for the messages (``ckpt``, ``resume``); None
            for a path given in Python (the messages then name no setting).

    Returns:
        Lightning's checkpoint dict (``state_dict``, ``hyper_parameters``, ...).

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (e.g. an int).
        FileNotFoundError: the path does not exist or is a directory.
        ValueError: the file is truncated, corrupt (a zip entry failing its CRC check included), or
            not a mixerlab checkpoint (no model config in its ``hyper_parameters``, no
            ``state_dict``), or its weights hold NaN or inf (:func:`check_finite_weights`).
    """
    # A run resumes from its last.ckpt (a best.ckpt resumes too, on the uninterrupted run's steps).
    name = "last.ckpt" if arg == "resume" else "best.ckpt"
    example = (
        f"a .ckpt file written by train.py, e.g. outputs/<date>/<time>-<mixer>-<data>/checkpoints/{name}"
    )
    hint = f"pass {arg}=<{example}>" if arg else f"give {example}"
    if not isinstance(path, (str, os.PathLike)):  # a new-user check: load_model(5) was pathlib's TypeError
        raise TypeError(
            f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__} {path!r}; {hint}"
        )
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}; {hint}")
    if path.is_dir():
        raise FileNotFoundError(f"checkpoint path is a directory, not a file: {path}; {hint}")
    try:
        # weights_only: a checkpoint holds tensors and plain containers only, so nothing in it can
        # run code when loaded (a foreign pickle is refused instead).
        # torch.load does not check the zip entries' CRCs: bytes overwritten inside a tensor would
        # load as wrong (finite) weights and score 0 without a word.
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                bad_entry = archive.testzip()
            if bad_entry is not None:
                raise ValueError(f"the bytes of {bad_entry} do not match its stored CRC-32")
        with numpy_scalars_loadable(), warnings.catch_warnings():
            # Bytes that are no checkpoint can start like a pickle of an unknown protocol: torch's
            # warning about it would precede the one-line error below.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, KeyError,
        IndexError, struct.error,
    ) as err:  # fmt: skip
        # A text file read as a legacy pickle raises KeyError (IndexError when it is a few bytes:
        # the unpickler pops an empty stack; struct.error when an opcode's argument is cut short,
        # "junk"), random bytes or a foreign pickle fail the weights-only unpickler, whose advice
        # (retry with weights_only=False) must not reach the user.
        unreadable = isinstance(err, KeyError | IndexError | struct.error)
        text = _text_start(path)
        if text is not None:  # a result-record .json passed as ckpt= read as "corrupt" (a new-user check)
            raise ValueError(f"{path} is a text file (it begins {text!r}), not a checkpoint; {hint}") from err
        if unreadable or str(err).startswith("Weights only load failed"):
            reason = "not a file of tensors and plain containers that torch.load can read"
        else:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"could not read checkpoint {path}: the file is truncated or corrupt ({reason}); {hint}"
        ) from err
    hyper_parameters = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(hyper_parameters, dict) or not isinstance(hyper_parameters.get("model"), dict):
        raise ValueError(
            f"{path} is not a mixerlab checkpoint (no model config in its hyper_parameters); {hint}"
        )
    if not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"{path} is not a mixerlab checkpoint, or a truncated or corrupt one (no state_dict of "
            f"model weights); {hint}"
        )
    check_finite_weights(checkpoint["state_dict"], path, arg)
    return checkpoint


def _text_start(path: Path) -> str | None:
    """The start of the file at ``path`` (its first line, up to 30 characters) when its first 512
    bytes are printable UTF-8 text; None for binary bytes or an unreadable file."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    text = head.decode("utf-8", errors="replace").rstrip("\ufffd")  # a character cut at byte 512
    if not text.strip() or "\ufffd" in text or not all(c.isprintable() or c in "\n\r\t" for c in text):
        return None
    return text.strip().splitlines()[0][:30]


def check_finite_weights(state_dict: dict[str, Any], path: str | os.PathLike, arg: str | None = None) -> None:
    """Refuse weights that hold NaN or inf: a diverged run's checkpoint would otherwise score 0
    everywhere without a word, and training on from it stays NaN (every update is).

    Args:
        state_dict: a checkpoint's ``state_dict``.
        path: the checkpoint file, for the message.
        arg: the command-line setting that named it (``ckpt``, ``resume``); None for a path given in
            Python.

    Raises:
        ValueError: how many floating-point tensors hold a non-finite value, naming the first.
    """
    floats = {
        name: t for name, t in state_dict.items() if isinstance(t, torch.Tensor) and t.is_floating_point()
    }
    bad = [name for name, t in floats.items() if not bool(torch.isfinite(t).all())]
    if bad:
        earlier = (
            "an earlier checkpoint of the run, e.g. its best.ckpt if that was saved before the divergence"
        )
        raise ValueError(
            f"checkpoint {path} has NaN or inf weights in {len(bad)} of its {len(floats)} floating-point "
            f"tensors (the first: {bad[0]}): the run likely diverged; "
            + (f"pass {arg}=<{earlier}>" if arg else f"use {earlier}")
        )

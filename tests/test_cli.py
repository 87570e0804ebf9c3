"""The command lines' handling of Ctrl+C, failed writes, non-finite record values and record output
names: eval/cli.py's ``user_errors``, models/checkpoint.py's atomic writer, eval/records.py's
strict JSON and ``output`` check, and eval/report.py's reading of a ``null`` value."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT, compose_eval, compose_train, without_wandb_key
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import eval.records as records_module
import models.checkpoint as checkpoint_module
import train as train_module
from eval.cli import (
    INTERRUPTED,
    _job_overrides,
    _sweep_jobs,
    _sweep_values,
    check_command_line,
    check_group_options,
    check_known_settings,
    config_settings,
    signal_handlers,
    user_errors,
    write_error_message,
)
from eval.copying import copying_eval
from eval.decode import decode_eval
from eval.long_context import long_context_eval
from eval.perplexity import perplexity_eval
from eval.recall import recall_eval
from eval.records import (
    check_output,
    finite_or_none,
    log_records_to_wandb,
    write_records,
    write_sweep_records,
)
from eval.report import build_report, read_record_file
from eval.roofline import roofline
from eval.startup import quiet_interrupt_while_starting
from models.checkpoint import WriteError, atomic_write_bytes
from training.settings import SETTING_HINTS, lightning_settings


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def nothing_written_yet(monkeypatch):
    """This process as if it had written no file yet (other tests of the session have)."""
    monkeypatch.setattr(checkpoint_module, "_written", [])
    monkeypatch.setattr(records_module, "_partial", {})


@pytest.fixture
def sigint_restored():
    """SIGINT's and SIGTERM's handlers as they were before the test (user_errors replaces them)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


# --- atomic writes on a full disk ---------------------------------------------------------------


def torch_save_on_a_full_disk(f):
    """What torch.save raises when its writer hits ENOSPC: a RuntimeError while handling the OSError."""
    try:
        full_disk()
    except OSError as err:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3030784") from err


@pytest.mark.parametrize("failing", ["fsync", "write", "torch.save"])
def test_a_full_disk_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "results.json"
    path.write_bytes(b"the earlier results")
    if failing == "fsync":
        monkeypatch.setattr(os, "fsync", full_disk)
    writers = {"write": full_disk, "torch.save": torch_save_on_a_full_disk}
    with pytest.raises(WriteError) as exc:
        atomic_write_bytes(path, writers.get(failing, lambda f: f.write(b"new results")))
    assert isinstance(exc.value, OSError)
    assert (exc.value.errno, exc.value.strerror, exc.value.filename) == (
        errno.ENOSPC, "No space left on device", str(path),
    )  # fmt: skip
    assert path.read_bytes() == b"the earlier results"
    assert list(tmp_path.iterdir()) == [path]


def test_a_folder_that_cannot_be_made_is_a_write_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(WriteError) as exc:
        atomic_write_bytes(blocker / "results.json", lambda f: f.write(b"{}"))
    assert exc.value.filename == str(blocker / "results.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_other_errors_of_the_writer_are_not_write_errors(tmp_path):
    # A bug's exception keeps its type (and its traceback in the command lines).
    def broken(f):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        atomic_write_bytes(tmp_path / "x.json", broken)
    assert list(tmp_path.iterdir()) == []


def test_written_files_lists_each_file_once(tmp_path, nothing_written_yet):
    for name in ("a.json", "b.json", "a.json"):
        atomic_write_bytes(tmp_path / name, lambda f: f.write(b"[]"))
    assert checkpoint_module.written_files() == [tmp_path / "a.json", tmp_path / "b.json"]


# --- user_errors: failed writes ------------------------------------------------------------------


def test_a_full_disk_is_one_line_naming_the_file_and_the_fix(tmp_path, monkeypatch, capsys, sigint_restored):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    path = tmp_path / "recall.json"
    write_records(path, [{"metric": "accuracy", "value": 0.5}])
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(SystemExit) as exc, user_errors():
        write_records(path, [{"metric": "accuracy", "value": 0.9}])
    assert exc.value.code == 1
    assert capsys.readouterr().err == (
        f"error: cannot write {path}: No space left on device; free space or pass output=<another path>\n"
    )
    assert json.loads(path.read_text()) == [{"metric": "accuracy", "value": 0.5}]
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    "code,fix",
    [
        (errno.EDQUOT, "free space or pass out=<another folder>"),
        (errno.EROFS, "make its folder writable or pass out=<another folder>"),
        (errno.EACCES, "make its folder writable or pass out=<another folder>"),
        (errno.ENOENT, "pass out=<another folder>"),
    ],
)
def test_the_fix_of_a_failed_write_fits_its_reason(code, fix):
    err = WriteError(code, os.strerror(code), "report/report.html")
    expected = f"cannot write report/report.html: {os.strerror(code)}; {fix}"
    assert write_error_message(err, "out=<another folder>") == expected


def test_a_file_that_refuses_to_be_replaced_is_not_blamed_on_its_folder(tmp_path, monkeypatch):
    """A new-user check: a file that could not be replaced (chattr +i) in a writable folder was told
    "make its folder writable". The rename over it fails; the temporary file in the folder was made."""
    path = tmp_path / "r.json"
    path.write_text("[]")
    os_replace = os.replace

    def refused(src, dst, **kwargs):
        if Path(dst) == path:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))
        return os_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(WriteError) as failed:
        atomic_write_bytes(path, lambda f: f.write(b"[1]"))
    assert failed.value.replacing and path.read_text() == "[]" and list(tmp_path.iterdir()) == [path]
    # A file whose refusal shows no reason (here a plain one): what to check.
    assert write_error_message(failed.value, "output=<another path>") == (
        f"cannot write {path}: Operation not permitted; its folder is writable, but the file there cannot be "
        "replaced: check its attributes (lsattr) and owner; or pass output=<another path>"
    )
    # Another user's file in a folder with the sticky bit (/tmp) that this user does not own either.
    tmp_path.chmod(0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: path.stat().st_uid + 1)
    assert checkpoint_module.replace_refusal(path) == (
        f"it belongs to another user (uid {path.stat().st_uid}) in a folder with the sticky bit, where only "
        "its owner (or the folder's) may replace it"
    )
    # Where the folder refused the temporary file, the folder is the one to fix.
    def no_new_file(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    monkeypatch.setattr(checkpoint_module.tempfile, "mkstemp", no_new_file)
    with pytest.raises(WriteError) as failed:
        atomic_write_bytes(path, lambda f: f.write(b"[1]"))
    assert not failed.value.replacing
    assert write_error_message(failed.value, "output=<another path>").endswith(
        "Permission denied; make its folder writable or pass output=<another path>"
    )


def test_other_os_errors_keep_their_traceback(monkeypatch, sigint_restored):
    # Only a failed write is reported as one line: an OSError of anything else (a bug) propagates.
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(PermissionError), user_errors():
        raise PermissionError(errno.EACCES, "Permission denied", "/etc/shadow")


def test_hydra_full_error_gives_the_traceback(monkeypatch, sigint_restored):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(WriteError), user_errors():
        raise WriteError(errno.ENOSPC, "No space left on device", "x.json")
    with pytest.raises(KeyboardInterrupt), user_errors():
        raise KeyboardInterrupt


def test_an_unresolved_interpolation_is_one_line_with_the_fix(monkeypatch, capsys, sigint_restored):
    """Found by a new-user check: `'ckpt=/d${x}/best.ckpt'` printed OmegaConf's three-line message
    (full_key, object_type) with no fix. It is one line; a key not found comes with the override that
    reads the value literally, which Hydra's parser and OmegaConf read back as the given path. Other
    unresolved interpolations (a missing environment variable, a missing value) get no escape advice."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def refused(config: dict, get) -> str:
        with pytest.raises(SystemExit) as exc, user_errors():
            get(OmegaConf.create(config))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
        return err[len("error: "):-1]

    path = "/data/my runs/d${x}/best.ckpt"
    message = refused({"ckpt": path}, lambda cfg: cfg.ckpt)
    head = "ckpt: Interpolation key 'x' not found; if its '${' is meant literally (a folder named '${x}'), pass it escaped: "
    assert message.startswith(head)
    (override,) = shlex.split(message[len(head):])
    parsed = OverridesParser.create().parse_override(override)
    assert parsed.key_or_group == "ckpt"
    assert OmegaConf.create({"ckpt": parsed.value()}).ckpt == path
    # A list element cannot be named on the command line: the escape alone.
    assert refused({"runs": ["/d${x}"]}, lambda cfg: cfg.runs[0]).endswith("pass it escaped, as '\\${'")
    assert refused({"o": "${oc.env:MIXERLAB_NOT_SET}"}, lambda cfg: cfg.o) == (
        "o: KeyError raised while resolving interpolation: \"Environment variable 'MIXERLAB_NOT_SET' not "
        "found\"; set it, or give the interpolation a default: ${oc.env:NAME,default}"
    )
    assert refused({"ckpt": "???", "out": "${ckpt}"}, lambda cfg: cfg.out) == (
        "out: MissingMandatoryValue while resolving interpolation: Missing mandatory value: ckpt"
    )


# --- user_errors: Ctrl+C -------------------------------------------------------------------------


def test_an_interrupt_is_one_line_and_status_130(tmp_path, monkeypatch, capsys, nothing_written_yet, sigint_restored):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exc, user_errors():
        raise KeyboardInterrupt
    assert exc.value.code == INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted: nothing written\n"
    # What was written before the interrupt is named: each file is complete (written atomically).
    with pytest.raises(SystemExit) as exc, user_errors():
        write_records(tmp_path / "recall.json", [])
        raise KeyboardInterrupt
    assert exc.value.code == 130
    assert capsys.readouterr().err == f"interrupted: kept the files written before it ({tmp_path / 'recall.json'})\n"
    # A length sweep's records (eval/decode.py, eval/long_context.py) say which lengths they hold
    # (a carried new-user note: "kept ..." did not say the file was partial); one finished is plain.
    with pytest.raises(SystemExit), user_errors():
        write_sweep_records(tmp_path / "decode.json", [], [512], [512, 1024], output_given=False)
        write_sweep_records(tmp_path / "done.json", [], [512], [512], output_given=False)
        raise KeyboardInterrupt
    assert capsys.readouterr().err == (
        f"interrupted: kept the files written before it ({tmp_path / 'recall.json'}; "
        f"{tmp_path / 'decode.json'}, partial: context lengths [512] of [512, 1024]; "
        f"{tmp_path / 'done.json'})\n"
    )
    # eval/decode.py's plot beside its records holds the same lengths, and says so (a new-user check).
    from eval.decode import write_results

    with pytest.raises(SystemExit), user_errors():
        write_results(tmp_path / "d2.json", [], [512], [512, 1024], output_given=False)
        raise KeyboardInterrupt
    assert capsys.readouterr().err.endswith(
        f"{tmp_path / 'd2.json'}, partial: context lengths [512] of [512, 1024]; "
        f"{tmp_path / 'd2.png'}, partial: context lengths [512] of [512, 1024])\n"
    )
    # A rerun's .earlier copies, removed when it finished, are not named (a new-user check: a sweep
    # interrupted in its second job named the copies its first had removed).
    planned, d3 = [512, 1024], tmp_path / "d3.json"
    with pytest.raises(SystemExit), user_errors():
        for done in (planned, [512], planned):  # a complete run, a rerun's first length, its last
            write_results(d3, [], done, planned, output_given=False)
        raise KeyboardInterrupt
    assert ".earlier" not in capsys.readouterr().err
    # An interrupt while the last length's plot is drawn: the records are whole and not called
    # partial; the plot is the previous length's and says so; the copies are still there.
    with pytest.raises(SystemExit), user_errors():
        write_results(d3, [], [512], planned, output_given=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("eval.decode.plot", lambda *args, **kwargs: signal.raise_signal(signal.SIGINT))
            write_results(d3, [], planned, planned, output_given=False)
    png = d3.with_suffix(".png")
    assert capsys.readouterr().err.endswith(
        f"{d3}; {png}, partial: context lengths [512] of [512, 1024], the earlier file it replaces kept in "
        f"{png}.earlier; {d3}.earlier; {png}.earlier)\n"
    )


def test_an_error_raised_while_handling_an_interrupt_is_the_interrupt(
    monkeypatch, capsys, nothing_written_yet, sigint_restored
):
    """A new-user check: Ctrl+C while the report drew a figure once ended as "error: Invalid bounding
    box" (matplotlib failing as it unwound), status 2, as if the user had given a bad value."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exc, user_errors():
        try:
            raise KeyboardInterrupt
        finally:
            raise ValueError("Invalid bounding box")
    assert exc.value.code == 130 and capsys.readouterr().err == "interrupted: nothing written\n"
    with pytest.raises(SystemExit) as exc, user_errors():
        raise ValueError("num_examples must be an integer >= 1")  # a user's error stays one
    assert exc.value.code == 2


def test_an_interrupted_sweep_of_worker_processes_does_not_say_nothing_written(
    tmp_path, monkeypatch, capsys, nothing_written_yet, sigint_restored
):
    """A new-user check: with hydra/launcher=joblib, SIGINT to the sweep's process alone printed
    "interrupted: nothing written" there while its jobs, in worker processes, saved checkpoints."""
    import eval.cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(eval.cli, "_WORKER_LAUNCHER", None)
    launcher = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    hydra = {"sweep": {"dir": str(tmp_path)}, "launcher": {"_target_": launcher}}
    config = OmegaConf.create({"hydra": hydra})
    eval.cli.OutputDirCheck().on_multirun_start(config)
    with pytest.raises(SystemExit) as exc, user_errors():
        raise KeyboardInterrupt
    assert exc.value.code == 130
    assert capsys.readouterr().err == (
        f"interrupted: this process wrote nothing; the sweep's jobs ran in worker processes ({launcher}), "
        "which keep what they wrote before it (their own lines above say what)\n"
    )
    # Hydra's basic launcher runs the jobs in this process: what they wrote is named as before.
    config.hydra.launcher._target_ = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    eval.cli.OutputDirCheck().on_multirun_start(config)
    with pytest.raises(SystemExit), user_errors():
        raise KeyboardInterrupt
    assert capsys.readouterr().err == "interrupted: nothing written\n"


def test_user_errors_hands_ctrl_c_back_to_python(sigint_restored):
    # The quiet exit a script sets while it imports is replaced, so Ctrl+C raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    with user_errors():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # An ignored SIGINT (a background job of a script) stays ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with user_errors():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_user_errors_takes_sigterm_as_ctrl_c_within_the_block(monkeypatch, capsys, nothing_written_yet, sigint_restored):
    """Found by a new-user check: `timeout -s TERM` on an evaluation ended it with status 143 and no
    word. Within the block SIGTERM raises KeyboardInterrupt (one line, status 130); the handler
    before it is back after the block; an ignored SIGTERM stays ignored."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def before(signum, frame):
        pass

    signal.signal(signal.SIGTERM, before)
    with pytest.raises(SystemExit) as exc, user_errors():
        signal.raise_signal(signal.SIGTERM)
    assert exc.value.code == 130 and capsys.readouterr().err == "interrupted: nothing written\n"
    assert signal.getsignal(signal.SIGTERM) is before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with user_errors():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    # Found by a review: the quiet exit a script sets while it imports came back after the block,
    # so a SIGTERM at exit said "nothing written" after files were written (and status 0 from an
    # atexit hook). After the block SIGTERM has its default.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    quiet_interrupt_while_starting("__main__")
    quiet_exit = signal.getsignal(signal.SIGTERM)
    assert quiet_exit is not signal.SIG_DFL
    with user_errors():
        assert signal.getsignal(signal.SIGTERM) is not quiet_exit
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # HYDRA_FULL_ERROR=1 keeps Python's own answer: SIGTERM is not taken.
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    signal.signal(signal.SIGTERM, before)
    with user_errors():
        assert signal.getsignal(signal.SIGTERM) is before


def start_and_interrupt(
    args: list[str], cwd: Path, env: dict[str, str], sig: signal.Signals = signal.SIGINT
) -> subprocess.CompletedProcess:
    """Start ``python args`` and send it ``sig`` once it is importing torch (its shared library is
    mapped), i.e. after the script's first lines ran and before Hydra composed its config."""
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch" in maps.read_text():
                break
        except FileNotFoundError:  # it ended (and was reaped) since poll()
            break
        time.sleep(0.01)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
@pytest.mark.parametrize("script", ["train.py", "eval/recall.py"])
def test_ctrl_c_while_a_command_starts_is_one_line(tmp_path, script, sig):
    """SIGTERM too: a new-user check found `timeout -s TERM` in the first seconds ending train.py with
    status 143 and no word, where the README promises Ctrl+C's line and status."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [str(REPO_ROOT / script), "trainer=cpu" if script == "train.py" else "ckpt=none.ckpt"]
    result = start_and_interrupt(args, tmp_path, env, sig)
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr == "interrupted: nothing written\n"
    assert list(tmp_path.iterdir()) == []
    # HYDRA_FULL_ERROR=1 keeps Python's own answer: a traceback for SIGINT, and death by the signal.
    result = start_and_interrupt(args, tmp_path, {**env, "HYDRA_FULL_ERROR": "1"}, sig)
    assert result.returncode == -sig
    assert ("KeyboardInterrupt" in result.stderr) == (sig == signal.SIGINT)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
@pytest.mark.parametrize("script", ["train.py", "eval/long_context.py", "eval/report.py"])
def test_ctrl_c_while_hydra_composes_the_config_is_one_line(tmp_path, script, sig):
    """Found by a new-user check: Ctrl+C or SIGTERM while @hydra.main composed the config, between the
    command line's checks and the task's user_errors, gave a KeyboardInterrupt traceback (status
    -2), or death by SIGTERM. The signal is sent from inside Hydra's composition of the command
    line's config (not the checks' own composing, ``from_shell=False``)."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    program = (
        "import runpy, signal, sys\n"
        "from hydra._internal.hydra import Hydra\n"
        "compose = Hydra.compose_config\n"
        "def interrupted(self, *args, **kwargs):\n"
        "    if kwargs.get('from_shell', True):\n"
        f"        signal.raise_signal({int(sig)})\n"
        "    return compose(self, *args, **kwargs)\n"
        "Hydra.compose_config = interrupted\n"
        f"sys.argv = [{script!r}, 'hydra.run.dir={tmp_path / 'run'}']\n"
        f"runpy.run_path({script!r}, run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr == "interrupted: nothing written\n"
    assert list(tmp_path.iterdir()) == []


# --- strict JSON records -------------------------------------------------------------------------


def test_records_are_strict_json_with_null_for_nan_and_inf(tmp_path):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    records = [
        {"run": "r", "metric": "val/loss", "value": math.nan, "seqlen": 64, "extra": {"a": [1.5, math.inf, (-math.inf,)]}},
        {"run": "r", "metric": "val/acc", "value": 0.25, "tokens_per_s": None, "task": "mqar"},
    ]
    path = write_records(tmp_path / "train.json", records)
    data = json.loads(path.read_text(), parse_constant=refuse)
    assert data == [
        {"run": "r", "metric": "val/loss", "value": None, "seqlen": 64, "extra": {"a": [1.5, None, [None]]}},
        {"run": "r", "metric": "val/acc", "value": 0.25, "tokens_per_s": None, "task": "mqar"},
    ]
    assert math.isnan(records[0]["value"])  # the caller's records are not changed
    assert finite_or_none({"x": (1, 2.0, "nan")}) == {"x": [1, 2.0, "nan"]}


def test_the_report_reads_a_null_value_as_nan(tmp_path):
    base = {"run": "r", "mixer": "attention"}
    path = write_records(
        tmp_path / "train.json",
        [{**base, "metric": "val/loss", "value": math.inf}, {**base, "metric": "val/acc", "value": 0.5}],
    )
    loss, acc = read_record_file(path)
    assert math.isnan(loss["value"]) and acc["value"] == 0.5
    # A throughput must be a number: null (a NaN or inf tokens/s) is refused, naming the record.
    path = write_records(tmp_path / "decode.json", [{**base, "metric": "decode_tokens_per_s", "value": math.nan}])
    message = f"{path}: record 0 (decode_tokens_per_s) has value=None; it must be a finite non-negative number"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_record_file(path)
    path.write_text(json.dumps([{**base, "metric": "val/acc", "value": "high"}]))
    with pytest.raises(ValueError, match="has a non-numeric value 'high'"):
        read_record_file(path)


# --- record outputs must be .json ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name,message",
    [
        ("x.png", "output={tmp}/x.png is a .png file name, but the results are written as JSON; pass "
                  "output=<name>.json, e.g. output={tmp}/x.json"),
        ("results", "output={tmp}/results is a file name without the .json suffix, but the results are "
                    "written as JSON; pass output=<name>.json, e.g. output={tmp}/results.json"),
        ("r.json.bak", "output={tmp}/r.json.bak is a .bak file name, but the results are written as JSON; "
                       "pass output=<name>.json, e.g. output={tmp}/r.json"),
    ],
)
def test_record_outputs_must_end_in_json(tmp_path, name, message):
    with pytest.raises(ValueError, match=re.escape(message.replace("{tmp}", str(tmp_path)))):
        check_output(tmp_path / name, "recall.json")
    check_output(tmp_path / "x.JSON", "recall.json")  # any case
    check_output(tmp_path / "new" / "x.json", "recall.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "fn,name",
    [(recall_eval, "recall"), (copying_eval, "copying"), (long_context_eval, "long_context"),
     (perplexity_eval, "perplexity")],
)  # fmt: skip
def test_evaluations_refuse_a_non_json_output_before_reading_the_checkpoint(tmp_path, fn, name):
    output = tmp_path / "x.png"
    message = f"output={output} is a .png file name, but the results are written as JSON"
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(compose_eval(name, [f"ckpt={tmp_path / 'missing.ckpt'}", f"output={output}"]))
    assert list(tmp_path.iterdir()) == []


# --- settings added with '+' that nothing reads ---------------------------------------------------


def compose_decode(overrides: list[str]):
    """conf/eval/decode.yaml, whose defaults name the root's model and mixer groups."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="eval/decode", overrides=overrides)


@pytest.mark.parametrize(
    "config,run,typo,meant",
    [
        ("train", lambda o: train_module.train(compose_train(o)), "seeds", "seed or data.seed"),
        ("eval/recall", lambda o: recall_eval(compose_eval("recall", o)), "num_example", "num_examples"),
        ("eval/copying", lambda o: copying_eval(compose_eval("copying", o)), "device_", "device"),
        ("eval/long_context", lambda o: long_context_eval(compose_eval("long_context", o)), "seqlen",
         "seqlens"),
        ("eval/perplexity", lambda o: perplexity_eval(compose_eval("perplexity", o)), "max_batch",
         "max_batches"),
        ("eval/decode", lambda o: decode_eval(compose_decode(o)), "batch", "batch_size"),
        ("eval/report", lambda o: build_report(compose_eval("report", o)), "runs_", "runs"),
        ("eval/roofline", lambda o: roofline(compose_eval("roofline", o)), "record", "records"),
    ],
)  # fmt: skip
def test_a_setting_added_with_plus_that_nothing_reads_is_refused(tmp_path, config, run, typo, meant):
    # Before anything is read or written: the checkpoint does not exist, the outputs go to tmp_path.
    base = [f"ckpt={tmp_path / 'missing.ckpt'}"] if "ckpt" in config_settings(config) else []
    if config == "train":
        base = [f"run_dir={tmp_path / 'run'}"]
    if config == "eval/report":
        base = [f"runs=[{tmp_path}]", f"out={tmp_path / 'report'}"]
    message = (f"unknown setting '{typo}' (did you mean {meant}?): conf/{config}.yaml has no such key and "
               "no setting refers to it, so nothing would read it (Hydra adds any key given with '+'); "
               "remove it or fix its name. The top-level settings are ")  # fmt: skip
    with pytest.raises(ValueError, match="^" + re.escape(message)) as caught:
        run([*base, f"+{typo}=1"])
    assert str(caught.value).endswith(", ".join(sorted(config_settings(config))))
    assert meant.split(" or ")[0] in config_settings(config)
    assert list(tmp_path.iterdir()) == []
    # Several unknown keys are each named; a key far from every name gets no guess.
    with pytest.raises(ValueError, match=re.escape(f"unknown setting 'aaaa', 'zzzz': conf/{config}.yaml")):
        run([*base, "+zzzz=1", "+aaaa=2"])


MIXERS = ("attention, hybrid_based, hybrid_jamba, hybrid_samba, hybrid_zamba, linear_attention, mamba, "
          "sliding_window")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["mixer=nonexistent"],
         f"unknown mixer 'nonexistent' in mixer=nonexistent: conf/mixer has no nonexistent.yaml; the mixer "
         f"options are {MIXERS}"),
        (["model=small", "experiment=zoology"],
         "unknown experiment 'zoology' in experiment=zoology: conf/experiment has no zoology.yaml (did you "
         "mean zoology_mqar?); the experiment options are induction_extrapolation, nanogpt_shakespeare, "
         "zoology_mqar"),
        (["-m", "mixer=attention,mambaa"],  # one choice of a sweep
         "unknown mixer 'mambaa' in mixer=attention,mambaa: conf/mixer has no mambaa.yaml (did you mean "
         f"mamba?); the mixer options are {MIXERS}"),
        (["trainer=gpus"],
         "unknown trainer 'gpus' in trainer=gpus: conf/trainer has no gpus.yaml (did you mean gpu?); the "
         "trainer options are cpu, ddp, gpu"),
        # A new-user check: null, no option, was Hydra's traceback ("Config group override must be a string").
        (["hydra/launcher=null"],
         "hydra/launcher=null: hydra/launcher takes the name of one of its options (basic, joblib), and null is "
         "none of them; leave hydra/launcher out for the config's own choice"),
        (["experiment=null"], "experiment=null: experiment takes the name of one of its options "
         "(induction_extrapolation, nanogpt_shakespeare, zoology_mqar), and null is none of them; leave "
         "experiment out for the config's own choice"),
        # Hydra's own groups, against the options Hydra finds (its answer was 8 lines with its search path).
        (["-m", "hydra/launcher=basic,jobib"],
         "unknown hydra/launcher 'jobib' in hydra/launcher=basic,jobib: Hydra has no hydra/launcher option "
         "jobib (did you mean joblib?); the hydra/launcher options are basic, joblib"),
        (["hydra/launchr=joblib"],
         "unknown config group 'hydra/launchr' in hydra/launchr=joblib: Hydra has no config group "
         "hydra/launchr; the groups are hydra/env, hydra/help, hydra/hydra_help, hydra/hydra_logging, "
         "hydra/job_logging, hydra/launcher, hydra/output, hydra/sweeper"),
        (["mixer/attention=x"],
         "unknown config group 'mixer/attention' in mixer/attention=x: conf has no folder mixer/attention; the "
         "groups are data, eval, experiment, logger, mixer, model, trainer"),
    ],
)  # fmt: skip
def test_an_unknown_group_option_is_one_line_with_the_options(argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_group_options(argv)


def test_a_group_given_a_list_or_a_number_is_one_line():
    # A list is a forgotten -m (Hydra would merge the mixers' configs into one run, found by a new-user
    # check); a number gave Hydra's traceback.
    message = ("mixer=[attention,mamba]: a list of mixer options merges their configs into one run; to run "
               "each, add -m and write mixer=attention,mamba")  # fmt: skip
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_group_options(["mixer=[attention,mamba]"])
    for argv in (["trainer=5"], ["-m", "trainer=1,cpu"]):
        message = "trainer takes the name of one of its options: cpu, ddp, gpu"
        with pytest.raises(ValueError, match=re.escape(message)):
            check_group_options(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["mixer=mamba", "model=small", "trainer=cpu", "data=text", "logger=none", "experiment=zoology_mqar"],
        ["-m", "mixer=attention,mamba", "model.d_model=32"],
        ["~logger", "mixer.settings.mamba.d_state=8"],  # a deletion, a key
        ["hydra/launcher=joblib", "mixer=glob(*)"],  # Hydra's own group; a sweep it expands itself
        ["--config-dir", "/elsewhere", "mixer=custom"],  # another search path: Hydra's to judge
        ["hydra.searchpath=[file:///elsewhere]", "mixer=custom"],
    ],
)
def test_group_options_that_exist_or_that_hydra_judges_pass(argv):
    check_group_options(argv)


TRAIN_CHECK = dict(
    hints=SETTING_HINTS,
    settings=lightning_settings(),
    check_job=train_module.check_sweep_job,
)


@pytest.mark.parametrize(
    "argv,config,message",
    [
        (["trainer.max_step=3"], "train",
         "unknown setting 'trainer.max_step' in trainer.max_step=3 (did you mean trainer.max_steps?): "
         "conf/train.yaml and its groups have no such key to change; the settings under trainer are "
         "accelerator, check_val_every_n_epoch, "),
        (["modle.d_model=64"], "train",  # a misspelt group: the top-level settings
         "unknown setting 'modle.d_model' in modle.d_model=64 (did you mean model.d_model?): conf/train.yaml "
         "and its groups have no such key to change; the top-level settings are data, early_stopping, "),
        (["modle=small"], "train", "unknown setting 'modle' in modle=small (did you mean model?): "),
        (["model.lr=1e-3"], "train",
         "unknown setting 'model.lr' in model.lr=1e-3 (did you mean optim.lr?): "),
        (["trainer.max_time=00:01:00:00"], "train",  # a Trainer argument the config leaves out: add it
         "unknown setting 'trainer.max_time' in trainer.max_time=00:01:00:00 (did you mean "
         "+trainer.max_time?): "),
        (["device=cpu"], "train", "unknown setting 'device' in device=cpu (did you mean trainer=cpu or "
         "trainer=gpu?): "),
        (["mixer=mamba", "mixer.settings.mamba.d_stat=8"], "train",  # the chosen mixer's settings
         "unknown setting 'mixer.settings.mamba.d_stat' in mixer.settings.mamba.d_stat=8 (did you mean "
         "mixer.settings.mamba.d_state?): conf/train.yaml and its groups have no such key to change; the "
         "settings under mixer.settings.mamba are d_conv, d_state, expand"),
        (["seed.x=1"], "train", "unknown setting 'seed.x' in seed.x=1: "  # x is like no setting
         "conf/train.yaml and its groups have no such key to change; seed is a value, not a group of "
         "settings"),
        (["+seed=3"], "train",
         "+seed=3 adds seed, which conf/train.yaml already sets; write seed=3 to change it ('+' adds a key "
         "the config lacks)"),
        # Sweeps: each job's config (a key typo is one in every job: no job named)
        (["-m", "mixer=attention,mamba", "trainer.max_step=3"], "train",
         "unknown setting 'trainer.max_step' in trainer.max_step=3 (did you mean trainer.max_steps?): "),
        (["-m", "trainer.max_step=1,2"], "train",
         "unknown setting 'trainer.max_step' in trainer.max_step=1 "),
        # A key only some of the sweep's mixers have: Hydra failed at that job, after the first had run.
        (["-m", "mixer=attention,mamba", "mixer.settings.attention.pos_emb=learned"], "train",
         "the sweep's job with mixer=mamba: mixer.settings.attention.pos_emb=learned: mixer=mamba has no "
         "attention layer (its settings are mamba), so nothing would read it; choose a mixer that has one "
         "(attention, hybrid_jamba or hybrid_zamba), or remove it (to set a key in the jobs that have it and "
         "add it to those that lack it, write ++key=value)"),
        # Another mixer's settings (a new-user check: "did you mean model.num_heads?").
        (["mixer=mamba", "mixer.settings.attention.num_kv_heads=3"], "train",
         "mixer.settings.attention.num_kv_heads=3: mixer=mamba has no attention layer (its settings are "
         "mamba), so nothing would read it; choose a mixer that has one (attention, hybrid_jamba or "
         "hybrid_zamba), or remove it"),
        (["mixer=attention", "mixer.settings.mamba.d_state=8"], "train",
         "mixer.settings.mamba.d_state=8: mixer=attention has no mamba layer (its settings are attention), "
         "so nothing would read it; choose a mixer that has one (hybrid_jamba, hybrid_samba, hybrid_zamba "
         "or mamba), or remove it"),
        (["+experiment=zoology_mqar"], "train",  # found by a new-user check: Hydra's "Multiple values"
         "+experiment=zoology_mqar adds experiment, which conf/train.yaml already chooses in its defaults; "
         "write experiment=zoology_mqar to choose it"),
        # Groups of conf/ that decode does not choose: Hydra looked for eval/experiment/..., or advised
        # a '+' that failed in its turn (a carried new-user note).
        (["experiment=zoology_mqar"], "eval/decode",
         "experiment=zoology_mqar: conf/eval/decode.yaml takes no experiment option (it chooses mixer, "
         "model); remove it"),
        (["+data=text"], "eval/decode", "+data=text: conf/eval/decode.yaml takes no data option "),
        (["~trainer"], "eval/decode", "~trainer: conf/eval/decode.yaml takes no trainer option "),
        (["eval=recall"], "train", "eval=recall: conf/train.yaml takes no eval option (it chooses data, "
         "experiment, logger, mixer, model, trainer); remove it"),
        # Hydra's own settings (a carried new-user note): Hydra's four lines and "use +..." advice.
        (["hydra.run.dirr=/tmp/x"], "train", "unknown setting 'hydra.run.dirr' in hydra.run.dirr=/tmp/x "
         "(did you mean hydra.run.dir?): Hydra's settings have no such key; the settings under hydra.run "
         "are dir"),
        (["hydra.jobb.name=x"], "train", "unknown setting 'hydra.jobb.name' in hydra.jobb.name=x (did you "
         "mean hydra.job.name?): Hydra's settings have no such key; the settings under hydra are "
         "callbacks, env, "),
        (["hydra.run.dir.x=1"], "train", "unknown setting 'hydra.run.dir.x' in hydra.run.dir.x=1: "
         "hydra.run.dir is a value, not a group of settings"),
        (["hydra.job.env_set.FOO=1"], "train", "hydra.job.env_set.FOO=1 sets a key hydra.job.env_set does "
         "not hold yet; write +hydra.job.env_set.FOO=1 to add it"),
        (["ckpt=x.ckpt", "hydra.sweep.subdirr=a"], "recall", "unknown setting 'hydra.sweep.subdirr' in "
         "hydra.sweep.subdirr=a (did you mean hydra.sweep.subdir?): "),
        (["ckpt=x.ckpt", "num_example=3"], "recall",
         "unknown setting 'num_example' in num_example=3 (did you mean num_examples?): "
         "conf/eval/recall.yaml "),
        (["model=small", "batch=2"], "eval/decode",
         "unknown setting 'batch' in batch=2 (did you mean batch_size?): conf/eval/decode.yaml "),
        (["seed"], "train",
         "cannot parse the override 'seed': missing EQUAL at '<EOF>'; see Hydra's override grammar, "
         "https://"),
        (["model.d_model=["], "train", "cannot parse the override 'model.d_model=[': no viable alternative "),
        # A new-user check: a path holding ~ got only the grammar's link; the quoted form is given.
        (["data.path=~/corpus.txt"], "train", "cannot parse the override 'data.path=~/corpus.txt': "
         "LexerNoViableAltException: data.path=~/corpus.txt; to give the value as a string, quote it for "
         "Hydra: \"data.path='~/corpus.txt'\"; see Hydra's override grammar, https://"),
        # Each value of a sweep quoted on its own (quoted whole, it was one value: another new-user check).
        (["-m", "ckpt=x.ckpt", "output=a~1.json,a~2.json"], "recall", "cannot parse the override "
         "'output=a~1.json,a~2.json': LexerNoViableAltException: output=a~1.json,a~2.json; to give the value "
         "as a string, quote it for Hydra: \"output='a~1.json','a~2.json'\" (each value of the sweep on its "
         "own; \"output='a~1.json,a~2.json'\" if the commas belong to one value); see Hydra's"),
        # Without -m the comma is the value's own: quoted whole (a new-user check: quoted in parts, the
        # suggestion was refused as a sweep).
        (["ckpt=/runs/lr=1e-3,wd=0/best.ckpt"], "recall", "cannot parse the override "
         "'ckpt=/runs/lr=1e-3,wd=0/best.ckpt': mismatched input '=' expecting <EOF>; to give the value as a "
         "string, quote it for Hydra: \"ckpt='/runs/lr=1e-3,wd=0/best.ckpt'\"; see Hydra's"),
        # A sweep without -m (a new user's finding): Hydra's five lines of "Ambiguous value".
        (["mixer=attention,mamba"], "train",
         "mixer=attention,mamba gives several values, a sweep: add -m to run one job per value"),
        (["ckpt=x.ckpt", "num_examples=1,2"], "recall",
         "num_examples=1,2 gives several values, a sweep: add -m to run one job per value (a list is "
         "num_examples=[a,b], a string with commas \"num_examples='a,b'\")"),
        # Deleting a setting (carried new-user notes): OmegaConf's or Hydra's lines, a traceback, or a
        # silent fallback to a default of the code (~optim.warmup_steps: 100, the config's 50).
        (["~mixer.name"], "train", "~mixer.name: deleting a setting is not supported (the scripts read "
         "every setting they compose: a deleted one fails, or falls back silently to a default of the "
         "code); set it instead: mixer.name=<value>"),
        (["-m", "experiment=induction_extrapolation,zoology_mqar", "~optim.lr"], "train",
         "~optim.lr: deleting a setting is not supported "),
        (["~optim.warmup_steps"], "train", "~optim.warmup_steps: deleting a setting is not supported "),
        (["~optim"], "train", "~optim: deleting a setting is not supported (the scripts read every setting "
         "they compose: a deleted one fails, or falls back silently to a default of the code); set its "
         "settings instead: "
         "optim.<lr|weight_decay|betas|warmup_steps|min_lr_ratio|schedule_interval>=<value>"),
        (["~early_stopping"], "train", "~early_stopping: deleting a setting is not supported "),
        (["~logger"], "train", "~logger: deleting a setting is not supported (the scripts read every "
         "setting they compose: a deleted one fails, or falls back silently to a default of the code); "
         "choose another option instead: logger=<csv|none|wandb>"),
        (["ckpt=x.ckpt", "~num_examples"], "recall", "~num_examples: deleting a setting is not supported "),
        # A new-user check: ~run_dir gave "Unsupported interpolation type hydra" on train.py and advised
        # run_dir=<value> (no such key) on an evaluation; ~mixer.settings advised mixer.settings=<value>.
        (["~run_dir"], "train", "~run_dir: run_dir is given by Hydra (${hydra:runtime.output_dir}), so it "
         "cannot be deleted; leave ~run_dir out (hydra.run.dir=<folder> chooses a run's folder)"),
        (["~run_dir"], "recall", "~run_dir: run_dir is no setting of this script, so there is nothing to "
         "delete (and deleting a setting is not supported); leave ~run_dir out"),
        (["~data.nope"], "train", "~data.nope: data.nope is no setting of this script, so there is nothing"),
        (["~hydra.run.dir"], "train", "~hydra.run.dir: deleting a setting is not supported (the scripts "
         "read every setting they compose: a deleted one fails, or falls back silently to a default of the "
         "code); set it instead: hydra.run.dir=<value>"),
        # Hydra's own settings and groups (a carried new-user note: ~hydra advised hydra=<value>, and
        # ~hydra/launcher said it was no setting).
        (["~hydra.run"], "train", "~hydra.run: deleting a setting is not supported (the scripts read every "
         "setting they compose: a deleted one fails, or falls back silently to a default of the code); set "
         "its settings instead: hydra.run.<dir>=<value>"),
        (["~hydra"], "train", "~hydra: deleting a setting is not supported (the scripts read every setting "
         "they compose: a deleted one fails, or falls back silently to a default of the code); set its "
         "settings instead: hydra.<run|sweep|launcher|"),
        (["-m", "~hydra/launcher"], "recall", "~hydra/launcher: deleting a setting is not supported (the "
         "scripts read every setting they compose: a deleted one fails, or falls back silently to a default "
         "of the code); choose another option instead: hydra/launcher=<basic|joblib>"),
        (["mixer=hybrid_jamba", "~mixer.settings"], "train", "~mixer.settings: deleting a setting is not "
         "supported (the scripts read every setting they compose: a deleted one fails, or falls back "
         "silently to a default of the code); set its settings instead: mixer.settings.<mamba|attention>."
         "<setting>=<value>"),
        # A key an experiment's options add (its package is global) is looked up in the composed config.
        (["experiment=nanogpt_shakespeare", "~data.path"], "train",
         "~data.path: deleting a setting is not supported (the scripts read every setting they compose: a "
         "deleted one fails, or falls back silently to a default of the code); set it instead: data.path="),
        # A sweep's run_dir (a carried new-user note): refused when its first job started.
        (["-m", "run_dir=/tmp/x", "seed=1,2"], "train", "the sweep's job with seed=1: run_dir=/tmp/x: "
         "run_dir is Hydra's run directory, the job's folder in hydra.sweep.dir for this run, which holds "
         "the run's .hydra/ and train.log beside its checkpoints and records; remove the run_dir override "
         "and set hydra.sweep.dir=<folder> (each job gets a folder in it, hydra.sweep.subdir) instead"),
        (["-m", "run_dir=/tmp/x"], "train", "the sweep's job: run_dir=/tmp/x: run_dir is Hydra's run "),
        (["-m", "optim.lr=abc"], "train", "the sweep's job: optim.lr must be a number, got 'abc'"),  # one job
        # Found this session: OmegaConf's "Unexpected type annotation: Set[str]" in three lines.
        (["-m", "seed=range(0,3),4"], "train", "seed=range(0,3),4: a list of a sweep's values holds another "
         "sweep (range(...), choice(...)), which Hydra cannot enumerate; write the values as one list, "
         "seed=<a>,<b>,..., or a range(...) alone"),
        (["-m", "ckpt=x.ckpt", "num_examples=choice(64),128"], "recall",
         "num_examples=choice(64),128: a list of "),
        # Sweeps that Hydra's basic sweeper fails on in a traceback, or that run no job (exit status 0).
        (["-m", "seed=interval(0,1)"], "train", "seed=interval(0,1): interval(...) is for the sweepers that "
         "search a range (Optuna, Nevergrad); Hydra's basic sweeper takes a list of values, seed=<a>,<b>,..., "
         "or a range(...)"),
        (["-m", "seed=range(5,0)"], "train", "seed=range(5,0) gives no value (range(start, stop[, step]) stops "
         "before stop): the sweep would run no job"),
        (["-m", "seed=range(0,3,0)"], "train", "seed=range(0,3,0): range() arg 3 must not be zero"),
        (["-m", "seed=glob(*)"], "train", "seed=glob(*): glob(...) chooses among a config group's options "
         "(mixer=glob(*)), and seed is a setting: it would run no job; write its values, seed=<a>,<b>,..."),
        (["-m", "mixer=glob(zz*)"], "train", "mixer=glob(zz*) matches none of the mixer options (attention, "),
        # A new-user check: Hydra's "Multiple values for hydra/launcher" and "force-add of config groups is
        # not supported", each with its HYDRA_FULL_ERROR line.
        (["+hydra/launcher=joblib"], "train", "+hydra/launcher=joblib adds hydra/launcher, which Hydra already "
         "chooses in its defaults; write hydra/launcher=joblib to choose it"),
        (["++mixer=mamba"], "train", "++mixer=mamba force-adds mixer, which conf/train.yaml already chooses in "
         "its defaults; write mixer=mamba to choose it"),
        # A new-user check: a later job's missing corpus was found after the first job had trained.
        (["-m", "data=text", f"data.path={REPO_ROOT / 'README.md'},/nonexistent/corpus.txt"], "train",
         "the sweep's job with data.path=/nonexistent/corpus.txt: text corpus file not found: "
         "'/nonexistent/corpus.txt' (set data.path to a text file)"),
        # A group's glob is expanded as Hydra's sweeper expands it, so its jobs are checked too.
        (["-m", "mixer=glob(mamb*)", "optim.lr=abc"], "train", "the sweep's job with mixer=mamba: optim.lr "
         "must be a number, got 'abc'"),
        # A carried new-user note: a later job's learned table was refused only when that job started.
        (["-m", "mixer.settings.attention.pos_emb=rope,learned", "++mixer.settings.attention.max_position=64"],
         "train", "the sweep's job with mixer.settings.attention.pos_emb=learned: attention: pos_emb=learned has "
         "max_position=64 rows, but the run trains or validates sequences of 256 tokens; set "
         "++mixer.settings.attention.max_position=256 (rows past "),
    ],
)  # fmt: skip
def test_a_command_line_hydra_would_refuse_is_one_line(argv, config, message):
    config_dir = REPO_ROOT / "conf" / ("eval" if config == "recall" else "")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_command_line(argv, config, config_dir, **(TRAIN_CHECK if config == "train" else {}))


@pytest.mark.parametrize(
    "name", ["copying", "decode", "long_context", "perplexity", "recall", "report", "roofline"]
)
def test_an_evaluation_sweep_makes_no_folder(name):
    # Found by a new-user check: eval/recall.py -m left multirun/<date>/<time>/ with empty job folders.
    # As each script's @hydra.main composes it: decode.yaml from conf/ (it chooses model and mixer).
    config_dir, config_name = ("conf", "eval/decode") if name == "decode" else ("conf/eval", name)
    with initialize_config_dir(config_dir=str(REPO_ROOT / config_dir), version_base="1.3"):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    assert (cfg.hydra.run.dir, cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir, cfg.hydra.output_subdir) == (
        ".", ".", ".", None)


def test_an_evaluation_refuses_a_misspelt_setting_in_one_line_before_hydra(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [sys.executable, str(REPO_ROOT / "eval" / "recall.py"), "ckpt=x.ckpt", "num_example=3"]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        "error: unknown setting 'num_example' in num_example=3 (did you mean num_examples?): "
        "conf/eval/recall.yaml and its groups have no such key to change; the top-level settings are "
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["optim.lr=1e-3,abc"], "the sweep's job with optim.lr=abc: optim.lr must be a number, got 'abc'"),
        (["trainer.max_steps=3,-5"],
         "the sweep's job with trainer.max_steps=-5: trainer.max_steps must be -1 "),
        (["data.seqlen=64,63"], "the sweep's job with data.seqlen=63: data.seqlen must be even "),
        # A mixer's value, checked in every job: here first in one whose layout does not use the mixer.
        (["mixer=attention,mamba", "++mixer.settings.mamba.d_state=8,0"],
         "the sweep's job with mixer=attention ++mixer.settings.mamba.d_state=0: mamba: d_state must be > 0, "
         "got 0 (in the settings of mamba, which this model's layout does not use"),
        # 3 x 5 x 5 = 75 jobs, over MAX_SWEEP_JOBS_CHECKED: each value is still checked once.
        (["mixer=attention,mamba,hybrid_jamba", "seed=0,1,2,3,4", "optim.lr=1e-3,2e-3,3e-3,4e-3,-1"],
         "the sweep's job with mixer=attention seed=0 optim.lr=-1: optim.lr must be > 0"),
        # A fresh-clone check of the above: a quoted value (with a comma), a range() sweep beside the
        # bad value, and a key given earlier on the command line, which the sweep's later value overrides.
        (["mixer.settings.attention.pos_emb=rope,'rop,e'"],
         "the sweep's job with mixer.settings.attention.pos_emb='rop,e': attention: unknown pos_emb 'rop,e'"),
        (["seed=range(0,2)", "optim.lr=1e-3,abc"], "the sweep's job with seed=0 optim.lr=abc: optim.lr must"),
        (["trainer.val_check_interval=3", "trainer.val_check_interval=3,0"],
         "the sweep's job with trainer.val_check_interval=0: trainer.val_check_interval must be >= 1"),
        # Lightning's refusals when it builds the Trainer: the devices, the time limit.
        (["trainer.devices=1,0"],
         "the sweep's job with trainer.devices=0: trainer settings: trainer.devices=0: `Trainer(devices=0)`"),
        (["+trainer.max_time=00:00:05:00,abc"],
         "the sweep's job with +trainer.max_time=abc: trainer.max_time must be DD:HH:MM:SS, e.g. "),
        # A new-user check: the metrics a monitor names were checked only as their job started.
        (["+early_stopping.monitor=val/loss,val/accc"],
         "the sweep's job with +early_stopping.monitor=val/accc: early_stopping.monitor='val/accc': "),
        (["+early_stopping.monitor=val/loss,val/acc", "+early_stopping.mode=min"],
         "the sweep's job with +early_stopping.monitor=val/acc: early_stopping.monitor=val/acc with "),
        (["data.monitor=val/acc,val/accc"],
         "the sweep's job with data.monitor=val/accc: data.monitor='val/accc': monitor one of the metrics"),
    ],
)  # fmt: skip
def test_a_sweeps_bad_value_is_refused_before_any_job_runs(argv, message):
    """A carried new-user note: in ``-m optim.lr=1e-3,abc`` the bad value was found only when its job
    started, after job 0 had trained (and Hydra's basic launcher then dropped the jobs after it)."""
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_command_line(["-m", *argv], "train", **TRAIN_CHECK)
    # Without -m the same values are Hydra's sweep syntax refused as such, before any job check.
    with pytest.raises(ValueError, match="gives several values, a sweep: add -m"):
        check_command_line(argv, "train", **TRAIN_CHECK)


def test_sweep_jobs_checked_cover_every_value():
    overrides = OverridesParser.create().parse_overrides(["a=1,2", "c=5", "b=x,'y,z'"])
    values = _sweep_values(overrides)
    assert values == {0: ["1", "2"], 2: ["x", "'y,z'"]}  # as Hydra's basic sweeper writes them
    jobs = [{0: "1", 2: "x"}, {0: "1", 2: "'y,z'"}, {0: "2", 2: "x"}, {0: "2", 2: "'y,z'"}]
    assert _sweep_jobs(values) == jobs
    assert _job_overrides(overrides, {0: "2", 2: "x"}) == ["a=2", "c=5", "b=x"]
    many = {0: [str(v) for v in range(9)], 1: [str(v) for v in range(9)]}
    jobs = _sweep_jobs(many)  # 81 > MAX_SWEEP_JOBS_CHECKED: each value once, the others at their first
    assert len(jobs) == 17 and jobs[0] == {0: "0", 1: "0"} and jobs[8] == {0: "8", 1: "0"}
    assert jobs[16] == {0: "0", 1: "8"}
    assert _sweep_values(OverridesParser.create().parse_overrides(["a=range(0,3)"])) == {0: ["0", "1", "2"]}
    # A group's glob, as Hydra's sweeper expands it (was left to Hydra: its jobs went unchecked).
    assert _sweep_values(OverridesParser.create().parse_overrides(["mixer=glob(*,exclude=hybrid*)"])) == {
        0: ["attention", "linear_attention", "mamba", "sliding_window"]
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["++seed=5", "+trainer.max_time=00:01:00:00", "hydra.run.dir=/tmp/x", "model.d_model=64"],
        ["mixer=hybrid_jamba", "model=small", "mixer.settings.mamba.d_state=8", "early_stopping=null"],
        ["experiment=zoology_mqar", "trainer.max_steps=5", "data.seqlen=64"],  # the experiment's keys
        ["-m", "mixer=attention,mamba", "++mixer.settings.attention.pos_emb=learned", "optim.lr=1e-3,3e-3"],
        ["-m", "mixer=glob(*)", "trainer.max_steps=3"],  # a glob, expanded as Hydra's sweeper does
        # Valid sweeps a fresh-clone check saw refused or crash: a '+' key that Hydra's sweep subdir
        # reads, and quoted string values.
        ["-m", "+tag=a,b", "hydra.sweep.subdir=${tag}"],
        ["-m", "logger.wandb.project='x','y'"],
        ["-m", "logger.wandb.project='a,b',c"],
        ["-m", "+trainer.max_time=00:00:05:00,{minutes:5}"],
        ["--cfg", "job", "data=text", "data.path=x.txt", "+tag=a", "hydra.job.name=${tag}"],
        ["hydra.run.dir=/tmp/x", "+hydra.job.env_set.FOO=1", "hydra.job.env_set={}", "hydra.verbose=true"],
        ["-m", "run_dir=${hydra:runtime.output_dir}", "seed=1,2"],  # run_dir as the config has it
        ["-m", "run_dir=${hydra:sweep.dir}/${hydra:sweep.subdir}", "seed=1,2"],  # the job's folder too
        ["-m", "optim.lr=1e-3"],  # one job, checked
    ],
)
def test_command_lines_hydra_composes_pass_the_check(argv):
    check_command_line(argv, "train", **TRAIN_CHECK)


@pytest.mark.parametrize(
    "given,meant",
    [
        ("lr", "optim.lr"),  # a group's key at the top level
        ("d_model", "model.d_model"),
        ("dmodel", "model.d_model"),  # the same letters without the underscore
        ("max_step", "trainer.max_steps"),  # a near name below the top level
        ("data_seed", "data.seed"),  # the path with _ for its dot
        ("name", "data.name or mixer.name or model.name"),  # ties, up to three
        ("max_time", "trainer.max_time"),  # Lightning's Trainer argument, not in conf/trainer/*.yaml
        ("patience", "early_stopping.patience"),  # EarlyStopping's (early_stopping is null)
        ("device", "trainer=cpu or trainer=gpu"),  # a hint: trainer.devices is something else
    ],
)
def test_a_misplaced_setting_is_named_where_it_belongs(tmp_path, given, meant):
    message = f"unknown setting '{given}' (did you mean {meant}?): conf/train.yaml"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        train_module.train(compose_train([f"run_dir={tmp_path}", f"+{given}=1"]))
    assert list(tmp_path.iterdir()) == []


def test_no_guess_for_a_key_unlike_every_setting(tmp_path):
    # d_state is the Mamba mixer's; the attention mixer has none of that name (strategy is not it).
    with pytest.raises(ValueError, match=re.escape("unknown setting 'd_state': conf/train.yaml")):
        train_module.train(compose_train([f"run_dir={tmp_path}", "+d_state=8"]))
    with pytest.raises(ValueError, match=re.escape("'d_state' (did you mean mixer.settings.mamba.d_state?)")):
        train_module.train(compose_train([f"run_dir={tmp_path}", "mixer=mamba", "+d_state=8"]))


def test_a_key_that_an_interpolation_reads_is_kept(tmp_path):
    # +tag=x read by ${tag} elsewhere in the config, or in Hydra's run dir (a real command line): the
    # check lets it through, and the next check refuses the bad max_steps instead.
    with pytest.raises(TypeError, match="trainer.max_steps"):
        train_module.train(compose_train(["+tag=abc", f"run_dir={tmp_path}/${{tag}}", "trainer.max_steps=x"]))
    with pytest.raises(TypeError, match="trainer.max_steps"):
        train_module.train(
            compose_train(["+tag=abc", f"run_dir={tmp_path}/${{oc.select:tag,none}}", "trainer.max_steps=x"])
        )
    # A resolver's name is no key: ${now:...} in Hydra's run dir does not make +now a setting.
    with pytest.raises(ValueError, match=re.escape("unknown setting 'now'")):
        train_module.train(compose_train(["+now=1", f"run_dir={tmp_path}/${{now:%H}}"]))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "+tag=abc", f"hydra.run.dir={tmp_path}/runs/${{tag}}",
         "trainer.max_steps=x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "trainer.max_steps" in proc.stderr
    assert "unknown setting" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # the refused run's folder is undone
    # Hydra's folder named by the command line's overrides reads every key given there.
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "+tag=abc",
         f"hydra.run.dir={tmp_path}/runs/${{hydra.job.override_dirname}}", "trainer.max_steps=x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "trainer.max_steps" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_signal_handlers_swap_and_restore(sigint_restored, monkeypatch):
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with signal_handlers((signal.SIGTERM, signal.SIGINT), mine):
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is not mine
    # A handler set outside Python (getsignal gives None) could not be put back: it is left alone.
    real_getsignal = signal.getsignal
    monkeypatch.setattr(
        signal, "getsignal", lambda sig: None if sig == signal.SIGTERM else real_getsignal(sig)
    )
    with signal_handlers((signal.SIGTERM,), mine):
        assert real_getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.undo()
    # Outside the main thread nothing is set (Python would raise).
    seen = []
    worker = threading.Thread(
        target=lambda: seen.append(signal_handlers((signal.SIGTERM,), mine).__enter__())
    )
    worker.start()
    worker.join()
    assert seen == [None] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_an_online_wandb_run_refused_after_an_evaluation_is_a_warning(tmp_path, monkeypatch, capsys):
    # The records are written before they are logged: W&B refusing an online run (no API key) is a
    # warning naming the fixes, not a traceback after the evaluation.
    pytest.importorskip("wandb")
    without_wandb_key(monkeypatch, tmp_path)
    log_records_to_wandb(
        [{"acc": 1.0}], enabled=True, project="p", name="n", mode="online", save_dir=tmp_path, table="recall"
    )
    err = capsys.readouterr().err
    assert "warning: W&B could not start an online run (" in err and "API key" in err
    assert "or log offline with wandb.mode=offline" in err and "the records were written as JSON only" in err


def test_an_evaluation_refuses_a_wandb_key_it_does_not_pass_on(tmp_path):
    message = "unknown wandb keys ['entity']; valid keys: ['enabled', 'mode', 'project'] (mixerlab passes no"
    with pytest.raises(ValueError, match=re.escape(message)):
        recall_eval(compose_eval("recall", [f"ckpt={tmp_path / 'missing.ckpt'}", "+wandb.entity=team"]))
    assert list(tmp_path.iterdir()) == []


def test_every_experiment_and_mixer_passes_the_settings_check():
    experiments = sorted(path.stem for path in (REPO_ROOT / "conf" / "experiment").glob("*.yaml"))
    mixers = sorted(path.stem for path in (REPO_ROOT / "conf" / "mixer").glob("*.yaml"))
    assert len(experiments) >= 3 and len(mixers) >= 8
    for experiment in experiments:
        check_known_settings(compose_train([f"experiment={experiment}"]), "train")
    for mixer in mixers:
        check_known_settings(compose_train([f"mixer={mixer}"]), "train")
        check_known_settings(compose_decode([f"mixer={mixer}", "model=small"]), "eval/decode")


def test_the_settings_of_a_config_are_its_keys_and_groups():
    assert config_settings("train") == {
        "model", "mixer", "data", "trainer", "logger", "experiment", "seed", "run_dir", "optim", "resume",
        "early_stopping",
    }  # fmt: skip
    assert {"model", "mixer", "context_lengths", "wandb"} <= config_settings("eval/decode")
    assert not {"hydra", "defaults", "_self_"} & config_settings("eval/decode")

"""training.sweep_stop: a stopped joblib sweep waits for its running jobs (train.py's whole path is
tests/test_train.py::test_a_stopped_joblib_sweep_lets_its_running_jobs_save)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import joblib
import pytest
from joblib.parallel import BACKENDS

import training.sweep_stop
from training.sweep_stop import (
    STOP_CHECK_INTERVAL_S,
    STOP_ENV,
    GracefulLokyBackend,
    StopWhenSweepStops,
    graceful_joblib_sweeps,
    stop_requested,
)


def test_stop_requested_reads_the_stop_file(tmp_path, monkeypatch):
    monkeypatch.delenv(STOP_ENV, raising=False)
    assert not stop_requested()
    stop = tmp_path / "stop"
    monkeypatch.setenv(STOP_ENV, str(stop))
    assert not stop_requested()
    callback = StopWhenSweepStops()
    callback.on_train_batch_start(None, None, None, 0)  # no stop file: training goes on
    stop.touch()
    assert stop_requested()
    with pytest.raises(KeyboardInterrupt, match="the sweep was stopped"):
        callback.on_train_batch_start(None, None, None, 0)


def test_a_running_job_looks_for_the_stop_file_about_once_a_second(tmp_path, monkeypatch):
    # It stat'ed the stop file at every batch: thousands a second for a small model.
    stop = tmp_path / "stop"
    monkeypatch.setenv(STOP_ENV, str(stop))
    now = [100.0]  # time.monotonic(), advanced by hand
    monkeypatch.setattr(training.sweep_stop, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    real_stat, looks = os.stat, []

    def counted_stat(path, *args, **kwargs):
        looks.extend([now[0]] if os.fspath(path) == str(stop) else [])
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    callback = StopWhenSweepStops()
    for batch_idx in range(1, 3001):  # 3 s of 1 ms batches, within an epoch
        callback.on_train_batch_start(None, None, None, batch_idx)
        now[0] += 0.001
    assert looks[0] == 100.0 and 3 <= len(looks) <= 4  # the first batch, then once a second
    assert all(b - a >= STOP_CHECK_INTERVAL_S for a, b in zip(looks, looks[1:], strict=False))
    callback.on_train_batch_start(None, None, None, 0)  # an epoch's first batch looks
    assert looks[-1] == now[0]
    # A stop is still noticed within a second; with batches longer than that, at the next batch.
    stop.touch()
    stopped_at = now[0]
    with pytest.raises(KeyboardInterrupt, match="the sweep was stopped"):
        for batch_idx in range(1, 2000):
            now[0] += 0.001
            callback.on_train_batch_start(None, None, None, batch_idx)
    assert now[0] - stopped_at <= STOP_CHECK_INTERVAL_S + 0.001
    stop.unlink()
    callback.on_train_batch_start(None, None, None, 0)
    stop.touch()
    now[0] += 5.0
    with pytest.raises(KeyboardInterrupt, match="the sweep was stopped"):
        callback.on_train_batch_start(None, None, None, 1)


def test_graceful_joblib_sweeps_puts_everything_back(monkeypatch):
    monkeypatch.delenv(STOP_ENV, raising=False)
    before = BACKENDS["loky"]
    with graceful_joblib_sweeps():
        assert BACKENDS["loky"] is GracefulLokyBackend
        # No stop file's folder before a pool is made: a run that makes none (a DDP run stopped by
        # SIGTERM leaves by os._exit) leaves no empty folder behind.
        assert STOP_ENV not in os.environ
        GracefulLokyBackend()
        folder = Path(os.environ[STOP_ENV]).parent
        assert folder.is_dir() and not stop_requested()
        GracefulLokyBackend()  # a second pool of the same sweep shares the stop file
        assert Path(os.environ[STOP_ENV]).parent == folder
    assert BACKENDS["loky"] is before and STOP_ENV not in os.environ and not folder.exists()


def _job(kind: str, out: str) -> str:
    """A sweep job: "fail" raises at once; "train" works until the sweep stops, then saves."""
    if kind == "fail":
        raise ValueError("a refused job")
    while not stop_requested():
        time.sleep(0.01)
    Path(out).write_text("saved")
    return out


def _pid() -> int:
    return os.getpid()


def _pid_beside_another(folder: str) -> int:
    """This worker's pid, once another job has written its own beside it: two such jobs run at the
    same time, so on two workers (a pool of two may otherwise run every quick job on one)."""
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(Path(folder).iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def test_an_aborted_sweep_waits_for_its_running_jobs(tmp_path):
    # Before: joblib SIGKILLed the workers as soon as one job failed, cutting the others' saves.
    saved = tmp_path / "saved"
    with graceful_joblib_sweeps():
        with pytest.raises(ValueError, match="a refused job"):
            joblib.Parallel(n_jobs=2, backend="loky")(
                joblib.delayed(_job)(kind, str(saved)) for kind in ("train", "fail")
            )
    assert saved.read_text() == "saved"


def test_idle_workers_init_sweep_worker(tmp_path):
    # A signal to the process group (a terminal's Ctrl+C) killed an idle loky worker, which broke
    # the pool; the sweep's own process passes the stop on through the stop file instead.
    with graceful_joblib_sweeps():
        with joblib.Parallel(n_jobs=2, backend="loky") as parallel:
            # Both workers' pids (4 quick jobs once ran on one worker of a loaded machine, and the
            # second call's other worker then looked like a replacement).
            pids = set(parallel(joblib.delayed(_pid_beside_another)(str(tmp_path)) for _ in range(2)))
            assert len(pids) == 2
            for pid in pids:
                os.kill(pid, signal.SIGINT)
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.5)
            assert set(parallel(joblib.delayed(_pid)() for _ in range(4))) <= pids


def test_an_orphaned_worker_ends_on_sigterm(tmp_path):
    """A new-user check: after the sweep's process was SIGKILLed, its workers ignored SIGTERM, so
    ``kill -- -<group>`` left them running. The worker here is started by a process that then exits."""
    worker = (
        "import time\nfrom training.sweep_stop import init_sweep_worker\ninit_sweep_worker()\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    for orphaned in (False, True):
        starter = (
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE, text=True)\n"
            "p.stdout.readline()\nprint(p.pid, flush=True)\n" + ("" if orphaned else "time.sleep(60)\n")
        )
        root = Path(__file__).resolve().parents[1]
        proc = subprocess.Popen([sys.executable, "-c", starter], cwd=root, stdout=subprocess.PIPE, text=True)
        pid = int(proc.stdout.readline())
        if orphaned:
            proc.wait(timeout=30)
        os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
        alive = Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert alive is not orphaned
        if not orphaned:
            os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()

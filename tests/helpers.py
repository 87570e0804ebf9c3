"""Shared test helpers: composing the shipped Hydra configs; reading a run's CSV metrics; a mixer run
against forced reference ops; the GPU marker, dtype ids and forced autotune configs of the kernel tests;
stand-ins for Triton's compiled kernels that let the decode steps' replayed launches run on CPU; a
W&B setup without an API key."""

from __future__ import annotations

import contextlib
import csv
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
MIXER_CONFIGS = sorted(p.stem for p in (CONF_DIR / "mixer").glob("*.yaml"))
SHAKESPEARE = REPO_ROOT.parent / "shared" / "data" / "tiny_shakespeare.txt"

# The GPU suite's tests also carry this skip, so `pytest -m gpu` on a machine without CUDA skips them.
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dtype_id(dtype: torch.dtype) -> str:
    """Test id of a dtype: ``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def without_wandb_key(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """No W&B API key anywhere for the test: none in the environment, no netrc (``home`` as HOME and
    an absent NETRC file), no W&B settings folder; W&B's mode left to the caller."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("NETRC", str(home / "netrc"))


@contextlib.contextmanager
def forced_config(tuners: Sequence, index: int) -> Iterator[None]:
    """Each Triton autotuner in ``tuners`` restricted to its ``index``-th config (the last one if it
    has fewer), with its autotune cache emptied; restored on exit. A single config skips autotuning."""
    saved = []
    try:
        for tuner in tuners:
            saved.append((tuner, tuner.configs, tuner.cache))
            tuner.configs = [tuner.configs[min(index, len(tuner.configs) - 1)]]
            tuner.cache = {}
        yield
    finally:
        for tuner, configs, cache in saved:
            tuner.configs, tuner.cache = configs, cache


def compose_train(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py ...`` would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def compose_eval(name: str, overrides: list[str]) -> DictConfig:
    """``conf/eval/<name>.yaml`` composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(CONF_DIR / "eval"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def metrics_rows(run_dir: str) -> list[dict[str, str]]:
    """The rows of a run's CSV log, ``<run_dir>/csv/metrics.csv``: one dict per logged step."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def mixer_runs_with_reference_ops(monkeypatch, mixer, x, ops, cache_fields, prefill):
    """Run ``mixer`` on x (B, T, d_model) twice: with the kernel ops as the mixer dispatches them
    (backend=None: the Triton kernels on CUDA), then with ``ops`` (names in :mod:`kernels`) forced
    to backend="reference". Each run gives (y, every parameter's gradient of mean(y^2), the output
    of a ``prefill``-token prefill plus token-by-token decode, the cache's ``cache_fields``), as
    float tensors. Used by the GPU tests that check a mixer on our kernels against the references.
    """
    import kernels

    batch, seqlen = x.shape[:2]
    results = []
    for backend in ("triton", "reference"):
        if backend == "reference":
            for op in ops:
                monkeypatch.setattr(kernels, op, functools.partial(getattr(kernels, op), backend="reference"))
        mixer.zero_grad()
        y = mixer(x)
        y.float().square().mean().backward()
        with torch.no_grad():
            cache = mixer.allocate_cache(batch, seqlen)
            decoded = [mixer(x[:, :prefill], cache=cache)] + [
                mixer(x[:, t : t + 1], cache=cache) for t in range(prefill, seqlen)
            ]
        grads = [p.grad.float().clone() for p in mixer.parameters()]
        fields = [getattr(cache, name).clone() for name in cache_fields]
        results.append((y.float(), grads, torch.cat(decoded, 1).float(), *fields))
    return results


def refuse_files_in(monkeypatch, directory: Path) -> None:
    """Make creating a file in ``directory`` fail as on read-only storage, for the output checks
    (:func:`eval.records.check_writable_dir`): chmod does not stop root, which CI may run as."""
    import eval.records as records_module

    real = records_module.tempfile.mkstemp
    target = Path(directory).resolve()

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == target:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(records_module.tempfile, "mkstemp", mkstemp)


class KernelParams:
    """A stand-in for a ``triton.jit`` function as ``kernels._host.CompiledLaunch`` reads it: its
    parameters, in order, by name."""

    def __init__(self, names: Sequence[str]) -> None:
        self.params = [SimpleNamespace(name=name) for name in names]


class RecordingCompiled:
    """A stand-in for the ``CompiledKernel`` an ordinary launch returns (the interpreter returns
    none): records what a replay hands the launcher, then launches ``kernel`` with the parameters
    it got (``args[:3]`` the grid, ``args[9:]`` the kernel's arguments), under the interpreter."""

    function, packed_metadata = "function", "packed"

    def __init__(self, kernel, options: dict) -> None:
        self.kernel, self.options, self.calls = kernel, options, []

    def run(self, *args) -> None:
        self.calls.append(args)
        self.kernel[args[:3]](*args[9:], **self.options)


def record_step_plans(monkeypatch, module) -> list:
    """Let ``module``'s decode step (``module._STEP_PLANS``, ``module.CompiledLaunch``) store plans
    for CPU calls too, each replayed through a :class:`RecordingCompiled`; returns the list the builds
    are appended to, as (recording, args, kwargs) of the ordinary launch each was built from. The
    caller clears ``module._STEP_PLANS`` afterwards."""
    from kernels import _host

    builds = []

    def build(kernel, compiled, grid, args, kwargs, num_tensors):
        recording = RecordingCompiled(kernel, {name: kwargs[name] for name in ("num_warps",) if name in kwargs})
        builds.append((recording, args, kwargs))
        return _host.CompiledLaunch.build(KernelParams(kernel.arg_names), recording, grid, args, kwargs, num_tensors)

    monkeypatch.setattr(module, "CompiledLaunch", SimpleNamespace(build=build))
    monkeypatch.setattr(module._STEP_PLANS, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(_host, "driver", SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda d: 0)))
    module._STEP_PLANS.clear()
    return builds


def same_layout(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``t`` (None stays None) with the same strides and 16-byte alignment, so with the same
    plan key and the same specialization of a Triton kernel (the replayed decode steps' tests)."""
    if t is None:
        return None
    size = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    offset = t.data_ptr() % 16 // t.element_size()  # fresh allocations are 16-byte aligned
    return torch.empty(offset + size, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride(), offset).copy_(t)

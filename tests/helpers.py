"""Shared test helpers: composing the shipped Hydra configs; a mixer run against forced reference ops."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
MIXER_CONFIGS = sorted(p.stem for p in (CONF_DIR / "mixer").glob("*.yaml"))
SHAKESPEARE = REPO_ROOT.parent / "shared" / "data" / "tiny_shakespeare.txt"


def compose_train(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py ...`` would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def compose_eval(name: str, overrides: list[str]) -> DictConfig:
    """``conf/eval/<name>.yaml`` composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(CONF_DIR / "eval"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


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

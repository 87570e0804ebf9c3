"""Shared test helpers: composing the shipped Hydra configs."""

from __future__ import annotations

from pathlib import Path

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

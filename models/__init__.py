"""The language model, its config and layouts, generation and the LightningModule."""

from models.config import ModelConfig, SharedBlockConfig, expand_layout
from models.model import LanguageModel, ModelCache

__all__ = ["LanguageModel", "ModelCache", "ModelConfig", "SharedBlockConfig", "expand_layout"]

"""Datasets as LightningDataModules: the MQAR recall task (:mod:`data.mqar`) and text corpora
(:mod:`data.text`). Depends only on torch, numpy, lightning and datasets.

Every data module yields batches ``{"input_ids": (B, T) int64, "labels": (B, T) int64,
"slice": list[str]}`` where ``labels`` is -100 (``IGNORE_INDEX``) at positions without loss, and
exposes ``vocab_size`` (after ``setup()`` for text) and ``slice_names``.
"""

from data.mqar import (
    IGNORE_INDEX,
    SEED_STRIDE,
    MQARDataModule,
    MQARSlice,
    check_mqar_config,
    multiquery_ar,
    parse_slice_name,
    slice_name,
)
from data.text import (
    BlockSampler,
    ByteTokenizer,
    CharTokenizer,
    TextDataModule,
    TokenWindows,
    tokenizer_from_config,
)

DATAMODULES = {"mqar": MQARDataModule, "text": TextDataModule}


def build_datamodule(name: str, **kwargs):
    """Construct the data module registered under ``name`` ("mqar" or "text") with ``kwargs``.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones).
    """
    if name not in DATAMODULES:
        raise ValueError(f"unknown data module {name!r}; choose one of {sorted(DATAMODULES)}")
    return DATAMODULES[name](**kwargs)


__all__ = [
    "DATAMODULES",
    "IGNORE_INDEX",
    "SEED_STRIDE",
    "BlockSampler",
    "ByteTokenizer",
    "CharTokenizer",
    "MQARDataModule",
    "MQARSlice",
    "TextDataModule",
    "TokenWindows",
    "build_datamodule",
    "check_mqar_config",
    "multiquery_ar",
    "parse_slice_name",
    "slice_name",
    "tokenizer_from_config",
]

"""Datasets as LightningDataModules: the MQAR recall task (:mod:`data.mqar`), text corpora
(:mod:`data.text`) and the synthetic evaluation tasks -- copying (:mod:`data.copying`), selective
copying (:mod:`data.selective_copying`), induction heads (:mod:`data.induction`), passkey and
multi-key needle retrieval (:mod:`data.retrieval`), built on :mod:`data.synthetic`. Their training
loaders are a stream of shuffled passes that a resumed fit continues mid-epoch (:mod:`data.resumable`).
Depends only on torch, numpy, lightning and datasets.

Every data module yields batches ``{"input_ids": (B, T) int64, "labels": (B, T) int64,
"slice": list[str]}`` (the synthetic tasks add per-example extras such as ``prompt_len``) where
``labels`` is -100 (``IGNORE_INDEX``) at positions without loss, and exposes ``vocab_size`` (after
``setup()`` for text) and ``slice_names``.
"""

import inspect

from data.copying import CopyDataModule, char_accuracy, copy_examples, string_exact_match
from data.induction import InductionHeadsDataModule, induction_heads
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
from data.retrieval import (
    MultiKeyNeedleDataModule,
    PasskeyDataModule,
    multikey_needle_examples,
    passkey_examples,
)
from data.selective_copying import SelectiveCopyingDataModule, selective_copying
from data.synthetic import (
    SyntheticDataModule,
    TaskSlice,
    exact_match,
    generated_to_predictions,
    token_accuracy,
)
from data.text import (
    BlockSampler,
    ByteTokenizer,
    CharTokenizer,
    TextDataModule,
    TokenWindows,
    UnknownCharacterError,
    tokenizer_from_config,
)

DATAMODULES = {
    "mqar": MQARDataModule,
    "text": TextDataModule,
    "copy": CopyDataModule,
    "selective_copying": SelectiveCopyingDataModule,
    "induction_heads": InductionHeadsDataModule,
    "passkey": PasskeyDataModule,
    "multikey_needle": MultiKeyNeedleDataModule,
}


def build_datamodule(name: str, **kwargs):
    """Construct the data module registered under ``name`` (a key of ``DATAMODULES``, which is
    also the ``name`` of its ``conf/data/<name>.yaml``) with ``kwargs``.

    Raises:
        ValueError: unknown ``name``, or a key of ``kwargs`` that the module does not take
            (``+data.foo=1``); the message lists the known ones.
    """
    if name not in DATAMODULES:
        raise ValueError(f"unknown data module {name!r}; choose one of {sorted(DATAMODULES)}")
    module = DATAMODULES[name]
    valid = inspect.signature(module).parameters
    unknown = sorted(set(kwargs) - set(valid))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in valid.values()):
        raise ValueError(f"unknown data keys {unknown} for data={name}; valid keys: {sorted(valid)}")
    return module(**kwargs)


__all__ = [
    "DATAMODULES",
    "IGNORE_INDEX",
    "SEED_STRIDE",
    "BlockSampler",
    "ByteTokenizer",
    "CharTokenizer",
    "CopyDataModule",
    "InductionHeadsDataModule",
    "MQARDataModule",
    "MQARSlice",
    "MultiKeyNeedleDataModule",
    "PasskeyDataModule",
    "SelectiveCopyingDataModule",
    "SyntheticDataModule",
    "TaskSlice",
    "TextDataModule",
    "TokenWindows",
    "UnknownCharacterError",
    "build_datamodule",
    "char_accuracy",
    "check_mqar_config",
    "copy_examples",
    "exact_match",
    "generated_to_predictions",
    "induction_heads",
    "multikey_needle_examples",
    "multiquery_ar",
    "parse_slice_name",
    "passkey_examples",
    "selective_copying",
    "slice_name",
    "string_exact_match",
    "token_accuracy",
    "tokenizer_from_config",
]

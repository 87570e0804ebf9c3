"""Associative-recall evaluation of a trained checkpoint: ``python eval/recall.py ckpt=PATH``.

Rebuilds the model from the checkpoint alone, then measures MQAR accuracy (Arora et al. 2024,
"Zoology", Sec. 3) at the training seqlen and at longer ones (2x and 4x by default, with
proportionally more key-value pairs), twice per slice:

- ``parallel``: one forward over the whole sequence (training's path);
- ``decode``: the key-value context prefilled into the caches, then every further token fed one
  at a time through the decode kernels (generation's path).

The two must agree (they compute the same function); a gap is a bug in a cache or decode kernel.
Prints a table per slice, writes result records next to the checkpoint
(``<checkpoint>.recall.json``) and logs them to W&B when ``wandb.enabled=true``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.mqar import MQARDataModule
from eval.cli import user_errors
from eval.records import git_sha, log_records_to_wandb, make_record, write_records
from models.lit import load_model

DATA_META_KEYS = ("name", "monitor", "monitor_mode")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``/``cuda`` as given.

    Raises:
        ValueError: unknown name, or ``cuda`` without a GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device=cuda was asked for but no CUDA GPU is available; use device=auto or device=cpu"
        )
    return torch.device(name)


@torch.no_grad()
def accuracy(model, loader, path: str, prefill_len: int, device: torch.device) -> tuple[float, int, float]:
    """Accuracy at the scored (query) positions of every batch of ``loader``.

    Args:
        model: a :class:`models.LanguageModel` in eval mode.
        loader: batches ``{"input_ids", "labels"}`` of ``(B, T)`` int64.
        path: ``"parallel"`` or ``"decode"`` (prefill ``prefill_len`` tokens, then step).
        prefill_len: the context prefilled on the decode path (the key-value pairs).
        device: where to run.

    Returns:
        ``(accuracy in [0, 1], scored positions, tokens/s processed)``.
    """
    correct, count, tokens, seconds = 0, 0, 0, 0.0
    for batch in loader:
        input_ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        start = time.perf_counter()
        if path == "parallel":
            logits = model(input_ids)
        else:
            logits = model.decode_logits(input_ids, prefill_len)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        scored = labels != -100
        correct += int((logits.argmax(-1) == labels)[scored].sum())
        count += int(scored.sum())
        tokens += input_ids.numel()
    return correct / max(count, 1), count, tokens / max(seconds, 1e-9)


def recall_eval(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run the evaluation that ``cfg`` (``conf/eval/recall.yaml``) describes; returns the records.

    Raises:
        FileNotFoundError: missing checkpoint.
        ValueError: corrupt checkpoint, a checkpoint not trained on MQAR, or invalid settings
            (unknown decode path, a longer slice that the vocabulary cannot hold).
    """
    unknown_paths = set(cfg.decode_paths) - {"parallel", "decode"}
    if unknown_paths:
        raise ValueError(f"unknown decode_paths {sorted(unknown_paths)}; choose from [parallel, decode]")
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ValueError("no checkpoint given: pass ckpt=<a .ckpt file written by train.py>")
    for key in ("num_examples", "batch_size"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    if not cfg.length_multipliers or any(not isinstance(m, int) or m < 1 for m in cfg.length_multipliers):
        raise ValueError(
            f"length_multipliers must be a list of integers >= 1, got {list(cfg.length_multipliers)}"
        )
    device = resolve_device(cfg.device)
    ckpt = Path(cfg.ckpt).expanduser()
    lit = load_model(ckpt, map_location=device)
    model = lit.model
    data_cfg = dict(lit.hparams.data or {})
    if data_cfg.get("name") != "mqar":
        raise ValueError(
            f"{ckpt} was trained on {data_cfg.get('name')!r} data; eval/recall.py evaluates models trained on "
            "MQAR (python train.py data=mqar ...)"
        )
    seqlen, num_kv_pairs = int(data_cfg["seqlen"]), int(data_cfg["num_kv_pairs"])
    vocab_size = int(data_cfg["vocab_size"])
    too_long = [m for m in cfg.length_multipliers if seqlen * m >= vocab_size]
    if too_long:
        raise ValueError(
            f"length_multipliers {too_long} give seqlens of at least the checkpoint's MQAR vocabulary "
            f"({vocab_size}), which the generator cannot fill with distinct keys; use multipliers "
            f"below {-(-vocab_size // seqlen)} (e.g. length_multipliers=[1,2,4])"
        )
    test_configs = [{"seqlen": seqlen * m, "num_kv_pairs": num_kv_pairs * m} for m in cfg.length_multipliers]
    dm_kwargs = {k: v for k, v in data_cfg.items() if k not in DATA_META_KEYS}
    dm_kwargs.update(
        test_configs=test_configs, num_test_examples=int(cfg.num_examples), batch_size=int(cfg.batch_size)
    )
    dm = MQARDataModule(**dm_kwargs)
    dm.setup("test")

    # train.py writes <run_dir>/checkpoints/<name>.ckpt: records and W&B runs belong to that run.
    run_dir = ckpt.resolve().parent.parent
    sha, run = git_sha(), run_dir.name
    records, rows = [], []
    for loader, slice_name, test in zip(dm.test_dataloader(), dm.slice_names, test_configs, strict=True):
        prefill_len = 2 * test["num_kv_pairs"]
        row = {"slice": slice_name}
        for path in cfg.decode_paths:
            print(f"evaluating {slice_name} through the {path} path ...", flush=True)
            acc, count, tokens_per_s = accuracy(model, loader, path, prefill_len, device)
            row[path] = acc
            records.append(
                make_record(
                    run=run,
                    model=model,
                    task="mqar",
                    metric="accuracy",
                    value=acc,
                    seqlen=test["seqlen"],
                    tokens_per_s=tokens_per_s,
                    device=device,
                    sha=sha,
                    slice=slice_name,
                    path=path,
                    num_kv_pairs=test["num_kv_pairs"],
                    scored_positions=count,
                    checkpoint=str(ckpt.resolve()),
                    split="test",
                )
            )
        rows.append(row)

    _print_table(model.config.name, rows, list(cfg.decode_paths))
    output = Path(cfg.output) if cfg.output else ckpt.with_name(ckpt.name + ".recall.json")
    write_records(output, records)
    print(f"results: {output}")
    log_records_to_wandb(
        records,
        enabled=bool(cfg.wandb.enabled),
        project=cfg.wandb.project,
        name=f"recall-{run}",
        mode=cfg.wandb.mode,
        save_dir=run_dir,
        table="recall",
    )
    return records


def _print_table(mixer: str, rows: list[dict[str, Any]], paths: list[str]) -> None:
    header = f"{'slice':<14}" + "".join(f"{p:>10}" for p in paths)
    if len(paths) == 2:
        header += f"{'|diff| pt':>11}"
    print(f"MQAR recall accuracy ({mixer})")
    print(header)
    for row in rows:
        line = f"{row['slice']:<14}" + "".join(f"{row[p]:>10.4f}" for p in paths)
        if len(paths) == 2:
            line += f"{100 * abs(row[paths[0]] - row[paths[1]]):>11.2f}"
        print(line)


@hydra.main(version_base="1.3", config_path="../conf/eval", config_name="recall")
def main(cfg: DictConfig) -> None:
    """Command-line entry point (Hydra)."""
    torch.set_flush_denormal(True)
    OmegaConf.set_readonly(cfg, True)
    with user_errors():
        recall_eval(cfg)


if __name__ == "__main__":
    main()

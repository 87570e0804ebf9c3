"""Training parity: a model trained on mixerlab's Triton kernels against the same model trained on the
PyTorch references, loss curve by loss curve.

    # the recorded H200 run (benchmarks/results/2026-12-01-nvidia-h200-train-parity.json):
    python benchmarks/train_parity.py mixer=mamba model.d_model=256 model.n_layers=4 data=text \
        data.path=.../tiny_shakespeare.txt data.seqlen=256 data.batch_size=32 trainer=gpu
    python benchmarks/train_parity.py --steps 50 trainer=gpu          # mamba on the default MQAR task
    # CPU smoke run (the Triton interpreter: tiny sizes only)
    python benchmarks/train_parity.py --steps 3 --out-dir /tmp/tp model.n_layers=1 model.d_model=16 \
        data.seqlen=16 data.num_kv_pairs=2 data.batch_size=2

What is compared: ``train.train(cfg)`` run twice on one composed config (``conf/train.yaml`` with
``mixer=mamba`` unless an override names another mixer, then the command line's Hydra overrides), so
both runs start from the same seed, initial weights and batches. In the first run ("ours") every op
of the ``kernels`` package is forced to ``backend="triton"``; in the second ("reference") to
``backend="reference"``. The mixers call the ops as attributes of the ``kernels`` module
(``kernels.selective_scan(...)``), so each op is forced by swapping that attribute for
``functools.partial(op, backend=...)`` for the length of the run (:func:`forced_backend`). On a
machine without CUDA, "triton" is the Triton interpreter (``TRITON_INTERPRET=1``, set here before
any kernel module is imported, as tests/conftest.py does): slow, for tiny smoke runs only.

How: each run trains ``--steps`` optimizer steps (default 200) with ``trainer.max_steps`` set to it,
``trainer.log_every_n_steps=1``, one batch per validation slice (``trainer.limit_val_batches=1``:
validation is not compared), the CSV logger on and W&B off, in its own run directory (under
``--runs-dir`` if given, else a temporary folder removed at exit; checkpoints included). Its
per-step ``train/loss`` is read back from ``<run_dir>/csv/metrics.csv``, the curves are aligned
on Lightning's logged step (0-based), and each step's relative gap is ``|ours - ref| / |ref|``.
The printed table samples the curves about every ``--steps / 10`` steps, plus the last step and the
step of the largest gap.

Targets (the issue's): training a ``mamba`` model on the GPU with our kernels follows the reference
path's loss curve over the first 200 steps, same seed and data: the largest relative gap between
the curves at most 5%, the final loss (the last step's) within 2%. Run-to-run non-determinism of
either path on the GPU (reductions whose order varies) counts against these budgets too.

Writes the overrides, both curves, the gaps, the targets and whether each is met, each run's wall
time (ours' includes Triton's compilation and autotuning), the versions and the device to
``benchmarks/results/<date>-<gpu>-train-parity.json`` (``cpu`` in place of the GPU on a machine
without one; ``--out-dir`` picks the folder). Exits 0 when both targets are met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# The interpreter must be chosen before any kernel module is imported (tests/conftest.py's rule).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import kernels  # noqa: E402
import train as train_module  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, gpu_name, results_path, versions, write_json  # noqa: E402
from eval.cli import check_command_line, user_errors  # noqa: E402
from training.settings import SETTING_HINTS, lightning_settings  # noqa: E402

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
NAME = "train-parity"
STEPS = 200
# The targets: relative gaps |ours - ref| / |ref| of the per-step train/loss.
MAX_GAP_TARGET = 0.05
FINAL_GAP_TARGET = 0.02
DEFAULT_OVERRIDES = ("mixer=mamba",)  # first, so the command line's own mixer=... wins
BACKENDS = {"ours": "triton", "reference": "reference"}  # run name -> the backend every op is forced to
TABLE_ROWS = 10  # about this many sampled steps in the printed table


@contextlib.contextmanager
def forced_backend(backend: str) -> Iterator[None]:
    """Within the block, every op in ``kernels.__all__`` runs with ``backend=backend``.

    Each ``kernels.<op>`` attribute is replaced by ``functools.partial(op, backend=backend)`` and
    put back on exit, also when the block raises. This reaches every caller that looks the op up on
    the module at call time (``kernels.selective_scan(...)``), as the mixers do; a caller holding its
    own reference (``from kernels import selective_scan``) would bypass it.

    Raises:
        ValueError: ``backend`` is neither "triton" nor "reference".
    """
    if backend not in ("triton", "reference"):
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    originals = {name: getattr(kernels, name) for name in kernels.__all__}
    try:
        for name, op in originals.items():
            setattr(kernels, name, functools.partial(op, backend=backend))
        yield
    finally:
        for name, op in originals.items():
            setattr(kernels, name, op)


def compose_config(overrides: Sequence[str], steps: int, run_dir: Path) -> DictConfig:
    """``conf/train.yaml`` composed with :data:`DEFAULT_OVERRIDES`, then ``overrides``, then this
    benchmark's own settings (later overrides of a key win): ``steps`` optimizer steps, train/loss
    logged every step to CSV only, one batch per validation slice (validation is not compared, and
    a full one through the Triton interpreter takes minutes on a CPU), and ``run_dir``
    (``${hydra:runtime.output_dir}`` does not resolve outside ``@hydra.main``).

    Raises:
        ValueError: an override Hydra rejects (unknown group option or key, bad syntax), with
            :func:`eval.cli.check_command_line`'s message or Hydra's; a trainer of more than one
            process (both runs must share this one).
    """
    forced = [
        "logger.wandb.enabled=false",
        "logger.csv.enabled=true",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1",
        f"run_dir={run_dir}",
    ]
    try:  # one line for an unknown option or key, as train.py's command line gives it
        check_command_line(
            [*DEFAULT_OVERRIDES, *overrides],
            "train",
            hints=SETTING_HINTS,
            settings=lightning_settings(),
        )
    except ValueError as err:
        raise ValueError(f"bad override: {err}") from None
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[*DEFAULT_OVERRIDES, *overrides, *forced])
    except HydraException as err:
        raise ValueError(f"bad override: {err}") from None
    if str(cfg.trainer.strategy) != "auto" or str(cfg.trainer.devices) != "1":
        raise ValueError(
            f"trainer.strategy={cfg.trainer.strategy} trainer.devices={cfg.trainer.devices}: this benchmark "
            "runs both trainings in one process on one device; use trainer=gpu (or trainer=cpu)"
        )
    return cfg


def read_losses(metrics_csv: str | os.PathLike) -> dict[int, float]:
    """``{step: train/loss}`` from a Lightning CSVLogger ``metrics.csv`` (rows without a train/loss,
    such as the learning-rate monitor's, are skipped).

    Raises:
        ValueError: the file is missing or holds no train/loss value.
    """
    path = Path(metrics_csv)
    if not path.is_file():
        raise ValueError(f"{path}: no metrics.csv was written; keep logger.csv enabled for this benchmark")
    with open(path, newline="") as f:
        losses = {
            int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")
        }
    if not losses:
        raise ValueError(
            f"{path} holds no train/loss values; keep logger.csv enabled (and train/loss logged) for this benchmark"
        )
    return losses


def relative_gap(ours: float, ref: float) -> float:
    """``|ours - ref| / |ref|``: 0 when both are 0, ``inf`` when only ``ref`` is, NaN when either is NaN."""
    if ours == ref:
        return 0.0
    if ref == 0:
        return math.inf
    return abs(ours - ref) / abs(ref)


def compare_curves(ours: dict[int, float], ref: dict[int, float]) -> dict[str, Any]:
    """The two loss curves on their common steps, each step's relative gap, the largest gap (a NaN
    counts as the largest) and its step, and the final step's gap.

    Returns:
        ``{"steps", "ours", "reference", "gaps", "max_gap", "max_gap_step", "final_gap"}``, lists in
        step order.

    Raises:
        ValueError: the curves share no step.
    """
    steps = sorted(ours.keys() & ref.keys())
    if not steps:
        raise ValueError(f"the loss curves share no step (ours: {sorted(ours)}, reference: {sorted(ref)})")
    gaps = [relative_gap(ours[s], ref[s]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: math.inf if math.isnan(gaps[i]) else gaps[i])
    return {
        "steps": steps,
        "ours": [ours[s] for s in steps],
        "reference": [ref[s] for s in steps],
        "gaps": gaps,
        "max_gap": gaps[worst],
        "max_gap_step": steps[worst],
        "final_gap": gaps[-1],
    }


def verdicts(comparison: dict[str, Any]) -> dict[str, bool]:
    """Whether each target is met: ``{"max_gap": ..., "final_gap": ...}`` (a NaN gap misses)."""
    return {
        "max_gap": comparison["max_gap"] <= MAX_GAP_TARGET,
        "final_gap": comparison["final_gap"] <= FINAL_GAP_TARGET,
    }


def table_rows(comparison: dict[str, Any], rows: int = TABLE_ROWS) -> list[list[str]]:
    """The printed table's rows: about ``rows`` evenly spaced steps plus the last step and the step of
    the largest gap, as ``[step, ours, reference, gap %, note]`` cells (note ``max`` on the largest gap)."""
    steps = comparison["steps"]
    stride = max(1, round(len(steps) / rows))
    picked = sorted({*range(0, len(steps), stride), len(steps) - 1, steps.index(comparison["max_gap_step"])})
    out = []
    for i in picked:
        note = "max" if steps[i] == comparison["max_gap_step"] else ""
        out.append([str(steps[i]), f"{comparison['ours'][i]:.4f}", f"{comparison['reference'][i]:.4f}",
                    f"{100 * comparison['gaps'][i]:.2f}%", note])  # fmt: skip
    return out


def summary_line(comparison: dict[str, Any], met: dict[str, bool]) -> str:
    """One line: the largest gap and its step, the final gap, each against its target with PASS / MISS."""

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    return (
        f"max gap {100 * comparison['max_gap']:.2f}% at step {comparison['max_gap_step']} "
        f"(target <= {MAX_GAP_TARGET:.0%}): {verdict(met['max_gap'])} | final gap "
        f"{100 * comparison['final_gap']:.2f}% at step {comparison['steps'][-1]} "
        f"(target <= {FINAL_GAP_TARGET:.0%}): {verdict(met['final_gap'])}"
    )


def run_training(backend: str, overrides: Sequence[str], steps: int, run_dir: Path) -> dict[str, Any]:
    """Train once with every kernel op forced to ``backend``; returns ``{"backend", "run_dir",
    "wall_s", "losses"}`` with ``losses`` the ``{step: train/loss}`` of the run's metrics.csv.

    Raises:
        ValueError: a bad config (from :func:`train.train`), a metrics.csv without train/loss, or
            ``backend="triton"`` on a CPU trainer without the interpreter (a GPU machine: use trainer=gpu).
    """
    cfg = compose_config(overrides, steps, run_dir)
    if backend == "triton" and cfg.trainer.accelerator == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "trainer.accelerator=cpu: the Triton kernels would get CPU tensors, which they only run under "
            "the interpreter (TRITON_INTERPRET=1, set by this script only where torch sees no GPU); "
            "pass trainer=gpu"
        )
    start = time.perf_counter()
    with forced_backend(backend):
        out = train_module.train(cfg)
    wall_s = time.perf_counter() - start
    losses = read_losses(Path(out["run_dir"]) / "csv" / "metrics.csv")
    return {"backend": backend, "run_dir": out["run_dir"], "wall_s": wall_s, "losses": losses}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); exits with a usage error when ``--steps`` < 2."""
    parser = argparse.ArgumentParser(
        description="Train one config on the Triton kernels and on the PyTorch references; compare the loss curves.",
    )
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument(
        "--out-dir", type=Path, default=RESULTS_DIR, help="results folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        help="keep the two run directories here (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides of conf/train.yaml, e.g. model=small trainer=gpu"
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 to compare loss curves, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run both trainings, print the sampled curves and the verdicts, write the JSON record; returns 0
    when both targets are met, else 1."""
    args = parse_args(argv)
    torch.set_flush_denormal(True)  # as train.py: CPU arithmetic on denormals is very slow
    device = gpu_name() if torch.cuda.is_available() else "cpu"
    path = results_path(NAME, args.out_dir, gpu=device)
    info = versions()
    print(f"{device} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"{args.steps} steps | overrides {' '.join(args.overrides) or '-'} | results -> {path}", flush=True)  # fmt: skip
    if device == "cpu":
        print("no GPU: 'ours' runs the Triton interpreter, far slower than the reference; beyond the tiny sizes "
              "of this script's CPU smoke run (python benchmarks/train_parity.py --help) a run takes hours",
              flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="train-parity-") as tmp:  # checkpoints too: not kept by default
        runs_dir = args.runs_dir or Path(tmp)
        runs = {}
        for name, backend in BACKENDS.items():
            runs[name] = run_training(backend, args.overrides, args.steps, runs_dir / name)
            print(f"{name} (backend={backend}): {len(runs[name]['losses'])} steps in {runs[name]['wall_s']:.1f}s",
                  flush=True)  # fmt: skip
    comparison = compare_curves(runs["ours"]["losses"], runs["reference"]["losses"])
    met = verdicts(comparison)
    payload = {
        "benchmark": "train_parity",
        "versions": info,
        "device": device,
        "overrides": list(args.overrides),
        "default_overrides": list(DEFAULT_OVERRIDES),
        "steps": args.steps,
        "runs": {
            name: {
                "backend": run["backend"],
                "wall_s": run["wall_s"],
                "run_dir": run["run_dir"] if args.runs_dir else None,
            }
            for name, run in runs.items()
        },
        "curves": {key: comparison[key] for key in ("steps", "ours", "reference")},
        "gaps": comparison["gaps"],
        "max_gap": comparison["max_gap"],
        "max_gap_step": comparison["max_gap_step"],
        "final_gap": comparison["final_gap"],
        "targets": {"max_gap": MAX_GAP_TARGET, "final_gap": FINAL_GAP_TARGET},
        "met": met,
        "gap": "|ours - reference| / |reference| of train/loss per logged step (Lightning's, 0-based)",
    }
    write_json(path, payload)
    print()
    print(format_table(["step", "ours", "reference", "gap", ""], table_rows(comparison)))
    print()
    print(summary_line(comparison, met))
    print(f"written to {path}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    with user_errors():
        sys.exit(main())

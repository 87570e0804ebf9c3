"""The LightningModule: loss, metrics per slice, optimiser and schedule.

It owns a plain-dict model config and calls ``save_hyperparameters()``, so
``LitLM.load_from_checkpoint(path)`` (or :func:`load_model`) rebuilds the model from the
checkpoint alone (DESIGN.md, contract 4).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from models.checkpoint import numpy_scalars_loadable, read_checkpoint
from models.config import ModelConfig
from models.model import LanguageModel

IGNORE_INDEX = -100

_LIGHTNING_LOAD = inspect.getattr_static(L.LightningModule, "load_from_checkpoint")


def _signature_of(original):
    """A decorator giving a wrapper ``original``'s signature, which :func:`inspect.signature` reports."""

    def decorate(function):
        function.__signature__ = inspect.signature(original)
        return function

    return decorate

# What LitLM logs each training step; validation adds the names of :func:`logged_metrics`.
TRAIN_METRICS = ("train/loss", "train/acc", "train/tokens")


def logged_metrics(slice_names: Sequence[str]) -> set[str]:
    """Every metric name :class:`LitLM` logs for a task with these validation slices: the training
    step's ``train/loss``, ``train/acc`` (next-token accuracy on scored positions) and
    ``train/tokens`` (tokens seen, all ranks), and per validation epoch ``val/loss_<slice>`` and
    ``val/acc_<slice>`` for each slice plus ``val/loss``, ``val/acc`` (the first slice's) and
    ``val/ppl`` (exp of ``val/loss``, capped at e^50). train.py checks ``early_stopping.monitor``
    against it before training starts.
    """
    per_slice = {f"val/{metric}_{name}" for metric in ("loss", "acc") for name in slice_names}
    return {*TRAIN_METRICS, "val/loss", "val/acc", "val/ppl"} | per_slice


def improving_mode(metric: str) -> str | None:
    """How a metric of :func:`logged_metrics` improves: ``"max"`` for the accuracies (``train/acc``,
    ``val/acc``, ``val/acc_<slice>``), ``"min"`` for the losses and ``val/ppl``, None for
    ``train/tokens`` (a count). The direction early stopping and best.ckpt's selection must take."""
    if metric == "train/tokens":
        return None
    return "max" if metric.split("/", 1)[-1].startswith("acc") else "min"


DEFAULT_OPTIM = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "warmup_steps": 100,
    "min_lr_ratio": 0.1,
    "schedule_interval": "step",
}
SCHEDULE_INTERVALS = ("step", "epoch")


def scored_metrics(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy, correct predictions and count over positions whose label is not -100.

    Args:
        logits: ``(B, T, V)`` any float dtype (the loss is computed in fp32).
        labels: ``(B, T)`` int64, ``-100`` where unscored.

    Returns:
        ``(loss_sum, correct, count)``, fp32 scalars (nats, predictions, positions).
    """
    logits = logits.float().flatten(0, 1)
    labels = labels.flatten()
    loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    scored = labels != IGNORE_INDEX
    correct = (logits.argmax(-1) == labels)[scored].sum().float()
    return loss_sum, correct, scored.sum().float()


class LitLM(L.LightningModule):
    """Trains a :class:`LanguageModel` with next-token cross-entropy on scored positions.

    Args:
        model: plain-dict model config (:class:`ModelConfig` fields).
        optim: ``lr`` (peak), ``weight_decay`` (AdamW, Loshchilov & Hutter 2019; not applied to
            biases, norms, ``A_log`` and ``D``), ``betas``, ``warmup_steps`` (linear warmup),
            ``min_lr_ratio`` (cosine decay to ``lr * min_lr_ratio`` at the end of training) and
            ``schedule_interval``: ``"step"`` updates the learning rate every optimizer step over
            the run's steps; ``"epoch"`` once per epoch over ``trainer.max_epochs`` epochs
            (``warmup_steps`` then counts epochs) -- with no warmup and ``min_lr_ratio`` 0 this is
            Zoology's ``CosineAnnealingLR(T_max=max_epochs, eta_min=0)`` stepped after each epoch.
        data: the data config the model was trained on (kept for evaluations).
        slice_names: names of the validation dataloaders, in order (``["T64_kv4", ...]``);
            metrics are logged as ``val/acc_<slice>``; ``val/acc`` and ``val/loss`` are the first
            slice's (the in-distribution one).
        tokenizer_config: the tokenizer config of text runs (``data.tokenizer_from_config`` rebuilds it), so
            prompts can be encoded and generations decoded from the checkpoint alone.
        run_seed: the run's ``seed=`` (train.py's), kept so that ``resume=`` can refuse another one:
            the training data order is a function of it and ``data.seed``. None: not recorded (a
            module built outside train.py, or a checkpoint written before it was stored). Not named
            ``seed``: Lightning merges these hyperparameters with the data module's, whose ``seed`` is
            ``data.seed``, for the loggers and refuses two values under one name.
        corpus_sha256: a text run's corpus digest (``TextDataModule.corpus_sha256``), kept so that
            ``resume=`` can refuse a corpus edited in place. None: not a text run, or not recorded.

    Logged: ``train/loss``, ``train/acc``, ``train/tokens``; ``val/loss``, ``val/acc``, ``val/ppl``
    and their per-slice forms. Accuracies are exact counts over the whole split (reduced across
    DDP ranks), not means of batch means.
    """

    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        slice_names: Sequence[str] | None = None,
        tokenizer_config: dict[str, Any] | None = None,
        run_seed: int | None = None,
        corpus_sha256: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LanguageModel(ModelConfig.from_dict(model))
        self.optim = check_optim(optim)
        self.slice_names = list(slice_names or ["val"])
        self._val_sums: dict[int, torch.Tensor] = {}
        self.val_metrics: dict[str, float] = {}  # the last validation's metrics, exact (float64)
        # global_step of the last validation during fit (None before one; not the final validate()).
        self.last_fit_validation_step: int | None = None
        # The step this fit started at (after a resume, the checkpoint's): None until training starts.
        self.first_step: int | None = None
        # The learning-rate schedule's length and warmup, in its interval's units (configure_optimizers):
        # {"total", "warmup", "interval"}; empty until then.
        self.lr_schedule: dict[str, Any] = {}
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.float64), persistent=True)

    # Lightning's own decorator of load_from_checkpoint (a classmethod that refuses instance calls,
    # whose result would be dropped), taken from the method it wraps rather than a private import;
    # and its signature, so that help() and editors show the named arguments, not *args / **kwargs.
    @type(_LIGHTNING_LOAD)
    @_signature_of(_LIGHTNING_LOAD.__func__)
    def load_from_checkpoint(cls, checkpoint_path, *args: Any, **kwargs: Any) -> LitLM:
        """Lightning's ``load_from_checkpoint`` (same arguments and errors), reading the numpy
        bool / integer / float scalars that :func:`load_model` reads too
        (:func:`models.checkpoint.numpy_scalars_loadable`); torch's weights-only load refuses them
        otherwise. :func:`load_model` gives the clearer errors for missing or corrupt files."""
        with numpy_scalars_loadable():
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for ``input_ids (B, T)`` (see :meth:`LanguageModel.forward`)."""
        return self.model(input_ids, cache=cache)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Mean cross-entropy over the batch's scored tokens (``labels`` != -100), a scalar; logs
        train/loss, train/acc and train/tokens (tokens trained on so far)."""
        logits = self.model(batch["input_ids"])
        loss_sum, correct, count = scored_metrics(logits, batch["labels"])
        loss = loss_sum / count.clamp_min(1)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", correct / count.clamp_min(1), prog_bar=True)
        self.log("train/tokens", (self.tokens_seen + self._batch_tokens(batch)).float())
        return loss

    def _batch_tokens(self, batch: dict[str, Any]) -> int:
        return batch["input_ids"].numel() * self.trainer.world_size

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Any], batch_idx: int) -> None:
        """Count the batch's tokens as trained on."""
        # Counted once the step is done, not in training_step: a run interrupted between the two
        # (Ctrl+C during the backward or the optimizer step) saved one batch more than it trained on.
        self.tokens_seen += self._batch_tokens(batch)

    def on_validation_epoch_start(self) -> None:
        """Start the per-slice sums of the validation pass."""
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Add the batch's loss sum, correct and scored token counts to its slice's sums (float64)."""
        logits = self.model(batch["input_ids"])
        sums = torch.stack(scored_metrics(logits, batch["labels"])).double()
        self._val_sums[dataloader_idx] = self._val_sums.get(dataloader_idx, torch.zeros_like(sums)) + sums

    def on_validation_epoch_end(self) -> None:
        """Log val/loss_<slice> and val/acc_<slice> from the sums reduced over processes, token-weighted."""
        metrics = {}
        for idx, name in enumerate(self.slice_names):
            sums = self._val_sums.get(idx, torch.zeros(3, dtype=torch.float64, device=self.device))
            loss_sum, correct, count = self.trainer.strategy.reduce(sums, reduce_op="sum").tolist()
            metrics[f"val/loss_{name}"] = loss_sum / max(count, 1.0)
            metrics[f"val/acc_{name}"] = correct / max(count, 1.0)
        first = self.slice_names[0]
        metrics["val/loss"] = metrics[f"val/loss_{first}"]
        metrics["val/acc"] = metrics[f"val/acc_{first}"]
        metrics["val/ppl"] = math.exp(min(metrics["val/loss"], 50.0))
        self.val_metrics = metrics
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.last_fit_validation_step = self.global_step
        for key, value in metrics.items():
            # Already summed over ranks above, so every rank logs the same value; sync_dist (a mean
            # of equal values) only keeps Lightning from warning about unsynchronised epoch metrics.
            self.log(key, value, prog_bar=key in ("val/loss", "val/acc"), sync_dist=True)

    def on_train_start(self) -> None:
        """Set the learning rate from this run's schedule at the current step.

        A run resumed from a checkpoint (``train.py resume=...``) gets its optimizer's learning
        rate as last set, under the earlier run's schedule; when the resume raises
        ``trainer.max_steps`` the schedule is longer, so its first step would use the old value.
        Re-evaluating the schedule here makes every step's rate the one an uninterrupted run with
        the new settings uses (on a fresh run it is the rate already set). Also notes the step
        training starts at (``first_step``: 0, or a resumed checkpoint's step).
        """
        self.first_step = self.global_step
        for config in self.trainer.lr_scheduler_configs:
            sched = config.scheduler
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
                for group, base_lr, fn in zip(
                    sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
                ):
                    group["lr"] = base_lr * fn(sched.last_epoch)

    def configure_optimizers(self):
        """AdamW (Loshchilov & Hutter 2019) over two parameter groups, weight decay on matrices only,
        and a linear warmup over ``warmup_steps`` then a cosine decay to ``min_lr_ratio * lr`` over the
        run's steps (or epochs: ``schedule_interval``).

        Raises:
            ValueError: a schedule over epochs without a positive ``trainer.max_epochs``, or over steps
                with neither ``trainer.max_steps`` nor ``trainer.max_epochs`` set.
        """
        decay, no_decay = [], []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            # Weight decay shrinks matrices only: decaying gains, biases, A_log or D would pull
            # norms to zero and SSM decay rates towards 1 (Mamba marks A_log and D _no_weight_decay).
            (no_decay if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.optim["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.optim["lr"],
            betas=tuple(self.optim["betas"]),
        )
        interval = self.optim["schedule_interval"]
        if interval == "epoch":
            total = self.trainer.max_epochs
            if total is None or total < 1:
                raise ValueError(
                    "optim.schedule_interval=epoch decays the learning rate over trainer.max_epochs, "
                    f"which must be a positive number of epochs, got {total}; set trainer.max_epochs"
                )
        else:
            total = self.trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise ValueError(
                    "the learning-rate schedule decays over the run's length, but trainer.max_steps and "
                    "trainer.max_epochs are both unlimited (-1); set one of them"
                )
            total = max(1, int(total))
        warmup = min(int(self.optim["warmup_steps"]), total)
        floor = float(self.optim["min_lr_ratio"])
        self.lr_schedule = {"total": total, "warmup": warmup, "interval": interval}

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}


def check_optim(optim: dict[str, Any] | None) -> dict[str, Any]:
    """``optim`` completed with :data:`DEFAULT_OPTIM` and validated.

    Raises:
        TypeError: a value of the wrong type (``optim.lr=abc``), naming the ``optim.*`` key.
        ValueError: unknown keys, ``lr <= 0``, ``weight_decay < 0``, ``warmup_steps < 0``, betas
            outside [0, 1), ``min_lr_ratio`` outside [0, 1] or ``schedule_interval`` not one of
            :data:`SCHEDULE_INTERVALS`, each naming the ``optim.*`` key.
    """
    unknown = set(optim or {}) - set(DEFAULT_OPTIM)
    if unknown:
        raise ValueError(f"unknown optim keys {sorted(unknown)}; valid keys: {sorted(DEFAULT_OPTIM)}")
    optim = {**DEFAULT_OPTIM, **(optim or {})}

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key in ("lr", "weight_decay", "warmup_steps", "min_lr_ratio"):
        if not number(optim[key]) or (key == "warmup_steps" and not isinstance(optim[key], int)):
            kind = "an integer" if key == "warmup_steps" else "a number"
            raise TypeError(f"optim.{key} must be {kind}, got {optim[key]!r}")
    if not isinstance(optim["betas"], (list, tuple)) or not all(number(b) for b in optim["betas"]):
        raise TypeError(f"optim.betas must be two numbers in [0, 1), got {optim['betas']!r}")
    rules = {
        "lr": ("> 0", optim["lr"] > 0),
        "weight_decay": (">= 0", optim["weight_decay"] >= 0),
        "warmup_steps": (">= 0", optim["warmup_steps"] >= 0),
        "min_lr_ratio": ("in [0, 1]", 0 <= optim["min_lr_ratio"] <= 1),
        "betas": (
            "two numbers in [0, 1)",
            len(optim["betas"]) == 2 and all(0 <= b < 1 for b in optim["betas"]),
        ),
        "schedule_interval": (
            f"one of {SCHEDULE_INTERVALS}",
            optim["schedule_interval"] in SCHEDULE_INTERVALS,
        ),
    }
    for key, (rule, ok) in rules.items():
        if not ok:
            raise ValueError(f"optim.{key} must be {rule}, got {optim[key]!r}")
    return optim


def check_map_location(map_location: Any) -> torch.device:
    """The device ``map_location`` names, checked to exist here before a checkpoint is read.

    Raises:
        TypeError: not a ``str`` or ``torch.device``.
        ValueError: a string that names no device type, or a CUDA (or MPS) device this machine does
            not have (a new-user check: ``map_location="cuda"`` on a CPU-only machine ended in torch's
            AssertionError after the checkpoint was read).
    """
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"map_location must be a device name or torch.device (e.g. 'cpu' or 'cuda'), got "
            f"{type(map_location).__name__} {map_location!r}"
        )
    try:
        device = torch.device(map_location)
    except RuntimeError:
        raise ValueError(
            f"map_location={map_location!r} is not a device; give e.g. map_location='cpu' or 'cuda'"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "it finds no GPU"
            raise ValueError(
                f"map_location={map_location!r} asks for a CUDA GPU, but {why}; use map_location='cpu'"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"map_location={map_location!r} asks for GPU {device.index}, but this machine has {count} "
                f"(cuda:0 to cuda:{count - 1}); use one of them or map_location='cpu'"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"map_location={map_location!r} asks for Apple's MPS, which is not available here; use "
            "map_location='cpu'"
        )
    return device


def load_model(path, map_location: str | torch.device = "cpu", arg: str | None = None) -> LitLM:
    """Rebuild a trained :class:`LitLM` (in eval mode) from a checkpoint file alone.

    Args:
        path: a ``.ckpt`` written by ``train.py`` (``str`` or ``os.PathLike``).
        map_location: device for the weights (a name such as ``"cpu"`` or ``"cuda:0"``, or a
            ``torch.device``), checked before the file is read (:func:`check_map_location`).
        arg: the command-line setting that named ``path`` (``ckpt`` in the evaluations), for the
            error messages; None (the default) when called from Python.

    Raises:
        TypeError: ``path`` not a ``str`` or ``os.PathLike``; ``map_location`` not a ``str`` or
            ``torch.device``.
        FileNotFoundError: missing checkpoint.
        ValueError: a ``map_location`` that names no device or one this machine does not have;
            truncated, corrupt or foreign checkpoint, weights that hold NaN or inf (a diverged run)
            or integer / bool values where the model's are floating-point (an edited or converted
            file), hyper_parameters that LitLM does not take, or a model config that no longer
            validates.
    """
    check_map_location(map_location)
    checkpoint = read_checkpoint(path, arg)
    hparams = checkpoint["hyper_parameters"]
    unknown = sorted(set(hparams) - set(inspect.signature(LitLM.__init__).parameters))
    if unknown:  # an edited file, or one of a newer mixerlab: LitLM would raise a bare TypeError
        raise ValueError(
            f"checkpoint {path} holds hyper_parameters that this mixerlab's LitLM does not take ({unknown}): "
            "was it edited, or written by another mixerlab version?"
        )
    try:
        lit = LitLM(**hparams)
    except (ValueError, TypeError) as err:  # a new-user check: read as a refusal of their own setting
        raise type(err)(
            f"checkpoint {path} holds a model config that does not validate ({err}): was it edited, or "
            "written by another mixerlab version?"
        ) from err
    # load_state_dict casts each tensor to its parameter's dtype: integer or bool weights (an
    # edited or foreign file) would load as truncated numbers and score 0 without a word.
    expected = lit.state_dict()
    not_float = [
        f"{name} ({t.dtype})"
        for name, t in checkpoint["state_dict"].items()
        if isinstance(t, torch.Tensor) and name in expected
        and expected[name].is_floating_point() and not t.is_floating_point()
    ]  # fmt: skip
    if not_float:
        example = "a .ckpt file written by train.py"
        raise ValueError(
            f"checkpoint {path} holds non-floating-point weights in {len(not_float)} tensors (the first: "
            f"{not_float[0]}) where the model has floating-point ones: was it edited or converted? "
            + (f"pass {arg}=<{example}>" if arg else f"give {example}")
        )
    try:
        missing, unexpected = lit.load_state_dict(checkpoint["state_dict"], strict=False)
    except RuntimeError as err:  # a tensor whose shape the config does not give (an edited config)
        raise ValueError(
            f"checkpoint {path} does not match the model its config describes: "
            f"{str(err).splitlines()[-1].strip()}; was the config edited, or written by another mixerlab version?"
        ) from err
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model its config describes "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]}); was it written by another mixerlab version?"
        )
    return lit.to(map_location).eval()

"""Model dropout (embedding and residual, nanoGPT's placement) and the optimiser's schedule interval."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from models import LanguageModel, ModelConfig
from models.lit import LitLM, check_optim
from training.resume import schedule_note

BASE = dict(
    vocab_size=23,
    d_model=16,
    n_layers=2,
    pattern=["attention"],
    mixer_settings={"attention": {"num_heads": 2}},
)


def test_dropout_is_active_in_training_only_and_changes_nothing_at_eval():
    torch.manual_seed(0)
    plain = LanguageModel(BASE)
    dropped = LanguageModel({**BASE, "embed_dropout": 0.3, "resid_dropout": 0.3})
    dropped.load_state_dict(plain.state_dict())  # dropout adds no parameters
    ids = torch.randint(0, 23, (2, 12))
    plain.eval(), dropped.eval()
    torch.testing.assert_close(dropped(ids), plain(ids))
    plain.train(), dropped.train()
    torch.testing.assert_close(plain(ids), plain(ids))  # p = 0: training is deterministic
    assert not torch.allclose(dropped(ids), dropped(ids))
    assert dropped.embed_dropout.p == 0.3 and all(block.dropout.p == 0.3 for block in dropped.layers)


def test_residual_dropout_reaches_the_shared_block():
    config = {
        **BASE,
        "pattern": ["mamba"],
        "n_layers": 2,
        "mixer_settings": {"attention": {"num_heads": 2}},
        "shared_block": {"every": 1},
        "resid_dropout": 0.25,
    }
    assert LanguageModel(config).shared_block.block.dropout.p == 0.25


@pytest.mark.parametrize("field", ["embed_dropout", "resid_dropout"])
@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.1"])
def test_dropout_outside_0_1_is_a_clear_error(field, value):
    with pytest.raises(ValueError, match=f"model.{field} must be a probability in \\[0, 1\\)"):
        ModelConfig(**{**BASE, field: value})


def test_schedule_interval_is_validated():
    assert check_optim(None)["schedule_interval"] == "step"
    assert check_optim({"schedule_interval": "epoch"})["schedule_interval"] == "epoch"
    with pytest.raises(ValueError, match="optim.schedule_interval must be one of"):
        check_optim({"schedule_interval": "batch"})


def _schedule(optim: dict, max_epochs: int | None, stepping_batches: int = 100):
    lit = LitLM(model=BASE, optim=optim)
    trainer = SimpleNamespace(max_epochs=max_epochs, estimated_stepping_batches=stepping_batches)
    lit.trainer = trainer  # what Lightning attaches before configure_optimizers
    return lit.configure_optimizers()


def test_epoch_schedule_is_cosine_annealing_over_max_epochs():
    out = _schedule({"lr": 0.01, "warmup_steps": 0, "min_lr_ratio": 0.0, "schedule_interval": "epoch"}, 8)
    assert out["lr_scheduler"]["interval"] == "epoch"
    sched = out["lr_scheduler"]["scheduler"]
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.01), T_max=8, eta_min=0.0
    )
    for epoch in range(8):
        assert sched.get_last_lr()[0] == pytest.approx(reference.get_last_lr()[0])
        assert sched.get_last_lr()[0] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * epoch / 8)))
        sched.optimizer.step(), sched.step()
        reference.optimizer.step(), reference.step()


def test_step_schedule_spans_the_estimated_steps():
    out = _schedule({"lr": 0.01, "warmup_steps": 0, "min_lr_ratio": 0.0}, None, stepping_batches=10)
    assert out["lr_scheduler"]["interval"] == "step"
    sched = out["lr_scheduler"]["scheduler"]
    for _ in range(5):
        sched.optimizer.step(), sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.005)  # half-way down the cosine at step 5 of 10


@pytest.mark.parametrize("max_epochs", [None, -1])
def test_epoch_schedule_needs_max_epochs(max_epochs):
    with pytest.raises(ValueError, match="set trainer.max_epochs"):
        _schedule({"schedule_interval": "epoch"}, max_epochs)


def test_resume_note_of_a_run_that_only_warms_up_names_no_floor():
    """A new-user check: resumed at step 20 with trainer.max_steps=30 under optim.warmup_steps=50, the
    note said the lr "reaches its floor 0.003 at step 30", the peak: a run no longer than its warmup
    never decays."""
    out = _schedule({"lr": 0.003, "warmup_steps": 50, "min_lr_ratio": 0.1}, None, stepping_batches=30)
    sched = out["lr_scheduler"]["scheduler"]
    for _ in range(20):
        sched.optimizer.step(), sched.step()
    trainer = SimpleNamespace(
        lr_scheduler_configs=[SimpleNamespace(scheduler=sched)], max_steps=30, max_epochs=None
    )
    current = {"total": 30, "warmup": 30, "interval": "step"}
    note = schedule_note(trainer, current, {"total": 20, "warmup": 20})
    assert note.endswith(
        "it warms up over the whole run (optim.warmup_steps >= 30 steps), to 0.003 at step 30 (step 20 "
        "before), with no cosine decay"
    )
    assert "floor" not in note
    # With a warmup shorter than the run, the floor is min_lr_ratio * lr at the run's last step.
    out = _schedule({"lr": 0.003, "warmup_steps": 10, "min_lr_ratio": 0.1}, None, stepping_batches=30)
    trainer.lr_scheduler_configs = [SimpleNamespace(scheduler=out["lr_scheduler"]["scheduler"])]
    current = {"total": 30, "warmup": 10, "interval": "step"}
    assert schedule_note(trainer, current, {"total": 20, "warmup": 5}).endswith(
        "its floor 0.0003 at step 30 (step 20 before); its warmup ends at step 10 (step 5 before)"
    )

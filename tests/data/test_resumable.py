"""Tests of the resumable training stream (data/resumable.py): passes, positions, process shares, the
data modules' checkpoint hooks, and a Lightning fit resumed mid-epoch."""

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import build_datamodule
from data.resumable import ResumableLoader, ResumableSampler, ShuffledSampler

N, SEED = 11, 3


def _loader(batch_size=3, world_size=1, rank=0, n=N) -> ResumableLoader:
    sampler = ResumableSampler(ShuffledSampler(n, SEED), num_replicas=world_size, rank=rank)
    return ResumableLoader(list(range(n)), sampler, batch_size=batch_size)


def _batches(loader, batches: int) -> list:
    """``batches`` batches of the stream, iterating again whenever a pass ends (as Lightning's epochs do)."""
    out, it = [], iter(loader)
    while len(out) < batches:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(loader)
    return out


def _draw(loader, batches: int) -> list[list[int]]:
    return [batch.tolist() for batch in _batches(loader, batches)]


def _order(epoch: int, n=N) -> list[int]:
    return np.random.default_rng([SEED, epoch]).permutation(n).tolist()


def test_the_stream_is_one_pass_after_another_each_in_its_own_order():
    stream = _draw(_loader(), 12)  # 3 passes of 4 batches (3 + 3 + 3 + 2)
    for epoch in range(3):
        batches = stream[4 * epoch : 4 * epoch + 4]
        assert [len(b) for b in batches] == [3, 3, 3, 2]
        assert sum(batches, []) == _order(epoch)
    assert _order(0) != _order(1)
    # Lightning's set_epoch does not move it: after a resume its epoch count is not the pass.
    loader = _loader()
    loader.sampler.set_epoch(5)
    assert _draw(loader, 4) == stream[:4]


@pytest.mark.parametrize(
    "cut,position", [(0, (0, 0)), (1, (0, 3)), (3, (0, 9)), (4, (0, 11)), (5, (1, 3)), (9, (2, 3))]
)
def test_a_loader_given_the_state_continues_the_stream(cut, position):
    stream = _draw(_loader(), 12)
    first = _loader()
    seen = _draw(first, cut)
    state = first.state_dict()
    assert state == {"epoch": position[0], "examples": position[1]}
    resumed = _loader()
    resumed.load_state_dict(state)
    assert seen + _draw(resumed, 12 - cut) == stream
    # Another batch size continues the same order, in other batches.
    other = _loader(batch_size=2)
    other.load_state_dict(state)
    epoch, examples = position
    rest = _order(epoch)[examples:] + _order(epoch + 1)
    got = sum(_draw(other, 6), [])
    assert len(got) >= 10 and got == rest[: len(got)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_processes_share_each_pass_and_resume_their_shares(world_size):
    loaders = [_loader(batch_size=2, world_size=world_size, rank=r) for r in range(world_size)]
    per_pass = len(loaders[0])  # batches each process has in a pass
    shares = [_draw(loader, 3 * per_pass) for loader in loaders]
    for epoch in range(3):
        parts = [sum(share[epoch * per_pass : (epoch + 1) * per_pass], []) for share in shares]
        assert {len(p) for p in parts} == {N // world_size}  # equal counts, no example repeated
        interleaved = [p[j] for j in range(N // world_size) for p in parts]
        assert interleaved == _order(epoch)[: len(interleaved)]  # together, the pass's order
    # Every process resumes from the first process's checkpointed position.
    for cut in (1, per_pass, per_pass + 1):
        first = _loader(batch_size=2, world_size=world_size, rank=0)
        _draw(first, cut)
        state = first.state_dict()
        for rank, share in enumerate(shares):
            resumed = _loader(batch_size=2, world_size=world_size, rank=rank)
            resumed.load_state_dict(state)
            assert _draw(resumed, 3 * per_pass - cut) == share[cut:]
        # One process continues the order where the processes together left it.
        single = _loader()
        single.load_state_dict(state)
        got = sum(_draw(single, 4), [])
        assert got == (_order(state["epoch"])[state["examples"] :] + _order(state["epoch"] + 1))[: len(got)]


def test_put_back_and_bad_states():
    loader = _loader()
    batches = _draw(loader, 2)
    loader.put_back()  # the second batch was never trained on: a resume hands it out again
    resumed = _loader()
    resumed.load_state_dict(loader.state_dict())
    assert _draw(resumed, 1) == batches[1:]
    with pytest.raises(RuntimeError, match="no training batch was handed out"):
        _loader().put_back()
    for bad in ({"epoch": 0}, {"epoch": -1, "examples": 0}, {"epoch": True, "examples": 0}, [0, 0]):
        with pytest.raises(ValueError, match="a training stream position must be"):
            loader.load_state_dict(bad)
    with pytest.raises(ValueError, match="has 2 examples, fewer than the 3 processes"):
        _loader(world_size=3, n=2)


@pytest.mark.parametrize("name", ["mqar", "copy", "text"])
def test_data_modules_checkpoint_their_training_stream(name, tmp_path):
    def module():
        if name == "text":
            path = tmp_path / "corpus.txt"
            path.write_text("to be, or not to be: that is the question.\n" * 20)
            return build_datamodule("text", path=str(path), seqlen=8, batch_size=4)
        settings = {"min_len": 4, "max_len": 6, "seqlen": 16} if name == "copy" else {}
        return build_datamodule(name, num_train_examples=40, num_test_examples=4, batch_size=4, **settings)

    dm = module()
    dm.setup("fit")
    assert dm.state_dict() == {}  # no training loader yet: nothing to save
    rows = [b["input_ids"].tolist() for b in _batches(dm.train_dataloader(), 15)]
    cut = module()
    cut.setup("fit")
    _batches(cut.train_dataloader(), 6)
    state = cut.state_dict()
    assert set(state) == {"train_stream"} and state["train_stream"]["examples"] > 0
    resumed = module()
    resumed.setup("fit")
    resumed.load_state_dict(state)  # as Lightning does when a fit resumes, before any dataloader
    assert [b["input_ids"].tolist() for b in _batches(resumed.train_dataloader(), 9)] == rows[6:]


@pytest.mark.parametrize("name", ["mqar", "copy", "text"])
def test_the_training_order_follows_the_run_seed(name, tmp_path):
    # The same data (data seed 0) in the order of the run's seed (seed_everything sets torch's):
    # a sweep over seed= alone varies the order, as a shuffled DataLoader did; a run is repeatable.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: to be, or not to be.\n" for i in range(40)))

    def first_batches(run_seed: int) -> list:
        torch.manual_seed(run_seed)
        if name == "text":
            dm = build_datamodule("text", path=str(corpus), seqlen=8, batch_size=4)
        else:
            settings = {"min_len": 4, "max_len": 6, "seqlen": 16} if name == "copy" else {}
            dm = build_datamodule(name, num_train_examples=40, num_test_examples=4, batch_size=4, **settings)
        dm.setup("fit")
        return [b["input_ids"].tolist() for b in _batches(dm.train_dataloader(), 3)]

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)
    assert sorted(sum(first_batches(1), [])) != sorted(sum(first_batches(2), []))  # other examples first


class _Probe(L.LightningModule):
    """Records the training batches; reads estimated_stepping_batches in configure_optimizers, as
    LitLM does, which builds the training loader before Lightning restores a checkpoint."""

    def __init__(self, vocab_size):
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return F.cross_entropy(self.logits(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100)  # fmt: skip

    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("stop,max_epochs,rest_len", [(5, 3, 3 + 8), (8, -1, 16)])
def test_a_fit_stopped_mid_epoch_resumes_on_the_uninterrupted_batches(tmp_path, stop, max_epochs, rest_len):
    # 8 batches an epoch. Stopped by max_steps at 5, Lightning resumes as epoch 1 with the old
    # epoch's remaining 3 batches; an epoch-based fit (max_epochs=3) then ends after epoch 2, one
    # epoch short. Stopped at 8, the end of epoch 0, a step-based fit resumes with a one-batch epoch 1
    # and starts epoch 2 after it: the stream continues through both. Lightning loads a stateful
    # loader's state only if configure_optimizers does not read estimated_stepping_batches with
    # max_epochs set (Lightning issue #20550): the data module's checkpoint hooks restore the stream
    # in either case.
    def fit(max_steps, max_epochs, ckpt=None):
        dm = build_datamodule("mqar", num_train_examples=64, num_test_examples=4, batch_size=8)
        probe = _Probe(dm.vocab_size)
        trainer = L.Trainer(accelerator="cpu", max_epochs=max_epochs, max_steps=max_steps, limit_val_batches=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(probe, datamodule=dm, ckpt_path=ckpt)
        return trainer, probe.seen

    _, full = fit(-1, 3)
    trainer, first = fit(stop, max_epochs)
    trainer.save_checkpoint(tmp_path / "cut.ckpt")
    _, rest = fit(24 if max_epochs == -1 else -1, max_epochs, tmp_path / "cut.ckpt")
    assert len(full) == 24 and first == full[:stop] and len(rest) == rest_len
    assert first + rest == full[: len(first) + len(rest)]

"""The language model: layouts, every shipped mixer config end to end, caches, generation, errors."""

from __future__ import annotations

import ast
import math
import re

import numpy as np
import pytest
import torch
from helpers import MIXER_CONFIGS, compose_train

import train as train_module
from models import LanguageModel, ModelConfig, expand_layout


def model_from_config(
    mixer: str, *, d_model: int = 32, n_layers: int = 8, vocab_size: int = 37, overrides: tuple = ()
) -> LanguageModel:
    """A tiny float64 model built from the shipped ``conf/mixer/<mixer>.yaml`` (plus ``overrides``)."""
    cfg = compose_train(
        [f"mixer={mixer}", f"model.d_model={d_model}", f"model.n_layers={n_layers}", *overrides]
    )
    return LanguageModel(train_module.build_model_config(cfg, vocab_size)).double().eval()


def test_shipped_mixer_configs_are_the_eight_names():
    assert MIXER_CONFIGS == sorted(
        [
            "attention",
            "sliding_window",
            "linear_attention",
            "mamba",
            "hybrid_jamba",
            "hybrid_samba",
            "hybrid_zamba",
            "hybrid_based",
        ]
    )


@pytest.mark.parametrize("mixer", MIXER_CONFIGS)
def test_full_forward_equals_prefill_plus_decode(mixer):
    torch.manual_seed(0)
    model = model_from_config(mixer)
    ids = torch.randint(0, 37, (2, 21))
    full = model(ids)  # (B, T, V)
    for prefill_len in (1, 9):
        stepped = model.decode_logits(ids, prefill_len)
        torch.testing.assert_close(stepped, full, rtol=1e-9, atol=1e-9)
    # chunked prefill: several T > 1 chunks through the same caches
    cache = model.allocate_cache(2, 21)
    chunks = [model(ids[:, a:b], cache=cache) for a, b in ((0, 5), (5, 12), (12, 21))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.seqlen == 21


@pytest.mark.parametrize("mixer", MIXER_CONFIGS)
@pytest.mark.parametrize("seqlen", [1, 17, 64])
def test_cache_bytes_equal_state_size(mixer, seqlen):
    model = model_from_config(mixer)
    for dtype in (None, torch.float32):
        cache = model.allocate_cache(3, seqlen, dtype=dtype)
        assert cache.nbytes() == 3 * model.state_size(seqlen, dtype=dtype)
        assert cache.nbytes() > 0


def test_state_size_growth_tells_mixers_apart():
    sizes = {
        m: (model_from_config(m).state_size(64), model_from_config(m).state_size(256)) for m in MIXER_CONFIGS
    }
    # KV pages grow linearly with the context; the int32 length of each of the 8 layers' caches does not.
    lengths = 8 * 4
    assert sizes["attention"][1] - lengths == 4 * (sizes["attention"][0] - lengths)
    assert sizes["mamba"][0] == sizes["mamba"][1]  # fixed-size state
    assert sizes["linear_attention"][0] == sizes["linear_attention"][1]
    assert sizes["sliding_window"][0] == sizes["sliding_window"][1]  # window 32 < 64: capped
    assert sizes["hybrid_jamba"][1] < sizes["attention"][1]  # one attention layer in eight


def test_layouts_follow_the_papers():
    jamba = model_from_config("hybrid_jamba").config.layout
    assert jamba == ["mamba"] * 4 + ["attention"] + ["mamba"] * 3
    assert model_from_config("hybrid_samba").config.layout == ["mamba", "sliding_window"] * 4
    assert model_from_config("hybrid_based").config.layout == ["linear_attention", "sliding_window"] * 4
    zamba = model_from_config("hybrid_zamba")
    assert zamba.config.layout == ["mamba"] * 8
    assert zamba.shared_after == [3, 7]
    assert model_from_config("hybrid_jamba", n_layers=16).config.layout == jamba * 2


def test_zamba_shares_weights_across_invocations():
    model = model_from_config("hybrid_zamba")
    assert model.shared_block is not None
    shared = {id(p) for p in model.shared_block.block.parameters()}
    backbone = {id(p) for p in model.layers.parameters()}
    assert shared and not shared & backbone
    # gradient reaches the shared weights from both invocations: zeroing the first invocation's
    # output map changes the shared weights' gradient
    ids = torch.randint(0, 37, (2, 9))
    model.train()
    model(ids).sum().backward()
    grad_both = next(model.shared_block.block.parameters()).grad.clone()
    model.zero_grad()
    with torch.no_grad():
        model.shared_block.out_projs[0].weight.zero_()
    model(ids).sum().backward()
    assert not torch.allclose(next(model.shared_block.block.parameters()).grad, grad_both)


def test_causal_model_ignores_future_tokens():
    torch.manual_seed(0)
    for mixer in MIXER_CONFIGS:
        model = model_from_config(mixer)
        ids = torch.randint(0, 37, (1, 16))
        changed = ids.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % 37
        torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10], rtol=0, atol=1e-12)


def test_generate_greedy_matches_argmax_of_forward():
    torch.manual_seed(0)
    model = model_from_config("hybrid_jamba")
    prompt = torch.randint(0, 37, (2, 5))
    out = model.generate(prompt, 6, greedy=True)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    for t in range(5, 11):  # each generated token is the argmax of the full forward on its prefix
        torch.testing.assert_close(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_generate_sampling_and_stop_tokens():
    model = model_from_config("attention")
    prompt = torch.randint(0, 37, (3, 4))
    g = torch.Generator().manual_seed(1)
    a = model.generate(prompt, 8, temperature=0.7, top_k=5, generator=g)
    b = model.generate(prompt, 8, temperature=0.7, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (3, 12)
    first = model.generate(prompt, 1, greedy=True)[:, -1]
    stopped = model.generate(prompt, 8, greedy=True, stop_tokens=first.tolist())
    assert stopped.shape[1] == 5  # every sequence emitted its stop token first
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    vocab = model.config.vocab_size
    with pytest.raises(
        ValueError, match=rf"stop_tokens \[{vocab}, -1\] lie outside the vocabulary \[0, {vocab}\)"
    ):
        model.generate(prompt, 2, stop_tokens=[3, vocab, -1])


def test_generate_refuses_bad_arguments_with_clear_errors():
    # Each refused before any step, with what is wrong, not an error from inside PyTorch's sampler.
    model = model_from_config("attention")
    prompt = torch.randint(0, 37, (2, 4))
    cases = [
        (
            (prompt.tolist(), 2),
            {},
            TypeError,
            r"input_ids must be a \(batch, seqlen\) integer tensor, got list",
        ),
        ((prompt.bool(), 2), {}, ValueError, r"integer tensor, got shape \(2, 4\) and dtype torch.bool"),
        ((prompt[0], 2), {}, ValueError, r"got shape \(4,\)"),
        ((prompt, 2.5), {}, TypeError, r"max_new_tokens must be an int, got 2.5"),
        (
            (prompt, 2),
            {"temperature": float("nan")},
            ValueError,
            r"temperature must be a finite number > 0.*nan",
        ),
        (
            (prompt, 2),
            {"temperature": float("inf")},
            ValueError,
            r"temperature must be a finite number > 0.*inf",
        ),
        ((prompt, 2), {"top_k": 2.5}, TypeError, r"top_k must be an int, got 2.5"),
        (
            (prompt, 2),
            {"stop_tokens": 5},
            TypeError,
            r"stop_tokens must be a list of token ids \(ints\), got 5",
        ),
        ((prompt, 2), {"stop_tokens": [1.0]}, TypeError, r"stop_tokens must be a list"),
        # A new user's findings: a batch of 0 named a mixer's batch_size, a generator that is not one
        # failed in torch.multinomial after the prefill, and greedy="yes" sampled greedily.
        ((prompt[:0], 2), {}, ValueError, r"at least one prompt of at least one token.*got shape \(0, 4\)"),
        ((prompt, 2), {"generator": "x"}, TypeError, r"generator must be a torch.Generator or None, got str"),
        ((prompt, 2), {"greedy": "yes"}, TypeError, r"greedy must be True or False, got 'yes'"),
        ((prompt, 2), {"cuda_graph": 1}, TypeError, r"cuda_graph must be True or False, got 1"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model.generate(*args, **kwargs)
    with pytest.raises(TypeError, match="input_ids must be"):
        model(prompt.tolist())
    # numpy integers are token ids too
    out = model.generate(prompt, 2, greedy=True, stop_tokens=list(prompt[:, 0].numpy()))
    assert out.shape[0] == 2 and 4 <= out.shape[1] <= 6


def test_generate_takes_numpy_scalars_small_int_prompts_and_tiny_temperatures():
    # Found by a review: each of these failed inside torch or named an argument never passed.
    model = model_from_config("mamba", n_layers=2)
    prompt = torch.randint(0, 37, (2, 4))
    want = model.generate(prompt, 3, greedy=True)
    assert torch.equal(model.generate(prompt, np.int64(3), greedy=True), want)
    for dtype in (torch.int16, torch.uint8, torch.int32):  # a byte tokenizer's ids, say
        out = model.generate(prompt.to(dtype), 3, greedy=True)
        assert out.dtype == torch.int64 and torch.equal(out, want)
    assert model.generate(prompt, 3, temperature=np.float32(0.7), top_k=np.int64(5)).shape == (2, 7)
    # temperature -> 0 is the argmax (the logits are shifted before the division, so no NaN)
    for tiny in (1e-30, 1e-40):  # 1e-40 is subnormal in float32 (read as 0 with denormals flushed)
        sampled = model.generate(prompt, 3, temperature=tiny, generator=torch.Generator().manual_seed(0))
        assert torch.equal(sampled, want), tiny
    with pytest.raises(ValueError, match="temperature must be a finite number > 0.*got True"):
        model.generate(prompt, 3, temperature=True)
    # no new tokens: the prompt, checked and as int64, in a new tensor
    none = model.generate(prompt.int(), 0)
    assert none.dtype == torch.int64 and torch.equal(none, prompt) and none.data_ptr() != prompt.data_ptr()
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\), got range \[70, 70\]"):
        model.generate(torch.tensor([[70]]), 0)
    # A new-user check: a tensor temperature was "must be a finite number > 0, got tensor(0.7000)",
    # and ids on another device failed inside torch ("item() cannot be called on meta tensors").
    with pytest.raises(TypeError, match=r"temperature must be a Python number, got a tensor; pass float"):
        model.generate(prompt, 3, temperature=torch.tensor(0.7))
    with pytest.raises(
        ValueError, match=r"input_ids are on meta, the model on cpu; move them with input_ids.to"
    ):
        model.generate(prompt.to("meta"), 3)
    with pytest.raises(ValueError, match=r"input_ids are on meta, the model on cpu"):
        model(prompt.to("meta"))


def test_generate_says_when_the_caches_do_not_fit():
    model = model_from_config("attention", n_layers=2)
    with pytest.raises(
        ValueError, match=r"caches for 1 sequences of up to 2 \+ 1000000000000 tokens .* lower max_new_tokens"
    ):
        model.generate(torch.tensor([[1, 2]]), 10**12, greedy=True, stop_tokens=list(range(37)))


def test_generate_checks_a_learned_position_table_before_the_prefill():
    # A review found the loop failing after some steps (its tokens lost), with a hint to rebuild the
    # mixer. The last sampled token is never fed back: 8 rows serve prompt + max_new_tokens <= 9.
    learned = ("mixer.settings.attention.pos_emb=learned", "+mixer.settings.attention.max_position=8")
    model = model_from_config("attention", n_layers=2, overrides=learned)
    prompt = torch.randint(0, 37, (1, 5))
    out = model.generate(prompt, 4, greedy=True)
    assert out.shape == (1, 9)
    for t in range(5, 9):  # the whole table was usable: each token is the full forward's argmax
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))
    for length, new in ((5, 5), (12, 1)):
        with pytest.raises(
            ValueError,
            match=rf"max_position=8 rows, but a prompt of {length} tokens plus max_new_tokens={new} .* "
            r"prompt length \+ max_new_tokens <= 9",
        ):
            model.generate(torch.randint(0, 37, (1, length)), new, greedy=True)


def test_generate_runs_without_dropout_and_keeps_the_modules_mode():
    dropout = ("model.resid_dropout=0.5", "model.embed_dropout=0.5")
    model = model_from_config("hybrid_jamba", overrides=dropout)
    prompt = torch.randint(0, 37, (2, 5))
    want = model.generate(prompt, 6, greedy=True)  # in eval mode
    model.train()
    assert torch.equal(model.generate(prompt, 6, greedy=True), want) and model.training
    assert not torch.equal(model(prompt), model(prompt))  # dropout is on again in the forward


@pytest.mark.parametrize("mixer", MIXER_CONFIGS)
def test_cached_calls_run_without_autograd(mixer):
    # A prefill with gradients enabled left Mamba / linear-attention states with autograd history,
    # which the next decode step's in-place update refused, naming an internal tensor.
    model = model_from_config(mixer)
    ids = torch.randint(0, 37, (2, 9))
    full = model(ids)
    assert full.requires_grad
    cache = model.allocate_cache(2, 9)
    logits = [model(ids[:, :6], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(6, 9)]
    assert not any(x.requires_grad for x in logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full.detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_config_errors_are_clear():
    base = dict(
        vocab_size=10,
        d_model=32,
        n_layers=8,
        pattern=["attention"],
        mixer_settings={"attention": {"num_heads": 4}},
    )
    with pytest.raises(ValueError, match="unknown mixer 'transformer'"):
        ModelConfig(**{**base, "pattern": ["transformer"]})
    with pytest.raises(ValueError, match="does not divide"):
        expand_layout(["mamba", "mamba", "attention"], 8)
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({**base, "n_layer": 3})
    # A new-user check: LanguageModel("tiny") was told of unknown model config keys ['i', 'n', 't', 'y'].
    message = "a model config must be a ModelConfig or a mapping of its fields, got str 'tiny'; e.g. {"
    with pytest.raises(TypeError, match="^" + re.escape(message)) as refused:
        LanguageModel("tiny")
    assert "presets (conf/model/<size>.yaml" in str(refused.value)
    assert "models.lit.load_model(<checkpoint>)" in str(refused.value)
    example = ast.literal_eval(re.search(r"e\.g\. (\{.*\}\})", str(refused.value)).group(1))  # it builds
    assert LanguageModel(example).config.n_layers == 2
    with pytest.raises(TypeError, match=r"^a model config must be .*, got list \[1\]; e\.g\. \{[^;]*\}$"):
        ModelConfig.from_dict([1])
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(**{**base, "d_model": 0})
    with pytest.raises(ValueError, match="mlp"):
        ModelConfig(**{**base, "mlp": "gelu"})
    with pytest.raises(ValueError, match="shared_block.every"):
        ModelConfig(**{**base, "shared_block": {"every": 0}})
    # A new-user check: train.py mixer=hybrid_zamba model.n_layers=3 named no setting to change.
    message = "shared_block.every=4 exceeds n_layers=3: the shared block would never run; set "
    message += "mixer.shared_block.every <= model.n_layers on the command line (e.g. "
    message += "mixer.shared_block.every=3)"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        LanguageModel({**base, "n_layers": 3, "shared_block": {"every": 4}})
    # Found by an audit: non-finite or mistyped values gave NaN logits or errors from deep in torch.
    for field, value in [("norm_eps", -1.0), ("norm_eps", math.nan), ("norm_eps", "1e-5"),
                         ("mlp_ratio", math.inf), ("mlp_ratio", "4")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^model.{field} must be a finite number > 0, got "):
            ModelConfig(**{**base, field: value})
    for field in ("vocab_size", "n_layers"):
        with pytest.raises(ValueError, match=f"^model.{field} must be a positive integer, got True"):
            ModelConfig(**{**base, field: True})
    with pytest.raises(ValueError, match="^model.pattern must be a list of mixer names, got None"):
        ModelConfig(**{**base, "pattern": None})
    message = "unknown shared_block keys ['foo']; valid keys: ['every', 'mixer']"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ModelConfig(**{**base, "shared_block": {"every": 1, "foo": 2}})
    with pytest.raises(ValueError, match=r"^model.shared_block must be null or \{every: <layers>, mixer: "):
        ModelConfig(**{**base, "shared_block": [1]})
    with pytest.raises(ValueError, match="^model.mixer_settings must map mixer names to their settings"):
        ModelConfig(**{**base, "mixer_settings": [1, 2]})
    with pytest.raises(ValueError, match="divide"):  # heads that do not divide d_model
        LanguageModel({**base, "mixer_settings": {"attention": {"num_heads": 5}}})
    with pytest.raises(ValueError, match="window"):
        LanguageModel(
            {
                **base,
                "pattern": ["sliding_window"],
                "mixer_settings": {"sliding_window": {"num_heads": 4, "window": 0}},
            }
        )
    model = LanguageModel(base)
    ids = torch.tensor([[1, 2, 3]])
    message = "the cache holds 1 layer caches and 0 shared-block ones, but this model has 8 layers"
    with pytest.raises(ValueError, match="^" + message):
        model(ids, cache=LanguageModel({**base, "n_layers": 1}).allocate_cache(1, 4))
    message = "cache must be a ModelCache from this model's allocate_cache, got list"
    with pytest.raises(TypeError, match="^" + message):
        model(ids, cache=[])
    with pytest.raises(TypeError, match="^input_ids must be a .* integer tensor, got list"):
        model.decode_logits([[1, 2]], 1)
    with pytest.raises(TypeError, match="^prefill_len must be an int, got 2.0"):
        model.decode_logits(ids, 2.0)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[1, 10]]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"^input_ids has no tokens \(shape \(2, 0\)\); pass at least one"):
        model(torch.zeros(2, 0, dtype=torch.long))
    # Found by an audit: torch's "Internal error: NestedTensorImpl doesn't support sizes" (strided
    # layout), or (jagged) the first mixer's refusal of its x, with d_model.
    message = r"^input_ids must be a \(batch, seqlen\) integer tensor, got a nested tensor"
    for layout in (torch.strided, torch.jagged):
        ids = torch.nested.nested_tensor([torch.arange(5), torch.arange(3)], layout=layout)
        with pytest.raises(TypeError, match=message):
            model(ids)

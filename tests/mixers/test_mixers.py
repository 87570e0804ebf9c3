"""Tests of the four mixers, their caches and the registry (DESIGN.md, contract 2).

Every mixer variant is checked in float64 at tiny sizes for: full forward == prefill + decode and
== chunked prefill; cache bytes == batch * state_size; decode through the decode kernels only;
clear errors; causality; finite, non-zero gradients for every parameter.
"""

import functools
import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from mixers import (
    MIXERS,
    Attention,
    KVCache,
    LinearAttention,
    LinearAttentionCache,
    Mamba,
    MambaCache,
    RingKVCache,
    SlidingWindowAttention,
    build_mixer,
    check_setting_values,
)
from mixers.attention import apply_rope
from mixers.linear_attention import taylor_feature_map

D_MODEL = 24
BATCH = 2
SEQLEN = 13
WINDOW = 4  # < SEQLEN, and < the chunk of 6 below, so the ring wraps inside a chunk too

CONFIGS = [
    ("attention", dict(num_heads=4)),
    ("attention", dict(num_heads=6, num_kv_heads=2)),  # GQA, group of 3
    ("attention", dict(num_heads=4, pos_emb="learned", max_position=32)),
    ("attention", dict(num_heads=3, num_kv_heads=1, pos_emb="none", bias=True)),  # MQA
    ("attention", dict(num_heads=6, num_kv_heads=2, page_size=4)),  # prefill and decode cross pages
    ("sliding_window", dict(num_heads=6, num_kv_heads=2, window=WINDOW)),
    ("sliding_window", dict(num_heads=4, window=5, pos_emb="learned", max_position=32)),
    ("sliding_window", dict(num_heads=4, window=64)),  # window > max_seqlen: the ring never wraps
    ("linear_attention", dict(num_heads=4, feature_map="elu")),
    ("linear_attention", dict(num_heads=4, feature_map="elu", normalize=False, short_conv=True)),
    ("linear_attention", dict(num_heads=2, feature_map="relu", feature_dim=8, short_conv=True, d_conv=3)),
    ("linear_attention", dict(num_heads=2, feature_map="relu", normalize=False)),
    ("linear_attention", dict(num_heads=4, feature_map="identity", normalize=False, bias=True)),
    ("linear_attention", dict(num_heads=2, feature_map="taylor", feature_dim=4, short_conv=True)),
    ("linear_attention", dict(num_heads=2, feature_map="taylor", feature_dim=4, normalize=False)),
    ("mamba", dict()),
    ("mamba", dict(d_state=8, d_conv=3, expand=1, dt_rank=3, conv_bias=False, bias=True)),
]
IDS = [f"{name}-" + "-".join(f"{k}={v}" for k, v in settings.items()) for name, settings in CONFIGS]

FULL_OP = {
    "attention": "flash_attention",
    "sliding_window": "flash_attention",
    "linear_attention": "linear_attention",
    "mamba": "selective_scan",
}
DECODE_OP = {
    "attention": "flash_decode",
    "sliding_window": "flash_decode",
    "linear_attention": "linear_attention_step",
    "mamba": "selective_state_update",
}


def make_mixer(name, settings, seed=0):
    """A float64 mixer whose weights are re-drawn at unit scale.

    The default init (std 0.02) makes attention near-uniform and every mixer nearly linear, which
    would hide bugs such as a wrong RoPE offset; fan-in scaled weights make every path matter.
    Mamba's dt bias (its dt init) is kept.
    """
    torch.manual_seed(seed)
    mixer = build_mixer(name, D_MODEL, **settings).double()
    with torch.no_grad():
        for module_name, module in mixer.named_modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
                if module.bias is not None and module_name != "dt_proj":
                    module.bias.normal_(0, 0.1)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0, 1.0)
    return mixer


def inputs(batch=BATCH, seqlen=SEQLEN, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, dtype=torch.float64, generator=generator)


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# (a) full forward == prefill + decode == chunked prefill
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_prefill_then_decode_matches_full_forward(name, settings):
    mixer = make_mixer(name, settings)
    x = inputs()
    with torch.no_grad():
        expected = mixer(x)
        cache = mixer.allocate_cache(BATCH, SEQLEN + 3)
        nbytes = cache.nbytes()
        outputs = [mixer(x[:, :5], cache=cache)]
        for t in range(5, SEQLEN):
            outputs.append(mixer(x[:, t : t + 1], cache=cache))
    assert cache.seqlen == SEQLEN
    assert cache.nbytes() == nbytes  # preallocated: decoding never grows the cache
    assert_close(torch.cat(outputs, dim=1), expected)


@pytest.mark.parametrize("chunks", [(1, 3, 6, 1, 2), (2, 2, 9)], ids=["decode-first", "prefill-chunks"])
@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_chunked_prefill_matches_full_forward(name, settings, chunks):
    mixer = make_mixer(name, settings)
    x = inputs()
    with torch.no_grad():
        expected = mixer(x)
        cache = mixer.allocate_cache(BATCH, SEQLEN)
        outputs, start = [], 0
        for size in chunks:
            outputs.append(mixer(x=x[:, start : start + size], cache=cache))  # the interface names x
            start += size
    assert cache.seqlen == SEQLEN
    assert_close(torch.cat(outputs, dim=1), expected)


def test_sliding_window_wider_than_sequence_equals_attention():
    attention = make_mixer("attention", dict(num_heads=6, num_kv_heads=2))
    sliding = SlidingWindowAttention(D_MODEL, 6, window=SEQLEN, num_kv_heads=2).double()
    sliding.load_state_dict(attention.state_dict())
    x = inputs()
    assert_close(sliding(x), attention(x))
    narrow = SlidingWindowAttention(D_MODEL, 6, window=WINDOW, num_kv_heads=2).double()
    narrow.load_state_dict(attention.state_dict())
    assert (narrow(x) - attention(x)).abs().max() > 1e-3  # the window does cut attention off


@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_paged_cache_any_page_assignment(page_size):
    # Pages handed out in shuffled order (sequences interleaved in the pool): prefill, chunked
    # prefill and decode give the full forward's outputs, and every key sits where the table says.
    mixer = make_mixer("attention", dict(num_heads=6, num_kv_heads=2, page_size=page_size))
    x = inputs()
    with torch.no_grad():
        expected = mixer(x)
        cache = mixer.allocate_cache(BATCH, SEQLEN)
        assert cache.k.shape[0] == BATCH * math.ceil(SEQLEN / page_size)
        perm = torch.randperm(cache.k.shape[0], generator=torch.Generator().manual_seed(3))
        cache.block_table.copy_(perm.view_as(cache.block_table))
        outputs = [mixer(x[:, :5], cache=cache), mixer(x[:, 5:8], cache=cache)]
        outputs += [mixer(x[:, t : t + 1], cache=cache) for t in range(8, SEQLEN)]
        _, k, v = mixer._project(x, 0)
    assert_close(torch.cat(outputs, dim=1), expected)
    pages, slots = cache.slots(0, SEQLEN)
    assert_close(cache.k[pages, slots], k)
    assert_close(cache.v[pages, slots], v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors reach the Triton kernel only interpreted")
@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("attention", dict(num_heads=6, num_kv_heads=2, page_size=4)),
        ("sliding_window", dict(num_heads=4, window=5)),
    ],
    ids=["paged", "ring"],
)
def test_decode_through_the_triton_kernel(monkeypatch, name, settings):
    # The mixers' caches as the split-K kernel sees them on a GPU: pages of 4 tokens through a
    # shuffled table, and the ring viewed as one page of `window` slots per sequence.
    mixer = make_mixer(name, settings)
    x = inputs()
    with torch.no_grad():
        expected = mixer(x)
        monkeypatch.setattr(
            kernels, "flash_decode", functools.partial(kernels.flash_decode, backend="triton")
        )
        cache = mixer.allocate_cache(BATCH, SEQLEN)
        if name == "attention":
            perm = torch.randperm(cache.k.shape[0], generator=torch.Generator().manual_seed(3))
            cache.block_table.copy_(perm.view_as(cache.block_table))
        outputs = [mixer(x[:, :6], cache=cache)]
        outputs += [mixer(x[:, t : t + 1], cache=cache) for t in range(6, SEQLEN)]
    assert_close(torch.cat(outputs, dim=1), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors reach the Triton kernel only interpreted")
@pytest.mark.parametrize("settings", [dict(), dict(d_state=8, d_conv=3, expand=1, dt_rank=3, bias=True)])
def test_mamba_through_the_triton_kernels(monkeypatch, settings):
    # The Mamba block as it runs on a GPU, through the Triton conv and scan kernels with the strided
    # views the block passes them (channel-last x, z and dt; B and C slices of x_proj's output; the
    # conv's time-offset output after a cached prefill): forward, the gradients of the input and of
    # every parameter, and prefill + decode equal the reference path.
    mixer = make_mixer("mamba", settings)
    x = inputs().requires_grad_()

    def run():
        out = mixer(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *mixer.parameters()])
        with torch.no_grad():
            cache = mixer.allocate_cache(BATCH, SEQLEN)
            steps = [mixer(x[:, :6], cache=cache)] + [mixer(x[:, t : t + 1], cache=cache) for t in range(6, SEQLEN)]
        return out, grads, torch.cat(steps, dim=1)

    want = run()
    for op in ("causal_conv1d", "causal_conv1d_update", "selective_scan", "selective_state_update"):
        monkeypatch.setattr(kernels, op, functools.partial(getattr(kernels, op), backend="triton"))
    got = run()
    assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert_close(g, w)
    assert_close(got[2], want[0].detach())


# ---------------------------------------------------------------------------------------------
# (b) cache bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_cache_bytes_match_state_size(name, settings):
    mixer = make_mixer(name, settings)
    lengths = (1, 3, 7, 20, 100)
    for seqlen in lengths:
        for batch in (1, 3):
            assert mixer.allocate_cache(batch, seqlen).nbytes() == batch * mixer.state_size(seqlen)
    sizes = [mixer.state_size(s) for s in lengths]
    if name == "attention":
        # Whole pages of K and V of the KV heads only (float64), an int32 table entry each, and the
        # int32 length.
        page_bytes = 2 * mixer.page_size * mixer.num_kv_heads * mixer.head_dim * 8 + 4
        assert sizes == [math.ceil(s / mixer.page_size) * page_bytes + 4 for s in lengths]
    elif name == "sliding_window":
        per_token = 2 * mixer.num_kv_heads * mixer.head_dim * 8
        assert sizes == [min(s, mixer.window) * per_token + 4 for s in lengths]
    else:
        assert len(set(sizes)) == 1  # recurrent state: constant in seqlen
    # A new user's finding: state_size(-100) gave negative bytes, state_size("10") a TypeError from
    # inside the formula, state_size(2.5) a float. It refuses what allocate_cache refuses.
    bad_lengths = [(-100, ValueError, "> 0, got -100"), (0, ValueError, "> 0, got 0"),
                   (2.5, TypeError, "an int, got 2.5"), ("10", TypeError, "an int, got '10'")]  # fmt: skip
    for bad, error, message in bad_lengths:
        with pytest.raises(error, match=rf"^{name}: seqlen must be {message}"):
            mixer.state_size(bad)


def test_state_size_formulas():
    mamba = Mamba(D_MODEL, d_state=8, d_conv=3, expand=2)
    assert mamba.state_size(50) == (48 * 3 + 48 * 8) * 4  # fp32 state
    linear = LinearAttention(D_MODEL, 2, feature_dim=4, feature_map="taylor", short_conv=True, d_conv=3)
    features = 1 + 4 + 16
    channels = 2 * (2 * 4 + 12)
    assert linear.state_size(50) == (2 * features * 12 + 2 * features + channels * 3) * 4
    unnormalised = LinearAttention(D_MODEL, 2, feature_dim=4, normalize=False)
    assert unnormalised.state_size(50) == 2 * 4 * 12 * 4
    sliding = SlidingWindowAttention(D_MODEL, 6, window=5, num_kv_heads=2)
    assert sliding.state_size(3) == 2 * 3 * 2 * 4 * 4 + 4  # K and V slots + the int32 length
    assert sliding.state_size(50) == sliding.state_size(5) == 2 * 5 * 2 * 4 * 4 + 4


@pytest.mark.parametrize(
    ("module_dtype", "kv_dtype", "state_dtype"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.float32),  # recurrent states stay fp32
        (torch.float64, torch.float64, torch.float64),
    ],
)
def test_cache_dtype_defaults(module_dtype, kv_dtype, state_dtype):
    attention = Attention(D_MODEL, 6, num_kv_heads=2, page_size=4).to(module_dtype)
    cache = attention.allocate_cache(2, 9)
    assert isinstance(cache, KVCache)
    assert cache.k.dtype == cache.v.dtype == kv_dtype
    assert cache.k.shape == (2 * 3, 4, 2, 4)  # 3 pages of 4 tokens per sequence, only the KV heads
    assert cache.block_table.dtype == torch.int32 and cache.block_table.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert cache.nbytes() == 2 * attention.state_size(9)
    assert attention.allocate_cache(2, 9, dtype=torch.float16).k.dtype == torch.float16
    assert attention.state_size(9, torch.float16) == 3 * (2 * 4 * 2 * 4 * 2 + 4) + 4

    ring = SlidingWindowAttention(D_MODEL, 4, window=3).to(module_dtype).allocate_cache(2, 9)
    assert isinstance(ring, RingKVCache) and ring.k.shape == (2, 3, 4, 6) and ring.k.dtype == kv_dtype

    linear = LinearAttention(D_MODEL, 4, short_conv=True).to(module_dtype).allocate_cache(2, 9)
    assert isinstance(linear, LinearAttentionCache)
    assert linear.kv.dtype == linear.z.dtype == linear.conv_state.dtype == state_dtype

    mamba = Mamba(D_MODEL).to(module_dtype)
    cache = mamba.allocate_cache(2, 9)
    assert isinstance(cache, MambaCache)
    assert cache.conv_state.dtype == cache.ssm_state.dtype == state_dtype
    assert mamba.allocate_cache(2, 9, dtype=torch.bfloat16).ssm_state.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# (c) decode runs the decode kernels, not the full-sequence ones
# ---------------------------------------------------------------------------------------------


def count_kernel_calls(monkeypatch):
    """Wrap every kernel op so that calls through `kernels.<op>` are counted."""
    calls = Counter()

    def counted(op, original):
        def wrapper(*args, **kwargs):
            calls[op] += 1
            return original(*args, **kwargs)

        return wrapper

    for op in set(FULL_OP.values()) | set(DECODE_OP.values()):
        monkeypatch.setattr(kernels, op, counted(op, getattr(kernels, op)))
    return calls


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_decode_uses_decode_kernel(monkeypatch, name, settings):
    mixer = make_mixer(name, settings)
    x = inputs()
    calls = count_kernel_calls(monkeypatch)
    cache = mixer.allocate_cache(BATCH, SEQLEN)
    with torch.no_grad():
        mixer(x[:, :6], cache=cache)
        assert calls == Counter({FULL_OP[name]: 1})
        calls.clear()
        for t in range(6, 10):
            mixer(x[:, t : t + 1], cache=cache)
    assert calls == Counter({DECODE_OP[name]: 4})


# ---------------------------------------------------------------------------------------------
# (d) clear errors
# ---------------------------------------------------------------------------------------------


def test_registry_lists_the_four_mixers():
    assert MIXERS == {
        "attention": Attention,
        "sliding_window": SlidingWindowAttention,
        "linear_attention": LinearAttention,
        "mamba": Mamba,
    }


@pytest.mark.parametrize(
    ("name", "settings", "error", "match"),
    [
        ("transformer", dict(), ValueError, r"unknown mixer 'transformer'.*attention.*mamba"),
        ("mamba", dict(num_heads=4), ValueError, r"'mamba'.*num_heads"),
        ("sliding_window", dict(num_heads=4, window=2, d_state=3), ValueError, r"'sliding_window'.*d_state"),
        ("attention", dict(), ValueError, r"'attention' needs.*num_heads"),
        ("sliding_window", dict(num_heads=4), ValueError, r"'sliding_window' needs.*window"),
        ("attention", dict(num_heads=5), ValueError, r"num_heads=5 does not divide d_model=24"),
        ("linear_attention", dict(num_heads=5), ValueError, r"num_heads=5 does not divide d_model=24"),
        (
            "attention",
            dict(num_heads=6, num_kv_heads=4),
            ValueError,
            r"num_kv_heads=4 must divide num_heads=6",
        ),
        ("attention", dict(num_heads=4, pos_emb="alibi"), ValueError, r"unknown pos_emb 'alibi'"),
        ("attention", dict(num_heads=8, head_dim=3), ValueError, r"head_dim must be even"),
        ("sliding_window", dict(num_heads=4, window=0), ValueError, r"window must be > 0"),
        ("sliding_window", dict(num_heads=4, window=-3), ValueError, r"window must be > 0"),
        ("sliding_window", dict(num_heads=4, window=2.5), TypeError, r"window must be an int"),
        # Found by an audit: built, then refused at the first forward by the kernels, whose message
        # said to pass window=None, which the mixer does not take.
        (
            "sliding_window",
            dict(num_heads=4, window=2**63),
            ValueError,
            r"^sliding_window: window must be at most 2\*\*63 - 1 \(the kernels' int64\), got "
            r"9223372036854775808; a window at least as long as the sequences excludes nothing: use the "
            r"attention mixer$",
        ),
        ("linear_attention", dict(num_heads=4, feature_map="identity"), ValueError, r"normalize=True"),
        ("linear_attention", dict(num_heads=4, feature_map="cosine"), ValueError, r"unknown feature_map"),
        # The README's name of the map (a new-user check wrote feature_map=elu+1).
        ("linear_attention", dict(num_heads=4, feature_map="elu+1"), ValueError, r"\(elu is elu\(x\) \+ 1"),
        ("mamba", dict(dt_rank="full"), ValueError, r"dt_rank"),
        ("mamba", dict(dt_min=0.1, dt_max=0.01), ValueError, r"dt_min <= dt_max"),
        # Found by an audit: NaN passed the checks and gave NaN biases, inf failed inside torch's init.
        ("mamba", dict(dt_init_floor=math.nan), ValueError,
         r"^mamba: dt_init_floor must be a finite number >= 0, got nan"),
        ("mamba", dict(dt_max=math.inf), ValueError, r"^mamba: dt_max must be a finite number > 0, got inf"),
        ("mamba", dict(dt_scale=math.inf), ValueError, r"^mamba: dt_scale must be a finite number > 0"),
        ("mamba", dict(dt_min="0.001"), TypeError, r"^mamba: dt_min must be a number, got '0.001'$"),
        ("attention", dict(num_heads=4, rope_base="10000"), TypeError,
         r"^attention: rope_base must be a number, got '10000'$"),
        ("attention", dict(num_heads=4, rope_base=math.inf), ValueError,
         r"rope_base must be a finite number > 1, got inf"),
        ("attention", dict(num_heads=4, rope_base=1), ValueError,
         r"rope_base must be a finite number > 1, got 1"),
        # Config strings for boolean settings (Hydra passes `short_conv=no` as "no") must not become True.
        (
            "linear_attention",
            dict(num_heads=4, short_conv="no"),
            TypeError,
            r"^linear_attention: short_conv must be true or false, got 'no'$",
        ),
        (
            "linear_attention",
            dict(num_heads=4, normalize="no"),
            TypeError,
            r"^linear_attention: normalize must be true or false, got 'no'$",
        ),
        ("linear_attention", dict(num_heads=4, bias=1), TypeError, r"bias must be true or false, got 1"),
        ("mamba", dict(bias="no"), TypeError, r"^mamba: bias must be true or false, got 'no'$"),
        ("mamba", dict(conv_bias="false"), TypeError, r"^mamba: conv_bias must be true or false"),
        ("attention", dict(num_heads=4, bias="no"), TypeError, r"^attention: bias must be true or false"),
        (
            "sliding_window",
            dict(num_heads=4, window=2, bias=0),
            TypeError,
            r"^sliding_window: bias must be true or false, got 0$",
        ),
        # A new-user check (hybrid_zamba with mixer.shared_block.mixer=sliding_window) got the names
        # alone; the message says where they go.
        (
            "sliding_window",
            {},
            ValueError,
            re.escape(
                "mixer 'sliding_window' needs the setting(s) ['num_heads', 'window'], which have no "
                "default: give them in the model config's mixer_settings['sliding_window'] (on train.py's "
                "command line: +mixer.settings.sliding_window.num_heads=<value> "
                "+mixer.settings.sliding_window.window=<value>;"
            ),
        ),
    ],
)
def test_bad_settings_raise_clear_errors(name, settings, error, match):
    with pytest.raises(error, match=match):
        build_mixer(name, D_MODEL, **settings)


def test_values_of_a_mixer_missing_its_required_settings_are_checked():
    """A new-user check: ``mixer=mamba +mixer.settings.attention.pos_emb=bogus`` trained, nothing
    giving the num_heads that attention needs to be built. The missing settings are tried at the
    divisors of d_model: refused only when no choice builds the mixer, naming the first choice."""
    with pytest.raises(ValueError, match=re.escape(
        "attention: unknown pos_emb 'bogus'; choose one of ('rope', 'learned', 'none') (num_heads not "
        "given for attention: tried at each divisor of d_model=64, from num_heads=1)"
    )):
        check_setting_values("attention", 64, {"pos_emb": "bogus"})
    with pytest.raises(ValueError, match=re.escape(
        "(num_heads and window not given for sliding_window: tried at each divisor of d_model=64, from "
        "num_heads=1, window=1)"
    )):
        check_setting_values("sliding_window", 64, {"pos_emb": "bogus"})
    with pytest.raises(ValueError, match=re.escape("sliding_window: window must be > 0, got 0 (num_heads")):
        check_setting_values("sliding_window", 64, {"window": 0})
    # A refusal that depends on the value tried is said as the try's (a new-user check: "num_kv_heads=3
    # must divide num_heads=1", with num_heads not given at all).
    with pytest.raises(ValueError, match=re.escape(
        "attention: these settings build it at no num_heads (not given for attention; tried at each divisor "
        "of d_model=64); at num_heads=1: num_kv_heads=3 must divide num_heads=1 (each KV head serves"
    )):
        check_setting_values("attention", 64, {"num_kv_heads": 3})
    check_setting_values("attention", 64, {"num_kv_heads": 2})  # num_heads=2 builds it
    # Valid for some choice: 2 KV heads divide num_heads=2, 4, ... (not the first choice, 1).
    check_setting_values("attention", 64, {"num_kv_heads": 2})
    # A value the model gives (another mixer's num_heads) is the only choice: no note about it.
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4 \(each KV head serves a "
                       r"whole group of query heads\)$"):
        check_setting_values("attention", 64, {"num_kv_heads": 3}, {"num_heads": 4})


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_cache_misuse_raises(name, settings):
    mixer = make_mixer(name, settings)
    x = inputs(seqlen=6)
    cache = mixer.allocate_cache(BATCH, 5)
    mixer(x[:, :4], cache=cache)
    with pytest.raises(ValueError, match="cache overflow.*max_seqlen=5"):
        mixer(x[:, 4:6], cache=cache)
    assert cache.seqlen == 4  # the failed call consumed nothing
    with pytest.raises(ValueError, match="batch size 2 .* 3 sequences"):
        mixer(x, cache=mixer.allocate_cache(3, 8))
    with pytest.raises(ValueError, match=r"shape \(B, T, d_model=24\)"):
        mixer(torch.randn(2, 5, D_MODEL + 1, dtype=torch.float64))


@pytest.mark.parametrize(
    ("name", "settings", "owner", "owner_settings", "error", "match"),
    [
        ("attention", dict(num_heads=4), "mamba", dict(), TypeError,
         r"^attention: the cache is a MambaCache, but this layer keeps a KVCache: a cache of another mixer"),
        ("attention", dict(num_heads=4), "sliding_window", dict(num_heads=4, window=3), TypeError,
         r"the cache is a RingKVCache, but this layer keeps a KVCache"),
        ("sliding_window", dict(num_heads=4, window=3), "attention", dict(num_heads=4), TypeError,
         r"the cache is a KVCache, but this layer keeps a RingKVCache"),
        ("attention", dict(num_heads=4), "attention", dict(num_heads=4, num_kv_heads=2), ValueError,
         r"^attention: the cache's k is \(2, 64, 2, 6\), but this layer needs \(\.\.\., 64, 4, 6\)"),
        ("sliding_window", dict(num_heads=4, window=3), "sliding_window", dict(num_heads=2, window=3),
         ValueError,
         r"the cache's k is \(2, 3, 2, 12\), but this layer needs \(\.\.\., 4, 6\)"),
        ("mamba", dict(d_conv=4), "mamba", dict(d_conv=2), ValueError,
         r"^mamba: the cache's conv_state is \(2, 48, 2\), but this layer needs \(\.\.\., 48, 4\)"),
        # A silent wrong result before: the short convolutions ran without their window.
        ("linear_attention", dict(num_heads=4, short_conv=True), "linear_attention", dict(num_heads=4),
         ValueError, r"^linear_attention: the cache has no conv_state, which this layer's settings need"),
        ("linear_attention", dict(num_heads=4, normalize=False), "linear_attention", dict(num_heads=4),
         ValueError, r"the cache has a z, which this layer's settings do not use"),
    ],
)  # fmt: skip
def test_a_cache_of_another_mixer_or_settings_is_refused(name, settings, owner, owner_settings, error, match):
    # Found by an audit: such caches failed deep in torch (a shape mismatch, an AttributeError) or ran.
    mixer = make_mixer(name, settings)
    cache = make_mixer(owner, owner_settings).allocate_cache(BATCH, 8)
    before = [t.clone() for t in cache.tensors()]
    with pytest.raises(error, match=match):
        mixer(inputs(seqlen=3), cache=cache)
    assert cache.seqlen == 0 and all(torch.equal(a, b) for a, b in zip(before, cache.tensors(), strict=True))


def test_a_cache_on_another_device_or_in_another_dtype_is_refused():
    mixer = make_mixer("attention", dict(num_heads=4))  # float64 weights
    with pytest.raises(ValueError, match=r"the cache's k is on meta but the layer's weights are on cpu"):
        mixer(inputs(seqlen=3), cache=mixer.allocate_cache(BATCH, 8, device="meta"))
    message = "the cache holds torch.float16 keys but this layer computes torch.float64 ones"
    with pytest.raises(TypeError, match=message):
        mixer(inputs(seqlen=3), cache=mixer.allocate_cache(BATCH, 8, dtype=torch.float16))
    for name, settings in [("attention", dict(num_heads=4)), ("mamba", dict()),
                           ("linear_attention", dict(num_heads=4))]:  # fmt: skip
        for dtype in ("float16", torch.int64):
            message = f"cache dtype must be a floating-point torch.dtype, got {dtype!r}"
            with pytest.raises(TypeError, match=message):
                make_mixer(name, settings).allocate_cache(BATCH, 8, dtype=dtype)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_bad_input_dtypes_raise_clear_errors(name):
    settings = next(settings for mixer_name, settings in CONFIGS if mixer_name == name)
    mixer = build_mixer(name, D_MODEL, **settings)  # float32 weights
    token_ids = torch.arange(10).reshape(2, 5)
    with pytest.raises(TypeError, match=r"got a torch.int64 tensor of shape \(2, 5\); token ids") as err:
        mixer(token_ids)
    assert f"{name}: x must be a floating-point tensor of shape (B, T, d_model=24) in torch.float32" in str(
        err.value
    )
    assert "tensor(" not in str(err.value)  # the dtype and shape, not the values
    for dtype in (torch.float64, torch.bfloat16):
        match = (
            rf"^{name}: x is {dtype} but the mixer's weights are torch.float32: cast x with "
            rf"x.to\(torch.float32\) or the module with .to\({dtype}\)"
        )
        with pytest.raises(TypeError, match=match):
            mixer(torch.randn(2, 5, D_MODEL, dtype=dtype))
    # Under autocast (training's bf16-mixed) a bf16 input with float32 weights is fine.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(torch.randn(2, 5, D_MODEL, dtype=torch.bfloat16))
    assert y.shape == (2, 5, D_MODEL) and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_input_on_another_device_than_the_weights_is_refused(name):
    # Found by an audit: x on the meta device failed deep in torch (Mamba: "unknown device type for
    # autocast"), in a kernel's device check (linear attention's short conv) or ran on meta (attention).
    settings = next(settings for mixer_name, settings in CONFIGS if mixer_name == name)
    mixer = build_mixer(name, D_MODEL, **settings)  # float32 weights on the CPU
    match = r"^" + name + r": x is on meta but the mixer's weights are on cpu: move x with x.to\('cpu'\)"
    for cache in (None, mixer.allocate_cache(2, 8)):
        with pytest.raises(ValueError, match=match):
            mixer(torch.randn(2, 5, D_MODEL, device="meta"), cache=cache)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_nested_input_is_refused(name):
    # Found by an audit: torch's "Internal error: NestedTensorImpl doesn't support sizes" (strided
    # layout) or errors from deep in the forward (jagged: "Permute is not supported on the batch dimension").
    settings = next(settings for mixer_name, settings in CONFIGS if mixer_name == name)
    mixer = build_mixer(name, D_MODEL, **settings)
    x = torch.nested.nested_tensor([torch.randn(5, D_MODEL), torch.randn(3, D_MODEL)], layout=torch.jagged)
    match = rf"^{name}: x must be a floating-point tensor of shape \(B, T, d_model=24\), got a nested tensor"
    with pytest.raises(TypeError, match=match):
        mixer(x)


def test_learned_positions_beyond_table_raise():
    mixer = Attention(D_MODEL, 4, pos_emb="learned", max_position=8).double()
    with pytest.raises(ValueError, match="max_position=8"):
        mixer(inputs(seqlen=9))
    cache = mixer.allocate_cache(BATCH, 16)
    mixer(inputs(seqlen=8), cache=cache)
    with pytest.raises(ValueError, match="max_position=8"):
        mixer(inputs(seqlen=1), cache=cache)


# ---------------------------------------------------------------------------------------------
# (e) causality, (f) gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_future_tokens_do_not_change_the_past(name, settings):
    mixer = make_mixer(name, settings)
    x = inputs()
    changed = x.clone()
    changed[:, 7:] = inputs(seed=2)[:, 7:]
    with torch.no_grad():
        y, y_changed = mixer(x), mixer(changed)
    assert_close(y_changed[:, :7], y[:, :7])
    assert (y_changed[:, 7:] - y[:, 7:]).abs().amax() > 1e-3


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_gradients_reach_every_parameter(name, settings):
    mixer = make_mixer(name, settings)
    x = inputs().requires_grad_()
    weights = inputs(seed=3)  # a generic loss: a plain sum could cancel by symmetry
    (mixer(x) * weights).sum().backward()
    assert torch.isfinite(x.grad).all()
    for param_name, param in mixer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().amax() > 0, param_name


# ---------------------------------------------------------------------------------------------
# pieces with a closed form
# ---------------------------------------------------------------------------------------------


def test_taylor_feature_map_approximates_exp():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 16, dtype=torch.float64, generator=generator)
    phi_q, phi_k = taylor_feature_map(q), taylor_feature_map(k)
    assert phi_q.shape == (5, 1 + 16 + 256)
    a = (q * k).sum(-1) / 4.0  # q·k / sqrt(d)
    assert_close((phi_q * phi_k).sum(-1), 1 + a + a**2 / 2)


def test_mamba_init():
    mixer = Mamba(D_MODEL, d_state=6, dt_min=0.01, dt_max=0.05)
    assert mixer.dt_rank == math.ceil(D_MODEL / 16)
    dt = F.softplus(mixer.dt_proj.bias.detach())
    assert (dt >= 0.01 - 1e-6).all() and (dt <= 0.05 + 1e-6).all()
    A = -torch.exp(mixer.A_log.detach())
    torch.testing.assert_close(A, -torch.arange(1.0, 7.0).repeat(mixer.d_inner, 1))
    assert torch.equal(mixer.D.detach(), torch.ones(mixer.d_inner))
    assert mixer.A_log._no_weight_decay and mixer.D._no_weight_decay


# ---------------------------------------------------------------------------------------------
# each mixer against a naive transcription of its paper's equations
# ---------------------------------------------------------------------------------------------


def naive_attention(mixer, x):
    """Softmax attention written out: complex-number RoPE, explicit causal / window mask, GQA by
    repeating KV heads."""
    B, T, _ = x.shape
    H, Hkv, Dh = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    if mixer.pos_emb == "learned":
        x = x + mixer.wpe.weight[:T]
    q, k, v = mixer.qkv_proj(x).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q, k, v = q.view(B, T, H, Dh), k.view(B, T, Hkv, Dh), v.view(B, T, Hkv, Dh)
    if mixer.pos_emb == "rope":
        # Dims i and i + Dh/2 form the complex number x_i + j x_{i+Dh/2}, rotated by t * base^(-2i/Dh).
        theta = torch.arange(T, dtype=torch.float64)[:, None] * mixer.rope_base ** (
            -torch.arange(0, Dh, 2, dtype=torch.float64) / Dh
        )
        rotation = torch.polar(torch.ones_like(theta), theta)[None, :, None, :]  # (1, T, 1, Dh/2)

        def rotate(t):
            rotated = torch.complex(t[..., : Dh // 2], t[..., Dh // 2 :]) * rotation
            return torch.cat([rotated.real, rotated.imag], dim=-1)

        q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(Dh)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & ((j > i - mixer.window) if mixer.window else True)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return mixer.out_proj(torch.einsum("bhij,bjhd->bihd", probs, v).reshape(B, T, H * Dh))


def naive_causal_conv(x, conv):
    """Causal depthwise conv of x (B, T, C) as a dot of each length-d_conv window with the kernel."""
    d_conv = conv.kernel_size[0]
    windows = F.pad(x, (0, 0, d_conv - 1, 0)).unfold(1, d_conv, 1)  # (B, T, C, d_conv)
    out = torch.einsum("btcw,cw->btc", windows, conv.weight[:, 0])
    return out if conv.bias is None else out + conv.bias


def naive_linear_attention(mixer, x):
    """Linear attention as an explicit causal kernel matrix kappa(q_t, k_s), independent of the
    feature-map code."""
    B, T, _ = x.shape
    H, Fd, Dh = mixer.num_heads, mixer.feature_dim, mixer.head_dim
    qkv = mixer.qkv_proj(x)
    if mixer.short_conv:
        qkv = F.silu(naive_causal_conv(qkv, mixer.conv))
    q, k, v = qkv.split([H * Fd, H * Fd, H * Dh], dim=-1)
    q, k, v = q.view(B, T, H, Fd), k.view(B, T, H, Fd), v.view(B, T, H, Dh)
    if mixer.feature_map == "taylor":
        a = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(Fd)
        kernel = 1 + a + a**2 / 2  # 2nd-order Taylor expansion of exp(q·k / sqrt(d)), scale 1
    else:
        phi = {"elu": lambda t: F.elu(t) + 1, "relu": F.relu, "identity": lambda t: t}[mixer.feature_map]
        kernel = torch.einsum("bihd,bjhd->bhij", phi(q), phi(k)) / math.sqrt(Fd)
    kernel = torch.tril(kernel)
    out = torch.einsum("bhij,bjhd->bihd", kernel, v)
    if mixer.normalize:
        out = out / (rearrange_heads_last(kernel.sum(-1)) + 1e-10)  # the kernels' default eps
    return mixer.out_proj(out.reshape(B, T, H * Dh))


def rearrange_heads_last(t):
    """(B, H, T) -> (B, T, H, 1)."""
    return t.permute(0, 2, 1)[..., None]


def naive_mamba(mixer, u):
    """The Mamba block step by step (Gu & Dao 2023, Algorithm 2 and eq. 2a-2b)."""
    T = u.shape[1]
    x, z = mixer.in_proj(u).chunk(2, dim=-1)  # (B, T, E)
    x = F.silu(naive_causal_conv(x, mixer.conv1d))
    dt, B, C = mixer.x_proj(x).split([mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
    dt = F.softplus(mixer.dt_proj(dt))  # (B, T, E)
    A = -torch.exp(mixer.A_log)  # (E, N)
    h = u.new_zeros(u.shape[0], mixer.d_inner, mixer.d_state)
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1) + mixer.D * x[:, t])
    y = torch.stack(ys, dim=1) * F.silu(z)
    return mixer.out_proj(y)


NAIVE = {
    "attention": naive_attention,
    "sliding_window": naive_attention,
    "linear_attention": naive_linear_attention,
    "mamba": naive_mamba,
}


@pytest.mark.parametrize(("name", "settings"), CONFIGS, ids=IDS)
def test_matches_naive_transcription(name, settings):
    mixer = make_mixer(name, settings)
    x = inputs()
    with torch.no_grad():
        assert_close(mixer(x), NAIVE[name](mixer, x))


def test_rope_scores_depend_only_on_relative_position():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 6, 3, 8, dtype=torch.float64, generator=generator)
    scores = [
        torch.einsum("bihd,bjhd->bhij", apply_rope(q, offset, 500.0), apply_rope(k, offset, 500.0))
        for offset in (0, 37)
    ]
    assert_close(scores[1], scores[0])
    assert_close(apply_rope(q, 0, 500.0)[:, :1], q[:, :1])  # position 0 is not rotated
    assert_close(apply_rope(q, 5, 500.0).norm(dim=-1), q.norm(dim=-1))  # a rotation

"""Sequence mixers and their registry (DESIGN.md, contract 2).

Every mixer maps (B, T, d_model) -> (B, T, d_model) and is used the same way::

    mixer = build_mixer("mamba", d_model=64, d_state=16)
    y = mixer(x)                                   # full sequence (training, prefill)
    cache = mixer.allocate_cache(batch_size, max_seqlen)
    y = mixer(x_new, cache=cache)                  # T new tokens: prefill, chunked prefill or decode
    cache.nbytes() == batch_size * mixer.state_size(max_seqlen)
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixers.attention import Attention, KVCache
from mixers.common import MixerCache
from mixers.linear_attention import LinearAttention, LinearAttentionCache
from mixers.mamba import Mamba, MambaCache
from mixers.sliding_window import RingKVCache, SlidingWindowAttention

__all__ = [
    "MIXERS",
    "build_mixer",
    "check_setting_names",
    "check_setting_values",
    "Attention",
    "SlidingWindowAttention",
    "LinearAttention",
    "Mamba",
    "MixerCache",
    "KVCache",
    "RingKVCache",
    "LinearAttentionCache",
    "MambaCache",
]

MIXERS: dict[str, type[nn.Module]] = {
    "attention": Attention,
    "sliding_window": SlidingWindowAttention,
    "linear_attention": LinearAttention,
    "mamba": Mamba,
}


def _settings_of(cls: type[nn.Module]) -> dict[str, inspect.Parameter]:
    """Named constructor settings of a mixer class (d_model excluded), following **kwargs into the base
    classes (SlidingWindowAttention forwards them to Attention)."""
    settings: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters
        for name, param in params.items():
            if name not in ("self", "d_model") and param.kind not in (
                param.VAR_KEYWORD,
                param.VAR_POSITIONAL,
            ):
                settings.setdefault(name, param)
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return settings


def setting_names(name: str) -> tuple[str, ...]:
    """The settings mixer ``name`` takes (its constructor's arguments but d_model), in their order.

    Raises:
        KeyError: an unknown mixer name.
    """
    return tuple(_settings_of(MIXERS[name]))


def check_setting_names(name: str, settings: Mapping[str, Any]) -> None:
    """Check that ``name`` is a registered mixer and that it takes every key of ``settings`` (not
    their values, which its constructor checks): a model config's settings for a mixer its layout
    does not use are checked this way too, so a misspelt key is never carried along unread.

    Raises:
        ValueError: unknown name (lists the known ones), or settings the mixer does not take (names
            them and the mixer's settings).
    """
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known mixers: {sorted(MIXERS)}")
    known = _settings_of(MIXERS[name])
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"mixer {name!r} has no setting(s) {unknown}; its settings are {sorted(known)}")


def check_setting_values(
    name: str, d_model: int, settings: Mapping[str, Any], fill: Mapping[str, Any] | None = None
) -> None:
    """Check the values of ``settings`` for mixer ``name`` at width ``d_model`` as its constructor
    checks them, by building it on the meta device (no memory, no initialisation arithmetic): for
    the settings of a mixer the layout does not use, which are otherwise never read (a new-user
    check: ``mixer=attention +mixer.settings.mamba.d_state=0`` trained without a word, while a
    misspelt key there is refused). A required setting missing from ``settings`` is taken from
    ``fill`` (the model's value for a setting of that name, e.g. another mixer's ``num_heads``);
    where ``fill`` has none either, it is tried at each divisor of ``d_model`` (a head count, a
    window), and the values are refused only when no choice builds the mixer (a new-user check:
    ``mixer=mamba +mixer.settings.attention.pos_emb=bogus`` trained, no num_heads being given). The
    names are :func:`check_setting_names`'s to check, before this (as
    :class:`models.config.ModelConfig` does).

    Raises:
        ValueError, TypeError: the constructor's, e.g. ``mamba: d_state must be > 0, got 0``, for the
            first choice of the missing settings, which the message names (as the place the refusal
            was met where it names that choice: ``num_kv_heads=3`` divides no head count of
            ``d_model=64``).
    """
    fill = fill or {}
    known = _settings_of(MIXERS[name])
    required = [s for s, p in known.items() if p.default is p.empty and s not in settings]
    divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
    choices = [[fill[s]] if s in fill else divisors for s in required]
    first = None
    for values in itertools.product(*choices):
        try:
            with torch.device("meta"):
                MIXERS[name](d_model, **dict(zip(required, values, strict=True)), **settings)
            return
        except (ValueError, TypeError) as err:
            first = first or (err, values)
    err, values = first
    tried = [s for s, c in zip(required, choices, strict=True) if c is divisors]
    if not tried:
        raise err
    first_try = ", ".join(f"{s}={v}" for s, v in zip(required, values, strict=True) if s in tried)
    if any(f"{s}={v}" in str(err) for s, v in zip(required, values, strict=True) if s in tried):
        # The refusal names the value tried (num_kv_heads=3 "must divide num_heads=1"): said as the
        # first try's, not as if that value had been given (a new-user check).
        reason = str(err).removeprefix(f"{name}: ")
        raise type(err)(
            f"{name}: these settings build it at no {' and '.join(tried)} (not given for {name}; tried at "
            f"each divisor of d_model={d_model}); at {first_try}: {reason}"
        ) from None
    raise type(err)(
        f"{err} ({' and '.join(tried)} not given for {name}: tried at each divisor of d_model={d_model}, "
        f"from {first_try})"
    ) from None


def build_mixer(name: str, d_model: int, **settings) -> nn.Module:
    """Build a registered mixer: `MIXERS[name](d_model, **settings)`.

    Args:
        name: one of MIXERS ("attention", "sliding_window", "linear_attention", "mamba").
        d_model: model width.
        **settings: the mixer's constructor arguments (e.g. num_heads, window, d_state).

    Returns:
        The mixer, an nn.Module mapping (B, T, d_model) -> (B, T, d_model).

    Raises:
        ValueError: unknown name (lists the known ones), a setting the mixer does not take, or a
            required setting missing (both name the setting and the mixer); and whatever the mixer's
            constructor raises for bad values.
    """
    check_setting_names(name, settings)
    cls = MIXERS[name]
    known = _settings_of(cls)
    missing = [s for s, p in known.items() if p.default is p.empty and s not in settings]
    if missing:
        # A shared block's mixer (mixer.shared_block.mixer=sliding_window) may have no settings in
        # the layout's config: say where they go (a new-user check got only the names).
        add = " ".join(f"+mixer.settings.{name}.{setting}=<value>" for setting in missing)
        raise ValueError(
            f"mixer {name!r} needs the setting(s) {missing}, which have no default: give them in the model "
            f"config's mixer_settings[{name!r}] (on train.py's command line: {add}; conf/mixer/{name}.yaml "
            "has values)"
        )
    return cls(d_model, **settings)

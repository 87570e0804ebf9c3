"""Model configuration: validation and per-layer layouts.

A model is described by a plain dict (what Hydra composes and what the LightningModule saves in
its checkpoint); :class:`ModelConfig` validates it once, up front, so that every mistake a user can
make in a config (an unknown mixer, a pattern that does not divide ``n_layers``, heads that do not
divide ``d_model``) is a clear ``ValueError`` before any tensor is allocated.

A *layout* is the explicit per-layer list of mixer names. Mixer configs give a *pattern*, e.g.
Jamba's ``[mamba]*4 + [attention] + [mamba]*3`` (Lieber et al. 2024, Fig. 1: one attention layer
per 8-layer period); the pattern is repeated to fill the model's ``n_layers``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import mixers

MLP_KINDS = ("swiglu", "none")
# A model config in Python, for the message refusing something else.
EXAMPLE_CONFIG = (
    "{'vocab_size': 256, 'd_model': 64, 'n_layers': 2, 'pattern': ['attention'], "
    "'mixer_settings': {'attention': {'num_heads': 4}}}"
)
# What a preset's name is, for a string given as a model config.
PRESET_HINT = (
    "; the sizes tiny, small and base are Hydra presets (conf/model/<size>.yaml, with a layout from "
    "conf/mixer/<mixer>.yaml) that train.py composes; a trained model is rebuilt with "
    "models.lit.load_model(<checkpoint>)"
)


def expand_layout(pattern: Sequence[str], n_layers: int) -> list[str]:
    """Repeat a mixer pattern to fill ``n_layers`` layers.

    Args:
        pattern: mixer names of one period, e.g. ``["mamba", "attention"]``.
        n_layers: number of layers of the model.

    Returns:
        ``list[str]`` of length ``n_layers``.

    Raises:
        ValueError: empty pattern, ``n_layers`` < 1, a pattern length that does not divide
            ``n_layers``, or an unknown mixer name.
    """
    pattern = list(pattern)
    if not pattern:
        raise ValueError(
            "the mixer pattern is empty: give at least one mixer name, e.g. pattern: [attention]"
        )
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    for name in pattern:
        if name not in mixers.MIXERS:
            raise ValueError(
                f"unknown mixer {name!r} in the pattern {pattern}; known mixers: {sorted(mixers.MIXERS)}"
            )
    if n_layers % len(pattern) != 0:
        raise ValueError(
            f"the mixer pattern {pattern} has {len(pattern)} layers, which does not divide "
            f"n_layers={n_layers}; choose n_layers as a multiple of {len(pattern)} "
            f"(e.g. model.n_layers={len(pattern) * max(1, round(n_layers / len(pattern)))})"
        )
    return pattern * (n_layers // len(pattern))


@dataclasses.dataclass
class SharedBlockConfig:
    """Zamba's shared attention+MLP block (Glorioso et al. 2024, Sec. 2).

    One block whose weights are reused every ``every`` layers, fed the concatenation of the hidden
    state and the input embeddings.

    Attributes:
        every: the block runs after every ``every``-th backbone layer (1-based), so a model of
            ``n_layers`` layers invokes it ``n_layers // every`` times.
        mixer: mixer name inside the shared block (normally ``attention``).
    """

    every: int
    mixer: str = "attention"

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"shared_block.every must be an integer >= 1, got {self.every!r}")
        if self.mixer not in mixers.MIXERS:
            raise ValueError(
                f"unknown mixer {self.mixer!r} in shared_block; known mixers: {sorted(mixers.MIXERS)}"
            )


@dataclasses.dataclass
class ModelConfig:
    """Validated configuration of :class:`models.LanguageModel`.

    Attributes:
        vocab_size: number of token ids (embedding rows; the head is tied to the embedding).
        d_model: residual stream width.
        n_layers: number of blocks (mixer + MLP).
        pattern: mixer names of one layout period, repeated to fill ``n_layers``.
        mixer_settings: per mixer name, the keyword arguments of its constructor
            (``{"attention": {"num_heads": 4}, "mamba": {"d_state": 16}}``); names absent from
            the layout are ignored, so one config can carry settings for several mixers.
        mlp: ``"swiglu"`` (Shazeer 2020) or ``"none"`` (Zoology's MQAR setting).
        mlp_ratio: SwiGLU hidden width is ``mlp_ratio * 2/3 * d_model`` rounded up to 16, which
            keeps the parameter count of a ``mlp_ratio``-wide GELU MLP.
        norm_eps: RMSNorm epsilon.
        embed_dropout: dropout probability on the token embeddings before the first block
            (nanoGPT's ``transformer.drop``; Zoology's ``embed_dropout``), in [0, 1).
        resid_dropout: dropout probability on every mixer and MLP output before it joins the
            residual stream (nanoGPT's ``resid_dropout``; Zoology's ``resid_dropout``), in [0, 1).
            Dropout of attention probabilities is not available: the attention kernels have none.
        shared_block: Zamba's shared block, or ``None``.
        name: a label for records and logs (e.g. ``hybrid_jamba``).

    Raises:
        ValueError: on any invalid field (see :func:`expand_layout`), non-positive sizes (bools
            too), an unknown MLP kind, an mlp_ratio or norm_eps that is not a finite number > 0, a
            dropout outside [0, 1), a pattern that is not a list, settings that are not a mapping of
            mappings or given for an unknown mixer, a shared block that is not a mapping of its
            keys.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    pattern: list[str]
    mixer_settings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    mlp: str = "swiglu"
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-5
    embed_dropout: float = 0.0
    resid_dropout: float = 0.0
    shared_block: SharedBlockConfig | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field} must be a positive integer, got {value!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; choose one of {MLP_KINDS}")
        for field in ("mlp_ratio", "norm_eps"):  # finite: NaN or inf would give NaN or a failed init
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"model.{field} must be a finite number > 0, got {value!r}")
        for field in ("embed_dropout", "resid_dropout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"model.{field} must be a probability in [0, 1), got {value!r}")
        if isinstance(self.pattern, (str, bytes)) or not isinstance(self.pattern, Sequence):
            raise ValueError(f"model.pattern must be a list of mixer names, got {self.pattern!r}")
        self.pattern = [str(name) for name in self.pattern]
        if not isinstance(self.mixer_settings, Mapping) or not all(
            isinstance(v, Mapping) or v is None for v in self.mixer_settings.values()
        ):
            raise ValueError(
                "model.mixer_settings must map mixer names to their settings ({'mamba': {'d_state': 16}}), "
                f"got {self.mixer_settings!r}"
            )
        self.mixer_settings = {str(k): dict(v or {}) for k, v in dict(self.mixer_settings).items()}
        for name, settings in self.mixer_settings.items():
            if name not in mixers.MIXERS:
                raise ValueError(
                    f"settings given for unknown mixer {name!r}; known mixers: {sorted(mixers.MIXERS)}"
                )
            mixers.check_setting_names(name, settings)  # also for a mixer the layout does not use
        if isinstance(self.shared_block, Mapping):
            valid = sorted(f.name for f in dataclasses.fields(SharedBlockConfig))
            unknown = sorted(set(self.shared_block) - set(valid))
            if unknown:
                raise ValueError(f"unknown shared_block keys {unknown}; valid keys: {valid}")
            self.shared_block = SharedBlockConfig(**self.shared_block)
        elif self.shared_block is not None and not isinstance(self.shared_block, SharedBlockConfig):
            raise ValueError(
                "model.shared_block must be null or {every: <layers>, mixer: <name>}, got "
                f"{self.shared_block!r}"
            )
        layout = expand_layout(self.pattern, self.n_layers)  # validates the pattern against n_layers
        used = set(layout) | ({self.shared_block.mixer} if self.shared_block is not None else set())
        fill = {k: v for name in used for k, v in self.mixer_settings.get(name, {}).items()}
        for name, settings in self.mixer_settings.items():
            if name in used or not settings:
                continue  # a used mixer's constructor checks its own when the model is built
            try:
                mixers.check_setting_values(name, self.d_model, settings, fill)
            except (ValueError, TypeError) as err:
                raise type(err)(
                    f"{err} (in the settings of {name}, which this model's layout does not use: "
                    f"correct or remove them)"
                ) from None

    @property
    def layout(self) -> list[str]:
        """Per-layer mixer names, length ``n_layers``."""
        return expand_layout(self.pattern, self.n_layers)

    @property
    def d_intermediate(self) -> int:
        """SwiGLU hidden width (0 when ``mlp == "none"``)."""
        if self.mlp == "none":
            return 0
        return 16 * math.ceil(self.mlp_ratio * 2 * self.d_model / 3 / 16)

    def settings_for(self, name: str) -> dict[str, Any]:
        """Constructor keyword arguments for mixer ``name`` (empty dict if none were given)."""
        return dict(self.mixer_settings.get(name, {}))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a plain dict (e.g. ``OmegaConf.to_container(cfg.model)``).

        Raises:
            TypeError: ``config`` is not a mapping (a preset's name such as ``"tiny"`` included).
            ValueError: unknown keys (with the list of valid ones) or invalid values.
        """
        if not isinstance(config, Mapping):
            # a new-user check: LanguageModel("tiny") was told of unknown keys ['i', 'n', 't', 'y']
            raise TypeError(
                f"a model config must be a ModelConfig or a mapping of its fields, got "
                f"{type(config).__name__} {config!r}; e.g. {EXAMPLE_CONFIG}"
                + (PRESET_HINT if isinstance(config, str) else "")
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(config) - names
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; valid keys: {sorted(names)}")
        return cls(**dict(config))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, the inverse of :meth:`from_dict` (JSON/YAML serialisable)."""
        return dataclasses.asdict(self)


# Keys of a ``model=`` config group (conf/model/*.yaml): the ModelConfig sizes it sets, its name, and
# num_heads, which the mixer configs read through ``${model.num_heads}``.
MODEL_GROUP_KEYS = (
    "name", "d_model", "n_layers", "num_heads", "mlp", "mlp_ratio", "norm_eps", "embed_dropout", "resid_dropout",
)  # fmt: skip


# Keys of a ``mixer=`` config group (conf/mixer/*.yaml).
MIXER_GROUP_KEYS = ("name", "pattern", "settings", "shared_block")


def config_from_groups(model: Mapping[str, Any], mixer: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """The plain-dict :class:`ModelConfig` of a composed run: the ``model`` group's sizes with the
    ``mixer`` group's pattern, settings and shared block (both resolved to plain containers).

    Settings for a mixer that no layer of the layout uses are kept, unused: experiment configs set,
    say, ``mixer.settings.attention`` for every mixer a sweep may pick. Their names are checked, and
    their values where the mixer can be built from them (:meth:`ModelConfig.from_dict`).

    Raises:
        ValueError: a key the model or mixer group does not have (a typo such as ``+model.foo=1``
            or ``+mixer.foo=1``, which would otherwise change nothing), settings that are not a
            mapping, a pattern given as a string instead of a list, or what
            :meth:`ModelConfig.from_dict` refuses (a setting a mixer does not take, even a mixer the
            layout does not use).
    """
    unknown = sorted(set(model) - set(MODEL_GROUP_KEYS))
    if unknown:
        raise ValueError(f"unknown model keys {unknown}; valid keys: {sorted(MODEL_GROUP_KEYS)}")
    unknown = sorted(set(mixer) - set(MIXER_GROUP_KEYS))
    if unknown:
        raise ValueError(f"unknown mixer keys {unknown}; valid keys: {sorted(MIXER_GROUP_KEYS)}")
    if not isinstance(mixer.get("settings") or {}, Mapping):
        raise ValueError(
            f"mixer.settings must map mixer names to their settings, got {mixer['settings']!r}; write "
            "e.g. mixer.settings.mamba.d_state=16"
        )
    for name, settings in (mixer.get("settings") or {}).items():
        if settings is not None and not isinstance(settings, Mapping):  # named as ModelConfig's key
            raise ValueError(
                f"mixer.settings.{name} must map {name}'s settings to their values, got {settings!r}; write "
                f"e.g. mixer.settings.{name}.<setting>=<value>"
            )
    config = {key: model[key] for key in MODEL_GROUP_KEYS if key in model and key not in ("name", "num_heads")}
    if isinstance(mixer["pattern"], str):  # list() would split it into characters
        raise ValueError(
            f"mixer.pattern must be a list of mixer names, got the string {mixer['pattern']!r}; write "
            f"mixer.pattern=[{mixer['pattern']}]"
        )
    config.update(
        vocab_size=int(vocab_size),
        pattern=list(mixer["pattern"]),
        mixer_settings=mixer.get("settings") or {},
        shared_block=mixer.get("shared_block"),
        name=mixer["name"],
    )
    try:
        return ModelConfig.from_dict(config).to_dict()
    except ValueError as err:  # ModelConfig's words, for the group's mixer.shared_block (a new-user check)
        message = str(err)
        for field in ("model.shared_block", "shared_block"):
            if message.startswith(field):
                raise ValueError(f"mixer.shared_block{message[len(field) :]}") from err
        raise

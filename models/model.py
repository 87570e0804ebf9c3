"""The language model every mixer is compared in.

One model family for every mixer, so that only the mixer layer differs between runs (DESIGN.md,
contract 3): token embedding; ``n_layers`` pre-norm residual blocks ``h += mixer(norm(h))``,
``h += mlp(norm(h))``; a final RMSNorm; a head tied to the embedding (Press & Wolf 2017). Dropout
(``embed_dropout`` on the embeddings, ``resid_dropout`` on each mixer and MLP output, where
nanoGPT's ``model.py`` puts them) is active in training mode only. The per-layer mixers come from
the layout of :class:`models.config.ModelConfig`, so hybrids in the style of Jamba and Samba are
configs, not classes. Zamba's shared attention block is the one place where a hybrid needs
structure of its own (:class:`SharedBlock`).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import kernels
import mixers
from models.config import ModelConfig


class SwiGLU(nn.Module):
    """Gated MLP ``W2 (silu(W1 x) * W3 x)`` (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).

    Args:
        d_model: input/output width.
        d_intermediate: hidden width.

    Shapes: ``(..., d_model) -> (..., d_model)``, any float dtype.
    """

    def __init__(self, d_model: int, d_intermediate: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(d_model, 2 * d_intermediate, bias=False)
        self.w_down = nn.Linear(d_intermediate, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., d_model), in x's (or autocast) dtype."""
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: ``h = h + drop(mixer(norm(h))); h = h + drop(mlp(norm(h)))``.

    Args:
        mixer: any module following the mixer interface of DESIGN.md.
        d_model: residual width.
        d_intermediate: SwiGLU hidden width, 0 for no MLP.
        norm_eps: RMSNorm epsilon.
        resid_dropout: dropout probability on the mixer and MLP outputs (nanoGPT's
            ``resid_dropout``); active in training mode only.

    Shapes: ``(B, T, d_model) -> (B, T, d_model)``.
    """

    def __init__(
        self,
        mixer: nn.Module,
        d_model: int,
        d_intermediate: int,
        norm_eps: float,
        resid_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=norm_eps)
        self.mixer = mixer
        self.norm2 = nn.RMSNorm(d_model, eps=norm_eps) if d_intermediate else None
        self.mlp = SwiGLU(d_model, d_intermediate) if d_intermediate else None
        self.dropout = nn.Dropout(resid_dropout)

    def forward(self, h: torch.Tensor, cache=None) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model); ``cache``: the mixer's (advanced in place), or None."""
        h = h + self.dropout(self.mixer(self.norm1(h), cache=cache))
        if self.mlp is not None:
            h = h + self.dropout(self.mlp(self.norm2(h)))
        return h


class SharedBlock(nn.Module):
    """Zamba's shared attention + MLP block (Glorioso et al. 2024, "Zamba", Sec. 2, Fig. 1).

    The same weights run at several depths of a Mamba backbone. Each invocation sees the
    concatenation of the current hidden state and the input embeddings (so attention always has
    the raw tokens to retrieve from), reduced to ``d_model`` by a shared linear map; the block's
    output goes through a per-invocation linear map (Zamba's non-shared projection) back into the
    residual stream, so each depth can use the shared computation differently.

    Args:
        mixer: the shared mixer (attention).
        d_model: residual width.
        d_intermediate: SwiGLU hidden width, 0 for no MLP.
        num_invocations: how many depths use the block (one output map each).
        norm_eps: RMSNorm epsilon.
        resid_dropout: dropout probability inside the shared block (see :class:`Block`).

    Shapes: ``h, emb (B, T, d_model) -> (B, T, d_model)`` (the residual update, not the new ``h``).
    """

    def __init__(
        self,
        mixer: nn.Module,
        d_model: int,
        d_intermediate: int,
        num_invocations: int,
        norm_eps: float,
        resid_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm_in = nn.RMSNorm(2 * d_model, eps=norm_eps)
        self.in_proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = Block(mixer, d_model, d_intermediate, norm_eps, resid_dropout)
        self.out_projs = nn.ModuleList(
            nn.Linear(d_model, d_model, bias=False) for _ in range(num_invocations)
        )

    def forward(self, h: torch.Tensor, emb: torch.Tensor, invocation: int, cache=None) -> torch.Tensor:
        """The shared block's output for call number ``invocation`` (its own output projection):
        h, emb (B, T, d_model) -> (B, T, d_model); ``cache``: this invocation's mixer cache, or None."""
        x = self.in_proj(self.norm_in(torch.cat([h, emb], dim=-1)))  # (B, T, d_model)
        return self.out_projs[invocation](self.block(x, cache=cache))


class ModelCache:
    """Decode state of a whole model: one mixer cache per layer (and per shared-block invocation).

    All sequences of the batch advance together (DESIGN.md, contract 2).

    Attributes:
        layers: the per-layer mixer caches, in layer order.
        shared: the caches of the shared block's invocations (Zamba), else empty.
    """

    def __init__(self, layers: list, shared: list) -> None:
        self.layers = layers
        self.shared = shared

    @property
    def seqlen(self) -> int:
        """Tokens consumed so far (the same for every layer)."""
        return self.layers[0].seqlen

    def nbytes(self) -> int:
        """Bytes held by every cache tensor of every layer, summed (int, bytes)."""
        return sum(c.nbytes() for c in self.layers) + sum(c.nbytes() for c in self.shared)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure: ``torch.OutOfMemoryError`` (CUDA), ``MemoryError``,
    or the ``RuntimeError`` PyTorch's CPU allocator raises ("can't allocate memory")."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")


def _check_input_ids(input_ids) -> None:
    """(B, T) integer token ids, or a clear error (a list, a float or bool tensor, another rank)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a (batch, seqlen) integer tensor, got {type(input_ids).__name__}; "
            "wrap it, e.g. torch.tensor([[1, 2, 3]])"
        )
    if input_ids.is_nested:
        raise TypeError(
            "input_ids must be a (batch, seqlen) integer tensor, got a nested tensor; pass sequences of one "
            "length (e.g. one call per length)"
        )
    dtype = input_ids.dtype
    if input_ids.ndim != 2 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(
            f"input_ids must be a (batch, seqlen) integer tensor, got shape {tuple(input_ids.shape)} "
            f"and dtype {input_ids.dtype}"
        )


class LanguageModel(nn.Module):
    """Causal language model whose mixer layers follow a layout (DESIGN.md, contract 3).

    Args:
        config: a :class:`ModelConfig` or a plain dict accepted by :meth:`ModelConfig.from_dict`.

    Raises:
        TypeError: ``config`` is neither a :class:`ModelConfig` nor a mapping (e.g. a preset's name).
        ValueError: invalid config (unknown mixer, bad pattern, heads that do not divide
            ``d_model``, ...), raised while building the layers with the mixer's own message.
    """

    def __init__(self, config: ModelConfig | dict) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            config = ModelConfig.from_dict(config)
        self.config = config
        d_model, d_ff = config.d_model, config.d_intermediate
        self.embedding = nn.Embedding(config.vocab_size, d_model)
        self.layers = nn.ModuleList(
            Block(
                mixers.build_mixer(name, d_model=d_model, **config.settings_for(name)),
                d_model,
                d_ff,
                config.norm_eps,
                config.resid_dropout,
            )
            for name in config.layout
        )
        self.shared_block = None
        self.shared_after: list[int] = []
        if config.shared_block is not None:
            every = config.shared_block.every
            self.shared_after = [i for i in range(config.n_layers) if (i + 1) % every == 0]
            if not self.shared_after:
                raise ValueError(
                    f"shared_block.every={every} exceeds n_layers={config.n_layers}: the shared block "
                    "would never run; set mixer.shared_block.every <= model.n_layers on the command line "
                    f"(e.g. mixer.shared_block.every={config.n_layers}) or give more layers"
                )
            name = config.shared_block.mixer
            shared_mixer = mixers.build_mixer(name, d_model=d_model, **config.settings_for(name))
            self.shared_block = SharedBlock(
                shared_mixer, d_model, d_ff, len(self.shared_after), config.norm_eps, config.resid_dropout
            )
        self.embed_dropout = nn.Dropout(config.embed_dropout)
        self.norm_f = nn.RMSNorm(d_model, eps=config.norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 initialisation (Radford et al. 2019, Sec. 2.3) for what the model owns: N(0, 0.02)
        # embeddings and MLP inputs; the MLP output projections, which add to the residual stream
        # once per layer, scaled by 1/sqrt(2 n_layers) so the stream's variance does not grow
        # with depth. Mixers initialise their own weights (paper-specific, e.g. Mamba's dt bias).
        nn.init.normal_(self.embedding.weight, std=0.02)
        blocks = list(self.layers) + ([self.shared_block.block] if self.shared_block is not None else [])
        for block in blocks:
            if block.mlp is not None:
                nn.init.normal_(block.mlp.w_gate_up.weight, std=0.02)
                nn.init.normal_(block.mlp.w_down.weight, std=0.02 / math.sqrt(2 * self.config.n_layers))
        if self.shared_block is not None:
            nn.init.normal_(self.shared_block.in_proj.weight, std=0.02)
            for proj in self.shared_block.out_projs:
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def num_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None) -> torch.Tensor:
        """Logits for every position.

        Args:
            input_ids: ``(B, T)`` int64 token ids in ``[0, vocab_size)``.
            cache: from :meth:`allocate_cache`; when given, the ``T`` tokens continue the cached
                sequences (prefill, chunked prefill or a decode step with ``T == 1``) and the
                cache is advanced in place. Cached calls are inference: they run without autograd
                (the mixers' decode steps update their states in place, which autograd cannot
                follow; a prefill under autograd left states that the next step refused).

        Returns:
            ``(B, T, vocab_size)`` logits in the parameters' (or autocast) dtype; without autograd
            history when ``cache`` is given.

        Raises:
            TypeError: ``input_ids`` not a tensor or a nested one; a cache that is not this model's kind
                (:meth:`_check_cache`, :func:`mixers.common.check_cache`).
            ValueError: ``input_ids`` not 2-D integer (bool is not), on another device than the
                model, or token ids out of range; a cache of another model or of other mixer
                settings, or one that is full.
        """
        if cache is not None and torch.is_grad_enabled():
            with torch.no_grad():
                return self.forward(input_ids, cache)  # not self(...): module hooks run once
        if cache is not None:
            self._check_cache(cache)
        input_ids = self._token_ids(input_ids)
        emb = self.embed_dropout(self.embedding(input_ids))  # (B, T, d_model)
        h = emb
        invocation = 0
        for i, block in enumerate(self.layers):
            h = block(h, cache=None if cache is None else cache.layers[i])
            if invocation < len(self.shared_after) and self.shared_after[invocation] == i:
                shared_cache = None if cache is None else cache.shared[invocation]
                h = h + self.shared_block(h, emb, invocation, cache=shared_cache)
                invocation += 1
        h = self.norm_f(h)
        return F.linear(h, self.embedding.weight)  # tied head: (B, T, vocab_size)

    def _check_cache(self, cache: object) -> None:
        """Refuse a cache of another model: one mixer cache per layer and per shared-block
        invocation (each layer then checks its own, :func:`mixers.common.check_cache`).

        Raises:
            TypeError: ``cache`` is not a :class:`ModelCache`.
            ValueError: another number of layer or shared-block caches.
        """
        if not isinstance(cache, ModelCache):
            raise TypeError(
                f"cache must be a ModelCache from this model's allocate_cache, got {type(cache).__name__}"
            )
        if len(cache.layers) != len(self.layers) or len(cache.shared) != len(self.shared_after):
            raise ValueError(
                f"the cache holds {len(cache.layers)} layer caches and {len(cache.shared)} shared-block "
                f"ones, but this model has {len(self.layers)} layers and {len(self.shared_after)} "
                "shared-block invocations: a cache of another model; allocate it with this model's "
                "allocate_cache"
            )

    def _token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` checked (2-D integer, on the model's device, ids in ``[0, vocab_size)``) and
        in an index dtype the embedding takes: int16 / uint8 ids (a byte tokenizer's) become int64,
        int32 / int64 pass. Sequences of no tokens are refused here, with the ids' shape (a mixer
        would name its own x)."""
        _check_input_ids(input_ids)
        device = self.embedding.weight.device
        if input_ids.device != device:  # read back below (meta ids: a deep "item() on meta" error)
            raise ValueError(
                f"input_ids are on {input_ids.device}, the model on {device}; move them with "
                f"input_ids.to('{device}')"
            )
        if input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids has no tokens (shape {tuple(input_ids.shape)}); "
                "pass at least one token per sequence"
            )
        # A decode step being captured in a CUDA graph cannot read tokens back to the host; generate()
        # feeds it tokens sampled from the model's own logits, which are in range.
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if (
            input_ids.numel()
            and not capturing
            and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size)
        ):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got range "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]; is the data's vocab_size larger than the model's?"
            )
        return input_ids if input_ids.dtype in (torch.int32, torch.int64) else input_ids.long()

    def allocate_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> ModelCache:
        """Allocate the decode state of every layer for ``batch_size`` sequences of up to ``max_seqlen`` tokens.

        ``device`` defaults to the parameters' device; ``dtype`` is passed to each mixer, which
        defaults it as its cache layout requires (KV caches in the parameter dtype, recurrent
        states in fp32).

        Returns:
            :class:`ModelCache`, with ``nbytes() == batch_size * state_size(max_seqlen)``.
        """
        device = device if device is not None else self.embedding.weight.device
        layers = [
            b.mixer.allocate_cache(batch_size, max_seqlen, device=device, dtype=dtype) for b in self.layers
        ]
        shared = []
        if self.shared_block is not None:
            mixer = self.shared_block.block.mixer
            shared = [
                mixer.allocate_cache(batch_size, max_seqlen, device=device, dtype=dtype)
                for _ in self.shared_after
            ]
        return ModelCache(layers, shared)

    def position_limit(self) -> tuple[str, int] | None:
        """``(mixer name, max_position)`` of the smallest learned position table (attention with
        ``pos_emb="learned"``): no position at or past it can be run. None when no mixer has one."""
        tables = [(m.max_position, m.name) for m in self.modules() if getattr(m, "wpe", None) is not None]
        if not tables:
            return None
        size, name = min(tables)
        return name, size

    def state_size(self, seqlen: int, dtype: torch.dtype | None = None) -> int:
        """Analytic decode-state bytes per sequence at context length ``seqlen`` (int, bytes).

        Raises:
            TypeError / ValueError: seqlen not an int > 0 (named by the first mixer that checks it).
        """
        total = sum(b.mixer.state_size(seqlen, dtype=dtype) for b in self.layers)
        if self.shared_block is not None:
            total += len(self.shared_after) * self.shared_block.block.mixer.state_size(seqlen, dtype=dtype)
        return total

    @torch.no_grad()
    def decode_logits(self, input_ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
        """Logits for every position, computed through the decode path instead of the parallel forward.

        The first ``prefill_len`` tokens are prefilled into fresh caches in one call, then every
        following token is fed alone (teacher forcing), as during generation. Comparing the result
        with :meth:`forward` checks that the recurrent/cached path computes the same function.

        Args:
            input_ids: ``(B, T)`` int64.
            prefill_len: tokens prefilled at once, ``1 <= prefill_len <= T``.

        Returns:
            ``(B, T, vocab_size)`` logits.

        Raises:
            TypeError: ``input_ids`` not a tensor, ``prefill_len`` not an int.
            ValueError: ``input_ids`` not 2-D integer ids in range, ``prefill_len`` outside ``[1, T]``.
        """
        _check_input_ids(input_ids)  # the ids' range: the forward checks it
        batch, seqlen = input_ids.shape
        _check_int("prefill_len", prefill_len)
        if not 1 <= prefill_len <= seqlen:
            raise ValueError(f"prefill_len must lie in [1, {seqlen}], got {prefill_len}")
        cache = self.allocate_cache(batch, seqlen)
        logits = [self(input_ids[:, :prefill_len], cache=cache)]  # (B, prefill_len, V)
        for t in range(prefill_len, seqlen):
            logits.append(self(input_ids[:, t : t + 1], cache=cache))  # (B, 1, V)
        return torch.cat(logits, dim=1)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        greedy: bool = False,
        stop_tokens: list[int] | None = None,
        generator: torch.Generator | None = None,
        cuda_graph: bool = True,
    ) -> torch.Tensor:
        """Continue ``input_ids`` by prefilling the caches once, then decoding one token at a time.

        On CUDA (with ``cuda_graph``) the decode step has static shapes -- one token per sequence,
        caches updated in place, positions read from the caches on the device -- so after one eager
        step it is captured in a CUDA graph and replayed: one launch per step instead of one per
        kernel (Nvidia, "CUDA Graphs", CUDA C++ Programming Guide Sec. 3.2.8.7). The same kernels
        run, so the tokens equal the eager loop's. If a mixer's step cannot be captured (it reads a
        value back to the host), a warning says so and the loop stays eager. On CPU every step runs
        eagerly. Generation runs in eval mode (no dropout); the module's mode is restored after.

        Args:
            input_ids: ``(B, T)`` integer prompt, ``T >= 1`` (any integer dtype; returned as int64).
            max_new_tokens: tokens to generate per sequence (``>= 0``).
            temperature: softmax temperature for sampling (``> 0``); ignored when greedy.
            top_k: sample only among the ``top_k`` most likely tokens.
            greedy: take the argmax instead of sampling.
            stop_tokens: a sequence that emits one of these stops; it is padded with its stop
                token until every sequence has stopped or ``max_new_tokens`` is reached.
            generator: RNG for sampling (reproducible generation).
            cuda_graph: replay the decode step from a CUDA graph on CUDA inputs.

        Returns:
            ``(B, T + n)`` int64, ``n <= max_new_tokens`` (fewer when every sequence stopped).

        Raises:
            TypeError: ``input_ids`` not a tensor, ``max_new_tokens`` / ``top_k`` not ints,
                ``stop_tokens`` not a list of ints, ``greedy`` / ``cuda_graph`` not bools,
                ``temperature`` a tensor,
                ``generator`` not a ``torch.Generator``.
            ValueError: ``input_ids`` not 2-D integer, on another device than the model or
                outside ``[0, vocab_size)``, no prompt or an empty one, negative ``max_new_tokens``,
                ``temperature`` not a finite number > 0, ``top_k < 1``,
                a stop token outside ``[0, vocab_size)`` (it could never stop), a learned position
                table (``pos_emb="learned"``) with fewer than ``T + max_new_tokens - 1`` rows
                (checked before the prefill), or caches for ``T + max_new_tokens`` tokens that do not
                fit in memory.
        """
        input_ids = self._token_ids(input_ids).long()
        if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(
                f"input_ids must hold at least one prompt of at least one token, (B >= 1, T >= 1), got shape "
                f"{tuple(input_ids.shape)}"
            )
        for name, flag in (("greedy", greedy), ("cuda_graph", cuda_graph)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}; e.g. "
                "generator=torch.Generator(device=input_ids.device).manual_seed(0)"
            )
        _check_int("max_new_tokens", max_new_tokens)
        max_new_tokens = int(max_new_tokens)  # numpy integers too
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        # The chained comparison is False for NaN; inf would sample uniformly, ignoring the model.
        real = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
        if not greedy and isinstance(temperature, torch.Tensor):  # "got tensor(0.7)" read as wrong value
            raise TypeError("temperature must be a Python number, got a tensor; pass float(temperature)")
        if not greedy and not (real and 0 < temperature < math.inf):
            raise ValueError(
                f"temperature must be a finite number > 0 (or pass greedy=True), got {temperature!r}"
            )
        if top_k is not None:
            _check_int("top_k", top_k)
            top_k = int(top_k)
            if top_k < 1:
                raise ValueError(f"top_k must be >= 1, got {top_k}")
        if stop_tokens is not None and (
            not isinstance(stop_tokens, (list, tuple)) or not all(_is_int(t) for t in stop_tokens)
        ):
            raise TypeError(
                f"stop_tokens must be a list of token ids (ints), got {stop_tokens!r}; e.g. stop_tokens=[0]"
            )
        vocab = self.config.vocab_size
        outside = [int(t) for t in stop_tokens or [] if not 0 <= t < vocab]
        if outside:
            raise ValueError(
                f"stop_tokens {outside} lie outside the vocabulary [0, {vocab}): the model can never emit "
                "them; pass token ids of its tokenizer"
            )
        batch, prompt_len = input_ids.shape
        if max_new_tokens == 0:
            return input_ids.clone()
        # Checked before the prefill: otherwise the loop would fail mid-way and lose its tokens. The
        # last token sampled is never fed back, so positions run to prompt_len + max_new_tokens - 2.
        limit = self.position_limit()
        if limit is not None and prompt_len + max_new_tokens - 1 > limit[1]:
            name, size = limit
            raise ValueError(
                f"{name}: the learned position table has max_position={size} rows, but a prompt of "
                f"{prompt_len} token{'s' * (prompt_len != 1)} plus max_new_tokens={max_new_tokens} needs "
                "positions up to "
                f"{prompt_len + max_new_tokens - 2}; shorten the prompt or lower max_new_tokens so that "
                f"prompt length + max_new_tokens <= {size + 1}"
            )
        max_seqlen = prompt_len + max_new_tokens
        try:
            cache = self.allocate_cache(batch, max_seqlen)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
            if not is_out_of_memory(err):
                raise
            raise ValueError(
                f"the decode caches for {batch} sequences of up to {prompt_len} + {max_new_tokens} tokens "
                f"({batch * self.state_size(max_seqlen)} bytes) do not fit in memory: lower max_new_tokens "
                "(caches are allocated for the longest sequence up front; an attention cache grows with it)"
            ) from None
        stop = torch.tensor([int(t) for t in stop_tokens or []], dtype=torch.long, device=input_ids.device)
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        out = [input_ids]
        was_training = self.training
        self.eval()  # dropout off while generating; the module's mode is restored below
        try:
            logits = self(input_ids, cache=cache)[:, -1]  # prefill: (B, vocab)
            decode_step = DecodeStep(self, cache, graphed=cuda_graph and input_ids.is_cuda)
            for step in range(max_new_tokens):
                token = self._sample(logits.float(), float(temperature), top_k, greedy, generator)  # (B,)
                token = torch.where(done, out[-1][:, -1], token)  # a stopped sequence repeats its stop token
                out.append(token[:, None])
                done |= torch.isin(token, stop)
                if step == max_new_tokens - 1 or bool(done.all()):
                    break
                logits = decode_step(token)  # (B, vocab)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        greedy: bool,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if greedy:
            return logits.argmax(dim=-1)
        # Shifted by the row maximum before the division (softmax is unchanged by a shift): a tiny
        # temperature then sends the other logits to -inf, the argmax's limit, instead of
        # overflowing every logit to +-inf and the probabilities to NaN. The maximum stays 0 even
        # where a subnormal temperature reads as 0 (flush-to-zero arithmetic), which 0 / 0 would not.
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        logits = torch.where(shifted == 0, 0.0, shifted / temperature)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class DecodeStep:
    """One decode step of ``model`` over ``cache``: ``step(token (B,) int64) -> logits (B, vocab)``
    in the model's dtype; used by :meth:`LanguageModel.generate` and ``eval/decode.py``.

    With ``graphed``, the first call runs eagerly on the current stream (Triton autotuning, lazy
    initialisation and the allocator's warm-up must not happen during capture), the second captures
    the step in a CUDA graph on a stream of its own, prepared by :func:`kernels.prepare_graph_capture`
    (flash_decode's split counters) -- a static (B, 1) token buffer in, a static (B, vocab) logits
    buffer out, the caches updated in place -- and every call replays it. The warm-up stays on the
    current stream: run on a side stream (as ``torch.cuda.graphs`` suggests), the graph, captured on
    that stream or on a fresh one, replayed with gaps between its kernels, 1836-1867 instead of
    1546-1560 us a step for ``model=small`` attention at 2k keys (H200, 2026-12-04, the same kernel
    time; the cause is not known). The returned logits are that static buffer: read them before
    the next call. The caches' host-side ``seqlen`` counters are kept as an eager
    loop would leave them (capture records the step without running it). Source: CUDA Graphs (CUDA
    C++ Programming Guide, Sec. 3.2.8.7) through ``torch.cuda.graph``.

    Raises:
        ValueError: a step beyond the caches' ``max_seqlen`` (from the mixers' checks); with
            ``graphed``, a token that is not on a CUDA device (CUDA graphs are CUDA only).
    """

    def __init__(self, model: LanguageModel, cache: ModelCache, graphed: bool) -> None:
        self.model, self.cache, self.graphed = model, cache, graphed
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.token: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _caches(self) -> list:
        return self.cache.layers + self.cache.shared

    def _capture(self, token: torch.Tensor) -> None:
        self.token = token[:, None].clone()  # (B, 1) static input
        seqlens = [c.seqlen for c in self._caches()]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(token.device)
        kernels.prepare_graph_capture(stream)
        try:
            with torch.cuda.graph(graph, stream=stream):
                self.logits = self.model(self.token, cache=self.cache)[:, -1]  # (B, vocab) static output
            self.graph = graph
        except RuntimeError as err:
            warnings.warn(
                f"generate: the decode step could not be captured in a CUDA graph ({str(err).splitlines()[0]}); "
                "decoding eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
            self.graphed = False
        finally:
            for c, n in zip(self._caches(), seqlens, strict=True):
                c.seqlen = n

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        if self.graphed and self.graph is None and not token.is_cuda:  # off the replay path
            raise ValueError(
                f"DecodeStep(graphed=True) captures a CUDA graph, which needs CUDA tensors; got a token on "
                f"{token.device}: pass graphed=False (or use generate(), which graphs only on CUDA)"
            )
        self.calls += 1
        if self.graphed and self.calls > 1 and self.graph is None:
            self._capture(token)
        if self.graph is None:
            return self.model(token[:, None], cache=self.cache)[:, -1]
        for c in self._caches():
            c.check_step(token.shape[0], 1, "generate")
            c.seqlen += 1
        self.token.copy_(token[:, None])
        self.graph.replay()
        return self.logits

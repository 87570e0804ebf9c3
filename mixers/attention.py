"""Causal multi-head / grouped-query softmax attention with a paged KV cache.

Attention (Vaswani et al. 2017, eq. 1): o = softmax(q k^T / sqrt(head_dim) + causal mask) v, per head.
Grouped-query attention (Ainslie et al. 2023): num_kv_heads <= num_heads key/value heads, query head h
reads KV head h // (num_heads // num_kv_heads); only the KV heads are cached, which is GQA's point.
Positions: rotary embeddings (RoPE, Su et al. 2021, eq. 34, rotate-half convention), a learned
absolute position table added to the input (GPT-2), or none.

All attention math goes through `kernels` (looked up as module attributes so tests can count calls):
`kernels.flash_attention` for a full forward and for (chunked) prefill, `kernels.flash_decode` for a
decode step of one token.
"""

from __future__ import annotations

import dataclasses

import torch
from einops import rearrange
from torch import nn

import kernels
from mixers.common import (
    MixerCache,
    check_bool,
    check_cache,
    check_cache_dtype,
    check_input,
    check_number,
    check_positive_int,
)

POS_EMBS = ("rope", "learned", "none")


@dataclasses.dataclass(kw_only=True)
class KVCache(MixerCache):
    """Paged key/value cache of one attention layer (vLLM's PagedAttention layout, Kwon et al. 2023).

    A pool of fixed-size pages shared by the batch, and a block table per sequence mapping its
    logical pages to pool pages: token t of sequence b lives at
    ``k[block_table[b, t // page_size], t % page_size]``, which is the layout
    :func:`kernels.flash_decode` reads directly. Only the KV heads are stored (GQA). The pool holds
    the batch's whole pages for max_seqlen, ``batch * ceil(max_seqlen / page_size)`` pages
    (DESIGN.md, contract 2); sequence b initially owns pages ``[b * max_blocks, (b + 1) * max_blocks)``,
    and any permutation of the pool written into ``block_table`` before the first token works the
    same.

    Fields:
        block_table: (B, max_blocks) int32 pool page of each logical page, max_blocks =
            ceil(max_seqlen / page_size).
        seqlens: (B,) int32 tokens written per sequence, on the cache's device. A decode step takes
            its positions (RoPE, page slot, kernel lengths) from it rather than from ``seqlen``, so
            the step has static shapes and no host values: captured once in a CUDA graph, it stays
            valid as the sequences grow.
        k, v: (B * max_blocks, page_size, num_kv_heads, head_dim) in the cache dtype. Keys are
            cached after RoPE, so a cached key never needs its position again.
        max_seqlen: tokens each sequence may hold.
        seqlen: tokens written so far (the same for every sequence).
    """

    block_table: torch.Tensor
    seqlens: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def batch_size(self) -> int:
        """Number of sequences the cache holds (rows of the block table)."""
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.k.shape[1]

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool addresses of positions [start, end) of every sequence: (pages (B, end - start) int64,
        slots (B, end - start) int64), so that ``k[pages, slots]`` is (B, end - start, Hkv, D)."""
        pos = torch.arange(start, end, device=self.block_table.device)  # (T,)
        pages = self.block_table[:, pos // self.page_size].long()  # (B, T)
        return pages, (pos % self.page_size).expand_as(pages)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half of RoPE: (x1, x2) -> (-x2, x1) over the two halves of the last dim, (..., D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, offset: int | torch.Tensor, base: float) -> torch.Tensor:
    """Apply rotary position embeddings (Su et al. 2021, eq. 34; rotate-half pairing of dims i, i + D/2).

    Args:
        x: (B, T, H, D) queries or keys, D even; token t sits at absolute position offset + t.
        offset: absolute position of the first token: an int shared by the batch, or a (B,)
            integer tensor of per-sequence positions (a decode step reads it from the cache).
        base: RoPE base theta; frequency i is base^(-2i/D).

    Returns:
        (B, T, H, D) in x's dtype.
    """
    T, D = x.shape[1], x.shape[-1]
    # Angles are computed here rather than cached in a buffer: a buffer would be cast by
    # module.half(), and position * frequency in 16 bits is wrong by whole radians at long contexts.
    # float32 is enough for any realistic position; float64 inputs get float64 angles (exact tests).
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=angle_dtype) / D)  # (D/2,)
    steps = torch.arange(T, device=x.device, dtype=angle_dtype)  # (T,)
    if isinstance(offset, torch.Tensor):
        positions = offset.to(angle_dtype)[:, None] + steps  # (B, T)
    else:
        positions = (offset + steps)[None]  # (1, T)
    angles = (positions[..., None] * inv_freq).repeat(1, 1, 2)  # (B or 1, T, D), dims i and i + D/2 pair
    cos = angles.cos()[:, :, None, :].to(x.dtype)  # (B or 1, T, 1, D)
    sin = angles.sin()[:, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal MHA / GQA softmax attention (Vaswani et al. 2017; GQA: Ainslie et al. 2023).

    Args:
        d_model: model width; input and output are (B, T, d_model).
        num_heads: query heads.
        num_kv_heads: key/value heads (default num_heads); must divide num_heads.
        head_dim: per-head width (default d_model // num_heads, then num_heads must divide d_model).
        pos_emb: "rope" (rotary on q and k), "learned" (an nn.Embedding(max_position, d_model) added to
            the input before the projections) or "none".
        rope_base: RoPE base theta (used with pos_emb="rope").
        max_position: size of the learned position table (used with pos_emb="learned"); a token at a
            position >= max_position is an error.
        bias: whether the q/k/v and output projections have biases.
        page_size: tokens per page of the paged KV cache (int > 0); a sequence's cache grows in
            whole pages, so ``state_size`` rounds up to it. Any size works (the decode kernel
            gathers per key); small pages waste less at a sequence's end, large ones need fewer
            block-table entries.

    Raises:
        TypeError: bias is not a bool (e.g. the config string "no").
        TypeError / ValueError: non-positive or non-int sizes, num_heads not dividing d_model (without
            head_dim), num_kv_heads not dividing num_heads, unknown pos_emb, odd head_dim with RoPE,
            rope_base not a finite number > 1.
    """

    name = "attention"
    cache_cls = KVCache

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        pos_emb: str = "rope",
        rope_base: float = 10000.0,
        max_position: int = 2048,
        bias: bool = False,
        page_size: int = 64,
    ):
        super().__init__()
        check_positive_int(d_model, "d_model", self.name)
        check_positive_int(num_heads, "num_heads", self.name)
        check_bool(bias, "bias", self.name)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        check_positive_int(num_kv_heads, "num_kv_heads", self.name)
        if head_dim is None:
            if d_model % num_heads != 0:
                raise ValueError(
                    f"{self.name}: num_heads={num_heads} does not divide d_model={d_model}; "
                    "choose num_heads dividing d_model or pass head_dim explicitly"
                )
            head_dim = d_model // num_heads
        check_positive_int(head_dim, "head_dim", self.name)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{self.name}: num_kv_heads={num_kv_heads} must divide num_heads={num_heads} "
                "(each KV head serves a whole group of query heads)"
            )
        if pos_emb not in POS_EMBS:
            raise ValueError(f"{self.name}: unknown pos_emb {pos_emb!r}; choose one of {POS_EMBS}")
        if pos_emb == "rope" and head_dim % 2 != 0:
            raise ValueError(
                f"{self.name}: RoPE rotates pairs of dims, so head_dim must be even, got {head_dim}"
            )
        check_number(rope_base, "rope_base", self.name, low=1.0)

        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pos_emb = pos_emb
        self.rope_base = float(rope_base)
        self.max_position = check_positive_int(max_position, "max_position", self.name)
        self.page_size = check_positive_int(page_size, "page_size", self.name)
        self.window: int | None = None  # no window: SlidingWindowAttention sets one
        # Trailing shapes of the cache's k and v (mixers.common.check_cache): a paged pool here.
        self._cache_layout = dict.fromkeys(("k", "v"), (page_size, num_kv_heads, head_dim))

        # One fused projection for q, k, v: a single matmul instead of three.
        self.qkv_proj = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)
        self.wpe = nn.Embedding(max_position, d_model) if pos_emb == "learned" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 / nanoGPT init: weights N(0, 0.02), biases zero.

        std 0.02 keeps q·k small at init, so the softmax starts near uniform and its gradients are
        not saturated. The model may rescale out_proj by 1/sqrt(2 * n_layers) (GPT-2's residual
        scaling); a mixer does not know the depth.
        """
        for linear in (self.qkv_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, std=0.02)

    def _project(
        self, x: torch.Tensor, offset: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position-encode and project x (B, T, d_model) whose first token is at position `offset`
        (an int, checked against the learned table), or per sequence at `positions` (B,) on the
        device when given (the decode step: no host value enters the computation).

        Returns:
            q (B, T, num_heads, head_dim), k and v (B, T, num_kv_heads, head_dim), RoPE applied to q, k.

        Raises:
            ValueError: with pos_emb="learned", a position >= max_position.
        """
        T = x.shape[1]
        if self.wpe is not None:
            if offset + T > self.max_position:
                raise ValueError(
                    f"{self.name}: positions up to {offset + T - 1} exceed the learned position table "
                    f"(max_position={self.max_position}); build the mixer with a larger max_position"
                )
            steps = torch.arange(T, device=x.device)  # (T,)
            first = offset if positions is None else positions.long()[:, None]  # int or (B, 1)
            x = x + self.wpe(first + steps)  # (B, T, d_model)
        qkv = self.qkv_proj(x)  # (B, T, (Hq + 2 Hkv) * D)
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = rearrange(q, "b t (h d) -> b t h d", d=self.head_dim)  # (B, T, Hq, D)
        k = rearrange(k, "b t (h d) -> b t h d", d=self.head_dim)  # (B, T, Hkv, D)
        v = rearrange(v, "b t (h d) -> b t h d", d=self.head_dim)  # (B, T, Hkv, D)
        if self.pos_emb == "rope":
            first = offset if positions is None else positions
            q = apply_rope(q, first, self.rope_base)
            k = apply_rope(k, first, self.rope_base)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Causal attention over x, continuing the cached sequences when a cache is given.

        Args:
            x: (B, T, d_model). Without a cache, the whole sequence (positions 0 .. T-1). With a cache,
                T new tokens at positions cache.seqlen ..: a prefill / chunked prefill (T > 1) or a
                decode step (T == 1).
            cache: from `allocate_cache`; updated in place (new K/V written, seqlen advanced by T).

        Returns:
            (B, T, d_model) in x's dtype.

        Raises:
            TypeError: x is not a float tensor, or (outside autocast) not in the weights' dtype.
            ValueError: x of the wrong shape or on another device than the weights, a cache of
                another batch size, cache overflow, or a position beyond the learned table.
        """
        B, T = check_input(x, self.d_model, self.name, self.qkv_proj.weight)
        offset, positions = 0, None
        if cache is not None:
            check_cache(cache, self, self.cache_cls, self._cache_layout, self.qkv_proj.weight.device)
            cache.check_step(B, T, self.name)
            offset = cache.seqlen
            if T == 1:
                positions = cache.seqlens  # (B,) on the device: a decode step has no host positions
        q, k, v = self._project(x, offset, positions)
        if cache is not None and k.dtype != cache.k.dtype:  # under autocast too: the dtype k is made in
            raise TypeError(
                f"{self.name}: the cache holds {cache.k.dtype} keys but this layer computes {k.dtype} ones; "
                f"allocate the cache with dtype={k.dtype} (or dtype=None outside autocast)"
            )
        if cache is None:
            o = kernels.flash_attention(q, k, v, causal=True, window=self.window)  # (B, T, Hq, D)
        else:
            o = self._attend_with_cache(q, k, v, cache)
            cache.seqlen += T
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)"))

    def _attend_with_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Write the new k, v (B, T, Hkv, D) into positions [seqlen, seqlen + T) of the pages and
        attend q (B, T, Hq, D) to everything cached so far; returns (B, T, Hq, D)."""
        T = q.shape[1]
        start, end = cache.seqlen, cache.seqlen + T
        if T == 1:
            # Decode: append at each sequence's own position (read on the device), then let the
            # split-K kernel gather the pages through the block table.
            pos = cache.seqlens.long()  # (B,)
            page = cache.block_table.gather(1, (pos // cache.page_size)[:, None]).long()  # (B, 1)
            slot = (pos % cache.page_size)[:, None]  # (B, 1)
            cache.k[page, slot] = k
            cache.v[page, slot] = v
            cache.seqlens += 1
            o = kernels.flash_decode(
                q[:, 0],
                cache.k,
                cache.v,
                cache.block_table,
                cache.seqlens,
                window=self.window,
                check_values=False,  # the cache built them: no device sync per layer and step
            )
            return o[:, None]  # (B, 1, Hq, D)
        pages, slots = cache.slots(start, end)  # (B, T) each
        cache.k[pages, slots] = k
        cache.v[pages, slots] = v
        cache.seqlens += T
        if start > 0:
            # Chunked prefill: gather the cached prefix into contiguous (B, end, Hkv, D) keys and values.
            pages, slots = cache.slots(0, end)
            k, v = cache.k[pages, slots], cache.v[pages, slots]
        # T queries against the first `end` keys; the kernel's bottom-right causal alignment lets
        # query i (position start + i) see keys j <= start + i.
        return kernels.flash_attention(q, k, v, causal=True, window=self.window)

    def _cache_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """KV caches default to the parameter dtype (K/V are produced in it).

        Raises:
            TypeError: ``dtype`` is neither None nor a floating-point torch.dtype.
        """
        check_cache_dtype(dtype, self.name)
        return dtype or self.qkv_proj.weight.dtype

    def allocate_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """Allocate an empty paged KV cache (:class:`KVCache`): a pool of batch_size *
        ceil(max_seqlen / page_size) zero pages of (page_size, num_kv_heads, head_dim) for k and v,
        and a block table giving sequence b the pages [b * max_blocks, (b + 1) * max_blocks).

        Args:
            batch_size: sequences decoded together.
            max_seqlen: tokens each sequence may hold (prompt + generated).
            device: defaults to the parameters' device.
            dtype: defaults to the parameters' dtype.

        Raises:
            TypeError / ValueError: batch_size or max_seqlen not an int > 0.
        """
        check_positive_int(batch_size, "batch_size", self.name)
        check_positive_int(max_seqlen, "max_seqlen", self.name)
        device = device or self.qkv_proj.weight.device
        max_blocks = -(-max_seqlen // self.page_size)  # ceil
        pool = (batch_size * max_blocks, self.page_size, self.num_kv_heads, self.head_dim)
        dtype = self._cache_dtype(dtype)
        table = torch.arange(batch_size * max_blocks, device=device, dtype=torch.int32)
        return KVCache(
            max_seqlen=max_seqlen,
            block_table=table.view(batch_size, max_blocks),
            seqlens=torch.zeros(batch_size, device=device, dtype=torch.int32),
            k=torch.zeros(pool, device=device, dtype=dtype),
            v=torch.zeros(pool, device=device, dtype=dtype),
        )

    def state_size(self, seqlen: int, dtype: torch.dtype | None = None) -> int:
        """Bytes per sequence of a cache with max_seqlen = seqlen: its ceil(seqlen / page_size)
        whole pages of keys and values of every KV head, 2 * page_size * num_kv_heads * head_dim *
        itemsize bytes each, plus one int32 block-table entry per page and the int32 length.

        Raises:
            TypeError / ValueError: seqlen not an int > 0 (as ``allocate_cache``'s max_seqlen).
        """
        pages = -(-check_positive_int(seqlen, "seqlen", self.name) // self.page_size)
        page_bytes = (
            2 * self.page_size * self.num_kv_heads * self.head_dim * self._cache_dtype(dtype).itemsize
        )
        return pages * (page_bytes + torch.int32.itemsize) + torch.int32.itemsize

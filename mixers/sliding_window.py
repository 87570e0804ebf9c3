"""Causal sliding-window attention with a ring-buffer KV cache.

Each token attends to itself and the window - 1 tokens before it (Longformer's local attention,
Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023): query position p sees keys p - window < j <= p.
Everything else (projections, GQA, positions) is `Attention`'s. Because no query ever looks further
back than the window, the cache is a ring of min(max_seqlen, window) slots per sequence (Mistral's
rolling buffer cache), so decode memory stops growing at the window.
"""

from __future__ import annotations

import dataclasses

import torch

import kernels
from mixers.attention import Attention
from mixers.common import MixerCache, check_positive_int


@dataclasses.dataclass(kw_only=True)
class RingKVCache(MixerCache):
    """Ring-buffer key/value cache of one sliding-window attention layer.

    Fields:
        k, v: (B, slots, num_kv_heads, head_dim) with slots = min(max_seqlen, window); the token at
            position p lives in slot p % slots. Keys are stored after RoPE.
        max_seqlen: tokens each sequence may hold in total.
        seqlen: tokens consumed so far; the ring holds the last min(seqlen, slots) of them.
        seqlens: (B,) int32 tokens consumed per sequence, on the device: a decode step takes its
            positions and slot from it (static shapes, no host values; see ``KVCache.seqlens``).
    """

    seqlens: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def slots(self) -> int:
        """Number of ring slots per sequence."""
        return self.k.shape[1]


class SlidingWindowAttention(Attention):
    """Causal sliding-window MHA / GQA attention; `Attention` with a window passed to the kernels.

    Args:
        d_model, num_heads: as for `Attention`.
        window: tokens each query sees, itself included (int > 0).
        **kwargs: the other `Attention` settings (num_kv_heads, head_dim, pos_emb, rope_base,
            max_position, bias; page_size is accepted and unused: the ring is not paged).

    Raises:
        TypeError: window is not an int.
        ValueError: window <= 0 or beyond int64, and everything `Attention` rejects.
    """

    name = "sliding_window"
    cache_cls = RingKVCache

    def __init__(self, d_model: int, num_heads: int, window: int, **kwargs):
        super().__init__(d_model, num_heads, **kwargs)
        self.window = check_positive_int(window, "window", self.name)
        if window > kernels.reference.MAX_WINDOW:
            raise ValueError(
                f"{self.name}: window must be at most 2**63 - 1 (the kernels' int64), got {window}; a "
                "window at least as long as the sequences excludes nothing: use the attention mixer"
            )
        # The ring's slots depend on max_seqlen: its k and v end with (num_kv_heads, head_dim).
        self._cache_layout = dict.fromkeys(("k", "v"), (self.num_kv_heads, self.head_dim))

    def _attend_with_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: RingKVCache
    ) -> torch.Tensor:
        """Attend q (B, T, Hq, D) to the ring's valid tokens and the new k, v (B, T, Hkv, D), then store
        the new tokens in the ring; returns (B, T, Hq, D)."""
        B, T = q.shape[:2]
        start, slots = cache.seqlen, cache.slots
        if T == 1:
            # Decode: write the new token over the oldest slot, then attend to every valid slot, viewing
            # the ring as one page per sequence. Slot order is not temporal order, which softmax
            # attention does not care about: positions were baked into the keys by RoPE before caching
            # (or into the input by a learned table), and the sum over keys is order-free. For the same
            # reason no window goes to the kernel: the ring holds exactly the tokens inside the window.
            rows = torch.arange(B, device=q.device)  # (B,)
            slot = cache.seqlens.long() % slots  # (B,) read on the device
            cache.k[rows, slot] = k[:, 0]
            cache.v[rows, slot] = v[:, 0]
            cache.seqlens += 1
            block_table = rows.to(torch.int32)[:, None]  # (B, 1)
            seqlens = cache.seqlens.clamp(max=slots)  # (B,) valid slots
            return kernels.flash_decode(q[:, 0], cache.k, cache.v, block_table, seqlens, check_values=False)[
                :, None
            ]  # the ring built the table and lengths: no device sync

        # Chunked prefill: the ring's valid tokens in temporal order, then the new ones; with
        # bottom-right causal alignment and the window, query i (position start + i) sees exactly the
        # keys at positions start + i - window < p <= start + i. The ring holds the last
        # min(start, slots) >= min(start, window - 1) tokens, all the first query can need.
        n_past = min(start, slots)
        past_slots = torch.arange(start - n_past, start, device=q.device) % slots  # (n_past,)
        k_all = torch.cat([cache.k[:, past_slots], k], dim=1)  # (B, n_past + T, Hkv, D)
        v_all = torch.cat([cache.v[:, past_slots], v], dim=1)
        o = kernels.flash_attention(q, k_all, v_all, causal=True, window=self.window)  # (B, T, Hq, D)

        # Only the last `slots` new tokens can be seen again; their slots are distinct.
        n_keep = min(T, slots)
        new_slots = torch.arange(start + T - n_keep, start + T, device=q.device) % slots  # (n_keep,)
        cache.k[:, new_slots] = k[:, T - n_keep :]
        cache.v[:, new_slots] = v[:, T - n_keep :]
        cache.seqlens += T
        return o

    def allocate_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> RingKVCache:
        """Allocate an empty ring cache (:class:`RingKVCache`): k, v zeros of (batch_size,
        min(max_seqlen, window), num_kv_heads, head_dim), so memory stops growing at the window.

        Args:
            batch_size: sequences decoded together.
            max_seqlen: tokens each sequence may hold (prompt + generated).
            device: defaults to the parameters' device.
            dtype: defaults to the parameters' dtype.

        Raises:
            TypeError / ValueError: batch_size or max_seqlen not an int > 0.
        """
        check_positive_int(batch_size, "batch_size", self.name)
        check_positive_int(max_seqlen, "max_seqlen", self.name)  # before it sizes the slots
        device = device or self.qkv_proj.weight.device
        shape = (batch_size, min(max_seqlen, self.window), self.num_kv_heads, self.head_dim)
        dtype = self._cache_dtype(dtype)
        return RingKVCache(
            max_seqlen=max_seqlen,
            seqlens=torch.zeros(batch_size, device=device, dtype=torch.int32),
            k=torch.zeros(shape, device=device, dtype=dtype),
            v=torch.zeros(shape, device=device, dtype=dtype),
        )

    def state_size(self, seqlen: int, dtype: torch.dtype | None = None) -> int:
        """Bytes per sequence of a ring cache with max_seqlen = seqlen: 2 * min(seqlen, window) *
        num_kv_heads * head_dim * itemsize (keys and values of every KV head) + 4 (the int32 length).

        Raises:
            TypeError / ValueError: seqlen not an int > 0 (as ``allocate_cache``'s max_seqlen).
        """
        slots = min(check_positive_int(seqlen, "seqlen", self.name), self.window)
        kv_bytes = 2 * slots * self.num_kv_heads * self.head_dim * self._cache_dtype(dtype).itemsize
        return kv_bytes + torch.int32.itemsize

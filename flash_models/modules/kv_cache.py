"""A preallocated key/value cache: one (B, max_len, Hkv, D) pair of tensors per layer, compacted per row.

Only the KV heads are stored (GQA/MQA caches are Hq/Hkv times smaller), and only real tokens: padding in a
prompt is never written, so row b holds its tokens at [0, seqlens[b]) and decoding needs no padding mask.
``seqlens`` is an int32 tensor on the cache's device, advanced in place by the model, so a decode step reads
no Python-side length and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

import flash_kernels
from flash_kernels.kv_append import cache_locations


class KVCache:
    def __init__(
        self, *, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, growable: bool = False,
    ):
        """``growable``: a model's forward may enlarge the cache when new tokens would not fit (``grow``), as HF's
        dynamic cache grows; generate's caches are fixed, since its CUDA graphs read their tensors in place."""
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)  # real tokens per row
        self.max_len = max_len
        self.upper_bound = 0  # host-side bound on seqlens.max() (no device sync needed to check room)
        self.block_table: torch.Tensor | None = None  # paged caches only (see paged_kv_cache.py)
        self.growable = growable

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    @property
    def empty(self) -> bool:
        return self.upper_bound == 0

    def reset(self) -> None:
        self.seqlens.zero_()
        self.upper_bound = 0

    def reserve(self, new_tokens: int) -> None:
        """Account for ``new_tokens`` more per row; raise before anything is written if they cannot fit."""
        if self.upper_bound + new_tokens > self.max_len:
            raise ValueError(
                f"KV cache overflow: up to {self.upper_bound} cached + {new_tokens} new tokens > max_len "
                f"{self.max_len}; allocate a larger cache (max_len) or generate fewer tokens"
            )
        self.upper_bound += new_tokens

    def make_room(self, new_tokens: int) -> None:
        """A growable cache too short for ``new_tokens`` more per row grows to twice what it then needs (a loop
        that feeds one token a call copies the cache a logarithmic number of times); others are left as they
        are (``reserve`` refuses what does not fit)."""
        needed = self.upper_bound + new_tokens
        if self.growable and needed > self.max_len:
            self.grow(2 * needed)

    def grow(self, max_len: int) -> None:
        """Enlarge every layer's tensors to ``max_len`` positions, keeping what they hold."""
        if max_len <= self.max_len:
            return
        for tensors in (self.k, self.v):
            for i, old in enumerate(tensors):
                tensors[i] = old.new_zeros(old.shape[0], max_len, *old.shape[2:])
                tensors[i][:, :self.max_len] = old
        self.max_len = max_len

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, real: torch.Tensor | None,
              *, backend: str) -> None:
        """Store k, v (B, S, Hkv, D) of the new tokens at their cache positions (B, S); skip padding (``real``
        False). Positions are per row: seqlens[b] + index among the row's real new tokens. ``backend`` is the
        model's kernel backend."""
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if real is None:  # every new token is real (decoding): one fused launch for k and v on CUDA
            flash_kernels.kv_append(kc, vc, k, v, positions, block_table=self.block_table, backend=backend)
            return
        first, second = cache_locations(positions, self.block_table, kc.shape[1])
        kc[first[real], second[real]] = k[real].to(kc.dtype)
        vc[first[real], second[real]] = v[real].to(vc.dtype)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as (B, max_len, Hkv, D), for attention that masks the whole cache."""
        return self.k[layer_idx], self.v[layer_idx]

    def advance_to(self, lengths: torch.Tensor) -> None:
        """Set every row's length to ``lengths`` (B,), the lengths after the tokens just written: one copy
        kernel (a decode step's graph has no kernel to spare)."""
        self.seqlens.copy_(lengths)

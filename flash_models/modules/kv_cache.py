"""A preallocated key/value cache: one (B, max_len, Hkv, D) pair of tensors per layer.

Only the KV heads are stored (GQA/MQA caches are Hq/Hkv times smaller). ``seqlen`` counts the positions
already written; a forward writes its new keys at [seqlen, seqlen + S) in every layer, then ``advance``
moves the cursor once for the whole model.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self, *, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.seqlen = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def check_room(self, new_tokens: int) -> None:
        if self.seqlen + new_tokens > self.max_len:
            raise ValueError(
                f"KV cache overflow: {self.seqlen} cached + {new_tokens} new tokens > max_len {self.max_len}; "
                "allocate a larger cache (max_len) or generate fewer tokens"
            )

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, S, Hkv, D) after the cached positions; return all keys/values so far."""
        end = self.seqlen + k.shape[1]
        self.k[layer_idx][:, self.seqlen:end] = k
        self.v[layer_idx][:, self.seqlen:end] = v
        return self.k[layer_idx][:, :end], self.v[layer_idx][:, :end]

    def advance(self, new_tokens: int) -> None:
        self.seqlen += new_tokens

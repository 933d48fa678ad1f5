"""A paged KV cache: per layer one pool of fixed-size blocks, and a block table mapping each row's logical
positions to blocks.

Blocks are handed out as the cache grows (``reserve``), so memory follows the tokens actually generated, and a
pool smaller than batch x max_len serves batches that stop early. The host never reads per-row lengths: every
row gets blocks up to the shared upper bound. The block table is a device tensor updated in place, so a
captured decode graph keeps reading the current mapping. The split-KV decode kernel reads the pool through
the table directly; other attention paths gather a row-contiguous view.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache


class PagedKVCache(KVCache):
    def __init__(
        self, *, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, block_size: int, num_blocks: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        blocks_per_row = -(-max_len // block_size)
        num_blocks = batch_size * blocks_per_row if num_blocks is None else num_blocks
        # The parent's per-row tensors are replaced by the pools; it still owns lengths and bookkeeping.
        super().__init__(num_layers=0, batch_size=batch_size, max_len=blocks_per_row * block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
        pool = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks
        self.block_table = torch.zeros(batch_size, blocks_per_row, dtype=torch.int32, device=device)
        self.free_blocks = list(range(num_blocks))
        self.blocks_per_row_in_use = 0

    def reset(self) -> None:
        super().reset()
        self.free_blocks = list(range(self.num_blocks))
        self.blocks_per_row_in_use = 0
        self.block_table.zero_()

    def reserve(self, new_tokens: int) -> None:
        super().reserve(new_tokens)
        needed = -(-self.upper_bound // self.block_size)
        extra = needed - self.blocks_per_row_in_use
        if extra <= 0:
            return
        count = extra * self.batch_size
        if count > len(self.free_blocks):
            self.upper_bound -= new_tokens
            raise ValueError(
                f"paged KV cache pool exhausted: {count} more blocks of {self.block_size} tokens needed, "
                f"{len(self.free_blocks)} free of {self.num_blocks}; give the cache more blocks (num_blocks)"
            )
        taken, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        new = torch.tensor(taken, dtype=torch.int32).view(self.batch_size, extra)
        self.block_table[:, self.blocks_per_row_in_use:needed] = new.to(self.block_table.device)
        self.blocks_per_row_in_use = needed

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-contiguous (B, max_len, Hkv, D) copies gathered through the block table."""
        B = self.batch_size
        gather = lambda pool: pool[self.block_table.long()].reshape(B, self.max_len, *pool.shape[2:])  # noqa: E731
        return gather(self.k[layer_idx]), gather(self.v[layer_idx])

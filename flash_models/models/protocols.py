"""What a model offers to the layers above it, as named protocols: generation reaches a decoder only through
``CausalDecoder`` (``DecoderLM`` implements it for every decoder family)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from ..config import DecoderConfig
from ..modules import KVCache, RotaryEmbedding
from .outputs import CausalLMOutput


class CausalDecoder(Protocol):
    """A decoder-only LM that generation can drive: a forward that fills a KV cache (the prefill, and the
    steps of a model whose rotary tables change with the length), a fixed-shape one-token decode step (what a
    CUDA graph captures), and the config values generation reads."""

    config: Any  # the family's config
    generation_config: Any  # transformers.GenerationConfig: its eos_token_id / pad_token_id are generation's defaults
    decoder_config: DecoderConfig  # vocab_size, position limits (learned_positions), rope (dynamic NTK)
    rotary: RotaryEmbedding | None  # tables(length, device) for decode_step; None with learned positions

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def new_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                     block_size: int | None = None, num_blocks: int | None = None) -> KVCache: ...

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, rope_tables) -> torch.Tensor:
        """tokens (B, 1) against a filled ``cache`` with room reserved -> next-token logits (B, V)."""
        ...

    def lean_decode_step(self, cache: KVCache) -> Callable[[torch.Tensor, KVCache, Any], torch.Tensor] | None:
        """A faster callable that computes ``decode_step`` against ``cache`` on this device, or None."""
        ...

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 kv_cache: KVCache | None = None) -> CausalLMOutput: ...


_MEMBERS = sorted({*CausalDecoder.__annotations__, "device", "dtype", "new_kv_cache", "decode_step", "lean_decode_step",
                   "__call__"})


def missing_members(model) -> list[str]:
    """The ``CausalDecoder`` members ``model`` lacks. By ``hasattr``, not ``isinstance`` on a runtime protocol:
    from Python 3.12 that looks members up statically, and an nn.Module's submodules (``rotary``) and
    parameters live in its ``_modules`` and ``_parameters``, where a static lookup does not see them."""
    return [name for name in _MEMBERS if not hasattr(model, name)]


def is_causal_decoder(model) -> bool:
    return not missing_members(model)


def check_causal_decoder(model) -> None:
    """Raise a TypeError naming what ``model`` lacks when it is not a ``CausalDecoder``."""
    missing = missing_members(model)
    if missing:
        raise TypeError(
            f"{type(model).__name__} cannot generate: it is not a decoder-only LM (it lacks {', '.join(missing)}); "
            "generation takes a causal LM such as the one from_pretrained builds for a GPT-2 or LLaMA checkpoint"
        )

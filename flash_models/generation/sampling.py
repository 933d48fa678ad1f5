"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p."""

from __future__ import annotations

import torch


def check_sampling_args(*, temperature: float, top_k: int, top_p: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use do_sample=False for greedy decoding")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability reaches
    top_p (HF's rule: the token that crosses the threshold is kept). logits (B, V) in float32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p  # ascending: the low-probability tail
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor, *, do_sample: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits / temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)

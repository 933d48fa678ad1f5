"""Minimal KV-cached generation: one prefill, then one token per step. Returns prompt + new tokens, as HF.

Shaped for the full engine to grow from: a cache object, a forward per step, and ``next_token`` sampling.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .sampling import check_sampling_args, next_token


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _eos_ids(eos_token_id, config_eos, vocab_size: int) -> list[int]:
    """The user's EOS ids, checked against the vocabulary; else the config's (those in the vocabulary)."""
    if eos_token_id is None:
        return [i for i in _as_list(config_eos) if 0 <= i < vocab_size]
    ids = _as_list(eos_token_id)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad} outside the vocabulary [0, {vocab_size})")
    return ids


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Iterable[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Greedy or sampled continuation of ``input_ids`` (B, S); left-pad batches and pass ``attention_mask``.

    Finished rows (after an EOS) continue with ``pad_token_id`` (default: the first EOS id), and generation
    stops early once every row has finished. ``on_token`` receives each step's (B,) tokens, for streaming.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: generation needs a prompt of at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if do_sample:
        check_sampling_args(temperature=temperature, top_k=top_k, top_p=top_p)
    vocab = model.decoder_config.vocab_size
    eos = _eos_ids(eos_token_id, model.config.eos_token_id, vocab)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    B, S = input_ids.shape
    limit = model.decoder_config.max_position_embeddings
    if model.decoder_config.learned_positions and S + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({S}) + max_new_tokens ({max_new_tokens}) exceeds the model's {limit} positions"
        )
    device = model.device
    input_ids = input_ids.to(device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if max_new_tokens == 0:
        return input_ids

    cache = model.new_kv_cache(B, S + max_new_tokens)
    logits = model(input_ids, attention_mask=attention_mask, kv_cache=cache).logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    eos_tensor = torch.tensor(eos, device=device, dtype=input_ids.dtype)
    new_tokens = []
    for step in range(max_new_tokens):
        token = next_token(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        token = torch.where(finished, torch.full_like(token, pad), token)
        new_tokens.append(token)
        if on_token is not None:
            on_token(token)
        if eos:
            finished |= torch.isin(token, eos_tensor)
            if bool(finished.all()):  # the one host sync per step: the batched stop check
                break
        if step + 1 == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        logits = model(token.unsqueeze(1), attention_mask=attention_mask, kv_cache=cache).logits[:, -1]
    return torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)

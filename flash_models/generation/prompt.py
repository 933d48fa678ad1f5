"""What plain and speculative decoding share: the prompt's checks, the prefill that fills the KV cache, and
the output type."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..models.outputs import ModelOutput
from ..modules.attention import without_padding
from ..models.protocols import CausalDecoder
from .settings import GenerationSettings


@dataclass
class GenerateOutput(ModelOutput):
    """What ``return_dict_in_generate`` gives, read as transformers' output is: ``out.sequences``,
    ``out["scores"]``, ``out[0]``."""

    sequences: torch.Tensor  # (B, S + T)
    scores: tuple[torch.Tensor, ...] | None = None  # T x (B, V): the processed scores each token was chosen from
    logprobs: torch.Tensor | None = None  # (B, T): log-probability of each chosen token under those scores
    logits: tuple[torch.Tensor, ...] | None = None  # T x (B, V): the raw logits of each step (output_logits)


def check_prompt(model: CausalDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings: GenerationSettings):
    """(ids, mask, settings): the prompt as (B, S) int64 ids on the model's device and its mask, checked (ids of
    the model's vocabulary, a 0/1 mask of the same shape with a real token in every row, room in the position
    table), each row repeated ``num_return_sequences`` times in place as HF does; the settings with max_length
    and min_length resolved for the prompt's S columns (``GenerationSettings.for_prompt``)."""
    if isinstance(input_ids, Mapping) and "input_ids" in input_ids:  # what tokenizers and apply_chat_template return
        raise ValueError(f"input_ids is a tokenizer's output ({type(input_ids).__name__}): unpack it, "
                         "model.generate(**encoded, max_new_tokens=...), which passes its attention_mask too")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, seq_len) prompt, got shape {tuple(input_ids.shape)}")
    settings = settings.for_prompt(input_ids.shape[1])
    dc = model.decoder_config
    device = model.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    outside = (input_ids < 0) | (input_ids >= dc.vocab_size)
    if bool(outside.any()):  # once per call: on CUDA the model's own check is an asynchronous assert
        raise ValueError(f"input_ids must lie in the vocabulary [0, {dc.vocab_size}), got {int(input_ids[outside][0])}: "
                         "check the tokenizer matches the model")
    pad = settings.pad_token_id
    if attention_mask is None and pad is not None and pad not in settings.eos_ids and bool((input_ids == pad).any()):
        # transformers' rule: without a mask, the pad id marks padding when it is set and is not an EOS id (a
        # tokenizer's padded batch passed without its mask)
        attention_mask = (input_ids != pad).long()
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a tensor of 0/1 (1 = real token), got {type(attention_mask).__name__}")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        attention_mask = attention_mask.to(device)
        if attention_mask.is_complex() or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        attention_mask = attention_mask.long()
        if not attention_mask.bool().any(dim=1).all():
            raise ValueError("a row of attention_mask has no real token: every prompt needs at least one")
    # Positions count real tokens (the cache holds them compacted): the longest row's must fit the table.
    longest = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(1).max())
    if dc.learned_positions and longest + settings.max_new_tokens > dc.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({settings.max_new_tokens}) exceeds the model's "
            f"{dc.max_position_embeddings} positions"
        )
    if settings.num_return_sequences > 1:
        input_ids = input_ids.repeat_interleave(settings.num_return_sequences, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(settings.num_return_sequences, dim=0)
    return input_ids, attention_mask, settings


def prefill_logits(model: CausalDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
    """The prompt into ``cache`` -> (B, V) logits at each row's last real token: the last column for an
    unpadded or left-padded row, an earlier one for a right-padded row. The cache holds only real tokens,
    compacted, so every row continues right after its own last real token."""
    attention_mask = without_padding(attention_mask)  # an unpadded prompt (a tokenizer's mask of ones): no mask
    lean = model.lean_decode_step(cache) if cache.empty else None
    if lean is not None and attention_mask is None:
        # the CPU's lean step takes unpadded prompts too (runtime/cpu_decode.py)
        cache.reserve(input_ids.shape[1])
        tables = model.rotary.tables(input_ids.shape[1], input_ids.device) if model.rotary is not None else None
        return lean(input_ids, cache, tables)
    if attention_mask is None or bool(attention_mask[:, -1].all()):
        # Every row ends at the last column: the LM head runs on it alone (over every prompt position it would
        # be a large share of the time to the first token on a CPU).
        return model(input_ids, attention_mask=attention_mask, kv_cache=cache, logits_to_keep=1).logits[:, -1]
    logits = model(input_ids, attention_mask=attention_mask, kv_cache=cache).logits  # (B, S, V)
    S = attention_mask.shape[1]
    last = S - 1 - attention_mask.flip(1).argmax(dim=1)  # (B,) index of each row's last real token
    return logits[torch.arange(logits.shape[0], device=logits.device), last]

"""Speculative decoding (greedy): a small draft model proposes k tokens, the target checks them all in one
forward, and the longest agreeing prefix plus the target's own next token is kept. The output is exactly
what plain greedy decoding of the target gives; rows of a batch accept different counts, which the
per-row cache lengths absorb (a rejected tail is simply overwritten later).
"""

from __future__ import annotations

import torch

from .generate import _check_prompt
from .settings import GenerationSettings


def _check_pair(target, draft) -> None:
    if target.decoder_config.vocab_size != draft.decoder_config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.decoder_config.vocab_size}) differs from the target's "
            f"({target.decoder_config.vocab_size}): speculative decoding needs the same tokenizer"
        )


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, *, attention_mask=None, settings: GenerationSettings) -> torch.Tensor:
    if settings.do_sample:
        raise ValueError("speculative decoding here is greedy: use do_sample=False (or drop draft_model)")
    _check_pair(target, draft)
    input_ids, attention_mask = _check_prompt(target, input_ids, attention_mask, settings)
    B, S = input_ids.shape
    k, max_new, device = settings.num_draft_tokens, settings.max_new_tokens, input_ids.device
    if max_new == 0:
        return input_ids
    room = S + max_new + k + 1
    t_cache, d_cache = target.new_kv_cache(B, room), draft.new_kv_cache(B, room)
    last = target(input_ids, attention_mask=attention_mask, kv_cache=t_cache).logits[:, -1].argmax(-1)  # (B,)
    draft(input_ids, attention_mask=attention_mask, kv_cache=d_cache)

    # One column past max_new_tokens takes the writes of invalid slots, so every scatter stays in bounds.
    out = torch.full((B, max_new + 1), settings.pad_id, dtype=torch.long, device=device)
    out[:, 0] = last
    produced = torch.ones(B, dtype=torch.long, device=device)  # tokens written to ``out`` per row
    eos = torch.tensor(settings.eos_ids, dtype=torch.long, device=device)
    finished = torch.isin(last, eos)
    # A token the draft has not consumed yet (when it proposed k and all were accepted), with its mask.
    pending = torch.zeros(B, dtype=torch.long, device=device)
    pending_real = torch.zeros(B, dtype=torch.bool, device=device)
    steps = torch.arange(k + 1, device=device)

    while True:
        active = ~finished & (produced < max_new)  # rows still generating; the others' caches stay frozen
        if not bool(active.any()):
            break
        t_before, d_before = t_cache.seqlens.clone(), d_cache.seqlens.clone()
        # 1. The draft catches up on what it missed, then proposes k tokens greedily.
        feed = torch.stack([pending, last], dim=1)  # (B, 2)
        feed_mask = torch.stack([pending_real, torch.ones_like(pending_real)], dim=1).long()
        d_logits = draft(feed, attention_mask=feed_mask, kv_cache=d_cache).logits[:, -1]
        proposals = []
        for i in range(k):
            proposals.append(d_logits.argmax(-1))
            if i < k - 1:
                d_logits = draft(proposals[-1].unsqueeze(1), kv_cache=d_cache).logits[:, -1]
        proposed = torch.stack(proposals, dim=1)  # (B, k)
        # 2. The target scores [last, d1 .. dk] in one forward.
        verify = torch.cat([last.unsqueeze(1), proposed], dim=1)  # (B, k + 1)
        predicted = target(verify, kv_cache=t_cache).logits.argmax(-1)  # (B, k + 1)
        accepted = (proposed == predicted[:, :k]).long().cumprod(dim=1).sum(dim=1)  # (B,) in [0, k]
        # 3. Keep only the accepted part of each cache; the rest is overwritten later.
        t_cache.seqlens.copy_(torch.where(active, t_before + 1 + accepted.int(), t_before))
        d_kept = d_cache.seqlens - (k - 1 - accepted).clamp(min=0).int()
        d_cache.seqlens.copy_(torch.where(active, d_kept, d_before))
        t_cache.upper_bound = d_cache.upper_bound = int(t_cache.seqlens.max())
        pending = torch.where(active, proposed[:, -1], pending)
        pending_real = torch.where(active, accepted == k, pending_real)
        # 4. Emit d1 .. d_accepted and the target's own next token, stopping rows at EOS.
        bonus = predicted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        emitted = torch.where(steps < accepted.unsqueeze(1), torch.cat([proposed, proposed[:, :1]], dim=1), 0)
        emitted.scatter_(1, accepted.unsqueeze(1), bonus.unsqueeze(1))  # (B, k + 1), first accepted + 1 valid
        valid = steps <= accepted.unsqueeze(1)
        if eos.numel():
            is_eos = torch.isin(emitted, eos) & valid
            after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
            valid &= ~after_eos
            stopped = is_eos.any(dim=1)
        else:
            stopped = torch.zeros_like(finished)
        slots = produced.unsqueeze(1) + steps  # (B, k + 1)
        valid &= ~finished.unsqueeze(1) & (slots < max_new)
        out.scatter_(1, torch.where(valid, slots, max_new), emitted)
        produced += valid.sum(dim=1)
        finished |= stopped & active
        last = torch.where(active, bonus, last)
    return _finish(input_ids, out, produced, finished, settings)


def _finish(input_ids, out, produced, finished, settings: GenerationSettings) -> torch.Tensor:
    """Cut to max_new_tokens, or to the longest row when every row stopped at EOS earlier (as greedy does);
    positions past a row's own end hold the pad id."""
    lengths = produced.clamp(max=settings.max_new_tokens)
    total = int(lengths.max()) if bool(finished.all()) else settings.max_new_tokens
    new = out[:, :total].clone()
    new[torch.arange(total, device=out.device).unsqueeze(0) >= lengths.unsqueeze(1)] = settings.pad_id
    return torch.cat([input_ids, new], dim=1)

"""Speculative decoding (greedy): a small draft model proposes k tokens, the target checks them all in one
forward, and the longest agreeing prefix plus the target's own next token is kept. The output is exactly
what plain greedy decoding of the target gives, with the same logits processing (repetition penalty, EOS
held back before min_new_tokens) applied to the target's scores at every checked position; rows of a batch
accept different counts, which the per-row cache lengths absorb (a rejected tail is simply overwritten
later).
"""

from __future__ import annotations

import torch

from ..models.protocols import CausalDecoder, is_causal_decoder
from .prompt import GenerateOutput, check_prompt, prefill_logits
from .sampling import process_logits, seen_tokens
from .settings import GenerationSettings


def _check_pair(target: CausalDecoder, draft, settings: GenerationSettings) -> None:
    if not is_causal_decoder(draft):
        raise ValueError(f"draft_model must be a flash-models decoder LM, got {type(draft).__name__}")
    if target.decoder_config.vocab_size != draft.decoder_config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.decoder_config.vocab_size}) differs from the target's "
            f"({target.decoder_config.vocab_size}): speculative decoding needs the same tokenizer"
        )
    if settings.do_sample:
        raise ValueError("speculative decoding here is greedy: use do_sample=False (or drop draft_model)")
    # What speculative decoding cannot honour, refused by name rather than ignored.
    refused = {
        "stop_strings": "stop strings are matched on decoded text token by token",
        "kv_block_size": "its two caches roll rejected tokens back, which a paged cache does not",
        "compile_decode": "it runs no one-token decode step to compile",
        "no_repeat_ngram_size": "the n-gram ban is not implemented for its checked positions",
        "output_logits": "it keeps the processed scores only (output_scores)",
    }
    for name, why in refused.items():
        if getattr(settings, name) not in ((), None, False):
            raise ValueError(f"{name} is not supported with draft_model ({why}); drop one of them")


@torch.inference_mode()
def speculative_generate(target: CausalDecoder, draft: CausalDecoder, input_ids, *, attention_mask=None, settings: GenerationSettings):
    _check_pair(target, draft, settings)
    input_ids, attention_mask, settings = check_prompt(target, input_ids, attention_mask, settings)
    check_prompt(draft, input_ids, attention_mask, settings)  # the draft's own position table must hold it too
    B, S = input_ids.shape
    k, max_new, device = settings.num_draft_tokens, settings.max_new_tokens, input_ids.device
    for role, model in (("model", target), ("draft_model", draft)):
        length = model.decoder_config.cache_refill_length()
        if length is not None and S <= length < S + max_new + k:
            raise ValueError(f"the {role} rotates with LongRoPE, whose frequencies change past {length} "
                             "tokens, where its whole cache is recomputed (as HF's generate does), which speculative "
                             "decoding does not do: generate without draft_model, or fewer max_new_tokens")
    V = target.decoder_config.vocab_size
    if max_new == 0:  # what plain greedy returns for no step
        if not (settings.return_dict_in_generate or settings.output_scores):
            return input_ids
        return GenerateOutput(sequences=input_ids, scores=() if settings.output_scores else None)
    room = S + max_new + k + 1
    t_cache, d_cache = target.new_kv_cache(B, room), draft.new_kv_cache(B, room)
    seen = seen_tokens(input_ids, attention_mask, V)
    first_scores = process_logits(prefill_logits(target, input_ids, attention_mask, t_cache), settings, seen=seen, step=0)
    last = first_scores.argmax(-1)  # (B,)
    draft(input_ids, attention_mask=attention_mask, kv_cache=d_cache)

    # One column past max_new_tokens takes the writes of invalid slots, so every scatter stays in bounds.
    out = torch.full((B, max_new + 1), settings.pad_id, dtype=torch.long, device=device)
    out[:, 0] = last
    scores_out = None
    if settings.output_scores:
        scores_out = torch.zeros(B, max_new + 1, V, dtype=torch.float32, device=device)
        scores_out[:, 0] = first_scores
    seen.scatter_(1, last.unsqueeze(1), True)
    rows = torch.arange(B, device=device).unsqueeze(1)
    produced = torch.ones(B, dtype=torch.long, device=device)  # tokens written to ``out`` per row
    eos = torch.tensor(settings.eos_ids, dtype=torch.long, device=device)
    finished = torch.isin(last, eos)
    # A token the draft has not consumed yet (when it proposed k and all were accepted), with its mask.
    pending = torch.zeros(B, dtype=torch.long, device=device)
    pending_real = torch.zeros(B, dtype=torch.bool, device=device)

    while True:
        active = ~finished & (produced < max_new)  # rows still generating
        if not bool(active.any()):
            break
        # A row that stopped never resumes: its caches are dead, so they restart empty and what the batched
        # forwards compute for it (and discard) stays inside the position tables.
        for cache in (t_cache, d_cache):
            cache.seqlens.masked_fill_(~active, 0)
            cache.upper_bound = int(cache.seqlens.max())
        # Never check past max_new_tokens: the tokens there would be discarded, and their positions may lie
        # past the model's table when the prompt and max_new_tokens fill it exactly.
        kr = min(k, int((max_new - produced[active]).min()))
        t_before, d_before = t_cache.seqlens.clone(), d_cache.seqlens.clone()
        # 1. The draft catches up on what it missed, then proposes kr tokens greedily, through the same
        #    processing as the target (which only raises how many it gets right).
        feed = torch.stack([pending, last], dim=1)  # (B, 2)
        feed_mask = torch.stack([pending_real, torch.ones_like(pending_real)], dim=1).long()
        d_logits = draft(feed, attention_mask=feed_mask, kv_cache=d_cache).logits[:, -1]
        d_seen = seen.clone()
        proposals = []
        for i in range(kr):
            proposals.append(process_logits(d_logits, settings, seen=d_seen, step=produced + i).argmax(-1))
            if i < kr - 1:
                d_seen.scatter_(1, proposals[-1].unsqueeze(1), True)
                d_logits = draft(proposals[-1].unsqueeze(1), kv_cache=d_cache).logits[:, -1]
        proposed = torch.stack(proposals, dim=1)  # (B, kr)
        # 2. The target scores [last, d1 .. dkr] in one forward; position j is processed as greedy would
        #    process it after d1 .. dj.
        verify = torch.cat([last.unsqueeze(1), proposed], dim=1)  # (B, kr + 1)
        logits = target(verify, kv_cache=t_cache).logits  # (B, kr + 1, V)
        v_seen, scores = seen.clone(), []
        for j in range(kr + 1):
            scores.append(process_logits(logits[:, j], settings, seen=v_seen, step=produced + j))
            if j < kr:
                v_seen.scatter_(1, proposed[:, j:j + 1], True)
        scores = torch.stack(scores, dim=1)  # (B, kr + 1, V)
        predicted = scores.argmax(-1)  # (B, kr + 1)
        accepted = (proposed == predicted[:, :kr]).long().cumprod(dim=1).sum(dim=1)  # (B,) in [0, kr]
        # 3. Keep only the accepted part of each cache; the rest is overwritten later.
        t_cache.seqlens.copy_(torch.where(active, t_before + 1 + accepted.int(), t_before))
        d_kept = d_cache.seqlens - (kr - 1 - accepted).clamp(min=0).int()
        d_cache.seqlens.copy_(torch.where(active, d_kept, d_before))
        pending = torch.where(active, proposed[:, -1], pending)
        pending_real = torch.where(active, accepted == kr, pending_real)
        # 4. Emit d1 .. d_accepted and the target's own next token, stopping rows at EOS.
        steps = torch.arange(kr + 1, device=device)
        bonus = predicted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        emitted = torch.where(steps < accepted.unsqueeze(1), torch.cat([proposed, proposed[:, :1]], dim=1), 0)
        emitted.scatter_(1, accepted.unsqueeze(1), bonus.unsqueeze(1))  # (B, kr + 1), first accepted + 1 valid
        valid = steps <= accepted.unsqueeze(1)
        if eos.numel():
            is_eos = torch.isin(emitted, eos) & valid
            after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
            valid &= ~after_eos
            stopped = is_eos.any(dim=1)
        else:
            stopped = torch.zeros_like(finished)
        slots = produced.unsqueeze(1) + steps  # (B, kr + 1)
        valid &= ~finished.unsqueeze(1) & (slots < max_new)
        slots = torch.where(valid, slots, max_new)
        out.scatter_(1, slots, emitted)
        if scores_out is not None:
            scores_out[rows, slots] = scores
        seen.scatter_(1, torch.where(valid, emitted, last.unsqueeze(1)), True)  # ``last`` is in ``seen`` already
        produced += valid.sum(dim=1)
        finished |= stopped & active
        last = torch.where(active, bonus, last)
    return _finish(input_ids, out, produced, finished, scores_out, settings)


def _finish(input_ids, out, produced, finished, scores_out, settings: GenerationSettings):
    """Cut to max_new_tokens, or to the longest row when every row stopped at EOS earlier (as greedy does);
    positions past a row's own end hold the pad id, and there its scores put all the probability on the pad
    id (plain greedy scores the pad tokens it feeds such a row; speculative decoding feeds it nothing)."""
    lengths = produced.clamp(max=settings.max_new_tokens)
    total = int(lengths.max()) if bool(finished.all()) else settings.max_new_tokens
    new = out[:, :total].clone()
    ended = torch.arange(total, device=out.device).unsqueeze(0) >= lengths.unsqueeze(1)  # (B, total)
    new[ended] = settings.pad_id
    sequences = torch.cat([input_ids, new], dim=1)
    if not (settings.return_dict_in_generate or settings.output_scores):
        return sequences
    if not settings.output_scores:
        return GenerateOutput(sequences=sequences)
    scores = scores_out[:, :total]
    scores[ended] = float("-inf")
    scores[..., settings.pad_id] = torch.where(ended, 0.0, scores[..., settings.pad_id])
    logprobs = scores.log_softmax(-1).gather(2, new.unsqueeze(2)).squeeze(2) if total else None
    return GenerateOutput(sequences=sequences, scores=tuple(scores.unbind(1)), logprobs=logprobs)

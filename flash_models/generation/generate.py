"""KV-cached generation: prefill once, then decode one token per row per step (eager or a CUDA graph),
with HF's argument names. Returns prompt + new tokens as HF does, or a ``GenerateOutput`` with scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .engine import cache_and_runner
from .sampling import choose, process_logits, seen_tokens
from .settings import GenerationSettings, resolve_settings


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # (B, S + T)
    scores: tuple[torch.Tensor, ...] | None = None  # T x (B, V): the processed scores each token was chosen from
    logprobs: torch.Tensor | None = None  # (B, T): log-probability of each chosen token under those scores


def _check_prompt(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings: GenerationSettings):
    """The prompt as (B, S) int64 ids on the model's device and its mask, checked: ids of the model's
    vocabulary, a 0/1 mask of the same shape with a real token in every row, room in the position table."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, seq_len) prompt, got shape {tuple(input_ids.shape)}")
    dc = model.decoder_config
    device = model.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    outside = (input_ids < 0) | (input_ids >= dc.vocab_size)
    if bool(outside.any()):  # once per call: on CUDA the model's own check is an asynchronous assert
        raise ValueError(f"input_ids must lie in the vocabulary [0, {dc.vocab_size}), got {int(input_ids[outside][0])}: "
                         "check the tokenizer matches the model")
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
    return input_ids, attention_mask


def prefill_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
    """The prompt into ``cache`` -> (B, V) logits at each row's last real token: the last column for an
    unpadded or left-padded row, an earlier one for a right-padded row. The cache holds only real tokens,
    compacted, so every row continues right after its own last real token."""
    if attention_mask is None or bool(attention_mask[:, -1].all()):
        # Every row ends at the last column: the LM head runs on it alone (over every prompt position it would
        # be a large share of the time to the first token on a CPU).
        return model(input_ids, attention_mask=attention_mask, kv_cache=cache, logits_to_keep=1).logits[:, -1]
    logits = model(input_ids, attention_mask=attention_mask, kv_cache=cache).logits  # (B, S, V)
    S = attention_mask.shape[1]
    last = S - 1 - attention_mask.flip(1).argmax(dim=1)  # (B,) index of each row's last real token
    return logits[torch.arange(logits.shape[0], device=logits.device), last]


class _StopStrings:
    """Marks rows whose decoded continuation contains a stop string (host-side, only when asked for)."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
        self.tokenizer, self.stop_strings = tokenizer, stop_strings

    def hits(self, new_tokens: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.stop_strings:
            return None
        rows = torch.stack(new_tokens, dim=1).tolist()
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False)
        return torch.tensor([any(s in t for s in self.stop_strings) for t in texts])


class Generation:
    """One generate call as an iterator over steps: each ``next`` yields the (B,) tokens of one step."""

    def __init__(self, model, input_ids, *, attention_mask=None, settings: GenerationSettings, generator=None, tokenizer=None):
        self.model, self.settings, self.generator = model, settings, generator
        self.input_ids, self.attention_mask = _check_prompt(model, input_ids, attention_mask, settings)
        self.stops = _StopStrings(tokenizer, settings.stop_strings)
        self.tokens: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        B = self.input_ids.shape[0]
        self.finish_step = torch.full((B,), settings.max_new_tokens, dtype=torch.long, device=self.input_ids.device)

    # How often the decode loop asks the device whether every row has finished: each ask is a host sync.
    def _stop_interval(self) -> int:
        return 4 if self.input_ids.is_cuda else 1

    # torch runs a decorated generator's every step in inference mode and leaves it at each yield: the pooled
    # caches and graphs hold inference tensors, which only inference mode may update in place.
    @torch.inference_mode()
    def __iter__(self) -> Iterator[torch.Tensor]:
        s, model = self.settings, self.model
        if s.max_new_tokens == 0:
            return
        B, S = self.input_ids.shape
        cache, runner = cache_and_runner(model, B, S + s.max_new_tokens, use_cuda_graph=s.use_cuda_graph,
                                         block_size=s.kv_block_size, compile=s.compile_decode,
                                         programmatic_launch=s.programmatic_launch)
        try:
            yield from self._steps(cache, runner)
        finally:  # also when a caller abandons the iterator: the pooled cache is free again
            runner.release()

    def _steps(self, cache, runner) -> Iterator[torch.Tensor]:
        s, model = self.settings, self.model
        B = self.input_ids.shape[0]
        device = self.input_ids.device
        logits = prefill_logits(model, self.input_ids, self.attention_mask, cache)
        seen = None
        if s.repetition_penalty != 1.0:
            seen = seen_tokens(self.input_ids, self.attention_mask, model.decoder_config.vocab_size)
        eos = torch.tensor(s.eos_ids, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stoppable = bool(s.eos_ids) or bool(s.stop_strings)
        # Rows still sampling, refreshed at each stop check (None: all). Filtering and drawing (sorts over the
        # vocabulary) then skip finished rows; greedy argmax is too cheap to be worth the gather.
        active: torch.Tensor | None = None
        compact = s.do_sample and not s.output_scores
        for step in range(s.max_new_tokens):
            if active is None:
                scores = process_logits(logits, s, seen=seen, step=step)
                token = choose(scores, do_sample=s.do_sample, generator=self.generator)
            else:
                rows_seen = seen[active] if seen is not None else None
                scores = process_logits(logits[active], s, seen=rows_seen, step=step)
                token = torch.full((B,), s.pad_id, dtype=torch.long, device=device)
                token[active] = choose(scores, do_sample=True, generator=self.generator)
            token = torch.where(finished, torch.full_like(token, s.pad_id), token)
            if s.output_scores:  # a copy: the scores may be the decode graph's static output buffer
                self.scores.append(scores.clone())
                self.logprobs.append(scores.log_softmax(-1).gather(1, token.unsqueeze(1)).squeeze(1))
            self.tokens.append(token)
            yield token
            if stoppable:
                done = torch.isin(token, eos)
                hits = self.stops.hits(self.tokens)
                if hits is not None:
                    done |= hits.to(device)
                newly = done & ~finished
                self.finish_step = torch.where(newly, torch.full_like(self.finish_step, step), self.finish_step)
                finished |= newly
                if (step + 1) % self._stop_interval() == 0:  # the batched stop check
                    if bool(finished.all()):
                        return
                    if compact and bool(finished.any()):
                        active = (~finished).nonzero().squeeze(1)
            if step + 1 == s.max_new_tokens:
                return
            if seen is not None:
                seen.scatter_(1, token.unsqueeze(1), True)
            logits = runner(token)

    def output(self):
        """Prompt + generated tokens; steps after the last row finished (the stop check runs every few
        steps on a GPU) are trimmed so the result is what a per-step check gives."""
        steps = len(self.tokens)
        stoppable = bool(self.settings.eos_ids) or bool(self.settings.stop_strings)
        if stoppable and steps and bool((self.finish_step < self.settings.max_new_tokens).all()):
            steps = min(steps, int(self.finish_step.max()) + 1)
        new = torch.stack(self.tokens[:steps], dim=1) if steps else self.input_ids[:, :0]
        sequences = torch.cat([self.input_ids, new], dim=1)
        if not (self.settings.return_dict_in_generate or self.settings.output_scores):
            return sequences
        scores = tuple(self.scores[:steps]) if self.settings.output_scores else None
        logprobs = torch.stack(self.logprobs[:steps], dim=1) if self.settings.output_scores and steps else None
        return GenerateOutput(sequences=sequences, scores=scores, logprobs=logprobs)


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    generation_config=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    draft_model=None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    **kwargs,
):
    """Greedy or sampled continuation of ``input_ids`` (B, S), with HF's argument names: max_new_tokens,
    min_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, eos_token_id (one id or
    several; [] for none), pad_token_id, stop_strings (needs ``tokenizer``), output_scores,
    return_dict_in_generate; or a ``transformers.GenerationConfig``. Every argument is checked up front,
    naming it. A batch may be left- or right-padded (pass ``attention_mask``): each row continues from its
    own last real token, and the new tokens follow the prompt's columns as given. Finished rows continue
    with pad_token_id (default: the first EOS id). ``generator`` seeds sampling. ``draft_model`` turns on
    speculative decoding (greedy, the same tokens and scores as plain greedy). ``on_token`` gets each step's
    (B,) tokens."""
    settings = resolve_settings(model.config, model.decoder_config.vocab_size, generation_config, **kwargs)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be callable (it gets each step's (batch,) tokens), got {type(on_token).__name__}")
    if draft_model is not None:
        from .speculative import speculative_generate

        if on_token is not None:
            raise ValueError("on_token is not supported with draft_model: speculative decoding emits several tokens "
                             "per row per step, a different number in each row")
        return speculative_generate(model, draft_model, input_ids, attention_mask=attention_mask, settings=settings)
    run = Generation(model, input_ids, attention_mask=attention_mask, settings=settings, generator=generator, tokenizer=tokenizer)
    for token in run:
        if on_token is not None:
            on_token(token)
    return run.output()

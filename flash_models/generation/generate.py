"""KV-cached generation: prefill once, then decode one token per row per step (eager or a CUDA graph),
with HF's argument names. Returns prompt + new tokens as HF does, or a ``GenerateOutput`` with scores."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..models.protocols import CausalDecoder, check_causal_decoder
from .engine import cache_and_runner
from .prompt import GenerateOutput, check_prompt, prefill_logits
from .sampling import NgramHistory, choose, process_logits, seen_tokens
from .settings import GenerationSettings, resolve_settings
from .speculative import speculative_generate


class _StopStrings:
    """Marks rows where a new token completes a stop string (host-side, only when asked for). As in
    transformers, a stop string may begin in the prompt: each row's text is decoded from the end of its prompt
    (enough tokens to hold the longest stop string) on, and a stop string counts when it ends past the prompt."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], input_ids: torch.Tensor, attention_mask):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        if not stop_strings:
            return
        # A token holds at least one character, or a piece of one (byte tokens): 4 tokens a character suffice.
        keep = 4 * max(len(t) for t in stop_strings)
        rows = input_ids.tolist() if attention_mask is None else [
            [t for t, real in zip(row, mask) if real] for row, mask in zip(input_ids.tolist(), attention_mask.tolist())]
        self.tails = [row[-keep:] for row in rows]
        self.tail_chars = [len(t) for t in tokenizer.batch_decode(self.tails, skip_special_tokens=False)]

    def hits(self, new_tokens: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.stop_strings:
            return None
        rows = [tail + new for tail, new in zip(self.tails, torch.stack(new_tokens, dim=1).tolist())]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False)
        return torch.tensor([any(text.find(stop, max(0, start - len(stop) + 1)) >= 0 for stop in self.stop_strings)
                             for text, start in zip(texts, self.tail_chars)])


def _rope_switches_next(model: CausalDecoder, cache) -> bool:
    """Whether the next token takes the longest row past the length where LongRoPE changes its frequencies, in a
    model whose generation then recomputes the whole cache once with the long factors (Phi-3's 128k models, as
    HF's Phi-3 ``prepare_inputs_for_generation`` does), so that every cached key is rotated as one forward over
    the sequence rotates it. Other families keep the keys cached before the switch, as HF's do."""
    length = model.decoder_config.cache_refill_length()
    return length is not None and cache.upper_bound == length


class Generation:
    """One generate call as an iterator over steps: each ``next`` yields the (B,) tokens of one step."""

    def __init__(self, model: CausalDecoder, input_ids, *, attention_mask=None, settings: GenerationSettings, generator=None,
                 tokenizer=None):
        check_causal_decoder(model)
        self.model, self.generator = model, generator
        self.input_ids, self.attention_mask, settings = check_prompt(model, input_ids, attention_mask, settings)
        self.settings = settings
        self.stops = _StopStrings(tokenizer, settings.stop_strings, self.input_ids, self.attention_mask)
        self.tokens: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
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
        V = model.decoder_config.vocab_size
        seen = None
        if s.repetition_penalty != 1.0:
            seen = seen_tokens(self.input_ids, self.attention_mask, V)
        history = None
        if s.no_repeat_ngram_size:
            history = NgramHistory(self.input_ids, self.attention_mask, s.max_new_tokens, s.no_repeat_ngram_size)
        eos = torch.tensor(s.eos_ids, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stoppable = bool(s.eos_ids) or bool(s.stop_strings)
        # Rows still sampling, refreshed at each stop check (None: all). Filtering and drawing (sorts over the
        # vocabulary) then skip finished rows; greedy argmax is too cheap to be worth the gather.
        active: torch.Tensor | None = None
        compact = s.do_sample and not s.output_scores
        for step in range(s.max_new_tokens):
            banned = history.banned(V) if history is not None else None
            if s.output_logits:  # a copy: the logits may be the decode graph's static output buffer
                self.logits.append(logits.float().clone())
            if active is None:
                scores = process_logits(logits, s, seen=seen, step=step, banned=banned)
                token = choose(scores, do_sample=s.do_sample, generator=self.generator)
            else:
                rows_seen = seen[active] if seen is not None else None
                rows_banned = banned[active] if banned is not None else None
                scores = process_logits(logits[active], s, seen=rows_seen, step=step, banned=rows_banned)
                # The draw still covers every row (a finished one certain of the pad id): the random stream a
                # seed gives is then spent as in transformers, which draws for finished rows too.
                probs = torch.zeros(B, V, dtype=scores.dtype, device=device)
                probs[:, s.pad_id] = 1.0
                probs[active] = scores.softmax(dim=-1)
                token = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(-1)
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
            if history is not None:
                history.push(token)
            logits = self._refill(cache) if _rope_switches_next(model, cache) else runner(token)

    def _refill(self, cache) -> torch.Tensor:
        """The sequence so far (prompt and every new token, finished rows' pad ids too, as HF's mask counts them)
        prefilled into the emptied cache -> the next logits."""
        ids = torch.cat([self.input_ids, torch.stack(self.tokens, dim=1)], dim=1)
        mask = None
        if self.attention_mask is not None:
            mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(ids.shape[0], len(self.tokens))], dim=1)
        cache.reset()
        return prefill_logits(self.model, ids, mask, cache)

    def running_at(self, step: int) -> bool:
        """Whether any row was still generating at ``step`` (as a per-step stop check sees it): on a GPU the loop
        checks every few steps, and the steps after every row has finished are not part of the output."""
        return bool((self.finish_step >= step).any())

    def output(self):
        """Prompt + generated tokens; steps after the last row finished (the stop check runs every few
        steps on a GPU) are trimmed so the result is what a per-step check gives."""
        steps = len(self.tokens)
        stoppable = bool(self.settings.eos_ids) or bool(self.settings.stop_strings)
        if stoppable and steps and bool((self.finish_step < self.settings.max_new_tokens).all()):
            steps = min(steps, int(self.finish_step.max()) + 1)
        new = torch.stack(self.tokens[:steps], dim=1) if steps else self.input_ids[:, :0]
        sequences = torch.cat([self.input_ids, new], dim=1)
        s = self.settings
        if not (s.return_dict_in_generate or s.output_scores or s.output_logits):
            return sequences
        scores = tuple(self.scores[:steps]) if s.output_scores else None
        logprobs = torch.stack(self.logprobs[:steps], dim=1) if s.output_scores and steps else None
        logits = tuple(self.logits[:steps]) if s.output_logits else None
        return GenerateOutput(sequences=sequences, scores=scores, logprobs=logprobs, logits=logits)


@torch.inference_mode()
def generate(
    model: CausalDecoder,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    generation_config=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    draft_model=None,
    assistant_model=None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    streamer=None,
    **kwargs,
):
    """Greedy or sampled continuation of ``input_ids`` (B, S), with HF's argument names and meaning:
    max_new_tokens or max_length (which counts the prompt's columns), min_new_tokens or min_length, do_sample,
    temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size, num_return_sequences,
    eos_token_id (one id or several; [] for none), pad_token_id, stop_strings (needs ``tokenizer``),
    output_scores, output_logits, return_dict_in_generate; or a ``transformers.GenerationConfig``, which keyword
    arguments override. ``model.generation_config`` (the checkpoint's generation_config.json, else config.json's
    token ids) gives the default EOS and pad ids; its sampling settings apply only when passed as
    ``generation_config=model.generation_config`` (greedy unless asked, see ``resolve_settings``).
    Every argument is checked up front, naming it; an HF setting that would change the tokens and is not
    implemented here is refused by name. A batch may be left- or right-padded (pass
    ``attention_mask``): each row continues from its own last real token, and the new tokens follow the
    prompt's columns as given. Finished rows continue with pad_token_id (default: the first EOS id).
    ``generator`` seeds sampling. ``draft_model`` (HF's name: ``assistant_model``) turns on speculative
    decoding (greedy, the same tokens and scores as plain greedy). ``on_token`` gets each step's (B,) tokens;
    ``streamer`` is HF's streamer protocol (``TextStreamer``): ``put`` the prompt, then each step's tokens,
    then ``end()``."""
    check_causal_decoder(model)
    settings = resolve_settings(model.generation_config, model.decoder_config.vocab_size, generation_config, **kwargs)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be callable (it gets each step's (batch,) tokens), got {type(on_token).__name__}")
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer must have put(tokens) and end() (transformers' TextStreamer), got {type(streamer).__name__}")
    if assistant_model is not None:
        if draft_model is not None:
            raise ValueError("give draft_model or assistant_model (transformers' name for it), not both")
        draft_model = assistant_model
    if draft_model is not None:
        for name, value in (("on_token", on_token), ("streamer", streamer)):
            if value is not None:
                raise ValueError(f"{name} is not supported with draft_model: speculative decoding emits several tokens "
                                 "per row per step, a different number in each row")
        return speculative_generate(model, draft_model, input_ids, attention_mask=attention_mask, settings=settings)
    run = Generation(model, input_ids, attention_mask=attention_mask, settings=settings, generator=generator, tokenizer=tokenizer)
    if streamer is not None:
        streamer.put(run.input_ids.cpu())
    for step, token in enumerate(run):
        if on_token is not None:
            on_token(token)
        if streamer is not None and run.running_at(step):
            streamer.put(token.cpu())
    if streamer is not None:
        streamer.end()
    return run.output()

"""Streaming text as tokens arrive.

``TextStream`` turns a growing list of token ids into text pieces, correct across multi-byte characters and
tokens that merge with their neighbours: decode everything so far, emit the new suffix, and hold back a piece
that ends inside a character (the tokenizer shows it as U+FFFD). ``stream`` runs a generation and yields
those pieces.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..models.protocols import check_causal_decoder


class TextStream:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def flush(self) -> str:
        """Whatever is still held back, once generation has ended."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece


@torch.inference_mode()
def stream(
    model, tokenizer, input_ids: torch.Tensor, *, attention_mask=None, generation_config=None,
    skip_special_tokens: bool = True, generator=None, on_token=None, **kwargs,
) -> Iterator[str]:
    """Yield text pieces of the continuation of a single prompt (1, S) as they are generated. Joined, they
    equal ``tokenizer.decode(new_tokens, skip_special_tokens=...)``; generation stops at EOS. ``on_token``
    receives each token id as it comes (for timing). The other arguments are ``generate``'s."""
    from .generate import Generation
    from .settings import resolve_settings

    check_causal_decoder(model)

    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"stream takes one prompt (1, seq_len), got batch {input_ids.shape[0]}")
    settings = resolve_settings(model.generation_config, model.decoder_config.vocab_size, generation_config, **kwargs)
    if settings.num_return_sequences != 1:
        raise ValueError("stream takes one prompt and yields one text: num_return_sequences must be 1")
    text = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
    eos = set(settings.eos_ids)
    for token in Generation(model, input_ids, attention_mask=attention_mask, settings=settings, generator=generator,
                            tokenizer=tokenizer):
        token_id = int(token[0])
        if on_token is not None:
            on_token(token_id)
        piece = text.push(token_id)
        if piece:
            yield piece
        if token_id in eos:
            break
    tail = text.flush()
    if tail:
        yield tail

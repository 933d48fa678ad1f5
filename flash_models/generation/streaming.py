"""Turning a growing list of token ids into text pieces, correct across multi-byte characters and tokens
that merge with their neighbours: decode everything so far, emit the new suffix, and hold back a piece that
ends inside a character (the tokenizer shows it as U+FFFD)."""

from __future__ import annotations


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
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece

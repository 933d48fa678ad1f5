"""Tokenizers through transformers.AutoTokenizer, for HF folders, hub ids and GGUF files alike."""

from __future__ import annotations

from pathlib import Path

import transformers

from .hub import is_gguf


def load_tokenizer(name_or_path: str | Path):
    if is_gguf(name_or_path):
        path = Path(name_or_path)
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return transformers.AutoTokenizer.from_pretrained(name_or_path)

"""Tokenizers through transformers.AutoTokenizer, for HF folders, hub ids and GGUF files alike."""

from __future__ import annotations

from pathlib import Path

import transformers

from .hub import is_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(name_or_path: str | Path):
    if is_gguf(name_or_path):
        path = Path(name_or_path)
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    folder = Path(name_or_path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {folder} (expected one of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer next to the model (tokenizer.save_pretrained)"
        )
    return transformers.AutoTokenizer.from_pretrained(name_or_path)

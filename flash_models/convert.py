"""``flash-models convert SRC DST``: any checkpoint we load (HF folder, hub id, GGUF) -> a complete HF folder.

The folder holds what transformers and our own command line need to use it on their own: config.json and
safetensors (``save_pretrained``), the tokenizer with its chat template, and generation_config.json when the
source says which tokens begin, end and pad a sequence. DST is written whole (``checkpoint.atomic``): it holds
the old folder or the new one, never a mix. A GGUF file's tokenizer is the one transformers
builds from the file's metadata (``checkpoint.tokenizer``); its special token ids come from the same file.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from .checkpoint.atomic import atomic_folder, why_unwritable

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# Tokenizer files an HF folder may hold beside the model, copied verbatim (AutoTokenizer reads them back).
_TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                       "*.model", "*.tiktoken", "chat_template.json", "chat_template.jinja", GENERATION_CONFIG)


def check_destination(dst: str | Path, *, overwrite: bool, src: str | Path | None = None) -> None:
    """Refuse to mix a conversion into a folder that already holds something, unless asked to, and to replace a
    folder that holds the source itself (DST is replaced whole: the source would be gone)."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst} is a file; give a folder to write the converted model into")
    if src is not None and dst.exists():
        src = Path(src)
        source, target = src.parent.resolve() / src.name, dst.resolve()  # a link to a source elsewhere may go
        if source == target or target in source.parents:
            what = "is the source folder" if source == target else f"holds the source {src}"
            raise ValueError(f"{dst} {what}, and a conversion replaces its folder whole (the source would be "
                             "deleted); write into another folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"{dst} already holds files; pass --overwrite to replace them, or pick an empty folder")
    # DST is written beside itself and swapped in (checkpoint.atomic): its nearest existing folder must take it.
    problem = why_unwritable(dst)
    if problem:
        raise ValueError(f"cannot write {dst}: {problem}")


def gguf_generation_config(path: Path) -> dict:
    """bos/eos/pad token ids from a GGUF file's tokenizer metadata (only those the file sets)."""
    from .checkpoint.gguf_reader import GGUFFile

    fields = GGUFFile(path).fields
    keys = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
            "pad_token_id": "tokenizer.ggml.padding_token_id"}
    return {name: int(fields[key]) for name, key in keys.items() if fields.get(key) is not None}


def _write_generation_config(ids: dict, dst: Path) -> None:
    import transformers

    transformers.GenerationConfig(**ids).save_pretrained(dst)


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for pattern in _TOKENIZER_PATTERNS:
        for file in src.glob(pattern):
            if file.is_file():
                shutil.copy2(file, dst / file.name)
                copied.append(file.name)
    return copied


def convert(src: str | Path, dst: str | Path, *, dtype=None, max_shard_size: int | str = "5GB") -> str:
    """Load ``src`` (a .gguf file or an HF folder) and write ``dst``; returns a one-line summary."""
    from .checkpoint import from_pretrained
    from .checkpoint.hub import TOKENIZER_FILES, is_gguf

    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite=True, src=src)
    tokenizer, generation = None, None
    if is_gguf(src):
        from .checkpoint.gguf_file import check_gguf
        from .checkpoint.tokenizer import check_gguf_tokenizer, load_gguf_tokenizer

        reader, _ = check_gguf(src)  # before any write: a file we cannot read leaves nothing behind
        try:
            check_gguf_tokenizer(reader)
        except ValueError as err:  # weights alone, as from an HF folder without tokenizer files
            log.warning("%s; %s holds the model only", err, dst)
        else:
            tokenizer = load_gguf_tokenizer(src)
        generation = gguf_generation_config(src)
    model = from_pretrained(src, dtype=dtype)
    # The whole folder (weights, tokenizer, generation config) is written aside and swapped in at once: a
    # failure leaves DST as it was, and an --overwrite keeps none of the old folder's files (a previous
    # model's tokenizer files must not sit beside this model's).
    with atomic_folder(dst) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if is_gguf(src):
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if generation:
                _write_generation_config(generation, tmp)
            template = tokenizer is not None and tokenizer.chat_template
            extras = ["tokenizer" if tokenizer is not None else None, "chat template" if template else None,
                      "generation config" if generation else None]
        else:
            copied = _copy_tokenizer_files(src, tmp)
            has_tokenizer = any(name in copied for name in TOKENIZER_FILES)
            if not has_tokenizer:
                log.warning("%s has no tokenizer files: %s holds the model only", src, dst)
            template = any(name.startswith("chat_template") for name in copied) or _config_has_template(tmp)
            extras = ["tokenizer" if has_tokenizer else None, "chat template" if template else None,
                      "generation config" if GENERATION_CONFIG in copied else None]
    parameters = sum(p.numel() for p in model.parameters())
    written = ", ".join(e for e in extras if e)
    return f"wrote {dst} ({model.config.model_type}, {parameters:,} parameters{'; ' + written if written else ''})"


def _config_has_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    return config.is_file() and "chat_template" in json.loads(config.read_text())

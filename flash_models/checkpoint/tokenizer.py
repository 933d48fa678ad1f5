"""Tokenizers through transformers.AutoTokenizer, for HF folders, hub ids and GGUF files alike.

A GGUF file's tokenizer is rebuilt by transformers from the file's metadata, which takes seconds (it parses
every vocabulary entry through the gguf package). The first load saves the result as an ordinary tokenizer
folder in the cache (``$FLASH_MODELS_CACHE``, default ``~/.cache/flash_models``), keyed by the file's path,
size and modification time and by the transformers version; later loads read that folder instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers

from .gguf_reader import GGUFFile
from .hub import is_gguf, require_tokenizer

log = logging.getLogger(__name__)

CACHE_ENV = "FLASH_MODELS_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flash_models")


def _gguf_cache_dir(path: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|transformers {transformers.__version__}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _save_atomically(tokenizer, target: Path) -> None:
    """Write into a temporary folder beside ``target`` and rename it: a reader never sees half a folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # another process may have won the race; anything else is worth a word
            raise


def gguf_tokenizer_is_cached(path: str | Path) -> bool:
    """Whether ``load_gguf_tokenizer`` will read a converted folder (fast) rather than convert (seconds)."""
    return (_gguf_cache_dir(Path(path)) / "tokenizer_config.json").is_file()


def check_gguf_tokenizer(reader: GGUFFile) -> None:
    """A GGUF file without a vocabulary (llama.cpp writes some for weights alone) is named as such, not as
    whatever transformers' builder stumbles on."""
    missing = [key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if key not in reader.fields]
    if missing:
        raise ValueError(f"{reader.path} holds no tokenizer (GGUF metadata {' and '.join(missing)} missing): use a "
                         "GGUF file with its vocabulary, or `flash-models convert` this one to a folder and add the "
                         "model's tokenizer files to it")
    if reader.fields["tokenizer.ggml.model"] == "gpt2" and not reader.fields.get("tokenizer.ggml.merges"):
        raise ValueError(f"{reader.path}: its byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2') has no merges "
                         "(GGUF metadata tokenizer.ggml.merges), so it cannot be rebuilt; the file is incomplete")


def load_gguf_tokenizer(path: str | Path, *, use_cache: bool = True):
    path = Path(path)
    cached = _gguf_cache_dir(path) if use_cache else None
    if cached is not None and gguf_tokenizer_is_cached(path):
        return transformers.AutoTokenizer.from_pretrained(cached, trust_remote_code=False)
    check_gguf_tokenizer(GGUFFile(path))  # a corrupt file or a missing vocabulary, named by us
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    if cached is not None:
        try:
            _save_atomically(tokenizer, cached)
        except OSError as err:  # a read-only home, a full disk: the tokenizer is still good, only slower next time
            log.warning("could not cache the GGUF tokenizer in %s (%s); set %s to a writable folder", cached, err, CACHE_ENV)
    return tokenizer


def load_tokenizer(name_or_path: str | Path):
    if is_gguf(name_or_path):
        return load_gguf_tokenizer(name_or_path)
    folder = Path(name_or_path)
    if folder.is_dir():
        require_tokenizer(folder)
    try:  # never code from the checkpoint (and never transformers' prompt asking whether to run it)
        return transformers.AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(f"{name_or_path}: the tokenizer is code shipped with the checkpoint (auto_map in its "
                         "tokenizer_config.json), and flash_models never runs code from a checkpoint; use a tokenizer "
                         "transformers implements (a tokenizer.json with a standard tokenizer_class)") from None

"""What a MODEL argument names, found without torch or network waits: the command line checks it before
anything loads, so a typo or an offline hub id is one line within a second, not a traceback after a load. A GGUF
file's header is read and checked here too (torch is imported for that, as its load needs it anyway)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.hub import is_gguf, no_config_error, require_tokenizer, resolve_model_dir
_DEVICE = re.compile(r"(cpu|mps|cuda(:\d+)?)")


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a .gguf file or an HF folder (a hub repo resolved to its local snapshot)
    is_gguf: bool


def check_device_name(device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"{device!r} is not a device: cpu, cuda, cuda:N or mps")


def locate_model(name: str, *, need_tokenizer: bool) -> ModelSource:
    """An alias, a .gguf file, an HF folder or a hub repo id (from the local HF cache, or downloaded), checked:
    FileNotFoundError / ValueError name what is wrong and how to fix it."""
    from .embedded import ALIASES, resolve_alias

    if not name.strip():
        raise ValueError("the model name is empty: give a folder, a .gguf file, a hub repo id or an alias "
                         f"({', '.join(ALIASES)})")
    path = Path(resolve_alias(name)).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        _check_gguf(path, need_tokenizer=need_tokenizer)
        return ModelSource(path, is_gguf=True)
    if path.is_file():
        raise ValueError(f"{path} is a file: give an HF model folder (with config.json) or a .gguf file")
    if not path.is_dir():
        path = resolve_model_dir(name)  # a hub repo id; a path-like name that does not exist raises here
    if not (path / "config.json").is_file():
        raise no_config_error(path)
    if need_tokenizer:
        require_tokenizer(path)
    return ModelSource(path, is_gguf=False)


def _check_gguf(path: Path, *, need_tokenizer: bool) -> None:
    """A corrupt or truncated file, an architecture, tensor or tokenizer we cannot read: named before the
    tokenizer (transformers' GGUF reader) or the weights load."""
    from .checkpoint.gguf_file import check_gguf
    from .checkpoint.tokenizer import check_gguf_tokenizer

    reader, _ = check_gguf(path)
    if need_tokenizer:
        check_gguf_tokenizer(reader)

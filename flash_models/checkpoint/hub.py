"""Where a model comes from: a local HF folder, a local .gguf file, or a HuggingFace Hub repo id."""

from __future__ import annotations

from pathlib import Path

from .files import SAFETENSORS, SAFETENSORS_INDEX

# What a model folder needs besides weights; tokenizer files come along so the CLI can use them offline.
_CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def is_gguf(name_or_path: str | Path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def resolve_model_dir(name_or_path: str | Path, *, revision: str | None = None) -> Path:
    """A local folder as is; anything else is a hub repo id, downloaded (safetensors preferred, .bin if the
    repo has no safetensors) into the HF cache."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/")) or str(name_or_path).count("/") > 1:
        raise FileNotFoundError(f"{name_or_path}: no model folder there (expected a folder with config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id = str(name_or_path)
    try:
        local = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_CONFIG_PATTERNS + ["*.safetensors"]))
        if not (local / SAFETENSORS).exists() and not (local / SAFETENSORS_INDEX).exists():
            local = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_CONFIG_PATTERNS + ["pytorch_model*.bin"]))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise ValueError(
            f"{repo_id!r} is not a local folder or .gguf file, and the HuggingFace Hub could not provide it "
            f"({type(err).__name__}: {err})"
        ) from err
    return local


def resolve_gguf(name_or_path: str | Path, *, gguf_file: str | None = None, revision: str | None = None) -> Path:
    """A local .gguf path, or ``gguf_file`` inside a hub repo (or local folder) ``name_or_path``."""
    if gguf_file is None:
        return Path(name_or_path)
    folder = Path(name_or_path)
    if folder.is_dir():
        return folder / gguf_file
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(str(name_or_path), gguf_file, revision=revision))

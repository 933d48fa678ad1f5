"""Where a model comes from: a local HF folder, a local .gguf file, or a HuggingFace Hub repo id."""

from __future__ import annotations

import contextlib
from pathlib import Path

# What a model folder needs besides weights; tokenizer files come along so the CLI can use them offline.
_CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
# A folder holds a tokenizer when it has one of these (AutoTokenizer reads it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def require_tokenizer(folder: Path) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {folder} (expected one of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer next to the model (tokenizer.save_pretrained)"
        )


def no_config_error(folder: Path) -> FileNotFoundError:
    """A folder without config.json; the error says what the folder is instead where it can tell: one holding
    .gguf files (a GGUF file is loaded by its own path), or a transformers.Trainer checkpoint of our model saved
    without ``SavePretrainedCallback`` or the folder of ``Trainer.save_model()`` (both hold the model's bare state
    dict)."""
    ggufs = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
    hint = f"; it holds {', '.join(ggufs[:3])}: give the .gguf file's path instead" if ggufs else ""
    if not ggufs and (folder / "trainer_state.json").is_file():
        hint = ("; it is a transformers.Trainer checkpoint saved without flash_models.hf.SavePretrainedCallback, "
                "which holds the model's bare state dict: build the same model and call model.load_state_dict("
                "safetensors.torch.load_file(folder / 'model.safetensors')), or train with "
                "callbacks=[SavePretrainedCallback()] so that every checkpoint loads with from_pretrained")
    elif not ggufs and (folder / "training_args.bin").is_file():
        hint = ("; it is what transformers.Trainer.save_model() writes for a flash-models model (the bare state dict, "
                "in our own layout): export the trained model with model.save_pretrained(folder) instead, or build the "
                "same model and call model.load_state_dict(safetensors.torch.load_file(folder / 'model.safetensors'))")
    return FileNotFoundError(f"{folder} has no config.json: not an HF model folder{hint}")


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def is_gguf(name_or_path: str | Path) -> bool:
    """A path ending in .gguf, or a local file of another name that starts as a GGUF file does (``model.bin``
    downloaded under another name): loaded as GGUF, not looked for as a model folder."""
    if str(name_or_path).lower().endswith(".gguf"):
        return True
    path = Path(name_or_path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def resolve_model_dir(name_or_path: str | Path, *, revision: str | None = None, subfolder: str = "",
                      **download) -> Path:
    """A local folder as is; anything else is a hub repo id, downloaded (safetensors preferred, .bin if the
    repo has no safetensors) into the HF cache. ``subfolder`` is the model's folder inside either; ``download``
    are huggingface_hub's ``cache_dir``, ``local_files_only``, ``token`` and ``force_download``."""
    path = Path(name_or_path)
    if path.is_dir():
        return _subfolder(path, subfolder)
    if path.exists() or str(name_or_path).startswith((".", "/")) or str(name_or_path).count("/") > 1:
        raise FileNotFoundError(f"{name_or_path}: no model folder there (expected a folder with config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id = str(name_or_path)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise FileNotFoundError(f"{_not_here(repo_id)}: no such file or folder, and not a hub repo id (owner/name)") from None
    # No network (or HF_HUB_OFFLINE=1) fails at once here, served from the local cache when the repo is in it:
    # the snapshot lookup makes one attempt, where transformers' own loaders retry for about a minute.
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    with _hub_errors(repo_id):
        patterns = [prefix + p for p in _CONFIG_PATTERNS + ["*.safetensors"]]
        root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **download))
        if not (root / prefix / "model.safetensors").exists() and not (root / prefix / "model.safetensors.index.json").exists():
            patterns = [prefix + p for p in _CONFIG_PATTERNS + ["pytorch_model*.bin"]]
            root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **download))
    return _subfolder(root, subfolder)


def _subfolder(folder: Path, subfolder: str) -> Path:
    """``folder / subfolder``, which must be a folder inside ``folder`` (the model's files)."""
    inner = folder / subfolder if subfolder else folder
    if subfolder and (Path(subfolder).is_absolute() or ".." in Path(subfolder).parts):
        raise ValueError(f"subfolder={subfolder!r} must be a relative folder inside {folder}")
    if not inner.is_dir():
        raise FileNotFoundError(f"{inner}: no such folder (subfolder={subfolder!r} of {folder})")
    return inner


def _not_here(repo_id: str) -> str:
    return f"{repo_id!r} is not a local folder or .gguf file, and the HuggingFace Hub could not provide it"


@contextlib.contextmanager
def _hub_errors(repo_id: str, what: str = ""):
    """huggingface_hub's errors for a download, as one ValueError that says why and what to do."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    not_here = _not_here(repo_id) + what
    try:
        yield
    except LocalEntryNotFoundError as err:
        raise ValueError(f"{not_here} (not in the local HF cache, and the Hub is unreachable or HF_HUB_OFFLINE is set)") from err
    except RepositoryNotFoundError as err:
        raise ValueError(f"{not_here} (no such repo, or a private one: log in with `hf auth login`)") from err
    except (HfHubHTTPError, OSError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{not_here} ({type(err).__name__}: {reason})") from err


def resolve_gguf(name_or_path: str | Path, *, gguf_file: str | None = None, revision: str | None = None,
                 subfolder: str = "", **download) -> Path:
    """A local .gguf path, or ``gguf_file`` inside a hub repo (or local folder) ``name_or_path`` (in its
    ``subfolder``); ``download`` as in ``resolve_model_dir``."""
    if gguf_file is None:
        if subfolder:
            raise ValueError(f"subfolder={subfolder!r} with a .gguf path: give the file's own path, or the folder "
                             "with gguf_file=")
        return Path(name_or_path)
    folder = Path(name_or_path)
    if folder.is_dir():
        return _subfolder(folder, subfolder) / gguf_file
    from huggingface_hub import hf_hub_download

    with _hub_errors(str(name_or_path), f" with the file {gguf_file!r}"):
        return Path(hf_hub_download(str(name_or_path), gguf_file, revision=revision, subfolder=subfolder or None,
                                    **download))

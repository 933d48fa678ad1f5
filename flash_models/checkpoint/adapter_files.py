"""PEFT adapter folders as PEFT writes and reads them: ``adapter_config.json`` and ``adapter_model.safetensors``
(or an older ``adapter_model.bin``), from a local folder or a Hub repo; tensors named
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` (PEFT leaves the adapter's name out on disk)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .atomic import atomic_folder
from .files import _read_safetensors, read_json_object, safe_torch_load
from .hub import _hub_errors, _not_here, _subfolder
from .lora_layout import LoraWeights

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # PeftModel's path to the model it wraps, which starts every saved key
_OWNED = (ADAPTER_CONFIG, ADAPTER_SAFETENSORS, ADAPTER_BIN)  # a new save replaces these and keeps other files


def resolve_adapter_dir(name_or_path: str | Path, *, revision: str | None = None, subfolder: str = "",
                        **download) -> Path:
    """A local adapter folder as is; anything else is a Hub repo id, whose adapter files are downloaded (the
    safetensors file, else the .bin) into the HF cache. ``download`` are huggingface_hub's ``cache_dir``,
    ``local_files_only``, ``token`` and ``force_download``."""
    path = Path(name_or_path)
    if path.is_dir():
        folder = _subfolder(path, subfolder)
    elif path.exists() or str(name_or_path).startswith((".", "/")) or str(name_or_path).count("/") != 1:
        raise FileNotFoundError(f"{name_or_path}: no adapter folder there (expected a folder with {ADAPTER_CONFIG} "
                                f"and {ADAPTER_SAFETENSORS}, as PEFT's save_pretrained writes it)")
    else:
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder.strip('/')}/" if subfolder else ""
        with _hub_errors(str(name_or_path)):
            for weights in (ADAPTER_SAFETENSORS, ADAPTER_BIN):
                root = Path(snapshot_download(str(name_or_path), revision=revision,
                                              allow_patterns=[prefix + ADAPTER_CONFIG, prefix + weights], **download))
                if (root / prefix / weights).is_file():
                    break
        folder = _subfolder(root, subfolder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{folder} has no {ADAPTER_CONFIG}: not a PEFT adapter folder"
                                + ("" if path.is_dir() else f" ({_not_here(str(name_or_path))})"))
    return folder


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config fields and its tensors."""
    config_path = folder / ADAPTER_CONFIG
    fields = read_json_object(config_path, what="adapter settings")
    if (folder / ADAPTER_SAFETENSORS).is_file():
        tensors = _read_safetensors(folder / ADAPTER_SAFETENSORS)
    elif (folder / ADAPTER_BIN).is_file():
        tensors = safe_torch_load(folder / ADAPTER_BIN, what="adapter file")
    else:
        raise FileNotFoundError(f"{folder} has {ADAPTER_CONFIG} but no {ADAPTER_SAFETENSORS} (or {ADAPTER_BIN}): the "
                                "adapter's weights are missing")
    return fields, tensors


@dataclass(frozen=True)
class AdapterContents:
    """A saved LoRA state dict, sorted by what each tensor is, under the model's own key names."""

    loras: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (lora_A, lora_B)
    # PEFT saves the base weights of an adapted LM head or embedding next to its LoRA (``<module>.base_layer.weight``:
    # the vocabulary may have been resized) and loads them back over the model's: parameter key -> tensor.
    base_weights: dict[str, torch.Tensor]
    saved_modules: dict[str, torch.Tensor]  # the trained copies of ``modules_to_save``: parameter key -> tensor


def adapter_contents(tensors: dict[str, torch.Tensor], *, modules_to_save, source: str) -> AdapterContents:
    """Sort a saved LoRA state dict. A tensor of none of the three kinds (a LoRA on an embedding, a trained
    bias) is refused, listed."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    base_weights, saved_modules, other = {}, {}, []
    for key, tensor in tensors.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else None
        kind = next((k for k in ("lora_A", "lora_B") if name is not None and name.endswith(f".{k}.weight")), None)
        if kind is not None:
            pairs.setdefault(name.removesuffix(f".{kind}.weight"), {})[kind] = tensor
        elif name is not None and ".base_layer." in name:
            base_weights[name.replace(".base_layer.", ".")] = tensor
        elif name is not None and ".lora_" not in name and _saved_module(name, modules_to_save or ()):
            saved_modules[name] = tensor
        else:
            other.append(key)
    if other:
        embedding = any("lora_embedding" in key for key in other)
        embedding = " (LoRA on embedding layers is not carried over)" if embedding else ""
        raise ValueError(f"{source} holds tensors other than LoRA's A and B of linear layers and the modules_to_save"
                         f"{embedding}: {', '.join(sorted(other)[:10])}{' ...' if len(other) > 10 else ''}")
    halves = [name for name, pair in pairs.items() if len(pair) != 2]
    if halves:
        raise ValueError(f"{source} holds only one of lora_A and lora_B for {', '.join(sorted(halves)[:10])}: the "
                         "adapter file is damaged")
    return AdapterContents({name: (pair["lora_A"], pair["lora_B"]) for name, pair in pairs.items()}, base_weights,
                           saved_modules)


def _saved_module(key: str, modules_to_save) -> bool:
    """Whether a parameter key belongs to a module that ``modules_to_save`` names (PEFT's rule: a name suffix)."""
    module = key.rsplit(".", 1)[0]
    return any(module.endswith(name) for name in modules_to_save)


def lora_state(layers: dict[str, LoraWeights]) -> dict[str, torch.Tensor]:
    """The saved LoRA state dict of the layers (module name -> weights)."""
    state = {}
    for name, lora in layers.items():
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = lora.A
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = lora.B
    return state


def write_adapter(folder: str | Path, fields: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the adapter atomically per folder (``atomic.atomic_folder``): a reader sees the old adapter or the
    new one, whole; the folder's other files (a tokenizer, a README) stay."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_folder(folder, owned=lambda name: name in _OWNED) as tmp:
        save_file(tensors, str(tmp / ADAPTER_SAFETENSORS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")

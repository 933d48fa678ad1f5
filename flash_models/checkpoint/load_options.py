"""transformers' ``from_pretrained`` keyword arguments, read as ``flash_models.from_pretrained`` reads them.

A user who moves a call from ``AutoModelForCausalLM.from_pretrained`` keeps its arguments: the device ones
(``device_map``) and the attention one (``attn_implementation``) map to ours, those that change nothing here
are accepted, config fields (``num_labels=3``, ``rope_scaling=...``) override the checkpoint's config as in
transformers, and anything else is refused by name, never silently dropped.
"""

from __future__ import annotations

import difflib
import logging

import torch

log = logging.getLogger(__name__)

# transformers' attn_implementation names -> ours (ours are accepted there too).
ATTN_IMPLEMENTATIONS = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
                        "flash": "flash", "auto": "auto"}
# Loading options of transformers that change nothing here: the weights always go to a meta model first and
# are assigned once (what low_cpu_mem_usage asks for), and checkpoint code never runs (trust_remote_code).
NO_EFFECT = ("low_cpu_mem_usage", "_fast_init", "use_flash_attention_2")
# Loading options of transformers flash-models does not implement, with what to do instead.
UNSUPPORTED = {
    "variant": "rename the variant's weight files to model.safetensors (or its index)",
    "output_loading_info": "a checkpoint that does not fit raises, listing missing and unexpected keys",
    "ignore_mismatched_sizes": "a checkpoint that does not fit raises, naming expected and found shapes; load the "
                               "encoder and add a fresh head (BertForSequenceClassification.from_pretrained(path, num_labels=N))",
    "quantization_config": "load the unquantized weights, or a GGUF file",
    "load_in_8bit": "load the unquantized weights, or a GGUF file",
    "load_in_4bit": "load the unquantized weights, or a GGUF file",
    "max_memory": "flash-models loads a model on one device (device=)",
    "offload_folder": "flash-models loads a model on one device (device=)",
    "offload_state_dict": "flash-models loads a model on one device (device=)",
    "offload_buffers": "flash-models loads a model on one device (device=)",
    "tp_plan": "tensor parallelism is the Trainer's (distributed.strategy)",
    "tp_size": "tensor parallelism is the Trainer's (distributed.strategy)",
    "state_dict": "load the state dict into the model: model.load_state_dict(state_dict) reads HF's layout",
    "from_tf": "flash-models reads safetensors, PyTorch .bin and GGUF files",
    "from_flax": "flash-models reads safetensors, PyTorch .bin and GGUF files",
    "key_mapping": "flash-models maps HF's key names by each family's own rules",
    "adapter_name": "load the base model, then attach the adapter with peft.PeftModel.from_pretrained(model, path)",
    "adapter_kwargs": "load the base model, then attach the adapter with peft.PeftModel.from_pretrained(model, path)",
    "proxies": "set HTTP(S)_PROXY in the environment; huggingface_hub reads it",
}
# Config flags our models do not act on: set through from_pretrained they would be silently ignored.
REFUSED_CONFIG_FLAGS = {
    "output_hidden_states": "flash-models models return the last hidden state only",
    "output_attentions": "flash-models models do not return attention weights",
    "return_dict": "the output already indexes like a tuple (out[0], out.to_tuple())",
}


def device_from_map(device, device_map):
    """The one device ``device_map`` names: a device (str, int, torch.device), "auto" (the GPU when there is one,
    else the CPU), or a dict whose entries all name the same device. A map that spreads the model over several
    devices is refused: flash-models loads a model on one device."""
    if device_map is None:
        return device
    if isinstance(device_map, dict):
        targets = {str(torch.device(v) if isinstance(v, int) else v) for v in device_map.values()}
        if len(targets) != 1:
            raise ValueError(f"device_map={device_map!r} spreads the model over {sorted(targets)}: flash-models loads a "
                             "model on one device; pass device= (or a device_map naming one device)")
        chosen = device_map[next(iter(device_map))]
    elif device_map == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    elif device_map in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map={device_map!r} spreads the model over several devices: flash-models loads a "
                         "model on one device; pass device= (or device_map='auto': the GPU, else the CPU)")
    else:
        chosen = device_map
    try:
        differ = device is not None and torch.device(device) != torch.device(chosen)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} / device_map={device_map!r}: not a torch device ({err})") from None
    if differ:
        raise ValueError(f"device={device!r} and device_map={device_map!r} name different devices: give one of them")
    return chosen


def attn_impl_from_hf(attn_impl: str, attn_implementation: str | None) -> str:
    """Our ``attn_impl`` from transformers' ``attn_implementation`` (its names or ours); both given must agree."""
    if attn_implementation is None:
        return attn_impl
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r} is not one flash-models runs; use one of "
                         f"{sorted(ATTN_IMPLEMENTATIONS)} (flash_attention_2/3 run our flash kernels)")
    mapped = ATTN_IMPLEMENTATIONS[attn_implementation]
    if attn_impl != "auto" and attn_impl != mapped:
        raise ValueError(f"attn_impl={attn_impl!r} and attn_implementation={attn_implementation!r} disagree: give one")
    return mapped


def config_overrides(hf_config_class, options: dict) -> dict:
    """The keyword arguments that are fields of the checkpoint's HF config class (transformers applies them to
    the loaded config); the others are refused by name: a transformers option flash-models does not implement
    (with what to do instead), or a name that is neither (with the closest field)."""
    for name in [n for n in options if n in NO_EFFECT]:
        options.pop(name)
    if options.pop("trust_remote_code", None):
        log.warning("trust_remote_code=True has no effect: flash-models never runs code from a checkpoint; it loads "
                    "the architectures it implements")
    unsupported = sorted(n for n in options if n in UNSUPPORTED)
    if unsupported:
        raise ValueError("from_pretrained does not support " + "; ".join(f"{n}= ({UNSUPPORTED[n]})" for n in unsupported))
    refused = sorted(n for n in options if n == "return_dict" and options[n] is False
                     or n in ("output_hidden_states", "output_attentions") and options[n])
    if refused:
        raise ValueError("; ".join(f"{n}={options[n]!r} is not supported ({REFUSED_CONFIG_FLAGS[n]})" for n in refused))
    if not options:
        return {}
    known = set(hf_config_class().to_dict()) | set(hf_config_class.attribute_map) | {"num_labels"}
    unknown = [n for n in options if n not in known and n not in REFUSED_CONFIG_FLAGS]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known | set(ATTN_IMPLEMENTATIONS) | _ARGUMENTS), n=1)
            hints.append(f"{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"from_pretrained got unexpected keyword argument(s) {', '.join(hints)}: neither a loading "
                        f"option nor a field of {hf_config_class.__name__}")
    return {n: v for n, v in options.items() if n not in REFUSED_CONFIG_FLAGS}


# The loading options from_pretrained itself takes (for the did-you-mean hint of a misspelt one).
_ARGUMENTS = {"dtype", "torch_dtype", "device", "device_map", "attn_impl", "attn_implementation", "kernel_backend",
              "gguf_file", "revision", "subfolder", "cache_dir", "local_files_only", "token", "force_download",
              "config", "trust_remote_code", "low_cpu_mem_usage", "use_safetensors"}

"""transformers' ``save_pretrained`` keyword arguments, read as ``model.save_pretrained`` reads them.

A call moved from a transformers model keeps its arguments: those flash-models implements mean what they mean
there (``max_shard_size``, ``safe_serialization=True``, ``state_dict``, ``is_main_process``), those that change
nothing here are accepted (``save_peft_format``: transformers' own PEFT integration, which our models never
carry), and the others are refused by name with what to do instead, never silently dropped.
"""

from __future__ import annotations

import difflib

import torch

# transformers' hub arguments (``push_to_hub``'s, passed on to huggingface_hub): flash-models saves offline only.
HUB_ARGUMENTS = ("token", "repo_id", "commit_message", "commit_description", "create_pr", "private", "revision", "tags")
PUSH_INSTEAD = ("flash-models saves to a local folder only; save, then upload the folder with huggingface_hub: "
                "HfApi().upload_folder(folder_path=save_directory, repo_id=...) (or `hf upload REPO_ID save_directory`)")
# What save_pretrained takes (for the did-you-mean hint of a misspelt one).
ARGUMENTS = ("is_main_process", "state_dict", "push_to_hub", "max_shard_size", "variant", "save_peft_format",
             "save_original_format", "distributed_checkpoint", "safe_serialization") + HUB_ARGUMENTS


def check_save_options(*, push_to_hub, variant, safe_serialization, save_original_format, distributed_checkpoint,
                       is_main_process, hub: dict) -> None:
    """Refuse, by name, the transformers save options flash-models does not implement (and unknown keywords)."""
    unknown = sorted(n for n in hub if n not in HUB_ARGUMENTS)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, ARGUMENTS, n=1)
            hints.append(name + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"save_pretrained got unexpected keyword argument(s) {', '.join(hints)}; it takes "
                        f"{', '.join(ARGUMENTS)}")
    if push_to_hub:
        raise ValueError(f"save_pretrained(push_to_hub=True) is not supported: {PUSH_INSTEAD}")
    given = sorted(n for n, v in hub.items() if v is not None and v is not False)
    if given:
        raise ValueError(f"save_pretrained: {', '.join(f'{n}=' for n in given)} {'is' if len(given) == 1 else 'are'} "
                         f"for push_to_hub, which is not supported: {PUSH_INSTEAD}")
    if variant is not None:
        raise ValueError(f"save_pretrained(variant={variant!r}) is not supported: flash-models writes and reads "
                         "model.safetensors (or its shards) only; save each variant to a folder of its own")
    if safe_serialization is not True:
        raise ValueError(f"safe_serialization={safe_serialization!r}: flash-models writes safetensors only (a pickled "
                         ".bin can run code when it is loaded, and transformers reads safetensors)")
    if save_original_format is not True:
        raise ValueError(f"save_original_format={save_original_format!r} is not supported: save_pretrained writes HF's "
                         "layout, which transformers reads; for our internal layout (fused projections) save "
                         "model.state_dict() with safetensors.torch.save_file")
    if distributed_checkpoint:
        raise ValueError("save_pretrained(distributed_checkpoint=True) is not supported: it writes one consolidated "
                         "checkpoint; the Trainer's checkpoints (train.save_every) are what resumes a distributed run")
    if not isinstance(is_main_process, bool):
        raise ValueError(f"is_main_process must be True or False, got {is_main_process!r}")


def checked_state_dict(state_dict: dict, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict=`` to save in place of the model's own: the same keys and shapes as ``model.state_dict()``
    (our layout, the real vocabulary rows), which it is converted from, as the model's own would be."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict of tensors as model.state_dict() gives, got {type(state_dict).__name__}")
    missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    wrong = [f"{k}: expected {tuple(own[k].shape)}, got {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
             for k, v in state_dict.items()
             if k in own and not (isinstance(v, torch.Tensor) and v.shape == own[k].shape)]
    if missing or unexpected or wrong:
        lines = ["state_dict does not fit the model (give what model.state_dict() gives: its keys and shapes):"]
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shapes", wrong)):
            if keys:
                lines.append(f"  {label} ({len(keys)}): {', '.join(keys[:10])}" + (" ..." if len(keys) > 10 else ""))
        raise ValueError("\n".join(lines))
    return {k: state_dict[k] for k in own}

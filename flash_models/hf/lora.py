"""LoRA adapters between HF's models and ours. PEFT adapters trained on transformers' models (``q_proj``,
``k_proj``, ``v_proj``, ``gate_proj``, ``c_attn``, ...) load onto flash-models' models, whose projections are
fused (``qkv``, ``gate_up``), merged into the weights or as a ``peft.PeftModel``; and adapters trained with PEFT
on ours save in HF's layout, for ``peft.PeftModel.from_pretrained(hf_model, folder)``. The mapping follows each
family's checkpoint rules and is exact (``flash_models.checkpoint.lora_layout``).

    model = fm.from_pretrained("meta-llama/Llama-3.2-1B")
    model = load_hf_adapter(model, "someone/llama-3.2-1b-lora", merge=True)        # plain model, adapter merged
    peft_model = load_hf_adapter(fm.from_pretrained(...), folder, is_trainable=True)  # PeftModel over qkv, down, ...
    save_hf_adapter(peft_model, "out/adapter")  # PeftModel.from_pretrained(AutoModelForCausalLM..., "out/adapter")
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint.adapter_config import check_lora_config, pattern_value, patterns_for, target_names
from ..checkpoint.adapter_files import (
    PEFT_PREFIX, adapter_contents, lora_state, read_adapter, resolve_adapter_dir, write_adapter,
)
from ..checkpoint.lora_layout import (
    LinearTarget, LoraWeights, check_part, copy_weights, fuse, hf_index, hf_weights_as_ours, linear_targets,
    merge_into, split,
)
from ..checkpoint.remap import ours_to_hf
from ..models.hf_protocol import HFModelProtocol
from ..registry import rules_for

if TYPE_CHECKING:
    import peft

__all__ = ["load_hf_adapter", "save_hf_adapter"]

_MERGE_ON_HF = ("merge it into HF's model instead (PeftModel.merge_and_unload(), then save_pretrained) and load that "
                "folder with flash_models.from_pretrained")
_MERGE_ON_OURS = ("merge it into the model instead (merge_and_unload(), then save_pretrained), which transformers "
                  "loads as a plain model")
_PEFT_ALPHA_DEFAULT = 8  # LoraConfig's lora_alpha when a config file leaves it out


def load_hf_adapter(model: nn.Module, adapter: str | Path, *, merge: bool = False, adapter_name: str = "default",
                    is_trainable: bool = False, revision: str | None = None, subfolder: str = "", **download):
    """Load a PEFT LoRA adapter trained on HF's model (a local folder or a Hub repo id holding
    ``adapter_config.json`` and ``adapter_model.safetensors``) onto ``model``, our model of the same checkpoint.

    ``merge=True`` adds the adapter to the weights and returns ``model`` itself: the fused kernels, ``generate``
    and ``save_pretrained`` see a plain model (PEFT need not be installed for this). Otherwise the result is a ``peft.PeftModel`` over ``model`` whose
    LoRA layers sit on our fused projections (q_proj and v_proj become one LoRA on ``qkv`` of the summed rank,
    block-structured, with per-layer ``rank_pattern``/``alpha_pattern`` so the result is exact), with PEFT's whole
    API (``merge_and_unload``, ``disable_adapter``, ``save_pretrained`` in our layout, ``save_hf_adapter`` in
    HF's). As in ``PeftModel.from_pretrained``, its adapter is frozen unless ``is_trainable=True``; a
    ``PeftModel`` given as ``model`` gets the adapter added as ``adapter_name``. Training further, LoRA dropout
    draws one mask per fused layer where HF draws one per projection.

    ``revision``, ``subfolder`` and ``cache_dir``/``local_files_only``/``token``/``force_download`` locate a Hub
    adapter. ``modules_to_save`` copies (the classifier of a ``SEQ_CLS`` adapter) carry over by the family's rules.
    Adapters the mapping cannot carry exactly (DoRA, trained biases, other PEFT methods, LoRA on embeddings or
    on an LM head tied to the embeddings) and adapters of another architecture or size are refused with a
    ValueError saying why and what to do instead.
    """
    folder = resolve_adapter_dir(adapter, revision=revision, subfolder=subfolder, **download)
    source = str(folder)
    fields, tensors = read_adapter(folder)
    check_lora_config(fields, source=source, fix=_MERGE_ON_HF)
    rslora = bool(fields.get("use_rslora"))
    base = model.get_base_model() if _is_peft_model(model) else model
    if not isinstance(base, HFModelProtocol):
        raise ValueError(f"load_hf_adapter loads onto a flash-models model (flash_models.from_pretrained), got "
                         f"{type(base).__name__}: for transformers' own model use peft.PeftModel.from_pretrained")
    if merge and base is not model:
        raise ValueError("merge=True adds the adapter to the weights of a plain model, not of a PeftModel: pass "
                         "model.merge_and_unload() (or the model before PEFT wrapped it)")
    if base is not model and adapter_name in model.peft_config:
        raise ValueError(f"the PeftModel already has an adapter named {adapter_name!r}: pass another adapter_name")
    contents = adapter_contents(tensors, modules_to_save=fields.get("modules_to_save"), source=source)
    targets = linear_targets(base)
    loras = _fused_from_hf(base, targets, fields, contents.loras, source=source)
    base_weights = hf_weights_as_ours(base, contents.base_weights, source=source, what="base weights of adapted layers")
    saved = hf_weights_as_ours(base, contents.saved_modules, source=source, what="modules_to_save copies")
    copy_weights(base, base_weights)  # PEFT loads them over the base model's
    if merge:
        merge_into(model, loras, rslora=rslora)
        copy_weights(model, saved)  # a trained copy replaces its module
        return model
    import peft

    modules_to_save = sorted({key.rsplit(".", 1)[0] for key in saved}) or None
    config = _lora_config_for_ours(set(targets), fields, loras, rslora=rslora, modules_to_save=modules_to_save,
                                   inference_mode=not is_trainable)
    if base is model:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name)
    else:
        peft_model = model
        peft_model.add_adapter(adapter_name, config)
    state = {**lora_state(loras), **{PEFT_PREFIX + key: tensor for key, tensor in saved.items()}}
    loaded = peft.set_peft_model_state_dict(peft_model, state, adapter_name=adapter_name)
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    return peft_model


def save_hf_adapter(peft_model: peft.PeftModel, save_directory: str | Path, *, adapter_name: str = "default",
                    base_model_name_or_path: str | None = None) -> None:
    """Save the LoRA adapter ``adapter_name`` of ``peft_model`` (PEFT over our model, on our module names:
    ``qkv``, ``gate_up``, ...) in HF's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` for
    ``peft.PeftModel.from_pretrained(hf_model, save_directory)`` on transformers' model of the same checkpoint.

    Each HF projection of a fused layer gets the layer's A and its own rows of B, at the layer's rank and alpha,
    so the HF model computes exactly what ours does. The config names HF's modules and keeps the adapter's other
    settings; ``base_model_name_or_path`` (default: the adapter's own) names the base checkpoint. The folder is
    written atomically: a reader sees the old adapter or the new one, whole, and its other files stay."""
    import peft

    if not isinstance(peft_model, peft.PeftModel):
        raise ValueError(f"save_hf_adapter takes a peft.PeftModel over a flash-models model (e.g. peft.get_peft_model("
                         f"model, LoraConfig(target_modules=['qkv', 'down']))), got {type(peft_model).__name__}")
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"the PeftModel has no adapter {adapter_name!r}; it has {sorted(peft_model.peft_config)}")
    model = peft_model.get_base_model()
    if not isinstance(model, HFModelProtocol):
        raise ValueError(f"save_hf_adapter saves adapters of flash-models models; this PeftModel wraps "
                         f"{type(model).__name__}, whose adapter peft_model.save_pretrained already writes in its layout")
    fields = peft_model.peft_config[adapter_name].to_dict()
    source = f"adapter {adapter_name!r}"
    check_lora_config(fields, source=source, fix=_MERGE_ON_OURS)
    targets = linear_targets(model)
    contents = adapter_contents(peft.get_peft_model_state_dict(peft_model, adapter_name=adapter_name),
                                modules_to_save=fields["modules_to_save"], source=source)
    layers: dict[str, LoraWeights] = {}
    conv1d = False
    for name, (A, B) in sorted(contents.loras.items()):
        if name not in targets:
            raise ValueError(f"{source} adapts {name}, which has no HF counterpart that a LoRA maps to: "
                             f"{_MERGE_ON_OURS}")
        alpha = pattern_value(fields["alpha_pattern"], name, fields["lora_alpha"])
        layers.update(split(targets[name], LoraWeights(A, B, alpha)))
        conv1d |= targets[name].hf_conv1d
    if not layers:
        raise ValueError(f"{source} adapts no layer")
    # contents.base_weights (PEFT's copy of an adapted LM head's weight) stay behind: HF's model has its own.
    saved = ours_to_hf(contents.saved_modules, rules_for(model.config))
    r, rank_pattern = patterns_for({name: lora.rank for name, lora in layers.items()})
    alpha, alpha_pattern = patterns_for({name: lora.alpha for name, lora in layers.items()})
    every = {hf for target in targets.values() for hf in target.hf}
    # Our module names in the selection settings mean nothing to HF's model: the HF names are explicit.
    fields.update(target_modules=target_names(set(layers), every), exclude_modules=None, layers_to_transform=None,
                  layers_pattern=None, r=r, lora_alpha=alpha, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                  fan_in_fan_out=conv1d, inference_mode=True,
                  modules_to_save=sorted({key.rsplit(".", 1)[0] for key in saved}) or None,
                  base_model_name_or_path=base_model_name_or_path or fields["base_model_name_or_path"])
    write_adapter(save_directory, {k: sorted(v) if isinstance(v, set) else v for k, v in fields.items()},
                  {**lora_state(layers), **{PEFT_PREFIX + key: tensor for key, tensor in saved.items()}})


def _is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel``, without importing PEFT (merging needs none): a PeftModel exists
    only once PEFT is imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _fused_from_hf(model: nn.Module, targets: dict[str, LinearTarget], fields: dict,
                   pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], *, source: str) -> dict[str, LoraWeights]:
    """Our layers' LoRAs (module name -> weights) from an HF adapter's (HF module name -> (lora_A, lora_B)),
    checked against the model's layers (``targets``)."""
    rules = rules_for(model.config)
    index = hf_index(targets)
    parts: dict[str, dict[int, LoraWeights]] = {}
    unknown = []
    for name, (A, B) in sorted(pairs.items()):
        found = index.get(rules.normalize_hf_key(f"{name}.weight").removesuffix(".weight"))
        if found is None:
            unknown.append(name)
            continue
        target, part = found
        alpha = pattern_value(fields.get("alpha_pattern") or {}, name, fields.get("lora_alpha", _PEFT_ALPHA_DEFAULT))
        lora = LoraWeights(A, B, alpha)
        check_part(target, part, lora, where=source)
        parts.setdefault(target.ours, {})[part] = lora
    if unknown:
        raise ValueError(
            f"{source} adapts {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}, which this "
            f"{model.config.model_type} model has no linear layer for: the adapter belongs to another architecture or "
            f"depth (base_model_name_or_path: {fields.get('base_model_name_or_path')}), or adapts a layer flash-models "
            "does not keep apart (an LM head tied to the embeddings)")
    if not parts:
        raise ValueError(f"{source} holds no LoRA weights")
    rslora = bool(fields.get("use_rslora"))
    return {name: fuse(targets[name], group, rslora=rslora) for name, group in parts.items()}


def _lora_config_for_ours(linears: set[str], fields: dict, loras: dict[str, LoraWeights], *, rslora: bool,
                          modules_to_save: list[str] | None, inference_mode: bool):
    """PEFT's LoraConfig that builds exactly ``loras`` on our module names (among the model's ``linears``)."""
    import peft

    r, rank_pattern = patterns_for({name: lora.rank for name, lora in loras.items()})
    alpha, alpha_pattern = patterns_for({name: lora.alpha for name, lora in loras.items()})
    return peft.LoraConfig(
        task_type=fields.get("task_type"), target_modules=target_names(set(loras), linears), r=r, lora_alpha=alpha,
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, use_rslora=rslora,
        lora_dropout=fields.get("lora_dropout", 0.0), modules_to_save=modules_to_save, inference_mode=inference_mode,
        revision=fields.get("revision"),
    )

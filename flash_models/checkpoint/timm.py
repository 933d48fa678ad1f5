"""``from_timm``: our VisionTransformer with the weights of a timm ``VisionTransformer``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..models.vit import ViTConfig, VisionTransformer, timm_vit_rules
from .placement import resolve_device, resolve_dtype
from .remap import hf_to_ours


def vit_config_from_timm(model: nn.Module) -> ViTConfig:
    """Read a timm ``VisionTransformer`` (its modules are the source of truth for its options)."""
    block = model.blocks[0]
    checks = {
        "LayerScale (init_values)": not isinstance(block.ls1, nn.Identity),
        "qk_norm": not isinstance(block.attn.q_norm, nn.Identity),
        "stochastic depth (drop_path_rate)": any(not isinstance(b.drop_path1, nn.Identity) for b in model.blocks),
        "attention pooling (global_pool='map')": model.attn_pool is not None,
        "dynamic_img_size": model.dynamic_img_size,
        "a norm in the patch embedding": not isinstance(model.patch_embed.norm, nn.Identity),
        "a norm layer other than LayerNorm": not isinstance(block.norm1, nn.LayerNorm),
        "an activation other than exact GELU": not (isinstance(block.mlp.act, nn.GELU) and block.mlp.act.approximate == "none"),
        "an MLP other than fc1 -> act -> fc2": not isinstance(block.mlp.norm, nn.Identity),
        "no position embedding": model.pos_embed is None,
        "non-square images or patches": len(set(model.patch_embed.img_size)) > 1 or len(set(model.patch_embed.patch_size)) > 1,
        "pool_include_prefix": getattr(model, "pool_include_prefix", False),  # attribute only in newer timm
    }
    unsupported = [name for name, found in checks.items() if found]
    if unsupported:
        raise ValueError(f"timm VisionTransformer with {', '.join(unsupported)} is not supported")
    final = model.norm if not isinstance(model.norm, nn.Identity) else model.fc_norm
    return ViTConfig(
        image_size=model.patch_embed.img_size[0], patch_size=model.patch_embed.patch_size[0],
        num_channels=model.patch_embed.proj.in_channels, hidden_size=model.embed_dim,
        num_hidden_layers=len(model.blocks), num_attention_heads=block.attn.num_heads,
        intermediate_size=block.mlp.fc1.out_features, layer_norm_eps=block.norm1.eps,
        qkv_bias=block.attn.qkv.bias is not None, patch_bias=model.patch_embed.proj.bias is not None,
        class_token=model.cls_token is not None, reg_tokens=model.num_reg_tokens, no_embed_class=model.no_embed_class,
        pre_norm=not isinstance(model.norm_pre, nn.Identity), final_norm=not isinstance(final, nn.Identity),
        fc_norm=not isinstance(model.fc_norm, nn.Identity), global_pool=model.global_pool,
        num_classes=model.num_classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=block.attn.attn_drop.p,
    )


def from_timm(name_or_model, *, pretrained: bool = False, dtype=None, device=None, attn_impl: str = "auto",
              kernel_backend: str = "auto", **timm_kwargs) -> VisionTransformer:
    """A timm model name (built with ``timm.create_model(name, pretrained=pretrained, **timm_kwargs)``; with
    ``pretrained=True`` timm downloads the weights) or a timm VisionTransformer instance -> ours, in eval mode."""
    if isinstance(name_or_model, str):
        import timm
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            source = timm.create_model(name_or_model, pretrained=pretrained, **timm_kwargs)
        except (LocalEntryNotFoundError, HfHubHTTPError) as err:
            raise ValueError(f"timm could not download the weights of {name_or_model!r} (not in the local HF cache, and "
                             "the Hub is unreachable or HF_HUB_OFFLINE is set); pretrained=False builds it without "
                             "them") from err
    else:
        if timm_kwargs:
            raise ValueError(f"timm keyword arguments {sorted(timm_kwargs)} apply only when a model name is given")
        source = name_or_model
    if type(source).__name__ != "VisionTransformer":
        raise ValueError(f"from_timm reads timm VisionTransformer models, got {type(source).__name__}")
    config = vit_config_from_timm(source)
    with torch.device("meta"):
        model = VisionTransformer(config, attn_impl=attn_impl, kernel_backend=kernel_backend)
    state = hf_to_ours(source.state_dict(), timm_vit_rules(config))
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()


def is_timm_dir(directory: Path) -> bool:
    """A folder in timm's Hub layout (``timm.models.save_for_hf``, ``push_to_hf_hub``): its config.json names a timm
    ``architecture`` and no transformers ``model_type``."""
    try:
        fields = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False  # the HF reader names the problem
    return isinstance(fields, dict) and "model_type" not in fields and isinstance(fields.get("architecture"), str)


def from_timm_dir(directory: Path, *, dtype=None, device=None, attn_impl: str = "auto",
                  kernel_backend: str = "auto") -> VisionTransformer:
    """``from_pretrained`` of a timm folder: timm builds the model its config.json describes (``model_args``:
    classes, pooling, sizes) with the folder's weights (``timm.create_model("local-dir:...")``), then ``from_timm``.
    ``dtype="auto"`` keeps the weights' dtype as timm loads them (float32)."""
    import timm

    source = timm.create_model(f"local-dir:{directory}", pretrained=True)
    if dtype == "auto":
        dtype = next(source.parameters()).dtype
    return from_timm(source, dtype=dtype, device=device, attn_impl=attn_impl, kernel_backend=kernel_backend)

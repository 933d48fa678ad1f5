"""model_type -> family (config class, model class), and named presets.

Dispatch is an exact lookup of the checkpoint's HF ``config.model_type``; no name sniffing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Family:
    model_type: str
    config_cls: type  # our frozen config, with from_hf / to_hf
    model_cls: Callable[..., nn.Module]  # our nn.Module class, or a function of our config picking one (BERT heads)
    hf_auto_class: str = "AutoModelForCausalLM"  # the transformers class that reads what we save (presets)


@dataclass(frozen=True)
class Preset:
    """A named model size: HF config fields for ``model_type``. ``create_model(name)`` builds it random-init."""

    name: str
    model_type: str
    hf_config: dict = field(default_factory=dict)
    description: str = ""


_FAMILIES: dict[str, Family] = {}
_PRESETS: dict[str, Preset] = {}


def register_family(family: Family) -> None:
    if family.model_type in _FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    _FAMILIES[family.model_type] = family


def register_preset(preset: Preset) -> None:
    if preset.name in _PRESETS:
        raise ValueError(f"preset {preset.name!r} is registered twice")
    _PRESETS[preset.name] = preset


def get_family(model_type: str) -> Family:
    try:
        return _FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported by flash-models; supported: {sorted(_FAMILIES)}"
        ) from None


def get_preset(name: str) -> Preset:
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(_PRESETS)}") from None


def families() -> list[str]:
    return sorted(_FAMILIES)


def list_models() -> list[str]:
    """Names of the registered presets (see ``flash_models.create_model``)."""
    return sorted(_PRESETS)

"""model_type -> family, and named presets, collected from the families' own records.

Dispatch is an exact lookup of the checkpoint's HF ``config.model_type``; no name sniffing. Each family file
in ``flash_models.models`` declares one ``Family`` (config, model, checkpoint rules, presets, test size);
this module only indexes them.
"""

from __future__ import annotations

from .models import FAMILIES, Family, Preset
from .models.checkpoint_rules import RuleSet

__all__ = ["Family", "Preset", "families", "get_family", "get_preset", "list_models", "register_family", "rules_for"]

_FAMILIES: dict[str, Family] = {}
_PRESETS: dict[str, Preset] = {}


def register_family(family: Family) -> None:
    """Add a family (and its presets): every family in flash_models.models is added at import; call this for
    one defined elsewhere."""
    if family.model_type in _FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    taken = [p.name for p in family.presets if p.name in _PRESETS]
    if taken:
        raise ValueError(f"preset(s) {taken} are registered twice")
    _FAMILIES[family.model_type] = family
    _PRESETS.update((p.name, p) for p in family.presets)


for _family in FAMILIES:
    register_family(_family)


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


def rules_for(config) -> RuleSet:
    """The checkpoint rules of our config's family (HF layout <-> ours)."""
    return get_family(config.model_type).rules(config)


def families() -> list[str]:
    return sorted(_FAMILIES)


def list_models() -> list[str]:
    """Names of the registered presets (see ``flash_models.create_model``)."""
    return sorted(_PRESETS)

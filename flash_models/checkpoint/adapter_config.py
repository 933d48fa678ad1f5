"""PEFT's LoRA adapter_config.json, for carrying an adapter between HF's module names and ours: which settings
carry over, how PEFT picks a layer's rank and alpha (``rank_pattern``/``alpha_pattern``), and how to write both
back compactly for a new set of module names."""

from __future__ import annotations

import collections
import re

# Settings that do not change what a LoRA adapter computes on a given base model, or that only say which layers
# it adapts or saves whole (the saved tensors say that too, and they are what is carried over): any value carries
# over.
_NEUTRAL = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out", "use_rslora",
    "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "runtime_config", "ensure_weight_tying", "megatron_core",
    "qalora_group_size", "modules_to_save",
})
_WHY = {
    "use_dora": "DoRA (use_dora=True) rescales each output row of the whole weight by a learned magnitude, which "
                "does not split or fuse with the projections (q_proj/k_proj/v_proj are one qkv layer in flash-models)",
    "bias": "bias={value!r} trains the base layers' own biases, which the adapter carries as whole tensors",
    "lora_bias": "lora_bias=True gives lora_B a bias",
}


_ONLY_LORA = "Only plain LoRA on linear layers maps between HF's module layout and flash-models' fused one"


def check_lora_config(fields: dict, *, source: str, fix: str) -> None:
    """Refuse, naming the setting and ``fix``, an adapter the mapping would not carry over exactly: another PEFT
    method, or a LoRA setting beyond plain low-rank deltas on linear layers."""
    kind = fields.get("peft_type")
    if kind != "LORA":
        what = f"is a PEFT {kind} adapter (peft_type), not LoRA" if kind else "names no peft_type"
        raise ValueError(f"{source} {what}. {_ONLY_LORA}: {fix}")
    for name, value in fields.items():
        if name in _NEUTRAL or value in (None, False, {}, [], "none"):
            continue
        why = _WHY[name].format(value=value) if name in _WHY else f"{name}={value!r} is a PEFT feature"
        raise ValueError(f"{source}: {why}. {_ONLY_LORA}: {fix}")


def pattern_value(patterns: dict, name: str, default):
    """PEFT's lookup of a layer's rank or alpha: the first key of ``rank_pattern``/``alpha_pattern`` that matches
    the end of the module name (a regex, after a dot), else the config's ``r``/``lora_alpha``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def patterns_for(values: dict[str, object]) -> tuple[object, dict[str, object]]:
    """A default and a pattern dict that give every module of ``values`` (module name -> rank or alpha) its value
    under ``pattern_value``: the most common value is the default; a module name's last part (``qkv``) is the
    pattern key where every module of that name shares the value, the escaped full name otherwise."""
    default = collections.Counter(values.values()).most_common(1)[0][0]
    by_short = collections.defaultdict(dict)
    for name, value in values.items():
        by_short[name.rsplit(".", 1)[-1]][name] = value
    patterns = {}
    for short, group in sorted(by_short.items()):
        if set(group.values()) == {default}:
            continue
        if len(set(group.values())) == 1:
            patterns[re.escape(short)] = next(iter(group.values()))
        else:
            patterns.update((re.escape(name), value) for name, value in sorted(group.items()) if value != default)
    return default, patterns


def target_names(chosen: set[str], every: set[str]) -> list[str]:
    """``target_modules`` for PEFT that select exactly the modules ``chosen`` among ``every``: their last name
    parts (``["qkv", "down"]``) where those select no other module, else the full names."""
    short = {name.rsplit(".", 1)[-1] for name in chosen}
    if {name for name in every if name.rsplit(".", 1)[-1] in short} == chosen:
        return sorted(short)
    return sorted(chosen)

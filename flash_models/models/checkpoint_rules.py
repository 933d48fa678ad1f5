"""A family's checkpoint layout as data: rules mapping our state-dict keys to HF's (or timm's), and small named
tensor transforms, each with its inverse. Family files build their ``RuleSet`` from these pieces and the
shared helpers at the end; ``flash_models.checkpoint.remap`` applies them.

A ``Rule`` maps one of our keys to one or more HF keys, e.g. our fused ``blocks.{layer}.attn.qkv.weight`` to
HF's ``model.layers.{layer}.self_attn.{q,k,v}_proj.weight``. Templates are matched with ``re.fullmatch`` after
escaping, with ``{layer}`` (or any ``{name}``) standing for a number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Transform:
    name: str
    to_ours: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]
    # What the map does to a weight read as nn.Linear's (out_features, in_features), the orientation LoRA's
    # matrices are kept in (PEFT stores A (r, in) and B (out, r) for HF's Conv1D too): "rows" when it only moves
    # or groups output rows, so it maps LoRA's B and every part shares the inputs (A); "transposed" when it only
    # turns HF's (in, out) storage into ours, so LoRA's matrices map unchanged; "" when it mixes inputs, which no
    # LoRA mapping survives (``flash_models.checkpoint.lora_layout``).
    linear_view: str = ""

    def on_linear_rows(self) -> Transform | None:
        """The map on the parts' LoRA B matrices (their output rows), or None when a LoRA cannot be carried over."""
        return {"rows": self, "transposed": IDENTITY}.get(self.linear_view)


IDENTITY = Transform("identity", lambda parts: parts[0], lambda t: [t], linear_view="rows")
# HF's GPT-2 stores linear weights as Conv1D (in_features, out_features).
TRANSPOSE = Transform("conv1d_transpose", lambda parts: parts[0].t().contiguous(), lambda t: [t.t().contiguous()],
                      linear_view="transposed")


def concat(sizes: tuple[int, ...], *, dim: int = 0, name: str = "concat") -> Transform:
    """Fuse parts along ``dim`` (q/k/v into qkv, gate/up into gate_up); the inverse splits by ``sizes``."""
    return Transform(
        f"{name}{sizes}",
        lambda parts: torch.cat(parts, dim=dim),
        lambda t: [p.contiguous() for p in torch.split(t, list(sizes), dim=dim)],
        linear_view="rows" if dim == 0 else "",
    )


def then(first: Transform, second: Transform) -> Transform:
    """Apply ``first`` to the parts, then ``second`` to the single result (and the reverse on the way back).
    It moves only rows when both do; a transpose composed with another map is not worked out for LoRA."""
    return Transform(
        f"{first.name}+{second.name}",
        lambda parts: second.to_ours([first.to_ours(parts)]),
        lambda t: first.to_hf(second.to_hf(t)[0]),
        linear_view="rows" if first.linear_view == second.linear_view == "rows" else "",
    )


@dataclass(frozen=True)
class Rule:
    ours: str
    hf: tuple[str, ...]
    transform: Transform = IDENTITY

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))


@dataclass(frozen=True)
class RuleSet:
    """A family's rules for one config. ``base_prefix`` (e.g. "transformer.") is added to keys of checkpoints
    saved from the bare base model (the original GPT-2 files have no prefix); keys under ``head_prefixes``
    keep theirs."""

    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()  # regexes of HF keys that carry nothing we need (buffers, tied copies)
    # Regexes of HF keys a checkpoint may lack: the model's own init gives them then, with a warning, as
    # transformers does (BERT's pooler, which transformers' BertModel(add_pooling_layer=False) does not save).
    fresh: tuple[str, ...] = ()
    base_prefix: str = ""
    head_prefixes: tuple[str, ...] = ()
    # (regex, replacement) renames, applied in order with re.sub, for key names of older transformers versions
    legacy_keys: tuple[tuple[str, str], ...] = ()

    def normalize_hf_key(self, key: str) -> str:
        for pattern, replacement in self.legacy_keys:
            key = re.sub(pattern, replacement, key)
        if self.base_prefix and not key.startswith(self.base_prefix) and not key.startswith(self.head_prefixes):
            return self.base_prefix + key
        return key

    def is_ignored(self, key: str) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in self.ignore)

    def is_fresh(self, key: str) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in self.fresh)


# ------------------------------------------------------------------------------------------------------------
# Shared helpers. The dict form ``{our sub-key: (HF sub-keys, transform)}`` describes one block's tensors.

def layer_rules(prefix: str, layer: str, *parts: dict) -> list[Rule]:
    """Rules for every block: our ``blocks.{layer}.<sub-key>`` <-> HF's ``<prefix><layer>.{layer}.<sub-keys>``."""
    rules = []
    for ours, (hf_parts, transform) in {k: v for part in parts for k, v in part.items()}.items():
        rules.append(Rule(f"blocks.{{layer}}.{ours}", tuple(f"{prefix}{layer}.{{layer}}.{p}" for p in hf_parts), transform))
    return rules


def linears(pairs: dict[str, str], *, bias: bool, transform: Transform = IDENTITY) -> dict:
    """Block sub-keys of linears, ours -> HF's name: weight (through ``transform``) and, with ``bias``, bias."""
    out = {}
    for ours, hf in pairs.items():
        out[f"{ours}.weight"] = ((f"{hf}.weight",), transform)
        if bias:
            out[f"{ours}.bias"] = ((f"{hf}.bias",), IDENTITY)
    return out


def norms(pairs: dict[str, str], *, bias: bool = True) -> dict:
    """Block sub-keys of norms, ours -> HF's name: weight and, with ``bias``, bias."""
    return {f"{ours}.{w}": ((f"{hf}.{w}",), IDENTITY) for ours, hf in pairs.items() for w in (("weight", "bias") if bias else ("weight",))}


def lm_head(config, rules: list[Rule], ignore: list[str], *, bias: bool = False) -> None:
    """A tied head is HF's copy of the embeddings (ignored on load, not saved); an untied one is a rule."""
    if config.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    else:
        rules.append(Rule("lm_head.weight", "lm_head.weight"))
        if bias:
            rules.append(Rule("lm_head.bias", "lm_head.bias"))


def pairs(ours: str, hf: str, *, bias: bool = True) -> list[Rule]:
    """weight (and bias) of one linear or norm, with full key prefixes."""
    return [Rule(f"{ours}.{w}", f"{hf}.{w}") for w in (("weight", "bias") if bias else ("weight",))]


def fused_qkv(ours: str, hf: tuple[str, str, str], hidden: int, *, bias: bool = True) -> list[Rule]:
    """Our fused qkv linear from HF's three equal-width q, k, v linears (full key prefixes)."""
    rules = [Rule(f"{ours}.weight", tuple(f"{p}.weight" for p in hf), concat((hidden,) * 3))]
    if bias:
        rules.append(Rule(f"{ours}.bias", tuple(f"{p}.bias" for p in hf), concat((hidden,) * 3)))
    return rules

"""LoRA adapters between HF's module layout and ours, derived from the family's checkpoint rules.

A LoRA layer adds ``scaling * B @ A`` to a linear weight (PEFT's convention: A is (rank, in_features), B is
(out_features, rank), ``scaling = alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA). Where a rule fuses HF
linears along their output rows (q/k/v into our ``qkv``), the fused layer's delta is the parts' deltas stacked
the way the rule stacks the weights; as one LoRA that is A = the parts' A stacked (rank = the sum of theirs) and
B = the parts' B placed block-diagonally, each block scaled by its part's scaling over the fused one (zero blocks
for parts the adapter left alone, e.g. k_proj of a q_proj/v_proj adapter). The other way, every HF part gets
the fused A and its own rows of B, at the fused rank and scaling. Both are exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..models.checkpoint_rules import Transform
from ..registry import rules_for
from .remap import CheckpointKeyError, hf_to_ours, template_regex


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA layer as PEFT holds it: the delta is ``scaling(alpha, rank) * B @ A``."""

    A: torch.Tensor  # (rank, in_features)
    B: torch.Tensor  # (out_features, rank)
    alpha: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def lora_scaling(alpha: float, rank: int, *, rslora: bool) -> float:
    """PEFT's scaling of a LoRA layer."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


@dataclass(frozen=True)
class LinearTarget:
    """One of our linear layers and the HF linears it is made of, as the family's rule fuses them."""

    ours: str  # our module name, e.g. "blocks.0.attn.qkv"
    hf: tuple[str, ...]  # HF's module names of the parts, in the rule's order (q_proj, k_proj, v_proj)
    rows: Transform  # the rule's map on the parts' (out, in) matrices: our B from the parts' B
    part_rows: tuple[int, ...]  # each part's out_features
    in_features: int
    out_features: int  # ours: more than sum(part_rows) where the vocabulary is padded (the LM head)
    hf_conv1d: bool  # HF stores the parts as Conv1D (in, out): PEFT adapts them with fan_in_fan_out=True


def linear_targets(model: nn.Module) -> dict[str, LinearTarget]:
    """Every linear layer of ``model`` (ours, bare or with PEFT's layers in it) that a rule maps to HF linears
    by their output rows only, by our module name."""
    rules = rules_for(model.config)
    targets = {}
    for key, shape in weight_shapes(model).items():
        name = key.removesuffix(".weight")
        if not key.endswith(".weight") or len(shape) != 2 or isinstance(model.get_submodule(name), nn.Embedding):
            continue
        for rule in rules.rules:
            found = template_regex(rule.ours).fullmatch(key)
            if found is None:
                continue
            rows = rule.transform.on_linear_rows()
            if rows is not None and all(t.endswith(".weight") for t in rule.hf):
                parts = rows.to_hf(torch.empty(shape, device="meta"))
                targets[name] = LinearTarget(
                    ours=name, hf=tuple(t.format(**found.groupdict()).removesuffix(".weight") for t in rule.hf),
                    rows=rows, part_rows=tuple(p.shape[0] for p in parts), in_features=shape[1],
                    out_features=model.get_submodule(name).weight.shape[0],
                    hf_conv1d=rule.transform.linear_view == "transposed")
            break
    return targets


def weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Our parameters' shapes as the state dict shows them (the real vocabulary rows, without the padding), also
    with PEFT's layers in the model: a LoRA layer keeps the original layer as ``base_layer`` next to its
    ``lora_*`` tensors, a ``modules_to_save`` wrapper keeps it as ``original_module`` next to the trained copies."""
    shapes = {}
    for key, tensor in model.state_dict().items():
        if ".lora_" not in key and ".modules_to_save." not in key:
            shapes[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = tensor.shape
    return shapes


def hf_index(targets: dict[str, LinearTarget]) -> dict[str, tuple[LinearTarget, int]]:
    """HF module name -> (our target, the part it is)."""
    return {hf: (target, i) for target in targets.values() for i, hf in enumerate(target.hf)}


def check_part(target: LinearTarget, part: int, lora: LoraWeights, *, where: str) -> None:
    """An HF part's LoRA must fit the model: A over our layer's inputs, B over the part's rows."""
    rows = target.part_rows[part]
    A, B = tuple(lora.A.shape), tuple(lora.B.shape)
    if len(A) != 2 or len(B) != 2 or A[1] != target.in_features or B != (rows, A[0]):
        raise ValueError(
            f"{where}: the LoRA of {target.hf[part]} has lora_A {A} and lora_B {B}, "
            f"but this model's {target.hf[part]} takes lora_A (r, {target.in_features}) and lora_B ({rows}, r): the "
            "adapter was trained on another architecture or size; load it onto the base model it was trained on "
            "(base_model_name_or_path in adapter_config.json)")


def fuse(target: LinearTarget, parts: dict[int, LoraWeights], *, rslora: bool) -> LoraWeights:
    """One LoRA for our layer from the LoRAs of some of its HF parts (part index -> weights), exactly."""
    order = sorted(parts)
    scalings = {i: lora_scaling(parts[i].alpha, parts[i].rank, rslora=rslora) for i in order}
    fused_scaling = max(scalings.values())  # equal scalings (the usual case) leave B untouched
    A = torch.cat([parts[i].A for i in order])
    offsets = dict(zip(order, itertools.accumulate((parts[i].rank for i in order), initial=0)))
    blocks = []
    for i, rows in enumerate(target.part_rows):
        block = A.new_zeros(rows, A.shape[0])
        if i in parts:
            ratio = scalings[i] / fused_scaling
            block[:, offsets[i]:offsets[i] + parts[i].rank] = parts[i].B if ratio == 1 else parts[i].B * ratio
        blocks.append(block)
    B = target.rows.to_ours(blocks)
    if B.shape[0] < target.out_features:  # the padded vocabulary's rows, whose outputs nothing reads
        B = torch.cat([B, B.new_zeros(target.out_features - B.shape[0], B.shape[1])])
    rank = A.shape[0]
    return LoraWeights(A, B, fused_scaling * (math.sqrt(rank) if rslora else rank))


def split(target: LinearTarget, lora: LoraWeights) -> dict[str, LoraWeights]:
    """The LoRA of each HF part of our layer: the shared A and the part's rows of B (same rank and alpha)."""
    if lora.B.shape != (target.out_features, lora.rank) or lora.A.shape[1] != target.in_features:
        raise ValueError(f"the LoRA of {target.ours} has lora_A {tuple(lora.A.shape)} and lora_B "
                         f"{tuple(lora.B.shape)}, which do not fit the layer ({target.out_features} x {target.in_features})")
    rows = lora.B[:sum(target.part_rows)]  # without the padded vocabulary's rows
    # Each part gets its own copy of A: safetensors refuses tensors that share memory.
    return {hf: LoraWeights(lora.A.clone(), B.contiguous(), lora.alpha)
            for hf, B in zip(target.hf, target.rows.to_hf(rows), strict=True)}


@torch.no_grad()
def merge_into(model: nn.Module, loras: dict[str, LoraWeights], *, rslora: bool) -> None:
    """Add each LoRA's delta to our layer's weight (module name -> weights), as PEFT's merge does: the delta in
    float32 (or the weight's own wider dtype), then cast to the weight's dtype."""
    for name, lora in loras.items():
        weight = model.get_submodule(name).weight
        dtype = torch.promote_types(weight.dtype, torch.float32)
        A, B = (t.to(device=weight.device, dtype=dtype) for t in (lora.A, lora.B))
        weight += (lora_scaling(lora.alpha, lora.rank, rslora=rslora) * (B @ A)).to(weight.dtype)


def hf_weights_as_ours(model: nn.Module, hf_weights: dict[str, torch.Tensor], *, source: str,
                       what: str) -> dict[str, torch.Tensor]:
    """Whole weights an adapter carries (HF keys: an adapted LM head's base weight, ``modules_to_save`` copies),
    converted to our keys and checked against the model. ``what`` names them in errors."""
    if not hf_weights:
        return {}
    rules = rules_for(model.config)
    dropped = [key for key in hf_weights if rules.is_ignored(rules.normalize_hf_key(key))]
    if dropped:
        raise ValueError(f"{source} holds {what} {', '.join(sorted(dropped))}, which this model does not keep apart "
                         "(an LM head tied to the embeddings): load it onto a model with an untied head")
    try:
        ours = hf_to_ours(hf_weights, rules)
    except CheckpointKeyError as err:
        raise ValueError(f"{source} holds {what} that flash-models keeps fused with other layers, so they do not "
                         f"convert on their own ({err}); merge the adapter into HF's model (merge_and_unload, then "
                         "save_pretrained) and load that folder with flash_models.from_pretrained") from None
    shapes = weight_shapes(model)
    for key, tensor in ours.items():
        if shapes.get(key) != tensor.shape:
            raise ValueError(f"{source} holds {what}: {key} (as our model names it) of shape {tuple(tensor.shape)}, "
                             f"but the model's is {tuple(shapes[key]) if key in shapes else 'absent'}: resize the "
                             "model's vocabulary as the adapter's was (model.resize_token_embeddings(n)) first")
    return ours


@torch.no_grad()
def copy_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy weights (our keys, shapes as the state dict shows them) into the model's parameters."""
    for key, tensor in weights.items():
        module, name = key.rsplit(".", 1)
        # Through the module (a PEFT layer keeps the original as base_layer), into the real vocabulary's rows.
        getattr(model.get_submodule(module), name)[:tensor.shape[0]].copy_(tensor)

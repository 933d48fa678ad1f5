"""State-dict remapping: applies a family's rules (``flash_models.models.checkpoint_rules``: anchored
templates plus small named transforms, each with an inverse) to a state dict, in either direction.

Every checkpoint key must be claimed by a rule or an ignore pattern; anything else is an error that lists
the keys.
"""

from __future__ import annotations

import functools
import re

import torch

from ..models.checkpoint_rules import Rule, RuleSet, Tensors


class CheckpointKeyError(ValueError):
    """Checkpoint keys that do not fit the model: missing ones, unexpected ones, or both (listed)."""


_PLACEHOLDER = re.compile(r"\\\{(\w+)\\\}")


@functools.lru_cache(maxsize=None)
def template_regex(template: str) -> re.Pattern:
    return re.compile(_PLACEHOLDER.sub(lambda m: f"(?P<{m.group(1)}>\\d+)", re.escape(template)))


def _match(key: str, templates: tuple[str, ...]) -> tuple[int, dict] | None:
    for index, template in enumerate(templates):
        m = template_regex(template).fullmatch(key)
        if m:
            return index, m.groupdict()
    return None


def _listing(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:20])
    return shown + (f", ... ({len(keys) - 20} more)" if len(keys) > 20 else "")


def hf_to_ours(state_dict: dict[str, torch.Tensor], ruleset: RuleSet) -> dict[str, torch.Tensor]:
    """Convert an HF state dict to ours. Unexpected keys and incomplete fused groups raise, listed."""
    groups: dict[tuple[int, tuple], list] = {}
    unexpected = []
    for raw_key, tensor in state_dict.items():
        key = ruleset.normalize_hf_key(raw_key)
        if ruleset.is_ignored(key):
            continue
        for rule_index, rule in enumerate(ruleset.rules):
            found = _match(key, rule.hf)
            if found is not None:
                part, names = found
                slot = groups.setdefault((rule_index, tuple(sorted(names.items()))), [None] * len(rule.hf))
                slot[part] = tensor
                break
        else:
            unexpected.append(raw_key)
    missing = []
    out = {}
    for (rule_index, names), parts in groups.items():
        rule = ruleset.rules[rule_index]
        absent = [t.format(**dict(names)) for t, p in zip(rule.hf, parts) if p is None]
        if absent:
            missing.extend(absent)
            continue
        out[rule.ours.format(**dict(names))] = _convert(rule, dict(names), parts)
    if unexpected or missing:
        raise CheckpointKeyError(_key_report(missing=missing, unexpected=unexpected))
    return out


def _convert(rule: Rule, names: dict, parts: Tensors) -> torch.Tensor:
    """``rule.transform.to_ours``, with a failure (parts that do not fit together) naming the checkpoint keys."""
    try:
        return rule.transform.to_ours(parts)
    except RuntimeError as err:
        shapes = ", ".join(f"{t.format(**names)} {tuple(p.shape)}" for t, p in zip(rule.hf, parts))
        raise ValueError(f"checkpoint tensors {shapes} cannot be combined by {rule.transform.name} into "
                         f"{rule.ours.format(**names)}: {err}") from None


def check_hf_shapes(given: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], ruleset: RuleSet) -> None:
    """Compare each checkpoint tensor's shape with what the model needs (``expected``: HF keys, e.g. from
    ``ours_to_hf`` of a meta model), before any tensor is fused or concatenated, naming every misfit."""
    wrong = []
    for raw_key, tensor in given.items():
        want = expected.get(ruleset.normalize_hf_key(raw_key))
        if want is not None and tuple(want.shape) != tuple(tensor.shape):
            wrong.append(f"{raw_key}: expected {tuple(want.shape)}, got {tuple(tensor.shape)}")
    if wrong:
        raise ValueError("checkpoint tensor shapes do not fit the config:\n  " + "\n  ".join(wrong[:20])
                         + (f"\n  ... ({len(wrong) - 20} more)" if len(wrong) > 20 else "")
                         + "\n  check that config.json belongs to these weights (same family and sizes)")


def ours_to_hf(state_dict: dict[str, torch.Tensor], ruleset: RuleSet) -> dict[str, torch.Tensor]:
    """Convert our state dict to HF's canonical layout (fused parameters split back)."""
    out = {}
    for key, tensor in state_dict.items():
        for rule in ruleset.rules:
            found = _match(key, (rule.ours,))
            if found is not None:
                names = found[1]
                for template, part in zip(rule.hf, rule.transform.to_hf(tensor)):
                    out[template.format(**names)] = part
                break
        else:
            raise CheckpointKeyError(f"no rule maps our parameter {key!r} to HF (a bug in the family's rules)")
    return out


def check_keys(given: set[str], expected: set[str], ruleset: RuleSet) -> set[str]:
    """Compare a checkpoint's HF keys with what the model needs, before any tensor is converted. Returns the
    missing keys the model may initialise itself (``RuleSet.fresh``); any other missing key raises."""
    given = {ruleset.normalize_hf_key(k) for k in given if not ruleset.is_ignored(ruleset.normalize_hf_key(k))}
    missing, unexpected = expected - given, given - expected
    fresh = {k for k in missing if ruleset.is_fresh(k)}
    if missing - fresh or unexpected:
        raise CheckpointKeyError(_key_report(missing=missing, unexpected=unexpected))
    return fresh


def _key_report(*, missing, unexpected) -> str:
    lines = ["the checkpoint does not fit the model:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {_listing(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    lines.append("  check that config.json belongs to these weights (same family and sizes)")
    return "\n".join(lines)

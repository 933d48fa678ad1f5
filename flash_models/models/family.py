"""What a family declares: one ``Family`` record, in the family's own file (or package) as ``FAMILY``.

``flash_models.registry`` collects the records of every module in ``flash_models.models``; the loader, the
presets and the registry-driven tests (contract and parity) read nothing else, so a new family is its file
plus its parity test. Nothing here imports transformers: an HF class is named by a string and resolved on use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .checkpoint_rules import RuleSet


@dataclass(frozen=True)
class Preset:
    """A named model size: HF config fields for ``model_type``. ``create_model(name)`` builds it random-init."""

    name: str
    model_type: str
    hf_config: dict = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class Family:
    """One model family. ``config_class`` is our frozen config: it carries the class attributes
    ``model_type`` (HF's ``config.model_type``, the dispatch key) and ``hf_config_class`` (the name of
    transformers' config class), and converts with ``from_hf(hf_config)`` / ``to_hf()``."""

    config_class: type
    model_class: Callable[..., nn.Module]  # our model class, or a function of our config picking one (BERT's heads)
    rules: Callable[..., RuleSet]  # our config -> its checkpoint rules (HF layout <-> ours)
    # HF config fields that shrink a preset (given its fields) to a test size while keeping its options (tied
    # head, GQA ratio, ...): the contract and parity tests build every preset at this size.
    tiny: Callable[[dict], dict]
    presets: tuple[Preset, ...]
    hf_auto_class: str = "AutoModelForCausalLM"  # the transformers auto class that reads what we save

    def __post_init__(self):
        if not self.presets:
            raise ValueError(f"family {self.model_type!r} needs at least one preset (the tests build each one)")
        for preset in self.presets:
            if preset.model_type != self.model_type:
                raise ValueError(f"preset {preset.name!r} has model_type {preset.model_type!r}, its family {self.model_type!r}")

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def hf_config_class(self) -> str:
        return self.config_class.hf_config_class


def hf_class(name: str) -> type:
    """The transformers class of that name, imported on use (transformers takes most of a second to import)."""
    import transformers

    return getattr(transformers, name)


def token_ids(value) -> int | tuple[int, ...] | None:
    """HF allows one id or a list (e.g. several EOS ids); keep lists as tuples so the config stays frozen."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def hf_token_ids(value):
    return list(value) if isinstance(value, tuple) else value

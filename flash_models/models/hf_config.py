"""``model.config``: the family's frozen, typed config, seen the way transformers' trainers see a config.

``transformers.Trainer``, TRL and PEFT read and set attributes on ``model.config`` as on a
``PretrainedConfig``: the Trainer sets ``use_cache``, TRL aligns ``eos_token_id`` / ``pad_token_id`` with its
tokenizer through ``get_text_config()``, PEFT and the logging callbacks call ``to_dict()``. A frozen dataclass
refuses all of that. ``ModelConfig`` wraps it without loosening it:

- reads come from, in order: the settings written at run time, the typed config (its fields, properties and
  methods: the model's own code reads it through the wrapper), then the HF config it converts to
  (``to_hf()``), so any attribute HF's config has (``is_encoder_decoder``, ``tie_word_embeddings``,
  ``output_hidden_states`` ...) reads as HF's would;
- writes of a name the typed config does not have (``use_cache``, ``_name_or_path``, ...) are run-time settings;
- writes of a typed field are refused, except the token ids, which no weight depends on: those replace the
  typed config by a copy, validated again.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from .outputs import NOT_PREDICTIONS

# Typed fields that may change after the model is built: ids of special tokens (TRL sets them from its tokenizer).
SETTABLE_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_OWN = ("typed", "_settings", "_hf")


class ModelConfig:
    def __init__(self, typed, *, architecture: str):
        assert dataclasses.is_dataclass(typed) and not isinstance(typed, type), "wrap a family's config instance"
        object.__setattr__(self, "typed", typed)
        object.__setattr__(self, "_hf", None)
        object.__setattr__(self, "_settings", {
            "use_cache": True,  # HF's default, for the trainers that read it; the forward keeps a cache only when a call passes use_cache=True
            "_name_or_path": "",
            "architectures": [architecture],
            "keys_to_ignore_at_inference": list(NOT_PREDICTIONS),
        })

    # ----------------------------------------------------------------------------------------------------
    def __getattr__(self, name: str):  # only names not found on the wrapper itself
        if name in _OWN or name.startswith("__"):
            raise AttributeError(name)
        if name in self._settings:
            return self._settings[name]
        try:
            return getattr(self.typed, name)
        except AttributeError:
            pass
        try:
            return getattr(self.hf_config(), name)
        except AttributeError:
            raise AttributeError(f"{type(self.typed).__name__} (model_type {self.typed.model_type!r}) has no "
                                 f"attribute {name!r}, nor has its HF config") from None

    def __setattr__(self, name: str, value) -> None:
        fields = {f.name for f in dataclasses.fields(self.typed)}
        if name in SETTABLE_FIELDS and name in fields:
            value = tuple(value) if isinstance(value, list) else value  # the typed config stays hashable
            object.__setattr__(self, "typed", dataclasses.replace(self.typed, **{name: value}))
            object.__setattr__(self, "_hf", None)
        elif isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        elif name in fields or hasattr(type(self.typed), name):
            raise AttributeError(
                f"config.{name} is part of the {self.typed.model_type} architecture the model was built with and "
                f"cannot change on a built model; build a new one from dataclasses.replace(model.config.typed, "
                f"{name}=...) (only {', '.join(SETTABLE_FIELDS)} can be set)"
            )
        else:
            self._settings[name] = value

    def __delattr__(self, name: str) -> None:
        if name not in self._settings:
            raise AttributeError(f"config.{name} is not a run-time setting; only those can be deleted")
        del self._settings[name]

    def __eq__(self, other) -> bool:
        other = other.typed if isinstance(other, ModelConfig) else other
        return self.typed == other

    __hash__ = None  # mutable: its settings change while the model trains

    def __repr__(self) -> str:
        return f"ModelConfig({self.typed!r}, settings={self._settings!r})"

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        object.__setattr__(new, "_settings", copy.deepcopy(self._settings, memo))
        return new

    def __copy__(self):
        new = object.__new__(type(self))
        for name in _OWN:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "_settings", dict(self._settings))
        return new

    # ----------------------------------------------------------------------------------------------------
    @property
    def name_or_path(self) -> str:
        return self._settings["_name_or_path"]

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self._settings["_name_or_path"] = str(value)

    def hf_config(self):
        """The typed config as HF's config class (``to_hf()``, made once per typed config), with the run-time
        settings applied: what ``save_pretrained`` writes and what transformers would read."""
        if self._hf is None:
            object.__setattr__(self, "_hf", self.typed.to_hf())
        hf = copy.copy(self._hf)
        for name, value in self._settings.items():
            if name != "keys_to_ignore_at_inference":  # a class attribute in HF's configs, not saved
                setattr(hf, name, value)
        return hf

    def replace_typed(self, typed) -> None:
        """Put ``typed`` (the same family's config) in place of the typed config, keeping the run-time settings:
        only for the model's own methods that change its shapes together with its weights
        (``resize_token_embeddings``)."""
        assert type(typed) is type(self.typed), (type(typed), type(self.typed))
        object.__setattr__(self, "typed", typed)
        object.__setattr__(self, "_hf", None)

    @classmethod
    def from_pretrained(cls, name_or_path, **kwargs) -> ModelConfig:
        """The config a model loaded from ``name_or_path`` (a folder with config.json, or a Hub id) holds, as HF's
        ``PretrainedConfig.from_pretrained``: PEFT reads the base model's ``vocab_size`` this way when it saves
        an adapter (to tell whether the embeddings were resized). ``kwargs`` go to ``AutoConfig.from_pretrained``."""
        import transformers

        from ..checkpoint.loader import build_model  # a higher layer: imported on use

        return build_model(transformers.AutoConfig.from_pretrained(name_or_path, **kwargs), device="meta").config

    def get_text_config(self, *args, **kwargs) -> ModelConfig:
        """HF's accessor for a multimodal model's text part; our models are one part: the config itself."""
        return self

    def to_dict(self) -> dict:
        return self.hf_config().to_dict()

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict() if not use_diff else self.hf_config().to_diff_dict(), indent=2,
                          sort_keys=True) + "\n"

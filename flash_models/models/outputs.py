"""What every model's forward returns: dataclasses that behave like transformers' ``ModelOutput``.

``transformers.Trainer``, TRL and accelerate read outputs as HF's are read: ``out.loss``, ``out["loss"]``,
``out[0]``, ``out.to_tuple()``, ``out.items()``. Like HF's, an output is an ordered dict of its fields that are
not None, in the order the fields are declared (the loss first, as HF declares it), so ``out[0]`` is the loss
when there is one and the logits otherwise; a None field is an attribute but not a key. accelerate rebuilds
outputs as ``type(out)(dict_of_fields)`` when it casts them (``convert_outputs_to_fp32``), and
``torch.nn.DataParallel`` (the Trainer's choice on several GPUs without torchrun) as ``type(out)(pairs)`` when
it gathers them, which ``__post_init__`` accepts as HF's does. Like HF's, every output class is a pytree node:
DistributedDataParallel finds the tensors it must hook (``static_graph=True``, ``find_unused_parameters=True``)
by flattening the output, and a leaf would hide them, leaving the ranks' gradients unreduced.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree


class ModelOutput(OrderedDict):
    """Base of the output dataclasses: attribute, key and index access over the fields that are not None."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(cls, _flatten, functools.partial(_unflatten, output_type=cls),
                                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")

    def __post_init__(self):
        # The dataclass __init__ has filled the dict through __setattr__; one Mapping, or an iterable of (name,
        # value) pairs, as the first field is the ``type(out)(dict)`` / ``type(out)(pairs)`` form.
        names = [f.name for f in fields(self)]
        first = getattr(self, names[0])
        if first is None or torch.is_tensor(first) or any(getattr(self, name) is not None for name in names[1:]):
            return
        if isinstance(first, Mapping):
            values = dict(first)
        else:
            try:
                pairs = list(first)
            except TypeError:
                return
            if not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
                raise ValueError(f"{type(self).__name__}({names[0]}=...) got an iterable that is not (name, value) "
                                 f"pairs; pass the fields by name")
            values = dict(pairs)
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no fields {sorted(unknown)}; its fields are {names}")
        setattr(self, names[0], None)
        for name in names:  # declaration order, whatever the order given
            if values.get(name) is not None:
                setattr(self, name, values[name])

    def __getitem__(self, key):
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def __setattr__(self, name, value):
        if value is not None and name in self.__dataclass_fields__:
            super().__setitem__(name, value)
        elif name in self:
            super().__delitem__(name)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        if key not in self.__dataclass_fields__:
            raise KeyError(f"{type(self).__name__} has no field {key!r}")
        setattr(self, key, value)

    def __delitem__(self, key):
        raise TypeError(f"{type(self).__name__} fields cannot be deleted; set the attribute to None")

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a fixed set of fields: set them as attributes or keys")

    pop = popitem = setdefault = update = clear = _refuse

    def to_tuple(self) -> tuple:
        """The fields that are not None, in declaration order (HF's ``ModelOutput.to_tuple``)."""
        return tuple(self.values())

    def __reduce__(self):  # pickling and deepcopy: rebuild through the constructor, not the dict protocol
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


def _flatten(output: ModelOutput) -> tuple[list, list[str]]:
    return list(output.values()), list(output.keys())


def _unflatten(values, names: list[str], *, output_type: type[ModelOutput]) -> ModelOutput:
    return output_type(**dict(zip(names, values)))


@dataclass
class CausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, S, vocab); None from a training forward with return_logits=False
    last_hidden_state: torch.Tensor | None = None
    kv_cache: object | None = None  # modules.KVCache of a forward that was given one

    @property
    def cache(self):
        """HF's name for the cache (transformers 5.24 on): the KVCache this forward kept (``kv_cache=``, ``cache=``,
        ``past_key_values=`` or ``use_cache=True``)."""
        if self.kv_cache is None:
            raise AttributeError(NO_CACHE)
        return self.kv_cache

    @property
    def past_key_values(self):
        """HF's earlier name for ``cache``."""
        return self.cache


# Why a forward returned no cache, and how to keep one.
NO_CACHE = ("this forward kept no KV cache: pass use_cache=True (outside training, without labels) for one that grows, "
            "or cache = model.new_kv_cache(batch_size, max_len) and out = model(ids, past_key_values=cache); then "
            "out.past_key_values is the cache, to pass to the next call with the new tokens only. model.generate(...) "
            "does all of this")


@dataclass
class EncoderOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None  # (B, S, hidden)
    pooler_output: torch.Tensor | None = None  # (B, hidden)


@dataclass
class HeadOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # MLM (B, S, vocab); sequence (B, labels); token (B, S, labels)
    prediction_logits: torch.Tensor | None = None  # BertForPreTraining: MLM logits
    seq_relationship_logits: torch.Tensor | None = None  # BertForPreTraining: next-sentence logits (B, 2)
    start_logits: torch.Tensor | None = None  # question answering: the span's first token (B, S)
    end_logits: torch.Tensor | None = None  # question answering: the span's last token (B, S)
    last_hidden_state: torch.Tensor | None = None


@dataclass
class VisionOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, classes); None without a head
    last_hidden_state: torch.Tensor | None = None  # (B, prefix + patches, hidden), after the final norm
    pooler_output: torch.Tensor | None = None  # pooled features (HF ViTModel: its tanh pooler)


# Outputs hold tensors the Trainer gathers at evaluation; these fields are not predictions (HF's
# ``config.keys_to_ignore_at_inference``).
NOT_PREDICTIONS = ("last_hidden_state", "kv_cache", "pooler_output")

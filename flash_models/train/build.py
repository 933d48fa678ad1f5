"""From an ``ExperimentConfig`` to the objects a run needs: tokenizer, model, datasets and their collate."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from .config import ExperimentConfig
from .classification import (
    ImageFolderData, TextClassification, collate_classification, collate_images, collate_packed_classification,
)
from .data import LMWindows, PackedExamples, build_token_store, collate_lm, load_tokenizer, synthetic_store


@dataclass
class DataBundle:
    train: object
    eval: object | None
    collate: Callable
    tokenizer: object | None = None
    label_names: list[str] | None = None  # classification: class i's name (the exported config's id2label)


def build_model(cfg: ExperimentConfig) -> nn.Module:
    """A pretrained checkpoint (``model.pretrained``) or a random-init preset with ``model.overrides``."""
    from ..checkpoint import create_model, from_pretrained
    from ..embedded import resolve_alias

    m = cfg.model
    if m.task != "causal_lm":
        return _build_classifier(cfg)
    if m.pretrained:
        _refuse_overrides(m.overrides)
        model = from_pretrained(resolve_alias(m.name), attn_impl=m.attn_impl, kernel_backend=m.kernel_backend)
    else:
        check_overrides(m.name, m.overrides)
        model = create_model(m.name, attn_impl=m.attn_impl, kernel_backend=m.kernel_backend, **m.overrides)
    return model.train()


def _refuse_overrides(overrides: dict) -> None:
    if overrides:
        raise ValueError("model.overrides apply to random-init presets (and timm model names); a checkpoint keeps its "
                         f"config, so {sorted(overrides)} would be ignored")


def check_overrides(preset: str, overrides: dict) -> None:
    """transformers configs accept any keyword silently; name an override the family's HF config lacks."""
    from ..checkpoint.loader import check_override_names

    check_override_names(preset, overrides, prefix="model.overrides.")


def _build_classifier(cfg: ExperimentConfig) -> nn.Module:
    """BERT sequence classification (a BERT checkpoint or preset gets a fresh ``num_labels`` head) or ViT image
    classification (a registered ViT preset, an HF ViT folder, or a timm model name)."""
    from ..checkpoint import create_model, from_pretrained, from_timm
    from ..embedded import resolve_alias
    from ..models.vit.model import VisionTransformer
    from ..registry import get_preset, list_models

    m = cfg.model
    kw = dict(attn_impl=m.attn_impl, kernel_backend=m.kernel_backend)
    family = "bert" if m.task == "sequence_classification" else "vit"
    if m.name in list_models() and get_preset(m.name).model_type != family:  # create_model would build it as it is
        fitting = [name for name in list_models() if get_preset(name).model_type == family]
        raise ValueError(f"model.task={m.task!r} trains a {family} model, and {m.name!r} is a "
                         f"{get_preset(m.name).model_type} preset; presets that fit: {fitting}")
    if m.task == "sequence_classification":
        if not m.pretrained:
            check_overrides(m.name, m.overrides)
            return create_model(m.name, architectures=["BertForSequenceClassification"], num_labels=m.num_labels,
                                **m.overrides, **kw)
        _refuse_overrides(m.overrides)
        return _with_sequence_head(from_pretrained(resolve_alias(m.name), **kw), m.num_labels)
    if m.name in list_models():
        check_overrides(m.name, m.overrides)
        return create_model(m.name, architectures=["ViTForImageClassification"], num_labels=m.num_labels, **m.overrides, **kw)
    if Path(m.name).exists():
        _refuse_overrides(m.overrides)
        model = from_pretrained(m.name, **kw)
        if not isinstance(model, VisionTransformer):
            raise ValueError(f"model.task='image_classification' trains a ViT, and {m.name} holds a {type(model).__name__}")
        if model.head is None or model.head.out_features != m.num_labels:
            raise ValueError(f"{m.name} has {0 if model.head is None else model.head.out_features} classes, not "
                             f"model.num_labels={m.num_labels}; use a timm name or a preset to get a fresh head")
        return model
    return from_timm(m.name, pretrained=m.pretrained, num_classes=m.num_labels, **m.overrides, **kw)


def _with_sequence_head(base: nn.Module, num_labels: int) -> nn.Module:
    """A BertForSequenceClassification whose encoder (and pooler) are ``base``'s weights and whose classifier
    is freshly initialised; a checkpoint that already has the right head is kept as it is."""
    from ..models.bert import BertForSequenceClassification
    from ..models.bert.model import BertPreTrainedModel

    if not isinstance(base, BertPreTrainedModel):
        raise ValueError(f"model.task='sequence_classification' trains a BERT, and model.name is a {type(base).__name__}")
    return BertForSequenceClassification.on_encoder(base, num_labels=num_labels)


def tokenizer_name(cfg: ExperimentConfig) -> str:
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    if cfg.model.pretrained:
        return cfg.model.name
    raise ValueError("data.tokenizer is required for a random-init model (an HF folder, a .gguf file, an alias, or 'bytes')")


def check_labels(labels, num_labels: int, spec: str, *, names: list[str] | None) -> None:
    """Every class id in [0, num_labels): cross-entropy would otherwise fail on the device mid-step, or (a class
    count above the head's) never see a class named."""
    if names is not None and len(names) > num_labels:
        raise ValueError(f"{spec} has {len(names)} classes {list(names)}, more than model.num_labels={num_labels}; "
                         f"set model.num_labels={len(names)}")
    outside = sorted({label for label in labels if not 0 <= label < num_labels})
    if outside:
        raise ValueError(f"{spec} has labels {outside[:5]} outside 0..{num_labels - 1} (model.num_labels={num_labels}); "
                         "class ids count from 0: set model.num_labels above the largest, or give the labels as names")


def build_data(cfg: ExperimentConfig, *, vocab_size: int | None = None) -> DataBundle:
    d = cfg.data
    if d.format == "synthetic":
        if vocab_size is None:
            raise ValueError("data.format='synthetic' needs the model's vocab size")
        store = synthetic_store(d.synthetic_tokens, vocab_size, seed=cfg.train.seed, doc_len=max(8, d.seq_len // 2))
        return DataBundle(LMWindows(store, d.seq_len, packing=d.packing), None, collate_lm)
    if d.format == "image_folder":
        train = ImageFolderData(d.train, image_size=d.image_size, train=True)
        evaluation = ImageFolderData(d.eval, image_size=d.image_size, train=False, class_to_idx=train.class_to_idx) if d.eval else None
        check_labels(range(len(train.classes)), cfg.model.num_labels, d.train, names=train.classes)
        return DataBundle(train, evaluation, collate_images, label_names=train.classes)
    tokenizer = load_tokenizer(tokenizer_name(cfg))
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab_size}; "
                         "set model.overrides.vocab_size (or the matching n_vocab field)")
    if d.format == "classification":
        train = TextClassification(d.train, tokenizer, d)
        evaluation = TextClassification(d.eval, tokenizer, d, label_names=train.label_names) if d.eval else None
        for spec, ds in ((d.train, train), (d.eval, evaluation)):
            if ds is not None:
                check_labels(ds.labels, cfg.model.num_labels, spec, names=train.label_names)
        # Graph replays need fixed shapes and no host reads: rows are packed into buckets on the host.
        collate = (functools.partial(collate_packed_classification, seq_len=d.seq_len) if cfg.train.cuda_graphs
                   else collate_classification)
        return DataBundle(train, evaluation, collate, tokenizer, label_names=train.label_names)
    sft = d.format == "sft"

    def dataset(spec):
        store = build_token_store(spec, tokenizer, d, sft=sft)
        if sft:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            return PackedExamples(store, d.seq_len, pad_id=pad or 0)
        return LMWindows(store, d.seq_len, packing=d.packing)

    return DataBundle(dataset(d.train), dataset(d.eval) if d.eval else None, collate_lm, tokenizer)

"""From an ``ExperimentConfig`` to the objects a run needs: tokenizer, model, datasets and their collate."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .config import ExperimentConfig
from .data import (
    ImageFolderData, LMWindows, PackedExamples, TextClassification, build_token_store, collate_classification,
    collate_images, collate_lm, load_tokenizer, synthetic_store,
)

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    train: object
    eval: object | None
    collate: Callable
    tokenizer: object | None = None


def build_model(cfg: ExperimentConfig) -> nn.Module:
    """A pretrained checkpoint (``model.pretrained``) or a random-init preset with ``model.overrides``."""
    from ..checkpoint import create_model, from_pretrained
    from ..embedded import resolve_alias

    m = cfg.model
    if m.task != "causal_lm":
        return _build_classifier(cfg)
    if m.pretrained:
        if m.overrides:
            raise ValueError("model.overrides apply to random-init presets; a pretrained checkpoint keeps its config")
        model = from_pretrained(resolve_alias(m.name), attn_impl=m.attn_impl, kernel_backend=m.kernel_backend)
    else:
        model = create_model(m.name, attn_impl=m.attn_impl, kernel_backend=m.kernel_backend, **m.overrides)
    return model.train()


def _build_classifier(cfg: ExperimentConfig) -> nn.Module:
    """BERT sequence classification / ViT image classification through the registry's task heads."""
    import flash_models

    m = cfg.model
    builder = getattr(flash_models, "for_task", None)
    if builder is None:
        raise NotImplementedError(
            f"model.task={m.task!r} needs a classification head (BertForSequenceClassification / ViT) that "
            "flash_models does not provide yet"
        )
    return builder(m.name, task=m.task, num_labels=m.num_labels, pretrained=m.pretrained).train()


def tokenizer_name(cfg: ExperimentConfig) -> str:
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    if cfg.model.pretrained:
        return cfg.model.name
    raise ValueError("data.tokenizer is required for a random-init model (an HF folder, a .gguf file, an alias, or 'bytes')")


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
        return DataBundle(train, evaluation, collate_images)
    tokenizer = load_tokenizer(tokenizer_name(cfg))
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab_size}; "
                         "set model.overrides.vocab_size (or the matching n_vocab field)")
    if d.format == "classification":
        train = TextClassification(d.train, tokenizer, d)
        evaluation = TextClassification(d.eval, tokenizer, d, label_names=train.label_names) if d.eval else None
        return DataBundle(train, evaluation, collate_classification, tokenizer)
    sft = d.format == "sft"

    def dataset(spec):
        store = build_token_store(spec, tokenizer, d, sft=sft)
        if sft:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            return PackedExamples(store, d.seq_len, pad_id=pad or 0)
        return LMWindows(store, d.seq_len, packing=d.packing)

    return DataBundle(dataset(d.train), dataset(d.eval) if d.eval else None, collate_lm, tokenizer)

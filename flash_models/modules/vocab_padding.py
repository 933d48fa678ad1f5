"""Vocabulary padding kept inside the model: the token embedding and the LM head hold rows up to a multiple of
``VOCAB_MULTIPLE``, while state dicts, checkpoints, logits and losses see the real vocabulary.

Why: a real checkpoint's vocabulary is often an odd number (GPT-2's 50257, OPT's 50272). The LM head's GEMMs
then have an output width (forward) or a reduction width (the two backward GEMMs) that is not 16-byte aligned,
and cuBLAS falls back to slow unaligned kernels. Padded, GPT-2's head at 50257 runs the GEMMs of a 50304 head
(compare `flash-models bench train --cases gpt2,gpt2@50304 --sides loop:ours`). Padding the weight once, at
construction, costs a few zero rows instead of a copy per step.

Why 128: alignment alone needs 8 bf16 elements, but the GEMM kernels' tiles are 128 wide, so a multiple of
128 also fills the last tile (the weight-gradient GEMM runs over the vocabulary as its M dimension). Real
vocabularies that are already multiples of 128 (32000, 49152, 151936, 128256) get no padding at all, and
GPT-2's 50257 becomes 50304 (47 rows, 0.1% of the head).

The pad rows are zero and stay zero: no input id reaches them (ids are checked against the real vocabulary),
their logits are cut off before anything reads them, and the losses ignore their columns, so their gradients
are exactly zero, which AdamW's update and its decoupled weight decay both leave at zero.
"""

from __future__ import annotations

import torch
from torch import nn

from .scaled_embedding import ScaledEmbedding

VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` that holds ``vocab_size`` rows."""
    return -(-vocab_size // multiple) * multiple


def hide_vocab_padding(module: nn.Module, vocab_size: int) -> None:
    """Make ``module``'s own parameters (an nn.Embedding's or nn.Linear's weight and bias, padded along dim 0)
    look like ``vocab_size`` rows to ``state_dict`` and ``load_state_dict``: saving strips the pad rows, loading
    takes real-vocabulary tensors and pads them with zeros (tensors of any other shape are left for the usual
    shape check to refuse)."""
    names = tuple(name for name, _ in module.named_parameters(recurse=False))
    module.register_state_dict_post_hook(_StripVocabPadding(names, vocab_size))
    module.register_load_state_dict_pre_hook(_PadVocab(names, vocab_size))


class _StripVocabPadding:
    """The state-dict hook that keeps the real rows. A class, not a closure: a model with its hooks pickles
    (``torch.save(model)``, ``copy.deepcopy``)."""

    def __init__(self, names: tuple[str, ...], vocab_size: int):
        self.names, self.vocab_size = names, vocab_size

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for name in self.names:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state_dict[key][:self.vocab_size]  # rows of a row-major tensor: still contiguous


class _PadVocab:
    """The load hook that pads real-vocabulary tensors with zero rows (a class for the same reason)."""

    def __init__(self, names: tuple[str, ...], vocab_size: int):
        self.names, self.vocab_size = names, vocab_size

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        for name in self.names:
            key, param = prefix + name, getattr(module, name)
            value = state_dict.get(key)
            if value is None or value.shape[0] != self.vocab_size or param.shape[0] == self.vocab_size:
                continue
            if value.shape[1:] != param.shape[1:]:
                continue
            extra = value.new_zeros((param.shape[0] - self.vocab_size, *value.shape[1:]))
            state_dict[key] = torch.cat([value, extra])


@torch.no_grad()
def zero_vocab_padding(module: nn.Module, vocab_size: int) -> None:
    """Zero the pad rows (beyond ``vocab_size``) of ``module``'s own parameters, e.g. after a random init."""
    for param in module.parameters(recurse=False):
        param[vocab_size:].zero_()


def resized_vocab_size(old: int, new_num_tokens: int | None, pad_to_multiple_of: int | None) -> int:
    """The vocabulary HF's ``resize_token_embeddings(new_num_tokens, pad_to_multiple_of)`` asks for."""
    new = old if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:
        new = padded_vocab_size(new, pad_to_multiple_of)
    if isinstance(new, bool) or not isinstance(new, int) or new < 1:
        raise ValueError(f"new_num_tokens must be an int >= 1, got {new_num_tokens!r}")
    return new


def resized_table(table: nn.Module, old: int, new: int, *, multiple: int, mean_resizing: bool, std: float) -> nn.Module:
    """For HF's ``resize_token_embeddings``: a copy of ``table`` (a token nn.Embedding or an LM head's nn.Linear,
    ``old`` real rows padded to ``multiple``) with ``new`` real rows: the first min(old, new) copied, the others
    at the old rows' mean (``mean_resizing``) or N(0, std) (zero for a bias), the padding zero."""
    rows, weight = padded_vocab_size(new, multiple), table.weight
    if isinstance(table, nn.Embedding):  # the pad row keeps getting no gradient, as HF's resized table
        kwargs = dict(padding_idx=table.padding_idx, device=weight.device, dtype=weight.dtype)
        resized = (ScaledEmbedding(rows, weight.shape[1], scale=table.scale, **kwargs) if isinstance(table, ScaledEmbedding)
                   else nn.Embedding(rows, weight.shape[1], **kwargs))
    else:
        resized = nn.Linear(weight.shape[1], rows, bias=table.bias is not None, device=weight.device, dtype=weight.dtype)
    kept = min(old, new)
    with torch.no_grad():
        for name, param in resized.named_parameters():
            source = getattr(table, name)[:old]
            if mean_resizing:
                param[kept:new] = source.mean(dim=0)
            elif param.dim() > 1:
                nn.init.normal_(param[kept:new], mean=0.0, std=std)
            else:
                param[kept:new] = 0
            param[:kept] = source[:kept]
        zero_vocab_padding(resized, new)
    if rows != new:
        hide_vocab_padding(resized, new)
    return resized.train(table.training)


class RealVocabHead(nn.Module):
    """An LM head as callers outside the model see it (HF's ``get_output_embeddings``: TRL's fused loss reads its
    ``weight`` and ``bias``): views of the padded head's first ``vocab_size`` rows, so that gradients reach the
    parameters and no pad column enters a softmax."""

    def __init__(self, head: nn.Module, vocab_size: int):
        super().__init__()
        self.head, self.vocab_size = head, vocab_size

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight[: self.vocab_size]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.head.bias is None else self.head.bias[: self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight, self.bias)

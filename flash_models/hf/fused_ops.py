"""``use_fused_ops(model)``: our fused norms and cross-entropy in HF's own models, without touching HF's classes.

Two swaps, both on the one model instance passed in, through what transformers and torch offer for it:

- every norm module of the model (Llama/Mistral/Phi-3/Qwen2/Qwen3 ``*RMSNorm``, Gemma/Gemma2's zero-centred
  ``*RMSNorm``, GPT-2's ``nn.LayerNorm``) is replaced by a ``FusedNorm`` that holds the SAME parameter objects
  under the same names and runs ``flash_kernels.rms_norm`` / ``layer_norm``: state-dict keys, ``save_pretrained``,
  tied or shared parameters and an optimizer built before the swap are unchanged;
- a causal LM's loss is set through ``PreTrainedModel.loss_function``'s setter to ``flash_kernels.cross_entropy``
  on the logits HF's forward computed: no float32 copy of the logits and no saved log-softmax (HF's loss upcasts
  the logits and keeps both for the backward).

What it cannot do cleanly, and therefore does not do (``fm.from_pretrained`` gives all of it):
- the fused linear + cross-entropy: HF's forward computes ``logits = self.lm_head(hidden)`` before it calls the
  loss, so no extension point sees the hidden states; only rewriting the model's forward would avoid the logits;
- rotary: HF's attention forward calls the module-level function ``apply_rotary_pos_emb``, whose only hook is
  the ``kernels`` package's Hub layer mapping (``use_kernel_forward_from_hub``), which replaces it process-wide;
- the fused SwiGLU/GeGLU MLP: HF keeps ``gate_proj`` and ``up_proj`` as two linears, and our activation kernel
  reads one packed ``[gate; up]`` tensor, which would mean packing the weights every step or changing the keys.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import LOSS_MAPPING
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import flash_kernels

from ..backward import backward_on_this_thread_from_now

# The HF model types whose every norm class is below (and which the tests cover); others are refused rather
# than left half swapped.
SUPPORTED_MODEL_TYPES = ("gemma", "gemma2", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")
# weight * norm(x), with the epsilon in ``variance_epsilon``.
_RMS_NORMS = (LlamaRMSNorm, MistralRMSNorm, Phi3RMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)
# (1 + weight) * norm(x), with the epsilon in ``eps``.
_ZERO_CENTERED_RMS_NORMS = (GemmaRMSNorm, Gemma2RMSNorm)


class FusedNorm(nn.Module):
    """An HF norm's parameters (the same ``nn.Parameter`` objects) run through flash_kernels' fused norm.
    ``forward(x)`` computes what the HF module computed, in one kernel with its own backward."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, kind: str, eps: float,
                 zero_centered_weight: bool, backend: str):
        super().__init__()
        assert kind in ("layer_norm", "rms_norm"), kind
        self.weight, self.bias = weight, bias
        self.kind, self.eps, self.zero_centered_weight, self.backend = kind, eps, zero_centered_weight, backend

    @classmethod
    def from_hf(cls, module: nn.Module, *, backend: str) -> FusedNorm | None:
        """The fused twin of an HF norm module, or None for any other module."""
        if isinstance(module, FusedNorm):  # use_fused_ops again, with another backend
            return cls(module.weight, module.bias, kind=module.kind, eps=module.eps,
                       zero_centered_weight=module.zero_centered_weight, backend=backend)
        if isinstance(module, _RMS_NORMS):
            return cls(module.weight, None, kind="rms_norm", eps=module.variance_epsilon, zero_centered_weight=False,
                       backend=backend)
        if isinstance(module, _ZERO_CENTERED_RMS_NORMS):
            return cls(module.weight, None, kind="rms_norm", eps=module.eps, zero_centered_weight=True, backend=backend)
        if type(module) is nn.LayerNorm:
            if not module.elementwise_affine or len(module.normalized_shape) != 1:
                raise ValueError(f"use_fused_ops: a LayerNorm over {tuple(module.normalized_shape)} with "
                                 f"elementwise_affine={module.elementwise_affine}; the fused norm takes one "
                                 "affine dimension")
            return cls(module.weight, module.bias, kind="layer_norm", eps=module.eps, zero_centered_weight=False,
                       backend=backend)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backward_on_this_thread_from_now(self)  # its autograd node, as our models' forwards do
        fn = flash_kernels.rms_norm if self.kind == "rms_norm" else flash_kernels.layer_norm
        return fn(x, self.weight, self.bias, eps=self.eps, zero_centered_weight=self.zero_centered_weight,
                  backend=self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, kind={self.kind}, eps={self.eps}, backend={self.backend}"


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels: torch.Tensor | None = None, *, backend: str,
                   **kwargs) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` (the same arguments, the same number) on ``flash_kernels.cross_entropy``:
    tokens < n predict n; the mean over labelled tokens, or their sum / ``num_items_in_batch``."""
    if shift_labels is None:
        # The labels move left instead of the logits, so the logits are read in place (no shifted copy).
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = flash_kernels.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device), ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum", backend=backend,
    )
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _is_causal_lm_loss(loss_function) -> bool:
    """HF's shifted LM loss (what a causal LM's forward calls; GPT-2's resolves to it without a loss_type), or
    ours from an earlier use_fused_ops."""
    ours = isinstance(loss_function, functools.partial) and loss_function.func is causal_lm_loss
    return ours or loss_function is LOSS_MAPPING["ForCausalLM"]


def use_fused_ops(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Run ``model`` (an HF ``PreTrainedModel`` of a type in ``SUPPORTED_MODEL_TYPES``, any head) on our fused
    norms and, for a causal LM, our cross-entropy; returns the same model. ``backend`` as in
    ``flash_models.hf.register``: "auto" (our Triton kernels on CUDA, else the PyTorch reference), "triton" or
    "reference". Calling it again re-applies with the new backend. Combine with
    ``attn_implementation="fm_attention"`` for our attention. A PEFT model (``get_peft_model``) is accepted: its
    base model is swapped, and the adapters run on it as before."""
    flash_kernels._backend.check_backend_name(backend)
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper, or the model
    if not isinstance(hf_model, PreTrainedModel):
        raise ValueError(f"use_fused_ops takes a transformers PreTrainedModel, got {type(hf_model).__module__}."
                         f"{type(hf_model).__qualname__}; flash-models' own models (fm.from_pretrained) already run on "
                         "the fused ops")
    _swap(hf_model, backend)
    return model


def _swap(model: PreTrainedModel, backend: str) -> None:
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"use_fused_ops does not support model_type {model_type!r} (supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}); fm.from_pretrained loads it on the whole fused stack "
                         "where the family is one of ours, and attn_implementation='fm_attention' (register()) works "
                         "in any HF decoder")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = FusedNorm.from_hf(child, backend=backend)
            if fused is not None:
                fused.train(child.training)
                setattr(parent, name, fused)
    if _is_causal_lm_loss(model.loss_function):
        model.loss_function = functools.partial(causal_lm_loss, backend=backend)

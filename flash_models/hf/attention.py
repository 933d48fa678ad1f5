"""Our attention kernels inside HF's own models, through transformers' official extension points.

``register()`` adds ``"fm_attention"`` to ``transformers.AttentionInterface`` (the attention function) and to
``AttentionMaskInterface`` (the mask each layer receives: FlashAttention-2's, a (B, keys) padding mask or None),
so ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="fm_attention")`` or
``model.set_attn_implementation("fm_attention")`` runs ``flash_kernels.flash_attn_func`` /
``flash_attn_varlen_func``, forward and backward, in any HF model that calls its attention through the interface
(Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2/3, GPT-2, Phi3, ... all of transformers' modern decoders).

What it reads from HF's call, as HF's FlashAttention-2 integration does:
- a padded batch: the padding mask; keys (and a causal or windowed layer's queries) are unpadded to packed
  documents, the output padded back (such a layer's padding rows are zero; other layers' queries, such as
  cross-attention's, are all computed, as in eager);
- a packed row (padding-free collators): ``cu_seq_lens_q/k`` when the collator gives them, else restarts of
  ``position_ids`` in a (1, S) row without a mask;
- ``is_causal`` (the module's, or the call's), ``scaling``, ``dropout``, ``sliding_window`` (W keys: the query
  and the W - 1 before it) and ``softcap``; with a KV cache (more keys than queries) the causal diagonal is
  aligned bottom-right.
Attention sinks (``s_aux``, ``sinks``), additive biases (T5's relative ``position_bias``), sparse key selections
(``indices``, ``block_indices``), 4D masks and returned attention weights are not supported and raise, naming
the argument: an attention that ignored them would compute another function without a word.

A call that records gradients on CUDA in one process runs the calling thread's later backward calls on that
thread, as our models' forwards do (``flash_models.backward``): our attention's autograd node then pays no GIL
hand-off from autograd's worker thread.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

import flash_kernels

from ..backward import backward_on_this_thread_from_now
from ..models.hf_protocol import offsets_from_positions
from ..modules.varlen import UnpaddedBatch

# transformers reads any implementation name containing "flash" as a request for a FlashAttention kernel from
# the Hub (utils.generic.is_flash_attention_requested), so the name avoids that word.
ATTN_IMPLEMENTATION = "fm_attention"

# Arguments some HF models pass to their attention function that change what it computes (T5 and its kin: a
# relative position bias added to the scores; sparse-attention models: which keys each query reads; attention
# sinks): none of our kernels takes them, so a call that carries one is refused.
UNSUPPORTED_ARGUMENTS = {
    "position_bias": "an additive attention bias (T5-style relative positions)",
    "sinks": "attention sinks",
    "indices": "a sparse selection of keys",
    "block_indices": "a sparse selection of key blocks",
}


def register(*, backend: str = "auto") -> str:
    """Register our attention as ``attn_implementation="fm_attention"`` in transformers and return that name.
    ``backend`` is the kernel backend every call uses ("auto": our Triton kernels on CUDA for supported dtypes
    and head dims, else the PyTorch reference; "triton" or "reference" to insist). Calling again replaces the
    registered backend."""
    flash_kernels._backend.check_backend_name(backend)
    AttentionInterface.register(ATTN_IMPLEMENTATION, functools.partial(flash_models_attention, backend=backend))
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, flash_attention_mask)
    return ATTN_IMPLEMENTATION


def flash_models_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None, *, backend: str = "auto", **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) -> ((B, Sq, Hq, D), None)."""
    if s_aux is not None:
        raise ValueError("attn_implementation='fm_attention' does not support attention sinks (s_aux); use 'eager' or 'sdpa'")
    for name, what in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='fm_attention' does not support {what} ({name}=, passed by "
                             f"{type(module).__name__}); load this model with attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='fm_attention' does not return attention weights; use 'eager'")
    backward_on_this_thread_from_now(module)  # our attention's autograd node, as our models' forwards do
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='fm_attention' takes a (batch, keys) padding mask, got a mask of shape "
                         f"{tuple(attention_mask.shape)}: a 4D (custom) attention mask is not supported (use 'sdpa' "
                         "or 'eager' for it), and a model loaded before register() was called gets HF's masks")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # As autocast casts sdpa's inputs. Under it HF's rotary leaves q and k in float32 (its cos/sin follow the
        # float32 hidden states) while v comes out of its projection in the autocast dtype.
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if attention_mask is not None and attention_mask.shape[1] < k.shape[1]:
        # A static cache: its keys are all its slots, the mask covers the ones written so far (the tokens seen and
        # these queries); the rest are unwritten, and are cut off as in HF's FlashAttention integration.
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None and Sk > sliding_window else (-1, -1)
    options = dict(causal=module.is_causal if is_causal is None else is_causal, softmax_scale=scaling, window_size=window,
                   softcap=softcap or 0.0, dropout_p=dropout, backend=backend)
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask.bool(), options), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None and B == 1 and Sq == Sk and kwargs.get("position_ids") is not None:
        cu_seqlens = offsets_from_positions(kwargs["position_ids"])
    if cu_seqlens is not None:
        cu_k = kwargs.get("cu_seq_lens_k", cu_seqlens)
        max_q = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        max_k = kwargs.get("max_length_k") or int((cu_k[1:] - cu_k[:-1]).max())
        out = flash_kernels.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_seqlens_q=cu_seqlens.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32), max_seqlen_q=max_q,
            max_seqlen_k=max_k, **options,
        )
        return out.view(B, Sq, *out.shape[1:]), None
    return flash_kernels.flash_attn_func(q, k, v, **options), None


def _padded(q, k, v, mask, options) -> torch.Tensor:
    """Attention over a padded batch as packed documents: mask (B, Sk) marks real keys. Causal or windowed
    attention is self-attention (a window relates query and key positions): the queries are the last Sq positions
    of each row (with a KV cache, the new ones), padding queries left out (zero). Other attention may be
    cross-attention, whose queries are another sequence than its keys (BART, Whisper): the mask says nothing
    about them, so every query is computed, as in HF's eager and sdpa (an encoder's padding rows too)."""
    B, Sq = q.shape[:2]
    self_attention = options["causal"] or options["window_size"] != (-1, -1)
    query_mask = mask[:, -Sq:] if self_attention else torch.ones(B, Sq, dtype=torch.bool, device=mask.device)
    keys, queries = UnpaddedBatch.from_mask(mask), UnpaddedBatch.from_mask(query_mask)
    out = flash_kernels.flash_attn_varlen_func(
        queries.unpad(q)[0], keys.unpad(k)[0], keys.unpad(v)[0], cu_seqlens_q=queries.cu_seqlens,
        cu_seqlens_k=keys.cu_seqlens, max_seqlen_q=queries.max_seqlen, max_seqlen_k=keys.max_seqlen, **options,
    )  # (real queries, Hq, D)
    return queries.pad(out.unsqueeze(0))  # (B, Sq, Hq, D), zeros at the padding

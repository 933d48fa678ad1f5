"""The shared decoder-only causal LM. Family files (gpt2.py, llama.py, ...) supply a typed config and the
checkpoint rules; the residual stream lives here, readable in one place."""

from __future__ import annotations

import dataclasses
import math
import torch
from torch import nn

import flash_kernels
from flash_kernels._backend import capturing_cuda_graph

from ..config import ATTN_IMPLS, DecoderConfig, check_choice
from ..modules import (
    Attention, Embeddings, KVCache, Norm, ParallelBlock, PostNormBlock, PreNormBlock, RotaryEmbedding, SandwichBlock,
    build_attention_mask, build_mlp,
)
from ..modules.attention import build_cached_attention_mask, without_padding
from ..modules.linear import autocast_like, dense, plain_linear
from ..modules.varlen import UnpaddedBatch, positions_in_documents
from ..modules.paged_kv_cache import PagedKVCache
from ..modules.vocab_padding import (
    VOCAB_MULTIPLE, RealVocabHead, hide_vocab_padding, padded_vocab_size, resized_table, resized_vocab_size,
    zero_vocab_padding,
)
from ..runtime.cpu_decode import LeanCpuStep, lean_step_unsupported
from ..runtime.decode_chain import chained_block_step, chains, gemv_in_chain
from .hf_config import ModelConfig
from .hf_protocol import HFModelProtocol, TiedOutputEmbeddings, public_forward, cache_argument, packed_documents
from .outputs import CausalLMOutput, EncoderOutput


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """labels (B, S) as the token each position predicts: shifted left by one, -100 after each row's last."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)


def positions_from_mask(attention_mask: torch.Tensor, *, pad_position: int | None = None) -> torch.Tensor:
    """Position of each token = number of real tokens before it, so padding never shifts positions. Padding
    takes ``pad_position`` when given (HF's OPT: -1, a row its offset table holds), else its neighbours' count."""
    counted = attention_mask.long().cumsum(-1) - 1
    if pad_position is None:
        return counted.clamp(min=0)
    return counted.masked_fill(attention_mask == 0, pad_position)


class DecoderLM(HFModelProtocol, nn.Module):
    """Embeddings -> N pre-norm blocks -> final norm -> LM head, over a family's ``DecoderConfig``.

    The token embedding and the LM head hold the vocabulary padded to a multiple of ``vocab_multiple`` (128: see
    modules/vocab_padding.py) for aligned GEMMs; state dicts, checkpoints, logits, losses and generation see
    the real vocabulary only. ``vocab_multiple=1`` keeps the real shapes."""

    accepts_loss_kwargs = True
    loss_type = "ForCausalLM"  # HF's name for the shifted LM loss: the Trainer counts labels[:, 1:] for num_items_in_batch

    def __init__(self, config, *, attn_impl: str = "auto", kernel_backend: str = "auto",
                 vocab_multiple: int = VOCAB_MULTIPLE):
        super().__init__()
        check_choice("attn_impl", attn_impl, ATTN_IMPLS)
        flash_kernels._backend.check_backend_name(kernel_backend)
        self.config = ModelConfig(config, architecture=type(self).__name__)  # wraps the family's frozen config
        self._generation_config = None  # made on first use (generation_config)
        self.attn_impl, self.kernel_backend, self.vocab_multiple = attn_impl, kernel_backend, vocab_multiple
        dc: DecoderConfig = config.decoder()
        self.decoder_config = dc
        self.embed = Embeddings(
            dc.vocab_size, dc.hidden_size, max_positions=dc.max_position_embeddings if dc.learned_positions else None,
            token_dim=dc.embed_dim, position_offset=dc.position_offset, padding_idx=dc.padding_idx,
            vocab_multiple=vocab_multiple, token_scale=dc.embed_scale,
        )
        self.rotary = RotaryEmbedding(dc.rope) if dc.rope is not None else None
        self.blocks = nn.ModuleList(self._block(dc, i) for i in range(dc.num_layers))
        self.norm_f = self._norm() if dc.final_norm else None
        token_dim = dc.embed_dim or dc.hidden_size
        self.project_out = nn.Linear(dc.hidden_size, token_dim, bias=False) if token_dim != dc.hidden_size else None
        if dc.tie_word_embeddings:
            self.lm_head = TiedOutputEmbeddings(self.embed)
        else:
            self.lm_head = nn.Linear(token_dim, padded_vocab_size(dc.vocab_size, vocab_multiple), bias=dc.lm_head_bias)
            hide_vocab_padding(self.lm_head, dc.vocab_size)
        self.init_weights()

    def _norm(self) -> Norm:
        dc = self.decoder_config
        return Norm(dc.hidden_size, kind=dc.norm, eps=dc.norm_eps, bias=dc.norm_bias, kernel_backend=self.kernel_backend,
                    zero_centered=dc.norm_zero_centered)

    def _block(self, dc: DecoderConfig, i: int) -> nn.Module:
        """Block ``i`` of the kind the config names (see modules/block.py for each residual stream)."""
        attention = dataclasses.replace(dc.attention, sliding_window=None) if i in dc.full_attention_layers else dc.attention
        attn = Attention(attention, layer_idx=i, rope=dc.rope, attn_impl=self.attn_impl, kernel_backend=self.kernel_backend)
        mlp = build_mlp(dc.mlp, kernel_backend=self.kernel_backend)
        input_dropout_p = dc.embed_dropout_p if i == 0 else dc.residual_dropout_p
        if dc.block == "pre_norm":
            # LLaMA-style (gated-MLP) models are the memory-bound ones: their blocks recompute the normalized
            # inputs and the weights' autocast copies in the backward, as their MLPs recompute the activation
            # (modules/recompute.py, modules/linear.py). A few memory-bound kernels for ~3 GB at LLaMA-1.1B.
            attn.recompute_weight_casts = mlp.recompute_weight_casts = dc.mlp.gated
            return PreNormBlock(norm1=self._norm(), attn=attn, norm2=self._norm(), mlp=mlp, input_dropout_p=input_dropout_p,
                                residual_dropout_p=dc.residual_dropout_p, residual_in_fp32=dc.residual_in_fp32,
                                recompute_norm_outputs=dc.mlp.gated)
        if dc.block == "sandwich":
            attn.recompute_weight_casts = mlp.recompute_weight_casts = dc.mlp.gated
            return SandwichBlock(norm1=self._norm(), attn=attn, post_attn_norm=self._norm(), norm2=self._norm(), mlp=mlp,
                                 post_mlp_norm=self._norm(), input_dropout_p=input_dropout_p,
                                 residual_dropout_p=dc.residual_dropout_p, residual_in_fp32=dc.residual_in_fp32)
        if dc.block in ("parallel", "parallel_shared_norm"):
            norm2 = self._norm() if dc.block == "parallel" else None
            return ParallelBlock(norm1=self._norm(), attn=attn, mlp=mlp, norm2=norm2, input_dropout_p=input_dropout_p,
                                 residual_in_fp32=dc.residual_in_fp32)
        # post-norm: blocks hand over a normalized stream, so only the embeddings get input dropout
        return PostNormBlock(attn=attn, norm1=self._norm(), mlp=mlp, norm2=self._norm(),
                             input_dropout_p=dc.embed_dropout_p if i == 0 else 0.0, residual_dropout_p=dc.residual_dropout_p)

    # ----------------------------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """GPT-2/LLaMA practice: N(0, initializer_range) for linears and embeddings, zero biases, unit norms;
        with ``scale_residual_init`` (GPT-2) the projections that write into the residual stream get
        std / sqrt(2 * layers)."""
        if self.embed.tokens.weight.is_meta:  # built for loading: nothing to initialize (see modules/embedding.py)
            return
        dc = self.decoder_config
        std = dc.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, Norm):
                module.reset_parameters()
        if dc.scale_residual_init:
            for block in self.blocks:
                for proj in (block.attn.out_proj, getattr(block.mlp, "fc2", None) or block.mlp.down):
                    nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * dc.num_layers))
        for table in (self.embed.tokens, None if self.head_is_tied() else self.lm_head):
            if table is not None:
                zero_vocab_padding(table, dc.vocab_size)
        if self.embed.tokens.padding_idx is not None:
            with torch.no_grad():
                self.embed.tokens.weight[self.embed.tokens.padding_idx].zero_()

    @property
    def device(self) -> torch.device:
        return self.embed.tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.tokens.weight.dtype

    def adapted_head(self) -> bool:
        """Whether an adapter (PEFT's LoRA on ``lm_head``, or its ``modules_to_save`` copy) has taken the LM head's
        place: its own forward computes the logits then, since ``output_embeddings()`` is the base weight."""
        return not self.head_is_tied() and not plain_linear(self.lm_head)

    def head_is_tied(self) -> bool:
        """Whether the LM head is the token embedding table (``lm_head`` a ``TiedOutputEmbeddings``)."""
        return isinstance(self.lm_head, TiedOutputEmbeddings)

    def output_embeddings(self) -> torch.Tensor:
        """The LM head's weight (V_padded, hidden): rows past ``decoder_config.vocab_size`` are zero padding."""
        return self.lm_head.weight

    def new_kv_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, block_size: int | None = None,
        num_blocks: int | None = None, growable: bool = False,
    ) -> KVCache:
        """A static KV cache for ``batch_size`` rows of up to ``max_len`` tokens; with ``block_size`` a paged
        one whose blocks (``num_blocks`` in all, default enough for every row) are handed out as it grows.
        ``growable=True``: the forward enlarges it when new tokens would not fit (what ``use_cache=True`` makes)."""
        att = self.decoder_config.attention
        shape = dict(num_layers=len(self.blocks), batch_size=batch_size, max_len=max_len, num_kv_heads=att.num_kv_heads,
                     head_dim=att.head_dim, dtype=dtype or self.dtype, device=self.device)
        if block_size is None:
            return KVCache(**shape, growable=growable)
        if growable:
            raise ValueError("a paged cache (block_size) grows by its blocks: growable=True is for the static cache")
        return PagedKVCache(**shape, block_size=block_size, num_blocks=num_blocks)

    # ----------------------------------------------------------------------------------------------------
    @public_forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_logits: bool | None = None,
        mask_positions: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        logits_to_keep: int = 0,
        **hf_kwargs,
    ) -> CausalLMOutput:
        """input_ids (B, S). attention_mask (B, S), 1 = real token, 0 = padding; with a KV cache HF's (B,
        past + S) mask is accepted too, and only its last S columns count, since the cache keeps each row's
        earlier real tokens compacted. labels (B, S) are shifted inside, as in HF: the loss at position t
        predicts labels[t + 1]; -100 is ignored (a mean over no labelled token is NaN, as in torch and HF).

        Without position_ids, positions follow the family's HF forward: 0..S-1 in every row (OPT: counted from
        the mask). ``mask_positions=True`` counts real tokens instead (a row's first real token is position 0,
        so left padding shifts nothing: what generate does); False forces 0..S-1. With a KV cache positions
        always count real tokens, since the cache holds them compacted.

        Packed training: input_ids (1, total) holding documents back to back, with ``cu_seqlens`` (int32
        offsets, num_docs + 1). Documents never attend across each other and positions restart at each one.
        Give labels = -100 at each document's first token if the previous document must not predict it.

        ``return_logits``: None (the default) means logits unless the model is training and labels are given. A
        forward without logits and with labels runs the LM head and the loss fused in token chunks
        (flash_kernels.linear_cross_entropy): the (B, S, vocab) logits are never stored and ``logits`` is None.
        So ``model.train(); model(ids, labels=ids).loss`` gets the fused loss; ``return_logits=True`` keeps the
        logits for whoever needs them (the loss is then computed from them), ``False`` drops them in eval too.

        ``num_items_in_batch`` (transformers.Trainer with gradient accumulation): the loss is the sum of the
        token losses divided by it, not their mean. ``hf_kwargs``: what HF's trainers and collators pass besides
        (``use_cache``, FlashAttention's ``cu_seq_lens_q/k``, ...; see ``hf_protocol.packed_documents``).

        ``logits_to_keep=N`` (as in HF) computes the logits of the last N positions only, (B, N, vocab); 0 keeps
        all. A prefill that only samples the next token passes 1: the LM head over every prompt position is a
        large share of the time to the first token on a CPU."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if S == 0:
            raise ValueError("input_ids is empty: give at least one token")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: every position), got {logits_to_keep!r}")
        if logits_to_keep and labels is not None:
            raise ValueError("logits_to_keep computes only the last positions' logits: it cannot go with labels")
        kv_cache = cache_argument(hf_kwargs, kv_cache)
        if (kv_cache is None and hf_kwargs.get("use_cache") is True and labels is None and cu_seqlens is None
                and not (self.training and torch.is_grad_enabled())):
            # HF's decode loop: out.past_key_values carries the cache to the next call, which grows it as needed.
            kv_cache = self.new_kv_cache(B, S, growable=True)
        cu_seqlens = packed_documents(input_ids, attention_mask, position_ids, kv_cache, cu_seqlens, hf_kwargs)
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"packed documents (cu_seqlens) come as one row: input_ids (1, total), got {tuple(input_ids.shape)}")
        if return_logits is None:
            return_logits = labels is None or not self.training
        fused = labels is not None and not return_logits
        rows = None  # a padded batch whose layers run on its real tokens alone (``_real_rows``)
        if kv_cache is None and cu_seqlens is None:
            attention_mask, rows = self._real_rows(input_ids, attention_mask, labels)
        position_ids, mask, positions_needed = self._positions_and_mask(
            input_ids, attention_mask, position_ids, kv_cache=kv_cache, cu_seqlens=cu_seqlens, mask_positions=mask_positions
        )
        if rows is not None:
            input_ids, position_ids, mask = self._packed_rows(rows, input_ids, position_ids)
        rope_tables = self.rotary.tables(positions_needed, input_ids.device) if self.rotary is not None else None
        hidden = self._backbone(input_ids, position_ids, mask, rope_tables, kv_cache)
        if rows is not None:
            packed, hidden = hidden, rows.pad(hidden)  # (1, real tokens, H), and (B, S, H) with zeros at the padding
            if fused:
                loss = self._token_loss(packed[0], rows.unpad(_next_tokens(labels))[0], num_items_in_batch)
                return CausalLMOutput(loss=loss, last_hidden_state=hidden)
        if fused:
            return CausalLMOutput(loss=self.fused_loss(hidden, labels, num_items_in_batch), last_hidden_state=hidden)
        # Whole, not a view of the padded head's output: HF-style callers .view() the logits.
        logits = self._logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden).contiguous()
        loss = self.loss(logits, labels, num_items_in_batch) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss, last_hidden_state=hidden, kv_cache=kv_cache)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, rope_tables) -> torch.Tensor:
        """One token per row (tokens (B, 1)) against a filled ``cache`` -> next-token logits (B, V).

        It reads only tensors and fixed sizes, so the generation engine can capture it in a CUDA graph or
        compile it: the caller has checked the positions, reserved the room (``cache.reserve(1)``) and gives
        rotary tables that cover the whole cache."""
        mask = build_cached_attention_mask(
            None, cache, q_len=1, sliding_window=self.decoder_config.attention.sliding_window, cache_was_empty=False
        )
        # The tokens come from our own sampler over this model's logits: in range, no device check needed.
        hidden = self._backbone(tokens, mask.cache_slots, mask, rope_tables, cache, check_ids=False)
        return self._logits(hidden[:, -1])

    def lean_decode_step(self, cache: KVCache):
        """``decode_step`` against ``cache`` in far fewer torch calls, where the runtime has such a step for this
        model here (runtime/cpu_decode.py: a float32 pre-norm decoder on the CPU, no grad), else None."""
        return LeanCpuStep(self, cache) if lean_step_unsupported(self, cache) is None else None

    def _backbone(self, input_ids, position_ids, mask, rope_tables, kv_cache, *, check_ids: bool = True) -> torch.Tensor:
        """Embeddings, every block, the final norm: the residual stream, (B, S) ids -> (B, S, hidden)."""
        dc = self.decoder_config
        hidden = self.embed(input_ids, position_ids, check_ids=check_ids)  # (B, S, hidden)
        residual = None
        attn_kwargs = dict(mask=mask, position_ids=position_ids, rope_tables=rope_tables, kv_cache=kv_cache)
        # The same mask without its window, for the layers that attend to every earlier key (Qwen2's lower ones).
        full = (dict(attn_kwargs, mask=dataclasses.replace(mask, sliding_window=None, _dense=None))
                if dc.full_attention_layers and mask.sliding_window is not None else attn_kwargs)
        for i, block in enumerate(self.blocks):
            kwargs = full if i in dc.full_attention_layers else attn_kwargs
            if residual is None and chains(block, hidden):  # a decode step in a chain of programmatic launches
                hidden = chained_block_step(block, hidden, **kwargs)  # the whole stream, nothing pending
            else:
                hidden, residual = block(hidden, residual, **kwargs)
        if self.norm_f is not None:
            hidden = self.norm_f(hidden, residual, dropout_p=dc.residual_dropout_p, residual_in_fp32=dc.residual_in_fp32)
        if self.project_out is not None:
            hidden = self.project_out(hidden)  # (B, S, embed_dim)
        if kv_cache is not None:
            kv_cache.advance_to(mask.cache_lengths)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., V), V the real vocabulary: the LM head's output (``_head_logits``), soft-capped
        where the family caps its logits (Gemma 2), in HF's order of operations: divide, tanh, multiply."""
        logits = self._head_logits(hidden)
        cap = self.decoder_config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., V), V the real vocabulary. On CUDA, with a padded head, a view of its output (row
        stride V_padded, aligned GEMMs), so the pad columns never reach a softmax or an argmax; on the CPU, the
        head's real rows alone.

        With an unpadded head (``vocab_multiple=1``) on CUDA whose vocabulary is not a multiple of 64 (GPT-2's
        50257), the rows up to the last multiple of 64 and the few after it are two GEMMs, concatenated: for an
        odd output width cuBLAS falls back to unaligned kernels, 96 us instead of about 20 for GPT-2's batch-16
        decode step on an H200, a sixth of the whole step."""
        vocab = self.decoder_config.vocab_size
        if self.adapted_head():
            return self.lm_head(hidden)[..., :vocab]
        weight = self.output_embeddings()
        bias = self.lm_head.bias
        if not hidden.is_cuda:
            # A CPU GEMM runs at any width: the real rows give the logits whole, where a view of the padded output
            # would be copied whole by the forward (GPT-2's eval forward: a sixth of its time).
            return dense(hidden, weight[:vocab], None if bias is None else bias[:vocab], backend=self.kernel_backend)
        aligned = weight.shape[0] // 64 * 64
        if aligned in (0, weight.shape[0]) or gemv_in_chain(hidden, weight, self.kernel_backend):
            logits = dense(hidden, weight, bias, backend=self.kernel_backend)  # our GEMV takes any width
            return logits if weight.shape[0] == vocab else logits[..., :vocab]
        parts = [nn.functional.linear(hidden, weight[rows], bias[rows] if bias is not None else None)
                 for rows in (slice(0, aligned), slice(aligned, None))]
        return torch.cat(parts, dim=-1)

    def _positions_and_mask(self, input_ids, attention_mask, position_ids, *, kv_cache, cu_seqlens, mask_positions=None):
        """Position ids (B, S), the shared AttentionMask, and how many rotary positions the tables must cover.

        Without a cache, attention_mask (B, S) covers the input; with one, only its last S columns (the new
        tokens) matter, since the cache holds each row's earlier real tokens compacted."""
        dc = self.decoder_config
        B, S = input_ids.shape
        window = dc.attention.sliding_window
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                           or attention_mask.shape[1] < S):
            raise ValueError(f"attention_mask must be (batch, keys): {B} rows of 1 for real tokens and 0 for padding "
                             f"covering at least the {S} input tokens, got shape {tuple(attention_mask.shape)} (4-D "
                             "and additive masks are not taken)")
        if kv_cache is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens (packed documents) cannot be combined with a KV cache")
            if mask_positions is False:
                raise ValueError("mask_positions=False cannot be combined with a KV cache: the cache holds each "
                                 "row's real tokens compacted, so positions count real tokens")
            if kv_cache.batch_size != B:
                raise ValueError(f"KV cache batch {kv_cache.batch_size} != input batch {B}")
            kv_cache.make_room(S)
            new_mask = attention_mask[:, -S:] if attention_mask is not None else None
            mask = build_cached_attention_mask(new_mask, kv_cache, q_len=S, sliding_window=window)
            derived, needed = mask.cache_slots, kv_cache.upper_bound + S
        else:
            mask = build_attention_mask(attention_mask, q_len=S, past_len=0, causal=True, sliding_window=window,
                                        cu_seqlens=cu_seqlens)
            needed = S
            # The family's own HF rule (OPT's) also numbers the padding as HF does: its logits there match too.
            pad_position = -1 if mask_positions is None and dc.positions_from_mask else None
            assert pad_position is None or dc.position_offset >= 1, "position -1 needs a table row before 0"
            if mask_positions is None:
                mask_positions = dc.positions_from_mask
            if cu_seqlens is not None:
                derived = positions_in_documents(cu_seqlens, S).unsqueeze(0)
                if S > dc.max_position_embeddings:  # positions restart per document: the longest one counts
                    needed = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            elif attention_mask is not None and mask_positions:
                derived = positions_from_mask(attention_mask, pad_position=pad_position)
            else:
                derived = torch.arange(S, device=input_ids.device).expand(B, S)
        if position_ids is None:
            position_ids = derived
        elif torch.compiler.is_compiling():
            # A host read would break the graph: the tables cover the model's positions, and positions past them
            # go unchecked, as labels do under torch.compile (flash_kernels.cross_entropy).
            needed = max(needed, dc.max_position_embeddings)
        else:
            needed = max(needed, int(position_ids.max()) + 1)
        if dc.learned_positions and needed > dc.max_position_embeddings:
            raise ValueError(
                f"sequence of {needed} positions exceeds the model's {dc.max_position_embeddings} positions; "
                "truncate the input"
            )
        if kv_cache is not None:
            kv_cache.reserve(S)  # last: nothing is accounted for when a check above fails
        return position_ids, mask, needed

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The shifted LM loss: the mean over labelled tokens, or their sum / ``num_items_in_batch``."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels shape {tuple(labels.shape)} must match input_ids {tuple(logits.shape[:2])}")
        shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        shifted_labels = labels[:, 1:].reshape(-1)
        loss = flash_kernels.cross_entropy(shifted_logits, shifted_labels, backend=self.kernel_backend,
                                           reduction="mean" if num_items_in_batch is None else "sum")
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    def fused_loss(self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The shifted LM loss straight from the final hidden states (B, S, H), without the logits."""
        if labels.shape != hidden.shape[:2]:
            raise ValueError(f"labels shape {tuple(labels.shape)} must match input_ids {tuple(hidden.shape[:2])}")
        return self._token_loss(hidden[:, :-1], labels[:, 1:], num_items_in_batch)

    def _token_loss(self, hidden: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The LM loss of hidden states (..., H) against the token each predicts (...; -100: none): their mean, or
        their sum / ``num_items_in_batch``. Through the fused LM head + loss, unless an adapter wraps the head (the
        fused kernel would read the base weight only) or the logits are soft-capped (which the kernel does not do):
        those compute the logits."""
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        reduction = "mean" if num_items_in_batch is None else "sum"
        if self.adapted_head() or self.decoder_config.final_logit_softcap is not None:
            loss = flash_kernels.cross_entropy(self._logits(hidden).contiguous(), targets, backend=self.kernel_backend,
                                               reduction=reduction)
        else:
            weight = self.output_embeddings()
            bias = self.lm_head.bias
            if torch.is_autocast_enabled(hidden.device.type):  # a custom op: cast as autocast would for a linear
                hidden, weight, bias = autocast_like(hidden, weight, bias)
            else:
                hidden = hidden.to(weight.dtype)
            loss = flash_kernels.linear_cross_entropy(hidden, weight, targets, bias=bias, reduction=reduction,
                                                      vocab_size=self.decoder_config.vocab_size,
                                                      backend=self.kernel_backend)
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    def _real_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None):
        """The mask of a forward without a cache (training or not, the backbone alone too), as its layers take it,
        with one host read: (None, None) where the mask marks every token real (``without_padding``); else
        (attention_mask, None), or, where our attention kernels run the layers and no loss term is read at a
        padding position (no ``labels``, or a next-token label of -100 there, as collators pad labels),
        (attention_mask, the rows' real tokens): the layers then run on the real tokens alone (no GEMM on padding,
        no unpadding around each attention), and the loss, gradients and the real positions' logits are the
        padded forward's. Our kernels' padded path already gives the padding positions no attention, so what
        changes there (the hidden states are zeros now, the logits the head's of a zero state) was not HF's
        before either. Under torch.compile or a CUDA graph capture the mask is kept as given; one of the wrong
        shape too (the mask's checks refuse it)."""
        if (attention_mask is None or attention_mask.shape != input_ids.shape
                or (labels is not None and labels.shape != input_ids.shape)
                or torch.compiler.is_compiling() or capturing_cuda_graph()):
            return attention_mask, None
        if self.blocks[0].attn.backend_computing(self.embed.tokens.weight) != "flash":
            return without_padding(attention_mask), None
        real = attention_mask.bool()
        checks = [real.all()] if labels is None else [real.all(), (real | (_next_tokens(labels) == -100)).all()]
        all_real, *no_loss_at_padding = torch.stack(checks).tolist()
        if all_real:
            return None, None
        return attention_mask, UnpaddedBatch.from_mask(attention_mask) if all(no_loss_at_padding) else None

    def _packed_rows(self, rows: UnpaddedBatch, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """The real tokens of a padded batch, their positions and mask: each row a document of one packed row, as
        padding-free training runs (the rows are no longer than the batch's sequence: no host read)."""
        mask = build_attention_mask(None, q_len=rows.total, past_len=0, causal=True, cu_seqlens=rows.cu_seqlens,
                                    sliding_window=self.decoder_config.attention.sliding_window,
                                    max_seqlen=input_ids.shape[1])
        return rows.unpad(input_ids), rows.unpad(position_ids), mask

    # ----------------------------------------------------------------------------------------------------
    # HF names TRL's fused LM head uses: the backbone's final hidden states, and the LM head's weight and bias.
    @classmethod
    def can_generate(cls) -> bool:
        return True

    @property
    def base_model(self):
        """What HF calls the model without its LM head: called like the forward (without labels), it returns
        an output whose ``last_hidden_state`` is the final hidden states (B, S, hidden). ``logits_to_keep`` is taken
        and changes nothing, as in HF's base models: it concerns the LM head (TRL's distillation passes it)."""
        return self.hidden_states

    @public_forward
    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, *, cu_seqlens=None, logits_to_keep: int = 0,
                      **hf_kwargs) -> EncoderOutput:
        B, S = input_ids.shape
        cu_seqlens = packed_documents(input_ids, attention_mask, position_ids, None, cu_seqlens, hf_kwargs)
        rows = None  # a padded batch whose layers run on its real tokens alone (``_real_rows``)
        if cu_seqlens is None:
            attention_mask, rows = self._real_rows(input_ids, attention_mask, None)
        position_ids, mask, needed = self._positions_and_mask(input_ids, attention_mask, position_ids, kv_cache=None,
                                                              cu_seqlens=cu_seqlens)
        if rows is not None:
            input_ids, position_ids, mask = self._packed_rows(rows, input_ids, position_ids)
        rope_tables = self.rotary.tables(needed, input_ids.device) if self.rotary is not None else None
        hidden = self._backbone(input_ids, position_ids, mask, rope_tables, None)
        return EncoderOutput(last_hidden_state=hidden if rows is None else rows.pad(hidden))

    @property
    def generation_config(self):
        """HF's ``GenerationConfig`` of this model: the checkpoint's generation_config.json (``from_pretrained``),
        else made from the config's token ids on first use (TRL aligns its ids with the tokenizer's). ``generate``
        takes its default EOS and pad ids from it (its sampling settings only when it is passed as ``generation_config=``)."""
        if self._generation_config is None:
            import transformers  # HF's class, made on use: the model files do not need transformers to load

            c = self.config
            self._generation_config = transformers.GenerationConfig(
                bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **hf_kwargs) -> dict:
        """HF's per-step hook of its own generation loop, which PEFT's ``task_type="CAUSAL_LM"`` wrapper reads when
        it is built. ``generate`` here keeps its own KV cache and does not call it: it gives the forward's inputs
        for the whole sequence so far. HF's cache arguments (``past_key_values``, ...) are refused."""
        given = sorted(name for name, value in hf_kwargs.items() if value is not None)
        if given:
            raise ValueError(f"prepare_inputs_for_generation: {given} are HF generation-loop state; flash-models "
                             "models generate with model.generate, which keeps its own cache")
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def get_output_embeddings(self) -> nn.Module:
        """The LM head with the real vocabulary's rows (the padding hidden: ``RealVocabHead``)."""
        vocab = self.decoder_config.vocab_size
        return self.lm_head if self.lm_head.weight.shape[0] == vocab else RealVocabHead(self.lm_head, vocab)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """HF's method (tokens added to the tokenizer, TRL's ``clone_chat_template``): the vocabulary becomes
        ``new_num_tokens`` ids (rounded up to ``pad_to_multiple_of``), in place. The first ids keep their rows in the
        token table and an untied LM head; new rows start at the mean of the old ones (``mean_resizing``, as HF
        does, which keeps the old tokens' next-token distribution), or from the model's init. ``config.vocab_size``
        follows. Returns the token table; an optimizer built before holds the old tables, as with HF."""
        old = self.decoder_config.vocab_size
        new = resized_vocab_size(old, new_num_tokens, pad_to_multiple_of)
        if new == old:
            return self.get_input_embeddings()
        typed = dataclasses.replace(self.config.typed, vocab_size=new)
        decoder_config = typed.decoder()  # checked before anything changes (a pad_token_id the new size leaves out)
        self.config.replace_typed(typed)
        self.decoder_config = decoder_config
        std = self.decoder_config.initializer_range
        self.embed.tokens = resized_table(self.embed.tokens, old, new, multiple=self.vocab_multiple,
                                          mean_resizing=mean_resizing, std=std)
        self.embed.vocab_size = new
        if not self.head_is_tied():  # a tied head reads the new table itself
            self.lm_head = resized_table(self.lm_head, old, new, multiple=self.vocab_multiple,
                                         mean_resizing=mean_resizing, std=std)
        return self.get_input_embeddings()

    # ----------------------------------------------------------------------------------------------------
    # Generation and saving live in higher layers (generation/, checkpoint/); these methods are the HF-style
    # entry points and import them on use so that this module never imports upward at load time.
    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        from ..generation import generate

        return generate(self, input_ids, **kwargs)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        from ..checkpoint import save_pretrained

        save_pretrained(self, save_directory, **kwargs)

"""Multi-head attention with a fused qkv projection: MHA, GQA and MQA, rotary, causal and padding masks,
sliding windows, a KV cache, and explicit backends:

- "eager": scores in float32, softmax, weighted sum: the readable reference.
- "sdpa": torch's scaled_dot_product_attention.
- "flash": our Triton kernels (flash_kernels.flash_attn_func / flash_attn_varlen_func); padded batches are
  unpadded into packed sequences so no work is spent on padding.
- "auto": "flash" for CUDA tensors in fp16/bf16 with a head dim the kernels support, else "sdpa"; always "sdpa"
  with the "reference" kernel backend. The check is a cheap look at device/dtype at call time, so a model
  moved with ``.to("cuda")`` picks it up. A soft-capped attention (Gemma 2) takes "eager" where "auto" would take
  "sdpa", which cannot soft-cap.

``kernel_backend`` (the model's) goes to every other kernel the layer calls: rotary, the KV-cache writes, the
projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels
from flash_kernels._backend import capturing_cuda_graph

from ..config import ATTN_IMPLS, AttentionConfig, RopeConfig, check_choice
from .kv_cache import KVCache
from .linear import compute_dtype, linear
from .norm import Norm
from .recompute import NormedInput, projection_of
from .varlen import UnpaddedBatch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The kernels take any head dim up to this (flash_kernels.attention.MAX_HEAD_DIM, FlashAttention-2's limit); a
# constant here so that importing the model code does not import the kernels.
FLASH_MAX_HEAD_DIM = 256


@dataclass
class AttentionMask:
    """Everything a layer needs to mask attention, built once per model forward and shared by all layers.

    ``key_padding`` is HF's attention_mask as bool (B, past + Sq), True for real tokens, or None. Query i
    sits at key index past_len + i: causal masking is aligned bottom-right. A ``sliding_window`` of W keeps the
    keys less than W positions away: causal, the query itself and the W - 1 keys before it (Mistral); not
    causal, W - 1 keys on either side (HF's bidirectional sliding window).
    """

    q_len: int
    past_len: int
    causal: bool
    sliding_window: int | None
    key_padding: torch.Tensor | None
    cu_seqlens: torch.Tensor | None = None  # packed documents in one row: (num_docs + 1,) int32 offsets
    max_seqlen: int = 0
    # With a KV cache: each new token's cache slot (B, S), which new tokens are real (None: all), the real
    # keys per row once they are written (B,), and whether the cache held nothing before this forward.
    cache_slots: torch.Tensor | None = None
    query_real: torch.Tensor | None = None
    cache_lengths: torch.Tensor | None = None
    cache_was_empty: bool = True
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _unpad: tuple | None = field(default=None, repr=False)

    @property
    def k_len(self) -> int:
        return self.past_len + self.q_len

    @property
    def implicit(self) -> bool:
        """True when plain causal attention (or none) says it all: no padding, no window, and Sq == Sk or
        a single query (which may see every key)."""
        return self.key_padding is None and self.cu_seqlens is None and self.sliding_window is None and (
            not self.causal or self.q_len == self.k_len or self.q_len == 1
        )

    def dense(self, device: torch.device) -> torch.Tensor:
        """Boolean (B or 1, 1, Sq, Sk), True where a query may attend to a key."""
        if self._dense is None:
            q_idx = torch.arange(self.past_len, self.k_len, device=device).unsqueeze(1)  # (Sq, 1)
            k_idx = torch.arange(self.k_len, device=device).unsqueeze(0)  # (1, Sk)
            allowed = torch.ones(self.q_len, self.k_len, dtype=torch.bool, device=device)
            if self.causal:
                allowed &= k_idx <= q_idx
            if self.sliding_window is not None:
                allowed &= (q_idx - k_idx).abs() < self.sliding_window  # (the causal mask cut the keys after)
            if self.cu_seqlens is not None:  # packed documents never attend across each other
                doc = torch.searchsorted(self.cu_seqlens[1:], torch.arange(self.k_len, device=device), right=True)
                allowed &= doc.unsqueeze(1) == doc.unsqueeze(0)
            allowed = allowed[None, None]
            if self.key_padding is not None:
                allowed = allowed & self.key_padding[:, None, None, :]
            self._dense = allowed
        return self._dense

    def cache_dense(self, max_len: int, device: torch.device) -> torch.Tensor:
        """Boolean (B, 1, Sq, max_len) over the whole cache: a new token sees the cached and new keys at or
        before its own slot, within the window; padded new tokens see nothing (their output is zeroed)."""
        if self._dense is None:
            k_idx = torch.arange(max_len, device=device)[None, None, :]  # (1, 1, max_len)
            slots = self.cache_slots.unsqueeze(-1)  # (B, Sq, 1)
            allowed = (k_idx <= slots) & (k_idx < self.cache_lengths[:, None, None])
            if self.sliding_window is not None:
                allowed &= slots - k_idx < self.sliding_window
            if self.query_real is not None:
                allowed &= self.query_real.unsqueeze(-1)
            self._dense = allowed.unsqueeze(1)
        return self._dense

    def unpad_indices(self):
        """(q_index, k_index, cu_seqlens_q, cu_seqlens_k, max_q, max_k) for packing real tokens, cached."""
        if self._unpad is None:
            keys = UnpaddedBatch.from_mask(self.key_padding)  # (B, Sk)
            queries = UnpaddedBatch.from_mask(self.key_padding[:, self.past_len:])  # (B, Sq): the new tokens' own mask
            self._unpad = (queries.index, keys.index, queries.cu_seqlens, keys.cu_seqlens,
                           queries.max_seqlen, keys.max_seqlen)
        return self._unpad


def without_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """HF's (B, S) attention_mask, or None where it marks every token real: the layers then attend with no mask,
    the kernels' fastest path (no unpadding, gathers or host reads in each layer), as HF's own models drop such a
    mask. Tokenizers and collators give one with every batch, padded or not. It costs one host read; under
    torch.compile or a CUDA graph capture, which cannot make it, the mask is kept."""
    if attention_mask is None or torch.compiler.is_compiling() or capturing_cuda_graph():
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


def build_attention_mask(
    attention_mask: torch.Tensor | None, *, q_len: int, past_len: int, causal: bool, sliding_window: int | None,
    cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
) -> AttentionMask:
    """Check HF's (B, past + Sq) attention_mask, or packed-document offsets, and wrap them (see
    ``AttentionMask``). Offsets are read back and checked, which also finds the longest document, unless
    ``max_seqlen`` (an upper bound of the document lengths) is given: then nothing is read from the device,
    so a CUDA graph can capture the call, and the offsets are the caller's to get right."""
    k_len = past_len + q_len
    if cu_seqlens is not None:
        if attention_mask is not None or past_len:
            raise ValueError("cu_seqlens (packed documents) cannot be combined with attention_mask or a KV cache")
        if max_seqlen is not None:
            if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens must be 1-D int32 offsets with at least 2 entries, got "
                                 f"{tuple(cu_seqlens.shape)} ({cu_seqlens.dtype})")
            if max_seqlen < 0:
                raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
            return AttentionMask(q_len=q_len, past_len=0, causal=causal, sliding_window=sliding_window,
                                 key_padding=None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        offsets = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else []  # one host read per forward
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if cu_seqlens.dtype != torch.int32 or not offsets or offsets[0] != 0 or offsets[-1] != q_len or min(lengths, default=0) < 0:
            raise ValueError(
                f"cu_seqlens must be non-decreasing int32 offsets starting at 0 and ending at the packed length "
                f"{q_len}, got {offsets if 0 < len(offsets) < 20 else tuple(cu_seqlens.shape)} ({cu_seqlens.dtype})"
            )
        max_seqlen = max(lengths, default=0)
        return AttentionMask(q_len=q_len, past_len=0, causal=causal, sliding_window=sliding_window, key_padding=None,
                             cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} positions but the keys span {k_len} "
            f"({past_len} cached + {q_len} new); pass a mask over all cached and new tokens"
        )
    key_padding = attention_mask.bool() if attention_mask is not None else None
    return AttentionMask(q_len=q_len, past_len=past_len, causal=causal, sliding_window=sliding_window, key_padding=key_padding)


def build_cached_attention_mask(
    new_mask: torch.Tensor | None, cache: KVCache, *, q_len: int, sliding_window: int | None,
    cache_was_empty: bool | None = None,
) -> AttentionMask:
    """The mask for ``q_len`` new tokens going into ``cache``. ``new_mask`` (B, q_len) marks the real new
    tokens (None: all real). Real tokens take the next free slots of their row; padding takes none.
    ``cache_was_empty`` defaults to the cache's own host-side state; a decode step that must not read it (a
    compiled one) says False."""
    if new_mask is None:  # the fewest kernels: this runs at the start of every decode step
        slots = cache.seqlens.long().unsqueeze(1)  # (B, S)
        if q_len > 1:
            slots = slots + torch.arange(q_len, device=cache.seqlens.device)
        new_counts = q_len
        query_real = None
    else:
        query_real = new_mask.bool()
        slots = cache.seqlens.long().unsqueeze(1) + (query_real.long().cumsum(1) - 1).clamp(min=0)
        new_counts = query_real.sum(1, dtype=torch.int32)
    return AttentionMask(
        q_len=q_len, past_len=0, causal=True, sliding_window=sliding_window, key_padding=query_real,
        cache_slots=slots, query_real=query_real, cache_lengths=cache.seqlens + new_counts,
        cache_was_empty=cache.empty if cache_was_empty is None else cache_was_empty,
    )


def _decoding(mask: AttentionMask) -> bool:
    """New tokens, all real (no padding among them), going into a cache that already holds the prompt: a
    decode step (or an unpadded chunk), whose attention reads the keys and values back from the cache."""
    return not mask.cache_was_empty and mask.query_real is None


def _eager_attention(q, k, v, mask, *, scale, dropout_p, softcap: float = 0.0):
    """Readable reference: scores in float32 (soft-capped where ``softcap``), softmax, weighted sum.
    q (B, H, Sq, D), k/v (B, H, Sk, D)."""
    with torch.autocast(q.device.type, enabled=False):  # autocast would round the float32 scores' matmul down
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(probs.to(v.dtype), v)


class Attention(nn.Module):
    # Whether the backward casts the float32 projection weights again under autocast rather than keep the
    # forward's copies (modules/linear.py); the LLaMA-style decoders turn it on.
    recompute_weight_casts = False

    def __init__(
        self, cfg: AttentionConfig, *, layer_idx: int, rope: RopeConfig | None = None, attn_impl: str = "auto",
        kernel_backend: str = "auto",
    ):
        super().__init__()
        check_choice("attn_impl", attn_impl, ATTN_IMPLS)
        check_choice("kernel_backend", kernel_backend, flash_kernels.BACKENDS)
        if attn_impl == "sdpa" and cfg.softcap:
            raise ValueError(f"attn_impl='sdpa' has no soft-capping of the scores, which this model's attention "
                             f"applies (softcap {cfg.softcap}); use attn_impl='auto' (our kernels on a GPU, 'eager' "
                             "elsewhere), 'flash' or 'eager'")
        if attn_impl == "flash" and cfg.head_dim > FLASH_MAX_HEAD_DIM:
            raise ValueError(
                f"attn_impl='flash' supports head dims up to {FLASH_MAX_HEAD_DIM}, this model has {cfg.head_dim}; "
                "use attn_impl='sdpa' or 'auto'"
            )
        self.cfg, self.layer_idx, self.rope, self.attn_impl = cfg, layer_idx, rope, attn_impl
        self.kernel_backend = kernel_backend
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.out_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm_eps is not None:
            self.q_norm = Norm(cfg.head_dim, kind="rms_norm", eps=cfg.qk_norm_eps, bias=False, kernel_backend=kernel_backend)
            self.k_norm = Norm(cfg.head_dim, kind="rms_norm", eps=cfg.qk_norm_eps, bias=False, kernel_backend=kernel_backend)
        self.softmax_scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self.softcap = cfg.softcap or 0.0  # 0: none, as our kernels take it
        if cfg.scale_by_inverse_layer_idx:
            self.softmax_scale /= layer_idx + 1

    def forward(
        self, x: torch.Tensor, *, mask: AttentionMask, position_ids: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache: KVCache | None = None,
        normed: NormedInput | None = None,
    ) -> torch.Tensor:
        """x (B, S, hidden); position_ids (B, S); rope_tables the model's (cos, sin) covering every position;
        ``normed``: x as a pre-norm block's norm made it, recomputed in the backward (modules/recompute.py)."""
        qkv = projection_of(x, self.qkv, normed=normed, backend=self.kernel_backend,
                            recompute_weight_cast=self.recompute_weight_casts)
        out = self.attend_qkv(qkv, mask=mask, position_ids=position_ids, rope_tables=rope_tables, kv_cache=kv_cache)
        return linear(out, self.out_proj, backend=self.kernel_backend, recompute_weight_cast=self.recompute_weight_casts)

    def attend_qkv(
        self, qkv: torch.Tensor, *, mask: AttentionMask, position_ids: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The projected qkv (B, S, (Hq + 2 * Hkv) * D) -> the attention output before out_proj, (B, S, Hq * D):
        the q/k norms, rotary, the cache writes and the attention."""
        cfg, backend = self.cfg, self.kernel_backend
        B, S, _ = qkv.shape
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        qkv = qkv.view(B, S, hq + 2 * hkv, cfg.head_dim)  # heads: [q (Hq) | k (Hkv) | v (Hkv)]
        if self.q_norm is not None:  # before every path below (packed, decode, cached), so each sees normed heads
            q, k, v = qkv.split((hq, hkv, hkv), dim=2)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=2)
        q_dim = hq * cfg.head_dim
        if kv_cache is None and mask.key_padding is None and self.backend_for(qkv) == "flash":
            # Training and cacheless prefill: attend over the packed projection, so the backward writes one
            # dqkv instead of autograd assembling it slice by slice (zero fills, copies and adds).
            if self.rope is not None:
                cos, sin = rope_tables
                qkv = flash_kernels.apply_rotary(qkv, cos, sin, interleaved=self.rope.interleaved,
                                                 position_ids=position_ids, num_rotated_heads=hq + hkv, backend=backend)
            return self._flash_packed(qkv, mask, self.dropout_p()).reshape(B, S, q_dim)
        if kv_cache is not None and self.rope is not None and _decoding(mask):
            # A decode step: q and k rotate and k and v go into the cache in one launch, then attend over it.
            cos, sin = rope_tables
            layer = self.layer_idx
            q = flash_kernels.rotary_kv_append(
                qkv, cos, sin, position_ids=position_ids, k_cache=kv_cache.k[layer], v_cache=kv_cache.v[layer],
                slots=mask.cache_slots, num_q_heads=hq, block_table=kv_cache.block_table,
                interleaved=self.rope.interleaved, backend=backend,
            )
            return self.attend_cached(q, mask, kv_cache).reshape(B, S, q_dim)
        qk, v = qkv[:, :, : hq + hkv], qkv[:, :, hq + hkv :]
        if self.rope is not None:  # q and k heads rotate together: one launch
            cos, sin = rope_tables
            qk = flash_kernels.apply_rotary(qk, cos, sin, interleaved=self.rope.interleaved, position_ids=position_ids,
                                            backend=backend)
        q, k = qk[:, :, :hq], qk[:, :, hq:]  # (B, S, Hq, D), (B, S, Hkv, D)
        if kv_cache is None:
            out = self.attend(q, k, v, mask)  # (B, S, Hq, D)
        else:
            out = self.attend_with_cache(q, k, v, mask, kv_cache)
        return out.reshape(B, S, q_dim)

    def attend_with_cache(self, q, k, v, mask: AttentionMask, cache: KVCache) -> torch.Tensor:
        """Store the new keys/values in the cache and attend over everything cached so far."""
        cache.write(self.layer_idx, k, v, mask.cache_slots, mask.query_real, backend=self.kernel_backend)
        if mask.cache_was_empty:  # prefill: the new tokens are all there is, attend among them directly
            return self.attend(q, k, v, mask)
        return self.attend_cached(q, mask, cache)

    def attend_cached(self, q, mask: AttentionMask, cache: KVCache) -> torch.Tensor:
        """Attend over everything in the cache, the new tokens' keys and values already stored there."""
        layer = self.layer_idx
        backend = self.backend_for(q)
        if backend == "flash" and _decoding(mask):
            # Decoding (or an unpadded chunk): the split-KV kernel over each row's cached keys, no mask needed.
            window = (mask.sliding_window - 1, 0) if mask.sliding_window is not None else (-1, -1)
            return flash_kernels.flash_attn_with_kvcache(
                q, cache.k[layer], cache.v[layer], cache_seqlens=mask.cache_lengths, causal=True,
                softmax_scale=self.softmax_scale, window_size=window, softcap=self.softcap,
                block_table=cache.block_table, backend="triton" if self.attn_impl == "flash" else "auto",
            )
        dense = mask.cache_dense(cache.max_len, q.device)  # (B, 1, Sq, max_len)
        keys, values = cache.layer_kv(layer)
        return self._masked_attention(q, keys, values, dense, "eager" if backend == "eager" else "sdpa", 0.0)

    def backend_for(self, x: torch.Tensor) -> str:
        """The backend for inputs on x's device and dtype (x: q, or the hidden states about to come in)."""
        return self.backend_on(x.device, x.dtype)

    def backend_computing(self, weight: torch.Tensor) -> str:
        """The backend the layers of a model with this ``weight`` will take, decided before they run: they compute
        in its dtype, or autocast's over float32 weights."""
        return self.backend_on(weight.device, compute_dtype(weight))

    def backend_on(self, device: torch.device, dtype: torch.dtype) -> str:
        """The backend for inputs on ``device`` in ``dtype``."""
        if self.attn_impl != "auto":
            return self.attn_impl
        flash_ok = (self.kernel_backend != "reference" and device.type == "cuda" and dtype in FLASH_DTYPES
                    and self.cfg.head_dim <= FLASH_MAX_HEAD_DIM)
        return "flash" if flash_ok else "eager" if self.softcap else "sdpa"  # (sdpa cannot soft-cap)

    def dropout_p(self) -> float:
        return self.cfg.dropout_p if self.training else 0.0

    def attend(self, q, k, v, mask: AttentionMask) -> torch.Tensor:
        """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> (B, Sq, Hq, D). Fully masked query rows give zeros."""
        dropout_p = self.dropout_p()
        backend = self.backend_for(q)
        if backend == "flash":
            return self._flash(q, k, v, mask, dropout_p)
        if mask.implicit and backend == "sdpa":
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                is_causal=mask.causal and mask.q_len > 1, scale=self.softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
            )
            return out.transpose(1, 2)
        return self._masked_attention(q, k, v, mask.dense(q.device), backend, dropout_p)

    def _masked_attention(self, q, k, v, dense, backend: str, dropout_p: float) -> torch.Tensor:
        """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), dense (B or 1, 1, Sq, Sk) -> (B, Sq, Hq, D)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        row_has_keys = dense.any(dim=-1, keepdim=True)  # (B, 1, Sq, 1)
        dense = dense | ~row_has_keys  # a row with no key would be NaN: let it see all, then zero it below
        if backend == "eager":
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = _eager_attention(q, k, v, dense, scale=self.softmax_scale, dropout_p=dropout_p, softcap=self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, dropout_p=dropout_p, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        return (out * row_has_keys).transpose(1, 2)

    def _check_flash_dtype(self, x: torch.Tensor) -> None:
        """An explicit attn_impl="flash" on inputs its kernels cannot take: said in the model's words (the kernels'
        own refusal would point at their backend= argument, which a model's caller never passes)."""
        if self.attn_impl == "flash" and x.dtype not in FLASH_DTYPES:
            raise ValueError(f"attn_impl='flash' runs our attention kernels in float16 or bfloat16, and this layer's "
                             f"inputs are {x.dtype}: load the model with dtype=torch.bfloat16 (or float16, or run it "
                             "under torch.autocast), or use attn_impl='sdpa' or 'auto'")

    def _flash_kwargs(self, mask: AttentionMask, dropout_p: float) -> dict:
        # Our kernels' window is (left, right) in keys: W - 1 keys back, and as many ahead when not causal.
        window = (-1, -1)
        if mask.sliding_window is not None:
            window = (mask.sliding_window - 1, 0 if mask.causal else mask.sliding_window - 1)
        return dict(causal=mask.causal, softmax_scale=self.softmax_scale, window_size=window, softcap=self.softcap,
                    dropout_p=dropout_p, backend="triton" if self.attn_impl == "flash" else "auto")

    def _flash_packed(self, qkv, mask: AttentionMask, dropout_p: float) -> torch.Tensor:
        """qkv (B, S, Hq + 2 * Hkv, D), no padding -> (B, S, Hq, D)."""
        self._check_flash_dtype(qkv)
        kwargs = dict(self._flash_kwargs(mask, dropout_p), num_heads_kv=self.cfg.num_kv_heads)
        if mask.cu_seqlens is not None:  # packed documents: one row holding every document back to back
            assert qkv.shape[0] == 1, "packed documents come as a single row"
            # squeeze(0), not qkv[0]: a select's backward fills a zero tensor of the input's shape and copies the
            # gradient into it (one fill and one qkv-sized copy per layer, 1.5 ms of a BERT-large training
            # step on an H100); squeeze's backward is a view.
            return flash_kernels.flash_attn_varlen_qkvpacked_func(qkv.squeeze(0), mask.cu_seqlens, mask.max_seqlen,
                                                                  **kwargs).unsqueeze(0)
        return flash_kernels.flash_attn_qkvpacked_func(qkv, **kwargs)

    def _flash(self, q, k, v, mask: AttentionMask, dropout_p: float) -> torch.Tensor:
        self._check_flash_dtype(q)
        kwargs = self._flash_kwargs(mask, dropout_p)
        if mask.cu_seqlens is not None:  # packed documents: one row holding every document back to back
            B, S, Hq, D = q.shape
            assert B == 1, "packed documents come as a single row"
            out = flash_kernels.flash_attn_varlen_func(  # squeeze(0), not [0]: see _flash_packed
                q.squeeze(0), k.squeeze(0), v.squeeze(0), cu_seqlens_q=mask.cu_seqlens, cu_seqlens_k=mask.cu_seqlens,
                max_seqlen_q=mask.max_seqlen, max_seqlen_k=mask.max_seqlen, **kwargs,
            )
            return out.unsqueeze(0)
        if mask.key_padding is None:
            return flash_kernels.flash_attn_func(q, k, v, **kwargs)
        # Pack the real tokens of every row, attend per sequence, scatter back; padded queries stay zero.
        B, Sq, Hq, D = q.shape
        q_index, k_index, cu_q, cu_k, max_q, max_k = mask.unpad_indices()
        packed = flash_kernels.flash_attn_varlen_func(
            q.reshape(B * Sq, Hq, D)[q_index], k.reshape(-1, *k.shape[2:])[k_index], v.reshape(-1, *v.shape[2:])[k_index],
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **kwargs,
        )
        out = q.new_zeros(B * Sq, Hq, D)
        out[q_index] = packed
        return out.view(B, Sq, Hq, D)

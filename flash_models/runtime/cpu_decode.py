"""A lean decode step for a decoder LM on the CPU: the plain forward's math over the same weights, in a
fraction of its torch calls.

On a CPU every torch call costs microseconds of dispatch whatever its size. The module path's decode step is
written for every case at once (autocast, recompute, packed documents, CUDA kernels), and at batch 1 that is
about 2,500 top-level calls a token for a 30-layer model: casts that change nothing, a mask rebuilt in every
layer, the cache written through advanced indexing, rotary through gathers and concatenations. Here the step
works out once what every layer shares (positions, cache slots, which keys to read, the rotary rotation) and
then runs each layer in about a dozen calls:

    norm -> qkv GEMV -> (q/k norms) -> rotary as one small matmul -> cache write (index_copy_) -> SDPA over
    the cache -> out GEMV + residual (one addmm) -> norm -> [gate; up] GEMV -> activation -> down GEMV +
    residual

It also runs generate's prefill of unpadded prompts into the empty cache (the first token a user waits for),
with the LM head on the last position only.

Every projection multiplies by a transposed copy of its weight, (in, out) contiguous, made once per model and
kept while the weight is unchanged (``TransposedWeights``). A batch-1 step is a chain of matrix-vector
products that stream the weights from memory, and torch's BLAS (MKL) streams a row-major (out, in) weight
through ``x @ W.T`` at a fraction of the speed it streams the (in, out) copy through ``x @ W_t``: measured on a
2-core AMD EPYC (AVX-512) at SmolLM2's sizes, 16-17 against 23 GB/s at 2 threads, 11 against 14-20 at 1 (the
first kernel barely uses the second thread). The copies cost the projections' memory once more (540 MB for
SmolLM2-135M in float32), the price of a third of the step's time, so they are made only while they take at
most an eighth of the machine's memory; a larger model multiplies by its weights' transposed views instead.
The faster kernel does split across the threads, so where another process holds one of the cores torch was
told to use, every projection waits for it: give torch the cores that are free (``torch.set_num_threads``).

The same numbers as the plain forward in float32, up to summation order (an add folded into a GEMM, a rotation
summed by a matmul): about 1e-6 relative, far below the float32 parity tolerance with HF.

``lean_step_unsupported`` says plainly which models and caches it takes; the engine runs the plain step for
everything else.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flash_kernels.rotary import apply_rotary_ref

from ..modules.attention import Attention
from ..modules.block import PreNormBlock
from ..modules.kv_cache import KVCache
from ..modules.linear import plain_linear
from ..modules.mlp import MLP, GatedMLP, activation
from ..modules.norm import Norm
from ..modules.scaled_embedding import ScaledEmbedding


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def lean_step_unsupported(model, cache: KVCache) -> str | None:
    """Why the lean CPU step cannot run ``model``'s decode steps against ``cache``, or None when it can:
    a float32 decoder on the CPU, nothing recording gradients, the "reference" or "auto" kernel backend and the
    "sdpa" or "auto" attention (an explicit "eager" or "triton" choice is the user's to keep), no dropout
    (eval mode, or every dropout probability zero), pre-norm blocks (GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma,
    OPT-125m style: LayerNorm or RMSNorm, gated or plain MLP, rotary or learned positions, q/k norms, sliding
    windows) built from the library's own modules with plain nn.Linear layers and no hooks (adapters such as
    LoRA keep their own forward), and a per-row (not paged) cache."""
    dc = model.decoder_config
    if model.device.type != "cpu":
        return f"device {model.device.type!r}"
    if torch.is_grad_enabled():
        return "grad mode is on"
    if model.kernel_backend == "triton" or model.attn_impl not in ("auto", "sdpa"):
        return f"kernel_backend={model.kernel_backend!r}, attn_impl={model.attn_impl!r} asked for"
    if model.dtype != torch.float32 or cache.k[0].dtype != torch.float32:
        return "not float32"
    if dc.block != "pre_norm":
        return f"{dc.block} blocks"
    if dc.full_attention_layers:
        return "a sliding window on some layers only"
    if dc.attention.softcap is not None or dc.final_logit_softcap is not None:
        return "soft-capped attention scores or logits"
    dropout = (dc.embed_dropout_p, dc.residual_dropout_p, dc.attention.dropout_p, dc.mlp.dropout_p)
    if model.training and any(dropout):
        return "dropout in training mode"
    if type(cache) is not KVCache:
        return f"a {type(cache).__name__}"
    for block in model.blocks:
        if (type(block) is not PreNormBlock or type(block.attn) is not Attention or type(block.mlp) not in (GatedMLP, MLP)
                or type(block.norm1) is not Norm or type(block.norm2) is not Norm):
            return "a block of other modules"
        # The step reads these layers' weights: a wrapper in their place (PEFT's LoRA layers are not nn.Linear
        # subclasses, and forward .weight to the base layer) must run its own forward.
        if not all(plain_linear(layer) for layer in (block.attn.qkv, block.attn.out_proj, *block.mlp.children())):
            return "adapted layers (LoRA and the like keep their own forward)"
    if model.adapted_head() or type(model.embed.tokens) not in (nn.Embedding, ScaledEmbedding):
        return "an adapted LM head or token table (LoRA and the like keep their own forward)"
    if model.embed.token_types is not None:
        return "token type embeddings"
    for module in model.modules():  # one pass: this runs at every generate's start
        if _hooked(module):
            return "forward hooks, which the step would not call"
        if (isinstance(module, nn.Linear) and not plain_linear(module)) or (
                isinstance(module, nn.Embedding) and type(module) not in (nn.Embedding, ScaledEmbedding)):
            return "adapted layers (LoRA and the like keep their own forward)"
        if any(p.dtype != torch.float32 for p in module._parameters.values() if p is not None):
            return "not float32"
    return None


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool

    zero_centered: bool = False  # the norm scales by 1 + weight (Gemma)

    @classmethod
    def of(cls, norm: Norm) -> "_Norm":
        return cls(norm.weight, norm.bias, norm.eps, norm.kind == "rms_norm", norm.zero_centered)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1.0 if self.zero_centered else self.weight  # (float32: the step runs float32 only)
        if self.rms:
            y = F.rms_norm(x, weight.shape, weight, self.eps)
            return y if self.bias is None else y + self.bias
        return F.layer_norm(x, weight.shape, weight, self.bias, self.eps)


def _version(weight: torch.Tensor) -> int:
    """The in-place update count of ``weight``; an inference tensor (made under torch.inference_mode) keeps none,
    and being read-only outside inference mode, counts as never updated."""
    return -1 if weight.is_inference() else weight._version


def _copy_budget() -> int:
    """Bytes the transposed copies may take: an eighth of the machine's memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (AttributeError, ValueError, OSError):
        return 0


class TransposedWeights:
    """Each weight (out, in) as (in, out) for ``x @ weight_t``: a contiguous copy, made on first use and made again
    when the weight changes (replaced by another tensor, or updated in place: its version counter moves, as an
    optimizer step or ``load_state_dict`` moves it), when all the copies together fit in ``_copy_budget()``;
    else the weight's own transposed view (no memory, the slower kernel)."""

    def __init__(self):
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def refreshed(self, weights: list[torch.Tensor]) -> "TransposedWeights":
        """The (in, out) forms of exactly ``weights``: current copies kept, stale or unused ones dropped."""
        fresh = TransposedWeights()
        copy = sum(w.numel() * w.element_size() for w in {id(w): w for w in weights}.values()) <= _copy_budget()
        for w in weights:
            entry = self._copies.get(id(w))
            if entry is None or entry[0] is not w or entry[1] != _version(w) or entry[2].is_contiguous() != copy:
                entry = (w, _version(w), w.detach().t().contiguous() if copy else w.detach().t())
            fresh._copies[id(w)] = entry
        return fresh

    def __getitem__(self, weight: torch.Tensor) -> torch.Tensor:
        return self._copies[id(weight)][2]


# model -> its TransposedWeights, for as long as the model lives
_TRANSPOSED: "weakref.WeakKeyDictionary[nn.Module, TransposedWeights]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Layer:
    norm1: _Norm
    qkv: "_Projection"
    q_norm: _Norm | None
    k_norm: _Norm | None
    out: "_Projection"
    scale: float
    norm2: _Norm
    up: "_Projection"  # [gate; up] for a gated MLP, fc1 for a plain one
    down: "_Projection"
    gated: bool

    @classmethod
    def of(cls, block: PreNormBlock, transposed: TransposedWeights) -> "_Layer":
        attn, mlp = block.attn, block.mlp
        gated = isinstance(mlp, GatedMLP)
        up, down = (mlp.gate_up, mlp.down) if gated else (mlp.fc1, mlp.fc2)
        return cls(
            norm1=_Norm.of(block.norm1), qkv=_Projection.of(attn.qkv, transposed),
            q_norm=_Norm.of(attn.q_norm) if attn.q_norm is not None else None,
            k_norm=_Norm.of(attn.k_norm) if attn.k_norm is not None else None, out=_Projection.of(attn.out_proj, transposed),
            scale=attn.softmax_scale, norm2=_Norm.of(block.norm2), up=_Projection.of(up, transposed),
            down=_Projection.of(down, transposed), gated=gated,
        )


@dataclass(frozen=True)
class _Projection:
    """A linear layer's bias and the transposed copy of its weight (in, out)."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, layer: nn.Linear, transposed: TransposedWeights) -> "_Projection":
        return cls(transposed[layer.weight], layer.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out)."""
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h): one addmm when there is no bias (the residual is the GEMM's accumulator)."""
        return torch.addmm(x, h, self.weight_t) if self.bias is None else x + self(h)


def _transposed_weights(model) -> TransposedWeights:
    """The (in, out) forms of every projection's weight of ``model``, made or refreshed now."""
    projections = [layer for block in model.blocks for layer in (block.attn.qkv, block.attn.out_proj, *block.mlp.children())]
    projections += [layer for layer in (model.embed.project_in, model.project_out) if layer is not None]
    transposed = _TRANSPOSED.get(model, TransposedWeights()).refreshed(
        [layer.weight for layer in projections] + [model.output_embeddings()])
    _TRANSPOSED[model] = transposed
    return transposed


def prepare_lean_step(model) -> bool:
    """Make the lean step's weight copies now, where it will run ``model``'s generation (a CLI calls it while it
    loads, so that the first answer does not wait for them); whether it will."""
    with torch.no_grad():
        if lean_step_unsupported(model, model.new_kv_cache(1, 1)) is not None:
            return False
        _transposed_weights(model)
    return True


class LeanCpuStep:
    """``model.decode_step`` for the models ``lean_step_unsupported`` accepts: called as
    ``step(tokens (B, S), cache, rope_tables) -> logits (B, V)`` of each row's last token, the cache advanced
    by S tokens per row, after the caller reserved the room (``cache.reserve(S)``) as it does for
    ``decode_step``. S is 1 (a decode step; rows may hold different lengths), or any length going into an empty
    cache (a prefill of unpadded prompts, whose first token is a user's wait).

    It holds the model's modules, and transposed copies of their weights kept in step with them."""

    def __init__(self, model, cache: KVCache):
        dc = model.decoder_config
        att = dc.attention
        self.model, self.cache = model, cache
        transposed = _transposed_weights(model)
        self.layers = [_Layer.of(block, transposed) for block in model.blocks]
        self.project_in = _Projection.of(model.embed.project_in, transposed) if model.embed.project_in is not None else None
        self.project_out = _Projection.of(model.project_out, transposed) if model.project_out is not None else None
        head_bias = model.lm_head.bias
        self.head = _Projection(transposed[model.output_embeddings()], head_bias)
        self.hq, self.hkv, self.head_dim = att.num_heads, att.num_kv_heads, att.head_dim
        self.window = att.sliding_window
        self.act = functools.partial(activation, name=dc.mlp.activation, backend="reference")
        self.norm_f = _Norm.of(model.norm_f)
        self.vocab = dc.vocab_size
        rope = dc.rope
        self.rotary_dim = rope.rotary_dim if rope is not None else 0
        self.interleaved = rope is not None and rope.interleaved
        self.row_offsets = torch.arange(cache.batch_size) * cache.max_len  # each row's first slot, cache flattened

    def __call__(self, tokens: torch.Tensor, cache: KVCache, rope_tables) -> torch.Tensor:
        B, S = tokens.shape
        assert cache is self.cache and B == cache.batch_size, "tokens (B, S) for the step's own cache"
        lengths = cache.seqlens.tolist()  # a CPU tensor: no device to wait for
        assert S == 1 or max(lengths) == 0, "several tokens a row go into an empty cache only (a prefill)"
        # Each new token's position is its slot: the cache holds real tokens only.
        positions = cache.seqlens.long()[:, None] + torch.arange(S)  # (B, S)
        if S == 1:
            keys, mask = self._keys(lengths, positions[:, 0])
            write_at = self.row_offsets + positions[:, 0]  # (B,) into a layer's cache viewed as (B * max_len, Hkv, D)
            rotation = self._rotation(positions[:, 0], rope_tables) if rope_tables is not None else None
        else:
            mask = self._prefill_mask(S)
        model = self.model
        embed = model.embed
        x = F.embedding(tokens.reshape(-1), embed.tokens.weight)  # (B * S, token_dim)
        if isinstance(embed.tokens, ScaledEmbedding):
            x = x * embed.tokens.scale_in(x.dtype)
        if self.project_in is not None:
            x = self.project_in(x)
        if embed.positions is not None:
            x = x + F.embedding(positions.reshape(-1) + embed.position_offset, embed.positions.weight)
        hq, hkv, D = self.hq, self.hkv, self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.norm1(x)).view(B, S, hq + 2 * hkv, D)
            qk, v = qkv[:, :, : hq + hkv], qkv[:, :, hq + hkv:]
            if layer.q_norm is not None:
                qk = torch.cat((layer.q_norm(qk[:, :, :hq]), layer.k_norm(qk[:, :, hq:])), dim=2)
            k_cache, v_cache = cache.k[i], cache.v[i]
            if S == 1:
                if rotation is not None:  # (B, Hq + Hkv, D) @ (B, D, D): q and k heads rotated at once
                    qk = torch.matmul(qk.view(B, hq + hkv, D), rotation).view(B, 1, hq + hkv, D)
                k_cache.view(-1, hkv, D).index_copy_(0, write_at, qk[:, 0, hq:])
                v_cache.view(-1, hkv, D).index_copy_(0, write_at, v[:, 0])
                q, k, v = qk[:, :, :hq], k_cache[:, keys], v_cache[:, keys]
            else:
                if rope_tables is not None:
                    cos, sin = rope_tables
                    qk = apply_rotary_ref(qk, cos, sin, interleaved=self.interleaved, position_ids=positions)
                k_cache[:, :S] = qk[:, :, hq:]
                v_cache[:, :S] = v
                q, k = qk[:, :, :hq], qk[:, :, hq:]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=layer.scale,
                is_causal=S > 1 and mask is None, enable_gqa=hq != hkv,
            )  # (B, Hq, S, D)
            x = layer.out.add_to(x, out.transpose(1, 2).reshape(B * S, hq * D))
            h = layer.up(layer.norm2(x))
            if layer.gated:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            x = layer.down.add_to(x, h)
        cache.seqlens.add_(S)
        x = self.norm_f(x.view(B, S, -1)[:, -1])
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.head(x)
        return logits if logits.shape[-1] == self.vocab else logits[:, : self.vocab]

    def _prefill_mask(self, S: int) -> torch.Tensor | None:
        """None (causal attention says it all), or with a sliding window shorter than the prompt the (S, S)
        causal mask that keeps each query's last W keys."""
        if self.window is None or self.window >= S:
            return None
        q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
        return (k <= q) & (q - k < self.window)

    def _keys(self, lengths: list[int], positions: torch.Tensor) -> tuple[slice, torch.Tensor | None]:
        """The cache slots every row reads (a slice shared by all rows) and, where rows differ in length, the
        boolean mask (B, 1, 1, keys) of each row's own keys; with a sliding window, only the last W keys."""
        end = max(lengths) + 1
        start = max(0, min(lengths) + 1 - self.window) if self.window is not None else 0  # the shortest row's window
        if min(lengths) == max(lengths):
            return slice(start, end), None
        slots = torch.arange(start, end)
        allowed = slots <= positions[:, None]  # (B, keys): a row's keys are its own tokens and the new one
        if self.window is not None:
            allowed &= positions[:, None] - slots < self.window
        return slice(start, end), allowed[:, None, None, :]

    def _rotation(self, positions: torch.Tensor, rope_tables) -> torch.Tensor:
        """(B, D, D) with ``x @ R`` the rotary embedding of the row vectors x (heads, D) at each row's position:
        each rotated pair (i, j) gets [[c, s], [-s, c]], channels past ``rotary_dim`` pass through."""
        cos, sin = rope_tables
        c, s = cos[positions], sin[positions]  # (B, rotary_dim // 2)
        D, half = self.head_dim, self.rotary_dim // 2
        pairs = torch.arange(half)
        first, second = (2 * pairs, 2 * pairs + 1) if self.interleaved else (pairs, pairs + half)
        R = torch.eye(D).repeat(len(positions), 1, 1)
        R[:, first, first] = c
        R[:, second, second] = c
        R[:, first, second] = s
        R[:, second, first] = -s
        return R

"""nn.Modules shared by every family; each picks its kernel backend from flash_kernels."""

from .attention import Attention, build_attention_mask
from .block import ParallelBlock, PostNormBlock, PreNormBlock, SandwichBlock
from .embedding import Embeddings
from .kv_cache import KVCache
from .mlp import MLP, GatedMLP, build_mlp
from .norm import Norm, dual_norm
from .rotary import RotaryEmbedding

__all__ = [
    "MLP", "Attention", "Embeddings", "GatedMLP", "KVCache", "Norm", "ParallelBlock", "PostNormBlock", "PreNormBlock", "SandwichBlock", "RotaryEmbedding",
    "build_attention_mask", "build_mlp", "dual_norm",
]

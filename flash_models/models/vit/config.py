"""The Vision Transformer's typed config. One config covers both sources: HF's ViT is the timm options
class_token=True, global_pool="token", no pre-norm, no fc_norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...config import check_choice
from ..family import hf_class
from ..losses import PROBLEM_TYPES

if TYPE_CHECKING:
    import transformers

GLOBAL_POOLS = ("token", "avg", "max", "avgmax", "")
ARCHITECTURES = (None, "ViTModel", "ViTForImageClassification")  # None: built from timm


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    patch_bias: bool = True  # timm drops the patch projection's bias when pre_norm is on
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False  # timm: position embeddings only on patches, not on prefix tokens
    pre_norm: bool = False
    final_norm: bool = True
    fc_norm: bool | None = None  # timm: None = norm after pooling for avg/max pools
    global_pool: str = "token"
    num_classes: int = 1000  # 0: no head
    pooler: bool = False  # HF ViTModel's dense + tanh on the class token
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    architecture: str | None = None
    labels: tuple[str, ...] = ()  # HF id2label, in id order
    problem_type: str | None = None  # HF's: which loss labels get (losses.classification_loss)
    encoder_stride: int = 16  # HF field kept for the round trip (masked image modeling only)

    model_type = "vit"
    hf_config_class = "ViTConfig"

    def __post_init__(self):
        check_choice("global_pool", self.global_pool, GLOBAL_POOLS)
        check_choice("architecture", self.architecture, ARCHITECTURES)
        check_choice("problem_type", self.problem_type, PROBLEM_TYPES)
        if self.patch_size > self.image_size:
            raise ValueError(f"patch_size {self.patch_size} is larger than image_size {self.image_size}")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs a class token")

    @property
    def use_fc_norm(self) -> bool:
        return self.global_pool in ("avg", "max", "avgmax") if self.fc_norm is None else self.fc_norm

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.reg_tokens

    @property
    def num_patches(self) -> int:
        """Whole patches per image: as the strided convolution of HF and timm, the last image_size % patch_size
        rows and columns are left out."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, hf: transformers.ViTConfig) -> ViTConfig:
        architecture = hf.architectures[0] if hf.architectures else "ViTModel"
        if architecture not in ARCHITECTURES:
            raise ValueError(f"ViT architecture {architecture!r} is not supported; supported: {ARCHITECTURES[1:]}")
        if hf.pooler_act != "tanh" or hf.pooler_output_size != hf.hidden_size:
            raise ValueError(f"ViT pooler_act={hf.pooler_act!r} with pooler_output_size={hf.pooler_output_size} is not "
                             f"supported: only HF's default, 'tanh' over hidden_size ({hf.hidden_size}) outputs")
        for name in ("image_size", "patch_size"):
            if not isinstance(getattr(hf, name), int):
                raise ValueError(f"ViT with a non-square {name} {getattr(hf, name)} is not supported")
        classify = architecture == "ViTForImageClassification"
        return cls(
            image_size=hf.image_size, patch_size=hf.patch_size, num_channels=hf.num_channels, hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            intermediate_size=hf.intermediate_size, hidden_act=hf.hidden_act, layer_norm_eps=hf.layer_norm_eps,
            qkv_bias=hf.qkv_bias, num_classes=hf.num_labels if classify else 0, pooler=not classify,
            hidden_dropout_prob=hf.hidden_dropout_prob, attention_probs_dropout_prob=hf.attention_probs_dropout_prob,
            initializer_range=hf.initializer_range, architecture=architecture, encoder_stride=hf.encoder_stride,
            labels=tuple(hf.id2label[i] for i in range(hf.num_labels)), problem_type=hf.problem_type,
        )

    def to_hf(self) -> transformers.ViTConfig:
        hf_shaped = (self.class_token and self.patch_bias and not self.reg_tokens and not self.no_embed_class and not self.pre_norm
                     and self.final_norm and not self.use_fc_norm and self.global_pool == "token")
        if not hf_shaped or (self.num_classes and self.pooler):
            raise ValueError("this ViT (timm options: registers, avg/max pooling, fc_norm, pre-norm ...) has no HF "
                             "ViT layout to save to; save its state_dict instead")
        labels = self.labels or tuple(f"LABEL_{i}" for i in range(self.num_classes or 2))
        hf = hf_class(self.hf_config_class)(
            image_size=self.image_size, patch_size=self.patch_size, num_channels=self.num_channels,
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, layer_norm_eps=self.layer_norm_eps, qkv_bias=self.qkv_bias,
            hidden_dropout_prob=self.hidden_dropout_prob, attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            initializer_range=self.initializer_range, encoder_stride=self.encoder_stride, id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)}, problem_type=self.problem_type,
        )
        hf.architectures = ["ViTForImageClassification" if self.num_classes else "ViTModel"]
        return hf

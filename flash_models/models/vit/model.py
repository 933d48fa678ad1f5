"""The Vision Transformer (HF ``model_type`` "vit", and timm's ``VisionTransformer``): patch embedding, class (and
register) tokens, learned position embedding, pre-norm blocks on the shared modules, pooling and a head.

One config covers both sources: HF's ViT is the timm options class_token=True, global_pool="token", no
pre-norm, no fc_norm. ``checkpoint.timm.vit_config_from_timm`` reads a timm model and raises for options we do
not build (LayerScale, qk-norm, attention pooling, stochastic depth, other norms or activations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import AttentionConfig, MLPConfig, head_dim_of
from ...modules import MLP, Attention, Norm, PreNormBlock, build_attention_mask
from ...runtime.cuda_graphs import GraphedInference, replays_graph
from ..hf_protocol import public_forward
from ..losses import classification_loss, cross_entropy
from ..outputs import VisionOutput
from ..pretrained import PretrainedModel
from .config import ViTConfig


class PatchTokens(nn.Module):
    """The patch tokens (B, N, D) handed on unchanged, as a module call: forward hooks on a model's input
    embeddings then see them, as they see the output of HF's ``ViTPatchEmbeddings``. No parameters (the patch
    embedding's weight stays ``patch_embed``, whose GEMM ``_patchify`` runs)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


class VisionTransformer(PretrainedModel):
    main_input_name = "pixel_values"

    def __init__(self, config: ViTConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto"):
        super().__init__()
        self._setup(config, attn_impl, kernel_backend)
        c = config
        d = c.hidden_size

        def norm() -> Norm:
            return Norm(d, kind="layer_norm", eps=c.layer_norm_eps, kernel_backend=kernel_backend)

        self.patch_embed = nn.Conv2d(c.num_channels, d, c.patch_size, stride=c.patch_size, bias=c.patch_bias)
        self.patch_tokens = PatchTokens()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if c.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, d)) if c.reg_tokens else None
        embedded = c.num_patches + (0 if c.no_embed_class else c.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, embedded, d))
        self.norm_pre = norm() if c.pre_norm else None
        attn = AttentionConfig(hidden_size=d, num_heads=c.num_attention_heads, num_kv_heads=c.num_attention_heads,
                               head_dim=head_dim_of(d, c.num_attention_heads), qkv_bias=c.qkv_bias,
                               dropout_p=c.attention_probs_dropout_prob, causal=False)
        mlp = MLPConfig(hidden_size=d, intermediate_size=c.intermediate_size, activation=c.hidden_act)
        self.blocks = nn.ModuleList(
            PreNormBlock(norm1=norm(), attn=Attention(attn, layer_idx=i, attn_impl=attn_impl, kernel_backend=kernel_backend),
                         norm2=norm(),
                         mlp=MLP(mlp, kernel_backend=kernel_backend), input_dropout_p=c.hidden_dropout_prob,
                         residual_dropout_p=c.hidden_dropout_prob)
            for i in range(c.num_hidden_layers)
        )
        self.norm = norm() if c.final_norm and not c.use_fc_norm else None
        self.fc_norm = norm() if c.final_norm and c.use_fc_norm else None
        self.pooler = nn.Linear(d, d) if c.pooler else None
        self.head = nn.Linear(d, c.num_classes) if c.num_classes else None
        self.graphed: GraphedInference | None = None  # set by use_cuda_graphs()
        self.init_weights()

    def get_input_embeddings(self) -> PatchTokens:
        """What HF's ViT returns here (its ``ViTPatchEmbeddings``): the module whose output is the patch tokens, where
        transformers.Trainer's NEFTune adds its noise and ``enable_input_require_grads`` hooks."""
        return self.patch_tokens

    def no_weight_decay(self) -> set[str]:
        """timm's convention: the learned tokens and position table are not decayed (an embedding, not a weight)."""
        return {"cls_token", "reg_token", "pos_embed"}

    def init_weights(self) -> None:
        """timm/HF practice: truncated normal (std initializer_range) for linears, the patch conv, the tokens and
        position table; zero biases; unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            if isinstance(module, Norm):
                module.reset_parameters()
        for param in (self.cls_token, self.reg_token, self.pos_embed):
            if param is not None:
                nn.init.trunc_normal_(param, std=std)

    @public_forward
    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, *,
                interpolate_pos_encoding: bool = False) -> VisionOutput:
        """pixel_values (B, C, H, W) at the config's image size; labels for ``loss``.

        ``interpolate_pos_encoding=True`` (HF's argument) takes other sizes, square or not, of at least one patch:
        the learned position table is resized to the image's grid of whole patches, bicubic as HF's ViT does
        (an image with the config's grid keeps the table as is)."""
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1] != c.num_channels:
            raise ValueError(f"pixel_values must be a batch of channels-first images (B, {c.num_channels}, H, W), got "
                             f"{tuple(pixel_values.shape)}: add the batch dimension, or move channels first "
                             "(images.permute(0, 3, 1, 2)), as the model's image processor does")
        size = tuple(pixel_values.shape[2:]) if interpolate_pos_encoding else (c.image_size,) * 2
        if tuple(pixel_values.shape[2:]) != size or min(size) < c.patch_size:
            raise ValueError(f"pixel_values must be (B, {c.num_channels}, {c.image_size}, {c.image_size}), got "
                             f"{tuple(pixel_values.shape)}; another size of at least one {c.patch_size}-pixel patch "
                             "needs interpolate_pos_encoding=True")
        if labels is not None and self.head is None:
            raise ValueError("labels given, but this ViT has no classification head (num_classes=0)")
        grid = (size[0] // c.patch_size, size[1] // c.patch_size)
        if grid != (c.image_size // c.patch_size,) * 2:
            logits, hidden, pooled = self._encode(pixel_values, self._position_table(grid))
        elif replays_graph(self, self.graphed, pixel_values):
            logits, hidden, pooled = self.graphed(pixel_values)
        else:
            logits, hidden, pooled = self._encode(pixel_values)
        loss = None if labels is None else self.loss(logits, labels)
        return VisionOutput(logits=logits, loss=loss, last_hidden_state=hidden, pooler_output=pooled)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """An HF checkpoint's head follows HF's rule (its ``problem_type``, else regression for one label,
        single-label for integer labels, multi-label for float ones). A timm model takes class ids (B,) or
        class probabilities (B, classes), as timm's training recipes (mixup) give: cross-entropy either way."""
        if self.config.architecture is None:
            if labels.is_floating_point():
                return F.cross_entropy(logits.float(), labels)
            return cross_entropy(logits, labels)
        return classification_loss(logits, labels, problem_type=self.config.problem_type)

    def use_cuda_graphs(self, enabled: bool = True, *, max_graphs: int = 8) -> VisionTransformer:
        """Run eval-mode forwards without autograd (``torch.inference_mode()`` or ``no_grad``) on CUDA from CUDA
        graphs, one per input shape and dtype (``runtime.cuda_graphs``); the first batch of a new shape
        captures its graph. Training forwards and CPU inputs stay eager. Graphs read the weights where they
        were at capture; moving the model (``.to``, ``.half``) drops them, to be captured again. Returns the model."""
        self.graphed = GraphedInference(self._encode, self, max_graphs=max_graphs) if enabled else None
        return self

    def _patchify(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The patch embedding, ``patch_embed`` (a Conv2d whose kernel is its stride) as what it is: one GEMM of
        the flattened (channel, row, column) patches against the flattened kernel, (B, C, H, W) -> (B, N, D).
        Why not the Conv2d: cuDNN runs it as an implicit-GEMM convolution plus layout conversions of the input
        and output, 1.06 ms of a ViT-B/16 batch of 128's 10.8 ms of kernels on an H200 (docs/benchmarks.md);
        the patch copy and the GEMM take a fraction of that. Same sums in another order."""
        conv, p = self.patch_embed, self.config.patch_size
        B, C, H, W = pixel_values.shape
        rows, cols = H // p, W // p
        pixels = pixel_values[:, :, : rows * p, : cols * p]  # what the convolution's stride reaches
        patches = (pixels.to(conv.weight.dtype).reshape(B, C, rows, p, cols, p)
                   .permute(0, 2, 4, 1, 3, 5).reshape(B, rows * cols, C * p * p))
        return F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)

    def _position_table(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position table for a (rows, columns) patch grid other than the config's: the patches' part resized
        bicubic in float32, as HF's ``interpolate_pos_encoding``; the prefix tokens' positions (if embedded) kept."""
        side = self.config.image_size // self.config.patch_size
        prefix = self.pos_embed.shape[1] - side * side
        tokens, patches = self.pos_embed[:, :prefix], self.pos_embed[:, prefix:]
        d = patches.shape[-1]
        square = patches.reshape(1, side, side, d).permute(0, 3, 1, 2).float()
        resized = F.interpolate(square, size=grid, mode="bicubic", align_corners=False).to(patches.dtype)
        return torch.cat([tokens, resized.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], d)], dim=1)

    def _encode(self, pixel_values: torch.Tensor, pos_embed: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(logits or None, last hidden state after the final norm, pooled features) of checked pixel values;
        ``pos_embed`` is the position table for an image of another grid than the config's."""
        c = self.config
        pos_embed = self.pos_embed if pos_embed is None else pos_embed
        x = self.patch_tokens(self._patchify(pixel_values))  # (B, N, D)
        B = x.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if c.no_embed_class:
            x = torch.cat([*prefix, x + pos_embed], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + pos_embed  # (B, prefix + N, D)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        mask = build_attention_mask(None, q_len=x.shape[1], past_len=0, causal=False, sliding_window=None)
        hidden, residual = x, None
        for block in self.blocks:
            hidden, residual = block(hidden, residual, mask=mask, position_ids=None)
        if self.norm is not None:
            x = self.norm(hidden, residual, dropout_p=c.hidden_dropout_prob)
        else:
            x = F.dropout(hidden, c.hidden_dropout_prob, self.training) + residual
        pooled = self.pool(x)
        if self.fc_norm is not None:
            pooled = self.fc_norm(pooled)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        logits = self.head(pooled) if self.head is not None else None
        return logits, x, pooled

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        kind, patches = self.config.global_pool, x[:, self.config.num_prefix_tokens:]
        if kind == "token":
            return x[:, 0]
        if kind == "avg":
            return patches.mean(1)
        if kind == "max":
            return patches.amax(1)
        if kind == "avgmax":
            return 0.5 * (patches.mean(1) + patches.amax(1))
        return x  # "": no pooling, the head sees every token

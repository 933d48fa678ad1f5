"""Feed-forward blocks: plain (fc1 -> activation -> fc2) and gated (packed [gate; up] -> SwiGLU/GeGLU -> down).

``recompute_activation`` chooses between keeping the activation for the backward and recomputing it there.

The plain MLP picks its kernels by what it can fuse: in inference fc1 and its activation are one Triton GEMM
(``flash_kernels.linear_act``); in training on CUDA, a tanh-GELU MLP (GPT-2, GPT-J) runs on ``fused_dense``'s
cuBLASLt epilogues (``fused_dense_gelu_dense``). cuBLASLt has no exact GELU, so BERT's, ViT's and Pythia's MLPs
train on cuBLAS GEMMs and a GELU kernel of its own, as OPT's ReLU MLP does (measured faster that way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels
from flash_kernels.linear_act import kernel_can_run as linear_act_can_run

from ..config import MLPConfig
from .linear import autocast_like, compute_dtype, plain_linear, routed_projection
from .recompute import NormedInput, activation_then_linear, projection_of

# HF activation name -> GELU approximation used by flash_kernels.
_GELU_APPROX = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# HF activation name -> flash_kernels.linear_act's activation (fc1 and its activation in one kernel).
_LINEAR_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# HF activation name -> flash_kernels.activation_backward's activation, for the gated MLPs' recomputing backward.
_GATED_GRAD = {"silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# The activations whose MLP trains on fused_dense's cuBLASLt epilogues: cuBLASLt's GELU is the tanh form, so
# GPT-2 and GPT-J, not the exact GELU of BERT, ViT and Pythia. OPT's ReLU has epilogues too (RELU_AUX_BIAS,
# DRELU), but its MLP measured slower on them than unfused (H100).
_CUBLASLT_GELU = ("gelu_new", "gelu_pytorch_tanh")


def activation(x: torch.Tensor, name: str, *, backend: str) -> torch.Tensor:
    if name in _GELU_APPROX:
        return flash_kernels.gelu(x, approximate=_GELU_APPROX[name], backend=backend)
    if name == "relu":
        return F.relu(x)
    return F.silu(x)


class MLP(nn.Module):
    # The activation is kept for the backward: these MLPs (GPT-2, BERT, ViT, OPT) have no memory pressure worth
    # an extra kernel per layer. Set it per module to trade the other way.
    recompute_activation = False
    # Whether the backward casts the float32 weights again under autocast rather than keep the forward's
    # copies (modules/linear.py); the LLaMA-style decoders turn it on.
    recompute_weight_casts = False

    def __init__(self, cfg: MLPConfig, *, kernel_backend: str = "auto"):
        super().__init__()
        self.cfg, self.kernel_backend = cfg, kernel_backend
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor, *, normed: NormedInput | None = None) -> torch.Tensor:
        """fc2(act(fc1(x))), on the fused kernels where they apply (see the module's docstring). ``normed``: x as
        a pre-norm block's norm made it, recomputed in the backward by fc1 (the cuBLASLt path keeps it)."""
        if self._inference_fusable(x):
            return self._inference_fused(x)
        if self._cublaslt_trainable(x):
            return self._cublaslt_fused(x)
        backend, recompute_weight_cast = self.kernel_backend, self.recompute_weight_casts
        pre = projection_of(x, self.fc1, normed=normed, backend=backend, recompute_weight_cast=recompute_weight_cast)
        return activation_then_linear(pre, self.act, self.fc2, backend=backend, recompute=self.recompute_activation,
                                      recompute_weight_cast=recompute_weight_cast)

    def _inference_fusable(self, x: torch.Tensor) -> bool:
        """Nothing records gradients, fc1 is a plain half-precision Linear in x's dtype (no autocast cast in
        between; float32 keeps torch's GEMM, whose default is not TF32), the activation is one linear_act has,
        with kernel_backend="triton" its kernel can take the input (a GPU without TMA or dims that are not
        multiples of 8 keep the unfused path: an optimization must not become an error), and no launch runtime
        routes fc1 to a kernel of its own (a decode step's GEMV in a chain of programmatic launches, see
        modules/linear.py: the GEMVs and our activation kernel take part in the chain, linear_act would not)."""
        return (not torch.is_grad_enabled() and self.cfg.activation in _LINEAR_ACT and plain_linear(self.fc1)
                and x.dtype in (torch.float16, torch.bfloat16) and x.dtype == self.fc1.weight.dtype
                and not torch.is_autocast_enabled(x.device.type)
                and (self.kernel_backend != "triton" or linear_act_can_run(x, self.fc1.weight, self.fc1.bias))
                and routed_projection(x, self.fc1.weight, self.kernel_backend) is None)

    def _inference_fused(self, x: torch.Tensor) -> torch.Tensor:
        """No backward to keep the pre-activation for: fc1, its bias and the activation in one kernel (one write
        of the widest tensor instead of a write, a read and a write)."""
        act = flash_kernels.linear_act(x, self.fc1.weight, self.fc1.bias, activation=_LINEAR_ACT[self.cfg.activation],
                                       backend=self.kernel_backend)
        return self.fc2(act)

    def _cublaslt_trainable(self, x: torch.Tensor) -> bool:
        """Whether the training forward runs on fused_dense_gelu_dense: autograd records, the activation is the
        tanh GELU, it and the weight casts are kept for the backward (not recomputed), both layers are plain with
        biases, kernel_backend is not "reference", no torch.compile trace (the compiler fuses by itself), and the
        extension can take the GEMMs in the compute dtype (CUDA, half precision, widths that are multiples of 8,
        built; a failed build warns once and trains unfused). Measured by `flash-models bench ops --only fused_dense`."""
        layers = (self.fc1, self.fc2)
        if not (x.is_cuda and torch.is_grad_enabled() and self.cfg.activation in _CUBLASLT_GELU
                and self.kernel_backend != "reference"
                and not (self.recompute_activation or self.recompute_weight_casts) and not torch.compiler.is_compiling()
                and all(plain_linear(layer) and layer.bias is not None for layer in layers)
                and (torch.is_autocast_enabled(x.device.type) or all(layer.weight.dtype == x.dtype for layer in layers))):
            return False
        # Imported here: the module marks a function for torch.compile, which imports torch._dynamo (a second
        # of a CPU program's start for a path only CUDA takes).
        from flash_kernels.fused_dense import gemm_unsupported, optional_extension

        return (gemm_unsupported(x, self.fc1.weight.shape, compute_dtype(x)) is None
                and optional_extension("a GELU MLP's training step", "it trains unfused") is not None)

    def _cublaslt_fused(self, x: torch.Tensor) -> torch.Tensor:
        """fc1 + bias + GELU and fc2 + bias on cuBLASLt's epilogues, and the backward's GELU gradient in the fc2
        dgrad GEMM's (DGELU): two elementwise passes over the widest tensor fewer (see fused_dense)."""
        h, *params = autocast_like(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        return flash_kernels.fused_dense_gelu_dense(h, *params, approximate="tanh", backend=self.kernel_backend)

    def act(self, pre: torch.Tensor) -> torch.Tensor:
        return activation(pre, self.cfg.activation, backend=self.kernel_backend)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one [gate; up] projection."""

    # LLaMA-style MLPs keep (N, 2 * intermediate) for the activation's backward already; keeping its
    # (N, intermediate) output as well is the largest saved tensor of the layer, so it is recomputed.
    recompute_activation = True
    recompute_weight_casts = False

    def __init__(self, cfg: MLPConfig, *, kernel_backend: str = "auto"):
        super().__init__()
        if cfg.activation == "relu":
            raise ValueError("activation function 'relu' (the config's hidden_act) in a gated MLP (ReGLU) is not "
                             "supported; a gated MLP takes silu (SwiGLU) or a gelu variant (GeGLU)")
        self.cfg, self.kernel_backend = cfg, kernel_backend
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor, *, normed: NormedInput | None = None) -> torch.Tensor:
        """``normed``: x as a pre-norm block's norm made it, recomputed in the backward (modules/recompute.py)."""
        gate_up = projection_of(x, self.gate_up, normed=normed, backend=self.kernel_backend,
                                recompute_weight_cast=self.recompute_weight_casts)  # (..., 2 * intermediate)
        return activation_then_linear(gate_up, self.act, self.down, backend=self.kernel_backend,
                                      recompute=self.recompute_activation, recompute_weight_cast=self.recompute_weight_casts,
                                      act_grad=self.act_grad)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "silu":
            return flash_kernels.swiglu(gate_up, backend=self.kernel_backend)
        return flash_kernels.geglu(gate_up, approximate=_GELU_APPROX[self.cfg.activation], backend=self.kernel_backend)

    def act_grad(self, gate_up: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate_up, act(gate_up)) for the output gradient ``dout``, in one pass (the recomputing backward's)."""
        return flash_kernels.activation_backward(gate_up, dout, activation=_GATED_GRAD[self.cfg.activation], gated=True,
                                                 backend=self.kernel_backend)


def build_mlp(cfg: MLPConfig, *, kernel_backend: str = "auto") -> nn.Module:
    return (GatedMLP if cfg.gated else MLP)(cfg, kernel_backend=kernel_backend)

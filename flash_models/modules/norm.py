"""LayerNorm / RMSNorm modules over the fused flash_kernels norm (dropout + residual add + norm)."""

from __future__ import annotations

import torch
from torch import nn

import flash_kernels


class Norm(nn.Module):
    """``forward(x, residual=None, prenorm=False)``: y = norm(dropout(x) + residual), and with ``prenorm`` the
    new residual stream as well, which is the ``(hidden, residual)`` block contract.

    ``zero_centered``: the weight is stored as its offset from one and the norm scales by ``1 + weight``, added
    in float32 (Gemma's RMSNorm): a fresh norm's weight is zeros, and checkpoints keep Gemma's values."""

    def __init__(self, dim: int, *, kind: str, eps: float, bias: bool = True, kernel_backend: str = "auto",
                 zero_centered: bool = False):
        super().__init__()
        if kind not in ("layer_norm", "rms_norm"):
            raise ValueError(f"norm kind {kind!r}; use 'layer_norm' or 'rms_norm'")
        self.kind, self.eps, self.kernel_backend, self.zero_centered = kind, eps, kernel_backend, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x, residual=None, *, prenorm: bool = False, dropout_p: float = 0.0, residual_in_fp32: bool = False):
        fn = flash_kernels.rms_norm if self.kind == "rms_norm" else flash_kernels.layer_norm
        return fn(
            x, self.weight, self.bias, residual=residual, eps=self.eps, dropout_p=dropout_p if self.training else 0.0,
            prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered,
            backend=self.kernel_backend,
        )

    def normalize_stream(self, stream: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The norm of an already summed residual stream, as ``forward(..., prenorm=True)`` output it: the fused
        kernel normalizes the stream as stored, so this gives the same bits from the stored stream."""
        fn = flash_kernels.rms_norm if self.kind == "rms_norm" else flash_kernels.layer_norm
        return fn(stream, self.weight, self.bias, eps=self.eps, out_dtype=out_dtype,
                  zero_centered_weight=self.zero_centered, backend=self.kernel_backend)

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        centered = ", zero_centered" if self.zero_centered else ""
        return f"{self.weight.shape[0]}, kind={self.kind}, eps={self.eps}{centered}"


def dual_norm(norm_a: Norm, norm_b: Norm, x, residual=None, *, dropout_p: float = 0.0, residual_in_fp32: bool = False):
    """``h = dropout(x) + residual`` normalized by two norms of the same kind in one fused kernel:
    returns (norm_a(h), norm_b(h), h). Parallel blocks with two norms (GPT-NeoX) use it."""
    assert (norm_a.kind, norm_a.eps, norm_a.zero_centered) == (norm_b.kind, norm_b.eps, norm_b.zero_centered), \
        "a dual norm needs two norms of one kind"
    fn = flash_kernels.rms_norm_dual if norm_a.kind == "rms_norm" else flash_kernels.layer_norm_dual
    return fn(
        x, norm_a.weight, norm_a.bias, norm_b.weight, norm_b.bias, residual=residual, eps=norm_a.eps,
        dropout_p=dropout_p if norm_a.training else 0.0, prenorm=True, residual_in_fp32=residual_in_fp32,
        zero_centered_weight=norm_a.zero_centered, backend=norm_a.kernel_backend,
    )

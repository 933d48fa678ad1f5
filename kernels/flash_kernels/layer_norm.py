"""LayerNorm and RMSNorm fused with dropout, residual add and row scaling.

One pass computes, per row:  h = dropout(x * rowscale) + residual;  y = norm(h) * weight + bias.
With ``prenorm=True`` the new residual stream ``h`` is returned too, which is what pre-norm blocks need:
the block contract ``(hidden, residual)`` from DESIGN.md maps straight onto this op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import use_triton


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    is_rms_norm: bool = False,
    upcast: bool = True,
):
    """Plain PyTorch reference. ``dropout_mask`` (bool, x's shape) replays a given mask; without one, a
    fresh mask is drawn when ``dropout_p > 0``. ``upcast`` computes in float32 (the kernels always do)."""
    dtype = x.dtype
    compute = torch.float32 if upcast else dtype
    h = x.to(compute)
    if rowscale is not None:
        h = h * rowscale.to(compute).unsqueeze(-1)
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand_like(h) >= dropout_p
        h = h * dropout_mask / (1.0 - dropout_p)
    if residual is not None:
        h = h + residual.to(compute)
    residual_out = h.to(torch.float32 if residual_in_fp32 else dtype)
    w = weight.to(compute) + 1.0 if zero_centered_weight else weight.to(compute)
    b = bias.to(compute) if bias is not None else None
    if is_rms_norm:
        rstd = torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps)
        y = h * rstd * w
        if b is not None:
            y = y + b
    else:
        y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    y = y.to(out_dtype or dtype)
    return (y, residual_out) if prenorm else y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs):
    return layer_norm_ref(x, weight, bias, is_rms_norm=True, **kwargs)


def _norm(
    x, weight, bias, *, is_rms_norm, residual, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
    zero_centered_weight, out_dtype, backend, op,
):
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{op}: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{op}: weight shape {tuple(weight.shape)} != normalized dim ({x.shape[-1]},)")
    use_triton(backend, x, op=op, unsupported=f"no Triton {op} kernel is built yet")
    return layer_norm_ref(
        x, weight, bias, residual=residual, eps=eps, dropout_p=dropout_p, rowscale=rowscale, prenorm=prenorm,
        residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight, out_dtype=out_dtype,
        is_rms_norm=is_rms_norm,
    )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
):
    """LayerNorm over the last dim, fused with dropout and residual add (see the module docstring)."""
    return _norm(
        x, weight, bias, is_rms_norm=False, residual=residual, eps=eps, dropout_p=dropout_p, rowscale=rowscale,
        prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight,
        out_dtype=out_dtype, backend=backend, op="layer_norm",
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
):
    """RMSNorm over the last dim, fused with dropout and residual add (see the module docstring)."""
    return _norm(
        x, weight, bias, is_rms_norm=True, residual=residual, eps=eps, dropout_p=dropout_p, rowscale=rowscale,
        prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight,
        out_dtype=out_dtype, backend=backend, op="rms_norm",
    )

"""Plain PyTorch LayerNorm / RMSNorm with the fused op's dropout, row scaling, residual add and prenorm
stream: the reference of ``layer_norm``'s kernels, what runs on the CPU, and the tests' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import compute_dtype


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
    fresh mask is drawn when ``dropout_p > 0``. ``upcast`` computes in float32 (the kernels always do; float64
    inputs stay float64)."""
    dtype = x.dtype
    compute = compute_dtype(dtype) if upcast else dtype
    h = x.to(compute)
    if rowscale is not None:
        h = h * rowscale.to(compute).unsqueeze(-1)
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand_like(h) >= dropout_p
        h = h * dropout_mask / (1.0 - dropout_p)
    if residual is not None:
        h = h + residual.to(compute)
    residual_out = h.to(torch.promote_types(torch.float32, dtype) if residual_in_fp32 else dtype)
    h = residual_out.to(compute)  # the norm reads the stream as stored (as the kernels do)
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




def layer_norm_dual_ref(
    x: torch.Tensor,
    weight0: torch.Tensor,
    bias0: torch.Tensor | None,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    prenorm: bool = False,
    **kwargs,
):
    """Reference for the dual norm: the same ``h`` (one dropout mask) normalized with two weight/bias sets."""
    if dropout_p > 0.0 and dropout_mask is None:
        dropout_mask = torch.rand(x.shape, device=x.device) >= dropout_p
    common = dict(dropout_p=dropout_p, dropout_mask=dropout_mask, **kwargs)
    out0 = layer_norm_ref(x, weight0, bias0, prenorm=prenorm, **common)
    y1 = layer_norm_ref(x, weight1, bias1, prenorm=False, **common)
    if prenorm:
        y0, residual_out = out0
        return y0, y1, residual_out
    return out0, y1

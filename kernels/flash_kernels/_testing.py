"""Test helpers shared by the kernel and model tests: dtype-aware tolerances and relative errors, and a spy on
the functions a module looks up on flash_kernels at each call."""

from __future__ import annotations

import torch

# Tolerances per dtype for an op compared against its float32/float64 reference. Low-precision kernels are
# judged by relative error of the whole tensor (||out - ref|| / ||ref||), which is robust to a few large
# elements, plus an elementwise bound for gross local errors.
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
ABS_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; 0 when both are zero."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0, name: str = "") -> None:
    """Assert ``out`` matches ``ref`` within the tolerance of ``dtype`` (times ``scale``), with no NaN/inf."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: output has NaN or inf"
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype] * scale, f"{name}: relative error {err:.3g} > {REL_TOL[dtype] * scale:.3g} ({dtype})"
    max_abs = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    ref_max = ref.double().abs().max().item() if ref.numel() else 0.0
    bound = ABS_TOL[dtype] * scale * max(1.0, ref_max)
    assert max_abs <= bound, f"{name}: max abs error {max_abs:.3g} > {bound:.3g} ({dtype})"


def assert_rounded_alike(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, name: str = "") -> None:
    """``out`` holds ``ref``'s own elements, bar a rare 1-ulp flip where float32 sums in another order land on
    a rounding boundary: that is what shows each rounding point sits where ref has it (a missed one, e.g. a
    fused epilogue that skips rounding what the unfused path stores, moves a quarter of the elements or more,
    too little for the tolerances to see). Nothing to check in float32, where rounding is a no-op and the sums
    differ in the last bits."""
    if dtype == torch.float32:
        return
    differ = (out != ref).float().mean().item()
    assert differ <= 0.05, f"{name}: {differ:.0%} of the elements differ from the unfused path's rounding ({dtype})"


def record_calls(monkeypatch, module, name: str, keyword: str) -> list:
    """Replace ``module.name`` (for the duration of a test) by a wrapper that appends each call's ``keyword``
    argument to the returned list and then calls through: which fused path a module took, and with what."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs[keyword])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls

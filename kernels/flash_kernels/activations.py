"""Gated and plain activations on the packed [gate; up] projection: SwiGLU, GeGLU, GELU (erf and tanh)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import use_triton

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r}; use one of {GELU_APPROXIMATIONS}")


def _split_gate_up(gate_up: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: the packed [gate; up] dim must be even, got {gate_up.shape[-1]}")
    return gate_up.chunk(2, dim=-1)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = _split_gate_up(gate_up, "swiglu")
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def geglu_ref(gate_up: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    gate, up = _split_gate_up(gate_up, "geglu")
    return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(gate_up.dtype)


def gelu_ref(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def swiglu(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up, with gate_up = [gate; up] packed on the last dim. Returns half the last dim."""
    use_triton(backend, gate_up, op="swiglu", unsupported="no Triton swiglu kernel is built yet")
    return swiglu_ref(gate_up)


def geglu(gate_up: torch.Tensor, *, approximate: str = "tanh", backend: str | None = None) -> torch.Tensor:
    """gelu(gate) * up, with gate_up = [gate; up] packed on the last dim. Returns half the last dim."""
    _check_approximate(approximate)
    use_triton(backend, gate_up, op="geglu", unsupported="no Triton geglu kernel is built yet")
    return geglu_ref(gate_up, approximate=approximate)


def gelu(x: torch.Tensor, *, approximate: str = "none", backend: str | None = None) -> torch.Tensor:
    """GELU, exact (erf) or tanh-approximated ("gelu_new" in HF)."""
    _check_approximate(approximate)
    use_triton(backend, x, op="gelu", unsupported="no Triton gelu kernel is built yet")
    return gelu_ref(x, approximate=approximate)

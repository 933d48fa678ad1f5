"""Single-instruction float32 math for the GPU kernels, with portable twins for Triton's interpreter.

``rcp.approx.ftz.f32`` and ``ex2.approx.ftz.f32`` are one MUFU instruction each. What Triton emits for
``tl.fdiv(1, x, ieee_rounding=False)`` and ``tl.math.exp2`` wraps the same instruction in range handling
(denormal inputs and results) that these kernels never need: their reciprocals are of numbers >= 1, and an
exp2 result below float32's normal range (2^-126) counts for nothing next to the values it is added to or
multiplies. The interpreter (how CI runs the kernels) cannot run inline PTX; kernels take a ``PTX`` constexpr
from ``ENABLED``, a module global so that a profile script can A/B the two forms in one process.

Not in the attention forward's softmax: its exp2 as ``ex2.approx.ftz.f32`` ran no faster (0.93-1.03x the
portable form's time over 8 training shapes, H200, session 15), so Triton's own lowering costs nothing there.
"""

from __future__ import annotations

from ._backend import triton_interpreter_enabled
from ._triton_compat import tl, triton

ENABLED = not triton_interpreter_enabled()


@triton.jit
def rcp(x, PTX: tl.constexpr):
    """1 / x to about one ulp."""
    if PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.fdiv(1.0, x, ieee_rounding=False)


@triton.jit
def exp2(x, PTX: tl.constexpr):
    """2^x; results below 2^-126 flush to 0 on the PTX form."""
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.math.exp2(x)

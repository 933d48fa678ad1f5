"""Single-instruction float32 math for the GPU kernels, with portable twins for Triton's interpreter.

``ex2.approx.ftz.f32`` is one MUFU instruction. What Triton emits for ``tl.math.exp2`` wraps the same
instruction in range handling (denormal inputs and results) that these kernels never need: an exp2 result
below float32's normal range (2^-126) counts for nothing next to the values it is added to or multiplies.
The interpreter (how CI runs the kernels) cannot run inline PTX; kernels take a ``PTX`` constexpr from
``ENABLED``, a module global so that a profile script can A/B the two forms in one process.

Not in the attention forward's softmax: its exp2 as ``ex2.approx.ftz.f32`` ran no faster over 8 training
shapes (H200), so Triton's own lowering costs nothing there.
"""

from __future__ import annotations

from ._backend import triton_interpreter_enabled
from ._triton_compat import tl, triton

ENABLED = not triton_interpreter_enabled()


@triton.jit
def exp2(x, PTX: tl.constexpr):
    """2^x; results below 2^-126 flush to 0 on the PTX form."""
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.math.exp2(x)

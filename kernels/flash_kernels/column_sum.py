"""Column sums of a (rows, N) matrix, accumulated in float32: a Linear layer's bias gradient.

torch reduces over the leading dim of a narrow matrix (16384 x 768, the bias gradient of GPT-2's output
projections) at about 0.8 TB/s on an H200: few columns leave its reduction little parallelism. Here a 2-D grid
of programs each sums a block of rows for a block of columns into a float32 partial, and one small second
launch sums the partials in order, so the result is deterministic and the first pass reads at copy speed.
The second pass (``sum_partials``) also serves the norm backward's weight-gradient partials.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._triton_compat import tl, triton
from ._triton_utils import eager_function, next_power_of_2, num_programs, pick

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_M, _MAX_BLOCK_N = 32, 128  # first pass: a (32, 128) tile per loop step
_SUM_BLOCK_P, _SUM_MAX_BLOCK_N, _SUM_MIN_BLOCK_N = 32, 64, 16  # second pass


def column_sum_ref(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch reference: the sum over every leading dim, accumulated in float32."""
    return x.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(dtype or x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _column_partials_kernel(X, P, M, N, stride_x, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P[pid_m, cols] = sum of X[rows of this program, cols], in float32."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = pid_m * rows_per_program
    end = tl.minimum(first + rows_per_program, M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        acc += tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(P + pid_m.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cols < N)


@triton.jit
def _sum_partials_kernel(P, OUT0, OUT1, OUT2, OUT3, programs, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """P (k, programs, N) -> column sums into OUT0..OUT(k-1), each (N,) in its own dtype; one program per
    (column block, buffer), rows in order, so the result is deterministic. Separate outputs, not rows of one
    tensor: custom-op outputs may not alias each other."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    buf = tl.program_id(1)
    base = P + buf.to(tl.int64) * programs * N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < programs) & (cols[None, :] < N)
        acc += tl.load(base + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    mask = cols < N
    if buf == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=mask)
    elif buf == 1:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=mask)
    elif buf == 2:
        tl.store(OUT2 + cols, total.to(OUT2.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT3 + cols, total.to(OUT3.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------


def sum_partials(partials: torch.Tensor, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """(k <= 4, programs, N) float32 -> k tensors (N,) of ``dtype``: the column sums of k partial buffers in
    one launch (torch's sum over dim 0 costs a launch each, and about 10 us per (512, 768) buffer on an H200)."""
    k, programs, n = partials.shape
    outs = [torch.empty(n, device=partials.device, dtype=dtype) for _ in range(k)]
    pointers = outs + [outs[0]] * (4 - k)  # unused slots: the grid never reaches them
    # Narrower column blocks until the grid covers every SM: the norm backward's (2, 1056, 768) partials
    # took 16 us on an H200 in 24 programs of 64 columns.
    block_n, sms = _SUM_MAX_BLOCK_N, num_programs(partials.device, per_sm=1)
    while block_n > _SUM_MIN_BLOCK_N and triton.cdiv(n, block_n) * k < sms:
        block_n //= 2
    _sum_partials_kernel[(triton.cdiv(n, block_n), k)](
        partials, *pointers, programs, n, BLOCK_P=_SUM_BLOCK_P, BLOCK_N=block_n, num_warps=4,
    )
    return outs


def _column_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (M, N) with a unit last stride -> (N,) of ``dtype``."""
    M, N = x.shape
    if M == 0 or N == 0:
        return torch.zeros(N, device=x.device, dtype=dtype)
    block_n = min(_MAX_BLOCK_N, next_power_of_2(N))
    column_blocks = triton.cdiv(N, block_n)
    # Enough programs to fill the GPU (about 8 per SM), each over a whole number of row tiles.
    row_programs = max(1, num_programs(x.device, per_sm=8) // column_blocks)
    rows_per_program = triton.cdiv(triton.cdiv(M, row_programs), _BLOCK_M) * _BLOCK_M
    row_programs = triton.cdiv(M, rows_per_program)
    partials = torch.empty((1, row_programs, N), device=x.device, dtype=torch.float32)
    _column_partials_kernel[(row_programs, column_blocks)](
        x, partials, M, N, x.stride(0), rows_per_program, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, num_warps=4,
    )
    return sum_partials(partials, dtype)[0]


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::column_sum", mutates_args=())
def _column_sum_op(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _column_sum(x, dtype)


@_column_sum_op.register_fake
def _(x, dtype):
    return x.new_empty((x.shape[1],), dtype=dtype)


def _column_sum_setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype


def _column_sum_backward(ctx, grad):
    return (None if grad is None else grad.to(ctx.x_dtype).expand(ctx.x_shape)), None


_column_sum_op.register_autograd(_column_sum_backward, setup_context=_column_sum_setup_context)
_column_sum_eager = eager_function("ColumnSum", _column_sum, _column_sum_setup_context, _column_sum_backward)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def column_sum(x: torch.Tensor, *, dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Sum of ``x`` (..., N) over every leading dim, accumulated in float32, returned as ``dtype`` (default
    x's). A Linear layer's bias gradient is ``column_sum(grad_output, dtype=bias.dtype)``."""
    if x.dim() == 0:
        raise ValueError("column_sum: x needs at least one dim, got a scalar")
    out_dtype = dtype or x.dtype
    unsupported = None
    if x.dtype not in _DTYPES or out_dtype not in _DTYPES:
        unsupported = f"dtype {x.dtype} -> {out_dtype} (supported: {_DTYPES})"
    if not use_triton(backend, x, op="column_sum", unsupported=unsupported):
        return column_sum_ref(x, dtype=out_dtype)
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return pick(_column_sum_op, _column_sum_eager)(rows, out_dtype)

"""One-row matrix-vector product for batch-1 decoding: ``y = x @ weight.T (+ bias)`` with x a single row.

At batch 1 a decoder step reads every weight once and does little else, so its projections are bound by
memory bandwidth. cuBLAS's GEMVs reach 83% of the copy bandwidth on LLaMA-1.1B's gate/up projection (46 MB)
but only 39% on qkv and o (10.5 and 8.4 MB) and 53% on down, with a split-K reduction kernel after it
(docs/benchmarks.md, Generation, session 6). This kernel splits the output rows over the programs and runs
the whole reduction over K inside each, in float32, so there is one launch and no partial sums; the tile
shape is autotuned per (N, K).

Backends: "triton" runs the kernel (inference only: it has no backward, and refuses inputs that need one);
"reference" is ``F.linear``; "auto" is ``F.linear`` too until a GPU run shows this kernel ahead of cuBLAS
(``scripts/profile/gemv_sweep.py`` measures both at LLaMA-1.1B's shapes; not yet run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autotune_cache import cached_autotune
from ._backend import check_backend_name, triton_interpreter_enabled, use_triton
from ._triton_compat import tl, triton
from ._triton_utils import cdiv, dummy_pointer, pick

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _configs():
    """(BLOCK_N, BLOCK_K, warps, stages) candidates: few output rows per program so that even N = 2048 spreads
    over every SM, long K tiles so each row is read in wide, coalesced pieces. The interpreter gets one small
    tile so test shapes cross several row blocks and K tiles."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    shapes = [(8, 256, 4, 3), (16, 256, 4, 3), (4, 512, 4, 3), (8, 512, 8, 3), (16, 128, 4, 4), (32, 256, 8, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


@cached_autotune
@triton.autotune(configs=_configs(), key=["N", "K"])
@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    row_offsets = rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_in = cols < K
        x = tl.load(X + cols, mask=col_in, other=0.0).to(tl.float32)
        w = tl.load(W + row_offsets + cols[None, :], mask=row_in[:, None] & col_in[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]  # summed over K once, after the loop
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_in, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_in)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    x1 = x.reshape(K)
    x1 = x1 if x1.stride(0) == 1 else x1.contiguous()
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    grid = lambda meta: (cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x1, weight, bias if bias is not None else dummy_pointer(x.device, x.dtype), y, N, K,
                       weight.stride(0), HAS_BIAS=bias is not None)
    return y.view(*x.shape[:-1], N)


# torch.compile traces the custom op as one opaque node; eager calls skip the dispatcher (``pick``).
@torch.library.custom_op("flash_kernels::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return pick(_gemv_op, _gemv)(x, weight, bias)


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (expected (N, "
                         f"{x.shape[-1]}))")
    if x.numel() != x.shape[-1]:
        raise ValueError(f"gemv: x must hold one row (batch-1 decoding), got shape {tuple(x.shape)}; use F.linear")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    if not (x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)):
        raise ValueError(f"gemv: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}"
                         f"{'' if bias is None else ', ' + str(bias.dtype)}")


def _unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if weight.stride(1) != 1:
        return "a weight whose rows are not contiguous"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return "an input that needs gradients (the kernel has no backward; run it under torch.no_grad)"
    return None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         backend: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a one-row x (..., K) with every leading dim 1 -> (..., N)."""
    _check(x, weight, bias)
    if check_backend_name(backend) == "auto" or not use_triton(
            backend, x, op="gemv", unsupported=_unsupported(x, weight, bias)):
        return gemv_ref(x, weight, bias)
    return pick(_gemv_op, _gemv)(x, weight, bias)

"""``embedding_layer_norm``: an encoder's input embedding (token + position + token type lookups, summed) and
its LayerNorm in one kernel, for inference.

Why: unfused, BERT's embedding is three gathers, two adds and the norm: five passes over (tokens, hidden)
between them. Here each program reads its token's three table rows and writes the normalized row once.

The sum rounds where the unfused path stores a tensor: (token + position) is rounded to the tables' dtype,
then (+ token type) again, then normalized in float32 exactly as ``layer_norm``'s kernel does (same block and
warps), so the result equals ``layer_norm(tok + pos + type)`` bit for bit on the GPU.

Inference only: there is no backward (the module keeps the unfused path when anything records gradients).
Every index is checked against its table here (asynchronously on CUDA, see ``check_ids_in_range``): a
gather kernel of our own must never read out of bounds, where ``F.embedding`` would have asserted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import check_ids_in_range, needs_grad_reason, use_triton
from ._launch import lean_launch
from ._triton_compat import tl, triton
from ._triton_utils import or_dummy, unit_last_stride
from .layer_norm import _fwd_plan
from .layer_norm_kernels import _store_affine
from .layer_norm_ref import layer_norm_ref

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def embedding_layer_norm_ref(input_ids, token_table, weight, bias=None, *, position_ids=None, position_table=None,
                             position_offset=0, token_type_ids=None, type_table=None, eps=1e-5):
    """The unfused path: the lookups summed in the tables' dtype (token + position, then + type), then LayerNorm
    computed in float32 and rounded to that dtype."""
    h = F.embedding(input_ids, token_table)
    if position_table is not None:
        h = h + F.embedding(position_ids + position_offset if position_offset else position_ids, position_table)
    if type_table is not None:
        h = h + F.embedding(token_type_ids, type_table)
    return layer_norm_ref(h, weight, bias, eps=eps)


@triton.jit
def _add_row(h, TABLE, INDEX, offset, row, stride, cols, mask):
    """h + TABLE[INDEX[row] + offset], rounded to the table's dtype as a stored sum would be."""
    index = tl.load(INDEX + row).to(tl.int64) + offset
    other = tl.load(TABLE + index * stride + cols, mask=mask, other=0.0)
    return (h.to(tl.float32) + other.to(tl.float32)).to(TABLE.dtype.element_ty)


@lean_launch
@triton.jit
def _embedding_norm_kernel(
    IDS, TOKENS, POS_IDS, POSITIONS, TYPE_IDS, TYPES, W, B, Y,
    stride_tokens, stride_positions, stride_types, stride_y, position_offset, N, eps,
    HAS_POSITIONS: tl.constexpr, HAS_TYPES: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    token = tl.load(IDS + row).to(tl.int64)
    h = tl.load(TOKENS + token * stride_tokens + cols, mask=mask, other=0.0)
    if HAS_POSITIONS:
        h = _add_row(h, POSITIONS, POS_IDS, position_offset, row, stride_positions, cols, mask)
    if HAS_TYPES:
        h = _add_row(h, TYPES, TYPE_IDS, 0, row, stride_types, cols, mask)
    # layer_norm's single-block forward, step for step (its kernel's reduction order, hence its bits)
    h = h.to(tl.float32)
    mean = tl.sum(h, axis=0) / N
    d = tl.where(mask, h - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
    _store_affine(Y, W, B, row, stride_y, cols, mask, d * rstd, HAS_B, False)


def _check(input_ids, token_table, weight, bias, lookups) -> None:
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding_layer_norm: ids must be int32 or int64, got {input_ids.dtype}")
    if token_table.dim() != 2:
        raise ValueError(f"embedding_layer_norm: token_table must be (vocab, hidden), got {tuple(token_table.shape)}")
    n = token_table.shape[1]
    for name, ids, _ in (("input", input_ids, None), *lookups):
        if ids is not None and ids.device != token_table.device:
            raise ValueError(f"embedding_layer_norm: {name}_ids are on {ids.device}, the tables on "
                             f"{token_table.device}: move them to one device")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (n,):
            raise ValueError(f"embedding_layer_norm: {name} shape {tuple(p.shape)} != (hidden,) = ({n},)")
    for name, ids, table in lookups:
        if (ids is None) != (table is None):
            raise ValueError(f"embedding_layer_norm: pass {name}_ids and {name}_table together (or neither)")
        if table is None:
            continue
        if ids.shape != input_ids.shape or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"embedding_layer_norm: {name}_ids must be integer ids shaped like input_ids "
                             f"{tuple(input_ids.shape)}, got {ids.dtype} {tuple(ids.shape)}")
        if table.dim() != 2 or table.shape[1] != n or table.dtype != token_table.dtype:
            raise ValueError(f"embedding_layer_norm: {name}_table must be (rows, {n}) {token_table.dtype}, got "
                             f"{table.dtype} {tuple(table.shape)}")


def _unsupported(token_table: torch.Tensor, weight, bias, tables) -> str | None:
    if token_table.dtype not in _DTYPES:
        return f"dtype {token_table.dtype} (supported: float32, float16, bfloat16)"
    if not _fwd_plan(token_table.shape[1])[1]:
        return f"hidden size {token_table.shape[1]} (one block of layer_norm's forward at most)"
    if any(t.stride(1) != 1 for t in (token_table, *tables)):
        return "a table whose rows are not contiguous"
    return needs_grad_reason(token_table, weight, bias, *tables)


def embedding_layer_norm(
    input_ids: torch.Tensor, token_table: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    position_ids: torch.Tensor | None = None, position_table: torch.Tensor | None = None, position_offset: int = 0,
    token_type_ids: torch.Tensor | None = None, type_table: torch.Tensor | None = None, eps: float = 1e-5,
    backend: str | None = None, check_token_ids: bool = True,
) -> torch.Tensor:
    """``layer_norm(token_table[ids] + position_table[position_ids + position_offset] + type_table[type_ids])``
    with ``weight``/``bias`` over the hidden dim: (...) ids -> (..., hidden). Inference only (see the module
    docstring). ``check_token_ids=False`` skips the token and type id checks, for a caller that made them
    (the position ids are always checked: nothing upstream reads them)."""
    lookups = (("position", position_ids, position_table), ("token_type", token_type_ids, type_table))
    _check(input_ids, token_table, weight, bias, lookups)
    tables = [t for t in (position_table, type_table) if t is not None]
    # Checked on every backend: the reference's lookups would raise an IndexError naming no input, or, for a
    # negative position within position_offset of 0, read another position's row.
    if check_token_ids:
        check_ids_in_range(input_ids, token_table.shape[0], message="embedding_layer_norm: input_ids out of range")
        if type_table is not None:
            check_ids_in_range(token_type_ids, type_table.shape[0],
                               message="embedding_layer_norm: token_type_ids out of range")
    if position_table is not None:
        rows = position_table.shape[0] - position_offset
        check_ids_in_range(position_ids, rows, message=f"embedding_layer_norm: position_ids must lie in [0, {rows})")
    if not use_triton(backend, token_table, op="embedding_layer_norm",
                      unsupported=_unsupported(token_table, weight, bias, tables)):
        return embedding_layer_norm_ref(input_ids, token_table, weight, bias, position_ids=position_ids,
                                        position_table=position_table, position_offset=position_offset,
                                        token_type_ids=token_type_ids, type_table=type_table, eps=eps)
    n = token_table.shape[1]
    ids, dev, dt = unit_last_stride(input_ids.reshape(-1)), token_table.device, token_table.dtype
    flat = lambda t: unit_last_stride(or_dummy(t, dev, torch.int64).reshape(-1))  # noqa: E731
    weight, bias = unit_last_stride(weight), unit_last_stride(bias)
    y = torch.empty((ids.numel(), n), device=dev, dtype=dt)
    if ids.numel():
        block, _, warps = _fwd_plan(n)
        row_stride = lambda table: 0 if table is None else table.stride(0)  # noqa: E731
        _embedding_norm_kernel[(ids.numel(),)](
            ids, token_table, flat(position_ids), or_dummy(position_table, dev, dt), flat(token_type_ids),
            or_dummy(type_table, dev, dt), weight,
            or_dummy(bias, dev, dt), y, token_table.stride(0), row_stride(position_table), row_stride(type_table),
            y.stride(0), position_offset, n, float(eps),
            HAS_POSITIONS=position_table is not None, HAS_TYPES=type_table is not None, HAS_B=bias is not None,
            BLOCK_N=block, num_warps=warps,
        )
    return y.view(*input_ids.shape, n)

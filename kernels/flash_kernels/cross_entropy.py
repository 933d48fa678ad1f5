"""Cross-entropy over a large vocabulary, with label smoothing, z-loss and logit scaling.

The Triton kernels read the logits in their own dtype and compute in float32 registers, so bf16 logits are
never upcast to a float32 copy of the matrix. The forward reads each row once: a wide row in slices, by
parallel programs whose statistics (max and sum of exp) combine into the row's log-sum-exp. The backward
recomputes the softmax from the saved per-row log-sum-exp, optionally writing the gradient over the logits
buffer (``inplace_backward``); with the loss gradient known up front (the fused LM head's case) one more pass
after the statistics writes both the loss and the gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._backend import check_ids_in_range, holds_integers, use_triton
from ._launch import lean_launch
from ._triton_compat import tl, triton
from ._triton_utils import (
    as_rows, cdiv, dummy_pointer, eager_function, next_power_of_2, pick, unit_last_stride, warps_for_block,
)

REDUCTIONS = ("mean", "sum", "none")


def mean_over_labelled(total: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """``total`` / the number of labelled rows; NaN when no row is labelled, as torch's and HF's mean
    cross-entropy give, with zero gradients (the division never sees a zero, so the backward stays finite)."""
    return torch.where(labelled > 0, total / labelled.clamp(min=1), torch.full_like(total, float("nan")))


def cross_entropy_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    return_lse: bool = False,
):
    """Plain PyTorch reference in float32. logits (N, V), labels (N,). The mean is over non-ignored rows (NaN
    when every row is ignored, with zero gradients, as ``torch.nn.functional.cross_entropy``)."""
    z = logits.float() * logit_scale
    lse = torch.logsumexp(z, dim=-1)
    # torch takes int64 targets only; ours may be any integer dtype (int32 too, as the kernels take)
    losses = F.cross_entropy(z, labels.long(), ignore_index=ignore_index, label_smoothing=label_smoothing,
                             reduction="none")
    valid = labels != ignore_index
    if lse_square_scale:
        losses = losses + lse_square_scale * lse.square() * valid
    if reduction == "mean":
        loss = mean_over_labelled(losses.sum(), valid.sum())
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    return (loss, lse) if return_lse else loss


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int, op: str) -> None:
    """Labels must lie in [0, vocab) or equal ignore_index; a silent out-of-range label corrupts the loss."""
    if not holds_integers(labels):
        raise ValueError(f"{op}: labels must be integer class ids (torch.long), got a tensor of {labels.dtype}")
    check_ids_in_range(
        labels, vocab_size, ignore=ignore_index,
        message=f"{op}: a label is outside the vocabulary [0, {vocab_size}); use ignore_index={ignore_index} for "
        "positions that carry no loss",
    )



def index_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels as the kernels and torch's gathers index with: int32 and int64 as they are, narrower integers
    (int16, uint8, ...) widened to int64, and contiguous (the kernels read label i at offset i)."""
    return unit_last_stride(labels if labels.dtype in (torch.int32, torch.int64) else labels.long())


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

# A row's gradient needs the row's log-sum-exp first, and an LM head's rows are long (32k-256k logits). One
# program walking a whole row is latency-bound: each block's load waits for the previous block's reduction,
# and a few hundred such programs cannot keep an H200's memory busy. So a wide row is cut
# into slices read by independent programs (grid rows x slices), each storing its slice's statistics (max,
# sum of exp(z - max), with smoothing the sum of z) in a small float32 buffer; then either a small kernel turns
# them into losses and lse (forward), or the gradient kernel, one program per block of a row, combines its
# row's few statistics into the lse and writes its block's gradient (forward + backward). Each program reads
# its block once, with thousands in flight: bandwidth-bound passes over the logits (forward + backward: read,
# read, write). A row of at most _SLICE logits is one program's, which keeps it in registers: one read (and
# one write).

# Sizes for an H200 (132 SMs, ~4.8 TB/s; bf16 rows of 32k-256k), in vocab elements per program. A memory-bound
# program needs many bytes of loads in flight per SM (tens of KB to cover HBM latency): elements a thread
# (16-byte loads) times the programs that fit on an SM, which registers limit (2048 threads fit at 32 registers
# a thread). Registers counted by compiling for sm_90 with Triton 3.8 (ptxas): the masked branch of a block
# past the row's end (a V that is no multiple of 16 loads element by element there) costs registers too.
# Statistics: 8192 a program at 16 warps (16 a thread: two 16-byte loads of bf16), 30-50 registers, capped at
# 40 (no spill in any variant) so that 3 programs fit on an SM: 48 KB of reads in flight. Larger slices would
# give a chunk's last wave fewer, longer programs; smaller ones more statistics for each gradient program.
_SLICE = 8192
_SLICE_REGISTERS = 40
# Gradient: 4096 a program at 16 warps (8 a thread: one 16-byte load and store of bf16), 30-36 registers, capped
# at 32 for 16-bit logits (no spill; float32 ones would spill) so that 4 programs fit: 32 KB of reads in
# flight. 16 a thread would take 75-80 registers: 3 programs of 8 warps, 24 KB. 8-38 programs a row at
# real vocabularies.
_GRAD_BLOCK = 4096
_GRAD_REGISTERS = 32
_ROW_TILE = 1024  # statistics per program of the kernel that turns them into losses (rows x slices)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stats_launch(block: int, whole_row: bool) -> dict:
    """Launch options of the forward kernel over ``block`` logits a program (16 a thread). A whole row's
    program computes its loss too and would spill under the register cap: it runs without one."""
    options = dict(num_warps=warps_for_block(block, elems_per_thread=16))
    if not whole_row:
        options["maxnreg"] = _SLICE_REGISTERS
    return options


def _grad_launch(block: int, dtype: torch.dtype) -> dict:
    """Launch options of a gradient program over ``block`` logits (8 a thread; 32 warps for a whole row of 8192)."""
    options = dict(num_warps=warps_for_block(block, max_warps=32))
    if dtype != torch.float32:
        options["maxnreg"] = _GRAD_REGISTERS
    return options


@triton.jit
def _load_scaled(base, cols, start, V, logit_scale, BLOCK_V: tl.constexpr):
    """The block of columns ``cols`` (start .. start + BLOCK_V) of a row, scaled, in float32; -inf in the lanes
    past the row (no max, exp or sum counts them). A block inside the row loads without a mask: a mask bounded
    by a V that is not a multiple of 16 (GPT-2's 50257) makes Triton load element by element, 2 bytes at a
    time instead of 16."""
    if start + BLOCK_V <= V:
        x = tl.load(base + cols)
    else:
        x = tl.load(base + cols, mask=cols < V, other=0.0)
    return tl.where(cols < V, x.to(tl.float32) * logit_scale, -float("inf"))


@triton.jit
def _store_block(base, cols, start, V, values, BLOCK_V: tl.constexpr):
    """Stores a block of a row (``cols`` as for _load_scaled), unmasked where it lies inside the row."""
    values = values.to(base.dtype.element_ty)
    if start + BLOCK_V <= V:
        tl.store(base + cols, values)
    else:
        tl.store(base + cols, values, mask=cols < V)


@triton.jit
def _finite(m):
    """A max to subtract before exp, with -inf (a block of only -inf logits, such as a masked vocabulary's) as
    0: exp(z - m) is then exp(-inf) = 0, not exp(-inf + inf) = NaN."""
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def _block_stats(z, mask, HAS_SMOOTHING: tl.constexpr):
    """(max, sum of exp(z - max), sum of z) of a block from _load_scaled; the sum of z only with smoothing."""
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - _finite(m)), axis=0)
    z_sum = 0.0
    if HAS_SMOOTHING:
        z_sum = tl.sum(tl.where(mask, z, 0.0), axis=0)
    return m, s, z_sum


@triton.jit
def _combine_lse(m, s, AXIS: tl.constexpr):
    """A row's log-sum-exp from its slices' maxima ``m`` and sums of exp(z - max) ``s`` along AXIS (entries
    past the row's slices: -inf and 0)."""
    top = _finite(tl.max(m, axis=AXIS, keep_dims=True))
    return tl.max(top, axis=AXIS) + tl.log(tl.sum(s * tl.exp(m - top), axis=AXIS))


@triton.jit
def _load_label(LABELS, row, ignore_index):
    """(the row's label as int32, whether the row is labelled). int32 because the label is compared with every
    column index: an int64 compare widens them all, registers a memory-bound program needs for its loads in
    flight. Labels are below V < 2**31 (checked before launch in eager mode)."""
    label = tl.load(LABELS + row)
    return label.to(tl.int32), label != ignore_index


@triton.jit
def _ce_loss(lse, z_label, z_sum, V, label_smoothing, lse_square_scale, HAS_SMOOTHING: tl.constexpr):
    """A labelled row's loss from its lse, its label's scaled logit and, with smoothing, its scaled logits' sum."""
    if HAS_SMOOTHING:
        # torch's definition: (1 - eps) * NLL(label) + eps * mean over classes of NLL(class).
        loss = lse - (1.0 - label_smoothing) * z_label - label_smoothing * z_sum / V
    else:
        loss = lse - z_label
    return loss + lse_square_scale * lse * lse


@lean_launch
@triton.jit
def _ce_fwd_kernel(
    LOGITS, LABELS, LOSS, LSE, STATS, stride_row, V, num_slices, plane, ignore_index, label_smoothing,
    lse_square_scale, logit_scale, HAS_SMOOTHING: tl.constexpr, WHOLE_ROW: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One slice of a row (grid rows x slices, row-major). WHOLE_ROW (the row is one slice): the row's loss and
    lse. Otherwise the slice's statistics at STATS[k * plane + program id]: k = 0 its max, 1 its sum of
    exp(z - max), 2 (with smoothing) its sum of z."""
    pid = tl.program_id(0)
    row = (pid // num_slices).to(tl.int64)
    start = (pid % num_slices) * BLOCK_V
    cols = start + tl.arange(0, BLOCK_V)
    z = _load_scaled(LOGITS + row * stride_row, cols, start, V, logit_scale, BLOCK_V)
    m, s, z_sum = _block_stats(z, cols < V, HAS_SMOOTHING)
    if WHOLE_ROW:
        lse = _finite(m) + tl.log(s)
        label, valid = _load_label(LABELS, row, ignore_index)
        z_label = tl.sum(tl.where(cols == label, z, 0.0), axis=0)
        loss = _ce_loss(lse, z_label, z_sum, V, label_smoothing, lse_square_scale, HAS_SMOOTHING)
        tl.store(LOSS + row, tl.where(valid, loss, 0.0))
        tl.store(LSE + row, lse)
    else:
        tl.store(STATS + pid, m)
        tl.store(STATS + plane + pid, s)
        if HAS_SMOOTHING:
            tl.store(STATS + 2 * plane + pid, z_sum)


@lean_launch
@triton.jit
def _ce_loss_kernel(
    LOGITS, LABELS, STATS, LOSS, LSE, stride_row, N, V, num_slices, plane, ignore_index, label_smoothing,
    lse_square_scale, logit_scale, HAS_SMOOTHING: tl.constexpr, BLOCK_N: tl.constexpr, SLICES: tl.constexpr,
):
    """Loss and lse of BLOCK_N rows from their slices' statistics (SLICES: num_slices padded to a power of two)
    and their labels' logits, one element read per row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    # The tile's lanes past the last row read the last row (their results are not stored): no -inf lse there.
    rows = tl.minimum(rows, N - 1).to(tl.int64)
    slices = tl.arange(0, SLICES)
    mask = (slices < num_slices)[None, :]
    at = STATS + rows[:, None] * num_slices + slices[None, :]
    lse = _combine_lse(tl.load(at, mask=mask, other=-float("inf")), tl.load(at + plane, mask=mask, other=0.0), 1)
    z_sum = 0.0
    if HAS_SMOOTHING:
        z_sum = tl.sum(tl.load(at + 2 * plane, mask=mask, other=0.0), axis=1)
    label = tl.load(LABELS + rows).to(tl.int64)
    valid = label != ignore_index
    z_label = tl.load(LOGITS + rows * stride_row + label, mask=valid, other=0.0).to(tl.float32) * logit_scale
    loss = _ce_loss(lse, z_label, z_sum, V, label_smoothing, lse_square_scale, HAS_SMOOTHING)
    tl.store(LOSS + rows, tl.where(valid, loss, 0.0), mask=in_rows)
    tl.store(LSE + rows, lse, mask=in_rows)


@triton.jit
def _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale):
    """One block of d loss / d logits for scaled logits ``z``. d loss / d z = softmax * p_coef - coef *
    ((1 - eps) * onehot(label) + eps / V), where coef is the row's loss gradient and p_coef adds the z-loss
    and lse terms (d lse / d z = softmax); then the chain rule through z = logit_scale * logits."""
    g = tl.exp(z - lse) * p_coef - coef * label_smoothing / V
    g = tl.where(cols == label, g - coef * (1.0 - label_smoothing), g)
    return g * logit_scale


@lean_launch
@triton.jit
def _ce_bwd_kernel(
    LOGITS, DLOGITS, LABELS, LSE, DLOSS, DLSE, stride_row, stride_drow, V, ignore_index, label_smoothing,
    lse_square_scale, logit_scale, HAS_DLSE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_V
    cols = start + tl.arange(0, BLOCK_V)
    z = _load_scaled(LOGITS + row * stride_row, cols, start, V, logit_scale, BLOCK_V)  # first: see _ce_fwd_bwd_kernel
    label, valid = _load_label(LABELS, row, ignore_index)
    lse = tl.load(LSE + row)
    coef = tl.where(valid, tl.load(DLOSS + row), 0.0)
    p_coef = coef * (1.0 + 2.0 * lse_square_scale * lse)
    if HAS_DLSE:
        p_coef += tl.load(DLSE + row)
    g = _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale)
    _store_block(DLOGITS + row * stride_drow, cols, start, V, g, BLOCK_V)


@lean_launch
@triton.jit
def _ce_fwd_bwd_kernel(
    LOGITS, LABELS, LOSS, DLOSS, STATS, stride_row, N, V, num_blocks, num_slices, plane, ignore_index,
    label_smoothing, lse_square_scale, logit_scale, HAS_SMOOTHING: tl.constexpr, WHOLE_ROW: tl.constexpr,
    BLOCK_V: tl.constexpr, SLICES: tl.constexpr,
):
    """One block of a row (grid rows x blocks) when the row's loss gradient DLOSS is known up front (a fused LM
    head scales it later): the block's gradient, written over the logits, and, from the block holding the label
    (block 0 for an ignored row), the row's loss. The lse comes from the row's slices' statistics (SLICES:
    num_slices padded to a power of two), or with WHOLE_ROW (the row is one block) from the block itself.
    Rows run last to first: the statistics kernel read the last rows last, so theirs are the logits still in L2."""
    pid = tl.program_id(0)
    row = (N - 1 - pid // num_blocks).to(tl.int64)
    block = pid % num_blocks
    start = block * BLOCK_V
    cols = start + tl.arange(0, BLOCK_V)
    base = LOGITS + row * stride_row
    # The block's load first, before anything waits on the small loads below (L2 hits): one memory latency a
    # program, not two.
    z = _load_scaled(base, cols, start, V, logit_scale, BLOCK_V)
    label, valid = _load_label(LABELS, row, ignore_index)
    coef = tl.where(valid, tl.load(DLOSS + row), 0.0)
    if WHOLE_ROW:
        m, s, z_sum = _block_stats(z, cols < V, HAS_SMOOTHING)
        lse = _finite(m) + tl.log(s)
    else:
        slices = tl.arange(0, SLICES)
        in_row = slices < num_slices
        at = STATS + row * num_slices + slices
        lse = _combine_lse(tl.load(at, mask=in_row, other=-float("inf")), tl.load(at + plane, mask=in_row, other=0.0), 0)
        z_sum = 0.0
        if HAS_SMOOTHING:
            z_sum = tl.sum(tl.load(at + 2 * plane, mask=in_row, other=0.0), axis=0)
    # Clamped: an out-of-range label (unchecked under torch.compile) still has its loss written by one block.
    owner = tl.where(valid, tl.minimum(tl.maximum(label // BLOCK_V, 0), num_blocks - 1), 0)
    if block == owner:
        # The label's logit from the registers: the store below overwrites it in memory.
        z_label = tl.sum(tl.where(cols == label, z, 0.0), axis=0)
        loss = _ce_loss(lse, z_label, z_sum, V, label_smoothing, lse_square_scale, HAS_SMOOTHING)
        tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    p_coef = coef * (1.0 + 2.0 * lse_square_scale * lse)
    g = _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale)
    _store_block(base, cols, start, V, g, BLOCK_V)


def _slice_statistics(logits, labels, losses, lse, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Launches the forward kernel over every row. Rows of at most _SLICE logits: one program a row stores its
    loss and lse, and this returns None. Wider rows: programs of _SLICE logits store their slices' statistics,
    returned as (stats (k, rows * slices) float32, slices a row) for a kernel that combines them."""
    N, V = logits.shape
    whole_row = V <= _SLICE
    block = next_power_of_2(V) if whole_row else _SLICE
    slices = cdiv(V, block)
    smoothing = label_smoothing > 0.0
    stats = (dummy_pointer(logits.device, torch.float32) if whole_row else
             torch.empty((3 if smoothing else 2, N * slices), device=logits.device, dtype=torch.float32))
    _ce_fwd_kernel[(N * slices,)](
        logits, labels, losses, lse, stats, logits.stride(0), V, slices, N * slices, ignore_index, label_smoothing,
        lse_square_scale, logit_scale, HAS_SMOOTHING=smoothing, WHOLE_ROW=whole_row, BLOCK_V=block,
        **_stats_launch(block, whole_row),
    )
    return None if whole_row else (stats, slices)


def ce_rows_fwd(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Per-row (losses, lse), float32."""
    N, V = logits.shape
    losses = torch.empty((N,), device=logits.device, dtype=torch.float32)
    lse = torch.empty((N,), device=logits.device, dtype=torch.float32)
    split = _slice_statistics(logits, labels, losses, lse, ignore_index, label_smoothing, lse_square_scale,
                              logit_scale)
    if split is not None:
        stats, slices = split
        padded = next_power_of_2(slices)
        block_n = max(1, min(next_power_of_2(N), _ROW_TILE // padded))
        _ce_loss_kernel[(cdiv(N, block_n),)](
            logits, labels, stats, losses, lse, logits.stride(0), N, V, slices, N * slices, ignore_index,
            label_smoothing, lse_square_scale, logit_scale, HAS_SMOOTHING=label_smoothing > 0.0, BLOCK_N=block_n,
            SLICES=padded, num_warps=4,
        )
    return losses, lse


def ce_rows_fwd_bwd_(logits, labels, dlosses, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Per-row losses (float32), with the logits gradient for the per-row loss gradients ``dlosses`` written
    over ``logits``: one launch for rows of at most _SLICE logits, two (statistics, then gradient) for wider."""
    N, V = logits.shape
    losses = torch.empty((N,), device=logits.device, dtype=torch.float32)
    unused = dummy_pointer(logits.device, torch.float32)
    whole_row = V <= _SLICE  # one program a row: statistics and gradient from the same registers
    if whole_row:
        stats, slices, block = unused, 1, next_power_of_2(V)
    else:
        stats, slices = _slice_statistics(logits, labels, losses, unused, ignore_index, label_smoothing,
                                          lse_square_scale, logit_scale)
        block = _GRAD_BLOCK
    blocks = cdiv(V, block)
    _ce_fwd_bwd_kernel[(N * blocks,)](
        logits, labels, losses, dlosses, stats, logits.stride(0), N, V, blocks, slices, N * slices, ignore_index,
        label_smoothing, lse_square_scale, logit_scale, HAS_SMOOTHING=label_smoothing > 0.0, WHOLE_ROW=whole_row,
        BLOCK_V=block, SLICES=next_power_of_2(slices), **_grad_launch(block, logits.dtype),
    )
    return losses


def ce_rows_bwd(logits, dlogits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Writes the logits gradient into ``dlogits``, which may be ``logits`` itself."""
    N, V = logits.shape
    block = min(_GRAD_BLOCK, next_power_of_2(V))
    _ce_bwd_kernel[(N, cdiv(V, block))](
        logits, dlogits, labels, lse, dlosses, dlse, logits.stride(0), dlogits.stride(0), V, ignore_index,
        label_smoothing, lse_square_scale, logit_scale, HAS_DLSE=dlse is not None, BLOCK_V=block,
        **_grad_launch(block, logits.dtype),
    )


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    logit_scale: float, inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ce_rows_fwd(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale)


@_ce_fwd_op.register_fake
def _(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale, inplace_backward):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("flash_kernels::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dlosses: torch.Tensor, dlse: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, lse_square_scale: float, logit_scale: float,
) -> torch.Tensor:
    return _ce_bwd_new(logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale)


@_ce_bwd_op.register_fake
def _(logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    return torch.empty_like(logits)


@torch.library.custom_op("flash_kernels::cross_entropy_bwd_", mutates_args=("logits",))
def _ce_bwd_inplace_op(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dlosses: torch.Tensor, dlse: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, lse_square_scale: float, logit_scale: float,
) -> None:
    ce_rows_bwd(logits, logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale)


def _ce_setup_context(ctx, inputs, output):
    logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale, inplace_backward = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.args = (ignore_index, label_smoothing, lse_square_scale, logit_scale)
    ctx.inplace_backward = inplace_backward


def _ce_bwd_new(logits, labels, lse, dlosses, dlse, *args):
    dlogits = torch.empty_like(logits)
    ce_rows_bwd(logits, dlogits, labels, lse, dlosses, dlse, *args)
    return dlogits


def _ce_backward_with(bwd, bwd_inplace):
    """The backward, calling the custom ops (traced by torch.compile) or their implementations (eager)."""

    def backward(ctx, dlosses, dlse):
        logits, labels, lse = ctx.saved_tensors
        if dlosses is None:
            dlosses = torch.zeros_like(lse)
        if ctx.inplace_backward:
            bwd_inplace(logits, labels, lse, dlosses.contiguous(), dlse, *ctx.args)
            dlogits = logits
        else:
            dlogits = bwd(logits, labels, lse, dlosses.contiguous(), dlse, *ctx.args)
        return dlogits, None, None, None, None, None, None

    return backward


def _ce_bwd_inplace(logits, labels, lse, dlosses, dlse, *args):
    ce_rows_bwd(logits, logits, labels, lse, dlosses, dlse, *args)


_ce_fwd_op.register_autograd(_ce_backward_with(_ce_bwd_op, _ce_bwd_inplace_op), setup_context=_ce_setup_context)
_ce_eager = eager_function(
    "CrossEntropy", lambda logits, labels, *args: ce_rows_fwd(logits, labels, *args[:-1]), _ce_setup_context,
    _ce_backward_with(_ce_bwd_new, _ce_bwd_inplace),
)


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


def _unsupported(logits: torch.Tensor) -> str | None:
    if logits.dtype not in _DTYPES:
        return f"logits dtype {logits.dtype} (supported: float32, float16, bfloat16)"
    return None


def reduce_losses(losses: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-row losses reduced as the reference does: the mean is over non-ignored rows."""
    if reduction == "mean":
        return mean_over_labelled(losses.sum(), (labels != ignore_index).sum())
    if reduction == "sum":
        return losses.sum()
    return losses


def cross_entropy_triton_rows(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0, logit_scale: float = 1.0, inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (losses, lse) from the Triton kernels, differentiable; shared with linear_cross_entropy."""
    # Under torch.compile the graph is functional: an in-place backward would be copied anyway.
    inplace = inplace_backward and not torch.compiler.is_compiling()
    return pick(_ce_fwd_op, _ce_eager)(as_rows(logits), labels, int(ignore_index), float(label_smoothing), float(lse_square_scale),
                      float(logit_scale), inplace)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    inplace_backward: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Cross-entropy of logits (N, V) against labels (N,). See ``cross_entropy_ref`` for the exact function.

    The loss is float32. ``inplace_backward=True`` writes the logits gradient over ``logits`` (saving a buffer
    the size of the logits; the logits are garbage afterwards). ``return_lse`` also returns the per-row
    log-sum-exp of the scaled logits, which is differentiable too. Labels are range-checked in eager mode (a
    host sync); under torch.compile the check is skipped and an out-of-range label gives an undefined loss.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: expected logits (N, V) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if not torch.compiler.is_compiling():
        check_labels(labels, logits.shape[-1], ignore_index, "cross_entropy")
    labels = index_labels(labels)
    if not use_triton(backend, logits, op="cross_entropy", unsupported=_unsupported(logits)):
        return cross_entropy_ref(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, logit_scale=logit_scale, reduction=reduction, return_lse=return_lse,
        )
    losses, lse = cross_entropy_triton_rows(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, logit_scale=logit_scale, inplace_backward=inplace_backward,
    )
    loss = reduce_losses(losses, labels, ignore_index, reduction)
    return (loss, lse) if return_lse else loss

"""``linear_act(x, weight, bias, activation=...)``: ``act(x @ weight.T + bias)`` for inference, one Triton GEMM
with the bias and the activation in its epilogue.

Why: an encoder's first MLP projection (BERT, ViT: exact, erf GELU) writes its (tokens, 4 x hidden)
pre-activation and a separate GELU kernel reads it back and writes the activation, two passes over the
largest tensor of the layer. In a BERT-base forward that GELU is a large share of the kernel time
(``scripts/profile/bert_kernels.py`` lists HF's kernels, which run it unfused), and cuBLASLt cannot take it: its GELU epilogue is the tanh
approximation, not the erf GELU these models were trained with. Here the activation is applied to the
accumulator tile before the one store.

The kernel is persistent (one or two programs per SM walk the output tiles) and its operands come by TMA
(host-built tensor descriptors), which needs a Hopper-class GPU (compute capability 9.0+) and K and N
multiples of 8; other inputs are copied to be 16-byte aligned where needed.

The result rounds where the unfused path stores a tensor: the pre-activation (with its bias) is rounded to
x's dtype, as the GEMM stores it, before the activation, whose float32 result is rounded once more. Only the
float32 summation order of the GEMM differs from cuBLAS's.

Inference only: no backward (a training MLP keeps its pre-activation for the GELU gradient, which this kernel
does not write), and inputs that need gradients are refused. Backends: "triton" runs the kernel;
"reference" is ``F.linear`` then torch's activation; "auto" runs the kernel on CUDA for inputs of at least
``AUTO_MIN_ROWS`` rows that it can take, else ``F.linear`` then our activation kernel (``activations.gelu``).
Why the row bound: an eager call of the kernel costs several times the host time of the two unfused calls (its
descriptor arguments take Triton's own launch path, not ``_launch.lean_launch``), which only a GEMM of thousands
of rows hides.

What the kernel gains (H200, bf16, graph-replayed): with the GELU's math in ``_ptx_math``'s single instructions
and the tile loop flattened into the K loop (Triton pipelines loads across tiles), it measured ahead of cuBLAS +
our GELU at BERT's and ViT's fc1 shapes, with outputs equal to that path's in those runs (its GEMM sums in
another order, so equality is not promised).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ptx_math
from ._autotune_cache import cached_autotune
from ._backend import check_backend_name, needs_grad_reason, triton_interpreter_enabled, use_triton
from ._triton_compat import TRITON_AVAILABLE, tl, triton
from ._triton_utils import cdiv, hopper_or_newer, next_power_of_2, num_programs, or_dummy, pick
from .activations import _act_and_grad, gelu
from .attention_tiles import _mm

if TRITON_AVAILABLE:
    from triton.tools.tensor_descriptor import TensorDescriptor

# activation name -> the kernel's ACT code (see _activate), and the reference on a stored pre-activation.
ACTIVATIONS = {
    "gelu": (1, lambda y: F.gelu(y)),
    "gelu_tanh": (2, lambda y: F.gelu(y, approximate="tanh")),
    "relu": (3, F.relu),
}
_DTYPES = (torch.float16, torch.bfloat16)  # float32 would run the dot in TF32, unlike torch's default


def linear_act_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   activation: str = "gelu") -> torch.Tensor:
    """The unfused path: the GEMM (+ bias) stored in x's dtype, then the activation of that stored tensor."""
    return ACTIVATIONS[activation][1](F.linear(x, weight, bias))


def _configs():
    """Candidates for the persistent kernel: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM, epilogue
    in two halves), from an H100 sweep at BERT's and ViT's fc1 shapes: one
    program per SM with 128 x 256 tiles and a split epilogue was fastest at BERT-large's; two per SM (128 x 128
    tiles, ~112 KB of shared memory each), where one program's GELU can overlap the other's main loop, at
    BERT-base's and ViT's. The interpreter gets one small tile, split, so test shapes cross several
    tiles in every dim and the split epilogue runs."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "PROGRAMS_PER_SM": 1,
                               "SPLIT_EPILOGUE": True}, num_warps=4, num_stages=1, pre_hook=_set_block_shapes)]
    shapes = [(128, 256, 64, 8, 3, 1, True), (128, 256, 64, 8, 4, 1, True), (128, 128, 64, 8, 4, 1, False),
              (128, 128, 128, 8, 3, 1, False), (128, 128, 64, 4, 3, 2, True), (128, 128, 64, 8, 3, 2, True),
              (128, 128, 64, 4, 3, 2, False)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "PROGRAMS_PER_SM": programs,
                           "SPLIT_EPILOGUE": split}, num_warps=w, num_stages=s, pre_hook=_set_block_shapes)
            for m, n, k, w, s, programs, split in shapes]


def _set_block_shapes(nargs: dict) -> None:
    """A TMA descriptor carries the box it moves, so each config sets the boxes of the descriptors it gets."""
    block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [block_m, block_k]
    nargs["w_desc"].block_shape = [block_n, block_k]
    nargs["y_desc"].block_shape = [block_m, block_n // 2 if nargs["SPLIT_EPILOGUE"] else block_n]


@triton.jit
def _activate(y, ACT: tl.constexpr, PTX: tl.constexpr):
    """ACT 1: exact GELU (erf), 2: tanh-approximated GELU (both as the activations module computes them), 3: ReLU.
    PTX: the GELU's exp2 as a single instruction (``_ptx_math``)."""
    if ACT == 3:
        return tl.maximum(y, 0.0)
    a, _ = _act_and_grad(y, ACT, PTX)
    return a


@triton.jit
def _epilogue(acc, B, offs_n, N, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PTX: tl.constexpr,
              out_dtype: tl.constexpr):
    """Bias, the pre-activation rounded as the unfused GEMM stores it, then the activation, in out_dtype."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    pre = acc.to(out_dtype).to(tl.float32)
    return _activate(pre, ACT, PTX).to(out_dtype)


@triton.jit
def _tile_coords(tile, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a tile, visiting GROUP_M row blocks at a time down each column block so
    that programs working at the same time share W's columns and X's rows in L2."""
    per_group = GROUP_M * blocks_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


_CONFIGS = _configs()
# "auto" takes the kernel from this many rows (tokens) on. The bound is the eager host cost (module docstring):
# at 6k-16k rows of an encoder's fc1 the kernel's GPU time hides it (H200); a GEMM with a few times fewer rows
# would not. BERT's and
# ViT's benchmark batches run 8k-16k tokens; small batches and decode steps stay on cuBLAS + our GELU.
AUTO_MIN_ROWS = 8192


@cached_autotune
@triton.autotune(configs=_CONFIGS, key=["N", "K", "M_BUCKET"])
@triton.jit
def _linear_act_kernel(
    x_desc, w_desc, y_desc, B, M, N, K, NUM_SMS, M_BUCKET,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PTX: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
):
    """act(X @ W.T + B), persistent: each program walks the output tiles with a stride of the grid size, its
    operands brought by TMA (tensor descriptors; out-of-range rows and columns read as zeros and are not
    stored). SPLIT_EPILOGUE stores the tile in two column halves, so half the accumulator is converted at a
    time and the output staging buffer is half the size. M_BUCKET (a power of two at or above M) only keys the
    autotuner: packed batches change M by a few tokens each time. The tile loop is flattened into the K loop,
    so the pipeline loads the next tile's first operands during this tile's last steps and epilogue."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    out_dtype = B.dtype.element_ty
    for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, NUM_SMS * PROGRAMS_PER_SM, flatten=True):
        pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _mm(x_desc.load([off_m, k0]), w_desc.load([off_n, k0]).T, acc, DOT_F32)
        if SPLIT_EPILOGUE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            offs_n = off_n + tl.arange(0, BLOCK_N // 2)
            y_desc.store([off_m, off_n], _epilogue(left, B, offs_n, N, HAS_BIAS, ACT, PTX, out_dtype))
            y_desc.store([off_m, off_n + BLOCK_N // 2],
                         _epilogue(right, B, offs_n + BLOCK_N // 2, N, HAS_BIAS, ACT, PTX, out_dtype))
        else:
            y_desc.store([off_m, off_n],
                         _epilogue(acc, B, off_n + tl.arange(0, BLOCK_N), N, HAS_BIAS, ACT, PTX, out_dtype))


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t (2-D) as TMA reads it: unit column stride, rows and base 16-byte aligned; else a contiguous copy."""
    aligned = t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    return t if aligned else t.contiguous()


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor of t; its box is set by the chosen config's pre-hook (_set_block_shapes)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])


def _linear_act(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
    M, K = x2.shape
    N = weight.shape[0]
    x2, weight = _tma_ready(x2), _tma_ready(weight)
    y = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    dot_f32 = triton_interpreter_enabled() and x2.dtype == torch.bfloat16
    sms = num_programs(x2.device, per_sm=1)
    grid = lambda meta: (min(sms * meta["PROGRAMS_PER_SM"],  # noqa: E731
                             cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)
    _linear_act_kernel[grid](
        _descriptor(x2), _descriptor(weight), _descriptor(y), or_dummy(bias, x2.device, x2.dtype), M, N, K, sms,
        next_power_of_2(M), HAS_BIAS=bias is not None, ACT=act, PTX=_ptx_math.ENABLED, DOT_F32=dot_f32,
    )
    return y


# torch.compile traces the custom op as one opaque node; eager calls skip the dispatcher (``pick``).
@torch.library.custom_op("flash_kernels::linear_act", mutates_args=())
def _linear_act_op(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
    return _linear_act(x2, weight, bias, act)


@_linear_act_op.register_fake
def _(x2, weight, bias, act):
    return x2.new_empty((x2.shape[0], weight.shape[0]))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear_act: activation={activation!r}; use one of {sorted(ACTIVATIONS)}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_act: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (expected "
                         f"(N, {x.shape[-1]}))")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_act: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    if not (x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)):
        raise ValueError(f"linear_act: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}"
                         f"{'' if bias is None else ', ' + str(bias.dtype)}")


def _unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float16, bfloat16)"
    if x.numel() == 0:
        return "an empty input"
    if weight.shape[0] % 8 or weight.shape[1] % 8:
        return (f"weight {tuple(weight.shape)}: both dims must be multiples of 8 (the kernel moves rows by TMA, "
                "which needs them 16-byte aligned)")
    if x.is_cuda and not hopper_or_newer(x.device):
        return "a GPU without TMA (the kernel needs compute capability 9.0 or newer)"
    return needs_grad_reason(x, weight, bias)


def kernel_can_run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether backend="triton" can take these inputs (a module falls back to the unfused path otherwise, rather
    than make an optimization an error: a GPU without TMA, dims that are not multiples of 8...)."""
    return _unsupported(x, weight, bias) is None


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str = "gelu",
               backend: str | None = None) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` for x (..., K), weight (N, K) -> (..., N); ``activation`` is "gelu"
    (exact, erf), "gelu_tanh" or "relu". Inference only; "auto" takes the fused kernel on CUDA from
    ``AUTO_MIN_ROWS`` rows (see the module docstring)."""
    _check(x, weight, bias, activation)
    backend = check_backend_name(backend)
    if backend == "auto" and x.is_cuda and x.numel() >= AUTO_MIN_ROWS * x.shape[-1] and kernel_can_run(x, weight, bias):
        backend = "triton"
    if backend == "auto":
        y = F.linear(x, weight, bias)
        return F.relu(y) if activation == "relu" else gelu(y, approximate="none" if activation == "gelu" else "tanh")
    if not use_triton(backend, x, op="linear_act", unsupported=_unsupported(x, weight, bias)):
        return linear_act_ref(x, weight, bias, activation=activation)
    x2 = x.reshape(-1, x.shape[-1])
    bias = None if bias is None else bias.contiguous()
    y = pick(_linear_act_op, _linear_act)(x2, weight, bias, ACTIVATIONS[activation][0])
    return y.view(*x.shape[:-1], weight.shape[0])

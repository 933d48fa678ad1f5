"""``linear_act(x, weight, bias, activation=...)``: ``act(x @ weight.T + bias)`` for inference, one Triton GEMM
with the bias and the activation in its epilogue.

Why: an encoder's first MLP projection (BERT, ViT: exact, erf GELU) writes its (tokens, 4 x hidden)
pre-activation and a separate GELU kernel reads it back and writes the activation, two passes over the
largest tensor of the layer. In a BERT-base forward at 0% padding that GELU is 0.86 of 6.6 ms of kernels
(docs/benchmarks.md, BERT, session 8), and cuBLASLt cannot take it: its GELU epilogue is the tanh
approximation, not the erf GELU these models were trained with. Here the activation is applied to the
accumulator tile before the one store.

The result rounds where the unfused path stores a tensor: the pre-activation (with its bias) is rounded to
x's dtype, as the GEMM stores it, before the activation, whose float32 result is rounded once more. Only the
float32 summation order of the GEMM differs from cuBLAS's.

Inference only: no backward (a training MLP keeps its pre-activation for the GELU gradient, which this kernel
does not write), and inputs that need gradients are refused. Backends: "triton" runs the kernel;
"reference" is ``F.linear`` then the activation; "auto" is the reference too, until a GPU run shows the
kernel ahead of cuBLAS + torch's activation (``scripts/profile/linear_act_sweep.py``; not yet run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autotune_cache import cached_autotune
from ._backend import check_backend_name, needs_grad_reason, triton_interpreter_enabled, use_triton
from ._triton_compat import tl, triton
from ._triton_utils import cdiv, next_power_of_2, or_dummy, pick
from .activations import _act_and_grad
from .attention import _mm

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
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) candidates for Hopper-class GPUs: large output tiles so the
    tensor cores are fed, three or four stages of shared memory (96-147 KB for 128-row tiles: the 96 KB ones
    fit two programs per SM, so one's epilogue overlaps the other's main loop); the interpreter gets one small
    tile so test shapes cross several tiles in every dim."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4, num_stages=1)]
    shapes = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
              (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
              (128, 256, 32, 8, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


@triton.jit
def _activate(y, ACT: tl.constexpr):
    """ACT 1: exact GELU (erf), 2: tanh-approximated GELU (both as the activations module computes them), 3: ReLU."""
    if ACT == 3:
        return tl.maximum(y, 0.0)
    a, _ = _act_and_grad(y, ACT)
    return a


_CONFIGS = _configs()
_K_ALIGN = max(config.kwargs["BLOCK_K"] for config in _CONFIGS)  # K a multiple of it: no mask along K


@cached_autotune
@triton.autotune(configs=_CONFIGS, key=["N", "K", "M_BUCKET"])
@triton.jit
def _linear_act_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, M_BUCKET,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of act(X @ W.T + B). Tiles are visited GROUP_M row blocks at a time down each
    column block, so consecutive programs share W's columns and X's rows in L2. M_BUCKET (a power of two at or
    above M) only keys the autotuner: packed batches change M by a few tokens each time."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_in, n_in = offs_m < M, offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) of W.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # no mask along K: the loads stay vectorized and pipelined
            x = tl.load(x_ptrs, mask=m_in[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_in[None, :], other=0.0)
        else:
            k_in = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        acc = _mm(x, w, acc, DOT_F32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    pre = acc.to(Y.dtype.element_ty).to(tl.float32)  # the pre-activation as the unfused GEMM stores it
    y = _activate(pre, ACT).to(Y.dtype.element_ty)
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y, mask=m_in[:, None] & n_in[None, :])


def _linear_act(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    dot_f32 = triton_interpreter_enabled() and x2.dtype == torch.bfloat16
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _linear_act_kernel[grid](
        x2, weight, or_dummy(bias, x2.device, x2.dtype), y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
        next_power_of_2(M), HAS_BIAS=bias is not None, ACT=act, EVEN_K=K % _K_ALIGN == 0, DOT_F32=dot_f32,
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
    return needs_grad_reason(x, weight, bias)


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str = "gelu",
               backend: str | None = None) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` for x (..., K), weight (N, K) -> (..., N); ``activation`` is "gelu"
    (exact, erf), "gelu_tanh" or "relu". Inference only (see the module docstring)."""
    _check(x, weight, bias, activation)
    if check_backend_name(backend) == "auto" or not use_triton(
            backend, x, op="linear_act", unsupported=_unsupported(x, weight, bias)):
        return linear_act_ref(x, weight, bias, activation=activation)
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = pick(_linear_act_op, _linear_act)(x2, weight, bias, ACTIVATIONS[activation][0])
    return y.view(*x.shape[:-1], weight.shape[0])

"""Dense layers on cuBLASLt epilogues (CUDA C++ in ``csrc/``): GEMM+bias, and the GELU MLP
``fc2(gelu(fc1(x)))`` whose forward writes the GELU and its pre-activation from the fc1 GEMM's epilogue and
whose backward gets gelu'(pre) * (dy @ W2) from the DGELU epilogue. Each bias gradient comes with its weight
gradient from one GEMM: from BGRADB (cuBLASLt runs its reduction as a kernel of its own), or, where it moves
fewer bytes, from a ones column appended to the layer's input (``_weight_and_bias_grads``).

The extension is built on first use by ``torch.utils.cpp_extension.load`` (JIT with nvcc and ninja, cached
under ``FLASH_KERNELS_BUILD_DIR`` or ~/.cache/flash_kernels), unless an ahead-of-time build is installed
(``FLASH_KERNELS_BUILD_EXT=1 pip install --no-build-isolation .``). A default install never compiles.

Backends, the vocabulary of every op: "reference" (torch), "triton" (our kernels, here the extension; an error
carrying the compiler's message if it cannot build), "auto" (the extension on CUDA for fp16/bf16 with dims that
are multiples of 8 when nvcc or a prebuilt extension is there, else torch). "cuda", this module's own word for
"triton", is still accepted with a FutureWarning. cuBLASLt's GELU is the tanh approximation, so the extension serves
``approximate="tanh"`` only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ._backend import check_backend_name
from ._triton_utils import eager_function, pick

logger = logging.getLogger(__name__)

ENV_BUILD_DIR = "FLASH_KERNELS_BUILD_DIR"
_PREBUILT = "flash_kernels._fused_dense_C"
_CSRC = Path(__file__).parent / "csrc"
SOURCES = [str(_CSRC / "fused_dense.cpp"), str(_CSRC / "fused_dense_cuda.cu")]
_EXT = None


class ExtensionBuildError(RuntimeError):
    """The CUDA extension could not be built; the message carries the compiler's output."""


# ----------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------


def fused_dense_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def fused_dense_gelu_dense_ref(x, weight1, bias1, weight2, bias2, *, approximate: str = "tanh") -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, weight1, bias1), approximate=approximate), weight2, bias2)


# ----------------------------------------------------------------------------------------------------------
# Building and loading the extension
# ----------------------------------------------------------------------------------------------------------


def build_directory() -> Path:
    tag = f"torch{torch.__version__.replace('+', '_')}_cuda{torch.version.cuda}"
    root = os.environ.get(ENV_BUILD_DIR) or Path.home() / ".cache" / "flash_kernels"
    path = Path(root) / tag / "fused_dense"
    path.mkdir(parents=True, exist_ok=True)
    return path


@torch.compiler.assume_constant_result
def extension_buildable() -> str | None:
    """None when the extension is prebuilt or can be built here, else why not. Asked by every eager call on
    the "auto" path, so the answer is found once per process: ``find_spec`` walks sys.path (54 us a call on
    the CPU machine, as much as the GPU time of a small GEMM)."""
    return None if _EXT is not None else _why_not_buildable()


@functools.cache
def _why_not_buildable() -> str | None:
    if importlib.util.find_spec(_PREBUILT) is not None:
        return None
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) was found; set CUDA_HOME"
    return None


def _cublas_flags() -> tuple[list[str], list[str]]:
    """(include dirs, linker flags) for cuBLASLt. Toolkits without the cuBLAS headers (pip-installed CUDA,
    slim images) get them from the ``nvidia-cublas`` wheel that torch itself depends on."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None and (Path(CUDA_HOME) / "include" / "cublasLt.h").exists():
        return [], ["-lcublasLt"]
    nvidia = importlib.util.find_spec("nvidia")
    for root in (nvidia.submodule_search_locations or []) if nvidia is not None else []:
        for header in sorted(Path(root).glob("*/include/cublasLt.h")):
            libs = sorted(header.parent.parent.glob("lib/libcublasLt.so*"))
            if libs:
                return [str(header.parent)], [str(libs[0]), f"-Wl,-rpath,{libs[0].parent}"]
    return [], ["-lcublasLt"]


def load_extension(*, verbose: bool = False):
    """The compiled module: the ahead-of-time build if installed, else a JIT build (cached after the first)."""
    global _EXT
    if _EXT is not None:
        return _EXT
    if importlib.util.find_spec(_PREBUILT) is not None:
        _EXT = importlib.import_module(_PREBUILT)
        return _EXT
    reason = extension_buildable()
    if reason is not None:
        raise ExtensionBuildError(f"fused_dense: cannot build the CUDA extension: {reason}")
    from torch.utils.cpp_extension import load

    logger.info("building the fused_dense CUDA extension (first use; cached afterwards)")
    if not torch.cuda.is_available() and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        # No GPU to detect the architecture from (a compile-only check): build for Hopper.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    includes, ldflags = _cublas_flags()
    try:
        _EXT = load(
            name="flash_kernels_fused_dense", sources=SOURCES, build_directory=str(build_directory()),
            extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], extra_include_paths=includes, extra_ldflags=ldflags,
            verbose=verbose,
        )
    except (RuntimeError, OSError) as err:  # the build's own failure, re-raised with its output kept
        raise ExtensionBuildError(f"fused_dense: building the CUDA extension failed:\n{err}") from err
    return _EXT


@functools.cache
def optional_extension(user: str, cost: str):
    """The extension, or None with one warning (per ``user``) when its build fails: for callers to which it is an
    optimization, not the op, so that a broken toolchain costs ``cost`` rather than stopping a run. The answer is
    cached, so a failing build is not retried at every call. (``fused_dense`` itself raises instead.)"""
    try:
        return load_extension()
    except ExtensionBuildError as err:
        warnings.warn(f"{user}: the fused_dense extension did not build, so {cost}. {err}", RuntimeWarning,
                      stacklevel=2)
        return None


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


def bias_grad_by_ones_column(rows: int, in_features: int, out_features: int) -> bool:
    """Whether ``_weight_and_bias_grads`` takes the ones column: where its copies (x into the wider operand, read
    and written: 2 * rows * in; dW out of the wider result: 2 * out * in) move fewer elements than one read of
    dy (rows * out), which any separate bias reduction needs. It pays when the layer widens its input over many
    rows: GPT-2's fc1 over 16k tokens (768 -> 3072) moves 30M elements against 50M (H100: the dense layer's
    forward + backward in 348-350 us of kernels against 364-375 with BGRADB; ``scripts/profile/op_kernels.py
    fused_dense`` gives the kernel time of ``bench ops``' dense GEMM+bias case), not its fc2 (3072 -> 768: 211M
    against 13M)."""
    return 2 * rows * in_features + 2 * out_features * in_features < rows * out_features


def _weight_and_bias_grads(ext, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW, db) of y = x @ W.T + b from one GEMM: dy.T @ [x | 1] (``linear_wgrad_ones``, db in its last column)
    where ``bias_grad_by_ones_column`` takes it, else BGRADB (a dW GEMM slower than the plain one, and a
    reduction kernel of its own)."""
    dw, db = (ext.linear_wgrad_ones(x, dy) if bias_grad_by_ones_column(*x.shape, dy.shape[1])
              else ext.linear_wgrad(x, dy, True))
    return dw, db


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return load_extension().linear_fwd(x, weight, bias, False)[0]


_dense_op = torch.library.custom_op("flash_kernels::fused_dense_fwd", mutates_args=())(_dense)


@_dense_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _dense_bwd(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = load_extension()
    dw, db = _weight_and_bias_grads(ext, x, dy)
    return ext.linear_dgrad(dy, weight, None, False)[0], dw, db


_dense_bwd_op = torch.library.custom_op("flash_kernels::fused_dense_bwd", mutates_args=())(_dense_bwd)


@_dense_bwd_op.register_fake
def _(x, weight, dy):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


def _dense_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _dense_backward_with(bwd):
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return bwd(x, weight, dy.contiguous())

    return backward


_dense_op.register_autograd(_dense_backward_with(_dense_bwd_op), setup_context=_dense_setup)
_dense_eager = eager_function("FusedDense", _dense, _dense_setup, _dense_backward_with(_dense_bwd))


def _mlp(
    x: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor, weight2: torch.Tensor, bias2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = load_extension()
    act, pre = ext.linear_fwd(x, weight1, bias1, True)
    return ext.linear_fwd(act, weight2, bias2, False)[0], act, pre


_mlp_op = torch.library.custom_op("flash_kernels::fused_mlp_gelu_fwd", mutates_args=())(_mlp)


@_mlp_op.register_fake
def _(x, weight1, bias1, weight2, bias2):
    hidden = x.new_empty((x.shape[0], weight1.shape[0]))
    return x.new_empty((x.shape[0], weight2.shape[0])), hidden, torch.empty_like(hidden)


def _mlp_bwd(
    x: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor, act: torch.Tensor, pre: torch.Tensor,
    dy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = load_extension()
    dw2, db2 = _weight_and_bias_grads(ext, act, dy)
    # fc1's bias gradient comes with its weight gradient, not from DGELU_BGRAD here: cuBLASLt
    # runs DGELU_BGRAD as a separate generic kernel (357 us at GPT-2's 16k x 768 -> 3072 on an H100, where
    # the DGELU GEMM alone takes 168 and BGRADB's reduction ~45): forward + backward runs 1.05x torch's autograd
    # this way, 0.85x with DGELU_BGRAD (`flash-models bench ops --only fused_dense`, the MLP case).
    dpre = ext.linear_dgrad(dy, weight2, pre, False)[0]  # (dy @ W2) * gelu'(pre)
    dw1, db1 = _weight_and_bias_grads(ext, x, dpre)
    dx = ext.linear_dgrad(dpre, weight1, None, False)[0]
    return dx, dw1, db1, dw2, db2


_mlp_bwd_op = torch.library.custom_op("flash_kernels::fused_mlp_gelu_bwd", mutates_args=())(_mlp_bwd)


@_mlp_bwd_op.register_fake
def _(x, weight1, weight2, act, pre, dy):
    return (torch.empty_like(x), torch.empty_like(weight1), weight1.new_empty((weight1.shape[0],)),
            torch.empty_like(weight2), weight2.new_empty((weight2.shape[0],)))


def _mlp_setup(ctx, inputs, output):
    x, weight1, _, weight2, _ = inputs
    _, act, pre = output
    ctx.save_for_backward(x, weight1, weight2, act, pre)


def _mlp_backward_with(bwd):
    def backward(ctx, dy, _dact, _dpre):
        x, weight1, weight2, act, pre = ctx.saved_tensors
        return bwd(x, weight1, weight2, act, pre, dy.contiguous())

    return backward


_mlp_op.register_autograd(_mlp_backward_with(_mlp_bwd_op), setup_context=_mlp_setup)
_mlp_eager = eager_function("FusedMLP", _mlp, _mlp_setup, _mlp_backward_with(_mlp_bwd))


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def _check_backend(backend: str | None) -> str:
    if backend == "cuda":
        warnings.warn("fused_dense: backend='cuda' is spelled 'triton' (our kernels), as for every op; 'cuda' will "
                      "stop working", FutureWarning, stacklevel=4)
        return "triton"
    return check_backend_name(backend)


def gemm_unsupported(x: torch.Tensor, feature_dims, dtype: torch.dtype | None = None) -> str | None:
    """Why the extension's GEMMs cannot take input x (cast to ``dtype`` first, if given) with these feature dims,
    or None: CUDA, float16/bfloat16, feature dims that are multiples of 8 (16-byte rows for cuBLASLt), a
    non-empty x, and the extension prebuilt or buildable here. The layers below add their own conditions;
    linear_cross_entropy asks this alone for its epilogue-scaled weight gradient."""
    dtype = x.dtype if dtype is None else dtype
    if x.device.type != "cuda":
        return f"device {x.device.type!r} (needs CUDA)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (supported: float16, bfloat16)"
    if any(d % 8 for d in feature_dims):
        return "feature dims that are not multiples of 8 (cuBLASLt epilogue alignment)"
    if x.numel() == 0:
        return "an empty input"
    return extension_buildable()


def _unsupported(x: torch.Tensor, params: list[torch.Tensor | None], approximate: str) -> str | None:
    if any(p is None for p in params):
        return "a missing bias (the epilogues fuse one)"
    if any(p.dtype != x.dtype for p in params):
        return "parameters whose dtype differs from the input's"
    if approximate != "tanh":
        return f"approximate={approximate!r} (cuBLASLt's GELU is the tanh approximation)"
    return gemm_unsupported(x, [d for p in params if p.dim() == 2 for d in p.shape])


def _use_cuda(backend: str | None, x, params, *, approximate: str = "tanh", op: str) -> bool:
    backend = _check_backend(backend)
    if backend == "reference":
        return False
    reason = _unsupported(x, params, approximate)
    if backend == "auto":
        return reason is None
    if reason is not None:
        raise ValueError(f"{op}: backend='triton' cannot run this input: {reason}. Use backend='auto'.")
    return True


def fused_dense(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str | None = None
) -> torch.Tensor:
    """x @ weight.T + bias with the bias added in the GEMM's epilogue (and its gradient with the weight's, from
    one GEMM: see ``_weight_and_bias_grads``)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"fused_dense: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if not _use_cuda(backend, x, [weight, bias], op="fused_dense"):
        return fused_dense_ref(x, weight, bias)
    y = pick(_dense_op, _dense_eager)(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), bias.contiguous())
    return y.view(*x.shape[:-1], weight.shape[0])


def fused_dense_gelu_dense(
    x: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    *,
    approximate: str = "tanh",
    backend: str | None = None,
) -> torch.Tensor:
    """The GELU MLP fc2(gelu(fc1(x))) on cuBLASLt epilogues (see the module docstring)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"fused_dense_gelu_dense: approximate={approximate!r}; use 'none' or 'tanh'")
    if x.shape[-1] != weight1.shape[1] or weight2.shape[1] != weight1.shape[0]:
        raise ValueError(f"fused_dense_gelu_dense: shapes x {tuple(x.shape)}, weight1 {tuple(weight1.shape)}, "
                         f"weight2 {tuple(weight2.shape)} do not chain")
    params = [weight1, bias1, weight2, bias2]
    if not _use_cuda(backend, x, params, approximate=approximate, op="fused_dense_gelu_dense"):
        return fused_dense_gelu_dense_ref(x, weight1, bias1, weight2, bias2, approximate=approximate)
    y, _, _ = pick(_mlp_op, _mlp_eager)(x.reshape(-1, x.shape[-1]).contiguous(), *(p.contiguous() for p in params))
    return y.view(*x.shape[:-1], weight2.shape[0])

"""Compile the Hopper attention kernels (Gluon) for sm_90 without a GPU, as Triton would at their first launch on
an H100.

Run in a fresh process without TRITON_INTERPRET (under the interpreter the kernels' Gluon helpers are not
compilable functions): ``python -m tests.kernels.hopper_offline_compile HEAD_DIM CAUSAL VARLEN`` compiles the
forward, ``... HEAD_DIM CAUSAL bwd`` the backward. It prints the Triton version and the kernel's shared memory in
bytes (the backward: and whether its dQ sum is a TMA reduce-add), or fails with the compiler's error. The CPU
tests run it so that a Triton whose Gluon API moved (3.7 renamed ``thread_barrier``) is caught without a Hopper
GPU.
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from flash_kernels import attention_hopper as hopper
from flash_kernels import attention_hopper_bwd as hopper_bwd


def signature(kernel, d: int, constexprs: dict) -> dict:
    """Each parameter's type as Triton writes a launch's signature (bf16 tensors)."""
    block_n = hopper.TILES[d][0]

    def descriptor(rows: int) -> str:
        return f"tensordesc<bf16[{rows}, {d}],{hopper._box_layout(rows, d, torch.bfloat16)!r}>"

    types = {"q_desc": descriptor(hopper.BLOCK_M // 2), "o_desc": descriptor(hopper.BLOCK_M // 2),
             "k_desc": descriptor(block_n), "v_desc": descriptor(block_n), "O": "*bf16", "LSE": "*fp32",
             "CuSeq": "*i32", "Next": "*i32", "scale_log2": "fp32"}
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}


def compile_forward(d: int, causal: bool, varlen: bool):
    kernel = hopper._attn_fwd_hopper_kernel
    kernel = getattr(kernel, "jit", kernel)  # the Gluon function behind lean_launch
    block_n, stages = hopper.TILES[d]
    constexprs = dict(HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=hopper.CONSUMER_REGISTERS,
                      PRODUCER_REGS=hopper.PRODUCER_REGISTERS, CAUSAL=causal, VARLEN=varlen,
                      PINGPONG=hopper.PINGPONG, Q_BUFFERS=hopper.Q_BUFFERS)
    source = GluonASTSource(kernel, signature=signature(kernel, d, constexprs),
                            constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=hopper.MAX_REGISTERS))


def compile_backward(d: int, causal: bool):
    """The backward kernel as ``attention_hopper_bwd.attention_backward`` launches it (Triton 3.6: through the PTX
    rewrite hook, which it installs)."""
    kernel = hopper_bwd._attn_bwd_hopper_kernel
    kernel = getattr(kernel, "jit", kernel)
    block_m, stages = hopper_bwd.TILES[d, causal]
    constexprs = dict(CAUSAL=causal, LAST_FIRST=causal in hopper_bwd.LAST_FIRST, STAGES=stages,
                      CONSUMER_REGS=hopper.CONSUMER_REGISTERS, PRODUCER_REGS=hopper.PRODUCER_REGISTERS)

    def descriptor(rows: int, cols: int, dtype: torch.dtype) -> str:
        name = "fp32" if dtype == torch.float32 else "bf16"
        return f"tensordesc<{name}[{rows}, {cols}],{hopper._box_layout(rows, cols, dtype)!r}>"

    types = {"q_desc": descriptor(block_m, d, torch.bfloat16), "do_desc": descriptor(block_m, d, torch.bfloat16),
             "k_desc": descriptor(hopper_bwd.BLOCK_N, d, torch.bfloat16),
             "v_desc": descriptor(hopper_bwd.BLOCK_N, d, torch.bfloat16),
             "dq_desc": descriptor(block_m, d // 2, torch.float32),
             "LSE": "*fp32", "Delta": "*fp32", "DK": "*bf16", "DV": "*bf16", "scale_log2": "fp32", "scale": "fp32"}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    source = GluonASTSource(kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    if hopper_bwd.PTX_REWRITE:
        hopper_bwd._install_reduce_hook()
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=hopper.MAX_REGISTERS))


if __name__ == "__main__":
    head_dim, causal = int(sys.argv[1]), sys.argv[2] == "1"
    if sys.argv[3] == "bwd":
        compiled = compile_backward(head_dim, causal)
        reduces = "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]
        print(f"triton {triton.__version__} shared {compiled.metadata.shared} reduce-add {reduces}")
    else:
        compiled = compile_forward(head_dim, causal, sys.argv[3] == "1")
        print(f"triton {triton.__version__} shared {compiled.metadata.shared}")

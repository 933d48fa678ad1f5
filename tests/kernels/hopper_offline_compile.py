"""Compile the Hopper attention forward for sm_90 without a GPU, as Triton would at its first launch on an H100.

Run in a fresh process without TRITON_INTERPRET (under the interpreter the kernel's Gluon helpers are not
compilable functions): ``python -m tests.kernels.hopper_offline_compile HEAD_DIM CAUSAL VARLEN`` prints the
Triton version and the kernel's shared memory in bytes, or fails with the compiler's error. The CPU tests run it
so that a Triton whose Gluon API moved (3.7 renamed ``thread_barrier``) is caught without a Hopper GPU.
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from flash_kernels import attention_hopper as hopper


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


if __name__ == "__main__":
    head_dim, causal, varlen = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
    compiled = compile_forward(head_dim, causal, varlen)
    print(f"triton {triton.__version__} shared {compiled.metadata.shared}")

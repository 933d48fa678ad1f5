"""The dense backward's dX = dy @ W as a persistent Triton GEMM (TMA descriptors, the tile loop flattened as in
``linear_act``), alone and also writing the column sums of dy (the bias gradient, as one row of partial sums per
row block), against cuBLAS's dy @ W and torch's dy.sum(0). Prints the time of each (CUDA-graph replays) and
each variant's errors against cuBLAS and a float32 sum.

Why: issue 4's dense GEMM+bias row sits at 0.969x torch.compile because the bias gradient costs a pass over dy
(docs/benchmarks.md, Fused ops, session 19). Summing dy inside a GEMM that reads it anyway would hide that pass.
Under Triton 3.6 on an H100 (session 21) neither way of summing paid: on the CUDA cores (``SUMS = 1``) the
pipelined loop returned a wrong dX, and as a second MMA (``SUMS = 2``) the kernel took twice as long. Rerun it
after a Triton upgrade: a correct and fast ``SUMS = 1`` would make the fused backward worth building.

    PYTHONPATH=.:kernels:scripts/profile python scripts/profile/dgrad_bias_sums.py   # on a Hopper GPU
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import flash_kernels.linear_act  # noqa: F401  (the package exports the function under the module's name)
from gemm_rows import graphed_us  # this folder's sibling module

linear_act = sys.modules["flash_kernels.linear_act"]
SHAPES = [(16384, 3072, 768), (16384, 768, 3072), (16384, 4096, 1024)]  # (rows, dy width, dX width)
CONFIGS = [(128, 256, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 128, 64, 4, 4, 2)]  # M, N, K tile, warps, stages, per SM
SUMS_NAMES = {0: "dX", 1: "dX + sums (CUDA cores)", 2: "dX + sums (tensor core)"}


@triton.jit
def _dgrad_kernel(dy_desc, w_desc, dx_desc, Partial, M, NF, KF, NUM_PROGS, SUMS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """dX (M, KF) = dy (M, NF) @ W (NF, KF). SUMS 1 / 2: programs on the first column block also store, for
    each dy tile they load, its column sums into Partial's row of their row block (Partial (blocks_m, NF))."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(KF, BLOCK_N)
    for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = linear_act._tile_coords(tile, blocks_m, blocks_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, NF, BLOCK_K):
            a = dy_desc.load([off_m, r0])
            acc = tl.dot(a, w_desc.load([r0, off_n]), acc)
            cols = r0 + tl.arange(0, BLOCK_K)
            if SUMS == 1:
                if pid_n == 0:
                    tl.store(Partial + pid_m * NF + cols, tl.sum(a.to(tl.float32), 0), mask=cols < NF)
            if SUMS == 2:
                if pid_n == 0:
                    # Row 0 of ones(64, BLOCK_M) @ a (the other rows are zeros; 64 is the MMA's least row
                    # count): only the threads holding row 0 store, so no reduction across threads.
                    rows = tl.arange(0, 64)
                    ones = tl.where(rows[:, None] == 0, 1.0, 0.0).to(a.dtype) + tl.zeros([64, BLOCK_M], a.dtype)
                    tl.store(Partial + pid_m * NF + cols[None, :] + rows[:, None] * 0, tl.dot(ones, a),
                             mask=(rows[:, None] == 0) & (cols[None, :] < NF))
        dx_desc.store([off_m, off_n], acc.to(dx_desc.dtype))


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def dgrad(dy, w, sums, block_m, block_n, block_k, warps, stages, per_sm):
    """(dX, partial column sums of dy) from one launch."""
    m, nf = dy.shape
    kf = w.shape[1]
    dx = torch.empty(m, kf, device=dy.device, dtype=dy.dtype)
    partial = torch.zeros(triton.cdiv(m, block_m), nf, device=dy.device, dtype=torch.float32)
    descriptors = (TensorDescriptor(t, list(t.shape), list(t.stride()), box)
                   for t, box in ((dy, [block_m, block_k]), (w, [block_k, block_n]), (dx, [block_m, block_n])))
    programs = min(torch.cuda.get_device_properties(dy.device).multi_processor_count * per_sm,
                   triton.cdiv(m, block_m) * triton.cdiv(kf, block_n))
    _dgrad_kernel[(programs,)](*descriptors, partial, m, nf, kf, programs, SUMS=sums, BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return dx, partial


def main():
    print(torch.cuda.get_device_name())
    triton.set_allocator(_scratch)
    for m, nf, kf in SHAPES:
        dy = torch.randn(m, nf, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(nf, kf, device="cuda", dtype=torch.bfloat16) / nf**0.5
        with torch.no_grad():
            ref_dx, ref_sums = dy @ w, dy.float().sum(0)
            print(f"dX {m}x{nf} @ {nf}x{kf}: cuBLAS {graphed_us(lambda: dy @ w):.1f} us, dy.sum(0) in float32 "
                  f"{graphed_us(lambda: dy.sum(0, dtype=torch.float32)):.1f} us")
            for config in CONFIGS:
                parts = []
                for sums, name in SUMS_NAMES.items():
                    us = graphed_us(lambda: dgrad(dy, w, sums, *config))
                    dx, partial = dgrad(dy, w, sums, *config)
                    dx_err = (dx.float() - ref_dx.float()).abs().max().item()
                    sums_err = (partial.sum(0) - ref_sums).abs().max().item() if sums else 0.0
                    parts.append(f"{name} {us:.1f} us (dX error {dx_err:.1e}, sums error {sums_err:.1e})")
                print(f"  tile {config}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()

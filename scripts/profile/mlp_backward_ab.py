"""The GELU MLP's backward on cuBLASLt three ways, against torch's autograd, forward + backward timed as CUDA-graph
replays (host cost out) at GPT-2's MLP shape, with each side's kernels listed from torch.profiler.

Why: issue 4 asks fused_dense's GELU MLP for >= 1.1x torch Linear + GELU forward + backward, and it ran at
0.82x; the H200 profile of session 5 showed the DGELU_BGRAD epilogue (fc2's input gradient times gelu'(pre),
with fc1's bias gradient) as a separate generic cuBLASLt kernel, slower than torch's GELU backward plus its
bias reduction. The sides, all with the same forward (GELU_AUX_BIAS for fc1, BIAS for fc2) and fc2's weight
and bias gradients from one BGRADB GEMM:

- dgelu_bgrad: fc1's bias gradient from the DGELU_BGRAD epilogue of fc2's input-gradient GEMM (the path
  before 2026-11-25);
- dgelu+bgradb: the DGELU epilogue alone there, fc1's bias gradient from BGRADB in fc1's weight-gradient GEMM
  (the path since);
- torch_gelu_bwd+bgradb: a plain input-gradient GEMM, torch's GELU backward kernel, then BGRADB as above.

    PYTHONPATH=.:kernels:scripts/profile python scripts/profile/mlp_backward_ab.py   # CUDA GPU; builds fused_dense
"""

import torch
import torch.nn.functional as F

from flash_kernels.fused_dense import load_extension
from gemm_rows import graphed_us  # this folder's sibling scripts
from kernel_table import time_and_profile

SHAPES = [(16384, 768, 3072), (8192, 1024, 4096)]  # tokens, hidden, MLP width: GPT-2 small, GPT-2 medium


def sides(x, w1, b1, w2, b2, dy):
    ext = load_extension()

    def forward():
        act, pre = ext.linear_fwd(x, w1, b1, True)
        return ext.linear_fwd(act, w2, b2, False)[0], act, pre

    def dgelu_bgrad():
        _, act, pre = forward()
        ext.linear_wgrad(act, dy, True)
        dpre, _db1 = ext.linear_dgrad(dy, w2, pre, True)
        ext.linear_wgrad(x, dpre, False)
        ext.linear_dgrad(dpre, w1, None, False)

    def dgelu_then_bgradb():
        _, act, pre = forward()
        ext.linear_wgrad(act, dy, True)
        dpre = ext.linear_dgrad(dy, w2, pre, False)[0]
        ext.linear_wgrad(x, dpre, True)
        ext.linear_dgrad(dpre, w1, None, False)

    def torch_gelu_bwd_then_bgradb():
        _, act, pre = forward()
        ext.linear_wgrad(act, dy, True)
        dact = ext.linear_dgrad(dy, w2, None, False)[0]
        dpre = torch.ops.aten.gelu_backward(dact, pre, approximate="tanh")
        ext.linear_wgrad(x, dpre, True)
        ext.linear_dgrad(dpre, w1, None, False)

    params = [t.detach().requires_grad_() for t in (x, w1, b1, w2, b2)]

    def torch_autograd():
        y = F.linear(F.gelu(F.linear(params[0], params[1], params[2]), approximate="tanh"), params[3], params[4])
        torch.autograd.backward(y, dy)
        for p in params:
            p.grad = None

    return {"torch autograd": torch_autograd, "dgelu_bgrad": dgelu_bgrad, "dgelu+bgradb": dgelu_then_bgradb,
            "torch_gelu_bwd+bgradb": torch_gelu_bwd_then_bgradb}


def main():
    print(torch.cuda.get_device_name())
    for tokens, hidden, width in SHAPES:
        torch.manual_seed(0)
        dev, dt = "cuda", torch.bfloat16
        x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        w1, b1 = torch.randn(width, hidden, device=dev, dtype=dt) * 0.02, torch.randn(width, device=dev, dtype=dt)
        w2, b2 = torch.randn(hidden, width, device=dev, dtype=dt) * 0.02, torch.randn(hidden, device=dev, dtype=dt)
        dy = torch.randn(tokens, hidden, device=dev, dtype=dt)
        fns = sides(x, w1, b1, w2, b2, dy)
        print(f"\n{tokens} x {hidden} -> {width} -> {hidden}, fwd + bwd")
        print("| side | graphed ms | x torch | kernels (us) |")
        print("|---|---|---|---|")
        base = None
        for name, fn in fns.items():
            ms = min(graphed_us(fn) for _ in range(2)) / 1e3
            base = base or ms
            _, kernels = time_and_profile(fn)
            kernels = ", ".join(f"{k[:60]} {us:.0f}" for k, (_, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]))
            print(f"| {name} | {ms:.3f} | {base / ms:.2f} | {kernels} |", flush=True)


if __name__ == "__main__":
    main()

"""Host time of eager norm forward + backward steps with kept kernels launched directly (``_launch.CompiledLaunch``,
tensors passed as addresses) or through Triton's runner (``_RunnerLaunch``, tensors as tensors: the launch path
before session 35). One side per process, so that each process's kernels are kept under one path only:

    for side in runner direct runner direct; do
        PYTHONPATH=.:kernels:scripts/profile python scripts/profile/launch_direct_ab.py $side
    done

Per side, three rounds of: a tiny step (64 x 4096, where the GPU idles: host time alone), then the issue time of
bench ops' norm steps (16384 x 4096; 20 steps queued without a sync, the GPU queue never full), each
after 20 more warm-up steps (``host_cost.host_us``).
"""

import sys

import torch

from flash_kernels import _launch
from host_cost import host_us  # this folder's sibling script


def main(side: str):
    if side == "runner":
        _launch.CompiledLaunch.of = staticmethod(lambda compiled, device: _launch._RunnerLaunch(compiled))
    elif side != "direct":
        raise SystemExit("usage: launch_direct_ab.py {runner|direct}")
    from flash_kernels import rms_norm
    from flash_models.bench.ops import _fwd_bwd_step, norm_cases

    steps = {f"{case.op} 16384x4096": _fwd_bwd_step(case.impls["ours"], case.inputs)
             for case in norm_cases(compile_peer=False)}
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tiny = _fwd_bwd_step(lambda: rms_norm(x, w), [x, w])
    for step in (tiny, *steps.values()):
        for _ in range(5):  # compiles, then keeps each launch (a plan is made the second time a key is seen)
            step()
    for round_ in range(3):
        print(f"{side} round {round_} | rms_norm 64x4096 (host alone) | {host_us(tiny, n=2000):.1f} us", flush=True)
        for name, step in steps.items():
            print(f"{side} round {round_} | {name} | {host_us(step, n=20):.0f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")

"""Norm backward kernel time vs programs per SM and warps, by CUDA-graph replay (GPU time only).
Patches layer_norm.num_programs / _bwd_warps to sweep (clearing the cached launch plan each time); the
current launch is timed last.

    PYTHONPATH=.:kernels python scripts/profile/norm_bwd_sweep.py [N ...]   # on a CUDA GPU; default 768 2048 4096
"""
import sys, torch
import flash_kernels  # noqa
ln = sys.modules['flash_kernels.layer_norm']
dev = torch.device('cuda')
sms = torch.cuda.get_device_properties(dev).multi_processor_count
orig_np, orig_w = ln.num_programs, ln._bwd_warps

def graph_time(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / (5 * reps) * 1e3

for N in [int(a) for a in sys.argv[1:]] or (768, 2048, 4096):
    M = 16384
    h = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(h); dres = torch.randn_like(h)
    w = torch.randn(N, device=dev); mean = torch.randn(M, device=dev); rstd = torch.rand(M, device=dev)
    seed = torch.empty(0, device=dev, dtype=torch.int64)
    for is_rms in (False, True):
        fn_args = (h, dy, None, dres, w, None, mean, rstd, None, seed, 0.0, is_rms, False, not is_rms, False, True, torch.bfloat16, torch.bfloat16)
        res = []
        for per_sm in (2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                ln.num_programs = lambda d, per_sm=per_sm: sms * per_sm
                ln._bwd_warps = lambda block, single, rms_with_residual, warps=warps: warps
                ln._bwd_plan.cache_clear()  # the launch plan is cached per shape
                us = graph_time(lambda: ln._norm_bwd(*fn_args))
                res.append((us, per_sm, warps))
        ln.num_programs, ln._bwd_warps = orig_np, orig_w
        ln._bwd_plan.cache_clear()
        base = graph_time(lambda: ln._norm_bwd(*fn_args))
        res.sort()
        gb = 4 * M * N * 2 / 1e9
        print(f"N={N} rms={is_rms}: current {base:.1f} us ({gb / base * 1e3:.2f} TB/s); best " +
              ", ".join(f"{us:.1f}us p{p} w{w}" for us, p, w in res[:5]))
    # forward too
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16); r = torch.randn_like(x); b = torch.randn(N, device=dev)
    f = lambda: ln._norm_fwd(x, w, b, None, None, r, None, 1e-5, 0.0, False, False, x.dtype, x.dtype, True, False)
    fwd = graph_time(f)
    print(f"N={N} fwd layer_norm+residual {fwd:.1f} us ({4 * M * N * 2 / fwd / 1e3:.2f} TB/s)")

"""Every gemv tile config at LLaMA-1.1B's batch-1 projections, as a decode step runs them: with programmatic
dependent launch (each call starts while the one before runs, prefetching its first weight columns) and with
the fusions the chained block uses (norm prologues, the SwiGLU epilogue, the residual adds). The autotuner
times configs one plain launch at a time, so its pick may not be the fastest in the chain; this shows how far
each projection is from the copy bandwidth with each config (the autotuner's list and EXTRA_SHAPES), and which one the autotuner picked (*).

    PYTHONPATH=.:kernels python scripts/profile/gemv_chain_sweep.py   # on a Hopper GPU, from the repo root

Written in session 11 and not yet run on a GPU.

Session 11 (H100) measured the chained gate/up and down GEMVs at ~70% of the copy bandwidth (21 and 11 us a
layer against 15 and 8 at copy speed): the largest part of what keeps LLaMA-1.1B's batch-1 step from 70% of
its bound.
"""

import importlib

import torch
import triton

from flash_kernels import gemv, programmatic_launch
from flash_models.bench.harness import measure_copy_bandwidth
from gemv_sweep import CALLS, DTYPE, EPS, per_call_us, weight_copies  # this folder's sibling module

gemv_module = importlib.import_module("flash_kernels.gemv")  # the package's ``gemv`` attribute is the function

# Tiles outside the autotuner's list, timed too: one or two output rows per program with the whole row in a few
# loads (many programs per SM, for down's 2048 outputs), and other warp and stage counts for the big tiles.
EXTRA_SHAPES = [(1, 2048, 4, 1), (1, 1024, 2, 2), (2, 2048, 8, 1), (2, 512, 2, 3), (4, 256, 2, 4), (4, 512, 4, 4),
                (8, 256, 2, 4), (8, 512, 4, 2), (16, 256, 8, 2), (16, 512, 8, 2), (32, 128, 4, 3), (64, 64, 4, 4)]


def candidates():
    return gemv_module._configs() + [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                                     for n, k, w, s in EXTRA_SHAPES]

# name: (weight rows, K, gemv keywords besides the weight); gate/up's rows are the packed [gate; up].
PROJECTIONS = {
    "norm + qkv": (2560, 2048, {"norm": True}),
    "o + add": (2048, 2048, {"residual": True}),
    "norm + gate/up + swiglu": (11264, 2048, {"norm": True, "swiglu_output": True}),
    "down + add": (2048, 5632, {"residual": True}),
    "lm head": (32000, 2048, {}),
}


def calls(weights, k, options):
    """CALLS chained gemv calls, one per weight copy, with the block's fusions."""
    n = weights[0].shape[0] // (2 if options.get("swiglu_output") else 1)
    x = torch.randn(1, 1, k, device="cuda", dtype=DTYPE)
    kwargs = {"swiglu_output": options.get("swiglu_output", False)}
    if options.get("norm"):
        kwargs.update(norm_weight=torch.randn(k, device="cuda", dtype=DTYPE), norm_eps=EPS)
    if options.get("residual"):
        kwargs["residual"] = torch.randn(1, 1, n, device="cuda", dtype=DTYPE)
    return lambda: [gemv(x, w, **kwargs, static_weight=True, backend="triton") for w in weights]


def force(config) -> None:
    """Make the one-row kernel launch ``config`` alone (None: the full list, tuned afresh)."""
    kernel = gemv_module._gemv_kernel
    kernel.autotuner.configs = gemv_module._configs() if config is None else [config]
    kernel.autotuner.cache.clear()
    kernel.chosen.clear()


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s, {CALLS} chained calls per graph")
    print("| projection | BLOCK_N x BLOCK_K, warps, stages | us per call | frac of copy bw |")
    print("|---|---|---|---|")
    with torch.no_grad(), programmatic_launch():
        for name, (rows, k, options) in PROJECTIONS.items():
            run = calls(weight_copies(rows, k), k, options)
            force(None)
            per_call_us(run)  # the autotuner's own pick, tuned as in a real first call
            picked = next(iter(gemv_module._gemv_kernel.chosen.values()))[0]
            for config in candidates():
                force(config)
                meta = config.all_kwargs()
                try:
                    us = per_call_us(run)
                except Exception as error:  # a tile that does not compile (registers, shared memory): say so, go on
                    print(f"| {name} | {meta} | failed: {type(error).__name__} | |", flush=True)
                    continue
                star = " *" if all(picked.get(key) == value for key, value in meta.items()) else ""
                print(f"| {name} | {meta['BLOCK_N']} x {meta['BLOCK_K']}, {meta['num_warps']}, "
                      f"{meta['num_stages']}{star} | {us:.2f} | {rows * k * 2 / (us * 1e-6) / copy_bw:.2f} |",
                      flush=True)
    force(None)


if __name__ == "__main__":
    main()

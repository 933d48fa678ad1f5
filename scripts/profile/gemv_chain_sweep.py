"""Every gemv tile at LLaMA-1.1B's batch-1 projections, as a decode step runs them: with programmatic dependent
launch (each call starts while the one before runs, prefetching its first weight columns) and with the fusions
the chained block uses (norm prologues, the SwiGLU epilogue, the residual adds). A chained call
(``static_weight=True``) takes its tile from ``gemv._chain_tile``, a rule set from this sweep's results; this
shows how far each projection is from the copy bandwidth with each tile (the autotuner's list and EXTRA_SHAPES),
and which one the rule picks (*).

    PYTHONPATH=.:kernels python scripts/profile/gemv_chain_sweep.py   # on a Hopper GPU, from the repo root

Why a rule and not the autotuner: the autotuner times each config as a lone launch, and a lone launch's
ranking is not a chained one's (no predecessor to overlap with, no prefetch before the wait).
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


def force(tile) -> None:
    """Make chained calls launch ``tile`` (BLOCK_N, BLOCK_K, warps, stages); None: the rule's own."""
    gemv_module._chain_tile = RULE if tile is None else (lambda n, k, device: tile)


RULE = gemv_module._chain_tile


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s, {CALLS} chained calls per graph")
    print("| projection | BLOCK_N x BLOCK_K, warps, stages | us per call | frac of copy bw |")
    print("|---|---|---|---|")
    with torch.no_grad(), programmatic_launch(early_trigger=True):  # batch 1, as generation runs it
        for name, (rows, k, options) in PROJECTIONS.items():
            run = calls(weight_copies(rows, k), k, options)
            n = rows // (2 if options.get("swiglu_output") else 1)
            picked = RULE(n, k, torch.device("cuda"))
            for config in candidates():
                meta = config.all_kwargs()
                tile = (meta["BLOCK_N"], meta["BLOCK_K"], meta["num_warps"], meta["num_stages"])
                force(tile)
                try:
                    us = per_call_us(run)
                except Exception as error:  # a tile that does not compile (registers, shared memory): say so, go on
                    print(f"| {name} | {tile} | failed: {type(error).__name__} | |", flush=True)
                    continue
                star = " *" if tile == picked else ""
                print(f"| {name} | {tile[0]} x {tile[1]}, {tile[2]}, {tile[3]}{star} | {us:.2f} | "
                      f"{rows * k * 2 / (us * 1e-6) / copy_bw:.2f} |", flush=True)
    force(None)


if __name__ == "__main__":
    main()

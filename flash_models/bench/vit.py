"""`flash-models bench vit`: our VisionTransformer vs timm eager and timm + torch.compile, same weights.

Grid: ViT-B/16 and ViT-L/16 at 224 px, bf16, inference (forward under inference_mode) and training (forward +
backward of cross-entropy on random labels; no optimizer step, the same for all). Sides: ours eager, ours
replayed from CUDA graphs (``use_cuda_graphs`` for inference, the trainer's graphed loss for training), timm
eager and timm + torch.compile. Reports images/s, speedup of ours over each peer, peak memory (not for
ours+graphs: a graph's memory is its private pool, allocated at capture, which a replay's peak does not see),
and our logits' max difference from timm's. The sides are timed in interleaved rounds (``--rounds``), each
reporting its best.

``--dry-run`` runs the whole script on a tiny ViT (32 px) on the CPU in fp32 with a wall-clock timer; add
``--compile`` to include the torch.compile peer there too (slow to compile on a CPU).
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import from_timm
from ..runtime.train_graphs import GraphedLoss
from .harness import BenchResult, add_rounds_argument, best_of_rounds, peak_memory_bytes
from .measure import backward_and_drop_grads, time_fn

log = logging.getLogger(__name__)

COLUMNS = ["model", "batch", "mode", "impl", "ms", "img_s", "x_vs_timm_eager", "x_vs_timm_compile", "peak_MiB", "max_diff"]

MODELS = {"vit-b16": "vit_base_patch16_224", "vit-l16": "vit_large_patch16_224"}
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)


def build_models(name: str, *, dtype, device, dry_run: bool, compile_peer: bool):
    """{impl: model}: ours (eager), ours+graphs (a second instance of ours, replayed from CUDA graphs on CUDA: its
    own, so its captured graphs stay while the other sides are timed between its rounds), timm eager and, if
    asked, timm + torch.compile, all with the same weights."""
    import timm

    torch.manual_seed(0)
    source = timm.create_model(MODELS[name], pretrained=False, **(TINY if dry_run else {}))
    ours = from_timm(source, attn_impl="auto").to(device=device, dtype=dtype)
    source = source.to(device=device, dtype=dtype)
    models = {"ours": ours, "ours+graphs": copy.deepcopy(ours), "timm eager": source}
    if compile_peer:
        models["timm compile"] = torch.compile(source)
    return models


def step_fns(model, images, labels, *, impl: str):
    """(inference, training) step functions of one side. ours+graphs runs inference through
    ``VisionTransformer.use_cuda_graphs`` and training through the trainer's graphed loss
    (``runtime.train_graphs.GraphedLoss``, what ``train.cuda_graphs`` uses); off CUDA both stay eager."""
    ours = impl.startswith("ours")
    graphs = impl == "ours+graphs" and images.is_cuda
    if ours:
        model.use_cuda_graphs(graphs)

    def logits(m, x):
        out = m(x)
        return out.logits if ours else out

    def loss_of(m, batch):
        return F.cross_entropy(logits(m, batch["pixel_values"]).float(), batch["labels"])

    graphed_loss = GraphedLoss(model, loss_of) if graphs else None

    def inference():
        with torch.inference_mode():
            return logits(model, images)

    def training():
        batch = {"pixel_values": images, "labels": labels}
        return backward_and_drop_grads(graphed_loss(batch) if graphed_loss is not None else loss_of(model, batch), model)

    return inference, training


@torch.inference_mode()
def _max_diff(inference_step, reference: torch.Tensor) -> float:
    return (inference_step().float() - reference).abs().max().item()


def bench(result: BenchResult, *, names, batch: int, modes, repeats: int, dtype, device, dry_run: bool, compile_peer: bool,
          rounds: int = 3):
    """Every side of a (model, mode) point is timed in ``rounds`` interleaved rounds, each reporting its best
    (``harness.best_of_rounds``)."""
    cuda = device.type == "cuda"
    for name in names:
        models = build_models(name, dtype=dtype, device=device, dry_run=dry_run, compile_peer=compile_peer)
        config = models["ours"].config
        gen = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, config.image_size, config.image_size, generator=gen).to(device=device, dtype=dtype)
        labels = torch.randint(0, config.num_classes, (batch,), generator=gen).to(device)
        with torch.inference_mode():
            reference = models["timm eager"](images).float()
            diff = (models["ours"](images).logits.float() - reference).abs().max().item()
        for mode in modes:
            steps = {}
            for impl, model in models.items():
                model.train(mode == "training")
                inference, training = step_fns(model, images, labels, impl=impl)
                steps[impl] = inference if mode == "inference" else training
            warmup = 5 if cuda else 1
            times = best_of_rounds({impl: lambda fn=fn: time_fn(fn, device=device, warmup=warmup, repeats=repeats).median_ms
                                    for impl, fn in steps.items()}, rounds)
            rows = {}
            for impl, fn in steps.items():
                ms = times[impl]
                max_diff = None
                if impl.startswith("ours"):  # in inference, of the path just timed (ours+graphs: a replay)
                    max_diff = _max_diff(fn, reference) if mode == "inference" else diff
                rows[impl] = result.add(model=name, batch=batch, mode=mode, impl=impl, ms=ms, img_s=batch / (ms * 1e-3),
                                        peak_MiB=peak_memory_bytes(fn) / 2**20 if cuda and impl != "ours+graphs" else None,
                                        max_diff=max_diff)
            for impl, row in rows.items():
                if impl.startswith("ours"):
                    for peer in ("timm eager", "timm compile"):
                        if peer in rows:
                            row[f"x_vs_{peer.replace(' ', '_')}"] = rows[peer]["ms"] / row["ms"]
            log.info("%s %s: %s", name, mode, {impl: f"{row['ms']:.2f} ms" for impl, row in rows.items()})
        models["ours+graphs"].use_cuda_graphs(False)
        del models
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(prog="flash-models bench vit", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results", help="directory for vit.json")
    p.add_argument("--models", default="vit-b16,vit-l16", help=f"any of {sorted(MODELS)}")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--modes", default="inference,training")
    p.add_argument("--repeats", type=int, default=20)
    add_rounds_argument(p, "model and mode")
    p.add_argument("--no-compile", action="store_true", help="skip the timm + torch.compile peer")
    p.add_argument("--dry-run", action="store_true", help="a tiny ViT on the CPU in fp32: checks the code, not speed")
    p.add_argument("--compile", action="store_true", help="with --dry-run: include the torch.compile peer")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    if args.dry_run:
        device, dtype, batch, repeats, compile_peer = torch.device("cpu"), torch.float32, 4, 2, args.compile
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench vit needs a CUDA GPU (or --dry-run to check the script on a CPU)")
        device, dtype, batch, repeats, compile_peer = torch.device("cuda"), torch.bfloat16, args.batch, args.repeats, not args.no_compile
    result = BenchResult(area="vit")
    result.env.update(dtype=str(dtype).removeprefix("torch."), dry_run=args.dry_run, image_size=224 if not args.dry_run else 32)
    bench(result, names=args.models.split(","), batch=batch, modes=args.modes.split(","), repeats=repeats, dtype=dtype,
          device=device, dry_run=args.dry_run, compile_peer=compile_peer, rounds=args.rounds)
    result.write_json(Path(args.out) / "vit.json")
    print(result.markdown(COLUMNS))
    print(f"\n{result.env}")
    return result


if __name__ == "__main__":
    main()

"""AdamW with decay only on matrices, and warmup + cosine/linear learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimSection
from .distributed import full_tensor, shard_like


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only (2-D and up); biases, norm weights and embedding tables get none.

    Decided by shape, by the owning module being an ``nn.Embedding``, and by the names a model lists in
    ``no_weight_decay()`` (timm's convention: a ViT's class token and position table), so it holds for our
    models, HF's and timm's alike (HF GPT-2's Conv1D matrices decay too; a tied LM head is the embedding table,
    seen once)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):  # its names start with "module."
        model = model.module
    exempt = set(model.no_weight_decay()) if callable(getattr(model, "no_weight_decay", None)) else set()
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{name}" if module_name else name
            matrix = param.dim() >= 2 and not isinstance(module, nn.Embedding) and full_name not in exempt
            (decay if matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def split_by_tensor_kind(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor and its plain-tensor parameters. The fused and foreach AdamW kernels
    take one kind per call (one call per group), and tensor parallelism leaves embeddings, norms and the LM head
    plain next to sharded DTensor matrices. Without DTensors the groups come back unchanged."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in groups:
        for sharded in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) == sharded]
            if params:
                out.append({**group, "params": params})
    return out


def build_optimizer(model: nn.Module, cfg: OptimSection, *, params: list[dict] | None = None) -> torch.optim.AdamW:
    """AdamW; fused (one kernel over every parameter) on CUDA unless ``cfg.fused`` says otherwise."""
    groups = split_by_tensor_kind(params if params is not None else param_groups(model, cfg.weight_decay))
    first = groups[0]["params"][0]
    fused = cfg.fused if cfg.fused is not None else first.device.type == "cuda"
    if fused and first.device.type != "cuda":
        raise ValueError("optim.fused=true needs the parameters on CUDA; set optim.fused=null on the CPU")
    kwargs = {"fused": True} if fused else {"foreach": first.device.type == "cuda"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kwargs)


def lr_lambda(cfg: OptimSection, max_steps: int):
    """Multiplier of the peak lr at a step: linear warmup over ``warmup_steps``, then cosine or linear decay
    to ``min_lr_ratio`` at ``max_steps`` (or constant)."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimSection, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, max_steps))


class MasterWeights:
    """Pure-bf16 training with fp32 master weights: the model holds bf16 parameters (so activations and
    gradients are bf16), the optimizer steps fp32 copies, and each step writes them back rounded to bf16."""

    def __init__(self, model: nn.Module, groups: list[dict]):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                master = nn.Parameter(p.detach().float().clone())
                self.pairs.append((p, master))
                masters.append(master)
            self.groups.append({**group, "params": masters})

    def grads_to_master(self) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, master in self.pairs:
            p.copy_(master)

    def masters(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def state_dict(self) -> list[torch.Tensor]:
        """The masters whole (tensor-parallel shards gathered: a collective, every rank calls)."""
        return [full_tensor(m.detach()).clone() for m in self.masters()]

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        for m, saved in zip(self.masters(), state, strict=True):
            m.copy_(shard_like(saved, m))

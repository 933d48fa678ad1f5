"""Training utilities: FLOPs/MFU, gradient norm and clipping (plain, DDP, FSDP and TP parameters alike), an
exponential moving average of the weights, and the metrics log (JSONL, optional TensorBoard)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from .distributed import full_tensor, shard_like, state_dict_names

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------
def model_dims(model: nn.Module) -> tuple[int, int] | None:
    """(layers, hidden) for the attention term of the FLOPs count: ours (decoder_config) or an HF config."""
    dc = getattr(model, "decoder_config", None)
    if dc is not None:
        return dc.num_layers, dc.hidden_size
    hf = getattr(model, "config", None)
    layers = getattr(hf, "num_hidden_layers", None) or getattr(hf, "n_layer", None)
    hidden = getattr(hf, "hidden_size", None) or getattr(hf, "n_embd", None)
    return (layers, hidden) if layers and hidden else None


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matmuls: all but learned position tables (a lookup: ours
    ``embed.positions``, HF's ``wpe`` / ``position_embeddings``). Tied tables count once (the LM head)."""
    total = 0
    for name, p in model.named_parameters():  # named_parameters yields a shared parameter once
        if "position" in name or name.endswith("wpe.weight"):
            continue
        total += p.numel()
    return total


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, 6 N + 12 L D S (forward + backward; DESIGN.md's convention)."""
    dims = model_dims(model)
    attn = 12 * dims[0] * dims[1] * seq_len if dims else 0
    return 6.0 * matmul_params(model) + attn


def measure_matmul_peak(device: torch.device, dtype: torch.dtype | None = None) -> float:
    """Achieved FLOP/s of a large square matmul on ``device`` (bf16 on CUDA, fp32 on the CPU): the MFU peak."""
    if device.type == "cuda":
        dtype, n, reps = dtype or torch.bfloat16, 8192, 20
    else:
        dtype, n, reps = dtype or torch.float32, 1024, 3
    gen = torch.Generator(device).manual_seed(0)  # its own generator: training's RNG stream stays untouched
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(2):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients, in float32. DTensor gradients (FSDP2 shards, TP shards) reduce across
    ranks; plain ones take one fused multi-tensor kernel per device and dtype instead of a launch per tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(hasattr(g, "full_tensor") for g in grads):
        norms = [full_tensor(torch.linalg.vector_norm(g.float())) for g in grads]
    else:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are multiplied by so that their norm ``total`` is at most ``max_norm`` (<= 1)."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    total = grad_norm(params)
    if max_norm is not None and max_norm > 0:
        coef = clip_coefficient(total, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        if any(hasattr(g, "full_tensor") for g in grads):
            for g in grads:
                g.mul_(coef.to(g.device))
        else:
            torch._foreach_mul_(grads, coef)
    return total


# ------------------------------------------------------------------------------------------------------------
class EMA:
    """Exponential moving average of the weights in float32: ema = decay * ema + (1 - decay) * w after each
    step. ``swapped_in(model)`` evaluates with the averaged weights and restores the trained ones."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        params = state_dict_names(model)
        self.names = [n for n, p in params.items() if p.requires_grad]
        self.shadow = [params[n].detach().float().clone() for n in self.names]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        params = state_dict_names(model)
        for name, s in zip(self.names, self.shadow):
            s.lerp_(params[name].detach().float(), 1.0 - self.decay)

    @torch.no_grad()
    def swap(self, model: nn.Module) -> None:
        """Exchange the model's weights and the averages (call twice to restore)."""
        params = state_dict_names(model)
        for i, name in enumerate(self.names):
            p = params[name]
            kept = p.detach().float().clone()
            p.copy_(self.shadow[i])
            self.shadow[i] = kept

    def state_dict(self) -> dict:
        return {"decay": self.decay, "names": self.names, "shadow": [full_tensor(s) for s in self.shadow]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state["names"] != self.names:
            raise ValueError("the checkpoint's EMA covers different parameters than this model")
        for s, saved in zip(self.shadow, state["shadow"]):
            s.copy_(shard_like(saved, s))  # a DTensor shard takes this rank's part of the full tensor


# ------------------------------------------------------------------------------------------------------------
class MetricsLog:
    """One JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard when asked. ``fresh``: a run from
    step 0, whose log replaces an earlier run's."""

    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool, fresh: bool = False):
        self.enabled = enabled
        self.file = None
        self.writer = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = (output_dir / "metrics.jsonl").open("w" if fresh else "a")  # a resumed run continues its log
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("train.tensorboard=true needs TensorBoard: pip install tensorboard") from None
            self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()

"""Distributed training, always launched by torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR):

- ``ddp``: torch DDP, optionally with torch.distributed's own bf16 gradient-compression comm hook;
- ``fsdp``: FSDP2 ``fully_shard`` per block then the root, with a bf16 MixedPrecisionPolicy for precision=bf16
  (the sharded fp32 parameters are the master weights);
- ``tp``: DTensor tensor parallelism over all ranks with ``parallelize_module``: column-wise qkv and MLP input
  projections, row-wise output projections; embeddings, norms and the LM head stay replicated.

Fused projections and column-wise sharding. Our Attention keeps q, k and v in one Linear whose output rows
are [q (Hq*D); k (Hkv*D); v (Hkv*D)], and GatedMLP keeps [gate (I); up (I)]. ColwiseParallel gives rank r the
r-th contiguous block of rows, which for the fused layout would hand rank 0 all of q and nothing of v. Before
sharding we therefore permute the rows so that each rank's contiguous block is [q_r; k_r; v_r] (its own heads,
whole) or [gate_r; up_r]; the module then runs unchanged on its local heads (its config is narrowed to
Hq/tp, Hkv/tp heads) and SwiGLU splits the local [gate_r; up_r] in halves as usual. The permutation is
recorded on the model and undone when the full state dict is exported (``export_state_dict``), so
save_pretrained writes the canonical HF layout; training checkpoints save the canonical rows too
(``tp_row_layout``), so they resume under any strategy and tensor-parallel size. Requirement: Hq, Hkv and
the MLP width divisible by the TP size (``check_tp``).

A 2-GPU NCCL run (not made here; see scripts/train_2gpu.sh):
    torchrun --standalone --nproc-per-node 2 -m flash_models train configs/gpt2-small.yaml distributed.strategy=ddp
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class DistState:
    strategy: str = "none"
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object = None  # DeviceMesh for fsdp / tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return 0 if self.strategy == "tp" else self.rank

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each reads different data. Tensor-parallel ranks all read the same batch."""
        return 1 if self.strategy in ("none", "tp") else self.world

    @property
    def initialized(self) -> bool:
        return self.world > 1 or dist.is_initialized()


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"train.device={name!r} is not a device torch knows; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu (or auto)")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def launched_world() -> int:
    """How many processes the launcher (torchrun) started for this run; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(strategy: str, device_name: str) -> DistState:
    if strategy == "none":
        if launched_world() > 1:  # every process would train alone and write the same output_dir
            raise ValueError(
                f"this process is one of {launched_world()} that torchrun started, and distributed.strategy='none' "
                "would train a separate copy in each, all writing the same train.output_dir; set "
                "distributed.strategy=ddp (or fsdp, tp), or run one process without torchrun"
            )
        return DistState(device=pick_device(device_name))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"distributed.strategy={strategy!r} runs under torchrun, e.g. "
            f"torchrun --standalone --nproc-per-node 2 -m flash_models train CONFIG distributed.strategy={strategy}"
        )
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    mesh = None
    if strategy in ("fsdp", "tp"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    return DistState(strategy=strategy, rank=rank, world=world, local_rank=local_rank, device=device, mesh=mesh)


def all_reduce_sum(value: torch.Tensor, state: DistState) -> torch.Tensor:
    """Sum over data-parallel ranks (a no-op for one process and for pure TP)."""
    if state.dp_world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier(state: DistState) -> None:
    if state.initialized and dist.is_initialized():
        dist.barrier()


# Seconds the closing ranks wait, with the GIL free, for the backend's worker threads to let go of their last
# collective before the interpreter may start shutting down (see leave_process_group).
SETTLE_SECONDS = 0.2


def leave_process_group() -> None:
    """End this process's part in a run that went well: a collective, every rank calls it after its last one.

    Why not a bare ``destroy_process_group()`` before exit: a collective's backend worker thread (gloo's
    ``pt_gloo_runloop``) drops its reference to the finished work, and with it the work's tensors, only after
    the caller's ``wait()`` has returned. When the caller's Python references to those tensors are gone by then
    (``all_gather_object``'s buffers, for one), that drop takes the GIL. If the main thread has reached
    interpreter shutdown in the meantime, CPython ends the worker thread inside ``take_gil`` with
    ``pthread_exit``, whose unwinding through torch's noexcept destructor calls std::terminate: the process
    dies with SIGABRT ("terminate called without an active exception") after a run that succeeded.
    ``destroy_process_group`` does not stop those threads (they end with the group's last reference, and a
    DDP model keeps references that outlive it), so the barrier and a short wait without the GIL give them
    the time to finish first. This narrows torch's race; it cannot close it from outside torch."""
    dist.barrier()
    time.sleep(SETTLE_SECONDS)
    dist.destroy_process_group()


def teardown(state: DistState, *, failed: bool = False) -> None:
    """Leave the process group a distributed run made. After a failure, without the closing barrier: the other
    ranks may never reach it, and this rank would wait there instead of exiting with its error."""
    if state.strategy == "none" or not dist.is_initialized():
        return
    if failed:
        dist.destroy_process_group()
    else:
        leave_process_group()


# ------------------------------------------------------------------------------------------------------------
def apply_ddp(model: nn.Module, state: DistState, *, bf16_compress: bool) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[state.device.index] if state.device.type == "cuda" else None)
    if bf16_compress:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    return ddp


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], state: DistState, *, bf16: bool, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=state.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=state.mesh, mp_policy=policy)
    return model


def reshard(model: nn.Module) -> None:
    """An FSDP2 model's parameters back to their sharded DTensors. A forward that no backward follows (an
    evaluation) leaves the root's unsharded, and with ``fsdp_reshard_after_forward=false`` every block's too;
    code that reads the parameters afterwards (the EMA's swap, a checkpoint) expects the shards."""
    if not dist.is_initialized():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fused_row_order(sizes: list[int], tp: int) -> torch.Tensor:
    """Row permutation of a fused projection with parts of ``sizes`` rows so that rank r's contiguous block
    (of sum(sizes)/tp rows) holds the r-th slice of every part, in order: [a_r; b_r; c_r]."""
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    order = []
    for r in range(tp):
        for start, size in zip(starts, sizes):
            piece = size // tp
            order.extend(range(start + r * piece, start + (r + 1) * piece))
    return torch.tensor(order)


@torch.no_grad()
def _permute_rows(linear: nn.Linear, order: torch.Tensor) -> None:
    linear.weight.copy_(linear.weight[order.to(linear.weight.device)])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order.to(linear.bias.device)])


def tp_plan(block: nn.Module) -> dict:
    """The parallelize_module plan of one of our pre-norm blocks (GPT-2: fc1/fc2; LLaMA: gate_up/down)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"attn.qkv": ColwiseParallel(), "attn.out_proj": RowwiseParallel()}
    if hasattr(block.mlp, "gate_up"):
        plan.update({"mlp.gate_up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    else:
        plan.update({"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return plan


def check_tp(model: nn.Module, tp: int) -> None:
    """ValueError, before any work, unless ``tp`` tensor-parallel ranks can split ``model``: our decoder's blocks
    with the query and kv heads and the MLP width divisible by ``tp``. Every rank raises it alike (no rank is
    left waiting for the others)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not hasattr(model, "decoder_config"):
        raise ValueError(f"distributed.strategy='tp' splits our decoder models (GPT-2, LLaMA families), not a "
                         f"{type(model).__name__}; use distributed.strategy=ddp or fsdp")
    parts = {}
    for block in blocks:
        width = block.mlp.gate_up.out_features // 2 if hasattr(block.mlp, "gate_up") else block.mlp.fc1.out_features
        for name, count in (("query heads", block.attn.cfg.num_heads), ("kv heads", block.attn.cfg.num_kv_heads),
                            ("MLP width", width)):
            parts.setdefault(name, count)
            assert parts[name] == count, f"blocks differ in their {name}"
    bad = [f"{name} {count}" for name, count in parts.items() if count % tp]
    if bad:
        fitting = [n for n in range(2, max(parts.values()) + 1) if all(count % n == 0 for count in parts.values())]
        raise ValueError(f"distributed.strategy='tp' over {tp} ranks splits the heads and the MLP width evenly, and "
                         f"{type(model).__name__}'s {', '.join(bad)}: not divisible by {tp}; launch a number of ranks "
                         f"(torchrun --nproc-per-node) that divides them all ({fitting or 'none above 1'}), or use "
                         "distributed.strategy=ddp or fsdp")


def apply_tp(model: nn.Module, state: DistState) -> nn.Module:
    """Tensor-parallel blocks of our decoder (see the module docstring for the fused-row permutation)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = state.world
    check_tp(model, tp)
    orders: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        cfg = block.attn.cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        orders[f"blocks.{i}.attn.qkv"] = fused_row_order([q_dim, kv_dim, kv_dim], tp)
        _permute_rows(block.attn.qkv, orders[f"blocks.{i}.attn.qkv"])
        if hasattr(block.mlp, "gate_up"):
            inter = block.mlp.gate_up.out_features // 2
            orders[f"blocks.{i}.mlp.gate_up"] = fused_row_order([inter, inter], tp)
            _permute_rows(block.mlp.gate_up, orders[f"blocks.{i}.mlp.gate_up"])
        parallelize_module(block, state.mesh, tp_plan(block))
        block.attn.cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp)
    model.tp_row_orders = orders
    return model


# ------------------------------------------------------------------------------------------------------------
def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls, in the same order); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` split as the DTensor ``like`` is (this rank's part, as a DTensor); for a plain ``like``, ``full``."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device_mesh.device_type), like.device_mesh, like.placements)


def export_state_dict(model: nn.Module, state: DistState) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict on the CPU in the canonical row layout (collective: every rank calls), a copy:
    the weights changing afterwards (the EMA's swapped in) leave it as it was."""
    if state.strategy == "none":
        sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if state.device.type == "cpu":  # offloading a CPU tensor keeps it: DDP's would be the live weights
            sd = {k: v.clone() for k, v in sd.items()}
    return tp_row_layout(sd, model, canonical=True)


def tp_row_layout(tensors: dict, model: nn.Module, *, canonical: bool) -> dict:
    """``tensors`` (full tensors by state-dict name, or dicts of them: an optimizer's state) with the rows of the
    fused projections that ``apply_tp`` permuted put in the canonical order (``canonical=True``: what HF and the
    other strategies hold) or in this model's tensor-parallel order; other entries as they are. A model without
    tensor parallelism gives them back unchanged."""
    out = dict(tensors)
    for prefix, order in getattr(unwrap(model), "tp_row_orders", {}).items():
        index = torch.argsort(order) if canonical else order
        for name in (prefix + ".weight", prefix + ".bias"):
            if name in out:
                out[name] = _rows(out[name], index)
    return out


def _rows(value, index: torch.Tensor):
    if isinstance(value, dict):
        return {key: _rows(v, index) for key, v in value.items()}
    if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == len(index):  # not Adam's step count
        return value[index.to(value.device)]
    return value


def state_dict_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters by their state-dict names, without DDP's ``module.`` and the activation-checkpoint
    wrapper's prefix (what a checkpoint calls them, whatever wraps the model)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return {name.replace(_CHECKPOINT_PREFIX, ""): p for name, p in unwrap(model).named_parameters()}


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel) else model
